//! Intents at home nodes (AdaPM, Section 4.1 and Appendix B.2): every node tells a key's home
//! how much it needs the key — `Soon` once the intent service acts on a window (it is within
//! the action horizon), `Now` once a worker's window has started, `None` when its windows ended
//! — and the home answers with INTENT_GO:
//!
//! - **move** the key to a node when that node alone needs it now, or, with nobody needing it
//!   now, alone needs it at all;
//! - **replicate** the key on every other intending node while several intend it — AdaPM
//!   replicates while several nodes have *active* intent (the node holding the key ignores
//!   this). A node that needs the key now gets its replica at once. A node that needs it only
//!   soon gets one in advance unless that rarely pays: if the key is *shared* (several nodes
//!   needed it now at the same time before, and it was not passed on from one node that
//!   needed it now to the next since), or if in its table a node that intended a key
//!   soon while another needed it now went on to need it while the other still did in at
//!   least one of 16 cases (counted per table at each home, the older half of the counts
//!   dropped every 1 024 outcomes; an advance replica is made in the background, an access
//!   that finds no copy waits for the network), or if the table has no such case yet and no
//!   node needs the key now (a training's first clocks, when several nodes declare keys
//!   that all still sit at their homes: without replicas all but the first to start would
//!   be late; a node that intends a key soon while another needs it now waits for the
//!   table's first outcome, and gets its advance replica when that says *contended*). A key
//!   passed from one node to the next
//!   (matrix factorization's blocks: the next user intends a block while its current user
//!   still works on it) is then moved when its current user is done rather than replicated
//!   on its way, while keys several nodes use together (popular entities, words) are
//!   replicated before they are needed. A node keeps its replica until its own intent ends or
//!   the key is moved to it, and the key itself does not move while several need it now, so
//!   it never bounces between the nodes sharing it.
//!
//! A node that needs a key now wins it from nodes that only need it soon, so an early intent
//! for the next phase does not hold a key back from the node using it; the node it is won
//! from is then one of the intending nodes like any other (a replicate grant where they pay,
//! which turns the key's departing value into its replica). Intents never change
//! values or ownership by themselves: a move is an ordinary `localize` issued by the intent
//! service, a replica is kept by the service with ordinary pushes and pulls (see
//! [`crate::intent`]), so every guarantee of relocation holds unchanged.

use std::collections::BTreeMap;

use smallvec::SmallVec;

use super::LOST_OWNER;
use super::step::Step;
use super::wire::{self, msg};
use crate::error::{Error, Result};
use crate::keymap::{KeyMap, KeySet};
use crate::stats::MessageKind;
use crate::util::FastMap;

/// How much a node needs a key: what it tells the key's home node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IntentLevel {
    /// No intent the node acts on (none declared, or none within reach yet).
    #[default]
    None = 0,
    /// A window within the action horizon has not started yet.
    Soon = 1,
    /// A window has started: a worker uses the key now.
    Now = 2,
}

impl IntentLevel {
    /// The level of a wire byte.
    pub fn from_u8(b: u8) -> Option<IntentLevel> {
        match b {
            0 => Some(IntentLevel::None),
            1 => Some(IntentLevel::Soon),
            2 => Some(IntentLevel::Now),
            _ => None,
        }
    }
}

/// Keys per INTENT or INTENT_GO message at most (512 KiB of keys).
const KEYS_PER_MESSAGE: usize = 1 << 16;

/// What a home tells a node to do with a key it intends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Grant {
    /// Move the key to the node (it alone needs it).
    Move,
    /// Keep a replica of the key on the node (several need it now).
    Replicate,
}

impl Grant {
    /// The level byte of an INTENT_GO carrying this grant.
    pub fn to_u8(self) -> u8 {
        self as u8
    }

    /// The grant of an INTENT_GO's level byte.
    pub fn from_u8(b: u8) -> Option<Grant> {
        match b {
            0 => Some(Grant::Move),
            1 => Some(Grant::Replicate),
            _ => None,
        }
    }
}

/// A few nodes, inline: a key is intended by a handful of nodes at a time, and a home makes
/// and drops these per key many thousand times a second.
type FewNodes<T> = SmallVec<[T; 4]>;

