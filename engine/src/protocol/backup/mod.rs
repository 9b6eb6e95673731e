//! Backups of every key on its owner's successor, and failover (the parameter server, OSDI
//! 2014, Sections 4.3–4.4: replication after aggregation). The design and its argument are in
//! docs/ARCHITECTURE.md, "A lost node"; in short:
//!
//! * **Who.** A node's keys — those homed at it, and those it took over from lost nodes — are
//!   backed up on its `k` first successors: the next live nodes on the ring of ranks
//!   ([`super::Directory::backup_targets`]). When a node is lost, its first live successor is
//!   the one that serves its keys from then on ([`super::Directory::stand_in`]), from the
//!   images it kept; with `k` copies that successor is among the backups however many of up to
//!   `k` nodes are lost at once.
//! * **Images, not updates.** A round sends the images (value and updater state) of the slots
//!   whose version moved since the last round: an image is idempotent, needs no updater at the
//!   backup, and a hot key costs one image per round however many pushes it took.
//! * **Acknowledgement.** A push is acknowledged to its worker only once a round that began
//!   after it was applied is acknowledged by every backup (up to [`ROUNDS_IN_FLIGHT`] rounds
//!   are under way at once, and they complete in order): the owner holds a remote push's
//!   RESPONSE until then ([`Backups::hold`]), a local push's call waits for the round
//!   ([`BackupCounters`]). Pulls are answered at once.
//! * **Failover.** When a node is lost, its successor adopts the images it kept into slots
//!   of its own and serves the keys; every node routes them there. A round under way to a lost
//!   backup is given up, and the next round sends every image to the new successor.
//!
//! [`Backups`] is the state machine (no thread, clock, lock or I/O): rounds, the versions last
//! sent, the answers held back, and the images kept for the predecessor. The steps that scan
//! slots, encode and handle the messages and adopt images are in `step.rs`; the runtime's
//! driver (`runtime::backup`) and the simulator run the same machine.

mod handover;
mod images;
mod step;
pub(crate) mod wire;

pub(crate) use images::{KeptImages, Origin};

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A version no slot at rest has (versions at rest are even): "never sent".
pub(crate) const NEVER: u32 = 1;

/// Rounds under way at once, at most: the next begins while the last is on its way, so that
/// the parts of a large push applied meanwhile are shipped without waiting for its
/// acknowledgement, and the round a write waits for covers only what came after the last.
pub(crate) const ROUNDS_IN_FLIGHT: usize = 4;

/// An answer held until a round completes.
#[derive(Debug)]
pub(crate) struct HeldAnswer {
    /// The round whose completion releases it.
    pub round: u32,
    /// The node it goes to.
    pub origin: u16,
    /// The encoded RESPONSE.
    pub bytes: Vec<u8>,
}

/// A round just begun.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundStart {
    /// Its number.
    pub number: u32,
    /// The backups it goes to (none: no other node is alive, or nothing was to be sent, and
    /// the round completed at once).
    pub targets: Vec<u16>,
}

/// Rounds begun, completed and wanted, for workers that wait for their pushes to be backed
/// up: a local push waits for a round that began after it was applied.
#[derive(Debug, Default)]
pub struct BackupCounters {
    begun: AtomicU32,
    completed: AtomicU32,
    /// The latest round a worker waits for.
    wanted: AtomicU32,
    images: AtomicU64,
    adopted: AtomicU64,
    dropped: AtomicU64,
    handed: AtomicU64,
    given_back: AtomicU64,
    after_ready: AtomicU64,
}

/// Whether round `a` comes after round `b` (round numbers wrap: "after" is a difference below
/// half the range).
fn later(a: u32, b: u32) -> bool {
    a != b && a.wrapping_sub(b) < u32::MAX / 2
}

