//! Graceful leaves (`Node::leave`, with backups): a node hands its keys to its successor and
//! leaves the cluster without failing an operation or losing a push. The design and its
//! argument are in docs/ARCHITECTURE.md, "A node that leaves"; in short:
//!
//! 1. **Ordered.** The leaver asks the coordinator (LEAVE_ASK), which begins departures one after the
//!    other: it sends LEAVE_BEGIN to every live node. Links keep their order, so every node
//!    sees the departures in its order and works on one at a time (the *current* one).
//! 2. **The cut.** When a departure becomes current on a node, that node stops sending
//!    requests to the leaver — parts routed to it wait, so its workers see a pause — and
//!    answers LEAVE_READY behind every request it already sent. The departure is set under
//!    every shard lock and parts are sent under their keys' shard locks, so no part slips past
//!    the READY.
//! 3. **The hand-over.** With a READY from every live peer, the leaver has applied every write
//!    it will ever get. It begins a backup round (its successor gets the images of whatever
//!    changed since the last round), and once that round is acknowledged — which releases the
//!    answers it held — it sends LEFT to every live node.
//! 4. **The new membership.** A node handling LEFT marks the leaver gone without failing
//!    anything: as after a loss, the leaver's successor adopts the images and serves its keys,
//!    and every node routes them there (the parts that waited included). It then closes its
//!    connection to the leaver, which shuts down once every peer did.
//!
//! 5. **A lost coordinator** (with failover the coordinator is rank 0 until it is lost, then
//!    the lowest-ranked live node). The departures a node knows were begun are a prefix of
//!    the old coordinator's order (links keep their order; it sent each LEAVE_BEGIN to every
//!    node before the next). Every node sends the new coordinator LEAVE_KNOWN: its queue, and
//!    whether it asked to leave itself. The new coordinator takes asks only once every live
//!    node reported; it then begins the longest queue reported, in its order (the others are
//!    prefixes of it, and a node ignores a begin it has seen), then the other asks by rank.
//!    Begun in any other order, two nodes could wait on different departures for ever.
//!
//! [`Departures`] is the state machine (no thread, clock, lock or I/O); the steps that send
//! and handle the messages are in `step.rs`. Joins (`join.rs`) are membership changes of the
//! same queue.

mod evacuate;
mod join;
mod join_step;
mod step;
pub(crate) mod wire;

pub(crate) use join::{JOIN_BIT, Joins, join_of};

/// Why a node that left is gone, as [`crate::Node::lost_nodes`] gives it.
pub const LEFT_REASON: &str = "it left the cluster gracefully, handing its keys over";

use std::collections::VecDeque;

use crate::util::FastSet;

/// This node's own departure.
#[derive(Debug)]
struct OwnDeparture {
    /// The peers whose LEAVE_READY arrived, by rank.
    ready: Vec<bool>,
    /// The backup round that hands the keys over, once begun.
    final_round: Option<u32>,
    /// Whether LEFT went out: the node serves nothing more.
    left: bool,
    /// With relocation: the keys of other homes this node gave back (GIVE_BACK sent) and
    /// still holds.
    given_back: FastSet<(u16, u64)>,
    /// With relocation: whether every key held here was looked at while none was on its way
    /// here (none can come after that: a leaving node asks for none), so that only
    /// `given_back` needs looking at again.
    scanned_quiet: bool,
}

/// The departures one node knows of (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct Departures {
    /// Departures the coordinator began that have not ended here, in its order: the first is current.
    queue: VecDeque<u16>,
    /// This node's own departure, once asked for.
    own: Option<OwnDeparture>,
    /// At the coordinator: the nodes whose departure it began (a repeated ask begins nothing).
    begun: Vec<u16>,
    /// Asks this node holds until it coordinates and every live node has reported (an ask may
    /// reach a node before it learns that it coordinates).
    asks: Vec<u16>,
    /// LEAVE_KNOWN reports by rank (the latest of each): the queue the node knows and whether
    /// it asked.
    reports: Vec<Option<(Vec<u16>, bool)>>,
    /// Whether this node took over as coordinator and waits for reports.
    taking_over: bool,
    /// Joins: this node's own, and what it knows as a giver.
    pub joins: Joins,
    /// With relocation: items this node would have passed to the home of their keys, a node
    /// whose departure is current here, and those after them (ACCESS messages,
    /// length-prefixed), sent on once the census after the departure is over (`evacuate.rs`).
    held_forwards: Vec<Vec<u8>>,
}

