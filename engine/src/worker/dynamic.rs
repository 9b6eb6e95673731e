//! A worker's calls on a dynamic table ([`crate::dynamic`]): raw ids looked up in the node's
//! index, those it does not know asked of their homes (created there if new and admitted), then
//! the same call on the slot keys. Ids an admission filter has not admitted yet have no slot
//! key: the call runs on the others, their pushes are dropped (their homes counted them), and
//! their rows read their initial values.

use std::sync::Arc;
use std::time::Instant;

use super::{PullTicket, Worker};
use crate::dynamic::{Assigned, IdIndex, Intent, table_full};
use crate::error::{Error, Result};
use crate::protocol::{Progress, assign};
use crate::table::Table;
use crate::util::FastMap;

/// The call on slot keys: the slot-key handle, the keys, their rows of input (or none) and
/// their rows of output (or none).
type OnSlotKeys<'o, R> = dyn FnOnce(&mut Worker, Table, &[u64], &[f32], Option<&mut [f32]>) -> Result<R> + 'o;

impl Worker {
    /// Runs `op` on the slot keys of `ids`, asked for with `intent`: on all of them when every
    /// id has one, else on those that do, with their rows of `input` (`value_len` floats per
    /// id, or empty) and into their rows of `out`, whose other rows take their ids' initial
    /// values. Known ids cost a lookup each; unknown ones one ASSIGN per home. The key buffer
    /// is the worker's, kept between calls.
    pub(super) fn through_index<R>(
        &mut self,
        table: Table,
        ids: &[u64],
        intent: Intent,
        input: &[f32],
        out: Option<&mut [f32]>,
        op: Box<OnSlotKeys<'_, R>>,
    ) -> Result<R> {
        self.pinned(move |w| {
            // One known id: its slot key on the stack, with no reference counted. Its slot's
            // line (where the store put it at start) and a writer's latch are asked for now,
            // so that they come while the store's map is read: the index's miss is then the
            // one a dense key does not pay.
            if let [id] = ids
                && let Some(key) = w.node.core.id_index(table.id).and_then(|index| index.lookup(*id))
            {
                let store = w.node.core.store();
                if let Some(slot) = store.table(table.id).start_slot_guess(key) {
                    store.table(table.id).prefetch_slot(slot);
                }
                if intent != Intent::Read {
                    store.prefetch_latch(table.id, key);
                }
                return op(w, table.slot_keys(), &[key], input, out);
            }
            let (keys, not_admitted) = w.translate(table, ids, intent)?;
            if not_admitted.is_empty() {
                let outcome = op(w, table.slot_keys(), &keys, input, out);
                w.hashed_keys = keys;
                return outcome;
            }
            let outcome = w.on_admitted(table, ids, &keys, &not_admitted, input, out, op);
            w.hashed_keys = keys;
            outcome
        })
    }

    /// Runs `f` pinned for eviction's grace periods (where a table evicts): a node that evicts
    /// ids waits until no operation that could have looked them up is left; unpinned after
    /// unless an asynchronous operation is still in flight.
    #[inline]
    fn pinned<R>(&mut self, f: impl FnOnce(&mut Worker) -> R) -> R {
        if let Some(pin) = &self.pin {
            self.node.core.pins().pin(pin);
        }
        let outcome = f(self);
        self.unpin_if_idle();
        outcome
    }

    /// Unpins this worker once it has no operation in flight (an asynchronous operation on a
    /// dynamic table keeps it pinned until it is waited for or seen done).
    #[inline]
    pub(super) fn unpin_if_idle(&self) {
        if let Some(pin) = &self.pin
            && self.requester.pending() == 0
        {
            crate::dynamic::Pins::unpin(pin);
        }
    }

