//! Feature-hashed tables (`TableSpec::feature_hashed`, Duan and Wu's model compression) on an
//! in-process 2-node cluster: workers address them by raw ids of the whole `u64` range, ids
//! that share a bucket share its value, signed tables multiply by each id's sign on every path
//! (sync, async, push-pull, set), relocation and intent take ids, ranges and sampling are
//! refused, and a checkpoint restores the buckets.

use std::collections::HashMap;

use ferry::{Config, FeatureHashing, KeyDistribution, Node, SamplingScheme, TableSpec};
use ferry_tests::{finalize_all, scratch_dir};

const BUCKETS: u64 = 16;
const LEN: usize = 2;

fn tables() -> Vec<TableSpec> {
    vec![
        TableSpec::new("plain", BUCKETS, LEN).feature_hashed(FeatureHashing { seed: 3, signed: false }),
        TableSpec::new("signed", BUCKETS, LEN).feature_hashed(FeatureHashing { seed: 3, signed: true }),
    ]
}

/// Raw ids spread over the whole `u64` range: 200 of them in 16 buckets must collide.
fn ids(rank: u64) -> Vec<u64> {
    (0..100u64).map(|i| (i + 100 * rank).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i << 60)).chain([u64::MAX - rank]).collect()
}

/// What a table of `hashing` holds after every id of `pushed` pushed `row(id)`, and so what an
/// id reads: `sign(id) · Σ sign(j) · row(j)` over the ids `j` of its bucket.
fn expected(hashing: FeatureHashing, pushed: &[u64], read: &[u64], row: impl Fn(u64) -> [f32; LEN]) -> Vec<f32> {
    let mut buckets: HashMap<u64, [f32; LEN]> = HashMap::new();
    for &id in pushed {
        let b = buckets.entry(hashing.bucket(id, BUCKETS)).or_default();
        for (x, v) in b.iter_mut().zip(row(id)) {
            *x += hashing.sign(id) * v;
        }
    }
    read.iter().flat_map(|&id| buckets.get(&hashing.bucket(id, BUCKETS)).copied().unwrap_or_default().map(|x| hashing.sign(id) * x)).collect()
}

/// A row of small integers (exact in f32 whatever the order of the additions).
fn row(id: u64) -> [f32; LEN] {
    [(id % 7) as f32 + 1.0, (id % 5) as f32 - 2.0]
}

