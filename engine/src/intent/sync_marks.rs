//! Keeps a run-time replica's delta off its way to the owner while the key may be moving here.
//!
//! A sync round sends a replica's delta straight to the node believed to own the key
//! (REPLICA_SYNC), while a relocation to this node travels by the key's home: the two are not
//! ordered. A dropped replica's delta goes in a push (a drain), which is issued after the delta
//! was taken, so a `localize` issued in between overtakes it. Either way, a key that landed
//! here while its delta was on its way to the old owner would lack this node's pushes until the
//! delta followed it, and this node's workers, which read the key's slot once it landed (the
//! replica ends there), would miss their own pushes meanwhile. So a round or a drain takes no
//! delta of a key a worker's `localize` is about to move here (or that is arriving: the landing
//! adds the delta to the key), and a `localize` of a key whose delta a round or a drain carries
//! waits until it has reached the owner (a worker's) or is put off until then (the intent
//! service's, which checks [`SyncMarks::carried`] while no other thread takes deltas).
//!
//! The marks are the intent service's: its replica set ([`super::ReplicaSet`]) takes and ends
//! them through its context, a worker's `localize` begins and ends its own, and the simulator
//! keeps a set per node. They are shared between the service's thread and the workers', so they
//! come with the lock and the condition variable a waiting `localize` needs.

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::util::FastMap;

/// A node's sync marks (see the module documentation).
#[derive(Default)]
pub(crate) struct SyncMarks {
    marks: Mutex<Marks>,
    /// Notified when a round's or a drain's keys are released.
    synced: Condvar,
}

/// Per (table, key): how many takes carry its delta, and how many `localize`s are about to
/// move it here.
#[derive(Default)]
struct Marks {
    in_sync: FastMap<(u16, u64), u32>,
    localizing: FastMap<(u16, u64), u32>,
}

/// Takes one of `key`'s marks in `counts` back (the key is unmarked at zero; an extra call is
/// harmless).
fn unmark(counts: &mut FastMap<(u16, u64), u32>, key: (u16, u64)) {
    if let std::collections::hash_map::Entry::Occupied(mut entry) = counts.entry(key) {
        *entry.get_mut() -= 1;
        if *entry.get() == 0 {
            entry.remove();
        }
    }
}

/// A sync round's or a drain's hold on the marks of one table while it takes deltas (see
/// [`SyncMarks::taker`]): no `localize` marks a key meanwhile.
pub(crate) struct SyncTaker<'a> {
    marks: MutexGuard<'a, Marks>,
    table: u16,
}

impl SyncTaker<'_> {
    /// A sync round or a drain is about to take `key`'s delta (not zero; the caller holds the
    /// key's latch and has checked that the key is not arriving here): returns false, taking
    /// nothing, when a `localize` is about to move the key here (its delta stays in the
    /// replica, and the landing adds it to the key); otherwise marks the key as carried until
    /// [`SyncMarks::end_sync`] (once per mark: a drain may carry a key's newer delta while a
    /// round carries its older one).
    pub fn take(&mut self, key: u64) -> bool {
        if self.marks.localizing.contains_key(&(self.table, key)) {
            return false;
        }
        *self.marks.in_sync.entry((self.table, key)).or_insert(0) += 1;
        true
    }
}

