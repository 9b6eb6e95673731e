//! Cluster set-up: rendezvous at a coordinator, then one connection per pair of nodes.
//!
//! Rank 0 listens on the coordinator address; every other rank connects to it and announces its
//! rank and the cluster size. The coordinator then runs all-gather rounds (each node contributes
//! a blob and receives everybody's) which the engine uses to exchange listening addresses and
//! configuration fingerprints, and a clock round so that nodes can relate their monotonic clocks.
//! Finally the higher rank of every pair connects to the lower one.
//!
//! Every connection starts with the membership handshake (see [`crate::Membership`]): a
//! connection that fails it — a stranger without the secret, another job, garbage, or one that
//! has not finished it within a short deadline (a total, however slowly it trickles bytes) — is
//! dropped and logged, and set-up goes on with the others. Nothing is sized by what a stranger
//! claims: a greeting longer than a greeting is refused before its bytes are read, and even a
//! member's all-gather blob grows only as its bytes arrive. When more strangers than
//! [`MAX_HANDSHAKES`] hold handshakes open, the oldest is dropped for the newcomer, and a member
//! whose handshake was cut short this way connects again until its deadline.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::auth::{MAC, Membership, NONCE};
use crate::error::{TransportError, io_err};
use crate::mesh::{Mesh, MeshConfig};

const RENDEZVOUS_MAGIC: &[u8; 8] = b"FERRY-RV";
const MESH_MAGIC: &[u8; 8] = b"FERRY-MS";
const VERSION: u32 = 2;
/// Bytes of a greeting: magic, version, rank, node count.
const HELLO: usize = 20;
/// How long an accepted connection may take to complete its handshake, in total.
pub const HANDSHAKE: Duration = Duration::from_secs(5);
/// Largest all-gather blob a member may send.
const MAX_BLOB: usize = 64 << 20;
/// Largest short answer: a refusal, an abort, an all-gather count, a clock reading.
pub(crate) const MAX_NOTICE: usize = 4096;
/// Bytes of a blob read (and allocated) at a time: a blob's memory follows what has arrived.
const READ_CHUNK: usize = 1 << 20;
const CLOCK_ROUNDS: usize = 8;
/// Prefix of the coordinator's message to joined nodes when set-up fails.
const ABORT: &str = "ABORT:";
/// Pause between a member's attempts to connect again after its handshake was cut short.
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// Nanoseconds of the system-wide monotonic clock (comparable between processes of one host).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec and CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

enum Link {
    Coordinator(Vec<TcpStream>),
    Member(TcpStream),
}

/// A node's membership in the cluster's rendezvous.
pub struct Rendezvous {
    rank: usize,
    nodes: usize,
    link: Link,
    local_ip: IpAddr,
    /// Rank 0's rendezvous listener, kept as a door for nodes that join later.
    listener: Option<TcpListener>,
}

pub(crate) fn setup_err(msg: impl Into<String>) -> TransportError {
    TransportError::Setup(msg.into())
}

/// The time left until `deadline`, or a timed-out error once it has passed.
pub(crate) fn time_left(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() { Err(io::Error::new(io::ErrorKind::TimedOut, "timed out")) } else { Ok(left) }
}

/// Fills `buf` from `stream` by `deadline` in total: a peer that trickles a byte now and then
/// gains nothing over one that sends none.
fn read_exact_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        stream.set_read_timeout(Some(time_left(deadline)?))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the connection was closed")),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out")),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

pub(crate) fn write_blob(stream: &mut TcpStream, blob: &[u8], deadline: Instant) -> io::Result<()> {
    stream.set_write_timeout(Some(time_left(deadline)?))?;
    let mut framed = Vec::with_capacity(4 + blob.len());
    framed.extend_from_slice(&(blob.len() as u32).to_le_bytes());
    framed.extend_from_slice(blob);
    stream.write_all(&framed)
}

