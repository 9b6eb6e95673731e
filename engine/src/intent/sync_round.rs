//! One sync round of the run-time replicas (AdaPM, Appendix B.1), as part of the replica set's
//! state machine: each replica's delta goes to the node believed to own its key in one
//! REPLICA_SYNC per owner and table; the owner applies the deltas of the keys it holds, cuts
//! their images and acknowledges; the round refreshes those replicas with **one one-sided read**
//! per message (an RDMA READ over verbs) and sends the rest — keys that were not there — through
//! an ordinary push-pull that the homes route, whose answer refreshes them. The acknowledgement
//! names, per key not held, where to try next time (see the protocol's `replica_sync`), or that
//! the key's value was lost with its owner: such keys are not routed but handed to the replica
//! set, which drops their replicas.
//!
//! Each replica becomes its owner's value (which includes the delta just sent) plus the pushes
//! it took since its delta was taken. A replica that ends (or is kept anew from its departing
//! key) while the round is in flight is left out of its refresh: the round's value for it is
//! older than what the replica has since become.
//!
//! The round does no I/O: it queues actions (send the REPLICA_SYNCs, route a push-pull, read an
//! owner's images) for the driver and is handed their outcomes by token.

use std::collections::{BTreeMap, VecDeque};

use super::replica_set::{OpToken, ReplicaAction, ReplicaContext};
use super::replica_store::{TakenDeltas, believed_owner, lost_key_among, set_replica};
use crate::error::{Error, Result};
use crate::protocol::wire::ReplicaSyncAck;
use crate::protocol::{LOST_OWNER, OutgoingSync};
use crate::util::{FastMap, FastSet};

/// Where each key's owner is believed to be, for keys that were not at their home's first
/// guess (absent: try the home, or the owner the home records if that is this node).
pub(crate) type OwnerHints = FastMap<(u16, u64), u16>;

/// A REPLICA_SYNC waiting for its acknowledgement.
struct SyncPart {
    owner: u16,
    table: u16,
    id: u32,
    /// Where its keys' images start in the owner's buffer for this node.
    offset: u32,
    keys: Vec<u64>,
    deltas: Vec<f32>,
}

/// The keys of a table one operation of the round (a routed push-pull, an image read) refreshes.
struct Refreshing {
    table: u16,
    keys: Vec<u64>,
}

/// A sync round in flight.
pub(crate) struct SyncRound {
    /// The token of the action that sends its REPLICA_SYNCs (their values were fetched when it ran).
    send_op: Option<OpToken>,
    parts: Vec<SyncPart>,
    /// Image reads in flight, by token.
    reads: FastMap<OpToken, Refreshing>,
    /// Routed push-pulls in flight, by token.
    routed: FastMap<OpToken, Refreshing>,
    /// Replicas that ended or were kept anew since the round started: not refreshed by it.
    left_out: FastSet<(u16, u64)>,
    /// Each key's replica incarnation when its delta was taken: a replica refreshed must still
    /// be that one (the key did not land here, no replica ended or was made meanwhile).
    incarnations: FastMap<(u16, u64), u32>,
}

/// What the replica set and its rounds hand out: the actions for the driver, keys found lost,
/// and (when the simulator looks) which replicas were set from which action's value.
#[derive(Default)]
pub(crate) struct Outbox {
    /// Actions for the driver, in the order they were asked for.
    pub actions: VecDeque<ReplicaAction>,
    /// The last action's token.
    next_op: OpToken,
    /// Keys found lost with their owners, for the replica set to drop.
    pub lost: Vec<(u16, u64)>,
    /// Replicas set from their owners' values, with the token of the action that fetched them
    /// (the simulator's freshness check; `None` when nobody looks).
    pub set: Option<Vec<(u16, u64, OpToken)>>,
}

impl Outbox {
    /// A new action's token.
    pub fn op(&mut self) -> OpToken {
        self.next_op = self.next_op.wrapping_add(1);
        self.next_op
    }

