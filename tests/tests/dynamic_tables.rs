//! Dynamic tables (`TableSpec::dynamic`) on in-process clusters over TCP: raw ids of the whole
//! `u64` range are created when first touched, once in the cluster however many nodes touch
//! them at once, start at their initial value, and work on every path (sync, async,
//! push-pull, set, localize, pull_if_local); a home whose share is used up refuses new ids
//! with a clear error while known ids go on; a checkpoint names the ids and restores on
//! other node counts; bad configurations are refused.

use ferry::{Config, Error, Node, TableSpec, Updater, dynamic::Init};
use ferry_tests::{checkpoint_all, finalize_all, scratch_dir};

const LEN: usize = 3;
const INIT: Init = Init::Uniform { scale: 0.5, seed: 11 };

/// Ids in awkward patterns: the ends of the range, multiples of large powers of two, a
/// multiplicative scramble.
fn ids() -> Vec<u64> {
    let mut ids: Vec<u64> = (0..300u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
    ids.extend((0..100u64).map(|i| i << 40));
    ids.extend([0, 1, u64::MAX, u64::MAX - 1]);
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn initial(id: u64) -> Vec<f32> {
    let mut v = vec![0.0; LEN];
    INIT.fill(id, &mut v);
    v
}

/// Every worker of three nodes pushes every id at once, in batches of its own order: each id
/// is created once (its home alone creates it; the sum of the nodes' created ids is the
/// number of ids), and every node reads its initial value plus every push.
#[test]
fn ids_first_touched_on_several_nodes_at_once_are_created_once() {
    let config = Config::new(vec![TableSpec::dynamic("emb", LEN, 1_000).initialised(INIT)]);
    let cluster = Node::start_local_cluster(3, config).unwrap();
    let ids = ids();
    const WORKERS: usize = 2;
    std::thread::scope(|s| {
        for node in &cluster {
            for w in 0..WORKERS {
                let ids = &ids;
                s.spawn(move || {
                    let mut worker = node.worker();
                    let table = node.table("emb").unwrap();
                    assert!(table.is_dynamic());
                    // Each worker its own order and batch size, so that first touches race.
                    let mut mine = ids.clone();
                    mine.rotate_left((node.rank() * WORKERS + w) * 37 % ids.len());
                    let batch = 7 + 13 * (node.rank() * WORKERS + w);
                    for chunk in mine.chunks(batch) {
                        let ones = vec![1.0; chunk.len() * LEN];
                        worker.push(table, chunk, &ones).unwrap();
                    }
                    worker.barrier().unwrap();
                    let total = (cluster_size() * WORKERS) as f32;
                    let mut out = vec![0.0; ids.len() * LEN];
                    worker.pull(table, ids, &mut out).unwrap();
                    for (i, &id) in ids.iter().enumerate() {
                        // (The sum's rounding depends on the order of the pushes; a key created
                        // twice would be off by whole pushes.)
                        let want: Vec<f32> = initial(id).iter().map(|v| v + total).collect();
                        let got = &out[i * LEN..(i + 1) * LEN];
                        assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-4), "id {id} on node {}: {got:?}, not {want:?}", node.rank());
                    }
                    worker.barrier().unwrap();
                });
            }
        }
    });
    let stats: Vec<_> = cluster.iter().map(|n| n.stats()).collect();
    let created: u64 = stats.iter().map(|s| s.dynamic.ids_created).sum();
    assert_eq!(created, ids.len() as u64, "an id was created twice or never");
    for (rank, s) in stats.iter().enumerate() {
        assert_eq!(s.dynamic.ids_known, ids.len() as u64, "node {rank} read every id, so it knows every one");
        assert_eq!(s.dynamic.keys_free, 1_000 - s.dynamic.ids_created);
        assert!(s.dynamic.ids_created > 0, "node {rank} is the home of no id: {:?}", s.dynamic);
    }
    finalize_all(cluster);
}

fn cluster_size() -> usize {
    3
}

