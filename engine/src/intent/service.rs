//! The intent service: a node's background thread that acts on its workers' intents.
//!
//! Each communication round (AdaPM, Section 4.2) it
//!
//! 1. updates each declaring worker's clock-rate estimate from the clocks it completed since the
//!    last round ([`ActionTiming::round`]) and computes its horizon;
//! 2. takes the windows that start at or before their worker's horizon
//!    ([`IntentTable::take_due`]) — each window once;
//! 3. relocates the keys among them that are not here with one asynchronous `localize` per table
//!    (the protocol sends one message per home node), through a worker of its own, and waits for
//!    them: a round lasts as long as its relocations, which is what the rate estimate measures;
//! 4. records for each key whether it landed before its window started (and how many clocks
//!    before), and drops windows that ended.
//!
//! A round that acts on nothing waits for the configured round time, or until a worker declares
//! new intent. The thread starts with the node's first intent and stops before the node
//! finalizes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use super::{ActionTiming, IntentTable, Window};
use crate::error::{Error, Result};
use crate::node::Table;
use crate::runtime::NodeInner;
use crate::worker::Worker;

/// One declaring worker's clock and timing.
struct WorkerClock {
    clock: u64,
    timing: ActionTiming,
}

#[derive(Default)]
struct State {
    table: IntentTable,
    workers: BTreeMap<u16, WorkerClock>,
}

/// A node's intents and the thread acting on them.
#[derive(Default)]
pub(crate) struct IntentService {
    state: Mutex<State>,
    wake: Condvar,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Whether the service thread (and its worker) exists.
    running: AtomicBool,
}

impl IntentService {
    /// Worker `worker`, in clock `clock`, will need `keys` of `table` in clocks `start..end`.
    /// Keys the node cannot move (replicated keys) are left out. Starts the service thread with
    /// the first intent.
    #[allow(clippy::too_many_arguments)]
    pub fn declare(&self, node: &Arc<NodeInner>, worker: u16, clock: u64, table: Table, keys: &[u64], start: u64, end: u64) -> Result<()> {
        let store = node.core.store();
        let replicas = store.table(table.id).replicas();
        let mut state = self.state.lock();
        let settings = node.config.intent;
        state
            .workers
            .entry(worker)
            .or_insert_with(|| WorkerClock { clock, timing: ActionTiming::new(settings.alpha, settings.quantile, settings.initial_rate) })
            .clock = clock;
        let mut added = 0;
        for &key in keys {
            if replicas.is_some_and(|r| r.ordinal(key).is_some()) {
                continue;
            }
            added += state.table.add(table.id, key, worker, start, end) as u64;
        }
        node.core.intent_counters().note_declared(added);
        if !self.running.load(Ordering::Acquire) && !self.stop.load(Ordering::Acquire) {
            // The service's worker is outside barriers and finalize's count of live workers.
            let own = Worker::unclocked(node.clone());
            let service_node = node.clone();
            let handle = std::thread::Builder::new()
                .name(format!("ferry{}-intent", node.config.rank))
                .spawn(move || service_node.intents.run(&service_node, own))
                .map_err(|e| Error::Transport(format!("cannot start the intent thread: {e}")))?;
            *self.thread.lock() = Some(handle);
            self.running.store(true, Ordering::Release);
        }
        drop(state);
        self.wake.notify_all();
        Ok(())
    }

    /// Worker `worker` is in clock `clock` now.
    pub fn note_clock(&self, worker: u16, clock: u64) {
        if let Some(w) = self.state.lock().workers.get_mut(&worker) {
            w.clock = clock;
        }
    }

    /// Worker `worker` left: its intents end.
    pub fn forget_worker(&self, worker: u16) {
        let mut state = self.state.lock();
        state.table.forget_worker(worker);
        state.workers.remove(&worker);
    }

    /// How many of `keys` worker `worker`, in clock `clock`, declared intent for now although
    /// they are not here (`here(key)`): late accesses.
    pub fn count_late(&self, table: u16, keys: &[u64], worker: u16, clock: u64, here: impl Fn(u64) -> bool) -> u64 {
        if keys.iter().all(|&k| here(k)) {
            return 0;
        }
        let state = self.state.lock();
        keys.iter().filter(|&&k| !here(k) && state.table.active(table, k, worker, clock)).count() as u64
    }

    /// Stops the service thread and waits for it (its worker is dropped with it).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        {
            let _state = self.state.lock();
            self.wake.notify_all();
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

    /// The service thread.
    fn run(&self, node: &Arc<NodeInner>, mut own: Worker) {
        let round_time = node.config.intent.round;
        let counters = node.core.intent_counters();
        loop {
            let started = Instant::now();
            let due = {
                let mut state = self.state.lock();
                while state.table.is_empty() && !self.stopped(node) {
                    self.wake.wait_for(&mut state, std::time::Duration::from_millis(100));
                }
                if self.stopped(node) {
                    return;
                }
                let State { table, workers } = &mut *state;
                let mut horizons = BTreeMap::new();
                for (&w, c) in workers.iter_mut() {
                    horizons.insert(w, (c.clock, c.timing.round(c.clock)));
                }
                let limit = horizons.values().map(|h| h.1).max().unwrap_or(0);
                let latest = horizons.values().map(|h| h.0).max().unwrap_or(0);
                let at = |w: u16| horizons.get(&w).copied().unwrap_or((0, 0));
                let due = table.take_due(limit, |w| at(w).1, |w| at(w).0);
                table.expire(latest, |w| at(w).0);
                due
            };
            counters.note_round();
            if !due.is_empty() && !self.act(node, &mut own, due) {
                return;
            }
            let mut state = self.state.lock();
            let until = started + round_time;
            if !self.stopped(node) && Instant::now() < until {
                self.wake.wait_until(&mut state, until);
            }
        }
    }

    /// Relocates the due keys that are not here; returns false when the node shuts down.
    fn act(&self, node: &Arc<NodeInner>, own: &mut Worker, due: Vec<((u16, u64), Window)>) -> bool {
        let store = node.core.store();
        let mut per_table: BTreeMap<u16, (Vec<u64>, Vec<Window>)> = BTreeMap::new();
        for ((table, key), window) in due {
            if store.table(table).slot_of(key).is_none() {
                let (keys, windows) = per_table.entry(table).or_default();
                keys.push(key);
                windows.push(window);
            }
        }
        let mut tickets = Vec::new();
        for (table, (keys, windows)) in per_table {
            match own.localize_async(node.table_by_id(table), &keys) {
                Ok(ticket) => tickets.push((ticket, windows)),
                Err(Error::ShutDown) => return false,
                Err(e) => tracing::warn!(node = node.config.rank, error = %e, "the intent service could not relocate keys; their accesses go remote"),
            }
        }
        for (ticket, windows) in tickets {
            match own.wait(ticket) {
                Ok(()) => {
                    let state = self.state.lock();
                    let counters = node.core.intent_counters();
                    for w in windows {
                        let clock = state.workers.get(&w.worker).map_or(0, |c| c.clock);
                        counters.note_landed(w.start.checked_sub(clock).filter(|&lead| lead > 0));
                    }
                }
                Err(Error::ShutDown) => return false,
                Err(e) if self.stopped(node) => {
                    tracing::debug!(node = node.config.rank, error = %e, "intent relocation ended by shutdown");
                    return false;
                }
                Err(e) => tracing::warn!(node = node.config.rank, error = %e, "an intent relocation failed; its keys' accesses go remote"),
            }
        }
        true
    }
}
