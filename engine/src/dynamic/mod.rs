//! Dynamic tables: tables whose keys are not known in advance. Workers address a dynamic table
//! by raw ids — any `u64`: user and item ids, hashed feature strings — and a key exists once it
//! was first touched, anywhere in the cluster.
//!
//! The design is the *managed-collision* remapping that TorchRec's `ManagedCollisionCollection`
//! and Monolith's collisionless tables use, fitted to Ferry's dense store: each node keeps a
//! fixed number of dense *slots keys* for the table ([`DynamicSpec::capacity`] per node, in
//! its registered arenas as any table's keys), and every raw id is mapped, once and for the
//! cluster, to one of them. So relocation, one-sided reads, updaters, codecs, intent and the
//! protocol's consistency work on the slot keys unchanged; only the mapping is new.
//!
//! - **The id's home decides.** Each id has a home node, a seeded hash of the id over the
//!   ranks (through the stand-in of a lost rank, as every home). The home holds the
//!   authoritative id → slot-key index of its ids and hands out slot keys from its own range
//!   (`rank × capacity ..`, whose keys it is the home of too). A key first touched on two
//!   nodes at once is created once: both ask its home (ASSIGN), which creates it under its
//!   index's lock and answers both with the same slot key.
//! - **Initialised on creation**, at the home, deterministically from the id: zeros, or a
//!   uniform or normal draw from a seeded hash of the id and the element's index
//!   ([`Init`]), whichever node touched it first. An updater's state starts as in any slot.
//! - **Known ids are looked up locally.** Every node keeps the ids it learnt (its own home's
//!   and the answers of other homes) in a sharded index; a known id costs one hash lookup
//!   under a read latch before the dense path, an unknown one a round trip to its home.
//!
//! - **Evicted in rounds** when a home runs short of slot keys or an id outlives its time to
//!   live ([`Eviction`], module `evict`).
//! - **Hot ids replicated** (NuPS) by id ([`crate::TableSpec::replicating_ids`]): each home
//!   sets aside the first slot keys of its range for them (`replicated_slots`), known to
//!   every node from the start and never evicted; the slot-key table replicates those keys.
//!
//! What is not built yet (refused with a reason where it would be wrong): backups of dynamic
//! tables (the index would be lost with its node), replicated ranges of slot keys set by the
//! caller, and feature hashing on a dynamic table.

mod evict;
pub(crate) mod spill;

use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

pub use evict::Eviction;
pub(crate) use evict::{Evictor, Grace, Pin, Pins, ROUND_IDS};
pub use spill::{SpillFile, read_spill};

use parking_lot::RwLock;

use crate::error::{Error, Result};
use crate::hashing::mix;

/// `Eq` and `Hash` for a rule with floats in it, by its `bits()`: floats compared bit for
/// bit, so that a rule equals itself and hashes alike wherever it is read.
macro_rules! equal_by_bits {
    ($rule:ty) => {
        impl PartialEq for $rule {
            fn eq(&self, other: &$rule) -> bool {
                self.bits() == other.bits()
            }
        }

        impl Eq for $rule {}

        impl Hash for $rule {
            fn hash<H: Hasher>(&self, state: &mut H) {
                self.bits().hash(state);
            }
        }
    };
}

/// How a dynamic table's values start when their id is first touched.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// Every element 0.
    Zeros,
    /// Each element uniform in `[-scale, scale)`, from a seeded hash of the id and its index.
    Uniform {
        /// Half the width of the interval.
        scale: f32,
        /// Seed of the hash.
        seed: u64,
    },
    /// Each element normal with mean 0 and deviation `std`, from a seeded hash of the id and
    /// its index.
    Normal {
        /// Standard deviation.
        std: f32,
        /// Seed of the hash.
        seed: u64,
    },
}

impl Init {
    /// The rule's parts as bits, for equality and hashing (floats compared bit for bit).
    fn bits(&self) -> (u8, u32, u64) {
        match *self {
            Init::Zeros => (0, 0, 0),
            Init::Uniform { scale, seed } => (1, scale.to_bits(), seed),
            Init::Normal { std, seed } => (2, std.to_bits(), seed),
        }
    }

    /// Fills `out` with the initial value of `id`: the same on every node and in every run.
    pub fn fill(&self, id: u64, out: &mut [f32]) {
        match *self {
            Init::Zeros => out.fill(0.0),
            Init::Uniform { scale, seed } => {
                for (i, v) in out.iter_mut().enumerate() {
                    *v = (unit(id, seed, i as u64) * 2.0 - 1.0) as f32 * scale;
                }
            }
            Init::Normal { std, seed } => {
                for (i, v) in out.iter_mut().enumerate() {
                    // Box–Muller from two independent uniforms in (0, 1].
                    let u1 = 1.0 - unit(id, seed, 2 * i as u64);
                    let u2 = unit(id, seed, 2 * i as u64 + 1);
                    *v = ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32 * std;
                }
            }
        }
    }

    /// The rule as [`Init::from_str`](std::str::FromStr) reads it.
    pub fn name(&self) -> String {
        match self {
            Init::Zeros => "zeros".into(),
            Init::Uniform { scale, seed } => format!("uniform:{scale}:{seed}"),
            Init::Normal { std, seed } => format!("normal:{std}:{seed}"),
        }
    }
}

equal_by_bits!(Init);

