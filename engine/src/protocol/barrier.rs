//! Cluster-wide barriers: every node sends BARRIER to rank 0, which counts arrivals per
//! generation and releases everybody once all nodes have arrived.
//!
//! Rank 0 alone decides each generation's outcome, so that every survivor of a node loss sees a
//! barrier the same way: a node that loses a peer other than rank 0 keeps waiting for rank 0's
//! BARRIER_RELEASE (the lost node may have arrived before it died, and rank 0 may have released
//! the generation already) or BARRIER_FAILED (sent for every generation still incomplete when
//! rank 0 learns of the loss, and in answer to any later arrival). Only the loss of rank 0
//! itself fails a waiting barrier locally.
//!
//! With failover (backups kept: [`Directory::failover`]) a lost node's keys live on and its
//! acknowledged pushes with them, so barriers go on among the survivors: a lost node counts as
//! arrived, the coordinator releases the generations that only waited for it when it learns of
//! the loss, and later generations need the live nodes only.
//!
//! **A lost coordinator.** With failover the coordinator is rank 0 until it is lost, then the
//! lowest-ranked live node ([`Directory::coordinator`]); every node that knows the same losses
//! names the same one. A node that learns that the coordinator is lost sends the new one what
//! the old one may have taken with it: BARRIER again for every generation it waits in, and
//! BARRIER_PASSED for the last generation of each kind it was released from. The old
//! coordinator released a generation only once every node had arrived, so a node that passed
//! it proves that it completed: whoever learns of a passed generation releases every node
//! still waiting in it or an earlier one (the old coordinator may have died halfway through
//! its releases). Arrivals that reach a node before it knows it coordinates (their sender
//! learnt of the loss first) are counted all the same and decided once it learns.

use std::collections::VecDeque;

use super::directory::Directory;
use super::transmit::Transmit;
use super::wire::{self, msg};
use crate::error::{Error, Result};
use crate::stats::MessageKind;
use crate::util::FastMap;

/// Barrier kinds (separate generation counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BarrierKind {
    /// The workers' barrier.
    Workers = 0,
    /// The barrier that starts shutdown.
    Finalize = 1,
}

impl BarrierKind {
    fn from_u8(b: u8) -> Option<BarrierKind> {
        match b {
            0 => Some(BarrierKind::Workers),
            1 => Some(BarrierKind::Finalize),
            _ => None,
        }
    }
}

/// A barrier generation that completed (or failed).
#[derive(Debug, Clone, PartialEq)]
pub struct BarrierEvent {
    /// Which barrier.
    pub kind: BarrierKind,
    /// Its generation.
    pub generation: u32,
    /// `Ok` when every node arrived.
    pub result: Result<()>,
}

/// Sends a BARRIER, BARRIER_RELEASE or BARRIER_PASSED message of generation `generation` of
/// `kind` to `to`.
fn send_barrier(tx: &mut Transmit, to: u16, ty: u8, kind: u8, generation: u32) {
    wire::encode_barrier(tx.buf(to), ty, kind, generation);
    tx.sent(to, MessageKind::Barrier, 12);
}

/// One node's barrier state: generations entered, and at rank 0 the arrivals counted.
pub struct Barriers {
    rank: u16,
    nodes: usize,
    generation: [u32; 2],
    waiting: Vec<(BarrierKind, u32)>,
    /// At the coordinator (or a node about to be: see the module documentation): which nodes
    /// arrived, per open generation.
    arrivals: FastMap<(u8, u32), Vec<bool>>,
    /// Per kind, the latest generation known to have completed cluster-wide (released here,
    /// or passed by a node that reported it): an arrival in it or before is released at once.
    passed: [u32; 2],
    /// Per node and kind, the first generation it takes part in: 0, or for a node that
    /// joined at run time the generation after those open when it joined (see
    /// [`Barriers::next_generations`]). It counts as arrived in the generations before.
    member_from: Vec<[u32; 2]>,
    events: VecDeque<BarrierEvent>,
}

impl Barriers {
    /// Barriers of node `rank` of `nodes`.
    pub fn new(rank: u16, nodes: usize) -> Barriers {
        Barriers {
            rank,
            nodes,
            generation: [0; 2],
            waiting: Vec::new(),
            arrivals: FastMap::default(),
            passed: [0; 2],
            member_from: vec![[0; 2]; nodes],
            events: VecDeque::new(),
        }
    }

