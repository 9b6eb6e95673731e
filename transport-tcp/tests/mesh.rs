//! Meshes of real TCP connections on loopback, several nodes in one test process.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_tcp::{AccessError, Handler, LandedWrite, Mesh, MeshConfig, TransportError, bind_listener, connect_mesh, join_cluster};
use parking_lot::{Condvar, Mutex};

#[derive(Debug, Clone, PartialEq)]
enum Event {
    Message(usize, Vec<u8>),
    Landed(usize, LandedWrite),
    WriteError(usize, u64, AccessError),
    ReadDone(usize, u64, Result<(), AccessError>),
    Closed(usize, bool),
}

#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<Event>>,
    changed: Condvar,
    /// Why connections failed, as reported.
    losses: Mutex<Vec<String>>,
}

impl Recorder {
    fn push(&self, e: Event) {
        self.events.lock().push(e);
        self.changed.notify_all();
    }

    fn wait_for(&self, what: &str, timeout: Duration, pred: impl Fn(&[Event]) -> bool) -> Vec<Event> {
        let deadline = Instant::now() + timeout;
        let mut events = self.events.lock();
        while !pred(&events) {
            assert!(!self.changed.wait_until(&mut events, deadline).timed_out(), "timed out waiting for {what}; saw {:?}", *events);
        }
        events.clone()
    }
}

impl Handler for Recorder {
    fn on_message(&self, from: usize, payload: bytes::Bytes) {
        self.push(Event::Message(from, payload.to_vec()));
    }
    fn on_writes_landed(&self, from: usize, writes: &[LandedWrite]) {
        for w in writes {
            self.push(Event::Landed(from, *w));
        }
    }
    fn on_write_error(&self, peer: usize, wr_id: u64, error: AccessError) {
        self.push(Event::WriteError(peer, wr_id, error));
    }
    fn on_read_complete(&self, peer: usize, wr_id: u64, result: Result<(), AccessError>) {
        self.push(Event::ReadDone(peer, wr_id, result));
    }
    fn on_peer_closed(&self, peer: usize, error: Option<&TransportError>) {
        if let Some(e) = error {
            self.losses.lock().push(e.to_string());
        }
        self.push(Event::Closed(peer, error.is_none()));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn cluster(nodes: usize, config: MeshConfig) -> Vec<(Mesh, Arc<Recorder>)> {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let handles: Vec<_> = (0..nodes)
        .map(|rank| {
            let (coordinator, config) = (coordinator.clone(), config.clone());
            std::thread::spawn(move || join_cluster(rank, nodes, &coordinator, config).map(|(_, mesh)| mesh))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            let mesh = h.join().unwrap().expect("cluster set-up");
            let rec = Arc::new(Recorder::default());
            mesh.start(rec.clone()).unwrap();
            (mesh, rec)
        })
        .collect()
}

fn quick_config() -> MeshConfig {
    MeshConfig { heartbeat: Duration::from_millis(50), peer_timeout: Duration::from_millis(600), ..MeshConfig::default() }
}

#[test]
fn messages_arrive_in_order_between_every_pair() {
    let nodes = cluster(3, MeshConfig::default());
    for (mesh, _) in &nodes {
        for peer in 0..3 {
            if peer == mesh.rank() {
                continue;
            }
            for i in 0..200u32 {
                let mut payload = vec![mesh.rank() as u8];
                payload.extend_from_slice(&i.to_le_bytes());
                payload.resize(5 + (i as usize * 37) % 3000, 7);
                mesh.send(peer, payload).unwrap();
            }
        }
    }
    for (mesh, rec) in &nodes {
        let events = rec.wait_for("400 messages", Duration::from_secs(10), |e| e.len() >= 400);
        for from in 0..3 {
            if from == mesh.rank() {
                continue;
            }
            let seq: Vec<u32> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Message(f, p) if *f == from => {
                        assert_eq!(p[0] as usize, from);
                        Some(u32::from_le_bytes(p[1..5].try_into().unwrap()))
                    }
                    _ => None,
                })
                .collect();
            assert_eq!(seq, (0..200).collect::<Vec<_>>(), "order from {from} at {}", mesh.rank());
        }
    }
    for (mesh, _) in &nodes {
        mesh.shutdown();
    }
}

