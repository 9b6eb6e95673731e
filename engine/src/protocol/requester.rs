//! One worker's operations: the requester side of the protocol.
//!
//! Each worker owns a [`Requester`], so no lock guards the operation table. Everything that
//! answers the worker's operations reaches it as a [`Delivery`]: RESPONSE and FAILURE messages
//! from peers (a connection's reader routes them by the worker index in the operation id, as
//! shared, zero-copy slices of the received frame), events from this node's own shards (a row
//! that was queued while its key arrived, keys a `localize` waited for), a lost peer, shutdown.
//! The worker feeds deliveries in when it waits; pulled values of the operation it waits for go
//! straight into the caller's buffer, those of asynchronous pulls into the operation's own.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Weak;

use bytes::Bytes;

use super::directory::Directory;
use super::rows::Rows;
use super::wire::{self, AccessKind, Failure, FailureCode, Response, msg};
use crate::error::{Error, Result};
use crate::util::{FastMap, copy_bytes_to_f32};

/// Identifies an operation: the issuing worker's index in the top 16 bits, a sequence number
/// below.
pub type OpId = u64;

/// Bits of an [`OpId`] below the worker index.
pub const WORKER_SHIFT: u32 = 48;

/// The worker that issued `op`.
#[inline]
pub fn worker_of(op: OpId) -> u16 {
    (op >> WORKER_SHIFT) as u16
}

/// What answers a worker's operations.
#[derive(Debug, Clone)]
pub enum Delivery {
    /// RESPONSE and FAILURE messages from `from` (a slice of the frame it sent).
    Messages {
        /// The sending node.
        from: u16,
        /// Length-prefixed messages, each for an operation of this worker.
        bytes: Bytes,
    },
    /// This node's protocol served or failed something of an operation.
    Local(LocalEvent),
    /// A peer is lost: every operation issued before the loss fails (a forwarded request may
    /// pass through any node); operations issued later already saw the peer as lost.
    PeerLost {
        /// The lost node.
        node: u16,
        /// What the transport observed.
        reason: String,
        /// [`super::Directory::losses`] after this loss.
        losses: u64,
    },
    /// The node shuts down.
    ShutDown,
}

/// Something this node's own protocol did for an operation.
#[derive(Debug, Clone, PartialEq)]
pub enum LocalEvent {
    /// The last key a `localize` waited for arrived (its countdown reached zero).
    Arrived {
        /// The operation.
        op: OpId,
    },
    /// A key a `localize` waited for will not arrive (it was counted down).
    ArrivalFailed {
        /// The operation.
        op: OpId,
        /// Why.
        error: Error,
    },
}

/// A peer that sent something the protocol does not allow; the caller closes its connection.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerFault {
    /// The peer.
    pub peer: u16,
    /// What it did.
    pub error: Error,
}

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// Pull, push or set.
    Access(AccessKind),
    /// Move keys here.
    Localize,
}

/// Where an operation's pulled values go.
#[derive(Debug)]
pub enum Output {
    /// Nowhere (push, set, localize).
    None,
    /// A buffer of the operation's own (`rows × value_len`), returned at completion.
    Owned(Vec<f32>),
    /// The buffer the caller passes to [`Requester::handle`] while it waits for this operation.
    Caller,
}

/// Fast-path parts not yet encoded (a large operation is encoded while its first parts travel).
pub(crate) struct Unsent {
    /// Groups of rows by destination, front first.
    pub groups: std::collections::VecDeque<super::issue::Group>,
}

pub(crate) struct PendingOp {
    pub kind: OpKind,
    pub table: u16,
    pub value_len: usize,
    pub parts: Vec<Rows>,
    /// The node each part was sent to (this node's own rank for rows waiting here for a
    /// relocation to land).
    pub part_nodes: Vec<u16>,
    answered: Vec<u64>,
    pub remaining: usize,
    pub output: Output,
    error: Option<Error>,
    deadline: u64,
    /// The operation's keys, kept only with location caches (answers update the cache).
    keys: Option<Vec<u64>>,
    /// Dropped when the caller dropped the ticket: the result is then discarded.
    ticket: Option<Weak<()>>,
    pub unsent: Option<Unsent>,
    /// [`super::Core::arrivals`] when the operation looked at its keys.
    pub arrivals: u64,
    /// [`super::Directory::losses`] when the operation was issued.
    losses: u64,
    /// A `localize`'s keys still to arrive, counted down by the shards.
    pub countdown: Option<super::shard::Countdown>,
}

