//! The sampling API (NuPS 4.3–4.4) on in-process clusters over loopback TCP: empirical
//! frequencies against the target distribution, values matching their keys, local sampling
//! never leaving the node, and bad input.

use ferry::{Config, Conformity, Error, KeyDistribution, Node, SamplingScheme, TableSpec, Worker};
use ferry_tests::finalize_all;

const KEYS: u64 = 64;
const VALUE_LEN: usize = 2;

fn cluster(nodes: usize, relocation: bool) -> Vec<Node> {
    let mut c = Config::new(vec![TableSpec::new("emb", KEYS, VALUE_LEN)]);
    c.latches = 64;
    c.relocation = relocation;
    let cluster = Node::start_local_cluster(nodes, c).unwrap();
    // Every key's value names the key, so a sample's value shows which key it came from.
    let mut w = cluster[0].worker();
    let table = w.table("emb").unwrap();
    let keys: Vec<u64> = (0..KEYS).collect();
    let values: Vec<f32> = keys.iter().flat_map(|&k| [k as f32, -(k as f32)]).collect();
    w.set(table, &keys, &values).unwrap();
    drop(w);
    cluster
}

/// Skewed weights over keys 8..56 (key 8 + i has weight i % 7 + 1, a few keys weight 0).
fn weights() -> KeyDistribution {
    let weights = (0..48).map(|i| if i % 11 == 5 { 0.0 } else { (i % 7 + 1) as f64 }).collect();
    KeyDistribution::Weighted { start: 8, weights }
}

/// Pearson's chi-square statistic of `counts` (per key of the range) against `dist`, with
/// `scale` samples counted as one (a reuse scheme repeats each draw `uses` times).
fn chi_square(counts: &[u64], dist: &KeyDistribution, scale: u64) -> (f64, usize) {
    let range = dist.range();
    let total: u64 = counts.iter().sum::<u64>() / scale;
    let mut stat = 0.0;
    let mut cells = 0;
    for (i, key) in range.enumerate() {
        let expected = dist.probability(key) * total as f64;
        let observed = (counts[i] / scale) as f64;
        if expected == 0.0 {
            assert_eq!(counts[i], 0, "key {key} has probability 0 but was sampled");
            continue;
        }
        stat += (observed - expected).powi(2) / expected;
        cells += 1;
    }
    (stat, cells - 1)
}

/// The chi-square quantile at p = 0.001 (Wilson–Hilferty).
fn critical(df: usize) -> f64 {
    let df = df as f64;
    let z = 3.09;
    df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
}

/// Draws `handles × per_handle` samples in portions of `portion`, checks every value against
/// its key and returns counts per key of the distribution's range.
fn draw(w: &mut Worker, dist: ferry::DistributionId, range: std::ops::Range<u64>, handles: usize, per_handle: usize, portion: usize) -> Vec<u64> {
    let table = w.table("emb").unwrap();
    let mut counts = vec![0u64; (range.end - range.start) as usize];
    let mut keys = vec![0u64; portion];
    let mut values = vec![0f32; portion * VALUE_LEN];
    for _ in 0..handles {
        let mut handle = w.prepare_sample(dist, per_handle).unwrap();
        assert_eq!(handle.len(), per_handle);
        while handle.remaining() > 0 {
            let n = portion.min(handle.remaining());
            w.pull_sample(&mut handle, &mut keys[..n], &mut values[..n * VALUE_LEN]).unwrap();
            for (i, &k) in keys[..n].iter().enumerate() {
                assert!(range.contains(&k), "sampled key {k} is outside {range:?}");
                assert_eq!(&values[i * VALUE_LEN..(i + 1) * VALUE_LEN], &[k as f32, -(k as f32)], "values of sampled key {k}");
                counts[(k - range.start) as usize] += 1;
            }
        }
    }
    let _ = table;
    counts
}

