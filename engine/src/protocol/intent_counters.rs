//! A node's intent counters: bumped by the protocol (grants, late accesses) and by the intent
//! service, read into [`IntentStats`].

use std::sync::atomic::{AtomicU64, Ordering};

use crate::stats::{IntentStats, LateCause};

/// A node's intent counters (see [`IntentStats`]).
#[derive(Debug, Default)]
pub struct IntentCounters {
    rounds: AtomicU64,
    declared: AtomicU64,
    acted_keys: AtomicU64,
    in_time: AtomicU64,
    lead_clocks: AtomicU64,
    late_accesses: AtomicU64,
    /// Late accesses indexed by `LateCause as usize`.
    late_by_cause: [AtomicU64; LateCause::ALL.len()],
    replicas_made: AtomicU64,
    replicas_kept: AtomicU64,
    replica_syncs: AtomicU64,
    refresh_reads: AtomicU64,
    refresh_bytes: AtomicU64,
    refreshed_by_read: AtomicU64,
    synced_by_push_pull: AtomicU64,
    reasked: AtomicU64,
    declined: AtomicU64,
    drained: AtomicU64,
    drained_again: AtomicU64,
    made_with_pushes: AtomicU64,
    moves_put_off: AtomicU64,
    replicas_lost: AtomicU64,
}

impl IntentCounters {
    pub(crate) fn note_round(&self) {
        self.rounds.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn note_declared(&self, windows: u64) {
        self.declared.fetch_add(windows, Ordering::Relaxed);
    }

    /// A key relocated for an intent landed `lead` clocks before its window starts (`None`:
    /// after it started).
    pub(crate) fn note_landed(&self, lead: Option<u64>) {
        self.acted_keys.fetch_add(1, Ordering::Relaxed);
        if let Some(lead) = lead {
            self.in_time.fetch_add(1, Ordering::Relaxed);
            self.lead_clocks.fetch_add(lead, Ordering::Relaxed);
        }
    }

    /// Late accesses, by cause.
    pub(crate) fn note_late(&self, late: &LateCounts) {
        let total: u64 = late.0.iter().sum();
        if total == 0 {
            return;
        }
        self.late_accesses.fetch_add(total, Ordering::Relaxed);
        for (counter, &n) in self.late_by_cause.iter().zip(&late.0) {
            if n > 0 {
                counter.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    pub(crate) fn note_replicas_made(&self, keys: u64) {
        self.replicas_made.fetch_add(keys, Ordering::Relaxed);
    }

    /// `keys` replicas were kept from departing keys (also counted as made).
    pub(crate) fn note_replicas_kept(&self, keys: u64) {
        self.replicas_made.fetch_add(keys, Ordering::Relaxed);
        self.replicas_kept.fetch_add(keys, Ordering::Relaxed);
    }

    pub(crate) fn note_replica_sync(&self) {
        self.replica_syncs.fetch_add(1, Ordering::Relaxed);
    }

    /// A one-sided read of `bytes` refreshed `keys` run-time replicas.
    pub(crate) fn note_refresh_read(&self, bytes: u64, keys: u64) {
        self.refresh_reads.fetch_add(1, Ordering::Relaxed);
        self.refresh_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.refreshed_by_read.fetch_add(keys, Ordering::Relaxed);
    }

    /// `keys` run-time replicas were synced through a routed push-pull.
    pub(crate) fn note_synced_by_push_pull(&self, keys: u64) {
        self.synced_by_push_pull.fetch_add(keys, Ordering::Relaxed);
    }

    /// `keys` keys' homes were asked again ([`REASK_ROUNDS`]).
    pub(crate) fn note_reasked(&self, keys: u64) {
        self.reasked.fetch_add(keys, Ordering::Relaxed);
    }

    /// `keys` moves this node asked for on a grant were declined by their homes.
    pub(crate) fn note_declined(&self, keys: u64) {
        self.declined.fetch_add(keys, Ordering::Relaxed);
    }

    /// `keys` dropped replicas drained: they served until the push of their deltas was
    /// acknowledged.
    pub(crate) fn note_drained(&self, keys: u64) {
        self.drained.fetch_add(keys, Ordering::Relaxed);
    }

    /// `keys` draining replicas were pushed to meanwhile and drain again with that delta.
    pub(crate) fn note_drained_again(&self, keys: u64) {
        self.drained_again.fetch_add(keys, Ordering::Relaxed);
    }

    /// `keys` replicas were made with pushes sent behind the pull that made them.
    pub(crate) fn note_made_with_pushes(&self, keys: u64) {
        self.made_with_pushes.fetch_add(keys, Ordering::Relaxed);
    }

    /// `keys` granted moves were put off while a sync round carried their replicas' deltas.
    pub(crate) fn note_moves_put_off(&self, keys: u64) {
        self.moves_put_off.fetch_add(keys, Ordering::Relaxed);
    }

    /// `keys` keys granted a replica here were found lost with their owners.
    pub(crate) fn note_replicas_lost(&self, keys: u64) {
        self.replicas_lost.fetch_add(keys, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> IntentStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let [late_unacted, late_unanswered, late_untaken, late_moving, late_replicating, late_left] = self.late_by_cause.each_ref().map(get);
        IntentStats {
            rounds: get(&self.rounds),
            declared: get(&self.declared),
            acted_keys: get(&self.acted_keys),
            in_time: get(&self.in_time),
            lead_clocks: get(&self.lead_clocks),
            late_accesses: get(&self.late_accesses),
            late_unacted,
            late_unanswered,
            late_untaken,
            late_moving,
            late_replicating,
            late_left,
            replicas_made: get(&self.replicas_made),
            replicas_kept: get(&self.replicas_kept),
            replica_syncs: get(&self.replica_syncs),
            refresh_reads: get(&self.refresh_reads),
            refresh_bytes: get(&self.refresh_bytes),
            refreshed_by_read: get(&self.refreshed_by_read),
            synced_by_push_pull: get(&self.synced_by_push_pull),
            reasked: get(&self.reasked),
            declined: get(&self.declined),
            drained: get(&self.drained),
            drained_again: get(&self.drained_again),
            made_with_pushes: get(&self.made_with_pushes),
            moves_put_off: get(&self.moves_put_off),
            replicas_lost: get(&self.replicas_lost),
        }
    }
}

/// Late accesses of one access, indexed by `LateCause as usize`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LateCounts(pub [u64; LateCause::ALL.len()]);

impl LateCounts {
    /// Counts one more late access of cause `cause`.
    pub fn add(&mut self, cause: LateCause) {
        self.0[cause as usize] += 1;
    }
}
