//! Deterministic simulated clusters for testing the protocol without threads or sockets.
//!
//! A simulation runs N nodes — each a [`Core`] over a real [`Store`], with workers that own a
//! [`Requester`] and an inbox — connected by an in-memory fabric that keeps per-pair FIFO order
//! for frames (as TCP and RC queue pairs do) but otherwise delays and interleaves everything —
//! frames of different pairs, one-sided writes (on a channel of their own, so they may overtake
//! or trail frames), write completions, worker steps, deliveries, timer ticks — as a seeded
//! random generator decides. The nodes are driven exactly as the runtime drives them (a step,
//! its output handed over before it ends, yields resumed on fresh steps), except that a worker's
//! step may hand its frames over late, as when its thread waits for a CPU before it queues
//! them: steps that do not need its shards then queue theirs first, as the runtime's may
//! ([`SimOptions::late_hand_over`]). Simulated workers run
//! random mixes of pull, push, set and localize, synchronous (pulls into the caller's buffer)
//! and asynchronous, with one to hundreds of keys per operation split into parts of a
//! configurable size — and, as configured, intents whose grants they carry out, the deltas of
//! replica syncs (`replica_syncs.rs`), and a service worker per node that makes, syncs and
//! drops run-time replicas of some keys with the intent service's own replica set
//! (`replica_set.rs`) and runs its rounds on windows the workers declare (`intent_rounds.rs`) — and
//! every operation is recorded for the [consistency checker](crate::consistency) (keys with
//! run-time replicas for the replica guarantee). A slow link can be drawn per run. The same
//! seed always gives the same run.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::{HugePages, Partitioning, TableSpec};
use crate::consistency::{ClockTrace, Event, History, TimedPull, TimedPush, Violation, check_bounded_delay, check_replica_rounds, push_update, set_value};
use crate::error::{Error, Result};
use crate::fabric::Landed;
use crate::protocol::{ALL_WORKERS, AccessKind, Core, Delivery, Issued, OpId, Progress, PullTarget, Requester, Settings, SlotWrite, Step, Transmit};
use crate::stats::Stats;
use crate::store::{RegionHandle, Registrar, RemoteAddr, Store};
use crate::update::Updater;

mod backups;
mod dynamic_ids;
mod intent_rounds;
mod replica_checks;
mod replica_set;
mod replica_syncs;
pub use intent_rounds::DeclaredIntentCounts;
pub use replica_set::ReplicaSetCounts;
use replica_set::SimReplicaSet;
pub use replica_syncs::SyncCounts;
use replica_syncs::SyncWait;

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
    /// Keys per operation: drawn uniformly from this range (inclusive).
    pub keys_per_op: (usize, usize),
    /// Whether `localize` moves keys.
    pub relocation: bool,
    /// Whether location caches are on.
    pub location_caches: bool,
    /// Share of operations issued asynchronously (0..=1).
    pub async_share: f64,
    /// Home-node assignment.
    pub partitioning: Partitioning,
    /// An explicit home per key (`keys` of them, each below `nodes`), which makes the table
    /// [`Partitioning::Placed`] whatever `partitioning` says.
    pub placement: Option<Vec<u16>>,
    /// Part size: operations are split into parts of about this many bytes (small values make
    /// many parts).
    pub part_bytes: usize,
    /// Operations with more remote rows than this stream, a frame of parts per worker step,
    /// so keys can move between the steps of one operation.
    pub small_operation_rows: usize,
    /// Shards per node.
    pub shards: usize,
    /// Lose this node at this step (fault injection); the run then checks liveness only.
    pub crash: Option<(usize, usize)>,
    /// Keep a backup of every key on its owner's successor (see `protocol::backup`): pushes
    /// complete once backed up, and a crashed node's keys fail over to its successor. The run
    /// checks that every push acknowledged before a crash survives it.
    pub backups: bool,
    /// With backups: on how many successors every key is backed up (at least 1).
    pub backup_copies: usize,
    /// With `crash`: this node crashes at the same step too, and the survivors learn of the
    /// two losses one by one, in any order (with `rejoin`, it may be the joining node). With
    /// `backup_copies` ≥ 2 no acknowledged push may be lost.
    pub crash_also: Option<usize>,
    /// With backups: this node leaves gracefully (`protocol::leave`) once its workers, whose
    /// scripts are half as long, are done, while the others go on. Nothing may fail and no
    /// push may be lost: the run checks the whole history, the leaver's included, against
    /// reads after everything where the survivors serve each key.
    pub leave: Option<usize>,
    /// With `leave` and `crash`: the crash's step counts from the step the leaver asks to
    /// leave, so that it falls during the departure.
    pub crash_while_leaving: bool,
    /// With `leave`: once the leaver has left, its links are empty and every node's backups
    /// are settled, a fresh node takes its rank and joins (`protocol::leave`, joins) while the
    /// others go on; its own workers, with scripts half as long, start once it joined. The run
    /// checks the whole history, and that the joined node serves what it stands in for again.
    /// Without `leave`, with `crash` (and backups): the same for the crashed node's rank, once
    /// every survivor learnt of the crash.
    pub rejoin: bool,
    /// With `rejoin` and `crash`: the crash's step counts from the step the fresh node asks
    /// to join, so that it falls during the join (the crashed node may be the joining node,
    /// which then need not end up joined).
    pub crash_while_joining: bool,
    /// Keys managed by replication (see [`crate::replication`]); their operations are
    /// single-key pulls and pushes, checked with the round-based staleness rule.
    pub replicated: Vec<std::ops::Range<u64>>,
    /// Raw ids of a dynamic table (a second table) that workers ask the slot keys of, now and
    /// then, from a pool of this many (0: no dynamic table); see `sim::dynamic_ids`.
    pub dynamic_ids: u64,
    /// With `dynamic_ids`: the dynamic table evicts ids, and nodes begin eviction rounds now
    /// and then (see `sim::dynamic_ids`).
    pub evict_ids: bool,
    /// With `evict_ids` and relocation: workers also signal intent on slot keys of the dynamic
    /// table (any of its range: held, offered in a round or free), as the intent service does
    /// on the slot keys of the ids it was told of; the homes' grants become granted localizes
    /// of those slot keys and run-time replicas, each dropped when its node's intent ends.
    /// Checked after every step: a slot key a node holds away from its home, or has a replica
    /// of, is an id's (no grant moved or replicated a slot a new id may take, and no round
    /// freed one while it was away or replicated). See `sim::dynamic_ids`.
    pub intend_ids: bool,
    /// Simulated nanoseconds between a node's replication rounds.
    pub round_period: u64,
    /// A round that has waited more than a round period for its acknowledgements is given up
    /// now and then, as the runtime's driver gives one up at its deadline: it refreshes from
    /// the images that came, its late acknowledgements are dropped, and the next round asks
    /// for full images.
    pub round_give_ups: bool,
    /// Share of pushes issued as push-pulls (0..=1): the update and the updated value in one
    /// round trip, recorded as a push followed by a pull of the same key.
    pub push_pull: f64,
    /// The table's update function.
    pub updater: SimUpdater,
    /// How values travel (the histories' lanes and tags are small integers, exact in the
    /// 16-bit formats).
    pub codec: crate::codec::ValueCodec,
    /// Key caching for lists of at least this many keys (0: off).
    pub key_cache_min: usize,
    /// Clocks each worker completes (each after waiting for its operations), at random points
    /// of its script; 0: workers do not use clocks.
    pub clocks: usize,
    /// The delay bound `τ` the clocks keep (`None`: no bound); checked on the recorded clocks.
    pub max_delay: Option<u64>,
    /// The clock every node's count starts from, as in a cluster restored from a checkpoint
    /// that saved it (0: a fresh cluster). Each clock a worker completes must return this plus
    /// the clocks it completed.
    pub first_clock: u64,
    /// Workers also signal intent (random levels on random keys) to the keys' homes, and the
    /// moves the homes grant (INTENT_GO) become asynchronous localizes of a worker of the node,
    /// mixed with the explicit localizes.
    pub intents: bool,
    /// Each node's first worker also sends keys' deltas the way the intent service keeps its
    /// run-time replicas in sync: a REPLICA_SYNC straight to a node it guesses holds them, the
    /// images of the items applied read from that node's registered buffer (as a one-sided
    /// read would), the others sent on through the homes as a push-pull (see
    /// `replica_syncs.rs`).
    pub replica_syncs: bool,
    /// Keys that may get run-time replicas: each node runs a service worker that makes and
    /// drops them the way the intent service does — on the homes' replicate grants and at
    /// random — and the workers' accesses of these keys (no sets) are checked against the
    /// replica guarantee (see `replica_set.rs`). Needs a table without static replication
    /// whose pushes add.
    pub run_time_replicas: Option<std::ops::Range<u64>>,
    /// With [`SimOptions::intents`] and run-time replicas: instead of sending random levels,
    /// the workers declare windows of clocks in which they will need keys, and each node's
    /// service worker runs the intent service's rounds on them (the shipped
    /// `intent::IntentRounds`), telling the homes the level changes and taking their grants
    /// (see `intent_rounds.rs`).
    pub declared_intents: bool,
    /// With [`SimOptions::declared_intents`]: each node's service now and then holds its
    /// relocations, as a checkpoint does (`Node::hold_relocations`, the shipped
    /// `intent::ServiceSchedule`), acts until its schedule says they settled, and releases them
    /// a while later; while they are settled no granted move of that node may be queued or in
    /// flight, which the run checks.
    pub hold_relocations: bool,
    /// One link, drawn per run, delivers its frames only when no other link has any, nine times
    /// in ten: frames sent over it are overtaken by much that follows them on other paths.
    pub slow_link: bool,
    /// A worker's step that took shard locks hands its frames over late one time in two, as
    /// when its thread waits for a CPU between routing and queueing: they wait until a step of
    /// the node takes one of those shards (which the runtime's would take only after them) or
    /// until a later event, and that worker's later frames queue behind them. Other steps queue
    /// theirs first meanwhile, as the runtime's may.
    pub late_hand_over: bool,
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
            keys_per_op: (1, 3),
            relocation: true,
            location_caches: false,
            async_share: 0.4,
            partitioning: Partitioning::Range,
            placement: None,
            part_bytes: 4096,
            small_operation_rows: crate::protocol::SMALL_OPERATION_ROWS,
            shards: 3,
            crash: None,
            backups: false,
            backup_copies: 1,
            crash_also: None,
            leave: None,
            crash_while_leaving: false,
            rejoin: false,
            crash_while_joining: false,
            replicated: Vec::new(),
            dynamic_ids: 0,
            evict_ids: false,
            intend_ids: false,
            round_period: 40_000,
            round_give_ups: false,
            push_pull: 0.0,
            updater: SimUpdater::Add,
            codec: crate::codec::ValueCodec::F32,
            key_cache_min: 0,
            clocks: 0,
            max_delay: None,
            first_clock: 0,
            intents: false,
            replica_syncs: false,
            run_time_replicas: None,
            declared_intents: false,
            hold_relocations: false,
            slow_link: false,
            late_hand_over: true,
            trace_lines: 150,
            seed,
        }
    }

    /// Operations of up to hundreds of keys over a larger table, split into parts of a few keys
    /// each: the decoders, the part bookkeeping and bulk relocations get exercised.
    pub fn large(seed: u64) -> SimOptions {
        SimOptions {
            nodes: 3,
            workers_per_node: 2,
            keys: 300,
            lanes: 40,
            ops_per_worker: 12,
            keys_per_op: (1, 250),
            part_bytes: 400,
            small_operation_rows: 24,
            shards: 5,
            ..SimOptions::small(seed)
        }
    }

    /// The toolbox: push-pulls next to every other operation, on a table whose pushes go
    /// through a user-defined updater with state in the slot ([`SimUpdater::Counting`]).
    pub fn toolbox(seed: u64) -> SimOptions {
        SimOptions { push_pull: 0.4, updater: SimUpdater::Counting, ..SimOptions::small(seed) }
    }

    /// Bounded delay `τ = tau`: every worker completes 6 clocks among its operations.
    pub fn bounded_delay(seed: u64, tau: u64) -> SimOptions {
        SimOptions { clocks: 6, max_delay: Some(tau), ops_per_worker: 30, ..SimOptions::small(seed) }
    }

    /// Intent signalling mixed with explicit localizes and every access.
    pub fn intents(seed: u64) -> SimOptions {
        SimOptions { intents: true, ops_per_worker: 35, ..SimOptions::small(seed) }
    }

    /// Intents, with run-time replicas of the lower half of 8 keys made and dropped by each
    /// node's simulated intent service among the relocations.
    pub fn run_time_replicas(seed: u64) -> SimOptions {
        SimOptions { keys: 8, run_time_replicas: Some(0..4), ..SimOptions::intents(seed) }
    }

    /// A small cluster where 3 of 8 keys are replicated and the others relocate.
    pub fn replicated(seed: u64) -> SimOptions {
        SimOptions { keys: 8, replicated: vec![1..2, 4..6], ops_per_worker: 40, round_give_ups: true, ..SimOptions::small(seed) }
    }
}