    /// The replica of `key` of `table` was set from the value action `op` fetched.
    pub fn note_set(&mut self, table: u16, key: u64, op: OpToken) {
        if let Some(set) = &mut self.set {
            set.push((table, key, op));
        }
    }
}

impl SyncRound {
    /// Starts a round for the `taken` deltas (per table: keys and their deltas, taken from the
    /// replicas): one REPLICA_SYNC per believed owner (a message at most half the largest one a
    /// peer accepts), a push-pull the homes route for keys without one. Message ids come from
    /// `next_id`.
    pub fn start(ctx: &ReplicaContext<'_>, hints: &OwnerHints, next_id: &mut u32, taken: Vec<TakenDeltas>, out: &mut Outbox) -> SyncRound {
        let mut round = SyncRound {
            send_op: None,
            parts: Vec::new(),
            reads: FastMap::default(),
            routed: FastMap::default(),
            left_out: FastSet::default(),
            incarnations: FastMap::default(),
        };
        let limit = ctx.max_message_bytes / 2;
        for TakenDeltas { table, keys, deltas, incarnations } in taken {
            round.incarnations.extend(keys.iter().zip(incarnations).map(|(&k, i)| ((table, k), i)));
            let value_len = ctx.store.table(table).value_len();
            let per_item = 8 + 4 * value_len;
            let mut by_owner: BTreeMap<u16, (Vec<u64>, Vec<f32>)> = BTreeMap::new();
            let mut routed = (Vec::new(), Vec::new());
            for (&key, delta) in keys.iter().zip(deltas.chunks_exact(value_len)) {
                let (k, d) = match believed_owner(ctx.directory, hints.get(&(table, key)).copied(), table, key, ctx.alive) {
                    Some(owner) => by_owner.entry(owner).or_default(),
                    // This node is the key's home and knows its value went with its owner.
                    None if ctx.directory.knows_lost(table, key) => {
                        out.lost.push((table, key));
                        continue;
                    }
                    None => &mut routed,
                };
                k.push(key);
                d.extend_from_slice(delta);
            }
            for (owner, (keys, deltas)) in by_owner {
                let per_message = (limit / per_item).max(1);
                for (offset, chunk) in keys.chunks(per_message).enumerate().map(|(i, c)| (i * per_message, c)) {
                    *next_id = next_id.wrapping_add(1);
                    let deltas = deltas[offset * value_len..(offset + chunk.len()) * value_len].to_vec();
                    round.parts.push(SyncPart { owner, table, id: *next_id, offset: offset as u32, keys: chunk.to_vec(), deltas });
                }
            }
            if !routed.0.is_empty() {
                round.route(ctx, table, routed.0, routed.1, out);
            }
        }
        if !round.parts.is_empty() {
            let op = out.op();
            round.send_op = Some(op);
            out.actions.push_back(ReplicaAction::SendSyncs { op });
        }
        round
    }

