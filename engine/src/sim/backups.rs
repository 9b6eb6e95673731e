//! Backups and failover in the simulation (`protocol::backup`), driven as the runtime's backup
//! thread and workers drive them: a node begins a round when answers are held for one or a
//! worker waits for one (and once at the start, so that every key has an image); a write is
//! acknowledged to its worker only once a round that began after it completed. A crash then
//! fails the node's keys over to its successor.
//!
//! The check is the promise: **no acknowledged push is lost** with one backup and one
//! crash. A crashed node's writes that were not acknowledged float (they may or may not have
//! taken effect), those that were stay in its workers' histories; at the end every key is
//! read where the survivors serve it, after everything, so the consistency checker holds each
//! final value to every acknowledged write of every worker, the crashed node's included.

use super::Sim;
use crate::consistency::Event;
use crate::protocol::Progress;

/// A write of a worker whose effect waits to be backed up.
#[derive(Debug, Clone, Copy)]
pub(super) struct AwaitingBackup {
    /// The round whose completion acknowledges it.
    pub round: u32,
    /// Its events in the worker's history.
    pub events: (usize, usize),
    /// Whether the worker waits for it (a synchronous operation) before it goes on.
    pub synchronous: bool,
}

impl Sim {
    /// A write of worker `w` completed (its events `from..to`): with backups it is
    /// acknowledged once a round that begins after now completed.
    pub(super) fn await_backup(&mut self, w: usize, from: usize, to: usize, synchronous: bool) {
        if !self.opts.backups {
            return;
        }
        let counters = self.nodes[self.workers[w].node].core.backup_counters();
        let round = counters.round_after_now();
        counters.want(round);
        self.log(format!("worker {w}'s write (events {from}..{to}) waits for backup round {round}"));
        self.workers[w].awaiting_backup.push(AwaitingBackup { round, events: (from, to), synchronous });
    }

    /// With backups and a crash to come: which of `keys` the node that is to crash serves in
    /// worker `w`'s node's view (its own, and those it stands in for), counting it as live
    /// (empty once that node knows it lost). Reads of them go there, and may see writes that are
    /// never backed up: the surviving history cannot hold them (see `InFlight`). With
    /// `even_if_known`, also once that node knows (for a read that completed since).
    pub(super) fn victim_reads(&self, w: usize, keys: &[u64], even_if_known: bool) -> Vec<bool> {
        if !self.opts.backups {
            return Vec::new();
        }
        let Some((first, _)) = self.opts.crash else { return Vec::new() };
        let dir = self.nodes[self.workers[w].node].core.directory();
        let partitioner = &dir.tables()[0].partitioner;
        let mut reads: Vec<bool> = Vec::new();
        for victim in std::iter::once(first).chain(self.opts.crash_also) {
            let incarnation = self.nodes[victim].incarnation;
            let victim = victim as u16;
            // Gone in an earlier incarnation (it left, and a fresh node is joining in its rank)
            // is not known lost: reads waiting for the join go to the fresh node.
            if dir.is_lost(victim) && dir.incarnation(victim) == incarnation && !even_if_known {
                continue;
            }
            // With relocation a key is wherever it moved: the victim serves its own workers,
            // and the keys it holds or awaits (as the simulation sees it; it may hold a key
            // for a while in between, and the operations it answered are noted as they are,
            // `victim_answers`).
            let victim_table = self.nodes[victim as usize].core.store().table(0);
            let own = self.workers[w].node == victim as usize;
            let served = keys.iter().map(|&key| {
                if self.opts.relocation {
                    own || !matches!(victim_table.residence(key), crate::store::Residence::Away)
                } else {
                    dir.stand_in_once_joined(partitioner.home(key) as u16, victim) == victim
                }
            });
            if reads.is_empty() {
                reads = served.collect();
            } else {
                reads.iter_mut().zip(served).for_each(|(read, served)| *read |= served);
            }
        }
        reads
    }

    /// With relocation: notes the operations whose answers `frame` (from `from` to `to`)
    /// carries when `from` is a node that crashes in this run (see `victim_answers`).
    pub(super) fn note_victim_answers(&mut self, from: usize, to: usize, frame: &[u8]) {
        if !(self.opts.relocation && self.opts.backups) || !(self.opts.crash.map(|(n, _)| n) == Some(from) || self.opts.crash_also == Some(from)) {
            return;
        }
        for message in crate::protocol::wire::Messages::new(frame).flatten() {
            if message.first() == Some(&crate::protocol::wire::msg::RESPONSE)
                && let Some(op) = crate::protocol::wire::op_of(message)
            {
                self.victim_answers.insert((to, op));
            }
        }
    }

