//! Completion queues and reliable-connected queue pairs.

use std::sync::Arc;

use parking_lot::Mutex;
use std::os::fd::AsRawFd;
use std::time::Duration;

use rdma_mummy_sys::{ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq, ibv_wc};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{CompletionChannel, CompletionQueue as _, GenericCompletionQueue};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    GenericQueuePair, PostSendGuard, QueuePair as _, QueuePairAttribute, QueuePairState, SetInlineData, SetScatterGatherEntry, WorkRequestFlags,
};

use crate::context::{Context, LocalSlice, RemoteSlice};
use crate::device::LinkLayer;
use crate::error::{CompletionStatus, Result, VerbsError};

/// What a completed work request was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionKind {
    /// A SEND this side posted.
    Send,
    /// An RDMA WRITE (with or without immediate) this side posted.
    Write,
    /// An RDMA READ this side posted.
    Read,
    /// A receive consumed by the peer's SEND.
    Recv,
    /// A receive consumed by the peer's RDMA WRITE WITH IMMEDIATE (no bytes land in it).
    RecvWriteImm,
    /// Anything else; the raw opcode is kept. Failed completions carry no valid opcode.
    Other(u32),
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The id the work request was posted with.
    pub wr_id: u64,
    /// What it was (valid only when it succeeded).
    pub kind: CompletionKind,
    /// Bytes received (receives only).
    pub byte_len: u32,
    /// The immediate of a SEND WITH IMMEDIATE or WRITE WITH IMMEDIATE (receives only).
    pub imm: Option<u32>,
    /// Why it failed, with the vendor's error code.
    pub error: Option<(CompletionStatus, u32)>,
}

impl Completion {
    /// The completion as a result.
    pub fn result(&self) -> Result<()> {
        match self.error {
            None => Ok(()),
            Some((status, vendor_error)) => Err(VerbsError::Completion { wr_id: self.wr_id, status, vendor_error }),
        }
    }
}

/// A completion queue shared by any number of queue pairs, with a completion channel so that an
/// idle poller can block until the next completion instead of polling.
pub struct CompletionQueue {
    cq: GenericCompletionQueue,
    /// Declared after `cq`: the queue is destroyed before its channel.
    channel: Arc<CompletionChannel>,
    /// Reused completion array for `ibv_poll_cq`; the lock also serializes pollers.
    scratch: Mutex<Vec<ibv_wc>>,
    entries: u32,
}

// SAFETY: the raw `ibv_wc` records in `scratch` are plain data behind a mutex, and libibverbs
// allows polling a CQ from any thread.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above; every use of `scratch` holds its mutex.
unsafe impl Sync for CompletionQueue {}

/// `IBV_WC_WITH_IMM` of `enum ibv_wc_flags`.
const WC_WITH_IMM: u32 = 1 << 1;

impl CompletionQueue {
    /// Creates a queue of at least `entries` completions.
    ///
    /// This is a classic CQ polled with `ibv_poll_cq` into a reused array: no allocation per
    /// poll, and it behaves the same on every provider (the extended `ibv_start_poll` interface
    /// miscounted consumed entries on soft-RoCE in our tests).
    pub fn new(context: &Context, entries: u32) -> Result<Arc<CompletionQueue>> {
        let channel =
            CompletionChannel::new(&context.device).map_err(|e| VerbsError::Resource { what: "creating a completion channel", reason: e.to_string() })?;
        // Non-blocking: `wait` sleeps in poll(2) with a timeout, then drains the events.
        channel.set_nonblocking(true).map_err(|e| VerbsError::Resource { what: "configuring a completion channel", reason: e.to_string() })?;
        let mut builder = context.device.create_cq_builder();
        builder.setup_cqe(entries.max(1)).setup_comp_channel(&channel, 0);
        let cq = builder.build().map_err(|e| VerbsError::Resource { what: "creating a completion queue", reason: e.to_string() })?;
        Ok(Arc::new(CompletionQueue { cq: GenericCompletionQueue::from(cq), channel, scratch: Mutex::new(Vec::with_capacity(64)), entries }))
    }