/// A uniform draw in `[0, 1)` from `id`, `seed` and `index`.
fn unit(id: u64, seed: u64, index: u64) -> f64 {
    let bits = mix(mix(id ^ seed).wrapping_add(index.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

impl std::str::FromStr for Init {
    type Err = String;

    /// `zeros`, `uniform:SCALE[:SEED]` or `normal:STD[:SEED]` (seed 0 when left out).
    fn from_str(s: &str) -> std::result::Result<Init, String> {
        let mut parts = s.trim().split(':');
        let kind = parts.next().unwrap_or_default();
        let number = |p: Option<&str>, what: &str| -> std::result::Result<f32, String> {
            let text = p.ok_or_else(|| format!("'{s}': {kind} needs a {what}"))?;
            let v: f32 = text.parse().map_err(|_| format!("'{s}': the {what} '{text}' is not a number"))?;
            if v.is_finite() && v >= 0.0 { Ok(v) } else { Err(format!("'{s}': the {what} must be finite and at least 0")) }
        };
        let seed = |p: Option<&str>| -> std::result::Result<u64, String> {
            p.map_or(Ok(0), |t| t.parse().map_err(|_| format!("'{s}': the seed '{t}' is not a number")))
        };
        let init = match kind {
            "zeros" => Init::Zeros,
            "uniform" => Init::Uniform { scale: number(parts.next(), "scale")?, seed: seed(parts.next())? },
            "normal" => Init::Normal { std: number(parts.next(), "standard deviation")?, seed: seed(parts.next())? },
            _ => return Err(format!("'{s}': expected zeros, uniform:SCALE[:SEED] or normal:STD[:SEED]")),
        };
        match parts.next() {
            Some(extra) => Err(format!("'{s}': unexpected '{extra}'")),
            None => Ok(init),
        }
    }
}

/// Which new ids a home creates ([`crate::TableSpec::admitting`]). An id not admitted yet has
/// no slot key: pulls read its initial value, and its pushes are counted at its home, not
/// stored (Paddle's count and probability filters; Monolith's frequency filtering).
#[derive(Debug, Clone, Copy)]
pub enum Admission {
    /// Every id, when first touched (the default).
    All,
    /// An id once it was pushed `pushes` times. The counts are kept in a count-min sketch at
    /// the home (4 rows of `2 × capacity` counters, at least 1 024), so an id may be admitted
    /// early when it shares counters with busy ids, never late.
    Count {
        /// Pushes that admit an id.
        pushes: u32,
    },
    /// Each push of an id not admitted yet admits it with probability `p` (drawn from a
    /// seeded sequence at its home).
    Probability {
        /// The chance of a push to admit its id.
        p: f32,
        /// Seed of the draws.
        seed: u64,
    },
}

impl Admission {
    fn bits(&self) -> (u8, u32, u64) {
        match *self {
            Admission::All => (0, 0, 0),
            Admission::Count { pushes } => (1, pushes, 0),
            Admission::Probability { p, seed } => (2, p.to_bits(), seed),
        }
    }

    /// The rule as [`Admission::from_str`](std::str::FromStr) reads it.
    pub fn name(&self) -> String {
        match self {
            Admission::All => "all".into(),
            Admission::Count { pushes } => format!("count:{pushes}"),
            Admission::Probability { p, seed } => format!("probability:{p}:{seed}"),
        }
    }
}

equal_by_bits!(Admission);

impl std::str::FromStr for Admission {
    type Err = String;

    /// `all`, `count:N` (N ≥ 1) or `probability:P[:SEED]` (0 < P ≤ 1).
    fn from_str(s: &str) -> std::result::Result<Admission, String> {
        let mut parts = s.trim().split(':');
        let admission = match (parts.next().unwrap_or_default(), parts.next(), parts.next()) {
            ("all", None, None) => Admission::All,
            ("count", Some(n), None) => match n.parse::<u32>() {
                Ok(pushes) if pushes >= 1 => Admission::Count { pushes },
                _ => return Err(format!("'{s}': count:N needs a number of pushes of at least 1")),
            },
            ("probability", Some(p), seed) => {
                let p: f32 = p.parse().map_err(|_| format!("'{s}': the probability '{p}' is not a number"))?;
                if !(p > 0.0 && p <= 1.0) {
                    return Err(format!("'{s}': the probability must be above 0 and at most 1"));
                }
                let seed = seed.map_or(Ok(0), |t| t.parse().map_err(|_| format!("'{s}': the seed '{t}' is not a number")))?;
                Admission::Probability { p, seed }
            }
            _ => return Err(format!("'{s}': expected all, count:N or probability:P[:SEED]")),
        };
        match parts.next() {
            Some(extra) => Err(format!("'{s}': unexpected '{extra}'")),
            None => Ok(admission),
        }
    }
}

/// What an asker means to do with ids it asks the home of (the ASSIGN's flags): an id not
/// admitted yet is created only for a write that admits it, or for a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Intent {
    /// A pull, localize or intent: creates nothing under an admission filter.
    Read = 0,
    /// A push or push-pull: counts toward admission.
    Write = 1,
    /// A set: creates the id whatever the filter says (its value is given).
    Force = 2,
    /// A read of what the table holds ([`crate::Worker::pull_held`]): creates nothing under
    /// any admission, is no use of the ids for eviction, and rescues no id an eviction round
    /// offers (it reads as not held).
    Peek = 3,
}

impl Intent {
    /// The intent of an ASSIGN's flags byte.
    pub fn of(flags: u8) -> Option<Intent> {
        match flags {
            0 => Some(Intent::Read),
            1 => Some(Intent::Write),
            2 => Some(Intent::Force),
            3 => Some(Intent::Peek),
            _ => None,
        }
    }
}

/// What a home answers for one id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Assigned {
    /// Its slot key.
    Key(u64),
    /// It is new and the home's share of slot keys is used up.
    Full,
    /// It is new and the admission filter did not admit it (yet).
    NotAdmitted,
}

/// Counters of pushes to ids not admitted yet (a count-min sketch with conservative update).
struct Sketch {
    counters: Vec<u32>,
    mask: usize,
}

/// Rows of a [`Sketch`].
const SKETCH_ROWS: usize = 4;

impl Sketch {
    fn new(capacity: u64) -> Sketch {
        let width = (capacity.saturating_mul(2) as usize).clamp(1024, 1 << 24).next_power_of_two();
        Sketch { counters: vec![0; SKETCH_ROWS * width], mask: width - 1 }
    }

    /// The counters of `id`, one a row.
    fn cells(&self, id: u64) -> [usize; SKETCH_ROWS] {
        std::array::from_fn(|r| r * (self.mask + 1) + (mix(id ^ (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) as usize & self.mask))
    }

    /// Counts one push of `id`; returns its count (at least the true count).
    fn add(&mut self, id: u64) -> u32 {
        self.add_n(id, 1)
    }

    /// Counts `n` of `id`; returns its count (at least the true count).
    fn add_n(&mut self, id: u64, n: u32) -> u32 {
        let at = self.cells(id);
        let least = at.iter().map(|&i| self.counters[i]).min().unwrap_or(0).saturating_add(n);
        for i in at {
            self.counters[i] = self.counters[i].max(least);
        }
        least
    }

    /// The count of `id` (at least its true count).
    fn estimate(&self, id: u64) -> u32 {
        self.cells(id).iter().map(|&i| self.counters[i]).min().unwrap_or(0)
    }

    /// Halves every count, so that uses long past fade.
    fn halve(&mut self) {
        for c in &mut self.counters {
            *c /= 2;
        }
    }
}

/// Where a table evicts: the uses of its home's ids, counted as eviction rounds close, in a
/// count-min sketch that outlives the ids (TinyLFU's idea): an evicted id that comes back
/// starts with the uses it had, so that an id of middling frequency is not taken for a new,
/// rare one. Halved each time `10 × capacity` uses were added.
struct History {
    sketch: Sketch,
    added: u64,
    period: u64,
}

impl History {
    fn new(capacity: u64) -> History {
        History { sketch: Sketch::new(capacity), added: 0, period: capacity.saturating_mul(10).max(1024) }
    }

    /// `n` more uses of `id`.
    fn add(&mut self, id: u64, n: u64) {
        if n == 0 {
            return;
        }
        self.sketch.add_n(id, n.min(u32::MAX as u64) as u32);
        self.added = self.added.saturating_add(n);
        if self.added >= self.period {
            self.sketch.halve();
            self.added /= 2;
        }
    }

    /// The use count a (re)created `id` starts with: one, and the uses it had.
    fn starting_uses(&self, id: u64) -> u64 {
        (1 + self.sketch.estimate(id) as u64).min(COUNT_MAX)
    }
}

/// A home's state for creating ids: the next slot key of its range never used (counted from
/// its start), what its admission filter keeps, and its eviction's: the id of each slot handed
/// out, the slots freed, the ids offered in the open round, the clock hand.
struct HomeState {
    next: u64,
    sketch: Option<Sketch>,
    draws: u64,
    /// Where the table evicts, per slot handed out (by offset in the range): its id, `None`
    /// once freed.
    slot_ids: Vec<Option<u64>>,
    /// Offsets of freed slots, taken before `next`.
    free: Vec<u64>,
    /// Ids offered in the open round.
    offered: crate::util::FastMap<u64, Offered>,
    /// Turns the clock hand went round.
    turns: u64,
    /// Where the clock hand stands (an offset).
    hand: u64,
    /// Ids created and evicted so far.
    created: u64,
    evicted: u64,
    /// New ids not created because the home was full while it evicts.
    deferred: u64,
    /// Slot keys of evicted ids not written back yet (not held here when their round
    /// closed), with the ids that had them.
    stranded: Vec<(u64, u64)>,
    /// `deferred` when the last round began.
    deferred_before: u64,
    /// Where the table evicts: its ids' uses, beyond their lifetimes.
    history: Option<History>,
    /// The use count at or under which the last round offered ids: new ids used no more are
    /// not admitted while the home is short of room.
    admit_above: u64,
    /// New ids not admitted for that.
    filtered: u64,
}

/// A home's admission state as a checkpoint keeps it ([`IdIndex::admission_state`]): the
/// counters of the count filter's sketch of pushes, of eviction's history of uses (each empty
/// where the table has none), the uses added to the history since it was last halved, and the
/// use count under which the last round offered ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AdmissionState {
    pub pushes: Vec<u32>,
    pub uses: Vec<u32>,
    pub uses_added: u64,
    pub admit_above: u64,
}

/// What makes a table dynamic ([`crate::TableSpec::dynamic`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DynamicSpec {
    /// Ids each node can hold as a home: its share of slot keys. The table has
    /// `capacity × nodes` slot keys in all.
    pub capacity: u64,
    /// How a new id's value starts.
    pub init: Init,
    /// Seed of the hash that gives each id its home.
    pub seed: u64,
    /// Which new ids a home creates.
    pub admission: Admission,
    /// When homes evict ids.
    pub eviction: Eviction,
}