#[test]
fn large_messages_in_both_directions_do_not_deadlock() {
    let nodes = cluster(2, MeshConfig::default());
    let big = vec![3u8; 48 << 20];
    nodes[0].0.send(1, big.clone()).unwrap();
    nodes[1].0.send(0, big.clone()).unwrap();
    nodes[0].0.send(1, vec![1]).unwrap();
    nodes[1].0.send(0, vec![1]).unwrap();
    for (_, rec) in &nodes {
        let events = rec.wait_for("both messages", Duration::from_secs(30), |e| e.len() >= 2);
        assert!(matches!(&events[0], Event::Message(_, p) if p.len() == big.len() && p.iter().all(|&b| b == 3)));
        assert!(matches!(&events[1], Event::Message(_, p) if p == &vec![1]));
    }
}

#[test]
fn one_sided_writes_reads_and_their_errors() {
    let nodes = cluster(2, MeshConfig::default());
    let (a, rec_a) = (&nodes[0].0, &nodes[0].1);
    let (b, rec_b) = (&nodes[1].0, &nodes[1].1);
    let mut target = vec![0u8; 4096];
    let mut local = vec![0u8; 4096];
    // SAFETY: both buffers outlive the meshes' use of them (regions are deregistered below).
    let region_b = unsafe { b.register(target.as_mut_ptr(), target.len()) };
    let region_a = unsafe { a.register(local.as_mut_ptr(), local.len()) };

    let data: Vec<u8> = (0..255u8).collect();
    a.write(1, region_b, 100, &data, Some(42), 1).unwrap();
    let events = rec_b.wait_for("the landed write", Duration::from_secs(5), |e| !e.is_empty());
    assert_eq!(events[0], Event::Landed(0, LandedWrite { imm: 42, region: region_b, offset: 100, len: 255 }));
    assert_eq!(&target[100..355], &data[..]);

    a.read(1, region_b, 100, 255, region_a, 1000, 7).unwrap();
    let events = rec_a.wait_for("the read", Duration::from_secs(5), |e| !e.is_empty());
    assert_eq!(events[0], Event::ReadDone(1, 7, Ok(())));
    assert_eq!(&local[1000..1255], &data[..]);

    // Out of bounds and unknown regions come back as errors, and the connection survives.
    a.write(1, region_b, 4000, &data, None, 9).unwrap();
    a.read(1, region_b + 5, 0, 8, region_a, 0, 8).unwrap();
    a.read(1, region_b, 4095, 2, region_a, 0, 10).unwrap();
    let events = rec_a.wait_for("three errors", Duration::from_secs(5), |e| e.len() >= 4);
    assert!(matches!(events[1], Event::WriteError(1, 9, AccessError::OutOfBounds { .. })));
    assert_eq!(events[2], Event::ReadDone(1, 8, Err(AccessError::UnknownRegion(region_b + 5))));
    assert!(matches!(events[3], Event::ReadDone(1, 10, Err(AccessError::OutOfBounds { .. }))));
    assert!(a.read(1, region_b, 0, 8, region_a, 4090, 11).is_err(), "local destination out of bounds");
    a.send(1, b"still here".to_vec()).unwrap();
    rec_b.wait_for("a message after the errors", Duration::from_secs(5), |e| e.iter().any(|e| matches!(e, Event::Message(0, p) if p == b"still here")));
    assert!(a.is_alive(1));
    // A region registered for reads only: read, but never written by a peer.
    let mut image = vec![7u8; 64];
    // SAFETY: `image` outlives its registration (deregistered below).
    let read_only = unsafe { b.register_read_only(image.as_mut_ptr(), image.len()) };
    a.write(1, read_only, 0, &data[..16], Some(5), 12).unwrap();
    a.read(1, read_only, 0, 16, region_a, 2000, 13).unwrap();
    let events = rec_a.wait_for("the refused write and the read", Duration::from_secs(5), |e| e.len() >= 6);
    assert_eq!(events[4], Event::WriteError(1, 12, AccessError::ReadOnly(read_only)));
    assert_eq!(events[5], Event::ReadDone(1, 13, Ok(())));
    assert_eq!(&local[2000..2016], &[7u8; 16]);
    assert_eq!(image, vec![7u8; 64], "the read-only region is unchanged");
    b.deregister(read_only);
    b.deregister(region_b);
    a.deregister(region_a);
}

