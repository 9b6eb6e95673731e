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
//! Rounds start every configured round time (earlier only when a worker's barrier waits for
//! one; without replicas here that worker runs steps 1–3 itself); a grant arriving in between
//! wakes the service only for steps 4 and 5. A round in which no worker advanced or declared
//! anything, with nothing in flight and no replicas, changes nothing: after one the service
//! sleeps until a worker does (or a grant or barrier comes), so workers slower than a clock per
//! round (MF's sub-epochs: a clock every few milliseconds) do not pay for rounds that cannot
//! act; rounds that see clocks advance but move no window come further apart (up to
//! [`MAX_STRETCH`] round times). A service with nothing to do sleeps until a worker declares
//! intent. The thread starts with the node's first intent and stops before the node finalizes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::replicas::ReplicaDriver;
use crate::error::{Error, Result};
use crate::intent::{GrantsTaken, IntentLevel, IntentRounds, LateCause, LevelChanges};
use crate::protocol::LateCounts;
use crate::protocol::{Grant, IntentHomes};
use crate::runtime::NodeInner;
use crate::table::Table;
use crate::worker::Worker;

/// Localize operations the service keeps in flight at most before it waits for them.
const MAX_IN_FLIGHT: usize = 64;

/// The longest the service sleeps waiting for a worker's clock or declaration (a safety net:
/// those wake it).
const QUIET_REST: std::time::Duration = std::time::Duration::from_millis(100);

/// Rounds that move no window, with nothing in flight and no replicas, stretch the time to
/// the next round, doubling it up to this many round times; a round that moves one resets it.
const MAX_STRETCH: u32 = 8;

/// How many round times a worker leaving a barrier waits at most for the service to take up
/// the grants that arrived meanwhile ([`IntentService::take_up_grants`]); past it, the worker
/// goes on and its accesses find the keys where they are.
const TAKE_UP_ROUNDS: u32 = 4;

/// What a round's steps 1–2 found: the changes for the homes, and whether a worker advanced,
/// declared or left since the last round began.
struct RoundChanges {
    changes: LevelChanges,
    news: bool,
}

/// A node's intents and the thread acting on them.
#[derive(Default)]
pub(crate) struct IntentService {
    /// The intents and what the rounds decide (the state machine; workers' clocks are in
    /// [`IntentService::clocks`]).
    state: Mutex<IntentRounds>,
    wake: Condvar,
    /// Notified (under the state lock) when a round has told the homes its changes: a worker
    /// in [`IntentService::signal_levels`] waits on it.
    signalled: Condvar,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Whether the service thread (and its worker) exists.
    running: AtomicBool,
    /// The run-time replicas kept here, and their operations in flight.
    replicas: Mutex<ReplicaDriver>,
    /// Whether replicas exist or replica operations are in flight (the service keeps running
    /// rounds while so).
    replicas_busy: AtomicBool,
    /// Rounds that have computed their level changes (counted under the state lock), and
    /// rounds whose changes were handed to the protocol.
    rounds_started: AtomicU64,
    rounds_signalled: AtomicU64,
    /// A worker waits for a round to tell the homes its ended windows (before a barrier).
    round_wanted: AtomicBool,
    /// Held from a round's computing its level changes until it has told the homes, by the
    /// service or by a worker signalling before a barrier itself: the homes must learn one
    /// round's changes before the next round's, or a key's end could overtake its new start.
    signalling: Mutex<()>,
    /// Workers in [`IntentService::sync_replicas`], waiting for the replicas to be quiet: the
    /// service starts no sync round of its own meanwhile.
    barrier_syncs: AtomicUsize,
    /// Times the service took the grants waiting for it, and times it then had started their
    /// moves and replicas (both counted under the state lock, `signalled` notified with the
    /// second): a worker in [`IntentService::take_up_grants`] waits for them.
    takes_begun: AtomicU64,
    takes_done: AtomicU64,
    /// The service thread sleeps (or is about to): a grant must wake it.
    resting: AtomicBool,
    /// Granted moves put off because a sync round in flight carried their keys' deltas (see
    /// `store::dynamic::SyncMarks`): granted again once it has ended.
    put_off_moves: Mutex<Vec<(u16, Vec<u64>)>>,
    /// The service sleeps until a worker advances or declares (set under the state lock):
    /// `note_clock` must wake it.
    awaiting_news: AtomicBool,
    /// A worker advanced its clock, declared intent or left since the last round began (taken
    /// by the round under the state lock; set by `note_clock` without it).
    news: AtomicBool,
    /// Each declaring worker's current clock. Not in the state: a worker advancing its clock
    /// takes only this lock, held for a store, while the state lock is held for whole rounds
    /// (a worker that waited for it there spent 3–8 µs per clock in MF, 2–4 % of an epoch,
    /// whenever the service holding it waited for a core).
    clocks: Mutex<BTreeMap<u16, u64>>,
}

