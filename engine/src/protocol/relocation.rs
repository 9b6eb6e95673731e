//! `localize`: the requester reserves slots and tells the home node, the home node re-routes and
//! tells the old owner, the old owner writes the value into the reserved slot, and the requester
//! serves everything it queued once the write lands.

use super::access::{AnswerBatch, failure_code, serve_row};
use super::rows::Rows;
use super::wire::{self, AccessHeader, AccessKind, FLAG_INDEXED, FLAG_STALE, FailureCode, LocalizeFailed, Move, MoveItem, msg};
use super::{LOST_OWNER, OpId, OpKind, Protocol, Queued, SlotWrite, Submitted, Transit};
use crate::error::{Error, Result};
use crate::stats::{MessageKind, ProtocolCounters};
use crate::store::STAMP_SHIFT;
use crate::util::f32_bytes;

impl Protocol {
    pub(super) fn submit_localize(&mut self, table: u16, keys: &[u64]) -> Result<Submitted> {
        if !self.settings.relocation {
            return Ok(Submitted::Done(Vec::new()));
        }
        let id = self.register_op(OpKind::Localize, table, Vec::new());
        let mut groups: Vec<Vec<MoveItem>> = vec![Vec::new(); self.nodes];
        let (mut remaining, mut error) = (0usize, None);
        for &key in keys {
            if self.store.table(table).slot_of(key).is_some() {
                continue;
            }
            if let Some(transit) = self.transits.get_mut(&(table, key)) {
                match &transit.suspect {
                    Some(e) => {
                        error.get_or_insert_with(|| e.clone());
                    }
                    None => {
                        transit.waiters.push(id);
                        remaining += 1;
                    }
                }
                continue;
            }
            let meta = &self.tables[table as usize];
            let home = meta.partitioner.home(key) as u16;
            if self.is_lost(home) {
                error.get_or_insert_with(|| self.lost_error(home));
                continue;
            }
            if home == self.rank && self.owners[table as usize][meta.partitioner.home_index(key)] == LOST_OWNER {
                error.get_or_insert_with(|| Error::KeyLost { table: meta.name.clone(), key });
                continue;
            }
            let slot = match self.store.reserve(table) {
                Ok(s) => s,
                Err(e) => {
                    error.get_or_insert(e);
                    continue;
                }
            };
            let resv = self.allocate_reservation();
            self.transits.insert(
                (table, key),
                Transit { slot, queue: Vec::new(), waiters: vec![id], started: self.now, suspect: None, suspect_since: 0, abandoned: false },
            );
            self.reservations.insert(resv, (table, key));
            groups[home as usize].push(MoveItem { key, resv, to: self.store.table(table).remote_addr(slot) });
            remaining += 1;
        }
        let per_message = ((self.settings.max_message_bytes - wire::MOVE_HEADER) / wire::MOVE_ITEM).max(1);
        for (home, items) in groups.iter().enumerate() {
            for chunk in items.chunks(per_message) {
                self.send_move(home as u16, msg::LOCALIZE, table, 0, chunk);
            }
        }
        let op = self.ops.get_mut(&id).expect("registered");
        op.remaining = remaining;
        if let Some(e) = error {
            op.error = Some(e);
        }
        if remaining == 0 {
            let op = self.ops.remove(&id).expect("registered");
            return match op.error {
                Some(e) => Err(e),
                None => Ok(Submitted::Done(Vec::new())),
            };
        }
        Ok(Submitted::Pending(id))
    }

    fn allocate_reservation(&mut self) -> u32 {
        loop {
            let r = self.next_resv;
            self.next_resv = self.next_resv.wrapping_add(1).max(1);
            if !self.reservations.contains_key(&r) {
                return r;
            }
        }
    }

    fn send_move(&mut self, to: u16, ty: u8, table: u16, new_owner: u16, items: &[MoveItem]) {
        let buf = self.out.buf(to);
        let before = buf.len();
        wire::encode_move(buf, ty, table, new_owner, items);
        let bytes = buf.len() - before;
        let kind = if ty == msg::LOCALIZE { MessageKind::Localize } else { MessageKind::Relocate };
        self.out.sent(to, kind, bytes);
    }

    fn send_localize_failed(&mut self, to: u16, error: &Error, table: u16, resvs: &[u32]) {
        if resvs.is_empty() || self.is_lost(to) {
            return;
        }
        let (code, node) = failure_code(error);
        let buf = self.out.buf(to);
        let before = buf.len();
        wire::encode_localize_failed(buf, code, table, node, resvs);
        let bytes = buf.len() - before;
        self.out.sent(to, MessageKind::Failure, bytes);
    }

