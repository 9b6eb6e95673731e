//! Declared intents in the simulation ([`super::SimOptions::declared_intents`]): the trainers
//! declare windows of clocks in which they will need keys, and each node's service worker runs
//! the intent service's own state machines — [`crate::intent::IntentRounds`] (windows, action
//! timing, level changes, re-asks, what becomes of the homes' grants) and
//! [`crate::intent::ServiceSchedule`] (when it runs a round, when it takes up grants, when it
//! rests and what wakes it) — among the random relocations, accesses and replica operations.
//! Each time the service worker gets a step it does what its schedule says at the simulated
//! time: a round tells the homes the level changes it finds (dropping the replicas of keys
//! whose intent ended first, as the service does); an act takes up the grants the homes sent
//! back, which the rounds machine turns into the node's granted localizes, replica makes and
//! drops of unwanted replicas; a rest does nothing. Workers report their clocks and
//! declarations to the schedule as they do to the service. A worker's clock here is the number
//! of its script steps so far.

use std::collections::BTreeMap;

use super::{ScriptOp, Sim};
use crate::config::IntentSettings;
use crate::intent::{GrantsTaken, IntentLevel, IntentRounds, Next, ServiceSchedule};

/// The simulated intent service's round time: a few dozen simulated steps (each advances the
/// simulated clock by 1 µs on average), so that its cadence — rounds, stretches, rests for
/// news — plays out many times in a run.
const ROUND_NANOS: u64 = 20_000;

/// A node's intents and its service's schedule.
pub(super) struct SimIntentService {
    /// What the service decides.
    pub rounds: IntentRounds,
    /// When it acts.
    schedule: ServiceSchedule,
}

impl SimIntentService {
    pub(super) fn new() -> SimIntentService {
        let mut schedule = ServiceSchedule::new(ROUND_NANOS, u64::MAX);
        schedule.start(0);
        SimIntentService { rounds: IntentRounds::default(), schedule }
    }
}

/// What the nodes' intent rounds did over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeclaredIntentCounts {
    /// Windows declared.
    pub declared: u64,
    /// Rounds run.
    pub rounds: usize,
    /// Service steps at which its schedule said rest.
    pub rests: usize,
    /// Service steps at which it acted (took up grants and moved along).
    pub acts: usize,
    /// Keys whose level a round told their homes (re-asks included).
    pub levels_told: usize,
    /// Of those, keys no longer needed.
    pub ended: usize,
    /// Keys the homes granted to move here that the machine took (still intended, not here).
    pub moves: usize,
    /// Keys granted a replica that the machine took.
    pub replicas: usize,
    /// Keys granted a replica no longer intended (their marks and replicas dropped).
    pub unwanted: usize,
    /// Holds of the relocations begun (see [`super::SimOptions::hold_relocations`]).
    pub holds: usize,
    /// Service steps at which a hold had settled: no granted move queued or in flight.
    pub settled_steps: usize,
    /// Holds released.
    pub releases: usize,
}

impl Sim {
    /// Trainer `w` declares that it will need `keys` in the `len` clocks that begin `start`
    /// clocks from now.
    pub(super) fn declare_intent(&mut self, w: usize, keys: Vec<u64>, start: u64, len: u64) {
        let (node, index, clock) = (self.workers[w].node, self.workers[w].index, self.workers[w].intent_clock);
        let window = clock + start..clock + start + len;
        self.log(format!("worker {w}@{node} declares {keys:?} in clocks {window:?}"));
        let service = &mut self.intent_services[node];
        self.declared.declared += service.rounds.declare(&IntentSettings::default(), index, 0, keys, window);
        service.schedule.declare(index, clock);
    }

    /// Worker `w` took a script step: its clock advances (and its node's schedule hears of it,
    /// as the service does of a worker's `advance_clock`).
    pub(super) fn advance_intent_clock(&mut self, w: usize) {
        let worker = &mut self.workers[w];
        worker.intent_clock += 1;
        if let Some(service) = self.intent_services.get_mut(worker.node) {
            service.schedule.note_clock(worker.index, worker.intent_clock);
        }
    }

    /// Service worker `w` gets a core: it does what its node's schedule says at the simulated
    /// time.
    pub(super) fn intent_service_step(&mut self, w: usize) -> Result<(), String> {
        let node = self.workers[w].node;
        let grants_waiting = self.nodes[node].core.intent_go_waiting();
        if self.opts.hold_relocations {
            self.hold_or_release(node, grants_waiting)?;
        }
        let busy = self.replica_sets.get(node).is_some_and(|s| s.busy());
        let service = &mut self.intent_services[node];
        service.schedule.set_replicas_busy(busy);
        match service.schedule.next(self.now, grants_waiting) {
            Next::Round { clocks } => self.intent_round(w, &clocks),
            Next::Act => {
                self.declared.acts += 1;
                if grants_waiting && self.intent_services[node].schedule.may_take_up() {
                    self.intent_services[node].schedule.begin_take();
                    let granted = self.nodes[node].core.take_intent_go();
                    self.take_declared_grants(node, granted);
                    self.intent_services[node].schedule.finish_take();
                }
                // The service's localizes go to a trainer's script; the act is idle when none
                // of them is queued there or in flight.
                let idle = self.granted_moves_outstanding(node) == 0;
                self.intent_services[node].schedule.acted(self.now, idle);
                Ok(())
            }
            Next::Rest { .. } => {
                self.declared.rests += 1;
                Ok(())
            }
            Next::Stop => Err("the simulated intent service was stopped".into()),
        }
    }

