use super::*;

/// A small random graph: `n` examples of 1..=3 keys among `m`.
fn random_graph(n: usize, m: u64, seed: u64) -> Incidence {
    let mut g = Incidence::new(m).unwrap();
    let mut x = seed;
    let mut draw = |below: u64| {
        x = crate::hashing::mix(x);
        x % below
    };
    for _ in 0..n {
        let len = 1 + draw(3);
        let row: Vec<u64> = (0..len).map(|_| draw(m)).collect();
        g.push_example(row).unwrap();
    }
    g
}

/// The bottleneck counted directly, one access per example and key (batch 1).
fn direct_bottleneck(g: &Incidence, nodes: usize, examples: &[u16], homes: &[u16]) -> f64 {
    let mut load = vec![0u64; nodes];
    for (e, &u) in examples.iter().enumerate() {
        for &k in g.row(e) {
            let h = homes[k as usize];
            if h != u {
                load[u as usize] += 1;
                load[h as usize] += 1;
            }
        }
    }
    load.into_iter().max().unwrap_or(0) as f64
}

/// Every assignment of `len` items to `nodes` nodes.
fn assignments(len: usize, nodes: usize) -> impl Iterator<Item = Vec<u16>> {
    (0..nodes.pow(len as u32)).map(move |mut code| {
        (0..len)
            .map(|_| {
                let n = code % nodes;
                code /= nodes;
                n as u16
            })
            .collect()
    })
}

/// Whether a data partition is as balanced as the co-partitioner keeps it: every node's
/// non-zeros within the band of `refine::balance_slack` around the mean.
fn balanced(g: &Incidence, nodes: usize, examples: &[u16]) -> bool {
    let mut load = vec![0f64; nodes];
    for (e, &u) in examples.iter().enumerate() {
        load[u as usize] += g.row(e).len().max(1) as f64;
    }
    let mean = load.iter().sum::<f64>() / nodes as f64;
    let slack = refine::balance_slack(g, nodes);
    load.iter().all(|l| (l - mean).abs() <= slack + 1e-9)
}

/// The least bottleneck of any homes for the data partition `examples`.
fn best_homes(g: &Incidence, nodes: usize, examples: &[u16]) -> f64 {
    assignments(g.keys() as usize, nodes).map(|homes| direct_bottleneck(g, nodes, examples, &homes)).fold(f64::INFINITY, f64::min)
}

#[test]
fn traffic_matches_a_direct_count() {
    for seed in 0..30 {
        let g = random_graph(12, 8, seed);
        let nodes = 2 + (seed % 3) as usize;
        let mut x = seed ^ 0x77;
        let mut pick = || {
            x = crate::hashing::mix(x);
            (x % nodes as u64) as u16
        };
        let examples: Vec<u16> = (0..12).map(|_| pick()).collect();
        let homes: Vec<u16> = (0..8).map(|_| pick()).collect();
        let t = traffic(&g, nodes, 1, &examples, &homes).unwrap();
        assert_eq!(t.bottleneck, direct_bottleneck(&g, nodes, &examples, &homes), "seed {seed}");
        assert!((t.total - t.per_node.iter().sum::<f64>()).abs() < 1e-9);
    }
}