/// What a new coordinator begins once every live node has reported, in this order.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Takeover {
    /// Departures to begin (again) at every live node.
    pub begin: Vec<u16>,
}

impl Departures {
    /// This node asks to leave a cluster of `nodes`: false when it asked already.
    pub fn ask(&mut self, nodes: usize) -> bool {
        if self.own.is_some() {
            return false;
        }
        self.own = Some(OwnDeparture { ready: vec![false; nodes], final_round: None, left: false, given_back: FastSet::default(), scanned_quiet: false });
        true
    }

    /// At the coordinator: whether `node`'s departure should begin now (not begun before).
    pub fn begin_at_coordinator(&mut self, node: u16) -> bool {
        if self.begun.contains(&node) {
            return false;
        }
        self.begun.push(node);
        true
    }

    /// A new coordinator begins `node`'s departure again (its predecessor began it): not
    /// counted as begun here before.
    pub fn forget_begun(&mut self, node: u16) {
        self.begun.retain(|&n| n != node);
    }

    /// An ask the coordinator cannot take yet (this node does not know it coordinates, or it
    /// waits for reports): held.
    pub fn hold_ask(&mut self, node: u16) {
        if !self.asks.contains(&node) {
            self.asks.push(node);
        }
    }

    /// Whether asks wait for a takeover's reports.
    pub fn taking_over(&self) -> bool {
        self.taking_over
    }

    /// What this node reports to a new coordinator: its queue, and whether it asked to leave
    /// and has not left.
    pub fn report(&self) -> (Vec<u16>, bool) {
        (self.queue.iter().copied().collect(), self.own.as_ref().is_some_and(|o| !o.left))
    }

    /// LEAVE_KNOWN from `from` (kept whether or not this node coordinates yet).
    pub fn note_report(&mut self, nodes: usize, from: u16, queue: Vec<u16>, asks: bool) {
        if self.reports.len() < nodes {
            self.reports.resize(nodes, None);
        }
        if let Some(r) = self.reports.get_mut(from as usize) {
            *r = Some((queue, asks));
        }
    }

    /// This node (`rank`) coordinates now: asks wait until every live node has reported.
    pub fn start_takeover(&mut self, nodes: usize, rank: u16) {
        let own = self.report();
        self.note_report(nodes, rank, own.0, own.1);
        self.taking_over = true;
    }

    /// If every live node has reported, ends the takeover: the departures to begin, in order —
    /// the longest queue reported (the others are prefixes of it), then the asks by rank.
    pub fn finish_takeover(&mut self, live: impl Fn(u16) -> bool) -> Option<Takeover> {
        if !self.taking_over {
            return None;
        }
        let reported = |n: usize| self.reports.get(n).is_some_and(Option::is_some);
        if (0..self.reports.len().max(1)).any(|n| live(n as u16) && !reported(n)) {
            return None;
        }
        self.taking_over = false;
        let reports = std::mem::take(&mut self.reports);
        let mut begin = reports.iter().flatten().map(|(q, _)| q).max_by_key(|q| q.len()).cloned().unwrap_or_default();
        let mut asks: Vec<u16> = std::mem::take(&mut self.asks);
        asks.extend(reports.iter().enumerate().filter(|(_, r)| r.as_ref().is_some_and(|(_, asked)| *asked)).map(|(n, _)| n as u16));
        asks.sort_unstable();
        asks.dedup();
        asks.retain(|n| !begin.contains(n));
        begin.extend(asks);
        begin.retain(|&n| live(n));
        Some(Takeover { begin })
    }

    /// Asks held while this node did not coordinate, or while a join was queued here, to
    /// take now (no takeover waits and no join is queued).
    pub fn take_asks(&mut self) -> Vec<u16> {
        if self.taking_over || self.join_queued() {
            return Vec::new();
        }
        let mut asks = std::mem::take(&mut self.asks);
        asks.sort_unstable();
        asks
    }

    /// Whether a join is queued here (a coordinator begins no other change meanwhile).
    pub fn join_queued(&self) -> bool {
        self.queue.iter().any(|&e| join_of(e).is_some())
    }

