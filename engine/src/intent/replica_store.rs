//! What a run-time replica does to the store — take its delta for a sync round, drop it, end
//! its drain or its making, set it to its owner's value — each under the key's latch, with no
//! node, worker or I/O; the replica set's state machine (`replica_set.rs`) calls them.

use super::sync_marks::{SyncMarks, SyncTaker};
use crate::error::Error;
use crate::protocol::Directory;
use crate::store::{KeyGuard, Residence, Slot, Store};
use crate::util::FastSet;

/// The deltas a sync round takes from one table's replicas, each with the replica's
/// incarnation when it was taken (`DynamicReplicas::incarnation`).
pub(crate) struct TakenDeltas {
    /// The table.
    pub table: u16,
    /// The replicas' keys.
    pub keys: Vec<u64>,
    /// Their deltas, one value each.
    pub deltas: Vec<f32>,
    /// Their incarnations.
    pub incarnations: Vec<u32>,
}

/// The node to send `key`'s delta to: where it was last found to be (`hint`), else its home,
/// else (this node being the home) the owner `dir` records; `None` if that is this node, a lost
/// one or one `alive` says is gone.
pub(crate) fn believed_owner(dir: &Directory, hint: Option<u16>, table: u16, key: u64, alive: impl Fn(u16) -> bool) -> Option<u16> {
    let rank = dir.rank();
    let home = dir.home(table, key);
    let recorded = if home == rank { dir.owner_of(table, key) } else { None };
    [hint, Some(home), recorded].into_iter().flatten().find(|&n| n != rank && (n as usize) < dir.nodes() && !dir.is_lost(n) && alive(n))
}

/// The key of `keys` that `error` says was lost with its owner, if any.
pub(crate) fn lost_key_among(error: &Error, keys: &[u64]) -> Option<u64> {
    match error {
        Error::KeyLost { key, .. } if keys.contains(key) => Some(*key),
        _ => None,
    }
}

/// Takes the deltas of the replicas of `table` whose keys `set` lists, each under its latch and
/// zeroed (see `ReplicaSet::take_deltas`): a key whose replica ended leaves `set`, and
/// `arrived` is told of each that ended because the key arrived here (its delta went into the
/// key). Returns the deltas taken, if any, and the keys marked as carried by the round in
/// `marks` (until [`SyncMarks::end_sync`]).
pub(crate) fn take_table_deltas(
    store: &Store,
    marks: &SyncMarks,
    table: u16,
    set: &mut FastSet<u64>,
    mut arrived: impl FnMut(u64),
) -> (Option<TakenDeltas>, Vec<u64>) {
    let value_len = store.table(table).value_len();
    let dynamic = store.table(table).dynamic();
    let mut marked = Vec::new();
    let mut incarnations = Vec::with_capacity(set.len());
    let mut keys = Vec::with_capacity(set.len());
    let mut deltas = Vec::with_capacity(set.len() * value_len);
    let mut delta = vec![0.0; value_len];
    let zero = vec![0.0; value_len];
    // Held through the table's keys: no worker's `localize` marks a key in between.
    let mut taker = dynamic.map(|_| marks.taker(table));
    set.retain(|&key| {
        let guard = store.lock(table, key);
        match look_at_replica(store, &guard, &mut delta) {
            Held::Arrived => {
                arrived(key);
                false
            }
            Held::Gone => false,
            Held::Replica { delta: delta_slot, clean } => {
                if !clean {
                    if guard.residence() == Residence::Arriving || !taker.as_mut().is_some_and(|t| t.take(key)) {
                        return true;
                    }
                    marked.push(key);
                    delta_slot.write(&zero);
                }
                tracing::trace!(target: "ferry::replica_trace",  table, key, ?delta, clean, "delta taken for a sync round");
                keys.push(key);
                deltas.extend_from_slice(&delta);
                incarnations.push(dynamic.map_or(0, |d| d.incarnation(key)));
                true
            }
        }
    });
    let taken = (!keys.is_empty()).then_some(TakenDeltas { table, keys, deltas, incarnations });
    (taken, marked)
}

/// Ends the making of the replicas of `keys` of `table` whose pull failed or was never sent
/// (each under its latch): the protocol stops adding up the pushes sent behind the pull.
pub(crate) fn end_making(store: &Store, table: u16, keys: &[u64]) {
    let Some(d) = store.table(table).dynamic() else { return };
    for &key in keys {
        let _latch = store.lock(table, key);
        d.end_making(key);
    }
}

/// Whether a drain may take the delta of the replica of the key `guard` latches, and if so
/// whether `taker` marked the key as carried: `None` when the key is arriving here or a
/// `localize` is about to move it here (the delta then stays for the landing), unless the
/// service is `stopping` (nothing would try again: taken all the same, unmarked).
fn take_for_drain(guard: &KeyGuard<'_>, taker: Option<&mut SyncTaker<'_>>, stopping: bool) -> Option<bool> {
    let arriving = guard.residence() == Residence::Arriving;
    let marked = !arriving && taker.is_some_and(|t| t.take(guard.key()));
    (marked || stopping).then_some(marked)
}

/// What dropping a run-time replica came to ([`drop_replica`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dropped {
    /// No replica (or the key arrived here, which ended it).
    Nothing,
    /// Its delta stays for the key, arriving here or about to be moved here by a `localize`,
    /// to take when it lands: drop again later.
    PutOff,
    /// Its delta, taken and zeroed, is to be pushed to the owner; it drains until then.
    /// `marked`: the key is marked as carried until the push is acknowledged.
    Push {
        /// Whether the key was marked.
        marked: bool,
    },
    /// Clean, but the sync round in flight carries its last delta: it drains until that ends.
    WaitForRound,
    /// Clean: removed.
    Removed,
}

