//! Per-node statistics: access locality, relocations, and traffic per message kind.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hdrhistogram::Histogram;
use parking_lot::Mutex;

/// Kinds of traffic counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// Requests from the requesting node to a home node or a cached owner.
    Access,
    /// Requests forwarded by a home node (or double-forwarded through one).
    Forward,
    /// Values and acknowledgements back to the requester.
    Response,
    /// Requester to home node: "move these keys to me".
    Localize,
    /// Home node to old owner: "hand these keys over".
    Relocate,
    /// The relocation's one-sided write of a value into the new owner's slot.
    Transfer,
    /// Failure reports.
    Failure,
    /// Barrier traffic.
    Barrier,
    /// Replication: replicas' deltas shipped home and their acknowledgements (the refresh
    /// reads are one-sided and counted in [`ReplicationStats`]).
    Replica,
    /// Backups: an owner's slot images for its successor, and their acknowledgements.
    Backup,
    /// Membership: a node's graceful departure (ask, begin, ready, left).
    Membership,
    /// Eviction rounds of dynamic tables: ids offered and ids kept.
    Eviction,
}

/// Number of [`MessageKind`]s.
pub const MESSAGE_KINDS: usize = 12;

impl MessageKind {
    /// All kinds, in display order.
    pub const ALL: [MessageKind; MESSAGE_KINDS] = [
        MessageKind::Access,
        MessageKind::Forward,
        MessageKind::Response,
        MessageKind::Localize,
        MessageKind::Relocate,
        MessageKind::Transfer,
        MessageKind::Failure,
        MessageKind::Barrier,
        MessageKind::Replica,
        MessageKind::Backup,
        MessageKind::Membership,
        MessageKind::Eviction,
    ];

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            MessageKind::Access => "access",
            MessageKind::Forward => "forward",
            MessageKind::Response => "response",
            MessageKind::Localize => "localize",
            MessageKind::Relocate => "relocate",
            MessageKind::Transfer => "transfer",
            MessageKind::Failure => "failure",
            MessageKind::Barrier => "barrier",
            MessageKind::Replica => "replica",
            MessageKind::Backup => "backup",
            MessageKind::Membership => "membership",
            MessageKind::Eviction => "eviction",
        }
    }
}

/// Messages and bytes sent to other nodes, per kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Messages per [`MessageKind`] (index = position in [`MessageKind::ALL`]).
    pub messages: [u64; MESSAGE_KINDS],
    /// Bytes per kind.
    pub bytes: [u64; MESSAGE_KINDS],
}

impl Traffic {
    /// Counts one message of `bytes` bytes.
    pub fn add(&mut self, kind: MessageKind, bytes: usize) {
        self.messages[kind as usize] += 1;
        self.bytes[kind as usize] += bytes as u64;
    }

    /// Messages of all kinds.
    pub fn total_messages(&self) -> u64 {
        self.messages.iter().sum()
    }

    /// Bytes of all kinds.
    pub fn total_bytes(&self) -> u64 {
        self.bytes.iter().sum()
    }
}

/// Upper bounds of a [`Latency`]'s buckets, in nanoseconds: 1 µs to about 4.2 s by powers of 4
/// (wide enough for a local wait, a remote access, a relocation and a replica's age alike).
pub const LATENCY_BUCKET_BOUNDS_NS: [u64; 12] = {
    let mut bounds = [0u64; 12];
    let mut i = 0;
    while i < 12 {
        bounds[i] = 1000 << (2 * i);
        i += 1;
    }
    bounds
};

/// Summary of a latency distribution in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Latency {
    /// Number of samples.
    pub count: u64,
    /// Median.
    pub p50_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// Largest sample.
    pub max_ns: u64,
    /// Sum of the samples (to the histogram's two significant digits).
    pub sum_ns: u64,
    /// Samples per bucket: `buckets[i]` counts those above the bound before
    /// [`LATENCY_BUCKET_BOUNDS_NS`]`[i]` and at most that bound; the last one those above every
    /// bound. What a Prometheus histogram exports (`/metrics`).
    pub buckets: [u64; LATENCY_BUCKET_BOUNDS_NS.len() + 1],
}

