//! Tests against real verbs devices.
//!
//! `FERRY_VERBS_DEVICES=rxe0,rxe1` names the two devices to connect (the soft-RoCE VM sets it;
//! see `tests/rxe/`). Without it the first device with an active port is used for both ends (a
//! loopback connection). On a host with no verbs at all, every test instead checks that the
//! absence is reported as [`VerbsError::Unavailable`]; `FERRY_VERBS_REQUIRE=1` turns that case
//! into a failure, so the VM run cannot silently test nothing.

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferry_verbs::{
    Access, Backoff, Completion, CompletionHandler, CompletionKind, CompletionQueue, CompletionStatus, Context, Endpoint, Operation, Payload, Poller,
    QueuePair, QueuePairCaps, RemoteRegion, RemoteSlice, Selection, SendRequest, VerbsError, exchange, probe,
};

fn selections() -> Option<(Selection, Selection)> {
    if let Ok(list) = std::env::var("FERRY_VERBS_DEVICES") {
        let names: Vec<&str> = list.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        assert_eq!(names.len(), 2, "FERRY_VERBS_DEVICES must name two devices, got '{list}'");
        let sel = |name: &str| Selection { device: Some(name.to_string()), ..Default::default() };
        return Some((sel(names[0]), sel(names[1])));
    }
    match probe(&Selection::default()) {
        Ok(chosen) => {
            let sel = Selection { device: Some(chosen.device), port: Some(chosen.port), gid_index: Some(chosen.gid_index) };
            Some((sel.clone(), sel))
        }
        Err(e) => {
            assert!(std::env::var("FERRY_VERBS_REQUIRE").is_err(), "FERRY_VERBS_REQUIRE is set but this host has no verbs: {e}");
            assert!(matches!(e, VerbsError::Unavailable(_)), "the absence of verbs must be reported as Unavailable, got {e:?}");
            assert!(matches!(Context::open(&Selection::default()), Err(VerbsError::Unavailable(_))));
            None
        }
    }
}

/// Two connected queue pairs, one per device, each with its own completion queue.
struct Pair {
    a: Context,
    b: Context,
    cq_a: Arc<CompletionQueue>,
    cq_b: Arc<CompletionQueue>,
    qp_a: QueuePair,
    qp_b: QueuePair,
}

/// Trades endpoints over a real loopback TCP connection, as nodes do.
fn trade(local: Endpoint, mut stream: TcpStream) -> Endpoint {
    Endpoint::decode(&exchange(&mut stream, &local.encode()).unwrap()).unwrap()
}

fn pair() -> Option<Pair> {
    let (sa, sb) = selections()?;
    let a = Context::open(&sa).unwrap();
    let b = Context::open(&sb).unwrap();
    let cq_a = CompletionQueue::new(&a, 256).unwrap();
    let cq_b = CompletionQueue::new(&b, 256).unwrap();
    let caps = QueuePairCaps { max_send: 64, max_recv: 64, max_inline: 64 };
    let mut qp_a = QueuePair::new(&a, &cq_a, caps).unwrap();
    let mut qp_b = QueuePair::new(&b, &cq_b, caps).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let end_b = qp_b.endpoint();
    let t = std::thread::spawn(move || trade(end_b, listener.accept().unwrap().0));
    let remote_b = trade(qp_a.endpoint(), TcpStream::connect(addr).unwrap());
    let remote_a = t.join().unwrap();
    assert_eq!(remote_b, qp_b.endpoint());
    qp_a.connect(&remote_b).unwrap();
    qp_b.connect(&remote_a).unwrap();
    assert!(qp_a.connect(&remote_b).is_err(), "connecting twice is refused");
    Some(Pair { a, b, cq_a, cq_b, qp_a, qp_b })
}

