//! Data–parameter co-partitioning (Duan and Wu, *Accelerating Distributed Machine Learning with
//! Model Compression and Graph Partition*, JPDC 2023, Sections 3.3–3.4 and 4.2).
//!
//! For a sparse model whose examples each touch a known set of keys (a linear model's features),
//! where examples are trained decides which keys each node needs, and where keys live decides
//! which of those accesses cross the network. [`copartition`] chooses both: a data partition
//! (Algorithm 1: each node in turn, the least loaded first, takes the example among a few sampled
//! ones that makes the fewest keys shared with other nodes, see `data`) and then a parameter
//! partition (Algorithm 2: a key goes to the node that accesses it more than all others
//! together, and the node of lowest traffic so far takes, of the rest, the key that raises its
//! traffic least, see `keys`), minimising the traffic of the busiest node (the objective of
//! Section 3.4). The result is a
//! [`Plan`]: the node of every example, which the trainer gives its workers, and a
//! [`Placement`] of the keys, which [`crate::TableSpec::placed`] makes the table's homes.
//!
//! **Traffic.** A node's traffic is the remote accesses it makes plus those it serves, per epoch.
//! Unlike the paper's count of distinct keys, a key homed at `j` that nodes `u` and `v` use costs
//! `j` both their accesses (the home answers every node that pulls), and an access is a
//! mini-batch's, not an example's: with `batch` examples per mini-batch a node whose `c` of `n`
//! examples touch a key is expected to touch it in `b·(1 − (1 − c/n)^batch)` of its `b` batches.
//! [`Traffic::lower_bound`] is the least any placement of the keys can reach for the same data
//! partition (every key homed at its heaviest user, the total spread evenly).
//!
//! **Refinement** (ours): Algorithm 1 places early examples nearly blind, so examples then move
//! to the node where their keys' accesses cost least, within a balance band, and the keys are
//! placed again, while the busiest node's traffic falls ([`Options::refine`]).
//!
//! **Dynamic reallocation** (Section 5, Algorithm 4): when the examples change, [`reallocate`]
//! moves keys from the busiest node to the least busy one while a move gains more than it costs;
//! the moves are relocations.
//!
//! **Cost.** Algorithm 1 costs `candidates` bit tests per non-zero and a bitset of the keys per
//! node; Algorithm 2 a counting sort of the non-zeros by key and a sort of each node's keys, so
//! about `O(nnz · (candidates + log nnz))` in all (the paper's literal Algorithm 2 is
//! `O(n·m²)`; a key's cost to a node does not depend on the node's other keys, so each node's
//! candidates are sorted once); refinement `O(nnz · nodes)` a round.

mod data;
mod file;
mod keys;
mod realloc;
mod refine;

pub use realloc::{Move, Reallocation, reallocate};

use crate::error::{Error, Result};
use crate::placement::Placement;

/// Which keys each example touches: the data–parameter bipartite graph of Section 3.3.
#[derive(Debug, Clone)]
pub struct Incidence {
    keys: u64,
    /// Example `i` touches `features[offsets[i]..offsets[i + 1]]` (sorted, distinct).
    offsets: Vec<usize>,
    features: Vec<u32>,
}

impl Incidence {
    /// An empty graph over keys `0..keys` (1..=[`Placement::MAX_KEYS`]).
    pub fn new(keys: u64) -> Result<Incidence> {
        if keys == 0 || keys > Placement::MAX_KEYS {
            return Err(Error::Config(format!("co-partitioning takes 1..={} keys, not {keys}", Placement::MAX_KEYS)));
        }
        Ok(Incidence { keys, offsets: vec![0], features: Vec::new() })
    }

    /// Adds the next example, which touches `keys` (repeats count once). Fails on a key
    /// outside the graph's.
    pub fn push_example(&mut self, keys: impl IntoIterator<Item = u64>) -> Result<()> {
        let start = self.features.len();
        for key in keys {
            if key >= self.keys {
                self.features.truncate(start);
                return Err(Error::Config(format!("example {} touches key {key}, but the graph has keys 0..{}", self.examples(), self.keys)));
            }
            self.features.push(key as u32);
        }
        let row = &mut self.features[start..];
        row.sort_unstable();
        let mut kept = 0;
        for i in 0..row.len() {
            if i == 0 || row[i] != row[kept - 1] {
                row[kept] = row[i];
                kept += 1;
            }
        }
        self.features.truncate(start + kept);
        self.offsets.push(self.features.len());
        Ok(())
    }