    /// At the home node: record the requester as owner and tell each old owner.
    pub(super) fn handle_localize(&mut self, requester: u16, body: &[u8]) -> Result<()> {
        let m = Move::decode(body, self.tables.len())?;
        if self.is_lost(requester) {
            return Ok(());
        }
        let table = m.table as usize;
        let mut groups: Vec<Vec<MoveItem>> = vec![Vec::new(); self.nodes];
        let mut failed: Vec<(Error, Vec<u32>)> = Vec::new();
        for i in 0..m.count {
            let item = m.item(i);
            let meta = &self.tables[table];
            if item.key >= meta.keys {
                return Err(Error::Protocol(format!("LOCALIZE for key {} beyond table '{}'", item.key, meta.name)));
            }
            let outcome = if meta.partitioner.home(item.key) != self.rank as usize {
                Err(Error::Protocol(format!("LOCALIZE of key {} sent to a node that is not its home", item.key)))
            } else {
                let index = meta.partitioner.home_index(item.key);
                match self.owners[table][index] {
                    LOST_OWNER => Err(Error::KeyLost { table: meta.name.clone(), key: item.key }),
                    // This node owns the key but its own incoming transfer may never come: do not
                    // promise the key to anyone else.
                    owner if owner == self.rank && self.transits.get(&(m.table, item.key)).is_some_and(|t| t.suspect.is_some()) => {
                        Err(self.transits[&(m.table, item.key)].suspect.clone().expect("checked"))
                    }
                    owner if owner == requester => Err(Error::Protocol(format!("node {requester} asked for key {} it already owns", item.key))),
                    owner if self.is_lost(owner) => Err(self.lost_error(owner)),
                    owner => {
                        self.owners[table][index] = requester;
                        Ok(owner)
                    }
                }
            };
            match outcome {
                Ok(owner) => groups[owner as usize].push(item),
                Err(e) => match failed.iter_mut().find(|(k, _)| *k == e) {
                    Some((_, resvs)) => resvs.push(item.resv),
                    None => failed.push((e, vec![item.resv])),
                },
            }
        }
        for (owner, items) in groups.iter().enumerate() {
            if !items.is_empty() {
                self.send_move(owner as u16, msg::RELOCATE, m.table, requester, items);
            }
        }
        for (e, resvs) in failed {
            self.send_localize_failed(requester, &e, m.table, &resvs);
        }
        Ok(())
    }

    /// At the old owner: hand the keys over (or queue the hand-over behind an incoming one).
    pub(super) fn handle_relocate(&mut self, body: &[u8]) -> Result<()> {
        let m = Move::decode(body, self.tables.len())?;
        if m.new_owner as usize >= self.nodes || m.new_owner == self.rank {
            return Err(Error::Protocol(format!("RELOCATE to invalid node {}", m.new_owner)));
        }
        let mut unknown = Vec::new();
        for i in 0..m.count {
            let item = m.item(i);
            if item.key >= self.tables[m.table as usize].keys {
                return Err(Error::Protocol(format!("RELOCATE for key {} beyond its table", item.key)));
            }
            if let Some(slot) = self.store.table(m.table).slot_of(item.key) {
                self.relocate_out(m.table, item.key, slot, m.new_owner, item);
            } else if let Some(transit) = self.transits.get_mut(&(m.table, item.key)) {
                if transit.abandoned {
                    let e = transit.suspect.clone().unwrap_or(Error::Protocol("the key's transfer to this node was given up".into()));
                    self.send_localize_failed(m.new_owner, &e, m.table, &[item.resv]);
                } else {
                    transit.queue.push(Queued::Relocate { new_owner: m.new_owner, resv: item.resv, to: item.to });
                }
            } else {
                tracing::error!(node = self.rank, key = item.key, "told to hand over a key this node does not hold");
                unknown.push(item.resv);
            }
        }
        let e = Error::Protocol("the old owner did not hold the key".into());
        self.send_localize_failed(m.new_owner, &e, m.table, &unknown);
        Ok(())
    }

    /// Stops serving `key`, stamps the slot with the stop time and posts the value's write.
    fn relocate_out(&mut self, table: u16, key: u64, slot: u32, new_owner: u16, item: MoveItem) {
        let t = self.store.table(table);
        {
            let _latch = self.store.latch(table, key);
            t.unpublish(key);
        }
        // SAFETY: the key was just unpublished under its latch, so no local access can reach the
        // slot any more.
        unsafe { t.stamp_outgoing(slot, ((self.now >> STAMP_SHIFT) as u32).max(1)) };
        self.counters.relocations_out += 1;
        if self.settings.location_caches {
            self.cache.insert((table, key), new_owner);
        }
        if self.is_lost(new_owner) {
            self.store.free(table, slot);
            return;
        }
        let wr_id = self.next_wr;
        self.next_wr += 1;
        self.outgoing.insert(wr_id, (table, slot));
        let len = t.transfer_bytes();
        self.writes.push(SlotWrite { to: new_owner, table, slot, len, remote: item.to, imm: item.resv, wr_id });
        self.out.traffic.add(MessageKind::Transfer, len);
    }