impl SyncMarks {
    /// Marks for a sync round or a drain taking deltas of `table` (held until dropped): see
    /// [`SyncTaker::take`].
    pub fn taker(&self, table: u16) -> SyncTaker<'_> {
        SyncTaker { marks: self.marks.lock(), table }
    }

    /// Of `keys` of `table`, those whose deltas a sync round or a drain in flight carries.
    pub fn carried(&self, table: u16, keys: &[u64]) -> Vec<u64> {
        let marks = self.marks.lock();
        if marks.in_sync.is_empty() {
            return Vec::new();
        }
        keys.iter().copied().filter(|&k| marks.in_sync.contains_key(&(table, k))).collect()
    }

    /// The sync round or the drain that carried the deltas of `keys` of `table` has ended
    /// (every delta applied where its key is held): a `localize` waiting for them goes on.
    pub fn end_sync(&self, table: u16, keys: &[u64]) {
        if keys.is_empty() {
            return;
        }
        let mut marks = self.marks.lock();
        for &key in keys {
            unmark(&mut marks.in_sync, (table, key));
        }
        self.synced.notify_all();
    }

    /// A `localize` is about to move `keys` of `table` here: from now until
    /// [`SyncMarks::end_localize`] no sync round takes their deltas. Returns those whose deltas
    /// a round in flight carries already (the caller waits for them with
    /// [`SyncMarks::wait_synced`], or leaves them out and ends their marks).
    pub fn begin_localize(&self, table: u16, keys: &[u64]) -> Vec<u64> {
        let mut marks = self.marks.lock();
        for &key in keys {
            *marks.localizing.entry((table, key)).or_insert(0) += 1;
        }
        keys.iter().copied().filter(|&k| marks.in_sync.contains_key(&(table, k))).collect()
    }

    /// The `localize` that marked `keys` of `table` has been issued (they are arriving or here)
    /// or given up.
    pub fn end_localize(&self, table: u16, keys: &[u64]) {
        let mut marks = self.marks.lock();
        for &key in keys {
            unmark(&mut marks.localizing, (table, key));
        }
    }

    /// Whether a `localize` is about to move `key` of `table` here (between
    /// [`SyncMarks::begin_localize`] and [`SyncMarks::end_localize`]).
    #[cfg(any(test, feature = "sim"))]
    pub fn is_localizing(&self, table: u16, key: u64) -> bool {
        self.marks.lock().localizing.contains_key(&(table, key))
    }

    /// Waits until no sync round carries the delta of any of `keys` of `table`, at most until
    /// `deadline`; returns whether none does.
    pub fn wait_synced(&self, table: u16, keys: &[u64], deadline: std::time::Instant) -> bool {
        let mut marks = self.marks.lock();
        loop {
            if !keys.iter().any(|&k| marks.in_sync.contains_key(&(table, k))) {
                return true;
            }
            if self.synced.wait_until(&mut marks, deadline).timed_out() {
                return !keys.iter().any(|&k| marks.in_sync.contains_key(&(table, k)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sync_round_and_a_localize_never_hold_one_key_at_once() {
        let r = std::sync::Arc::new(SyncMarks::default());
        // A localize about to move key 3 keeps its delta out of a round.
        assert!(r.begin_localize(0, &[3]).is_empty());
        assert!(r.is_localizing(0, 3) && !r.taker(0).take(3));
        assert!(r.taker(1).take(3), "another table's key 3 is another key");
        r.end_sync(1, &[3]);
        r.end_localize(0, &[3]);
        assert!(!r.is_localizing(0, 3) && r.taker(0).take(3));
        assert_eq!(r.carried(0, &[2, 3]), vec![3]);
        assert!(r.carried(1, &[3]).is_empty());
        // Key 3's delta is in a round now: a localize learns it and waits for the round.
        assert_eq!(r.begin_localize(0, &[3, 4]), vec![3]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(20);
        assert!(!r.wait_synced(0, &[3], deadline), "the round has not ended");
        let ender = {
            let r = r.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                r.end_sync(0, &[3]);
            })
        };
        assert!(r.wait_synced(0, &[3, 4], std::time::Instant::now() + std::time::Duration::from_secs(10)));
        ender.join().unwrap();
        r.end_localize(0, &[3, 4]);
        assert!(!r.is_localizing(0, 3) && !r.is_localizing(0, 4));
        // Carried twice (a drain's newer delta while a round carries the older one): the key
        // is free once both ended.
        assert!(r.taker(0).take(6) && r.taker(0).take(6));
        r.end_sync(0, &[6]);
        assert_eq!(r.carried(0, &[6]), vec![6], "one end freed a key carried twice");
        r.end_sync(0, &[6]);
        assert!(r.carried(0, &[6]).is_empty());
        r.end_sync(0, &[6]);
        assert!(r.taker(0).take(6), "an extra end is harmless");
        // Marks nest: two localizes of one key.
        r.begin_localize(0, &[5]);
        r.begin_localize(0, &[5]);
        r.end_localize(0, &[5]);
        assert!(r.is_localizing(0, 5));
        r.end_localize(0, &[5]);
        assert!(!r.is_localizing(0, 5));
    }
}
