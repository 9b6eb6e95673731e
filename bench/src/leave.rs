//! `ferry-bench failover --only leave`: the pause workers see while a node leaves gracefully,
//! and while a fresh node joins in its rank.
//!
//! Per trial, four nodes in this process (over loopback TCP, or verbs with
//! `FERRY_TRANSPORT=verbs`), a classic parameter server with one backup per key: the workers of
//! ranks 0, 1 and 3 push batches of random keys of every node in a loop, each push's latency
//! recorded, while rank 2 leaves (`Node::leave`) a while in. The hand-over lasts from the call
//! until every other node has taken the leave in (the call itself returns later: it closes
//! connections and joins threads). The pause is the longest push that overlapped the
//! hand-over; the baseline is the p99 of the pushes that ended before it began, in the same
//! trial. A while after the leave, a fresh node joins in rank 2 (`Node::join`, through rank 0)
//! as the workers go on: the join's pause is the longest push that overlapped the call, which
//! returns once every member counts the node; the keys rank 3 handed back are the share that
//! moved. After the trial every key is pulled and must hold exactly the pushes the workers
//! made: neither the leave nor the join loses anything.
//!
//! With relocation (`--only leave-localize`) the workers localize one batch in eight before
//! pushing it, and the leaver took a share of the other homes' keys before the trial, so it
//! gives them back as it leaves (`protocol::leave`); no node joins (a cluster that relocates
//! keys takes no joins yet), and every push must be on the three nodes left.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry::{Config, Node, TableSpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use crate::micro::percentile;
use crate::report::{Better, record};

const NODES: usize = 4;
const LEAVER: usize = 2;
const KEYS: u64 = 40_000;
const VALUE_LEN: usize = 8;
const BATCH: usize = 64;

/// What a pushing worker made: pushes per key, and each push's start and end.
type Pushed = (Vec<u32>, Vec<(Instant, Instant)>);

/// What one trial measured.
struct Trial {
    /// The longest push that overlapped the leave (ms).
    pause_ms: f64,
    /// p99 of the pushes that ended before the leave began (ms).
    baseline_p99_ms: f64,
    /// From the call of `Node::leave` until every other node had taken the leave in (ms).
    handover_ms: f64,
    /// How long `Node::leave` took, its threads joined and connections closed (ms).
    leave_ms: f64,
    /// Keys the successor adopted.
    handed_over: u64,
    /// Keys the leaver gave back to their homes (with relocation).
    given_back: u64,
    /// The join after the leave, without relocation.
    join: Option<JoinFigures>,
}

/// What the join after a leave measured.
struct JoinFigures {
    /// The longest push that overlapped the join (ms).
    pause_ms: f64,
    /// How long `Node::join` took (ms).
    call_ms: f64,
    /// Keys handed to the joined node.
    keys: u64,
}

/// Runs `trials` leave trials (in a cluster that relocates keys with `relocation`); the
/// record's headline is the p99 over trials of the pause.
pub fn leave_trials(trials: usize, quick: bool, relocation: bool) -> Result<crate::report::Record> {
    let mut runs = Vec::new();
    let mut transport = String::new();
    let backups = Config::from_env(vec![TableSpec::new("l", KEYS, VALUE_LEN)])?.backups.max(1);
    for trial in 0..trials {
        let (t, name) = leave_trial(trial as u64, quick, relocation).with_context(|| format!("leave trial {trial}"))?;
        if trial == 0 {
            eprintln!("transport: {name}");
        }
        transport = name;
        runs.push(t);
    }
    let pct = |f: &dyn Fn(&Trial) -> f64, q: f64| percentile(&mut runs.iter().map(f).collect::<Vec<_>>(), q);
    let baseline = pct(&|t| t.baseline_p99_ms, 0.5);
    let mut figures = json!({
            "pause_p50_ms": pct(&|t| t.pause_ms, 0.5),
            "pause_p99_ms": pct(&|t| t.pause_ms, 0.99),
            "baseline_push_p99_ms": baseline,
            "handover_p50_ms": pct(&|t| t.handover_ms, 0.5),
            "handover_p99_ms": pct(&|t| t.handover_ms, 0.99),
            "leave_call_p50_ms": pct(&|t| t.leave_ms, 0.5),
            "keys_handed_over": pct(&|t| t.handed_over as f64, 0.5),
            "lost_pushes": 0,
    });
    if relocation {
        figures["keys_given_back"] = json!(pct(&|t| t.given_back as f64, 0.5));
    } else {
        let join = |f: &dyn Fn(&JoinFigures) -> f64, q: f64| pct(&|t| t.join.as_ref().map_or(0.0, f), q);
        figures["join_pause_p50_ms"] = json!(join(&|j| j.pause_ms, 0.5));
        figures["join_pause_p99_ms"] = json!(join(&|j| j.pause_ms, 0.99));
        figures["join_call_p50_ms"] = json!(join(&|j| j.call_ms, 0.5));
        figures["join_call_p99_ms"] = json!(join(&|j| j.call_ms, 0.99));
        figures["keys_moved_by_join_vs_quarter"] = json!(join(&|j| j.keys as f64, 0.5) / (KEYS as f64 / NODES as f64));
    }
    Ok(record(
        if relocation { "leave-localize" } else { "leave" },
        json!({"nodes": NODES, "backups": backups, "transport": transport, "keys": KEYS, "value_len": VALUE_LEN, "batch": BATCH, "trials": trials, "relocation": relocation}),
        figures,
        "pause_p99_ms",
        "push p99",
        baseline,
        Better::Lower,
        ("", 0.0),
    ))
}

