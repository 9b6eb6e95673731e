//! Pull, push and set: routing at the requester, forwarding at home nodes, serving at owners.

use super::rows::Rows;
use super::wire::{self, Access, AccessHeader, AccessKind, FLAG_DIRECT, FLAG_FORWARDED, FLAG_INDEXED, FLAG_STALE, Failure, FailureCode, Response};
use super::{LOST_OWNER, OpId, OpKind, PendingOp, Protocol, Queued, Submitted};
use crate::error::{Error, Result};
use crate::stats::MessageKind;
use crate::store::Store;
use crate::util::{copy_bytes_to_f32, f32_bytes};

/// Applies one access to a local slot under the key's latch.
pub(super) fn serve_row(store: &Store, table: u16, key: u64, slot: u32, kind: AccessKind, input: &[f32], output: &mut [f32]) {
    let t = store.table(table);
    let _latch = store.latch(table, key);
    // SAFETY: the latch of `key` is held and `slot` is the key's published slot (the protocol,
    // which alone changes `slot_map`, is running this call), or a landed slot not yet published.
    unsafe {
        match kind {
            AccessKind::Pull => t.read(slot, output),
            AccessKind::Push => t.add(slot, input),
            AccessKind::Set => t.write(slot, input),
        }
    }
}

/// Maps an error to the code FAILURE messages carry.
pub(super) fn failure_code(error: &Error) -> (FailureCode, u16) {
    match error {
        Error::PeerLost { node, .. } => (FailureCode::PeerLost, *node as u16),
        Error::KeyLost { .. } => (FailureCode::KeyLost, 0),
        Error::Timeout { .. } => (FailureCode::Unavailable, 0),
        _ => (FailureCode::Protocol, 0),
    }
}

/// Served items of one (origin, op, part) awaiting their RESPONSE.
pub(super) struct Answers {
    origin: u16,
    op: OpId,
    part: u32,
    kind: AccessKind,
    table: u16,
    indices: Vec<u32>,
    values: Vec<u8>,
}

/// Collects answers for several operations and writes one RESPONSE per (origin, op, part).
#[derive(Default)]
pub(super) struct AnswerBatch {
    entries: Vec<Answers>,
}

impl AnswerBatch {
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

/// Items of one failure report.
struct Failed {
    code: FailureCode,
    node: u16,
    indices: Vec<u32>,
}

fn push_failed(failed: &mut Vec<Failed>, code: FailureCode, node: u16, index: u32) {
    match failed.iter_mut().find(|f| f.code == code && f.node == node) {
        Some(f) => f.indices.push(index),
        None => failed.push(Failed { code, node, indices: vec![index] }),
    }
}

impl Protocol {
    /// Whether operations on a key that is relocating to this node belong in its queue here.
    ///
    /// A node that is the key's home routes by its owner table, even when the key is also in
    /// transit to it: if a later `localize` made another node the owner, an operation the home
    /// sequences now must go to that owner. Queueing it here would put it behind the hand-over
    /// already queued for the key and reorder it (found by the 8-node simulations).
    #[inline]
    pub(super) fn owns_in_transit(&self, table: u16, key: u64) -> bool {
        let meta = &self.tables[table as usize];
        meta.partitioner.home(key) != self.rank as usize || self.owners[table as usize][meta.partitioner.home_index(key)] == self.rank
    }

