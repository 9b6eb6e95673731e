//! One event's exclusive access to the shards it needs, and the events that are not about
//! accesses or relocations: frames (dispatch), write completions, lost peers, timeouts,
//! barriers.

use bytes::Bytes;
use parking_lot::MutexGuard;

use super::barrier::BarrierKind;
use super::requester::{Delivery, worker_of};
use super::shard::{DeadlineKind, Shard, wr_shard};
use super::transmit::{ALL_WORKERS, Transmit};
use super::wire::{self, Failure, Response, msg};
use super::{Core, Directory};
use crate::error::{Error, Result};
use crate::stats::MessageKind;

/// How far an event handler got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// The event is handled.
    Done,
    /// The step must end here: drain it, drop it, and call the handler again on a fresh step
    /// with these positions (a byte offset into a frame and an item of the message there, or
    /// an index into a batch of landed writes in `at`).
    Yield {
        /// Where to resume.
        at: usize,
        /// The item of the message at `at` to resume with.
        item: usize,
    },
}

/// Exclusive access to a set of shards for one event, and the caller's output buffer.
///
/// A step takes shard locks at most once, in ascending order, when its event first needs them;
/// an event that later needs shards it does not hold ends the step with [`Progress::Yield`].
/// So steps never wait for each other in a cycle. See the module documentation for what the
/// caller must do before dropping a step.
pub struct Step<'c, 't> {
    pub(crate) core: &'c Core,
    pub(crate) tx: &'t mut Transmit,
    guards: Vec<Option<MutexGuard<'c, Shard>>>,
    held: u64,
    pub(crate) now: u64,
    /// Sets of answers a backup round released into this step's output (see
    /// `backup::Released`), and whether it completed the round this node leaves with.
    released: usize,
    completed_last_round: bool,
}

/// A step that took released answers and was dropped without [`Step::handed_over`] would count
/// as holding them for ever, and a node leaving would never send LEFT: a driver's mistake,
/// caught here in debug builds.
impl Drop for Step<'_, '_> {
    fn drop(&mut self) {
        debug_assert!(
            std::thread::panicking() || (self.released == 0 && !self.completed_last_round),
            "a step that released backed-up answers was dropped before its driver called handed_over"
        );
    }
}

impl<'c, 't> Step<'c, 't> {
    pub(crate) fn new(core: &'c Core, tx: &'t mut Transmit, now: u64) -> Step<'c, 't> {
        Step { core, tx, guards: (0..core.directory().shards()).map(|_| None).collect(), held: 0, now, released: 0, completed_last_round: false }
    }

    /// The output buffer (to drain before the step is dropped).
    pub fn transmit(&mut self) -> &mut Transmit {
        self.tx
    }

    /// A backup round's completion released answers into this step's output (`answers`), or
    /// completed the round this node leaves with (`last_round`).
    pub(crate) fn note_released(&mut self, answers: bool, last_round: bool) {
        self.released += usize::from(answers);
        self.completed_last_round |= last_round;
    }

    /// The driver handed this step's output to the fabric. Returns whether the step has more
    /// to hand over: LEFT, when the round this node leaves with completed and no step holds
    /// answers it released any more (see `backup::Released`). Costs nothing in a step that
    /// released none.
    pub fn handed_over(&mut self) -> bool {
        if self.released == 0 && !self.completed_last_round {
            return false;
        }
        let released = std::mem::take(&mut self.released);
        self.completed_last_round = false;
        let send = self.core.backups().lock().handed_over(released);
        if send {
            self.send_left();
            return true;
        }
        false
    }

    /// The shards the step holds, one bit each.
    pub fn held_shards(&self) -> u64 {
        self.held
    }

    /// Takes the shards in `mask` unless the step already took others: true when the step
    /// holds all of them afterwards.
    pub(crate) fn try_acquire(&mut self, mask: u64) -> bool {
        if mask & !self.held == 0 {
            return true;
        }
        if self.held != 0 {
            return false;
        }
        let mut bits = mask;
        while bits != 0 {
            let s = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            self.guards[s] = Some(self.core.shard_lock(s).lock());
        }
        self.held = mask;
        true
    }

    /// Takes the shards of `keys` (table and key) unless the step already took others: true
    /// when the step holds all of them afterwards.
    pub(crate) fn try_acquire_keys(&mut self, keys: impl IntoIterator<Item = (u16, u64)>) -> bool {
        let dir = self.core.directory();
        let mask = keys.into_iter().fold(0u64, |mask, (table, key)| mask | 1 << dir.shard_of(table, key));
        self.try_acquire(mask)
    }

