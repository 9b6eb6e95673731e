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
    assert!(stub.contains("__init__.pyi") && stub.contains("py.typed"), "type stubs and py.typed installed: {stub}");
    let launch = |args: &[&str]| {
        let mut c = Command::new(binary("ferry"));
        c.args(["launch", "-n", "2", "--timeout", "120", "--"]).arg(&python).args(args).current_dir(&source);
        c
    };
    let tests = run(&mut launch(&["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]), "pytest on 2 processes");
    for rank in 0..2 {
        assert!(tests.lines().any(|l| l.starts_with(&format!("[{rank}]")) && l.contains("9 passed")), "rank {rank} did not pass all nine tests:\n{tests}");
    }
    let example = run(&mut launch(&["examples/mf.py"]), "the Python example on 2 processes");
    assert!(example.contains("[0] python-mf ok"), "{example}");
}
