//! Checkpoints (*Scaling Distributed Machine Learning with the Parameter Server*, OSDI 2014,
//! Sections 4.4 and 4.5: servers persist their state so that a job survives them).
//!
//! A checkpoint is a directory. Every node writes the values it owns — with their keys, so that
//! the files do not depend on how keys were partitioned — and their optimizer state into
//! `node-R.values`, then `node-R.manifest`: a text file with the checkpoint's identity (the
//! cluster's, the checkpoint's number, the node count), every table's settings and record count,
//! and the values file's size and SHA-256. Both are written under temporary names, fsynced and
//! renamed, the manifest last; a checkpoint is whole when every node's manifest is there and
//! they agree, and a restore refuses anything else, naming what is missing or wrong.
//!
//! A restore ([`crate::Config::restore_from`]) may run on another node count and another
//! partitioning: each node reads every node's file and loads the keys it is now home of (and
//! its replicas of replicated keys), and checks that every key it is home of was in exactly one
//! file.
//!
//! Values file (little-endian): `FERRYCK1`, the number of tables (u32); per table its id (u16),
//! words per key (u32: value, then state), record count (u64), the keys (u64 each) and then the
//! words (u32 each, f32 bits).

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::config::{Config, TableSpec};
use crate::error::{Error, Result};
use crate::partition::Partitioner;
use crate::store::{Residence, Store};

const MAGIC: &[u8; 8] = b"FERRYCK1";
const FORMAT_LINE: &str = "ferry-checkpoint 1";

/// What a node wrote for a checkpoint ([`crate::Node::checkpoint`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// The checkpoint's number in this cluster's run (1 for the first).
    pub sequence: u64,
    /// Keys this node wrote, over all tables.
    pub keys: u64,
    /// Bytes of this node's values file.
    pub bytes: u64,
}

/// The values and optimizer state of the keys of one table a node owns, at the cut.
pub(crate) struct TableCut {
    id: u16,
    words_per_key: usize,
    keys: Vec<u64>,
    words: Vec<u32>,
}

fn err(message: impl Into<String>) -> Error {
    Error::Checkpoint(message.into())
}

fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    err(format!("{what} {}: {e}", path.display()))
}

/// The keys of every table that `rank` (of `nodes`) owns, with their values and state. A
/// replicated key is written by its home only; a key on its way here is an error, as the cut
/// would miss it.
pub(crate) fn cut(store: &Store, specs: &[TableSpec], rank: usize, nodes: usize) -> Result<Vec<TableCut>> {
    let mut cuts = Vec::with_capacity(specs.len());
    for (id, spec) in specs.iter().enumerate() {
        let id = id as u16;
        let table = store.table(id);
        let words_per_key = table.value_len() + table.state_len();
        let partitioner = Partitioner::new(spec.keys, nodes, spec.partitioning);
        let mut cut = TableCut { id, words_per_key, keys: Vec::new(), words: Vec::new() };
        for key in 0..spec.keys {
            let guard = store.lock(id, key);
            match guard.residence() {
                Residence::Away => {}
                Residence::Arriving => {
                    return Err(err(format!(
                        "key {key} of table '{}' is on its way to node {rank}: take a checkpoint while no key relocates (after a barrier, with intents ended)",
                        spec.name
                    )));
                }
                Residence::Here(_) => {
                    if table.is_replicated(key) && partitioner.home(key) != rank {
                        continue;
                    }
                    let Some(slot) = guard.slot() else { continue };
                    cut.keys.push(key);
                    cut.words.extend(slot.all_words());
                }
            }
        }
        cuts.push(cut);
    }
    Ok(cuts)
}

