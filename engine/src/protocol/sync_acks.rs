//! Acknowledgements of REPLICA_SYNC on their way from the protocol to the intent service's
//! replica set (see [`crate::protocol`]'s replica sync and [`super::replicas`]).

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::protocol::wire::ReplicaSyncAck;
use crate::util::{FastMap, FastSet};

/// Acknowledgements kept at most; beyond, an arbitrary one is dropped (only a peer that answers
/// what was never asked fills the mailbox).
const LIMIT: usize = 4096;

#[derive(Default)]
struct Mailbox {
    /// Acknowledgements by (sender, id).
    acks: FastMap<(u16, u32), ReplicaSyncAck>,
    /// Messages nobody waits for any more (timed out): their acknowledgements are dropped.
    abandoned: FastSet<(u16, u32)>,
}

/// Acknowledgements by (sender, id).
#[derive(Default)]
pub(crate) struct SyncAcks {
    mailbox: Mutex<Mailbox>,
    arrived: Condvar,
}

impl SyncAcks {
    /// Posts `ack` from node `from`.
    pub fn post(&self, from: u16, ack: ReplicaSyncAck) {
        let mut m = self.mailbox.lock();
        if m.abandoned.remove(&(from, ack.id)) {
            return;
        }
        if m.acks.len() >= LIMIT
            && let Some(&any) = m.acks.keys().next()
        {
            m.acks.remove(&any);
        }
        m.acks.insert((from, ack.id), ack);
        drop(m);
        self.arrived.notify_all();
    }

    /// Takes the acknowledgement of `id` from `from`, if it arrived.
    pub fn take(&self, from: u16, id: u32) -> Option<ReplicaSyncAck> {
        self.mailbox.lock().acks.remove(&(from, id))
    }

    /// Waits for the acknowledgement of `id` from `from` until `deadline` or until `alive`
    /// says the node is gone.
    pub fn wait(&self, from: u16, id: u32, deadline: Instant, alive: impl Fn() -> bool) -> Option<ReplicaSyncAck> {
        let mut m = self.mailbox.lock();
        loop {
            if let Some(ack) = m.acks.remove(&(from, id)) {
                return Some(ack);
            }
            if Instant::now() >= deadline || !alive() {
                return None;
            }
            let _ = self.arrived.wait_until(&mut m, deadline.min(Instant::now() + Duration::from_millis(50)));
        }
    }

    /// Nobody waits for the acknowledgement of `id` from `from` any more: drops it now or when
    /// it arrives. Entries for acknowledgements that never come (a lost node's) are never
    /// cleared, so at most `LIMIT` are remembered; beyond, a late acknowledgement stays in the
    /// mailbox until the bound on it evicts it.
    pub fn abandon(&self, from: u16, id: u32) {
        let mut m = self.mailbox.lock();
        if m.acks.remove(&(from, id)).is_none() && m.abandoned.len() < LIMIT {
            m.abandoned.insert((from, id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RemoteAddr;

    fn ack(id: u32) -> ReplicaSyncAck {
        ReplicaSyncAck { table: 0, id, count: 0, remote: RemoteAddr { region: 0, addr: 0 }, held: Vec::new(), hints: Vec::new() }
    }

    #[test]
    fn acknowledgements_are_taken_by_sender_and_id_and_abandoned_ones_dropped() {
        let acks = SyncAcks::default();
        acks.post(1, ack(7));
        assert!(acks.take(2, 7).is_none() && acks.take(1, 8).is_none());
        assert_eq!(acks.take(1, 7).map(|a| a.id), Some(7));
        assert!(acks.take(1, 7).is_none(), "taken once");
        acks.abandon(1, 9);
        acks.post(1, ack(9));
        assert!(acks.take(1, 9).is_none(), "an abandoned message's late acknowledgement is dropped");
        acks.post(1, ack(9));
        assert!(acks.take(1, 9).is_some(), "only once");
        let deadline = Instant::now() + Duration::from_millis(20);
        assert!(acks.wait(1, 10, deadline, || true).is_none(), "times out");
        assert!(acks.wait(1, 10, Instant::now() + Duration::from_secs(60), || false).is_none(), "a lost sender ends the wait");
        for id in 0..LIMIT as u32 + 10 {
            acks.post(3, ack(id));
        }
        assert!(acks.mailbox.lock().acks.len() <= LIMIT, "bounded");
    }
}