/// Reads one length-prefixed blob of at most `max` bytes by `deadline`. A longer length is
/// refused before any of it is read; the blob's memory grows with the bytes that arrive.
pub(crate) fn read_blob(stream: &mut TcpStream, max: usize, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_by(stream, &mut len, deadline)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a message of {len} bytes where at most {max} were expected")));
    }
    let mut blob = Vec::with_capacity(len.min(READ_CHUNK));
    while blob.len() < len {
        let start = blob.len();
        blob.resize(start + (len - start).min(READ_CHUNK), 0);
        read_exact_by(stream, &mut blob[start..], deadline)?;
    }
    Ok(blob)
}

fn hello(magic: &[u8; 8], rank: usize, nodes: usize) -> Vec<u8> {
    let mut out = magic.to_vec();
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(rank as u32).to_le_bytes());
    out.extend_from_slice(&(nodes as u32).to_le_bytes());
    out
}

fn parse_hello(magic: &[u8; 8], blob: &[u8]) -> Result<(usize, usize), String> {
    if blob.len() != 20 || &blob[..8] != magic {
        return Err("not a Ferry node (bad greeting)".into());
    }
    let version = u32::from_le_bytes(blob[8..12].try_into().expect("4"));
    if version != VERSION {
        return Err(format!("protocol version {version}, expected {VERSION}"));
    }
    let rank = u32::from_le_bytes(blob[12..16].try_into().expect("4")) as usize;
    let nodes = u32::from_le_bytes(blob[16..20].try_into().expect("4")) as usize;
    Ok((rank, nodes))
}

/// Why a connecting handshake failed.
enum ConnectFailure {
    /// The connection broke before the acceptor answered (it may have been dropped to make room
    /// for others): worth connecting again.
    Cut(String),
    /// The acceptor answered, and is not a member of this job (or not Ferry): final.
    Refused(String),
}

impl ConnectFailure {
    fn text(self) -> String {
        match self {
            ConnectFailure::Cut(e) | ConnectFailure::Refused(e) => e,
        }
    }
}

/// The connecting side of the membership handshake, finished by `deadline`: greeting and nonce
/// out, the acceptor's greeting, nonce and MAC back (checked), this side's MAC out. Returns the
/// acceptor's (rank, node count), or why it is not a member of this job.
fn handshake_connect(
    stream: &mut TcpStream,
    magic: &[u8; 8],
    (rank, nodes): (usize, usize),
    m: &Membership,
    deadline: Instant,
) -> Result<(usize, usize), ConnectFailure> {
    let mut first = hello(magic, rank, nodes);
    first.extend_from_slice(&Membership::nonce());
    write_blob(stream, &first, deadline).map_err(|e| ConnectFailure::Cut(format!("sending the greeting: {e}")))?;
    let second = read_blob(stream, MAX_NOTICE, deadline).map_err(|e| match e.kind() {
        io::ErrorKind::InvalidData => ConnectFailure::Refused(format!("it answered with {e}")),
        // A Ferry acceptor answers at once or drops the connection: silence is somebody else.
        io::ErrorKind::TimedOut => ConnectFailure::Refused(format!("it accepted the connection but did not answer within {HANDSHAKE:?}")),
        _ => ConnectFailure::Cut(format!("waiting for its greeting: {e}")),
    })?;
    if second.len() != HELLO + NONCE + MAC || &second[..8] != magic {
        // A refusal is plain text.
        return Err(ConnectFailure::Refused(format!("it answered '{}'", String::from_utf8_lossy(&second[..second.len().min(200)]))));
    }
    let peer = parse_hello(magic, &second[..HELLO]).map_err(ConnectFailure::Refused)?;
    if !m.verify("accept", &[&first, &second[..HELLO + NONCE]], &second[HELLO + NONCE..]) {
        return Err(ConnectFailure::Refused("it does not hold this job's cluster secret, or runs another job (FERRY_SECRET, FERRY_JOB_ID)".into()));
    }
    write_blob(stream, &m.mac("connect", &[&first, &second]), deadline).map_err(|e| ConnectFailure::Cut(format!("sending the proof: {e}")))?;
    Ok(peer)
}

