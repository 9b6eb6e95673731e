//! Acknowledgements of REPLICA_SYNC on their way from the protocol to the intent service's
//! replica set (see [`crate::protocol`]'s replica sync and [`super::replicas`]).

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::protocol::wire::ReplicaSyncAck;
use crate::util::FastMap;

/// Acknowledgements kept at most; beyond, the oldest-looking are dropped (only a peer that
/// answers what was never asked fills the mailbox).
const LIMIT: usize = 4096;

/// Acknowledgements by (sender, id).
#[derive(Default)]
pub(crate) struct SyncAcks {
    acks: Mutex<FastMap<(u16, u32), ReplicaSyncAck>>,
    arrived: Condvar,
}

impl SyncAcks {
    /// Posts `ack` from node `from`.
    pub fn post(&self, from: u16, ack: ReplicaSyncAck) {
        let mut acks = self.acks.lock();
        if acks.len() >= LIMIT {
            acks.clear();
        }
        acks.insert((from, ack.id), ack);
        drop(acks);
        self.arrived.notify_all();
    }

    /// Takes the acknowledgement of `id` from `from`, if it arrived.
    pub fn take(&self, from: u16, id: u32) -> Option<ReplicaSyncAck> {
        self.acks.lock().remove(&(from, id))
    }

    /// Waits for the acknowledgement of `id` from `from` until `deadline` or until `alive`
    /// says the node is gone.
    pub fn wait(&self, from: u16, id: u32, deadline: Instant, alive: impl Fn() -> bool) -> Option<ReplicaSyncAck> {
        let mut acks = self.acks.lock();
        loop {
            if let Some(ack) = acks.remove(&(from, id)) {
                return Some(ack);
            }
            if Instant::now() >= deadline || !alive() {
                return None;
            }
            let _ = self.arrived.wait_until(&mut acks, deadline.min(Instant::now() + Duration::from_millis(50)));
        }
    }
}
