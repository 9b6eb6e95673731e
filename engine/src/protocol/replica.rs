//! The protocol's part in replication: shipping the deltas of this node's replicas to their
//! home nodes (one REPLICA_DELTA per table and home per round), applying deltas that arrive at
//! a home node, cutting the sender's image of the replicated keys (see
//! [`crate::store::Snapshot`]) and answering with REPLICA_ACK, which tells the replica node
//! where to read that image with one-sided reads. The refresh itself is I/O and runs in
//! [`crate::replication`]; see there for the round as a whole.

use super::AckMailbox;
use super::Step;
use super::wire::{self, REPLICA_CUT, REPLICA_FULL, ReplicaDelta, ReplicaImage};
use crate::error::{Error, Result};
use crate::stats::MessageKind;

impl Step<'_, '_> {
    /// Ships, for every table with replicas and every live home node in `homes`, the deltas of
    /// this node's replicas homed there as one REPLICA_DELTA of round `round` (an empty one
    /// when nothing changed: its acknowledgement is what orders the refresh after the apply).
    /// With `full`, each home's image holds every replicated slot, changed or not (the first
    /// round, or after a refresh failed). Returns the (home, table) pairs messaged, once per
    /// message; each is answered by one REPLICA_ACK, the last one with the image.
    pub fn ship_replica_deltas(&mut self, round: u32, homes: &[u16], full: bool) -> Vec<(u16, u16)> {
        let store = self.core.store().clone();
        // Messages stay well below the largest one a peer accepts.
        let limit = self.core.settings().max_message_bytes / 2;
        let mut sent = Vec::new();
        for t in store.tables() {
            let Some(replicas) = t.replicas() else { continue };
            for &home in homes {
                let range = replicas.homed_at(home as usize);
                if range.is_empty() {
                    continue;
                }
                let dirty = replicas.dirty_in(range);
                let mut items = dirty.into_iter().peekable();
                loop {
                    let out = self.tx.buf(home);
                    let before = out.len();
                    let start = wire::begin_replica_delta(out, t.id(), round, 0);
                    let mut count = 0u32;
                    while out.len() - start < limit
                        && let Some(ordinal) = items.next()
                    {
                        let key = replicas.key(ordinal);
                        let _latch = store.lock(t.id(), key);
                        wire::push_replica_delta_key(out, key);
                        replicas.take_delta(ordinal, out);
                        count += 1;
                    }
                    let last = items.peek().is_none();
                    if last {
                        wire::set_replica_delta_flags(out, start, REPLICA_CUT | if full { REPLICA_FULL } else { 0 });
                    }
                    wire::finish_replica_delta(out, start, count);
                    let bytes = out.len() - before;
                    self.tx.sent(home, MessageKind::Replica, bytes);
                    self.core.replication().note_shipped(count as u64, bytes as u64);
                    sent.push((home, t.id()));
                    if last {
                        break;
                    }
                }
            }
        }
        sent
    }

    /// A REPLICA_DELTA arrived at this home node: adds each item to its key's slot and answers
    /// with REPLICA_ACK. Every key must be replicated and homed here; otherwise nothing is
    /// applied and the message is a protocol violation.
    pub(crate) fn handle_replica_delta(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let store = self.core.store().clone();
        let delta = ReplicaDelta::decode(body, |t| self.directory().table(t).map(|m| m.value_len))?;
        let t = store.table(delta.table);
        let replicas = t.replicas().ok_or_else(|| Error::Protocol(format!("REPLICA_DELTA for table {}, which replicates nothing", delta.table)))?;
        for i in 0..delta.count {
            let (key, _) = delta.item(i);
            if replicas.home_position(key).is_none() {
                return Err(Error::Protocol(format!("REPLICA_DELTA for key {key} of table {}, not a replicated key homed here", delta.table)));
            }
        }
        for i in 0..delta.count {
            let (key, values) = delta.item(i);
            let guard = store.lock(delta.table, key);
            match guard.slot() {
                Some(slot) => slot.add_le_bytes(values),
                None => return Err(Error::Protocol(format!("replicated key {key} of table {} is not held at its home", delta.table))),
            }
        }
        // After the shipment's last message the peer's image is cut, its deltas applied: its
        // refresh reads it.
        let image = if delta.flags & REPLICA_CUT != 0 {
            let (remote, positions) = store.cut_snapshot(delta.table, from as usize, delta.flags & REPLICA_FULL != 0).unwrap_or_default();
            Some(ReplicaImage { remote, positions })
        } else {
            None
        };
        let keys = replicas.home_keys().len() as u32;
        let out = self.tx.buf(from);
        let before = out.len();
        wire::encode_replica_ack(out, delta.table, delta.round, keys, image.as_ref());
        let bytes = out.len() - before;
        self.tx.sent(from, MessageKind::Replica, bytes);
        Ok(())
    }

    /// A REPLICA_ACK arrived: hands it to the replication round waiting for it.
    pub(crate) fn handle_replica_ack(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let (table, round, keys, image) = wire::decode_replica_ack(body)?;
        let expected = self.core.store().tables().get(table as usize).and_then(|t| t.replicas()).map(|r| r.homed_at(from as usize).len() as u32);
        if expected != Some(keys) {
            return Err(Error::Protocol(format!(
                "REPLICA_ACK from node {from} for table {table} lists {keys} replicated keys; this node expects {expected:?}"
            )));
        }
        let mailbox: &AckMailbox = self.core.replication().mailbox();
        mailbox.post(from, table, round, image);
        Ok(())
    }
}
