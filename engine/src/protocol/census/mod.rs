//! The census after a loss, in a cluster that relocates keys and keeps backups (the design and
//! its argument are in docs/ARCHITECTURE.md, "Backups with relocation").
//!
//! With relocation a lost node may have held keys of any home, been the home of keys held
//! anywhere, and been either end of relocations under way. Its keys' homes (or, for its own
//! home keys, the node that stands in for it) learn where every one of their keys is from the
//! survivors themselves, before anything is routed by what they knew before:
//!
//! 1. **Quiet.** Every survivor, on learning of the loss, stops moving keys: LOCALIZE and
//!    RELOCATE are held, hand-overs whose rounds completed are not sent, and a hand-over to the
//!    lost node is taken back (the key is served here again). Workers' requests to other nodes
//!    wait; local accesses go on.
//! 2. **Flush.** Once every one-sided write it posted has completed, a survivor sends every
//!    other one CENSUS_FLUSH, behind those writes on the link: a node with every survivor's
//!    flush has seen every relocation that will ever land from a live node, but those held back.
//! 3. **Census.** It then tells each key's home (the node serving the home, after the loss)
//!    what it knows of the key: it holds it, it awaits it (with the reservation), or it will
//!    hand it to another node (a hand-over waiting for its round, or one queued behind an
//!    arrival).
//! 4. **Resolve.** A home with every survivor's census settles each of its keys: a key held or
//!    on its way from a live node is where the chain of hand-overs from that node ends; a key
//!    no live node holds or hands over was with the lost node, or on its way from it, and the
//!    home adopts the image it keeps (the newest of the key's images: images are taken in
//!    order, see `protocol::backup::handover`), declining every reservation that awaited it.
//!    It records the owners and tells everyone CENSUS_DONE.
//! 5. **Resume.** A node with every survivor's CENSUS_DONE lets requests and moves go again.
//!
//! A second loss during a census starts it again (messages carry the number of losses the
//! sender knows of; a node relays a loss before anything else it sends, so a census message
//! never comes from a node that knows of more losses, and one from a node that knows of fewer
//! is dropped: that node starts again too).
//!
//! [`Census`] is the state machine; the steps are in `step.rs`, the messages in `wire.rs`.

pub(crate) mod step;
pub(crate) mod wire;

use crate::store::RemoteAddr;
use crate::util::FastMap;

/// What a survivor knows of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// The node holds it.
    Held,
    /// The node awaits it, for this reservation, in this slot.
    Arriving(u32, RemoteAddr),
    /// The node holds it out of service and will write it to this node (a hand-over waiting
    /// for its round, or a RELOCATE held since the census began).
    Handing(u16),
    /// The node will hand it to this node once it arrived (a hand-over queued behind its
    /// arrival).
    Then(u16),
}

/// One node's census (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct Census {
    /// Losses known when the census began (0: none ever began).
    epoch: u32,
    /// Whether one is under way: from a loss until every survivor said it is done.
    active: bool,
    /// Whether this node sent its CENSUS_FLUSH, and per node whether one arrived.
    flushed: bool,
    flushes: Vec<bool>,
    /// Whether this node sent its census, and per node whether its census (all of it) arrived.
    reported: bool,
    reports: Vec<bool>,
    /// What survivors claim of the keys this node is home for: per key, (node, claim).
    claims: FastMap<(u16, u64), Vec<(u16, Claim)>>,
    /// Whether this node settled its keys and said so.
    resolved: bool,
    /// Per node, whether its CENSUS_DONE arrived.
    done: Vec<bool>,
    /// LOCALIZE and RELOCATE messages held until the census is over: (sender, message).
    held_moves: Vec<(u16, Vec<u8>)>,
    /// Items for keys of a lost home this node stands in for, held until it settled them:
    /// ACCESS messages, length-prefixed.
    held_accesses: Vec<Vec<u8>>,
    /// Nodes that left whose own LEFT has not arrived (a relayed one came first): what they
    /// sent before it may still be on its way, so this node's claims wait.
    awaiting_left: Vec<u16>,
}

impl Census {
    /// A loss: a census begins (again) for `epoch` losses among `nodes` nodes.
    pub fn begin(&mut self, epoch: u32, nodes: usize) {
        let held_moves = std::mem::take(&mut self.held_moves);
        let held_accesses = std::mem::take(&mut self.held_accesses);
        let awaiting_left = std::mem::take(&mut self.awaiting_left);
        *self = Census {
            epoch,
            active: true,
            flushes: vec![false; nodes],
            reports: vec![false; nodes],
            done: vec![false; nodes],
            held_moves,
            held_accesses,
            awaiting_left,
            ..Census::default()
        };
    }

    /// `node` left, and its own LEFT is still on its way (a relayed one came first): this
    /// node's claims wait for it.
    pub fn await_left(&mut self, node: u16) {
        if !self.awaiting_left.contains(&node) {
            self.awaiting_left.push(node);
        }
    }

