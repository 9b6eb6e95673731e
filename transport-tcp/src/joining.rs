//! Nodes that join a running cluster: the door every member keeps open after set-up, and the
//! joining node's way in.
//!
//! A node joins in the rank of a node that left or was lost. It knocks at a *contact* (any
//! member's mesh address, or rank 0's rendezvous address, which rank 0 keeps listening on) with
//! the membership handshake under the contact magic, and learns every rank's mesh address,
//! which ranks the contact is connected to, and the contact's join information (the engine's
//! configuration fingerprint). It then connects to each of those members under the rejoin magic,
//! says where it listens itself and hands over an *offer* for the fabric above (a verbs queue
//! pair's endpoint; empty over TCP), which the member's [`RejoinHook`] answers (with its own
//! endpoint, its queue pair connected), and each member puts the connection in the rank's slot of its
//! mesh — only once the old connection's end was reported to its handler, so that the node's
//! protocol counts the rank as gone before it hears from the new node. A member that has not
//! noticed the old node's end yet answers "retry", and the joining node knocks again until its
//! deadline. What the protocol does next (the join itself) is the engine's.
//!
//! Every knock is authenticated as set-up is, runs on its own thread with the handshake
//! deadline, and at most [`MAX_HANDSHAKES`] run at once (later ones are dropped): a stranger
//! costs a member a short-lived thread, never a slot.

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{TransportError, io_err};
use crate::mesh::{Inner, Mesh, MeshConfig, POLL_TICK, Peer};
use crate::setup::{HANDSHAKE, MAX_HANDSHAKES, MAX_NOTICE, RETRY_PAUSE, bind_listener, connect_member, handshake_accept, read_blob, setup_err, write_blob};

/// A joining node asking a contact about the cluster.
const CONTACT_MAGIC: &[u8; 8] = b"FERRY-JN";
/// A joining node's mesh connection to a member.
const REJOIN_MAGIC: &[u8; 8] = b"FERRY-RJ";
/// Prefix of a refusal worth knocking again after (the member has not noticed the old node's end).
const RETRY: &str = "RETRY:";
/// Largest join information a contact may send (the engine's fingerprint is a few KiB).
const MAX_INFO: usize = 1 << 20;
/// What a member answers before the node said whether it takes joins.
const NOT_YET: &str = "this node takes no joins: they need backups (FERRY_BACKUPS=1) and no bounded delay, or it is still starting";

/// What a member's fabric does with a joining node's offer (see [`Mesh::on_rejoin`]): sets up
/// its side of the connection to node `rank` and answers, or refuses with a reason.
pub type RejoinHook = Arc<dyn Fn(usize, &[u8]) -> Result<Vec<u8>, String> + Send + Sync>;

/// What a joining node's fabric hands `member` (see [`join_running`]), made from the contact's
/// join information once it is known; or why it cannot.
pub type MakeOffer<'a> = dyn FnMut(&[u8], usize) -> Result<Vec<u8>, String> + 'a;

/// A member's door for nodes that join after set-up.
pub(crate) struct Door {
    /// The fabric's answer to a joining node's offer (none: only an empty offer is taken).
    hook: Mutex<Option<RejoinHook>>,
    listeners: Mutex<Vec<TcpListener>>,
    /// Every rank's mesh address, as the node last learnt it.
    addresses: Mutex<Vec<SocketAddr>>,
    /// What a contact hands a joining node, or why joins are refused.
    info: Mutex<Result<Vec<u8>, String>>,
    open: AtomicBool,
    /// Knocks being answered now.
    knocking: AtomicUsize,
}

impl Default for Door {
    fn default() -> Self {
        Door {
            hook: Mutex::default(),
            listeners: Mutex::default(),
            addresses: Mutex::default(),
            info: Mutex::new(Err(NOT_YET.into())),
            open: AtomicBool::new(false),
            knocking: AtomicUsize::new(0),
        }
    }
}

impl Door {
    /// Keeps `listener` open after set-up, with every rank's mesh address.
    pub(crate) fn open(&self, listener: TcpListener, addresses: Vec<SocketAddr>) {
        self.listeners.lock().push(listener);
        *self.addresses.lock() = addresses;
        self.open.store(true, Ordering::Release);
    }

    /// Takes knocks on `listener` too (rank 0's rendezvous address).
    pub(crate) fn add_listener(&self, listener: TcpListener) {
        self.listeners.lock().push(listener);
    }