/// The update function of the simulated table. Histories record pushes as additions, so the
/// updaters are ones whose effect on the value is an addition the checker can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimUpdater {
    /// The default: pushes add.
    Add,
    /// Server-side SGD with learning rate 0.5; pushes carry `-2 ×` the update to add.
    Sgd,
    /// A user-defined rule that adds the update and counts pushes in one word of state kept in
    /// the slot: after the run every key's count must equal its pushes (the state moved with
    /// every relocation, and no push was applied twice or lost).
    Counting,
}

/// The rule behind [`SimUpdater::Counting`].
struct CountingRule;

impl crate::update::UpdateRule for CountingRule {
    fn describe(&self) -> String {
        "sim-counting".into()
    }
    fn state_len(&self, _: usize) -> usize {
        1
    }
    fn apply(&self, value: &mut [f32], state: &mut [f32], gradient: &[f32]) {
        for (x, g) in value.iter_mut().zip(gradient) {
            *x += g;
        }
        state[0] += 1.0;
    }
}

impl SimUpdater {
    fn updater(self) -> Updater {
        match self {
            SimUpdater::Add => Updater::Add,
            SimUpdater::Sgd => Updater::Sgd { lr: 0.5 },
            SimUpdater::Counting => Updater::custom(CountingRule),
        }
    }

    /// What a push sends so that the value gains `update`.
    fn scale(self) -> f32 {
        if self == SimUpdater::Sgd { -2.0 } else { 1.0 }
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
    /// Most parts any one operation was split into.
    pub max_parts: usize,
    /// Operations whose parts were encoded over several worker steps (streamed), so that keys
    /// could move between the routing of their first and last parts.
    pub streamed_ops: usize,
    /// Slots in use at the end, per node.
    pub slots_in_use: Vec<usize>,
    /// The last steps of the run.
    pub trace: Vec<String>,
    /// Replication rounds completed, over all nodes.
    pub rounds: usize,
    /// Replication rounds given up (see [`SimOptions::round_give_ups`]), over all nodes.
    pub rounds_given_up: usize,
    /// Replicated-key accesses recorded.
    pub replica_events: usize,
    /// The first violation of the round-based staleness rule, if any.
    pub replica_violation: Option<Violation>,
    /// Every worker's clocks (started and completed, simulated time).
    pub clocks: Vec<ClockTrace>,
    /// The first violation of the delay bound, if any.
    pub clock_violation: Option<Violation>,
    /// Keys the homes granted to nodes that signalled intent (each became a localize).
    pub intent_grants: usize,
    /// Replica syncs sent (see [`SimOptions::replica_syncs`]) and what became of their items.
    pub replica_syncs: SyncCounts,
    /// What the simulated replica sets did (see [`SimOptions::run_time_replicas`]).
    pub run_time_replicas: ReplicaSetCounts,
    /// What the nodes' intent rounds did (see [`SimOptions::declared_intents`]).
    pub declared_intents: DeclaredIntentCounts,
    /// The first violation of the run-time replica guarantee, if any.
    pub run_time_violation: Option<Violation>,
    /// Worker steps whose frames were handed over late (see [`SimOptions::late_hand_over`]).
    pub late_hand_overs: usize,
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

    unsafe fn register_read_only(&self, base: *mut u8, len: usize) -> Result<RegionHandle> {
        // SAFETY: same contract; simulated writes only ever target slot regions.
        unsafe { self.register(base, len) }
    }
}

struct SimNode {
    core: Core,
    regions: Arc<SimRegistrar>,
    /// The output buffer of the node's own event handling (frames, landings, ticks).
    tx: Transmit,
    crashed: bool,
    /// It left gracefully (its LEFT went out): it holds nothing the checks look at, though
    /// what it sent is still delivered.
    left: bool,
    /// 0 for the node started with the cluster, 1 for a fresh node that took its rank
    /// ([`SimOptions::rejoin`]).
    incarnation: u8,
}

#[derive(Debug, Clone)]
enum ScriptOp {
    /// Ids of the dynamic table whose slot keys the worker asks for (`sim::dynamic_ids`).
    Assign {
        ids: Vec<u64>,
    },
    Access {
        kind: AccessKind,
        keys: Vec<u64>,
        lanes_or_tags: Vec<u32>,
        asynchronous: bool,
    },
    /// A pull (no lane) or push (its lane) of one replicated key.
    Replicated {
        key: u64,
        lane: Option<u32>,
    },
    Localize {
        keys: Vec<u64>,
        asynchronous: bool,
        /// Asked for on a home's intent grant (`MOVE_GRANTED`).
        granted: bool,
    },
    /// The node's need of slot keys of the dynamic table changes ([`SimOptions::intend_ids`]).
    IntentIds {
        keys: Vec<u64>,
        level: crate::intent::IntentLevel,
    },
    /// The end of the node's replicas of slot keys of the dynamic table whose intent ended a
    /// while ago, as the runtime's service ends a replica whose drop it put off or whose delta
    /// drains ([`SimOptions::intend_ids`]).
    DropSlotReplicas {
        keys: Vec<u64>,
    },
    /// A granted localize of slot keys of the dynamic table ([`SimOptions::intend_ids`]).
    LocalizeIds {
        keys: Vec<u64>,
    },
    /// The node's need of keys changes (what its intent service tells their homes).
    Intent {
        keys: Vec<u64>,
        level: crate::intent::IntentLevel,
    },
    /// The service makes replicas of `keys` (see [`SimOptions::run_time_replicas`]).
    MakeReplicas {
        keys: Vec<u64>,
        /// A home's grant (the node's intents note it once taken).
        granted: bool,
    },
    /// The service drops the replicas of `keys`.
    DropReplicas {
        keys: Vec<u64>,
    },
    /// The service starts a sync round of its replicas.
    SyncReplicas,
    /// The worker declares that it will need `keys` in the `len` clocks beginning `start`
    /// clocks from now (see [`SimOptions::declared_intents`]).
    Declare {
        keys: Vec<u64>,
        start: u64,
        len: u64,
    },
    /// The intent service's thread gets a core: it does what its schedule says now (a round,
    /// taking up the grants, or nothing while it rests).
    IntentService,
    /// A barrier's sync round of the replicas (`ReplicaSet::sync_now`), once nothing drains
    /// or syncs and no key with a dirty replica is arriving here.
    SyncReplicasNow,
    /// The service pushes the deltas of dropped replicas its replica set took at an earlier
    /// step (`token`: the set's action).
    PushDrain {
        token: u32,
        keys: Vec<u64>,
        deltas: Vec<f32>,
    },
    /// The service's last step, once its node's workers are done: drops every replica.
    StopReplicas,
    /// Deltas of `keys` sent as a replica sync (see [`SimOptions::replica_syncs`]): each key's
    /// lane, or `None` for a delta of zeros (sent as the key alone).
    ReplicaSync {
        keys: Vec<u64>,
        lanes: Vec<Option<u32>>,
    },
    WaitAll,
    /// Completes the worker's clock (its operations completed: a `WaitAll` precedes it).
    AdvanceClock,
}

/// What served an access of a key with run-time replicas, as far as the simulation knows (see
/// `replica_set.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Served {
    /// Not known (a streamed operation, whose later parts were routed in later steps).
    Unknown,
    /// The key's value wherever it was (here, or at its owner): a pull includes every push
    /// known to be there when it was issued, a push is there when it completes.
    Owner,
    /// A run-time replica here whose value includes every push that was at the owner at the
    /// given time (`None`: not known, e.g. a replica kept from a departing key).
    Replica(Option<u64>),
}

/// An operation the worker waits for or will collect.
struct InFlight {
    op: OpId,
    kind: Option<AccessKind>,
    keys: Vec<u64>,
    /// A synchronous pull's caller buffer (the borrowed-buffer path); local rows filled already.
    buffer: Vec<f32>,
    first_event: usize,
    asynchronous: bool,
    /// An operation of a node's simulated intent service (`replica_set.rs`), which records no
    /// events.
    service: bool,
    /// A localize the homes granted (intent's move of keys here).
    granted_move: bool,
    /// With backups and a crash to come, per key: whether the node that will crash served it
    /// when this was issued (the issuing node did not know it lost) — its reads may include
    /// writes that node never got backed up (see `backups.rs`).
    victim_reads: Vec<bool>,
}

impl InFlight {
    /// The operation's events in its worker's history (`None` for one that records none): a
    /// push-pull's pushes, then its pulls.
    fn events(&self) -> Option<(usize, usize)> {
        let kind = self.kind?;
        let n = if kind == AccessKind::PushPull { 2 * self.keys.len() } else { self.keys.len() };
        Some((self.first_event, self.first_event + n))
    }
}

/// An operation whose parts are still being encoded.
struct Streaming {
    op: OpId,
    keys: Vec<u64>,
    input: Vec<f32>,
}

struct SimWorker {
    node: usize,
    requester: Requester,
    inbox: VecDeque<Delivery>,
    tx: Transmit,
    script: VecDeque<ScriptOp>,
    in_flight: Vec<InFlight>,
    streaming: Option<Streaming>,
    waiting_all: bool,
    /// Program-ordered events; pulls are filled in at completion.
    events: Vec<(u64, Event)>,
    /// Per event, when its operation was issued and when it completed (simulated time).
    times: Vec<(u64, u64)>,
    /// Per event, what served it (recorded for keys with run-time replicas only).
    served: Vec<Served>,
    /// The worker's index on its node.
    index: u16,
    /// Waiting to start its next clock until the cluster completed this many.
    clock_target: Option<u64>,
    /// When it started and completed its clocks (simulated time).
    clocks: ClockTrace,
    /// A replica sync waiting for its acknowledgement.
    sync: Option<SyncWait>,
    /// A localize waiting until no sync round carries these keys' deltas (run-time replicas).
    localize_waits_for: Option<Vec<u64>>,
    /// The keys a worker's localize (not a granted one: the service's) marked
    /// (`begin_localize`) until it is issued: a granted localize put at the front of the
    /// script meanwhile leaves them marked.
    localize_marked: Option<Vec<u64>>,
    /// The worker's localize marked its keys at its last step and found none carried: it is
    /// issued at this step without looking again.
    localize_deferred: bool,
    /// Script steps taken: the worker's clock for declared intents.
    intent_clock: u64,
    /// Writes waiting to be backed up before they are acknowledged (see `backups.rs`).
    awaiting_backup: Vec<backups::AwaitingBackup>,
    /// The incarnation of its node it runs on ([`SimNode::incarnation`]).
    incarnation: u8,
    /// Ids of the dynamic table waiting for their homes' answers.
    assigning: Option<dynamic_ids::AssignWait>,
    /// Where the dynamic table evicts: the worker's pin for grace periods, and the ids with
    /// their slot keys it got and will use at its next step.
    pin: Option<crate::dynamic::Pin>,
    holding: Option<Vec<(u64, u64)>>,
}

impl SimWorker {
    fn new(node: usize, index: u16, requester: Requester, tx: Transmit, script: VecDeque<ScriptOp>) -> SimWorker {
        SimWorker {
            index,
            clock_target: None,
            clocks: ClockTrace { started: vec![0], finished: Vec::new() },
            node,
            requester,
            inbox: VecDeque::new(),
            tx,
            script,
            in_flight: Vec::new(),
            sync: None,
            assigning: None,
            streaming: None,
            waiting_all: false,
            events: Vec::new(),
            times: Vec::new(),
            served: Vec::new(),
            localize_waits_for: None,
            localize_deferred: false,
            localize_marked: None,
            intent_clock: 0,
            awaiting_backup: Vec::new(),
            incarnation: 0,
            pin: None,
            holding: None,
        }
    }

    fn blocked(&self) -> bool {
        self.sync.is_some() || self.in_flight.iter().any(|f| !f.asynchronous) || self.awaiting_backup.iter().any(|a| a.synchronous)
    }
}

