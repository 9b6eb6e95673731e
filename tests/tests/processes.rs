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
    assert!(String::from_utf8_lossy(&out.stderr).contains("ferry launch: 1 of 3 ranks failed: rank 1 (exit status: 1)"));
    let ok = std::process::Command::new(binary("ferry")).args(["launch", "-n", "2", "--", "true"]).output().unwrap();
    assert!(ok.status.success());
}

/// `ferry launch --join RANK` starts that rank alone, told to join (`FERRY_JOIN=1`) the cluster
/// at `--coordinator`, and only with the cluster's secret.
#[test]
fn launch_join_starts_one_rank_that_joins() {
    let launch = |extra_env: &[(&str, &str)]| {
        std::process::Command::new(binary("ferry"))
            .args([
                "launch",
                "-n",
                "3",
                "--join",
                "1",
                "--coordinator",
                "127.0.0.1:9",
                "--",
                "sh",
                "-c",
                "echo rank $FERRY_RANK of $FERRY_NODES joins=$FERRY_JOIN",
            ])
            .env_remove("FERRY_SECRET")
            .env_remove("FERRY_SECRET_FILE")
            .envs(extra_env.iter().copied())
            .output()
            .unwrap()
    };
    let refused = launch(&[]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("needs the cluster's secret"), "{stderr}");
    let started = launch(&[("FERRY_SECRET", "0123456789abcdef0123456789abcdef0123456789abcdef")]);
    let stdout = String::from_utf8_lossy(&started.stdout);
    assert!(started.status.success(), "{stdout}");
    assert_eq!(stdout.trim(), "[1] rank 1 of 3 joins=1");
    let no_coordinator = std::process::Command::new(binary("ferry")).args(["launch", "-n", "3", "--join", "1", "--", "true"]).output().unwrap();
    assert!(!no_coordinator.status.success());
}

/// Whether process `pid` is gone (or a zombie nobody has reaped yet: it runs no more).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|state| state == "Z" || state == "X"),
    }
}

