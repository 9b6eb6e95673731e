//! The key directory: who owns each key this node is home for, where this node last saw keys
//! (location caches), which peers are lost, and which shard guards each key.
//!
//! Entries are atomics so that the parts of the directory belonging to different shards can be
//! changed under different locks: the owner entry of a key is only written — and, for routing,
//! only read — by a thread holding the key's shard lock (a [`super::Step`] that locked it).
//! Location-cache entries are hints and are read and written without any lock.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU16, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::config::{MAX_SHARDS, TableSpec};
use crate::error::Error;
use crate::partition::Partitioner;

/// Owner entry of a key whose owner was lost.
pub const LOST_OWNER: u16 = u16::MAX;
/// Location-cache entry meaning "no idea".
const NOT_CACHED: u16 = u16::MAX;
/// Keys per block that maps to one shard (neighbouring keys share a shard, so runs of keys lock
/// few shards).
pub const SHARD_BLOCK_BITS: u32 = 6;

/// One table as the protocol sees it.
pub struct TableMeta {
    /// Its name (for error messages).
    pub name: String,
    /// Number of keys.
    pub keys: u64,
    /// Elements per value.
    pub value_len: usize,
    /// Key → home node.
    pub partitioner: Partitioner,
    owners: Box<[AtomicU16]>,
    cache: Option<Box<[AtomicU16]>>,
}

/// A node's directory of keys and peers.
pub struct Directory {
    rank: u16,
    nodes: usize,
    shards: usize,
    tables: Vec<TableMeta>,
    lost: Box<[AtomicBool]>,
    /// Per node, whether it is joining and counts here as a member already (this node handed
    /// it its keys, or it is this node, asking): it coordinates nothing until its join
    /// completes (see [`Directory::coordinator`]).
    joining: Box<[AtomicBool]>,
    /// Why each lost node was lost, and the order of the losses (the first is the cause that
    /// errors name when several nodes are gone).
    reasons: Mutex<(Vec<Option<String>>, Vec<u16>)>,
    /// Peers lost so far: an operation records it when issued, and a loss fails only the
    /// operations issued before it (later ones already see the peer as lost).
    losses: AtomicU64,
    /// Whether a lost node's keys fail over to its successor (backups are kept): its home keys
    /// are then homed at its stand-in ([`Directory::stand_in`]).
    failover: bool,
    /// On how many nodes a node's keys are backed up: its first live successors.
    backup_copies: usize,
    /// The node whose graceful departure is current here ([`NO_DEPARTURE`]: none): parts
    /// routed to it wait until it has left (see `protocol::leave`).
    departing: AtomicU16,
    /// A node whose join is current here and that is among this node's backups once it is a
    /// member ([`NO_DEPARTURE`]: none): backed up to already (see
    /// [`Directory::backup_targets`]).
    join_target: AtomicU16,
    /// Per node, how many times a node joined in its rank (wrapping): messages about a node's
    /// membership carry it, so that one about an earlier incarnation is not applied to a
    /// later one.
    incarnations: Box<[AtomicU8]>,
    /// Joins this node has seen (see [`Directory::joins`]).
    joins: AtomicU64,
    /// Whether owner entries cover every key (by key), not only this node's home keys (by
    /// their index among them): with relocation and backups, where a node that stands in for
    /// a lost home records where that home's keys are (see `protocol::census`).
    owners_by_key: bool,
    /// Whether a census after a loss is under way here (see `protocol::census`): workers'
    /// requests to other nodes wait until it is over.
    recovering: AtomicBool,
}

/// [`Directory::departing`]'s "none".
const NO_DEPARTURE: u16 = u16::MAX;

