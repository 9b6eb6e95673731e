//! Deterministic simulated clusters for testing the protocol without threads or sockets.
//!
//! A simulation runs N [`Protocol`] state machines, each over a real [`Store`], connected by an
//! in-memory fabric that keeps per-pair FIFO order for messages (as TCP and RC queue pairs do) but
//! otherwise delays and interleaves everything — messages of different pairs, one-sided writes
//! (on a channel of their own, so they may overtake or trail messages), write completions, worker
//! steps and timer ticks — as a seeded random generator decides. Simulated workers run random
//! mixes of pull, push, set and localize, synchronous and asynchronous, through the same local
//! fast path as real workers, and every operation is recorded for the
//! [consistency checker](crate::consistency). The same seed always gives the same run.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::client::{gather, local_pass, scatter};
use crate::config::{HugePages, Partitioning, TableSpec};
use crate::consistency::{Event, History, Violation, push_update, set_value};
use crate::error::Result;
use crate::protocol::{AccessKind, OpId, Output, Protocol, Request, RequestKind, Settings, SlotWrite, Submitted};
use crate::stats::Stats;
use crate::store::{RegionHandle, Registrar, Store};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Number of nodes.
    pub nodes: usize,
    /// Workers per node.
    pub workers_per_node: usize,
    /// Keys in the (single) table; few keys make conflicts frequent.
    pub keys: u64,
    /// Value length, which bounds the pushes per key (one lane each, lane 0 holds set tags).
    pub lanes: usize,
    /// Operations per worker.
    pub ops_per_worker: usize,
    /// Whether `localize` moves keys.
    pub relocation: bool,
    /// Whether location caches are on.
    pub location_caches: bool,
    /// Share of operations issued asynchronously (0..=1).
    pub async_share: f64,
    /// Home-node assignment.
    pub partitioning: Partitioning,
    /// Message size target (small values split operations into many parts).
    pub max_message_bytes: usize,
    /// Lose this node at this step (fault injection); the run then checks liveness only.
    pub crash: Option<(usize, usize)>,
    /// Trace lines kept for a failure report (the last ones).
    pub trace_lines: usize,
    /// The seed.
    pub seed: u64,
}

impl SimOptions {
    /// A small, conflict-heavy configuration.
    pub fn small(seed: u64) -> SimOptions {
        SimOptions {
            nodes: 3,
            workers_per_node: 2,
            keys: 4,
            lanes: 96,
            ops_per_worker: 25,
            relocation: true,
            location_caches: false,
            async_share: 0.4,
            partitioning: Partitioning::Range,
            max_message_bytes: 4096,
            crash: None,
            trace_lines: 150,
            seed,
        }
    }
}

/// What a run produced.
#[derive(Debug)]
pub struct SimReport {
    /// Recorded operations, with a final read of every key.
    pub history: History,
    /// Scheduler steps taken.
    pub steps: usize,
    /// Per-node statistics.
    pub stats: Vec<Stats>,
    /// Operations that completed with an error (only with fault injection).
    pub failed_ops: usize,
    /// Operations issued.
    pub ops: usize,
    /// Largest number of slots any node had in use at the end, per node.
    pub slots_in_use: Vec<usize>,
    /// The last steps of the run.
    pub trace: Vec<String>,
}

/// A failed run: the seed, what went wrong, and the last steps taken.
#[derive(Debug)]
pub struct SimFailure {
    /// The seed (rerun with it to replay the identical run).
    pub seed: u64,
    /// What went wrong.
    pub reason: String,
    /// The last scheduler steps, oldest first.
    pub trace: Vec<String>,
}