#[test]
fn clean_shutdown_reports_goodbye_and_joins() {
    let mut nodes = cluster(2, MeshConfig::default());
    let (b, rec_b) = nodes.pop().unwrap();
    let (a, rec_a) = nodes.pop().unwrap();
    let t = std::thread::spawn(move || b.shutdown());
    a.shutdown();
    t.join().unwrap();
    assert!(rec_a.events.lock().contains(&Event::Closed(1, true)));
    assert!(rec_b.events.lock().contains(&Event::Closed(0, true)));
}

/// A peer that says goodbye first makes this node queue its own goodbye; the send-queue count
/// must account for it (an uncounted frame once made the counter wrap below zero, and the next
/// send's limit check overflowed).
#[test]
fn a_peers_goodbye_leaves_the_send_queue_count_at_zero() {
    let mut nodes = cluster(2, MeshConfig::default());
    let (b, _) = nodes.pop().unwrap();
    let (a, rec_a) = nodes.pop().unwrap();
    b.shutdown();
    rec_a.wait_for("node 1's goodbye", Duration::from_secs(10), |e| e.contains(&Event::Closed(1, true)));
    // The reply goodbye is written (or dropped with the closed socket) soon after.
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.queued_bytes(1) != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(a.queued_bytes(1), 0);
    a.shutdown();
}

#[test]
fn a_vanished_peer_is_reported_as_lost() {
    let mut nodes = cluster(3, quick_config());
    let (c, _) = nodes.pop().unwrap();
    // Cut node 2 off without a goodbye: its sockets close under it.
    drop_without_goodbye(c);
    for (mesh, rec) in &nodes {
        rec.wait_for("loss of node 2", Duration::from_secs(5), |e| e.contains(&Event::Closed(2, false)));
        assert!(!mesh.is_alive(2));
        assert!(matches!(mesh.send(2, vec![1]), Err(TransportError::PeerGone(2))));
    }
    nodes[0].0.send(1, b"ok".to_vec()).unwrap();
    nodes[1].1.wait_for("message between survivors", Duration::from_secs(5), |e| e.iter().any(|e| matches!(e, Event::Message(0, _))));
}

fn drop_without_goodbye(mesh: Mesh) {
    mesh.abort();
}

#[test]
fn a_silent_peer_times_out() {
    // Node 1 connects but never starts its mesh: no heartbeats, no reads.
    let port = free_port();
    let coordinator = format!("127.0.0.1:{port}");
    let c2 = coordinator.clone();
    let silent = std::thread::spawn(move || join_cluster(1, 2, &c2, quick_config()).map(|(_, m)| m));
    let (_, a) = join_cluster(0, 2, &coordinator, quick_config()).unwrap();
    let silent = silent.join().unwrap().unwrap();
    let rec = Arc::new(Recorder::default());
    a.start(rec.clone()).unwrap();
    let started = Instant::now();
    rec.wait_for("the timeout", Duration::from_secs(5), |e| e.contains(&Event::Closed(1, false)));
    assert!(started.elapsed() >= Duration::from_millis(500));
    drop(silent);
}

