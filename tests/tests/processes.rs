//! Real multi-process clusters, started through `ferry launch`.

use std::time::Duration;

use ferry_tests::{binary, launch_testnode};

fn assert_ok(output: &std::process::Output, marker: &str) {
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "cluster failed: {}", output.status);
    assert!(stdout.contains(marker), "missing '{marker}' in output");
}

#[test]
fn two_processes_exact_sums() {
    let out = launch_testnode(2, &["sums", "--workers", "3", "--rounds", "300"], Duration::from_secs(120));
    assert_ok(&out, "[0] sums ok");
}

#[test]
fn three_processes_async_hash_partitioned() {
    let out = launch_testnode(3, &["sums", "--workers", "2", "--asynchronous", "--hash"], Duration::from_secs(120));
    assert_ok(&out, "[0] sums ok");
}

#[test]
fn four_processes_with_relocations_in_flight() {
    let out = launch_testnode(4, &["sums", "--workers", "2", "--relocate", "--asynchronous", "--keys", "60"], Duration::from_secs(120));
    assert_ok(&out, "[0] sums ok");
}

#[test]
fn recorded_history_is_sequentially_consistent() {
    let dir = std::env::temp_dir().join(format!("ferry-history-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = launch_testnode(3, &["history", "--workers", "2", "--ops", "200", "--dir", dir.to_str().unwrap()], Duration::from_secs(120));
    assert_ok(&out, "[0] history ok");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Random intents on three processes (keys moved, replicated on two or three nodes, dropped,
/// localized explicitly): the guarantee for keys under intent holds for every pull.
#[test]
fn intent_history_on_three_processes_keeps_each_nodes_pushes() {
    let dir = std::env::temp_dir().join(format!("ferry-intent-history-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = launch_testnode(3, &["intent-history", "--seed", "1", "--clocks", "150", "--dir", dir.to_str().unwrap()], Duration::from_secs(240));
    assert_ok(&out, "[0] intent history ok");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The last of three processes dies while keys move and are replicated under intent: the
/// survivors' calls fail naming the loss (never hang, never return a push twice), their barrier
/// fails at once and their intent services stop.
#[test]
fn a_crash_under_intent_fails_operations_without_hanging() {
    // The last rank, rank 0 (which decides barriers), and the middle one.
    for (seed, victim) in [(1, 2), (2, 0), (3, 1)] {
        let out = launch_testnode(3, &["intent-crash", "--seed", &seed.to_string(), "--victim", &victim.to_string()], Duration::from_secs(120));
        for survivor in (0..3).filter(|&r| r != victim) {
            assert_ok(&out, &format!("[{survivor}] intent crash ok"));
        }
    }
}

#[test]
fn a_crashed_process_fails_operations_without_hanging() {
    let out = launch_testnode(3, &["crash"], Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[0] crash ok") && stdout.contains("[1] crash ok"), "survivors did not report");
}

#[test]
fn launch_reports_failures_and_prefixes_ranks() {
    let out = std::process::Command::new(binary("ferry"))
        .args(["launch", "-n", "3", "--", "sh", "-c", "echo hello from $FERRY_RANK of $FERRY_NODES; test $FERRY_RANK -ne 1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    for r in 0..3 {
        assert!(stdout.contains(&format!("[{r}] hello from {r} of 3")), "{stdout}");
    }
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 1 failed"));
    let ok = std::process::Command::new(binary("ferry")).args(["launch", "-n", "2", "--", "true"]).output().unwrap();
    assert!(ok.status.success());
}

#[test]
fn the_readme_example_runs_on_two_processes() {
    let example = ferry_tests::bin_dir().join("examples").join("readme");
    assert!(example.exists(), "{} is missing (cargo test --workspace builds examples)", example.display());
    let out = std::process::Command::new(binary("ferry")).args(["launch", "-n", "2", "--timeout", "60", "--"]).arg(&example).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Two jobs started on one coordinator port with different secrets: rank 0 of job A and rank 1
/// of job B. They never merge: B's node is refused, naming the secret, and A's coordinator gives
/// up naming the rank that never joined. With the same secret but another job id, the same.
#[test]
fn jobs_with_different_secrets_or_ids_never_merge() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let node = move |rank: usize, secret: &str, job: &str| {
        std::process::Command::new(binary("ferry-testnode"))
            .args(["sums", "--workers", "1", "--rounds", "5"])
            .env("FERRY_RANK", rank.to_string())
            .env("FERRY_NODES", "2")
            .env("FERRY_COORDINATOR", format!("127.0.0.1:{port}"))
            .env("FERRY_SECRET", secret)
            .env("FERRY_JOB_ID", job)
            .env("FERRY_START_TIMEOUT", "4s")
            .output()
            .unwrap()
    };
    for (secret_b, job_b) in [("secret-of-job-b-0123", "1"), ("secret-of-job-a-0123", "2")] {
        let a = std::thread::spawn(move || node(0, "secret-of-job-a-0123", "1"));
        std::thread::sleep(Duration::from_millis(200));
        let b = node(1, secret_b, job_b);
        let a = a.join().unwrap();
        let (ea, eb) = (String::from_utf8_lossy(&a.stderr), String::from_utf8_lossy(&b.stderr));
        assert!(!a.status.success() && !b.status.success(), "the two jobs merged");
        assert!(eb.contains("does not hold this job's cluster secret"), "job B's node: {eb}");
        assert!(ea.contains("ranks [1] never joined"), "job A's coordinator: {ea}");
    }
}

/// A member that keeps its connection (and heartbeats) but stops reading: its peer's worker is
/// held back once the send queue reaches its limit, the member is declared lost within the
/// liveness timeout naming why, and the peer's memory stays bounded.
#[test]
fn a_member_that_stops_reading_is_declared_lost_and_memory_stays_bounded() {
    let out = launch_testnode(2, &["stalled-reader", "--limit-mib", "16"], Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[0] stalled-reader ok") && stdout.contains("[1] stalled-reader ok"), "{stdout}");
    let grew: u64 =
        stdout.split("peak RSS grew ").nth(1).and_then(|rest| rest.split(' ').next()).and_then(|n| n.parse().ok()).expect("rank 0 reports its memory growth");
    // The queue may hold the limit plus one frame (16 + 1 MiB), far below the hard limit (64 MiB);
    // before this bound existed, the queue grew by about 250 MiB a second.
    assert!(grew < 96, "rank 0's resident memory grew {grew} MiB");
}

/// A stopped node (SIGSTOP; its process lives on but says nothing): both survivors name it in
/// their errors and barrier failures, never each other, and go on working with each other. The
/// survivor with a long liveness timeout learns of the loss from the other's PEER_LOST, seconds
/// before its own timeout would have told it.
#[test]
fn a_stopped_node_is_named_by_every_survivor() {
    let out = launch_testnode(3, &["stopped"], Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for rank in 0..3 {
        assert!(stdout.contains(&format!("[{rank}] stopped ok")), "rank {rank}: {stdout}");
    }
}
