//! A cluster node for Ferry's multi-process tests, started through `ferry launch`.
//!
//! * `sums`: every worker of every node pushes known increments to random keys (local and
//!   remote, optionally asynchronously and with relocations in flight); after a barrier, rank 0
//!   pulls every key and compares it with the exact expected sum.
//! * `history`: workers run a conflict-heavy mix of pull, push, set and localize on few keys,
//!   recording every operation; rank 0 gathers the histories (files in `--dir`) and runs the
//!   per-key sequential-consistency checker.
//! * `crash`: the last rank dies in the middle of relocations; the others must see their
//!   operations fail with the loss's error (the node, a key it held, or a timeout; never a
//!   protocol error, never a hang) and then shut down.
//! * `send-failure`: rank 0's sends to rank 1 fail after a number of sends (injected: a failing
//!   `sendmsg` over TCP, a failing post over verbs); rank 0's operations end in errors and rank 1
//!   sees rank 0 lost — nobody hangs.
//! * `writes-queued`: rank 1 localizes every key of rank 0 and dies while the values are still
//!   being written to it; rank 0's operations towards rank 1 fail, and every slot of a key that
//!   left is freed once its write failed or completed.
//! * `stalled-reader`: over TCP, rank 1 stops reading (its heartbeats go on) while rank 0's
//!   worker floods it with asynchronous pushes: rank 0 must declare it lost within the liveness
//!   timeout, with the send queue held to its limit meanwhile (backpressure), and report how
//!   much its resident memory grew.
//! * `stopped`: the last of three ranks is stopped (SIGSTOP, continued 6 s later): the
//!   survivors' operations and barrier fail naming it — not each other — and they go on working
//!   with each other.
//! * `replicas`: every node pushes into its own lanes of replicated keys while pulling them,
//!   recording times on the host's monotonic clock; rank 0 checks the bounded-staleness
//!   guarantee on the gathered history and the exact sums after a barrier, and every rank
//!   reports how many one-sided reads its refreshes issued.
//! * `intent-history`: workers of every node declare random intents on few keys (so that keys
//!   move to one node, are replicated on several, and are dropped again), push into lanes of
//!   their own, pull and localize explicitly, recording times on the host's monotonic clock;
//!   rank 0 checks every pull against the guarantee for keys under intent (its own node's
//!   pushes, each push at most once, other nodes' within a bound) and the exact sums after a
//!   barrier.
//! * `intent-crash`: one of three ranks (the last, or `--victim`) dies while the keys its
//!   workers and the others' declare are moving and replicated under intent; the survivors'
//!   workers go on declaring,
//!   pushing and pulling: operations that needed the lost node fail with an error naming it
//!   (or a key it held; a timeout fails the test),
//!   none hangs, no pull returns a push twice or one its worker has not made yet, and the
//!   survivors' intent services stop (`finalize`) without hanging.

use std::path::PathBuf;
use std::time::{Duration, Instant};