impl Latency {
    /// The summary of a histogram of nanoseconds.
    pub(crate) fn of(h: &Histogram<u64>) -> Latency {
        if h.is_empty() {
            return Latency::default();
        }
        let (mut buckets, mut sum_ns) = ([0u64; LATENCY_BUCKET_BOUNDS_NS.len() + 1], 0u64);
        for recorded in h.iter_recorded() {
            let (value, count) = (h.median_equivalent(recorded.value_iterated_to()), recorded.count_at_value());
            sum_ns = sum_ns.saturating_add(value.saturating_mul(count));
            buckets[LATENCY_BUCKET_BOUNDS_NS.partition_point(|&bound| bound < value)] += count;
        }
        Latency { count: h.len(), p50_ns: h.value_at_quantile(0.5), p99_ns: h.value_at_quantile(0.99), max_ns: h.max(), sum_ns, buckets }
    }

    /// Adds `other`'s samples to this summary: counts, sums and buckets add up; the
    /// percentiles keep the worse of the two (the exact ones would need the samples).
    pub(crate) fn add(&mut self, other: &Latency) {
        self.count += other.count;
        self.p50_ns = self.p50_ns.max(other.p50_ns);
        self.p99_ns = self.p99_ns.max(other.p99_ns);
        self.max_ns = self.max_ns.max(other.max_ns);
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
        for (mine, theirs) in self.buckets.iter_mut().zip(&other.buckets) {
            *mine += theirs;
        }
    }
}

/// A node's statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Keys accessed by this node's workers and served from local memory, including accesses
    /// queued here behind a relocation to this node (they wait, but send nothing).
    pub local_accesses: u64,
    /// Keys accessed by this node's workers that had to go to another node.
    pub remote_accesses: u64,
    /// Keys accessed while relocating to this node (queued until they landed).
    pub queued_accesses: u64,
    /// Keys whose requests this node forwarded as a home node.
    pub forwarded_keys: u64,
    /// Keys this node passed on because a stale location cache sent them here.
    pub double_forwarded_keys: u64,
    /// Keys relocated to this node.
    pub relocations_in: u64,
    /// Keys relocated away from this node.
    pub relocations_out: u64,
    /// One-sided writes that carried those keys: a run of keys in consecutive slots here and at
    /// the new owner travels as one write (`relocations_out / relocation_writes` keys a write).
    pub relocation_writes: u64,
    /// Traffic sent to other nodes.
    pub traffic: Traffic,
    /// Bytes of the message frames this node received from other nodes (what one-sided writes
    /// put into its memory is not seen by it, and not counted).
    pub received_bytes: u64,
    /// Relocation time (localize issued → new owner serves locally), measured at the new owner.
    pub relocation_time: Latency,
    /// Blocking time (old owner stops serving → new owner serves), measured at the new owner.
    pub blocking_time: Latency,
    /// Replicated keys: accesses, shipping and refreshes.
    pub replication: ReplicationStats,
    /// Intent signalling: rounds, keys acted on, and how timely.
    pub intent: IntentStats,
    /// Backups and failover.
    pub backups: BackupStats,
    /// Dynamic tables: ids created and known.
    pub dynamic: DynamicStats,
}

/// What a node's dynamic tables hold ([`crate::TableSpec::dynamic`]), summed over them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DynamicStats {
    /// Ids this node created as their home (each holds one of its slot keys).
    pub ids_created: u64,
    /// Ids whose slot keys this node knows: those it created and those it learnt from their
    /// homes.
    pub ids_known: u64,
    /// Slot keys this node can still hand out as a home.
    pub keys_free: u64,
    /// Ids this node evicted as their home ([`crate::dynamic::Eviction`]).
    pub ids_evicted: u64,
    /// New ids this home did not create yet because it was full, or short of room and they
    /// were used less than what it evicts (they were read as initial values, their pushes
    /// dropped).
    pub ids_deferred: u64,
}