    /// At the coordinator, as a node joins: per kind, the first generation the joining node
    /// can take part in — the one after every generation this node entered, passed, or counts
    /// arrivals in. Earlier generations complete without it; a node that arrives in this one
    /// or a later one is waited for until the joining node arrives too.
    pub fn next_generations(&self) -> [u32; 2] {
        let mut next = [0; 2];
        for kind in [BarrierKind::Workers, BarrierKind::Finalize] {
            let k = kind as usize;
            let open = self.arrivals.keys().filter(|&&(kd, _)| kd == kind as u8).map(|&(_, g)| g).max().unwrap_or(0);
            next[k] = self.generation[k].max(self.passed[k]).max(open).saturating_add(1);
        }
        next
    }

    /// `node` joined: it takes part in barriers from generations `from` (per kind).
    pub fn admit(&mut self, node: u16, from: [u32; 2]) {
        if let Some(m) = self.member_from.get_mut(node as usize) {
            *m = from;
        }
    }

    /// The first generations `node` takes part in (see [`Barriers::admit`]).
    pub fn first_generations(&self, node: u16) -> [u32; 2] {
        self.member_from.get(node as usize).copied().unwrap_or_default()
    }

    /// This node joined: its first barrier of each kind is generation `from`.
    pub fn start_at(&mut self, from: [u32; 2]) {
        for (k, first) in from.into_iter().enumerate() {
            let before = first.saturating_sub(1);
            self.generation[k] = self.generation[k].max(before);
            self.passed[k] = self.passed[k].max(before);
        }
        self.admit(self.rank, from);
    }

    /// Whether `node` counts as arrived in `generation` of `kind` without arriving: it is lost
    /// (with failover), or it joined after that generation was open.
    fn excused(&self, node: usize, kind: u8, generation: u32, directory: &Directory) -> bool {
        (directory.failover() && directory.is_lost(node as u16))
            || self.member_from.get(node).and_then(|m| m.get(kind as usize)).is_some_and(|&first| generation < first)
    }

    /// Enters the next generation of `kind`; its release (or failure) appears through
    /// [`Barriers::poll_event`].
    pub fn enter(&mut self, kind: BarrierKind, directory: &Directory, tx: &mut Transmit) -> u32 {
        let generation = {
            let g = &mut self.generation[kind as usize];
            *g += 1;
            *g
        };
        if let Some((peer, reason)) = self.blocking_loss(directory) {
            self.events.push_back(BarrierEvent { kind, generation, result: Err(Error::PeerLost { node: peer as usize, reason }) });
            return generation;
        }
        self.waiting.push((kind, generation));
        self.send_arrival(kind as u8, generation, directory, tx);
        generation
    }

    /// Tells the coordinator this node arrived in `generation` of `kind` (counts it, at the
    /// coordinator itself).
    fn send_arrival(&mut self, kind: u8, generation: u32, directory: &Directory, tx: &mut Transmit) {
        let coordinator = directory.coordinator();
        if coordinator == self.rank {
            self.arrive(kind, generation, self.rank, directory, tx);
        } else {
            send_barrier(tx, coordinator, msg::BARRIER, kind, generation);
        }
    }

    /// Handles BARRIER (at rank 0) or BARRIER_RELEASE sent by node `from`.
    pub fn handle_message(&mut self, from: u16, body: &[u8], directory: &Directory, tx: &mut Transmit) -> Result<()> {
        if body[0] == msg::BARRIER_FAILED {
            let (kind, generation, lost) = wire::decode_barrier_failed(body)?;
            let Some(kind) = BarrierKind::from_u8(kind) else {
                return Err(Error::Protocol(format!("unknown barrier kind {kind}")));
            };
            if self.rank == 0 {
                return Err(Error::Protocol("BARRIER_FAILED sent to the node that coordinates barriers".into()));
            }
            let reason = format!("it was lost before barrier generation {generation} completed (reported by node {from})");
            self.fail(kind, generation, Error::PeerLost { node: lost as usize, reason });
            return Ok(());
        }
        let (kind, generation) = wire::decode_barrier(body)?;
        if BarrierKind::from_u8(kind).is_none() {
            return Err(Error::Protocol(format!("unknown barrier kind {kind}")));
        }
        match body[0] {
            // With failover, a node that learnt of the coordinator's loss before this one may
            // already count this one as the coordinator.
            msg::BARRIER if self.rank == 0 || directory.failover() => {
                self.arrive(kind, generation, from, directory, tx);
                Ok(())
            }
            msg::BARRIER => Err(Error::Protocol("BARRIER sent to a node that does not coordinate barriers".into())),
            msg::BARRIER_PASSED if directory.failover() => {
                self.note_passed(kind, generation, directory, tx);
                Ok(())
            }
            msg::BARRIER_PASSED => Err(Error::Protocol("BARRIER_PASSED without failover".into())),
            _ => {
                self.released(kind, generation);
                Ok(())
            }
        }
    }