#[test]
fn malformed_and_oversized_frames_close_only_that_connection() {
    for garbage in [vec![0u8; 16], {
        let mut h = ferry_tcp::Header { kind: ferry_tcp::FrameKind::Message, flags: 0, len: 0 }.encode().to_vec();
        h[4..8].copy_from_slice(&(2u32 << 20).to_le_bytes());
        h
    }] {
        // A 3-node mesh where node 2 is a hand-written impostor speaking the set-up protocol.
        let config = MeshConfig { max_frame: 1 << 20, ..quick_config() };
        let listeners: Vec<_> = (0..2).map(|_| bind_listener("127.0.0.1".parse().unwrap()).unwrap()).collect();
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).chain(["127.0.0.1:9".parse().unwrap()]).collect();
        let mut listeners = listeners.into_iter();
        let (l0, l1) = (listeners.next().unwrap(), listeners.next().unwrap());
        let (a0, a1) = (addrs.clone(), addrs.clone());
        let (c0, c1) = (config.clone(), config.clone());
        let n0 = std::thread::spawn(move || connect_mesh(0, &a0, l0, c0));
        let n1 = std::thread::spawn(move || connect_mesh(1, &a1, l1, c1));
        let mut impostors = Vec::new();
        for addr in &addrs[..2] {
            let mut s = TcpStream::connect(addr).unwrap();
            ferry_tcp::mesh_handshake(&mut s, 2, 3, &config.membership).unwrap();
            impostors.push(s);
        }
        let m0 = n0.join().unwrap().unwrap();
        let m1 = n1.join().unwrap().unwrap();
        let (r0, r1) = (Arc::new(Recorder::default()), Arc::new(Recorder::default()));
        m0.start(r0.clone()).unwrap();
        m1.start(r1.clone()).unwrap();
        impostors[0].write_all(&garbage).unwrap();
        r0.wait_for("the impostor's connection to close", Duration::from_secs(5), |e| e.contains(&Event::Closed(2, false)));
        m1.send(0, b"fine".to_vec()).unwrap();
        r0.wait_for("a message from the honest node", Duration::from_secs(5), |e| e.iter().any(|e| matches!(e, Event::Message(1, p) if p == b"fine")));
        assert!(m0.is_alive(1));
        assert!(!m0.is_alive(2));
    }
}