    fn raw(&self) -> *mut ibv_cq {
        // SAFETY: the handle is only used while `self.cq` lives (every caller borrows `self`).
        unsafe { self.cq.cq().as_ptr() }
    }

    /// Asks for an event on the completion channel when the next completion arrives. A
    /// completion already queued raises none: poll once more after arming, then [`wait`].
    ///
    /// [`wait`]: CompletionQueue::wait
    pub fn arm(&self) -> Result<()> {
        // SAFETY: the CQ handle is valid while `self` lives; arming may be repeated.
        let rc = unsafe { ibv_req_notify_cq(self.raw(), 0) };
        if rc != 0 {
            return Err(VerbsError::Resource { what: "arming a completion queue", reason: std::io::Error::from_raw_os_error(rc.abs()).to_string() });
        }
        Ok(())
    }

    /// Blocks until the armed queue raises an event or `timeout` passes; returns whether an
    /// event came. Events are acknowledged at once.
    pub fn wait(&self, timeout: Duration) -> Result<bool> {
        let mut fd = libc::pollfd { fd: self.channel.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let millis = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `fd` is one valid pollfd record and the count says one.
        let ready = unsafe { libc::poll(&mut fd, 1, millis) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(VerbsError::Resource { what: "waiting on a completion channel", reason: e.to_string() });
        }
        let mut events = 0u32;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut cq_context: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is valid while `self` lives; the out-pointers are valid
            // locals. The descriptor is non-blocking, so this returns -1 once none is left.
            let rc = unsafe { ibv_get_cq_event(self.channel.comp_channel().as_ptr(), &mut cq, &mut cq_context) };
            if rc != 0 {
                break;
            }
            events += 1;
        }
        if events > 0 {
            // SAFETY: acknowledges exactly the events taken above, all for this queue (the
            // channel serves no other); destroying the queue requires it.
            unsafe { ibv_ack_cq_events(self.raw(), events) };
        }
        Ok(events > 0)
    }

    /// Capacity asked for at creation.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Moves up to `max` completions into `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut scratch = self.scratch.lock();
        let want = max.min(scratch.capacity()).min(i32::MAX as usize);
        if want == 0 {
            return Ok(0);
        }
        // SAFETY: the CQ handle is valid while `self.cq` lives; `scratch` has room for `want`
        // records, which `ibv_poll_cq` fills from the start and reports how many it wrote.
        let got = unsafe { ibv_poll_cq(self.raw(), want as i32, scratch.as_mut_ptr()) };
        if got < 0 {
            return Err(VerbsError::Resource { what: "polling a completion queue", reason: std::io::Error::from_raw_os_error(-got).to_string() });
        }
        // SAFETY: `ibv_poll_cq` initialized the first `got` records (got <= want <= capacity).
        unsafe { scratch.set_len(got as usize) };
        for wc in scratch.iter() {
            let error = (wc.status != 0).then(|| (CompletionStatus::from_raw(wc.status), wc.vendor_err));
            let kind = match (error, wc.opcode) {
                (Some(_), _) => CompletionKind::Other(u32::MAX),
                (None, 0) => CompletionKind::Send,
                (None, 1) => CompletionKind::Write,
                (None, 2) => CompletionKind::Read,
                (None, 128) => CompletionKind::Recv,
                (None, 129) => CompletionKind::RecvWriteImm,
                (None, other) => CompletionKind::Other(other),
            };
            let receive = matches!(kind, CompletionKind::Recv | CompletionKind::RecvWriteImm);
            // SAFETY: reading the immediate arm of a plain-data union of two u32s.
            let imm = (receive && wc.wc_flags & WC_WITH_IMM != 0).then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
            out.push(Completion { wr_id: wc.wr_id, kind, byte_len: if receive { wc.byte_len } else { 0 }, imm, error });
        }
        scratch.clear();
        Ok(got as usize)
    }
}

