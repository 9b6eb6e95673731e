//! The files a node writes beside its values file for a checkpoint of dynamic tables: the
//! homes' admission state (`node-R.admission`: what the count filter and eviction's history
//! learnt) and copies of its spill files (`node-R.table-T.spill`), each listed in its manifest
//! with its size and checksum, checked against both before it is used.

use std::io::Write;
use std::path::Path;

use super::{Config, Manifest, Result, err, file_checksum, io, values_name, whole, write_le};
use crate::dynamic::{AdmissionState, IdIndex};

/// The first bytes of a node's admission file.
const ADMISSION_MAGIC: &[u8; 8] = b"FERRYAD1";

/// The name of node `rank`'s admission file in a checkpoint: per table, its id (u16), the
/// count filter's counters (a u64 count, then u32 each), the history's (the same), the uses
/// added since the history was halved (u64) and the last round's threshold (u64), after
/// `FERRYAD1` and the table count (u32); little-endian.
pub(super) fn admission_name(rank: usize) -> String {
    format!("node-{rank}.admission")
}

/// Node `rank`'s admission file's body.
pub(super) fn write_admission(out: &mut dyn Write, states: &[(u16, AdmissionState)]) -> std::io::Result<()> {
    out.write_all(ADMISSION_MAGIC)?;
    out.write_all(&(states.len() as u32).to_le_bytes())?;
    for (table, state) in states {
        out.write_all(&table.to_le_bytes())?;
        for counters in [&state.pushes, &state.uses] {
            out.write_all(&(counters.len() as u64).to_le_bytes())?;
            write_le(out, counters)?;
        }
        out.write_all(&state.uses_added.to_le_bytes())?;
        out.write_all(&state.admit_above.to_le_bytes())?;
    }
    Ok(())
}

/// An admission file's `bytes` (`path` names it in errors); every count is checked against
/// the bytes left before anything is sized by it.
pub(super) fn parse_admission(bytes: &[u8], path: &Path) -> Result<Vec<(u16, AdmissionState)>> {
    let bad = || err(format!("{}: not a whole admission file of this version", path.display()));
    let mut at = bytes.strip_prefix(ADMISSION_MAGIC.as_slice()).ok_or_else(bad)?;
    let mut take = |n: usize| -> Result<&[u8]> {
        if at.len() < n {
            return Err(bad());
        }
        let (head, rest) = at.split_at(n);
        at = rest;
        Ok(head)
    };
    let tables = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes"));
    let mut states = Vec::new();
    for _ in 0..tables {
        let table = u16::from_le_bytes(take(2)?.try_into().expect("2 bytes"));
        let mut counters = [Vec::new(), Vec::new()];
        for c in &mut counters {
            let n = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
            let n = usize::try_from(n).ok().and_then(|n| n.checked_mul(4)).ok_or_else(bad)?;
            *c = take(n)?.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))).collect();
        }
        let uses_added = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
        let admit_above = u64::from_le_bytes(take(8)?.try_into().expect("8 bytes"));
        let [pushes, uses] = counters;
        states.push((table, AdmissionState { pushes, uses, uses_added, admit_above }));
    }
    if !at.is_empty() {
        return Err(bad());
    }
    Ok(states)
}

/// Node `m`'s admission file in checkpoint `dir`, checked against its manifest's size (before
/// it is read) and checksum; empty where the node wrote none.
fn read_admission(dir: &Path, m: &Manifest) -> Result<Vec<(u16, AdmissionState)>> {
    let Some((name, bytes, checksum)) = &m.admission else { return Ok(Vec::new()) };
    let (path, data) = read_listed(dir, name, *bytes, checksum)?;
    parse_admission(&data, &path)
}

/// The file `name` a manifest lists in checkpoint `dir` with `bytes` and `checksum`: its path
/// and contents, its size checked before it is read and its checksum after.
fn read_listed(dir: &Path, name: &str, bytes: u64, checksum: &str) -> Result<(std::path::PathBuf, Vec<u8>)> {
    let path = dir.join(name);
    let len = std::fs::metadata(&path).map_err(|e| io("reading", &path, e))?.len();
    if len != bytes {
        return Err(err(format!("{}: {len} bytes, but its manifest says {bytes}", path.display())));
    }
    let data = std::fs::read(&path).map_err(|e| io("reading", &path, e))?;
    if file_checksum(&data) != checksum {
        return Err(err(format!("{}: its checksum does not match its manifest's (damaged)", path.display())));
    }
    Ok((path, data))
}

/// The name of node `rank`'s copy of its spill file of table `table` in a checkpoint.
pub(super) fn spill_name(rank: usize, table: u16) -> String {
    format!("node-{rank}.table-{table}.spill")
}

