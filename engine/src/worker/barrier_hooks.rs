//! The node's services' part in a worker barrier, as one interface: each service that keeps
//! state across nodes (replicated keys, intents and their run-time replicas) gets a hook before
//! the cluster-wide barrier and one after it, so that the barrier orders their keys like every
//! other key.
//!
//! The order, which [`Worker::barrier_within`] keeps: the worker's own asynchronous operations
//! complete; then every service's [`BarrierHooks::before_barrier`], in the order of
//! [`SERVICES`]; then the cluster-wide barrier; then every service's
//! [`BarrierHooks::after_barrier`], in the reverse order (the services nest around the
//! barrier). Each service's hooks touch only its own keys (the intent service leaves
//! replicated keys out), so no service's hooks depend on another's.

use super::Worker;
use crate::error::Result;

/// A node service's part in every barrier of a worker (see the module documentation).
pub(crate) trait BarrierHooks: Sync {
    /// Before the cluster-wide barrier: what this node did before it must be where the
    /// barrier's other side will look for it.
    fn before_barrier(&self, worker: &mut Worker) -> Result<()>;
    /// After the cluster-wide barrier: what the other nodes did before it must be visible here.
    fn after_barrier(&self, worker: &mut Worker) -> Result<()>;
}

/// NuPS replication of hot keys: this node's deltas go home before, and the replicas are
/// refreshed after (a replication round each, unless one began after the call started).
struct Replication;

impl BarrierHooks for Replication {
    fn before_barrier(&self, worker: &mut Worker) -> Result<()> {
        worker.node.replication_sync()
    }

    fn after_barrier(&self, worker: &mut Worker) -> Result<()> {
        worker.node.replication_sync()
    }
}

/// Intent signalling: before, the homes learn of the windows that ended (so that a key's next
/// user gets it moved rather than replicated), and the run-time replicas' deltas reach their
/// owners; after, the grants that arrived meanwhile are taken up before the worker's first
/// accesses, and the run-time replicas are refreshed.
struct Intents;

impl BarrierHooks for Intents {
    fn before_barrier(&self, worker: &mut Worker) -> Result<()> {
        let (node, service) = (worker.node.clone(), worker.intent_service.clone());
        service.signal_levels(&node, worker)?;
        service.sync_replicas(&node, worker)
    }

    fn after_barrier(&self, worker: &mut Worker) -> Result<()> {
        let (node, service) = (worker.node.clone(), worker.intent_service.clone());
        service.take_up_grants(&node);
        service.sync_replicas(&node, worker)
    }
}

/// The node's services, in the order their `before_barrier` hooks run.
pub(crate) const SERVICES: [&dyn BarrierHooks; 2] = [&Replication, &Intents];