/// The intents on one key homed here.
#[derive(Debug, Default)]
struct KeyIntents {
    /// Nodes with intent, and how much they need the key.
    nodes: FewNodes<(u16, IntentLevel)>,
    /// The node last told to take the key, while it still is the one.
    told: Option<u16>,
    /// Nodes told to replicate the key whose intent has not ended since.
    replicating: FewNodes<u16>,
    /// Nodes that intended the key soon while another node needed it now: when they need it
    /// now, whether the other still does is counted for the table ([`Contention`]).
    undecided: FewNodes<u16>,
}

/// Per table, at a home: of the nodes that intended a key soon while another node needed it
/// now (keys not yet shared), how many went on to need it while the other still did
/// (`contended`) and how many only after the other was done (`passed`). Halved every 1 024
/// outcomes, so that it follows a change of the workload.
#[derive(Debug, Default, Clone, Copy)]
struct Contention {
    contended: u32,
    passed: u32,
}

impl Contention {
    fn note(&mut self, contended: bool) {
        if contended {
            self.contended += 1;
        } else {
            self.passed += 1;
        }
        if self.contended + self.passed >= 1024 {
            self.contended /= 2;
            self.passed /= 2;
        }
    }

    /// Whether a node that will need a key soon should get a replica in advance: unless that
    /// is rarely needed (in fewer than one in 16 outcomes). The bar is low because the costs
    /// are lopsided: an advance replica is made in the background, while an access that finds
    /// the key neither here nor replicated waits for the network.
    fn replicate_ahead(&self) -> bool {
        self.contended * 16 > self.passed
    }
}

impl KeyIntents {
    /// Who should hold the key: the only node that needs it now, or, when none needs it now,
    /// the only node that needs it at all; nobody while it is shared.
    fn target(&self) -> Option<u16> {
        let mut now = self.nodes.iter().filter(|n| n.1 == IntentLevel::Now);
        match (now.next(), now.next()) {
            (Some(&(node, _)), None) => Some(node),
            (None, _) if self.nodes.len() == 1 => Some(self.nodes[0].0),
            _ => None,
        }
    }
}

/// Per (node, grant): the keys of one table a node is told about.
pub type Grants = BTreeMap<(u16, Grant), Vec<u64>>;

/// The intents on the keys homed at this node, and what this node was told to do.
#[derive(Debug, Default)]
pub struct IntentHomes {
    /// Per intended key (found through a dense index: updates come in sorted batches, see
    /// [`crate::keymap`]).
    intents: KeyMap<KeyIntents>,
    /// Keys homed here that several nodes needed now at the same time, and that were not
    /// passed on from one node to the next since (a bit per key of a touched page).
    shared: KeySet,
    /// Per table: whether replicas made in advance were needed.
    contention: FastMap<u16, Contention>,
    /// Keys this node was told to take or replicate, per table, for the intent service.
    go: Vec<(u16, Grant, Vec<u64>)>,
    /// Whether keys are only ever moved, never replicated (with backups, which do not cover
    /// run-time replicas: their pushes not yet sent would be lost with their node).
    moves_only: bool,
}

impl IntentHomes {
    /// Keys are only moved from now on, never replicated (see the field).
    pub fn set_moves_only(&mut self) {
        self.moves_only = true;
    }