/// Connects to `addr` and runs the connecting handshake, connecting again while the
/// acceptor is not there yet or cuts the handshake short, until `deadline`. Each attempt's
/// handshake has the handshake deadline.
pub(crate) fn connect_member(
    addr: SocketAddr,
    magic: &[u8; 8],
    me: (usize, usize),
    m: &Membership,
    deadline: Instant,
    what: &str,
) -> Result<(TcpStream, (usize, usize)), TransportError> {
    loop {
        let mut stream = connect_with_retry(addr, deadline, what)?;
        stream.set_nodelay(true).map_err(io_err("setting TCP_NODELAY"))?;
        match handshake_connect(&mut stream, magic, me, m, deadline.min(Instant::now() + HANDSHAKE)) {
            Ok(peer) => return Ok((stream, peer)),
            Err(ConnectFailure::Cut(e)) if Instant::now() + RETRY_PAUSE < deadline => {
                tracing::debug!(rank = me.0, "the handshake with {what} at {addr} was cut short ({e}); connecting again");
                std::thread::sleep(RETRY_PAUSE);
            }
            Err(failure) => {
                let e = failure.text();
                let hint = if e.contains("cluster secret") { "" } else { " (is another program using its port?)" };
                return Err(setup_err(format!("{what} at {addr} did not let this node in: {e}{hint}")));
            }
        }
    }
}

/// Runs the connecting side of the mesh's membership handshake on `stream` as node `rank` of
/// `nodes` (for tools and tests that speak the set-up protocol by hand), within the handshake
/// deadline. Returns the acceptor's (rank, node count).
pub fn mesh_handshake(stream: &mut TcpStream, rank: usize, nodes: usize, membership: &Membership) -> Result<(usize, usize), TransportError> {
    handshake_connect(stream, MESH_MAGIC, (rank, nodes), membership, Instant::now() + HANDSHAKE).map_err(|f| setup_err(f.text()))
}

