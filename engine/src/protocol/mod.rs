//! The parameter-server protocol as a deterministic state machine.
//!
//! A [`Protocol`] is one node's protocol state. It has no threads, sockets or clock: the caller
//! feeds it events — a worker request ([`Protocol::submit`]), a message ([`Protocol::on_message`]),
//! a landed or completed one-sided write, a lost peer, a timer tick — each with the current
//! cluster time, and then drains its [`Output`]: frames to send, one-sided writes to post,
//! completed operations and released barriers. The same state machine runs in the node runtime
//! (threads, TCP or verbs around it) and in the simulated clusters of the tests.
//!
//! It implements Lapse's dynamic parameter allocation: every key has a static *home node* that
//! knows its current *owner*; the owner holds the value. A remote access goes to the home node,
//! which forwards it to the owner, which answers the requester (3 messages); with location caches
//! it goes straight to the cached owner (2), and a stale cache costs a double forward (4). A
//! `localize` reserves a slot at the requester and tells the home node, which re-routes at once
//! and tells the old owner; the old owner finishes what it has queued for the key, stops serving
//! it, and writes the value into the reserved slot with one one-sided write carrying an
//! immediate. Until that write lands, the requester queues every operation on the key.

mod access;
mod outbox;
mod relocation;
mod rows;
pub mod wire;

use std::sync::Arc;

use crate::config::TableSpec;
use crate::error::{Error, Result};
use crate::partition::Partitioner;
use crate::stats::{MessageKind, ProtocolCounters, Stats};
use crate::store::{RemoteAddr, Store};
use crate::util::FastMap;
use outbox::Outbox;
pub use wire::AccessKind;
use wire::msg;

/// Identifies an operation at the node that issued it.
pub type OpId = u64;

/// Owner entry of a key whose owner was lost.
const LOST_OWNER: u16 = u16::MAX;

/// What a worker asks for keys it could not serve from local memory.
#[derive(Debug, Clone, Copy)]
pub enum RequestKind {
    /// Pull, push or set.
    Access(AccessKind),
    /// Move the keys to this node.
    Localize,
}

/// A worker request handed to the protocol.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// What to do.
    pub kind: RequestKind,
    /// Table id.
    pub table: u16,
    /// Keys (validated by the caller: each below the table's key count).
    pub keys: &'a [u64],
    /// Push/set: `keys.len() × value_len` values; otherwise empty.
    pub values: &'a [f32],
}

/// The outcome of [`Protocol::submit`].
#[derive(Debug, PartialEq)]
pub enum Submitted {
    /// Everything was served at once; pull values in key order.
    Done(Vec<f32>),
    /// The operation is under way; its completion will appear in the output.
    Pending(OpId),
}

/// A finished operation: pull values in key order (empty for the other kinds), or the error.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The operation.
    pub op: OpId,
    /// Its result.
    pub result: Result<Vec<f32>>,
}

/// Barrier kinds (separate generation counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BarrierKind {
    /// The workers' barrier.
    Workers = 0,
    /// The barrier that starts shutdown.
    Finalize = 1,
}

/// A barrier generation that completed (or failed).
#[derive(Debug, Clone, PartialEq)]
pub struct BarrierEvent {
    /// Which barrier.
    pub kind: BarrierKind,
    /// Its generation.
    pub generation: u32,
    /// `Ok` when every node arrived.
    pub result: Result<()>,
}

/// A one-sided write of a slot to another node, to be posted by the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotWrite {
    /// Target node.
    pub to: u16,
    /// Source table.
    pub table: u16,
    /// Source slot (its first `len` bytes are written).
    pub slot: u32,
    /// Bytes to write.
    pub len: usize,
    /// Destination.
    pub remote: RemoteAddr,
    /// Immediate delivered with the write.
    pub imm: u32,
    /// Completion id to report back through [`Protocol::on_write_done`].
    pub wr_id: u64,
}

/// Everything a step produced.
#[derive(Debug, Default)]
pub struct Output {
    /// Frames (each a sequence of messages), in sending order per destination.
    pub frames: Vec<(u16, Vec<u8>)>,
    /// One-sided writes to post.
    pub writes: Vec<SlotWrite>,
    /// Completed operations.
    pub completions: Vec<Completion>,
    /// Released barriers.
    pub barriers: Vec<BarrierEvent>,
}

