//! Trained models out: every table of a model saved as a NumPy `.npy` matrix (one row per key,
//! `float32`, C order) with a TSV of ids → rows beside it, and a `model.json` that says which
//! task made it and with which settings, the run and epoch, and every file's size and checksum (XXH3-128, as in checkpoints).
//! [`save`] replaces the directory as a whole, so a crash leaves the old model or the new one;
//! [`load`] reads such a directory back (for predictions) and refuses a damaged or mixed one,
//! naming the file.
//!
//! The `.npy` files are written and read here rather than through a crate: the only maintained
//! one brings a Python-literal parser and 15 crates along, for a header of one line. Reading
//! accepts what this module writes and any 2-D little-endian `float32` C-order array numpy
//! writes (format versions 1 to 3).

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};

/// One table of a model: `ids.len()` rows of `cols` values.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedTable {
    /// File stem and name in `model.json` (`users`, `entities`, …).
    pub name: String,
    /// Values per row.
    pub cols: usize,
    /// The rows, one after the other.
    pub data: Vec<f32>,
    /// The name of each row's key in the training data (user, item, entity, word, …).
    pub ids: Vec<String>,
}

impl SavedTable {
    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }

    /// Row numbers by id.
    pub fn index(&self) -> HashMap<&str, usize> {
        self.ids.iter().enumerate().map(|(i, id)| (id.as_str(), i)).collect()
    }
}

/// A saved model.
#[derive(Debug, Clone)]
pub struct Model {
    /// `mf`, `kge`, `w2v` or `lr`.
    pub task: String,
    /// The task's settings and scalars (e.g. MF's global mean).
    pub meta: Value,
    /// The tables.
    pub tables: Vec<SavedTable>,
    /// The epoch after which it was saved (models saved before checksums: unknown).
    pub epoch: Option<u64>,
    /// The training run that saved it ([`run_id`]).
    pub run_id: Option<String>,
}

impl Model {
    /// The table named `name`.
    pub fn table(&self, name: &str) -> Result<&SavedTable> {
        self.tables.iter().find(|t| t.name == name).with_context(|| format!("the model has no table '{name}'"))
    }

    /// A number from the model's settings.
    pub fn number(&self, key: &str) -> Result<f64> {
        self.meta.get(key).and_then(Value::as_f64).with_context(|| format!("model.json has no number '{key}'"))
    }
}

/// Reads the model in `dir` for a question to a `task` model (`what` names that kind of model
/// in the error when `dir` holds another).
pub fn load_task(dir: &Path, task: &str, what: &str) -> Result<Model> {
    let model = load(dir)?;
    if model.task != task {
        bail!("{} holds a {} model, not {what}", dir.display(), model.task);
    }
    Ok(model)
}

/// What `model.json` says the format is; a model without it predates checksums and is read
/// without them.
pub(super) const FORMAT: &str = "ferry-model/2";

/// The id of this process's training run, in every model it saves: models of the same run
/// have the same id, so a directory of one run's model is never taken for another's.
pub fn run_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        format!("{:016x}", nanos ^ (u64::from(std::process::id()) << 40))
    })
}

/// Writes `tables` (the model after `epoch`) as the directory `dir`: `NAME.npy`, `NAME.tsv`
/// (`id<TAB>row` lines) and `model.json`, which lists every file with its size and checksum
/// beside the run id and epoch.
///
/// A save replaces `dir` as a whole: the new model is written and fsynced in `DIR.partial`, then
/// `dir` is renamed to `DIR.previous`, `DIR.partial` to `dir`, and `DIR.previous` removed. A
/// crash at any point leaves a whole model, the old or the new one: before the swap `dir` is
/// untouched, between its two renames [`load`] reads `DIR.previous`, and the next save cleans
/// up what was left. `dir` must not exist, be empty or hold a saved model: anything else is
/// not replaced.
pub fn save(dir: &Path, task: &str, epoch: usize, meta: Value, tables: &[SavedTable]) -> Result<()> {
    Saving::default().save(dir, task, epoch, meta, tables)
}

