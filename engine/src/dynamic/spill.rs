//! Spill files: where the homes of a dynamic table that evicts write the ids they evict, with
//! their values, when [`crate::Config::spill_dir`] is set. An evicted id still reads as new
//! afterwards; the spill file is the archive of what the table learnt of it, which a checkpoint
//! includes ([`crate::CheckpointTable::spilled_ids`]) and a restore carries on.
//!
//! One file per table and node, `DIR/TABLE.node-R.spill`, appended as eviction rounds close
//! (little-endian): `FERRYSP1`, the values per id (u32), then one record per evicted id: the id
//! (u64) and its values (f32 each). An id evicted more than once has a record per eviction,
//! the latest last. A file cut short by a crash reads up to its last whole record.
//!
//! The protocol only queues the rows it frees (`Core::take_spilled`); the node's eviction
//! thread writes them here, so no step of the state machine does I/O.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A spill file's first bytes.
const MAGIC: &[u8; 8] = b"FERRYSP1";

/// Bytes before the first record.
const HEADER: usize = 12;

/// Rows of one table evicted together (a round closed at its home), or restored: the ids and
/// their values, id after id.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct SpilledRows {
    pub table: u16,
    pub ids: Vec<u64>,
    pub values: Vec<f32>,
}

/// A spill file, read whole ([`read_spill`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SpillFile {
    /// Values per id.
    pub value_len: usize,
    /// The evicted ids, in the order they were evicted (an id once per eviction).
    pub ids: Vec<u64>,
    /// Their values, id after id (`ids.len() × value_len`).
    pub values: Vec<f32>,
    /// Bytes after the last whole record (a write cut short by a crash), not read.
    pub torn_bytes: u64,
}

/// Reads the spill file at `path`.
pub fn read_spill(path: impl AsRef<Path>) -> Result<SpillFile> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::Checkpoint(format!("reading spill file {}: {e}", path.display())))?;
    parse(&bytes, path)
}

/// A spill file's `bytes` (`path` names it in errors).
pub(crate) fn parse(bytes: &[u8], path: &Path) -> Result<SpillFile> {
    let bad = |what: String| Error::Checkpoint(format!("{}: {what}", path.display()));
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err(bad("not a spill file of this version (it does not start with FERRYSP1)".into()));
    }
    let value_len = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")) as usize;
    let record = 8 + 4 * value_len;
    let body = &bytes[HEADER..];
    let whole = body.len() / record;
    let mut ids = Vec::with_capacity(whole);
    let mut values = Vec::with_capacity(whole * value_len);
    for r in body.chunks_exact(record) {
        ids.push(u64::from_le_bytes(r[..8].try_into().expect("8 bytes")));
        values.extend(r[8..].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))));
    }
    Ok(SpillFile { value_len, ids, values, torn_bytes: (body.len() % record) as u64 })
}

/// The spill file of table `table` at node `rank` under `dir`.
pub(crate) fn path(dir: &Path, table: &str, rank: usize) -> PathBuf {
    dir.join(format!("{table}.node-{rank}.spill"))
}

/// Whether `name` can name a table's spill file (no path separator, not a relative step).
pub(crate) fn name_fits(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0'])
}

/// One table's open spill file.
struct Open {
    path: PathBuf,
    value_len: usize,
    out: BufWriter<std::fs::File>,
    /// Bytes written to it (buffered ones included).
    bytes: u64,
}

/// A node's spill files, one per table that evicts: [`Spiller::append`] writes the rows the
/// protocol freed, [`Spiller::sync`] makes them durable.
pub(crate) struct Spiller {
    tables: Vec<Option<Open>>,
}

impl Spiller {
    /// Opens node `rank`'s spill files under `dir` for the tables that evict (`evicting[t]`:
    /// table `t`'s name and values per id, `None` for a table that does not evict), starting
    /// each anew: a file already there (of an earlier run) is renamed to `NAME.previous-N` with
    /// the first free `N`, never overwritten. `seed` rows (a restored checkpoint's spilled ids
    /// homed here) are written first.
    pub fn open(dir: &Path, rank: usize, evicting: &[Option<(&str, usize)>], seed: Vec<SpilledRows>) -> Result<Spiller> {
        let failed = |what: &str, path: &Path, e: std::io::Error| Error::Checkpoint(format!("{what} {}: {e}", path.display()));
        std::fs::create_dir_all(dir).map_err(|e| failed("creating the spill directory", dir, e))?;
        let mut tables = Vec::with_capacity(evicting.len());
        for table in evicting {
            let Some((name, value_len)) = *table else {
                tables.push(None);
                continue;
            };
            let path = path(dir, name, rank);
            if path.exists() {
                let aside = (1u32..).map(|n| path.with_extension(format!("spill.previous-{n}"))).find(|p| !p.exists()).expect("a free name");
                std::fs::rename(&path, &aside).map_err(|e| failed("moving aside the earlier spill file", &path, e))?;
                tracing::info!(node = rank, from = %path.display(), to = %aside.display(), "an earlier spill file moved aside");
            }
            let file = std::fs::OpenOptions::new().create_new(true).write(true).open(&path).map_err(|e| failed("creating spill file", &path, e))?;
            let mut out = BufWriter::new(file);
            out.write_all(MAGIC).and_then(|()| out.write_all(&(value_len as u32).to_le_bytes())).map_err(|e| failed("writing", &path, e))?;
            tables.push(Some(Open { path, value_len, out, bytes: HEADER as u64 }));
        }
        let mut spiller = Spiller { tables };
        for rows in seed {
            spiller.append(rows.table, &rows.ids, &rows.values)?;
        }
        spiller.sync()?;
        Ok(spiller)
    }