/// A failing send must not call the handler on the sending thread: senders may hold locks the
/// handler needs (the engine's protocol lock), which would deadlock.
#[test]
fn send_failures_are_reported_from_the_reader_thread() {
    struct ThreadCheck {
        sender: std::thread::ThreadId,
        closed_on: Mutex<Vec<std::thread::ThreadId>>,
    }
    impl Handler for ThreadCheck {
        fn on_message(&self, _: usize, _: bytes::Bytes) {}
        fn on_writes_landed(&self, _: usize, _: &[LandedWrite]) {}
        fn on_write_error(&self, _: usize, _: u64, _: AccessError) {}
        fn on_read_complete(&self, _: usize, _: u64, _: Result<(), AccessError>) {}
        fn on_peer_closed(&self, _: usize, _: Option<&TransportError>) {
            self.closed_on.lock().push(std::thread::current().id());
        }
    }
    let check = Arc::new(ThreadCheck { sender: std::thread::current().id(), closed_on: Mutex::new(Vec::new()) });
    let coordinator = format!("127.0.0.1:{}", free_port());
    let c2 = coordinator.clone();
    let other = std::thread::spawn(move || join_cluster(1, 2, &c2, quick_config()).map(|(_, m)| m));
    let (_, mesh) = join_cluster(0, 2, &coordinator, quick_config()).unwrap();
    let peer = other.join().unwrap().unwrap();
    mesh.start(check.clone()).unwrap();
    peer.abort();
    let big = vec![0u8; 8 << 20];
    for _ in 0..20 {
        if mesh.send(1, big.clone()).is_err() {
            break;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while check.closed_on.lock().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let threads = check.closed_on.lock().clone();
    assert_eq!(threads.len(), 1, "the loss is reported once");
    assert_ne!(threads[0], check.sender, "reported on the sending thread");
}

fn member(secret: &[u8], job: &str) -> MeshConfig {
    MeshConfig {
        connect_timeout: Duration::from_secs(8),
        membership: ferry_tcp::Membership { secret: Some(secret.to_vec()), job: job.into() },
        ..quick_config()
    }
}

/// Starts ranks 0 and 1 with these configurations; returns their set-up results.
fn two(c0: MeshConfig, c1: MeshConfig) -> (Result<Mesh, TransportError>, Result<Mesh, TransportError>) {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let c = coordinator.clone();
    let one = std::thread::spawn(move || join_cluster(1, 2, &c, c1).map(|(_, m)| m));
    let zero = join_cluster(0, 2, &coordinator, c0).map(|(_, m)| m);
    (zero, one.join().unwrap())
}

#[test]
fn only_holders_of_the_secret_in_the_same_job_join() {
    let secret = b"0123456789abcdef-cluster";
    let (a, b) = two(member(secret, "job-1"), member(secret, "job-1"));
    assert!(a.is_ok() && b.is_ok(), "members with the secret join");
    // A wrong secret or another job: the joining node is told, the coordinator never completes.
    let short = |c: MeshConfig| MeshConfig { connect_timeout: Duration::from_secs(3), ..c };
    for (c1, what) in [(member(b"another-secret-of-16", "job-1"), "secret"), (member(secret, "job-2"), "job")] {
        let started = Instant::now();
        let (a, b) = two(short(member(secret, "job-1")), short(c1));
        let e = b.err().expect("the stranger is refused").to_string();
        assert!(e.contains("does not hold this job's cluster secret"), "{what}: {e}");
        let e = a.err().expect("the coordinator does not complete").to_string();
        assert!(e.contains("ranks [1] never joined"), "{what}: {e}");
        assert!(started.elapsed() < Duration::from_secs(20));
    }
}

#[test]
fn strangers_cannot_stall_or_break_set_up() {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let secret = b"0123456789abcdef-cluster";
    let c = coordinator.clone();
    let zero = std::thread::spawn(move || join_cluster(0, 2, &c, member(secret, "j")).map(|(_, m)| m));
    // Before the real rank 1 comes: an idle connection, garbage, and a well-framed foreign
    // greeting; the coordinator drops each (the idle one after the handshake deadline).
    let addr: std::net::SocketAddr = coordinator.parse().unwrap();
    let connect = || loop {
        if let Ok(s) = std::net::TcpStream::connect(addr) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _idle = connect();
    let mut garbage = connect();
    let _ = garbage.write_all(&[0xff; 64]);
    let mut foreign = connect();
    let mut greeting = 20u32.to_le_bytes().to_vec();
    greeting.extend_from_slice(b"FERRY-RV");
    greeting.extend_from_slice(&[2, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0]);
    let _ = foreign.write_all(&greeting);
    // One that opens with a one-sided read request, as if it were a member.
    let mut reader = connect();
    let mut request = ferry_tcp::Header { kind: ferry_tcp::FrameKind::ReadRequest, flags: 0, len: 24 }.encode().to_vec();
    request.extend_from_slice(&[0u8; 24]);
    let _ = reader.write_all(&request);
    let started = Instant::now();
    let one = join_cluster(1, 2, &coordinator, member(secret, "j")).map(|(_, m)| m);
    assert!(one.is_ok(), "{:?}", one.err());
    assert!(zero.join().unwrap().is_ok());
    // Handshakes run concurrently: the idle stranger (dropped only after its 5 s deadline)
    // delays nobody.
    assert!(started.elapsed() < Duration::from_secs(4), "strangers delayed set-up by {:?}", started.elapsed());
    // None of them got a byte back: no memory, no greeting to build on.
    for (what, mut stranger) in [("garbage", garbage), ("a foreign greeting", foreign), ("a read request", reader)] {
        stranger.set_read_timeout(Some(Duration::from_secs(6))).unwrap();
        let mut got = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stranger, &mut got);
        assert!(got.is_empty(), "{what}: the stranger received {} bytes", got.len());
    }
}

/// A second process with a rank that already joined: the coordinator refuses it, and every
/// node — the refused one and those that joined — fails saying why, at once.
#[test]
fn a_duplicate_rank_fails_set_up_on_every_node_naming_it() {
    let coordinator = format!("127.0.0.1:{}", free_port());
    let config = MeshConfig { connect_timeout: Duration::from_secs(20), ..quick_config() };
    let started = Instant::now();
    let spawn = |rank: usize, delay: u64| {
        let (c, config) = (coordinator.clone(), config.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(delay));
            join_cluster(rank, 3, &c, config).map(|_| ())
        })
    };
    let zero = spawn(0, 0);
    let first = spawn(1, 0);
    let second = spawn(1, 500);
    for (who, outcome) in [("rank 0", zero), ("the first rank 1", first), ("the second rank 1", second)] {
        let e = outcome.join().unwrap().expect_err("set-up cannot succeed").to_string();
        assert!(e.contains("rank 1 joined twice"), "{who}: {e}");
    }
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
}

