//! The intent service: a node's background thread that acts on its workers' intents.
//!
//! Each communication round (AdaPM, Section 4.2) it
//!
//! 1. updates each declaring worker's clock-rate estimate from the clocks it completed since the
//!    last round ([`ActionTiming::round`]) and computes its horizon;
//! 2. moves the windows along ([`IntentTable::advance`]): taken once their start is within
//!    the horizon, started once the worker reaches it, dropped once it reaches their end;
//! 3. tells the homes of the keys whose level changed ([`IntentLevel`]: needed now, soon, or
//!    no longer) with INTENT, one message per home, table and level
//!    (`crate::protocol::IntentHomes` decides who gets a key);
//! 4. starts relocating the keys the homes said this node should take (INTENT_GO, move), if it
//!    still intends them and they are not here, with one asynchronous `localize` per table
//!    through a worker of its own, and records for the relocations that completed whether each
//!    key landed before its window started (and how many clocks before);
//! 5. makes replicas of the keys the homes said several nodes intend (INTENT_GO, replicate),
//!    drops those whose intent ended here, and every half of the staleness bound starts a sync
//!    round of the replicas (see [`super::replicas`]); what is in flight completes in later
//!    rounds.
//!
//! What is decided is in state machines with no thread, clock or lock: steps 1–3 and what
//! becomes of the grants in [`IntentRounds`], the replicas in [`crate::intent::ReplicaSet`], and
//! *when* — the rounds' cadence, the rests and what ends them, what workers wait for around
//! their barriers — in [`ServiceSchedule`]. This driver holds each behind a lock, reads the
//! clock, sleeps when the schedule says rest, wakes the service when an event answers that it
//! must, and does the I/O through a worker of its own. The thread starts with the node's first
//! intent and stops before the node finalizes.
//!
//! [`ActionTiming::round`]: crate::intent::ActionTiming::round
//! [`IntentTable::advance`]: crate::intent::IntentTable::advance

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::replicas::ReplicaDriver;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::intent::{GrantsTaken, IntentLevel, IntentRounds, LateCause, LevelChanges, Nanos, Next, ServiceSchedule, SyncMarks};
use crate::protocol::IntentHomes;
use crate::protocol::LateCounts;
use crate::runtime::NodeInner;
use crate::table::Table;
use crate::worker::Worker;

/// Localize operations the service keeps in flight at most before it waits for them.
const MAX_IN_FLIGHT: usize = 64;

/// How many round times a worker leaving a barrier waits at most for the service to take up
/// the grants that arrived meanwhile ([`IntentService::take_up_grants`]); past it, the worker
/// goes on and its accesses find the keys where they are.
const TAKE_UP_ROUNDS: u32 = 4;

/// A node's intents and the thread acting on them.
pub(crate) struct IntentService {
    /// The intents and what the rounds decide. Held while a round computes its changes, never
    /// while the schedule is.
    rounds: Mutex<IntentRounds>,
    /// When the service acts and what workers wait for; held only for a few field updates, so
    /// that a worker advancing its clock never waits for a round in progress.
    schedule: Mutex<ServiceSchedule>,
    /// The service thread rests on it (with the schedule).
    wake: Condvar,
    /// Workers waiting for a round told, a take-up or the turn to tell a round rest on it (with
    /// the schedule); notified whenever one of those changes.
    signalled: Condvar,
    /// The run-time replicas kept here, and their operations in flight.
    replicas: Mutex<ReplicaDriver>,
    /// Which replicas' deltas are on their way, and which keys a worker's `localize` is about
    /// to move here (shared with the replica set).
    marks: Arc<SyncMarks>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The origin of the schedule's clock.
    origin: Instant,
}

/// The part of a round its caller tells the homes: the changes, and whether windows are left.
struct RoundChanges {
    changes: LevelChanges,
    windows: bool,
}

impl IntentService {
    /// A service for a node configured by `config` (its thread starts with the first intent).
    pub fn new(config: &Config) -> IntentService {
        let nanos = |d: Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        let marks = Arc::new(SyncMarks::default());
        IntentService {
            rounds: Mutex::new(IntentRounds::default()),
            schedule: Mutex::new(ServiceSchedule::new(nanos(config.intent.round), nanos(config.staleness / 2))),
            wake: Condvar::new(),
            signalled: Condvar::new(),
            replicas: Mutex::new(ReplicaDriver::new(marks.clone())),
            marks,
            thread: Mutex::new(None),
            origin: Instant::now(),
        }
    }

    /// Now on the schedule's clock.
    fn now(&self) -> Nanos {
        self.origin.elapsed().as_nanos().min(u64::MAX as u128) as u64
    }

    /// `at` on the schedule's clock as an instant.
    fn instant(&self, at: Nanos) -> Instant {
        self.origin + Duration::from_nanos(at)
    }

    /// Wakes the resting service if `needed` (an event's answer; the schedule is held, so the
    /// wake-up cannot fall between the service's look at the schedule and its sleep).
    fn wake_if(&self, needed: bool) {
        if needed {
            self.wake.notify_all();
        }
    }