    /// `op` on the ids that have slot keys (`keys`, one per id) only: compacted rows of `input`
    /// go in, and rows of `out` come back to their places; the ids at `not_admitted` read their
    /// initial values.
    #[allow(clippy::too_many_arguments)]
    fn on_admitted<R>(
        &mut self,
        table: Table,
        ids: &[u64],
        keys: &[u64],
        not_admitted: &[usize],
        input: &[f32],
        out: Option<&mut [f32]>,
        op: Box<OnSlotKeys<'_, R>>,
    ) -> Result<R> {
        let len = table.value_len;
        let mut skipped = vec![false; ids.len()];
        for &i in not_admitted {
            skipped[i] = true;
        }
        let admitted: Vec<usize> = (0..ids.len()).filter(|&i| !skipped[i]).collect();
        let some_keys: Vec<u64> = admitted.iter().map(|&i| keys[i]).collect();
        let some_input: Vec<f32> =
            if input.is_empty() { Vec::new() } else { admitted.iter().flat_map(|&i| input[i * len..(i + 1) * len].iter().copied()).collect() };
        let Some(out) = out else {
            return op(self, table.slot_keys(), &some_keys, &some_input, None);
        };
        let mut some_out = vec![0.0f32; admitted.len() * len];
        let outcome = op(self, table.slot_keys(), &some_keys, &some_input, Some(&mut some_out))?;
        for (row, &i) in some_out.chunks_exact(len.max(1)).zip(&admitted) {
            out[i * len..(i + 1) * len].copy_from_slice(row);
        }
        if let Some(index) = self.node.core.id_index(table.id) {
            for &i in not_admitted {
                index.spec().init.fill(ids[i], &mut out[i * len..(i + 1) * len]);
            }
        }
        Ok(outcome)
    }

    /// An asynchronous pull or push-pull (`write`) of a dynamic table: started as on any table
    /// when every id has a slot key; with ids not admitted yet it runs at once, and the ticket
    /// holds its values.
    pub(super) fn dynamic_pull_async(&mut self, table: Table, ids: &[u64], updates: &[f32], write: bool) -> Result<PullTicket> {
        self.pinned(|w| w.dynamic_pull_async_pinned(table, ids, updates, write))
    }

    fn dynamic_pull_async_pinned(&mut self, table: Table, ids: &[u64], updates: &[f32], write: bool) -> Result<PullTicket> {
        let intent = if write { Intent::Write } else { Intent::Read };
        let (keys, not_admitted) = self.translate(table, ids, intent)?;
        let outcome = if not_admitted.is_empty() {
            if write { self.push_pull_async(table.slot_keys(), &keys, updates) } else { self.pull_async(table.slot_keys(), &keys) }
        } else {
            let mut values = vec![0.0f32; ids.len() * table.value_len];
            let done = self.on_admitted(
                table,
                ids,
                &keys,
                &not_admitted,
                updates,
                Some(&mut values),
                Box::new(move |w, t, k, u, out| {
                    let out = out.unwrap_or_default();
                    if write { w.push_pull(t, k, u, out) } else { w.pull(t, k, out) }
                }),
            );
            done.map(|()| PullTicket { op: None, values: Some(values), _token: Arc::new(()), signs: None })
        };
        self.hashed_keys = keys;
        outcome
    }

    /// [`Worker::pull_held`] of a dynamic table: the homes are asked without creating
    /// anything ([`Intent::Peek`]).
    pub(super) fn dynamic_pull_held(&mut self, table: Table, ids: &[u64], out: &mut [f32]) -> Result<Vec<bool>> {
        self.pinned(|w| {
            let (keys, absent) = w.translate(table, ids, Intent::Peek)?;
            let mut held = vec![true; ids.len()];
            for &i in &absent {
                held[i] = false;
            }
            let outcome = if absent.is_empty() {
                w.pull(table.slot_keys(), &keys, out)
            } else {
                w.on_admitted(table, ids, &keys, &absent, &[], Some(out), Box::new(|w, t, k, _, out| w.pull(t, k, out.unwrap_or_default())))
            };
            w.hashed_keys = keys;
            outcome.map(|()| held)
        })
    }

    /// The slot key of each of `ids` (0 for an id without one), learnt from its home with
    /// `intent` where this node does not know it, and the positions of the ids without one
    /// (not admitted yet). The keys are the worker's buffer: the caller puts it back.
    fn translate(&mut self, table: Table, ids: &[u64], intent: Intent) -> Result<(Vec<u64>, Vec<usize>)> {
        let node = self.node.clone();
        let Some(index) = node.core.id_index(table.id) else {
            return Err(Error::UnknownTable(format!("#{} (a dynamic handle of a table that is not dynamic)", table.id)));
        };
        let mut keys = std::mem::take(&mut self.hashed_keys);
        keys.clear();
        let mut missing = Vec::new();
        index.lookup_many(ids, intent, &mut keys, &mut missing);
        let mut not_admitted = Vec::new();
        match self.assign_missing(table, index, ids, &missing, intent) {
            Ok(learnt) => {
                for &i in &missing {
                    match learnt.get(&ids[i]) {
                        Some(Assigned::Key(key)) => keys[i] = *key,
                        _ => not_admitted.push(i),
                    }
                }
                Ok((keys, not_admitted))
            }
            Err(e) => {
                self.hashed_keys = keys;
                Err(e)
            }
        }
    }

