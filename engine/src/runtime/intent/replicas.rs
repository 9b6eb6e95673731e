//! Run-time replicas of keys several nodes intend at once (AdaPM, Section 4.1 and Appendix
//! B.1), kept by the intent service.
//!
//! A replica is made when the key's home tells this node that several nodes need the key now
//! (INTENT_GO, replicate) and the key is not held here: the service pulls the key's value from
//! its owner and installs it (see [`crate::store::DynamicReplicas`]). From then on the node's
//! workers read and push it locally; a push also adds to the replica's delta.
//!
//! The value pulled lacks exactly the pushes this node's workers send to the key after the
//! pull: both are queued under the key's shard lock on the same ordered path (without location
//! caches every access to a key not here goes by its home, which sequences them), so the
//! owner answers the pull first. Such pushes are added up while the pull is on its way
//! ([`crate::store::DynamicReplicas::begin_making`], in `Step::look_at_replicas`) and added to
//! the replica's value when it is installed (not to its delta: the owner has them). A push that
//! found no replica when it was issued and is routed after the install is served by the
//! replica instead. A key granted again while its pull is on its way is made from that pull.
//!
//! A **sync round** (every half of [`crate::Config::staleness`], and around worker barriers)
//! takes each replica's delta under its latch, zeroing it, and sends a table's deltas to the
//! keys' owners — the owner is the hub of AdaPM's owner-hub synchronisation — in one
//! REPLICA_SYNC per owner; the owner adds them to the keys it holds and cuts their images, and
//! the round refreshes those replicas with one one-sided read each message; keys not where
//! they were sent go through a push-pull the homes route (see [`super::sync_round`]). Each
//! replica becomes the owner's value plus the delta accumulated since. The owner applies a
//! delta and copies the value under the key's latch, so the value read includes the delta just
//! sent and every push the owner had applied: a replica never counts a push twice, and every
//! push of this node reaches the owner exactly once (it leaves a delta exactly once, under the
//! latch that also admits pushes, and is applied where the key is held or routed).
//!
//! A key granted while it is held (or arriving) here gets no replica yet; the store marks it
//! (`DynamicReplicas::want`), and when the key leaves, the departure keeps its last value here
//! as the replica — no pull back for a node that will need the key again. The service adopts
//! such a replica in its next round (or makes one with a pull if the departure could not keep
//! one).
//!
//! The replica is dropped when this node's intent on the key ends or when the service stops
//! (before `finalize`): its delta is taken under the latch and pushed to the owner, and the
//! replica *drains* — it goes on serving this node's workers until the owner has acknowledged
//! that push (and any sync round that carried an earlier delta has ended), and only then is
//! removed, pushing what was added meanwhile the same way. Removing it at once would let a
//! worker's pull go to the owner ahead of the push carrying that worker's own earlier pushes.
//! A grant of a draining key keeps its replica instead. When the key
//! itself moves here (granted to this node, or an explicit `localize`), the replica serves until
//! the key has landed, and the landing ends it, adding its unsent delta to the arriving value
//! before anything reads it (`Store::fold_replica_into_arrival`). No delta of such a key may be
//! on its way to the old owner meanwhile: a sync round takes none of a key arriving here or
//! about to be localized, and a `localize` waits for (a worker) or puts off (the service) a key
//! whose delta a round carries (`store::dynamic::SyncMarks`); a dropped replica of an
//! arriving key keeps its delta for the landing. A value fetched for a replica is written only
//! into the incarnation it was fetched for (`DynamicReplicas::incarnation`): not into a replica
//! made since, nor after the key was here. The service's worker bypasses replicas, so its
//! pushes and pulls reach the owner.
//!
//! The service issues all of this asynchronously and completes it in its next rounds (at most
//! one sync round in flight), so that a round never waits for the network; a barrier's sync
//! waits until nothing is in flight and then runs synchronously through the barrier's worker.

use std::collections::BTreeMap;

use super::sync_round::{OwnerHints, SyncRound, keep_first_error};
use crate::error::Result;
use crate::intent::{
    Drained, Dropped, Held, TakenDeltas, drop_replica, end_drained_replica, end_making, look_at_replica, lost_key_among, set_replica, take_table_deltas,
};
use crate::runtime::NodeInner;
use crate::store::{MadeReplica, Residence};
use crate::util::{FastMap, FastSet};
use crate::worker::{PullTicket, Ticket, Worker};

/// The run-time replicas this node keeps, per table (the store is the authority on whether
/// one exists; this set says which keys to look at), and their operations in flight.
#[derive(Default)]
pub(crate) struct ReplicaSet {
    keys: BTreeMap<u16, FastSet<u64>>,
    /// Keys whose values are being pulled to make a replica (dropped keys leave).
    making: FastSet<(u16, u64)>,
    /// Keys with a pull in flight to make their replicas (dropped or not): a key wanted again
    /// meanwhile is made from that pull, not pulled a second time.
    pulling: FastSet<(u16, u64)>,
    /// Keys granted a replica whose intent has not ended here: a replica is kept of each
    /// whenever the key is neither held nor arriving here (made again after it left).
    granted: FastSet<(u16, u64)>,
    /// Granted keys without a replica because they were held or arriving here: looked at every
    /// round, a replica made as soon as they are elsewhere.
    awaiting: FastSet<(u16, u64)>,
    /// Pulls in flight that make replicas: table, keys, each key's incarnation when its pull
    /// was sent (`DynamicReplicas::incarnation`), ticket.
    makes: Vec<(u16, Vec<u64>, Vec<u32>, PullTicket)>,
    /// The sync round in flight.
    syncing: Option<SyncRound>,
    /// Per table, the keys whose deltas (not zero) the sync round in flight carries, marked
    /// in the store until it ends (`DynamicReplicas::sync_taker`).
    sync_marked: Vec<(u16, Vec<u64>)>,
    /// Where keys were found when not at their homes (for the sync rounds).
    owners: OwnerHints,
    /// The last REPLICA_SYNC id.
    sync_id: u32,
    /// Dropped replicas whose deltas are on their way to the owners (see the module's notes).
    drains: Vec<Drain>,
    /// The keys whose replicas drain, with the id of their latest drain (a grant takes a key
    /// back out; a key granted and dropped again meanwhile ends with its newer drain only).
    draining: FastMap<(u16, u64), u32>,
    /// The last drain's id.
    drain_id: u32,
    /// Dropped replicas with a delta whose keys were arriving here: their deltas stay for the
    /// landing to add to the key (a push of them would reach this node behind the key); the
    /// drop is tried again every round in case the key does not arrive.
    put_off_drops: FastSet<(u16, u64)>,
    /// Keys found lost with their owners: their replicas were dropped and no grant makes one
    /// again (a lost value stays lost).
    lost: FastSet<(u16, u64)>,
    /// Keys a barrier's sync round found lost, for the service's next poll to drop (with its
    /// own worker: a drain's push is polled by the service's worker).
    found_lost: Vec<(u16, u64)>,
}

