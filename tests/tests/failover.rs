//! Backups and failover in clusters inside one test process, over real loopback TCP: a node is
//! aborted as a crash would end it, and the survivors serve its keys from their backups with
//! every acknowledged push.

use std::time::{Duration, Instant};

use ferry::{Config, Error, Node, TableSpec};

fn config(keys: u64, value_len: usize) -> Config {
    let mut c = Config::new(vec![TableSpec::new("t", keys, value_len)]);
    c.latches = 64;
    c.relocation = false;
    c.backups = 1;
    c.peer_timeout = Duration::from_millis(800);
    c.heartbeat = Duration::from_millis(100);
    c
}

/// Pulls `keys` until the pull succeeds (a survivor may not have learnt of the loss yet, and
/// its first pulls then fail with it), at most `within`.
fn pull_after_loss(w: &mut ferry::Worker, table: ferry::Table, keys: &[u64], out: &mut [f32], within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        match w.pull(table, keys, out) {
            Ok(()) => return started.elapsed(),
            Err(Error::PeerLost { .. } | Error::KeyLost { .. }) if started.elapsed() < within => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("pull after the loss: {e}"),
        }
    }
}

/// After [`push_everything`] from three nodes, the victim's push of 10 to `victims` and a
/// survivor's of 5 to `survivors`, and the loss: pulls every key once the survivors serve them
/// again (into `out`), and checks each holds every acknowledged push.
fn check_after_loss(w: &mut ferry::Worker, table: ferry::Table, keys: u64, out: &mut [f32], victims: [u64; 2], survivors: [u64; 2]) {
    let all: Vec<u64> = (0..keys).collect();
    let took = pull_after_loss(w, table, &all, out, Duration::from_secs(10));
    for k in 0..keys {
        let mut expected = 3.0 * 20.0;
        if k % 7 == 0 {
            expected += 3.0 * 4.0 * 0.5;
        }
        if victims.contains(&k) {
            expected += 10.0;
        }
        if survivors.contains(&k) {
            expected += 5.0;
        }
        assert_eq!(&out[2 * k as usize..2 * k as usize + 2], &[expected, expected], "key {k} after the loss ({took:?})");
    }
}

/// Every node pushes 1 to every key of `all` 20 times, and 0.5 to every seventh key 4 times
/// (single-key pushes, which take the local hot path on the owner); each push is acknowledged
/// only once backed up.
fn push_everything(cluster: &[Node], table: ferry::Table, all: &[u64]) {
    std::thread::scope(|s| {
        for node in cluster {
            let mut w = node.worker();
            s.spawn(move || {
                for round in 0..20 {
                    w.push(table, all, &vec![1.0; all.len() * 2]).unwrap();
                    if round % 5 == 0 {
                        for &k in all.iter().step_by(7) {
                            w.push(table, &[k], &[0.5, 0.5]).unwrap();
                        }
                    }
                }
            });
        }
    });
}

#[test]
fn every_acknowledged_push_survives_a_lost_node() {
    let keys = 90u64;
    let mut cluster = Node::start_local_cluster(3, config(keys, 2)).unwrap();
    let table = cluster[0].table("t").unwrap();
    let all: Vec<u64> = (0..keys).collect();
    // Every node pushes to every key (local and remote rows) a known number of times.
    push_everything(&cluster, table, &all);
    let victim = cluster.remove(1);
    // The victim's own last acknowledged pushes, to its own keys (held locally), right before
    // it goes.
    {
        let mut w = victim.worker();
        w.push(table, &[30, 31], &[10.0; 4]).unwrap();
    }
    // And a survivor's acknowledged push to one of the victim's keys: the victim held its
    // answer until the push was backed up.
    cluster[0].worker().push(table, &[35, 36], &[5.0; 4]).unwrap();
    victim.abort();
    let mut w = cluster[0].worker();
    let mut out = vec![0.0; keys as usize * 2];
    check_after_loss(&mut w, table, keys, &mut out, [30, 31], [35, 36]);
    // The survivors keep working on the lost node's keys, and back them up anew: pushes are
    // still acknowledged (the backup thread now ships to the new successor).
    let mut w2 = cluster[1].worker();
    w2.push(table, &[30, 42], &[1.0; 4]).unwrap();
    w.pull(table, &[30, 42], &mut out[..4]).unwrap();
    assert_eq!(&out[..4], &[71.0, 71.0, 67.0, 67.0]);
    // Barriers go on among the survivors, and so does the shutdown.
    std::thread::scope(|s| {
        for mut worker in [w, w2] {
            s.spawn(move || worker.barrier().expect("a barrier among the survivors"));
        }
    });
    ferry_tests::finalize_all(cluster);
}

