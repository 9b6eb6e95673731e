//! Criterion benchmarks of the local fast path: a latch and a copy, against a plain copy.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ferry::{Config, Node, TableSpec};

fn local_path(c: &mut Criterion) {
    let lens = [1usize, 64, 1024];
    let mut node = Node::start(Config::new(lens.iter().map(|&l| TableSpec::new(format!("t{l}"), 4096, l)).collect())).expect("node");
    let mut worker = node.worker();
    let mut group = c.benchmark_group("local");
    for &len in &lens {
        let table = node.table(&format!("t{len}")).expect("table");
        let plain = vec![1.0f32; 4096 * len];
        let mut out = vec![0.0f32; len];
        let update = vec![0.5f32; len];
        let mut k = 0u64;
        group.bench_with_input(BenchmarkId::new("memcpy", len), &len, |b, _| {
            b.iter(|| {
                k = (k + 97) % 4096;
                out.copy_from_slice(&plain[k as usize * len..(k as usize + 1) * len]);
                black_box(&out);
            })
        });
        group.bench_with_input(BenchmarkId::new("pull", len), &len, |b, _| {
            b.iter(|| {
                k = (k + 97) % 4096;
                worker.pull(table, &[k], &mut out).expect("pull");
                black_box(&out);
            })
        });
        group.bench_with_input(BenchmarkId::new("push", len), &len, |b, _| {
            b.iter(|| {
                k = (k + 97) % 4096;
                worker.push(table, &[k], &update).expect("push");
            })
        });
    }
    group.finish();
    drop(worker);
    node.finalize().expect("finalize");
}

criterion_group!(benches, local_path);
criterion_main!(benches);
