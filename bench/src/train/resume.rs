//! Checkpoints of a training run (`--checkpoint-every N --checkpoint-dir D`, `--resume D`): one
//! engine checkpoint per directory `D/epoch-E` (see the engine's `docs/CHECKPOINTS.md`), written
//! after epoch `E` by every node of the cluster (by the process itself in `single`). A resumed
//! run starts from the newest whole one, at the epoch after it, on any node count. Files are
//! written in the background while training goes on; the two newest whole checkpoints are kept.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The directory of the checkpoint after `epoch`.
pub fn epoch_dir(dir: &Path, epoch: usize) -> PathBuf {
    dir.join(format!("epoch-{epoch}"))
}

/// The epochs of the `epoch-E` directories in `dir`, ascending, whole or not.
fn epochs(dir: &Path) -> Result<Vec<usize>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading checkpoint directory {}", dir.display()))? {
        let name = entry.with_context(|| format!("reading checkpoint directory {}", dir.display()))?.file_name();
        if let Some(epoch) = name.to_str().and_then(|n| n.strip_prefix("epoch-")).and_then(|e| e.parse().ok()) {
            found.push(epoch);
        }
    }
    found.sort_unstable();
    Ok(found)
}

/// The newest whole checkpoint in `dir` (its epoch and directory); an error naming why when
/// there is none.
pub fn latest(dir: &Path) -> Result<(usize, PathBuf)> {
    let mut why = Vec::new();
    for epoch in epochs(dir)?.into_iter().rev() {
        let path = epoch_dir(dir, epoch);
        match ferry::checkpoint_nodes(&path) {
            Ok(_) => return Ok((epoch, path)),
            Err(e) => why.push(format!("epoch {epoch}: {e}")),
        }
    }
    if why.is_empty() {
        bail!("--resume {}: no checkpoint in it (directories epoch-N written with --checkpoint-dir)", dir.display());
    }
    bail!("--resume {}: no whole checkpoint in it ({})", dir.display(), why.join("; "))
}

/// Before the checkpoint after `epoch` (every earlier one finished writing): removes the
/// checkpoints at or after `epoch` (an earlier run's, which went further, or one cut short) and
/// those older than the newest whole one before it, so that with the new one two are kept.
pub fn prepare(dir: &Path, epoch: usize) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating checkpoint directory {}", dir.display()))?;
    let found = epochs(dir)?;
    let keep = found.iter().rev().copied().filter(|&e| e < epoch).find(|&e| ferry::checkpoint_nodes(epoch_dir(dir, e)).is_ok());
    remove_all_but(dir, found, keep.into_iter().collect())
}

/// After the run's last checkpoint finished writing: keeps the two newest whole checkpoints.
pub fn finish(dir: &Path) -> Result<()> {
    let found = epochs(dir)?;
    let keep: Vec<usize> = found.iter().rev().copied().filter(|&e| ferry::checkpoint_nodes(epoch_dir(dir, e)).is_ok()).take(2).collect();
    remove_all_but(dir, found, keep)
}

fn remove_all_but(dir: &Path, found: Vec<usize>, keep: Vec<usize>) -> Result<()> {
    for e in found.into_iter().filter(|e| !keep.contains(e)) {
        let path = epoch_dir(dir, e);
        std::fs::remove_dir_all(&path).with_context(|| format!("removing checkpoint {}", path.display()))?;
    }
    Ok(())
}
