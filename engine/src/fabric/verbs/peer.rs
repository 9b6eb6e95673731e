//! One peer's connection over verbs: its queue pair, message buffers, credits, and the queue of
//! frames and writes waiting for them.
//!
//! Messages are SENDs into the peer's pre-posted receive buffers. Every SEND and every WRITE
//! WITH IMMEDIATE consumes one of those buffers, so the sender holds one credit per buffer and
//! spends one per request; the receiver reposts each buffer once it has handled it and returns
//! the credits in the immediate of its next SEND, or — when it has nothing to say and owes at
//! least a quarter of the buffers — in a SEND of its own. One credit is reserved for that
//! credit-only SEND, so two peers that have both run out can always tell each other.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use ferry_verbs::{LocalSlice, Operation, Payload, QueuePair, RegisteredBuffer, RemoteSlice, SendRequest, VerbsError};
use parking_lot::Mutex;

use crate::fabric::WriteRequest;

/// Immediate bits of a SEND: credits returned (low 16 bits) and two flags.
pub(super) const IMM_CREDITS: u32 = 0xFFFF;
/// The SEND carries the last fragment of a frame.
pub(super) const IMM_FRAME_END: u32 = 1 << 16;
/// The SEND carries only credits.
pub(super) const IMM_CREDIT_ONLY: u32 = 1 << 17;

/// Credits only a credit-returning SEND may use.
const RESERVED_CREDITS: u32 = 1;

/// One message SEND in this many asks for a completion (and the last of every posted batch):
/// a queue pair completes its requests in order, so a completion also covers the unsignaled
/// SENDs before it, and the poller handles a fraction of the completions. Writes and reads are
/// always signaled (their completions free a slot or finish a read).
const SIGNAL_EVERY: u64 = 8;

/// What a posted send-queue request was, to act on its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Posted {
    /// A frame fragment in send buffer `slot`.
    Fragment(u32),
    /// A credit-only SEND.
    Credits,
    /// A relocation's write, reported to the node under this id.
    Write(u64),
    /// A one-sided read, reported to the waiting reader under this id.
    Read(u64),
}

enum Pending {
    Frame {
        data: Vec<u8>,
        sent: usize,
    },
    Write(QueuedWrite),
    /// A one-sided read (needs no credit: it consumes no receive buffer).
    Read {
        id: u64,
        remote: RemoteSlice,
        local: LocalSlice,
    },
}

/// A [`WriteRequest`] waiting for credits; the source address is kept as a number (the
/// `Fabric::write` contract keeps the memory valid until completion).
#[derive(Clone, Copy)]
struct QueuedWrite {
    src: usize,
    len: usize,
    remote: crate::store::RemoteAddr,
    imm: u32,
    wr_id: u64,
}

/// The connection's life.
pub(super) const OPEN: u8 = 0;
/// The peer said goodbye: nothing more is sent, late errors are expected.
pub(super) const CLOSED: u8 = 1;
/// The connection failed.
pub(super) const FAILED: u8 = 2;

/// Send-side state, behind the peer's send lock.
pub(super) struct SendState {
    credits: u32,
    pending: VecDeque<Pending>,
    /// Posted requests in posting order (a queue pair completes them in that order).
    inflight: VecDeque<(u64, Posted)>,
    free_slots: Vec<u32>,
    next_seq: u64,
    /// A thread is posting what it took from `pending`; others only queue (see [`Peer::pump`]).
    pumping: bool,
}

/// What a pump left for the caller to report once the send lock is released.
#[derive(Default)]
pub(super) struct Fallout {
    /// Writes that will never be posted, with the reason.
    pub failed_writes: Vec<(u64, String)>,
    /// Reads that will never be posted.
    pub failed_reads: Vec<u64>,
    /// The queue pair refused a post: the connection is broken.
    pub broken: Option<String>,
}

