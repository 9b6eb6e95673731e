//! Eviction rounds of dynamic tables ([`crate::dynamic::Eviction`]; the argument is in
//! `dynamic::evict`): the home offers ids (EVICT), every node answers after its grace period
//! with those it keeps (EVICTED), and the home frees the slots of the others.
//!
//! EVICT and EVICTED share ASSIGN's layout (`protocol::assign`): `[type][flags 0][table u16]
//! [round u32][count u32]`, then `count` values of eight bytes: in EVICT, each id offered
//! followed by its slot key; in EVICTED, each id kept followed by the uses the node counted.
//!
//! The steps here are driven by the runtime's eviction thread (`runtime::eviction`) and by the
//! simulator alike: [`Step::begin_eviction_round`] when a home runs short or a time to live
//! passed, [`Step::answer_evictions`] when grace periods may have ended, and
//! [`Step::evictions_after_loss`] when nodes were lost.

use std::collections::VecDeque;

use super::Step;
use super::assign::{Assign, encode};
use super::wire::msg;
use crate::dynamic::{Evictor, Grace, Pass, ROUND_IDS};
use crate::error::{Error, Result};
use crate::stats::MessageKind;
use crate::util::FastMap;

/// A node's eviction state: per table it is a home of, its rounds; and its answers waiting for
/// their grace periods, oldest first.
#[derive(Default)]
pub(crate) struct Evictions {
    evictors: FastMap<u16, Evictor>,
    graces: VecDeque<Grace>,
}

impl Evictions {
    /// Whether a round of `table` is open here.
    pub fn round_open(&self, table: u16) -> bool {
        self.evictors.get(&table).is_some_and(Evictor::is_open)
    }

    /// Whether the oldest answer's grace period ended under `pins`.
    #[cfg(any(test, feature = "sim"))]
    pub fn grace_ended(&self, pins: &crate::dynamic::Pins) -> bool {
        self.graces.front().is_some_and(|g| pins.passed(g.epoch))
    }
}

impl Step<'_, '_> {
    /// As a home of dynamic table `table`, begins an eviction round unless one is open: offers
    /// the ids its clock hand picks to every live node (itself too). A home that runs short
    /// (`short`) looks for the ids used least, a sixteenth of its capacity and as many as it
    /// deferred since the last round began (up to half its capacity: new ids arriving faster
    /// than rounds free room make rounds larger); a round for the time to live goes round once
    /// (offering the ids not used since the last one, clearing the others' counts). See
    /// `IdIndex::offer_round`. Returns whether a round began (there were ids to offer).
    pub(crate) fn begin_eviction_round(&mut self, table: u16, short: bool) -> bool {
        let core = self.core;
        let Some(index) = core.id_index(table).filter(|i| i.spec().eviction.evicts()) else { return false };
        let mut evictions = core.evictions.lock();
        let evictor = evictions.evictors.entry(table).or_default();
        if evictor.is_open() {
            return false;
        }
        let capacity = index.spec().capacity;
        // Slot keys a node intends are in use (see `Step::intents_at_home`, which claims their
        // ids under the same lock, so an intent either finds its id offered or keeps it out).
        let offered = {
            let homes = core.intent_homes().lock();
            let intended = |key: u64| homes.intends(table, key);
            if short {
                let most = (capacity / 16 + index.deferred_since_last_round()).min(capacity / 2).max(1);
                index.offer_round(ROUND_IDS.min(most as usize), Pass::Short, intended)
            } else {
                index.offer_round(ROUND_IDS, Pass::Ttl, intended)
            }
        };
        if offered.is_empty() {
            return false;
        }
        let dir = core.directory();
        let members: Vec<u16> = (0..dir.nodes() as u16).filter(|&n| !dir.is_lost(n)).collect();
        let round = evictor.begin(members.iter().copied());
        for &node in members.iter().filter(|&&n| n != dir.rank()) {
            let values = offered.iter().flat_map(|&(id, key)| [id, key]);
            let bytes = encode(self.tx.buf(node), msg::EVICT, 0, table, round, values.collect::<Vec<_>>().into_iter());
            self.tx.sent(node, MessageKind::Eviction, bytes);
        }
        // This node's own answer waits for its grace period like the others'; the ids left its
        // index when they were offered.
        let epoch = core.pins.advance();
        evictions.graces.push_back(Grace { home: dir.rank(), table, round, offered, epoch });
        true
    }

