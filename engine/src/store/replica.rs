//! A table's replicas on this node: which keys are replicas, and the updates pushed to them
//! that their home nodes have not seen yet.
//!
//! A replicated key has a slot on every node, published in the slot map like any key held here,
//! so the local path finds it with the same lookup and the same latch (NuPS, Section 3.2: one
//! latch covers both checks). On its home node that slot is the authoritative value. On every
//! other node it is a replica, and a push to it is also added to the key's *delta* — the sum of
//! this node's pushes not yet shipped home — under the same latch, so that a refresh can
//! rebuild the replica as "home value + what is still unshipped" without losing a push.
//!
//! Replicas are numbered by *ordinal*: this node's replicas sorted by (home node, key). The
//! replicas homed at node `h` are a contiguous range of ordinals, and on `h` those keys occupy
//! its table's first slots in key order (the store allocates them first), so a refresh reads
//! them as a few contiguous runs of slots.

use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::config::TableSpec;
use crate::partition::Partitioner;

/// Marker of a key that is not replicated.
const NOT_REPLICATED: u32 = u32::MAX;
/// Marker of a replicated key whose home is this node.
const HOME_HERE: u32 = u32::MAX - 1;

/// What a node knows about one table's replicated keys.
pub struct ReplicaState {
    value_len: usize,
    /// Per key: [`NOT_REPLICATED`], [`HOME_HERE`], or the ordinal of this node's replica.
    marks: Box<[u32]>,
    /// Ordinal → key.
    keys: Box<[u64]>,
    /// Per node: the ordinals of the replicas homed there (empty for this node).
    by_home: Box<[Range<u32>]>,
    /// Replicated keys homed here, in key order (they occupy this table's first slots).
    home_keys: Box<[u64]>,
    /// Unshipped pushes: `value_len` floats per ordinal (f32 bits). Changed under the key's
    /// latch only.
    deltas: Box<[AtomicU32]>,
    /// One bit per ordinal: the delta may be non-zero.
    dirty: Box<[AtomicU64]>,
}

