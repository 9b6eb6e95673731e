//! A connection's receiving side: the reader thread, and workers that poll for their answers.
//!
//! A frame crossing a thread costs a wake-up, 10–35 µs on a virtual machine and several µs on
//! bare metal, more than a small message takes on the wire. Two threads may therefore read a
//! connection, taking turns under its [`Receiving`] lock so that frames stay whole and in order:
//!
//! * its reader thread, which waits for bytes without holding the lock (a blocking peek), or —
//!   when the node's poll budget allows and no worker of the node is polling — busy-polls for a
//!   short window after the last bytes it read, so that a request arriving in a ping-pong finds
//!   it awake;
//! * a worker waiting for an answer ([`crate::Mesh::poll_receive`]), which reads what the socket
//!   holds without blocking and hands the frames on itself, so that its answer does not wait for
//!   the reader thread to wake and pass it through the worker's inbox.

use std::io;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::BytesMut;

use crate::error::TransportError;
use crate::frame::{HEADER_LEN, Header};
use crate::mesh::{Handler, Inner, LandedWrite, Peer};

/// Bytes a connection's reader asks the socket for at a time (at least).
const READ_CHUNK: usize = 512 << 10;

/// What a connection's receiving side keeps between reads.
pub(crate) struct Receiving {
    /// Received bytes not yet split into frames. Frames are split off and handed on as shared
    /// slices (no copy); when its spare room runs low a fresh allocation takes over, while
    /// handed-out frames keep theirs.
    buf: BytesMut,
    /// Writes with immediates that landed and are not yet reported.
    landed: Vec<LandedWrite>,
    /// Frames handed on so far (for fault injection).
    frames: u64,
}

impl Default for Receiving {
    fn default() -> Self {
        Receiving { buf: BytesMut::with_capacity(READ_CHUNK), landed: Vec::new(), frames: 0 }
    }
}

/// What one non-blocking read found.
enum Received {
    /// Bytes (their whole frames were handed on).
    Bytes,
    /// Nothing yet.
    Nothing,
    /// The peer closed its side.
    End,
    /// The socket failed.
    Failed(io::Error),
}