/// The sibling directories of a save: where the new model is written, and where the old one
/// waits while they are swapped.
fn siblings(dir: &Path) -> Result<(std::path::PathBuf, std::path::PathBuf)> {
    let absolute = std::path::absolute(dir).with_context(|| format!("resolving {}", dir.display()))?;
    let name = absolute.file_name().with_context(|| format!("{} names no directory a model can be saved as", dir.display()))?;
    let with = |suffix: &str| {
        let mut n = name.to_os_string();
        n.push(suffix);
        absolute.with_file_name(n)
    };
    Ok((with(".partial"), with(".previous")))
}

/// One save, counting its durable steps: a test stops it after any of them, as a crash would.
#[derive(Default)]
struct Saving {
    /// Stop (with an error) once this many steps are done.
    stop_after: Option<usize>,
    done: usize,
}

impl Saving {
    fn step(&mut self) -> Result<()> {
        self.done += 1;
        if self.stop_after.is_some_and(|n| self.done >= n) {
            bail!("stopped after step {} (a crash, for a test)", self.done);
        }
        Ok(())
    }

    fn save(&mut self, dir: &Path, task: &str, epoch: usize, meta: Value, tables: &[SavedTable]) -> Result<()> {
        let (partial, previous) = siblings(dir)?;
        recover(dir, &previous)?;
        if partial.exists() {
            std::fs::remove_dir_all(&partial).with_context(|| format!("removing {}, left by an interrupted save", partial.display()))?;
        }
        if dir.exists() && !dir.join("model.json").exists() && std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?.next().is_some() {
            bail!("{} exists and holds no saved model; a save replaces its directory as a whole, so it is not saved there", dir.display());
        }
        std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
        let mut files = Vec::new();
        let mut listed = Vec::new();
        for t in tables {
            ensure!(t.data.len() == t.ids.len() * t.cols, "table {} holds {} values for {} rows of {}", t.name, t.data.len(), t.ids.len(), t.cols);
            files.push(write_durably(&partial, &format!("{}.npy", t.name), |out| write_npy(out, t.ids.len(), t.cols, &t.data))?);
            self.step()?;
            files.push(write_ids(&partial, &t.name, &t.ids)?);
            self.step()?;
            listed.push(json!({ "name": t.name, "rows": t.ids.len(), "cols": t.cols }));
        }
        let description = json!({ "format": FORMAT, "task": task, "run_id": run_id(), "epoch": epoch, "meta": meta, "tables": listed, "files": files });
        write_durably(&partial, "model.json", |out| serde_json::to_writer_pretty(out, &description).map_err(std::io::Error::other))?;
        sync_dir(&partial)?;
        self.step()?;
        if dir.exists() {
            rename(dir, &previous)?;
            self.step()?;
        }
        rename(&partial, dir)?;
        sync_dir(previous.parent().unwrap_or(Path::new(".")))?;
        self.step()?;
        if previous.exists() {
            std::fs::remove_dir_all(&previous).with_context(|| format!("removing the previous model {}", previous.display()))?;
        }
        Ok(())
    }
}

/// Finishes what an interrupted save left: a model whose swap stopped between its renames is
/// put back (`dir` missing, `previous` whole), and one whose swap completed loses the old copy.
fn recover(dir: &Path, previous: &Path) -> Result<()> {
    if !previous.exists() {
        return Ok(());
    }
    if dir.exists() {
        std::fs::remove_dir_all(previous).with_context(|| format!("removing {}, left by an interrupted save", previous.display()))
    } else {
        rename(previous, dir)
    }
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).with_context(|| format!("renaming {} to {}", from.display(), to.display()))
}

pub(super) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("syncing directory {}", dir.display()))
}