    /// An EVICT from `from`: the offered ids with no uses counted here leave this node's index
    /// (unless it holds their slots); its answer waits for the grace period.
    pub(crate) fn handle_evict(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let m = Assign::decode(body)?;
        let core = self.core;
        let Some(index) = core.id_index(m.table).filter(|i| i.spec().eviction.evicts()) else {
            return Err(Error::Protocol(format!("EVICT for table {}, which does not evict", m.table)));
        };
        if !m.len().is_multiple_of(2) || m.len() / 2 > ROUND_IDS {
            return Err(Error::Protocol(format!("EVICT from node {from} with {} values", m.len())));
        }
        let capacity = index.spec().capacity;
        let values: Vec<u64> = m.values().collect();
        let offered: Vec<(u64, u64)> = values.chunks_exact(2).map(|p| (p[0], p[1])).collect();
        if let Some(&(id, key)) = offered.iter().find(|&&(_, key)| key / capacity != from as u64) {
            return Err(Error::Protocol(format!("EVICT from node {from} offers id {id} with slot key {key}, outside its range")));
        }
        index.offer(&offered, |key| core.holds_slot_or_replica(m.table, key));
        let epoch = core.pins.advance();
        core.evictions.lock().graces.push_back(Grace { home: from, table: m.table, round: m.request, offered, epoch });
        Ok(())
    }

    /// Answers the rounds whose grace periods ended (every worker of this node is idle or began
    /// after the ids left its index): with the ids still in its index or whose slots it holds,
    /// and the uses it counted of each. A home's answer to its own round may complete it.
    pub(crate) fn answer_evictions(&mut self) {
        let core = self.core;
        let rank = core.directory().rank();
        loop {
            let grace = {
                let mut evictions = core.evictions.lock();
                match evictions.graces.front() {
                    Some(g) if core.pins.passed(g.epoch) => evictions.graces.pop_front(),
                    _ => None,
                }
            };
            let Some(grace) = grace else { return };
            let Some(index) = core.id_index(grace.table) else { continue };
            if grace.home == rank {
                // The home holds its slots itself: whether it still does is looked at when it
                // frees them.
                self.evicted_answer(rank, grace.table, grace.round, Vec::new());
                continue;
            }
            if core.directory().is_lost(grace.home) {
                continue;
            }
            let kept = index.keeps(&grace.offered, |key| core.holds_slot_or_replica(grace.table, key));
            let values: Vec<u64> = kept.into_iter().flat_map(|(id, uses)| [id, uses]).collect();
            let bytes = encode(self.tx.buf(grace.home), msg::EVICTED, 0, grace.table, grace.round, values.into_iter());
            self.tx.sent(grace.home, MessageKind::Eviction, bytes);
        }
    }

    /// An EVICTED from `from`: its answer to one of this home's rounds.
    pub(crate) fn handle_evicted(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let m = Assign::decode(body)?;
        if self.core.id_index(m.table).is_none_or(|i| !i.spec().eviction.evicts()) {
            return Err(Error::Protocol(format!("EVICTED for table {}, which does not evict", m.table)));
        }
        if !m.len().is_multiple_of(2) || m.len() / 2 > ROUND_IDS {
            return Err(Error::Protocol(format!("EVICTED from node {from} with {} values", m.len())));
        }
        let values: Vec<u64> = m.values().collect();
        self.evicted_answer(from, m.table, m.request, values.chunks_exact(2).map(|p| (p[0], p[1])).collect());
        Ok(())
    }

    /// Node `from` answered round `round` of `table`, keeping `kept`: closes the round if it
    /// was the last answer.
    fn evicted_answer(&mut self, from: u16, table: u16, round: u32, kept: Vec<(u64, u64)>) {
        let closed = self.core.evictions.lock().evictors.get_mut(&table).and_then(|e| e.answer(from, round, kept));
        if let Some(kept) = closed {
            self.core.finish_eviction(table, &kept);
        }
    }

    /// Rounds no longer wait for lost nodes' answers (what those nodes mapped went with them).
    pub(crate) fn evictions_after_loss(&mut self) {
        let core = self.core;
        let lost: Vec<u16> = core.directory().lost_nodes().into_iter().map(|(n, _)| n).collect();
        if lost.is_empty() {
            return;
        }
        let closed: Vec<(u16, FastMap<u64, u64>)> = {
            let mut evictions = core.evictions.lock();
            evictions.graces.retain(|g| !lost.contains(&g.home));
            let mut closed = Vec::new();
            for (&table, evictor) in evictions.evictors.iter_mut() {
                for &node in &lost {
                    if let Some(kept) = evictor.lost(node) {
                        closed.push((table, kept));
                    }
                }
            }
            closed
        };
        for (table, kept) in closed {
            core.finish_eviction(table, &kept);
        }
    }
}

