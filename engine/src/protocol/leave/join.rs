//! Joins at run time (`Node::join`, with backups): a node started afresh in the rank of a node
//! that left or was lost becomes a member again and takes its keys back. The design and its
//! argument are in docs/ARCHITECTURE.md, "A node that joins"; in short:
//!
//! 1. **Ordered with departures.** The joining node asks the coordinator (JOIN_ASK), which
//!    begins the join as a membership change of the same queue as departures (LEAVE_BEGIN
//!    of the entry `JOIN_BIT | rank`) at every live node, and welcomes the joining node
//!    (JOIN_WELCOME: the nodes gone). While a join is queued at the coordinator it begins no
//!    other change: a change begun before the join ends would not reach the joining node.
//! 2. **The cut.** The joining node's keys are served by its stand-in, the first live node
//!    after its rank (the giver). When the join is current at a node, that node stops sending
//!    requests to the giver — parts routed there wait — and answers JOIN_READY behind every
//!    request it sent before, as for a departure.
//! 3. **The hand-over.** With a READY from every live peer, the giver has applied every write
//!    the keys will get from others. Under every shard lock it takes the keys that move (those
//!    of the homes that the joining node stands in for once it is a member) out of its store,
//!    sends their images to the joining node (JOIN_IMAGES), keeps them as that node's backups
//!    (it is the joining node's successor), and counts the joining node as a member: its own
//!    workers' requests for the keys follow the images on the same link. No round of the
//!    giver completes from then until the joined node's own backups hold the keys (JOIN_SETTLED,
//!    step 4): a write the giver applied just before the hand-over is, until then, on the
//!    joining node and in the giver's kept images only.
//! 4. **The new membership.** Once it holds every image and was welcomed, the joining node
//!    tells the coordinator (JOIN_HANDED), which counts it as a member from the next barrier
//!    generations on and sends JOINED with them to every live node, the joining node
//!    included. A node handling JOINED routes the keys to the joining node (the parts that
//!    waited included), ends the change and acknowledges (JOIN_ACK): the joining node sends
//!    requests only once every live node did, as a node drops what it would answer to a
//!    node it counts as gone. It then begins a backup round, and once that round completed
//!    tells the giver (JOIN_SETTLED), whose held-back rounds complete.
//!
//! 5. **A joining node lost.** A node that counts the rank as gone cannot tell the joining
//!    node's loss from its predecessor's; the coordinator decides. If the join is queued
//!    there, it sends JOIN_ABANDONED to every live node, behind the begin: the change ends
//!    everywhere, and the giver, if it handed the keys over, takes them back from the images
//!    it kept (a loss, as any other).
//!
//! [`Joins`] is the state machine (no thread, clock, lock or I/O), kept with the departures
//! under one lock; the steps are in `join_step.rs`.

use crate::protocol::Directory;

/// The bit that marks an entry of the queue of membership changes (and of LEAVE_BEGIN and
/// LEAVE_KNOWN) as a join: a rank alone is that node's departure, `JOIN_BIT | rank` its join.
/// Ranks stay below it ([`crate::config::MAX_NODES`]).
pub(crate) const JOIN_BIT: u16 = 0x8000;
const _: () = assert!(crate::config::MAX_NODES < JOIN_BIT as usize);

/// The node a queue entry is the join of, if it is a join.
#[inline]
pub(crate) fn join_of(entry: u16) -> Option<u16> {
    (entry & JOIN_BIT != 0).then_some(entry & !JOIN_BIT)
}

/// Why the nodes gone before a node joined are gone, as that node records them.
pub(crate) const GONE_BEFORE_JOIN: &str = "it was gone from the cluster when this node joined";