impl DynamicStats {
    fn counters(&mut self) -> [&mut u64; 5] {
        [&mut self.ids_created, &mut self.ids_known, &mut self.keys_free, &mut self.ids_evicted, &mut self.ids_deferred]
    }
}

/// What backups did on a node ([`crate::Config::backups`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackupStats {
    /// Backup rounds completed.
    pub rounds: u64,
    /// Slot images sent to this node's backup.
    pub images_sent: u64,
    /// Keys this node took over from lost nodes' backups.
    pub keys_adopted: u64,
    /// Writes of this node's workers that a node's loss failed and that they dropped
    /// (`Worker::drop_lost_writes`).
    pub writes_dropped: u64,
    /// Keys this node handed to nodes that joined (it served them while their rank was gone).
    pub keys_handed: u64,
    /// Keys of other homes this node gave back to them before it left a cluster that
    /// relocates keys ([`crate::Node::leave`]).
    pub keys_given_back: u64,
    /// Requests this node got, as it left, from a peer after that peer's READY, other than
    /// those a home passed on for a key this node still held: none should come (the cut, see
    /// `Node::leave`), so anything but 0 is a fault worth reporting.
    pub requests_after_ready: u64,
}

impl BackupStats {
    fn counters(&mut self) -> [&mut u64; 7] {
        [
            &mut self.rounds,
            &mut self.images_sent,
            &mut self.keys_adopted,
            &mut self.writes_dropped,
            &mut self.keys_handed,
            &mut self.keys_given_back,
            &mut self.requests_after_ready,
        ]
    }
}

/// What intent signalling did on a node (AdaPM, Sections 4.2 and 5).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IntentStats {
    /// Communication rounds of the intent service.
    pub rounds: u64,
    /// Key windows declared by this node's workers.
    pub declared: u64,
    /// Keys the service relocated here because of an intent.
    pub acted_keys: u64,
    /// Of those, keys that were here before their window started (as the service sees it in
    /// its first round after the relocation completed).
    pub in_time: u64,
    /// Sum over the keys in time of how many clocks before the window's start they were here
    /// (divide by `in_time` for the mean lead).
    pub lead_clocks: u64,
    /// Accesses by a worker to a key it had declared intent for in its current clock that did
    /// not find the key here ("late" accesses: they went to another node; pulls, pushes and
    /// sets, a set that found a run-time replica here not counted). The six counts
    /// below split them by cause ([`LateCause`]) and sum to this.
    pub late_accesses: u64,
    /// Late accesses whose window the service had not acted on yet (its start was beyond the
    /// worker's action horizon at every round so far).
    pub late_unacted: u64,
    /// Late accesses whose key's home had been told but nothing was on its way here yet and no
    /// grant had arrived (the answer was on its way, or the key was held for another node).
    pub late_unanswered: u64,
    /// Late accesses whose key's grant (a move or a replica here) had arrived but the intent
    /// service had not taken it up yet.
    pub late_untaken: u64,
    /// Late accesses whose key's move here had been granted and was still on its way.
    pub late_moving: u64,
    /// Late accesses whose key's replica here had been granted and was still being made.
    pub late_replicating: u64,
    /// Late accesses whose key had landed here for the intent and left again.
    pub late_left: u64,
    /// Replicas made here because several nodes needed a key at once.
    pub replicas_made: u64,
    /// Of those, replicas kept from a key's value when it left this node (no pull back).
    pub replicas_kept: u64,
    /// Rounds that synchronised this node's run-time replicas with the keys' owners.
    pub replica_syncs: u64,
    /// One-sided reads (RDMA READs over verbs) that refreshed run-time replicas from the images
    /// their owners cut.
    pub refresh_reads: u64,
    /// Bytes those reads fetched.
    pub refresh_bytes: u64,
    /// Run-time replica refreshes that came from those reads.
    pub refreshed_by_read: u64,
    /// Run-time replica syncs that went through a routed push-pull instead (the key was not
    /// where this node believed it; the answer refreshed the replica).
    pub synced_by_push_pull: u64,
    /// Keys whose home this node asked again because it needed them without pause and they
    /// stayed neither here nor on their way (64 rounds after it last asked).
    pub reasked: u64,
    /// Keys this node asked to move here on a grant that their home had since given to another
    /// node, so the home declined the move (the grant and the move race; see
    /// `docs/INTENT.md`, "Acting: moves"), or, on a dynamic table that evicts, whose id was
    /// evicted since (`docs/DYNAMIC.md`, "Intent on a table that evicts").
    pub declined: u64,
    /// Run-time replicas dropped with a delta on its way (or a sync round in flight) that
    /// served this node's workers until the owner acknowledged it (see `docs/INTENT.md`,
    /// "Acting: replicas").
    pub drained: u64,
    /// Of those, replicas a worker pushed to while they drained: accesses after this node's
    /// intent on the key had ended, which a replica removed at once would have sent to the
    /// owner, possibly ahead of the worker's own earlier pushes.
    pub drained_again: u64,
    /// Run-time replicas made while this node's workers pushed to the key: pushes sent to the
    /// owner behind the pull that made the replica, which its value lacked and which the
    /// install added (see `docs/INTENT.md`, "Pushes sent behind the pull").
    pub made_with_pushes: u64,
    /// Keys whose granted moves the intent service put off because a sync round in flight
    /// carried their replicas' deltas straight to the old owner (a move landing first would
    /// lack them; see `docs/INTENT.md`, "A delta on its way when the key lands").
    pub moves_put_off: u64,
    /// Keys with a run-time replica here (made, being made or granted) whose values were found
    /// lost with their owners: their replicas were dropped and none is made again, so their
    /// accesses fail with [`crate::Error::KeyLost`] (see `docs/INTENT.md`, "What holds").
    pub replicas_lost: u64,
}