    /// Worker `worker`, in clock `clock`, will need `keys` of `table` in clocks `window`. Keys
    /// the node cannot move (replicated keys) are left out. Starts the service thread with the
    /// first intent.
    pub fn declare(self: &Arc<Self>, node: &Arc<NodeInner>, worker: u16, clock: u64, table: Table, keys: &[u64], window: std::ops::Range<u64>) -> Result<()> {
        let store = node.core.store();
        let replicas = store.table(table.id).replicas();
        let movable = keys.iter().copied().filter(|&key| replicas.is_none_or(|r| r.ordinal(key).is_none()));
        let added = self.rounds.lock().declare(&node.config.intent, worker, table.id, movable, window);
        node.core.intent_counters().note_declared(added);
        let mut schedule = self.schedule.lock();
        self.wake_if(schedule.declare(worker, clock));
        if !schedule.start(self.now()) {
            return Ok(());
        }
        drop(schedule);
        // The service's worker is outside barriers and finalize's count of live workers.
        let own = Worker::unclocked(node.clone(), self.clone());
        let (service, service_node) = (self.clone(), node.clone());
        let started = std::thread::Builder::new().name(format!("ferry{}-intent", node.config.rank)).spawn(move || service.run(&service_node, own));
        match started {
            Ok(handle) => {
                *self.thread.lock() = Some(handle);
                Ok(())
            }
            Err(e) => {
                self.schedule.lock().not_started();
                Err(Error::Transport(format!("cannot start the intent thread: {e}")))
            }
        }
    }

    /// The node's sync marks: a worker's `localize` of keys with run-time replicas here marks
    /// them, and waits for the sync rounds that carry their deltas.
    pub fn marks(&self) -> &SyncMarks {
        &self.marks
    }

    /// The node's sync marks, shared (tests drive replica sets of their own on them).
    #[cfg(test)]
    pub(crate) fn marks_handle(&self) -> Arc<SyncMarks> {
        self.marks.clone()
    }

    /// Whether the service thread runs (it takes replicas' deltas in sync rounds).
    pub fn is_running(&self) -> bool {
        self.schedule.lock().is_running()
    }

    /// Worker `worker` is in clock `clock` now. The service is woken only if it rests waiting
    /// for a worker to advance ([`ServiceSchedule::note_clock`]).
    pub fn note_clock(&self, worker: u16, clock: u64) {
        let mut schedule = self.schedule.lock();
        self.wake_if(schedule.note_clock(worker, clock));
    }

    /// Worker `worker` left: its intents end.
    pub fn forget_worker(&self, worker: u16) {
        self.rounds.lock().forget_worker(worker);
        let mut schedule = self.schedule.lock();
        self.wake_if(schedule.forget_worker(worker));
    }

    /// Of `away`, keys an access of worker `worker` in clock `clock` found neither here nor
    /// replicated here, those the worker declared intent for now (late accesses), by cause.
    /// A key whose home has not answered, as far as the service knows, is told apart by
    /// whether a grant for it waits in `homes` for the service to take it up.
    pub fn count_late(&self, homes: &Mutex<IntentHomes>, table: u16, away: &[u64], worker: u16, clock: u64) -> LateCounts {
        let mut late = LateCounts::default();
        let mut unanswered = Vec::new();
        {
            let mut rounds = self.rounds.lock();
            for &key in away {
                match rounds.table.note_late(table, key, worker, clock) {
                    Some(LateCause::Unanswered) => unanswered.push(key),
                    Some(cause) => late.add(cause),
                    None => {}
                }
            }
        }
        if !unanswered.is_empty() {
            // One pass over the waiting grants (usually none: the service takes them every
            // round), then a lookup per key.
            let mut waiting = homes.lock().waiting_grants(table);
            waiting.sort_unstable();
            for key in unanswered {
                late.add(if waiting.binary_search(&key).is_ok() { LateCause::Untaken } else { LateCause::Unanswered });
            }
        }
        late
    }

