//! Consistent hashing with virtual nodes (the parameter server, OSDI 2014, Section 4.3), over
//! the *positions* of a table's keys (the multiplicative scatter of [`super::Partitioner`]).
//!
//! Node `n`'s virtual node `v` is a point on the ring `0..positions`, at a place fixed by a
//! hash of `(n, v)` alone; a position belongs to the nearest point at or before it (wrapping
//! round). Adding node `N` only adds its points, which split arcs of the others: the positions
//! in the new arcs move to `N`, every other position stays. A node's positions are the union
//! of its arcs, numbered in ring order, which keeps the dense home indices the directory's
//! owner array needs.
//!
//! A lookup finds the arc through a bucket index (`position >> shift` gives the arc holding
//! the bucket's first position, and buckets are about as many as arcs), so it costs a shift,
//! a load and on average about one comparison, whatever the ring's size.

use std::ops::Range;

use crate::hashing::mix;

/// The ring of one table, on every node alike.
#[derive(Debug, Clone)]
pub(crate) struct Ring {
    positions: u64,
    /// Arc `i` covers `starts[i]..starts[i + 1]` (the last one up to `positions`); the first
    /// starts at 0. Adjacent arcs have different owners.
    starts: Vec<u64>,
    owners: Vec<u16>,
    /// Index, among its owner's positions, of each arc's first position.
    bases: Vec<u64>,
    /// Positions per node.
    counts: Vec<u64>,
    /// For bucket `b`: the arc holding position `b << shift`.
    buckets: Vec<u32>,
    shift: u32,
}

/// Where virtual node `v` of `node` sits on a ring of `positions` positions (the hash's bits
/// each depend on every input bit, so that points land apart even for neighbouring `(node, v)`).
fn point(node: usize, v: u32, positions: u64) -> u64 {
    let h = mix(((node as u64) << 32 | v as u64) ^ 0x6665_7272_7972_696e);
    ((h as u128 * positions as u128) >> 64) as u64
}

impl Ring {
    /// The ring of `nodes` nodes with `virtual_nodes` points each over `positions` positions
    /// (at least 1). Configuration bounds `nodes × virtual_nodes`.
    pub(crate) fn new(positions: u64, nodes: usize, virtual_nodes: u32) -> Ring {
        let positions = positions.max(1);
        let (nodes, virtual_nodes) = (nodes.max(1), virtual_nodes.max(1));
        // Points in ring order; of several at one place the highest node wins it (the others'
        // arcs are empty), so that a joining node, the highest, only ever takes positions.
        let mut points: Vec<(u64, u16)> = (0..nodes).flat_map(|n| (0..virtual_nodes).map(move |v| (point(n, v, positions), n as u16))).collect();
        points.sort_unstable();
        let wrap_owner = points.last().map_or(0, |p| p.1);
        let (mut starts, mut owners) = (Vec::new(), Vec::new());
        let mut add = |start: u64, owner: u16| {
            if owners.last() == Some(&owner) {
                return;
            }
            if starts.last() == Some(&start) {
                // The previous arc is empty: this one replaces it.
                owners.pop();
                starts.pop();
                if owners.last() == Some(&owner) {
                    return;
                }
            }
            starts.push(start);
            owners.push(owner);
        };
        add(0, wrap_owner);
        for &(start, owner) in &points {
            add(start, owner);
        }
        let mut counts = vec![0u64; nodes];
        let mut bases = Vec::with_capacity(starts.len());
        for (i, &start) in starts.iter().enumerate() {
            let end = starts.get(i + 1).copied().unwrap_or(positions);
            let owner = owners[i] as usize;
            bases.push(counts[owner]);
            counts[owner] += end - start;
        }
        // Buckets of 2^shift positions, about as many as arcs (at most twice as many).
        let arcs = starts.len() as u64;
        let shift = if positions > arcs { (positions / arcs).ilog2() } else { 0 };
        let mut buckets = Vec::with_capacity((((positions - 1) >> shift) + 1) as usize);
        let mut arc = 0usize;
        for b in 0..=((positions - 1) >> shift) {
            let first = b << shift;
            while arc + 1 < starts.len() && starts[arc + 1] <= first {
                arc += 1;
            }
            buckets.push(arc as u32);
        }
        Ring { positions, starts, owners, bases, counts, buckets, shift }
    }

