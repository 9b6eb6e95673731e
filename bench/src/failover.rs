//! `ferry-bench failover`: what backups cost and how fast a lost node's keys are served again.
//!
//! * **Push cost.** Three nodes in this process over loopback TCP, a classic parameter server
//!   with one backup per key (`k = 1`) against the same without (`k = 0`), started one after
//!   the other and repeated: node 0's worker pushes batches of node 1's keys as `micro`'s
//!   batched pushes do (30 000 keys of 100 values, 300 000 of 1 value), as keys per second,
//!   and single keys, as the push's latency.
//! * **Failover.** Per trial, three processes of this binary with `k = 1`: every node pushes
//!   known updates, then rank 1 kills itself with `kill -9` (after recording the cluster time)
//!   while rank 0 pulls rank 1's keys in a loop. The time from the kill to rank 0's first pull
//!   error is the detection, to its first pull that succeeds — served by rank 2 from the
//!   images it adopted, and checked to hold every acknowledged push — the failover. The
//!   liveness timeout (`FERRY_PEER_TIMEOUT`, 5 s) bounds detection when a peer goes silent
//!   without its connection closing; a killed process's connections close at once. Then a
//!   fresh process joins in the victim's rank, started as `ferry launch --join 1` starts it
//!   (`FERRY_JOIN=1`, through rank 0's rendezvous address): it must hold the victim's share of
//!   the keys again, read every acknowledged push, and pass a barrier with the survivors. The
//!   time its `Node::start` took (connections and the join) is the join time.
//! * **Leave.** A node leaves gracefully while the others push: the pause their pushes see
//!   (see `leave.rs`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry::launch::{LaunchSpec, Stream, launch};
use ferry::{Config, MessageKind, Node, TableSpec};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use std::sync::Arc;

use crate::micro::median;
use crate::report::{Better, print_records, record};

/// The push-cost batches, as `micro`'s batched pushes: (keys per batch, value length). Each
/// table has three times the batch's keys, so the batch is one node's home keys.
const BATCHES: [(u64, usize); 2] = [(30_000, 100), (300_000, 1)];
/// Keys and value length of the failover table; the victim's keys that rank 0 pulls.
const FAILOVER_KEYS: u64 = 3_000;
const FAILOVER_LEN: usize = 8;
const PULLED: usize = 10;
/// Pushes every node makes to every key before the kill.
const PUSH_ROUNDS: usize = 5;
/// Rank that is killed, and rank that pulls its keys (rank 2 takes them over).
const VICTIM: usize = 1;
const PULLER: usize = 0;

/// Arguments of `ferry-bench failover`.
#[derive(clap::Args, Debug, Clone)]
pub struct FailoverArgs {
    /// A short run (fewer push-cost repetitions; still 20 failover trials unless --trials).
    #[arg(long)]
    pub quick: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Failover trials (default 20).
    #[arg(long, default_value_t = 20)]
    pub trials: usize,
    /// Only the push cost (`push`), the failover trials (`trials`), the graceful-leave trials
    /// (`leave`: the pause workers see while a node leaves, then while one joins), or the same
    /// leave in a cluster that relocates keys (`leave-localize`: workers move keys as they
    /// push, the leaver gives back the keys of other homes it holds; no join, which such a
    /// cluster does not take yet).
    #[arg(long, value_parser = ["push", "trials", "leave", "leave-localize"])]
    pub only: Option<String>,
    /// Internal: be one node of a failover trial, exchanging times through this directory.
    #[arg(long, hide = true)]
    pub trial_dir: Option<PathBuf>,
}

/// Runs the benchmark (or, with `--trial-dir`, one node of a trial).
pub fn run(args: &FailoverArgs) -> Result<()> {
    if let Some(dir) = &args.trial_dir {
        return trial_node(dir);
    }
    if args.trials == 0 {
        bail!("--trials must be at least 1");
    }
    let started = Instant::now();
    let mut records = Vec::new();
    let wants = |part: &str| args.only.as_deref().is_none_or(|only| only == part);
    if wants("push") {
        records.extend(push_cost(args.quick)?);
    }
    if wants("trials") {
        records.push(failover_trials(args.trials)?);
    }
    if wants("leave") {
        records.push(crate::leave::leave_trials(args.trials, args.quick, false)?);
    }
    if wants("leave-localize") {
        records.push(crate::leave::leave_trials(args.trials, args.quick, true)?);
    }
    print_records("failover", args.quick, started, args.json, &records);
    Ok(())
}

