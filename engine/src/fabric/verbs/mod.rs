//! The fabric over RDMA verbs.
//!
//! One reliable-connected queue pair per peer, all completing on one completion queue drained
//! by one poller thread. Frames travel as SENDs into per-peer receive buffers under credit-based
//! flow control (see the `peer` module); a relocation's value is one RDMA WRITE WITH IMMEDIATE straight
//! from the old owner's slot into the slot the new owner reserved (its rkey and address came in
//! the protocol's LOCALIZE message), the immediate naming the reservation. Frames and writes to
//! one peer share its queue pair, so they arrive in the order they were posted, as over TCP.
//! One-sided READs serve replica refresh ([`crate::Node::read_slot`]).
//!
//! Why SEND/RECV and not RDMA writes into ring buffers (FaRM, eRPC's RDMA mode): with ring
//! buffers the receiver must poll memory per peer, and a relocation's WRITE WITH IMMEDIATE
//! already needs posted receives; with SENDs one completion queue reports messages and landed
//! writes alike, in order. The cost is a receive per message, which credits bound.
//!
//! A TCP mesh stays alongside for liveness: heartbeats, a clean goodbye, and loss detection
//! when a peer dies without its queue pairs reporting errors (no traffic in flight).

mod peer;
mod receive;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use ferry_tcp::{AccessError, Handler, LandedWrite, Mesh, Rendezvous, TransportError};
use ferry_verbs::{
    Access, Backoff, CompletionQueue, Context, Endpoint, LocalSlice, MemoryRegion, PollHandle, Poller, QueuePair, QueuePairCaps, RegisteredBuffer, RemoteSlice,
};
use parking_lot::{Condvar, Mutex, RwLock};

use self::peer::{CLOSED, FAILED, Peer, next_tag};
use super::{Fabric, FabricHandler, Landing, Landings, PostedRead, ReadWaiters, WriteCompletion, WriteRequest};
use crate::config::VerbsSettings;
use crate::error::{Error, Result};
use crate::store::{RegionHandle, Registrar, RemoteAddr};

/// A fabric over RDMA verbs.
pub struct VerbsFabric {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    rank: usize,
    context: Context,
    cq: Arc<CompletionQueue>,
    /// The connection to every peer (`None` at this node's rank, and for a node that was gone
    /// when this one joined); a node that joins in a rank gets a new one.
    peers: Vec<RwLock<Option<Arc<Peer>>>>,
    /// How connections are made (for those made after set-up).
    shape: PeerShape,
    /// Registered parameter memory, for the lkeys of write sources.
    regions: RwLock<Vec<MemoryRegion>>,
    control: Arc<Mesh>,
    handler: OnceLock<Arc<dyn FabricHandler>>,
    poller: Mutex<Option<Poller>>,
    /// For workers that poll the completion queue themselves while they wait.
    poll_handle: OnceLock<PollHandle>,
    reads: ReadWaiters,
    /// The registered buffers RDMA READs land in.
    landings: Landings<RegisteredBuffer>,
    next_read: AtomicU64,
    max_frame: usize,
    poll_spin: Duration,
    closing: AtomicBool,
    /// Failures found on send paths, for the reporter thread to tell the node about.
    reports: Mutex<VecDeque<Report>>,
    reports_cv: Condvar,
    reporter: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// A failure found while posting, reported to the node by the reporter thread: a send path
/// (a node thread flushing, the poller pumping) never calls into the node.
enum Report {
    /// A write that will never complete.
    WriteFailed(u64, String),
    /// The connection to a peer broke.
    Broken(usize, String),
}

fn verbs_err(e: ferry_verbs::VerbsError) -> Error {
    Error::Transport(e.to_string())
}

/// How this node's connections are made: queue pair capacities and message buffers.
#[derive(Clone, Copy)]
struct PeerShape {
    caps: QueuePairCaps,
    buffers: u32,
    buffer_bytes: usize,
    max_send: usize,
}

impl PeerShape {
    fn new(settings: &VerbsSettings) -> PeerShape {
        let max_send = settings.buffers + 16;
        let buffers = settings.buffers as u32;
        PeerShape {
            caps: QueuePairCaps { max_send: max_send as u32, max_recv: buffers, max_inline: 0 },
            buffers,
            buffer_bytes: settings.buffer_bytes,
            max_send,
        }
    }

    /// Completion queue entries for `nodes` nodes' connections.
    fn cq_entries(&self, nodes: usize) -> u32 {
        ((nodes - 1) * (self.max_send + self.buffers as usize) + 16) as u32
    }

