//! Slot keys for the ids of a dynamic table ([`crate::dynamic`]): a node that meets ids it does
//! not know asks their home (ASSIGN), which looks each up in its index, creates those it lacks
//! (initialising their values in its own slots) and answers with the slot key of each
//! (ASSIGNED). The asking worker waits for the answer in [`Assignments`].
//!
//! ASSIGN and ASSIGNED: `[type][flags][table u16][request u32][count u32]`, then `count` values
//! of eight bytes: ids in ASSIGN, in the same order their slot keys in ASSIGNED — or [`FULL`]
//! (the home's share of the table is used up), [`NOT_ADMITTED`] (the admission filter did not
//! admit the new id) or [`NOT_HOME`] (the node is not the id's home). ASSIGN's flags say what
//! the asker will do (`dynamic::Intent`: 0 read, 1 write, 2 set); ASSIGNED's are 0.

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::Step;
use super::wire::{begin, finish, msg, u16_at, u32_at, u64_at};
use crate::dynamic::{Assigned, Intent};
use crate::error::{Error, Result};
use crate::stats::MessageKind;
use crate::util::FastMap;

/// Header bytes of ASSIGN and ASSIGNED.
pub const HEADER: usize = 12;
/// In ASSIGNED: the home cannot create the id (its share of the table is used up).
pub const FULL: u64 = u64::MAX;
/// In ASSIGNED: the node is not the id's home.
pub const NOT_HOME: u64 = u64::MAX - 1;
/// In ASSIGNED: the id is new and its table's admission filter did not admit it.
pub const NOT_ADMITTED: u64 = u64::MAX - 2;

/// Appends an ASSIGN or ASSIGNED (`ty`) of `table` for request `request` with `values` (or an
/// EVICT or EVICTED, which share the layout: see `protocol::evict`).
pub fn encode(out: &mut Vec<u8>, ty: u8, flags: u8, table: u16, request: u32, values: impl ExactSizeIterator<Item = u64>) -> usize {
    debug_assert!(matches!(ty, msg::ASSIGN | msg::ASSIGNED | msg::EVICT | msg::EVICTED));
    let start = begin(out, ty);
    out.push(flags);
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&request.to_le_bytes());
    out.extend_from_slice(&(values.len() as u32).to_le_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    finish(out, start);
    out.len() - start
}

/// A decoded ASSIGN or ASSIGNED.
#[derive(Debug)]
pub struct Assign<'a> {
    /// Its flags (an ASSIGN's intent).
    pub flags: u8,
    /// Its table.
    pub table: u16,
    /// The asker's number for it, repeated in the answer.
    pub request: u32,
    values: &'a [u8],
}

impl Assign<'_> {
    /// Decodes `body`, checking that its length is what its count says.
    pub fn decode(body: &[u8]) -> Result<Assign<'_>> {
        if body.len() < HEADER {
            return Err(Error::Protocol(format!("ASSIGN message of {} bytes", body.len())));
        }
        let count = u32_at(body, 8) as usize;
        if (body.len() - HEADER) / 8 != count || !(body.len() - HEADER).is_multiple_of(8) {
            return Err(Error::Protocol(format!("ASSIGN message of {} bytes says it carries {count} values", body.len())));
        }
        Ok(Assign { flags: body[1], table: u16_at(body, 2), request: u32_at(body, 4), values: &body[HEADER..] })
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.values.len() / 8
    }

    /// The values: ids, or slot keys.
    pub fn values(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        (0..self.len()).map(|i| u64_at(self.values, i * 8))
    }
}

/// How ASSIGNED carries a home's answer for one id.
pub(crate) fn wire_value(assigned: Assigned) -> u64 {
    match assigned {
        Assigned::Key(key) => key,
        Assigned::Full => FULL,
        Assigned::NotAdmitted => NOT_ADMITTED,
    }
}

/// A home's answer for one id, from ASSIGNED (the value checked against the table before).
pub(crate) fn from_wire(value: u64) -> Option<Assigned> {
    match value {
        FULL => Some(Assigned::Full),
        NOT_ADMITTED => Some(Assigned::NotAdmitted),
        NOT_HOME => None,
        key => Some(Assigned::Key(key)),
    }
}

/// Answers to this node's ASSIGN messages, on their way from the protocol to the workers that
/// wait for them.
#[derive(Default)]
pub(crate) struct Assignments {
    answers: Mutex<FastMap<(u16, u32), Vec<u64>>>,
    arrived: Condvar,
}

/// Answers kept at most: one of a request nobody waits for any more (it timed out) is dropped
/// when the map is full.
const KEPT: usize = 4096;

