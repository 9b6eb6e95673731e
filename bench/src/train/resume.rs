//! Checkpoints of a training run (`--checkpoint-every N --checkpoint-dir D`, `--resume D`): one
//! engine checkpoint per directory `D/epoch-E` (see the engine's `docs/CHECKPOINTS.md`), written
//! after epoch `E` by every node of the cluster (by the process itself in `single`). A resumed
//! run starts from the newest whole one, at the epoch after it, on any node count; the two
//! newest whole checkpoints are kept.

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

/// Before the checkpoint after `epoch`: removes what an earlier run may have left under its name
/// (a checkpoint of a run that went further, or one cut short), so that it can be written.
pub fn clear(dir: &Path, epoch: usize) -> Result<()> {
    let path = epoch_dir(dir, epoch);
    if path.exists() {
        std::fs::remove_dir_all(&path).with_context(|| format!("removing {}, left by an earlier run", path.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating checkpoint directory {}", dir.display()))
}

/// After the checkpoint after `epoch` is whole: removes the checkpoints older than the newest
/// whole one before it.
pub fn prune(dir: &Path, epoch: usize) -> Result<()> {
    let older: Vec<usize> = epochs(dir)?.into_iter().filter(|&e| e < epoch).collect();
    let keep = older.iter().rev().copied().find(|&e| ferry::checkpoint_nodes(epoch_dir(dir, e)).is_ok());
    for e in older.into_iter().filter(|&e| Some(e) != keep) {
        let path = epoch_dir(dir, e);
        std::fs::remove_dir_all(&path).with_context(|| format!("removing old checkpoint {}", path.display()))?;
    }
    Ok(())
}