// A retaining allocator: large per-operation buffers are reused instead of being mapped and
// faulted in again on every bulk operation.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use anyhow::{Context, Result, bail, ensure};
use clap::{Parser, Subcommand};
use ferry::testing::consistency::{Event, History, push_update, set_value};
use ferry::{Config, Node, Partitioning, TableSpec, Worker};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    Sums {
        #[arg(long, default_value_t = 3)]
        workers: usize,
        #[arg(long, default_value_t = 200)]
        keys: u64,
        #[arg(long, default_value_t = 4)]
        value_len: usize,
        #[arg(long, default_value_t = 300)]
        rounds: usize,
        #[arg(long)]
        relocate: bool,
        #[arg(long)]
        asynchronous: bool,
        #[arg(long)]
        hash: bool,
    },
    History {
        #[arg(long, default_value_t = 2)]
        workers: usize,
        #[arg(long, default_value_t = 4)]
        keys: u64,
        #[arg(long, default_value_t = 150)]
        ops: usize,
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    Crash {
        #[arg(long, default_value_t = 2)]
        workers: usize,
    },
    SendFailure {
        #[arg(long, default_value_t = 200)]
        after: u64,
    },
    WritesQueued {
        #[arg(long, default_value_t = 20_000)]
        keys: u64,
    },
    Stopped,
    StalledReader {
        /// The send-queue limit, MiB.
        #[arg(long, default_value_t = 16)]
        limit_mib: usize,
    },
    Replicas {
        #[arg(long, default_value_t = 25)]
        pushes: u32,
        #[arg(long)]
        dir: PathBuf,
    },
    /// Server-side AdaGrad, push-pull and bounded-delay clocks across processes.
    Toolbox {
        #[arg(long, default_value_t = 24)]
        clocks: u64,
    },
    /// Intent signalling across processes: keys follow the declared windows.
    Intent {
        #[arg(long, default_value_t = 30)]
        clocks: u64,
    },
    /// Random intents with pushes, pulls and explicit localizes, checked per pull.
    IntentHistory {
        #[arg(long, default_value_t = 2)]
        workers: usize,
        #[arg(long, default_value_t = 16)]
        keys: u64,
        #[arg(long, default_value_t = 40)]
        clocks: u64,
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Random intents while a rank (the last, or `--victim`) dies: errors, no hang, no push
    /// twice.
    IntentCrash {
        #[arg(long, default_value_t = 2)]
        workers: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// The rank that dies (default: the last).
        #[arg(long)]
        victim: Option<usize>,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().scenario {
        Scenario::Sums { workers, keys, value_len, rounds, relocate, asynchronous, hash } => {
            sums(workers, keys, value_len, rounds, relocate, asynchronous, hash)
        }
        Scenario::History { workers, keys, ops, dir, seed } => history(workers, keys, ops, &dir, seed),
        Scenario::Crash { workers } => crash(workers),
        Scenario::SendFailure { after } => send_failure(after),
        Scenario::WritesQueued { keys } => writes_queued(keys),
        Scenario::Stopped => stopped(),
        Scenario::StalledReader { limit_mib } => stalled_reader(limit_mib),
        Scenario::Replicas { pushes, dir } => replicas(pushes, &dir),
        Scenario::Toolbox { clocks } => toolbox(clocks),
        Scenario::Intent { clocks } => intent(clocks),
        Scenario::IntentHistory { workers, keys, clocks, dir, seed } => intent_history(workers, keys, clocks, &dir, seed),
        Scenario::IntentCrash { workers, seed, victim } => intent_crash(workers, seed, victim),
    }
}

/// Intent signalling across two processes: in clock `c` rank `r` needs the keys `k` with
/// `k % 2 == (c + r) % 2` and declares each clock's keys two clocks ahead; both push to every
/// key every clock. The keys must follow the windows (relocated or replicated by the intent
/// service, as the homes grant), the late accesses must stay a minority, and no push may be
/// lost or doubled. Then both need every key for a few clocks (replicas on both sides, kept in
/// sync through the holders' images).
fn intent(clocks: u64) -> Result<()> {
    const KEYS: u64 = 64;
    let spec = TableSpec::new("t", KEYS, 2).partitioned(Partitioning::Hash);
    let mut config = Config::from_env(vec![spec])?;
    config.max_delay = Some(0);
    // A key is needed every other clock here: bridging one-clock gaps (the default bridges up
    // to 4) would make both ranks need every key throughout, and the keys would only be
    // replicated, never handed over. Likewise on a table whose keys the homes had this node
    // share (the shared phase below, and the hand-overs' overlaps).
    config.intent.gap = 0;
    config.intent.shared_gap = 0;
    let mut node = Node::start(config)?;
    println!("transport {}", node.transport());
    let rank = node.rank() as u64;
    let table = node.table("t")?;
    let needed = |c: u64| -> Vec<u64> { (0..KEYS).filter(|k| k % 2 == (c + rank) % 2).collect() };
    let mut w = node.worker();
    for c in 0..2 {
        w.intent(table, &needed(c), c, c + 1)?;
    }
    let before = node.stats();
    for c in 0..clocks {
        w.intent(table, &needed(c + 2), c + 2, c + 3)?;
        // The other rank used these keys until the clock began: the hand-over starts only
        // now (the homes grant a key to the one node that needs it now), so the worker gives
        // it a moment, as a trainer computing its next batch would.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let keys = needed(c);
        let mut out = vec![0.0f32; keys.len() * 2];
        w.pull(table, &keys, &mut out)?;
        w.push(table, &(0..KEYS).collect::<Vec<_>>(), &vec![1.0; KEYS as usize * 2])?;
        w.advance_clock()?;
    }
    w.barrier()?;
    let mut out = vec![0.0f32; KEYS as usize * 2];
    w.pull(table, &(0..KEYS).collect::<Vec<_>>(), &mut out)?;
    let s = node.stats().since(&before);
    if let Some(v) = out.iter().find(|&&v| v != 2.0 * clocks as f32) {
        let wrong: Vec<String> =
            out.chunks_exact(2).enumerate().filter(|(_, p)| p.iter().any(|&v| v != 2.0 * clocks as f32)).map(|(k, p)| format!("{k}: {p:?}")).collect();
        anyhow::bail!("a key holds {v}, expected {} (a push lost or doubled); keys {}; {:?}", 2 * clocks, wrong.join(", "), s.intent);
    }
    // Accesses within declared windows: the pull and the push of the clock's keys.
    let declared = clocks * KEYS;
    // Each rank needs every key within a few clocks: keys move to the rank that needs them
    // alone, and ranks that intend a key together keep replicas of it. A replica kept across
    // clocks needs no new action, so how many actions there are varies with timing: in the
    // emulated verbs guest a fifth of the runs made 350–480 for the 960 keys needed per rank
    // (over TCP, near 1 200); an eighth of the needs shows that intent acted.
    if s.relocations_in + s.intent.replicas_made < clocks * KEYS / 8 || s.intent.acted_keys + s.intent.replicas_made == 0 {
        anyhow::bail!("intent moved only {} keys here and replicated {}: {:?}", s.relocations_in, s.intent.replicas_made, s.intent);
    }
    if s.intent.late_accesses * 2 > declared {
        anyhow::bail!("{} of {declared} accesses in a declared window were late", s.intent.late_accesses);
    }
    // Both ranks have read the sums before either pushes again: a barrier orders every push
    // made before it ahead of the reads after it, not the other rank's later pushes (a rank
    // whose intent service holds its barrier longer read them otherwise: "a key holds 61").
    w.barrier()?;
    // Then both ranks need every key at once for a while: each keeps replicas of the keys the
    // other holds, and their sync rounds send the deltas to the holder and refresh from the
    // images it cuts with one-sided reads (RDMA READs over verbs).
    const SHARED: u64 = 15;
    let all: Vec<u64> = (0..KEYS).collect();
    let start = clocks;
    for c in start..start + 2 {
        w.intent(table, &all, c, c + 1)?;
    }
    let before_shared = node.stats();
    for c in start..start + SHARED {
        if c + 2 < start + SHARED {
            w.intent(table, &all, c + 2, c + 3)?;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        w.pull(table, &all, &mut out)?;
        w.push(table, &all, &vec![1.0; KEYS as usize * 2])?;
        w.advance_clock()?;
    }
    w.barrier()?;
    w.pull(table, &all, &mut out)?;
    let expected = 2.0 * (clocks + SHARED) as f32;
    if let Some(v) = out.iter().find(|&&v| v != expected) {
        anyhow::bail!("after the shared clocks a key holds {v}, expected {expected} (a push lost or doubled)");
    }
    let shared = node.stats().since(&before_shared).intent;
    w.barrier()?;
    drop(w);
    node.finalize()?;
    println!(
        "intent ok ({} relocations in, {} replicas made, {} of {declared} accesses late, mean lead {:.1} clocks)",
        s.relocations_in,
        s.intent.replicas_made,
        s.intent.late_accesses,
        s.intent.mean_lead()
    );
    println!(
        "shared keys: {} replicas made, {} refreshed by {} one-sided reads, {} synced through push-pulls",
        shared.replicas_made, shared.refreshed_by_read, shared.refresh_reads, shared.synced_by_push_pull
    );
    Ok(())
}

/// The toolbox across two processes: rank `r` alone pushes the gradients of keys `k % 2 == r`
/// to a table with a server-side AdaGrad, and the keys move back and forth between the nodes
/// meanwhile (relocations carry the optimizer state: one one-sided write of the slot); every
/// clock one push is a push-pull, whose value is checked at once; clocks keep a delay bound of 1.
/// At the end both ranks check every key against a local AdaGrad run of the same gradients.
fn toolbox(clocks: u64) -> Result<()> {
    const KEYS: u64 = 64;
    const DIM: usize = 4;
    let (lr, eps, init) = (0.3f32, 1e-6f32, 0.1f32);
    let spec = TableSpec::new("t", KEYS, DIM).partitioned(Partitioning::Hash).with_updater(ferry::Updater::Adagrad { lr, eps, init });
    // Counts with bf16 values and key caching: small integers are exact in bf16.
    let counts = TableSpec::new("c", KEYS, DIM).partitioned(Partitioning::Hash).compressed(ferry::ValueCodec::Bf16).cache_keys(4);
    let mut config = Config::from_env(vec![spec, counts])?;
    config.max_delay = Some(1);
    let mut node = Node::start(config)?;
    println!("transport {}", node.transport());
    let rank = node.rank();
    let table = node.table("t")?;
    let counts = node.table("c")?;
    let scattered: Vec<u64> = (0..KEYS).filter(|k| k % 3 != 0).collect();
    let gradient = |c: u64, k: u64, j: usize| ((c * 31 + k * 7 + j as u64 * 3) % 13) as f32 / 6.0 - 1.0;
    // The reference: each key's gradients in its pusher's order.
    let reference = |k: u64, upto: u64| -> Vec<f32> {
        let (mut x, mut h) = ([0.0f32; DIM], [init; DIM]);
        for c in 0..upto {
            for j in 0..DIM {
                let g = gradient(c, k, j);
                h[j] += g * g;
                x[j] -= lr * g / (h[j].sqrt() + eps);
            }
        }
        x.to_vec()
    };
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4 * (1.0 + y.abs()));
    let mine: Vec<u64> = (0..KEYS).filter(|k| k % 2 == rank as u64).collect();
    let theirs: Vec<u64> = (0..KEYS).filter(|k| k % 2 != rank as u64).collect();
    let mut w = node.worker();
    for c in 0..clocks {
        // Keys move every clock: here, or over to the node that does not push them.
        w.localize(table, if c % 2 == 0 { &mine } else { &theirs })?;
        let (probe, rest) = mine.split_at(1);
        let updates: Vec<f32> = rest.iter().flat_map(|&k| (0..DIM).map(move |j| gradient(c, k, j))).collect();
        w.push(table, rest, &updates)?;
        let probe_update: Vec<f32> = (0..DIM).map(|j| gradient(c, probe[0], j)).collect();
        let mut value = [0.0f32; DIM];
        w.push_pull(table, probe, &probe_update, &mut value)?;
        if !close(&value, &reference(probe[0], c + 1)) {
            anyhow::bail!("clock {c}: push-pull of key {} returned {value:?}, expected {:?}", probe[0], reference(probe[0], c + 1));
        }
        // The same key list every clock: sent once, then by hash.
        w.push(counts, &scattered, &vec![1.0; scattered.len() * DIM])?;
        let mut seen = vec![0.0f32; scattered.len() * DIM];
        w.pull(counts, &scattered, &mut seen)?;
        if seen.iter().any(|&v| v < (c + 1) as f32) {
            anyhow::bail!("clock {c}: a count of the compressed table is below {}", c + 1);
        }
        w.advance_clock()?;
    }
    w.barrier()?;
    let mut seen = vec![0.0f32; scattered.len() * DIM];
    w.pull(counts, &scattered, &mut seen)?;
    if let Some(v) = seen.iter().find(|&&v| v != 2.0 * clocks as f32) {
        anyhow::bail!("a count of the compressed table is {v}, expected {}", 2 * clocks);
    }
    let all: Vec<u64> = (0..KEYS).collect();
    let mut out = vec![0.0f32; KEYS as usize * DIM];
    w.pull(table, &all, &mut out)?;
    for k in 0..KEYS {
        let want = reference(k, clocks);
        let got = &out[k as usize * DIM..(k as usize + 1) * DIM];
        if !close(got, &want) {
            anyhow::bail!("key {k}: {got:?}, expected {want:?} (a push lost, doubled, or the optimizer state left behind)");
        }
    }
    let stats = node.stats();
    if stats.relocations_in == 0 {
        anyhow::bail!("no key relocated to node {rank}");
    }
    w.barrier()?;
    drop(w);
    node.finalize()?;
    println!("toolbox ok ({} relocations in)", stats.relocations_in);
    Ok(())
}

/// The increments worker `w` of node `rank` pushes: (key, amount) per round.
fn script(rank: usize, w: usize, keys: u64, rounds: usize) -> Vec<(u64, f32)> {
    let mut rng = ChaCha8Rng::seed_from_u64(((rank as u64) << 32) | w as u64);
    (0..rounds).map(|_| (rng.gen_range(0..keys), rng.gen_range(1..4) as f32)).collect()
}

#[allow(clippy::too_many_arguments)]
fn sums(workers: usize, keys: u64, value_len: usize, rounds: usize, relocate: bool, asynchronous: bool, hash: bool) -> Result<()> {
    let spec = TableSpec::new("t", keys, value_len).partitioned(if hash { Partitioning::Hash } else { Partitioning::Range });
    let mut config = Config::from_env(vec![spec])?;
    config.relocation = relocate;
    let mut node = Node::start(config)?;
    println!("transport {}", node.transport());
    let (rank, nodes) = (node.rank(), node.nodes());
    let table = node.table("t")?;
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let mut worker = node.worker();
                s.spawn(move || -> Result<()> {
                    let mut rng = ChaCha8Rng::seed_from_u64(1000 + w as u64 + rank as u64 * 77);
                    let mut tickets = Vec::new();
                    for (i, (key, amount)) in script(rank, w, keys, rounds).into_iter().enumerate() {
                        if relocate && rng.gen_bool(0.2) {
                            let batch: Vec<u64> = (0..3).map(|_| rng.gen_range(0..keys)).collect();
                            if asynchronous {
                                tickets.push(worker.localize_async(table, &batch)?);
                            } else {
                                worker.localize(table, &batch)?;
                            }
                        }
                        let update = vec![amount; value_len];
                        if asynchronous && i % 2 == 0 {
                            tickets.push(worker.push_async(table, &[key], &update)?);
                        } else {
                            worker.push(table, &[key], &update)?;
                        }
                        if i % 17 == 0 {
                            let mut out = vec![0.0; value_len];
                            worker.pull(table, &[key], &mut out)?;
                        }
                    }
                    for t in tickets {
                        worker.wait(t)?;
                    }
                    worker.barrier()?;
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().expect("worker thread")?;
        }
        Ok(())
    })?;
    let stats = node.stats();
    eprintln!(
        "node {rank}: {} local, {} remote accesses, {} relocations in, {} out",
        stats.local_accesses, stats.remote_accesses, stats.relocations_in, stats.relocations_out
    );
    if rank == 0 {
        let mut expected = vec![0.0f32; keys as usize];
        for r in 0..nodes {
            for w in 0..workers {
                for (key, amount) in script(r, w, keys, rounds) {
                    expected[key as usize] += amount;
                }
            }
        }
        let mut worker = node.worker();
        let all: Vec<u64> = (0..keys).collect();
        let mut out = vec![0.0; keys as usize * value_len];
        worker.pull(table, &all, &mut out)?;
        for key in 0..keys as usize {
            for j in 0..value_len {
                let got = out[key * value_len + j];
                ensure!(got == expected[key], "key {key} element {j}: expected {} got {got}", expected[key]);
            }
        }
        println!("sums ok: {keys} keys match after {} pushes", nodes * workers * rounds);
        worker.barrier()?;
    } else {
        let mut worker = node.worker();
        worker.barrier()?;
    }
    node.finalize()?;
    Ok(())
}

const LANES: usize = 128;

/// Runs a recorded workload on one worker; returns (key, event) in program order.
fn recorded_workload(
    worker: &mut Worker,
    table: ferry::Table,
    keys: u64,
    ops: usize,
    seed: u64,
    lanes_base: &mut dyn FnMut(u64) -> Option<u32>,
    tags: &mut dyn FnMut(u64) -> u32,
) -> Result<Vec<(u64, Event)>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut events = Vec::new();
    let mut pending_pulls: Vec<(ferry::PullTicket, Vec<(usize, u64)>)> = Vec::new();
    let mut tickets = Vec::new();
    for _ in 0..ops {
        let key = rng.gen_range(0..keys);
        let asynchronous = rng.gen_bool(0.4);
        match rng.gen_range(0..100) {
            0..25 => {
                if asynchronous {
                    tickets.push(worker.localize_async(table, &[key])?);
                } else {
                    worker.localize(table, &[key])?;
                }
            }
            25..60 => {
                let Some(lane) = lanes_base(key) else { continue };
                events.push((key, Event::Push { lane }));
                let update = push_update(lane, LANES);
                if asynchronous {
                    tickets.push(worker.push_async(table, &[key], &update)?);
                } else {
                    worker.push(table, &[key], &update)?;
                }
            }
            60..66 => {
                let tag = tags(key);
                events.push((key, Event::Set { tag }));
                let value = set_value(tag, LANES);
                if asynchronous {
                    tickets.push(worker.set_async(table, &[key], &value)?);
                } else {
                    worker.set(table, &[key], &value)?;
                }
            }
            _ => {
                events.push((key, Event::Pull { value: Vec::new() }));
                let at = events.len() - 1;
                if asynchronous {
                    pending_pulls.push((worker.pull_async(table, &[key])?, vec![(at, key)]));
                } else {
                    let mut out = vec![0.0; LANES];
                    worker.pull(table, &[key], &mut out)?;
                    events[at].1 = Event::Pull { value: out };
                }
            }
        }
    }
    for (ticket, slots) in pending_pulls {
        let values = worker.wait_pull(ticket)?;
        for (at, _) in slots {
            events[at].1 = Event::Pull { value: values.clone() };
        }
    }
    for t in tickets {
        worker.wait(t)?;
    }
    Ok(events)
}

