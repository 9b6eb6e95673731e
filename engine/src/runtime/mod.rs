//! The machinery around the protocol in a running node: every thread with an event — a worker
//! with a request, a connection's reader with a frame, the verbs poller with completions, the
//! timer — takes a step on the shared [`Core`], hands the step's frames and writes to the fabric
//! before the step releases its shard locks, sends them after, and routes deliveries to the
//! workers' inboxes. Nothing here does I/O while holding a lock: queueing into the fabric is not
//! I/O; its flush, done after the step, is.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex, RwLock};

mod backup;
mod eviction;
mod replication;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::fabric::{Fabric, FabricHandler, Landed, WriteCompletion, WriteRequest};
use crate::protocol::{ALL_WORKERS, BarrierKind, Core, Delivery, Progress, Step, Transmit};

/// A registered worker: its inbox, and the sequence number its successor starts from.
#[derive(Default)]
struct WorkerSlot {
    inbox: Option<Sender<Delivery>>,
    next_seq: u64,
}

#[derive(Default)]
struct BarrierState {
    /// Workers of this node waiting in the current local round.
    arrived: usize,
    /// Local rounds started.
    rounds: u32,
    /// The latest finished protocol generation, per kind.
    finished: [u32; 2],
    errors: Vec<(BarrierKind, u32, Error)>,
}

/// The node's shared state, held by the node, its workers and (weakly) the fabric's threads.
pub(crate) struct NodeInner {
    pub config: Config,
    pub core: Core,
    pub fabric: std::sync::Arc<dyn Fabric>,
    clock_offset: i64,
    workers: RwLock<Vec<WorkerSlot>>,
    pub live_workers: AtomicUsize,
    transmits: Mutex<Vec<Transmit>>,
    barrier: Mutex<BarrierState>,
    barrier_cv: Condvar,
    /// Workers waiting for slower workers' clocks sleep here (see [`NodeInner::wait_clock`]).
    clock_lock: Mutex<()>,
    clock_cv: Condvar,
    pub stopping: AtomicBool,
    /// Set when this node enters the finalize barrier. A peer can only leave after every node
    /// entered it, so a clean goodbye seen from then on is expected, not a failure.
    pub finalizing: AtomicBool,
    pub fingerprint: u64,
    /// When the timer thread next wakes up (cluster ns; `u64::MAX`: when told).
    timer_wake: Mutex<u64>,
    timer_cv: Condvar,
    /// Replication rounds (held while one runs).
    pub replication_rounds: Mutex<crate::replication::Rounds>,
    /// Tells the replication thread to stop (finalize stops it before its last round).
    pub replication_stop: AtomicBool,
    /// Told when the homes granted this node moves or replicas (the intent service, which sits
    /// above the runtime and registers itself at start-up: see [`GrantListener`]).
    grant_listener: std::sync::OnceLock<std::sync::Weak<dyn GrantListener>>,
    /// Backups: the backup thread and workers waiting for rounds sleep here, steps that change
    /// backup state notify (see `backup.rs`).
    backup_lock: Mutex<()>,
    backup_cv: Condvar,
    /// Per rank, 1 + the incarnation lost in it when a node joining in the rank connected (0:
    /// none did): that connection is the new node's, which the rank's loss must not close.
    rejoining: Vec<AtomicU16>,
    /// Where evicted rows are spilled ([`crate::Config::spill_dir`]): the node's spill files,
    /// written by the eviction thread and synced for checkpoints and at the end.
    pub spiller: Option<Mutex<crate::dynamic::spill::Spiller>>,
}

/// A service above the runtime that acts on the homes' grants (INTENT_GO) posted for this
/// node: the fabric's frame handler tells it, after posting, while a grant waits. Registered
/// weakly ([`NodeInner::listen_for_grants`]), so that the runtime never names the service nor
/// keeps it alive.
pub(crate) trait GrantListener: Send + Sync {
    /// Grants wait to be taken up (called for every frame while they do: cheap when the
    /// listener is awake already).
    fn grants_waiting(&self);
}

