//! The handle a trainer thread holds.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::client::{gather, local_pass, pull_if_all_local, scatter};
use crate::error::{Error, Result};
use crate::node::{NodeInner, OpCell, Table};
use crate::protocol::{AccessKind, Request, RequestKind, Submitted};

/// One trainer thread's access to the parameter store.
///
/// Keys may repeat within a call and need not be sorted; values are laid out key after key
/// (`keys.len() × value_len` floats). Keys held by this node are served right here — a latch and
/// a copy, no queue, no allocation, no system call; other keys go to their owners, grouped into
/// one message per destination.
///
/// # Consistency
///
/// Per key, Ferry guarantees:
/// * **synchronous operations are sequentially consistent**, with or without location caches:
///   all nodes' operations on a key take effect in one order that respects each worker's program
///   order, and a pull returns the sum of the pushes (since the last set) before it;
/// * **asynchronous operations are sequentially consistent without location caches**: a worker's
///   operations on a key take effect in the order it issued them, even while the key relocates;
/// * **with location caches, asynchronous operations are only eventually consistent**: a stale
///   cache entry can make a later operation overtake an earlier one (Lapse, Theorem 3).
///
/// Relocations never change values and never lose or duplicate updates. Operations that fail (a
/// lost peer, a timeout) may or may not have taken effect.
pub struct Worker {
    node: Arc<NodeInner>,
    id: usize,
    local: Arc<CachePadded<AtomicU64>>,
    outstanding: Arc<AtomicUsize>,
    rows: Vec<u32>,
}

/// An asynchronous push, set or localize in flight; pass it to [`Worker::wait`].
#[must_use = "an operation's outcome is only known by waiting for it"]
pub struct Ticket {
    cell: Option<Arc<OpCell>>,
}

/// An asynchronous pull in flight; pass it to [`Worker::wait_pull`].
#[must_use = "a pull's values are only available by waiting for it"]
pub struct PullTicket {
    values: Vec<f32>,
    rows: Vec<u32>,
    value_len: usize,
    cell: Option<Arc<OpCell>>,
}

impl Ticket {
    /// Whether the operation has completed (successfully or not).
    pub fn is_done(&self) -> bool {
        self.cell.as_ref().is_none_or(|c| c.is_done())
    }
}

impl PullTicket {
    /// Whether the pull has completed (successfully or not).
    pub fn is_done(&self) -> bool {
        self.cell.as_ref().is_none_or(|c| c.is_done())
    }
}

impl Worker {
    pub(crate) fn new(node: Arc<NodeInner>) -> Worker {
        let (id, local) = node.register_worker();
        Worker { node, id, local, outstanding: Arc::new(AtomicUsize::new(0)), rows: Vec::new() }
    }

    /// This worker's number on its node.
    pub fn id(&self) -> usize {
        self.id
    }

    /// The node's rank.
    pub fn rank(&self) -> usize {
        self.node.config.rank
    }

    /// Looks a table up by name.
    pub fn table(&self, name: &str) -> Result<Table> {
        self.node.table(name)
    }

    #[inline]
    fn validate_keys(&self, table: Table, keys: &[u64]) -> Result<()> {
        self.node.check_table(table)?;
        if keys.iter().any(|&k| k >= table.keys) {
            return Err(self.unknown_key(table, keys));
        }
        Ok(())
    }

    #[cold]
    fn unknown_key(&self, table: Table, keys: &[u64]) -> Error {
        let key = keys.iter().copied().find(|&k| k >= table.keys).unwrap_or(u64::MAX);
        Error::UnknownKey { table: self.node.config.tables[table.id as usize].name.clone(), key, keys: table.keys }
    }

    #[inline]
    fn validate(&self, table: Table, keys: &[u64], values: usize, what: &'static str) -> Result<()> {
        self.validate_keys(table, keys)?;
        let expected = keys.len() * table.value_len;
        if values != expected {
            return Err(Error::WrongLength { what, expected, got: values });
        }
        Ok(())
    }

