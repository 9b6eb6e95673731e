//! The state of one key shard: relocations in transit to this node (with their reservations
//! and the operations queued behind them), one-sided writes this node posted for keys leaving
//! it, and the deadlines of transits that may have to be given up.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use super::requester::OpId;
use super::wire::AccessKind;
use crate::error::Error;
use crate::stats::ShardCounters;
use crate::store::{RemoteAddr, Reserved};
use crate::util::FastMap;

/// Bits of a reservation id below the shard index.
pub const RESV_SHARD_SHIFT: u32 = 26;
/// Bits of a write id below the shard index.
pub const WR_SHARD_SHIFT: u32 = 56;

/// The shard a reservation id (a relocation write's immediate) belongs to.
#[inline]
pub fn resv_shard(resv: u32) -> usize {
    (resv >> RESV_SHARD_SHIFT) as usize
}

/// The shard a write id belongs to.
#[inline]
pub fn wr_shard(wr_id: u64) -> usize {
    (wr_id >> WR_SHARD_SHIFT) as usize
}

/// An operation item waiting for its key to land at this node.
#[derive(Debug)]
pub(crate) enum Queued {
    /// An item of an access (of this node's workers, or of another node's).
    Access { origin: u16, op: OpId, part: u32, index: u32, kind: AccessKind, values: Vec<f32> },
    /// The home node moved the key on before it arrived here.
    Relocate { new_owner: u16, resv: u32, to: RemoteAddr },
}

/// A key relocating to this node.
pub(crate) struct Transit {
    /// The reserved slot the value lands in.
    pub slot: Option<Reserved>,
    pub queue: Vec<Queued>,
    /// `localize` operations waiting for the key.
    pub waiters: Waiters,
    pub started: u64,
    /// Set when a peer was lost or the transfer timed out: the value may never arrive, so new
    /// operations on the key fail at once instead of queueing. (Boxed: rare, and a transit per
    /// relocating key is moved in and out of its map.)
    pub suspect: Option<Box<Error>>,
    pub suspect_since: u64,
    /// The transfer did not come within the grace period after a loss: hand-overs of the key
    /// fail at once. (If it still lands, the key is published here.)
    pub abandoned: bool,
    /// Tells this transit's deadlines from those of an earlier transit of the same key.
    pub generation: u64,
    /// Asked for on a home's intent grant alone (`MOVE_GRANTED`; a plain `localize` that
    /// joins it clears this): the home may decline it.
    pub granted: bool,
}

/// Keys a `localize` still waits for, shared by its worker and the shards: a landing counts
/// down, and only the last one wakes the worker.
pub(crate) type Countdown = Arc<AtomicUsize>;

/// A `localize` waiting for a key.
pub(crate) type Waiter = (OpId, Countdown);

/// The `localize` operations waiting for a key: nearly always one, kept without an allocation.
#[derive(Debug, Default, Clone)]
pub(crate) struct Waiters {
    first: Option<Waiter>,
    rest: Vec<Waiter>,
}

impl Waiters {
    /// One waiter.
    pub fn one(waiter: Waiter) -> Waiters {
        Waiters { first: Some(waiter), rest: Vec::new() }
    }

    pub fn push(&mut self, waiter: Waiter) {
        if self.first.is_none() {
            self.first = Some(waiter);
        } else {
            self.rest.push(waiter);
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Waiter> + '_ {
        self.first.iter().chain(self.rest.iter())
    }
}

/// The slots one posted write reads from: its first key's, and those of the keys that joined
/// it as a run (consecutive slots here and at the new owner).
#[derive(Debug)]
pub(crate) struct Outgoing {
    pub first: Reserved,
    pub rest: Vec<Reserved>,
}

/// What a deadline is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum DeadlineKind {
    /// The transfer should have landed by now.
    Stuck,
    /// The grace period after a loss is over.
    Grace,
}

/// A deadline: (when, table, key, transit generation, kind).
pub(crate) type Deadline = (u64, u16, u64, u64, DeadlineKind);

/// One shard's state; lives behind its own lock in [`super::Core`].
pub struct Shard {
    index: usize,
    pub(crate) transits: FastMap<(u16, u64), Transit>,
    pub(crate) reservations: FastMap<u32, (u16, u64)>,
    next_resv: u32,
    /// Whether `next_resv` wrapped: ids from then on may still be in use.
    resv_wrapped: bool,
    /// Slots whose values are being written to another node, by write id (several for a
    /// run of keys written at once).
    pub(crate) outgoing: FastMap<u64, Outgoing>,
    next_wr: u64,
    /// Deadlines of transits that may not land, in the order they were set. Every deadline of
    /// a kind is "when it was set + a fixed time", so each queue is ordered by deadline and a
    /// deadline that no longer matters is dropped when it reaches the front (no heap, no scan).
    stuck: VecDeque<Deadline>,
    grace: VecDeque<Deadline>,
    next_generation: u64,
    pub(crate) counters: ShardCounters,
}

impl Shard {
    /// An empty shard with index `index`.
    pub fn new(index: usize) -> Shard {
        Shard {
            index,
            transits: FastMap::default(),
            reservations: FastMap::default(),
            next_resv: 1,
            resv_wrapped: false,
            outgoing: FastMap::default(),
            next_wr: 1,
            stuck: VecDeque::new(),
            grace: VecDeque::new(),
            next_generation: 1,
            counters: ShardCounters::default(),
        }
    }