impl IntentStats {
    fn counters(&mut self) -> [&mut u64; 26] {
        [
            &mut self.rounds,
            &mut self.declared,
            &mut self.acted_keys,
            &mut self.in_time,
            &mut self.lead_clocks,
            &mut self.late_accesses,
            &mut self.late_unacted,
            &mut self.late_unanswered,
            &mut self.late_untaken,
            &mut self.late_moving,
            &mut self.late_replicating,
            &mut self.late_left,
            &mut self.replicas_made,
            &mut self.replicas_kept,
            &mut self.replica_syncs,
            &mut self.refresh_reads,
            &mut self.refresh_bytes,
            &mut self.refreshed_by_read,
            &mut self.synced_by_push_pull,
            &mut self.reasked,
            &mut self.declined,
            &mut self.drained,
            &mut self.drained_again,
            &mut self.made_with_pushes,
            &mut self.moves_put_off,
            &mut self.replicas_lost,
        ]
    }

    /// Mean number of clocks between a key's arrival and its window's start (0 without data).
    pub fn mean_lead(&self) -> f64 {
        if self.in_time == 0 { 0.0 } else { self.lead_clocks as f64 / self.in_time as f64 }
    }

    /// Late accesses of cause `cause` (the field for it).
    pub fn late(&self, cause: LateCause) -> u64 {
        use LateCause::*;
        match cause {
            Unacted => self.late_unacted,
            Unanswered => self.late_unanswered,
            Untaken => self.late_untaken,
            Moving => self.late_moving,
            Replicating => self.late_replicating,
            Left => self.late_left,
        }
    }
}

