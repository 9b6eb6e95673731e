//! `ferry-bench relocate`: relocation throughput between two processes against a raw TCP
//! stream of the same bytes, relocation and blocking times, and a parameter-blocking workload
//! against the same workload on a classic parameter server (relocation off).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry::{Config, Node, Partitioning, Stats, TableSpec};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use crate::cluster::emit;
use crate::micro::median;
use crate::rawtcp;
use crate::report::{Better, print_records, record};

/// (value length, keys moved per localize call).
const MOVES: [(usize, u64); 4] = [(1, 100_000), (100, 20_000), (1000, 4_000), (8000, 1_024)];

/// Keys of the parameter-blocking table unless `--blocking-keys` says otherwise.
pub const BLOCKING_KEYS: u64 = 200_000;

/// Batches of 8 keys each node accesses per sub-epoch of the parameter-blocking workload at
/// [`BLOCKING_KEYS`] keys (quick, full); they scale with the table's size.
const BLOCKING_BATCHES: (u64, u64) = (4_000, 40_000);

/// Wire bytes per relocated key: the LOCALIZE item (24) to the home, and the one-sided write of
/// the value (frame header 8, write header 24, head word 4, values) to the new owner.
fn bytes_per_key(value_len: usize) -> (usize, usize) {
    (24, 8 + 24 + 4 + 4 * value_len)
}

/// Runs the relocation benchmark on a 2-process cluster and reports.
pub fn run_driver(quick: bool, json: bool, lens: &[usize], blocking_keys: Option<u64>) -> Result<()> {
    let started = Instant::now();
    if let Some(bad) = lens.iter().find(|l| !MOVES.iter().any(|(len, _)| len == *l)) {
        bail!("--lens {bad}: the value lengths measured are {:?}", MOVES.map(|(len, _)| len));
    }
    let blocking_keys = blocking_keys_given(lens, blocking_keys)?;
    let extra = if lens.is_empty() {
        vec!["--blocking-keys".to_string(), blocking_keys.to_string()]
    } else {
        vec!["--lens".into(), lens.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(",")]
    };
    let records = crate::cluster::run_nodes_with("relocate", quick, 2, &extra)?;
    print_records("relocate", quick, started, json, &records);
    Ok(())
}

/// The parameter-blocking table's keys: as given (refused with `--lens`, which leaves the
/// workload out, even at the default's value) or the default.
fn blocking_keys_given(lens: &[usize], given: Option<u64>) -> Result<u64> {
    match given {
        Some(_) if !lens.is_empty() => bail!("--blocking-keys sizes the parameter-blocking workload, which --lens leaves out"),
        Some(keys) => check_blocking_keys(keys).map(|()| keys),
        None => Ok(BLOCKING_KEYS),
    }
}

/// The parameter-blocking table needs a block per node, and more keys than the default's
/// would only make the run longer than the full one.
fn check_blocking_keys(keys: u64) -> Result<()> {
    if !(2..=BLOCKING_KEYS).contains(&keys) {
        bail!("--blocking-keys {keys}: between 2 and {BLOCKING_KEYS}");
    }
    Ok(())
}

/// Batches per sub-epoch for a parameter-blocking table of `keys` keys: the default's, scaled
/// down with the table so that each key is accessed as often, at least one.
fn blocking_batches(quick: bool, keys: u64) -> u64 {
    let at_default = if quick { BLOCKING_BATCHES.0 } else { BLOCKING_BATCHES.1 };
    (at_default * keys / BLOCKING_KEYS).max(1)
}

fn tables(blocking_keys: u64) -> Vec<TableSpec> {
    let mut t: Vec<TableSpec> = MOVES.iter().map(|&(len, n)| TableSpec::new(format!("move{len}"), 2 * n, len)).collect();
    t.push(TableSpec::new("blocks", blocking_keys, 16).partitioned(Partitioning::Hash));
    t
}