/// A writer that hashes and counts what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `dir/name` through a temporary name, fsynced before the rename; returns the bytes
/// written and their SHA-256.
fn write_durably(dir: &Path, name: &str, body: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<(u64, String)> {
    let (path, partial) = (dir.join(name), dir.join(format!("{name}.partial")));
    let file = std::fs::File::create(&partial).map_err(|e| io("creating", &partial, e))?;
    let mut out = Hashing { inner: std::io::BufWriter::new(file), hash: Sha256::new(), bytes: 0 };
    body(&mut out).and_then(|()| out.flush()).map_err(|e| io("writing", &partial, e))?;
    let Hashing { inner, hash, bytes } = out;
    let file = inner.into_inner().map_err(|e| io("writing", &partial, e.into_error()))?;
    file.sync_all().map_err(|e| io("syncing", &partial, e))?;
    std::fs::rename(&partial, &path).map_err(|e| io("renaming into place", &path, e))?;
    Ok((bytes, hex(&hash.finalize())))
}

/// An id of the cluster that wrote a checkpoint: every node of one run has the same (its
/// settings and its coordinator), so that files of two runs are not taken for one checkpoint.
pub(crate) fn cluster_id(config: &Config) -> u64 {
    let text = format!("{}{}", config.fingerprint_text(), config.coordinator);
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

fn values_name(rank: usize) -> String {
    format!("node-{rank}.values")
}

fn manifest_name(rank: usize) -> String {
    format!("node-{rank}.manifest")
}

/// Writes node `config.rank`'s part of checkpoint number `sequence` into `dir`: its values
/// file, then its manifest.
pub(crate) fn write_node(dir: &Path, config: &Config, sequence: u64, cuts: &[TableCut]) -> Result<CheckpointInfo> {
    let rank = config.rank;
    std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
    let manifest = dir.join(manifest_name(rank));
    if manifest.exists() {
        return Err(err(format!("{} already holds a checkpoint ({} exists): each checkpoint needs a directory of its own", dir.display(), manifest.display())));
    }
    for spec in &config.tables {
        if spec.name.contains(['\t', '\n']) {
            return Err(err(format!("table name {:?} holds a tab or a newline, which the manifest cannot hold", spec.name)));
        }
    }
    let (bytes, sha256) = write_durably(dir, &values_name(rank), |out| {
        out.write_all(MAGIC)?;
        out.write_all(&(cuts.len() as u32).to_le_bytes())?;
        for cut in cuts {
            out.write_all(&cut.id.to_le_bytes())?;
            out.write_all(&(cut.words_per_key as u32).to_le_bytes())?;
            out.write_all(&(cut.keys.len() as u64).to_le_bytes())?;
            for chunk in cut.keys.chunks(1 << 14) {
                out.write_all(&chunk.iter().flat_map(|k| k.to_le_bytes()).collect::<Vec<u8>>())?;
            }
            for chunk in cut.words.chunks(1 << 15) {
                out.write_all(&chunk.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>())?;
            }
        }
        Ok(())
    })?;
    let mut text = format!(
        "{FORMAT_LINE}\ncluster\t{:016x}\nsequence\t{sequence}\nnodes\t{}\nfile\t{}\t{bytes}\t{sha256}\n",
        cluster_id(config),
        config.nodes,
        values_name(rank)
    );
    for (spec, cut) in config.tables.iter().zip(cuts) {
        text.push_str(&format!(
            "table\t{}\t{}\t{}\t{}\t{}\t{:?}\t{}\t{}\n",
            cut.id,
            cut.keys.len(),
            spec.keys,
            spec.value_len,
            spec.state_len(),
            spec.partitioning,
            spec.updater.describe(),
            spec.name
        ));
    }
    write_durably(dir, &manifest_name(rank), |out| out.write_all(text.as_bytes()))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io("syncing", dir, e))?;
    Ok(CheckpointInfo { dir: dir.to_path_buf(), sequence, keys: cuts.iter().map(|c| c.keys.len() as u64).sum(), bytes })
}

/// One node's manifest, parsed.
#[derive(Debug, PartialEq)]
struct Manifest {
    cluster: String,
    sequence: u64,
    nodes: usize,
    file: (String, u64, String),
    /// (id, records, keys, value_len, state_len, updater, name) per table.
    tables: Vec<(u16, u64, u64, usize, usize, String, String)>,
}

fn parse_manifest(path: &Path, text: &str) -> Result<Manifest> {
    let bad = |what: &str| err(format!("{}: {what}", path.display()));
    let mut lines = text.lines();
    if lines.next() != Some(FORMAT_LINE) {
        return Err(bad(&format!("not a checkpoint manifest of this version (its first line is not '{FORMAT_LINE}')")));
    }
    let mut m = Manifest { cluster: String::new(), sequence: 0, nodes: 0, file: Default::default(), tables: Vec::new() };
    let number = |field: &str, what: &str| field.parse::<u64>().map_err(|_| bad(&format!("{what} '{field}' is not a number")));
    for line in lines {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields[..] {
            ["cluster", id] => m.cluster = id.to_string(),
            ["sequence", n] => m.sequence = number(n, "sequence")?,
            ["nodes", n] => m.nodes = number(n, "nodes")? as usize,
            ["file", name, bytes, sha] => m.file = (name.to_string(), number(bytes, "bytes")?, sha.to_string()),
            ["table", id, records, keys, value_len, state_len, _partitioning, updater, name] => m.tables.push((
                u16::try_from(number(id, "table id")?).map_err(|_| bad("a table id beyond 65535"))?,
                number(records, "records")?,
                number(keys, "keys")?,
                number(value_len, "value_len")? as usize,
                number(state_len, "state_len")? as usize,
                updater.to_string(),
                name.to_string(),
            )),
            _ => return Err(bad(&format!("a line it cannot read: {line:?}"))),
        }
    }
    if m.nodes == 0 || m.file.0.is_empty() || m.cluster.is_empty() {
        return Err(bad("it is cut short (no node count, cluster or values file)"));
    }
    Ok(m)
}

/// The manifests of a whole checkpoint in `dir`, checked to belong together.
fn whole(dir: &Path) -> Result<Vec<Manifest>> {
    let read = |rank: usize| -> Result<Manifest> {
        let path = dir.join(manifest_name(rank));
        let text = std::fs::read_to_string(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                err(format!("{} is not a whole checkpoint: {} is missing (node {rank} did not finish writing)", dir.display(), path.display()))
            } else {
                io("reading", &path, e)
            }
        })?;
        parse_manifest(&path, &text)
    };
    let first = read(0)?;
    let nodes = first.nodes;
    if nodes > u16::MAX as usize {
        return Err(err(format!("{}: {nodes} nodes", dir.join(manifest_name(0)).display())));
    }
    let mut all = vec![first];
    for rank in 1..nodes {
        let m = read(rank)?;
        if (m.cluster.as_str(), m.sequence, m.nodes) != (all[0].cluster.as_str(), all[0].sequence, nodes) || !same_tables(&m, &all[0]) {
            return Err(err(format!(
                "{} is from another checkpoint than {} (cluster {} number {} of {} nodes, against cluster {} number {} of {nodes})",
                dir.join(manifest_name(rank)).display(),
                dir.join(manifest_name(0)).display(),
                m.cluster,
                m.sequence,
                m.nodes,
                all[0].cluster,
                all[0].sequence
            )));
        }
        all.push(m);
    }
    Ok(all)
}

