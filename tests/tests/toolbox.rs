//! The parameter server's toolbox on in-process clusters over loopback TCP: server-side
//! updaters (applied once, at whichever node holds the key, with their state moving along),
//! push-pull, range operations, and bounded-delay clocks checked on recorded histories.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use ferry::testing::consistency::{ClockTrace, check_bounded_delay};
use ferry::{Config, Error, MessageKind, Node, TableSpec, UpdateRule, Updater};
use ferry_tests::finalize_all;

const KEYS: u64 = 64;

fn cluster(nodes: usize, spec: TableSpec) -> Vec<Node> {
    let mut c = Config::new(vec![spec]);
    c.latches = 64;
    Node::start_local_cluster(nodes, c).unwrap()
}

/// A reference optimizer step on plain floats (the formulas of `ferry::update`).
fn reference(u: &Updater, value: &mut [f32], state: &mut [f32], g: &[f32]) {
    match *u {
        Updater::Sgd { lr } => value.iter_mut().zip(g).for_each(|(x, g)| *x -= lr * g),
        Updater::Adagrad { lr, eps, init } => {
            for i in 0..value.len() {
                state[i] += g[i] * g[i];
                value[i] -= lr * g[i] / ((init + state[i]).sqrt() + eps);
            }
        }
        Updater::Adam { lr, beta1, beta2, eps } => {
            let n = value.len();
            state[2 * n] += 1.0;
            let t = state[2 * n] as i32;
            for i in 0..n {
                state[i] = beta1 * state[i] + (1.0 - beta1) * g[i];
                state[n + i] = beta2 * state[n + i] + (1.0 - beta2) * g[i] * g[i];
                value[i] -= lr * (state[i] / (1.0 - beta1.powi(t))) / ((state[n + i] / (1.0 - beta2.powi(t))).sqrt() + eps);
            }
        }
        _ => value.iter_mut().zip(g).for_each(|(x, g)| *x += g),
    }
}

/// Node 1 pushes gradients to keys homed at node 0 (applied remotely), then moves them here and
/// pushes more (applied locally), then node 0 takes them back and pushes more: the values follow
/// one optimizer run exactly, so every push was applied once and the state moved with the keys.
fn updater_follows_its_keys(updater: Updater) {
    let dim = 3;
    let nodes = cluster(2, TableSpec::new("t", KEYS, dim).with_updater(updater.clone()));
    let keys: Vec<u64> = (0..8).collect(); // homed at node 0 (range partitioning)
    let grad = |step: usize, k: u64| -> Vec<f32> { (0..dim).map(|i| ((step * 7 + k as usize * 3 + i) % 11) as f32 / 5.0 - 1.0).collect() };
    let mut expected: Vec<(Vec<f32>, Vec<f32>)> = keys.iter().map(|_| (vec![0.0; dim], vec![0.0; updater.state_len(dim)])).collect();
    let (mut w0, mut w1) = (nodes[0].worker(), nodes[1].worker());
    let t = w1.table("t").unwrap();
    let mut step = 0;
    let mut push = |w: &mut ferry::Worker, step: &mut usize| {
        let g: Vec<f32> = keys.iter().flat_map(|&k| grad(*step, k)).collect();
        w.push(t, &keys, &g).unwrap();
        for (i, &k) in keys.iter().enumerate() {
            let (v, s) = &mut expected[i];
            reference(&updater, v, s, &grad(*step, k));
        }
        *step += 1;
    };
    for _ in 0..3 {
        push(&mut w1, &mut step);
    }
    w1.localize(t, &keys).unwrap();
    for _ in 0..3 {
        push(&mut w1, &mut step);
    }
    w0.localize(t, &keys).unwrap();
    for _ in 0..3 {
        push(&mut w0, &mut step);
    }
    let mut out = vec![0.0; keys.len() * dim];
    w1.pull(t, &keys, &mut out).unwrap();
    for (i, (v, _)) in expected.iter().enumerate() {
        for d in 0..dim {
            let got = out[i * dim + d];
            assert!((got - v[d]).abs() <= 1e-5 * (1.0 + v[d].abs()), "{updater:?} key {i} element {d}: {got} vs {}", v[d]);
        }
    }
    assert!(nodes[0].stats().relocations_in > 0 && nodes[1].stats().relocations_in > 0);
    drop((w0, w1));
    finalize_all(nodes);
}

#[test]
fn sgd_applies_every_push_once_wherever_the_key_is() {
    updater_follows_its_keys(Updater::Sgd { lr: 0.1 });
}

