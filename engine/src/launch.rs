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
use std::os::unix::process::CommandExt;
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
}

impl LaunchSpec {
    /// `nodes` copies of `program args…`.
    pub fn new(nodes: usize, program: impl Into<PathBuf>, args: Vec<String>) -> LaunchSpec {
        LaunchSpec { nodes, program: program.into(), args, env: Vec::new(), coordinator: None, grace: Duration::from_secs(10), timeout: None, join: None }
    }
}

/// How the processes ended.
#[derive(Debug)]
pub struct LaunchOutcome {
    /// The rank of each process started, in order (every rank, or the one that joins).
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

    /// How `rank`'s process ended (`None`: killed, or not started by this launch).
    pub fn status_of(&self, rank: usize) -> Option<ExitStatus> {
        self.ranks.iter().position(|&r| r == rank).and_then(|i| self.statuses[i])
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
    let on_line = Arc::new(on_line);
    let mut children: Vec<Child> = Vec::new();
    let mut readers = Vec::new();
    for &rank in &ranks {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .env("FERRY_RANK", rank.to_string())
            .env("FERRY_NODES", spec.nodes.to_string())
            .env("FERRY_COORDINATOR", &coordinator)
            .envs((!file_given).then_some(("FERRY_SECRET", &secret)))
            .envs(spec.join.map(|_| ("FERRY_JOIN", "1")))
            .envs(spec.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for c in &children {
                    signal_group(c, Signal::KILL);
                }
                for c in &mut children {
                    let _ = c.wait();
                }
                return Err(Error::Config(format!("cannot start {}: {e}", spec.program.display())));
            }
        };
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
        children.push(child);
    }
    let signals = Signals::register();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let started = Instant::now();
    let mut failed_at: Option<Instant> = None;
    let mut interrupted = None;
    loop {
        for (i, child) in children.iter_mut().enumerate() {
            if statuses[i].is_none()
                && let Ok(Some(status)) = child.try_wait()
            {
                statuses[i] = Some(status);
                if !status.success() && failed_at.is_none() {
                    failed_at = Some(Instant::now());
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