/// Writes `dir/name` and fsyncs it; returns its entry for `model.json` (name, size, checksum).
pub(super) fn write_durably(dir: &Path, name: &str, body: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<Value> {
    let (bytes, checksum) = ferry::write_file_durably(dir, name, body)?;
    Ok(json!({ "name": name, "bytes": bytes, "checksum": checksum }))
}

/// The directory a model in `dir` is read from: `dir`, or the previous model a save was
/// swapping out when it stopped.
fn readable(dir: &Path) -> std::path::PathBuf {
    match siblings(dir) {
        Ok((_, previous)) if !dir.join("model.json").exists() && previous.join("model.json").exists() => previous,
        _ => dir.to_path_buf(),
    }
}

/// Reads file `name` of the model in `dir`, checked against its entry in `model.json`.
fn read_checked(dir: &Path, name: &str, files: Option<&Vec<Value>>) -> Result<Vec<u8>> {
    let path = dir.join(name);
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let Some(files) = files else { return Ok(bytes) };
    let entry = files.iter().find(|f| f["name"] == name).with_context(|| format!("{}: model.json does not list it", path.display()))?;
    let (want_bytes, want_hash) = (entry["bytes"].as_u64(), entry["checksum"].as_str());
    ensure!(
        want_bytes == Some(bytes.len() as u64),
        "{}: {} bytes where model.json says {:?} (damaged, or from another save)",
        path.display(),
        bytes.len(),
        want_bytes
    );
    ensure!(
        want_hash == Some(ferry::file_checksum(&bytes).as_str()),
        "{}: its checksum differs from model.json's (damaged, or from another save)",
        path.display()
    );
    Ok(bytes)
}

/// Reads a model that [`save`] wrote, checking every file against `model.json`; or the model a
/// training checkpoint holds (`--checkpoint-dir D` writes `D/epoch-E/model.json` beside the
/// checkpoint's files, see [`super::checkpoint_model`]).
pub fn load(dir: &Path) -> Result<Model> {
    let dir = &readable(dir);
    let path = dir.join("model.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {} (is {} a saved model?)", path.display(), dir.display()))?;
    let description: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let task = description["task"].as_str().with_context(|| format!("{} names no task", path.display()))?.to_string();
    let files = match description.get("format").and_then(Value::as_str) {
        Some(FORMAT) => Some(description["files"].as_array().with_context(|| format!("{} lists no files", path.display()))?),
        Some(other) => bail!("{}: format '{other}' is not one this version reads ({FORMAT})", path.display()),
        None => None,
    };
    let from_checkpoint = match description.get("storage").and_then(Value::as_str) {
        None | Some("npy") => false,
        Some(super::checkpoint_model::STORAGE) => true,
        Some(other) => bail!("{}: storage '{other}' is not one this version reads", path.display()),
    };
    let checkpoint = if from_checkpoint { Some(super::checkpoint_model::values(dir, &description)?) } else { None };
    let mut tables = Vec::new();
    for entry in description["tables"].as_array().with_context(|| format!("{} lists no tables", path.display()))? {
        let name = entry["name"].as_str().with_context(|| format!("{}: a table without a name", path.display()))?.to_string();
        let (rows, cols, data, ids) = match &checkpoint {
            Some(values) => super::checkpoint_model::table(dir, entry, values)?,
            None => {
                let npy = dir.join(format!("{name}.npy"));
                let (rows, cols, data) = read_npy(&read_checked(dir, &format!("{name}.npy"), files)?).with_context(|| npy.display().to_string())?;
                (rows, cols, data, None)
            }
        };
        let ids = match ids {
            Some(ids) => ids,
            None => read_ids(dir, &name, rows, files)?,
        };
        tables.push(SavedTable { name, cols, data, ids });
    }
    Ok(Model {
        task,
        meta: description["meta"].clone(),
        tables,
        epoch: description["epoch"].as_u64(),
        run_id: description["run_id"].as_str().map(str::to_string),
    })
}

