//! Replicated keys (NuPS, Section 3.2) on in-process clusters over loopback TCP: replicas serve
//! locally, pushes from every node converge at the home and in every replica without loss,
//! recorded histories keep the bounded-staleness guarantee, sets go home, replicated keys never
//! relocate, and bad configurations are refused.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use ferry::testing::consistency::{TimedPull, TimedPush, check_bounded_staleness, push_update};
use ferry::{Config, Error, Node, TableSpec};
use ferry_tests::finalize_all;

const KEYS: u64 = 96;

/// One node's pushes and pulls, per key.
type NodeHistory = (Vec<Vec<TimedPush>>, Vec<Vec<TimedPull>>);

fn cluster(nodes: usize, value_len: usize, staleness: Duration) -> Vec<Node> {
    let mut c = Config::new(vec![TableSpec::new("t", KEYS, value_len).replicating([0..4, 40..44, 90..96])]);
    c.latches = 64;
    c.staleness = staleness;
    Node::start_local_cluster(nodes, c).unwrap()
}

fn replicated() -> Vec<u64> {
    (0..4).chain(40..44).chain(90..96).collect()
}

#[test]
fn pushes_from_every_node_converge_without_loss() {
    let nodes = cluster(3, 2, Duration::from_millis(20));
    let rounds = 50;
    std::thread::scope(|s| {
        for node in &nodes {
            s.spawn(move || {
                let mut w = node.worker();
                let t = w.table("t").unwrap();
                let keys = replicated();
                let ones = vec![1.0f32; keys.len() * 2];
                for i in 0..rounds {
                    // Alternate one-key and batched calls: both local paths keep deltas.
                    if i % 2 == 0 {
                        w.push(t, &keys, &ones).unwrap();
                    } else {
                        for &k in &keys {
                            w.push(t, &[k], &[1.0, 1.0]).unwrap();
                        }
                    }
                }
                w.barrier().unwrap();
                let mut out = vec![0.0; keys.len() * 2];
                w.pull(t, &keys, &mut out).unwrap();
                assert!(out.iter().all(|&v| v == (3 * rounds) as f32), "node {}: {out:?}", node.rank());
                // One key at a time, through the single-key path.
                for &k in &keys {
                    let mut one = [0.0; 2];
                    w.pull(t, &[k], &mut one).unwrap();
                    assert_eq!(one, [(3 * rounds) as f32; 2]);
                }
                w.barrier().unwrap();
            });
        }
    });
    for node in &nodes {
        let s = node.stats();
        assert_eq!(s.remote_accesses, 0, "replicated keys never leave the node: {s:?}");
        assert!(s.replication.replica_accesses > 0);
        assert!(s.replication.refresh_reads > 0 && s.replication.refresh_bytes > 0, "refreshes are one-sided reads: {:?}", s.replication);
        assert!(s.replication.shipped_keys > 0);
        assert_eq!(s.relocations_in + s.relocations_out, 0);
    }
    finalize_all(nodes);
}

#[test]
fn own_pushes_are_visible_at_once_and_others_within_the_bound() {
    let nodes = cluster(2, 1, Duration::from_millis(30));
    // Key 90 is homed at node 1; node 0 holds a replica.
    let mut w0 = nodes[0].worker();
    let mut w1 = nodes[1].worker();
    let t = w0.table("t").unwrap();
    w0.push(t, &[90], &[2.0]).unwrap();
    let mut v = [0.0];
    w0.pull(t, &[90], &mut v).unwrap();
    assert_eq!(v, [2.0], "a replica includes its own node's pushes at once");
    w1.push(t, &[90], &[5.0]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        w0.pull(t, &[90], &mut v).unwrap();
        if v == [7.0] {
            break;
        }
        assert!(v == [2.0], "a replica is the home value plus this node's pushes, not {v:?}");
        assert!(Instant::now() < deadline, "the replica never saw the home's push");
        std::thread::sleep(Duration::from_millis(2));
    }
    w1.pull(t, &[90], &mut v).unwrap();
    assert_eq!(v, [7.0], "the home holds both pushes");
    drop((w0, w1));
    finalize_all(nodes);
}

