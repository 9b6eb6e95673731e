//! The node runtime: start-up, the protocol behind its lock, the fabric's callbacks, timers,
//! barriers and shutdown.
//!
//! There is no protocol thread. Whoever has an event — a worker with a request, a fabric reader
//! thread with a frame, the timer — takes the protocol lock, feeds the event, and moves the output
//! into the fabric's per-peer queues *before* releasing the lock (so frames leave in protocol
//! order), then flushes those queues outside the lock. This saves the thread hand-off a protocol
//! thread would add to every remote operation.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use parking_lot::{Condvar, Mutex};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::fabric::{Fabric, FabricHandler, WriteCompletion, WriteRequest};
use crate::protocol::{BarrierKind, OpId, Protocol, Settings};
use crate::stats::Stats;
use crate::store::{PageKind, Store};
use crate::util::FastMap;
use crate::worker::Worker;

/// Bytes of one-sided writes posted (and sent) at a time.
const WRITE_PIECE: usize = 256 << 10;

/// Completion cell of one remote operation, shared by the waiting worker and the engine.
pub(crate) struct OpCell {
    done: AtomicBool,
    result: Mutex<Option<Result<Vec<f32>>>>,
    waiter: Mutex<Option<Thread>>,
    /// The issuing worker's count of unfinished asynchronous operations, when asynchronous.
    outstanding: Option<Arc<AtomicUsize>>,
}

impl OpCell {
    pub(crate) fn new(outstanding: Option<Arc<AtomicUsize>>) -> Arc<OpCell> {
        if let Some(o) = &outstanding {
            o.fetch_add(1, Ordering::AcqRel);
        }
        Arc::new(OpCell { done: AtomicBool::new(false), result: Mutex::new(None), waiter: Mutex::new(None), outstanding })
    }

