//! ACCESS at the receiving node: serve what is here (latches only), queue what is arriving,
//! forward what lives elsewhere (shard locks).

use super::LOST_OWNER;
use super::Step;
use super::requester::OpId;
use super::shard::Queued;
use super::wire::{self, Access, AccessHeader, AccessKind, FLAG_DIRECT, FLAG_FORWARDED, FLAG_INDEXED, FLAG_STALE, FailureCode};
use crate::error::{Error, Result};
use crate::stats::MessageKind;
use crate::store::{Residence, Slot};
use crate::update::Updater;
use crate::util::copy_bytes_to_f32;

/// Maps an error to the code FAILURE messages carry.
pub(super) fn failure_code(error: &Error) -> (FailureCode, u16) {
    match error {
        Error::PeerLost { node, .. } => (FailureCode::PeerLost, *node as u16),
        Error::KeyLost { .. } => (FailureCode::KeyLost, 0),
        Error::Timeout { .. } => (FailureCode::Unavailable, 0),
        _ => (FailureCode::Protocol, 0),
    }
}

/// Applies an access to a slot: pull values out as little-endian bytes, apply the input bytes
/// with the table's `updater` (a push-pull then reads the result), or write them.
#[inline]
pub(super) fn apply(slot: &Slot<'_>, updater: &Updater, kind: AccessKind, input: &[u8], pulled: &mut [u8]) {
    match kind {
        AccessKind::Pull => slot.read_le_bytes(pulled),
        AccessKind::Push => slot.push_le_bytes(updater, input),
        AccessKind::Set => slot.write_le_bytes(input),
        AccessKind::PushPull => {
            slot.push_le_bytes(updater, input);
            slot.read_le_bytes(pulled);
        }
    }
}

/// Serves item `i` of an access on its slot, appending pulled values to `buf`.
#[inline]
fn serve_item(slot: &Slot<'_>, updater: &Updater, a: &Access<'_>, i: usize, buf: &mut Vec<u8>) {
    match a.kind {
        AccessKind::Pull => slot.append_le_bytes(buf),
        AccessKind::Push => slot.push_le_bytes(updater, a.value(i)),
        AccessKind::Set => slot.write_le_bytes(a.value(i)),
        AccessKind::PushPull => {
            slot.push_le_bytes(updater, a.value(i));
            slot.append_le_bytes(buf);
        }
    }
}

/// Answers to items of one (origin, op, part), collected and sent as one indexed RESPONSE.
pub(super) struct Answers {
    origin: u16,
    op: OpId,
    part: u32,
    kind: AccessKind,
    table: u16,
    indices: Vec<u32>,
    values: Vec<u8>,
}

/// Answers for several operations.
#[derive(Default)]
pub(super) struct AnswerBatch {
    entries: Vec<Answers>,
}

impl AnswerBatch {
    /// Adds item `index`; returns where its pulled value bytes go (extend by the value).
    pub fn add(&mut self, origin: u16, op: OpId, part: u32, kind: AccessKind, table: u16, index: u32) -> &mut Vec<u8> {
        let pos = match self.entries.iter().position(|e| e.origin == origin && e.op == op && e.part == part) {
            Some(p) => p,
            None => {
                self.entries.push(Answers { origin, op, part, kind, table, indices: Vec::new(), values: Vec::new() });
                self.entries.len() - 1
            }
        };
        let e = &mut self.entries[pos];
        e.indices.push(index);
        &mut e.values
    }
}

/// Failed items of one operation part, for one reason.
struct Failed {
    origin: u16,
    op: OpId,
    part: u32,
    table: u16,
    code: FailureCode,
    node: u16,
    /// The first failed key (named in the error).
    key: u64,
    indices: Vec<u32>,
}

/// Failed items of several operation parts, by reason.
#[derive(Default)]
pub(super) struct FailureBatch {
    entries: Vec<Failed>,
}

impl FailureBatch {
    /// Item `index` (key `key`) of (origin, op, part) failed with `code`/`node`.
    #[allow(clippy::too_many_arguments)]
    pub fn add(&mut self, origin: u16, op: OpId, part: u32, table: u16, code: FailureCode, node: u16, key: u64, index: u32) {
        match self.entries.iter_mut().find(|e| e.origin == origin && e.op == op && e.part == part && e.code == code && e.node == node) {
            Some(e) => e.indices.push(index),
            None => self.entries.push(Failed { origin, op, part, table, code, node, key, indices: vec![index] }),
        }
    }
}

