//! A full mesh of TCP connections between the nodes of a cluster.
//!
//! One ordered connection per pair of nodes carries two-sided messages and the emulated one-sided
//! operations. Each connection has a reader thread, which parses frames and serves one-sided
//! reads and writes itself (the node's protocol logic is not involved; threads waiting for
//! answers may take its place, see [`crate::receive`]), and a writer thread that finishes
//! whatever a caller's non-blocking write could not send at once.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex, RwLock};

use crate::error::{AccessError, TransportError};
use crate::frame::{self, FLAG_IMM, FrameKind, HEADER_LEN, Header};
use crate::outq::{OutFrame, OutQueue, write_frames};
use crate::region::{RegionId, Regions, copy_from_region, copy_into_region};

/// Timing and size limits of a mesh.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// Largest frame payload accepted from a peer; a larger one closes the connection.
    pub max_frame: usize,
    /// An idle connection sends a heartbeat this often.
    pub heartbeat: Duration,
    /// A peer that sends nothing (not even heartbeats) for this long is declared lost.
    pub peer_timeout: Duration,
    /// How long connection set-up may take.
    pub connect_timeout: Duration,
    /// Bytes queued for one peer beyond which callers of [`Mesh::wait_for_room`] wait (the
    /// engine's workers do before each operation). A peer whose queue grows past
    /// [`SEND_QUEUE_HARD_FACTOR`] times this, or stops draining for the liveness timeout, is
    /// declared lost: a member that keeps its connection but does not read cannot make this
    /// node's memory grow without bound.
    pub send_queue_limit: usize,
    /// Fault injection for tests: sending to peer `.0` fails after `.1` more sends, as a
    /// failing `sendmsg` would.
    pub fail_sends_after: Option<(usize, u64)>,
    /// Fault injection for tests: every connection's reader stops reading after this many
    /// frames, while the node goes on sending (heartbeats included), as a member whose receiving
    /// side is stuck would.
    pub stop_reading_after: Option<u64>,
    /// Who may join the rendezvous and the mesh (see [`crate::Membership`]).
    pub membership: crate::Membership,
    /// Reader threads that may busy-poll their connections at once (0: readers always sleep
    /// until bytes come). A busy-polling reader answers a request without a wake-up but takes
    /// a core while it polls, so the budget should count cores that nothing else needs.
    /// `None` chooses from the machine once the mesh is connected ([`auto_poll_readers`]).
    pub poll_readers: Option<usize>,
    /// How long after its last bytes a reader busy-polls (when the budget allows and no worker
    /// of the node polls itself) before it sleeps.
    pub poll_window: Duration,
}

impl Default for MeshConfig {
    fn default() -> Self {
        MeshConfig {
            max_frame: 1 << 30,
            heartbeat: Duration::from_millis(500),
            peer_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(30),
            send_queue_limit: 256 << 20,
            fail_sends_after: None,
            stop_reading_after: None,
            membership: crate::Membership::default(),
            poll_readers: None,
            poll_window: Duration::from_micros(100),
        }
    }
}

/// A one-sided write whose target asked for an immediate value to be delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LandedWrite {
    /// The immediate value given by the writer.
    pub imm: u32,
    /// Region written.
    pub region: RegionId,
    /// First byte written.
    pub offset: u64,
    /// Number of bytes written.
    pub len: usize,
}

/// Receives what arrives on the mesh. Called from the reader threads, one per peer, and from
/// threads polling through [`Mesh::poll_receive`]; calls for one peer never overlap and come in
/// the order the peer sent the frames.
pub trait Handler: Send + Sync + 'static {
    /// A two-sided message arrived (a shared slice of the received bytes: keeping it costs no
    /// copy).
    fn on_message(&self, from: usize, payload: Bytes);
    /// One-sided writes with immediates landed (their bytes are already in place).
    fn on_writes_landed(&self, from: usize, writes: &[LandedWrite]);
    /// A one-sided write sent by this node was refused by its target.
    fn on_write_error(&self, peer: usize, wr_id: u64, error: AccessError);
    /// A one-sided read issued by this node finished (its bytes are in place when `Ok`).
    fn on_read_complete(&self, peer: usize, wr_id: u64, result: Result<(), AccessError>);
    /// The connection to `peer` closed: cleanly after a goodbye (`None`) or through a failure.
    fn on_peer_closed(&self, peer: usize, error: Option<&TransportError>);
    /// A node joining in `peer`'s rank connected, after the old connection's end was reported
    /// (see [`crate::join_running`]). Called before anything it sends is delivered.
    fn on_peer_connected(&self, peer: usize) {
        let _ = peer;
    }
}

/// Traffic counters of a mesh.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeshStats {
    /// Bytes handed to the operating system for sending (headers included).
    pub bytes_sent: u64,
    /// Bytes read from sockets.
    pub bytes_received: u64,
    /// Frames queued for sending.
    pub frames_sent: u64,
}

struct PendingRead {
    region: RegionId,
    offset: u64,
    len: usize,
}

pub(crate) struct Peer {
    pub(crate) id: usize,
    pub(crate) stream: TcpStream,
    /// The receiving side, taken by whichever thread reads (see [`crate::receive`]).
    pub(crate) receiving: Mutex<crate::receive::Receiving>,
    out: Mutex<OutQueue>,
    writer_wake: Condvar,
    pub(crate) alive: AtomicBool,
    pub(crate) goodbye_received: AtomicBool,
    last_sent_ns: AtomicU64,
    /// Bytes queued and not yet taken by the socket.
    queued: AtomicU64,
    /// When the queue last drained some bytes, or became non-empty.
    drained_ns: AtomicU64,
    /// Bytes of this connection's stream that the socket took (heartbeats included).
    written: AtomicU64,
    /// Bytes of the peer's stream that this node has read.
    pub(crate) read: AtomicU64,
    /// When this node last read bytes of the peer's stream.
    pub(crate) read_ns: AtomicU64,
    /// How many of `written` the peer says it has read (its heartbeats carry it).
    acked: AtomicU64,
    /// When `acked` last advanced, or when bytes came to be outstanding.
    acked_ns: AtomicU64,
    /// `read` as last reported to the peer.
    reported: AtomicU64,
    /// When this node last sent the peer a heartbeat.
    heartbeat_ns: AtomicU64,
    pending_reads: Mutex<HashMap<u64, PendingRead>>,
    /// Why a send failed; the reader thread reports it (see [`Inner::defer_loss`]).
    pub(crate) failure: Mutex<Option<TransportError>>,
    /// Fault injection: sends left before sending fails.
    sends_before_failure: Option<AtomicU64>,
    /// Whether the handler was told that this connection closed: only then may a node that
    /// joins in the peer's rank take the slot (see [`crate::joining`]).
    pub(crate) closure_reported: AtomicBool,
}