impl Output {
    /// Whether nothing was produced.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty() && self.writes.is_empty() && self.completions.is_empty() && self.barriers.is_empty()
    }
}

/// Behaviour switches of the protocol.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Whether `localize` moves keys (off: a classic parameter server).
    pub relocation: bool,
    /// Whether per-node location caches are used.
    pub location_caches: bool,
    /// Largest message; a single value must fit one.
    pub max_message_bytes: usize,
    /// Operations are split into parts of about this many bytes, so that the parts of a large
    /// operation stream through sender, network and receiver at the same time.
    pub part_bytes: usize,
    /// Operations and incoming relocations older than this fail with a timeout.
    pub op_timeout_ns: u64,
    /// After a peer is lost, a relocation to this node that has not landed within this long is
    /// given up (its source is unknown here and may be the lost node).
    pub loss_grace_ns: u64,
}

pub(crate) struct TableMeta {
    pub name: String,
    pub keys: u64,
    pub value_len: usize,
    pub partitioner: Partitioner,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Access(AccessKind),
    Localize,
}

struct PendingOp {
    kind: OpKind,
    table: u16,
    /// Row → key (access operations).
    keys: Vec<u64>,
    /// Part → rows.
    parts: Vec<rows::Rows>,
    answered: Vec<u64>,
    remaining: usize,
    /// Pull output, `rows × value_len`.
    values: PullOutput,
    error: Option<Error>,
    started: u64,
}

/// Where a pull's values go: a buffer of the operation's own, or the caller's (see
/// [`Protocol::submit_into`]).
enum PullOutput {
    Owned(Vec<f32>),
    Borrowed { ptr: *mut f32, len: usize },
}

// SAFETY: a borrowed buffer is written only through `&mut Protocol` (so by one thread at a time),
// and `submit_into`'s caller keeps it valid and unaliased until the operation completes or is
// cancelled, from whichever thread drives the protocol.
unsafe impl Send for PullOutput {}

impl PullOutput {
    fn as_mut_slice(&mut self) -> &mut [f32] {
        match self {
            PullOutput::Owned(v) => v,
            // SAFETY: see `submit_into`: the buffer is valid, unaliased and `len` long while the
            // operation is pending.
            PullOutput::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts_mut(*ptr, *len) },
        }
    }

    /// The values, or nothing when they were written into the caller's buffer.
    fn into_vec(self) -> Vec<f32> {
        match self {
            PullOutput::Owned(v) => v,
            PullOutput::Borrowed { .. } => Vec::new(),
        }
    }
}

