//! Run-time replicas in the simulation: each node's intent service's replica set — the shipped
//! state machine, [`crate::intent::ReplicaSet`] — driven by a service worker of the node among
//! the random relocations, intents and accesses of a simulated cluster, on a range of keys
//! ([`super::SimOptions::run_time_replicas`]). This file is the simulator's driver of that
//! machine, as `worker::intent::replicas` is the node's: it feeds the machine the homes'
//! grants and random makes, drops and sync rounds (each service step first does what the
//! service's round does: adopt kept replicas, make those of keys that left, retry put-off
//! drops), executes the actions it asks for through the service worker (which bypasses
//! replicas, as the service's does) — a make's pull flagged as making replicas, a routed
//! push-pull, the REPLICA_SYNCs, a drain's push (at the service's next step: a `localize` may
//! come in between, as on a node), a one-sided read of an owner's images (out of its registered
//! buffer) — and hands it their outcomes, the acknowledgements as they arrive, and the loss of
//! an owner. Once the node's workers are done, the service drops every replica and is held to
//! leaving none.
//!
//! The trainers' workers access the keys as usual (no sets: a set goes to the owner, past the
//! replica, which the guarantee leaves out), served by replicas where the protocol finds them.
//! Their histories on these keys are checked against the replica guarantee
//! (`replica_checks.rs`): every read includes each push at most once, none issued after it
//! returned, and every push of its own node acknowledged before it began
//! ([`crate::consistency::check_bounded_staleness`] with no time bound); every read includes
//! every push that was at the key's owner when its value was fetched (for a replica: when the
//! request that last set it — the making pull, the sync, the routed push-pull — was sent; a push
//! is at the owner once acknowledged, or, taken by a replica, once the sync or drain that
//! carried its delta was); and after the run every key's value at its owner holds every push
//! exactly once.

use std::collections::BTreeMap;

use super::{InFlight, ScriptOp, Sim, is_loss, queued};
use crate::intent::{OpToken, ReplicaAction, ReplicaContext, ReplicaSet};
use crate::protocol::{AccessKind, Issued, OpId, PullTarget};

/// What the simulated replica sets did over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaSetCounts {
    /// Pulls sent to make replicas.
    pub pulls: usize,
    /// Replicas installed from a pull.
    pub made: usize,
    /// Of those, replicas whose value took pushes this node sent behind the pull.
    pub made_with_pushes: usize,
    /// Values not installed because the key was here (or had been) since the pull left.
    pub stale: usize,
    /// Replicas a departing key left here, adopted.
    pub kept: usize,
    /// Replicas a sync round found ended by their key landing here (their deltas folded into it).
    pub folded: usize,
    /// Pushes of drained replicas' deltas.
    pub drain_pushes: usize,
    /// Drops put off because the key was arriving here with a delta.
    pub put_off: usize,
    /// Trainer accesses of these keys recorded.
    pub events: usize,
    /// Sync rounds started (that sent REPLICA_SYNCs).
    pub syncs: usize,
    /// Barriers' sync rounds run.
    pub barrier_rounds: usize,
    /// Deltas they took.
    pub synced: usize,
    /// Of those, deltas their owners applied (images read back).
    pub sync_applied: usize,
    /// Deltas sent on through a push-pull (not held where sent, or no believed owner).
    pub sync_routed: usize,
    /// Localizes that waited for a sync round carrying their keys' deltas.
    pub localize_waits: usize,
    /// Reads checked for including every push at the owner when their value was fetched.
    pub fresh_checked: usize,
    /// Service operations (makes, drains, routed syncs) that failed: their node was lost.
    pub failed: usize,
    /// REPLICA_SYNCs given up because their owner was lost.
    pub sync_abandoned: usize,
    /// Keys found lost with their owners (by a home's answer to a REPLICA_SYNC, the node's
    /// own directory as their home, or a failed make or routed sync): their replicas dropped.
    pub lost: usize,
}

