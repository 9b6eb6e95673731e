//! Run-time replicas in the simulation: the intent service's replica set (`runtime::intent::replicas`)
//! driven by a service worker of each node, among the random relocations, intents and accesses
//! of a simulated cluster, on a range of keys ([`super::SimOptions::run_time_replicas`]).
//!
//! The service worker bypasses replicas, as the service's does, and follows the service's
//! rules step by step, calling the same store and replica functions where the service's code
//! can be shared (`Store::install_made_replica`, `take_table_deltas`, `drop_replica`,
//! `end_drained_replica`, `end_making`, `set_replica`, `believed_owner`); the bookkeeping
//! around them (which keys are made, wanted, draining, put off) is a copy in miniature of
//! `ReplicaSet` and `SyncRound`, whose own code needs a running node:
//!
//! - a replica is made from a pull sent with the making flag (the protocol adds up the pushes
//!   this node sends behind it) and installed, with those pushes, unless the key was here since
//!   the pull left; a key held or arriving here is marked wanted, and its departure keeps its
//!   value as a replica, which the service adopts;
//! - a **sync round** takes each replica's delta under its latch (none of a key arriving here or
//!   about to be localized here, whose landing adds it), sends the deltas in one REPLICA_SYNC per
//!   believed owner (where the key was last found, else its home; a replica made with pushes
//!   sent behind its pull syncs by the home first), reads the images of the items the owner
//!   applied out of its registered buffer (as the one-sided read does) and refreshes those
//!   replicas, and sends the others on through a push-pull the homes route, whose answer
//!   refreshes them; a `localize` of a key whose delta a round carries waits for the round (a
//!   worker's; a granted move is put off), as `Worker::localize` does;
//! - a dropped replica's delta is pushed to the owner and the replica drains — serves this
//!   node's workers — until that push is acknowledged and no round is in flight, and drains
//!   again with what was pushed to it meanwhile; a dirty replica of a key arriving here keeps its
//!   delta for the landing, which folds it into the key; a grant of a draining or put-off key
//!   keeps its replica.
//!
//! Grants to replicate from the homes (intent) and random makes, drops and sync rounds drive
//! it; once the node's workers are done, the service drops every replica and waits until none
//! is left. The trainers' workers access the keys as usual (no sets: a set goes to the owner,
//! past the replica, which the guarantee leaves out), served by replicas where the protocol
//! finds them.
//!
//! Their histories on these keys are checked against the replica guarantee: every read
//! includes each push at most once, none issued after it returned, and every push of its own
//! node acknowledged before it began ([`crate::consistency::check_bounded_staleness`] with no
//! time bound); every read includes every push that was at the key's owner when its value was
//! fetched (for a replica: when the request that last set it — the making pull, the sync, the
//! routed push-pull — was sent; a push is at the owner once acknowledged, or, taken by a
//! replica, once the sync or drain that carried its delta was); and after the run every key's
//! value at its owner holds every push exactly once.

use std::collections::{BTreeMap, BTreeSet};

use crate::util::FastSet;

use super::{InFlight, ScriptOp, Served, Sim, queued};
use crate::consistency::{Event, TimedPull, TimedPush, Violation, check_bounded_staleness};
use crate::intent::{
    Drained, Dropped, TakenDeltas, believed_owner, drop_replica, end_drained_replica, end_making, lost_key_among, set_replica, take_table_deltas,
};
use crate::protocol::{AccessKind, Issued, LOST_OWNER, OpId, OutgoingSync, PullTarget};
use crate::store::{MadeReplica, Residence};

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
    /// Replicas ended by their key landing here (their deltas folded into it).
    pub folded: usize,
    /// Pushes of drained replicas' deltas.
    pub drain_pushes: usize,
    /// Drops put off because the key was arriving here with a delta.
    pub put_off: usize,
    /// Trainer accesses of these keys recorded.
    pub events: usize,
    /// Sync rounds started.
    pub syncs: usize,
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

/// One node's simulated replica set (the intent service's `ReplicaSet`, in miniature).
#[derive(Default)]
pub(super) struct SimReplicaSet {
    /// The node's service worker (an index into the simulation's workers).
    pub(super) worker: usize,
    /// Keys with a replica made or adopted here (the store is the authority).
    replicas: FastSet<u64>,
    /// Keys whose replicas are being made (a drop takes a key out).
    making: BTreeSet<u64>,
    /// Keys with a pull in flight (dropped or not): a key wanted again is made from it.
    pulling: BTreeSet<u64>,
    /// Keys wanted while held or arriving here: marked in the store, made when they leave.
    awaiting: BTreeSet<u64>,
    /// Draining keys and the id of their latest drain.
    draining: BTreeMap<u64, u32>,
    drain_id: u32,
    /// Dirty replicas of keys that were arriving when dropped.
    put_off: BTreeSet<u64>,
    /// Make pulls in flight: op, keys, incarnations, when the pull was issued.
    makes: Vec<(OpId, Vec<u64>, Vec<u32>, u64)>,
    /// Drain pushes in flight.
    drains: Vec<SimDrain>,
    /// Drain pushes whose deltas were taken but that the service has not issued yet (it does
    /// at its next step, as the service issues a drain's push after taking its deltas: a
    /// `localize` may come in between).
    drain_pushes_due: usize,
    /// Per key, the replica's incarnation and a time such that its value includes every push
    /// that was at the owner then (when the request that last set it was sent).
    fresh: BTreeMap<u64, (u32, u64)>,
    /// When this node's pushes that replicas took reached their keys' owners: per (key, lane),
    /// the time their delta's delivery was acknowledged.
    delivered: BTreeMap<(u64, u32), u64>,
    /// Drains waiting for the sync round in flight to end (their pushes completed, or their
    /// replicas had no delta): drain id, keys, keys marked until the drain ends.
    drains_after_sync: Vec<(u32, Vec<u64>, Vec<u64>)>,
    /// The sync round in flight.
    syncing: Option<SimSyncRound>,
    /// The last REPLICA_SYNC id.
    sync_id: u32,
    /// Where keys were found when not at their homes (`OwnerHints`).
    hints: BTreeMap<u64, u16>,
    /// Keys found lost with their owners: no replica is made of them again.
    lost: BTreeSet<u64>,
    /// The node's workers are done and every replica was dropped.
    pub(super) stopped: bool,
}