impl BackupCounters {
    /// A worker waits for round `round`: rounds go on until it completed.
    pub fn want(&self, round: u32) {
        let _ = self.wanted.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| later(round, w).then_some(round));
    }

    /// The latest round a worker waits for, if it has not completed.
    pub fn wanted_round(&self) -> Option<u32> {
        let wanted = self.wanted.load(Ordering::SeqCst);
        (!self.completed(wanted)).then_some(wanted)
    }

    /// The round a write applied before this call waits for (read after the write).
    pub fn round_after_now(&self) -> u32 {
        self.begun.load(Ordering::SeqCst).wrapping_add(1)
    }

    /// Whether round `round` (or a later one) has completed.
    pub fn completed(&self, round: u32) -> bool {
        !later(round, self.completed.load(Ordering::SeqCst))
    }

    /// The last round completed.
    pub fn last_completed(&self) -> u32 {
        self.completed.load(Ordering::SeqCst)
    }

    /// The last round begun.
    pub fn last_begun(&self) -> u32 {
        self.begun.load(Ordering::SeqCst)
    }

    pub(crate) fn note_images(&self, images: usize) {
        self.images.fetch_add(images as u64, Ordering::Relaxed);
    }

    pub(crate) fn note_dropped(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Writes that a node's loss failed and workers dropped (`Worker::drop_lost_writes`).
    pub fn writes_dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub(crate) fn note_adopted(&self, keys: usize) {
        self.adopted.fetch_add(keys as u64, Ordering::Relaxed);
    }

    pub(crate) fn note_handed(&self, keys: usize) {
        self.handed.fetch_add(keys as u64, Ordering::Relaxed);
    }

    pub(crate) fn note_given_back(&self, keys: usize) {
        self.given_back.fetch_add(keys as u64, Ordering::Relaxed);
    }

    pub(crate) fn note_request_after_ready(&self) {
        self.after_ready.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests a leaving node got from a peer after that peer's READY (none should come).
    pub fn requests_after_ready(&self) -> u64 {
        self.after_ready.load(Ordering::Relaxed)
    }

    /// Keys of other homes given back on the way out of a cluster that relocates keys.
    pub fn keys_given_back(&self) -> u64 {
        self.given_back.load(Ordering::Relaxed)
    }

    /// Keys handed to nodes that joined so far.
    pub fn keys_handed(&self) -> u64 {
        self.handed.load(Ordering::Relaxed)
    }

    /// Slot images sent to backups so far.
    pub fn images_sent(&self) -> u64 {
        self.images.load(Ordering::Relaxed)
    }

    /// Keys taken over from lost nodes' backups so far.
    pub fn keys_adopted(&self) -> u64 {
        self.adopted.load(Ordering::Relaxed)
    }
}

/// Keys per dirty block (a shard block: neighbouring keys share one bit).
const BLOCK_BITS: u32 = 6;

/// Per table, one bit per block of 64 keys that a write changed since a round last looked: a
/// round reads the versions of the marked blocks' keys only, not of every key this node serves.
///
/// A writer marks after applying (a load, and a locked `or` only when the bit is clear); a
/// round clears a word and then reads its blocks' slots. Both sides are sequentially
/// consistent, and so is the round counter a waiting worker reads after marking: a write whose
/// worker saw round `n` begun is marked before round `n + 1` clears the bits, so round
/// `n + 1` reads it — or the bit is set already and clears only when a round reads the block
/// after the write.
#[derive(Debug, Default)]
pub(crate) struct DirtyBlocks {
    tables: Box<[Box<[AtomicU64]>]>,
}

impl DirtyBlocks {
    /// Bits for tables of these key counts.
    pub fn new(keys: impl Iterator<Item = u64>) -> DirtyBlocks {
        DirtyBlocks { tables: keys.map(|k| (0..(k >> BLOCK_BITS).div_ceil(64) + 1).map(|_| AtomicU64::new(0)).collect()).collect() }
    }

    /// `key` of `table` was written.
    #[inline]
    pub fn mark(&self, table: u16, key: u64) {
        let block = key >> BLOCK_BITS;
        let Some(word) = self.tables.get(table as usize).and_then(|t| t.get((block >> 6) as usize)) else { return };
        let bit = 1u64 << (block & 63);
        if word.load(Ordering::SeqCst) & bit == 0 {
            word.fetch_or(bit, Ordering::SeqCst);
        }
    }

    /// Keys `first..first + count` of `table` were written.
    pub fn mark_run(&self, table: u16, first: u64, count: u64) {
        if count == 0 {
            return;
        }
        let (lo, hi) = (first >> BLOCK_BITS, (first + count - 1) >> BLOCK_BITS);
        for block in lo..=hi {
            self.mark(table, block << BLOCK_BITS);
        }
    }

    /// Clears and returns the marked blocks of `table` (their first keys).
    pub fn take(&self, table: u16) -> Vec<u64> {
        let mut blocks = Vec::new();
        for (w, word) in self.tables.get(table as usize).map(|t| &t[..]).unwrap_or_default().iter().enumerate() {
            if word.load(Ordering::SeqCst) == 0 {
                continue;
            }
            let mut bits = word.swap(0, Ordering::SeqCst);
            while bits != 0 {
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                blocks.push(((w as u64) << 6 | b) << BLOCK_BITS);
            }
        }
        blocks
    }
}

/// Keys per dirty block.
pub(crate) const BLOCK_KEYS: u64 = 1 << BLOCK_BITS;

/// One node's backups (see the module documentation).
#[derive(Debug)]
pub(crate) struct Backups {
    /// The last round begun and the last completed (rounds complete in order).
    begun: u32,
    completed: u32,
    /// The rounds under way, oldest first, each with the backups whose acknowledgement it
    /// still awaits (at most [`ROUNDS_IN_FLIGHT`]; acknowledgements come in order on each
    /// link, so they complete in order).
    under_way: VecDeque<(u32, Vec<u16>)>,
    /// The backups the versions in `sent` were sent to.
    targets: Vec<u16>,
    /// Per table and node the keys were homed at on start-up: each key's slot version last
    /// sent to `target`, by the key's index among that node's home keys.
    sent: Vec<Vec<Vec<u32>>>,
    /// Whether the next round reads every key this node serves (the first round, and every
    /// round after the backup changed or a round was given up), not the marked blocks only.
    full: bool,
    /// Answers held for rounds, in the order they were held.
    held: Vec<HeldAnswer>,
    /// Images kept for the predecessor.
    images: KeptImages,
    /// A joining node this node handed keys to and whose JOIN_SETTLED it awaits: until then no
    /// round completes (a write to a key handed over is on the joining node and in the images
    /// kept here — rounds after the hand-over no longer carry the key — and its acknowledgement
    /// must wait until the joined node's own backups hold it).
    gate: Option<u16>,
    /// The last round that completed while the gate was closed.
    gated_round: Option<u32>,
    /// Keys out of service for relocations, their writes waiting for a round to carry their
    /// last images (see `handover.rs`).
    hand_overs: Vec<handover::HandOver>,
    /// Hand-overs whose rounds completed, their writes not yet sent.
    ready: Vec<handover::HandOver>,
    /// The round that hands this node's keys over as it leaves, begun and not completed.
    last_round: Option<u32>,
    /// Steps that took released answers and have not handed them to the fabric yet.
    answers_in_hand: usize,
    /// The round this node leaves with completed, and LEFT is not out yet: it goes out once no
    /// step holds released answers ([`Backups::handed_over`]).
    left_due: bool,
}

/// What a round's completion released: the answers held for it (and the rounds before it),
/// and whether it completed the round this node leaves with.
///
/// LEFT must follow every released answer on every link, and steps that hold no shard in
/// common hand their frames to the fabric in no particular order. So a step that takes
/// answers counts as holding them until its driver has handed its output over
/// (`Step::handed_over`), and LEFT goes out from the step that, afterwards, finds the last
/// round completed and no answers in any step's hands. (A step that only saw the round
/// completed and sent LEFT could overtake answers still in another step's hands — one
/// completing the round before; the peers then closed the link first, and those pushes waited
/// out their timeout.)
#[derive(Debug, Default)]
pub(crate) struct Released {
    pub answers: Vec<HeldAnswer>,
    pub last_round: bool,
}

impl Default for Backups {
    fn default() -> Backups {
        Backups {
            begun: 0,
            completed: 0,
            under_way: VecDeque::new(),
            targets: Vec::new(),
            sent: Vec::new(),
            full: true,
            held: Vec::new(),
            images: KeptImages::default(),
            gate: None,
            gated_round: None,
            hand_overs: Vec::new(),
            ready: Vec::new(),
            last_round: None,
            answers_in_hand: 0,
            left_due: false,
        }
    }
}

impl Backups {
    /// Holds `bytes`, a RESPONSE to `origin`, until a round that begins after now completes.
    pub fn hold(&mut self, origin: u16, bytes: Vec<u8>) {
        self.held.push(HeldAnswer { round: self.begun.wrapping_add(1), origin, bytes });
    }

    /// Whether answers are held (a round should run).
    pub fn has_held(&self) -> bool {
        !self.held.is_empty()
    }

    /// Whether a round should begin now towards `targets`: answers are held or a worker waits
    /// for a round that none under way covers (one that began after them), and one may begin
    /// ([`Backups::can_begin`]).
    pub fn round_due(&self, targets: &[u16], counters: &BackupCounters) -> bool {
        let uncovered = |round: u32| self.under_way.back().is_none_or(|&(last, _)| later(round, last));
        self.can_begin(targets) && (self.held.last().is_some_and(|h| uncovered(h.round)) || counters.wanted_round().is_some_and(uncovered))
    }

    /// Whether a round towards `targets` may begin: fewer than [`ROUNDS_IN_FLIGHT`] are under
    /// way, and none if the backups changed (a round to new backups sends every image, and
    /// must not complete before rounds to the old ones that carried what it releases).
    pub fn can_begin(&self, targets: &[u16]) -> bool {
        self.under_way.is_empty() || (self.under_way.len() < ROUNDS_IN_FLIGHT && targets == self.targets)
    }

    /// Whether the last round went to other backups than `targets` (the next one sends every
    /// image).
    pub fn targets_differ(&self, targets: &[u16]) -> bool {
        self.targets != targets
    }

    /// The latest round under way, if any.
    pub fn under_way(&self) -> Option<u32> {
        self.under_way.back().map(|(n, _)| *n)
    }

    /// Whether round `number` is the only one under way.
    pub fn alone(&self, number: u32) -> bool {
        self.under_way.len() == 1 && self.under_way.front().is_some_and(|(n, _)| *n == number)
    }

    /// Begins the next round towards `targets` (the node's current first successors; see
    /// [`Backups::can_begin`]). When they changed since the last round, every version sent is
    /// forgotten: the round sends every image. A round that has no target completes at once
    /// ([`Backups::complete`]).
    pub fn begin(&mut self, targets: Vec<u16>, counters: &BackupCounters) -> RoundStart {
        debug_assert!(self.can_begin(&targets), "{} rounds under way", self.under_way.len());
        if targets != self.targets {
            self.forget_sent();
            self.targets = targets.clone();
        }
        self.begun = self.begun.wrapping_add(1);
        counters.begun.store(self.begun, Ordering::SeqCst);
        if !targets.is_empty() {
            self.under_way.push_back((self.begun, targets.clone()));
        }
        RoundStart { number: self.begun, targets }
    }

    /// Round `number` (under way) awaits the acknowledgements of `nodes` too: with relocation
    /// a round also goes to the homes of keys held here and to the backups of keys handed over.
    pub fn await_also(&mut self, number: u32, nodes: &[u16]) {
        if let Some((_, awaiting)) = self.under_way.iter_mut().find(|(n, _)| *n == number) {
            for &node in nodes {
                if !awaiting.contains(&node) {
                    awaiting.push(node);
                }
            }
        }
    }

    /// The versions last sent of the keys homed at `home` on start-up, in `table` (`keys` of
    /// them), all [`NEVER`] the first time.
    pub fn sent_versions(&mut self, table: u16, home: u16, keys: usize) -> &mut Vec<u32> {
        let (table, home) = (table as usize, home as usize);
        if self.sent.len() <= table {
            self.sent.resize_with(table + 1, Vec::new);
        }
        let homes = &mut self.sent[table];
        if homes.len() <= home {
            homes.resize_with(home + 1, Vec::new);
        }
        let v = &mut homes[home];
        if v.len() != keys {
            *v = vec![NEVER; keys];
        }
        v
    }

    /// Round `number` completed (acknowledged, or nothing to send it to), and every round
    /// before it: returns the answers they release.
    pub fn complete(&mut self, number: u32, counters: &BackupCounters) -> Released {
        while self.under_way.front().is_some_and(|&(n, _)| !later(n, number)) {
            self.under_way.pop_front();
        }
        // A round not begun, or one completed already (an empty round completes at once).
        if later(number, self.begun) || !later(number, self.completed) {
            return Released::default();
        }
        if self.gate.is_some() {
            self.gated_round = Some(number);
            return Released::default();
        }
        self.completed = number;
        counters.completed.store(number, Ordering::SeqCst);
        self.hand_overs_completed(number);
        let (answers, kept) = std::mem::take(&mut self.held).into_iter().partition(|h| h.round.wrapping_sub(number).wrapping_sub(1) >= u32::MAX / 2);
        self.held = kept;
        let last_round = self.last_round.take_if(|&mut last| !later(last, number)).is_some();
        if !answers.is_empty() {
            self.answers_in_hand += 1;
        }
        self.left_due |= last_round;
        Released { answers, last_round }
    }

    /// A step handed its output to the fabric, `released` sets of released answers among it:
    /// returns whether LEFT should go out now, from that step (once).
    pub fn handed_over(&mut self, released: usize) -> bool {
        self.answers_in_hand = self.answers_in_hand.saturating_sub(released);
        let send = self.left_due && self.answers_in_hand == 0;
        if send {
            self.left_due = false;
        }
        send
    }

    /// Round `number`, just begun, is the one this node leaves with: once it completed, LEFT
    /// goes out behind every answer released ([`Released`]).
    pub fn set_last_round(&mut self, number: u32) {
        self.last_round = Some(number);
    }

    /// A BACKUP_ACK of `round` came from `from`: the answers it releases, if it was the last
    /// acknowledgement the oldest round under way awaited (others, from a round given up or a
    /// node that is not one of its backups, are dropped; a later round's is counted, and it
    /// completes after the rounds before it).
    pub fn handle_ack(&mut self, from: u16, round: u32, counters: &BackupCounters) -> Option<Released> {
        let (_, awaiting) = self.under_way.iter_mut().find(|(n, awaiting)| *n == round && awaiting.contains(&from))?;
        awaiting.retain(|&t| t != from);
        let mut done = None;
        while let Some(&(n, ref awaiting)) = self.under_way.front()
            && awaiting.is_empty()
        {
            self.under_way.pop_front();
            done = Some(n);
        }
        done.map(|n| self.complete(n, counters))
    }

    /// Gives the rounds under way up (a backup is lost, or did not answer in time): every
    /// version sent is forgotten, so the next round sends every image. Returns whether a round
    /// was under way.
    pub fn give_up(&mut self) -> bool {
        self.forget_sent();
        self.hand_overs_given_up();
        let any = !self.under_way.is_empty();
        self.under_way.clear();
        any
    }

    /// Forgets every version sent: the next round reads and sends every key.
    pub fn forget_sent(&mut self) {
        self.sent.clear();
        self.full = true;
    }

    /// Whether this round reads every key this node serves (and the next need not).
    pub fn take_full(&mut self) -> bool {
        std::mem::take(&mut self.full)
    }

    /// This node handed keys to `joining`: rounds complete only once its backups hold them
    /// ([`Backups::open_gate`]).
    pub fn close_gate(&mut self, joining: u16) {
        self.gate = Some(joining);
    }

    /// `joining`'s backups hold the keys handed to it (JOIN_SETTLED): the rounds that
    /// completed meanwhile complete now; returns the answers they release.
    pub fn open_gate(&mut self, joining: u16, counters: &BackupCounters) -> Released {
        if self.gate != Some(joining) {
            return Released::default();
        }
        self.gate = None;
        match self.gated_round.take() {
            Some(round) => self.complete(round, counters),
            None => Released::default(),
        }
    }

    /// `peer` is lost: a round under way that still awaits its acknowledgement is given up (one
    /// it acknowledged already completes with the others'), and answers held for it are
    /// dropped. Returns whether a round was given up. A joining node lost before its backups held
    /// the keys handed to it opens the gate without completing anything: those keys are adopted
    /// back here, and the next round, which carries them, releases what waited.
    pub fn handle_lost(&mut self, peer: u16) -> bool {
        if self.gate == Some(peer) {
            self.gate = None;
            self.gated_round = None;
        }
        let gave_up = self.under_way.iter().any(|(_, awaiting)| awaiting.contains(&peer)) && self.give_up();
        self.held.retain(|h| h.origin != peer);
        self.images.forget_origin(peer);
        gave_up
    }

    /// The images kept.
    pub fn images(&mut self) -> &mut KeptImages {
        &mut self.images
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_answer_waits_for_a_round_that_began_after_it() {
        let (mut b, c) = (Backups::default(), BackupCounters::default());
        let first = b.begin(vec![1], &c);
        // Held while round 1 is under way (it may have scanned the slot already): round 2.
        b.hold(4, vec![1]);
        assert_eq!(c.round_after_now(), 2);
        assert!(b.handle_ack(2, first.number, &c).is_none(), "an acknowledgement from a node that is not the backup");
        assert!(b.handle_ack(1, first.number, &c).unwrap().answers.is_empty(), "round 1 does not release it");
        assert!(c.completed(1) && !c.completed(2));
        let second = b.begin(vec![1], &c);
        b.hold(5, vec![2]);
        let released = b.handle_ack(1, second.number, &c).unwrap();
        assert_eq!(released.answers.iter().map(|h| h.origin).collect::<Vec<_>>(), vec![4]);
        assert!(b.has_held());
        // A round with no backup completes at once and releases the rest.
        let third = b.begin(vec![], &c);
        assert!(b.under_way().is_none());
        assert_eq!(b.complete(third.number, &c).answers.len(), 1);
        assert!(!b.has_held() && c.completed(3));
    }

    /// Only the completion that covers the round a node leaves with says so, once: its step
    /// sends LEFT behind the answers it released.
    #[test]
    fn the_completion_of_the_last_round_is_told_once_to_the_step_that_completes_it() {
        let (mut b, c) = (Backups::default(), BackupCounters::default());
        let first = b.begin(vec![1], &c);
        b.hold(4, vec![1]);
        let last = b.begin(vec![1], &c);
        b.set_last_round(last.number);
        let released = b.handle_ack(1, first.number, &c).unwrap();
        assert!(!released.last_round, "an earlier round");
        let released = b.handle_ack(1, last.number, &c).unwrap();
        assert!(released.last_round && released.answers.len() == 1);
        let after = b.begin(vec![], &c);
        assert!(!b.complete(after.number, &c).last_round, "told once");
        assert!(b.handed_over(1), "the step that took the last answers sends LEFT");
        assert!(!b.handed_over(0), "once");
        // A later round's completion covers it too (one given up is never acknowledged).
        let given_up = b.begin(vec![1], &c);
        b.set_last_round(given_up.number);
        assert!(b.give_up());
        let next = b.begin(vec![1], &c);
        assert!(b.handle_ack(1, next.number, &c).unwrap().last_round);
        assert!(b.handed_over(0), "no answers: the completing step sends it");
    }

    /// LEFT waits for every step that took released answers to hand them over, including one
    /// that completed an earlier round and is still on its way to the fabric.
    #[test]
    fn left_waits_for_answers_still_in_another_steps_hands() {
        let (mut b, c) = (Backups::default(), BackupCounters::default());
        let first = b.begin(vec![1], &c);
        b.hold(4, vec![1]);
        let last = b.begin(vec![1], &c);
        b.set_last_round(last.number);
        b.hold(5, vec![2]);
        let earlier = b.handle_ack(1, first.number, &c).unwrap();
        assert!(earlier.answers.is_empty() && !earlier.last_round);
        let third = b.begin(vec![1], &c);
        // One step completes the last round and takes its answer, another the round after
        // it; the first to hand its output over does not send LEFT.
        let at_last = b.handle_ack(1, last.number, &c).unwrap();
        assert!(at_last.last_round && at_last.answers.len() == 1);
        let after = b.handle_ack(1, third.number, &c).unwrap();
        assert!(!after.last_round && after.answers.len() == 1);
        assert!(!b.handed_over(1), "another step still holds answers");
        assert!(b.handed_over(1), "the last one to hand them over sends LEFT");
    }

    #[test]
    fn rounds_after_a_hand_over_complete_once_the_joining_node_holds_the_keys() {
        let (mut b, c) = (Backups::default(), BackupCounters::default());
        b.hold(4, vec![1]);
        let first = b.begin(vec![1], &c);
        b.close_gate(2);
        assert!(b.handle_ack(1, first.number, &c).unwrap().answers.is_empty(), "gated");
        assert!(!c.completed(first.number));
        assert!(b.open_gate(3, &c).answers.is_empty(), "another node");
        assert_eq!(b.open_gate(2, &c).answers.len(), 1);
        assert!(c.completed(first.number));
        // The joining node is lost instead: nothing completes until a later round.
        b.hold(4, vec![2]);
        let second = b.begin(vec![1], &c);
        b.close_gate(2);
        assert!(b.handle_ack(1, second.number, &c).unwrap().answers.is_empty());
        b.handle_lost(2);
        assert!(!c.completed(second.number) && b.has_held());
        let third = b.begin(vec![1], &c);
        assert_eq!(b.handle_ack(1, third.number, &c).unwrap().answers.len(), 1);
    }

    #[test]
    fn a_new_backup_or_a_round_given_up_sends_every_image_again() {
        let (mut b, c) = (Backups::default(), BackupCounters::default());
        let _ = b.begin(vec![1], &c);
        b.sent_versions(0, 0, 3)[1] = 8;
        assert!(b.handle_ack(1, 1, &c).is_some());
        let _ = b.begin(vec![1], &c);
        assert_eq!(b.sent_versions(0, 0, 3)[1], 8, "the same backup: versions kept");
        assert!(b.give_up());
        assert_eq!(b.sent_versions(0, 0, 3)[1], NEVER, "a round given up: everything again");
        b.sent_versions(0, 0, 3)[1] = 8;
        let _ = b.begin(vec![2], &c);
        assert_eq!(b.sent_versions(0, 0, 3)[1], NEVER, "a new backup: everything again");
        // The backup is lost: the round is given up; its late acknowledgement is dropped.
        b.hold(2, vec![0]);
        b.hold(3, vec![0]);
        assert!(b.handle_lost(2));
        assert!(b.handle_ack(2, 3, &c).is_none());
        assert_eq!(b.held.len(), 1, "answers for the lost node are dropped");
    }

    #[test]
    fn a_round_to_several_backups_completes_once_every_one_acknowledged_it() {
        let (mut b, c) = (Backups::default(), BackupCounters::default());
        b.hold(4, vec![1]);
        let first = b.begin(vec![1, 2], &c);
        assert_eq!(first.targets, vec![1, 2]);
        assert!(b.handle_ack(1, first.number, &c).is_none(), "node 2 has not acknowledged");
        assert!(b.handle_ack(1, first.number, &c).is_none(), "node 1 again");
        assert!(b.handle_ack(3, first.number, &c).is_none(), "not a backup");
        assert!(!c.completed(first.number));
        assert_eq!(b.handle_ack(2, first.number, &c).unwrap().answers.len(), 1);
        assert!(c.completed(first.number));
        // A backup that acknowledged and is then lost does not give the round up: the others'
        // acknowledgements complete it.
        b.hold(4, vec![2]);
        let second = b.begin(vec![1, 2], &c);
        assert!(b.handle_ack(2, second.number, &c).is_none());
        assert!(!b.handle_lost(2), "node 2 acknowledged already");
        assert_eq!(b.handle_ack(1, second.number, &c).unwrap().answers.len(), 1);
        // One still awaited is lost: the round is given up, and the next, to the new backups,
        // sends every image.
        b.hold(4, vec![3]);
        let third = b.begin(vec![1, 3], &c);
        b.sent_versions(0, 0, 2)[0] = 6;
        assert!(b.handle_lost(3));
        assert!(b.handle_ack(1, third.number, &c).is_none(), "given up");
        assert_eq!(b.sent_versions(0, 0, 2)[0], NEVER);
        let fourth = b.begin(vec![1, 0], &c);
        assert!(b.handle_ack(1, fourth.number, &c).is_none());
        assert_eq!(b.handle_ack(0, fourth.number, &c).unwrap().answers.len(), 1);
    }

    #[test]
    fn two_rounds_may_be_under_way_and_complete_in_order() {
        let (mut b, c) = (Backups::default(), BackupCounters::default());
        let targets = [1u16];
        b.hold(4, vec![1]);
        assert!(b.round_due(&targets, &c));
        let first = b.begin(vec![1], &c);
        assert!(!b.round_due(&targets, &c), "the held answer is covered by the round under way");
        b.hold(5, vec![2]);
        assert!(b.round_due(&targets, &c), "this one needs a round that begins after it");
        assert!(!b.can_begin(&[2]), "new backups wait until the rounds to the old ones are done");
        let second = b.begin(vec![1], &c);
        // As many as may be under way: the next waits.
        let mut more = Vec::new();
        while b.can_begin(&targets) {
            b.hold(9, vec![0]);
            more.push(b.begin(vec![1], &c));
        }
        assert_eq!(b.under_way.len(), ROUNDS_IN_FLIGHT);
        b.hold(6, vec![3]);
        assert!(!b.round_due(&targets, &c), "{ROUNDS_IN_FLIGHT} under way");
        // The second's acknowledgement cannot overtake the first's on one link; were it
        // counted first, it would wait for the first.
        assert!(b.handle_ack(1, second.number, &c).is_none());
        assert!(!c.completed(first.number));
        let released = b.handle_ack(1, first.number, &c).unwrap();
        assert_eq!(released.answers.iter().map(|h| h.origin).collect::<Vec<_>>(), vec![4, 5], "both rounds completed");
        assert!(c.completed(second.number));
        for round in &more {
            assert_eq!(b.handle_ack(1, round.number, &c).unwrap().answers.len(), 1);
        }
        assert!(b.under_way().is_none());
        // A worker's wanted round is due like a held answer, and a round given up covers
        // nothing.
        let third = b.begin(vec![1], &c);
        c.want(third.number.wrapping_add(1));
        assert!(b.round_due(&targets, &c));
        assert!(b.give_up());
        assert!(b.round_due(&targets, &c) && b.handle_ack(1, third.number, &c).is_none());
        let fourth = b.begin(vec![1], &c);
        assert_eq!(b.handle_ack(1, fourth.number, &c).unwrap().answers.len(), 1, "the answer held for the third round");
        assert!(!b.round_due(&targets, &c) && c.wanted_round().is_none());
    }
}