impl NodeInner {
    pub fn new(
        config: Config,
        core: Core,
        fabric: std::sync::Arc<dyn Fabric>,
        clock_offset: i64,
        spiller: Option<crate::dynamic::spill::Spiller>,
    ) -> NodeInner {
        let config_nodes = config.nodes;
        NodeInner {
            fingerprint: config.fingerprint(),
            config,
            core,
            fabric,
            clock_offset,
            workers: RwLock::new(Vec::new()),
            live_workers: AtomicUsize::new(0),
            transmits: Mutex::new(Vec::new()),
            barrier: Mutex::new(BarrierState::default()),
            barrier_cv: Condvar::new(),
            clock_lock: Mutex::new(()),
            clock_cv: Condvar::new(),
            stopping: AtomicBool::new(false),
            finalizing: AtomicBool::new(false),
            timer_wake: Mutex::new(u64::MAX),
            timer_cv: Condvar::new(),
            replication_rounds: Mutex::new(crate::replication::Rounds::default()),
            replication_stop: AtomicBool::new(false),
            grant_listener: std::sync::OnceLock::new(),
            backup_lock: Mutex::new(()),
            backup_cv: Condvar::new(),
            rejoining: (0..config_nodes).map(|_| AtomicU16::new(0)).collect(),
            spiller: spiller.map(Mutex::new),
        }
    }

    /// Registers the service that takes up this node's grants (see [`GrantListener`]; once, at
    /// start-up: a second listener is ignored).
    pub fn listen_for_grants(&self, listener: std::sync::Weak<dyn GrantListener>) {
        let _ = self.grant_listener.set(listener);
    }

    /// Marks `peer` lost (once; later calls change nothing) and fails what depended on it.
    pub fn lose_peer(&self, peer: usize, reason: &str) {
        // A node joining in a lost rank is lost in its own right (the coordinator abandons its
        // join), though the rank counts as lost already.
        if peer == self.config.rank || peer >= self.config.nodes {
            return;
        }
        if self.core.directory().is_lost(peer as u16) && !self.connection_is_a_joiners(peer as u16) {
            // (A node that left and whose own LEFT never came: a census may wait for it.)
            let _ = self.run_pooled(|step, _, _| Ok(step.left_link_closed(peer as u16)));
            return;
        }
        if self.core.leave_state().1 {
            // This node left: its peers close their links to it, as they should.
            tracing::info!(node = self.config.rank, peer, %reason, "a peer closed its link to this node, which left the cluster");
        } else {
            tracing::warn!(node = self.config.rank, peer, %reason, "peer lost");
        }
        let _ = self.run_pooled(|step, _, _| Ok(step.handle_peer_lost(peer as u16, reason)));
    }

    /// `from` leaves the cluster after losing `lost` (its LEAVING message). The nodes it lost are
    /// lost here too, first, so that what fails names the cause and not the messenger (this node
    /// might have noticed them only later, or never); then `from` itself.
    pub fn peer_left(&self, from: usize, lost: Vec<(u16, String)>) {
        let mut causes = Vec::new();
        for (node, reason) in lost {
            let node = node as usize;
            if node == self.config.rank || node == from || node >= self.config.nodes {
                continue;
            }
            causes.push(node.to_string());
            if !self.core.directory().is_lost(node as u16) {
                self.lose_peer(node, &format!("{reason}; reported by node {from}"));
                self.fabric.disconnect(node);
            }
        }
        let reason =
            if causes.is_empty() { "it left the cluster".to_string() } else { format!("it left the cluster after losing node {}", causes.join(", node ")) };
        self.lose_peer(from, &reason);
    }

    /// Closes the connections to lost peers that are still open: nodes another node reported
    /// lost (PEER_LOST), which this one must not hear from any more (a node lost to one is lost
    /// to all).
    pub fn disconnect_lost(&self) {
        for (peer, reason) in self.core.directory().lost_nodes() {
            // A node that left closes when its own LEFT was handled (`Transmit::take_departed`):
            // answers it sent before may still be on their way behind a relayed LEFT.
            if reason != crate::protocol::LEFT_REASON && self.fabric.is_alive(peer as usize) && !self.connection_is_a_joiners(peer) {
                tracing::warn!(node = self.config.rank, peer, %reason, "peer lost");
                self.fabric.disconnect(peer as usize);
            }
        }
    }

    /// Whether the connection to `peer` belongs to a node joining in its rank, whose join has
    /// not completed: its rank still counts as lost (the old node's), which is no reason to
    /// close it.
    fn connection_is_a_joiners(&self, peer: u16) -> bool {
        let lost = self.core.directory().incarnation(peer);
        self.rejoining.get(peer as usize).is_some_and(|r| r.load(Ordering::Acquire) == u16::from(lost) + 1)
    }