    /// A connection with tag `tag` (see `peer::next_tag`): its queue pair (not connected yet),
    /// buffers, and receives posted.
    fn make(&self, context: &Context, cq: &Arc<CompletionQueue>, tag: usize) -> Result<Peer> {
        let r = tag & (peer::GENERATION_BIT - 1);
        let qp = QueuePair::new(context, cq, self.caps).map_err(verbs_err)?;
        let bytes = self.buffers as usize * self.buffer_bytes;
        let memory = |what: &str, e: ferry_verbs::VerbsError| Error::Memory(format!("{what} for node {r}: {e}"));
        let tx = context.alloc(bytes, Access::LOCAL).map_err(|e| memory("send buffers", e))?;
        let rx = context.alloc(bytes, Access::LOCAL).map_err(|e| memory("receive buffers", e))?;
        let peer = Peer::new(tag, qp, tx, rx, self.buffers, self.buffer_bytes, self.max_send);
        peer.post_receives(0..self.buffers).map_err(verbs_err)?;
        Ok(peer)
    }
}

/// A node joining a running cluster over verbs: its connections, made as the members are
/// reached (see `ferry_tcp::join_running`), each connected once the member answered.
pub struct JoiningVerbs {
    rank: usize,
    context: Context,
    cq: Arc<CompletionQueue>,
    shape: PeerShape,
    peers: Vec<Option<Peer>>,
}

impl JoiningVerbs {
    /// Opens the device for node `rank` of `nodes`.
    pub fn open(context: Context, settings: &VerbsSettings, rank: usize, nodes: usize) -> Result<JoiningVerbs> {
        let shape = PeerShape::new(settings);
        let cq = CompletionQueue::new(&context, shape.cq_entries(nodes)).map_err(verbs_err)?;
        Ok(JoiningVerbs { rank, context, cq, shape, peers: (0..nodes).map(|_| None).collect() })
    }

    /// A connection to `member`, not yet connected; returns its endpoint for the member.
    pub fn offer(&mut self, member: usize) -> Result<Vec<u8>> {
        if member == self.rank || member >= self.peers.len() {
            return Err(Error::Transport(format!("node {member} is no member to connect to")));
        }
        let peer = self.shape.make(&self.context, &self.cq, member)?;
        let endpoint = peer.qp.lock().endpoint().encode().to_vec();
        self.peers[member] = Some(peer);
        Ok(endpoint)
    }

    /// Connects every offered connection to its member's answer (`answers` by rank) and builds
    /// the fabric over `control`.
    pub fn finish(self, control: Mesh, answers: &[Vec<u8>], max_frame: usize, poll_spin: Duration) -> Result<VerbsFabric> {
        for (r, peer) in self.peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            let theirs = answers.get(r).ok_or_else(|| Error::Transport(format!("node {r} did not answer")))?;
            let endpoint = Endpoint::decode(theirs).map_err(verbs_err)?;
            peer.qp.lock().connect(&endpoint).map_err(|e| Error::Transport(format!("connecting to node {r}: {e}")))?;
        }
        Ok(VerbsFabric::build(self.rank, self.context, self.cq, self.peers, self.shape, control, max_frame, poll_spin))
    }
}

impl VerbsFabric {
    #[allow(clippy::too_many_arguments)]
    fn build(
        rank: usize,
        context: Context,
        cq: Arc<CompletionQueue>,
        peers: Vec<Option<Peer>>,
        shape: PeerShape,
        control: Mesh,
        max_frame: usize,
        poll_spin: Duration,
    ) -> VerbsFabric {
        VerbsFabric {
            inner: Arc::new(Inner {
                rank,
                context,
                cq,
                peers: peers.into_iter().map(|p| RwLock::new(p.map(Arc::new))).collect(),
                shape,
                regions: RwLock::new(Vec::new()),
                control: Arc::new(control),
                handler: OnceLock::new(),
                poller: Mutex::new(None),
                poll_handle: OnceLock::new(),
                reads: ReadWaiters::default(),
                landings: Landings::default(),
                next_read: AtomicU64::new(1),
                max_frame,
                poll_spin,
                closing: AtomicBool::new(false),
                reports: Mutex::new(VecDeque::new()),
                reports_cv: Condvar::new(),
                reporter: Mutex::new(None),
            }),
        }
    }

