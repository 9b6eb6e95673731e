//! Starting a local cluster of processes: N copies of a command on this machine, each told its
//! rank, the node count and the rendezvous address through `FERRY_RANK`, `FERRY_NODES` and
//! `FERRY_COORDINATOR`.
//!
//! Every rank leads a process group of its own, so that whatever it starts (a shell's children,
//! a script's background jobs) ends with it: when the launch ends — every rank exited, or the
//! rest were killed after one failed — what is left of each group is killed, and nothing holds
//! the launcher's pipes. An interrupt or termination of the launcher (SIGINT, SIGTERM, SIGHUP)
//! is passed on to every rank's group (the ranks are not in the terminal's foreground group any
//! more, so Ctrl-C reaches them only this way); the ranks get the grace period to finish, a
//! second signal or the end of the grace period kills them.

use std::io::{BufRead, BufReader};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process_group};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// Which output stream a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Number of processes.
    pub nodes: usize,
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment variables for every process.
    pub env: Vec<(String, String)>,
    /// Rendezvous address; a free loopback port when `None`.
    pub coordinator: Option<String>,
    /// After one process fails, how long the others may keep running before they are killed.
    pub grace: Duration,
    /// Kill everything after this long (`None`: no limit).
    pub timeout: Option<Duration>,
    /// Start only this rank, as a node that joins the running cluster of `nodes` at
    /// `coordinator` in the rank of one that left or was lost (`FERRY_JOIN=1`). It needs the
    /// cluster's secret (`FERRY_SECRET_FILE` or `FERRY_SECRET`, as the launch it joins had).
    pub join: Option<usize>,
    /// Start a fresh process in the rank of one that a signal ended (a lost node: killed, or
    /// crashed) while rank 0 runs, as a node that joins the running cluster (`FERRY_JOIN=1`,
    /// the same rendezvous address and secret; rank 0 takes joins there) — for programs that
    /// train on without a lost node and take a fresh one back. Rank 0 itself is not replaced
    /// (a joining node never takes coordination over), nor a process that failed with an
    /// error of its own; a replacement lost in turn is replaced again, up to
    /// [`MAX_REPLACEMENTS`] in one launch. A replaced process's end does not start the grace
    /// period.
    pub replace_lost: bool,
}

/// Most processes [`LaunchSpec::replace_lost`] starts in one launch: a node that is lost again
/// and again (one that runs out of memory on start, say) does not make the launch fork for ever.
pub const MAX_REPLACEMENTS: usize = 16;

impl LaunchSpec {
    /// `nodes` copies of `program args…`.
    pub fn new(nodes: usize, program: impl Into<PathBuf>, args: Vec<String>) -> LaunchSpec {
        LaunchSpec {
            nodes,
            program: program.into(),
            args,
            env: Vec::new(),
            coordinator: None,
            grace: Duration::from_secs(10),
            timeout: None,
            join: None,
            replace_lost: false,
        }
    }
}

/// How the processes ended.
#[derive(Debug)]
pub struct LaunchOutcome {
    /// The rank of each process started, in order (every rank, or the one that joins; then
    /// any replacement [`LaunchSpec::replace_lost`] started, in the rank it replaced).
    pub ranks: Vec<usize>,
    /// Exit status per process, as `ranks` (`None` if it had to be killed).
    pub statuses: Vec<Option<ExitStatus>>,
    /// The signal (SIGINT, SIGTERM or SIGHUP) that stopped the launch, if one did: it was passed
    /// on to the ranks.
    pub interrupted: Option<i32>,
}

impl LaunchOutcome {
    /// Whether every process exited with status 0.
    pub fn success(&self) -> bool {
        self.statuses.iter().all(|s| s.is_some_and(|s| s.success()))
    }

    /// Ranks that failed or were killed.
    pub fn failed_ranks(&self) -> Vec<usize> {
        self.ranks.iter().zip(&self.statuses).filter(|(_, s)| !s.is_some_and(|s| s.success())).map(|(&r, _)| r).collect()
    }

    /// How `rank`'s process ended (`None`: killed, or not started by this launch); of a rank
    /// that was replaced, how its last process ended.
    pub fn status_of(&self, rank: usize) -> Option<ExitStatus> {
        self.ranks.iter().rposition(|&r| r == rank).and_then(|i| self.statuses[i])
    }

