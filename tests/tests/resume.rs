//! Training runs killed with SIGKILL after a checkpoint, resumed with `--resume`: the same
//! model bit for bit where training is deterministic (`single` with one thread: every epoch's
//! order and draws depend on the seed and the epoch alone), the same quality on another node
//! count; and a node killed in a run that trains on without it (`--on-loss continue`).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry_tests::binary;
use serde_json::Value;

fn scratch(what: &str) -> PathBuf {
    ferry_tests::scratch_dir(&format!("resume-{what}"))
}

/// `ferry train ARGS --json`: its epoch reports.
fn train(args: &[&str]) -> Vec<Value> {
    let out = Command::new(binary("ferry")).arg("train").args(args).arg("--json").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ferry train {args:?}:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Starts `ferry train ARGS` in a process group of its own (a cluster's nodes with it), waits
/// until node `node`'s manifest of a checkpoint of an epoch in `epochs` is in `checkpoints`, and
/// kills the group with SIGKILL. Any epoch of the range will do: only the last two checkpoints
/// are kept, so on a loaded machine the first one's can come and go between two looks.
fn kill_after(args: &[&str], checkpoints: &Path, epochs: std::ops::Range<u64>, node: usize) {
    let mut child = Command::new(binary("ferry")).arg("train").args(args).stdout(Stdio::null()).stderr(Stdio::null()).process_group(0).spawn().unwrap();
    wait_for_checkpoint(&mut child, checkpoints, epochs, node);
    let status = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status().unwrap();
    assert!(status.success());
    let ended = child.wait().unwrap();
    assert!(!ended.success(), "the run was killed");
}

/// Waits until node `node`'s manifest of a checkpoint of an epoch in `epochs` is in
/// `checkpoints`, while `child` (the run writing them) goes on.
fn wait_for_checkpoint(child: &mut std::process::Child, checkpoints: &Path, epochs: std::ops::Range<u64>, node: usize) {
    let started = Instant::now();
    let written = || {
        std::fs::read_dir(checkpoints).into_iter().flatten().flatten().any(|e| {
            let name = e.file_name().into_string().unwrap_or_default();
            name.strip_prefix("epoch-").and_then(|n| n.parse::<u64>().ok()).is_some_and(|n| epochs.contains(&n))
                && e.path().join(format!("node-{node}.manifest")).exists()
        })
    };
    let whole = checkpoints.join(format!("epoch-{}/node-{node}.manifest", epochs.start));
    while !written() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before {} (or a later checkpoint) was written", whole.display());
        assert!(started.elapsed() < Duration::from_secs(300), "{} was not written", whole.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_run_killed_after_a_checkpoint_resumes_to_the_same_model_bit_for_bit() {
    let dir = scratch("single");
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let run = ["mf", "--data", "synth-tiny", "--rank", "4", "--mode", "single", "--single-threads", "1", "--epochs", "12"];
    let with = |extra: &[&str]| run.iter().copied().chain(extra.iter().copied()).map(str::to_string).collect::<Vec<String>>();
    let uninterrupted = with(&["--save", &path("whole")]);
    train(&uninterrupted.iter().map(String::as_str).collect::<Vec<_>>());
    let killed = with(&["--checkpoint-every", "1", "--checkpoint-dir", &path("checkpoints")]);
    kill_after(&killed.iter().map(String::as_str).collect::<Vec<_>>(), &dir.join("checkpoints"), 3..12, 0);
    let resumed = with(&["--checkpoint-every", "1", "--checkpoint-dir", &path("checkpoints"), "--resume", &path("checkpoints"), "--save", &path("resumed")]);
    let reports = train(&resumed.iter().map(String::as_str).collect::<Vec<_>>());
    let first = reports[0]["epoch"].as_u64().unwrap();
    assert!((4..=12).contains(&first), "resumed at epoch {first}");
    for table in ["users.npy", "items.npy"] {
        assert!(std::fs::read(dir.join("whole").join(table)).unwrap() == std::fs::read(dir.join("resumed").join(table)).unwrap(), "{table} differs");
    }
    // Two checkpoints are kept.
    let mut left: Vec<String> = std::fs::read_dir(dir.join("checkpoints")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, ["epoch-11", "epoch-12"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_cluster_killed_after_a_checkpoint_resumes_on_another_node_count() {
    resume_on_another_node_count("localize");
}

/// Intent signalling moves keys by itself: a checkpoint holds its relocations on every node
/// (`Node::hold_relocations`) before the cut, so that every key is in exactly one node's file.
#[test]
fn an_intent_cluster_killed_after_a_checkpoint_resumes_on_another_node_count() {
    resume_on_another_node_count("intent");
}

/// MF in `mode` on 2 nodes, killed after its checkpoint after epoch 4, resumed on 3 nodes: the
/// quality of an uninterrupted run, and its last checkpoint reads as the model it saved.
fn resume_on_another_node_count(mode: &str) {
    let dir = scratch(&format!("cluster-{mode}"));
    let checkpoints = dir.join("checkpoints");
    let checkpoints = checkpoints.to_str().unwrap();
    let run = ["mf", "--data", "synth-tiny", "--rank", "4", "--mode", mode, "--epochs", "8", "--checkpoint-every", "2", "--checkpoint-dir", checkpoints];
    let uninterrupted = train(&run[..run.len() - 4].iter().copied().chain(["--nodes", "2"]).collect::<Vec<_>>());
    kill_after(&run.iter().copied().chain(["--nodes", "2"]).collect::<Vec<_>>(), &dir.join("checkpoints"), 4..8, 1);
    let saved = dir.join("saved");
    let saved = saved.to_str().unwrap();
    let resumed = train(&run.iter().copied().chain(["--nodes", "3", "--resume", checkpoints, "--save", saved]).collect::<Vec<_>>());
    let first = resumed[0]["epoch"].as_u64().unwrap();
    assert!((3..=8).contains(&first), "resumed at epoch {first}");
    let rmse = |reports: &[Value]| reports.last().unwrap()["quality"]["rmse"].as_f64().unwrap();
    let (whole, again) = (rmse(&uninterrupted), rmse(&resumed));
    assert!((again - whole).abs() < 0.03 * whole, "{mode}: RMSE {again} after resuming on 3 nodes, {whole} uninterrupted");
    // Resumed training on from its checkpoint rather than from the start: fewer epochs reported.
    assert!(resumed.len() < uninterrupted.len());
    read_as_a_model(&dir, &dir.join("checkpoints/epoch-8"), &dir.join("saved"));
    // The cluster's checkpoint resumes in `single` too, for more epochs than the run had (the
    // per-epoch figures' table, sized by them, is a scratch table: not in checkpoints).
    let more = train(&["mf", "--data", "synth-tiny", "--rank", "4", "--mode", "single", "--epochs", "10", "--resume", checkpoints]);
    assert_eq!(more[0]["epoch"], 9, "{:?}", more[0]);
    let last = rmse(&more);
    assert!(last < 1.03 * again, "{mode}: RMSE {last} after two more epochs in single, {again} before");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The checkpoint of a 3-node MF run after its last epoch (`checkpoint`) reads as the model the
/// same run saved then (`saved`): the same predictions, the same `.npy` files once exported; a
/// damaged file of it is refused by name.
fn read_as_a_model(dir: &Path, checkpoint: &Path, saved: &Path) {
    std::fs::write(dir.join("pairs.tsv"), "0 1\n5 7\n3 2\n").unwrap();
    let predict =
        |model: &Path| Command::new(binary("ferry")).args(["train", "mf", "--predict"]).arg(dir.join("pairs.tsv")).arg("--model").arg(model).output().unwrap();
    let (from_checkpoint, from_save) = (predict(checkpoint), predict(saved));
    assert!(from_checkpoint.status.success(), "{}", String::from_utf8_lossy(&from_checkpoint.stderr));
    assert_eq!(String::from_utf8_lossy(&from_checkpoint.stdout).lines().count(), 3);
    assert_eq!(from_checkpoint.stdout, from_save.stdout);
    let exported = dir.join("exported");
    let out = Command::new(binary("ferry")).arg("export").arg(checkpoint).args(["--format", "npy", "--out"]).arg(&exported).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for table in ["users.npy", "items.npy", "users.tsv"] {
        assert!(std::fs::read(exported.join(table)).unwrap() == std::fs::read(saved.join(table)).unwrap(), "{table} differs");
    }
    // One flipped byte in a node's values, then in the ids: refused, naming the file.
    for file in ["node-2.values", "items.tsv"] {
        let path = checkpoint.join(file);
        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x20;
        std::fs::write(&path, &bytes).unwrap();
        let refused = predict(checkpoint);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && stderr.contains(file) && stderr.contains("checksum"), "{file}: {stderr}");
        bytes[middle] ^= 0x20;
        std::fs::write(&path, &bytes).unwrap();
    }
}

/// The pid of rank `rank` among the processes `parent` started (each rank's environment names
/// it), once it runs.
fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
        // The parent's pid is the second field after the parenthesised command name.
        let ppid: u32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
        let environ = std::fs::read(entry.path().join("environ")).ok()?;
        let named = environ.split(|&b| b == 0).any(|v| v == format!("FERRY_RANK={rank}").as_bytes());
        (ppid == parent && named).then_some(pid)
    })
}

/// `--on-loss resume`: one node of three killed with SIGKILL mid-training; the driver starts the
/// cluster again on the two others from the newest checkpoint, says so, and the run ends with
/// every epoch trained and the quality of an uninterrupted run. Without it the run fails, naming
/// the lost node.
#[test]
fn a_lost_node_is_survived_by_resuming_on_the_others() {
    let dir = scratch("on-loss");
    let checkpoints = dir.join("checkpoints");
    let ck = checkpoints.to_str().unwrap();
    let run = ["mf", "--data", "synth-tiny", "--rank", "4", "--mode", "classic", "--nodes", "3", "--epochs", "16"];
    let uninterrupted = train(&run);
    let killed_run = |extra: &[&str]| {
        let mut child = Command::new(binary("ferry"))
            .arg("train")
            .args(run)
            .args(["--checkpoint-every", "1", "--checkpoint-dir", ck, "--json"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for_checkpoint(&mut child, &checkpoints, 2..8, 1);
        let pid = rank_pid(child.id(), 1).expect("rank 1 runs");
        assert!(Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap().success());
        child.wait_with_output().unwrap()
    };
    let out = killed_run(&["--on-loss", "resume"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("1 of 3 nodes lost") && stderr.contains("resuming from the checkpoint after epoch"), "{stderr}");
    let reports: Vec<Value> = stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    let nodes = |r: &Value| r["nodes"].as_u64().unwrap();
    let resumed_at = reports.iter().find(|r| nodes(r) == 2).expect("epochs trained on the 2 survivors")["epoch"].as_u64().unwrap();
    assert!((3..=8).contains(&resumed_at), "resumed at epoch {resumed_at}");
    assert!(reports.iter().take_while(|r| nodes(r) == 3).count() >= 2, "{reports:?}");
    let last = reports.last().unwrap();
    assert_eq!((last["epoch"].as_u64(), nodes(last)), (Some(16), 2));
    // Every epoch after the resumed one once, in order, with training time counted on.
    let after: Vec<&Value> = reports.iter().skip_while(|r| nodes(r) == 3).collect();
    assert_eq!(after.iter().map(|r| r["epoch"].as_u64().unwrap()).collect::<Vec<_>>(), (resumed_at..=16).collect::<Vec<_>>());
    assert!(after[0]["elapsed_s"].as_f64().unwrap() > after[0]["epoch_s"].as_f64().unwrap(), "{:?}", after[0]);
    let rmse = |r: &Value| r["quality"]["rmse"].as_f64().unwrap();
    let (whole, again) = (rmse(uninterrupted.last().unwrap()), rmse(last));
    assert!((again - whole).abs() < 0.03 * whole, "RMSE {again} after losing a node, {whole} uninterrupted");
    // The default fails, naming the lost node.
    let _ = std::fs::remove_dir_all(&checkpoints);
    let out = killed_run(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("node 1 is lost") && !stderr.contains("resuming"), "{stderr}");
    // Resuming needs checkpoints to resume from.
    let out = Command::new(binary("ferry")).arg("train").args(run).args(["--on-loss", "resume"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--on-loss resume resumes from the newest checkpoint"), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--on-loss continue`: one node of three killed with SIGKILL mid-training; every key is backed
/// up on its owner's successor, so the two survivors train on without a restart — the lost
/// node's keys served from their backups, its share of the data dealt among them from the next
/// epoch — say so, report every epoch once, and end with the quality of an uninterrupted run.
/// Rank 0 too: it coordinates barriers and reports, and the next rank takes both over.
///
/// The same with `--mode localize`, whose trainer moves keys to the node about to use them:
/// the survivors' census after the loss finds every key (rank 1 killed).
#[test]
fn a_lost_node_is_survived_by_training_on() {
    for (mode, victims) in [("classic", &[1, 0][..]), ("localize", &[1][..])] {
        survived_by_training_on(mode, victims);
    }
    // Refused where it is not built: modes that replicate keys, and joins into a cluster that
    // moves keys.
    for (args, says) in [
        (&["mf", "--data", "synth-tiny", "--mode", "hybrid", "--on-loss", "continue"][..], "use --mode classic or localize"),
        (&["mf", "--data", "synth-tiny", "--mode", "localize", "--on-loss", "replace"][..], "cannot do yet"),
    ] {
        let out = Command::new(binary("ferry")).arg("train").args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{stderr}");
    }
}

/// [`a_lost_node_is_survived_by_training_on`] in `mode`, killing each of `victims` in a run.
fn survived_by_training_on(mode: &str, victims: &[usize]) {
    let run = ["mf", "--data", "synth-tiny", "--rank", "4", "--mode", mode, "--nodes", "3", "--epochs", "16"];
    let uninterrupted = train(&run);
    for &victim in victims {
        let (status, reports, stderr) = train_killing(&run, victim);
        assert!(status.success(), "rank {victim} killed: {stderr}");
        assert!(
            stderr.contains(&format!("1 of 3 nodes lost (rank {victim}); the others trained on")) && stderr.contains("training goes on on 2 nodes"),
            "{stderr}"
        );
        assert_eq!(
            reports.iter().map(|r| r["epoch"].as_u64().unwrap()).collect::<Vec<_>>(),
            (1..=16).collect::<Vec<_>>(),
            "every epoch once (rank {victim} killed)"
        );
        let last = reports.last().unwrap();
        assert_eq!(last["nodes"].as_u64(), Some(2), "{last}");
        let rmse = |r: &Value| r["quality"]["rmse"].as_f64().unwrap();
        let (whole, survived) = (rmse(uninterrupted.last().unwrap()), rmse(last));
        assert!((survived - whole).abs() < 0.03 * whole, "RMSE {survived} after losing rank {victim} ({mode}), {whole} uninterrupted");
    }
}

/// `ferry train ARGS --json --on-loss continue`, rank `victim` killed with SIGKILL once two
/// epochs are reported: the driver's status, the epoch reports and its standard error.
fn train_killing(args: &[&str], victim: usize) -> (std::process::ExitStatus, Vec<Value>, String) {
    train_killing_with(args, victim, "continue")
}

/// [`train_killing`] with `--on-loss ON_LOSS`.
fn train_killing_with(args: &[&str], victim: usize, on_loss: &str) -> (std::process::ExitStatus, Vec<Value>, String) {
    use std::io::BufRead;
    let mut child = Command::new(binary("ferry"))
        .arg("train")
        .args(args)
        .args(["--json", "--on-loss", on_loss])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    // A run that hangs (nodes waiting in barriers that never complete) fails the test in
    // minutes, not after the hours a barrier may wait for an evaluation.
    let (group, done) = (child.id(), std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)));
    let watch = done.clone();
    std::thread::spawn(move || {
        let started = Instant::now();
        while !watch.load(std::sync::atomic::Ordering::SeqCst) {
            if started.elapsed() > Duration::from_secs(600) {
                let _ = Command::new("kill").args(["-KILL", "--", &format!("-{group}")]).status();
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let stderr = child.stderr.take().unwrap();
    let errors = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap());
    let mut reports: Vec<Value> = Vec::new();
    let mut killed = false;
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        if !line.starts_with('{') {
            continue;
        }
        reports.push(serde_json::from_str(&line).unwrap());
        if !killed && reports.len() == 2 {
            let pid = rank_pid(child.id(), victim).expect("the victim runs");
            assert!(Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap().success());
            killed = true;
        }
    }
    let status = child.wait().unwrap();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let stderr = errors.join().unwrap();
    assert!(killed, "rank {victim} was never killed: {stderr}");
    (status, reports, stderr)
}

/// `--on-loss replace`: rank 1 of 3 killed with SIGKILL mid-training; the survivors train on,
/// and the driver starts a fresh process in rank 1, which joins the running cluster, gets its
/// keys back from the node that served them and trains from the start of an epoch the others
/// begin (it passes their barriers until the schedule names one). Every epoch is reported once,
/// the last ones on 3 nodes again, and the model ends at the quality of an uninterrupted run.
/// A lost rank 0 is not replaced (it takes the joins); the others train on without it.
#[test]
fn a_lost_node_is_replaced_by_a_fresh_one_that_joins_the_run() {
    let run = ["mf", "--data", "synth-tiny", "--rank", "4", "--mode", "classic", "--nodes", "3", "--epochs", "16"];
    let uninterrupted = train(&run);
    let (status, reports, stderr) = train_killing_with(&run, 1, "replace");
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains("1 of 3 nodes lost (rank 1); the others trained on, a fresh node joined in rank 1")
            && stderr.contains("node 1 joined: training goes on on 3 nodes"),
        "{stderr}"
    );
    let epochs: Vec<u64> = reports.iter().map(|r| r["epoch"].as_u64().unwrap()).collect();
    assert_eq!(epochs, (1..=16).collect::<Vec<_>>(), "every epoch once");
    // (Whether an epoch ran on the survivors alone depends on how soon the fresh node joins.)
    let nodes: Vec<u64> = reports.iter().map(|r| r["nodes"].as_u64().unwrap()).collect();
    assert_eq!(nodes.last(), Some(&3), "the last epochs on 3 nodes again: {nodes:?}");
    let rmse = |r: &Value| r["quality"]["rmse"].as_f64().unwrap();
    let (whole, replaced) = (rmse(uninterrupted.last().unwrap()), rmse(reports.last().unwrap()));
    assert!((replaced - whole).abs() < 0.03 * whole, "RMSE {replaced} after rank 1 was replaced, {whole} uninterrupted");
    let (status, reports, stderr) = train_killing_with(&run, 0, "replace");
    assert!(status.success() && stderr.contains("1 of 3 nodes lost (rank 0); the others trained on and finished the run"), "{stderr}");
    assert_eq!(reports.iter().map(|r| r["epoch"].as_u64().unwrap()).collect::<Vec<_>>(), (1..=16).collect::<Vec<_>>(), "every epoch once");
    assert_eq!(reports.last().unwrap()["nodes"].as_u64(), Some(2), "rank 0 is not replaced");
}

/// `--on-loss continue` for the other tasks: logistic regression, the CountMin sketch, ComplEx
/// and word2vec (their negatives sampled through pulls, which the workers repeat) train on
/// after rank 1 of 3 is killed, every epoch reported once, LR's AUC near an uninterrupted run's.
#[test]
fn every_task_trains_on_after_a_lost_node() {
    let lr = ["lr", "--data", "synth-lr", "--mode", "classic", "--nodes", "3", "--epochs", "6"];
    let uninterrupted = train(&lr);
    let countmin = ["countmin", "--data", "synth-text", "--width", "512", "--depth", "3", "--mode", "classic", "--nodes", "3", "--epochs", "30"];
    let kge = ["kge", "--data", "synth-kg", "--dim", "16", "--epochs", "6", "--eval-every", "3", "--mode", "classic", "--nodes", "3"];
    let w2v = ["w2v", "--data", "synth-text", "--dim", "16", "--epochs", "4", "--mode", "classic", "--nodes", "3"];
    for (run, epochs) in [(&lr[..], 6), (&countmin[..], 30), (&kge[..], 6), (&w2v[..], 4)] {
        let (status, reports, stderr) = train_killing(run, 1);
        assert!(status.success() && stderr.contains("1 of 3 nodes lost (rank 1); the others trained on"), "{run:?}: {stderr}");
        assert_eq!(reports.iter().map(|r| r["epoch"].as_u64().unwrap()).collect::<Vec<_>>(), (1..=epochs).collect::<Vec<_>>(), "{run:?}");
        match run[0] {
            "lr" => {
                let auc = |r: &Value| r["quality"]["auc"].as_f64().unwrap();
                let (whole, survived) = (auc(uninterrupted.last().unwrap()), auc(reports.last().unwrap()));
                assert!((survived - whole).abs() < 0.02, "AUC {survived} after losing a node, {whole} uninterrupted");
            }
            "countmin" => assert!(reports.iter().all(|r| r["quality"]["within_bound"].as_f64() == Some(1.0)), "the sketch's error stays within its bound"),
            "kge" => assert!(reports.last().unwrap()["quality"]["mrr"].as_f64().is_some_and(|m| m > 0.0), "{:?}", reports.last()),
            _ => assert!(reports.last().unwrap()["quality"]["analogy"].as_f64().is_some(), "{:?}", reports.last()),
        }
    }
}

/// `--leave 2@3`: rank 2 leaves gracefully at the start of epoch 3, handing its keys to its
/// successor (in a cluster that relocates keys, giving those of other homes back first); the
/// others train on without a failed operation, deal its data among them, keep taking
/// checkpoints (whole without it), and end at the quality of an uninterrupted run.
#[test]
fn a_node_that_leaves_mid_training_is_trained_on_without() {
    for mode in ["classic", "localize"] {
        trained_on_without_a_leaver(mode);
    }
}

/// [`a_node_that_leaves_mid_training_is_trained_on_without`] in `mode`.
fn trained_on_without_a_leaver(mode: &str) {
    let run = ["mf", "--data", "synth-tiny", "--rank", "4", "--mode", mode, "--nodes", "3", "--epochs", "8"];
    let uninterrupted = train(&run);
    let dir = scratch(&format!("leave-{mode}"));
    let dir_text = dir.display().to_string();
    let out = Command::new(binary("ferry"))
        .arg("train")
        .args(run)
        .args(["--json", "--on-loss", "continue", "--leave", "2@3", "--checkpoint-every", "4", "--checkpoint-dir", &dir_text])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("node 2 leaves the cluster at the start of epoch 3") && stderr.contains("node 2 left: training goes on on 2 nodes"), "{stderr}");
    let reports: Vec<Value> = stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(reports.iter().map(|r| r["epoch"].as_u64().unwrap()).collect::<Vec<_>>(), (1..=8).collect::<Vec<_>>(), "every epoch once");
    assert_eq!(reports.last().unwrap()["nodes"].as_u64(), Some(2));
    let rmse = |r: &Value| r["quality"]["rmse"].as_f64().unwrap();
    let (whole, trained) = (rmse(uninterrupted.last().unwrap()), rmse(reports.last().unwrap()));
    assert!((trained - whole).abs() < 0.03 * whole, "RMSE {trained} after a node left ({mode}), {whole} uninterrupted");
    // The checkpoint after epoch 8 was written by ranks 0 and 1 alone, and says so.
    let manifest = std::fs::read_to_string(dir.join("epoch-8/node-1.manifest")).unwrap();
    assert!(manifest.contains("absent\t2") && !dir.join("epoch-8/node-2.manifest").exists(), "{manifest}");
    // Refused with a reason: without --on-loss continue, rank 0, beyond the epochs.
    for (args, says) in [
        (vec!["--leave", "2@3"], "--leave needs --on-loss continue"),
        (vec!["--on-loss", "continue", "--leave", "0@3"], "must be one of 1..3"),
        (vec!["--on-loss", "continue", "--leave", "2@9"], "from 2 to --epochs (8)"),
        (vec!["--on-loss", "continue", "--leave", "two"], "is not RANK@EPOCH"),
    ] {
        let out = Command::new(binary("ferry")).arg("train").args(run).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