/// A classic parameter server of three nodes in this process, with `backups` backups and a
/// table per batch shape.
fn local_cluster(backups: usize) -> Result<Vec<Node>> {
    let tables = BATCHES.iter().map(|&(keys, len)| TableSpec::new(format!("v{len}"), 3 * keys, len)).collect();
    let mut c = Config::new(tables);
    c.relocation = false;
    c.backups = backups;
    Ok(Node::start_local_cluster(3, c)?)
}

/// What one cluster measured: per batch shape, keys pushed per second and the CPU time the
/// process (all three nodes) spent per batch, in seconds (0 where the platform does not say);
/// single-key pushes per second and their p50 (µs).
struct PushFigures {
    batched: [f64; BATCHES.len()],
    batched_cpu_s: [f64; BATCHES.len()],
    /// Bytes the nodes sent per key pushed, as pushes (ACCESS) and as backup images (BACKUP).
    push_bytes_per_key: [f64; BATCHES.len()],
    backup_bytes_per_key: [f64; BATCHES.len()],
    single: f64,
    single_p50_us: f64,
}

/// CPU time this process's threads have run so far, in seconds, from Linux's per-thread
/// scheduler statistics (nanoseconds, unlike `/proc/self/stat`'s 10 ms ticks); `None`
/// elsewhere. Threads that ended are not counted: call it around work whose threads live.
fn process_cpu_s() -> Option<f64> {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let Ok(text) = std::fs::read_to_string(task.ok()?.path().join("schedstat")) else { continue };
        ns += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(ns as f64 / 1e9)
}

/// Node 0's worker pushes to node 1's keys: whole batches of its home keys (range
/// partitioning: the middle third), then single keys.
fn measure_pushes(backups: usize, quick: bool, seed: u64) -> Result<PushFigures> {
    let cluster = local_cluster(backups)?;
    let mut w = cluster[0].worker();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut batched, mut batched_cpu_s) = ([0.0; BATCHES.len()], [0.0; BATCHES.len()]);
    let (mut push_bytes_per_key, mut backup_bytes_per_key) = ([0.0; BATCHES.len()], [0.0; BATCHES.len()]);
    let sent = |kind: MessageKind| -> u64 {
        let at = MessageKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
        cluster.iter().map(|n| n.stats().traffic.bytes[at]).sum()
    };
    for (i, &(keys, len)) in BATCHES.iter().enumerate() {
        let table = cluster[0].table(&format!("v{len}"))?;
        let batch: Vec<u64> = (keys..2 * keys).collect();
        let updates = vec![0.001f32; batch.len() * len];
        // The first round sends every image; a push before the measured ones sends its keys'.
        w.push(table, &batch, &updates)?;
        let reps = if quick { 5 } else { 15 };
        let mut times = Vec::new();
        let cpu_before = process_cpu_s();
        let (pushed_before, backed_up_before) = (sent(MessageKind::Access), sent(MessageKind::Backup));
        for _ in 0..reps {
            let t = Instant::now();
            w.push(table, &batch, &updates)?;
            times.push(t.elapsed().as_secs_f64());
        }
        let per_key = |bytes: u64| bytes as f64 / (reps * keys) as f64;
        push_bytes_per_key[i] = per_key(sent(MessageKind::Access) - pushed_before);
        backup_bytes_per_key[i] = per_key(sent(MessageKind::Backup) - backed_up_before);
        batched[i] = keys as f64 / median(&mut times);
        if let (Some(before), Some(after)) = (cpu_before, process_cpu_s()) {
            batched_cpu_s[i] = (after - before) / reps as f64;
        }
    }
    let (keys, len) = BATCHES[1];
    let table = cluster[0].table(&format!("v{len}"))?;
    let span = Duration::from_millis(if quick { 400 } else { 1500 });
    let mut latencies = Vec::new();
    let began = Instant::now();
    while began.elapsed() < span {
        let key = rng.gen_range(keys..2 * keys);
        let t = Instant::now();
        w.push(table, &[key], &[0.5])?;
        latencies.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let single = latencies.len() as f64 / began.elapsed().as_secs_f64();
    let single_p50_us = median(&mut latencies);
    drop(w);
    finish(cluster);
    Ok(PushFigures { batched, batched_cpu_s, push_bytes_per_key, backup_bytes_per_key, single, single_p50_us })
}

/// Finalizes a cluster in this process (every node at once: finalize is collective).
pub(crate) fn finish(cluster: Vec<Node>) {
    std::thread::scope(|s| {
        for mut node in cluster {
            s.spawn(move || {
                let _ = node.finalize();
            });
        }
    });
}