impl PendingOp {
    /// Marks rows `first..first+count` answered if none of them was; false (and nothing
    /// changed) otherwise.
    fn answer_run(&mut self, first: usize, count: usize) -> bool {
        let end = first + count;
        if count == 0 || end > self.answered.len() * 64 {
            return false;
        }
        let mask = |w: usize| -> u64 {
            let lo = (w * 64).max(first) - w * 64;
            let hi = ((w + 1) * 64).min(end) - w * 64;
            if hi - lo == 64 { u64::MAX } else { ((1u64 << (hi - lo)) - 1) << lo }
        };
        let words = first / 64..end.div_ceil(64);
        if words.clone().any(|w| self.answered[w] & mask(w) != 0) {
            return false;
        }
        for w in words {
            self.answered[w] |= mask(w);
        }
        self.remaining = self.remaining.saturating_sub(count);
        true
    }

    /// Marks one row answered; false when it already was (or does not exist).
    fn answer(&mut self, row: u32) -> bool {
        let (w, b) = (row as usize / 64, row as usize % 64);
        if w >= self.answered.len() || self.answered[w] & (1 << b) != 0 {
            return false;
        }
        self.answered[w] |= 1 << b;
        self.remaining = self.remaining.saturating_sub(1);
        true
    }

    fn fail(&mut self, error: Error) {
        self.error.get_or_insert(error);
    }

    /// The nodes that have not answered every row of the parts sent to them.
    fn unanswered_nodes(&self, own: u16) -> Vec<usize> {
        let answered = |row: u32| self.answered.get(row as usize / 64).is_some_and(|w| w & (1 << (row % 64)) != 0);
        let mut nodes: Vec<usize> = self
            .parts
            .iter()
            .zip(&self.part_nodes)
            .filter(|&(rows, &node)| node != own && rows.iter().any(|r| !answered(r)))
            .map(|(_, &node)| node as usize)
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }

    /// Where row `row`'s values go, given the caller's buffer of the waited-for operation.
    fn row_output<'o>(&'o mut self, row: usize, caller: &'o mut Option<&mut [f32]>) -> Option<&'o mut [f32]> {
        let range = row * self.value_len..(row + 1) * self.value_len;
        match &mut self.output {
            Output::Owned(v) => v.get_mut(range),
            Output::Caller => caller.as_deref_mut().and_then(|o| o.get_mut(range)),
            Output::None => None,
        }
    }
}

/// The table of one worker's pending operations.
pub struct Requester {
    worker: u16,
    rank: u16,
    next_seq: u64,
    op_timeout_ns: u64,
    ops: FastMap<OpId, PendingOp>,
    deadlines: BinaryHeap<Reverse<(u64, OpId)>>,
    done: FastMap<OpId, Result<Vec<f32>>>,
    /// Key lists the nodes keep for this worker (key caching), per node.
    key_caches: FastMap<u16, super::keycache::KeyCache>,
    /// Accesses skip this node's run-time replicas (for the worker that keeps them in sync).
    pub(crate) bypass_replicas: bool,
    /// This worker's pulls make run-time replicas (the intent service's, while it issues one):
    /// each key sent for starts adding up this node's pushes sent after it
    /// ([`crate::store::DynamicReplicas::begin_making`]).
    pub(crate) making_replicas: bool,
    /// When `Some`: the keys of the last access that were not served here (neither held nor
    /// replicated here), filled by [`crate::protocol::Step::issue_access`] — a worker that
    /// declared intent counts its late accesses from them, at no cost to accesses served here.
    pub(crate) remote_keys: Option<Vec<u64>>,
    /// Set when a part waits for a departure to end ([`crate::protocol::Step::continue_issue`]
    /// routed nothing): the worker should wait a little before it tries again.
    pub(crate) paused: bool,
}

impl Requester {
    /// The operation table of worker `worker` on node `rank`; sequence numbers start at
    /// `first_seq` (so that a worker index reused by a new worker never repeats an id).
    pub fn new(rank: u16, worker: u16, first_seq: u64, op_timeout_ns: u64) -> Requester {
        Requester {
            worker,
            rank,
            next_seq: first_seq.max(1),
            op_timeout_ns,
            ops: FastMap::default(),
            deadlines: BinaryHeap::new(),
            done: FastMap::default(),
            key_caches: FastMap::default(),
            bypass_replicas: false,
            making_replicas: false,
            remote_keys: None,
            paused: false,
        }
    }