/// A sync round in flight (`runtime::intent::sync_round::SyncRound`, in miniature).
#[derive(Default)]
struct SimSyncRound {
    /// REPLICA_SYNCs waiting for their acknowledgements: owner, id, keys, deltas.
    parts: Vec<(u16, u32, Vec<u64>, Vec<f32>)>,
    /// When they were sent.
    sent_at: u64,
    /// Push-pulls of deltas whose keys were not where they were sent: op, keys, deltas, when
    /// issued.
    routed: Vec<(OpId, Vec<u64>, Vec<f32>, u64)>,
    /// Replicas that ended or were kept anew since the round started: not refreshed by it.
    left_out: BTreeSet<u64>,
    /// Each key's replica incarnation when its delta was taken.
    incarnations: BTreeMap<u64, u32>,
    /// The keys marked as carried by the round.
    marked: Vec<u64>,
}

impl SimReplicaSet {
    /// The replica set of a node whose service worker is `worker`.
    pub(super) fn new(worker: usize) -> SimReplicaSet {
        SimReplicaSet { worker, ..SimReplicaSet::default() }
    }

    fn next_drain(&mut self) -> u32 {
        self.drain_id = self.drain_id.wrapping_add(1);
        self.drain_id
    }

    /// Whether no sync round is in flight and no replica drains (`ReplicaSet::quiet`): a sync
    /// round may start.
    fn quiet(&self) -> bool {
        self.syncing.is_none() && self.drains.is_empty() && self.drains_after_sync.is_empty() && self.drain_pushes_due == 0
    }
}

/// A drain's push in flight (`ReplicaSet`'s `Drain`).
struct SimDrain {
    op: OpId,
    id: u32,
    keys: Vec<u64>,
    deltas: Vec<f32>,
    /// Keys marked as carried until the drain ends.
    marked: Vec<u64>,
}

impl Sim {
    fn replica_set(&mut self, node: usize) -> &mut SimReplicaSet {
        &mut self.replica_sets[node]
    }

    fn in_replica_range(&self, key: u64) -> bool {
        self.opts.run_time_replicas.as_ref().is_some_and(|r| r.contains(&key))
    }

    /// A home's replicate grant to `node` becomes a make at the front of its service's script.
    pub(super) fn grant_replicas(&mut self, node: usize, keys: Vec<u64>) {
        let keys: Vec<u64> = keys.into_iter().filter(|&k| self.in_replica_range(k)).collect();
        if keys.is_empty() || self.replica_sets.get(node).is_none_or(|s| s.stopped) {
            return;
        }
        let w = self.replica_sets[node].worker;
        self.log(format!("node {node} granted replicas of {keys:?}"));
        self.workers[w].script.push_front(ScriptOp::MakeReplicas { keys });
    }

    /// Whether the service worker `w` may take its last step: its node's other workers are
    /// done and nothing of its own is in flight.
    pub(super) fn may_stop_replicas(&self, w: usize) -> bool {
        let node = self.workers[w].node;
        self.workers[w].in_flight.is_empty()
            && self.replica_sets[node].syncing.is_none()
            && self
                .workers
                .iter()
                .enumerate()
                .all(|(i, o)| i == w || o.node != node || (o.script.is_empty() && o.in_flight.is_empty() && o.streaming.is_none() && o.sync.is_none()))
    }

    /// The bookkeeping of every service step: adopts replicas departing keys left here, notes
    /// those a landing ended, makes those of waited-for keys that left without one, and drops
    /// again the put-off ones.
    fn replica_set_round(&mut self, w: usize) -> Result<(), String> {
        let node = self.workers[w].node;
        let store = self.nodes[node].core.store().clone();
        let t = store.table(0);
        let Some(d) = t.dynamic() else { return Err("the simulated table keeps no run-time replicas".into()) };
        let mut adopted = 0;
        for key in d.take_kept() {
            if t.has_dynamic_replica(key) && self.replica_sets[node].replicas.insert(key) {
                adopted += 1;
                if let Some(round) = &mut self.replica_sets[node].syncing {
                    round.left_out.insert(key);
                }
                if self.replica_sets[node].awaiting.remove(&key) {
                    d.want(key, false);
                }
            }
        }
        self.replica_counts.kept += adopted;
        let set = &mut self.replica_sets[node];
        let landed: Vec<u64> = set.replicas.iter().copied().filter(|&k| !t.has_dynamic_replica(k) && t.residence(k) != Residence::Away).collect();
        for k in &landed {
            set.replicas.remove(k);
        }
        self.replica_counts.folded += landed.len();
        let set = &mut self.replica_sets[node];
        let left: Vec<u64> = set.awaiting.iter().copied().filter(|&k| t.residence(k) == Residence::Away).collect();
        let mut remake = Vec::new();
        for key in left {
            set.awaiting.remove(&key);
            d.want(key, false);
            if !t.has_dynamic_replica(key) {
                remake.push(key);
            } else {
                set.replicas.insert(key);
            }
        }
        if !remake.is_empty() {
            self.make_replicas(w, remake)?;
        }
        let put_off: Vec<u64> = std::mem::take(&mut self.replica_sets[node].put_off).into_iter().collect();
        if !put_off.is_empty() {
            self.drop_replicas(w, put_off, true, false)?;
        }
        Ok(())
    }