    /// Keys of the graph.
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// Examples added.
    pub fn examples(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Edges (an example's distinct keys, summed).
    pub fn nonzeros(&self) -> usize {
        self.features.len()
    }

    /// The keys example `i` touches.
    pub(crate) fn row(&self, i: usize) -> &[u32] {
        &self.features[self.offsets[i]..self.offsets[i + 1]]
    }

    /// A hash of the graph, which a [`Plan`] keeps so that it is not applied to other data.
    pub fn digest(&self) -> u64 {
        let mut h = crate::hashing::mix(self.keys ^ (self.examples() as u64).rotate_left(32));
        for i in 0..self.examples() {
            h = crate::hashing::mix(h ^ self.row(i).len() as u64);
            for &f in self.row(i) {
                h = crate::hashing::mix(h ^ f as u64);
            }
        }
        h
    }
}

/// How [`copartition`] works.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Nodes to partition for (1..=65535).
    pub nodes: usize,
    /// Examples per mini-batch of the trainer: an access is a batch's (see the module
    /// documentation); 1 counts every example's.
    pub batch: usize,
    /// Algorithm 1's sample: how many unassigned examples a node chooses its next one from.
    /// More find better groups, at that many bit tests per non-zero.
    pub candidates: usize,
    /// Seed of the samples.
    pub seed: u64,
    /// After Algorithms 1 and 2, move examples to where their keys are homed and place the keys
    /// again, while the busiest node's traffic falls (see `refine`; ours, not the paper's).
    pub refine: bool,
}

impl Options {
    /// Defaults for `nodes` nodes: batches of 1, 16 candidates, seed 1, refined.
    pub fn new(nodes: usize) -> Options {
        Options { nodes, batch: 1, candidates: 16, seed: 1, refine: true }
    }

    fn validate(&self) -> Result<()> {
        if self.nodes == 0 || self.nodes > u16::MAX as usize {
            return Err(Error::Config(format!("co-partitioning is for 1..={} nodes, not {}", u16::MAX, self.nodes)));
        }
        if self.batch == 0 || self.candidates == 0 || self.candidates > 4096 {
            return Err(Error::Config(format!(
                "co-partitioning needs a batch of at least 1 and 1..=4096 candidates (got {} and {})",
                self.batch, self.candidates
            )));
        }
        Ok(())
    }
}

/// Per-node traffic of a data partition and a placement, in remote key accesses per epoch
/// (made plus served; see the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct Traffic {
    /// Each node's.
    pub per_node: Vec<f64>,
    /// The largest: the objective.
    pub bottleneck: f64,
    /// All nodes' together (each access counted at both ends).
    pub total: f64,
    /// The least bottleneck any placement of the keys reaches for this data partition.
    pub lower_bound: f64,
}

/// A co-partitioning: the node of every example, and the home of every key.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Node of each example, in the graph's order.
    pub examples: Vec<u16>,
    /// Home of each key.
    pub placement: std::sync::Arc<Placement>,
    /// The trainer's batch the plan was made for ([`Options::batch`]).
    pub batch: usize,
    /// [`Incidence::digest`] of the data it was made for.
    pub data_digest: u64,
}

impl Plan {
    /// Nodes it is for.
    pub fn nodes(&self) -> usize {
        self.placement.nodes()
    }