    /// Node `from` needs `keys` of `table` at `level` now. Returns, per node and grant, the
    /// keys it was not yet told about and now should be.
    pub fn update(&mut self, from: u16, level: IntentLevel, table: u16, keys: impl IntoIterator<Item = u64>) -> Grants {
        let mut go = Grants::new();
        let mut first_outcome_contended = false;
        for key in keys {
            let entry = self.intents.get_or_default(table, key);
            entry.nodes.retain(|n| n.0 != from);
            if level != IntentLevel::None {
                entry.nodes.push((from, level));
            }
            if entry.nodes.is_empty() {
                self.intents.remove(table, key);
                continue;
            }
            let target = entry.target();
            let holder = entry.told;
            if let Some(node) = target.filter(|&t| entry.told != Some(t)) {
                go.entry((node, Grant::Move)).or_default().push(key);
            }
            entry.told = target;
            // A node whose intent ended dropped its replica; while several intend the key,
            // each of them but the one it moves (or last moved) to keeps one: at once if it
            // needs the key now, in advance if that is likely to pay (see the module's notes).
            let KeyIntents { nodes, replicating, undecided, .. } = entry;
            replicating.retain(|r| nodes.iter().any(|n| n.0 == *r) && Some(*r) != target);
            let needing_now = nodes.iter().filter(|n| n.1 == IntentLevel::Now).count();
            let contended = needing_now >= 2;
            let mut shared = self.shared.contains(table, key);
            if let Some(i) = undecided.iter().position(|&n| n == from).filter(|_| level != IntentLevel::Soon) {
                undecided.swap_remove(i);
                if level == IntentLevel::Now {
                    if !shared {
                        first_outcome_contended |= contended && !self.contention.contains_key(&table);
                        self.contention.entry(table).or_default().note(contended);
                    } else if !contended {
                        // A shared key passed on from one node to the next: it is no longer
                        // used together (a workload's phase changed), and the table's counts
                        // decide again until several nodes need it now at the same time again.
                        self.shared.remove(table, key);
                        shared = false;
                    }
                }
            }
            if contended && !shared {
                self.shared.insert(table, key);
                shared = true;
            }
            if nodes.len() >= 2 && !self.moves_only {
                // A table with no outcomes yet says nothing either way; a key several nodes will
                // need while none needs it yet would otherwise wait until one of their windows
                // starts, late for every other node (a training's first clocks, when every key
                // still is at its home), so AdaPM's own rule applies: replicas on all of them.
                let ahead = shared
                    || match self.contention.get(&table) {
                        Some(counts) => counts.replicate_ahead(),
                        None => needing_now == 0,
                    };
                // The node last told to take the key keeps it while nobody else is, and needs no
                // replica; once the key moves on, it is one of the intending nodes like any other:
                // a replicate grant, which reaches it before the request to hand the key over,
                // makes the departing value its replica.
                let keeps = |n: u16| Some(n) == holder && target.is_none();
                for &(node, level) in nodes.iter().filter(|n| Some(n.0) != target && !keeps(n.0)) {
                    if level == IntentLevel::Soon && needing_now > 0 && !undecided.contains(&node) {
                        undecided.push(node);
                    }
                    if !(ahead || level == IntentLevel::Now) {
                        continue;
                    }
                    if !replicating.contains(&node) {
                        replicating.push(node);
                        go.entry((node, Grant::Replicate)).or_default().push(key);
                    }
                }
            }
        }
        if first_outcome_contended && !self.moves_only {
            self.replicate_undecided(table, &mut go);
        }
        go
    }

    /// The first outcome of `table` says that its keys are used together: the nodes that
    /// intended its keys soon while another needed them now, and got nothing while nothing was
    /// known, get their advance replicas now rather than when their windows start (a training's
    /// first clocks declare many keys at once; they would all be late). Once per table.
    fn replicate_undecided(&mut self, table: u16, go: &mut Grants) {
        let keys: Vec<u64> = self.intents.iter().filter(|((t, _), i)| *t == table && !i.undecided.is_empty()).map(|((_, k), _)| k).collect();
        for key in keys {
            let entry = self.intents.get_or_default(table, key);
            let target = entry.target();
            let KeyIntents { nodes, replicating, undecided, .. } = entry;
            for &(node, _) in nodes.iter().filter(|n| n.1 == IntentLevel::Soon && Some(n.0) != target && undecided.contains(&n.0)) {
                if !replicating.contains(&node) {
                    replicating.push(node);
                    go.entry((node, Grant::Replicate)).or_default().push(key);
                }
            }
        }
    }