    /// Whether `entry` is queued here.
    pub fn queued(&self, entry: u16) -> bool {
        self.queue.contains(&entry)
    }

    /// LEAVE_BEGIN of `node` (a queue entry: a departure, or a join): queued. Returns `node`
    /// when it is the current change now.
    pub fn handle_begin(&mut self, node: u16) -> Option<u16> {
        if self.queue.contains(&node) {
            return None;
        }
        self.queue.push_back(node);
        (self.queue.len() == 1).then_some(node)
    }

    /// `node` left or was lost: its departure or join, if any, ends (`node` may also be a
    /// join's entry: it joined). Returns the change that became current, if the current one
    /// ended and another waits.
    pub fn end(&mut self, node: u16) -> Option<u16> {
        let joining = node & !JOIN_BIT;
        let ends = |e: u16| e == node || e == joining || e == JOIN_BIT | joining;
        let was_current = self.queue.front().is_some_and(|&e| ends(e));
        self.queue.retain(|&e| !ends(e));
        self.joins.forget(joining);
        if was_current { self.queue.front().copied() } else { None }
    }

    /// The current departure.
    pub fn current(&self) -> Option<u16> {
        self.queue.front().copied()
    }

    /// Whether `from`'s LEAVE_READY came (this node asked to leave).
    pub fn ready_from(&self, from: u16) -> bool {
        self.own.as_ref().and_then(|o| o.ready.get(from as usize)).copied().unwrap_or(false)
    }

    /// LEAVE_READY from `from`; false when this node did not ask to leave.
    pub fn note_ready(&mut self, from: u16) -> bool {
        match self.own.as_mut().and_then(|o| o.ready.get_mut(from as usize)) {
            Some(r) => {
                *r = true;
                true
            }
            None => false,
        }
    }

    /// Whether this node (`rank`) should begin the round that hands its keys over: its
    /// departure is current, every live peer is ready, and the round was not begun yet.
    pub fn wants_final_round(&self, rank: u16, live: impl Fn(u16) -> bool) -> bool {
        let Some(own) = &self.own else { return false };
        self.current() == Some(rank)
            && own.final_round.is_none()
            && own.ready.iter().enumerate().all(|(n, &ready)| ready || n as u16 == rank || !live(n as u16))
    }

    /// Whether this node asked to leave and has not begun the round that hands its keys over:
    /// with relocation it gives the keys of other homes back meanwhile — from the ask on, so
    /// that little is left to do once its departure is current and the others pause for it.
    pub fn evacuating(&self) -> bool {
        self.own.as_ref().is_some_and(|o| o.final_round.is_none() && !o.left)
    }

    /// Whether this node began the round that hands its keys over (or left): as a home it
    /// moves none of its keys any more.
    pub fn handing_over(&self) -> bool {
        self.own.as_ref().is_some_and(|o| o.final_round.is_some() || o.left)
    }

    /// Whether the keys held here must all be looked at (see `OwnDeparture::scanned_quiet`).
    pub fn needs_scan(&self) -> bool {
        self.own.as_ref().is_some_and(|o| !o.scanned_quiet)
    }

    /// A look at every key held here found `held`, the keys of other homes (`quiet`: none was
    /// on its way here): returns those not given back before, which are given back now.
    pub fn scanned(&mut self, held: FastSet<(u16, u64)>, quiet: bool) -> Vec<(u16, u64)> {
        let Some(own) = self.own.as_mut() else { return Vec::new() };
        let mut new: Vec<(u16, u64)> = held.iter().filter(|k| !own.given_back.contains(k)).copied().collect();
        new.sort_unstable();
        own.given_back = held;
        own.scanned_quiet = quiet;
        new
    }

    /// Forgets the keys given back that `held` says are gone; returns whether any is left.
    pub fn still_given_back(&mut self, held: impl Fn(u16, u64) -> bool) -> bool {
        let Some(own) = self.own.as_mut() else { return false };
        own.given_back.retain(|&(table, key)| held(table, key));
        !own.given_back.is_empty()
    }

    /// A key is on its way here: the next look takes in every key again.
    pub fn arriving(&mut self) {
        if let Some(own) = self.own.as_mut() {
            own.scanned_quiet = false;
        }
    }

    /// Holds a forwarded ACCESS (`message`, length-prefixed) for the departing home of its keys.
    pub fn hold_forward(&mut self, message: Vec<u8>) {
        self.held_forwards.push(message);
    }

