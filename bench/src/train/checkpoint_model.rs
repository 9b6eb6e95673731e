//! One format for models and checkpoints: a training checkpoint (`--checkpoint-dir D`, one
//! engine checkpoint per `D/epoch-E`) also holds a `model.json` and the tables' `NAME.tsv` ids,
//! written before the nodes' files, so that `--predict`, `--rank-tails` and `ferry export` read
//! a checkpoint as they read a model `--save` wrote. The `model.json` is the saved model's
//! (format, task, settings, run id, epoch, files with sizes and checksums) with `storage` set to
//! [`STORAGE`]: each table names the checkpoint table its rows come from (keys `0..rows`, the
//! leading `cols` values of each key) instead of a `.npy` file.
//!
//! A table whose source is dynamic (`--ids raw`) has no ids file: its rows are the ids the
//! checkpoint holds, named by their decimal ids (`"ids": "checkpoint"` in its entry), so an
//! export's id column is the table's key.
//!
//! A task says how its tables read as a model once ([`Description`]); `--save` and checkpoints
//! both use that.

use std::path::Path;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};

use super::model::{self, SavedTable};

/// `model.json`'s `storage` for a model whose values are the checkpoint beside it.
pub const STORAGE: &str = "ferry-checkpoint";

/// A table entry's `ids` when its rows are the ids of a dynamic table in the checkpoint.
const IDS_OF_CHECKPOINT: &str = "checkpoint";

/// How a task's model reads as a saved model.
pub struct Description<'a> {
    /// `mf`, `kge`, `w2v` or `lr`.
    pub task: &'static str,
    /// The task's settings and scalars (e.g. MF's global mean).
    pub meta: Value,
    /// The model's tables as saved.
    pub tables: Vec<Described<'a>>,
}

/// One table of a [`Description`]: rows `0..ids.len()` of one of the workload's tables, the
/// leading `cols` values of each.
pub struct Described<'a> {
    /// The saved table's name (`users`, `entities`, …).
    pub name: &'static str,
    /// The workload's table its rows come from (its position in the workload's model).
    pub source: usize,
    /// Values per row (a key's leading values: optimizer state kept beside them is left out).
    pub cols: usize,
    /// The name of each row's key in the training data.
    pub ids: &'a [String],
}

impl Description<'_> {
    /// Table `i` as saved, from all of its source table's values (`len` per key).
    pub fn saved(&self, i: usize, values: &[f32], len: usize) -> SavedTable {
        let t = &self.tables[i];
        let rows = values.len().min(t.ids.len() * len);
        let data = super::shared::leading_columns(&values[..rows], len, t.cols);
        SavedTable { name: t.name.to_string(), cols: t.cols, data, ids: t.ids.to_vec() }
    }

    /// Table `i` as saved from a dynamic table's rows (`len` values per id, the ids of the
    /// description in order): only those `held` says the table holds (ids it evicted or never
    /// admitted are not in it).
    pub fn saved_held(&self, i: usize, values: &[f32], len: usize, held: &[bool]) -> SavedTable {
        let t = &self.tables[i];
        let rows: Vec<usize> = (0..held.len().min(t.ids.len())).filter(|&r| held[r]).collect();
        let data = rows.iter().flat_map(|&r| values[r * len..r * len + t.cols].iter().copied()).collect();
        let ids = rows.iter().map(|&r| t.ids[r].clone()).collect();
        SavedTable { name: t.name.to_string(), cols: t.cols, data, ids }
    }

    /// Writes `model.json` and the ids beside the checkpoint after `epoch` in `dir` (before any
    /// node writes its files there, so that a whole checkpoint always has them): `sources` are
    /// the workload's tables in the checkpoint, `nodes` the node count writing it. A dynamic
    /// source's ids are the checkpoint's own.
    pub fn write_beside_checkpoint(&self, dir: &Path, epoch: usize, sources: &[ferry::TableSpec], nodes: usize) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut files = Vec::new();
        let mut listed = Vec::new();
        for t in &self.tables {
            let source = sources.get(t.source).with_context(|| format!("table {} comes from table {} of {}", t.name, t.source, sources.len()))?;
            if source.dynamic.is_some() {
                listed.push(json!({ "name": t.name, "cols": t.cols, "source": source.name, "ids": IDS_OF_CHECKPOINT }));
                continue;
            }
            files.push(model::write_ids(dir, t.name, t.ids)?);
            listed.push(json!({ "name": t.name, "rows": t.ids.len(), "cols": t.cols, "source": source.name }));
        }
        let description = json!({
            "format": model::FORMAT,
            "storage": STORAGE,
            "task": self.task,
            "run_id": model::run_id(),
            "epoch": epoch,
            "checkpoint_nodes": nodes,
            "meta": self.meta,
            "tables": listed,
            "files": files,
        });
        model::write_durably(dir, "model.json", |out| serde_json::to_writer_pretty(out, &description).map_err(std::io::Error::other))?;
        model::sync_dir(dir)
    }
}

