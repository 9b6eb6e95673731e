//! The Python bindings (`python/`, PyO3 built with maturin) on a 2-process cluster: their pytest
//! suite and the matrix-factorization example, both started with `ferry launch`. Needs python3
//! with venv and pip (to install maturin, NumPy and pytest into a throwaway environment under
//! the target directory); `FERRY_PYTHON=0` skips the test, saying so.

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
    let python = venv.join("bin/python");
    if !venv.join("bin/maturin").exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv), "creating a virtual environment (python3 -m venv)");
        run(Command::new(&python).args(["-m", "pip", "install", "-q", "maturin>=1.5,<2", "numpy", "pytest"]), "pip install maturin numpy pytest");
    }
    let path = format!("{}:{}", venv.join("bin").display(), std::env::var("PATH").unwrap_or_default());
    run(
        Command::new(venv.join("bin/maturin"))
            .args(["develop", "--locked", "-q", "--manifest-path"])
            .arg(source.join("Cargo.toml"))
            .env("VIRTUAL_ENV", &venv)
            .env("PATH", &path)
            .env("CARGO_TARGET_DIR", target.join("python")),
        "maturin develop",
    );
    let launch = |args: &[&str]| {
        let mut c = Command::new(binary("ferry"));
        c.args(["launch", "-n", "2", "--timeout", "120", "--"]).arg(&python).args(args).current_dir(&source);
        c
    };
    let tests = run(&mut launch(&["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]), "pytest on 2 processes");
    for rank in 0..2 {
        assert!(tests.lines().any(|l| l.starts_with(&format!("[{rank}]")) && l.contains("8 passed")), "rank {rank} did not pass all eight tests:\n{tests}");
    }
    let example = run(&mut launch(&["examples/mf.py"]), "the Python example on 2 processes");
    assert!(example.contains("[0] python-mf ok"), "{example}");
}
