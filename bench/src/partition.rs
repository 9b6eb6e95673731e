//! `ferry-bench partition`: what each partitioning costs and moves — the share of keys whose
//! home changes when a node joins (N → N+1) against the ideal 1/(N+1), how even the homes are,
//! and the local pull through a consistently hashed table, and through a feature-hashed one,
//! against the same pull through a hashed one, in one in-process 2-node cluster; and the
//! co-partitioner's run time on 10⁷ non-zeros.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ferry::testing::partition::Partitioner;
use ferry::{Config, Node, Partitioning, TableSpec};
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::report::{Better, Record, print_records, record};

/// Options of `ferry-bench partition`.
#[derive(Debug, Clone, clap::Args)]
pub struct PartitionArgs {
    /// A short run (a million keys, fewer repetitions).
    #[arg(long)]
    pub quick: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The schemes compared: the two fixed ones and consistent hashing at three ring sizes.
fn schemes() -> Vec<Partitioning> {
    let mut all = vec![Partitioning::Range, Partitioning::Hash];
    all.extend([16, Partitioning::DEFAULT_VIRTUAL_NODES, 1024].map(|virtual_nodes| Partitioning::Consistent { virtual_nodes }));
    all
}

/// The share of keys whose home differs between `nodes` and `nodes + 1` nodes, and the largest
/// home's key count over the mean after the join.
fn join_moves(keys: u64, nodes: usize, scheme: Partitioning) -> (f64, f64) {
    let (before, after) = (Partitioner::new(keys, nodes, scheme), Partitioner::new(keys, nodes + 1, scheme));
    let moved = (0..keys).filter(|&k| before.home(k) != after.home(k)).count();
    let largest = (0..=nodes).map(|n| after.home_count(n)).max().unwrap_or(0);
    (moved as f64 / keys as f64, largest as f64 * (nodes + 1) as f64 / keys as f64)
}

/// Nanoseconds per key of the directory's lookups (home and home index) over `keys` random keys.
fn lookup_ns(partitioner: &Partitioner, keys: &[u64]) -> f64 {
    let started = Instant::now();
    let mut sum = 0usize;
    for &k in keys {
        sum = sum.wrapping_add(partitioner.home(k)).wrapping_add(partitioner.home_index(k));
    }
    std::hint::black_box(sum);
    started.elapsed().as_nanos() as f64 / keys.len() as f64
}

/// Local pulls of `batch` keys homed (and so owned) at node 0, for `how_long`: keys per second.
fn local_pull_rate(node: &Node, table: &str, homed_here: &[u64], batch: usize, how_long: Duration) -> Result<f64> {
    let table = node.table(table)?;
    let mut worker = node.worker();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let (mut keys, mut out) = (vec![0u64; batch], vec![0f32; batch * table.value_len()]);
    let (started, mut pulled) = (Instant::now(), 0u64);
    while started.elapsed() < how_long {
        for _ in 0..64 {
            for k in keys.iter_mut() {
                *k = homed_here[rng.gen_range(0..homed_here.len())];
            }
            worker.pull(table, &keys, &mut out)?;
            pulled += batch as u64;
        }
    }
    Ok(pulled as f64 / started.elapsed().as_secs_f64())
}

/// Runs the benchmark and prints its records.
pub fn run(args: &PartitionArgs) -> Result<()> {
    let started = Instant::now();
    let keys: u64 = if args.quick { 1_000_000 } else { 10_000_000 };
    let mut records = Vec::new();
    for nodes in [3usize, 8, 32] {
        let ideal = 1.0 / (nodes + 1) as f64;
        for scheme in schemes() {
            let (moved, largest) = join_moves(keys, nodes, scheme);
            let target = if matches!(scheme, Partitioning::Consistent { virtual_nodes } if virtual_nodes >= Partitioning::DEFAULT_VIRTUAL_NODES) {
                ("ratio<=1.2", 1.2)
            } else {
                ("", 0.0)
            };
            let config = json!({ "partitioning": scheme.name(), "nodes": format!("{nodes}->{}", nodes + 1), "keys": keys });
            let figures = json!({ "moved_share": moved, "largest_home_over_mean": largest });
            records.push(record("join_moves", config, figures, "moved_share", "1/(N+1)", ideal, Better::Lower, target));
        }
    }
    records.extend(lookups(args.quick)?);
    records.extend(local_pulls(args.quick)?);
    records.extend(copartitioning(args.quick)?);
    print_records("partition", args.quick, started, args.json, &records);
    Ok(())
}

/// The co-partitioner's run time on a generated sparse data set of 10⁷ non-zeros (10⁶ with
/// `quick`): a million keys drawn with a skew (key `⌊m·u³⌋`, so low keys are frequent, as words
/// are), 10 a example; against the time to build the graph (a pass over the non-zeros that
/// sorts each example's keys), on one core. Also the busiest node's traffic against examples
/// dealt round robin with hashed homes (on such data, without structure, the cut is small).
fn copartitioning(quick: bool) -> Result<Vec<Record>> {
    use ferry::copartition::{Incidence, Options, copartition, dealt_examples, traffic};
    let (keys, nonzeros) = (1_000_000u64, if quick { 1_000_000usize } else { 10_000_000 });
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let rows: Vec<[u64; 10]> = (0..nonzeros / 10).map(|_| std::array::from_fn(|_| (keys as f64 * rng.r#gen::<f64>().powi(3)) as u64)).collect();
    let built = Instant::now();
    let mut graph = Incidence::new(keys)?;
    for row in &rows {
        graph.push_example(row.iter().copied())?;
    }
    let build_s = built.elapsed().as_secs_f64();
    drop(rows);
    let mut records = Vec::new();
    for nodes in [4usize, 16] {
        let started = Instant::now();
        let plan = copartition(&graph, &Options { batch: 32, ..Options::new(nodes) })?;
        let seconds = started.elapsed().as_secs_f64();
        let planned = traffic(&graph, nodes, 32, &plan.examples, plan.placement.homes())?;
        let hashed_homes: Vec<u16> = {
            let p = Partitioner::new(keys, nodes, Partitioning::Hash);
            (0..keys).map(|k| p.home(k) as u16).collect()
        };
        let hashed = traffic(&graph, nodes, 32, &dealt_examples(&graph, nodes), &hashed_homes)?;
        let config = json!({ "nodes": nodes, "nonzeros": graph.nonzeros(), "keys": keys, "examples": graph.examples() });
        let figures = json!({
            "seconds": seconds,
            "build_seconds": build_s,
            "bottleneck_vs_hash": planned.bottleneck / hashed.bottleneck.max(1e-9),
            "bottleneck_vs_lower_bound": planned.bottleneck / planned.lower_bound.max(1e-9),
        });
        let target = if quick { ("", 0.0) } else { ("<=10", 10.0) };
        records.push(record("copartition", config, figures, "seconds", "graph build", build_s, Better::Lower, target));
    }
    Ok(records)
}

/// The directory's lookups per scheme on 8 nodes, against the hash scheme's.
fn lookups(quick: bool) -> Result<Vec<Record>> {
    let keys: u64 = 10_000_000;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let sample: Vec<u64> = (0..if quick { 1_000_000 } else { 10_000_000 }).map(|_| rng.gen_range(0..keys)).collect();
    let partitioners: Vec<(Partitioning, Partitioner)> = schemes().into_iter().map(|s| (s, Partitioner::new(keys, 8, s))).collect();
    // Median of rounds that alternate the schemes, so that a noisy moment hits all alike.
    let rounds = if quick { 5 } else { 11 };
    let mut times = vec![Vec::with_capacity(rounds); partitioners.len()];
    for _ in 0..rounds {
        for (i, (_, p)) in partitioners.iter().enumerate() {
            times[i].push(lookup_ns(p, &sample));
        }
    }
    let median = |t: &mut Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let medians: Vec<f64> = times.iter_mut().map(median).collect();
    let hash = medians[1];
    Ok(partitioners
        .iter()
        .zip(&medians)
        .map(|((scheme, _), &ns)| {
            record(
                "home_lookup",
                json!({ "partitioning": scheme.name(), "nodes": 8 }),
                json!({ "ns_per_key": ns }),
                "ns_per_key",
                "hash",
                hash,
                Better::Lower,
                ("", 0.0),
            )
        })
        .collect())
}

/// Local pulls through a consistently hashed table, and through a feature-hashed one (raw ids
/// mapped to buckets and signs), against a hashed table of the same shape, on node 0 of an
/// in-process 2-node cluster, 1 and 100 keys a pull.
fn local_pulls(quick: bool) -> Result<Vec<Record>> {
    let keys: u64 = 1 << 20;
    let consistent = Partitioning::consistent();
    let features = ferry::FeatureHashing { seed: 9, signed: true };
    let tables = vec![
        TableSpec::new("features", keys, 16).partitioned(Partitioning::Hash).feature_hashed(features),
        TableSpec::new("hashed", keys, 16).partitioned(Partitioning::Hash),
        TableSpec::new("consistent", keys, 16).partitioned(consistent),
    ];
    let mut template = Config::new(tables);
    template.op_timeout = Duration::from_secs(60);
    let cluster = Node::start_local_cluster(2, template).context("starting a 2-node cluster in this process")?;
    let homed_here = |scheme: Partitioning| -> Vec<u64> { Partitioner::new(keys, 2, scheme).home_keys(0).collect() };
    let (hashed_keys, consistent_keys) = (homed_here(Partitioning::Hash), homed_here(consistent));
    // Raw ids from the whole u64 range whose buckets node 0 is home of.
    let buckets = Partitioner::new(keys, 2, Partitioning::Hash);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let raw_ids: Vec<u64> =
        std::iter::repeat_with(|| rng.r#gen::<u64>()).filter(|&id| buckets.home(features.bucket(id, keys)) == 0).take(hashed_keys.len()).collect();
    ensure!(!hashed_keys.is_empty() && !consistent_keys.is_empty(), "node 0 is home of no key");
    let how_long = Duration::from_millis(if quick { 300 } else { 1500 });
    let rounds = if quick { 3 } else { 7 };
    let mut out = Vec::new();
    for batch in [1usize, 100] {
        let (mut hashed, mut consistent_rates, mut feature_rates) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            hashed.push(local_pull_rate(&cluster[0], "hashed", &hashed_keys, batch, how_long)?);
            consistent_rates.push(local_pull_rate(&cluster[0], "consistent", &consistent_keys, batch, how_long)?);
            feature_rates.push(local_pull_rate(&cluster[0], "features", &raw_ids, batch, how_long)?);
        }
        // Consistent hashing should not cost a local access anything; feature hashing costs the
        // hash before the access (no target: a figure to know).
        for (config, rates, target) in [
            (json!({ "partitioning": consistent.name(), "keys_per_pull": batch, "value_len": 16 }), &consistent_rates, ("ratio>=0.9", 0.9)),
            (json!({ "table": "feature-hashed, signed", "keys_per_pull": batch, "value_len": 16 }), &feature_rates, ("", 0.0)),
        ] {
            // The round of the median ratio, so that both figures come from one moment.
            let ratios: Vec<f64> = rates.iter().zip(&hashed).map(|(c, h)| c / h).collect();
            let mut order: Vec<usize> = (0..rounds).collect();
            order.sort_by(|&a, &b| ratios[a].total_cmp(&ratios[b]));
            let mid = order[rounds / 2];
            out.push(record("local_pull", config, json!({ "keys_per_s": rates[mid] }), "keys_per_s", "hash", hashed[mid], Better::Higher, target));
        }
    }
    // Finalizing is collective: every node at once.
    let stopped: Vec<ferry::Result<()>> = std::thread::scope(|s| {
        cluster.into_iter().map(|mut node| s.spawn(move || node.finalize())).collect::<Vec<_>>().into_iter().map(|h| h.join().expect("finalizing")).collect()
    });
    for result in stopped {
        result.context("stopping the cluster")?;
    }
    Ok(out)
}