    pub(crate) fn complete(&self, result: Result<Vec<f32>>) {
        *self.result.lock() = Some(result);
        self.done.store(true, Ordering::Release);
        if let Some(o) = &self.outstanding {
            o.fetch_sub(1, Ordering::AcqRel);
        }
        if let Some(t) = self.waiter.lock().take() {
            t.unpark();
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Waits until completion or `deadline`; `None` on timeout. Spins briefly first: a remote
    /// operation on a fast network completes within microseconds, sooner than a park/unpark.
    pub(crate) fn wait(&self, deadline: Instant) -> Option<Result<Vec<f32>>> {
        for i in 0..4000u32 {
            if self.is_done() {
                return self.result.lock().take();
            }
            if i % 64 == 63 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        *self.waiter.lock() = Some(std::thread::current());
        loop {
            if self.is_done() {
                return self.result.lock().take();
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            std::thread::park_timeout(deadline - now);
        }
    }
}

/// The protocol plus the cells of operations waiting on it, under one lock.
pub(crate) struct Engine {
    pub protocol: Protocol,
    pub waiters: FastMap<OpId, Arc<OpCell>>,
}

#[derive(Default)]
struct BarrierState {
    /// Workers of this node waiting in the current local round.
    arrived: usize,
    /// Local rounds started.
    rounds: u32,
    /// Results of finished protocol generations, per kind.
    finished: [u32; 2],
    errors: Vec<(BarrierKind, u32, Error)>,
}

pub(crate) struct NodeInner {
    pub config: Config,
    pub store: Arc<Store>,
    pub engine: Mutex<Engine>,
    pub fabric: Arc<dyn Fabric>,
    clock_offset: i64,
    pub live_workers: AtomicUsize,
    retired_local: AtomicU64,
    worker_counters: Mutex<Vec<Arc<CachePadded<AtomicU64>>>>,
    barrier: Mutex<BarrierState>,
    barrier_cv: Condvar,
    stopping: AtomicBool,
    /// Set when this node enters the finalize barrier. A peer can only leave after every node
    /// entered it, so a clean goodbye seen from then on is expected, not a failure.
    finalizing: AtomicBool,
    next_worker: AtomicUsize,
    fingerprint: u64,
}

/// A running node: one process's share of the cluster.
pub struct Node {
    inner: Arc<NodeInner>,
    timer: Option<JoinHandle<()>>,
    finished: bool,
}

/// A slot in a node's registered memory, as [`Node::slot_address`] gives it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAddress {
    /// The node holding the slot.
    pub node: usize,
    /// Its region key (an rkey over verbs).
    pub region: u32,
    /// Its address in that node's region address space.
    pub addr: u64,
    /// Elements of the value.
    pub value_len: usize,
}

/// A table as the API names it: id, value length and key count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Table {
    pub(crate) id: u16,
    pub(crate) value_len: usize,
    pub(crate) keys: u64,
    /// Fingerprint of the cluster configuration the handle belongs to: a handle is valid on
    /// every node of that cluster, and checking it costs one comparison.
    pub(crate) cluster: u64,
}

impl Table {
    /// Elements per value.
    pub fn value_len(&self) -> usize {
        self.value_len
    }

    /// Number of keys.
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// The table id (its position in the configuration).
    pub fn id(&self) -> usize {
        self.id as usize
    }
}

struct Callbacks {
    node: Weak<NodeInner>,
}

impl FabricHandler for Callbacks {
    fn on_frame(&self, from: usize, frame: &[u8]) {
        let Some(node) = self.node.upgrade() else { return };
        let result = node.step(|e, now| e.protocol.on_message(from, frame, now));
        if let Err(e) = result {
            tracing::error!(node = node.config.rank, peer = from, error = %e, "closing the connection to a peer that broke the protocol");
            node.fabric.disconnect(from);
        }
    }

    fn on_writes_landed(&self, _from: usize, imms: &[u32]) {
        if let Some(node) = self.node.upgrade() {
            node.step(|e, now| e.protocol.on_writes_landed(imms, now));
        }
    }

    fn on_write_done(&self, wr_id: u64, result: Result<()>) {
        if let Some(node) = self.node.upgrade() {
            node.step(|e, now| e.protocol.on_write_done(wr_id, result, now));
        }
    }

    fn on_peer_closed(&self, peer: usize, error: Option<String>) {
        let Some(node) = self.node.upgrade() else { return };
        if error.is_none() && (node.stopping.load(Ordering::Acquire) || node.finalizing.load(Ordering::Acquire)) {
            return;
        }
        let reason = error.unwrap_or_else(|| "it left the cluster".into());
        tracing::warn!(node = node.config.rank, peer, %reason, "peer lost");
        node.step(|e, now| e.protocol.on_peer_lost(peer, &reason, now));
    }
}

impl Node {
    /// Starts this node: joins the cluster at the coordinator, connects to every peer, checks
    /// that all nodes have the same tables and settings, and allocates the home keys' values.
    pub fn start(config: Config) -> Result<Node> {
        config.validate()?;
        let (fabric, clock_offset) = crate::fabric::select::connect(&config)?;
        Self::assemble(config, fabric, clock_offset)
    }

    fn assemble(config: Config, fabric: Arc<dyn Fabric>, clock_offset: i64) -> Result<Node> {
        let store = Arc::new(Store::new(config.rank, config.nodes, &config.tables, config.latches, config.huge_pages, fabric.registrar())?);
        let settings = Settings {
            relocation: config.relocation,
            location_caches: config.location_caches,
            max_message_bytes: config.max_message_bytes,
            part_bytes: config.part_bytes,
            op_timeout_ns: config.op_timeout.as_nanos() as u64,
            loss_grace_ns: (config.peer_timeout * 2).as_nanos() as u64,
        };
        let mut protocol = Protocol::new(config.rank, config.nodes, &config.tables, store.clone(), settings);
        let sink_fabric = fabric.clone();
        protocol.set_frame_sink(Box::new(move |to, frame| {
            let to = to as usize;
            if sink_fabric.enqueue(to, frame).is_ok() {
                sink_fabric.flush(to);
            }
        }));
        let inner = Arc::new(NodeInner {
            store,
            engine: Mutex::new(Engine { protocol, waiters: FastMap::default() }),
            fabric: fabric.clone(),
            clock_offset,
            live_workers: AtomicUsize::new(0),
            retired_local: AtomicU64::new(0),
            worker_counters: Mutex::new(Vec::new()),
            barrier: Mutex::new(BarrierState::default()),
            barrier_cv: Condvar::new(),
            stopping: AtomicBool::new(false),
            finalizing: AtomicBool::new(false),
            next_worker: AtomicUsize::new(0),
            fingerprint: config.fingerprint(),
            config,
        });
        fabric.start(Arc::new(Callbacks { node: Arc::downgrade(&inner) }))?;
        let weak = Arc::downgrade(&inner);
        let timer = std::thread::Builder::new()
            .name(format!("ferry{}-timer", inner.config.rank))
            .spawn(move || {
                while let Some(node) = weak.upgrade() {
                    if node.stopping.load(Ordering::Acquire) {
                        return;
                    }
                    node.step(|e, now| e.protocol.on_tick(now));
                    drop(node);
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
            .map_err(|e| Error::Transport(format!("cannot start the timer thread: {e}")))?;
        Ok(Node { inner, timer: Some(timer), finished: false })
    }

    /// Starts `nodes` nodes inside this process, connected over loopback TCP, with `template`'s
    /// tables and settings (its rank, node count and coordinator are replaced). For tests and
    /// single-machine benchmarks.
    pub fn start_local_cluster(nodes: usize, template: Config) -> Result<Vec<Node>> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| Error::Transport(e.to_string()))?.port();
        let handles: Vec<_> = (0..nodes)
            .map(|rank| {
                let mut config = template.clone();
                config.rank = rank;
                config.nodes = nodes;
                config.coordinator = format!("127.0.0.1:{port}");
                std::thread::spawn(move || Node::start(config))
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| Error::Transport("a node's start-up panicked".into()))?).collect()
    }

    /// This node's rank.
    pub fn rank(&self) -> usize {
        self.inner.config.rank
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.inner.config.nodes
    }

    /// The configuration the node runs with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Name of the fabric in use ("tcp" or "verbs").
    pub fn transport(&self) -> &'static str {
        self.inner.fabric.name()
    }

    /// The kind of pages backing parameter memory (the worst used, if huge pages ran out).
    pub fn page_kind(&self) -> Option<PageKind> {
        self.inner.store.page_kind()
    }

    /// Looks a table up by name.
    pub fn table(&self, name: &str) -> Result<Table> {
        self.inner.table(name)
    }

    /// A handle for one trainer thread.
    pub fn worker(&self) -> Worker {
        Worker::new(self.inner.clone())
    }

    /// This node's statistics.
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// Forgets the relocation and blocking times recorded so far, so that the next
    /// [`Node::stats`] describes only what follows.
    pub fn reset_latencies(&self) {
        self.inner.engine.lock().protocol.reset_latencies();
    }

    /// Slots of `table` in use here and bytes of arena memory mapped for it.
    pub fn memory(&self, table: Table) -> (usize, usize) {
        let t = self.inner.store.table(table.id);
        (t.slot_usage().0, t.arena_bytes())
    }

    /// Where `key`'s value lives in this node's registered memory, for one-sided readers on
    /// other nodes (replica refresh); `None` when this node does not hold the key. The address
    /// stays valid while the key stays here: relocating the key away frees the slot.
    pub fn slot_address(&self, table: Table, key: u64) -> Result<Option<SlotAddress>> {
        self.inner.check_table(table)?;
        if key >= table.keys {
            return Err(Error::UnknownKey { table: self.inner.config.tables[table.id as usize].name.clone(), key, keys: table.keys });
        }
        let t = self.inner.store.table(table.id);
        Ok(t.slot_of(key).map(|slot| {
            let remote = t.remote_addr(slot);
            SlotAddress { node: self.rank(), region: remote.region, addr: remote.addr, value_len: table.value_len }
        }))
    }

    /// Reads the value at `at` — a slot on another node — with one-sided reads, validated by
    /// the slot's version: a copy that may have caught a write in progress is read again.
    /// Returns how many copies were discarded.
    ///
    /// Neither RDMA nor `memcpy` promises the order in which the bytes of one read are fetched,
    /// so the copy is bracketed seqlock-style: the slot's write counter is read alone before
    /// and after the copy, and the copy is kept only when both are equal and even (no write
    /// began or ended in between). That is three dependent reads; over verbs each is one RDMA
    /// READ, over TCP the peer's connection thread serves them without its engine.
    pub fn read_slot(&self, at: &SlotAddress, out: &mut [f32]) -> Result<u32> {
        if out.len() != at.value_len {
            return Err(Error::WrongLength { what: "read_slot output", expected: at.value_len, got: out.len() });
        }
        if at.node == self.rank() || at.node >= self.inner.config.nodes {
            return Err(Error::Config(format!("node {} is not a peer of node {}", at.node, self.rank())));
        }
        let fabric = &self.inner.fabric;
        let timeout = self.inner.config.op_timeout;
        let mut copy = vec![0u8; crate::store::slot_copy_len(at.value_len)];
        let slot = crate::store::RemoteAddr { region: at.region, addr: at.addr };
        let counter = crate::store::RemoteAddr { region: at.region, addr: at.addr + crate::store::slot_counter_offset(at.value_len) as u64 };
        let (mut before, mut after) = ([0u8; 4], [0u8; 4]);
        const ATTEMPTS: u32 = 10_000;
        fabric.read(at.node, counter, &mut before, timeout)?;
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                // The last attempt's closing read is this one's opening read.
                before = after;
                if u32::from_le_bytes(before) % 2 != 0 {
                    std::thread::yield_now();
                    fabric.read(at.node, counter, &mut before, timeout)?;
                }
            }
            if u32::from_le_bytes(before) % 2 == 0 {
                fabric.read(at.node, slot, &mut copy, timeout)?;
                fabric.read(at.node, counter, &mut after, timeout)?;
                if before == after
                    && let Some(values) = crate::store::validate_slot_copy(&copy, at.value_len)
                {
                    for (o, c) in out.iter_mut().zip(values.chunks_exact(4)) {
                        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                    return Ok(attempt);
                }
            } else {
                after = before;
            }
        }
        Err(Error::Contended { attempts: ATTEMPTS })
    }

    /// Shuts down cleanly: a cluster-wide barrier (so that no node leaves while others still
    /// talk to it), then every connection closed and every thread joined. All worker handles
    /// must be dropped first; otherwise this returns [`Error::WorkersAlive`] and changes nothing.
    /// After it, operations fail with [`Error::ShutDown`].
    pub fn finalize(&mut self) -> Result<()> {
        if self.finished {
            return Err(Error::ShutDown);
        }
        let live = self.inner.live_workers.load(Ordering::Acquire);
        if live > 0 {
            return Err(Error::WorkersAlive(live));
        }
        self.inner.finalizing.store(true, Ordering::Release);
        let result = self.inner.barrier_round(BarrierKind::Finalize);
        self.close(false);
        result
    }

    /// Stops the node at once, as a crash would (peers see it as lost). For fault injection.
    pub fn abort(mut self) {
        self.close(true);
    }

    fn close(&mut self, abort: bool) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.inner.stopping.store(true, Ordering::Release);
        if abort {
            self.inner.fabric.abort();
        } else {
            self.inner.fabric.shutdown();
        }
        if let Some(t) = self.timer.take() {
            let _ = t.join();
        }
        // Fail whatever still waits, so that no worker stays blocked.
        let mut engine = self.inner.engine.lock();
        engine.protocol.cancel_all();
        for (_, cell) in engine.waiters.drain() {
            cell.complete(Err(Error::ShutDown));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.close(false);
    }
}

impl NodeInner {
    /// Cluster time: this host's monotonic clock aligned to the coordinator's.
    pub(crate) fn now(&self) -> u64 {
        (ferry_tcp::monotonic_ns() as i64 + self.clock_offset).max(1) as u64
    }

