//! Ferry's benchmarks and ML workloads, shared by the `ferry-bench` binary and the `ferry`
//! command (`ferry data fetch`, `ferry demo`, `ferry train`).

pub mod checkpoint;
pub mod cluster;
pub mod data;
mod dynamic;
pub mod failover;
mod leave;
pub mod micro;
pub mod partition;
pub mod rawtcp;
pub mod relocate;
pub mod replicate;
pub mod report;
mod stages;
pub mod train;

/// The `main` of Ferry's command-line programs: an error prints as one line with its causes
/// (`PROGRAM: error: what failed: why`), never with a backtrace whatever `RUST_BACKTRACE` says,
/// and the exit status is 1.
pub fn exit_status(program: &str, outcome: anyhow::Result<()>) -> std::process::ExitCode {
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