/// The spill files a node's manifest `m` lists in checkpoint `dir`, each checked against its
/// size (before it is read) and checksum, whole, and of its table's value length: (table id,
/// its rows).
pub(super) fn read_spills(dir: &Path, m: &Manifest) -> Result<Vec<(u16, crate::dynamic::SpillFile)>> {
    let mut spills = Vec::with_capacity(m.spills.len());
    for (table, name, bytes, checksum) in &m.spills {
        let (path, data) = read_listed(dir, name, *bytes, checksum)?;
        let spill = crate::dynamic::spill::parse(&data, &path)?;
        let value_len = m.tables.iter().find(|t| t.0 == *table).map(|t| t.3);
        if spill.torn_bytes != 0 || value_len != Some(spill.value_len) || !m.dynamic.contains(table) {
            return Err(err(format!("{}: not the whole spill file of dynamic table {table} with {value_len:?} values per id", path.display())));
        }
        spills.push((*table, spill));
    }
    Ok(spills)
}

/// The spilled rows in checkpoint `dir` of the ids node `config.rank` is now the home of, per
/// table of `config` that evicts (by name): (table, ids, values), for its new spill files.
pub(crate) fn spilled_rows(dir: &Path, config: &Config) -> Result<Vec<crate::dynamic::spill::SpilledRows>> {
    let manifests = whole(dir)?;
    let mut rows = Vec::new();
    for m in &manifests {
        for (table, spill) in read_spills(dir, m)? {
            let Some(name) = m.tables.iter().find(|t| t.0 == table).map(|t| &t.6) else { continue };
            let Some((ours, dynamic)) = config.tables.iter().enumerate().find(|(_, t)| &t.name == name).and_then(|(i, t)| Some((i as u16, t.dynamic?))) else {
                continue;
            };
            if !dynamic.eviction.evicts() || spill.value_len != config.tables[ours as usize].value_len {
                continue;
            }
            let (mut ids, mut values) = (Vec::new(), Vec::new());
            for (i, &id) in spill.ids.iter().enumerate() {
                if dynamic.home_of(id, config.nodes) == config.rank {
                    ids.push(id);
                    values.extend_from_slice(&spill.values[i * spill.value_len..(i + 1) * spill.value_len]);
                }
            }
            rows.push(crate::dynamic::spill::SpilledRows { table: ours, ids, values });
        }
    }
    Ok(rows)
}

/// What the checkpoint's homes' admission filters and eviction histories learnt, into this
/// node's: on the node count that wrote it, this rank's own (its ids' homes are the same);
/// on another, every node's added up (an id's counts are at its old home, wherever that was;
/// other ids' only raise estimates, as a count-min sketch's collisions do). A table of
/// another capacity (another sketch size) starts them afresh, said in the log.
pub(super) fn restore_admission(dir: &Path, manifests: &[Manifest], config: &Config, indexes: &[Option<IdIndex>]) -> Result<()> {
    let same_nodes = manifests.first().is_some_and(|m| m.nodes == config.nodes);
    for m in manifests {
        if same_nodes && m.file.0 != values_name(config.rank) {
            continue;
        }
        for (table, state) in read_admission(dir, m)? {
            let Some(name) = m.tables.iter().find(|t| t.0 == table).map(|t| &t.6) else { continue };
            let Some(index) = config.tables.iter().position(|t| &t.name == name).and_then(|i| indexes.get(i)).and_then(Option::as_ref) else { continue };
            if !index.add_admission_state(&state) {
                tracing::warn!(node = config.rank, table = %name, "the checkpoint's admission state is of another capacity: the table starts it afresh");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An admission file reads back as written; counts beyond its bytes, a cut file and
    /// bytes left over are refused before anything is sized by them.
    #[test]
    fn admission_files_round_trip_and_bad_counts_are_refused() {
        let states = vec![
            (0u16, AdmissionState { pushes: vec![1, 2, 3], uses: Vec::new(), uses_added: 0, admit_above: 0 }),
            (3u16, AdmissionState { pushes: Vec::new(), uses: vec![u32::MAX, 0], uses_added: 77, admit_above: 4 }),
        ];
        let mut bytes = Vec::new();
        write_admission(&mut bytes, &states).unwrap();
        let path = Path::new("node-0.admission");
        assert_eq!(parse_admission(&bytes, path).unwrap(), states);
        let mut inflated = bytes.clone();
        inflated[14..22].copy_from_slice(&u64::MAX.to_le_bytes());
        for bad in [&inflated[..], &bytes[..bytes.len() - 1], &[&bytes[..], &[0u8]].concat(), b"FERRYCK1"] {
            let e = parse_admission(bad, path).unwrap_err().to_string();
            assert!(e.contains("node-0.admission"), "{e}");
        }
    }
}