    /// The hot path for one key held here: a latch and a copy. `None` when the key is elsewhere.
    #[inline]
    fn single_local(&mut self, kind: AccessKind, table: Table, key: u64, input: &[f32], output: &mut [f32]) -> Option<()> {
        let store = &self.node.store;
        let t = store.table(table.id);
        // SAFETY: `output` holds `value_len` floats (validated by the caller).
        if kind == AccessKind::Pull && unsafe { t.read_optimistic(key, output.as_mut_ptr()) } {
            self.count_local(1);
            return Some(());
        }
        let _latch = store.latch(table.id, key);
        let slot = t.slot_of(key)?;
        // SAFETY: the key's latch is held and `slot` is its published slot.
        unsafe {
            match kind {
                AccessKind::Pull => t.read(slot, output),
                AccessKind::Push => t.add(slot, input),
                AccessKind::Set => t.write(slot, input),
            }
        }
        self.count_local(1);
        Some(())
    }

    /// Counts keys served locally. Only this worker writes its counter, so a load and a store
    /// suffice (no locked read-modify-write on the hot path).
    #[inline]
    fn count_local(&self, served: usize) {
        self.local.store(self.local.load(Ordering::Relaxed) + served as u64, Ordering::Relaxed);
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.node.config.op_timeout
    }

    /// Serves what is local; submits the rest. Returns the remote rows and the pending cell, or
    /// `None` for the cell when everything completed.
    fn issue(
        &mut self,
        kind: AccessKind,
        table: Table,
        keys: &[u64],
        input: &[f32],
        output: &mut [f32],
        asynchronous: bool,
    ) -> Result<(Vec<u32>, Option<Arc<OpCell>>)> {
        let mut rows = std::mem::take(&mut self.rows);
        rows.clear();
        let served = local_pass(&self.node.store, kind, table.id, keys, input, output, &mut rows);
        self.count_local(served);
        if rows.is_empty() {
            self.rows = rows;
            return Ok((Vec::new(), None));
        }
        // When every row is remote the caller's slices are the request as they are.
        let gathered;
        let (remote_keys, remote_values): (&[u64], &[f32]) = if rows.len() == keys.len() {
            (keys, input)
        } else {
            gathered = gather(&rows, keys, input, table.value_len, kind.carries_values());
            (&gathered.0, &gathered.1)
        };
        let cell = OpCell::new(asynchronous.then(|| self.outstanding.clone()));
        let request = Request { kind: RequestKind::Access(kind), table: table.id, keys: remote_keys, values: remote_values };
        let submitted = self.node.step(|e, now| {
            let r = e.protocol.submit(request, now);
            if let Ok(Submitted::Pending(id)) = r {
                e.waiters.insert(id, cell.clone());
            }
            r
        });
        match submitted {
            Ok(Submitted::Done(values)) => {
                if kind == AccessKind::Pull {
                    scatter(&rows, &values, output, table.value_len);
                }
                cell.finish_unused();
                Ok((Vec::new(), None))
            }
            Ok(Submitted::Pending(_)) => Ok((rows, Some(cell))),
            Err(e) => {
                cell.finish_unused();
                Err(e)
            }
        }
    }

    fn wait_cell(&self, cell: &OpCell, what: &'static str) -> Result<Vec<f32>> {
        match cell.wait(self.deadline()) {
            Some(result) => result,
            None => {
                // Forget the operation so that a late answer is ignored; it may or may not have
                // taken effect.
                self.node.step(|e, _| {
                    let ids: Vec<_> = e.waiters.iter().filter(|(_, c)| std::ptr::eq(Arc::as_ptr(c), cell)).map(|(id, _)| *id).collect();
                    for id in ids {
                        e.waiters.remove(&id);
                        e.protocol.cancel(id);
                    }
                });
                cell.finish_unused();
                Err(Error::Timeout { what, millis: self.node.config.op_timeout.as_millis() as u64 })
            }
        }
    }

