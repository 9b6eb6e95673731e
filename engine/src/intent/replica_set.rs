//! Run-time replicas of keys several nodes intend at once (AdaPM, Section 4.1 and Appendix
//! B.1), as a state machine: the intent service's driver (`worker::intent::replicas`) and the
//! simulator feed it grants, drops, rounds and the outcomes of what it asked for, and execute
//! the actions it queues — pull a key's value to make a replica, push a dropped replica's delta,
//! send REPLICA_SYNCs, read an owner's images, route a push-pull. It has no thread, clock, lock,
//! node or worker of its own; it works on the store (under the keys' latches, as the protocol
//! does) and nothing else.
//!
//! A replica is made when the key's home tells this node that several nodes need the key now
//! (INTENT_GO, replicate) and the key is not held here: the machine asks for a pull of the key's
//! value from its owner and installs it (see [`crate::store::DynamicReplicas`]). From then on the
//! node's workers read and push it locally; a push also adds to the replica's delta.
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
//! as the replica — no pull back for a node that will need the key again. The machine adopts
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
//! whose delta a round carries (`intent::SyncMarks`); a dropped replica of an
//! arriving key keeps its delta for the landing. A value fetched for a replica is written only
//! into the incarnation it was fetched for (`DynamicReplicas::incarnation`): not into a replica
//! made since, nor after the key was here. The driver's worker bypasses replicas, so its
//! pushes and pulls reach the owner.
//!
//! At most one sync round is in flight; none starts while a dropped replica drains.

use std::collections::BTreeMap;

use super::replica_store::{
    Drained, Dropped, Held, TakenDeltas, drop_replica, end_drained_replica, end_making, look_at_replica, lost_key_among, take_table_deltas,
};
use super::sync_round::{Outbox, OwnerHints, SyncRound};
use crate::error::{Error, Result};
use crate::protocol::wire::ReplicaSyncAck;
use crate::protocol::{Directory, IntentCounters, OutgoingSync};
use crate::store::{MadeReplica, RemoteAddr, Residence, Store};
use crate::util::{FastMap, FastSet};

/// What the replica set works on: the node's store, what it knows of the cluster, its
/// counters. Built by each driver from its node.
pub(crate) struct ReplicaContext<'a> {
    /// The node's store.
    pub store: &'a Store,
    /// The node's directory (homes, owners, lost nodes).
    pub directory: &'a Directory,
    /// Where the replica set's figures go.
    pub counters: &'a IntentCounters,
    /// Whether the fabric still reaches a node.
    pub alive: &'a dyn Fn(u16) -> bool,
    /// The largest message a peer accepts.
    pub max_message_bytes: usize,
    /// The node's sync marks (the intent service's, shared with its workers' `localize`).
    pub marks: &'a super::SyncMarks,
}

/// Names one action, so that its outcome can be handed back.
pub(crate) type OpToken = u32;

/// What the replica set asks its driver to do. Each completes with the `handle_*` call its
/// variant names.
#[derive(Debug)]
pub(crate) enum ReplicaAction {
    /// Pull `keys` of `table` from their owners, past any replica, flagged as making replicas
    /// (the protocol adds up the pushes this node sends behind the pull):
    /// [`ReplicaSet::handle_pulled`].
    MakePull { op: OpToken, table: u16, keys: Vec<u64> },
    /// Push dropped replicas' `deltas` of `keys` to the owners: [`ReplicaSet::handle_pushed`]
    /// (or [`ReplicaSet::handle_drain_unsent`] when the push cannot be issued).
    DrainPush { op: OpToken, table: u16, keys: Vec<u64>, deltas: Vec<f32> },
    /// Push-pull `deltas` of `keys` (a sync round's, not where they were sent) by the keys'
    /// homes: [`ReplicaSet::handle_pulled`].
    RoutedSync { op: OpToken, table: u16, keys: Vec<u64>, deltas: Vec<f32> },
    /// Send the sync round's REPLICA_SYNCs ([`ReplicaSet::syncs_to_send`]) in one step; each is
    /// acknowledged by [`ReplicaSet::handle_sync_ack`] or given up by
    /// [`ReplicaSet::handle_sync_unanswered`] ([`ReplicaSet::awaiting_acks`] lists them).
    SendSyncs { op: OpToken },
    /// Read `bytes` of `owner`'s registered images at `remote` (one-sided):
    /// [`ReplicaSet::handle_read`].
    ReadImages { op: OpToken, owner: u16, remote: RemoteAddr, bytes: usize },
}

