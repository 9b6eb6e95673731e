//! Node and table configuration, and discovery of the cluster from the environment.

use std::time::Duration;

use crate::error::{Error, Result};

/// Most shards a node can have (shard sets are 64-bit masks).
pub const MAX_SHARDS: usize = 64;
/// Most nodes a cluster may have: ranks stay below the bit that marks a membership change as a
/// join (`protocol::leave`, joins).
pub const MAX_NODES: usize = 0x7fff;

/// How keys are assigned to home nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Partitioning {
    /// Contiguous key ranges of (nearly) equal size, in rank order.
    Range,
    /// Keys scattered over nodes by a multiplicative hash (a bijection of the key space), so
    /// neighbouring keys land on different nodes.
    Hash,
    /// Consistent hashing with virtual nodes (the parameter server, OSDI 2014, Section 4.3):
    /// every node places `virtual_nodes` points on a ring of the scattered keys and homes the
    /// keys from each of its points to the next point, so that a change in the node count
    /// moves about 1/N of the keys where [`Partitioning::Range`] and [`Partitioning::Hash`]
    /// move most of them. More virtual nodes balance the homes better (±1/√virtual_nodes) at
    /// the cost of a larger ring; see [`Partitioning::DEFAULT_VIRTUAL_NODES`].
    Consistent {
        /// Points per node on the ring, 1..=[`Partitioning::MAX_VIRTUAL_NODES`].
        virtual_nodes: u32,
    },
    /// An explicit home per key, from a [`crate::Placement`] (for instance the co-partitioner's
    /// plan, [`crate::copartition`]), given with [`TableSpec::placed`]: a table partitioned so
    /// needs its placement, whose node and key counts must be the cluster's and the table's.
    Placed,
}

impl Partitioning {
    /// Virtual nodes per node when `consistent` is asked for without a count: a home's key
    /// count is then within about ±9 % of the mean (one standard deviation).
    pub const DEFAULT_VIRTUAL_NODES: u32 = 128;
    /// Most virtual nodes per node.
    pub const MAX_VIRTUAL_NODES: u32 = 4096;
    /// Most points on a ring (nodes × virtual nodes), which bounds its memory (16 bytes a
    /// point on every node, per table).
    pub const MAX_RING_POINTS: u64 = 1 << 22;

    /// Consistent hashing with [`Partitioning::DEFAULT_VIRTUAL_NODES`].
    pub fn consistent() -> Partitioning {
        Partitioning::Consistent { virtual_nodes: Partitioning::DEFAULT_VIRTUAL_NODES }
    }

    /// The scheme's name as [`Partitioning::from_str`](std::str::FromStr) reads it: `range`,
    /// `hash` or `consistent:V`.
    pub fn name(&self) -> String {
        match self {
            Partitioning::Range => "range".into(),
            Partitioning::Hash => "hash".into(),
            Partitioning::Consistent { virtual_nodes } => format!("consistent:{virtual_nodes}"),
            Partitioning::Placed => "placed".into(),
        }
    }
}

impl std::str::FromStr for Partitioning {
    type Err = String;

    /// `range`, `hash`, `consistent` (with the default virtual-node count) or `consistent:V`.
    fn from_str(s: &str) -> std::result::Result<Partitioning, String> {
        let expected = "expected range, hash, consistent or consistent:VIRTUAL_NODES";
        match s.trim() {
            "range" => Ok(Partitioning::Range),
            "hash" => Ok(Partitioning::Hash),
            "consistent" => Ok(Partitioning::consistent()),
            "placed" => Err("partitioning 'placed' takes a placement: give the table one with TableSpec::placed (a plan of `ferry partition`)".into()),
            other => {
                let count = other.strip_prefix("consistent:").ok_or_else(|| format!("partitioning '{other}': {expected}"))?;
                match count.parse::<u32>() {
                    Ok(v) if (1..=Partitioning::MAX_VIRTUAL_NODES).contains(&v) => Ok(Partitioning::Consistent { virtual_nodes: v }),
                    _ => Err(format!("partitioning '{other}': the virtual-node count must be a number in 1..={}", Partitioning::MAX_VIRTUAL_NODES)),
                }
            }
        }
    }
}

/// Element type of a table's values. Only `f32` exists today; the enum keeps the door open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// 32-bit IEEE floats.
    F32,
}

impl ElementType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            ElementType::F32 => 4,
        }
    }
}

/// A named table of `keys` parameters, each a dense vector of `value_len` elements.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableSpec {
    /// Name used to look the table up.
    pub name: String,
    /// Number of keys; keys are `0..keys` (for a dynamic table, its slot keys: set when a node
    /// starts, `capacity × nodes`).
    pub keys: u64,
    /// Elements per value.
    pub value_len: usize,
    /// Home-node assignment.
    pub partitioning: Partitioning,
    /// Element type.
    pub element: ElementType,
    /// Keys managed by replication instead of relocation (NuPS, Section 3.2): sorted,
    /// non-overlapping half-open ranges. Every node keeps a replica of each; the home node
    /// holds the authoritative value and the key never relocates. See [`crate::replication`].
    pub replicated: Vec<std::ops::Range<u64>>,
    /// What a push does to a value (the parameter server's server-side update functions,
    /// Section 3.3); `add` by default. See [`crate::update`].
    pub updater: crate::update::Updater,
    /// How values are encoded in messages (the parameter server's value compression, Section
    /// 4.2); exact `f32` by default. See [`crate::codec`].
    pub codec: crate::codec::ValueCodec,
    /// Key caching (the parameter server, Section 4.2): a worker's key lists of at least this
    /// many keys are kept by the receiving node and sent again as their hash; 0 (the default)
    /// is off. See `protocol::keycache`.
    pub key_cache_min: usize,
    /// A scratch table (a trainer's per-epoch figures, counters): left out of checkpoints, and
    /// at zeros after a restore, so that its size may change between the run that wrote a
    /// checkpoint and the one that resumes from it. See `docs/CHECKPOINTS.md`.
    pub scratch: bool,
    /// Feature hashing: workers address the table by raw ids (any `u64`), which Ferry maps to
    /// its `keys` buckets (and signs), or `None` (the default): keys are `0..keys`. See
    /// [`crate::hashing`].
    pub feature_hashing: Option<crate::hashing::FeatureHashing>,
    /// The explicit home of every key, with [`Partitioning::Placed`] (see
    /// [`TableSpec::placed`]); `None` otherwise.
    pub placement: Option<std::sync::Arc<crate::placement::Placement>>,
    /// A dynamic table ([`TableSpec::dynamic`]): workers address it by raw ids, each mapped to
    /// one of `keys` slot keys when first touched; `None` (the default) otherwise. See
    /// [`crate::dynamic`].
    pub dynamic: Option<crate::dynamic::DynamicSpec>,
    /// Ids of a dynamic table managed by replication instead of relocation (NuPS, Section 3.2,
    /// by id: [`TableSpec::replicating_ids`]): sorted and distinct, each created at start-up in
    /// a slot key its home sets aside, with a replica on every node. Empty by default.
    pub replicated_ids: Vec<u64>,
}

impl TableSpec {
    /// A range-partitioned f32 table.
    pub fn new(name: impl Into<String>, keys: u64, value_len: usize) -> TableSpec {
        TableSpec {
            name: name.into(),
            keys,
            value_len,
            partitioning: Partitioning::Range,
            element: ElementType::F32,
            replicated: Vec::new(),
            updater: crate::update::Updater::Add,
            codec: crate::codec::ValueCodec::F32,
            key_cache_min: 0,
            scratch: false,
            feature_hashing: None,
            placement: None,
            dynamic: None,
            replicated_ids: Vec::new(),
        }
    }

    /// A dynamic table of `value_len` floats per value, addressed by raw ids (any `u64`) that
    /// are created when first touched (see [`crate::dynamic`]): each node holds up to
    /// `capacity` ids as their home, so the table has `capacity × nodes` slot keys (its `keys`
    /// once the cluster starts). Values start at zeros ([`TableSpec::initialised`] changes it).
    pub fn dynamic(name: impl Into<String>, value_len: usize, capacity: u64) -> TableSpec {
        let mut spec = TableSpec::new(name, 0, value_len);
        spec.dynamic = Some(crate::dynamic::DynamicSpec {
            capacity,
            init: crate::dynamic::Init::Zeros,
            seed: 0,
            admission: crate::dynamic::Admission::All,
            eviction: crate::dynamic::Eviction::Never,
        });
        spec
    }

    /// The same dynamic table with new ids created only as `admission` says (no effect on a
    /// table that is not dynamic; see [`crate::dynamic::Admission`]).
    pub fn admitting(mut self, admission: crate::dynamic::Admission) -> TableSpec {
        if let Some(d) = &mut self.dynamic {
            d.admission = admission;
        }
        self
    }

    /// The same dynamic table with ids evicted as `eviction` says (no effect on a table that is
    /// not dynamic; see [`crate::dynamic::Eviction`]).
    pub fn evicting(mut self, eviction: crate::dynamic::Eviction) -> TableSpec {
        if let Some(d) = &mut self.dynamic {
            d.eviction = eviction;
        }
        self
    }

