//! Starting a local cluster of processes: N copies of a command on this machine, each told its
//! rank, the node count and the rendezvous address through `FERRY_RANK`, `FERRY_NODES` and
//! `FERRY_COORDINATOR`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
}

impl LaunchSpec {
    /// `nodes` copies of `program args…`.
    pub fn new(nodes: usize, program: impl Into<PathBuf>, args: Vec<String>) -> LaunchSpec {
        LaunchSpec { nodes, program: program.into(), args, env: Vec::new(), coordinator: None, grace: Duration::from_secs(10), timeout: None }
    }
}

/// How the processes ended.
#[derive(Debug)]
pub struct LaunchOutcome {
    /// Exit status per rank (`None` if it had to be killed).
    pub statuses: Vec<Option<ExitStatus>>,
}

impl LaunchOutcome {
    /// Whether every process exited with status 0.
    pub fn success(&self) -> bool {
        self.statuses.iter().all(|s| s.is_some_and(|s| s.success()))
    }

    /// Ranks that failed or were killed.
    pub fn failed_ranks(&self) -> Vec<usize> {
        self.statuses.iter().enumerate().filter(|(_, s)| !s.is_some_and(|s| s.success())).map(|(r, _)| r).collect()
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
    let coordinator = match &spec.coordinator {
        Some(c) => c.clone(),
        None => format!("127.0.0.1:{}", free_loopback_port()?),
    };
    // The processes of this launch share a fresh secret (unless the caller gave one): nothing
    // else can join their cluster, and two launches on one port never merge.
    let secret = match std::env::var("FERRY_SECRET")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| spec.env.iter().find(|(k, _)| k == "FERRY_SECRET").map(|(_, v)| v.clone()))
    {
        Some(s) => s,
        None => {
            use rand::RngCore;
            let mut bytes = [0u8; 24];
            rand::rngs::OsRng.fill_bytes(&mut bytes);
            bytes.iter().map(|b| format!("{b:02x}")).collect()
        }
    };
    let on_line = Arc::new(on_line);
    let mut children: Vec<Child> = Vec::new();
    let mut readers = Vec::new();
    for rank in 0..spec.nodes {
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .env("FERRY_RANK", rank.to_string())
            .env("FERRY_NODES", spec.nodes.to_string())
            .env("FERRY_COORDINATOR", &coordinator)
            .env("FERRY_SECRET", &secret)
            .envs(spec.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
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
    let statuses = Arc::new(Mutex::new(vec![None; spec.nodes]));
    let started = Instant::now();
    let mut failed_at: Option<Instant> = None;
    loop {
        let mut running = 0;
        for (rank, child) in children.iter_mut().enumerate() {
            if statuses.lock()[rank].is_some() {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) => {
                    statuses.lock()[rank] = Some(status);
                    if !status.success() && failed_at.is_none() {
                        failed_at = Some(Instant::now());
                    }
                }
                Ok(None) => running += 1,
                Err(_) => running += 1,
            }
        }
        if running == 0 {
            break;
        }
        let expired = failed_at.is_some_and(|t| t.elapsed() > spec.grace) || spec.timeout.is_some_and(|t| started.elapsed() > t);
        if expired {
            for (rank, child) in children.iter_mut().enumerate() {
                if statuses.lock()[rank].is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for r in readers {
        let _ = r.join();
    }
    let statuses = statuses.lock().clone();
    Ok(LaunchOutcome { statuses })
}