/// The coordinator's port is held by another program that accepts and says nothing: rank 0
/// fails at once saying the port is taken, rank 1 within the handshake deadline saying what it
/// found there — not after the whole start-up timeout.
#[test]
fn a_port_held_by_another_program_fails_both_sides_quickly() {
    let foreign = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let coordinator = foreign.local_addr().unwrap().to_string();
    let held = std::thread::spawn(move || {
        let mut kept = Vec::new();
        if let Ok((s, _)) = foreign.accept() {
            kept.push(s);
        }
        std::thread::sleep(Duration::from_secs(8));
    });
    let config = MeshConfig { connect_timeout: Duration::from_secs(30), ..quick_config() };
    let started = Instant::now();
    let e = join_cluster(0, 2, &coordinator, config.clone()).map(|_| ()).expect_err("the port is taken").to_string();
    assert!(e.contains("cannot listen") && e.contains("holds the port"), "rank 0: {e}");
    let e = join_cluster(1, 2, &coordinator, config).map(|_| ()).expect_err("not a coordinator").to_string();
    assert!(e.contains("did not let this node in") && e.contains("another program"), "rank 1: {e}");
    assert!(started.elapsed() < Duration::from_secs(8), "took {:?}", started.elapsed());
    held.join().unwrap();
}

/// Node 1 keeps its connection and heartbeats but stops reading. Node 0's submitter waits for
/// room once the queue reaches its limit (the queue never holds more than the limit plus a
/// message), and node 1 is declared lost within the liveness timeout, naming why. Without
/// waiting for room, the hard limit ends it sooner, with the queue bounded all the same.
#[test]
fn a_member_that_stops_reading_is_lost_and_its_queue_stays_bounded() {
    const LIMIT: usize = 1 << 20;
    const MESSAGE: usize = 64 << 10;
    for wait in [true, false] {
        let config = MeshConfig { send_queue_limit: LIMIT, ..quick_config() };
        let coordinator = format!("127.0.0.1:{}", free_port());
        let c = coordinator.clone();
        let stuck = MeshConfig { stop_reading_after: Some(0), ..config.clone() };
        let one = std::thread::spawn(move || join_cluster(1, 2, &c, stuck).map(|(_, m)| m));
        let (_, zero) = join_cluster(0, 2, &coordinator, config).unwrap();
        let one = one.join().unwrap().unwrap();
        let (rec0, rec1) = (Arc::new(Recorder::default()), Arc::new(Recorder::default()));
        zero.start(rec0.clone()).unwrap();
        one.start(rec1).unwrap();
        let started = Instant::now();
        let mut most = 0;
        let mut sent = 0usize;
        loop {
            if wait {
                zero.wait_for_room(Duration::from_secs(10)).unwrap();
            }
            if zero.send(1, vec![7; MESSAGE]).is_err() {
                break;
            }
            sent += MESSAGE;
            most = most.max(zero.queued_bytes(1));
            assert!(started.elapsed() < Duration::from_secs(10), "{sent} bytes sent into a peer that does not read, and it was never declared lost");
        }
        rec0.wait_for("the loss of node 1", Duration::from_secs(5), |e| e.contains(&Event::Closed(1, false)));
        let why = rec0.losses.lock().join("; ");
        assert!(why.contains("node 1 does not read"), "{why}");
        let bound = if wait { LIMIT + MESSAGE } else { 4 * LIMIT + MESSAGE } as u64;
        assert!(most <= bound, "the queue to node 1 held {most} bytes (bound {bound}); waited for room: {wait}");
        if wait {
            // Found by time (its queue took nothing, or its acknowledgements stopped), not by
            // the hard limit.
            assert!(why.contains("took none") || why.contains("it has read"), "declared lost for not draining: {why}");
        }
    }
}