/// This node's own join.
#[derive(Debug, Default)]
struct OwnJoin {
    /// The coordinator that welcomed it (the latest, after a coordinator was lost).
    welcomed_by: Option<u16>,
    /// Whether the last of the images handed to it arrived.
    images_done: bool,
    /// The coordinator JOIN_HANDED went to.
    handed_to: Option<u16>,
    /// The barrier generations it takes part in from, once JOINED came.
    joined: Option<[u32; 2]>,
    /// The nodes whose JOIN_ACK came.
    acks: Vec<u16>,
    /// Why this node gave its join up, if it did.
    given_up: Option<String>,
    /// The nodes that handed it keys and wait for JOIN_SETTLED (their rounds are held back).
    givers: Vec<u16>,
    /// The backup round that settles the join once it completes (begun after every live node
    /// counted this node as a member).
    settle_round: Option<u32>,
    /// Whether that round completed: the keys handed here are on this node's own backups.
    settled: bool,
}

/// What one node knows of joins (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct Joins {
    /// This node's own join, once asked for.
    own: Option<OwnJoin>,
    /// At a giver: JOIN_READY received, as (joining node, sender).
    readies: Vec<(u16, u16)>,
    /// At a giver: the joins whose keys it handed over.
    given: Vec<u16>,
    /// Nodes this node learnt were lost — joining, or members that joined or started with
    /// the cluster — since a fresh node in their rank last asked to join: a coordinator that
    /// takes over later abandons a reported join of theirs instead of beginning it again for
    /// a node that will never answer.
    lost: Vec<u16>,
    /// A join current here whose JOIN_READY waits for a backup round that includes the joining
    /// node (it will be one of this node's backups): the joining node and that round, once
    /// begun.
    ready_after: Option<(u16, Option<u32>)>,
}

impl Joins {
    /// This node asks to join: false when it asked already.
    pub fn ask(&mut self) -> bool {
        if self.own.is_some() {
            return false;
        }
        self.own = Some(OwnJoin::default());
        true
    }

    /// Whether this node asked to join.
    pub fn asked(&self) -> bool {
        self.own.is_some()
    }

    /// The barrier generations this node takes part in from, once it is a member.
    pub fn joined(&self) -> Option<[u32; 2]> {
        self.own.as_ref().and_then(|o| o.joined)
    }

    /// This node gives its join up, for `why` (after JOINED too: the coordinator that refused
    /// it counts it as gone, and so do the members it tells).
    pub fn give_up(&mut self, why: String) {
        if let Some(own) = self.own.as_mut() {
            own.given_up.get_or_insert(why);
        }
    }

    /// Why this node gave its join up, if it did.
    pub fn given_up(&self) -> Option<&str> {
        self.own.as_ref().and_then(|o| o.given_up.as_deref())
    }

    /// JOIN_ACK from `from`.
    pub fn note_ack(&mut self, from: u16) {
        if let Some(own) = &mut self.own
            && !own.acks.contains(&from)
        {
            own.acks.push(from);
        }
    }

    /// Whether this node (`rank`) joined and every live node of `nodes` counts it as a member:
    /// its workers may send requests.
    pub fn ready(&self, rank: u16, nodes: usize, live: impl Fn(u16) -> bool) -> bool {
        self.own.as_ref().is_some_and(|o| o.joined.is_some() && (0..nodes as u16).all(|n| n == rank || !live(n) || o.acks.contains(&n)))
    }

    /// [`Joins::ready`] as `dir` sees the cluster: this node joined and every node it does not
    /// count lost counts it as a member.
    pub fn ready_in(&self, dir: &Directory) -> bool {
        self.ready(dir.rank(), dir.nodes(), |n| !dir.is_lost(n))
    }

    /// JOIN_WELCOME came from coordinator `from`.
    pub fn welcome(&mut self, from: u16) {
        if let Some(own) = &mut self.own {
            own.welcomed_by = Some(from);
        }
    }

    /// The last image handed over arrived.
    pub fn images_done(&mut self) {
        if let Some(own) = &mut self.own {
            own.images_done = true;
        }
    }

