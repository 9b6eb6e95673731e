//! The poller's side of the verbs fabric: completions become frames, landed writes, finished
//! writes and reads, returned credits, and — when something fails — lost peers.
//!
//! The poller never holds a peer's send lock while it calls into the node: node threads hold
//! the engine lock while they take send locks, so the reverse order would deadlock.

use std::sync::Weak;
use std::sync::atomic::Ordering;

use ferry_verbs::{Completion, CompletionHandler, CompletionKind, CompletionStatus, VerbsError};

use super::Inner;
use super::peer::{IMM_CREDIT_ONLY, IMM_CREDITS, IMM_FRAME_END, Peer, Posted, split_wr_id};
use crate::error::Error;
use crate::fabric::Landed;

pub(super) struct Receiver {
    inner: Weak<Inner>,
    /// Fragments of a frame still arriving, per peer, and the tag of the connection they came
    /// over (a new connection in the rank starts afresh).
    partial: Vec<(usize, Vec<u8>)>,
    /// Landed writes not yet reported, and whose they are (reported before anything else from
    /// that peer, so the order holds).
    landed: Vec<Landed>,
    landed_from: usize,
    /// Peers whose send side may have room or owe credits after this batch.
    touched: Vec<bool>,
}

impl Receiver {
    pub fn new(inner: Weak<Inner>, nodes: usize) -> Receiver {
        Receiver { inner, partial: (0..nodes).map(|r| (r, Vec::new())).collect(), landed: Vec::new(), landed_from: 0, touched: vec![false; nodes] }
    }

    fn flush_landed(&mut self, inner: &Inner) {
        if self.landed.is_empty() {
            return;
        }
        if let Some(h) = inner.handler() {
            h.on_writes_landed(self.landed_from, &self.landed);
        }
        self.landed.clear();
    }

    fn repost(&self, inner: &Inner, peer: &Peer, index: u32) {
        match peer.post_receives(std::iter::once(index)) {
            Ok(()) => {
                peer.owed.fetch_add(1, Ordering::AcqRel);
            }
            Err(e) if peer.is_open() => inner.fail(peer.rank, format!("reposting a receive failed: {e}")),
            Err(_) => {}
        }
    }

    /// A failed completion: expected while a connection is being torn down, fatal otherwise.
    fn failed(&self, inner: &Inner, peer: &Peer, status: CompletionStatus, what: &str) {
        if peer.is_open() && !inner.closing.load(Ordering::Acquire) {
            inner.fail(peer.rank, format!("{what} failed: {status}"));
        }
    }

    fn received(&mut self, inner: &Inner, peer: &Peer, index: u32, c: &Completion) {
        ferry_tcp::stage_trace::mark(ferry_tcp::stage_trace::Point::Received);
        let rank = peer.rank;
        match c.kind {
            CompletionKind::RecvWriteImm => {
                if self.landed_from != rank {
                    self.flush_landed(inner);
                }
                self.landed_from = rank;
                // A WRITE WITH IMMEDIATE's receive completion reports the bytes the write
                // placed (a relocation run's length).
                self.landed.push(Landed { imm: c.imm.unwrap_or(0), len: c.byte_len as usize });
                self.repost(inner, peer, index);
            }
            CompletionKind::Recv => {
                self.flush_landed(inner);
                let imm = c.imm.unwrap_or(0);
                if imm & IMM_CREDIT_ONLY == 0 {
                    let len = c.byte_len as usize;
                    let offset = index as usize * peer.buffer_bytes;
                    // SAFETY: the receive completed, so the device is done with this buffer, and
                    // it is reposted only after the frame has been handled below.
                    let bytes = unsafe { std::slice::from_raw_parts(peer.rx.as_ptr().add(offset), len.min(peer.buffer_bytes)) };
                    let (tag, partial) = &mut self.partial[rank];
                    if *tag != peer.tag {
                        *tag = peer.tag;
                        partial.clear();
                    }
                    if imm & IMM_FRAME_END != 0 && partial.is_empty() {
                        deliver(inner, rank, bytes::Bytes::copy_from_slice(bytes));
                    } else if partial.len() + len > inner.max_frame {
                        partial.clear();
                        inner.fail(rank, format!("node {rank} sent a frame longer than {} bytes", inner.max_frame));
                        return;
                    } else {
                        partial.extend_from_slice(bytes);
                        if imm & IMM_FRAME_END != 0 {
                            let frame = std::mem::take(partial);
                            deliver(inner, rank, bytes::Bytes::from(frame));
                        }
                    }
                }
                self.repost(inner, peer, index);
                peer.add_credits(imm & IMM_CREDITS);
            }
            other => tracing::warn!(peer = rank, ?other, "unexpected receive completion"),
        }
        self.touched[rank] = true;
    }

    fn sent(&mut self, inner: &Inner, peer: &Peer, seq: u64, c: &Completion) {
        let result = c.result().map_err(|e| Error::Transport(format!("to node {}: {e}", peer.rank)));
        let done = peer.complete(seq);
        if done.is_empty() {
            tracing::warn!(peer = peer.rank, seq, "a completion for nothing this node posted");
        }
        for posted in done {
            match posted {
                Posted::Write(id) => {
                    if let Some(h) = inner.handler() {
                        h.on_write_done(id, result.clone());
                    }
                }
                Posted::Read(id) => inner.reads.complete(id, result.clone()),
                Posted::Fragment(_) | Posted::Credits => {}
            }
        }
        if let Some((status, _)) = c.error {
            // A refused write or read (bad address) fails that request only if the queue pair
            // survived it, but verbs move a queue pair to the error state on any failure, so
            // the connection is gone either way.
            self.failed(inner, peer, status, "a send-queue request");
        }
        self.touched[peer.rank] = true;
    }
}

fn deliver(inner: &Inner, rank: usize, frame: bytes::Bytes) {
    if let Some(h) = inner.handler() {
        h.on_frame(rank, frame);
    }
}

impl CompletionHandler for Receiver {
    fn on_completions(&mut self, batch: &[Completion]) {
        let Some(inner) = self.inner.upgrade() else { return };
        for c in batch {
            let (tag, recv, index) = split_wr_id(c.wr_id);
            let rank = tag & (super::peer::GENERATION_BIT - 1);
            let Some(peer) = inner.peer(rank) else {
                tracing::warn!(wr_id = c.wr_id, "a completion for an unknown peer");
                continue;
            };
            if peer.tag != tag {
                // The rank's old connection, which a node that joined in its place replaced:
                // what it still completes (flushed requests) is moot.
                continue;
            }
            let peer = &*peer;
            if recv {
                match c.error {
                    Some((status, _)) => {
                        self.flush_landed(&inner);
                        self.failed(&inner, peer, status, "a receive");
                    }
                    None => self.received(&inner, peer, index as u32, c),
                }
            } else {
                self.sent(&inner, peer, index, c);
            }
        }
        self.flush_landed(&inner);
        for rank in 0..self.touched.len() {
            if std::mem::take(&mut self.touched[rank]) {
                inner.pump(rank);
            }
        }
    }

    fn on_poll_error(&mut self, error: VerbsError) {
        let Some(inner) = self.inner.upgrade() else { return };
        tracing::error!(%error, "polling the completion queue failed; every verbs connection is lost");
        for rank in 0..inner.peers.len() {
            inner.fail(rank, format!("the completion queue failed: {error}"));
        }
    }
}