impl PendingOp {
    /// Marks rows `first..first+count` answered if none of them was; false (and nothing changed)
    /// otherwise.
    fn answer_run(&mut self, first: usize, count: usize) -> bool {
        let end = first + count;
        if end > self.answered.len() * 64 {
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
        self.remaining -= count;
        true
    }

    fn answer(&mut self, row: u32) -> bool {
        let (w, b) = (row as usize / 64, row as usize % 64);
        if w >= self.answered.len() || self.answered[w] & (1 << b) != 0 {
            return false;
        }
        self.answered[w] |= 1 << b;
        self.remaining -= 1;
        true
    }
}

/// An operation item waiting for its key to land at this node.
enum Queued {
    /// A row of one of this node's operations.
    Local { op: OpId, row: u32, kind: AccessKind, values: Vec<f32> },
    /// An item of another node's operation.
    Remote { origin: u16, op: OpId, part: u32, index: u32, kind: AccessKind, values: Vec<f32> },
    /// The home node moved the key on before it arrived here.
    Relocate { new_owner: u16, resv: u32, to: RemoteAddr },
}

/// A key relocating to this node.
struct Transit {
    slot: u32,
    queue: Vec<Queued>,
    waiters: Vec<OpId>,
    started: u64,
    /// Set when a peer was lost or the transfer timed out: the value may never arrive, so new
    /// operations on the key fail at once instead of queueing.
    suspect: Option<Error>,
    /// When it became suspect.
    suspect_since: u64,
    /// The transfer did not come within the grace period after a loss: hand-overs of the key
    /// fail at once. (If it still lands, the key is published here.)
    abandoned: bool,
}

/// One node's protocol state.
pub struct Protocol {
    rank: u16,
    nodes: usize,
    store: Arc<Store>,
    tables: Vec<TableMeta>,
    /// Per table, owner of each home key (by home index).
    owners: Vec<Vec<u16>>,
    lost: Vec<Option<String>>,
    settings: Settings,
    ops: FastMap<OpId, PendingOp>,
    next_op: OpId,
    transits: FastMap<(u16, u64), Transit>,
    reservations: FastMap<u32, (u16, u64)>,
    next_resv: u32,
    outgoing: FastMap<u64, (u16, u32)>,
    next_wr: u64,
    cache: FastMap<(u16, u64), u16>,
    out: Outbox,
    writes: Vec<SlotWrite>,
    completions: Vec<Completion>,
    barrier_events: Vec<BarrierEvent>,
    barrier_generation: [u32; 2],
    barrier_waiting: Vec<(BarrierKind, u32)>,
    barrier_counts: FastMap<(u8, u32), usize>,
    counters: ProtocolCounters,
    now: u64,
    /// The caller's pull buffer for the operation `submit_into` is registering.
    borrowed_output: Option<PullOutput>,
}

impl Protocol {
    /// The protocol state of node `rank` of `nodes`, over `store` (which holds the home keys).
    pub fn new(rank: usize, nodes: usize, specs: &[TableSpec], store: Arc<Store>, settings: Settings) -> Protocol {
        let tables: Vec<TableMeta> = specs
            .iter()
            .map(|s| TableMeta { name: s.name.clone(), keys: s.keys, value_len: s.value_len, partitioner: Partitioner::new(s.keys, nodes, s.partitioning) })
            .collect();
        let owners = tables.iter().map(|t| vec![rank as u16; t.partitioner.home_count(rank)]).collect();
        Protocol {
            rank: rank as u16,
            nodes,
            store,
            tables,
            owners,
            lost: vec![None; nodes],
            settings,
            ops: FastMap::default(),
            next_op: 1,
            transits: FastMap::default(),
            reservations: FastMap::default(),
            next_resv: 1,
            outgoing: FastMap::default(),
            next_wr: 1,
            cache: FastMap::default(),
            out: Outbox::new(rank as u16, nodes, settings.part_bytes.clamp(4096, settings.max_message_bytes)),
            writes: Vec::new(),
            completions: Vec::new(),
            barrier_events: Vec::new(),
            barrier_generation: [0; 2],
            barrier_waiting: Vec::new(),
            barrier_counts: FastMap::default(),
            counters: ProtocolCounters::default(),
            now: 0,
            borrowed_output: None,
        }
    }

    /// This node's rank.
    pub fn rank(&self) -> usize {
        self.rank as usize
    }

    /// The store this protocol serves.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Statistics, with `worker_local` keys served by workers' fast paths added.
    pub fn stats(&self, worker_local: u64) -> Stats {
        let mut s = self.counters.snapshot(worker_local);
        s.traffic = self.out.traffic;
        s
    }

    /// Forgets the relocation and blocking times recorded so far (for measuring phases).
    pub fn reset_latencies(&mut self) {
        self.counters.relocation_ns.reset();
        self.counters.blocking_ns.reset();
    }

    /// Operations still pending.
    pub fn pending_ops(&self) -> usize {
        self.ops.len()
    }

    /// The owner this node records for `key`, when this node is the key's home (`None` when it
    /// is not, or when the owner was lost).
    pub fn owner_of(&self, table: u16, key: u64) -> Option<u16> {
        let meta = self.tables.get(table as usize)?;
        if key >= meta.keys || meta.partitioner.home(key) != self.rank as usize {
            return None;
        }
        Some(self.owners[table as usize][meta.partitioner.home_index(key)]).filter(|&o| o != LOST_OWNER)
    }

    /// Keys currently relocating to this node.
    pub fn keys_in_transit(&self) -> usize {
        self.transits.len()
    }