fn history(workers: usize, keys: u64, ops: usize, dir: &std::path::Path, seed: u64) -> Result<()> {
    let mut config = Config::from_env(vec![TableSpec::new("h", keys, LANES)])?;
    config.relocation = true;
    let mut node = Node::start(config)?;
    println!("transport {}", node.transport());
    let (rank, nodes) = (node.rank(), node.nodes());
    let table = node.table("h")?;
    // Lanes and tags are partitioned between workers so that every push and set is unique.
    let per_worker = (LANES - 1) / (nodes * workers);
    let results: Vec<Vec<(u64, Event)>> = std::thread::scope(|s| -> Result<Vec<_>> {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let mut worker = node.worker();
                s.spawn(move || -> Result<Vec<(u64, Event)>> {
                    let global = rank * workers + w;
                    let mut used = vec![0u32; keys as usize];
                    let mut next_tag = vec![0u32; keys as usize];
                    let mut lanes = |key: u64| {
                        let u = &mut used[key as usize];
                        if (*u as usize) < per_worker {
                            *u += 1;
                            Some(1 + (global * per_worker) as u32 + *u - 1)
                        } else {
                            None
                        }
                    };
                    let mut tags = |key: u64| {
                        let t = &mut next_tag[key as usize];
                        *t += 1;
                        (global as u32 + 1) * 100_000 + *t
                    };
                    let events = recorded_workload(&mut worker, table, keys, ops, seed * 1000 + global as u64, &mut lanes, &mut tags)?;
                    worker.barrier()?;
                    Ok(events)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
    })?;
    let file = dir.join(format!("history-{rank}.txt"));
    let mut text = String::new();
    for (w, events) in results.iter().enumerate() {
        for (key, e) in events {
            let (kind, payload) = match e {
                Event::Push { lane } => ("push", lane.to_string()),
                Event::Set { tag } => ("set", tag.to_string()),
                Event::Pull { value } => ("pull", value.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",")),
            };
            text.push_str(&format!("{} {key} {kind} {payload}\n", rank * workers + w));
        }
    }
    std::fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
    let mut worker = node.worker();
    worker.barrier()?;
    if rank == 0 {
        let mut h = History::new(nodes * workers);
        for r in 0..nodes {
            let text = std::fs::read_to_string(dir.join(format!("history-{r}.txt")))?;
            for line in text.lines() {
                let mut parts = line.splitn(4, ' ');
                let (w, key, kind, payload) = (parts.next(), parts.next(), parts.next(), parts.next().unwrap_or(""));
                let w: usize = w.context("worker")?.parse()?;
                let key: u64 = key.context("key")?.parse()?;
                let event = match kind {
                    Some("push") => Event::Push { lane: payload.parse()? },
                    Some("set") => Event::Set { tag: payload.parse()? },
                    Some("pull") => Event::Pull { value: payload.split(',').map(str::parse).collect::<Result<Vec<f32>, _>>()? },
                    _ => bail!("bad history line: {line}"),
                };
                h.record(w, key, event);
            }
        }
        let all: Vec<u64> = (0..keys).collect();
        let mut out = vec![0.0; keys as usize * LANES];
        worker.pull(table, &all, &mut out)?;
        for key in 0..keys {
            h.record_after_all(key, Event::Pull { value: out[key as usize * LANES..(key as usize + 1) * LANES].to_vec() });
        }
        h.check(LANES).map_err(|v| anyhow::anyhow!("consistency violation: {v}"))?;
        println!("history ok: {} events on {keys} keys are per-key sequentially consistent", h.len());
    }
    worker.barrier()?;
    drop(worker);
    node.finalize()?;
    Ok(())
}

fn crash(workers: usize) -> Result<()> {
    let mut config = Config::from_env(vec![TableSpec::new("c", 64, 8)])?;
    config.peer_timeout = Duration::from_millis(1500);
    config.op_timeout = Duration::from_secs(10);
    let node = Node::start(config)?;
    let (rank, nodes) = (node.rank(), node.nodes());
    let table = node.table("c")?;
    let victim = nodes - 1;
    let mut worker = node.worker();
    worker.barrier()?;
    if rank == victim {
        // Keep relocations flowing towards this node, then die without a goodbye.
        for i in 0..50u64 {
            let _ = worker.localize_async(table, &[i % 64, (i * 7) % 64]);
        }
        drop(worker);
        node.abort();
        std::process::exit(0);
    }
    let started = Instant::now();
    let mut saw_error = false;
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let mut worker = node.worker();
                s.spawn(move || -> std::result::Result<bool, ferry::Error> {
                    let mut rng = ChaCha8Rng::seed_from_u64(w as u64);
                    let mut failed = false;
                    let deadline = Instant::now() + Duration::from_secs(8);
                    while Instant::now() < deadline {
                        let keys: Vec<u64> = (0..4).map(|_| rng.gen_range(0..64)).collect();
                        let r = if rng.gen_bool(0.5) { worker.localize(table, &keys) } else { worker.push(table, &keys, &[1.0; 32]) };
                        match r {
                            Ok(()) => {}
                            // The loss, a key whose value it took, or a wait for it.
                            Err(ferry::Error::PeerLost { .. } | ferry::Error::KeyLost { .. } | ferry::Error::Timeout { .. }) => failed = true,
                            Err(e) => return Err(e),
                        }
                        if failed && Instant::now() > deadline - Duration::from_secs(6) {
                            break;
                        }
                    }
                    Ok(failed)
                })
            })
            .collect();
        for h in handles {
            saw_error |= h.join().expect("worker thread").context("an operation failed with something else than the loss")?;
        }
        Ok(())
    })?;
    ensure!(saw_error, "no operation failed although node {victim} died");
    ensure!(started.elapsed() < Duration::from_secs(30), "operations took too long to fail");
    println!("crash ok: operations failed with errors after node {victim} died, none hung");
    drop(worker);
    // The cluster is broken: shut down without the (impossible) cluster-wide barrier.
    node.abort();
    Ok(())
}

