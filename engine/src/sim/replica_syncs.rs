//! Replica syncs in the simulation: the protocol's half of keeping run-time replicas in sync
//! (`protocol::replica_sync`), driven the way the intent service's sync rounds drive it
//! (`intent::sync_round`), among the random relocations, intents and accesses of a simulated
//! cluster.
//!
//! A node's first worker sends keys' deltas in a REPLICA_SYNC straight to a node it guesses
//! holds them (usually the node that does, sometimes another), waits for the acknowledgement,
//! reads the images of the items the receiver applied out of the receiver's registered buffer
//! (as the one-sided read does: at some later step, the bytes as they are then), and sends the
//! items it did not hold on as an ordinary push-pull the homes route (a delta of zeros as a
//! pull: it changes nothing). No replica is kept: a delta here is a push, and an applied item is
//! recorded as a push followed by a read of the key — its image, which is what a replica is set
//! to — and a routed one as the push-pull it becomes. So the checker holds syncs to per-key
//! sequential consistency: every delta applied exactly once, wherever the key was or was going
//! when the message arrived, and every image the key's value right after its delta. The worker
//! does nothing else until its sync is done, so recording a sync's events when their outcome is
//! known keeps its program order.
//!
//! The replica set itself — making, serving, syncing, draining and folding replicas — runs in
//! `replica_set.rs`, on keys of its own.

use rand::Rng;

use super::{ScriptOp, Sim, queued};
use crate::consistency::{Event, push_update};
use crate::protocol::wire::ReplicaSyncAck;
use crate::protocol::{AccessKind, OutgoingSync};

/// What the replica syncs of a run came to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncCounts {
    /// REPLICA_SYNC messages sent.
    pub messages: usize,
    /// Items the receiver held and applied (their images read back).
    pub applied: usize,
    /// Items the receiver did not hold, sent on through the homes.
    pub routed: usize,
    /// Items that carried a delta of zeros (sent as the key alone).
    pub zero: usize,
    /// Syncs given up because their receiver was lost (fault injection).
    pub abandoned: usize,
}

/// A REPLICA_SYNC a worker sent and waits for.
pub(super) struct SyncWait {
    owner: usize,
    id: u32,
    keys: Vec<u64>,
    /// Per item, its lane (`None`: a delta of zeros).
    lanes: Vec<Option<u32>>,
    ack: Option<ReplicaSyncAck>,
}

impl SyncWait {
    /// Whether its acknowledgement arrived.
    pub(super) fn acknowledged(&self) -> bool {
        self.ack.is_some()
    }
}

impl Sim {
    /// Worker `w` sends the deltas of `keys` (each key's lane, `None` for zeros) in one
    /// REPLICA_SYNC and waits for its acknowledgement.
    pub(super) fn send_replica_sync(&mut self, w: usize, keys: Vec<u64>, lanes: Vec<Option<u32>>) -> Result<(), String> {
        let node = self.workers[w].node;
        let others: Vec<usize> = (0..self.opts.nodes).filter(|&m| m != node && !self.nodes[m].crashed).collect();
        if others.is_empty() || keys.is_empty() {
            return Ok(());
        }
        // The service's guess is where the key was last found: mostly right, sometimes not.
        let holder = (0..self.opts.nodes).find(|&m| self.nodes[m].core.store().table(0).slot_of(keys[0]).is_some());
        let owner = match holder {
            Some(m) if m != node && self.rng.gen_bool(0.7) => m,
            _ => others[self.rng.gen_range(0..others.len())],
        };
        let width = self.opts.lanes;
        let scale = self.opts.updater.scale();
        let mut deltas = vec![0f32; keys.len() * width];
        for (delta, lane) in deltas.chunks_exact_mut(width).zip(&lanes) {
            match lane {
                Some(lane) => delta.iter_mut().zip(push_update(*lane, width)).for_each(|(d, u)| *d = u * scale),
                None => self.syncs.zero += 1,
            }
        }
        // Images go to a range of the receiver's buffer for this node that the message chooses
        // (the service's parts of one round take consecutive ranges): any range grows it.
        let offset = self.rng.gen_range(0..=self.opts.keys as usize - keys.len()) as u32;
        let id = self.ops as u32;
        self.syncs.messages += 1;
        self.log(format!("worker {w}@{node} syncs {keys:?} (lanes {lanes:?}) to node {owner}, id {id}, images at {offset}"));
        let sync = OutgoingSync { owner: owner as u16, table: 0, id, offset, keys: &keys, deltas: &deltas };
        self.worker_event(w, |step, _| queued(step.send_replica_syncs(&[sync])))?;
        self.workers[w].sync = Some(SyncWait { owner, id, keys, lanes, ack: None });
        Ok(())
    }