    /// The same dynamic table with new ids' values starting as `init` says (no effect on a
    /// table that is not dynamic).
    pub fn initialised(mut self, init: crate::dynamic::Init) -> TableSpec {
        if let Some(d) = &mut self.dynamic {
            d.init = init;
        }
        self
    }

    /// The same table with `ranges` of keys replicated on every node (overlapping or unsorted
    /// ranges are merged; empty ones dropped).
    pub fn replicating(mut self, ranges: impl IntoIterator<Item = std::ops::Range<u64>>) -> TableSpec {
        let mut all: Vec<std::ops::Range<u64>> = self.replicated.drain(..).chain(ranges).filter(|r| r.start < r.end).collect();
        all.sort_by_key(|r| r.start);
        let mut merged: Vec<std::ops::Range<u64>> = Vec::with_capacity(all.len());
        for r in all {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        self.replicated = merged;
        self
    }

    /// The same table with the given keys replicated (see [`TableSpec::replicating`]).
    pub fn replicating_keys(self, keys: impl IntoIterator<Item = u64>) -> TableSpec {
        self.replicating(keys.into_iter().map(|k| k..k.saturating_add(1)))
    }

    /// The same dynamic table with `ids` replicated (NuPS's hot keys, named by raw id): each is
    /// created when the cluster starts, in a slot key its home sets aside (no eviction round
    /// offers it), with its initial value on every node; pushes go to the node's replica and
    /// reach the home within the staleness bound, as for [`TableSpec::replicating`] on a dense
    /// table. Refused on a table that is not dynamic (use [`TableSpec::replicating_keys`]).
    pub fn replicating_ids(mut self, ids: impl IntoIterator<Item = u64>) -> TableSpec {
        self.replicated_ids.extend(ids);
        self.replicated_ids.sort_unstable();
        self.replicated_ids.dedup();
        self
    }

    /// Number of replicated keys.
    pub fn replicated_keys(&self) -> u64 {
        self.replicated.iter().map(|r| r.end - r.start).sum()
    }

    /// The same table with pushes applied by `updater` (see [`crate::update`]).
    pub fn with_updater(mut self, updater: crate::update::Updater) -> TableSpec {
        self.updater = updater;
        self
    }

    /// The same table with values compressed by `codec` on the wire.
    pub fn compressed(mut self, codec: crate::codec::ValueCodec) -> TableSpec {
        self.codec = codec;
        self
    }

    /// The same table with key caching for key lists of at least `min_keys` keys (0: off).
    pub fn cache_keys(mut self, min_keys: usize) -> TableSpec {
        self.key_cache_min = min_keys;
        self
    }

    /// Floats of optimizer state kept next to each value.
    pub fn state_len(&self) -> usize {
        self.updater.state_len(self.value_len)
    }

    /// The same table as a scratch table: left out of checkpoints (see [`TableSpec::scratch`]).
    pub fn scratch(mut self) -> TableSpec {
        self.scratch = true;
        self
    }

    /// The same table addressed by raw ids, hashed into its `keys` buckets by `hashing` (see
    /// [`crate::hashing`]).
    pub fn feature_hashed(mut self, hashing: crate::hashing::FeatureHashing) -> TableSpec {
        self.feature_hashing = Some(hashing);
        self
    }

    /// The same table with another partitioning (dropping a placement, unless it is
    /// [`Partitioning::Placed`]).
    pub fn partitioned(mut self, partitioning: Partitioning) -> TableSpec {
        self.partitioning = partitioning;
        if partitioning != Partitioning::Placed {
            self.placement = None;
        }
        self
    }

    /// The same table with every key homed where `placement` says ([`Partitioning::Placed`]):
    /// the placement must be for the cluster's node count and place exactly the table's keys.
    pub fn placed(mut self, placement: std::sync::Arc<crate::placement::Placement>) -> TableSpec {
        self.partitioning = Partitioning::Placed;
        self.placement = Some(placement);
        self
    }
}

/// Which fabric carries the cluster's traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// Verbs when every node has an active verbs port, TCP otherwise.
    Auto,
    /// TCP only.
    Tcp,
    /// Verbs only; start-up fails without an active port.
    Verbs,
}

/// How the intent service times its actions (AdaPM, Section 4.2, Algorithm 1). Local to a
/// node: nodes may differ.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IntentSettings {
    /// Communication round of the intent service: rounds start at most this often (earlier only
    /// when a worker's barrier waits for one; a grant in between is acted on at once). While no
    /// round moves a window, with nothing in flight and no replica kept, rounds come up to 8
    /// round times apart, and while no worker advances the service sleeps.
    pub round: Duration,
    /// Smoothing factor α of the clocks-per-round estimate, in (0, 1].
    pub alpha: f64,
    /// Quantile `p` of the Poisson bound on how far a worker gets in `rounds_ahead` rounds, in
    /// [0.5, 1).
    pub quantile: f64,
    /// How many rounds ahead the service acts on an intent (AdaPM: two, the round in which it
    /// acts and the next), in 1..=16. Here an action is a level told to the key's home, whose
    /// grant comes back and is taken at the service's next round before the relocation or the
    /// replica's pull even starts, so two rounds leave the slowest of those too little time
    /// (`docs/INTENT.md`, "Action timing"). `FERRY_INTENT_AHEAD` sets it.
    pub rounds_ahead: u32,
    /// Initial estimate of clocks per round (AdaPM: 10, which acts early until the estimate has
    /// learned the real rate).
    pub initial_rate: f64,
    /// A window that begins at most this many clocks after a window of the same worker on the
    /// same key ends extends it: the node keeps needing the key across the gap, instead of
    /// releasing it (or dropping its replica) and asking for it again a few clocks later. Larger
    /// gaps hold keys longer; a gap as long as the time until another node needs a key turns a
    /// hand-over into sharing. `FERRY_INTENT_GAP` sets it.
    pub gap: u64,
    /// The gap, instead of `gap`, on the keys of a table whose keys the homes have had this
    /// node share with others (it was granted a replica of one): there, a key several nodes
    /// use is best kept where it is, with replicas, than moved whenever one of its users pauses
    /// (`docs/INTENT.md`, "Aggregation per node"). Tables whose keys pass from node to node
    /// (MF's blocks) never get a replica and keep `gap`. `FERRY_INTENT_SHARED_GAP` sets it.
    pub shared_gap: u64,
}

impl Default for IntentSettings {
    /// AdaPM's untuned settings (α = 0.1, p = 0.9999, 10 clocks per round), 1 ms rounds, acting
    /// four rounds ahead, and gaps of up to 4 clocks bridged (64 on tables whose keys are shared).
    fn default() -> Self {
        IntentSettings { round: Duration::from_millis(1), alpha: 0.1, quantile: 0.9999, initial_rate: 10.0, rounds_ahead: 4, gap: 4, shared_gap: 64 }
    }
}

/// Which verbs device, port and GID a node uses, and how its messaging buffers are sized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsSettings {
    /// Device names; rank `r` uses entry `r % len` (several ranks per host, one HCA each).
    /// Empty: the first device with an active port.
    pub devices: Vec<String>,
    /// Port number; `None`: the first active port.
    pub port: Option<u8>,
    /// GID index; `None`: the port GID on InfiniBand, a RoCE v2 GID (IPv4-mapped first) on RoCE.
    pub gid_index: Option<u32>,
    /// Receive buffers (and so send credits) per peer.
    pub buffers: usize,
    /// Bytes per message buffer; longer frames travel in several SENDs.
    pub buffer_bytes: usize,
    /// How long the completion poller keeps polling after the last completion before it blocks
    /// on the completion channel: spinning answers in nanoseconds but takes a core, which an
    /// oversubscribed host (more busy threads than cores) pays for in scheduling delays.
    pub poll_spin: std::time::Duration,
}

impl Default for VerbsSettings {
    fn default() -> Self {
        VerbsSettings { devices: Vec::new(), port: None, gid_index: None, buffers: 64, buffer_bytes: 32 << 10, poll_spin: std::time::Duration::from_micros(50) }
    }
}

impl VerbsSettings {
    /// The device name rank `rank` should use, if any is configured.
    pub fn device_for(&self, rank: usize) -> Option<&str> {
        (!self.devices.is_empty()).then(|| self.devices[rank % self.devices.len()].as_str())
    }
}

impl std::str::FromStr for TransportChoice {
    type Err = Error;

    fn from_str(s: &str) -> Result<TransportChoice> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(TransportChoice::Auto),
            "tcp" => Ok(TransportChoice::Tcp),
            "verbs" | "rdma" => Ok(TransportChoice::Verbs),
            other => Err(Error::Config(format!("transport '{other}' is not one of auto, verbs, tcp"))),
        }
    }
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Verbs => "verbs",
        })
    }
}

/// Whether parameter arenas may use huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePages {
    /// Explicit huge pages (`MAP_HUGETLB`), else transparent huge pages, else normal pages.
    Auto,
    /// Normal pages only.
    Off,
}

