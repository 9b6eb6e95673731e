//! `localize`: the requester reserves slots and tells the home node, the home node re-routes and
//! tells the old owner, the old owner writes the value into the reserved slot, and the requester
//! serves everything it queued once the write lands.

use super::access::{AnswerBatch, FailureBatch, apply, failure_code};
use super::requester::{Delivery, LocalEvent, OpId, worker_of};
use super::shard::{DeadlineKind, Outgoing, Queued, Transit, Waiters, resv_shard, wr_shard};
use super::wire::{self, AccessHeader, AccessKind, FLAG_INDEXED, FLAG_STALE, FailureCode, LocalizeFailed, Move, MoveItem, msg};
use super::{LOST_OWNER, SlotWrite, Step};
use crate::error::{Error, Result};
use crate::fabric::Landed;
use crate::stats::{MessageKind, ShardCounters};
use crate::store::{Reserved, STAMP_SHIFT};
use crate::util::f32_bytes;
use std::sync::atomic::Ordering;

/// Bytes of hand-over writes a step prepares before it ends, so that they are sent while the
/// rest of a large hand-over is prepared.
const WRITE_PIECE: usize = 32 << 10;

/// Most bytes one write of a run of keys carries (it is one message on the wire, and within
/// every fabric's frame limit).
const MAX_RUN_BYTES: usize = 64 << 10;

/// Fewest and most items of one LOCALIZE or RELOCATE a step takes on (the locks of their shards
/// are held together; the rest waits for the next step).
const MIN_CHUNK: usize = 16;
const MAX_CHUNK: usize = 4096;

impl Step<'_, '_> {
    pub(super) fn send_move(&mut self, to: u16, ty: u8, flags: u8, table: u16, new_owner: u16, items: &[MoveItem]) {
        let per_message = ((self.core.settings().max_message_bytes - wire::MOVE_HEADER) / wire::MOVE_ITEM).max(1);
        for chunk in items.chunks(per_message) {
            let buf = self.tx.buf(to);
            let before = buf.len();
            wire::encode_move(buf, ty, flags, table, new_owner, chunk);
            let bytes = buf.len() - before;
            let kind = if ty == msg::LOCALIZE { MessageKind::Localize } else { MessageKind::Relocate };
            self.tx.sent(to, kind, bytes);
        }
    }

    /// Tells `to` that its reservations `resvs` will not be filled.
    pub(crate) fn send_localize_failed(&mut self, to: u16, error: &Error, table: u16, resvs: &[u32]) {
        if resvs.is_empty() || self.directory().is_lost(to) {
            return;
        }
        if to == self.directory().rank() {
            for &resv in resvs {
                self.fail_reservation(resv, error.clone());
            }
            return;
        }
        let (code, node) = failure_code(error);
        let buf = self.tx.buf(to);
        let before = buf.len();
        wire::encode_localize_failed(buf, code, table, node, resvs);
        let bytes = buf.len() - before;
        self.tx.sent(to, MessageKind::Failure, bytes);
    }

    /// The items of a LOCALIZE or RELOCATE handled in one step from `start` on, and their
    /// shards. The whole message's keys are checked against the table once, at its start; later
    /// steps look only at their own items, so a large hand-over costs O(items) in all.
    fn move_chunk(&self, m: &Move<'_>, start: usize) -> Result<(usize, u64)> {
        let dir = self.directory();
        if start == 0 {
            let keys = dir.table(m.table).map_or(0, |t| t.keys);
            if let Some(key) = (0..m.count).map(|i| m.item(i).key).find(|&k| k >= keys) {
                return Err(Error::Protocol(format!("LOCALIZE/RELOCATE for key {key} beyond table {}", m.table)));
            }
        }
        let per_step = (WRITE_PIECE / self.core.store().table(m.table).transfer_bytes().max(1)).clamp(MIN_CHUNK, MAX_CHUNK);
        let end = m.count.min(start.saturating_add(per_step));
        let mask = (start..end).fold(0u64, |mask, i| mask | 1 << dir.shard_of(m.table, m.item(i).key));
        Ok((end, mask))
    }

    /// LOCALIZE at the home node, from item `start` on. Returns the item to resume at when the
    /// step must end first (other shards needed, or — with `pieces` — a piece of writes ready
    /// to be sent).
    pub(super) fn handle_localize(&mut self, requester: u16, body: &[u8], start: usize, pieces: bool) -> Result<Option<usize>> {
        let m = Move::decode(body, self.directory().tables().len())?;
        let (end, mask) = self.move_chunk(&m, start)?;
        if self.directory().is_lost(requester) || start >= m.count {
            return Ok(None);
        }
        if !self.try_acquire(mask) {
            return Ok(Some(start));
        }
        if start == 0 && self.hold_move_during_census(requester, body) {
            return Ok(None);
        }
        if self.core.settings().relocation && self.core.asked_to_leave().load(Ordering::Acquire) && self.core.departures().lock().handing_over() {
            // This node is leaving and its last round began: it moves no key any more. The
            // requester awaits the key until the census after the leave settles it (see
            // `protocol::leave`, evacuate.rs).
            return Ok(None);
        }
        let items: Vec<MoveItem> = (start..end).map(|i| m.item(i)).collect();
        let done = self.localize_at_home(requester, m.table, &items, pieces, m.flags);
        Ok((start + done < m.count).then_some(start + done))
    }

