//! The C ABI's statistics beyond `FerryStats`' totals: traffic by message kind and the latency
//! distributions (relocation, blocking, replica staleness), as `ferry::Stats` has them.

use std::ffi::{CString, c_char};
use std::sync::OnceLock;

use super::{FerryNode, argument, finalized, guard, handle, put, slice_mut, text};

/// A latency distribution (see `ferry::Latency`): sample count, median, 99th percentile,
/// largest sample and sum in nanoseconds, and samples per bucket of
/// `ferry_latency_bucket_bound_ns` (the last bucket: above every bound).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FerryLatency {
    /// Number of samples.
    pub count: u64,
    /// Median.
    pub p50_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// Largest sample.
    pub max_ns: u64,
    /// Sum of the samples.
    pub sum_ns: u64,
    /// Samples per bucket: `buckets[i]` counts those above bound `i - 1` and at most bound `i`;
    /// `buckets[12]` those above every bound.
    pub buckets: [u64; 13],
}

// The C struct's bucket count is the engine's.
const _: () = assert!(ferry::LATENCY_BUCKET_BOUNDS_NS.len() + 1 == 13);

/// The names of the message kinds, NUL-terminated, made once.
fn kind_names() -> &'static [CString] {
    static NAMES: OnceLock<Vec<CString>> = OnceLock::new();
    NAMES.get_or_init(|| ferry::MessageKind::ALL.iter().map(|k| CString::new(k.name()).expect("kind names have no NUL")).collect())
}

/// How many kinds of message `ferry_node_traffic` counts.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_message_kinds() -> usize {
    ferry::MessageKind::ALL.len()
}

/// The name of message kind `kind` (`access`, `forward`, `response`, `localize`, …; below
/// `ferry_message_kinds()`), or null beyond them. The string lives as long as the program.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_message_kind_name(kind: usize) -> *const c_char {
    kind_names().get(kind).map_or(std::ptr::null(), |name| name.as_ptr())
}

/// The upper bound in nanoseconds of latency bucket `bucket` (below 12: 1 µs to about 4.2 s by
/// powers of 4), or 0 for the last bucket and beyond.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_latency_bucket_bound_ns(bucket: usize) -> u64 {
    ferry::LATENCY_BUCKET_BOUNDS_NS.get(bucket).copied().unwrap_or(0)
}

/// Messages and bytes this node sent, by kind: `messages[k]` and `bytes[k]` for kind `k`, both
/// arrays with room for `kinds` counts, at least `ferry_message_kinds()`.
///
/// # Safety
///
/// `node` is null or a live node; `messages` and `bytes` are null or hold `kinds` writable
/// counts each.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_node_traffic(node: *mut FerryNode, messages: *mut u64, bytes: *mut u64, kinds: usize) -> i32 {
    guard(|| {
        let needed = ferry::MessageKind::ALL.len();
        if kinds < needed {
            return Err(argument(format!("room for {kinds} message kinds; there are {needed} (ferry_message_kinds)")));
        }
        // SAFETY: forwarded from this function's contract.
        let (n, messages, bytes) = unsafe { (handle(node, "node")?, slice_mut(messages, kinds, "messages")?, slice_mut(bytes, kinds, "bytes")?) };
        let n = n.node.as_ref().ok_or_else(finalized)?;
        let traffic = n.stats().traffic;
        messages[..needed].copy_from_slice(&traffic.messages);
        bytes[..needed].copy_from_slice(&traffic.bytes);
        Ok(())
    })
}

/// One of this node's latency distributions, `which` of `relocation` (a localize to the key's
/// arrival), `blocking` (a relocating key out of reach) or `staleness` (replicated keys' age
/// when read), since the node started or its statistics were last reset.
///
/// # Safety
///
/// `node` is null or a live node; `which` is null or NUL-terminated; `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_node_latency(node: *mut FerryNode, which: *const c_char, out: *mut FerryLatency) -> i32 {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (n, which) = unsafe { (handle(node, "node")?, text(which, "which")?) };
        let n = n.node.as_ref().ok_or_else(finalized)?;
        let s = n.stats();
        let l = match which {
            "relocation" => s.relocation_time,
            "blocking" => s.blocking_time,
            "staleness" => s.replication.staleness,
            other => return Err(argument(format!("latency '{other}': expected relocation, blocking or staleness"))),
        };
        let latency = FerryLatency { count: l.count, p50_ns: l.p50_ns, p99_ns: l.p99_ns, max_ns: l.max_ns, sum_ns: l.sum_ns, buckets: l.buckets };
        // SAFETY: forwarded from this function's contract.
        unsafe { put(out, latency, "out") }
    })
}
