//! The protocol's part in keeping run-time replicas in sync (AdaPM, Appendix B.1, with the
//! refresh of NuPS's replication): a node sends its replicas' deltas straight to the node it
//! believes owns each key (REPLICA_SYNC, one message per owner and table, split when large; a
//! delta of zeros, a replica that took no push since the last round, travels as its key only);
//! the receiver adds each delta to the key's slot if it holds the key, copies the slot under
//! the same latch into an image buffer of the sender's own (see [`crate::store::ImageBuffer`]),
//! and answers with REPLICA_SYNC_ACK: which items it applied, where their images lie, and, for
//! each item it does not hold, where the key is to be found (the owner if it is the key's home,
//! the home otherwise; [`LOST_OWNER`] from the home of a key whose value was lost with its
//! owner). The sender refreshes the applied items with one one-sided read and
//! sends the others through an ordinary push-pull, which the homes route (see
//! [`crate::intent`]'s replica set for that side).
//!
//! A delta is applied where the key is held, under its latch, or not at all, and the answer
//! says which: every push reaches the key exactly once. The sender writes into a buffer range
//! of its own (`offset` on, in slot images) and sends its next REPLICA_SYNC of the table only
//! after it has read the images of the last one, so no image is overwritten before it is read.
//!
//! A REPLICA_SYNC is queued by a step that holds its keys' shards. A push this node routed to
//! one of the keys before the delta was taken (one a pull making the replica counted as sent
//! behind it, say) was routed by a step holding the key's shard, and a step queues its frames
//! for the fabric before it lets its shards go; frames to one peer leave in order. So the push
//! reaches the owner first and the image includes it. Queued without the shards, the message
//! could go first while the routing step's thread waits for a CPU, and the refresh would lose
//! the push from the replica (seen over soft-RoCE, see `docs/INTENT.md`).

use super::wire::{self, ReplicaSync, ReplicaSyncAck};
use super::{LOST_OWNER, Progress, Step};
use crate::error::{Error, Result};
use crate::stats::MessageKind;

/// One REPLICA_SYNC to queue: `keys` of `table` with their `deltas` (one value each) to
/// `owner`, message id `id`, their images to go to slot image `offset` on.
#[derive(Debug, Clone, Copy)]
pub struct OutgoingSync<'a> {
    /// The node believed to own the keys.
    pub owner: u16,
    /// The table.
    pub table: u16,
    /// The message's id (its acknowledgement's).
    pub id: u32,
    /// The first slot image of the sender's buffer that the keys' images go to.
    pub offset: u32,
    /// The keys.
    pub keys: &'a [u64],
    /// Their deltas, one value each.
    pub deltas: &'a [f32],
}

