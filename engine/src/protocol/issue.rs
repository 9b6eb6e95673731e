//! A worker's operation entering the protocol: the local pass (latches only), then the keys
//! held elsewhere — straight to their home nodes without any shard lock when neither this node
//! nor a relocation to it is involved, through the shard locks otherwise — encoded into parts
//! that stream out while later parts are still being encoded.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use super::LOST_OWNER;
use super::Step;
use super::directory::SHARD_BLOCK_BITS;
use super::requester::{OpId, OpKind, Output, Requester, Unsent};
use super::rows::Rows;
use super::shard::{Countdown, Queued, Waiters};
use super::wire::{self, AccessHeader, AccessKind, BlockKeys, FLAG_DIRECT, FLAG_FORWARDED, FLAG_RUN, MoveItem};
use crate::config::Partitioning;
use crate::error::{Error, Result};
use crate::stats::MessageKind;
use crate::store::{OPTIMISTIC_MAX, Residence};
use crate::util::f32_bytes;

/// Where a pull's values go.
pub enum PullTarget<'a> {
    /// Not a pull.
    None,
    /// The caller's buffer (`keys × value_len`): local rows are written now, the others while
    /// the caller waits for the operation (a synchronous pull).
    Caller(&'a mut [f32]),
    /// A buffer the operation keeps and returns at completion (an asynchronous pull).
    Owned(Vec<f32>),
}

/// The outcome of issuing an operation.
#[derive(Debug, PartialEq)]
pub enum Issued {
    /// Everything was served at once; an owned pull buffer comes back.
    Done(Option<Vec<f32>>),
    /// The operation is under way; when `more`, parts remain to be encoded with
    /// [`Step::continue_issue`] (after the frames so far were handed on).
    Pending {
        /// The operation.
        op: OpId,
        /// Whether parts remain to be encoded.
        more: bool,
    },
}

/// Rows going to one node (to this node's own rank: routed row by row).
#[derive(Debug)]
pub(crate) struct Group {
    pub dest: u16,
    pub flags: u8,
    pub rows: Rows,
    /// The rows' keys are consecutive (sent as a run).
    pub keys_run: bool,
}

impl Group {
    fn new(dest: u16, flags: u8, rows: Rows, keys: &[u64]) -> Group {
        let keys_run = rows.run().is_some_and(|(first, len)| is_run(&keys[first as usize..(first + len) as usize]));
        Group { dest, flags, rows, keys_run }
    }

    /// The first `n` rows and the rest (a part of a run of keys is a run).
    fn split_at(self, n: usize) -> (Group, Group) {
        let (a, b) = self.rows.split_at(n);
        (Group { rows: a, ..self }, Group { rows: b, dest: self.dest, flags: self.flags, keys_run: self.keys_run })
    }
}

/// Operations with at most this many remote rows are routed in one step (the default of
/// [`super::Settings::small_operation_rows`]).
pub const SMALL_OPERATION_ROWS: usize = 4096;

/// The shards of the keys of `rows` (runs of neighbouring keys cost one lookup per block).
fn shard_mask(dir: &super::Directory, table: u16, keys: &[u64], rows: &Rows) -> u64 {
    let mut mask = 0u64;
    let mut last_block = u64::MAX;
    for r in rows.iter() {
        let key = keys[r as usize];
        if key >> SHARD_BLOCK_BITS != last_block {
            last_block = key >> SHARD_BLOCK_BITS;
            mask |= 1 << dir.shard_of(table, key);
        }
    }
    mask
}