    /// Node `lost` is gone: its intents end. Returns, per (node, table), the keys a node
    /// should now take.
    pub fn forget_node(&mut self, lost: u16) -> BTreeMap<(u16, u16), Vec<u64>> {
        let mut keys: Vec<(u16, u64)> = self.intents.iter().filter(|(_, i)| i.nodes.iter().any(|n| n.0 == lost)).map(|(k, _)| k).collect();
        keys.sort_unstable();
        let mut go = BTreeMap::new();
        for (table, key) in keys {
            // Fewer nodes share the key now, so the only grants are moves.
            for ((node, _), ks) in self.update(lost, IntentLevel::None, table, [key]) {
                go.entry((node, table)).or_insert_with(Vec::new).extend(ks);
            }
        }
        go
    }

    /// Whether a node intends `key` of `table` (homed here).
    pub fn intends(&self, table: u16, key: u64) -> bool {
        self.intents.get(table, key).is_some()
    }

    /// The nodes with intent on `key` of `table` (homed here), with their levels.
    #[cfg(test)]
    pub fn intenders(&self, table: u16, key: u64) -> Vec<(u16, IntentLevel)> {
        self.intents.get(table, key).map_or_else(Vec::new, |i| i.nodes.to_vec())
    }

    /// Whether this home last told a node other than `requester` to take `key` of `table`,
    /// and still means it to (a move `requester` asks for on an older grant is then declined).
    pub fn granted_elsewhere(&self, table: u16, key: u64, requester: u16) -> bool {
        self.intents.get(table, key).and_then(|i| i.told).is_some_and(|told| told != requester)
    }

    /// Records that this node may move (or replicate) `keys` of `table` here.
    pub fn post_go(&mut self, table: u16, grant: Grant, keys: Vec<u64>) {
        if !keys.is_empty() {
            self.go.push((table, grant, keys));
        }
    }

    /// The keys of `table` whose grants arrived here and wait for the intent service (for the
    /// causes of late accesses), unsorted.
    pub fn waiting_grants(&self, table: u16) -> Vec<u64> {
        self.go.iter().filter(|(t, _, _)| *t == table).flat_map(|(_, _, keys)| keys.iter().copied()).collect()
    }

    /// Takes the moves and replicas this node was told to make.
    pub fn take_go(&mut self) -> Vec<(u16, Grant, Vec<u64>)> {
        std::mem::take(&mut self.go)
    }
}

impl Step<'_, '_> {
    /// This node needs `keys` of `table` at `level`: tells each key's home (one message per
    /// home; keys homed here are handled at once). Keys homed at lost nodes are left out.
    pub fn signal_intent(&mut self, table: u16, keys: &[u64], level: IntentLevel) {
        let dir = self.directory();
        let rank = dir.rank();
        let mut per_home: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
        for &key in keys {
            let home = dir.home(table, key);
            if !dir.is_lost(home) {
                per_home.entry(home).or_default().push(key);
            }
        }
        for (home, keys) in per_home {
            if home == rank {
                self.intents_at_home(rank, level, table, keys);
            } else {
                self.send_intent_messages(home, msg::INTENT, level as u8, table, &keys);
            }
        }
    }

    /// Tells each node of `go` that it may move its keys of `table` (this node itself through
    /// its mailbox).
    /// Keys whose value went with a lost node are left out: a move or replica of them could
    /// only fail, again at each change of their intents.
    fn send_go(&mut self, table: u16, go: Grants) {
        let dir = self.directory();
        let rank = dir.rank();
        for ((node, grant), mut keys) in go {
            keys.retain(|&key| {
                let owner = dir.owner(table, key);
                owner != LOST_OWNER && !dir.is_lost(owner)
            });
            if keys.is_empty() {
                continue;
            }
            if node == rank {
                self.core.post_intent_go(table, grant, keys);
            } else if !self.directory().is_lost(node) {
                self.send_intent_messages(node, msg::INTENT_GO, grant.to_u8(), table, &keys);
            }
        }
    }

    /// Queues INTENT or INTENT_GO (`ty`) messages for `keys` to node `to`, at most
    /// `KEYS_PER_MESSAGE` keys each.
    fn send_intent_messages(&mut self, to: u16, ty: u8, level: u8, table: u16, keys: &[u64]) {
        for chunk in keys.chunks(KEYS_PER_MESSAGE) {
            let buf = self.tx.buf(to);
            let before = buf.len();
            wire::encode_intent(buf, ty, level, table, chunk);
            let bytes = self.tx.buf(to).len() - before;
            self.tx.sent(to, MessageKind::Localize, bytes);
        }
    }