    /// Connects a queue pair to every peer: creates them and their buffers, trades endpoints
    /// through the rendezvous (TCP), connects, and waits until every node has. `control` is
    /// the already connected TCP mesh kept for liveness; `fail_sends_after` injects a post
    /// failure (tests).
    pub fn connect(
        rendezvous: &mut Rendezvous,
        control: Mesh,
        context: Context,
        settings: &VerbsSettings,
        max_frame: usize,
        timeout: Duration,
        fail_sends_after: Option<(usize, u64)>,
    ) -> Result<VerbsFabric> {
        let rank = rendezvous.rank();
        let nodes = rendezvous.nodes();
        let shape = PeerShape::new(settings);
        let cq = CompletionQueue::new(&context, shape.cq_entries(nodes)).map_err(verbs_err)?;
        let mut peers = Vec::with_capacity(nodes);
        let mut blob = Vec::with_capacity(nodes * Endpoint::BYTES);
        for r in 0..nodes {
            if r == rank {
                peers.push(None);
                blob.extend_from_slice(&[0u8; Endpoint::BYTES]);
                continue;
            }
            let mut peer = shape.make(&context, &cq, next_tag(r, None))?;
            blob.extend_from_slice(&peer.qp.lock().endpoint().encode());
            if let Some((to, after)) = fail_sends_after
                && to == r
            {
                tracing::warn!(node = rank, peer = r, after, "fault injection: posting to this peer will fail");
                peer.fail_posts_after(after);
            }
            peers.push(Some(peer));
        }
        let all = rendezvous.all_gather(&blob, timeout)?;
        for (r, peer) in peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            let theirs = all[r]
                .get(rank * Endpoint::BYTES..(rank + 1) * Endpoint::BYTES)
                .ok_or_else(|| Error::Transport(format!("node {r} sent a malformed endpoint table")))?;
            let endpoint = Endpoint::decode(theirs).map_err(verbs_err)?;
            peer.qp.lock().connect(&endpoint).map_err(|e| Error::Transport(format!("connecting to node {r}: {e}")))?;
        }
        // Nobody sends before every queue pair is ready to receive.
        rendezvous.all_gather(b"ready", timeout)?;
        Ok(VerbsFabric::build(rank, context, cq, peers, shape, control, max_frame, settings.poll_spin))
    }
}

impl Inner {
    fn peer(&self, rank: usize) -> Option<Arc<Peer>> {
        self.peers.get(rank).and_then(|p| p.read().clone())
    }

    /// Every connection now.
    fn peers_now(&self) -> Vec<Arc<Peer>> {
        self.peers.iter().filter_map(|p| p.read().clone()).collect()
    }

    /// A node joins in `rank`'s place and offers the endpoint of its queue pair to this node:
    /// once the old connection is closed, a new one takes the rank's slot, connected to the
    /// offer, and its endpoint is the answer (see `ferry_tcp::RejoinHook`).
    fn accept_rejoin(&self, rank: usize, offer: &[u8]) -> std::result::Result<Vec<u8>, String> {
        let slot = self.peers.get(rank).filter(|_| rank != self.rank).ok_or_else(|| format!("node {rank} is no peer of node {}", self.rank))?;
        let endpoint = Endpoint::decode(offer).map_err(|e| format!("a bad queue pair endpoint: {e}"))?;
        let previous = slot.read().as_ref().map(|p| (p.is_open(), p.tag));
        if previous.is_some_and(|(open, _)| open) {
            return Err(format!("node {} still has an open verbs connection to node {rank}", self.rank));
        }
        let peer = self.shape.make(&self.context, &self.cq, next_tag(rank, previous.map(|(_, tag)| tag))).map_err(|e| e.to_string())?;
        peer.qp.lock().connect(&endpoint).map_err(|e| format!("connecting to node {rank}: {e}"))?;
        let mine = peer.qp.lock().endpoint().encode().to_vec();
        *slot.write() = Some(Arc::new(peer));
        tracing::info!(node = self.rank, joining = rank, "a node joins: verbs queue pair connected");
        Ok(mine)
    }

    fn open_peer(&self, rank: usize) -> Result<Arc<Peer>> {
        match self.peer(rank) {
            Some(p) if p.is_open() => Ok(p),
            Some(_) => Err(Error::PeerLost { node: rank, reason: "its connection is closed".into() }),
            None => Err(Error::Transport(format!("node {rank} is not a peer of node {}", self.rank))),
        }
    }

