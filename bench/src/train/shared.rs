//! Pieces shared by the workloads and their epoch loop: plain shared arrays for the `single`
//! mode, cluster-wide sums through a Ferry table, and per-epoch statistics.

use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::Result;
use ferry::LateCause;
use ferry::{Node, Stats, Table, Worker};

/// Floats that several threads read and write without locks (the `single` mode's parameters).
///
/// Each element is an `AtomicU32` holding the float's bits, accessed with relaxed loads and
/// stores: the same machine code as plain floats, but defined behaviour when threads race (as
/// Hogwild-style SGD lets them).
pub struct SharedArray {
    data: Vec<AtomicU32>,
    row: usize,
}

impl SharedArray {
    /// `rows × row` elements, each set by `init(row, column)`.
    pub fn new(rows: usize, row: usize, mut init: impl FnMut(usize, usize) -> f32) -> SharedArray {
        let mut data = Vec::with_capacity(rows * row);
        for r in 0..rows {
            for c in 0..row {
                data.push(AtomicU32::new(init(r, c).to_bits()));
            }
        }
        SharedArray { data, row }
    }

    /// Every row, one after the other.
    pub fn to_vec(&self) -> Vec<f32> {
        self.data.iter().map(|a| f32::from_bits(a.load(Ordering::Relaxed))).collect()
    }

    /// Elements per row.
    pub fn row_len(&self) -> usize {
        self.row
    }

    /// Copies row `r` into `out`.
    #[inline]
    pub fn read(&self, r: usize, out: &mut [f32]) {
        for (o, a) in out.iter_mut().zip(&self.data[r * self.row..(r + 1) * self.row]) {
            *o = f32::from_bits(a.load(Ordering::Relaxed));
        }
    }

    /// Sets row `r` to `values`.
    #[inline]
    pub fn write(&self, r: usize, values: &[f32]) {
        for (v, a) in values.iter().zip(&self.data[r * self.row..(r + 1) * self.row]) {
            a.store(v.to_bits(), Ordering::Relaxed);
        }
    }

    /// Adds `delta` to row `r` (not atomic as a whole: concurrent adds may lose one another,
    /// as in Hogwild).
    #[inline]
    pub fn add(&self, r: usize, delta: &[f32]) {
        for (d, a) in delta.iter().zip(&self.data[r * self.row..(r + 1) * self.row]) {
            a.store((f32::from_bits(a.load(Ordering::Relaxed)) + d).to_bits(), Ordering::Relaxed);
        }
    }
}

/// Fields every node contributes to an epoch's cluster-wide sums.
pub const METRIC_FIELDS: usize = 38;

/// Field positions in the metrics table.
pub mod field {
    /// Sum of training losses.
    pub const LOSS: usize = 0;
    /// Training examples.
    pub const EXAMPLES: usize = 1;
    /// Keys accessed locally.
    pub const LOCAL: usize = 2;
    /// Keys accessed remotely.
    pub const REMOTE: usize = 3;
    /// Relocations into the node.
    pub const RELOCATIONS: usize = 4;
    /// Messages sent (thousands, to keep floats exact).
    pub const KILO_MESSAGES: usize = 5;
    /// Bytes sent (megabytes).
    pub const MEGABYTES: usize = 6;
    /// Sum of squared test errors (MF).
    pub const TEST_SSE: usize = 7;
    /// Test examples (MF).
    pub const TEST_COUNT: usize = 8;
    /// Training time of the slowest node's epoch.
    pub const EPOCH_S: usize = 9;
    /// Keys accessed through replicas.
    pub const REPLICA: usize = 10;
    /// Replica age at reads, 99th percentile, in milliseconds (summed over nodes).
    pub const STALENESS_P99_MS: usize = 11;
    /// Bytes read by replica refreshes (megabytes).
    pub const REFRESH_MB: usize = 12;
    /// Nodes reporting (each adds 1).
    pub const NODES: usize = 13;
    /// Late accesses (intent mode).
    pub const LATE: usize = 14;
    /// Mean lead of intent actions in clocks (summed over nodes).
    pub const INTENT_LEAD: usize = 15;
    /// Late accesses by cause: window not acted on yet, nothing on its way, grant not taken
    /// up yet, key on its way, replica being made, key left again (see
    /// `ferry::LateCause`).
    pub const LATE_CAUSES: [usize; 6] = [16, 17, 18, 19, 20, 21];
    /// Keys whose homes were asked again (intent mode; `ferry::IntentStats::reasked`).
    pub const REASKED: usize = 22;
    /// Moves asked for on a grant that the homes declined (intent mode;
    /// `ferry::IntentStats::declined`).
    pub const DECLINED: usize = 23;
    /// Dropped replicas pushed to while they drained (intent mode;
    /// `ferry::IntentStats::drained_again`).
    pub const DRAINED_AGAIN: usize = 24;
    /// Replicas made with pushes sent behind their pull (intent mode;
    /// `ferry::IntentStats::made_with_pushes`).
    pub const MADE_WITH_PUSHES: usize = 25;
    /// Granted moves put off while a sync round carried their replicas' deltas (intent mode;
    /// `ferry::IntentStats::moves_put_off`).
    pub const MOVES_PUT_OFF: usize = 26;
    /// Key updates a push filter held back, and key updates offered to it, since the start (LR
    /// with `--filter`).
    pub const FILTER_HELD: usize = 27;
    /// See [`FILTER_HELD`].
    pub const FILTER_OFFERED: usize = 28;
    /// Sum of absolute test errors (MF).
    pub const TEST_AE: usize = 29;
    /// Megabytes node `r` sent and received, in field `NODE_MEGABYTES[r % 8]` (the busiest
    /// node's traffic, the co-partitioning objective; beyond 8 nodes, of groups of nodes).
    pub const NODE_MEGABYTES: [usize; 8] = [30, 31, 32, 33, 34, 35, 36, 37];
}