    /// Writes whose round completed are acknowledged.
    pub(super) fn settle_backups(&mut self) {
        if !self.opts.backups {
            return;
        }
        for w in 0..self.workers.len() {
            let node = self.workers[w].node;
            if self.worker_crashed(w) {
                continue;
            }
            let counters = self.nodes[node].core.backup_counters();
            self.workers[w].awaiting_backup.retain(|a| !counters.completed(a.round));
        }
    }

    /// Nodes where a round would begin now (a waiting worker or the watchdog begins it): one
    /// is due (answers held or a worker waiting for a round none under way covers, and room
    /// for one more), or none was ever begun.
    pub(super) fn backups_ready(&self) -> Vec<usize> {
        if !self.opts.backups {
            return Vec::new();
        }
        (0..self.nodes.len())
            .filter(|&n| {
                let node = &self.nodes[n];
                if node.crashed {
                    return false;
                }
                let (_, under_way) = node.core.backup_pending();
                node.core.backup_round_due() || (!under_way && node.core.backup_counters().last_begun() == 0) || node.core.leave_check_due()
            })
            .collect()
    }

    /// Node `node`'s backup watchdog: it takes a leave that gives keys back a step further
    /// (see `protocol::leave`), and begins a backup round if one is due.
    pub(super) fn backup_round(&mut self, node: usize) -> Result<(), String> {
        let core = &self.nodes[node].core;
        let (_, under_way) = core.backup_pending();
        let due = core.backup_round_due() || (!under_way && core.backup_counters().last_begun() == 0);
        let mut started = None;
        self.node_event(node, |step, _, _| {
            step.advance_leave();
            if due {
                started = step.begin_backup_round(false);
            }
            Ok(Progress::Done)
        })?;
        if let Some(s) = started {
            self.log(format!("node {node} begins backup round {} to {:?}", s.number, s.targets));
        }
        Ok(())
    }

    /// At the end of a run with a crash: the crashed node's writes not acknowledged float, and
    /// so do its operations still in flight (their pushes may have reached their owners).
    pub(super) fn float_unacknowledged(&mut self) {
        if !self.opts.backups {
            return;
        }
        for w in 0..self.workers.len() {
            if !self.worker_crashed(w) {
                continue;
            }
            let mut ranges: Vec<(usize, usize)> = self.workers[w].awaiting_backup.drain(..).map(|a| a.events).collect();
            ranges.extend(self.workers[w].in_flight.iter().filter_map(|f| f.events()));
            for (from, to) in ranges {
                self.drop_events(w, from, to);
            }
        }
    }

    /// After a crash with backups: each key is held by exactly one survivor (a node that left
    /// is none), or by none if no write of it was ever acknowledged (its owner crashed before
    /// its first round), and its value there is read after everything.
    pub(super) fn final_reads_after_crash(&self, history: &mut crate::consistency::History) -> Result<(), String> {
        let lanes = self.opts.lanes;
        let survives = |n: usize| !self.nodes[n].crashed && !self.nodes[n].left;
        // A fresh node that joined in the crashed node's rank serves its share again.
        let rejoined = Self::rejoiner_of(&self.opts).filter(|&n| self.opts.leave.is_none() && survives(n) && self.nodes[n].core.join_state().1);
        for key in 0..self.opts.keys {
            let holders: Vec<usize> = (0..self.nodes.len()).filter(|&n| survives(n) && self.nodes[n].core.store().table(0).slot_of(key).is_some()).collect();
            match holders[..] {
                [owner] => {
                    if let Some(rejoined) = rejoined
                        && self.nodes[owner]
                            .core
                            .directory()
                            .stand_in_once_joined(self.nodes[owner].core.directory().tables()[0].partitioner.home(key) as u16, rejoined as u16)
                            == rejoined as u16
                        && owner != rejoined
                    {
                        return Err(format!("key {key} of node {rejoined}, which joined in the crashed node's rank, is held by node {owner}"));
                    }
                    let mut value = vec![0.0; lanes];
                    let store = self.nodes[owner].core.store();
                    let guard = store.lock(0, key);
                    guard.slot().expect("held").read(&mut value);
                    drop(guard);
                    history.record_after_all(key, Event::Pull { value });
                }
                [] => {
                    let acknowledged = self.workers.iter().flat_map(|w| &w.events).any(|(k, e)| *k == key && !matches!(e, Event::Pull { .. }));
                    if acknowledged {
                        return Err(format!("key {key} was lost with its node although writes of it were acknowledged"));
                    }
                }
                _ => return Err(format!("key {key} is held by survivors {holders:?}")),
            }
        }
        Ok(())
    }
}