impl super::Core {
    /// Whether this node holds slot key `key` of `table`, or a run-time replica of it (made or
    /// being made for intent: its pushes not yet sent to the owner would reach the slot's next
    /// id, and its value would be read as that id's), so that it keeps the slot's id in an
    /// eviction round.
    fn holds_slot_or_replica(&self, table: u16, key: u64) -> bool {
        let guard = self.store.lock(table, key);
        guard.slot().is_some() || self.store.table(table).dynamic().is_some_and(|d| d.get(key).is_some() || d.is_making(key))
    }

    /// Closes the round of `table` that every node answered: frees the slots of the ids nobody
    /// kept that this home still holds, writing them back to zeros with a fresh optimizer
    /// state. Where evicted rows are spilled, each freed slot's id and value are queued first
    /// ([`Core::take_spilled`]).
    pub(crate) fn finish_eviction(&self, table: u16, kept: &FastMap<u64, u64>) {
        let Some(index) = self.id_index(table) else { return };
        let store = &self.store;
        let t = store.table(table);
        let zeros = vec![0u8; 4 * (t.value_len() + t.state_len())];
        let spilling = self.spilled.is_some();
        let (mut spilled_ids, mut spilled_values) = (Vec::new(), Vec::new());
        let mut value = vec![0.0f32; if spilling { t.value_len() } else { 0 }];
        let (freed, stranded): (Vec<_>, Vec<_>) = index.finish_round(kept).into_iter().partition(|&(key, id)| {
            let guard = store.lock(table, key);
            let Some(slot) = guard.slot() else { return false };
            if spilling {
                slot.read(&mut value);
                spilled_ids.push(id);
                spilled_values.extend_from_slice(&value);
            }
            slot.write_all_le_bytes(&zeros);
            true
        });
        tracing::debug!(node = self.directory.rank(), table, freed = freed.len(), stranded = stranded.len(), kept = kept.len(), "an eviction round closed");
        if let Some(queue) = &self.spilled
            && !spilled_ids.is_empty()
        {
            queue.lock().push(crate::dynamic::spill::SpilledRows { table, ids: spilled_ids, values: spilled_values });
        }
        let freed: Vec<u64> = freed.into_iter().map(|(key, _)| key).collect();
        index.free_slots(&freed, stranded);
    }

    /// The rows freed since the last call where evicted rows are spilled ([`Core::spill_evicted`]):
    /// per round closed, the table, the evicted ids and their values, for the node's eviction
    /// thread to write ([`crate::dynamic::spill`]).
    pub(crate) fn take_spilled(&self) -> Vec<crate::dynamic::spill::SpilledRows> {
        self.spilled.as_ref().map(|queue| std::mem::take(&mut *queue.lock())).unwrap_or_default()
    }

    /// Queues the rows of the ids this node evicts as a home for spilling (from then on).
    pub(crate) fn spill_evicted(&mut self) {
        self.spilled = Some(parking_lot::Mutex::new(Vec::new()));
    }

    /// Eviction's state.
    pub(crate) fn evictions(&self) -> &parking_lot::Mutex<Evictions> {
        &self.evictions
    }

    /// The workers' pins for eviction's grace periods.
    pub(crate) fn pins(&self) -> &crate::dynamic::Pins {
        &self.pins
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// EVICT carries pairs and EVICTED ids in ASSIGN's layout, checked the same way.
    #[test]
    fn messages_share_assigns_layout() {
        let mut out = Vec::new();
        encode(&mut out, msg::EVICT, 0, 2, 9, [7u64, 3, u64::MAX, 4].into_iter());
        let m = Assign::decode(&out[4..]).unwrap();
        assert_eq!((m.table, m.request, m.values().collect::<Vec<_>>()), (2, 9, vec![7, 3, u64::MAX, 4]));
        assert!(Assign::decode(&out[4..out.len() - 8]).is_err(), "a body shorter than its count says");
        let mut odd = Vec::new();
        encode(&mut odd, msg::EVICT, 0, 2, 9, [7u64, 3, 5].into_iter());
        assert!(Assign::decode(&odd[4..]).is_ok_and(|m| m.len() == 3), "an odd count decodes; handle_evict refuses it");
    }
}