impl Step<'_, '_> {
    /// Issues a pull, push or set of `keys` of `table` for the worker owning `req`. Keys may
    /// repeat; `input` holds push/set values (`keys × value_len`). The step must be fresh (hold
    /// no locks). Rows held here are served at once under their latches; the others are routed
    /// part by part, each under the locks of its keys' shards (so that the route and the queueing
    /// of the part are one decision against relocations to this node), starting in this step.
    #[allow(clippy::too_many_arguments)]
    pub fn issue_access(
        &mut self,
        req: &mut Requester,
        kind: AccessKind,
        table: u16,
        keys: &[u64],
        input: &[f32],
        target: PullTarget<'_>,
        ticket: Option<Weak<()>>,
    ) -> Result<Issued> {
        let dir = self.directory();
        let meta = dir.table(table).ok_or_else(|| Error::UnknownTable(format!("#{table}")))?;
        // Keys are checked before anything takes effect: a run of keys by its last one (the
        // bulk case costs one pass to find the run), others by one branch-free pass.
        let run = is_run(keys);
        let largest = if run { keys.last().copied() } else { keys.iter().copied().max() };
        if largest.is_some_and(|k| k >= meta.keys) {
            let bad = keys.iter().copied().find(|&k| k >= meta.keys).unwrap_or(u64::MAX);
            return Err(Error::UnknownKey { table: meta.name.clone(), key: bad, keys: meta.keys });
        }
        let value_len = meta.value_len;
        let need = keys.len() * value_len;
        let expected_input = if kind.carries_values() { need } else { 0 };
        if input.len() != expected_input {
            return Err(Error::WrongLength { what: "values", expected: expected_input, got: input.len() });
        }
        let (mut owned, mut caller) = match target {
            PullTarget::Owned(v) => (Some(v), None),
            PullTarget::Caller(c) => (None, Some(c)),
            PullTarget::None => (None, None),
        };
        // Taken before any key is looked at (see `continue_issue`), and before any route is
        // chosen (see `Delivery::PeerLost`).
        let arrivals = self.core.arrivals();
        let losses = dir.losses();
        let mut remote = Rows::default();
        let served = {
            let output: &mut [f32] = match (&mut owned, &mut caller) {
                (Some(v), _) => v.as_mut_slice(),
                (None, Some(c)) => c,
                (None, None) => &mut [],
            };
            if kind.returns_values() && output.len() != need {
                return Err(Error::WrongLength { what: "pull output", expected: need, got: output.len() });
            }
            self.local_pass(kind, table, keys, run, req.bypass_replicas, input, output, &mut remote)
        };
        self.tx.count_local(served);
        if let Some(away) = &mut req.remote_keys {
            away.clear();
            away.extend(remote.iter().map(|row| keys[row as usize]));
        }
        if remote.is_empty() {
            return Ok(Issued::Done(owned));
        }
        let cache_keys = dir.caches().then(|| keys.to_vec());
        let now = self.now;
        let op = req.begin(OpKind::Access(kind), table, value_len, keys.len(), remote.len(), Output::None, cache_keys, ticket, now, losses);
        let groups = self.plan(table, keys, run, remote);
        if let Some(o) = req.op_mut(op) {
            o.output = match (owned, kind) {
                (Some(v), _) => Output::Owned(v),
                (None, k) if k.returns_values() => Output::Caller,
                (None, _) => Output::None,
            };
            o.arrivals = arrivals;
            o.unsent = Some(Unsent { groups });
        }
        let more = self.continue_issue(req, op, keys, input, caller);
        Ok(Issued::Pending { op, more })
    }

    /// Serves the rows held here; collects the others, in order, in `remote`. `run`: the keys
    /// are consecutive; `bypass_replicas`: run-time replicas do not serve.
    #[allow(clippy::too_many_arguments)]
    fn local_pass(
        &mut self,
        kind: AccessKind,
        table: u16,
        keys: &[u64],
        run: bool,
        bypass_replicas: bool,
        input: &[f32],
        output: &mut [f32],
        remote: &mut Rows,
    ) -> usize {
        let store = self.core.store();
        let t = store.table(table);
        let value_len = t.value_len();
        // The bulk remote case: nothing of the batch is here or arriving (for a run of keys,
        // one load per block of keys; otherwise one per key).
        // Run-time replicas are not in the slot map, so only a table without any takes it.
        let dynamic = kind != AccessKind::Set && !bypass_replicas && t.any_dynamic_replica();
        if keys.len() >= 64 && !dynamic && if run { t.run_is_away(keys[0], keys.len()) } else { keys.iter().all(|&k| t.is_away(k)) } {
            *remote = Rows::Run { first: 0, len: keys.len() as u32 };
            return 0;
        }
        // A push to a replica also adds to its delta under the same latch; a set of a replica
        // goes to the key's home node with the remote rows.
        let replicas = t.replicas();
        let optimistic = kind == AccessKind::Pull && value_len <= OPTIMISTIC_MAX;
        let (mut served, mut replica_rows, mut dynamic_rows) = (0, 0, 0);
        for (row, &key) in keys.iter().enumerate() {
            let ordinal = replicas.and_then(|r| r.ordinal(key));
            let here = matches!(t.residence(key), Residence::Here(_)) && !(kind == AccessKind::Set && ordinal.is_some());
            // A run-time replica (intent) is not in the slot map: looked up under the latch.
            let replica = dynamic && t.has_dynamic_replica(key);
            if here || replica {
                // Pulls carry no input and pushes no output.
                let values = row * value_len..(row + 1) * value_len;
                let (row_input, row_output) = (input.get(values.clone()).unwrap_or_default(), output.get_mut(values).unwrap_or_default());
                if here && optimistic && t.read_optimistic(key, row_output) {
                    served += 1;
                    replica_rows += ordinal.is_some() as usize;
                    continue;
                }
                let guard = store.lock(table, key);
                // A key that arrived since it was looked at serves itself, not its replica.
                if let Some(slot) = guard.slot() {
                    serve_held(&slot, t.updater(), kind, row_input, row_output);
                    if let (Some(o), Some(r), AccessKind::Push | AccessKind::PushPull) = (ordinal, replicas, kind) {
                        r.add_delta(o, row_input);
                    }
                    drop(guard);
                    if kind != AccessKind::Pull {
                        self.note_local_write(table, key);
                    }
                    served += 1;
                    replica_rows += ordinal.is_some() as usize;
                    continue;
                }
                if replica && let Some((value, delta)) = guard.replica() {
                    tracing::trace!(target: "ferry::replica_trace",  table, key, ?kind, "served by a replica");
                    serve_replica(&value, &delta, kind, row_input, row_output);
                    served += 1;
                    dynamic_rows += 1;
                    continue;
                }
            }
            remote.push(row as u32);
        }
        if replica_rows > 0 && self.tx.count_replica(replica_rows) {
            self.core.replication().sample_staleness(table, self.now);
        }
        if dynamic_rows > 0 {
            self.tx.count_replica(dynamic_rows);
        }
        served
    }