    /// Hands every frame to `sink` as soon as it is full, instead of collecting it in the
    /// output, so that large operations start moving while later parts are still encoded. Frames
    /// keep their order per destination (the rest still come through [`Protocol::take_output`]).
    pub fn set_frame_sink(&mut self, sink: Box<dyn FnMut(u16, Vec<u8>) + Send>) {
        self.out.set_sink(sink);
    }

    /// Takes everything the previous calls produced.
    pub fn take_output(&mut self) -> Output {
        Output {
            frames: self.out.take_frames(),
            writes: std::mem::take(&mut self.writes),
            completions: std::mem::take(&mut self.completions),
            barriers: std::mem::take(&mut self.barrier_events),
        }
    }

    /// Starts a worker request for keys the worker could not serve itself.
    pub fn submit(&mut self, request: Request<'_>, now: u64) -> Result<Submitted> {
        self.now = now;
        let table = request.table as usize;
        let Some(meta) = self.tables.get(table) else {
            return Err(Error::UnknownTable(format!("#{table}")));
        };
        if let Some(&bad) = request.keys.iter().find(|&&k| k >= meta.keys) {
            return Err(Error::UnknownKey { table: meta.name.clone(), key: bad, keys: meta.keys });
        }
        let result = match request.kind {
            RequestKind::Localize => self.submit_localize(request.table, request.keys),
            RequestKind::Access(kind) => {
                let need = if kind.carries_values() { request.keys.len() * meta.value_len } else { 0 };
                if request.values.len() != need {
                    return Err(Error::WrongLength { what: "values", expected: need, got: request.values.len() });
                }
                self.submit_access(kind, request.table, request.keys, request.values)
            }
        };
        self.drain_loopback();
        result
    }

    /// Like [`Protocol::submit`] for a pull, but the values are written straight into `out`
    /// (`keys.len() × value_len` floats) instead of a buffer of the operation's own; the completion
    /// then carries an empty vector. Saves a copy of every pulled value.
    ///
    /// # Safety
    ///
    /// `out` must stay valid, and must not be read or written by anyone else, until the operation
    /// completes (its completion is output) or is [cancelled](Protocol::cancel).
    pub unsafe fn submit_into(&mut self, table: u16, keys: &[u64], out: *mut f32, now: u64) -> Result<Submitted> {
        let len = keys.len() * self.tables.get(table as usize).map_or(0, |t| t.value_len);
        self.borrowed_output = Some(PullOutput::Borrowed { ptr: out, len });
        let result = self.submit(Request { kind: RequestKind::Access(AccessKind::Pull), table, keys, values: &[] }, now);
        self.borrowed_output = None;
        result
    }

    /// Forgets every pending operation (the node is shutting down).
    pub fn cancel_all(&mut self) {
        self.ops.clear();
    }

    /// Handles a frame of messages from `from`. A malformed message is an error; the caller
    /// should then close the connection to `from`.
    pub fn on_message(&mut self, from: usize, frame: &[u8], now: u64) -> Result<()> {
        self.now = now;
        if from >= self.nodes || from == self.rank as usize {
            return Err(Error::Protocol(format!("frame from invalid node {from}")));
        }
        let result = self.handle_frame(from as u16, frame);
        self.drain_loopback();
        result
    }

    /// One-sided writes with immediates `imms` (relocation reservations) landed.
    pub fn on_writes_landed(&mut self, imms: &[u32], now: u64) {
        self.now = now;
        for &imm in imms {
            self.landed(imm);
        }
        self.drain_loopback();
    }

    /// A one-sided write posted by this node completed; its source slot may be reused.
    pub fn on_write_done(&mut self, wr_id: u64, result: Result<()>, now: u64) {
        self.now = now;
        if let Some((table, slot)) = self.outgoing.remove(&wr_id) {
            if let Err(e) = result {
                tracing::error!(node = self.rank, table, "a relocation's value transfer failed ({e}); the key's value is lost");
            }
            self.store.free(table, slot);
        }
    }

