//! The handle a trainer thread holds.

mod barrier_hooks;
mod dynamic;
mod hashed;
mod intent;
mod sampling;

pub(crate) use intent::IntentService;

pub use sampling::SampleHandle;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use crate::dynamic::Intent;
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::protocol::{AccessKind, Delivery, Issued, OpId, Progress, PullTarget, Requester, Transmit};
use crate::runtime::NodeInner;
use crate::table::Table;

/// How long a waiting worker polls its connections and inbox spinning, before it yields its
/// core between polls (matrix factorisation's epochs and the single-key latency were the same
/// from 20 to 500 µs; 5 µs made the epochs 1.8× longer).
const SPINNING: Duration = Duration::from_micros(50);
/// How long a waiting worker then polls, yielding its core between polls, before it blocks.
const YIELDING: Duration = Duration::from_micros(50);

/// Counts a waiting worker as polling its fabric while it lives (see [`Fabric::start_polling`]).
struct PollingGuard<'f> {
    fabric: &'f dyn Fabric,
}

impl<'f> PollingGuard<'f> {
    fn start(fabric: &'f dyn Fabric) -> PollingGuard<'f> {
        fabric.start_polling();
        PollingGuard { fabric }
    }
}

impl Drop for PollingGuard<'_> {
    fn drop(&mut self) {
        self.fabric.stop_polling();
    }
}

/// One trainer thread's access to the parameter store.
///
/// Keys may repeat within a call and need not be sorted; values are laid out key after key
/// (`keys.len() × value_len` floats). Keys held by this node are served right here — a latch and
/// a copy, no queue, no allocation, no system call; other keys go to their owners, grouped into
/// one message per destination (parts of about `part_bytes` for large calls).
///
/// Each worker owns its operation table and an inbox: answers to its operations are handled by
/// the worker itself while it waits (pulled values go straight into the caller's buffer), so
/// workers never contend for the node's protocol state unless they touch the same keys.
/// Completions of asynchronous operations are noticed whenever the worker calls into Ferry.
///
/// # Consistency
///
/// Per key, Ferry guarantees:
/// * **synchronous operations are sequentially consistent**, with or without location caches:
///   all nodes' operations on a key take effect in one order that respects each worker's program
///   order, and a pull returns the sum of the pushes (since the last set) before it;
/// * **asynchronous operations are sequentially consistent without location caches**: a worker's
///   operations on a key take effect in the order it issued them, even while the key relocates;
/// * **with location caches, asynchronous operations are only eventually consistent**: a stale
///   cache entry can make a later operation overtake an earlier one (Lapse, Theorem 3).
///
/// A key repeated within one call is applied in the call's order, except that its repeats may
/// take effect in either order when the key arrives at (or leaves) this node during the call,
/// and, with location caches, when a call of more than
/// 4 096 remote rows streams while the
/// key moves (its parts go out one after another, like separate asynchronous operations).
/// Relocations never change values and never lose or duplicate updates. Operations that fail (a
/// lost peer, a timeout) may or may not have taken effect.
pub struct Worker {
    node: Arc<NodeInner>,
    index: u16,
    requester: Requester,
    inbox: Receiver<Delivery>,
    tx: Transmit,
    /// Distributions this worker registered for sampling.
    pub(crate) samplers: Vec<sampling::Sampler>,
    /// The keys of the last range operation (reused: a range operation allocates nothing after
    /// the first of its size).
    range_keys: Vec<u64>,
    /// Buckets and signed values of a feature-hashed table's call, kept between calls.
    hashed_keys: Vec<u64>,
    hashed_values: Vec<f32>,
    /// Bounded-delay clocks (see [`Worker::advance_clock`]).
    pub(crate) clock: u64,
    /// Whether this worker is a trainer's: it takes part in clocks and barriers and keeps
    /// finalize waiting (the intent service's own worker does none of these).
    member: bool,
    /// Whether this worker declared intent (its accesses are then checked for lateness).
    declared: bool,
    /// The node's intent service (the worker declares to it, tells it its clocks, and its
    /// barriers run the service's hooks).
    intent_service: Arc<IntentService>,
    /// With backups: the round this worker's writes so far wait for (see [`Worker::backed_up`]).
    backup_due: Option<u32>,
    /// Writes a node's loss failed count as done (see [`Worker::drop_lost_writes`]).
    drop_lost_writes: bool,
    /// Where a table evicts ids: this worker's pin for eviction's grace periods, set while it
    /// runs an operation on a dynamic table (see `dynamic::evict`).
    pin: Option<crate::dynamic::Pin>,
}

/// An asynchronous push, set or localize in flight; pass it to [`Worker::wait`].
#[must_use = "an operation's outcome is only known by waiting for it"]
pub struct Ticket {
    op: Option<OpId>,
    _token: Arc<()>,
}

/// An asynchronous pull in flight; pass it to [`Worker::wait_pull`].
#[must_use = "a pull's values are only available by waiting for it"]
pub struct PullTicket {
    op: Option<OpId>,
    values: Option<Vec<f32>>,
    _token: Arc<()>,
    /// A signed feature-hashed table's pull: what signs its rows when it is waited for.
    signs: Option<hashed::SignedRows>,
}

impl Worker {
    pub(crate) fn new(node: Arc<NodeInner>, intent_service: Arc<IntentService>) -> Worker {
        Worker::register(node, intent_service, true)
    }

    /// A worker outside the clocks and barriers, which never holds the trainer's workers back
    /// (the intent service's).
    pub(crate) fn unclocked(node: Arc<NodeInner>, intent_service: Arc<IntentService>) -> Worker {
        Worker::register(node, intent_service, false)
    }

