//! `ferry-bench replicate`: replica refresh between two processes — rounds run on demand,
//! refresh throughput in keys/s and bytes/s against a raw TCP stream of the same bytes in the
//! same run — and the staleness workers see under a configured bound while both nodes push and
//! pull replicated keys.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry::{Config, Node, TableSpec};
use serde_json::json;

use crate::cluster::emit;
use crate::micro::median;
use crate::rawtcp;
use crate::report::{Better, print_records, record};

/// (value length, replicated keys): half of them are homed at each node.
const SHAPES: [(usize, u64); 3] = [(1, 40_000), (100, 4_000), (400, 1_000)];
/// The staleness bound of the second part.
const BOUND: Duration = Duration::from_millis(40);

/// Runs the benchmark on a 2-process cluster and reports.
pub fn run_driver(quick: bool, json: bool) -> Result<()> {
    let started = Instant::now();
    let records = crate::cluster::run_nodes_with("replicate", quick, 2, &[])?;
    print_records("replicate", quick, started, json, &records);
    Ok(())
}

/// A cluster of one table of `n` replicated keys of `len` floats.
fn start(len: usize, n: u64, staleness: Duration, quick: bool) -> Result<Node> {
    let mut config = Config::from_env(vec![TableSpec::new(format!("hot{len}"), n, len).replicating(std::iter::once(0..n))])?;
    config.staleness = staleness;
    config.op_timeout = crate::cluster::budget(quick);
    let node = Node::start(config)?;
    if node.nodes() != 2 {
        bail!("the replication benchmark runs on exactly 2 nodes");
    }
    Ok(node)
}

/// One process of the cluster.
pub fn run_node(quick: bool) -> Result<()> {
    let port: u16 = std::env::var("FERRY_BENCH_PORT").context("FERRY_BENCH_PORT is not set")?.parse()?;
    // Part 1: rounds only when asked for (a bound of an hour keeps the background quiet), one
    // cluster per shape so that a round refreshes that shape only.
    let rank: usize = std::env::var("FERRY_RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
    let server = if rank == 1 { Some(rawtcp::serve(port)?) } else { None };
    let mut client = if rank == 0 { Some(rawtcp::Client::connect(port)?) } else { None };
    let rounds = if quick { 5 } else { 21 };
    for &(len, n) in &SHAPES {
        let mut node = start(len, n, Duration::from_secs(3600), quick)?;
        if rank == 0 && len == SHAPES[0].0 {
            eprintln!("transport: {}", node.transport());
        }
        let mut worker = node.worker();
        let table = node.table(&format!("hot{len}"))?;
        let keys: Vec<u64> = (0..n).collect();
        let ones = vec![1.0f32; keys.len() * len];
        worker.barrier()?;
        if let Some(client) = client.as_mut() {
            let before = node.stats();
            let (mut ferry_t, mut raw_t) = (Vec::new(), Vec::new());
            // The replicas homed at rank 1, read as slots of head, values and tail.
            let refreshed = n / 2;
            let bytes = refreshed as usize * (8 + 4 * len);
            // Refresh-only rounds (every home slot changed by a set at the home, no replica
            // changed here: the deltas are empty and the image holds every slot), then rounds
            // that also ship a delta for every replica.
            let theirs: Vec<u64> = (n / 2..n).collect();
            let values = vec![2.0f32; theirs.len() * len];
            let mut with_deltas_t = Vec::new();
            for _ in 0..rounds {
                let mut raw = Duration::ZERO;
                client.exchange(64, bytes, 1, |d| raw = d)?;
                worker.set(table, &theirs, &values)?;
                let t = Instant::now();
                node.sync_replicas()?;
                ferry_t.push(t.elapsed().as_secs_f64());
                raw_t.push(raw.as_secs_f64());
                worker.push(table, &keys, &ones)?;
                let t = Instant::now();
                node.sync_replicas()?;
                with_deltas_t.push(t.elapsed().as_secs_f64());
            }
            let s = node.stats().since(&before).replication;
            let (ferry_s, raw_s, deltas_s) = (median(&mut ferry_t), median(&mut raw_t), median(&mut with_deltas_t));
            let rounds = 2 * rounds;
            let figures = json!({
                "keys_per_s": refreshed as f64 / ferry_s,
                "bytes_per_s": bytes as f64 / ferry_s,
                "raw_bytes_per_s": bytes as f64 / raw_s,
                "round_ms": ferry_s * 1e3,
                "round_with_deltas_ms": deltas_s * 1e3,
                "reads_per_round": s.refresh_reads as f64 / rounds as f64,
                "bytes_read_per_round": s.refresh_bytes as f64 / rounds as f64,
                "shipped_keys_per_round_with_deltas": 2.0 * s.shipped_keys as f64 / rounds as f64,
                "torn_copies": s.torn_copies,
            });
            emit(record(
                "replica_refresh",
                json!({"value_len": len, "keys": refreshed}),
                figures,
                "bytes_per_s",
                "tcp_stream",
                bytes as f64 / raw_s,
                Better::Higher,
                ("", 0.0),
            ));
        }
        worker.barrier()?;
        drop(worker);
        node.finalize()?;
    }
    drop(client.take());
    if let Some(s) = server {
        let _ = s.join();
    }
    // Part 2: both nodes push and pull every replicated key of the 100-float table for a while
    // under the bound; workers sample the replicas' age as they read them.
    let (len, n) = SHAPES[1];
    let mut node = start(len, n, BOUND, quick)?;
    let mut worker = node.worker();
    let table = node.table(&format!("hot{len}"))?;
    let keys: Vec<u64> = (0..n).collect();
    let mut values = vec![0.0f32; 64 * len];
    let updates = vec![0.001f32; 64 * len];
    worker.barrier()?;
    node.reset_latencies();
    let before = node.stats();
    let until = Instant::now() + if quick { Duration::from_secs(1) } else { Duration::from_secs(5) };
    let mut accesses = 0u64;
    while Instant::now() < until {
        for chunk in keys.chunks(64) {
            worker.pull(table, chunk, &mut values[..chunk.len() * len])?;
            worker.push(table, chunk, &updates[..chunk.len() * len])?;
            accesses += 2 * chunk.len() as u64;
        }
    }
    let s = node.stats().since(&before);
    worker.barrier()?;
    if rank == 0 {
        let r = s.replication;
        let bound_ms = BOUND.as_secs_f64() * 1e3;
        let figures = json!({
            "staleness_p50_ms": r.staleness.p50_ns as f64 / 1e6,
            "staleness_p99_ms": r.staleness.p99_ns as f64 / 1e6,
            "staleness_max_ms": r.staleness.max_ns as f64 / 1e6,
            "round_p50_ms": r.round_time.p50_ns as f64 / 1e6,
            "round_p99_ms": r.round_time.p99_ns as f64 / 1e6,
            "rounds": r.rounds,
            "refresh_mb": r.refresh_bytes as f64 / 1e6,
            "accesses": accesses,
            "local_share": s.local_share(),
        });
        emit(record(
            "replica_staleness",
            json!({"value_len": len, "keys": n, "bound_ms": bound_ms}),
            figures,
            "staleness_p99_ms",
            "bound_ms",
            bound_ms,
            Better::Lower,
            ("ratio<=1", 1.0),
        ));
    }
    drop(worker);
    node.finalize()?;
    Ok(())
}