    /// The coordinator to send JOIN_HANDED to now, once welcomed and every image is here, and
    /// not sent to that coordinator yet: a new coordinator that welcomes again gets it again,
    /// with the barrier generations this node took part in from if JOINED came already (the
    /// old coordinator completed the join, but its JOINED may not have reached every node).
    pub fn handed_due(&mut self) -> Option<(u16, Option<[u32; 2]>)> {
        let own = self.own.as_mut()?;
        let to = own.welcomed_by.filter(|_| own.images_done)?;
        if own.handed_to == Some(to) {
            return None;
        }
        own.handed_to = Some(to);
        Some((to, own.joined))
    }

    /// `giver` handed this node keys (the last of its JOIN_IMAGES came) and waits for
    /// JOIN_SETTLED. True when the join is settled already: it is due at once.
    pub fn note_giver(&mut self, giver: u16) -> bool {
        let Some(own) = self.own.as_mut() else { return false };
        if !own.givers.contains(&giver) {
            own.givers.push(giver);
        }
        own.settled
    }

    /// Where the settling round stands: `Some(None)` when it is to begin now (this node is
    /// ready, and none began), `Some(Some(round))` once begun and not known complete, `None`
    /// when there is nothing to do (not ready, or settled already).
    pub fn settle_round(&self, ready: bool) -> Option<Option<u32>> {
        let own = self.own.as_ref().filter(|o| ready && !o.settled)?;
        Some(own.settle_round)
    }

    /// The settling round began.
    pub fn set_settle_round(&mut self, round: u32) {
        if let Some(own) = self.own.as_mut() {
            own.settle_round = Some(round);
        }
    }

    /// The settling round completed: returns the givers to tell (JOIN_SETTLED), once.
    pub fn settle(&mut self) -> Vec<u16> {
        match self.own.as_mut() {
            Some(own) if !own.settled => {
                own.settled = true;
                own.givers.clone()
            }
            _ => Vec::new(),
        }
    }

    /// JOINED came: this node is a member from barrier generations `from`. True the first time.
    pub fn note_joined(&mut self, from: [u32; 2]) -> bool {
        match &mut self.own {
            Some(own) if own.joined.is_none() => {
                own.joined = Some(from);
                true
            }
            _ => false,
        }
    }

    /// JOIN_READY from `from` for `joining`'s join.
    pub fn note_ready(&mut self, joining: u16, from: u16) {
        if !self.readies.contains(&(joining, from)) {
            self.readies.push((joining, from));
        }
    }

    /// Whether this node (`rank`), the giver of `joining`'s keys, should hand them over now:
    /// every live peer but the joining node is ready, and it did not hand them over yet.
    pub fn wants_to_give(&self, joining: u16, rank: u16, nodes: usize, live: impl Fn(u16) -> bool) -> bool {
        !self.given.contains(&joining) && (0..nodes as u16).filter(|&n| n != rank && n != joining && live(n)).all(|n| self.readies.contains(&(joining, n)))
    }

    /// The keys of `joining` were handed over.
    pub fn mark_given(&mut self, joining: u16) {
        self.given.push(joining);
    }

    /// Node `node` was lost (joining, or a member that joined once; see [`Joins::was_lost`]).
    pub fn note_lost(&mut self, node: u16) {
        if !self.lost.contains(&node) {
            self.lost.push(node);
        }
    }

    /// Whether node `node` was lost since a fresh node in its rank last asked to join here: a
    /// reported join of it is over.
    pub fn was_lost(&self, node: u16) -> bool {
        self.lost.contains(&node)
    }

    /// `joining` asks afresh (a new process in the rank): its earlier loss is past.
    pub fn asks_afresh(&mut self, joining: u16) {
        self.lost.retain(|&j| j != joining);
    }

    /// `joining`'s join is current here and will make it one of this node's backups: its
    /// READY waits for a round to it ([`Joins::ready_after`]).
    pub fn await_round_before_ready(&mut self, joining: u16) {
        if self.ready_after.is_none_or(|(j, _)| j != joining) {
            self.ready_after = Some((joining, None));
        }
    }