    /// A sync round of the run-time replicas through `worker` (around a barrier): their deltas
    /// reach the owners, their values are refreshed. First waits (at most the operation
    /// timeout) until the service has no sync round in flight and no dropped replica drains, so
    /// that every delta taken before this call has reached its owner, and until no key with a
    /// replica here is on its way here (its delta reaches the key when it lands). It waits
    /// without holding the replica set, so the service goes on meanwhile (it runs a round every
    /// round time while replicas are kept); it fails at once instead while a node is lost.
    /// Nothing to do without replicas.
    pub fn sync_replicas(&self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        let deadline = Instant::now() + node.config.op_timeout;
        // While rounds take longer than the sync period (a slow fabric, an emulated host), the
        // service starts each one as the last ends, and a waiter that only looks now and then
        // would never see the replicas quiet: so it holds the service's rounds off.
        let _holding_off = HoldOff::new(&self.schedule);
        loop {
            {
                let mut replicas = self.replicas.lock();
                if replicas.quiet() {
                    replicas.adopt_kept(node);
                    if replicas.is_empty() {
                        return Ok(());
                    }
                }
                // Checked with the set held through the round, so the service starts no move
                // meanwhile. A worker of this node not yet in the barrier may localize a key:
                // its delta stays for the landing, which the last worker's round waits for.
                if replicas.quiet() && !replicas.replicas_arriving(node) {
                    worker.bypass_replicas(true);
                    let outcome = replicas.sync_now(node, worker);
                    worker.bypass_replicas(false);
                    return outcome;
                }
            }
            // A barrier fails while a node is lost (`Barriers::enter`), and what this waits for
            // may wait for that node for good — a key with a replica here whose value was on
            // its way from it never lands: fail now, as the barrier would.
            if let Some((peer, reason)) = node.core.directory().any_lost() {
                return Err(Error::PeerLost { node: peer as usize, reason });
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: "the intent service's replica operations, and keys with replicas here to land,",
                    millis: node.config.op_timeout.as_millis() as u64,
                    nodes: Vec::new(),
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Waits (at most the operation timeout) until a round that started after this call has
    /// told the homes every change of this node's levels — in particular the windows that ended
    /// at the workers' current clocks. A worker calls this before a barrier, so that a key it is
    /// done with is released before the barrier lets the key's next user start: the home then
    /// sees the next user need the key after this node stopped needing it, and moves it rather
    /// than replicating it (see [`crate::protocol::IntentHomes`]). Nothing to do without the
    /// service, or when nothing happened since the last round that has told the homes. Without
    /// replicas here, `worker` runs that round itself ([`IntentService::signal_here`]).
    pub fn signal_levels(&self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        if !self.is_running() || self.signal_here(node, worker) {
            return Ok(());
        }
        let mut schedule = self.schedule.lock();
        let Some((started, wake)) = schedule.want_round() else { return Ok(()) };
        self.wake_if(wake);
        let deadline = Instant::now() + node.config.op_timeout;
        while !schedule.told_since(started) {
            if schedule.stopped() || node.stopping.load(std::sync::atomic::Ordering::Acquire) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: "the intent service's round before a barrier",
                    millis: node.config.op_timeout.as_millis() as u64,
                    nodes: Vec::new(),
                });
            }
            // Woken when a round was told; the bound is a safety net against a service that
            // stops without one.
            self.signalled.wait_for(&mut schedule, Duration::from_millis(10));
        }
        Ok(())
    }

    /// [`IntentService::signal_levels`] in the calling worker's thread, when this node keeps
    /// no replicas and none is being made: the worker computes the round's changes and tells
    /// the homes itself, instead of waking the service and waiting to be woken in turn — two
    /// hand-overs between threads on busy cores, which took 0.2 ms of a 0.3 ms wait in MF,
    /// twice per epoch. The replica set stays locked meanwhile, so the service makes no
    /// replica whose intent this round could end (a replica's drop pushes its delta through
    /// the service's worker, which completes it in later rounds). Returns false, having
    /// changed nothing, when there are replicas: the service's round then drops them.
    fn signal_here(&self, node: &NodeInner, worker: &mut Worker) -> bool {
        // The turn to tell a round first (the service may be telling one: wait for it), then
        // the replica set, then the intents: the service's rounds take them in that order too.
        {
            let mut schedule = self.schedule.lock();
            while !schedule.claim_round() {
                if schedule.stopped() {
                    return true;
                }
                self.signalled.wait_for(&mut schedule, Duration::from_millis(10));
            }
        }
        let mut replicas = self.replicas.lock();
        replicas.adopt_kept(node);
        if replicas.busy() {
            self.give_back_turn();
            return false;
        }
        let clocks = {
            let mut schedule = self.schedule.lock();
            // No worker advanced, declared or left since the last round (rounds are not in
            // progress while the turn is held): nothing to tell.
            schedule.has_news().then(|| schedule.begin_round().0)
        };
        let Some(clocks) = clocks else {
            self.give_back_turn();
            return true;
        };
        let changes = self.compute_round(&clocks);
        // On a shutdown the barrier that follows fails.
        self.tell_changes(node, worker, changes, false);
        true
    }

    /// Gives the turn to tell a round back unused.
    fn give_back_turn(&self) {
        let mut schedule = self.schedule.lock();
        let wake = schedule.release_round();
        self.wake_if(wake);
        self.signalled.notify_all();
    }

    /// A worker left a barrier: if grants the homes sent while the workers were in it still
    /// wait for the service (the moves and replicas of the keys whose windows start now), the
    /// worker gives its core to the service until it has taken them up — started the moves
    /// and the replicas — at most [`TAKE_UP_ROUNDS`] round times. Otherwise the worker's first
    /// accesses, made at once, find those keys still remote and are late (cause `Untaken`):
    /// on two cores with a node per core, the woken service may not run before the worker
    /// has made hundreds of accesses. After the take-up, an access to a key on its way here
    /// waits for it locally instead of going to the node it is leaving.
    pub fn take_up_grants(&self, node: &NodeInner) {
        let mut schedule = self.schedule.lock();
        let Some(target) = schedule.take_up_target(node.core.intent_go_waiting()) else { return };
        self.wake_if(schedule.grants_arrived());
        let deadline = Instant::now() + node.config.intent.round * TAKE_UP_ROUNDS;
        while !schedule.taken_up(target) {
            if schedule.stopped() || node.stopping.load(std::sync::atomic::Ordering::Acquire) || Instant::now() >= deadline {
                return;
            }
            self.signalled.wait_until(&mut schedule, deadline);
        }
    }