    /// Whether the last [`crate::protocol::Step::continue_issue`] routed nothing because its
    /// parts wait for a departure to end (cleared by the call).
    pub fn take_paused(&mut self) -> bool {
        std::mem::take(&mut self.paused)
    }

    /// The key lists node `node` keeps for this worker (key caching).
    pub(crate) fn key_cache(&mut self, node: u16) -> &mut super::keycache::KeyCache {
        self.key_caches.entry(node).or_default()
    }

    /// The worker index.
    #[cfg(any(test, feature = "sim"))]
    pub fn worker(&self) -> u16 {
        self.worker
    }

    /// The sequence number the next operation gets (for a successor on the same index).
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Registers an operation of `rows` rows of which `remaining` (rows, or keys for a
    /// localize) are still to be answered.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn begin(
        &mut self,
        kind: OpKind,
        table: u16,
        value_len: usize,
        rows: usize,
        remaining: usize,
        output: Output,
        keys: Option<Vec<u64>>,
        ticket: Option<Weak<()>>,
        now: u64,
        losses: u64,
    ) -> OpId {
        let id = ((self.worker as u64) << WORKER_SHIFT) | (self.next_seq & ((1 << WORKER_SHIFT) - 1));
        self.next_seq += 1;
        let deadline = now.saturating_add(self.op_timeout_ns);
        self.deadlines.push(Reverse((deadline, id)));
        let answered = if matches!(kind, OpKind::Access(_)) { vec![0; rows.div_ceil(64)] } else { Vec::new() };
        self.ops.insert(
            id,
            PendingOp {
                kind,
                table,
                value_len,
                parts: Vec::new(),
                part_nodes: Vec::new(),
                answered,
                remaining,
                output,
                error: None,
                deadline,
                keys,
                ticket,
                unsent: None,
                arrivals: 0,
                losses,
                countdown: None,
            },
        );
        id
    }

    pub(crate) fn op_mut(&mut self, op: OpId) -> Option<&mut PendingOp> {
        self.ops.get_mut(&op)
    }

    /// Rows that can never be answered (their destination is lost, say).
    pub(crate) fn fail_rows(&mut self, op: OpId, rows: impl Iterator<Item = u32>, error: &Error) {
        if let Some(o) = self.ops.get_mut(&op) {
            o.fail(error.clone());
            for r in rows {
                o.answer(r);
            }
        }
    }

    /// Keys of a localize that will not arrive.
    pub(crate) fn fail_count(&mut self, op: OpId, count: usize, error: &Error) {
        if let Some(o) = self.ops.get_mut(&op) {
            o.fail(error.clone());
            o.remaining = o.remaining.saturating_sub(count);
        }
    }

    /// Pulled values of a row served right away by the issuing step (`caller`: the buffer of a
    /// synchronous pull).
    pub(crate) fn deliver_row(&mut self, op: OpId, row: u32, values: &[f32], caller: Option<&mut [f32]>) {
        let mut caller = caller;
        if let Some(o) = self.ops.get_mut(&op)
            && let Some(dst) = o.row_output(row as usize, &mut caller)
            && dst.len() == values.len()
        {
            dst.copy_from_slice(values);
        }
    }

    /// Rows served right away by the issuing step.
    pub(crate) fn answer_rows(&mut self, op: OpId, rows: impl Iterator<Item = u32>) {
        if let Some(o) = self.ops.get_mut(&op) {
            for r in rows {
                o.answer(r);
            }
        }
    }

    /// Completes `op` if nothing is outstanding (and nothing remains to be encoded).
    pub(crate) fn settle(&mut self, op: OpId) {
        let settled =
            |o: &PendingOp| o.remaining == 0 && o.unsent.is_none() && o.countdown.as_ref().is_none_or(|c| c.load(std::sync::atomic::Ordering::Acquire) == 0);
        if self.ops.get(&op).is_some_and(settled) {
            let o = self.ops.remove(&op).expect("present");
            let result = match o.error {
                Some(e) => Err(e),
                None => Ok(match o.output {
                    Output::Owned(v) => v,
                    Output::None | Output::Caller => Vec::new(),
                }),
            };
            if o.ticket.as_ref().is_some_and(|t| t.strong_count() == 0) {
                return;
            }
            self.done.insert(op, result);
        }
    }

