//! Checkpoints of clusters inside one test process (real loopback TCP): written by every node,
//! restored on other node counts and partitionings, refused when incomplete, damaged or written
//! for other tables.

use std::path::{Path, PathBuf};

use ferry::{Config, Node, Partitioning, TableSpec, Updater};
use ferry_tests::finalize_all;

const ADDED: u64 = 101;
const LEARNED: u64 = 57;

fn tables(added: Partitioning, learned: Partitioning) -> Vec<TableSpec> {
    vec![
        // Plain sums, with a few replicated keys.
        TableSpec::new("added", ADDED, 3).partitioned(added).replicating(std::iter::once(0..4)),
        // AdaGrad: the restore must bring the optimizer state back, not only the values.
        TableSpec::new("learned", LEARNED, 2).partitioned(learned).with_updater(Updater::adagrad(0.1)),
        // A scratch table (a trainer's per-epoch figures): left out of checkpoints, so a
        // restore may size it otherwise (see `resized_scratch`).
        TableSpec::new("figures", 7, 2).scratch(),
    ]
}

/// `tables` with the scratch table sized for a run of `epochs`.
fn resized_scratch(mut tables: Vec<TableSpec>, epochs: u64) -> Vec<TableSpec> {
    tables[2].keys = epochs + 2;
    tables
}

fn config(tables: Vec<TableSpec>) -> Config {
    let mut c = Config::new(tables);
    c.latches = 64;
    c
}

fn scratch(what: &str) -> PathBuf {
    ferry_tests::scratch_dir(&format!("checkpoint-{what}"))
}

/// Every key of both tables, pulled by node 0's worker.
fn pull_all(cluster: &[Node]) -> (Vec<f32>, Vec<f32>) {
    let mut worker = cluster[0].worker();
    let (added, learned) = (cluster[0].table("added").unwrap(), cluster[0].table("learned").unwrap());
    let mut a = vec![0.0; ADDED as usize * 3];
    worker.pull(added, &(0..ADDED).collect::<Vec<_>>(), &mut a).unwrap();
    let mut l = vec![0.0; LEARNED as usize * 2];
    worker.pull(learned, &(0..LEARNED).collect::<Vec<_>>(), &mut l).unwrap();
    (a, l)
}

/// The same gradient on every learned key, then the learned values: AdaGrad's step depends on
/// the state accumulated so far.
fn step_learned(cluster: &[Node]) -> Vec<f32> {
    let mut worker = cluster[0].worker();
    let learned = cluster[0].table("learned").unwrap();
    let keys: Vec<u64> = (0..LEARNED).collect();
    // A worker's pull sees its own pushes (per-key sequential consistency): no barrier, which
    // would wait for the other nodes' workers.
    worker.push(learned, &keys, &vec![0.5; keys.len() * 2]).unwrap();
    let mut out = vec![0.0; keys.len() * 2];
    worker.pull(learned, &keys, &mut out).unwrap();
    out
}