    /// Notes that a node joining in `peer`'s rank connected (see [`NodeInner::disconnect_lost`]).
    pub fn peer_connected(&self, peer: usize) {
        if let Some(r) = self.rejoining.get(peer) {
            let lost = self.core.directory().incarnation(peer as u16);
            r.store(u16::from(lost) + 1, Ordering::Release);
            tracing::info!(node = self.config.rank, peer, "a node joining in a lost peer's rank connected");
        }
    }

    /// Tells every live peer that this node leaves after losing peers, and why (LEAVING), so
    /// that their errors name the cause. Nothing is sent when no peer was lost.
    pub fn announce_leaving(&self) {
        // Nodes that left gracefully are no cause of anything.
        let lost: Vec<(u16, String)> = self.core.directory().lost_nodes().into_iter().filter(|(_, why)| why != crate::protocol::LEFT_REASON).collect();
        if lost.is_empty() {
            return;
        }
        let mut frame = Vec::new();
        crate::protocol::wire::encode_leaving(&mut frame, &lost);
        for peer in (0..self.config.nodes).filter(|&p| p != self.config.rank && self.fabric.is_alive(p)) {
            if self.fabric.enqueue(peer, frame.clone()).is_ok() {
                self.fabric.flush(peer);
            }
        }
    }

    /// Cluster time: this host's monotonic clock aligned to the coordinator's.
    pub fn now(&self) -> u64 {
        (ferry_tcp::monotonic_ns() as i64 + self.clock_offset).max(1) as u64
    }

    /// An output buffer for a thread without one of its own.
    fn take_transmit(&self) -> Transmit {
        self.transmits.lock().pop().unwrap_or_else(|| self.core.transmit())
    }

    fn return_transmit(&self, tx: Transmit) {
        self.transmits.lock().push(tx);
    }

    /// Hands a step's frames and writes to the fabric (queueing only) and reports writes the
    /// fabric completed while queueing. Called before the step is dropped.
    pub fn hand_over(&self, step: &mut Step<'_, '_>) {
        loop {
            while let Some((to, frame)) = step.transmit().poll_transmit() {
                // A peer that is gone fails its operations through its loss; the frame is moot.
                let _ = self.fabric.enqueue(to as usize, frame);
            }
            let mut writes = Vec::new();
            while let Some(w) = step.transmit().poll_write() {
                writes.push(w);
            }
            if writes.is_empty() {
                return;
            }
            writes.sort_by_key(|w| w.to);
            for group in writes.chunk_by(|a, b| a.to == b.to) {
                let requests: Vec<WriteRequest> = group
                    .iter()
                    .map(|w| WriteRequest { remote: w.remote, src: self.core.store().table(w.table).slot_ptr(w.slot), len: w.len, imm: w.imm, wr_id: w.wr_id })
                    .collect();
                // SAFETY: each source is a slot the protocol keeps allocated, and no longer
                // publishes, until it is told the write completed (`handle_write_done`).
                let outcome = unsafe { self.fabric.write(group[0].to as usize, &requests) };
                let done = match outcome {
                    Ok(WriteCompletion::Immediate) => Some(Ok(())),
                    #[cfg(feature = "verbs")]
                    Ok(WriteCompletion::Deferred) => None,
                    Err(e) => Some(Err(e)),
                };
                if let Some(result) = done {
                    for w in group {
                        // The step made these writes under the shard it still holds.
                        let _ = step.handle_write_done(w.wr_id, result.clone());
                    }
                }
            }
        }
    }

    /// After a step is dropped: sends what was queued, delivers to workers, updates barriers and
    /// the timer.
    pub fn finish(&self, tx: &mut Transmit) {
        tx.take_touched(|to| self.fabric.flush(to));
        while let Some((worker, d)) = tx.poll_delivery() {
            self.deliver(worker, d);
        }
        if let Some(at) = tx.take_deadline() {
            let mut wake = self.timer_wake.lock();
            if at < *wake {
                *wake = at;
                self.timer_cv.notify_all();
            }
        }
        if tx.take_barrier_touched() {
            self.note_barrier_events();
        }
        if tx.take_clock_touched() {
            let _guard = self.clock_lock.lock();
            self.clock_cv.notify_all();
        }
        if tx.take_backup_touched() {
            self.wake_backups();
        }
        for peer in tx.take_departed() {
            tracing::info!(node = self.config.rank, peer, "peer left the cluster");
            self.fabric.disconnect(peer as usize);
        }
    }