/// One peer.
pub(super) struct Peer {
    pub rank: usize,
    /// What this connection's work requests carry in their top bits: the rank, and above it
    /// which of the rank's connections this is (a node that joins in the rank gets a new one),
    /// so that a late completion of the old queue pair is told apart.
    pub tag: usize,
    pub qp: Mutex<QueuePair>,
    pub send: Mutex<SendState>,
    pub tx: RegisteredBuffer,
    pub rx: RegisteredBuffer,
    pub buffer_bytes: usize,
    pub buffers: u32,
    /// Receive buffers handled and reposted but not yet reported to the peer.
    pub owed: AtomicU32,
    pub state: AtomicU8,
    /// Bytes of frames queued and not yet posted.
    pub queued: AtomicU64,
    /// When something was last posted, or the queue became non-empty (monotonic ns).
    progress_ns: AtomicU64,
    max_send: usize,
    /// Fault injection (tests): posts left before posting to this peer fails.
    posts_before_failure: Option<AtomicU64>,
}

/// Work-request ids: the peer's tag in the top 16 bits (its rank, below [`GENERATION_BIT`]),
/// bit 47 set for receives, a sequence number or buffer index below.
pub(super) const RECV_BIT: u64 = 1 << 47;

/// The bit of a tag that tells a rank's connections apart (ranks stay below it:
/// `Config::MAX_NODES`).
pub(super) const GENERATION_BIT: usize = 1 << 15;

/// The tag of the connection to `rank` that follows `previous` (the first: generation 0).
pub(super) fn next_tag(rank: usize, previous: Option<usize>) -> usize {
    match previous {
        Some(tag) => tag ^ GENERATION_BIT,
        None => rank,
    }
}

pub(super) fn wr_id(peer: usize, recv: bool, index: u64) -> u64 {
    ((peer as u64) << 48) | if recv { RECV_BIT } else { 0 } | (index & (RECV_BIT - 1))
}

pub(super) fn split_wr_id(id: u64) -> (usize, bool, u64) {
    ((id >> 48) as usize, id & RECV_BIT != 0, id & (RECV_BIT - 1))
}

impl Peer {
    pub fn new(tag: usize, qp: QueuePair, tx: RegisteredBuffer, rx: RegisteredBuffer, buffers: u32, buffer_bytes: usize, max_send: usize) -> Peer {
        Peer {
            rank: tag & (GENERATION_BIT - 1),
            tag,
            qp: Mutex::new(qp),
            send: Mutex::new(SendState {
                credits: buffers,
                pending: VecDeque::new(),
                inflight: VecDeque::new(),
                free_slots: (0..buffers).rev().collect(),
                next_seq: 0,
                pumping: false,
            }),
            tx,
            rx,
            buffer_bytes,
            buffers,
            owed: AtomicU32::new(0),
            state: AtomicU8::new(OPEN),
            queued: AtomicU64::new(0),
            progress_ns: AtomicU64::new(0),
            max_send,
            posts_before_failure: None,
        }
    }

    /// Makes posting to this peer fail after `posts` more posts (fault injection for tests).
    pub fn fail_posts_after(&mut self, posts: u64) {
        self.posts_before_failure = Some(AtomicU64::new(posts));
    }

    pub fn is_open(&self) -> bool {
        self.state.load(Ordering::Acquire) == OPEN
    }

    /// Receive buffer `index`.
    pub fn rx_slice(&self, index: u32) -> LocalSlice {
        self.rx.slice(index as usize * self.buffer_bytes, self.buffer_bytes).expect("index below the buffer count")
    }

    /// Posts receive buffers `indices` (initially, and again after each is handled).
    pub fn post_receives(&self, indices: impl Iterator<Item = u32>) -> Result<(), VerbsError> {
        let receives: Vec<(u64, LocalSlice)> = indices.map(|i| (wr_id(self.tag, true, i as u64), self.rx_slice(i))).collect();
        // SAFETY: the receive buffers belong to this peer and live as long as its queue pair;
        // a buffer is reposted only after its previous receive completed and was handled.
        unsafe { self.qp.lock().post_recvs(&receives) }
    }