    /// Makes this worker's accesses skip (`true`) or use this node's run-time replicas.
    /// Such accesses keep replicas in sync: they are left out of the access and late counts.
    pub(crate) fn bypass_replicas(&mut self, bypass: bool) {
        self.requester.bypass_replicas = bypass;
        self.tx.uncounted = bypass;
    }

    /// Registers a worker with the node (and, for a `member`, with the clocks).
    fn register(node: Arc<NodeInner>, intent_service: Arc<IntentService>, member: bool) -> Worker {
        let (index, first_seq, inbox) = node.register_worker(member);
        let requester = node.core.requester(index, first_seq);
        let mut tx = node.core.transmit();
        let mut clock = 0;
        // Registering touches no network; it cannot fail short of a shutdown, when the clock
        // does not matter.
        if member {
            let _ = node.run(&mut tx, |step, _, _| {
                clock = step.clock_register(index);
                Ok(Progress::Done)
            });
        }
        Worker {
            index,
            requester,
            inbox,
            tx,
            samplers: Vec::new(),
            range_keys: Vec::new(),
            hashed_keys: Vec::new(),
            hashed_values: Vec::new(),
            clock,
            member,
            declared: false,
            intent_service,
            backup_due: None,
            drop_lost_writes: false,
            pin: node.config.tables.iter().any(|t| t.dynamic.is_some_and(|d| d.eviction.evicts())).then(|| node.core.pins().register()),
            node,
        }
    }

    /// With backups, notes whether a write of this worker was applied on this node (the
    /// protocol says so in the buffer): it is acknowledged once a round that begins after now
    /// completed ([`Worker::backed_up`]). Remote owners hold their answers until then by
    /// themselves; this covers the rows applied here.
    #[inline]
    fn note_write(&mut self) {
        if self.tx.take_local_write() {
            self.backup_due = Some(self.node.core.backup_counters().round_after_now());
        }
    }

    /// Waits until this worker's writes are on their backups (nothing to wait for without
    /// backups, or when they are there already).
    fn backed_up(&mut self) -> Result<()> {
        match self.backup_due {
            None => Ok(()),
            Some(round) => {
                self.node.await_backup(round)?;
                self.backup_due = None;
                Ok(())
            }
        }
    }

    /// Whether this worker's writes are on their backups, without waiting.
    fn is_backed_up(&self) -> bool {
        match self.backup_due {
            None => true,
            Some(round) => {
                let done = self.node.core.backup_counters().completed(round);
                if !done {
                    self.node.want_backup(round);
                }
                done
            }
        }
    }

    /// This worker's number on its node.
    pub fn id(&self) -> usize {
        self.index as usize
    }

    /// The node's rank.
    pub fn rank(&self) -> usize {
        self.node.config.rank
    }

    /// Looks a table up by name.
    pub fn table(&self, name: &str) -> Result<Table> {
        self.node.table(name)
    }

    /// The table's name, once the handle is checked to belong to this cluster.
    pub(crate) fn checked_table_name(&self, table: Table) -> Result<String> {
        self.node.check_table(table)?;
        Ok(self.node.config.tables[table.id as usize].name.clone())
    }

    /// Whether this node holds `key` right now (it may leave the next moment).
    #[inline]
    pub(crate) fn holds(&self, table: Table, key: u64) -> bool {
        self.node.core.store().table(table.id).slot_of(key).is_some()
    }

    /// Whether keys can move between nodes in this cluster.
    pub(crate) fn relocation_enabled(&self) -> bool {
        self.node.config.relocation
    }

    #[inline]
    fn validate_keys(&self, table: Table, keys: &[u64]) -> Result<()> {
        self.node.check_table(table)?;
        if keys.iter().any(|&k| k >= table.keys) {
            return Err(self.unknown_key(table, keys));
        }
        Ok(())
    }

    /// Checks the table handle and the value buffer's length. Keys are checked where they are
    /// used: by the protocol before anything takes effect (one pass over a large batch, not two).
    #[inline]
    fn validate(&self, table: Table, keys: &[u64], values: usize, what: &'static str) -> Result<()> {
        self.node.check_table(table)?;
        let expected = keys.len() * table.value_len;
        if values != expected {
            return Err(Error::WrongLength { what, expected, got: values });
        }
        Ok(())
    }

    #[cold]
    fn unknown_key(&self, table: Table, keys: &[u64]) -> Error {
        let key = keys.iter().copied().find(|&k| k >= table.keys).unwrap_or(u64::MAX);
        Error::UnknownKey { table: self.node.config.tables[table.id as usize].name.clone(), key, keys: table.keys }
    }

    /// The hot path for one key held here: a latch and a copy (a push to a replica also adds
    /// to its delta under the same latch). `None` when the key is elsewhere, and for a set of a
    /// replica, which goes to the key's home node.
    #[inline]
    fn single_local(&mut self, kind: AccessKind, table: Table, key: u64, input: &[f32], output: &mut [f32]) -> Option<()> {
        let store = self.node.core.store();
        let t = store.table(table.id);
        let replicas = t.replicas();
        let ordinal = replicas.and_then(|r| r.ordinal(key));
        if kind == AccessKind::Set && ordinal.is_some() {
            return None;
        }
        if !(kind == AccessKind::Pull && t.read_optimistic(key, output)) {
            let guard = store.lock(table.id, key);
            let Some(slot) = guard.slot() else {
                // A run-time replica (intent) serves all but a set.
                let (value, delta) = guard.replica().filter(|_| kind != AccessKind::Set && !self.requester.bypass_replicas)?;
                crate::protocol::serve_replica(&value, &delta, kind, input, output);
                drop(guard);
                self.tx.count_local(1);
                self.tx.count_replica(1);
                return Some(());
            };
            crate::protocol::serve_held(&slot, t.updater(), kind, input, output);
            if let (Some(o), Some(r), AccessKind::Push | AccessKind::PushPull) = (ordinal, replicas, kind) {
                r.add_delta(o, input);
            }
        }
        self.tx.count_local(1);
        if kind != AccessKind::Pull && self.node.config.backups > 0 {
            self.node.core.note_written(table.id, key);
            self.backup_due = Some(self.node.core.backup_counters().round_after_now());
        }
        if ordinal.is_some() && self.tx.count_replica(1) {
            self.node.core.replication().sample_staleness(table.id, self.node.now());
        }
        Some(())
    }