    /// Whether `op` is still under way.
    pub fn is_pending(&self, op: OpId) -> bool {
        self.ops.contains_key(&op)
    }

    /// Parts an operation under way was split into so far.
    #[cfg(any(test, feature = "sim"))]
    pub fn parts_of(&self, op: OpId) -> Option<usize> {
        self.ops.get(&op).map(|o| o.parts.len())
    }

    /// Operations under way.
    pub fn pending(&self) -> usize {
        self.ops.len()
    }

    /// Takes the result of a completed operation (`None` while it is pending, or when it is
    /// unknown). Pulls into the caller's buffer complete with an empty vector.
    pub fn take(&mut self, op: OpId) -> Option<Result<Vec<f32>>> {
        self.done.remove(&op)
    }

    /// The nodes that have not answered every part of this worker's pending operations.
    pub fn unanswered_nodes(&self) -> Vec<usize> {
        let mut nodes: Vec<usize> = self.ops.values().flat_map(|o| o.unanswered_nodes(self.rank)).collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }

    /// The earliest deadline of a pending operation.
    pub fn poll_timeout(&mut self) -> Option<u64> {
        while let Some(Reverse((at, op))) = self.deadlines.peek().copied() {
            if self.ops.get(&op).is_some_and(|o| o.deadline == at) {
                return Some(at);
            }
            self.deadlines.pop();
        }
        None
    }

    /// Fails the operations whose deadline has passed.
    pub fn handle_timeout(&mut self, now: u64) {
        let millis = self.op_timeout_ns / 1_000_000;
        while let Some(at) = self.poll_timeout() {
            if at > now {
                break;
            }
            let Some(Reverse((_, op))) = self.deadlines.pop() else { break };
            if let Some(o) = self.ops.get_mut(&op) {
                let nodes = o.unanswered_nodes(self.rank);
                o.fail(Error::Timeout { what: "operation", millis, nodes });
                o.remaining = 0;
                o.unsent = None;
                o.countdown = None;
                self.settle(op);
            }
        }
    }

    /// Feeds a delivery in. `caller` is the buffer of the operation the worker waits for, if it
    /// is a pull into the caller's memory. A peer's message that breaks the protocol is
    /// returned as a fault (the rest of the delivery is still handled).
    pub fn handle(&mut self, delivery: Delivery, directory: &Directory, mut caller: Option<(OpId, &mut [f32])>) -> Option<PeerFault> {
        match delivery {
            Delivery::Messages { from, bytes } => {
                let mut fault = None;
                for body in wire::Messages::new(&bytes) {
                    let result = body.and_then(|body| match body[0] {
                        msg::RESPONSE => self.on_response(body, directory, &mut caller),
                        msg::FAILURE => self.on_failure(body, directory),
                        other => Err(Error::Protocol(format!("message type {other} routed to a worker"))),
                    });
                    if let Err(error) = result {
                        fault.get_or_insert(PeerFault { peer: from, error });
                    }
                }
                fault
            }
            Delivery::Local(event) => {
                self.on_local(event);
                None
            }
            Delivery::PeerLost { node, reason, losses } => {
                self.fail_all(Error::PeerLost { node: node as usize, reason }, losses);
                None
            }
            Delivery::ShutDown => {
                self.fail_all(Error::ShutDown, u64::MAX);
                None
            }
        }
    }

    /// Fails every operation issued while fewer than `losses` peers were lost.
    fn fail_all(&mut self, error: Error, losses: u64) {
        let mut ids: Vec<OpId> = self.ops.iter().filter(|(_, o)| o.losses < losses).map(|(id, _)| *id).collect();
        ids.sort_unstable();
        for op in ids {
            if let Some(o) = self.ops.get_mut(&op) {
                o.fail(error.clone());
                o.remaining = 0;
                o.unsent = None;
                o.countdown = None;
            }
            self.settle(op);
        }
    }

