//! `ferry partition`: co-partitions a sparse data set's examples and weights for `train lr
//! --plan` ([`ferry::copartition`]), and reports the busiest node's traffic against the default
//! placements and the lower bound.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Parser};
use ferry::Partitioning;
use ferry::copartition::{self, Incidence, Options, Traffic};
use ferry::testing::partition::Partitioner;

use super::arrivals::{part_end, place_arrived};
use super::lr::LrArgs;

/// Options of `ferry partition`.
#[derive(Debug, Clone, Args)]
pub struct PartitionArgs {
    /// Data, as `train lr --data` takes it: `agaricus`, `criteo-small`, `spam`, `synth-lr`, a
    /// LIBSVM/libffm file or a directory with `train.libsvm` and `test.libsvm`.
    pub data: String,
    /// Nodes to partition for.
    #[arg(long, short = 'n')]
    pub nodes: usize,
    /// Where to write the plan.
    #[arg(long, short = 'o')]
    pub out: PathBuf,
    /// Examples per mini-batch of the training (`train lr --batch`): an access is a batch's.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Unassigned examples a node chooses its next one from (Algorithm 1's sample).
    #[arg(long, default_value_t = 16)]
    pub candidates: usize,
    /// Only the paper's Algorithms 1 and 2, without the refinement rounds that move examples to
    /// where their keys are homed.
    #[arg(long)]
    pub no_refine: bool,
    /// As `train lr --train` (with --test).
    #[arg(long, requires = "test")]
    pub train: Option<PathBuf>,
    /// As `train lr --test` (with --train).
    #[arg(long, requires = "train")]
    pub test: Option<PathBuf>,
    /// As `train lr --hash-bits`.
    #[arg(long)]
    pub hash_bits: Option<u32>,
    /// As `train lr --hash-buckets`.
    #[arg(long)]
    pub hash_buckets: Option<u64>,
    /// As `train lr --hash-signed`.
    #[arg(long, requires = "hash_buckets")]
    pub hash_signed: bool,
    /// As `train lr --seed` (the split and the hashing depend on it).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also simulate examples arriving in this many parts (Duan and Wu, Section 5): the plan is
    /// made from the first part, and the busiest node's traffic after each arrival is printed
    /// with the new examples dealt round robin and the keys kept where they were; with the new
    /// examples placed where their keys are held; then with keys reallocated by Algorithm 4
    /// (moves made while they gain more than --move-cost); and with a plan made from scratch.
    /// The plan written is the full data's, as without this option.
    #[arg(long, default_value_t = 1)]
    pub arrivals: usize,
    /// What a relocation costs in remote accesses per epoch of the placement it makes (a value
    /// sent once is about two accesses' bytes; spread over the epochs trained until the next
    /// arrival).
    #[arg(long, default_value_t = 2.0)]
    pub move_cost: f64,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Parser)]
struct LrOnly {
    #[command(flatten)]
    lr: LrArgs,
}

impl PartitionArgs {
    /// The `train lr` options that load the same examples.
    fn lr(&self) -> Result<LrArgs> {
        let mut args = vec!["lr".to_string(), "--data".into(), self.data.clone(), "--seed".into(), self.seed.to_string()];
        args.extend(super::lr::loader_args(&self.train, &self.test, self.hash_bits, self.hash_buckets, self.hash_signed));
        Ok(LrOnly::try_parse_from(args)?.lr)
    }
}

/// Makes the plan, writes it and prints the report.
pub fn run(args: &PartitionArgs) -> Result<()> {
    let lr = args.lr()?;
    super::Task::prepare(&lr)?;
    let split = lr.load()?;
    let graph = split.incidence()?;
    let options = Options { nodes: args.nodes, batch: args.batch, candidates: args.candidates, seed: args.seed, refine: !args.no_refine };
    let started = Instant::now();
    let plan = copartition::copartition(&graph, &options)?;
    let seconds = started.elapsed().as_secs_f64();
    plan.write(&args.out)?;
    let report = Report::new(&graph, &plan, args, seconds)?;
    let arrivals = if args.arrivals > 1 { arrivals(&split, &options, args)? } else { Vec::new() };
    if args.json {
        let mut json = report.json();
        json["arrivals"] = serde_json::to_value(&arrivals)?;
        println!("{}", serde_json::to_string(&json)?);
    } else {
        report.print(&args.out);
        print_arrivals(&arrivals);
    }
    Ok(())
}

/// The busiest node's traffic after one arrival of examples, per way of placing the keys.
#[derive(Debug, serde::Serialize)]
struct Arrival {
    /// Examples so far.
    examples: usize,
    /// New examples dealt round robin, keys where the first part's plan put them.
    kept: f64,
    /// New examples placed where their keys are held (`place_examples`), keys kept.
    placed: f64,
    /// Then keys moved by Algorithm 4 from the previous arrival's placement.
    reallocated: f64,
    /// Keys Algorithm 4 moved at this arrival.
    moves: usize,
    /// A plan made from scratch for the examples so far (examples moved too).
    repartitioned: f64,
    /// Keys whose place that plan changes against the reallocated placement.
    repartition_moves: usize,
    /// Examples dealt round robin with hashed homes.
    hash: f64,
}