    /// Issues an access (local rows served at once) and hands its parts to the fabric as they
    /// are encoded.
    /// `owned`: an asynchronous pull's buffer; `caller`: a synchronous pull's.
    #[allow(clippy::too_many_arguments)]
    fn issue(
        &mut self,
        kind: AccessKind,
        table: Table,
        keys: &[u64],
        input: &[f32],
        owned: Option<Vec<f32>>,
        mut caller: Option<&mut [f32]>,
        ticket: Option<&Arc<()>>,
    ) -> Result<Issued> {
        let node = self.node.clone();
        // Late accesses (intent): counted from the keys the protocol could not serve here (every
        // access that returns refills `remote_keys`), so that an access served here costs
        // nothing more. The service's own accesses, which bypass replicas to sync them, are not
        // the trainer's and are not counted.
        let count_late = self.declared && !self.requester.bypass_replicas;
        // Backpressure: a peer's full send queue holds the worker here, before it adds more.
        node.fabric.wait_for_room(node.config.op_timeout)?;
        let mut issued = None;
        let ticket = ticket.map(Arc::downgrade);
        let mut owned = owned;
        node.run(&mut self.tx, |step, _, _| {
            let target = match (owned.take(), caller.as_deref_mut()) {
                (Some(v), _) => PullTarget::Owned(v),
                (None, Some(c)) => PullTarget::Caller(c),
                (None, None) => PullTarget::None,
            };
            issued = Some(step.issue_access(&mut self.requester, kind, table.id, keys, input, target, ticket.clone()));
            Ok(Progress::Done)
        })?;
        let issued = issued.unwrap_or(Err(Error::ShutDown))?;
        self.note_write();
        if count_late && let Some(away) = self.requester.remote_keys.as_mut().filter(|away| !away.is_empty()) {
            if kind == AccessKind::Set {
                // A set goes to the key's owner even past a replica here, and a key replicated
                // here for the intent is not late.
                let t = node.core.store().table(table.id);
                away.retain(|&key| !t.has_dynamic_replica(key));
            }
            let late = self.intent_service.count_late(node.core.intent_homes(), table.id, away, self.index, self.clock);
            node.core.intent_counters().note_late(&late);
        }
        if let Issued::Pending { op, more: true } = issued {
            let mut more = true;
            let mut paused_since: Option<std::time::Instant> = None;
            while more {
                node.fabric.wait_for_room(node.config.op_timeout)?;
                node.run(&mut self.tx, |step, _, _| {
                    more = step.continue_issue(&mut self.requester, op, keys, input, caller.as_deref_mut());
                    Ok(Progress::Done)
                })?;
                if self.requester.take_paused() {
                    // Parts wait for a node's departure, or for the census after a loss (a
                    // few round trips): try again soon.
                    let since = *paused_since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() > node.config.op_timeout {
                        let leaving = node.core.directory().departing().map(usize::from);
                        return Err(Error::Timeout {
                            what: if leaving.is_some() { "a node's departure" } else { "the census after a loss" },
                            millis: node.config.op_timeout.as_millis() as u64,
                            nodes: leaving.into_iter().collect(),
                        });
                    }
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
            }
            self.note_write();
        }
        Ok(issued)
    }

    /// Feeds one delivery to the operation table.
    fn handle(&mut self, delivery: Delivery, waiting: Option<(OpId, &mut [f32])>) {
        if let Some(fault) = self.requester.handle(delivery, self.node.core.directory(), waiting) {
            if fault.peer as usize == self.node.config.rank {
                tracing::error!(node = fault.peer, error = %fault.error, "a malformed answer from this node's own protocol");
            } else {
                tracing::error!(node = self.node.config.rank, peer = fault.peer, error = %fault.error, "closing the connection to a peer that broke the protocol");
                self.node.fabric.disconnect(fault.peer as usize);
            }
        }
    }

    /// Handles whatever deliveries are waiting, without blocking.
    fn progress(&mut self) {
        while let Ok(d) = self.inbox.try_recv() {
            self.handle(d, None);
        }
        self.requester.handle_timeout(self.node.now());
    }

    /// Waits for `op`, handling deliveries; a synchronous pull's values go into `caller`.
    fn wait_op(&mut self, op: OpId, mut caller: Option<&mut [f32]>) -> Result<Vec<f32>> {
        loop {
            if let Some(result) = self.requester.take(op) {
                return result;
            }
            if !self.requester.is_pending(op) {
                return Err(Error::Protocol(format!("operation {op} is unknown to this worker")));
            }
            match self.next_delivery()? {
                Some(d) => self.handle(d, caller.as_deref_mut().map(|c| (op, c))),
                None => self.requester.handle_timeout(self.node.now()),
            }
        }
    }

    /// The next delivery, or `None` when the earliest deadline of this worker's operations
    /// passed first. An answer on a fast network comes within microseconds, sooner than a park
    /// and wake-up, so the worker first polls: it reads the connections itself (the answer then
    /// needs no reader thread to wake and hand it over) and its inbox, spinning for a while,
    /// then yielding its core between polls for a while (on a machine with few cores the
    /// threads it waits for need it), and only then blocks.
    fn next_delivery(&mut self) -> Result<Option<Delivery>> {
        let fabric = self.node.fabric.clone();
        let polling = PollingGuard::start(&*fabric);
        let started = Instant::now();
        loop {
            let polled = fabric.poll_receive();
            match self.inbox.try_recv() {
                Ok(d) => return Ok(Some(d)),
                Err(TryRecvError::Empty) => {}
                Err(TryRecvError::Disconnected) => return Err(Error::ShutDown),
            }
            let waited = started.elapsed();
            if waited >= SPINNING + YIELDING {
                break;
            }
            if polled {
                continue;
            }
            if waited < SPINNING {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        drop(polling);
        let now = self.node.now();
        let deadline = self.requester.poll_timeout().unwrap_or(now + 1_000_000_000);
        let wait = Instant::now() + Duration::from_nanos(deadline.saturating_sub(now));
        match self.inbox.recv_deadline(wait) {
            Ok(d) => Ok(Some(d)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(Error::ShutDown),
        }
    }

    /// Reads the values of `keys` into `out` (`keys.len() × value_len` floats). With backups
    /// ([`crate::Config::backups`]) a pull that a node's loss failed is repeated, served by the
    /// lost node's successor: it fails only when a key was lost (`KeyLost`).
    #[inline]
    pub fn pull(&mut self, table: Table, keys: &[u64], out: &mut [f32]) -> Result<()> {
        self.validate(table, keys, out.len(), "pull output")?;
        if let Some(h) = table.hashing {
            self.through_buckets(table, h, keys, &[], |w, t, buckets, _| w.pull(t, buckets, &mut *out))?;
            Worker::sign_rows(h, table.value_len, keys, out);
            return Ok(());
        }
        if table.dynamic {
            return self.through_index(table, keys, Intent::Read, &[], Some(out), Box::new(|w, t, k, _, out| w.pull(t, k, out.unwrap_or_default())));
        }
        if let [key] = keys
            && let Some(()) = self.single_local(AccessKind::Pull, table, *key, &[], out)
        {
            return Ok(());
        }
        // A pull is safe to repeat: with backups, one that a node's loss failed is issued again
        // (by then this node knows of the loss and routes the lost node's keys to its successor,
        // which learnt of it first), once per node lost meanwhile.
        let mut retries = if self.node.config.backups > 0 { self.node.config.nodes - 1 } else { 0 };
        loop {
            let outcome = match self.issue(AccessKind::Pull, table, keys, &[], None, Some(&mut *out), None) {
                Ok(Issued::Done(_)) => Ok(()),
                Ok(Issued::Pending { op, .. }) => self.wait_op(op, Some(&mut *out)).map(|_| ()),
                Err(e) => Err(e),
            };
            match outcome {
                Err(Error::PeerLost { node, .. }) if retries > 0 && self.node.core.directory().is_lost(node as u16) => retries -= 1,
                outcome => return outcome,
            }
        }
    }

    /// Adds `updates` to the values of `keys` (cumulative).
    #[inline]
    pub fn push(&mut self, table: Table, keys: &[u64], updates: &[f32]) -> Result<()> {
        self.validate(table, keys, updates.len(), "push updates")?;
        if let Some(h) = table.hashing {
            return self.through_buckets(table, h, keys, updates, |w, t, buckets, updates| w.push(t, buckets, updates));
        }
        if table.dynamic {
            return self.through_index(table, keys, Intent::Write, updates, None, Box::new(|w, t, k, u, _| w.push(t, k, u)));
        }
        if let [key] = keys
            && let Some(()) = self.single_local(AccessKind::Push, table, *key, updates, &mut [])
        {
            return self.backed_up();
        }
        match self.issue(AccessKind::Push, table, keys, updates, None, None, None)? {
            Issued::Done(_) => {}
            Issued::Pending { op, .. } => {
                let outcome = self.wait_op(op, None).map(|_| ());
                self.lost_write(outcome)?;
            }
        }
        self.backed_up()
    }

    /// With backups, lets a push or set that a node's loss failed count as done (`on`), rather
    /// than fail with [`Error::PeerLost`]: it may or may not have been applied before the node
    /// went, which stochastic training takes as noise. Pulls need no such switch (they are
    /// repeated at the lost node's successor). Off by default; [`crate::BackupStats`] counts the
    /// writes dropped.
    pub fn drop_lost_writes(&mut self, on: bool) {
        self.drop_lost_writes = on;
    }

    /// A write's outcome, with a failure by a node that is lost (its keys failed over) dropped
    /// when [`Worker::drop_lost_writes`] is on.
    fn lost_write(&mut self, outcome: Result<()>) -> Result<()> {
        match outcome {
            Err(Error::PeerLost { node, .. })
                if self.drop_lost_writes && self.node.core.directory().failover() && self.node.core.directory().is_lost(node as u16) =>
            {
                self.node.core.backup_counters().note_dropped();
                Ok(())
            }
            outcome => outcome,
        }
    }

    /// Applies `updates` to `keys` (with the table's updater) and reads the updated values into
    /// `out`, in one round trip per owner: each value read includes this call's update of it
    /// and nothing applied to the key after that update.
    pub fn push_pull(&mut self, table: Table, keys: &[u64], updates: &[f32], out: &mut [f32]) -> Result<()> {
        self.validate(table, keys, updates.len(), "push_pull updates")?;
        self.validate(table, keys, out.len(), "push_pull output")?;
        if let Some(h) = table.hashing {
            self.through_buckets(table, h, keys, updates, |w, t, buckets, updates| w.push_pull(t, buckets, updates, &mut *out))?;
            Worker::sign_rows(h, table.value_len, keys, out);
            return Ok(());
        }
        if table.dynamic {
            return self.through_index(
                table,
                keys,
                Intent::Write,
                updates,
                Some(out),
                Box::new(|w, t, k, u, out| w.push_pull(t, k, u, out.unwrap_or_default())),
            );
        }
        if let [key] = keys
            && let Some(()) = self.single_local(AccessKind::PushPull, table, *key, updates, out)
        {
            return self.backed_up();
        }
        match self.issue(AccessKind::PushPull, table, keys, updates, None, Some(&mut *out), None)? {
            Issued::Done(_) => {}
            Issued::Pending { op, .. } => {
                self.wait_op(op, Some(out))?;
            }
        }
        self.backed_up()
    }

    /// Starts a push-pull; the updated values come from [`Worker::wait_pull`].
    pub fn push_pull_async(&mut self, table: Table, keys: &[u64], updates: &[f32]) -> Result<PullTicket> {
        self.validate(table, keys, updates.len(), "push_pull updates")?;
        if let Some(h) = table.hashing {
            return self.hashed_pull_async(table, h, keys, updates, |w, t, buckets, updates| w.push_pull_async(t, buckets, updates));
        }
        if table.dynamic {
            return self.dynamic_pull_async(table, keys, updates, true);
        }
        let token = Arc::new(());
        let values = vec![0.0; keys.len() * table.value_len];
        Ok(match self.issue(AccessKind::PushPull, table, keys, updates, Some(values), None, Some(&token))? {
            Issued::Done(values) => PullTicket { op: None, values, _token: token, signs: None },
            Issued::Pending { op, .. } => PullTicket { op: Some(op), values: None, _token: token, signs: None },
        })
    }

    /// Reads the values of the keys `range` (in order) into `out`. The keys travel as a range
    /// (first key and count), not as a list: the range costs no bytes on the wire.
    pub fn pull_range(&mut self, table: Table, range: std::ops::Range<u64>, out: &mut [f32]) -> Result<()> {
        let keys = self.range_keys(table, range)?;
        let result = self.pull(table, &keys, out);
        self.range_keys = keys;
        result
    }

    /// Pushes `updates` to the keys `range` (in order), sent as a range like [`Worker::pull_range`].
    pub fn push_range(&mut self, table: Table, range: std::ops::Range<u64>, updates: &[f32]) -> Result<()> {
        let keys = self.range_keys(table, range)?;
        let result = self.push(table, &keys, updates);
        self.range_keys = keys;
        result
    }

    /// The keys of `range`, in the worker's reused buffer (taken; the caller puts it back).
    fn range_keys(&mut self, table: Table, range: std::ops::Range<u64>) -> Result<Vec<u64>> {
        self.node.check_table(table)?;
        if table.hashing.is_some() {
            return Err(Error::Config(format!(
                "table '{}' is feature-hashed: its ids are spread over its buckets, so there are no key ranges to pull or push (pull and push the ids)",
                self.node.config.tables[table.id as usize].name
            )));
        }
        if table.dynamic {
            return Err(Error::Config(format!(
                "table '{}' is dynamic: its ids are mapped to slot keys as they come, so there are no key ranges to pull or push (pull and push the ids)",
                self.node.config.tables[table.id as usize].name
            )));
        }
        if range.start > range.end || range.end > table.keys {
            return Err(Error::Config(format!(
                "key range {}..{} is not within the {} keys of table '{}'",
                range.start, range.end, table.keys, self.node.config.tables[table.id as usize].name
            )));
        }
        let mut keys = std::mem::take(&mut self.range_keys);
        keys.clear();
        keys.extend(range);
        Ok(keys)
    }

    /// Overwrites the values of `keys`.
    pub fn set(&mut self, table: Table, keys: &[u64], values: &[f32]) -> Result<()> {
        if let Some(h) = table.hashing {
            self.validate(table, keys, values.len(), "set values")?;
            return self.through_buckets(table, h, keys, values, |w, t, buckets, values| w.set(t, buckets, values));
        }
        if table.dynamic {
            self.validate(table, keys, values.len(), "set values")?;
            return self.through_index(table, keys, Intent::Force, values, None, Box::new(|w, t, k, v, _| w.set(t, k, v)));
        }
        self.validate(table, keys, values.len(), "set values")?;
        match self.issue(AccessKind::Set, table, keys, values, None, None, None)? {
            Issued::Done(_) => {}
            Issued::Pending { op, .. } => {
                let outcome = self.wait_op(op, None).map(|_| ());
                self.lost_write(outcome)?;
            }
        }
        self.backed_up()
    }

    /// Reads the rows of those of `ids` that table `table` holds into `out` (`ids.len() ×
    /// value_len` floats) and says which it holds, creating none: the rows of the others take
    /// their initial values. On a dynamic table this is how its contents are read (to save a
    /// model, say) where a pull would create the ids it reads under `Admission::All`; an id
    /// offered in an eviction round under way is read and kept, as by any read. Every key of
    /// another table is held.
    pub fn pull_held(&mut self, table: Table, ids: &[u64], out: &mut [f32]) -> Result<Vec<bool>> {
        if table.dynamic {
            self.validate(table, ids, out.len(), "pull output")?;
            return self.dynamic_pull_held(table, ids, out);
        }
        self.pull(table, ids, out)?;
        Ok(vec![true; ids.len()])
    }

    /// Reads `keys` into `out` only if all of them are held by this node; returns whether it
    /// did. Never touches the network.
    pub fn pull_if_local(&mut self, table: Table, keys: &[u64], out: &mut [f32]) -> Result<bool> {
        if let Some(h) = table.hashing {
            // The pull of the buckets checks the table and the output's length.
            let local = self.through_buckets(table, h, keys, &[], |w, t, buckets, _| w.pull_if_local(t, buckets, &mut *out))?;
            if local {
                Worker::sign_rows(h, table.value_len, keys, out);
            }
            return Ok(local);
        }
        if table.dynamic {
            // Never touches the network: an id this node does not know is not here.
            let node = self.node.clone();
            let index = node.core.id_index(table.id);
            if !keys.iter().all(|&id| index.is_some_and(|i| i.lookup(id).is_some())) {
                self.validate(table, keys, out.len(), "pull output")?;
                return Ok(false);
            }
            return self.through_index(table, keys, Intent::Read, &[], Some(out), Box::new(|w, t, k, _, out| w.pull_if_local(t, k, out.unwrap_or_default())));
        }
        self.validate_keys(table, keys)?;
        self.validate(table, keys, out.len(), "pull output")?;
        let store = self.node.core.store();
        let t = store.table(table.id);
        if keys.iter().any(|&k| t.slot_of(k).is_none()) {
            return Ok(false);
        }
        let value_len = table.value_len;
        for (row, &key) in keys.iter().enumerate() {
            let dst = &mut out[row * value_len..(row + 1) * value_len];
            if t.read_optimistic(key, dst) {
                continue;
            }
            let guard = store.lock(table.id, key);
            let Some(slot) = guard.slot() else { return Ok(false) };
            slot.read(dst);
        }
        self.tx.count_local(keys.len());
        Ok(true)
    }

    /// Moves `keys` to this node and waits until they are here (keys already here are skipped).
    /// Without relocation (a classic parameter server) it returns at once.
    pub fn localize(&mut self, table: Table, keys: &[u64]) -> Result<()> {
        let ticket = self.localize_async(table, keys)?;
        self.wait(ticket)
    }

    /// Starts moving `keys` to this node. A key with a run-time replica here (intent) whose
    /// delta a sync round is carrying to the key's owner is moved once that round has ended:
    /// the call waits for it (a few milliseconds; at most the operation timeout).
    pub fn localize_async(&mut self, table: Table, keys: &[u64]) -> Result<Ticket> {
        if let Some(h) = table.hashing {
            self.node.check_table(table)?;
            return self.through_buckets(table, h, keys, &[], |w, t, buckets, _| w.start_localize(t, buckets, false));
        }
        if table.dynamic {
            self.node.check_table(table)?;
            return self.through_index(table, keys, Intent::Read, &[], None, Box::new(|w, t, k, _, _| w.start_localize(t, k, false)));
        }
        self.start_localize(table, keys, false)
    }

    /// Starts moving `keys` to this node because their homes granted them to it (the intent
    /// service): a home declines a key it has granted to another node since, and the ticket
    /// then completes without it. The service leaves out keys whose replicas' deltas a sync
    /// round carries (see `intent::SyncMarks`).
    pub(crate) fn localize_granted_async(&mut self, table: Table, keys: &[u64]) -> Result<Ticket> {
        self.start_localize(table, keys, true)
    }

    fn start_localize(&mut self, table: Table, keys: &[u64], granted: bool) -> Result<Ticket> {
        self.validate_keys(table, keys)?;
        let node = self.node.clone();
        // An explicit localize of keys replicated here at run time: their deltas must not be on
        // their way to the old owner when they land (see `intent::SyncMarks`).
        if !granted && node.core.store().table(table.id).dynamic().is_some_and(|d| d.any() || d.any_making() || self.intent_service.is_running()) {
            let marks = self.intent_service.clone();
            let marks = marks.marks();
            let in_sync = marks.begin_localize(table.id, keys);
            let synced = in_sync.is_empty() || marks.wait_synced(table.id, &in_sync, Instant::now() + node.config.op_timeout);
            let outcome = if synced {
                self.issue_localize(table, keys, granted)
            } else {
                Err(Error::Timeout {
                    what: "waiting for a sync round of run-time replicas to end before a localize",
                    millis: node.config.op_timeout.as_millis() as u64,
                    nodes: Vec::new(),
                })
            };
            marks.end_localize(table.id, keys);
            return outcome;
        }
        self.issue_localize(table, keys, granted)
    }

    fn issue_localize(&mut self, table: Table, keys: &[u64], granted: bool) -> Result<Ticket> {
        let token = Arc::new(());
        let weak = Arc::downgrade(&token);
        let node = self.node.clone();
        node.fabric.wait_for_room(node.config.op_timeout)?;
        let mut issued = None;
        node.run(&mut self.tx, |step, _, _| {
            issued = Some(step.issue_localize(&mut self.requester, table.id, keys, granted, Some(weak.clone())));
            Ok(Progress::Done)
        })?;
        let op = match issued.unwrap_or(Err(Error::ShutDown))? {
            Issued::Done(_) => None,
            Issued::Pending { op, .. } => Some(op),
        };
        Ok(Ticket { op, _token: token })
    }

    /// Starts a pull; the values come from [`Worker::wait_pull`].
    pub fn pull_async(&mut self, table: Table, keys: &[u64]) -> Result<PullTicket> {
        self.validate(table, keys, keys.len() * table.value_len, "pull output")?;
        if let Some(h) = table.hashing {
            return self.hashed_pull_async(table, h, keys, &[], |w, t, buckets, _| w.pull_async(t, buckets));
        }
        if table.dynamic {
            return self.dynamic_pull_async(table, keys, &[], false);
        }
        let token = Arc::new(());
        let values = vec![0.0; keys.len() * table.value_len];
        Ok(match self.issue(AccessKind::Pull, table, keys, &[], Some(values), None, Some(&token))? {
            Issued::Done(values) => PullTicket { op: None, values, _token: token, signs: None },
            Issued::Pending { op, .. } => PullTicket { op: Some(op), values: None, _token: token, signs: None },
        })
    }

    /// Starts the pull that makes run-time replicas of `keys` (the intent service's worker,
    /// which bypasses replicas): the pushes this node's workers send to those keys behind it,
    /// which its values lack, are added up until the caller ends each key's making
    /// ([`crate::store::DynamicReplicas::end_making`]) — including keys of a pull that fails.
    pub(crate) fn pull_to_make_replicas(&mut self, table: Table, keys: &[u64]) -> Result<PullTicket> {
        self.requester.making_replicas = true;
        let ticket = self.pull_async(table, keys);
        self.requester.making_replicas = false;
        ticket
    }

    /// Starts a push.
    pub fn push_async(&mut self, table: Table, keys: &[u64], updates: &[f32]) -> Result<Ticket> {
        self.validate(table, keys, updates.len(), "push updates")?;
        if let Some(h) = table.hashing {
            return self.through_buckets(table, h, keys, updates, |w, t, buckets, updates| w.push_async(t, buckets, updates));
        }
        if table.dynamic {
            return self.through_index(table, keys, Intent::Write, updates, None, Box::new(|w, t, k, u, _| w.push_async(t, k, u)));
        }
        self.start(AccessKind::Push, table, keys, updates)
    }

    /// Starts a set.
    pub fn set_async(&mut self, table: Table, keys: &[u64], values: &[f32]) -> Result<Ticket> {
        self.validate(table, keys, values.len(), "set values")?;
        if let Some(h) = table.hashing {
            return self.through_buckets(table, h, keys, values, |w, t, buckets, values| w.set_async(t, buckets, values));
        }
        if table.dynamic {
            return self.through_index(table, keys, Intent::Force, values, None, Box::new(|w, t, k, v, _| w.set_async(t, k, v)));
        }
        self.start(AccessKind::Set, table, keys, values)
    }

    fn start(&mut self, kind: AccessKind, table: Table, keys: &[u64], input: &[f32]) -> Result<Ticket> {
        let token = Arc::new(());
        let op = match self.issue(kind, table, keys, input, None, None, Some(&token))? {
            Issued::Done(_) => None,
            Issued::Pending { op, .. } => Some(op),
        };
        Ok(Ticket { op, _token: token })
    }

    /// Waits for an asynchronous push, set or localize.
    pub fn wait(&mut self, ticket: Ticket) -> Result<()> {
        if let Some(op) = ticket.op {
            let outcome = self.wait_op(op, None).map(|_| ());
            self.unpin_if_idle();
            self.lost_write(outcome)?;
        }
        self.backed_up()
    }

    /// Waits for an asynchronous pull and returns its values.
    pub fn wait_pull(&mut self, ticket: PullTicket) -> Result<Vec<f32>> {
        let mut values = match (ticket.op, ticket.values) {
            (_, Some(values)) => values,
            (Some(op), None) => {
                let values = self.wait_op(op, None);
                self.unpin_if_idle();
                values?
            }
            (None, None) => Vec::new(),
        };
        self.backed_up()?;
        if let Some(signed) = &ticket.signs {
            Worker::sign_rows(signed.hashing, signed.value_len, &signed.ids, &mut values);
        }
        Ok(values)
    }

    /// Whether the operation of `ticket` has completed (successfully or not); handles waiting
    /// answers first, never blocks.
    pub fn is_done(&mut self, ticket: &Ticket) -> bool {
        self.progress();
        self.unpin_if_idle();
        ticket.op.is_none_or(|op| !self.requester.is_pending(op)) && self.is_backed_up()
    }

    /// Whether the pull of `ticket` has completed; handles waiting answers first, never blocks.
    pub fn is_pull_done(&mut self, ticket: &PullTicket) -> bool {
        self.progress();
        self.unpin_if_idle();
        ticket.op.is_none_or(|op| !self.requester.is_pending(op)) && self.is_backed_up()
    }

    /// Waits until this worker's asynchronous operations have completed, then until every live
    /// worker of every node has reached the barrier. Operations issued before the barrier are
    /// visible to all operations after it.
    ///
    /// A node enters the barrier when all of its workers alive at that moment have arrived, so
    /// make a node's workers before any of them may reach a barrier (for instance before
    /// spawning their threads): a worker made after its node entered a barrier takes part in
    /// the next one, and waits for it.
    pub fn barrier(&mut self) -> Result<()> {
        self.barrier_within(self.node.config.op_timeout)
    }

    /// The cluster-wide generation of the last barrier this worker passed (0 before its
    /// first). Every node numbers generations alike, and a node that joined a running cluster
    /// ([`crate::Node::join`]) goes on from the generation it joined in: so a trainer can tell
    /// a node that joins where the others are — say, by writing into a table the generation
    /// at which an epoch begins — and the joining node passes barriers until it reaches it.
    pub fn barriers_passed(&self) -> u32 {
        self.node.barriers_entered()
    }

    /// [`Worker::barrier`] with its own timeout instead of the operation timeout, for a phase in
    /// which one node computes for long while the others wait (rank 0 evaluating a model, for
    /// one). A lost node still fails it within the liveness timeout.
    pub fn barrier_within(&mut self, timeout: Duration) -> Result<()> {
        self.wait_all_pending()?;
        // The services' hooks nest around the cluster-wide barrier (see `barrier_hooks`).
        for service in barrier_hooks::SERVICES {
            service.before_barrier(self)?;
        }
        self.node.worker_barrier(timeout)?;
        for service in barrier_hooks::SERVICES.iter().rev() {
            service.after_barrier(self)?;
        }
        Ok(())
    }

    /// Waits until this worker's asynchronous operations have completed (at most the
    /// operation timeout).
    fn wait_all_pending(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.node.config.op_timeout;
        while self.requester.pending() > 0 {
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: "waiting for asynchronous operations before a barrier or clock",
                    millis: self.node.config.op_timeout.as_millis() as u64,
                    nodes: self.requester.unanswered_nodes(),
                });
            }
            match self.inbox.recv_deadline((Instant::now() + Duration::from_millis(10)).min(deadline)) {
                Ok(d) => self.handle(d, None),
                Err(RecvTimeoutError::Timeout) => self.requester.handle_timeout(self.node.now()),
                Err(RecvTimeoutError::Disconnected) => return Err(Error::ShutDown),
            }
        }
        // Nothing in flight: no longer holding eviction's grace periods back.
        self.unpin_if_idle();
        self.backed_up()
    }

    /// Completes this worker's current clock (iteration) and starts the next; returns the new
    /// clock's number. The worker's asynchronous operations complete first, so a completed
    /// clock's updates have reached their keys. With a delay bound `τ`
    /// ([`crate::Config::max_delay`]) it then waits until every worker of the cluster has
    /// completed clock `c − τ − 1`, where `c` is the clock it starts (the parameter server's
    /// bounded delay, Sections 3.4–3.5): `τ = 0` makes clocks bulk synchronous. Without a bound
    /// it only counts. A worker created later starts at its node's slowest worker's clock; a
    /// worker that stops advancing holds the others back (drop it to release them) unless
    /// its node is lost. Waits at most the operation timeout; see
    /// [`Worker::advance_clock_within`].
    pub fn advance_clock(&mut self) -> Result<u64> {
        self.advance_clock_within(self.node.config.op_timeout)
    }

    /// [`Worker::advance_clock`] waiting at most `timeout` for slower workers.
    pub fn advance_clock_within(&mut self, timeout: Duration) -> Result<u64> {
        self.wait_all_pending()?;
        let node = self.node.clone();
        let mut completed = None;
        node.run(&mut self.tx, |step, _, _| {
            completed = Some(step.clock_advance(self.index));
            Ok(Progress::Done)
        })?;
        let completed = completed.ok_or(Error::ShutDown)?;
        self.clock = completed;
        if self.declared {
            self.intent_service.note_clock(self.index, completed);
        }
        if let Some(tau) = node.config.max_delay {
            node.wait_clock(completed.saturating_sub(tau), timeout)?;
        }
        Ok(completed)
    }

    /// Tells the homes of `keys` how much this node needs them now (the intent service's
    /// worker).
    pub(crate) fn signal_intent(&mut self, table: u16, keys: &[u64], level: crate::intent::IntentLevel) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let node = self.node.clone();
        node.fabric.wait_for_room(node.config.op_timeout)?;
        node.run(&mut self.tx, |step, _, _| {
            step.signal_intent(table, keys, level);
            Ok(Progress::Done)
        })
    }