#[test]
fn conforming_schemes_follow_the_distribution() {
    let nodes = cluster(1, false);
    let mut w = nodes[0].worker();
    let table = w.table("emb").unwrap();
    let target = weights();
    let cases =
        [(SamplingScheme::Independent, 1), (SamplingScheme::Reuse { pool: 40, uses: 4 }, 4), (SamplingScheme::ReusePostponing { pool: 40, uses: 3 }, 3)];
    for (scheme, uses) in cases {
        let dist = w.register_distribution(table, target.clone(), scheme).unwrap();
        // Handles of 480 samples: a whole number of pools of every case, so each pool is
        // handed out exactly `uses` times.
        let counts = draw(&mut w, dist, target.range(), 250, 480, 100);
        assert!(counts.iter().all(|c| c % uses == 0), "{scheme:?}: each draw is used {uses} times");
        let (stat, df) = chi_square(&counts, &target, uses);
        assert!(stat < critical(df), "{scheme:?}: chi-square {stat:.1} with {df} degrees of freedom (critical {:.1})", critical(df));
        let stats = w.sampling_stats(dist).unwrap();
        assert_eq!(stats.samples, 250 * 480);
        assert_eq!(stats.local, stats.samples, "one node: every sample is local");
        let expected = [Conformity::Conform, Conformity::Bounded, Conformity::LongTerm][cases.iter().position(|c| c.0 == scheme).unwrap()];
        assert_eq!(scheme.conformity(), expected, "{scheme:?}");
    }
    // Uniform, too.
    let uniform = KeyDistribution::uniform(0..KEYS);
    let dist = w.register_distribution(table, uniform.clone(), SamplingScheme::Independent).unwrap();
    let counts = draw(&mut w, dist, uniform.range(), 100, 640, 640);
    let (stat, df) = chi_square(&counts, &uniform, 1);
    assert!(stat < critical(df), "uniform: chi-square {stat:.1} with {df} degrees of freedom");
    drop(w);
    finalize_all(nodes);
}

#[test]
fn independent_and_reuse_localize_their_samples() {
    for scheme in [SamplingScheme::Independent, SamplingScheme::Reuse { pool: 16, uses: 2 }] {
        // Half of the keys start at node 1; node 0's samples bring them here.
        let nodes = cluster(2, true);
        let mut w = nodes[0].worker();
        let table = w.table("emb").unwrap();
        let dist = w.register_distribution(table, KeyDistribution::uniform(0..KEYS), scheme).unwrap();
        let counts = draw(&mut w, dist, 0..KEYS, 40, 64, 16);
        assert_eq!(counts.iter().sum::<u64>(), 40 * 64);
        let stats = w.sampling_stats(dist).unwrap();
        assert!(stats.localized > 0, "{scheme:?}: samples held elsewhere are localized: {stats:?}");
        assert_eq!(stats.local + stats.remote, stats.samples);
        assert!(stats.local > stats.samples / 2, "{scheme:?}: most samples are here when pulled: {stats:?}");
        assert!(nodes[0].stats().relocations_in > 0);
        drop(w);
        finalize_all(nodes);
    }
}

#[test]
fn postponing_keeps_the_long_term_frequencies_across_nodes() {
    let nodes = cluster(2, true);
    let target = &weights();
    std::thread::scope(|s| {
        for node in &nodes {
            s.spawn(move || {
                let mut w = node.worker();
                let table = w.table("emb").unwrap();
                let dist = w.register_distribution(table, target.clone(), SamplingScheme::ReusePostponing { pool: 60, uses: 2 }).unwrap();
                // Both nodes sample the same keys, so keys keep moving between them and some
                // samples are not here when pulled.
                let counts = draw(&mut w, dist, target.range(), 100, 600, 50);
                let (stat, df) = chi_square(&counts, target, 2);
                assert!(stat < critical(df), "node {}: chi-square {stat:.1} with {df} degrees of freedom", node.rank());
                let stats = w.sampling_stats(dist).unwrap();
                assert_eq!(stats.samples, 100 * 600);
                assert!(stats.localized > 0, "{stats:?}");
                w.barrier().unwrap();
            });
        }
    });
    finalize_all(nodes);
}