#[test]
fn plans_come_near_the_brute_force_optimum_and_the_bound_holds() {
    let (nodes, n, m) = (2, 6, 5);
    let (mut plan_sum, mut best_sum, mut keys_sum, mut keys_best_sum) = (0.0, 0.0, 0.0, 0.0);
    for seed in 0..40 {
        let g = random_graph(n, m, seed);
        // The optimum over every balanced data partition (or all of it on one node costs
        // nothing) and every placement.
        let optimum = assignments(n, nodes)
            .filter(|examples| balanced(&g, nodes, examples))
            .map(|examples| best_homes(&g, nodes, &examples))
            .fold(f64::INFINITY, f64::min);
        let plan = copartition(&g, &Options { candidates: 8, ..Options::new(nodes) }).unwrap();
        assert!(balanced(&g, nodes, &plan.examples), "seed {seed}: unbalanced {:?}", plan.examples);
        let ours = traffic(&g, nodes, 1, &plan.examples, plan.placement.homes()).unwrap();
        assert_eq!(ours.bottleneck, direct_bottleneck(&g, nodes, &plan.examples, plan.placement.homes()));
        assert!(ours.bottleneck >= optimum, "seed {seed}: a plan below the optimum");
        // Algorithm 2 against the best homes for the same data partition, and the bound under
        // both.
        let keys_optimum = best_homes(&g, nodes, &plan.examples);
        assert!(ours.lower_bound <= keys_optimum + 1e-9, "seed {seed}: bound {} above the best homes {keys_optimum}", ours.lower_bound);
        plan_sum += ours.bottleneck;
        best_sum += optimum;
        keys_sum += ours.bottleneck;
        keys_best_sum += keys_optimum;
    }
    // Summed over the graphs (single graphs of 6 examples can be unlucky): within 1.5x of the
    // optimum (1.41x when written), and Algorithm 2 within 1.1x of the best homes for its data
    // partition (1.0x when written).
    assert!(plan_sum <= 1.5 * best_sum, "plans {plan_sum} against optima {best_sum}");
    assert!(keys_sum <= 1.1 * keys_best_sum, "homes {keys_sum} against the best {keys_best_sum}");
}

#[test]
fn planted_blocks_are_kept_apart() {
    // Four groups of 100 examples over four disjoint groups of 40 keys: a balanced partition
    // needs (almost) no access to cross. Random samples can miss a group's last examples, so a
    // few may.
    let mut g = Incidence::new(160).unwrap();
    for e in 0..400u64 {
        let block = (e % 4) * 40;
        g.push_example((0..5).map(|j| block + crate::hashing::mix(e * 8 + j) % 40)).unwrap();
    }
    let plan = copartition(&g, &Options::new(4)).unwrap();
    let t = traffic(&g, 4, 1, &plan.examples, plan.placement.homes()).unwrap();
    let hashed: Vec<u16> = (0..160).map(|k| (crate::hashing::mix(k) % 4) as u16).collect();
    let dealt = traffic(&g, 4, 1, &dealt_examples(&g, 4), &hashed).unwrap();
    assert!(t.bottleneck <= 0.05 * dealt.bottleneck, "planned {t:?}, dealt and hashed {dealt:?}");
    let per_node: Vec<usize> = (0..4).map(|n| plan.examples_of(n).count()).collect();
    assert!(per_node.iter().all(|c| (90..=110).contains(c)), "unbalanced: {per_node:?}");
}

#[test]
fn batches_count_an_access_per_batch() {
    // One node's 64 examples all touch key 0, and it is homed on the other: 64 accesses an
    // epoch one at a time, 2 in batches of 32.
    let mut g = Incidence::new(2).unwrap();
    for _ in 0..64 {
        g.push_example([0]).unwrap();
    }
    let (examples, homes) = (vec![0u16; 64], vec![1u16, 1]);
    assert_eq!(traffic(&g, 2, 1, &examples, &homes).unwrap().bottleneck, 64.0);
    assert!((traffic(&g, 2, 32, &examples, &homes).unwrap().bottleneck - 2.0).abs() < 1e-9);
}

#[test]
fn bad_graphs_and_options_are_refused() {
    assert!(Incidence::new(0).is_err());
    assert!(Incidence::new(Placement::MAX_KEYS + 1).is_err());
    let mut g = Incidence::new(4).unwrap();
    let e = g.push_example([1, 4]).unwrap_err().to_string();
    assert!(e.contains("key 4") && e.contains("0..4"), "{e}");
    assert_eq!((g.examples(), g.nonzeros()), (0, 0));
    g.push_example([3, 1, 3]).unwrap();
    assert_eq!(g.row(0), &[1, 3]);
    assert!(copartition(&g, &Options::new(0)).is_err());
    assert!(copartition(&g, &Options { batch: 0, ..Options::new(2) }).is_err());
    assert!(traffic(&g, 2, 1, &[2], &[0, 0, 0, 0]).is_err());
    assert!(traffic(&g, 2, 1, &[0], &[0, 0]).is_err());
}

