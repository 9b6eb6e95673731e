//! The caller-owned buffer a protocol step writes its output into.
//!
//! Every thread that drives the protocol (a worker, a connection's reader, the timer) owns one
//! [`Transmit`] and reuses it. A step appends messages to per-destination frames, one-sided
//! writes and deliveries to this node's workers; the caller drains them with
//! [`Transmit::poll_transmit`], [`Transmit::poll_write`] and [`Transmit::poll_delivery`]. The
//! calling contract (which output to hand on before which lock is released) is on
//! [`super::Step`].

use std::collections::VecDeque;
use std::sync::Arc;

use super::SlotWrite;
use super::requester::{Delivery, worker_of};
use super::wire;
use crate::stats::{CounterCell, CounterRegistry, MessageKind};

/// A worker index that addresses every worker of the node (a lost peer, a shutdown).
pub const ALL_WORKERS: u16 = u16::MAX;

/// Output of protocol steps, waiting to be handed to the fabric and to workers.
pub struct Transmit {
    rank: u16,
    frame_target: usize,
    /// The frame being filled per destination.
    building: Vec<Vec<u8>>,
    /// Frames sealed because they reached the target size, in order.
    sealed: VecDeque<(u16, Vec<u8>)>,
    /// RESPONSE and FAILURE messages for this node's own workers (a request of theirs came
    /// back here through a forward, or was queued here while its key arrived).
    loopback: Vec<u8>,
    writes: VecDeque<SlotWrite>,
    /// Bytes of the writes in `writes`.
    write_bytes: usize,
    deliveries: VecDeque<(u16, Delivery)>,
    /// Destinations with frames handed out since [`Transmit::take_touched`].
    touched: Vec<bool>,
    counters: Arc<CounterCell>,
    registry: Option<Arc<CounterRegistry>>,
    earliest_deadline: Option<u64>,
    barrier_touched: bool,
    clock_touched: bool,
    backup_touched: bool,
    /// Peers that left: their own LEFT was their last message, so their links can close.
    departed: Vec<u16>,
    /// A worker's write was applied here since [`Transmit::take_local_write`] (backups only).
    local_write: bool,
    /// Accesses through this buffer are housekeeping (replica sync), not the trainer's: they
    /// are left out of the local/remote counts.
    pub(crate) uncounted: bool,
}

impl Transmit {
    /// A buffer for node `rank` of `nodes`, sealing frames at about `frame_target` bytes; its
    /// counters are summed by `registry`.
    pub(crate) fn new(rank: u16, nodes: usize, frame_target: usize, registry: &Arc<CounterRegistry>) -> Transmit {
        Transmit {
            rank,
            frame_target: frame_target.max(1024),
            building: (0..nodes).map(|_| Vec::new()).collect(),
            sealed: VecDeque::new(),
            loopback: Vec::new(),
            writes: VecDeque::new(),
            write_bytes: 0,
            deliveries: VecDeque::new(),
            touched: vec![false; nodes],
            counters: registry.cell(),
            registry: Some(registry.clone()),
            earliest_deadline: None,
            barrier_touched: false,
            clock_touched: false,
            backup_touched: false,
            departed: Vec::new(),
            local_write: false,
            uncounted: false,
        }
    }

    /// The buffer a message to `to` is appended to; call [`Transmit::sent`] after appending.
    /// Messages to this node itself (only RESPONSE and FAILURE) go to the loopback buffer and
    /// come out as deliveries.
    #[inline]
    pub(crate) fn buf(&mut self, to: u16) -> &mut Vec<u8> {
        if to == self.rank { &mut self.loopback } else { &mut self.building[to as usize] }
    }

    /// Accounts for a message of `bytes` just appended for `to`, sealing the frame when it is
    /// large enough that sending should start.
    #[inline]
    pub(crate) fn sent(&mut self, to: u16, kind: MessageKind, bytes: usize) {
        if to == self.rank {
            return;
        }
        CounterCell::bump(&self.counters.messages[kind as usize], 1);
        CounterCell::bump(&self.counters.bytes[kind as usize], bytes as u64);
        let frame = &mut self.building[to as usize];
        if frame.len() >= self.frame_target {
            let frame = std::mem::take(frame);
            self.sealed.push_back((to, frame));
        }
    }