impl Peer {
    /// A connection to node `id` over `stream`, configured for the mesh: no delay, the reader's
    /// and writer's tick as timeouts, large buffers.
    pub(crate) fn new(id: usize, stream: TcpStream, config: &MeshConfig) -> Result<Peer, TransportError> {
        let tick = POLL_TICK.min(config.heartbeat);
        stream.set_nodelay(true).map_err(crate::error::io_err("setting TCP_NODELAY"))?;
        stream.set_read_timeout(Some(tick)).map_err(crate::error::io_err("setting a read timeout"))?;
        stream.set_write_timeout(Some(tick)).map_err(crate::error::io_err("setting a write timeout"))?;
        let sock = socket2::SockRef::from(&stream);
        // Larger buffers keep bulk transfers streaming; failure only costs throughput.
        let _ = sock.set_send_buffer_size(4 << 20);
        let _ = sock.set_recv_buffer_size(4 << 20);
        Ok(Peer {
            id,
            stream,
            receiving: Mutex::default(),
            out: Mutex::new(OutQueue::default()),
            writer_wake: Condvar::new(),
            alive: AtomicBool::new(true),
            goodbye_received: AtomicBool::new(false),
            last_sent_ns: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            drained_ns: AtomicU64::new(0),
            written: AtomicU64::new(0),
            read: AtomicU64::new(0),
            read_ns: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            acked_ns: AtomicU64::new(0),
            reported: AtomicU64::new(0),
            heartbeat_ns: AtomicU64::new(0),
            pending_reads: Mutex::new(HashMap::new()),
            failure: Mutex::new(None),
            sends_before_failure: config.fail_sends_after.filter(|(peer, _)| *peer == id).map(|(_, n)| AtomicU64::new(n)),
            closure_reported: AtomicBool::new(false),
        })
    }
}

pub(crate) struct Inner {
    pub(crate) rank: usize,
    pub(crate) nodes: usize,
    pub(crate) config: MeshConfig,
    /// The connection to every peer (`None` at this node's rank, and for a node that was gone
    /// when this one joined). A slot changes only when a node joins in a lost peer's rank.
    peers: Vec<RwLock<Option<Arc<Peer>>>>,
    /// Where nodes that join after set-up knock (see [`crate::joining`]).
    pub(crate) door: crate::joining::Door,
    regions: Regions,
    handler: Mutex<Option<Arc<dyn Handler>>>,
    started: AtomicBool,
    pub(crate) stopping: AtomicBool,
    writers_exit: AtomicBool,
    /// Threads polling their connections for answers (see [`Mesh::start_polling`]).
    pub(crate) polling_workers: AtomicUsize,
    /// Reader threads busy-polling now (at most `poll_readers`).
    pub(crate) spinning_readers: AtomicUsize,
    /// Reader threads that may busy-poll at once ([`MeshConfig::poll_readers`], resolved).
    pub(crate) poll_readers: usize,
    /// Nodes of the mesh on this host, this one included.
    nodes_on_host: usize,
    threads: Mutex<Vec<JoinHandle<()>>>,
    epoch: Instant,
    bytes_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    frames_sent: AtomicU64,
}

/// The cores this process may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Reader threads that may busy-poll per node when the configuration leaves it to the machine:
/// one when each of the `nodes_on_host` nodes sharing the host's `cores` has at least four
/// (one to poll, the rest for its workers and its other threads), none otherwise. A poller on
/// a host without spare cores takes them from the trainers: on 2 cores shared by 2 nodes one
/// reader each made matrix factorisation's epochs 1.7× longer.
pub fn auto_poll_readers(cores: usize, nodes_on_host: usize) -> usize {
    usize::from(cores >= 4 * nodes_on_host.max(1))
}

/// Whether the peer at the other end of `stream` runs on this host (the same address at both
/// ends, or loopback).
fn on_this_host(stream: &TcpStream) -> bool {
    match (stream.local_addr(), stream.peer_addr()) {
        (Ok(local), Ok(peer)) => local.ip() == peer.ip() || peer.ip().is_loopback(),
        _ => false,
    }
}

/// A mesh of connections; dropping it shuts it down (see [`Mesh::shutdown`]).
pub struct Mesh {
    pub(crate) inner: Arc<Inner>,
}

/// A peer's send queue may grow to this many times [`MeshConfig::send_queue_limit`] (frames
/// queued by threads that do not wait for room: answers, one-sided reads' data, heartbeats)
/// before the peer is declared lost.
pub const SEND_QUEUE_HARD_FACTOR: u64 = 4;
const SEND_FLAGS_NONBLOCKING: i32 = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
const SEND_FLAGS_BLOCKING: i32 = libc::MSG_NOSIGNAL;
pub(crate) const POLL_TICK: Duration = Duration::from_millis(100);

impl Mesh {
    /// Wraps connected streams (`streams[p]` for every peer `p`, `None` at this node's rank).
    pub(crate) fn from_streams(rank: usize, nodes: usize, streams: Vec<Option<TcpStream>>, config: MeshConfig) -> Result<Mesh, TransportError> {
        let epoch = Instant::now();
        let mut peers = Vec::with_capacity(nodes);
        for (id, stream) in streams.into_iter().enumerate() {
            peers.push(match stream {
                Some(stream) => Some(Arc::new(Peer::new(id, stream, &config)?)),
                None => None,
            });
        }
        let on_host = 1 + peers.iter().flatten().filter(|p| on_this_host(&p.stream)).count();
        let peers = peers.into_iter().map(RwLock::new).collect();
        let poll_readers = config.poll_readers.unwrap_or_else(|| auto_poll_readers(cores(), on_host));
        Ok(Mesh {
            inner: Arc::new(Inner {
                poll_readers,
                nodes_on_host: on_host,
                rank,
                nodes,
                config,
                peers,
                door: Default::default(),
                regions: Regions::default(),
                handler: Mutex::new(None),
                started: AtomicBool::new(false),
                stopping: AtomicBool::new(false),
                writers_exit: AtomicBool::new(false),
                polling_workers: AtomicUsize::new(0),
                spinning_readers: AtomicUsize::new(0),
                threads: Mutex::new(Vec::new()),
                epoch,
                bytes_sent: AtomicU64::new(0),
                bytes_received: AtomicU64::new(0),
                frames_sent: AtomicU64::new(0),
            }),
        })
    }

