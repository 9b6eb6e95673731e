//! The fabric: what the protocol's actions run on.
//!
//! A fabric offers ordered two-sided frames per peer, one-sided writes (with an immediate) into
//! a peer's registered memory, one-sided reads of it, and registration of parameter memory.
//! Implementations: TCP ([`tcp::TcpFabric`], over `ferry-tcp`) and, with the `verbs` cargo
//! feature (on by default), RDMA verbs (`verbs::VerbsFabric`, over `ferry-verbs`); [`select`]
//! picks one at start-up.

mod reads;
pub mod select;
pub mod tcp;
#[cfg(feature = "verbs")]
pub mod verbs;

use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::store::{Registrar, RemoteAddr};

pub use reads::PostedRead;
pub(crate) use reads::{Landing, Landings, ReadWaiters};

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

/// A one-sided write with an immediate that landed at this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Landed {
    /// The immediate the writer gave.
    pub imm: u32,
    /// Bytes the write placed (a relocation run's length tells how many slots it filled).
    pub len: usize,
}

/// What a fabric reports back to its node. Calls for one peer come in the peer's sending order.
pub trait FabricHandler: Send + Sync {
    /// A frame of protocol messages arrived (owned, so that parts of it can be handed to
    /// workers without copying).
    fn on_frame(&self, from: usize, frame: bytes::Bytes);
    /// One-sided writes with immediates landed at this node (their bytes are in place).
    fn on_writes_landed(&self, from: usize, writes: &[Landed]);
    /// A one-sided write this node posted completed (its source may be reused). Only a fabric
    /// that completes writes later ([`WriteCompletion::Deferred`], verbs) calls it.
    #[cfg(feature = "verbs")]
    fn on_write_done(&self, wr_id: u64, result: Result<()>);
    /// The connection to `peer` closed: cleanly (`None`) or through a failure.
    fn on_peer_closed(&self, peer: usize, error: Option<String>);
    /// A node joining in `peer`'s rank connected (after the old connection's end was
    /// reported), before anything it sends is delivered.
    fn on_peer_connected(&self, peer: usize) {
        let _ = peer;
    }
}

/// How a posted write is completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteCompletion {
    /// The source was copied while posting; it may be reused at once.
    Immediate,
    /// Completion comes later through [`FabricHandler::on_write_done`].
    #[cfg(feature = "verbs")]
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
    /// Backpressure: waits (at most `timeout`) until no peer's send queue is over its limit.
    /// A submitter calls it before adding work, outside every lock. Fabrics whose queues are
    /// bounded otherwise return at once.
    fn wait_for_room(&self, timeout: Duration) -> Result<()> {
        let _ = timeout;
        Ok(())
    }
    /// Bytes queued for `peer` and not yet taken by the connection (the send queue's depth, for
    /// the metrics); `None` for a fabric that keeps no send queue of its own.
    fn queued_bytes(&self, peer: usize) -> Option<u64> {
        let _ = peer;
        None
    }
    /// Counts the caller as a thread polling for its answers ([`Fabric::poll_receive`]) until
    /// its [`Fabric::stop_polling`]: the fabric's own threads do not busy-poll meanwhile, so
    /// that the caller keeps its core.
    fn start_polling(&self) {}
    /// Ends a [`Fabric::start_polling`].
    fn stop_polling(&self) {}
    /// Takes, on the calling thread, what the connections hold without blocking and hands it
    /// to the handler as the fabric's threads would; whether anything came. A worker waiting
    /// for an answer calls it so that the answer needs no other thread to wake.
    fn poll_receive(&self) -> bool {
        false
    }
    /// Posts one-sided writes to `to`; the caller flushes `to` afterwards.
    ///
    /// # Safety
    ///
    /// Every `src` range must stay valid and unchanged until the write completes.
    unsafe fn write(&self, to: usize, writes: &[WriteRequest]) -> Result<WriteCompletion>;
    /// Posts a one-sided read of `len` bytes at `remote` in `peer`'s registered memory, landing
    /// in a registered buffer of the fabric's own until [`Fabric::finish_read`] takes the bytes.
    /// Any number of reads may be in flight, from any threads. A read that cannot be sent (the
    /// connection is closed) fails here and holds no buffer.
    fn post_read(&self, peer: usize, remote: RemoteAddr, len: usize) -> Result<PostedRead>;
    /// Whether `read` has completed, successfully or not: [`Fabric::finish_read`] would not wait.
    fn read_done(&self, read: &PostedRead) -> bool;
    /// Waits at most `timeout` for `read` and copies its bytes into `out`, which must be
    /// `read.len()` long. Its landing buffer serves later reads; after a failure or a timeout it
    /// is retired instead (an answer may still arrive there).
    fn finish_read(&self, read: PostedRead, out: &mut [u8], timeout: Duration) -> Result<()>;
    /// Reads `out.len()` bytes at `remote` in `peer`'s registered memory with a one-sided read,
    /// waiting at most `timeout`.
    fn read(&self, peer: usize, remote: RemoteAddr, out: &mut [u8], timeout: Duration) -> Result<()> {
        let read = self.post_read(peer, remote, out.len())?;
        self.finish_read(read, out, timeout)
    }
    /// Closes the connection to `peer` (after it broke the protocol, or another node reported
    /// it lost).
    fn disconnect(&self, peer: usize);
    /// Whether `peer` is reachable.
    fn is_alive(&self, peer: usize) -> bool;
    /// Lets nodes join in the rank of a lost or departed peer from now on, handing each `info`
    /// (the fabric's name and the configuration fingerprint: `select::join_info`).
    fn admit_joins(&self, info: Vec<u8>) {
        let _ = info;
    }
    /// The addresses a joining node may use as its contact on this node (none when the fabric
    /// takes no joins).
    fn join_addresses(&self) -> Vec<std::net::SocketAddr> {
        Vec::new()
    }
    /// Closes all connections cleanly and joins the fabric's threads.
    fn shutdown(&self);
    /// Closes all connections at once, as a crash would.
    fn abort(&self);
}