/// What replication did on a node (NuPS, Section 3.2).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicationStats {
    /// Accesses of this node's workers served by a replica (also counted in `local_accesses`).
    pub replica_accesses: u64,
    /// Rounds run (ship deltas, wait for acknowledgements, refresh).
    pub rounds: u64,
    /// Replica deltas shipped to home nodes.
    pub shipped_keys: u64,
    /// Bytes of REPLICA_DELTA messages sent.
    pub shipped_bytes: u64,
    /// One-sided reads issued by refreshes (RDMA READs over verbs).
    pub refresh_reads: u64,
    /// Bytes those reads fetched.
    pub refresh_bytes: u64,
    /// Replicas refreshed.
    pub refreshed_keys: u64,
    /// Replicas whose copy caught a write in progress and was read again.
    pub torn_copies: u64,
    /// Age of a replica when a worker read it (time since its last refresh began; sampled).
    pub staleness: Latency,
    /// Duration of a round.
    pub round_time: Latency,
}

impl ReplicationStats {
    /// The counters (everything but the latency summaries), for summing and differencing.
    fn counters(&mut self) -> [&mut u64; 8] {
        [
            &mut self.replica_accesses,
            &mut self.rounds,
            &mut self.shipped_keys,
            &mut self.shipped_bytes,
            &mut self.refresh_reads,
            &mut self.refresh_bytes,
            &mut self.refreshed_keys,
            &mut self.torn_copies,
        ]
    }
}

/// `a` with each of its counters (the fields `counters` lists) replaced by `op` of it and `b`'s;
/// its other fields stay `a`'s.
fn combine<T: Copy, const N: usize>(mut a: T, mut b: T, counters: fn(&mut T) -> [&mut u64; N], op: impl Fn(u64, u64) -> u64) -> T {
    for (x, y) in counters(&mut a).into_iter().zip(counters(&mut b)) {
        *x = op(*x, *y);
    }
    a
}

impl Stats {
    /// Share of this node's key accesses served locally (1 when there were none).
    pub fn local_share(&self) -> f64 {
        let total = self.local_accesses + self.remote_accesses;
        if total == 0 { 1.0 } else { self.local_accesses as f64 / total as f64 }
    }

    /// Difference `self - earlier` of the counters (latencies are taken from `self`).
    pub fn since(&self, earlier: &Stats) -> Stats {
        let mut traffic = self.traffic;
        for i in 0..MESSAGE_KINDS {
            traffic.messages[i] -= earlier.traffic.messages[i].min(traffic.messages[i]);
            traffic.bytes[i] -= earlier.traffic.bytes[i].min(traffic.bytes[i]);
        }
        Stats {
            local_accesses: self.local_accesses.saturating_sub(earlier.local_accesses),
            remote_accesses: self.remote_accesses.saturating_sub(earlier.remote_accesses),
            queued_accesses: self.queued_accesses.saturating_sub(earlier.queued_accesses),
            forwarded_keys: self.forwarded_keys.saturating_sub(earlier.forwarded_keys),
            double_forwarded_keys: self.double_forwarded_keys.saturating_sub(earlier.double_forwarded_keys),
            relocations_in: self.relocations_in.saturating_sub(earlier.relocations_in),
            relocations_out: self.relocations_out.saturating_sub(earlier.relocations_out),
            relocation_writes: self.relocation_writes.saturating_sub(earlier.relocation_writes),
            traffic,
            received_bytes: self.received_bytes.saturating_sub(earlier.received_bytes),
            relocation_time: self.relocation_time,
            blocking_time: self.blocking_time,
            replication: combine(self.replication, earlier.replication, ReplicationStats::counters, u64::saturating_sub),
            intent: combine(self.intent, earlier.intent, IntentStats::counters, u64::saturating_sub),
            backups: combine(self.backups, earlier.backups, BackupStats::counters, u64::saturating_sub),
            // Levels, not counts: the later ones.
            dynamic: self.dynamic,
        }
    }

