//! One sync round of the run-time replicas (AdaPM, Appendix B.1): each replica's delta goes to
//! the node believed to own its key in one REPLICA_SYNC per owner and table; the owner applies
//! the deltas of the keys it holds, cuts their images and acknowledges; the round refreshes
//! those replicas with **one one-sided read** per message (an RDMA READ over verbs), posted
//! when the acknowledgement arrives and finished in a later poll, and sends
//! the rest — keys that were not there — through an ordinary push-pull that the homes route,
//! whose answer refreshes them. The acknowledgement names, per key not held, where to try next
//! time (see the protocol's `replica_sync`), or that the key's value was lost with its owner:
//! such keys are not routed but handed to the replica set, which drops their replicas.
//!
//! Each replica becomes its owner's value (which includes the delta just sent) plus the pushes
//! it took since its delta was taken. The service runs a round asynchronously and completes it
//! in its later rounds; a barrier runs one and waits for it. A replica that ends (or is kept
//! anew from its departing key) while the round is in flight is left out of its refresh: the
//! round's value for it is older than what the replica has since become.
//!
//! The service does not wait for the reads, so its rounds come every round time rather than
//! every read (an image read over loopback TCP took 6.6 ms behind the relocations' frames).
//! Sampling the windows that often, a pause in a word's use became a release and the key went
//! back and forth between nodes, unless the pause is bridged: tables whose keys are shared
//! bridge longer pauses (`IntentSettings::shared_gap`).

use std::collections::BTreeMap;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::fabric::PostedRead;
use crate::intent::{TakenDeltas, believed_owner, lost_key_among, set_replica};
use crate::protocol::wire::ReplicaSyncAck;
use crate::protocol::{LOST_OWNER, OutgoingSync};
use crate::runtime::NodeInner;
use crate::util::{FastMap, FastSet};
use crate::worker::{PullTicket, Worker};

/// Where each key's owner is believed to be, for keys that were not at their home's first
/// guess (absent: try the home, or the owner the home records if that is this node).
pub(super) type OwnerHints = FastMap<(u16, u64), u16>;

/// A REPLICA_SYNC waiting for its acknowledgement.
struct SyncPart {
    owner: u16,
    table: u16,
    id: u32,
    keys: Vec<u64>,
    deltas: Vec<f32>,
}

/// A routed push-pull of deltas whose keys were not where they were sent (or had no guess).
struct RoutedSync {
    table: u16,
    keys: Vec<u64>,
    ticket: PullTicket,
}

/// A one-sided read of the images an owner cut for an acknowledged REPLICA_SYNC.
struct ImageRead {
    table: u16,
    /// The keys whose images it reads, in the images' order.
    keys: Vec<u64>,
    read: PostedRead,
}

/// A sync round in flight.
pub(super) struct SyncRound {
    parts: Vec<SyncPart>,
    reads: Vec<ImageRead>,
    routed: Vec<RoutedSync>,
    /// Keys found lost with their owners (by the home's answer, this node being the home, or
    /// a routed push-pull's failure), not yet taken by the replica set.
    lost: Vec<(u16, u64)>,
    /// Replicas that ended or were kept anew since the round started: not refreshed by it.
    left_out: FastSet<(u16, u64)>,
    /// Each key's replica incarnation when its delta was taken: a replica refreshed must still
    /// be that one (the key did not land here, no replica ended or was made meanwhile).
    incarnations: FastMap<(u16, u64), u32>,
    deadline: Instant,
}