fn send_failure(after: u64) -> Result<()> {
    let mut config = Config::from_env(vec![TableSpec::new("s", 1000, 4)])?;
    config.peer_timeout = Duration::from_millis(1500);
    config.op_timeout = Duration::from_secs(10);
    if config.rank == 0 {
        config.fail_sends_after = Some((1, after));
    }
    let node = Node::start(config)?;
    println!("transport {}", node.transport());
    let table = node.table("s")?;
    let mut worker = node.worker();
    if node.rank() == 0 {
        let started = Instant::now();
        let remote: Vec<u64> = (500..508).collect(); // homed at rank 1
        let mut pushes = 0u64;
        let error = loop {
            match worker.push(table, &remote, &[1.0; 32]) {
                Ok(()) => pushes += 1,
                Err(e) => break e,
            }
            ensure!(started.elapsed() < Duration::from_secs(20), "{pushes} pushes and no failure: the injected fault did nothing");
        };
        ensure!(matches!(error, ferry::Error::PeerLost { node: 1, .. }), "the failure names the wrong cause: {error}");
        ensure!(started.elapsed() < Duration::from_secs(15), "failing took {:?}", started.elapsed());
        // Later operations towards the peer fail at once.
        let again = Instant::now();
        ensure!(worker.pull(table, &remote, &mut [0.0; 32]).is_err(), "an operation towards the lost peer succeeded");
        ensure!(again.elapsed() < Duration::from_secs(1), "a later operation took {:?} to fail", again.elapsed());
        println!("send-failure ok: {pushes} pushes, then: {error}");
    } else {
        // Rank 0 never enters this barrier; it fails when rank 0's connection breaks.
        let outcome = worker.barrier();
        ensure!(outcome.is_err(), "the barrier passed although rank 0 never entered it");
        println!("send-failure ok: {}", outcome.unwrap_err());
    }
    drop(worker);
    node.abort();
    Ok(())
}