    /// Counts a frame of `bytes` bytes received from another node.
    #[inline]
    pub(crate) fn count_received(&mut self, bytes: usize) {
        CounterCell::bump(&self.counters.received_bytes, bytes as u64);
    }

    /// Counts a one-sided write's bytes (it travels outside frames).
    pub(crate) fn count_transfer(&mut self, bytes: usize) {
        CounterCell::bump(&self.counters.messages[MessageKind::Transfer as usize], 1);
        CounterCell::bump(&self.counters.bytes[MessageKind::Transfer as usize], bytes as u64);
    }

    /// Counts keys served from local memory.
    #[inline]
    pub(crate) fn count_local(&mut self, keys: usize) {
        if self.uncounted {
            return;
        }
        CounterCell::bump(&self.counters.local_keys, keys as u64);
    }

    /// Counts keys served by replicas (also counted as local); true when the count crossed a
    /// multiple of 64 (a worker then samples the replicas' staleness).
    #[inline]
    pub(crate) fn count_replica(&mut self, keys: usize) -> bool {
        let before = self.counters.replica_keys.load(std::sync::atomic::Ordering::Relaxed);
        CounterCell::bump(&self.counters.replica_keys, keys as u64);
        (before & !63) != (before + keys as u64) & !63
    }

    /// Counts keys sent to other nodes.
    #[inline]
    pub(crate) fn count_remote(&mut self, keys: usize) {
        if self.uncounted {
            return;
        }
        CounterCell::bump(&self.counters.remote_keys, keys as u64);
    }

    pub(crate) fn push_write(&mut self, write: SlotWrite) {
        self.write_bytes += write.len;
        self.writes.push_back(write);
    }

    /// The last write added and not yet handed on, for a key to join as a run
    /// ([`Transmit::grow_last_write`]).
    pub(crate) fn last_write(&self) -> Option<&SlotWrite> {
        self.writes.back()
    }

    /// Makes the last write carry one more key of `extra` bytes.
    pub(crate) fn grow_last_write(&mut self, extra: usize) {
        if let Some(w) = self.writes.back_mut() {
            w.len += extra;
            w.keys += 1;
            self.write_bytes += extra;
        }
    }

    /// Bytes of one-sided writes waiting to be handed on.
    pub fn pending_write_bytes(&self) -> usize {
        self.write_bytes
    }

    pub(crate) fn deliver(&mut self, worker: u16, delivery: Delivery) {
        self.deliveries.push_back((worker, delivery));
    }

    /// Notes a protocol deadline set during the step.
    pub(crate) fn note_deadline(&mut self, at: u64) {
        self.earliest_deadline = Some(self.earliest_deadline.map_or(at, |d| d.min(at)));
    }

    /// Whether some frame is sealed (full): a caller streaming a large operation may hand it on
    /// before encoding more.
    pub fn has_sealed_frames(&self) -> bool {
        !self.sealed.is_empty()
    }

    /// The next frame to send, sealed ones first, then every partly filled one.
    pub fn poll_transmit(&mut self) -> Option<(u16, Vec<u8>)> {
        let next = self.sealed.pop_front().or_else(|| {
            let to = self.building.iter().position(|b| !b.is_empty())?;
            Some((to as u16, std::mem::take(&mut self.building[to])))
        });
        if let Some((to, _)) = &next {
            self.touched[*to as usize] = true;
        }
        next
    }

    /// The next one-sided write to post.
    pub fn poll_write(&mut self) -> Option<SlotWrite> {
        let next = self.writes.pop_front();
        if let Some(w) = &next {
            self.write_bytes -= w.len;
            self.touched[w.to as usize] = true;
        }
        next
    }

    /// The next delivery for a worker of this node ([`ALL_WORKERS`]: for every worker).
    pub fn poll_delivery(&mut self) -> Option<(u16, Delivery)> {
        if !self.loopback.is_empty() {
            self.split_loopback();
        }
        self.deliveries.pop_front()
    }