struct Sim {
    opts: SimOptions,
    rng: ChaCha8Rng,
    nodes: Vec<SimNode>,
    workers: Vec<SimWorker>,
    frames: Vec<VecDeque<Vec<u8>>>,
    writes: Vec<VecDeque<SlotWrite>>,
    write_dones: Vec<(usize, u64)>,
    now: u64,
    trace: VecDeque<String>,
    failed_ops: usize,
    ops: usize,
    max_parts: usize,
    streamed_ops: usize,
    /// Per node: replication round state.
    replication: Vec<SimRounds>,
    /// Per replicated key (in key order): pushes and pulls with their times.
    replica_history: Vec<(u64, Vec<TimedPush>, Vec<TimedPull>)>,
    /// Keys granted by intent (see [`SimReport::intent_grants`]).
    intent_grants: usize,
    /// Replica syncs sent and their items' outcomes.
    syncs: SyncCounts,
    /// The slot key every id of the dynamic table got (see `sim::dynamic_ids`).
    dynamic_slots: std::collections::BTreeMap<u64, u64>,
    /// Per node: how much it needs each slot key of the dynamic table it last signalled
    /// ([`SimOptions::intend_ids`]).
    slot_intents: Vec<std::collections::BTreeMap<u64, crate::intent::IntentLevel>>,
    /// Per node, its simulated replica set (empty without run-time replicas).
    replica_sets: Vec<SimReplicaSet>,
    /// What the replica sets did.
    replica_counts: ReplicaSetCounts,
    /// Each node's intents and service schedule (see [`SimOptions::declared_intents`]).
    intent_services: Vec<intent_rounds::SimIntentService>,
    declared: DeclaredIntentCounts,
    /// The slow link's channel (see [`SimOptions::slow_link`]).
    slow_link: Option<usize>,
    /// Per worker: frames its steps handed over late.
    late: Vec<LateFrames>,
    /// Per node: its workers.
    workers_by_node: Vec<Vec<usize>>,
    /// Worker steps whose frames were handed over late.
    late_hand_overs: usize,
    /// Survivors not yet told of a crash, with the node that crashed: each learns of each
    /// crash at a time of its own, as each real node detects a dead peer on its own connection.
    unaware: Vec<(usize, usize)>,
    /// With relocation, backups and a crash: the operations (node, op) a node that crashes
    /// answered any part of — their reads may include writes it never backed up.
    victim_answers: std::collections::HashSet<(usize, u64)>,
    /// The step at which the leaver asked to leave (see [`SimOptions::crash_while_leaving`]).
    leave_asked_at: Option<usize>,
    /// The step at which the fresh node asked to join (see [`SimOptions::crash_while_joining`]).
    join_asked_at: Option<usize>,
    /// The pushes and sets of operations that failed (under a crash), each with its key: each
    /// may have taken effect or not, at any time after it was issued, so the checker sees it
    /// as the only event of a worker of its own.
    floating: Vec<(u64, Event)>,
}

/// A simulated node's replication rounds: the shipped machine ([`crate::replication::Rounds`])
/// and the round under way, driven as the runtime's driver drives them.
#[derive(Default)]
struct SimRounds {
    rounds: crate::replication::Rounds,
    /// When the next round is due.
    next_at: u64,
    /// The round under way.
    under_way: Option<crate::replication::Round>,
    /// Completed rounds: (began, completed).
    done: Vec<(u64, u64)>,
    /// Rounds given up.
    given_up: usize,
}

/// Whether `error` is one a lost node explains: the node itself, a key whose value it took, or
/// an operation that waited for it. Anything else failing an operation under a crash means the
/// protocol's state went wrong (a home that records an owner without the key, say).
fn is_loss(error: &Error) -> bool {
    matches!(error, Error::PeerLost { .. } | Error::KeyLost { .. } | Error::Timeout { .. })
}

/// Runs one simulation.
pub fn run(opts: SimOptions) -> Result<SimReport, SimFailure> {
    let mut sim = Sim::new(opts.clone()).map_err(|e| SimFailure { seed: opts.seed, reason: format!("set-up failed: {e}"), trace: Vec::new() })?;
    let outcome = sim.run();
    outcome.map_err(|reason| SimFailure { seed: opts.seed, reason, trace: sim.trace.iter().cloned().collect() })
}

/// Runs one simulation and checks its history for per-key sequential consistency, and what the
/// options add: bounded delay, replica staleness, the run-time replica guarantee.
///
/// With a crash ([`SimOptions::crash`]) it checks what survives a lost node: every key's
/// sequential consistency (a failed operation's pushes and sets may have taken effect at any
/// time after they were issued, or never) and, for keys with run-time replicas, that no push is
/// read twice or before it was issued. A lost node no longer holds back the clocks and stops
/// replica rounds, so bounded delay and staleness are not checked then. Nothing may hang, and
/// what fails must fail with the loss ([`run`] checks those).
pub fn run_and_check(opts: SimOptions) -> Result<SimReport, SimFailure> {
    let (lanes, seed, crash) = (opts.lanes, opts.seed, opts.crash.is_some());
    let report = run(opts)?;
    let under = if crash { " under a crash" } else { "" };
    if let Err(v) = report.history.check(lanes) {
        let v: Violation = v;
        return Err(SimFailure { seed, reason: format!("consistency violation{under}: {v}"), trace: report.trace });
    }
    if !crash {
        if let Some(v) = &report.clock_violation {
            return Err(SimFailure { seed, reason: format!("bounded-delay violation: {v}"), trace: report.trace });
        }
        if let Some(v) = &report.replica_violation {
            return Err(SimFailure { seed, reason: format!("replica staleness violation: {v}"), trace: report.trace });
        }
    }
    if let Some(v) = &report.run_time_violation {
        return Err(SimFailure { seed, reason: format!("run-time replica violation{under}: {v}"), trace: report.trace });
    }
    Ok(report)
}

/// A worker's frames handed over late (see [`SimOptions::late_hand_over`]).
#[derive(Default)]
struct LateFrames {
    /// The shards the steps that made them held: a step taking one of these lets them go first.
    shards: u64,
    /// The frames with their channels, in order.
    frames: VecDeque<(usize, Vec<u8>)>,
}

impl LateFrames {
    /// Moves the frames onto their links, in order (those from or to a crashed node vanish).
    fn flush(&mut self, frames: &mut [VecDeque<Vec<u8>>], crashed: &[bool], n: usize) {
        for (channel, frame) in self.frames.drain(..) {
            if !crashed[channel % n] && !crashed[channel / n] {
                frames[channel].push_back(frame);
            }
        }
        self.shards = 0;
    }
}

/// Where a step's frames and writes go in the simulated fabric.
struct Wires<'a> {
    from: usize,
    n: usize,
    crashed: Vec<bool>,
    frames: &'a mut Vec<VecDeque<Vec<u8>>>,
    writes: &'a mut Vec<VecDeque<SlotWrite>>,
    /// Every worker's late frames (see [`SimOptions::late_hand_over`]).
    late: &'a mut [LateFrames],
    /// The node's workers.
    node_workers: &'a [usize],
    /// The worker whose steps these are (`None`: the node's own).
    worker: Option<usize>,
    /// Whether this worker's steps that take shards hand their frames over late.
    defer: bool,
}

impl Wires<'_> {
    /// Hands a step's frames and writes over, as the runtime does before a step ends. Writes to
    /// a crashed node complete with an error at once. A step that took shards first lets the
    /// other workers' late frames made under any of them go (the runtime's would have waited
    /// for them); this worker's frames queue behind its own late ones.
    fn hand_over(&mut self, step: &mut Step<'_, '_>) {
        let held = step.held_shards();
        for &w in self.node_workers.iter().filter(|&&w| Some(w) != self.worker) {
            if self.late[w].shards & held != 0 {
                self.late[w].flush(self.frames, &self.crashed, self.n);
            }
        }
        let late = self.worker.filter(|&w| (self.defer && held != 0) || !self.late[w].frames.is_empty());
        if let Some(w) = late {
            self.late[w].shards |= held;
        }
        while let Some((to, frame)) = step.transmit().poll_transmit() {
            if self.crashed[to as usize] {
                continue;
            }
            let channel = self.from * self.n + to as usize;
            match late {
                Some(w) => self.late[w].frames.push_back((channel, frame)),
                None => self.frames[channel].push_back(frame),
            }
        }
        while let Some(w) = step.transmit().poll_write() {
            if self.crashed[w.to as usize] {
                let _ = step.handle_write_done(w.wr_id, Err(Error::PeerLost { node: w.to as usize, reason: "crashed".into() }));
            } else {
                self.writes[self.from * self.n + w.to as usize].push_back(w);
            }
        }
    }
}

impl Sim {
    fn new(opts: SimOptions) -> Result<Sim> {
        let mut nodes = Vec::new();
        for rank in 0..opts.nodes {
            nodes.push(Self::start_node(&opts, rank)?);
        }
        Self::around(opts, nodes)
    }

    /// Starts node `rank` afresh: a core over a new store holding its home keys.
    fn start_node(opts: &SimOptions, rank: usize) -> Result<SimNode> {
        let mut spec = TableSpec::new("sim", opts.keys, opts.lanes)
            .partitioned(opts.partitioning)
            .replicating(opts.replicated.clone())
            .with_updater(opts.updater.updater())
            .compressed(opts.codec)
            .cache_keys(opts.key_cache_min);
        if let Some(homes) = &opts.placement {
            if homes.len() as u64 != opts.keys {
                return Err(Error::Config(format!("a placement of {} keys for a table of {}", homes.len(), opts.keys)));
            }
            spec = spec.placed(Arc::new(crate::placement::Placement::new(opts.nodes, homes.clone())?));
        }
        let settings = Settings {
            relocation: opts.relocation,
            backups: if opts.backups { opts.backup_copies.max(1) } else { 0 },
            location_caches: opts.location_caches,
            max_message_bytes: 64 << 10,
            part_bytes: opts.part_bytes,
            small_operation_rows: opts.small_operation_rows,
            op_timeout_ns: u64::MAX / 4,
            loss_grace_ns: 200_000,
            shards: opts.shards,
            share_clocks: opts.max_delay.is_some(),
            first_clock: opts.first_clock,
        };
        let regions = Arc::new(SimRegistrar::default());
        let mut specs = vec![spec];
        if opts.dynamic_ids > 0 {
            specs.push(dynamic_ids::spec(opts));
        }
        let store = Arc::new(Store::new(rank, opts.nodes, &specs, 7, HugePages::Off, regions.clone())?);
        let core = Core::new(rank, opts.nodes, &specs, store, settings);
        let tx = core.transmit();
        Ok(SimNode { core, regions, tx, crashed: false, left: false, incarnation: 0 })
    }

    /// Builds the Sim around its started nodes.
    fn around(opts: SimOptions, nodes: Vec<SimNode>) -> Result<Sim> {
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
        let mut workers = Self::scripts(&opts, &mut rng, &nodes);
        let replica_sets = Self::replica_services(&opts, &mut rng, &nodes, &mut workers);
        let late = (0..workers.len()).map(|_| LateFrames::default()).collect();
        let workers_by_node = (0..opts.nodes).map(|node| (0..workers.len()).filter(|&w| workers[w].node == node).collect()).collect();
        Ok(Sim {
            frames: (0..opts.nodes * opts.nodes).map(|_| VecDeque::new()).collect(),
            writes: (0..opts.nodes * opts.nodes).map(|_| VecDeque::new()).collect(),
            write_dones: Vec::new(),
            workers,
            now: 1,
            trace: VecDeque::new(),
            failed_ops: 0,
            ops: 0,
            max_parts: 0,
            streamed_ops: 0,
            replication: (0..opts.nodes).map(|_| SimRounds::default()).collect(),
            replica_history: opts.replicated.iter().flat_map(|r| r.clone()).map(|k| (k, Vec::new(), Vec::new())).collect(),
            intent_grants: 0,
            syncs: SyncCounts::default(),
            dynamic_slots: Default::default(),
            slot_intents: vec![Default::default(); opts.nodes],
            replica_sets,
            replica_counts: ReplicaSetCounts::default(),
            intent_services: (0..if opts.declared_intents { opts.nodes } else { 0 }).map(|_| intent_rounds::SimIntentService::new()).collect(),
            declared: DeclaredIntentCounts::default(),
            slow_link: opts.slow_link.then(|| {
                let (from, to) = (rng.gen_range(0..opts.nodes), rng.gen_range(1..opts.nodes.max(2)));
                from * opts.nodes + (from + to) % opts.nodes
            }),
            late,
            workers_by_node,
            late_hand_overs: 0,
            unaware: Vec::new(),
            victim_answers: Default::default(),
            leave_asked_at: None,
            join_asked_at: None,
            floating: Vec::new(),
            rng,
            nodes,
            opts,
        })
    }