    /// Holds the relocations intent makes on this node (for a checkpoint's cut): no grant is
    /// taken up until [`IntentService::release_moves`], and this waits until every relocation
    /// the service started has landed (at most `node`'s operation timeout).
    pub fn hold_moves(&self, node: &NodeInner) -> Result<()> {
        let mut schedule = self.schedule.lock();
        self.wake_if(schedule.hold_moves());
        let deadline = Instant::now() + node.config.op_timeout;
        while !schedule.moves_settled() {
            if schedule.stopped() || node.stopping.load(std::sync::atomic::Ordering::Acquire) {
                return Err(Error::ShutDown);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout { what: "holding intent's relocations", millis: node.config.op_timeout.as_millis() as u64, nodes: Vec::new() });
            }
            self.signalled.wait_until(&mut schedule, deadline);
        }
        Ok(())
    }

    /// Ends [`IntentService::hold_moves`]: the grants that waited are taken up.
    pub fn release_moves(&self, node: &NodeInner) {
        let mut schedule = self.schedule.lock();
        self.wake_if(schedule.release_moves(node.core.intent_go_waiting()));
    }

    /// Whether relocations are held and settled, or the service never ran (no key of this
    /// node's is moved by intent): a checkpoint's cut may be taken.
    pub fn at_rest(&self) -> bool {
        let schedule = self.schedule.lock();
        !schedule.is_running() || schedule.moves_settled()
    }

    /// Stops the service thread and waits for it (its worker is dropped with it).
    pub fn stop(&self) {
        {
            let mut schedule = self.schedule.lock();
            schedule.stop();
            self.wake.notify_all();
            self.signalled.notify_all();
        }
        let handle = self.thread.lock().take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }

    fn stopped(&self, node: &NodeInner) -> bool {
        node.stopping.load(std::sync::atomic::Ordering::Acquire) || self.schedule.lock().stopped()
    }

    /// The service thread; its replicas are dropped (their deltas pushed) when it stops.
    fn run(&self, node: &Arc<NodeInner>, mut own: Worker) {
        own.bypass_replicas(true);
        // Departing keys may stay as replicas while this thread adopts them (`drop_all` closes).
        for t in node.core.store().tables() {
            if let Some(d) = t.dynamic() {
                d.open_marks();
            }
        }
        self.serve(node, &mut own);
        if let Err(e) = self.replicas.lock().drop_all(node, &mut own) {
            tracing::warn!(node = node.config.rank, error = %e, "the intent service could not send its replicas' last pushes");
        }
    }

    /// The service's loop: asks the schedule what to do, does it, reports back.
    fn serve(&self, node: &Arc<NodeInner>, own: &mut Worker) {
        let mut in_flight: Vec<InFlight> = Vec::new();
        loop {
            if node.stopping.load(std::sync::atomic::Ordering::Acquire) {
                return;
            }
            match self.next(node) {
                Next::Stop => return,
                Next::Round { clocks } => {
                    let changes = self.compute_round(&clocks);
                    if !self.tell_changes(node, own, changes, true) {
                        return;
                    }
                }
                Next::Act => {
                    if !self.act(node, own, &mut in_flight) {
                        return;
                    }
                    let now = self.now();
                    let mut schedule = self.schedule.lock();
                    schedule.acted(now, in_flight.is_empty());
                    if schedule.moves_settled() {
                        // A node holding relocations for a checkpoint waits for this.
                        self.signalled.notify_all();
                    }
                }
                Next::Rest { .. } => unreachable!("the service rests inside IntentService::next"),
            }
        }
    }

    /// What the schedule says to do next; rests (releasing the schedule) as long as it says
    /// rest, until the time it names or a wake-up.
    fn next(&self, node: &NodeInner) -> Next {
        let mut schedule = self.schedule.lock();
        loop {
            // Grants are posted by the frame handler, which then takes the schedule to wake the
            // service (`GrantListener::grants_waiting`): either this look sees them, or that
            // wake-up comes after the service started waiting.
            match schedule.next(self.now(), node.core.intent_go_waiting()) {
                Next::Rest { until } => {
                    let until = self.instant(until);
                    if Instant::now() < until {
                        self.wake.wait_until(&mut schedule, until);
                    }
                }
                next => return next,
            }
        }
    }

    /// Steps 1–2 of a round at the workers' `clocks` (the caller holds the turn to tell it):
    /// the workers' horizons, the windows moved along, and the level changes the homes must
    /// learn.
    fn compute_round(&self, clocks: &std::collections::BTreeMap<u16, u64>) -> RoundChanges {
        let mut rounds = self.rounds.lock();
        let changes = rounds.round(clocks);
        RoundChanges { changes, windows: !rounds.is_empty() }
    }

    /// Step 3 of a round, through `own` (with the turn to tell it held): tells the homes
    /// `changes`, dropping the replicas of keys whose intent ended first if `drop_replicas` (a
    /// caller that holds the replica set, empty, passes false), then gives the turn back and
    /// wakes the workers waiting for the round. Returns false when the node shuts down.
    fn tell_changes(&self, node: &NodeInner, own: &mut Worker, changes: RoundChanges, drop_replicas: bool) -> bool {
        let RoundChanges { changes, windows } = changes;
        let windows_moved = changes.windows_moved;
        let told = self.tell_homes_changes(node, own, changes, drop_replicas);
        let mut schedule = self.schedule.lock();
        let wake = schedule.round_told(windows, windows_moved);
        self.wake_if(wake);
        self.signalled.notify_all();
        told
    }

    fn tell_homes_changes(&self, node: &NodeInner, own: &mut Worker, changes: LevelChanges, drop_replicas: bool) -> bool {
        let counters = node.core.intent_counters();
        counters.note_round();
        // Ends first (`None` sorts first): a key this node stops needing may be the one
        // another node waits for. Its replica, if any, ends with the intent.
        for ((level, table), keys) in changes.levels {
            if drop_replicas
                && level == IntentLevel::None
                && let Err(e) = self.replicas.lock().drop_keys(node, own, table, &keys)
            {
                if self.stopped(node) {
                    return false;
                }
                tracing::warn!(node = node.config.rank, error = %e, "the intent service could not send a dropped replica's pushes");
            }
            if !Self::tell_homes(node, own, table, &keys, &[level]) {
                return false;
            }
        }
        // Asked again: the home forgets this node's intent on the keys and learns it anew,
        // so it grants again what the node needs (one connection: the two arrive in order).
        for ((level, table), keys) in changes.reasks {
            counters.note_reasked(keys.len() as u64);
            if !Self::tell_homes(node, own, table, &keys, &[IntentLevel::None, level]) {
                return false;
            }
        }
        true
    }

    /// Tells the homes of `keys` of `table` each of `levels` in turn; returns false when the
    /// node shuts down (a home that cannot be reached is logged: the next change or re-ask
    /// tells it again).
    fn tell_homes(node: &NodeInner, own: &mut Worker, table: u16, keys: &[u64], levels: &[IntentLevel]) -> bool {
        for &level in levels {
            match own.signal_intent(table, keys, level) {
                Ok(()) => {}
                Err(Error::ShutDown) => return false,
                Err(e) => {
                    tracing::warn!(node = node.config.rank, error = %e, "the intent service could not reach a home node");
                    return true;
                }
            }
        }
        true
    }

    /// The part of a round that acts: records the relocations that completed, takes up the
    /// grants waiting (starts their moves, at most MAX_IN_FLIGHT at once, and their replicas;
    /// they run while the workers go on), and moves the replicas along. Returns false when the
    /// node shuts down.
    fn act(&self, node: &Arc<NodeInner>, own: &mut Worker, in_flight: &mut Vec<InFlight>) -> bool {
        let (settling, may_take_up) = {
            let schedule = self.schedule.lock();
            (schedule.settling(), schedule.may_take_up())
        };
        let many = in_flight.len() >= MAX_IN_FLIGHT;
        if !self.collect(node, own, in_flight, many || settling) {
            return false;
        }
        if may_take_up && node.core.intent_go_waiting() && !self.take_up(node, own, in_flight) {
            return false;
        }
        let mut replicas = self.replicas.lock();
        let mut outcome = replicas.poll(node, own, false).and(replicas.remake(node, own, false)).and(replicas.retry_put_off_drops(node, own));
        // Moves put off while a sync round carried their keys' deltas: granted again, so the
        // next act moves them — before another round can take their deltas.
        let reposted = replicas.repost_put_off_moves(node);
        if !reposted && replicas.quiet() && !replicas.is_empty() && self.schedule.lock().sync_due(self.now()) {
            outcome = outcome.and(replicas.start_sync(node, own)).and(replicas.remake(node, own, true));
        }
        self.schedule.lock().set_replicas_busy(replicas.busy());
        if let Err(e) = outcome {
            if self.stopped(node) {
                return false;
            }
            if known_loss(node, &e) {
                tracing::debug!(node = node.config.rank, error = %e, "a replica operation failed; the replicas keep their values");
            } else {
                tracing::warn!(node = node.config.rank, error = %e, "a replica operation failed; the replicas keep their values");
            }
        }
        true
    }

    /// Takes up the grants waiting (INTENT_GO): starts relocating the keys this node was told to
    /// move that it still intends and does not hold, makes the replicas granted, drops the
    /// replicas no longer wanted. Returns false when the node shuts down.
    fn take_up(&self, node: &Arc<NodeInner>, own: &mut Worker, in_flight: &mut Vec<InFlight>) -> bool {
        let store = node.core.store();
        let granted = {
            // Taken with the schedule held: a worker leaving a barrier sees either the grants
            // waiting or the take-up begun (`ServiceSchedule::take_up_target`).
            let mut schedule = self.schedule.lock();
            schedule.begin_take();
            node.core.take_intent_go()
        };
        // A replicate grant for a key held here is kept for when the key leaves (see
        // `intent::ReplicaSet`).
        let GrantsTaken { moves, replicate, unwanted } = self.rounds.lock().take_grants(granted, |table, key| store.table(table).slot_of(key).is_some());
        let started = self.start_granted(node, own, in_flight, moves, replicate, unwanted);
        let mut schedule = self.schedule.lock();
        schedule.finish_take();
        self.signalled.notify_all();
        started
    }

    fn start_granted(
        &self,
        node: &Arc<NodeInner>,
        own: &mut Worker,
        in_flight: &mut Vec<InFlight>,
        moves: Vec<(u16, Vec<u64>)>,
        replicate: Vec<(u16, Vec<u64>)>,
        unwanted: Vec<(u16, Vec<u64>)>,
    ) -> bool {
        for (table, keys) in unwanted {
            if let Err(e) = self.replicas.lock().drop_keys(node, own, table, &keys) {
                if self.stopped(node) {
                    return false;
                }
                tracing::warn!(node = node.config.rank, error = %e, "the intent service could not send a dropped replica's pushes");
            }
        }
        for (table, keys) in replicate {
            let made = self.replicas.lock().start_make(node, own, table, &keys);
            let taken = match made {
                Ok(taken) => taken,
                Err(e) => {
                    if self.stopped(node) {
                        return false;
                    }
                    tracing::warn!(node = node.config.rank, error = %e, "the intent service could not make replicas; their accesses go remote");
                    true
                }
            };
            if taken {
                self.rounds.lock().replicas_taken(table, &keys);
            }
        }
        // A replica here keeps serving until the key has landed, and the landing adds its
        // delta to the key. A key whose delta a sync round carries moves once the round has
        // ended: the replica set stays locked meanwhile, so that no barrier's round starts
        // between the check and the move (the service's own rounds run in this thread).
        let mut replicas = self.replicas.lock();
        for (table, keys) in moves {
            let keys = replicas.put_off_moves_carried(node, table, keys);
            if keys.is_empty() {
                continue;
            }
            match own.localize_granted_async(node.table_by_id(table), &keys) {
                Ok(ticket) => in_flight.push(InFlight { ticket, table, keys }),
                Err(Error::ShutDown) => return false,
                Err(e) => tracing::warn!(node = node.config.rank, error = %e, "the intent service could not relocate keys; their accesses go remote"),
            }
        }
        true
    }

    /// Records the relocations that completed (all of them, waiting, with `wait_all`); returns
    /// false when the node shuts down.
    fn collect(&self, node: &Arc<NodeInner>, own: &mut Worker, in_flight: &mut Vec<InFlight>, wait_all: bool) -> bool {
        let mut i = 0;
        while i < in_flight.len() {
            if !wait_all && !own.is_done(&in_flight[i].ticket) {
                i += 1;
                continue;
            }
            let InFlight { ticket, table, keys } = in_flight.swap_remove(i);
            match own.wait(ticket) {
                Ok(()) => {
                    let clocks = self.schedule.lock().clocks().clone();
                    let store = node.core.store().table(table);
                    self.rounds.lock().landed(table, &keys, &clocks, |key| store.slot_of(key).is_some(), node.core.intent_counters());
                }
                Err(Error::ShutDown) => return false,
                Err(e) if self.stopped(node) => {
                    tracing::debug!(node = node.config.rank, error = %e, "intent relocation ended by shutdown");
                    return false;
                }
                Err(e) if known_loss(node, &e) => {
                    tracing::debug!(node = node.config.rank, error = %e, "an intent relocation failed; its keys' accesses go remote")
                }
                Err(e) => tracing::warn!(node = node.config.rank, error = %e, "an intent relocation failed; its keys' accesses go remote"),
            }
        }
        true
    }
}