/// The ids of the `rows` rows of table `name`, from `NAME.tsv` (`id<TAB>row` lines), each row
/// named exactly once.
fn read_ids(dir: &Path, name: &str, rows: usize, files: Option<&Vec<Value>>) -> Result<Vec<String>> {
    let tsv = dir.join(format!("{name}.tsv"));
    let mut ids = vec![None; rows];
    let text = String::from_utf8(read_checked(dir, &format!("{name}.tsv"), files)?).with_context(|| format!("{} is not UTF-8", tsv.display()))?;
    for (n, line) in text.lines().enumerate() {
        let at = || format!("{}:{}", tsv.display(), n + 1);
        let (id, row) = line.rsplit_once('\t').with_context(|| format!("{}: expected 'id<TAB>row'", at()))?;
        let row: usize = row.parse().with_context(|| format!("{}: '{row}' is not a row number", at()))?;
        let slot = ids.get_mut(row).with_context(|| format!("{}: row {row} is beyond the {rows} rows of table {name}", at()))?;
        ensure!(slot.is_none(), "{}: row {row} is named twice", at());
        *slot = Some(id.to_string());
    }
    ids.into_iter().enumerate().map(|(r, id)| id.with_context(|| format!("{}: row {r} has no id", tsv.display()))).collect()
}

/// Writes `NAME.tsv` of `ids` (`id<TAB>row` lines) into `dir`, durably; returns its entry for
/// `model.json`.
pub(super) fn write_ids(dir: &Path, name: &str, ids: &[String]) -> Result<Value> {
    write_durably(dir, &format!("{name}.tsv"), |out| {
        for (row, id) in ids.iter().enumerate() {
            writeln!(out, "{id}\t{row}")?;
        }
        Ok(())
    })
}

/// Text formats a saved model can be exported to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    /// One `NAME.tsv` per table: `id<TAB>value<TAB>value…` per row (spreadsheets, pandas).
    Tsv,
    /// A saved model's directory as `--save` writes it (`NAME.npy`, which NumPy's `np.load`
    /// reads, `NAME.tsv` ids and `model.json`), of every table or of one: how a training
    /// checkpoint becomes a directory of `.npy` files.
    Npy,
    /// The word2vec text format of one table (`rows dim`, then `id value value…` per row), which
    /// gensim's `KeyedVectors.load_word2vec_format` reads; ids must not contain spaces.
    Word2vec,
}

/// Writes `model` in `format` under `out` (a directory for `tsv`, a file for `word2vec`, whose
/// table is `table`, else the first one); returns the files written.
pub fn export(model: &Model, format: ExportFormat, out: &Path, table: Option<&str>) -> Result<Vec<std::path::PathBuf>> {
    match format {
        ExportFormat::Tsv => {
            std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
            let mut written = Vec::new();
            for t in model.tables.iter().filter(|t| table.is_none_or(|name| name == t.name)) {
                let path = out.join(format!("{}.tsv", t.name));
                write_atomically(&path, |w| write_rows(w, t, '\t'))?;
                written.push(path);
            }
            ensure!(!written.is_empty(), "the model has no table '{}'", table.unwrap_or_default());
            Ok(written)
        }
        ExportFormat::Npy => {
            let tables: Vec<SavedTable> = model.tables.iter().filter(|t| table.is_none_or(|name| name == t.name)).cloned().collect();
            ensure!(!tables.is_empty(), "the model has no table '{}'", table.unwrap_or_default());
            let epoch = model.epoch.unwrap_or(0) as usize;
            save(out, &model.task, epoch, model.meta.clone(), &tables).with_context(|| format!("saving the model into {}", out.display()))?;
            Ok(tables.iter().flat_map(|t| [out.join(format!("{}.npy", t.name)), out.join(format!("{}.tsv", t.name))]).chain([out.join("model.json")]).collect())
        }
        ExportFormat::Word2vec => {
            let t = match table {
                Some(name) => model.table(name)?,
                None => model.tables.first().context("the model has no tables")?,
            };
            if let Some(bad) = t.ids.iter().find(|id| id.is_empty() || id.contains(char::is_whitespace)) {
                bail!("id '{bad}' of table {} is empty or contains whitespace, which the word2vec format cannot hold (export as tsv)", t.name);
            }
            write_atomically(out, |w| {
                writeln!(w, "{} {}", t.ids.len(), t.cols)?;
                write_rows(w, t, ' ')
            })?;
            Ok(vec![out.to_path_buf()])
        }
    }
}

