//! What the simulation checks of run-time replicas (the replica guarantee, see `replica_set.rs`
//! for the driver that runs the shipped replica set): what served each access, and the keys'
//! histories afterwards.

use std::collections::BTreeMap;

use rand::Rng;

use super::{Served, Sim};
use crate::consistency::{Event, TimedPull, TimedPush, Violation, check_bounded_staleness};
use crate::store::Residence;

impl Sim {
    /// Node `node`'s replicas' `deltas` of `keys` were applied where the keys are held: the
    /// pushes they carry (one lane each) are there.
    pub(super) fn note_delivered(&mut self, node: usize, keys: &[u64], deltas: &[f32]) {
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
        let Some(marks) = self.replica_sets.get(node).map(|s| &s.marks) else { return false };
        if !granted && std::mem::take(&mut self.workers[w].localize_deferred) {
            // Marked at its last step, found nothing carried then: issued now without looking
            // again, as a worker's `localize` does.
            return false;
        }
        let in_sync = if granted || self.workers[w].localize_marked.is_some() {
            marks.carried(0, keys)
        } else {
            let in_sync = marks.begin_localize(0, keys);
            self.workers[w].localize_marked = Some(keys.to_vec());
            if in_sync.is_empty() && self.rng.gen_bool(0.5) {
                // A worker's thread may lose its core between marking the keys and issuing the
                // localize: it issues it at its next step, the service going on meanwhile.
                self.log(format!("worker {w}@{node} marks {keys:?} and localizes them at its next step"));
                self.workers[w].localize_deferred = true;
                return true;
            }
            in_sync
        };
        if in_sync.is_empty() {
            return false;
        }
        self.replica_counts.localize_waits += 1;
        self.log(format!("worker {w}@{node} waits for the sync round carrying {in_sync:?} before it localizes {keys:?}"));
        self.workers[w].localize_waits_for = Some(in_sync);
        true
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
