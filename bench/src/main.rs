//! `ferry-bench`: Ferry's micro-benchmarks and ML workloads.

use ferry_bench::{micro, relocate, train};

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
        /// Internal: the part this process plays.
        #[arg(long, value_enum, default_value = "driver", hide = true)]
        role: Role,
    },
    /// Train a model on real or synthetic data in single, classic or localize mode.
    #[command(subcommand)]
    Train(train::TrainCommand),
    /// Relocation throughput, relocation and blocking times, and a parameter-blocking workload
    /// with and without relocation.
    Relocate {
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
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Micro { quick, json, role: Role::Driver } => micro::run_driver(quick, json),
        Command::Micro { quick, role: Role::Node, .. } => micro::run_node(quick),
        Command::Relocate { quick, json, role: Role::Driver } => relocate::run_driver(quick, json),
        Command::Relocate { quick, role: Role::Node, .. } => relocate::run_node(quick),
        Command::Train(t) => train::run(&t).map(|_| ()),
    }
}
