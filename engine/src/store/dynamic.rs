//! Replicas made at run time for intent (AdaPM, Section 4.1): a key that several nodes need at
//! once gets a replica on each intending node that does not hold it.
//!
//! Unlike the replicas fixed at start-up ([`super::ReplicaState`]), a run-time replica is not
//! published in the slot map: the protocol — which serves remote operations, relocates keys and
//! answers for the key's home — keeps seeing the key as held elsewhere, so nothing it does can
//! touch the replica. Only the local paths of this node's workers look here, after the slot
//! map, under the key's latch: a pull reads the replica, a push adds to it and to its *delta*
//! (this node's pushes not yet sent to the key's owner), a set is routed to the owner.
//!
//! Each replica is two slots of the table: its value and its delta. Per key, one `u64` says
//! which (zero: no replica), in memory mapped without populating it, so a table with no
//! replicas costs address space only.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use memmap2::{MmapMut, MmapOptions};

use crate::error::{Error, Result};

/// Per key of one table: the slots of its run-time replica on this node, if any.
pub struct DynamicReplicas {
    entries: *const AtomicU64,
    len: usize,
    _memory: MmapMut,
    /// Per key: how many times a replica of it was made or ended here, or the key landed here
    /// (see [`DynamicReplicas::incarnation`]); mapped like `entries`.
    incarnations: *const AtomicU32,
    _incarnation_memory: MmapMut,
    live: AtomicUsize,
    /// Keys held here that this node has been granted a replica of: when one leaves, it keeps
    /// its departing value as a replica (see [`DynamicReplicas::wanted`]).
    wanted: parking_lot::Mutex<Wanted>,
    wanted_count: AtomicUsize,
    /// Keys whose replicas are being made, with the sum of the pushes this node's workers sent
    /// to each since the pull that makes it left (see [`DynamicReplicas::begin_making`]).
    making: parking_lot::Mutex<crate::util::FastMap<u64, Vec<f32>>>,
    making_count: AtomicUsize,
}

/// The marked keys, and whether marks are taken: only while an intent service runs that adopts
/// the replicas kept (otherwise nobody would sync or drop them); and the keys that stayed as
/// replicas since the service last looked.
#[derive(Default)]
struct Wanted {
    keys: crate::util::FastSet<u64>,
    open: bool,
    kept: Vec<u64>,
}

// SAFETY: `entries` points into `_memory` and `incarnations` into `_incarnation_memory`, both
// owned by this value and mapped until it drops; they are only accessed as atomics.
unsafe impl Send for DynamicReplicas {}
// SAFETY: as above.
unsafe impl Sync for DynamicReplicas {}

/// The two slots of one run-time replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaSlots {
    /// The replica's value.
    pub value: u32,
    /// This node's pushes to it that its owner has not been sent yet.
    pub delta: u32,
}

impl ReplicaSlots {
    fn pack(self) -> u64 {
        (self.value as u64 + 1) | ((self.delta as u64 + 1) << 32)
    }

    fn unpack(word: u64) -> Option<ReplicaSlots> {
        (word != 0).then(|| ReplicaSlots { value: (word as u32).wrapping_sub(1), delta: ((word >> 32) as u32).wrapping_sub(1) })
    }
}

impl DynamicReplicas {
    /// Room for the replicas of `keys` keys (untouched, zeroed pages: no replica).
    pub fn new(keys: usize) -> Result<DynamicReplicas> {
        let bytes = keys.max(1) * 8;
        let memory = MmapOptions::new().len(bytes).map_anon().map_err(|e| Error::Memory(format!("cannot map {bytes} bytes for replica entries: {e}")))?;
        let entries = memory.as_ptr() as *const AtomicU64;
        let incarnation_bytes = keys.max(1) * 4;
        let incarnation_memory = MmapOptions::new()
            .len(incarnation_bytes)
            .map_anon()
            .map_err(|e| Error::Memory(format!("cannot map {incarnation_bytes} bytes for replica incarnations: {e}")))?;
        let incarnations = incarnation_memory.as_ptr() as *const AtomicU32;
        Ok(DynamicReplicas {
            entries,
            len: keys,
            _memory: memory,
            incarnations,
            _incarnation_memory: incarnation_memory,
            live: AtomicUsize::new(0),
            wanted: Default::default(),
            wanted_count: AtomicUsize::new(0),
            making: Default::default(),
            making_count: AtomicUsize::new(0),
        })
    }

    #[inline]
    fn entry(&self, key: u64) -> Option<&AtomicU64> {
        // SAFETY: `entries` is one of this table's per-key arrays.
        unsafe { self.mapped(self.entries, key) }
    }

    #[inline]
    fn incarnation_entry(&self, key: u64) -> Option<&AtomicU32> {
        // SAFETY: `incarnations` is one of this table's per-key arrays.
        unsafe { self.mapped(self.incarnations, key) }
    }