    /// Every shard's bit.
    pub(crate) fn all_shards(&self) -> u64 {
        let n = self.core.directory().shards();
        if n >= 64 { u64::MAX } else { (1u64 << n) - 1 }
    }

    /// A held shard. Handlers only touch shards they acquired, so a missing one is a bug.
    #[inline]
    pub(crate) fn shard(&mut self, s: usize) -> &mut Shard {
        self.guards[s].as_deref_mut().expect("the step holds the shard it works on")
    }

    /// A held shard, to read.
    #[inline]
    pub(crate) fn shard_ref(&self, s: usize) -> &Shard {
        self.guards[s].as_deref().expect("the step holds the shard it works on")
    }

    /// The held shard of `key`.
    #[inline]
    pub(crate) fn shard_of(&mut self, table: u16, key: u64) -> &mut Shard {
        let s = self.core.directory().shard_of(table, key);
        self.shard(s)
    }

    pub(crate) fn directory(&self) -> &'c Directory {
        self.core.directory()
    }

    /// Handles a frame of messages from peer `from`, starting at byte `at` and, in the message
    /// there, at item `item` (0 and 0 for a new frame). RESPONSE and FAILURE messages become
    /// deliveries to the workers whose operations they answer (slices of `frame`, not copies).
    /// A message that breaks the protocol is an error; the caller should close the connection.
    pub fn handle_frame(&mut self, from: u16, frame: &Bytes, at: usize, item: usize) -> Result<Progress> {
        let dir = self.directory();
        if from as usize >= dir.nodes() || from == dir.rank() {
            return Err(Error::Protocol(format!("frame from invalid node {from}")));
        }
        let Some(rest) = frame.get(at..) else {
            return Err(Error::Protocol(format!("resuming beyond a frame of {} bytes", frame.len())));
        };
        if at == 0 && item == 0 {
            self.tx.count_received(frame.len());
        }
        let mut messages = wire::Messages::new(rest);
        let mut run: Option<(u16, usize, usize)> = None;
        let mut first_item = item;
        loop {
            let start = at + messages.offset();
            let Some(body) = messages.next() else { break };
            let body = body?;
            let end = at + messages.offset();
            match body[0] {
                msg::RESPONSE | msg::FAILURE => {
                    let op =
                        if body[0] == msg::RESPONSE { Response::decode(body, |t| dir.table(t).map(|m| m.value_len))?.op } else { Failure::decode(body)?.op };
                    let worker = worker_of(op);
                    match &mut run {
                        Some((w, _, e)) if *w == worker && *e == start => *e = end,
                        _ => {
                            self.flush_run(from, frame, run.take());
                            run = Some((worker, start, end));
                        }
                    }
                }
                kind => {
                    self.flush_run(from, frame, run.take());
                    let resume = match kind {
                        msg::ACCESS => self.handle_access(from, body, first_item)?,
                        msg::LOCALIZE => self.handle_localize(from, body, first_item, true)?,
                        msg::RELOCATE => self.handle_relocate(body, first_item, true)?,
                        msg::LOCALIZE_FAILED => self.handle_localize_failed(from, body)?,
                        msg::BARRIER | msg::BARRIER_RELEASE | msg::BARRIER_FAILED | msg::BARRIER_PASSED => {
                            let core = self.core;
                            self.tx.touch_barrier();
                            core.barriers().lock().handle_message(from, body, dir, self.tx)?;
                            None
                        }
                        msg::CLOCK => {
                            self.core.clocks().lock().handle_message(from, body)?;
                            self.tx.touch_clock();
                            None
                        }
                        msg::REPLICA_DELTA => {
                            self.handle_replica_delta(from, body)?;
                            None
                        }
                        msg::REPLICA_ACK => {
                            self.handle_replica_ack(from, body)?;
                            None
                        }
                        msg::INTENT => {
                            self.handle_intent(from, body)?;
                            None
                        }
                        msg::INTENT_GO => {
                            self.handle_intent_go(body)?;
                            None
                        }
                        msg::REPLICA_SYNC => {
                            self.handle_replica_sync(from, body)?;
                            None
                        }
                        msg::ASSIGN => {
                            self.handle_assign(from, body)?;
                            None
                        }
                        msg::ASSIGNED => {
                            self.handle_assigned(from, body)?;
                            None
                        }
                        msg::EVICT => {
                            self.handle_evict(from, body)?;
                            None
                        }
                        msg::EVICTED => {
                            self.handle_evicted(from, body)?;
                            None
                        }
                        msg::REPLICA_SYNC_ACK => {
                            self.handle_replica_sync_ack(from, body)?;
                            None
                        }
                        msg::BACKUP => {
                            self.handle_backup(from, body)?;
                            None
                        }
                        msg::BACKUP_ACK => {
                            self.handle_backup_ack(from, body)?;
                            self.advance_leave();
                            self.advance_join_ready();
                            self.advance_join_settled();
                            None
                        }
                        msg::LEAVE_READY => {
                            self.handle_leave_ready(from, body)?;
                            None
                        }
                        msg::JOIN_ACK => {
                            self.handle_join_ack(from, body)?;
                            self.advance_join_settled();
                            None
                        }
                        // These need every shard, as PEER_LOST does.
                        msg::LEAVE_ASK
                        | msg::LEAVE_BEGIN
                        | msg::LEAVE_KNOWN
                        | msg::LEFT
                        | msg::JOIN_ASK
                        | msg::JOIN_WELCOME
                        | msg::JOIN_READY
                        | msg::JOIN_IMAGES
                        | msg::JOIN_HANDED
                        | msg::JOINED
                        | msg::JOIN_ABANDONED
                        | msg::JOIN_SETTLED
                        | msg::CENSUS_FLUSH
                        | msg::CENSUS
                        | msg::CENSUS_DONE
                        | msg::GIVE_BACK => {
                            let progress = match kind {
                                msg::GIVE_BACK => self.handle_give_back(from, body)?,
                                msg::CENSUS_FLUSH | msg::CENSUS_DONE => self.handle_census_mark(kind, from, body)?,
                                msg::CENSUS => self.handle_census(from, body)?,
                                msg::LEAVE_ASK => self.handle_leave_ask(from, body)?,
                                msg::LEAVE_BEGIN => self.handle_leave_begin(from, body)?,
                                msg::LEAVE_KNOWN => self.handle_leave_known(from, body)?,
                                msg::JOIN_ASK => self.handle_join_ask(from, body)?,
                                msg::JOIN_WELCOME => self.handle_join_welcome(from, body)?,
                                msg::JOIN_READY => self.handle_join_ready(from, body)?,
                                msg::JOIN_IMAGES => self.handle_join_images(from, body)?,
                                msg::JOIN_HANDED => self.handle_join_handed(from, body)?,
                                msg::JOINED => self.handle_joined(from, body)?,
                                msg::JOIN_ABANDONED => self.handle_join_abandoned(from, body)?,
                                msg::JOIN_SETTLED => self.handle_join_settled(from, body)?,
                                _ => self.handle_left(from, body)?,
                            };
                            match progress {
                                Progress::Done => None,
                                Progress::Yield { .. } => return Ok(Progress::Yield { at: start, item: 0 }),
                            }
                        }
                        // Needs every shard: a step holding some ends here, and a fresh one
                        // starts with this message.
                        msg::PEER_LOST => match self.handle_peer_lost_notice(from, body)? {
                            Progress::Done => None,
                            Progress::Yield { .. } => return Ok(Progress::Yield { at: start, item: 0 }),
                        },
                        other => return Err(Error::Protocol(format!("unknown message type {other}"))),
                    };
                    if let Some(item) = resume {
                        return Ok(Progress::Yield { at: start, item });
                    }
                    // A full answer is ready while more messages wait: end the step here so
                    // that the caller sends it before the rest is served (a large request streams
                    // back a frame at a time).
                    if self.tx.has_sealed_frames() && end < frame.len() {
                        return Ok(Progress::Yield { at: end, item: 0 });
                    }
                }
            }
            first_item = 0;
        }
        self.flush_run(from, frame, run);
        Ok(Progress::Done)
    }

    fn flush_run(&mut self, from: u16, frame: &Bytes, run: Option<(u16, usize, usize)>) {
        if let Some((worker, start, end)) = run {
            self.tx.deliver(worker, Delivery::Messages { from, bytes: frame.slice(start..end) });
        }
    }

    /// A one-sided write this node posted completed (`Ok`) or failed: its source slot is free.
    pub fn handle_write_done(&mut self, wr_id: u64, result: Result<()>) -> Progress {
        let s = wr_shard(wr_id);
        if s >= self.directory().shards() {
            tracing::warn!(node = self.directory().rank(), wr_id, "completion of an unknown write");
            return Progress::Done;
        }
        // During a census, a completed write may let this node flush: that step needs every
        // shard.
        let census = self.core.census_active();
        if !self.try_acquire(if census { self.all_shards() } else { 1 << s }) {
            return Progress::Yield { at: 0, item: 0 };
        }
        if let Some(out) = self.shard(s).outgoing.remove(&wr_id) {
            self.core.writes_out().fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            if let Err(e) = result {
                let keys = 1 + out.rest.len();
                tracing::error!(
                    node = self.directory().rank(),
                    table = out.first.table(),
                    keys,
                    "a relocation's value transfer failed ({e}); the keys' values are lost"
                );
            }
            let store = self.core.store();
            store.free(out.first);
            for slot in out.rest {
                store.free(slot);
            }
        }
        if census {
            self.advance_census();
        }
        if self.core.leave_check_due() {
            // On a node leaving a cluster that relocates keys, the last round may begin now
            // (if this step can take every shard; the backup watchdog's otherwise).
            self.advance_leave();
        }
        Progress::Done
    }

    /// A peer is gone. Marks it lost (new operations towards it fail at once), gives up what
    /// may depend on it — relocations to this node that it might have been sending are made
    /// suspect and given up after the grace period, keys it owned are lost at their home,
    /// barriers fail — and tells every worker, whose pending operations fail. With backups its
    /// keys fail over: its successor adopts their images and serves them from now on, and
    /// every node routes them there.
    pub fn handle_peer_lost(&mut self, peer: u16, reason: &str) -> Progress {
        self.remove_peer(peer, reason, false)
    }

    /// Removes `peer` from the cluster as [`Step::handle_peer_lost`] describes; a peer that
    /// `left` gracefully (LEFT, see `protocol::leave`) answered everything it was sent and
    /// handed its keys over, so nothing fails and no one else needs telling.
    pub(crate) fn remove_peer(&mut self, peer: u16, reason: &str, left: bool) -> Progress {
        let all = self.all_shards();
        if !self.try_acquire(all) {
            return Progress::Yield { at: 0, item: 0 };
        }
        let dir = self.directory();
        if self.core.settings().relocation && self.core.departures().lock().has_left() {
            // This node left a cluster that relocates keys: its peers close their links to it,
            // as they should, and it serves nothing any more — it takes no census, which could
            // write images into its former peers' slots.
            dir.mark_lost(peer, reason);
            self.tx.forget(peer);
            return Progress::Done;
        }
        // The coordinator decides whether a join whose joining node is lost ends (a node that
        // counts the rank as gone cannot tell the joining node's loss from the old one's).
        self.abandon_join_of(peer);
        if !dir.mark_lost(peer, reason) {
            // (A joining node's loss: rounds that awaited it were given up.)
            self.advance_join_ready();
            self.advance_join_settled();
            self.begin_backup_round_if_due();
            return Progress::Done;
        }
        dir.set_joining(peer, false);
        let error = Error::PeerLost { node: peer as usize, reason: reason.to_string() };
        if !left {
            self.announce_loss(peer, reason);
        }
        // With relocation and backups, a census finds where the lost node's keys are and what
        // was on its way from it (`protocol::census`); nothing is given up meanwhile.
        let census = dir.failover() && self.core.settings().relocation;
        if !census {
            for s in 0..dir.shards() {
                let mut keys: Vec<(u16, u64)> = self.shard(s).transits.keys().copied().collect();
                keys.sort_unstable();
                for key in keys {
                    self.abandon_transit_queue(key, error.clone());
                }
            }
            dir.lose_owner(peer);
        }
        dir.uncache_node(peer);
        if dir.failover() {
            self.fail_over(peer, left);
        }
        if census {
            self.begin_census(peer);
        }
        self.core.barriers().lock().handle_peer_lost(peer, &error, dir, self.tx);
        // (Otherwise a new coordinator no longer waits for the lost node's report:
        // `end_departure` below advances its takeover.)
        if dir.failover() && dir.coordinated(peer) {
            self.coordinator_lost(dir.coordinator());
        }
        self.intents_of_lost_node(peer);
        self.tx.touch_barrier();
        // A lost node no longer holds back the cluster's clocks.
        self.tx.touch_clock();
        self.tx.forget(peer);
        if !left {
            self.tx.deliver(ALL_WORKERS, Delivery::PeerLost { node: peer, reason: reason.to_string(), losses: dir.losses() });
        }
        self.end_departure(peer);
        // A loss may leave no backup to wait for, or end the round a READY waited for (or
        // make this joined node ready: the loss stands for the lost node's JOIN_ACK).
        self.advance_join_ready();
        self.advance_join_settled();
        Progress::Done
    }

    /// Tells every other live node that `peer` is lost (PEER_LOST), ahead of anything this
    /// node sends them later. A node may learn of a loss before others do (each watches its own
    /// connections); without the notice, a request it sends after learning could reach a home
    /// that has not learnt yet and be forwarded to the lost node, to wait out the operation
    /// timeout. Links keep their order, so the home learns first and fails the request.
    fn announce_loss(&mut self, peer: u16, reason: &str) {
        let incarnation = self.directory().incarnation(peer);
        self.send_to_live(&[peer], MessageKind::Failure, |out| wire::encode_peer_lost(out, peer, incarnation, reason));
    }

    /// Sends a message to every live node but this one and those in `except`: `encode` appends
    /// it to a node's buffer and returns its length.
    pub(crate) fn send_to_live(&mut self, except: &[u16], kind: MessageKind, encode: impl Fn(&mut Vec<u8>) -> usize) {
        let dir = self.directory();
        let rank = dir.rank();
        for node in (0..dir.nodes() as u16).filter(|&n| n != rank && !except.contains(&n) && !dir.is_lost(n)) {
            let bytes = encode(self.tx.buf(node));
            self.tx.sent(node, kind, bytes);
        }
    }

    /// PEER_LOST from `from`: its node is lost here too (see [`Step::announce_loss`]).
    fn handle_peer_lost_notice(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let (peer, incarnation, reason) = wire::decode_peer_lost(body)?;
        let dir = self.directory();
        if peer as usize >= dir.nodes() {
            return Err(Error::Protocol(format!("PEER_LOST names node {peer} of {}", dir.nodes())));
        }
        // A node never names itself; one naming this node has lost it and no longer talks
        // to it. A notice about an earlier incarnation of a node that joined since is stale.
        if peer == from || peer == dir.rank() || dir.is_lost(peer) || incarnation != dir.incarnation(peer) {
            return Ok(Progress::Done);
        }
        Ok(self.handle_peer_lost(peer, &format!("{reason}; reported by node {from}")))
    }

    /// Gives up relocations whose deadline passed: a transfer that did not land within the
    /// operation timeout fails what waits for it; after a loss, one that did not land within the
    /// grace period fails its hand-overs too.
    pub fn handle_timeout(&mut self) -> Progress {
        let all = self.all_shards();
        if !self.try_acquire(all) {
            return Progress::Yield { at: 0, item: 0 };
        }
        let millis = self.core.settings().op_timeout_ns / 1_000_000;
        for s in 0..self.directory().shards() {
            let now = self.now;
            while let Some((_, table, key, _, kind)) = self.shard(s).pop_due(now) {
                match kind {
                    DeadlineKind::Stuck => {
                        tracing::warn!(node = self.directory().rank(), table, key, "an incoming relocation did not land in time");
                        // The key's home routed the request; it knows (and told) the old owner.
                        let home = self.directory().home(table, key) as usize;
                        let nodes = if home == self.directory().rank() as usize { Vec::new() } else { vec![home] };
                        self.abandon_transit_queue((table, key), Error::Timeout { what: "relocation", millis, nodes });
                    }
                    DeadlineKind::Grace => self.give_up_transit((table, key)),
                }
            }
        }
        Progress::Done
    }

    /// Worker `worker` completed a clock; returns its completed count (see [`super::Clocks`]).
    pub fn clock_advance(&mut self, worker: u16) -> u64 {
        let core = self.core;
        self.tx.touch_clock();
        core.clocks().lock().advance(worker, core.directory(), self.tx)
    }

    /// Worker `worker` starts taking part in clocks; returns the clock it starts in.
    pub fn clock_register(&mut self, worker: u16) -> u64 {
        self.core.clocks().lock().register(worker)
    }

    /// Worker `worker` left: it no longer holds back the clocks.
    pub fn clock_retire(&mut self, worker: u16) {
        let core = self.core;
        self.tx.touch_clock();
        core.clocks().lock().retire(worker, core.directory(), self.tx);
    }

    /// Enters the next generation of a barrier; its release appears in [`Core::barrier_events`].
    pub fn barrier_enter(&mut self, kind: BarrierKind) -> u32 {
        let core = self.core;
        self.tx.touch_barrier();
        core.barriers().lock().enter(kind, core.directory(), self.tx)
    }
}
