//! Running a benchmark's remote part on a cluster of processes of this binary.

use std::sync::Arc;
use std::time::Duration;

use std::os::unix::process::ExitStatusExt;

use anyhow::{Context, Result, anyhow};
use ferry::launch::{LaunchOutcome, LaunchSpec, Stream, launch};
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
    let errors = RankErrors::default();
    let held = errors.clone();
    let outcome = launch(&spec, move |rank, stream, line| {
        if stream == Stream::Stderr && held.hold(rank, line) {
            return;
        }
        if rank == 0 && stream == Stream::Stdout && line.starts_with("RECORD ") {
            match serde_json::from_str::<serde_json::Value>(&line[7..]) {
                Ok(v) => sink.lock().push(crate::report::from_json(&v)),
                Err(e) => eprintln!("[0] unreadable record ({e}): {line}"),
            }
        } else {
            eprintln!("[{rank}] {line}");
        }
    })?;
    if !outcome.success() || outcome.interrupted.is_some() {
        return Err(errors.failure("the benchmark cluster", &outcome));
    }
    let collected = std::mem::take(&mut *records.lock());
    Ok(collected)
}

/// The last words of the ranks of a launched cluster: the one line each prints when it fails
/// (`PROGRAM: error: …`), held back so that an error every rank hits is printed once, with how
/// many ranks hit it, instead of once per rank.
#[derive(Clone, Default)]
pub struct RankErrors(Arc<Mutex<Vec<(usize, String)>>>);

impl RankErrors {
    /// Holds `line` back if it is a rank's final error line; says whether it did.
    pub fn hold(&self, rank: usize, line: &str) -> bool {
        match final_error(line) {
            Some(message) => {
                self.0.lock().push((rank, message.to_string()));
                true
            }
            None => false,
        }
    }

    /// One error for a cluster that failed: how many ranks failed, then each distinct cause
    /// once, in the order the ranks reported them (the first is usually the cause, the rest its
    /// consequences) with the ranks that reported it, then the ranks that failed without a word.
    pub fn failure(&self, what: &str, outcome: &LaunchOutcome) -> anyhow::Error {
        let errors = self.0.lock();
        let mut causes: Vec<(&str, Vec<usize>)> = Vec::new();
        for (rank, message) in errors.iter() {
            match causes.iter_mut().find(|(m, _)| *m == message.as_str()) {
                Some((_, ranks)) => ranks.push(*rank),
                None => causes.push((message, vec![*rank])),
            }
        }
        let failed = outcome.failed_ranks();
        let mut text = match outcome.interrupted {
            Some(signal) => format!("{what} was stopped by signal {signal}"),
            None => format!("{what} failed on {} of {} ranks", failed.len(), outcome.statuses.len()),
        };
        const SHOWN: usize = 3;
        for (i, (message, ranks)) in causes.iter().enumerate().take(SHOWN) {
            let on = if ranks.len() == 1 { format!("rank {}", ranks[0]) } else { format!("ranks {}", rank_list(ranks)) };
            text.push_str(&format!("{}{message} ({on})", if i == 0 { ": " } else { "; then " }));
        }
        if causes.len() > SHOWN {
            text.push_str(&format!("; and {} other errors", causes.len() - SHOWN));
        }
        let silent: Vec<usize> = failed.into_iter().filter(|r| !errors.iter().any(|(e, _)| e == r)).collect();
        if !silent.is_empty() {
            text.push_str(&format!("; {}", describe_ranks(outcome, &silent)));
        }
        anyhow!(text)
    }
}

/// A rank's final error line (`PROGRAM: error: MESSAGE`, as [`crate::exit_status`] prints it):
/// its message.
fn final_error(line: &str) -> Option<&str> {
    let (program, message) = line.split_once(": error: ")?;
    (!program.is_empty() && program.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))).then_some(message)
}

/// Up to four ranks by number, then how many more.
fn rank_list(ranks: &[usize]) -> String {
    first_few(ranks, usize::to_string)
}

/// The first few of `ranks`, each as `describe` puts it, then how many more.
fn first_few(ranks: &[usize], describe: impl Fn(&usize) -> String) -> String {
    const LISTED: usize = 4;
    let listed: Vec<String> = ranks.iter().take(LISTED).map(describe).collect();
    match ranks.len().saturating_sub(LISTED) {
        0 => listed.join(", "),
        more => format!("{} and {more} more", listed.join(", ")),
    }
}

/// How a launch's ranks ended, in one line: how many failed of how many, and which (the first
/// few, with their exit status or that they were killed).
pub fn failure_summary(outcome: &LaunchOutcome) -> String {
    let failed = outcome.failed_ranks();
    format!("{} of {} ranks failed: {}", failed.len(), outcome.statuses.len(), describe_ranks(outcome, &failed))
}

/// The first few of `ranks` with how each ended, then how many more.
fn describe_ranks(outcome: &LaunchOutcome, ranks: &[usize]) -> String {
    first_few(ranks, |&r| match outcome.status_of(r) {
        // Killed from outside the launcher: most often the kernel, out of memory.
        Some(status) if status.signal() == Some(9) => format!("rank {r} ({status}: the out-of-memory killer?)"),
        Some(status) => format!("rank {r} ({status})"),
        None => format!("rank {r} (killed)"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::ExitStatus;

    #[test]
    fn an_error_every_rank_hits_is_told_once_with_its_count() {
        let errors = RankErrors::default();
        assert!(!errors.hold(0, "ferry: training epoch 1"), "not an error line");
        assert!(!errors.hold(0, "an odd line: error: in the middle"), "not a program's name");
        for rank in [3, 0, 1, 2, 4, 5] {
            let message = if rank == 3 { "out of memory" } else { "node 3 is lost" };
            assert!(errors.hold(rank, &format!("ferry-bench: error: {message}")));
        }
        let mut statuses = vec![Some(ExitStatus::from_raw(256)); 7];
        statuses[5] = None;
        let outcome = LaunchOutcome { ranks: (0..7).collect(), statuses, interrupted: None };
        let text = errors.failure("the intent cluster", &outcome).to_string();
        assert_eq!(
            text,
            "the intent cluster failed on 7 of 7 ranks: out of memory (rank 3); then node 3 is lost (ranks 0, 1, 2, 4 and 1 more); \
             rank 6 (exit status: 1)"
        );
        assert_eq!(
            failure_summary(&outcome),
            "7 of 7 ranks failed: rank 0 (exit status: 1), rank 1 (exit status: 1), rank 2 (exit status: 1), rank 3 (exit status: 1) and 3 more"
        );
        let killed = LaunchOutcome { ranks: vec![0, 1], statuses: vec![Some(ExitStatus::from_raw(9)), Some(ExitStatus::from_raw(256))], interrupted: None };
        assert!(failure_summary(&killed).contains("rank 0 (signal: 9 (SIGKILL): the out-of-memory killer?)"), "{}", failure_summary(&killed));
        let stopped = LaunchOutcome { ranks: vec![0, 1], statuses: vec![None; 2], interrupted: Some(15) };
        // A launch that started one rank (a node that joins) names it by its rank.
        let joined = LaunchOutcome { ranks: vec![2], statuses: vec![Some(ExitStatus::from_raw(256))], interrupted: None };
        assert_eq!(failure_summary(&joined), "1 of 1 ranks failed: rank 2 (exit status: 1)");
        assert!(RankErrors::default().failure("the cluster", &stopped).to_string().starts_with("the cluster was stopped by signal 15"));
    }
}