    /// `node`'s own LEFT arrived, or its link closed: returns whether the census waited for it.
    pub fn note_left(&mut self, node: u16) -> bool {
        let before = self.awaiting_left.len();
        self.awaiting_left.retain(|&n| n != node);
        self.awaiting_left.len() < before
    }

    /// Whether items for keys of lost homes this node stands in for wait: a census is under
    /// way and this node has not settled its keys.
    pub fn holds_accesses(&self) -> bool {
        self.active && !self.resolved
    }

    /// Holds an ACCESS (length-prefixed) until this node settled its keys.
    pub fn hold_access(&mut self, message: Vec<u8>) {
        self.held_accesses.push(message);
    }

    /// The items held until this node settled its keys, which it just did.
    pub fn take_held_accesses(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.held_accesses)
    }

    /// Whether a census is under way.
    #[cfg(test)]
    pub fn active(&self) -> bool {
        self.active
    }

    /// The losses the census is for.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Whether a message of census `epoch` belongs to the one under way (one of an earlier
    /// census is stale: its sender starts again).
    pub fn current(&self, epoch: u32) -> bool {
        self.active && epoch == self.epoch
    }

    /// Whether this node may flush now (it has not, and its writes completed).
    pub fn wants_flush(&self) -> bool {
        self.active && !self.flushed
    }

    /// This node sent its flushes.
    pub fn note_flushed(&mut self) {
        self.flushed = true;
    }

    /// `from`'s flush arrived.
    pub fn note_flush(&mut self, from: u16) {
        if let Some(f) = self.flushes.get_mut(from as usize) {
            *f = true;
        }
    }

    /// Whether this node should send its census now: it flushed, and every node `live` counts
    /// (but this one, `rank`) did.
    pub fn census_due(&self, rank: u16, live: impl Fn(u16) -> bool) -> bool {
        self.active && self.flushed && !self.reported && self.awaiting_left.is_empty() && all_in(&self.flushes, rank, live)
    }

    /// This node sent its census.
    pub fn note_reported(&mut self) {
        self.reported = true;
    }

    /// `from` claims `claim` of `key` of `table`, homed here.
    pub fn claim(&mut self, from: u16, table: u16, key: u64, claim: Claim) {
        self.claims.entry((table, key)).or_default().push((from, claim));
    }

    /// `from`'s census is all in.
    pub fn note_report(&mut self, from: u16) {
        if let Some(r) = self.reports.get_mut(from as usize) {
            *r = true;
        }
    }

    /// Whether this node can settle its keys now: every node `live` counts (this one
    /// included) reported, and it has not settled them.
    pub fn resolve_due(&self, live: impl Fn(u16) -> bool) -> bool {
        self.active && self.reported && !self.resolved && all_in(&self.reports, u16::MAX, live)
    }

    /// Takes the claims to settle the keys with; the census is resolved here.
    pub fn take_claims(&mut self) -> FastMap<(u16, u64), Vec<(u16, Claim)>> {
        self.resolved = true;
        std::mem::take(&mut self.claims)
    }

    /// `from` settled its keys.
    pub fn note_done(&mut self, from: u16) {
        if let Some(d) = self.done.get_mut(from as usize) {
            *d = true;
        }
    }

    /// Whether every node `live` counts settled its keys (and this one did): the census ends.
    pub fn over(&self, live: impl Fn(u16) -> bool) -> bool {
        self.active && self.resolved && all_in(&self.done, u16::MAX, live)
    }

    /// The census ended: returns the moves held meanwhile.
    pub fn end(&mut self) -> Vec<(u16, Vec<u8>)> {
        self.active = false;
        std::mem::take(&mut self.held_moves)
    }

    /// The LOCALIZE and RELOCATE messages held: (sender, message).
    pub fn held_moves(&self) -> &[(u16, Vec<u8>)] {
        &self.held_moves
    }

    /// Rewrites the held moves with `strip` (given the sender and the message; `None` drops
    /// it): requests met another way are taken out.
    pub fn drop_held_requests(&mut self, strip: impl Fn(u16, &[u8]) -> Option<Vec<u8>>) {
        let held = std::mem::take(&mut self.held_moves);
        self.held_moves = held.into_iter().filter_map(|(from, m)| strip(from, &m).map(|m| (from, m))).collect();
    }

    /// Holds a LOCALIZE or RELOCATE from `from` until the census ends.
    pub fn hold_move(&mut self, from: u16, message: Vec<u8>) {
        self.held_moves.push((from, message));
    }
}

/// Whether every node `live` counts but `except` is marked in `marks`.
fn all_in(marks: &[bool], except: u16, live: impl Fn(u16) -> bool) -> bool {
    marks.iter().enumerate().all(|(n, &m)| m || n as u16 == except || !live(n as u16))
}