/// The other paths: an asynchronous pull and push, a push-pull, a set, a localize in a
/// cluster that relocates keys (the id's slot key then reads here without the network), and
/// a pull of ids nobody touched yet (their initial values).
#[test]
fn every_path_takes_ids_and_keys_relocate() {
    let mut config = Config::new(vec![TableSpec::dynamic("emb", LEN, 500).initialised(INIT)]);
    config.relocation = true;
    let cluster = Node::start_local_cluster(2, config).unwrap();
    let ids = ids();
    let node = &cluster[0];
    let table = node.table("emb").unwrap();
    let mut w = node.worker();
    let fresh = &ids[..50];
    let mut out = vec![0.0; fresh.len() * LEN];
    w.pull(table, fresh, &mut out).unwrap();
    assert_eq!(out, fresh.iter().flat_map(|&id| initial(id)).collect::<Vec<_>>(), "untouched ids read their initial values");
    let twos = vec![2.0; ids.len() * LEN];
    let ticket = w.push_async(table, &ids, &twos).unwrap();
    w.wait(ticket).unwrap();
    let ticket = w.pull_async(table, &ids).unwrap();
    let pulled = w.wait_pull(ticket).unwrap();
    assert_eq!(pulled, ids.iter().flat_map(|&id| initial(id).into_iter().map(|v| v + 2.0)).collect::<Vec<_>>());
    let mut after = vec![0.0; ids.len() * LEN];
    w.push_pull(table, &ids, &twos, &mut after).unwrap();
    assert_eq!(after, pulled.iter().map(|v| v + 2.0).collect::<Vec<_>>(), "a push-pull reads its own push");
    let set: Vec<f32> = (0..ids.len() * LEN).map(|i| i as f32).collect();
    w.set(table, &ids, &set).unwrap();
    // Localize every id here: afterwards each reads here, without the network.
    w.localize(table, &ids).unwrap();
    let mut local = vec![0.0; ids.len() * LEN];
    assert!(w.pull_if_local(table, &ids, &mut local).unwrap(), "a localized id is not here");
    assert_eq!(local, set);
    // An id nobody has touched is not here (and pull_if_local does not create it).
    let mut one = vec![0.0; LEN];
    assert!(!w.pull_if_local(table, &[0xdead_beef_0000_0001], &mut one).unwrap());
    // Node 1 reads the values node 0 set, through the new owner.
    let mut w1 = cluster[1].worker();
    let mut there = vec![0.0; ids.len() * LEN];
    w1.pull(cluster[1].table("emb").unwrap(), &ids, &mut there).unwrap();
    assert_eq!(there, set);
    assert!(cluster[0].stats().relocations_in > 0, "nothing relocated");
    // Ranges of ids are refused with the reason.
    let e = w.pull_range(table, 0..4, &mut [0.0; 4 * LEN]).unwrap_err().to_string();
    assert!(e.contains("is dynamic"), "{e}");
    drop((w, w1));
    finalize_all(cluster);
}

/// A home whose share is used up refuses the ids it would have to create, naming the table
/// and itself; ids already created go on being read and pushed.
#[test]
fn a_full_home_refuses_new_ids_and_keeps_the_known_ones() {
    let config = Config::new(vec![TableSpec::dynamic("small", 1, 4)]);
    let cluster = Node::start_local_cluster(2, config).unwrap();
    let node = &cluster[0];
    let table = node.table("small").unwrap();
    let mut w = node.worker();
    let mut created = Vec::new();
    let mut full = None;
    for id in 0..100u64 {
        match w.push(table, &[id], &[1.0]) {
            Ok(()) => created.push(id),
            Err(e) => full = Some(e),
        }
    }
    assert_eq!(created.len(), 8, "two nodes of four keys each");
    match full {
        Some(Error::TableFull { table, capacity, .. }) => assert_eq!((table.as_str(), capacity), ("small", 4)),
        other => panic!("expected TableFull, got {other:?}"),
    }
    let mut out = vec![0.0; created.len()];
    w.pull(table, &created, &mut out).unwrap();
    assert_eq!(out, vec![1.0; created.len()]);
    drop(w);
    finalize_all(cluster);
}

