//! The parameter-server protocol as deterministic state machines with no I/O and no clock.
//!
//! It implements Lapse's dynamic parameter allocation: every key has a static *home node* that
//! knows its current *owner*; the owner holds the value. A remote access goes to the home node,
//! which forwards it to the owner, which answers the requester (3 messages; 2 when the home owns
//! the key); with location caches it goes straight to the cached owner, and a stale cache costs
//! a double forward. A `localize` reserves a slot at the requester and tells the home node, which
//! re-routes at once and tells the old owner; the old owner finishes what it has queued for the
//! key, stops serving it, and writes the value into the reserved slot with one one-sided write
//! carrying an immediate. Until that write lands, the requester queues every operation on the
//! key.
//!
//! # The parts
//!
//! * [`Directory`]: owners of the keys this node is home for, location caches, lost peers, and
//!   the key → shard map.
//! * [`Shard`]: for the keys of one shard, relocations in transit with their reservations and
//!   queues, outgoing one-sided writes, and deadline queues (FIFO per kind: each kind is "set + a fixed time").
//! * [`Requester`]: one worker's operation table; owned by the worker, fed by [`Delivery`]s.
//! * [`Barriers`]: cluster-wide barrier generations.
//! * [`Core`] holds a node's directory, shards (each behind its own lock) and barriers, and
//!   [`Step`] is one event's exclusive access to the shards it needs.
//!
//! # Calling contract
//!
//! A thread with an event takes a step ([`Core::step`]) with its own [`Transmit`] buffer, feeds
//! the event (`handle_frame`, `handle_writes_landed`, `handle_write_done`, `handle_peer_lost`,
//! `handle_timeout`, `issue_access`, `issue_localize`, `barrier_enter`), and then:
//!
//! 1. **before dropping the step**, hands every frame ([`Transmit::poll_transmit`]) and every
//!    one-sided write ([`Transmit::poll_write`]) to the fabric's per-peer queues — queueing
//!    only, no system call — and reports writes the fabric completed at once through
//!    [`Step::handle_write_done`]. The step holds the shard locks under which those outputs
//!    were decided; handing them on before the locks go keeps every key's messages in the
//!    order its shard decided them (per-key sequential consistency rests on it);
//! 2. drops the step, then sends what it queued (the fabric's flush: the only I/O);
//! 3. hands deliveries ([`Transmit::poll_delivery`]) to the workers named (any time later);
//! 4. when an event handler returned [`Progress::Yield`], repeats with a fresh step from where
//!    it stopped (a step takes locks once, in ascending order, so it never deadlocks; an event
//!    that needs other shards is cut there).
//!
//! [`Core::poll_timeout`] gives the next protocol deadline (relocations that did not land);
//! [`Requester::poll_timeout`] that of a worker's operations.
//!
//! Hot paths take no shard lock: a worker serves local keys under their latches and sends keys
//! homed elsewhere straight to their home; an owner serves keys it holds under their latches.
//! Shard locks are for keys homed at this node, keys relocating to it, and relocation itself.

mod access;
pub(crate) mod assign;
pub(crate) mod backup;
mod barrier;
pub(crate) mod census;
mod clock;
mod directory;
pub(crate) mod evict;
mod intent;
mod intent_counters;
mod issue;
pub mod keycache;
pub(crate) mod leave;
pub use leave::LEFT_REASON;
mod relocation;
mod replica;
mod replica_sync;
mod replication_counters;
mod requester;
mod rows;
mod shard;
mod step;
mod sync_acks;
mod transmit;
pub mod wire;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

pub use backup::BackupCounters;
pub(crate) use backup::{Backups, DirtyBlocks};
pub use barrier::{BarrierEvent, BarrierKind, Barriers};
pub use clock::Clocks;
pub use directory::{Directory, LOST_OWNER};
pub use intent::{Grant, IntentHomes, IntentLevel};
pub use intent_counters::IntentCounters;
pub(crate) use intent_counters::LateCounts;
pub use issue::{Issued, PullTarget, SMALL_OPERATION_ROWS};
pub(crate) use issue::{serve_held, serve_replica};
pub use replica_sync::OutgoingSync;
pub use replication_counters::{Ack, AckMailbox, Replication};
pub use requester::{Delivery, OpId, Requester, worker_of};
pub use shard::Shard;
pub use step::{Progress, Step};
pub(crate) use sync_acks::SyncAcks;
pub use transmit::{ALL_WORKERS, Transmit};
pub use wire::AccessKind;

