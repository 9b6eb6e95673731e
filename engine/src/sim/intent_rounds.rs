//! Declared intents in the simulation ([`super::SimOptions::declared_intents`]): the trainers
//! declare windows of clocks in which they will need keys, and each node's service worker runs
//! the intent service's own rounds — the shipped state machine, [`crate::intent::IntentRounds`]
//! (windows, action timing, level changes, re-asks, what becomes of the homes' grants) — among
//! the random relocations, accesses and replica operations: a round tells the homes the level
//! changes it finds (dropping the replicas of keys whose intent ended first, as the service
//! does), and the grants the homes send back are taken by the machine, which turns them into
//! the node's granted localizes, replica makes and drops of unwanted replicas. A worker's clock
//! here is the number of its script steps so far.

use std::collections::BTreeMap;

use super::{ScriptOp, Sim};
use crate::config::IntentSettings;
use crate::intent::{GrantsTaken, IntentLevel};
use crate::protocol::Grant;

/// What the nodes' intent rounds did over a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeclaredIntentCounts {
    /// Windows declared.
    pub declared: u64,
    /// Rounds run.
    pub rounds: usize,
    /// Keys whose level a round told their homes (re-asks included).
    pub levels_told: usize,
    /// Of those, keys no longer needed.
    pub ended: usize,
    /// Keys the homes granted to move here that the machine took (still intended, not here).
    pub moves: usize,
    /// Keys granted a replica that the machine took.
    pub replicas: usize,
    /// Keys granted a replica no longer intended (their marks and replicas dropped).
    pub unwanted: usize,
}

impl Sim {
    /// Trainer `w` declares that it will need `keys` in the `len` clocks that begin `start`
    /// clocks from now.
    pub(super) fn declare_intent(&mut self, w: usize, keys: Vec<u64>, start: u64, len: u64) {
        let (node, index, clock) = (self.workers[w].node, self.workers[w].index, self.workers[w].intent_clock);
        let window = clock + start..clock + start + len;
        self.log(format!("worker {w}@{node} declares {keys:?} in clocks {window:?}"));
        self.declared.declared += self.intent_rounds[node].declare(&IntentSettings::default(), index, 0, keys, window);
    }

    /// Service worker `w` runs a round of its node's intents: the level changes go to the
    /// homes, ends first, the replicas of keys whose intent ended dropped before.
    pub(super) fn intent_round(&mut self, w: usize) -> Result<(), String> {
        let node = self.workers[w].node;
        let service = self.workers[w].index;
        let clocks: BTreeMap<u16, u64> = self.workers.iter().filter(|o| o.node == node && o.index != service).map(|o| (o.index, o.intent_clock)).collect();
        let changes = self.intent_rounds[node].round(&clocks);
        self.declared.rounds += 1;
        for ((level, table), keys) in changes.levels {
            self.declared.levels_told += keys.len();
            if level == IntentLevel::None {
                self.declared.ended += keys.len();
                self.with_replica_set(node, |m, ctx| m.drop_keys(ctx, table, &keys));
            }
            self.log(format!("worker {w}@{node}'s intent round tells the homes {level:?} for {keys:?}"));
            self.worker_event(w, |step, _| {
                step.signal_intent(table, &keys, level);
                Ok(())
            })?;
        }
        for ((level, table), keys) in changes.reasks {
            self.declared.levels_told += keys.len();
            self.log(format!("worker {w}@{node}'s intent round asks the homes again for {keys:?} ({level:?})"));
            for level in [IntentLevel::None, level] {
                self.worker_event(w, |step, _| {
                    step.signal_intent(table, &keys, level);
                    Ok(())
                })?;
            }
        }
        self.run_replica_actions(w)
    }

    /// Node `node`'s intents take the homes' `granted` moves and replicas: the moves become
    /// granted localizes of a trainer, the replicas makes of the service, the unwanted ones
    /// drops.
    pub(super) fn take_declared_grants(&mut self, node: usize, granted: Vec<(u16, Grant, Vec<u64>)>) {
        let store = self.nodes[node].core.store().clone();
        let GrantsTaken { moves, replicate, unwanted } = self.intent_rounds[node].take_grants(granted, |t, k| store.table(t).slot_of(k).is_some());
        let service = self.replica_sets.get(node).map(|s| s.worker);
        for (_, keys) in unwanted {
            self.declared.unwanted += keys.len();
            if let Some(s) = service {
                self.workers[s].script.push_front(ScriptOp::DropReplicas { keys });
            }
        }
        for (_, keys) in replicate {
            self.grant_replicas(node, keys);
        }
        let Some(w) = (0..self.workers.len()).find(|&w| self.workers[w].node == node) else { return };
        for (_, keys) in moves {
            self.declared.moves += keys.len();
            self.intent_grants += keys.len();
            self.log(format!("node {node}'s intents take the move of {keys:?}: worker {w} localizes them"));
            let asynchronous = !self.opts.location_caches;
            self.workers[w].script.push_front(ScriptOp::Localize { keys, asynchronous, granted: true });
        }
    }
}