/// One process of the cluster.
pub fn run_node(quick: bool, lens: &[usize], blocking_keys: Option<u64>) -> Result<()> {
    // The driver passes the table's size only without --lens (see `run_driver`).
    let blocking_keys = blocking_keys.unwrap_or(BLOCKING_KEYS);
    check_blocking_keys(blocking_keys)?;
    let port: u16 = std::env::var("FERRY_BENCH_PORT").context("FERRY_BENCH_PORT is not set")?.parse()?;
    let mut config = Config::from_env(tables(blocking_keys))?;
    config.relocation = true;
    config.op_timeout = crate::cluster::budget(quick);
    let mut node = Node::start(config)?;
    if node.nodes() != 2 {
        bail!("the relocation benchmark runs on exactly 2 nodes");
    }
    if node.rank() == 0 {
        eprintln!("transport: {}", node.transport());
    }
    let rank = node.rank();
    let server = if rank == 1 { Some(rawtcp::serve(port)?) } else { None };
    let mut client = if rank == 0 { Some(rawtcp::Client::connect(port)?) } else { None };
    let mut worker = node.worker();
    let rounds = if quick { 3 } else { 9 };
    for &(len, n) in MOVES.iter().filter(|(len, _)| lens.is_empty() || lens.contains(len)) {
        let table = node.table(&format!("move{len}"))?;
        // Keys homed (and held) at rank 1; rank 0 pulls them over, rank 1 takes them back.
        let keys: Vec<u64> = (n..2 * n).collect();
        let (out_bytes, back_bytes) = bytes_per_key(len);
        let (mut ferry_t, mut raw_t) = (Vec::new(), Vec::new());
        worker.barrier()?;
        node.reset_latencies();
        let before = node.stats();
        for round in 0..=rounds {
            if let Some(client) = client.as_mut() {
                let mut raw = Duration::ZERO;
                client.exchange(n as usize * out_bytes, n as usize * back_bytes, 1, |d| raw = d)?;
                let t = Instant::now();
                worker.localize(table, &keys)?;
                let elapsed = t.elapsed();
                if round > 0 {
                    ferry_t.push(elapsed.as_secs_f64());
                    raw_t.push(raw.as_secs_f64());
                }
            }
            worker.barrier()?;
            if rank == 1 {
                worker.localize(table, &keys)?;
            }
            worker.barrier()?;
        }
        if rank == 0 {
            let stats = node.stats();
            let moved = stats.since(&before);
            let (ferry_s, raw_s) = (median(&mut ferry_t), median(&mut raw_t));
            let bytes = (n as usize * (out_bytes + back_bytes)) as f64;
            let figures = json!({
                "keys_per_s": n as f64 / ferry_s,
                "values_per_s": (n as usize * len) as f64 / ferry_s,
                "bytes_per_s": bytes / ferry_s,
                "raw_bytes_per_s": bytes / raw_s,
                "relocation_p50_us": stats.relocation_time.p50_ns as f64 / 1e3,
                "relocation_p99_us": stats.relocation_time.p99_ns as f64 / 1e3,
                "blocking_p50_us": stats.blocking_time.p50_ns as f64 / 1e3,
                "blocking_p99_us": stats.blocking_time.p99_ns as f64 / 1e3,
                "keys_per_call": n,
                // This node hands the keys back in every round: keys per one-sided write.
                "keys_per_write": moved.relocations_out as f64 / moved.relocation_writes.max(1) as f64,
            });
            let config = json!({"value_len": len});
            let r = match len {
                1 => record("relocate", config, figures, "keys_per_s", "tcp_stream_keys_per_s", n as f64 / raw_s, Better::Higher, (">=1M keys/s", 1e6)),
                8000 => record("relocate", config, figures, "bytes_per_s", "tcp_stream", bytes / raw_s, Better::Higher, ("ratio>=0.7", 0.7)),
                _ => record("relocate", config, figures, "bytes_per_s", "tcp_stream", bytes / raw_s, Better::Higher, ("", 0.0)),
            };
            emit(r);
        }
    }
    drop(client.take());
    if !lens.is_empty() {
        drop(worker);
        return node.finalize().map_err(Into::into);
    }
    let dynamic = blocking_workload(&mut worker, &node, quick)?;
    worker.barrier()?;
    drop(worker);
    node.finalize()?;
    // The same workload on a classic parameter server: a second cluster with relocation off.
    let mut config = Config::from_env(tables(blocking_keys))?;
    config.relocation = false;
    let mut classic_node = Node::start(config)?;
    let mut worker = classic_node.worker();
    let classic = blocking_workload(&mut worker, &classic_node, quick)?;
    worker.barrier()?;
    drop(worker);
    classic_node.finalize()?;
    if rank == 0 {
        let figures = json!({
            "local_share": dynamic.0.local_share(),
            "accesses_per_s": dynamic.1,
            "classic_local_share": classic.0.local_share(),
            "classic_accesses_per_s": classic.1,
            "speedup": dynamic.1 / classic.1,
            "relocations": dynamic.0.relocations_in,
        });
        emit(record(
            "parameter_blocking",
            json!({"nodes": 2, "keys": blocking_keys, "value_len": 16}),
            figures,
            "local_share",
            "classic_local_share",
            classic.0.local_share(),
            Better::Higher,
            (">=0.999", 0.999),
        ));
    }
    if let Some(s) = server {
        let _ = s.join();
    }
    Ok(())
}

