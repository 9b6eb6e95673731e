//! Checkpoints (*Scaling Distributed Machine Learning with the Parameter Server*, OSDI 2014,
//! Sections 4.4 and 4.5: servers persist their state so that a job survives them).
//!
//! A checkpoint is a directory. Every node writes the values it owns — with their keys, so that
//! the files do not depend on how keys were partitioned — and their optimizer state into
//! `node-R.values`, then `node-R.manifest`: a text file with the checkpoint's identity (the
//! cluster's, the checkpoint's number, the node count), every table's settings and record count,
//! and the values file's size and checksum (XXH3-128). Both are written under temporary names, fsynced and
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
//!
//! Beside it, a node with dynamic tables may write their homes' admission state and copies of
//! its spill files (`beside`), listed in its manifest too.

use std::io::Write;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use crate::config::{Config, TableSpec};
use crate::dynamic::{AdmissionState, IdIndex};

mod beside;
use crate::error::{Error, Result};
use crate::partition::Partitioner;
use crate::store::{Residence, Store};
use crate::util::FastMap;
pub(crate) use beside::spilled_rows;
use beside::{admission_name, read_spills, restore_admission, spill_name, write_admission};

const MAGIC: &[u8; 8] = b"FERRYCK1";
const FORMAT_LINE: &str = "ferry-checkpoint 1";

/// What a node wrote for a checkpoint ([`crate::Node::checkpoint`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The checkpoint's directory.
    pub dir: PathBuf,
    /// The checkpoint's number in this cluster's run (1 for the first).
    pub sequence: u64,
    /// The clock of this node's slowest worker at the cut ([`crate::Worker::current_clock`]):
    /// a cluster restored from the checkpoint starts its workers at the smallest of the nodes'.
    pub clock: u64,
    /// Keys this node wrote, over all tables.
    pub keys: u64,
    /// Bytes of this node's values file.
    pub bytes: u64,
}

/// A checkpoint being written by a thread of its own ([`crate::Node::checkpoint_in_background`]).
#[derive(Debug)]
pub struct CheckpointWriting {
    thread: std::thread::JoinHandle<Result<CheckpointInfo>>,
}

impl CheckpointWriting {
    /// Waits until this node's files are written and durable.
    pub fn wait(self) -> Result<CheckpointInfo> {
        self.thread.join().map_err(|_| err("the thread writing the checkpoint panicked"))?
    }

    /// Whether the writing ended (then [`CheckpointWriting::wait`] returns at once).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }
}

/// The buffers of a node's last cut, once written, for its next: a checkpoint every epoch then
/// copies into memory that is already mapped, and its pause is the copy, not the page faults.
pub(crate) type SpareCuts = std::sync::Arc<parking_lot::Mutex<Vec<TableCut>>>;

/// Writes `cuts` as node `config.rank`'s part of checkpoint `sequence` in `dir`, on a thread of
/// its own, then hands the buffers back to `spare`.
pub(crate) fn write_in_background(dir: PathBuf, config: Config, cut: Cut, cuts: Vec<TableCut>, spare: SpareCuts) -> Result<CheckpointWriting> {
    let thread = std::thread::Builder::new()
        .name(format!("ferry{}-checkpoint", config.rank))
        .spawn(move || {
            let written = write_node(&dir, &config, &cut, &cuts);
            *spare.lock() = cuts;
            written
        })
        .map_err(|e| err(format!("cannot start the thread writing the checkpoint: {e}")))?;
    Ok(CheckpointWriting { thread })
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

/// The keys of every table that `rank` (of `nodes`) owns, with their values and state, copied
/// while every latch is held (nothing pushes, publishes or moves a key meanwhile). A replicated
/// key is written by its home only; a key on its way here is an error, as the cut would miss it.
///
/// A dynamic table's records are named by their ids (`indexes[table]`, the node's index of it):
/// the node knows the id of every slot key it holds that was handed out (it took the key by
/// its id), and the slot keys of its own range not handed out yet are left out.
pub(crate) fn cut(store: &Store, specs: &[TableSpec], indexes: &[Option<&IdIndex>], rank: usize, nodes: usize, spare: &SpareCuts) -> Result<Vec<TableCut>> {
    let mut buffers = std::mem::take(&mut *spare.lock()).into_iter();
    // The ids of dynamic tables' slots, before the latches: creating an id takes its index's
    // locks, then a latch.
    let id_maps: Vec<Option<FastMap<u64, u64>>> = specs
        .iter()
        .enumerate()
        .map(|(id, _)| indexes.get(id).copied().flatten().map(|i| i.pairs().into_iter().map(|(id, key)| (key, id)).collect()))
        .collect();
    let all = store.lock_all();
    let mut cuts = Vec::with_capacity(specs.len());
    for (id, spec) in specs.iter().enumerate().filter(|(_, spec)| !spec.scratch) {
        let id = id as u16;
        let table = store.table(id);
        let words_per_key = table.value_len() + table.state_len();
        let partitioner = Partitioner::of(spec, nodes);
        let held = table.slot_usage().0;
        let (mut keys, mut words) = buffers.next().map_or_else(|| (Vec::new(), Vec::new()), |c| (c.keys, c.words));
        keys.clear();
        words.clear();
        keys.reserve(held);
        words.reserve(held * words_per_key);
        let mut cut = TableCut { id, words_per_key, keys, words };
        let index = indexes.get(id as usize).copied().flatten();
        let ids = &id_maps[id as usize];
        for key in 0..spec.keys {
            match all.slot(id, key) {
                Some(slot) => {
                    if table.is_replicated(key) && partitioner.home(key) != rank {
                        continue;
                    }
                    match (ids, index) {
                        (Some(ids), Some(index)) => match ids.get(&key) {
                            Some(&raw) => cut.keys.push(raw),
                            None if index.is_own(key) => continue,
                            None => {
                                return Err(err(format!("slot key {key} of dynamic table '{}' is held by node {rank}, which does not know its id", spec.name)));
                            }
                        },
                        _ => cut.keys.push(key),
                    }
                    slot.append_all_words(&mut cut.words);
                }
                None if matches!(table.residence(key), Residence::Arriving) => {
                    return Err(err(format!(
                        "key {key} of table '{}' is on its way to node {rank}: take a checkpoint while no key relocates (after a barrier, with intents ended)",
                        spec.name
                    )));
                }
                None => {}
            }
        }
        cuts.push(cut);
    }
    Ok(cuts)
}

/// A writer that hashes and counts what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Xxh3,
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

/// A file's checksum as the manifest names it: XXH3-128, a non-cryptographic hash that runs
/// at memory speed (a checksum finds damage and mix-ups; it does not stand against forgery).
fn checksum_text(hash: u128) -> String {
    format!("xxh3-128:{hash:032x}")
}

/// The checksum of `bytes` as checkpoint manifests (and saved models) write it:
/// `xxh3-128:` and 32 hex digits.
pub fn file_checksum(bytes: &[u8]) -> String {
    checksum_text(xxhash_rust::xxh3::xxh3_128(bytes))
}

/// Writes `words` as little-endian bytes: on a little-endian machine the slice's own bytes, in
/// one piece.
fn write_le<T: bytemuck::Pod + ToLe>(out: &mut dyn Write, words: &[T]) -> std::io::Result<()> {
    if cfg!(target_endian = "little") {
        return out.write_all(bytemuck::cast_slice(words));
    }
    for chunk in words.chunks(1 << 14) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|w| w.to_le_vec()).collect();
        out.write_all(&bytes)?;
    }
    Ok(())
}

