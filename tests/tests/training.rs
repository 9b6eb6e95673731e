//! Small versions of the training workloads, run through the `ferry` command on 2-node
//! clusters: the loss falls, quality passes a loose bar, and the three modes agree.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::RwLock;

use ferry_tests::binary;
use serde_json::Value;

/// Training runs whose figures are compared across runs (relocation counts, which CPU
/// contention changes eightfold) train alone; the others share this while they train.
static QUIET: RwLock<()> = RwLock::new(());

/// `ferry train ARGS --json`, beside other tests' training runs: its reports.
fn train(args: &[&str]) -> Vec<Value> {
    let _beside_others = QUIET.read().unwrap_or_else(|poisoned| poisoned.into_inner());
    run_train(args)
}

/// The same while no other test of this file trains.
fn train_alone(args: &[&str]) -> Vec<Value> {
    let _alone = QUIET.write().unwrap_or_else(|poisoned| poisoned.into_inner());
    run_train(args)
}

fn run_train(args: &[&str]) -> Vec<Value> {
    let out = Command::new(binary("ferry")).arg("train").args(args).arg("--json").output().expect("running ferry train");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ferry train {args:?} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect("a JSON report")).collect()
}

fn by_mode(reports: &[Value]) -> BTreeMap<String, Vec<Value>> {
    let mut m: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for r in reports {
        m.entry(r["mode"].as_str().unwrap().to_string()).or_default().push(r.clone());
    }
    m
}

fn f(v: &Value) -> f64 {
    v.as_f64().expect("a number")
}

/// Relocations over a run's epochs.
fn relocations(runs: &[Value]) -> u64 {
    runs.iter().map(|r| r["relocations"].as_u64().expect("a count")).sum()
}

#[test]
fn matrix_factorization_learns_and_modes_agree() {
    let reports = train(&["mf", "--data", "synth-tiny", "--rank", "5", "--lr", "0.02", "--reg", "0.02", "--mode", "all", "--epochs", "4", "--nodes", "2"]);
    let modes = by_mode(&reports);
    assert_eq!(modes.keys().cloned().collect::<Vec<_>>(), ["classic", "localize", "single"]);
    let final_rmse = |m: &str| f(&modes[m].last().unwrap()["quality"]["rmse"]);
    for (mode, runs) in &modes {
        assert_eq!(runs.len(), 4, "{mode}");
        assert!(f(&runs[3]["loss"]) < 0.8 * f(&runs[0]["loss"]), "{mode}: the loss did not fall");
        assert!(final_rmse(mode) < 0.8, "{mode}: RMSE {} is above the bar", final_rmse(mode));
        assert!(f(&runs[3]["quality"]["rmse"]) < f(&runs[0]["quality"]["rmse"]), "{mode}: RMSE did not improve");
    }
    for mode in ["classic", "localize"] {
        let ratio = final_rmse(mode) / final_rmse("single");
        assert!((0.97..1.03).contains(&ratio), "{mode} RMSE {} vs single {}", final_rmse(mode), final_rmse("single"));
    }
    assert!(modes["localize"].iter().all(|r| f(&r["local_share"]) >= 0.99), "localize keeps accesses local");
    assert!(modes["classic"].iter().all(|r| f(&r["local_share"]) < 0.8), "classic goes remote for foreign keys");
    assert!(modes["localize"].iter().all(|r| r["relocations"].as_u64().unwrap() > 0));
    assert!(modes["classic"].iter().all(|r| r["relocations"].as_u64().unwrap() == 0));
}

