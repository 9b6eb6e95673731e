//! The driver of the node's intents: the intent service's thread, its run-time replica set
//! and sync rounds (see [`crate::intent`] for the timing, the table and what the replicas do to
//! the store, which the simulator runs too).

mod replicas;
mod service;
mod sync_round;

pub(crate) use service::IntentService;
