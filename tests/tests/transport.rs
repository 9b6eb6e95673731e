//! Transport selection and the fabrics' data paths, on whatever this host offers.
//!
//! On a host without verbs (these machines, CI) `auto` must pick TCP and everything must still
//! work; inside the soft-RoCE VM (`tests/rxe/`), where `FERRY_VERBS_DEVICE=rxe0,rxe1` gives each
//! rank its own device and `FERRY_EXPECT_TRANSPORT=verbs` is set, the same tests run the engine
//! over verbs. Without the variable the expectation follows the host: verbs if it has an active
//! port, TCP otherwise.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferry::{Config, Node, TableSpec, TransportChoice};
use ferry_tests::{binary, finalize_all, launch_testnode};

fn expected_transport() -> &'static str {
    match std::env::var("FERRY_EXPECT_TRANSPORT").as_deref() {
        Ok("verbs") => "verbs",
        Ok("tcp") => "tcp",
        Ok(other) => panic!("FERRY_EXPECT_TRANSPORT='{other}' is neither verbs nor tcp"),
        Err(_) => {
            if ferry::local_verbs(&Config::new(vec![TableSpec::new("x", 1, 1)])).is_ok() {
                "verbs"
            } else {
                "tcp"
            }
        }
    }
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn auto_picks_the_expected_transport_and_sums_are_exact() {
    let want = expected_transport();
    let out = launch_testnode(2, &["sums", "--workers", "3", "--rounds", "200", "--relocate", "--asynchronous", "--keys", "40"], Duration::from_secs(300));
    let text = stdout(&out);
    assert!(out.status.success(), "cluster failed");
    for r in 0..2 {
        assert!(text.contains(&format!("[{r}] transport {want}")), "rank {r} did not use {want}");
    }
    assert!(text.contains("[0] sums ok"));
}

/// Server-side AdaGrad with keys moving between the processes (the optimizer state travels in
/// the slot: one one-sided write over verbs), push-pull and bounded-delay clocks.
#[test]
fn updaters_push_pull_and_clocks_over_the_chosen_transport() {
    let want = expected_transport();
    let out = launch_testnode(2, &["toolbox"], Duration::from_secs(300));
    let text = stdout(&out);
    assert!(out.status.success(), "cluster failed");
    for r in 0..2 {
        assert!(text.contains(&format!("[{r}] transport {want}")), "rank {r} did not use {want}");
        assert!(text.contains(&format!("[{r}] toolbox ok")), "rank {r} did not finish");
    }
}

/// Intent signalling: keys follow declared windows between the processes (INTENT and
/// INTENT_GO messages, relocations by the intent service), keys both need are replicated on
/// both and refreshed with one-sided reads (RDMA READs over verbs), nothing lost.
#[test]
fn intents_move_keys_over_the_chosen_transport() {
    let want = expected_transport();
    let out = launch_testnode(2, &["intent"], Duration::from_secs(300));
    let text = stdout(&out);
    assert!(out.status.success(), "cluster failed:\n{text}");
    for r in 0..2 {
        assert!(text.contains(&format!("[{r}] transport {want}")), "rank {r} did not use {want}");
        assert!(text.contains(&format!("[{r}] intent ok")), "rank {r} did not finish");
        // Each rank kept replicas of keys the other held (made now or earlier) and refreshed
        // them from its images.
        let line = text.lines().find(|l| l.starts_with(&format!("[{r}] shared keys: "))).expect("each rank reports its shared keys");
        let numbers: Vec<u64> = line.split(' ').filter_map(|w| w.parse().ok()).collect();
        assert!(numbers.len() == 4 && numbers[1] > 0 && numbers[2] > 0, "{line}");
    }
}

