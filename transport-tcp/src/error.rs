//! Errors of the TCP transport.

use std::io;

/// Everything that can go wrong in the transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What the transport was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A peer sent bytes that do not form a valid frame, or a frame that is too large.
    #[error("malformed frame from node {peer}: {reason}")]
    Malformed {
        /// The sending node.
        peer: usize,
        /// What was wrong.
        reason: String,
    },
    /// This node closed the connection to a peer ([`crate::Mesh::disconnect`]: the peer broke
    /// the protocol above the transport, or another node reported it lost).
    #[error("the connection to node {0} was closed by this node")]
    Disconnected(usize),
    /// The connection to a peer is closed (it left, failed, or was cut off).
    #[error("node {0} is not reachable: its connection is closed")]
    PeerGone(usize),
    /// A peer stayed silent for longer than the liveness timeout.
    #[error("node {peer} sent nothing for {millis} ms (liveness timeout)")]
    PeerTimeout {
        /// The silent node.
        peer: usize,
        /// How long it was silent.
        millis: u128,
    },
    /// A peer did not take what this node sent it: its send queue stopped draining for longer
    /// than the liveness timeout, or grew past the hard limit (it keeps its connection but does
    /// not read).
    #[error("node {peer} does not read what this node sends: {reason}")]
    PeerNotReading {
        /// The node that stopped reading.
        peer: usize,
        /// What was observed (bytes queued, for how long).
        reason: String,
    },
    /// The send queue to a peer stayed over its limit for as long as the caller would wait.
    #[error("the send queue to node {peer} stayed over its limit of {limit} bytes ({queued} queued) for {millis} ms")]
    SendQueueFull {
        /// The peer whose queue is full.
        peer: usize,
        /// Bytes queued for it.
        queued: u64,
        /// The limit ([`crate::MeshConfig::send_queue_limit`]).
        limit: u64,
        /// How long the caller waited.
        millis: u128,
    },
    /// A rank outside `0..nodes`, or this node's own rank, was given as a peer.
    #[error("no such peer: node {0}")]
    NoSuchPeer(usize),
    /// A one-sided access named a region that does not exist or fell outside its bounds.
    #[error("one-sided access rejected: {0}")]
    Access(AccessError),
    /// Rendezvous or connection set-up failed.
    #[error("cluster set-up failed: {0}")]
    Setup(String),
    /// The transport is shutting down.
    #[error("the transport is shut down")]
    Shutdown,
}

/// Why a one-sided read or write was refused by its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// No region with that id is registered at the target.
    #[error("region {0} is not registered")]
    UnknownRegion(u32),
    /// The byte range lies (partly) outside the region.
    #[error("range {offset}+{len} lies outside region {region} of {region_len} bytes")]
    OutOfBounds {
        /// The region named.
        region: u32,
        /// First byte asked for.
        offset: u64,
        /// Number of bytes asked for.
        len: u64,
        /// The region's size.
        region_len: u64,
    },
    /// The connection failed before the access completed.
    #[error("the connection closed before the access completed")]
    ConnectionLost,
    /// The region was registered for peers' reads only.
    #[error("region {0} does not accept one-sided writes")]
    ReadOnly(u32),
}

impl AccessError {
    /// Stable numeric code used on the wire.
    pub(crate) fn code(&self) -> u32 {
        match self {
            AccessError::UnknownRegion(_) => 1,
            AccessError::OutOfBounds { .. } => 2,
            AccessError::ConnectionLost => 3,
            AccessError::ReadOnly(_) => 4,
        }
    }

    /// Rebuilds an error from its wire code; details that are not on the wire are zero.
    pub(crate) fn from_code(code: u32, region: u32) -> AccessError {
        match code {
            1 => AccessError::UnknownRegion(region),
            2 => AccessError::OutOfBounds { region, offset: 0, len: 0, region_len: 0 },
            4 => AccessError::ReadOnly(region),
            _ => AccessError::ConnectionLost,
        }
    }
}

/// Builds a closure that wraps an [`io::Error`] with context.
pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> TransportError {
    let context = context.into();
    move |source| TransportError::Io { context, source }
}