    /// Hands each waiting replica sync its acknowledgement, once the node has it; gives up on
    /// one whose receiver the node has lost, as a sync round does (its deltas' outcome is then
    /// unknown, like a push's to a lost node).
    pub(super) fn take_sync_acks(&mut self) {
        for w in 0..self.workers.len() {
            let core = &self.nodes[self.workers[w].node].core;
            let Some(sync) = self.workers[w].sync.as_mut().filter(|s| s.ack.is_none()) else { continue };
            sync.ack = core.replica_sync_acks().take(sync.owner as u16, sync.id);
            if sync.ack.is_some() || !core.directory().is_lost(sync.owner as u16) {
                continue;
            }
            core.replica_sync_acks().abandon(sync.owner as u16, sync.id);
            let (owner, id) = (sync.owner, sync.id);
            self.float_sync(w);
            self.syncs.abandoned += 1;
            self.failed_ops += 1;
            self.log(format!("worker {w} gives up sync {id}: node {owner} is lost"));
        }
    }

    /// Worker `w`'s replica sync will not be finished (its receiver or its node was lost): its
    /// deltas may have been applied or not, so they float (see `Sim::floating`).
    pub(super) fn float_sync(&mut self, w: usize) {
        if let Some(sync) = self.workers[w].sync.take() {
            for (&key, lane) in sync.keys.iter().zip(&sync.lanes) {
                if let Some(lane) = *lane {
                    self.floating.push((key, Event::Push { lane }));
                }
            }
        }
    }

    /// Checks `owner`'s acknowledgement `ack` of replica sync `id` of `count` items (against
    /// what a peer may send, beyond what decoding checked) and reads the images of the items it
    /// applied out of `owner`'s registered buffer, as the one-sided read does: one value per
    /// applied item, in `ack.held`'s order. Shared by the syncs of `send_replica_sync` and the
    /// replica set's rounds.
    pub(super) fn read_sync_images(&self, owner: usize, id: u32, count: usize, ack: &ReplicaSyncAck) -> Result<Vec<Vec<f32>>, String> {
        let held_ok = ack.held.windows(2).all(|p| p[0] < p[1]) && ack.held.iter().all(|&i| (i as usize) < count);
        if ack.table != 0 || ack.id != id || ack.count as usize != count || !held_ok || ack.hints.len() != count - ack.held.len() {
            return Err(format!("node {owner} acknowledged replica sync {id} of {count} items with {ack:?}"));
        }
        if ack.hints.iter().any(|&h| h as usize >= self.opts.nodes && h != crate::protocol::LOST_OWNER) {
            return Err(format!("node {owner} named a node beyond the cluster: {:?}", ack.hints));
        }
        if ack.held.is_empty() {
            return Ok(Vec::new());
        }
        let slot_bytes = self.nodes[owner].core.store().table(0).slot_bytes();
        let bytes = ack.held.len() * slot_bytes;
        let source = self.registered_range(owner, ack.remote, bytes)?;
        let mut copy = vec![0u8; bytes];
        // SAFETY: the range was bounds-checked against a region the owner registered (its image
        // buffer, which the store keeps until it is dropped), and the simulation is
        // single-threaded, so nothing writes it meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(source as *const u8, copy.as_mut_ptr(), bytes) };
        let width = self.opts.lanes;
        ack.held
            .iter()
            .zip(copy.chunks_exact(slot_bytes))
            .map(|(&item, image)| {
                let values = crate::store::validate_slot_copy(image, width).ok_or(format!("image of item {item} of sync {id} is torn"))?;
                Ok(values.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
            })
            .collect()
    }

    /// Worker `w`'s replica sync was acknowledged: records the applied items with the images
    /// read from the receiver's buffer, and puts the others at the front of its script as a
    /// push-pull (and a pull for deltas of zeros), which complete the sync.
    pub(super) fn finish_replica_sync(&mut self, w: usize) -> Result<(), String> {
        let Some(SyncWait { owner, id, keys, lanes, ack: Some(ack) }) = self.workers[w].sync.take() else {
            return Err(format!("worker {w} finished a replica sync it was not waiting for"));
        };
        let count = keys.len();
        let images = self.read_sync_images(owner, id, count, &ack)?;
        self.log(format!("worker {w} reads {} images of sync {id} from node {owner}; {} items routed", ack.held.len(), count - ack.held.len()));
        for (&item, value) in ack.held.iter().zip(images) {
            let (key, lane) = (keys[item as usize], lanes[item as usize]);
            if let Some(lane) = lane {
                self.workers[w].events.push((key, Event::Push { lane }));
            }
            self.workers[w].events.push((key, Event::Pull { value }));
        }
        self.syncs.applied += ack.held.len();
        let now = self.now;
        self.pad_events(w, now);
        let (mut pushed, mut zeros) = ((Vec::new(), Vec::new()), Vec::new());
        for (i, (&key, lane)) in keys.iter().zip(&lanes).enumerate() {
            if ack.held.contains(&(i as u32)) {
                continue;
            }
            self.syncs.routed += 1;
            match lane {
                Some(lane) => {
                    pushed.0.push(key);
                    pushed.1.push(*lane);
                }
                None => zeros.push(key),
            }
        }
        let script = &mut self.workers[w].script;
        if !zeros.is_empty() {
            script.push_front(ScriptOp::Access { kind: AccessKind::Pull, keys: zeros, lanes_or_tags: Vec::new(), asynchronous: false });
        }
        if !pushed.0.is_empty() {
            script.push_front(ScriptOp::Access { kind: AccessKind::PushPull, keys: pushed.0, lanes_or_tags: pushed.1, asynchronous: false });
        }
        Ok(())
    }
}
