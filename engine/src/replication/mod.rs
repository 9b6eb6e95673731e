//! Replication of hot keys with a time-based staleness bound (NuPS, Section 3.2).
//!
//! A table names the keys it replicates ([`crate::TableSpec::replicating`]); every node keeps a
//! replica of each, the key's home node keeps the authoritative value, and the key never
//! relocates. Workers access a replica exactly like a key held here — one latch and a copy — and
//! a push to a replica also accumulates in the replica's *delta* (see
//! `store::ReplicaState`).
//!
//! A background thread per node runs a **round** at least every half of the staleness bound
//! (sooner after a slow round): it
//!
//! 1. ships, per table and home node, the dirty replicas' deltas as one REPLICA_DELTA (the
//!    deltas are taken and zeroed under each key's latch);
//! 2. waits for every home's REPLICA_ACK, sent once the deltas were added to the home's slots;
//!    with the last one the home cuts this node's *image* (see `store::Snapshot`): the
//!    replicated slots whose version moved since they last went into it (all of them when asked
//!    with REPLICA_FULL), each copied under its latch, packed, their positions listed in the
//!    acknowledgement;
//! 3. refreshes: reads each image with **one one-sided read** (RDMA READ over verbs, served by
//!    the peer's connection thread over TCP), checks each slot image's versions, and, under each
//!    replica's latch, sets the replica to the image's value plus the delta accumulated since
//!    step 1. A replica whose home slot did not change keeps its value, which is still the home
//!    value plus this node's unshipped pushes. After any failure the next round asks for full
//!    images.
//!
//! A round is a state machine with no thread, clock or I/O (`round::Rounds` and the
//! `round::Round` under way, fed the shipment, acknowledgements, lost homes, a deadline and the
//! reads' outcomes); the runtime drives it with the fabric (`runtime::replication`) and the
//! simulator drives the same machine, giving rounds up now and then to take the path after a
//! failed one. Applying an image to the store is shared too (`image::apply_image`).
//!
//! Worker barriers run a round before and after the cluster-wide barrier, so that every push
//! before a barrier is visible in every replica after it, and [`crate::Node::finalize`] ships
//! the last deltas home.
//!
//! # Guarantee
//!
//! A pull of a replicated key returns a value that includes every push of this node's workers
//! before it, and every push acknowledged on any node at least `staleness` before it, as long as
//! rounds take less than about a sixth of the bound (the statistics report round times and the
//! staleness actually seen). Pushes are never lost or applied twice: a delta leaves a replica
//! exactly once, and a node that is lost loses with it the deltas it had not shipped. A `set` of
//! a replicated key goes to its home node; replicas see it at their next refresh, and deltas
//! shipped after it are added to it.

mod choose;
mod image;
mod round;

pub use choose::{AccessCounts, as_ranges, hot_keys};
pub(crate) use image::apply_image;
pub(crate) use round::{Round, Rounds};

pub(crate) use crate::protocol::Ack;