impl Step<'_, '_> {
    /// Sends collected answers to their origins.
    pub(super) fn flush_answers(&mut self, answers: AnswerBatch) {
        let rank = self.directory().rank();
        let core = self.core;
        let codec_of = |table: u16| core.store().table(table).spec().codec;
        for e in answers.entries {
            if self.directory().is_lost(e.origin) {
                continue;
            }
            let buf = self.tx.buf(e.origin);
            let before = buf.len();
            let start = wire::begin_response(buf, e.kind, FLAG_INDEXED, e.table, rank, e.op, e.part, codec_of(e.table));
            for i in &e.indices {
                buf.extend_from_slice(&i.to_le_bytes());
            }
            buf.extend_from_slice(&e.values);
            wire::finish_response(buf, start, e.indices.len());
            self.answered(e.origin, e.kind, before);
        }
    }

    /// A RESPONSE to `origin` was encoded from byte `before` of its buffer: counts it as sent,
    /// or, with backups, holds an answer to a write until its effect is backed up.
    fn answered(&mut self, origin: u16, kind: AccessKind, before: usize) {
        if self.core.settings().backups > 0 && kind != AccessKind::Pull {
            let bytes = self.tx.buf(origin).split_off(before);
            self.hold_answer(origin, bytes);
            return;
        }
        let bytes = self.tx.buf(origin).len() - before;
        self.tx.sent(origin, MessageKind::Response, bytes);
    }

    /// Sends collected failures to their origins.
    pub(super) fn flush_failures(&mut self, failures: FailureBatch) {
        for f in failures.entries {
            if self.directory().is_lost(f.origin) {
                continue;
            }
            let buf = self.tx.buf(f.origin);
            let before = buf.len();
            wire::encode_failure(buf, f.code, f.table, f.node, f.op, f.part, f.key, &f.indices);
            let bytes = buf.len() - before;
            self.tx.sent(f.origin, MessageKind::Failure, bytes);
        }
    }

    /// Routes an ACCESS held or made here (`body`, without its length) as if it came from this
    /// node, under the shards the step holds already; `what` names it in the log should that
    /// fail (a bug: the callers hold every shard its items touch).
    pub(crate) fn route_access_here(&mut self, body: &[u8], what: &str) {
        let rank = self.directory().rank();
        match self.handle_access(rank, body, 0) {
            Ok(None) => {}
            Ok(Some(_)) => tracing::error!(node = rank, "{what} could not be routed without other shards"),
            Err(e) => tracing::error!(node = rank, "{what} could not be routed: {e}"),
        }
    }

    /// An ACCESS from `from`, from item `start` on. Returns the item to resume at when the step
    /// must end first (the rest needs shard locks the step cannot take).
    pub(super) fn handle_access(&mut self, from: u16, body: &[u8], start: usize) -> Result<Option<usize>> {
        let dir = self.directory();
        let caches = self.core.key_caches();
        let sender = (from, super::worker_of(wire::op_of(body).unwrap_or(0)));
        let a = Access::decode_cached(
            body,
            |t| dir.table(t).map(|m| m.value_len),
            |hash| caches.lock().get(&sender).and_then(|c| c.get(hash)).map(<[u8]>::to_vec),
        )?;
        if a.flags & wire::FLAG_KEYS_REMEMBER != 0 {
            // Kept in the order the worker sent its lists (see `keycache`); again on a resumed
            // step, which changes nothing.
            let bytes = a.key_bytes();
            caches.lock().entry(sender).or_default().remember(super::keycache::list_hash(bytes), bytes);
        }
        let meta = dir.table(a.table).expect("decoding checked the table");
        if a.origin as usize >= dir.nodes() {
            return Err(Error::Protocol(format!("ACCESS from node {from} names origin {}", a.origin)));
        }
        let beyond = match a.first_key() {
            Some(first) => (first + a.count as u64 > meta.keys).then_some(first + a.count as u64 - 1),
            None => (0..a.count).map(|i| a.key(i)).find(|&k| k >= meta.keys),
        };
        if let Some(key) = beyond {
            return Err(Error::Protocol(format!("ACCESS from node {from} for key {key} beyond table '{}'", meta.name)));
        }
        if start > a.count {
            return Err(Error::Protocol("resuming an ACCESS beyond its items".into()));
        }
        if dir.is_lost(a.origin) {
            // Its operation failed there already; whether it took effect is unknown either way.
            return Ok(None);
        }
        if start == 0
            && a.flags & FLAG_FORWARDED == 0
            && from != dir.rank()
            && self.core.asked_to_leave().load(std::sync::atomic::Ordering::Acquire)
            && self.core.departures().lock().ready_from(from)
        {
            // The cut says no request follows a peer's READY to a leaving node: counted, so
            // that tests and the metrics see it (it is served as any). A home passing on a
            // request for a key this node still holds is not one: the key's hand-over, which it
            // would wait for, comes behind it on the same link.
            self.core.backup_counters().note_request_after_ready();
            tracing::warn!(node = dir.rank(), peer = from, "a request came from a peer after its READY to this leaving node");
        }
        let stop = self.serve_local(&a, start);
        if stop == a.count {
            return Ok(None);
        }
        let mut mask = 0u64;
        for i in stop..a.count {
            mask |= 1 << dir.shard_of(a.table, a.key(i));
        }
        if !self.try_acquire(mask) {
            return Ok(Some(stop));
        }
        self.serve_locked(&a, stop);
        Ok(None)
    }

