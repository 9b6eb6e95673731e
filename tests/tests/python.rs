//! The Python bindings (`python/`, PyO3 built with maturin) as a user gets them: one abi3 wheel
//! (`maturin build --release`), installed with pip into a fresh virtual environment, runs the
//! pytest suite and the matrix-factorization example on a 2-process cluster started with `ferry
//! launch`. Needs python3 with venv and pip (maturin goes into a throwaway environment under the
//! target directory; the wheel's environment is made anew each run, with NumPy and pytest);
//! `FERRY_PYTHON=0` skips the test, saying so.

use std::path::Path;
use std::process::Command;

use ferry_tests::{bin_dir, binary};

fn run(command: &mut Command, what: &str) -> String {
    let out = command.env("PYTHONDONTWRITEBYTECODE", "1").output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{stderr}");
    stdout
}

#[test]
fn python_bindings_on_a_two_process_cluster() {
    if std::env::var("FERRY_PYTHON").is_ok_and(|v| v == "0") {
        eprintln!("FERRY_PYTHON=0: the Python bindings were NOT tested");
        return;
    }
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python");
    let target = bin_dir().parent().expect("the target directory").to_path_buf();
    let venv = target.join("pyenv");
    if !venv.join("bin/maturin").exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv), "creating a virtual environment (python3 -m venv)");
        run(Command::new(venv.join("bin/python")).args(["-m", "pip", "install", "-q", "maturin>=1.5,<2"]), "pip install maturin");
    }
    let path = format!("{}:{}", venv.join("bin").display(), std::env::var("PATH").unwrap_or_default());
    let wheels = target.join("wheels");
    let _ = std::fs::remove_dir_all(&wheels);
    run(
        Command::new(venv.join("bin/maturin"))
            .args(["build", "--release", "--locked", "-q", "--manifest-path"])
            .arg(source.join("Cargo.toml"))
            .arg("-o")
            .arg(&wheels)
            .env("PATH", &path)
            .env("CARGO_TARGET_DIR", target.join("python")),
        "maturin build",
    );
    let wheel: Vec<_> = std::fs::read_dir(&wheels).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "whl")).collect();
    let [wheel] = &wheel[..] else { panic!("maturin built {} wheels: {wheel:?}", wheel.len()) };
    let name = wheel.file_name().unwrap().to_string_lossy();
    assert!(name.contains("-cp39-abi3-"), "one wheel for every CPython from 3.9: {name}");
    // A fresh environment, as a user's: the wheel and what the tests need, nothing else.
    let users = target.join("pyenv-wheel");
    let _ = std::fs::remove_dir_all(&users);
    run(Command::new("python3").args(["-m", "venv"]).arg(&users), "creating the wheel's environment");
    let python = users.join("bin/python");
    run(Command::new(&python).args(["-m", "pip", "install", "-q"]).arg(wheel).arg("pytest"), "pip install the wheel");
    let stub =
        run(Command::new(&python).args(["-c", "import ferry, os; d = os.path.dirname(ferry.__file__); print(sorted(os.listdir(d)))"]), "listing the package");
    assert!(stub.contains("_native.pyi") && stub.contains("py.typed"), "type stubs and py.typed installed: {stub}");
    let launch = |args: &[&str]| {
        let mut c = Command::new(binary("ferry"));
        c.args(["launch", "-n", "2", "--timeout", "120", "--"]).arg(&python).args(args).current_dir(&source);
        c
    };
    let tests = run(&mut launch(&["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]), "pytest on 2 processes");
    for rank in 0..2 {
        assert!(tests.lines().any(|l| l.starts_with(&format!("[{rank}]")) && l.contains("12 passed")), "rank {rank} did not pass all twelve tests:\n{tests}");
    }
    let example = run(&mut launch(&["examples/mf.py"]), "the Python example on 2 processes");
    assert!(example.contains("[0] python-mf ok"), "{example}");
    // The binding's benchmark runs (its figures are PERFORMANCE.md's).
    let bench = run(Command::new(&python).arg(source.join("benchmarks/pull.py")).arg("--quick"), "the pull benchmark");
    assert!(bench.contains("pull of 10000 rows x 64 on 1 node(s): Rust"), "{bench}");
    with_torch(&source, &target, wheel);
}

/// The wheel with PyTorch: installed into an environment that sees a CPU torch (Debian's
/// `python3-torch` for `/usr/bin/python3`, which `scripts/setup` installs; `FERRY_TORCH_PYTHON`
/// names another interpreter), it runs the tensor and `ferry.torch` tests on 2 processes, and
/// the PyTorch example under `ferry launch` and under torchrun reaches the quality of
/// `torch.nn.Embedding(sparse=True)` in one process (the times are printed, not held to
/// anything: that is `docs/PERFORMANCE.md`'s business). `FERRY_TORCH=0` skips it, saying so.
fn with_torch(source: &Path, target: &Path, wheel: &Path) {
    if std::env::var("FERRY_TORCH").is_ok_and(|v| v == "0") {
        eprintln!("FERRY_TORCH=0: Ferry with PyTorch was NOT tested");
        return;
    }
    let interpreter = std::env::var("FERRY_TORCH_PYTHON").unwrap_or_else(|_| "/usr/bin/python3".into());
    let found = Command::new(&interpreter).args(["-c", "import torch"]).output().is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{interpreter} cannot import torch: run scripts/setup (as root; it installs python3-torch), name another interpreter in FERRY_TORCH_PYTHON, or set FERRY_TORCH=0 to skip this part"
    );
    let env = target.join("pyenv-torch");
    let _ = std::fs::remove_dir_all(&env);
    run(Command::new(&interpreter).args(["-m", "venv", "--system-site-packages"]).arg(&env), "creating the torch environment");
    let python = env.join("bin/python");
    run(Command::new(&python).args(["-m", "pip", "install", "-q"]).arg(wheel).arg("pytest"), "pip install the wheel beside torch");
    let command = |program: &Path| {
        let mut c = Command::new(program);
        c.current_dir(source);
        c
    };
    let launch = |args: &[&str]| {
        let mut c = command(&binary("ferry"));
        c.args(["launch", "-n", "2", "--timeout", "300", "--"]).arg(&python).args(args);
        c
    };
    let tests = run(&mut launch(&["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_torch.py"]), "the torch tests on 2 processes");
    for rank in 0..2 {
        assert!(
            tests.lines().any(|l| l.starts_with(&format!("[{rank}]")) && l.contains("5 passed")),
            "rank {rank} did not pass the five torch tests:\n{tests}"
        );
    }
    let baseline = run(command(&python).args(["examples/torch_mf.py", "--baseline"]), "the torch example's baseline");
    let launched = run(&mut launch(&["examples/torch_mf.py"]), "the torch example under ferry launch");
    // torchrun itself (torch.distributed.run): `--redirects 1 --tee 1` because torch 1.13's
    // parser turns the default "0" into nothing on Python 3.11 (an IntFlag's zero member is
    // not iterated there), and the launcher then fails before starting anybody.
    let secret = target.join("torch-secret");
    let _ = std::fs::remove_file(&secret);
    run(Command::new(binary("ferry")).args(["secret", "--out"]).arg(&secret), "ferry secret");
    let torchrun = run(
        command(&python)
            .args(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--redirects", "1", "--tee", "1", "examples/torch_mf.py"])
            .env("FERRY_SECRET_FILE", &secret),
        "the torch example under torchrun",
    );
    // "… rmse FIRST -> LAST, SECONDS s per epoch (median)" from each run's summary line.
    let summary = |out: &str, marker: &str| -> (f64, f64) {
        let line = out.lines().find(|l| l.contains(marker)).unwrap_or_else(|| panic!("no '{marker}' line in:\n{out}"));
        let after = line.split("-> ").nth(1).unwrap();
        let last: f64 = after.split(',').next().unwrap().trim().parse().unwrap();
        let seconds: f64 = after.split(", ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        (last, seconds)
    };
    let (alone, alone_s) = summary(&baseline, "torch-mf baseline:");
    for (out, how) in [(&launched, "ferry launch"), (&torchrun, "torchrun")] {
        assert!(out.contains("torch-mf ok"), "{how}:\n{out}");
        let (rmse, seconds) = summary(out, "torch-mf on 2 processes");
        eprintln!(
            "torch example under {how}: RMSE {rmse:.4}, {seconds:.3} s per epoch; torch.nn.Embedding(sparse=True) alone: RMSE {alone:.4}, {alone_s:.3} s ({:.2}x)",
            seconds / alone_s
        );
        assert!(rmse <= 1.05 * alone, "{how}: RMSE {rmse} against {alone} in one process");
    }
}