    /// The granted moves of node `node` that its workers have queued or in flight.
    fn granted_moves_outstanding(&self, node: usize) -> usize {
        self.workers
            .iter()
            .filter(|worker| worker.node == node)
            .map(|worker| {
                worker.script.iter().filter(|op| matches!(op, ScriptOp::Localize { granted: true, .. })).count()
                    + worker.in_flight.iter().filter(|f| f.granted_move).count()
            })
            .sum()
    }

    /// Now and then node `node`'s service holds its relocations or, once they settled, releases
    /// them (see [`super::SimOptions::hold_relocations`]); a settled hold with a granted move
    /// outstanding is a violation.
    fn hold_or_release(&mut self, node: usize, grants_waiting: bool) -> Result<(), String> {
        use rand::Rng;
        let outstanding = self.granted_moves_outstanding(node);
        let schedule = &mut self.intent_services[node].schedule;
        if schedule.moves_settled() {
            if outstanding > 0 {
                return Err(format!("node {node}'s relocations are held and settled, but {outstanding} granted move(s) are queued or in flight"));
            }
            self.declared.settled_steps += 1;
            if self.rng.gen_ratio(1, 8) {
                schedule.release_moves(grants_waiting);
                self.declared.releases += 1;
                self.log(format!("node {node}'s service releases its relocations"));
            }
        } else if schedule.may_take_up() && self.rng.gen_ratio(1, 40) {
            schedule.hold_moves();
            self.declared.holds += 1;
            self.log(format!("node {node}'s service holds its relocations ({outstanding} granted move(s) outstanding)"));
        }
        Ok(())
    }

    /// Service worker `w` runs a round of its node's intents at the workers' `clocks`: the
    /// level changes go to the homes, ends first, the replicas of keys whose intent ended
    /// dropped before; then the round is told to the schedule.
    fn intent_round(&mut self, w: usize, clocks: &BTreeMap<u16, u64>) -> Result<(), String> {
        let node = self.workers[w].node;
        let changes = self.intent_services[node].rounds.round(clocks);
        let (windows, windows_moved) = (!self.intent_services[node].rounds.is_empty(), changes.windows_moved);
        self.declared.rounds += 1;
        for ((level, table), keys) in changes.levels {
            self.declared.levels_told += keys.len();
            if level == IntentLevel::None {
                self.declared.ended += keys.len();
                self.with_replica_set(node, |m, ctx| m.drop_keys(ctx, table, &keys));
            }
            self.log(format!("worker {w}@{node}'s intent round tells the homes {level:?} for {keys:?}"));
            self.worker_event(w, |step, _| {
                step.signal_intent(table, &keys, level);
                Ok(())
            })?;
        }
        for ((level, table), keys) in changes.reasks {
            self.declared.levels_told += keys.len();
            self.log(format!("worker {w}@{node}'s intent round asks the homes again for {keys:?} ({level:?})"));
            for level in [IntentLevel::None, level] {
                self.worker_event(w, |step, _| {
                    step.signal_intent(table, &keys, level);
                    Ok(())
                })?;
            }
        }
        self.intent_services[node].schedule.round_told(windows, windows_moved);
        self.run_replica_actions(w)
    }

    /// Node `node`'s intents take the homes' `granted` moves and replicas: the moves become
    /// granted localizes of a trainer, the replicas makes of the service, the unwanted ones
    /// drops.
    fn take_declared_grants(&mut self, node: usize, granted: Vec<(u16, crate::protocol::Grant, Vec<u64>)>) {
        let store = self.nodes[node].core.store().clone();
        let GrantsTaken { moves, replicate, unwanted } = self.intent_services[node].rounds.take_grants(granted, |t, k| store.table(t).slot_of(k).is_some());
        let service = self.replica_sets.get(node).map(|s| s.worker);
        for (_, keys) in unwanted {
            self.declared.unwanted += keys.len();
            if let Some(s) = service {
                self.workers[s].script.push_front(ScriptOp::DropReplicas { keys });
            }
        }
        for (_, keys) in replicate {
            self.grant_replicas(node, keys);
        }
        let Some(w) = (0..self.workers.len()).find(|&w| self.workers[w].node == node) else { return };
        for (_, keys) in moves {
            self.declared.moves += keys.len();
            self.intent_grants += keys.len();
            self.log(format!("node {node}'s intents take the move of {keys:?}: worker {w} localizes them"));
            let asynchronous = !self.opts.location_caches;
            self.workers[w].script.push_front(ScriptOp::Localize { keys, asynchronous, granted: true });
        }
    }
}
