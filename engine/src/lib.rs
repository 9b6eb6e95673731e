//! Ferry: a parameter store for distributed machine-learning training.
//!
//! Trainers embed Ferry as a library. Every node runs one process that holds a share of the
//! model's parameters in huge-page arenas plus the trainer's worker threads; workers `pull` and
//! `push` any parameter by key, wherever it lives, and `localize` moves parameters to the node
//! that uses them (dynamic parameter allocation, as in Lapse).
//!
//! The pieces:
//! * [`Node`] starts a node (rendezvous, fabric, store, protocol) and hands out [`Worker`]s;
//! * [`Worker`] is one trainer thread's handle with the synchronous and asynchronous API;
//! * [`replication`] keeps replicas of hot keys on every node within a staleness bound (NuPS);
//! * [`sampling`] gives workers samples from a key distribution under a conformity level (NuPS);
//! * [`protocol`] is the parameter-server protocol as deterministic state machines with no I/O;
//! * [`update`] applies pushes at the key's holder: add, sgd, adagrad, adam, ftrl or a user rule;
//!   [`codec`] compresses values on the wire, [`filter`] holds back insignificant pushes;
//! * [`intent`] holds AdaPM's intent signalling: windows, action timing and the service that
//!   acts on them;
//! * [`store`] holds the values, [`partition`] maps keys to home nodes;
//! * with the `sim` feature, `sim` runs the protocol in seeded simulated clusters and
//!   `consistency` checks recorded histories for per-key sequential consistency, and `fuzz`
//!   feeds mutated well-formed frames to a live node.

#![warn(missing_docs)]

pub mod codec;
pub mod config;
#[cfg(any(test, feature = "sim"))]
pub mod consistency;
mod error;
pub mod fabric;
pub mod filter;
#[cfg(any(test, feature = "sim"))]
pub mod fuzz;
pub mod intent;
mod keymap;
pub mod launch;
mod node;
pub mod partition;
pub mod protocol;
pub mod replication;
mod runtime;
pub mod sampling;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
pub mod stats;
pub mod store;
pub mod update;
mod util;
mod worker;

pub use codec::ValueCodec;
pub use config::{ClusterEnv, Config, ElementType, HugePages, IntentSettings, Partitioning, TableSpec, TransportChoice, VerbsSettings};
pub use error::{Error, Result};
pub use node::{Node, SlotAddress, Table};
pub use replication::AccessCounts;
pub use sampling::{Conformity, DistributionId, KeyDistribution, SampleHandle, SamplingScheme, SamplingStats};
pub use stats::{IntentStats, Latency, MessageKind, ReplicationStats, Stats, Traffic};
pub use update::{UpdateRule, Updater};
pub use worker::{PullTicket, Ticket, Worker};