    /// Generation `generation` of `kind` completed cluster-wide (a node passed it): every
    /// generation up to it that is open here is released, here and at every live node (they
    /// ignore a release of a generation they do not wait in).
    fn note_passed(&mut self, kind: u8, generation: u32, directory: &Directory, tx: &mut Transmit) {
        let Some(k) = BarrierKind::from_u8(kind) else { return };
        if generation <= self.passed[k as usize] {
            return;
        }
        self.passed[k as usize] = generation;
        let mut open: Vec<u32> = self.arrivals.keys().filter(|&&(kd, g)| kd == kind && g <= generation).map(|&(_, g)| g).collect();
        open.extend(self.waiting.iter().filter(|&&(kd, g)| kd == k && g <= generation).map(|&(_, g)| g));
        open.sort_unstable();
        open.dedup();
        for g in open {
            self.arrivals.remove(&(kind, g));
            self.release_everywhere(kind, g, directory, tx);
        }
    }

    /// A loss that keeps barriers from completing: any, without failover; with it, none (a
    /// lost coordinator is succeeded).
    fn blocking_loss(&self, directory: &Directory) -> Option<(u16, String)> {
        if directory.failover() {
            return None;
        }
        directory.any_lost()
    }

    fn arrive(&mut self, kind: u8, generation: u32, from: u16, directory: &Directory, tx: &mut Transmit) {
        if let Some((lost, _)) = self.blocking_loss(directory) {
            // A node is gone: no generation can complete any more. Tell every live node that
            // waits in it (the arrival may come from a node that has not noticed the loss yet).
            self.arrivals.remove(&(kind, generation));
            self.decide_failed(kind, generation, lost, directory, tx);
            return;
        }
        if BarrierKind::from_u8(kind).is_some_and(|k| generation <= self.passed[k as usize]) {
            // Completed already (its sender repeats an arrival the lost coordinator counted).
            if from == self.rank {
                self.released(kind, generation);
            } else {
                send_barrier(tx, from, msg::BARRIER_RELEASE, kind, generation);
            }
            return;
        }
        let nodes = self.nodes;
        let arrived = self.arrivals.entry((kind, generation)).or_insert_with(|| vec![false; nodes]);
        if let Some(seen) = arrived.get_mut(from as usize) {
            *seen = true;
        }
        self.release_if_complete(kind, generation, directory, tx);
    }

    /// At the coordinator: releases `generation` of `kind` if every node arrived — with
    /// failover, every node not lost.
    fn release_if_complete(&mut self, kind: u8, generation: u32, directory: &Directory, tx: &mut Transmit) {
        if directory.coordinator() != self.rank {
            return;
        }
        let Some(arrived) = self.arrivals.get(&(kind, generation)) else { return };
        if !arrived.iter().enumerate().all(|(n, &a)| a || self.excused(n, kind, generation, directory)) {
            return;
        }
        self.arrivals.remove(&(kind, generation));
        if let Some(k) = BarrierKind::from_u8(kind) {
            self.passed[k as usize] = self.passed[k as usize].max(generation);
        }
        self.release_everywhere(kind, generation, directory, tx);
    }

    /// Releases `generation` of `kind` here and at every live node.
    fn release_everywhere(&mut self, kind: u8, generation: u32, directory: &Directory, tx: &mut Transmit) {
        for node in 0..self.nodes as u16 {
            if node == self.rank {
                self.released(kind, generation);
            } else if !directory.is_lost(node) {
                send_barrier(tx, node, msg::BARRIER_RELEASE, kind, generation);
            }
        }
    }

    fn released(&mut self, kind: u8, generation: u32) {
        let Some(kind) = BarrierKind::from_u8(kind) else { return };
        if let Some(pos) = self.waiting.iter().position(|w| *w == (kind, generation)) {
            self.waiting.remove(pos);
            self.events.push_back(BarrierEvent { kind, generation, result: Ok(()) });
        }
    }