/// Push throughput and latency with one backup, and with two, against none, alternating
/// clusters.
fn push_cost(quick: bool) -> Result<Vec<crate::report::Record>> {
    let repeats = if quick { 3 } else { 5 };
    let (mut k0, mut k1, mut k2) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..repeats {
        k0.push(measure_pushes(0, quick, r as u64)?);
        k1.push(measure_pushes(1, quick, r as u64)?);
        k2.push(measure_pushes(2, quick, r as u64)?);
    }
    let med = |v: &[PushFigures], f: &dyn Fn(&PushFigures) -> f64| median(&mut v.iter().map(f).collect::<Vec<_>>());
    let ratios_of = |k: &[PushFigures], f: &dyn Fn(&PushFigures) -> f64| median(&mut k0.iter().zip(k).map(|(a, b)| f(b) / f(a)).collect::<Vec<_>>());
    let ratios = |f: &dyn Fn(&PushFigures) -> f64| ratios_of(&k1, f);
    let mut records = Vec::new();
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get()) as f64;
    for (i, &(keys, len)) in BATCHES.iter().enumerate() {
        let f = |p: &PushFigures| p.batched[i];
        // The work a backup adds, as CPU time per batch against none; and the best ratio this
        // host's cores allow for that work: k = 0's time per batch against k = 1's CPU time
        // spread over every core (the three nodes share them).
        let cpu = |p: &PushFigures| p.batched_cpu_s[i];
        let (cpu_k0, cpu_k1) = (med(&k0, &cpu), med(&k1, &cpu));
        let cpu_ratio = if cpu_k0 > 0.0 { cpu_k1 / cpu_k0 } else { 0.0 };
        let bound = if cpu_k1 > 0.0 { (cores * keys as f64 / med(&k0, &f) / cpu_k1).min(1.0) } else { 0.0 };
        records.push(record(
            "backup_push",
            json!({"nodes": 3, "keys": keys, "value_len": len, "remote": true, "repeats": repeats}),
            json!({"keys_per_s_k1": med(&k1, &f), "keys_per_s_k0": med(&k0, &f), "ratio_median": ratios(&f), "keys_per_s_k2": med(&k2, &f), "ratio_k2_median": ratios_of(&k2, &f), "cpu_ms_per_batch_k0": cpu_k0 * 1e3, "cpu_ms_per_batch_k1": cpu_k1 * 1e3, "cpu_ratio": cpu_ratio, "cores": cores, "ratio_bound_here": bound, "push_bytes_per_key": med(&k1, &|p| p.push_bytes_per_key[i]), "backup_bytes_per_key": med(&k1, &|p| p.backup_bytes_per_key[i])}),
            "keys_per_s_k1",
            "k0",
            med(&k0, &f),
            Better::Higher,
            if len == 100 { ("ratio>=", 0.5) } else { ("", 0.0) },
        ));
    }
    let config = json!({"nodes": 3, "keys": 1, "value_len": 1, "remote": true, "repeats": repeats});
    records.push(record(
        "backup_push_latency",
        config,
        json!({"p50_us_k1": med(&k1, &|f| f.single_p50_us), "p50_us_k0": med(&k0, &|f| f.single_p50_us), "ratio_median": ratios(&|f| f.single_p50_us), "pushes_per_s_k1": med(&k1, &|f| f.single), "pushes_per_s_k0": med(&k0, &|f| f.single), "p50_us_k2": med(&k2, &|f| f.single_p50_us), "ratio_k2_median": ratios_of(&k2, &|f| f.single_p50_us)}),
        "p50_us_k1",
        "k0",
        med(&k0, &|f| f.single_p50_us),
        Better::Lower,
        ("", 0.0),
    ));
    Ok(records)
}