    /// Keys relocating to this node in this shard.
    #[cfg(any(test, feature = "sim"))]
    pub fn keys_in_transit(&self) -> usize {
        self.transits.len()
    }

    /// A reservation id not in use, carrying the shard index in its top bits. Until the
    /// counter first wraps every id is new; only after that is it looked up among those in use
    /// (a lookup per key is a cache miss when a `localize` reserves 100 000 keys).
    pub(crate) fn allocate_resv(&mut self) -> u32 {
        let base = (self.index as u32) << RESV_SHARD_SHIFT;
        let mask = (1u32 << RESV_SHARD_SHIFT) - 1;
        loop {
            let r = base | (self.next_resv & mask);
            let next = self.next_resv.wrapping_add(1) & mask;
            self.resv_wrapped |= next == 0;
            self.next_resv = next.max(1);
            if r & mask != 0 && !(self.resv_wrapped && self.reservations.contains_key(&r)) {
                return r;
            }
        }
    }

    /// A write id, carrying the shard index in its top bits.
    pub(crate) fn allocate_wr(&mut self) -> u64 {
        let id = ((self.index as u64) << WR_SHARD_SHIFT) | (self.next_wr & ((1 << WR_SHARD_SHIFT) - 1));
        self.next_wr += 1;
        id
    }

    pub(crate) fn next_generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    pub(crate) fn push_deadline(&mut self, d: Deadline) {
        match d.4 {
            DeadlineKind::Stuck => self.stuck.push_back(d),
            DeadlineKind::Grace => self.grace.push_back(d),
        }
    }

    /// Drops deadlines that no longer matter from the front of both queues.
    fn clean(&mut self) {
        while let Some(d) = self.stuck.front().copied() {
            if self.deadline_live(&d) {
                break;
            }
            self.stuck.pop_front();
        }
        while let Some(d) = self.grace.front().copied() {
            if self.deadline_live(&d) {
                break;
            }
            self.grace.pop_front();
        }
    }

    /// The earliest deadline that still matters.
    pub fn poll_timeout(&mut self) -> Option<u64> {
        self.clean();
        match (self.stuck.front(), self.grace.front()) {
            (Some(a), Some(b)) => Some(a.0.min(b.0)),
            (Some(a), None) | (None, Some(a)) => Some(a.0),
            (None, None) => None,
        }
    }

    /// Takes the earliest live deadline if it is due at `now`.
    pub(crate) fn pop_due(&mut self, now: u64) -> Option<Deadline> {
        self.clean();
        let stuck = self.stuck.front().map_or(u64::MAX, |d| d.0);
        let grace = self.grace.front().map_or(u64::MAX, |d| d.0);
        if stuck.min(grace) > now {
            return None;
        }
        if stuck <= grace { self.stuck.pop_front() } else { self.grace.pop_front() }
    }

    fn deadline_live(&self, d: &Deadline) -> bool {
        let (_, table, key, generation, kind) = *d;
        self.transits.get(&(table, key)).is_some_and(|t| {
            t.generation == generation
                && match kind {
                    DeadlineKind::Stuck => t.suspect.is_none(),
                    DeadlineKind::Grace => t.suspect.is_some() && !t.abandoned,
                }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_the_shard_and_skip_ids_in_use() {
        let mut s = Shard::new(5);
        let a = s.allocate_resv();
        assert_eq!(resv_shard(a), 5);
        assert_eq!(s.allocate_resv(), a + 1, "ids are handed out in order");
        // Once the counter wraps, an id still in use (here the first) is skipped.
        s.reservations.insert(a, (0, 0));
        s.next_resv = (1 << RESV_SHARD_SHIFT) - 1;
        let last = s.allocate_resv();
        assert_eq!(last & ((1 << RESV_SHARD_SHIFT) - 1), (1 << RESV_SHARD_SHIFT) - 1);
        let b = s.allocate_resv();
        assert_eq!(b, a + 1, "the id in use is skipped after the wrap, and 0 is never used");
        assert_eq!(resv_shard(b), 5);
        let w = s.allocate_wr();
        assert_eq!(wr_shard(w), 5);
        assert_ne!(w, s.allocate_wr());
    }

    #[test]
    fn stale_deadlines_are_dropped() {
        let mut s = Shard::new(0);
        s.push_deadline((10, 0, 1, 7, DeadlineKind::Stuck));
        assert_eq!(s.poll_timeout(), None, "no transit: the deadline is stale");
        let generation = s.next_generation();
        s.transits.insert(
            (0, 1),
            Transit {
                slot: None,
                queue: Vec::new(),
                waiters: Waiters::default(),
                started: 0,
                suspect: None,
                suspect_since: 0,
                abandoned: false,
                generation,
                granted: false,
            },
        );
        s.push_deadline((20, 0, 1, generation, DeadlineKind::Stuck));
        s.push_deadline((15, 0, 1, generation, DeadlineKind::Grace));
        assert_eq!(s.poll_timeout(), Some(20), "the grace deadline only counts for a suspect transit");
        assert!(s.pop_due(19).is_none());
        assert_eq!(s.pop_due(20).map(|d| d.4), Some(DeadlineKind::Stuck));
    }
}