#[test]
fn backups_are_refused_where_they_are_not_built() {
    let refused = |change: &dyn Fn(&mut Config)| {
        let mut c = config(10, 1);
        c.nodes = 3;
        c.no_secret = true;
        change(&mut c);
        c.validate().unwrap_err().to_string()
    };
    assert!(refused(&|c| c.nodes = 1).contains("at most 0"));
    assert!(refused(&|c| c.backups = 3).contains("at most 2"));
    let replicated = refused(&|c| c.tables = vec![TableSpec::new("r", 10, 1).replicating(std::iter::once(0..2))]);
    assert!(replicated.contains("replicates keys"), "{replicated}");
    let mut c = config(10, 1);
    c.nodes = 3;
    c.no_secret = true;
    c.validate().unwrap();
    c.backups = 2;
    c.validate().unwrap();
    c.relocation = true;
    c.validate().unwrap();
}

/// With relocation: keys moved away from their homes (each node localizes a share of every
/// other node's keys, the lost node's among them), every node pushes to every key, and a node
/// is aborted. Its keys, wherever they were homed, and the keys homed at it that other nodes
/// hold, are served again by the survivors after the census, with every acknowledged push;
/// keys go on moving afterwards.
#[test]
fn every_acknowledged_push_survives_a_lost_node_that_moved_keys() {
    let keys = 90u64;
    let mut c = config(keys, 2);
    c.relocation = true;
    let mut cluster = Node::start_local_cluster(3, c).unwrap();
    let table = cluster[0].table("t").unwrap();
    let all: Vec<u64> = (0..keys).collect();
    for (rank, node) in cluster.iter().enumerate() {
        let mine: Vec<u64> = all.iter().copied().filter(|k| k % 3 == rank as u64 && (k / 30) as usize != rank).collect();
        node.worker().localize(table, &mine).unwrap();
    }
    push_everything(&cluster, table, &all);
    let victim = cluster.remove(1);
    // The victim's last acknowledged pushes, to keys it moved here (held locally), and a
    // survivor's to a key the victim holds away from its home.
    victim.worker().push(table, &[4, 7], &[10.0; 4]).unwrap();
    cluster[0].worker().push(table, &[13, 16], &[5.0; 4]).unwrap();
    victim.abort();
    let mut w = cluster[0].worker();
    let mut out = vec![0.0; keys as usize * 2];
    check_after_loss(&mut w, table, keys, &mut out, [4, 7], [13, 16]);
    // Keys move again among the survivors, and their pushes are still backed up.
    let mut w2 = cluster[1].worker();
    w2.localize(table, &[4, 13, 40]).unwrap();
    w2.push(table, &[4, 13, 40], &[1.0; 6]).unwrap();
    w.pull(table, &[4, 13, 40], &mut out[..6]).unwrap();
    assert_eq!(&out[..6], &[71.0, 71.0, 66.0, 66.0, 61.0, 61.0]);
    drop((w, w2));
    ferry_tests::finalize_all(cluster);
}

/// Two backups per key survive two nodes lost at once: nodes 1 and 2 of 4 (a node and its
/// first backup) are aborted together, and node 3, their first live successor, serves both
/// nodes' keys with every acknowledged push; pushes go on being backed up among the two left.
#[test]
fn two_backups_survive_two_nodes_lost_at_once() {
    let keys = 120u64;
    let mut c = config(keys, 2);
    c.backups = 2;
    let mut cluster = Node::start_local_cluster(4, c).unwrap();
    let table = cluster[0].table("t").unwrap();
    let all: Vec<u64> = (0..keys).collect();
    push_from_every_node(&cluster, table, &all, 10, 1.0);
    // The victims' own last pushes to their own keys (range partitioning: node 1 holds 30..60,
    // node 2 60..90), acknowledged right before they go.
    cluster[1].worker().push(table, &[30, 31], &[10.0; 4]).unwrap();
    cluster[2].worker().push(table, &[60, 61], &[10.0; 4]).unwrap();
    let second = cluster.remove(2);
    let first = cluster.remove(1);
    std::thread::scope(|s| {
        s.spawn(|| first.abort());
        s.spawn(|| second.abort());
    });
    let mut w = cluster[0].worker();
    let mut out = vec![0.0; keys as usize * 2];
    let took = pull_after_loss(&mut w, table, &all, &mut out, Duration::from_secs(10));
    for k in 0..keys {
        let expected = 4.0 * 10.0 + if [30, 31, 60, 61].contains(&k) { 10.0 } else { 0.0 };
        assert_eq!(&out[2 * k as usize..2 * k as usize + 2], &[expected, expected], "key {k} after the loss ({took:?})");
    }
    assert!(cluster[1].stats().backups.keys_adopted >= 60, "node 3 took over both lost nodes' keys");
    // The two survivors go on: pushes are acknowledged (each is now the other's one backup).
    let mut w3 = cluster[1].worker();
    w3.push(table, &[30, 70, 100], &[1.0; 6]).unwrap();
    // Neither survivor took the other for lost: an aborted node, like a crashed one, tells no
    // one anything on its way out.
    assert_eq!(cluster[0].lost_nodes().len(), 2, "{:?}", cluster[0].lost_nodes());
    assert_eq!(cluster[1].lost_nodes().len(), 2, "{:?}", cluster[1].lost_nodes());
    w.pull(table, &[30, 70, 100], &mut out[..6]).unwrap();
    assert_eq!(&out[..6], &[51.0, 51.0, 41.0, 41.0, 41.0, 41.0]);
    std::thread::scope(|s| {
        for mut worker in [w, w3] {
            s.spawn(move || worker.barrier().expect("a barrier among the survivors"));
        }
    });
    ferry_tests::finalize_all(cluster);
}