    /// This node's rank.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of nodes in the cluster.
    pub fn nodes(&self) -> usize {
        self.inner.nodes
    }

    /// The mesh's limits.
    pub fn config(&self) -> &MeshConfig {
        &self.inner.config
    }

    /// Starts the reader, writer and heartbeat threads; frames received before this call wait
    /// in the kernel. Calling it twice is an error.
    pub fn start(&self, handler: Arc<dyn Handler>) -> Result<(), TransportError> {
        if self.inner.started.swap(true, Ordering::SeqCst) {
            return Err(TransportError::Setup("mesh already started".into()));
        }
        *self.inner.handler.lock() = Some(handler);
        let mut threads = self.inner.threads.lock();
        for peer in self.inner.peers_now() {
            threads.extend(self.inner.spawn_connection_threads(&peer)?);
        }
        let inner = self.inner.clone();
        threads.push(spawn(format!("ferry{}-hb", self.inner.rank), move || inner.run_heartbeat())?);
        if self.inner.door.is_open() {
            let inner = self.inner.clone();
            threads.push(spawn(format!("ferry{}-door", self.inner.rank), move || crate::joining::run_door(&inner))?);
        }
        Ok(())
    }

    /// Queues a two-sided message and tries to send it at once.
    pub fn send(&self, peer: usize, payload: Vec<u8>) -> Result<(), TransportError> {
        self.enqueue(peer, payload)?;
        self.flush(peer);
        Ok(())
    }

    /// Queues a two-sided message without sending it; [`Mesh::flush`] sends what is queued.
    /// Messages to one peer leave in the order they were queued.
    pub fn enqueue(&self, peer: usize, payload: Vec<u8>) -> Result<(), TransportError> {
        let len = u32::try_from(payload.len()).ok().filter(|&l| l as usize <= self.inner.config.max_frame).ok_or_else(|| TransportError::Malformed {
            peer: self.inner.rank,
            reason: format!("message of {} bytes exceeds the frame limit", payload.len()),
        })?;
        let head = Header { kind: FrameKind::Message, flags: 0, len }.encode();
        self.inner.push_frame(peer, OutFrame::new(&head, payload))
    }

    /// Sends whatever is queued for `peer` that the socket takes without blocking and leaves
    /// the rest to the connection's writer thread.
    pub fn flush(&self, peer: usize) {
        if let Some(p) = self.inner.slot(peer) {
            self.inner.flush_peer(&p);
        }
    }

    /// Reader threads that may busy-poll at once (the configured budget, or the machine's
    /// choice; see [`auto_poll_readers`]).
    pub fn poll_readers(&self) -> usize {
        self.inner.poll_readers
    }

    /// Nodes of this mesh running on this host, this one included (the peers reached over
    /// loopback or at this node's own address).
    pub fn nodes_on_host(&self) -> usize {
        self.inner.nodes_on_host
    }

    /// Counts the caller as a thread polling for its answers ([`Mesh::poll_receive`]) until
    /// its [`Mesh::stop_polling`]: reader threads do not busy-poll meanwhile, so that the
    /// poller keeps its core.
    pub fn start_polling(&self) {
        self.inner.start_polling();
    }

    /// Ends a [`Mesh::start_polling`].
    pub fn stop_polling(&self) {
        self.inner.stop_polling();
    }

    /// Reads, without blocking, what the connections hold and hands the frames to the handler
    /// on the calling thread, as their reader threads would (a connection another thread is
    /// reading is skipped); whether any bytes came. A thread waiting for an answer calls it to
    /// take the answer itself instead of waiting for a reader thread to wake.
    pub fn poll_receive(&self) -> bool {
        let mut any = false;
        self.inner.each_peer(|p| any |= self.inner.poll_peer(p));
        any
    }

    /// Bytes queued for `peer` and not yet taken by its socket.
    pub fn queued_bytes(&self, peer: usize) -> u64 {
        self.inner.slot(peer).map_or(0, |p| p.queued.load(Ordering::Relaxed))
    }

    /// Waits until the send queue of every live peer is below
    /// [`MeshConfig::send_queue_limit`] (backpressure for a submitter that would add to them),
    /// at most for `timeout`. Returns at once in the common case. A peer that does not drain
    /// is declared lost after the liveness timeout, which ends the wait for it.
    pub fn wait_for_room(&self, timeout: Duration) -> Result<(), TransportError> {
        let limit = self.inner.config.send_queue_limit as u64;
        wait_for_room(limit, timeout, || {
            let mut full = None;
            self.inner.each_peer(|p| {
                let queued = p.queued.load(Ordering::Relaxed);
                if full.is_none() && p.alive.load(Ordering::Acquire) && queued >= limit {
                    full = Some((p.id, queued));
                }
            });
            full
        })
    }

    /// Registers memory for one-sided access by peers; see [`Regions::register`].
    ///
    /// # Safety
    ///
    /// `base..base+len` must stay valid for reads and writes until [`Mesh::deregister`] returns
    /// for the returned id, and the owner must tolerate peers writing into it concurrently.
    pub unsafe fn register(&self, base: *mut u8, len: usize) -> RegionId {
        // SAFETY: the caller upholds the contract documented above.
        unsafe { self.inner.regions.register(base, len) }
    }

    /// Registers memory for peers' one-sided reads only; see [`Regions::register_read_only`].
    ///
    /// # Safety
    ///
    /// `base..base+len` must stay valid for reads until [`Mesh::deregister`] returns for the
    /// returned id.
    pub unsafe fn register_read_only(&self, base: *mut u8, len: usize) -> RegionId {
        // SAFETY: the caller upholds the contract documented above.
        unsafe { self.inner.regions.register_read_only(base, len) }
    }

    /// Removes a region; no access to it runs after this returns.
    pub fn deregister(&self, region: RegionId) -> bool {
        self.inner.regions.deregister(region)
    }