/// One push of dropped replicas' deltas: its keys' replicas serve until it is acknowledged.
struct Drain {
    id: u32,
    table: u16,
    /// Empty for the last pushes of a stopping service, whose replicas are gone already.
    keys: Vec<u64>,
    /// `None` when every delta was zero (the replicas wait only for a sync round in flight).
    push: Option<Ticket>,
    /// Keys whose deltas the push carries, marked until it is acknowledged
    /// ([`crate::store::DynamicReplicas::end_sync`]): a `localize` of one waits until then.
    marked: Vec<u64>,
}

impl ReplicaSet {
    /// Whether no replica is kept, being made or granted.
    pub fn is_empty(&self) -> bool {
        self.making.is_empty() && self.granted.is_empty() && self.put_off_drops.is_empty() && self.keys.values().all(FastSet::is_empty)
    }

    /// Waits for granted `key`, held or arriving here, to leave: its departure keeps it here
    /// as a replica.
    fn await_departure(&mut self, node: &NodeInner, table: u16, key: u64) {
        if self.awaiting.insert((table, key))
            && let Some(d) = node.core.store().table(table).dynamic()
        {
            d.want(key, true);
        }
    }

    /// Stops waiting for `key` to leave; returns whether it was waited for. A replica its
    /// departure kept may exist and must be looked at under the key's latch afterwards.
    fn stop_awaiting(&mut self, node: &NodeInner, table: u16, key: u64) -> bool {
        let was = self.awaiting.remove(&(table, key));
        if was && let Some(d) = node.core.store().table(table).dynamic() {
            d.want(key, false);
        }
        was
    }

    /// Takes over the replicas that departing keys left here since the last call (before
    /// anything looks at the replica set: every round, every sync round, the stop), so that
    /// each is synced and dropped like one this set made.
    pub fn adopt_kept(&mut self, node: &NodeInner) {
        let mut adopted = 0;
        for t in node.core.store().tables() {
            let Some(d) = t.dynamic() else { continue };
            for key in d.take_kept() {
                // Gone already if its intent ended meanwhile (`drop_replicas` looks under the
                // latch for any replica).
                if t.has_dynamic_replica(key) && self.keys.entry(t.id()).or_default().insert(key) {
                    adopted += 1;
                    if let Some(round) = &mut self.syncing {
                        round.leave_out(t.id(), [key]);
                    }
                }
            }
        }
        if adopted > 0 {
            node.core.intent_counters().note_replicas_kept(adopted);
        }
    }

    /// Whether a sync round is in flight.
    pub fn sync_in_flight(&self) -> bool {
        self.syncing.is_some()
    }

    /// Whether no sync round is in flight and no dropped replica drains.
    pub fn quiet(&self) -> bool {
        self.syncing.is_none() && self.drains.is_empty()
    }

    /// Whether anything is kept or in flight.
    pub fn busy(&self) -> bool {
        !self.is_empty() || !self.quiet() || !self.makes.is_empty()
    }

    /// Takes a replica grant for `keys`, and starts making replicas of those that are neither
    /// held here, replicated nor being made: pulls their values from their owners through
    /// `worker` (which bypasses replicas); [`ReplicaSet::poll`] installs them. Returns whether
    /// the grant was taken: false for a table whose holders apply server-side updates, which
    /// keeps no replicas. An error (the pull could not be sent) leaves the grant taken;
    /// [`ReplicaSet::remake`] tries again.
    pub fn start_make(&mut self, node: &NodeInner, worker: &mut Worker, table: u16, keys: &[u64]) -> Result<bool> {
        let t = node.core.store().table(table);
        if t.dynamic().is_none() {
            return Ok(false);
        }
        // A grant its home sent before it learnt of the loss.
        let kept;
        let keys = if self.lost.is_empty() {
            keys
        } else {
            kept = keys.iter().copied().filter(|&k| !self.lost.contains(&(table, k))).collect::<Vec<u64>>();
            &kept[..]
        };
        // A key held or arriving here needs no replica until it leaves (the home grants a
        // replica to the nodes that intend a key, and cannot tell where it is about to be);
        // `remake` catches up with those.
        self.granted.extend(keys.iter().map(|&k| (table, k)));
        // A replica whose drop was put off is wanted again: it stays.
        if !self.put_off_drops.is_empty() {
            for &k in keys {
                if self.put_off_drops.remove(&(table, k)) && t.has_dynamic_replica(k) {
                    self.keys.entry(table).or_default().insert(k);
                }
            }
        }
        // A draining replica is wanted again: it stays (its drain's push goes on, and was
        // taken from its delta once).
        if !self.draining.is_empty() {
            for &k in keys {
                if self.draining.remove(&(table, k)).is_some() && t.has_dynamic_replica(k) {
                    self.keys.entry(table).or_default().insert(k);
                }
            }
        }
        for &k in keys.iter().filter(|&&k| t.residence(k) != Residence::Away) {
            self.await_departure(node, table, k);
        }
        let mut wanted: Vec<u64> =
            keys.iter().copied().filter(|&k| t.residence(k) == Residence::Away && !t.has_dynamic_replica(k) && !self.making.contains(&(table, k))).collect();
        // A key whose earlier pull is still on its way is made from that one: its pushes sent
        // since are added up from when that pull left.
        wanted.retain(|&k| {
            let in_flight = self.pulling.contains(&(table, k));
            if in_flight {
                self.making.insert((table, k));
            }
            !in_flight
        });
        if wanted.is_empty() {
            return Ok(true);
        }
        // Read before the pull leaves: a key that lands here after it changes incarnation, and
        // the value pulled, which lacks what the key took here, is not installed.
        let incarnations: Vec<u32> = wanted.iter().map(|&k| t.dynamic().map_or(0, |d| d.incarnation(k))).collect();
        let ticket = match worker.pull_to_make_replicas(node.table_by_id(table), &wanted) {
            Ok(ticket) => ticket,
            Err(e) => {
                end_making(node.core.store(), table, &wanted);
                return Err(e);
            }
        };
        self.making.extend(wanted.iter().map(|&k| (table, k)));
        self.pulling.extend(wanted.iter().map(|&k| (table, k)));
        self.makes.push((table, wanted, incarnations, ticket));
        Ok(true)
    }