    /// Queues a frame.
    pub fn enqueue_frame(&self, data: Vec<u8>) {
        let mut st = self.send.lock();
        self.note_queued(&st);
        self.queued.fetch_add(data.len() as u64, Ordering::Relaxed);
        st.pending.push_back(Pending::Frame { data, sent: 0 });
    }

    /// An empty queue gets work: the time without progress counts from now.
    fn note_queued(&self, st: &SendState) {
        if st.pending.is_empty() {
            self.progress_ns.store(ferry_tcp::monotonic_ns(), Ordering::Relaxed);
        }
    }

    /// When queued work has waited without anything being posted: the bytes of frames queued and
    /// for how long (ns), or `None` when nothing waits.
    pub fn stalled(&self, now_ns: u64) -> Option<(u64, u64)> {
        let st = self.send.lock();
        (!st.pending.is_empty()).then(|| (self.queued.load(Ordering::Relaxed), now_ns.saturating_sub(self.progress_ns.load(Ordering::Relaxed))))
    }

    /// Queues writes.
    pub fn enqueue_writes(&self, writes: &[WriteRequest]) {
        let mut st = self.send.lock();
        self.note_queued(&st);
        st.pending.extend(writes.iter().map(|w| Pending::Write(QueuedWrite { src: w.src as usize, len: w.len, remote: w.remote, imm: w.imm, wr_id: w.wr_id })));
    }

    /// Credits returned by the peer.
    pub fn add_credits(&self, n: u32) {
        if n > 0 {
            self.send.lock().credits += n;
        }
    }

    /// Takes up to 16 bits' worth of owed credits for a SEND's immediate.
    fn take_owed(&self) -> u32 {
        let mut owed = self.owed.load(Ordering::Acquire);
        loop {
            let take = owed.min(IMM_CREDITS);
            match self.owed.compare_exchange_weak(owed, owed - take, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return take,
                Err(now) => owed = now,
            }
        }
    }

