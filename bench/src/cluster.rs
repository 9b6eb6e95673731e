//! Running a benchmark's remote part on a cluster of processes of this binary.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ferry::launch::{LaunchSpec, Stream, launch};
use parking_lot::Mutex;

use crate::report::Record;

/// How long a benchmark cluster may run: `FERRY_BENCH_TIMEOUT_S` seconds when set (slow
/// fabrics such as soft-RoCE under an emulated CPU need more), else 5 minutes for `--quick`
/// and an hour otherwise. Nodes use it as their operation timeout too, since one of them may
/// wait in a barrier while the other measures.
pub fn budget(quick: bool) -> Duration {
    let default = if quick { 300 } else { 3600 };
    let seconds = std::env::var("FERRY_BENCH_TIMEOUT_S").ok().and_then(|s| s.trim().parse::<u64>().ok()).filter(|&s| s > 0).unwrap_or(default);
    Duration::from_secs(seconds)
}

/// Prints a record for the driver to collect (rank 0's standard output).
pub fn emit(r: Record) {
    println!("RECORD {}", r.json_line());
}

/// Starts `nodes` processes of this binary running `subcommand --role node`, with a free port for
/// the raw-TCP baseline in `FERRY_BENCH_PORT`, and collects the records rank 0 emits; other
/// output is passed through with the rank as prefix.
pub fn run_nodes(subcommand: &str, quick: bool, nodes: usize) -> Result<Vec<Record>> {
    run_nodes_with(subcommand, quick, nodes, &[])
}

/// [`run_nodes`] with extra arguments for the node processes.
pub fn run_nodes_with(subcommand: &str, quick: bool, nodes: usize, extra: &[String]) -> Result<Vec<Record>> {
    let port = ferry::launch::free_loopback_port()?;
    let exe = std::env::current_exe().context("locating ferry-bench")?;
    let mut args = vec![subcommand.to_string(), "--role".into(), "node".into()];
    if quick {
        args.push("--quick".into());
    }
    args.extend(extra.iter().cloned());
    let mut spec = LaunchSpec::new(nodes, exe, args);
    spec.env.push(("FERRY_BENCH_PORT".into(), port.to_string()));
    spec.timeout = Some(budget(quick));
    let records: Arc<Mutex<Vec<Record>>> = Arc::default();
    let sink = records.clone();
    let outcome = launch(&spec, move |rank, stream, line| {
        if rank == 0 && stream == Stream::Stdout && line.starts_with("RECORD ") {
            match serde_json::from_str::<serde_json::Value>(&line[7..]) {
                Ok(v) => sink.lock().push(crate::report::from_json(&v)),
                Err(e) => eprintln!("[0] unreadable record ({e}): {line}"),
            }
        } else {
            eprintln!("[{rank}] {line}");
        }
    })?;
    if !outcome.success() {
        bail!("the benchmark cluster failed (ranks {:?})", outcome.failed_ranks());
    }
    let collected = std::mem::take(&mut *records.lock());
    Ok(collected)
}