    /// The REPLICA_SYNCs that action `op` sends (all of the round's, in one step).
    pub fn syncs_to_send(&self, op: OpToken) -> Vec<OutgoingSync<'_>> {
        if self.send_op != Some(op) {
            return Vec::new();
        }
        self.parts
            .iter()
            .map(|part| OutgoingSync { owner: part.owner, table: part.table, id: part.id, offset: part.offset, keys: &part.keys, deltas: &part.deltas })
            .collect()
    }

    /// The messages still waiting for their acknowledgements: owner and id.
    pub fn awaiting_acks(&self) -> impl Iterator<Item = (u16, u32)> + '_ {
        self.parts.iter().map(|p| (p.owner, p.id))
    }

    /// The keys and deltas of message `id` to `owner`, while it waits for its acknowledgement.
    #[cfg(any(test, feature = "sim"))]
    pub fn awaited(&self, owner: u16, id: u32) -> Option<(&[u64], &[f32])> {
        self.parts.iter().find(|p| (p.owner, p.id) == (owner, id)).map(|p| (&p.keys[..], &p.deltas[..]))
    }

    /// Whether everything of the round completed.
    pub fn is_done(&self) -> bool {
        self.parts.is_empty() && self.reads.is_empty() && self.routed.is_empty()
    }

    /// Whether `op` is one of the round's routed push-pulls.
    pub fn routes(&self, op: OpToken) -> bool {
        self.routed.contains_key(&op)
    }

    /// The replicas of `keys` of `table` ended or were made anew: the round leaves them as
    /// they are.
    pub fn leave_out(&mut self, table: u16, keys: impl IntoIterator<Item = u64>) {
        self.left_out.extend(keys.into_iter().map(|k| (table, k)));
    }

    /// Message `id` to `owner` will not be acknowledged (`error`: the owner is gone, or silent
    /// past the round's deadline): like a push to such a node, its deltas may be lost.
    pub fn handle_unanswered(&mut self, owner: u16, id: u32, error: Error) -> Result<()> {
        let before = self.parts.len();
        self.parts.retain(|p| (p.owner, p.id) != (owner, id));
        if self.parts.len() == before {
            return Ok(());
        }
        Err(error)
    }

    /// Message `id` to `owner` was acknowledged with `ack`: queues the read of the images of the
    /// items applied, routes the others (learning where they are), and hands keys whose values
    /// were lost with their owners to the replica set. An acknowledgement of no message sent is
    /// ignored.
    pub fn handle_ack(&mut self, ctx: &ReplicaContext<'_>, hints: &mut OwnerHints, owner: u16, id: u32, ack: ReplicaSyncAck, out: &mut Outbox) -> Result<()> {
        let Some(i) = self.parts.iter().position(|p| (p.owner, p.id) == (owner, id)) else { return Ok(()) };
        let part = self.parts.swap_remove(i);
        let count = part.keys.len();
        let held_ok = ack.held.windows(2).all(|p| p[0] < p[1]) && ack.held.iter().all(|&i| (i as usize) < count);
        if ack.table != part.table || ack.id != id || ack.count as usize != count || !held_ok || ack.hints.len() > count - ack.held.len() {
            // A peer that answers another message than the one sent: what it applied is
            // unknown, so nothing is sent again.
            return Err(Error::Protocol(format!("REPLICA_SYNC_ACK from node {owner} does not match message {id}")));
        }
        let t = ctx.store.table(part.table);
        let value_len = t.value_len();
        if !ack.held.is_empty() {
            let keys: Vec<u64> = ack.held.iter().map(|&i| part.keys[i as usize]).collect();
            let op = out.op();
            out.actions.push_back(ReplicaAction::ReadImages { op, owner, remote: ack.remote, bytes: keys.len() * t.slot_bytes() });
            self.reads.insert(op, Refreshing { table: part.table, keys });
        }
        if ack.held.len() < count {
            let (mut keys, mut deltas) = (Vec::new(), Vec::new());
            let mut held = ack.held.iter().peekable();
            let mut hint = ack.hints.iter();
            for (i, (&key, delta)) in part.keys.iter().zip(part.deltas.chunks_exact(value_len)).enumerate() {
                if held.next_if_eq(&&(i as u32)).is_some() {
                    continue;
                }
                match hint.next() {
                    // The key's home answered that its value was lost with its owner.
                    Some(&LOST_OWNER) => {
                        out.lost.push((part.table, key));
                        continue;
                    }
                    Some(&h) if (h as usize) < ctx.directory.nodes() => {
                        hints.insert((part.table, key), h);
                    }
                    _ => {}
                }
                keys.push(key);
                deltas.extend_from_slice(delta);
            }
            if !keys.is_empty() {
                self.route(ctx, part.table, keys, deltas, out);
            }
        }
        Ok(())
    }

    /// Image read `op` finished with `copy` (the owner's slot images, in the keys' order), or
    /// failed: refreshes its replicas (a failure leaves them as they are until next time; the
    /// deltas were applied all the same). Returns an error for images that were torn.
    pub fn handle_read(&mut self, ctx: &ReplicaContext<'_>, op: OpToken, copy: Result<Vec<u8>>, out: &mut Outbox) -> Result<()> {
        let Some(r) = self.reads.remove(&op) else { return Ok(()) };
        let copy = copy?;
        let t = ctx.store.table(r.table);
        let value_len = t.value_len();
        if copy.len() != r.keys.len() * t.slot_bytes() {
            return Err(Error::Protocol(format!("a read of {} slot images returned {} bytes", r.keys.len(), copy.len())));
        }
        let (mut value, mut delta) = (vec![0f32; value_len], vec![0f32; value_len]);
        let mut torn = 0;
        for (&key, image) in r.keys.iter().zip(copy.chunks_exact(t.slot_bytes())) {
            let Some(fresh) = crate::store::validate_slot_copy(image, value_len) else {
                torn += 1;
                continue;
            };
            let Some(incarnation) = self.incarnation_to_refresh(r.table, key) else { continue };
            for (v, b) in value.iter_mut().zip(fresh.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            if set_replica(ctx.store, r.table, key, incarnation, &mut value, &mut delta)
                && let Some(send) = self.send_op
            {
                out.note_set(r.table, key, send);
            }
        }
        ctx.counters.note_refresh_read(copy.len() as u64, (r.keys.len() - torn) as u64);
        if torn > 0 {
            return Err(Error::Protocol(format!("{torn} slot images read were torn")));
        }
        Ok(())
    }

    /// Routed push-pull `op` answered with the owners' values `fresh`, or failed: refreshes its
    /// replicas, or (failed) leaves them as they are until next time, except those of keys the
    /// failure names lost with their owner. The deltas were handed to the protocol: like any
    /// push, they reach their owner unless it is lost.
    pub fn handle_routed(&mut self, ctx: &ReplicaContext<'_>, op: OpToken, fresh: Result<Vec<f32>>, out: &mut Outbox) -> Result<()> {
        let Some(r) = self.routed.remove(&op) else { return Ok(()) };
        let mut fresh = match fresh {
            Ok(fresh) => fresh,
            Err(e) => {
                out.lost.extend(lost_key_among(&e, &r.keys).map(|key| (r.table, key)));
                return Err(e);
            }
        };
        let value_len = ctx.store.table(r.table).value_len();
        if fresh.len() != r.keys.len() * value_len {
            return Err(Error::Protocol(format!("a routed sync of {} keys returned {} values", r.keys.len(), fresh.len())));
        }
        let mut delta = vec![0.0; value_len];
        for (&key, value) in r.keys.iter().zip(fresh.chunks_exact_mut(value_len)) {
            if let Some(incarnation) = self.incarnation_to_refresh(r.table, key)
                && set_replica(ctx.store, r.table, key, incarnation, value, &mut delta)
            {
                out.note_set(r.table, key, op);
            }
        }
        Ok(())
    }

    /// The incarnation a replica of `key` must still be to take the round's value, unless the
    /// round leaves it out.
    fn incarnation_to_refresh(&self, table: u16, key: u64) -> Option<u32> {
        self.incarnations.get(&(table, key)).copied().filter(|_| !self.left_out.contains(&(table, key)))
    }

    /// Queues `keys`' `deltas` as a push-pull the homes route.
    fn route(&mut self, ctx: &ReplicaContext<'_>, table: u16, keys: Vec<u64>, deltas: Vec<f32>, out: &mut Outbox) {
        ctx.counters.note_synced_by_push_pull(keys.len() as u64);
        let op = out.op();
        self.routed.insert(op, Refreshing { table, keys: keys.clone() });
        out.actions.push_back(ReplicaAction::RoutedSync { op, table, keys, deltas });
    }
}