use crate::config::TableSpec;
use crate::error::Result;
use crate::stats::{CounterRegistry, Stats, latency_histogram};
use crate::store::{RemoteAddr, Store};

/// Behaviour switches of the protocol.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Whether `localize` moves keys (off: a classic parameter server).
    pub relocation: bool,
    /// On how many other nodes every key is backed up (0: none): its owner's successors.
    /// With backups, pushes are acknowledged once backed up, and a lost node's keys fail over
    /// (see [`Backups`]).
    pub backups: usize,
    /// Whether per-node location caches are used.
    pub location_caches: bool,
    /// Largest message; a single value must fit one.
    pub max_message_bytes: usize,
    /// Operations are split into parts of about this many bytes, so that the parts of a large
    /// operation stream through sender, network and receiver at the same time.
    pub part_bytes: usize,
    /// Operations with at most this many remote rows are routed and encoded in one step;
    /// larger ones a frame of parts per step, so that their parts stream
    /// ([`SMALL_OPERATION_ROWS`] unless a test wants streaming at small sizes).
    pub small_operation_rows: usize,
    /// Operations and incoming relocations older than this fail with a timeout.
    pub op_timeout_ns: u64,
    /// After a peer is lost, a relocation to this node that has not landed within this long is
    /// given up (its source is unknown here and may be the lost node).
    pub loss_grace_ns: u64,
    /// Number of key shards (1..=64), each with its own lock.
    pub shards: usize,
    /// Whether nodes tell each other their workers' clocks (CLOCK). Only a delay bound waits
    /// for the cluster's clocks; without one, a trainer that advances its clock every
    /// mini-batch (intent signalling) would send a message to every peer each time for nothing.
    pub share_clocks: bool,
    /// The clock every worker count starts from: 0, or the clock of the checkpoint the
    /// cluster restored (the same on every node).
    pub first_clock: u64,
}

impl Settings {
    /// The part size actually used: at least 64 bytes, at most a message.
    pub fn effective_part_bytes(&self) -> usize {
        self.part_bytes.clamp(64, self.max_message_bytes.max(64))
    }
}

/// A one-sided write of a slot to another node, to be posted by the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotWrite {
    /// Target node.
    pub to: u16,
    /// Source table.
    pub table: u16,
    /// Source slot (its first `len` bytes are written: for a run of several keys, this slot
    /// and the ones after it).
    pub slot: u32,
    /// Bytes to write: the transfer bytes of one slot, plus a whole slot for every further key
    /// of a run.
    pub len: usize,
    /// Keys the write carries (a run of consecutive source and destination slots whose
    /// reservations are consecutive from `imm`).
    pub keys: u32,
    /// Destination.
    pub remote: RemoteAddr,
    /// Immediate delivered with the write.
    pub imm: u32,
    /// Completion id to report back through [`Step::handle_write_done`].
    pub wr_id: u64,
}