    /// At the home node (shards held): record `requester` as owner and tell each old owner.
    /// With `pieces`, stops once a piece of hand-over writes is ready to be sent (so a large
    /// hand-over streams); returns how many items it handled. A LOCALIZE the intent service
    /// sent on a grant (`flags` has `MOVE_GRANTED`) is declined for a key this home has since
    /// granted to another node: a grant and the move it starts are not atomic, and a stale
    /// grant's move arriving after the current one would take the key from the node the home
    /// now means to have it, which it would not be told again.
    pub(super) fn localize_at_home(&mut self, requester: u16, table: u16, items: &[MoveItem], pieces: bool, flags: u8) -> usize {
        let dir = self.directory();
        let rank = dir.rank();
        let mut groups: Vec<Vec<MoveItem>> = vec![Vec::new(); dir.nodes()];
        let mut failed: Vec<(Error, Vec<u32>)> = Vec::new();
        let granted_elsewhere: Vec<bool> = if flags & wire::MOVE_GRANTED != 0 {
            let homes = self.core.intent_homes().lock();
            // On a dynamic table that evicts, a granted move is declined for a slot key whose
            // id was evicted since the grant (a new id may take the slot), and rescues an id
            // offered in a round under way (its slot is about to leave the home).
            let claimed = match self.core.id_index(table) {
                Some(index) => index.claim_slots(&items.iter().map(|item| item.key).collect::<Vec<_>>()),
                None => vec![true; items.len()],
            };
            items.iter().zip(claimed).map(|(item, claimed)| !claimed || homes.granted_elsewhere(table, item.key, requester)).collect()
        } else {
            Vec::new()
        };
        let mut declined: Vec<u32> = Vec::new();
        let mut done = 0;
        for (i, &item) in items.iter().enumerate() {
            if pieces && self.tx.pending_write_bytes() >= WRITE_PIECE {
                break;
            }
            done += 1;
            if granted_elsewhere.get(i).copied().unwrap_or(false) {
                declined.push(item.resv);
                continue;
            }
            let outcome = if dir.home(table, item.key) != rank {
                Err(Error::Protocol(format!("LOCALIZE of key {} sent to a node that is not its home", item.key)))
            } else if self.core.store().table(table).is_replicated(item.key) {
                // Replicated keys stay at their home: replicas read the home's slots.
                Err(Error::Protocol(format!("LOCALIZE of replicated key {}", item.key)))
            } else {
                match dir.owner(table, item.key) {
                    LOST_OWNER => Err(Error::KeyLost { table: dir.table_name(table), key: item.key }),
                    // This node owns the key but its own incoming transfer may never come: do not
                    // promise the key to anyone else.
                    owner
                        if owner == rank
                            && let Some(e) = self.shard_of(table, item.key).transits.get(&(table, item.key)).and_then(|t| t.suspect.as_deref().cloned()) =>
                    {
                        Err(e)
                    }
                    owner if owner == requester => Err(Error::Protocol(format!("node {requester} asked for key {} it already owns", item.key))),
                    owner if dir.is_lost(owner) => Err(dir.lost_error(owner)),
                    owner => {
                        dir.set_owner(table, item.key, requester);
                        Ok(owner)
                    }
                }
            };
            match outcome {
                // This node is the old owner too: hand the key over right away.
                Ok(owner) if owner == rank => {
                    self.relocate_items(requester, table, &[item], false);
                }
                Ok(owner) => groups[owner as usize].push(item),
                Err(e) => match failed.iter_mut().find(|(k, _)| *k == e) {
                    Some((_, resvs)) => resvs.push(item.resv),
                    None => failed.push((e, vec![item.resv])),
                },
            }
        }
        for (owner, items) in groups.iter().enumerate() {
            if !items.is_empty() {
                self.send_move(owner as u16, msg::RELOCATE, 0, table, requester, items);
            }
        }
        for (e, resvs) in failed {
            self.send_localize_failed(requester, &e, table, &resvs);
        }
        self.send_declined(requester, table, &declined);
        done
    }

    /// Tells `to` that the home declined its granted relocations `resvs`.
    fn send_declined(&mut self, to: u16, table: u16, resvs: &[u32]) {
        self.send_refusal(to, FailureCode::Declined, table, resvs);
    }