/// A worker pulling a node's keys while that node dies never sees the loss: a pull the loss
/// failed is repeated, served by the node's successor from its backups.
#[test]
fn pulls_in_flight_when_a_node_dies_are_repeated_at_its_successor() {
    let keys = 90u64;
    let mut cluster = Node::start_local_cluster(3, config(keys, 2)).unwrap();
    let table = cluster[0].table("t").unwrap();
    let victims: Vec<u64> = (30..60).collect();
    cluster[1].worker().push(table, &victims, &vec![1.0; victims.len() * 2]).unwrap();
    let victim = cluster.remove(1);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (pulls, errors) = std::thread::scope(|s| {
        let mut w = cluster[0].worker();
        let (victims, stop) = (&victims, &stop);
        let puller = s.spawn(move || {
            let (mut pulls, mut errors) = (0usize, Vec::new());
            let mut out = vec![0.0; victims.len() * 2];
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                match w.pull(table, victims, &mut out) {
                    Ok(()) => assert!(out.iter().all(|&v| v == 1.0), "{out:?}"),
                    Err(e) => errors.push(e.to_string()),
                }
                pulls += 1;
            }
            (pulls, errors)
        });
        std::thread::sleep(Duration::from_millis(30));
        victim.abort();
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, std::sync::atomic::Ordering::Release);
        puller.join().unwrap()
    });
    assert!(errors.is_empty(), "{} of {pulls} pulls failed: {:?}", errors.len(), &errors[..errors.len().min(3)]);
    assert!(pulls > 10, "{pulls} pulls");
    assert_eq!(cluster[0].lost_nodes().len(), 1);
    ferry_tests::finalize_all(cluster);
}

/// A node leaves gracefully while the others push to every key, its own included: no
/// operation fails, no push is lost, and its keys are served by its successor afterwards.
#[test]
fn a_node_that_leaves_hands_its_keys_over_and_nothing_is_lost() {
    let keys = 120u64;
    let rounds = 60usize;
    let mut cluster = Node::start_local_cluster(4, config(keys, 2)).unwrap();
    let table = cluster[0].table("t").unwrap();
    let all: Vec<u64> = (0..keys).collect();
    // Node 2 pushes a known amount to its own and the others' keys, then leaves while nodes
    // 0, 1 and 3 go on pushing (batches, and single keys on the local path).
    cluster[2].worker().push(table, &all, &vec![3.0; all.len() * 2]).unwrap();
    let mut leaver = cluster.remove(2);
    let errors = leave_while_pushing(&cluster, &mut leaver, table, &all, rounds, false);
    assert!(errors.is_empty(), "{} operations failed: {:?}", errors.len(), &errors[..errors.len().min(3)]);
    assert!(matches!(leaver.leave(), Err(Error::ShutDown)), "a node leaves once");
    for node in &cluster {
        assert_eq!(node.lost_nodes(), vec![(2, ferry::LEFT_REASON.to_string())], "node {}", node.rank());
    }
    let mut out = vec![0.0; keys as usize * 2];
    cluster[1].worker().pull(table, &all, &mut out).unwrap();
    for k in 0..keys {
        let mut expected = 3.0 + 3.0 * rounds as f32;
        if k % 9 == 0 {
            expected += 3.0 * (rounds / 10) as f32 * 0.5;
        }
        assert_eq!(out[k as usize * 2], expected, "key {k}");
    }
    assert_eq!(cluster[2].rank(), 3);
    assert!(cluster[2].stats().backups.keys_adopted >= keys / 4, "node 3 serves node 2's keys from its images");
    ferry_tests::finalize_all(cluster);
}