    /// Learns what the homes of the ids at `missing` (positions in `ids`) say of them: this
    /// node's own index for those homed here, one ASSIGN per other home, all sent before the
    /// first answer is awaited. Returns the answers (the slot keys also remembered in the
    /// index).
    fn assign_missing(&mut self, table: Table, index: &IdIndex, ids: &[u64], missing: &[usize], intent: Intent) -> Result<FastMap<u64, Assigned>> {
        let mut learnt = FastMap::default();
        if missing.is_empty() {
            return Ok(learnt);
        }
        let node = self.node.clone();
        let dir = node.core.directory();
        // Until a home answers otherwise, an id has no slot key.
        let per_home = dir.ids_by_home(index.spec(), missing.iter().map(|&i| ids[i]), |id| learnt.insert(id, Assigned::NotAdmitted).is_none());
        let name = || node.config.tables[table.id as usize].name.clone();
        let capacity = index.spec().capacity;
        let rank = dir.rank();
        let mut asked = Vec::new();
        for (home, group) in per_home.iter().enumerate() {
            if group.is_empty() || home == rank as usize {
                continue;
            }
            if dir.is_lost(home as u16) {
                return Err(dir.lost_error(home as u16));
            }
            let request = node.core.next_assign_request();
            node.run(&mut self.tx, |step, _, _| {
                step.send_assign(home as u16, table.id, request, intent, group);
                Ok(Progress::Done)
            })?;
            asked.push((home as u16, request));
        }
        // Those homed here meanwhile: no message. (A failure here still takes the other homes'
        // answers: their ids are learnt, and the mailbox keeps nothing nobody waits for.)
        let mut outcome = Ok(());
        let own = &per_home[rank as usize];
        if !own.is_empty() {
            let mut answers = Vec::with_capacity(own.len());
            match node.core.assign_ids(table.id, own, intent, &mut answers) {
                Ok(_) => {
                    for (&id, &answer) in own.iter().zip(&answers) {
                        if answer == Assigned::Full {
                            outcome = outcome.and(Err(table_full(&name(), rank as usize, capacity)));
                        }
                        learnt.insert(id, answer);
                    }
                }
                Err(e) => outcome = Err(e),
            }
        }
        let timeout = node.config.op_timeout;
        let deadline = Instant::now() + timeout;
        for (home, request) in asked {
            let alive = || node.fabric.is_alive(home as usize) && !dir.is_lost(home);
            let Some(values) = node.core.assignments().wait(home, request, deadline, alive) else {
                if outcome.is_ok() {
                    outcome = Err(if dir.is_lost(home) {
                        dir.lost_error(home)
                    } else {
                        Error::Timeout { what: "the slot keys of new ids of a dynamic table", millis: timeout.as_millis() as u64, nodes: vec![home as usize] }
                    });
                }
                continue;
            };
            let group = &per_home[home as usize];
            if values.len() != group.len() {
                outcome = outcome.and(Err(Error::Protocol(format!("node {home} answered {} ids with {} slot keys", group.len(), values.len()))));
                continue;
            }
            let mut answered = Vec::with_capacity(values.len());
            for (&id, &value) in group.iter().zip(&values) {
                match assign::from_wire(value) {
                    None => outcome = outcome.and(Err(Error::Protocol(format!("node {home} is not the home of id {id} of table '{}'", name())))),
                    Some(Assigned::Full) => outcome = outcome.and(Err(table_full(&name(), home as usize, capacity))),
                    Some(answer) => {
                        if let Assigned::Key(key) = answer {
                            answered.push((id, key));
                        }
                        learnt.insert(id, answer);
                    }
                }
            }
            index.learn_many(&answered, intent);
        }
        outcome.map(|()| learnt)
    }
}