impl crate::runtime::GrantListener for IntentService {
    /// Wakes the service if it rests in a way grants end (a move or replica was granted to this
    /// node; called after posting it, for every frame while a grant waits).
    fn grants_waiting(&self) {
        let schedule = self.schedule.lock();
        self.wake_if(schedule.grants_arrived());
    }
}

/// Whether `error` comes from a node this one already knows lost, or a key whose value went
/// with it. The loss itself was logged as a warning when it was found; the service tries such
/// keys again in its rounds for as long as they are intended, and each try fails the same way,
/// so those failures are logged at debug level rather than as a warning per round.
fn known_loss(node: &NodeInner, error: &Error) -> bool {
    match error {
        Error::PeerLost { node: lost, .. } => node.core.directory().is_lost(*lost as u16),
        Error::KeyLost { .. } => true,
        _ => false,
    }
}

/// A relocation the service started.
struct InFlight {
    ticket: crate::worker::Ticket,
    table: u16,
    keys: Vec<u64>,
}

/// Holds the service's own sync rounds off for as long as it lives (a worker waiting for quiet
/// replicas; released on every way out).
struct HoldOff<'a>(&'a Mutex<ServiceSchedule>);

impl<'a> HoldOff<'a> {
    fn new(schedule: &'a Mutex<ServiceSchedule>) -> Self {
        schedule.lock().hold_off_syncs();
        HoldOff(schedule)
    }
}

