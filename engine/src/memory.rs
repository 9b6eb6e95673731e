//! What a node's tables will take, and what the machine has: checked before anything is
//! allocated, so that a model too large for the machine is refused with both figures instead of
//! being found out by the kernel's out-of-memory killer half-way through start-up.

use crate::config::{Config, TableSpec};
use crate::error::{Error, Result};
use crate::store::VALUES_OFFSET;

/// Bytes this machine has for new allocations: the kernel's estimate of available memory
/// (`MemAvailable`), or less where a cgroup (v2) limit leaves less. `None` where neither can be
/// read.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|text| {
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib * 1024)
    });
    let read = |name: &str| std::fs::read_to_string(format!("/sys/fs/cgroup/{name}")).ok().and_then(|t| t.trim().parse::<u64>().ok());
    let cgroup = read("memory.max").map(|max| max.saturating_sub(read("memory.current").unwrap_or(0)));
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Bytes of one key's slot in `spec`'s arena: head version, values, optimizer state, tail.
fn slot_bytes(spec: &TableSpec) -> u64 {
    (VALUES_OFFSET + spec.value_len * spec.element.size() + 4 * spec.state_len() + 4) as u64
}

/// Bytes a node of `config` allocates for its tables at start: every table's slot map (a word
/// per key) and the slots of its share of the keys (and of the replicated keys, twice: slot and
/// image). Keys that relocate to the node take more as they come.
pub fn table_bytes(config: &Config) -> u64 {
    let nodes = config.nodes.max(1) as u64;
    config.tables.iter().map(|t| t.keys * 4 + t.keys.div_ceil(nodes) * slot_bytes(t) + 2 * t.replicated_keys() * slot_bytes(t)).sum()
}

/// Bytes of every key's slot on one node: what a node may come to hold when keys relocate to it.
pub fn all_keys_bytes(config: &Config) -> u64 {
    config.tables.iter().map(|t| t.keys * (4 + slot_bytes(t))).sum()
}

/// A number of bytes for people.
pub fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.1} KiB", b as f64 / 1024.0),
    }
}

/// Refuses to start a node whose tables cannot fit in what the machine has: with a loopback
/// coordinator every node of the cluster runs on this machine, so all of theirs count. Warns
/// (rank 0) when keys relocating may come to need more than that.
pub(crate) fn check_tables_fit(config: &Config) -> Result<()> {
    let Some(available) = available_memory() else { return Ok(()) };
    let local_nodes = if coordinator_is_local(config) { config.nodes.max(1) as u64 } else { 1 };
    let needed = table_bytes(config).saturating_mul(local_nodes);
    let largest = config.tables.iter().max_by_key(|t| t.keys.saturating_mul(slot_bytes(t)));
    let largest = largest.map_or(String::new(), |t| format!("; the largest, '{}', is {} keys of {} bytes", t.name, t.keys, slot_bytes(t)));
    let on = if local_nodes > 1 { format!("the {local_nodes} nodes on this machine") } else { "this node".into() };
    if needed > available {
        return Err(Error::Config(format!(
            "the tables need about {} on {on}{largest}, but this machine has {} available: use fewer or smaller tables, or more machines",
            human(needed),
            human(available)
        )));
    }
    let relocating = all_keys_bytes(config).saturating_mul(local_nodes);
    if config.relocation && config.nodes > 1 && relocating > available && config.rank == 0 {
        tracing::warn!(
            "the tables take about {} on {on} at start, and up to {} should their keys relocate to every node; this machine has {} available",
            human(needed),
            human(relocating),
            human(available)
        );
    }
    Ok(())
}

/// Whether the coordinator's address is this machine's loopback (every node runs here).
fn coordinator_is_local(config: &Config) -> bool {
    use std::net::ToSocketAddrs;
    config.nodes <= 1 || config.coordinator.to_socket_addrs().is_ok_and(|mut a| a.all(|a| a.ip().is_loopback()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_memory_is_estimated_per_node_and_a_model_beyond_the_machine_is_refused() {
        let mut config = Config::new(vec![TableSpec::new("users", 1000, 15), TableSpec::new("items", 100, 15)]);
        // 4 + 60 + 4 bytes a slot, a word of slot map per key.
        assert_eq!(table_bytes(&config), 1000 * (4 + 68) + 100 * (4 + 68));
        config.nodes = 2;
        config.coordinator = "127.0.0.1:7000".into();
        assert_eq!(table_bytes(&config), 1000 * 4 + 500 * 68 + 100 * 4 + 50 * 68);
        assert_eq!(all_keys_bytes(&config), 1100 * 72);
        let available = available_memory().expect("this machine says what it has");
        assert!(available > 1 << 20, "{available}");
        assert!(check_tables_fit(&config).is_ok());
        let mut huge = Config::new(vec![TableSpec::new("users", 2000, 100_000_000)]);
        huge.nodes = 2;
        huge.coordinator = "127.0.0.1:7000".into();
        let e = check_tables_fit(&huge).unwrap_err().to_string();
        assert!(e.contains("on the 2 nodes on this machine") && e.contains("'users', is 2000 keys of 400000008 bytes") && e.contains("available"), "{e}");
        assert_eq!(human(3 << 29), "1.5 GiB");
    }
}
