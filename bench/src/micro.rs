//! `ferry-bench micro`: local and remote access, each against a baseline measured in the same
//! run: a memcpy for local pulls, a plain store and a read-modify-write (`+=`) for local pushes,
//! the better of a blocking and a busy-polling raw TCP ping-pong for single remote keys, and a
//! raw TCP stream of the same bytes for batches. `--only` picks configurations by name, and
//! `--repeat` measures each several times and reports the median ratio with its spread.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry::{Config, Node, Table, TableSpec, Worker};
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use crate::rawtcp::{self, Wait};
use crate::report::{Better, Record, latency_figures, print_records, record};

/// Local tables: (value length, keys). The large ("cold") tables do not fit in the caches, so
/// every access misses; the small ("hot") ones do, so the figures show the path itself.
const LOCAL_LENS: [(usize, u64); 3] = [(1, 1_000_000), (64, 100_000), (1024, 10_000)];
const HOT_KEYS: u64 = 4096;
const REMOTE_LENS: [usize; 3] = [1, 64, 1024];
/// Batched configurations: (keys per operation, value length).
const BATCHES: [(u64, usize); 4] = [(300_000, 1), (1_000_000, 1), (30_000, 100), (300_000, 100)];

/// Wire bytes of a one-key request and its response: frame header 8, message length 4, ACCESS or
/// RESPONSE header 24, then the key or the values.
fn single_key_sizes(value_len: usize, push: bool) -> (usize, usize) {
    let request = 8 + 4 + 24 + 8 + if push { value_len * 4 } else { 0 };
    let response = 8 + 4 + 24 + if push { 0 } else { value_len * 4 };
    (request, response)
}

/// A latency histogram in ns, from 1 ns to a minute, 3 significant digits.
pub(crate) fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The `q` quantile of `v` (not empty) by the nearest rank: the smallest value with at least
/// a `q` share of the values at or below it.
pub(crate) fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1]
}

/// Which configurations to run: alternatives separated by commas, each selecting the
/// configurations in whose `"<benchmark> <configuration>"` every one of its space-separated
/// terms occurs, e.g. `batched_push value_len=1` or `remote,batched` (everything that goes over
/// the network). An empty pattern selects everything.
#[derive(Debug, Clone, Default)]
pub struct Only {
    alternatives: Vec<Vec<String>>,
}

