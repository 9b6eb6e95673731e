//! `ferry-bench micro`'s dynamic-table configurations (`--only dynamic`): each measured beside
//! the same configuration on a dense table in the same run, its ratio printed as `vs_dense`.
//!
//! - `dynamic_local_pull` / `dynamic_local_push`: one id at a time on one node, ids of a
//!   dynamic table against keys of a dense table of as many keys (p50 latency; target ≤ 1.5).
//! - `dynamic_insert`: new ids created by pushes in batches of 1 000 on one node, against
//!   inserts of the same ids into a `std` hash map with the same hash (single thread; target
//!   ≥ 0.5 of its rate).
//! - `dynamic_batched_pull` / `dynamic_batched_push`: 10 000 one-value ids homed at the other
//!   process of the 2-process cluster, known already, against as many dense keys there in the
//!   same order (keys per second; target ≥ 0.8).
//! - `evicting_local_pull` / `evicting_local_push`: as `dynamic_local_*`, on a table that evicts
//!   (`lfu`, with room to spare: no round runs), against the same dynamic table that does not
//!   (`vs_dynamic`: what the marks and the workers' pins cost; target ≤ 1.1).
//! - `evicting_churn`: ids never seen before streamed by pushes of 1 000 into a table that
//!   evicts with room for an eighth of them, against the same stream into a table with room
//!   for all (`vs_roomy`: ids per second; target ≥ 0.5). Once the table is short of room,
//!   eviction's admission defers such ids (`deferred_share`).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::hint::black_box;
use std::time::Instant;

use anyhow::{Context, Result};
use ferry::dynamic::{DynamicSpec, Eviction, IdMixer};
use ferry::{Config, Node, Table, TableSpec, Worker};
use serde_json::{Value, json};

use crate::micro::{Only, hist, median};
use crate::report::{Better, Record, latency_figures, record};

/// Keys of the local tables (dense and dynamic alike).
const LOCAL_KEYS: u64 = 100_000;
/// Value lengths of the local configurations.
const LOCAL_LENS: [usize; 2] = [1, 64];
/// Ids per batch of the remote configurations.
const REMOTE_KEYS: usize = 10_000;
/// Slot keys per node of the remote dynamic table.
const REMOTE_CAPACITY: u64 = 100_000;