fn stopped() -> Result<()> {
    let mut config = Config::from_env(vec![TableSpec::new("s", 300, 2)])?;
    // Rank 1 notices the stop itself; rank 0, with a long liveness timeout, learns it from rank 1
    // (its PEER_LOST notice) — and must name the stopped node, not the one that told it.
    config.peer_timeout = if config.rank == 0 { Duration::from_secs(12) } else { Duration::from_millis(1500) };
    config.op_timeout = Duration::from_secs(20);
    let node = Node::start(config)?;
    let table = node.table("s")?;
    let mut worker = node.worker();
    worker.barrier()?;
    let victim = node.nodes() - 1;
    let blames_victim = |e: &ferry::Error| matches!(e, ferry::Error::PeerLost { node, .. } if *node == victim);
    let started = Instant::now();
    if node.rank() == victim {
        let pid = std::process::id().to_string();
        std::process::Command::new("sh").arg("-c").arg(format!("sleep 6; kill -CONT {pid}")).spawn()?;
        // Returns once continued.
        std::process::Command::new("kill").args(["-STOP", &pid]).status()?;
        let outcome = worker.barrier();
        ensure!(outcome.is_err(), "a barrier passed after this node was stopped for 6 s");
        println!("stopped ok: continued, then {}", outcome.unwrap_err());
    } else {
        let on_victim = [250u64]; // homed at the last rank
        let error = loop {
            match worker.push(table, &on_victim, &[1.0; 2]) {
                Ok(()) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => break e,
            }
            ensure!(started.elapsed() < Duration::from_secs(8), "pushes to the stopped node kept succeeding");
        };
        ensure!(blames_victim(&error), "the failure blames the wrong node: {error}");
        if node.rank() == 0 {
            ensure!(error.to_string().contains("reported by node 1"), "rank 0 learnt of the loss from rank 1: {error}");
            // Rank 1 stays until rank 0 has pushed to it below, so only its PEER_LOST can have
            // told rank 0 this early (rank 0's own liveness timeout is 12 s).
            ensure!(started.elapsed() < Duration::from_secs(8), "rank 0 learnt of the loss only after {} ms", started.elapsed().as_millis());
        }
        // The survivors still work with each other: each pushes to a key the other homes, and
        // waits for the other's push, so that neither leaves before both know of the loss.
        let (to_other, from_other) = if node.rank() == 0 { ([150u64], [50u64]) } else { ([50u64], [150u64]) };
        worker.push(table, &to_other, &[1.0; 2]).context("a push between survivors")?;
        let mut value = [0.0f32; 2];
        while value[0] < 1.0 {
            ensure!(started.elapsed() < Duration::from_secs(15), "the other survivor's push never came");
            worker.pull(table, &from_other, &mut value)?;
            std::thread::sleep(Duration::from_millis(10));
        }
        let barrier = worker.barrier().expect_err("a barrier with a stopped node cannot pass");
        ensure!(blames_victim(&barrier), "the barrier blames the wrong node: {barrier}");
        println!("stopped ok after {} ms: {error}; barrier: {barrier}", started.elapsed().as_millis());
    }
    drop(worker);
    node.abort();
    Ok(())
}

/// Peak resident memory of this process (VmHWM), in bytes.
fn peak_rss() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).context("no VmHWM in /proc/self/status")?;
    let kib: u64 = line.split_whitespace().nth(1).context("bad VmHWM line")?.parse()?;
    Ok(kib << 10)
}

fn stalled_reader(limit_mib: usize) -> Result<()> {
    const VALUE_LEN: usize = 256;
    const BATCH: u64 = 1024; // one push: 1 MiB of values
    let mut config = Config::from_env(vec![TableSpec::new("s", 4 * BATCH, VALUE_LEN)])?;
    config.transport = ferry::TransportChoice::Tcp;
    config.peer_timeout = Duration::from_millis(1500);
    config.op_timeout = Duration::from_secs(30);
    config.send_queue_limit = limit_mib << 20;
    if config.rank == 1 {
        // Enough frames for start-up and the first barrier, then rank 1 reads nothing more.
        config.stop_reading_after = Some(3);
    }
    let node = Node::start(config)?;
    let table = node.table("s")?;
    let mut worker = node.worker();
    worker.barrier()?;
    if node.rank() == 0 {
        let before = peak_rss()?;
        let remote: Vec<u64> = (2 * BATCH..3 * BATCH).collect(); // homed at rank 1
        let values = vec![1.0f32; BATCH as usize * VALUE_LEN];
        let started = Instant::now();
        let mut outstanding = std::collections::VecDeque::new();
        let mut pushes = 0u64;
        let error = loop {
            ensure!(started.elapsed() < Duration::from_secs(25), "{pushes} pushes into a node that does not read, and it was never declared lost");
            let pushed = worker.push_async(table, &remote, &values).and_then(|t| {
                outstanding.push_back(t);
                if outstanding.len() > 256 { worker.wait(outstanding.pop_front().expect("one")) } else { Ok(()) }
            });
            match pushed {
                Ok(()) => pushes += 1,
                Err(e) => break e,
            }
        };
        let took = started.elapsed();
        let grew = peak_rss()?.saturating_sub(before);
        ensure!(matches!(&error, ferry::Error::PeerLost { node: 1, reason } if reason.contains("does not read")), "the failure names the wrong cause: {error}");
        ensure!(took < Duration::from_secs(10), "declaring the peer lost took {took:?}");
        println!("stalled-reader ok: {pushes} pushes of 1 MiB, lost after {} ms, peak RSS grew {} MiB: {error}", took.as_millis(), grew >> 20);
    } else {
        let outcome = worker.barrier();
        ensure!(outcome.is_err(), "the barrier passed although rank 0 never entered it");
        println!("stalled-reader ok: {}", outcome.unwrap_err());
    }
    drop(worker);
    node.abort();
    Ok(())
}

fn writes_queued(keys: u64) -> Result<()> {
    let mut config = Config::from_env(vec![TableSpec::new("w", 2 * keys, 16)])?;
    config.peer_timeout = Duration::from_millis(1500);
    config.op_timeout = Duration::from_secs(20);
    // Few verbs buffers: the hand-overs' writes wait for credits, so they are queued when rank 1
    // dies (over TCP they are copied out when queued).
    config.verbs.buffers = 4;
    let node = Node::start(config)?;
    println!("transport {}", node.transport());
    let table = node.table("w")?;
    let mut worker = node.worker();
    worker.barrier()?;
    if node.rank() == 1 {
        let all_of_rank_0: Vec<u64> = (0..keys).collect();
        let ticket = worker.localize_async(table, &all_of_rank_0)?;
        std::thread::sleep(Duration::from_millis(30));
        println!("writes-queued ok: dying with {keys} relocations in flight");
        std::mem::forget(ticket);
        drop(worker);
        node.abort();
        std::process::exit(0);
    }
    let started = Instant::now();
    let mut out = [0.0f32; 16];
    let error = loop {
        match worker.pull(table, &[keys + 1], &mut out) {
            Ok(()) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => break e,
        }
        ensure!(started.elapsed() < Duration::from_secs(20), "rank 1 died but operations towards it still succeed");
    };
    ensure!(matches!(error, ferry::Error::PeerLost { node: 1, .. }), "the failure names the wrong cause: {error}");
    // Every slot of a key that left is freed once its write completed or failed.
    let deadline = Instant::now() + Duration::from_secs(15);
    let (held, in_use) = loop {
        let mut held = 0;
        for key in 0..2 * keys {
            held += node.slot_address(table, key)?.is_some() as usize;
        }
        let (in_use, _) = node.memory(table);
        if in_use == held {
            break (held, in_use);
        }
        ensure!(Instant::now() < deadline, "{in_use} slots in use for {held} keys held: slots of keys that left were not freed");
        std::thread::sleep(Duration::from_millis(50));
    };
    println!("writes-queued ok: {error}; {held} keys still here, {in_use} slots in use");
    drop(worker);
    node.abort();
    Ok(())
}