    /// The examples assigned to `node`, in order.
    pub fn examples_of(&self, node: usize) -> impl Iterator<Item = usize> + '_ {
        self.examples.iter().enumerate().filter(move |(_, n)| **n as usize == node).map(|(i, _)| i)
    }

    /// The keys (in order) that the examples of at least two nodes touch: the ones no placement
    /// keeps local to all their users, which a trainer may replicate instead (NuPS); every
    /// other touched key is used by one node only, and the plan homes it there. Fails unless
    /// the plan was made for `graph`.
    pub fn shared_keys(&self, graph: &Incidence) -> Result<Vec<u64>> {
        Ok(shared(&self.users(graph)?))
    }

    /// Per key, how many nodes' examples touch it (0 for a key no example touches). Fails
    /// unless the plan was made for `graph`.
    pub fn users(&self, graph: &Incidence) -> Result<Vec<u16>> {
        self.check(graph, self.nodes())?;
        // The examples in node order (a counting sort), so that each node's turn marks a key
        // once however many of its examples touch it.
        let mut starts = vec![0usize; self.nodes() + 1];
        for &n in &self.examples {
            starts[n as usize + 1] += 1;
        }
        for n in 0..self.nodes() {
            starts[n + 1] += starts[n];
        }
        let mut order = vec![0usize; self.examples.len()];
        for (e, &n) in self.examples.iter().enumerate() {
            order[starts[n as usize]] = e;
            starts[n as usize] += 1;
        }
        const NONE: u16 = u16::MAX;
        let (mut last, mut users) = (vec![NONE; graph.keys() as usize], vec![0u16; graph.keys() as usize]);
        for e in order {
            let node = self.examples[e];
            for &key in graph.row(e) {
                if last[key as usize] != node {
                    last[key as usize] = node;
                    users[key as usize] += 1;
                }
            }
        }
        Ok(users)
    }

    /// Fails unless the plan was made for `graph` on `nodes` nodes, saying what differs.
    pub fn check(&self, graph: &Incidence, nodes: usize) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.nodes() != nodes {
            return bad(format!("the plan is for {} nodes, not {nodes}: make one for {nodes}", self.nodes()));
        }
        if self.examples.len() != graph.examples() || self.placement.keys() != graph.keys() {
            return bad(format!(
                "the plan places {} examples and {} keys; the data has {} and {}: it was made for other data (or other loader options)",
                self.examples.len(),
                self.placement.keys(),
                graph.examples(),
                graph.keys()
            ));
        }
        if self.data_digest != graph.digest() {
            return bad("the plan was made for other data of the same shape (its digest differs): make it again from this data".into());
        }
        Ok(())
    }
}

/// The keys (in order) that two or more nodes use, from [`Plan::users`].
pub fn shared(users: &[u16]) -> Vec<u64> {
    (0..users.len() as u64).filter(|&k| users[k as usize] >= 2).collect()
}

/// Co-partitions `graph` for `options.nodes` nodes (Algorithms 1 and 2).
pub fn copartition(graph: &Incidence, options: &Options) -> Result<Plan> {
    options.validate()?;
    let mut examples = data::partition(graph, options);
    let weights = keys::Weights::new(graph, &examples, options.nodes, options.batch);
    let mut homes = keys::partition(&weights, graph.keys(), options.nodes);
    if options.refine {
        homes = refine::refine(graph, options, &mut examples, homes);
    }
    Ok(Plan { examples, placement: std::sync::Arc::new(Placement::new(options.nodes, homes)?), batch: options.batch, data_digest: graph.digest() })
}

/// The traffic of examples trained at `examples` (a node each) with keys homed at `homes`, for
/// mini-batches of `batch` examples. Fails when the lengths do not match the graph or a node is
/// not below `nodes`.
pub fn traffic(graph: &Incidence, nodes: usize, batch: usize, examples: &[u16], homes: &[u16]) -> Result<Traffic> {
    check_partition(graph, nodes, batch, examples, homes)?;
    Ok(keys::Weights::new(graph, examples, nodes, batch).traffic(homes))
}

/// Fails unless `examples` gives every example of `graph`, and `homes` every key, a node below
/// `nodes`, and `nodes` and `batch` are valid.
fn check_partition(graph: &Incidence, nodes: usize, batch: usize, examples: &[u16], homes: &[u16]) -> Result<()> {
    Options { nodes, batch, candidates: 1, seed: 0, refine: false }.validate()?;
    if examples.len() != graph.examples() || homes.len() as u64 != graph.keys() {
        return Err(Error::Config(format!(
            "{} example nodes and {} homes for a graph of {} examples and {} keys",
            examples.len(),
            homes.len(),
            graph.examples(),
            graph.keys()
        )));
    }
    if examples.iter().chain(homes).any(|&n| n as usize >= nodes) {
        return Err(Error::Config(format!("a node outside 0..{nodes}")));
    }
    Ok(())
}

/// Examples that arrived (`examples[first_new..]`, already given a node each, e.g. dealt round
/// robin) move to the nodes where their keys are held (`owners`), within the balance band the
/// co-partitioner keeps: one refinement pass over them alone, the keys left where they are.
/// Returns how many moved. Pair it with [`reallocate`], which moves keys instead.
pub fn place_examples(graph: &Incidence, examples: &mut [u16], first_new: usize, owners: &[u16], options: &Options) -> Result<usize> {
    options.validate()?;
    check_partition(graph, options.nodes, options.batch, examples, owners)?;
    Ok(refine::move_examples(graph, options, examples, owners, first_new))
}

/// The data partition trainers use without a plan (example `i` at node `i % nodes`).
pub fn dealt_examples(graph: &Incidence, nodes: usize) -> Vec<u16> {
    (0..graph.examples()).map(|i| (i % nodes.max(1)) as u16).collect()
}

#[cfg(test)]
mod tests;
