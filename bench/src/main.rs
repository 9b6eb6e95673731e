//! `ferry-bench`: Ferry's micro-benchmarks and ML workloads.

use ferry_bench::{checkpoint, failover, micro, partition, relocate, replicate, train};

// A retaining allocator: large per-operation buffers are reused instead of being mapped and
// faulted in again on every bulk operation.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(name = "ferry-bench", about = "Micro-benchmarks and ML workloads for the Ferry parameter store")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    /// Run everything and report.
    Driver,
    /// Be one node of the cluster the driver starts (internal).
    Node,
}

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Local and remote pull/push latency and batched throughput, against memcpy and raw TCP.
    Micro {
        /// A short run (under 30 s).
        #[arg(long)]
        quick: bool,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        /// Only configurations whose "benchmark key=value…" text contains every word of this
        /// pattern, e.g. "batched_push value_len=1" or "remote"; alternatives separated by
        /// commas, e.g. "remote,batched" (everything that goes over the network).
        #[arg(long)]
        only: Option<String>,
        /// Measure each configuration this many times; the table shows the median ratio and
        /// the spread.
        #[arg(long, default_value_t = 1)]
        repeat: usize,
        /// Internal: the part this process plays.
        #[arg(long, value_enum, default_value = "driver", hide = true)]
        role: Role,
    },
    /// Structured fuzzing of the protocol: well-formed frames of every message type, mutated,
    /// fed to a live node; fails if anything panics.
    Fuzz {
        /// Frames to feed.
        #[arg(long, default_value_t = 100_000)]
        cases: u64,
        /// Seed of the first batch (each further batch of 100 000 uses the next seed).
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// A checkpoint of one node's values: the pause against a memcpy, the writing against a plain
    /// sequential write with fsync, the restore against a sequential read, and a worker's push
    /// throughput while the files are written in the background.
    Checkpoint(checkpoint::CheckpointArgs),
    /// What each partitioning moves when a node joins (against the ideal 1/(N+1)), how even
    /// its homes are, its lookup cost, and local pulls through a consistently hashed table
    /// against a hashed one.
    Partition(partition::PartitionArgs),
    /// Backups: push throughput and latency with one backup per key against none, and how
    /// soon the survivors serve a node's keys again after it is killed (`kill -9`).
    Failover(failover::FailoverArgs),
    /// Train a model on real or synthetic data in single, classic, localize, hybrid or intent mode.
    #[command(subcommand)]
    Train(Box<train::TrainCommand>),
    /// Replica refresh throughput against a raw TCP stream, and replica staleness under a
    /// 40 ms bound while both nodes push and pull replicated keys.
    Replicate {
        /// A short run.
        #[arg(long)]
        quick: bool,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        /// Internal: the part this process plays.
        #[arg(long, value_enum, default_value = "driver", hide = true)]
        role: Role,
    },
    /// Relocation throughput, relocation and blocking times, and a parameter-blocking workload
    /// with and without relocation.
    Relocate {
        /// A short run.
        #[arg(long)]
        quick: bool,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        /// Only these value lengths (comma-separated, from 1, 100, 1000, 8000), and no
        /// parameter-blocking workload.
        #[arg(long, value_delimiter = ',')]
        lens: Vec<usize>,
        /// Keys of the parameter-blocking workload's table (default 200 000, at most that); its
        /// accesses per sub-epoch scale with it, so a smaller table runs the same workload in
        /// less time. Not with --lens, which leaves the workload out.
        #[arg(long)]
        blocking_keys: Option<u64>,
        /// Internal: the part this process plays.
        #[arg(long, value_enum, default_value = "driver", hide = true)]
        role: Role,
    },
}

fn fuzz(cases: u64, seed: u64) -> Result<()> {
    let started = std::time::Instant::now();
    let mut total = ferry::testing::fuzz::FuzzReport::default();
    let mut left = cases;
    let mut batch_seed = seed;
    while left > 0 {
        let n = left.min(100_000);
        let r = ferry::testing::fuzz::run(n, batch_seed);
        total.cases += r.cases;
        total.accepted += r.accepted;
        total.rejected += r.rejected;
        total.unmutated += r.unmutated;
        total.deliveries += r.deliveries;
        total.faults += r.faults;
        total.panics += r.panics;
        if total.first_panic.is_none() {
            total.first_panic = r.first_panic;
        }
        for (ty, (a, b)) in r.per_type {
            let e = total.per_type.entry(ty).or_default();
            e.0 += a;
            e.1 += b;
        }
        left -= n;
        batch_seed += 1;
    }
    println!("ferry-bench fuzz: {} cases in {:.1} s (seeds {seed}..{batch_seed})", total.cases, started.elapsed().as_secs_f64());
    println!(
        "  accepted {} ({:.1} %), rejected {}, left unmutated {}",
        total.accepted,
        100.0 * total.accepted as f64 / total.cases.max(1) as f64,
        total.rejected,
        total.unmutated
    );
    println!("  deliveries to the worker {}, rejected as a peer's fault {}", total.deliveries, total.faults);
    for (ty, (a, b)) in &total.per_type {
        println!("  {ty:<16} accepted {a:>8}  rejected {b:>8}");
    }
    if total.panics > 0 {
        anyhow::bail!("{} cases panicked; first: {}", total.panics, total.first_panic.unwrap_or_default());
    }
    println!("  panics: 0");
    Ok(())
}

fn main() -> std::process::ExitCode {
    ferry_bench::exit_status("ferry-bench", run())
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    // Fuzzing feeds broken frames on purpose: their log lines are noise unless asked for.
    let default_filter = if matches!(cli.command, Command::Fuzz { .. }) { "off" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into()))
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Micro { quick, json, only, repeat, role: Role::Driver } => micro::run_driver(quick, json, &micro::Only::new(only.as_deref()), repeat),
        Command::Micro { quick, only, repeat, role: Role::Node, .. } => micro::run_node(quick, &micro::Only::new(only.as_deref()), repeat),
        Command::Relocate { quick, json, lens, blocking_keys, role: Role::Driver } => relocate::run_driver(quick, json, &lens, blocking_keys),
        Command::Relocate { quick, lens, blocking_keys, role: Role::Node, .. } => relocate::run_node(quick, &lens, blocking_keys),
        Command::Checkpoint(args) => checkpoint::run(&args),
        Command::Partition(args) => partition::run(&args),
        Command::Failover(args) => failover::run(&args),
        Command::Replicate { quick, json, role: Role::Driver } => replicate::run_driver(quick, json),
        Command::Replicate { quick, role: Role::Node, .. } => replicate::run_node(quick),
        Command::Train(t) => train::run(&t).map(|_| ()),
        Command::Fuzz { cases, seed } => fuzz(cases, seed),
    }
}