/// Runs `trials` failover trials; the record's figures are the p50 and p99 in seconds.
fn failover_trials(trials: usize) -> Result<crate::report::Record> {
    let exe = std::env::current_exe().context("locating ferry-bench")?;
    let (mut serve, mut detect, mut join) = (Vec::new(), Vec::new(), Vec::new());
    let transport: Arc<Mutex<String>> = Arc::default();
    for trial in 0..trials {
        let dir = std::env::temp_dir().join(format!("ferry-bench-failover-{}-{trial}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut spec = LaunchSpec::new(3, exe.clone(), vec!["failover".into(), "--trial-dir".into(), dir.display().to_string()]);
        // The survivors go on after the victim dies.
        spec.grace = Duration::from_secs(120);
        spec.timeout = Some(Duration::from_secs(120));
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let (sink, seen) = (lines.clone(), transport.clone());
        let outcome = launch(&spec, move |rank, stream, line| {
            if rank == PULLER && stream == Stream::Stdout && (line.starts_with("FAILOVER ") || line.starts_with("JOINED ")) {
                sink.lock().push(line.to_string());
            } else if let Some(name) = line.strip_prefix("transport: ") {
                // Once per run is enough.
                if trial == 0 {
                    eprintln!("{line}");
                }
                *seen.lock() = name.to_string();
            } else if !line.contains("peer lost") && !line.contains("took over") && !line.contains("WARN") {
                eprintln!("[trial {trial} rank {rank}] {line}");
            }
        })?;
        let _ = std::fs::remove_dir_all(&dir);
        let survivors_ok = outcome.statuses.iter().enumerate().filter(|&(r, _)| r != VICTIM).all(|(_, s)| s.is_some_and(|s| s.success()));
        if !survivors_ok || outcome.interrupted.is_some() {
            bail!("failover trial {trial}: the survivors did not finish cleanly ({:?})", outcome.statuses);
        }
        let reported = |tag: &str| -> Result<serde_json::Value> {
            let line = lines.lock().iter().find_map(|l| l.strip_prefix(tag).map(str::to_string));
            let line = line.with_context(|| format!("failover trial {trial}: rank {PULLER} reported no {tag}line"))?;
            Ok(serde_json::from_str(&line)?)
        };
        let v = reported("FAILOVER ")?;
        serve.push(v["serve_s"].as_f64().context("serve_s")?);
        detect.push(v["detect_s"].as_f64().context("detect_s")?);
        join.push(reported("JOINED ")?["join_s"].as_f64().context("join_s")?);
    }
    let pct = crate::micro::percentile;
    let (p50, p99) = (pct(&mut serve, 0.5), pct(&mut serve, 0.99));
    // The liveness timeout the nodes ran with (the environment's, else the default).
    let mut config = Config::new(Vec::new());
    config.apply_timeout_env(|name| std::env::var(name).ok())?;
    let peer_timeout_s = config.peer_timeout.as_secs_f64();
    let (d50, d99) = (pct(&mut detect, 0.5), pct(&mut detect, 0.99));

    let figures = json!({
        "p50_s": p50, "p99_s": p99, "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3,
        "detect_p50_ms": d50 * 1e3, "detect_p99_ms": d99 * 1e3,
        "join_p50_ms": pct(&mut join, 0.5) * 1e3, "join_p99_ms": pct(&mut join, 0.99) * 1e3,
    });
    Ok(record(
        "failover",
        json!({"nodes": 3, "backups": 1, "transport": *transport.lock(), "killed": "kill -9", "trials": trials, "peer_timeout_s": peer_timeout_s}),
        figures,
        "p99_s",
        "1 s",
        1.0,
        Better::Lower,
        ("<=", 1.0),
    ))
}

/// One node of a failover trial (see the module documentation).
fn trial_node(dir: &Path) -> Result<()> {
    let mut config = Config::from_env(vec![TableSpec::new("f", FAILOVER_KEYS, FAILOVER_LEN)])?;
    config.relocation = false;
    config.backups = 1;
    let joining = config.join.is_some();
    let started = Instant::now();
    let node = Node::start(config)?;
    if node.nodes() != 3 {
        bail!("a failover trial runs on exactly 3 nodes");
    }
    if joining {
        return joined_node(dir, node, started.elapsed());
    }
    let rank = node.rank();
    if rank == PULLER {
        eprintln!("transport: {}", node.transport());
    }
    let table = node.table("f")?;
    let mut w = node.worker();
    let all: Vec<u64> = (0..FAILOVER_KEYS).collect();
    let ones = vec![1.0f32; all.len() * FAILOVER_LEN];
    for _ in 0..PUSH_ROUNDS {
        w.push(table, &all, &ones)?;
    }
    w.barrier()?;
    let victims: Vec<u64> = (0..PULLED as u64).map(|i| FAILOVER_KEYS / 3 + i).collect();
    let done = dir.join("done");
    match rank {
        VICTIM => {
            let pause = ChaCha8Rng::from_entropy().gen_range(10..60);
            std::thread::sleep(Duration::from_millis(pause));
            std::fs::write(dir.join("killed"), node.cluster_time_ns().to_string())?;
            let status = std::process::Command::new("sh").arg("-c").arg(format!("kill -9 {}", std::process::id())).status()?;
            bail!("kill -9 of this process did not kill it ({status})");
        }
        PULLER => {
            let mut out = vec![0.0f32; PULLED * FAILOVER_LEN];
            let mut lost_at = None;
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                // The loss is seen through a failed pull, or (learnt between two pulls) in the
                // node's list of lost nodes.
                if lost_at.is_none() && !node.lost_nodes().is_empty() {
                    lost_at = Some(node.cluster_time_ns());
                }
                match w.pull(table, &victims, &mut out) {
                    Ok(()) if lost_at.is_some() => break,
                    Ok(()) => {}
                    Err(_) if Instant::now() < deadline => {
                        lost_at.get_or_insert_with(|| node.cluster_time_ns());
                    }
                    Err(e) => return Err(e).context("the victim's keys were not served again within 60 s"),
                }
            }
            let served_at = node.cluster_time_ns();
            let expected = (3 * PUSH_ROUNDS) as f32;
            if let Some(bad) = out.iter().find(|&&v| v != expected) {
                bail!("after failover a key holds {bad}, not the {expected} every acknowledged push made");
            }
            let killed_file = dir.join("killed");
            let killed: u64 = std::fs::read_to_string(&killed_file).with_context(|| format!("reading {}", killed_file.display()))?.trim().parse()?;
            let lost_at = lost_at.unwrap_or(served_at);
            let secs = |at: u64| at.saturating_sub(killed) as f64 / 1e9;
            println!("FAILOVER {}", json!({"detect_s": secs(lost_at), "serve_s": secs(served_at)}));
            let joiner = start_joiner(dir)?;
            wait_for(&dir.join("joined"), "the node that joins")?;
            w.barrier().context("a barrier with the node that joined")?;
            std::fs::write(&done, "")?;
            let outcome = joiner.join().map_err(|_| anyhow::anyhow!("the joiner's launch panicked"))??;
            if !outcome.success() {
                bail!("the node that joined failed: {}", crate::cluster::failure_summary(&outcome));
            }
        }
        _ => {
            wait_for(&dir.join("joined"), "the node that joins")?;
            w.barrier().context("a barrier with the node that joined")?;
            wait_for(&done, &format!("rank {PULLER}"))?;
        }
    }
    drop(w);
    node.abort();
    Ok(())
}

/// Waits for `file` to exist, written by `who`, at most 90 s.
fn wait_for(file: &Path, who: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !file.exists() {
        if Instant::now() >= deadline {
            bail!("{who} did not write {} in 90 s", file.display());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Starts a fresh process of this trial in the victim's rank, as `ferry launch --join` does;
/// its JOINED line is passed on to this rank's output.
fn start_joiner(dir: &Path) -> Result<std::thread::JoinHandle<Result<ferry::launch::LaunchOutcome>>> {
    let exe = std::env::current_exe().context("locating ferry-bench")?;
    let mut spec = LaunchSpec::new(3, exe, vec!["failover".into(), "--trial-dir".into(), dir.display().to_string()]);
    spec.coordinator = Some(std::env::var("FERRY_COORDINATOR").context("FERRY_COORDINATOR of the trial")?);
    spec.join = Some(VICTIM);
    spec.grace = Duration::from_secs(60);
    spec.timeout = Some(Duration::from_secs(90));
    Ok(std::thread::spawn(move || {
        let outcome = launch(&spec, |_, stream, line| match stream {
            Stream::Stdout => println!("{line}"),
            Stream::Stderr => eprintln!("[joining] {line}"),
        })?;
        Ok(outcome)
    }))
}

/// The node that joined in the victim's rank: it must hold the victim's share again and read
/// every acknowledged push; then it passes a barrier with the survivors.
fn joined_node(dir: &Path, node: Node, took: Duration) -> Result<()> {
    let table = node.table("f")?;
    let mut held = 0u64;
    for key in 0..FAILOVER_KEYS {
        held += u64::from(node.slot_address(table, key)?.is_some());
    }
    if held * 3 < FAILOVER_KEYS * 9 / 10 {
        bail!("the node that joined holds {held} of {FAILOVER_KEYS} keys, not its share");
    }
    let mut w = node.worker();
    let all: Vec<u64> = (0..FAILOVER_KEYS).collect();
    let mut out = vec![0.0f32; all.len() * FAILOVER_LEN];
    w.pull(table, &all, &mut out)?;
    let expected = (3 * PUSH_ROUNDS) as f32;
    if let Some(bad) = out.iter().find(|&&v| v != expected) {
        bail!("after the join a key holds {bad}, not the {expected} every acknowledged push made");
    }
    println!("JOINED {}", json!({"join_s": took.as_secs_f64(), "keys_held": held}));
    std::fs::write(dir.join("joined"), "")?;
    w.barrier().context("a barrier with the survivors")?;
    wait_for(&dir.join("done"), &format!("rank {PULLER}"))?;
    drop(w);
    node.abort();
    Ok(())
}
