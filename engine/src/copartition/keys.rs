//! Algorithm 2, the parameter partition, and the traffic it minimises.
//!
//! With the data partitioned, node `u` accesses key `p` `w_u(p)` times an epoch (its expected
//! batches touching `p`). Homing `p` at `j` costs `j` the accesses of every other node and saves
//! it its own: `Δ_j(p) = W(p) − 2·w_j(p)`, with `W(p)` all nodes' accesses; the other nodes pay
//! the same wherever `p` lives, unless it lives with them.
//!
//! A key that one node accesses more than all others together (`Δ_j(p) < 0`) is homed there
//! first: that lowers `j`'s traffic, and every other node's is at least as low as anywhere else,
//! so no placement of that key does better for any node. The paper's greedy then places the
//! rest, the contested keys: since `Δ_j(p)` does not depend on `j`'s other keys, each node's
//! candidates are sorted by it once, and until every key has a home the node of least traffic
//! takes its cheapest unplaced candidate (Algorithm 2, lines 3–6). Taken literally over all
//! keys, that greedy lets the least busy node take a key another node accesses far more often
//! (its cost rises a little, the other's stays high), which the first pass prevents. Keys no
//! example touches are spread to even out the nodes' key counts.

use super::{Incidence, Traffic};

/// Per key, the nodes that access it and how often an epoch.
pub(super) struct Weights {
    /// Key `p`'s accessors are `nodes[offsets[p]..offsets[p + 1]]`, with `weights` beside.
    offsets: Vec<usize>,
    nodes: Vec<u16>,
    weights: Vec<f64>,
    node_count: usize,
}

/// Expected number of a node's `b = ⌈n / batch⌉` mini-batches that hold at least one of the `c`
/// (of its `n`) examples that touch a key.
pub(super) fn batches_touching(c: u64, n: u64, batch: usize) -> f64 {
    if batch <= 1 || n == 0 {
        return c as f64;
    }
    let b = n.div_ceil(batch as u64) as f64;
    let miss = 1.0 - c as f64 / n as f64;
    b * (1.0 - miss.max(0.0).powf(batch as f64))
}

impl Weights {
    /// The accesses of `graph`'s examples trained at `examples` (a node each, below `nodes`).
    pub(super) fn new(graph: &Incidence, examples: &[u16], nodes: usize, batch: usize) -> Weights {
        let keys = graph.keys() as usize;
        let mut per_node = vec![0u64; nodes];
        for &n in examples {
            per_node[n as usize] += 1;
        }
        // A counting sort of the edges by key, each carrying its example's node.
        let mut offsets = vec![0usize; keys + 1];
        for &f in &graph.features {
            offsets[f as usize + 1] += 1;
        }
        for k in 0..keys {
            offsets[k + 1] += offsets[k];
        }
        let mut fill = offsets.clone();
        let mut by_key = vec![0u16; graph.nonzeros()];
        for (e, &node) in examples.iter().enumerate() {
            for &f in graph.row(e) {
                by_key[fill[f as usize]] = node;
                fill[f as usize] += 1;
            }
        }
        drop(fill);
        // Each key's nodes, counted: (node, examples) runs become (node, weight) entries.
        let (mut out_offsets, mut out_nodes, mut out_weights) = (Vec::with_capacity(keys + 1), Vec::new(), Vec::new());
        out_offsets.push(0);
        for k in 0..keys {
            let run = &mut by_key[offsets[k]..offsets[k + 1]];
            run.sort_unstable();
            let mut i = 0;
            while i < run.len() {
                let j = i + run[i..].iter().take_while(|&&n| n == run[i]).count();
                let node = run[i] as usize;
                out_nodes.push(run[i]);
                out_weights.push(batches_touching((j - i) as u64, per_node[node], batch));
                i = j;
            }
            out_offsets.push(out_nodes.len());
        }
        Weights { offsets: out_offsets, nodes: out_nodes, weights: out_weights, node_count: nodes }
    }

    pub(super) fn accessors(&self, key: usize) -> impl Iterator<Item = (usize, f64)> + '_ {
        let r = self.offsets[key]..self.offsets[key + 1];
        self.nodes[r.clone()].iter().map(|&n| n as usize).zip(self.weights[r].iter().copied())
    }

    pub(super) fn keys(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The traffic with keys homed at `homes`.
    pub(super) fn traffic(&self, homes: &[u16]) -> Traffic {
        let mut per_node = vec![0.0f64; self.node_count];
        let mut least_total = 0.0;
        for (key, &home) in homes.iter().enumerate() {
            let (mut all, mut heaviest) = (0.0f64, 0.0f64);
            for (node, w) in self.accessors(key) {
                all += w;
                heaviest = heaviest.max(w);
                if node != home as usize {
                    per_node[node] += w;
                    per_node[home as usize] += w;
                }
            }
            least_total += 2.0 * (all - heaviest);
        }
        let total = per_node.iter().sum();
        let bottleneck = per_node.iter().copied().fold(0.0, f64::max);
        Traffic { per_node, bottleneck, total, lower_bound: least_total / self.node_count as f64 }
    }
}

/// Algorithm 2: the home of each of `keys` keys on `nodes` nodes.
pub(super) fn partition(weights: &Weights, keys: u64, nodes: usize) -> Vec<u16> {
    const NONE: u16 = u16::MAX;
    let mut homes = vec![NONE; keys as usize];
    if nodes == 1 {
        return vec![0; keys as usize];
    }
    // Every node starts fetching all it accesses. A key with a majority accessor is homed
    // there; the others are candidates of the nodes that access them, cheapest first.
    let mut cost = vec![0.0f64; nodes];
    let mut candidates: Vec<Vec<(f64, u32)>> = vec![Vec::new(); nodes];
    for (key, home) in homes.iter_mut().enumerate().take(weights.keys()) {
        let all: f64 = weights.accessors(key).map(|(_, w)| w).sum();
        for (node, w) in weights.accessors(key) {
            cost[node] += w;
        }
        match weights.accessors(key).find(|&(_, w)| 2.0 * w > all) {
            Some((node, w)) => {
                *home = node as u16;
                cost[node] += all - 2.0 * w;
            }
            None => {
                for (node, w) in weights.accessors(key) {
                    candidates[node].push((all - 2.0 * w, key as u32));
                }
            }
        }
    }
    for list in &mut candidates {
        list.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    }
    let mut next = vec![0usize; nodes];
    loop {
        // The node of least traffic that still has an unplaced candidate.
        let mut chosen: Option<usize> = None;
        for node in 0..nodes {
            let list = &candidates[node];
            while next[node] < list.len() && homes[list[next[node]].1 as usize] != NONE {
                next[node] += 1;
            }
            if next[node] < list.len() && chosen.is_none_or(|c| cost[node] < cost[c]) {
                chosen = Some(node);
            }
        }
        let Some(node) = chosen else { break };
        let (delta, key) = candidates[node][next[node]];
        homes[key as usize] = node as u16;
        cost[node] += delta;
        next[node] += 1;
    }
    // Keys nobody accesses: fill up the nodes with the fewest keys.
    let mut count = vec![0u64; nodes];
    for &h in homes.iter().filter(|&&h| h != NONE) {
        count[h as usize] += 1;
    }
    let target = keys.div_ceil(nodes as u64);
    let mut node = 0;
    for h in homes.iter_mut().filter(|h| **h == NONE) {
        while node + 1 < nodes && count[node] >= target {
            node += 1;
        }
        *h = node as u16;
        count[node] += 1;
    }
    homes
}