    /// Sum of several nodes' statistics (latency summaries keep the worst percentiles).
    pub fn sum<'a>(all: impl IntoIterator<Item = &'a Stats>) -> Stats {
        let mut s = Stats::default();
        for o in all {
            s.local_accesses += o.local_accesses;
            s.remote_accesses += o.remote_accesses;
            s.queued_accesses += o.queued_accesses;
            s.forwarded_keys += o.forwarded_keys;
            s.double_forwarded_keys += o.double_forwarded_keys;
            s.relocations_in += o.relocations_in;
            s.relocations_out += o.relocations_out;
            s.relocation_writes += o.relocation_writes;
            s.received_bytes += o.received_bytes;
            for i in 0..MESSAGE_KINDS {
                s.traffic.messages[i] += o.traffic.messages[i];
                s.traffic.bytes[i] += o.traffic.bytes[i];
            }
            s.replication = combine(s.replication, o.replication, ReplicationStats::counters, |x, y| x + y);
            s.intent = combine(s.intent, o.intent, IntentStats::counters, |x, y| x + y);
            s.backups = combine(s.backups, o.backups, BackupStats::counters, |x, y| x + y);
            s.dynamic = combine(s.dynamic, o.dynamic, DynamicStats::counters, |x, y| x + y);
            for (mine, theirs) in [
                (&mut s.relocation_time, &o.relocation_time),
                (&mut s.blocking_time, &o.blocking_time),
                (&mut s.replication.staleness, &o.replication.staleness),
                (&mut s.replication.round_time, &o.replication.round_time),
            ] {
                mine.add(theirs);
            }
        }
        s
    }
}

/// Counters of one thread's protocol output (a [`crate::protocol::Transmit`]): keys it served
/// locally or sent away, and the traffic it produced. One thread writes a cell (a load and a
/// store, no locked read-modify-write); readers sum all cells.
#[derive(Default)]
pub(crate) struct CounterCell {
    pub local_keys: AtomicU64,
    pub replica_keys: AtomicU64,
    pub remote_keys: AtomicU64,
    pub messages: [AtomicU64; MESSAGE_KINDS],
    pub bytes: [AtomicU64; MESSAGE_KINDS],
    pub received_bytes: AtomicU64,
}

impl CounterCell {
    /// Adds `n` to a field of a cell this thread alone writes.
    #[inline]
    pub fn bump(field: &AtomicU64, n: u64) {
        field.store(field.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }

    fn add_to(&self, s: &mut Stats) {
        s.local_accesses += self.local_keys.load(Ordering::Relaxed);
        s.remote_accesses += self.remote_keys.load(Ordering::Relaxed);
        s.replication.replica_accesses += self.replica_keys.load(Ordering::Relaxed);
        s.received_bytes += self.received_bytes.load(Ordering::Relaxed);
        for i in 0..MESSAGE_KINDS {
            s.traffic.messages[i] += self.messages[i].load(Ordering::Relaxed);
            s.traffic.bytes[i] += self.bytes[i].load(Ordering::Relaxed);
        }
    }
}

/// All counter cells of a node, and the totals of cells whose threads have finished.
#[derive(Default)]
pub(crate) struct CounterRegistry {
    live: Mutex<Vec<Arc<CounterCell>>>,
    retired: Mutex<Stats>,
}

impl CounterRegistry {
    /// A new cell, counted from now on.
    pub fn cell(&self) -> Arc<CounterCell> {
        let cell = Arc::new(CounterCell::default());
        self.live.lock().push(cell.clone());
        cell
    }

    /// Folds a cell into the totals and stops tracking it.
    pub fn retire(&self, cell: &Arc<CounterCell>) {
        let mut live = self.live.lock();
        if let Some(pos) = live.iter().position(|c| Arc::ptr_eq(c, cell)) {
            live.swap_remove(pos);
            cell.add_to(&mut self.retired.lock());
        }
    }