    /// A peer is gone. Fails every operation that may depend on it (every pending remote
    /// operation: a forwarded request may pass through any node), marks the keys it owned as lost
    /// at their home, and fails barriers.
    pub fn on_peer_lost(&mut self, peer: usize, reason: &str, now: u64) {
        self.now = now;
        if peer >= self.nodes || peer == self.rank as usize || self.lost[peer].is_some() {
            return;
        }
        self.lost[peer] = Some(reason.to_string());
        self.out.forget(peer as u16);
        let error = Error::PeerLost { node: peer, reason: reason.to_string() };
        let mut ids: Vec<OpId> = self.ops.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            self.fail_op(id, error.clone());
        }
        let mut keys: Vec<(u16, u64)> = self.transits.keys().copied().collect();
        keys.sort_unstable();
        for key in keys {
            self.abandon_transit_queue(key, error.clone());
        }
        for owners in &mut self.owners {
            for o in owners.iter_mut().filter(|o| **o as usize == peer) {
                *o = LOST_OWNER;
            }
        }
        self.cache.retain(|_, o| *o as usize != peer);
        for (kind, generation) in std::mem::take(&mut self.barrier_waiting) {
            self.barrier_events.push(BarrierEvent { kind, generation, result: Err(error.clone()) });
        }
        self.drain_loopback();
    }

    /// Fails operations and incoming relocations older than the timeout.
    pub fn on_tick(&mut self, now: u64) {
        self.now = now;
        let limit = self.settings.op_timeout_ns;
        let timeout = Error::Timeout { what: "operation", millis: limit / 1_000_000 };
        let mut expired: Vec<OpId> = self.ops.iter().filter(|(_, op)| now.saturating_sub(op.started) > limit).map(|(id, _)| *id).collect();
        expired.sort_unstable();
        for id in expired {
            self.fail_op(id, timeout.clone());
        }
        let mut stuck: Vec<(u16, u64)> =
            self.transits.iter().filter(|(_, t)| t.suspect.is_none() && now.saturating_sub(t.started) > limit).map(|(k, _)| *k).collect();
        stuck.sort_unstable();
        for key in stuck {
            tracing::warn!(node = self.rank, table = key.0, key = key.1, "an incoming relocation did not land in time");
            self.abandon_transit_queue(key, Error::Timeout { what: "relocation", millis: limit / 1_000_000 });
        }
        let grace = self.settings.loss_grace_ns;
        let mut expired: Vec<(u16, u64)> =
            self.transits.iter().filter(|(_, t)| t.suspect.is_some() && !t.abandoned && now.saturating_sub(t.suspect_since) > grace).map(|(k, _)| *k).collect();
        expired.sort_unstable();
        for key in expired {
            self.give_up_transit(key);
        }
        self.drain_loopback();
    }

    /// Forgets an operation (its waiter gave up); late answers are ignored.
    pub fn cancel(&mut self, op: OpId) {
        self.ops.remove(&op);
    }

    /// Enters the next generation of a barrier; its release appears in the output.
    pub fn barrier_enter(&mut self, kind: BarrierKind, now: u64) -> u32 {
        self.now = now;
        let generation = {
            let g = &mut self.barrier_generation[kind as usize];
            *g += 1;
            *g
        };
        if let Some((peer, reason)) = self.lost.iter().enumerate().find_map(|(i, l)| l.as_ref().map(|r| (i, r.clone()))) {
            self.barrier_events.push(BarrierEvent { kind, generation, result: Err(Error::PeerLost { node: peer, reason }) });
            return generation;
        }
        self.barrier_waiting.push((kind, generation));
        wire::encode_barrier(self.out.buf(0), msg::BARRIER, kind as u8, generation);
        self.out.sent(0, MessageKind::Barrier, 12);
        self.drain_loopback();
        generation
    }

    fn handle_frame(&mut self, from: u16, frame: &[u8]) -> Result<()> {
        for body in wire::Messages::new(frame) {
            let body = body?;
            match body[0] {
                msg::ACCESS => self.handle_access(from, body)?,
                msg::RESPONSE => self.handle_response(body)?,
                msg::FAILURE => self.handle_failure(body)?,
                msg::LOCALIZE => self.handle_localize(from, body)?,
                msg::RELOCATE => self.handle_relocate(body)?,
                msg::LOCALIZE_FAILED => self.handle_localize_failed(body)?,
                msg::BARRIER => self.handle_barrier(body)?,
                msg::BARRIER_RELEASE => self.handle_barrier_release(body)?,
                other => return Err(Error::Protocol(format!("unknown message type {other}"))),
            }
        }
        Ok(())
    }