    /// Service worker `w` makes replicas of `keys` (`ReplicaSet::start_make`).
    pub(super) fn make_replicas(&mut self, w: usize, keys: Vec<u64>) -> Result<(), String> {
        let node = self.workers[w].node;
        let store = self.nodes[node].core.store().clone();
        let t = store.table(0);
        let Some(d) = t.dynamic() else { return Err("the simulated table keeps no run-time replicas".into()) };
        let set = &mut self.replica_sets[node];
        let mut wanted = Vec::new();
        // A grant its home sent before it learnt of the loss.
        for &key in keys.iter().filter(|k| !set.lost.contains(k)) {
            // A drained or put-off replica wanted again stays.
            if (set.put_off.remove(&key) || set.draining.remove(&key).is_some()) && t.has_dynamic_replica(key) {
                set.replicas.insert(key);
            }
            if t.residence(key) != Residence::Away {
                if set.awaiting.insert(key) {
                    d.want(key, true);
                }
                continue;
            }
            if t.has_dynamic_replica(key) || set.making.contains(&key) || wanted.contains(&key) {
                continue;
            }
            if set.pulling.contains(&key) {
                set.making.insert(key);
                continue;
            }
            wanted.push(key);
        }
        if wanted.is_empty() {
            return Ok(());
        }
        let incarnations: Vec<u32> = wanted.iter().map(|&k| d.incarnation(k)).collect();
        let now = self.now;
        self.log(format!("worker {w}@{node} pulls {wanted:?} to make replicas"));
        let lanes = self.opts.lanes;
        let issued = self.worker_event(w, |step, req| {
            req.making_replicas = true;
            let issued = step.issue_access(req, AccessKind::Pull, 0, &wanted, &[], PullTarget::Owned(vec![0.0; wanted.len() * lanes]), None);
            req.making_replicas = false;
            issued
        })?;
        let op = match issued {
            Some(Issued::Pending { op, more }) => {
                if more {
                    self.send_all_parts(w, op, &wanted, &[], true)?;
                }
                op
            }
            Some(Issued::Done(_)) => return Err(format!("a pull of keys elsewhere ({wanted:?}) was served at node {node}")),
            None => return Err(format!("node {node} could not send a pull to make replicas")),
        };
        self.replica_counts.pulls += 1;
        let set = &mut self.replica_sets[node];
        set.making.extend(&wanted);
        set.pulling.extend(&wanted);
        set.makes.push((op, wanted, incarnations, now));
        let first_event = self.workers[w].events.len();
        self.workers[w].in_flight.push(InFlight { op, kind: None, keys: Vec::new(), buffer: Vec::new(), first_event, asynchronous: true, service: true });
        Ok(())
    }