    /// Serves items from `start` on while their keys are published here, under latches only,
    /// and answers them in one RESPONSE. Returns the first item not served.
    fn serve_local(&mut self, a: &Access<'_>, start: usize) -> usize {
        let core = self.core;
        let store = core.store();
        let t = store.table(a.table);
        if start >= a.count || t.slot_of(a.key(start)).is_none() {
            return start;
        }
        let indexed = a.indexed() || start > 0;
        // An indexed answer lists its items first, so it needs to know how far it gets; a
        // plain one (the bulk case) serves until the first key that is not here.
        let end = if indexed {
            let mut end = start + 1;
            while end < a.count && t.slot_of(a.key(end)).is_some() {
                end += 1;
            }
            end
        } else {
            a.count
        };
        let value_bytes = t.value_len() * 4;
        let rank = self.directory().rank();
        let buf = self.tx.buf(a.origin);
        let before = buf.len();
        let msg_start = wire::begin_response(buf, a.kind, if indexed { FLAG_INDEXED } else { 0 }, a.table, rank, a.op, a.part, t.spec().codec);
        if indexed {
            for i in start..end {
                buf.extend_from_slice(&a.index(i).to_le_bytes());
            }
        }
        let values_at = buf.len();
        buf.reserve(if a.kind.returns_values() { (end - start) * value_bytes } else { 0 });
        let mut served = start;
        // Large messages take every latch once per chunk instead of one latch per key; a chunk
        // is short enough that local workers wait only tens of microseconds.
        let latches = store.latch_count();
        if end - start >= (4 * latches).max(2048) {
            // About 256 KiB of values per round of latching (and at least 16 keys per latch):
            // local workers wait only tens of microseconds.
            let chunk = (16 * latches).max(8192).max((256 << 10) / value_bytes.max(1));
            for from in (start..end).step_by(chunk) {
                let to = (from + chunk).min(end);
                let all = store.lock_all();
                let done = match a.first_key() {
                    // A run of keys: the slot map is walked as one slice, one loop per kind.
                    Some(first) => {
                        let first = first + from as u64;
                        match a.kind {
                            AccessKind::Pull => {
                                // Straight into reserved space, the length set once.
                                buf.reserve((to - from) * value_bytes);
                                let at = buf.len();
                                let dst = buf.spare_capacity_mut().as_mut_ptr() as *mut u8;
                                let done = all.for_each_in_run(a.table, first, to - from, |j, slot| {
                                    // SAFETY: `reserve` made room for `to - from` values after
                                    // `at`; item `j` of this chunk goes to its place among them.
                                    unsafe { slot.copy_to(dst.add(j * value_bytes)) }
                                });
                                // SAFETY: the first `done` values were written just above.
                                unsafe { buf.set_len(at + done * value_bytes) };
                                done
                            }
                            AccessKind::PushPull => {
                                let values = &a.values()[from * value_bytes..to * value_bytes];
                                let mut chunks = values.chunks_exact(value_bytes);
                                let updater = t.updater();
                                all.for_each_in_run(a.table, first, to - from, |_, slot| {
                                    slot.push_le_bytes(updater, chunks.next().unwrap_or(&[]));
                                    slot.append_le_bytes(buf);
                                })
                            }
                            kind => {
                                let values = &a.values()[from * value_bytes..to * value_bytes];
                                let mut chunks = values.chunks_exact(value_bytes);
                                let updater = t.updater();
                                all.for_each_in_run(a.table, first, to - from, |_, slot| {
                                    let v = chunks.next().unwrap_or(&[]);
                                    if kind == AccessKind::Push { slot.push_le_bytes(updater, v) } else { slot.write_le_bytes(v) }
                                })
                            }
                        }
                    }
                    None => {
                        let mut n = 0;
                        while from + n < to
                            && let Some(slot) = all.slot(a.table, a.key(from + n))
                        {
                            serve_item(&slot, t.updater(), a, from + n, buf);
                            n += 1;
                        }
                        n
                    }
                };
                drop(all);
                if a.kind != AccessKind::Pull {
                    match a.first_key() {
                        Some(first) => core.dirty_blocks_note_run(a.table, first + from as u64, done as u64),
                        None => (from..from + done).for_each(|i| core.note_written(a.table, a.key(i))),
                    }
                }
                served = from + done;
                if from + done < to {
                    break;
                }
            }
        } else {
            for i in start..end {
                let guard = store.lock(a.table, a.key(i));
                let Some(slot) = guard.slot() else { break };
                serve_item(&slot, t.updater(), a, i, buf);
                drop(guard);
                if a.kind != AccessKind::Pull {
                    core.note_written(a.table, a.key(i));
                }
                served = i + 1;
            }
        }
        if served == start {
            buf.truncate(before);
            return start;
        }
        if served < end && indexed {
            // A key left between the scan and its latch (relocated away): list only the items
            // that were served.
            let cut = (end - served) * 4;
            buf.drain(values_at - cut..values_at);
        }
        wire::finish_response(buf, msg_start, served - start);
        self.answered(a.origin, a.kind, before);
        served
    }