#[test]
fn adagrad_state_moves_with_the_key() {
    updater_follows_its_keys(Updater::Adagrad { lr: 0.5, eps: 1e-6, init: 0.1 });
}

#[test]
fn adam_state_moves_with_the_key() {
    updater_follows_its_keys(Updater::adam(0.05));
}

/// A user-defined rule: clip each gradient element to ±0.5, then add it (state: none).
struct ClippedAdd;

impl UpdateRule for ClippedAdd {
    fn describe(&self) -> String {
        "clipped-add(0.5)".into()
    }
    fn state_len(&self, _: usize) -> usize {
        0
    }
    fn apply(&self, value: &mut [f32], _: &mut [f32], gradient: &[f32]) {
        for (x, g) in value.iter_mut().zip(gradient) {
            *x += g.clamp(-0.5, 0.5);
        }
    }
}

#[test]
fn user_defined_updaters_run_on_every_path() {
    let nodes = cluster(2, TableSpec::new("t", KEYS, 2).with_updater(Updater::custom(ClippedAdd)));
    let mut w = nodes[1].worker();
    let t = w.table("t").unwrap();
    // Remote (keys 0..4 at node 0), local (keys 40..44 at node 1), one key and many.
    w.push(t, &[0, 1, 2, 3, 40, 41, 42, 43], &[3.0; 16]).unwrap();
    w.push(t, &[1], &[-3.0, 0.25]).unwrap();
    w.push(t, &[41], &[-3.0, 0.25]).unwrap();
    let mut out = vec![0.0; 4];
    w.pull(t, &[1, 41], &mut out).unwrap();
    assert_eq!(out, [0.0, 0.75, 0.0, 0.75]);
    drop(w);
    finalize_all(nodes);
}