/// Drops the run-time replica of the key `guard` latches (`ReplicaSet::drop_replicas`): a
/// dirty one's delta goes to `delta` and is zeroed in the replica (`zero` is one value of
/// zeros), the key marked by `taker` until the delta's push is acknowledged, unless the key is
/// arriving here or about to be (see [`take_for_drain`]) and the service is not `stopping`; a
/// clean one is removed unless a round is `syncing`.
pub(crate) fn drop_replica(
    store: &Store,
    guard: &KeyGuard<'_>,
    delta: &mut [f32],
    zero: &[f32],
    stopping: bool,
    syncing: bool,
    taker: Option<&mut SyncTaker<'_>>,
) -> Dropped {
    // A key that arrived here meanwhile took the delta into its slot.
    match look_at_replica(store, guard, delta) {
        Held::Arrived | Held::Gone => Dropped::Nothing,
        Held::Replica { delta: delta_slot, clean: false } => {
            let Some(marked) = take_for_drain(guard, taker, stopping) else { return Dropped::PutOff };
            delta_slot.write(zero);
            Dropped::Push { marked }
        }
        // Nothing new since the round in flight took its delta: it waits for that.
        Held::Replica { clean: true, .. } if syncing => Dropped::WaitForRound,
        Held::Replica { clean: true, .. } => {
            store.remove_replica(guard, delta);
            Dropped::Removed
        }
    }
}

/// What became of a draining replica whose push was acknowledged ([`end_drained_replica`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drained {
    /// It ended: clean and removed, or gone (the key arrived here, which took its delta).
    Ended,
    /// Removed with what was pushed to it meanwhile, now in `delta`, to push (the service
    /// stops); `marked` as for [`Dropped::Push`].
    Removed {
        /// Whether the key was marked.
        marked: bool,
    },
    /// Pushed to meanwhile, and the key is arriving here or about to be: its landing takes the
    /// delta.
    PutOff,
    /// Pushed to meanwhile: that delta, now in `delta` and zeroed in the replica, drains again,
    /// the key marked until its push is acknowledged.
    Again,
}

/// Ends the drain of the replica of the key `guard` latches, its push acknowledged
/// (`ReplicaSet::end_drain`): a clean replica is removed; one pushed to meanwhile is removed
/// with its delta if this is the `last` drain, is put off while its key is arriving here or
/// about to be (see [`take_for_drain`]), and otherwise gives its delta (into `delta`, zeroed in
/// the replica; `zero` is one value of zeros) to drain again, the key marked by `taker`.
pub(crate) fn end_drained_replica(
    store: &Store,
    guard: &KeyGuard<'_>,
    delta: &mut [f32],
    zero: &[f32],
    last: bool,
    taker: Option<&mut SyncTaker<'_>>,
) -> Drained {
    match look_at_replica(store, guard, delta) {
        Held::Arrived | Held::Gone => Drained::Ended,
        Held::Replica { clean: true, .. } => {
            store.remove_replica(guard, delta);
            Drained::Ended
        }
        Held::Replica { delta: delta_slot, .. } => {
            let Some(marked) = take_for_drain(guard, taker, last) else { return Drained::PutOff };
            if last {
                store.remove_replica(guard, delta);
                return Drained::Removed { marked };
            }
            delta_slot.write(zero);
            Drained::Again
        }
    }
}

/// What the key a [`KeyGuard`] latches holds of its run-time replica, for ending or syncing it.
pub(crate) enum Held<'g> {
    /// The key arrived here: any replica has ended, its delta added to the key's slot.
    Arrived,
    /// The key has no replica here.
    Gone,
    /// A replica, whose delta the caller's buffer received; `clean` when that delta is zero.
    Replica { delta: Slot<'g>, clean: bool },
}

/// Looks at the replica of the key `guard` latches, reading its delta into `delta`; ends it at
/// once when the key arrived here (the slot takes its delta, which nothing else holds).
pub(crate) fn look_at_replica<'g>(store: &Store, guard: &'g KeyGuard<'_>, delta: &mut [f32]) -> Held<'g> {
    if let Some(slot) = guard.slot() {
        if store.remove_replica(guard, delta) {
            slot.add(delta);
        }
        return Held::Arrived;
    }
    let Some((_, delta_slot)) = guard.replica() else { return Held::Gone };
    delta_slot.read(delta);
    let clean = delta.iter().all(|&d| d == 0.0);
    Held::Replica { delta: delta_slot, clean }
}

/// Sets the replica of `key`, if it is still here and still of `incarnation` (the one its delta
/// was taken from), to its owner's `value` (which included the replica's delta when last taken)
/// plus what was pushed to it since (`delta` is scratch space). A key that arrived here
/// meanwhile keeps its own value; a replica made since, or one of a key that was here since,
/// keeps its value too (the owner's predates pushes it has). Returns whether it was set.
pub(crate) fn set_replica(store: &Store, table: u16, key: u64, incarnation: u32, value: &mut [f32], delta: &mut [f32]) -> bool {
    let guard = store.lock(table, key);
    if guard.slot().is_some() || store.table(table).dynamic().is_none_or(|d| d.incarnation(key) != incarnation) {
        return false;
    }
    let Some((value_slot, delta_slot)) = guard.replica() else { return false };
    delta_slot.read(delta);
    tracing::trace!(target: "ferry::replica_trace",  table, key, fresh = ?value, ?delta, "replica set from its owner's value");
    for (v, d) in value.iter_mut().zip(delta.iter()) {
        *v += d;
    }
    value_slot.write(value);
    true
}