/// `train mf --ids raw`: users and items keyed by their ids in the file, in dynamic tables —
/// the same RMSE as the dense model in classic, localize and intent modes, localize keeping
/// every access local; names that are not
/// numbers key the tables by their hash, and a saved model names its rows as the file does.
#[test]
fn matrix_factorization_keys_raw_user_and_item_ids() {
    let base = ["mf", "--rank", "5", "--lr", "0.02", "--reg", "0.02", "--epochs", "4", "--nodes", "2"];
    // Hybrid mode replicates the five most rated items by their raw ids.
    let modes = by_mode(&train(
        &[&base[..], &["--data", "synth-tiny", "--mode", "single,classic,localize,intent,hybrid", "--ids", "raw", "--replicate", "5"]].concat(),
    ));
    let rmse = |m: &str| f(&modes[m][3]["quality"]["rmse"]);
    assert!(f(&modes["hybrid"][3]["replica_share"]) > 0.0, "hybrid reads replicated items here: {}", modes["hybrid"][3]);
    for mode in ["classic", "localize", "intent", "hybrid"] {
        // The dynamic tables start from a hash of each id (bias included), not as the dense ones.
        assert!((0.97..1.03).contains(&(rmse(mode) / rmse("single"))), "{mode}: RMSE {} vs single {}", rmse(mode), rmse("single"));
    }
    assert!(modes["localize"].iter().all(|r| f(&r["local_share"]) >= 0.99), "localize keeps raw ids local");
    // Named users and items (strings, hashed into ids), saved and exported by name.
    let dir = std::env::temp_dir().join(format!("ferry-mf-raw-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut csv = String::new();
    for u in 0..60 {
        for i in 0..12 {
            if (u * 7 + i * 3) % 5 != 0 {
                csv.push_str(&format!("user-{u},film {i},{}\n", 1 + (u + i) % 5));
            }
        }
    }
    std::fs::write(dir.join("ratings.csv"), csv).unwrap();
    let (data, model) = (dir.join("ratings.csv"), dir.join("model"));
    train(&[&base[..], &["--data", data.to_str().unwrap(), "--mode", "localize", "--ids", "raw", "--save", model.to_str().unwrap()]].concat());
    let users = std::fs::read_to_string(model.join("users.tsv")).unwrap();
    let items = std::fs::read_to_string(model.join("items.tsv")).unwrap();
    assert_eq!(users.lines().count(), 60, "every user held");
    assert!(users.lines().all(|l| l.starts_with("user-")) && items.lines().all(|l| l.starts_with("film ")), "rows named as the file names them");
    std::fs::remove_dir_all(&dir).unwrap();
    let out = Command::new(binary("ferry")).args(["train", "mf", "--data", "synth-tiny", "--ids", "cooked", "--mode", "single"]).output().unwrap();
    assert!(!out.status.success(), "--ids cooked was accepted");
}

#[test]
fn knowledge_graph_embeddings_learn_and_modes_agree() {
    let reports = train(&["kge", "--data", "synth-kg", "--dim", "16", "--mode", "all", "--epochs", "20", "--eval-every", "20", "--nodes", "2"]);
    let modes = by_mode(&reports);
    let mrr = |m: &str| f(&modes[m].last().unwrap()["quality"]["mrr"]);
    for (mode, runs) in &modes {
        assert!(f(&runs.last().unwrap()["loss"]) < 0.5 * f(&runs[0]["loss"]), "{mode}: the loss did not fall");
        // A random ranking of 40 entities has an MRR of about 0.11.
        assert!(mrr(mode) > 0.35, "{mode}: MRR {}", mrr(mode));
        for key in ["hits@1", "hits@3", "hits@10"] {
            let h = f(&runs.last().unwrap()["quality"][key]);
            assert!((0.0..=1.0).contains(&h), "{mode} {key} {h}");
        }
    }
    for mode in ["classic", "localize"] {
        assert!((mrr(mode) - mrr("single")).abs() < 0.12, "{mode} MRR {} vs single {}", mrr(mode), mrr("single"));
    }
    assert!(modes["localize"].iter().all(|r| f(&r["local_share"]) > f(&modes["classic"][0]["local_share"])));
    // Negatives from Ferry's sampling API train as well; local ones relocate less.
    for scheme in ["independent", "reuse:16:2", "local"] {
        let reports = train(&[
            "kge",
            "--data",
            "synth-kg",
            "--dim",
            "16",
            "--mode",
            "localize",
            "--epochs",
            "20",
            "--eval-every",
            "20",
            "--nodes",
            "2",
            "--negatives",
            scheme,
        ]);
        let last = reports.last().unwrap();
        assert!(f(&last["loss"]) < 0.5 * f(&reports[0]["loss"]), "{scheme}: the loss did not fall");
        assert!(f(&last["quality"]["mrr"]) > 0.3, "{scheme}: MRR {}", f(&last["quality"]["mrr"]));
        if scheme == "local" {
            assert!(relocations(&reports) < relocations(&modes["localize"]), "local negatives are not moved here");
        }
    }
}

#[test]
fn co_partitioned_triples_train_with_every_access_local() {
    // --copartition deals the triples by the entities they touch and homes each entity with
    // its triples; hybrid mode replicates the entities both nodes' triples share, so that with
    // local negatives nothing is fetched from the other node while training.
    let base = ["kge", "--data", "synth-kg", "--dim", "16", "--epochs", "20", "--eval-every", "20", "--nodes", "2"];
    let run = |extra: &[&str]| by_mode(&train(&[&base[..], extra].concat()));
    let direct = run(&["--mode", "single,classic", "--copartition", "--negatives", "direct"]);
    let carried = run(&["--mode", "hybrid", "--copartition", "--negatives", "local", "--adagrad", "worker"]);
    // Hybrid's defaults: co-partitioned, local negatives, and each worker's own AdaGrad
    // accumulators, so values are the embeddings alone.
    let defaults = run(&["--mode", "hybrid"]);
    let mrr = |runs: &[Value]| f(&runs.last().unwrap()["quality"]["mrr"]);
    let single = mrr(&direct["single"]);
    for (mode, runs) in [("classic", &direct["classic"]), ("hybrid, carried accumulators", &carried["hybrid"]), ("hybrid, defaults", &defaults["hybrid"])] {
        assert!(mrr(runs) > 0.35 && mrr(runs) > single - 0.12, "{mode} MRR {} vs single {single}", mrr(runs));
    }
    let shares = |runs: &[Value]| runs.iter().map(|r| f(&r["local_share"])).collect::<Vec<_>>();
    for runs in [&carried["hybrid"], &defaults["hybrid"]] {
        assert!(shares(runs).iter().all(|&s| s > 0.999), "hybrid: {:?}", shares(runs));
    }
    assert!(shares(&direct["classic"]).iter().all(|&s| s < 0.9), "classic: {:?}", shares(&direct["classic"]));
    let bytes = |runs: &[Value]| runs.iter().map(|r| r["bytes"].as_u64().unwrap()).sum::<u64>() as f64;
    assert!(
        bytes(&defaults["hybrid"]) < 0.7 * bytes(&carried["hybrid"]),
        "own accumulators: {} bytes, carried: {}",
        bytes(&defaults["hybrid"]),
        bytes(&carried["hybrid"])
    );
    // Without the plan, hybrid replicates NuPS's hot entities and relocates the rest; with it,
    // nothing moves.
    let hashed = run(&["--mode", "hybrid", "--no-copartition", "--negatives", "direct"]);
    assert!(
        relocations(&defaults["hybrid"]) == 0 && relocations(&hashed["hybrid"]) > 0,
        "relocations: {} with the plan, {} without",
        relocations(&defaults["hybrid"]),
        relocations(&hashed["hybrid"])
    );
}

#[test]
fn consistent_hashing_trains_as_hashing_does() {
    // The partitioning moves homes, not values: the same seed learns the same model.
    let base = ["mf", "--mode", "classic", "--nodes", "3", "--epochs", "2"];
    let hashed = train(&base);
    let consistent = train(&[&base[..], &["--partitioning", "consistent:16"]].concat());
    assert_eq!(consistent.len(), 2);
    assert!(f(&consistent[1]["loss"]) < f(&consistent[0]["loss"]));
    let rmse = |r: &[Value]| f(&r[1]["quality"]["rmse"]);
    assert!((rmse(&consistent) - rmse(&hashed)).abs() < 0.01, "RMSE {} consistent vs {} hashed", rmse(&consistent), rmse(&hashed));
    let out = Command::new(binary("ferry")).args(["train", "mf", "--nodes", "2", "--partitioning", "consistent:0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--partitioning: partitioning 'consistent:0'"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn any_ratings_file_of_the_right_shape_trains() {
    let dir = std::env::temp_dir().join(format!("ferry-ratings-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ratings.csv");
    let mut text = String::from("user,item,rating\n");
    for u in 0..60 {
        for i in 0..30 {
            if (u * 7 + i * 3) % 4 != 0 {
                text.push_str(&format!("u{u},i{i},{}\n", 1 + (u + 2 * i) % 5));
            }
        }
    }
    std::fs::write(&path, text).unwrap();
    let reports = train(&["mf", "--data", path.to_str().unwrap(), "--mode", "single", "--epochs", "3", "--rank", "4"]);
    assert_eq!(reports.len(), 3);
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "user,item\n1,2\n").unwrap();
    let out = Command::new(binary("ferry")).args(["train", "mf", "--mode", "single", "--data", bad.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bad.csv:2") && stderr.contains("expected at least 3"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A split of one's own (`--train`, `--test`) on a 2-node cluster, names with spaces in a
/// comma-separated file, and the errors a user meets with bad input: each is one line naming
/// the cause, printed before (and instead of) any table.
#[test]
fn own_train_and_test_files_and_clear_errors_for_bad_data() {
    let dir = std::env::temp_dir().join(format!("ferry-own-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (train_file, test_file) = (dir.join("train.csv"), dir.join("test.csv"));
    let (mut train_text, mut test_text) = (String::new(), String::new());
    for u in 0..60 {
        for i in 0..30 {
            let line = format!("user {u},Movie {i} (1999),{}\n", 1 + (u + 2 * i) % 5);
            match (u * 7 + i * 3) % 5 {
                0 => test_text.push_str(&line),
                1 => {}
                _ => train_text.push_str(&line),
            }
        }
    }
    std::fs::write(&train_file, train_text).unwrap();
    std::fs::write(&test_file, test_text).unwrap();
    let (train_arg, test_arg) = (train_file.to_str().unwrap(), test_file.to_str().unwrap());
    let reports = train(&["mf", "--train", train_arg, "--test", test_arg, "--mode", "single,localize", "--epochs", "2", "--rank", "4"]);
    let modes = by_mode(&reports);
    assert_eq!(modes.keys().cloned().collect::<Vec<_>>(), ["localize", "single"]);
    for runs in modes.values() {
        assert!(f(&runs[1]["quality"]["rmse"]) < 2.0, "the held-out file was evaluated: {:?}", runs[1]);
    }
    let fails = |args: &[&str], want: &str| {
        let out = Command::new(binary("ferry")).arg("train").args(args).env("RUST_BACKTRACE", "1").output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(want), "{args:?}: expected '{want}' in:\n{stderr}");
        assert!(!stdout.contains("epoch[s]"), "{args:?}: a table header was printed before the error:\n{stdout}");
        assert!(!stderr.contains("backtrace"), "{args:?}: the error came with a backtrace:\n{stderr}");
    };
    fails(&["mf", "--data", "wn18", "--mode", "single"], "known: ml-100k, synth-small, synth-tiny");
    fails(&["kge", "--data", "wn18", "--mode", "single"], "known: umls, kinships, nations, film, wordnet, synth-kg");
    let absurd = dir.join("absurd.txt");
    std::fs::write(&absurd, "a x 3\nb y 1e30\n").unwrap();
    fails(&["mf", "--train", absurd.to_str().unwrap(), "--test", test_arg, "--mode", "localize"], "absurd.txt:2: rating 1e30 is not a finite number");
    let one = dir.join("one.txt");
    std::fs::write(&one, "a x 3\n").unwrap();
    fails(&["mf", "--data", one.to_str().unwrap(), "--mode", "single"], "the test set is empty");
    let mixed = dir.join("mixed.txt");
    std::fs::write(&mixed, "a\tx\t3\nb y 4\n").unwrap();
    fails(&["mf", "--data", mixed.to_str().unwrap(), "--mode", "single"], "mixed.txt:2: 1 field(s) separated by tab");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `ferry train args` fails, and its error output names `want`, without a backtrace and without
/// the ranks' parser having misread a value.
fn fails_saying(args: &[&str], want: &str) {
    let out = Command::new(binary("ferry")).arg("train").args(args).env("RUST_BACKTRACE", "1").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded:\n{}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains(want), "{args:?}: expected '{want}' in:\n{stderr}");
    assert!(!stderr.contains("backtrace") && !stderr.contains("unexpected argument"), "{args:?}:\n{stderr}");
}

#[test]
fn a_diverged_run_fails_and_options_that_cannot_train_are_refused() {
    // A learning rate that makes the factors blow up: the epoch's loss is not a number.
    for mode in ["single", "classic"] {
        fails_saying(
            &["mf", "--data", "synth-tiny", "--rank", "4", "--lr", "1e6", "--epochs", "3", "--mode", mode, "--nodes", "2"],
            "epoch 1: the training diverged",
        );
    }
    fails_saying(&["kge", "--data", "synth-kg", "--dim", "8", "--lr", "1e30", "--epochs", "2", "--mode", "single"], "the training diverged");
    // Refused before any rank starts (a negative value once reached the ranks as a flag).
    fails_saying(&["mf", "--data", "synth-tiny", "--lr=-1", "--mode", "localize"], "--lr must be a positive number");
    fails_saying(&["mf", "--data", "synth-tiny", "--lr", "nan", "--mode", "single"], "--lr must be a positive number");
    fails_saying(&["kge", "--data", "synth-kg", "--reg=-0.5", "--mode", "localize"], "--reg a number at least 0");
    fails_saying(&["mf", "--data", "synth-tiny", "--threads", "0", "--mode", "single"], "--threads must be at least 1");
    fails_saying(&["mf", "--data", "synth-tiny", "--epochs", "0", "--mode", "single"], "--epochs must be at least 1");
    fails_saying(&["mf", "--data", "synth-tiny", "--test-share", "1.5", "--mode", "single"], "--test-share must be between 0 and 1");
}

/// A ratings file as spreadsheets and pandas write them (a byte-order mark, CRLF line ends,
/// quoted names holding the separator) trains in one process and on a cluster, with the header
/// notice said once for the whole run and MF's second measure in the table; a bad line is found
/// before any rank starts and said once; an error every rank of a cluster hits is said once
/// with the count of ranks.
#[test]
fn real_csv_files_train_and_a_cluster_says_each_notice_and_error_once() {
    let dir = std::env::temp_dir().join(format!("ferry-real-csv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("quoted.csv");
    let mut text = String::from("\u{feff}user,item,rating\r\n");
    for u in 0..60 {
        for i in 0..30 {
            if (u * 7 + i * 3) % 4 != 0 {
                text.push_str(&format!("\"user {u}\",\"Movie, {i}\",{}\r\n", 1 + (u + 2 * i) % 5));
            }
        }
    }
    std::fs::write(&path, &text).unwrap();
    let run = |args: &[&str]| Command::new(binary("ferry")).arg("train").args(args).output().unwrap();
    let out = run(&["mf", "--data", path.to_str().unwrap(), "--mode", "single,localize", "--nodes", "3", "--epochs", "2", "--rank", "4", "--json"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let reports: Vec<Value> = stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(reports.len(), 4, "{stdout}");
    for r in &reports {
        assert!(f(&r["quality"]["rmse"]) < 2.0 && f(&r["quality"]["mae"]) < f(&r["quality"]["rmse"]), "{r}");
    }
    assert_eq!(stderr.matches("taken as a header: 'user,item,rating'").count(), 1, "one notice for the run:\n{stderr}");
    // A bad line: found by the launching process, before a rank starts.
    let bad = dir.join("bad.csv");
    assert!(text.contains("\"user 3\",\"Movie, 4\",2\r\n"));
    std::fs::write(&bad, text.replace("\"user 3\",\"Movie, 4\",2", "\"user 3\",\"Movie, 4\",two")).unwrap();
    let out = run(&["mf", "--data", bad.to_str().unwrap(), "--mode", "localize", "--nodes", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(stderr.matches("'two' is not a rating").count(), 1, "{stderr}");
    assert!(!stderr.contains("[0]") && !stderr.contains("[1]"), "ranks were started for a bad file:\n{stderr}");
    // Every rank diverges: one line says so, with how many ranks.
    let out = run(&["mf", "--data", "synth-tiny", "--rank", "4", "--lr", "1e6", "--epochs", "2", "--mode", "localize", "--nodes", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("the training diverged")).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("the localize cluster failed on 3 of 3 ranks") && lines[0].contains("(ranks "), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A model beyond the machine's memory is refused before anything is allocated, naming what it
/// needs and what the machine has: in one process, and on a cluster once for all its ranks.
#[test]
fn a_model_too_large_for_the_machine_is_refused_before_it_is_allocated() {
    let started = std::time::Instant::now();
    fails_saying(&["mf", "--data", "synth-tiny", "--rank", "100000000", "--mode", "single"], "the model needs about");
    let out = Command::new(binary("ferry"))
        .args(["train", "mf", "--data", "synth-small", "--rank", "1000000", "--mode", "localize", "--nodes", "2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let lines: Vec<&str> = stderr.lines().filter(|l| l.contains("the tables need about")).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains("on the 2 nodes on this machine") && lines[0].contains("available") && lines[0].contains("failed on 2 of 2 ranks"), "{stderr}");
    assert!(started.elapsed() < std::time::Duration::from_secs(60), "refusing took {:?}", started.elapsed());
}

#[test]
fn fetching_reports_clearly_when_offline() {
    let cache = std::env::temp_dir().join(format!("ferry-offline-{}", std::process::id()));
    let out = Command::new(binary("ferry"))
        .args(["data", "fetch", "nations"])
        .env("FERRY_DATA", &cache)
        .env("PIP_NO_INDEX", "1")
        .env("PIP_FIND_LINKS", "")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("could not download pykeen==1.11.1") && err.contains("Offline?"), "{err}");
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn fetching_checks_and_caches_real_data() {
    let cache = std::env::temp_dir().join(format!("ferry-fetch-{}", std::process::id()));
    let out = Command::new(binary("ferry")).args(["data", "fetch", "nations"]).env("FERRY_DATA", &cache).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for f in ["train.txt", "valid.txt", "test.txt"] {
        assert!(cache.join("nations").join(f).exists(), "{f}");
    }
    // A damaged file is noticed and fetched again.
    std::fs::write(cache.join("nations").join("test.txt"), "damaged").unwrap();
    let out = Command::new(binary("ferry")).args(["data", "fetch", "nations"]).env("FERRY_DATA", &cache).output().unwrap();
    assert!(out.status.success());
    assert_ne!(std::fs::read_to_string(cache.join("nations").join("test.txt")).unwrap(), "damaged");
    let list = Command::new(binary("ferry")).args(["data", "list"]).env("FERRY_DATA", &cache).output().unwrap();
    assert!(String::from_utf8_lossy(&list.stdout).contains("nations   cached"));
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn word_vectors_learn_in_every_mode_with_every_sampling_scheme() {
    let base = ["w2v", "--data", "synth-text", "--dim", "16", "--epochs", "3", "--eval-every", "1", "--nodes", "2"];
    // Alone: its relocations are compared with the local scheme's below.
    let reports = train_alone(&[&base[..], &["--mode", "all", "--negatives", "independent"]].concat());
    let modes = by_mode(&reports);
    assert_eq!(modes.keys().cloned().collect::<Vec<_>>(), ["classic", "localize", "single"]);
    let final_loss = |m: &BTreeMap<String, Vec<Value>>, mode: &str| f(&m[mode].last().unwrap()["loss"]);
    for (mode, runs) in &modes {
        assert_eq!(runs.len(), 3, "{mode}");
        assert!(f(&runs[2]["loss"]) < f(&runs[0]["loss"]), "{mode}: the loss did not fall");
        let q = &runs[2]["quality"];
        assert_eq!(q["analogy_questions"].as_u64(), Some(20), "{mode}");
        assert!((0.0..=1.0).contains(&f(&q["analogy"])), "{mode}");
        assert!(f(&q["words_per_s_per_thread"]) > 0.0);
    }
    for mode in ["classic", "localize"] {
        let ratio = final_loss(&modes, mode) / final_loss(&modes, "single");
        assert!((0.9..1.1).contains(&ratio), "{mode} loss {} vs single {}", final_loss(&modes, mode), final_loss(&modes, "single"));
    }
    assert!(modes["classic"].iter().all(|r| f(&r["local_share"]) < 0.8), "classic goes remote for foreign words");
    // Every scheme trains; local sampling keeps the negatives here.
    for scheme in ["reuse:64:2", "postpone:64:2", "local"] {
        let args = [&base[..], &["--mode", "localize", "--negatives", scheme]].concat();
        let reports = if scheme == "local" { train_alone(&args) } else { train(&args) };
        assert_eq!(reports.len(), 3, "{scheme}");
        assert!(f(&reports[2]["loss"]) < f(&reports[0]["loss"]), "{scheme}: the loss did not fall");
        if scheme == "local" {
            // Counted in relocations, not in the local share: how much of the share localize
            // reaches in time depends on the machine's load (0.64 here, 0.995 on a loaded CI
            // run), while negatives drawn from the local keys are never moved at all. The
            // counts move with the load too: local negatives took 0.55–0.71 of independent
            // ones' relocations over three CI runs (42 000–50 000 against 70 000–76 000), so the
            // check asks for clearly fewer (under 0.8), not for half.
            let (local, independent) = (relocations(&reports), relocations(&modes["localize"]));
            assert!(5 * local < 4 * independent, "local negatives: {local} relocations, independent ones {independent}");
        }
    }
    // Any text file and any analogy file of the format; questions with unknown words are skipped.
    let dir = std::env::temp_dir().join(format!("ferry-w2v-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (corpus, questions) = (dir.join("text.txt"), dir.join("questions.txt"));
    std::fs::write(&corpus, "the cat sat on the mat\nthe dog sat on the log\n".repeat(50)).unwrap();
    std::fs::write(&questions, ": animals\ncat mat dog log\ncat mat dog unicorn\n").unwrap();
    let reports =
        train(&["w2v", "--mode", "single", "--epochs", "1", "--dim", "8", "--data", corpus.to_str().unwrap(), "--analogies", questions.to_str().unwrap()]);
    assert_eq!(reports[0]["quality"]["analogy_questions"].as_u64(), Some(1));
    // Several corpora, comma-separated, are one: "unicorn" occurs only in the second, so the
    // question that needs it is answered only with both.
    let more = dir.join("more.txt");
    std::fs::write(&more, "the unicorn sat on the log\n".repeat(10)).unwrap();
    let both = format!("{},{}", corpus.display(), more.display());
    let reports = train(&["w2v", "--mode", "single", "--epochs", "1", "--dim", "8", "--data", &both, "--analogies", questions.to_str().unwrap()]);
    assert_eq!(reports[0]["quality"]["analogy_questions"].as_u64(), Some(2));
    let out = Command::new(binary("ferry")).args(["train", "w2v", "--mode", "single", "--data", &format!("{both},synth-text")]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be combined"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(binary("ferry"))
        .args(["train", "w2v", "--mode", "single", "--negatives", "sometimes", "--data", corpus.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown sampling scheme"), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hybrid_mode_replicates_hot_keys_and_learns() {
    // ComplEx: hot entities and every relation replicated, the tail relocated, local negatives.
    let kge = ["kge", "--data", "synth-kg", "--dim", "16", "--epochs", "20", "--eval-every", "20", "--nodes", "2", "--negatives", "local"];
    let reports = train(&[&kge[..], &["--mode", "single,hybrid", "--replicate", "10", "--no-copartition"]].concat());
    let modes = by_mode(&reports);
    let last = |mode: &str| modes[mode].last().unwrap().clone();
    let (single, hybrid) = (last("single"), last("hybrid"));
    assert!(f(&hybrid["loss"]) < 0.5 * f(&modes["hybrid"][0]["loss"]), "hybrid: the loss did not fall");
    assert!(f(&hybrid["quality"]["mrr"]) > 0.35, "hybrid MRR {}", f(&hybrid["quality"]["mrr"]));
    // Not worse than one process: hybrid's MRR was 0.05-0.12 above single's in three runs on a
    // quiet machine (single's own varies by 0.04 between runs), so only a loss is checked.
    let (h, s) = (f(&hybrid["quality"]["mrr"]), f(&single["quality"]["mrr"]));
    assert!(h > s - 0.12, "hybrid MRR {h} against single's {s}");
    assert!(modes["hybrid"].iter().all(|r| f(&r["replica_share"]) > 0.05 && f(&r["local_share"]) > 0.99), "replicas serve locally");
    assert!(modes["hybrid"].iter().any(|r| f(&r["refresh_bytes"]) > 0.0), "replicas are refreshed");
    // Word vectors and matrix factorization run in hybrid mode too (MF replicates nothing with
    // the default factor: no regression against localize). Word2vec's defaults replicate the
    // words both nodes' sentences use and home the others with their user, and draw local
    // negatives: every access is local and nothing moves. With the frequency rule
    // (`--replicate`) the other words are relocated to where they are used.
    let w2v =
        |extra: &[&str]| train(&[&["w2v", "--data", "synth-text", "--dim", "16", "--epochs", "2", "--nodes", "2", "--mode", "hybrid"][..], extra].concat());
    let (shared, frequent) = (w2v(&[]), w2v(&["--replicate", "5"]));
    assert!(f(&shared[1]["loss"]) < f(&shared[0]["loss"]) && f(&shared[1]["replica_share"]) > 0.0);
    assert!(shared.iter().all(|r| f(&r["local_share"]) > 0.999), "{:?}", shared.iter().map(|r| &r["local_share"]).collect::<Vec<_>>());
    assert!(relocations(&shared) == 0 && relocations(&frequent) > 0, "relocations: {} shared, {} frequent", relocations(&shared), relocations(&frequent));
    let mf = train(&["mf", "--data", "synth-tiny", "--rank", "5", "--lr", "0.02", "--reg", "0.02", "--mode", "hybrid", "--epochs", "3", "--nodes", "2"]);
    assert_eq!(f(&mf[2]["replica_share"]), 0.0);
    assert!(f(&mf[2]["loss"]) < f(&mf[0]["loss"]));
}

/// `--save` writes every table as `.npy` + TSV of ids with `model.json`, from `single` and from
/// a 2-node cluster alike; `--predict` and `--rank-tails` use a saved model.
#[test]
fn models_are_saved_and_used_for_predictions() {
    let dir = std::env::temp_dir().join(format!("ferry-models-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    // Matrix factorization: the cluster's model predicts like single's (same seed, same data).
    for mode in ["single", "localize"] {
        train(&["mf", "--data", "synth-tiny", "--rank", "4", "--epochs", "2", "--mode", mode, "--save", &path(&format!("mf-{mode}"))]);
        let model = dir.join(format!("mf-{mode}"));
        let description: Value = serde_json::from_str(&std::fs::read_to_string(model.join("model.json")).unwrap()).unwrap();
        assert_eq!(description["task"], "mf");
        assert_eq!(description["tables"][0], serde_json::json!({ "name": "users", "rows": 2000, "cols": 5 }));
        let npy = std::fs::read(model.join("items.npy")).unwrap();
        assert!(String::from_utf8_lossy(&npy[..128]).contains("'shape': (200, 5)"), "items.npy's header");
        assert_eq!(npy.len() % 64, (200 * 5 * 4) % 64, "64-byte aligned data of 200 × 5 floats");
        assert_eq!(std::fs::read_to_string(model.join("users.tsv")).unwrap().lines().count(), 2000);
    }
    std::fs::write(dir.join("pairs.tsv"), "0 1\n5 7\nnobody 7\n").unwrap();
    let predict = |mode: &str| {
        let out =
            Command::new(binary("ferry")).args(["train", "mf", "--predict", &path("pairs.tsv"), "--model", &path(&format!("mf-{mode}"))]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("1 pair(s) name a user or item the model has not seen"));
        String::from_utf8_lossy(&out.stdout).lines().map(|l| l.split('\t').nth(2).unwrap().parse::<f64>().unwrap()).collect::<Vec<_>>()
    };
    let (single, cluster) = (predict("single"), predict("localize"));
    assert_eq!(single.len(), 3);
    assert!(single.iter().zip(&cluster).all(|(a, b)| (a - b).abs() < 0.5), "single {single:?} vs cluster {cluster:?}");
    // Knowledge-graph embeddings: the best tails of a query.
    train(&["kge", "--data", "synth-kg", "--dim", "8", "--epochs", "2", "--eval-every", "2", "--mode", "localize", "--save", &path("kge")]);
    let entities = std::fs::read_to_string(dir.join("kge/entities.tsv")).unwrap();
    let relations = std::fs::read_to_string(dir.join("kge/relations.tsv")).unwrap();
    let (head, relation) = (entities.lines().next().unwrap().split('\t').next().unwrap(), relations.lines().next().unwrap().split('\t').next().unwrap());
    std::fs::write(dir.join("queries.tsv"), format!("{head}\t{relation}\n")).unwrap();
    let out =
        Command::new(binary("ferry")).args(["train", "kge", "--rank-tails", &path("queries.tsv"), "--model", &path("kge"), "--top", "5"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let ranks: Vec<&str> = stdout.lines().map(|l| l.split('\t').nth(2).unwrap()).collect();
    assert_eq!(ranks, ["1", "2", "3", "4", "5"], "{stdout}");
    // Word vectors, and a model of the wrong task.
    train(&["w2v", "--data", "synth-text", "--dim", "8", "--epochs", "1", "--mode", "single", "--save", &path("w2v")]);
    let words = std::fs::read_to_string(dir.join("w2v/words.tsv")).unwrap().lines().count();
    assert!(words > 50, "{words} words saved");
    let out = Command::new(binary("ferry")).args(["train", "mf", "--predict", &path("pairs.tsv"), "--model", &path("w2v")]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("holds a w2v model"));
    // `ferry export`: the word vectors in the word2vec text format, the MF model as TSVs.
    let export = |args: &[&str]| {
        let out = Command::new(binary("ferry")).arg("export").args(args).output().unwrap();
        assert!(out.status.success(), "ferry export {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    export(&[&path("w2v"), "--format", "word2vec", "--out", &path("vectors.txt")]);
    let vectors = std::fs::read_to_string(dir.join("vectors.txt")).unwrap();
    assert_eq!(vectors.lines().next().unwrap(), format!("{words} 8"));
    assert_eq!(vectors.lines().nth(1).unwrap().split(' ').count(), 9, "a word and 8 values");
    export(&[&path("mf-single"), "--out", &path("mf-text")]);
    let items = std::fs::read_to_string(dir.join("mf-text/items.tsv")).unwrap();
    assert_eq!((items.lines().count(), items.lines().next().unwrap().split('\t').count()), (200, 6));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `train lr --save` and its checkpoints: dense keys save a row per feature key and the
/// bias's; raw ids save, by id, the ids the dynamic table holds — every trained one with room
/// for all, the same rows as the checkpoint written after the same epoch, which `ferry export`
/// reads by the checkpoint's own ids — and at most its capacity with room for a quarter.
#[test]
fn logistic_regression_models_are_saved_by_raw_id() {
    let dir = std::env::temp_dir().join(format!("ferry-lr-models-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let base = ["lr", "--data", "synth-lr", "--epochs", "2", "--nodes", "2", "--mode", "classic"];
    let export = |model: &str, out: &str| -> BTreeMap<String, f32> {
        let run = Command::new(binary("ferry")).args(["export", &path(model), "--out", &path(out)]).output().unwrap();
        assert!(run.status.success(), "ferry export {model}: {}", String::from_utf8_lossy(&run.stderr));
        let text = std::fs::read_to_string(dir.join(out).join("weights.tsv")).unwrap();
        text.lines()
            .map(|l| {
                let (id, value) = l.split_once('\t').unwrap();
                (id.to_string(), value.parse().unwrap())
            })
            .collect()
    };
    train(&[&base[..], &["--save", &path("dense")]].concat());
    let dense = export("dense", "dense-tsv");
    assert_eq!(dense.len(), 501, "500 feature keys and the bias");
    assert!(dense.contains_key("bias") && dense.contains_key("499"));
    train(&[&base[..], &["--ids", "raw", "--save", &path("raw"), "--checkpoint-every", "2", "--checkpoint-dir", &path("checkpoints")]].concat());
    let raw = export("raw", "raw-tsv");
    let bias = u64::MAX.to_string();
    assert_eq!(raw.len(), 501, "every trained id and the bias");
    assert!(raw.keys().all(|id| *id == bias || id.parse::<u64>().is_ok_and(|f| f < 500)), "ids are the data's feature ids");
    let description: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("checkpoints/epoch-2/model.json")).unwrap()).unwrap();
    assert_eq!(description["tables"][0]["ids"], "checkpoint", "{description}");
    assert!(!dir.join("checkpoints/epoch-2/weights.tsv").exists(), "a dynamic table's ids are the checkpoint's");
    let checkpointed = export("checkpoints/epoch-2", "checkpoint-tsv");
    assert_eq!(checkpointed, raw, "the checkpoint after epoch 2 holds the model saved after it");
    assert!(raw[&bias] != 0.0 && raw.values().filter(|v| **v != 0.0).count() > 400, "the model learnt");
    train(&[&base[..], &["--ids", "raw", "--capacity-share", "0.25", "--save", &path("quarter")]].concat());
    let quarter = export("quarter", "quarter-tsv");
    assert!((20..=126).contains(&quarter.len()), "{} ids saved from room for 2 × 63", quarter.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn logistic_regression_learns_with_every_toolbox_option() {
    let base = ["lr", "--data", "synth-lr", "--epochs", "4", "--nodes", "2"];
    let plain = train(&[&base[..], &["--mode", "single,classic,localize"]].concat());
    let modes = by_mode(&plain);
    let auc = |r: &Value| f(&r["quality"]["auc"]);
    for (mode, runs) in &modes {
        assert!(f(&runs[3]["loss"]) < f(&runs[0]["loss"]), "{mode}: the loss did not fall");
        // The planted model's Bayes AUC is about 0.75; a random guess 0.5.
        assert!(auc(&runs[3]) > 0.7, "{mode}: AUC {}", auc(&runs[3]));
    }
    assert!((auc(&modes["classic"][3]) - auc(&modes["single"][3])).abs() < 0.01);
    assert!(modes["localize"].iter().all(|r| r["relocations"].as_u64().unwrap() > 0));
    // Key caching and bf16 values: fewer bytes from the second epoch on, the same quality.
    let lean = train(&[&base[..], &["--mode", "classic", "--key-cache", "16", "--codec", "bf16"]].concat());
    let classic = &modes["classic"];
    assert!(lean[3]["bytes"].as_u64().unwrap() * 2 < classic[3]["bytes"].as_u64().unwrap(), "{} vs {}", lean[3]["bytes"], classic[3]["bytes"]);
    assert!((auc(&lean[3]) - auc(&classic[3])).abs() < 0.01);
    // FTRL with the KKT filter, and AdaGrad with the significance filter: they learn, and the
    // significance filter reports what it held back.
    let ftrl = train(&[&base[..], &["--mode", "classic", "--optimizer", "ftrl", "--lr", "2", "--l1", "1e-4", "--filter", "kkt"]].concat());
    assert!(auc(&ftrl[3]) > 0.7, "FTRL: AUC {}", auc(&ftrl[3]));
    // AdaGrad computed by the trainer (each value carries its accumulator): the same model.
    let worker_side = train(&[&base[..], &["--mode", "classic", "--optimizer-at", "worker"]].concat());
    assert!((auc(&worker_side[3]) - auc(&classic[3])).abs() < 0.01, "worker-side AdaGrad: AUC {}", auc(&worker_side[3]));
    let filtered = train(&[&base[..], &["--mode", "classic", "--filter", "significance:0.05"]].concat());
    assert!(auc(&filtered[3]) > 0.7 && filtered[3]["quality"]["filtered"].as_str().is_some_and(|s| s.ends_with("held")));
    // Feature hashing of the 500 features into 1024 signed keys (collisions cost about 0.03 of
    // AUC there, and 64 keys 0.17): still learning, and the same model in one process and on
    // two nodes.
    let hashed = by_mode(&train(&[&base[..], &["--mode", "single,classic", "--hash-buckets", "1024", "--hash-signed"]].concat()));
    assert!(auc(&hashed["classic"][3]) > 0.68, "1024 hashed keys: AUC {}", auc(&hashed["classic"][3]));
    assert!((auc(&hashed["classic"][3]) - auc(&hashed["single"][3])).abs() < 0.01);
    // Raw ids in a dynamic table (each feature's id created at its first push): the same model
    // as `single` with room for all.
    let raw = by_mode(&train(&[&base[..], &["--mode", "single,classic,localize", "--ids", "raw"]].concat()));
    assert!((auc(&raw["classic"][3]) - auc(&raw["single"][3])).abs() < 0.01, "raw ids: AUC {} vs {}", auc(&raw["classic"][3]), auc(&raw["single"][3]));
    assert!((auc(&raw["localize"][3]) - auc(&raw["single"][3])).abs() < 0.01);
    assert!((auc(&raw["single"][3]) - auc(&modes["single"][3])).abs() < 0.01, "renumbered raw ids are the dense model");
    // Intent mode declares the raw ids.
    let intent = train(&[&base[..], &["--mode", "intent", "--ids", "raw", "--eviction", "never"]].concat());
    assert!((auc(&intent[3]) - auc(&raw["single"][3])).abs() < 0.01, "raw ids in intent mode: AUC {}", auc(&intent[3]));
    assert!(f(&intent[3]["local_share"]) > 0.9, "intent brings the raw ids' weights here: {}", intent[3]["local_share"]);
    // Room for a quarter of the ids, evicting, on data whose features come by Zipf's law (as
    // words and click features do; synth-lr's are all alike, and which quarter of them
    // survives is down to timing): in classic and intent modes, and in a stream, the table
    // holds at most its room (2 nodes × 36 of the 284 distinct ids) and keeps most of what room
    // for all learns above chance (0.77–0.84 of it between runs; 0.6 is the bar).
    let skewed = ["lr", "--data", "synth-lr-skewed", "--epochs", "4", "--nodes", "2", "--ids", "raw"];
    let kept = |quarter: &Value, all: &Value| (auc(quarter) - 0.5) / (auc(all) - 0.5);
    let room_for_all = train(&[&skewed[..], &["--mode", "classic"]].concat());
    // Hybrid mode replicates the 20 most used raw ids (38 % of the accesses there): the same
    // model, those read and pushed here.
    let hybrid = train(&[&skewed[..], &["--mode", "hybrid", "--replicate", "20"]].concat());
    assert!((auc(&hybrid[3]) - auc(&room_for_all[3])).abs() < 0.01, "raw ids in hybrid mode: AUC {} vs {}", auc(&hybrid[3]), auc(&room_for_all[3]));
    assert!(f(&hybrid[3]["replica_share"]) > 0.0, "hybrid reads replicated ids here: {}", hybrid[3]);
    for mode in ["classic", "intent"] {
        let quarter = train(&[&skewed[..], &["--mode", mode, "--capacity-share", "0.25"]].concat());
        assert!(kept(&quarter[3], &room_for_all[3]) > 0.6, "{mode}, a quarter of the ids: AUC {} against {}", auc(&quarter[3]), auc(&room_for_all[3]));
        let held = quarter[3]["quality"]["nonzero"].as_u64().unwrap();
        assert!((10..=72).contains(&held), "{mode}: {held} weights held in room for a quarter of 284 ids");
    }
    // A stream (each epoch trains on a new quarter of the examples, once): it learns, and
    // every epoch sends about what the first did (a growing prefix sends four times as much
    // by the fourth).
    let arrivals = ["--mode", "classic", "--ids", "raw", "--arrivals", "4"];
    let stream = train(&[&base[..], &arrivals[..], &["--stream"]].concat());
    let prefix = train(&[&base[..], &arrivals[..]].concat());
    let bytes = |r: &Value| f(&r["bytes"]);
    assert!(bytes(&stream[3]) < 1.5 * bytes(&stream[0]) && bytes(&prefix[3]) > 2.5 * bytes(&prefix[0]), "stream {stream:?}, prefix {prefix:?}");
    assert!(auc(&stream[3]) > 0.7, "a stream: AUC {}", auc(&stream[3]));
    let skewed_stream = ["--mode", "classic", "--arrivals", "4", "--stream"];
    let stream_all = train(&[&skewed[..], &skewed_stream[..]].concat());
    let quarter_stream = train(&[&skewed[..], &skewed_stream[..], &["--capacity-share", "0.25"]].concat());
    assert!(kept(&quarter_stream[3], &stream_all[3]) > 0.6, "a stream in room for a quarter: AUC {} against {}", auc(&quarter_stream[3]), auc(&stream_all[3]));
    for r in &quarter_stream {
        let held = r["quality"]["ids_held"].as_u64().unwrap();
        assert!((10..=72).contains(&held), "epoch {}: {held} ids held in room for a quarter", r["epoch"]);
    }
    // Bad options are refused before anything starts.
    for bad in [
        &["--ids", "raw", "--hash-buckets", "64"][..],
        &["--ids", "raw", "--admission", "sometimes"],
        &["--ids", "raw", "--capacity-share", "0"],
        &["--ids", "raw", "--arrivals", "4", "--place-arrivals"],
        &["--arrivals", "4", "--stream", "--epochs", "5"],
        &["--arrivals", "4", "--stream", "--mode", "single"],
        &["--stream"],
        &["--ids", "cooked"],
        &["--optimizer", "sgd"],
        &["--codec", "fp8"],
        &["--filter", "significance:-1"],
        &["--l1", "0.1"],
        &["--optimizer-at", "gpu"],
        &["--filter", "kkt", "--optimizer-at", "worker"],
        &["--mode", "hybrid", "--optimizer-at", "server"],
        &["--hash-buckets", "0"],
        &["--hash-signed"],
        &["--hash-buckets", "64", "--hash-bits", "10"],
    ] {
        let out = Command::new(binary("ferry")).args(["train", "lr", "--data", "synth-lr"]).args(bad).output().unwrap();
        assert!(!out.status.success(), "{bad:?} was accepted");
    }
}

#[test]
fn count_min_sketch_stays_within_its_bound() {
    for combine in ["0", "4096"] {
        let reports = train(&[
            "countmin",
            "--data",
            "synth-text",
            "--width",
            "512",
            "--depth",
            "3",
            "--mode",
            "single,classic",
            "--epochs",
            "2",
            "--nodes",
            "2",
            "--combine",
            combine,
        ]);
        let modes = by_mode(&reports);
        for (mode, runs) in &modes {
            let q = &runs[1]["quality"];
            assert!(f(&q["within_bound"]) >= 0.99, "{mode}: {q}");
            assert_eq!(q["undercounts"].as_u64(), Some(0), "{mode}: a CountMin sketch never undercounts");
            assert!(f(&q["keys_per_s"]) > 0.0 && f(&q["raw_keys_per_s"]) > 0.0);
        }
        // Every node inserted into the same sketch: the cluster's estimates equal single's.
        assert_eq!(modes["classic"][1]["quality"]["mean_overcount"], modes["single"][1]["quality"]["mean_overcount"]);
    }
}

#[test]
fn logistic_regression_on_a_real_libsvm_set_from_a_source_archive() {
    // agaricus comes out of the xlearn source archive (pip, --no-binary): fetched, checked,
    // cached, then read as LIBSVM.
    let cache = std::env::temp_dir().join(format!("ferry-fetch-lr-{}", std::process::id()));
    let out = Command::new(binary("ferry"))
        .args(["train", "lr", "--data", "agaricus", "--mode", "single", "--epochs", "2", "--json"])
        .env("FERRY_DATA", &cache)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&cache);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reports: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(f(&reports[1]["quality"]["auc"]) > 0.99, "{}", reports[1]);
}

#[test]
fn wordnet_comes_from_a_debian_package_as_a_graph_of_a_hundred_thousand_synsets() {
    // wordnet-base is downloaded with apt-get, read with dpkg-deb, turned into triples and
    // glosses, checked and cached; ComplEx trains on the triples.
    let cache = std::env::temp_dir().join(format!("ferry-fetch-wordnet-{}", std::process::id()));
    let out = Command::new(binary("ferry"))
        .args(["train", "kge", "--data", "wordnet", "--mode", "single", "--epochs", "1", "--dim", "4", "--eval-max", "20", "--json"])
        .env("FERRY_DATA", &cache)
        .output()
        .unwrap();
    let glosses = std::fs::read_to_string(cache.join("wordnet/glosses.txt")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&cache);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(glosses.lines().count(), 117_659, "one gloss per synset");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let reports: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(reports.len(), 1, "{stderr}");
    assert_eq!(reports[0]["quality"]["test_triples"].as_u64(), Some(20));
}

#[test]
fn a_training_killed_at_any_rename_of_its_model_saves_leaves_a_whole_model() {
    // A whole model of epoch 1 is saved first. Then strace kills a 2-epoch run at its n-th
    // rename (every file of a save is renamed into place in DIR.partial, then the old model is
    // renamed away and the new one in); whatever n, the directory reads as one whole model that
    // predicts, of epoch 1 or 2 (a model whose files mixed two saves would fail its checksums),
    // and the run that renames nothing more ends normally.
    assert!(Command::new("strace").arg("-V").output().is_ok_and(|o| o.status.success()), "strace is missing (scripts/setup installs it)");
    let dir = std::env::temp_dir().join(format!("ferry-killed-saves-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model");
    std::fs::write(dir.join("pairs.tsv"), "0 1\n").unwrap();
    let args = |epochs: &str| {
        ["train", "mf", "--data", "synth-tiny", "--rank", "4", "--epochs", epochs, "--save-every", "1", "--mode", "single", "--save"].map(str::to_string)
    };
    let first = Command::new(binary("ferry")).args(args("1")).arg(&model).output().unwrap();
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let mut killed = 0;
    for n in 1..60 {
        let out = Command::new("strace")
            .args(["-f", "-o", "/dev/null", "-e", &format!("inject=rename:signal=SIGKILL:when={n}")])
            .arg(binary("ferry"))
            .args(args("2"))
            .arg(&model)
            .output()
            .unwrap();
        let predicted =
            Command::new(binary("ferry")).args(["train", "mf", "--predict"]).arg(dir.join("pairs.tsv")).arg("--model").arg(&model).output().unwrap();
        assert!(predicted.status.success(), "killed at rename {n}: {}", String::from_utf8_lossy(&predicted.stderr));
        assert_eq!(String::from_utf8_lossy(&predicted.stdout).lines().count(), 1);
        let readable = if model.join("model.json").exists() { model.clone() } else { dir.join("model.previous") };
        let description: Value = serde_json::from_str(&std::fs::read_to_string(readable.join("model.json")).unwrap()).unwrap();
        assert!(description["epoch"] == 1 || description["epoch"] == 2, "killed at rename {n}: {}", description["epoch"]);
        if out.status.success() {
            assert_eq!(description["epoch"], 2);
            break;
        }
        killed += 1;
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(killed >= 10, "only {killed} runs were killed: the saves rename less than expected");
}

#[test]
fn the_four_dictionaries_are_one_corpus_with_a_vocabulary_of_fifty_thousand_words() {
    // `dictionaries` fetches GCIDE, WordNet's glosses, FOLDOC and the Jargon File from their
    // Debian packages and trains on them as one corpus; the report says how large it is.
    // Strong subsampling and one analogy question keep the epoch and its evaluation short.
    let questions = std::env::temp_dir().join(format!("ferry-one-question-{}.txt", std::process::id()));
    std::fs::write(&questions, ": capital-common-countries\nathens greece baghdad iraq\n").unwrap();
    let out = Command::new(binary("ferry"))
        .args(["train", "w2v", "--data", "dictionaries", "--mode", "single", "--epochs", "1", "--dim", "2", "--window", "1", "--sample", "1e-6", "--json"])
        .arg("--analogies")
        .arg(&questions)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&questions);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let reports: Vec<Value> = String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(reports.len(), 1, "{stderr}");
    let quality = &reports[0]["quality"];
    assert!(quality["vocabulary"].as_u64().unwrap() >= 50_000, "{quality}");
    assert!(quality["corpus_words"].as_u64().unwrap() > 6_000_000, "{quality}");
}

#[test]
fn every_relocating_workload_trains_in_intent_mode() {
    // The trainer only declares intent; the engine moves and replicates keys. MF's blocks are exclusive per
    // sub-epoch, so after the first epoch (the clock-rate estimate warming up) nearly every
    // access is local, and the model is the localize mode's.
    let mf =
        train(&["mf", "--data", "synth-tiny", "--rank", "5", "--lr", "0.02", "--reg", "0.02", "--mode", "localize,intent", "--epochs", "4", "--nodes", "2"]);
    let modes = by_mode(&mf);
    let (localize, intent) = (&modes["localize"], &modes["intent"]);
    assert_eq!(intent.len(), 4);
    assert!(f(&intent[3]["loss"]) < 0.8 * f(&intent[0]["loss"]), "the loss did not fall");
    let ratio = f(&intent[3]["quality"]["rmse"]) / f(&localize[3]["quality"]["rmse"]);
    assert!((0.97..1.03).contains(&ratio), "intent RMSE {} vs localize {}", intent[3]["quality"]["rmse"], localize[3]["quality"]["rmse"]);
    assert!(intent.iter().all(|r| r["relocations"].as_u64().unwrap() > 0), "intent moved nothing");
    // Epochs of a few milliseconds are at the scheduler's mercy on a loaded machine (a late
    // hand-over is a large share of one): at least one warmed-up epoch must show the blocks
    // arriving in time; the per-epoch figures are the benchmark's (docs/WORKLOADS.md).
    let in_time = |r: &&Value| f(&r["local_share"]) >= 0.98 && f(&r["late_share"]) <= 0.02;
    assert!(intent[1..].iter().any(|r| in_time(&r)), "no warmed-up epoch kept its blocks local: {intent:?}");
    assert!(localize.iter().all(|r| f(&r["late_share"]) == 0.0), "only intent mode has late accesses");
    // A block passes from node to node at the sub-epoch barriers, its current user releasing
    // it before its next user needs it: the homes move it and replicate nothing.
    assert!(intent.iter().all(|r| f(&r["replica_share"]) == 0.0), "mf: blocks were replicated on their way: {intent:?}");

    let kge = train(&["kge", "--data", "synth-kg", "--dim", "16", "--mode", "intent", "--epochs", "20", "--eval-every", "20", "--nodes", "2"]);
    assert!(f(&kge.last().unwrap()["loss"]) < 0.5 * f(&kge[0]["loss"]), "kge: the loss did not fall");
    assert!(f(&kge.last().unwrap()["quality"]["mrr"]) > 0.35, "kge MRR {}", kge.last().unwrap()["quality"]["mrr"]);
    // Keys move to the node that needs them alone and are replicated on nodes that share them;
    // once the shared ones are replicated an epoch may move nothing.
    assert!(kge.iter().any(|r| r["relocations"].as_u64().unwrap() > 0), "kge: intent moved nothing");
    assert!(kge.iter().all(|r| f(&r["local_share"]) > 0.5), "kge: {:?}", kge.iter().map(|r| (&r["local_share"], &r["relocations"])).collect::<Vec<_>>());
    // Entities that both nodes draw at once are replicated on both (AdaGrad runs in the
    // trainer in intent mode, so replicas can take its pushes).
    assert!(kge.iter().any(|r| f(&r["replica_share"]) > 0.0), "kge: nothing was replicated");

    let w2v = train(&["w2v", "--data", "synth-text", "--dim", "16", "--epochs", "3", "--eval-every", "3", "--nodes", "2", "--mode", "intent"]);
    assert!(f(&w2v[2]["loss"]) < f(&w2v[0]["loss"]), "w2v: the loss did not fall");
    assert!(w2v.iter().all(|r| r["relocations"].as_u64().unwrap() > 0));
    assert!(w2v.iter().any(|r| f(&r["replica_share"]) > 0.0), "w2v: frequent words were not replicated");
    // With a sampling scheme intent declares only the batches' words, and the scheme serves the
    // negatives from what is here: the frequent words that both nodes drew as negatives, and so
    // declared at once, were replicated; now far fewer accesses go to replicas.
    let sampled = train(&[
        "w2v",
        "--data",
        "synth-text",
        "--dim",
        "16",
        "--epochs",
        "3",
        "--eval-every",
        "3",
        "--nodes",
        "2",
        "--mode",
        "intent",
        "--negatives",
        "local",
    ]);
    assert!(f(&sampled[2]["loss"]) < f(&sampled[0]["loss"]), "w2v, local negatives: the loss did not fall");
    let replicated = |runs: &[Value]| runs.iter().map(|r| f(&r["replica_share"])).sum::<f64>() / runs.len() as f64;
    assert!(
        replicated(&sampled) < 0.5 * replicated(&w2v),
        "w2v: {:.3} of accesses went to replicas with local negatives, {:.3} with declared ones",
        replicated(&sampled),
        replicated(&w2v)
    );

    let lr = train(&["lr", "--data", "synth-lr", "--epochs", "4", "--nodes", "2", "--mode", "intent"]);
    assert!(f(&lr[3]["loss"]) < f(&lr[0]["loss"]), "lr: the loss did not fall");
    assert!(f(&lr[3]["quality"]["auc"]) > 0.7, "lr AUC {}", lr[3]["quality"]["auc"]);
    // AdaGrad runs in the trainer in intent mode, so the weights both nodes need are replicated.
    // (Epochs of 10 ms: on a loaded machine one may pass before the service acts.)
    assert!(lr.iter().any(|r| f(&r["replica_share"]) > 0.0), "lr: nothing was replicated");

    // Options that contradict intent mode are refused with a reason.
    for (args, says) in [
        (&["kge", "--data", "synth-kg", "--mode", "intent", "--negatives", "local"][..], "--negatives direct"),
        (&["countmin", "--mode", "intent"][..], "classic mode"),
        (&["mf", "--data", "synth-tiny", "--mode", "intent", "--intent-clocks", "0"][..], "--intent-clocks"),
        (&["lr", "--data", "synth-lr", "--mode", "intent", "--optimizer", "ftrl", "--optimizer-at", "worker"][..], "FTRL runs server-side"),
    ] {
        let out = Command::new(binary("ferry")).arg("train").args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{args:?}: {stderr}");
    }
}