impl Step<'_, '_> {
    /// Queues `syncs` behind every step that routed an access to their keys (see the module
    /// documentation): takes the keys' shards first. Returns [`Progress::Yield`] when the step
    /// already holds other shards (queueing nothing); the caller retries on a fresh step.
    pub fn send_replica_syncs(&mut self, syncs: &[OutgoingSync<'_>]) -> Progress {
        if !self.try_acquire_keys(syncs.iter().flat_map(|s| s.keys.iter().map(|&key| (s.table, key)))) {
            return Progress::Yield { at: 0, item: 0 };
        }
        for s in syncs {
            self.send_replica_sync(s.owner, s.table, s.id, s.offset, s.keys, s.deltas);
        }
        Progress::Done
    }

    /// Queues a REPLICA_SYNC of `table` with id `id` to `owner`: `keys` with their `deltas`
    /// (`value_len` each), their images to go to slot image `offset` on.
    fn send_replica_sync(&mut self, owner: u16, table: u16, id: u32, offset: u32, keys: &[u64], deltas: &[f32]) {
        let value_len = if keys.is_empty() { 0 } else { deltas.len() / keys.len() };
        let out = self.tx.buf(owner);
        let before = out.len();
        let start = wire::begin_replica_sync(out, table, id, offset, keys.len() as u32);
        for (i, (&key, delta)) in keys.iter().zip(deltas.chunks_exact(value_len.max(1))).enumerate() {
            wire::push_replica_sync_item(out, start, i, key, delta);
        }
        wire::finish_replica_sync(out, start);
        let bytes = out.len() - before;
        self.tx.sent(owner, MessageKind::Replica, bytes);
    }

    /// A REPLICA_SYNC arrived: applies the deltas of the keys held here, cuts their images for
    /// the sender, and answers with REPLICA_SYNC_ACK. A message naming a table without
    /// run-time replicas or a key beyond its table is refused whole (nothing applied).
    pub(crate) fn handle_replica_sync(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let store = self.core.store().clone();
        let dir = self.directory();
        let sync = ReplicaSync::decode(body, |t| dir.table(t).map(|m| m.value_len))?;
        let t = store.table(sync.table);
        if t.dynamic().is_none() {
            return Err(Error::Protocol(format!("REPLICA_SYNC for table {}, which keeps no run-time replicas", sync.table)));
        }
        let keys = dir.table(sync.table).map_or(0, |m| m.keys);
        if let Some((key, _)) = sync.items().find(|&(key, _)| key >= keys) {
            return Err(Error::Protocol(format!("REPLICA_SYNC names key {key} of table {}, which has {keys}", sync.table)));
        }
        let offset = sync.offset as usize;
        let image = store.sync_image(sync.table, from, offset + sync.count)?;
        let slot_words = t.slot_bytes() / 4;
        let rank = dir.rank();
        let (mut held, mut hints) = (Vec::new(), Vec::new());
        for (i, (key, delta)) in sync.items().enumerate() {
            let guard = store.lock(sync.table, key);
            if let Some(slot) = guard.slot() {
                if let Some(delta) = delta {
                    slot.add_le_bytes(delta);
                }
                tracing::trace!(target: "ferry::replica_trace",  from, table = sync.table, key, id = sync.id, version = slot.version(), "replica delta applied and image cut");
                image.put(offset + held.len(), slot_words, slot.version(), slot.words());
                held.push(i as u32);
                continue;
            }
            drop(guard);
            let home = dir.home(sync.table, key);
            // A hint only: the sender tries there next time and is told again if it is wrong.
            // The home of a key whose value went with a lost owner says so ([`LOST_OWNER`]):
            // the sender's replica can reach no one, and is dropped.
            let hint = if home == rank { dir.owner(sync.table, key) } else { home };
            hints.push(hint);
        }
        let ack = ReplicaSyncAck { table: sync.table, id: sync.id, count: sync.count as u32, remote: image.remote_at(offset, slot_words), held, hints };
        let out = self.tx.buf(from);
        let before = out.len();
        wire::encode_replica_sync_ack(out, &ack);
        let bytes = out.len() - before;
        self.tx.sent(from, MessageKind::Replica, bytes);
        Ok(())
    }

    /// A REPLICA_SYNC_ACK arrived: hands it to the intent service's replica set.
    pub(crate) fn handle_replica_sync_ack(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let ack = wire::decode_replica_sync_ack(body)?;
        if self.directory().table(ack.table).is_none() {
            return Err(Error::Protocol(format!("REPLICA_SYNC_ACK for unknown table {}", ack.table)));
        }
        if ack.hints.iter().any(|&h| h as usize >= self.directory().nodes() && h != LOST_OWNER) {
            return Err(Error::Protocol(format!("REPLICA_SYNC_ACK from node {from} names a node beyond the cluster")));
        }
        self.core.replica_sync_acks().post(from, ack);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::wire::msg;

    /// A home answers a REPLICA_SYNC item of a key whose value was lost with its owner with
    /// [`LOST_OWNER`] (the sender drops its replica); the sender's side takes that hint and
    /// still refuses a node beyond the cluster.
    #[test]
    fn a_home_names_a_key_lost_with_its_owner_in_its_answer() {
        let core = crate::protocol::tests::core_of(1, 3);
        // Keys 10..20 are homed (and held) at node 1; key 11 left for a node that was lost,
        // with its value; key 3 is homed at node 0.
        let left = core.store().lock(0, 11).unpublish().expect("held at its home");
        core.store().free(left);
        core.directory().set_owner(0, 11, LOST_OWNER);
        let mut frame = Vec::new();
        let start = wire::begin_replica_sync(&mut frame, 0, 7, 0, 3);
        for (i, key) in [10u64, 11, 3].into_iter().enumerate() {
            wire::push_replica_sync_item(&mut frame, start, i, key, &[1.0, 2.0]);
        }
        wire::finish_replica_sync(&mut frame, start);
        let body = crate::protocol::tests::answer_to(&core, 2, frame, msg::REPLICA_SYNC_ACK);
        let ack = wire::decode_replica_sync_ack(&body).unwrap();
        assert_eq!((ack.held.clone(), ack.hints.clone()), (vec![0], vec![LOST_OWNER, 0]), "key 10 applied, key 11 lost, key 3 at its home");
        // Node 2's side.
        let core = crate::protocol::tests::core_of(2, 3);
        let mut tx = core.transmit();
        for (hints, accepted) in [(vec![LOST_OWNER, 0], true), (vec![3, 0], false)] {
            let mut frame = Vec::new();
            wire::encode_replica_sync_ack(&mut frame, &ReplicaSyncAck { hints, ..ack.clone() });
            let mut step = core.step(&mut tx, 1);
            let handled = step.handle_frame(1, &bytes::Bytes::from(frame), 0, 0);
            assert_eq!(handled.is_ok(), accepted, "{handled:?}");
        }
    }
}