/// Node 1 keeps its connection and heartbeats but stops reading, and node 0 sends it only a few
/// small messages (the kernels' buffers take them all, so node 0's send queue drains): node 1's
/// heartbeats stop acknowledging what it read, and node 0 declares it lost within the liveness
/// timeout, naming it, instead of waiting on it for as long as its callers would.
#[test]
fn a_member_that_stops_reading_light_traffic_is_found_by_its_acknowledgements() {
    let config = quick_config();
    let coordinator = format!("127.0.0.1:{}", free_port());
    let c = coordinator.clone();
    let stuck = MeshConfig { stop_reading_after: Some(0), ..config.clone() };
    let one = std::thread::spawn(move || join_cluster(1, 2, &c, stuck).map(|(_, m)| m));
    let (_, zero) = join_cluster(0, 2, &coordinator, config.clone()).unwrap();
    let one = one.join().unwrap().unwrap();
    let (rec0, rec1) = (Arc::new(Recorder::default()), Arc::new(Recorder::default()));
    zero.start(rec0.clone()).unwrap();
    one.start(rec1).unwrap();
    let started = Instant::now();
    for i in 0..10u8 {
        zero.send(1, vec![i; 100]).unwrap();
    }
    let drained = Instant::now() + Duration::from_secs(1);
    while zero.queued_bytes(1) > 0 && Instant::now() < drained {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(zero.queued_bytes(1), 0, "the kernel took the light traffic");
    rec0.wait_for("the loss of node 1", Duration::from_secs(5), |e| e.contains(&Event::Closed(1, false)));
    let took = started.elapsed();
    let why = rec0.losses.lock().join("; ");
    assert!(why.contains("node 1 does not read") && why.contains("it has read"), "{why}");
    assert!(took < config.peer_timeout * 3, "found after {took:?} (liveness timeout {:?})", config.peer_timeout);
}

/// Both directions busy and both reading: acknowledgements keep pace, and nobody is declared
/// lost for not reading.
#[test]
fn members_that_read_are_never_taken_for_stalled() {
    let config = quick_config();
    let mut meshes = cluster(2, config.clone());
    let (one, zero) = (meshes.pop().unwrap(), meshes.pop().unwrap());
    let until = Instant::now() + config.peer_timeout * 4;
    while Instant::now() < until {
        for (mesh, to) in [(&zero.0, 1), (&one.0, 0)] {
            mesh.send(to, vec![1; 32 << 10]).unwrap();
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(config.peer_timeout * 2);
    for (mesh, rec) in [&zero, &one] {
        assert!(rec.losses.lock().is_empty(), "a reading member was declared lost: {:?}", rec.losses.lock());
        assert!(mesh.is_alive(1 - mesh.rank()), "the connection broke");
    }
}

/// Sends `count` numbered messages of varied sizes (some larger than a socket read) from node 0
/// to node 1, and checks that node 1's handler saw them all, once each, in order.
fn numbered_messages_arrive_in_order(nodes: &[(Mesh, Arc<Recorder>)], count: u32, poll: impl Fn(&Mesh) + Send + Sync) {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let (stop, poll) = (&stop, &poll);
        let pollers: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Acquire) {
                        poll(&nodes[1].0);
                    }
                })
            })
            .collect();
        // The pollers stop however the wait ends (the scope joins them, a failed wait too).
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Release);
            }
        }
        let stopping = StopOnDrop(stop);
        for i in 0..count {
            let mut payload = i.to_le_bytes().to_vec();
            payload.resize(4 + (i as usize * 7919) % 20_000, (i % 251) as u8);
            nodes[0].0.send(1, payload).unwrap();
        }
        let events = nodes[1].1.wait_for("every message", Duration::from_secs(30), |e| e.len() >= count as usize);
        drop(stopping);
        for p in pollers {
            p.join().unwrap();
        }
        let seq: Vec<u32> = events
            .iter()
            .map(|e| match e {
                Event::Message(0, p) => {
                    let i = u32::from_le_bytes(p[..4].try_into().unwrap());
                    assert_eq!(p.len(), 4 + (i as usize * 7919) % 20_000, "message {i} arrived whole");
                    assert!(p[4..].iter().all(|&b| b == (i % 251) as u8), "message {i} arrived intact");
                    i
                }
                other => panic!("unexpected event {other:?}"),
            })
            .collect();
        assert_eq!(seq, (0..count).collect::<Vec<_>>());
    });
}

