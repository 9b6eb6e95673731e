//! Dynamic reallocation (Section 5, Algorithm 4): when the examples change — new ones arrive,
//! or the accesses drift — keys move from the busiest node to the least busy one while a move
//! lowers the busiest node's traffic by more than it costs.
//!
//! Each step takes the node of most traffic `a` and of least `b`; moving key `p` from `a` to
//! `b` changes only their traffic: `a` stops serving `W(p) − w_a(p)` and fetches its own
//! `w_a(p)`, `b` the reverse. The gain is the busiest traffic before less the busiest after
//! (line 5); below a move's cost the loop ends (lines 6–9). Line 4 chooses the key that leaves
//! the two closest, `argmin |f(P_a ∖ p) − f(P_b ∪ p)|`; taken alone that picks a key only `a`
//! uses (both rise by its accesses: no gap, and a loss), which line 6 rejects, ending the loop
//! at once. So the key chosen here is the one that leaves the larger of the two lowest, and
//! between equals the two closest. The paper estimates DNN accesses
//! from similar past examples (Algorithm 3); for a sparse linear model the accesses are known
//! exactly, so the weights are the examples' own (see [`super::traffic`]).
//!
//! The moves are relocations: the node a key moves to `localize`s it (its home does not change,
//! so location caches and forwarding find it).

use super::{Incidence, Traffic, keys::Weights};
use crate::error::{Error, Result};

/// One key's move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    /// The key.
    pub key: u64,
    /// Where it was.
    pub from: u16,
    /// Where it goes (the node that localizes it).
    pub to: u16,
}

/// What [`reallocate`] decided.
#[derive(Debug, Clone)]
pub struct Reallocation {
    /// The moves, in the order chosen.
    pub moves: Vec<Move>,
    /// The traffic with the keys where they were.
    pub before: Traffic,
    /// The traffic after the moves.
    pub after: Traffic,
}

impl Reallocation {
    /// Applies the moves to `owners` (the holders [`reallocate`] started from).
    pub fn apply(&self, owners: &mut [u16]) {
        for m in &self.moves {
            owners[m.key as usize] = m.to;
        }
    }

    /// The keys that move to `node`: what it `localize`s to apply the moves.
    pub fn keys_to(&self, node: usize) -> Vec<u64> {
        self.moves.iter().filter(|m| m.to as usize == node).map(|m| m.key).collect()
    }
}

/// Algorithm 4: which keys of `graph` (trained at `examples`, a node each, in mini-batches of
/// `batch`) move from where they are (`owners`, a node per key) so that the busiest node's
/// traffic falls, each move made only while it gains more than `move_cost` (in remote accesses
/// per epoch: what a relocation costs, spread over the epochs the new placement will serve).
pub fn reallocate(graph: &Incidence, examples: &[u16], owners: &[u16], nodes: usize, batch: usize, move_cost: f64) -> Result<Reallocation> {
    super::check_partition(graph, nodes, batch, examples, owners)?;
    if !move_cost.is_finite() || move_cost < 0.0 {
        return Err(Error::Config(format!("a move's cost must be a number of at least 0, not {move_cost}")));
    }
    let weights = Weights::new(graph, examples, nodes, batch);
    let before = weights.traffic(owners);
    let mut owners = owners.to_vec();
    let mut load = before.per_node.clone();
    // The keys each node holds that somebody accesses (the others cannot lower any traffic).
    let mut held: Vec<Vec<u32>> = vec![Vec::new(); nodes];
    let mut all = vec![0.0f64; weights.keys()];
    for (key, total) in all.iter_mut().enumerate() {
        *total = weights.accessors(key).map(|(_, w)| w).sum();
        if *total > 0.0 {
            held[owners[key] as usize].push(key as u32);
        }
    }
    let weight_at = |key: usize, node: usize| weights.accessors(key).find(|&(n, _)| n == node).map_or(0.0, |(_, w)| w);
    let mut moves = Vec::new();
    // Each move lowers the busiest node's traffic, so no placement comes back: the loop ends.
    loop {
        // Among nodes equally busy, the one holding most keys (the one that can give some).
        let busiest = (0..nodes).max_by(|&a, &b| load[a].total_cmp(&load[b]).then(held[a].len().cmp(&held[b].len()))).unwrap_or(0);
        let Some(idlest) = (0..nodes).filter(|&n| n != busiest).min_by(|&a, &b| load[a].total_cmp(&load[b])) else { break };
        // The key whose move leaves the larger of the two nodes' traffic lowest, then the two
        // closest (line 4; see the module documentation).
        let mut best: Option<(usize, f64, f64)> = None;
        let mut best_rank = (f64::INFINITY, f64::INFINITY);
        for (at, &key) in held[busiest].iter().enumerate() {
            let key = key as usize;
            let after_busiest = load[busiest] - all[key] + 2.0 * weight_at(key, busiest);
            let after_idlest = load[idlest] + all[key] - 2.0 * weight_at(key, idlest);
            let rank = (after_busiest.max(after_idlest), (after_busiest - after_idlest).abs());
            if rank < best_rank {
                best_rank = rank;
                best = Some((at, after_busiest, after_idlest));
            }
        }
        let Some((at, after_busiest, after_idlest)) = best else { break };
        // The gain in the busiest node's traffic (line 5), against the move's cost (line 6).
        let others = (0..nodes).filter(|&n| n != busiest && n != idlest).map(|n| load[n]).fold(0.0, f64::max);
        let gain = load[busiest] - after_busiest.max(after_idlest).max(others);
        if gain <= move_cost {
            break;
        }
        let key = held[busiest].swap_remove(at);
        held[idlest].push(key);
        owners[key as usize] = idlest as u16;
        load[busiest] = after_busiest;
        load[idlest] = after_idlest;
        moves.push(Move { key: key as u64, from: busiest as u16, to: idlest as u16 });
    }
    let after = weights.traffic(&owners);
    Ok(Reallocation { moves, before, after })
}
