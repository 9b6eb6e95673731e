//! Algorithm 1, the data partition: the node with the fewest non-zeros so far takes, among
//! `candidates` unassigned examples drawn at random, the one of least marginal cost, until
//! every example has a node. Balancing non-zeros rather than examples balances the trainers'
//! work.
//!
//! The paper's marginal cost is the growth of the node's key set, `f(D_i ∪ {d}, P) − f(D_i, P)`.
//! Only part of that growth is traffic: a key no other node touches can be homed where it is
//! used. So the cost here is the number of the example's keys that the node does not touch yet
//! *and* another node does (each becomes shared), then, between equals, the growth of the key
//! set; both per key of the example, so that long examples are not shunned. Without the first
//! criterion the second node's first pick ignores what the first took, and clusters that could
//! stay apart are split.

use super::{Incidence, Options};

/// A node's keys so far, as a bitset.
struct Touched {
    words: Vec<u64>,
}

impl Touched {
    fn new(keys: u64) -> Touched {
        Touched { words: vec![0; keys.div_ceil(64) as usize] }
    }

    #[inline]
    fn has(&self, key: u32) -> bool {
        self.words[(key >> 6) as usize] & (1 << (key & 63)) != 0
    }

    fn add(&mut self, keys: &[u32]) {
        for &k in keys {
            self.words[(k >> 6) as usize] |= 1 << (k & 63);
        }
    }
}

/// The cost of giving a node an example: keys that become shared less keys the node already
/// has, keys new to the node, and the example's length.
#[derive(Clone, Copy)]
struct Cost {
    shared: i64,
    fresh: i64,
    len: i64,
}

impl Cost {
    fn of(row: &[u32], mine: &Touched, anyone: &Touched) -> Cost {
        let (mut shared, mut fresh) = (0, 0);
        for &k in row {
            if mine.has(k) {
                shared -= 1;
            } else {
                fresh += 1;
                shared += i64::from(anyone.has(k));
            }
        }
        Cost { shared, fresh, len: row.len() as i64 }
    }

    /// Whether `self` is cheaper per key than `other` (at equal shares, the longer example).
    fn below(&self, other: &Cost) -> bool {
        let (a, b) = (self.shared * other.len.max(1), other.shared * self.len.max(1));
        let (c, d) = (self.fresh * other.len.max(1), other.fresh * self.len.max(1));
        (a, c, other.len) < (b, d, self.len)
    }
}

/// The node of every example of `graph`.
pub(super) fn partition(graph: &Incidence, options: &Options) -> Vec<u16> {
    let nodes = options.nodes;
    let mut assigned = vec![0u16; graph.examples()];
    if nodes == 1 {
        return assigned;
    }
    let mut touched: Vec<Touched> = (0..nodes).map(|_| Touched::new(graph.keys())).collect();
    let mut anyone = Touched::new(graph.keys());
    let mut load = vec![0u64; nodes];
    let mut unassigned: Vec<u32> = (0..graph.examples() as u32).collect();
    let mut draw = options.seed;
    while !unassigned.is_empty() {
        let node = (0..nodes).min_by_key(|&n| (load[n], n)).unwrap_or(0);
        // The best candidate so far: its place in `unassigned`, and its cost.
        let mut best: Option<(usize, Cost)> = None;
        for _ in 0..options.candidates.min(unassigned.len()) {
            draw = crate::hashing::mix(draw);
            let at = ((draw as u128 * unassigned.len() as u128) >> 64) as usize;
            let cost = Cost::of(graph.row(unassigned[at] as usize), &touched[node], &anyone);
            if best.is_none_or(|(_, b)| cost.below(&b)) {
                best = Some((at, cost));
            }
        }
        let Some((at, cost)) = best else { break };
        let example = unassigned.swap_remove(at) as usize;
        touched[node].add(graph.row(example));
        anyone.add(graph.row(example));
        load[node] += cost.len.max(1) as u64;
        assigned[example] = node as u16;
    }
    assigned
}
