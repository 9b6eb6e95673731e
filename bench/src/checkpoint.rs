//! `ferry-bench checkpoint`: what a checkpoint of one node's values costs, each figure against a
//! baseline measured in the same run — the pause a worker sees (the cut) against a memcpy of the
//! same bytes, the writing against a plain sequential write of the same bytes with one fsync,
//! the restore against a plain sequential read of them, and a worker's push throughput while
//! the files are written in the background against its throughput without.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ferry::{Config, Node, TableSpec};
use rand::{Rng, SeedableRng};

/// Options of `ferry-bench checkpoint`.
#[derive(Debug, Clone, clap::Args)]
pub struct CheckpointArgs {
    /// Values per node, in GiB.
    #[arg(long, default_value_t = 1.0)]
    pub gib: f64,
    /// Floats per key.
    #[arg(long, default_value_t = 64)]
    pub value_len: usize,
    /// Where to write (a directory on the disk to measure; default: the system's temporary
    /// directory). Removed afterwards.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// One JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Keys per push of the throughput loop.
const BATCH: usize = 1024;

/// Seconds, as a float.
fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Writes `bytes` bytes to `path` in 1 MiB pieces and fsyncs: the disk's sequential write.
fn write_baseline(path: &Path, bytes: usize) -> Result<Duration> {
    let piece = vec![0x5au8; 1 << 20];
    let started = Instant::now();
    let mut file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(piece.len());
        file.write_all(&piece[..n])?;
        left -= n;
    }
    file.sync_all()?;
    Ok(started.elapsed())
}

/// Reads `path` sequentially into memory (a buffer of its size, as a restore must hold the
/// values in memory): the disk's (or the page cache's) sequential read.
fn read_baseline(path: &Path) -> Result<Duration> {
    let started = Instant::now();
    let bytes = std::fs::read(path)?;
    std::hint::black_box(&bytes);
    Ok(started.elapsed())
}

/// Drops the page cache (root only), so that the next read comes from the disk; whether it could.
fn drop_caches() -> bool {
    let synced = std::process::Command::new("sync").status().is_ok_and(|s| s.success());
    synced && std::fs::write("/proc/sys/vm/drop_caches", "1\n").is_ok()
}

/// Pushes of `BATCH` random keys for `how_long` (or until `until` says stop): pushes per second.
fn push_rate(worker: &mut ferry::Worker, table: ferry::Table, how_long: Duration, until: impl Fn() -> bool) -> Result<f64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let updates = vec![1e-3f32; BATCH * table.value_len()];
    let mut keys = vec![0u64; BATCH];
    let (started, mut pushes) = (Instant::now(), 0u64);
    while started.elapsed() < how_long && !until() {
        for k in keys.iter_mut() {
            *k = rng.gen_range(0..table.keys());
        }
        worker.push(table, &keys, &updates)?;
        pushes += 1;
    }
    Ok(pushes as f64 / secs(started.elapsed()))
}

/// Runs the benchmark and prints its figures.
pub fn run(a: &CheckpointArgs) -> Result<()> {
    ensure!(a.gib > 0.0 && a.gib.is_finite() && a.value_len > 0, "--gib and --value-len must be positive");
    let keys = ((a.gib * (1u64 << 30) as f64) / (4 * a.value_len) as f64).ceil() as u64;
    let bytes = keys as usize * a.value_len * 4;
    let root = a.dir.clone().unwrap_or_else(std::env::temp_dir).join(format!("ferry-bench-checkpoint-{}", std::process::id()));
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let outcome = measure(a, keys, bytes, &root);
    let _ = std::fs::remove_dir_all(&root);
    outcome
}