    /// A worker's write changed `key` of `table` here: with backups, the block is marked for
    /// the next round and the worker's write waits for it ([`super::Transmit::take_local_write`]).
    #[inline]
    fn note_local_write(&mut self, table: u16, key: u64) {
        if self.core.settings().backups > 0 {
            self.core.note_written(table, key);
            self.tx.note_local_write();
        }
    }

    /// Plans where the remote rows go: groups by destination (the cached owner, or the home
    /// node) of rows that are away; rows homed here or arriving here form groups routed row by
    /// row (destination: this node). When a part is sent, under its shards' locks, rows planned
    /// as away are looked at again unless no key started arriving here since they were planned.
    fn plan(&self, table: u16, keys: &[u64], keys_run: bool, rows: Rows) -> VecDeque<Group> {
        let dir = self.directory();
        let rank = dir.rank();
        let meta = dir.table(table).expect("checked by the caller");
        // The bulk case: one run of rows whose keys are one run of range-partitioned keys with
        // one home elsewhere, so no per-row work.
        if let Some((first, len)) = rows.run()
            && !dir.caches()
            && meta.partitioner.kind() == Partitioning::Range
        {
            let ks = &keys[first as usize..(first + len) as usize];
            let (lo, hi) = (ks[0], ks[ks.len() - 1]);
            let home = dir.home(table, lo);
            let whole = first == 0 && len as usize == keys.len();
            if hi >= lo
                && hi - lo == ks.len() as u64 - 1
                && home != rank
                // (The start-up homes: once a node is lost its stand-in also serves keys of
                // its own between the two ends.)
                && meta.partitioner.home(lo) == meta.partitioner.home(hi)
                && ((whole && keys_run) || is_run(ks))
                && self.core.store().table(table).run_is_away(lo, ks.len())
            {
                return VecDeque::from([Group { dest: home, flags: 0, rows, keys_run: true }]);
            }
        }
        let t = self.core.store().table(table);
        let mut list: Vec<(u16, u8, Rows)> = Vec::new();
        let mut hint = (1u64, 0u64, 0usize);
        for row in rows.iter() {
            let key = keys[row as usize];
            let home = dir.stand_in(meta.partitioner.home_cached(key, &mut hint) as u16);
            let (dest, flags) = if home == rank || t.route_residence(key) != Residence::Away {
                (rank, 0)
            } else {
                match dir.cached(table, key) {
                    Some(o) if o != rank && !dir.is_lost(o) => (o, FLAG_DIRECT),
                    _ => (home, 0),
                }
            };
            add_to_group(&mut list, dest, flags, row);
        }
        list.into_iter().map(|(dest, flags, rows)| Group::new(dest, flags, rows, keys)).collect()
    }