/// Sizes of a queue pair's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuePairCaps {
    /// Outstanding send-queue work requests.
    pub max_send: u32,
    /// Outstanding receives.
    pub max_recv: u32,
    /// Largest payload that may be copied into the work request itself.
    pub max_inline: u32,
}

impl Default for QueuePairCaps {
    fn default() -> Self {
        QueuePairCaps { max_send: 128, max_recv: 128, max_inline: 64 }
    }
}

/// What a peer needs to connect its queue pair to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue-pair number.
    pub qpn: u32,
    /// First packet sequence number this side sends with.
    pub psn: u32,
    /// LID (InfiniBand).
    pub lid: u16,
    /// GID (RoCE, or InfiniBand across subnets).
    pub gid: [u8; 16],
    /// Active MTU in bytes.
    pub mtu: u32,
    /// The port's link layer.
    pub link_layer: LinkLayer,
}

const ENDPOINT_MAGIC: [u8; 2] = *b"FV";
const ENDPOINT_VERSION: u8 = 1;

impl Endpoint {
    /// Encoded size.
    pub const BYTES: usize = 32;

    /// Encoding for the connection exchange.
    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..2].copy_from_slice(&ENDPOINT_MAGIC);
        out[2] = ENDPOINT_VERSION;
        out[3] = match self.link_layer {
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
            LinkLayer::Unspecified => 0,
        };
        out[4..8].copy_from_slice(&self.qpn.to_le_bytes());
        out[8..12].copy_from_slice(&self.psn.to_le_bytes());
        out[12..14].copy_from_slice(&self.lid.to_le_bytes());
        out[14..16].copy_from_slice(&(self.mtu.min(u16::MAX as u32) as u16).to_le_bytes());
        out[16..].copy_from_slice(&self.gid);
        out
    }

    /// Decodes [`Endpoint::encode`]'s output, refusing anything malformed.
    pub fn decode(bytes: &[u8]) -> Result<Endpoint> {
        let bad = |m: String| Err(VerbsError::Exchange(m));
        if bytes.len() != Self::BYTES || bytes[..2] != ENDPOINT_MAGIC {
            return bad(format!("not a queue-pair endpoint ({} bytes)", bytes.len()));
        }
        if bytes[2] != ENDPOINT_VERSION {
            return bad(format!("endpoint version {}, expected {ENDPOINT_VERSION}", bytes[2]));
        }
        let link_layer = match bytes[3] {
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            0 => LinkLayer::Unspecified,
            other => return bad(format!("unknown link layer {other}")),
        };
        let psn = u32::from_le_bytes(bytes[8..12].try_into().expect("4"));
        if psn > 0xFF_FFFF {
            return bad(format!("packet sequence number {psn:#x} is wider than 24 bits"));
        }
        Ok(Endpoint {
            qpn: u32::from_le_bytes(bytes[4..8].try_into().expect("4")),
            psn,
            lid: u16::from_le_bytes(bytes[12..14].try_into().expect("2")),
            mtu: u16::from_le_bytes(bytes[14..16].try_into().expect("2")) as u32,
            gid: bytes[16..].try_into().expect("16"),
            link_layer,
        })
    }
}

/// The data a send-queue work request carries.
#[derive(Debug, Clone, Copy)]
pub enum Payload<'a> {
    /// No bytes (a zero-length SEND or WRITE WITH IMMEDIATE).
    Empty,
    /// Bytes copied into the work request at posting time (at most `max_inline`).
    Inline(&'a [u8]),
    /// Registered local memory, read (or for READ written) by the device after posting.
    Local(LocalSlice),
}

/// A send-queue operation.
#[derive(Debug, Clone, Copy)]
pub enum Operation {
    /// Two-sided SEND, consuming one of the peer's receives; the immediate, if any, is
    /// delivered with it.
    Send {
        /// Immediate value.
        imm: Option<u32>,
    },
    /// One-sided RDMA WRITE into the peer's memory; with an immediate it also consumes one of
    /// the peer's receives, which completes (with the immediate) once the bytes are in place.
    Write {
        /// Destination.
        remote: RemoteSlice,
        /// Immediate value.
        imm: Option<u32>,
    },
    /// One-sided RDMA READ of the peer's memory into the local payload.
    Read {
        /// Source.
        remote: RemoteSlice,
    },
}