    /// Tells `to` that its reservations `resvs` will not be filled by a move from here,
    /// `code` saying how (`Declined`, or after a census `Superseded`); this node itself is told
    /// at once.
    pub(crate) fn send_refusal(&mut self, to: u16, code: FailureCode, table: u16, resvs: &[u32]) {
        if resvs.is_empty() || self.directory().is_lost(to) {
            return;
        }
        if to == self.directory().rank() {
            let mut arrived = Vec::new();
            for &resv in resvs {
                if code == FailureCode::Superseded {
                    self.supersede_reservation(resv, &mut arrived);
                } else {
                    self.decline_reservation(resv, &mut arrived);
                }
            }
            self.deliver_arrived(arrived);
            return;
        }
        let buf = self.tx.buf(to);
        let before = buf.len();
        wire::encode_localize_failed(buf, code, table, 0, resvs);
        let bytes = buf.len() - before;
        self.tx.sent(to, MessageKind::Failure, bytes);
    }

    /// Tells each `localize` in `arrived` that its last key is here (or was declined).
    pub(crate) fn deliver_arrived(&mut self, arrived: Vec<OpId>) {
        for op in arrived {
            self.tx.deliver(worker_of(op), Delivery::Local(LocalEvent::Arrived { op }));
        }
    }

    /// The home declined granted relocation `resv` (its shard held): the key stays where the
    /// home has it, and what queued for it here goes there through the home. A plain
    /// `localize` that joined the transit still needs the key: then the same reservation is
    /// asked for again, without the flag.
    fn decline_reservation(&mut self, resv: u32, arrived: &mut Vec<OpId>) {
        let dir = self.directory();
        let store = self.core.store();
        let shard = self.shard(resv_shard(resv));
        let Some(&(table, key)) = shard.reservations.get(&resv) else { return };
        let Some(transit) = shard.transits.get(&(table, key)) else { return };
        if !transit.granted {
            let Some(to) = transit.slot.as_ref().map(|s| store.table(table).remote_addr(s.index())) else { return };
            self.request_move(dir.home(table, key), table, &[MoveItem { key, resv, to }], 0);
            return;
        }
        let Some(((table, key), transit)) = self.end_transit(resv) else { return };
        dir.uncache(table, key);
        for (op, left) in transit.waiters.iter() {
            if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                arrived.push(*op);
            }
        }
        let mut failures = FailureBatch::default();
        for queued in transit.queue {
            match queued {
                Queued::Access { origin, op, part, index, kind, values } => {
                    self.forward_to_home(table, key, origin, op, part, index, kind, &values, &mut failures)
                }
                Queued::Relocate { new_owner, resv, .. } => {
                    // The home routes nothing here for a key it declined to move here.
                    tracing::error!(node = dir.rank(), key, "a hand-over queued behind a declined relocation");
                    self.send_localize_failed(new_owner, &Error::Protocol("the key's relocation was declined".into()), table, &[resv]);
                }
            }
        }
        self.flush_failures(failures);
        self.core.intent_counters().note_declined(1);
    }

    /// The key's home says, after a census, that no live node will hand the key over for
    /// reservation `resv` (its shard held): the transit ends, `localize` calls waiting for it
    /// are done (the key stays where the home has it), queued accesses go through the home,
    /// and queued hand-overs are dropped (their requesters were told the same by the home).
    pub(crate) fn supersede_reservation(&mut self, resv: u32, arrived: &mut Vec<OpId>) {
        let Some(((table, key), transit)) = self.end_transit(resv) else { return };
        self.directory().uncache(table, key);
        for (op, left) in transit.waiters.iter() {
            if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                arrived.push(*op);
            }
        }
        let mut failures = FailureBatch::default();
        for queued in transit.queue {
            if let Queued::Access { origin, op, part, index, kind, values } = queued {
                self.forward_to_home(table, key, origin, op, part, index, kind, &values, &mut failures);
            }
        }
        self.flush_failures(failures);
    }

    /// Passes an access item that queued for a key which did not (or no longer does) stay
    /// here to the key's home, which routes it to the owner.
    #[allow(clippy::too_many_arguments)]
    fn forward_to_home(
        &mut self,
        table: u16,
        key: u64,
        origin: u16,
        op: OpId,
        part: u32,
        index: u32,
        kind: AccessKind,
        values: &[f32],
        failures: &mut FailureBatch,
    ) {
        let dir = self.directory();
        let home = dir.home(table, key);
        if dir.is_lost(home) {
            failures.add(origin, op, part, table, FailureCode::PeerLost, home, key, index);
            return;
        }
        let h = AccessHeader { kind, flags: FLAG_INDEXED | FLAG_STALE, table, origin, op, part, codec: self.core.store().table(table).spec().codec };
        let encode = |out: &mut Vec<u8>| wire::encode_access(out, h, 1, |_| index, |_| key, |_, o| o.extend_from_slice(f32_bytes(values)));
        if home == dir.rank() {
            // This node is the key's home (a census made it give up an arrival): it routes the
            // item as a home does, under the key's shard, which the caller holds.
            let mut message = Vec::new();
            encode(&mut message);
            self.route_access_here(&message[4..], "an item for a key homed here");
            return;
        }
        if self.forwards_held_for(home) {
            // The home is on its way out: held until it is gone (see `protocol::leave`).
            let mut message = Vec::new();
            encode(&mut message);
            self.hold_forward(message);
            return;
        }
        let buf = self.tx.buf(home);
        let before = buf.len();
        encode(buf);
        let bytes = buf.len() - before;
        self.tx.sent(home, MessageKind::Forward, bytes);
        self.shard_of(table, key).counters.double_forwarded_keys += 1;
    }

    /// RELOCATE at the old owner, from item `start` on. Returns the item to resume at when the
    /// step must end first (other shards needed, or — with `pieces` — a piece of writes ready
    /// to be sent).
    pub(super) fn handle_relocate(&mut self, body: &[u8], start: usize, pieces: bool) -> Result<Option<usize>> {
        let m = Move::decode(body, self.directory().tables().len())?;
        if m.new_owner as usize >= self.directory().nodes() || m.new_owner == self.directory().rank() {
            return Err(Error::Protocol(format!("RELOCATE to invalid node {}", m.new_owner)));
        }
        let (end, mask) = self.move_chunk(&m, start)?;
        if start >= m.count {
            return Ok(None);
        }
        if !self.try_acquire(mask) {
            return Ok(Some(start));
        }
        if start == 0 && self.hold_move_during_census(self.directory().home(m.table, m.item(0).key), body) {
            return Ok(None);
        }
        let items: Vec<MoveItem> = (start..end).map(|i| m.item(i)).collect();
        let done = self.relocate_items(m.new_owner, m.table, &items, pieces);
        Ok((start + done < m.count).then_some(start + done))
    }

    /// At the old owner (shards held): hand the keys over, or queue the hand-over behind an
    /// incoming relocation. With `pieces`, stops once a piece of writes is ready to be sent;
    /// returns how many items it handled.
    fn relocate_items(&mut self, new_owner: u16, table: u16, items: &[MoveItem], pieces: bool) -> usize {
        let mut unknown = Vec::new();
        let mut done = 0;
        for &item in items {
            if pieces && self.tx.pending_write_bytes() >= WRITE_PIECE {
                break;
            }
            done += 1;
            if self.core.settings().backups > 0 && self.directory().is_lost(new_owner) {
                // A RELOCATE sent before its home learnt of the loss: the key stays here, where
                // the census after the loss records it.
                continue;
            }
            if let Some(mut slot) = self.unpublish_departing(table, item.key) {
                self.stamp(&mut slot);
                self.shard_of(table, item.key).counters.relocations_out += 1;
                self.hand_over_slot(slot, table, item.key, new_owner, item);
            } else if let Some(transit) = self.shard_of(table, item.key).transits.get_mut(&(table, item.key)) {
                if transit.abandoned {
                    let e = transit.suspect.as_deref().cloned().unwrap_or(Error::Protocol("the key's transfer to this node was given up".into()));
                    self.send_localize_failed(new_owner, &e, table, &[item.resv]);
                } else {
                    transit.queue.push(Queued::Relocate { new_owner, resv: item.resv, to: item.to });
                }
            } else {
                tracing::error!(node = self.directory().rank(), key = item.key, "told to hand over a key this node does not hold");
                unknown.push(item.resv);
            }
        }
        let e = Error::Protocol("the old owner did not hold the key".into());
        self.send_localize_failed(new_owner, &e, table, &unknown);
        done
    }

    /// Stops serving a key that leaves this node and hands its slot over; a key this node was
    /// granted a replica of (intent) stays here as one, with its departing value.
    fn unpublish_departing(&mut self, table: u16, key: u64) -> Option<Reserved> {
        let store = self.core.store();
        let mut guard = store.lock(table, key);
        let mut slot = guard.unpublish()?;
        if let Err(e) = store.keep_departing_replica(&guard, &mut slot) {
            // Only the replica is missing: the intent service makes it with a pull instead.
            tracing::warn!(node = self.directory().rank(), key, error = %e, "no room for a departing key's replica");
        }
        Some(slot)
    }

    /// Stamps a slot leaving this node with the time it stopped being served.
    pub(crate) fn stamp(&mut self, slot: &mut Reserved) {
        let stamp = ((self.now >> STAMP_SHIFT) as u32).max(1);
        self.core.store().stamp_outgoing(slot, stamp);
    }

    /// Posts the one-sided write of a slot no longer served here into the new owner's
    /// reserved slot; the slot is freed when the write completes. A key whose slot here, slot
    /// there and reservation each follow those of the last write's keys joins that write as a
    /// run: one write and one notification for the run (see [`Step::handle_writes_landed`]).
    pub(crate) fn send_slot(&mut self, slot: Reserved, table: u16, key: u64, new_owner: u16, item: MoveItem) {
        let dir = self.directory();
        if dir.caches() {
            dir.cache(table, key, new_owner);
        }
        if dir.is_lost(new_owner) {
            self.core.store().free(slot);
            return;
        }
        let store = self.core.store();
        let t = store.table(table);
        let (stride, len) = (t.slot_bytes(), t.transfer_bytes());
        let shard_index = dir.shard_of(table, key);
        let joins = self.tx.last_write().filter(|last| {
            let next = last.keys as usize * stride;
            last.to == new_owner
                && last.table == table
                && wr_shard(last.wr_id) == shard_index
                && last.len + stride <= MAX_RUN_BYTES
                && last.imm.wrapping_add(last.keys) == item.resv
                && last.remote.region == item.to.region
                && last.remote.addr.wrapping_add(next as u64) == item.to.addr
                // The source too is one region: consecutive slots of one chunk.
                && last.slot.wrapping_add(last.keys) == slot.index()
                && t.same_chunk(last.slot, slot.index())
        });
        if let Some(wr_id) = joins.map(|last| last.wr_id)
            && let Some(out) = self.shard(shard_index).outgoing.get_mut(&wr_id)
        {
            out.rest.push(slot);
            self.tx.grow_last_write(stride);
            self.tx.count_transfer(len);
            return;
        }
        let shard = self.shard(shard_index);
        shard.counters.relocation_writes += 1;
        let wr_id = shard.allocate_wr();
        let index = slot.index();
        shard.outgoing.insert(wr_id, Outgoing { first: slot, rest: Vec::new() });
        self.core.writes_out().fetch_add(1, Ordering::AcqRel);
        self.tx.push_write(SlotWrite { to: new_owner, table, slot: index, len, keys: 1, remote: item.to, imm: item.resv, wr_id });
        self.tx.count_transfer(len);
    }

    /// One-sided writes landed at this node, from index `start` on. A write's immediate is the
    /// reservation of its first key; a write longer than one slot's transfer bytes is a run,
    /// whose further keys are the reservations after it, in the slots after its first
    /// ([`Step::send_slot`]).
    pub fn handle_writes_landed(&mut self, writes: &[Landed], start: usize) -> super::Progress {
        let shards = self.directory().shards();
        let mask = writes.iter().skip(start).map(|w| resv_shard(w.imm)).filter(|&s| s < shards).fold(0u64, |m, s| m | 1 << s);
        if !self.try_acquire(mask) {
            return super::Progress::Yield { at: start, item: 0 };
        }
        let mut arrived: Vec<OpId> = Vec::new();
        for w in writes.iter().skip(start) {
            if resv_shard(w.imm) >= shards {
                tracing::warn!(node = self.directory().rank(), resv = w.imm, "a write landed for an unknown reservation");
                continue;
            }
            let keys = self.run_keys(w);
            for i in 0..keys {
                self.landed(w.imm.wrapping_add(i), &mut arrived);
            }
        }
        // A `localize` hears only when its last key arrived.
        self.deliver_arrived(arrived);
        super::Progress::Done
    }

    /// How many reservations a landed write fills (its shard held): one for a write of one
    /// slot's transfer bytes; for a run, as many as its length covers, but only as far as the
    /// reservations after the first are this node's, of the same table, in the slots after the
    /// first's — a write that claims more lands only its first keys, and says so.
    fn run_keys(&self, w: &Landed) -> u32 {
        let rank = self.directory().rank();
        let shard = self.shard_ref(resv_shard(w.imm));
        let Some(&(table, _)) = shard.reservations.get(&w.imm) else { return 1 };
        let t = self.core.store().table(table);
        let (stride, transfer) = (t.slot_bytes(), t.transfer_bytes());
        if w.len <= transfer {
            return 1;
        }
        let claimed = w.len - transfer;
        if !claimed.is_multiple_of(stride) {
            tracing::warn!(node = rank, resv = w.imm, len = w.len, "a write landed with a length that is no run of slots");
            return 1;
        }
        let claimed = (claimed / stride + 1) as u32;
        let slot_of = |resv: u32| {
            let &(tab, key) = shard.reservations.get(&resv)?;
            (tab == table).then_some(())?;
            shard.transits.get(&(tab, key))?.slot.as_ref().map(|s| s.index())
        };
        let Some(first) = slot_of(w.imm) else { return 1 };
        let first_addr = t.remote_addr(first);
        let mut keys = 1;
        while keys < claimed {
            let fits = slot_of(w.imm.wrapping_add(keys)).is_some_and(|slot| {
                let at = t.remote_addr(slot);
                at.region == first_addr.region && at.addr == first_addr.addr + keys as u64 * stride as u64
            });
            if !fits {
                tracing::warn!(node = rank, resv = w.imm, claimed, keys, "a run's write covers slots not reserved for it; only its first keys land");
                break;
            }
            keys += 1;
        }
        keys
    }

    /// A relocation's write landed: serve what queued for the key, then publish it (or move it
    /// on to a node the home already gave it to).
    /// `localize` operations whose last key this was go to `arrived`.
    pub(crate) fn landed(&mut self, resv: u32, arrived: &mut Vec<OpId>) {
        let dir = self.directory();
        let rank = dir.rank();
        let store = self.core.store();
        let now = self.now;
        let shard = self.shard(resv_shard(resv));
        let Some((table, key)) = shard.reservations.remove(&resv) else {
            tracing::warn!(node = rank, resv, "a write landed for an unknown reservation");
            return;
        };
        let Some(transit) = shard.transits.remove(&(table, key)) else {
            tracing::warn!(node = rank, resv, "a write landed for a key not in transit");
            return;
        };
        let Some(mut slot) = transit.slot else {
            tracing::error!(node = rank, resv, "a transit without its reserved slot");
            return;
        };
        let stamp = store.take_incoming_stamp(&mut slot);
        let elapsed = ((now >> STAMP_SHIFT) as u32).wrapping_sub(stamp);
        let counters = &mut shard.counters;
        if stamp != 0 && elapsed < 1 << 31 {
            ShardCounters::record(&mut counters.blocking_ns, (elapsed as u64) << STAMP_SHIFT);
        }
        ShardCounters::record(&mut counters.relocation_ns, now.saturating_sub(transit.started));
        counters.relocations_in += 1;
        for (op, left) in transit.waiters.iter() {
            if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                arrived.push(*op);
            }
        }
        // A replica here served this node's workers while the key was on its way: its unsent
        // pushes join the value before anything reads it — the accesses queued for the key
        // below included (the slot is not yet published, and this step holds the key's shard).
        {
            let guard = store.lock(table, key);
            store.fold_replica_into_arrival(&guard, &mut slot);
        }
        let value_bytes = store.table(table).value_len() * 4;
        let mut slot = Some(slot);
        let mut answers = AnswerBatch::default();
        let mut failures = FailureBatch::default();
        // The node the key was handed to from here, if it moved on at once.
        let mut moved_to: Option<u16> = None;
        for queued in transit.queue {
            let here = slot.is_some();
            match (queued, here) {
                (Queued::Access { origin, op, part, index, kind, values }, true) => {
                    let out = answers.add(origin, op, part, kind, table, index);
                    let at = out.len();
                    if kind.returns_values() {
                        out.resize(at + value_bytes, 0);
                    }
                    let held = slot.as_mut().expect("here");
                    apply(&store.reserved(held), store.table(table).updater(), kind, f32_bytes(&values), &mut out[at..]);
                }
                (Queued::Access { origin, op, part, index, kind, values }, false) => match moved_to {
                    // The key moved on before this item was served, and its home is on its way
                    // out (it would hold the item, and a later request of its worker could
                    // bring the key back here first): straight to the new owner, where it
                    // queues until the key lands, ahead of anything the home sends there.
                    Some(to) if self.forwards_held_for(dir.home(table, key)) => {
                        let codec = store.table(table).spec().codec;
                        let h = AccessHeader { kind, flags: FLAG_INDEXED | wire::FLAG_FORWARDED, table, origin, op, part, codec };
                        let buf = self.tx.buf(to);
                        let before = buf.len();
                        wire::encode_access(buf, h, 1, |_| index, |_| key, |_, o| o.extend_from_slice(f32_bytes(&values)));
                        let bytes = buf.len() - before;
                        self.tx.sent(to, MessageKind::Forward, bytes);
                    }
                    // The key moved on before this item was served: via the home node.
                    _ => self.forward_to_home(table, key, origin, op, part, index, kind, &values, &mut failures),
                },
                (Queued::Relocate { new_owner, resv, to }, true) => {
                    moved_to = Some(new_owner);
                    let mut held = slot.take().expect("here");
                    self.stamp(&mut held);
                    self.shard_of(table, key).counters.relocations_out += 1;
                    self.hand_over_slot(held, table, key, new_owner, MoveItem { key, resv, to });
                }
                (Queued::Relocate { new_owner, resv, .. }, false) => {
                    tracing::error!(node = rank, key, "two hand-overs queued for one key");
                    self.send_localize_failed(new_owner, &Error::Protocol("conflicting hand-overs".into()), table, &[resv]);
                }
            }
        }
        match slot {
            Some(held) => {
                store.lock(table, key).publish(held);
                dir.uncache(table, key);
                // The writes queued for the key were applied to it above (and a replica's pushes
                // folded in): with backups, the rounds that release their answers carry it.
                self.core.note_written(table, key);
            }
            // It moved on at once: no longer arriving here (a census after a loss would
            // otherwise find it neither here nor away).
            None => store.lock(table, key).set_arriving(false),
        }
        self.flush_answers(answers);
        self.flush_failures(failures);
    }

    /// Tells the `localize` operations in `waiters` that one of their keys will not arrive.
    fn arrival_failed(&mut self, waiters: &Waiters, error: &Error) {
        let mut told: Vec<OpId> = Vec::new();
        for (op, left) in waiters.iter() {
            left.fetch_sub(1, Ordering::AcqRel);
            if !told.contains(op) {
                told.push(*op);
                self.tx.deliver(worker_of(*op), Delivery::Local(LocalEvent::ArrivalFailed { op: *op, error: error.clone() }));
            }
        }
    }

    /// LOCALIZE_FAILED from node `from` at the requester: the home node or old owner refused
    /// relocations. `Some(0)` when the step must end first.
    pub(super) fn handle_localize_failed(&mut self, from: u16, body: &[u8]) -> Result<Option<usize>> {
        let f = LocalizeFailed::decode(body)?;
        let shards = self.directory().shards();
        let mut mask = 0u64;
        for i in 0..f.count {
            let s = resv_shard(f.resv(i));
            if s < shards {
                mask |= 1 << s;
            }
        }
        if !self.try_acquire(mask) {
            return Ok(Some(0));
        }
        let mut arrived = Vec::new();
        for i in 0..f.count {
            let resv = f.resv(i);
            if resv_shard(resv) >= shards {
                continue;
            }
            if f.code == FailureCode::Declined {
                self.decline_reservation(resv, &mut arrived);
                continue;
            }
            if f.code == FailureCode::Superseded {
                self.supersede_reservation(resv, &mut arrived);
                continue;
            }
            let Some(&(table, key)) = self.shard(resv_shard(resv)).reservations.get(&resv) else { continue };
            let error = match f.code {
                FailureCode::PeerLost => Error::PeerLost { node: f.node as usize, reason: format!("reported by node {from}") },
                FailureCode::KeyLost => Error::KeyLost { table: self.directory().table_name(table), key },
                _ => Error::Protocol(format!("relocation of key {key} of '{}' was refused", self.directory().table_name(table))),
            };
            // The old owner lost the key's value (it was itself waiting for it from a lost
            // node) after the home had made this node the owner: the home routes the key here
            // for good, so its transit stays, given up, and fails what comes for it with the
            // loss (as at the old owner), instead of the key being found nowhere. A home that
            // refuses made no such change, or marked the key lost itself.
            let lost_on_the_way = matches!(f.code, FailureCode::PeerLost | FailureCode::KeyLost) && from != self.directory().home(table, key);
            if lost_on_the_way {
                self.lose_reservation(resv, error);
            } else {
                self.fail_reservation(resv, error);
            }
        }
        self.deliver_arrived(arrived);
        Ok(None)
    }

    /// No write will fill reservation `resv` (its shard held): free the slot and fail what
    /// waits for the key.
    fn fail_reservation(&mut self, resv: u32, error: Error) {
        let Some(((table, key), transit)) = self.end_transit(resv) else { return };
        self.fail_transit_items(table, key, transit.queue, &transit.waiters, &error, false);
    }

    /// Reservation `resv`'s key will never come and its home records this node as the owner
    /// (its shard held): the transit is given up with `error` as after a lost peer's grace
    /// period ([`Step::give_up_transit`]), its reservation kept.
    fn lose_reservation(&mut self, resv: u32, error: Error) {
        let Some(&key) = self.shard(resv_shard(resv)).reservations.get(&resv) else { return };
        let Some(transit) = self.shard_of(key.0, key.1).transits.get_mut(&key) else { return };
        if transit.abandoned {
            return;
        }
        transit.suspect = Some(Box::new(error));
        self.give_up_transit(key);
    }

    /// Ends reservation `resv` without a landing (its shard held): forgets it and its transit,
    /// clears the key's arriving mark and frees the reserved slot. Returns the key and what
    /// waited on the transit, for the caller to settle.
    fn end_transit(&mut self, resv: u32) -> Option<((u16, u64), Transit)> {
        let shard = self.shard(resv_shard(resv));
        let key = shard.reservations.remove(&resv)?;
        let mut transit = shard.transits.remove(&key)?;
        let store = self.core.store();
        store.lock(key.0, key.1).set_arriving(false);
        if let Some(slot) = transit.slot.take() {
            store.free(slot);
        }
        Some((key, transit))
    }

    /// Opens the transit of `key` of `table` into `slot` (the key's shard held, no transit of
    /// it open): records the reservation, arms the deadline after which the move counts as
    /// stuck and marks the key arriving. Returns the item a LOCALIZE asks its home for.
    pub(super) fn open_transit(&mut self, table: u16, key: u64, slot: Reserved, waiters: Waiters, granted: bool) -> MoveItem {
        let core = self.core;
        let to = core.store().table(table).remote_addr(slot.index());
        let (now, deadline) = (self.now, self.now.saturating_add(core.settings().op_timeout_ns));
        let shard = self.shard_of(table, key);
        let resv = shard.allocate_resv();
        let generation = shard.next_generation();
        shard.reservations.insert(resv, (table, key));
        let transit =
            Transit { slot: Some(slot), queue: Vec::new(), waiters, started: now, suspect: None, suspect_since: 0, abandoned: false, generation, granted };
        shard.transits.insert((table, key), transit);
        shard.push_deadline((deadline, table, key, generation, DeadlineKind::Stuck));
        self.tx.note_deadline(deadline);
        core.store().lock(table, key).set_arriving(true);
        MoveItem { key, resv, to }
    }

    /// Asks `home` (possibly this node) to move `items` of `table` here.
    pub(super) fn request_move(&mut self, home: u16, table: u16, items: &[MoveItem], flags: u8) {
        let rank = self.directory().rank();
        if home == rank {
            if self.core.census_active() {
                // Held with the others until the census is over.
                let mut message = Vec::new();
                wire::encode_move(&mut message, msg::LOCALIZE, flags, table, 0, items);
                self.hold_move_during_census(rank, &message[4..]);
                return;
            }
            self.localize_at_home(rank, table, items, false, flags);
        } else {
            self.send_move(home, msg::LOCALIZE, flags, table, 0, items);
        }
    }

    /// Gives up on what waits for a key in transit (the value may never come): queued items and
    /// localize waiters fail, and new operations on the key fail at once. Queued hand-overs stay,
    /// so that a late landing still moves the key on.
    pub(super) fn abandon_transit_queue(&mut self, key: (u16, u64), error: Error) {
        let grace = self.core.settings().loss_grace_ns;
        let now = self.now;
        let shard = self.shard_of(key.0, key.1);
        let Some(transit) = shard.transits.get_mut(&key) else { return };
        if transit.suspect.is_none() {
            transit.suspect_since = now;
        }
        transit.suspect = Some(Box::new(error.clone()));
        let queue = std::mem::take(&mut transit.queue);
        let waiters = std::mem::take(&mut transit.waiters);
        let deadline = (transit.suspect_since.saturating_add(grace), key.0, key.1, transit.generation, DeadlineKind::Grace);
        shard.push_deadline(deadline);
        self.tx.note_deadline(deadline.0);
        let kept = self.fail_transit_items(key.0, key.1, queue, &waiters, &error, true);
        if let Some(transit) = self.shard_of(key.0, key.1).transits.get_mut(&key) {
            transit.queue = kept;
        }
    }

    /// The grace period after a loss passed and the key has not landed: queued hand-overs fail
    /// (their requesters must not wait for a value that may never come), and later ones fail at
    /// once. The reservation stays, so that a late landing is still received safely.
    pub(super) fn give_up_transit(&mut self, key: (u16, u64)) {
        let rank = self.directory().rank();
        let Some(transit) = self.shard_of(key.0, key.1).transits.get_mut(&key) else { return };
        transit.abandoned = true;
        let error = transit.suspect.as_deref().cloned().unwrap_or(Error::Protocol("relocation given up".into()));
        let queue = std::mem::take(&mut transit.queue);
        let waiters = std::mem::take(&mut transit.waiters);
        tracing::warn!(node = rank, table = key.0, key = key.1, "giving up an incoming relocation after a lost peer");
        self.fail_transit_items(key.0, key.1, queue, &waiters, &error, false);
    }

    /// Fails queued items and waiters; returns the queued hand-overs when `keep_relocations`.
    fn fail_transit_items(&mut self, table: u16, key: u64, queue: Vec<Queued>, waiters: &Waiters, error: &Error, keep_relocations: bool) -> Vec<Queued> {
        let mut kept = Vec::new();
        let mut failures = FailureBatch::default();
        let (code, node) = failure_code(error);
        for queued in queue {
            match queued {
                Queued::Access { origin, op, part, index, .. } => failures.add(origin, op, part, table, code, node, key, index),
                Queued::Relocate { new_owner, resv, to } => {
                    if keep_relocations {
                        kept.push(Queued::Relocate { new_owner, resv, to });
                    } else {
                        // The value is lost on its way; as the key's home, this node made
                        // `new_owner` the owner: the key is lost (its requester, told by the
                        // home, forgets its transit).
                        let dir = self.directory();
                        if matches!(error, Error::PeerLost { .. } | Error::KeyLost { .. })
                            && dir.home(table, key) == dir.rank()
                            && dir.owner(table, key) == new_owner
                        {
                            dir.set_owner(table, key, LOST_OWNER);
                        }
                        self.send_localize_failed(new_owner, error, table, &[resv]);
                    }
                }
            }
        }
        self.flush_failures(failures);
        self.arrival_failed(waiters, error);
        kept
    }
}