/// Everything a node needs to start.
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's rank, `0..nodes`.
    pub rank: usize,
    /// Number of nodes in the cluster.
    pub nodes: usize,
    /// `host:port` where rank 0 runs the rendezvous.
    pub coordinator: String,
    /// The tables, identical on every node.
    pub tables: Vec<TableSpec>,
    /// Number of striped latches (`key mod L`) guarding local parameter access.
    pub latches: usize,
    /// Fabric selection.
    pub transport: TransportChoice,
    /// Verbs device selection and buffer sizes (used when the fabric is verbs).
    pub verbs: VerbsSettings,
    /// Whether `localize` moves parameters. Off gives a classic parameter server in which every
    /// key stays at its home node and `localize` completes at once without moving anything.
    pub relocation: bool,
    /// Backups per key (the parameter server, OSDI 2014, Sections 4.3–4.4): with `k ≥ 1`,
    /// every key's value and updater state are also kept on the next `k` live nodes after its
    /// owner, a push is acknowledged only once its effect is on all of them, and when a node is
    /// lost its first live successor takes its keys over (docs/ARCHITECTURE.md, "A lost node"):
    /// up to `k` nodes may be lost at once without losing an acknowledged push. `k` is at most
    /// the node count less one. `0` (the default) keeps today's behaviour and speed: a lost
    /// node's keys are lost. `FERRY_BACKUPS` sets it. With `relocation`, a key away from its
    /// home is backed up at the home, a relocation waits for one backup round, a loss is
    /// followed by a census of where every key is (docs/ARCHITECTURE.md, "Backups with
    /// relocation"), intent moves keys but replicates none, a node that leaves gives the keys
    /// of other homes back first, and nodes cannot join yet. Tables with replicated keys are
    /// refused.
    pub backups: usize,
    /// Per-node location caches (see the consistency notes on [`crate::Worker`]).
    pub location_caches: bool,
    /// Huge-page use for parameter arenas.
    pub huge_pages: HugePages,
    /// A peer silent for this long is declared lost.
    pub peer_timeout: Duration,
    /// Idle connections send heartbeats this often.
    pub heartbeat: Duration,
    /// A remote operation (or an incoming relocation) that takes longer fails with a timeout.
    pub op_timeout: Duration,
    /// How long cluster start-up may take.
    pub connect_timeout: Duration,
    /// Largest protocol message; a single value must fit one.
    pub max_message_bytes: usize,
    /// Bytes queued for one peer beyond which workers wait before issuing more (backpressure,
    /// bounded by `op_timeout`); a peer whose queue reaches four times this, or takes nothing
    /// for `peer_timeout`, is declared lost. `FERRY_SEND_QUEUE_LIMIT` sets it (e.g. `64M`).
    /// Over TCP; over verbs the peer's receive credits bound what is in flight.
    pub send_queue_limit: usize,
    /// Over TCP, reader threads of this node that may busy-poll their connections at once, so
    /// that a request finds its reader awake (single-key latency without a wake-up); each takes
    /// a core while traffic comes. `None` (the default, `FERRY_POLL_CORES=auto`) chooses from
    /// the machine: one when every node on the host has four cores or more, else none
    /// ([`ferry_tcp::auto_poll_readers`]). A worker waiting for an answer reads its
    /// connections itself whatever this says.
    pub poll_cores: Option<usize>,
    /// Large operations are split into parts of about this many bytes, so that their parts
    /// stream through sender, network and receiver at the same time.
    pub part_bytes: usize,
    /// Shards of the protocol state (1..=64), each behind its own lock: threads working on keys
    /// of different shards do not wait for each other. Local to this node (nodes may differ).
    pub shards: usize,
    /// Replicas of replicated keys include every push acknowledged anywhere at least this long
    /// ago (NuPS's time-based staleness bound, Section 3.2): each node ships its replicas'
    /// accumulated updates to their home nodes and refreshes its replicas every half of it.
    /// `FERRY_STALENESS` sets it.
    pub staleness: Duration,
    /// Bounded delay (the parameter server, Sections 3.4–3.5): with `Some(τ)` no worker starts
    /// clock `c` ([`crate::Worker::advance_clock`]) before every worker has completed clock
    /// `c − τ − 1`; `Some(0)` is bulk synchronous, `None` (the default) fully asynchronous.
    /// `FERRY_MAX_DELAY` sets it (a number, or `inf`).
    pub max_delay: Option<u64>,
    /// Timing of the intent service ([`crate::Worker::intent`]).
    pub intent: IntentSettings,
    /// Who may join the cluster: the shared secret (`FERRY_SECRET`, or the contents of
    /// `FERRY_SECRET_FILE`) and the job id (`FERRY_JOB_ID`, else Slurm's `SLURM_JOB_ID`). Without
    /// a secret the cluster must run on loopback (see docs/SECURITY.md).
    pub membership: ferry_tcp::Membership,
    /// Refuse to start without a secret (`FERRY_REQUIRE_SECRET=1`).
    pub require_secret: bool,
    /// Start a cluster of more than one node without a secret, knowingly (`FERRY_NO_SECRET=1`):
    /// on loopback only, where then any local user can join it and read its parameters. Without
    /// this, such a cluster is refused.
    pub no_secret: bool,
    /// Fault injection for tests: sending to peer `.0` fails after `.1` more send operations
    /// (a `sendmsg` over TCP, a post over verbs), and the connection breaks as it would on a
    /// real failure. `FERRY_FAIL_SENDS=peer:count` sets it.
    pub fail_sends_after: Option<(usize, u64)>,
    /// Fault injection for tests: over TCP, this node stops reading from every connection after
    /// that many frames while it goes on sending, like a member whose receiving side is stuck.
    /// `FERRY_STOP_READING_AFTER=frames` sets it.
    pub stop_reading_after: Option<u64>,
    /// Start from the checkpoint in this directory ([`crate::Node::checkpoint`]), which may
    /// have been written by another node count and partitioning: every node loads the keys it
    /// is home of. `FERRY_RESTORE` sets it.
    pub restore_from: Option<std::path::PathBuf>,
    /// Where the homes of dynamic tables that evict write the ids they evict with their values
    /// (`DIR/TABLE.node-RANK.spill`, see [`crate::dynamic::read_spill`]): an archive of what
    /// the table learnt of ids it let go, which checkpoints include and a restore carries on.
    /// An evicted id still reads as new. A file of an earlier run is renamed aside, never
    /// overwritten. `FERRY_SPILL_DIR` sets it; `None` (the default): evicted rows are dropped.
    pub spill_dir: Option<std::path::PathBuf>,
    /// Join a running cluster in this node's rank (that of a node that left or was lost)
    /// through this contact, instead of starting with the others: [`crate::Node::start`] then
    /// does what [`crate::Node::join`] does. `FERRY_JOIN` sets it: a member's join address, or
    /// `1` for `FERRY_COORDINATOR` (rank 0 takes joins at its rendezvous address).
    pub join: Option<String>,
    /// Serve this node's statistics for Prometheus on `HOST:(PORT + rank)` for this base
    /// `HOST:PORT` (`GET /metrics`, OpenMetrics text; see `docs/ENVIRONMENT.md`).
    /// `FERRY_METRICS` sets it.
    pub metrics: Option<String>,
}

/// Replicated keys per table must stay below this (their ordinals are `u32` markers).
const ARRIVING_LIMIT: u64 = (u32::MAX - 2) as u64;