    /// The clock this worker is in (the number of clocks it has completed).
    pub fn current_clock(&self) -> u64 {
        self.clock
    }

    /// Declares that this worker will need `keys` of `table` in its clocks `start..end` (see
    /// [`Worker::advance_clock`]; `start` is inclusive, `end` exclusive), so that the node
    /// relocates them here in time (AdaPM, *Good Intentions*, Sections 3 and 4): a background
    /// thread estimates how fast this worker's clock advances and, once the worker may reach
    /// `start` within the next two of its rounds, tells each key's home; the home grants the
    /// key to the one node that needs it now (or, with nobody needing it now, to the one node
    /// that needs it at all), and the key moves there. Intent changes where keys live, never
    /// what operations return: every operation keeps the guarantees stated on [`Worker`],
    /// whether the key arrived in time or not. Accesses in the window that still find the key
    /// elsewhere are counted as late ([`crate::IntentStats`]).
    ///
    /// Windows of several workers of this node on the same key are acted on as one, and a
    /// window that begins at most [`crate::IntentSettings::gap`] clocks after one of this
    /// worker's on the key ends extends it. A key that several nodes need at the same time
    /// stays where it is and is replicated on the others while they need it, if its table's
    /// updater is [`crate::Updater::Add`] (see `docs/INTENT.md`); a worker's barrier first
    /// releases the keys whose windows ended. Keys replicated by the table's configuration are
    /// served here already and are left out; without relocation, or on a single node, intents
    /// are checked and otherwise ignored. An empty window, or one that ended already, changes nothing; `start > end` is an
    /// error.
    pub fn intent(&mut self, table: Table, keys: &[u64], start: u64, end: u64) -> Result<()> {
        if let Some(h) = table.hashing {
            self.node.check_table(table)?;
            return self.through_buckets(table, h, keys, &[], |w, t, buckets, _| w.intent(t, buckets, start, end));
        }
        if table.dynamic {
            self.node.check_table(table)?;
            // The intent service moves and replicates the slot keys by itself; on a table that
            // evicts, a slot key intended is its id's until the intent ends (see
            // `protocol::evict`).
            return self.through_index(table, keys, Intent::Read, &[], None, Box::new(move |w, t, k, _, _| w.intent(t, k, start, end)));
        }
        self.validate_keys(table, keys)?;
        if start > end {
            return Err(Error::Intent(format!("a window from clock {start} to clock {end} ends before it starts")));
        }
        if start == end || end <= self.clock || keys.is_empty() || !self.node.config.relocation || self.node.config.nodes < 2 {
            return Ok(());
        }
        self.declared = true;
        self.requester.remote_keys.get_or_insert_with(Vec::new);
        self.intent_service.declare(&self.node, self.index, self.clock, table, keys, start..end)
    }

    /// This node's statistics.
    pub fn stats(&self) -> crate::stats::Stats {
        self.node.core.stats()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // A worker that leaves no longer holds back the others' clocks.
        let index = self.index;
        if self.member {
            let _ = self.node.run(&mut self.tx, |step, _, _| {
                step.clock_retire(index);
                Ok(Progress::Done)
            });
        }
        if self.declared {
            self.intent_service.forget_worker(index);
        }
        self.node.retire_worker(self.index, self.requester.next_seq(), self.member);
    }
}
