//! Intent signalling on in-process clusters over loopback TCP: the intent service moves keys to
//! the declaring node before their window starts, times its actions from the worker's clock
//! rate, counts late accesses, leaves values untouched, and stays out of bounded delay and
//! finalize.

use std::time::{Duration, Instant};

use ferry::{Config, Error, IntentSettings, Node, TableSpec};
use ferry_tests::finalize_all;

const KEYS: u64 = 64;

fn cluster(nodes: usize, spec: TableSpec, adjust: impl FnOnce(&mut Config)) -> Vec<Node> {
    let mut c = Config::new(vec![spec]);
    c.latches = 64;
    adjust(&mut c);
    Node::start_local_cluster(nodes, c).unwrap()
}

/// Waits (at most 10 s) until `node` holds every key of `keys`.
fn wait_until_held(node: &Node, table: ferry::Table, keys: &[u64]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if keys.iter().all(|&k| node.slot_address(table, k).unwrap().is_some()) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

/// Waits (at most 10 s) until `node`'s service recorded `keys` relocations: it records one in
/// its first round after the keys landed.
fn wait_until_recorded(node: &Node, keys: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.stats().intent.acted_keys < keys && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn declared_keys_arrive_before_their_window_and_accesses_are_local() {
    let nodes = cluster(2, TableSpec::new("t", KEYS, 2), |_| {});
    let mut w1 = nodes[1].worker();
    let t = w1.table("t").unwrap();
    let keys: Vec<u64> = (0..16).collect(); // homed at node 0
    assert!(keys.iter().all(|&k| nodes[1].slot_address(t, k).unwrap().is_none()));
    // AdaPM's initial estimate (10 clocks per round) acts on a window two clocks ahead at once.
    w1.intent(t, &keys, 2, 4).unwrap();
    assert!(wait_until_held(&nodes[1], t, &keys), "the intent service did not move the keys here");
    // How early a key landed is measured in the service's first round after (a worker that
    // advances at once may be a clock further by then).
    wait_until_recorded(&nodes[1], 16);
    let before = nodes[1].stats();
    w1.advance_clock().unwrap();
    w1.advance_clock().unwrap();
    let mut out = vec![0.0; keys.len() * 2];
    w1.pull(t, &keys, &mut out).unwrap();
    let delta = nodes[1].stats().since(&before);
    assert_eq!((delta.local_accesses, delta.remote_accesses, delta.intent.late_accesses), (16, 0, 0));
    let s = nodes[1].stats().intent;
    assert_eq!((s.declared, s.acted_keys, s.in_time), (16, 16, 16));
    assert!(s.mean_lead() >= 1.0 && s.rounds > 0, "{s:?}");
    drop(w1);
    finalize_all(nodes);
}

/// Two nodes whose intent services start from an estimate of zero clocks per round, so that
/// they wait for a worker's clock rate before acting on a window far ahead.
fn unhurried_cluster() -> Vec<Node> {
    let settings = IntentSettings { initial_rate: 0.0, ..IntentSettings::default() };
    cluster(2, TableSpec::new("t", KEYS, 1), |c| c.intent = settings)
}

#[test]
fn a_slow_worker_gets_its_keys_only_when_it_comes_near_the_window() {
    // With an initial estimate of zero clocks per round, the service waits for the worker's
    // clock rate before it acts on a window far ahead.
    let nodes = unhurried_cluster();
    let mut w1 = nodes[1].worker();
    let t = w1.table("t").unwrap();
    let keys: Vec<u64> = (0..4).collect();
    w1.intent(t, &keys, 40, 50).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let before = nodes[1].stats().intent.rounds;
    std::thread::sleep(Duration::from_millis(200));
    // No clock moves, nothing is in flight, no replicas: a round could change nothing, so the
    // service waits for the worker instead of running a round every millisecond (about 200
    // here); the safety net wakes it every 100 ms.
    let idle = nodes[1].stats().intent.rounds - before;
    assert!(idle <= 5, "{idle} rounds while nothing moved");
    assert!(keys.iter().all(|&k| nodes[1].slot_address(t, k).unwrap().is_none()), "acted on a window far out of reach");
    // Thirty clocks in one go wake it at once: the rate estimate takes the jump, and 40 is
    // within reach.
    for _ in 0..30 {
        w1.advance_clock().unwrap();
    }
    assert!(wait_until_held(&nodes[1], t, &keys), "the service never acted once the worker came near");
    assert!(nodes[1].stats().intent.rounds > before + idle);
    wait_until_recorded(&nodes[1], 4);
    let s = nodes[1].stats().intent;
    assert_eq!((s.acted_keys, s.in_time), (4, 4), "{s:?}");
    drop(w1);
    finalize_all(nodes);
}

#[test]
fn rounds_stretch_while_a_slow_worker_moves_no_window() {
    // A worker completing a clock about every millisecond, its only window far ahead: no round
    // moves a window, so rounds come up to eight round times apart instead of one per clock.
    let nodes = unhurried_cluster();
    let mut w1 = nodes[1].worker();
    let t = w1.table("t").unwrap();
    w1.intent(t, &[1, 2], 10_000, 10_010).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let before = nodes[1].stats().intent.rounds;
    let mut clocks = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(300) {
        w1.advance_clock().unwrap();
        clocks += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    let rounds = nodes[1].stats().intent.rounds - before;
    // A round per clock (or per millisecond) would be at least `clocks`; 8 ms apart, about 40.
    assert!(rounds * 2 < clocks, "{rounds} rounds for {clocks} clocks");
    assert!(nodes[1].slot_address(t, 1).unwrap().is_none(), "acted on a window far out of reach");
    drop(w1);
    finalize_all(nodes);
}

#[test]
fn a_key_taken_away_during_its_window_counts_as_late_and_values_stay_exact() {
    let nodes = cluster(2, TableSpec::new("t", KEYS, 1), |_| {});
    let (mut w0, mut w1) = (nodes[0].worker(), nodes[1].worker());
    let t = w0.table("t").unwrap();
    let keys: Vec<u64> = vec![40, 41, 42]; // homed at node 1
    w0.intent(t, &keys, 0, 100).unwrap();
    assert!(wait_until_held(&nodes[0], t, &keys));
    // The service records the landing when it collects the relocation (its next round).
    wait_until_recorded(&nodes[0], 3);
    assert_eq!(nodes[0].stats().intent.acted_keys, 3, "the relocations were never recorded");
    w0.push(t, &keys, &[1.0, 1.0, 1.0]).unwrap();
    // Node 1 takes one key back explicitly: node 0's window is still open, so its next access
    // to that key is late (each window is acted on once; the key is not pulled back).
    w1.localize(t, &[41]).unwrap();
    w1.push(t, &[41], &[2.0]).unwrap();
    let before = nodes[0].stats();
    let mut out = vec![0.0; 3];
    w0.pull(t, &keys, &mut out).unwrap();
    assert_eq!(out, vec![1.0, 3.0, 1.0]);
    let delta = nodes[0].stats().since(&before);
    assert_eq!((delta.intent.late_accesses, delta.remote_accesses, delta.local_accesses), (1, 1, 2));
    assert_eq!(delta.intent.late_left, 1, "it had landed for the intent and left: {:?}", delta.intent);
    // A set inside the window is an access like the others: late where the key is not here.
    let before = nodes[0].stats();
    w0.set(t, &keys, &[5.0, 6.0, 7.0]).unwrap();
    let delta = nodes[0].stats().since(&before);
    assert_eq!((delta.intent.late_accesses, delta.intent.late_left, delta.remote_accesses), (1, 1, 1), "{:?}", delta.intent);
    w1.pull(t, &[41], &mut out[..1]).unwrap();
    assert_eq!(out[0], 6.0);
    drop((w0, w1));
    finalize_all(nodes);
}

#[test]
fn a_key_two_nodes_need_at_once_is_replicated_there_then_follows_the_remaining_intent() {
    // AdaPM, Section 4.1: while two nodes need a key now, it stays where it is and each of them
    // keeps a replica (the holder needs none); when one is done, the key moves to the other.
    let nodes = cluster(3, TableSpec::new("t", KEYS, 1), |c| c.staleness = Duration::from_millis(10));
    let (mut w1, mut w2) = (nodes[1].worker(), nodes[2].worker());
    let t = w1.table("t").unwrap();
    let keys = [1u64, 2]; // homed at node 0
    w1.intent(t, &keys, 0, 3).unwrap();
    assert!(wait_until_held(&nodes[1], t, &keys), "the only intender did not get the keys");
    w2.intent(t, &keys, 0, 10).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes[2].stats().intent.replicas_made < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(nodes[2].stats().intent.replicas_made, 2, "node 2 made no replicas");
    assert_eq!(nodes[1].stats().intent.replicas_made, 0, "the holder needs no replica");
    assert!(keys.iter().all(|&k| nodes[1].slot_address(t, k).unwrap().is_some()), "a shared key moved");
    let before = nodes[2].stats();
    let mut out = [0.0; 2];
    w2.pull(t, &keys, &mut out).unwrap();
    let delta = nodes[2].stats().since(&before);
    assert_eq!((delta.local_accesses, delta.remote_accesses, delta.intent.late_accesses), (2, 0, 0), "the replicas serve");
    assert_eq!(delta.replication.replica_accesses, 2);
    // Pushes on both sides meet within a few sync rounds, each counted once.
    w2.push(t, &keys, &[1.0, 2.0]).unwrap();
    w1.push(t, &keys, &[10.0, 20.0]).unwrap();
    let settled = |w: &mut ferry::Worker, expected: [f32; 2]| {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut out = [0.0; 2];
        while Instant::now() < deadline {
            w.pull(t, &keys, &mut out).unwrap();
            if out == expected {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!("values never settled at {expected:?}: {out:?}");
    };
    assert!(settled(&mut w1, [11.0, 22.0]) && settled(&mut w2, [11.0, 22.0]));
    // A set goes to the owner past the replica, and is not late for it (the same values, so
    // what follows is unchanged).
    let before = nodes[2].stats();
    w2.set(t, &keys, &[11.0, 22.0]).unwrap();
    let delta = nodes[2].stats().since(&before);
    assert_eq!((delta.remote_accesses, delta.intent.late_accesses), (2, 0), "{:?}", delta.intent);
    assert!(nodes[2].stats().intent.replica_syncs > 0);
    // The deltas went to the home first, which does not hold the keys and names their owner;
    // from then on they go to the owner, and its images refresh the replicas with one-sided
    // reads.
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes[2].stats().intent.refreshed_by_read < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let intent = nodes[2].stats().intent;
    assert!(intent.refreshed_by_read >= 2 && intent.refresh_reads >= 1 && intent.refresh_bytes > 0, "no one-sided refresh: {intent:?}");
    assert!(intent.synced_by_push_pull >= 2, "the first sync went to the home, which routes: {intent:?}");
    let routed = intent.synced_by_push_pull;
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(nodes[2].stats().intent.synced_by_push_pull, routed, "the owner was not learned");
    // Replicas that took no push since the last round still sync (their keys travel without
    // deltas) and are refreshed from the owner's images: the holder's push reaches them.
    let before = nodes[2].stats();
    w1.push(t, &keys, &[100.0, 200.0]).unwrap();
    assert!(settled(&mut w2, [111.0, 222.0]));
    let delta = nodes[2].stats().since(&before);
    assert!(delta.intent.refreshed_by_read >= 2 && delta.intent.synced_by_push_pull == 0, "{:?}", delta.intent);
    // Node 1's window ends: node 2 is alone, drops its replicas and gets the keys.
    for _ in 0..3 {
        w1.advance_clock().unwrap();
    }
    assert!(wait_until_held(&nodes[2], t, &keys), "the keys did not follow the remaining intent");
    w2.pull(t, &keys, &mut out).unwrap();
    assert_eq!(out, [111.0, 222.0], "moving the key lost or repeated a push");
    drop((w1, w2));
    finalize_all(nodes);
}

#[test]
fn a_key_leaving_a_node_that_intends_it_again_stays_there_as_a_replica() {
    // Node 1 holds the keys; both nodes need them now (shared: no target, so node 1 is granted
    // a replica it cannot make while it holds them). Node 1's window ends while it intends the
    // keys again later: node 2 alone needs them now and gets them, and the departure leaves
    // node 1 its replicas with their last values — nothing pulled back.
    let nodes = cluster(3, TableSpec::new("t", KEYS, 1), |c| c.staleness = Duration::from_millis(10));
    let (mut w1, mut w2) = (nodes[1].worker(), nodes[2].worker());
    let t = w1.table("t").unwrap();
    let keys: Vec<u64> = (0..8).collect(); // homed at node 0
    w1.intent(t, &keys, 0, 3).unwrap();
    assert!(wait_until_held(&nodes[1], t, &keys), "the only intender did not get the keys");
    w1.push(t, &keys, &vec![5.0; keys.len()]).unwrap();
    w2.intent(t, &keys, 0, 1_000).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes[2].stats().intent.replicas_made < keys.len() as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(nodes[2].stats().intent.replicas_made, keys.len() as u64, "node 2 made no replicas");
    // Node 1 needs the keys again from clock 20 (beyond the bridged gap), then leaves clock 3.
    w1.intent(t, &keys, 20, 30).unwrap();
    for _ in 0..3 {
        w1.advance_clock().unwrap();
    }
    assert!(wait_until_held(&nodes[2], t, &keys), "the keys did not go to the node needing them now");
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes[1].stats().intent.replicas_made < keys.len() as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let intent = nodes[1].stats().intent;
    assert_eq!(intent.replicas_made, keys.len() as u64, "node 1 has no replica of some key: {intent:?}");
    // The grant reaches node 1 one hop after the home's decision, the move three hops (and a
    // round of node 2's service) after it: the departures find the keys marked.
    assert!(intent.replicas_kept > 0, "no departing key stayed as a replica: {intent:?}");
    // Node 1's replicas serve its worker with the departing values.
    let before = nodes[1].stats();
    let mut out = vec![0.0; keys.len()];
    w1.pull(t, &keys, &mut out).unwrap();
    let delta = nodes[1].stats().since(&before);
    assert_eq!((delta.replication.replica_accesses, delta.remote_accesses), (keys.len() as u64, 0), "{delta:?}");
    assert!(out.iter().all(|&v| v == 5.0), "a replica holds the departing value: {out:?}");
    // Pushes on both sides meet, each exactly once.
    w1.push(t, &keys, &vec![1.0; keys.len()]).unwrap();
    w2.push(t, &keys, &vec![10.0; keys.len()]).unwrap();
    for w in [&mut w1, &mut w2] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            w.pull(t, &keys, &mut out).unwrap();
            if out.iter().all(|&v| v == 16.0) {
                break;
            }
            assert!(Instant::now() < deadline, "values never settled: {out:?}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    drop((w1, w2));
    finalize_all(nodes);
}

#[test]
fn replicas_of_keys_lost_with_their_owner_are_dropped_and_their_accesses_fail() {
    // Node 1 holds keys 1 and 2 (homed at node 0) and all three nodes need them now: nodes 0
    // and 2 keep replicas. Node 1 dies with the keys' values. Each survivor's replicas serve
    // until its next sync round finds the values lost: node 2 from the home's answer to its
    // REPLICA_SYNC, node 0 (the home) from its own directory. Then the replicas are gone, and
    // the keys' accesses fail as those of any key lost with its owner — a push into a replica
    // whose deltas can reach no one would vanish without an error.
    let mut nodes = cluster(3, TableSpec::new("t", KEYS, 1), |c| {
        c.staleness = Duration::from_millis(10);
        c.peer_timeout = Duration::from_millis(800);
        c.heartbeat = Duration::from_millis(100);
    });
    let (mut w0, mut w1, mut w2) = (nodes[0].worker(), nodes[1].worker(), nodes[2].worker());
    let t = w1.table("t").unwrap();
    let keys = [1u64, 2];
    w1.intent(t, &keys, 0, 1_000).unwrap();
    assert!(wait_until_held(&nodes[1], t, &keys), "the only intender did not get the keys");
    w0.intent(t, &keys, 0, 1_000).unwrap();
    w2.intent(t, &keys, 0, 1_000).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while [0, 2].iter().any(|&n| nodes[n].stats().intent.replicas_made < 2) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    for n in [0, 2] {
        assert_eq!(nodes[n].stats().intent.replicas_made, 2, "node {n} made no replicas");
    }
    w2.push(t, &keys, &[1.0, 2.0]).unwrap();
    let routed = [0, 2].map(|n| nodes[n].stats().intent.synced_by_push_pull);
    drop(w1);
    nodes.remove(1).abort();
    for (rank, node, w) in [(0, &nodes[0], &mut w0), (2, &nodes[1], &mut w2)] {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut out = [0.0; 2];
        let error = loop {
            match w.pull(t, &keys, &mut out) {
                Ok(()) => assert!(Instant::now() < deadline, "node {rank}'s replicas of lost keys still serve"),
                Err(e) => break e,
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(matches!(error, Error::KeyLost { .. }), "node {rank}: {error:?}");
        assert!(matches!(w.push(t, &keys[..1], &[1.0]), Err(Error::KeyLost { key: 1, .. })), "node {rank}'s push went somewhere");
        let intent = node.stats().intent;
        assert_eq!(intent.replicas_lost, 2, "node {rank}: {intent:?}");
        // Told by the home, not by failing push-pulls (which name one key each).
        assert_eq!(intent.synced_by_push_pull, routed[rank / 2], "node {rank}: {intent:?}");
    }
    // Keys homed and held on the survivors still work.
    let mut out = [0.0];
    w2.pull(t, &[3], &mut out).unwrap();
    drop((w0, w2));
    for n in nodes {
        n.abort();
    }
}

#[test]
fn replicas_of_a_table_with_server_side_updates_are_never_made() {
    // A replica takes pushes by adding them; a table whose holder applies an optimizer keeps
    // shared keys in place instead.
    let spec = TableSpec::new("t", KEYS, 1).with_updater(ferry::Updater::Sgd { lr: 0.5 });
    let nodes = cluster(3, spec, |_| {});
    let (mut w1, mut w2) = (nodes[1].worker(), nodes[2].worker());
    let t = w1.table("t").unwrap();
    w1.intent(t, &[1], 0, 10).unwrap();
    assert!(wait_until_held(&nodes[1], t, &[1]));
    w2.intent(t, &[1], 0, 10).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let mut out = [0.0];
    let before = nodes[2].stats();
    w2.pull(t, &[1], &mut out).unwrap();
    let late = nodes[2].stats().since(&before).intent;
    assert_eq!((late.late_accesses, late.late_unanswered), (1, 1), "the home never grants it: {late:?}");
    assert_eq!(nodes[2].stats().intent.replicas_made, 0);
    drop((w1, w2));
    finalize_all(nodes);
}

#[test]
fn intents_of_both_nodes_and_explicit_localizes_never_change_values() {
    // Both nodes declare overlapping windows on the same keys, and localize some explicitly,
    // while they push: the keys move back and forth, keys both need at once are replicated on
    // both, and every push counts exactly once. Half of each clock's keys are the same on both
    // nodes, and the two workers complete their clocks in step, so that some keys are needed by
    // both at once whatever the scheduling (without both, one worker could run ahead and the
    // nodes' windows never overlap).
    let nodes = cluster(2, TableSpec::new("t", KEYS, 1), |_| {});
    let rounds = 60u64;
    let in_step = std::sync::Barrier::new(nodes.len());
    std::thread::scope(|s| {
        for (rank, node) in nodes.iter().enumerate() {
            let in_step = &in_step;
            s.spawn(move || {
                let mut w = node.worker();
                let t = w.table("t").unwrap();
                for c in 0..rounds {
                    let keys: Vec<u64> = (0..8).map(|i| (c * 5 + i * 7 + (i % 2) * rank as u64) % KEYS).collect();
                    w.intent(t, &keys, c + 1, c + 3).unwrap();
                    if c % 7 == rank as u64 {
                        w.localize(t, &keys[..2]).unwrap();
                    }
                    let all: Vec<u64> = (0..KEYS).collect();
                    w.push(t, &all, &vec![1.0; KEYS as usize]).unwrap();
                    w.advance_clock().unwrap();
                    in_step.wait();
                }
                w.barrier().unwrap();
                let mut out = vec![0.0; KEYS as usize];
                w.pull(t, &(0..KEYS).collect::<Vec<_>>(), &mut out).unwrap();
                assert!(out.iter().all(|&v| v == 2.0 * rounds as f32), "node {rank}: {out:?}");
            });
        }
    });
    let acted: u64 = nodes.iter().map(|n| n.stats().intent.acted_keys).sum();
    assert!(acted > 0, "no intent was acted on");
    let replicated: u64 = nodes.iter().map(|n| n.stats().intent.replicas_made).sum();
    assert!(replicated > 0, "no key was replicated, although both nodes needed some at once");
    finalize_all(nodes);
}

#[test]
fn the_intent_service_holds_back_neither_clocks_nor_finalize() {
    // τ = 0: every worker's clock waits for every other's. The service's own worker must not
    // count among them, nor among the workers finalize waits for.
    let nodes = cluster(2, TableSpec::new("t", KEYS, 1), |c| c.max_delay = Some(0));
    std::thread::scope(|s| {
        for node in &nodes {
            s.spawn(move || {
                let mut w = node.worker();
                let t = w.table("t").unwrap();
                for c in 0..20 {
                    w.intent(t, &[(c * 3) % KEYS], c + 1, c + 2).unwrap();
                    w.advance_clock_within(Duration::from_secs(20)).unwrap();
                }
            });
        }
    });
    let mut nodes = nodes;
    let w = nodes[0].worker();
    assert!(matches!(nodes[0].finalize(), Err(Error::WorkersAlive(1))), "the trainer's worker is alive, the service's does not count");
    drop(w);
    finalize_all(nodes);
}

#[test]
fn bad_intents_are_refused_and_harmless_ones_ignored() {
    let spec = TableSpec::new("t", KEYS, 1).replicating(std::iter::once(0..4));
    let nodes = cluster(2, spec, |_| {});
    let mut w = nodes[1].worker();
    let t = w.table("t").unwrap();
    assert!(matches!(w.intent(t, &[3], 5, 2), Err(Error::Intent(_))));
    assert!(matches!(w.intent(t, &[KEYS], 1, 2), Err(Error::UnknownKey { .. })));
    w.intent(t, &[5], 3, 3).unwrap(); // empty window
    w.intent(t, &[0, 1], 0, 10).unwrap(); // replicated keys are here already
    assert_eq!(nodes[1].stats().intent.declared, 0);
    drop(w);
    finalize_all(nodes);

    // A single node has nothing to move.
    let mut single = cluster(1, TableSpec::new("t", KEYS, 1), |_| {});
    let mut w = single[0].worker();
    let t = w.table("t").unwrap();
    w.intent(t, &[1, 2], 0, 4).unwrap();
    assert_eq!(single[0].stats().intent.declared, 0);
    drop(w);
    single.remove(0).finalize().unwrap();
}