/// A node leaves gracefully a cluster that relocates keys, while the others push to every key
/// and move keys about: it gives the keys of other homes it holds back first, hands its own
/// over in its last round, and no operation fails and no push is lost.
#[test]
fn a_node_that_leaves_a_relocating_cluster_gives_keys_back_and_nothing_is_lost() {
    let keys = 120u64;
    let rounds = 60usize;
    let mut c = config(keys, 2);
    c.relocation = true;
    let mut cluster = Node::start_local_cluster(4, c).unwrap();
    let table = cluster[0].table("t").unwrap();
    let all: Vec<u64> = (0..keys).collect();
    // Every node takes a share of the others' keys (node 2, the leaver, among them), then
    // node 2 pushes a known amount to every key.
    for (rank, node) in cluster.iter().enumerate() {
        let mine: Vec<u64> = all.iter().copied().filter(|k| k % 4 == rank as u64 && (k / 30) as usize != rank).collect();
        node.worker().localize(table, &mine).unwrap();
    }
    cluster[2].worker().push(table, &all, &vec![3.0; all.len() * 2]).unwrap();
    let mut leaver = cluster.remove(2);
    let errors = leave_while_pushing(&cluster, &mut leaver, table, &all, rounds, true);
    assert!(errors.is_empty(), "{} operations failed: {:?}", errors.len(), &errors[..errors.len().min(3)]);
    for node in &cluster {
        assert_eq!(node.lost_nodes(), vec![(2, ferry::LEFT_REASON.to_string())], "node {}", node.rank());
    }
    let mut out = vec![0.0; keys as usize * 2];
    cluster[1].worker().pull(table, &all, &mut out).unwrap();
    let singles = (0..rounds).filter(|r| r % 10 < 3).count() as f32;
    for k in 0..keys {
        let mut expected = 3.0 + 3.0 * rounds as f32;
        if k % 9 == 0 {
            expected += singles * 0.5;
        }
        assert_eq!(out[k as usize * 2], expected, "key {k}");
    }
    // Not vacuous: the leaver held keys of other homes, and gave them back.
    assert!(leaver.stats().backups.keys_given_back > 0, "{:?}", leaver.stats().backups);
    ferry_tests::finalize_all(cluster);
}

