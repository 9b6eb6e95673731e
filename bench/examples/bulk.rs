//! Bulk remote pushes or pulls between two in-process nodes, for profiling (perf, callgrind).
//! Usage: `bulk [push|pull|both] [keys] [value_len] [repetitions]`.
fn main() {
    let arg = |i: usize| std::env::args().nth(i);
    let mode = arg(1).unwrap_or_else(|| "both".into());
    let keys: u64 = arg(2).and_then(|a| a.parse().ok()).unwrap_or(300_000);
    let value_len: usize = arg(3).and_then(|a| a.parse().ok()).unwrap_or(1);
    let reps: usize = arg(4).and_then(|a| a.parse().ok()).unwrap_or(10);
    let mut c = ferry::Config::new(vec![ferry::TableSpec::new("t", 2 * keys, value_len)]);
    c.latches = 1000;
    if let Some(p) = std::env::var("PART").ok().and_then(|p| p.parse().ok()) {
        c.part_bytes = p;
    }
    let nodes = ferry::Node::start_local_cluster(2, c).unwrap();
    let table = nodes[0].table("t").unwrap();
    let mut w = nodes[0].worker();
    let batch: Vec<u64> = (keys..2 * keys).collect();
    let mut vals = vec![1.0f32; batch.len() * value_len];
    let t = std::time::Instant::now();
    let mut ops = 0;
    for _ in 0..reps {
        if mode != "pull" {
            w.push(table, &batch, &vals).unwrap();
            ops += 1;
        }
        if mode != "push" {
            w.pull(table, &batch, &mut vals).unwrap();
            ops += 1;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    eprintln!("{mode}: {:.1} M keys/s, {:.2} GB/s of values", (ops * batch.len()) as f64 / secs / 1e6, (ops * batch.len() * value_len * 4) as f64 / secs / 1e9);
}