    /// At the requester: a relocation's write landed.
    pub(super) fn landed(&mut self, resv: u32) {
        let Some((table, key)) = self.reservations.remove(&resv) else {
            tracing::warn!(node = self.rank, resv, "a write landed for an unknown reservation");
            return;
        };
        let Some(transit) = self.transits.remove(&(table, key)) else {
            tracing::warn!(node = self.rank, resv, "a write landed for a key not in transit");
            return;
        };
        let t = self.store.table(table);
        // SAFETY: the slot was reserved for this relocation, the write has landed, and the key is
        // not published yet, so nobody else uses the slot.
        let stamp = unsafe { t.take_incoming_stamp(transit.slot) };
        let elapsed = ((self.now >> STAMP_SHIFT) as u32).wrapping_sub(stamp);
        if stamp != 0 && elapsed < 1 << 31 {
            ProtocolCounters::record(&mut self.counters.blocking_ns, (elapsed as u64) << STAMP_SHIFT);
        }
        ProtocolCounters::record(&mut self.counters.relocation_ns, self.now.saturating_sub(transit.started));
        self.counters.relocations_in += 1;
        for waiter in &transit.waiters {
            if let Some(op) = self.ops.get_mut(waiter) {
                op.remaining = op.remaining.saturating_sub(1);
            }
        }
        for waiter in transit.waiters {
            self.maybe_complete(waiter);
        }
        let value_len = self.tables[table as usize].value_len;
        let mut gone: Option<u16> = None;
        let mut answers = AnswerBatch::default();
        let mut reroute: Vec<(OpId, u32, AccessKind, Vec<f32>)> = Vec::new();
        for queued in transit.queue {
            match (queued, gone) {
                (Queued::Local { op, row, kind, values }, None) => self.serve_queued_local(op, row, kind, table, key, transit.slot, &values),
                (Queued::Local { op, row, kind, values }, Some(_)) => reroute.push((op, row, kind, values)),
                (Queued::Remote { origin, op, part, index, kind, values }, None) => {
                    let out = answers.add(origin, op, part, kind, table, index);
                    let mut pulled = vec![0.0; if kind == AccessKind::Pull { value_len } else { 0 }];
                    serve_row(&self.store, table, key, transit.slot, kind, &values, &mut pulled);
                    out.extend_from_slice(f32_bytes(&pulled));
                }
                (Queued::Remote { origin, op, part, index, kind, values }, Some(_)) => {
                    // It came through a stale cache; the key has moved on: via the home node.
                    let home = self.tables[table as usize].partitioner.home(key) as u16;
                    let h = AccessHeader { kind, flags: FLAG_INDEXED | FLAG_STALE, table, origin, op, part };
                    let buf = self.out.buf(home);
                    let before = buf.len();
                    wire::encode_access(buf, h, 1, |_| index, |_| key, |_, o| o.extend_from_slice(f32_bytes(&values)));
                    let bytes = buf.len() - before;
                    self.out.sent(home, MessageKind::Forward, bytes);
                    self.counters.double_forwarded_keys += 1;
                }
                (Queued::Relocate { new_owner, resv, to }, None) => {
                    self.relocate_out(table, key, transit.slot, new_owner, MoveItem { key, resv, to });
                    gone = Some(new_owner);
                }
                (Queued::Relocate { new_owner, resv, .. }, Some(_)) => {
                    tracing::error!(node = self.rank, key, "two hand-overs queued for one key");
                    self.send_localize_failed(new_owner, &Error::Protocol("conflicting hand-overs".into()), table, &[resv]);
                }
            }
        }
        if gone.is_none() {
            let _latch = self.store.latch(table, key);
            self.store.table(table).publish(key, transit.slot);
            self.cache.remove(&(table, key));
        }
        self.flush_answers(answers);
        for (op_id, row, kind, values) in reroute {
            if let Some(mut op) = self.ops.remove(&op_id) {
                self.send_rows(op_id, &mut op, kind, &Rows::one(row), &|_| &values[..]);
                self.ops.insert(op_id, op);
                self.maybe_complete(op_id);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn serve_queued_local(&mut self, op_id: OpId, row: u32, kind: AccessKind, table: u16, key: u64, slot: u32, values: &[f32]) {
        let value_len = self.tables[table as usize].value_len;
        let Some(op) = self.ops.get_mut(&op_id) else {
            // The operation failed or was abandoned (its caller saw an error); do not apply it.
            return;
        };
        let output =
            if kind == AccessKind::Pull { &mut op.values.as_mut_slice()[row as usize * value_len..(row as usize + 1) * value_len] } else { &mut [][..] };
        serve_row(&self.store, table, key, slot, kind, values, output);
        op.answer(row);
        self.counters.local_keys += 1;
        self.maybe_complete(op_id);
    }

    /// At the requester: the home node or old owner refused relocations.
    pub(super) fn handle_localize_failed(&mut self, body: &[u8]) -> Result<()> {
        let f = LocalizeFailed::decode(body)?;
        for i in 0..f.count {
            let Some((table, key)) = self.reservations.remove(&f.resv(i)) else { continue };
            let Some(transit) = self.transits.remove(&(table, key)) else { continue };
            let error = match f.code {
                FailureCode::PeerLost => Error::PeerLost { node: f.node as usize, reason: "reported by the home node".into() },
                FailureCode::KeyLost => Error::KeyLost { table: self.table_name(table), key },
                _ => Error::Protocol(format!("relocation of key {key} of '{}' was refused", self.table_name(table))),
            };
            // No write will target the slot: the home node did not pass the request on, or the
            // old owner did not have the key.
            self.store.free(table, transit.slot);
            self.fail_transit_items(table, transit.queue, transit.waiters, &error, false);
        }
        Ok(())
    }

    /// Gives up on what waits for a key in transit (the value may never come): queued items and
    /// localize waiters fail, and new operations on the key fail at once. Queued hand-overs stay,
    /// so that a late landing still moves the key on.
    pub(super) fn abandon_transit_queue(&mut self, key: (u16, u64), error: Error) {
        let Some(transit) = self.transits.get_mut(&key) else { return };
        if transit.suspect.is_none() {
            transit.suspect_since = self.now;
        }
        transit.suspect = Some(error.clone());
        let queue = std::mem::take(&mut transit.queue);
        let waiters = std::mem::take(&mut transit.waiters);
        let kept = self.fail_transit_items(key.0, queue, waiters, &error, true);
        if let Some(transit) = self.transits.get_mut(&key) {
            transit.queue = kept;
        }
    }

    /// The grace period after a loss passed and the key has not landed: queued hand-overs fail
    /// (their requesters must not wait for a value that may never come), and later ones fail at
    /// once. The reservation stays, so that a late landing is still received safely.
    pub(super) fn give_up_transit(&mut self, key: (u16, u64)) {
        let Some(transit) = self.transits.get_mut(&key) else { return };
        transit.abandoned = true;
        let error = transit.suspect.clone().unwrap_or(Error::Protocol("relocation given up".into()));
        let queue = std::mem::take(&mut transit.queue);
        let waiters = std::mem::take(&mut transit.waiters);
        tracing::warn!(node = self.rank, table = key.0, key = key.1, "giving up an incoming relocation after a lost peer");
        self.fail_transit_items(key.0, queue, waiters, &error, false);
    }

    /// Fails queued items and waiters; returns the queued hand-overs when `keep_relocations`.
    fn fail_transit_items(&mut self, table: u16, queue: Vec<Queued>, waiters: Vec<OpId>, error: &Error, keep_relocations: bool) -> Vec<Queued> {
        let mut kept = Vec::new();
        let mut remote_failures: Vec<(u16, OpId, u32, Vec<u32>)> = Vec::new();
        for queued in queue {
            match queued {
                Queued::Local { op, row, .. } => {
                    if let Some(o) = self.ops.get_mut(&op) {
                        o.error.get_or_insert_with(|| error.clone());
                        o.answer(row);
                    }
                    self.maybe_complete(op);
                }
                Queued::Remote { origin, op, part, index, .. } => match remote_failures.iter_mut().find(|f| f.0 == origin && f.1 == op && f.2 == part) {
                    Some(f) => f.3.push(index),
                    None => remote_failures.push((origin, op, part, vec![index])),
                },
                Queued::Relocate { new_owner, resv, to } => {
                    if keep_relocations {
                        kept.push(Queued::Relocate { new_owner, resv, to });
                    } else {
                        self.send_localize_failed(new_owner, error, table, &[resv]);
                    }
                }
            }
        }
        let (code, node) = failure_code(error);
        for (origin, op, part, indices) in remote_failures {
            if self.is_lost(origin) {
                continue;
            }
            let buf = self.out.buf(origin);
            let before = buf.len();
            wire::encode_failure(buf, code, table, node, op, part, &indices);
            let bytes = buf.len() - before;
            self.out.sent(origin, MessageKind::Failure, bytes);
        }
        for waiter in waiters {
            if let Some(o) = self.ops.get_mut(&waiter) {
                o.error.get_or_insert_with(|| error.clone());
                o.remaining = o.remaining.saturating_sub(1);
            }
            self.maybe_complete(waiter);
        }
        kept
    }
}