/// `pull_held` reads what a table holds and creates nothing, even where a pull creates every
/// id it reads (admission of all): ids never touched read as absent with their initial
/// values, on the node that is their home and on the other; pushed ids read as held with
/// their values, known locally or not.
#[test]
fn pull_held_reads_what_a_table_holds_and_creates_nothing() {
    let config = Config::new(vec![TableSpec::dynamic("emb", LEN, 1_000).initialised(INIT)]);
    let cluster = Node::start_local_cluster(2, config).unwrap();
    let table = cluster[0].table("emb").unwrap();
    let (mut w0, mut w1) = (cluster[0].worker(), cluster[1].worker());
    let ids = ids();
    let created = |cluster: &[Node]| cluster.iter().map(|n| n.stats().dynamic.ids_created).sum::<u64>();
    let mut out = vec![0.0; ids.len() * LEN];
    for w in [&mut w0, &mut w1] {
        let held = w.pull_held(table, &ids, &mut out).unwrap();
        assert!(held.iter().all(|h| !h), "nothing was pushed yet");
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(&out[i * LEN..(i + 1) * LEN], &initial(id)[..], "id {id} reads its initial value");
        }
    }
    assert_eq!(created(&cluster), 0, "pull_held created ids");
    // Every other id pushed once, by node 0: node 1 knows none of them yet.
    let pushed: Vec<u64> = ids.iter().copied().step_by(2).collect();
    w0.push(table, &pushed, &vec![1.0; pushed.len() * LEN]).unwrap();
    for w in [&mut w0, &mut w1] {
        let held = w.pull_held(table, &ids, &mut out).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(held[i], i % 2 == 0, "id {id}");
            let expected: Vec<f32> = initial(id).iter().map(|v| v + if i % 2 == 0 { 1.0 } else { 0.0 }).collect();
            assert_eq!(&out[i * LEN..(i + 1) * LEN], &expected[..], "id {id}");
        }
    }
    assert_eq!(created(&cluster), pushed.len() as u64, "pull_held created ids");
    // A pull creates what it reads under this admission: pull_held sees them afterwards.
    w1.pull(table, &ids, &mut out).unwrap();
    assert!(w0.pull_held(table, &ids, &mut out).unwrap().iter().all(|&h| h));
    // Bad output lengths are refused as by a pull.
    assert!(w0.pull_held(table, &ids, &mut out[1..]).is_err());
    drop((w0, w1));
    finalize_all(cluster);
}

/// Configurations that cannot work are refused with what is wrong.
#[test]
fn bad_dynamic_configurations_are_refused() {
    let mut with_backups = Config::new(vec![TableSpec::dynamic("t", 2, 10)]);
    with_backups.backups = 1;
    let cases = [
        (Config::new(vec![TableSpec::dynamic("t", 2, 0)]), "capacity of 0"),
        (Config::new(vec![TableSpec::dynamic("t", 2, u64::MAX / 2)]), "fewer than"),
        (Config::new(vec![TableSpec::dynamic("t", 2, 10).partitioned(ferry::Partitioning::Hash)]), "cannot have a partitioning"),
        (Config::new(vec![TableSpec::dynamic("t", 2, 10).replicating_keys([0u64, 1])]), "replicated ranges"),
        (Config::new(vec![TableSpec::dynamic("t", 2, 10).feature_hashed(ferry::FeatureHashing { seed: 1, signed: false })]), "feature hashing"),
        (with_backups, "backups"),
        (Config::new(vec![TableSpec::new("t", 10, 2).replicating_ids([1u64])]), "only a dynamic table"),
        (Config::new(vec![TableSpec::dynamic("t", 2, 2).replicating_ids(0..20u64)]), "more than its 2 keys per node"),
    ];
    for (config, says) in cases {
        let e = Node::start_local_cluster(2, config).err().expect("a bad configuration started").to_string();
        assert!(e.contains(says), "expected '{says}' in: {e}");
    }
}