    /// Makes replicas of `keys` of `table` through `worker` and installs them, waiting (tests).
    #[cfg(test)]
    pub(super) fn make_now(&mut self, node: &NodeInner, worker: &mut Worker, table: u16, keys: &[u64]) {
        assert!(self.start_make(node, worker, table, keys).unwrap(), "the table keeps no run-time replicas");
        self.poll(node, worker, true).unwrap();
    }

    /// Starts making the replicas of granted keys that are elsewhere now and have none: with
    /// `all`, every granted key is looked at (a safety net, run with each sync round);
    /// otherwise those that were held or arriving here (run every round).
    pub fn remake(&mut self, node: &NodeInner, worker: &mut Worker, all: bool) -> Result<()> {
        if self.awaiting.is_empty() && !all {
            return Ok(());
        }
        let store = node.core.store();
        let mut missing: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
        let making = &self.making;
        let mut check = |&(table, key): &(u16, u64)| {
            let t = store.table(table);
            match t.residence(key) {
                Residence::Away => {
                    if !t.has_dynamic_replica(key) && !making.contains(&(table, key)) {
                        missing.entry(table).or_default().push(key);
                    }
                    false
                }
                _ => true,
            }
        };
        let left: Vec<(u16, u64)> = if all {
            for key in &self.granted {
                check(key);
            }
            // Keys found elsewhere are made below; those held here wait for them to leave.
            self.awaiting.iter().copied().filter(|&(table, key)| store.table(table).residence(key) == Residence::Away).collect()
        } else {
            self.awaiting.iter().copied().filter(|key| !check(key)).collect()
        };
        // A key that left with its replica kept was adopted before this (`adopt_kept`).
        for (table, key) in left {
            self.stop_awaiting(node, table, key);
        }
        let mut outcome = Ok(());
        for (table, keys) in missing {
            keep_first_error(&mut outcome, self.start_make(node, worker, table, &keys).map(|_taken| ()));
        }
        outcome
    }

    /// Completes what finished (everything, waiting, with `wait`): installs the replicas whose
    /// values arrived and are still wanted, refreshes after a sync round, reaps pushes.
    pub fn poll(&mut self, node: &NodeInner, worker: &mut Worker, wait: bool) -> Result<()> {
        self.adopt_kept(node);
        let mut lost = std::mem::take(&mut self.found_lost);
        let mut outcome = Ok(());
        let mut note = |e| keep_first_error(&mut outcome, Err(e));
        let mut i = 0;
        while i < self.makes.len() {
            if !wait && !worker.is_pull_done(&self.makes[i].3) {
                i += 1;
                continue;
            }
            let (table, keys, incarnations, ticket) = self.makes.swap_remove(i);
            for k in &keys {
                self.pulling.remove(&(table, *k));
            }
            match worker.wait_pull(ticket) {
                Ok(values) => {
                    if let Err(e) = self.install(node, table, &keys, &incarnations, &values) {
                        note(e);
                    }
                }
                Err(e) => {
                    for k in &keys {
                        self.making.remove(&(table, *k));
                    }
                    end_making(node.core.store(), table, &keys);
                    lost.extend(lost_key_among(&e, &keys).map(|key| (table, key)));
                    note(e);
                }
            }
        }
        if let Some(round) = &mut self.syncing {
            if let Err(e) = round.poll(node, worker, &mut self.owners, wait) {
                note(e);
            }
            lost.extend(round.take_lost());
            if round.is_done() {
                self.syncing = None;
                self.end_sync_marks(node);
                node.core.intent_counters().note_replica_sync();
            }
        }
        if !lost.is_empty() {
            self.forget_lost(node, worker, lost).unwrap_or_else(&mut note);
        }
        // A drain ends when its push is acknowledged and no sync round that may carry an
        // earlier delta of its keys is in flight (none starts while anything drains).
        let mut j = 0;
        while j < self.drains.len() {
            let pushed = self.drains[j].push.as_ref().is_none_or(|push| worker.is_done(push));
            // Waiting (the service stops), the round above has ended.
            let ready = wait || (pushed && self.syncing.is_none());
            if !ready {
                j += 1;
                continue;
            }
            let mut drain = self.drains.swap_remove(j);
            if let Some(push) = drain.push.take()
                && let Err(e) = worker.wait(push)
            {
                note(e);
            }
            // Applied where the key is (or lost with its owner): the key may move here now.
            end_marks(node, drain.table, &drain.marked);
            if let Err(e) = self.end_drain(node, worker, &drain, wait) {
                note(e);
            }
        }
        outcome
    }