#[test]
fn push_pull_returns_each_update_exactly_once() {
    // Every push-pull adds 1 to the same keys from 3 nodes × 2 workers, remote and local at
    // once: the values returned for a key are exactly 1, 2, …, n — each push-pull read its own
    // update and no other push-pull's read the same state.
    let nodes = cluster(3, TableSpec::new("t", KEYS, 1));
    let per_worker = 200;
    let returned: Vec<Vec<f32>> = std::thread::scope(|s| {
        // Every worker exists before any thread runs: a worker made after its node's other
        // worker had reached the barrier would wait for the next barrier, which nobody enters.
        let workers: Vec<_> = nodes.iter().flat_map(|node| (0..2).map(move |_| node.worker())).collect();
        let handles: Vec<_> = workers
            .into_iter()
            .enumerate()
            .map(|(i, mut w)| {
                s.spawn(move || {
                    let t = w.table("t").unwrap();
                    let mut seen = Vec::new();
                    for j in 0..per_worker {
                        let mut out = [0.0f32; 2];
                        if (i + j) % 3 == 0 {
                            let ticket = w.push_pull_async(t, &[5, 50], &[1.0, 1.0]).unwrap();
                            out.copy_from_slice(&w.wait_pull(ticket).unwrap());
                        } else if (i + j) % 3 == 1 {
                            w.push_pull(t, &[5, 50], &[1.0, 1.0], &mut out).unwrap();
                        } else {
                            w.push_pull(t, &[5], &[1.0], &mut out[..1]).unwrap();
                            w.push_pull(t, &[50], &[1.0], &mut out[1..]).unwrap();
                        }
                        seen.extend_from_slice(&out);
                    }
                    w.barrier().unwrap();
                    seen
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for key in 0..2 {
        let mut values: Vec<u32> = returned.iter().flat_map(|seen| seen.iter().skip(key).step_by(2).map(|&v| v as u32)).collect();
        values.sort_unstable();
        let n = values.len() as u32;
        assert_eq!(values, (1..=n).collect::<Vec<_>>(), "key {}", [5, 50][key]);
    }
    finalize_all(nodes);
}

#[test]
fn push_pull_goes_through_the_updater() {
    let nodes = cluster(2, TableSpec::new("t", KEYS, 2).with_updater(Updater::Sgd { lr: 0.5 }));
    let mut w = nodes[1].worker();
    let t = w.table("t").unwrap();
    let mut out = vec![0.0; 4];
    w.push_pull(t, &[3, 60], &[2.0, -2.0, 4.0, 0.0], &mut out).unwrap();
    assert_eq!(out, [-1.0, 1.0, -2.0, 0.0]);
    w.push_pull(t, &[3, 60], &[2.0, -2.0, 4.0, 0.0], &mut out).unwrap();
    assert_eq!(out, [-2.0, 2.0, -4.0, 0.0]);
    assert!(matches!(w.push_pull(t, &[3], &[1.0], &mut [0.0; 2]), Err(Error::WrongLength { .. })));
    assert!(matches!(w.push_pull(t, &[3], &[1.0, 1.0], &mut [0.0; 3]), Err(Error::WrongLength { .. })));
    assert!(matches!(w.push_pull(t, &[KEYS], &[1.0, 1.0], &mut [0.0; 2]), Err(Error::UnknownKey { .. })));
    drop(w);
    finalize_all(nodes);
}

#[test]
fn range_operations_send_no_key_list() {
    let keys = 4096u64;
    let nodes = cluster(2, TableSpec::new("t", keys, 1));
    let mut w = nodes[1].worker();
    let t = w.table("t").unwrap();
    // Keys 0..2048 live at node 0: the whole range is remote.
    let range = 100..1900u64;
    let n = (range.end - range.start) as usize;
    let before = nodes[1].stats();
    let updates: Vec<f32> = (0..n).map(|i| i as f32).collect();
    w.push_range(t, range.clone(), &updates).unwrap();
    let mut out = vec![0.0; n];
    w.pull_range(t, range.clone(), &mut out).unwrap();
    assert_eq!(out, updates);
    let sent = nodes[1].stats().since(&before).traffic;
    let access_bytes = sent.bytes[MessageKind::Access as usize];
    // The push carries 4 bytes per key of values, the pull nothing per key: a key list would
    // add 8 bytes per key to each.
    assert!(access_bytes < (n as u64) * 4 + 1024, "{access_bytes} bytes of requests for {n} keys");
    // The same keys as a list (reversed, so not a run) cost the key list.
    let before = nodes[1].stats();
    let list: Vec<u64> = range.clone().rev().collect();
    w.pull(t, &list, &mut out).unwrap();
    let listed = nodes[1].stats().since(&before).traffic.bytes[MessageKind::Access as usize];
    assert!(listed >= (n as u64) * 8, "{listed}");
    // Bad ranges are errors.
    assert!(w.pull_range(t, 10..keys + 1, &mut vec![0.0; keys as usize - 9]).is_err());
    assert!(matches!(w.pull_range(t, 0..4, &mut [0.0; 3]), Err(Error::WrongLength { .. })));
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 9..3;
    assert!(w.push_range(t, backwards, &[]).is_err());
    w.pull_range(t, 7..7, &mut []).unwrap();
    drop(w);
    finalize_all(nodes);
}

#[test]
fn bad_updater_settings_are_refused() {
    let mut c = Config::new(vec![TableSpec::new("t", 16, 2).replicating_keys([0, 1]).with_updater(Updater::adagrad(0.1))]);
    assert!(matches!(Node::start(c.clone()), Err(Error::Config(m)) if m.contains("only the add updater")));
    c.tables = vec![TableSpec::new("t", 16, 2).with_updater(Updater::Sgd { lr: f32::NAN })];
    assert!(matches!(Node::start(c.clone()), Err(Error::Config(m)) if m.contains("lr")));
    c.tables = vec![TableSpec::new("t", 16, 2).with_updater(Updater::Adam { lr: 0.1, beta1: 1.0, beta2: 0.9, eps: 1e-8 })];
    assert!(matches!(Node::start(c), Err(Error::Config(m)) if m.contains("beta1")));
}

/// Workers of 3 nodes advance clocks at different speeds under a delay bound; the recorded
/// clocks keep it (checked with the same checker the simulator uses).
fn clocks_keep_the_bound(tau: Option<u64>) -> Vec<ClockTrace> {
    let mut c = Config::new(vec![TableSpec::new("t", KEYS, 1)]);
    c.max_delay = tau;
    let nodes = Node::start_local_cluster(3, c).unwrap();
    let epoch = Instant::now();
    let clocks = 12;
    let now = move || epoch.elapsed().as_nanos() as u64;
    let traces: Vec<ClockTrace> = std::thread::scope(|s| {
        let handles: Vec<_> = nodes
            .iter()
            .flat_map(|node| (0..2).map(move |i| (node, i)))
            // Every worker registers before any advances: a worker created after its node's
            // others completed a clock starts at their clock, not at 0.
            .map(|(node, i)| (node, i, node.worker()))
            .collect::<Vec<_>>()
            .into_iter()
            .map(|(node, i, mut w)| {
                s.spawn(move || {
                    let t = w.table("t").unwrap();
                    let mut trace = ClockTrace { started: vec![now()], finished: Vec::new() };
                    // Node 2's first worker is slow.
                    let work = if node.rank() == 2 && i == 0 { Duration::from_millis(8) } else { Duration::from_micros(300) };
                    for c in 0..clocks {
                        std::thread::sleep(work);
                        let _ticket = w.push_async(t, &[(c * 5 + node.rank() as u64) % KEYS], &[1.0]).unwrap();
                        trace.finished.push(now());
                        let next = w.advance_clock().unwrap();
                        assert_eq!(next, c + 1);
                        assert_eq!(w.current_clock(), c + 1);
                        trace.started.push(now());
                    }
                    w.barrier().unwrap();
                    trace
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    finalize_all(nodes);
    traces
}

#[test]
fn bounded_delay_holds_on_a_real_cluster() {
    for tau in [0, 2] {
        let traces = clocks_keep_the_bound(Some(tau));
        check_bounded_delay(&traces, Some(tau)).unwrap_or_else(|v| panic!("τ = {tau}: {v}"));
    }
    // Without a bound the fast workers run ahead of the slow one: the τ = 0 check fails on
    // that history, so the check above is not vacuous.
    let free = clocks_keep_the_bound(None);
    assert!(check_bounded_delay(&free, Some(0)).is_err(), "free-running workers never ran ahead");
}

#[test]
fn a_worker_that_stops_advancing_is_named_and_leaving_releases_the_others() {
    let mut c = Config::new(vec![TableSpec::new("t", KEYS, 1)]);
    c.max_delay = Some(0);
    let nodes = Node::start_local_cluster(2, c).unwrap();
    let gate = Arc::new(Barrier::new(2));
    std::thread::scope(|s| {
        let g = gate.clone();
        let n1 = &nodes[1];
        s.spawn(move || {
            let w = n1.worker();
            g.wait(); // registered
            g.wait(); // the other timed out
            drop(w); // leaving releases it
        });
        let mut w = nodes[0].worker();
        gate.wait();
        match w.advance_clock_within(Duration::from_millis(300)) {
            Err(Error::Timeout { nodes, .. }) => assert_eq!(nodes, vec![1]),
            other => panic!("expected a timeout naming node 1, got {other:?}"),
        }
        gate.wait();
        // The clock was counted; the wait for clock 1 ends once node 1's worker left.
        assert_eq!(w.current_clock(), 1);
        w.advance_clock_within(Duration::from_secs(10)).unwrap();
    });
    finalize_all(nodes);
}

#[test]
fn max_delay_comes_from_the_environment() {
    let mut c = Config::new(vec![TableSpec::new("t", 4, 1)]);
    c.apply_timeout_env(|n| (n == "FERRY_MAX_DELAY").then(|| "3".to_string())).unwrap();
    assert_eq!(c.max_delay, Some(3));
    c.apply_timeout_env(|n| (n == "FERRY_MAX_DELAY").then(|| "inf".to_string())).unwrap();
    assert_eq!(c.max_delay, None);
    assert!(c.apply_timeout_env(|n| (n == "FERRY_MAX_DELAY").then(|| "soon".to_string())).is_err());
}

#[test]
fn compressed_values_travel_in_fewer_bytes_within_their_precision() {
    use ferry::ValueCodec;
    let dim = 16;
    let n = 512usize;
    for (codec, tolerance, max_ratio) in [(ValueCodec::Bf16, 1.0 / 128.0, 0.6), (ValueCodec::F16, 1.0 / 1024.0, 0.6), (ValueCodec::Int8, 1.0 / 127.0, 0.4)] {
        let nodes = cluster(2, TableSpec::new("t", 2 * n as u64, dim).compressed(codec));
        let mut w = nodes[1].worker();
        let t = w.table("t").unwrap();
        let keys: Vec<u64> = (0..n as u64).rev().collect(); // homed at node 0, a list
        let values: Vec<f32> = (0..n * dim).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let before = nodes[1].stats();
        w.push(t, &keys, &values).unwrap();
        let mut out = vec![0.0; n * dim];
        w.pull(t, &keys, &mut out).unwrap();
        let sent = nodes[1].stats().since(&before).traffic.bytes[MessageKind::Access as usize];
        let received = nodes[0].stats().traffic.bytes[MessageKind::Response as usize];
        // Each value crossed twice (push, then pull), each time rounded; the largest magnitude is 1.
        for (x, y) in values.iter().zip(&out) {
            assert!((x - y).abs() <= 2.0 * tolerance + 1e-6, "{codec:?}: {x} came back as {y}");
        }
        let raw = (n * dim * 4) as u64;
        // Requests: the push's keys and values, the pull's keys.
        let keys_bytes = 2 * (n as u64) * 8;
        assert!(sent > keys_bytes && (sent - keys_bytes) as f64 <= max_ratio * raw as f64, "{codec:?}: {sent} bytes of requests for {raw} of values");
        assert!((received as f64) <= max_ratio * raw as f64 + 4096.0, "{codec:?}: {received} bytes of answers for {raw} of values");
        drop(w);
        finalize_all(nodes);
    }
}

#[test]
fn filtered_pushes_hold_back_small_updates_and_lose_nothing() {
    use ferry::filter::{FilteredPusher, Kkt, Significance};
    let nodes = cluster(2, TableSpec::new("t", KEYS, 1));
    let mut w = nodes[1].worker();
    let t = w.table("t").unwrap();
    w.set(t, &(0..KEYS).collect::<Vec<_>>(), &vec![10.0; KEYS as usize]).unwrap();
    let mut pusher = FilteredPusher::new(t, Significance { threshold: 0.05, floor: 0.0 });
    let keys: Vec<u64> = (0..KEYS).collect();
    let mut values = vec![0.0; KEYS as usize];
    let before = nodes[1].stats();
    for _ in 0..40 {
        w.pull(t, &keys, &mut values).unwrap();
        // 0.1 per step: 1 % of the value, significant every fifth step.
        pusher.push(&mut w, &keys, &vec![0.1; KEYS as usize], &values).unwrap();
    }
    let s = pusher.stats();
    assert_eq!(s.offered, 40 * KEYS);
    assert!(s.sent * 4 < s.offered, "{s:?}");
    pusher.flush(&mut w).unwrap();
    assert_eq!(pusher.held_keys(), 0);
    w.pull(t, &keys, &mut values).unwrap();
    assert!(values.iter().all(|v| (v - 14.0).abs() < 1e-4), "every update arrived: {values:?}");
    let pushed = nodes[1].stats().since(&before).traffic.messages[MessageKind::Access as usize];
    assert!(pushed < 2 * 40 * 2, "{pushed} request messages");
    // KKT: gradients of zero weights within the L1 penalty stay home.
    let mut kkt = FilteredPusher::new(t, Kkt { l1: 1.0 });
    w.set(t, &[0, 1], &[0.0, 3.0]).unwrap();
    kkt.push(&mut w, &[0, 1], &[0.5, 0.5], &[0.0, 3.0]).unwrap();
    assert_eq!((kkt.stats().sent, kkt.stats().held), (1, 1));
    kkt.push(&mut w, &[0], &[0.6], &[0.0]).unwrap();
    assert_eq!(kkt.stats().sent, 2, "the accumulated 1.1 passes the penalty");
    let mut out = [0.0; 2];
    w.pull(t, &[0, 1], &mut out).unwrap();
    assert!((out[0] - 1.1).abs() < 1e-6 && (out[1] - 3.5).abs() < 1e-6, "{out:?}");
    assert!(matches!(kkt.push(&mut w, &[0], &[1.0, 2.0], &[]), Err(Error::WrongLength { .. })));
    drop(w);
    finalize_all(nodes);
}

/// Without a delay bound nobody waits for the cluster's clocks, so advancing one sends nothing
/// (intent signalling advances a clock every mini-batch); under a bound every clock that raises
/// the node's minimum is told to the peer (CLOCK, counted with the barrier messages).
#[test]
fn clocks_reach_the_peers_only_under_a_delay_bound() {
    for (tau, expect_sent) in [(None, false), (Some(1_000), true)] {
        let mut c = Config::new(vec![TableSpec::new("t", KEYS, 1)]);
        c.max_delay = tau;
        let nodes = Node::start_local_cluster(2, c).unwrap();
        let mut w = nodes[0].worker();
        let before = nodes[0].stats();
        for _ in 0..50 {
            w.advance_clock().unwrap();
        }
        let sent = nodes[0].stats().since(&before).traffic.messages[MessageKind::Barrier as usize];
        if expect_sent {
            assert!(sent >= 50, "τ = {tau:?}: {sent} clock messages for 50 clocks");
        } else {
            assert_eq!(sent, 0, "without a bound, {sent} clock messages went out");
        }
        assert_eq!(w.current_clock(), 50);
        drop(w);
        finalize_all(nodes);
    }
}