/// Random intents between the processes, with explicit localizes mixed in: keys move, run-time
/// replicas are made, synced (one-sided reads over verbs) and dropped, and every pull still
/// includes its own node's earlier pushes, each push at most once and none from its future;
/// after a barrier every node reads every push.
#[test]
fn intent_histories_over_the_chosen_transport_keep_each_nodes_pushes() {
    let want = expected_transport();
    let dir = std::env::temp_dir().join(format!("ferry-transport-intent-history-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = launch_testnode(2, &["intent-history", "--clocks", "150", "--dir", dir.to_str().unwrap()], Duration::from_secs(300));
    let _ = std::fs::remove_dir_all(&dir);
    let text = stdout(&out);
    assert!(out.status.success(), "cluster failed:\n{text}");
    assert!(text.contains(&format!("[0] transport {want}")) && text.contains(&format!("[1] transport {want}")));
    assert!(text.contains("[0] intent history ok"));
}

#[test]
fn history_over_the_chosen_transport_is_sequentially_consistent() {
    let want = expected_transport();
    let dir = std::env::temp_dir().join(format!("ferry-transport-history-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = launch_testnode(2, &["history", "--workers", "2", "--ops", "150", "--dir", dir.to_str().unwrap()], Duration::from_secs(300));
    let _ = std::fs::remove_dir_all(&dir);
    let text = stdout(&out);
    assert!(out.status.success(), "cluster failed");
    assert!(text.contains(&format!("[0] transport {want}")) && text.contains(&format!("[1] transport {want}")));
    assert!(text.contains("[0] history ok"));
}

/// Replicated keys over the chosen transport: the bounded-staleness guarantee on a real
/// two-process history, exact sums, and refreshes made of one-sided reads (RDMA READs over
/// verbs).
#[test]
fn replicas_refresh_with_one_sided_reads_within_the_bound() {
    let want = expected_transport();
    let dir = std::env::temp_dir().join(format!("ferry-transport-replicas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = launch_testnode(2, &["replicas", "--dir", dir.to_str().unwrap()], Duration::from_secs(300));
    let _ = std::fs::remove_dir_all(&dir);
    let text = stdout(&out);
    assert!(out.status.success(), "cluster failed");
    for r in 0..2 {
        let line = text.lines().find(|l| l.starts_with(&format!("[{r}] refresh reads "))).expect("each rank reports its refresh reads");
        let reads: u64 = line.split(' ').nth(3).unwrap().parse().unwrap();
        assert!(reads > 0 && line.ends_with(&format!("over {want}")), "{line}");
    }
    assert!(text.contains("[0] replicas ok"));
}

/// Rank 0's sends to rank 1 fail after 200 sends (a failing `sendmsg` over TCP, a failing post
/// over verbs, reported by the fabric's own threads, never from the send path): rank 0's
/// operations end in `PeerLost`, rank 1 sees rank 0 lost, nobody hangs.
#[test]
fn failing_sends_end_in_errors_not_hangs() {
    let want = expected_transport();
    let started = std::time::Instant::now();
    let out = launch_testnode(2, &["send-failure", "--after", "200"], Duration::from_secs(120));
    let text = stdout(&out);
    assert!(text.contains(&format!("[0] transport {want}")), "rank 0 did not use {want}: {text}");
    assert!(text.contains("[0] send-failure ok") && text.contains("[1] send-failure ok"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("injected fault"), "rank 0's error is not the injected send failure: {text}");
    assert!(started.elapsed() < Duration::from_secs(60), "took {:?}", started.elapsed());
}

/// Rank 1 localizes every key of rank 0 and dies while their values are still being written to
/// it: rank 0 sees it lost, and frees the slot of every key that left.
#[test]
fn a_peer_dying_with_writes_queued_leaves_no_slot_behind() {
    let want = expected_transport();
    let out = launch_testnode(2, &["writes-queued", "--keys", "20000"], Duration::from_secs(180));
    let text = stdout(&out);
    assert!(text.contains(&format!("[0] transport {want}")), "rank 0 did not use {want}: {text}");
    assert!(text.contains("[0] writes-queued ok"), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn demanding_verbs_works_exactly_when_verbs_exist() {
    let out = Command::new(binary("ferry"))
        .args(["launch", "-n", "2", "--timeout", "120", "--"])
        .arg(binary("ferry-testnode"))
        .args(["sums", "--workers", "1", "--rounds", "50"])
        .env("FERRY_TRANSPORT", "verbs")
        .output()
        .unwrap();
    let (text, err) = (stdout(&out), String::from_utf8_lossy(&out.stderr).into_owned());
    if expected_transport() == "verbs" {
        assert!(out.status.success() && text.contains("[0] transport verbs"), "{text}\n{err}");
    } else {
        assert!(!out.status.success(), "transport = verbs must fail without verbs");
        assert!(err.contains("transport = verbs, but node") && err.contains("cannot use verbs"), "the error must say which node lacks verbs and why: {err}");
    }
}

/// Paths of the libibverbs files the dynamic loader would find.
fn libibverbs_files() -> Vec<String> {
    let listing = Command::new("sh").args(["-c", "ldconfig -p 2>/dev/null | grep -o '/[^ ]*libibverbs\\.so[^ ]*'"]).output().unwrap();
    let mut files: Vec<String> =
        String::from_utf8_lossy(&listing.stdout).lines().filter_map(|p| std::fs::canonicalize(p).ok()).map(|p| p.display().to_string()).collect();
    files.sort();
    files.dedup();
    files
}

#[test]
fn a_host_without_libibverbs_starts_and_falls_back_to_tcp() {
    // A private mount namespace in which every libibverbs file is covered by /dev/null: the
    // run-time loader cannot load it, exactly as on a host where it is not installed.
    let hide: String = libibverbs_files().iter().map(|f| format!("mount --bind /dev/null {f} && ")).collect();
    let script = format!(
        "{hide} {info} info && FERRY_TRANSPORT=auto {ferry} launch -n 2 --timeout 120 -- {node} sums --workers 2 --rounds 100 --relocate",
        info = binary("ferry").display(),
        ferry = binary("ferry").display(),
        node = binary("ferry-testnode").display()
    );
    // As root a mount namespace is enough; otherwise map this user to root in a user namespace.
    let root = is_root();
    let mut cmd = Command::new("unshare");
    if root {
        cmd.args(["--mount", "--propagation", "private"]);
    } else {
        cmd.args(["--mount", "--map-root-user", "--propagation", "private"]);
    }
    let out = cmd.args(["sh", "-c", &script]).output().expect("running unshare (util-linux)");
    let (text, err) = (stdout(&out), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "the fallback run failed (mount namespaces are needed: run as root or allow user namespaces)\n{text}\n{err}");
    assert!(text.contains("libibverbs.so.1 could not be loaded"), "ferry info must report the missing library:\n{text}");
    assert!(text.contains("[0] transport tcp") && text.contains("[1] transport tcp"), "{text}");
    assert!(text.contains("[0] sums ok"));
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

#[test]
fn one_sided_reads_are_validated_by_slot_versions() {
    // Node 1 keeps adding 1.0 to every element of a key it holds while node 0 reads the slot
    // one-sidedly: every accepted copy must have all elements equal (no torn value), and the
    // values must never go backwards. The writer pauses between bursts, as a trainer's pushes
    // do; a writer that never pauses starves lock-free readers (they then report `Contended`).
    let mut template = Config::new(vec![TableSpec::new("r", 8, 256)]);
    template.apply_transport_env(|k| std::env::var(k).ok()).unwrap();
    if template.transport == TransportChoice::Tcp && expected_transport() == "verbs" {
        template.transport = TransportChoice::Auto;
    }
    let nodes = Node::start_local_cluster(2, template).unwrap();
    assert_eq!(nodes[0].transport(), expected_transport());
    let table = nodes[0].table("r").unwrap();
    let key = 7; // range partitioning: keys 4..8 live on node 1
    assert!(nodes[0].slot_address(table, key).unwrap().is_none());
    let at = nodes[1].slot_address(table, key).unwrap().expect("node 1 holds key 7");
    let stop = Arc::new(AtomicBool::new(false));
    // Stops the writer even when an assertion below fails, so the failure is reported.
    struct StopOnDrop(Arc<AtomicBool>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let writes = std::thread::scope(|s| {
        let _stop_writer = StopOnDrop(stop.clone());
        let writer = {
            let stop = stop.clone();
            let mut w = nodes[1].worker();
            s.spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..50 {
                        w.push(table, &[key], &[1.0; 256]).unwrap();
                        n += 1;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                n
            })
        };
        let mut out = vec![0.0f32; 256];
        let mut last = 0.0f32;
        let mut discarded = 0;
        for _ in 0..300 {
            discarded += nodes[0].read_slot(&at, &mut out).unwrap();
            assert!(out.iter().all(|&v| v == out[0]), "a torn copy was accepted: {:?}", &out[..4]);
            assert!(out[0] >= last, "the value went backwards: {} after {last}", out[0]);
            last = out[0];
        }
        stop.store(true, Ordering::Relaxed);
        let n = writer.join().unwrap();
        eprintln!("{n} writes, {discarded} copies discarded, last value read {last}");
        assert!(last > 0.0, "the reads saw none of the writes");
        n
    });
    let mut out = vec![0.0f32; 256];
    nodes[0].read_slot(&at, &mut out).unwrap();
    assert_eq!(out[0], writes as f32, "a read after the writer stopped sees every write");
    let mut wrong = vec![0.0f32; 3];
    assert!(nodes[0].read_slot(&at, &mut wrong).is_err());
    finalize_all(nodes);
}