/// Every row of `t` as a line: its id, then its values, each after `separator`.
fn write_rows(w: &mut impl Write, t: &SavedTable, separator: char) -> Result<()> {
    for (row, id) in t.ids.iter().enumerate() {
        write!(w, "{id}")?;
        for v in t.row(row) {
            write!(w, "{separator}{v}")?;
        }
        writeln!(w)?;
    }
    Ok(())
}

fn write_atomically(path: &Path, body: impl FnOnce(&mut std::io::BufWriter<std::fs::File>) -> Result<()>) -> Result<()> {
    let temporary = path.with_extension("partial");
    let file = std::fs::File::create(&temporary).with_context(|| format!("creating {}", temporary.display()))?;
    let mut out = std::io::BufWriter::new(file);
    body(&mut out).with_context(|| format!("writing {}", temporary.display()))?;
    let file = out.into_inner().map_err(|e| e.into_error()).with_context(|| format!("writing {}", temporary.display()))?;
    file.sync_all().with_context(|| format!("syncing {}", temporary.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("renaming {} to {}", temporary.display(), path.display()))
}

const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// Writes a `rows × cols` little-endian `float32` matrix in NPY format 1.0.
fn write_npy(out: &mut dyn Write, rows: usize, cols: usize, data: &[f32]) -> std::io::Result<()> {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // Magic (6), version (2) and length (2) before it; the data starts 64-byte aligned.
    let unpadded = NPY_MAGIC.len() + 4 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    out.write_all(NPY_MAGIC)?;
    out.write_all(&[1, 0])?;
    out.write_all(&(header.len() as u16).to_le_bytes())?;
    out.write_all(header.as_bytes())?;
    for chunk in data.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        out.write_all(&bytes)?;
    }
    Ok(())
}