/// Replicated keys of the `replicas` scenario (homed at both ranks of a 2-node cluster).
const REPLICATED: [u64; 6] = [1, 5, 9, 33, 40, 60];

fn replicas(pushes: u32, dir: &std::path::Path) -> Result<()> {
    use ferry::testing::consistency::{TimedPull, TimedPush, check_bounded_staleness};
    let staleness = Duration::from_millis(30);
    let mut config = Config::from_env(vec![TableSpec::new("r", 64, LANES).replicating_keys(REPLICATED)])?;
    config.staleness = staleness;
    let mut node = Node::start(config)?;
    println!("transport {}", node.transport());
    let (rank, nodes) = (node.rank(), node.nodes());
    ensure!((nodes as u32) * pushes < LANES as u32, "too many pushes for {LANES} lanes");
    let table = node.table("r")?;
    let mut worker = node.worker();
    worker.barrier()?;
    let mut text = String::new();
    for i in 0..pushes {
        let lane = 1 + rank as u32 * pushes + i;
        for &key in &REPLICATED {
            let issued = ferry_tcp::monotonic_ns();
            worker.push(table, &[key], &push_update(lane, LANES))?;
            text.push_str(&format!("push {key} {rank} {lane} {issued} {}\n", ferry_tcp::monotonic_ns()));
            let mut value = vec![0.0; LANES];
            let start = ferry_tcp::monotonic_ns();
            worker.pull(table, &[key], &mut value)?;
            let end = ferry_tcp::monotonic_ns();
            let joined = value.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",");
            text.push_str(&format!("pull {key} {rank} {start} {end} {joined}\n"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    worker.barrier()?;
    let stats = node.stats().replication;
    text.push_str(&format!("round {}\n", stats.round_time.max_ns));
    std::fs::write(dir.join(format!("replicas-{rank}.txt")), text)?;
    println!("refresh reads {} bytes {} over {}", stats.refresh_reads, stats.refresh_bytes, node.transport());
    ensure!(stats.refresh_reads > 0, "no refresh read was issued");
    worker.barrier()?;
    // Every push, exactly once, in every replica after the barrier.
    let mut out = vec![0.0; REPLICATED.len() * LANES];
    worker.pull(table, &REPLICATED, &mut out)?;
    for (k, value) in out.chunks(LANES).enumerate() {
        let expected = (1..=(nodes as u32 * pushes) as usize).all(|l| value[l] == 1.0) && value[0] == 0.0;
        ensure!(expected, "key {} after the barrier: {value:?}", REPLICATED[k]);
    }
    if rank == 0 {
        let (mut pushes_by_key, mut pulls_by_key) = (vec![Vec::new(); REPLICATED.len()], vec![Vec::new(); REPLICATED.len()]);
        let mut slowest = 0u64;
        for r in 0..nodes {
            for line in std::fs::read_to_string(dir.join(format!("replicas-{r}.txt")))?.lines() {
                let f: Vec<&str> = line.split(' ').collect();
                let index = |key: &str| -> Result<usize> {
                    let key: u64 = key.parse()?;
                    REPLICATED.iter().position(|&k| k == key).context("unknown key")
                };
                match f[..] {
                    ["push", key, node, lane, issued, acked] => {
                        pushes_by_key[index(key)?].push(TimedPush { node: node.parse()?, lane: lane.parse()?, issued: issued.parse()?, acked: acked.parse()? })
                    }
                    ["pull", key, node, start, end, value] => pulls_by_key[index(key)?].push(TimedPull {
                        node: node.parse()?,
                        start: start.parse()?,
                        end: end.parse()?,
                        value: value.split(',').map(str::parse).collect::<Result<Vec<f32>, _>>()?,
                    }),
                    ["round", max] => slowest = slowest.max(max.parse()?),
                    _ => bail!("bad replicas line: {line}"),
                }
            }
        }
        // The guarantee holds while rounds are short against the bound: the bound checked is
        // the configured one plus twice the slowest round either node saw.
        let bound = staleness.as_nanos() as u64 + 2 * slowest;
        for (k, &key) in REPLICATED.iter().enumerate() {
            check_bounded_staleness(key, &pushes_by_key[k], &pulls_by_key[k], LANES, bound).map_err(|v| anyhow::anyhow!("staleness violation: {v:?}"))?;
        }
        let pulls: usize = pulls_by_key.iter().map(Vec::len).sum();
        println!("replicas ok: {pulls} pulls within {} ms of every push, sums exact", bound / 1_000_000);
    }
    worker.barrier()?;
    drop(worker);
    node.finalize()?;
    Ok(())
}

/// Lanes of the `intent-history` scenario's values: every push of a key has a lane of its own.
const INTENT_LANES: usize = 512;

/// What every worker of the `intent-history` scenario shares.
#[derive(Clone, Copy)]
struct IntentHistoryPlan {
    table: ferry::Table,
    keys: u64,
    clocks: u64,
    /// Lanes each worker has per key.
    lanes_per_worker: usize,
}

/// One worker's part of the `intent-history` scenario: each clock it declares a few random
/// keys for a short window two clocks ahead, then pushes to, pulls and sometimes localizes
/// mostly the keys of its current windows. Returns its record lines (see `intent_history`).
fn intent_history_worker(worker: &mut Worker, plan: &IntentHistoryPlan, rank: usize, global: usize, seed: u64) -> Result<String> {
    let IntentHistoryPlan { table, keys, clocks, lanes_per_worker } = *plan;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut used = vec![0usize; keys as usize];
    let mut windows: Vec<(Vec<u64>, u64, u64)> = Vec::new();
    let mut text = String::new();
    let mut localizes = Vec::new();
    let declare = |rng: &mut ChaCha8Rng, worker: &mut Worker, windows: &mut Vec<(Vec<u64>, u64, u64)>, start: u64| -> Result<()> {
        let mut chosen: Vec<u64> = (0..rng.gen_range(2..6)).map(|_| rng.gen_range(0..keys)).collect();
        chosen.sort_unstable();
        chosen.dedup();
        let end = start + rng.gen_range(1..4);
        worker.intent(table, &chosen, start, end)?;
        windows.push((chosen, start, end));
        Ok(())
    };
    for start in 0..2 {
        declare(&mut rng, worker, &mut windows, start)?;
    }
    for clock in 0..clocks {
        declare(&mut rng, worker, &mut windows, clock + 2)?;
        windows.retain(|w| w.2 > clock);
        let now: Vec<u64> = windows.iter().filter(|w| w.1 <= clock).flat_map(|w| w.0.iter().copied()).collect();
        for _ in 0..6 {
            let key = if !now.is_empty() && rng.gen_bool(0.8) { now[rng.gen_range(0..now.len())] } else { rng.gen_range(0..keys) };
            match rng.gen_range(0..100) {
                0..45 => {
                    let u = &mut used[key as usize];
                    if *u == lanes_per_worker {
                        continue;
                    }
                    *u += 1;
                    let lane = 1 + global * lanes_per_worker + *u - 1;
                    let issued = ferry_tcp::monotonic_ns();
                    worker.push(table, &[key], &push_update(lane as u32, INTENT_LANES))?;
                    text.push_str(&format!("push {key} {rank} {lane} {issued} {} {global}\n", ferry_tcp::monotonic_ns()));
                }
                45..92 => {
                    let mut value = vec![0.0; INTENT_LANES];
                    let start = ferry_tcp::monotonic_ns();
                    worker.pull(table, &[key], &mut value)?;
                    let end = ferry_tcp::monotonic_ns();
                    text.push_str(&format!("pull {key} {rank} {start} {end} {} {global}\n", sparse_value(&value)));
                }
                _ => {
                    if rng.gen_bool(0.5) {
                        localizes.push(worker.localize_async(table, &[key])?);
                    } else {
                        worker.localize(table, &[key])?;
                    }
                }
            }
        }
        // The trainer's computation between clocks, during which the intent service acts.
        std::thread::sleep(Duration::from_micros(rng.gen_range(300..2_000)));
        worker.advance_clock()?;
    }
    for ticket in localizes {
        worker.wait(ticket)?;
    }
    Ok(text)
}

/// A value's non-zero elements as `index=value` pairs (`-` when there are none).
fn sparse_value(value: &[f32]) -> String {
    let pairs: Vec<String> = value.iter().enumerate().filter(|(_, v)| **v != 0.0).map(|(i, v)| format!("{i}={v}")).collect();
    if pairs.is_empty() { "-".to_string() } else { pairs.join(",") }
}

fn parse_sparse_value(text: &str, lanes: usize) -> Result<Vec<f32>> {
    let mut value = vec![0.0; lanes];
    if text != "-" {
        for pair in text.split(',') {
            let (i, v) = pair.split_once('=').context("a value element without '='")?;
            let i: usize = i.parse()?;
            ensure!(i < lanes, "element {i} of {lanes}");
            value[i] = v.parse()?;
        }
    }
    Ok(value)
}

/// Random intents on few keys across the cluster: keys move to the one node that declared
/// them, are replicated on the nodes that declared them together and dropped when the windows
/// end, while explicit localizes pull them elsewhere. Every pull must include each push at
/// most once, every push its own node acknowledged before the pull began, no push issued after
/// it returned, and every push acknowledged more than a bound before it began (the replicas'
/// sync rounds run every half of the staleness bound; the bound checked adds a generous margin
/// for rounds delayed on loaded machines, so it catches a push that never arrives, not a slow
/// round). After a barrier every node reads every push exactly once.
fn intent_history(workers: usize, keys: u64, clocks: u64, dir: &std::path::Path, seed: u64) -> Result<()> {
    use ferry::testing::consistency::{TimedPull, TimedPush, check_bounded_staleness};
    let staleness = Duration::from_millis(20);
    let margin = Duration::from_secs(2);
    let mut config = Config::from_env(vec![TableSpec::new("i", keys, INTENT_LANES)])?;
    config.relocation = true;
    config.staleness = staleness;
    let mut node = Node::start(config)?;
    println!("transport {}", node.transport());
    let (rank, nodes) = (node.rank(), node.nodes());
    let table = node.table("i")?;
    let plan = &IntentHistoryPlan { table, keys, clocks, lanes_per_worker: (INTENT_LANES - 1) / (nodes * workers) };
    let before = node.stats();
    let texts: Vec<String> = std::thread::scope(|s| -> Result<Vec<String>> {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let mut worker = node.worker();
                s.spawn(move || -> Result<String> {
                    let global = rank * workers + w;
                    let text = intent_history_worker(&mut worker, plan, rank, global, seed * 1000 + global as u64)?;
                    worker.barrier()?;
                    Ok(text)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
    })?;
    let mut worker = node.worker();
    // Every push of the cluster, exactly once, in every value read after the barrier.
    let all: Vec<u64> = (0..keys).collect();
    let mut out = vec![0.0; keys as usize * INTENT_LANES];
    worker.pull(table, &all, &mut out)?;
    let s = node.stats().since(&before);
    let mut text = texts.concat();
    for (key, value) in out.chunks(INTENT_LANES).enumerate() {
        text.push_str(&format!("final {key} {rank} {}\n", sparse_value(value)));
    }
    text.push_str(&format!("stats {rank} {} {} {}\n", s.intent.acted_keys, s.intent.replicas_made, s.relocations_in));
    std::fs::write(dir.join(format!("intent-history-{rank}.txt")), text)?;
    worker.barrier()?;
    if rank == 0 {
        let (mut pushes, mut pulls, mut finals) = (vec![Vec::new(); keys as usize], vec![Vec::new(); keys as usize], Vec::new());
        let (mut acted, mut made, mut moved) = (0u64, 0u64, 0u64);
        for r in 0..nodes {
            for line in std::fs::read_to_string(dir.join(format!("intent-history-{r}.txt")))?.lines() {
                let f: Vec<&str> = line.split(' ').collect();
                let key = |k: &str| -> Result<usize> { k.parse::<usize>().ok().filter(|&k| k < keys as usize).context("bad key") };
                match f[..] {
                    ["push", k, node, lane, issued, acked, _] => {
                        pushes[key(k)?].push(TimedPush { node: node.parse()?, lane: lane.parse()?, issued: issued.parse()?, acked: acked.parse()? })
                    }
                    ["pull", k, node, start, end, value, _] => pulls[key(k)?].push(TimedPull {
                        node: node.parse()?,
                        start: start.parse()?,
                        end: end.parse()?,
                        value: parse_sparse_value(value, INTENT_LANES)?,
                    }),
                    ["final", k, node, value] => finals.push((key(k)?, node.to_string(), parse_sparse_value(value, INTENT_LANES)?)),
                    ["stats", _, a, m, i] => {
                        acted += a.parse::<u64>()?;
                        made += m.parse::<u64>()?;
                        moved += i.parse::<u64>()?;
                    }
                    _ => bail!("bad intent-history line: {line}"),
                }
            }
        }
        let bound = (staleness + margin).as_nanos() as u64;
        for key in 0..keys as usize {
            check_bounded_staleness(key as u64, &pushes[key], &pulls[key], INTENT_LANES, bound).map_err(|v| anyhow::anyhow!("violation: {v:?}"))?;
        }
        for (key, node, value) in &finals {
            let expected = |lane: usize| if pushes[*key].iter().any(|p| p.lane as usize == lane) { 1.0 } else { 0.0 };
            if let Some(lane) = (0..INTENT_LANES).find(|&l| value[l] != expected(l)) {
                bail!("node {node} read key {key} after the barrier with {} in lane {lane}, expected {}", value[lane], expected(lane));
            }
        }
        // The run must have exercised what it checks: moves by the service, run-time replicas.
        ensure!(acted > 0 && made > 0, "the intent service moved {acted} keys and made {made} replicas: the history checks neither");
        let (n_pushes, n_pulls): (usize, usize) = (pushes.iter().map(Vec::len).sum(), pulls.iter().map(Vec::len).sum());
        println!(
            "intent history ok: {n_pulls} pulls and {n_pushes} pushes on {keys} keys ({acted} keys moved by the service, {made} replicas made, {moved} relocations in)"
        );
    }
    worker.barrier()?;
    drop(worker);
    node.finalize()?;
    Ok(())
}

/// What one survivor's worker saw in `intent-crash`.
#[derive(Default)]
struct CrashedIntents {
    ok: u64,
    failed: u64,
    /// Failures that blamed neither the lost node nor a key it held (timeouts included).
    misblamed: Vec<String>,
    /// The longest single call, in milliseconds.
    longest_ms: u128,
    /// What it was, and how it ended.
    longest_call: String,
}

/// One of three ranks (`victim`, the last by default) dies at clock `DIE_AT` of `CLOCKS` while every node's workers declare
/// random intents on few keys (so that keys move, and are replicated on the nodes that declare
/// them together), push into lanes of their own and pull; bounded-delay clocks (τ = 2) keep
/// every worker within two clocks of the slowest, so the victim dies while the survivors are
/// early in their run. The survivors' workers go on to the end: every call returns (an error
/// naming the lost node or a key it held, where it needed it — never a timeout), no pull includes a
/// push twice or one of its own worker's lanes the worker has not pushed yet, run-time replicas
/// existed, the barrier fails at once, and the survivors' nodes stop — their intent services
/// drop every replica, whose deltas to the lost node fail — without hanging.
fn intent_crash(workers: usize, seed: u64, victim: Option<usize>) -> Result<()> {
    const KEYS: u64 = 12;
    const CLOCKS: u64 = 120;
    const DIE_AT: u64 = 40;
    let mut config = Config::from_env(vec![TableSpec::new("i", KEYS, INTENT_LANES)])?;
    config.relocation = true;
    config.staleness = Duration::from_millis(20);
    config.peer_timeout = Duration::from_millis(1500);
    config.op_timeout = Duration::from_secs(10);
    // The survivors wait for the victim's clocks until it is lost (a lost node no longer holds
    // them back).
    config.max_delay = Some(2);
    let node = Node::start(config)?;
    println!("transport {}", node.transport());
    let (rank, nodes) = (node.rank(), node.nodes());
    ensure!(nodes >= 3, "intent-crash needs three nodes or more (two survivors)");
    let victim = victim.unwrap_or(nodes - 1);
    ensure!(victim < nodes, "no rank {victim} among {nodes}");
    let table = node.table("i")?;
    let lanes_per_worker = (INTENT_LANES - 1) / (nodes * workers);
    let mut first = node.worker();
    first.barrier()?;
    drop(first);
    let started = Instant::now();
    let seen: Vec<CrashedIntents> = std::thread::scope(|s| -> Result<Vec<CrashedIntents>> {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let mut worker = node.worker();
                s.spawn(move || -> Result<CrashedIntents> {
                    let global = rank * workers + w;
                    let mut rng = ChaCha8Rng::seed_from_u64(seed * 1000 + global as u64);
                    let mut seen = CrashedIntents::default();
                    let mut pushed = vec![0usize; KEYS as usize];
                    let own = 1 + global * lanes_per_worker..1 + (global + 1) * lanes_per_worker;
                    let note = |seen: &mut CrashedIntents, began: Instant, call: &dyn Fn() -> String, outcome: std::result::Result<(), ferry::Error>| {
                        let took = began.elapsed().as_millis();
                        if took >= seen.longest_ms {
                            seen.longest_ms = took;
                            let ended = match &outcome {
                                Ok(()) => "ok".to_string(),
                                Err(e) => e.to_string(),
                            };
                            seen.longest_call = format!("{}: {ended}", call());
                        }
                        match outcome {
                            Ok(()) => seen.ok += 1,
                            Err(e) => {
                                seen.failed += 1;
                                // The lost node by name, or a key it held (whose value went with it).
                                // Not a timeout: every wait is bounded by one, but a call that needs
                                // one to end waited for the lost node without knowing of the loss,
                                // which PEER_LOST rules out (none in about 5 000 runs since).
                                if !matches!(e, ferry::Error::PeerLost { .. } | ferry::Error::KeyLost { .. }) {
                                    seen.misblamed.push(e.to_string());
                                }
                            }
                        }
                    };
                    let mut clock = 0;
                    while clock < CLOCKS {
                        if rank == victim && clock == DIE_AT {
                            return Ok(seen);
                        }
                        let mut chosen: Vec<u64> = (0..rng.gen_range(2..6)).map(|_| rng.gen_range(0..KEYS)).collect();
                        chosen.sort_unstable();
                        chosen.dedup();
                        let began = Instant::now();
                        let declared = worker.intent(table, &chosen, clock + 1, clock + 1 + rng.gen_range(1..4));
                        note(&mut seen, began, &|| format!("intent on {chosen:?} at clock {clock}"), declared);
                        for _ in 0..6 {
                            let key = if rng.gen_bool(0.8) { chosen[rng.gen_range(0..chosen.len())] } else { rng.gen_range(0..KEYS) };
                            let began = Instant::now();
                            if rng.gen_bool(0.5) && pushed[key as usize] < lanes_per_worker {
                                let lane = own.start + pushed[key as usize];
                                pushed[key as usize] += 1;
                                let outcome = worker.push(table, &[key], &push_update(lane as u32, INTENT_LANES));
                                note(&mut seen, began, &|| format!("push to key {key} at clock {clock}"), outcome);
                            } else {
                                let mut value = vec![0.0; INTENT_LANES];
                                let outcome = worker.pull(table, &[key], &mut value);
                                let ok = outcome.is_ok();
                                note(&mut seen, began, &|| format!("pull of key {key} at clock {clock}"), outcome);
                                if ok {
                                    if let Some((lane, x)) = value.iter().enumerate().find(|&(_, &x)| x != 0.0 && x != 1.0) {
                                        bail!("a pull of key {key} holds {x} in lane {lane}: a push applied more than once");
                                    }
                                    let unmade = own.clone().skip(pushed[key as usize]).find(|&lane| value[lane] != 0.0);
                                    ensure!(unmade.is_none(), "a pull of key {key} includes lane {unmade:?}, which its worker has not pushed yet");
                                }
                            }
                        }
                        std::thread::sleep(Duration::from_micros(rng.gen_range(300..2_000)));
                        let began = Instant::now();
                        let advanced = worker.advance_clock().map(|_| ());
                        note(&mut seen, began, &|| format!("advance from clock {clock}"), advanced);
                        clock += 1;
                    }
                    Ok(seen)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("worker thread")).collect()
    })?;
    let stats = node.stats();
    if rank == victim {
        println!("intent crash: rank {rank} dies ({} replicas made here)", stats.intent.replicas_made);
        node.abort();
        std::process::exit(0);
    }
    let (ok, failed) = (seen.iter().map(|s| s.ok).sum::<u64>(), seen.iter().map(|s| s.failed).sum::<u64>());
    let (longest, longest_call) = seen.iter().max_by_key(|s| s.longest_ms).map_or((0, ""), |s| (s.longest_ms, s.longest_call.as_str()));
    let misblamed: Vec<&String> = seen.iter().flat_map(|s| &s.misblamed).collect();
    ensure!(misblamed.is_empty(), "failures that do not name the lost node {victim} or a key it held: {misblamed:?}");
    // No check that a call failed: a survivor may hold or replicate every key it used after the
    // loss (2 of 180 survivors in a loop). The barrier below shows that it knows of the loss.
    ensure!(longest < 20_000, "a call took {longest} ms (the operation timeout is 10 s)");
    ensure!(stats.intent.replicas_made > 0, "no run-time replica was made here");
    let mut last = node.worker();
    let barrier_began = Instant::now();
    let barrier = last.barrier();
    let barrier_ms = barrier_began.elapsed().as_millis();
    let Err(barrier) = barrier else { bail!("a barrier passed with node {victim} lost") };
    // It fails as it starts (a lost node), not after waiting for what the lost node had.
    ensure!(barrier_ms < 5_000, "the barrier took {barrier_ms} ms to fail ({barrier})");
    drop(last);
    let mut node = node;
    let stopping = Instant::now();
    let finalized = node.finalize();
    let stop_ms = stopping.elapsed().as_millis();
    ensure!(stop_ms < 30_000, "finalize took {stop_ms} ms");
    println!(
        "intent crash ok: {ok} calls succeeded and {failed} failed (naming node {victim} or a key it held), the longest took {longest} ms ({longest_call}); \
         {} replicas made and {} syncs here, {} keys found lost with the victim (their replicas here dropped); the barrier failed in {barrier_ms} ms ({barrier}); \
         finalize returned in {stop_ms} ms ({}) after {} ms",
        stats.intent.replicas_made,
        stats.intent.replica_syncs,
        stats.intent.replicas_lost,
        match &finalized {
            Ok(()) => "ok".to_string(),
            Err(e) => e.to_string(),
        },
        started.elapsed().as_millis()
    );
    Ok(())
}