    /// Fails a generation this node waits in (if it does).
    fn fail(&mut self, kind: BarrierKind, generation: u32, error: Error) {
        if let Some(pos) = self.waiting.iter().position(|w| *w == (kind, generation)) {
            self.waiting.remove(pos);
            self.events.push_back(BarrierEvent { kind, generation, result: Err(error) });
        }
    }

    /// At rank 0: generation `generation` of `kind` failed because `lost` is gone; fails it here
    /// and tells every other live node.
    fn decide_failed(&mut self, kind: u8, generation: u32, lost: u16, directory: &Directory, tx: &mut Transmit) {
        for node in 0..self.nodes as u16 {
            if node == self.rank {
                if let Some(k) = BarrierKind::from_u8(kind) {
                    let reason = format!("it was lost before barrier generation {generation} completed");
                    self.fail(k, generation, Error::PeerLost { node: lost as usize, reason });
                }
            } else if !directory.is_lost(node) {
                wire::encode_barrier_failed(tx.buf(node), kind, generation, lost);
                tx.sent(node, MessageKind::Barrier, 14);
            }
        }
    }

    /// Peer `peer` is gone (already marked lost in `directory`). At rank 0, every generation not
    /// completed yet fails, here and at every live node — with failover, those that waited only
    /// for `peer` are released instead; elsewhere, barriers wait for rank 0's verdict unless
    /// `peer` is rank 0. With failover a lost coordinator is succeeded (see the module
    /// documentation).
    pub fn handle_peer_lost(&mut self, peer: u16, error: &Error, directory: &Directory, tx: &mut Transmit) {
        if directory.failover() {
            let coordinator = directory.coordinator();
            if directory.coordinated(peer) {
                if coordinator == self.rank {
                    // This node coordinates now: what it passed completed, and its own
                    // arrivals count here.
                    for kind in [BarrierKind::Workers, BarrierKind::Finalize] {
                        let passed = self.own_passed(kind);
                        if passed > 0 {
                            self.note_passed(kind as u8, passed, directory, tx);
                        }
                    }
                    let waiting = self.waiting.clone();
                    for (kind, generation) in waiting {
                        self.arrive(kind as u8, generation, self.rank, directory, tx);
                    }
                } else {
                    self.report_to(coordinator, tx);
                }
            }
            if coordinator == self.rank {
                // The lost node counts as arrived: generations that waited only for it complete.
                let mut open: Vec<(u8, u32)> = self.arrivals.keys().copied().collect();
                open.sort_unstable();
                for (kind, generation) in open {
                    self.release_if_complete(kind, generation, directory, tx);
                }
            }
        } else if self.rank == 0 {
            let mut open: Vec<(u8, u32)> = self.arrivals.keys().copied().collect();
            open.extend(self.waiting.iter().map(|&(k, g)| (k as u8, g)));
            open.sort_unstable();
            open.dedup();
            self.arrivals.clear();
            for (kind, generation) in open {
                self.decide_failed(kind, generation, peer, directory, tx);
            }
        } else if peer == 0 {
            for (kind, generation) in std::mem::take(&mut self.waiting) {
                self.events.push_back(BarrierEvent { kind, generation, result: Err(error.clone()) });
            }
        }
    }

    /// The coordinator moved without a loss (a node that joined below it was announced by a
    /// coordinator since lost, and coordinates now): it hears from this node what the old one
    /// would have, as after a loss.
    pub fn coordinator_moved(&mut self, directory: &Directory, tx: &mut Transmit) {
        let coordinator = directory.coordinator();
        if coordinator != self.rank {
            self.report_to(coordinator, tx);
        }
    }

    /// Sends a new coordinator what the lost one may have taken with it: the last generation
    /// of each kind this node passed, and its arrival in every generation it waits in.
    fn report_to(&mut self, coordinator: u16, tx: &mut Transmit) {
        for kind in [BarrierKind::Workers, BarrierKind::Finalize] {
            let passed = self.own_passed(kind);
            if passed > 0 {
                send_barrier(tx, coordinator, msg::BARRIER_PASSED, kind as u8, passed);
            }
        }
        for &(kind, generation) in &self.waiting {
            send_barrier(tx, coordinator, msg::BARRIER, kind as u8, generation);
        }
    }

    /// The last generation of `kind` this node was released from: generations of a kind
    /// complete in order, so every one before the first it still waits in.
    fn own_passed(&self, kind: BarrierKind) -> u32 {
        let first_waiting = self.waiting.iter().filter(|&&(k, _)| k == kind).map(|&(_, g)| g).min();
        first_waiting.map_or(self.generation[kind as usize], |g| g - 1)
    }