/// The accepting side of the membership handshake, finished by `deadline`, for a greeting with
/// any of `magics`. Returns the magic the connecting node greeted with and its (rank, node
/// count), or why it is not a member of this job.
pub(crate) fn handshake_accept(
    stream: &mut TcpStream,
    magics: &[&'static [u8; 8]],
    rank: usize,
    nodes: usize,
    m: &Membership,
    deadline: Instant,
) -> Result<(&'static [u8; 8], (usize, usize)), String> {
    let first = read_blob(stream, HELLO + NONCE, deadline).map_err(|e| format!("no greeting: {e}"))?;
    if first.len() != HELLO + NONCE {
        return Err("not a Ferry node (bad greeting)".into());
    }
    let magic = *magics.iter().find(|m| first[..8] == m[..]).ok_or("not a Ferry node, or not one this listener serves (bad greeting)")?;
    let peer = parse_hello(magic, &first[..HELLO])?;
    let mut second = hello(magic, rank, nodes);
    second.extend_from_slice(&Membership::nonce());
    let tag = m.mac("accept", &[&first, &second]);
    second.extend_from_slice(&tag);
    write_blob(stream, &second, deadline).map_err(|e| format!("answering: {e}"))?;
    let proof = read_blob(stream, MAC, deadline).map_err(|e| format!("no proof: {e}"))?;
    if !m.verify("connect", &[&first, &second], &proof) {
        return Err(format!("node {} of {} does not hold this job's cluster secret, or runs another job", peer.0, peer.1));
    }
    Ok((magic, peer))
}

/// Handshakes running at once at most; beyond, the oldest is dropped for the newcomer (a
/// flood of strangers must neither exhaust threads nor keep members out: a member's handshake
/// takes a round trip, a stranger's as long as it is let).
pub const MAX_HANDSHAKES: usize = 64;

/// What an accepted connection's handshake thread reports.
type Handshaken = (TcpStream, SocketAddr, Result<(usize, usize), String>);

/// The handshakes running, oldest first, with a handle to cut each short.
#[derive(Default)]
struct Running {
    next: u64,
    streams: BTreeMap<u64, TcpStream>,
}

/// The accepting side of set-up: accepts connections on `listener` until `admit` has taken all
/// it needs (it returns `Ok(true)` when done) or `deadline` passes (`Ok(false)`). Every
/// connection's handshake runs on its own thread with its own short deadline, so an idle or slow
/// stranger delays nobody; those that fail are logged and dropped. `admit` gets each member that
/// passed (its stream, address, rank and node count) and may refuse it with an error, which
/// ends set-up.
fn accept_members(
    listener: &TcpListener,
    magic: &'static [u8; 8],
    (rank, nodes): (usize, usize),
    membership: &Membership,
    deadline: Instant,
    mut admit: impl FnMut(TcpStream, SocketAddr, (usize, usize)) -> Result<bool, TransportError>,
) -> Result<bool, TransportError> {
    listener.set_nonblocking(true).map_err(io_err("configuring the listener"))?;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<Handshaken>();
    let running = Arc::new(Mutex::new(Running::default()));
    loop {
        loop {
            match listener.accept() {
                Ok((stream, from)) => {
                    let id = {
                        let mut running = running.lock();
                        if running.streams.len() >= MAX_HANDSHAKES
                            && let Some((_, oldest)) = running.streams.pop_first()
                        {
                            let old = oldest.peer_addr().map_or("?".into(), |a| a.to_string());
                            tracing::warn!(rank, "{MAX_HANDSHAKES} handshakes run: dropping the oldest (from {old}) for a connection from {from}");
                            let _ = oldest.shutdown(Shutdown::Both);
                        }
                        let Ok(handle) = stream.try_clone() else {
                            tracing::warn!(rank, "dropping a connection from {from}: its socket cannot be shared");
                            continue;
                        };
                        running.next += 1;
                        let id = running.next;
                        running.streams.insert(id, handle);
                        id
                    };
                    let (done, running_here, membership) = (done_tx.clone(), running.clone(), membership.clone());
                    let handshake_deadline = deadline.min(Instant::now() + HANDSHAKE);
                    let spawned = std::thread::Builder::new().name(format!("ferry{rank}-hs")).spawn(move || {
                        let mut stream = stream;
                        let outcome = stream
                            .set_nonblocking(false)
                            .map_err(|e| e.to_string())
                            .and_then(|()| handshake_accept(&mut stream, &[magic], rank, nodes, &membership, handshake_deadline))
                            .map(|(_, peer)| peer);
                        running_here.lock().streams.remove(&id);
                        let _ = done.send((stream, from, outcome));
                    });
                    if spawned.is_err() {
                        running.lock().streams.remove(&id);
                        tracing::warn!(rank, "dropping a connection from {from}: no thread for its handshake");
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted || e.kind() == io::ErrorKind::ConnectionAborted => continue,
                Err(e) => return Err(io_err("accepting a node")(e)),
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        match done_rx.recv_timeout(left.min(Duration::from_millis(5))) {
            Ok((stream, from, Ok(peer))) => {
                if admit(stream, from, peer)? {
                    return Ok(true);
                }
            }
            Ok((_, from, Err(e))) => tracing::warn!(rank, "dropped a connection from {from}: {e}"),
            Err(_) => {}
        }
    }
}

pub(crate) fn resolve(address: &str) -> Result<SocketAddr, TransportError> {
    address
        .to_socket_addrs()
        .map_err(|e| setup_err(format!("cannot resolve coordinator address '{address}': {e}")))?
        .next()
        .ok_or_else(|| setup_err(format!("coordinator address '{address}' resolves to nothing")))
}

fn connect_with_retry(addr: SocketAddr, deadline: Instant, what: &str) -> Result<TcpStream, TransportError> {
    let mut last = None;
    while Instant::now() < deadline {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
            Ok(s) => return Ok(s),
            Err(e) => {
                last = Some(e);
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    Err(setup_err(format!("could not connect to {what} at {addr}: {}", last.map_or("timed out".into(), |e| e.to_string()))))
}

impl Rendezvous {
    /// Joins the rendezvous: rank 0 listens on `coordinator` and waits for the others; the
    /// others connect to it (retrying until `timeout`, since the coordinator may start later).
    /// Only holders of `membership`'s secret in its job get in.
    pub fn join(rank: usize, nodes: usize, coordinator: &str, timeout: Duration, membership: &Membership) -> Result<Rendezvous, TransportError> {
        if nodes == 0 || rank >= nodes {
            return Err(setup_err(format!("rank {rank} is not below the node count {nodes}")));
        }
        if nodes > u16::MAX as usize {
            return Err(setup_err(format!("{nodes} nodes is more than the supported {}", u16::MAX)));
        }
        let deadline = Instant::now() + timeout;
        if nodes == 1 {
            return Ok(Rendezvous { rank, nodes, link: Link::Coordinator(Vec::new()), local_ip: IpAddr::from([127, 0, 0, 1]), listener: None });
        }
        let addr = resolve(coordinator)?;
        if rank == 0 {
            Self::serve(nodes, addr, deadline, membership)
        } else {
            let (mut stream, _) = connect_member(addr, RENDEZVOUS_MAGIC, (rank, nodes), membership, deadline, "the coordinator")?;
            let answer = read_blob(&mut stream, MAX_NOTICE, deadline).map_err(io_err("waiting for the coordinator to accept this node"))?;
            if answer != b"OK" {
                return Err(setup_err(format!("the coordinator refused this node: {}", String::from_utf8_lossy(&answer))));
            }
            let local_ip = stream.local_addr().map_err(io_err("reading the local address"))?.ip();
            Ok(Rendezvous { rank, nodes, link: Link::Member(stream), local_ip, listener: None })
        }
    }

    fn serve(nodes: usize, addr: SocketAddr, deadline: Instant, membership: &Membership) -> Result<Rendezvous, TransportError> {
        let listener = bind_reusable(addr).map_err(|e| {
            let hint = if e.kind() == io::ErrorKind::AddrInUse { " (another program, or another job's coordinator, holds the port)" } else { "" };
            setup_err(format!("the coordinator cannot listen on {addr}: {e}{hint}"))
        })?;
        let mut members: Vec<Option<TcpStream>> = (0..nodes).map(|_| None).collect();
        let mut local_ip = addr.ip();
        // Strangers were dropped by `accept_members`; members that proved the secret but do not
        // fit this cluster stop it, saying why to every node that joined.
        let mut refusal = None;
        let complete = accept_members(&listener, RENDEZVOUS_MAGIC, (0, nodes), membership, deadline, |mut stream, _, (rank, n)| {
            let reason = match (rank, n) {
                (_, n) if n != nodes => Some(format!("a node announced {n} nodes but the coordinator was started for {nodes}")),
                (r, _) if r == 0 || r >= nodes => Some(format!("a node announced rank {r}, out of range for {nodes} nodes")),
                (r, _) if members[r].is_some() => Some(format!("rank {r} joined twice (two processes were started with FERRY_RANK={r})")),
                _ => None,
            };
            if let Some(reason) = reason {
                let _ = write_blob(&mut stream, reason.as_bytes(), deadline);
                refusal = Some(reason);
                return Ok(true);
            }
            write_blob(&mut stream, b"OK", deadline).map_err(io_err("accepting a node"))?;
            stream.set_nodelay(true).map_err(io_err("setting TCP_NODELAY"))?;
            if local_ip.is_unspecified() {
                local_ip = stream.local_addr().map_err(io_err("reading the local address"))?.ip();
            }
            members[rank] = Some(stream);
            Ok(members.iter().skip(1).all(Option::is_some))
        })?;
        let failure = match refusal {
            Some(reason) => Some(format!("a node could not join: {reason}")),
            None if !complete => {
                let missing: Vec<usize> = (1..nodes).filter(|&r| members[r].is_none()).collect();
                Some(format!("rendezvous timed out: ranks {missing:?} never joined"))
            }
            None => None,
        };
        if let Some(failure) = failure {
            // The nodes that joined hear it too, instead of waiting for their own deadline.
            for stream in members.iter_mut().flatten() {
                let _ = write_blob(stream, format!("{ABORT}{failure}").as_bytes(), deadline);
            }
            return Err(setup_err(failure));
        }
        let streams = members.into_iter().skip(1).map(|s| s.expect("all joined")).collect();
        Ok(Rendezvous { rank: 0, nodes, link: Link::Coordinator(streams), local_ip, listener: Some(listener) })
    }

    /// This node's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The local address through which this node reached the coordinator; other nodes can
    /// reach it there.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// Every node contributes `blob`; everybody receives all blobs in rank order.
    pub fn all_gather(&mut self, blob: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>, TransportError> {
        let deadline = Instant::now() + timeout;
        match &mut self.link {
            Link::Member(stream) => {
                write_blob(stream, blob, deadline).map_err(io_err("sending to the coordinator"))?;
                let count = read_blob(stream, MAX_NOTICE, deadline).map_err(io_err("waiting for the other nodes"))?;
                if let Some(reason) = count.strip_prefix(ABORT.as_bytes()) {
                    return Err(setup_err(format!("the coordinator stopped set-up: {}", String::from_utf8_lossy(reason))));
                }
                let count = u32::from_le_bytes(count.as_slice().try_into().map_err(|_| setup_err("bad all-gather answer"))?) as usize;
                if count != self.nodes {
                    return Err(setup_err(format!("all-gather answered with {count} blobs for {} nodes", self.nodes)));
                }
                (0..count).map(|_| read_blob(stream, MAX_BLOB, deadline).map_err(io_err("receiving from the coordinator"))).collect()
            }
            Link::Coordinator(members) => {
                let mut blobs = vec![blob.to_vec()];
                for (i, stream) in members.iter_mut().enumerate() {
                    blobs.push(read_blob(stream, MAX_BLOB, deadline).map_err(io_err(format!("waiting for rank {}", i + 1)))?);
                }
                for (i, stream) in members.iter_mut().enumerate() {
                    let send = |stream: &mut TcpStream| -> io::Result<()> {
                        write_blob(stream, &(blobs.len() as u32).to_le_bytes(), deadline)?;
                        blobs.iter().try_for_each(|b| write_blob(stream, b, deadline))
                    };
                    send(stream).map_err(io_err(format!("answering rank {}", i + 1)))?;
                }
                Ok(blobs)
            }
        }
    }

    /// Estimates, for every node, the offset to add to its [`monotonic_ns`] to get the
    /// coordinator's clock (the minimum-round-trip sample of a few ping-pongs). Collective.
    pub fn clock_offset_ns(&mut self, timeout: Duration) -> Result<i64, TransportError> {
        let deadline = Instant::now() + timeout;
        match &mut self.link {
            Link::Member(stream) => {
                let mut best: Option<(u64, i64)> = None;
                for _ in 0..CLOCK_ROUNDS {
                    let t0 = monotonic_ns();
                    write_blob(stream, &t0.to_le_bytes(), deadline).map_err(io_err("clock round"))?;
                    let reply = read_blob(stream, MAX_NOTICE, deadline).map_err(io_err("clock round"))?;
                    let t1 = monotonic_ns();
                    let tc = u64::from_le_bytes(reply.as_slice().try_into().map_err(|_| setup_err("bad clock answer"))?);
                    let rtt = t1.saturating_sub(t0);
                    let offset = tc as i64 - ((t0 as i128 + t1 as i128) / 2) as i64;
                    if best.is_none_or(|(r, _)| rtt < r) {
                        best = Some((rtt, offset));
                    }
                }
                Ok(best.map_or(0, |(_, o)| o))
            }
            Link::Coordinator(members) => {
                for stream in members.iter_mut() {
                    for _ in 0..CLOCK_ROUNDS {
                        read_blob(stream, MAX_NOTICE, deadline).map_err(io_err("clock round"))?;
                        write_blob(stream, &monotonic_ns().to_le_bytes(), deadline).map_err(io_err("clock round"))?;
                    }
                }
                Ok(0)
            }
        }
    }
}

fn bind_reusable(addr: SocketAddr) -> io::Result<TcpListener> {
    let domain = socket2::Domain::for_address(addr);
    let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// Binds a listener for mesh connections on `ip` with a port chosen by the system.
pub fn bind_listener(ip: IpAddr) -> Result<TcpListener, TransportError> {
    bind_reusable(SocketAddr::new(ip, 0)).map_err(io_err(format!("listening on {ip}")))
}

/// Connects this node to every other: to each lower rank at `addresses[r]`, and accepts the
/// higher ranks on `listener`, which stays open for nodes that join later (see
/// [`crate::join_running`]). Returns the mesh, not yet started.
pub fn connect_mesh(rank: usize, addresses: &[SocketAddr], listener: TcpListener, config: MeshConfig) -> Result<Mesh, TransportError> {
    let nodes = addresses.len();
    let deadline = Instant::now() + config.connect_timeout;
    let mut streams: Vec<Option<TcpStream>> = (0..nodes).map(|_| None).collect();
    for (peer, addr) in addresses.iter().enumerate().take(rank) {
        match connect_member(*addr, MESH_MAGIC, (rank, nodes), &config.membership, deadline, &format!("node {peer}"))? {
            (stream, (r, n)) if r == peer && n == nodes => streams[peer] = Some(stream),
            (_, (r, n)) => return Err(setup_err(format!("expected node {peer} of {nodes} at {addr}, found node {r} of {n}"))),
        }
    }
    if rank + 1 < nodes {
        let complete = accept_members(&listener, MESH_MAGIC, (rank, nodes), &config.membership, deadline, |stream, from, (r, n)| {
            if n == nodes && r > rank && r < nodes && streams[r].is_none() {
                streams[r] = Some(stream);
            } else {
                tracing::warn!(rank, "ignoring a connection from {from}: node {r} of {n}");
            }
            Ok(streams[rank + 1..].iter().all(Option::is_some))
        })?;
        if !complete {
            let missing: Vec<usize> = (rank + 1..nodes).filter(|&r| streams[r].is_none()).collect();
            return Err(setup_err(format!("nodes {missing:?} never connected")));
        }
    }
    let mesh = Mesh::from_streams(rank, nodes, streams, config)?;
    if nodes > 1 {
        mesh.inner.door.open(listener, addresses.to_vec());
    }
    Ok(mesh)
}

/// Runs the whole set-up for a node: rendezvous, address exchange and mesh connection.
/// Returns the rendezvous (still open for further all-gather rounds) and the unstarted mesh.
pub fn join_cluster(rank: usize, nodes: usize, coordinator: &str, config: MeshConfig) -> Result<(Rendezvous, Mesh), TransportError> {
    let mut rendezvous = Rendezvous::join(rank, nodes, coordinator, config.connect_timeout, &config.membership)?;
    let listener = bind_listener(rendezvous.local_ip())?;
    let local = listener.local_addr().map_err(io_err("reading the listener address"))?;
    let blobs = rendezvous.all_gather(local.to_string().as_bytes(), config.connect_timeout)?;
    let addresses = blobs
        .iter()
        .enumerate()
        .map(|(r, b)| {
            std::str::from_utf8(b).ok().and_then(|s| s.parse::<SocketAddr>().ok()).ok_or_else(|| setup_err(format!("node {r} announced a bad address")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mesh = connect_mesh(rank, &addresses, listener, config)?;
    if let Some(listener) = rendezvous.listener.take() {
        // Nodes that join later may knock at the address every launcher knows.
        mesh.inner.door.add_listener(listener);
    }
    Ok((rendezvous, mesh))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let near = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (near, listener.accept().unwrap().0)
    }

    #[test]
    fn a_blob_trickled_a_byte_at_a_time_times_out_at_the_total_deadline() {
        let (mut near, mut far) = pair();
        let trickle = std::thread::spawn(move || {
            let _ = far.write_all(&36u32.to_le_bytes());
            for _ in 0..36 {
                if far.write_all(&[1]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(40));
            }
        });
        let started = Instant::now();
        let e = read_blob(&mut near, HELLO + NONCE, started + Duration::from_millis(300)).expect_err("the blob takes 1.4 s");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() < Duration::from_millis(600), "took {:?}", started.elapsed());
        drop(near);
        trickle.join().unwrap();
    }

    #[test]
    fn a_length_beyond_the_limit_is_refused_before_its_bytes_are_read() {
        let (mut near, mut far) = pair();
        far.write_all(&(64u32 << 20).to_le_bytes()).unwrap();
        let e = read_blob(&mut near, HELLO + NONCE, Instant::now() + Duration::from_secs(5)).expect_err("too long");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("67108864 bytes"), "{e}");
        // Within the limit, the bytes arrive whole.
        write_blob(&mut far, b"a greeting", Instant::now() + Duration::from_secs(5)).unwrap();
        assert_eq!(read_blob(&mut near, HELLO + NONCE, Instant::now() + Duration::from_secs(5)).unwrap(), b"a greeting");
    }
}