impl Only {
    /// A filter from a pattern (`None` or empty: everything).
    pub fn new(pattern: Option<&str>) -> Only {
        let alternatives = pattern
            .unwrap_or_default()
            .split(',')
            .map(|alt| alt.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            .filter(|terms| !terms.is_empty())
            .collect();
        Only { alternatives }
    }

    /// Whether a configuration is selected.
    pub fn wants(&self, bench: &str, config: &serde_json::Value) -> bool {
        let text = format!("{bench} {}", crate::report::config_text(config));
        self.alternatives.is_empty() || self.alternatives.iter().any(|terms| terms.iter().all(|t| text.contains(t.as_str())))
    }

    /// The pattern, for passing on to cluster nodes.
    pub fn pattern(&self) -> String {
        self.alternatives.iter().map(|terms| terms.join(" ")).collect::<Vec<_>>().join(",")
    }
}

/// Whether the filter selects any configuration that runs on the 2-process cluster.
fn wants_cluster(only: &Only) -> bool {
    let remote = REMOTE_LENS.iter().flat_map(|&len| ["remote_pull", "remote_push"].map(|b| (b, json!({"value_len": len, "keys": 1}))));
    let batched = BATCHES.iter().flat_map(|&(keys, len)| ["batched_push", "batched_pull"].map(|b| (b, json!({"keys": keys, "value_len": len}))));
    remote.chain(batched).any(|(b, c)| only.wants(b, &c)) || only.wants(crate::stages::BENCH, &crate::stages::config()) || crate::dynamic::wants_cluster(only)
}

/// Runs the whole micro benchmark: local figures in this process, remote ones in a 2-process
/// cluster of this binary.
pub fn run_driver(quick: bool, json: bool, only: &Only, repeat: usize) -> Result<()> {
    let started = Instant::now();
    let repeat = repeat.max(1);
    let mut records = Vec::new();
    for _ in 0..repeat {
        records.extend(local_benchmarks(quick, only)?);
        records.extend(crate::dynamic::local(quick, only)?);
    }
    if wants_cluster(only) {
        let mut extra = vec!["--repeat".to_string(), repeat.to_string()];
        if !only.pattern().is_empty() {
            extra.extend(["--only".to_string(), only.pattern()]);
        }
        records.extend(crate::cluster::run_nodes_with("micro", quick, 2, &extra)?);
    }
    let records = crate::report::merge_repeats(records);
    print_records("micro", quick, started, json, &records);
    Ok(())
}

fn local_benchmarks(quick: bool, only: &Only) -> Result<Vec<Record>> {
    let mut tables: Vec<TableSpec> = LOCAL_LENS.iter().map(|&(len, keys)| TableSpec::new(format!("local{len}"), keys, len)).collect();
    tables.extend(LOCAL_LENS.iter().map(|&(len, _)| TableSpec::new(format!("hot{len}"), HOT_KEYS, len)));
    let mut node = Node::start(Config::new(tables))?;
    let mut worker = node.worker();
    let iterations: usize = if quick { 300_000 } else { 3_000_000 };
    let mut records = Vec::new();
    let timer_cost = timer_overhead();
    let configurations = LOCAL_LENS.iter().map(|&(len, keys)| (len, keys, "cold")).chain(LOCAL_LENS.iter().map(|&(len, _)| (len, HOT_KEYS, "hot")));
    for (len, keys, cache) in configurations {
        let config = json!({"value_len": len, "keys": keys, "cache": cache});
        if !only.wants("local_pull", &config) && !only.wants("local_push", &config) {
            continue;
        }
        let table = node.table(&format!("{}{len}", if cache == "hot" { "hot" } else { "local" }))?;
        let mut rng = ChaCha8Rng::seed_from_u64(len as u64);
        let order: Vec<u64> = (0..65_536).map(|_| rng.gen_range(0..keys)).collect();
        let plain = vec![1.0f32; keys as usize * len];
        let mut plain_mut = plain.clone();
        let mut out = vec![0.0f32; len];
        let update = vec![0.5f32; len];
        for push in [false, true] {
            let name = if push { "local_push" } else { "local_pull" };
            if !only.wants(name, &config) {
                continue;
            }
            // Baselines: a memcpy of the value (pull); a plain store and a read-modify-write of
            // it (push: a push reads the value it adds to, a plain store does not wait for its
            // cache miss).
            let (mut ferry_h, mut base_h, mut rmw_h) = (hist(), hist(), hist());
            let block = 10_000;
            let mut done = 0;
            while done < iterations {
                for i in done..done + block {
                    let k = order[i % order.len()] as usize;
                    let t = Instant::now();
                    if push {
                        plain_mut[k * len..(k + 1) * len].copy_from_slice(&update);
                        black_box(&plain_mut);
                    } else {
                        out.copy_from_slice(&plain[k * len..(k + 1) * len]);
                        black_box(&out);
                    }
                    base_h.record(t.elapsed().as_nanos() as u64).ok();
                }
                if push {
                    for i in done..done + block {
                        let k = order[(i + 7919) % order.len()] as usize;
                        let t = Instant::now();
                        for (x, u) in plain_mut[k * len..(k + 1) * len].iter_mut().zip(&update) {
                            *x += u;
                        }
                        black_box(&plain_mut);
                        rmw_h.record(t.elapsed().as_nanos() as u64).ok();
                    }
                }
                for i in done..done + block {
                    let k = order[i % order.len()];
                    let t = Instant::now();
                    if push {
                        worker.push(table, &[k], &update)?;
                    } else {
                        worker.pull(table, &[k], &mut out)?;
                    }
                    black_box(&out);
                    ferry_h.record(t.elapsed().as_nanos() as u64).ok();
                }
                done += block;
            }
            let mut figures = latency_figures(&ferry_h);
            figures["timer_overhead_ns"] = json!(timer_cost);
            let (baseline, base_p50) = if push {
                figures["store_p50_ns"] = json!(base_h.value_at_quantile(0.5));
                ("memcpy_rmw", rmw_h.value_at_quantile(0.5))
            } else {
                ("memcpy", base_h.value_at_quantile(0.5))
            };
            records.push(record(name, config.clone(), figures, "p50_ns", baseline, base_p50 as f64, Better::Lower, ("ratio<=3", 3.0)));
        }
    }
    drop(worker);
    node.finalize()?;
    Ok(records)
}

/// Median cost of one `Instant::now()` pair, included in every per-operation sample above.
fn timer_overhead() -> u64 {
    let mut h = hist();
    for _ in 0..100_000 {
        let t = Instant::now();
        h.record(t.elapsed().as_nanos() as u64).ok();
    }
    h.value_at_quantile(0.5)
}

/// A member of the 2-process cluster (started by the driver through `ferry::launch`).
pub fn run_node(quick: bool, only: &Only, repeat: usize) -> Result<()> {
    let port: u16 = std::env::var("FERRY_BENCH_PORT").context("FERRY_BENCH_PORT is not set")?.parse()?;
    let mut tables: Vec<TableSpec> = REMOTE_LENS.iter().map(|&l| TableSpec::new(format!("remote{l}"), 1024, l)).collect();
    tables.push(TableSpec::new("bulk1", 2_000_000, 1));
    tables.push(TableSpec::new("bulk100", 600_000, 100));
    tables.extend(crate::dynamic::cluster_tables());
    let mut config = Config::from_env(tables)?;
    config.max_message_bytes = 4 << 20;
    // Rank 1 waits in one barrier while rank 0 measures everything.
    config.op_timeout = crate::cluster::budget(quick);
    let mut node = Node::start(config)?;
    if node.nodes() != 2 {
        bail!("the micro benchmark runs on exactly 2 nodes");
    }
    if node.rank() == 0 {
        eprintln!("transport: {}", node.transport());
    }
    let mut worker = node.worker();
    let stages = only.wants(crate::stages::BENCH, &crate::stages::config());
    if node.rank() == 1 {
        let server = rawtcp::serve(port)?;
        if stages {
            crate::stages::serve(&mut worker, port)?;
        }
        worker.barrier()?;
        drop(worker);
        let _ = server.join();
        node.finalize()?;
        return Ok(());
    }
    let mut client = rawtcp::Client::connect(port)?;
    let emit = crate::cluster::emit;
    for _ in 0..repeat.max(1) {
        for &len in &REMOTE_LENS {
            let table = node.table(&format!("remote{len}"))?;
            for push in [false, true] {
                if only.wants(if push { "remote_push" } else { "remote_pull" }, &json!({"value_len": len, "keys": 1})) {
                    emit(remote_latency(&mut worker, &mut client, table, len, push, quick)?);
                }
            }
        }
        for &(keys, len) in &BATCHES {
            let table = node.table(if len == 1 { "bulk1" } else { "bulk100" })?;
            for push in [true, false] {
                if only.wants(if push { "batched_push" } else { "batched_pull" }, &json!({"keys": keys, "value_len": len})) {
                    emit(batched(&mut worker, &mut client, table, keys, len, push, quick)?);
                }
            }
        }
    }
    if crate::dynamic::wants_cluster(only) {
        for r in crate::dynamic::remote(&mut worker, &node, node.table("bulk1")?, quick, only)? {
            emit(r);
        }
    }
    if stages {
        emit(crate::stages::measure(&mut worker, &mut client, node.table("remote1")?, port, quick)?);
    }
    let stats = node.stats();
    eprintln!("rank 0: {} remote key accesses, {} messages, {} bytes sent", stats.remote_accesses, stats.traffic.total_messages(), stats.traffic.total_bytes());
    drop(client);
    worker.barrier()?;
    drop(worker);
    node.finalize()?;
    Ok(())
}

fn remote_latency(worker: &mut Worker, client: &mut rawtcp::Client, table: Table, len: usize, push: bool, quick: bool) -> Result<Record> {
    let iterations = if quick { 6_000 } else { 60_000 };
    let block = 1_000;
    let remote_keys: Vec<u64> = (table.keys() / 2..table.keys()).collect();
    let (req, resp) = single_key_sizes(len, push);
    let (mut ferry_h, mut blocking_h, mut busy_h) = (hist(), hist(), hist());
    let mut out = vec![0.0f32; len];
    let update = vec![1.0f32; len];
    // Warm all paths up.
    client.exchange_with(Wait::Blocking, req, resp, 200, |_| {})?;
    client.exchange_with(Wait::BusyPoll, req, resp, 200, |_| {})?;
    for i in 0..200 {
        worker.pull(table, &[remote_keys[i % remote_keys.len()]], &mut out)?;
    }
    let mut done = 0;
    while done < iterations {
        client.exchange_with(Wait::Blocking, req, resp, block as u64 / 2, |d| {
            blocking_h.record(d.as_nanos() as u64).ok();
        })?;
        client.exchange_with(Wait::BusyPoll, req, resp, block as u64 / 2, |d| {
            busy_h.record(d.as_nanos() as u64).ok();
        })?;
        for i in done..done + block {
            let k = remote_keys[i % remote_keys.len()];
            let t = Instant::now();
            if push {
                worker.push(table, &[k], &update)?;
            } else {
                worker.pull(table, &[k], &mut out)?;
            }
            ferry_h.record(t.elapsed().as_nanos() as u64).ok();
        }
        done += block;
    }
    let (blocking, busy) = (blocking_h.value_at_quantile(0.5), busy_h.value_at_quantile(0.5));
    let mut figures = latency_figures(&ferry_h);
    figures["request_bytes"] = json!(req);
    figures["response_bytes"] = json!(resp);
    figures["blocking_pingpong_p50_ns"] = json!(blocking);
    figures["busy_pingpong_p50_ns"] = json!(busy);
    Ok(record(
        if push { "remote_push" } else { "remote_pull" },
        json!({"value_len": len, "keys": 1}),
        figures,
        "p50_ns",
        "tcp_pingpong_best",
        blocking.min(busy) as f64,
        Better::Lower,
        ("ratio<=1.3", 1.3),
    ))
}

fn batched(worker: &mut Worker, client: &mut rawtcp::Client, table: Table, keys: u64, len: usize, push: bool, quick: bool) -> Result<Record> {
    let first = table.keys() / 2;
    let batch: Vec<u64> = (first..first + keys).collect();
    let mut values = vec![0.25f32; keys as usize * len];
    let (req, resp) = if push { (keys as usize * (8 + 4 * len), 40) } else { (keys as usize * 8, keys as usize * 4 * len) };
    // Enough alternating pairs for a stable median: at least 9 (3 when quick), more for short
    // operations, up to about a second of Ferry's time.
    let (min_reps, max_reps) = if quick { (3, 10) } else { (9, 40) };
    let (mut ferry_t, mut base_t) = (Vec::new(), Vec::new());
    let mut spent = Duration::ZERO;
    for rep in 0..=max_reps {
        if rep > min_reps && spent > Duration::from_secs(if quick { 0 } else { 1 }) {
            break;
        }
        let mut base = Duration::ZERO;
        client.exchange(req, resp, 1, |d| base = d)?;
        let t = Instant::now();
        if push {
            worker.push(table, &batch, &values)?;
        } else {
            worker.pull(table, &batch, &mut values)?;
        }
        let ferry = t.elapsed();
        spent += ferry;
        if rep > 0 {
            ferry_t.push(ferry.as_secs_f64());
            base_t.push(base.as_secs_f64());
        }
    }
    let ferry_s = median(&mut ferry_t);
    let base_s = median(&mut base_t);
    let bytes = (req + resp) as f64;
    let keys_per_s = keys as f64 / ferry_s;
    let figures = json!({
        "keys_per_s": keys_per_s,
        "bytes_per_s": bytes / ferry_s,
        "values_per_s": keys_per_s * len as f64,
        "op_ms": ferry_s * 1e3,
        "raw_bytes_per_s": bytes / base_s,
    });
    let name = if push { "batched_push" } else { "batched_pull" };
    let config = json!({"keys": keys, "value_len": len});
    Ok(if len == 1 {
        record(name, config, figures, "keys_per_s", "tcp_stream_keys_per_s", keys as f64 / base_s, Better::Higher, ("ratio>=0.6", 0.6))
    } else {
        record(name, config, figures, "bytes_per_s", "tcp_stream", bytes / base_s, Better::Higher, ("ratio>=0.9", 0.9))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_selects_by_every_term_of_any_alternative() {
        let remote = ("remote_pull", json!({"keys": 1, "value_len": 64}));
        let batched = ("batched_push", json!({"keys": 300_000, "value_len": 1}));
        let local = ("local_pull", json!({"cache": "cold", "keys": 1000, "value_len": 1}));
        let picks = |pattern: Option<&str>| {
            let only = Only::new(pattern);
            [&remote, &batched, &local].map(|(b, c)| only.wants(b, c))
        };
        assert_eq!(picks(None), [true; 3]);
        assert_eq!(picks(Some(" , ")), [true; 3], "no terms: everything");
        assert_eq!(picks(Some("remote")), [true, false, false]);
        assert_eq!(picks(Some("value_len=1 batched")), [false, true, false], "terms of one alternative all hold");
        assert_eq!(picks(Some("remote,batched")), [true, true, false]);
        assert_eq!(picks(Some("remote value_len=1,local cold")), [false, false, true]);
        assert_eq!(Only::new(Some("remote  value_len=64 ,batched")).pattern(), "remote value_len=64,batched", "passed on to the nodes as it selects");
    }
}