    pub(crate) fn table(&self, name: &str) -> Result<Table> {
        self.config
            .tables
            .iter()
            .position(|t| t.name == name)
            .map(|i| {
                let t = &self.config.tables[i];
                Table { id: i as u16, value_len: t.value_len, keys: t.keys, cluster: self.fingerprint }
            })
            .ok_or_else(|| Error::UnknownTable(name.to_string()))
    }

    #[inline]
    pub(crate) fn check_table(&self, table: Table) -> Result<()> {
        if table.cluster == self.fingerprint {
            Ok(())
        } else {
            Err(Error::UnknownTable(format!("#{} (a handle from another cluster configuration)", table.id)))
        }
    }

    pub(crate) fn register_worker(&self) -> (usize, Arc<CachePadded<AtomicU64>>) {
        let counter = Arc::new(CachePadded::new(AtomicU64::new(0)));
        self.worker_counters.lock().push(counter.clone());
        self.live_workers.fetch_add(1, Ordering::AcqRel);
        (self.next_worker.fetch_add(1, Ordering::Relaxed), counter)
    }

    pub(crate) fn retire_worker(&self, counter: &Arc<CachePadded<AtomicU64>>) {
        self.retired_local.fetch_add(counter.load(Ordering::Relaxed), Ordering::Relaxed);
        self.worker_counters.lock().retain(|c| !Arc::ptr_eq(c, counter));
        self.live_workers.fetch_sub(1, Ordering::AcqRel);
        // A departing worker may complete a round the others wait in.
        self.maybe_start_round();
    }

