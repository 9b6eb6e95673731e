//! Helpers for Ferry's integration tests.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

/// The directory holding the workspace's binaries (next to the test executable's `deps/`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent().and_then(|d| d.parent()).expect("target directory").to_path_buf()
}

/// Path of a workspace binary, checked to exist.
pub fn binary(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(path.exists(), "{} is missing: build the workspace first (cargo test --workspace builds it)", path.display());
    path
}

/// Runs `ferry launch -n nodes -- ferry-testnode args…` and returns its output.
pub fn launch_testnode(nodes: usize, args: &[&str], timeout: Duration) -> Output {
    let output = Command::new(binary("ferry"))
        .args(["launch", "-n", &nodes.to_string(), "--timeout", &timeout.as_secs().to_string(), "--"])
        .arg(binary("ferry-testnode"))
        .args(args)
        .output()
        .expect("running ferry launch");
    eprintln!("--- stdout\n{}\n--- stderr\n{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    output
}

/// Finalizes every node of an in-process cluster at once (each finalize waits in a barrier for
/// the others) and panics if any fails.
pub fn finalize_all(nodes: Vec<ferry::Node>) {
    std::thread::scope(|s| {
        for mut n in nodes {
            s.spawn(move || n.finalize().unwrap());
        }
    });
}

/// A fresh, empty directory for a test, named after `what` and this process (whatever an
/// earlier run left there is removed).
pub fn scratch_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-test-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// Every node of `cluster` writes its part of a checkpoint into `dir`, all at once (each
/// node's call returns once its files are durable); panics on any error.
pub fn checkpoint_all(cluster: &[ferry::Node], dir: &std::path::Path) {
    std::thread::scope(|s| {
        let handles: Vec<_> = cluster.iter().map(|node| s.spawn(|| node.checkpoint(dir))).collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
    });
}