impl IntentService {
    /// Worker `worker`, in clock `clock`, will need `keys` of `table` in clocks `window`. Keys
    /// the node cannot move (replicated keys) are left out. Starts the service thread with the
    /// first intent.
    pub fn declare(self: &Arc<Self>, node: &Arc<NodeInner>, worker: u16, clock: u64, table: Table, keys: &[u64], window: std::ops::Range<u64>) -> Result<()> {
        let store = node.core.store();
        let replicas = store.table(table.id).replicas();
        let mut state = self.state.lock();
        // The service waits for work only while no window is registered (it checks under this
        // lock); otherwise its next round sees the new windows, and waking it for each
        // declaration would only cost context switches.
        let idle = state.is_empty() || self.awaiting_news.load(Ordering::Relaxed);
        self.news.store(true, Ordering::SeqCst);
        self.clocks.lock().insert(worker, clock);
        let movable = keys.iter().copied().filter(|&key| replicas.is_none_or(|r| r.ordinal(key).is_none()));
        let added = state.declare(&node.config.intent, worker, table.id, movable, window);
        node.core.intent_counters().note_declared(added);
        if !self.running.load(Ordering::Acquire) && !self.stop.load(Ordering::Acquire) {
            // The service's worker is outside barriers and finalize's count of live workers.
            let own = Worker::unclocked(node.clone(), self.clone());
            let (service, service_node) = (self.clone(), node.clone());
            let handle = std::thread::Builder::new()
                .name(format!("ferry{}-intent", node.config.rank))
                .spawn(move || service.run(&service_node, own))
                .map_err(|e| Error::Transport(format!("cannot start the intent thread: {e}")))?;
            *self.thread.lock() = Some(handle);
            self.running.store(true, Ordering::Release);
        }
        drop(state);
        if idle {
            self.wake.notify_all();
        }
        Ok(())
    }