/// Reads a 2-D little-endian `float32` C-order NPY array: (rows, cols, values).
fn read_npy(bytes: &[u8]) -> Result<(usize, usize, Vec<f32>)> {
    ensure!(bytes.len() >= 10 && bytes.starts_with(NPY_MAGIC), "not an NPY file");
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => bail!("NPY format version {v} is not supported"),
    };
    let header = bytes.get(start..start + header_len).context("the NPY header is cut short")?;
    let header = std::str::from_utf8(header).context("the NPY header is not text")?;
    let field = |key: &str| -> Result<&str> {
        let at = header.find(&format!("'{key}'")).with_context(|| format!("the NPY header has no '{key}'"))?;
        Ok(header[at + key.len() + 2..].trim_start().trim_start_matches(':').trim_start())
    };
    ensure!(field("descr")?.starts_with("'<f4'"), "only little-endian float32 arrays are supported ({header})");
    ensure!(field("fortran_order")?.starts_with("False"), "only C-order arrays are supported");
    let shape = field("shape")?;
    let inside = shape.strip_prefix('(').and_then(|s| s.split_once(')')).map(|(s, _)| s).context("the NPY shape is not a tuple")?;
    let dims: Vec<usize> =
        inside.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::parse).collect::<Result<_, _>>().context("the NPY shape is not numbers")?;
    let [rows, cols] = dims[..] else { bail!("expected a 2-D array, found shape ({inside})") };
    // Checked against the file before anything is sized by the shape: with at least one column,
    // the rows cannot outnumber the file's values.
    ensure!(cols > 0, "a table without columns (shape ({inside}))");
    let data = &bytes[start + header_len..];
    let need = rows.checked_mul(cols).and_then(|n| n.checked_mul(4));
    ensure!(
        need == Some(data.len()),
        "{rows} × {cols} float32 values need {} bytes, the file has {}",
        need.map_or("more than 2^64".to_string(), |n| n.to_string()),
        data.len()
    );
    Ok((rows, cols, data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(what: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ferry-model-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn tables(scale: f32) -> Vec<SavedTable> {
        let users = SavedTable { name: "users".into(), cols: 3, data: (0..6).map(|v| v as f32 * scale).collect(), ids: vec!["ann".into(), "bob smith".into()] };
        let items = SavedTable { name: "items".into(), cols: 3, data: vec![scale; 3], ids: vec!["Apollo 13".into()] };
        vec![users, items]
    }

    fn error(dir: &Path) -> String {
        format!("{:#}", load(dir).unwrap_err())
    }

    #[test]
    fn models_round_trip_and_damaged_files_are_refused_by_name() {
        let root = scratch("round-trip");
        let dir = root.join("model");
        let [users, items] = <[SavedTable; 2]>::try_from(tables(0.5)).unwrap();
        save(&dir, "mf", 7, json!({ "mu": 3.5 }), &[users.clone(), items.clone()]).unwrap();
        let model = load(&dir).unwrap();
        assert_eq!((model.task.as_str(), model.number("mu").unwrap(), model.epoch), ("mf", 3.5, Some(7)));
        assert_eq!(model.run_id.as_deref(), Some(run_id()));
        assert_eq!(model.table("users").unwrap(), &users);
        assert_eq!(model.table("users").unwrap().index()["bob smith"], 1);
        let npy = std::fs::read(dir.join("users.npy")).unwrap();
        assert_eq!((npy.len() - 6 * 4) % 64, 0, "the data starts 64-byte aligned");
        assert!(String::from_utf8_lossy(&npy[10..]).starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"));
        // A flipped byte, a cut file, a missing file, another save's file, a broken manifest:
        // each refused, naming the file.
        let mut flipped = npy.clone();
        *flipped.last_mut().unwrap() ^= 1;
        std::fs::write(dir.join("users.npy"), &flipped).unwrap();
        let e = error(&dir);
        assert!(e.contains("users.npy") && e.contains("checksum"), "{e}");
        std::fs::write(dir.join("users.npy"), &npy).unwrap();
        let tsv = std::fs::read(dir.join("items.tsv")).unwrap();
        std::fs::write(dir.join("items.tsv"), &tsv[..tsv.len() - 1]).unwrap();
        let e = error(&dir);
        assert!(e.contains("items.tsv") && e.contains("bytes"), "{e}");
        std::fs::remove_file(dir.join("items.tsv")).unwrap();
        assert!(error(&dir).contains("items.tsv"));
        std::fs::write(dir.join("items.tsv"), &tsv).unwrap();
        load(&dir).unwrap();
        let other = root.join("other");
        save(&other, "mf", 8, json!({ "mu": 3.5 }), &tables(0.25)).unwrap();
        std::fs::copy(other.join("items.npy"), dir.join("items.npy")).unwrap();
        assert!(error(&dir).contains("items.npy"), "a file of another save is not taken");
        let manifest = std::fs::read_to_string(dir.join("model.json")).unwrap();
        std::fs::write(dir.join("model.json"), &manifest[..manifest.len() / 2]).unwrap();
        assert!(error(&dir).contains("model.json"));
        std::fs::write(dir.join("model.json"), manifest.replace(FORMAT, "ferry-model/9")).unwrap();
        assert!(error(&dir).contains("ferry-model/9"));
        assert!(load(&root.join("nowhere")).unwrap_err().to_string().contains("saved model"));
        // A model saved before checksums (no format, no file list) is still read.
        let old = root.join("old");
        save(&old, "mf", 1, json!({ "mu": 3.5 }), std::slice::from_ref(&users)).unwrap();
        std::fs::write(old.join("model.json"), r#"{"task": "mf", "meta": {"mu": 3.5}, "tables": [{"name": "users", "rows": 2, "cols": 3}]}"#).unwrap();
        assert_eq!(load(&old).unwrap().table("users").unwrap(), &users);
        // A directory that holds something else is not replaced.
        let busy = root.join("busy");
        std::fs::create_dir_all(&busy).unwrap();
        std::fs::write(busy.join("notes.txt"), "mine").unwrap();
        let e = format!("{:#}", save(&busy, "mf", 1, json!({}), &tables(1.0)).unwrap_err());
        assert!(e.contains("holds no saved model"), "{e}");
        assert_eq!(std::fs::read_to_string(busy.join("notes.txt")).unwrap(), "mine");
        // Exports of a model read back from disk.
        save(&dir, "mf", 9, json!({ "mu": 3.5 }), std::slice::from_ref(&users)).unwrap();
        let model = load(&dir).unwrap();
        let files = export(&model, ExportFormat::Tsv, &root.join("text"), None).unwrap();
        assert_eq!(std::fs::read_to_string(&files[0]).unwrap(), "ann\t0\t0.5\t1\nbob smith\t1.5\t2\t2.5\n");
        let e = export(&model, ExportFormat::Word2vec, &root.join("w2v.txt"), None).unwrap_err();
        assert!(e.to_string().contains("'bob smith'"), "{e}");
        let words = SavedTable { name: "words".into(), cols: 2, data: vec![1.0, 2.0], ids: vec!["king".into()] };
        save(&dir, "w2v", 1, json!({}), &[words]).unwrap();
        export(&load(&dir).unwrap(), ExportFormat::Word2vec, &root.join("w2v.txt"), Some("words")).unwrap();
        assert_eq!(std::fs::read_to_string(root.join("w2v.txt")).unwrap(), "1 2\nking 1 2\n");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_save_stopped_at_any_step_leaves_the_old_model_or_the_new_one() {
        let root = scratch("crash");
        let dir = root.join("model");
        let (old, new) = (tables(1.0), tables(2.0));
        let mut stopped_somewhere = 0;
        for stop in 1.. {
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            save(&dir, "mf", 1, json!({}), &old).unwrap();
            let finished = Saving { stop_after: Some(stop), done: 0 }.save(&dir, "mf", 2, json!({}), &new).is_ok();
            let model = load(&dir).unwrap_or_else(|e| panic!("stopped after step {stop}: {e:#}"));
            let whole = (model.epoch == Some(1) && model.tables == old) || (model.epoch == Some(2) && model.tables == new);
            assert!(whole, "stopped after step {stop}: epoch {:?} with tables {:?}", model.epoch, model.tables);
            // The next save cleans up and succeeds.
            save(&dir, "mf", 3, json!({}), &tables(3.0)).unwrap();
            assert_eq!(load(&dir).unwrap().epoch, Some(3));
            let left: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name()).collect();
            assert_eq!(left, ["model"], "stopped after step {stop}");
            if finished {
                break;
            }
            stopped_somewhere += 1;
        }
        // Two files per table, the manifest, each of the swap's two renames.
        assert_eq!(stopped_somewhere, 7);
        // A first save stopped at any step leaves no model that loads as one.
        for stop in 1..=6 {
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            assert!(Saving { stop_after: Some(stop), done: 0 }.save(&dir, "mf", 2, json!({}), &new).is_err());
            match load(&dir) {
                Ok(model) => assert_eq!(model.tables, new, "stopped after step {stop}"),
                Err(e) => assert!(format!("{e:#}").contains("saved model"), "{e:#}"),
            }
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn crafted_npy_shapes_are_refused_before_anything_is_allocated() {
        for (shape, want) in
            [("(4611686018427387904, 1)", "more than 2^64"), ("(1000000000000000, 0)", "without columns"), ("(1000000000000000, 1)", "the file has 0")]
        {
            let header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}\n");
            let mut crafted = NPY_MAGIC.to_vec();
            crafted.extend([1, 0]);
            crafted.extend((header.len() as u16).to_le_bytes());
            crafted.extend(header.as_bytes());
            let e = format!("{:#}", read_npy(&crafted).unwrap_err());
            assert!(e.contains(want), "{shape}: {e}");
        }
        assert!(read_npy(b"garbage").is_err());
    }
}