impl Directory {
    /// The directory of node `rank` of `nodes`, with `shards` shards (1..=64) and location
    /// caches when `caches` is set (two bytes per key of every table).
    pub fn new(rank: usize, nodes: usize, shards: usize, specs: &[TableSpec], caches: bool) -> Directory {
        let tables = specs
            .iter()
            .map(|s| {
                let partitioner = Partitioner::of(s, nodes);
                let owners = (0..partitioner.home_count(rank)).map(|_| AtomicU16::new(rank as u16)).collect();
                let cache = caches.then(|| (0..s.keys).map(|_| AtomicU16::new(NOT_CACHED)).collect());
                TableMeta { name: s.name.clone(), keys: s.keys, value_len: s.value_len, partitioner, owners, cache }
            })
            .collect();
        Directory {
            rank: rank as u16,
            nodes,
            shards: shards.clamp(1, MAX_SHARDS),
            tables,
            lost: (0..nodes).map(|_| AtomicBool::new(false)).collect(),
            joining: (0..nodes).map(|_| AtomicBool::new(false)).collect(),
            reasons: Mutex::new((vec![None; nodes], Vec::new())),
            losses: AtomicU64::new(0),
            failover: false,
            backup_copies: 0,
            departing: AtomicU16::new(NO_DEPARTURE),
            join_target: AtomicU16::new(NO_DEPARTURE),
            incarnations: (0..nodes).map(|_| AtomicU8::new(0)).collect(),
            joins: AtomicU64::new(0),
            owners_by_key: false,
            recovering: AtomicBool::new(false),
        }
    }

    /// With relocation and backups: owner entries for every key, each starting at the key's
    /// start-up home (its owner at start-up), so that a node standing in for a lost home can
    /// record where that home's keys are. Set before the node serves anything.
    pub fn with_owners_of_every_key(mut self) -> Directory {
        for t in &mut self.tables {
            t.owners = (0..t.keys).map(|k| AtomicU16::new(t.partitioner.home(k) as u16)).collect();
        }
        self.owners_by_key = true;
        self
    }

    /// Whether a census after a loss is under way here (see `protocol::census`).
    #[inline]
    pub fn recovering(&self) -> bool {
        self.recovering.load(Ordering::Acquire)
    }

    /// Sets whether a census is under way (under every shard lock).
    pub(crate) fn set_recovering(&self, recovering: bool) {
        self.recovering.store(recovering, Ordering::Release);
    }

    /// The index of `key`'s owner entry.
    #[inline]
    fn owner_index(&self, t: &TableMeta, key: u64) -> usize {
        if self.owners_by_key { key as usize } else { t.partitioner.home_index(key) }
    }

    /// Lost nodes' keys fail over to their successors (see [`Directory::stand_in`]): set when
    /// backups are kept, `copies` per key (at least one), before the node serves anything.
    pub fn with_failover(mut self, copies: usize) -> Directory {
        self.failover = true;
        self.backup_copies = copies.max(1);
        self
    }

    /// Whether lost nodes' keys fail over.
    #[inline]
    pub fn failover(&self) -> bool {
        self.failover
    }

    /// The node that serves what `node` was given at start-up: `node` itself while it is alive;
    /// with failover, once it is lost, the first live node after it on the ring of ranks (the
    /// node that kept its backups); without failover, `node` whether lost or not (its keys are
    /// lost with it). Every node computes the same answer from the same losses.
    #[inline]
    pub fn stand_in(&self, node: u16) -> u16 {
        if !self.failover || self.losses() == 0 || !self.is_lost(node) {
            return node;
        }
        self.successor(node).unwrap_or(node)
    }

    /// The node that will serve what `node` was given at start-up once lost node `joining`
    /// is a member again (see `protocol::leave`, joins): [`Directory::stand_in`] with
    /// `joining` counted as live.
    pub fn stand_in_once_joined(&self, node: u16, joining: u16) -> u16 {
        if node == joining || !self.is_lost(node) {
            return node;
        }
        let n = self.nodes as u16;
        (1..n).map(|i| (node + i) % n).find(|&m| m == joining || !self.is_lost(m)).unwrap_or(node)
    }

    /// The node whose graceful departure is current here, or that serves the keys of a node
    /// whose join is current: this node sends it no requests until the change is over.
    #[inline]
    pub fn departing(&self) -> Option<u16> {
        let d = self.departing.load(Ordering::Acquire);
        (d != NO_DEPARTURE).then_some(d)
    }

    /// Sets the current departure (under every shard lock, so that a part routed under its
    /// keys' shard locks sees it).
    pub(crate) fn set_departing(&self, node: Option<u16>) {
        self.departing.store(node.unwrap_or(NO_DEPARTURE), Ordering::Release);
    }

