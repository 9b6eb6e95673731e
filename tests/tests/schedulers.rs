//! `ferry train` started by a real scheduler: every process finds its rank in the scheduler's
//! variables, acts as one node, and rank 0 prints the normal report.

use std::process::Command;

use ferry_tests::binary;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Whether `program` can be run. A missing scheduler fails the test unless `opt_out` is set to 0
/// (`scripts/setup` installs them).
fn available(program: &str, opt_out: &str) -> bool {
    if Command::new(program).arg("--version").output().is_ok() {
        return true;
    }
    assert!(std::env::var(opt_out).is_ok_and(|v| v == "0"), "{program} is not installed: run scripts/setup (as root), or set {opt_out}=0 to skip this test");
    eprintln!("{opt_out}=0: {program} is not installed and this test was NOT run");
    false
}

/// Open MPI's `mpirun` starts two `ferry train mf` processes: they form one cluster
/// (`OMPI_COMM_WORLD_RANK`/`SIZE` and `FERRY_COORDINATOR`), rank 0 prints one JSON report per
/// epoch and nobody else prints any; a second mode is refused with a message.
#[test]
fn train_runs_under_open_mpi() {
    if !available("mpirun", "FERRY_MPI") {
        return;
    }
    let run = |extra: &[&str]| {
        Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", &format!("FERRY_COORDINATOR=127.0.0.1:{}", free_port())])
            .arg(binary("ferry"))
            .args(["train", "mf", "--data", "synth-tiny", "--rank", "4", "--epochs", "3"])
            .args(extra)
            .output()
            .expect("running mpirun")
    };
    let out = run(&["--json"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "mpirun failed:\n{stdout}\n{stderr}");
    let reports: Vec<serde_json::Value> = stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(reports.len(), 3, "one report per epoch, from rank 0 only:\n{stdout}");
    assert!(reports.iter().all(|r| r["mode"] == "localize" && r["local_share"].as_f64().unwrap() > 0.99), "{stdout}");
    let rmse = |r: &serde_json::Value| r["quality"]["rmse"].as_f64().unwrap();
    assert!(rmse(&reports[2]) < rmse(&reports[0]), "the model learns: {stdout}");
    assert!(stderr.contains("localize mode on 2 nodes started by open-mpi"), "{stderr}");
    let out = run(&["--mode", "single,localize"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("runs exactly one cluster mode"), "{}", String::from_utf8_lossy(&out.stderr));
}