    /// Routes and encodes parts of `op` that remain: a small operation at once, a large one a
    /// part per step (the caller hands each step's frames on before the next, so parts stream).
    /// `caller` is a synchronous pull's buffer, for rows that turn out to be held here. Returns
    /// whether parts remain; the step must be fresh.
    pub fn continue_issue(&mut self, req: &mut Requester, op: OpId, keys: &[u64], input: &[f32], mut caller: Option<&mut [f32]>) -> bool {
        let Some(mut groups) = req.op_mut(op).and_then(|o| o.unsent.take()).map(|u| u.groups) else { return false };
        let Some((kind, table)) = req.op_mut(op).and_then(|o| if let OpKind::Access(k) = o.kind { Some((k, o.table)) } else { None }) else {
            return false;
        };
        let epoch = req.op_mut(op).map_or(0, |o| o.arrivals);
        let total: usize = groups.iter().map(|g| g.rows.len()).sum();
        let mut chunk: Vec<Group> = Vec::new();
        if total <= self.core.settings().small_operation_rows {
            chunk.extend(groups.drain(..));
        } else {
            // Parts until about a frame of requests: large requests stream a frame at a time,
            // small ones (pulls of runs of keys) go out together.
            let frame = self.core.settings().effective_part_bytes();
            let value_bytes = self.directory().table(table).map_or(4, |t| t.value_len * 4);
            let mut bytes = 0;
            while bytes < frame
                && let Some(group) = groups.pop_front()
            {
                let per_part = self.rows_per_part(kind, table, group.keys_run);
                let key_bytes = if group.keys_run { 0 } else { 8 };
                let (first, rest) = group.split_at(per_part);
                bytes += 64 + first.rows.len() * (key_bytes + if kind.carries_values() { value_bytes } else { 0 });
                if !rest.rows.is_empty() {
                    groups.push_front(rest);
                }
                chunk.push(first);
            }
        }
        let dir = self.directory();
        let mut mask = 0u64;
        for g in &chunk {
            mask |= match g.rows.run() {
                // A run of keys: its blocks, without looking at each key.
                Some((first, len)) if g.keys_run && len > 0 => {
                    let (lo, hi) = (keys[first as usize], keys[(first + len - 1) as usize]);
                    let mut m = 0u64;
                    for block in lo >> SHARD_BLOCK_BITS..=hi >> SHARD_BLOCK_BITS {
                        m |= 1 << dir.shard_of(table, block << SHARD_BLOCK_BITS);
                        if m == u64::MAX >> (64 - dir.shards().min(64)) {
                            break;
                        }
                    }
                    m
                }
                _ => shard_mask(dir, table, keys, &g.rows),
            };
        }
        if !self.try_acquire(mask) {
            // Only a step that already holds other shards gets here: retry on a fresh one.
            groups.extend(chunk);
            if let Some(o) = req.op_mut(op) {
                o.unsent = Some(Unsent { groups });
            }
            return true;
        }
        // A node on its way out gets no request after this node's READY to it (sent under
        // every shard): parts for it wait, in order, until it has left and its keys are
        // served by its successor (see `protocol::leave`).
        // During a census after a loss (relocation with backups), no part is routed until
        // every home knows where its keys are again (see `protocol::census`); keys held here
        // were served by the operation's local pass.
        let paused = match dir.departing() {
            Some(leaving) => leaving != dir.rank() && chunk.iter().any(|g| current_dest(dir, g.dest) == leaving),
            None => false,
        } || (dir.recovering() && !chunk.is_empty());
        if paused {
            for g in chunk.into_iter().rev() {
                groups.push_front(g);
            }
            if let Some(o) = req.op_mut(op) {
                o.unsent = Some(Unsent { groups });
            }
            req.paused = true;
            return true;
        }
        // Whether any key of this node's started arriving since the operation's local pass: if
        // not, rows found elsewhere then are elsewhere still, and need no second look.
        let unchanged = self.core.arrivals() == epoch;
        let mut deferred = Rows::default();
        for group in chunk {
            let held = self.route_rows(req, op, kind, table, group, unchanged, keys, input, caller.as_deref_mut());
            held.iter().for_each(|row| deferred.push(row));
        }
        if !deferred.is_empty() {
            // Rows whose route, looked at again here, led to a node on its way out: they wait
            // as the paused ones do, planned for this node so that their route is looked at
            // again when they go.
            groups.push_front(Group::new(dir.rank(), 0, deferred, keys));
            req.paused = true;
        }
        let more = !groups.is_empty();
        if more {
            if let Some(o) = req.op_mut(op) {
                o.unsent = Some(Unsent { groups });
            }
        } else {
            req.settle(op);
        }
        more
    }

    /// Rows of a group per part: parts of about `part_bytes`, sized by the larger of request
    /// and response; run-encoded keys cost nothing.
    fn rows_per_part(&self, kind: AccessKind, table: u16, keys_run: bool) -> usize {
        let value_bytes = self.directory().table(table).map_or(4, |t| t.value_len * 4);
        let key_bytes = if keys_run { 0 } else { 8 };
        let request_item = key_bytes + if kind.carries_values() { value_bytes } else { 0 };
        let response_item = if kind.returns_values() { value_bytes } else { 0 };
        let part_bytes = self.core.settings().effective_part_bytes();
        (part_bytes.saturating_sub(64) / request_item.max(response_item).max(1)).max(1)
    }