    /// For a timeout's message: the nodes a generation waits for. The coordinator knows which
    /// nodes have not arrived; any other node waits for its release.
    pub fn not_arrived(&self, kind: BarrierKind, generation: u32, directory: &Directory) -> Vec<usize> {
        let coordinator = directory.coordinator();
        if self.rank != coordinator {
            return vec![coordinator as usize];
        }
        match self.arrivals.get(&(kind as u8, generation)) {
            Some(arrived) => arrived.iter().enumerate().filter(|&(n, &a)| !(a || self.excused(n, kind as u8, generation, directory))).map(|(n, _)| n).collect(),
            None => Vec::new(),
        }
    }

    /// The next released or failed generation.
    pub fn poll_event(&mut self) -> Option<BarrierEvent> {
        self.events.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::TableSpec;
    use crate::stats::CounterRegistry;

    fn parts(rank: u16, nodes: usize) -> (Barriers, Directory, Transmit) {
        let registry = Arc::new(CounterRegistry::default());
        (Barriers::new(rank, nodes), Directory::new(rank as usize, nodes, 1, &[TableSpec::new("t", 4, 1)], false), Transmit::new(rank, nodes, 4096, &registry))
    }

    #[test]
    fn three_nodes_release_together() {
        let mut nodes: Vec<_> = (0..3).map(|r| parts(r, 3)).collect();
        let mut to_zero = Vec::new();
        for (r, (b, d, tx)) in nodes.iter_mut().enumerate() {
            assert_eq!(b.enter(BarrierKind::Workers, d, tx), 1);
            while let Some((to, frame)) = tx.poll_transmit() {
                assert_eq!((r, to), (r, 0));
                to_zero.push((r as u16, frame));
            }
        }
        assert_eq!(to_zero.len(), 2, "rank 0 counts its own arrival without a message");
        let (b0, d0, tx0) = &mut nodes[0];
        assert_eq!(b0.not_arrived(BarrierKind::Workers, 1, d0), vec![1, 2], "rank 0 knows who has not arrived");
        let (from, frame) = &to_zero[0];
        for body in wire::Messages::new(frame) {
            let body = body.unwrap();
            b0.handle_message(*from, body, d0, tx0).unwrap();
            // A repeated arrival is not counted twice.
            b0.handle_message(*from, body, d0, tx0).unwrap();
        }
        assert_eq!(b0.not_arrived(BarrierKind::Workers, 1, d0), vec![2]);
        assert_eq!(b0.poll_event(), None);
        let (from, frame) = &to_zero[1];
        for body in wire::Messages::new(frame) {
            b0.handle_message(*from, body.unwrap(), d0, tx0).unwrap();
        }
        assert_eq!(b0.poll_event().map(|e| e.result), Some(Ok(())));
        let releases: Vec<_> = std::iter::from_fn(|| tx0.poll_transmit()).collect();
        assert_eq!(releases.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2]);
        for (to, frame) in releases {
            let (b, d, tx) = &mut nodes[to as usize];
            for body in wire::Messages::new(&frame) {
                b.handle_message(0, body.unwrap(), d, tx).unwrap();
            }
            assert_eq!(b.poll_event(), Some(BarrierEvent { kind: BarrierKind::Workers, generation: 1, result: Ok(()) }));
        }
    }

    #[test]
    fn lost_peers_fail_barriers_and_bad_messages_are_errors() {
        let (mut b, d, mut tx) = parts(1, 2);
        b.enter(BarrierKind::Finalize, &d, &mut tx);
        d.mark_lost(0, "gone");
        b.handle_peer_lost(0, &Error::PeerLost { node: 0, reason: "x".into() }, &d, &mut tx);
        assert!(b.poll_event().unwrap().result.is_err(), "losing the coordinator fails a waiting barrier");
        assert_eq!(b.enter(BarrierKind::Workers, &d, &mut tx), 1);
        assert!(b.poll_event().unwrap().result.is_err(), "entering with a lost peer fails at once");
        let mut frame = Vec::new();
        wire::encode_barrier(&mut frame, msg::BARRIER, 0, 1);
        let body = wire::Messages::new(&frame).next().unwrap().unwrap();
        assert!(b.handle_message(0, body, &d, &mut tx).is_err(), "only rank 0 counts arrivals");
        let mut frame = Vec::new();
        wire::encode_barrier(&mut frame, msg::BARRIER_RELEASE, 9, 1);
        let body = wire::Messages::new(&frame).next().unwrap().unwrap();
        assert!(b.handle_message(0, body, &d, &mut tx).is_err(), "unknown kind");
    }

