//! `ferry-tcp`: the TCP transport of Ferry.
//!
//! It knows nothing about parameters. It gives a cluster of nodes:
//!
//! * a rendezvous at a coordinator ([`Rendezvous`]) with all-gather rounds and clock alignment;
//! * one ordered TCP connection per pair of nodes ([`Mesh`]), with `TCP_NODELAY`, vectored
//!   writes, and framed two-sided messages delivered to a [`Handler`] in the order they were sent;
//! * an emulation of one-sided RDMA: a node registers memory regions, and peers read from or
//!   write into them by (region, offset, length), optionally with an immediate value announced to
//!   the target's handler once the bytes are in place. The target's reader thread serves these
//!   accesses without involving the node's protocol logic;
//! * liveness: idle connections send heartbeats, a silent or vanished peer is reported through
//!   [`Handler::on_peer_closed`], and a malformed or oversized frame closes only that connection.

#![warn(missing_docs)]

mod auth;
mod error;
mod frame;
mod joining;
mod mesh;
mod outq;
mod receive;
mod region;
mod setup;
pub mod stage_trace;

pub use auth::Membership;
pub use error::{AccessError, TransportError};
pub use frame::{FrameKind, HEADER_LEN, Header, MAGIC};
pub use joining::{Joined, MakeOffer, RejoinHook, join_running};
pub use mesh::{Handler, LandedWrite, Mesh, MeshConfig, MeshStats, SEND_QUEUE_HARD_FACTOR, WriteBatch, auto_poll_readers, cores, wait_for_room};
pub use region::{RegionId, Regions};
pub use setup::{HANDSHAKE, MAX_HANDSHAKES, Rendezvous, bind_listener, connect_mesh, join_cluster, mesh_handshake, monotonic_ns};