impl DynamicSpec {
    /// The home rank of `id` among `nodes` (before a lost rank's stand-in takes its place):
    /// the node that creates it, and whose share of slot keys it takes.
    #[inline]
    pub fn home_of(&self, id: u64, nodes: usize) -> usize {
        id_home(self.seed, id, nodes)
    }
}

/// The home rank of `id` among `nodes` for a table whose homes are seeded by `seed`
/// ([`DynamicSpec::home_of`]).
pub(crate) fn id_home(seed: u64, id: u64, nodes: usize) -> usize {
    ((mix(id ^ seed ^ 0x6479_6e61_6d69_6373) as u128 * nodes as u128) >> 64) as usize
}

/// The replicated ids of a table with `spec` among `nodes` (`ids` sorted and distinct) with
/// their slot keys: each home sets aside the first keys of its range for the ids it is home
/// of, in the order of the ids, so that every node finds the same keys without a message.
pub(crate) fn replicated_slots(spec: &DynamicSpec, ids: &[u64], nodes: usize) -> Vec<(u64, u64)> {
    let mut next = vec![0u64; nodes.max(1)];
    ids.iter()
        .map(|&id| {
            let home = spec.home_of(id, nodes.max(1));
            next[home] += 1;
            (id, home as u64 * spec.capacity + next[home] - 1)
        })
        .collect()
}

/// How many of the replicated `ids` each of `nodes` homes is home of.
pub(crate) fn replicated_per_home(spec: &DynamicSpec, ids: &[u64], nodes: usize) -> Vec<u64> {
    let mut count = vec![0u64; nodes.max(1)];
    for &id in ids {
        count[spec.home_of(id, nodes.max(1))] += 1;
    }
    count
}

/// The slot keys of the replicated `ids` as the ranges the slot-key table replicates: the first
/// keys of each home's range (at most its capacity of them).
pub(crate) fn replicated_ranges(spec: &DynamicSpec, ids: &[u64], nodes: usize) -> Vec<std::ops::Range<u64>> {
    replicated_per_home(spec, ids, nodes)
        .into_iter()
        .enumerate()
        .filter(|&(_, n)| n > 0)
        .map(|(home, n)| {
            let first = home as u64 * spec.capacity;
            first..first + n.min(spec.capacity)
        })
        .collect()
}

/// Per shard of the index: the ids known here and their slot keys, each with a use count in
/// its top bits where the table evicts ([`COUNT_ONE`]).
type IdMap = std::collections::HashMap<u64, AtomicU64, BuildHasherDefault<IdMixer>>;

/// In an index entry, where the table evicts: one use, counted in the top six bits above the
/// slot key (a table has fewer than 2^42 keys). Lookups add one up to [`COUNT_MAX`] (a few
/// racing lookups may add one more each: six bits hold them, and a carry out of them is lost,
/// never into the key); eviction offers the ids with the lowest counts and halves the counts
/// its clock hand passes every fourth turn: an approximate least-frequently-used with aging.
const COUNT_ONE: u64 = 1 << 58;
/// The slot key's bits of an entry.
const KEY_BITS: u64 = COUNT_ONE - 1;
/// Uses an entry counts at most: enough to tell rare ids from busy ones, few enough that four
/// halvings take a busy id that went quiet back to the rare ones.
const COUNT_MAX: u64 = 15;

/// An id offered in an eviction round: its slot key, the uses its home counted, and whether an
/// ASSIGN rescued it meanwhile.
#[derive(Debug, Clone, Copy)]
struct Offered {
    key: u64,
    uses: u64,
    rescued: bool,
}

impl Offered {
    /// Marks the id rescued from its round (an ASSIGN or an intent named it): the index entry
    /// it goes back in with, its slot key and the uses counted, one more for this use.
    fn rescue(&mut self) -> u64 {
        self.rescued = true;
        self.key | ((self.uses + 1).min(COUNT_MAX) * COUNT_ONE)
    }
}

/// How a home's eviction round picks ids ([`IdIndex::offer_round`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// The home runs short: the ids used least.
    Short,
    /// The time to live passed: the ids not used since the last such round.
    Ttl,
}

/// An entry's use count.
#[inline]
fn uses(word: u64) -> u64 {
    word >> 58
}

/// An entry's slot key, counting a use where ids are evicted. Nothing is stored once the count
/// is at its most, so that a busy id's line is not written on every lookup.
#[inline]
fn touch(entry: &AtomicU64, count: bool) -> u64 {
    let word = entry.load(Ordering::Relaxed);
    if count && uses(word) < COUNT_MAX {
        entry.fetch_add(COUNT_ONE, Ordering::Relaxed);
    }
    word & KEY_BITS
}

/// The hasher of a node's index of ids (for `std` hash maps: `BuildHasherDefault<IdMixer>`):
/// the splitmix64 finaliser, since raw ids come in any pattern (multiples of a large power of
/// two included), which an identity or multiplicative hash would crowd into a few buckets.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdMixer(u64);

impl Hasher for IdMixer {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = mix(self.0 ^ *b as u64);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = mix(self.0 ^ n);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// Shards of a node's index: workers reading known ids on several threads rarely meet on one
/// latch.
const INDEX_SHARDS: usize = 64;

/// A node's index of one dynamic table: the ids it knows (its own home's, and the answers of
/// other homes) and, as a home, the slot keys it handed out. Lookups take a read latch on one
/// shard; creating takes the home's lock, so that an id is created once.
pub(crate) struct IdIndex {
    spec: DynamicSpec,
    shards: Vec<RwLock<IdMap>>,
    /// What the home needs to create ids; held while it creates them.
    home: parking_lot::Mutex<HomeState>,
    /// The first slot key of this node's range.
    first: u64,
    /// Whether lookups mark ids used (the table evicts).
    marks: bool,
    /// The table's replicated ids, with their slot keys ([`replicated_slots`]).
    replicated: crate::util::FastMap<u64, u64>,
}

impl IdIndex {
    /// The index of a table with `spec` and `replicated_ids` on node `rank` of `nodes`.
    pub fn with_replicated(spec: DynamicSpec, rank: usize, nodes: usize, replicated_ids: &[u64]) -> IdIndex {
        IdIndex::new(spec, rank, &replicated_slots(&spec, replicated_ids, nodes))
    }