    /// The first live node after `node` on the ring of ranks (not `node` itself), if any.
    pub fn successor(&self, node: u16) -> Option<u16> {
        let n = self.nodes as u16;
        (1..n).map(|i| (node + i) % n).find(|&m| !self.is_lost(m))
    }

    /// The nodes that keep this node's backups, nearest first: its first live successors on the
    /// ring of ranks, as many as there are copies (fewer when fewer nodes are left; none when
    /// it is the last one). The first is the one that takes over its keys should it be lost
    /// ([`Directory::stand_in`]); with `k` copies, any `k` of them may be lost at once.
    pub fn backup_targets(&self) -> Vec<u16> {
        let n = self.nodes as u16;
        let successors =
            |counts: &dyn Fn(u16) -> bool| (1..n).map(|i| (self.rank + i) % n).filter(|&m| counts(m)).take(self.backup_copies).collect::<Vec<u16>>();
        let mut targets = successors(&|m| !self.is_lost(m));
        // A node joining (its join current here) that will be one of this node's backups is
        // one already: when its join completes it holds every image (see `protocol::leave`).
        let joining = self.join_target.load(Ordering::Acquire);
        if joining != NO_DEPARTURE && !targets.contains(&joining) && successors(&|m| m == joining || !self.is_lost(m)).contains(&joining) {
            targets.push(joining);
        }
        targets
    }

    /// With relocation, the nodes that back up a key homed at `home` (its current home: a
    /// stand-in once the start-up home is lost) while `owner` holds it: the home's first live
    /// successors while the home owns it (as [`Directory::backup_targets`] on the home),
    /// otherwise the home itself and then its first live successors other than `owner`, as
    /// many as there are copies. The home is the authority on where its keys are, so a key
    /// that moves keeps its images where its home can adopt them.
    pub fn backup_targets_of(&self, owner: u16, home: u16) -> Vec<u16> {
        let n = self.nodes as u16;
        let mut targets = Vec::with_capacity(self.backup_copies);
        if owner != home {
            targets.push(home);
        }
        targets.extend((1..n).map(|i| (home + i) % n).filter(|&m| m != owner && !self.is_lost(m)).take(self.backup_copies - targets.len()));
        targets
    }

    /// `node`'s join is current here (or no join is, `None`): while it is, the node is backed
    /// up to if it will be one of this node's backups ([`Directory::backup_targets`]).
    pub(crate) fn set_join_target(&self, node: Option<u16>) {
        self.join_target.store(node.unwrap_or(NO_DEPARTURE), Ordering::Release);
    }

    /// The node whose join is current here, backed up to if it will be a backup (see
    /// [`Directory::set_join_target`]).
    pub(crate) fn join_target(&self) -> Option<u16> {
        let j = self.join_target.load(Ordering::Acquire);
        (j != NO_DEPARTURE).then_some(j)
    }

    /// The nodes whose start-up keys this node serves: itself and, with failover, every lost
    /// node it stands in for.
    pub fn served_homes(&self) -> Vec<u16> {
        (0..self.nodes as u16).filter(|&h| self.stand_in(h) == self.rank).collect()
    }

    /// This node's rank.
    #[inline]
    pub fn rank(&self) -> u16 {
        self.rank
    }

    /// Number of nodes.
    #[inline]
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Number of shards.
    #[inline]
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// A table, if it exists.
    #[inline]
    pub fn table(&self, table: u16) -> Option<&TableMeta> {
        self.tables.get(table as usize)
    }

    /// All tables.
    pub fn tables(&self) -> &[TableMeta] {
        &self.tables
    }

    /// The name of a table (or `#id` for an unknown one), for messages.
    pub fn table_name(&self, table: u16) -> String {
        self.table(table).map_or_else(|| format!("#{table}"), |t| t.name.clone())
    }

    /// The shard that guards `key` of `table`.
    #[inline]
    pub fn shard_of(&self, table: u16, key: u64) -> usize {
        let block = (key >> SHARD_BLOCK_BITS) ^ ((table as u64) << 40);
        let mixed = block.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        ((mixed * self.shards as u64) >> 32) as usize
    }

    /// The home of `id` of a dynamic table with `spec`: the node that creates it and knows
    /// its slot key (through the stand-in of a lost home).
    #[inline]
    pub fn id_home(&self, spec: &crate::dynamic::DynamicSpec, id: u64) -> u16 {
        self.stand_in(spec.home_of(id, self.nodes()) as u16)
    }