    /// Local and remote keys and traffic over every cell, past and present.
    pub fn totals(&self) -> Stats {
        let live = self.live.lock();
        let mut s = *self.retired.lock();
        for c in live.iter() {
            c.add_to(&mut s);
        }
        s
    }
}

/// Counters kept by one shard of the protocol (under its lock).
pub(crate) struct ShardCounters {
    pub queued_keys: u64,
    pub forwarded_keys: u64,
    pub double_forwarded_keys: u64,
    pub relocations_in: u64,
    pub relocations_out: u64,
    pub relocation_writes: u64,
    pub relocation_ns: Histogram<u64>,
    pub blocking_ns: Histogram<u64>,
}

impl Default for ShardCounters {
    fn default() -> Self {
        let hist = || Histogram::new_with_bounds(1, 3_600_000_000_000, 2).expect("valid histogram bounds");
        ShardCounters {
            queued_keys: 0,
            forwarded_keys: 0,
            double_forwarded_keys: 0,
            relocations_in: 0,
            relocations_out: 0,
            relocation_writes: 0,
            relocation_ns: hist(),
            blocking_ns: hist(),
        }
    }
}

impl ShardCounters {
    pub fn record(h: &mut Histogram<u64>, ns: u64) {
        let _ = h.record(ns.max(1));
    }

    /// Adds this shard's counters to `s` and its latencies to the merged histograms.
    pub fn add_to(&self, s: &mut Stats, relocation: &mut Histogram<u64>, blocking: &mut Histogram<u64>) {
        s.queued_accesses += self.queued_keys;
        s.forwarded_keys += self.forwarded_keys;
        s.double_forwarded_keys += self.double_forwarded_keys;
        s.relocations_in += self.relocations_in;
        s.relocations_out += self.relocations_out;
        s.relocation_writes += self.relocation_writes;
        let _ = relocation.add(&self.relocation_ns);
        let _ = blocking.add(&self.blocking_ns);
    }

    pub fn reset_latencies(&mut self) {
        self.relocation_ns.reset();
        self.blocking_ns.reset();
    }
}

/// A histogram for merging shard latencies.
pub(crate) fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 2).expect("valid histogram bounds")
}

/// Why an access of a worker to a key it had declared intent for in its current clock did not
/// find the key here (see [`IntentStats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LateCause {
    /// The window was not yet acted on: its start was beyond the worker's action horizon at
    /// every round so far (the timing, or a declaration made too late, left no lead).
    Unacted,
    /// Acted on (the home was told) but nothing was on its way here and no grant had arrived:
    /// the home's answer was on its way, the key was held for another node, or the home
    /// granted a replica of a table that keeps none (server-side updates).
    Unanswered,
    /// The home's grant (a move or a replica here) had arrived, but the intent service had not
    /// taken it up yet: the service was not scheduled between the grant's arrival and the
    /// access.
    Untaken,
    /// A move here was granted; the relocation was still on its way.
    Moving,
    /// A replica here was granted; it was still being made.
    Replicating,
    /// It had landed here for the intent and left again before the intent ended (won by a node
    /// that needed it now while this one needed it only soon, or taken by an explicit
    /// `localize`).
    Left,
}

impl LateCause {
    /// Every cause, in declaration order (`ALL[c as usize] == c`).
    pub const ALL: [LateCause; 6] = [LateCause::Unacted, LateCause::Unanswered, LateCause::Untaken, LateCause::Moving, LateCause::Replicating, LateCause::Left];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_count_each_sample_once_below_its_bound() {
        let mut h = latency_histogram();
        for ns in [500, 900, 3_000, 100_000, 5_000_000_000] {
            h.record(ns).unwrap();
        }
        let l = Latency::of(&h);
        let mut expected = [0u64; LATENCY_BUCKET_BOUNDS_NS.len() + 1];
        (expected[0], expected[1], expected[4], expected[12]) = (2, 1, 1, 1);
        assert_eq!(l.buckets, expected);
        assert_eq!(l.count, 5);
        let exact = 5_000_104_400f64;
        assert!((l.sum_ns as f64 - exact).abs() < 0.01 * exact, "sum {}", l.sum_ns);
        let mut twice = l;
        twice.add(&l);
        assert_eq!((twice.count, twice.buckets[0], twice.sum_ns, twice.max_ns), (10, 4, 2 * l.sum_ns, l.max_ns));
    }
}