impl SyncRound {
    /// Starts a round for the `taken` deltas (per table: keys and their deltas, taken from the
    /// replicas): REPLICA_SYNC to each believed owner, a push-pull through `worker` for keys
    /// without one. Message ids come from `next_id`. Returns the round and the first error of
    /// starting it (what started is in the round).
    pub fn start(node: &NodeInner, worker: &mut Worker, hints: &OwnerHints, next_id: &mut u32, taken: Vec<TakenDeltas>) -> (SyncRound, Result<()>) {
        let mut round = SyncRound {
            parts: Vec::new(),
            reads: Vec::new(),
            routed: Vec::new(),
            lost: Vec::new(),
            left_out: FastSet::default(),
            incarnations: FastMap::default(),
            deadline: Instant::now() + node.config.op_timeout,
        };
        let mut outcome = Ok(());
        // Messages stay well below the largest one a peer accepts.
        let limit = node.core.settings().max_message_bytes / 2;
        let mut sends: Vec<(SyncPart, u32)> = Vec::new();
        for TakenDeltas { table, keys, deltas, incarnations } in taken {
            round.incarnations.extend(keys.iter().zip(incarnations).map(|(&k, i)| ((table, k), i)));
            let value_len = node.core.store().table(table).value_len();
            let per_item = 8 + 4 * value_len;
            let mut by_owner: BTreeMap<u16, (Vec<u64>, Vec<f32>)> = BTreeMap::new();
            let mut routed = (Vec::new(), Vec::new());
            let dir = node.core.directory();
            for (&key, delta) in keys.iter().zip(deltas.chunks_exact(value_len)) {
                let (k, d) = match believed_owner(dir, hints.get(&(table, key)).copied(), table, key, |n| node.fabric.is_alive(n as usize)) {
                    Some(owner) => by_owner.entry(owner).or_default(),
                    // This node is the key's home and knows its value went with its owner.
                    None if dir.knows_lost(table, key) => {
                        round.lost.push((table, key));
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
                    sends.push((SyncPart { owner, table, id: *next_id, keys: chunk.to_vec(), deltas }, offset as u32));
                }
            }
            if !routed.0.is_empty() {
                keep_first_error(&mut outcome, round.route(node, worker, table, routed.0, &routed.1));
            }
        }
        if !sends.is_empty() {
            let syncs: Vec<OutgoingSync<'_>> = sends
                .iter()
                .map(|(part, offset)| OutgoingSync {
                    owner: part.owner,
                    table: part.table,
                    id: part.id,
                    offset: *offset,
                    keys: &part.keys,
                    deltas: &part.deltas,
                })
                .collect();
            let sent = node.run_pooled(|step, _, _| Ok(step.send_replica_syncs(&syncs)));
            // Queuing cannot fail; were it to, whether a message left would be unknown, so the
            // deltas are never sent a second way: an unanswered message times out.
            keep_first_error(&mut outcome, sent);
            round.parts.extend(sends.into_iter().map(|(part, _)| part));
        }
        (round, outcome)
    }

    /// Takes the keys the round found lost with their owners since the last call: their
    /// replicas can reach no one (their deltas, sent or not, are lost with the value).
    pub fn take_lost(&mut self) -> Vec<(u16, u64)> {
        std::mem::take(&mut self.lost)
    }

    /// Whether everything of the round completed.
    pub fn is_done(&self) -> bool {
        self.parts.is_empty() && self.reads.is_empty() && self.routed.is_empty()
    }

    /// The replicas of `keys` of `table` ended or were made anew: the round leaves them as
    /// they are.
    pub fn leave_out(&mut self, table: u16, keys: impl IntoIterator<Item = u64>) {
        self.left_out.extend(keys.into_iter().map(|k| (table, k)));
    }

    /// Completes what arrived (everything, waiting, with `wait`): posts the reads of the images
    /// of acknowledged messages and routes their keys that were not held (learning where they
    /// are), refreshes from the reads that completed and from the routed push-pulls' answers.
    pub fn poll(&mut self, node: &NodeInner, worker: &mut Worker, hints: &mut OwnerHints, wait: bool) -> Result<()> {
        let mut outcome = Ok(());
        let acks = node.core.replica_sync_acks();
        let mut i = 0;
        while i < self.parts.len() {
            let (owner, id) = (self.parts[i].owner, self.parts[i].id);
            let alive = || node.fabric.is_alive(owner as usize) && !node.core.directory().is_lost(owner);
            let ack = if wait { acks.wait(owner, id, self.deadline, alive) } else { acks.take(owner, id) };
            let Some(ack) = ack else {
                if !wait && alive() && Instant::now() < self.deadline {
                    i += 1;
                    continue;
                }
                // Like a push to a node that is gone or silent: its deltas may be lost.
                self.parts.swap_remove(i);
                acks.abandon(owner, id);
                let error = if alive() {
                    Error::Timeout {
                        what: "run-time replica deltas to be acknowledged",
                        millis: node.config.op_timeout.as_millis() as u64,
                        nodes: vec![owner as usize],
                    }
                } else {
                    node.core.directory().lost_error(owner)
                };
                keep_first_error(&mut outcome, Err(error));
                continue;
            };
            let part = self.parts.swap_remove(i);
            keep_first_error(&mut outcome, self.complete(node, worker, hints, part, ack));
        }
        let mut k = 0;
        while k < self.reads.len() {
            if !wait && !node.fabric.read_done(&self.reads[k].read) && Instant::now() < self.deadline {
                k += 1;
                continue;
            }
            let r = self.reads.swap_remove(k);
            keep_first_error(&mut outcome, self.finish_read(node, r));
        }
        let mut j = 0;
        while j < self.routed.len() {
            if !wait && !worker.is_pull_done(&self.routed[j].ticket) {
                j += 1;
                continue;
            }
            let r = self.routed.swap_remove(j);
            match worker.wait_pull(r.ticket) {
                Ok(fresh) => super::replicas::refresh(node, r.table, &r.keys, fresh, &self.left_out, &self.incarnations),
                // The deltas were handed to the protocol: like any push, they reach their
                // owner unless it is lost. The replicas keep their values until next time,
                // except that of a key the failure names lost with its owner.
                Err(e) => {
                    self.lost.extend(lost_key_among(&e, &r.keys).map(|key| (r.table, key)));
                    keep_first_error(&mut outcome, Err(e))
                }
            }
        }
        outcome
    }

    /// `part` was acknowledged with `ack`: posts the read of the images of the items applied,
    /// routes the others.
    fn complete(&mut self, node: &NodeInner, worker: &mut Worker, hints: &mut OwnerHints, part: SyncPart, ack: ReplicaSyncAck) -> Result<()> {
        let store = node.core.store();
        let t = store.table(part.table);
        let value_len = t.value_len();
        if ack.table != part.table || ack.count as usize != part.keys.len() {
            // A peer that answers another message than the one sent: what it applied is
            // unknown, so nothing is sent again.
            return Err(Error::Protocol(format!("REPLICA_SYNC_ACK from node {} does not match message {}", part.owner, part.id)));
        }
        let mut outcome = Ok(());
        if !ack.held.is_empty() {
            let keys: Vec<u64> = ack.held.iter().map(|&i| part.keys[i as usize]).collect();
            match node.fabric.post_read(part.owner as usize, ack.remote, keys.len() * t.slot_bytes()) {
                Ok(read) => self.reads.push(ImageRead { table: part.table, keys, read }),
                // The deltas were applied; the replicas keep their values until next time.
                Err(e) => outcome = Err(e),
            }
        }
        if ack.held.len() < part.keys.len() {
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
                        self.lost.push((part.table, key));
                        continue;
                    }
                    Some(&h) => {
                        hints.insert((part.table, key), h);
                    }
                    None => {}
                }
                keys.push(key);
                deltas.extend_from_slice(delta);
            }
            keep_first_error(&mut outcome, self.route(node, worker, part.table, keys, &deltas));
        }
        outcome
    }

    /// Finishes the read `r` (waiting until the round's deadline at most) and refreshes its
    /// replicas from the images.
    fn finish_read(&self, node: &NodeInner, r: ImageRead) -> Result<()> {
        let owner = r.read.peer();
        let mut copy = vec![0u8; r.read.len()];
        // On failure the deltas were applied all the same; the replicas keep their values until
        // next time.
        node.fabric.finish_read(r.read, &mut copy, self.deadline.saturating_duration_since(Instant::now()))?;
        let torn = apply_images(node, r.table, &r.keys, &copy, &self.left_out, &self.incarnations);
        node.core.intent_counters().note_refresh_read(copy.len() as u64, (r.keys.len() - torn) as u64);
        if torn > 0 {
            return Err(Error::Protocol(format!("{torn} slot images read from node {owner} were torn")));
        }
        Ok(())
    }

    /// Sends `keys`' `deltas` through a push-pull the homes route.
    fn route(&mut self, node: &NodeInner, worker: &mut Worker, table: u16, keys: Vec<u64>, deltas: &[f32]) -> Result<()> {
        let ticket = worker.push_pull_async(node.table_by_id(table), &keys, deltas)?;
        node.core.intent_counters().note_synced_by_push_pull(keys.len() as u64);
        self.routed.push(RoutedSync { table, keys, ticket });
        Ok(())
    }
}