    /// The ranks in which [`LaunchSpec::replace_lost`] started a fresh process, once per
    /// replacement.
    pub fn replaced_ranks(&self) -> Vec<usize> {
        (0..self.ranks.len()).filter(|&i| self.is_replacement(i)).map(|i| self.ranks[i]).collect()
    }

    /// Whether process `i` (of `ranks` and `statuses`) is a replacement
    /// [`LaunchSpec::replace_lost`] started, not one the launch started with.
    pub fn is_replacement(&self, i: usize) -> bool {
        self.ranks.get(i).is_some_and(|r| self.ranks[..i].contains(r))
    }
}

/// A free TCP port on loopback (bound and released; good enough for a rendezvous).
pub fn free_loopback_port() -> Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).map_err(|e| Error::Transport(format!("no free port: {e}")))
}

/// Starts the processes, passes every output line to `on_line(rank, stream, line)`, and waits.
/// When a process fails, the others get `grace` to finish and are then killed.
pub fn launch(spec: &LaunchSpec, on_line: impl Fn(usize, Stream, &str) + Send + Sync + 'static) -> Result<LaunchOutcome> {
    if spec.nodes == 0 {
        return Err(Error::Config("launch needs at least one process".into()));
    }
    let coordinator = match (&spec.coordinator, spec.join) {
        (Some(c), _) => c.clone(),
        (None, None) => format!("127.0.0.1:{}", free_loopback_port()?),
        (None, Some(_)) => return Err(Error::Config("a node that joins needs the running cluster's rendezvous address (--coordinator)".into())),
    };
    let ranks: Vec<usize> = match spec.join {
        Some(rank) if rank >= spec.nodes => return Err(Error::Config(format!("rank {rank} does not exist in a cluster of {} nodes", spec.nodes))),
        Some(rank) => vec![rank],
        None => (0..spec.nodes).collect(),
    };
    let secret_given =
        ["FERRY_SECRET", "FERRY_SECRET_FILE"].iter().any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()) || spec.env.iter().any(|(k, _)| k == v));
    if spec.join.is_some() && !secret_given {
        return Err(Error::Config(
            "a node that joins needs the cluster's secret: give it FERRY_SECRET_FILE (or FERRY_SECRET) as the launch it joins had (`ferry secret --out FILE` writes one)".into(),
        ));
    }
    // The processes of this launch share a fresh secret (unless the caller gave one): nothing
    // else can join their cluster, and two launches on one port never merge.
    let secret = match std::env::var("FERRY_SECRET")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| spec.env.iter().find(|(k, _)| k == "FERRY_SECRET").map(|(_, v)| v.clone()))
    {
        Some(s) => s,
        None => crate::config::generate_secret(),
    };
    // A secret file the caller chose is passed on as it is (a rank takes one or the other).
    let file_given = std::env::var_os("FERRY_SECRET_FILE").is_some_and(|f| !f.is_empty()) || spec.env.iter().any(|(k, _)| k == "FERRY_SECRET_FILE");
    let on_line: LineSink = Arc::new(on_line);
    let env = RankEnv { spec, coordinator: &coordinator, secret: (!file_given).then_some(secret.as_str()) };
    let mut children: Vec<Child> = Vec::new();
    let mut readers = Vec::new();
    for &rank in &ranks {
        match env.spawn(rank, spec.join.is_some(), &on_line) {
            Ok((child, pipes)) => {
                children.push(child);
                readers.extend(pipes);
            }
            Err(e) => {
                for c in &children {
                    signal_group(c, Signal::KILL);
                }
                for c in &mut children {
                    let _ = c.wait();
                }
                return Err(e);
            }
        }
    }
    let started_with = ranks.len();
    let mut ranks = ranks;
    let signals = Signals::register();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let started = Instant::now();
    let mut failed_at: Option<Instant> = None;
    let mut interrupted = None;
    loop {
        let mut lost = Vec::new();
        for (i, child) in children.iter_mut().enumerate() {
            if statuses[i].is_none()
                && let Ok(Some(status)) = child.try_wait()
            {
                statuses[i] = Some(status);
                if status.signal().is_some() && interrupted.is_none() && spec.replace_lost && ranks[i] != 0 {
                    lost.push(ranks[i]);
                } else if !status.success() && failed_at.is_none() {
                    failed_at = Some(Instant::now());
                }
            }
        }
        // Lost ranks, replaced while rank 0 (the contact) runs.
        let contact_runs = ranks.iter().zip(&statuses).any(|(&r, s)| r == 0 && s.is_none());
        for rank in lost {
            let spawned = if contact_runs && ranks.len() - started_with < MAX_REPLACEMENTS { Some(env.spawn(rank, true, &on_line)) } else { None };
            match spawned {
                Some(Ok((child, pipes))) => {
                    children.push(child);
                    readers.extend(pipes);
                    ranks.push(rank);
                    statuses.push(None);
                }
                Some(Err(e)) => {
                    on_line(rank, Stream::Stderr, &format!("could not start a node in lost rank {rank}: {e}"));
                    failed_at.get_or_insert_with(Instant::now);
                }
                None => {
                    failed_at.get_or_insert_with(Instant::now);
                }
            }
        }
        let running = || children.iter().zip(&statuses).filter(|(_, s)| s.is_none()).map(|(c, _)| c);
        if running().next().is_none() {
            break;
        }
        let mut kill_now = false;
        if let Some(signal) = signals.take() {
            if interrupted.is_some() {
                kill_now = true;
            } else {
                interrupted = Some(signal.as_raw());
                failed_at.get_or_insert_with(Instant::now);
                running().for_each(|c| signal_group(c, signal));
            }
        }
        let expired = failed_at.is_some_and(|t| t.elapsed() > spec.grace) || spec.timeout.is_some_and(|t| started.elapsed() > t);
        if expired || kill_now {
            running().for_each(|c| signal_group(c, Signal::KILL));
            for (i, child) in children.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    // The leader itself, should its group be out of reach (it left it).
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if interrupted.is_none() {
        // Caught as the last rank ended: nothing left to pass it on to, but the caller hears it.
        interrupted = signals.take().map(|s| s.as_raw());
    }
    drop(signals);
    // What the ranks started and left behind goes with them, and lets go of the pipes. Every
    // group's leader has been reaped, but its group id stays taken while a member lives.
    children.iter().for_each(|c| signal_group(c, Signal::KILL));
    for r in readers {
        let _ = r.join();
    }
    Ok(LaunchOutcome { ranks, statuses, interrupted })
}

/// Where every process's output lines go: `(rank, stream, line)`.
type LineSink = Arc<dyn Fn(usize, Stream, &str) + Send + Sync>;

/// What every rank's process is started with.
struct RankEnv<'a> {
    spec: &'a LaunchSpec,
    coordinator: &'a str,
    /// The launch's secret, unless the caller gave a secret file (passed on as it is).
    secret: Option<&'a str>,
}