    /// The index of a table with `spec` on node `rank`, knowing its `replicated` ids and their
    /// slot keys ([`replicated_slots`]) from the start: this node's own take the first keys of
    /// its range, which no eviction round offers.
    pub fn new(spec: DynamicSpec, rank: usize, replicated: &[(u64, u64)]) -> IdIndex {
        let first = rank as u64 * spec.capacity;
        let own = replicated.iter().filter(|&&(_, key)| key >= first && key - first < spec.capacity).count() as u64;
        let mut shards: Vec<RwLock<IdMap>> = (0..INDEX_SHARDS).map(|_| RwLock::new(IdMap::default())).collect();
        for &(id, key) in replicated {
            shards[Self::shard_index(id)].get_mut().insert(id, AtomicU64::new(key));
        }
        IdIndex {
            spec,
            shards,
            home: parking_lot::Mutex::new(HomeState {
                // Set aside: never offered (no id in `slot_ids`), never freed.
                next: own,
                sketch: matches!(spec.admission, Admission::Count { .. }).then(|| Sketch::new(spec.capacity)),
                draws: 0,
                slot_ids: if spec.eviction.evicts() { vec![None; own as usize] } else { Vec::new() },
                free: Vec::new(),
                offered: Default::default(),
                turns: 0,
                hand: 0,
                created: own,
                evicted: 0,
                deferred: 0,
                stranded: Vec::new(),
                deferred_before: 0,
                history: spec.eviction.evicts().then(|| History::new(spec.capacity)),
                admit_above: 0,
                filtered: 0,
            }),
            first,
            marks: spec.eviction.evicts(),
            replicated: replicated.iter().copied().collect(),
        }
    }

    /// The table's spec.
    pub fn spec(&self) -> &DynamicSpec {
        &self.spec
    }

    /// The shard of `id`: bits 51–56 of the id's hash, which a shard's map uses for neither
    /// the bucket (the low bits) nor the tag it checks first (the top seven). The top bits
    /// would leave a shard's ids two tags between them: a probe's tag check would then pass
    /// half the entries of its group, and a lookup of an id not there compare all of those.
    #[inline]
    fn shard_index(id: u64) -> usize {
        (mix(id) >> 51) as usize % INDEX_SHARDS
    }

    #[inline]
    fn shard(&self, id: u64) -> &RwLock<IdMap> {
        &self.shards[Self::shard_index(id)]
    }

    /// The slot key of `id`, if this node knows it (marked used where ids are evicted).
    #[inline]
    pub fn lookup(&self, id: u64) -> Option<u64> {
        self.shard(id).read().get(&id).map(|e| touch(e, self.marks))
    }

    /// The slot keys of `ids` into `keys` (one each; 0 for an id not known here, whose
    /// position goes into `missing`), each marked used unless `intent` is a peek. A large
    /// batch takes every shard's read latch once rather than one per id.
    pub fn lookup_many(&self, ids: &[u64], intent: Intent, keys: &mut Vec<u64>, missing: &mut Vec<usize>) {
        let count = self.marks && intent != Intent::Peek;
        let mut note = |i: usize, found: Option<u64>| match found {
            Some(key) => keys.push(key),
            None => {
                keys.push(0);
                missing.push(i);
            }
        };
        if ids.len() < 2 * INDEX_SHARDS {
            for (i, &id) in ids.iter().enumerate() {
                note(i, self.shard(id).read().get(&id).map(|e| touch(e, count)));
            }
            return;
        }
        let shards: [_; INDEX_SHARDS] = std::array::from_fn(|s| self.shards[s].read());
        for (i, &id) in ids.iter().enumerate() {
            note(i, shards[Self::shard_index(id)].get(&id).map(|e| touch(e, count)));
        }
    }

    /// Remembers the slot keys of ids (`(id, key)`: answers of their home to an ask with
    /// `intent`). A large batch takes every shard's write latch once rather than one per id.
    pub fn learn_many(&self, pairs: &[(u64, u64)], intent: Intent) {
        // Learnt for a call that uses it: one use (a peek is none).
        let used = if self.marks && intent != Intent::Peek { COUNT_ONE } else { 0 };
        if pairs.len() < 2 * INDEX_SHARDS {
            for &(id, key) in pairs {
                self.shard(id).write().insert(id, AtomicU64::new(key | used));
            }
            return;
        }
        let mut shards: [_; INDEX_SHARDS] = std::array::from_fn(|s| self.shards[s].write());
        for &(id, key) in pairs {
            shards[Self::shard_index(id)].insert(id, AtomicU64::new(key | used));
        }
    }

    /// As the home of `ids`, asked with `intent`: the slot key of each, creating those it does
    /// not know and its admission filter admits with `create` (given the id and the new slot
    /// key; it writes the initial value) while slot keys of its range are free. An id offered
    /// in an open eviction round is rescued: it keeps its slot key. Returns how many ids were
    /// created.
    pub fn assign(&self, ids: &[u64], intent: Intent, keys: &mut Vec<Assigned>, mut create: impl FnMut(u64, u64) -> Result<()>) -> Result<usize> {
        keys.clear();
        let mut home = self.home.lock();
        let home = &mut *home;
        let before = home.created;
        let (capacity, first, admission, evicts) = (self.spec.capacity, self.first, self.spec.admission, self.marks);
        let mut one = |map: &mut IdMap, id: u64, home: &mut HomeState| -> Result<Assigned> {
            // One hash of the id for a new id as for a known one.
            let vacant = match map.entry(id) {
                std::collections::hash_map::Entry::Occupied(entry) => return Ok(Assigned::Key(touch(entry.get(), evicts && intent != Intent::Peek))),
                std::collections::hash_map::Entry::Vacant(vacant) => vacant,
            };
            if intent == Intent::Peek {
                // Not held, or offered in a round under way: a peek neither uses nor rescues it
                // (nor could the asker learn a slot key the round may free).
                return Ok(Assigned::NotAdmitted);
            }
            if let Some(offered) = home.offered.get_mut(&id) {
                vacant.insert(AtomicU64::new(offered.rescue()));
                return Ok(Assigned::Key(offered.key));
            }
            let admitted = match (intent, admission) {
                (Intent::Peek, _) => false,
                (Intent::Force, _) | (_, Admission::All) => true,
                (Intent::Read, _) => false,
                (Intent::Write, Admission::Count { pushes }) => home.sketch.as_mut().is_none_or(|s| s.add(id) >= pushes),
                (Intent::Write, Admission::Probability { p, seed }) => {
                    home.draws += 1;
                    unit(id, seed, home.draws) < p as f64
                }
            };
            if !admitted {
                return Ok(Assigned::NotAdmitted);
            }
            // A home short of room admits a new id only if it was used more than the ids its
            // last round evicted (TinyLFU's admission): a rare id does not push out a busier one.
            let free = capacity - home.next + home.free.len() as u64;
            if intent == Intent::Write
                && free <= capacity / 8
                && let Some(history) = home.history.as_mut()
                && history.starting_uses(id) <= home.admit_above
            {
                history.add(id, 1);
                home.filtered += 1;
                return Ok(Assigned::NotAdmitted);
            }
            let offset = match home.free.pop() {
                Some(offset) => offset,
                None if home.next < capacity => {
                    home.next += 1;
                    if evicts {
                        home.slot_ids.push(None);
                    }
                    home.next - 1
                }
                // A home that evicts defers the id until a round frees room.
                None if evicts && intent != Intent::Force => {
                    home.deferred += 1;
                    return Ok(Assigned::NotAdmitted);
                }
                None => return Ok(Assigned::Full),
            };
            let key = first + offset;
            if let Err(e) = create(id, key) {
                home.free.push(offset);
                return Err(e);
            }
            if evicts {
                home.slot_ids[offset as usize] = Some(id);
            }
            home.created += 1;
            let uses = home.history.as_ref().map_or(0, |h| h.starting_uses(id));
            vacant.insert(AtomicU64::new(key | (uses * COUNT_ONE)));
            Ok(Assigned::Key(key))
        };
        if ids.len() < 2 * INDEX_SHARDS {
            for &id in ids {
                keys.push(one(&mut self.shard(id).write(), id, home)?);
            }
        } else {
            // A large batch takes every shard's write latch once rather than one per id.
            let mut shards: [_; INDEX_SHARDS] = std::array::from_fn(|s| self.shards[s].write());
            for &id in ids {
                keys.push(one(&mut shards[Self::shard_index(id)], id, home)?);
            }
        }
        Ok((home.created - before) as usize)
    }