impl Inner {
    pub(crate) fn start_polling(&self) {
        self.polling_workers.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn stop_polling(&self) {
        // Never below zero, whatever a caller got wrong: the count gates the readers.
        let _ = self.polling_workers.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// Whether fault injection has this node stop reading `rx`'s connection.
    fn stopped_reading(&self, rx: &Receiving) -> bool {
        self.config.stop_reading_after.is_some_and(|n| rx.frames >= n)
    }

    /// A worker's poll of `p`: reads what its socket holds without blocking (one read) and
    /// hands the frames on; false when nothing came or another thread is reading it.
    pub(crate) fn poll_peer(&self, p: &Arc<Peer>) -> bool {
        if !p.alive.load(Ordering::Acquire) {
            return false;
        }
        let Some(handler) = self.handler() else { return false };
        let Some(mut rx) = p.receiving.try_lock() else { return false };
        if self.stopped_reading(&rx) {
            return false;
        }
        match self.receive_ready(&*handler, p, &mut rx, true, false) {
            Ok(Received::Bytes) => true,
            // The reader thread sees the end or the failure too, and reports it.
            Ok(Received::Nothing | Received::End | Received::Failed(_)) => false,
            Err(error) => {
                tracing::error!(node = self.rank, peer = p.id, %error, "closing connection after a malformed frame");
                self.deliver_landed(&*handler, p.id, &mut rx.landed);
                drop(rx);
                self.defer_loss(p, error);
                false
            }
        }
    }

    /// Reads what `p`'s socket holds (once, or until it is empty) and hands every whole frame
    /// on; an error is a malformed frame, after which the connection must go. The first read
    /// waits up to the socket's read timeout when `block` is set; no other does.
    fn receive_ready(&self, handler: &dyn Handler, p: &Arc<Peer>, rx: &mut Receiving, once: bool, block: bool) -> Result<Received, TransportError> {
        let max_payload = self.config.max_frame.max(crate::frame::WRITE_HEADER + 64);
        let sock = socket2::SockRef::from(&p.stream);
        let mut got = Received::Nothing;
        let mut flags = if block { 0 } else { libc::MSG_DONTWAIT };
        loop {
            if rx.buf.capacity() - rx.buf.len() < READ_CHUNK / 4 {
                rx.buf.reserve(READ_CHUNK);
            }
            let read = sock.recv_with_flags(rx.buf.spare_capacity_mut(), flags);
            flags = libc::MSG_DONTWAIT;
            match read {
                Ok(0) => return Ok(if matches!(got, Received::Bytes) { got } else { Received::End }),
                Ok(n) => {
                    crate::stage_trace::mark(crate::stage_trace::Point::Received);
                    // SAFETY: `recv` initialised the first `n` bytes of the spare capacity.
                    unsafe { rx.buf.set_len(rx.buf.len() + n) };
                    self.bytes_received.fetch_add(n as u64, Ordering::Relaxed);
                    p.read.fetch_add(n as u64, Ordering::Relaxed);
                    p.read_ns.store(self.now_ns(), Ordering::Relaxed);
                    got = Received::Bytes;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => return Ok(got),
                Err(e) => return Ok(if matches!(got, Received::Bytes) { got } else { Received::Failed(e) }),
            }
            while rx.buf.len() >= HEADER_LEN {
                let head: &[u8; HEADER_LEN] = rx.buf[..HEADER_LEN].try_into().expect("header");
                let header = Header::decode(head, p.id, max_payload)?;
                let total = HEADER_LEN + header.len as usize;
                if rx.buf.len() < total {
                    rx.buf.reserve(total - rx.buf.len());
                    break;
                }
                let frame = rx.buf.split_to(total).freeze();
                rx.frames += 1;
                self.dispatch(handler, p, header, frame.slice(HEADER_LEN..), &mut rx.landed)?;
                if self.stopped_reading(rx) {
                    break;
                }
            }
            self.deliver_landed(handler, p.id, &mut rx.landed);
            if once || self.stopped_reading(rx) {
                return Ok(got);
            }
        }
    }

    /// Busy-polls `p`'s socket, reading and handing on what comes, for as long as the poll
    /// budget allows, no worker of this node polls, and bytes came within the poll window;
    /// returns what ended it (`Nothing` when the reader should sleep until bytes come).
    fn spin(&self, handler: &dyn Handler, p: &Arc<Peer>) -> Result<Received, TransportError> {
        let window = self.config.poll_window.as_nanos() as u64;
        if window == 0 || self.poll_readers == 0 || self.polling_workers.load(Ordering::Acquire) > 0 {
            return Ok(Received::Nothing);
        }
        if self.spinning_readers.fetch_add(1, Ordering::AcqRel) >= self.poll_readers {
            self.spinning_readers.fetch_sub(1, Ordering::AcqRel);
            return Ok(Received::Nothing);
        }
        let outcome = loop {
            if let Some(mut rx) = p.receiving.try_lock() {
                if self.stopped_reading(&rx) {
                    break Ok(Received::Nothing);
                }
                match self.receive_ready(handler, p, &mut rx, true, false) {
                    Ok(Received::Nothing) => {}
                    Ok(Received::Bytes) => continue,
                    Ok(other) => break Ok(other),
                    Err(e) => {
                        self.deliver_landed(handler, p.id, &mut rx.landed);
                        break Err(e);
                    }
                }
            }
            // Only while bytes come: an idle connection's reader sleeps.
            let idle = self.now_ns().saturating_sub(p.read_ns.load(Ordering::Relaxed));
            if idle > window || self.polling_workers.load(Ordering::Acquire) > 0 || !p.alive.load(Ordering::Acquire) {
                break Ok(Received::Nothing);
            }
            std::hint::spin_loop();
        };
        self.spinning_readers.fetch_sub(1, Ordering::AcqRel);
        outcome
    }

    /// Sleeps until `p`'s socket has bytes (or its end, or a failure), up to the socket's read
    /// timeout, then reads and hands on what it holds. Errors are malformed frames (the landed
    /// writes before them are delivered).
    ///
    /// While no worker of this node polls, the reader sleeps in the read itself, holding the
    /// receiving lock: one system call per wake-up, as a plain reader makes. While workers poll,
    /// it sleeps in a peek without the lock, so that they can take what comes; a worker that
    /// starts polling while the reader sleeps in a read finds the lock taken, and that one
    /// message goes through the reader thread.
    fn wait_and_receive(&self, handler: &dyn Handler, p: &Arc<Peer>) -> Result<Received, TransportError> {
        let receive = |block: bool| {
            let mut rx = p.receiving.lock();
            if self.stopped_reading(&rx) {
                return Ok(Received::Nothing);
            }
            let received = self.receive_ready(handler, p, &mut rx, true, block);
            if received.is_err() {
                self.deliver_landed(handler, p.id, &mut rx.landed);
            }
            received
        };
        if self.polling_workers.load(Ordering::Acquire) == 0 {
            return receive(true);
        }
        let sock = socket2::SockRef::from(&p.stream);
        let mut probe = [MaybeUninit::<u8>::uninit(); 1];
        match sock.peek(&mut probe) {
            Ok(0) => Ok(Received::End),
            Ok(_) => receive(false),
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted) => Ok(Received::Nothing),
            Err(e) => Ok(Received::Failed(e)),
        }
    }

    /// The reader thread of `p`'s connection.
    pub(crate) fn run_reader(&self, p: &Arc<Peer>) {
        let Some(handler) = self.handler() else { return };
        let started = self.now_ns();
        loop {
            if !p.alive.load(Ordering::Acquire) {
                return;
            }
            if self.stopped_reading(&p.receiving.lock()) {
                // Injected fault: read nothing more; only a failed send (the peer closed the
                // connection) or this node's shutdown ends the connection.
                while p.alive.load(Ordering::Acquire) && !self.stopping.load(Ordering::Acquire) {
                    // Taken out of its lock first: telling the handler may disconnect the peer
                    // again, which records a failure under the same lock.
                    let failure = p.failure.lock().take();
                    if let Some(e) = failure {
                        self.lose_peer(p, e);
                        return;
                    }
                    std::thread::sleep(crate::mesh::POLL_TICK);
                }
                return;
            }
            let received = match self.spin(&*handler, p) {
                Ok(Received::Nothing) => self.wait_and_receive(&*handler, p),
                spun => spun,
            };
            let received = match received {
                Ok(received) => received,
                Err(error) => {
                    tracing::error!(node = self.rank, peer = p.id, %error, "closing connection after a malformed frame");
                    self.lose_peer(p, error);
                    return;
                }
            };
            match received {
                Received::Bytes => {}
                Received::Nothing => {
                    let silent = self.now_ns().saturating_sub(p.read_ns.load(Ordering::Relaxed).max(started));
                    if silent > self.config.peer_timeout.as_nanos() as u64 {
                        self.lose_peer(p, TransportError::PeerTimeout { peer: p.id, millis: (silent / 1_000_000) as u128 });
                        return;
                    }
                }
                Received::End => {
                    // Taken out of its lock first: the handler that `lose_peer` tells may
                    // disconnect the peer again (the verbs fabric does), which records a failure
                    // under the same lock — held across the call, that deadlocked the reader and
                    // with it the node's shutdown.
                    let failure = p.failure.lock().take();
                    if let Some(e) = failure {
                        self.lose_peer(p, e);
                    } else if p.goodbye_received.load(Ordering::Acquire) || self.stopping.load(Ordering::Acquire) {
                        self.close_peer_cleanly(p);
                    } else {
                        self.lose_peer(p, TransportError::PeerGone(p.id));
                    }
                    return;
                }
                Received::Failed(e) => {
                    let error = p.failure.lock().take().unwrap_or(TransportError::Io { context: format!("reading from node {}", p.id), source: e });
                    self.lose_peer(p, error);
                    return;
                }
            }
        }
    }
}