    /// Removes the drained replicas of `keys` of `table` (those a grant did not take back).
    /// One whose key arrived here adds its delta to the key; one pushed to since its drain
    /// began drains again with that delta, unless `last` (the service stops), when it is
    /// removed and its delta pushed.
    fn end_drain(&mut self, node: &NodeInner, worker: &mut Worker, drain: &Drain, last: bool) -> Result<()> {
        let table = drain.table;
        let store = node.core.store();
        let value_len = store.table(table).value_len();
        let mut delta = vec![0.0; value_len];
        let zero = vec![0.0; value_len];
        let (mut again, mut pushed, mut deltas, mut marked) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut taker = store.table(table).dynamic().map(|d| d.sync_taker());
        for &key in &drain.keys {
            if self.draining.get(&(table, key)) != Some(&drain.id) {
                continue;
            }
            self.draining.remove(&(table, key));
            let guard = store.lock(table, key);
            match end_drained_replica(store, &guard, &mut delta, &zero, last, taker.as_mut()) {
                Drained::Ended => {}
                Drained::Removed { marked: m } => {
                    pushed.push(key);
                    deltas.extend_from_slice(&delta);
                    if m {
                        marked.push(key);
                    }
                }
                Drained::PutOff => {
                    self.put_off_drops.insert((table, key));
                }
                Drained::Again => {
                    again.push(key);
                    deltas.extend_from_slice(&delta);
                }
            }
        }
        drop(taker);
        if !again.is_empty() {
            node.core.intent_counters().note_drained_again(again.len() as u64);
            // Every key drained again was marked (a refused one was put off).
            self.push_drain(node, worker, table, again.clone(), &deltas, again)?;
        } else if !pushed.is_empty() {
            match worker.push_async(node.table_by_id(table), &pushed, &deltas) {
                Ok(push) => self.start_drain(table, Vec::new(), Some(push), marked),
                Err(e) => {
                    end_marks(node, table, &marked);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Installs the replicas of `keys` of `table` still being made, from `values` (the
    /// answer of the pull that made them) plus the pushes this node sent to each key behind
    /// that pull; ends every key's making.
    fn install(&mut self, node: &NodeInner, table: u16, keys: &[u64], incarnations: &[u32], values: &[f32]) -> Result<()> {
        let store = node.core.store();
        let value_len = store.table(table).value_len();
        let (mut made, mut with_pushes, mut outcome) = (0, 0, Ok(()));
        for ((&key, &incarnation), value) in keys.iter().zip(incarnations).zip(values.chunks_exact(value_len)) {
            let wanted = self.making.remove(&(table, key));
            match store.install_made_replica(table, key, incarnation, wanted, value) {
                Ok(MadeReplica::Installed { with_pushes: pushes }) => {
                    if pushes {
                        with_pushes += 1;
                        // Those pushes may still be on their way, by the key's home; a sync
                        // sent straight to the owner could overtake them, and the image it cuts
                        // would lack them. So the replica's first sync goes the way they went:
                        // to the home, which applies it if it holds the key and is otherwise
                        // answered by a push-pull the home routes behind them.
                        self.owners.remove(&(table, key));
                    }
                    self.keys.entry(table).or_default().insert(key);
                    made += 1;
                }
                // Held here: made when it leaves. Elsewhere again since the pull: made anew by
                // the next round's `remake`.
                Ok(MadeReplica::Stale) if wanted && self.granted.contains(&(table, key)) => self.await_departure(node, table, key),
                Ok(_) => {}
                Err(e) => keep_first_error(&mut outcome, Err(e)),
            }
        }
        node.core.intent_counters().note_replicas_made(made);
        node.core.intent_counters().note_made_with_pushes(with_pushes);
        outcome
    }

    /// Drops the replicas of `keys` of `table` (and stops making them); their deltas start on
    /// their way to the keys' owners, and the replicas drain (see the module's notes).
    pub fn drop_keys(&mut self, node: &NodeInner, worker: &mut Worker, table: u16, keys: &[u64]) -> Result<()> {
        self.drop_replicas(node, worker, table, keys, false)
    }

    /// Drops again the replicas whose drops were put off while their keys were arriving here:
    /// those whose keys landed ended with the landing; the others drop now, or wait again.
    pub fn retry_put_off_drops(&mut self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        if self.put_off_drops.is_empty() {
            return Ok(());
        }
        let mut tables: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
        for (table, key) in self.put_off_drops.drain() {
            tables.entry(table).or_default().push(key);
        }
        let mut outcome = Ok(());
        for (table, keys) in tables {
            keep_first_error(&mut outcome, self.drop_replicas(node, worker, table, &keys, false));
        }
        outcome
    }

    /// [`ReplicaSet::drop_keys`]; with `every`, each key's latch is taken to look for a replica
    /// (keys whose marks were cleared already).
    fn drop_replicas(&mut self, node: &NodeInner, worker: &mut Worker, table: u16, keys: &[u64], every: bool) -> Result<()> {
        // Marked keys are unmarked first (waited for, or marked when the grant arrived): a
        // departure after this keeps no replica, and one kept before is found under the latch
        // below.
        let mut unmarked = FastSet::default();
        if let Some(round) = &mut self.syncing {
            round.leave_out(table, keys.iter().copied());
        }
        let dynamic = node.core.store().table(table).dynamic();
        for &key in keys {
            self.making.remove(&(table, key));
            self.owners.remove(&(table, key));
            self.granted.remove(&(table, key));
            self.awaiting.remove(&(table, key));
            if dynamic.is_some_and(|d| d.want(key, false)) {
                unmarked.insert(key);
            }
        }
        let set = self.keys.entry(table).or_default();
        let store = node.core.store();
        let value_len = store.table(table).value_len();
        let (mut pushed, mut deltas, mut waiting, mut marked) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut delta = vec![0.0; value_len];
        let zero = vec![0.0; value_len];
        let t = store.table(table);
        // Held through the keys, like a sync round's: no `localize` marks a key in between.
        let mut taker = t.dynamic().map(|d| d.sync_taker());
        for &key in keys {
            // Any run-time replica is this set's, adopted or not yet (one a departure kept
            // while the pull for the same key was failing, say): it ends with the intent.
            if self.draining.contains_key(&(table, key)) || (!set.remove(&key) && !unmarked.contains(&key) && !every && !t.has_dynamic_replica(key)) {
                continue;
            }
            let guard = store.lock(table, key);
            match drop_replica(store, &guard, &mut delta, &zero, every, self.syncing.is_some(), taker.as_mut()) {
                Dropped::Nothing | Dropped::Removed => {}
                Dropped::PutOff => {
                    self.put_off_drops.insert((table, key));
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
        node.core.intent_counters().note_drained((waiting.len() + pushed.len()) as u64);
        if !waiting.is_empty() {
            self.start_drain(table, waiting, None, Vec::new());
        }
        if !pushed.is_empty() {
            self.push_drain(node, worker, table, pushed, &deltas, marked)?;
        }
        Ok(())
    }

    /// Pushes `deltas`, taken from the replicas of `keys` of `table`, which drain until the
    /// push is acknowledged (or fails: a lost owner's drain ends all the same). A push that
    /// cannot even be issued (the node shuts down, say) would fail again: the replicas are
    /// removed at once and their deltas lost with the error (a key that arrived here meanwhile
    /// takes both). The `marked` keys' marks end when the push is acknowledged or fails.
    fn push_drain(&mut self, node: &NodeInner, worker: &mut Worker, table: u16, keys: Vec<u64>, deltas: &[f32], marked: Vec<u64>) -> Result<()> {
        match worker.push_async(node.table_by_id(table), &keys, deltas) {
            Ok(push) => {
                self.start_drain(table, keys, Some(push), marked);
                Ok(())
            }
            Err(e) => {
                end_marks(node, table, &marked);
                let store = node.core.store();
                let mut delta = vec![0.0; store.table(table).value_len()];
                for (&key, taken) in keys.iter().zip(deltas.chunks_exact(delta.len())) {
                    let guard = store.lock(table, key);
                    if store.remove_replica(&guard, &mut delta)
                        && let Some(slot) = guard.slot()
                    {
                        slot.add(&delta);
                        slot.add(taken);
                    }
                }
                Err(e)
            }
        }
    }

    /// Starts draining the replicas of `keys` of `table` until `push` (of their deltas) is
    /// acknowledged and no sync round is in flight; a key drained again later ends with that
    /// newer drain only. The `marked` keys' marks end when `push` is acknowledged.
    fn start_drain(&mut self, table: u16, keys: Vec<u64>, push: Option<Ticket>, marked: Vec<u64>) {
        self.drain_id = self.drain_id.wrapping_add(1);
        let id = self.drain_id;
        self.draining.extend(keys.iter().map(|&k| ((table, k), id)));
        self.drains.push(Drain { id, table, keys, push, marked });
    }

    /// Drops every replica and waits until their deltas reached the owners (the service stops).
    pub fn drop_all(&mut self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        self.adopt_kept(node);
        self.making.clear();
        self.granted.clear();
        // Kept replicas and marked keys (which may have left with a replica kept): the marks
        // go first, then `drop_replicas` finds any such replica under its latch.
        let mut tables: BTreeMap<u16, Vec<u64>> = self.keys.iter().map(|(&t, k)| (t, k.iter().copied().collect())).collect();
        self.awaiting.clear();
        for t in node.core.store().tables() {
            if let Some(d) = t.dynamic() {
                tables.entry(t.id()).or_default().extend(d.want_none());
            }
        }
        let mut outcome = self.poll(node, worker, true);
        for (table, keys) in tables {
            keep_first_error(&mut outcome, self.drop_replicas(node, worker, table, &keys, true));
        }
        let last = self.poll(node, worker, true);
        keep_first_error(&mut outcome, last);
        outcome
    }

    /// Starts a sync round unless one is in flight (see [`super::sync_round`]);
    /// [`ReplicaSet::poll`] completes it.
    pub fn start_sync(&mut self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        if self.syncing.is_some() {
            return Ok(());
        }
        let taken = self.take_deltas(node);
        if taken.is_empty() {
            return Ok(());
        }
        let (mut round, mut outcome) = SyncRound::start(node, worker, &self.owners, &mut self.sync_id, taken);
        let lost = round.take_lost();
        if round.is_done() {
            self.end_sync_marks(node);
        } else {
            self.syncing = Some(round);
        }
        if !lost.is_empty() {
            keep_first_error(&mut outcome, self.forget_lost(node, worker, lost));
        }
        outcome
    }

    /// `lost` keys' values were lost with their owners: drops their replicas (their deltas can
    /// reach no one; the drop's push fails as any push of a lost key does), stops making them,
    /// and takes no grant of them again. Accesses of these keys then fail as those of any key
    /// lost with its owner, rather than being served by a replica whose pushes would vanish.
    fn forget_lost(&mut self, node: &NodeInner, worker: &mut Worker, lost: Vec<(u16, u64)>) -> Result<()> {
        let mut tables: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
        for (table, key) in lost {
            if self.lost.insert((table, key)) {
                tables.entry(table).or_default().push(key);
            }
        }
        let mut outcome = Ok(());
        for (table, keys) in tables {
            tracing::debug!(node = node.config.rank, table, keys = keys.len(), "run-time replicas of keys lost with their owner are dropped");
            node.core.intent_counters().note_replicas_lost(keys.len() as u64);
            keep_first_error(&mut outcome, self.drop_replicas(node, worker, table, &keys, false));
        }
        outcome
    }

    /// Whether a key on its way here has a replica here with a delta (one whose drop was put
    /// off included): a sync round takes no delta of such a key, whose landing adds it to the
    /// key, so a barrier's round, which must deliver every delta, waits for the landing.
    pub fn replicas_arriving(&self, node: &NodeInner) -> bool {
        let store = node.core.store();
        let mut delta = Vec::new();
        let mut arriving = |table: u16, key: u64| {
            let t = store.table(table);
            if t.residence(key) != Residence::Arriving || !t.has_dynamic_replica(key) {
                return false;
            }
            delta.resize(t.value_len(), 0.0);
            let guard = store.lock(table, key);
            matches!(look_at_replica(store, &guard, &mut delta), Held::Replica { clean: false, .. })
        };
        self.keys.iter().any(|(&table, keys)| keys.iter().any(|&k| arriving(table, k))) || self.put_off_drops.iter().any(|&(table, k)| arriving(table, k))
    }

    /// The sync round that carried the marked deltas has ended: localizes waiting for them go on.
    fn end_sync_marks(&mut self, node: &NodeInner) {
        for (table, keys) in self.sync_marked.drain(..) {
            end_marks(node, table, &keys);
        }
    }

    /// A sync round now, through `worker`, waiting for it (around a barrier; nothing may be in
    /// flight, and no key with a replica here may be on its way here: see
    /// [`ReplicaSet::replicas_arriving`]). Keys it finds lost are dropped by the service's next
    /// poll.
    pub fn sync_now(&mut self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        debug_assert!(self.quiet());
        let taken = self.take_deltas(node);
        let (mut round, mut outcome) = SyncRound::start(node, worker, &self.owners, &mut self.sync_id, taken);
        keep_first_error(&mut outcome, round.poll(node, worker, &mut self.owners, true));
        self.end_sync_marks(node);
        node.core.intent_counters().note_replica_sync();
        self.found_lost.extend(round.take_lost());
        outcome
    }

    /// Per table: the replicas and their deltas, each taken under its latch and zeroed. A
    /// replica whose key arrived here ends, its delta added to the key. The delta of a key that
    /// is arriving here, or that a `localize` is about to move here, stays in the replica: the
    /// landing adds it to the key (`DynamicReplicas::sync_taker`). The keys whose deltas are
    /// taken are marked until the round ends.
    fn take_deltas(&mut self, node: &NodeInner) -> Vec<TakenDeltas> {
        self.adopt_kept(node);
        let store = node.core.store();
        let mut out = Vec::new();
        let (granted, awaiting) = (&self.granted, &mut self.awaiting);
        for (&table, set) in self.keys.iter_mut() {
            let (taken, marked) = take_table_deltas(store, table, set, |key| {
                // Granted still: a replica again once the key leaves (kept by its departure).
                if granted.contains(&(table, key))
                    && awaiting.insert((table, key))
                    && let Some(d) = store.table(table).dynamic()
                {
                    d.want(key, true);
                }
            });
            out.extend(taken);
            if !marked.is_empty() {
                self.sync_marked.push((table, marked));
            }
        }
        out
    }
}

/// Ends the marks of `keys` of `table` that a drain's push or a sync round carried
/// ([`crate::store::DynamicReplicas::end_sync`]).
fn end_marks(node: &NodeInner, table: u16, keys: &[u64]) {
    if let Some(d) = node.core.store().table(table).dynamic() {
        d.end_sync(keys);
    }
}

/// Sets each replica of `keys` still here, not `left_out` and of the incarnation its delta was
/// taken from to its owner's value `fresh` (answering the push-pull of its delta) plus what
/// was pushed to it since.
pub(super) fn refresh(
    node: &NodeInner,
    table: u16,
    keys: &[u64],
    mut fresh: Vec<f32>,
    left_out: &FastSet<(u16, u64)>,
    incarnations: &FastMap<(u16, u64), u32>,
) {
    let store = node.core.store();
    let value_len = store.table(table).value_len();
    let mut delta = vec![0.0; value_len];
    for (&key, value) in keys.iter().zip(fresh.chunks_exact_mut(value_len)) {
        if let Some(&incarnation) = incarnations.get(&(table, key)).filter(|_| !left_out.contains(&(table, key))) {
            set_replica(node.core.store(), table, key, incarnation, value, &mut delta);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::{Config, Node, Table, TableSpec};

    /// Two in-process nodes, node 1's shared state, a trainer and a service worker on node 1
    /// (the service's bypasses replicas), table `t`'s id, and a key held at node 0.
    fn two_nodes() -> (Vec<Node>, std::sync::Arc<NodeInner>, Worker, Worker, u16, u64) {
        let mut config = Config::new(vec![TableSpec::new("t", 16, 2)]);
        config.latches = 16;
        let nodes = Node::start_local_cluster(2, config).unwrap();
        let node = nodes[1].inner().clone();
        let (trainer, mut service) = (nodes[1].worker(), nodes[1].worker());
        service.bypass_replicas(true);
        let table = trainer.table("t").unwrap().id;
        let key = (0..16).find(|&k| node.core.store().table(table).residence(k) == Residence::Away).unwrap();
        (nodes, node, trainer, service, table, key)
    }

    /// Polls `set` until nothing drains or syncs (at most 10 s).
    fn settle(set: &mut ReplicaSet, node: &NodeInner, service: &mut Worker) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !set.quiet() {
            assert!(Instant::now() < deadline, "the replicas never drained");
            set.poll(node, service, false).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The key's value as its owner, node 0, reads it.
    fn owner_value(nodes: &[Node], handle: Table, key: u64) -> [f32; 2] {
        let mut out = [0.0; 2];
        nodes[0].worker().pull(handle, &[key], &mut out).unwrap();
        out
    }

    fn shut_down(nodes: Vec<Node>, workers: [Worker; 2]) {
        drop(workers);
        crate::node::finalize_all(nodes);
    }

    #[test]
    fn a_dropped_replica_serves_until_the_owner_has_its_delta() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        set.make_now(&node, &mut service, table, &[key]);
        assert!(t.has_dynamic_replica(key), "the replica was not made");
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();

        // Dropped, the replica drains: it still serves this node's workers, their pushes
        // included, until the owner has acknowledged the push carrying its delta.
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        assert!(t.has_dynamic_replica(key) && !set.quiet(), "the replica went before its delta reached the owner");
        let before = node.core.stats();
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0]);
        assert_eq!(node.core.stats().since(&before).remote_accesses, 0, "a draining replica serves");
        // A push while it drains leaves with a second drain; then the replica goes.
        trainer.push(handle, &[key], &[10.0, 20.0]).unwrap();
        settle(&mut set, &node, &mut service);
        assert!(!t.has_dynamic_replica(key), "the drained replica stayed");
        let intent = node.core.stats().intent;
        assert_eq!((intent.drained, intent.drained_again), (1, 1), "{intent:?}");
        let before = node.core.stats();
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(node.core.stats().since(&before).remote_accesses, 1);
        assert_eq!(out, [11.0, 22.0], "a push was lost or counted twice");
        assert_eq!(owner_value(&nodes, handle, key), [11.0, 22.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_drained_delta_holds_a_localize_off_until_the_owner_has_it() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let d = t.dynamic().unwrap();
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();

        // A `localize` is about to move the key here: the drop leaves the delta for its
        // landing (a push issued after the localize's request would reach the key after it
        // landed, and this node would read the key without its own pushes meanwhile).
        assert!(d.begin_localize(&[key]).is_empty());
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        assert!(set.put_off_drops.contains(&(table, key)) && set.quiet(), "the delta was taken under a localize");
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0]);
        d.end_localize(&[key]);

        // Given up, the localize lets the drop go on: the delta's push marks the key until the
        // owner has it, and a `localize` learns that it must wait.
        set.retry_put_off_drops(&node, &mut service).unwrap();
        assert!(set.put_off_drops.is_empty() && !set.quiet());
        assert_eq!(d.carried_by_sync(&[key]), vec![key], "the drain's push does not mark its key");
        assert_eq!(d.begin_localize(&[key]), vec![key]);
        d.end_localize(&[key]);
        // The mark ends when the service sees the push acknowledged.
        settle(&mut set, &node, &mut service);
        assert!(d.carried_by_sync(&[key]).is_empty() && !t.has_dynamic_replica(key));
        assert!(d.wait_synced(&[key], Instant::now()));
        assert_eq!(owner_value(&nodes, handle, key), [1.0, 2.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_sync_round_is_queued_behind_the_steps_routing_its_keys() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();

        // A step that routed an access to the key holds its shard until it has queued its
        // frames (its thread may wait for a CPU meanwhile). A REPLICA_SYNC queued before them
        // would reach the owner first, whose image would then lack a push the replica's
        // making counted as sent behind its pull: the round's message waits for the step.
        let mut tx = node.core.transmit();
        let mut routing = node.core.step(&mut tx, node.now());
        assert!(routing.try_acquire_keys([(table, key)]));
        let (sent_tx, sent_rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let (node, set, service) = (&*node, &mut set, &mut service);
            scope.spawn(move || {
                let outcome = set.start_sync(node, service);
                let _ = sent_tx.send(outcome);
            });
            assert!(
                matches!(sent_rx.recv_timeout(Duration::from_millis(300)), Err(std::sync::mpsc::RecvTimeoutError::Timeout)),
                "a REPLICA_SYNC was queued while a step holding its key's shard had not queued its frames"
            );
            drop(routing);
            sent_rx.recv_timeout(Duration::from_secs(10)).expect("the round never started").unwrap();
        });
        settle(&mut set, &node, &mut service);
        assert_eq!(owner_value(&nodes, handle, key), [1.0, 2.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_grant_keeps_a_draining_replica() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 1.0]).unwrap();
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        // Granted again while it drains: the replica stays, is synced like any other, and is
        // not pulled anew.
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        assert!(set.makes.is_empty(), "a replica that is still here was made again");
        settle(&mut set, &node, &mut service);
        assert!(t.has_dynamic_replica(key), "the drain removed a replica granted again");
        trainer.push(handle, &[key], &[2.0, 2.0]).unwrap();
        set.start_sync(&node, &mut service).unwrap();
        settle(&mut set, &node, &mut service);
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        settle(&mut set, &node, &mut service);
        assert_eq!(owner_value(&nodes, handle, key), [3.0, 3.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_drain_whose_owner_is_lost_ends() {
        let (mut nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 1.0]).unwrap();
        nodes.remove(0).abort();
        // This node learns of the loss (an access to the key fails) before the drop.
        let (mut out, known) = ([0.0; 2], Instant::now() + Duration::from_secs(10));
        while service.pull(handle, &[key], &mut out).is_ok() {
            assert!(Instant::now() < known, "the owner's loss went unnoticed");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The push to the lost owner fails: the replica goes with its delta instead of
        // draining (and holding back every sync round) for ever.
        let outcome = set.drop_keys(&node, &mut service, table, &[key]);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut errors = usize::from(outcome.is_err());
        while !set.quiet() {
            assert!(Instant::now() < deadline, "a drain to a lost owner never ended");
            errors += usize::from(set.poll(&node, &mut service, false).is_err());
            std::thread::sleep(Duration::from_micros(200));
        }
        assert!(!t.has_dynamic_replica(key) && errors >= 1, "errors {errors}");
        drop((trainer, service));
        for n in nodes {
            n.abort();
        }
    }

    #[test]
    fn a_replica_made_while_this_node_pushes_has_those_pushes() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        trainer.push(handle, &[key], &[100.0, 200.0]).unwrap();
        assert!(set.start_make(&node, &mut service, table, &[key]).unwrap());
        // The pull that makes the replica is on its way: this push reaches the owner after the
        // owner answered it (one ordered connection), so the value pulled lacks it.
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();
        set.poll(&node, &mut service, true).unwrap();
        assert!(t.has_dynamic_replica(key), "the replica was not made");
        let before = node.core.stats();
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(node.core.stats().since(&before).remote_accesses, 0, "the replica does not serve");
        assert_eq!(out, [101.0, 202.0], "the new replica lacks this node's own earlier push");
        assert_eq!(node.core.stats().intent.made_with_pushes, 1);
        // The owner has each push once, and the replica, synced, agrees with it.
        trainer.push(handle, &[key], &[10.0, 20.0]).unwrap();
        set.start_sync(&node, &mut service).unwrap();
        settle(&mut set, &node, &mut service);
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [111.0, 222.0]);
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        settle(&mut set, &node, &mut service);
        assert_eq!(owner_value(&nodes, handle, key), [111.0, 222.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_key_granted_again_while_its_pull_is_on_its_way_is_made_from_that_pull() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        trainer.push(handle, &[key], &[1.0, 1.0]).unwrap();
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        trainer.push(handle, &[key], &[2.0, 2.0]).unwrap();
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        assert_eq!(set.makes.len(), 1, "a second pull for a key whose first is on its way");
        trainer.push(handle, &[key], &[4.0, 4.0]).unwrap();
        set.poll(&node, &mut service, true).unwrap();
        assert!(t.has_dynamic_replica(key), "the replica was not made");
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [7.0, 7.0], "the replica lacks pushes sent behind its pull");
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        settle(&mut set, &node, &mut service);
        assert_eq!(owner_value(&nodes, handle, key), [7.0, 7.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_key_landing_where_it_has_a_replica_keeps_this_nodes_pushes() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        set.make_now(&node, &mut service, table, &[key]);
        // The push stays in the replica's delta (no sync round runs); then the key moves here.
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();
        trainer.localize(handle, &[key]).unwrap();
        assert!(t.slot_of(key).is_some() && !t.has_dynamic_replica(key), "the key did not land, or its replica stayed");
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0], "the landed key lacks the push its replica took");
        // The sync rounds after it find the key here and add nothing twice.
        set.start_sync(&node, &mut service).unwrap();
        settle(&mut set, &node, &mut service);
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0], "a push was counted twice");
        assert_eq!(owner_value(&nodes, handle, key), [1.0, 2.0]);
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_localize_waits_until_no_sync_round_carries_the_keys_delta() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();
        // The round takes the delta and sends it straight to the owner; a localize now would
        // race it (the key could leave the owner before the delta gets there).
        set.start_sync(&node, &mut service).unwrap();
        assert!(set.sync_in_flight());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let mover = std::thread::spawn(move || {
            trainer.localize(handle, &[key]).unwrap();
            let mut out = [0.0; 2];
            trainer.pull(handle, &[key], &mut out).unwrap();
            done_tx.send(out).unwrap();
            trainer
        });
        assert!(done_rx.recv_timeout(Duration::from_millis(200)).is_err(), "the localize did not wait for the sync round");
        assert!(t.slot_of(key).is_none() && t.residence(key) == Residence::Away);
        settle(&mut set, &node, &mut service);
        let out = done_rx.recv_timeout(Duration::from_secs(10)).expect("the localize never went on");
        assert_eq!(out, [1.0, 2.0], "the landed key lacks the push its replica's delta carried");
        let trainer = mover.join().unwrap();
        assert_eq!(owner_value(&nodes, handle, key), [1.0, 2.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_sync_round_does_not_refresh_a_replica_made_after_the_key_was_here() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        set.make_now(&node, &mut service, table, &[key]);
        // A round for the clean replica is in flight (its image will be the owner's [0, 0]).
        set.start_sync(&node, &mut service).unwrap();
        assert!(set.sync_in_flight());
        // Meanwhile the key lands here, takes a push, leaves, and a new replica is made from
        // the owner's value, which has that push.
        trainer.localize(handle, &[key]).unwrap();
        trainer.push(handle, &[key], &[5.0, 5.0]).unwrap();
        nodes[0].worker().localize(handle, &[key]).unwrap();
        assert!(t.residence(key) == Residence::Away);
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !t.has_dynamic_replica(key) {
            assert!(Instant::now() < deadline, "the new replica was not made");
            set.poll(&node, &mut service, false).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        // The old round's image predates the push: the new replica keeps its value.
        settle(&mut set, &node, &mut service);
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [5.0, 5.0], "an old round's image overwrote a newer replica");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_value_pulled_before_the_key_was_here_makes_no_replica() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaSet::default();
        // The pull that makes the replica is answered with the owner's [0, 0]; before it is
        // installed, the key lands here, takes a push and leaves.
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        trainer.localize(handle, &[key]).unwrap();
        trainer.push(handle, &[key], &[5.0, 5.0]).unwrap();
        nodes[0].worker().localize(handle, &[key]).unwrap();
        set.poll(&node, &mut service, true).unwrap();
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [5.0, 5.0], "a replica was made from a value older than this node's push");
        assert!(!t.has_dynamic_replica(key));
        shut_down(nodes, [trainer, service]);
    }
}