/// Waits until every process of `pids` is gone, for up to `within`; returns those still running.
fn wait_gone(pids: &[u32], within: Duration) -> Vec<u32> {
    let until = std::time::Instant::now() + within;
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|&p| !process_gone(p)).collect();
        if left.is_empty() || std::time::Instant::now() > until {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills what a failed test left running.
fn kill_all(pids: &[u32]) {
    for pid in pids {
        let _ = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status();
    }
}

/// Runs `ferry launch ARGS` with its standard output read line by line; returns the child and
/// a receiver of its lines.
fn launch_reading(args: &[&str]) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(binary("ferry"))
        .arg("launch")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// The process ids the ranks print (`[r] PID`), one per rank.
fn printed_pids(lines: &std::sync::mpsc::Receiver<String>, ranks: usize) -> Vec<u32> {
    (0..ranks)
        .map(|_| {
            let line = lines.recv_timeout(Duration::from_secs(30)).expect("a rank prints its process id");
            line.rsplit(' ').next().unwrap().parse().unwrap()
        })
        .collect()
}

/// Waits for `child` for up to `within`; kills it and fails if it takes longer.
fn wait_within(child: &mut std::process::Child, within: Duration, what: &str) -> std::process::ExitStatus {
    let until = std::time::Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!("{what}: ferry launch still runs after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Ranks whose shell leaves a background job behind holding the launcher's pipes: the launch
/// ends when the ranks do (the jobs are killed with their rank's process group) instead of
/// waiting for the jobs.
#[test]
fn what_a_rank_leaves_behind_is_killed_with_it() {
    let (mut launcher, lines) = launch_reading(&["-n", "2", "--grace", "2", "--", "sh", "-c", "sleep 300 & echo $!"]);
    let jobs = printed_pids(&lines, 2);
    let status = wait_within(&mut launcher, Duration::from_secs(20), "background jobs of the ranks");
    let left = wait_gone(&jobs, Duration::from_secs(5));
    kill_all(&left);
    assert!(status.success(), "{status}");
    assert!(left.is_empty(), "the ranks' background jobs {left:?} outlived the launch");
}

/// SIGTERM to `ferry launch` is passed on to every rank: a rank that takes it ends, one that
/// ignores it is killed after the grace period, and the launcher exits with 128 + 15 instead of
/// leaving its ranks behind.
#[test]
fn a_terminated_launcher_takes_its_ranks_with_it() {
    let script = "if [ $FERRY_RANK = 0 ]; then trap '' TERM; fi; echo $$; exec sleep 300";
    let (mut launcher, lines) = launch_reading(&["-n", "2", "--grace", "2", "--", "sh", "-c", script]);
    let ranks = printed_pids(&lines, 2);
    let status = std::process::Command::new("kill").args(["-TERM", &launcher.id().to_string()]).status().unwrap();
    assert!(status.success());
    let status = wait_within(&mut launcher, Duration::from_secs(20), "after SIGTERM");
    let left = wait_gone(&ranks, Duration::from_secs(5));
    kill_all(&left);
    assert!(left.is_empty(), "ranks {left:?} outlived their terminated launcher");
    assert_eq!(status.code(), Some(128 + 15), "{status}");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("stopped by signal 15"), "{stderr}");
}

#[test]
fn the_readme_example_runs_on_two_processes() {
    let example = ferry_tests::bin_dir().join("examples").join("readme");
    assert!(example.exists(), "{} is missing (cargo test --workspace builds examples)", example.display());
    let out = std::process::Command::new(binary("ferry")).args(["launch", "-n", "2", "--timeout", "60", "--"]).arg(&example).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The README's "More to run" commands run programs that `scripts/install` puts on the PATH
/// (or scripts of this checkout, or `mpirun`), and each `ferry`/`ferry-bench` subcommand named
/// there exists.
#[test]
fn the_readmes_commands_are_installed_and_their_subcommands_exist() {
    let root = ferry_tests::bin_dir().join("../..").canonicalize().unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let block = readme.split_once("More to run").expect("the README has 'More to run'").1;
    let block = block.split("```sh\n").nth(1).and_then(|b| b.split("```").next()).expect("a sh block");
    let install = std::fs::read_to_string(root.join("scripts/install")).unwrap();
    assert!(
        install.contains("cargo install --locked --path \"$crate\"") && install.contains("for crate in tools bench"),
        "scripts/install installs ferry and ferry-bench"
    );
    let mut checked = 0;
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let program = if words[0] == "mpirun" { words.iter().position(|w| *w == "ferry").map(|i| &words[i..]) } else { Some(&words[..]) };
        let Some(words) = program else { panic!("mpirun runs something other than ferry: {line}") };
        match words[0] {
            "ferry" | "ferry-bench" => {
                let sub: Vec<&str> = words[1..].iter().take_while(|w| !w.starts_with('-') && !w.contains('/')).take(2).copied().collect();
                let out = std::process::Command::new(binary(words[0])).args(&sub).arg("--help").output().unwrap();
                assert!(out.status.success(), "{line}: `{} {} --help` fails: {}", words[0], sub.join(" "), String::from_utf8_lossy(&out.stderr));
                checked += 1;
            }
            script if script.starts_with("scripts/") => assert!(root.join(script).exists(), "{line}: {script} is missing"),
            other => panic!("{line}: `{other}` is neither installed by scripts/install nor a script of this checkout"),
        }
    }
    assert!(checked >= 20, "only {checked} commands checked");
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
    for (secret_b, job_b) in [("secret-of-job-b-0123456789abcdef-0123", "1"), ("secret-of-job-a-0123456789abcdef-0123", "2")] {
        let a = std::thread::spawn(move || node(0, "secret-of-job-a-0123456789abcdef-0123", "1"));
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

/// A hand-started cluster (ranks given by `FERRY_RANK`, not by `ferry launch`) without a
/// secret does not start unless asked to, and then says what that means; a secret file that
/// others may read is refused, as ssh refuses such a key; `ferry secret --out` writes one only
/// its owner reads, which the nodes take.
#[test]
fn a_hand_started_cluster_needs_a_secret_or_an_explicit_choice_to_run_without() {
    let dir = std::env::temp_dir().join(format!("ferry-secrets-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cluster = |env: &[(&str, &str)]| {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let node = |rank: usize| {
            let mut c = std::process::Command::new(binary("ferry-testnode"));
            c.args(["sums", "--workers", "1", "--rounds", "5"])
                .env("FERRY_RANK", rank.to_string())
                .env("FERRY_NODES", "2")
                .env("FERRY_COORDINATOR", format!("127.0.0.1:{port}"))
                .env("FERRY_START_TIMEOUT", "20s")
                .env_remove("FERRY_SECRET")
                .env_remove("FERRY_SECRET_FILE")
                .envs(env.iter().copied());
            c
        };
        let one = node(1).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
        let zero = node(0).output().unwrap();
        (zero, one.wait_with_output().unwrap())
    };
    let (zero, one) = cluster(&[]);
    for out in [&zero, &one] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("no cluster secret is set") && stderr.contains("FERRY_NO_SECRET=1"), "{stderr}");
    }
    let file = dir.join("secret");
    let out = std::process::Command::new(binary("ferry")).args(["secret", "--out"]).arg(&file).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
    let again = std::process::Command::new(binary("ferry")).args(["secret", "--out"]).arg(&file).output().unwrap();
    assert!(!again.status.success(), "an existing file is left alone");
    let printed = std::process::Command::new(binary("ferry")).arg("secret").output().unwrap();
    let printed = String::from_utf8_lossy(&printed.stdout);
    assert!(printed.trim().len() == 64 && printed.trim().chars().all(|c| c.is_ascii_hexdigit()), "{printed}");
    let path = file.to_str().unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (zero, _) = cluster(&[("FERRY_SECRET_FILE", path)]);
    let stderr = String::from_utf8_lossy(&zero.stderr);
    assert!(!zero.status.success() && stderr.contains("chmod 600"), "a secret file others may read: {stderr}");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (zero, one) = cluster(&[("FERRY_SECRET_FILE", path)]);
    assert!(zero.status.success() && one.status.success(), "{}", String::from_utf8_lossy(&zero.stderr));
    let (zero, one) = cluster(&[("FERRY_NO_SECRET", "1")]);
    assert!(zero.status.success() && one.status.success(), "{}", String::from_utf8_lossy(&zero.stderr));
    assert!(String::from_utf8_lossy(&zero.stderr).contains("any local user can join this cluster"), "said at the default log level");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Strangers on a real node's ports, opened before the member that needs each port: more slow
/// ones than the node runs handshakes (each trickling a byte at a time, as if to keep a
/// per-read deadline alive) and a few that announce a 64 MiB greeting and start sending it.
/// Returns the writers' threads; they end when the node drops their connections.
fn flood_with_strangers(addr: std::net::SocketAddr) -> Vec<std::thread::JoinHandle<()>> {
    use std::io::Write;
    let connect = || loop {
        if let Ok(s) = std::net::TcpStream::connect(addr) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // A greeting's length (a greeting and a nonce), then its bytes one by one.
    let slow: Vec<std::net::TcpStream> = (0..ferry_tcp::MAX_HANDSHAKES + 16)
        .map(|_| {
            let mut s = connect();
            let _ = s.write_all(&36u32.to_le_bytes());
            s
        })
        .collect();
    let mut writers = vec![std::thread::spawn(move || {
        let mut slow = slow;
        for _ in 0..40 {
            slow.retain_mut(|s| s.write_all(&[0]).is_ok());
            if slow.is_empty() {
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    })];
    for _ in 0..16 {
        let mut large = connect();
        writers.push(std::thread::spawn(move || {
            let _ = large.set_write_timeout(Some(Duration::from_secs(20)));
            let _ = large.write_all(&(64u32 << 20).to_le_bytes());
            let chunk = vec![0x5au8; 1 << 20];
            for _ in 0..8 {
                if large.write_all(&chunk).is_err() {
                    return;
                }
            }
        }));
    }
    writers
}

/// The peak resident memory of a process, in bytes.
fn peak_memory(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM in /proc/PID/status");
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// A real rank 0 (coordinator and mesh acceptor) with strangers on both its ports, and this
/// test as its rank 1, speaking the set-up protocol through the transport library: with more
/// slow strangers than handshake slots and strangers announcing 64 MiB greetings on the
/// coordinator's port, then the same on rank 0's mesh port, each step completes within its
/// normal time plus at most the handshake deadline, and rank 0's memory stays bounded.
#[test]
fn strangers_on_a_real_nodes_ports_neither_stall_set_up_nor_inflate_it() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let coordinator = format!("127.0.0.1:{port}");
    let secret = "stranger-test-secret-0123456789abcdef";
    let mut rank0 = std::process::Command::new(binary("ferry-testnode"))
        .args(["sums", "--workers", "1", "--rounds", "5"])
        .env("FERRY_RANK", "0")
        .env("FERRY_NODES", "2")
        .env("FERRY_COORDINATOR", &coordinator)
        .env("FERRY_SECRET", secret)
        .env("FERRY_JOB_ID", "strangers")
        .env("FERRY_START_TIMEOUT", "60s")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let membership = ferry_tcp::Membership { secret: Some(secret.as_bytes().to_vec()), job: "strangers".into() };
    let bound = ferry_tcp::HANDSHAKE + Duration::from_secs(3);
    let outcome = std::panic::catch_unwind(|| {
        let mut writers = flood_with_strangers(coordinator.parse().unwrap());
        let started = std::time::Instant::now();
        let mut rendezvous = ferry_tcp::Rendezvous::join(1, 2, &coordinator, Duration::from_secs(60), &membership).expect("rank 1 joins");
        let joined = started.elapsed();
        assert!(joined < bound, "strangers on the coordinator's port delayed the rendezvous by {joined:?}");
        let listener = ferry_tcp::bind_listener(rendezvous.local_ip()).unwrap();
        let mine = listener.local_addr().unwrap().to_string();
        let addresses: Vec<std::net::SocketAddr> =
            rendezvous.all_gather(mine.as_bytes(), Duration::from_secs(30)).unwrap().iter().map(|b| std::str::from_utf8(b).unwrap().parse().unwrap()).collect();
        writers.extend(flood_with_strangers(addresses[0]));
        let config = ferry_tcp::MeshConfig { membership: membership.clone(), connect_timeout: Duration::from_secs(60), ..Default::default() };
        let started = std::time::Instant::now();
        let mesh = ferry_tcp::connect_mesh(1, &addresses, listener, config).expect("rank 1 connects to rank 0's mesh port");
        let connected = started.elapsed();
        assert!(connected < bound, "strangers on rank 0's mesh port delayed its connection by {connected:?}");
        for writer in writers {
            writer.join().unwrap();
        }
        let peak = peak_memory(rank0.id());
        eprintln!("rendezvous {joined:?}, mesh {connected:?}, rank 0 peak {} MiB", peak >> 20);
        assert!(peak < 96 << 20, "rank 0 peaked at {} MiB with strangers on its ports", peak >> 20);
        drop(mesh);
    });
    let _ = rank0.kill();
    let _ = rank0.wait();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}