#[test]
fn local_sampling_never_leaves_the_node() {
    let nodes = cluster(2, true);
    let table = nodes[0].table("emb").unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let rounds = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        // Keys 0..16 (home: node 0) keep moving to node 1 and back while node 0 samples; keys
        // 16..32 stay at node 0, keys 32..64 at node 1.
        let mover = s.spawn(|| {
            let (mut there, mut back) = (nodes[1].worker(), nodes[0].worker());
            let mut round = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let key = [round * 7 % 16];
                there.localize(table, &key).unwrap();
                back.localize(table, &key).unwrap();
                round += 1;
                rounds.store(round, std::sync::atomic::Ordering::Relaxed);
            }
        });
        let mut w = nodes[0].worker();
        let dist = w.register_distribution(table, KeyDistribution::uniform(0..KEYS), SamplingScheme::Local).unwrap();
        let before = nodes[0].stats().remote_accesses;
        let mut keys = vec![0u64; 20];
        let mut values = vec![0f32; 20 * VALUE_LEN];
        let mut seen = [false; KEYS as usize];
        let mut handles = 0;
        // Sample for as long as it takes the mover to move keys 200 times, and at least 300
        // handles.
        while handles < 300 || rounds.load(std::sync::atomic::Ordering::Relaxed) < 200 {
            handles += 1;
            let mut handle = w.prepare_sample(dist, 40).unwrap();
            while handle.remaining() > 0 {
                w.pull_sample(&mut handle, &mut keys, &mut values).unwrap();
                for (i, &k) in keys.iter().enumerate() {
                    assert!(k < KEYS / 2, "key {k} was never held by node 0");
                    assert_eq!(&values[i * VALUE_LEN..(i + 1) * VALUE_LEN], &[k as f32, -(k as f32)]);
                    seen[k as usize] = true;
                }
            }
        }
        assert_eq!(nodes[0].stats().remote_accesses, before, "local sampling made no remote access");
        let stats = w.sampling_stats(dist).unwrap();
        assert_eq!((stats.samples, stats.local, stats.remote, stats.localized), (handles * 40, handles * 40, 0, 0));
        assert!(seen[16..32].iter().all(|&s| s), "every key that stayed here was sampled");
        eprintln!("local sampling while keys move: {stats:?}, {} moves", rounds.load(std::sync::atomic::Ordering::Relaxed));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        mover.join().unwrap();
    });
    // A node that holds none of a range draws from the whole distribution and pulls.
    let mut w = nodes[0].worker();
    nodes[1].worker().localize(table, &[0]).unwrap();
    let elsewhere = w.register_distribution(table, KeyDistribution::uniform(0..1), SamplingScheme::Local).unwrap();
    let mut handle = w.prepare_sample(elsewhere, 2).unwrap();
    let (mut keys, mut values) = ([9u64; 2], [9.0f32; 2 * VALUE_LEN]);
    w.pull_sample(&mut handle, &mut keys, &mut values).unwrap();
    assert_eq!((keys, values), ([0, 0], [0.0, -0.0, 0.0, -0.0]));
    let stats = w.sampling_stats(elsewhere).unwrap();
    assert_eq!((stats.local, stats.remote), (0, 2));
    drop(w);
    finalize_all(nodes);
}

#[test]
fn bad_sampling_input_is_an_error() {
    let nodes = cluster(1, false);
    let mut w = nodes[0].worker();
    let mut other = nodes[0].worker();
    let table = w.table("emb").unwrap();
    let bad_ranges = [
        KeyDistribution::uniform(5..5),
        KeyDistribution::uniform(0..KEYS + 1),
        KeyDistribution::Weighted { start: KEYS - 1, weights: vec![1.0, 1.0] },
        KeyDistribution::Weighted { start: 0, weights: vec![0.0, 0.0] },
        KeyDistribution::Weighted { start: 0, weights: vec![1.0, f64::NAN] },
        KeyDistribution::Weighted { start: 0, weights: vec![] },
    ];
    for dist in bad_ranges {
        let e = w.register_distribution(table, dist.clone(), SamplingScheme::Independent).unwrap_err();
        assert!(matches!(e, Error::Sampling(_)), "{dist:?}: {e}");
    }
    assert!(w.register_distribution(table, KeyDistribution::uniform(0..4), SamplingScheme::Reuse { pool: 0, uses: 1 }).is_err());
    let dist = w.register_distribution(table, KeyDistribution::uniform(0..4), SamplingScheme::Independent).unwrap();
    assert!(other.prepare_sample(dist, 1).is_err(), "a distribution belongs to its worker");
    assert!(w.prepare_sample(dist, usize::MAX).is_err());
    let mut handle = w.prepare_sample(dist, 3).unwrap();
    let e = w.pull_sample(&mut handle, &mut [0; 4], &mut [0.0; 8]).unwrap_err();
    assert!(e.to_string().contains("3 remain"), "{e}");
    let e = w.pull_sample(&mut handle, &mut [0; 2], &mut [0.0; 3]).unwrap_err();
    assert!(matches!(e, Error::WrongLength { expected: 4, got: 3, .. }), "{e}");
    assert!(other.pull_sample(&mut handle, &mut [0; 1], &mut [0.0; 2]).is_err());
    w.pull_sample(&mut handle, &mut [0; 3], &mut [0.0; 6]).unwrap();
    assert_eq!(handle.remaining(), 0);
    let empty = w.prepare_sample(dist, 0).unwrap();
    assert!(empty.is_empty());
    drop((w, other));
    finalize_all(nodes);
}