/// Simulates `args.arrivals` arrivals of the training examples (see `--arrivals`).
fn arrivals(split: &super::lr::Split, options: &Options, args: &PartitionArgs) -> Result<Vec<Arrival>> {
    let (n, parts, nodes) = (split.train.len(), args.arrivals, args.nodes);
    let end = |i: usize| part_end(n, parts, i);
    let first = copartition::copartition(&split.incidence_of(0..end(0))?, options)?;
    let kept_owners: Vec<u16> = first.placement.homes().to_vec();
    let mut owners = kept_owners.clone();
    let mut examples = first.examples.clone();
    // Without placing or reallocating: every later example dealt round robin.
    let kept_examples: Vec<u16> = first.examples.iter().copied().chain((first.examples.len()..n).map(|e| (e % nodes) as u16)).collect();
    let hash_homes = homes(split.dims + 1, nodes, Partitioning::Hash);
    let mut out = Vec::new();
    for i in 1..parts {
        let graph = split.incidence_of(0..end(i))?;
        let kept = copartition::traffic(&graph, nodes, args.batch, &kept_examples[..end(i)], &kept_owners)?.bottleneck;
        place_arrived(&graph, &mut examples, &owners, options)?;
        let placed = copartition::traffic(&graph, nodes, args.batch, &examples, &owners)?.bottleneck;
        let r = copartition::reallocate(&graph, &examples, &owners, nodes, args.batch, args.move_cost)?;
        r.apply(&mut owners);
        let fresh = copartition::copartition(&graph, options)?;
        let dealt = copartition::dealt_examples(&graph, nodes);
        out.push(Arrival {
            examples: graph.examples(),
            kept,
            placed,
            reallocated: r.after.bottleneck,
            moves: r.moves.len(),
            repartitioned: copartition::traffic(&graph, nodes, args.batch, &fresh.examples, fresh.placement.homes())?.bottleneck,
            repartition_moves: fresh.placement.homes().iter().zip(&owners).filter(|(a, b)| a != b).count(),
            hash: copartition::traffic(&graph, nodes, args.batch, &dealt, &hash_homes)?.bottleneck,
        });
    }
    Ok(out)
}

/// Every key's home under `kind`.
fn homes(keys: u64, nodes: usize, kind: Partitioning) -> Vec<u16> {
    let p = Partitioner::new(keys, nodes, kind);
    (0..keys).map(|k| p.home(k) as u16).collect()
}

fn print_arrivals(arrivals: &[Arrival]) {
    if arrivals.is_empty() {
        return;
    }
    println!("examples arriving in {} parts: the busiest node's remote accesses per epoch after each", arrivals.len() + 1);
    println!(
        "  {:>9} {:>12} {:>12} {:>12} {:>7} {:>14} {:>8} {:>12}",
        "examples", "dealt, kept", "placed", "reallocated", "moves", "repartitioned", "moves", "hash"
    );
    for a in arrivals {
        println!(
            "  {:>9} {:>12.0} {:>12.0} {:>12.0} {:>7} {:>14.0} {:>8} {:>12.0}",
            a.examples, a.kept, a.placed, a.reallocated, a.moves, a.repartitioned, a.repartition_moves, a.hash
        );
    }
}

/// What a plan achieves, against what `train lr` does without one.
struct Report {
    examples: usize,
    keys: u64,
    nonzeros: usize,
    seconds: f64,
    plan: Traffic,
    hash: Traffic,
    range: Traffic,
}

impl Report {
    fn new(graph: &Incidence, plan: &copartition::Plan, args: &PartitionArgs, seconds: f64) -> Result<Report> {
        let dealt = copartition::dealt_examples(graph, args.nodes);
        let homes = |kind| homes(graph.keys(), args.nodes, kind);
        let traffic = |examples: &[u16], homes: &[u16]| copartition::traffic(graph, args.nodes, args.batch, examples, homes).context("measuring a placement");
        Ok(Report {
            examples: graph.examples(),
            keys: graph.keys(),
            nonzeros: graph.nonzeros(),
            seconds,
            plan: traffic(&plan.examples, plan.placement.homes())?,
            hash: traffic(&dealt, &homes(Partitioning::Hash))?,
            range: traffic(&dealt, &homes(Partitioning::Range))?,
        })
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "examples": self.examples,
            "keys": self.keys,
            "nonzeros": self.nonzeros,
            "seconds": self.seconds,
            "bottleneck": self.plan.bottleneck,
            "lower_bound": self.plan.lower_bound,
            "per_node": self.plan.per_node,
            "hash_bottleneck": self.hash.bottleneck,
            "range_bottleneck": self.range.bottleneck,
            "vs_hash": self.plan.bottleneck / self.hash.bottleneck.max(1e-9),
        })
    }

    fn print(&self, out: &std::path::Path) {
        println!("plan written to {}", out.display());
        println!("{} examples, {} keys, {} non-zeros, partitioned in {:.3} s", self.examples, self.keys, self.nonzeros, self.seconds);
        println!("busiest node's remote accesses per epoch (made and served, a batch's each):");
        println!("  {:<42} {:>14.0}", "co-partitioned (this plan)", self.plan.bottleneck);
        println!("  {:<42} {:>14.0}", "lower bound for the plan's data partition", self.plan.lower_bound);
        println!(
            "  {:<42} {:>14.0}  ({:.2}x the plan)",
            "examples dealt round robin, hash homes",
            self.hash.bottleneck,
            self.hash.bottleneck / self.plan.bottleneck.max(1e-9)
        );
        println!(
            "  {:<42} {:>14.0}  ({:.2}x the plan)",
            "examples dealt round robin, range homes",
            self.range.bottleneck,
            self.range.bottleneck / self.plan.bottleneck.max(1e-9)
        );
        println!("  per node (plan): {:?}", self.plan.per_node.iter().map(|t| t.round() as u64).collect::<Vec<_>>());
    }
}