impl Assignments {
    /// Posts the slot keys that `from` answered request `request` with.
    pub fn post(&self, from: u16, request: u32, keys: Vec<u64>) {
        let mut answers = self.answers.lock();
        if answers.len() >= KEPT
            && let Some(&any) = answers.keys().next()
        {
            answers.remove(&any);
        }
        answers.insert((from, request), keys);
        drop(answers);
        self.arrived.notify_all();
    }

    /// Takes the answer of `from` to `request`, if it came (the simulator's workers poll).
    #[cfg(any(test, feature = "sim"))]
    pub fn take(&self, from: u16, request: u32) -> Option<Vec<u64>> {
        self.answers.lock().remove(&(from, request))
    }

    /// Waits for the answer of `from` to `request` until `deadline`, or until `alive` says
    /// that `from` is gone.
    pub fn wait(&self, from: u16, request: u32, deadline: Instant, alive: impl Fn() -> bool) -> Option<Vec<u64>> {
        let mut answers = self.answers.lock();
        loop {
            if let Some(keys) = answers.remove(&(from, request)) {
                return Some(keys);
            }
            if Instant::now() >= deadline || !alive() {
                return None;
            }
            let _ = self.arrived.wait_until(&mut answers, deadline.min(Instant::now() + Duration::from_millis(50)));
        }
    }
}

impl Step<'_, '_> {
    /// Queues an ASSIGN of `ids` of dynamic table `table`, asked with `intent`, to their home
    /// `home`.
    pub(crate) fn send_assign(&mut self, home: u16, table: u16, request: u32, intent: Intent, ids: &[u64]) {
        let bytes = encode(self.tx.buf(home), msg::ASSIGN, intent as u8, table, request, ids.iter().copied());
        self.tx.sent(home, MessageKind::Access, bytes);
    }

    /// An ASSIGN from `from`: answers with the slot key of each id, creating the ids this home
    /// does not know yet.
    pub(crate) fn handle_assign(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let m = Assign::decode(body)?;
        let core = self.core;
        let dir = core.directory();
        let Some(index) = core.id_index(m.table) else {
            return Err(Error::Protocol(format!("ASSIGN for table {}, which is not dynamic", m.table)));
        };
        let Some(intent) = Intent::of(m.flags) else {
            return Err(Error::Protocol(format!("ASSIGN with flags {:#x}", m.flags)));
        };
        let ids: Vec<u64> = m.values().collect();
        let (mut keys, mut answer) = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
        let (here, elsewhere): (Vec<usize>, Vec<usize>) = (0..ids.len()).partition(|&i| dir.id_home(index.spec(), ids[i]) == dir.rank());
        let mine: Vec<u64> = here.iter().map(|&i| ids[i]).collect();
        core.assign_ids(m.table, &mine, intent, &mut keys)?;
        answer.resize(ids.len(), NOT_HOME);
        for (&i, key) in here.iter().zip(&keys) {
            answer[i] = wire_value(*key);
        }
        if !elsewhere.is_empty() {
            tracing::warn!(node = dir.rank(), from, table = m.table, ids = elsewhere.len(), "ASSIGN of ids homed elsewhere");
        }
        let bytes = encode(self.tx.buf(from), msg::ASSIGNED, 0, m.table, m.request, answer.into_iter());
        self.tx.sent(from, MessageKind::Response, bytes);
        Ok(())
    }

    /// An ASSIGNED from `from`: hands it to the worker that waits for it.
    pub(crate) fn handle_assigned(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let m = Assign::decode(body)?;
        let core = self.core;
        let Some(meta) = core.directory().table(m.table).filter(|_| core.id_index(m.table).is_some()) else {
            return Err(Error::Protocol(format!("ASSIGNED for table {}, which is not dynamic", m.table)));
        };
        if let Some(key) = m.values().find(|&k| k >= meta.keys && k != FULL && k != NOT_HOME && k != NOT_ADMITTED) {
            return Err(Error::Protocol(format!("ASSIGNED from node {from} names slot key {key} beyond table {}", m.table)));
        }
        core.assignments().post(from, m.request, m.values().collect());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message's values come back as sent, and a body whose length disagrees with its
    /// count is refused before anything is read or allocated from the count.
    #[test]
    fn messages_round_trip_and_bad_lengths_are_refused() {
        let mut out = Vec::new();
        encode(&mut out, msg::ASSIGN, 1, 3, 77, [5u64, u64::MAX, 0].into_iter());
        let body = &out[4..];
        let m = Assign::decode(body).unwrap();
        assert_eq!((m.flags, m.table, m.request, m.values().collect::<Vec<_>>()), (1, 3, 77, vec![5, u64::MAX, 0]));
        assert!(Assign::decode(&body[..body.len() - 1]).is_err());
        assert!(Assign::decode(&body[..HEADER - 1]).is_err());
        let mut lying = body.to_vec();
        lying[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Assign::decode(&lying).is_err());
    }
}