    /// `key`'s element of one of the per-key arrays this table maps.
    ///
    /// # Safety
    ///
    /// `base` must be `self.entries` or `self.incarnations`.
    #[inline]
    unsafe fn mapped<T>(&self, base: *const T, key: u64) -> Option<&T> {
        if key as usize >= self.len {
            return None;
        }
        // SAFETY: `base` is `entries` or `incarnations` (the caller's promise), each a zeroed,
        // page-aligned mapping of `len` elements (so aligned for its atomic type, whose layout
        // is that of the plain integer) that lives as long as `self`; bounds checked above.
        Some(unsafe { &*base.add(key as usize) })
    }

    /// `key`'s incarnation: it changes (under the key's latch) whenever a replica of the key is
    /// made or ends here, and whenever the key lands here. A value pulled or synced for a
    /// replica is written into it only if the incarnation is still the one read when the pull
    /// or the sync began: otherwise the replica is not the one the value is for, or the key
    /// was here meanwhile and took pushes the value lacks.
    #[inline]
    pub fn incarnation(&self, key: u64) -> u32 {
        self.incarnation_entry(key).map_or(0, |e| e.load(Ordering::Acquire))
    }

    /// The key landed here (the caller holds its latch): see [`DynamicReplicas::incarnation`].
    pub fn note_landing(&self, key: u64) {
        self.bump_incarnation(key);
    }