/// One send-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct SendRequest<'a> {
    /// Id reported back in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: Operation,
    /// The local bytes.
    pub payload: Payload<'a>,
    /// Whether a completion is generated on success (failures always generate one).
    pub signaled: bool,
}

/// A reliable-connected queue pair.
pub struct QueuePair {
    qp: GenericQueuePair,
    port: u8,
    gid_index: u32,
    gid: [u8; 16],
    lid: u16,
    mtu: u32,
    link_layer: LinkLayer,
    max_rd_atomic: u8,
    max_inline: u32,
    psn: u32,
    connected: bool,
}

fn mtu_enum(bytes: u32) -> Mtu {
    match bytes {
        0..=256 => Mtu::Mtu256,
        257..=512 => Mtu::Mtu512,
        513..=1024 => Mtu::Mtu1024,
        1025..=2048 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

fn initial_psn(qpn: u32) -> u32 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    (qpn.wrapping_mul(2_654_435_761) ^ nanos) & 0xFF_FFFF
}

impl QueuePair {
    /// Creates a queue pair whose sends and receives complete on `cq`, in the INIT state.
    pub fn new(context: &Context, cq: &Arc<CompletionQueue>, caps: QueuePairCaps) -> Result<QueuePair> {
        let handle = cq.cq.clone();
        let mut builder = context.pd.create_qp_builder();
        builder
            .setup_max_send_wr(caps.max_send)
            .setup_max_recv_wr(caps.max_recv)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(caps.max_inline)
            .setup_send_cq(handle.clone())
            .setup_recv_cq(handle);
        let qp: GenericQueuePair = builder.build().map_err(|e| VerbsError::Resource { what: "creating a queue pair", reason: e.to_string() })?.into();
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(context.chosen.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead);
        let mut qp = QueuePair {
            psn: initial_psn(qp.qp_number()),
            qp,
            port: context.chosen.port,
            gid_index: context.chosen.gid_index,
            gid: context.gid,
            lid: context.port.lid,
            mtu: context.port.active_mtu,
            link_layer: context.port.link_layer,
            max_rd_atomic: context.max_rd_atomic,
            max_inline: caps.max_inline,
            connected: false,
        };
        qp.qp.modify(&attr).map_err(|e| VerbsError::Connect { state: "INIT", reason: e.to_string() })?;
        Ok(qp)
    }

    /// The queue-pair number.
    pub fn qp_number(&self) -> u32 {
        self.qp.qp_number()
    }

    /// What the peer needs to connect to this queue pair.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint { qpn: self.qp_number(), psn: self.psn, lid: self.lid, gid: self.gid, mtu: self.mtu, link_layer: self.link_layer }
    }

    /// Connects to the peer's queue pair (INIT → ready to receive → ready to send). Post the
    /// receives the peer may consume before the peer starts sending.
    pub fn connect(&mut self, remote: &Endpoint) -> Result<()> {
        if self.connected {
            return Err(VerbsError::Invalid("the queue pair is already connected".into()));
        }
        if remote.link_layer != self.link_layer {
            return Err(VerbsError::Connect { state: "RTR", reason: format!("link layers differ: local {}, remote {}", self.link_layer, remote.link_layer) });
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_enum(self.mtu.min(remote.mtu)))
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(self.max_rd_atomic)
            // 12 = 0.64 ms before a receiver-not-ready retry.
            .setup_min_rnr_timer(12);
        let mut av = AddressHandleAttribute::new();
        av.setup_dest_lid(remote.lid).setup_port(self.port).setup_service_level(0);
        // RoCE always routes by GID; InfiniBand needs the global route header only when the
        // peer has no LID in this subnet.
        if self.link_layer == LinkLayer::Ethernet || remote.lid == 0 {
            av.setup_grh_dest_gid(&Gid { raw: remote.gid }).setup_grh_src_gid_index(self.gid_index as u8).setup_grh_hop_limit(64);
        }
        attr.setup_address_vector(&av);
        self.qp.modify(&attr).map_err(|e| VerbsError::Connect { state: "RTR", reason: e.to_string() })?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(self.psn)
            // 4.096 µs × 2^14 ≈ 67 ms per transport retry, 7 retries: a silent peer fails
            // outstanding requests after about half a second.
            .setup_timeout(14)
            .setup_retry_cnt(7)
            // 7 = retry forever while the receiver has no receive posted.
            .setup_rnr_retry(7)
            .setup_max_read_atomic(self.max_rd_atomic);
        self.qp.modify(&attr).map_err(|e| VerbsError::Connect { state: "RTS", reason: e.to_string() })?;
        self.connected = true;
        Ok(())
    }

    /// Moves the queue pair to the error state: every outstanding request completes as
    /// flushed, and nothing more is sent.
    pub fn fail(&mut self) -> Result<()> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.qp.modify(&attr).map_err(|e| VerbsError::Connect { state: "ERROR", reason: e.to_string() })
    }

    /// Posts receives, each into its buffer.
    ///
    /// # Safety
    ///
    /// Each buffer's memory must stay registered, mapped and untouched by anything else until
    /// its receive completes.
    pub unsafe fn post_recvs(&mut self, receives: &[(u64, LocalSlice)]) -> Result<()> {
        if receives.is_empty() {
            return Ok(());
        }
        let mut guard = self.qp.start_post_recv();
        for (wr_id, buf) in receives {
            let wr = guard.construct_wr(*wr_id);
            // SAFETY: forwarded from the caller (the buffer stays valid until completion).
            unsafe { wr.setup_sge(buf.lkey(), buf.addr(), buf.len()) };
        }
        guard.post().map_err(|e| VerbsError::Post { what: "receives", reason: e.to_string() })
    }

    /// Posts send-queue work requests in order.
    ///
    /// # Safety
    ///
    /// Every [`Payload::Local`] buffer must stay registered and mapped until its request
    /// completes; a SEND's or WRITE's source must not change meanwhile, and a READ's
    /// destination must not be touched by anything else.
    pub unsafe fn post_send(&mut self, requests: &[SendRequest<'_>]) -> Result<()> {
        if requests.is_empty() {
            return Ok(());
        }
        for r in requests {
            match (r.op, r.payload) {
                (Operation::Read { .. }, Payload::Inline(_)) => {
                    return Err(VerbsError::Invalid("a READ needs a registered destination, not inline data".into()));
                }
                (_, Payload::Inline(data)) if data.len() > self.max_inline as usize => {
                    return Err(VerbsError::Invalid(format!("{} inline bytes exceed the queue pair's {}", data.len(), self.max_inline)));
                }
                _ => {}
            }
        }
        let mut guard = self.qp.start_post_send();
        for r in requests {
            let flags = if r.signaled { WorkRequestFlags::Signaled } else { WorkRequestFlags::none() };
            let wr = guard.construct_wr(r.wr_id, flags);
            let handle = match r.op {
                // Immediates travel in network byte order (`__be32` in verbs.h).
                Operation::Send { imm: Some(imm) } => wr.setup_send_imm(imm.to_be()),
                Operation::Send { imm: None } => wr.setup_send(),
                Operation::Write { remote, imm: Some(imm) } => wr.setup_write_imm(remote.rkey, remote.addr, imm.to_be()),
                Operation::Write { remote, imm: None } => wr.setup_write(remote.rkey, remote.addr),
                Operation::Read { remote } => wr.setup_read(remote.rkey, remote.addr),
            };
            match r.payload {
                Payload::Empty => {}
                Payload::Inline(data) => handle.setup_inline_data(data),
                // SAFETY: forwarded from the caller (the buffer stays valid until completion).
                Payload::Local(buf) => unsafe { handle.setup_sge(buf.lkey(), buf.addr(), buf.len()) },
            }
        }
        guard.post().map_err(|e| VerbsError::Post { what: "send-queue requests", reason: e.to_string() })
    }
}