impl RankEnv<'_> {
    /// Starts the process of `rank` (`joining`: as a node that joins the running cluster), in a
    /// process group of its own, with a thread per output stream passing lines to `on_line`.
    fn spawn(&self, rank: usize, joining: bool, on_line: &LineSink) -> Result<(Child, Vec<std::thread::JoinHandle<()>>)> {
        let spec = self.spec;
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .env("FERRY_RANK", rank.to_string())
            .env("FERRY_NODES", spec.nodes.to_string())
            .env("FERRY_COORDINATOR", self.coordinator)
            .envs(self.secret.map(|s| ("FERRY_SECRET", s)))
            .envs(joining.then_some(("FERRY_JOIN", "1")))
            .envs(spec.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = cmd.spawn().map_err(|e| Error::Config(format!("cannot start {}: {e}", spec.program.display())))?;
        let mut readers = Vec::new();
        for (stream, pipe) in [
            (Stream::Stdout, child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>)),
            (Stream::Stderr, child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>)),
        ] {
            let Some(pipe) = pipe else { continue };
            let on_line = on_line.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines() {
                    match line {
                        Ok(l) => on_line(rank, stream, &l),
                        Err(_) => break,
                    }
                }
            }));
        }
        Ok((child, readers))
    }
}

/// Sends `signal` to every process of `child`'s group (it leads its own: `process_group(0)`).
fn signal_group(child: &Child, signal: Signal) {
    if let Some(group) = i32::try_from(child.id()).ok().and_then(Pid::from_raw) {
        // The group may be gone (everything in it exited): nothing to do then.
        let _ = kill_process_group(group, signal);
    }
}