    /// Every id this node knows, with its slot key (for a checkpoint, which names the slots it
    /// writes by their ids): those offered in an open eviction round too.
    pub fn pairs(&self) -> Vec<(u64, u64)> {
        let mut all: Vec<(u64, u64)> = self.home.lock().offered.iter().map(|(&id, offered)| (id, offered.key)).collect();
        for shard in &self.shards {
            all.extend(shard.read().iter().map(|(&id, key)| (id, key.load(Ordering::Relaxed) & KEY_BITS)));
        }
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Whether `key` is one of this node's own slot keys (it hands them out as a home).
    pub fn is_own(&self, key: u64) -> bool {
        key >= self.first && key - self.first < self.spec.capacity
    }

    /// As the home of `id`, restored from a checkpoint: creates it with `write` (given its new
    /// slot key) instead of its initial value; a replicated id is written in its slot key (on
    /// every node, home or not). Refuses an id restored twice (a damaged or
    /// mixed-up checkpoint) and one beyond this node's share.
    pub fn restore(&self, id: u64, write: impl FnOnce(u64) -> Result<()>) -> Result<()> {
        // A replicated id has its slot key from the start, on every node (each writes its copy).
        if let Some(&key) = self.replicated.get(&id) {
            return write(key);
        }
        let mut keys = Vec::with_capacity(1);
        let mut write = Some(write);
        let created = self.assign(&[id], Intent::Force, &mut keys, |_, key| write.take().map_or(Ok(()), |w| w(key)))?;
        match (created, keys.first()) {
            (1, _) => Ok(()),
            (_, Some(Assigned::Full)) => Err(Error::Checkpoint(format!(
                "the checkpoint holds more ids homed at this node than its {} keys of the table (a larger capacity holds them)",
                self.spec.capacity
            ))),
            _ => Err(Error::Checkpoint(format!("id {id} is in the checkpoint twice"))),
        }
    }

    /// The slot key of `id` if the table replicates it.
    pub fn replicated_key(&self, id: u64) -> Option<u64> {
        self.replicated.get(&id).copied()
    }

    /// The table's replicated ids with their slot keys.
    pub fn replicated(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.replicated.iter().map(|(&id, &key)| (id, key))
    }

    /// What this node's admission filter and eviction history learnt as a home (the count
    /// filter's sketch, eviction's history of uses and the last round's threshold), for a
    /// checkpoint; `None` where the table keeps neither.
    pub fn admission_state(&self) -> Option<AdmissionState> {
        let home = self.home.lock();
        if home.sketch.is_none() && home.history.is_none() {
            return None;
        }
        Some(AdmissionState {
            pushes: home.sketch.as_ref().map(|s| s.counters.clone()).unwrap_or_default(),
            uses: home.history.as_ref().map(|h| h.sketch.counters.clone()).unwrap_or_default(),
            uses_added: home.history.as_ref().map_or(0, |h| h.added),
            admit_above: home.admit_above,
        })
    }

    /// Adds `state` (a checkpoint's, of this node or of another: counts of ids homed
    /// elsewhere only raise estimates, as a count-min sketch's collisions do) to what this
    /// node's filter and history know. Returns whether it fit: a sketch of another size (a
    /// table of another capacity) is left out, and the table starts that part afresh.
    pub fn add_admission_state(&self, state: &AdmissionState) -> bool {
        let mut home = self.home.lock();
        let home = &mut *home;
        let mut fit = true;
        let mut add = |counters: &mut Vec<u32>, saved: &[u32]| {
            if saved.is_empty() {
                return;
            }
            if counters.len() != saved.len() {
                fit = false;
                return;
            }
            for (c, s) in counters.iter_mut().zip(saved) {
                *c = c.saturating_add(*s);
            }
        };
        if let Some(sketch) = home.sketch.as_mut() {
            add(&mut sketch.counters, &state.pushes);
        }
        if let Some(history) = home.history.as_mut() {
            add(&mut history.sketch.counters, &state.uses);
            history.added = history.added.saturating_add(state.uses_added);
        }
        home.admit_above = home.admit_above.max(state.admit_above.min(COUNT_MAX));
        fit
    }

    /// Ids this node created as their home (evicted ones included).
    pub fn created(&self) -> u64 {
        self.home.lock().created
    }

    /// As a home: ids created and not evicted, ids evicted, and new ids deferred (full, or short
    /// of room and not used enough).
    pub fn home_counts(&self) -> (u64, u64, u64) {
        let home = self.home.lock();
        (home.next - home.free.len() as u64 - home.stranded.len() as u64, home.evicted, home.deferred + home.filtered)
    }

    /// Ids this node knows the slot keys of (its own and those it learnt).
    pub fn known(&self) -> u64 {
        self.shards.iter().map(|s| s.read().len() as u64).sum()
    }

    /// Whether this home should begin an eviction round: it evicts, none is open, and its free
    /// slot keys are down to a sixteenth of its capacity, or to as many as the new ids it
    /// deferred since its last round began.
    pub fn runs_short(&self) -> bool {
        let home = self.home.lock();
        // New ids deferred since the last round began: they keep arriving faster than rounds
        // free room, so the next round begins with that much room left.
        let headroom = (self.spec.capacity / 16).max(home.deferred - home.deferred_before).max(1);
        self.marks && home.offered.is_empty() && (self.spec.capacity - home.next) + (home.free.len() as u64) <= headroom
    }

    /// New ids deferred since the last round began (what the last round fell short by).
    pub fn deferred_since_last_round(&self) -> u64 {
        let home = self.home.lock();
        home.deferred - home.deferred_before
    }

    /// As a home, opens an eviction round and returns the ids it offers with their slot keys
    /// (none while a round is open); they leave the index and wait in the round.
    ///
    /// - A home that runs short ([`Pass::Short`]) offers up to `most` of the ids used least:
    ///   from a sample of its slots it finds the use count below which about `most` ids are,
    ///   then its clock hand offers ids at or under it, going round twice at most. The hand
    ///   halves the counts of the ids it passes every fourth turn, so that uses long past fade.
    /// - A round for the time to live ([`Pass::Ttl`]) goes round once, offering the ids with no
    ///   uses counted since the last such round and clearing the others' counts.
    ///
    /// Ids whose slot keys are `intended` (a node told this home it will need the slot key:
    /// its intent service may move or replicate the slot at any time) are in use: never offered.
    pub fn offer_round(&self, most: usize, pass: Pass, intended: impl Fn(u64) -> bool) -> Vec<(u64, u64)> {
        let mut home = self.home.lock();
        let home = &mut *home;
        let mut offered = Vec::new();
        if !home.offered.is_empty() || home.next == 0 || most == 0 {
            return offered;
        }
        home.deferred_before = home.deferred;
        let threshold = match pass {
            Pass::Ttl => 0,
            Pass::Short => self.threshold(home, most),
        };
        if pass == Pass::Short {
            home.admit_above = threshold;
        }
        let mut left = home.next.saturating_mul(if pass == Pass::Ttl { 1 } else { 2 });
        while left > 0 && offered.len() < most {
            // Every shard's latch for a stretch of slots, then let workers' lookups through.
            let mut shards: [_; INDEX_SHARDS] = std::array::from_fn(|s| self.shards[s].write());
            for _ in 0..left.min(4096) {
                left -= 1;
                let offset = home.hand % home.next;
                home.hand = (offset + 1) % home.next;
                if home.hand == 0 {
                    home.turns += 1;
                }
                let Some(id) = home.slot_ids[offset as usize] else { continue };
                let shard = &mut shards[Self::shard_index(id)];
                let Some(entry) = shard.get(&id) else { continue };
                let word = entry.load(Ordering::Relaxed);
                if intended(word & KEY_BITS) {
                    continue;
                }
                let count = uses(word);
                if count > threshold {
                    let aged = match pass {
                        Pass::Ttl => 0,
                        Pass::Short if home.turns % 4 == 3 => count / 2,
                        Pass::Short => count,
                    };
                    entry.store((word & KEY_BITS) | (aged * COUNT_ONE), Ordering::Relaxed);
                    continue;
                }
                let key = word & KEY_BITS;
                shard.remove(&id);
                home.offered.insert(id, Offered { key, uses: count, rescued: false });
                offered.push((id, key));
                if offered.len() >= most {
                    break;
                }
            }
        }
        offered
    }

    /// The use count at or under which about `most` of this home's ids are, from a sample of
    /// up to 4 096 of its slots spread over its range.
    fn threshold(&self, home: &HomeState, most: usize) -> u64 {
        let stride = (home.next / 4096).max(1);
        let mut histogram = [0u64; 64];
        let mut sampled = 0u64;
        for offset in (0..home.next).step_by(stride as usize) {
            let Some(id) = home.slot_ids[offset as usize] else { continue };
            if let Some(entry) = self.shard(id).read().get(&id) {
                histogram[uses(entry.load(Ordering::Relaxed)) as usize] += 1;
                sampled += 1;
            }
        }
        let live = home.next - home.free.len() as u64 - home.stranded.len() as u64;
        let wanted = (most as u64).saturating_mul(sampled) / live.max(1);
        let mut below = 0;
        for (count, n) in histogram.iter().enumerate() {
            below += n;
            if below >= wanted {
                return count as u64;
            }
        }
        COUNT_MAX
    }

    /// Offered ids of another home's round: those with no uses counted here leave this node's
    /// index unless `holds` says it has their slot; the others stay. After the grace period,
    /// [`IdIndex::keeps`] says which this node keeps.
    pub fn offer(&self, offered: &[(u64, u64)], holds: impl Fn(u64) -> bool) {
        for &(id, key) in offered {
            let mut shard = self.shard(id).write();
            let Some(entry) = shard.get(&id) else { continue };
            let word = entry.load(Ordering::Relaxed);
            if word & KEY_BITS == key && uses(word) == 0 && !holds(key) {
                shard.remove(&id);
            }
        }
    }

    /// After the grace period of a round of another home: the offered ids this node keeps,
    /// with the uses it counted of each (handed to the home, which adds them to its own: the
    /// count here starts again), those still in its index (used, or learnt again) and those
    /// whose slot `holds` says it has (which it then knows again, should the slot have come
    /// meanwhile).
    pub fn keeps(&self, offered: &[(u64, u64)], holds: impl Fn(u64) -> bool) -> Vec<(u64, u64)> {
        let mut kept = Vec::new();
        for &(id, key) in offered {
            let counted = self.shard(id).read().get(&id).map(|entry| uses(entry.fetch_and(KEY_BITS, Ordering::Relaxed)));
            match counted {
                Some(count) => kept.push((id, count)),
                None if holds(key) => {
                    self.shard(id).write().entry(id).or_insert_with(|| AtomicU64::new(key));
                    kept.push((id, 0));
                }
                None => {}
            }
        }
        kept
    }

    /// As a home, closes the open round: the ids offered that no node kept nor an ASSIGN
    /// rescued are evicted (they leave the round; asked for again, they are new ids), the
    /// others return to the index with the uses the nodes that kept them counted added to the
    /// home's. Returns the slot keys of the evicted ids with the ids, and those of earlier
    /// rounds that could not be freed yet: the caller writes back each it holds and hands them to
    /// [`IdIndex::free_slots`]. No slot is touched under the home's lock, which creating ids
    /// holds while it writes slots.
    pub fn finish_round(&self, kept: &crate::util::FastMap<u64, u64>) -> Vec<(u64, u64)> {
        let mut home = self.home.lock();
        let home = &mut *home;
        let mut evicted = std::mem::take(&mut home.stranded);
        for (id, offered) in std::mem::take(&mut home.offered) {
            if let Some(history) = home.history.as_mut() {
                history.add(id, offered.uses.saturating_add(kept.get(&id).copied().unwrap_or(0)));
            }
            if offered.rescued {
                continue;
            }
            if let Some(&counted) = kept.get(&id) {
                let count = offered.uses.saturating_add(counted).min(COUNT_MAX);
                self.shard(id).write().entry(id).or_insert_with(|| AtomicU64::new(offered.key | (count * COUNT_ONE)));
                continue;
            }
            home.slot_ids[(offered.key - self.first) as usize] = None;
            home.evicted += 1;
            evicted.push((offered.key, id));
        }
        evicted
    }

    /// Slots of evicted ids written back (`freed`) are free for new ids; the others
    /// (`stranded`: not here yet, e.g. on their way back from a node that left) are tried again
    /// when the next round closes.
    pub fn free_slots(&self, freed: &[u64], stranded: Vec<(u64, u64)>) {
        let mut home = self.home.lock();
        home.free.extend(freed.iter().map(|key| key - self.first));
        home.stranded.extend(stranded);
    }

    /// As the home of slot keys `keys` (of its range), which a node is about to intend or move
    /// on a grant of the intent service, neither of which goes through an id: whether an id has
    /// each. An id offered in an open eviction round is rescued, as an ASSIGN naming it would
    /// (the node that intends it may move or replicate its slot whatever its index says); a
    /// free slot key is nobody's, and a grant of it would move or replicate a slot that a new
    /// id may take. On a table that does not evict, every slot key handed out keeps its id.
    pub fn claim_slots(&self, keys: &[u64]) -> Vec<bool> {
        if !self.marks {
            return vec![true; keys.len()];
        }
        let mut home = self.home.lock();
        let home = &mut *home;
        keys.iter()
            .map(|&key| {
                let Some(id) = key.checked_sub(self.first).and_then(|offset| home.slot_ids.get(offset as usize).copied().flatten()) else {
                    return false;
                };
                if let Some(offered) = home.offered.get_mut(&id)
                    && !offered.rescued
                {
                    let word = offered.rescue();
                    self.shard(id).write().entry(id).or_insert_with(|| AtomicU64::new(word));
                }
                true
            })
            .collect()
    }

    /// As the home of slot key `key`: the id that has it (offered in a round included).
    #[cfg(any(test, feature = "sim"))]
    pub fn id_of_slot(&self, key: u64) -> Option<u64> {
        let home = self.home.lock();
        home.slot_ids.get(key.checked_sub(self.first)? as usize).copied().flatten()
    }
}

/// The error for ids that their home could not create: its share of the table is used up.
pub(crate) fn table_full(table: &str, node: usize, capacity: u64) -> Error {
    Error::TableFull { table: table.to_string(), node, capacity }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(capacity: u64) -> DynamicSpec {
        DynamicSpec { capacity, init: Init::Zeros, seed: 7, admission: Admission::All, eviction: Eviction::Never }
    }

    /// A home creates an id once, from its own range, and refuses ids beyond its capacity
    /// while still answering those it knows.
    #[test]
    fn a_home_creates_each_id_once_from_its_range_until_it_is_full() {
        let index = IdIndex::new(spec(3), 2, &[]);
        let mut made = Vec::new();
        let mut keys = Vec::new();
        let n = index
            .assign(&[u64::MAX, 5, u64::MAX], Intent::Read, &mut keys, |id, key| {
                made.push((id, key));
                Ok(())
            })
            .unwrap();
        assert_eq!((n, keys.clone()), (2, vec![Assigned::Key(6), Assigned::Key(7), Assigned::Key(6)]));
        let n = index
            .assign(&[9, 10, 5], Intent::Write, &mut keys, |id, key| {
                made.push((id, key));
                Ok(())
            })
            .unwrap();
        assert_eq!((n, keys.clone()), (1, vec![Assigned::Key(8), Assigned::Full, Assigned::Key(7)]), "full after three ids");
        assert_eq!(made, vec![(u64::MAX, 6), (5, 7), (9, 8)], "each id initialised once");
        assert_eq!((index.created(), index.known()), (3, 3));
        assert_eq!(index.lookup(9), Some(8));
        assert_eq!(index.lookup(10), None);
    }

    /// Ids created on two threads at once get one slot key each, never two.
    #[test]
    fn ids_created_on_two_threads_at_once_are_created_once() {
        let index = IdIndex::new(spec(10_000), 0, &[]);
        let counts: Vec<usize> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let mut keys = Vec::new();
                        let ids: Vec<u64> = (0..5_000u64).map(|i| i.wrapping_mul(0x1000_0000_0000)).collect();
                        index.assign(&ids, Intent::Write, &mut keys, |_, _| Ok(())).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(counts.iter().sum::<usize>(), 5_000);
        assert_eq!(index.created(), 5_000);
        let mut keys: Vec<u64> = (0..5_000u64).map(|i| index.lookup(i.wrapping_mul(0x1000_0000_0000)).unwrap()).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), 5_000, "two ids share a slot key");
    }