    pub(crate) fn stats(&self) -> Stats {
        let local = self.retired_local.load(Ordering::Relaxed) + self.worker_counters.lock().iter().map(|c| c.load(Ordering::Relaxed)).sum::<u64>();
        self.engine.lock().protocol.stats(local)
    }

    /// Runs `f` on the engine and executes its output: frames into the fabric queues and
    /// writes posted while the lock is held, completions delivered, then queues flushed.
    pub(crate) fn step<R>(&self, f: impl FnOnce(&mut Engine, u64) -> R) -> R {
        let now = self.now();
        let mut touched: Vec<usize> = Vec::new();
        let mut barrier_events = Vec::new();
        let result;
        {
            let mut engine = self.engine.lock();
            result = f(&mut engine, now);
            loop {
                let out = engine.protocol.take_output();
                if out.is_empty() {
                    break;
                }
                for (to, frame) in out.frames {
                    let to = to as usize;
                    if self.fabric.enqueue(to, frame).is_ok() && !touched.contains(&to) {
                        touched.push(to);
                    }
                }
                let mut writes = out.writes;
                writes.sort_by_key(|w| w.to);
                for group in writes.chunk_by(|a, b| a.to == b.to) {
                    let to = group[0].to as usize;
                    // Post in pieces of about a quarter megabyte and send each piece at once, so
                    // that copying values out and sending them overlap; each piece's completions
                    // are recorded before it is sent, so a source slot is free before its bytes
                    // arrive anywhere.
                    let mut start = 0;
                    while start < group.len() {
                        let mut end = start;
                        let mut bytes = 0;
                        while end < group.len() && (end == start || bytes + group[end].len <= WRITE_PIECE) {
                            bytes += group[end].len;
                            end += 1;
                        }
                        let piece = &group[start..end];
                        let requests: Vec<WriteRequest> = piece
                            .iter()
                            .map(|w| WriteRequest { remote: w.remote, src: self.store.table(w.table).slot_ptr(w.slot), len: w.len, imm: w.imm, wr_id: w.wr_id })
                            .collect();
                        // SAFETY: each source is a slot the protocol keeps allocated (and no longer
                        // publishes) until `on_write_done` reports the write complete.
                        let outcome = unsafe { self.fabric.write(to, &requests) };
                        match outcome {
                            Ok(WriteCompletion::Immediate) => {
                                for w in piece {
                                    engine.protocol.on_write_done(w.wr_id, Ok(()), now);
                                }
                            }
                            Ok(WriteCompletion::Deferred) => {}
                            Err(e) => {
                                for w in piece {
                                    engine.protocol.on_write_done(w.wr_id, Err(e.clone()), now);
                                }
                            }
                        }
                        self.fabric.flush(to);
                        start = end;
                    }
                    if !touched.contains(&to) {
                        touched.push(to);
                    }
                }
                for c in out.completions {
                    if let Some(cell) = engine.waiters.remove(&c.op) {
                        cell.complete(c.result);
                    }
                }
                barrier_events.extend(out.barriers);
            }
        }
        for to in touched {
            self.fabric.flush(to);
        }
        if !barrier_events.is_empty() {
            let mut state = self.barrier.lock();
            for event in barrier_events {
                let slot = &mut state.finished[event.kind as usize];
                *slot = (*slot).max(event.generation);
                if let Err(e) = event.result {
                    state.errors.push((event.kind, event.generation, e));
                }
            }
            self.barrier_cv.notify_all();
        }
        result
    }