/// The launcher's interrupt and termination signals, caught (instead of ending the launcher
/// and orphaning the ranks) while a launch runs. The handlers are installed once per process;
/// while no launch runs they do what the signals do by default.
struct Signals(&'static Catcher);

struct Catcher {
    /// The last signal caught (0: none since it was last taken).
    caught: Arc<AtomicUsize>,
    /// Whether no launch runs: then a signal takes its default action.
    idle: Arc<AtomicBool>,
    launches: Mutex<usize>,
}

static CATCHER: OnceLock<Catcher> = OnceLock::new();

impl Signals {
    const FORWARDED: [Signal; 3] = [Signal::INT, Signal::TERM, Signal::HUP];

    fn register() -> Signals {
        let catcher = CATCHER.get_or_init(|| {
            let catcher = Catcher { caught: Arc::new(AtomicUsize::new(0)), idle: Arc::new(AtomicBool::new(true)), launches: Mutex::new(0) };
            for s in Self::FORWARDED {
                let installed = signal_hook::flag::register_conditional_default(s.as_raw(), catcher.idle.clone())
                    .and_then(|_| signal_hook::flag::register_usize(s.as_raw(), catcher.caught.clone(), s.as_raw() as usize));
                if let Err(e) = installed {
                    tracing::warn!("cannot catch signal {}: {e}; it would end the launcher without its ranks", s.as_raw());
                }
            }
            catcher
        });
        let mut launches = catcher.launches.lock();
        if *launches == 0 {
            catcher.caught.store(0, Ordering::SeqCst);
        }
        *launches += 1;
        catcher.idle.store(false, Ordering::SeqCst);
        Signals(catcher)
    }

    /// The signal caught since the last call, if any (one launch at a time takes it).
    fn take(&self) -> Option<Signal> {
        let raw = self.0.caught.swap(0, Ordering::SeqCst);
        Self::FORWARDED.into_iter().find(|s| s.as_raw() as usize == raw)
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        let mut launches = self.0.launches.lock();
        *launches -= 1;
        if *launches == 0 {
            self.0.idle.store(true, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `nodes` copies of a shell script in which rank `victim` kills itself with SIGKILL unless it
    /// was started as a joining node, which leaves a mark; the others wait for the mark (4 s
    /// at most) and succeed. Returns the outcome and the lines the fresh nodes printed.
    fn run(nodes: usize, victim: usize, replace_lost: bool) -> (LaunchOutcome, Vec<usize>) {
        let mark = std::env::temp_dir().join(format!("ferry-launch-replace-{}-{victim}-{replace_lost}", std::process::id()));
        let _ = std::fs::remove_file(&mark);
        let script = format!(
            r#"if [ -n "$FERRY_JOIN" ]; then echo fresh; touch '{m}'; exit 0; fi
               if [ "$FERRY_RANK" = {victim} ]; then kill -9 $$; fi
               i=0; while [ ! -e '{m}' ] && [ $i -lt 80 ]; do sleep 0.05; i=$((i+1)); done"#,
            m = mark.display()
        );
        let mut spec = LaunchSpec::new(nodes, "sh", vec!["-c".into(), script]);
        spec.replace_lost = replace_lost;
        spec.grace = Duration::from_secs(30);
        let fresh = Arc::new(Mutex::new(Vec::new()));
        let seen = fresh.clone();
        let outcome = launch(&spec, move |rank, stream, line| {
            if stream == Stream::Stdout && line == "fresh" {
                seen.lock().push(rank);
            }
        })
        .unwrap();
        let _ = std::fs::remove_file(&mark);
        let fresh = fresh.lock().clone();
        (outcome, fresh)
    }

    #[test]
    fn a_lost_rank_is_started_again_as_a_joining_node_but_never_rank_0() {
        let (outcome, fresh) = run(3, 1, true);
        assert_eq!(outcome.ranks, vec![0, 1, 2, 1], "{outcome:?}");
        assert_eq!(outcome.statuses[1].and_then(|s| s.signal()), Some(9));
        assert!([0, 2, 3].iter().all(|&i| outcome.statuses[i].is_some_and(|s| s.success())), "{outcome:?}");
        assert_eq!((outcome.replaced_ranks(), fresh), (vec![1], vec![1]));
        assert!(outcome.status_of(1).is_some_and(|s| s.success()), "a replaced rank's last process");
        // Rank 0 takes the joins: it is not replaced; nor is anything without the option.
        for (victim, replace) in [(0, true), (1, false)] {
            let (outcome, fresh) = run(2, victim, replace);
            assert_eq!((outcome.ranks.clone(), fresh), (vec![0, 1], vec![]), "victim {victim}: {outcome:?}");
        }
    }
}