impl Sim {
    /// With relocation and backups, at the end of a run without a loss (every round done):
    /// the image of every key on each node that backs it up while its owner holds it — the
    /// owner's successors at its home, the home otherwise (see `Directory::backup_targets_of`)
    /// — is its value. A key handed over is backed up there before it lands, and what its new
    /// owner writes to it after.
    pub(super) fn check_images_follow_keys(&self) -> Result<(), String> {
        for owner in 0..self.nodes.len() {
            let core = &self.nodes[owner].core;
            let (dir, store) = (core.directory(), core.store());
            let partitioner = &dir.tables()[0].partitioner;
            for key in 0..self.opts.keys {
                let guard = store.lock(0, key);
                let Some(slot) = guard.slot() else { continue };
                let mut value = Vec::new();
                slot.append_all_le_bytes(&mut value);
                drop(guard);
                let home = dir.home(0, key);
                let targets = if home as usize == owner { dir.backup_targets() } else { dir.backup_targets_of(owner as u16, home) };
                let (start_home, index) = (partitioner.home(key) as u16, partitioner.home_index(key));
                for t in targets {
                    let image = self.nodes[t as usize].core.backups().lock().images().get(0, start_home, index).map(<[u8]>::to_vec);
                    if image.as_deref() != Some(&value[..]) {
                        return Err(format!(
                            "key {key}, held by node {owner} (homed at {home}): node {t} keeps {image:?} as its image, not its value {value:?}"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The rank a fresh node takes with [`SimOptions::rejoin`](super::SimOptions::rejoin): the
    /// leaver's, or without a leave the crashed node's.
    pub(super) fn rejoiner_of(opts: &super::SimOptions) -> Option<usize> {
        if !opts.rejoin {
            return None;
        }
        opts.leave.or(opts.crash.map(|(node, _)| node))
    }

    /// With [`super::SimOptions::leave`]: asks the node to leave once its workers are done
    /// (as `Node::leave` needs), and notes when it has left. Returns whether it asked now.
    pub(super) fn leave_when_done(&mut self) -> Result<bool, String> {
        let Some(node) = self.opts.leave.filter(|&n| self.nodes[n].incarnation == 0) else { return Ok(false) };
        let (asked, left) = self.nodes[node].core.leave_state();
        if left {
            if !self.nodes[node].left {
                self.log(format!("node {node} has left"));
                self.nodes[node].left = true;
            }
            return Ok(false);
        }
        let done = self
            .workers
            .iter()
            .filter(|w| w.node == node && w.incarnation == 0)
            .all(|w| w.script.is_empty() && w.in_flight.is_empty() && w.streaming.is_none() && w.awaiting_backup.is_empty() && w.requester.pending() == 0);
        if asked || !done || self.nodes[node].crashed {
            return Ok(false);
        }
        self.log(format!("node {node} asks to leave"));
        self.node_event(node, |step, _, _| step.ask_to_leave().map(|_| Progress::Done))?;
        Ok(true)
    }

    /// With [`SimOptions::rejoin`](super::SimOptions::rejoin): once the leaver has left, its
    /// links are empty (the runtime closes them once every peer handled its LEFT) and no node
    /// has a backup round due or under way (the keys the leaver handed over are on a second
    /// node: a crash before that is a second change the backups do not cover), a fresh node
    /// takes its rank and asks the lowest-ranked member to let it join. Its workers (the second
    /// incarnation's) get requesters of the new core and start once it joined. Returns whether
    /// it asked now.
    pub(super) fn rejoin_when_gone(&mut self) -> Result<bool, String> {
        let Some(node) = Self::rejoiner_of(&self.opts) else { return Ok(false) };
        let gone = if self.opts.leave.is_some() { self.nodes[node].left } else { self.nodes[node].crashed && self.unaware.is_empty() };
        if !gone || self.nodes[node].incarnation > 0 {
            return Ok(false);
        }
        let n = self.opts.nodes;
        let empty = |c: usize| self.frames[c].is_empty() && self.writes[c].is_empty();
        if !(0..n).all(|o| empty(node * n + o) && empty(o * n + node)) || self.late.iter().any(|l| !l.frames.is_empty()) {
            return Ok(false);
        }
        let members = || (0..n).filter(|&m| m != node && !self.nodes[m].crashed && !self.nodes[m].left);
        if members().any(|m| self.nodes[m].core.backup_pending() != (false, false) || self.nodes[m].core.backup_counters().wanted_round().is_some()) {
            return Ok(false);
        }
        let Some(contact) = members().next() else { return Ok(false) };
        let mut fresh = Self::start_node(&self.opts, node).map_err(|e| e.to_string())?;
        fresh.incarnation = 1;
        for w in self.workers.iter_mut().filter(|w| w.node == node && w.incarnation == 1) {
            w.requester = fresh.core.requester(w.index, 1);
            w.tx = fresh.core.transmit();
        }
        self.nodes[node] = fresh;
        self.log(format!("a fresh node {node} asks node {contact} to join"));
        self.node_event(node, |step, _, _| step.ask_to_join(contact as u16))?;
        Ok(true)
    }
}