/// `leaver` leaves while every node of `cluster` pushes 1 to each of `all` in `rounds` rounds,
/// and 0.5 to every ninth key alone one round in ten — in round 0, 10, …, or, with `moving`, in
/// rounds ≡ its index (mod 10), where it also localizes a seventh of the keys first. Returns
/// the errors the operations met.
fn leave_while_pushing(cluster: &[Node], leaver: &mut Node, table: ferry::Table, all: &[u64], rounds: usize, moving: bool) -> Vec<String> {
    std::thread::scope(|s| {
        let mut pushers = Vec::new();
        for (i, node) in cluster.iter().enumerate() {
            let mut w = node.worker();
            pushers.push(s.spawn(move || {
                let mut errors = Vec::new();
                for round in 0..rounds {
                    if let Err(e) = w.push(table, all, &vec![1.0; all.len() * 2]) {
                        errors.push(e.to_string());
                    }
                    if round % 10 == if moving { i } else { 0 } {
                        if moving {
                            // Keys keep moving during the leave, the leaver's own among them.
                            let some: Vec<u64> = all.iter().copied().filter(|k| k % 7 == (round % 7) as u64).collect();
                            if let Err(e) = w.localize(table, &some) {
                                errors.push(e.to_string());
                            }
                        }
                        for &k in all.iter().step_by(9) {
                            if let Err(e) = w.push(table, &[k], &[0.5, 0.5]) {
                                errors.push(e.to_string());
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                errors
            }));
        }
        std::thread::sleep(Duration::from_millis(15));
        leaver.leave().unwrap();
        pushers.into_iter().flat_map(|p| p.join().unwrap()).collect::<Vec<_>>()
    })
}

#[test]
fn leaving_is_refused_without_backups_and_on_rank_0() {
    let mut c = config(10, 1);
    c.backups = 0;
    let mut cluster = Node::start_local_cluster(2, c).unwrap();
    let refused = cluster[1].leave().unwrap_err().to_string();
    assert!(refused.contains("FERRY_BACKUPS=1"), "{refused}");
    ferry_tests::finalize_all(cluster);
    let mut cluster = Node::start_local_cluster(2, config(10, 1)).unwrap();
    let refused = cluster[0].leave().unwrap_err().to_string();
    assert!(refused.contains("rank 0"), "{refused}");
    let w = cluster[1].worker();
    assert!(matches!(cluster[1].leave(), Err(Error::WorkersAlive(1))));
    drop(w);
    ferry_tests::finalize_all(cluster);
}

/// Rank 0 coordinates barriers and departures; when it is lost the lowest-ranked survivor takes
/// over: a barrier the survivors were waiting in when it died completes, later barriers and
/// a graceful leave go on under node 1, and no acknowledged push is lost.
#[test]
fn losing_rank_0_hands_coordination_to_the_next_node() {
    let keys = 80u64;
    let mut cluster = Node::start_local_cluster(4, config(keys, 1)).unwrap();
    let table = cluster[0].table("t").unwrap();
    let all: Vec<u64> = (0..keys).collect();
    push_from_every_node(&cluster, table, &all, 10, 1.0);
    barrier_everywhere(&cluster);
    let rank_0 = cluster.remove(0);
    // Nodes 1..3 enter a barrier that rank 0 (the coordinator) never reaches: it dies while
    // they wait, and node 1 completes it.
    let waited = std::thread::scope(|s| {
        let waiters: Vec<_> = cluster
            .iter()
            .map(|node| {
                let mut w = node.worker();
                s.spawn(move || {
                    let started = Instant::now();
                    w.barrier().map(|_| started.elapsed())
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        rank_0.abort();
        waiters.into_iter().map(|w| w.join().unwrap()).collect::<Vec<_>>()
    });
    for (i, outcome) in waited.iter().enumerate() {
        assert!(outcome.is_ok(), "node {}: the barrier rank 0 never reached failed: {outcome:?}", i + 1);
    }
    let mut out = vec![0.0; keys as usize];
    let mut w = cluster[0].worker();
    pull_after_loss(&mut w, table, &all, &mut out, Duration::from_secs(10));
    assert!(out.iter().all(|&v| v == 40.0), "acknowledged pushes lost with rank 0: {:?}", &out[..8]);
    drop(w);
    // Node 1 coordinates now: it cannot leave, node 2 can (its departure begun by node 1).
    let refused = cluster[0].leave().unwrap_err().to_string();
    assert!(refused.contains("rank 1") && refused.contains("coordinates"), "{refused}");
    let mut leaver = cluster.remove(1);
    std::thread::scope(|s| {
        s.spawn(|| push_from_every_node(&cluster, table, &all, 20, 0.5));
        std::thread::sleep(Duration::from_millis(2));
        leaver.leave().expect("a leave coordinated by node 1");
    });
    // Barriers among the last two, then every push is there.
    barrier_everywhere(&cluster);
    cluster[1].worker().pull(table, &all, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 60.0), "{:?}", &out[..8]);
    assert_eq!(cluster[1].lost_nodes().len(), 2);
    ferry_tests::finalize_all(cluster);
}

/// Every node of `cluster` pushes `value` to every key of `keys`, `rounds` times (in parallel).
fn push_from_every_node(cluster: &[Node], table: ferry::Table, keys: &[u64], rounds: usize, value: f32) {
    std::thread::scope(|s| {
        for node in cluster {
            let mut w = node.worker();
            s.spawn(move || {
                for _ in 0..rounds {
                    w.push(table, keys, &vec![value; keys.len() * table.value_len()]).unwrap();
                }
            });
        }
    });
}

/// Every node of `cluster` passes a workers' barrier.
fn barrier_everywhere(cluster: &[Node]) {
    std::thread::scope(|s| {
        for node in cluster {
            let mut w = node.worker();
            s.spawn(move || w.barrier().expect("a barrier among the nodes left"));
        }
    });
}

/// A checkpoint taken after a node was lost (its keys failed over) and another left is whole:
/// the survivors' files hold every key, their manifests name the ranks gone, and a cluster of
/// another size restores every value.
#[test]
fn a_checkpoint_after_a_loss_and_a_leave_restores_every_key() {
    let keys = 120u64;
    let mut cluster = Node::start_local_cluster(4, config(keys, 2)).unwrap();
    let table = cluster[0].table("t").unwrap();
    let all: Vec<u64> = (0..keys).collect();
    let values: Vec<f32> = (0..keys * 2).map(|i| i as f32).collect();
    cluster[0].worker().push(table, &all, &values).unwrap();
    let mut leaver = cluster.remove(3);
    leaver.leave().unwrap();
    let victim = cluster.remove(1);
    victim.abort();
    let mut out = vec![0.0; values.len()];
    pull_after_loss(&mut cluster[0].worker(), table, &all, &mut out, Duration::from_secs(10));
    // Both survivors know of both departures before they cut.
    let deadline = Instant::now() + Duration::from_secs(10);
    while cluster.iter().any(|n| n.lost_nodes().len() < 2) {
        assert!(Instant::now() < deadline, "the survivors did not learn of the loss");
        std::thread::sleep(Duration::from_millis(5));
    }
    let dir = std::env::temp_dir().join(format!("ferry-failover-checkpoint-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for node in &cluster {
        node.checkpoint(&dir).unwrap();
    }
    assert_eq!(ferry::checkpoint_nodes(&dir).unwrap(), 2, "ranks 0 and 2 wrote it");
    let manifest = std::fs::read_to_string(dir.join("node-2.manifest")).unwrap();
    assert!(manifest.contains("absent\t1,3"), "{manifest}");
    ferry_tests::finalize_all(cluster);
    let mut restored = config(keys, 2);
    restored.backups = 0;
    restored.restore_from = Some(dir.clone());
    let cluster = Node::start_local_cluster(3, restored).unwrap();
    let mut out = vec![0.0; values.len()];
    cluster[1].worker().pull(table_of(&cluster[1]), &all, &mut out).unwrap();
    assert_eq!(out, values);
    ferry_tests::finalize_all(cluster);
    // A checkpoint whose writers disagree on who was gone is not whole.
    let text = std::fs::read_to_string(dir.join("node-2.manifest")).unwrap().replace("absent\t1,3", "absent\t1");
    std::fs::write(dir.join("node-2.manifest"), text).unwrap();
    let refused = ferry::checkpoint_nodes(&dir).unwrap_err().to_string();
    assert!(refused.contains("a node was lost while it was taken") || refused.contains("node-3.manifest is missing"), "{refused}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn table_of(node: &Node) -> ferry::Table {
    node.table("t").unwrap()
}

/// A worker that drops writes a loss failed (`Worker::drop_lost_writes`) pushes and sets
/// through a node's death without an error: its writes in flight to the node are dropped and
/// counted, the next ones go to the node's successor.
#[test]
fn writes_in_flight_when_a_node_dies_are_dropped_on_request() {
    let keys = 90u64;
    let mut cluster = Node::start_local_cluster(3, config(keys, 2)).unwrap();
    let table = cluster[0].table("t").unwrap();
    // The victim holds keys 30..60: pushes go to the first half, sets (of 7.0) to the second.
    let (victims, set_keys): (Vec<u64>, Vec<u64>) = ((30..45).collect(), (45..60).collect());
    let victim = cluster.remove(1);
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Two pushers and a setter on each survivor: some write is in flight to the victim when
    // it dies.
    let (pushes, errors) = std::thread::scope(|s| {
        let (victims, set_keys, stop) = (&victims, &set_keys, &stop);
        let pushers: Vec<_> = [(0, false), (0, false), (1, false), (1, false), (0, true), (1, true)]
            .into_iter()
            .map(|(n, setter)| {
                let mut w = cluster[n].worker();
                w.drop_lost_writes(true);
                s.spawn(move || {
                    let (mut pushes, mut errors) = (0usize, Vec::new());
                    while !stop.load(std::sync::atomic::Ordering::Acquire) {
                        if setter {
                            if let Err(e) = w.set(table, set_keys, &vec![7.0; set_keys.len() * 2]) {
                                errors.push(format!("set: {e}"));
                            }
                            continue;
                        }
                        if let Err(e) = w.push(table, victims, &vec![1.0; victims.len() * 2]) {
                            errors.push(format!("push: {e}"));
                        }
                        pushes += 1;
                    }
                    (pushes, errors)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(30));
        victim.abort();
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, std::sync::atomic::Ordering::Release);
        pushers.into_iter().map(|p| p.join().unwrap()).fold((0, Vec::new()), |(n, mut all), (p, e)| {
            all.extend(e);
            (n + p, all)
        })
    });
    assert!(errors.is_empty(), "{} writes failed ({pushes} pushes): {:?}", errors.len(), &errors[..errors.len().min(3)]);
    // Every push acknowledged is there; a dropped one may be or not.
    let dropped = cluster.iter().map(|n| n.stats().backups.writes_dropped).sum::<u64>() as f32;
    let mut out = vec![0.0; victims.len() * 2];
    cluster[0].worker().pull(table, &victims, &mut out).unwrap();
    let acknowledged = pushes as f32 - dropped;
    assert!(out.iter().all(|&v| v >= acknowledged && v <= pushes as f32), "values {:?} for {pushes} pushes, {dropped} dropped", &out[..2]);
    // The sets after the death reached the successor (a dropped one set the same values).
    cluster[1].worker().pull(table, &set_keys, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 7.0), "{:?}", &out[..2]);
    ferry_tests::finalize_all(cluster);
}

/// `config` with a fixed secret, so that a node started later (one that joins) is a member.
fn joinable(keys: u64, value_len: usize) -> Config {
    let mut c = config(keys, value_len);
    c.membership.secret = Some(b"a secret the nodes of this test share, 32 bytes or more".to_vec());
    c
}

/// `template` as node `rank` of `nodes`, for a node that joins.
fn as_rank(template: &Config, rank: usize, nodes: usize) -> Config {
    let mut c = template.clone();
    c.rank = rank;
    c.nodes = nodes;
    c
}

/// Every key is held by exactly one of `cluster`'s nodes; returns how many each holds.
fn holders(cluster: &[Node], table: ferry::Table, keys: u64) -> Vec<usize> {
    let mut held = vec![0; cluster.len()];
    for k in 0..keys {
        let at: Vec<usize> = (0..cluster.len()).filter(|&i| cluster[i].slot_address(table, k).unwrap().is_some()).collect();
        assert_eq!(at.len(), 1, "key {k} is held by the nodes at {at:?}");
        held[at[0]] += 1;
    }
    held
}

/// Workers on `cluster` push 1.0 to every key `rounds` times, while `during` runs; returns the
/// operations' errors.
fn push_while(cluster: &[Node], table: ferry::Table, keys: u64, rounds: usize, during: impl FnOnce()) -> Vec<String> {
    let all: Vec<u64> = (0..keys).collect();
    std::thread::scope(|s| {
        let pushers: Vec<_> = cluster
            .iter()
            .map(|node| {
                let mut w = node.worker();
                let all = &all;
                s.spawn(move || {
                    let mut errors = Vec::new();
                    for _ in 0..rounds {
                        if let Err(e) = w.push(table, all, &vec![1.0; all.len() * 2]) {
                            errors.push(e.to_string());
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    errors
                })
            })
            .collect();
        during();
        pushers.into_iter().flat_map(|p| p.join().unwrap()).collect()
    })
}

/// A node leaves, and a fresh node joins in its rank through rank 0's rendezvous address while
/// the others push to every key: nothing fails, nothing is lost, the new node holds its share
/// again (handed over by the node that served it), takes part in barriers, and can let a later
/// node in itself.
#[test]
fn a_node_joins_in_the_rank_of_one_that_left_and_takes_its_keys_back() {
    let keys = 120u64;
    let rounds = 40;
    let template = joinable(keys, 2);
    let mut cluster = Node::start_local_cluster(4, template.clone()).unwrap();
    let table = cluster[0].table("t").unwrap();
    let all: Vec<u64> = (0..keys).collect();
    cluster[2].worker().push(table, &all, &vec![3.0; all.len() * 2]).unwrap();
    let contact = cluster[0].join_addresses();
    assert_eq!(contact.len(), 2, "rank 0 takes joins at its mesh and its rendezvous address: {contact:?}");
    let mut leaver = cluster.remove(2);
    leaver.leave().unwrap();
    let mut joined = None;
    let errors = push_while(&cluster, table, keys, rounds, || {
        std::thread::sleep(Duration::from_millis(10));
        joined = Some(Node::join(as_rank(&template, 2, 4), &template_coordinator(&cluster[0])).expect("joining in rank 2"));
    });
    assert!(errors.is_empty(), "{} operations failed: {:?}", errors.len(), &errors[..errors.len().min(3)]);
    let joined = joined.unwrap();
    assert_eq!(joined.rank(), 2);
    cluster.insert(2, joined);
    for node in &cluster {
        assert!(node.lost_nodes().is_empty(), "node {} still counts {:?} as gone", node.rank(), node.lost_nodes());
    }
    let held = holders(&cluster, table, keys);
    assert!(held[2] >= keys as usize / 8, "the joined node holds {held:?}");
    assert_eq!(cluster[3].stats().backups.keys_handed, held[2] as u64, "node 3 served node 2's keys and handed them back");
    let mut out = vec![0.0; keys as usize * 2];
    cluster[2].worker().pull(table, &all, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 3.0 + 3.0 * rounds as f32), "{:?}", &out[..4]);
    // The joined node's workers push and pull like anyone's, and barriers wait for it.
    cluster[2].worker().push(table, &all, &vec![1.0; all.len() * 2]).unwrap();
    barrier_everywhere(&cluster);
    cluster[0].worker().pull(table, &all, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 4.0 + 3.0 * rounds as f32), "{:?}", &out[..4]);
    assert_eq!(cluster[2].join_addresses().len(), 1, "the joined node takes joins at its mesh address");
    ferry_tests::finalize_all(cluster);
}

/// Rank 0's rendezvous address (where every launcher points its nodes).
fn template_coordinator(rank0: &Node) -> String {
    rank0.join_addresses().last().expect("rank 0 takes joins").to_string()
}

/// A node is lost (a crash: its keys fail over to its successor's backups), and a fresh node
/// joins in its rank through a member's mesh address: every acknowledged push is there, and
/// the new node holds its share again.
#[test]
fn a_node_joins_in_the_rank_of_one_that_was_lost() {
    let keys = 90u64;
    let template = joinable(keys, 2);
    let mut cluster = Node::start_local_cluster(3, template.clone()).unwrap();
    let table = cluster[0].table("t").unwrap();
    let all: Vec<u64> = (0..keys).collect();
    for node in &cluster {
        node.worker().push(table, &all, &vec![2.0; all.len() * 2]).unwrap();
    }
    // Barriers passed before the join: the joined node's first is a later generation.
    barrier_everywhere(&cluster);
    barrier_everywhere(&cluster);
    let victim = cluster.remove(1);
    victim.abort();
    let mut out = vec![0.0; keys as usize * 2];
    pull_after_loss(&mut cluster[0].worker(), table, &all, &mut out, Duration::from_secs(10));
    let contact = cluster[1].join_addresses()[0].to_string();
    let mut joined = None;
    let errors = push_while(&cluster, table, keys, 20, || {
        joined = Some(Node::join(as_rank(&template, 1, 3), &contact).expect("joining in rank 1"));
    });
    assert!(errors.is_empty(), "{} operations failed: {:?}", errors.len(), &errors[..errors.len().min(3)]);
    cluster.insert(1, joined.unwrap());
    let held = holders(&cluster, table, keys);
    assert!(held[1] >= keys as usize / 6, "the joined node holds {held:?}");
    cluster[1].worker().pull(table, &all, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 6.0 + 2.0 * 20.0), "{:?}", &out[..4]);
    // Two barriers: the joined node waits in the second for a push the others make before it.
    barrier_everywhere(&cluster);
    std::thread::scope(|s| {
        for (i, node) in cluster.iter().enumerate() {
            let mut w = node.worker();
            s.spawn(move || {
                if i != 1 {
                    std::thread::sleep(Duration::from_millis(100));
                    w.push(table, &[7], &[1.0, 1.0]).unwrap();
                }
                w.barrier().unwrap();
                let mut seen = [0.0; 2];
                w.pull(table, &[7], &mut seen).unwrap();
                assert_eq!(seen[0], 6.0 + 2.0 * 20.0 + 2.0, "node {i} after the barrier");
            });
        }
    });
    ferry_tests::finalize_all(cluster);
}

/// A node cannot join in the rank of a live member, with other tables, or without the secret;
/// each is refused at once with a reason, and the cluster goes on.
#[test]
fn joining_is_refused_with_a_reason() {
    let template = joinable(30, 1);
    let mut cluster = Node::start_local_cluster(3, template.clone()).unwrap();
    cluster.pop().unwrap().leave().unwrap();
    let contact = cluster[0].join_addresses()[0].to_string();
    let refused = |c: Config| Node::join(c, &contact).err().expect("refused").to_string();
    let live = refused(as_rank(&template, 1, 3));
    assert!(live.contains("still connected to node 1"), "{live}");
    let mut other = joinable(31, 1);
    other.membership.secret = template.membership.secret.clone();
    let tables = refused(as_rank(&other, 2, 3));
    assert!(tables.contains("different tables or settings"), "{tables}");
    let mut stranger = as_rank(&template, 2, 3);
    stranger.membership.secret = Some(b"another secret, also of 32 bytes or more".to_vec());
    let secret = refused(stranger);
    assert!(secret.contains("cluster secret"), "{secret}");
    let mut no_backups = as_rank(&template, 2, 3);
    no_backups.backups = 0;
    assert!(refused(no_backups).contains("FERRY_BACKUPS=1"));
    let rank0 = refused(as_rank(&template, 0, 3));
    assert!(rank0.contains("join as node 0"), "{rank0}");
    let mut out = [0.0; 30];
    cluster[1].worker().pull(cluster[1].table("t").unwrap(), &(0..30).collect::<Vec<_>>(), &mut out).unwrap();
    // After all that, the rank is still free to join in.
    cluster.push(Node::join(as_rank(&template, 2, 3), &contact).unwrap());
    barrier_everywhere(&cluster);
    ferry_tests::finalize_all(cluster);
}