    /// Reads the values of `keys` into `out` (`keys.len() × value_len` floats).
    #[inline]
    pub fn pull(&mut self, table: Table, keys: &[u64], out: &mut [f32]) -> Result<()> {
        self.validate(table, keys, out.len(), "pull output")?;
        if let [key] = keys
            && let Some(()) = self.single_local(AccessKind::Pull, table, *key, &[], out)
        {
            return Ok(());
        }
        if keys.len() >= 64 && self.all_remote(table, keys) {
            return self.pull_remote_into(table, keys, out);
        }
        let (rows, cell) = self.issue(AccessKind::Pull, table, keys, &[], out, false)?;
        if let Some(cell) = cell {
            let values = self.wait_cell(&cell, "pull")?;
            scatter(&rows, &values, out, table.value_len);
            self.rows = rows;
        }
        Ok(())
    }

    fn all_remote(&self, table: Table, keys: &[u64]) -> bool {
        let t = self.node.store.table(table.id);
        keys.iter().all(|&k| t.slot_of(k).is_none())
    }

    /// A pull of keys held elsewhere, written by the protocol straight into `out` (one copy of
    /// every value fewer). `out` stays borrowed until the operation completes or is cancelled.
    fn pull_remote_into(&mut self, table: Table, keys: &[u64], out: &mut [f32]) -> Result<()> {
        let cell = OpCell::new(None);
        let ptr = out.as_mut_ptr();
        let submitted = self.node.step(|e, now| {
            // SAFETY: `out` is borrowed mutably for this whole call, and the call does not return
            // before the operation completes or `wait_cell` cancelled it (under this same lock),
            // so the protocol never writes through `ptr` after `out` is released.
            let r = unsafe { e.protocol.submit_into(table.id, keys, ptr, now) };
            if let Ok(Submitted::Pending(id)) = r {
                e.waiters.insert(id, cell.clone());
            }
            r
        });
        match submitted {
            Ok(Submitted::Done(_)) => {
                cell.finish_unused();
                Ok(())
            }
            Ok(Submitted::Pending(_)) => self.wait_cell(&cell, "pull").map(|_| ()),
            Err(e) => {
                cell.finish_unused();
                Err(e)
            }
        }
    }

    /// Adds `updates` to the values of `keys` (cumulative).
    #[inline]
    pub fn push(&mut self, table: Table, keys: &[u64], updates: &[f32]) -> Result<()> {
        self.validate(table, keys, updates.len(), "push updates")?;
        if let [key] = keys
            && let Some(()) = self.single_local(AccessKind::Push, table, *key, updates, &mut [])
        {
            return Ok(());
        }
        let (rows, cell) = self.issue(AccessKind::Push, table, keys, updates, &mut [], false)?;
        if let Some(cell) = cell {
            self.wait_cell(&cell, "push")?;
            self.rows = rows;
        }
        Ok(())
    }

    /// Overwrites the values of `keys`.
    pub fn set(&mut self, table: Table, keys: &[u64], values: &[f32]) -> Result<()> {
        self.validate(table, keys, values.len(), "set values")?;
        let (rows, cell) = self.issue(AccessKind::Set, table, keys, values, &mut [], false)?;
        if let Some(cell) = cell {
            self.wait_cell(&cell, "set")?;
            self.rows = rows;
        }
        Ok(())
    }

    /// Reads `keys` into `out` only if all of them are held by this node; returns whether it
    /// did. Never touches the network.
    pub fn pull_if_local(&mut self, table: Table, keys: &[u64], out: &mut [f32]) -> Result<bool> {
        self.validate(table, keys, out.len(), "pull output")?;
        let done = pull_if_all_local(&self.node.store, table.id, keys, out);
        if done {
            self.count_local(keys.len());
        }
        Ok(done)
    }