    /// Whether the service thread runs (it takes replicas' deltas in sync rounds).
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }

    /// Worker `worker` is in clock `clock` now. The service is woken only if it sleeps waiting
    /// for a worker to advance: otherwise it runs rounds anyway (at most a round time apart),
    /// and a worker completing a clock every few hundred microseconds would wake it for each.
    pub fn note_clock(&self, worker: u16, clock: u64) {
        match self.clocks.lock().get_mut(&worker) {
            Some(c) => *c = clock,
            None => return,
        }
        // Paired with `rest_until_news`, which sets `awaiting_news` before it looks at `news`
        // (both SeqCst): either it sees the news, or this sees it waiting and wakes it under
        // the lock it waits with.
        self.news.store(true, Ordering::SeqCst);
        if self.awaiting_news.load(Ordering::SeqCst) {
            let _state = self.state.lock();
            self.wake.notify_all();
        }
    }

    /// Wakes the service (a move was posted for it). Taking the lock orders the wake-up after
    /// the service's check of the mailbox, so that it is not lost.
    pub fn wake(&self) {
        let _state = self.state.lock();
        self.wake.notify_all();
    }

    /// Worker `worker` left: its intents end.
    pub fn forget_worker(&self, worker: u16) {
        self.state.lock().forget_worker(worker);
        self.clocks.lock().remove(&worker);
        self.news.store(true, Ordering::SeqCst);
        self.wake.notify_all();
    }

    /// Of `away`, keys an access of worker `worker` in clock `clock` found neither here nor
    /// replicated here, those the worker declared intent for now (late accesses), by cause.
    /// A key whose home has not answered, as far as the service knows, is told apart by
    /// whether a grant for it waits in `homes` for the service to take it up.
    pub fn count_late(&self, homes: &Mutex<IntentHomes>, table: u16, away: &[u64], worker: u16, clock: u64) -> LateCounts {
        let mut late = LateCounts::default();
        let mut unanswered = Vec::new();
        {
            let mut state = self.state.lock();
            for &key in away {
                match state.table.note_late(table, key, worker, clock) {
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
    /// without holding the replica set, so the service goes on meanwhile; it fails at once
    /// instead while a node is lost. Nothing to do without replicas.
    pub fn sync_replicas(&self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        let deadline = Instant::now() + node.config.op_timeout;
        // While rounds take longer than the sync period (a slow fabric, an emulated host), the
        // service starts each one as the last ends, and a waiter that only looks now and then
        // would never see the replicas quiet: so it holds the service's rounds off.
        let _holding_off = HoldOff::new(&self.barrier_syncs);
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
            // The service completes them in its rounds (every millisecond while busy).
            self.wake();
            std::thread::sleep(std::time::Duration::from_micros(200));
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
        if !self.running.load(Ordering::Acquire) {
            return Ok(());
        }
        if self.signal_here(node, worker) {
            return Ok(());
        }
        let mut state = self.state.lock();
        // No worker advanced, declared or left since the last round began (a round counts
        // itself started before it takes the news), and that round has told the homes its
        // changes: a round now would find the same clocks and horizons, hence no change to tell.
        if !self.news.load(Ordering::SeqCst) && self.rounds_signalled.load(Ordering::Acquire) == self.rounds_started.load(Ordering::Acquire) {
            return Ok(());
        }
        self.round_wanted.store(true, Ordering::Release);
        self.wake.notify_all();
        let after = self.rounds_started.load(Ordering::Acquire);
        let deadline = Instant::now() + node.config.op_timeout;
        while self.rounds_signalled.load(Ordering::Acquire) <= after {
            if self.stopped(node) || !self.running.load(Ordering::Acquire) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: "the intent service's round before a barrier",
                    millis: node.config.op_timeout.as_millis() as u64,
                    nodes: Vec::new(),
                });
            }
            // Woken when the round has signalled; the bound is a safety net against a service
            // that stops without a round.
            self.signalled.wait_for(&mut state, std::time::Duration::from_millis(10));
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
        let _round = self.signalling.lock();
        let mut replicas = self.replicas.lock();
        replicas.adopt_kept(node);
        if replicas.busy() {
            return false;
        }
        let changes = {
            let mut state = self.state.lock();
            // No worker advanced, declared or left since the last round (rounds are not in
            // progress while `signalling` is held): nothing to tell.
            if !self.news.load(Ordering::SeqCst) {
                return true;
            }
            self.level_changes(&mut state)
        };
        // On a shutdown the barrier that follows fails.
        self.tell_changes(node, worker, changes, false);
        true
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
        // Looked at without the lock first: a barrier with nothing to take up costs a few loads.
        if !self.running.load(Ordering::Acquire) || self.take_up_target(node).is_none() {
            return;
        }
        let mut state = self.state.lock();
        let Some(target) = self.take_up_target(node) else { return };
        let deadline = Instant::now() + node.config.intent.round * TAKE_UP_ROUNDS;
        self.wake.notify_all();
        while self.takes_done.load(Ordering::Acquire) < target {
            if self.stopped(node) || !self.running.load(Ordering::Acquire) || Instant::now() >= deadline {
                return;
            }
            self.signalled.wait_until(&mut state, deadline);
        }
    }

    /// The take-up a worker leaving a barrier waits for (as a count of `takes_done`): the next
    /// one if grants still wait, else one the service is in the middle of (it took the grants
    /// and is starting their moves); none if neither. Exact under the state lock, which both
    /// counts change under.
    fn take_up_target(&self, node: &NodeInner) -> Option<u64> {
        let begun = self.takes_begun.load(Ordering::Acquire);
        if node.core.intent_go_waiting() {
            Some(begun + 1)
        } else if self.takes_done.load(Ordering::Acquire) < begun {
            Some(begun)
        } else {
            None
        }
    }

    /// Stops the service thread and waits for it (its worker is dropped with it).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        {
            let _state = self.state.lock();
            self.wake.notify_all();
            self.signalled.notify_all();
        }
        let handle = self.thread.lock().take();
        if let Some(h) = handle {
            let _ = h.join();
        }
        self.running.store(false, Ordering::Release);
    }

    fn stopped(&self, node: &NodeInner) -> bool {
        self.stop.load(Ordering::Acquire) || node.stopping.load(Ordering::Acquire)
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

    fn serve(&self, node: &Arc<NodeInner>, own: &mut Worker) {
        let round_time = node.config.intent.round;
        let sync_every = node.config.staleness / 2;
        let mut last_sync = Instant::now();
        let mut in_flight: Vec<InFlight> = Vec::new();
        let mut next_round = Instant::now();
        // Round times to the next round (see MAX_STRETCH).
        let mut stretch = 1;
        loop {
            // A full round (clocks, windows, levels told to the homes) every round time, or at
            // once when a worker waits for one; in between, the service only acts on what the
            // homes granted, so a stream of grants does not make rounds back to back (and the
            // clock-rate estimate stays per round time).
            let now = Instant::now();
            if now < next_round && !self.round_wanted.load(Ordering::Acquire) {
                if !self.finish_round(node, own, &mut in_flight, &mut last_sync, sync_every) {
                    return;
                }
                self.rest(node, next_round);
                continue;
            }
            {
                let mut state = self.state.lock();
                self.begin_resting();
                while state.is_empty()
                    && !node.core.intent_go_waiting()
                    && !self.replicas_busy.load(Ordering::Acquire)
                    && !self.round_wanted.load(Ordering::Acquire)
                    && !self.stopped(node)
                {
                    self.wake.wait_for(&mut state, std::time::Duration::from_millis(100));
                }
                self.resting.store(false, Ordering::Relaxed);
                if self.stopped(node) {
                    return;
                }
            }
            // Taken without the state lock held: a worker signalling itself takes this, then
            // the replica set, then the state.
            let round = self.signalling.lock();
            let began = Instant::now();
            let changes = {
                let mut state = self.state.lock();
                self.round_wanted.store(false, Ordering::Release);
                self.level_changes(&mut state)
            };
            let (news, windows_moved) = (changes.news, changes.changes.windows_moved);
            if !self.tell_changes(node, own, changes, true) {
                return;
            }
            drop(round);
            if !self.finish_round(node, own, &mut in_flight, &mut last_sync, sync_every) {
                return;
            }
            // A round that moved no window while nothing is in flight and no replica is kept:
            // the workers are slow against the round time (a clock every few milliseconds, as
            // in MF's sub-epochs), so the next round may come later; the estimate is in clocks
            // per round, and `ActionTiming::round` takes a longer round's clocks at once, so the
            // horizon grows with the stretch. A round that moves a window resets it.
            let quiet = in_flight.is_empty() && !self.replicas_busy.load(Ordering::Acquire);
            stretch = if quiet && !windows_moved { (stretch * 2).min(MAX_STRETCH) } else { 1 };
            next_round = began + round_time * stretch;
            // Nothing advanced since the last round and nothing is in flight: the next round
            // would see the same clocks and horizons (a round without progress leaves the
            // estimate alone), so it waits until a worker advances or declares.
            if quiet && !news && self.rest_until_news(node) {
                next_round = Instant::now();
                continue;
            }
            self.rest(node, next_round);
        }
    }

    /// Steps 1–2 of a round, under the state lock (and with [`IntentService::signalling`]
    /// held): the workers' horizons, the windows moved along, and the level changes the homes
    /// must learn.
    fn level_changes(&self, state: &mut IntentRounds) -> RoundChanges {
        self.rounds_started.fetch_add(1, Ordering::SeqCst);
        let news = self.news.swap(false, Ordering::SeqCst);
        let clocks = self.clocks.lock().clone();
        RoundChanges { changes: state.round(&clocks), news }
    }

    /// Step 3 of a round, through `own` (with [`IntentService::signalling`] held): tells the
    /// homes `changes`, dropping the replicas of keys whose intent ended first if
    /// `drop_replicas` (a caller that holds the replica set, empty, passes false), and wakes the
    /// workers waiting for it. Returns false when the node shuts down.
    fn tell_changes(&self, node: &NodeInner, own: &mut Worker, changes: RoundChanges, drop_replicas: bool) -> bool {
        let changes = changes.changes;
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
        self.rounds_signalled.store(self.rounds_started.load(Ordering::Acquire), Ordering::Release);
        // Under the lock: a worker that saw the round unsignalled is waiting by now.
        let _state = self.state.lock();
        self.signalled.notify_all();
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

    /// The part of a round that acts: records the relocations that completed, starts those
    /// granted (at most MAX_IN_FLIGHT at once; they run while the workers go on), and moves the
    /// replicas along. Returns false when the node shuts down.
    fn finish_round(
        &self,
        node: &Arc<NodeInner>,
        own: &mut Worker,
        in_flight: &mut Vec<InFlight>,
        last_sync: &mut Instant,
        sync_every: std::time::Duration,
    ) -> bool {
        let many = in_flight.len() >= MAX_IN_FLIGHT;
        if !self.collect(node, own, in_flight, many) {
            return false;
        }
        if node.core.intent_go_waiting() && !self.act(node, own, in_flight) {
            return false;
        }
        let mut replicas = self.replicas.lock();
        let mut outcome = replicas.poll(node, own, false).and(replicas.remake(node, own, false)).and(replicas.retry_put_off_drops(node, own));
        // Moves put off while a sync round carried their keys' deltas: granted again, so the
        // next pass moves them — before another round can take their deltas.
        let mut put_off = self.put_off_moves.lock();
        let reposted = !put_off.is_empty() && !replicas.sync_in_flight();
        if reposted {
            for (table, keys) in put_off.drain(..) {
                node.core.post_intent_go(table, Grant::Move, keys);
            }
        }
        drop(put_off);
        let held_off = self.barrier_syncs.load(Ordering::Acquire) > 0;
        if !reposted && !held_off && last_sync.elapsed() >= sync_every && replicas.quiet() && !replicas.is_empty() {
            *last_sync = Instant::now();
            outcome = outcome.and(replicas.start_sync(node, own)).and(replicas.remake(node, own, true));
        }
        self.replicas_busy.store(replicas.busy(), Ordering::Release);
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

    /// Marks the service as resting, before it checks for grants one last time and sleeps.
    /// Paired with the fence in `grants_waiting`: either the check sees the grant, or the
    /// poster sees the service resting and wakes it.
    fn begin_resting(&self) {
        self.resting.store(true, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Sleeps until `until`, a move or replica granted to this node, a worker waiting for a
    /// round, or the stop. While asleep, a grant wakes it (`GrantListener::grants_waiting`).
    fn rest(&self, node: &NodeInner, until: Instant) {
        let mut state = self.state.lock();
        self.begin_resting();
        while !self.stopped(node) && !node.core.intent_go_waiting() && !self.round_wanted.load(Ordering::Acquire) && Instant::now() < until {
            self.wake.wait_until(&mut state, until);
        }
        self.resting.store(false, Ordering::Relaxed);
    }

    /// Sleeps until a worker advances, declares or leaves, a grant arrives, a worker waits for a
    /// round, or the stop (at most [`QUIET_REST`]). Returns false, without sleeping, if one of
    /// them already happened.
    fn rest_until_news(&self, node: &NodeInner) -> bool {
        let mut state = self.state.lock();
        let until = Instant::now() + QUIET_REST;
        self.awaiting_news.store(true, Ordering::SeqCst);
        self.begin_resting();
        let mut slept = false;
        while !self.news.load(Ordering::SeqCst)
            && !self.stopped(node)
            && !node.core.intent_go_waiting()
            && !self.round_wanted.load(Ordering::Acquire)
            && Instant::now() < until
        {
            self.wake.wait_until(&mut state, until);
            slept = true;
        }
        self.awaiting_news.store(false, Ordering::Relaxed);
        self.resting.store(false, Ordering::Relaxed);
        slept
    }

    /// Starts relocating the keys this node was told to move (INTENT_GO) that it still intends
    /// and does not hold; returns false when the node shuts down.
    fn act(&self, node: &Arc<NodeInner>, own: &mut Worker, in_flight: &mut Vec<InFlight>) -> bool {
        let store = node.core.store();
        let GrantsTaken { moves, replicate, unwanted } = {
            let mut state = self.state.lock();
            // A replicate grant for a key held here is kept for when the key leaves (see
            // `intent::ReplicaSet`).
            let taken = state.take_grants(node.core.take_intent_go(), |table, key| store.table(table).slot_of(key).is_some());
            // A worker leaving a barrier may wait until the moves and replicas below started.
            self.takes_begun.fetch_add(1, Ordering::AcqRel);
            taken
        };
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
                self.state.lock().replicas_taken(table, &keys);
            }
        }
        // A replica here keeps serving until the key has landed, and the landing adds its
        // delta to the key. A key whose delta a sync round carries moves once the round has
        // ended: the replica set stays locked meanwhile, so that no barrier's round starts
        // between the check and the move (the service's own rounds run in this thread).
        let replicas = self.replicas.lock();
        for (table, mut keys) in moves {
            if replicas.sync_in_flight()
                && let Some(d) = store.table(table).dynamic()
            {
                let put_off = d.carried_by_sync(&keys);
                if !put_off.is_empty() {
                    keys.retain(|k| !put_off.contains(k));
                    node.core.intent_counters().note_moves_put_off(put_off.len() as u64);
                    self.put_off_moves.lock().push((table, put_off));
                }
            }
            if keys.is_empty() {
                continue;
            }
            match own.localize_granted_async(node.table_by_id(table), &keys) {
                Ok(ticket) => in_flight.push(InFlight { ticket, table, keys }),
                Err(Error::ShutDown) => return false,
                Err(e) => tracing::warn!(node = node.config.rank, error = %e, "the intent service could not relocate keys; their accesses go remote"),
            }
        }
        drop(replicas);
        self.finish_take_up();
        true
    }

    /// A take-up's moves and replicas have started: counted under the state lock, so that a
    /// worker in [`IntentService::take_up_grants`] that saw it unfinished is waiting by now.
    fn finish_take_up(&self) {
        let _state = self.state.lock();
        self.takes_done.fetch_add(1, Ordering::AcqRel);
        self.signalled.notify_all();
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
                    let clocks = self.clocks.lock().clone();
                    let store = node.core.store().table(table);
                    self.state.lock().landed(table, &keys, &clocks, |key| store.slot_of(key).is_some(), node.core.intent_counters());
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
    /// Wakes the service if it rests (a move or replica was granted to this node; called after
    /// posting it). Called for every frame while a grant waits, so a service that is awake is
    /// left alone: it acts on the grant before it rests again.
    fn grants_waiting(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.resting.load(Ordering::Relaxed) {
            self.wake();
        }
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

/// Counts a waiter in a counter for as long as it lives (the count drops on every way out).
struct HoldOff<'a>(&'a AtomicUsize);

impl<'a> HoldOff<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        HoldOff(count)
    }
}

impl Drop for HoldOff<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
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
        let service = Arc::new(IntentService::default());
        service.state.lock().add_worker(0, &crate::config::IntentSettings::default());
        service.clocks.lock().insert(0, 0);
        // A clock of a worker that never declared is not news.
        service.note_clock(9, 3);
        assert!(!service.news.load(Ordering::SeqCst));
        // A round in progress holds the state lock (for its whole walk of the windows, and
        // for as long as the thread running it waits for a core).
        let round = service.state.lock();
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
        assert!(!waited, "the worker's clock waited for the round to release the state");
        // The next round sees it.
        assert!(service.news.load(Ordering::SeqCst));
        assert_eq!(service.clocks.lock().get(&0), Some(&7));
        let changes = service.level_changes(&mut service.state.lock());
        assert!(changes.news);
        assert!(!service.news.load(Ordering::SeqCst), "the round took the news");
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
        let service = Arc::new(IntentService::default());
        service.running.store(true, Ordering::Release);
        {
            let mut state = service.state.lock();
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
        assert!(service.act(&node, &mut own, &mut in_flight));
        finished.recv_timeout(Duration::from_secs(2)).expect("still waiting after the take-up");
        assert_eq!(in_flight.len(), 1, "the move was started before the worker went on");
        for f in in_flight {
            own.wait(f.ticket).unwrap();
        }
        assert!(matches!(node.core.store().table(handle.id).residence(key), Residence::Here(_)));
        // A take-up in progress (the grants taken, their moves not yet started): the worker
        // waits for it too.
        service.takes_begun.fetch_add(1, Ordering::AcqRel);
        let finished = take_up(&service);
        assert!(finished.recv_timeout(Duration::from_millis(300)).is_err(), "went on in the middle of a take-up");
        service.finish_take_up();
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
        let service = IntentService::default();
        service.replicas.lock().make_now(&node, &mut own, handle.id, &[key]);
        assert!(node.core.store().table(handle.id).has_dynamic_replica(key));
        trainer.push(handle, &[key], &[1.0]).unwrap();
        let (mut in_flight, mut last_sync) = (Vec::new(), Instant::now());
        // A worker waits in `sync_replicas`: the service's round starts no sync.
        let waiting = HoldOff::new(&service.barrier_syncs);
        assert!(service.finish_round(&node, &mut own, &mut in_flight, &mut last_sync, Duration::ZERO));
        assert!(!service.replicas.lock().sync_in_flight(), "a sync round started while a barrier waited for quiet replicas");
        // It went: the next round syncs.
        drop(waiting);
        assert_eq!(service.barrier_syncs.load(Ordering::Acquire), 0);
        assert!(service.finish_round(&node, &mut own, &mut in_flight, &mut last_sync, Duration::ZERO));
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
        let service = IntentService::default();
        service.running.store(true, Ordering::Release);
        let declare = |key: u64| {
            let mut state = service.state.lock();
            state.add_worker(0, &node.config.intent);
            service.clocks.lock().entry(0).or_insert(0);
            state.table.add(handle.id, key, 0, 0, 10);
            service.news.store(true, Ordering::SeqCst);
        };
        let rounds = || (service.rounds_started.load(Ordering::Acquire), service.rounds_signalled.load(Ordering::Acquire));
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
        assert!(service.news.load(Ordering::SeqCst), "the round's news were taken");
        assert_eq!(rounds(), (1, 1));
        assert!(node.core.intent_homes().lock().intenders(handle.id, second).is_empty());
        service.replicas.lock().drop_all(&node, &mut own).unwrap();
        drop((own, trainer));
        crate::node::finalize_all(nodes);
    }

    #[test]
    fn a_late_access_whose_grant_waits_for_the_service_is_told_apart() {
        let service = IntentService::default();
        {
            let mut state = service.state.lock();
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