    /// `peer` is lost to the node of `b` (its directory marks it, then its barriers learn).
    fn lose(b: &mut Barriers, d: &Directory, tx: &mut Transmit, peer: u16) {
        d.mark_lost(peer, "gone");
        b.handle_peer_lost(peer, &Error::PeerLost { node: peer as usize, reason: "gone".into() }, d, tx);
    }

    /// Delivers every frame `from` has queued to the nodes' barrier state.
    fn deliver(nodes: &mut [(Barriers, Directory, Transmit)], from: usize) {
        let frames: Vec<_> = std::iter::from_fn(|| nodes[from].2.poll_transmit()).collect();
        for (to, frame) in frames {
            let (b, d, tx) = &mut nodes[to as usize];
            for body in wire::Messages::new(&frame) {
                b.handle_message(from as u16, body.unwrap(), d, tx).unwrap();
            }
        }
    }

    /// Nodes `ranks` enter the next generation of `kind`, in this order, each one's messages
    /// delivered at once.
    fn enter_and_deliver(nodes: &mut [(Barriers, Directory, Transmit)], ranks: &[usize], kind: BarrierKind) {
        for &r in ranks {
            let (b, d, tx) = &mut nodes[r];
            b.enter(kind, d, tx);
            deliver(nodes, r);
        }
    }

    #[test]
    fn survivors_agree_on_a_barrier_released_before_a_loss() {
        // Nodes 1 and 2 arrive, rank 0 arrives and releases; node 1 notices node 2's death
        // before the release reaches it. It must still pass, as rank 0 did.
        let mut nodes: Vec<_> = (0..3).map(|r| parts(r, 3)).collect();
        enter_and_deliver(&mut nodes, &[1, 2], BarrierKind::Workers);
        {
            let (b, d, tx) = &mut nodes[0];
            b.enter(BarrierKind::Workers, d, tx);
            assert_eq!(b.poll_event().map(|e| e.result), Some(Ok(())));
        }
        let lost = Error::PeerLost { node: 2, reason: "gone".into() };
        {
            let (b, d, tx) = &mut nodes[1];
            d.mark_lost(2, "gone");
            b.handle_peer_lost(2, &lost, d, tx);
            assert_eq!(b.poll_event(), None, "node 1 waits for rank 0's verdict");
        }
        deliver(&mut nodes, 0);
        assert_eq!(nodes[1].0.poll_event().map(|e| e.result), Some(Ok(())));
    }

    #[test]
    fn with_failover_barriers_go_on_among_the_survivors() {
        let mut nodes = failover_nodes(3);
        // Node 1 waits in generation 1; node 2 dies before arriving; rank 0 arrives.
        {
            let (b, d, tx) = &mut nodes[1];
            b.enter(BarrierKind::Workers, d, tx);
        }
        deliver(&mut nodes, 1);
        {
            let (b, d, tx) = &mut nodes[0];
            b.enter(BarrierKind::Workers, d, tx);
            assert_eq!(b.poll_event(), None, "node 2 has not arrived");
            lose(b, d, tx, 2);
            assert_eq!(b.poll_event().map(|e| e.result), Some(Ok(())), "released without the lost node");
        }
        deliver(&mut nodes, 0);
        assert_eq!(nodes[1].0.poll_event().map(|e| e.result), Some(Ok(())));
        // The next generation needs the two survivors only.
        {
            let (b, d, tx) = &mut nodes[1];
            lose(b, d, tx, 2);
            b.enter(BarrierKind::Workers, d, tx);
            assert_eq!(b.poll_event(), None);
        }
        deliver(&mut nodes, 1);
        {
            let (b, d, tx) = &mut nodes[0];
            b.enter(BarrierKind::Workers, d, tx);
            assert_eq!(b.poll_event().map(|e| e.result), Some(Ok(())));
        }
        deliver(&mut nodes, 0);
        assert_eq!(nodes[1].0.poll_event().map(|e| e.result), Some(Ok(())));
        // Rank 0 is lost too: node 1, the last one, coordinates its own barriers.
        let (b, d, tx) = &mut nodes[1];
        lose(b, d, tx, 0);
        assert_eq!(d.coordinator(), 1);
        b.enter(BarrierKind::Workers, d, tx);
        assert_eq!(b.poll_event().map(|e| e.result), Some(Ok(())));
        assert!(tx.poll_transmit().is_none(), "nobody else to tell");
    }

