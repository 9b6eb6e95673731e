//! The steps of a graceful leave: the ask, the coordinator's begin (and a new coordinator's
//! takeover), each node's READY behind its last request to the leaver, the leaver's hand-over
//! round and LEFT, and LEFT at the others.

use super::join::{JOIN_BIT, join_of};
use super::wire::{decode, decode_known, decode_left, encode, encode_known, encode_left};
use crate::error::{Error, Result};
use crate::protocol::Progress;
use crate::protocol::Step;
use crate::protocol::wire::msg;
use crate::stats::MessageKind;

impl Step<'_, '_> {
    /// This node asks to leave the cluster ([`crate::Node::leave`]): LEAVE_ASK to the
    /// coordinator (rank 0, or after its loss the lowest-ranked live node), which coordinates
    /// departures and so cannot leave itself. Needs backups (the keys are handed over as a
    /// backup round). Asking twice changes nothing.
    pub fn ask_to_leave(&mut self) -> Result<()> {
        let core = self.core;
        let dir = core.directory();
        if core.settings().backups == 0 {
            return Err(Error::Config("a node can leave only with backups (FERRY_BACKUPS=1): its keys are handed over as a last backup round".into()));
        }
        let coordinator = dir.coordinator();
        if dir.rank() == coordinator {
            return Err(Error::Config(format!("this node (rank {coordinator}) coordinates barriers and departures and cannot leave; any other node can")));
        }
        if core.departures().lock().ask(dir.nodes()) {
            core.asked_to_leave().store(true, std::sync::atomic::Ordering::Release);
            let bytes = encode(self.tx.buf(coordinator), msg::LEAVE_ASK, dir.rank());
            self.tx.sent(coordinator, MessageKind::Membership, bytes);
            // With relocation: the keys of other homes start going back now.
            self.advance_leave();
        }
        Ok(())
    }