    /// Moves `keys` to this node and waits until they are here (keys already here are skipped).
    /// Without relocation (a classic parameter server) it returns at once.
    pub fn localize(&mut self, table: Table, keys: &[u64]) -> Result<()> {
        let ticket = self.localize_async(table, keys)?;
        self.wait(ticket)
    }

    /// Starts moving `keys` to this node.
    pub fn localize_async(&mut self, table: Table, keys: &[u64]) -> Result<Ticket> {
        self.validate_keys(table, keys)?;
        let cell = OpCell::new(Some(self.outstanding.clone()));
        let request = Request { kind: RequestKind::Localize, table: table.id, keys, values: &[] };
        let submitted = self.node.step(|e, now| {
            let r = e.protocol.submit(request, now);
            if let Ok(Submitted::Pending(id)) = r {
                e.waiters.insert(id, cell.clone());
            }
            r
        });
        match submitted {
            Ok(Submitted::Pending(_)) => Ok(Ticket { cell: Some(cell) }),
            Ok(Submitted::Done(_)) => {
                cell.finish_unused();
                Ok(Ticket { cell: None })
            }
            Err(e) => {
                cell.finish_unused();
                Err(e)
            }
        }
    }

    /// Starts a pull; the values come from [`Worker::wait_pull`].
    pub fn pull_async(&mut self, table: Table, keys: &[u64]) -> Result<PullTicket> {
        self.validate(table, keys, keys.len() * table.value_len, "pull output")?;
        let mut values = vec![0.0; keys.len() * table.value_len];
        let (rows, cell) = self.issue(AccessKind::Pull, table, keys, &[], &mut values, true)?;
        Ok(PullTicket { values, rows, value_len: table.value_len, cell })
    }

    /// Starts a push.
    pub fn push_async(&mut self, table: Table, keys: &[u64], updates: &[f32]) -> Result<Ticket> {
        self.validate(table, keys, updates.len(), "push updates")?;
        let (_, cell) = self.issue(AccessKind::Push, table, keys, updates, &mut [], true)?;
        Ok(Ticket { cell })
    }

    /// Starts a set.
    pub fn set_async(&mut self, table: Table, keys: &[u64], values: &[f32]) -> Result<Ticket> {
        self.validate(table, keys, values.len(), "set values")?;
        let (_, cell) = self.issue(AccessKind::Set, table, keys, values, &mut [], true)?;
        Ok(Ticket { cell })
    }

    /// Waits for an asynchronous push, set or localize.
    pub fn wait(&mut self, ticket: Ticket) -> Result<()> {
        match ticket.cell {
            None => Ok(()),
            Some(cell) => self.wait_cell(&cell, "asynchronous operation").map(|_| ()),
        }
    }

    /// Waits for an asynchronous pull and returns its values.
    pub fn wait_pull(&mut self, ticket: PullTicket) -> Result<Vec<f32>> {
        let mut values = ticket.values;
        if let Some(cell) = ticket.cell {
            let pulled = self.wait_cell(&cell, "asynchronous pull")?;
            scatter(&ticket.rows, &pulled, &mut values, ticket.value_len);
        }
        Ok(values)
    }

    /// Waits until this worker's asynchronous operations have completed, then until every live
    /// worker of every node has reached the barrier. Operations issued before the barrier are
    /// visible to all operations after it.
    pub fn barrier(&mut self) -> Result<()> {
        let deadline = self.deadline();
        while self.outstanding.load(Ordering::Acquire) > 0 {
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: "waiting for asynchronous operations before a barrier",
                    millis: self.node.config.op_timeout.as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        self.node.worker_barrier()
    }

    /// This node's statistics.
    pub fn stats(&self) -> crate::stats::Stats {
        self.node.stats()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.node.retire_worker(&self.local);
    }
}

impl OpCell {
    /// Balances the outstanding count of a cell that was created but never registered.
    pub(crate) fn finish_unused(&self) {
        if !self.is_done() {
            self.complete(Ok(Vec::new()));
        }
    }
}
