//! `ferry-bench` as a user runs it: every benchmark the README names is a subcommand, and a
//! bad option is one line of error, not a panic. (Being an integration test of this package,
//! it also has `cargo test --workspace` build the `ferry-bench` binary that the workspace's
//! other tests run.)

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferry-bench")).args(args).output().expect("running ferry-bench")
}

/// Held by the tests that run clusters of processes, one at a time: the stages test times
/// single pulls, and on two cores a failover run beside it (four processes joining, killing,
/// pushing) made a sixth of its pulls lose points.
static CLUSTERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_cluster_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    CLUSTERS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn every_benchmark_is_a_subcommand_and_bad_options_are_one_line() {
    let help = String::from_utf8_lossy(&bench(&["--help"]).stdout).into_owned();
    for sub in ["micro", "fuzz", "train", "replicate", "relocate", "failover"] {
        assert!(help.lines().any(|l| l.trim_start().starts_with(sub)), "{sub} missing from:\n{help}");
        assert!(bench(&[sub, "--help"]).status.success(), "{sub} --help");
    }
    let out = bench(&["micro", "--repeat", "many"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("invalid value 'many'") && !stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_single_key_pull_splits_into_stages_that_add_up() {
    // Two real processes over loopback: every pull's points are found on both nodes, and the
    // stages of the median pull account for it.
    let _alone = one_cluster_at_a_time();
    let out = bench(&["micro", "--quick", "--only", "stages", "--json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.contains("\"bench\":\"stages\"")).unwrap_or_else(|| panic!("no stages record in:\n{stdout}"));
    let record: serde_json::Value = serde_json::from_str(line).expect("a JSON record");
    let f = &record["figures"];
    let (pulls, iterations) = (f["pulls"].as_u64().unwrap(), f["iterations"].as_u64().unwrap());
    assert!(pulls * 10 >= iterations * 9, "only {pulls} of {iterations} pulls had all their points: {line}");
    let stages = ["issue", "to_send", "to_remote", "remote_step", "remote_to_send", "to_local", "local_step", "wake"];
    assert!(stages.iter().all(|s| f[format!("{s}_p50_ns")].as_u64().is_some_and(|v| v > 0)), "{line}");
    let (sum, total) = (f["stages_p50_sum_ns"].as_f64().unwrap(), f["p50_ns"].as_f64().unwrap());
    assert!(sum > 0.5 * total && sum < 2.0 * total, "the stages' medians add up to {sum} ns against a median pull of {total} ns");
}

/// Three real processes with one backup per key; one is killed with `kill -9` after every node
/// pushed known updates, and the survivors serve its keys again: the bench's rank 0 checks the
/// values it pulls afterwards hold every acknowledged push (it fails otherwise), and reports
/// when it saw the loss and when the keys were served again. Then a fresh process joins in the
/// killed one's rank, as `ferry launch --join` starts it: the bench fails unless it holds that
/// rank's share again, reads every acknowledged push and passes a barrier with the survivors.
#[test]
fn a_killed_node_keys_are_served_again_with_every_acknowledged_push() {
    let _alone = one_cluster_at_a_time();
    let out = bench(&["failover", "--only", "trials", "--trials", "3", "--json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let record: serde_json::Value = stdout.lines().find_map(|l| serde_json::from_str(l).ok()).expect("a JSON record");
    let figures = &record["figures"];
    let (p50, p99, detect) = (figures["p50_s"].as_f64().unwrap(), figures["p99_s"].as_f64().unwrap(), figures["detect_p50_ms"].as_f64().unwrap());
    assert!(p50 > 0.0 && p50 <= p99, "{figures}");
    assert!(detect / 1e3 <= p50, "the loss is seen before the keys are served again: {figures}");
    // Loopback TCP sees a killed process's connections close at once: far below the 5 s
    // liveness timeout.
    assert!(p99 < 5.0, "{figures}");
    let join = figures["join_p50_ms"].as_f64().unwrap();
    assert!(join > 0.0 && join <= figures["join_p99_ms"].as_f64().unwrap(), "{figures}");
}

/// Four nodes; one leaves gracefully while the others push batches of every node's keys: the
/// bench fails unless every push made is there afterwards, and reports the pause the pushes saw
/// against their p99 before the leave.
#[test]
fn a_node_that_leaves_pauses_the_others_briefly_and_loses_nothing() {
    let _alone = one_cluster_at_a_time();
    let out = bench(&["failover", "--only", "leave", "--trials", "3", "--quick", "--json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let record: serde_json::Value = stdout.lines().find_map(|l| serde_json::from_str(l).ok()).expect("a JSON record");
    let figures = &record["figures"];
    let (pause, handover) = (figures["pause_p99_ms"].as_f64().unwrap(), figures["handover_p50_ms"].as_f64().unwrap());
    assert!(pause > 0.0 && handover > 0.0, "{figures}");
    assert_eq!(figures["lost_pushes"].as_f64(), Some(0.0), "{figures}");
    assert!(figures["keys_handed_over"].as_f64().unwrap() >= 10_000.0, "the leaver's quarter of the keys: {figures}");
}
