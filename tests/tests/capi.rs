//! The C ABI from a real C++ program: the matrix-factorization example in
//! `capi/examples/mf` is built with CMake against `capi/include/ferry.h` and the `ferry-capi`
//! shared library, and runs as a 2-process cluster under `ferry launch`.

use std::process::Command;
use std::time::Duration;

use ferry_tests::{bin_dir, binary};

#[test]
fn the_cpp_example_trains_on_a_two_process_cluster() {
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../capi/examples/mf");
    // Cargo builds the library, with its cdylib, as a dependency of these tests.
    let lib_dir = bin_dir().join("deps");
    assert!(lib_dir.join("libferry_capi.so").exists(), "libferry_capi.so is missing from {}", lib_dir.display());
    let build = std::env::temp_dir().join(format!("ferry-capi-example-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&build);
    let run = |command: &mut Command, what: &str| {
        let out = command.output().unwrap_or_else(|e| panic!("{what}: {e} (scripts/setup installs cmake and a C++ compiler)"));
        assert!(out.status.success(), "{what} failed:\n{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        out
    };
    run(Command::new("cmake").arg("-S").arg(&source).arg("-B").arg(&build).arg(format!("-DFERRY_LIB_DIR={}", lib_dir.display())), "cmake (configure)");
    run(Command::new("cmake").arg("--build").arg(&build), "cmake --build");
    let out = Command::new(binary("ferry"))
        .args(["launch", "-n", "2", "--timeout", &Duration::from_secs(120).as_secs().to_string(), "--"])
        .arg(build.join("ferry-mf-example"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the example failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("[0] capi-mf ok"), "{stdout}");
    assert!(stdout.contains("[1] capi-mf rank 1:") && stdout.contains("remote key accesses"), "{stdout}");
    let _ = std::fs::remove_dir_all(&build);
}