    /// `ids` of a dynamic table grouped by their homes ([`Directory::id_home`]): one list per
    /// node, each id once (`first` says whether an id is seen for the first time; the caller
    /// keeps the set, which it may need anyway), in the order the ids came (a home creates them
    /// in that order, so the ids of a batch that came first take consecutive slot keys). The
    /// worker's asks and the simulator's both group so.
    pub fn ids_by_home(&self, spec: &crate::dynamic::DynamicSpec, ids: impl IntoIterator<Item = u64>, mut first: impl FnMut(u64) -> bool) -> Vec<Vec<u64>> {
        let mut per_home: Vec<Vec<u64>> = vec![Vec::new(); self.nodes()];
        for id in ids {
            if first(id) {
                per_home[self.id_home(spec, id) as usize].push(id);
            }
        }
        per_home
    }

    /// The home node of a key (the table and key must exist): where it was homed at start-up,
    /// or that node's stand-in once it is lost and keys fail over.
    #[inline]
    pub fn home(&self, table: u16, key: u64) -> u16 {
        self.stand_in(self.tables[table as usize].partitioner.home(key) as u16)
    }

    /// The owner this node records for `key`, of which it must be the home. Callers that act on
    /// the answer hold the key's shard lock. A key this node took over from a lost node is
    /// owned here if its backup was adopted, and otherwise lost: callers ask only about keys
    /// not held here, so the answer for those is [`LOST_OWNER`].
    #[inline]
    pub fn owner(&self, table: u16, key: u64) -> u16 {
        let t = &self.tables[table as usize];
        if self.failover && !self.owners_by_key && t.partitioner.home(key) != self.rank as usize {
            return LOST_OWNER;
        }
        t.owners[self.owner_index(t, key)].load(Ordering::Relaxed)
    }

    /// Records a new owner for `key` (this node is its home; the caller holds its shard lock).
    #[inline]
    pub fn set_owner(&self, table: u16, key: u64, owner: u16) {
        let t = &self.tables[table as usize];
        t.owners[self.owner_index(t, key)].store(owner, Ordering::Relaxed);
    }

    /// Whether this node is `key`'s home and knows its value was lost with its owner.
    #[inline]
    pub fn knows_lost(&self, table: u16, key: u64) -> bool {
        self.home(table, key) == self.rank && self.owner(table, key) == LOST_OWNER
    }

    /// The owner this node records for `key` when it is the key's home and the owner is not
    /// lost; `None` otherwise (for tests and consistency checks).
    pub fn owner_of(&self, table: u16, key: u64) -> Option<u16> {
        let t = self.table(table)?;
        if key >= t.keys || t.partitioner.home(key) != self.rank as usize {
            return None;
        }
        Some(self.owner(table, key)).filter(|&o| o != LOST_OWNER)
    }

    /// Marks every key owned by `peer` (of those this node is home for) as lost. The caller
    /// holds every shard lock.
    pub fn lose_owner(&self, peer: u16) {
        for t in &self.tables {
            for o in t.owners.iter() {
                if o.load(Ordering::Relaxed) == peer {
                    o.store(LOST_OWNER, Ordering::Relaxed);
                }
            }
        }
    }

    /// Whether location caches are on.
    #[inline]
    pub fn caches(&self) -> bool {
        self.tables.first().is_some_and(|t| t.cache.is_some())
    }

    /// The node this one last saw serving `key`, if caches are on and it knows one.
    #[inline]
    pub fn cached(&self, table: u16, key: u64) -> Option<u16> {
        let cache = self.tables.get(table as usize)?.cache.as_ref()?;
        let o = cache.get(key as usize)?.load(Ordering::Relaxed);
        (o != NOT_CACHED).then_some(o)
    }

    /// Remembers that `node` served `key` (no-op without caches).
    #[inline]
    pub fn cache(&self, table: u16, key: u64, node: u16) {
        if let Some(e) = self.tables.get(table as usize).and_then(|t| t.cache.as_ref()).and_then(|c| c.get(key as usize)) {
            e.store(node, Ordering::Relaxed);
        }
    }

