//! The driver of the node's intents: the intent service's thread and the driver of its run-time
//! replica set (see [`crate::intent`] for the timing, the table and the replica set's state
//! machine, which the simulator runs too).

mod replicas;
mod service;

pub(crate) use service::IntentService;