    /// LEAVE_ASK from `from`, at the coordinator: begins its departure at every live node, this
    /// one included (once; a repeated ask begins nothing). A node that does not know yet that
    /// it coordinates (the asker learnt of a loss first), or that waits for the reports of a
    /// takeover, holds the ask until then. Needs every shard.
    pub(crate) fn handle_leave_ask(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let node = decode(body)?;
        let dir = self.directory();
        if node != from || (dir.rank() != 0 && !dir.failover()) {
            return Err(Error::Protocol(format!("LEAVE_ASK for node {node} from node {from} to node {}", dir.rank())));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        self.begin_or_hold(node);
        Ok(Progress::Done)
    }

    /// An ask for the change `entry` (a departure, or a join), every shard held: begun at every
    /// live node, or held while this node does not know yet that it coordinates, waits for a
    /// takeover's reports, or has a join queued.
    pub(super) fn begin_or_hold(&mut self, entry: u16) {
        let dir = self.directory();
        {
            let mut departures = self.core.departures().lock();
            if dir.coordinator() != dir.rank() || departures.taking_over() || departures.join_queued() {
                departures.hold_ask(entry);
                return;
            }
        }
        self.begin_everywhere(entry);
    }

    /// At the coordinator (every shard held): begins the change `node` (a departure, or a
    /// join: a queue entry) at every live node, this one included, unless it was begun before
    /// or is moot (the leaving node is gone, the joining node a member already). A joining
    /// node is welcomed first.
    pub(super) fn begin_everywhere(&mut self, node: u16) {
        let dir = self.directory();
        let moot = match join_of(node) {
            Some(joining) => !dir.is_lost(joining) && !dir.is_joining(joining),
            None => dir.is_lost(node),
        };
        if moot {
            return;
        }
        if let Some(joining) = join_of(node) {
            if self.core.departures().lock().joins.was_lost(joining) {
                // Lost before this node coordinated (its loss was not a coordinator's to act
                // on then): abandoned now, as the coordinator would have.
                self.abandon_join(joining);
                return;
            }
            if joining < dir.rank() {
                self.refuse_join(joining);
                return;
            }
        }
        if !self.core.departures().lock().begin_at_coordinator(node) {
            return;
        }
        match join_of(node) {
            Some(joining) => {
                tracing::info!(node = dir.rank(), joining, "a node's join begins");
                self.welcome(joining);
            }
            None => tracing::info!(node = dir.rank(), leaving = node, "a node's departure begins"),
        }
        self.send_to_live(&[], MessageKind::Membership, |out| encode(out, msg::LEAVE_BEGIN, node));
        self.begin_departure(node);
    }

    /// The coordinator was lost (every shard held; `coordinator` is the new one): this node
    /// reports the departures it knows to it, or, if it is the new coordinator, waits for
    /// every live node's report before it takes asks (see the module documentation).
    pub(crate) fn coordinator_lost(&mut self, coordinator: u16) {
        let dir = self.directory();
        let joining = {
            let departures = self.core.departures().lock();
            departures.joins.asked() && departures.joins.joined().is_none()
        };
        if joining {
            // Not a member yet: it asks the new coordinator — the lowest-ranked live member;
            // never itself — (which may know its join already, and then welcomes it again once
            // it took over), and reports no departures, in case the new coordinator counts it
            // as a member already and waits for its report. A joining node never coordinates:
            // with every member ranked below it lost, it gives its join up (the members take
            // it for lost when it goes, and abandon the join).
            // (`Directory::coordinator` passes over a joining node: it names this one only
            // when no other is left.)
            let rank = dir.rank();
            if coordinator < rank {
                let bytes = encode(self.tx.buf(coordinator), msg::JOIN_ASK, rank);
                self.tx.sent(coordinator, MessageKind::Membership, bytes);
                let bytes = encode_known(self.tx.buf(coordinator), &[], false);
                self.tx.sent(coordinator, MessageKind::Membership, bytes);
            } else {
                let why = if coordinator == rank {
                    format!("every member was lost while node {rank} joined")
                } else {
                    format!(
                        "every member ranked below node {rank} was lost while it joined, and a joining node never coordinates: node {coordinator} does now; this rank cannot join until a member below it is back"
                    )
                };
                tracing::warn!(node = rank, "gives its join up: {why}");
                self.core.departures().lock().joins.give_up(why);
            }
            return;
        }
        if coordinator == dir.rank() {
            // A node that joined but that not every member counts yet (the JOINED of the
            // coordinator just lost did not reach them all) announces its own join again:
            // until they count it, they take it for a joining node and coordinate themselves.
            let own = {
                let departures = self.core.departures().lock();
                departures.joins.joined().filter(|_| !departures.joins.ready_in(dir))
            };
            if let Some(from_generations) = own {
                self.announce_joined(dir.rank(), from_generations);
            }
            self.core.departures().lock().start_takeover(dir.nodes(), dir.rank());
            self.advance_takeover();
            return;
        }
        let (queue, asks) = self.core.departures().lock().report();
        let bytes = encode_known(self.tx.buf(coordinator), &queue, asks);
        self.tx.sent(coordinator, MessageKind::Membership, bytes);
    }

    /// LEAVE_KNOWN from `from`: kept for this node's takeover as coordinator (which it may not
    /// know of yet). Needs every shard.
    pub(crate) fn handle_leave_known(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let (queue, asks) = decode_known(body, self.directory().nodes())?;
        if !self.directory().failover() {
            return Err(Error::Protocol(format!("LEAVE_KNOWN from node {from} without failover")));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        self.core.departures().lock().note_report(self.directory().nodes(), from, queue, asks);
        self.advance_takeover();
        Ok(Progress::Done)
    }

    /// At a new coordinator (every shard held): once every live node has reported, begins the
    /// departures the reports name, in their order, then any asks held.
    pub(crate) fn advance_takeover(&mut self) {
        let dir = self.directory();
        if dir.coordinator() != dir.rank() {
            return;
        }
        let takeover = self.core.departures().lock().finish_takeover(|n| n == dir.rank() || !dir.is_lost(n));
        let begin = match takeover {
            Some(t) => t.begin,
            None => self.core.departures().lock().take_asks(),
        };
        for node in begin {
            // (A joining node this node handed its keys to counts as a member here, but its
            // join has not completed.)
            if let Some(joining) = join_of(node)
                && !dir.is_lost(joining)
                && !dir.is_joining(joining)
            {
                // The old coordinator completed this join before it was lost, but its JOINED
                // may not have reached every node: it goes out again, with the same
                // generations (nodes that have it ignore it).
                let from_generations = self.core.barriers().lock().first_generations(joining);
                self.announce_joined(joining, from_generations);
                continue;
            }
            // Changes the old coordinator began go out again: a node that has one ignores it.
            self.core.departures().lock().forget_begun(node);
            self.begin_everywhere(node);
        }
    }

    /// LEAVE_BEGIN from the coordinator: the change `node` (a departure, or a join) is queued
    /// here. Needs every shard.
    pub(crate) fn handle_leave_begin(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let node = decode(body)?;
        let dir = self.directory();
        let rank = node & !JOIN_BIT;
        if (from != 0 && !dir.failover()) || rank == from || rank == 0 || rank as usize >= dir.nodes() || (node & JOIN_BIT != 0 && !dir.failover()) {
            return Err(Error::Protocol(format!("LEAVE_BEGIN for node {node} from node {from}")));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        self.begin_departure(node);
        Ok(Progress::Done)
    }

    /// Queues the change `node` (every shard held); it is worked on once it is current.
    fn begin_departure(&mut self, node: u16) {
        let moot = match join_of(node) {
            // A member already here (its JOINED came first, or it joined before).
            Some(joining) => !self.directory().is_lost(joining),
            // Lost (or left) before its begin got here: nothing to wait for.
            None => self.directory().is_lost(node),
        };
        if moot {
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
        if let Some(joining) = join_of(node) {
            self.make_join_current(joining);
            return;
        }
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
    /// ready (or after the round under way, which may have read keys before the last writes);
    /// LEFT goes out once that round completed and every answer released is handed to the
    /// fabric ([`Step::send_left`], from [`Step::handed_over`]).
    ///
    /// With relocation, the round waits until this node gave back every key of another home
    /// and nothing is on its way here or from here (`evacuate.rs`); that takes every shard, so
    /// a step holding some leaves it to a later one (the backup watchdog's, if no other).
    pub(crate) fn advance_leave(&mut self) {
        let core = self.core;
        let dir = core.directory();
        if core.settings().relocation && core.departures().lock().evacuating() {
            if !self.try_acquire(self.all_shards()) {
                return;
            }
            // Again under every shard: another step may have begun the last round meanwhile.
            if core.departures().lock().evacuating() && !self.evacuate() {
                return;
            }
        }
        let live = |n| !dir.is_lost(n);
        if !core.departures().lock().wants_final_round(dir.rank(), live) {
            return;
        }
        // Under every shard, so that one step begins it: the round may complete (and send
        // LEFT, which takes the departures lock) before `begin_round` returns.
        if !self.try_acquire(self.all_shards()) || !core.departures().lock().wants_final_round(dir.rank(), live) {
            return;
        }
        if let Some(start) = self.begin_round(false, true) {
            core.departures().lock().set_final_round(start.number);
        }
    }

    /// The round this node leaves with completed, and no step holds answers released for it
    /// any more (see `protocol::backup::Released`): LEFT goes out, once.
    pub(crate) fn send_left(&mut self) {
        let dir = self.directory();
        {
            let mut departures = self.core.departures().lock();
            if departures.has_left() {
                return;
            }
            departures.mark_left();
        }
        tracing::info!(node = dir.rank(), "keys handed over; this node leaves the cluster");
        let incarnation = dir.incarnation(dir.rank());
        self.send_to_live(&[], MessageKind::Membership, |out| encode_left(out, dir.rank(), incarnation));
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
        let (node, incarnation) = decode_left(body)?;
        let dir = self.directory();
        if node == 0 || node as usize >= dir.nodes() || node == dir.rank() {
            return Err(Error::Protocol(format!("LEFT for node {node} from node {from}")));
        }
        if incarnation != dir.incarnation(node) {
            // About an earlier incarnation of a node that joined since (a relay that trailed
            // the join): stale.
            return Ok(Progress::Done);
        }
        // With relocation a census follows, as after a loss (see `evacuate.rs`).
        let census = dir.failover() && self.core.settings().relocation;
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        if from == node {
            // Its last message: everything it sent before (answers it released with the
            // hand-over among them) is handled, so its link can close — not sooner, even if
            // a relayed LEFT came first.
            self.tx.note_departed(node);
        }
        if dir.is_lost(node) {
            if from == node && census && self.core.census().lock().note_left(node) {
                // The census waited for it: the writes it sent before are in.
                self.advance_census();
            }
            return Ok(Progress::Done);
        }
        if census && from != node {
            // Its own LEFT is still on its way, behind what it sent before — last writes
            // among them, which the census must see.
            self.core.census().lock().await_left(node);
        }
        self.send_to_live(&[node, from], MessageKind::Membership, |out| encode_left(out, node, incarnation));
        Ok(self.remove_peer(node, super::LEFT_REASON, true))
    }

    /// `peer` left or was lost, or joined (`peer` is then its join's entry), every shard
    /// held: its change, if any, ends; the next one becomes current; a leaving node no longer
    /// waits for a lost peer's READY; a current join goes on without it (its giver may have
    /// changed, or waited for its READY); a coordinator takes the asks it held for the join.
    pub(crate) fn end_departure(&mut self, peer: u16) {
        let core = self.core;
        let dir = core.directory();
        let (ended_current, next, current, asked) = {
            let mut departures = core.departures().lock();
            let before = departures.current();
            let next = departures.end(peer);
            (departures.current() != before, next, departures.current(), departures.asked())
        };
        if ended_current {
            dir.set_departing(None);
            dir.set_join_target(None);
        }
        if let Some(node) = next {
            self.make_current(node);
        } else if let Some(entry) = current.filter(|&e| join_of(e).is_some()) {
            self.make_current(entry);
        } else if asked {
            self.advance_leave();
        }

        self.advance_takeover();
    }
}