    pub(super) fn submit_access(&mut self, kind: AccessKind, table: u16, keys: &[u64], values: &[f32]) -> Result<Submitted> {
        let value_len = self.tables[table as usize].value_len;
        let id = self.register_op(OpKind::Access(kind), table, keys.to_vec());
        let mut op = self.ops.remove(&id).expect("just registered");
        op.remaining = keys.len();
        let input = |row: usize| if kind.carries_values() { &values[row * value_len..(row + 1) * value_len] } else { &[][..] };
        let mut remote = Rows::default();
        let t = self.store.table(table);
        for (row, &key) in keys.iter().enumerate() {
            if let Some(slot) = t.slot_of(key) {
                let output = if kind == AccessKind::Pull { &mut op.values.as_mut_slice()[row * value_len..(row + 1) * value_len] } else { &mut [][..] };
                serve_row(&self.store, table, key, slot, kind, input(row), output);
                op.answer(row as u32);
                self.counters.local_keys += 1;
            } else if let Some(transit) =
                if self.transits.is_empty() || !self.owns_in_transit(table, key) { None } else { self.transits.get_mut(&(table, key)) }
            {
                if let Some(e) = &transit.suspect {
                    op.error.get_or_insert_with(|| e.clone());
                    op.answer(row as u32);
                } else {
                    transit.queue.push(Queued::Local { op: id, row: row as u32, kind, values: input(row).to_vec() });
                    self.counters.queued_keys += 1;
                }
            } else {
                remote.push(row as u32);
            }
        }
        self.send_rows(id, &mut op, kind, &remote, &|row| input(row as usize));
        if op.remaining == 0 {
            return match op.error {
                Some(e) => Err(e),
                None => Ok(Submitted::Done(op.values.into_vec())),
            };
        }
        self.ops.insert(id, op);
        Ok(Submitted::Pending(id))
    }

    /// Sends rows of `op` towards their owners: to the cached owner, or to the home node (or,
    /// when this node is the home, straight to the owner it records). Rows that cannot be routed
    /// fail.
    pub(super) fn send_rows<'v>(&mut self, id: OpId, op: &mut PendingOp, kind: AccessKind, rows: &Rows, input: &dyn Fn(u32) -> &'v [f32]) {
        if rows.is_empty() {
            return;
        }
        let meta = &self.tables[op.table as usize];
        let mut groups: Vec<(u16, u8, Rows)> = Vec::new();
        let mut hint = (1u64, 0u64, 0usize);
        if !self.settings.location_caches {
            // The common case, kept tight: each row goes to its home node; rows homed here
            // take the general path below. Lost destinations are checked once per group.
            let mut local_home = Rows::default();
            for row in rows.iter() {
                let home = meta.partitioner.home_cached(op.keys[row as usize], &mut hint) as u16;
                if home == self.rank {
                    local_home.push(row);
                    continue;
                }
                match groups.last_mut() {
                    Some(g) if g.0 == home => g.2.push(row),
                    _ => match groups.iter_mut().find(|g| g.0 == home) {
                        Some(g) => g.2.push(row),
                        None => groups.push((home, 0, Rows::one(row))),
                    },
                }
            }
            groups.retain(|(dest, _, rows)| {
                if self.lost[*dest as usize].is_none() {
                    return true;
                }
                op.error.get_or_insert_with(|| Error::PeerLost { node: *dest as usize, reason: self.lost[*dest as usize].clone().unwrap_or_default() });
                for row in rows.iter() {
                    op.answer(row);
                }
                false
            });
            self.route_rows(op, &local_home, &mut groups);
        } else {
            self.route_rows(op, rows, &mut groups);
        }
        self.encode_groups(id, op, kind, groups, input);
    }