    fn scripts(opts: &SimOptions, rng: &mut ChaCha8Rng, nodes: &[SimNode]) -> Vec<SimWorker> {
        let mut next_lane = vec![1u32; opts.keys as usize];
        let mut next_tag = vec![1u32; opts.keys as usize];
        let mut workers = Vec::new();
        for (node, n) in nodes.iter().enumerate() {
            // A node that rejoins gets a second set of workers for its second incarnation.
            let incarnations = if opts.rejoin && Self::rejoiner_of(opts) == Some(node) { 2 } else { 1 };
            for (incarnation, w) in (0..incarnations).flat_map(|i| (0..opts.workers_per_node).map(move |w| (i, w))) {
                let mut script = VecDeque::new();
                let ops = if opts.leave == Some(node) || incarnation > 0 { opts.ops_per_worker / 2 } else { opts.ops_per_worker };
                for _ in 0..ops {
                    let count = rng.gen_range(opts.keys_per_op.0.max(1)..=opts.keys_per_op.1.max(opts.keys_per_op.0.max(1)));
                    // Large operations take a block of neighbouring keys (so they form runs) or
                    // scattered ones.
                    let keys: Vec<u64> = if count > 3 && rng.gen_bool(0.5) {
                        let start = rng.gen_range(0..opts.keys);
                        (0..count as u64).map(|i| (start + i) % opts.keys).collect()
                    } else {
                        (0..count).map(|_| rng.gen_range(0..opts.keys)).collect()
                    };
                    if opts.dynamic_ids > 0 && rng.gen_bool(0.3) {
                        if opts.intend_ids && rng.gen_bool(0.4) {
                            use crate::intent::IntentLevel;
                            let level = [IntentLevel::None, IntentLevel::Soon, IntentLevel::Now][rng.gen_range(0..3)];
                            // Slot keys of the dynamic table: mostly the first of a home's range,
                            // which its first ids take (a pool of ids spread over the homes uses
                            // few of each range).
                            let key = |rng: &mut ChaCha8Rng| {
                                if rng.gen_bool(0.8) {
                                    rng.gen_range(0..opts.nodes as u64) * opts.dynamic_ids + rng.gen_range(0..opts.dynamic_ids.min(4))
                                } else {
                                    rng.gen_range(0..opts.dynamic_ids * opts.nodes as u64)
                                }
                            };
                            let keys = (0..rng.gen_range(1..=3)).map(|_| key(rng)).collect();
                            script.push_back(ScriptOp::IntentIds { keys, level });
                            continue;
                        }
                        // Ids of the dynamic table, from a pool small enough that nodes race to
                        // create them.
                        let ids = (0..rng.gen_range(1..=5)).map(|_| dynamic_ids::id(rng.gen_range(0..opts.dynamic_ids))).collect();
                        script.push_back(ScriptOp::Assign { ids });
                        continue;
                    }
                    let replicated = |k: &u64| opts.replicated.iter().any(|r| r.contains(k));
                    if !opts.replicated.is_empty() && rng.gen_bool(0.4) {
                        // A replicated key: one-key pulls and pushes, each push a lane of its own.
                        let hot: Vec<u64> = opts.replicated.iter().flat_map(|r| r.clone()).collect();
                        let key = hot[rng.gen_range(0..hot.len())];
                        let lane = (rng.gen_bool(0.5) && (next_lane[key as usize] as usize) < opts.lanes - 1).then(|| {
                            next_lane[key as usize] += 1;
                            next_lane[key as usize] - 1
                        });
                        script.push_back(ScriptOp::Replicated { key, lane });
                        continue;
                    }
                    let mut keys: Vec<u64> = keys.into_iter().filter(|k| !replicated(k)).collect();
                    if keys.len() > opts.small_operation_rows {
                        // A streamed operation's repeats of a key may take effect in either
                        // order when the key arrives at or leaves this node between its parts
                        // (the exception on `Worker`'s consistency notes): the checker holds a
                        // call's rows to the call's order, so such calls name each key once.
                        let mut seen = crate::util::FastSet::default();
                        keys.retain(|&k| seen.insert(k));
                    }
                    if keys.is_empty() {
                        continue;
                    }
                    let asynchronous = rng.gen_bool(opts.async_share);
                    let roll = rng.gen_range(0..100);
                    let distinct = keys.iter().enumerate().all(|(i, k)| !keys[..i].contains(k));
                    let op = if roll < 5 {
                        ScriptOp::WaitAll
                    } else if roll < 14 && opts.replica_syncs && w == 0 && distinct && keys.iter().all(|&k| (next_lane[k as usize] as usize) < opts.lanes - 1) {
                        // As the intent service's rounds do, one at a time per node; after the
                        // worker's own operations completed (a replica's deltas hold pushes
                        // made before the round, which a sync must not overtake).
                        script.push_back(ScriptOp::WaitAll);
                        let lanes = keys.iter().map(|&k| {
                            rng.gen_bool(0.8).then(|| {
                                next_lane[k as usize] += 1;
                                next_lane[k as usize] - 1
                            })
                        });
                        ScriptOp::ReplicaSync { lanes: lanes.collect(), keys }
                    } else if roll < 17 && opts.relocation && opts.intents {
                        use crate::intent::IntentLevel;
                        let level = [IntentLevel::None, IntentLevel::Soon, IntentLevel::Now][rng.gen_range(0..3)];
                        // A replicate grant marks a key held here for a replica when it leaves
                        // (`Core::post_intent_go`): with run-time replicas, only their keys
                        // are intended, so that the others keep sequential consistency.
                        let keys = match &opts.run_time_replicas {
                            Some(r) => keys.into_iter().filter(|k| r.contains(k)).collect(),
                            None => keys,
                        };
                        if keys.is_empty() {
                            continue;
                        }
                        if opts.declared_intents {
                            ScriptOp::Declare { keys, start: rng.gen_range(0..6), len: rng.gen_range(1..10) }
                        } else {
                            ScriptOp::Intent { keys, level }
                        }
                    } else if roll < 27 && opts.relocation {
                        ScriptOp::Localize { keys, asynchronous, granted: false }
                    } else if roll < 33 && !keys.iter().any(|k| opts.run_time_replicas.as_ref().is_some_and(|r| r.contains(k))) {
                        let tags = keys.iter().map(|&k| {
                            next_tag[k as usize] += 1;
                            next_tag[k as usize] - 1
                        });
                        ScriptOp::Access { kind: AccessKind::Set, lanes_or_tags: tags.collect(), keys, asynchronous }
                    } else if roll < 66 && keys.iter().all(|&k| (next_lane[k as usize] as usize) + keys.len() < opts.lanes - 1) {
                        let lanes = keys.iter().map(|&k| {
                            next_lane[k as usize] += 1;
                            next_lane[k as usize] - 1
                        });
                        let lanes: Vec<u32> = lanes.collect();
                        // A push-pull's rows may be served in any order, so a key repeated in one
                        // would read the other row's push or not: only distinct keys are checkable.
                        let kind = if distinct && opts.push_pull > 0.0 && rng.gen_bool(opts.push_pull) { AccessKind::PushPull } else { AccessKind::Push };
                        ScriptOp::Access { kind, lanes_or_tags: lanes, keys, asynchronous }
                    } else {
                        ScriptOp::Access { kind: AccessKind::Pull, lanes_or_tags: Vec::new(), keys, asynchronous }
                    };
                    script.push_back(op);
                }
                for _ in 0..opts.clocks {
                    let at = rng.gen_range(0..=script.len());
                    script.insert(at, ScriptOp::AdvanceClock);
                    script.insert(at, ScriptOp::WaitAll);
                }
                script.push_back(ScriptOp::WaitAll);
                if incarnation == 0 {
                    n.core.clocks().lock().register(w as u16);
                }
                // A later incarnation's requester and buffer come from its own core when it starts.
                let mut worker = SimWorker::new(node, w as u16, n.core.requester(w as u16, 1), n.core.transmit(), script);
                worker.incarnation = incarnation as u8;
                if opts.evict_ids {
                    worker.pin = Some(n.core.pins().register());
                }
                workers.push(worker);
            }
        }
        workers
    }

    /// With run-time replicas, a service worker per node (after the node's others) whose
    /// script makes replicas, drops them and runs sync rounds at random (three times as many
    /// steps as a worker's operations, three in five of them sync rounds, so that rounds are
    /// often in flight while keys move) and ends by dropping them all.
    fn replica_services(opts: &SimOptions, rng: &mut ChaCha8Rng, nodes: &[SimNode], workers: &mut Vec<SimWorker>) -> Vec<SimReplicaSet> {
        let Some(range) = opts.run_time_replicas.clone().filter(|r| !r.is_empty()) else { return Vec::new() };
        let mut sets = Vec::new();
        for (node, n) in nodes.iter().enumerate() {
            let mut script = VecDeque::new();
            for _ in 0..opts.ops_per_worker * 3 {
                let count = rng.gen_range(1..=3);
                let keys = (0..count).map(|_| rng.gen_range(range.clone())).collect();
                script.push_back(match rng.gen_range(0..5) {
                    0 => ScriptOp::MakeReplicas { keys, granted: false },
                    1 => ScriptOp::DropReplicas { keys },
                    2 if rng.gen_bool(0.5) => ScriptOp::SyncReplicasNow,
                    _ => ScriptOp::SyncReplicas,
                });
                // The intent service's rounds, as often as its other steps.
                if opts.declared_intents {
                    script.push_back(ScriptOp::IntentService);
                }
            }
            script.push_back(ScriptOp::StopReplicas);
            // The service takes marks of keys wanted when they leave from its start.
            if let Some(d) = n.core.store().table(0).dynamic() {
                d.open_marks();
            }
            let index = opts.workers_per_node as u16;
            let mut requester = n.core.requester(index, 1);
            // As the service's worker: its pulls and pushes reach the owners.
            requester.bypass_replicas = true;
            sets.push(SimReplicaSet::new(workers.len()));
            workers.push(SimWorker::new(node, index, requester, n.core.transmit(), script));
        }
        sets
    }

    fn log(&mut self, line: String) {
        if self.trace.len() >= self.opts.trace_lines {
            self.trace.pop_front();
        }
        self.trace.push_back(format!("t={} {line}", self.now));
    }

    /// Worker `w`'s localize that `issued` says is pending goes in flight (a granted move's
    /// counts toward the service's outstanding moves).
    fn localize_in_flight(&mut self, w: usize, issued: Option<Issued>, asynchronous: bool, granted_move: bool) {
        if let Some(Issued::Pending { op, .. }) = issued {
            let first_event = self.workers[w].events.len();
            self.workers[w].in_flight.push(InFlight {
                op,
                kind: None,
                keys: Vec::new(),
                buffer: Vec::new(),
                first_event,
                asynchronous,
                service: false,
                granted_move,
                victim_reads: Vec::new(),
            });
        }
    }

    /// The moves homes granted a node (INTENT_GO) become localizes at the front of a worker's
    /// script, as the intent service would issue them: asynchronous, except with location
    /// caches. (The service's worker only localizes, so no access of its own can overtake
    /// one; a trainer's worker here could be overtaken by its own later accesses, which
    /// location caches allow for asynchronous operations — Lapse, Theorem 3 — so there it
    /// waits, which orders no less than the service does.)
    fn grant_intents(&mut self) {
        if !self.opts.intents && !self.opts.intend_ids {
            return;
        }
        for node in 0..self.opts.nodes {
            if self.nodes[node].crashed || !self.nodes[node].core.intent_go_waiting() {
                continue;
            }
            // Declared intents: the grants wait for the service's schedule to take them up.
            if self.opts.declared_intents {
                continue;
            }
            let granted = self.nodes[node].core.take_intent_go();
            let Some(w) = (0..self.workers.len()).find(|&w| self.workers[w].node == node) else { continue };
            for (table, grant, keys) in granted {
                if table == dynamic_ids::TABLE {
                    self.grant_slot_keys(node, w, grant, keys);
                    continue;
                }
                // Replicas are kept by the intent service with ordinary pushes and pulls, which
                // the protocol cannot tell from a trainer's; the simulation runs the moves.
                if grant == crate::protocol::Grant::Replicate {
                    self.grant_replicas(node, keys);
                    continue;
                }
                self.log(format!("node {node} granted {keys:?}: worker {w} localizes them"));
                self.intent_grants += keys.len();
                let asynchronous = !self.opts.location_caches;
                self.workers[w].script.push_front(ScriptOp::Localize { keys, asynchronous, granted: true });
            }
        }
    }