impl std::fmt::Display for SimFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "simulation seed {} failed: {}", self.seed, self.reason)?;
        writeln!(f, "replay: FERRY_SIM_SEED={} FERRY_SIM_CONFIG=<configuration> cargo test -p ferry-tests --test simulation replay -- --nocapture", self.seed)?;
        writeln!(f, "last {} steps:", self.trace.len())?;
        for line in &self.trace {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

#[derive(Default)]
struct SimRegistrar {
    regions: Mutex<Vec<(usize, usize)>>,
}

impl Registrar for SimRegistrar {
    unsafe fn register(&self, base: *mut u8, len: usize) -> Result<RegionHandle> {
        let mut regions = self.regions.lock();
        regions.push((base as usize, len));
        Ok(RegionHandle { region: (regions.len() - 1) as u32, remote_base: 0 })
    }
}

struct Node {
    protocol: Protocol,
    store: Arc<Store>,
    regions: Arc<SimRegistrar>,
    crashed: bool,
}

#[derive(Debug, Clone)]
enum ScriptOp {
    Access { kind: AccessKind, keys: Vec<u64>, lanes_or_tags: Vec<u32>, asynchronous: bool },
    Localize { keys: Vec<u64>, asynchronous: bool },
    WaitAll,
}

struct Worker {
    node: usize,
    script: VecDeque<ScriptOp>,
    blocked: Option<(usize, OpId)>,
    outstanding: Vec<(usize, OpId)>,
    waiting_all: bool,
    /// Program-ordered events; pulls are filled in at completion.
    events: Vec<(u64, Event)>,
}

struct InFlight {
    worker: usize,
    kind: Option<AccessKind>,
    keys: Vec<u64>,
    rows: Vec<u32>,
    output: Vec<f32>,
    first_event: usize,
}

struct Sim {
    opts: SimOptions,
    rng: ChaCha8Rng,
    nodes: Vec<Node>,
    messages: Vec<VecDeque<Vec<u8>>>,
    writes: Vec<VecDeque<SlotWrite>>,
    write_dones: Vec<(usize, u64)>,
    workers: Vec<Worker>,
    in_flight: Vec<((usize, OpId), InFlight)>,
    now: u64,
    trace: VecDeque<String>,
    failed_ops: usize,
    ops: usize,
}

/// Runs one simulation.
pub fn run(opts: SimOptions) -> Result<SimReport, SimFailure> {
    let mut sim = Sim::new(opts.clone()).map_err(|e| SimFailure { seed: opts.seed, reason: format!("set-up failed: {e}"), trace: Vec::new() })?;
    let outcome = sim.run();
    outcome.map_err(|reason| SimFailure { seed: opts.seed, reason, trace: sim.trace.iter().cloned().collect() })
}

/// Runs one simulation and checks its history for per-key sequential consistency.
pub fn run_and_check(opts: SimOptions) -> Result<SimReport, SimFailure> {
    let lanes = opts.lanes;
    let seed = opts.seed;
    let report = run(opts)?;
    if let Err(v) = report.history.check(lanes) {
        let v: Violation = v;
        return Err(SimFailure { seed, reason: format!("consistency violation: {v}"), trace: report.trace });
    }
    Ok(report)
}

impl Sim {
    fn new(opts: SimOptions) -> Result<Sim> {
        let spec = TableSpec::new("sim", opts.keys, opts.lanes).partitioned(opts.partitioning);
        let settings = Settings {
            relocation: opts.relocation,
            location_caches: opts.location_caches,
            max_message_bytes: opts.max_message_bytes.max(4096),
            part_bytes: opts.max_message_bytes.max(4096),
            op_timeout_ns: u64::MAX / 4,
            loss_grace_ns: 200_000,
        };
        let mut nodes = Vec::new();
        for rank in 0..opts.nodes {
            let regions = Arc::new(SimRegistrar::default());
            let store = Arc::new(Store::new(rank, opts.nodes, std::slice::from_ref(&spec), 7, HugePages::Off, regions.clone())?);
            let protocol = Protocol::new(rank, opts.nodes, std::slice::from_ref(&spec), store.clone(), settings);
            nodes.push(Node { protocol, store, regions, crashed: false });
        }
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
        let workers = Self::scripts(&opts, &mut rng);
        Ok(Sim {
            messages: (0..opts.nodes * opts.nodes).map(|_| VecDeque::new()).collect(),
            writes: (0..opts.nodes * opts.nodes).map(|_| VecDeque::new()).collect(),
            write_dones: Vec::new(),
            workers,
            in_flight: Vec::new(),
            now: 1,
            trace: VecDeque::new(),
            failed_ops: 0,
            ops: 0,
            rng,
            nodes,
            opts,
        })
    }

    fn scripts(opts: &SimOptions, rng: &mut ChaCha8Rng) -> Vec<Worker> {
        let mut next_lane = vec![1u32; opts.keys as usize];
        let mut next_tag = vec![1u32; opts.keys as usize];
        let mut workers = Vec::new();
        for node in 0..opts.nodes {
            for _ in 0..opts.workers_per_node {
                let mut script = VecDeque::new();
                for _ in 0..opts.ops_per_worker {
                    let n = rng.gen_range(1..=3);
                    let keys: Vec<u64> = (0..n).map(|_| rng.gen_range(0..opts.keys)).collect();
                    let asynchronous = rng.gen_bool(opts.async_share);
                    let roll = rng.gen_range(0..100);
                    let op = if roll < 5 {
                        ScriptOp::WaitAll
                    } else if roll < 27 && opts.relocation {
                        ScriptOp::Localize { keys, asynchronous }
                    } else if roll < 33 {
                        let tags = keys.iter().map(|&k| {
                            next_tag[k as usize] += 1;
                            next_tag[k as usize] - 1
                        });
                        ScriptOp::Access { kind: AccessKind::Set, lanes_or_tags: tags.collect(), keys, asynchronous }
                    } else if roll < 66 && keys.iter().all(|&k| (next_lane[k as usize] as usize) < opts.lanes - 3) {
                        let lanes = keys.iter().map(|&k| {
                            next_lane[k as usize] += 1;
                            next_lane[k as usize] - 1
                        });
                        ScriptOp::Access { kind: AccessKind::Push, lanes_or_tags: lanes.collect(), keys, asynchronous }
                    } else {
                        ScriptOp::Access { kind: AccessKind::Pull, lanes_or_tags: Vec::new(), keys, asynchronous }
                    };
                    script.push_back(op);
                }
                script.push_back(ScriptOp::WaitAll);
                workers.push(Worker { node, script, blocked: None, outstanding: Vec::new(), waiting_all: false, events: Vec::new() });
            }
        }
        workers
    }

    fn log(&mut self, line: String) {
        if self.trace.len() >= self.opts.trace_lines {
            self.trace.pop_front();
        }
        self.trace.push_back(format!("t={} {line}", self.now));
    }

    fn runnable(&self, w: usize) -> bool {
        let worker = &self.workers[w];
        if self.nodes[worker.node].crashed || worker.blocked.is_some() {
            return false;
        }
        if worker.waiting_all {
            return worker.outstanding.is_empty();
        }
        !worker.script.is_empty()
    }

    fn run(&mut self) -> Result<SimReport, String> {
        let mut steps = 0usize;
        let mut timers_fired = false;
        loop {
            steps += 1;
            if steps > 2_000_000 {
                return Err("simulation did not terminate".into());
            }
            if let Some((node, at)) = self.opts.crash
                && steps == at
                && !self.nodes[node].crashed
            {
                self.crash(node);
            }
            self.now += self.rng.gen_range(1..2000);
            let runnable: Vec<usize> = (0..self.workers.len()).filter(|&w| self.runnable(w)).collect();
            let channels: Vec<usize> = (0..self.messages.len()).filter(|&c| !self.messages[c].is_empty()).collect();
            let write_channels: Vec<usize> = (0..self.writes.len()).filter(|&c| !self.writes[c].is_empty()).collect();
            let mut choices = Vec::new();
            if !runnable.is_empty() {
                choices.push(0);
            }
            if !channels.is_empty() {
                choices.extend([1, 1]);
            }
            if !write_channels.is_empty() {
                choices.push(2);
            }
            if !self.write_dones.is_empty() {
                choices.push(3);
            }
            if choices.is_empty() {
                // Only timers can make progress now (a crash left relocations to give up).
                let waiting = self.workers.iter().any(|w| !self.nodes[w.node].crashed && (w.blocked.is_some() || !w.outstanding.is_empty()));
                if waiting && self.opts.crash.is_some() && !timers_fired {
                    timers_fired = true;
                    self.now += 1_000_000;
                    self.log("timers fire".into());
                    for node in 0..self.opts.nodes {
                        if !self.nodes[node].crashed {
                            let now = self.now;
                            self.nodes[node].protocol.on_tick(now);
                            self.drain(node)?;
                        }
                    }
                    continue;
                }
                return self.finish(steps);
            }
            timers_fired = false;
            match choices[self.rng.gen_range(0..choices.len())] {
                0 => {
                    let w = runnable[self.rng.gen_range(0..runnable.len())];
                    self.worker_step(w)?;
                }
                1 => {
                    let c = channels[self.rng.gen_range(0..channels.len())];
                    let frame = self.messages[c].pop_front().expect("non-empty");
                    let (from, to) = (c / self.opts.nodes, c % self.opts.nodes);
                    self.log(format!("deliver {from}->{to}: {}", describe_frame(&frame)));
                    let now = self.now;
                    if let Err(e) = self.nodes[to].protocol.on_message(from, &frame, now) {
                        return Err(format!("node {to} rejected a frame from {from}: {e}"));
                    }
                    self.drain(to)?;
                }
                2 => {
                    let c = write_channels[self.rng.gen_range(0..write_channels.len())];
                    let write = self.writes[c].pop_front().expect("non-empty");
                    let (from, to) = (c / self.opts.nodes, c % self.opts.nodes);
                    self.land(from, to, write)?;
                }
                _ => {
                    let i = self.rng.gen_range(0..self.write_dones.len());
                    let (node, wr_id) = self.write_dones.swap_remove(i);
                    self.log(format!("write {wr_id} of node {node} completes"));
                    let now = self.now;
                    self.nodes[node].protocol.on_write_done(wr_id, Ok(()), now);
                    self.drain(node)?;
                }
            }
            if self.rng.gen_range(0..50) == 0 {
                let node = self.rng.gen_range(0..self.opts.nodes);
                if !self.nodes[node].crashed {
                    let now = self.now;
                    self.nodes[node].protocol.on_tick(now);
                    self.drain(node)?;
                }
            }
        }
    }

    fn crash(&mut self, node: usize) {
        self.log(format!("node {node} crashes"));
        self.nodes[node].crashed = true;
        let n = self.opts.nodes;
        for other in 0..n {
            self.messages[node * n + other].clear();
            self.messages[other * n + node].clear();
            self.writes[node * n + other].clear();
            self.writes[other * n + node].clear();
        }
        self.write_dones.retain(|(m, _)| *m != node);
        for other in 0..n {
            if other != node && !self.nodes[other].crashed {
                let now = self.now;
                self.nodes[other].protocol.on_peer_lost(node, "crashed in the simulation", now);
                // Writes this node posted to the crashed one complete with an error.
                let _ = self.drain(other);
            }
        }
    }

    fn land(&mut self, from: usize, to: usize, w: SlotWrite) -> Result<(), String> {
        self.log(format!("write {} lands {from}->{to} (imm {})", w.wr_id, w.imm));
        let src = self.nodes[from].store.table(w.table).slot_ptr(w.slot);
        let (base, len) = {
            let regions = self.nodes[to].regions.regions.lock();
            *regions.get(w.remote.region as usize).ok_or("write to an unknown region")?
        };
        if w.remote.addr as usize + w.len > len {
            return Err(format!("write of {} bytes at {} overflows region of {len}", w.len, w.remote.addr));
        }
        // SAFETY: the source slot stays allocated until its write completes (the completion is
        // delivered after this), the target range was bounds-checked against the registered
        // region, and the simulation is single-threaded.
        unsafe { std::ptr::copy_nonoverlapping(src, (base + w.remote.addr as usize) as *mut u8, w.len) };
        let now = self.now;
        self.nodes[to].protocol.on_writes_landed(&[w.imm], now);
        self.write_dones.push((from, w.wr_id));
        self.drain(to)
    }

    /// Moves a node's output into the fabric and resolves completions.
    fn drain(&mut self, node: usize) -> Result<(), String> {
        let out: Output = self.nodes[node].protocol.take_output();
        let n = self.opts.nodes;
        for (to, frame) in out.frames {
            if self.nodes[to as usize].crashed {
                continue;
            }
            self.messages[node * n + to as usize].push_back(frame);
        }
        for w in out.writes {
            if self.nodes[w.to as usize].crashed {
                let now = self.now;
                self.nodes[node].protocol.on_write_done(w.wr_id, Err(crate::error::Error::PeerLost { node: w.to as usize, reason: "crashed".into() }), now);
                continue;
            }
            self.writes[node * n + w.to as usize].push_back(w);
        }
        for c in out.completions {
            self.complete(node, c.op, c.result)?;
        }
        Ok(())
    }

    fn complete(&mut self, node: usize, op: OpId, result: Result<Vec<f32>>) -> Result<(), String> {
        let Some(pos) = self.in_flight.iter().position(|(k, _)| *k == (node, op)) else {
            return Err(format!("node {node} completed unknown operation {op}"));
        };
        let (_, f) = self.in_flight.swap_remove(pos);
        self.log(format!("op {op} of node {node} completes: {}", if result.is_ok() { "ok" } else { "error" }));
        let lanes = self.opts.lanes;
        let worker = &mut self.workers[f.worker];
        worker.outstanding.retain(|o| *o != (node, op));
        if worker.blocked == Some((node, op)) {
            worker.blocked = None;
        }
        match result {
            Ok(values) => {
                if f.kind == Some(AccessKind::Pull) {
                    let mut output = f.output;
                    scatter(&f.rows, &values, &mut output, lanes);
                    for (i, _) in f.keys.iter().enumerate() {
                        worker.events[f.first_event + i].1 = Event::Pull { value: output[i * lanes..(i + 1) * lanes].to_vec() };
                    }
                }
                Ok(())
            }
            Err(e) => {
                if self.opts.crash.is_none() {
                    return Err(format!("operation {op} of node {node} failed: {e}"));
                }
                self.failed_ops += 1;
                // The outcome of a failed operation is unknown; its events are dropped.
                if f.kind.is_some() {
                    for i in 0..f.keys.len() {
                        worker.events[f.first_event + i].1 = Event::Pull { value: Vec::new() };
                    }
                }
                Ok(())
            }
        }
    }

    fn worker_step(&mut self, w: usize) -> Result<(), String> {
        if self.workers[w].waiting_all {
            self.workers[w].waiting_all = false;
            return Ok(());
        }
        let op = self.workers[w].script.pop_front().expect("runnable");
        let node = self.workers[w].node;
        let lanes = self.opts.lanes;
        let now = self.now;
        match op {
            ScriptOp::WaitAll => {
                self.log(format!("worker {w} waits for its operations"));
                self.workers[w].waiting_all = true;
            }
            ScriptOp::Localize { keys, asynchronous } => {
                self.ops += 1;
                self.log(format!("worker {w}@{node} localize {keys:?}{}", if asynchronous { " async" } else { "" }));
                let request = Request { kind: RequestKind::Localize, table: 0, keys: &keys, values: &[] };
                match self.nodes[node].protocol.submit(request, now) {
                    Ok(Submitted::Done(_)) => {}
                    Ok(Submitted::Pending(id)) => {
                        let first_event = self.workers[w].events.len();
                        self.in_flight
                            .push(((node, id), InFlight { worker: w, kind: None, keys: Vec::new(), rows: Vec::new(), output: Vec::new(), first_event }));
                        self.track(w, node, id, asynchronous);
                    }
                    Err(e) => self.submit_error(e)?,
                }
                self.drain(node)?;
            }
            ScriptOp::Access { kind, keys, lanes_or_tags, asynchronous } => {
                self.ops += 1;
                self.log(format!("worker {w}@{node} {kind:?} {keys:?} {lanes_or_tags:?}{}", if asynchronous { " async" } else { "" }));
                let mut input = Vec::new();
                for (i, _) in keys.iter().enumerate() {
                    match kind {
                        AccessKind::Push => input.extend(push_update(lanes_or_tags[i], lanes)),
                        AccessKind::Set => input.extend(set_value(lanes_or_tags[i], lanes)),
                        AccessKind::Pull => {}
                    }
                }
                let first_event = self.workers[w].events.len();
                for (i, &key) in keys.iter().enumerate() {
                    let e = match kind {
                        AccessKind::Push => Event::Push { lane: lanes_or_tags[i] },
                        AccessKind::Set => Event::Set { tag: lanes_or_tags[i] },
                        AccessKind::Pull => Event::Pull { value: Vec::new() },
                    };
                    self.workers[w].events.push((key, e));
                }
                let mut output = vec![0.0; if kind == AccessKind::Pull { keys.len() * lanes } else { 0 }];
                let mut rows = Vec::new();
                local_pass(&self.nodes[node].store, kind, 0, &keys, &input, &mut output, &mut rows);
                let pending = if rows.is_empty() {
                    None
                } else {
                    let (rkeys, rvalues) = gather(&rows, &keys, &input, lanes, kind.carries_values());
                    let request = Request { kind: RequestKind::Access(kind), table: 0, keys: &rkeys, values: &rvalues };
                    match self.nodes[node].protocol.submit(request, now) {
                        Ok(Submitted::Done(values)) => {
                            if kind == AccessKind::Pull {
                                scatter(&rows, &values, &mut output, lanes);
                            }
                            None
                        }
                        Ok(Submitted::Pending(id)) => Some(id),
                        Err(e) => {
                            self.submit_error(e)?;
                            None
                        }
                    }
                };
                match pending {
                    Some(id) => {
                        self.in_flight.push(((node, id), InFlight { worker: w, kind: Some(kind), keys: keys.clone(), rows, output, first_event }));
                        self.track(w, node, id, asynchronous);
                    }
                    None if kind == AccessKind::Pull => {
                        for (i, _) in keys.iter().enumerate() {
                            self.workers[w].events[first_event + i].1 = Event::Pull { value: output[i * lanes..(i + 1) * lanes].to_vec() };
                        }
                    }
                    None => {}
                }
                self.drain(node)?;
            }
        }
        Ok(())
    }

    fn submit_error(&mut self, e: crate::error::Error) -> Result<(), String> {
        if self.opts.crash.is_some() {
            self.failed_ops += 1;
            Ok(())
        } else {
            Err(format!("submit failed: {e}"))
        }
    }

    fn track(&mut self, w: usize, node: usize, id: OpId, asynchronous: bool) {
        let worker = &mut self.workers[w];
        if asynchronous {
            worker.outstanding.push((node, id));
        } else {
            worker.blocked = Some((node, id));
        }
    }

    fn finish(&mut self, steps: usize) -> Result<SimReport, String> {
        let live = |w: &Worker, nodes: &[Node]| !nodes[w.node].crashed;
        for (i, w) in self.workers.iter().enumerate() {
            if live(w, &self.nodes) && (w.blocked.is_some() || !w.outstanding.is_empty() || !w.script.is_empty()) {
                return Err(format!(
                    "worker {i} is stuck: blocked on {:?}, {} outstanding, {} left in its script",
                    w.blocked,
                    w.outstanding.len(),
                    w.script.len()
                ));
            }
        }
        let mut history = History::new(self.workers.len());
        for (i, w) in self.workers.iter().enumerate() {
            for (key, e) in &w.events {
                if matches!(e, Event::Pull { value } if value.is_empty()) {
                    continue;
                }
                history.record(i, *key, e.clone());
            }
        }
        let lanes = self.opts.lanes;
        let mut slots_in_use = Vec::new();
        for (rank, node) in self.nodes.iter().enumerate() {
            if node.crashed {
                slots_in_use.push(0);
                continue;
            }
            if (node.protocol.pending_ops() != 0 || node.protocol.keys_in_transit() != 0) && self.opts.crash.is_none() {
                return Err(format!(
                    "node {rank} ended with {} pending operations and {} keys in transit",
                    node.protocol.pending_ops(),
                    node.protocol.keys_in_transit()
                ));
            }
            let t = node.store.table(0);
            let held = (0..self.opts.keys).filter(|&k| t.slot_of(k).is_some()).count();
            let (live, _) = t.slot_usage();
            if self.opts.crash.is_none() && live != held {
                return Err(format!("node {rank} holds {held} keys but has {live} slots in use (a slot leaked)"));
            }
            slots_in_use.push(live);
        }
        if self.opts.crash.is_none() {
            for key in 0..self.opts.keys {
                let holders: Vec<usize> = (0..self.nodes.len()).filter(|&n| self.nodes[n].store.table(0).slot_of(key).is_some()).collect();
                if holders.len() != 1 {
                    return Err(format!("key {key} is held by nodes {holders:?}"));
                }
                let owner = holders[0];
                let t = self.nodes[owner].store.table(0);
                let mut value = vec![0.0; lanes];
                // SAFETY: the simulation is single-threaded and the slot is the key's published slot.
                unsafe { t.read(t.slot_of(key).expect("held"), &mut value) };
                history.record_after_all(key, Event::Pull { value });
                for node in &self.nodes {
                    if let Some(recorded) = node.protocol.owner_of(0, key)
                        && recorded as usize != owner
                    {
                        return Err(format!("home of key {key} records node {recorded} but node {owner} holds it"));
                    }
                }
            }
        }
        let stats = self.nodes.iter().map(|n| n.protocol.stats(0)).collect();
        Ok(SimReport { history, steps, stats, failed_ops: self.failed_ops, ops: self.ops, slots_in_use, trace: self.trace.iter().cloned().collect() })
    }
}

fn describe_frame(frame: &[u8]) -> String {
    use crate::protocol::wire::{self, msg};
    let describe = |b: &[u8]| -> String {
        match b[0] {
            msg::ACCESS => {
                // Keys sit after the header and the optional indices; values are not decoded.
                let kind = b[1];
                let flags = b[2];
                let origin = u16::from_le_bytes([b[6], b[7]]);
                let op = u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8]));
                let part = u32::from_le_bytes(b[16..20].try_into().unwrap_or([0; 4]));
                let count = u32::from_le_bytes(b[20..24].try_into().unwrap_or([0; 4])) as usize;
                let at = wire::ACCESS_HEADER + if flags & wire::FLAG_INDEXED != 0 { count * 4 } else { 0 };
                let keys: Vec<u64> =
                    (0..count).filter_map(|i| b.get(at + i * 8..at + i * 8 + 8)).map(|k| u64::from_le_bytes(k.try_into().unwrap_or([0; 8]))).collect();
                let kind = ["?", "pull", "push", "set"].get(kind as usize).copied().unwrap_or("?");
                format!("access[{kind} op {origin}:{op}/{part} keys {keys:?} flags {flags}]")
            }
            msg::RESPONSE => {
                let responder = u16::from_le_bytes([b[6], b[7]]);
                let op = u64::from_le_bytes(b[8..16].try_into().unwrap_or([0; 8]));
                let part = u32::from_le_bytes(b[16..20].try_into().unwrap_or([0; 4]));
                format!("response[op {op}/{part} from {responder}]")
            }
            msg::LOCALIZE | msg::RELOCATE => match wire::Move::decode(b, usize::MAX) {
                Ok(m) => {
                    let items: Vec<String> = (0..m.count).map(|i| format!("{}(r{})", m.item(i).key, m.item(i).resv)).collect();
                    let name = if b[0] == msg::LOCALIZE { "localize" } else { "relocate" };
                    format!("{name}[to {} {}]", m.new_owner, items.join(","))
                }
                Err(_) => "move?".into(),
            },
            msg::FAILURE => "failure".into(),
            msg::LOCALIZE_FAILED => "localize-failed".into(),
            msg::BARRIER => "barrier".into(),
            msg::BARRIER_RELEASE => "release".into(),
            _ => "?".into(),
        }
    };
    wire::Messages::new(frame).map(|m| m.map(describe).unwrap_or_else(|_| "?".into())).collect::<Vec<_>>().join(",")
}