/// One node's protocol state, shared by every thread of the node.
pub struct Core {
    store: Arc<Store>,
    directory: Directory,
    shards: Box<[Mutex<Shard>]>,
    barriers: Mutex<Barriers>,
    clocks: Mutex<Clocks>,
    /// Key lists kept for peers' workers (key caching), per (peer, worker).
    key_caches: Mutex<crate::util::FastMap<(u16, u16), keycache::KeyCache>>,
    settings: Settings,
    counters: Arc<CounterRegistry>,
    /// Bumped (under the keys' shard locks, after they are marked arriving) whenever keys start
    /// arriving at this node, once per localize: a requester that saw no change since before
    /// it looked at its keys knows that keys it found elsewhere are elsewhere still.
    arrivals: AtomicU64,
    /// Replication's counters and the acknowledgements its rounds wait for.
    replication: Replication,
    /// Intent signalling's counters.
    intent: IntentCounters,
    /// Intents on the keys homed here, and the moves this node was told to make.
    intent_homes: Mutex<IntentHomes>,
    /// Set when a move waits in `intent_homes` for the intent service.
    intent_go: std::sync::atomic::AtomicBool,
    /// Acknowledgements of this node's REPLICA_SYNC messages, for the intent service.
    replica_sync_acks: SyncAcks,
    /// Backups: rounds, held answers, images kept for the predecessor.
    backups: Mutex<Backups>,
    backup_counters: BackupCounters,
    /// Blocks of keys writes changed since a backup round looked (backups only).
    dirty: DirtyBlocks,
    /// Graceful departures: this node's own, and the others' it knows of.
    departures: Mutex<leave::Departures>,
    /// Whether this node asked to leave (never cleared: it then leaves): paths that run often
    /// look at it before they lock `departures`.
    asked_to_leave: std::sync::atomic::AtomicBool,
    /// Whether forwards are held for a departing home (`Departures::hold_forward`), kept beside
    /// them for the same reason.
    forwards_held: std::sync::atomic::AtomicBool,
    /// The census after a loss (relocation with backups).
    census: Mutex<census::Census>,
    /// One-sided writes posted and not completed (the census flushes once there are none).
    writes_out: AtomicU64,
    /// Per table: the index of a dynamic table's ids (`None` for other tables).
    id_indexes: Vec<Option<crate::dynamic::IdIndex>>,
    /// Answers to this node's ASSIGN messages, and the number of the next one.
    assignments: assign::Assignments,
    assign_requests: std::sync::atomic::AtomicU32,
    /// Eviction: the rounds of the tables this node is a home of, and its answers waiting for
    /// their grace periods.
    evictions: Mutex<evict::Evictions>,
    /// The workers' pins for eviction's grace periods.
    pins: crate::dynamic::Pins,
    /// Where evicted rows are spilled: the rows freed and not taken yet (table, ids, values).
    spilled: Option<Mutex<Vec<crate::dynamic::spill::SpilledRows>>>,
}

impl Core {
    /// The protocol state of node `rank` of `nodes`, over `store` (which holds the home keys).
    pub fn new(rank: usize, nodes: usize, specs: &[TableSpec], store: Arc<Store>, settings: Settings) -> Core {
        let mut directory = Directory::new(rank, nodes, settings.shards, specs, settings.location_caches);
        if settings.backups > 0 {
            directory = directory.with_failover(settings.backups);
            if settings.relocation {
                directory = directory.with_owners_of_every_key();
            }
        }
        let shards = (0..directory.shards()).map(|i| Mutex::new(Shard::new(i))).collect();
        Core {
            store,
            directory,
            shards,
            barriers: Mutex::new(Barriers::new(rank as u16, nodes)),
            clocks: Mutex::new(Clocks::new(rank as u16, nodes, settings.share_clocks, settings.first_clock)),
            key_caches: Mutex::new(Default::default()),
            settings,
            counters: Arc::new(CounterRegistry::default()),
            arrivals: AtomicU64::new(0),
            replication: Replication::new(specs.len()),
            intent: Default::default(),
            intent_homes: Mutex::new({
                let mut homes = IntentHomes::default();
                if settings.backups > 0 {
                    homes.set_moves_only();
                }
                homes
            }),
            intent_go: std::sync::atomic::AtomicBool::new(false),
            replica_sync_acks: Default::default(),
            backups: Mutex::new(Backups::default()),
            backup_counters: BackupCounters::default(),
            dirty: if settings.backups > 0 { DirtyBlocks::new(specs.iter().map(|s| s.keys)) } else { DirtyBlocks::default() },
            departures: Mutex::new(leave::Departures::default()),
            asked_to_leave: std::sync::atomic::AtomicBool::new(false),
            forwards_held: std::sync::atomic::AtomicBool::new(false),
            census: Mutex::new(census::Census::default()),
            writes_out: AtomicU64::new(0),
            id_indexes: specs.iter().map(|s| s.dynamic.map(|d| crate::dynamic::IdIndex::with_replicated(d, rank, nodes, &s.replicated_ids))).collect(),
            assignments: Default::default(),
            assign_requests: std::sync::atomic::AtomicU32::new(0),
            evictions: Default::default(),
            pins: Default::default(),
            spilled: None,
        }
    }