    fn failover_nodes(n: usize) -> Vec<(Barriers, Directory, Transmit)> {
        (0..n as u16)
            .map(|rank| {
                let registry = Arc::new(CounterRegistry::default());
                let d = Directory::new(rank as usize, n, 1, &[TableSpec::new("t", 4, 1)], false).with_failover(1);
                (Barriers::new(rank, n), d, Transmit::new(rank, n, 4096, &registry))
            })
            .collect()
    }

    /// Delivers `from`'s queued frames to `to` only; frames to others are dropped (a node that
    /// dies halfway through its sends).
    fn deliver_only(nodes: &mut [(Barriers, Directory, Transmit)], from: usize, to: usize) {
        let frames: Vec<_> = std::iter::from_fn(|| nodes[from].2.poll_transmit()).collect();
        for (dest, frame) in frames {
            if dest as usize != to {
                continue;
            }
            let (b, d, tx) = &mut nodes[to];
            for body in wire::Messages::new(&frame) {
                b.handle_message(from as u16, body.unwrap(), d, tx).unwrap();
            }
        }
    }

    #[test]
    fn a_coordinator_lost_halfway_through_its_releases_is_succeeded() {
        // Four nodes arrive; rank 0 releases node 1 and dies before node 2's and 3's releases
        // go out. Node 1 passed the generation, so it completed: whoever coordinates next
        // releases the others, in whichever order the nodes learn of the loss.
        for node_2_learns_first in [false, true] {
            let mut nodes = failover_nodes(4);
            enter_and_deliver(&mut nodes, &[1, 2, 3, 0], BarrierKind::Workers);
            assert_eq!(nodes[0].0.poll_event().map(|e| e.result), Some(Ok(())));
            deliver_only(&mut nodes, 0, 1);
            assert_eq!(nodes[1].0.poll_event().map(|e| e.result), Some(Ok(())));
            let order: &[usize] = if node_2_learns_first { &[2, 3, 1] } else { &[1, 2, 3] };
            for &r in order {
                let (b, d, tx) = &mut nodes[r];
                lose(b, d, tx, 0);
                assert_eq!(d.coordinator(), 1);
                deliver(&mut nodes, r);
                // Whatever node 1 sends in answer reaches the others at once.
                deliver(&mut nodes, 1);
            }
            for r in [2, 3] {
                assert_eq!(nodes[r].0.poll_event().map(|e| e.result), Some(Ok(())), "node {r} (node 2 first: {node_2_learns_first})");
            }
            assert_eq!(nodes[1].0.poll_event(), None, "node 1 was released once");
            // The next generation completes under node 1.
            for r in [2, 3, 1] {
                let (b, d, tx) = &mut nodes[r];
                assert_eq!(b.enter(BarrierKind::Workers, d, tx), 2);
                deliver(&mut nodes, r);
            }
            deliver(&mut nodes, 1);
            for (r, (b, _, _)) in nodes.iter_mut().enumerate().skip(1) {
                assert_eq!(b.poll_event().map(|e| e.result), Some(Ok(())), "generation 2 at node {r}");
            }
        }
    }

    #[test]
    fn a_coordinator_lost_before_everyone_arrived_is_succeeded() {
        // Nodes 1 and 2 arrive (rank 0 counts them) and rank 0 dies: nobody passed, so the new
        // coordinator counts the arrivals again, its own and node 3's later one included.
        let mut nodes = failover_nodes(4);
        for r in [1, 2] {
            let (b, d, tx) = &mut nodes[r];
            b.enter(BarrierKind::Finalize, d, tx);
            deliver(&mut nodes, r);
        }
        for r in [2, 1] {
            let (b, d, tx) = &mut nodes[r];
            lose(b, d, tx, 0);
            deliver(&mut nodes, r);
        }
        assert_eq!(nodes[1].0.not_arrived(BarrierKind::Finalize, 1, &nodes[1].1), vec![3]);
        assert_eq!(nodes[2].0.not_arrived(BarrierKind::Finalize, 1, &nodes[2].1), vec![1]);
        assert_eq!(nodes[1].0.poll_event(), None, "node 3 has not arrived");
        {
            // Node 3 arrives before it learns of the loss: its BARRIER goes to the dead node.
            let (b, d, tx) = &mut nodes[3];
            b.enter(BarrierKind::Finalize, d, tx);
            assert_eq!(tx.poll_transmit().map(|(to, _)| to), Some(0));
            lose(b, d, tx, 0);
            deliver(&mut nodes, 3);
        }
        deliver(&mut nodes, 1);
        for (r, (b, _, _)) in nodes.iter_mut().enumerate().skip(1) {
            assert_eq!(b.poll_event().map(|e| e.result), Some(Ok(())), "node {r}");
        }
    }