/// A pull in flight that makes replicas.
struct Make {
    op: OpToken,
    table: u16,
    keys: Vec<u64>,
    /// Each key's incarnation when the pull was asked for (`DynamicReplicas::incarnation`).
    incarnations: Vec<u32>,
}

/// One push of dropped replicas' deltas: its keys' replicas serve until it is acknowledged.
struct Drain {
    id: u32,
    table: u16,
    /// Empty for the last pushes of a stopping service, whose replicas are gone already.
    keys: Vec<u64>,
    /// The push's token while it is in flight; `None` once acknowledged (or when every delta
    /// was zero): the replicas then wait only for a sync round in flight.
    push: Option<OpToken>,
    /// Keys whose deltas the push carries, marked until it is acknowledged
    /// ([`super::SyncMarks::end_sync`]): a `localize` of one waits until then.
    marked: Vec<u64>,
}

/// Counts of what the replica set did that the node's statistics leave out (the simulator
/// reports them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ReplicaTally {
    /// Values pulled but not installed: the key was here since the pull left.
    pub stale: u64,
    /// Replicas a sync round found ended by their key landing here.
    pub folded: u64,
    /// Drops put off because the key was arriving here with a delta.
    pub put_off: u64,
}

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
    makes: Vec<Make>,
    /// The sync round in flight.
    syncing: Option<SyncRound>,
    /// Per table, the keys whose deltas (not zero) the sync round in flight carries, marked
    /// in the node's sync marks until it ends (`SyncMarks::taker`).
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
    /// The service stops: a drain ending removes its replicas (see [`ReplicaSet::begin_stop`]).
    stopping: bool,
    /// Keys to drop when the service stops.
    stop_keys: BTreeMap<u16, Vec<u64>>,
    /// Actions for the driver, keys found lost and not yet dropped
    /// ([`ReplicaSet::forget_found_lost`]), and the replicas set from owners' values while
    /// [`ReplicaSet::observe`] asks for them.
    out: Outbox,
    tally: ReplicaTally,
}

impl ReplicaSet {
    /// The next action for the driver to execute, in the order they were asked for.
    pub fn poll_action(&mut self) -> Option<ReplicaAction> {
        self.out.actions.pop_front()
    }