    /// One barrier generation across the cluster (for finalize; workers use `worker_barrier`).
    fn barrier_round(&self, kind: BarrierKind) -> Result<()> {
        let generation = self.step(|e, now| e.protocol.barrier_enter(kind, now));
        self.wait_generation(kind, generation)
    }

    fn wait_generation(&self, kind: BarrierKind, generation: u32) -> Result<()> {
        let deadline = Instant::now() + self.config.op_timeout;
        let mut state = self.barrier.lock();
        loop {
            if let Some(pos) = state.errors.iter().position(|(k, g, _)| *k == kind && *g == generation) {
                return Err(state.errors.remove(pos).2);
            }
            if state.finished[kind as usize] >= generation {
                return Ok(());
            }
            if self.barrier_cv.wait_until(&mut state, deadline).timed_out() {
                return Err(Error::Timeout { what: "barrier", millis: self.config.op_timeout.as_millis() as u64 });
            }
        }
    }

    /// A worker arrives at the workers' barrier; the node enters the cluster-wide generation
    /// when all its live workers have arrived.
    pub(crate) fn worker_barrier(&self) -> Result<()> {
        let generation = {
            let mut state = self.barrier.lock();
            state.arrived += 1;
            state.rounds + 1
        };
        self.maybe_start_round();
        self.wait_generation(BarrierKind::Workers, generation)
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
            self.step(|e, now| e.protocol.barrier_enter(BarrierKind::Workers, now));
        }
    }
}