/// One node's driver of its replica set.
#[derive(Default)]
pub(super) struct SimReplicaSet {
    /// The node's service worker (an index into the simulation's workers).
    pub(super) worker: usize,
    /// The shipped replica set.
    machine: ReplicaSet,
    /// The node's sync marks, which the replica set and the workers' localizes share.
    pub(super) marks: crate::intent::SyncMarks,
    /// The machine's operations the service worker has in flight.
    ops: Vec<ServiceOp>,
    /// When each action that fetched values was issued (a make's pull, a routed push-pull, a
    /// round's REPLICA_SYNCs): a replica set from its answer includes every push at the owner
    /// then.
    issued_at: BTreeMap<OpToken, u64>,
    /// Per key, the replica's incarnation and a time such that its value includes every push
    /// that was at the owner then (when the request that last set it was sent).
    pub(super) fresh: BTreeMap<u64, (u32, u64)>,
    /// When this node's pushes that replicas took reached their keys' owners: per (key, lane),
    /// the time their delta's delivery was acknowledged.
    pub(super) delivered: BTreeMap<(u64, u32), u64>,
    /// The node's workers are done and the service drops every replica.
    pub(super) stopped: bool,
    /// The sync round in flight is a barrier's: the keys it finds lost wait for the service's
    /// next step, as on a node (the barrier's worker does not drain).
    barrier_round: bool,
}

/// What a service operation in flight is to the machine.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ServiceKind {
    Make,
    Routed,
    Drain,
}

/// A service operation in flight: the simulation's op, the machine's token, what it carries.
struct ServiceOp {
    op: OpId,
    token: OpToken,
    kind: ServiceKind,
    keys: Vec<u64>,
    deltas: Vec<f32>,
}

impl SimReplicaSet {
    /// The replica set of a node whose service worker is `worker`.
    pub(super) fn new(worker: usize) -> SimReplicaSet {
        let mut machine = ReplicaSet::default();
        machine.observe();
        SimReplicaSet { worker, machine, ..SimReplicaSet::default() }
    }

    /// Whether replicas are kept or replica operations are in flight (the service's schedule
    /// keeps rounds coming while so).
    pub(super) fn busy(&self) -> bool {
        self.machine.busy()
    }
}

impl Sim {
    pub(super) fn in_replica_range(&self, key: u64) -> bool {
        self.opts.run_time_replicas.as_ref().is_some_and(|r| r.contains(&key))
    }