    /// Waits until every live worker of the cluster has completed `target` clocks (bounded
    /// delay), at most `timeout`.
    pub fn wait_clock(&self, target: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let dir = self.core.directory();
        let mut guard = self.clock_lock.lock();
        loop {
            if self.core.clocks().lock().cluster_min(dir) >= target {
                return Ok(());
            }
            if self.stopping.load(Ordering::Acquire) {
                return Err(Error::ShutDown);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "waiting for slower workers to complete their clocks (bounded delay)",
                    millis: timeout.as_millis() as u64,
                    nodes: self.core.clocks().lock().behind(target, dir),
                });
            }
            // Reports arrive through steps, which notify; the timed wait covers a shutdown.
            self.clock_cv.wait_until(&mut guard, deadline.min(now + Duration::from_millis(50)));
        }
    }

    /// Runs an event on fresh steps until it is handled, handing each step's output over.
    pub fn run(&self, tx: &mut Transmit, mut event: impl FnMut(&mut Step<'_, '_>, usize, usize) -> Result<Progress>) -> Result<()> {
        let (mut at, mut item) = (0, 0);
        let outcome = loop {
            let mut step = self.core.step(tx, self.now());
            let progress = event(&mut step, at, item);
            self.hand_over(&mut step);
            if step.handed_over() {
                self.hand_over(&mut step);
            }
            drop(step);
            match progress {
                Ok(Progress::Done) => break Ok(()),
                Ok(Progress::Yield { at: a, item: i }) => {
                    // Send what is ready before the rest of the event is handled.
                    tx.take_touched(|to| self.fabric.flush(to));
                    (at, item) = (a, i);
                }
                Err(e) => break Err(e),
            }
        };
        ferry_tcp::stage_trace::mark(ferry_tcp::stage_trace::Point::Stepped);
        self.finish(tx);
        outcome
    }

    /// Runs an event with a buffer from the pool.
    pub(crate) fn run_pooled(&self, event: impl FnMut(&mut Step<'_, '_>, usize, usize) -> Result<Progress>) -> Result<()> {
        let mut tx = self.take_transmit();
        let outcome = self.run(&mut tx, event);
        self.return_transmit(tx);
        outcome
    }

    fn deliver(&self, worker: u16, delivery: Delivery) {
        let workers = self.workers.read();
        if worker == ALL_WORKERS {
            for slot in workers.iter() {
                if let Some(inbox) = &slot.inbox {
                    let _ = inbox.send(delivery.clone());
                }
            }
        } else if let Some(inbox) = workers.get(worker as usize).and_then(|s| s.inbox.as_ref()) {
            // A worker that is gone no longer needs its answers.
            let _ = inbox.send(delivery);
        }
    }

    /// Registers a worker: its index, the sequence number its operation ids start at, and its
    /// inbox.
    /// A `member` worker counts among the node's live workers (barriers wait for it, finalize
    /// refuses while it lives); the intent service's own worker does not.
    pub fn register_worker(&self, member: bool) -> (u16, u64, Receiver<Delivery>) {
        let (sender, receiver) = crossbeam_channel::unbounded();
        let mut workers = self.workers.write();
        let index = match workers.iter().position(|s| s.inbox.is_none()) {
            Some(i) => i,
            None => {
                workers.push(WorkerSlot { inbox: None, next_seq: 1 });
                workers.len() - 1
            }
        };
        workers[index].inbox = Some(sender);
        if member {
            self.live_workers.fetch_add(1, Ordering::AcqRel);
        }
        (index as u16, workers[index].next_seq, receiver)
    }

    /// A worker leaves; its successor on the same index continues from `next_seq`.
    pub fn retire_worker(&self, index: u16, next_seq: u64, member: bool) {
        {
            let mut workers = self.workers.write();
            if let Some(slot) = workers.get_mut(index as usize) {
                slot.inbox = None;
                slot.next_seq = next_seq;
            }
        }
        if member {
            self.live_workers.fetch_sub(1, Ordering::AcqRel);
            // A departing worker may complete a round the others wait in.
            self.maybe_start_round();
        }
    }

    /// Tells every worker that the node shuts down.
    pub fn shut_down_workers(&self) {
        self.deliver(ALL_WORKERS, Delivery::ShutDown);
    }

    fn note_barrier_events(&self) {
        let events = self.core.barrier_events();
        if events.is_empty() {
            return;
        }
        let mut state = self.barrier.lock();
        for event in events {
            let slot = &mut state.finished[event.kind as usize];
            *slot = (*slot).max(event.generation);
            if let Err(e) = event.result {
                state.errors.push((event.kind, event.generation, e));
            }
        }
        self.barrier_cv.notify_all();
    }

    /// One barrier generation across the cluster (for finalize; workers use `worker_barrier`).
    pub fn barrier_round(&self, kind: BarrierKind) -> Result<()> {
        let mut generation = 0;
        self.run_pooled(|step, _, _| {
            generation = step.barrier_enter(kind);
            Ok(Progress::Done)
        })?;
        self.wait_generation(kind, generation, self.config.op_timeout)
    }

    fn wait_generation(&self, kind: BarrierKind, generation: u32, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut state = self.barrier.lock();
        loop {
            if let Some(pos) = state.errors.iter().position(|(k, g, _)| *k == kind && *g == generation) {
                return Err(state.errors.remove(pos).2);
            }
            if state.finished[kind as usize] >= generation {
                return Ok(());
            }
            if self.barrier_cv.wait_until(&mut state, deadline).timed_out() {
                drop(state);
                let nodes = self.core.barriers().lock().not_arrived(kind, generation, self.core.directory());
                return Err(Error::Timeout { what: "barrier", millis: timeout.as_millis() as u64, nodes });
            }
        }
    }

    /// This node joined a running cluster and takes part in barriers from generations `from`
    /// (per kind): its workers' first barrier waits for generation `from`, not 1.
    pub fn start_barriers_at(&self, from: [u32; 2]) {
        let mut state = self.barrier.lock();
        let before = from[BarrierKind::Workers as usize].saturating_sub(1);
        state.rounds = state.rounds.max(before);
        for kind in [BarrierKind::Workers, BarrierKind::Finalize] {
            let slot = &mut state.finished[kind as usize];
            *slot = (*slot).max(from[kind as usize].saturating_sub(1));
        }
    }

    /// The generation of the last workers' barrier this node entered (0 before the first): while
    /// a worker of the node is between two barriers, the one it last passed.
    pub fn barriers_entered(&self) -> u32 {
        self.barrier.lock().rounds
    }

    /// A worker arrives at the workers' barrier; the node enters the cluster-wide generation
    /// when all its live workers have arrived. Waits at most `timeout`.
    pub fn worker_barrier(&self, timeout: Duration) -> Result<()> {
        let generation = {
            let mut state = self.barrier.lock();
            state.arrived += 1;
            state.rounds + 1
        };
        self.maybe_start_round();
        self.wait_generation(BarrierKind::Workers, generation, timeout)
    }

    fn maybe_start_round(&self) {
        let start = {
            let mut state = self.barrier.lock();
            let live = self.live_workers.load(Ordering::Acquire);
            if state.arrived > 0 && state.arrived >= live {
                state.arrived = 0;
                state.rounds += 1;
                true
            } else {
                false
            }
        };
        if start {
            let _ = self.run_pooled(|step, _, _| {
                step.barrier_enter(BarrierKind::Workers);
                Ok(Progress::Done)
            });
        }
    }

    /// The timer thread: gives up relocations whose deadline passed, sleeping until the next
    /// deadline (a step that sets an earlier one wakes it).
    pub fn run_timer(&self) {
        loop {
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            let next = self.core.poll_timeout().unwrap_or(u64::MAX);
            let now = self.now();
            if next <= now {
                let _ = self.run_pooled(|step, _, _| Ok(step.handle_timeout()));
                continue;
            }
            let mut wake = self.timer_wake.lock();
            if *wake <= now {
                *wake = u64::MAX;
                continue;
            }
            *wake = (*wake).min(next);
            // Bounded sleeps keep shutdown prompt; nothing is scanned when they end early.
            let sleep = Duration::from_nanos((*wake).saturating_sub(now)).min(Duration::from_millis(200));
            self.timer_cv.wait_for(&mut wake, sleep);
            if *wake <= self.now() {
                *wake = u64::MAX;
            }
        }
    }

    /// Whether any table replicates keys.
    pub fn replicates(&self) -> bool {
        self.config.tables.iter().any(|t| !t.replicated.is_empty()) && self.config.nodes > 1
    }

    /// The replication thread: a round at least every half of the staleness bound, less the
    /// last round's duration twice over (so that a slow round does not stretch the bound), and
    /// never more often than every tenth of it.
    pub fn run_replication(&self) {
        let bound = self.config.staleness;
        let mut last = Duration::ZERO;
        loop {
            let pause = (bound / 2).saturating_sub(last * 2).max(bound / 10);
            let deadline = Instant::now() + pause;
            {
                let mut wake = self.timer_wake.lock();
                while !self.replication_stopped() && Instant::now() < deadline {
                    self.timer_cv.wait_until(&mut wake, deadline);
                }
            }
            if self.replication_stopped() {
                return;
            }
            let mut rounds = self.replication_rounds.lock();
            let began = Instant::now();
            if let Err(e) = replication::run_round(self, &mut rounds)
                && !self.stopping.load(Ordering::Acquire)
            {
                tracing::warn!(node = self.config.rank, error = %e, "a replication round failed; replicas refresh in the next one");
            }
            last = began.elapsed();
        }
    }

    fn replication_stopped(&self) -> bool {
        self.stopping.load(Ordering::Acquire) || self.replication_stop.load(Ordering::Acquire)
    }

    /// Ships this node's replica deltas home and refreshes its replicas, unless a round that
    /// began after this call's start has already done so.
    pub fn replication_sync(&self) -> Result<()> {
        if !self.replicates() {
            return Ok(());
        }
        replication::sync_since(self, self.now())
    }

    /// Wakes the timer thread (shutdown).
    pub fn wake_timer(&self) {
        let wake = self.timer_wake.lock();
        self.timer_cv.notify_all();
        drop(wake);
    }
}