    /// Handles messages this node sent to itself, in order, until none are left.
    fn drain_loopback(&mut self) {
        loop {
            let frame = self.out.take_loopback();
            if frame.is_empty() {
                return;
            }
            if let Err(e) = self.handle_frame(self.rank, &frame) {
                // Only this node's own encoder produced these bytes.
                tracing::error!(node = self.rank, "internal protocol error on a message to self: {e}");
            }
        }
    }

    fn handle_barrier(&mut self, body: &[u8]) -> Result<()> {
        let (kind, generation) = wire::decode_barrier(body)?;
        if self.rank != 0 || kind > 1 {
            return Err(Error::Protocol("BARRIER sent to a node that does not coordinate barriers".into()));
        }
        let count = self.barrier_counts.entry((kind, generation)).or_insert(0);
        *count += 1;
        if *count == self.nodes {
            self.barrier_counts.remove(&(kind, generation));
            for node in 0..self.nodes as u16 {
                if self.lost[node as usize].is_none() {
                    wire::encode_barrier(self.out.buf(node), msg::BARRIER_RELEASE, kind, generation);
                    self.out.sent(node, MessageKind::Barrier, 12);
                }
            }
        }
        Ok(())
    }

    fn handle_barrier_release(&mut self, body: &[u8]) -> Result<()> {
        let (kind, generation) = wire::decode_barrier(body)?;
        let kind = match kind {
            0 => BarrierKind::Workers,
            1 => BarrierKind::Finalize,
            _ => return Err(Error::Protocol(format!("unknown barrier kind {kind}"))),
        };
        if let Some(pos) = self.barrier_waiting.iter().position(|w| *w == (kind, generation)) {
            self.barrier_waiting.remove(pos);
            self.barrier_events.push(BarrierEvent { kind, generation, result: Ok(()) });
        }
        Ok(())
    }

    fn register_op(&mut self, kind: OpKind, table: u16, keys: Vec<u64>) -> OpId {
        let id = self.next_op;
        self.next_op += 1;
        let rows = keys.len();
        let value_len = self.tables[table as usize].value_len;
        let values = match self.borrowed_output.take() {
            Some(borrowed) => borrowed,
            None if kind == OpKind::Access(AccessKind::Pull) => PullOutput::Owned(vec![0.0; rows * value_len]),
            None => PullOutput::Owned(Vec::new()),
        };
        let op = PendingOp { kind, table, keys, parts: Vec::new(), answered: vec![0; rows.div_ceil(64)], remaining: 0, values, error: None, started: self.now };
        self.ops.insert(id, op);
        id
    }

    /// Completes `id` if nothing is outstanding.
    fn maybe_complete(&mut self, id: OpId) {
        if self.ops.get(&id).is_some_and(|op| op.remaining == 0) {
            let op = self.ops.remove(&id).expect("present");
            let result = match op.error {
                Some(e) => Err(e),
                None => Ok(op.values.into_vec()),
            };
            self.completions.push(Completion { op: id, result });
        }
    }

    fn fail_op(&mut self, id: OpId, error: Error) {
        if let Some(op) = self.ops.remove(&id) {
            self.completions.push(Completion { op: id, result: Err(op.error.unwrap_or(error)) });
        }
    }

    fn table_name(&self, table: u16) -> String {
        self.tables.get(table as usize).map_or_else(|| format!("#{table}"), |t| t.name.clone())
    }

    fn is_lost(&self, node: u16) -> bool {
        self.lost.get(node as usize).is_some_and(Option::is_some)
    }

    fn lost_error(&self, node: u16) -> Error {
        Error::PeerLost { node: node as usize, reason: self.lost[node as usize].clone().unwrap_or_default() }
    }
}

#[cfg(test)]
mod tests;