#[test]
fn plan_files_round_trip_and_bad_ones_are_refused() {
    let g = random_graph(30, 10, 3);
    let plan = copartition(&g, &Options { batch: 4, ..Options::new(3) }).unwrap();
    let path = std::env::temp_dir().join(format!("ferry-plan-test-{}", std::process::id()));
    plan.write(&path).unwrap();
    let read = Plan::read(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!((read.examples.clone(), read.placement.clone(), read.batch, read.data_digest), (plan.examples.clone(), plan.placement.clone(), 4, g.digest()));
    read.check(&g, 3).unwrap();
    let e = read.check(&g, 2).unwrap_err().to_string();
    assert!(e.contains("for 3 nodes, not 2"), "{e}");
    let other = random_graph(30, 10, 4);
    assert!(read.check(&other, 3).unwrap_err().to_string().contains("other data"));

    let parse = |t: &str| Plan::parse(t.as_bytes()).map(drop).unwrap_err();
    assert!(parse("hello\n").contains("not a plan"));
    // A home outside the nodes, a section cut short, counts that disagree, a claim too large.
    let home = text.replacen("\nhomes\n", "\nhomes\n7\n", 1);
    assert!(parse(&home).contains("not a node of 0..3"), "{}", parse(&home));
    let cut = &text[..text.len() / 2];
    assert!(parse(cut).contains("cut short") || parse(cut).contains("not a node"), "{}", parse(cut));
    let fewer = text.replacen("examples 30", "examples 29", 1);
    assert!(parse(&fewer).contains("expected `end`"), "{}", parse(&fewer));
    let huge = text.replacen("keys 10", "keys 99999999999999", 1);
    assert!(parse(&huge).contains("not a number up to"), "{}", parse(&huge));
    let digest = text.replacen("\ndata ", "\ndata zz", 1);
    assert!(parse(&digest).contains("data"), "{}", parse(&digest));
}

#[test]
fn refinement_never_makes_a_plan_worse() {
    for seed in 0..10 {
        let g = random_graph(300, 120, seed);
        for nodes in [2, 3, 4] {
            let options = Options { batch: 4, seed, ..Options::new(nodes) };
            let bottleneck = |refine| {
                let plan = copartition(&g, &Options { refine, ..options.clone() }).unwrap();
                assert!(balanced(&g, nodes, &plan.examples), "seed {seed}, {nodes} nodes, refined {refine}: unbalanced");
                traffic(&g, nodes, 4, &plan.examples, plan.placement.homes()).unwrap().bottleneck
            };
            let (paper, refined) = (bottleneck(false), bottleneck(true));
            assert!(refined <= paper + 1e-9, "seed {seed}, {nodes} nodes: refined {refined} above {paper}");
        }
    }
}

#[test]
fn reallocation_moves_keys_to_where_the_accesses_went() {
    // Ten keys, all held by node 0; node 1's examples use keys 5..10 heavily, node 0's 0..5.
    let mut g = Incidence::new(10).unwrap();
    let mut examples = Vec::new();
    for e in 0..200u64 {
        let node = (e % 2) as u16;
        g.push_example([e % 5 + 5 * node as u64, (e / 2) % 5 + 5 * node as u64]).unwrap();
        examples.push(node);
    }
    let owners = vec![0u16; 10];
    let r = reallocate(&g, &examples, &owners, 2, 1, 0.0).unwrap();
    assert!(!r.moves.is_empty() && r.after.bottleneck < r.before.bottleneck, "{r:?}");
    assert!(r.moves.iter().all(|m| m.key >= 5 && (m.from, m.to) == (0, 1)), "{:?}", r.moves);
    let mut moved = owners.clone();
    for m in &r.moves {
        moved[m.key as usize] = m.to;
    }
    assert_eq!(traffic(&g, 2, 1, &examples, &moved).unwrap(), r.after);
    // Moves that cost more than any gain are not made.
    let r = reallocate(&g, &examples, &owners, 2, 1, 1e9).unwrap();
    assert!(r.moves.is_empty() && r.after == r.before);
    assert!(reallocate(&g, &examples, &owners, 2, 1, f64::NAN).is_err());
    assert!(reallocate(&g, &examples, &owners[..9], 2, 1, 0.0).is_err());
}

#[test]
fn every_reallocation_move_gains_more_than_it_costs() {
    for seed in 0..20 {
        let g = random_graph(200, 60, seed);
        let nodes = 2 + (seed % 3) as usize;
        let pick = |i: u64| (crate::hashing::mix(seed ^ i) % nodes as u64) as u16;
        let examples: Vec<u16> = (0..200).map(pick).collect();
        let owners: Vec<u16> = (0..60).map(|k| pick(1000 + k)).collect();
        let cost = (seed % 4) as f64;
        let r = reallocate(&g, &examples, &owners, nodes, 4, cost).unwrap();
        let mut current = owners.clone();
        let mut bottleneck = r.before.bottleneck;
        for m in &r.moves {
            assert_eq!(current[m.key as usize], m.from, "seed {seed}: {m:?} is not where it was");
            current[m.key as usize] = m.to;
            let now = traffic(&g, nodes, 4, &examples, &current).unwrap().bottleneck;
            assert!(now < bottleneck - cost + 1e-6, "seed {seed}: {m:?} took the bottleneck from {bottleneck} to {now} at a cost of {cost}");
            bottleneck = now;
        }
        assert!((r.after.bottleneck - bottleneck).abs() < 1e-6);
    }
}

#[test]
fn arriving_examples_go_where_their_keys_are_held() {
    // 100 examples on keys 0..10 (held by node 0) and 100 on keys 10..20 (node 1), then 40 new
    // ones of each kind dealt round robin: placing them sends each kind to its keys' node.
    let mut g = Incidence::new(20).unwrap();
    let mut examples = Vec::new();
    for e in 0..280u64 {
        let kind = if e < 200 { e / 100 } else { e % 2 };
        g.push_example([kind * 10 + e % 10, kind * 10 + (e / 10) % 10]).unwrap();
        examples.push(if e < 200 { kind as u16 } else { ((e / 2) % 2) as u16 });
    }
    let owners: Vec<u16> = (0..20).map(|k| (k / 10) as u16).collect();
    let options = Options::new(2);
    let before = traffic(&g, 2, 1, &examples, &owners).unwrap().bottleneck;
    let moved = place_examples(&g, &mut examples, 200, &owners, &options).unwrap();
    let after = traffic(&g, 2, 1, &examples, &owners).unwrap().bottleneck;
    assert!(moved >= 30 && after < before / 2.0, "{moved} moved; {before} -> {after}");
    assert!(examples[..200].iter().enumerate().all(|(e, &n)| n as usize == e / 100), "placed examples stay");
    assert!(place_examples(&g, &mut examples, 200, &owners[..19], &options).is_err());
}

#[test]
fn shared_keys_are_those_two_nodes_touch() {
    // Examples 0 and 1 on node 0, 2 on node 1: key 1 is touched by both nodes, key 0 twice by
    // node 0 only, key 3 by node 1 only, key 2 by nobody.
    let mut g = Incidence::new(4).unwrap();
    for row in [vec![0, 1], vec![0], vec![1, 3]] {
        g.push_example(row).unwrap();
    }
    let plan =
        Plan { examples: vec![0, 0, 1], placement: std::sync::Arc::new(Placement::new(2, vec![0, 0, 0, 1]).unwrap()), batch: 1, data_digest: g.digest() };
    assert_eq!(plan.shared_keys(&g).unwrap(), vec![1]);
    assert_eq!(plan.users(&g).unwrap(), vec![1, 2, 0, 1]);
    // Against a direct count on random graphs and plans.
    for seed in 0..20 {
        let g = random_graph(40, 12, seed);
        let plan = copartition(&g, &Options::new(3)).unwrap();
        let direct: Vec<u64> = (0..12)
            .filter(|&k| {
                let users: std::collections::BTreeSet<u16> = (0..g.examples()).filter(|&e| g.row(e).contains(&(k as u32))).map(|e| plan.examples[e]).collect();
                users.len() >= 2
            })
            .collect();
        assert_eq!(plan.shared_keys(&g).unwrap(), direct, "seed {seed}");
        let users = plan.users(&g).unwrap();
        for k in 0..12u32 {
            let direct: std::collections::BTreeSet<u16> = (0..g.examples()).filter(|&e| g.row(e).contains(&k)).map(|e| plan.examples[e]).collect();
            assert_eq!(users[k as usize] as usize, direct.len(), "seed {seed}, key {k}");
        }
    }
    // A plan for other data is refused.
    assert!(plan.shared_keys(&random_graph(5, 4, 9)).is_err());
}
