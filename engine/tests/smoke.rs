use ferry::{Config, Node, TableSpec};

#[test]
fn two_nodes_push_pull_localize() {
    let nodes = Node::start_local_cluster(2, Config::new(vec![TableSpec::new("w", 100, 4)])).unwrap();
    let t = nodes[0].table("w").unwrap();
    let mut w0 = nodes[0].worker();
    let mut w1 = nodes[1].worker();
    w0.push(t, &[1, 99, 50], &[1.0; 12]).unwrap();
    w1.push(t, &[1, 99, 50], &[2.0; 12]).unwrap();
    let mut out = vec![0.0; 12];
    w0.pull(t, &[1, 99, 50], &mut out).unwrap();
    assert_eq!(out, vec![3.0; 12]);
    w0.localize(t, &[99, 98]).unwrap();
    w1.push(t, &[99], &[1.0; 4]).unwrap();
    let mut one = vec![0.0; 4];
    assert!(w0.pull_if_local(t, &[99], &mut one).unwrap());
    assert_eq!(one, vec![4.0; 4]);
    w1.pull(t, &[99], &mut one).unwrap();
    assert_eq!(one, vec![4.0; 4]);
    let s0 = nodes[0].stats();
    eprintln!("{s0:?}");
    assert_eq!(s0.relocations_in, 2, "keys 98 and 99 both live on node 1");
    drop((w0, w1));
    let handles: Vec<_> = nodes
        .into_iter()
        .map(|n| {
            std::thread::spawn(move || {
                let mut n = n;
                n.finalize()
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap().unwrap();
    }
}