    fn handler(&self) -> Option<&Arc<dyn FabricHandler>> {
        self.handler.get()
    }

    /// The registered local memory holding `len` bytes at `src`.
    fn lookup(&self, src: *const u8, len: usize) -> Option<LocalSlice> {
        self.regions.read().iter().find_map(|r| r.slice_at(src as u64, len))
    }

    /// Posts what `rank`'s queue allows; failures go to the reporter thread (this runs on send
    /// paths, which must not call into the node).
    fn pump(&self, rank: usize) {
        let Some(peer) = self.peer(rank) else { return };
        let fallout = peer.pump(&|src, len| self.lookup(src, len));
        for id in fallout.failed_reads {
            self.reads.complete(id, Err(Error::PeerLost { node: rank, reason: "its connection failed".into() }));
        }
        if fallout.failed_writes.is_empty() && fallout.broken.is_none() {
            return;
        }
        let mut reports = self.reports.lock();
        reports.extend(fallout.failed_writes.into_iter().map(|(id, why)| Report::WriteFailed(id, why)));
        if let Some(reason) = fallout.broken {
            reports.push_back(Report::Broken(rank, format!("posting to node {rank} failed: {reason}")));
        }
        self.reports_cv.notify_all();
    }

    /// The reporter thread: tells the node about failures found on send paths.
    fn run_reporter(&self) {
        loop {
            let report = {
                let mut reports = self.reports.lock();
                loop {
                    if let Some(r) = reports.pop_front() {
                        break r;
                    }
                    if self.closing.load(Ordering::Acquire) {
                        return;
                    }
                    if self.reports_cv.wait_for(&mut reports, Duration::from_millis(100)).timed_out() {
                        drop(reports);
                        self.check_stalls();
                        reports = self.reports.lock();
                    }
                }
            };
            match report {
                Report::WriteFailed(id, why) => self.report_failed_writes(vec![(id, why)]),
                Report::Broken(rank, reason) => self.fail(rank, reason),
            }
        }
    }

    /// Fails a peer whose queue has waited the liveness timeout without a single post (it does
    /// not return credits: connected, perhaps heartbeating, but not reading).
    fn check_stalls(&self) {
        let timeout = self.control.config().peer_timeout.as_nanos() as u64;
        let now = ferry_tcp::monotonic_ns();
        for peer in self.peers_now().iter().filter(|p| p.is_open()) {
            if let Some((queued, waited)) = peer.stalled(now)
                && waited > timeout
            {
                let reason = format!(
                    "node {} does not read what this node sends: {queued} bytes waited {} ms in its send queue and none was posted",
                    peer.rank,
                    waited / 1_000_000
                );
                tracing::warn!(node = self.rank, peer = peer.rank, %reason, "declaring a peer lost that does not read");
                self.fail(peer.rank, reason);
            }
        }
    }

    fn report_failed_writes(&self, failed: Vec<(u64, String)>) {
        if let Some(h) = self.handler() {
            for (id, reason) in failed {
                h.on_write_done(id, Err(Error::Transport(reason)));
            }
        }
    }

    /// The connection to `rank` failed: stop it and tell the node (once).
    fn fail(&self, rank: usize, reason: String) {
        let Some(peer) = self.peer(rank) else { return };
        if let Some(failed) = peer.shut(FAILED, &reason) {
            self.report_failed_writes(failed);
            self.reads.fail_all(&Error::PeerLost { node: rank, reason: reason.clone() });
            self.control.disconnect(rank);
            if !self.closing.load(Ordering::Acquire)
                && let Some(h) = self.handler()
            {
                h.on_peer_closed(rank, Some(reason));
            }
        }
    }

    /// `rank` said goodbye.
    fn closed(&self, rank: usize) {
        let Some(peer) = self.peer(rank) else { return };
        if let Some(failed) = peer.shut(CLOSED, "the node left the cluster") {
            self.report_failed_writes(failed);
            if let Some(h) = self.handler() {
                h.on_peer_closed(rank, None);
            }
        }
    }

    /// Stops the poller, the reporter and the queue pairs; what is registered is released.
    fn stop(&self) {
        if let Some(mut poller) = self.poller.lock().take() {
            poller.stop();
        }
        self.reports_cv.notify_all();
        if let Some(reporter) = self.reporter.lock().take() {
            let _ = reporter.join();
        }
        for peer in self.peers_now() {
            peer.shut(CLOSED, "this node shut down");
            let _ = peer.qp.lock().fail();
        }
        self.reads.fail_all(&Error::ShutDown);
    }
}