    /// Items from `start` on, with their shards locked: serve, queue behind an arriving key,
    /// forward to the owner (at the home) or to the home (after a stale cache), or fail.
    fn serve_locked(&mut self, a: &Access<'_>, start: usize) {
        let core = self.core;
        let dir = core.directory();
        let store = core.store();
        let rank = dir.rank();
        let value_bytes = store.table(a.table).value_len() * 4;
        let mut answers = AnswerBatch::default();
        let mut failures = FailureBatch::default();
        let mut forwards: Vec<(u16, u8, Vec<usize>)> = Vec::new();
        // Items for keys of a lost home this node stands in for, while a census has not
        // settled them yet: where they are is what the census finds out.
        let mut held: Vec<usize> = Vec::new();
        let census_holds = core.census_active() && core.census().lock().holds_accesses();
        for i in start..a.count {
            let (key, index) = (a.key(i), a.index(i));
            let mut fail = |code: FailureCode, node: u16| failures.add(a.origin, a.op, a.part, a.table, code, node, key, index);
            if let Residence::Here(_) = store.table(a.table).residence(key) {
                // Under the shard lock a published key cannot leave (only a step holding it
                // unpublishes), so the latch finds it.
                let guard = store.lock(a.table, key);
                if let Some(slot) = guard.slot() {
                    let out = answers.add(a.origin, a.op, a.part, a.kind, a.table, index);
                    let at = out.len();
                    if a.kind.returns_values() {
                        out.resize(at + value_bytes, 0);
                    }
                    apply(&slot, store.table(a.table).updater(), a.kind, a.value(i), &mut out[at..]);
                    drop(guard);
                    if a.kind != AccessKind::Pull {
                        core.note_written(a.table, key);
                    }
                    continue;
                }
            }
            // (A key of a lost home this node stands in for, on its way here, while the census
            // has not settled it: its items queue here, as the owner's would — the key lands
            // here, or what queued goes through its home once the census placed it.)
            let stood_in = census_holds && dir.tables()[a.table as usize].partitioner.home(key) != rank as usize && dir.home(a.table, key) == rank;
            if (stood_in || self.owns_in_transit(a.table, key))
                && let Some(transit) = self.shard_of(a.table, key).transits.get_mut(&(a.table, key))
            {
                match &transit.suspect {
                    Some(e) => {
                        let (code, node) = failure_code(e);
                        fail(code, node);
                    }
                    None => {
                        let mut values = vec![0.0; if a.kind.carries_values() { value_bytes / 4 } else { 0 }];
                        copy_bytes_to_f32(a.value(i), &mut values);
                        transit.queue.push(Queued::Access { origin: a.origin, op: a.op, part: a.part, index, kind: a.kind, values });
                        self.shard_of(a.table, key).counters.queued_keys += 1;
                    }
                }
                continue;
            }
            let home = dir.home(a.table, key);
            if stood_in {
                held.push(i);
                continue;
            }
            let route = if home == rank {
                match dir.owner(a.table, key) {
                    LOST_OWNER => Err((FailureCode::KeyLost, 0)),
                    owner if owner == rank => {
                        tracing::error!(node = rank, key, table = a.table, "home records this node as owner but the key is not here");
                        Err((FailureCode::Protocol, rank))
                    }
                    owner if dir.is_lost(owner) => Err((FailureCode::PeerLost, owner)),
                    owner => Ok((owner, FLAG_FORWARDED)),
                }
            } else if a.flags & FLAG_DIRECT != 0 {
                // A stale location cache sent it here: pass it to the home node.
                if dir.is_lost(home) { Err((FailureCode::PeerLost, home)) } else { Ok((home, FLAG_STALE)) }
            } else {
                tracing::warn!(node = rank, key, flags = a.flags, "access for a key this node neither holds nor homes");
                Err((FailureCode::Protocol, rank))
            };
            match route {
                Ok((dest, flag)) => {
                    let counters = &mut self.shard_of(a.table, key).counters;
                    if flag == FLAG_STALE {
                        counters.double_forwarded_keys += 1;
                    } else {
                        counters.forwarded_keys += 1;
                    }
                    match forwards.iter_mut().find(|f| f.0 == dest && f.1 == flag) {
                        Some(f) => f.2.push(i),
                        None => forwards.push((dest, flag, vec![i])),
                    }
                }
                Err((code, node)) => fail(code, node),
            }
        }
        self.flush_answers(answers);
        // The items `items` (indices into `a`) as one ACCESS with header `h`, into `out`.
        let encode = |out: &mut Vec<u8>, h: AccessHeader, items: &[usize]| {
            wire::encode_access(out, h, items.len(), |j| a.index(items[j]), |j| a.key(items[j]), |j, o| o.extend_from_slice(a.value(items[j])))
        };
        if !held.is_empty() {
            let codec = self.core.store().table(a.table).spec().codec;
            let h = AccessHeader { kind: a.kind, flags: FLAG_INDEXED | FLAG_STALE, table: a.table, origin: a.origin, op: a.op, part: a.part, codec };
            let mut message = Vec::new();
            encode(&mut message, h, &held);
            core.census().lock().hold_access(message);
        }
        for (dest, flag, items) in forwards {
            let codec = self.core.store().table(a.table).spec().codec;
            let h = AccessHeader { kind: a.kind, flags: FLAG_INDEXED | flag, table: a.table, origin: a.origin, op: a.op, part: a.part, codec };
            if flag == FLAG_STALE && self.forwards_held_for(dest) {
                // Passed back to a home on its way out: held until it is gone (see
                // `protocol::leave`, evacuate.rs).
                let mut message = Vec::new();
                encode(&mut message, h, &items);
                self.hold_forward(message);
                continue;
            }
            let buf = self.tx.buf(dest);
            let before = buf.len();
            encode(buf, h, &items);
            let bytes = buf.len() - before;
            self.tx.sent(dest, MessageKind::Forward, bytes);
        }
        self.flush_failures(failures);
    }

    /// Whether operations on a key relocating to this node belong in its queue here.
    ///
    /// A node that is the key's home routes by its owner table, even when the key is also in
    /// transit to it: if a later `localize` made another node the owner, an operation the home
    /// sequences now must go to that owner. Queueing it here would put it behind the hand-over
    /// already queued for the key and reorder it (found by the 8-node simulations).
    #[inline]
    pub(super) fn owns_in_transit(&self, table: u16, key: u64) -> bool {
        let dir = self.directory();
        dir.home(table, key) != dir.rank() || dir.owner(table, key) == dir.rank()
    }
}