/// Parameter blocking: the keys form one block per node; in sub-epoch `s` node `i` localizes
/// block `(i + s) mod N` and then pulls and pushes keys of that block only. Returns this node's
/// statistics for the workload and its accesses per second.
fn blocking_workload(worker: &mut ferry::Worker, node: &Node, quick: bool) -> Result<(Stats, f64)> {
    let table = node.table("blocks")?;
    let (rank, nodes) = (node.rank() as u64, node.nodes() as u64);
    let keys = table.keys();
    let block = keys / nodes;
    let sub_epochs = 2 * nodes;
    let batches = blocking_batches(quick, keys);
    let batch = 8usize;
    let mut rng = ChaCha8Rng::seed_from_u64(rank);
    let mut values = vec![0.0f32; batch * 16];
    let update = vec![0.001f32; batch * 16];
    let mut keys_batch = vec![0u64; batch];
    worker.barrier()?;
    let before = node.stats();
    let started = Instant::now();
    let mut accesses = 0u64;
    for s in 0..sub_epochs {
        let b = (rank + s) % nodes;
        let range = b * block..((b + 1) * block).min(keys);
        let all: Vec<u64> = range.clone().collect();
        worker.localize(table, &all)?;
        for _ in 0..batches {
            for k in keys_batch.iter_mut() {
                *k = rng.gen_range(range.clone());
            }
            worker.pull(table, &keys_batch, &mut values)?;
            worker.push(table, &keys_batch, &update)?;
            accesses += 2 * batch as u64;
        }
        worker.barrier()?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok((node.stats().since(&before), accesses as f64 / elapsed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocking_batches_scale_with_the_table() {
        assert_eq!(blocking_batches(true, BLOCKING_KEYS), 4_000);
        assert_eq!(blocking_batches(false, BLOCKING_KEYS), 40_000);
        assert_eq!(blocking_batches(true, BLOCKING_KEYS / 4), 1_000);
        assert_eq!(blocking_batches(false, BLOCKING_KEYS / 4), 10_000);
        assert_eq!(blocking_batches(true, 2), 1, "a tiny table still runs a batch");
    }

    #[test]
    fn blocking_keys_out_of_range_are_refused() {
        assert!(check_blocking_keys(2).is_ok());
        assert!(check_blocking_keys(BLOCKING_KEYS).is_ok());
        for bad in [0, 1, BLOCKING_KEYS + 1] {
            let err = check_blocking_keys(bad).unwrap_err().to_string();
            assert!(err.contains("--blocking-keys"), "{err}");
        }
    }

    #[test]
    fn blocking_keys_with_lens_are_refused_even_at_the_default() {
        assert_eq!(blocking_keys_given(&[], None).unwrap(), BLOCKING_KEYS);
        assert_eq!(blocking_keys_given(&[], Some(50_000)).unwrap(), 50_000);
        assert_eq!(blocking_keys_given(&[1], None).unwrap(), BLOCKING_KEYS);
        for given in [50_000, BLOCKING_KEYS] {
            let err = blocking_keys_given(&[1], Some(given)).unwrap_err().to_string();
            assert!(err.contains("--lens"), "{err}");
        }
        assert!(blocking_keys_given(&[], Some(1)).is_err());
    }
}