    /// Forgets where `key` was seen.
    #[inline]
    pub fn uncache(&self, table: u16, key: u64) {
        self.cache(table, key, NOT_CACHED);
    }

    /// Forgets every cache entry pointing at `peer`.
    pub fn uncache_node(&self, peer: u16) {
        for cache in self.tables.iter().filter_map(|t| t.cache.as_ref()) {
            for e in cache.iter() {
                if e.load(Ordering::Relaxed) == peer {
                    e.store(NOT_CACHED, Ordering::Relaxed);
                }
            }
        }
    }

    /// Whether `node` is lost.
    #[inline]
    pub fn is_lost(&self, node: u16) -> bool {
        self.lost.get(node as usize).is_some_and(|l| l.load(Ordering::Acquire))
    }

    /// The node that coordinates barriers and departures: rank 0, and with failover, once it
    /// is lost, the lowest-ranked live node (this node, if every other is gone). Every node
    /// that knows the same losses names the same coordinator (see `protocol::barrier`, "A lost
    /// coordinator").
    #[inline]
    pub fn coordinator(&self) -> u16 {
        if !self.failover || self.losses() == 0 {
            return 0;
        }
        (0..self.nodes as u16).find(|&n| !self.is_joining(n) && (n == self.rank || !self.is_lost(n))).unwrap_or(self.rank)
    }

    /// Whether `node` coordinated until it was lost: it was the lowest-ranked node not lost
    /// before it (with failover; without, rank 0). A node still joining never coordinates.
    pub fn coordinated(&self, node: u16) -> bool {
        if !self.failover {
            return node == 0;
        }
        (0..node).all(|n| n != self.rank && (self.is_lost(n) || self.is_joining(n)))
    }

    /// Whether `node` is joining and counts here as a member already (see
    /// [`Directory::set_joining`]).
    #[inline]
    pub fn is_joining(&self, node: u16) -> bool {
        self.joining.get(node as usize).is_some_and(|j| j.load(Ordering::Acquire))
    }

    /// `node` is joining and counts here as a member already (this node handed it its keys, or
    /// it is this node, asking to join), or no longer (its join completed or ended): while it
    /// does, it is passed over as coordinator — a joining node never coordinates.
    pub(crate) fn set_joining(&self, node: u16, joining: bool) {
        if let Some(j) = self.joining.get(node as usize) {
            j.store(joining, Ordering::Release);
        }
    }

    /// The first peer lost, if any, and why.
    pub fn any_lost(&self) -> Option<(u16, String)> {
        self.lost_nodes().into_iter().next()
    }

    /// Every lost node and why it was lost, in the order of the losses.
    pub fn lost_nodes(&self) -> Vec<(u16, String)> {
        let reasons = self.reasons.lock();
        reasons.1.iter().map(|&n| (n, reasons.0[n as usize].clone().unwrap_or_default())).collect()
    }

    /// The error for an operation that depended on lost `node`.
    pub fn lost_error(&self, node: u16) -> Error {
        let reason = self.reasons.lock().0.get(node as usize).cloned().flatten().unwrap_or_default();
        Error::PeerLost { node: node as usize, reason }
    }

