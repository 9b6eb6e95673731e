//! Graceful leaves (`Node::leave`, with backups): a node hands its keys to its successor and
//! leaves the cluster without failing an operation or losing a push. The design and its
//! argument are in docs/ARCHITECTURE.md, "A node that leaves"; in short:
//!
//! 1. **Ordered.** The leaver asks rank 0 (LEAVE_ASK), which begins departures one after the
//!    other: it sends LEAVE_BEGIN to every live node. Links keep their order, so every node
//!    sees the departures in rank 0's order and works on one at a time (the *current* one).
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
//! [`Departures`] is the state machine (no thread, clock, lock or I/O); the steps that send
//! and handle the messages are in `step.rs`.

mod step;
pub(crate) mod wire;

/// Why a node that left is gone, as [`super::Directory::lost_nodes`] gives it.
pub const LEFT_REASON: &str = "it left the cluster gracefully, handing its keys over";

use std::collections::VecDeque;

/// This node's own departure.
#[derive(Debug)]
struct OwnDeparture {
    /// The peers whose LEAVE_READY arrived, by rank.
    ready: Vec<bool>,
    /// The backup round that hands the keys over, once begun.
    final_round: Option<u32>,
    /// Whether LEFT went out: the node serves nothing more.
    left: bool,
}

/// The departures one node knows of (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct Departures {
    /// Departures rank 0 began that have not ended here, in its order: the first is current.
    queue: VecDeque<u16>,
    /// This node's own departure, once asked for.
    own: Option<OwnDeparture>,
    /// At rank 0: the nodes whose departure it began (a repeated ask begins nothing).
    begun: Vec<u16>,
}

impl Departures {
    /// This node asks to leave a cluster of `nodes`: false when it asked already.
    pub fn ask(&mut self, nodes: usize) -> bool {
        if self.own.is_some() {
            return false;
        }
        self.own = Some(OwnDeparture { ready: vec![false; nodes], final_round: None, left: false });
        true
    }

    /// At rank 0: whether `node`'s departure should begin now (not begun before).
    pub fn begin_at_coordinator(&mut self, node: u16) -> bool {
        if self.begun.contains(&node) {
            return false;
        }
        self.begun.push(node);
        true
    }

    /// LEAVE_BEGIN of `node`: queued. Returns `node` when it is the current departure now.
    pub fn handle_begin(&mut self, node: u16) -> Option<u16> {
        if self.queue.contains(&node) {
            return None;
        }
        self.queue.push_back(node);
        (self.queue.len() == 1).then_some(node)
    }

    /// `node` left or was lost: its departure, if any, ends. Returns the departure that became
    /// current, if the current one ended and another waits.
    pub fn end(&mut self, node: u16) -> Option<u16> {
        let was_current = self.queue.front() == Some(&node);
        self.queue.retain(|&n| n != node);
        if was_current { self.queue.front().copied() } else { None }
    }

    /// The current departure.
    pub fn current(&self) -> Option<u16> {
        self.queue.front().copied()
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

    /// The round that hands the keys over was begun.
    pub fn set_final_round(&mut self, round: u32) {
        if let Some(own) = &mut self.own {
            own.final_round = Some(round);
        }
    }

    /// The round that hands the keys over, if begun and LEFT is not out yet.
    pub fn final_round_pending(&self) -> Option<u32> {
        self.own.as_ref().filter(|o| !o.left).and_then(|o| o.final_round)
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
        assert_eq!(d.final_round_pending(), Some(7));
        d.mark_left();
        assert!(d.has_left() && d.final_round_pending().is_none());
        assert!(!Departures::default().note_ready(0), "READY to a node that did not ask");
    }
}