impl ReplicaState {
    /// The replicas of `spec` on node `rank` of `nodes`; `None` when the table replicates
    /// nothing.
    pub fn new(spec: &TableSpec, rank: usize, nodes: usize) -> Option<ReplicaState> {
        if spec.replicated.is_empty() {
            return None;
        }
        let partitioner = Partitioner::of(spec, nodes);
        let mut marks = vec![NOT_REPLICATED; spec.keys as usize].into_boxed_slice();
        let mut per_home: Vec<Vec<u64>> = vec![Vec::new(); nodes];
        for range in &spec.replicated {
            for key in range.clone() {
                per_home[partitioner.home(key)].push(key);
            }
        }
        let home_keys = std::mem::take(&mut per_home[rank]).into_boxed_slice();
        for &key in home_keys.iter() {
            marks[key as usize] = HOME_HERE;
        }
        let mut keys = Vec::new();
        let mut by_home = Vec::with_capacity(nodes);
        for list in &per_home {
            let start = keys.len() as u32;
            for &key in list {
                marks[key as usize] = keys.len() as u32;
                keys.push(key);
            }
            by_home.push(start..keys.len() as u32);
        }
        let deltas = (0..keys.len() * spec.value_len).map(|_| AtomicU32::new(0)).collect();
        let dirty = (0..keys.len().div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        Some(ReplicaState { value_len: spec.value_len, marks, keys: keys.into_boxed_slice(), by_home: by_home.into_boxed_slice(), home_keys, deltas, dirty })
    }

    /// The ordinal of `key` when this node holds a replica of it (not its home).
    #[inline]
    pub fn ordinal(&self, key: u64) -> Option<u32> {
        let mark = *self.marks.get(key as usize)?;
        (mark < HOME_HERE).then_some(mark)
    }

    /// Whether `key` is replicated (here as a replica or as its home).
    #[inline]
    pub fn is_replicated(&self, key: u64) -> bool {
        self.marks.get(key as usize).is_some_and(|&m| m != NOT_REPLICATED)
    }

    /// Number of replicas on this node (replicated keys homed elsewhere).
    pub fn replicas(&self) -> usize {
        self.keys.len()
    }

    /// The key of replica `ordinal`.
    pub fn key(&self, ordinal: u32) -> u64 {
        self.keys[ordinal as usize]
    }

    /// The ordinals of the replicas homed at `node`.
    pub fn homed_at(&self, node: usize) -> Range<u32> {
        self.by_home.get(node).cloned().unwrap_or(0..0)
    }

    /// Replicated keys homed at this node, in key order.
    pub fn home_keys(&self) -> &[u64] {
        &self.home_keys
    }

    /// The position of `key` among the replicated keys homed at this node (its slot there).
    pub fn home_position(&self, key: u64) -> Option<usize> {
        self.home_keys.binary_search(&key).ok()
    }

    fn delta(&self, ordinal: u32) -> &[AtomicU32] {
        let at = ordinal as usize * self.value_len;
        &self.deltas[at..at + self.value_len]
    }

    /// Adds a push to replica `ordinal`'s delta. The caller holds the key's latch.
    #[inline]
    pub fn add_delta(&self, ordinal: u32, update: &[f32]) {
        for (d, u) in self.delta(ordinal).iter().zip(update) {
            d.store((f32::from_bits(d.load(Ordering::Relaxed)) + u).to_bits(), Ordering::Relaxed);
        }
        let word = &self.dirty[ordinal as usize / 64];
        let bit = 1u64 << (ordinal % 64);
        if word.load(Ordering::Relaxed) & bit == 0 {
            word.fetch_or(bit, Ordering::Relaxed);
        }
    }

    /// Replicas in `range` whose delta may be non-zero (their dirty bits are left set; a
    /// replica is clean again once [`ReplicaState::take_delta`] took its delta).
    pub fn dirty_in(&self, range: Range<u32>) -> Vec<u32> {
        let mut out = Vec::new();
        let mut word = range.start / 64;
        while word * 64 < range.end {
            let mut bits = self.dirty[word as usize].load(Ordering::Relaxed);
            while bits != 0 {
                let o = word * 64 + bits.trailing_zeros();
                bits &= bits - 1;
                if range.contains(&o) {
                    out.push(o);
                }
            }
            word += 1;
        }
        out
    }

    /// Appends replica `ordinal`'s delta to `out` as little-endian bytes and zeroes it. The
    /// caller holds the key's latch. Returns whether the delta was non-zero.
    pub fn take_delta(&self, ordinal: u32, out: &mut Vec<u8>) -> bool {
        self.dirty[ordinal as usize / 64].fetch_and(!(1u64 << (ordinal % 64)), Ordering::Relaxed);
        let mut any = false;
        for d in self.delta(ordinal) {
            let bits = d.swap(0, Ordering::Relaxed);
            any |= bits & 0x7FFF_FFFF != 0;
            out.extend_from_slice(&bits.to_le_bytes());
        }
        any
    }

    /// Replica `ordinal`'s current delta, added to `value` (the caller holds the key's latch).
    pub fn add_current_delta(&self, ordinal: u32, value: &mut [f32]) {
        for (v, d) in value.iter_mut().zip(self.delta(ordinal)) {
            *v += f32::from_bits(d.load(Ordering::Relaxed));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Partitioning;

    #[test]
    fn ordinals_follow_home_then_key_order() {
        let spec = TableSpec::new("t", 100, 2).partitioned(Partitioning::Range).replicating([0..3, 50..52, 97..100]);
        let r = ReplicaState::new(&spec, 0, 2).unwrap();
        assert_eq!(r.home_keys(), &[0, 1, 2]);
        assert_eq!(r.homed_at(1), 0..5);
        assert_eq!((0..5).map(|o| r.key(o)).collect::<Vec<_>>(), vec![50, 51, 97, 98, 99]);
        assert_eq!(r.ordinal(51), Some(1));
        assert_eq!(r.ordinal(1), None, "home keys have no replica ordinal");
        assert!(r.is_replicated(1) && !r.is_replicated(10));
        assert_eq!(r.home_position(2), Some(2));
    }

    #[test]
    fn deltas_accumulate_and_drain() {
        let spec = TableSpec::new("t", 200, 2).replicating(std::iter::once(100..200));
        let r = ReplicaState::new(&spec, 0, 2).unwrap();
        let o = r.ordinal(170).unwrap();
        assert!(r.dirty_in(r.homed_at(1)).is_empty());
        r.add_delta(o, &[1.0, 2.0]);
        r.add_delta(o, &[0.5, 0.0]);
        assert_eq!(r.dirty_in(r.homed_at(1)), vec![o]);
        let mut v = [10.0, 10.0];
        r.add_current_delta(o, &mut v);
        assert_eq!(v, [11.5, 12.0]);
        let mut out = Vec::new();
        assert!(r.take_delta(o, &mut out));
        assert_eq!(out, [1.5f32.to_le_bytes(), 2.0f32.to_le_bytes()].concat());
        assert!(r.dirty_in(r.homed_at(1)).is_empty());
        out.clear();
        assert!(!r.take_delta(o, &mut out), "a taken delta is zero");
    }
}