    fn runnable(&self, w: usize) -> bool {
        let worker = &self.workers[w];
        let node = &self.nodes[worker.node];
        if node.crashed || worker.incarnation != node.incarnation || (node.incarnation > 0 && !node.core.join_state().1) {
            return false;
        }
        if worker.streaming.is_some() || !worker.inbox.is_empty() {
            return true;
        }
        if let Some(sync) = &worker.sync {
            return sync.acknowledged();
        }
        if let Some(wait) = &worker.assigning {
            return wait.answered();
        }
        if worker.holding.is_some() {
            return true;
        }
        if let Some(keys) = &worker.localize_waits_for {
            return self.replica_sets.get(worker.node).is_none_or(|s| s.marks.carried(0, keys).is_empty());
        }
        if let Some(target) = worker.clock_target {
            let core = &self.nodes[worker.node].core;
            return core.clocks().lock().cluster_min(core.directory()) >= target;
        }
        if worker.blocked() {
            return false;
        }
        if worker.waiting_all {
            return worker.in_flight.is_empty() && worker.awaiting_backup.is_empty();
        }
        match worker.script.front() {
            Some(ScriptOp::StopReplicas) => self.may_stop_replicas(w),
            Some(_) => true,
            None => false,
        }
    }

    fn run(&mut self) -> Result<SimReport, String> {
        let mut steps = 0usize;
        let mut timers_fired = false;
        loop {
            steps += 1;
            if steps > 3_000_000 {
                return Err("simulation did not terminate".into());
            }
            if let Some((node, at)) = self.opts.crash
                && Some(steps)
                    == if self.opts.crash_while_joining {
                        self.join_asked_at.map(|asked| asked + at)
                    } else if self.opts.crash_while_leaving {
                        self.leave_asked_at.map(|asked| asked + at)
                    } else {
                        Some(at)
                    }
                && !self.nodes[node].crashed
            {
                self.crash(node)?;
                if let Some(also) = self.opts.crash_also.filter(|&also| !self.nodes[also].crashed) {
                    self.crash(also)?;
                }
            }
            self.now += self.rng.gen_range(1..2000);
            self.grant_intents();
            self.settle_backups();
            if self.leave_when_done()? && self.leave_asked_at.is_none() {
                self.leave_asked_at = Some(steps);
            }
            if self.rejoin_when_gone()? {
                self.join_asked_at = Some(steps);
            }
            // A joining node that gave its join up stops, as `Node::join` returns its error:
            // the members take it for lost.
            for node in 0..self.nodes.len() {
                if !self.nodes[node].crashed
                    && let Some(why) = self.nodes[node].core.join_given_up()
                {
                    self.log(format!("node {node} gives its join up and stops: {why}"));
                    self.crash(node)?;
                }
            }
            self.take_sync_acks();
            self.take_assignments();
            self.take_replica_set_acks()?;
            let runnable: Vec<usize> = (0..self.workers.len()).filter(|&w| self.runnable(w)).collect();
            // A slow link's frames wait while others can go, nine times in ten.
            let mut channels: Vec<usize> = (0..self.frames.len()).filter(|&c| !self.frames[c].is_empty()).collect();
            if let Some(slow) = self.slow_link
                && channels.len() > 1
                && channels.contains(&slow)
                && self.rng.gen_bool(0.9)
            {
                channels.retain(|&c| c != slow);
            }
            let write_channels: Vec<usize> = (0..self.writes.len()).filter(|&c| !self.writes[c].is_empty()).collect();
            let mut choices = Vec::new();
            if !runnable.is_empty() {
                choices.extend([0, 0]);
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
            let rounds_ready = self.rounds_ready();
            if !rounds_ready.is_empty() {
                choices.push(4);
            }
            let backups_ready = self.backups_ready();
            if !backups_ready.is_empty() {
                choices.push(7);
            }
            let graces_ended = self.graces_ended();
            if !graces_ended.is_empty() {
                choices.push(8);
            }
            // A thread that waits for a CPU waits while much else happens.
            let late: Vec<usize> = (0..self.late.len()).filter(|&w| !self.late[w].frames.is_empty()).collect();
            if !late.is_empty() && (choices.is_empty() || self.rng.gen_range(0..4) == 0) {
                choices.push(5);
            }
            // A survivor may go on for a while before it learns of a crash.
            if !self.unaware.is_empty() && (choices.is_empty() || self.rng.gen_range(0..3) == 0) {
                choices.push(6);
            }
            if choices.is_empty() {
                // Only timers can make progress now (a crash left relocations to give up).
                let waiting = (0..self.workers.len()).any(|w| !self.worker_crashed(w) && !self.workers[w].in_flight.is_empty());
                if waiting && self.opts.crash.is_some() && !timers_fired {
                    timers_fired = true;
                    self.now += 1_000_000;
                    self.log("timers fire".into());
                    for node in 0..self.opts.nodes {
                        if !self.nodes[node].crashed {
                            self.node_event(node, |step, _, _| Ok(step.handle_timeout()))?;
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
                    let frame = Bytes::from(self.frames[c].pop_front().expect("non-empty"));
                    let (from, to) = (c / self.opts.nodes, c % self.opts.nodes);
                    self.log(format!("deliver {from}->{to}: {}", describe_frame(&frame)));
                    self.note_victim_answers(from, to, &frame);
                    if let Err(e) = self.node_event(to, |step, at, item| step.handle_frame(from as u16, &frame, at, item)) {
                        return Err(format!("node {to} rejected a frame from {from}: {e}"));
                    }
                }
                2 => {
                    let c = write_channels[self.rng.gen_range(0..write_channels.len())];
                    let write = self.writes[c].pop_front().expect("non-empty");
                    let (from, to) = (c / self.opts.nodes, c % self.opts.nodes);
                    self.land(from, to, write)?;
                }
                4 => {
                    let node = rounds_ready[self.rng.gen_range(0..rounds_ready.len())];
                    self.round_step(node)?;
                }
                6 => self.tell_of_crash()?,
                7 => {
                    let node = backups_ready[self.rng.gen_range(0..backups_ready.len())];
                    self.backup_round(node)?;
                }
                8 => {
                    let node = graces_ended[self.rng.gen_range(0..graces_ended.len())];
                    self.log(format!("node {node} answers the eviction rounds whose grace ended"));
                    self.node_event(node, |step, _, _| {
                        step.answer_evictions();
                        Ok(Progress::Done)
                    })?;
                }
                5 => {
                    let w = late[self.rng.gen_range(0..late.len())];
                    self.log(format!("worker {w}@{} hands its late frames over", self.workers[w].node));
                    self.flush_late(w);
                }
                _ => {
                    let i = self.rng.gen_range(0..self.write_dones.len());
                    let (node, wr_id) = self.write_dones.swap_remove(i);
                    self.log(format!("write {wr_id} of node {node} completes"));
                    self.node_event(node, |step, _, _| Ok(step.handle_write_done(wr_id, Ok(()))))?;
                }
            }
            if self.rng.gen_range(0..50) == 0 {
                let node = self.rng.gen_range(0..self.opts.nodes);
                if !self.nodes[node].crashed {
                    self.node_event(node, |step, _, _| Ok(step.handle_timeout()))?;
                }
            }
            // With intents on slot keys, more often: a round must fall in the while between a
            // node's intent ending and its replica's end to test what holds the replica's id.
            if self.opts.evict_ids && !runnable.is_empty() && self.rng.gen_range(0..if self.opts.intend_ids { 6 } else { 20 }) == 0 {
                self.begin_eviction_round()?;
            }
            if self.opts.evict_ids {
                self.check_id_mappings()?;
            }
            if self.opts.intend_ids {
                self.check_slots_away()?;
            }
        }
    }

    /// Runs an event on node `node`'s own buffer the way the runtime does: fresh steps until
    /// the handler is done, each step's frames and writes handed over before it ends, then the
    /// deliveries routed.
    fn node_event(&mut self, node: usize, mut event: impl FnMut(&mut Step<'_, '_>, usize, usize) -> Result<Progress>) -> Result<(), String> {
        let crashed: Vec<bool> = self.nodes.iter().map(|n| n.crashed).collect();
        let n = self.opts.nodes;
        let now = self.now;
        let SimNode { core, tx, .. } = &mut self.nodes[node];
        let mut wires = Wires {
            from: node,
            n,
            crashed,
            frames: &mut self.frames,
            writes: &mut self.writes,
            late: &mut self.late,
            node_workers: &self.workers_by_node[node],
            worker: None,
            defer: false,
        };
        let outcome = drive(core, tx, now, &mut wires, &mut event);
        self.route_deliveries(node, None);
        outcome.map_err(|e| e.to_string())
    }

    /// Moves worker `w`'s late frames onto their links.
    fn flush_late(&mut self, w: usize) {
        let crashed: Vec<bool> = self.nodes.iter().map(|n| n.crashed).collect();
        self.late[w].flush(&mut self.frames, &crashed, self.opts.nodes);
    }

    /// Moves deliveries out of a buffer (node `node`'s own, or worker `worker`'s) into inboxes.
    fn route_deliveries(&mut self, node: usize, worker: Option<usize>) {
        loop {
            let next = match worker {
                Some(w) => self.workers[w].tx.poll_delivery(),
                None => self.nodes[node].tx.poll_delivery(),
            };
            let Some((target, d)) = next else { break };
            let incarnation = self.nodes[node].incarnation;
            for w in &mut self.workers {
                if w.node == node && w.incarnation == incarnation && (target == ALL_WORKERS || w.requester.worker() == target) {
                    w.inbox.push_back(d.clone());
                }
            }
        }
    }

    /// Whether worker `w` ended with a crash of its node: its node is crashed now, or (in a run
    /// without a leave, where an incarnation ends only by crashing) a fresh node took the rank
    /// since.
    fn worker_crashed(&self, w: usize) -> bool {
        let worker = &self.workers[w];
        let node = &self.nodes[worker.node];
        node.crashed || (self.opts.leave.is_none() && worker.incarnation < node.incarnation)
    }

    fn crash(&mut self, node: usize) -> Result<(), String> {
        self.log(format!("node {node} crashes"));
        self.nodes[node].crashed = true;
        let n = self.opts.nodes;
        for other in 0..n {
            self.frames[node * n + other].clear();
            self.frames[other * n + node].clear();
            // Writes this node posted complete with an error (their slots are freed below).
            let lost: Vec<SlotWrite> = self.writes[other * n + node].drain(..).collect();
            self.writes[node * n + other].clear();
            for w in lost {
                if !self.nodes[other].crashed {
                    self.node_event(other, |step, _, _| Ok(step.handle_write_done(w.wr_id, Err(Error::PeerLost { node, reason: "crashed".into() }))))?;
                }
            }
        }
        self.write_dones.retain(|(m, _)| *m != node);
        // The survivors learn of the crash one by one, later (`tell_of_crash`).
        self.unaware.retain(|&(survivor, _)| survivor != node);
        let survivors: Vec<usize> = (0..n).filter(|&other| other != node && !self.nodes[other].crashed).collect();
        self.unaware.extend(survivors.into_iter().map(|survivor| (survivor, node)));
        Ok(())
    }

    /// Tells a survivor not yet told of a crash (a pair picked at random) that the node is lost.
    fn tell_of_crash(&mut self) -> Result<(), String> {
        if self.unaware.is_empty() {
            return Ok(());
        }
        let (node, crashed) = self.unaware.swap_remove(self.rng.gen_range(0..self.unaware.len()));
        self.log(format!("node {node} learns that node {crashed} crashed"));
        self.node_event(node, |step, _, _| Ok(step.handle_peer_lost(crashed as u16, "crashed in the simulation")))
    }

    fn land(&mut self, from: usize, to: usize, w: SlotWrite) -> Result<(), String> {
        self.log(format!("write {} lands {from}->{to} (imm {})", w.wr_id, w.imm));
        let src = self.nodes[from].core.store().table(w.table).slot_ptr(w.slot);
        let target = self.registered_range(to, w.remote, w.len)?;
        // SAFETY: the source slot stays allocated until its write completes (the completion is
        // delivered after this), the target range was bounds-checked against the registered
        // region, and the simulation is single-threaded, so no other access runs meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(src, target as *mut u8, w.len) };
        self.node_event(to, |step, at, _| Ok(step.handle_writes_landed(&[Landed { imm: w.imm, len: w.len }], at)))?;
        self.write_dones.push((from, w.wr_id));
        Ok(())
    }

    /// The address of `len` bytes at `remote` in a region node `node` registered, as a one-sided
    /// operation would reach them; an error if the region is unknown or too short.
    fn registered_range(&self, node: usize, remote: RemoteAddr, len: usize) -> Result<usize, String> {
        let regions = self.nodes[node].regions.regions.lock();
        let &(base, size) = regions.get(remote.region as usize).ok_or(format!("node {node} has no region {}", remote.region))?;
        if remote.addr as usize + len > size {
            return Err(format!("{len} bytes at {} overflow node {node}'s region of {size}", remote.addr));
        }
        Ok(base + remote.addr as usize)
    }

    /// Nodes whose replication can take a step: a round is due (while workers still work), the
    /// round under way has all its acknowledgements, or (with [`SimOptions::round_give_ups`])
    /// it has waited long enough to be given up.
    fn rounds_ready(&mut self) -> Vec<usize> {
        if self.opts.replicated.is_empty() || self.opts.nodes < 2 || self.opts.crash.is_some() {
            return Vec::new();
        }
        let working = self.workers.iter().any(|w| !w.script.is_empty() || !w.in_flight.is_empty() || w.streaming.is_some());
        let mut ready = Vec::new();
        for node in 0..self.opts.nodes {
            self.take_round_acks(node);
            let r = &self.replication[node];
            match &r.under_way {
                None if working && self.now >= r.next_at => ready.push(node),
                Some(round) if round.acknowledged() => ready.push(node),
                Some(round) if self.opts.round_give_ups && working && self.now > round.began() + self.opts.round_period => ready.push(node),
                _ => {}
            }
        }
        ready
    }

    /// Hands node `node`'s round under way the acknowledgements posted to its mailbox.
    fn take_round_acks(&mut self, node: usize) {
        let acks = self.nodes[node].core.replication().mailbox().take();
        let r = &mut self.replication[node];
        if let Some(round) = &mut r.under_way {
            for ack in acks {
                round.handle_ack(ack);
            }
        }
    }

    /// Node `node`'s next replication step: begin a round and ship its deltas, or, with every
    /// acknowledgement in (or the round given up), refresh from the homes' images (read from
    /// their stores, as a one-sided read would) and end it.
    fn round_step(&mut self, node: usize) -> Result<(), String> {
        let now = self.now;
        let Some(mut round) = self.replication[node].under_way.take() else {
            let mut round = self.replication[node].rounds.begin(now);
            let homes: Vec<u16> = (0..self.opts.nodes as u16).filter(|&h| h as usize != node).collect();
            let mut sent = Vec::new();
            self.node_event(node, |step, _, _| {
                sent = step.ship_replica_deltas(round.number(), &homes, round.full());
                Ok(Progress::Done)
            })?;
            self.log(format!("node {node} ships round {} ({} messages{})", round.number(), sent.len(), if round.full() { ", full images" } else { "" }));
            round.shipped(sent);
            self.replication[node].under_way = Some(round);
            return Ok(());
        };
        if !round.acknowledged() {
            self.log(format!("node {node} gives up round {} waiting for node(s) {:?}", round.number(), round.waiting_for()));
            round.give_up(self.opts.round_period / 1_000_000);
            self.replication[node].given_up += 1;
        }
        for read in round.take_reads() {
            let store = self.nodes[read.home as usize].core.store();
            let Some(bytes) = store.snapshot_bytes(read.table, node, read.image.positions.len()) else {
                return Err(format!("node {} acknowledged round {} of node {node} without an image", read.home, round.number()));
            };
            let (_, torn) = crate::replication::apply_image(self.nodes[node].core.store(), read.home, read.table, &read.image.positions, &bytes);
            if torn > 0 {
                return Err(format!("node {node} read {torn} torn slot images from node {}", read.home));
            }
            round.handle_read(read.table, Ok(()));
        }
        let (number, began) = (round.number(), round.began());
        let r = &mut self.replication[node];
        let end = r.rounds.end(round);
        if end.complete {
            r.done.push((began, now));
        }
        r.next_at = now + self.opts.round_period;
        self.log(format!("node {node} refreshed its replicas (round {number}{})", if end.complete { "" } else { ", given up" }));
        Ok(())
    }

    /// After the workers finished: two rounds on every node with every frame delivered, so
    /// that every replica holds every push; checks that it does, exactly once.
    fn converge_replicas(&mut self) -> Result<(), String> {
        if self.opts.replicated.is_empty() || self.opts.nodes < 2 || self.opts.crash.is_some() {
            return Ok(());
        }
        for _ in 0..2 {
            for node in 0..self.opts.nodes {
                // A round still under way completes first.
                while self.replication[node].under_way.is_some() {
                    self.deliver_all()?;
                    self.take_round_acks(node);
                    if !self.replication[node].under_way.as_ref().is_some_and(|r| r.acknowledged()) {
                        return Err(format!("node {node}'s round never got all its acknowledgements"));
                    }
                    self.round_step(node)?;
                }
                self.replication[node].next_at = 0;
                self.round_step(node)?;
            }
            self.deliver_all()?;
            for node in 0..self.opts.nodes {
                self.take_round_acks(node);
                if !self.replication[node].under_way.as_ref().is_some_and(|r| r.acknowledged()) {
                    return Err(format!("node {node}'s last round never got all its acknowledgements"));
                }
                self.round_step(node)?;
            }
        }
        let lanes = self.opts.lanes;
        for (key, pushes, _) in &self.replica_history {
            let mut expected = vec![0.0f32; lanes];
            for p in pushes {
                expected[p.lane as usize] = 1.0;
            }
            for (rank, n) in self.nodes.iter().enumerate() {
                let mut value = vec![0.0; lanes];
                n.core.store().lock(0, *key).slot().ok_or(format!("node {rank} holds no slot for replicated key {key}"))?.read(&mut value);
                if value != expected {
                    return Err(format!("node {rank}'s copy of replicated key {key} is {value:?}, not every push once"));
                }
            }
        }
        Ok(())
    }

    /// Delivers every frame in flight, in per-pair order.
    fn deliver_all(&mut self) -> Result<(), String> {
        for w in 0..self.late.len() {
            self.flush_late(w);
        }
        while let Some(c) = (0..self.frames.len()).find(|&c| !self.frames[c].is_empty()) {
            let frame = Bytes::from(self.frames[c].pop_front().expect("non-empty"));
            let (from, to) = (c / self.opts.nodes, c % self.opts.nodes);
            if let Err(e) = self.node_event(to, |step, at, item| step.handle_frame(from as u16, &frame, at, item)) {
                return Err(format!("node {to} rejected a frame from {from}: {e}"));
            }
        }
        Ok(())
    }

    fn worker_step(&mut self, w: usize) -> Result<(), String> {
        let node = self.workers[w].node;
        if let Some(s) = self.workers[w].streaming.take() {
            self.log(format!("worker {w}@{node} encodes more parts of op {}", s.op));
            let mut buffer = self.workers[w].in_flight.iter_mut().find(|f| f.op == s.op && !f.asynchronous).map(|f| std::mem::take(&mut f.buffer));
            let more =
                self.worker_event(w, |step, req| Ok(step.continue_issue(req, s.op, &s.keys, &s.input, buffer.as_deref_mut().filter(|b| !b.is_empty()))))?;
            if let Some(b) = buffer
                && let Some(f) = self.workers[w].in_flight.iter_mut().find(|f| f.op == s.op)
            {
                f.buffer = b;
            }
            self.note_parts(w, s.op);
            if more == Some(true) {
                self.workers[w].streaming = Some(s);
            }
            return self.collect(w);
        }
        if let Some(d) = self.workers[w].inbox.pop_front() {
            let worker = &mut self.workers[w];
            let dir = self.nodes[node].core.directory();
            let waited = worker.in_flight.iter_mut().find(|f| !f.asynchronous && f.kind.is_some_and(AccessKind::returns_values));
            let caller = waited.map(|f| (f.op, f.buffer.as_mut_slice()));
            if let Some(fault) = worker.requester.handle(d, dir, caller) {
                return Err(format!("worker {w} saw a protocol fault from node {}: {}", fault.peer, fault.error));
            }
            return self.collect(w);
        }
        if self.workers[w].sync.as_ref().is_some_and(SyncWait::acknowledged) {
            return self.finish_replica_sync(w);
        }
        if self.workers[w].assigning.as_ref().is_some_and(dynamic_ids::AssignWait::answered) {
            return self.finish_assign(w);
        }
        if self.workers[w].holding.is_some() {
            return self.use_slot_keys(w);
        }
        if self.workers[w].clock_target.take().is_some() {
            let now = self.now;
            self.log(format!("worker {w}@{node} starts clock {}", self.workers[w].clocks.started.len()));
            self.workers[w].clocks.started.push(now);
            return Ok(());
        }
        if self.workers[w].waiting_all {
            self.workers[w].waiting_all = false;
            return Ok(());
        }
        if self.workers[w].localize_waits_for.take().is_some() {
            return Ok(());
        }
        let op = self.workers[w].script.pop_front().expect("runnable");
        self.advance_intent_clock(w);
        let lanes = self.opts.lanes;
        match op {
            ScriptOp::WaitAll => {
                self.log(format!("worker {w} waits for its operations"));
                self.workers[w].waiting_all = true;
            }
            ScriptOp::AdvanceClock => {
                let now = self.now;
                self.workers[w].clocks.finished.push(now);
                let index = self.workers[w].index;
                let advanced = self.worker_event(w, |step, _| Ok(step.clock_advance(index)))?;
                // Counted from the first clock: a restored cluster's workers go on from it.
                let expected = self.opts.first_clock + self.workers[w].clocks.finished.len() as u64;
                if advanced.is_some_and(|completed| completed != expected) {
                    return Err(format!("worker {w}@{node} completed its clock {expected} by the count, but the clocks say {advanced:?}"));
                }
                let completed = advanced.unwrap_or(0);
                self.log(format!("worker {w}@{node} completed clock {}", completed.saturating_sub(1)));
                match self.opts.max_delay {
                    Some(tau) => self.workers[w].clock_target = Some(completed.saturating_sub(tau)),
                    None => self.workers[w].clocks.started.push(now),
                }
            }
            ScriptOp::Replicated { key, lane } => {
                self.ops += 1;
                self.log(format!("worker {w}@{node} {} replicated key {key}", if lane.is_some() { "push" } else { "pull" }));
                let (kind, input, target) = match lane {
                    Some(l) => (AccessKind::Push, push_update(l, lanes), None),
                    None => (AccessKind::Pull, Vec::new(), Some(vec![0.0; lanes])),
                };
                let issued = self.worker_event(w, |step, req| {
                    let target = target.clone().map_or(PullTarget::None, PullTarget::Owned);
                    step.issue_access(req, kind, 0, &[key], &input, target, None)
                })?;
                let Some(Issued::Done(values)) = issued else {
                    return Err(format!("replicated key {key} was not served by node {node}'s replica"));
                };
                let now = self.now;
                let Some(entry) = self.replica_history.iter_mut().find(|(k, _, _)| *k == key) else {
                    return Err(format!("key {key} is not replicated"));
                };
                match (lane, values) {
                    (Some(lane), _) => entry.1.push(TimedPush { node: node as u16, lane, issued: now, acked: now }),
                    (None, Some(value)) => entry.2.push(TimedPull { node: node as u16, start: now, end: now, value }),
                    (None, None) => return Err("a pull returned no values".into()),
                }
            }
            op @ (ScriptOp::MakeReplicas { .. }
            | ScriptOp::DropReplicas { .. }
            | ScriptOp::SyncReplicas
            | ScriptOp::SyncReplicasNow
            | ScriptOp::StopReplicas) => {
                self.service_step(w, op)?;
            }
            ScriptOp::PushDrain { token, keys, deltas } => self.issue_drain_push(w, token, keys, deltas)?,
            ScriptOp::Assign { ids } => {
                self.ops += 1;
                self.assign_ids(w, ids)?;
            }
            ScriptOp::ReplicaSync { keys, lanes } => {
                self.ops += 1;
                self.send_replica_sync(w, keys, lanes)?;
            }
            ScriptOp::Declare { keys, start, len } => self.declare_intent(w, keys, start, len),
            ScriptOp::IntentService => self.intent_service_step(w)?,
            ScriptOp::IntentIds { keys, level } => self.intend_slot_keys(w, keys, level)?,
            ScriptOp::DropSlotReplicas { keys } => self.drop_slot_replicas(w, &keys),
            ScriptOp::LocalizeIds { keys } => {
                self.ops += 1;
                self.log(format!("worker {w}@{node} localize slot keys {keys:?} granted"));
                let issued = self.worker_event(w, |step, req| step.issue_localize(req, dynamic_ids::TABLE, &keys, true, None))?;
                self.localize_in_flight(w, issued, true, false);
            }
            ScriptOp::Intent { keys, level } => {
                self.log(format!("worker {w}@{node} intent {level:?} on {keys:?}"));
                self.worker_event(w, |step, _| {
                    step.signal_intent(0, &keys, level);
                    Ok(())
                })?;
            }
            ScriptOp::Localize { keys, asynchronous, granted } => {
                if self.localize_waits_for_sync(w, &keys, granted) {
                    self.workers[w].script.push_front(ScriptOp::Localize { keys, asynchronous, granted });
                    return Ok(());
                }
                self.ops += 1;
                self.log(format!("worker {w}@{node} localize {keys:?}{}{}", if asynchronous { " async" } else { "" }, if granted { " granted" } else { "" }));
                let issued = self.worker_event(w, |step, req| step.issue_localize(req, 0, &keys, granted, None))?;
                if !granted
                    && let Some(marked) = self.workers[w].localize_marked.take()
                    && let Some(set) = self.replica_sets.get(node)
                {
                    set.marks.end_localize(0, &marked);
                }
                self.localize_in_flight(w, issued, asynchronous, granted);
            }
            ScriptOp::Access { kind, keys, lanes_or_tags, asynchronous } => {
                self.ops += 1;
                self.log(format!(
                    "worker {w}@{node} {kind:?} {} keys {:?}{}",
                    keys.len(),
                    &keys[..keys.len().min(8)],
                    if asynchronous { " async" } else { "" }
                ));
                let mut input = Vec::new();
                let scale = self.opts.updater.scale();
                for (i, _) in keys.iter().enumerate() {
                    match kind {
                        AccessKind::Push | AccessKind::PushPull => input.extend(push_update(lanes_or_tags[i], lanes).into_iter().map(|x| x * scale)),
                        AccessKind::Set => input.extend(set_value(lanes_or_tags[i], lanes)),
                        AccessKind::Pull => {}
                    }
                }
                let first_event = self.workers[w].events.len();
                for (i, &key) in keys.iter().enumerate() {
                    let e = match kind {
                        AccessKind::Push | AccessKind::PushPull => Event::Push { lane: lanes_or_tags[i] },
                        AccessKind::Set => Event::Set { tag: lanes_or_tags[i] },
                        AccessKind::Pull => Event::Pull { value: Vec::new() },
                    };
                    self.workers[w].events.push((key, e));
                }
                // A push-pull's read follows its push in the key's program order (the owner
                // applies both under one latch).
                let first_pull = if kind == AccessKind::PushPull {
                    for &key in &keys {
                        self.workers[w].events.push((key, Event::Pull { value: Vec::new() }));
                    }
                    first_event + keys.len()
                } else {
                    first_event
                };
                let recorded = self.workers[w].events.len();
                self.pad_events(w, u64::MAX);
                let pull = kind.returns_values();
                let mut buffer = vec![0.0; if pull { keys.len() * lanes } else { 0 }];
                let victim_reads = self.victim_reads(w, &keys, false);
                let issued = self.worker_event(w, |step, req| {
                    let target = match (pull, asynchronous) {
                        (false, _) => PullTarget::None,
                        (true, true) => PullTarget::Owned(vec![0.0; keys.len() * lanes]),
                        (true, false) => PullTarget::Caller(&mut buffer),
                    };
                    step.issue_access(req, kind, 0, &keys, &input, target, None)
                })?;
                let streamed = matches!(issued, Some(Issued::Pending { more: true, .. }));
                self.note_served(w, &keys, first_event, streamed);
                match issued {
                    None => self.drop_events(w, first_event, recorded),
                    Some(Issued::Done(owned)) => {
                        self.note_completed(w, first_event, recorded);
                        if kind != AccessKind::Pull {
                            self.await_backup(w, first_event, recorded, !asynchronous);
                        }
                        if pull {
                            let values = owned.unwrap_or(buffer);
                            self.record_pull(w, first_pull, &values, &victim_reads);
                        }
                    }
                    Some(Issued::Pending { op, more }) => {
                        self.note_parts(w, op);
                        if more {
                            self.streamed_ops += 1;
                            self.workers[w].streaming = Some(Streaming { op, keys: keys.clone(), input });
                        }
                        self.workers[w].in_flight.push(InFlight {
                            op,
                            kind: Some(kind),
                            keys,
                            buffer,
                            first_event,
                            asynchronous,
                            service: false,
                            granted_move: false,
                            victim_reads,
                        });
                    }
                }
            }
        }
        self.collect(w)
    }

    /// Runs an event on worker `w`'s own buffer and routes its deliveries.
    fn worker_event<T>(&mut self, w: usize, mut event: impl FnMut(&mut Step<'_, '_>, &mut Requester) -> Result<T>) -> Result<Option<T>, String> {
        let node = self.workers[w].node;
        let crashed: Vec<bool> = self.nodes.iter().map(|n| n.crashed).collect();
        let n = self.opts.nodes;
        let now = self.now;
        let defer = self.opts.late_hand_over && self.rng.gen_range(0..2) == 0;
        let late_before = self.late[w].frames.len();
        let core = &self.nodes[node].core;
        let worker = &mut self.workers[w];
        let mut wires = Wires {
            from: node,
            n,
            crashed,
            frames: &mut self.frames,
            writes: &mut self.writes,
            late: &mut self.late,
            node_workers: &self.workers_by_node[node],
            worker: Some(w),
            defer,
        };
        let mut result = None;
        let outcome = drive(core, &mut worker.tx, now, &mut wires, &mut |step, _, _| {
            result = Some(event(step, &mut worker.requester));
            Ok(Progress::Done)
        });
        if late_before == 0 && !self.late[w].frames.is_empty() {
            self.late_hand_overs += 1;
            self.log(format!("worker {w}@{node} hands {} frames over late", self.late[w].frames.len()));
        }
        self.route_deliveries(node, Some(w));
        outcome.map_err(|e| e.to_string())?;
        match result {
            Some(Ok(t)) => Ok(Some(t)),
            Some(Err(e)) if self.opts.crash.is_some() && is_loss(&e) => {
                self.failed_ops += 1;
                Ok(None)
            }
            Some(Err(e)) => Err(format!("submit failed: {e}")),
            None => Err("the step did not run".into()),
        }
    }

    fn note_parts(&mut self, w: usize, op: OpId) {
        if let Some(parts) = self.workers[w].requester.parts_of(op) {
            self.max_parts = self.max_parts.max(parts);
        }
    }

    /// Collects the results of the worker's completed operations.
    fn collect(&mut self, w: usize) -> Result<(), String> {
        let lanes = self.opts.lanes;
        let mut i = 0;
        while i < self.workers[w].in_flight.len() {
            let op = self.workers[w].in_flight[i].op;
            let Some(result) = self.workers[w].requester.take(op) else {
                i += 1;
                continue;
            };
            let f = self.workers[w].in_flight.swap_remove(i);
            self.log(format!(
                "op {op:#x} of worker {w} completes: {}",
                match &result {
                    Ok(_) => "ok".to_string(),
                    Err(e) => format!("error: {e}"),
                }
            ));
            if f.service {
                self.service_op_done(w, op, result)?;
                continue;
            }
            let events = f.events();
            if let Some((from, to)) = events {
                self.note_completed(w, from, to);
            }
            match result {
                Ok(values) => {
                    if let Some((from, to)) = events.filter(|_| f.kind != Some(AccessKind::Pull)) {
                        self.await_backup(w, from, to, !f.asynchronous);
                    }
                    if let Some(kind) = f.kind.filter(|k| k.returns_values()) {
                        let values = if f.asynchronous { values } else { f.buffer };
                        if values.len() != f.keys.len() * lanes {
                            return Err(format!("pull {op:#x} returned {} values for {} keys", values.len(), f.keys.len()));
                        }
                        let first_pull = if kind == AccessKind::PushPull { f.first_event + f.keys.len() } else { f.first_event };
                        let victim_reads =
                            if self.victim_answers.contains(&(self.workers[w].node, op)) { vec![true; f.keys.len()] } else { f.victim_reads.clone() };
                        self.record_pull(w, first_pull, &values, &victim_reads);
                    }
                }
                Err(e) => {
                    if self.opts.crash.is_none() || !is_loss(&e) {
                        return Err(format!("operation {op:#x} of worker {w} failed: {e}"));
                    }
                    self.failed_ops += 1;
                    if let Some((from, to)) = events {
                        self.drop_events(w, from, to);
                    }
                }
            }
        }
        Ok(())
    }

    /// Worker `w`'s events `from..to` belong to an operation that failed: its outcome is
    /// unknown, so they leave the worker's history — its reads are dropped, and its pushes and
    /// sets float (see [`Sim::floating`]).
    fn drop_events(&mut self, w: usize, from: usize, to: usize) {
        for i in from..to {
            let (key, event) = &mut self.workers[w].events[i];
            let (key, event) = (*key, std::mem::replace(event, Event::Pull { value: Vec::new() }));
            if !matches!(event, Event::Pull { .. }) {
                self.floating.push((key, event));
            }
        }
    }

    /// Gives worker `w`'s events recorded since the last call their issue time (and a completion
    /// time, `u64::MAX` until known).
    fn pad_events(&mut self, w: usize, completed: u64) {
        let (now, recorded) = (self.now, self.workers[w].events.len());
        self.workers[w].times.resize(recorded, (now, completed));
        self.workers[w].served.resize(recorded, Served::Unknown);
    }

    /// Worker `w`'s events `from..to` completed now.
    fn note_completed(&mut self, w: usize, from: usize, to: usize) {
        let now = self.now;
        for t in &mut self.workers[w].times[from..to] {
            t.1 = now;
        }
    }

    /// Records a pull's values; those of the keys `victim_served` marks (see
    /// [`InFlight::victim_reads`]) stay unrecorded, and so do those the node to crash serves
    /// now: a part that waited out a membership change went where the keys were served then.
    fn record_pull(&mut self, w: usize, first_event: usize, values: &[f32], victim_served: &[bool]) {
        let lanes = self.opts.lanes;
        let keys: Vec<u64> = self.workers[w].events[first_event..].iter().take(values.len() / lanes.max(1)).map(|(key, _)| *key).collect();
        let served_now = if victim_served.is_empty() { Vec::new() } else { self.victim_reads(w, &keys, true) };
        for (i, chunk) in values.chunks(lanes).enumerate() {
            let (_, event) = &mut self.workers[w].events[first_event + i];
            if victim_served.get(i).copied().unwrap_or(false) || served_now.get(i).copied().unwrap_or(false) {
                continue;
            }
            *event = Event::Pull { value: chunk.to_vec() };
        }
    }

    fn finish(&mut self, steps: usize) -> Result<SimReport, String> {
        // The staleness rule is checked on the rounds the run itself made.
        let rounds: Vec<Vec<(u64, u64)>> = self.replication.iter().map(|r| r.done.clone()).collect();
        let home_of = |key: u64| self.nodes[0].core.directory().home(0, key);
        let replica_violation = self
            .replica_history
            .iter()
            .find_map(|(key, pushes, pulls)| check_replica_rounds(*key, home_of(*key), pushes, pulls, &rounds, self.opts.lanes).err());
        let replica_events = self.replica_history.iter().map(|(_, p, q)| p.len() + q.len()).sum();
        self.converge_replicas()?;
        for (i, w) in self.workers.iter().enumerate() {
            if !self.worker_crashed(i)
                && (!w.in_flight.is_empty() || !w.script.is_empty() || w.streaming.is_some() || w.clock_target.is_some() || w.sync.is_some())
            {
                let ops: Vec<String> = w.in_flight.iter().map(|f| format!("{:#x} {:?} of keys {:?}", f.op, f.kind, f.keys)).collect();
                return Err(format!(
                    "worker {i} is stuck: {} operations in flight ({}), {} left in its script",
                    w.in_flight.len(),
                    ops.join(", "),
                    w.script.len()
                ));
            }
        }
        // A crashed node's worker may have been waiting for a replica sync.
        for w in 0..self.workers.len() {
            if self.worker_crashed(w) {
                self.float_sync(w);
            }
        }
        self.float_unacknowledged();
        let mut history = History::new(self.workers.len());
        let run_time_replica = |key: &u64| self.opts.run_time_replicas.as_ref().is_some_and(|r| r.contains(key));
        for (key, e) in self.floating.iter().filter(|(key, _)| !run_time_replica(key)) {
            history.record_floating(*key, e.clone());
        }
        for (i, w) in self.workers.iter().enumerate() {
            for (key, e) in &w.events {
                // Keys with run-time replicas are checked against the replica guarantee.
                if matches!(e, Event::Pull { value } if value.is_empty()) || run_time_replica(key) {
                    continue;
                }
                history.record(i, *key, e.clone());
            }
        }
        let lanes = self.opts.lanes;
        let mut finals = std::collections::BTreeMap::new();
        let mut slots_in_use = Vec::new();
        for (rank, node) in self.nodes.iter().enumerate() {
            if node.crashed || node.left {
                slots_in_use.push(0);
                continue;
            }
            let pending: usize = self.workers.iter().filter(|w| w.node == rank).map(|w| w.requester.pending()).sum();
            if (pending != 0 || node.core.keys_in_transit() != 0) && self.opts.crash.is_none() {
                return Err(format!("node {rank} ended with {pending} pending operations and {} keys in transit", node.core.keys_in_transit()));
            }
            let t = node.core.store().table(0);
            let held = (0..self.opts.keys).filter(|&k| t.slot_of(k).is_some()).count();
            let (live, _) = t.slot_usage();
            if self.opts.crash.is_none() && live != held {
                return Err(format!("node {rank} holds {held} keys but has {live} slots in use (a slot leaked)"));
            }
            slots_in_use.push(live);
        }
        if self.opts.crash.is_none() {
            for key in (0..self.opts.keys).filter(|k| !self.opts.replicated.iter().any(|r| r.contains(k))) {
                let holders: Vec<usize> =
                    (0..self.nodes.len()).filter(|&n| !self.nodes[n].left && self.nodes[n].core.store().table(0).slot_of(key).is_some()).collect();
                if holders.len() != 1 {
                    return Err(format!("key {key} is held by nodes {holders:?}"));
                }
                let owner = holders[0];
                if let Some(rejoined) = Self::rejoiner_of(&self.opts)
                    && self.nodes[owner].core.directory().tables()[0].partitioner.home(key) == rejoined
                    && owner != rejoined
                {
                    return Err(format!("key {key} of node {rejoined}, which joined again, is held by node {owner}"));
                }
                let mut value = vec![0.0; lanes];
                let store = self.nodes[owner].core.store();
                let guard = store.lock(0, key);
                let slot = guard.slot().expect("held");
                slot.read(&mut value);
                if self.opts.updater == SimUpdater::Counting {
                    let pushes = self.workers.iter().flat_map(|w| &w.events).filter(|(k, e)| *k == key && matches!(e, Event::Push { .. })).count();
                    if slot.state() != [pushes as f32] {
                        return Err(format!("key {key}: its updater's state counted {:?} pushes, the workers made {pushes}", slot.state()));
                    }
                }
                drop(guard);
                if run_time_replica(&key) {
                    finals.insert(key, value);
                } else {
                    history.record_after_all(key, Event::Pull { value });
                }
                for node in self.nodes.iter().filter(|n| !n.left) {
                    if let Some(recorded) = node.core.directory().owner_of(0, key)
                        && recorded as usize != owner
                    {
                        return Err(format!("home of key {key} records node {recorded} but node {owner} holds it"));
                    }
                }
            }
        }
        if self.opts.crash.is_some() && self.opts.backups {
            self.final_reads_after_crash(&mut history)?;
        }
        if self.opts.crash.is_none() && self.opts.leave.is_none() && self.opts.backups && self.opts.relocation {
            self.check_images_follow_keys()?;
        }
        if self.opts.dynamic_ids > 0 {
            self.check_dynamic_ids()?;
        }
        if let Some(node) = self.opts.leave.filter(|&n| !self.nodes[n].left && self.nodes[n].incarnation == 0) {
            return Err(format!("node {node} never left ({:?}: asked, left)", self.nodes[node].core.leave_state()));
        }
        if let Some(node) = self.opts.leave.filter(|&n| self.nodes[n].core.backup_counters().requests_after_ready() > 0) {
            return Err(format!(
                "node {node} got {} requests as it left from peers after their READY",
                self.nodes[node].core.backup_counters().requests_after_ready()
            ));
        }
        if let Some(node) = Self::rejoiner_of(&self.opts).filter(|&n| self.opts.leave.is_none() && self.nodes[n].incarnation == 0) {
            return Err(format!("node {node} crashed and no fresh node took its rank"));
        }
        if let Some(node) = Self::rejoiner_of(&self.opts).filter(|&n| !self.nodes[n].crashed && !self.nodes[n].core.join_state().1) {
            return Err(format!(
                "node {node} never joined again (incarnation {}, {:?}: asked, joined)",
                self.nodes[node].incarnation,
                self.nodes[node].core.join_state()
            ));
        }
        let traces: Vec<ClockTrace> = self.workers.iter().map(|w| w.clocks.clone()).collect();
        let clock_violation = if self.opts.clocks > 0 { check_bounded_delay(&traces, self.opts.max_delay).err() } else { None };
        let run_time_violation = if self.opts.crash.is_none() { self.check_run_time_replicas(&finals) } else { self.check_run_time_replicas_at_most_once() };
        let stats = self.nodes.iter().map(|n| n.core.stats()).collect();
        Ok(SimReport {
            clock_violation,
            clocks: traces,
            history,
            steps,
            stats,
            failed_ops: self.failed_ops,
            ops: self.ops,
            max_parts: self.max_parts,
            streamed_ops: self.streamed_ops,
            slots_in_use,
            trace: self.trace.iter().cloned().collect(),
            rounds: rounds.iter().map(Vec::len).sum(),
            rounds_given_up: self.replication.iter().map(|r| r.given_up).sum(),
            replica_events,
            replica_violation,
            intent_grants: self.intent_grants,
            replica_syncs: self.syncs,
            run_time_replicas: self.replica_set_counts(),
            declared_intents: self.declared,
            run_time_violation,
            late_hand_overs: self.late_hand_overs,
        })
    }
}

/// The runtime's event loop, with the simulated fabric as the destination.
fn drive(
    core: &Core,
    tx: &mut Transmit,
    now: u64,
    wires: &mut Wires<'_>,
    event: &mut impl FnMut(&mut Step<'_, '_>, usize, usize) -> Result<Progress>,
) -> Result<()> {
    let (mut at, mut item) = (0, 0);
    loop {
        let mut step = core.step(tx, now);
        let progress = event(&mut step, at, item);
        wires.hand_over(&mut step);
        if step.handed_over() {
            wires.hand_over(&mut step);
        }
        drop(step);
        match progress? {
            Progress::Done => return Ok(()),
            Progress::Yield { at: a, item: i } => (at, item) = (a, i),
        }
    }
}

/// What a worker step that queues REPLICA_SYNCs on a fresh step returns: a yield (the step
/// held other shards) cannot happen there, so it is an error.
fn queued(progress: Progress) -> Result<()> {
    match progress {
        Progress::Done => Ok(()),
        Progress::Yield { .. } => Err(Error::Protocol("a fresh step could not take the shards of its REPLICA_SYNCs".into())),
    }
}

fn describe_frame(frame: &[u8]) -> String {
    use crate::protocol::wire::{self, msg};
    let describe = |b: &[u8]| -> String {
        match b[0] {
            msg::ACCESS => match wire::Access::decode(b, |_| Some(0)).or_else(|_| wire::Access::decode(b, |_| Some(1))) {
                Ok(a) => {
                    let keys: Vec<u64> = (0..a.count.min(6)).map(|i| a.key(i)).collect();
                    let kind = ["?", "pull", "push", "set", "push-pull"].get(a.kind as usize).copied().unwrap_or("?");
                    format!("access[{kind} op {}:{:#x}/{} {} keys {keys:?} flags {}]", a.origin, a.op, a.part, a.count, a.flags)
                }
                Err(_) => "access".into(),
            },
            msg::RESPONSE => {
                let op = wire::op_of(b).unwrap_or(0);
                let part = b.get(16..20).map_or(0, |p| u32::from_le_bytes(p.try_into().unwrap_or([0; 4])));
                format!("response[op {op:#x}/{part}]")
            }
            msg::LOCALIZE | msg::RELOCATE | msg::GIVE_BACK => match wire::Move::decode(b, usize::MAX) {
                Ok(m) => {
                    let items: Vec<String> = (0..m.count.min(6)).map(|i| format!("{}(r{:#x})", m.item(i).key, m.item(i).resv)).collect();
                    let name = match b[0] {
                        msg::LOCALIZE => "localize",
                        msg::RELOCATE => "relocate",
                        _ => "give-back",
                    };
                    format!("{name}[to {} {} items {}]", m.new_owner, m.count, items.join(","))
                }
                Err(_) => "move?".into(),
            },
            msg::FAILURE => "failure".into(),
            msg::LOCALIZE_FAILED => "localize-failed".into(),
            msg::BARRIER => "barrier".into(),
            msg::BARRIER_RELEASE => "release".into(),
            msg::BARRIER_FAILED => "barrier-failed".into(),
            msg::BACKUP => {
                let round = b.get(4..8).map_or(0, |r| u32::from_le_bytes(r.try_into().unwrap_or([0; 4])));
                let count = b.get(8..12).map_or(0, |r| u32::from_le_bytes(r.try_into().unwrap_or([0; 4])));
                format!("backup[round {round} {count} images{}]", if b.get(1) == Some(&1) { " last" } else { "" })
            }
            msg::BACKUP_ACK => format!("backup-ack[round {}]", b.get(4..8).map_or(0, |r| u32::from_le_bytes(r.try_into().unwrap_or([0; 4])))),
            msg::PEER_LOST => match wire::decode_peer_lost(b) {
                Ok((node, incarnation, _)) => format!("peer-lost[{node}/{incarnation}]"),
                Err(_) => "peer-lost[bad]".into(),
            },
            msg::JOIN_IMAGES => {
                let count = b.get(8..12).map_or(0, |r| u32::from_le_bytes(r.try_into().unwrap_or([0; 4])));
                format!("join-images[{count}{}]", if b.get(1) == Some(&1) { " last" } else { "" })
            }
            ty @ (msg::LEAVE_ASK
            | msg::LEAVE_BEGIN
            | msg::LEAVE_READY
            | msg::LEFT
            | msg::LEAVE_KNOWN
            | msg::JOIN_ASK
            | msg::JOIN_WELCOME
            | msg::JOIN_READY
            | msg::JOIN_HANDED
            | msg::JOINED
            | msg::JOIN_ACK
            | msg::JOIN_ABANDONED
            | msg::JOIN_SETTLED) => {
                let names = [
                    "leave-ask",
                    "leave-begin",
                    "leave-ready",
                    "left",
                    "barrier-passed",
                    "leave-known",
                    "join-ask",
                    "join-welcome",
                    "join-ready",
                    "join-images",
                    "join-handed",
                    "joined",
                    "join-ack",
                    "join-abandoned",
                    "join-settled",
                ];
                let name = names.get((ty - msg::LEAVE_ASK) as usize).copied().unwrap_or("?");
                let node = b.get(2..4).map_or(0, |r| u16::from_le_bytes(r.try_into().unwrap_or([0; 2])));
                format!("{name}[{node:#x}]")
            }
            ty @ (msg::CENSUS_FLUSH | msg::CENSUS_DONE) => {
                let epoch = b.get(4..8).map_or(0, |r| u32::from_le_bytes(r.try_into().unwrap_or([0; 4])));
                format!("{}[{epoch}]", if ty == msg::CENSUS_FLUSH { "census-flush" } else { "census-done" })
            }
            msg::CENSUS => {
                let count = b.get(8..12).map_or(0, |r| u32::from_le_bytes(r.try_into().unwrap_or([0; 4])));
                format!("census[{count}{}]", if b.get(1) == Some(&1) { " last" } else { "" })
            }
            _ => "?".into(),
        }
    };
    wire::Messages::new(frame).map(|m| m.map(describe).unwrap_or_else(|_| "?".into())).collect::<Vec<_>>().join(",")
}