/// The fabric's reports, fed to the protocol. Held weakly, so the fabric's threads never keep
/// a node alive.
pub(crate) struct Callbacks {
    pub node: std::sync::Weak<NodeInner>,
}

impl FabricHandler for Callbacks {
    fn on_frame(&self, from: usize, frame: Bytes) {
        let Some(node) = self.node.upgrade() else { return };
        match crate::protocol::wire::leaving_of(&frame) {
            Some(Ok(lost)) => return node.peer_left(from, lost),
            Some(Err(e)) => {
                tracing::error!(node = node.config.rank, peer = from, error = %e, "closing the connection to a peer that broke the protocol");
                return node.fabric.disconnect(from);
            }
            None => {}
        }
        let losses = node.core.directory().losses();
        let result = node.run_pooled(|step, at, item| step.handle_frame(from as u16, &frame, at, item));
        if node.core.directory().losses() != losses {
            node.disconnect_lost();
        }
        if node.core.intent_go_waiting()
            && let Some(listener) = node.grant_listener.get().and_then(|l| l.upgrade())
        {
            listener.grants_waiting();
        }
        if let Err(e) = result {
            tracing::error!(node = node.config.rank, peer = from, error = %e, "closing the connection to a peer that broke the protocol");
            node.fabric.disconnect(from);
        }
    }