/// A checkpoint of a dynamic table names its records by id: it restores on one node and on
/// three (each id at its new home, with its value and its updater's state), every id once, new
/// ids are still created afterwards; read whole outside a cluster it gives the ids with their
/// rows.
#[test]
fn a_dynamic_table_restores_on_other_node_counts() {
    let tables = || vec![TableSpec::dynamic("emb", LEN, 1_000).initialised(INIT).with_updater("adagrad:0.1".parse::<Updater>().unwrap())];
    let dir = scratch_dir("dynamic-checkpoint");
    let cluster = Node::start_local_cluster(2, Config::new(tables())).unwrap();
    let ids = ids();
    // Node 0 pushes the first half, node 1 the second, then each pulls everything.
    std::thread::scope(|s| {
        for node in &cluster {
            let ids = &ids;
            s.spawn(move || {
                let mut w = node.worker();
                let table = node.table("emb").unwrap();
                let half = ids.len() / 2;
                let mine = if node.rank() == 0 { &ids[..half] } else { &ids[half..] };
                let grads: Vec<f32> = mine.iter().flat_map(|&id| [(id % 7) as f32 - 3.0, 1.0, -0.5]).collect();
                w.push(table, mine, &grads).unwrap();
                w.barrier().unwrap();
            });
        }
    });
    let mut w = cluster[0].worker();
    let table = cluster[0].table("emb").unwrap();
    let mut before = vec![0.0; ids.len() * LEN];
    w.pull(table, &ids, &mut before).unwrap();
    drop(w);
    checkpoint_all(&cluster, &dir);
    finalize_all(cluster);
    // Read whole outside a cluster: its ids ascending, with their rows.
    let whole = ferry::read_checkpoint(&dir).unwrap();
    let emb = &whole[0];
    let mut sorted: Vec<(u64, &[f32])> = ids.iter().copied().zip(before.chunks(LEN)).collect();
    sorted.sort_unstable_by_key(|r| r.0);
    assert!(emb.dynamic && emb.keys == ids.len() as u64);
    assert_eq!(emb.ids, sorted.iter().map(|r| r.0).collect::<Vec<_>>());
    assert_eq!(emb.values, sorted.iter().flat_map(|r| r.1.iter().copied()).collect::<Vec<_>>());
    for nodes in [1, 3] {
        let restored = Node::start_local_cluster(nodes, Config::new(tables()).restoring_from(&dir)).unwrap();
        let created: u64 = restored.iter().map(|n| n.stats().dynamic.ids_created).sum();
        assert_eq!(created, ids.len() as u64, "on {nodes} nodes: every id once");
        let node = &restored[nodes - 1];
        let table = node.table("emb").unwrap();
        let mut w = node.worker();
        let mut after = vec![0.0; ids.len() * LEN];
        w.pull(table, &ids, &mut after).unwrap();
        assert_eq!(after, before, "on {nodes} nodes");
        // The updater's state came along: the same gradient moves a restored id as it moves
        // it in the cluster that wrote the checkpoint (AdaGrad's step shrinks as its sums grow).
        w.push(table, &ids[..1], &[1.0, 1.0, 1.0]).unwrap();
        let mut one = vec![0.0; LEN];
        w.pull(table, &ids[..1], &mut one).unwrap();
        // (Element 1 took a gradient of 1 before: 0.1/√2 ≈ 0.071 with its sum restored, 0.1
        // without.)
        let step = (before[1] - one[1]).abs();
        assert!(step > 0.05 && step < 0.08, "on {nodes} nodes: an AdaGrad step of {step} after the restore");
        // New ids are created as before.
        let fresh = [u64::MAX / 3, 12_345];
        w.push(table, &fresh, &[1.0; 2 * LEN]).unwrap();
        assert_eq!(restored.iter().map(|n| n.stats().dynamic.ids_created).sum::<u64>(), ids.len() as u64 + 2);
        drop(w);
        finalize_all(restored);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Equal up to the rounding of sums taken in another order.
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert!(got.len() == want.len() && got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-4), "{what}: {got:?} vs {want:?}");
}