/// Polls until `n` completions arrived (the VM is slow: generous deadline).
fn wait(cq: &CompletionQueue, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    while out.len() < n {
        let want = n - out.len();
        cq.poll(&mut out, want).unwrap();
        assert!(Instant::now() < deadline, "only {} of {n} completions after 30 s: {out:?}", out.len());
        std::thread::yield_now();
    }
    out
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn registration_of_caller_memory() {
    let Some((sa, _)) = selections() else { return };
    let ctx = Context::open(&sa).unwrap();
    let mut memory = vec![0u8; 1 << 16];
    // SAFETY: `memory` outlives the region (dropped at the end of this scope, after `region`).
    let region = unsafe { ctx.register(memory.as_mut_ptr(), memory.len(), Access::REMOTE).unwrap() };
    assert_eq!(region.addr(), memory.as_ptr() as u64);
    assert_eq!(region.len(), 1 << 16);
    assert_eq!(region.remote().rkey, region.rkey());
    assert!(region.slice(65_000, 536).is_ok());
    assert!(matches!(region.slice(65_000, 537), Err(VerbsError::Invalid(_))));
    assert!(region.slice_at(region.addr() + 10, 10).is_some());
    assert!(region.slice_at(region.addr() - 1, 10).is_none());
    // SAFETY: an empty registration is refused before anything touches the pointer.
    assert!(matches!(unsafe { ctx.register(memory.as_mut_ptr(), 0, Access::LOCAL) }, Err(VerbsError::Invalid(_))));
    drop(region);
    let owned = ctx.alloc(4096, Access::LOCAL).unwrap();
    owned.write(4000, &[7; 96]).unwrap();
    let mut back = [0u8; 96];
    owned.read(4000, &mut back).unwrap();
    assert_eq!(back, [7; 96]);
    assert!(owned.write(4001, &[7; 96]).is_err());
}

#[test]
fn rdma_write_lands_byte_for_byte() {
    let Some(mut p) = pair() else { return };
    let src = p.a.alloc(64 << 10, Access::LOCAL).unwrap();
    let dst = p.b.alloc(64 << 10, Access::REMOTE).unwrap();
    let remote = RemoteRegion::decode(&dst.region().remote().encode()).unwrap();
    let data = pattern(64 << 10, 3);
    src.write(0, &data).unwrap();
    // Several writes of different sizes and offsets in one post, one signaled at the end
    // (completions of one queue pair come in order, so the last implies the others).
    let pieces = [(0usize, 1usize), (1, 63), (64, 4032), (4096, 61_440)];
    let requests: Vec<SendRequest> = pieces
        .iter()
        .enumerate()
        .map(|(i, &(off, len))| SendRequest {
            wr_id: i as u64,
            op: Operation::Write { remote: remote.slice(off as u64, len as u64).unwrap(), imm: None },
            payload: Payload::Local(src.slice(off, len).unwrap()),
            signaled: i == pieces.len() - 1,
        })
        .collect();
    // SAFETY: `src` and `dst` live until the completion below.
    unsafe { p.qp_a.post_send(&requests).unwrap() };
    let done = wait(&p.cq_a, 1);
    assert_eq!(done[0].wr_id, 3);
    done[0].result().unwrap();
    assert_eq!(done[0].kind, CompletionKind::Write);
    let mut landed = vec![0u8; 64 << 10];
    dst.read(0, &mut landed).unwrap();
    assert!(landed == data, "written bytes differ");
    // Inline payloads are copied at posting time.
    let inline = pattern(48, 99);
    let request =
        SendRequest { wr_id: 9, op: Operation::Write { remote: remote.slice(100, 48).unwrap(), imm: None }, payload: Payload::Inline(&inline), signaled: true };
    // SAFETY: no local buffer is involved.
    unsafe { p.qp_a.post_send(&[request]).unwrap() };
    wait(&p.cq_a, 1)[0].result().unwrap();
    let mut back = [0u8; 48];
    dst.read(100, &mut back).unwrap();
    assert_eq!(back.to_vec(), inline);
}

#[test]
fn write_with_immediate_completes_a_receive_after_the_bytes() {
    let Some(mut p) = pair() else { return };
    let src = p.a.alloc(8192, Access::LOCAL).unwrap();
    let dst = p.b.alloc(8192, Access::REMOTE).unwrap();
    let scratch = p.b.alloc(64, Access::LOCAL).unwrap();
    let remote = dst.region().remote();
    // SAFETY: the receive buffers live until the end of the test.
    unsafe { p.qp_b.post_recvs(&[(70, scratch.slice(0, 64).unwrap()), (71, scratch.slice(0, 64).unwrap())]).unwrap() };
    let data = pattern(8192, 17);
    src.write(0, &data).unwrap();
    let requests = [
        SendRequest {
            wr_id: 1,
            op: Operation::Write { remote: remote.slice(0, 8192).unwrap(), imm: Some(0xC0FFEE) },
            payload: Payload::Local(src.slice(0, 8192).unwrap()),
            signaled: true,
        },
        SendRequest { wr_id: 2, op: Operation::Write { remote: remote.slice(0, 0).unwrap(), imm: Some(0) }, payload: Payload::Empty, signaled: true },
    ];
    // SAFETY: buffers live until the completions below.
    unsafe { p.qp_a.post_send(&requests).unwrap() };
    let sent = wait(&p.cq_a, 2);
    assert!(sent.iter().all(|c| c.result().is_ok()));
    let got = wait(&p.cq_b, 2);
    assert_eq!((got[0].wr_id, got[0].kind, got[0].imm), (70, CompletionKind::RecvWriteImm, Some(0xC0FFEE)));
    assert_eq!((got[1].wr_id, got[1].kind, got[1].imm), (71, CompletionKind::RecvWriteImm, Some(0)));
    let mut landed = vec![0u8; 8192];
    dst.read(0, &mut landed).unwrap();
    assert!(landed == data, "bytes were not in place when the immediate arrived");
}

#[test]
fn rdma_read_fetches_byte_for_byte() {
    let Some(mut p) = pair() else { return };
    let dst = p.a.alloc(32 << 10, Access::LOCAL).unwrap();
    let src = p.b.alloc(32 << 10, Access::REMOTE_READ).unwrap();
    let data = pattern(32 << 10, 5);
    src.write(0, &data).unwrap();
    let remote = src.region().remote();
    let requests: Vec<SendRequest> = (0..4)
        .map(|i| SendRequest {
            wr_id: 40 + i,
            op: Operation::Read { remote: remote.slice(i * 8192, 8192).unwrap() },
            payload: Payload::Local(dst.slice(i as usize * 8192, 8192).unwrap()),
            signaled: true,
        })
        .collect();
    // SAFETY: buffers live until the completions below.
    unsafe { p.qp_a.post_send(&requests).unwrap() };
    let done = wait(&p.cq_a, 4);
    assert_eq!(done.iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![40, 41, 42, 43]);
    assert!(done.iter().all(|c| c.result().is_ok() && c.kind == CompletionKind::Read));
    let mut fetched = vec![0u8; 32 << 10];
    dst.read(0, &mut fetched).unwrap();
    assert!(fetched == data, "read bytes differ");
    let inline = [0u8; 4];
    let bad = SendRequest { wr_id: 1, op: Operation::Read { remote: remote.slice(0, 4).unwrap() }, payload: Payload::Inline(&inline), signaled: true };
    // SAFETY: refused before posting.
    assert!(matches!(unsafe { p.qp_a.post_send(&[bad]) }, Err(VerbsError::Invalid(_))));
}

#[test]
fn send_and_receive_with_and_without_immediates() {
    let Some(mut p) = pair() else { return };
    let rx = p.b.alloc(8 * 4096, Access::LOCAL).unwrap();
    let tx = p.a.alloc(4096, Access::LOCAL).unwrap();
    let receives: Vec<(u64, _)> = (0..8).map(|i| (100 + i, rx.slice(i as usize * 4096, 4096).unwrap())).collect();
    // SAFETY: the receive buffers live until the end of the test.
    unsafe { p.qp_b.post_recvs(&receives).unwrap() };
    let big = pattern(4096, 11);
    tx.write(0, &big).unwrap();
    let small = pattern(40, 1);
    let requests = [
        SendRequest { wr_id: 1, op: Operation::Send { imm: None }, payload: Payload::Inline(&small), signaled: true },
        SendRequest { wr_id: 2, op: Operation::Send { imm: Some(77) }, payload: Payload::Local(tx.slice(0, 4096).unwrap()), signaled: true },
        SendRequest { wr_id: 3, op: Operation::Send { imm: Some(78) }, payload: Payload::Empty, signaled: true },
    ];
    // SAFETY: `tx` lives until the completions below.
    unsafe { p.qp_a.post_send(&requests).unwrap() };
    assert!(wait(&p.cq_a, 3).iter().all(|c| c.result().is_ok() && c.kind == CompletionKind::Send));
    let got = wait(&p.cq_b, 3);
    assert_eq!((got[0].wr_id, got[0].kind, got[0].byte_len, got[0].imm), (100, CompletionKind::Recv, 40, None));
    assert_eq!((got[1].wr_id, got[1].byte_len, got[1].imm), (101, 4096, Some(77)));
    assert_eq!((got[2].wr_id, got[2].byte_len, got[2].imm), (102, 0, Some(78)));
    let mut first = [0u8; 40];
    rx.read(0, &mut first).unwrap();
    assert_eq!(first.to_vec(), small);
    let mut second = vec![0u8; 4096];
    rx.read(4096, &mut second).unwrap();
    assert!(second == big);
    let too_big = pattern(65, 0);
    let request = SendRequest { wr_id: 4, op: Operation::Send { imm: None }, payload: Payload::Inline(&too_big), signaled: true };
    // SAFETY: refused before posting.
    assert!(matches!(unsafe { p.qp_a.post_send(&[request]) }, Err(VerbsError::Invalid(_))));
}

fn expect_remote_access_error(mut p: Pair, remote: RemoteSlice, read: bool) {
    let local = p.a.alloc(4096, Access::LOCAL).unwrap();
    let op = if read { Operation::Read { remote } } else { Operation::Write { remote, imm: None } };
    let request = SendRequest { wr_id: 55, op, payload: Payload::Local(local.slice(0, 64).unwrap()), signaled: true };
    // SAFETY: `local` lives until the completion below.
    unsafe { p.qp_a.post_send(&[request]).unwrap() };
    let done = wait(&p.cq_a, 1);
    let err = done[0].result().unwrap_err();
    assert!(matches!(err, VerbsError::Completion { wr_id: 55, status: CompletionStatus::RemoteAccess, .. }), "expected a remote access error, got {err}");
    // The queue pair is now in the error state: later requests are flushed, not lost silently.
    let again = SendRequest { wr_id: 56, op: Operation::Send { imm: None }, payload: Payload::Empty, signaled: true };
    // SAFETY: no local buffer is involved.
    if unsafe { p.qp_a.post_send(&[again]) }.is_ok() {
        let flushed = wait(&p.cq_a, 1);
        assert!(matches!(flushed[0].result(), Err(VerbsError::Completion { wr_id: 56, status: CompletionStatus::Flushed, .. })), "{flushed:?}");
    }
    p.qp_b.fail().unwrap();
}

#[test]
fn bad_rkey_is_a_remote_access_error() {
    let Some(p) = pair() else { return };
    let target = p.b.alloc(4096, Access::REMOTE).unwrap();
    let remote = RemoteSlice { addr: target.region().addr(), rkey: target.region().rkey() ^ 0x5A5A_0000 };
    expect_remote_access_error(p, remote, false);
}

#[test]
fn out_of_bounds_read_and_write_are_remote_access_errors() {
    let Some(p) = pair() else { return };
    let target = p.b.alloc(4096, Access::REMOTE).unwrap();
    let past_end = RemoteSlice { addr: target.region().addr() + 4096 - 32, rkey: target.region().rkey() };
    expect_remote_access_error(p, past_end, true);
    let Some(p) = pair() else { return };
    let target = p.b.alloc(4096, Access::REMOTE).unwrap();
    let before = RemoteSlice { addr: target.region().addr() - 4096, rkey: target.region().rkey() };
    expect_remote_access_error(p, before, false);
}

#[test]
fn writes_into_read_only_memory_are_refused() {
    let Some(p) = pair() else { return };
    let target = p.b.alloc(4096, Access::REMOTE_READ).unwrap();
    let remote = target.region().remote().slice(0, 64).unwrap();
    expect_remote_access_error(p, remote, false);
}

struct Forward(mpsc::Sender<Completion>);

impl CompletionHandler for Forward {
    fn on_completions(&mut self, batch: &[Completion]) {
        for c in batch {
            let _ = self.0.send(*c);
        }
    }
    fn on_poll_error(&mut self, error: VerbsError) {
        panic!("poll failed: {error}");
    }
}

#[test]
fn poller_thread_delivers_every_completion_in_order() {
    let Some(mut p) = pair() else { return };
    let (tx, rx) = mpsc::channel();
    let mut poller = Poller::spawn("test-poller".into(), p.cq_b.clone(), Backoff::default(), Forward(tx)).unwrap();
    let buffers = p.b.alloc(64 * 64, Access::LOCAL).unwrap();
    let receives: Vec<(u64, _)> = (0..64).map(|i| (i, buffers.slice(i as usize * 64, 64).unwrap())).collect();
    // SAFETY: the buffers live until the poller has seen every receive.
    unsafe { p.qp_b.post_recvs(&receives).unwrap() };
    for round in 0..4u32 {
        let requests: Vec<SendRequest> = (0..16u32)
            .map(|i| SendRequest { wr_id: i as u64, op: Operation::Send { imm: Some(round * 16 + i) }, payload: Payload::Empty, signaled: i == 15 })
            .collect();
        // SAFETY: no local buffers are involved.
        unsafe { p.qp_a.post_send(&requests).unwrap() };
        wait(&p.cq_a, 1)[0].result().unwrap();
    }
    let got: Vec<Completion> = (0..64).map(|_| rx.recv_timeout(Duration::from_secs(30)).expect("the poller stalled")).collect();
    assert_eq!(got.iter().map(|c| c.imm).collect::<Vec<_>>(), (0..64).map(Some).collect::<Vec<_>>());
    assert_eq!(got.iter().map(|c| c.wr_id).collect::<Vec<_>>(), (0..64).collect::<Vec<_>>());
    poller.stop();
}

#[test]
fn an_idle_poller_blocks_and_is_woken_by_the_next_completion() {
    let Some(mut p) = pair() else { return };
    let (tx, rx) = mpsc::channel();
    // A tiny spin and a long blocking wait: a completion that arrives while the poller waits
    // can only reach it in time through the completion channel's event.
    let backoff = Backoff { spin: Duration::from_micros(1), block: Duration::from_secs(4) };
    let mut poller = Poller::spawn("test-idle-poller".into(), p.cq_b.clone(), backoff, Forward(tx)).unwrap();
    let buffers = p.b.alloc(3 * 64, Access::LOCAL).unwrap();
    let receives: Vec<(u64, _)> = (0..3).map(|i| (i, buffers.slice(i as usize * 64, 64).unwrap())).collect();
    // SAFETY: the buffers live until the poller has seen every receive.
    unsafe { p.qp_b.post_recvs(&receives).unwrap() };
    for round in 0..3u32 {
        std::thread::sleep(Duration::from_millis(300)); // the poller is blocked by now
        let request = SendRequest { wr_id: round as u64, op: Operation::Send { imm: Some(round) }, payload: Payload::Empty, signaled: true };
        // SAFETY: no local buffers are involved.
        unsafe { p.qp_a.post_send(&[request]).unwrap() };
        wait(&p.cq_a, 1)[0].result().unwrap();
        let got = rx.recv_timeout(Duration::from_secs(2)).expect("the blocked poller was not woken by the completion");
        assert_eq!(got.imm, Some(round));
    }
    poller.stop();
}