impl Drop for HoldOff<'_> {
    fn drop(&mut self) {
        self.0.lock().release_syncs();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::protocol::Grant;
    use crate::store::Residence;
    use crate::{Config, Node, TableSpec};

    /// Two in-process nodes with a table "t" of 16 keys, and on node 1 a worker that bypasses
    /// replicas (as the service's does) and one that trains.
    fn node_one_of_two() -> (Vec<Node>, Arc<NodeInner>, Worker, Worker, Table) {
        let mut config = Config::new(vec![TableSpec::new("t", 16, 1)]);
        config.latches = 16;
        let nodes = Node::start_local_cluster(2, config).unwrap();
        let node = nodes[1].inner().clone();
        let (mut own, trainer) = (nodes[1].worker(), nodes[1].worker());
        own.bypass_replicas(true);
        let handle = own.table("t").unwrap();
        (nodes, node, own, trainer, handle)
    }

    #[test]
    fn a_worker_advancing_its_clock_does_not_wait_for_a_round_in_progress() {
        let service = Arc::new(IntentService::new(&Config::new(Vec::new())));
        service.rounds.lock().add_worker(0, &crate::config::IntentSettings::default());
        service.schedule.lock().declare(0, 0);
        service.schedule.lock().begin_round_for_test();
        // A clock of a worker that never declared is not news.
        service.note_clock(9, 3);
        assert!(!service.schedule.lock().has_news());
        // A round in progress holds the intents (for its whole walk of the windows, and for as
        // long as the thread running it waits for a core).
        let round = service.rounds.lock();
        let (done, advanced) = mpsc::channel();
        let worker = {
            let service = service.clone();
            std::thread::spawn(move || {
                service.note_clock(0, 7);
                let _ = done.send(());
            })
        };
        let waited = advanced.recv_timeout(Duration::from_secs(10)).is_err();
        drop(round);
        worker.join().unwrap();
        assert!(!waited, "the worker's clock waited for the round to release the intents");
        // The next round sees it.
        let (clocks, news) = service.schedule.lock().begin_round_for_test();
        assert!(news);
        assert_eq!(clocks.get(&0), Some(&7));
        assert!(!service.schedule.lock().has_news(), "the round took the news");
    }

    #[test]
    fn a_worker_leaving_a_barrier_waits_until_the_waiting_grants_are_taken_up() {
        // Rounds of 1 s: the take-up's bound (four rounds) is beyond what the test waits for.
        let mut config = Config::new(vec![TableSpec::new("t", 16, 1)]);
        config.latches = 16;
        config.intent.round = Duration::from_secs(1);
        let nodes = Node::start_local_cluster(2, config).unwrap();
        let node = nodes[1].inner().clone();
        let mut own = nodes[1].worker();
        let handle = own.table("t").unwrap();
        let key = (0..16).find(|&k| node.core.store().table(handle.id).residence(k) == Residence::Away).unwrap();
        // A service of the test's own, driven by hand (no thread), that intends the key now.
        let service = Arc::new(IntentService::new(&node.config));
        assert!(service.schedule.lock().start(0));
        {
            let mut state = service.rounds.lock();
            state.table.add(handle.id, key, 0, 0, 10);
            state.table.advance(0, |_| 0, 0, |_| 0);
            assert_eq!(state.table.relevel(handle.id, key, |_| 0), Some(IntentLevel::Now));
        }
        let take_up = |service: &Arc<IntentService>| {
            let (service, node, (done, finished)) = (service.clone(), node.clone(), mpsc::channel());
            std::thread::spawn(move || {
                service.take_up_grants(&node);
                done.send(()).unwrap();
            });
            finished
        };
        // Nothing waits: the worker goes on at once.
        take_up(&service).recv_timeout(Duration::from_secs(2)).expect("nothing to wait for");
        // A move was granted: the worker waits until the service has taken it and started it.
        node.core.post_intent_go(handle.id, Grant::Move, vec![key]);
        let finished = take_up(&service);
        assert!(finished.recv_timeout(Duration::from_millis(300)).is_err(), "went on before the grant was taken up");
        let mut in_flight = Vec::new();
        assert!(service.take_up(&node, &mut own, &mut in_flight));
        finished.recv_timeout(Duration::from_secs(2)).expect("still waiting after the take-up");
        assert_eq!(in_flight.len(), 1, "the move was started before the worker went on");
        for f in in_flight {
            own.wait(f.ticket).unwrap();
        }
        assert!(matches!(node.core.store().table(handle.id).residence(key), Residence::Here(_)));
        // A take-up in progress (the grants taken, their moves not yet started): the worker
        // waits for it too.
        service.schedule.lock().begin_take();
        let finished = take_up(&service);
        assert!(finished.recv_timeout(Duration::from_millis(300)).is_err(), "went on in the middle of a take-up");
        service.schedule.lock().finish_take();
        service.signalled.notify_all();
        finished.recv_timeout(Duration::from_secs(2)).expect("still waiting after the take-up");
        drop(own);
        crate::node::finalize_all(nodes);
    }

    #[test]
    fn a_barrier_waiting_for_quiet_replicas_holds_the_services_sync_rounds_off() {
        let (nodes, node, mut own, mut trainer, handle) = node_one_of_two();
        let key = (0..16).find(|&k| node.core.store().table(handle.id).residence(k) == Residence::Away).unwrap();
        // A service of the test's own, driven by hand, with a replica of the key that took a
        // push: a sync round would carry its delta.
        // Sync rounds are due at every act (a staleness bound of zero).
        let mut config = node.config.clone();
        config.staleness = Duration::ZERO;
        let service = IntentService::new(&config);
        service.replicas.lock().make_now(&node, &mut own, handle.id, &[key]);
        assert!(node.core.store().table(handle.id).has_dynamic_replica(key));
        trainer.push(handle, &[key], &[1.0]).unwrap();
        let mut in_flight = Vec::new();
        // A worker waits in `sync_replicas`: the service's act starts no sync.
        let waiting = HoldOff::new(&service.schedule);
        assert!(service.act(&node, &mut own, &mut in_flight));
        assert!(!service.replicas.lock().sync_in_flight(), "a sync round started while a barrier waited for quiet replicas");
        // It went: the next act syncs.
        drop(waiting);
        assert!(service.act(&node, &mut own, &mut in_flight));
        assert!(service.replicas.lock().sync_in_flight(), "no sync round once nothing waits");
        service.replicas.lock().drop_all(&node, &mut own).unwrap();
        drop((own, trainer));
        crate::node::finalize_all(nodes);
    }

    #[test]
    fn a_worker_tells_the_homes_itself_before_a_barrier_unless_replicas_are_kept() {
        let (nodes, node, mut own, mut trainer, handle) = node_one_of_two();
        let residence = |k: u64| node.core.store().table(handle.id).residence(k);
        let mut homed_here = (0..16).filter(|&k| matches!(residence(k), Residence::Here(_)));
        let (first, second) = (homed_here.next().unwrap(), homed_here.next().unwrap());
        let away = (0..16).find(|&k| residence(k) == Residence::Away).unwrap();
        // A service of the test's own without a thread: nobody else runs a round.
        let service = IntentService::new(&node.config);
        assert!(service.schedule.lock().start(0));
        let declare = |key: u64| {
            let mut state = service.rounds.lock();
            state.add_worker(0, &node.config.intent);
            state.table.add(handle.id, key, 0, 0, 10);
            service.schedule.lock().declare(0, 0);
        };
        let rounds = || service.schedule.lock().rounds_for_test();
        // The worker's window on `first` started: the worker tells the key's home (this node)
        // itself, in a round of its own.
        declare(first);
        service.signal_levels(&node, &mut trainer).unwrap();
        assert_eq!(node.core.intent_homes().lock().intenders(handle.id, first), vec![(1, IntentLevel::Now)]);
        assert_eq!(rounds(), (1, 1));
        // Nothing happened since: nothing to tell, no round.
        service.signal_levels(&node, &mut trainer).unwrap();
        assert_eq!(rounds(), (1, 1));
        // With a replica kept here, the round must drop the replicas whose intent it ends, which
        // the service's worker does: the worker leaves it to the service, changing nothing.
        service.replicas.lock().make_now(&node, &mut own, handle.id, &[away]);
        declare(second);
        assert!(!service.signal_here(&node, &mut trainer), "a worker ran a round while replicas were kept");
        assert!(service.schedule.lock().has_news(), "the round's news were taken");
        assert!(!service.schedule.lock().turn_taken(), "the turn was given back");
        assert_eq!(rounds(), (1, 1));
        assert!(node.core.intent_homes().lock().intenders(handle.id, second).is_empty());
        service.replicas.lock().drop_all(&node, &mut own).unwrap();
        drop((own, trainer));
        crate::node::finalize_all(nodes);
    }

    #[test]
    fn a_late_access_whose_grant_waits_for_the_service_is_told_apart() {
        let service = IntentService::new(&Config::new(Vec::new()));
        {
            let mut state = service.rounds.lock();
            // Keys 5, 6 and 7 of table 0 are needed now; their homes were told.
            for key in [5, 6, 7] {
                state.table.add(0, key, 0, 0, 10);
            }
            state.table.advance(0, |_| 0, 0, |_| 0);
            for key in [5, 6, 7] {
                assert_eq!(state.table.relevel(0, key, |_| 0), Some(IntentLevel::Now));
            }
            // Key 7's move was taken up: it is on its way.
            state.table.note_granted(0, 7, false);
        }
        let homes = Mutex::new(IntentHomes::default());
        // A move of key 5 arrived and waits for the service; key 6's home has not answered.
        homes.lock().post_go(0, Grant::Move, vec![4, 5]);
        homes.lock().post_go(1, Grant::Move, vec![6]);
        // Key 5 is accessed twice in the batch: each access counts.
        let late = service.count_late(&homes, 0, &[5, 6, 7, 8, 5], 0, 0);
        let mut expected = LateCounts::default();
        expected.add(LateCause::Untaken);
        expected.add(LateCause::Untaken);
        expected.add(LateCause::Unanswered);
        expected.add(LateCause::Moving);
        assert_eq!(late, expected, "key 8 was not declared, so it is not late");
        // Once the service took the grant, nothing waits.
        homes.lock().take_go();
        let late = service.count_late(&homes, 0, &[5], 0, 0);
        let mut expected = LateCounts::default();
        expected.add(LateCause::Unanswered);
        assert_eq!(late, expected);
    }
}