/// Replicated ids (`TableSpec::replicating_ids`, hybrid mode's hot ids): every node reads
/// them at their initial values from the start and pushes them without a message; after a
/// barrier every copy holds every node's pushes; a table that evicts by time to live never
/// evicts them while it evicts the ids around them; a checkpoint restores every copy on other
/// node counts.
#[test]
fn replicated_ids_are_pushed_everywhere_kept_and_restored() {
    use ferry::dynamic::Eviction;
    let hot: Vec<u64> = vec![0, 7, 1 << 40, u64::MAX - 1, 0x9e37_79b9_7f4a_7c15];
    let tables =
        |hot: &[u64]| vec![TableSpec::dynamic("emb", LEN, 64).initialised(INIT).evicting(Eviction::Ttl { millis: 30 }).replicating_ids(hot.iter().copied())];
    let dir = scratch_dir("dynamic-replicated");
    let cluster = Node::start_local_cluster(3, Config::new(tables(&hot))).unwrap();
    let rounds = 20;
    let expect = |pushes: f32| -> Vec<f32> { hot.iter().flat_map(|&id| initial(id).into_iter().map(move |v| v + pushes)).collect() };
    std::thread::scope(|s| {
        for node in &cluster {
            let (hot, expect) = (&hot, &expect);
            s.spawn(move || {
                let mut w = node.worker();
                let t = node.table("emb").unwrap();
                let mut out = vec![0.0; hot.len() * LEN];
                w.pull(t, hot, &mut out).unwrap();
                assert_eq!(out, expect(0.0), "node {}: the replicated ids start at their initial values", node.rank());
                w.barrier().unwrap();
                for i in 0..rounds {
                    // One id at a time and in a batch with new ids: both paths keep deltas.
                    if i % 2 == 0 {
                        for &id in hot {
                            w.push(t, &[id], &[1.0; LEN]).unwrap();
                        }
                    } else {
                        let fresh = 1_000_000 + (node.rank() * rounds + i) as u64;
                        let ids: Vec<u64> = hot.iter().copied().chain([fresh]).collect();
                        w.push(t, &ids, &vec![1.0; ids.len() * LEN]).unwrap();
                    }
                }
                w.barrier().unwrap();
                w.pull(t, hot, &mut out).unwrap();
                assert_close(&out, &expect((3 * rounds) as f32), &format!("node {}: every node's pushes", node.rank()));
                w.barrier().unwrap();
            });
        }
    });
    // Time to live: the new ids go, the replicated ones stay with their pushes.
    let evicted = || cluster.iter().map(|n| n.stats().dynamic.ids_evicted).sum::<u64>();
    let started = std::time::Instant::now();
    while evicted() < 3 * rounds as u64 / 2 && started.elapsed() < std::time::Duration::from_secs(20) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(evicted(), 3 * rounds as u64 / 2, "every new id was evicted");
    for node in &cluster {
        let s = node.stats();
        assert!(s.replication.replica_accesses > 0, "node {}: {:?}", node.rank(), s.replication);
        let mut w = node.worker();
        let mut out = vec![0.0; hot.len() * LEN];
        w.pull(node.table("emb").unwrap(), &hot, &mut out).unwrap();
        assert_close(&out, &expect((3 * rounds) as f32), &format!("node {}: the replicated ids are never evicted", node.rank()));
    }
    checkpoint_all(&cluster, &dir);
    finalize_all(cluster);
    // On other node counts, every copy is restored (not only the home's), and a node that
    // replicates an id the checkpoint held as an ordinary one takes it into its copy too.
    let more: Vec<u64> = hot.iter().copied().chain([1_000_000]).collect();
    for nodes in [1, 2] {
        let restored = Node::start_local_cluster(nodes, Config::new(tables(&hot)).restoring_from(&dir)).unwrap();
        for node in &restored {
            let mut w = node.worker();
            let mut out = vec![0.0; hot.len() * LEN];
            w.pull(node.table("emb").unwrap(), &hot, &mut out).unwrap();
            assert_close(&out, &expect((3 * rounds) as f32), &format!("on {nodes} nodes, node {}", node.rank()));
        }
        finalize_all(restored);
    }
    // The checkpoint holds no id 1 000 000 (evicted, no spill): it starts at its initial value.
    let restored = Node::start_local_cluster(2, Config::new(tables(&more)).restoring_from(&dir)).unwrap();
    for node in &restored {
        let mut w = node.worker();
        let mut out = vec![0.0; LEN];
        w.pull(node.table("emb").unwrap(), &[1_000_000], &mut out).unwrap();
        assert_eq!(out, initial(1_000_000));
    }
    finalize_all(restored);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A count filter on two nodes: an id's first pushes are counted at its home and dropped, its
/// pulls read its initial value meanwhile, the third push creates it (holding that push only),
/// a set creates an id at once, and a batch mixing admitted and waiting ids works on every
/// path, asynchronous ones included.
#[test]
fn a_count_filter_admits_an_id_at_its_third_push() {
    let spec = TableSpec::dynamic("emb", LEN, 1_000).initialised(INIT).admitting("count:3".parse().unwrap());
    let cluster = Node::start_local_cluster(2, Config::new(vec![spec])).unwrap();
    let node = &cluster[0];
    let table = node.table("emb").unwrap();
    let mut w = node.worker();
    let ids = ids();
    let ones = vec![1.0; ids.len() * LEN];
    let created = || cluster.iter().map(|n| n.stats().dynamic.ids_created).sum::<u64>();
    let init: Vec<f32> = ids.iter().flat_map(|&id| initial(id)).collect();
    let mut out = vec![0.0; ids.len() * LEN];
    w.pull(table, &ids, &mut out).unwrap();
    assert_eq!((out.clone(), created()), (init.clone(), 0), "a pull creates nothing under a filter");
    w.push(table, &ids, &ones).unwrap();
    w.push(table, &ids, &ones).unwrap();
    w.pull(table, &ids, &mut out).unwrap();
    assert_eq!((out.clone(), created()), (init.clone(), 0), "two pushes are counted, not stored");
    // The third push: half of the ids through node 1, asynchronously.
    let half = ids.len() / 2;
    let mut w1 = cluster[1].worker();
    let ticket = w1.push_async(cluster[1].table("emb").unwrap(), &ids[..half], &ones[..half * LEN]).unwrap();
    w1.wait(ticket).unwrap();
    assert_eq!(created(), half as u64);
    // A batch of admitted and waiting ids: asynchronous pull, push-pull.
    let ticket = w.pull_async(table, &ids).unwrap();
    let mixed = w.wait_pull(ticket).unwrap();
    let want: Vec<f32> = init.iter().enumerate().map(|(i, v)| if i < half * LEN { v + 1.0 } else { *v }).collect();
    assert!(mixed.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-6), "admitted ids hold their third push only");
    let ticket = w.push_pull_async(table, &ids, &ones).unwrap();
    let after = w.wait_pull(ticket).unwrap();
    // The first half took the push; the second half's third push admitted them with it.
    let want: Vec<f32> = init.iter().enumerate().map(|(i, v)| if i < half * LEN { v + 2.0 } else { v + 1.0 }).collect();
    assert!(after.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5), "{:?} vs {:?}", &after[..6], &want[..6]);
    assert_eq!(created(), ids.len() as u64);
    // A set creates an id at once.
    w.set(table, &[77, 78], &[5.0; 2 * LEN]).unwrap();
    let mut two = vec![0.0; 2 * LEN];
    w.pull(table, &[77, 78], &mut two).unwrap();
    assert_eq!(two, vec![5.0; 2 * LEN]);
    drop((w, w1));
    finalize_all(cluster);
}