    /// Routes rows one by one (location caches, or keys homed at this node), adding them to
    /// `groups` or failing them.
    fn route_rows(&mut self, op: &mut PendingOp, rows: &Rows, groups: &mut Vec<(u16, u8, Rows)>) {
        let table = op.table;
        let meta = &self.tables[table as usize];
        let mut hint = (1u64, 0u64, 0usize);
        for row in rows.iter() {
            let key = op.keys[row as usize];
            let cached = if self.settings.location_caches { self.cache.get(&(table, key)).copied() } else { None };
            let route = match cached {
                Some(o) if o != self.rank && !self.is_lost(o) => Ok((o, FLAG_DIRECT)),
                _ => {
                    let home = meta.partitioner.home_cached(key, &mut hint) as u16;
                    if home == self.rank {
                        let owner = self.owners[table as usize][meta.partitioner.home_index(key)];
                        if owner == LOST_OWNER {
                            Err(Error::KeyLost { table: meta.name.clone(), key })
                        } else if owner == self.rank {
                            Err(Error::Protocol(format!("key {key} of '{}' should be here but is not", meta.name)))
                        } else {
                            Ok((owner, FLAG_FORWARDED))
                        }
                    } else {
                        Ok((home, 0))
                    }
                }
            };
            let route = route.and_then(|(dest, flags)| if self.is_lost(dest) { Err(self.lost_error(dest)) } else { Ok((dest, flags)) });
            match route {
                Ok((dest, flags)) => match groups.last_mut() {
                    Some(g) if g.0 == dest && g.1 == flags => g.2.push(row),
                    _ => match groups.iter_mut().find(|g| g.0 == dest && g.1 == flags) {
                        Some(g) => g.2.push(row),
                        None => groups.push((dest, flags, Rows::one(row))),
                    },
                },
                Err(e) => {
                    op.error.get_or_insert(e);
                    op.answer(row);
                }
            }
        }
    }

