//! Ferry: a parameter store for distributed machine-learning training.
//!
//! Trainers embed Ferry as a library. Every node runs one process that holds a share of the
//! model's parameters in huge-page arenas plus the trainer's worker threads; workers `pull` and
//! `push` any parameter by key, wherever it lives, and `localize` moves parameters to the node
//! that uses them (dynamic parameter allocation, as in Lapse).
//!
//! The public API is what a trainer uses:
//! * [`Node`] starts a node (rendezvous, fabric, store, protocol) from a [`Config`] of
//!   [`TableSpec`]s and hands out [`Worker`]s; [`Table`] names a table;
//! * [`Worker`] is one trainer thread's handle: `pull`, `push`, `set`, `localize`, their
//!   asynchronous forms ([`Ticket`], [`PullTicket`]), push-pull, ranges, barriers, clocks
//!   (bounded delay) and intent signalling (`Worker::intent`, tuned by [`IntentSettings`]);
//! * [`sampling`] gives workers samples from a [`KeyDistribution`] under a [`Conformity`]
//!   level (NuPS);
//! * hot keys are replicated on every node within a staleness bound
//!   ([`TableSpec::replicating`], chosen with [`hot_keys`] from [`AccessCounts`]; NuPS);
//! * [`Updater`]s apply pushes at the key's holder (add, sgd, adagrad, adam, ftrl or an
//!   [`UpdateRule`] of your own), [`ValueCodec`] compresses values on the wire, [`filter`]
//!   holds back insignificant pushes;
//! * [`Stats`] (with [`IntentStats`], [`ReplicationStats`], [`BackupStats`], [`Traffic`]) say what a node did;
//!   every call fails with an [`Error`] value;
//! * [`launch`] starts a local cluster of processes.
//!
//! The protocol (deterministic state machines with no I/O), the store, the fabrics and the
//! services around the protocol are internal. With the `sim` feature, `testing` holds what
//! tests and benchmarks need of them: seeded simulated clusters, the consistency checker and
//! the structured fuzzer.

#![warn(missing_docs)]

mod checkpoint;
pub mod codec;
mod config;
#[cfg(any(test, feature = "sim"))]
mod consistency;
pub mod copartition;
pub mod dynamic;
mod error;
mod fabric;
pub mod filter;
#[cfg(any(test, feature = "sim"))]
mod fuzz;
pub mod hashing;
mod intent;
mod keymap;
pub mod launch;
pub mod memory;
mod metrics;
mod node;
mod partition;
mod placement;
mod protocol;
pub mod replication;
mod runtime;
pub mod sampling;
#[cfg(any(test, feature = "sim"))]
mod sim;
mod stats;
mod store;
mod table;
pub mod update;
mod util;
mod worker;

pub use checkpoint::{
    CheckpointInfo, CheckpointTable, CheckpointWriting, checkpoint_nodes, file_checksum, read_arrays_checkpoint, read_checkpoint, write_arrays_checkpoint,
    write_file_durably,
};
pub use codec::ValueCodec;
pub use config::{
    ClusterEnv, Config, ElementType, HugePages, IntentSettings, MIN_SECRET_BYTES, Partitioning, TableSpec, TransportChoice, VerbsSettings, generate_secret,
    parse_max_delay,
};
pub use error::{Error, Result};
pub use fabric::select::{LocalVerbs, busy_polling_readers, local_verbs};
pub use hashing::{FeatureHashing, feature_id};
pub use intent::LateCause;
pub use node::{Node, SlotAddress};
pub use placement::Placement;
pub use protocol::LEFT_REASON;
pub use replication::{AccessCounts, as_ranges, hot_keys};
pub use sampling::{Conformity, DistributionId, KeyDistribution, SamplingScheme, SamplingStats};
pub use stats::{BackupStats, DynamicStats, IntentStats, LATENCY_BUCKET_BOUNDS_NS, Latency, MessageKind, ReplicationStats, Stats, Traffic};
pub use table::Table;
pub use update::{UpdateRule, Updater};
pub use worker::{PullTicket, SampleHandle, Ticket, Worker};

/// What tests and benchmarks need of the engine's insides (feature `sim`; not for production
/// builds).
#[cfg(any(test, feature = "sim"))]
pub mod testing {
    /// Seeded simulated clusters that run the shipped protocol and services.
    pub mod sim {
        pub use crate::sim::*;
    }
    /// The per-key sequential-consistency, staleness and bounded-delay checkers.
    pub mod consistency {
        pub use crate::consistency::*;
    }
    /// Structured fuzzing of a live node's frame handling.
    pub mod fuzz {
        pub use crate::fuzz::*;
    }
    /// The key → home mapping of each partitioning (for benchmarks of what a join moves).
    pub mod partition {
        pub use crate::partition::Partitioner;
    }
}