    /// Service worker `w` drops the replicas of `keys` (`ReplicaSet::drop_keys`); `retry`: the
    /// put-off drops of an earlier step; `stopping`: the service stops (`ReplicaSet::drop_all`).
    pub(super) fn drop_replicas(&mut self, w: usize, keys: Vec<u64>, retry: bool, stopping: bool) -> Result<(), String> {
        let node = self.workers[w].node;
        let store = self.nodes[node].core.store().clone();
        let t = store.table(0);
        let Some(d) = t.dynamic() else { return Err("the simulated table keeps no run-time replicas".into()) };
        let value_len = t.value_len();
        let (mut pushed, mut deltas, mut waiting, mut marked) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut delta = vec![0.0; value_len];
        let zero = vec![0.0; value_len];
        let set = &mut self.replica_sets[node];
        if let Some(round) = &mut set.syncing {
            round.left_out.extend(&keys);
        }
        let mut taker = d.sync_taker();
        for key in keys {
            set.making.remove(&key);
            set.hints.remove(&key);
            if set.awaiting.remove(&key) {
                d.want(key, false);
            }
            if set.draining.contains_key(&key) || pushed.contains(&key) {
                continue;
            }
            set.replicas.remove(&key);
            let guard = store.lock(0, key);
            match drop_replica(&store, &guard, &mut delta, &zero, stopping, set.syncing.is_some(), Some(&mut taker)) {
                Dropped::Nothing | Dropped::Removed => {}
                Dropped::PutOff => {
                    set.put_off.insert(key);
                    if !retry {
                        self.replica_counts.put_off += 1;
                    }
                }
                Dropped::Push { marked: m } => {
                    pushed.push(key);
                    deltas.extend_from_slice(&delta);
                    if m {
                        marked.push(key);
                    }
                }
                Dropped::WaitForRound => waiting.push(key),
            }
        }
        drop(taker);
        if !waiting.is_empty() {
            let id = set.next_drain();
            set.draining.extend(waiting.iter().map(|&k| (k, id)));
            set.drains_after_sync.push((id, waiting, Vec::new()));
        }
        self.push_drain(w, pushed, deltas, marked)
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

    /// Pushes dropped replicas' `deltas` to the owners at service worker `w`'s next step; the
    /// replicas drain until it completes, and the `marked` keys' marks end with the drain.
    fn push_drain(&mut self, w: usize, keys: Vec<u64>, deltas: Vec<f32>, marked: Vec<u64>) -> Result<(), String> {
        if keys.is_empty() {
            return Ok(());
        }
        let node = self.workers[w].node;
        // The drain is the replicas' own from now on: a drop or a round finds them draining.
        let set = self.replica_set(node);
        let id = set.next_drain();
        set.draining.extend(keys.iter().map(|&k| (k, id)));
        set.drain_pushes_due += 1;
        self.log(format!("worker {w}@{node} takes the deltas of dropped replicas {keys:?} (drain {id})"));
        self.workers[w].script.push_front(ScriptOp::PushDrain { id, keys, deltas, marked });
        Ok(())
    }

    /// Service worker `w` issues drain `id`'s push of `deltas` of `keys`, taken at an earlier
    /// step (see [`Sim::push_drain`]).
    pub(super) fn issue_drain_push(&mut self, w: usize, id: u32, keys: Vec<u64>, deltas: Vec<f32>, marked: Vec<u64>) -> Result<(), String> {
        let node = self.workers[w].node;
        self.replica_set(node).drain_pushes_due -= 1;
        self.log(format!("worker {w}@{node} pushes the deltas of dropped replicas {keys:?}"));
        let issued = self.worker_event(w, |step, req| step.issue_access(req, AccessKind::Push, 0, &keys, &deltas, PullTarget::None, None))?;
        let op = match issued {
            Some(Issued::Pending { op, more }) => {
                if more {
                    self.send_all_parts(w, op, &keys, &deltas, false)?;
                }
                op
            }
            Some(Issued::Done(_)) => {
                // Every key landed here since its delta was taken (which its marks keep
                // `localize` from doing): served here, the drain is done.
                self.replica_counts.drain_pushes += 1;
                self.log(format!("worker {w}@{node}'s push of drained deltas of {keys:?} was served here"));
                return self.drain_pushed(w, id, keys, &deltas, marked);
            }
            None => return Err(format!("node {node} could not push the drained deltas of {keys:?}")),
        };
        self.replica_counts.drain_pushes += 1;
        self.replica_set(node).drains.push(SimDrain { op, id, keys, deltas, marked });
        let first_event = self.workers[w].events.len();
        self.workers[w].in_flight.push(InFlight { op, kind: None, keys: Vec::new(), buffer: Vec::new(), first_event, asynchronous: true, service: true });
        Ok(())
    }

    /// A service operation of worker `w` completed: installs made replicas, or ends a drain
    /// (`ReplicaSet::poll`, `end_drain`).
    pub(super) fn service_op_done(&mut self, w: usize, op: OpId, result: crate::error::Result<Vec<f32>>) -> Result<(), String> {
        let node = self.workers[w].node;
        let values = match result {
            Ok(values) => values,
            Err(e) if self.opts.crash.is_some() && super::is_loss(&e) => return self.service_op_failed(w, op, &e),
            Err(e) => return Err(format!("service operation {op:#x} of node {node} failed: {e}")),
        };
        let store = self.nodes[node].core.store().clone();
        let set = &mut self.replica_sets[node];
        if let Some(i) = set.makes.iter().position(|m| m.0 == op) {
            let (_, keys, incarnations, issued) = set.makes.swap_remove(i);
            if values.len() != keys.len() * self.opts.lanes {
                return Err(format!("a pull to make replicas of {} keys returned {} values", keys.len(), values.len()));
            }
            for ((&key, &incarnation), value) in keys.iter().zip(&incarnations).zip(values.chunks_exact(self.opts.lanes)) {
                let set = &mut self.replica_sets[node];
                set.pulling.remove(&key);
                let wanted = set.making.remove(&key);
                match store.install_made_replica(0, key, incarnation, wanted, value).map_err(|e| e.to_string())? {
                    MadeReplica::Installed { with_pushes } => {
                        set.replicas.insert(key);
                        if let Some(d) = store.table(0).dynamic() {
                            set.fresh.insert(key, (d.incarnation(key), issued));
                        }
                        if with_pushes {
                            // Its first sync goes the way those pushes went: by the home.
                            set.hints.remove(&key);
                        }
                        self.replica_counts.made += 1;
                        self.replica_counts.made_with_pushes += with_pushes as usize;
                    }
                    MadeReplica::Stale if wanted => {
                        // Held here: made when it leaves; elsewhere again: made anew.
                        self.replica_counts.stale += 1;
                        if set.awaiting.insert(key)
                            && let Some(d) = store.table(0).dynamic()
                        {
                            d.want(key, true);
                        }
                    }
                    _ => {}
                }
            }
            self.log(format!("worker {w}@{node} installs the replicas of {keys:?}"));
            return Ok(());
        }
        if let Some(i) = set.syncing.as_ref().and_then(|r| r.routed.iter().position(|x| x.0 == op)) {
            let round = set.syncing.as_mut().expect("found in it");
            let (_, keys, deltas, issued) = round.routed.swap_remove(i);
            self.note_delivered(node, &keys, &deltas);
            self.refresh_routed(w, &keys, &values, issued)?;
            return self.end_sync_if_done(w);
        }
        let Some(i) = set.drains.iter().position(|d| d.op == op) else {
            return Err(format!("node {node}'s service completed an operation {op:#x} it did not send"));
        };
        let SimDrain { id, keys, deltas, marked, .. } = set.drains.swap_remove(i);
        self.drain_pushed(w, id, keys, &deltas, marked)
    }

    /// A service operation of worker `w` failed (a node it needed was lost), as
    /// `ReplicaSet::poll` and `SyncRound::poll` take it: a make's replicas are not made (their
    /// making ends), a routed sync's replicas keep their values until the next round, and a
    /// drain ends all the same (its deltas went wherever its push went: lost with the owner, or
    /// applied).
    fn service_op_failed(&mut self, w: usize, op: OpId, error: &crate::error::Error) -> Result<(), String> {
        let node = self.workers[w].node;
        self.replica_counts.failed += 1;
        self.failed_ops += 1;
        self.log(format!("worker {w}@{node}'s service operation {op:#x} failed: {error}"));
        let store = self.nodes[node].core.store().clone();
        let set = &mut self.replica_sets[node];
        if let Some(i) = set.makes.iter().position(|m| m.0 == op) {
            let (_, keys, _, _) = set.makes.swap_remove(i);
            for key in &keys {
                set.pulling.remove(key);
                set.making.remove(key);
            }
            end_making(&store, 0, &keys);
            return self.forget_lost(w, lost_key_among(error, &keys).into_iter().collect());
        }
        if let Some(round) = set.syncing.as_mut()
            && let Some(i) = round.routed.iter().position(|x| x.0 == op)
        {
            let (_, keys, _, _) = round.routed.swap_remove(i);
            self.forget_lost(w, lost_key_among(error, &keys).into_iter().collect())?;
            return self.end_sync_if_done(w);
        }
        let Some(i) = set.drains.iter().position(|d| d.op == op) else {
            return Err(format!("node {node}'s service lost an operation {op:#x} it did not send"));
        };
        let SimDrain { id, keys, marked, .. } = set.drains.swap_remove(i);
        self.end_drain_after_sync(w, id, keys, marked)
    }

    /// The push of service worker `w`'s drain `id` (`deltas` of `keys`, `marked` keys)
    /// completed: its deltas are at the owners; the drain ends, or waits for the sync round in
    /// flight, which may carry an earlier delta of its keys.
    fn drain_pushed(&mut self, w: usize, id: u32, keys: Vec<u64>, deltas: &[f32], marked: Vec<u64>) -> Result<(), String> {
        self.note_delivered(self.workers[w].node, &keys, deltas);
        self.end_drain_after_sync(w, id, keys, marked)
    }

    /// Ends drain `id` of service worker `w`, whose push completed, or has it wait for the sync
    /// round in flight, which may carry an earlier delta of its keys.
    fn end_drain_after_sync(&mut self, w: usize, id: u32, keys: Vec<u64>, marked: Vec<u64>) -> Result<(), String> {
        let set = &mut self.replica_sets[self.workers[w].node];
        if set.syncing.is_some() {
            set.drains_after_sync.push((id, keys, marked));
            return Ok(());
        }
        self.end_drain(w, id, keys, marked)
    }

    /// Ends drain `id` of service worker `w` (`ReplicaSet::end_drain`).
    fn end_drain(&mut self, w: usize, id: u32, keys: Vec<u64>, marked: Vec<u64>) -> Result<(), String> {
        let node = self.workers[w].node;
        let store = self.nodes[node].core.store().clone();
        let Some(d) = store.table(0).dynamic() else { return Err("the simulated table keeps no run-time replicas".into()) };
        // Its push reached the owner: a `localize` of its keys may go on.
        d.end_sync(&marked);
        let set = &mut self.replica_sets[node];
        let value_len = store.table(0).value_len();
        let (mut again, mut deltas) = (Vec::new(), Vec::new());
        let mut delta = vec![0.0; value_len];
        let zero = vec![0.0; value_len];
        let mut taker = d.sync_taker();
        for key in keys {
            if set.draining.get(&key) != Some(&id) {
                continue;
            }
            set.draining.remove(&key);
            let guard = store.lock(0, key);
            // Never the last drain: the simulator's service drains before it stops.
            match end_drained_replica(&store, &guard, &mut delta, &zero, false, Some(&mut taker)) {
                Drained::Ended => {}
                Drained::PutOff => {
                    set.put_off.insert(key);
                }
                Drained::Again => {
                    again.push(key);
                    deltas.extend_from_slice(&delta);
                }
                Drained::Removed { .. } => return Err(format!("replica of key {key} removed with its delta by a drain that is not the last")),
            }
        }
        drop(taker);
        self.log(format!("worker {w}@{node} ends drain {id} ({} again)", again.len()));
        // Every key drained again was marked (a refused one was put off).
        self.push_drain(w, again.clone(), deltas, again)
    }

    /// Starts a sync round of service worker `w`'s replicas unless one is in flight or a
    /// replica drains (`ReplicaSet::start_sync`, `SyncRound::start`): each delta taken under
    /// its latch goes in a REPLICA_SYNC to the node believed to own its key, or through a
    /// push-pull the homes route when none is.
    fn start_sync(&mut self, w: usize) -> Result<(), String> {
        let node = self.workers[w].node;
        if !self.replica_sets[node].quiet() {
            return Ok(());
        }
        let store = self.nodes[node].core.store().clone();
        let set = &mut self.replica_sets[node];
        let mut arrived = 0;
        let (taken, marked) = take_table_deltas(&store, 0, &mut set.replicas, |_| arrived += 1);
        self.replica_counts.folded += arrived;
        let Some(TakenDeltas { keys, deltas, incarnations, .. }) = taken else {
            if let Some(d) = store.table(0).dynamic() {
                d.end_sync(&marked);
            }
            return Ok(());
        };
        let lanes = self.opts.lanes;
        let dir = self.nodes[node].core.directory();
        let mut by_owner: BTreeMap<u16, (Vec<u64>, Vec<f32>)> = BTreeMap::new();
        let mut routed = (Vec::new(), Vec::new());
        let mut lost = Vec::new();
        for (&key, delta) in keys.iter().zip(deltas.chunks_exact(lanes)) {
            let (k, d) = match believed_owner(dir, set.hints.get(&key).copied(), 0, key, |_| true) {
                Some(owner) => by_owner.entry(owner).or_default(),
                None if dir.knows_lost(0, key) => {
                    lost.push(key);
                    continue;
                }
                None => &mut routed,
            };
            k.push(key);
            d.extend_from_slice(delta);
        }
        let mut round = SimSyncRound { incarnations: keys.iter().copied().zip(incarnations).collect(), marked, sent_at: self.now, ..SimSyncRound::default() };
        for (owner, (keys, deltas)) in by_owner {
            set.sync_id = set.sync_id.wrapping_add(1);
            round.parts.push((owner, set.sync_id, keys, deltas));
        }
        self.replica_counts.syncs += 1;
        self.replica_counts.synced += keys.len();
        self.log(format!("worker {w}@{node} syncs {keys:?}: {} messages, {} keys routed", round.parts.len(), routed.0.len()));
        let parts = round.parts.clone();
        self.replica_sets[node].syncing = Some(round);
        let syncs: Vec<OutgoingSync<'_>> =
            parts.iter().map(|(owner, id, keys, deltas)| OutgoingSync { owner: *owner, table: 0, id: *id, offset: 0, keys, deltas }).collect();
        self.worker_event(w, |step, _| queued(step.send_replica_syncs(&syncs)))?;
        if !routed.0.is_empty() {
            self.route_sync(w, routed.0, routed.1)?;
        }
        self.forget_lost(w, lost)?;
        self.end_sync_if_done(w)
    }

    /// Service worker `w`'s node found `keys` lost with their owners (`ReplicaSet::forget_lost`):
    /// their replicas drop, and none is made of them again.
    fn forget_lost(&mut self, w: usize, keys: Vec<u64>) -> Result<(), String> {
        let node = self.workers[w].node;
        let set = &mut self.replica_sets[node];
        let fresh: Vec<u64> = keys.into_iter().filter(|&k| set.lost.insert(k)).collect();
        if fresh.is_empty() {
            return Ok(());
        }
        self.replica_counts.lost += fresh.len();
        self.log(format!("worker {w}@{node} drops the replicas of {fresh:?}, lost with their owner"));
        self.drop_replicas(w, fresh, false, false)
    }

    /// Sends deltas of keys that were not where a sync sent them (or had no believed owner)
    /// through a push-pull of service worker `w`, whose answer refreshes them.
    fn route_sync(&mut self, w: usize, keys: Vec<u64>, deltas: Vec<f32>) -> Result<(), String> {
        let node = self.workers[w].node;
        self.replica_counts.sync_routed += keys.len();
        let (lanes, now) = (self.opts.lanes, self.now);
        let issued = self.worker_event(w, |step, req| {
            step.issue_access(req, AccessKind::PushPull, 0, &keys, &deltas, PullTarget::Owned(vec![0.0; keys.len() * lanes]), None)
        })?;
        let op = match issued {
            Some(Issued::Pending { op, more }) => {
                if more {
                    self.send_all_parts(w, op, &keys, &deltas, false)?;
                }
                op
            }
            // The keys landed here since their deltas were taken: applied to them here.
            Some(Issued::Done(values)) => return self.refresh_routed(w, &keys, &values.unwrap_or_default(), now),
            None => return Err(format!("node {node} could not route the sync of {keys:?}")),
        };
        if let Some(round) = &mut self.replica_sets[node].syncing {
            round.routed.push((op, keys, deltas, now));
        }
        let first_event = self.workers[w].events.len();
        self.workers[w].in_flight.push(InFlight { op, kind: None, keys: Vec::new(), buffer: Vec::new(), first_event, asynchronous: true, service: true });
        Ok(())
    }

    /// Refreshes the replicas of `keys` from a routed sync's answer `values` (those still of the
    /// incarnation their deltas were taken from and not left out).
    fn refresh_routed(&mut self, w: usize, keys: &[u64], values: &[f32], issued: u64) -> Result<(), String> {
        let node = self.workers[w].node;
        let lanes = self.opts.lanes;
        if values.len() != keys.len() * lanes {
            return Err(format!("a routed sync of {} keys returned {} values", keys.len(), values.len()));
        }
        let store = self.nodes[node].core.store().clone();
        let set = &mut self.replica_sets[node];
        let Some(round) = &set.syncing else { return Err("a routed sync completed outside its round".into()) };
        let mut delta = vec![0.0; lanes];
        for (&key, value) in keys.iter().zip(values.chunks_exact(lanes)) {
            if let Some(&incarnation) = round.incarnations.get(&key).filter(|_| !round.left_out.contains(&key))
                && set_replica(&store, 0, key, incarnation, &mut value.to_vec(), &mut delta)
            {
                set.fresh.insert(key, (incarnation, issued));
            }
        }
        self.log(format!("worker {w}@{node} refreshes {keys:?} from a routed sync"));
        Ok(())
    }

    /// Hands every node's sync round the acknowledgements that arrived: reads the images of
    /// the applied items out of the owner's registered buffer (as the one-sided read does),
    /// refreshes their replicas, and routes the others (`SyncRound::complete`).
    pub(super) fn take_replica_set_acks(&mut self) -> Result<(), String> {
        for node in 0..self.replica_sets.len() {
            if self.nodes[node].crashed {
                continue;
            }
            let Some(round) = &mut self.replica_sets[node].syncing else { continue };
            let core = &self.nodes[node].core;
            let acks = core.replica_sync_acks();
            let mut arrived = Vec::new();
            let mut abandoned = 0;
            round.parts.retain(|(owner, id, keys, deltas)| match acks.take(*owner, *id) {
                Some(ack) => {
                    arrived.push((*owner, *id, keys.clone(), deltas.clone(), ack));
                    false
                }
                // Given up as a sync round gives up a message to a lost node: its deltas may
                // be lost with it; the replicas keep their values.
                None if core.directory().is_lost(*owner) => {
                    acks.abandon(*owner, *id);
                    abandoned += 1;
                    false
                }
                None => true,
            });
            self.replica_counts.sync_abandoned += abandoned;
            self.failed_ops += abandoned;
            let w = self.replica_sets[node].worker;
            for (owner, id, keys, deltas, ack) in arrived {
                self.complete_sync(w, owner, id, keys, deltas, ack)?;
            }
            if self.replica_sets[node].syncing.is_some() {
                self.end_sync_if_done(w)?;
            }
        }
        Ok(())
    }

    fn complete_sync(
        &mut self,
        w: usize,
        owner: u16,
        id: u32,
        keys: Vec<u64>,
        deltas: Vec<f32>,
        ack: crate::protocol::wire::ReplicaSyncAck,
    ) -> Result<(), String> {
        let node = self.workers[w].node;
        let lanes = self.opts.lanes;
        let count = keys.len();
        let images = self.read_sync_images(owner as usize, id, count, &ack)?;
        self.log(format!("worker {w}@{node} reads {} images of sync {id} from node {owner}", ack.held.len()));
        if !ack.held.is_empty() {
            let store = self.nodes[node].core.store().clone();
            let mut delta = vec![0.0; lanes];
            let held_keys: Vec<u64> = ack.held.iter().map(|&i| keys[i as usize]).collect();
            let held_deltas: Vec<f32> = ack.held.iter().flat_map(|&i| deltas[i as usize * lanes..(i as usize + 1) * lanes].iter().copied()).collect();
            self.note_delivered(node, &held_keys, &held_deltas);
            let set = &mut self.replica_sets[node];
            let Some(round) = &set.syncing else { return Err("a sync acknowledged outside its round".into()) };
            for (&key, mut value) in held_keys.iter().zip(images) {
                if let Some(&incarnation) = round.incarnations.get(&key).filter(|_| !round.left_out.contains(&key))
                    && set_replica(&store, 0, key, incarnation, &mut value, &mut delta)
                {
                    set.fresh.insert(key, (incarnation, round.sent_at));
                }
            }
            self.replica_counts.sync_applied += ack.held.len();
        }
        if ack.held.len() < count {
            let (mut routed, mut routed_deltas, mut lost) = (Vec::new(), Vec::new(), Vec::new());
            let mut hints = ack.hints.iter();
            for (i, (&key, delta)) in keys.iter().zip(deltas.chunks_exact(lanes)).enumerate() {
                if ack.held.contains(&(i as u32)) {
                    continue;
                }
                match hints.next() {
                    Some(&LOST_OWNER) => {
                        lost.push(key);
                        continue;
                    }
                    Some(&h) => {
                        self.replica_sets[node].hints.insert(key, h);
                    }
                    None => {}
                }
                routed.push(key);
                routed_deltas.extend_from_slice(delta);
            }
            if !routed.is_empty() {
                self.route_sync(w, routed, routed_deltas)?;
            }
            self.forget_lost(w, lost)?;
        }
        Ok(())
    }

    /// Ends service worker `w`'s sync round once everything of it completed: the keys it
    /// carried are released to `localize`, and the drains that waited for it end.
    fn end_sync_if_done(&mut self, w: usize) -> Result<(), String> {
        let node = self.workers[w].node;
        let set = &mut self.replica_sets[node];
        if set.syncing.as_ref().is_none_or(|r| !r.parts.is_empty() || !r.routed.is_empty()) {
            return Ok(());
        }
        let round = set.syncing.take().expect("checked");
        if let Some(d) = self.nodes[node].core.store().table(0).dynamic() {
            d.end_sync(&round.marked);
        }
        self.log(format!("worker {w}@{node} ends its sync round"));
        for (id, keys, marked) in std::mem::take(&mut self.replica_sets[node].drains_after_sync) {
            self.end_drain(w, id, keys, marked)?;
        }
        Ok(())
    }

    /// Node `node`'s replicas' `deltas` of `keys` were applied where the keys are held: the
    /// pushes they carry (one lane each) are there.
    fn note_delivered(&mut self, node: usize, keys: &[u64], deltas: &[f32]) {
        let (lanes, now) = (self.opts.lanes, self.now);
        let set = &mut self.replica_sets[node];
        for (&key, delta) in keys.iter().zip(deltas.chunks_exact(lanes)) {
            for (lane, &x) in delta.iter().enumerate() {
                if x != 0.0 {
                    set.delivered.insert((key, lane as u32), now);
                }
            }
        }
    }

    /// Records what served worker `w`'s events from `first_event` on (an operation just issued
    /// on `keys`; `streamed`: its later parts are routed in later steps).
    pub(super) fn note_served(&mut self, w: usize, keys: &[u64], first_event: usize, streamed: bool) {
        if self.opts.run_time_replicas.is_none() || keys.is_empty() {
            return;
        }
        let node = self.workers[w].node;
        let store = self.nodes[node].core.store().clone();
        let t = store.table(0);
        for j in first_event..self.workers[w].events.len() {
            let key = self.workers[w].events[j].0;
            if !self.in_replica_range(key) || streamed {
                continue;
            }
            // Served in this step: by the key here, by a replica here, or by the owner.
            let served = match t.residence(key) {
                Residence::Here(_) => Served::Owner,
                _ if t.has_dynamic_replica(key) => {
                    let incarnation = t.dynamic().map(|d| d.incarnation(key));
                    Served::Replica(self.replica_sets[node].fresh.get(&key).filter(|f| Some(f.0) == incarnation).map(|f| f.1))
                }
                _ => Served::Owner,
            };
            self.workers[w].served[j] = served;
        }
    }

    /// Whether worker `w`'s localize of `keys` must wait because a sync round carries the delta
    /// of one of them, as `Worker::localize` waits (it marks the keys first, so that no round
    /// takes their deltas meanwhile) and the intent service puts a granted move off.
    pub(super) fn localize_waits_for_sync(&mut self, w: usize, keys: &[u64], granted: bool) -> bool {
        if self.opts.run_time_replicas.is_none() {
            return false;
        }
        let node = self.workers[w].node;
        let Some(d) = self.nodes[node].core.store().table(0).dynamic() else { return false };
        let in_sync = if granted || self.workers[w].localize_marked {
            d.carried_by_sync(keys)
        } else {
            self.workers[w].localize_marked = true;
            d.begin_localize(keys)
        };
        if in_sync.is_empty() {
            return false;
        }
        self.replica_counts.localize_waits += 1;
        self.log(format!("worker {w}@{node} waits for the sync round carrying {in_sync:?} before it localizes {keys:?}"));
        self.workers[w].localize_waits_for = Some(in_sync);
        true
    }

    /// A service script step of worker `w`, after the round's bookkeeping.
    pub(super) fn service_step(&mut self, w: usize, op: ScriptOp) -> Result<(), String> {
        self.replica_set_round(w)?;
        match op {
            ScriptOp::MakeReplicas { keys } => self.make_replicas(w, keys),
            ScriptOp::DropReplicas { keys } => {
                self.log(format!("worker {w} drops replicas of {keys:?}"));
                self.drop_replicas(w, keys, false, false)
            }
            ScriptOp::SyncReplicas => self.start_sync(w),
            ScriptOp::StopReplicas => self.stop_replicas(w),
            _ => Err("not a service operation".into()),
        }
    }

    /// The node's workers are done: drops every replica, and comes back until none is left.
    fn stop_replicas(&mut self, w: usize) -> Result<(), String> {
        let node = self.workers[w].node;
        let store = self.nodes[node].core.store().clone();
        let t = store.table(0);
        let mut keys: Vec<u64> = t.dynamic().map(|d| d.want_none()).unwrap_or_default();
        let set = &mut self.replica_sets[node];
        set.stopped = true;
        set.awaiting.clear();
        keys.extend(set.replicas.iter().chain(&set.making).chain(&set.put_off));
        keys.extend(self.opts.run_time_replicas.clone().into_iter().flatten().filter(|&k| t.has_dynamic_replica(k)));
        keys.sort_unstable();
        keys.dedup();
        self.log(format!("worker {w}@{node} stops its replicas: {keys:?}"));
        self.drop_replicas(w, keys, false, true)?;
        let set = &self.replica_sets[node];
        let left = !set.quiet() || !set.makes.is_empty() || !set.put_off.is_empty() || t.any_dynamic_replica();
        if left {
            self.workers[w].script.push_back(ScriptOp::StopReplicas);
        }
        Ok(())
    }

    /// Checks what of the replica guarantee a lost node leaves whole (the crash test): no read
    /// of a key with run-time replicas, and no survivor's value of one after the run, includes
    /// a push more than once, and no read includes a push issued after it returned. (Pushes
    /// that reached the lost node, or whose deltas a replica was syncing to it, may be missing,
    /// so the rest of the guarantee cannot be held to.)
    pub(super) fn check_run_time_replicas_at_most_once(&mut self) -> Option<Violation> {
        let range = self.opts.run_time_replicas.clone()?;
        let lanes = self.opts.lanes;
        let mut issued: BTreeMap<(u64, u32), u64> = BTreeMap::new();
        for w in &self.workers {
            for ((key, event), &(at, _)) in w.events.iter().zip(&w.times) {
                if let Event::Push { lane } = event
                    && range.contains(key)
                {
                    issued.insert((*key, *lane), at);
                }
            }
        }
        let twice = |key: u64, value: &[f32], what: &dyn Fn() -> String| {
            let wrong: Vec<(usize, f32)> = value.iter().enumerate().filter(|&(_, &x)| x != 0.0 && x != 1.0).map(|(lane, &x)| (lane, x)).collect();
            (!wrong.is_empty()).then(|| Violation { key, reason: format!("{}: a push applied more than once or partly, (lane, value) {wrong:?}", what()) })
        };
        for w in &self.workers {
            for ((key, event), &(start, end)) in w.events.iter().zip(&w.times) {
                let Event::Pull { value } = event else { continue };
                if !range.contains(key) || value.is_empty() {
                    continue;
                }
                self.replica_counts.events += 1;
                if let Some(v) = twice(*key, value, &|| format!("a pull of node {} at t={start}", w.node)) {
                    return Some(v);
                }
                for (lane, _) in value.iter().enumerate().filter(|&(_, &x)| x == 1.0) {
                    if issued.get(&(*key, lane as u32)).is_some_and(|&at| at > end) {
                        return Some(Violation {
                            key: *key,
                            reason: format!("a pull of node {} at t={start} includes the push in lane {lane}, issued after it returned", w.node),
                        });
                    }
                }
            }
        }
        let mut value = vec![0.0; lanes];
        for (rank, node) in self.nodes.iter().enumerate().filter(|(_, n)| !n.crashed) {
            let store = node.core.store();
            for key in range.clone() {
                let guard = store.lock(0, key);
                let Some(slot) = guard.slot() else { continue };
                slot.read(&mut value);
                if let Some(v) = twice(key, &value, &|| format!("node {rank}'s value after the run")) {
                    return Some(v);
                }
            }
        }
        None
    }

    /// Checks the run-time replica keys' histories (see the module's notes); `finals` holds
    /// each key's value at its owner after the run.
    pub(super) fn check_run_time_replicas(&mut self, finals: &BTreeMap<u64, Vec<f32>>) -> Option<Violation> {
        let range = self.opts.run_time_replicas.clone()?;
        let lanes = self.opts.lanes;
        // Per key: pushes (and when each was known to be at the owner), pulls (and a time such
        // that every push at the owner then must be in them).
        type Timed = (Vec<(TimedPush, Option<u64>)>, Vec<(TimedPull, Option<u64>)>);
        let mut per_key: BTreeMap<u64, Timed> = range.clone().map(|k| (k, Default::default())).collect();
        for w in &self.workers {
            let delivered = &self.replica_sets[w.node].delivered;
            for (((key, event), &(issued, done)), served) in w.events.iter().zip(&w.times).zip(&w.served) {
                let Some((pushes, pulls)) = per_key.get_mut(key) else { continue };
                let node = w.node as u16;
                match event {
                    Event::Push { lane } => {
                        let at_owner = match served {
                            Served::Owner if done != u64::MAX => Some(done),
                            Served::Replica(_) => delivered.get(&(*key, *lane)).copied(),
                            _ => None,
                        };
                        pushes.push((TimedPush { node, lane: *lane, issued, acked: done }, at_owner));
                    }
                    Event::Pull { value } if !value.is_empty() => {
                        let fresh = match served {
                            Served::Owner => Some(issued),
                            Served::Replica(fresh) => *fresh,
                            Served::Unknown => None,
                        };
                        pulls.push((TimedPull { node, start: issued, end: done, value: value.clone() }, fresh));
                    }
                    Event::Pull { .. } => {}
                    Event::Set { .. } => return Some(Violation { key: *key, reason: "a set of a key with run-time replicas was recorded".into() }),
                }
            }
        }
        for (key, (pushes, pulls)) in &per_key {
            self.replica_counts.events += pushes.len() + pulls.len();
            let timed: Vec<TimedPush> = pushes.iter().map(|p| p.0.clone()).collect();
            let reads: Vec<TimedPull> = pulls.iter().map(|p| p.0.clone()).collect();
            if let Err(v) = check_bounded_staleness(*key, &timed, &reads, lanes, u64::MAX) {
                return Some(v);
            }
            // Every push at the owner before a replica's value was fetched is in that value.
            for (i, (pull, fresh)) in pulls.iter().enumerate() {
                let Some(fresh) = *fresh else { continue };
                self.replica_counts.fresh_checked += 1;
                for (push, at_owner) in pushes {
                    if at_owner.is_some_and(|a| a < fresh) && pull.value.get(push.lane as usize) != Some(&1.0) {
                        return Some(Violation {
                            key: *key,
                            reason: format!(
                                "pull {i} (node {}, t={}) misses the push in lane {} (node {}), at the owner by t={} before its value was fetched at t={fresh}",
                                pull.node,
                                pull.start,
                                push.lane,
                                push.node,
                                at_owner.unwrap_or(0)
                            ),
                        });
                    }
                }
            }
            let mut expected = vec![0.0f32; lanes];
            for (p, _) in pushes {
                expected[p.lane as usize] = 1.0;
            }
            let Some(value) = finals.get(key) else {
                return Some(Violation { key: *key, reason: "after the run no node holds it".into() });
            };
            let wrong: Vec<(usize, f32)> = value.iter().enumerate().filter(|&(lane, &x)| x != expected[lane]).map(|(lane, &x)| (lane, x)).collect();
            if !wrong.is_empty() {
                return Some(Violation { key: *key, reason: format!("after the run, not every push is in it once: (lane, value) {wrong:?}") });
            }
        }
        None
    }
}