/// Sets each replica of `keys` still here, not `left_out` and of the incarnation its delta was
/// taken from to the value in its slot image in `copy` plus what was pushed to it since its
/// delta was taken. Returns how many images were torn (their replicas keep their values).
fn apply_images(node: &NodeInner, table: u16, keys: &[u64], copy: &[u8], left_out: &FastSet<(u16, u64)>, incarnations: &FastMap<(u16, u64), u32>) -> usize {
    let store = node.core.store();
    let t = store.table(table);
    let value_len = t.value_len();
    let (mut value, mut delta) = (vec![0f32; value_len], vec![0f32; value_len]);
    let mut torn = 0;
    for (&key, image) in keys.iter().zip(copy.chunks_exact(t.slot_bytes())) {
        let Some(fresh) = crate::store::validate_slot_copy(image, value_len) else {
            torn += 1;
            continue;
        };
        let Some(&incarnation) = incarnations.get(&(table, key)).filter(|_| !left_out.contains(&(table, key))) else { continue };
        for (v, b) in value.iter_mut().zip(fresh.chunks_exact(4)) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        set_replica(store, table, key, incarnation, &mut value, &mut delta);
    }
    torn
}

/// Keeps the first error of several steps that all run (`outcome` is what is reported).
pub(super) fn keep_first_error(outcome: &mut Result<()>, result: Result<()>) {
    if outcome.is_ok() {
        *outcome = result;
    }
}