    /// Initial values depend on the id and the rule alone, and have the asked-for spread.
    #[test]
    fn initial_values_are_the_same_everywhere_and_have_their_spread() {
        let mut a = vec![0.0f32; 8];
        let mut b = vec![0.0f32; 8];
        let rule: Init = "normal:0.5:3".parse().unwrap();
        rule.fill(42, &mut a);
        rule.fill(42, &mut b);
        assert_eq!(a, b);
        rule.fill(43, &mut b);
        assert_ne!(a, b);
        let mut all = vec![0.0f32; 100_000];
        rule.fill(1, &mut all);
        let mean = all.iter().map(|&v| v as f64).sum::<f64>() / all.len() as f64;
        let std = (all.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / all.len() as f64).sqrt();
        assert!(mean.abs() < 0.01 && (std - 0.5).abs() < 0.01, "mean {mean}, std {std}");
        let uniform: Init = "uniform:0.1".parse().unwrap();
        uniform.fill(1, &mut all);
        assert!(all.iter().all(|v| (-0.1..0.1).contains(v)));
        assert!(all.iter().any(|&v| v > 0.09) && all.iter().any(|&v| v < -0.09));
        Init::Zeros.fill(5, &mut a);
        assert!(a.iter().all(|&v| v == 0.0));
    }