    fn bump_incarnation(&self, key: u64) {
        if let Some(e) = self.incarnation_entry(key) {
            e.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The replica of `key` here. Acting on its slots needs the key's latch.
    #[inline]
    pub fn get(&self, key: u64) -> Option<ReplicaSlots> {
        ReplicaSlots::unpack(self.entry(key)?.load(Ordering::Acquire))
    }

    /// Whether any replica exists (lets bulk paths skip the per-key check).
    #[inline]
    pub fn any(&self) -> bool {
        self.live.load(Ordering::Acquire) > 0
    }

    /// Replicas that exist now.
    #[cfg(test)]
    pub fn count(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Marks (`true`; only while marks are open) or unmarks `key` as wanted as a replica when it
    /// leaves this node; returns whether the mark changed. A caller that unmarks a key and then
    /// takes its latch finds any replica kept on its departure: the departure path checks the
    /// mark under the latch and installs before letting go.
    pub fn want(&self, key: u64, wanted: bool) -> bool {
        if !wanted && self.wanted_count.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut marks = self.wanted.lock();
        let changed = if wanted { marks.open && marks.keys.insert(key) } else { marks.keys.remove(&key) };
        if changed {
            if wanted {
                self.wanted_count.fetch_add(1, Ordering::AcqRel);
            } else {
                self.wanted_count.fetch_sub(1, Ordering::AcqRel);
            }
        }
        changed
    }

    /// Starts taking marks (the intent service started).
    pub fn open_marks(&self) {
        self.wanted.lock().open = true;
    }

    /// Unmarks every key and takes no more marks (the intent service stops); returns the keys
    /// that were marked.
    pub fn want_none(&self) -> Vec<u64> {
        let mut marks = self.wanted.lock();
        marks.open = false;
        self.wanted_count.fetch_sub(marks.keys.len(), Ordering::AcqRel);
        marks.keys.drain().collect()
    }

    /// Whether `key`, leaving this node, should stay here as a replica (the caller holds its
    /// latch). One load when no key is marked.
    #[inline]
    pub fn wanted(&self, key: u64) -> bool {
        self.wanted_count.load(Ordering::Acquire) > 0 && self.wanted.lock().keys.contains(&key)
    }

    /// `key` left and stayed as a replica (the caller holds its latch): the intent service
    /// takes it over with [`DynamicReplicas::take_kept`].
    pub fn note_kept(&self, key: u64) {
        self.wanted.lock().kept.push(key);
    }

    /// The keys that stayed as replicas since the last call.
    pub fn take_kept(&self) -> Vec<u64> {
        std::mem::take(&mut self.wanted.lock().kept)
    }

    /// The pull that makes `key`'s replica is being sent (the caller holds the key's latch and
    /// the shard lock under which the pull is queued). From now until
    /// [`DynamicReplicas::end_making`], each push of this node's workers to the key that is
    /// queued for the network — behind the pull, on the same ordered path, so the value pulled
    /// lacks it — is added up here (`note_sent_push`), to be added to the replica. A key with a
    /// pull in flight already keeps its sum.
    pub fn begin_making(&self, key: u64, value_len: usize) {
        let mut making = self.making.lock();
        if let std::collections::hash_map::Entry::Vacant(entry) = making.entry(key) {
            entry.insert(vec![0.0; value_len]);
            self.making_count.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Whether a replica is being made of any key (one load).
    #[inline]
    pub fn any_making(&self) -> bool {
        self.making_count.load(Ordering::Acquire) > 0
    }

    /// Whether `key`'s replica is being made (its pull is in flight).
    pub fn is_making(&self, key: u64) -> bool {
        self.any_making() && self.making.lock().contains_key(&key)
    }

    /// Adds `update`, a push to `key` queued for the network, to the key's sum if its replica
    /// is being made (the caller holds the key's latch); returns whether it was.
    pub fn note_sent_push(&self, key: u64, update: &[f32]) -> bool {
        if !self.any_making() {
            return false;
        }
        let mut making = self.making.lock();
        let Some(sum) = making.get_mut(&key) else { return false };
        for (s, u) in sum.iter_mut().zip(update) {
            *s += u;
        }
        true
    }

    /// The pull that made `key`'s replica has been answered: returns the sum of the pushes
    /// sent since it left (the caller holds the key's latch), and stops adding them up.
    pub fn end_making(&self, key: u64) -> Option<Vec<f32>> {
        if !self.any_making() {
            return None;
        }
        let sum = self.making.lock().remove(&key)?;
        self.making_count.fetch_sub(1, Ordering::AcqRel);
        Some(sum)
    }

    /// Records `slots` as `key`'s replica (the caller holds the key's latch; none existed).
    pub(super) fn set(&self, key: u64, slots: ReplicaSlots) -> bool {
        let Some(entry) = self.entry(key) else { return false };
        if entry.load(Ordering::Relaxed) != 0 {
            return false;
        }
        self.live.fetch_add(1, Ordering::AcqRel);
        entry.store(slots.pack(), Ordering::Release);
        self.bump_incarnation(key);
        true
    }

    /// Forgets `key`'s replica and returns its slots (the caller holds the key's latch).
    pub(super) fn clear(&self, key: u64) -> Option<ReplicaSlots> {
        let slots = ReplicaSlots::unpack(self.entry(key)?.swap(0, Ordering::AcqRel))?;
        self.live.fetch_sub(1, Ordering::AcqRel);
        self.bump_incarnation(key);
        Some(slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_pack_both_slots_and_count_replicas() {
        let r = DynamicReplicas::new(100).unwrap();
        assert!(!r.any() && r.get(7).is_none() && r.get(1000).is_none());
        let slots = ReplicaSlots { value: 0, delta: u32::MAX - 2 };
        assert!(r.set(7, slots));
        assert!(!r.set(7, slots), "a key has one replica at most");
        assert!(!r.set(100, slots), "beyond the table");
        assert_eq!(r.get(7), Some(slots));
        assert_eq!(r.count(), 1);
        assert_eq!(r.clear(7), Some(slots));
        assert_eq!(r.clear(7), None);
        assert!(!r.any());
    }

    #[test]
    fn a_replica_made_or_ended_or_a_landing_changes_the_incarnation() {
        let r = DynamicReplicas::new(100).unwrap();
        let slots = ReplicaSlots { value: 1, delta: 2 };
        let start = r.incarnation(7);
        assert!(r.set(7, slots));
        let made = r.incarnation(7);
        assert_ne!(made, start);
        assert!(!r.set(7, slots));
        assert_eq!(r.incarnation(7), made, "a replica refused changes nothing");
        r.clear(7);
        let ended = r.incarnation(7);
        assert_ne!(ended, made);
        r.note_landing(7);
        assert_ne!(r.incarnation(7), ended);
        assert_eq!(r.incarnation(8), 0, "other keys keep theirs");
        assert_eq!(r.incarnation(1000), 0, "beyond the table");
    }

    #[test]
    fn keys_are_marked_for_a_replica_on_departure_and_unmarked() {
        let r = DynamicReplicas::new(100).unwrap();
        assert!(!r.want(3, true) && !r.wanted(3), "no marks before they are opened");
        r.open_marks();
        assert!(r.want(3, true) && !r.want(3, true), "marked once");
        r.want(4, true);
        assert!(r.wanted(3) && r.wanted(4) && !r.wanted(5));
        assert!(r.want(3, false) && !r.want(3, false), "unmarked once");
        assert!(!r.wanted(3) && r.wanted(4));
        assert_eq!(r.want_none(), vec![4]);
        assert!(!r.wanted(4));
        assert!(!r.want(5, true), "closed again");
        r.open_marks();
        r.want(5, true);
        assert!(r.wanted(5), "the count survives unmarking what was not marked");
    }

    #[test]
    fn pushes_sent_behind_a_making_pull_are_added_up_until_it_ends() {
        let r = DynamicReplicas::new(100).unwrap();
        assert!(!r.note_sent_push(3, &[1.0, 1.0]) && r.end_making(3).is_none(), "nothing is being made");
        r.begin_making(3, 2);
        assert!(r.any_making());
        assert!(r.note_sent_push(3, &[1.0, 2.0]) && !r.note_sent_push(4, &[5.0, 5.0]));
        // A second pull of the same key keeps the sum of the first.
        r.begin_making(3, 2);
        r.note_sent_push(3, &[10.0, 20.0]);
        assert_eq!(r.end_making(3), Some(vec![11.0, 22.0]));
        assert!(!r.any_making() && r.end_making(3).is_none() && !r.note_sent_push(3, &[1.0, 1.0]));
    }
}