    /// Wakes the door's thread, which waits in `poll` on the listeners, so that it sees the mesh
    /// stopping at once: shutting a listening socket down ends the wait on Linux (and refuses
    /// later knocks), and the listeners close with the door.
    pub(crate) fn wake(&self) {
        for l in self.listeners.lock().iter() {
            let _ = socket2::SockRef::from(l).shutdown(std::net::Shutdown::Read);
        }
    }

    /// Closes the door: its listeners let go of their ports (a later cluster of this process
    /// may rendezvous at the same address). Called once the door's thread is joined.
    pub(crate) fn close(&self) {
        self.open.store(false, Ordering::Release);
        self.listeners.lock().clear();
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    fn addresses_text(&self) -> String {
        self.addresses.lock().iter().map(|a| a.to_string()).collect::<Vec<_>>().join("\n")
    }
}

impl Mesh {
    /// Lets nodes join in the rank of a lost or departed peer from now on; a contact hands
    /// `info` to each (the engine's configuration fingerprint, which the joining node checks).
    pub fn admit_joins(&self, info: Vec<u8>) {
        *self.inner.door.info.lock() = Ok(info);
    }

    /// Answers joining nodes' offers with `hook` (a fabric above the mesh that sets up more per
    /// connection, verbs queue pairs, trades them here).
    pub fn on_rejoin(&self, hook: RejoinHook) {
        *self.inner.door.hook.lock() = Some(hook);
    }