/// The splitmix64 finaliser: raw ids that look like hashed feature ids.
fn scramble(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A record of a dynamic configuration against the dense one: `vs_dense` in its figures.
fn against_dense(name: &str, config: Value, mut figures: Value, headline: &str, dense: f64, better: Better, target: (&str, f64)) -> Record {
    let value = figures[headline].as_f64().unwrap_or(f64::NAN);
    figures["vs_dense"] = json!(value / dense);
    record(name, config, figures, headline, "dense", dense, better, target)
}

/// Whether any configuration of the 2-process cluster is selected.
pub fn wants_cluster(only: &Only) -> bool {
    ["dynamic_batched_pull", "dynamic_batched_push"].iter().any(|b| only.wants(b, &remote_config()))
}

fn remote_config() -> Value {
    json!({"keys": REMOTE_KEYS, "value_len": 1, "table": "dynamic"})
}

/// The local configurations, on a node of their own.
pub fn local(quick: bool, only: &Only) -> Result<Vec<Record>> {
    let mut records = Vec::new();
    let wanted: Vec<usize> = LOCAL_LENS
        .iter()
        .copied()
        .filter(|&len| {
            ["dynamic_local_pull", "dynamic_local_push"].iter().any(|b| only.wants(b, &json!({"keys": LOCAL_KEYS, "value_len": len, "table": "dynamic"})))
        })
        .collect();
    if !wanted.is_empty() {
        records.extend(local_access(quick, only, &wanted)?);
    }
    let insert_config = json!({"batch": 1_000, "value_len": 1, "table": "dynamic"});
    if only.wants("dynamic_insert", &insert_config) {
        records.push(insert(quick, insert_config)?);
    }
    let churn_config = json!({"batch": 1_000, "value_len": 1, "table": "dynamic", "eviction": "lfu", "room": 0.125});
    if only.wants("evicting_churn", &churn_config) {
        records.push(churn(quick, churn_config)?);
    }
    Ok(records)
}

/// One id at a time, against one key at a time of a dense table of as many keys.
fn local_access(quick: bool, only: &Only, lens: &[usize]) -> Result<Vec<Record>> {
    let mut tables = Vec::new();
    for &len in lens {
        tables.push(TableSpec::new(format!("dense{len}"), LOCAL_KEYS, len));
        tables.push(TableSpec::dynamic(format!("dynamic{len}"), len, LOCAL_KEYS));
        // Room to spare: no round runs, only the marks and pins are paid.
        tables.push(TableSpec::dynamic(format!("evicting{len}"), len, 2 * LOCAL_KEYS).evicting(Eviction::Lfu));
    }
    let mut node = Node::start(Config::new(tables))?;
    let mut worker = node.worker();
    let iterations: usize = if quick { 200_000 } else { 2_000_000 };
    let mut records = Vec::new();
    for &len in lens {
        let (dense, dynamic, evicting) = (node.table(&format!("dense{len}"))?, node.table(&format!("dynamic{len}"))?, node.table(&format!("evicting{len}"))?);
        // Every id created first: the figures are of known ids.
        let ids: Vec<u64> = (0..LOCAL_KEYS).map(scramble).collect();
        for chunk in ids.chunks(10_000) {
            worker.push(dynamic, chunk, &vec![0.0; chunk.len() * len])?;
            worker.push(evicting, chunk, &vec![0.0; chunk.len() * len])?;
        }
        let order: Vec<usize> = (0..65_536u64).map(|i| (scramble(i ^ 0x5eed) % LOCAL_KEYS) as usize).collect();
        let config = json!({"keys": LOCAL_KEYS, "value_len": len, "table": "dynamic"});
        for push in [false, true] {
            let name = if push { "dynamic_local_push" } else { "dynamic_local_pull" };
            let evicting_name = if push { "evicting_local_push" } else { "evicting_local_pull" };
            if !only.wants(name, &config) && !only.wants(evicting_name, &config) {
                continue;
            }
            let (mut dense_h, mut dynamic_h, mut evicting_h) = (hist(), hist(), hist());
            let update = vec![0.5f32; len];
            let mut out = vec![0.0f32; len];
            let block = 10_000;
            let mut done = 0;
            // Alternating blocks, so that both see the same machine.
            while done < iterations {
                for (table, h, dynamic_ids) in [(dense, &mut dense_h, false), (dynamic, &mut dynamic_h, true), (evicting, &mut evicting_h, true)] {
                    for i in done..done + block {
                        let k = order[i % order.len()];
                        let key = if dynamic_ids { ids[k] } else { k as u64 };
                        let t = Instant::now();
                        if push {
                            worker.push(table, &[key], &update)?;
                        } else {
                            worker.pull(table, &[key], &mut out)?;
                        }
                        black_box(&out);
                        h.record(t.elapsed().as_nanos() as u64).ok();
                    }
                }
                done += block;
            }
            let dense_p50 = dense_h.value_at_quantile(0.5) as f64;
            let dynamic_p50 = dynamic_h.value_at_quantile(0.5) as f64;
            if only.wants(name, &config) {
                let mut figures = latency_figures(&dynamic_h);
                figures["dense_p50_ns"] = json!(dense_p50);
                records.push(against_dense(name, config.clone(), figures, "p50_ns", dense_p50, Better::Lower, ("ratio<=1.5", 1.5)));
            }
            if only.wants(evicting_name, &config) {
                let mut figures = latency_figures(&evicting_h);
                figures["dynamic_p50_ns"] = json!(dynamic_p50);
                figures["vs_dynamic"] = json!(figures["p50_ns"].as_f64().unwrap_or(f64::NAN) / dynamic_p50);
                records.push(record(evicting_name, config.clone(), figures, "p50_ns", "dynamic", dynamic_p50, Better::Lower, ("ratio<=1.1", 1.1)));
            }
        }
    }
    drop(worker);
    node.finalize()?;
    Ok(records)
}

/// New ids created by pushes, 1 000 a batch, against inserting the same ids into a plain map.
fn insert(quick: bool, config: Value) -> Result<Record> {
    let ids_per_run: u64 = if quick { 200_000 } else { 1_000_000 };
    let runs = if quick { 3 } else { 5 };
    let mut node = Node::start(Config::new(vec![TableSpec::dynamic("fresh", 1, ids_per_run * runs as u64)]))?;
    let mut worker = node.worker();
    let table = node.table("fresh")?;
    let (mut ferry_rates, mut map_rates) = (Vec::new(), Vec::new());
    // One map over every run, as the table's index grows over every run.
    let mut map: HashMap<u64, u64, BuildHasherDefault<IdMixer>> = HashMap::default();
    for run in 0..runs as u64 {
        let ids: Vec<u64> = (run * ids_per_run..(run + 1) * ids_per_run).map(scramble).collect();
        let t = Instant::now();
        for (slot, &id) in ids.iter().enumerate() {
            map.insert(id, slot as u64);
        }
        black_box(&map);
        map_rates.push(ids.len() as f64 / t.elapsed().as_secs_f64());
        let ones = vec![1.0f32; 1_000];
        let t = Instant::now();
        for chunk in ids.chunks(1_000) {
            worker.push(table, chunk, &ones[..chunk.len()])?;
        }
        ferry_rates.push(ids.len() as f64 / t.elapsed().as_secs_f64());
    }
    let (ferry, map) = (median(&mut ferry_rates), median(&mut map_rates));
    let stats = node.stats();
    let figures = json!({"ids_per_s": ferry, "map_inserts_per_s": map, "ids_created": stats.dynamic.ids_created});
    drop(worker);
    node.finalize()?;
    Ok(record("dynamic_insert", config, figures, "ids_per_s", "hash_map_insert", map, Better::Higher, ("ratio>=0.5", 0.5)))
}

/// Ids never seen before streamed into a table that evicts with room for an eighth of them,
/// against the same stream into a table with room for all, in alternating runs.
fn churn(quick: bool, config: Value) -> Result<Record> {
    let ids_per_run: u64 = if quick { 100_000 } else { 400_000 };
    let runs = if quick { 3 } else { 5 };
    let total = ids_per_run * runs as u64;
    let mut node = Node::start(Config::new(vec![
        TableSpec::dynamic("roomy", 1, total),
        TableSpec::dynamic("evicting", 1, (ids_per_run / 8).max(1)).evicting(Eviction::Lfu),
    ]))?;
    let mut worker = node.worker();
    let (roomy, evicting) = (node.table("roomy")?, node.table("evicting")?);
    let (mut roomy_rates, mut evicting_rates) = (Vec::new(), Vec::new());
    let ones = vec![1.0f32; 1_000];
    for run in 0..runs as u64 {
        let ids: Vec<u64> = (run * ids_per_run..(run + 1) * ids_per_run).map(scramble).collect();
        for (table, rates) in [(roomy, &mut roomy_rates), (evicting, &mut evicting_rates)] {
            let t = Instant::now();
            for chunk in ids.chunks(1_000) {
                worker.push(table, chunk, &ones[..chunk.len()])?;
            }
            rates.push(ids.len() as f64 / t.elapsed().as_secs_f64());
        }
    }
    let (evicting_rate, roomy_rate) = (median(&mut evicting_rates), median(&mut roomy_rates));
    let d = node.stats().dynamic;
    let figures = json!({
        "ids_per_s": evicting_rate,
        "roomy_ids_per_s": roomy_rate,
        "vs_roomy": evicting_rate / roomy_rate,
        "ids_evicted": d.ids_evicted,
        "ids_deferred": d.ids_deferred,
        "deferred_share": d.ids_deferred as f64 / total as f64,
        "ids_streamed": total,
    });
    drop(worker);
    node.finalize()?;
    Ok(record("evicting_churn", config, figures, "ids_per_s", "roomy", roomy_rate, Better::Higher, ("ratio>=0.5", 0.5)))
}

/// The dynamic table of the 2-process cluster.
pub fn cluster_tables() -> Vec<TableSpec> {
    vec![TableSpec::dynamic("dynamic1", 1, REMOTE_CAPACITY)]
}

/// On rank 0 of the 2-process cluster: batches of ids homed at rank 1 against as many dense
/// keys held there (`dense`, a 1-value table whose upper half rank 1 holds).
pub fn remote(worker: &mut Worker, node: &Node, dense: Table, quick: bool, only: &Only) -> Result<Vec<Record>> {
    let dynamic = node.table("dynamic1")?;
    let spec: DynamicSpec = cluster_tables()[0].dynamic.context("the dynamic table has no dynamic spec")?;
    let ids: Vec<u64> = (0u64..).map(scramble).filter(|&id| spec.home_of(id, node.nodes()) == 1).take(REMOTE_KEYS).collect();
    let mut values = vec![0.25f32; REMOTE_KEYS];
    // Created (at rank 1, in this order: consecutive slot keys) and known here before anything
    // is timed.
    worker.push(dynamic, &ids, &values)?;
    // Timed in a shuffled order, the dense keys in the same one: both batches are the same
    // pattern of keys at rank 1.
    let mut order: Vec<usize> = (0..REMOTE_KEYS).collect();
    order.sort_by_key(|&i| scramble(i as u64 ^ 0xba7c));
    let first = dense.keys() / 2;
    let keys: Vec<u64> = order.iter().map(|&i| first + i as u64).collect();
    let ids: Vec<u64> = order.iter().map(|&i| ids[i]).collect();
    let reps = if quick { 5 } else { 41 };
    let mut records = Vec::new();
    for push in [false, true] {
        let name = if push { "dynamic_batched_push" } else { "dynamic_batched_pull" };
        if !only.wants(name, &remote_config()) {
            continue;
        }
        let (mut dense_t, mut dynamic_t) = (Vec::new(), Vec::new());
        for rep in 0..=reps {
            for (table, batch, times) in [(dense, &keys, &mut dense_t), (dynamic, &ids, &mut dynamic_t)] {
                let t = Instant::now();
                if push {
                    worker.push(table, batch, &values)?;
                } else {
                    worker.pull(table, batch, &mut values)?;
                }
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
        }
        let (dense_rate, dynamic_rate) = (REMOTE_KEYS as f64 / median(&mut dense_t), REMOTE_KEYS as f64 / median(&mut dynamic_t));
        let figures = json!({"keys_per_s": dynamic_rate, "dense_keys_per_s": dense_rate});
        records.push(against_dense(name, remote_config(), figures, "keys_per_s", dense_rate, Better::Higher, ("ratio>=0.8", 0.8)));
    }
    Ok(records)
}
