//! `ferry train` started by a real scheduler: every process finds its rank in the scheduler's
//! variables, acts as one node, and rank 0 prints the normal report.

use std::process::Command;

use ferry_tests::binary;

/// A port for a coordinator that binds it later: taken below the kernel's ephemeral range
/// (32768–60999 on Linux), so that no outgoing connection made meanwhile (srun's, mpirun's, a
/// parallel test's) can be given it; free when asked.
fn free_port() -> u16 {
    use std::hash::{BuildHasher, RandomState};
    let mut seed = RandomState::new().hash_one(std::process::id());
    for _ in 0..1000 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let port = 20_000 + (seed >> 33) as u16 % 12_000;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in 20000–31999 on 127.0.0.1")
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
/// epoch and nobody else prints any; a second mode is refused with a message; checkpoints
/// written by 2 processes resume under 3.
#[test]
fn train_runs_under_open_mpi() {
    if !available("mpirun", "FERRY_MPI") {
        return;
    }
    let secret = secret_file("mpi");
    let run_on = |processes: usize, epochs: usize, extra: &[&str]| {
        Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", &processes.to_string(), "-x", &format!("FERRY_COORDINATOR=127.0.0.1:{}", free_port())])
            .args(["-x", &format!("FERRY_SECRET_FILE={}", secret.display())])
            .arg(binary("ferry"))
            .args(["train", "mf", "--data", "synth-tiny", "--rank", "4", "--epochs", &epochs.to_string()])
            .args(extra)
            .output()
            .expect("running mpirun")
    };
    let run = |extra: &[&str]| run_on(2, 3, extra);
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
    // Checkpoints written by 2 processes resume under 3.
    let checkpoints = std::env::temp_dir().join(format!("ferry-mpi-checkpoints-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&checkpoints);
    let checkpoints_arg = checkpoints.to_str().unwrap();
    let out = run_on(2, 2, &["--checkpoint-every", "1", "--checkpoint-dir", checkpoints_arg]);
    assert!(out.status.success(), "mpirun with checkpoints failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let out = run_on(3, 4, &["--json", "--checkpoint-every", "1", "--checkpoint-dir", checkpoints_arg, "--resume", checkpoints_arg]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "mpirun --resume failed:\n{stdout}\n{stderr}");
    let resumed: Vec<serde_json::Value> = stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(resumed.iter().map(|r| r["epoch"].as_u64().unwrap()).collect::<Vec<_>>(), [3, 4], "resumed after epoch 2:\n{stdout}");
    assert!(rmse(&resumed[1]) < rmse(&reports[0]), "the resumed model goes on from the checkpoint: {stdout}");
    assert!(stderr.contains("localize mode on 3 nodes started by open-mpi"), "{stderr}");
    let _ = std::fs::remove_dir_all(&checkpoints);
}

/// A single-host Slurm cluster started for the test from the distribution's packages: its own
/// configuration (no munge: `auth/none`), `slurmctld` and `slurmd` on free ports, both stopped
/// when dropped.
struct Slurm {
    conf: std::path::PathBuf,
    dir: std::path::PathBuf,
    daemons: Vec<std::process::Child>,
}

impl Slurm {
    fn start() -> Slurm {
        let dir = std::env::temp_dir().join(format!("ferry-slurm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["ctld", "d"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        let host = String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap().trim().to_string();
        let d = dir.display();
        let conf = dir.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=ferry\nSlurmctldHost={host}\nSlurmctldPort={}\nSlurmdPort={}\nAuthType=auth/none\nCredType=cred/none\n\
                 SlurmUser=root\nSlurmdUser=root\nStateSaveLocation={d}/ctld\nSlurmdSpoolDir={d}/d\nSlurmctldPidFile={d}/ctld.pid\n\
                 SlurmdPidFile={d}/d.pid\nSlurmctldLogFile={d}/ctld.log\nSlurmdLogFile={d}/d.log\nProctrackType=proctrack/linuxproc\n\
                 TaskPlugin=task/none\nSelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nMpiDefault=none\nReturnToService=2\n\
                 SwitchType=switch/none\nJobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n\
                 NodeName={host} CPUs=2 State=UNKNOWN\nPartitionName=ferry Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n",
                free_port(),
                free_port()
            ),
        )
        .unwrap();
        let mut slurm = Slurm { conf, dir, daemons: Vec::new() };
        for daemon in ["slurmctld", "slurmd"] {
            let child =
                Command::new(daemon).args(["-D", "-f"]).arg(&slurm.conf).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn();
            slurm.daemons.push(child.unwrap_or_else(|e| panic!("starting {daemon}: {e}")));
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
        // The node registers with the controller and becomes idle.
        let started = std::time::Instant::now();
        loop {
            let state = slurm.command("sinfo").args(["-h", "-o", "%t"]).output().unwrap();
            if String::from_utf8_lossy(&state.stdout).trim() == "idle" {
                return slurm;
            }
            let log =
                std::fs::read_to_string(slurm.dir.join("ctld.log")).unwrap_or_default() + &std::fs::read_to_string(slurm.dir.join("d.log")).unwrap_or_default();
            assert!(started.elapsed() < std::time::Duration::from_secs(60), "the Slurm node never became idle:\n{log}");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// A Slurm client command talking to this cluster.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for daemon in &mut self.daemons {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh cluster secret in a file only its owner reads, written by `ferry secret --out`.
fn secret_file(name: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("ferry-secret-{name}-{}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let out = Command::new(binary("ferry")).args(["secret", "--out"]).arg(&path).output().unwrap();
    assert!(out.status.success(), "ferry secret: {}", String::from_utf8_lossy(&out.stderr));
    path
}

/// `srun --ntasks 2` on a real single-host Slurm starts two `ferry train mf` processes that find
/// their ranks in `SLURM_PROCID`/`SLURM_NTASKS` and form one cluster; rank 0 reports; checkpoints
/// written by 2 tasks resume under 3 (`--overcommit`: more tasks than the node's 2 CPUs).
#[test]
fn train_runs_under_slurm() {
    if !available("slurmctld", "FERRY_SLURM") || !available("slurmd", "FERRY_SLURM") {
        return;
    }
    let is_root = String::from_utf8_lossy(&Command::new("id").arg("-u").output().unwrap().stdout).trim() == "0";
    if !is_root {
        assert!(std::env::var("FERRY_SLURM").is_ok_and(|v| v == "0"), "slurmd must run as root for this test: run it as root, or set FERRY_SLURM=0 to skip it");
        eprintln!("FERRY_SLURM=0: not root, and this test was NOT run");
        return;
    }
    let slurm = Slurm::start();
    let secret = secret_file("slurm");
    let srun = |tasks: usize, args: &[&str]| {
        let mut srun = slurm
            .command("srun")
            .args(["--overcommit", "--ntasks", &tasks.to_string(), "env", &format!("FERRY_COORDINATOR=127.0.0.1:{}", free_port())])
            .arg(format!("FERRY_SECRET_FILE={}", secret.display()))
            .arg(binary("ferry"))
            .args(["train", "mf", "--data", "synth-tiny", "--rank", "4"])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("running srun");
        let started = std::time::Instant::now();
        while srun.try_wait().unwrap().is_none() {
            if started.elapsed() > std::time::Duration::from_secs(120) {
                let _ = srun.kill();
                panic!("srun did not finish within 120 s");
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let out = srun.wait_with_output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string());
        assert!(out.status.success(), "srun failed:\n{stdout}\n{stderr}");
        let reports: Vec<serde_json::Value> = stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
        (reports, stdout, stderr)
    };
    let (reports, stdout, stderr) = srun(2, &["--epochs", "3", "--json"]);
    assert_eq!(reports.len(), 3, "one report per epoch, from rank 0 only:\n{stdout}");
    assert!(reports.iter().all(|r| r["mode"] == "localize"), "{stdout}");
    assert!(stderr.contains("localize mode on 2 nodes started by slurm"), "{stderr}");
    // Checkpoints written by 2 tasks resume under 3.
    let checkpoints = std::env::temp_dir().join(format!("ferry-slurm-checkpoints-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&checkpoints);
    let dir = checkpoints.to_str().unwrap();
    srun(2, &["--epochs", "2", "--checkpoint-every", "1", "--checkpoint-dir", dir]);
    let (resumed, stdout, stderr) = srun(3, &["--epochs", "4", "--json", "--checkpoint-every", "1", "--checkpoint-dir", dir, "--resume", dir]);
    assert_eq!(resumed.iter().map(|r| r["epoch"].as_u64().unwrap()).collect::<Vec<_>>(), [3, 4], "resumed after epoch 2:\n{stdout}");
    assert!(stderr.contains("localize mode on 3 nodes started by slurm"), "{stderr}");
    let _ = std::fs::remove_dir_all(&checkpoints);
}