    /// Checks that `table` exists and every key is within it (and, for INTENT, homed here).
    fn intent_keys(&self, what: &str, table: u16, keys: impl Iterator<Item = u64>, homed_here: bool) -> Result<Vec<u64>> {
        let dir = self.directory();
        let meta = dir.table(table).ok_or_else(|| Error::Protocol(format!("{what} for unknown table {table}")))?;
        let limit = meta.keys;
        let mut out = Vec::with_capacity(keys.size_hint().0);
        for key in keys {
            if key >= limit || (homed_here && dir.home(table, key) != dir.rank()) {
                return Err(Error::Protocol(format!("{what} for key {key} of table {table}, which is not homed here or does not exist")));
            }
            out.push(key);
        }
        Ok(out)
    }

    /// An INTENT from node `from`: updates the key's intenders and tells a sole intender.
    pub(crate) fn handle_intent(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let (level, table, keys) = wire::decode_intent(body)?;
        let keys = self.intent_keys("INTENT", table, keys, true)?;
        self.intents_at_home(from, level, table, keys);
        Ok(())
    }

    /// Node `from` needs `keys` of `table` (homed here) at `level`: updates their intenders
    /// and tells the nodes that should now take or replicate them. On a dynamic table that
    /// evicts, a slot key a node starts to intend must be its id's while it is intended
    /// (`IdIndex::offer_round` leaves intended slot keys out): its id is rescued from a round
    /// under way, and a free slot key, whose id was evicted after the node looked it up, is
    /// not recorded (its grant would move or replicate a slot that a new id may take).
    fn intents_at_home(&mut self, from: u16, level: IntentLevel, table: u16, mut keys: Vec<u64>) {
        let mut homes = self.core.intent_homes().lock();
        if level != IntentLevel::None
            && let Some(index) = self.core.id_index(table)
        {
            let claimed = index.claim_slots(&keys);
            keys = keys.into_iter().zip(claimed).filter_map(|(key, claimed)| claimed.then_some(key)).collect();
        }
        let go = homes.update(from, level, table, keys);
        drop(homes);
        self.send_go(table, go);
    }

    /// An INTENT_GO: hands the keys to the intent service.
    pub(crate) fn handle_intent_go(&mut self, body: &[u8]) -> Result<()> {
        let (level, table, keys) = wire::decode_intent(body)?;
        let grant = Grant::from_u8(level as u8).ok_or_else(|| Error::Protocol(format!("INTENT_GO with grant {}", level as u8)))?;
        let keys = self.intent_keys("INTENT_GO", table, keys, false)?;
        self.core.post_intent_go(table, grant, keys);
        Ok(())
    }