/// The node that holds a key, or holds it out of service to hand it over, among `claims`:
/// the root of its chain of hand-overs (`Err` when two nodes claim to).
pub(crate) fn root(claims: &[(u16, Claim)]) -> Result<Option<u16>, String> {
    let mut roots = claims.iter().filter(|&&(_, c)| matches!(c, Claim::Held | Claim::Handing(_))).map(|&(n, _)| n);
    let Some(root) = roots.next() else { return Ok(None) };
    match roots.find(|&n| n != root) {
        Some(other) => Err(format!("nodes {root} and {other} both hold the key")),
        None => Ok(Some(root)),
    }
}

/// The chain of hand-overs from `start`, in order: from a root, its hand-over and then the
/// hand-overs queued behind each arrival; from a node awaiting the key, the latter only.
/// `Err` when it goes round in a circle.
pub(crate) fn chain(claims: &[(u16, Claim)], start: u16) -> Result<Vec<u16>, String> {
    let edge = |node: u16, first: bool| {
        claims.iter().find_map(|&(n, c)| match c {
            Claim::Handing(to) if first && n == node => Some(to),
            Claim::Then(to) if !first && n == node => Some(to),
            _ => None,
        })
    };
    let mut nodes = vec![start];
    let mut next = edge(start, true).or_else(|| edge(start, false));
    while let Some(at) = next {
        if nodes.len() > claims.len() {
            return Err(format!("the hand-overs from node {start} go round in a circle"));
        }
        nodes.push(at);
        next = edge(at, false);
    }
    Ok(nodes)
}

/// Where a key's census claims put it (see the module documentation, 4): `Some(node)` for the
/// node where the chain of hand-overs from a live holder ends, `None` when no live node holds
/// the key (it was with the lost node, or on its way from it).
#[cfg(test)]
fn settle(claims: &[(u16, Claim)]) -> Result<Option<u16>, String> {
    match root(claims)? {
        Some(root) => Ok(chain(claims, root)?.last().copied()),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_census_runs_flush_report_resolve_done_and_starts_again_on_a_loss() {
        let mut c = Census::default();
        assert!(!c.active());
        c.begin(1, 4);
        let live = |n: u16| n != 3;
        assert!(c.wants_flush() && !c.census_due(0, live));
        c.note_flushed();
        c.note_flush(1);
        assert!(!c.census_due(0, live), "node 2 has not flushed");
        c.note_flush(2);
        assert!(c.census_due(0, live));
        c.note_reported();
        c.claim(1, 0, 7, Claim::Held);
        c.note_report(0);
        c.note_report(1);
        assert!(!c.resolve_due(live));
        c.note_report(2);
        assert!(c.resolve_due(live));
        assert_eq!(c.take_claims().len(), 1);
        assert!(!c.resolve_due(live), "once");
        c.note_done(0);
        c.note_done(1);
        c.hold_move(2, vec![3]);
        assert!(!c.over(live));
        // Node 2 is lost too: the census starts again, the move stays held.
        c.begin(2, 4);
        assert!(c.current(2) && !c.current(1));
        let live = |n: u16| n < 2;
        c.note_flushed();
        c.note_flush(1);
        c.note_reported();
        c.note_report(0);
        c.note_report(1);
        let _ = c.take_claims();
        c.note_done(0);
        c.note_done(1);
        assert!(c.over(live));
        assert_eq!(c.end(), vec![(2, vec![3])]);
        assert!(!c.active());
    }

    #[test]
    fn claims_settle_where_the_chain_from_a_live_holder_ends() {
        let at = RemoteAddr::default();
        assert_eq!(settle(&[(1, Claim::Held)]), Ok(Some(1)));
        // 1 hands the key to 2, which will hand it to 3 once it arrived.
        let claims = [(2, Claim::Arriving(5, at)), (1, Claim::Handing(2)), (2, Claim::Then(3)), (3, Claim::Arriving(9, at))];
        assert_eq!(settle(&claims), Ok(Some(3)));
        assert_eq!(chain(&claims, 1), Ok(vec![1, 2, 3]));
        // The same chain from a lost node: no live root; it goes on from the first arrival.
        let orphans = [(2, Claim::Arriving(5, at)), (2, Claim::Then(3)), (3, Claim::Arriving(9, at))];
        assert_eq!(settle(&orphans), Ok(None));
        assert_eq!(chain(&orphans, 2), Ok(vec![2, 3]));
        assert_eq!(settle(&[]), Ok(None));
        assert!(settle(&[(1, Claim::Held), (2, Claim::Held)]).is_err());
        // A node handing the key over that asked for it back: its new arrival is the end.
        let back = [(0, Claim::Handing(1)), (0, Claim::Arriving(10, at)), (1, Claim::Arriving(44, at)), (1, Claim::Then(0))];
        assert_eq!(settle(&back), Ok(Some(0)));
        assert!(chain(&[(1, Claim::Handing(2)), (2, Claim::Arriving(1, at)), (2, Claim::Then(1)), (1, Claim::Then(2))], 1).is_err());
    }
}