/// Registers parameter arenas with the device.
struct VerbsRegistrar {
    inner: Arc<Inner>,
}

impl Registrar for VerbsRegistrar {
    unsafe fn register(&self, base: *mut u8, len: usize) -> Result<RegionHandle> {
        // SAFETY: the caller keeps the memory mapped for the registrar's lifetime (`Registrar`).
        let region = unsafe { self.inner.context.register(base, len, Access::REMOTE) }.map_err(|e| Error::Memory(e.to_string()))?;
        let handle = RegionHandle { region: region.rkey(), remote_base: region.addr() };
        self.inner.regions.write().push(region);
        Ok(handle)
    }

    unsafe fn register_read_only(&self, base: *mut u8, len: usize) -> Result<RegionHandle> {
        // SAFETY: as above; the region takes RDMA READs only.
        let region = unsafe { self.inner.context.register(base, len, Access::REMOTE_READ) }.map_err(|e| Error::Memory(e.to_string()))?;
        let handle = RegionHandle { region: region.rkey(), remote_base: region.addr() };
        self.inner.regions.write().push(region);
        Ok(handle)
    }
}

/// The TCP mesh's reports: only liveness matters (no frames travel over it).
struct ControlAdapter {
    inner: Weak<Inner>,
}

impl Handler for ControlAdapter {
    fn on_message(&self, from: usize, _payload: bytes::Bytes) {
        tracing::warn!(peer = from, "a protocol frame arrived over the TCP control connection of a verbs fabric; ignored");
    }

    fn on_writes_landed(&self, from: usize, _writes: &[LandedWrite]) {
        tracing::warn!(peer = from, "a TCP write arrived at a verbs fabric; ignored");
    }

    fn on_write_error(&self, _peer: usize, _wr_id: u64, _error: AccessError) {}

    fn on_read_complete(&self, _peer: usize, _wr_id: u64, _result: std::result::Result<(), AccessError>) {}

    fn on_peer_closed(&self, peer: usize, error: Option<&TransportError>) {
        let Some(inner) = self.inner.upgrade() else { return };
        match error {
            None => inner.closed(peer),
            Some(e) => inner.fail(peer, e.to_string()),
        }
    }
}