/// One trial (see the module documentation); also returns the transport's name.
fn leave_trial(seed: u64, quick: bool, relocation: bool) -> Result<(Trial, String)> {
    let mut config = Config::from_env(vec![TableSpec::new("l", KEYS, VALUE_LEN)])?;
    config.relocation = relocation;
    // One backup per key unless FERRY_BACKUPS asks for more.
    config.backups = config.backups.max(1);
    if config.membership.secret.is_none() && !config.no_secret {
        // The node that joins later must hold the cluster's secret.
        config.membership.secret = Some(ferry::generate_secret().into_bytes());
    }
    let mut cluster = Node::start_local_cluster(NODES, config.clone())?;
    let transport = cluster[0].transport().to_string();
    let table = cluster[0].table("l")?;
    if relocation {
        // The leaver holds keys of every home when it goes.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x1eae);
        let mut taken: Vec<u64> = (0..KEYS / 8).map(|_| rng.gen_range(0..KEYS)).collect();
        taken.sort_unstable();
        taken.dedup();
        cluster[LEAVER].worker().localize(table, &taken)?;
    }
    let mut leaver = cluster.remove(LEAVER);
    let before = Duration::from_millis(if quick { 150 } else { 300 });
    let after = Duration::from_millis(if quick { 150 } else { 300 });
    // Pushes done: the leave waits for a baseline of pushes (a loaded machine is slow to
    // start), and the pushers go on for `after` once it was handed over.
    let pushed = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let outcome = std::thread::scope(|s| -> Result<_> {
        let mut pushers = Vec::new();
        for (i, node) in cluster.iter().enumerate() {
            let mut w = node.worker();
            let (pushed, stop) = (&pushed, &stop);
            pushers.push(s.spawn(move || -> Result<Pushed> {
                let mut rng = ChaCha8Rng::seed_from_u64(seed * 16 + i as u64);
                let mut counts = vec![0u32; KEYS as usize];
                let mut spans = Vec::new();
                let ones = vec![1.0f32; BATCH * VALUE_LEN];
                let mut batches = 0usize;
                while !stop.load(Ordering::Acquire) {
                    let keys: Vec<u64> = (0..BATCH).map(|_| rng.gen_range(0..KEYS)).collect();
                    let t = Instant::now();
                    batches += 1;
                    if relocation && batches.is_multiple_of(8) {
                        let mut distinct = keys.clone();
                        distinct.sort_unstable();
                        distinct.dedup();
                        w.localize(table, &distinct)?;
                    }
                    w.push(table, &keys, &ones)?;
                    spans.push((t, Instant::now()));
                    pushed.fetch_add(1, Ordering::Relaxed);
                    for k in keys {
                        counts[k as usize] += 1;
                    }
                }
                Ok((counts, spans))
            }));
        }
        let started = Instant::now();
        while started.elapsed() < before || pushed.load(Ordering::Relaxed) < 100 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let began = Instant::now();
        let leaving = s.spawn(|| leaver.leave().map(|()| Instant::now()));
        // Handed over once every other node took the leave in.
        while !cluster.iter().all(|n| n.lost_nodes().iter().any(|(r, _)| *r == LEAVER)) && !leaving.is_finished() {
            std::thread::sleep(Duration::from_micros(100));
        }
        let handed = Instant::now();
        let ended = leaving.join().expect("the leaver panicked").context("leaving")?;
        std::thread::sleep(after.saturating_sub(handed.elapsed()));
        if relocation {
            stop.store(true, Ordering::Release);
            let results: Vec<_> = pushers.into_iter().map(|p| p.join().expect("a pusher panicked")).collect::<Result<_>>()?;
            return Ok((results, (began, handed, ended), None));
        }
        let mut joining = config.clone();
        joining.rank = LEAVER;
        joining.nodes = NODES;
        let contact = cluster[0].join_addresses().first().context("rank 0 takes no joins")?.to_string();
        let join_began = Instant::now();
        let joined = Node::join(joining, &contact).context("joining in the leaver's rank")?;
        let join_ended = Instant::now();
        std::thread::sleep(after);
        stop.store(true, Ordering::Release);
        let results: Vec<_> = pushers.into_iter().map(|p| p.join().expect("a pusher panicked")).collect::<Result<_>>()?;
        Ok((results, (began, handed, ended), Some((join_began, join_ended, joined))))
    });
    // A request that reached the leaver after a peer's READY breaks the cut (see
    // `protocol::leave`): said with whatever else went wrong, and a failure by itself.
    let late = leaver.stats().backups.requests_after_ready;
    let (results, leave_span, join) = outcome.with_context(|| format!("the leaver got {late} requests after a peer's READY"))?;
    if late > 0 {
        bail!("the leaver got {late} requests after a peer's READY");
    }
    let (began, handed, ended) = leave_span;
    let join_span = join.as_ref().map(|&(b, e, _)| (b, e));
    let mut expected = vec![0u32; KEYS as usize];
    let (mut baseline, mut pause, mut join_pause) = (Vec::new(), 0.0f64, 0.0f64);
    for (counts, spans) in &results {
        for (e, c) in expected.iter_mut().zip(counts) {
            *e += c;
        }
        for &(from, to) in spans {
            let ms = (to - from).as_secs_f64() * 1e3;
            if to < began {
                baseline.push(ms);
            } else if from <= handed {
                pause = pause.max(ms);
            }
            if let Some((join_began, join_ended)) = join_span
                && to >= join_began
                && from <= join_ended
            {
                join_pause = join_pause.max(ms);
            }
        }
    }
    if baseline.is_empty() {
        bail!("no push ended before the leave began");
    }
    let baseline_p99_ms = percentile(&mut baseline, 0.99);
    let handed_over = cluster.iter().map(|n| n.stats().backups.keys_adopted).sum();
    let given_back = leaver.stats().backups.keys_given_back;
    let joined_keys = cluster.iter().map(|n| n.stats().backups.keys_handed).sum();
    let join = join.map(|(join_began, join_ended, joined)| {
        cluster.insert(LEAVER, joined);
        JoinFigures { pause_ms: join_pause, call_ms: (join_ended - join_began).as_secs_f64() * 1e3, keys: joined_keys }
    });
    // Every push made is there, on the four nodes (the joined one included), or on the
    // three left.
    let all: Vec<u64> = (0..KEYS).collect();
    let mut out = vec![0.0f32; all.len() * VALUE_LEN];
    cluster[0].worker().pull(table, &all, &mut out)?;
    let lost: u64 = expected.iter().enumerate().map(|(k, &e)| (e as f64 - out[k * VALUE_LEN] as f64).abs() as u64).sum();
    if lost > 0 {
        bail!("{lost} pushes are missing (or extra) after the leave{}", if join.is_some() { " and the join" } else { "" });
    }
    if relocation && given_back == 0 {
        bail!("the leaver gave no key back (it took keys of every home before it left)");
    }
    crate::failover::finish(cluster);
    let ms = |to: Instant| (to - began).as_secs_f64() * 1e3;
    Ok((Trial { pause_ms: pause, baseline_p99_ms, handover_ms: ms(handed), leave_ms: ms(ended), handed_over, given_back, join }, transport))
}