/// Whether two nodes' manifests describe the same tables (record counts differ per node).
fn same_tables(a: &Manifest, b: &Manifest) -> bool {
    a.tables.len() == b.tables.len() && a.tables.iter().zip(&b.tables).all(|(x, y)| (x.0, x.2, x.3, x.4, &x.5, &x.6) == (y.0, y.2, y.3, y.4, &y.5, &y.6))
}

/// Checks that `dir` holds a whole checkpoint (every node's manifest, all of one checkpoint);
/// returns the node count that wrote it.
pub fn checkpoint_nodes(dir: impl AsRef<Path>) -> Result<usize> {
    Ok(whole(dir.as_ref())?.len())
}

/// The manifests of a whole checkpoint in `dir` that fits the tables `specs`.
fn manifests(dir: &Path, specs: &[TableSpec]) -> Result<Vec<Manifest>> {
    let all = whole(dir)?;
    // The tables must be the configuration's, in its order; partitioning may differ.
    let saved = &all[0].tables;
    if saved.len() != specs.len() {
        return Err(err(format!("the checkpoint in {} has {} table(s), this configuration {}", dir.display(), saved.len(), specs.len())));
    }
    for (spec, (_, _, keys, value_len, state_len, updater, name)) in specs.iter().zip(saved) {
        let mismatch = |setting: &str, theirs: String, ours: String| {
            err(format!("table '{}': the checkpoint's {setting} is {theirs}, this configuration's {ours}", spec.name))
        };
        if *name != spec.name {
            return Err(mismatch("name", format!("'{name}'"), format!("'{}'", spec.name)));
        }
        if *keys != spec.keys {
            return Err(mismatch("key count", keys.to_string(), spec.keys.to_string()));
        }
        if *value_len != spec.value_len {
            return Err(mismatch("value length", value_len.to_string(), spec.value_len.to_string()));
        }
        if *updater != spec.updater.describe() || *state_len != spec.state_len() {
            return Err(mismatch("updater", updater.clone(), spec.updater.describe()));
        }
    }
    Ok(all)
}

/// Reads and checks one node's values file against its manifest; returns its bytes.
fn values_file(dir: &Path, m: &Manifest) -> Result<Vec<u8>> {
    let (name, bytes, sha256) = &m.file;
    if name.contains(['/', '\\']) || name.starts_with('.') {
        return Err(err(format!("a manifest in {} names the values file {name:?}, which is not a file of the checkpoint", dir.display())));
    }
    let path = dir.join(name);
    let len = std::fs::metadata(&path).map_err(|e| io("reading", &path, e))?.len();
    if len != *bytes {
        return Err(err(format!("{}: {len} bytes where its manifest says {bytes} (damaged, or from another checkpoint)", path.display())));
    }
    let data = std::fs::read(&path).map_err(|e| io("reading", &path, e))?;
    if hex(&Sha256::digest(&data)) != *sha256 {
        return Err(err(format!("{}: its SHA-256 differs from its manifest's (damaged, or from another checkpoint)", path.display())));
    }
    Ok(data)
}

