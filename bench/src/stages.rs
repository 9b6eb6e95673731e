//! `ferry-bench micro --only stages`: where a remote single-key pull's time goes.
//!
//! Both nodes of the micro benchmark's cluster record the points their messages pass
//! (`ferry_tcp::stage_trace`: a protocol step ended, a connection is about to be written, a
//! connection was read) while rank 0 pulls one key of rank 1 at a time between its own marks. The nodes are
//! processes of one host, so their monotonic clocks agree: rank 1 hands its points over in a
//! file, and each pull's points, put in one order, split it into stages, whose percentiles are
//! reported next to the busy-polling raw TCP ping-pong of the same run.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ferry::{Table, Worker};
use ferry_tcp::stage_trace::{self, Point};
use serde_json::{Value, json};

use crate::micro::hist;
use crate::rawtcp::{self, Wait};
use crate::report::{Better, Record, record};

/// The benchmark's name for `--only`.
pub(crate) const BENCH: &str = "stages";

/// The stages of one pull, each ending at a point of the node in front: (name, node, point).
const STAGES: [(&str, usize, Point); 8] = [
    ("issue", 0, Point::Stepped),
    ("to_send", 0, Point::Sending),
    ("to_remote", 1, Point::Received),
    ("remote_step", 1, Point::Stepped),
    ("remote_to_send", 1, Point::Sending),
    ("to_local", 0, Point::Received),
    ("local_step", 0, Point::Stepped),
    ("wake", 0, Point::Return),
];

/// The configuration this benchmark reports.
pub(crate) fn config() -> Value {
    json!({"op": "pull", "value_len": 1, "keys": 1})
}

/// Where rank 1 hands its points to rank 0: named after the run's benchmark port, which both
/// know and no other run on the host uses at the same time.
fn trace_path(port: u16) -> PathBuf {
    std::env::temp_dir().join(format!("ferry-bench-stages-{port}.txt"))
}

/// Rank 1: records its points while rank 0 pulls (between the first two barriers), then hands
/// them over in a file (before the third).
pub(crate) fn serve(worker: &mut Worker, port: u16) -> Result<()> {
    worker.barrier()?;
    stage_trace::start();
    worker.barrier()?;
    let trace = stage_trace::stop();
    let path = trace_path(port);
    let text: String = trace.iter().map(|&(p, t)| format!("{} {t}\n", p as u8)).collect();
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    worker.barrier()?;
    Ok(())
}

fn read_trace(path: &PathBuf) -> Result<Vec<(Point, u64)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let _ = std::fs::remove_file(path);
    text.lines()
        .map(|line| {
            let (p, t) = line.split_once(' ').context("a trace line without a time")?;
            let point = Point::from_number(p.parse()?).context("an unknown point")?;
            Ok((point, t.parse()?))
        })
        .collect()
}

/// Rank 0 (rank 1 in [`serve`]): pulls one remote key at a time with both nodes recording,
/// and reports each stage's percentiles.
pub(crate) fn measure(worker: &mut Worker, client: &mut rawtcp::Client, table: Table, port: u16, quick: bool) -> Result<Record> {
    let iterations = if quick { 3_000 } else { 20_000 };
    let key = table.keys() - 1;
    let mut out = [0.0f32];
    let mut busy = hist();
    client.exchange_with(Wait::BusyPoll, 48, 40, 200, |_| {})?;
    client.exchange_with(Wait::BusyPoll, 48, 40, iterations as u64 / 2, |d| {
        busy.record(d.as_nanos() as u64).ok();
    })?;
    for _ in 0..200 {
        worker.pull(table, &[key], &mut out)?;
    }
    worker.barrier()?;
    stage_trace::start();
    for _ in 0..iterations {
        stage_trace::mark(Point::Call);
        worker.pull(table, &[key], &mut out)?;
        stage_trace::mark(Point::Return);
    }
    let own = stage_trace::stop();
    worker.barrier()?;
    worker.barrier()?;
    let peer = read_trace(&trace_path(port))?;
    let pulls = breakdown(&own, &peer);
    if pulls.is_empty() {
        bail!("no pull's points were all found ({} points here, {} at rank 1)", own.len(), peer.len());
    }
    let mut figures = json!({"pulls": pulls.len(), "iterations": iterations});
    let mut total = hist();
    let mut sum_p50 = 0;
    for (i, (name, _, _)) in STAGES.iter().enumerate() {
        let mut h = hist();
        for pull in &pulls {
            h.record(pull[i].max(1)).ok();
        }
        sum_p50 += h.value_at_quantile(0.5);
        figures[format!("{name}_p50_ns")] = json!(h.value_at_quantile(0.5));
        figures[format!("{name}_p90_ns")] = json!(h.value_at_quantile(0.9));
    }
    for pull in &pulls {
        total.record(pull.iter().sum::<u64>().max(1)).ok();
    }
    figures["p50_ns"] = json!(total.value_at_quantile(0.5));
    figures["p99_ns"] = json!(total.value_at_quantile(0.99));
    figures["stages_p50_sum_ns"] = json!(sum_p50);
    figures["busy_pingpong_p50_ns"] = json!(busy.value_at_quantile(0.5));
    Ok(record(BENCH, config(), figures, "p50_ns", "busy_pingpong", busy.value_at_quantile(0.5) as f64, Better::Lower, ("", 0.0)))
}

/// Splits each pull (rank 0's `Call` to its `Return`) into the durations of [`STAGES`]: the
/// first point of each stage's node and kind after the previous stage's end, within the pull.
/// Pulls whose points were not all found (a trace overflowed, a frame carried something else)
/// are left out.
fn breakdown(own: &[(Point, u64)], peer: &[(Point, u64)]) -> Vec<[u64; STAGES.len()]> {
    let mut merged: Vec<(u64, usize, Point)> = own.iter().map(|&(p, t)| (t, 0, p)).chain(peer.iter().map(|&(p, t)| (t, 1, p))).collect();
    merged.sort_by_key(|&(t, node, p)| (t, node, p));
    let mut pulls = Vec::new();
    let mut i = 0;
    while i < merged.len() {
        if merged[i].1 != 0 || merged[i].2 != Point::Call {
            i += 1;
            continue;
        }
        let start = i;
        let Some(end) = (start + 1..merged.len()).find(|&j| merged[j].1 == 0 && matches!(merged[j].2, Point::Return | Point::Call)) else { break };
        i = end;
        if merged[end].2 != Point::Return {
            continue;
        }
        let mut at = start;
        let mut stages = [0u64; STAGES.len()];
        let complete = STAGES.iter().enumerate().all(|(s, &(_, node, point))| {
            let found = (at + 1..=end).find(|&j| merged[j].1 == node && merged[j].2 == point);
            found.is_some_and(|j| {
                stages[s] = merged[j].0 - merged[at].0;
                at = j;
                true
            })
        });
        if complete {
            pulls.push(stages);
        }
    }
    pulls
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pulls_split_into_stages_on_the_shared_clock() {
        use Point::*;
        let own = [(Call, 100), (Stepped, 110), (Sending, 120), (Received, 190), (Stepped, 200), (Return, 230), (Call, 300), (Stepped, 305), (Return, 400)];
        // Rank 1 also read a heartbeat before the request was sent.
        let peer = [(Received, 115), (Received, 140), (Stepped, 160), (Sending, 170)];
        let pulls = breakdown(&own, &peer);
        assert_eq!(pulls, vec![[10, 10, 20, 20, 10, 20, 10, 30]], "the second pull's points are incomplete and left out");
        assert_eq!(pulls[0].iter().sum::<u64>(), 130, "the stages add up to the pull");
    }
}