    /// The arc holding `position` (below `positions`).
    #[inline]
    fn arc(&self, position: u64) -> usize {
        let mut arc = self.buckets[(position >> self.shift) as usize] as usize;
        while arc + 1 < self.starts.len() && self.starts[arc + 1] <= position {
            arc += 1;
        }
        arc
    }

    /// The node `position` belongs to.
    #[inline]
    pub(crate) fn node(&self, position: u64) -> usize {
        self.owners[self.arc(position)] as usize
    }

    /// The node `position` belongs to and its index among that node's positions.
    #[inline]
    pub(crate) fn locate(&self, position: u64) -> (usize, u64) {
        let arc = self.arc(position);
        (self.owners[arc] as usize, self.bases[arc] + position - self.starts[arc])
    }

    /// How many positions `node` has.
    pub(crate) fn count(&self, node: usize) -> u64 {
        self.counts.get(node).copied().unwrap_or(0)
    }

    /// `node`'s arcs in ring order, which is the order of its indices.
    pub(crate) fn arcs_of(&self, node: usize) -> impl Iterator<Item = Range<u64>> + '_ {
        (0..self.starts.len())
            .filter(move |&i| self.owners[i] as usize == node)
            .map(move |i| self.starts[i]..self.starts.get(i + 1).copied().unwrap_or(self.positions))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Every position has one node and index, the indices of a node are dense and in ring
    /// order, and the bucket index agrees with a scan.
    fn check(positions: u64, nodes: usize, virtual_nodes: u32) {
        let ring = Ring::new(positions, nodes, virtual_nodes);
        let mut next = vec![0u64; nodes];
        for p in 0..positions {
            let (node, index) = ring.locate(p);
            assert!(node < nodes);
            assert_eq!(ring.node(p), node);
            assert_eq!(index, next[node], "position {p}");
            next[node] += 1;
        }
        for (node, &n) in next.iter().enumerate() {
            assert_eq!(ring.count(node), n);
            assert_eq!(ring.arcs_of(node).map(|r| r.end - r.start).sum::<u64>(), n);
        }
        assert!(ring.starts.windows(2).all(|w| w[0] < w[1]) && ring.owners.windows(2).all(|w| w[0] != w[1]));
    }

    #[test]
    fn small_rings() {
        for positions in 1..60 {
            for nodes in 1..6 {
                for v in [1, 2, 5, 64] {
                    check(positions, nodes, v);
                }
            }
        }
    }

    #[test]
    fn a_joining_node_only_takes_positions() {
        let positions = 100_000;
        for nodes in 1..8 {
            let (before, after) = (Ring::new(positions, nodes, 128), Ring::new(positions, nodes + 1, 128));
            let mut moved = 0;
            for p in 0..positions {
                let (a, b) = (before.node(p), after.node(p));
                if a != b {
                    assert_eq!(b, nodes, "position {p} moved from {a} to {b}, not to the new node");
                    moved += 1;
                }
            }
            // About 1/(nodes+1) of the positions move; 128 points per node keep it within 30 %.
            let share = moved as f64 / positions as f64;
            let ideal = 1.0 / (nodes + 1) as f64;
            assert!((share - ideal).abs() < 0.3 * ideal, "{nodes} → {}: {share:.3} moved, ideally {ideal:.3}", nodes + 1);
        }
    }

    #[test]
    fn homes_are_balanced_within_the_virtual_nodes_bound() {
        let positions = 1_000_000u64;
        for nodes in [2, 4, 16] {
            let ring = Ring::new(positions, nodes, 128);
            let mean = positions as f64 / nodes as f64;
            for node in 0..nodes {
                let off = (ring.count(node) as f64 - mean).abs() / mean;
                // One standard deviation is about 1/√128 ≈ 9 %; 3.5 of them bound 16 nodes.
                assert!(off < 0.32, "node {node} of {nodes}: {} positions, mean {mean}", ring.count(node));
            }
        }
    }

    proptest! {
        #[test]
        fn every_position_has_one_dense_index(positions in 1u64..3000, nodes in 1usize..9, v in 1u32..40) {
            check(positions, nodes, v);
        }
    }
}