    /// Posts as much queued work as credits, send buffers and the send queue allow, then a
    /// credit-only SEND if enough credits are owed and nothing carried them. `lookup` finds the
    /// registered local memory behind a write's source.
    ///
    /// The post itself runs outside the send lock: the first thread to find work becomes the
    /// pumper (others only queue and leave), builds a batch under the lock — slots, credits and
    /// sequence numbers taken, the batch recorded as in flight so that its completions find it
    /// — posts it without the lock, and repeats until nothing can be posted. Failures are
    /// returned, never reported from here: the caller hands them to the fabric's reporter.
    pub fn pump(&self, lookup: &dyn Fn(*const u8, usize) -> Option<LocalSlice>) -> Fallout {
        let mut fallout = Fallout::default();
        let mut st = self.send.lock();
        if !self.is_open() {
            for p in st.pending.drain(..) {
                match p {
                    Pending::Write(w) => fallout.failed_writes.push((w.wr_id, format!("the connection to node {} is closed", self.rank))),
                    Pending::Read { id, .. } => fallout.failed_reads.push(id),
                    Pending::Frame { .. } => {}
                }
            }
            return fallout;
        }
        if st.pumping {
            return fallout;
        }
        st.pumping = true;
        loop {
            let (requests, posted) = self.take_batch(&mut st, lookup, &mut fallout);
            if requests.is_empty() {
                st.pumping = false;
                return fallout;
            }
            let first_seq = st.next_seq;
            st.next_seq += posted.len() as u64;
            st.inflight.extend(posted.iter().copied());
            drop(st);
            let injected = self.posts_before_failure.as_ref().is_some_and(|left| {
                let n = requests.len() as u64;
                left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| Some(l.saturating_sub(n))).is_ok_and(|l| l < n)
            });
            ferry_tcp::stage_trace::mark(ferry_tcp::stage_trace::Point::Sending);
            let outcome = if injected {
                Err(VerbsError::Invalid(format!("posting to node {} failed (injected fault)", self.rank)))
            } else {
                // SAFETY: fragments live in this peer's send buffers, whose slots stay taken
                // until the completion; write sources are slots the protocol keeps allocated
                // until it is told the write completed (the `Fabric::write` contract); read
                // targets are the reader's buffer, held until the read completes or is abandoned.
                unsafe { self.qp.lock().post_send(&requests) }
            };
            st = self.send.lock();
            if let Err(e) = outcome {
                // Nothing of the batch was taken for sure: it fails, and with it the connection.
                st.inflight.retain(|(seq, _)| *seq < first_seq || *seq >= first_seq + posted.len() as u64);
                for (_, p) in posted {
                    match p {
                        Posted::Write(id) => fallout.failed_writes.push((id, e.to_string())),
                        Posted::Read(id) => fallout.failed_reads.push(id),
                        Posted::Fragment(_) | Posted::Credits => {}
                    }
                }
                fallout.broken = Some(e.to_string());
                st.pumping = false;
                return fallout;
            }
        }
    }

    /// Takes what can be posted now from the queue.
    fn take_batch(
        &self,
        st: &mut SendState,
        lookup: &dyn Fn(*const u8, usize) -> Option<LocalSlice>,
        fallout: &mut Fallout,
    ) -> (Vec<SendRequest<'static>>, Vec<(u64, Posted)>) {
        let mut requests: Vec<SendRequest<'static>> = Vec::new();
        let mut posted: Vec<(u64, Posted)> = Vec::new();
        while let Some(front) = st.pending.front_mut() {
            if st.inflight.len() + requests.len() >= self.max_send {
                break;
            }
            let seq = st.next_seq + posted.len() as u64;
            match front {
                Pending::Read { id, remote, local } => {
                    let (id, remote, local) = (*id, *remote, *local);
                    st.pending.pop_front();
                    requests.push(SendRequest {
                        wr_id: wr_id(self.tag, false, seq),
                        op: Operation::Read { remote },
                        payload: Payload::Local(local),
                        signaled: true,
                    });
                    posted.push((seq, Posted::Read(id)));
                }
                _ if st.credits <= RESERVED_CREDITS => break,
                Pending::Frame { data, sent } => {
                    let Some(&slot) = st.free_slots.last() else { break };
                    let n = (data.len() - *sent).min(self.buffer_bytes);
                    let end = *sent + n == data.len();
                    self.tx.write(slot as usize * self.buffer_bytes, &data[*sent..*sent + n]).expect("fragment fits its slot");
                    *sent += n;
                    self.queued.fetch_sub(n as u64, Ordering::Relaxed);
                    if end {
                        st.pending.pop_front();
                    }
                    st.free_slots.pop();
                    let imm = self.take_owed() | if end { IMM_FRAME_END } else { 0 };
                    let payload = Payload::Local(self.tx.slice(slot as usize * self.buffer_bytes, n).expect("fragment fits its slot"));
                    let signaled = seq % SIGNAL_EVERY == SIGNAL_EVERY - 1;
                    requests.push(SendRequest { wr_id: wr_id(self.tag, false, seq), op: Operation::Send { imm: Some(imm) }, payload, signaled });
                    posted.push((seq, Posted::Fragment(slot)));
                    st.credits -= 1;
                }
                Pending::Write(w) => {
                    let w = *w;
                    st.pending.pop_front();
                    let Some(local) = lookup(w.src as *const u8, w.len) else {
                        fallout.failed_writes.push((w.wr_id, "the write's source is not registered memory".into()));
                        continue;
                    };
                    let remote = RemoteSlice { addr: w.remote.addr, rkey: w.remote.region };
                    requests.push(SendRequest {
                        wr_id: wr_id(self.tag, false, seq),
                        op: Operation::Write { remote, imm: Some(w.imm) },
                        payload: Payload::Local(local),
                        signaled: true,
                    });
                    posted.push((seq, Posted::Write(w.wr_id)));
                    st.credits -= 1;
                }
            }
        }
        if let Some(last) = requests.last_mut() {
            // Nothing posted stays without a completion that covers it.
            last.signaled = true;
            self.progress_ns.store(ferry_tcp::monotonic_ns(), Ordering::Relaxed);
        }
        let owed = self.owed.load(Ordering::Acquire);
        if requests.is_empty() && owed >= (self.buffers / 4).max(1) && st.credits >= 1 && st.inflight.len() < self.max_send {
            let seq = st.next_seq;
            let imm = self.take_owed() | IMM_CREDIT_ONLY;
            requests.push(SendRequest { wr_id: wr_id(self.tag, false, seq), op: Operation::Send { imm: Some(imm) }, payload: Payload::Empty, signaled: true });
            posted.push((seq, Posted::Credits));
            st.credits -= 1;
        }
        (requests, posted)
    }

    /// Queues a one-sided read of `local.len()` bytes at `remote` into `local`; the caller
    /// pumps.
    pub fn enqueue_read(&self, id: u64, remote: RemoteSlice, local: LocalSlice) -> Result<(), VerbsError> {
        let mut st = self.send.lock();
        if !self.is_open() {
            return Err(VerbsError::Invalid(format!("the connection to node {} is closed", self.rank)));
        }
        self.note_queued(&st);
        st.pending.push_back(Pending::Read { id, remote, local });
        Ok(())
    }

    /// A signaled send-queue request completed: it and the unsignaled requests posted before it
    /// (a queue pair completes its requests in posting order) are done. Frees what they held
    /// and returns them, oldest first; nothing for a request this peer does not know.
    pub fn complete(&self, seq: u64) -> Vec<Posted> {
        let mut st = self.send.lock();
        if !st.inflight.iter().any(|(s, _)| *s == seq) {
            return Vec::new();
        }
        let mut done = Vec::new();
        while let Some(&(s, posted)) = st.inflight.front() {
            if s > seq {
                break;
            }
            st.inflight.pop_front();
            if let Posted::Fragment(slot) = posted {
                st.free_slots.push(slot);
            }
            done.push(posted);
        }
        done
    }

    /// Whether everything queued has been posted and completed.
    pub fn is_drained(&self) -> bool {
        let st = self.send.lock();
        st.pending.is_empty() && st.inflight.is_empty()
    }

    /// Marks the connection failed (or closed), moves the queue pair to the error state so that
    /// everything posted completes as flushed, and drops what was never posted. Returns the
    /// writes that will never be posted; `None` when the connection was not open.
    pub fn shut(&self, state: u8, reason: &str) -> Option<Vec<(u64, String)>> {
        if self.state.compare_exchange(OPEN, state, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return None;
        }
        let mut st = self.send.lock();
        let failed = st
            .pending
            .drain(..)
            .filter_map(|p| match p {
                Pending::Write(w) => Some((w.wr_id, reason.to_string())),
                Pending::Frame { .. } | Pending::Read { .. } => None,
            })
            .collect();
        if state == FAILED {
            let _ = self.qp.lock().fail();
        }
        Some(failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_request_ids_round_trip() {
        for (peer, recv, index) in [(0, false, 0), (65_535, true, (1 << 47) - 1), (3, true, 12), (7, false, 99)] {
            assert_eq!(split_wr_id(wr_id(peer, recv, index)), (peer, recv, index));
        }
    }

    #[test]
    fn a_ranks_successive_connections_differ_in_their_tag_only() {
        let rank = 0x7ffe;
        let first = next_tag(rank, None);
        let second = next_tag(rank, Some(first));
        assert_eq!((first, first & (GENERATION_BIT - 1)), (rank, rank));
        assert_ne!(second, first);
        assert_eq!(second & (GENERATION_BIT - 1), rank);
        assert_eq!(next_tag(rank, Some(second)), first);
        let (tag, recv, index) = split_wr_id(wr_id(second, true, 5));
        assert_eq!((tag, recv, index), (second, true, 5));
    }
}