    /// Puts in the dynamic tables' indexes a restore filled (one per table, `None` for tables
    /// that are not dynamic), before the node runs.
    pub(crate) fn set_id_indexes(&mut self, indexes: Vec<Option<crate::dynamic::IdIndex>>) {
        self.id_indexes = indexes;
    }

    /// The index of dynamic table `table`'s ids, if it is dynamic.
    #[inline]
    pub(crate) fn id_index(&self, table: u16) -> Option<&crate::dynamic::IdIndex> {
        self.id_indexes.get(table as usize)?.as_ref()
    }

    /// Answers to this node's ASSIGN messages.
    pub(crate) fn assignments(&self) -> &assign::Assignments {
        &self.assignments
    }

    /// The number of this node's next ASSIGN.
    pub(crate) fn next_assign_request(&self) -> u32 {
        self.assign_requests.fetch_add(1, Ordering::Relaxed)
    }

    /// As the home of `ids` of dynamic table `table`, asked with `intent`: what each is (its
    /// slot key, or why it has none), creating the ids not known yet that the table's admission
    /// filter admits, with their initial values in this node's slots.
    pub(crate) fn assign_ids(&self, table: u16, ids: &[u64], intent: crate::dynamic::Intent, keys: &mut Vec<crate::dynamic::Assigned>) -> Result<usize> {
        let Some(index) = self.id_index(table) else {
            return Err(crate::error::Error::Protocol(format!("ids for table {table}, which is not dynamic")));
        };
        let store = &self.store;
        let mut value = vec![0.0f32; store.table(table).value_len()];
        index.assign(ids, intent, keys, |id, key| {
            index.spec().init.fill(id, &mut value);
            let guard = store.lock(table, key);
            let Some(slot) = guard.slot() else {
                // A slot key of this node's range is here until an id has it.
                return Err(crate::error::Error::Protocol(format!("slot key {key} of table {table} is not held by its home when its id is created")));
            };
            slot.write(&value);
            Ok(())
        })
    }

    /// The census after a loss.
    pub(crate) fn census(&self) -> &Mutex<census::Census> {
        &self.census
    }

    /// Whether a census after a loss is under way here.
    pub fn census_active(&self) -> bool {
        self.directory.recovering()
    }

    /// One-sided writes posted and not completed.
    pub(crate) fn writes_out(&self) -> &AtomicU64 {
        &self.writes_out
    }

    /// Graceful departures' state.
    pub(crate) fn departures(&self) -> &Mutex<leave::Departures> {
        &self.departures
    }

    /// Whether this node asked to leave (without a lock).
    pub(crate) fn asked_to_leave(&self) -> &std::sync::atomic::AtomicBool {
        &self.asked_to_leave
    }

    /// Whether forwards are held for a departing home (without a lock; see
    /// `Departures::hold_forward`).
    pub(crate) fn forwards_held(&self) -> &std::sync::atomic::AtomicBool {
        &self.forwards_held
    }

    /// Whether this node asked to leave, and whether it has left (its keys are handed over
    /// and LEFT went out).
    pub fn leave_state(&self) -> (bool, bool) {
        let d = self.departures.lock();
        (d.asked(), d.has_left())
    }

    /// Whether this node asked to join, and whether it has joined: it holds its keys, takes
    /// part in barriers, and every live node counts it as a member (its workers may start).
    pub fn join_state(&self) -> (bool, bool) {
        let d = self.departures.lock();
        let dir = &self.directory;
        (d.joins.asked(), d.joins.ready_in(dir))
    }

    /// Why this node, joining, gave its join up (see `protocol::leave`, a lost coordinator), if
    /// it did: the node then stops, and the members take it for lost.
    pub fn join_given_up(&self) -> Option<String> {
        self.departures.lock().joins.given_up().map(str::to_string)
    }

    /// Backups' state.
    pub(crate) fn backups(&self) -> &Mutex<Backups> {
        &self.backups
    }