    /// Sends rows planned for `group.dest` (shards held): rows still elsewhere go as planned,
    /// in parts; rows whose key arrived, is arriving, or is homed here take their own route.
    /// `unchanged`: no key started arriving since the rows were planned.
    #[allow(clippy::too_many_arguments)]
    fn route_rows(
        &mut self,
        req: &mut Requester,
        op: OpId,
        kind: AccessKind,
        table: u16,
        group: Group,
        unchanged: bool,
        keys: &[u64],
        input: &[f32],
        mut caller: Option<&mut [f32]>,
    ) -> Rows {
        let rank = self.directory().rank();
        let t = self.core.store().table(table);
        let group = match self.look_at_replicas(req, op, kind, table, &group.rows, keys, input, caller.as_deref_mut()) {
            None => group,
            Some(left) if left.is_empty() => return Rows::default(),
            Some(left) => Group::new(group.dest, group.flags, left, keys),
        };
        let Group { dest, flags, rows, keys_run } = group;
        let dir = self.directory();
        let dest = current_dest(dir, dest);
        // After a join, rows planned for the node that served the joining node's keys may
        // belong to the joining node now (a classic server: the planned node is the home).
        let moved = dir.joins() > 0 && dest != rank && rows.iter().any(|r| dir.home(table, keys[r as usize]) != dest);
        let (direct, own) = if dest == rank || moved {
            (Rows::default(), rows)
        } else if unchanged || rows.iter().all(|r| t.route_residence(keys[r as usize]) == Residence::Away) {
            (rows, Rows::default())
        } else {
            let (mut direct, mut own) = (Rows::default(), Rows::default());
            for r in rows.iter() {
                if t.route_residence(keys[r as usize]) == Residence::Away { direct.push(r) } else { own.push(r) }
            }
            (direct, own)
        };
        if !direct.is_empty() {
            if self.directory().is_lost(dest) {
                req.fail_rows(op, direct.iter(), &self.directory().lost_error(dest));
            } else {
                // A run of keys stays one when no row left it.
                let keys_run = keys_run && direct.run().is_some();
                let per_part = self.rows_per_part(kind, table, keys_run);
                let mut rest = direct;
                while !rest.is_empty() {
                    let (part, after) = rest.split_at(per_part);
                    self.encode_part(req, op, dest, flags, part, keys_run, keys, input);
                    rest = after;
                }
            }
        }
        if own.is_empty() { Rows::default() } else { self.route_each(req, op, kind, table, own, keys, input, caller) }
    }

    /// Looks at rows about to be sent for this node's run-time replicas (intent), under their
    /// shards' locks, so that making a replica and this node's pushes are ordered as they are
    /// queued for the network. A pull that makes replicas starts adding up, per key, the pushes
    /// sent behind it (which the value it brings back lacks). A push row that finds a replica
    /// made since the operation's local pass is served by it instead of being sent; one to a key
    /// whose replica is being made adds itself to that key's sum. Returns the rows left to send
    /// when any were served, `None` when none was.
    #[allow(clippy::too_many_arguments)]
    fn look_at_replicas(
        &mut self,
        req: &mut Requester,
        op: OpId,
        kind: AccessKind,
        table: u16,
        rows: &Rows,
        keys: &[u64],
        input: &[f32],
        mut caller: Option<&mut [f32]>,
    ) -> Option<Rows> {
        let store = self.core.store();
        let t = store.table(table);
        let d = t.dynamic()?;
        let value_len = t.value_len();
        if req.making_replicas {
            // With location caches, this pull and a later push may take different first hops,
            // so the push could overtake it: nothing is added up (the replica then lacks such a
            // push until its first sync round, as accesses with caches are eventually
            // consistent).
            if kind == AccessKind::Pull && !self.directory().caches() {
                for row in rows.iter() {
                    let key = keys[row as usize];
                    let guard = store.lock(table, key);
                    if guard.slot().is_none() && t.route_residence(key) == Residence::Away {
                        tracing::trace!(target: "ferry::replica_trace",  table, key, "pull making a replica routed");
                        d.begin_making(key, value_len);
                    }
                }
            }
            return None;
        }
        // Making first: an install counts its replica before it ends the making (see below).
        if !kind.updates() || req.bypass_replicas || !(d.any_making() || d.any()) {
            return None;
        }
        let (mut left, mut served) = (Rows::default(), 0);
        for row in rows.iter() {
            let key = keys[row as usize];
            // A replica being installed is visible before its making ends (`ReplicaSet`'s
            // install), so a key found in neither state, looked at in this order, has no
            // replica and no pull making one queued ahead of this row.
            if !d.any_making() && d.get(key).is_none() {
                left.push(row);
                continue;
            }
            let values = row as usize * value_len..(row as usize + 1) * value_len;
            let guard = store.lock(table, key);
            if guard.slot().is_none() {
                if let Some((value, delta)) = guard.replica() {
                    tracing::trace!(target: "ferry::replica_trace",  table, key, ?kind, "served by a replica made since the local pass");
                    let mut out = vec![0.0; if kind.returns_values() { value_len } else { 0 }];
                    serve_replica(&value, &delta, kind, &input[values], &mut out);
                    drop(guard);
                    if kind.returns_values() {
                        req.deliver_row(op, row, &out, caller.as_deref_mut());
                    }
                    req.answer_rows(op, std::iter::once(row));
                    served += 1;
                    continue;
                }
                let noted = d.note_sent_push(key, &input[values]);
                tracing::trace!(target: "ferry::replica_trace",  table, key, noted, "push sent to the owner");
            }
            left.push(row);
        }
        if served == 0 {
            return None;
        }
        self.tx.count_local(served);
        self.tx.count_replica(served);
        Some(left)
    }