/// The values of the checkpoint in `dir` that `description` (its `model.json`) describes,
/// checked to be whole and written by the node count it names.
pub(super) fn values(dir: &Path, description: &Value) -> Result<Vec<ferry::CheckpointTable>> {
    let nodes = ferry::checkpoint_nodes(dir).with_context(|| format!("{} describes a checkpoint", dir.join("model.json").display()))?;
    let described = description["checkpoint_nodes"].as_u64();
    ensure!(
        described == Some(nodes as u64),
        "{}: written for a checkpoint of {described:?} nodes, but the checkpoint beside it is of {nodes} (files of two checkpoints mixed up)",
        dir.join("model.json").display()
    );
    Ok(ferry::read_checkpoint(dir)?)
}

/// A table read from a checkpoint: rows, values per row, the values, and the rows' ids where
/// the checkpoint names them (a dynamic table's).
pub(super) type TableRows = (usize, usize, Vec<f32>, Option<Vec<String>>);

/// One table `entry` of a checkpoint's `model.json`: (rows, cols, values, ids), the leading
/// `cols` values of keys `0..rows` of the checkpoint table it names, checked to be there; for
/// a dynamic table, of every id it holds, with those ids (`None`: the ids are in the table's
/// ids file).
pub(super) fn table(dir: &Path, entry: &Value, values: &[ferry::CheckpointTable]) -> Result<TableRows> {
    let path = dir.join("model.json");
    let name = entry["name"].as_str().unwrap_or_default();
    let number = |field: &str| entry[field].as_u64().with_context(|| format!("{}: table {name} has no number '{field}'", path.display()));
    let source = entry["source"].as_str().with_context(|| format!("{}: table {name} names no checkpoint table", path.display()))?;
    let t = values
        .iter()
        .find(|t| t.name == source)
        .with_context(|| format!("{}: table {name} comes from '{source}', which the checkpoint has not", path.display()))?;
    let by_id = entry.get("ids").and_then(Value::as_str) == Some(IDS_OF_CHECKPOINT);
    ensure!(
        by_id == t.dynamic,
        "{}: table {name} reads '{source}' as {}dynamic, but it is {}",
        path.display(),
        if by_id { "" } else { "not " },
        if t.dynamic { "dynamic" } else { "not" }
    );
    let (rows, cols) = (if by_id { t.keys } else { number("rows")? }, number("cols")?);
    // Checked against the checkpoint's table before anything is sized by them.
    ensure!(
        rows <= t.keys && cols >= 1 && cols <= t.value_len as u64,
        "{}: table {name} has {rows} rows of {cols} values, but '{source}' holds {} keys of {}",
        path.display(),
        t.keys,
        t.value_len
    );
    let (rows, cols) = (rows as usize, cols as usize);
    let data = t.values.chunks_exact(t.value_len).take(rows).flat_map(|row| &row[..cols]).copied().collect();
    Ok((rows, cols, data, by_id.then(|| t.ids.iter().map(u64::to_string).collect())))
}
