//! The steps of a graceful leave: the ask, rank 0's begin, each node's READY behind its last
//! request to the leaver, the leaver's hand-over round and LEFT, and LEFT at the others.

use super::wire::{decode, encode};
use crate::error::{Error, Result};
use crate::protocol::Progress;
use crate::protocol::Step;
use crate::protocol::wire::msg;
use crate::stats::MessageKind;

impl Step<'_, '_> {
    /// This node asks to leave the cluster ([`crate::Node::leave`]): LEAVE_ASK to rank 0, which
    /// coordinates departures and so cannot leave itself. Needs backups (the keys are handed
    /// over as a backup round). Asking twice changes nothing.
    pub fn ask_to_leave(&mut self) -> Result<()> {
        let core = self.core;
        let dir = core.directory();
        if !core.settings().backups {
            return Err(Error::Config("a node can leave only with backups (FERRY_BACKUPS=1): its keys are handed over as a last backup round".into()));
        }
        if dir.rank() == 0 {
            return Err(Error::Config("rank 0 coordinates barriers and departures and cannot leave; any other node can".into()));
        }
        if dir.is_lost(0) {
            return Err(dir.lost_error(0));
        }
        if core.departures().lock().ask(dir.nodes()) {
            let bytes = encode(self.tx.buf(0), msg::LEAVE_ASK, dir.rank());
            self.tx.sent(0, MessageKind::Membership, bytes);
        }
        Ok(())
    }

    /// LEAVE_ASK from `from`, at rank 0: begins its departure at every live node, this one
    /// included (once; a repeated ask begins nothing). Needs every shard.
    pub(crate) fn handle_leave_ask(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let node = decode(body)?;
        let dir = self.directory();
        if dir.rank() != 0 || node != from {
            return Err(Error::Protocol(format!("LEAVE_ASK for node {node} from node {from} to node {}", dir.rank())));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        if !self.core.departures().lock().begin_at_coordinator(node) {
            return Ok(Progress::Done);
        }
        tracing::info!(node = dir.rank(), leaving = node, "a node's departure begins");
        self.send_to_live(&[], MessageKind::Membership, |out| encode(out, msg::LEAVE_BEGIN, node));
        self.begin_departure(node);
        Ok(Progress::Done)
    }

    /// LEAVE_BEGIN from rank 0: `node`'s departure is queued here. Needs every shard.
    pub(crate) fn handle_leave_begin(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let node = decode(body)?;
        let dir = self.directory();
        if from != 0 || node == 0 || node as usize >= dir.nodes() {
            return Err(Error::Protocol(format!("LEAVE_BEGIN for node {node} from node {from}")));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        self.begin_departure(node);
        Ok(Progress::Done)
    }

    /// Queues `node`'s departure (every shard held); it is worked on once it is current.
    fn begin_departure(&mut self, node: u16) {
        if self.directory().is_lost(node) {
            // Lost (or left) before its begin got here: nothing to wait for.
            return;
        }
        let current = self.core.departures().lock().handle_begin(node);
        if let Some(node) = current {
            self.make_current(node);
        }
    }

    /// `node`'s departure is the current one here (every shard held): parts routed to it wait
    /// from now on, and READY goes to it behind every request sent it before — or, on the
    /// leaving node itself, its hand-over may begin.
    fn make_current(&mut self, node: u16) {
        let dir = self.directory();
        dir.set_departing(Some(node));
        if node == dir.rank() {
            self.advance_leave();
        } else {
            let bytes = encode(self.tx.buf(node), msg::LEAVE_READY, node);
            self.tx.sent(node, MessageKind::Membership, bytes);
        }
    }

    /// LEAVE_READY from `from`: it sends this node no more requests.
    pub(crate) fn handle_leave_ready(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let node = decode(body)?;
        let rank = self.directory().rank();
        if node != rank || !self.core.departures().lock().note_ready(from) {
            return Err(Error::Protocol(format!("LEAVE_READY for node {node} from node {from} to node {rank}, which did not ask to leave")));
        }
        self.advance_leave();
        Ok(())
    }

    /// On a leaving node: begins the round that hands the keys over once every live peer is
    /// ready (or after the round under way, which may have read keys before the last writes),
    /// and sends LEFT once that round is acknowledged — behind the answers it released.
    pub(crate) fn advance_leave(&mut self) {
        let core = self.core;
        let dir = core.directory();
        let mut departures = core.departures().lock();
        if departures.wants_final_round(dir.rank(), |n| !dir.is_lost(n))
            && let Some(start) = self.begin_backup_round(false)
        {
            departures.set_final_round(start.number);
        }
        let Some(round) = departures.final_round_pending() else { return };
        if !core.backup_counters().completed(round) {
            return;
        }
        departures.mark_left();
        drop(departures);
        tracing::info!(node = dir.rank(), "keys handed over; this node leaves the cluster");
        self.send_to_live(&[], MessageKind::Membership, |out| encode(out, msg::LEFT, dir.rank()));
        self.tx.touch_backup();
    }

    /// LEFT about `node`, from the node itself or relayed by another: it handed its keys over
    /// and is gone. Needs every shard.
    ///
    /// The first time, this node relays LEFT to every other live node before anything it
    /// sends them later: a request it routes to the leaver's successor must not get there
    /// before the successor knows it serves the leaver's keys. (The successor kept their
    /// images before the leaver sent LEFT to anyone: the round it acknowledged came first.)
    pub(crate) fn handle_left(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let node = decode(body)?;
        let dir = self.directory();
        if node == 0 || node as usize >= dir.nodes() || node == dir.rank() {
            return Err(Error::Protocol(format!("LEFT for node {node} from node {from}")));
        }
        if from == node {
            // Its last message: everything it sent before (answers it released with the
            // hand-over among them) is handled, so its link can close — not sooner, even if
            // a relayed LEFT came first.
            self.tx.note_departed(node);
        }
        if dir.is_lost(node) {
            return Ok(Progress::Done);
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        self.send_to_live(&[node, from], MessageKind::Membership, |out| encode(out, msg::LEFT, node));
        Ok(self.remove_peer(node, super::LEFT_REASON, true))
    }

    /// `peer` left or was lost (every shard held): its departure, if any, ends; the next one
    /// becomes current; a leaving node no longer waits for a lost peer's READY.
    pub(crate) fn end_departure(&mut self, peer: u16) {
        let core = self.core;
        let dir = core.directory();
        let (next, asked) = {
            let mut departures = core.departures().lock();
            (departures.end(peer), departures.asked())
        };
        if dir.departing() == Some(peer) {
            dir.set_departing(None);
        }
        if let Some(node) = next {
            self.make_current(node);
        } else if asked {
            self.advance_leave();
        }
    }
}