    /// Blocks of keys written since a backup round looked.
    pub(crate) fn dirty_blocks(&self) -> &DirtyBlocks {
        &self.dirty
    }

    /// With backups, notes that a write changed `key` of `table` (after applying it).
    #[inline]
    pub(crate) fn note_written(&self, table: u16, key: u64) {
        if self.settings.backups > 0 {
            self.dirty.mark(table, key);
        }
    }

    /// With backups, notes that writes changed keys `first..first + count` of `table`.
    pub(crate) fn dirty_blocks_note_run(&self, table: u16, first: u64, count: u64) {
        if self.settings.backups > 0 {
            self.dirty.mark_run(table, first, count);
        }
    }

    /// Backup rounds begun and completed, for workers waiting for their pushes to be backed up.
    pub fn backup_counters(&self) -> &BackupCounters {
        &self.backup_counters
    }

    /// Whether answers are held for a backup round, or a round is under way.
    pub fn backup_pending(&self) -> (bool, bool) {
        let b = self.backups.lock();
        (b.has_held(), b.under_way().is_some())
    }

    /// Whether this node, leaving a cluster that relocates keys, waits to have given back the
    /// keys of other homes (`protocol::leave`): the backup watchdog then checks how far it got
    /// (`Step::advance_leave`), now and then.
    pub fn leave_check_due(&self) -> bool {
        self.settings.relocation && self.asked_to_leave.load(Ordering::Acquire) && self.departures.lock().evacuating()
    }

    /// Whether a backup round is due now (see `Backups::round_due`), or a relocation's write
    /// waits for a step to send it after its round completed.
    pub fn backup_round_due(&self) -> bool {
        let b = self.backups.lock();
        b.has_ready() || b.round_due(&self.directory.backup_targets(), &self.backup_counters)
    }

    /// Replication's counters and acknowledgement mailbox.
    #[inline]
    pub fn replication(&self) -> &Replication {
        &self.replication
    }

    /// Intent signalling's counters.
    #[inline]
    pub fn intent_counters(&self) -> &IntentCounters {
        &self.intent
    }

    /// Acknowledgements of this node's REPLICA_SYNC messages.
    pub(crate) fn replica_sync_acks(&self) -> &SyncAcks {
        &self.replica_sync_acks
    }

    /// Intents at this home node, and the moves this node was told to make.
    #[inline]
    pub fn intent_homes(&self) -> &Mutex<IntentHomes> {
        &self.intent_homes
    }

    /// Whether moves wait for the intent service (see [`Core::take_intent_go`]).
    #[inline]
    pub fn intent_go_waiting(&self) -> bool {
        self.intent_go.load(Ordering::Acquire)
    }

    /// Takes the moves this node was told to make (INTENT_GO), per table.
    pub fn take_intent_go(&self) -> Vec<(u16, Grant, Vec<u64>)> {
        let mut homes = self.intent_homes.lock();
        self.intent_go.store(false, Ordering::Release);
        homes.take_go()
    }

    pub(crate) fn post_intent_go(&self, table: u16, grant: Grant, keys: Vec<u64>) {
        // A replica granted for a key held (or arriving) here is kept when the key leaves. The
        // mark is set here, before the frames that follow from the home are handled — the
        // request that moves the key away comes after the grant — not when the intent service
        // gets to the grant; the service takes the marks over, or clears them with any replica
        // kept (`intent::ReplicaSet`). Marks are only taken while the service runs.
        let t = self.store.table(table);
        if grant == Grant::Replicate
            && let Some(d) = t.dynamic()
        {
            for &k in keys.iter().filter(|&&k| t.residence(k) != crate::store::Residence::Away) {
                d.want(k, true);
            }
        }
        self.intent_homes.lock().post_go(table, grant, keys);
        self.intent_go.store(true, Ordering::Release);
    }

    /// The arrivals counter (see the field).
    #[inline]
    pub(crate) fn arrivals(&self) -> u64 {
        self.arrivals.load(Ordering::Acquire)
    }

