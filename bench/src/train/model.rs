//! Trained models out: every table of a model saved as a NumPy `.npy` matrix (one row per key,
//! `float32`, C order) with a TSV of ids → rows beside it, and a `model.json` that says which
//! task made it and with which settings. [`load`] reads such a directory back (for predictions).
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
    /// `mf`, `kge` or `w2v`.
    pub task: String,
    /// The task's settings and scalars (e.g. MF's global mean).
    pub meta: Value,
    /// The tables.
    pub tables: Vec<SavedTable>,
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

/// Writes `tables` into `dir` (created if needed): `NAME.npy`, `NAME.tsv` (`id<TAB>row` lines)
/// and `model.json`. Files are written under temporary names and renamed, so that a directory
/// never holds half a model.
pub fn save(dir: &Path, task: &str, meta: Value, tables: &[SavedTable]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut listed = Vec::new();
    for t in tables {
        ensure!(t.data.len() == t.ids.len() * t.cols, "table {} holds {} values for {} rows of {}", t.name, t.data.len(), t.ids.len(), t.cols);
        write_atomically(&dir.join(format!("{}.npy", t.name)), |out| write_npy(out, t.ids.len(), t.cols, &t.data))?;
        write_atomically(&dir.join(format!("{}.tsv", t.name)), |out| {
            for (row, id) in t.ids.iter().enumerate() {
                writeln!(out, "{id}\t{row}")?;
            }
            Ok(())
        })?;
        listed.push(json!({ "name": t.name, "rows": t.ids.len(), "cols": t.cols }));
    }
    let description = json!({ "task": task, "meta": meta, "tables": listed });
    write_atomically(&dir.join("model.json"), |out| Ok(serde_json::to_writer_pretty(out, &description)?))
}

/// Reads a model that [`save`] wrote.
pub fn load(dir: &Path) -> Result<Model> {
    let path = dir.join("model.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {} (is {} a saved model?)", path.display(), dir.display()))?;
    let description: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let task = description["task"].as_str().with_context(|| format!("{} names no task", path.display()))?.to_string();
    let mut tables = Vec::new();
    for entry in description["tables"].as_array().with_context(|| format!("{} lists no tables", path.display()))? {
        let name = entry["name"].as_str().with_context(|| format!("{}: a table without a name", path.display()))?.to_string();
        let npy = dir.join(format!("{name}.npy"));
        let (rows, cols, data) =
            read_npy(&std::fs::read(&npy).with_context(|| format!("reading {}", npy.display()))?).with_context(|| npy.display().to_string())?;
        let tsv = dir.join(format!("{name}.tsv"));
        let mut ids = vec![None; rows];
        for (n, line) in std::fs::read_to_string(&tsv).with_context(|| format!("reading {}", tsv.display()))?.lines().enumerate() {
            let at = || format!("{}:{}", tsv.display(), n + 1);
            let (id, row) = line.rsplit_once('\t').with_context(|| format!("{}: expected 'id<TAB>row'", at()))?;
            let row: usize = row.parse().with_context(|| format!("{}: '{row}' is not a row number", at()))?;
            let slot = ids.get_mut(row).with_context(|| format!("{}: row {row} is beyond the {rows} rows of {name}.npy", at()))?;
            ensure!(slot.is_none(), "{}: row {row} is named twice", at());
            *slot = Some(id.to_string());
        }
        let ids = ids.into_iter().enumerate().map(|(r, id)| id.with_context(|| format!("{}: row {r} has no id", tsv.display()))).collect::<Result<Vec<_>>>()?;
        tables.push(SavedTable { name, cols, data, ids });
    }
    Ok(Model { task, meta: description["meta"].clone(), tables })
}

/// Text formats a saved model can be exported to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    /// One `NAME.tsv` per table: `id<TAB>value<TAB>value…` per row (spreadsheets, pandas).
    Tsv,
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
    out.flush().with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("renaming {} to {}", temporary.display(), path.display()))
}

const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// Writes a `rows × cols` little-endian `float32` matrix in NPY format 1.0.
fn write_npy(out: &mut impl Write, rows: usize, cols: usize, data: &[f32]) -> Result<()> {
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

    #[test]
    fn models_round_trip_and_broken_files_are_errors() {
        let dir = std::env::temp_dir().join(format!("ferry-model-{}", std::process::id()));
        let users = SavedTable { name: "users".into(), cols: 3, data: (0..6).map(|v| v as f32 * 0.5).collect(), ids: vec!["ann".into(), "bob smith".into()] };
        let items = SavedTable { name: "items".into(), cols: 3, data: vec![1.0; 3], ids: vec!["Apollo 13".into()] };
        save(&dir, "mf", json!({ "mu": 3.5 }), &[users.clone(), items]).unwrap();
        let model = load(&dir).unwrap();
        assert_eq!((model.task.as_str(), model.number("mu").unwrap()), ("mf", 3.5));
        assert_eq!(model.table("users").unwrap(), &users);
        assert_eq!(model.table("users").unwrap().index()["bob smith"], 1);
        let npy = std::fs::read(dir.join("users.npy")).unwrap();
        assert_eq!((npy.len() - 6 * 4) % 64, 0, "the data starts 64-byte aligned");
        assert!(String::from_utf8_lossy(&npy[10..]).starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"));
        std::fs::write(dir.join("users.npy"), &npy[..npy.len() - 1]).unwrap();
        assert!(format!("{:#}", load(&dir).unwrap_err()).contains("need 24 bytes"));
        std::fs::write(dir.join("users.npy"), b"garbage").unwrap();
        assert!(load(&dir).is_err());
        // Crafted shapes are refused before anything is allocated for them.
        for (shape, want) in
            [("(4611686018427387904, 1)", "more than 2^64"), ("(1000000000000000, 0)", "without columns"), ("(1000000000000000, 1)", "the file has 0")]
        {
            let header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}\n");
            let mut crafted = NPY_MAGIC.to_vec();
            crafted.extend([1, 0]);
            crafted.extend((header.len() as u16).to_le_bytes());
            crafted.extend(header.as_bytes());
            std::fs::write(dir.join("users.npy"), &crafted).unwrap();
            let e = format!("{:#}", load(&dir).unwrap_err());
            assert!(e.contains(want), "{shape}: {e}");
        }
        assert!(load(&dir.join("nowhere")).unwrap_err().to_string().contains("saved model"));
        // Exports of a model read back from disk.
        save(&dir, "mf", json!({ "mu": 3.5 }), std::slice::from_ref(&users)).unwrap();
        let model = load(&dir).unwrap();
        let files = export(&model, ExportFormat::Tsv, &dir.join("text"), None).unwrap();
        assert_eq!(std::fs::read_to_string(&files[0]).unwrap(), "ann\t0\t0.5\t1\nbob smith\t1.5\t2\t2.5\n");
        let e = export(&model, ExportFormat::Word2vec, &dir.join("w2v.txt"), None).unwrap_err();
        assert!(e.to_string().contains("'bob smith'"), "{e}");
        let words = SavedTable { name: "words".into(), cols: 2, data: vec![1.0, 2.0], ids: vec!["king".into()] };
        save(&dir, "w2v", json!({}), &[words]).unwrap();
        export(&load(&dir).unwrap(), ExportFormat::Word2vec, &dir.join("w2v.txt"), Some("words")).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("w2v.txt")).unwrap(), "1 2\nking 1 2\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