#[test]
fn raw_ids_share_buckets_and_signs_hold_on_every_path() {
    let cluster = Node::start_local_cluster(2, Config::new(tables())).unwrap();
    let all: Vec<u64> = ids(0).into_iter().chain(ids(1)).collect();
    std::thread::scope(|s| {
        for (rank, node) in cluster.iter().enumerate() {
            let all = &all;
            s.spawn(move || {
                let mut w = node.worker();
                let mine = ids(rank as u64);
                let rows: Vec<f32> = mine.iter().flat_map(|&id| row(id)).collect();
                for name in ["plain", "signed"] {
                    let table = node.table(name).unwrap();
                    assert_eq!((table.keys(), table.feature_hashing().map(|h| h.signed)), (BUCKETS, Some(name == "signed")));
                    // Half the ids synchronously, half asynchronously.
                    let half = mine.len() / 2;
                    w.push(table, &mine[..half], &rows[..half * LEN]).unwrap();
                    let ticket = w.push_async(table, &mine[half..], &rows[half * LEN..]).unwrap();
                    w.wait(ticket).unwrap();
                }
                w.barrier().unwrap();
                for name in ["plain", "signed"] {
                    let table = node.table(name).unwrap();
                    let hashing = table.feature_hashing().unwrap();
                    let want = expected(hashing, all, all, row);
                    let mut out = vec![0.0; all.len() * LEN];
                    w.pull(table, all, &mut out).unwrap();
                    assert_eq!(out, want, "{name}: a pull on node {rank}");
                    let ticket = w.pull_async(table, all).unwrap();
                    assert_eq!(w.wait_pull(ticket).unwrap(), want, "{name}: an asynchronous pull on node {rank}");
                    // One id at a time (an unsigned table's single id skips the buffers).
                    for (i, &id) in all.iter().enumerate().step_by(37) {
                        let mut one = vec![0.0; LEN];
                        w.pull(table, &[id], &mut one).unwrap();
                        assert_eq!(one, want[i * LEN..(i + 1) * LEN], "{name}: id {id} alone on node {rank}");
                    }
                }
                w.barrier().unwrap();
                // Push-pull on the signed table: each answer holds the push it made.
                let signed = node.table("signed").unwrap();
                let hashing = signed.feature_hashing().unwrap();
                if rank == 0 {
                    let id = [all[3]];
                    let mut before = vec![0.0; LEN];
                    w.pull(signed, &id, &mut before).unwrap();
                    let mut after = vec![0.0; LEN];
                    w.push_pull(signed, &id, &[1.0, 1.0], &mut after).unwrap();
                    assert_eq!(after, [before[0] + 1.0, before[1] + 1.0], "push-pull of an id reads its own push back");
                    let ticket = w.push_pull_async(signed, &id, &[-1.0, -1.0]).unwrap();
                    assert_eq!(w.wait_pull(ticket).unwrap(), before);
                    // A set writes what the id then reads, whatever its sign.
                    w.set(signed, &id, &[5.0, -6.0]).unwrap();
                    let mut read = vec![0.0; LEN];
                    w.pull(signed, &id, &mut read).unwrap();
                    assert_eq!(read, [5.0, -6.0]);
                    // Relocation and intent take ids: the buckets of the other node's ids move here.
                    let theirs: Vec<u64> = all.iter().copied().filter(|&id| hashing.bucket(id, BUCKETS) >= BUCKETS / 2).take(8).collect();
                    w.localize(signed, &theirs).unwrap();
                    let mut local = vec![0.0; theirs.len() * LEN];
                    assert!(w.pull_if_local(signed, &theirs, &mut local).unwrap(), "localized ids are local");
                    let mut pulled = vec![0.0; theirs.len() * LEN];
                    w.pull(signed, &theirs, &mut pulled).unwrap();
                    assert_eq!(local, pulled, "a local read signs as a pull does");
                    let short = w.pull_if_local(signed, &theirs, &mut [0.0; 3]).unwrap_err().to_string();
                    assert!(short.contains("pull output"), "{short}");
                    w.intent(signed, &theirs, w.current_clock() + 1, w.current_clock() + 2).unwrap();
                    // Ranges and sampling address keys, which a hashed table's callers never see.
                    let refused = w.pull_range(signed, 0..2, &mut [0.0; 2 * LEN]).unwrap_err().to_string();
                    assert!(refused.contains("feature-hashed"), "{refused}");
                    let refused = w.register_distribution(signed, KeyDistribution::uniform(0..BUCKETS), SamplingScheme::Independent).unwrap_err().to_string();
                    assert!(refused.contains("feature-hashed"), "{refused}");
                }
                // The intent above runs the intent service: held for the checkpoint below.
                node.hold_relocations().unwrap();
                w.barrier().unwrap();
            });
        }
    });
    // A checkpoint holds the buckets; a 1-node cluster restored from it reads the same ids.
    let dir = scratch_dir("feature-hashing");
    let mut held = vec![0.0; all.len() * LEN];
    cluster[0].worker().pull(cluster[0].table("signed").unwrap(), &all, &mut held).unwrap();
    let written: Vec<ferry::Result<ferry::CheckpointInfo>> =
        std::thread::scope(|s| cluster.iter().map(|n| s.spawn(|| n.checkpoint(&dir))).collect::<Vec<_>>().into_iter().map(|h| h.join().unwrap()).collect());
    assert!(written.iter().all(Result::is_ok), "{written:?}");
    finalize_all(cluster);
    let restored = Node::start_local_cluster(1, Config::new(tables()).restoring_from(&dir)).unwrap();
    let mut read = vec![0.0; all.len() * LEN];
    restored[0].worker().pull(restored[0].table("signed").unwrap(), &all, &mut read).unwrap();
    assert_eq!(read, held);
    finalize_all(restored);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tables_of_two_seeds_differ_and_the_seed_is_part_of_the_configuration() {
    let a = Config::new(vec![TableSpec::new("t", 8, 1).feature_hashed(FeatureHashing { seed: 1, signed: false })]);
    let b = Config::new(vec![TableSpec::new("t", 8, 1).feature_hashed(FeatureHashing { seed: 2, signed: false })]);
    let difference = Config::first_difference(&a.fingerprint_text(), &b.fingerprint_text());
    assert!(difference.contains("hashed 1") && difference.contains("hashed 2"), "{difference}");
}