    /// Routes rows one by one (their shards held): serves those that became local, queues those
    /// arriving here, forwards those homed here to their owner, sends the rest to their home.
    /// Returns the rows whose route leads to a node on its way out: the cut behind this node's
    /// READY (see `protocol::leave`) holds for them as for rows planned for that node, so they
    /// wait, unsent.
    #[allow(clippy::too_many_arguments)]
    fn route_each(
        &mut self,
        req: &mut Requester,
        op: OpId,
        kind: AccessKind,
        table: u16,
        rows: Rows,
        keys: &[u64],
        input: &[f32],
        mut caller: Option<&mut [f32]>,
    ) -> Rows {
        let dir = self.directory();
        let rank = dir.rank();
        let leaving = dir.departing().filter(|&node| node != rank);
        let mut deferred = Rows::default();
        let store = self.core.store();
        let value_len = store.table(table).value_len();
        let mut groups: Vec<(u16, u8, Rows)> = Vec::new();
        let mut queued = Rows::default();
        let queued_part = req.op_mut(op).map_or(0, |o| o.parts.len()) as u32;
        for row in rows.iter() {
            let key = keys[row as usize];
            let values = row as usize * value_len..(row as usize + 1) * value_len;
            if let Residence::Here(_) = store.table(table).route_residence(key) {
                let guard = store.lock(table, key);
                if let Some(slot) = guard.slot() {
                    // Pulls carry no input; `route_residence` counts a NuPS replica as away, so
                    // this slot is the key's own and no replica delta is kept.
                    let mut value = vec![0.0; if kind.returns_values() { value_len } else { 0 }];
                    serve_held(&slot, store.table(table).updater(), kind, input.get(values).unwrap_or_default(), &mut value);
                    drop(guard);
                    if kind != AccessKind::Pull {
                        self.note_local_write(table, key);
                    }
                    if kind.returns_values() {
                        req.deliver_row(op, row, &value, caller.as_deref_mut());
                    }
                    self.tx.count_local(1);
                    req.answer_rows(op, std::iter::once(row));
                    continue;
                }
            }
            if self.owns_in_transit(table, key)
                && let Some(transit) = self.shard_of(table, key).transits.get_mut(&(table, key))
            {
                match &transit.suspect {
                    Some(e) => req.fail_rows(op, std::iter::once(row), e),
                    None => {
                        let values = if kind.carries_values() { input[values].to_vec() } else { Vec::new() };
                        transit.queue.push(Queued::Access { origin: rank, op, part: queued_part, index: queued.len() as u32, kind, values });
                        queued.push(row);
                        self.shard_of(table, key).counters.queued_keys += 1;
                        // Served here once the key lands, without a message of this worker's.
                        self.tx.count_local(1);
                    }
                }
                continue;
            }
            let home = dir.home(table, key);
            let route = if home == rank {
                match dir.owner(table, key) {
                    LOST_OWNER => Err(Error::KeyLost { table: dir.table_name(table), key }),
                    owner if owner == rank => Err(Error::Protocol(format!("key {key} of '{}' should be here but is not", dir.table_name(table)))),
                    owner => Ok((owner, FLAG_FORWARDED)),
                }
            } else {
                Ok((home, 0))
            };
            match route.and_then(|(dest, flags)| if dir.is_lost(dest) { Err(dir.lost_error(dest)) } else { Ok((dest, flags)) }) {
                Ok((dest, _)) if Some(dest) == leaving => deferred.push(row),
                Ok((dest, flags)) => add_to_group(&mut groups, dest, flags, row),
                Err(e) => req.fail_rows(op, std::iter::once(row), &e),
            }
        }
        if !queued.is_empty()
            && let Some(o) = req.op_mut(op)
        {
            debug_assert_eq!(o.parts.len() as u32, queued_part);
            o.parts.push(queued);
            o.part_nodes.push(rank);
        }
        for (dest, flags, rows) in groups {
            let group = Group::new(dest, flags, rows, keys);
            let per_part = self.rows_per_part(kind, table, group.keys_run);
            let mut rest = group.rows;
            while !rest.is_empty() {
                let (part, after) = rest.split_at(per_part);
                self.encode_part(req, op, dest, flags, part, group.keys_run, keys, input);
                rest = after;
            }
        }
        deferred
    }