/// A little-endian reader over a checked buffer that never reads past its end.
struct Reader<'a> {
    data: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len()).ok_or_else(|| err(format!("{}: cut short", self.path.display())))?;
        let bytes = &self.data[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
}

/// Where the records of a checkpoint go as it is read: node `rank` of `nodes` takes the keys
/// it is home of (`apply` with `home` true) and those `also` names (replicas; `home` false).
struct Target<'a> {
    specs: &'a [TableSpec],
    rank: usize,
    nodes: usize,
    also: &'a dyn Fn(usize, u64) -> bool,
}

/// Reads the whole checkpoint in `dir` into `target`: every record it takes goes to
/// `apply(table, key, words, home)`. Checks that each of its home keys was in exactly one file.
fn read_into(dir: &Path, target: &Target<'_>, mut apply: impl FnMut(usize, u64, &[u32], bool) -> Result<()>) -> Result<u64> {
    let manifests = manifests(dir, target.specs)?;
    let (specs, rank) = (target.specs, target.rank);
    let partitioners: Vec<Partitioner> = specs.iter().map(|t| Partitioner::new(t.keys, target.nodes, t.partitioning)).collect();
    // Per table, which of the home keys were found (sized by the configuration, not the files).
    let mut found: Vec<Vec<bool>> = specs.iter().map(|t| vec![false; t.keys as usize]).collect();
    let mut loaded = 0u64;
    for m in &manifests {
        let data = values_file(dir, m)?;
        let path = dir.join(&m.file.0);
        let mut r = Reader { data: &data, at: 0, path: &path };
        if r.take(MAGIC.len())? != MAGIC {
            return Err(err(format!("{}: not a checkpoint values file", path.display())));
        }
        let tables = r.u32()? as usize;
        if tables != specs.len() {
            return Err(err(format!("{}: {tables} table(s) where the manifest lists {}", path.display(), specs.len())));
        }
        for _ in 0..tables {
            let id = r.u16()? as usize;
            let spec = specs.get(id).ok_or_else(|| err(format!("{}: table id {id} does not exist", path.display())))?;
            let words_per_key = r.u32()? as usize;
            if words_per_key != spec.value_len + spec.state_len() {
                return Err(err(format!(
                    "{}: table '{}' has {words_per_key} words per key, not {}",
                    path.display(),
                    spec.name,
                    spec.value_len + spec.state_len()
                )));
            }
            let count = r.u64()?;
            // Checked against the bytes left before anything is sized by it.
            let need = count.checked_mul(8 + 4 * words_per_key as u64).filter(|&n| n <= (data.len() - r.at) as u64);
            if need.is_none() {
                return Err(err(format!("{}: table '{}' claims {count} keys, more than the file holds", path.display(), spec.name)));
            }
            let keys = r.take(count as usize * 8)?;
            let words = r.take(count as usize * 4 * words_per_key)?;
            let mut row = vec![0u32; words_per_key];
            for (i, key) in keys.chunks_exact(8).enumerate() {
                let key = u64::from_le_bytes(key.try_into().expect("8 bytes"));
                if key >= spec.keys {
                    return Err(err(format!("{}: key {key} is outside table '{}' (keys 0..{})", path.display(), spec.name, spec.keys)));
                }
                let home = partitioners[id].home(key) == rank;
                if !home && !(target.also)(id, key) {
                    continue;
                }
                if home {
                    let seen = &mut found[id][key as usize];
                    if *seen {
                        return Err(err(format!("key {key} of table '{}' is in two nodes' files of {}", spec.name, dir.display())));
                    }
                    *seen = true;
                }
                for (w, b) in row.iter_mut().zip(words[i * 4 * words_per_key..(i + 1) * 4 * words_per_key].chunks_exact(4)) {
                    *w = u32::from_le_bytes(b.try_into().expect("4 bytes"));
                }
                apply(id, key, &row, home)?;
                loaded += u64::from(home);
            }
        }
        if r.at != data.len() {
            return Err(err(format!("{}: {} bytes after the last table", path.display(), data.len() - r.at)));
        }
    }
    for (id, spec) in specs.iter().enumerate() {
        if let Some(key) = partitioners[id].home_keys(rank).find(|&k| !found[id][k as usize]) {
            return Err(err(format!("key {key} of table '{}' is in no node's file of {}: the checkpoint is incomplete", spec.name, dir.display())));
        }
    }
    Ok(loaded)
}

