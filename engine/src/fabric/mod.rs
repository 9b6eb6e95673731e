//! The fabric: what the protocol's actions run on.
//!
//! A fabric offers ordered two-sided frames per peer, one-sided writes (with an immediate) into
//! a peer's registered memory, and registration of parameter memory. Implementations: TCP
//! ([`tcp::TcpFabric`], over `ferry-tcp`) and RDMA verbs (in the verbs issue).

pub mod tcp;

use std::sync::Arc;

use crate::error::Result;
use crate::store::{Registrar, RemoteAddr};

/// A one-sided write of local bytes into a peer's registered memory.
#[derive(Debug, Clone, Copy)]
pub struct WriteRequest {
    /// Destination in the peer's address space.
    pub remote: RemoteAddr,
    /// Source: registered local memory, which must stay valid until the write completes.
    pub src: *const u8,
    /// Bytes to write.
    pub len: usize,
    /// Immediate value delivered to the peer once the bytes are in place.
    pub imm: u32,
    /// Completion id.
    pub wr_id: u64,
}

/// What a fabric reports back to its node. Calls for one peer come in the peer's sending order.
pub trait FabricHandler: Send + Sync {
    /// A frame of protocol messages arrived.
    fn on_frame(&self, from: usize, frame: &[u8]);
    /// One-sided writes with these immediates landed at this node.
    fn on_writes_landed(&self, from: usize, imms: &[u32]);
    /// A one-sided write this node posted completed (its source may be reused).
    fn on_write_done(&self, wr_id: u64, result: Result<()>);
    /// The connection to `peer` closed: cleanly (`None`) or through a failure.
    fn on_peer_closed(&self, peer: usize, error: Option<String>);
}

/// How a posted write is completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteCompletion {
    /// The source was copied while posting; it may be reused at once.
    Immediate,
    /// Completion comes later through [`FabricHandler::on_write_done`].
    Deferred,
}

/// The transport under a node.
pub trait Fabric: Send + Sync {
    /// A short name ("tcp", "verbs").
    fn name(&self) -> &'static str;
    /// Registers parameter memory.
    fn registrar(&self) -> Arc<dyn Registrar>;
    /// Starts delivering to `handler`.
    fn start(&self, handler: Arc<dyn FabricHandler>) -> Result<()>;
    /// Queues a frame for `to`; frames to one peer leave in order.
    fn enqueue(&self, to: usize, frame: Vec<u8>) -> Result<()>;
    /// Sends what is queued for `to`.
    fn flush(&self, to: usize);
    /// Posts one-sided writes to `to`; the caller flushes `to` afterwards.
    ///
    /// # Safety
    ///
    /// Every `src` range must stay valid and unchanged until the write completes.
    unsafe fn write(&self, to: usize, writes: &[WriteRequest]) -> Result<WriteCompletion>;
    /// Closes the connection to `peer` (after it broke the protocol).
    fn disconnect(&self, peer: usize);
    /// Whether `peer` is reachable.
    fn is_alive(&self, peer: usize) -> bool;
    /// Closes all connections cleanly and joins the fabric's threads.
    fn shutdown(&self);
    /// Closes all connections at once, as a crash would.
    fn abort(&self);
}