    /// Marks `node` lost; false when it already was (or is this node, or no node).
    pub fn mark_lost(&self, node: u16, reason: &str) -> bool {
        if node == self.rank || node as usize >= self.nodes {
            return false;
        }
        let mut reasons = self.reasons.lock();
        if reasons.0[node as usize].is_some() {
            return false;
        }
        reasons.0[node as usize] = Some(reason.to_string());
        reasons.1.push(node);
        self.lost[node as usize].store(true, Ordering::Release);
        self.losses.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// Lost `node` is a member again (it joined): a new incarnation of it. False when it was
    /// not lost. The count of losses stays: it orders operations against losses, not
    /// membership.
    pub fn mark_joined(&self, node: u16) -> bool {
        if node as usize >= self.nodes {
            return false;
        }
        let mut reasons = self.reasons.lock();
        if reasons.0[node as usize].take().is_none() {
            return false;
        }
        reasons.1.retain(|&n| n != node);
        self.incarnations[node as usize].fetch_add(1, Ordering::AcqRel);
        self.joins.fetch_add(1, Ordering::AcqRel);
        self.lost[node as usize].store(false, Ordering::Release);
        true
    }

    /// How many times a node joined in `node`'s rank (wrapping; 0 for a node started with the
    /// cluster, and for no such node).
    #[inline]
    pub fn incarnation(&self, node: u16) -> u8 {
        self.incarnations.get(node as usize).map_or(0, |i| i.load(Ordering::Acquire))
    }

    /// Sets `node`'s incarnation (a joining node learns them from its welcome).
    pub(crate) fn set_incarnation(&self, node: u16, incarnation: u8) {
        if let Some(i) = self.incarnations.get(node as usize) {
            i.store(incarnation, Ordering::Release);
        }
    }

    /// Joins this node has seen (a node joining counts its own): rows planned for a node
    /// before a join may belong to the joining node now.
    #[inline]
    pub fn joins(&self) -> u64 {
        self.joins.load(Ordering::Acquire)
    }

    /// This node joined (see [`Directory::joins`]): a new incarnation of its rank.
    pub(crate) fn note_own_join(&self) {
        self.incarnations[self.rank as usize].fetch_add(1, Ordering::AcqRel);
        self.joins.fetch_add(1, Ordering::AcqRel);
    }

    /// Peers lost so far (see the field).
    #[inline]
    pub fn losses(&self) -> u64 {
        self.losses.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Partitioning;

    fn directory(caches: bool) -> Directory {
        let specs = [TableSpec::new("a", 1000, 2), TableSpec::new("b", 10, 1).partitioned(Partitioning::Hash)];
        Directory::new(1, 3, 8, &specs, caches)
    }

    #[test]
    fn owners_start_at_home_and_follow_updates() {
        let d = directory(false);
        let home_key = (0..1000).find(|&k| d.home(0, k) == 1).unwrap();
        assert_eq!(d.owner_of(0, home_key), Some(1));
        d.set_owner(0, home_key, 2);
        assert_eq!(d.owner_of(0, home_key), Some(2));
        assert_eq!(d.owner_of(0, 0), None, "key 0 is homed at node 0");
        assert_eq!(d.owner_of(0, 5000), None, "beyond the table");
        assert_eq!(d.owner_of(7, 1), None, "no such table");
        d.lose_owner(2);
        assert_eq!(d.owner_of(0, home_key), None);
        assert_eq!(d.owner(0, home_key), LOST_OWNER);
    }

    #[test]
    fn shards_cover_every_key_and_keep_blocks_together() {
        let d = directory(false);
        let mut used = [0usize; 8];
        for key in 0..1000 {
            let s = d.shard_of(0, key);
            used[s] += 1;
            assert_eq!(s, d.shard_of(0, key & !63), "a block of 64 keys shares a shard");
        }
        assert!(used.iter().filter(|&&n| n > 0).count() >= 4, "{used:?}");
        let one = Directory::new(0, 1, 1, &[TableSpec::new("x", 10, 1)], false);
        assert!((0..10).all(|k| one.shard_of(0, k) == 0));
    }

    #[test]
    fn caches_and_lost_peers() {
        let d = directory(true);
        assert!(d.caches());
        assert_eq!(d.cached(0, 5), None);
        d.cache(0, 5, 2);
        assert_eq!(d.cached(0, 5), Some(2));
        d.uncache_node(2);
        assert_eq!(d.cached(0, 5), None);
        d.cache(0, 5, 0);
        d.uncache(0, 5);
        assert_eq!(d.cached(0, 5), None);
        assert_eq!(d.cached(0, 100_000), None);
        assert!(!directory(false).caches());
        assert!(!d.is_lost(2));
        assert!(d.mark_lost(2, "gone"));
        assert!(!d.mark_lost(2, "again"));
        assert!(!d.mark_lost(1, "self"));
        assert!(!d.mark_lost(9, "no such node"));
        assert!(d.is_lost(2));
        assert_eq!(d.any_lost(), Some((2, "gone".to_string())));
        assert!(matches!(d.lost_error(2), Error::PeerLost { node: 2, reason } if reason == "gone"));
        assert!(d.mark_joined(2) && !d.mark_joined(2), "joined once");
        assert!(!d.is_lost(2) && d.any_lost().is_none());
        assert!(!d.mark_joined(1) && !d.mark_joined(9), "this node, no such node");
    }

    #[test]
    fn a_joining_node_takes_back_what_it_will_stand_in_for() {
        // Node 0 of 5; nodes 1, 2 and 3 are lost: node 4 stands in for all three.
        let d = Directory::new(0, 5, 1, &[TableSpec::new("t", 10, 1)], false).with_failover(1);
        for n in [1, 2, 3] {
            d.mark_lost(n, "gone");
        }
        assert_eq!((d.stand_in(1), d.stand_in(2), d.stand_in(3)), (4, 4, 4));
        // Node 2 joins: it serves its own keys and node 1's; node 3's stay at node 4.
        assert_eq!(d.stand_in_once_joined(1, 2), 2);
        assert_eq!(d.stand_in_once_joined(2, 2), 2);
        assert_eq!(d.stand_in_once_joined(3, 2), 4);
        assert_eq!(d.stand_in_once_joined(4, 2), 4);
        assert_eq!(d.stand_in_once_joined(0, 2), 0);
    }

    #[test]
    fn a_joining_node_is_backed_up_to_before_it_counts_and_never_coordinates() {
        // Node 1 of 4 with two backups; node 2 left and joins again.
        let d = Directory::new(1, 4, 1, &[TableSpec::new("t", 10, 1)], false).with_failover(2);
        d.mark_lost(2, "left");
        assert_eq!(d.backup_targets(), vec![3, 0]);
        d.set_join_target(Some(2));
        assert_eq!(d.backup_targets(), vec![3, 0, 2], "one of its backups once it joins: backed up to already");
        d.set_join_target(Some(0));
        assert_eq!(d.backup_targets(), vec![3, 0], "a node that will not be a backup changes nothing");
        d.set_join_target(None);
        // The giver (this node, say) counts node 2 once it handed it its keys; node 0 is lost.
        d.mark_lost(0, "crashed");
        assert!(d.mark_joined(2));
        d.set_joining(2, true);
        assert_eq!(d.coordinator(), 1, "a joining node is passed over");
        assert!(d.coordinated(0));
        d.set_joining(2, false);
        assert_eq!(d.coordinator(), 1, "node 1 ranks below node 2");
        let at_joining = Directory::new(2, 4, 1, &[TableSpec::new("t", 10, 1)], false).with_failover(2);
        for n in [0, 1] {
            at_joining.mark_lost(n, "crashed");
        }
        at_joining.set_joining(2, true);
        assert_eq!(at_joining.coordinator(), 3, "not itself while it joins");
        at_joining.set_joining(2, false);
        assert_eq!(at_joining.coordinator(), 2, "a member ranked lowest coordinates");
    }

    #[test]
    fn a_key_away_from_its_home_is_backed_up_at_the_home() {
        let d = directory(false).with_failover(1);
        assert_eq!(d.backup_targets_of(1, 1), vec![2], "at its home: the home's successor");
        assert_eq!(d.backup_targets_of(0, 1), vec![1], "away: the home");
        let d = directory(false).with_failover(2);
        assert_eq!(d.backup_targets_of(1, 1), vec![2, 0]);
        assert_eq!(d.backup_targets_of(2, 1), vec![1, 0], "the home, then its successors but the owner");
        d.mark_lost(0, "test");
        assert_eq!(d.backup_targets_of(2, 1), vec![1], "fewer nodes left than copies");
        assert_eq!(d.backup_targets_of(1, 1), vec![2]);
    }

    #[test]
    fn a_node_is_backed_up_on_its_first_live_successors() {
        let d = Directory::new(3, 5, 1, &[TableSpec::new("t", 10, 1)], false).with_failover(2);
        assert_eq!(d.backup_targets(), vec![4, 0], "around the ring");
        d.mark_lost(4, "gone");
        assert_eq!(d.backup_targets(), vec![0, 1], "past a lost node");
        for n in [0, 1] {
            d.mark_lost(n, "gone");
        }
        assert_eq!(d.backup_targets(), vec![2], "fewer nodes left than copies");
        d.mark_lost(2, "gone");
        assert!(d.backup_targets().is_empty(), "the last node");
        let one = Directory::new(1, 3, 1, &[TableSpec::new("t", 10, 1)], false).with_failover(1);
        assert_eq!(one.backup_targets(), vec![2]);
    }
}