/// The value of variable `name` from `get`, trimmed; `None` if unset or blank (a blank variable
/// leaves its setting as it is, like an unset one).
fn set_value(get: &impl Fn(&str) -> Option<String>, name: &str) -> Option<String> {
    get(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// Parses a duration with a unit: `250ms`, `30s`, `1.5m`, `2h`.
pub fn parse_duration(name: &str, value: &str) -> Result<Duration> {
    let bad = || Error::Config(format!("{name}='{value}' is not a duration: give a number with a unit (ms, s, m, h), e.g. 30s"));
    let split = value.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(bad)?;
    let (number, unit) = value.split_at(split);
    let number: f64 = number.parse().map_err(|_| bad())?;
    let seconds = match unit.trim() {
        "ms" => number / 1e3,
        "s" => number,
        "m" | "min" => number * 60.0,
        "h" => number * 3600.0,
        _ => return Err(bad()),
    };
    if seconds.is_nan() || seconds <= 0.0 || seconds > 365.0 * 86_400.0 {
        return Err(Error::Config(format!("{name}='{value}' must be positive and at most a year")));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// Parses a delay bound: a number of clocks, or `inf` / `none` for no bound.
pub fn parse_max_delay(value: &str) -> std::result::Result<Option<u64>, String> {
    match value.trim() {
        "inf" | "none" | "∞" => Ok(None),
        v => v.parse::<u64>().map(Some).map_err(|_| format!("'{v}' is neither a number of clocks nor 'inf'")),
    }
}

/// Parses a size in bytes, with an optional binary unit: `65536`, `512K`, `64M`, `1G`.
pub fn parse_bytes(name: &str, value: &str) -> Result<usize> {
    let bad = || Error::Config(format!("{name}='{value}' is not a size: give bytes, or a number with K, M or G (e.g. 64M)"));
    let split = value.find(|c: char| !c.is_ascii_digit()).unwrap_or(value.len());
    let (number, unit) = value.split_at(split);
    let number: usize = number.parse().map_err(|_| bad())?;
    let shift = match unit.trim().trim_end_matches(['B', 'b', 'i']) {
        "" => 0,
        "K" | "k" => 10,
        "M" | "m" => 20,
        "G" | "g" => 30,
        _ => return Err(bad()),
    };
    number.checked_mul(1 << shift).ok_or_else(bad)
}

/// The shortest cluster secret taken. The membership handshake answers a stranger with a MAC
/// keyed by the secret, which a stranger can test guesses against offline; 32 bytes is what
/// `ferry secret` generates, and out of reach of guessing when generated.
pub const MIN_SECRET_BYTES: usize = 32;

/// Refuses a secret file that anybody but its owner may read (or write), as ssh refuses such
/// a key: the secret in it is no secret.
fn refuse_shared_secret_file(file: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(file).map_err(|e| Error::Config(format!("FERRY_SECRET_FILE={file}: {e}")))?.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(Error::Config(format!(
            "FERRY_SECRET_FILE={file} may be read or written by others than its owner (mode {:o}): `chmod 600 {file}`",
            mode & 0o777
        )));
    }
    Ok(())
}

/// A fresh cluster secret: 32 random bytes from the operating system, as 64 hexadecimal digits.
pub fn generate_secret() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; MIN_SECRET_BYTES];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Config {
    /// A single-node configuration with default settings.
    pub fn new(tables: Vec<TableSpec>) -> Config {
        Config {
            rank: 0,
            nodes: 1,
            coordinator: "127.0.0.1:0".into(),
            tables,
            latches: 1000,
            transport: TransportChoice::Auto,
            verbs: VerbsSettings::default(),
            relocation: true,
            backups: 0,
            location_caches: false,
            huge_pages: HugePages::Auto,
            peer_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_millis(500),
            op_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(60),
            max_message_bytes: 4 << 20,
            send_queue_limit: 256 << 20,
            poll_cores: None,
            part_bytes: 256 << 10,
            shards: 16,
            staleness: Duration::from_millis(40),
            max_delay: None,
            intent: IntentSettings::default(),
            membership: ferry_tcp::Membership::default(),
            require_secret: false,
            no_secret: false,
            fail_sends_after: None,
            stop_reading_after: None,
            restore_from: None,
            spill_dir: None,
            join: None,
            metrics: None,
        }
    }

    /// Spills evicted rows into `dir` (see [`Config::spill_dir`]).
    pub fn spilling_to(mut self, dir: impl Into<std::path::PathBuf>) -> Config {
        self.spill_dir = Some(dir.into());
        self
    }

    /// Starts from the checkpoint in `dir` (see [`Config::restore_from`]).
    pub fn restoring_from(mut self, dir: impl Into<std::path::PathBuf>) -> Config {
        self.restore_from = Some(dir.into());
        self
    }

    /// A configuration whose rank, node count and coordinator come from the environment (see
    /// [`ClusterEnv::detect`]), with the transport settings of [`Config::apply_transport_env`].
    pub fn from_env(tables: Vec<TableSpec>) -> Result<Config> {
        let env = ClusterEnv::detect(|name| std::env::var(name).ok())?;
        let mut config = Config::new(tables);
        config.rank = env.rank;
        config.nodes = env.nodes;
        if let Some(c) = env.coordinator {
            config.coordinator = c;
        }
        config.apply_transport_env(|name| std::env::var(name).ok())?;
        config.apply_timeout_env(|name| std::env::var(name).ok())?;
        config.apply_membership_env(|name| std::env::var(name).ok())?;
        if let Some(dir) = set_value(&|name: &str| std::env::var(name).ok(), "FERRY_RESTORE") {
            config.restore_from = Some(dir.into());
        }
        if let Some(dir) = set_value(&|name: &str| std::env::var(name).ok(), "FERRY_SPILL_DIR") {
            config.spill_dir = Some(dir.into());
        }
        if let Some(contact) = set_value(&|name: &str| std::env::var(name).ok(), "FERRY_JOIN").filter(|c| c != "0") {
            config.join = Some(if contact == "1" { config.coordinator.clone() } else { contact });
        }
        // Checked when the node starts serving it (`metrics::address`), naming the variable.
        if let Some(base) = set_value(&|name: &str| std::env::var(name).ok(), "FERRY_METRICS") {
            config.metrics = Some(base);
        }
        Ok(config)
    }

    /// Applies timeouts from the environment, each a number with a unit (`ms`, `s`, `m`, `h`;
    /// e.g. `30s`, `1.5m`): `FERRY_OP_TIMEOUT` (operations and barriers), `FERRY_PEER_TIMEOUT`
    /// (silence after which a peer is lost), `FERRY_START_TIMEOUT` (start-up: rendezvous and
    /// connections), `FERRY_STALENESS` (replicas' staleness bound), `FERRY_INTENT_ROUND` (the
    /// intent service's round time); the intent gaps `FERRY_INTENT_GAP` and
    /// `FERRY_INTENT_SHARED_GAP` (clocks), how many rounds
    /// ahead the intent service acts `FERRY_INTENT_AHEAD`, the delay bound `FERRY_MAX_DELAY`
    /// (clocks, or `inf`), and the backups per key `FERRY_BACKUPS`.
    /// Unset variables leave the settings as they are.
    pub fn apply_timeout_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<()> {
        let set = |name: &str| set_value(&get, name);
        for (name, field) in [
            ("FERRY_OP_TIMEOUT", &mut self.op_timeout),
            ("FERRY_PEER_TIMEOUT", &mut self.peer_timeout),
            ("FERRY_START_TIMEOUT", &mut self.connect_timeout),
            ("FERRY_STALENESS", &mut self.staleness),
            ("FERRY_INTENT_ROUND", &mut self.intent.round),
        ] {
            if let Some(v) = set(name) {
                *field = parse_duration(name, &v)?;
            }
        }
        if let Some(v) = set("FERRY_INTENT_GAP") {
            self.intent.gap = v.parse().map_err(|_| Error::Config(format!("FERRY_INTENT_GAP='{v}' is not a number of clocks")))?;
        }
        if let Some(v) = set("FERRY_INTENT_SHARED_GAP") {
            self.intent.shared_gap = v.parse().map_err(|_| Error::Config(format!("FERRY_INTENT_SHARED_GAP='{v}' is not a number of clocks")))?;
        }
        if let Some(v) = set("FERRY_INTENT_AHEAD") {
            self.intent.rounds_ahead = v.parse().map_err(|_| Error::Config(format!("FERRY_INTENT_AHEAD='{v}' is not a number of rounds")))?;
        }
        if let Some(v) = set("FERRY_MAX_DELAY") {
            self.max_delay = parse_max_delay(&v).map_err(|e| Error::Config(format!("FERRY_MAX_DELAY: {e}")))?;
        }
        if let Some(v) = set("FERRY_BACKUPS") {
            self.backups = v.parse().map_err(|_| Error::Config(format!("FERRY_BACKUPS='{v}' is not a number of backups per key (0 for none, 1 or more)")))?;
        }
        Ok(())
    }

    /// Applies membership settings from the environment: `FERRY_SECRET` (the secret itself) or
    /// `FERRY_SECRET_FILE` (a file holding it; surrounding whitespace is ignored),
    /// `FERRY_JOB_ID` (else `SLURM_JOB_ID`), `FERRY_REQUIRE_SECRET=1` and `FERRY_NO_SECRET=1`.
    /// A secret file that others than its owner may read is refused, as ssh refuses such a key.
    pub fn apply_membership_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<()> {
        let set = |name: &str| set_value(&get, name);
        match (set("FERRY_SECRET"), set("FERRY_SECRET_FILE")) {
            (Some(_), Some(_)) => return Err(Error::Config("set FERRY_SECRET or FERRY_SECRET_FILE, not both".into())),
            (Some(secret), None) => self.membership.secret = Some(secret.into_bytes()),
            (None, Some(file)) => {
                refuse_shared_secret_file(&file)?;
                let text = std::fs::read_to_string(&file).map_err(|e| Error::Config(format!("FERRY_SECRET_FILE={file}: {e}")))?;
                let secret = text.trim();
                if secret.is_empty() {
                    return Err(Error::Config(format!("FERRY_SECRET_FILE={file} is empty")));
                }
                self.membership.secret = Some(secret.as_bytes().to_vec());
            }
            (None, None) => {}
        }
        if let Some(job) = set("FERRY_JOB_ID").or_else(|| set("SLURM_JOB_ID")) {
            self.membership.job = job;
        }
        self.require_secret = match set("FERRY_REQUIRE_SECRET").as_deref() {
            None | Some("0") => self.require_secret,
            Some("1") => true,
            Some(other) => return Err(Error::Config(format!("FERRY_REQUIRE_SECRET='{other}' is neither 0 nor 1"))),
        };
        self.no_secret = match set("FERRY_NO_SECRET").as_deref() {
            None | Some("0") => self.no_secret,
            Some("1") => true,
            Some(other) => return Err(Error::Config(format!("FERRY_NO_SECRET='{other}' is neither 0 nor 1"))),
        };
        Ok(())
    }

    /// Applies transport settings from the environment: `FERRY_TRANSPORT` (`auto`, `verbs`,
    /// `tcp`), `FERRY_VERBS_DEVICE` (a device name, or a comma-separated list indexed by rank),
    /// `FERRY_VERBS_PORT`, `FERRY_VERBS_GID_INDEX`, `FERRY_VERBS_BUFFERS` and
    /// `FERRY_VERBS_BUFFER_BYTES`, `FERRY_VERBS_SPIN_US`, and for fault-injection tests
    /// `FERRY_FAIL_SENDS`. Unset variables leave the settings as they are.
    pub fn apply_transport_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<()> {
        let get = |name: &str| set_value(&get, name);
        if let Some(t) = get("FERRY_TRANSPORT") {
            self.transport = t.parse()?;
        }
        if let Some(d) = get("FERRY_VERBS_DEVICE") {
            self.verbs.devices = d.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
        }
        fn number<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
            value.parse().map_err(|_| Error::Config(format!("{name}='{value}' is not a valid number")))
        }
        if let Some(p) = get("FERRY_VERBS_PORT") {
            self.verbs.port = Some(number("FERRY_VERBS_PORT", &p)?);
        }
        if let Some(g) = get("FERRY_VERBS_GID_INDEX") {
            self.verbs.gid_index = Some(number("FERRY_VERBS_GID_INDEX", &g)?);
        }
        if let Some(b) = get("FERRY_VERBS_BUFFERS") {
            self.verbs.buffers = number("FERRY_VERBS_BUFFERS", &b)?;
        }
        if let Some(b) = get("FERRY_VERBS_BUFFER_BYTES") {
            self.verbs.buffer_bytes = number("FERRY_VERBS_BUFFER_BYTES", &b)?;
        }
        if let Some(s) = get("FERRY_VERBS_SPIN_US") {
            self.verbs.poll_spin = std::time::Duration::from_micros(number("FERRY_VERBS_SPIN_US", &s)?);
        }
        if let Some(b) = get("FERRY_SEND_QUEUE_LIMIT") {
            self.send_queue_limit = parse_bytes("FERRY_SEND_QUEUE_LIMIT", &b)?;
        }
        if let Some(p) = get("FERRY_POLL_CORES") {
            self.poll_cores = if p == "auto" { None } else { Some(number("FERRY_POLL_CORES", &p)?) };
        }
        if let Some(n) = get("FERRY_STOP_READING_AFTER") {
            self.stop_reading_after = Some(number("FERRY_STOP_READING_AFTER", &n)?);
        }
        if let Some(f) = get("FERRY_FAIL_SENDS") {
            let (peer, count) = f.split_once(':').ok_or_else(|| Error::Config(format!("FERRY_FAIL_SENDS='{f}' is not peer:count")))?;
            self.fail_sends_after = Some((number("FERRY_FAIL_SENDS peer", peer)?, number("FERRY_FAIL_SENDS count", count)?));
        }
        Ok(())
    }

    /// Checks the configuration for values that cannot work.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.nodes == 0 || self.nodes > MAX_NODES {
            return bad(format!("node count {} is outside 1..={MAX_NODES}", self.nodes));
        }
        if self.rank >= self.nodes {
            return bad(format!("rank {} is not below the node count {}", self.rank, self.nodes));
        }
        if self.tables.is_empty() {
            return bad("no tables configured".into());
        }
        if self.tables.len() > u16::MAX as usize {
            return bad("too many tables".into());
        }
        if self.latches == 0 {
            return bad("at least one latch is needed".into());
        }
        if !(2..=4096).contains(&self.verbs.buffers) {
            return bad(format!("verbs buffers per peer must be in 2..=4096, not {}", self.verbs.buffers));
        }
        if self.verbs.poll_spin > std::time::Duration::from_secs(1) {
            return bad(format!("the verbs poller's spin must be at most 1 s, not {:?}", self.verbs.poll_spin));
        }
        if !(256..=(16 << 20)).contains(&self.verbs.buffer_bytes) {
            return bad(format!("verbs buffer bytes must be in 256..=16 MiB, not {}", self.verbs.buffer_bytes));
        }
        if self.tables.iter().any(|t| !t.replicated.is_empty()) && self.staleness < Duration::from_millis(1) {
            return bad(format!("the staleness bound must be at least 1 ms, not {:?}", self.staleness));
        }
        if self.membership.secret.as_ref().is_some_and(|s| s.len() < MIN_SECRET_BYTES) {
            return bad(format!(
                "the cluster secret must have at least {MIN_SECRET_BYTES} bytes (a shorter one may fall to guessing): `ferry secret --out FILE` writes one to use as FERRY_SECRET_FILE"
            ));
        }
        if self.membership.secret.is_none() && self.nodes > 1 {
            if self.require_secret {
                return bad("FERRY_REQUIRE_SECRET=1 but no cluster secret is set (FERRY_SECRET or FERRY_SECRET_FILE)".into());
            }
            if !self.no_secret {
                return bad("no cluster secret is set, so anybody who reaches this cluster's ports could join it and read its parameters: \
                     run `ferry secret --out FILE` and set FERRY_SECRET_FILE=FILE on every node (`ferry launch` makes one by itself), \
                     or set FERRY_NO_SECRET=1 to run on loopback without one, open to every local user (docs/SECURITY.md)"
                    .into());
            }
            // Without a secret anybody who reaches the coordinator could join: loopback only.
            use std::net::ToSocketAddrs;
            if let Ok(addrs) = self.coordinator.to_socket_addrs()
                && addrs.into_iter().any(|a| !a.ip().is_loopback())
            {
                return bad(format!(
                    "no cluster secret is set, so the cluster may only run on loopback, but the coordinator is {}: set FERRY_SECRET or FERRY_SECRET_FILE on every node (docs/SECURITY.md)",
                    self.coordinator
                ));
            }
        }
        if self.max_message_bytes < 4096 {
            return bad("max_message_bytes must be at least 4096".into());
        }
        if self.send_queue_limit < 4 * self.max_message_bytes {
            return bad(format!(
                "the send queue limit ({} bytes) must be at least four messages ({} bytes)",
                self.send_queue_limit,
                4 * self.max_message_bytes
            ));
        }
        let i = &self.intent;
        let timing_ok = i.alpha > 0.0 && i.alpha <= 1.0 && (0.5..1.0).contains(&i.quantile) && i.initial_rate.is_finite() && i.initial_rate >= 0.0;
        if !timing_ok {
            return bad(format!("intent timing needs 0 < alpha ≤ 1, 0.5 ≤ quantile < 1 and a finite initial rate ≥ 0, not {i:?}"));
        }
        if !(1..=16).contains(&i.rounds_ahead) {
            return bad(format!("the intent service acts 1 to 16 rounds ahead, not {}", i.rounds_ahead));
        }
        if i.round.is_zero() || i.round > Duration::from_secs(1) {
            return bad(format!("the intent round must be between 0 and 1 s, not {:?}", i.round));
        }
        if self.backups > 0 {
            if self.backups >= self.nodes {
                return bad(format!(
                    "{} backups per key asked for on {} nodes: a key's backups are on other nodes, so at most {} (FERRY_BACKUPS)",
                    self.backups,
                    self.nodes,
                    self.nodes.saturating_sub(1)
                ));
            }
            if let Some(t) = self.tables.iter().find(|t| !t.replicated.is_empty()) {
                return bad(format!(
                    "table '{}' replicates keys, which backups do not cover yet: FERRY_BACKUPS=1 needs tables without replicated keys",
                    t.name
                ));
            }
        }
        if !(1..=MAX_SHARDS).contains(&self.shards) {
            return bad(format!("shards must be in 1..={}, not {}", MAX_SHARDS, self.shards));
        }
        for (i, t) in self.tables.iter().enumerate() {
            if t.name.is_empty() {
                return bad(format!("table {i} has an empty name"));
            }
            if self.tables[..i].iter().any(|o| o.name == t.name) {
                return bad(format!("table name '{}' is used twice", t.name));
            }
            if let Some(d) = &t.dynamic {
                if d.capacity == 0 {
                    return bad(format!("dynamic table '{}' has a capacity of 0 keys per node; it needs at least 1", t.name));
                }
                if self.spill_dir.is_some() && d.eviction.evicts() && !crate::dynamic::spill::name_fits(&t.name) {
                    return bad(format!(
                        "dynamic table '{}' cannot name a spill file (its name holds a path separator): rename it or set no spill_dir",
                        t.name
                    ));
                }
                let keys = d.capacity.checked_mul(self.nodes as u64).filter(|&k| k < u32::MAX as u64 * 1024);
                if keys.is_none() || (t.keys != 0 && Some(t.keys) != keys) {
                    return bad(format!(
                        "dynamic table '{}' holds {} keys per node on {} nodes; it needs fewer than {} in all",
                        t.name,
                        d.capacity,
                        self.nodes,
                        u32::MAX as u64 * 1024
                    ));
                }
                if let Some((home, count)) =
                    crate::dynamic::replicated_per_home(d, &t.replicated_ids, self.nodes).into_iter().enumerate().find(|&(_, n)| n > d.capacity)
                {
                    return bad(format!("dynamic table '{}' replicates {count} ids homed at node {home}, more than its {} keys per node", t.name, d.capacity));
                }
                let refused = if t.partitioning != Partitioning::Range {
                    Some("a partitioning (its ids' homes are a hash of the id)")
                } else if t.replicated != crate::dynamic::replicated_ranges(d, &t.replicated_ids, self.nodes) {
                    Some("replicated ranges of slot keys (replicate ids with TableSpec::replicating_ids)")
                } else if t.feature_hashing.is_some() {
                    Some("feature hashing (a dynamic table maps every id to a key of its own)")
                } else if self.backups > 0 {
                    Some("backups, so far (FERRY_BACKUPS=0: its index of ids would be lost with its node)")
                } else {
                    None
                };
                if let Some(what) = refused {
                    return bad(format!("dynamic table '{}' cannot have {what}", t.name));
                }
            } else if !t.replicated_ids.is_empty() {
                return bad(format!("table '{}' replicates ids, which only a dynamic table has (replicate its keys with TableSpec::replicating_keys)", t.name));
            } else if t.keys == 0 || t.keys >= u32::MAX as u64 * 1024 {
                return bad(format!("table '{}' has {} keys; it needs 1..{}", t.name, t.keys, u32::MAX as u64 * 1024));
            }
            if let Some(r) = t.replicated.iter().find(|r| r.start >= r.end || r.end > t.keys) {
                return bad(format!("table '{}' replicates keys {}..{}, which is empty or beyond its {} keys", t.name, r.start, r.end, t.keys));
            }
            if t.replicated.windows(2).any(|w| w[1].start < w[0].end) {
                return bad(format!("table '{}' has unsorted or overlapping replicated ranges (build them with TableSpec::replicating)", t.name));
            }
            if t.replicated_keys() >= ARRIVING_LIMIT {
                return bad(format!("table '{}' replicates {} keys; at most {} can be replicated", t.name, t.replicated_keys(), ARRIVING_LIMIT - 1));
            }
            if let Err(e) = t.updater.validate() {
                return bad(format!("table '{}': {e}", t.name));
            }
            if !t.replicated.is_empty() && !t.updater.is_add() {
                return bad(format!(
                    "table '{}' replicates keys and applies pushes with {}: replicated keys take only the add updater (a replica's delta is added at the home)",
                    t.name,
                    t.updater.describe()
                ));
            }
            if t.state_len() > (1 << 20) {
                return bad(format!("table '{}': its updater keeps {} floats of state per value; at most {} fit a slot", t.name, t.state_len(), 1 << 20));
            }
            if let Partitioning::Consistent { virtual_nodes } = t.partitioning {
                let points = virtual_nodes as u64 * self.nodes as u64;
                if virtual_nodes == 0 || virtual_nodes > Partitioning::MAX_VIRTUAL_NODES || points > Partitioning::MAX_RING_POINTS {
                    return bad(format!(
                        "table '{}' hashes consistently with {virtual_nodes} virtual nodes per node; it needs 1..={} of them and at most {} points on the ring ({} nodes × {virtual_nodes} = {points})",
                        t.name,
                        Partitioning::MAX_VIRTUAL_NODES,
                        Partitioning::MAX_RING_POINTS,
                        self.nodes
                    ));
                }
            }
            match (&t.placement, t.partitioning) {
                (None, Partitioning::Placed) => return bad(format!("table '{}' is placed but has no placement: give it one with TableSpec::placed", t.name)),
                (Some(p), Partitioning::Placed) if p.nodes() != self.nodes => {
                    return bad(format!(
                        "table '{}' has a placement for {} nodes; this cluster has {}: make a plan for {} nodes",
                        t.name,
                        p.nodes(),
                        self.nodes,
                        self.nodes
                    ));
                }
                (Some(p), Partitioning::Placed) if p.keys() != t.keys => {
                    return bad(format!("table '{}' has {} keys but its placement places {}: the plan was made for other data", t.name, t.keys, p.keys()));
                }
                (Some(_), kind) if kind != Partitioning::Placed => {
                    return bad(format!("table '{}' has a placement but is partitioned by {}: use TableSpec::placed", t.name, kind.name()));
                }
                _ => {}
            }
            if t.value_len == 0 || t.value_len > (self.max_message_bytes - 64) / t.element.size() {
                return bad(format!("table '{}' has values of {} elements; they must fit one message ({} bytes)", t.name, t.value_len, self.max_message_bytes));
            }
        }
        Ok(())
    }

    /// Gives every dynamic table its `capacity × nodes` slot keys (done when a node starts, once
    /// the node count is known).
    pub(crate) fn resolve_dynamic_tables(&mut self) {
        let nodes = self.nodes as u64;
        for t in &mut self.tables {
            if let Some(d) = &t.dynamic {
                t.keys = d.capacity.saturating_mul(nodes);
                // The replicated ids' slot keys as replicated ranges, unless ranges of the
                // caller's are there (which `validate` refuses, naming them).
                let ranges = crate::dynamic::replicated_ranges(d, &t.replicated_ids, self.nodes);
                if t.replicated.is_empty() || t.replicated == ranges {
                    t.replicated = ranges;
                }
            }
        }
    }

    /// A fingerprint of everything that must be identical on all nodes (tables and protocol
    /// switches); nodes compare it at start-up.
    pub fn fingerprint(&self) -> u64 {
        fnv1a(self.fingerprint_text().as_bytes())
    }

    /// The settings the fingerprint covers, as `name=value;` fields (tables as
    /// `table NAME=keys:value_len:partitioning:element:updater:codec:key_cache_min:replicated;`), so that a mismatch can be
    /// named.
    pub fn fingerprint_text(&self) -> String {
        let mut text = format!(
            "nodes={};relocation={};backups={};caches={};transport={:?};staleness={:?};max_delay={:?};tables={};",
            self.nodes,
            self.relocation,
            self.backups,
            self.location_caches,
            self.transport,
            self.staleness,
            self.max_delay,
            self.tables.len()
        );
        for t in &self.tables {
            text.push_str(&format!(
                "table {}={}:{}:{}:{:?}:{}:{}:{}:",
                t.name,
                t.keys,
                t.value_len,
                t.partitioning.name(),
                t.element,
                t.updater.describe(),
                t.codec.name(),
                t.key_cache_min
            ));
            if let Some(h) = t.feature_hashing {
                text.push_str(&format!("hashed {}:", h.name()));
            }
            if let Some(d) = &t.dynamic {
                text.push_str(&format!("dynamic {}:{}:{}:{}:{}:", d.capacity, d.init.name(), d.seed, d.admission.name(), d.eviction.name()));
                if !t.replicated_ids.is_empty() {
                    let digest = fnv1a(&t.replicated_ids.iter().flat_map(|id| id.to_le_bytes()).collect::<Vec<u8>>());
                    text.push_str(&format!("replicated ids {}:{digest:016x}:", t.replicated_ids.len()));
                }
            }
            if let Some(p) = &t.placement {
                text.push_str(&format!("placement {:016x}:", p.digest()));
            }
            for r in &t.replicated {
                text.push_str(&format!("{}-{},", r.start, r.end));
            }
            text.push(';');
        }
        text
    }

    /// The first setting in which two fingerprint texts differ, as "ours vs theirs".
    pub fn first_difference(ours: &str, theirs: &str) -> String {
        let (a, b): (Vec<&str>, Vec<&str>) = (ours.split(';').collect(), theirs.split(';').collect());
        let clip = |s: &str| if s.len() > 120 { format!("{}…", &s[..s.floor_char_boundary(120)]) } else { s.to_string() };
        for i in 0..a.len().max(b.len()) {
            let (x, y) = (a.get(i).copied().unwrap_or("(nothing)"), b.get(i).copied().unwrap_or("(nothing)"));
            if x != y {
                return format!("{} here vs {} there", clip(x), clip(y));
            }
        }
        "nothing (the texts are equal)".into()
    }
}

pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A node's place in the cluster as found in the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterEnv {
    /// This node's rank.
    pub rank: usize,
    /// Number of nodes.
    pub nodes: usize,
    /// Rendezvous address, when given.
    pub coordinator: Option<String>,
    /// Which launcher's variables were used.
    pub source: &'static str,
}

impl ClusterEnv {
    /// Reads, in this order: `FERRY_RANK`/`FERRY_NODES`; torchrun's `RANK`/`WORLD_SIZE` (with
    /// `LOCAL_RANK`, which torchrun sets too, so that a stray `RANK` is not taken for it);
    /// Slurm's `SLURM_PROCID`/`SLURM_NTASKS`; Open MPI's `OMPI_COMM_WORLD_RANK`/
    /// `OMPI_COMM_WORLD_SIZE`; PMI's `PMI_RANK`/`PMI_SIZE`. The rendezvous address is
    /// `FERRY_COORDINATOR`, required for more than one node; under torchrun it defaults to
    /// `MASTER_ADDR` and the port after `MASTER_PORT` (torch.distributed's own rendezvous keeps
    /// `MASTER_PORT`). Without any of these the node runs alone (rank 0 of 1).
    pub fn detect(get: impl Fn(&str) -> Option<String>) -> Result<ClusterEnv> {
        const SOURCES: [(&str, &str, &str); 5] = [
            ("ferry", "FERRY_RANK", "FERRY_NODES"),
            ("torchrun", "RANK", "WORLD_SIZE"),
            ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
            ("open-mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
            ("pmi", "PMI_RANK", "PMI_SIZE"),
        ];
        let coordinator = get("FERRY_COORDINATOR").filter(|c| !c.trim().is_empty());
        for (source, rank_var, size_var) in SOURCES {
            let Some(rank) = get(rank_var) else { continue };
            if source == "torchrun" && get("LOCAL_RANK").is_none() {
                continue;
            }
            let parse = |var: &str, value: &str| -> Result<usize> {
                value.trim().parse::<usize>().map_err(|_| Error::Config(format!("{var}='{value}' is not a non-negative integer")))
            };
            let rank = parse(rank_var, &rank)?;
            let nodes = match get(size_var) {
                Some(v) => parse(size_var, &v)?,
                None => return Err(Error::Config(format!("{rank_var} is set but {size_var} is not"))),
            };
            if nodes == 0 || rank >= nodes {
                return Err(Error::Config(format!("{rank_var}={rank} is not below {size_var}={nodes}")));
            }
            let coordinator = match coordinator {
                None if source == "torchrun" => torchrun_coordinator(&get)?,
                given => given,
            };
            if nodes > 1 && coordinator.is_none() {
                return Err(Error::Config(format!("{nodes} nodes from {source} variables, but FERRY_COORDINATOR (host:port of rank 0) is not set")));
            }
            return Ok(ClusterEnv { rank, nodes, coordinator, source });
        }
        Ok(ClusterEnv { rank: 0, nodes: 1, coordinator, source: "none" })
    }
}

/// Ferry's rendezvous under torchrun: `MASTER_ADDR` and the port after `MASTER_PORT` (the one
/// torch.distributed listens on); `None` without `MASTER_ADDR`.
fn torchrun_coordinator(get: &impl Fn(&str) -> Option<String>) -> Result<Option<String>> {
    let Some(host) = get("MASTER_ADDR").map(|h| h.trim().to_string()).filter(|h| !h.is_empty()) else { return Ok(None) };
    let port = get("MASTER_PORT").ok_or_else(|| Error::Config("MASTER_ADDR is set but MASTER_PORT is not".into()))?;
    let next = port.trim().parse::<u16>().ok().and_then(|p| p.checked_add(1)).ok_or_else(|| {
        Error::Config(format!("MASTER_PORT='{port}' is not a port below 65535 (Ferry's rendezvous takes the port after it; or set FERRY_COORDINATOR)"))
    })?;
    // An IPv6 address needs brackets before the port.
    Ok(Some(if host.contains(':') && !host.starts_with('[') { format!("[{host}]:{next}") } else { format!("{host}:{next}") }))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<ClusterEnv> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        ClusterEnv::detect(|k| map.get(k).cloned())
    }