    /// Writes `data` into `peer`'s region at `offset`; with `imm`, the peer's handler is told
    /// through [`Handler::on_writes_landed`] once the bytes are in place. The data is copied
    /// before this returns, so the source may be reused at once.
    pub fn write(&self, peer: usize, region: RegionId, offset: u64, data: &[u8], imm: Option<u32>, wr_id: u64) -> Result<(), TransportError> {
        let mut batch = self.write_batch();
        batch.push(region, offset, data, imm, wr_id)?;
        batch.submit(peer)
    }

    /// Starts a batch of one-sided writes to one peer, encoded into a single buffer.
    pub fn write_batch(&self) -> WriteBatch<'_> {
        WriteBatch { mesh: self, bytes: Vec::new() }
    }

    /// Reads `len` bytes at `offset` of `peer`'s region `region` into this node's region
    /// `local_region` at `local_offset`; completion is reported through
    /// [`Handler::on_read_complete`] with `wr_id`.
    #[allow(clippy::too_many_arguments)]
    pub fn read(
        &self,
        peer: usize,
        region: RegionId,
        offset: u64,
        len: usize,
        local_region: RegionId,
        local_offset: u64,
        wr_id: u64,
    ) -> Result<(), TransportError> {
        self.inner.regions.resolve(local_region, local_offset, len, false).map_err(TransportError::Access)?;
        let len32 = u32::try_from(len).map_err(|_| TransportError::Access(AccessError::OutOfBounds { region, offset, len: len as u64, region_len: 0 }))?;
        let p = self.inner.peer(peer)?;
        {
            let mut pending = p.pending_reads.lock();
            if pending.insert(wr_id, PendingRead { region: local_region, offset: local_offset, len }).is_some() {
                return Err(TransportError::Setup(format!("read id {wr_id} is already in flight")));
            }
        }
        let mut head = [0u8; HEADER_LEN + frame::READ_REQUEST_LEN];
        head[..HEADER_LEN].copy_from_slice(&Header { kind: FrameKind::ReadRequest, flags: 0, len: frame::READ_REQUEST_LEN as u32 }.encode());
        head[8..16].copy_from_slice(&wr_id.to_le_bytes());
        head[16..20].copy_from_slice(&region.to_le_bytes());
        head[20..24].copy_from_slice(&len32.to_le_bytes());
        head[24..32].copy_from_slice(&offset.to_le_bytes());
        if let Err(e) = self.inner.push_frame(peer, OutFrame::new(&head, Vec::new())) {
            p.pending_reads.lock().remove(&wr_id);
            return Err(e);
        }
        self.inner.flush_peer(&p);
        Ok(())
    }

    /// Closes the connection to `peer` (after it broke the protocol above the transport, or
    /// another node reported it lost); the handler is told, from the connection's reader
    /// thread, as for any lost peer ([`TransportError::Disconnected`]).
    pub fn disconnect(&self, peer: usize) {
        if let Some(p) = self.inner.slot(peer) {
            self.inner.defer_loss(&p, TransportError::Disconnected(peer));
        }
    }

    /// Whether the connection to `peer` is open.
    pub fn is_alive(&self, peer: usize) -> bool {
        self.inner.slot(peer).is_some_and(|p| p.alive.load(Ordering::Acquire))
    }

    /// Traffic counters.
    pub fn stats(&self) -> MeshStats {
        MeshStats {
            bytes_sent: self.inner.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.inner.bytes_received.load(Ordering::Relaxed),
            frames_sent: self.inner.frames_sent.load(Ordering::Relaxed),
        }
    }

    /// Closes every connection cleanly: says goodbye, lets the writers drain, waits for the
    /// peers' goodbyes (bounded by the liveness timeout) and joins every thread.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }

    /// Closes every connection at once, without goodbyes, as a crash would (peers see the node
    /// as lost), and joins the mesh's threads. For fault injection and fatal errors.
    pub fn abort(&self) {
        self.inner.abort();
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Threads hold their own references to `Inner`, so this runs only after they have
        // finished; closing sockets here releases them for a mesh that never started.
        for peer in self.peers_now() {
            let _ = peer.stream.shutdown(Shutdown::Both);
        }
    }
}

/// Waits until `full` finds no peer whose send queue holds `limit` bytes or more, polling with a
/// growing pause, at most for `timeout` (then the error names the peer `full` last found, as
/// `(peer, bytes queued)`). Shared by every fabric's backpressure. Every access of a worker
/// passes here, so the common case — room — reads no clock.
pub fn wait_for_room(limit: u64, timeout: Duration, full: impl Fn() -> Option<(usize, u64)>) -> Result<(), TransportError> {
    let Some(mut found) = full() else { return Ok(()) };
    let started = Instant::now();
    let deadline = started + timeout;
    let mut pause = Duration::from_micros(50);
    loop {
        let now = Instant::now();
        if now >= deadline {
            let (peer, queued) = found;
            return Err(TransportError::SendQueueFull { peer, queued, limit, millis: started.elapsed().as_millis() });
        }
        std::thread::sleep(pause.min(deadline.saturating_duration_since(now)));
        pause = (pause * 2).min(Duration::from_millis(5));
        match full() {
            None => return Ok(()),
            Some(f) => found = f,
        }
    }
}

/// One-sided writes to one peer gathered into a single buffer (one syscall for many writes).
pub struct WriteBatch<'m> {
    mesh: &'m Mesh,
    bytes: Vec<u8>,
}

impl WriteBatch<'_> {
    /// Adds a write of `data` to `region` at `offset`; `imm` as in [`Mesh::write`]. A write
    /// larger than the frame limit is refused.
    pub fn push(&mut self, region: RegionId, offset: u64, data: &[u8], imm: Option<u32>, wr_id: u64) -> Result<(), TransportError> {
        let len = frame::WRITE_HEADER + data.len();
        if len > self.mesh.inner.config.max_frame {
            return Err(TransportError::Malformed {
                peer: self.mesh.inner.rank,
                reason: format!("a one-sided write of {} bytes exceeds the frame limit", data.len()),
            });
        }
        let flags = if imm.is_some() { FLAG_IMM } else { 0 };
        self.bytes.reserve(HEADER_LEN + len);
        self.bytes.extend_from_slice(&Header { kind: FrameKind::Write, flags, len: len as u32 }.encode());
        self.bytes.extend_from_slice(&region.to_le_bytes());
        self.bytes.extend_from_slice(&imm.unwrap_or(0).to_le_bytes());
        self.bytes.extend_from_slice(&offset.to_le_bytes());
        self.bytes.extend_from_slice(&wr_id.to_le_bytes());
        self.bytes.extend_from_slice(data);
        Ok(())
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Queues the batch for `peer` and tries to send it at once.
    pub fn submit(self, peer: usize) -> Result<(), TransportError> {
        let mesh = self.mesh;
        self.enqueue(peer)?;
        mesh.flush(peer);
        Ok(())
    }

    /// Queues the batch for `peer` without sending it; [`Mesh::flush`] sends it. The data was
    /// copied when the writes were added, so their sources may be reused already.
    pub fn enqueue(self, peer: usize) -> Result<(), TransportError> {
        if self.bytes.is_empty() {
            return Ok(());
        }
        self.mesh.inner.push_frame(peer, OutFrame::raw(self.bytes))
    }
}