fn measure(a: &CheckpointArgs, keys: u64, bytes: usize, root: &Path) -> Result<()> {
    let spec = TableSpec::new("values", keys, a.value_len);
    let mut node = Node::start(Config::new(vec![spec.clone()]))?;
    let table = node.table("values")?;
    let mut worker = node.worker();
    let all: Vec<u64> = (0..keys).collect();
    for chunk in all.chunks(1 << 16) {
        let values: Vec<f32> = chunk.iter().flat_map(|&k| (0..a.value_len).map(move |j| (k as f32) * 1e-3 + j as f32)).collect();
        worker.set(table, chunk, &values)?;
    }
    // memcpy of the same bytes (the second copy, after the pages are faulted in).
    let source = vec![1u8; bytes];
    let mut target = vec![0u8; bytes];
    target.copy_from_slice(&source);
    let started = Instant::now();
    target.copy_from_slice(std::hint::black_box(&source));
    let memcpy = started.elapsed();
    drop((source, target));
    // Training throughput without a checkpoint.
    let alone = push_rate(&mut worker, table, Duration::from_millis(1500), || false)?;
    // A first checkpoint maps the node's cut buffers; the second, measured, is what a checkpoint
    // every epoch costs.
    // Its writing, with nothing else running, is the write figure against the plain write.
    let first = node.checkpoint_in_background(root.join("first"))?;
    let started = Instant::now();
    first.wait()?;
    let quiet_write = started.elapsed();
    // The checkpoint: the cut (the pause), then the writing in the background while the worker
    // pushes.
    let dir = root.join("checkpoint");
    let mut at_cut = vec![0f32; a.value_len];
    worker.pull(table, &[keys - 1], &mut at_cut)?;
    let started = Instant::now();
    let writing = node.checkpoint_in_background(&dir)?;
    let cut = started.elapsed();
    let during = push_rate(&mut worker, table, Duration::from_secs(3600), || writing.is_finished())?;
    let info = writing.wait()?;
    let written = started.elapsed().saturating_sub(cut);
    drop(worker);
    node.finalize()?;
    // Sequential write and read of as many bytes as the values file.
    let plain = root.join("plain");
    let write = write_baseline(&plain, info.bytes as usize)?;
    // Reads from the disk where the page cache can be dropped (as root), else from the cache.
    let cold = drop_caches();
    let read = read_baseline(&plain)?;
    drop_caches();
    // Restore: a node started from the checkpoint, against one started empty.
    let started = Instant::now();
    // Normal pages for both: which of them gets the machine's few explicit huge pages would
    // otherwise decide more than the restore does.
    let config = |spec: TableSpec| {
        let mut c = Config::new(vec![spec]);
        c.huge_pages = ferry::HugePages::Off;
        c
    };
    let mut empty = Node::start(config(spec.clone()))?;
    let start_empty = started.elapsed();
    empty.finalize()?;
    let started = Instant::now();
    let mut restored = Node::start(config(spec).restoring_from(&dir))?;
    let restore = started.elapsed().saturating_sub(start_empty);
    let mut check = restored.worker();
    let mut value = vec![0f32; a.value_len];
    check.pull(table, &[keys - 1], &mut value)?;
    ensure!(value == at_cut, "the last key was restored as {value:?}, not {at_cut:?}");
    drop(check);
    restored.finalize()?;
    let gb = info.bytes as f64 / 1e9;
    let figures = serde_json::json!({
        "bytes": info.bytes,
        "keys": keys,
        "value_len": a.value_len,
        "cut_s": secs(cut),
        "memcpy_s": secs(memcpy),
        "cut_vs_memcpy": secs(cut) / secs(memcpy),
        "write_gb_s": gb / secs(quiet_write),
        "plain_write_gb_s": gb / secs(write),
        "write_vs_plain": secs(write) / secs(quiet_write),
        "write_while_training_gb_s": gb / secs(written),
        "restore_gb_s": gb / secs(restore),
        "plain_read_gb_s": gb / secs(read),
        "restore_vs_plain": secs(read) / secs(restore),
        "reads_from_disk": cold,
        "pushes_per_s_alone": alone,
        "pushes_per_s_while_writing": during,
        "throughput_while_writing": during / alone,
    });
    if a.json {
        println!("{figures}");
        return Ok(());
    }
    println!("checkpoint of {:.2} GiB ({keys} keys × {} floats) on one node", info.bytes as f64 / (1u64 << 30) as f64, a.value_len);
    println!("  pause (the cut)        {:8.3} s   memcpy of the same bytes {:8.3} s   ratio {:.2}", secs(cut), secs(memcpy), secs(cut) / secs(memcpy));
    println!(
        "  write, after the cut   {:8.2} GB/s plain write + fsync      {:8.2} GB/s ratio {:.2}",
        gb / secs(quiet_write),
        gb / secs(write),
        secs(write) / secs(quiet_write)
    );
    println!("  (while a worker pushes {:8.2} GB/s)", gb / secs(written));
    let source = if cold { "from disk" } else { "page cache" };
    println!(
        "  restore ({source})     {:8.2} GB/s plain sequential read   {:8.2} GB/s ratio {:.2}",
        gb / secs(restore),
        gb / secs(read),
        secs(read) / secs(restore)
    );
    println!("  pushes while writing   {:8.0} /s   without                  {:8.0} /s   ratio {:.2}", during, alone, during / alone);
    Ok(())
}