/// Every node checkpoints into `dir` at once.
fn checkpoint(cluster: &[Node], dir: &Path) -> Vec<ferry::Result<ferry::CheckpointInfo>> {
    std::thread::scope(|s| {
        cluster.iter().map(|node| s.spawn(move || node.checkpoint(dir))).collect::<Vec<_>>().into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A 2-node cluster whose workers pushed to every key (and moved some keys away from their
/// homes), checkpointed into `dir`; returns it with what it holds.
fn trained_cluster(dir: &Path) -> (Vec<Node>, (Vec<f32>, Vec<f32>)) {
    let cluster = Node::start_local_cluster(2, config(tables(Partitioning::Range, Partitioning::Hash))).unwrap();
    std::thread::scope(|s| {
        for (rank, node) in cluster.iter().enumerate() {
            s.spawn(move || {
                let mut worker = node.worker();
                let (added, learned) = (node.table("added").unwrap(), node.table("learned").unwrap());
                for round in 0..5u64 {
                    let keys: Vec<u64> = (0..ADDED).filter(|k| (k + round + rank as u64).is_multiple_of(3)).collect();
                    if round == 2 {
                        let movable: Vec<u64> = keys.iter().copied().filter(|&k| k >= 4).collect();
                        worker.localize(added, &movable).unwrap();
                    }
                    let update: Vec<f32> = keys.iter().flat_map(|&k| [k as f32, 1.0 + rank as f32, 0.25 * round as f32]).collect();
                    worker.push(added, &keys, &update).unwrap();
                    let keys: Vec<u64> = (0..LEARNED).filter(|k| (k + round) % 2 == rank as u64).collect();
                    let grads: Vec<f32> = keys.iter().flat_map(|&k| [(k % 5) as f32 - 2.0, 0.1 * round as f32]).collect();
                    worker.push(learned, &keys, &grads).unwrap();
                    worker.push(node.table("figures").unwrap(), &[3], &[1.0, 2.0]).unwrap();
                    worker.advance_clock().unwrap();
                }
                if rank == 1 {
                    // Node 1's worker is a clock ahead: the checkpoint keeps the slowest's.
                    worker.advance_clock().unwrap();
                }
                worker.barrier().unwrap();
            });
        }
    });
    let held = pull_all(&cluster);
    for written in checkpoint(&cluster, dir) {
        written.unwrap();
    }
    (cluster, held)
}

#[test]
fn a_checkpoint_restores_on_other_node_counts_and_partitionings() {
    let dir = scratch("restore");
    let (original, held) = trained_cluster(&dir);
    assert!(held.0.iter().any(|&v| v != 0.0) && held.1.iter().any(|&v| v != 0.0));
    let mut stepped = Vec::new();
    for (nodes, added, learned) in [
        (3, Partitioning::Hash, Partitioning::Range),
        (1, Partitioning::Range, Partitioning::Hash),
        (2, Partitioning::Hash, Partitioning::Hash),
        (4, Partitioning::consistent(), Partitioning::Consistent { virtual_nodes: 3 }),
    ] {
        let restored = Node::start_local_cluster(nodes, config(resized_scratch(tables(added, learned), 10 + nodes as u64)).restoring_from(&dir)).unwrap();
        assert_eq!(pull_all(&restored), held, "{nodes} node(s), {added:?}/{learned:?}");
        // The workers count on from the slowest worker's clock at the checkpoint.
        assert!(restored.iter().all(|node| node.worker().current_clock() == 5), "{nodes} node(s): the clock did not come back");
        let mut figures = vec![1.0; 2];
        restored[0].worker().pull(restored[0].table("figures").unwrap(), &[3], &mut figures).unwrap();
        assert_eq!(figures, [0.0, 0.0], "a scratch table starts at zeros");
        if nodes == 3 {
            // 3 → 2: the restored cluster's own checkpoint, restored on 2 nodes.
            let again = scratch("restore-3");
            for written in checkpoint(&restored, &again) {
                written.unwrap();
            }
            let two = Node::start_local_cluster(2, config(tables(Partitioning::Range, Partitioning::Range)).restoring_from(&again)).unwrap();
            assert_eq!(pull_all(&two), held, "3 -> 2 nodes");
            finalize_all(two);
            let _ = std::fs::remove_dir_all(&again);
        }
        stepped.push(step_learned(&restored));
        finalize_all(restored);
    }
    // The optimizer state came back too: the same step gives the same values as on the cluster
    // that wrote the checkpoint.
    let reference = step_learned(&original);
    for s in &stepped {
        assert_eq!(s, &reference);
    }
    // A second checkpoint needs a directory of its own.
    let again = checkpoint(&original, &dir);
    assert!(again.iter().all(|r| r.as_ref().is_err_and(|e| e.to_string().contains("already holds a checkpoint"))), "{again:?}");
    finalize_all(original);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Intent signalling moves keys on its own: a checkpoint is refused while it may, and taken
/// once every node held its relocations (`Node::hold_relocations`, which returns when the
/// relocations in flight landed); it restores to what the cluster held.
#[test]
fn intent_relocations_are_held_for_a_checkpoint() {
    let dir = scratch("intent");
    let cluster = Node::start_local_cluster(2, config(tables(Partitioning::Range, Partitioning::Hash))).unwrap();
    std::thread::scope(|s| {
        for (rank, node) in cluster.iter().enumerate() {
            s.spawn(move || {
                let mut worker = node.worker();
                let added = node.table("added").unwrap();
                // Each node intends the other's half of the keys (the replicated ones aside) for
                // a long window, and pushes to them clock after clock: the service moves them.
                let wanted: Vec<u64> = (4..ADDED).filter(|&k| (k < ADDED / 2) == (rank == 1)).collect();
                worker.intent(added, &wanted, 0, 1_000).unwrap();
                for clock in 0..20u64 {
                    worker.push(added, &wanted, &vec![1.0 + clock as f32; wanted.len() * 3]).unwrap();
                    worker.advance_clock().unwrap();
                }
                worker.barrier().unwrap();
            });
        }
    });
    let held = pull_all(&cluster);
    let refused = checkpoint(&cluster, &dir);
    assert!(refused.iter().all(|r| r.as_ref().is_err_and(|e| e.to_string().contains("hold_relocations"))), "{refused:?}");
    let _ = std::fs::remove_dir_all(&dir);
    std::thread::scope(|s| {
        for node in &cluster {
            s.spawn(move || node.hold_relocations().unwrap());
        }
    });
    for written in checkpoint(&cluster, &dir) {
        written.unwrap();
    }
    for node in &cluster {
        node.release_relocations();
    }
    let restored = Node::start_local_cluster(1, config(tables(Partitioning::Range, Partitioning::Range)).restoring_from(&dir)).unwrap();
    assert_eq!(pull_all(&restored), held);
    finalize_all(restored);
    finalize_all(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starting one node from `dir` with `tables`: the error's text.
fn refusal(dir: &Path, tables: Vec<TableSpec>) -> String {
    match Node::start(config(tables).restoring_from(dir)) {
        Ok(node) => {
            finalize_all(vec![node]);
            panic!("{} was restored", dir.display())
        }
        Err(e) => e.to_string(),
    }
}

fn copy_of(dir: &Path, what: &str) -> PathBuf {
    let copy = scratch(what);
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    copy
}

#[test]
fn incomplete_damaged_and_mismatched_checkpoints_are_refused_by_name() {
    let dir = scratch("refusals");
    let (original, held) = trained_cluster(&dir);
    finalize_all(original);
    let fitting = || tables(Partitioning::Range, Partitioning::Range);
    // The checkpoint as written restores.
    let node = Node::start(config(fitting()).restoring_from(&dir)).unwrap();
    assert_eq!(pull_all(std::slice::from_ref(&node)), held);
    finalize_all(vec![node]);
    // A node that did not finish: its manifest is missing.
    let incomplete = copy_of(&dir, "incomplete");
    std::fs::remove_file(incomplete.join("node-1.manifest")).unwrap();
    let e = refusal(&incomplete, fitting());
    assert!(e.contains("node-1.manifest is missing"), "{e}");
    // A crash at each step of a node's writing (values file partly written, written but not
    // renamed, renamed without a manifest, manifest written but not renamed): never restored.
    for (step, state) in ["values being written", "values not renamed", "no manifest yet", "manifest not renamed"].iter().enumerate() {
        let crashed = copy_of(&dir, &format!("crashed-{step}"));
        let (values, manifest) = (crashed.join("node-1.values"), crashed.join("node-1.manifest"));
        match step {
            0 => {
                let bytes = std::fs::read(&values).unwrap();
                std::fs::write(crashed.join("node-1.values.partial"), &bytes[..bytes.len() / 3]).unwrap();
                std::fs::remove_file(&values).unwrap();
                std::fs::remove_file(&manifest).unwrap();
            }
            1 => {
                std::fs::rename(&values, crashed.join("node-1.values.partial")).unwrap();
                std::fs::remove_file(&manifest).unwrap();
            }
            2 => std::fs::remove_file(&manifest).unwrap(),
            _ => std::fs::rename(&manifest, crashed.join("node-1.manifest.partial")).unwrap(),
        }
        let e = refusal(&crashed, fitting());
        assert!(e.contains("node-1.manifest is missing"), "{state}: {e}");
        let _ = std::fs::remove_dir_all(&crashed);
    }
    // A flipped byte and a cut file, named.
    let flipped = copy_of(&dir, "flipped");
    let mut bytes = std::fs::read(flipped.join("node-0.values")).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(flipped.join("node-0.values"), &bytes).unwrap();
    let e = refusal(&flipped, fitting());
    assert!(e.contains("node-0.values") && e.contains("checksum"), "{e}");
    let cut = copy_of(&dir, "cut");
    let bytes = std::fs::read(cut.join("node-1.values")).unwrap();
    std::fs::write(cut.join("node-1.values"), &bytes[..bytes.len() / 2]).unwrap();
    let e = refusal(&cut, fitting());
    assert!(e.contains("node-1.values") && e.contains("bytes where its manifest says"), "{e}");
    // A manifest of another checkpoint.
    let mixed = copy_of(&dir, "mixed");
    let text = std::fs::read_to_string(mixed.join("node-1.manifest")).unwrap();
    std::fs::write(mixed.join("node-1.manifest"), text.replace("sequence\t1", "sequence\t2")).unwrap();
    let e = refusal(&mixed, fitting());
    assert!(e.contains("node-1.manifest is from another checkpoint"), "{e}");
    // Tables that do not fit, each named with its setting.
    let mut wider = fitting();
    wider[0].value_len = 4;
    let e = refusal(&dir, wider);
    assert!(e.contains("table 'added'") && e.contains("value length is 3"), "{e}");
    let mut plain = fitting();
    plain[1].updater = Updater::Add;
    let e = refusal(&dir, plain);
    assert!(e.contains("table 'learned'") && e.contains("updater"), "{e}");
    let mut renamed = fitting();
    renamed[0].name = "other".into();
    let e = refusal(&dir, renamed);
    assert!(e.contains("name is 'added'"), "{e}");
    let e = refusal(&scratch("nowhere"), fitting());
    assert!(e.contains("node-0.manifest is missing"), "{e}");
    for d in [dir, incomplete, flipped, cut, mixed] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// A scratch table before a replicated one: the restore still gives every node its replicas
/// of the replicated keys (the scratch table, left out of the files, does not shift which
/// table a record's key is looked up in). Node 1 reads keys homed at node 0 from its replica
/// at once.
#[test]
fn replicas_restore_behind_a_scratch_table() {
    let tables = || vec![TableSpec::new("figures", 3, 2).scratch(), TableSpec::new("added", 10, 2).replicating(std::iter::once(0..4))];
    let dir = scratch("behind-scratch");
    let cluster = Node::start_local_cluster(2, config(tables())).unwrap();
    std::thread::scope(|s| {
        for node in &cluster {
            s.spawn(move || {
                let mut w = node.worker();
                let added = node.table("added").unwrap();
                w.push(added, &[0, 1, 2, 3], &[1.0; 8]).unwrap();
                w.barrier().unwrap();
            });
        }
    });
    checkpoint(&cluster, &dir).into_iter().for_each(|r| {
        r.unwrap();
    });
    finalize_all(cluster);
    let mut restored_config = config(tables());
    // Refreshes far apart: what node 1 reads is what the restore put in its replicas.
    restored_config.staleness = std::time::Duration::from_secs(30);
    let restored = Node::start_local_cluster(2, restored_config.restoring_from(&dir)).unwrap();
    let mut w = restored[1].worker();
    let mut out = [0.0; 8];
    w.pull(restored[1].table("added").unwrap(), &[0, 1, 2, 3], &mut out).unwrap();
    assert_eq!(out, [2.0; 8], "node 1's replicas after the restore");
    assert_eq!(restored[1].stats().remote_accesses, 0, "read from the replicas");
    drop(w);
    finalize_all(restored);
    let _ = std::fs::remove_dir_all(&dir);
}