    /// The addresses a joining node may knock at on this node (its mesh address, and on rank 0
    /// the rendezvous address too); empty on a single node.
    pub fn join_addresses(&self) -> Vec<SocketAddr> {
        self.inner.door.listeners.lock().iter().filter_map(|l| l.local_addr().ok()).collect()
    }
}

/// The door's thread: accepts knocks until the mesh stops, each answered on a thread of its own.
/// It sleeps in `poll` on the listeners until a knock comes or the mesh wakes it to stop
/// ([`Door::wake`]); the wait's timeout only bounds how long a missed wake-up could keep it.
pub(crate) fn run_door(inner: &Arc<Inner>) {
    let mine: Vec<TcpListener> = inner.door.listeners.lock().iter().filter_map(|l| l.try_clone().ok()).collect();
    for l in &mine {
        let _ = l.set_nonblocking(true);
    }
    while !inner.stopping.load(Ordering::Acquire) {
        if let Err(e) = wait_for_knocks(&mine, DOOR_WAIT) {
            tracing::warn!(node = inner.rank, "the door cannot wait for knocks: {e}");
            std::thread::sleep(POLL_TICK);
        }
        if inner.stopping.load(Ordering::Acquire) {
            break;
        }
        for listener in &mine {
            while let Ok((stream, from)) = listener.accept() {
                if inner.door.knocking.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                    inner.door.knocking.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!(node = inner.rank, "{MAX_HANDSHAKES} knocks are being answered: dropping one from {from}");
                    continue;
                }
                let here = inner.clone();
                let spawned = std::thread::Builder::new().name(format!("ferry{}-knock", inner.rank)).spawn(move || {
                    answer_knock(&here, stream, from);
                    here.door.knocking.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    inner.door.knocking.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!(node = inner.rank, "dropping a knock from {from}: no thread to answer it");
                }
            }
        }
    }
}

/// Longest the door's thread waits in `poll` without a knock or a wake-up.
const DOOR_WAIT: Duration = Duration::from_secs(1);

/// Waits until one of `listeners` has a knock to accept, one was shut down ([`Door::wake`]), a
/// signal interrupted the wait, or `wait` passed.
fn wait_for_knocks(listeners: &[TcpListener], wait: Duration) -> std::io::Result<()> {
    let timeout = rustix::event::Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: wait.subsec_nanos() as i64 };
    let mut fds: Vec<rustix::event::PollFd<'_>> = listeners.iter().map(|l| rustix::event::PollFd::new(l, rustix::event::PollFlags::IN)).collect();
    match rustix::event::poll(&mut fds, Some(&timeout)) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Why node `rank` of `nodes` may not come in at `inner` now, if it may not.
fn refusal(inner: &Inner, rank: usize, nodes: usize) -> Option<String> {
    if nodes != inner.nodes {
        return Some(format!("this cluster has {} nodes, not {nodes}", inner.nodes));
    }
    if rank >= nodes || rank == inner.rank {
        return Some(format!("node {} cannot let a node join as node {rank} of {nodes}", inner.rank));
    }
    if let Err(why) = &*inner.door.info.lock() {
        return Some(why.clone());
    }
    if inner.slot(rank).is_some_and(|p| !p.closure_reported.load(Ordering::Acquire)) {
        return Some(format!("{RETRY}node {} is still connected to node {rank}: a node joins only in the rank of one that left or was lost", inner.rank));
    }
    None
}

fn answer_knock(inner: &Arc<Inner>, mut stream: TcpStream, from: SocketAddr) {
    let deadline = Instant::now() + HANDSHAKE;
    let outcome = stream
        .set_nonblocking(false)
        .map_err(|e| e.to_string())
        .and_then(|()| handshake_accept(&mut stream, &[CONTACT_MAGIC, REJOIN_MAGIC], inner.rank, inner.nodes, &inner.config.membership, deadline));
    let (magic, (rank, nodes)) = match outcome {
        Ok(found) => found,
        Err(e) => return tracing::warn!(node = inner.rank, "dropped a knock from {from}: {e}"),
    };
    if let Some(why) = refusal(inner, rank, nodes) {
        tracing::info!(node = inner.rank, joining = rank, "refused a node that would join: {why}");
        let _ = write_blob(&mut stream, why.as_bytes(), deadline);
        return;
    }
    let result = if magic == CONTACT_MAGIC { answer_contact(inner, &mut stream, deadline) } else { let_in(inner, stream, rank, deadline) };
    if let Err(e) = result {
        tracing::warn!(node = inner.rank, joining = rank, "a node that would join, from {from}: {e}");
    }
}

/// As the contact: "OK", every rank's mesh address, which ranks this node is connected to, and
/// the join information.
fn answer_contact(inner: &Inner, stream: &mut TcpStream, deadline: Instant) -> Result<(), String> {
    let info = inner.door.info.lock().clone()?;
    let members: Vec<u8> = (0..inner.nodes).map(|r| u8::from(r == inner.rank || inner.slot(r).is_some_and(|p| p.alive.load(Ordering::Acquire)))).collect();
    let send = |stream: &mut TcpStream| -> std::io::Result<()> {
        write_blob(stream, b"OK", deadline)?;
        write_blob(stream, inner.door.addresses_text().as_bytes(), deadline)?;
        write_blob(stream, &members, deadline)?;
        write_blob(stream, &info, deadline)
    };
    send(stream).map_err(|e| format!("answering: {e}"))
}

/// As a member: takes the joining node's mesh address and its connection into the rank's slot.
fn let_in(inner: &Arc<Inner>, mut stream: TcpStream, rank: usize, deadline: Instant) -> Result<(), String> {
    let said = read_blob(&mut stream, MAX_NOTICE, deadline).map_err(|e| format!("no address: {e}"))?;
    let Some(address) = std::str::from_utf8(&said).ok().and_then(|s| s.parse::<SocketAddr>().ok()) else {
        let _ = write_blob(&mut stream, b"a bad listening address", deadline);
        return Err("it announced a bad listening address".into());
    };
    let offer = read_blob(&mut stream, MAX_NOTICE, deadline).map_err(|e| format!("no offer: {e}"))?;
    let hook = inner.door.hook.lock().clone();
    let answer = match (hook, offer.is_empty()) {
        (Some(hook), _) => hook(rank, &offer),
        (None, true) => Ok(Vec::new()),
        (None, false) => Err("this node's fabric trades nothing beyond the TCP connection".to_string()),
    };
    let answer = match answer {
        Ok(answer) => answer,
        Err(why) => {
            let _ = write_blob(&mut stream, why.as_bytes(), deadline);
            return Err(format!("refused its offer: {why}"));
        }
    };
    let mut handle = stream.try_clone().map_err(|e| e.to_string())?;
    let peer = Arc::new(Peer::new(rank, stream, &inner.config).map_err(|e| e.to_string())?);
    // Greeted only once the connection holds the rank's slot: the joining node asks to join as
    // soon as every member greeted it, and what a member then sends it (its keys, for one) must
    // not go to the old connection.
    let tick = POLL_TICK.min(inner.config.heartbeat);
    let greet = || -> std::io::Result<()> {
        write_blob(&mut handle, b"OK", deadline)?;
        write_blob(&mut handle, &answer, deadline)?;
        // The connection's writer counts on its tick as the socket's timeout.
        handle.set_write_timeout(Some(tick))
    };
    if !inner.install_peer(peer, greet).map_err(|e| e.to_string())? {
        return Err("the rank's old connection came back in the meantime, or this node stops".into());
    }
    if let Some(slot) = inner.door.addresses.lock().get_mut(rank) {
        *slot = address;
    }
    tracing::info!(node = inner.rank, joining = rank, %address, "a node joins: connected");
    Ok(())
}

/// What a node that joins a running cluster learnt and built.
pub struct Joined {
    /// Its mesh, connected to every member the contact was connected to, not yet started.
    pub mesh: Mesh,
    /// The contact's join information (the engine's configuration fingerprint).
    pub info: Vec<u8>,
    /// The contact's rank.
    pub contact: usize,
    /// The members this node connected to (the contact included), in rank order.
    pub members: Vec<usize>,
    /// Each member's answer to this node's offer, by rank (empty for the others).
    pub answers: Vec<Vec<u8>>,
}

/// Joins a running cluster of `nodes` as node `rank` (the rank of a node that left or was lost)
/// through `contact`: learns the members from it, connects to each, and listens for nodes that
/// join later. `offer(info, member)` makes what this node hands each member for the fabric
/// above, once the contact's join information is known (empty over TCP); the members' answers
/// come back in [`Joined::answers`]. Gives up at the connect timeout of `config`.
pub fn join_running(rank: usize, nodes: usize, contact: &str, config: MeshConfig, offer: &mut MakeOffer<'_>) -> Result<Joined, TransportError> {
    if nodes < 2 || rank >= nodes {
        return Err(setup_err(format!("node {rank} of {nodes} cannot join a cluster")));
    }
    let deadline = Instant::now() + config.connect_timeout;
    let contact_addr = resolve_contact(contact)?;
    let me = (rank, nodes);
    let (mut stream, (contact_rank, their_nodes)) = connect_member(contact_addr, CONTACT_MAGIC, me, &config.membership, deadline, "the contact")?;
    let short = deadline.min(Instant::now() + HANDSHAKE);
    let answer = read_blob(&mut stream, MAX_NOTICE, short).map_err(io_err("waiting for the contact's answer"))?;
    if answer != b"OK" {
        let why = String::from_utf8_lossy(&answer);
        return Err(setup_err(format!("node {contact_rank} at {contact} did not let node {rank} join: {}", why.trim_start_matches(RETRY))));
    }
    if their_nodes != nodes {
        return Err(setup_err(format!("the contact runs a cluster of {their_nodes} nodes, not {nodes}")));
    }
    let addresses = read_blob(&mut stream, MAX_NOTICE.max(64 * nodes), short).map_err(io_err("reading the members' addresses"))?;
    let addresses: Vec<SocketAddr> = std::str::from_utf8(&addresses)
        .ok()
        .map(|text| text.split('\n').filter_map(|a| a.parse().ok()).collect())
        .filter(|a: &Vec<SocketAddr>| a.len() == nodes)
        .ok_or_else(|| setup_err("the contact sent a bad address list"))?;
    let connected = read_blob(&mut stream, nodes, short).map_err(io_err("reading the members"))?;
    if connected.len() != nodes {
        return Err(setup_err("the contact sent a bad member list"));
    }
    let info = read_blob(&mut stream, MAX_INFO, short).map_err(io_err("reading the join information"))?;
    let local_ip: IpAddr = stream.local_addr().map_err(io_err("reading the local address"))?.ip();
    drop(stream);
    let listener = bind_listener(local_ip)?;
    let local = listener.local_addr().map_err(io_err("reading the listener address"))?;
    let members: Vec<usize> = (0..nodes).filter(|&r| r != rank && connected[r] == 1).collect();
    let offers = members
        .iter()
        .map(|&member| offer(&info, member).map_err(|e| setup_err(format!("preparing the connection to node {member}: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    // Every member at once: each connection is a handshake's round trips and a knock's thread.
    let reached: Vec<Result<(TcpStream, Vec<u8>), TransportError>> = std::thread::scope(|s| {
        let (config, addresses) = (&config, &addresses);
        let connecting: Vec<_> = members
            .iter()
            .zip(&offers)
            .map(|(&member, offered)| s.spawn(move || connect_as_rejoin(addresses[member], member, me, (local, offered), config, deadline)))
            .collect();
        connecting.into_iter().map(|c| c.join().unwrap_or_else(|_| Err(setup_err("connecting to a member panicked")))).collect()
    });
    let mut streams: Vec<Option<TcpStream>> = (0..nodes).map(|_| None).collect();
    let mut answers = vec![Vec::new(); nodes];
    for (&member, result) in members.iter().zip(reached) {
        let (stream, answer) = result?;
        streams[member] = Some(stream);
        answers[member] = answer;
    }
    let mut addresses = addresses;
    addresses[rank] = local;
    let mesh = Mesh::from_streams(rank, nodes, streams, config)?;
    mesh.inner.door.open(listener, addresses);
    Ok(Joined { mesh, info, contact: contact_rank, members, answers })
}

fn resolve_contact(contact: &str) -> Result<SocketAddr, TransportError> {
    use std::net::ToSocketAddrs;
    contact
        .to_socket_addrs()
        .map_err(|e| setup_err(format!("cannot resolve the contact address '{contact}': {e}")))?
        .next()
        .ok_or_else(|| setup_err(format!("the contact address '{contact}' resolves to nothing")))
}

/// Connects to `member` at `addr` under the rejoin magic, says where this node listens and hands
/// over its offer, knocking again while the member has not noticed the rank's old node end,
/// until `deadline`. Returns the connection and the member's answer.
fn connect_as_rejoin(
    addr: SocketAddr,
    member: usize,
    me: (usize, usize),
    (local, offer): (SocketAddr, &[u8]),
    config: &MeshConfig,
    deadline: Instant,
) -> Result<(TcpStream, Vec<u8>), TransportError> {
    let what = format!("node {member}");
    loop {
        let (mut stream, (r, n)) = connect_member(addr, REJOIN_MAGIC, me, &config.membership, deadline, &what)?;
        if (r, n) != (member, me.1) {
            return Err(setup_err(format!("expected node {member} of {} at {addr}, found node {r} of {n}", me.1)));
        }
        let short = deadline.min(Instant::now() + HANDSHAKE);
        write_blob(&mut stream, local.to_string().as_bytes(), short).map_err(io_err(format!("telling {what} this node's address")))?;
        write_blob(&mut stream, offer, short).map_err(io_err(format!("handing {what} this node's offer")))?;
        let answer = read_blob(&mut stream, MAX_NOTICE, short).map_err(io_err(format!("waiting for {what} to let this node in")))?;
        if answer == b"OK" {
            let theirs = read_blob(&mut stream, MAX_NOTICE, short).map_err(io_err(format!("reading {what}'s answer")))?;
            return Ok((stream, theirs));
        }
        let why = String::from_utf8_lossy(&answer).into_owned();
        match why.strip_prefix(RETRY) {
            Some(why) if Instant::now() + RETRY_PAUSE < deadline => {
                tracing::debug!(node = me.0, member, "{why}; knocking again");
                std::thread::sleep(RETRY_PAUSE);
            }
            _ => return Err(setup_err(format!("{what} did not let node {} in: {}", me.0, why.trim_start_matches(RETRY)))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The door's thread sleeps in `poll` until a knock comes, and a stopping mesh wakes it by
    /// shutting its listeners down: neither waits for the timeout.
    #[test]
    fn the_door_wakes_for_a_knock_and_for_its_mesh_stopping() {
        let door = Door::default();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        door.add_listener(listener);
        let mine: Vec<TcpListener> = door.listeners.lock().iter().map(|l| l.try_clone().unwrap()).collect();
        let waits = |mine: Vec<TcpListener>| {
            std::thread::spawn(move || {
                let started = Instant::now();
                wait_for_knocks(&mine, Duration::from_secs(30)).unwrap();
                (started.elapsed(), mine)
            })
        };
        let waiting = waits(mine);
        std::thread::sleep(Duration::from_millis(50));
        let _knock = TcpStream::connect(addr).unwrap();
        let (waited, mine) = waiting.join().unwrap();
        assert!(waited < Duration::from_secs(10), "a knock wakes the door ({waited:?})");
        mine[0].set_nonblocking(true).unwrap();
        assert!(mine[0].accept().is_ok(), "and is there to accept");
        let waiting = waits(mine);
        std::thread::sleep(Duration::from_millis(50));
        door.wake();
        let (waited, _) = waiting.join().unwrap();
        assert!(waited < Duration::from_secs(10), "a stopping mesh wakes the door ({waited:?})");
    }
}