    fn on_writes_landed(&self, _from: usize, writes: &[Landed]) {
        if let Some(node) = self.node.upgrade() {
            let _ = node.run_pooled(|step, at, _| Ok(step.handle_writes_landed(writes, at)));
        }
    }

    #[cfg(feature = "verbs")]
    fn on_write_done(&self, wr_id: u64, result: Result<()>) {
        if let Some(node) = self.node.upgrade() {
            let _ = node.run_pooled(|step, _, _| Ok(step.handle_write_done(wr_id, result.clone())));
        }
    }

    fn on_peer_connected(&self, peer: usize) {
        if let Some(node) = self.node.upgrade() {
            node.peer_connected(peer);
        }
    }

    fn on_peer_closed(&self, peer: usize, error: Option<String>) {
        let Some(node) = self.node.upgrade() else { return };
        // A node that stops closes its connections itself: what its readers see then is no
        // news of the peers (an aborted node that took its own closing for their loss would
        // tell the others so before its last links closed). A closed connection while
        // finalizing is the peer finishing too, unless it failed.
        if node.stopping.load(Ordering::Acquire) || (error.is_none() && node.finalizing.load(Ordering::Acquire)) {
            return;
        }
        if node.core.leave_state().1 {
            // This node left: its peers close their connections as they learn it.
            return;
        }
        let reason = error.unwrap_or_else(|| "it left the cluster".into());
        node.lose_peer(peer, &reason);
        if let Some(r) = node.rejoining.get(peer) {
            r.store(0, Ordering::Release);
        }
    }
}