/// Little-endian bytes of a word (the big-endian path of [`write_le`]).
trait ToLe {
    fn to_le_vec(&self) -> Vec<u8>;
}

impl ToLe for u32 {
    fn to_le_vec(&self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
}

impl ToLe for u64 {
    fn to_le_vec(&self) -> Vec<u8> {
        self.to_le_bytes().to_vec()
    }
}

/// Writes `dir/name` with `body` through a temporary name (`name.partial`), fsynced before it is
/// renamed into place; returns the bytes written and their checksum ([`file_checksum`]). The
/// directory itself is not fsynced: the caller does that once its files are all written.
pub fn write_file_durably(dir: &Path, name: &str, body: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<(u64, String)> {
    let (path, partial) = (dir.join(name), dir.join(format!("{name}.partial")));
    let file = std::fs::File::create(&partial).map_err(|e| io("creating", &partial, e))?;
    let mut out = Hashing { inner: std::io::BufWriter::with_capacity(1 << 20, file), hash: Xxh3::new(), bytes: 0 };
    body(&mut out).and_then(|()| out.flush()).map_err(|e| io("writing", &partial, e))?;
    let Hashing { inner, hash, bytes } = out;
    let file = inner.into_inner().map_err(|e| io("writing", &partial, e.into_error()))?;
    file.sync_all().map_err(|e| io("syncing", &partial, e))?;
    std::fs::rename(&partial, &path).map_err(|e| io("renaming into place", &path, e))?;
    Ok((bytes, checksum_text(hash.digest128())))
}

/// An id of the cluster that wrote a checkpoint: every node of one run has the same (its
/// settings and its coordinator), so that files of two runs are not taken for one checkpoint.
pub(crate) fn cluster_id(config: &Config) -> u64 {
    crate::config::fnv1a(format!("{}{}", config.fingerprint_text(), config.coordinator).as_bytes())
}

fn values_name(rank: usize) -> String {
    format!("node-{rank}.values")
}

fn manifest_name(rank: usize) -> String {
    format!("node-{rank}.manifest")
}

/// What a checkpoint's manifests say of the cut besides the tables.
#[derive(Debug, Clone, Default)]
pub(crate) struct Cut {
    /// The checkpoint's number in this cluster's run.
    pub sequence: u64,
    /// The node's slowest worker's clock.
    pub clock: u64,
    /// Ranks gone from the cluster at the cut (lost, their keys failed over, or left): they
    /// write nothing, and their keys are in the files of the nodes that took them over.
    pub absent: Vec<usize>,
    /// The node's spill files at the cut (table, path, bytes synced), copied into the
    /// checkpoint up to that length ([`crate::Config::spill_dir`]).
    pub spills: Vec<(u16, PathBuf, u64)>,
    /// What the node's dynamic tables' admission filters and eviction histories learnt as a
    /// home, per table that keeps any ([`crate::dynamic::IdIndex::admission_state`]).
    pub admission: Vec<(u16, AdmissionState)>,
}

/// Writes node `config.rank`'s part of checkpoint `cut.sequence` into `dir`: its values file,
/// then its manifest, which also holds the node's slowest worker's clock and the ranks gone
/// from the cluster.
pub(crate) fn write_node(dir: &Path, config: &Config, cut: &Cut, cuts: &[TableCut]) -> Result<CheckpointInfo> {
    let Cut { sequence, clock, .. } = *cut;
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
    let (bytes, checksum) = write_file_durably(dir, &values_name(rank), |out| {
        out.write_all(MAGIC)?;
        out.write_all(&(cuts.len() as u32).to_le_bytes())?;
        for cut in cuts {
            out.write_all(&cut.id.to_le_bytes())?;
            out.write_all(&(cut.words_per_key as u32).to_le_bytes())?;
            out.write_all(&(cut.keys.len() as u64).to_le_bytes())?;
            write_le(out, &cut.keys)?;
            write_le(out, &cut.words)?;
        }
        Ok(())
    })?;
    let mut spills = String::new();
    for (table, path, len) in &cut.spills {
        let (copied, checksum) = write_file_durably(dir, &spill_name(rank, *table), |out| {
            let file = std::fs::File::open(path)?;
            std::io::copy(&mut std::io::Read::take(file, *len), out).map(drop)
        })?;
        if copied != *len {
            return Err(err(format!("spill file {} holds {copied} bytes, fewer than the {len} synced", path.display())));
        }
        spills.push_str(&format!("spill\t{table}\t{}\t{copied}\t{checksum}\n", spill_name(rank, *table)));
    }
    if !cut.admission.is_empty() {
        let (bytes, checksum) = write_file_durably(dir, &admission_name(rank), |out| write_admission(out, &cut.admission))?;
        spills.push_str(&format!("admission\t{}\t{bytes}\t{checksum}\n", admission_name(rank)));
    }
    let mut text = format!(
        "{FORMAT_LINE}\ncluster\t{:016x}\nsequence\t{sequence}\nnodes\t{}\nclock\t{clock}\nfile\t{}\t{bytes}\t{checksum}\n",
        cluster_id(config),
        config.nodes,
        values_name(rank)
    );
    if !cut.absent.is_empty() {
        let ranks: Vec<String> = cut.absent.iter().map(usize::to_string).collect();
        text.push_str(&format!("absent\t{}\n", ranks.join(",")));
    }
    for cut in cuts.iter().filter(|c| config.tables[c.id as usize].dynamic.is_some()) {
        text.push_str(&format!("dynamic\t{}\n", cut.id));
    }
    text.push_str(&spills);
    for cut in cuts {
        let spec = &config.tables[cut.id as usize];
        text.push_str(&format!(
            "table\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n",
            cut.id,
            cut.keys.len(),
            spec.keys,
            spec.value_len,
            spec.state_len(),
            spec.partitioning.name(),
            spec.updater.describe(),
            spec.name
        ));
    }
    write_file_durably(dir, &manifest_name(rank), |out| out.write_all(text.as_bytes()))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io("syncing", dir, e))?;
    Ok(CheckpointInfo { dir: dir.to_path_buf(), sequence, clock, keys: cuts.iter().map(|c| c.keys.len() as u64).sum(), bytes })
}

/// One node's manifest, parsed.
#[derive(Debug, PartialEq)]
struct Manifest {
    cluster: String,
    sequence: u64,
    nodes: usize,
    /// The node's slowest worker's clock at the cut (0 in checkpoints from before clocks
    /// were saved).
    clock: u64,
    /// Ranks gone from the cluster at the cut, which wrote nothing (ascending).
    absent: Vec<usize>,
    file: (String, u64, String),
    /// (id, records, keys, value_len, state_len, updater, name) per table.
    tables: Vec<(u16, u64, u64, usize, usize, String, String)>,
    /// The ids of the dynamic tables, whose records are named by raw ids (any `u64`) rather
    /// than keys.
    dynamic: Vec<u16>,
    /// The node's spill files copied in: (table id, file, bytes, checksum).
    spills: Vec<(u16, String, u64, String)>,
    /// The node's admission file, if it wrote one: (file, bytes, checksum).
    admission: Option<(String, u64, String)>,
}

fn parse_manifest(path: &Path, text: &str) -> Result<Manifest> {
    let bad = |what: &str| err(format!("{}: {what}", path.display()));
    let mut lines = text.lines();
    if lines.next() != Some(FORMAT_LINE) {
        return Err(bad(&format!("not a checkpoint manifest of this version (its first line is not '{FORMAT_LINE}')")));
    }
    let mut m = Manifest {
        cluster: String::new(),
        sequence: 0,
        nodes: 0,
        clock: 0,
        absent: Vec::new(),
        file: Default::default(),
        tables: Vec::new(),
        dynamic: Vec::new(),
        spills: Vec::new(),
        admission: None,
    };
    let number = |field: &str, what: &str| field.parse::<u64>().map_err(|_| bad(&format!("{what} '{field}' is not a number")));
    for line in lines {
        let fields: Vec<&str> = line.split('\t').collect();
        match fields[..] {
            ["cluster", id] => m.cluster = id.to_string(),
            ["sequence", n] => m.sequence = number(n, "sequence")?,
            ["nodes", n] => m.nodes = number(n, "nodes")? as usize,
            ["clock", n] => m.clock = number(n, "clock")?,
            ["absent", ranks] => {
                for r in ranks.split(',') {
                    m.absent.push(number(r, "absent rank")? as usize);
                }
            }
            ["dynamic", id] => m.dynamic.push(u16::try_from(number(id, "table id")?).map_err(|_| bad("a table id beyond 65535"))?),
            ["file", name, bytes, checksum] => m.file = (name.to_string(), number(bytes, "bytes")?, checksum.to_string()),
            ["admission", name, bytes, checksum] => {
                if name.contains(['/', '\\']) || !name.ends_with(".admission") {
                    return Err(bad(&format!("admission file '{name}' is not a file of the checkpoint")));
                }
                m.admission = Some((name.to_string(), number(bytes, "bytes")?, checksum.to_string()));
            }
            ["spill", id, name, bytes, checksum] => {
                let id = u16::try_from(number(id, "table id")?).map_err(|_| bad("a table id beyond 65535"))?;
                if name.contains(['/', '\\']) || !name.ends_with(".spill") {
                    return Err(bad(&format!("spill file '{name}' is not a file of the checkpoint")));
                }
                m.spills.push((id, name.to_string(), number(bytes, "bytes")?, checksum.to_string()));
            }
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
    if m.absent.windows(2).any(|w| w[0] >= w[1]) || m.absent.last().is_some_and(|&r| r >= m.nodes) || m.absent.len() >= m.nodes {
        return Err(bad(&format!("its absent ranks {:?} are not distinct ranks of its {} nodes", m.absent, m.nodes)));
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
    // Rank 0 coordinates and never leaves; should it be missing, the lowest rank that wrote
    // says which ranks were gone.
    let first_rank = if dir.join(manifest_name(0)).exists() { 0 } else { lowest_manifest(dir).unwrap_or(0) };
    let first = read(first_rank)?;
    let nodes = first.nodes;
    if nodes > u16::MAX as usize {
        return Err(err(format!("{}: {nodes} nodes", dir.join(manifest_name(first_rank)).display())));
    }
    if first.absent.contains(&first_rank) || first_rank >= nodes {
        return Err(err(format!(
            "{} is not a whole checkpoint: {} is missing (node 0 did not finish writing)",
            dir.display(),
            dir.join(manifest_name(0)).display()
        )));
    }
    let absent = first.absent.clone();
    let mut all = vec![first];
    for rank in (0..nodes).filter(|&r| r != first_rank && !absent.contains(&r)) {
        let m = read(rank)?;
        if m.absent != all[0].absent {
            return Err(err(format!(
                "{} is not a whole checkpoint: node {rank} wrote it with nodes {:?} gone, node {first_rank} with nodes {:?} (a node was lost while it was taken)",
                dir.display(),
                m.absent,
                all[0].absent
            )));
        }
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

/// The lowest rank with a manifest in `dir`.
fn lowest_manifest(dir: &Path) -> Option<usize> {
    std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("node-")?.strip_suffix(".manifest")?.parse::<usize>().ok()).min()
}

/// Whether two nodes' manifests describe the same tables (record counts differ per node).
fn same_tables(a: &Manifest, b: &Manifest) -> bool {
    a.dynamic == b.dynamic
        && a.tables.len() == b.tables.len()
        && a.tables.iter().zip(&b.tables).all(|(x, y)| (x.0, x.2, x.3, x.4, &x.5, &x.6) == (y.0, y.2, y.3, y.4, &y.5, &y.6))
}

/// Checks that `dir` holds a whole checkpoint (the manifest of every node that was in the
/// cluster at the cut, all of one checkpoint); returns how many nodes wrote it.
pub fn checkpoint_nodes(dir: impl AsRef<Path>) -> Result<usize> {
    Ok(whole(dir.as_ref())?.len())
}

/// The manifests of a whole checkpoint in `dir` that fits the tables `specs`.
fn manifests(dir: &Path, specs: &[TableSpec]) -> Result<Vec<Manifest>> {
    let all = whole(dir)?;
    // The tables must be the configuration's but its scratch tables, in its order;
    // partitioning may differ.
    let saved = &all[0].tables;
    let kept: Vec<&TableSpec> = specs.iter().filter(|s| !s.scratch).collect();
    if saved.len() != kept.len() {
        return Err(err(format!("the checkpoint in {} has {} table(s), this configuration {} (scratch tables aside)", dir.display(), saved.len(), kept.len())));
    }
    for (spec, (id, _, keys, value_len, state_len, updater, name)) in kept.into_iter().zip(saved) {
        let mismatch = |setting: &str, theirs: String, ours: String| {
            err(format!("table '{}': the checkpoint's {setting} is {theirs}, this configuration's {ours}", spec.name))
        };
        if *name != spec.name {
            return Err(mismatch("name", format!("'{name}'"), format!("'{}'", spec.name)));
        }
        let dynamic = all[0].dynamic.contains(id);
        if dynamic != spec.dynamic.is_some() {
            let kind = |d: bool| if d { "dynamic" } else { "not dynamic" }.to_string();
            return Err(mismatch("table", kind(dynamic), kind(spec.dynamic.is_some())));
        }
        // (A dynamic table's slot keys depend on the node count; its records are ids.)
        if !dynamic && *keys != spec.keys {
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

/// One node's values file, read in pieces and hashed as it goes; never past the length its
/// manifest gave and the file has.
struct ValuesReader {
    file: std::io::BufReader<std::fs::File>,
    hash: Xxh3,
    read: u64,
    len: u64,
    path: PathBuf,
}

/// Bytes of rows read at a time.
const PIECE: usize = 4 << 20;

impl ValuesReader {
    /// Opens the values file `m` names in `dir`, checked to have the manifest's length.
    fn open(dir: &Path, m: &Manifest) -> Result<ValuesReader> {
        let (name, bytes, _) = &m.file;
        if name.contains(['/', '\\']) || name.starts_with('.') {
            return Err(err(format!("a manifest in {} names the values file {name:?}, which is not a file of the checkpoint", dir.display())));
        }
        let path = dir.join(name);
        let file = std::fs::File::open(&path).map_err(|e| io("reading", &path, e))?;
        let len = file.metadata().map_err(|e| io("reading", &path, e))?.len();
        if len != *bytes {
            return Err(err(format!("{}: {len} bytes where its manifest says {bytes} (damaged, or from another checkpoint)", path.display())));
        }
        Ok(ValuesReader { file: std::io::BufReader::with_capacity(1 << 20, file), hash: Xxh3::new(), read: 0, len, path })
    }

    /// Bytes not read yet.
    fn left(&self) -> u64 {
        self.len - self.read
    }

    /// Reads the next `n` bytes into `buf` (replacing what it held).
    fn bytes(&mut self, n: usize, buf: &mut Vec<u8>) -> Result<()> {
        if n as u64 > self.left() {
            return Err(err(format!("{}: cut short", self.path.display())));
        }
        buf.resize(n, 0);
        std::io::Read::read_exact(&mut self.file, buf).map_err(|e| io("reading", &self.path, e))?;
        self.hash.update(buf);
        self.read += n as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut buf = Vec::with_capacity(N);
        self.bytes(N, &mut buf)?;
        Ok(buf.try_into().expect("N bytes"))
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// At the end: nothing left over, and the checksum the manifest gave.
    fn finish(self, checksum: &str) -> Result<()> {
        if self.left() > 0 {
            return Err(err(format!("{}: {} bytes after the last table", self.path.display(), self.left())));
        }
        if checksum_text(self.hash.digest128()) != checksum {
            return Err(err(format!("{}: its checksum differs from its manifest's (damaged, or from another checkpoint)", self.path.display())));
        }
        Ok(())
    }
}

/// What a reader needs of one table: its name, key count and words per key (value, then
/// state), and how its keys are partitioned now.
struct Shape {
    /// Where its records go: the configuration's table index on a restore, the output's
    /// position when read whole.
    target: usize,
    name: String,
    keys: u64,
    value_len: usize,
    words_per_key: usize,
    partitioning: crate::config::Partitioning,
    placement: Option<std::sync::Arc<crate::placement::Placement>>,
    /// A dynamic table's seed of its ids' homes: its records are ids, each taken by its home.
    dynamic: Option<u64>,
}

impl Shape {
    /// The shapes of the tables of `specs` that checkpoints hold (scratch tables aside), in
    /// order: as a checkpoint's manifests list them.
    fn of_kept(specs: &[TableSpec]) -> Vec<Shape> {
        specs.iter().enumerate().filter(|(_, spec)| !spec.scratch).map(|(target, spec)| Shape::of(target, spec)).collect()
    }

    fn of(target: usize, spec: &TableSpec) -> Shape {
        Shape {
            target,
            name: spec.name.clone(),
            keys: spec.keys,
            value_len: spec.value_len,
            words_per_key: spec.value_len + spec.state_len(),
            partitioning: spec.partitioning,
            placement: spec.placement.clone(),
            dynamic: spec.dynamic.map(|d| d.seed),
        }
    }
}

/// Where the records of a checkpoint go as it is read: node `rank` of `nodes` takes the keys
/// it is home of (`apply` with `home` true) and those `also` names (replicas; `home` false),
/// `also` given the table's index in the configuration and the key (an id, in a dynamic table).
struct Target<'a> {
    shapes: &'a [Shape],
    rank: usize,
    nodes: usize,
    also: &'a dyn Fn(usize, u64) -> bool,
}

/// Reads the whole checkpoint of `manifests` in `dir` into `target` (`target.shapes` are the
/// manifests' tables, in their order): every record it takes goes to `apply(shape's target,
/// key, bytes, home)`, `bytes` its value's and state's words, little-endian. Checks that each of
/// its home keys was in exactly one file.
fn read_into(dir: &Path, manifests: &[Manifest], target: &Target<'_>, mut apply: impl FnMut(usize, u64, &[u8], bool) -> Result<()>) -> Result<u64> {
    let (shapes, rank) = (target.shapes, target.rank);
    // A values file names a table by the id it had in the writer's configuration; the manifests
    // list those ids in the order of `shapes`.
    let position = |id: usize| manifests[0].tables.iter().position(|t| t.0 as usize == id).filter(|&p| p < shapes.len());
    let partitioners: Vec<Partitioner> =
        shapes.iter().map(|t| Partitioner::with_placement(t.keys, target.nodes, t.partitioning, t.placement.clone())).collect();
    // Per table, which of the home keys were found (sized by the configuration, or by a
    // manifest checked against the files' sizes: never by a count read from a file alone).
    let mut found: Vec<Vec<bool>> = shapes.iter().map(|t| if t.dynamic.is_some() { Vec::new() } else { vec![false; t.keys as usize] }).collect();
    let mut loaded = 0u64;
    let (mut keys, mut rows) = (Vec::new(), Vec::new());
    for m in manifests {
        let mut r = ValuesReader::open(dir, m)?;
        let path = r.path.clone();
        if r.array::<8>()? != *MAGIC {
            return Err(err(format!("{}: not a checkpoint values file", path.display())));
        }
        let tables = r.u32()? as usize;
        if tables != shapes.len() {
            return Err(err(format!("{}: {tables} table(s) where the manifest lists {}", path.display(), shapes.len())));
        }
        for _ in 0..tables {
            let file_id = r.u16()? as usize;
            let id = position(file_id).ok_or_else(|| err(format!("{}: table id {file_id} is not in the manifest", path.display())))?;
            let shape = &shapes[id];
            let words_per_key = r.u32()? as usize;
            if words_per_key != shape.words_per_key {
                return Err(err(format!("{}: table '{}' has {words_per_key} words per key, not {}", path.display(), shape.name, shape.words_per_key)));
            }
            let count = r.u64()?;
            // Checked against the bytes left before anything is sized by it.
            let row_bytes = 4 * words_per_key;
            if count.checked_mul(8 + row_bytes as u64).is_none_or(|n| n > r.left()) {
                return Err(err(format!("{}: table '{}' claims {count} keys, more than the file holds", path.display(), shape.name)));
            }
            r.bytes(count as usize * 8, &mut keys)?;
            let per_piece = (PIECE / row_bytes.max(1)).max(1);
            for piece in keys.chunks(8 * per_piece) {
                r.bytes(piece.len() / 8 * row_bytes, &mut rows)?;
                for (key, row) in piece.chunks_exact(8).zip(rows.chunks_exact(row_bytes.max(1))) {
                    let key = u64::from_le_bytes(key.try_into().expect("8 bytes"));
                    if let Some(seed) = shape.dynamic {
                        // An id, taken by its home (which refuses one it took already), and by
                        // every node if the table replicates it.
                        let home = crate::dynamic::id_home(seed, key, target.nodes) == rank;
                        if home || (target.also)(shape.target, key) {
                            apply(shape.target, key, row, home)?;
                            loaded += u64::from(home);
                        }
                        continue;
                    }
                    if key >= shape.keys {
                        return Err(err(format!("{}: key {key} is outside table '{}' (keys 0..{})", path.display(), shape.name, shape.keys)));
                    }
                    let home = partitioners[id].home(key) == rank;
                    if !home && !(target.also)(shape.target, key) {
                        continue;
                    }
                    if home {
                        let seen = &mut found[id][key as usize];
                        if *seen {
                            return Err(err(format!("key {key} of table '{}' is in two nodes' files of {}", shape.name, dir.display())));
                        }
                        *seen = true;
                    }
                    apply(shape.target, key, row, home)?;
                    loaded += u64::from(home);
                }
            }
        }
        r.finish(&m.file.2)?;
    }
    for (id, shape) in shapes.iter().enumerate().filter(|(_, shape)| shape.dynamic.is_none()) {
        if let Some(key) = partitioners[id].home_keys(rank).find(|&k| !found[id][k as usize]) {
            return Err(err(format!("key {key} of table '{}' is in no node's file of {}: the checkpoint is incomplete", shape.name, dir.display())));
        }
    }
    Ok(loaded)
}

/// Loads the checkpoint in `dir` into `store` (node `config.rank` of `config.nodes`, freshly
/// built): the keys this node is home of, and its replicas of replicated keys. Returns the
/// clock the cluster's workers go on from: the smallest the nodes saved.
///
/// A dynamic table's ids homed here (now) go into `indexes[table]`, each in a slot key of this
/// node's range, with its saved value and state.
pub(crate) fn restore(dir: &Path, store: &Store, config: &Config, indexes: &[Option<IdIndex>]) -> Result<u64> {
    let manifests = manifests(dir, &config.tables)?;
    // Keys of dense tables, ids of dynamic ones.
    let also = |table: usize, key: u64| match indexes.get(table).and_then(Option::as_ref) {
        Some(index) => index.replicated_key(key).is_some(),
        None => store.table(table as u16).is_replicated(key),
    };
    let shapes = Shape::of_kept(&config.tables);
    let target = Target { shapes: &shapes, rank: config.rank, nodes: config.nodes, also: &also };
    // First the homes' admission state: a restored id then starts with the uses eviction's
    // history remembers of it.
    restore_admission(dir, &manifests, config, indexes)?;
    // Every latch for the whole restore: one lock instead of one per key.
    let all = store.lock_all();
    read_into(dir, &manifests, &target, |table, key, bytes, _| {
        if let Some(index) = indexes.get(table).and_then(Option::as_ref) {
            return index.restore(key, |slot_key| {
                let slot = all
                    .slot(table as u16, slot_key)
                    .ok_or_else(|| err(format!("slot key {slot_key} of table '{}' is not on its home", config.tables[table].name)))?;
                slot.write_all_le_bytes(bytes);
                Ok(())
            });
        }
        let slot = all
            .slot(table as u16, key)
            .ok_or_else(|| err(format!("key {key} of table '{}' has no slot on node {} to restore into", config.tables[table].name, config.rank)))?;
        slot.write_all_le_bytes(bytes);
        Ok(())
    })?;
    Ok(manifests.iter().map(|m| m.clock).min().unwrap_or(0))
}

/// Writes dense tables held by one process (`values[t]`: every key's value of `specs[t]`, key
/// after key) as checkpoint number `sequence` of one node, in the format of
/// [`crate::Node::checkpoint`]: a cluster of any size restores from it, and
/// [`read_arrays_checkpoint`] reads it back. Tables whose updater keeps state get it zeroed;
/// scratch tables are left out.
pub fn write_arrays_checkpoint(dir: impl AsRef<Path>, specs: &[TableSpec], values: &[&[f32]], sequence: u64) -> Result<CheckpointInfo> {
    if specs.len() != values.len() {
        return Err(err(format!("{} tables but {} arrays of values", specs.len(), values.len())));
    }
    let mut cuts = Vec::with_capacity(specs.len());
    for (id, (spec, values)) in specs.iter().zip(values).enumerate() {
        if spec.scratch {
            continue;
        }
        if spec.dynamic.is_some() {
            return Err(err(format!("table '{}' is dynamic: dense arrays cannot name its ids (a cluster's Node::checkpoint writes it)", spec.name)));
        }
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
    write_node(dir.as_ref(), &Config::new(specs.to_vec()), &Cut { sequence, ..Cut::default() }, &cuts)
}

/// Reads the whole checkpoint in `dir`, written by any node count, as dense tables for one
/// process: every key's value of `specs[t]`, key after key (optimizer state left out).
pub fn read_arrays_checkpoint(dir: impl AsRef<Path>, specs: &[TableSpec]) -> Result<Vec<Vec<f32>>> {
    let dir = dir.as_ref();
    let manifests = manifests(dir, specs)?;
    let shapes = Shape::of_kept(specs);
    let mut dense = read_dense(dir, &manifests, &shapes)?.into_iter();
    // Scratch tables are not in checkpoints: zeros.
    Ok(specs
        .iter()
        .map(|s| if s.scratch { vec![0.0; (s.keys as usize).saturating_mul(s.value_len)] } else { dense.next().expect("one per kept table") })
        .collect())
}

/// A checkpoint read whole outside a cluster cannot hold a dynamic table yet: refused, naming
/// the table.
fn refuse_dynamic(dir: &Path, manifests: &[Manifest]) -> Result<()> {
    if let Some(id) = manifests.first().and_then(|m| m.dynamic.first()) {
        let name = manifests[0].tables.iter().find(|t| t.0 == *id).map_or(String::new(), |t| t.6.clone());
        return Err(err(format!(
            "{}: table '{name}' is dynamic (its records are ids): restore it into a cluster (Config::restore_from); reading it whole is not built yet",
            dir.display()
        )));
    }
    Ok(())
}

/// Every key's value (state left out) of every table in `shapes` (the manifests' tables, their
/// targets their positions), key after key, from the checkpoint of `manifests` in `dir`.
fn read_dense(dir: &Path, manifests: &[Manifest], shapes: &[Shape]) -> Result<Vec<Vec<f32>>> {
    refuse_dynamic(dir, manifests)?;
    let mut out: Vec<Vec<f32>> = shapes.iter().map(|s| vec![0.0; (s.keys as usize).saturating_mul(s.value_len)]).collect();
    let shapes: Vec<Shape> =
        shapes.iter().enumerate().map(|(position, s)| Shape { target: position, name: s.name.clone(), placement: s.placement.clone(), ..*s }).collect();
    let target = Target { shapes: &shapes, rank: 0, nodes: 1, also: &|_, _| false };
    read_into(dir, manifests, &target, |table, key, bytes, _| {
        let len = shapes[table].value_len;
        for (o, b) in out[table][key as usize * len..(key as usize + 1) * len].iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
        Ok(())
    })?;
    Ok(out)
}

/// One table of a checkpoint, read whole by [`read_checkpoint`].
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointTable {
    /// The table's name.
    pub name: String,
    /// Its key count: `values` holds keys `0..keys` (a dynamic table's: the rows of `ids`).
    pub keys: u64,
    /// Values per key.
    pub value_len: usize,
    /// The updater it was trained with (as its manifest names it; its state is not read).
    pub updater: String,
    /// Every key's value, key after key (`keys × value_len`).
    pub values: Vec<f32>,
    /// Whether the table is dynamic ([`crate::TableSpec::dynamic`]): its rows are the ids of
    /// `ids`.
    pub dynamic: bool,
    /// A dynamic table's ids, ascending: `values` holds their rows in this order, and `keys`
    /// is their number. Empty for a table that is not dynamic.
    pub ids: Vec<u64>,
    /// A dynamic table's ids its homes evicted and spilled ([`crate::Config::spill_dir`]) up
    /// to the checkpoint, node by node in the order each evicted them (an id once per
    /// eviction); empty where nothing was spilled.
    pub spilled_ids: Vec<u64>,
    /// Their values, id after id (`spilled_ids.len() × value_len`).
    pub spilled_values: Vec<f32>,
}

/// Reads the whole checkpoint in `dir`, written by any node count, without knowing its tables
/// beforehand: every table's values, key after key (optimizer state left out). This is how a
/// checkpoint is read outside a cluster (a model's predictions, an export, NumPy through the
/// Python binding); a cluster restores with [`crate::Config::restore_from`] instead.
///
/// The tables' sizes come from the manifests, checked against the values files' sizes before
/// anything is allocated by them.
pub fn read_checkpoint(dir: impl AsRef<Path>) -> Result<Vec<CheckpointTable>> {
    let dir = dir.as_ref();
    let manifests = whole(dir)?;
    let first = &manifests[0];
    let dynamic = |id: u16| first.dynamic.contains(&id);
    // Every key is written by exactly one node, so the records over all nodes are the key
    // count (a dynamic table's, its ids), and each file holds its records' bytes.
    for (t, (id, _, keys, value_len, state_len, _, name)) in first.tables.iter().enumerate() {
        let records: u64 = manifests.iter().map(|m| m.tables[t].1).fold(0u64, u64::saturating_add);
        if records != *keys && !dynamic(*id) {
            return Err(err(format!("{}: table '{name}' has {records} records over all nodes' manifests for {keys} keys", dir.display())));
        }
        if value_len.checked_add(*state_len).is_none_or(|w| w > u32::MAX as usize) {
            return Err(err(format!("{}: table '{name}' has a value length beyond a u32", dir.display())));
        }
    }
    for m in &manifests {
        let bytes = m.tables.iter().try_fold(0u64, |sum, (_, records, _, value_len, state_len, _, _)| {
            records.checked_mul(8 + 4 * (*value_len + *state_len) as u64).and_then(|b| sum.checked_add(b))
        });
        if bytes.is_none_or(|b| b > m.file.1) {
            return Err(err(format!("{}: its manifest lists more records than its values file's {} bytes hold", dir.join(&m.file.0).display(), m.file.1)));
        }
    }
    let shapes: Vec<Shape> = first
        .tables
        .iter()
        .enumerate()
        .map(|(target, (id, _, keys, value_len, state_len, _, name))| Shape {
            target,
            name: name.clone(),
            // A dynamic table's rows are its ids (read whole by one reader, the home of every
            // id whatever the seed).
            keys: if dynamic(*id) { 0 } else { *keys },
            value_len: *value_len,
            words_per_key: value_len + state_len,
            partitioning: crate::config::Partitioning::Range,
            placement: None,
            dynamic: dynamic(*id).then_some(0),
        })
        .collect();
    let mut dense: Vec<Vec<f32>> = shapes.iter().map(|s| vec![0.0; (s.keys as usize).saturating_mul(s.value_len)]).collect();
    let mut rows: Vec<Vec<(u64, Vec<f32>)>> = shapes.iter().map(|_| Vec::new()).collect();
    let target = Target { shapes: &shapes, rank: 0, nodes: 1, also: &|_, _| false };
    read_into(dir, &manifests, &target, |table, key, bytes, _| {
        let len = shapes[table].value_len;
        let values = bytes.chunks_exact(4).take(len).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")));
        if shapes[table].dynamic.is_some() {
            rows[table].push((key, values.collect()));
        } else {
            for (o, v) in dense[table][key as usize * len..(key as usize + 1) * len].iter_mut().zip(values) {
                *o = v;
            }
        }
        Ok(())
    })?;
    let mut tables = Vec::with_capacity(shapes.len());
    for (((_, _, keys, value_len, _, updater, name), values), mut rows) in first.tables.iter().zip(dense).zip(rows) {
        let (keys, ids, values) = if shapes[tables.len()].dynamic.is_some() {
            // Ids in ascending order; an id written twice is a damaged or mixed-up checkpoint.
            rows.sort_unstable_by_key(|r| r.0);
            if let Some(w) = rows.windows(2).find(|w| w[0].0 == w[1].0) {
                return Err(err(format!("{}: id {} of dynamic table '{name}' is in two nodes' files", dir.display(), w[0].0)));
            }
            let ids: Vec<u64> = rows.iter().map(|r| r.0).collect();
            (ids.len() as u64, ids, rows.into_iter().flat_map(|r| r.1).collect())
        } else {
            (*keys, Vec::new(), values)
        };
        let dynamic = shapes[tables.len()].dynamic.is_some();
        tables.push(CheckpointTable {
            name: name.clone(),
            keys,
            value_len: *value_len,
            updater: updater.clone(),
            values,
            dynamic,
            ids,
            spilled_ids: Vec::new(),
            spilled_values: Vec::new(),
        });
    }
    for m in &manifests {
        for (table, spill) in read_spills(dir, m)? {
            if let Some(t) = first.tables.iter().position(|t| t.0 == table) {
                tables[t].spilled_ids.extend(spill.ids);
                tables[t].spilled_values.extend(spill.values);
            }
        }
    }
    Ok(tables)
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

    #[test]
    fn a_checkpoint_reads_back_without_its_tables_and_sizes_are_checked_before_use() {
        let dir = std::env::temp_dir().join(format!("ferry-read-checkpoint-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let specs = [TableSpec::new("a", 3, 2), TableSpec::new("b", 2, 1).with_updater(crate::Updater::adagrad(0.1))];
        let (a, b) = (vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], vec![-1.0, 0.5]);
        write_arrays_checkpoint(&dir, &specs, &[&a, &b], 7).unwrap();
        let tables = read_checkpoint(&dir).unwrap();
        assert_eq!(tables.iter().map(|t| (t.name.as_str(), t.keys, t.value_len)).collect::<Vec<_>>(), [("a", 3, 2), ("b", 2, 1)]);
        assert_eq!((&tables[0].values, &tables[1].values), (&a, &b));
        // A manifest that claims more keys than its file holds is refused before anything is
        // sized by it.
        let manifest = dir.join("node-0.manifest");
        let text = std::fs::read_to_string(&manifest).unwrap();
        let inflated = text.replace("table\t0\t3\t3\t", "table\t0\t300000000000\t300000000000\t");
        assert_ne!(inflated, text);
        std::fs::write(&manifest, inflated).unwrap();
        let e = read_checkpoint(&dir).unwrap_err().to_string();
        assert!(e.contains("more records than its values file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