    /// Runs `f` on node `node`'s replica set with what it works on.
    pub(super) fn with_replica_set<R>(&mut self, node: usize, f: impl FnOnce(&mut ReplicaSet, &ReplicaContext<'_>) -> R) -> R {
        let core = &self.nodes[node].core;
        let alive = |_: u16| true;
        let set = &mut self.replica_sets[node];
        let ctx = ReplicaContext {
            store: core.store(),
            directory: core.directory(),
            counters: core.intent_counters(),
            alive: &alive,
            max_message_bytes: core.settings().max_message_bytes,
            marks: &set.marks,
        };
        f(&mut set.machine, &ctx)
    }

    /// What the replica set's call came to: an error ends the run, unless it is a loss in a
    /// run with a crash.
    fn replica_outcome(&self, node: usize, outcome: crate::error::Result<()>) -> Result<(), String> {
        match outcome {
            Ok(()) => Ok(()),
            Err(e) if self.opts.crash.is_some() && is_loss(&e) => Ok(()),
            Err(e) => Err(format!("node {node}'s replica set: {e}")),
        }
    }

    /// A home's replicate grant to `node` becomes a make at the front of its service's script.
    pub(super) fn grant_replicas(&mut self, node: usize, keys: Vec<u64>) {
        let keys: Vec<u64> = keys.into_iter().filter(|&k| self.in_replica_range(k)).collect();
        if keys.is_empty() || self.replica_sets.get(node).is_none_or(|s| s.stopped) {
            return;
        }
        let w = self.replica_sets[node].worker;
        self.log(format!("node {node} granted replicas of {keys:?}"));
        self.workers[w].script.push_front(ScriptOp::MakeReplicas { keys, granted: true });
    }

    /// Whether the service worker `w` may take its last step: its node's other workers are
    /// done and nothing of its own is in flight.
    pub(super) fn may_stop_replicas(&self, w: usize) -> bool {
        let node = self.workers[w].node;
        self.workers[w].in_flight.is_empty()
            && !self.replica_sets[node].machine.sync_in_flight()
            && self
                .workers
                .iter()
                .enumerate()
                .all(|(i, o)| i == w || o.node != node || (o.script.is_empty() && o.in_flight.is_empty() && o.streaming.is_none() && o.sync.is_none()))
    }

    /// A service script step of worker `w`: what the service's round does first (adopt the
    /// replicas departing keys left, make those of waited-for keys that left without one, drop
    /// again the put-off ones), then the step's own call, then the actions they ask for.
    pub(super) fn service_step(&mut self, w: usize, op: ScriptOp) -> Result<(), String> {
        let node = self.workers[w].node;
        self.with_replica_set(node, |m, ctx| {
            m.adopt_kept(ctx);
            m.remake(ctx, false);
            m.retry_put_off_drops(ctx);
        });
        match op {
            ScriptOp::MakeReplicas { keys, granted } => {
                self.log(format!("worker {w}@{node} takes a grant of replicas of {keys:?}"));
                if !self.with_replica_set(node, |m, ctx| m.start_make(ctx, 0, &keys)) {
                    return Err("the simulated table keeps no run-time replicas".into());
                }
                // As the service notes a replica grant its replica set took.
                if granted && let Some(service) = self.intent_services.get_mut(node) {
                    service.rounds.replicas_taken(0, &keys);
                    self.declared.replicas += keys.len();
                }
            }
            ScriptOp::DropReplicas { keys } => {
                self.log(format!("worker {w}@{node} drops replicas of {keys:?}"));
                self.with_replica_set(node, |m, ctx| m.drop_keys(ctx, 0, &keys));
            }
            ScriptOp::SyncReplicas => {
                // As the service's round: only while nothing drains or syncs.
                self.with_replica_set(node, |m, ctx| {
                    if m.quiet() && !m.is_empty() {
                        m.start_sync(ctx);
                        m.remake(ctx, true);
                    }
                });
            }
            ScriptOp::SyncReplicasNow => {
                // As a barrier's: once nothing drains or syncs, and no key with a dirty replica
                // here is arriving (the barrier waits for the service meanwhile).
                let ready = self.with_replica_set(node, |m, ctx| m.quiet() && !m.replicas_arriving(ctx));
                if !ready {
                    self.workers[w].script.push_back(ScriptOp::SyncReplicasNow);
                    return self.run_replica_actions(w);
                }
                self.log(format!("worker {w}@{node} runs a barrier's sync round"));
                self.replica_sets[node].barrier_round = true;
                self.replica_counts.barrier_rounds += 1;
                self.with_replica_set(node, |m, ctx| m.sync_now(ctx));
            }
            ScriptOp::StopReplicas => return self.stop_replicas(w),
            _ => return Err("not a service operation".into()),
        }
        self.run_replica_actions(w)
    }

    /// The node's workers are done: drops every replica, and comes back until nothing of the
    /// replica set is in flight; then no replica may be left.
    fn stop_replicas(&mut self, w: usize) -> Result<(), String> {
        let node = self.workers[w].node;
        if !self.replica_sets[node].stopped {
            self.replica_sets[node].stopped = true;
            self.log(format!("worker {w}@{node} stops its replicas"));
            self.with_replica_set(node, |m, ctx| m.begin_stop(ctx));
        }
        self.with_replica_set(node, |m, ctx| m.drop_all(ctx));
        self.run_replica_actions(w)?;
        if !self.replica_sets[node].machine.idle() {
            self.workers[w].script.push_back(ScriptOp::StopReplicas);
            return Ok(());
        }
        let t = self.nodes[node].core.store().table(0);
        if let Some(key) = self.opts.run_time_replicas.clone().into_iter().flatten().find(|&k| t.has_dynamic_replica(k)) {
            let set = self.replica_sets[node].machine.describe(0, key);
            let residence = t.residence(key);
            let localizing = self.replica_sets[node].marks.is_localizing(0, key);
            let set = format!("{set}, localizing {localizing}");
            return Err(format!("node {node}'s replica set stopped with a run-time replica of key {key} left ({residence:?}; {set})"));
        }
        Ok(())
    }

    /// Notes what the replica set set from which answer, drops the keys it found lost, and
    /// executes the actions it asks for, until it asks for none.
    pub(super) fn run_replica_actions(&mut self, w: usize) -> Result<(), String> {
        let node = self.workers[w].node;
        loop {
            self.note_fresh(node);
            let set = &mut self.replica_sets[node];
            set.barrier_round &= set.machine.sync_in_flight();
            if !set.barrier_round {
                self.with_replica_set(node, |m, ctx| m.forget_found_lost(ctx));
            }
            let Some(action) = self.replica_sets[node].machine.poll_action() else { return Ok(()) };
            self.execute_replica_action(w, action)?;
        }
    }

    /// Records, per replica the machine set from an owner's value, when the request that
    /// fetched the value was sent.
    fn note_fresh(&mut self, node: usize) {
        let log = self.replica_sets[node].machine.take_set_log();
        let Some(d) = self.nodes[node].core.store().table(0).dynamic() else { return };
        let set = &mut self.replica_sets[node];
        for (_, key, token) in log {
            if let Some(&at) = set.issued_at.get(&token) {
                set.fresh.insert(key, (d.incarnation(key), at));
            }
        }
    }

    /// Service worker `w` executes one action of its replica set.
    fn execute_replica_action(&mut self, w: usize, action: ReplicaAction) -> Result<(), String> {
        let node = self.workers[w].node;
        let now = self.now;
        match action {
            ReplicaAction::MakePull { op: token, keys, .. } => {
                self.log(format!("worker {w}@{node} pulls {keys:?} to make replicas"));
                self.replica_counts.pulls += 1;
                self.replica_sets[node].issued_at.insert(token, now);
                match self.issue_service_access(w, token, ServiceKind::Make, &keys, &[])? {
                    None => Ok(()),
                    Some(values) => {
                        let outcome = self.with_replica_set(node, |m, ctx| m.handle_pulled(ctx, token, Ok(values)));
                        self.replica_outcome(node, outcome)
                    }
                }
            }
            ReplicaAction::DrainPush { op: token, keys, deltas, .. } => {
                self.log(format!("worker {w}@{node} takes the deltas of dropped replicas {keys:?}, to push next"));
                self.workers[w].script.push_front(ScriptOp::PushDrain { token, keys, deltas });
                Ok(())
            }
            ReplicaAction::RoutedSync { op: token, keys, deltas, .. } => {
                self.log(format!("worker {w}@{node} routes the sync of {keys:?}"));
                self.replica_counts.sync_routed += keys.len();
                self.replica_sets[node].issued_at.insert(token, now);
                match self.issue_service_access(w, token, ServiceKind::Routed, &keys, &deltas)? {
                    None => Ok(()),
                    // The keys landed here since their deltas were taken: applied to them here.
                    Some(values) => {
                        self.note_delivered(node, &keys, &deltas);
                        let outcome = self.with_replica_set(node, |m, ctx| m.handle_pulled(ctx, token, Ok(values)));
                        self.replica_outcome(node, outcome)
                    }
                }
            }
            ReplicaAction::SendSyncs { op: token } => {
                self.replica_counts.syncs += 1;
                self.replica_sets[node].issued_at.insert(token, now);
                // Out of the simulation while the step that sends its messages borrows it (the
                // step touches no replica set).
                let machine = std::mem::take(&mut self.replica_sets[node].machine);
                let syncs = machine.syncs_to_send(token);
                let keys: usize = syncs.iter().map(|s| s.keys.len()).sum();
                self.replica_counts.synced += keys;
                self.log(format!("worker {w}@{node} sends {} REPLICA_SYNCs of {keys} deltas", syncs.len()));
                let sent = self.worker_event(w, |step, _| queued(step.send_replica_syncs(&syncs)));
                drop(syncs);
                self.replica_sets[node].machine = machine;
                sent.map(drop)
            }
            ReplicaAction::ReadImages { op: token, owner, remote, bytes } => {
                self.log(format!("worker {w}@{node} reads {bytes} bytes of images from node {owner}"));
                // As a one-sided read: the bytes as they are now, unless the owner is gone.
                let copy = if self.nodes[owner as usize].crashed {
                    Err(self.nodes[node].core.directory().lost_error(owner))
                } else {
                    let source = self.registered_range(owner as usize, remote, bytes)?;
                    let mut copy = vec![0u8; bytes];
                    // SAFETY: the range was bounds-checked against a region the owner
                    // registered (its image buffer, which the store keeps until it is dropped),
                    // and the simulation is single-threaded, so nothing writes it meanwhile.
                    unsafe { std::ptr::copy_nonoverlapping(source as *const u8, copy.as_mut_ptr(), bytes) };
                    Ok(copy)
                };
                let outcome = self.with_replica_set(node, |m, ctx| m.handle_read(ctx, token, copy));
                self.replica_outcome(node, outcome)
            }
        }
    }

    /// Service worker `w` issued `op`: it waits among the worker's operations in flight.
    fn service_op_issued(&mut self, w: usize, op: ServiceOp) {
        let node = self.workers[w].node;
        let first_event = self.workers[w].events.len();
        self.workers[w].in_flight.push(InFlight {
            op: op.op,
            kind: None,
            keys: Vec::new(),
            buffer: Vec::new(),
            first_event,
            asynchronous: true,
            service: true,
            granted_move: false,
            victim_reads: Vec::new(),
        });
        self.replica_sets[node].ops.push(op);
    }

    /// Sends the remaining parts of the service's operation `op`, as the service's worker does
    /// within its call (a fresh step each; `making`: a pull that makes replicas).
    fn send_all_parts(&mut self, w: usize, op: OpId, keys: &[u64], input: &[f32], making: bool) -> Result<(), String> {
        self.streamed_ops += 1;
        let mut more = true;
        while more {
            more = self
                .worker_event(w, |step, req| {
                    req.making_replicas = making;
                    let more = step.continue_issue(req, op, keys, input, None);
                    req.making_replicas = false;
                    Ok(more)
                })?
                .unwrap_or(false);
        }
        Ok(())
    }

    /// Service worker `w` issues the push of a drain its replica set asked for at an earlier
    /// step (`token`: the machine's; `deltas` of `keys`).
    pub(super) fn issue_drain_push(&mut self, w: usize, token: OpToken, keys: Vec<u64>, deltas: Vec<f32>) -> Result<(), String> {
        let node = self.workers[w].node;
        self.log(format!("worker {w}@{node} pushes the deltas of dropped replicas {keys:?}"));
        self.replica_counts.drain_pushes += 1;
        if self.issue_service_access(w, token, ServiceKind::Drain, &keys, &deltas)?.is_none() {
            return Ok(());
        }
        // Every key landed here since its delta was taken (which its marks keep `localize` from
        // doing): served here, the drain's push is done.
        self.note_delivered(node, &keys, &deltas);
        let outcome = self.with_replica_set(node, |m, ctx| m.handle_pushed(ctx, token, Ok(())));
        self.replica_outcome(node, outcome)?;
        self.run_replica_actions(w)
    }

    /// Service worker `w` issues the access that action `token` of `kind` asks for (a make's
    /// pull, flagged as making replicas; a routed push-pull; a drain's push) on `keys` with
    /// `input`, all its parts within the call as the service's worker does. Returns `None` while
    /// it is in flight (among the worker's operations), or the values it returned when it was
    /// served here at once.
    fn issue_service_access(&mut self, w: usize, token: OpToken, kind: ServiceKind, keys: &[u64], input: &[f32]) -> Result<Option<Vec<f32>>, String> {
        let node = self.workers[w].node;
        let (access, making) = match kind {
            ServiceKind::Make => (AccessKind::Pull, true),
            ServiceKind::Routed => (AccessKind::PushPull, false),
            ServiceKind::Drain => (AccessKind::Push, false),
        };
        let lanes = self.opts.lanes;
        let issued = self.worker_event(w, |step, req| {
            let target = if access.returns_values() { PullTarget::Owned(vec![0.0; keys.len() * lanes]) } else { PullTarget::None };
            req.making_replicas = making;
            let issued = step.issue_access(req, access, 0, keys, input, target, None);
            req.making_replicas = false;
            issued
        })?;
        match issued {
            Some(Issued::Pending { op, more }) => {
                if more {
                    self.send_all_parts(w, op, keys, input, making)?;
                }
                self.service_op_issued(w, ServiceOp { op, token, kind, keys: keys.to_vec(), deltas: input.to_vec() });
                Ok(None)
            }
            Some(Issued::Done(values)) => Ok(Some(values.unwrap_or_default())),
            None => Err(format!("node {node} could not issue the service's {access:?} of {keys:?}")),
        }
    }

    /// A service operation of worker `w` completed: its outcome goes to the replica set.
    pub(super) fn service_op_done(&mut self, w: usize, op: OpId, result: crate::error::Result<Vec<f32>>) -> Result<(), String> {
        let node = self.workers[w].node;
        let Some(i) = self.replica_sets[node].ops.iter().position(|o| o.op == op) else {
            return Err(format!("node {node}'s service completed an operation {op:#x} it did not send"));
        };
        let ServiceOp { token, kind, keys, deltas, .. } = self.replica_sets[node].ops.swap_remove(i);
        match &result {
            Ok(_) if kind != ServiceKind::Make => self.note_delivered(node, &keys, &deltas),
            Ok(_) => {}
            Err(e) => {
                self.replica_counts.failed += 1;
                self.failed_ops += 1;
                self.log(format!("worker {w}@{node}'s service operation {op:#x} failed: {e}"));
            }
        }
        let outcome = self.with_replica_set(node, |m, ctx| match kind {
            ServiceKind::Make | ServiceKind::Routed => m.handle_pulled(ctx, token, result),
            ServiceKind::Drain => m.handle_pushed(ctx, token, result.map(drop)),
        });
        self.replica_outcome(node, outcome)?;
        self.run_replica_actions(w)
    }

    /// Hands every node's replica set the acknowledgements of its REPLICA_SYNCs that arrived,
    /// and gives up those to owners the node knows are lost (their deltas may be lost with
    /// them), as the service's driver does.
    pub(super) fn take_replica_set_acks(&mut self) -> Result<(), String> {
        for node in 0..self.replica_sets.len() {
            if self.nodes[node].crashed || !self.replica_sets[node].machine.sync_in_flight() {
                continue;
            }
            for (owner, id) in self.replica_sets[node].machine.awaiting_acks() {
                let core = &self.nodes[node].core;
                let acks = core.replica_sync_acks();
                let outcome = match acks.take(owner, id) {
                    Some(ack) => {
                        if let Some((keys, deltas)) = self.replica_sets[node].machine.awaited_sync(owner, id) {
                            let lanes = self.opts.lanes;
                            let held = ack.held.iter().filter(|&&i| (i as usize) < keys.len());
                            let (held_keys, held_deltas): (Vec<u64>, Vec<f32>) = (
                                held.clone().map(|&i| keys[i as usize]).collect(),
                                held.flat_map(|&i| deltas[i as usize * lanes..(i as usize + 1) * lanes].iter().copied()).collect(),
                            );
                            self.replica_counts.sync_applied += held_keys.len();
                            self.note_delivered(node, &held_keys, &held_deltas);
                        }
                        self.log(format!("node {node} takes the acknowledgement of REPLICA_SYNC {id} from node {owner}: {} held", ack.held.len()));
                        self.with_replica_set(node, |m, ctx| m.handle_sync_ack(ctx, owner, id, ack))
                    }
                    None if core.directory().is_lost(owner) => {
                        acks.abandon(owner, id);
                        let error = core.directory().lost_error(owner);
                        self.replica_counts.sync_abandoned += 1;
                        self.failed_ops += 1;
                        self.with_replica_set(node, |m, ctx| m.handle_sync_unanswered(ctx, owner, id, error))
                    }
                    None => continue,
                };
                self.replica_outcome(node, outcome)?;
            }
            let w = self.replica_sets[node].worker;
            self.run_replica_actions(w)?;
        }
        Ok(())
    }

    /// What the replica sets did over the run.
    pub(super) fn replica_set_counts(&self) -> ReplicaSetCounts {
        let mut counts = self.replica_counts;
        for (node, set) in self.nodes.iter().zip(&self.replica_sets) {
            let intent = node.core.intent_counters().snapshot();
            let tally = set.machine.tally();
            counts.made += intent.replicas_made as usize;
            counts.made_with_pushes += intent.made_with_pushes as usize;
            counts.kept += intent.replicas_kept as usize;
            counts.lost += intent.replicas_lost as usize;
            counts.stale += tally.stale as usize;
            counts.folded += tally.folded as usize;
            counts.put_off += tally.put_off as usize;
        }
        counts
    }
}
