//! The C ABI from a real C++ program, as a C++ project gets it: `capi/install` lays out the
//! header, the library, a CMake package and a pkg-config file under a prefix, and the
//! matrix-factorization example in `capi/examples/mf` is built against that install both with
//! CMake (`find_package(ferry CONFIG)`, the imported target `ferry::ferry`) and with
//! `pkg-config --cflags --libs ferry`; each build runs as a 2-process cluster under `ferry
//! launch`.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use ferry_tests::{bin_dir, binary, scratch_dir};

fn run(command: &mut Command, what: &str) -> Output {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e} (scripts/setup installs cmake, pkg-config and a C++ compiler)"));
    assert!(out.status.success(), "{what} failed:\n{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    out
}

/// Runs the example built at `program` on 2 processes (`library_path`: where the dynamic
/// linker finds the library, for a build without a run path) and checks that it trained.
fn trains(program: &Path, library_path: Option<&Path>, how: &str) {
    let mut launch = Command::new(binary("ferry"));
    launch.args(["launch", "-n", "2", "--timeout", &Duration::from_secs(120).as_secs().to_string(), "--"]).arg(program);
    if let Some(dir) = library_path {
        launch.env("LD_LIBRARY_PATH", dir);
    }
    let out = launch.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the example built with {how} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("[0] capi-mf ok"), "{how}: {stdout}");
    assert!(stdout.contains("[1] capi-mf rank 1:") && stdout.contains("remote key accesses"), "{how}: {stdout}");
    // Per-kind traffic and a latency distribution through the C functions: rank 1's users,
    // homed at rank 0 (range partitioning), were localized, so keys arrived and pulls went out.
    let by_kind = stdout.lines().find(|l| l.starts_with("[1] capi-mf rank 1: messages sent by kind:")).unwrap_or_else(|| panic!("{how}: {stdout}"));
    assert!(by_kind.contains(" access=") && by_kind.contains(" localize="), "{how}: {by_kind}");
    assert!(!by_kind.contains("keys relocated here, median 0.0 us") && !by_kind.contains("; 0 keys"), "{how}: {by_kind}");
}

#[test]
fn the_cpp_example_builds_against_the_installed_package_and_trains() {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../capi");
    // Cargo builds the library, with its cdylib, as a dependency of these tests.
    let lib_dir = bin_dir().join("deps");
    assert!(lib_dir.join("libferry_capi.so").exists(), "libferry_capi.so is missing from {}", lib_dir.display());
    let scratch = scratch_dir("capi");
    let prefix = scratch.join("prefix");
    run(Command::new(source.join("install")).arg(&prefix).arg(&lib_dir), "capi/install");
    for file in
        ["include/ferry.h", "lib/libferry_capi.so", "lib/cmake/ferry/ferryConfig.cmake", "lib/cmake/ferry/ferryConfigVersion.cmake", "lib/pkgconfig/ferry.pc"]
    {
        assert!(prefix.join(file).exists(), "capi/install left out {file}");
    }
    // CMake: find_package(ferry 0.1 CONFIG) through CMAKE_PREFIX_PATH.
    let example = source.join("examples/mf");
    let build = scratch.join("cmake");
    run(Command::new("cmake").arg("-S").arg(&example).arg("-B").arg(&build).arg(format!("-DCMAKE_PREFIX_PATH={}", prefix.display())), "cmake (configure)");
    run(Command::new("cmake").arg("--build").arg(&build), "cmake --build");
    trains(&build.join("ferry-mf-example"), None, "CMake");
    // A version the package is not is refused.
    let wrong = scratch.join("wrong");
    std::fs::create_dir_all(&wrong).unwrap();
    std::fs::write(wrong.join("CMakeLists.txt"), "cmake_minimum_required(VERSION 3.16)\nproject(wrong CXX)\nfind_package(ferry 7.0 CONFIG REQUIRED)\n")
        .unwrap();
    let refused = Command::new("cmake")
        .arg("-S")
        .arg(&wrong)
        .arg("-B")
        .arg(wrong.join("build"))
        .arg(format!("-DCMAKE_PREFIX_PATH={}", prefix.display()))
        .output()
        .unwrap();
    assert!(!refused.status.success(), "find_package(ferry 7.0) found version 0.1");
    // pkg-config: the flags it gives build the same program.
    let flags = run(Command::new("pkg-config").args(["--cflags", "--libs", "ferry"]).env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")), "pkg-config");
    let flags = String::from_utf8(flags.stdout).unwrap();
    assert!(flags.contains(&format!("-I{}", prefix.join("include").display())) && flags.contains("-lferry_capi"), "{flags}");
    let program = scratch.join("ferry-mf-pkg-config");
    run(
        Command::new("c++")
            .args(["-std=c++17", "-Wall", "-Wextra", "-Werror"])
            .arg(example.join("mf.cpp"))
            .args(flags.split_whitespace())
            .arg("-o")
            .arg(&program),
        "c++ with pkg-config's flags",
    );
    trains(&program, Some(&prefix.join("lib")), "pkg-config");
    let _ = std::fs::remove_dir_all(&scratch);
}