    /// Encodes one part of `op` for `dest` as one ACCESS (`keys_run`: its keys are known to be
    /// consecutive).
    #[allow(clippy::too_many_arguments)]
    fn encode_part(&mut self, req: &mut Requester, op: OpId, dest: u16, flags: u8, rows: Rows, keys_run: bool, keys: &[u64], input: &[f32]) {
        let Some(o) = req.op_mut(op) else { return };
        let OpKind::Access(kind) = o.kind else { return };
        let (table, value_len) = (o.table, o.value_len);
        let part = o.parts.len() as u32;
        let origin = self.directory().rank();
        let spec = self.core.store().table(table).spec();
        let h = AccessHeader { kind, flags, table, origin, op, part, codec: spec.codec };
        let cache = (spec.key_cache_min > 0).then_some(spec.key_cache_min);
        let buf = self.tx.buf(dest);
        let before = buf.len();
        encode_rows(buf, h, &rows, keys_run, keys, input, value_len, cache.map(|min| (min, req.key_cache(dest))));
        let Some(o) = req.op_mut(op) else { return };
        let bytes = buf.len() - before;
        // Counted here, where rows leave, so rows that turn out local on a second look count once.
        self.tx.count_remote(rows.len());
        o.parts.push(rows);
        o.part_nodes.push(dest);
        let message = if flags & FLAG_FORWARDED != 0 { MessageKind::Forward } else { MessageKind::Access };
        self.tx.sent(dest, message, bytes);
    }

    /// Moves `keys` of `table` to this node for the worker owning `req` (keys already here are
    /// skipped). The step must be fresh. `granted`: the intent service asks for the keys on
    /// their homes' grant, and a home declines a key it has since granted to another node
    /// (the key then stays where it is, and the operation completes without it).
    pub fn issue_localize(&mut self, req: &mut Requester, table: u16, keys: &[u64], granted: bool, ticket: Option<Weak<()>>) -> Result<Issued> {
        let dir = self.directory();
        let meta = dir.table(table).ok_or_else(|| Error::UnknownTable(format!("#{table}")))?;
        if let Some(&bad) = keys.iter().find(|&&k| k >= meta.keys) {
            return Err(Error::UnknownKey { table: meta.name.clone(), key: bad, keys: meta.keys });
        }
        if !self.core.settings().relocation {
            return Ok(Issued::Done(None));
        }
        let store = self.core.store();
        let t = store.table(table);
        if keys.iter().all(|&k| t.slot_of(k).is_some()) {
            return Ok(Issued::Done(None));
        }
        // Every key's shard, not only those elsewhere now: a key here may leave before the locks
        // are taken, and must then be fetched back under its shard's lock.
        let mask = shard_mask(dir, table, keys, &Rows::Run { first: 0, len: keys.len() as u32 });
        if !self.try_acquire(mask) {
            return Err(Error::Protocol("an operation was issued on a step that already holds shard locks".into()));
        }
        let (rank, now) = (dir.rank(), self.now);
        let op = req.begin(OpKind::Localize, table, meta.value_len, 0, 0, Output::None, None, ticket, now, dir.losses());
        // Set to the number of keys waited for before the locks go: no key can land earlier.
        let left: Countdown = Arc::new(AtomicUsize::new(0));
        let mut groups: Vec<Vec<MoveItem>> = vec![Vec::new(); dir.nodes()];
        let mut waiting = 0usize;
        for &key in keys {
            if t.slot_of(key).is_some() {
                continue;
            }
            let shard = self.shard_of(table, key);
            if let Some(transit) = shard.transits.get_mut(&(table, key)) {
                match &transit.suspect {
                    Some(e) => req.fail_count(op, 0, e),
                    None => {
                        transit.waiters.push((op, left.clone()));
                        // A plain localize needs the key here whatever the home granted.
                        transit.granted &= granted;
                        waiting += 1;
                    }
                }
                continue;
            }
            let home = dir.home(table, key);
            if dir.is_lost(home) {
                req.fail_count(op, 0, &dir.lost_error(home));
                continue;
            }
            if home == rank && dir.owner(table, key) == LOST_OWNER {
                req.fail_count(op, 0, &Error::KeyLost { table: meta.name.clone(), key });
                continue;
            }
            let slot = match store.reserve(table) {
                Ok(s) => s,
                Err(e) => {
                    req.fail_count(op, 0, &e);
                    continue;
                }
            };
            let item = self.open_transit(table, key, slot, Waiters::one((op, left.clone())), granted);
            groups[home as usize].push(item);
            waiting += 1;
        }
        // Keys marked arriving are those a move was requested for.
        if groups.iter().any(|items| !items.is_empty()) {
            // Once, after every key is marked and before the shard locks go: a requester that
            // read the counter before a key was marked, and found the key away, sees the bump
            // when it holds the key's shard lock, and looks again.
            self.core.note_arrival();
        }
        left.store(waiting, Ordering::Release);
        if let Some(o) = req.op_mut(op) {
            o.countdown = Some(left);
        }
        for (home, items) in groups.iter().enumerate() {
            if items.is_empty() {
                continue;
            }
            self.request_move(home as u16, table, items, if granted { wire::MOVE_GRANTED } else { 0 });
        }
        req.settle(op);
        Ok(Issued::Pending { op, more: false })
    }
}

/// Where rows planned for `dest` go now: rows planned for a node that was lost or left since
/// go where its keys are served now (none of them was sent, so none took effect).
#[inline]
fn current_dest(dir: &super::Directory, dest: u16) -> u16 {
    if dir.failover() && dir.is_lost(dest) { dir.stand_in(dest) } else { dest }
}

