//! Eviction of dynamic tables' ids (`TableSpec::evicting`) on in-process clusters over TCP:
//! ids nobody uses for a time to live are evicted and read as new afterwards while ids in use
//! keep every push; a home that runs short of slot keys evicts rather than refuses, under
//! workers of every node streaming new ids, relocating some, with every value read back
//! checked; ids intended on a table that evicts stay and keep every push.

use std::time::{Duration, Instant};

use ferry::dynamic::{Eviction, Init};
use ferry::{Config, Node, TableSpec};
use ferry_tests::{checkpoint_all, finalize_all, scratch_dir};

const LEN: usize = 2;

/// Ids spread over the whole range, distinct per `(stream, i)`.
fn id(stream: u64, i: u64) -> u64 {
    (stream << 56) ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17)
}

/// Ids touched once are evicted within two to four times the time to live, and read as new
/// afterwards; ids both nodes push every few milliseconds keep every push.
#[test]
fn unused_ids_outlive_their_time_to_live_and_read_as_new() {
    let init = Init::Uniform { scale: 0.5, seed: 3 };
    let spec = TableSpec::dynamic("emb", LEN, 10_000).initialised(init).evicting(Eviction::Ttl { millis: 300 });
    let cluster = Node::start_local_cluster(2, Config::new(vec![spec])).unwrap();
    let cold: Vec<u64> = (0..200).map(|i| id(1, i)).collect();
    let hot: Vec<u64> = (0..100).map(|i| id(2, i)).collect();
    let initial = |id: u64| {
        let mut v = vec![0.0f32; LEN];
        init.fill(id, &mut v);
        v
    };
    let pushes: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = cluster
            .iter()
            .map(|node| {
                let (cold, hot, initial) = (&cold, &hot, &initial);
                s.spawn(move || {
                    let mut w = node.worker();
                    let t = node.table("emb").unwrap();
                    // Both nodes know the cold ids; then nobody touches them.
                    let mut out = vec![0.0; cold.len() * LEN];
                    w.push_pull(t, cold, &vec![1.0; cold.len() * LEN], &mut out).unwrap();
                    w.barrier().unwrap();
                    let began = Instant::now();
                    let mut pushes = 0u64;
                    while began.elapsed() < Duration::from_millis(2_500) {
                        w.push(t, hot, &vec![1.0; hot.len() * LEN]).unwrap();
                        pushes += 1;
                        // Reading what the table holds is no use: the cold ids still go.
                        if pushes.is_multiple_of(20) {
                            let mut rows = vec![0.0; cold.len() * LEN];
                            let held = w.pull_held(t, cold, &mut rows).unwrap();
                            for (i, row) in rows.chunks_exact(LEN).enumerate() {
                                // Held: the initial value and both nodes' pushes of 1, added in turn.
                                let expected: Vec<f32> = initial(cold[i]).iter().map(|&v| if held[i] { v + 1.0 + 1.0 } else { v }).collect();
                                assert_eq!(row, &expected[..], "cold id {} (held: {})", cold[i], held[i]);
                            }
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    w.barrier().unwrap();
                    pushes
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let evicted: u64 = cluster.iter().map(|n| n.stats().dynamic.ids_evicted).sum();
    assert!(evicted >= cold.len() as u64, "{evicted} ids evicted; the {} cold ones should be", cold.len());
    let node = &cluster[1];
    let mut w = node.worker();
    let t = node.table("emb").unwrap();
    let mut out = vec![0.0; hot.len() * LEN];
    w.pull(t, &hot, &mut out).unwrap();
    let total = pushes.iter().sum::<u64>() as f32;
    for (i, &h) in hot.iter().enumerate() {
        // (Sums of f32 pushes round: a lost push would be 1 off.)
        let want: Vec<f32> = initial(h).iter().map(|v| v + total).collect();
        let got = &out[i * LEN..(i + 1) * LEN];
        assert!(got.iter().zip(&want).all(|(g, w)| (g - w).abs() < 0.05), "hot id {h} lost pushes: {got:?}, not {want:?}");
    }
    let mut out = vec![0.0; cold.len() * LEN];
    w.pull(t, &cold, &mut out).unwrap();
    for (i, &c) in cold.iter().enumerate() {
        assert_eq!(&out[i * LEN..(i + 1) * LEN], &initial(c)[..], "cold id {c} was not evicted, or came back with its old value");
    }
    drop(w);
    finalize_all(cluster);
}

/// Homes with room for 96 ids each, under 4 workers streaming 4 000 new ids each in batches
/// of 16: they evict rather than refuse, and every value read back is the id's own (its
/// initial zero plus its own pushes, or zero when its home deferred it), never another id's,
/// also for ids relocated to their worker's node.
#[test]
fn a_home_that_runs_short_evicts_and_no_id_sees_another_ids_value() {
    let spec = TableSpec::dynamic("emb", LEN, 96).evicting(Eviction::Lfu);
    let cluster = Node::start_local_cluster(2, Config::new(vec![spec])).unwrap();
    std::thread::scope(|s| {
        for node in &cluster {
            for worker in 0..2u64 {
                s.spawn(move || {
                    let mut w = node.worker();
                    let t = node.table("emb").unwrap();
                    let stream = 10 + node.rank() as u64 * 2 + worker;
                    let mut out = vec![0.0; 16 * LEN];
                    for batch in 0..250u64 {
                        let ids: Vec<u64> = (0..16).map(|i| id(stream, batch * 16 + i)).collect();
                        w.push_pull(t, &ids, &[1.0; 16 * LEN], &mut out).unwrap();
                        for (i, row) in out.chunks_exact(LEN).enumerate() {
                            assert!(row.iter().all(|&v| v == row[0]) && (row[0] == 0.0 || row[0] == 1.0), "id {} read {row:?} after its first push", ids[i]);
                        }
                        if batch % 4 == 0 {
                            w.localize(t, &ids).unwrap();
                            w.push_pull(t, &ids, &[1.0; 16 * LEN], &mut out).unwrap();
                            for (i, row) in out.chunks_exact(LEN).enumerate() {
                                assert!(
                                    row.iter().all(|&v| v == row[0]) && [0.0, 1.0, 2.0].contains(&row[0]),
                                    "id {} read {row:?} after its second push",
                                    ids[i]
                                );
                            }
                        }
                    }
                    w.barrier().unwrap();
                });
            }
        }
    });
    for node in &cluster {
        let d = node.stats().dynamic;
        assert!(d.ids_evicted > 0, "node {} evicted nothing: {d:?}", node.rank());
        assert!(d.keys_free <= 96, "{d:?}");
        assert!(d.ids_created >= d.ids_evicted, "{d:?}");
    }
    let created: u64 = cluster.iter().map(|n| n.stats().dynamic.ids_created).sum();
    assert!(created > 2 * 96, "only {created} ids were created in homes of 96 slots each");
    finalize_all(cluster);
}

/// Intent on a table that evicts: both nodes intend the same ids for the whole run, so the
/// ids get replicas on the node that does not hold them, and push them only every 150 ms — longer
/// than a time to live of 40 ms, so rounds run while they are unused — beside a stream of new
/// ids pushed once. The intended ids are never evicted and keep every push; the others are
/// evicted and read as new; a bad rule is refused.
#[test]
fn intended_ids_of_a_table_that_evicts_keep_every_push() {
    const CLOCKS: u64 = 12;
    let spec = TableSpec::dynamic("emb", LEN, 400).evicting(Eviction::Ttl { millis: 40 });
    let cluster = Node::start_local_cluster(2, Config::new(vec![spec])).unwrap();
    let hot: Vec<u64> = (0..32).map(|i| id(20, i)).collect();
    std::thread::scope(|s| {
        for node in &cluster {
            let hot = &hot;
            s.spawn(move || {
                let mut w = node.worker();
                let t = node.table("emb").unwrap();
                w.intent(t, hot, 0, 1_000).unwrap();
                for clock in 0..CLOCKS {
                    w.push(t, hot, &vec![1.0; hot.len() * LEN]).unwrap();
                    let cold: Vec<u64> = (0..16).map(|i| id(30 + node.rank() as u64, clock * 16 + i)).collect();
                    w.push(t, &cold, &vec![1.0; cold.len() * LEN]).unwrap();
                    std::thread::sleep(Duration::from_millis(150));
                    w.advance_clock().unwrap();
                }
                w.barrier().unwrap();
            });
        }
    });
    let evicted: u64 = cluster.iter().map(|n| n.stats().dynamic.ids_evicted).sum();
    assert!(evicted > 0, "no id was evicted");
    let replicas: u64 = cluster.iter().map(|n| n.stats().intent.replicas_made + n.stats().intent.replicas_kept).sum();
    assert!(replicas > 0, "no replica was made of the ids both nodes intend");
    for node in &cluster {
        let mut w = node.worker();
        let t = node.table("emb").unwrap();
        let mut out = vec![0.0; hot.len() * LEN];
        let held = w.pull_held(t, &hot, &mut out).unwrap();
        assert!(held.iter().all(|&h| h), "node {}: an intended id was evicted: {held:?}", node.rank());
        let want = 2.0 * CLOCKS as f32;
        assert!(out.iter().all(|&v| v == want), "node {}: intended ids lost pushes: {out:?}, not {want}", node.rank());
        let cold: Vec<u64> = (0..16).map(|i| id(30, i)).collect();
        let mut out = vec![0.0; cold.len() * LEN];
        w.pull(t, &cold, &mut out).unwrap();
        assert!(out.iter().all(|&v| v == 0.0), "the first cold ids were not evicted: {out:?}");
    }
    finalize_all(cluster);
    assert!("ttl:-1".parse::<Eviction>().is_err());
}

/// With a spill directory, the ids a home evicts are written with the values they had (an
/// earlier run's spill file is moved aside, not overwritten); a checkpoint includes them and
/// reads them back, and a restore on another node count starts its spill files with them.
#[test]
fn evicted_rows_are_spilled_checkpointed_and_carried_on_by_a_restore() {
    let dir = scratch_dir("spill");
    let (spill, checkpoint, restored) = (dir.join("spill"), dir.join("checkpoint"), dir.join("restored"));
    std::fs::create_dir_all(&spill).unwrap();
    std::fs::write(spill.join("emb.node-0.spill"), b"an earlier run's").unwrap();
    let init = Init::Uniform { scale: 0.5, seed: 3 };
    let tables = || vec![TableSpec::dynamic("emb", LEN, 10_000).initialised(init).evicting(Eviction::Ttl { millis: 200 })];
    let cluster = Node::start_local_cluster(2, Config::new(tables()).spilling_to(&spill)).unwrap();
    let ids: Vec<u64> = (0..150).map(|i| id(5, i)).collect();
    let pushed = |id: u64| -> Vec<f32> {
        let mut v = vec![0.0f32; LEN];
        init.fill(id, &mut v);
        v.iter().enumerate().map(|(j, x)| x + ((id % 11) as f32 + j as f32)).collect()
    };
    let mut w = cluster[0].worker();
    let t = cluster[0].table("emb").unwrap();
    let grads: Vec<f32> = ids.iter().flat_map(|&id| (0..LEN).map(move |j| (id % 11) as f32 + j as f32)).collect();
    w.push(t, &ids, &grads).unwrap();
    drop(w);
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.iter().map(|n| n.stats().dynamic.ids_evicted).sum::<u64>() < ids.len() as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    checkpoint_all(&cluster, &checkpoint);
    finalize_all(cluster);
    // Every pushed id in one node's spill file, with its value at eviction.
    let check = |spilled: &[(u64, Vec<f32>)], what: &str| {
        let mut got: Vec<u64> = spilled.iter().map(|r| r.0).collect();
        got.sort_unstable();
        let mut want = ids.clone();
        want.sort_unstable();
        assert_eq!(got, want, "{what}: every evicted id once");
        for (id, value) in spilled {
            assert_eq!(value, &pushed(*id), "{what}: id {id}");
        }
    };
    let rows = |file: ferry::dynamic::SpillFile| -> Vec<(u64, Vec<f32>)> {
        assert_eq!((file.value_len, file.torn_bytes), (LEN, 0));
        file.ids.iter().zip(file.values.chunks_exact(LEN)).map(|(&id, v)| (id, v.to_vec())).collect()
    };
    let files: Vec<(u64, Vec<f32>)> = (0..2).flat_map(|r| rows(ferry::dynamic::read_spill(spill.join(format!("emb.node-{r}.spill"))).unwrap())).collect();
    check(&files, "the spill files");
    assert_eq!(std::fs::read(spill.join("emb.node-0.spill.previous-1")).unwrap(), b"an earlier run's", "the earlier file kept");
    let read = ferry::read_checkpoint(&checkpoint).unwrap();
    let table = &read[0];
    let in_checkpoint: Vec<(u64, Vec<f32>)> = table.spilled_ids.iter().zip(table.spilled_values.chunks_exact(LEN)).map(|(&id, v)| (id, v.to_vec())).collect();
    check(&in_checkpoint, "the checkpoint");
    assert!(table.ids.is_empty(), "the table held none of them at the cut: {:?}", table.ids);
    // A damaged copy in the checkpoint is refused, naming it.
    let copy = checkpoint.join("node-1.table-0.spill");
    let good = std::fs::read(&copy).unwrap();
    let mut bad = good.clone();
    *bad.last_mut().unwrap() ^= 1;
    std::fs::write(&copy, &bad).unwrap();
    let e = ferry::read_checkpoint(&checkpoint).unwrap_err().to_string();
    assert!(e.contains("node-1.table-0.spill") && e.contains("checksum"), "{e}");
    std::fs::write(&copy, &good).unwrap();
    // Restored on one node: its spill file starts with every spilled row.
    let one = Node::start_local_cluster(1, Config::new(tables()).restoring_from(&checkpoint).spilling_to(&restored)).unwrap();
    finalize_all(one);
    check(&rows(ferry::dynamic::read_spill(restored.join("emb.node-0.spill")).unwrap()), "the restored node's spill file");
    std::fs::remove_dir_all(&dir).unwrap();
}
