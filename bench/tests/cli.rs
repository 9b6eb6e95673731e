//! `ferry-bench` as a user runs it: every benchmark the README names is a subcommand, and a
//! bad option is one line of error, not a panic. (Being an integration test of this package,
//! it also has `cargo test --workspace` build the `ferry-bench` binary that the workspace's
//! other tests run.)

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferry-bench")).args(args).output().expect("running ferry-bench")
}

#[test]
fn every_benchmark_is_a_subcommand_and_bad_options_are_one_line() {
    let help = String::from_utf8_lossy(&bench(&["--help"]).stdout).into_owned();
    for sub in ["micro", "fuzz", "train", "replicate", "relocate"] {
        assert!(help.lines().any(|l| l.trim_start().starts_with(sub)), "{sub} missing from:\n{help}");
        assert!(bench(&[sub, "--help"]).status.success(), "{sub} --help");
    }
    let out = bench(&["micro", "--repeat", "many"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("invalid value 'many'") && !stderr.contains("panicked"), "{stderr}");
}
