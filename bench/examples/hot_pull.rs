//! Runs the local pull path in a loop (for profiling with callgrind).
fn main() {
    let node = ferry::Node::start(ferry::Config::new(vec![ferry::TableSpec::new("t", 4096, 1)])).unwrap();
    let table = node.table("t").unwrap();
    let mut w = node.worker();
    let mut out = [0.0f32];
    let mut k = 0u64;
    for _ in 0..1_000_000 {
        k = (k + 97) % 4096;
        w.pull(table, &[k], &mut out).unwrap();
    }
    std::hint::black_box(out);
}