    /// A count filter creates an id at its N-th push, never on a read, at once on a set; the
    /// probability filter admits about the share of pushes it says.
    #[test]
    fn admission_filters_create_ids_as_they_say() {
        let counting = IdIndex::new(DynamicSpec { admission: Admission::Count { pushes: 3 }, ..spec(100) }, 0, &[]);
        let mut keys = Vec::new();
        let mut answer = |index: &IdIndex, id: u64, intent: Intent| {
            index.assign(&[id], intent, &mut keys, |_, _| Ok(())).unwrap();
            keys[0]
        };
        assert_eq!(answer(&counting, 1, Intent::Read), Assigned::NotAdmitted);
        assert_eq!(answer(&counting, 1, Intent::Write), Assigned::NotAdmitted);
        assert_eq!(answer(&counting, 1, Intent::Read), Assigned::NotAdmitted, "a read does not count");
        assert_eq!(answer(&counting, 1, Intent::Write), Assigned::NotAdmitted);
        assert_eq!(answer(&counting, 1, Intent::Write), Assigned::Key(0), "the third push admits it");
        assert_eq!(answer(&counting, 1, Intent::Read), Assigned::Key(0));
        assert_eq!(answer(&counting, 2, Intent::Force), Assigned::Key(1), "a set creates it");
        assert_eq!(counting.created(), 2);
        // Never late, whatever shares its counters: 5 000 ids pushed twice each, then once more.
        let many = IdIndex::new(DynamicSpec { admission: Admission::Count { pushes: 3 }, ..spec(20_000) }, 0, &[]);
        for _ in 0..2 {
            for id in 0..5_000u64 {
                answer(&many, id, Intent::Write);
            }
        }
        assert!(many.created() < 500, "{} ids admitted after two pushes", many.created());
        for id in 0..5_000u64 {
            assert!(matches!(answer(&many, id, Intent::Write), Assigned::Key(_)), "id {id} not admitted at its third push");
        }
        let sampled = IdIndex::new(DynamicSpec { admission: Admission::Probability { p: 0.1, seed: 4 }, ..spec(20_000) }, 0, &[]);
        for id in 0..10_000u64 {
            answer(&sampled, id, Intent::Write);
            assert_eq!(answer(&sampled, id + 1_000_000, Intent::Read), Assigned::NotAdmitted);
        }
        assert!((800..1_200).contains(&sampled.created()), "{} of 10 000 admitted at p = 0.1", sampled.created());
        for text in ["all", "count:3", "probability:0.25:9"] {
            assert_eq!(text.parse::<Admission>().unwrap().name(), text);
        }
        for (text, says) in
            [("count:0", "at least 1"), ("probability:0", "above 0"), ("probability:2", "above 0"), ("sometimes", "expected all"), ("all:1", "expected all")]
        {
            let e = text.parse::<Admission>().unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    /// Intent on a table that evicts: a home offers no id whose slot key is intended; claiming
    /// slot keys (a node starts to intend them, or moves them on a grant) rescues ids offered
    /// in a round under way, and says that a free slot key, or one never handed out, is
    /// nobody's. A table that does not evict claims every slot key.
    #[test]
    fn intended_slot_keys_are_not_offered_and_claims_rescue_or_refuse() {
        let index = IdIndex::new(DynamicSpec { eviction: Eviction::Ttl { millis: 1 }, ..spec(8) }, 1, &[]);
        let mut keys = Vec::new();
        let mut slot = |id: u64| {
            index.assign(&[id], Intent::Write, &mut keys, |_, _| Ok(())).unwrap();
            match keys[0] {
                Assigned::Key(key) => key,
                other => panic!("id {id}: {other:?}"),
            }
        };
        let slots: Vec<u64> = (0..4).map(&mut slot).collect();
        assert_eq!(slots, vec![8, 9, 10, 11], "node 1's range begins at 8");
        // A first round for the time to live clears the counts the ids started with (one use);
        // with none used since, the next offers all but the intended one.
        assert!(index.offer_round(8, Pass::Ttl, |_| false).is_empty());
        let offered: Vec<u64> = index.offer_round(8, Pass::Ttl, |key| key == 9).into_iter().map(|(id, _)| id).collect();
        assert_eq!(offered.len(), 3);
        assert!(!offered.contains(&1), "the id of intended slot key 9 is not offered");
        // Slot key 10 (id 2) is claimed during the round: rescued; 13 was never handed out, 99
        // is outside the range.
        assert_eq!(index.claim_slots(&[10, 9, 13, 99]), vec![true, true, false, false]);
        assert_eq!(index.lookup(2), Some(10), "a claimed id is back in the home's index");
        let freed: Vec<(u64, u64)> = index.finish_round(&crate::util::FastMap::default());
        let mut freed_ids: Vec<u64> = freed.iter().map(|&(_, id)| id).collect();
        freed_ids.sort_unstable();
        assert_eq!(freed_ids, vec![0, 3], "the unclaimed offered ids are evicted");
        index.free_slots(&freed.iter().map(|&(key, _)| key).collect::<Vec<_>>(), Vec::new());
        assert_eq!(index.claim_slots(&[8, 9, 10, 11]), vec![false, true, true, false], "freed slot keys are nobody's");
        assert_eq!(index.id_of_slot(10), Some(2));
        let never = IdIndex::new(spec(8), 0, &[]);
        assert_eq!(never.claim_slots(&[0, 7]), vec![true, true]);
    }

    /// Replicated ids: every node finds the same slot keys for them (the first of each home's
    /// range, in id order) and knows them from the start; a home creates new ids after them,
    /// its rounds never offer them, and a restore writes them where they are.
    #[test]
    fn replicated_ids_take_the_first_keys_of_their_homes_and_are_never_offered() {
        let spec = DynamicSpec { eviction: Eviction::Ttl { millis: 1 }, ..spec(8) };
        let ids: Vec<u64> = vec![0, 3, 1 << 40, u64::MAX - 1, 0x9e37_79b9_7f4a_7c15, 12_345];
        let nodes = 3;
        let slots = replicated_slots(&spec, &ids, nodes);
        let per_home = replicated_per_home(&spec, &ids, nodes);
        assert_eq!(per_home.iter().sum::<u64>(), ids.len() as u64);
        for (home, &count) in per_home.iter().enumerate() {
            let mut keys: Vec<u64> = slots.iter().filter(|&&(id, _)| spec.home_of(id, nodes) == home).map(|&(_, key)| key).collect();
            keys.sort_unstable();
            let first = home as u64 * 8;
            assert_eq!(keys, (first..first + count).collect::<Vec<_>>(), "home {home} sets aside the first keys of its range");
        }
        let ranges = replicated_ranges(&spec, &ids, nodes);
        assert_eq!(ranges.iter().map(|r| r.end - r.start).sum::<u64>(), ids.len() as u64);
        // Node 0's index knows every replicated id, and creates new ids after its own.
        let index = IdIndex::new(spec, 0, &slots);
        for &(id, key) in &slots {
            assert_eq!(index.lookup(id), Some(key));
            assert_eq!(index.replicated_key(id), Some(key));
        }
        let own = per_home[0];
        let mut keys = Vec::new();
        index.assign(&[1, 2], Intent::Write, &mut keys, |_, _| Ok(())).unwrap();
        assert_eq!(keys, vec![Assigned::Key(own), Assigned::Key(own + 1)], "new ids take the keys after the replicated ones");
        assert_eq!(index.created(), own + 2);
        // Rounds for the time to live offer the new ids, never the replicated ones.
        assert!(index.offer_round(8, Pass::Ttl, |_| false).is_empty());
        let offered: Vec<u64> = index.offer_round(8, Pass::Ttl, |_| false).into_iter().map(|(id, _)| id).collect();
        assert_eq!(offered, vec![1, 2]);
        // A restore writes a replicated id in its slot key, on its home and elsewhere alike.
        let (id, key) = slots[0];
        let mut written = None;
        index
            .restore(id, |k| {
                written = Some(k);
                Ok(())
            })
            .unwrap();
        assert_eq!(written, Some(key));
    }

    /// A home that runs short offers the ids used least; then, short of room, it admits a new
    /// id only if it was used more than those: an evicted id that had uses comes back, an id
    /// never seen waits.
    #[test]
    fn a_home_short_of_room_evicts_the_least_used_and_admits_only_busier_ids() {
        let index = IdIndex::new(DynamicSpec { eviction: Eviction::Lfu, ..spec(16) }, 0, &[]);
        let mut keys = Vec::new();
        let mut ask = |index: &IdIndex, id: u64| {
            index.assign(&[id], Intent::Write, &mut keys, |_, _| Ok(())).unwrap();
            keys[0]
        };
        for id in 0..16 {
            assert!(matches!(ask(&index, id), Assigned::Key(_)));
        }
        for _ in 0..5 {
            for id in 0..8 {
                index.lookup(id);
            }
        }
        let mut offered: Vec<u64> = index.offer_round(8, Pass::Short, |_| false).into_iter().map(|(id, _)| id).collect();
        offered.sort_unstable();
        assert_eq!(offered, (8..16).collect::<Vec<_>>(), "the least used are offered");
        let freed: Vec<u64> = index.finish_round(&crate::util::FastMap::default()).into_iter().map(|(key, _)| key).collect();
        assert_eq!(freed.len(), 8);
        index.free_slots(&freed, Vec::new());
        for id in 100..106 {
            assert!(matches!(ask(&index, id), Assigned::Key(_)), "room enough: id {id} admitted");
        }
        assert_eq!(ask(&index, 200), Assigned::NotAdmitted, "short of room, an id never seen waits");
        assert!(matches!(ask(&index, 8), Assigned::Key(_)), "an evicted id that had uses comes back");
        let (live, evicted, deferred) = index.home_counts();
        assert_eq!((live, evicted, deferred), (15, 8, 1));
    }

    /// Bad rules are refused with what is wrong.
    #[test]
    fn bad_rules_are_refused() {
        for (text, says) in [
            ("gauss", "expected zeros"),
            ("normal", "needs a standard deviation"),
            ("uniform:-1", "at least 0"),
            ("normal:1:x", "seed 'x'"),
            ("zeros:1", "unexpected"),
        ] {
            let e = text.parse::<Init>().unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
        for init in [Init::Zeros, Init::Uniform { scale: 0.25, seed: 9 }, Init::Normal { std: 1.5, seed: 0 }] {
            assert_eq!(init.name().parse::<Init>().unwrap(), init);
        }
    }

    /// Ids spread over the homes about evenly, whatever their pattern.
    #[test]
    fn ids_spread_over_the_homes() {
        let s = spec(1);
        for stride in [1u64, 1 << 32, 1000] {
            let mut per = [0usize; 4];
            for i in 0..40_000u64 {
                per[s.home_of(i.wrapping_mul(stride), 4)] += 1;
            }
            assert!(per.iter().all(|&n| (9_000..11_000).contains(&n)), "stride {stride}: {per:?}");
        }
    }
}