    /// Whether no replica is kept, being made or granted.
    pub fn is_empty(&self) -> bool {
        self.making.is_empty() && self.granted.is_empty() && self.put_off_drops.is_empty() && self.keys.values().all(FastSet::is_empty)
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

    /// Whether nothing the set asked for is outstanding (no make, drain or round in flight, no
    /// action queued).
    #[cfg(any(test, feature = "sim"))]
    pub fn idle(&self) -> bool {
        self.quiet() && self.makes.is_empty() && self.out.actions.is_empty()
    }

    /// Whether a drop of `key` of `table` was put off (its key was arriving here with a delta).
    #[cfg(test)]
    pub fn put_off(&self, table: u16, key: u64) -> bool {
        self.put_off_drops.contains(&(table, key))
    }

    /// How many pulls that make replicas are in flight.
    #[cfg(test)]
    pub fn makes_in_flight(&self) -> usize {
        self.makes.len()
    }

    /// Starts keeping, for [`ReplicaSet::take_set_log`], which replicas were set from which
    /// action's value (the simulator's freshness check).
    #[cfg(any(test, feature = "sim"))]
    pub fn observe(&mut self) {
        self.out.set.get_or_insert_with(Vec::new);
    }

    /// The replicas set from an owner's value since the last call: table, key, and the token of
    /// the action that fetched the value (a make's pull, a routed push-pull, a round's
    /// REPLICA_SYNCs).
    #[cfg(any(test, feature = "sim"))]
    pub fn take_set_log(&mut self) -> Vec<(u16, u64, OpToken)> {
        self.out.set.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// What the set did that the node's statistics leave out.
    #[cfg(any(test, feature = "sim"))]
    pub fn tally(&self) -> ReplicaTally {
        self.tally
    }

    /// What the set knows of `key` of `table` (the simulator's reports).
    #[cfg(any(test, feature = "sim"))]
    pub fn describe(&self, table: u16, key: u64) -> String {
        let k = (table, key);
        format!(
            "kept {}, making {}, pulling {}, granted {}, awaiting {}, draining {:?}, put off {}, lost {}",
            self.keys.get(&table).is_some_and(|s| s.contains(&key)),
            self.making.contains(&k),
            self.pulling.contains(&k),
            self.granted.contains(&k),
            self.awaiting.contains(&k),
            self.draining.get(&k),
            self.put_off_drops.contains(&k),
            self.lost.contains(&k)
        )
    }

    /// Waits for granted `key`, held or arriving here, to leave: its departure keeps it here
    /// as a replica.
    fn await_departure(&mut self, ctx: &ReplicaContext<'_>, table: u16, key: u64) {
        if self.awaiting.insert((table, key))
            && let Some(d) = ctx.store.table(table).dynamic()
        {
            d.want(key, true);
        }
    }

    /// Stops waiting for `key` to leave; returns whether it was waited for. A replica its
    /// departure kept may exist and must be looked at under the key's latch afterwards.
    fn stop_awaiting(&mut self, ctx: &ReplicaContext<'_>, table: u16, key: u64) -> bool {
        let was = self.awaiting.remove(&(table, key));
        if was && let Some(d) = ctx.store.table(table).dynamic() {
            d.want(key, false);
        }
        was
    }

    /// Takes over the replicas that departing keys left here since the last call (before
    /// anything looks at the replica set: every round, every sync round, the stop), so that
    /// each is synced and dropped like one this set made.
    pub fn adopt_kept(&mut self, ctx: &ReplicaContext<'_>) {
        let mut adopted = 0;
        for t in ctx.store.tables() {
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
            ctx.counters.note_replicas_kept(adopted);
        }
    }

    /// Takes a replica grant for `keys`, and asks for pulls making replicas of those that are
    /// neither held here, replicated nor being made ([`ReplicaAction::MakePull`]). Returns
    /// whether the grant was taken: false for a table whose holders apply server-side updates,
    /// which keeps no replicas.
    pub fn start_make(&mut self, ctx: &ReplicaContext<'_>, table: u16, keys: &[u64]) -> bool {
        let t = ctx.store.table(table);
        if t.dynamic().is_none() {
            return false;
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
            self.await_departure(ctx, table, k);
        }
        let mut wanted: Vec<u64> =
            keys.iter().copied().filter(|&k| t.residence(k) == Residence::Away && !t.has_dynamic_replica(k) && !self.making.contains(&(table, k))).collect();
        wanted.sort_unstable();
        wanted.dedup();
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
            return true;
        }
        // Read before the pull leaves: a key that lands here after it changes incarnation, and
        // the value pulled, which lacks what the key took here, is not installed.
        let incarnations: Vec<u32> = wanted.iter().map(|&k| t.dynamic().map_or(0, |d| d.incarnation(k))).collect();
        self.making.extend(wanted.iter().map(|&k| (table, k)));
        self.pulling.extend(wanted.iter().map(|&k| (table, k)));
        let op = self.out.op();
        self.out.actions.push_back(ReplicaAction::MakePull { op, table, keys: wanted.clone() });
        self.makes.push(Make { op, table, keys: wanted, incarnations });
        true
    }

    /// Asks for the replicas of granted keys that are elsewhere now and have none: with `all`,
    /// every granted key is looked at (a safety net, run with each sync round); otherwise those
    /// that were held or arriving here (run every round).
    pub fn remake(&mut self, ctx: &ReplicaContext<'_>, all: bool) {
        if self.awaiting.is_empty() && !all {
            return;
        }
        let store = ctx.store;
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
            self.stop_awaiting(ctx, table, key);
        }
        for (table, mut keys) in missing {
            keys.sort_unstable();
            self.start_make(ctx, table, &keys);
        }
    }