    /// The forwards held for a departure that is over.
    pub fn take_held_forwards(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.held_forwards)
    }

    /// The round that hands the keys over was begun.
    pub fn set_final_round(&mut self, round: u32) {
        if let Some(own) = &mut self.own {
            own.final_round = Some(round);
        }
    }

    /// LEFT went out.
    pub fn mark_left(&mut self) {
        if let Some(own) = &mut self.own {
            own.left = true;
        }
    }

    /// Whether this node asked to leave.
    pub fn asked(&self) -> bool {
        self.own.is_some()
    }

    /// Whether this node left (LEFT went out).
    pub fn has_left(&self) -> bool {
        self.own.as_ref().is_some_and(|o| o.left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn departures_run_one_at_a_time_in_the_coordinators_order() {
        let mut d = Departures::default();
        assert_eq!(d.handle_begin(2), Some(2));
        assert_eq!(d.handle_begin(3), None, "waits behind node 2");
        assert_eq!(d.handle_begin(2), None, "a repeated begin changes nothing");
        assert_eq!(d.end(3), None, "a waiting departure ends without changing the current one");
        assert_eq!(d.handle_begin(3), None);
        assert_eq!(d.end(2), Some(3));
        assert_eq!(d.current(), Some(3));
        assert_eq!(d.end(3), None);
        assert_eq!(d.current(), None);
        let mut c = Departures::default();
        assert!(c.begin_at_coordinator(1) && !c.begin_at_coordinator(1));
    }

    #[test]
    fn a_new_coordinator_begins_the_longest_known_order_then_the_asks() {
        // Rank 0 of 5 began node 3's departure, then node 4's, and died with node 4's begins
        // half sent: node 1 (the new coordinator) and node 3 know [3], nodes 2 and 4 know
        // [3, 4]. Node 2 asks to leave now, before node 1 has heard from everyone.
        let live = |n: u16| n != 0;
        let mut c = Departures::default();
        c.handle_begin(3);
        c.hold_ask(2);
        c.start_takeover(5, 1);
        assert!(c.taking_over());
        assert_eq!(c.finish_takeover(live), None, "no report yet");
        c.note_report(5, 3, vec![3], true);
        c.note_report(5, 2, vec![3, 4], true);
        assert_eq!(c.finish_takeover(live), None, "node 4 has not reported");
        assert!(c.take_asks().is_empty(), "asks wait for the takeover");
        c.note_report(5, 4, vec![3, 4], true);
        assert_eq!(c.finish_takeover(live), Some(Takeover { begin: vec![3, 4, 2] }));
        assert!(!c.taking_over() && c.finish_takeover(live).is_none());
        // A node lost meanwhile neither reports nor is begun.
        let mut c = Departures::default();
        c.start_takeover(4, 1);
        c.note_report(4, 2, vec![3], false);
        assert_eq!(c.finish_takeover(|n| n != 0 && n != 3), Some(Takeover { begin: vec![] }));
        // Outside a takeover, held asks are taken by rank.
        c.hold_ask(3);
        c.hold_ask(2);
        c.hold_ask(3);
        assert_eq!(c.take_asks(), vec![2, 3]);
    }

    #[test]
    fn the_hand_over_waits_for_every_live_peer_and_its_turn() {
        let mut d = Departures::default();
        assert!(!d.wants_final_round(1, |_| true), "not asked");
        assert!(d.ask(4) && !d.ask(4));
        assert_eq!(d.handle_begin(3), Some(3));
        assert_eq!(d.handle_begin(1), None);
        assert!(d.note_ready(0) && d.note_ready(2));
        assert!(!d.wants_final_round(1, |_| true), "node 3's departure comes first");
        assert_eq!(d.end(3), Some(1));
        assert!(d.wants_final_round(1, |n| n != 3), "node 3 is gone and need not answer");
        assert!(!d.wants_final_round(1, |_| true), "a live node 3 must answer");
        d.set_final_round(7);
        assert!(!d.wants_final_round(1, |n| n != 3), "begun once");
        assert!(d.handing_over() && !d.evacuating() && !d.has_left());
        d.mark_left();
        assert!(d.has_left() && d.handing_over());
        assert!(!Departures::default().note_ready(0), "READY to a node that did not ask");
    }
}