    /// Turns the loopback messages into deliveries, one per run of messages for one worker.
    fn split_loopback(&mut self) {
        let bytes = bytes::Bytes::from(std::mem::take(&mut self.loopback));
        let mut run: Option<(u16, usize, usize)> = None;
        let mut messages = wire::Messages::new(&bytes);
        loop {
            let start = messages.offset();
            let Some(body) = messages.next() else { break };
            let Some(op) = body.ok().and_then(wire::op_of) else {
                tracing::error!(node = self.rank, "a malformed message to this node's own workers was dropped");
                break;
            };
            let worker = worker_of(op);
            let end = messages.offset();
            match &mut run {
                Some((w, _, e)) if *w == worker && *e == start => *e = end,
                _ => {
                    if let Some((w, s, e)) = run.take() {
                        self.deliveries.push_back((w, Delivery::Messages { from: self.rank, bytes: bytes.slice(s..e) }));
                    }
                    run = Some((worker, start, end));
                }
            }
        }
        if let Some((w, s, e)) = run {
            self.deliveries.push_back((w, Delivery::Messages { from: self.rank, bytes: bytes.slice(s..e) }));
        }
    }

    /// Destinations that frames or writes were handed out for since the last call (to flush).
    pub fn take_touched(&mut self, mut each: impl FnMut(usize)) {
        for (to, t) in self.touched.iter_mut().enumerate() {
            if std::mem::take(t) {
                each(to);
            }
        }
    }

    /// Notes that a step changed barrier state (releases may be waiting in
    /// [`super::Core::barrier_events`]).
    pub(crate) fn touch_barrier(&mut self) {
        self.barrier_touched = true;
    }

    /// Notes that a step changed clock state (workers waiting for a clock may go on).
    pub(crate) fn touch_clock(&mut self) {
        self.clock_touched = true;
    }

    /// Notes that a step changed backup state: an answer is held for a round, a round
    /// completed or was given up (workers waiting for their pushes to be backed up, and the
    /// driver of the rounds, may go on).
    pub(crate) fn touch_backup(&mut self) {
        self.backup_touched = true;
    }

    /// Notes that a worker's write was applied on this node (it waits for a backup round).
    pub(crate) fn note_local_write(&mut self) {
        self.local_write = true;
    }

    /// Whether a worker's write was applied on this node since the last call.
    pub fn take_local_write(&mut self) -> bool {
        std::mem::take(&mut self.local_write)
    }

    /// Whether a step changed backup state since the last call.
    pub fn take_backup_touched(&mut self) -> bool {
        std::mem::take(&mut self.backup_touched)
    }

    /// `node` left, and its own LEFT (its last message) was handled: its link can close.
    pub(crate) fn note_departed(&mut self, node: u16) {
        self.departed.push(node);
    }

    /// Peers whose links can close since the last call (see [`Transmit::note_departed`]).
    pub fn take_departed(&mut self) -> Vec<u16> {
        std::mem::take(&mut self.departed)
    }

    /// Whether a step changed clock state since the last call.
    pub fn take_clock_touched(&mut self) -> bool {
        std::mem::take(&mut self.clock_touched)
    }

    /// Whether a step changed barrier state since the last call.
    pub fn take_barrier_touched(&mut self) -> bool {
        std::mem::take(&mut self.barrier_touched)
    }

    /// The earliest deadline a step set since the last call.
    pub fn take_deadline(&mut self) -> Option<u64> {
        self.earliest_deadline.take()
    }

    /// Drops the frames queued for a lost node (writes stay: their source slots are freed when
    /// the fabric reports them failed).
    pub(crate) fn forget(&mut self, to: u16) {
        if let Some(b) = self.building.get_mut(to as usize) {
            b.clear();
        }
        self.sealed.retain(|(t, _)| *t != to);
    }
}

impl Drop for Transmit {
    fn drop(&mut self) {
        if let Some(registry) = self.registry.take() {
            registry.retire(&self.counters);
        }
    }
}