    /// The joining node whose READY waits, and the round it waits for once begun.
    pub fn ready_after(&self) -> Option<(u16, Option<u32>)> {
        self.ready_after
    }

    /// The round the READY waits for began.
    pub fn set_ready_round(&mut self, round: u32) {
        if let Some((_, r)) = self.ready_after.as_mut() {
            *r = Some(round);
        }
    }

    /// The READY went (or is not needed any more).
    pub fn ready_sent(&mut self) {
        self.ready_after = None;
    }

    /// `joining`'s join ended here (it joined, or it was lost): its READYs and hand-over are
    /// forgotten, so that a later join of the same rank starts afresh.
    pub fn forget(&mut self, joining: u16) {
        if self.ready_after.is_some_and(|(j, _)| j == joining) {
            self.ready_after = None;
        }
        self.readies.retain(|&(j, _)| j != joining);
        self.given.retain(|&j| j != joining);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_giver_waits_for_every_live_peer_and_gives_once() {
        let mut j = Joins::default();
        // Node 2 gives node 1's keys in a cluster of 4; node 3 is lost.
        let live = |n: u16| n != 3;
        assert!(!j.wants_to_give(1, 2, 4, live), "node 0 has not answered");
        j.note_ready(1, 0);
        j.note_ready(1, 0);
        assert!(j.wants_to_give(1, 2, 4, live), "the joining node and a lost node need not answer");
        assert!(!j.wants_to_give(1, 2, 4, |_| true), "a live node 3 must answer");
        j.mark_given(1);
        assert!(!j.wants_to_give(1, 2, 4, live), "given once");
        j.forget(1);
        assert!(!j.wants_to_give(1, 2, 4, live), "a later join of the same rank waits for new READYs");
        assert_eq!(join_of(JOIN_BIT | 5), Some(5));
        assert_eq!(join_of(5), None);
    }

    #[test]
    fn the_joining_node_reports_once_welcomed_and_handed_everything() {
        let mut j = Joins::default();
        assert_eq!(j.handed_due(), None, "not joining");
        assert!(j.ask() && !j.ask());
        j.images_done();
        assert_eq!(j.handed_due(), None, "not welcomed yet");
        j.welcome(0);
        assert_eq!(j.handed_due(), Some((0, None)));
        assert_eq!(j.handed_due(), None, "sent once");
        // Coordinator 0 is lost; its successor welcomes again and gets the report again.
        j.welcome(1);
        assert_eq!(j.handed_due(), Some((1, None)));
        assert!(j.note_joined([4, 1]) && !j.note_joined([5, 1]));
        assert_eq!(j.joined(), Some([4, 1]));
        // Node 3 of 4 joined; nodes 0 and 2 acknowledge, node 1 is lost.
        assert!(!j.ready(3, 4, |_| true));
        j.note_ack(0);
        j.note_ack(2);
        assert!(!j.ready(3, 4, |_| true), "node 1 has not acknowledged");
        assert!(j.ready(3, 4, |n| n != 1));
        // Coordinator 1 completed the join and was lost: its successor gets the generations.
        j.welcome(2);
        assert_eq!(j.handed_due(), Some((2, Some([4, 1]))));
    }

    #[test]
    fn the_joined_node_settles_once_ready_and_its_round_began() {
        let mut j = Joins::default();
        assert!(!j.note_giver(2), "not joining");
        assert!(j.ask());
        assert!(!j.note_giver(2) && !j.note_giver(2));
        assert_eq!(j.settle_round(false), None, "not ready: every member must count it first");
        assert_eq!(j.settle_round(true), Some(None), "ready: the round is to begin");
        j.set_settle_round(9);
        assert_eq!(j.settle_round(true), Some(Some(9)));
        assert_eq!(j.settle(), vec![2], "the giver is told once");
        assert_eq!(j.settle(), Vec::<u16>::new());
        assert_eq!(j.settle_round(true), None, "settled");
        // A later giver (one that took over from a lost one) is told at once.
        assert!(j.note_giver(3));
    }
}