#[test]
fn histories_keep_the_staleness_bound() {
    // Every node pushes into its own lanes of each replicated key while pulling them; each
    // pull shows exactly which pushes it includes.
    let staleness = Duration::from_millis(40);
    let nodes = cluster(2, 64, staleness);
    let keys = [1u64, 41, 93];
    let pushes_per_node = 30u32;
    let lanes = 64;
    let origin = Instant::now();
    let ns = |at: Instant| at.duration_since(origin).as_nanos() as u64;
    let start = Barrier::new(nodes.len());
    let histories: Vec<NodeHistory> = std::thread::scope(|s| {
        let handles: Vec<_> = nodes
            .iter()
            .map(|node| {
                let start = &start;
                s.spawn(move || {
                    let mut w = node.worker();
                    let t = w.table("t").unwrap();
                    let rank = node.rank() as u32;
                    let (mut pushes, mut pulls) = (vec![Vec::new(); keys.len()], vec![Vec::new(); keys.len()]);
                    start.wait();
                    for i in 0..pushes_per_node {
                        let lane = 1 + rank * pushes_per_node + i;
                        for (k, &key) in keys.iter().enumerate() {
                            let issued = Instant::now();
                            w.push(t, &[key], &push_update(lane, lanes)).unwrap();
                            pushes[k].push(TimedPush { node: rank as u16, lane, issued: ns(issued), acked: ns(Instant::now()) });
                            for _ in 0..3 {
                                let mut value = vec![0.0; lanes];
                                let began = Instant::now();
                                w.pull(t, &[key], &mut value).unwrap();
                                pulls[k].push(TimedPull { node: rank as u16, start: ns(began), end: ns(Instant::now()), value });
                            }
                        }
                        std::thread::sleep(Duration::from_millis(3));
                    }
                    w.barrier().unwrap();
                    (pushes, pulls)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The guarantee holds while rounds are short against the bound; on a loaded machine a
    // round can take longer, so the bound checked is the configured one plus twice the
    // slowest round either node saw.
    let slowest = nodes.iter().map(|n| n.stats().replication.round_time.max_ns).max().unwrap();
    let bound = staleness.as_nanos() as u64 + 2 * slowest;
    for (k, &key) in keys.iter().enumerate() {
        let pushes: Vec<TimedPush> = histories.iter().flat_map(|(p, _)| p[k].clone()).collect();
        let pulls: Vec<TimedPull> = histories.iter().flat_map(|(_, p)| p[k].clone()).collect();
        assert_eq!(pushes.len(), 2 * pushes_per_node as usize);
        if let Err(v) = check_bounded_staleness(key, &pushes, &pulls, lanes, bound) {
            panic!("{v:?} (bound {} ms)", bound / 1_000_000);
        }
        // Pulls late in the history must have seen most remote pushes: the check is not vacuous.
        let last = pulls.iter().max_by_key(|p| p.start).unwrap();
        assert!(last.value.iter().filter(|&&x| x == 1.0).count() > pushes_per_node as usize);
    }
    for n in &nodes {
        let s = n.stats().replication;
        assert!(s.staleness.count > 0, "workers sample the replicas' age");
    }
    finalize_all(nodes);
}

#[test]
fn sets_go_home_and_replicated_keys_never_relocate() {
    let nodes = cluster(2, 1, Duration::from_millis(20));
    let mut w0 = nodes[0].worker();
    let t = w0.table("t").unwrap();
    // Key 92 is homed at node 1: the set is applied there.
    w0.set(t, &[92, 1], &[9.0, 4.0]).unwrap();
    w0.push(t, &[92], &[1.0]).unwrap();
    // Localizing replicated keys moves nothing (they are served here already).
    w0.localize(t, &[92, 93, 50]).unwrap();
    w0.barrier_alone(&nodes[1]);
    let mut v = [0.0; 2];
    w0.pull(t, &[92, 1], &mut v).unwrap();
    let mut w1 = nodes[1].worker();
    let mut h = [0.0; 2];
    w1.pull(t, &[92, 1], &mut h).unwrap();
    drop(w1);
    assert_eq!(h, [10.0, 4.0], "the home applied the set, then the replica's push");
    assert_eq!(v, [10.0, 4.0], "the replica was refreshed after the barrier");
    let s = nodes[0].stats();
    assert_eq!(s.relocations_in, 1, "only the non-replicated key 50 moved: {s:?}");
    drop(w0);
    finalize_all(nodes);
}

#[test]
fn bad_replication_settings_are_refused() {
    let mut c = Config::new(vec![TableSpec::new("t", 10, 1).replicating(std::iter::once(5..12))]);
    assert!(matches!(Node::start(c.clone()), Err(Error::Config(m)) if m.contains("replicates keys 5..12")));
    c.tables[0].replicated = vec![4..6, 5..7];
    assert!(matches!(Node::start(c.clone()), Err(Error::Config(m)) if m.contains("overlapping")));
    c.tables[0] = TableSpec::new("t", 10, 1).replicating(std::iter::once(0..2));
    c.staleness = Duration::from_micros(10);
    assert!(matches!(Node::start(c), Err(Error::Config(m)) if m.contains("staleness")));
    assert_eq!(TableSpec::new("t", 10, 1).replicating([3..5, 0..2, 1..4, 7..7]).replicated, vec![0..5]);
}

/// A barrier with the other node's worker joining from a thread.
trait BarrierAlone {
    fn barrier_alone(&mut self, other: &Node);
}

impl BarrierAlone for ferry::Worker {
    fn barrier_alone(&mut self, other: &Node) {
        std::thread::scope(|s| {
            s.spawn(|| other.worker().barrier().unwrap());
            self.barrier().unwrap();
        });
    }
}