    /// Encodes each group's rows as parts of bounded size.
    fn encode_groups<'v>(&mut self, id: OpId, op: &mut PendingOp, kind: AccessKind, groups: Vec<(u16, u8, Rows)>, input: &dyn Fn(u32) -> &'v [f32]) {
        let table = op.table;
        let value_len = self.tables[table as usize].value_len;
        let request_item = 8 + if kind.carries_values() { value_len * 4 } else { 0 };
        let response_item = if kind == AccessKind::Pull { value_len * 4 } else { 4 };
        let part_bytes = self.settings.part_bytes.clamp(4096, self.settings.max_message_bytes);
        let per_part = ((part_bytes - 64) / request_item.max(response_item)).max(1);
        for (dest, flags, rows) in groups {
            self.counters.remote_keys += rows.len() as u64;
            for chunk in rows.chunks(per_part) {
                let part = op.parts.len() as u32;
                let h = AccessHeader { kind, flags, table, origin: self.rank, op: id, part };
                let buf = self.out.buf(dest);
                let before = buf.len();
                let keys = &op.keys;
                match chunk.run() {
                    Some((first, len)) if !kind.carries_values() || contiguous_input(input, first, len) => {
                        // The usual bulk case: the rows are a run, so keys and values are blocks.
                        let (first, len) = (first as usize, len as usize);
                        let values = if kind.carries_values() {
                            // SAFETY: `contiguous_input` checked that the run's inputs lie back to
                            // back in one slice, starting at the first row's input.
                            unsafe { std::slice::from_raw_parts(input(first as u32).as_ptr() as *const u8, len * value_len * 4) }
                        } else {
                            &[][..]
                        };
                        wire::encode_access_blocks(buf, h, &keys[first..first + len], values);
                    }
                    _ => {
                        let rows: Vec<u32> = chunk.iter().collect();
                        wire::encode_access(
                            buf,
                            h,
                            rows.len(),
                            |i| i as u32,
                            |i| keys[rows[i] as usize],
                            |i, o| o.extend_from_slice(f32_bytes(input(rows[i]))),
                        );
                    }
                }
                op.parts.push(chunk);
                let bytes = buf.len() - before;
                let kind = if flags & FLAG_FORWARDED != 0 { MessageKind::Forward } else { MessageKind::Access };
                self.out.sent(dest, kind, bytes);
            }
        }
    }

    pub(super) fn handle_access(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let a = Access::decode(body, |t| self.tables.get(t as usize).map(|m| m.value_len))?;
        let meta = &self.tables[a.table as usize];
        if a.origin as usize >= self.nodes {
            return Err(Error::Protocol(format!("ACCESS from node {from} names origin {}", a.origin)));
        }
        let store = self.store.clone();
        let t = store.table(a.table);
        let mut all_local = true;
        for i in 0..a.count {
            let key = a.key(i);
            if key >= meta.keys {
                return Err(Error::Protocol(format!("ACCESS from node {from} for key {key} beyond table '{}'", meta.name)));
            }
            all_local &= t.slot_of(key).is_some();
        }
        if all_local {
            self.serve_all(&a);
            return Ok(());
        }
        let mut answers = AnswerBatch::default();
        let mut forwards: Vec<(u16, u8, Vec<usize>)> = Vec::new();
        let mut failed: Vec<Failed> = Vec::new();
        let value_len = meta.value_len;
        for i in 0..a.count {
            let (key, index) = (a.key(i), a.index(i));
            if let Some(slot) = t.slot_of(key) {
                let out = answers.add(a.origin, a.op, a.part, a.kind, a.table, index);
                serve_wire_item(&store, a.table, key, slot, a.kind, a.value(i), value_len, out);
            } else if let Some(transit) = if self.owns_in_transit(a.table, key) { self.transits.get_mut(&(a.table, key)) } else { None } {
                if let Some(e) = &transit.suspect {
                    let (code, node) = failure_code(e);
                    push_failed(&mut failed, code, node, index);
                } else {
                    let mut values = vec![0.0; if a.kind.carries_values() { value_len } else { 0 }];
                    if a.kind.carries_values() {
                        copy_bytes_to_f32(a.value(i), &mut values);
                    }
                    transit.queue.push(Queued::Remote { origin: a.origin, op: a.op, part: a.part, index, kind: a.kind, values });
                    self.counters.queued_keys += 1;
                }
            } else {
                let meta = &self.tables[a.table as usize];
                let home = meta.partitioner.home(key) as u16;
                let route = if home == self.rank {
                    match self.owners[a.table as usize][meta.partitioner.home_index(key)] {
                        LOST_OWNER => Err((FailureCode::KeyLost, 0)),
                        owner if owner == self.rank => {
                            tracing::error!(node = self.rank, key, table = %meta.name, "home records this node as owner but the key is not here");
                            Err((FailureCode::Protocol, self.rank))
                        }
                        owner if self.is_lost(owner) => Err((FailureCode::PeerLost, owner)),
                        owner => Ok((owner, FLAG_FORWARDED)),
                    }
                } else if a.flags & FLAG_DIRECT != 0 {
                    // A stale location cache sent it here: pass it to the home node.
                    if self.is_lost(home) { Err((FailureCode::PeerLost, home)) } else { Ok((home, FLAG_STALE)) }
                } else {
                    tracing::warn!(node = self.rank, from, key, flags = a.flags, "access for a key this node neither owns nor homes");
                    Err((FailureCode::Protocol, self.rank))
                };
                match route {
                    Ok((dest, flag)) => match forwards.iter_mut().find(|f| f.0 == dest && f.1 == flag) {
                        Some(f) => f.2.push(i),
                        None => forwards.push((dest, flag, vec![i])),
                    },
                    Err((code, node)) => push_failed(&mut failed, code, node, index),
                }
            }
        }
        self.flush_answers(answers);
        for (dest, flag, items) in forwards {
            let h = AccessHeader { kind: a.kind, flags: FLAG_INDEXED | flag, table: a.table, origin: a.origin, op: a.op, part: a.part };
            let buf = self.out.buf(dest);
            let before = buf.len();
            wire::encode_access(buf, h, items.len(), |j| a.index(items[j]), |j| a.key(items[j]), |j, o| o.extend_from_slice(a.value(items[j])));
            let bytes = buf.len() - before;
            self.out.sent(dest, MessageKind::Forward, bytes);
            if flag == FLAG_STALE {
                self.counters.double_forwarded_keys += items.len() as u64;
            } else {
                self.counters.forwarded_keys += items.len() as u64;
            }
        }
        if !self.is_lost(a.origin) {
            for f in failed {
                let buf = self.out.buf(a.origin);
                let before = buf.len();
                wire::encode_failure(buf, f.code, a.table, f.node, a.op, a.part, &f.indices);
                let bytes = buf.len() - before;
                self.out.sent(a.origin, MessageKind::Failure, bytes);
            }
        }
        Ok(())
    }

    /// Serves a whole message whose keys are all local, writing values straight into the
    /// response frame.
    fn serve_all(&mut self, a: &Access<'_>) {
        if self.is_lost(a.origin) {
            return;
        }
        let store = self.store.clone();
        let t = store.table(a.table);
        let indexed = a.indexed();
        let buf = self.out.buf(a.origin);
        let before = buf.len();
        let start = wire::begin_response(buf, a.kind, if indexed { FLAG_INDEXED } else { 0 }, a.table, self.rank, a.op, a.part);
        if indexed {
            for i in 0..a.count {
                buf.extend_from_slice(&a.index(i).to_le_bytes());
            }
        }
        let value_bytes = t.value_len() * 4;
        let values_at = buf.len();
        if a.kind == AccessKind::Pull {
            buf.resize(values_at + a.count * value_bytes, 0);
        }
        let serve = |i: usize, buf: &mut Vec<u8>| {
            let slot = t.slot_of(a.key(i)).expect("checked by the caller");
            // SAFETY: the caller holds the key's latch (or every latch) and `slot` is the key's
            // published slot; pull destinations lie inside the bytes resized above.
            unsafe {
                match a.kind {
                    AccessKind::Pull => t.read_to(slot, buf.as_mut_ptr().add(values_at + i * value_bytes)),
                    AccessKind::Push => t.add_bytes(slot, a.value(i)),
                    AccessKind::Set => t.write_bytes(slot, a.value(i)),
                }
            }
        };
        // Large messages take every latch once per chunk instead of one latch per key; a chunk
        // is short enough that local workers wait only tens of microseconds.
        let latches = store.latch_count();
        if a.count >= (4 * latches).max(2048) {
            let chunk = (16 * latches).max(8192);
            for start in (0..a.count).step_by(chunk) {
                let _all = store.lock_all();
                for i in start..(start + chunk).min(a.count) {
                    serve(i, buf);
                }
            }
        } else {
            for i in 0..a.count {
                let _latch = store.latch(a.table, a.key(i));
                serve(i, buf);
            }
        }
        wire::finish_response(buf, start, a.count);
        let bytes = buf.len() - before;
        self.out.sent(a.origin, MessageKind::Response, bytes);
    }

    pub(super) fn flush_answers(&mut self, answers: AnswerBatch) {
        for e in answers.entries {
            if self.is_lost(e.origin) {
                continue;
            }
            let buf = self.out.buf(e.origin);
            let before = buf.len();
            let start = wire::begin_response(buf, e.kind, FLAG_INDEXED, e.table, self.rank, e.op, e.part);
            for i in &e.indices {
                buf.extend_from_slice(&i.to_le_bytes());
            }
            buf.extend_from_slice(&e.values);
            wire::finish_response(buf, start, e.indices.len());
            let bytes = buf.len() - before;
            self.out.sent(e.origin, MessageKind::Response, bytes);
        }
    }

    pub(super) fn handle_response(&mut self, body: &[u8]) -> Result<()> {
        let r = Response::decode(body, |t| self.tables.get(t as usize).map(|m| m.value_len))?;
        let Some(op) = self.ops.get_mut(&r.op) else { return Ok(()) };
        if op.kind != OpKind::Access(r.kind) || op.table != r.table {
            return Err(Error::Protocol(format!("RESPONSE does not match operation {}", r.op)));
        }
        let Some(part) = op.parts.get(r.part as usize) else {
            return Err(Error::Protocol(format!("RESPONSE names part {} of operation {}", r.part, r.op)));
        };
        let value_len = self.tables[r.table as usize].value_len;
        let caches = self.settings.location_caches && r.responder != self.rank && (r.responder as usize) < self.nodes;
        // The usual bulk case: a whole part answered in order, its rows a run: block copies.
        if !r.indexed()
            && r.count == part.len()
            && r.count > 0
            && !caches
            && let Some((first, _)) = part.run()
            && op.answer_run(first as usize, r.count)
        {
            if r.kind == AccessKind::Pull {
                let first = first as usize;
                copy_bytes_to_f32(r.values(), &mut op.values.as_mut_slice()[first * value_len..(first + r.count) * value_len]);
            }
            self.maybe_complete(r.op);
            return Ok(());
        }
        let part = &op.parts[r.part as usize];
        for i in 0..r.count {
            let Some(row) = part.get(r.index(i) as usize) else {
                return Err(Error::Protocol(format!("RESPONSE names item {} beyond its part", r.index(i))));
            };
            let (w, b) = (row as usize / 64, row as usize % 64);
            if op.answered[w] & (1 << b) != 0 {
                continue;
            }
            op.answered[w] |= 1 << b;
            op.remaining -= 1;
            if r.kind == AccessKind::Pull {
                copy_bytes_to_f32(r.value(i), &mut op.values.as_mut_slice()[row as usize * value_len..(row as usize + 1) * value_len]);
            }
            if caches {
                self.cache.insert((r.table, op.keys[row as usize]), r.responder);
            }
        }
        self.maybe_complete(r.op);
        Ok(())
    }

    pub(super) fn handle_failure(&mut self, body: &[u8]) -> Result<()> {
        let f = Failure::decode(body)?;
        let name = self.table_name(f.table);
        let Some(op) = self.ops.get_mut(&f.op) else { return Ok(()) };
        let Some(part) = op.parts.get(f.part as usize).cloned() else {
            return Err(Error::Protocol(format!("FAILURE names part {} of operation {}", f.part, f.op)));
        };
        for i in 0..f.count {
            let Some(row) = part.get(f.index(i) as usize) else {
                return Err(Error::Protocol("FAILURE names an item beyond its part".into()));
            };
            if op.answer(row) && op.error.is_none() {
                let key = op.keys[row as usize];
                op.error = Some(match f.code {
                    FailureCode::PeerLost => Error::PeerLost { node: f.node as usize, reason: format!("while serving key {key}") },
                    FailureCode::KeyLost => Error::KeyLost { table: name.clone(), key },
                    FailureCode::Unavailable => Error::Timeout { what: "relocation of the key", millis: self.settings.op_timeout_ns / 1_000_000 },
                    FailureCode::Protocol => Error::Protocol(format!("node {} could not serve key {key}", f.node)),
                });
            }
        }
        self.maybe_complete(f.op);
        Ok(())
    }
}

/// Whether the inputs of the run `first..first+len` lie back to back in memory.
fn contiguous_input<'v>(input: &dyn Fn(u32) -> &'v [f32], first: u32, len: u32) -> bool {
    let a = input(first);
    let b = input(first + len - 1);
    !a.is_empty() && b.as_ptr() as usize == a.as_ptr() as usize + (len as usize - 1) * a.len() * 4
}

/// Serves one item as it came off the wire into a response's value bytes.
#[allow(clippy::too_many_arguments)]
fn serve_wire_item(store: &Store, table: u16, key: u64, slot: u32, kind: AccessKind, value: &[u8], value_len: usize, out: &mut Vec<u8>) {
    let t = store.table(table);
    let _latch = store.latch(table, key);
    // SAFETY: the key's latch is held and `slot` is its published slot.
    unsafe {
        match kind {
            AccessKind::Pull => t.read_bytes_into(slot, out),
            AccessKind::Push => t.add_bytes(slot, value),
            AccessKind::Set => t.write_bytes(slot, value),
        }
    }
    debug_assert!(kind != AccessKind::Pull || out.len().is_multiple_of(value_len * 4));
}
