//! Relocations back and forth between two in-process nodes, for profiling.
//! Usage: `relocate_loop [keys] [value_len] [rounds]`.
fn main() {
    let arg = |i: usize| std::env::args().nth(i);
    let keys: u64 = arg(1).and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let value_len: usize = arg(2).and_then(|a| a.parse().ok()).unwrap_or(1);
    let rounds: usize = arg(3).and_then(|a| a.parse().ok()).unwrap_or(10);
    let nodes = ferry::Node::start_local_cluster(2, ferry::Config::new(vec![ferry::TableSpec::new("t", 2 * keys, value_len)])).unwrap();
    let table = nodes[0].table("t").unwrap();
    let (mut w0, mut w1) = (nodes[0].worker(), nodes[1].worker());
    let block: Vec<u64> = (keys..2 * keys).collect(); // homed at node 1
    let t = std::time::Instant::now();
    for _ in 0..rounds {
        w0.localize(table, &block).unwrap();
        w1.localize(table, &block).unwrap();
    }
    let secs = t.elapsed().as_secs_f64();
    let moved = (2 * rounds) as f64 * keys as f64;
    eprintln!("{:.2} M keys/s, {:.2} GB/s", moved / secs / 1e6, moved * value_len as f64 * 4.0 / secs / 1e9);
}