    /// Drops the replicas of `keys` of `table` (and stops making them); their deltas start on
    /// their way to the keys' owners, and the replicas drain (see the module's notes).
    pub fn drop_keys(&mut self, ctx: &ReplicaContext<'_>, table: u16, keys: &[u64]) {
        self.drop_replicas(ctx, table, keys, false);
    }

    /// Drops again the replicas whose drops were put off while their keys were arriving here:
    /// those whose keys landed ended with the landing; the others drop now, or wait again.
    pub fn retry_put_off_drops(&mut self, ctx: &ReplicaContext<'_>) {
        if self.put_off_drops.is_empty() {
            return;
        }
        let mut tables: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
        for (table, key) in self.put_off_drops.drain() {
            tables.entry(table).or_default().push(key);
        }
        for (table, mut keys) in tables {
            keys.sort_unstable();
            self.drop_replicas(ctx, table, &keys, false);
        }
    }

    /// [`ReplicaSet::drop_keys`]; with `every`, each key's latch is taken to look for a replica
    /// (keys whose marks were cleared already), and a dirty replica's delta is taken even if
    /// its key is arriving here (the service stops: nothing would try again).
    fn drop_replicas(&mut self, ctx: &ReplicaContext<'_>, table: u16, keys: &[u64], every: bool) {
        // Marked keys are unmarked first (waited for, or marked when the grant arrived): a
        // departure after this keeps no replica, and one kept before is found under the latch
        // below.
        let mut unmarked = FastSet::default();
        if let Some(round) = &mut self.syncing {
            round.leave_out(table, keys.iter().copied());
        }
        let store = ctx.store;
        let t = store.table(table);
        let dynamic = t.dynamic();
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
        let value_len = t.value_len();
        let (mut pushed, mut deltas, mut waiting, mut marked) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut delta = vec![0.0; value_len];
        let zero = vec![0.0; value_len];
        let mut seen = FastSet::default();
        // Held through the keys, like a sync round's: no `localize` marks a key in between.
        let mut taker = dynamic.map(|_| ctx.marks.taker(table));
        for &key in keys {
            // Any run-time replica is this set's, adopted or not yet (one a departure kept
            // while the pull for the same key was failing, say): it ends with the intent.
            if !seen.insert(key)
                || self.draining.contains_key(&(table, key))
                || (!set.remove(&key) && !unmarked.contains(&key) && !every && !t.has_dynamic_replica(key))
            {
                continue;
            }
            let guard = store.lock(table, key);
            match drop_replica(store, &guard, &mut delta, &zero, every, self.syncing.is_some(), taker.as_mut()) {
                Dropped::Nothing | Dropped::Removed => {}
                Dropped::PutOff => {
                    self.tally.put_off += 1;
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
        ctx.counters.note_drained((waiting.len() + pushed.len()) as u64);
        if !waiting.is_empty() {
            self.start_drain(table, waiting, None, Vec::new());
        }
        if !pushed.is_empty() {
            self.push_drain(table, pushed, deltas, marked, true);
        }
    }

    /// Asks for a push of `deltas` of `keys` of `table` and starts a drain for it: with
    /// `replicas_stay`, the keys' replicas serve until it is acknowledged (or fails: a lost
    /// owner's drain ends all the same); otherwise they are gone already (the last pushes of a
    /// stopping service). The `marked` keys' marks end with the drain.
    fn push_drain(&mut self, table: u16, keys: Vec<u64>, deltas: Vec<f32>, marked: Vec<u64>, replicas_stay: bool) {
        let op = self.out.op();
        let draining = if replicas_stay { keys.clone() } else { Vec::new() };
        self.out.actions.push_back(ReplicaAction::DrainPush { op, table, keys, deltas });
        self.start_drain(table, draining, Some(op), marked);
    }

    /// Starts draining the replicas of `keys` of `table` until `push` (of their deltas) is
    /// acknowledged and no sync round is in flight; a key drained again later ends with that
    /// newer drain only.
    fn start_drain(&mut self, table: u16, keys: Vec<u64>, push: Option<OpToken>, marked: Vec<u64>) {
        self.drain_id = self.drain_id.wrapping_add(1);
        let id = self.drain_id;
        self.draining.extend(keys.iter().map(|&k| ((table, k), id)));
        self.drains.push(Drain { id, table, keys, push, marked });
    }

    /// The service stops: forgets every grant and what is being made, and notes every replica
    /// (kept, or left by a departure of a key wanted) to drop with [`ReplicaSet::drop_all`] once
    /// the driver has completed what is in flight. From now on a drain that ends removes its
    /// replicas, pushing what was added meanwhile.
    pub fn begin_stop(&mut self, ctx: &ReplicaContext<'_>) {
        self.adopt_kept(ctx);
        self.stopping = true;
        self.making.clear();
        self.granted.clear();
        // Kept replicas and marked keys (which may have left with a replica kept): the marks
        // go first, then `drop_replicas` finds any such replica under its latch.
        for (&t, keys) in &self.keys {
            self.stop_keys.entry(t).or_default().extend(keys.iter().copied());
        }
        // Drops put off for a landing: the stop takes their deltas all the same (the key may
        // never land, and nothing would try again).
        for (t, key) in self.put_off_drops.drain() {
            self.stop_keys.entry(t).or_default().push(key);
        }
        self.awaiting.clear();
        for t in ctx.store.tables() {
            if let Some(d) = t.dynamic() {
                self.stop_keys.entry(t.id()).or_default().extend(d.want_none());
            }
        }
    }

    /// Drops every replica [`ReplicaSet::begin_stop`] noted (and any adopted since), taking
    /// their deltas even of keys arriving here.
    pub fn drop_all(&mut self, ctx: &ReplicaContext<'_>) {
        self.adopt_kept(ctx);
        for (&t, keys) in &self.keys {
            self.stop_keys.entry(t).or_default().extend(keys.iter().copied());
        }
        for (t, key) in self.put_off_drops.drain() {
            self.stop_keys.entry(t).or_default().push(key);
        }
        for (table, mut keys) in std::mem::take(&mut self.stop_keys) {
            keys.sort_unstable();
            keys.dedup();
            self.drop_replicas(ctx, table, &keys, true);
        }
    }

    /// Starts a sync round unless one is in flight or a replica drains (see
    /// [`super::sync_round`]). Returns whether one started.
    pub fn start_sync(&mut self, ctx: &ReplicaContext<'_>) -> bool {
        if !self.quiet() {
            return false;
        }
        let taken = self.take_deltas(ctx);
        if taken.is_empty() {
            self.end_sync_marks(ctx);
            return false;
        }
        self.begin_round(ctx, taken, false);
        true
    }

    /// A sync round now, whatever it takes (around a barrier: nothing may be in flight, and no
    /// key with a replica here may be on its way here; see [`ReplicaSet::replicas_arriving`]).
    /// Keys it finds lost wait for [`ReplicaSet::forget_found_lost`].
    pub fn sync_now(&mut self, ctx: &ReplicaContext<'_>) {
        debug_assert!(self.quiet());
        let taken = self.take_deltas(ctx);
        self.begin_round(ctx, taken, true);
    }

    /// Starts a round for `taken`; `counts`: as a sync even if it has nothing to wait for.
    fn begin_round(&mut self, ctx: &ReplicaContext<'_>, taken: Vec<TakenDeltas>, counts: bool) {
        let round = SyncRound::start(ctx, &self.owners, &mut self.sync_id, taken, &mut self.out);
        if round.is_done() {
            // Nothing to wait for (every key lost, say): the round ends at once, and counts
            // only as a barrier's.
            self.end_sync_marks(ctx);
            if counts {
                ctx.counters.note_replica_sync();
            }
        } else {
            self.syncing = Some(round);
        }
        self.settle(ctx);
    }

    /// The messages of the round in flight still waiting for their acknowledgements: owner and
    /// id.
    pub fn awaiting_acks(&self) -> Vec<(u16, u32)> {
        self.syncing.as_ref().map(|r| r.awaiting_acks().collect()).unwrap_or_default()
    }

    /// The keys and deltas of the round's message `id` to `owner`, while it waits for its
    /// acknowledgement (the simulator's record of what reached the owners).
    #[cfg(any(test, feature = "sim"))]
    pub fn awaited_sync(&self, owner: u16, id: u32) -> Option<(&[u64], &[f32])> {
        self.syncing.as_ref()?.awaited(owner, id)
    }

    /// The REPLICA_SYNCs that action `op` sends.
    pub fn syncs_to_send(&self, op: OpToken) -> Vec<OutgoingSync<'_>> {
        self.syncing.as_ref().map(|r| r.syncs_to_send(op)).unwrap_or_default()
    }

    /// Per table: the replicas and their deltas, each taken under its latch and zeroed. A
    /// replica whose key arrived here ends, its delta added to the key. The delta of a key that
    /// is arriving here, or that a `localize` is about to move here, stays in the replica: the
    /// landing adds it to the key (`SyncMarks::taker`). The keys whose deltas are
    /// taken are marked until the round ends.
    fn take_deltas(&mut self, ctx: &ReplicaContext<'_>) -> Vec<TakenDeltas> {
        self.adopt_kept(ctx);
        let store = ctx.store;
        let mut out = Vec::new();
        let (granted, awaiting, tally) = (&self.granted, &mut self.awaiting, &mut self.tally);
        for (&table, set) in self.keys.iter_mut() {
            let (taken, marked) = take_table_deltas(store, ctx.marks, table, set, |key| {
                tally.folded += 1;
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

    /// Whether a key on its way here has a replica here with a delta (one whose drop was put
    /// off included): a sync round takes no delta of such a key, whose landing adds it to the
    /// key, so a barrier's round, which must deliver every delta, waits for the landing.
    pub fn replicas_arriving(&self, ctx: &ReplicaContext<'_>) -> bool {
        let store = ctx.store;
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

    /// Pull `op` (a make's, or a sync round's routed push-pull) answered with `values`, or
    /// failed: installs the replicas still being made (a failed make's keys are not made, and
    /// a key the failure names lost is dropped by [`ReplicaSet::forget_found_lost`]), or
    /// refreshes the routed keys' replicas. Returns the operation's error, or one of what it
    /// came to.
    pub fn handle_pulled(&mut self, ctx: &ReplicaContext<'_>, op: OpToken, values: Result<Vec<f32>>) -> Result<()> {
        let outcome = if let Some(i) = self.makes.iter().position(|m| m.op == op) {
            let make = self.makes.swap_remove(i);
            self.made(ctx, make, values)
        } else if let Some(round) = self.syncing.as_mut().filter(|r| r.routes(op)) {
            round.handle_routed(ctx, op, values, &mut self.out)
        } else {
            Ok(())
        };
        self.settle(ctx);
        outcome
    }

    fn made(&mut self, ctx: &ReplicaContext<'_>, make: Make, values: Result<Vec<f32>>) -> Result<()> {
        let Make { op, table, keys, incarnations } = make;
        for k in &keys {
            self.pulling.remove(&(table, *k));
        }
        let value_len = ctx.store.table(table).value_len();
        let values = match values {
            Ok(values) if values.len() == keys.len() * value_len => values,
            Ok(values) => {
                self.not_made(ctx, table, &keys);
                return Err(Error::Protocol(format!("a pull to make replicas of {} keys returned {} values", keys.len(), values.len())));
            }
            Err(e) => {
                self.not_made(ctx, table, &keys);
                self.out.lost.extend(lost_key_among(&e, &keys).map(|key| (table, key)));
                return Err(e);
            }
        };
        let (mut made, mut with_pushes, mut outcome) = (0, 0, Ok(()));
        for ((&key, &incarnation), value) in keys.iter().zip(&incarnations).zip(values.chunks_exact(value_len)) {
            let wanted = self.making.remove(&(table, key));
            match ctx.store.install_made_replica(table, key, incarnation, wanted, value) {
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
                    self.out.note_set(table, key, op);
                    made += 1;
                }
                // Held here: made when it leaves. Elsewhere again since the pull: made anew by
                // the next round's `remake`.
                Ok(MadeReplica::Stale) if wanted => {
                    self.tally.stale += 1;
                    if self.granted.contains(&(table, key)) {
                        self.await_departure(ctx, table, key);
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    if outcome.is_ok() {
                        outcome = Err(e);
                    }
                }
            }
        }
        ctx.counters.note_replicas_made(made);
        ctx.counters.note_made_with_pushes(with_pushes);
        outcome
    }

    /// The pull making replicas of `keys` of `table` failed: they are not being made.
    fn not_made(&mut self, ctx: &ReplicaContext<'_>, table: u16, keys: &[u64]) {
        for k in keys {
            self.making.remove(&(table, *k));
        }
        end_making(ctx.store, table, keys);
    }

    /// A drain's push `op` was acknowledged, or failed (its deltas went wherever it went: lost
    /// with the owner, or applied): the drain ends, unless a sync round that may carry an
    /// earlier delta of its keys is in flight, which it waits for. Returns the push's error.
    pub fn handle_pushed(&mut self, ctx: &ReplicaContext<'_>, op: OpToken, result: Result<()>) -> Result<()> {
        if let Some(drain) = self.drains.iter_mut().find(|d| d.push == Some(op)) {
            drain.push = None;
        }
        self.settle(ctx);
        result
    }

    /// A drain's push `op` of `deltas` of `keys` could not even be issued (the node shuts
    /// down, say), and would fail again: its replicas are removed at once and their deltas lost
    /// with the error (a key that arrived here meanwhile takes both). Returns `error`.
    pub fn handle_drain_unsent(&mut self, ctx: &ReplicaContext<'_>, op: OpToken, keys: &[u64], deltas: &[f32], error: Error) -> Result<()> {
        let Some(i) = self.drains.iter().position(|d| d.push == Some(op)) else { return Err(error) };
        let drain = self.drains.swap_remove(i);
        ctx.marks.end_sync(drain.table, &drain.marked);
        for key in &drain.keys {
            if self.draining.get(&(drain.table, *key)) == Some(&drain.id) {
                self.draining.remove(&(drain.table, *key));
            }
        }
        if !drain.keys.is_empty() {
            let store = ctx.store;
            let mut delta = vec![0.0; store.table(drain.table).value_len()];
            for (&key, taken) in keys.iter().zip(deltas.chunks_exact(delta.len())) {
                let guard = store.lock(drain.table, key);
                if store.remove_replica(&guard, &mut delta)
                    && let Some(slot) = guard.slot()
                {
                    slot.add(&delta);
                    slot.add(taken);
                }
            }
        }
        self.settle(ctx);
        Err(error)
    }

    /// `owner` acknowledged message `id` of the round in flight with `ack`.
    pub fn handle_sync_ack(&mut self, ctx: &ReplicaContext<'_>, owner: u16, id: u32, ack: ReplicaSyncAck) -> Result<()> {
        let outcome = match self.syncing.as_mut() {
            Some(round) => round.handle_ack(ctx, &mut self.owners, owner, id, ack, &mut self.out),
            None => Ok(()),
        };
        self.settle(ctx);
        outcome
    }

    /// Message `id` of the round in flight to `owner` will not be acknowledged: `error` says
    /// why (the owner is gone, or silent past the round's deadline). Returns it.
    pub fn handle_sync_unanswered(&mut self, ctx: &ReplicaContext<'_>, owner: u16, id: u32, error: Error) -> Result<()> {
        let outcome = match self.syncing.as_mut() {
            Some(round) => round.handle_unanswered(owner, id, error),
            None => Ok(()),
        };
        self.settle(ctx);
        outcome
    }

    /// Image read `op` finished with the bytes read, or failed.
    pub fn handle_read(&mut self, ctx: &ReplicaContext<'_>, op: OpToken, copy: Result<Vec<u8>>) -> Result<()> {
        let outcome = match self.syncing.as_mut() {
            Some(round) => round.handle_read(ctx, op, copy, &mut self.out),
            None => Ok(()),
        };
        self.settle(ctx);
        outcome
    }

    /// Drops the replicas of the keys found lost with their owners (their deltas can reach no
    /// one; the drop's push fails as any push of a lost key does), stops making them, and takes
    /// no grant of them again. Accesses of these keys then fail as those of any key lost with
    /// its owner, rather than being served by a replica whose pushes would vanish. The driver
    /// calls this where its own worker may push (not in a barrier's round).
    pub fn forget_found_lost(&mut self, ctx: &ReplicaContext<'_>) {
        if self.out.lost.is_empty() {
            return;
        }
        let mut tables: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
        for (table, key) in std::mem::take(&mut self.out.lost) {
            if self.lost.insert((table, key)) {
                tables.entry(table).or_default().push(key);
            }
        }
        for (table, keys) in tables {
            tracing::debug!(table, keys = keys.len(), "run-time replicas of keys lost with their owner are dropped");
            ctx.counters.note_replicas_lost(keys.len() as u64);
            self.drop_replicas(ctx, table, &keys, false);
        }
    }

    /// Ends the round once everything of it completed (the keys it carried are released to
    /// `localize`), and then the drains that are ready: pushed, with no round in flight that
    /// may carry an earlier delta of their keys (none starts while anything drains).
    fn settle(&mut self, ctx: &ReplicaContext<'_>) {
        if self.syncing.as_ref().is_some_and(SyncRound::is_done) {
            self.syncing = None;
            self.end_sync_marks(ctx);
            ctx.counters.note_replica_sync();
        }
        if self.syncing.is_some() {
            return;
        }
        while let Some(i) = self.drains.iter().position(|d| d.push.is_none()) {
            let drain = self.drains.swap_remove(i);
            // Applied where the key is (or lost with its owner): the key may move here now.
            ctx.marks.end_sync(drain.table, &drain.marked);
            self.end_drain(ctx, &drain);
        }
    }

    /// Removes the drained replicas of `drain`'s keys (those a grant did not take back). One
    /// whose key arrived here adds its delta to the key; one pushed to since its drain began
    /// drains again with that delta, unless the service stops, when it is removed and its delta
    /// pushed.
    fn end_drain(&mut self, ctx: &ReplicaContext<'_>, drain: &Drain) {
        let table = drain.table;
        let store = ctx.store;
        let value_len = store.table(table).value_len();
        let mut delta = vec![0.0; value_len];
        let zero = vec![0.0; value_len];
        let (mut again, mut pushed, mut deltas, mut marked) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut taker = store.table(table).dynamic().map(|_| ctx.marks.taker(table));
        for &key in &drain.keys {
            if self.draining.get(&(table, key)) != Some(&drain.id) {
                continue;
            }
            self.draining.remove(&(table, key));
            let guard = store.lock(table, key);
            match end_drained_replica(store, &guard, &mut delta, &zero, self.stopping, taker.as_mut()) {
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
            ctx.counters.note_drained_again(again.len() as u64);
            // Every key drained again was marked (a refused one was put off).
            self.push_drain(table, again.clone(), deltas, again, true);
        } else if !pushed.is_empty() {
            self.push_drain(table, pushed, deltas, marked, false);
        }
    }

    /// The sync round that carried the marked deltas has ended: localizes waiting for them go on.
    fn end_sync_marks(&mut self, ctx: &ReplicaContext<'_>) {
        for (table, keys) in self.sync_marked.drain(..) {
            ctx.marks.end_sync(table, &keys);
        }
    }
}