/// Loads the checkpoint in `dir` into `store` (node `config.rank` of `config.nodes`, freshly
/// built): the keys this node is home of, and its replicas of replicated keys. Returns the keys
/// loaded.
pub(crate) fn restore(dir: &Path, store: &Store, config: &Config) -> Result<u64> {
    let also = |table: usize, key: u64| store.table(table as u16).is_replicated(key);
    let target = Target { specs: &config.tables, rank: config.rank, nodes: config.nodes, also: &also };
    read_into(dir, &target, |table, key, words, _| {
        let guard = store.lock(table as u16, key);
        let slot = guard
            .slot()
            .ok_or_else(|| err(format!("key {key} of table '{}' has no slot on node {} to restore into", config.tables[table].name, config.rank)))?;
        slot.write_all_words(words);
        Ok(())
    })
}

/// Writes dense tables held by one process (`values[t]`: every key's value of `specs[t]`, key
/// after key) as checkpoint number `sequence` of one node, in the format of
/// [`crate::Node::checkpoint`]: a cluster of any size restores from it, and
/// [`read_arrays_checkpoint`] reads it back. Tables whose updater keeps state get it zeroed.
pub fn write_arrays_checkpoint(dir: impl AsRef<Path>, specs: &[TableSpec], values: &[&[f32]], sequence: u64) -> Result<CheckpointInfo> {
    if specs.len() != values.len() {
        return Err(err(format!("{} tables but {} arrays of values", specs.len(), values.len())));
    }
    let mut cuts = Vec::with_capacity(specs.len());
    for (id, (spec, values)) in specs.iter().zip(values).enumerate() {
        if values.len() as u64 != spec.keys.saturating_mul(spec.value_len as u64) {
            return Err(err(format!("table '{}': {} values for {} keys of {}", spec.name, values.len(), spec.keys, spec.value_len)));
        }
        let (len, state) = (spec.value_len, spec.state_len());
        let mut words = Vec::with_capacity(spec.keys as usize * (len + state));
        for row in values.chunks_exact(len.max(1)).take(spec.keys as usize) {
            words.extend(row.iter().map(|v| v.to_bits()));
            words.extend(std::iter::repeat_n(0u32, state));
        }
        cuts.push(TableCut { id: id as u16, words_per_key: len + state, keys: (0..spec.keys).collect(), words });
    }
    write_node(dir.as_ref(), &Config::new(specs.to_vec()), sequence, &cuts)
}

/// Reads the whole checkpoint in `dir`, written by any node count, as dense tables for one
/// process: every key's value of `specs[t]`, key after key (optimizer state left out).
pub fn read_arrays_checkpoint(dir: impl AsRef<Path>, specs: &[TableSpec]) -> Result<Vec<Vec<f32>>> {
    let mut out: Vec<Vec<f32>> = specs.iter().map(|s| vec![0.0; (s.keys as usize).saturating_mul(s.value_len)]).collect();
    let target = Target { specs, rank: 0, nodes: 1, also: &|_, _| false };
    read_into(dir.as_ref(), &target, |table, key, words, _| {
        let len = specs[table].value_len;
        for (o, w) in out[table][key as usize * len..(key as usize + 1) * len].iter_mut().zip(words) {
            *o = f32::from_bits(*w);
        }
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_round_trip_and_foreign_text_is_refused() {
        let path = Path::new("node-0.manifest");
        let text = format!("{FORMAT_LINE}\ncluster\tab\nsequence\t2\nnodes\t3\nfile\tnode-0.values\t10\tff\ntable\t0\t5\t9\t4\t0\tRange\tadd\tmy table\n");
        let m = parse_manifest(path, &text).unwrap();
        assert_eq!((m.sequence, m.nodes, m.file.1), (2, 3, 10));
        assert_eq!(m.tables, [(0, 5, 9, 4, 0, "add".to_string(), "my table".to_string())]);
        for (broken, want) in [
            ("something else\n", "not a checkpoint manifest"),
            (&text.replace("sequence\t2", "sequence\tx"), "is not a number"),
            (&text.replace("nodes\t3\n", ""), "cut short"),
            (&format!("{text}extra line\n"), "cannot read"),
        ] {
            let e = parse_manifest(path, broken).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("node-0.manifest"), "{e}");
        }
    }
}
