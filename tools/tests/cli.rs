//! The `ferry` command line.

use std::process::Command;

fn ferry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
}

#[test]
fn info_reports_the_host() {
    let out = ferry().arg("info").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("memlock limit") && text.contains("transport auto picks"), "{text}");
}

#[test]
fn launch_passes_rank_environment_and_exit_status() {
    let out = ferry().args(["launch", "-n", "2", "--", "sh", "-c", "echo $FERRY_RANK/$FERRY_NODES"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[0] 0/2") && text.contains("[1] 1/2"), "{text}");
    let out = ferry().args(["launch", "-n", "2", "--", "false"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let out = ferry().args(["launch", "-n", "1", "--", "/no/such/program"]).output().unwrap();
    assert!(!out.status.success());
}
