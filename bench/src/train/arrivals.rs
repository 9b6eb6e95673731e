//! `train lr --arrivals K`: the training examples arrive in `K` parts, one more at the start of
//! each epoch (epoch `e` trains on the first `min(e, K)` parts), as a stream of new data would.
//! With `--stream`, epoch `e` trains on part `e` alone: one pass over the data, each example
//! seen once, as an online learner sees a stream.
//!
//! Without `--place-arrivals` the examples so far are dealt round robin to the workers and the
//! weights stay at their hashed homes. With it (Duan and Wu, Sections 4.2 and 5), every node
//! computes the same things from the same data, so nothing but relocations crosses the network
//! for it: the co-partitioning plan of the first part (the weights table is placed by it), at
//! each arrival the new examples' nodes (`ferry::copartition::place_examples`: where their keys
//! are held), and with `--reallocate` the keys that move (`reallocate`, Algorithm 4, each move
//! gaining more than `--move-cost`), which the nodes they move to `localize` — relocations, so
//! the cluster then runs with relocation on although no worker localizes otherwise.

use anyhow::Result;
use ferry::copartition::{self, Options, Plan};

/// Where the examples that arrived so far are trained, and where their keys are held.
#[derive(Debug, Clone)]
pub struct Arrivals {
    parts: usize,
    /// All training examples.
    total: usize,
    /// `--place-arrivals`: the node of every arrived example, the holder of every key, and how
    /// the plan was made.
    placed: Option<Placed>,
    /// `--stream`: an epoch trains on the newest part only.
    stream: bool,
}

#[derive(Debug, Clone)]
struct Placed {
    examples: Vec<u16>,
    owners: Vec<u16>,
    options: Options,
    /// With `--reallocate`: a move's cost; `None` keeps the keys where they are.
    move_cost: Option<f64>,
}

impl Arrivals {
    /// Arrivals of `total` examples in `parts` parts; with `plan` (the first part's), placed, and
    /// with `move_cost` the keys reallocated.
    pub fn new(parts: usize, total: usize, plan: Option<&Plan>, options: Options, move_cost: Option<f64>) -> Arrivals {
        let placed = plan.map(|p| Placed { examples: p.examples.clone(), owners: p.placement.homes().to_vec(), options, move_cost });
        Arrivals { parts: parts.max(1), total, placed, stream: false }
    }

    /// The same arrivals, each epoch training on the newest part only when `stream`.
    pub fn streamed(self, stream: bool) -> Arrivals {
        Arrivals { stream, ..self }
    }

    /// The examples `epoch` trains on: those arrived so far, or with `--stream` the newest part.
    fn trained(&self, epoch: usize) -> std::ops::Range<usize> {
        let part = epoch.clamp(1, self.parts) - 1;
        let start = if self.stream && part > 0 { part_end(self.total, self.parts, part - 1) } else { 0 };
        start..self.arrived(epoch)
    }

    /// Examples arrived by the start of `epoch` (1-based): the first `min(epoch, parts)` parts.
    pub fn arrived(&self, epoch: usize) -> usize {
        part_end(self.total, self.parts, epoch.clamp(1, self.parts) - 1)
    }

    /// Takes the examples that arrive at the start of `epoch` in (placing them and reallocating
    /// the keys, with `--place-arrivals`); returns the keys node `rank` must localize.
    pub fn arrive(&mut self, split: &super::lr::Split, epoch: usize, rank: usize) -> Result<Vec<u64>> {
        let end = self.arrived(epoch);
        let Some(p) = self.placed.as_mut() else { return Ok(Vec::new()) };
        let first_new = p.examples.len();
        if end <= first_new {
            return Ok(Vec::new());
        }
        let graph = split.incidence_of(0..end)?;
        place_arrived(&graph, &mut p.examples, &p.owners, &p.options)?;
        let Some(move_cost) = p.move_cost else { return Ok(Vec::new()) };
        let moves = copartition::reallocate(&graph, &p.examples, &p.owners, p.options.nodes, p.options.batch, move_cost)?;
        moves.apply(&mut p.owners);
        Ok(moves.keys_to(rank))
    }

    /// The examples worker `thread` of node `rank` trains in `epoch` (after [`Arrivals::arrive`]).
    pub fn mine(&self, epoch: usize, rank: usize, thread: usize, threads: usize, nodes: usize) -> Vec<usize> {
        let trained = self.trained(epoch);
        match &self.placed {
            Some(p) => p.examples[..trained.end]
                .iter()
                .enumerate()
                .filter(|(i, n)| **n as usize == rank && trained.contains(i))
                .map(|(i, _)| i)
                .enumerate()
                .filter(|(j, _)| j % threads == thread)
                .map(|(_, i)| i)
                .collect(),
            None => trained.filter(|i| i % (nodes * threads) == rank * threads + thread).collect(),
        }
    }
}

/// Gives the examples of `graph` beyond `examples` (those that arrived) a node each: dealt round
/// robin, then moved to where their keys are held (`owners`), as `--place-arrivals` does.
pub fn place_arrived(graph: &copartition::Incidence, examples: &mut Vec<u16>, owners: &[u16], options: &Options) -> Result<()> {
    let first_new = examples.len();
    examples.extend((first_new..graph.examples()).map(|e| (e % options.nodes) as u16));
    copartition::place_examples(graph, examples, first_new, owners, options)?;
    Ok(())
}

/// End of part `i` of `total` examples cut into `parts`.
pub fn part_end(total: usize, parts: usize, i: usize) -> usize {
    total * (i + 1) / parts.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every worker's examples of an epoch, over all workers: the parts arrived so far, or with
    /// a stream the newest part alone, each example once.
    #[test]
    fn a_stream_trains_each_part_once_and_a_prefix_grows() {
        let options = Options::new(2);
        let (nodes, threads) = (2, 3);
        let all = |a: &Arrivals, epoch: usize| {
            let mut got: Vec<usize> = (0..nodes).flat_map(|rank| (0..threads).flat_map(move |thread| a.mine(epoch, rank, thread, threads, nodes))).collect();
            got.sort_unstable();
            got
        };
        let prefix = Arrivals::new(4, 103, None, options.clone(), None);
        let stream = Arrivals::new(4, 103, None, options, None).streamed(true);
        assert_eq!(all(&prefix, 1), (0..25).collect::<Vec<_>>());
        assert_eq!(all(&stream, 1), (0..25).collect::<Vec<_>>());
        assert_eq!(all(&prefix, 3), (0..77).collect::<Vec<_>>());
        assert_eq!(all(&stream, 2), (25..51).collect::<Vec<_>>());
        assert_eq!(all(&stream, 4), (77..103).collect::<Vec<_>>());
        // Past the last part, a stream stays on it (validation keeps epochs within the parts).
        assert_eq!(all(&stream, 6), (77..103).collect::<Vec<_>>());
    }
}
