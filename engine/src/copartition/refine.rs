//! Refinement of a data partition against its keys' homes (ours, not the paper's): with the
//! homes fixed, each example moves to the node where its accesses cost least, within a balance
//! band; then Algorithm 2 places the keys again. Rounds go on while the busiest node's traffic
//! falls.
//!
//! Algorithm 1 decides an example's node once, from a few random candidates and the keys each
//! node touched so far; examples placed early are placed nearly blind. Moving an example from
//! `u` to `v` saves `u` the batches in which only it touched a key homed elsewhere, and costs
//! `v` the same for its keys; with `c` of a node's `n` examples touching a key, one more adds
//! `b·((1 − c/n)^B − (1 − (c+1)/n)^B)` expected batches (`b` batches of `B`), nearly 1 for a
//! rare key and nearly 0 for a key in every batch. A node's non-zeros stay within the band
//! Algorithm 1 keeps (the longest example, or 5 % of the mean if that is wider).
//!
//! Cost: a counter per node and key (4 bytes each; refinement is skipped beyond
//! [`MAX_COUNTERS`]) and `O(nnz · nodes)` a round, for at most [`ROUNDS`] rounds and
//! [`ROUND_NODES`]` / nodes`.

use super::{Incidence, Options, keys};

/// Most node × key counters refinement allocates (1 GiB).
pub(super) const MAX_COUNTERS: u64 = 1 << 28;

/// Rounds at most.
const ROUNDS: usize = 6;

/// A round costs `O(nnz · nodes)`: rounds × nodes stays within this, so that many nodes get
/// fewer rounds (16 nodes two) and the whole stays about linear in the non-zeros.
const ROUND_NODES: usize = 32;

/// A round that lowers the busiest node's traffic by less than this share is the last.
const MIN_GAIN: f64 = 0.002;

/// How far a node's non-zeros may stray from the mean: the longest example's, or 5 % of the
/// mean if that is more.
pub(super) fn balance_slack(graph: &Incidence, nodes: usize) -> f64 {
    let longest = (0..graph.examples()).map(|e| graph.row(e).len().max(1)).max().unwrap_or(0) as f64;
    let mean = total_load(graph) as f64 / nodes.max(1) as f64;
    longest.max(0.05 * mean)
}

fn total_load(graph: &Incidence) -> u64 {
    (0..graph.examples()).map(|e| graph.row(e).len().max(1) as u64).sum()
}

/// Refines `examples` (and returns the homes for the result).
pub(super) fn refine(graph: &Incidence, options: &Options, examples: &mut [u16], mut homes: Vec<u16>) -> Vec<u16> {
    let nodes = options.nodes;
    if nodes < 2 || (nodes as u64).saturating_mul(graph.keys()) > MAX_COUNTERS {
        return homes;
    }
    let mut best = keys::Weights::new(graph, examples, nodes, options.batch).traffic(&homes).bottleneck;
    for _ in 0..ROUNDS.min(ROUND_NODES / nodes).max(1) {
        let before: Vec<u16> = examples.to_vec();
        if move_examples(graph, options, examples, &homes, 0) == 0 {
            break;
        }
        let weights = keys::Weights::new(graph, examples, nodes, options.batch);
        let placed = keys::partition(&weights, graph.keys(), nodes);
        let bottleneck = weights.traffic(&placed).bottleneck;
        if bottleneck >= best {
            examples.copy_from_slice(&before);
            break;
        }
        let small = bottleneck > best * (1.0 - MIN_GAIN);
        best = bottleneck;
        homes = placed;
        if small {
            break;
        }
    }
    homes
}

/// One pass over the examples from `first` on: each moves to the node where its keys' accesses
/// cost least with the keys held at `homes`, within the balance band. Returns how many moved
/// (none when the counters would take more than [`MAX_COUNTERS`]).
pub(super) fn move_examples(graph: &Incidence, options: &Options, examples: &mut [u16], homes: &[u16], first: usize) -> usize {
    let (nodes, m) = (options.nodes, graph.keys() as usize);
    if nodes < 2 || (nodes as u64).saturating_mul(m as u64) > MAX_COUNTERS {
        return 0;
    }
    let mean = total_load(graph) as f64 / nodes as f64;
    let slack = balance_slack(graph, nodes);
    let (low, high) = (mean - slack, mean + slack);
    // Key-major counters: a key's counts on every node share a cache line or two.
    let mut count = vec![0u32; nodes * m];
    let mut size = vec![0u64; nodes];
    let mut load = vec![0f64; nodes];
    for (e, &u) in examples.iter().enumerate() {
        size[u as usize] += 1;
        load[u as usize] += graph.row(e).len().max(1) as f64;
        for &p in graph.row(e) {
            count[p as usize * nodes + u as usize] += 1;
        }
    }
    // The marginal batches of one example more (at c) per node, tabled by c.
    let tables: Vec<Vec<f64>> = (0..nodes)
        .map(|u| {
            let n = size[u].max(1);
            (0..=n + 1).map(|c| keys::batches_touching(c + 1, n, options.batch) - keys::batches_touching(c, n, options.batch)).collect()
        })
        .collect();
    let marginal = |u: usize, c: u32| tables[u].get(c as usize).copied().unwrap_or(0.0);
    let mut moved = 0usize;
    // Per node: what the example's keys would cost it (for its own node: what they cost now).
    let mut cost = vec![0f64; nodes];
    for (e, node) in examples.iter_mut().enumerate().skip(first) {
        let row = graph.row(e);
        let u = *node as usize;
        let len = row.len().max(1) as f64;
        if load[u] - len < low {
            continue;
        }
        cost.fill(0.0);
        for &p in row {
            let (home, counts) = (homes[p as usize] as usize, &count[p as usize * nodes..(p as usize + 1) * nodes]);
            for (v, (&c, total)) in counts.iter().zip(cost.iter_mut()).enumerate() {
                if v != home {
                    // Its own node's count includes the example: the step that added it.
                    *total += marginal(v, if v == u { c - 1 } else { c });
                }
            }
        }
        let saved = cost[u];
        let choice = (0..nodes).filter(|&v| v != u && load[v] + len <= high && cost[v] < saved - 1e-9).min_by(|&a, &b| cost[a].total_cmp(&cost[b]));
        if let Some(v) = choice {
            for &p in row {
                count[p as usize * nodes + u] -= 1;
                count[p as usize * nodes + v] += 1;
            }
            load[u] -= len;
            load[v] += len;
            *node = v as u16;
            moved += 1;
        }
    }
    moved
}