#[test]
fn threads_polling_beside_the_reader_keep_frames_whole_and_in_order() {
    // Two threads take turns with the reader thread (sleeping, not busy-polling) at reading the
    // connection and handing its frames on.
    let nodes = cluster(2, MeshConfig { poll_readers: Some(0), ..MeshConfig::default() });
    assert_eq!(nodes[1].0.poll_readers(), 0);
    assert_eq!(nodes[1].0.nodes_on_host(), 2, "loopback peers run on this host");
    numbered_messages_arrive_in_order(&nodes, 20_000, |mesh| {
        mesh.start_polling();
        mesh.poll_receive();
        mesh.stop_polling();
    });
    for (mesh, _) in &nodes {
        mesh.shutdown();
    }
}

#[test]
fn a_busy_polling_reader_delivers_everything_in_order_and_sleeps_when_idle() {
    let nodes = cluster(2, MeshConfig { poll_readers: Some(1), poll_window: Duration::from_millis(5), ..MeshConfig::default() });
    assert_eq!(nodes[1].0.poll_readers(), 1);
    // Polling threads that do not count themselves leave the reader busy-polling beside them.
    numbered_messages_arrive_in_order(&nodes, 20_000, |mesh| {
        mesh.poll_receive();
    });
    // Idle, the reader sleeps: the process's CPU time stays far below the wall time.
    let cpu = || {
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
        // SAFETY: `usage` is writable and getrusage fills it on success.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) }, 0);
        // SAFETY: initialised by the successful call above.
        let u = unsafe { usage.assume_init() };
        Duration::new(u.ru_utime.tv_sec as u64, u.ru_utime.tv_usec as u32 * 1000) + Duration::new(u.ru_stime.tv_sec as u64, u.ru_stime.tv_usec as u32 * 1000)
    };
    std::thread::sleep(Duration::from_millis(50));
    let before = cpu();
    std::thread::sleep(Duration::from_millis(500));
    let used = cpu() - before;
    assert!(used < Duration::from_millis(150), "idle readers used {used:?} of CPU in 500 ms");
    for (mesh, _) in &nodes {
        mesh.shutdown();
    }
}

#[test]
fn the_machine_chooses_busy_polling_readers_only_with_cores_to_spare() {
    assert_eq!(ferry_tcp::auto_poll_readers(2, 1), 0);
    assert_eq!(ferry_tcp::auto_poll_readers(2, 2), 0);
    assert_eq!(ferry_tcp::auto_poll_readers(4, 1), 1);
    assert_eq!(ferry_tcp::auto_poll_readers(8, 2), 1);
    assert_eq!(ferry_tcp::auto_poll_readers(8, 3), 0);
    assert_eq!(ferry_tcp::auto_poll_readers(64, 0), 1, "a count of 0 nodes is taken as 1");
}