    #[test]
    fn a_node_that_joins_takes_part_from_the_next_generation_on() {
        // Node 2 of 3 is gone; node 1 waits in generation 1, rank 0 has not arrived yet. Node
        // 2 joins (a fresh node): generation 1 still completes without it, generation 2 waits
        // for it.
        let mut nodes = failover_nodes(3);
        for r in [0, 1] {
            let (b, d, tx) = &mut nodes[r];
            lose(b, d, tx, 2);
        }
        enter_and_deliver(&mut nodes, &[1], BarrierKind::Workers);
        let from = nodes[0].0.next_generations();
        assert_eq!(from, [2, 1], "after the generation node 1 waits in; no finalize yet");
        nodes[2] = {
            let registry = Arc::new(CounterRegistry::default());
            let d = Directory::new(2, 3, 1, &[TableSpec::new("t", 4, 1)], false).with_failover(1);
            (Barriers::new(2, 3), d, Transmit::new(2, 3, 4096, &registry))
        };
        nodes[2].0.start_at(from);
        for r in [0, 1] {
            assert!(nodes[r].1.mark_joined(2));
            nodes[r].0.admit(2, from);
        }
        assert_eq!(nodes[0].0.first_generations(2), from);
        enter_and_deliver(&mut nodes, &[0], BarrierKind::Workers);
        for r in [0, 1] {
            assert_eq!(nodes[r].0.poll_event().map(|e| (e.generation, e.result)), Some((1, Ok(()))), "node {r}");
        }
        enter_and_deliver(&mut nodes, &[0, 1], BarrierKind::Workers);
        assert_eq!(nodes[0].0.not_arrived(BarrierKind::Workers, 2, &nodes[0].1), vec![2], "the joined node is waited for");
        assert_eq!(nodes[0].0.poll_event(), None);
        let (b, d, tx) = &mut nodes[2];
        assert_eq!(b.enter(BarrierKind::Workers, d, tx), 2, "its first barrier is generation 2");
        deliver(&mut nodes, 2);
        deliver(&mut nodes, 0);
        for (r, (b, _, _)) in nodes.iter_mut().enumerate() {
            assert_eq!(b.poll_event().map(|e| (e.generation, e.result)), Some((2, Ok(()))), "node {r}");
        }
    }

    #[test]
    fn survivors_agree_on_a_barrier_a_lost_node_never_reached() {
        // Node 1 waits; node 2 dies before arriving. Rank 0 fails the generation for everyone,
        // naming node 2, and answers later arrivals with the same verdict.
        let mut nodes: Vec<_> = (0..3).map(|r| parts(r, 3)).collect();
        {
            let (b, d, tx) = &mut nodes[1];
            b.enter(BarrierKind::Workers, d, tx);
            lose(b, d, tx, 2);
            assert_eq!(b.poll_event(), None);
        }
        deliver(&mut nodes, 1);
        {
            let (b, d, tx) = &mut nodes[0];
            lose(b, d, tx, 2);
            b.enter(BarrierKind::Workers, d, tx);
            assert!(matches!(b.poll_event().map(|e| e.result), Some(Err(Error::PeerLost { node: 2, .. }))));
        }
        deliver(&mut nodes, 0);
        let event = nodes[1].0.poll_event().expect("a verdict");
        assert!(matches!(&event.result, Err(Error::PeerLost { node: 2, reason }) if reason.contains("reported by node 0")), "{event:?}");
        // A late arrival of another generation gets the same answer.
        let mut frame = Vec::new();
        wire::encode_barrier(&mut frame, msg::BARRIER, 0, 2);
        {
            let (b, d, tx) = &mut nodes[0];
            b.handle_message(1, wire::Messages::new(&frame).next().unwrap().unwrap(), d, tx).unwrap();
        }
        let replies: Vec<_> = std::iter::from_fn(|| nodes[0].2.poll_transmit()).collect();
        let body = wire::Messages::new(&replies[0].1).next().unwrap().unwrap();
        assert_eq!(wire::decode_barrier_failed(body).unwrap(), (0, 2, 2));
    }
}