/// Pulls keys `0..n` of `table` (`len` values each), in chunks.
pub fn pull_all(w: &mut Worker, table: Table, n: usize, len: usize) -> Result<Vec<f32>> {
    let mut all = vec![0.0; n * len];
    let keys: Vec<u64> = (0..n as u64).collect();
    for (c, chunk) in keys.chunks(4096).enumerate() {
        w.pull(table, chunk, &mut all[c * 4096 * len..(c * 4096 + chunk.len()) * len])?;
    }
    Ok(all)
}

/// The first `cols` values of every row of `len` (a table's parameters without the optimizer
/// state stored beside them).
pub fn leading_columns(all: &[f32], len: usize, cols: usize) -> Vec<f32> {
    all.chunks(len).flat_map(|row| row[..cols].iter().copied()).collect()
}

/// Adds this node's `values` to the cluster-wide sums of `slot` (a key of the metrics table),
/// waits for every node, and returns the sums. Every node must call it with the same slot.
/// `tolerate_loss`: a push that a lost node failed does not end the run (`--on-loss continue`).
pub fn all_reduce(worker: &mut Worker, metrics: Table, slot: u64, values: &[f32; METRIC_FIELDS], tolerate_loss: bool) -> Result<[f32; METRIC_FIELDS]> {
    match worker.push(metrics, &[slot], values) {
        // --on-loss continue: the figures' push may or may not have been applied before a node
        // was lost; this epoch's sums may then lack (or not) this node's figures.
        Err(ferry::Error::PeerLost { .. }) if tolerate_loss => {}
        outcome => outcome?,
    }
    worker.barrier()?;
    let mut out = [0.0f32; METRIC_FIELDS];
    worker.pull(metrics, &[slot], &mut out)?;
    worker.barrier()?;
    Ok(out)
}

/// The epoch's mean training loss from its summed figures (loss per example).
pub fn mean_loss(sums: &[f32; METRIC_FIELDS]) -> f64 {
    sums[field::LOSS] as f64 / (sums[field::EXAMPLES] as f64).max(1.0)
}

/// The statistics fields of an epoch: locality, relocations, traffic.
pub fn stats_fields(delta: &Stats, rank: usize, out: &mut [f32; METRIC_FIELDS]) {
    out[field::LOCAL] = delta.local_accesses as f32;
    out[field::REMOTE] = delta.remote_accesses as f32;
    out[field::RELOCATIONS] = delta.relocations_in as f32;
    out[field::KILO_MESSAGES] = delta.traffic.total_messages() as f32 / 1e3;
    out[field::MEGABYTES] = delta.traffic.total_bytes() as f32 / 1e6;
    out[field::NODE_MEGABYTES[rank % 8]] = (delta.traffic.total_bytes() + delta.received_bytes) as f32 / 1e6;
    out[field::REPLICA] = delta.replication.replica_accesses as f32;
    out[field::STALENESS_P99_MS] = delta.replication.staleness.p99_ns as f32 / 1e6;
    // Reads of replicated keys' images (NuPS) and of run-time replicas' (intent).
    out[field::REFRESH_MB] = (delta.replication.refresh_bytes + delta.intent.refresh_bytes) as f32 / 1e6;
    out[field::NODES] = 1.0;
    out[field::LATE] = delta.intent.late_accesses as f32;
    out[field::INTENT_LEAD] = delta.intent.mean_lead() as f32;
    out[field::REASKED] = delta.intent.reasked as f32;
    out[field::DECLINED] = delta.intent.declined as f32;
    out[field::DRAINED_AGAIN] = delta.intent.drained_again as f32;
    out[field::MADE_WITH_PUSHES] = delta.intent.made_with_pushes as f32;
    out[field::MOVES_PUT_OFF] = delta.intent.moves_put_off as f32;
    for (f, cause) in field::LATE_CAUSES.into_iter().zip(LateCause::ALL) {
        out[f] = delta.intent.late(cause) as f32;
    }
}

