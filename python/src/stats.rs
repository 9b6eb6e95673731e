//! A node's statistics as a typed object (`Node.stats()`), read like the engine's `Stats`:
//! attributes, and `stats["name"]` or `as_dict()` for code that wants a mapping.

use ferry_engine as engine;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A node's counters at one moment (`Node.stats()`): key accesses by where they were served,
/// relocations, traffic, latencies (seconds), replicas and intent signalling.
#[pyclass(module = "ferry", frozen, get_all)]
#[derive(Clone)]
pub(crate) struct Stats {
    /// Keys accessed by this node's workers and served from local memory.
    local_accesses: u64,
    /// Keys accessed by this node's workers and served by another node.
    remote_accesses: u64,
    /// Accesses that waited here for a key on its way to this node.
    queued_accesses: u64,
    /// Keys relocated to this node.
    relocations_in: u64,
    /// Keys relocated away from this node.
    relocations_out: u64,
    /// Messages sent to other nodes.
    messages_sent: u64,
    /// Bytes sent to other nodes.
    bytes_sent: u64,
    /// Bytes of message frames received from other nodes.
    bytes_received: u64,
    /// Messages sent, by kind (access, forward, response, localize, …).
    messages_by_kind: std::collections::BTreeMap<String, u64>,
    /// Bytes sent, by kind.
    bytes_by_kind: std::collections::BTreeMap<String, u64>,
    /// Median and 99th percentile of the time from a localize to the key's arrival (s).
    relocation_p50_s: f64,
    relocation_p99_s: f64,
    /// Median and 99th percentile of the time a relocating key could not be accessed (its old
    /// owner stopped serving it, the new one did not yet) (s).
    blocking_p50_s: f64,
    blocking_p99_s: f64,
    /// Accesses served by replicas of replicated keys.
    replica_accesses: u64,
    /// Keys moved here for declared intents.
    intent_relocations: u64,
    /// Accesses to intended keys that were not here yet.
    late_accesses: u64,
    /// Run-time replicas made for intents.
    intent_replicas: u64,
    /// Dynamic tables: ids this node created as their home (evicted ones included), ids it
    /// knows the slot keys of, slot keys it can still hand out, ids it evicted, and new ids it
    /// deferred (full, or short of room and not used enough).
    ids_created: u64,
    ids_known: u64,
    keys_free: u64,
    ids_evicted: u64,
    ids_deferred: u64,
}

impl Stats {
    pub(crate) fn of(s: &engine::Stats) -> Stats {
        let seconds = |ns: u64| ns as f64 / 1e9;
        let by_kind = |of: &[u64]| engine::MessageKind::ALL.iter().map(|k| (k.name().to_string(), of[*k as usize])).collect();
        Stats {
            local_accesses: s.local_accesses,
            remote_accesses: s.remote_accesses,
            queued_accesses: s.queued_accesses,
            relocations_in: s.relocations_in,
            relocations_out: s.relocations_out,
            messages_sent: s.traffic.messages.iter().sum(),
            bytes_sent: s.traffic.bytes.iter().sum(),
            bytes_received: s.received_bytes,
            messages_by_kind: by_kind(&s.traffic.messages),
            bytes_by_kind: by_kind(&s.traffic.bytes),
            relocation_p50_s: seconds(s.relocation_time.p50_ns),
            relocation_p99_s: seconds(s.relocation_time.p99_ns),
            blocking_p50_s: seconds(s.blocking_time.p50_ns),
            blocking_p99_s: seconds(s.blocking_time.p99_ns),
            replica_accesses: s.replication.replica_accesses,
            intent_relocations: s.intent.acted_keys,
            late_accesses: s.intent.late_accesses,
            intent_replicas: s.intent.replicas_made,
            ids_created: s.dynamic.ids_created,
            ids_known: s.dynamic.ids_known,
            keys_free: s.dynamic.keys_free,
            ids_evicted: s.dynamic.ids_evicted,
            ids_deferred: s.dynamic.ids_deferred,
        }
    }
}

#[pymethods]
impl Stats {
    /// Every counter by name.
    fn as_dict<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(slf.py());
        for name in NAMES {
            d.set_item(name, slf.getattr(name)?)?;
        }
        Ok(d)
    }

    /// `stats["local_accesses"]`: a counter by name.
    fn __getitem__<'py>(slf: &Bound<'py, Self>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        if !NAMES.contains(&name) {
            return Err(pyo3::exceptions::PyKeyError::new_err(name.to_string()));
        }
        slf.getattr(name)
    }

    fn __repr__(&self) -> String {
        format!(
            "ferry.Stats(local_accesses={}, remote_accesses={}, relocations_in={}, relocations_out={}, messages_sent={}, bytes_sent={})",
            self.local_accesses, self.remote_accesses, self.relocations_in, self.relocations_out, self.messages_sent, self.bytes_sent
        )
    }
}

/// The counters' names, as attributes and keys.
const NAMES: [&str; 23] = [
    "local_accesses",
    "remote_accesses",
    "queued_accesses",
    "relocations_in",
    "relocations_out",
    "messages_sent",
    "bytes_sent",
    "bytes_received",
    "messages_by_kind",
    "bytes_by_kind",
    "relocation_p50_s",
    "relocation_p99_s",
    "blocking_p50_s",
    "blocking_p99_s",
    "replica_accesses",
    "intent_relocations",
    "late_accesses",
    "intent_replicas",
    "ids_created",
    "ids_known",
    "keys_free",
    "ids_evicted",
    "ids_deferred",
];