fn add_to_group(groups: &mut Vec<(u16, u8, Rows)>, dest: u16, flags: u8, row: u32) {
    match groups.last_mut() {
        Some(g) if g.0 == dest && g.1 == flags => g.2.push(row),
        _ => match groups.iter_mut().find(|g| g.0 == dest && g.1 == flags) {
            Some(g) => g.2.push(row),
            None => groups.push((dest, flags, Rows::one(row))),
        },
    }
}

/// Whether `keys` are consecutive (`k, k+1, …`).
#[inline]
fn is_run(keys: &[u64]) -> bool {
    let Some(&first) = keys.first() else { return false };
    keys.iter().enumerate().all(|(i, &k)| k == first.wrapping_add(i as u64))
}

/// Encodes one part: keys as a run when they are consecutive (known, or checked for a short
/// part), as the hash of a list the destination keeps (key caching: `cache` holds the minimum
/// list length and this worker's record of what the destination keeps), or listed; values as
/// one block when the rows are a run.
#[allow(clippy::too_many_arguments)]
fn encode_rows(
    buf: &mut Vec<u8>,
    mut h: AccessHeader,
    rows: &Rows,
    keys_run: bool,
    keys: &[u64],
    input: &[f32],
    value_len: usize,
    cache: Option<(usize, &mut super::keycache::KeyCache)>,
) {
    let cache = cache.filter(|(min, _)| rows.len() >= *min);
    // Scattered rows (keys homed here and there) are gathered into one list when it may be
    // kept: key caching needs the list's bytes in one piece.
    let gathered: (Vec<u64>, Vec<f32>);
    let (ks, values, known_run): (&[u64], &[f32], bool) = match rows.run() {
        Some((first, len)) => {
            let (first, len) = (first as usize, len as usize);
            let values = if h.kind.carries_values() { &input[first * value_len..(first + len) * value_len] } else { &[][..] };
            (&keys[first..first + len], values, keys_run)
        }
        None if cache.is_some() => {
            let ks: Vec<u64> = rows.iter().map(|r| keys[r as usize]).collect();
            let values: Vec<f32> = if h.kind.carries_values() {
                rows.iter().flat_map(|r| input[r as usize * value_len..(r as usize + 1) * value_len].iter().copied()).collect()
            } else {
                Vec::new()
            };
            gathered = (ks, values);
            (&gathered.0, &gathered.1, false)
        }
        None => {
            let list: Vec<u32> = rows.iter().collect();
            let h = AccessHeader { flags: h.flags & !FLAG_RUN, ..h };
            wire::encode_access(
                buf,
                h,
                list.len(),
                |i| i as u32,
                |i| keys[list[i] as usize],
                |i, o| {
                    let r = list[i] as usize;
                    o.extend_from_slice(f32_bytes(&input[r * value_len..(r + 1) * value_len]));
                },
            );
            return;
        }
    };
    let mut block_keys = if known_run || is_run(ks) { BlockKeys::Run { first: ks[0], count: ks.len() } } else { BlockKeys::List(ks) };
    if let (BlockKeys::List(list), Some((_, cache))) = (block_keys, cache) {
        let bytes = crate::util::u64_bytes(list);
        let hash = super::keycache::list_hash(bytes);
        if cache.holds(hash, bytes) {
            block_keys = BlockKeys::Cached { hash, count: list.len() };
        } else {
            cache.remember(hash, bytes);
            h.flags |= wire::FLAG_KEYS_REMEMBER;
        }
    }
    wire::encode_access_block(buf, h, block_keys, f32_bytes(values));
}

/// Serves one row from a slot held here (a NuPS replica's delta is the caller's).
#[inline]
pub(crate) fn serve_held(slot: &crate::store::Slot<'_>, updater: &crate::update::Updater, kind: AccessKind, input: &[f32], output: &mut [f32]) {
    match kind {
        AccessKind::Pull => slot.read(output),
        AccessKind::Push => slot.push(updater, input),
        AccessKind::PushPull => {
            slot.push(updater, input);
            slot.read(output);
        }
        AccessKind::Set => slot.write(input),
    }
}

/// Serves one row from a run-time replica (the caller holds the key's latch): a push adds to
/// the value and to the delta, which the intent service sends to the key's owner. Sets are
/// never served here (they go to the owner).
#[inline]
pub(crate) fn serve_replica(value: &crate::store::Slot<'_>, delta: &crate::store::Slot<'_>, kind: AccessKind, input: &[f32], output: &mut [f32]) {
    match kind {
        AccessKind::Pull => value.read(output),
        AccessKind::Push | AccessKind::PushPull => {
            value.add(input);
            delta.add(input);
            if kind == AccessKind::PushPull {
                value.read(output);
            }
        }
        AccessKind::Set => debug_assert!(false, "a set of a replica goes to the key's owner"),
    }
}