    /// Keys started arriving (called with their shard locks still held, after they were marked
    /// arriving, so that a requester that read the counter before and found a key away sees
    /// the change; once per batch: every bump is a locked write to a line that each worker's
    /// access reads, and a bump per key cost the intent service about 8 % of its CPU in MF).
    pub(crate) fn note_arrival(&self) {
        self.arrivals.fetch_add(1, Ordering::AcqRel);
    }

    /// This node's rank.
    pub fn rank(&self) -> u16 {
        self.directory.rank()
    }

    /// The store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The directory.
    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// A new output buffer for a thread that drives the protocol.
    pub fn transmit(&self) -> Transmit {
        Transmit::new(self.rank(), self.directory.nodes(), self.settings.effective_part_bytes(), &self.counters)
    }

    /// The operation table of a new worker with index `worker` (see [`Requester::new`]).
    pub fn requester(&self, worker: u16, first_seq: u64) -> Requester {
        Requester::new(self.rank(), worker, first_seq, self.settings.op_timeout_ns)
    }

    /// Starts a step: exclusive access to shards, taken as the event needs them.
    pub fn step<'c, 't>(&'c self, tx: &'t mut Transmit, now: u64) -> Step<'c, 't> {
        Step::new(self, tx, now)
    }

    /// The earliest deadline of any shard (relocations that may have to be given up).
    pub fn poll_timeout(&self) -> Option<u64> {
        self.shards.iter().filter_map(|s| s.lock().poll_timeout()).min()
    }

    /// Released or failed barrier generations since the last call.
    pub fn barrier_events(&self) -> Vec<BarrierEvent> {
        let mut barriers = self.barriers.lock();
        std::iter::from_fn(|| barriers.poll_event()).collect()
    }

    /// Keys currently relocating to this node.
    #[cfg(any(test, feature = "sim"))]
    pub fn keys_in_transit(&self) -> usize {
        self.shards.iter().map(|s| s.lock().keys_in_transit()).sum()
    }

    /// Statistics: the shards' counters and latencies plus every thread's counters.
    pub fn stats(&self) -> Stats {
        let mut s = self.counters.totals();
        let (mut relocation, mut blocking) = (latency_histogram(), latency_histogram());
        for shard in self.shards.iter() {
            shard.lock().counters.add_to(&mut s, &mut relocation, &mut blocking);
        }
        self.replication.add_to(&mut s);
        s.intent = self.intent.snapshot();
        let b = &self.backup_counters;
        s.backups = crate::stats::BackupStats {
            rounds: b.last_completed() as u64,
            images_sent: b.images_sent(),
            keys_adopted: b.keys_adopted(),
            writes_dropped: b.writes_dropped(),
            keys_handed: b.keys_handed(),
            keys_given_back: b.keys_given_back(),
            requests_after_ready: b.requests_after_ready(),
        };
        for index in self.id_indexes.iter().flatten() {
            let (live, evicted, deferred) = index.home_counts();
            s.dynamic.ids_created += index.created();
            s.dynamic.ids_known += index.known();
            s.dynamic.keys_free += index.spec().capacity - live;
            s.dynamic.ids_evicted += evicted;
            s.dynamic.ids_deferred += deferred;
        }
        s.relocation_time = crate::stats::Latency::of(&relocation);
        s.blocking_time = crate::stats::Latency::of(&blocking);
        s
    }

    /// Forgets the relocation and blocking times recorded so far (for measuring phases).
    pub fn reset_latencies(&self) {
        self.replication.reset_latencies();
        for shard in self.shards.iter() {
            shard.lock().counters.reset_latencies();
        }
    }

    pub(crate) fn shard_lock(&self, index: usize) -> &Mutex<Shard> {
        &self.shards[index]
    }

    pub(crate) fn barriers(&self) -> &Mutex<Barriers> {
        &self.barriers
    }

    /// Key lists kept for peers' workers, per (peer, worker).
    pub(crate) fn key_caches(&self) -> &Mutex<crate::util::FastMap<(u16, u16), keycache::KeyCache>> {
        &self.key_caches
    }

    /// The workers' clocks (bounded delay).
    pub fn clocks(&self) -> &Mutex<Clocks> {
        &self.clocks
    }
}

#[cfg(test)]
mod tests;