    /// Appends evicted `ids` of `table` with their `values` (`value_len` each).
    pub fn append(&mut self, table: u16, ids: &[u64], values: &[f32]) -> Result<()> {
        let Some(open) = self.tables.get_mut(table as usize).and_then(Option::as_mut) else {
            return Err(Error::Checkpoint(format!("rows spilled for table {table}, which does not evict")));
        };
        if values.len() != ids.len() * open.value_len {
            return Err(Error::Checkpoint(format!("{} rows of {} values spilled with {} values", ids.len(), open.value_len, values.len())));
        }
        let len = open.value_len;
        let written = ids.iter().enumerate().try_for_each(|(i, id)| {
            open.out.write_all(&id.to_le_bytes())?;
            values[i * len..(i + 1) * len].iter().try_for_each(|v| open.out.write_all(&v.to_le_bytes()))
        });
        written.map_err(|e| Error::Checkpoint(format!("writing spill file {}: {e}", open.path.display())))?;
        open.bytes += (ids.len() * (8 + 4 * len)) as u64;
        Ok(())
    }

    /// Hands what is buffered to the operating system (readable by others, not yet durable).
    pub fn flush(&mut self) -> Result<()> {
        for open in self.tables.iter_mut().flatten() {
            open.out.flush().map_err(|e| Error::Checkpoint(format!("writing spill file {}: {e}", open.path.display())))?;
        }
        Ok(())
    }

    /// Writes what is buffered and makes it durable; returns each file (table, path, bytes).
    pub fn sync(&mut self) -> Result<Vec<(u16, PathBuf, u64)>> {
        let mut files = Vec::new();
        for (table, open) in self.tables.iter_mut().enumerate() {
            let Some(open) = open else { continue };
            open.out
                .flush()
                .and_then(|()| open.out.get_ref().sync_data())
                .map_err(|e| Error::Checkpoint(format!("syncing spill file {}: {e}", open.path.display())))?;
            files.push((table as u16, open.path.clone(), open.bytes));
        }
        Ok(files)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferry-spill-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Rows appended come back in order; a file of an earlier run is moved aside, not lost;
    /// a torn last record is left out and counted; a file of another kind is refused.
    #[test]
    fn spilled_rows_read_back_and_nothing_is_overwritten() {
        let dir = scratch("rows");
        let specs = [None, Some(("emb", 2))];
        let mut spiller = Spiller::open(&dir, 3, &specs, vec![SpilledRows { table: 1, ids: vec![7], values: vec![0.5, -0.5] }]).unwrap();
        spiller.append(1, &[u64::MAX, 9], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        assert!(spiller.append(0, &[1], &[1.0]).is_err(), "a table that does not evict");
        assert!(spiller.append(1, &[1], &[1.0]).is_err(), "a row of the wrong length");
        let files = spiller.sync().unwrap();
        assert_eq!(files, vec![(1, path(&dir, "emb", 3), (HEADER + 3 * 16) as u64)]);
        let read = read_spill(path(&dir, "emb", 3)).unwrap();
        assert_eq!((read.value_len, read.ids.clone(), read.values.clone(), read.torn_bytes), (2, vec![7, u64::MAX, 9], vec![0.5, -0.5, 1.0, 2.0, 3.0, 4.0], 0));
        drop(spiller);
        // A second run's spiller moves the first file aside.
        let again = Spiller::open(&dir, 3, &specs, Vec::new()).unwrap();
        drop(again);
        assert_eq!(read_spill(dir.join("emb.node-3.spill.previous-1")).unwrap(), read);
        assert!(read_spill(path(&dir, "emb", 3)).unwrap().ids.is_empty());
        // A torn record, and bytes of something else.
        let mut bytes = std::fs::read(dir.join("emb.node-3.spill.previous-1")).unwrap();
        bytes.truncate(bytes.len() - 5);
        let torn = parse(&bytes, Path::new("torn")).unwrap();
        assert_eq!((torn.ids.len(), torn.torn_bytes), (2, 11));
        assert!(parse(b"FERRYCK1\0\0\0\0", Path::new("x")).is_err());
        assert!(parse(b"FERRY", Path::new("x")).is_err());
        assert!(!name_fits("a/b") && !name_fits("..") && name_fits("emb"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