fn spawn(name: String, body: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, TransportError> {
    std::thread::Builder::new().name(name).spawn(body).map_err(crate::error::io_err("spawning a transport thread"))
}

impl Inner {
    pub(crate) fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn peer(&self, peer: usize) -> Result<Arc<Peer>, TransportError> {
        self.slot(peer).ok_or(TransportError::NoSuchPeer(peer))
    }

    /// The connection to `peer`, if there is one.
    pub(crate) fn slot(&self, peer: usize) -> Option<Arc<Peer>> {
        self.peers.get(peer).and_then(|slot| slot.read().clone())
    }

    /// Every connection now.
    pub(crate) fn peers_now(&self) -> Vec<Arc<Peer>> {
        self.peers.iter().filter_map(|slot| slot.read().clone()).collect()
    }

    /// Calls `f` with every connection, each outside its slot's lock.
    pub(crate) fn each_peer(&self, mut f: impl FnMut(&Arc<Peer>)) {
        for slot in &self.peers {
            let peer = slot.read().clone();
            if let Some(p) = peer {
                f(&p);
            }
        }
    }

    /// Starts `peer`'s reader and writer threads.
    pub(crate) fn spawn_connection_threads(self: &Arc<Self>, peer: &Arc<Peer>) -> Result<[JoinHandle<()>; 2], TransportError> {
        let (inner, p) = (self.clone(), peer.clone());
        let reader = spawn(format!("ferry{}-rd{}", self.rank, peer.id), move || inner.run_reader(&p))?;
        let (inner, p) = (self.clone(), peer.clone());
        let writer = spawn(format!("ferry{}-wr{}", self.rank, peer.id), move || inner.run_writer(&p))?;
        Ok([reader, writer])
    }

    /// Puts `peer`, the connection of a node that joins in its rank, in the slot of a
    /// connection whose closure the handler was told of (or that never existed), then lets
    /// `greet` finish the set-up exchange on the raw stream and starts the connection's threads.
    /// The slot is taken before the greeting — the joining node acts once greeted, and what this
    /// node sends it from then on must go over the new connection — but frames queued meanwhile
    /// wait (the queue counts as being flushed) until the greeting is out. Refused (`false`)
    /// while the old connection's end is not reported, or after the mesh began to stop.
    pub(crate) fn install_peer(self: &Arc<Self>, peer: Arc<Peer>, greet: impl FnOnce() -> io::Result<()>) -> Result<bool, TransportError> {
        let Some(slot) = self.peers.get(peer.id).filter(|_| peer.id != self.rank) else { return Ok(false) };
        {
            let _threads = self.threads.lock();
            if self.stopping.load(Ordering::Acquire) {
                return Ok(false);
            }
            let mut slot = slot.write();
            if slot.as_ref().is_some_and(|old| !old.closure_reported.load(Ordering::Acquire)) {
                return Ok(false);
            }
            peer.out.lock().flushing = true;
            *slot = Some(peer.clone());
        }
        if let Some(h) = self.handler() {
            h.on_peer_connected(peer.id);
        }
        let greeted = greet();
        let mut threads = self.threads.lock();
        peer.out.lock().flushing = false;
        if let Err(e) = greeted {
            // The reader thread sees the connection end and reports the loss.
            self.defer_loss(&peer, TransportError::Io { context: format!("greeting node {} as it joins", peer.id), source: e });
        }
        threads.extend(self.spawn_connection_threads(&peer)?);
        drop(threads);
        self.flush_peer(&peer);
        Ok(true)
    }

    pub(crate) fn handler(&self) -> Option<Arc<dyn Handler>> {
        self.handler.lock().clone()
    }

    fn push_frame(&self, peer: usize, frame: OutFrame) -> Result<(), TransportError> {
        let p = self.peer(peer)?;
        let len = frame.len() as u64;
        let queued = p.queued.load(Ordering::Relaxed);
        let hard = (self.config.send_queue_limit as u64).saturating_mul(SEND_QUEUE_HARD_FACTOR);
        if queued > 0 && queued.saturating_add(len) > hard {
            let reason = format!("{queued} bytes wait in its send queue, and {len} more would pass the limit of {hard}");
            self.defer_loss(&p, TransportError::PeerNotReading { peer, reason });
            return Err(TransportError::PeerGone(peer));
        }
        if self.enqueue(&p, frame, false) { Ok(()) } else { Err(TransportError::PeerGone(peer)) }
    }

    /// Queues `frame` for `p` behind every queued frame, or `ahead` of them (right after the one
    /// being written: a heartbeat), and counts it; `false` when the connection is closed.
    fn enqueue(&self, p: &Peer, frame: OutFrame, ahead: bool) -> bool {
        let len = frame.len() as u64;
        {
            let mut out = p.out.lock();
            if out.closed || !p.alive.load(Ordering::Acquire) {
                return false;
            }
            if ahead {
                let at = usize::from(out.front_written > 0).min(out.frames.len());
                out.frames.insert(at, frame);
            } else {
                out.frames.push_back(frame);
            }
            if p.queued.fetch_add(len, Ordering::Relaxed) == 0 {
                p.drained_ns.store(self.now_ns(), Ordering::Relaxed);
            }
        }
        p.last_sent_ns.store(self.now_ns(), Ordering::Relaxed);
        self.bytes_sent.fetch_add(len, Ordering::Relaxed);
        self.frames_sent.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Sends what is queued for `p` that the socket takes without blocking, outside the queue's
    /// lock: the first thread to find frames becomes the sender (others only queue and leave),
    /// writes until the queue is empty, and hands what the socket would not take to the
    /// connection's writer thread.
    fn flush_peer(&self, p: &Arc<Peer>) {
        let mut out = p.out.lock();
        if out.flushing || out.frames.is_empty() || out.closed {
            return;
        }
        out.flushing = true;
        loop {
            let mut batch = std::mem::take(&mut out.frames);
            let mut written = std::mem::take(&mut out.front_written);
            drop(out);
            let injected =
                p.sends_before_failure.as_ref().is_some_and(|left| left.fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| l.checked_sub(1)).is_err());
            crate::stage_trace::mark(crate::stage_trace::Point::Sending);
            let result = if injected {
                Err(io::Error::other(format!("sending to node {} failed (injected fault)", p.id)))
            } else {
                write_frames(&p.stream, &mut batch, &mut written, SEND_FLAGS_NONBLOCKING, &mut |n| self.drained(p, n))
            };
            out = p.out.lock();
            match result {
                Ok(true) if !out.frames.is_empty() && !out.closed => continue,
                Ok(true) => {
                    out.flushing = false;
                    // Only a shutdown waits for the queue to drain; waking the idle writer
                    // thread on every send would cost two context switches per message.
                    if self.stopping.load(Ordering::Acquire) {
                        p.writer_wake.notify_all();
                    }
                    return;
                }
                Ok(false) => {
                    // The socket is full: the rest, ahead of anything queued meanwhile, goes to
                    // the writer thread (which clears `flushing` when the queue is empty).
                    batch.append(&mut out.frames);
                    out.frames = batch;
                    out.front_written = written;
                    out.writer_busy = true;
                    p.writer_wake.notify_all();
                    return;
                }
                Err(e) => {
                    out.flushing = false;
                    drop(out);
                    self.defer_loss(p, TransportError::Io { context: format!("writing to node {}", p.id), source: e });
                    return;
                }
            }
        }
    }

    /// A send to `p` failed (or the node gave up on it): stop sending and close the socket, and
    /// let the reader thread, which then sees the connection end, tell the handler. Senders may
    /// hold their own locks (the node's protocol lock, for one), so the handler is never called
    /// from a send path.
    pub(crate) fn defer_loss(&self, p: &Peer, error: TransportError) {
        p.failure.lock().get_or_insert(error);
        {
            let mut out = p.out.lock();
            out.closed = true;
            out.frames.clear();
            p.writer_wake.notify_all();
        }
        let _ = p.stream.shutdown(Shutdown::Both);
        if !self.started.load(Ordering::Acquire) {
            p.alive.store(false, Ordering::Release);
        }
    }

    /// Declares `p` lost: closes the connection, fails its pending reads and tells the handler.
    pub(crate) fn lose_peer(&self, p: &Peer, error: TransportError) {
        if !p.alive.swap(false, Ordering::AcqRel) {
            return;
        }
        {
            let mut out = p.out.lock();
            out.closed = true;
            out.frames.clear();
            p.writer_wake.notify_all();
        }
        let _ = p.stream.shutdown(Shutdown::Both);
        let failed: Vec<u64> = p.pending_reads.lock().drain().map(|(id, _)| id).collect();
        if matches!(error, TransportError::Disconnected(_)) {
            // This node closed it on purpose (a peer that left, or that others lost).
            tracing::info!(node = self.rank, peer = p.id, %error, "connection closed");
        } else if !self.stopping.load(Ordering::Acquire) {
            tracing::warn!(node = self.rank, peer = p.id, %error, "connection lost");
        }
        if let Some(h) = self.handler() {
            for id in failed {
                h.on_read_complete(p.id, id, Err(AccessError::ConnectionLost));
            }
            h.on_peer_closed(p.id, Some(&error));
        }
        p.closure_reported.store(true, Ordering::Release);
    }

    /// The peer said goodbye and closed its side: answer with our goodbye (if the socket takes
    /// it at once) and close ours, so that its shutdown need not wait.
    pub(crate) fn close_peer_cleanly(&self, p: &Arc<Peer>) {
        if !p.alive.swap(false, Ordering::AcqRel) {
            return;
        }
        {
            let mut out = p.out.lock();
            if !out.closed {
                let head = Header { kind: FrameKind::Goodbye, flags: 0, len: 0 }.encode();
                let frame = OutFrame::new(&head, Vec::new());
                // Counted like every queued frame: the writer subtracts what the socket takes.
                p.queued.fetch_add(frame.len() as u64, Ordering::Relaxed);
                out.frames.push_back(frame);
            }
        }
        self.flush_peer(p);
        {
            let mut out = p.out.lock();
            out.closed = true;
            out.frames.clear();
            p.writer_wake.notify_all();
        }
        let _ = p.stream.shutdown(Shutdown::Both);
        let failed: Vec<u64> = p.pending_reads.lock().drain().map(|(id, _)| id).collect();
        if let Some(h) = self.handler() {
            for id in failed {
                h.on_read_complete(p.id, id, Err(AccessError::ConnectionLost));
            }
            h.on_peer_closed(p.id, None);
        }
        p.closure_reported.store(true, Ordering::Release);
    }

    fn run_writer(&self, p: &Arc<Peer>) {
        loop {
            let mut batch;
            let mut front_written;
            {
                let mut out = p.out.lock();
                while !out.writer_busy && !out.closed {
                    if self.writers_exit.load(Ordering::Acquire) {
                        return;
                    }
                    p.writer_wake.wait_for(&mut out, POLL_TICK);
                }
                if out.closed {
                    return;
                }
                batch = std::mem::take(&mut out.frames);
                front_written = std::mem::take(&mut out.front_written);
            }
            loop {
                match write_frames(&p.stream, &mut batch, &mut front_written, SEND_FLAGS_BLOCKING, &mut |n| self.drained(p, n)) {
                    Ok(true) => break,
                    Ok(false) => {
                        if !p.alive.load(Ordering::Acquire) || self.writers_exit.load(Ordering::Acquire) {
                            return;
                        }
                    }
                    Err(e) => {
                        self.defer_loss(p, TransportError::Io { context: format!("writing to node {}", p.id), source: e });
                        return;
                    }
                }
            }
            let mut out = p.out.lock();
            if out.frames.is_empty() {
                out.writer_busy = false;
                out.flushing = false;
                p.writer_wake.notify_all();
            }
        }
    }

    /// The socket took `bytes` of `p`'s queue.
    fn drained(&self, p: &Peer, bytes: usize) {
        // Never below zero, whatever a path forgot to count: the counter gates senders.
        let _ = p.queued.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| Some(q.saturating_sub(bytes as u64)));
        let now = self.now_ns();
        p.drained_ns.store(now, Ordering::Relaxed);
        if p.written.fetch_add(bytes as u64, Ordering::Relaxed) <= p.acked.load(Ordering::Relaxed) {
            // Nothing was outstanding: the peer's time to read these starts now.
            p.acked_ns.store(now, Ordering::Relaxed);
        }
    }

    /// The peer says (in a heartbeat) it has read `read` bytes of what this node sent.
    fn peer_read(&self, p: &Peer, read: u64) {
        if p.acked.fetch_max(read, Ordering::Relaxed) < read {
            p.acked_ns.store(self.now_ns(), Ordering::Relaxed);
        }
    }

    /// Why `p` counts as not reading, if it does: bytes it was sent are outstanding, and its
    /// heartbeats have not acknowledged reading any more of them for the liveness timeout,
    /// however little traffic that is (the kernels' buffers absorb light traffic, so a send
    /// queue that drains says nothing of whether the peer reads).
    ///
    /// Only while this node hears from the peer: a node that has stopped reading itself sees no
    /// acknowledgements either, and must not blame the peer for it (the peer finds it instead).
    fn not_reading(&self, p: &Peer, now: u64) -> Option<String> {
        let (written, acked) = (p.written.load(Ordering::Relaxed), p.acked.load(Ordering::Relaxed));
        let waited = now.saturating_sub(p.acked_ns.load(Ordering::Relaxed));
        let timeout = self.config.peer_timeout.as_nanos() as u64;
        let hearing = now.saturating_sub(p.read_ns.load(Ordering::Relaxed)) < timeout / 2;
        (written > acked && waited > timeout && hearing)
            .then(|| format!("it has read {acked} of the {written} bytes sent to it and no more for {} ms, though it is connected", waited / 1_000_000))
    }

    /// Queues a heartbeat carrying how much of `p`'s stream this node has read, ahead of the
    /// frames queued (not inside a frame half written): the peer learns it even while a long
    /// queue drains.
    fn send_heartbeat(&self, p: &Arc<Peer>) {
        let read = p.read.load(Ordering::Relaxed);
        let head = Header { kind: FrameKind::Heartbeat, flags: 0, len: frame::HEARTBEAT_LEN as u32 }.encode();
        let frame = OutFrame::new(&head, read.to_le_bytes().to_vec());
        if self.enqueue(p, frame, true) {
            p.reported.store(read, Ordering::Relaxed);
            self.flush_peer(p);
        }
    }

    /// Sends heartbeats on idle connections and, once per heartbeat period, wherever this node
    /// has read more of the peer's stream than it last told it; declares lost a peer whose send
    /// queue has not drained a byte for the liveness timeout, or that has not acknowledged
    /// reading more of what it was sent for as long (it is connected, maybe even heartbeating,
    /// but does not read).
    fn run_heartbeat(&self) {
        let beat = self.config.heartbeat;
        let tick = (beat / 2).max(Duration::from_millis(10));
        let timeout = self.config.peer_timeout.as_nanos() as u64;
        while !self.stopping.load(Ordering::Acquire) {
            std::thread::sleep(tick);
            let now = self.now_ns();
            for p in &self.peers_now() {
                let queued = p.queued.load(Ordering::Relaxed);
                let stuck = now.saturating_sub(p.drained_ns.load(Ordering::Relaxed));
                let unread = if queued > 0 && stuck > timeout {
                    Some(format!("{queued} bytes waited {} ms in its send queue and it took none", stuck / 1_000_000))
                } else {
                    self.not_reading(p, now)
                };
                if let Some(reason) = unread
                    && p.alive.load(Ordering::Acquire)
                    && !p.out.lock().closed
                {
                    tracing::warn!(node = self.rank, peer = p.id, %reason, "declaring a peer lost that does not read");
                    self.defer_loss(p, TransportError::PeerNotReading { peer: p.id, reason });
                    continue;
                }
                let idle = now.saturating_sub(p.last_sent_ns.load(Ordering::Relaxed)) >= beat.as_nanos() as u64;
                let news = p.read.load(Ordering::Relaxed) != p.reported.load(Ordering::Relaxed);
                if p.alive.load(Ordering::Acquire) && (idle || (news && now.saturating_sub(p.heartbeat_ns.load(Ordering::Relaxed)) >= beat.as_nanos() as u64)) {
                    p.heartbeat_ns.store(now, Ordering::Relaxed);
                    self.send_heartbeat(p);
                }
            }
        }
    }

    pub(crate) fn deliver_landed(&self, handler: &dyn Handler, from: usize, landed: &mut Vec<LandedWrite>) {
        if !landed.is_empty() {
            handler.on_writes_landed(from, landed);
            landed.clear();
        }
    }

    pub(crate) fn dispatch(
        &self,
        handler: &dyn Handler,
        p: &Arc<Peer>,
        header: Header,
        frame: Bytes,
        landed: &mut Vec<LandedWrite>,
    ) -> Result<(), TransportError> {
        let payload = &frame[..];
        match header.kind {
            FrameKind::Message => {
                self.deliver_landed(handler, p.id, landed);
                handler.on_message(p.id, frame.clone());
            }
            FrameKind::Write => {
                let region = frame::u32_at(payload, 0);
                let imm = frame::u32_at(payload, 4);
                let offset = frame::u64_at(payload, 8);
                let wr_id = frame::u64_at(payload, 16);
                let data = &payload[frame::WRITE_HEADER..];
                match self.regions.resolve(region, offset, data.len(), true) {
                    Ok(target) => {
                        // SAFETY: `resolve` checked that the range lies inside a registered
                        // region and holds the table's read lock, so the memory stays mapped for
                        // the copy. The region's owner reserved this range for the writer (its
                        // registration contract), and the frame buffer cannot overlap it.
                        unsafe { copy_into_region(data, target.ptr) };
                        if header.flags & FLAG_IMM != 0 {
                            landed.push(LandedWrite { imm, region, offset, len: data.len() });
                        }
                    }
                    Err(error) => {
                        tracing::warn!(node = self.rank, peer = p.id, %error, "refusing a one-sided write");
                        let mut head = [0u8; HEADER_LEN + frame::WRITE_ERROR_LEN];
                        head[..HEADER_LEN].copy_from_slice(&Header { kind: FrameKind::WriteError, flags: 0, len: frame::WRITE_ERROR_LEN as u32 }.encode());
                        head[8..16].copy_from_slice(&wr_id.to_le_bytes());
                        head[16..20].copy_from_slice(&error.code().to_le_bytes());
                        head[20..24].copy_from_slice(&region.to_le_bytes());
                        if self.push_frame(p.id, OutFrame::new(&head, Vec::new())).is_ok() {
                            self.flush_peer(p);
                        }
                    }
                }
            }
            FrameKind::ReadRequest => {
                let wr_id = frame::u64_at(payload, 0);
                let region = frame::u32_at(payload, 8);
                let len = frame::u32_at(payload, 12) as usize;
                let offset = frame::u64_at(payload, 16);
                let (status, body) = match self.regions.resolve(region, offset, len, false) {
                    Ok(source) => {
                        let mut body = vec![0u8; len];
                        // SAFETY: the range was checked by `resolve`, whose guard keeps it mapped.
                        // The bytes may be changing under a concurrent local writer: a one-sided
                        // read gives no atomicity across words, exactly as with RDMA, and readers
                        // validate what they read (slot versions).
                        unsafe { copy_from_region(source.ptr, &mut body) };
                        (0u32, body)
                    }
                    Err(error) => (error.code(), Vec::new()),
                };
                let mut head = [0u8; HEADER_LEN + frame::READ_RESPONSE_HEADER];
                let len = (frame::READ_RESPONSE_HEADER + body.len()) as u32;
                head[..HEADER_LEN].copy_from_slice(&Header { kind: FrameKind::ReadResponse, flags: 0, len }.encode());
                head[8..16].copy_from_slice(&wr_id.to_le_bytes());
                head[16..20].copy_from_slice(&status.to_le_bytes());
                head[20..24].copy_from_slice(&region.to_le_bytes());
                if self.push_frame(p.id, OutFrame::new(&head, body)).is_ok() {
                    self.flush_peer(p);
                }
            }
            FrameKind::ReadResponse => {
                let wr_id = frame::u64_at(payload, 0);
                let status = frame::u32_at(payload, 8);
                let region = frame::u32_at(payload, 12);
                let data = &payload[frame::READ_RESPONSE_HEADER..];
                let Some(pending) = p.pending_reads.lock().remove(&wr_id) else {
                    return Err(TransportError::Malformed { peer: p.id, reason: format!("answer to unknown read {wr_id}") });
                };
                let result = if status != 0 {
                    Err(AccessError::from_code(status, region))
                } else if data.len() != pending.len {
                    return Err(TransportError::Malformed {
                        peer: p.id,
                        reason: format!("read {wr_id} answered with {} bytes, not {}", data.len(), pending.len),
                    });
                } else {
                    match self.regions.resolve(pending.region, pending.offset, pending.len, false) {
                        Ok(target) => {
                            // SAFETY: checked and kept mapped by `resolve`; the reader named
                            // this range as the destination of its own read.
                            unsafe { copy_into_region(data, target.ptr) };
                            Ok(())
                        }
                        Err(e) => Err(e),
                    }
                };
                handler.on_read_complete(p.id, wr_id, result);
            }
            FrameKind::WriteError => {
                let wr_id = frame::u64_at(payload, 0);
                let code = frame::u32_at(payload, 8);
                let region = frame::u32_at(payload, 12);
                handler.on_write_error(p.id, wr_id, AccessError::from_code(code, region));
            }
            FrameKind::Heartbeat => self.peer_read(p, frame::u64_at(payload, 0)),
            FrameKind::Goodbye => {
                p.goodbye_received.store(true, Ordering::Release);
            }
        }
        Ok(())
    }

    fn abort(&self) {
        if self.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        self.door.wake();
        self.writers_exit.store(true, Ordering::Release);
        for p in &self.peers_now() {
            p.alive.store(false, Ordering::Release);
            p.out.lock().closed = true;
            p.writer_wake.notify_all();
            let _ = p.stream.shutdown(Shutdown::Both);
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            let _ = t.join();
        }
        self.door.close();
        *self.handler.lock() = None;
    }

    fn shutdown(&self) {
        if self.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        self.door.wake();
        let started = self.started.load(Ordering::Acquire);
        for p in &self.peers_now() {
            if !p.alive.load(Ordering::Acquire) {
                continue;
            }
            let head = Header { kind: FrameKind::Goodbye, flags: 0, len: 0 }.encode();
            if self.push_frame(p.id, OutFrame::new(&head, Vec::new())).is_ok() {
                if started {
                    self.flush_peer(p);
                } else {
                    // No other thread uses a mesh that never started: write it out directly.
                    let (mut frames, mut written) = {
                        let mut out = p.out.lock();
                        (std::mem::take(&mut out.frames), std::mem::take(&mut out.front_written))
                    };
                    let _ = write_frames(&p.stream, &mut frames, &mut written, SEND_FLAGS_BLOCKING, &mut |n| self.drained(p, n));
                }
            }
        }
        // Let the writers drain what is queued, then close our sending side.
        let deadline = Instant::now() + self.config.peer_timeout;
        for p in &self.peers_now() {
            let mut out = p.out.lock();
            while (out.flushing || !out.frames.is_empty()) && !out.closed && Instant::now() < deadline {
                if !out.flushing {
                    drop(out);
                    self.flush_peer(p);
                    out = p.out.lock();
                    continue;
                }
                p.writer_wake.wait_for(&mut out, POLL_TICK);
            }
            drop(out);
            let _ = p.stream.shutdown(Shutdown::Write);
        }
        // The readers end when the peers' goodbyes and end-of-stream arrive, or at the liveness
        // timeout; then every thread is joined.
        self.writers_exit.store(true, Ordering::Release);
        let threads = std::mem::take(&mut *self.threads.lock());
        for p in &self.peers_now() {
            p.writer_wake.notify_all();
        }
        for t in threads {
            let _ = t.join();
        }
        for p in &self.peers_now() {
            p.alive.store(false, Ordering::Release);
            let _ = p.stream.shutdown(Shutdown::Both);
        }
        self.door.close();
        *self.handler.lock() = None;
    }
}