/// A checkpoint keeps what a count filter counted: ids pushed twice under `count:3` before it
/// are admitted by one more push after a restore, on the node count that wrote it and on
/// another; ids never pushed still wait for three.
#[test]
fn a_restore_keeps_the_pushes_a_count_filter_counted() {
    let tables = || vec![TableSpec::dynamic("emb", LEN, 1_000).initialised(INIT).admitting("count:3".parse().unwrap())];
    let dir = scratch_dir("admission-checkpoint");
    let counted: Vec<u64> = ids();
    let fresh: Vec<u64> = (0..50u64).map(|i| (i + 1) << 20).collect();
    let cluster = Node::start_local_cluster(2, Config::new(tables())).unwrap();
    let mut w = cluster[0].worker();
    let table = cluster[0].table("emb").unwrap();
    let ones = vec![1.0; counted.len() * LEN];
    w.push(table, &counted, &ones).unwrap();
    w.push(table, &counted, &ones).unwrap();
    drop(w);
    checkpoint_all(&cluster, &dir);
    finalize_all(cluster);
    assert!(dir.join("node-0.admission").exists() && dir.join("node-1.admission").exists());
    for nodes in [2, 1] {
        let cluster = Node::start_local_cluster(nodes, Config::new(tables()).restoring_from(&dir)).unwrap();
        let mut w = cluster[0].worker();
        let table = cluster[0].table("emb").unwrap();
        w.push(table, &counted, &ones).unwrap();
        w.push(table, &fresh, &vec![1.0; fresh.len() * LEN]).unwrap();
        let mut out = vec![0.0; counted.len() * LEN];
        let held = w.pull_held(table, &counted, &mut out).unwrap();
        assert!(held.iter().all(|&h| h), "{nodes} node(s): ids counted twice before the checkpoint are admitted by a third push");
        for (i, &id) in counted.iter().enumerate() {
            let want: Vec<f32> = initial(id).iter().map(|v| v + 1.0).collect();
            assert_eq!(&out[i * LEN..(i + 1) * LEN], &want[..], "{nodes} node(s): id {id} holds its third push");
        }
        let mut rows = vec![0.0; fresh.len() * LEN];
        assert!(w.pull_held(table, &fresh, &mut rows).unwrap().iter().all(|&h| !h), "{nodes} node(s): new ids still wait");
        drop(w);
        finalize_all(cluster);
    }
    // A damaged admission file is refused, naming it.
    let file = dir.join("node-1.admission");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[20] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let e = Node::start_local_cluster(2, Config::new(tables()).restoring_from(&dir)).err().expect("a damaged checkpoint restored").to_string();
    assert!(e.contains("node-1.admission") && e.contains("checksum"), "{e}");
}
