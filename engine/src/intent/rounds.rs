//! What a node's intent service decides, as a state machine with no thread, clock or lock: the
//! windows its workers declared ([`IntentTable`]), each worker's action timing
//! ([`ActionTiming`]), each round's level changes for the homes, and what becomes of the homes'
//! grants (moves of keys still intended and not here, replicas, unwanted replica grants). The
//! service's thread (`worker::intent::service`) feeds it declarations, clocks, grants and
//! landings and does what it answers; the simulator feeds it the same.

use std::collections::BTreeMap;

use super::{ActionTiming, IntentLevel, IntentTable};
use crate::config::IntentSettings;
use crate::protocol::{Grant, IntentCounters};

/// What a round found for the homes.
#[derive(Debug, Default)]
pub(crate) struct LevelChanges {
    /// Per (level, table): the keys whose home must learn the new level (ends sort first).
    pub levels: BTreeMap<(IntentLevel, u16), Vec<u64>>,
    /// Keys whose homes are asked again (`IntentTable::take_reasks`).
    pub reasks: BTreeMap<(IntentLevel, u16), Vec<u64>>,
    /// Whether any window was taken, started or dropped.
    pub windows_moved: bool,
}

/// What the homes' grants come to, per table.
#[derive(Debug, Default)]
pub(crate) struct GrantsTaken {
    /// Keys to relocate here: still intended, not here.
    pub moves: Vec<(u16, Vec<u64>)>,
    /// Keys to keep replicas of: still intended (held here or not: a key held here is kept as a
    /// replica when it leaves).
    pub replicate: Vec<(u16, Vec<u64>)>,
    /// Keys granted a replica that are no longer intended: their marks, and any replica a
    /// departure kept meanwhile, go.
    pub unwanted: Vec<(u16, Vec<u64>)>,
}

/// A node's intents and its workers' timing.
#[derive(Debug, Default)]
pub(crate) struct IntentRounds {
    /// The windows, per key.
    pub table: IntentTable,
    /// Each declaring worker's clock-rate estimate.
    workers: BTreeMap<u16, ActionTiming>,
    /// Keys that lost windows with a worker that left.
    orphaned: Vec<(u16, u64)>,
}

impl IntentRounds {
    /// Whether no window is declared.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Worker `worker` will need `keys` of `table` in clocks `window` (`settings`: the node's;
    /// the first declaration of a worker starts its timing). Returns how many windows were
    /// added.
    pub fn declare(&mut self, settings: &IntentSettings, worker: u16, table: u16, keys: impl IntoIterator<Item = u64>, window: std::ops::Range<u64>) -> u64 {
        self.table.gap = settings.gap;
        self.table.shared_gap = settings.shared_gap;
        self.workers.entry(worker).or_insert_with(|| ActionTiming::from_settings(settings));
        keys.into_iter().map(|key| self.table.add(table, key, worker, window.start, window.end) as u64).sum()
    }

    /// Worker `worker` left: its windows end (the next round tells their homes).
    pub fn forget_worker(&mut self, worker: u16) {
        let gone = self.table.forget_worker(worker);
        self.orphaned.extend(gone);
        self.workers.remove(&worker);
    }

    /// One round at the workers' `clocks` (steps 1–2 of the service's round): each worker's
    /// rate estimate and horizon, the windows moved along, and the level changes the homes
    /// must learn.
    pub fn round(&mut self, clocks: &BTreeMap<u16, u64>) -> LevelChanges {
        let mut at = BTreeMap::new();
        for (&w, timing) in self.workers.iter_mut() {
            let clock = clocks.get(&w).copied().unwrap_or(0);
            at.insert(w, (clock, timing.round(clock)));
        }
        let max_horizon = at.values().map(|h| h.1).max().unwrap_or(0);
        let max_clock = at.values().map(|h| h.0).max().unwrap_or(0);
        let clock = |w: u16| at.get(&w).map_or(0, |h| h.0);
        let mut touched = self.table.advance(max_horizon, |w| at.get(&w).map_or(0, |h| h.1), max_clock, clock);
        touched.append(&mut self.orphaned);
        let windows_moved = !touched.is_empty();
        let mut levels: BTreeMap<(IntentLevel, u16), Vec<u64>> = BTreeMap::new();
        for (t, k) in touched {
            if let Some(level) = self.table.relevel(t, k, clock) {
                levels.entry((level, t)).or_default().push(k);
            }
        }
        LevelChanges { levels, reasks: self.table.take_reasks(), windows_moved }
    }

    /// Takes the homes' `grants` (table, grant, keys): moves of keys still intended that are
    /// not here (`here` says whether a key is held here), replicas of keys still intended, and
    /// the unwanted rest of the replica grants. A move counts as granted at once; a replica once
    /// the replica set took it ([`IntentRounds::replicas_taken`]).
    pub fn take_grants(&mut self, grants: Vec<(u16, Grant, Vec<u64>)>, here: impl Fn(u16, u64) -> bool) -> GrantsTaken {
        let mut taken = GrantsTaken::default();
        for (table, grant, keys) in grants {
            let (keys, stale): (Vec<u64>, Vec<u64>) =
                keys.into_iter().filter(|&k| grant == Grant::Replicate || !here(table, k)).partition(|&k| self.table.signalled(table, k) != IntentLevel::None);
            if grant == Grant::Replicate && !stale.is_empty() {
                taken.unwanted.push((table, stale));
            }
            if keys.is_empty() {
                continue;
            }
            match grant {
                Grant::Move => {
                    for &key in &keys {
                        self.table.note_granted(table, key, false);
                    }
                    taken.moves.push((table, keys));
                }
                Grant::Replicate => {
                    self.table.mark_shared(table);
                    taken.replicate.push((table, keys));
                }
            }
        }
        taken
    }

    /// The replica set took the replica grant of `keys` of `table`.
    pub fn replicas_taken(&mut self, table: u16, keys: &[u64]) {
        for &key in keys {
            self.table.note_granted(table, key, true);
        }
    }

    /// A relocation of `keys` of `table` the service started completed; those `here` landed
    /// (a key whose home declined the move, granted elsewhere since, did not). Notes each, and
    /// how many clocks before its window started it landed.
    pub fn landed(&mut self, table: u16, keys: &[u64], clocks: &BTreeMap<u16, u64>, here: impl Fn(u64) -> bool, counters: &IntentCounters) {
        let clock = |w: u16| clocks.get(&w).copied().unwrap_or(0);
        for &key in keys.iter().filter(|&&key| here(key)) {
            let lead = self.table.earliest(table, key, clock).and_then(|w| w.start.checked_sub(clock(w.worker))).filter(|&lead| lead > 0);
            counters.note_landed(lead);
            self.table.note_landed(table, key);
        }
    }

    /// Worker `worker`'s timing (tests).
    #[cfg(test)]
    pub fn add_worker(&mut self, worker: u16, settings: &IntentSettings) {
        self.workers.entry(worker).or_insert_with(|| ActionTiming::from_settings(settings));
    }
}
