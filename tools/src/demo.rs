//! `ferry demo`: a 2-node local cluster trains matrix factorization on MovieLens-100k with
//! dynamic allocation, then one epoch on a classic parameter server for contrast.

use anyhow::Result;
use clap::Parser;
use ferry_bench::train::{self, EpochReport, Mode, TrainCommand};

#[derive(Parser)]
struct Wrapper {
    #[command(subcommand)]
    command: TrainCommand,
}

fn command(data: &str, mode: &str, epochs: usize) -> TrainCommand {
    let args = ["ferry", "mf", "--data", data, "--mode", mode, "--epochs", &epochs.to_string(), "--nodes", "2", "--rank", "20"];
    Wrapper::parse_from(args).command
}

fn summary(mode: Mode, reports: &[EpochReport]) -> String {
    let last = reports.last();
    let rmse = last.and_then(|r| r.headline()).map_or("-".into(), |(_, v)| format!("{v:.4}"));
    let mean = reports.iter().map(|r| r.epoch_s).sum::<f64>() / reports.len().max(1) as f64;
    let local = reports.iter().map(|r| r.local_share).sum::<f64>() / reports.len().max(1) as f64;
    let messages: u64 = reports.iter().map(|r| r.messages).sum::<u64>() / reports.len().max(1) as u64;
    format!("{:>9} {:>7} {:>10} {:>14.4} {:>12.2}% {:>16}", mode.name(), reports.len(), rmse, mean, local * 100.0, messages)
}

/// Runs the demo.
pub fn run() -> Result<()> {
    let data = match ferry_bench::data::fetch("ml-100k") {
        Ok(_) => "ml-100k",
        Err(e) => {
            eprintln!("MovieLens-100k is not available ({e:#}).\nThe demo continues on synthetic data (synth-small) instead.\n");
            "synth-small"
        }
    };
    println!("Ferry demo: matrix factorization on {data}, 2 nodes on this machine\n");
    println!("-- dynamic parameter allocation (localize): rows stay with their node, column blocks move to whoever trains them");
    let localize_run = command(data, "localize", 10);
    let localize = train::run_mode(&localize_run, common(&localize_run), Mode::Localize)?;
    println!("\n-- classic parameter server (relocation off): every key stays at its home node");
    let classic_run = command(data, "classic", 1);
    let classic = train::run_mode(&classic_run, common(&classic_run), Mode::Classic)?;
    println!("\n{:>9} {:>7} {:>10} {:>14} {:>13} {:>16}", "mode", "epochs", "test RMSE", "epoch time [s]", "local access", "messages/epoch");
    println!("{}", summary(Mode::Localize, &localize));
    println!("{}", summary(Mode::Classic, &classic));
    let mean = |r: &[EpochReport]| r.iter().map(|e| e.epoch_s).sum::<f64>() / r.len().max(1) as f64;
    println!(
        "\nA localize epoch took {:.0}x less time than a classic one: with localize, each node trains on parameters it holds.",
        mean(&classic) / mean(&localize)
    );
    Ok(())
}

fn common(c: &TrainCommand) -> &train::Common {
    c.common()
}