    #[test]
    fn timeouts_come_from_the_environment_with_units() {
        assert_eq!(parse_duration("X", "250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("X", "1.5m").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("X", "2h").unwrap(), Duration::from_secs(7200));
        for bad in ["30", "s", "-1s", "0s", "1.2.3s", "5 days", "1e3s", "9999999h"] {
            let e = parse_duration("FERRY_OP_TIMEOUT", bad).unwrap_err().to_string();
            assert!(e.contains("FERRY_OP_TIMEOUT"), "{bad}: {e}");
        }
        let vars: HashMap<&str, &str> = [("FERRY_OP_TIMEOUT", "45s"), ("FERRY_PEER_TIMEOUT", "800ms"), ("FERRY_START_TIMEOUT", " 2m ")].into();
        let mut c = Config::new(vec![]);
        c.apply_timeout_env(|k| vars.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!((c.op_timeout, c.peer_timeout, c.connect_timeout), (Duration::from_secs(45), Duration::from_millis(800), Duration::from_secs(120)));
        let mut c = Config::new(vec![]);
        c.apply_timeout_env(|_| None).unwrap();
        assert_eq!(c.op_timeout, Config::new(vec![]).op_timeout, "unset leaves the default");
        assert!(c.apply_timeout_env(|k| (k == "FERRY_PEER_TIMEOUT").then(|| "5".to_string())).is_err(), "a unit is required");
        // The intent service's settings: a round time with a unit, a gap in clocks.
        let vars: HashMap<&str, &str> =
            [("FERRY_INTENT_ROUND", "2ms"), ("FERRY_INTENT_GAP", " 9 "), ("FERRY_INTENT_SHARED_GAP", "40"), ("FERRY_INTENT_AHEAD", "3")].into();
        let mut c = Config::new(vec![]);
        c.apply_timeout_env(|k| vars.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!((c.intent.round, c.intent.gap, c.intent.shared_gap, c.intent.rounds_ahead), (Duration::from_millis(2), 9, 40, 3));
        let e = c.apply_timeout_env(|k| (k == "FERRY_INTENT_AHEAD").then(|| "two".to_string())).unwrap_err().to_string();
        assert!(e.contains("FERRY_INTENT_AHEAD"), "{e}");
        let e = c.apply_timeout_env(|k| (k == "FERRY_INTENT_GAP").then(|| "-1".to_string())).unwrap_err().to_string();
        assert!(e.contains("FERRY_INTENT_GAP"), "{e}");
    }

    #[test]
    fn the_send_queue_limit_comes_from_the_environment_with_units() {
        assert_eq!(parse_bytes("X", "65536").unwrap(), 65536);
        assert_eq!(parse_bytes("X", "512K").unwrap(), 512 << 10);
        assert_eq!(parse_bytes("X", "64M").unwrap(), 64 << 20);
        assert_eq!(parse_bytes("X", "1GiB").unwrap(), 1 << 30);
        for bad in ["", "M", "-1M", "1.5M", "12T", "99999999999999999999G"] {
            let e = parse_bytes("FERRY_SEND_QUEUE_LIMIT", bad).unwrap_err().to_string();
            assert!(e.contains("FERRY_SEND_QUEUE_LIMIT"), "{bad}: {e}");
        }
        let mut c = Config::new(vec![TableSpec::new("t", 10, 1)]);
        c.apply_transport_env(|k| (k == "FERRY_SEND_QUEUE_LIMIT").then(|| "32M".to_string())).unwrap();
        assert_eq!(c.send_queue_limit, 32 << 20);
        c.validate().unwrap();
        c.send_queue_limit = 3 * c.max_message_bytes;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("send queue limit"), "{e}");
    }

    #[test]
    fn busy_polling_readers_come_from_the_environment_or_the_machine() {
        let with = |value: &str| {
            let mut c = Config::new(vec![TableSpec::new("t", 10, 1)]);
            c.apply_transport_env(|k| (k == "FERRY_POLL_CORES").then(|| value.to_string())).map(|()| c.poll_cores)
        };
        assert_eq!(with("2").unwrap(), Some(2));
        assert_eq!(with("0").unwrap(), Some(0));
        assert_eq!(with("auto").unwrap(), None);
        assert_eq!(with(" ").unwrap(), None, "empty leaves the default");
        let e = with("many").unwrap_err().to_string();
        assert!(e.contains("FERRY_POLL_CORES"), "{e}");
        let mut c = Config::new(vec![TableSpec::new("t", 10, 1)]);
        let cores = ferry_tcp::cores();
        assert_eq!(crate::busy_polling_readers(&c, 1), (ferry_tcp::auto_poll_readers(cores, 1), cores));
        c.poll_cores = Some(3);
        assert_eq!(crate::busy_polling_readers(&c, 8).0, 3, "a configured budget is kept");
    }

    #[test]
    fn detection_order_and_errors() {
        assert_eq!(env(&[]).unwrap(), ClusterEnv { rank: 0, nodes: 1, coordinator: None, source: "none" });
        let e = env(&[("FERRY_RANK", "1"), ("FERRY_NODES", "3"), ("FERRY_COORDINATOR", "h:1"), ("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4")]).unwrap();
        assert_eq!((e.rank, e.nodes, e.source), (1, 3, "ferry"));
        let e = env(&[("SLURM_PROCID", "2"), ("SLURM_NTASKS", "4"), ("OMPI_COMM_WORLD_RANK", "0"), ("FERRY_COORDINATOR", "h:1")]).unwrap();
        assert_eq!((e.rank, e.nodes, e.source), (2, 4, "slurm"));
        let e = env(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4"), ("FERRY_COORDINATOR", "h:1")]).unwrap();
        assert_eq!((e.rank, e.source), (3, "open-mpi"));
        let e = env(&[("PMI_RANK", "0"), ("PMI_SIZE", "1")]).unwrap();
        assert_eq!((e.rank, e.nodes, e.source), (0, 1, "pmi"));
        assert!(env(&[("PMI_RANK", "0"), ("PMI_SIZE", "2")]).is_err(), "coordinator required");
        assert!(env(&[("FERRY_RANK", "x"), ("FERRY_NODES", "2")]).is_err());
        assert!(env(&[("FERRY_RANK", "2"), ("FERRY_NODES", "2"), ("FERRY_COORDINATOR", "h:1")]).is_err());
        assert!(env(&[("FERRY_RANK", "0")]).is_err());
    }

    #[test]
    fn torchrun_variables_give_the_rank_and_the_port_after_torchs() {
        let torchrun = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "10.0.0.5"), ("MASTER_PORT", "29500")];
        let e = env(&torchrun).unwrap();
        assert_eq!(e, ClusterEnv { rank: 1, nodes: 2, coordinator: Some("10.0.0.5:29501".into()), source: "torchrun" });
        // Ferry's own variables come first, and FERRY_COORDINATOR overrides the derived address.
        let e = env(&[torchrun.as_slice(), &[("FERRY_COORDINATOR", "h:7")]].concat()).unwrap();
        assert_eq!(e.coordinator.as_deref(), Some("h:7"));
        let e = env(&[torchrun.as_slice(), &[("FERRY_RANK", "0"), ("FERRY_NODES", "3"), ("FERRY_COORDINATOR", "h:7")]].concat()).unwrap();
        assert_eq!((e.rank, e.nodes, e.source), (0, 3, "ferry"));
        // Before Slurm's: torchrun inside an allocation.
        let e = env(&[torchrun.as_slice(), &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]].concat()).unwrap();
        assert_eq!(e.source, "torchrun");
        // A RANK without LOCAL_RANK is not torchrun's.
        assert_eq!(env(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap().source, "none");
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "::1"), ("MASTER_PORT", "29500")]).unwrap();
        assert_eq!(e.coordinator.as_deref(), Some("[::1]:29501"));
        for bad in ["x", "65535", "-1"] {
            let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "h"), ("MASTER_PORT", bad)]).unwrap_err().to_string();
            assert!(e.contains("MASTER_PORT"), "{bad}: {e}");
        }
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]).unwrap_err().to_string();
        assert!(e.contains("FERRY_COORDINATOR"), "{e}");
    }

    #[test]
    fn transport_settings_from_the_environment() {
        let vars = |pairs: &[(&str, &str)]| -> HashMap<String, String> { pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect() };
        let mut c = Config::new(vec![TableSpec::new("a", 10, 1)]);
        let env = vars(&[
            ("FERRY_TRANSPORT", "Verbs"),
            ("FERRY_VERBS_DEVICE", "rxe0, rxe1"),
            ("FERRY_VERBS_GID_INDEX", "3"),
            ("FERRY_VERBS_BUFFERS", "16"),
            ("FERRY_VERBS_SPIN_US", "0"),
        ]);
        c.apply_transport_env(|k| env.get(k).cloned()).unwrap();
        assert_eq!(c.transport, TransportChoice::Verbs);
        assert_eq!((c.verbs.device_for(0), c.verbs.device_for(1), c.verbs.device_for(2)), (Some("rxe0"), Some("rxe1"), Some("rxe0")));
        assert_eq!((c.verbs.gid_index, c.verbs.buffers, c.verbs.port), (Some(3), 16, None));
        assert_eq!(c.verbs.poll_spin, std::time::Duration::ZERO);
        let env = vars(&[("FERRY_TRANSPORT", "carrier-pigeon")]);
        assert!(c.apply_transport_env(|k| env.get(k).cloned()).is_err());
        let env = vars(&[("FERRY_VERBS_PORT", "x")]);
        assert!(c.apply_transport_env(|k| env.get(k).cloned()).is_err());
        c.verbs.buffers = 1;
        assert!(c.validate().is_err());
        let mut d = Config::new(vec![TableSpec::new("a", 10, 1)]);
        let before = d.fingerprint();
        d.transport = TransportChoice::Tcp;
        assert_ne!(d.fingerprint(), before, "nodes must agree on the transport choice");
    }

    #[test]
    fn validation_catches_bad_tables() {
        assert!(Config::new(vec![TableSpec::new("a", 10, 4)]).validate().is_ok());
        assert!(Config::new(vec![]).validate().is_err());
        assert!(Config::new(vec![TableSpec::new("a", 0, 4)]).validate().is_err());
        assert!(Config::new(vec![TableSpec::new("a", 10, 0)]).validate().is_err());
        assert!(Config::new(vec![TableSpec::new("a", 10, 1), TableSpec::new("a", 5, 1)]).validate().is_err());
        let mut c = Config::new(vec![TableSpec::new("a", 10, 1)]);
        c.rank = 1;
        assert!(c.validate().is_err());
        // Ranks stay below the bit that marks a join in the queue of membership changes.
        let mut c = Config::new(vec![TableSpec::new("a", 10, 1)]);
        c.nodes = MAX_NODES + 1;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("node count 32768 is outside 1..=32767"), "{e}");
    }

    #[test]
    fn validation_catches_bad_intent_timing() {
        let ok = Config::new(vec![TableSpec::new("a", 10, 1)]);
        for bad in [0, 17] {
            let mut c = ok.clone();
            c.intent.rounds_ahead = bad;
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("rounds ahead"), "{e}");
        }
        let mut c = ok.clone();
        c.intent.rounds_ahead = 16;
        assert!(c.validate().is_ok());
        c.intent.quantile = 1.0;
        assert!(c.validate().is_err());
    }

    #[test]
    fn a_mismatch_names_the_setting() {
        let a = Config::new(vec![TableSpec::new("emb", 10, 4)]);
        let mut b = a.clone();
        b.staleness = Duration::from_millis(80);
        assert_eq!(Config::first_difference(&a.fingerprint_text(), &b.fingerprint_text()), "staleness=40ms here vs staleness=80ms there");
        let mut c = a.clone();
        c.tables[0].value_len = 8;
        assert!(Config::first_difference(&a.fingerprint_text(), &c.fingerprint_text()).starts_with("table emb=10:4:"));
        assert_ne!(a.fingerprint(), c.fingerprint());
        // Nodes that keep backups and nodes that do not would not understand each other.
        let mut d = a.clone();
        d.backups = 1;
        assert_eq!(Config::first_difference(&a.fingerprint_text(), &d.fingerprint_text()), "backups=0 here vs backups=1 there");
    }

    #[test]
    fn backups_come_from_the_environment() {
        let mut c = Config::new(vec![TableSpec::new("t", 10, 1)]);
        c.apply_timeout_env(|name| (name == "FERRY_BACKUPS").then(|| "1".to_string())).unwrap();
        assert_eq!(c.backups, 1);
        let err = c.apply_timeout_env(|name| (name == "FERRY_BACKUPS").then(|| "two".to_string())).unwrap_err();
        assert!(err.to_string().contains("FERRY_BACKUPS='two'"), "{err}");
    }

    #[test]
    fn membership_from_the_environment_and_its_rules() {
        let secret = "0123456789abcdef0123456789abcdef!";
        let mut c = Config::new(vec![TableSpec::new("t", 4, 1)]);
        c.nodes = 2;
        c.coordinator = "127.0.0.1:7000".into();
        assert!(matches!(c.validate(), Err(Error::Config(m)) if m.contains("FERRY_NO_SECRET=1")), "without a secret, only when asked for");
        c.apply_membership_env(|k| (k == "FERRY_NO_SECRET").then(|| "1".to_string())).unwrap();
        assert!(c.validate().is_ok(), "loopback without a secret, asked for");
        c.coordinator = "10.1.2.3:7000".into();
        assert!(matches!(c.validate(), Err(Error::Config(m)) if m.contains("loopback")), "elsewhere a secret is needed");
        c.apply_membership_env(|k| (k == "FERRY_SECRET").then(|| secret.to_string())).unwrap();
        assert!(c.validate().is_ok());
        assert!(!format!("{c:?}").contains(secret), "the secret is not printed");
        c.apply_membership_env(|k| (k == "SLURM_JOB_ID").then(|| "4242".to_string())).unwrap();
        assert_eq!(c.membership.job, "4242");
        let mut short = Config::new(vec![TableSpec::new("t", 4, 1)]);
        short.apply_membership_env(|k| (k == "FERRY_SECRET").then(|| "a-31-byte-secret-0123456789abcd".to_string())).unwrap();
        assert!(matches!(short.validate(), Err(Error::Config(m)) if m.contains("32 bytes") && m.contains("ferry secret")));
        let mut required = Config::new(vec![TableSpec::new("t", 4, 1)]);
        required.nodes = 2;
        required.apply_membership_env(|k| (k == "FERRY_REQUIRE_SECRET").then(|| "1".to_string())).unwrap();
        assert!(matches!(required.validate(), Err(Error::Config(m)) if m.contains("FERRY_REQUIRE_SECRET")));
        let file = std::env::temp_dir().join(format!("ferry-secret-{}", std::process::id()));
        std::fs::write(&file, format!("  {}\n", generate_secret())).unwrap();
        let path = file.to_str().unwrap().to_string();
        let from_file = |c: &mut Config| c.apply_membership_env(|k| (k == "FERRY_SECRET_FILE").then(|| path.clone()));
        use std::os::unix::fs::PermissionsExt;
        for mode in [0o644, 0o640, 0o604, 0o620] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = from_file(&mut required).unwrap_err().to_string();
            assert!(e.contains(&format!("mode {mode:o}")) && e.contains("chmod 600"), "{e}");
        }
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        from_file(&mut required).unwrap();
        let taken = required.membership.secret.clone().unwrap();
        assert!(taken.len() == 64 && taken.iter().all(u8::is_ascii_hexdigit), "the file's secret, trimmed");
        assert!(required.validate().is_ok());
        assert_ne!(generate_secret(), generate_secret());
        std::fs::remove_file(&file).unwrap();
        let both = |k: &str| matches!(k, "FERRY_SECRET" | "FERRY_SECRET_FILE").then(|| "x".repeat(40));
        assert!(Config::new(vec![]).apply_membership_env(both).is_err());
    }
}
