//! What a node's replication shares between the protocol and its rounds
//! ([`crate::replication`]): counters, refresh times and the mailbox that takes the homes'
//! acknowledgements to the round waiting for them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use hdrhistogram::Histogram;
use parking_lot::{Condvar, Mutex};

use super::wire::ReplicaImage;
use crate::stats::{Latency, ReplicationStats, Stats};

/// Acknowledgements kept for rounds at most (older ones are dropped first).
const MAILBOX_LIMIT: usize = 4096;

/// A home node's acknowledgement of one REPLICA_DELTA.
#[derive(Debug, Clone)]
pub struct Ack {
    /// The home node.
    pub from: u16,
    /// The table.
    pub table: u16,
    /// The round acknowledged.
    pub round: u32,
    /// The image cut for this node (on the last acknowledgement of a shipment).
    pub image: Option<ReplicaImage>,
}

/// Acknowledgements on their way from the protocol to the driver of the round waiting for
/// them, which hands them to its `replication::Round`.
#[derive(Default)]
pub struct AckMailbox {
    acks: Mutex<Vec<Ack>>,
    arrived: Condvar,
}

impl AckMailbox {
    /// Posts an acknowledgement (called by the protocol when REPLICA_ACK arrives).
    pub fn post(&self, from: u16, table: u16, round: u32, image: Option<ReplicaImage>) {
        let mut acks = self.acks.lock();
        // Acknowledgements nobody waits for (a peer that misbehaves) must not pile up.
        if acks.len() >= MAILBOX_LIMIT {
            acks.remove(0);
        }
        acks.push(Ack { from, table, round, image });
        drop(acks);
        self.arrived.notify_all();
    }

    /// Takes every acknowledgement posted so far (for drivers without threads, like the
    /// simulator).
    #[cfg(any(test, feature = "sim"))]
    pub fn take(&self) -> Vec<Ack> {
        std::mem::take(&mut *self.acks.lock())
    }

    /// Takes every acknowledgement posted so far, waiting until one is or `until` passes.
    pub(crate) fn wait_take(&self, until: Instant) -> Vec<Ack> {
        let mut acks = self.acks.lock();
        if acks.is_empty() {
            self.arrived.wait_until(&mut acks, until);
        }
        std::mem::take(&mut *acks)
    }
}

/// A node's replication counters, refresh times and acknowledgement mailbox.
pub struct Replication {
    /// Per table: cluster time at which the last completed refresh began (0: never).
    refreshed_at: Box<[AtomicU64]>,
    staleness: Mutex<Histogram<u64>>,
    round_time: Mutex<Histogram<u64>>,
    rounds: AtomicU64,
    shipped_keys: AtomicU64,
    shipped_bytes: AtomicU64,
    refresh_reads: AtomicU64,
    refresh_bytes: AtomicU64,
    refreshed_keys: AtomicU64,
    torn_copies: AtomicU64,
    mailbox: AckMailbox,
}

impl Replication {
    /// Counters for `tables` tables.
    pub fn new(tables: usize) -> Replication {
        Replication {
            refreshed_at: (0..tables).map(|_| AtomicU64::new(0)).collect(),
            staleness: Mutex::new(crate::stats::latency_histogram()),
            round_time: Mutex::new(crate::stats::latency_histogram()),
            rounds: AtomicU64::new(0),
            shipped_keys: AtomicU64::new(0),
            shipped_bytes: AtomicU64::new(0),
            refresh_reads: AtomicU64::new(0),
            refresh_bytes: AtomicU64::new(0),
            refreshed_keys: AtomicU64::new(0),
            torn_copies: AtomicU64::new(0),
            mailbox: AckMailbox::default(),
        }
    }

    /// The acknowledgement mailbox.
    pub fn mailbox(&self) -> &AckMailbox {
        &self.mailbox
    }

    /// Records the age of `table`'s replicas as a worker reads one at cluster time `now`.
    pub fn sample_staleness(&self, table: u16, now: u64) {
        let at = self.refreshed_at.get(table as usize).map_or(0, |a| a.load(Ordering::Relaxed));
        if at != 0 {
            let _ = self.staleness.lock().record(now.saturating_sub(at).max(1));
        }
    }

    /// `table`'s replicas were refreshed from reads that began at cluster time `at`.
    pub(crate) fn note_refreshed(&self, table: u16, at: u64) {
        if let Some(a) = self.refreshed_at.get(table as usize) {
            a.store(at, Ordering::Relaxed);
        }
    }

    /// Deltas shipped.
    pub(crate) fn note_shipped(&self, keys: u64, bytes: u64) {
        self.shipped_keys.fetch_add(keys, Ordering::Relaxed);
        self.shipped_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn note_reads(&self, reads: u64, bytes: u64) {
        self.refresh_reads.fetch_add(reads, Ordering::Relaxed);
        self.refresh_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn note_refreshed_keys(&self, keys: u64, torn: u64) {
        self.refreshed_keys.fetch_add(keys, Ordering::Relaxed);
        self.torn_copies.fetch_add(torn, Ordering::Relaxed);
    }

    pub(crate) fn note_round(&self, nanos: u64) {
        self.rounds.fetch_add(1, Ordering::Relaxed);
        let _ = self.round_time.lock().record(nanos.max(1));
    }

    /// Forgets the staleness and round-time samples (for measuring phases).
    pub fn reset_latencies(&self) {
        self.staleness.lock().reset();
        self.round_time.lock().reset();
    }

    /// Adds the counters to `s` (the replica accesses come from the workers' counters).
    pub(crate) fn add_to(&self, s: &mut Stats) {
        let r = &mut s.replication;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        *r = ReplicationStats {
            replica_accesses: r.replica_accesses,
            rounds: get(&self.rounds),
            shipped_keys: get(&self.shipped_keys),
            shipped_bytes: get(&self.shipped_bytes),
            refresh_reads: get(&self.refresh_reads),
            refresh_bytes: get(&self.refresh_bytes),
            refreshed_keys: get(&self.refreshed_keys),
            torn_copies: get(&self.torn_copies),
            staleness: Latency::of(&self.staleness.lock()),
            round_time: Latency::of(&self.round_time.lock()),
        };
    }
}