/// Runs `body(t, worker)` on `threads` threads, each with its own worker of `node`, and returns
/// the first error.
pub fn run_workers(node: &Node, threads: usize, body: impl Fn(usize, Worker) -> Result<()> + Sync) -> Result<()> {
    std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let w = node.worker();
                s.spawn(move || body(t, w))
            })
            .collect();
        handles.into_iter().try_for_each(|h| h.join().expect("training thread"))
    })
}

/// An epoch's report from the cluster-wide sums of [`all_reduce`] (loss per example, local
/// share, relocations and traffic).
pub fn cluster_report(
    task: &str,
    mode: super::Mode,
    epoch: usize,
    epoch_s: f64,
    elapsed_s: f64,
    sums: &[f32; METRIC_FIELDS],
    quality: serde_json::Map<String, serde_json::Value>,
) -> super::EpochReport {
    let (local, remote) = (sums[field::LOCAL] as f64, sums[field::REMOTE] as f64);
    super::EpochReport {
        task: task.into(),
        mode,
        epoch,
        nodes: sums[field::NODES] as usize,
        epoch_s,
        elapsed_s,
        loss: mean_loss(sums),
        quality,
        local_share: if local + remote > 0.0 { local / (local + remote) } else { 1.0 },
        relocations: sums[field::RELOCATIONS] as u64,
        messages: (sums[field::KILO_MESSAGES] as f64 * 1e3) as u64,
        bytes: (sums[field::MEGABYTES] as f64 * 1e6) as u64,
        busiest_node_bytes: (field::NODE_MEGABYTES.iter().map(|&f| sums[f] as f64).fold(0.0, f64::max) * 1e6) as u64,
        replica_share: if local + remote > 0.0 { sums[field::REPLICA] as f64 / (local + remote) } else { 0.0 },
        staleness_p99_ms: sums[field::STALENESS_P99_MS] as f64 / (sums[field::NODES] as f64).max(1.0),
        refresh_bytes: (sums[field::REFRESH_MB] as f64 * 1e6) as u64,
        late_share: if local + remote > 0.0 { sums[field::LATE] as f64 / (local + remote) } else { 0.0 },
        intent_lead: sums[field::INTENT_LEAD] as f64 / (sums[field::NODES] as f64).max(1.0),
        reasked: sums[field::REASKED] as u64,
        declined: sums[field::DECLINED] as u64,
        drained_again: sums[field::DRAINED_AGAIN] as u64,
        made_with_pushes: sums[field::MADE_WITH_PUSHES] as u64,
        moves_put_off: sums[field::MOVES_PUT_OFF] as u64,
        late_causes: super::LateCauses::from_counts(field::LATE_CAUSES.map(|f| sums[f] as f64)),
    }
}

/// Splits `0..n` into `parts` contiguous ranges of nearly equal size; part `i`.
pub fn part(n: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    (i * n / parts)..((i + 1) * n / parts)
}

/// Which part of `0..n` split into `parts` holds `x`.
pub fn part_of(x: usize, n: usize, parts: usize) -> usize {
    ((x + 1) * parts - 1) / n.max(1)
}

/// How long the other nodes wait in the barrier while rank 0 evaluates the model (minutes on a
/// large test set); every other wait uses the library's timeouts (`FERRY_OP_TIMEOUT`). A lost
/// rank 0 still fails the wait within the liveness timeout.
pub const EVALUATION_WAIT: std::time::Duration = std::time::Duration::from_secs(6 * 3600);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_everything_once() {
        for n in [1usize, 7, 100, 20_000] {
            for parts in 1..5 {
                let mut seen = 0;
                for i in 0..parts {
                    let r = part(n, parts, i);
                    for x in r.clone() {
                        assert_eq!(part_of(x, n, parts), i);
                    }
                    seen += r.len();
                }
                assert_eq!(seen, n);
            }
        }
        let a = SharedArray::new(2, 3, |r, c| (r * 3 + c) as f32);
        a.add(1, &[1.0, 1.0, 1.0]);
        let mut out = [0.0; 3];
        a.read(1, &mut out);
        assert_eq!(out, [4.0, 5.0, 6.0]);
    }
}