    fn caller_for<'c>(op: OpId, caller: &'c mut Option<(OpId, &mut [f32])>) -> Option<&'c mut [f32]> {
        match caller {
            Some((id, out)) if *id == op => Some(&mut **out),
            _ => None,
        }
    }

    fn on_response(&mut self, body: &[u8], directory: &Directory, caller: &mut Option<(OpId, &mut [f32])>) -> Result<()> {
        let r = Response::decode(body, |t| directory.table(t).map(|m| m.value_len))?;
        let Some(o) = self.ops.get_mut(&r.op) else { return Ok(()) };
        if o.kind != OpKind::Access(r.kind) || o.table != r.table {
            return Err(Error::Protocol(format!("RESPONSE does not match operation {}", r.op)));
        }
        let Some(part) = o.parts.get(r.part as usize) else {
            return Err(Error::Protocol(format!("RESPONSE names part {} of operation {}", r.part, r.op)));
        };
        let (part_len, part_run) = (part.len(), part.run());
        if matches!(o.output, Output::Caller) && r.kind.returns_values() && Self::caller_for(r.op, caller).is_none() {
            // Only the waiting worker's own buffer can take these values; nobody waits.
            o.fail(Error::Protocol("pulled values arrived while nobody waited for them".into()));
        }
        let value_len = o.value_len;
        let cache = directory.caches() && r.responder != self.rank && (r.responder as usize) < directory.nodes();
        let mut out = Self::caller_for(r.op, caller);
        // The usual bulk case: a whole part answered in order, its rows a run: one block copy.
        if !r.indexed()
            && r.count == part_len
            && !cache
            && let Some((first, _)) = part_run
            && o.answer_run(first as usize, r.count)
        {
            if r.kind.returns_values()
                && let Some(dst) = match &mut o.output {
                    Output::Owned(v) => v.get_mut(first as usize * value_len..(first as usize + r.count) * value_len),
                    Output::Caller => out.as_deref_mut().and_then(|c| c.get_mut(first as usize * value_len..(first as usize + r.count) * value_len)),
                    Output::None => None,
                }
            {
                copy_bytes_to_f32(r.values(), dst);
            }
            self.settle(r.op);
            return Ok(());
        }
        let part = o.parts[r.part as usize].clone();
        for i in 0..r.count {
            let Some(row) = part.get(r.index(i) as usize) else {
                return Err(Error::Protocol(format!("RESPONSE names item {} beyond its part", r.index(i))));
            };
            if !o.answer(row) {
                continue;
            }
            if r.kind.returns_values()
                && let Some(dst) = o.row_output(row as usize, &mut out)
            {
                copy_bytes_to_f32(r.value(i), dst);
            }
            if cache && let Some(keys) = &o.keys {
                directory.cache(r.table, keys[row as usize], r.responder);
            }
        }
        self.settle(r.op);
        Ok(())
    }

    fn on_failure(&mut self, body: &[u8], directory: &Directory) -> Result<()> {
        let f = Failure::decode(body)?;
        let Some(o) = self.ops.get_mut(&f.op) else { return Ok(()) };
        let Some(part) = o.parts.get(f.part as usize).cloned() else {
            return Err(Error::Protocol(format!("FAILURE names part {} of operation {}", f.part, f.op)));
        };
        let error = match f.code {
            FailureCode::PeerLost => Error::PeerLost { node: f.node as usize, reason: format!("while serving key {}", f.key) },
            FailureCode::KeyLost => Error::KeyLost { table: directory.table_name(f.table), key: f.key },
            FailureCode::Unavailable => Error::Timeout { what: "relocation of the key", millis: self.op_timeout_ns / 1_000_000, nodes: vec![f.node as usize] },
            FailureCode::Protocol => Error::Protocol(format!("node {} could not serve key {}", f.node, f.key)),
            // Only LOCALIZE_FAILED declines; in an access's FAILURE it is a misbehaving peer.
            FailureCode::Declined | FailureCode::Superseded => Error::Protocol(format!("node {} declined an access to key {}", f.node, f.key)),
        };
        for i in 0..f.count {
            let Some(row) = part.get(f.index(i) as usize) else {
                return Err(Error::Protocol("FAILURE names an item beyond its part".into()));
            };
            if o.answer(row) {
                o.fail(error.clone());
            }
        }
        self.settle(f.op);
        Ok(())
    }

    fn on_local(&mut self, event: LocalEvent) {
        match event {
            LocalEvent::Arrived { op } => self.settle(op),
            LocalEvent::ArrivalFailed { op, error } => {
                if let Some(o) = self.ops.get_mut(&op) {
                    o.fail(error);
                }
                self.settle(op);
            }
        }
    }
}