    /// Node `lost` is gone: its intents end, and nodes that now intend a key alone are told.
    pub(crate) fn intents_of_lost_node(&mut self, lost: u16) {
        let go = self.core.intent_homes().lock().forget_node(lost);
        for ((node, table), keys) in go {
            self.send_go(table, Grants::from([((node, Grant::Move), keys)]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A home does not grant keys whose value was lost (their owner was a lost node): the
    /// grantee's move or replica could only fail.
    #[test]
    fn a_home_grants_no_key_whose_value_was_lost() {
        let core = super::super::tests::core_of(1, 3);
        // Keys 10..20 are homed at node 1 (range partitioning); key 11's value was lost.
        let dir = core.directory();
        assert_eq!((dir.home(0, 10), dir.home(0, 11)), (1, 1));
        dir.set_owner(0, 11, LOST_OWNER);
        let mut frame = Vec::new();
        wire::encode_intent(&mut frame, msg::INTENT, IntentLevel::Now as u8, 0, &[10, 11]);
        let body = super::super::tests::answer_to(&core, 2, frame, msg::INTENT_GO);
        let (_, table, keys) = wire::decode_intent(&body).unwrap();
        assert_eq!((table, keys.collect::<Vec<_>>()), (0, vec![10]), "key 11 is not granted");
    }

    #[test]
    fn a_key_goes_to_the_node_that_needs_it_alone() {
        use IntentLevel::*;
        let mut h = IntentHomes::default();
        let go = |n: u16, keys: &[u64]| Grants::from([((n, Grant::Move), keys.to_vec())]);
        let replicate = |nodes: &[u16], keys: &[u64]| nodes.iter().map(|&n| ((n, Grant::Replicate), keys.to_vec())).collect::<Grants>();
        assert_eq!(h.update(1, Soon, 0, [5, 6]), go(1, &[5, 6]));
        assert!(h.update(1, Now, 0, [5]).is_empty(), "already told");
        // Node 2 will need key 5 soon while node 1 needs it now: it stays with node 1, and
        // node 2 gets nothing yet (nothing is known of the table: the key may simply pass on
        // once node 1 is done).
        assert!(h.update(2, Soon, 0, [5]).is_empty());
        // Both need it now: node 2 gets a replica to work on, and the key is shared.
        assert_eq!(h.update(2, Now, 0, [5]), replicate(&[2], &[5]));
        // Node 1 is done: node 2 alone gets the key (and drops its replica).
        assert_eq!(h.update(1, None, 0, [5]), go(2, &[5]));
        // Node 1 will need the shared key soon again: a replica there in advance.
        assert_eq!(h.update(1, Soon, 0, [5]), replicate(&[1], &[5]));
        // Nobody needs it now, both soon: it stays with node 2, which gets no replica.
        assert!(h.update(2, Soon, 0, [5]).is_empty());
        // A node that needs a key now wins it from nodes that only need it soon, which get a
        // replica (node 2 still holds the key: its departing value becomes the replica).
        assert_eq!(h.update(1, Now, 0, [5]), Grants::from([((1, Grant::Move), vec![5]), ((2, Grant::Replicate), vec![5])]));
        assert!(h.update(2, None, 0, [5]).is_empty(), "node 1 was told to take it already");
        assert_eq!(h.intenders(0, 5), vec![(1, Now)]);
        // An end without a beginning changes nothing.
        assert!(h.update(3, None, 0, [5, 9]).is_empty());
        // A lost node's intents end with it.
        h.update(3, Now, 0, [5]);
        assert_eq!(h.forget_node(1), BTreeMap::from([((3, 0), vec![5])]));
        assert!(h.update(3, None, 0, [5]).is_empty() && h.intenders(0, 5).is_empty());
        assert!(h.update(1, None, 0, [6]).is_empty());
        assert!(h.intents.is_empty(), "nothing is kept for keys nobody intends");
    }

    #[test]
    fn a_grant_given_to_another_node_since_makes_an_older_one_stale() {
        use IntentLevel::*;
        let mut h = IntentHomes::default();
        // Node 1 alone will need key 4 soon: it is told to take it.
        assert_eq!(h.update(1, Soon, 0, [4]), Grants::from([((1, Grant::Move), vec![4])]));
        assert!(!h.granted_elsewhere(0, 4, 1));
        // Node 2 needs it now before node 1's move arrived: node 2 is told to take it, and a
        // move node 1 asks for on its older grant is stale.
        assert_eq!(h.update(2, Now, 0, [4]), Grants::from([((2, Grant::Move), vec![4])]));
        assert!(h.granted_elsewhere(0, 4, 1) && !h.granted_elsewhere(0, 4, 2));
        // Node 2 is done: node 1 is told again, and its move is no longer stale.
        assert_eq!(h.update(2, None, 0, [4]), Grants::from([((1, Grant::Move), vec![4])]));
        assert!(!h.granted_elsewhere(0, 4, 1) && h.granted_elsewhere(0, 4, 2));
        // While several need it now nobody is told to take it, so no move is stale; nor is
        // one for a key nobody intends.
        h.update(2, Now, 0, [4]);
        h.update(1, Now, 0, [4]);
        assert!(!h.granted_elsewhere(0, 4, 1) && !h.granted_elsewhere(0, 4, 2));
        assert!(!h.granted_elsewhere(0, 9, 1));
    }

    #[test]
    fn a_key_passed_from_node_to_node_moves_without_replicas() {
        use IntentLevel::*;
        let mut h = IntentHomes::default();
        let go = |n: u16| Grants::from([((n, Grant::Move), vec![7])]);
        // A block passed on in turn: each next user intends it while the current one works.
        assert_eq!(h.update(0, Now, 0, [7]), go(0));
        for (current, next) in [(0, 1), (1, 2), (2, 0)].repeat(6) {
            assert!(h.update(next, Soon, 0, [7]).is_empty(), "no replica for a key that is only passed on");
            assert_eq!(h.update(current, None, 0, [7]), go(next));
            assert!(h.update(next, Now, 0, [7]).is_empty());
        }
        // Two nodes use it together once (one contended outcome against 18 passed on): from
        // then on a node that will need it gets a replica in advance.
        assert_eq!(h.update(1, Now, 0, [7]), Grants::from([((1, Grant::Replicate), vec![7])]));
        // Node 0 alone again: it is told again (it holds the key and ignores that).
        assert_eq!(h.update(1, None, 0, [7]), go(0));
        assert_eq!(h.update(2, Soon, 0, [7]), Grants::from([((2, Grant::Replicate), vec![7])]));
        // But then it is passed on again (node 2 needs it only once node 0 is done): it is no
        // longer shared, and the next node that will need it gets no replica in advance.
        assert_eq!(h.update(0, None, 0, [7]), go(2));
        assert!(h.update(2, Now, 0, [7]).is_empty());
        assert!(h.update(0, Soon, 0, [7]).is_empty(), "passed on since: no longer shared");
        // Used together again, it is shared again.
        assert_eq!(h.update(0, Now, 0, [7]), Grants::from([((0, Grant::Replicate), vec![7])]));
        assert_eq!(h.update(0, None, 0, [7]), go(2));
        assert_eq!(h.update(1, Soon, 0, [7]), Grants::from([((1, Grant::Replicate), vec![7])]));
        // Other keys of the table are still passed on without replicas (fewer than one in 16
        // outcomes was contended).
        assert_eq!(h.update(0, Now, 0, [8]), Grants::from([((0, Grant::Move), vec![8])]));
        assert!(h.update(1, Soon, 0, [8]).is_empty());
    }

    #[test]
    fn a_table_whose_keys_are_used_together_gets_replicas_in_advance() {
        use IntentLevel::*;
        let mut h = IntentHomes::default();
        let replicate = |n: u16, key: u64| Grants::from([((n, Grant::Replicate), vec![key])]);
        // Keys of table 0 are used by two nodes at once each time: node 1 intends each soon while
        // node 0 needs it now, and then needs it while node 0 still does.
        h.update(0, Now, 0, [0]);
        assert!(h.update(1, Soon, 0, [0]).is_empty(), "nothing known yet");
        assert_eq!(h.update(1, Now, 0, [0]), replicate(1, 0));
        // From then on, a node that will need a new key of that table soon gets its replica in
        // advance.
        for key in 1..4 {
            h.update(0, Now, 0, [key]);
            assert_eq!(h.update(1, Soon, 0, [key]), replicate(1, key), "key {key}");
            assert!(h.update(1, Now, 0, [key]).is_empty(), "key {key}: it has its replica");
        }
        // Table 1 learned nothing: its keys wait.
        h.update(0, Now, 1, [10]);
        assert!(h.update(1, Soon, 1, [10]).is_empty());
        // Passed-on outcomes outweigh the contended ones 16 to 1 again: advance replicas stop.
        for key in 20..90 {
            h.update(0, Now, 0, [key]);
            h.update(1, Soon, 0, [key]);
            h.update(0, None, 0, [key]);
            h.update(1, Now, 0, [key]);
        }
        h.update(0, Now, 0, [100]);
        assert!(h.update(1, Soon, 0, [100]).is_empty());
    }

    #[test]
    fn a_key_several_nodes_will_need_before_their_table_has_outcomes_is_replicated_in_advance() {
        use IntentLevel::*;
        let mut h = IntentHomes::default();
        let go = |n: u16, key: u64| Grants::from([((n, Grant::Move), vec![key])]);
        let replicate = |n: u16, key: u64| Grants::from([((n, Grant::Replicate), vec![key])]);
        // A training's first clocks: node 1 will need key 3 soon and is told to take it; node 2
        // will need it soon too, nobody needs it now and nothing is known of the table: node 2
        // gets a replica in advance instead of waiting for its window to start.
        assert_eq!(h.update(1, Soon, 0, [3]), go(1, 3));
        assert_eq!(h.update(2, Soon, 0, [3]), replicate(2, 3));
        // A node that will need a key while another needs it now still gets nothing before the
        // table's first outcome: the key may simply be passed on (matrix factorization's blocks).
        h.update(0, Now, 2, [9]);
        assert!(h.update(1, Soon, 2, [9]).is_empty());
        // Once a table's outcomes say that its keys are passed on, several nodes that will need
        // a key soon get no replicas either.
        h.update(0, Now, 1, [7]);
        h.update(1, Soon, 1, [7]);
        assert_eq!(h.update(0, None, 1, [7]), go(1, 7));
        assert!(h.update(1, Now, 1, [7]).is_empty());
        assert_eq!(h.update(2, Soon, 1, [8]), go(2, 8));
        assert!(h.update(3, Soon, 1, [8]).is_empty());
    }

    #[test]
    fn a_tables_first_outcome_saying_used_together_replicates_the_keys_that_waited_for_it() {
        use IntentLevel::*;
        let mut h = IntentHomes::default();
        // Node 1 will need keys 1–3 of table 0 while node 0 needs them now: nothing is known of
        // the table, so node 1 waits.
        h.update(0, Now, 0, [1, 2, 3]);
        assert!(h.update(1, Soon, 0, [1, 2, 3]).is_empty());
        // Node 1 needs key 1 while node 0 still does: the table's first outcome, contended. Node
        // 1 gets its replica of key 1, and the advance replicas of keys 2 and 3 it waited for.
        assert_eq!(h.update(1, Now, 0, [1]), Grants::from([((1, Grant::Replicate), vec![1, 2, 3])]));
        assert!(h.update(1, Now, 0, [2, 3]).is_empty(), "it has its replicas");
        // A first outcome saying that keys are passed on leaves the others waiting.
        h.update(0, Now, 1, [5, 6]);
        assert!(h.update(1, Soon, 1, [5, 6]).is_empty());
        assert_eq!(h.update(0, None, 1, [5]), Grants::from([((1, Grant::Move), vec![5])]));
        assert!(h.update(1, Now, 1, [5]).is_empty());
        assert!(h.update(2, Soon, 1, [6]).is_empty());
    }

    #[test]
    fn a_node_that_loses_a_key_it_still_intends_gets_a_replica_where_they_pay() {
        use IntentLevel::*;
        let mut h = IntentHomes::default();
        let go = |n: u16, key: u64| Grants::from([((n, Grant::Move), vec![key])]);
        // Table 0 learns that its keys are used together (one contended outcome).
        h.update(0, Now, 0, [0]);
        h.update(1, Soon, 0, [0]);
        h.update(1, Now, 0, [0]);
        // Node 1 alone intends key 5 and is told to take it; node 0 needs it now and wins it
        // while node 1 still intends it soon: node 1's replica comes with the hand-over.
        assert_eq!(h.update(1, Soon, 0, [5]), go(1, 5));
        assert_eq!(h.update(0, Now, 0, [5]), Grants::from([((0, Grant::Move), vec![5]), ((1, Grant::Replicate), vec![5])]));
        assert!(h.update(1, Now, 0, [5]).is_empty(), "node 1 has its replica");
        // While nobody needs it now, the node last told keeps the key and gets no replica; the
        // other intending node gets one in advance.
        assert_eq!(h.update(1, Soon, 0, [6]), go(1, 6));
        assert_eq!(h.update(0, Soon, 0, [6]), Grants::from([((0, Grant::Replicate), vec![6])]));
        // In a table whose keys are passed on, the node that loses a key gets no replica.
        assert_eq!(h.update(1, Soon, 1, [7]), go(1, 7));
        assert_eq!(h.update(0, Now, 1, [7]), go(0, 7));
    }
}