impl Fabric for VerbsFabric {
    fn name(&self) -> &'static str {
        "verbs"
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(VerbsRegistrar { inner: self.inner.clone() })
    }

    fn start(&self, handler: Arc<dyn FabricHandler>) -> Result<()> {
        if self.inner.handler.set(handler).is_err() {
            return Err(Error::Transport("the fabric was started twice".into()));
        }
        self.inner.control.start(Arc::new(ControlAdapter { inner: Arc::downgrade(&self.inner) }))?;
        let receiver = receive::Receiver::new(Arc::downgrade(&self.inner), self.inner.peers.len());
        let poller = Poller::spawn(
            format!("ferry{}-verbs", self.inner.rank),
            self.inner.cq.clone(),
            Backoff { spin: self.inner.poll_spin, ..Backoff::default() },
            receiver,
        )
        .map_err(verbs_err)?;
        let _ = self.inner.poll_handle.set(poller.handle());
        *self.inner.poller.lock() = Some(poller);
        let inner = self.inner.clone();
        let reporter = std::thread::Builder::new()
            .name(format!("ferry{}-verbs-report", self.inner.rank))
            .spawn(move || inner.run_reporter())
            .map_err(|e| Error::Transport(format!("cannot start the verbs reporter thread: {e}")))?;
        *self.inner.reporter.lock() = Some(reporter);
        Ok(())
    }

    fn start_polling(&self) {
        if let Some(h) = self.inner.poll_handle.get() {
            h.start_polling();
        }
    }

    fn stop_polling(&self) {
        if let Some(h) = self.inner.poll_handle.get() {
            h.stop_polling();
        }
    }

    fn poll_receive(&self) -> bool {
        !self.inner.closing.load(Ordering::Acquire) && self.inner.poll_handle.get().is_some_and(PollHandle::poll_now)
    }

    fn enqueue(&self, to: usize, frame: Vec<u8>) -> Result<()> {
        let peer = self.inner.open_peer(to)?;
        let queued = peer.queued.load(Ordering::Relaxed);
        let hard = (self.inner.control.config().send_queue_limit as u64).saturating_mul(ferry_tcp::SEND_QUEUE_HARD_FACTOR);
        if queued > 0 && queued + frame.len() as u64 > hard {
            let reason = format!("node {to} does not read what this node sends: {queued} bytes wait in its send queue, past the limit of {hard}");
            // Reported by the reporter thread: a send path never calls into the node.
            self.inner.reports.lock().push_back(Report::Broken(to, reason.clone()));
            self.inner.reports_cv.notify_all();
            return Err(Error::PeerLost { node: to, reason });
        }
        peer.enqueue_frame(frame);
        Ok(())
    }

    fn wait_for_room(&self, timeout: Duration) -> Result<()> {
        let limit = self.inner.control.config().send_queue_limit as u64;
        ferry_tcp::wait_for_room(limit, timeout, || {
            let queued = |p: &Peer| p.queued.load(Ordering::Relaxed);
            self.inner.peers_now().iter().find(|p| p.is_open() && queued(p) >= limit).map(|p| (p.rank, queued(p)))
        })
        .map_err(Error::from)
    }

    fn flush(&self, to: usize) {
        self.inner.pump(to);
    }

    fn queued_bytes(&self, peer: usize) -> Option<u64> {
        Some(self.inner.peer(peer).map_or(0, |p| p.queued.load(Ordering::Relaxed)))
    }

    unsafe fn write(&self, to: usize, writes: &[WriteRequest]) -> Result<WriteCompletion> {
        self.inner.open_peer(to)?.enqueue_writes(writes);
        Ok(WriteCompletion::Deferred)
    }

    fn post_read(&self, peer: usize, remote: RemoteAddr, len: usize) -> Result<PostedRead> {
        let inner = &self.inner;
        let p = inner.open_peer(peer)?;
        let id = inner.next_read.fetch_add(1, Ordering::Relaxed);
        let make = |size: usize| inner.context.alloc(size, Access::LOCAL).map_err(|e| Error::Memory(e.to_string()));
        let local = inner.landings.lend(id, len, make, drop, |b| b.slice(0, len))?;
        inner.reads.expect(id);
        if let Err(e) = local.and_then(|local| p.enqueue_read(id, RemoteSlice { addr: remote.addr, rkey: remote.region }, local)) {
            // Not queued: no answer will land in the buffer.
            inner.landings.unsent(&inner.reads, id);
            return Err(verbs_err(e));
        }
        inner.pump(peer);
        Ok(PostedRead { id, peer, len })
    }

    fn read_done(&self, read: &PostedRead) -> bool {
        self.inner.reads.is_done(read.id)
    }

    fn finish_read(&self, read: PostedRead, out: &mut [u8], timeout: Duration) -> Result<()> {
        self.inner.landings.finish(&self.inner.reads, read, out, timeout, |b, out| b.read(0, out).map_err(verbs_err))
    }

    fn disconnect(&self, peer: usize) {
        // Reported by the reporter thread, like any failure a node thread runs into.
        self.inner.reports.lock().push_back(Report::Broken(peer, "disconnected by this node".into()));
        self.inner.reports_cv.notify_all();
    }

    fn is_alive(&self, peer: usize) -> bool {
        self.inner.peer(peer).is_some_and(|p| p.is_open()) && self.inner.control.is_alive(peer)
    }

    fn shutdown(&self) {
        let inner = &self.inner;
        inner.closing.store(true, Ordering::Release);
        // Let what was posted reach the peers (their acknowledgements complete it) before the
        // goodbye: a peer may still be waiting for this node's last messages.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && inner.peers_now().iter().any(|p| p.is_open() && !p.is_drained()) {
            std::thread::sleep(Duration::from_millis(1));
        }
        inner.control.shutdown();
        inner.stop();
    }

    fn admit_joins(&self, info: Vec<u8>) {
        let inner = Arc::downgrade(&self.inner);
        self.inner.control.on_rejoin(Arc::new(move |rank, offer| match inner.upgrade() {
            Some(inner) => inner.accept_rejoin(rank, offer),
            None => Err("this node stops".into()),
        }));
        self.inner.control.admit_joins(info);
    }

    fn join_addresses(&self) -> Vec<std::net::SocketAddr> {
        self.inner.control.join_addresses()
    }

    fn abort(&self) {
        self.inner.closing.store(true, Ordering::Release);
        self.inner.control.abort();
        self.inner.stop();
    }
}

impl Landing for RegisteredBuffer {
    fn capacity(&self) -> usize {
        self.len()
    }
}
