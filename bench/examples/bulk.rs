//! Bulk remote pushes and pulls between two in-process nodes (for profiling with callgrind).
fn main() {
    let mut c = ferry::Config::new(vec![ferry::TableSpec::new("t", 600_000, 1)]);
    c.latches = 1000;
    let nodes = ferry::Node::start_local_cluster(2, c).unwrap();
    let table = nodes[0].table("t").unwrap();
    let mut w = nodes[0].worker();
    let keys: Vec<u64> = (300_000..600_000).collect();
    let mut vals = vec![1.0f32; keys.len()];
    let reps: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(10);
    let t = std::time::Instant::now();
    for _ in 0..reps {
        w.push(table, &keys, &vals).unwrap();
        w.pull(table, &keys, &mut vals).unwrap();
    }
    eprintln!("{:.1} M keys/s", (2 * reps * keys.len()) as f64 / t.elapsed().as_secs_f64() / 1e6);
}
