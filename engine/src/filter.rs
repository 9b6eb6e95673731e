//! User-defined filters on pushes (the parameter server, OSDI 2014, Section 3.6).
//!
//! A filter decides per key whether an update is worth a message now. Updates it holds back are
//! not lost: they accumulate in the worker's residual for the key and go out, summed, once the
//! filter admits the key or at [`FilteredPusher::flush`] (before an evaluation, at the end of an
//! epoch). Two filters come with Ferry:
//!
//! * [`Significance`]: an update is significant when some element's accumulated change reaches a
//!   fraction of the value's magnitude ("significantly modified", Section 3.6);
//! * [`Kkt`]: for L1-regularised models whose pushes are gradients: a weight that is zero and
//!   whose accumulated gradient stays within the L1 penalty satisfies the optimality (KKT)
//!   condition, so the update would not move it and is held back.
//!
//! Filters are worker-side: a [`FilteredPusher`] wraps a worker's pushes to one table. The
//! significance test needs the values; the trainer passes the ones it pulled for the step.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::{Table, Worker};

/// Decides whether a key's accumulated update is sent now.
pub trait PushFilter: Send {
    /// `update` is the key's accumulated unsent update (this step's included), `value` the
    /// key's value as the worker last saw it (`value_len` floats, or empty when unknown).
    fn admit(&mut self, key: u64, update: &[f32], value: &[f32]) -> bool;
}

impl<F: PushFilter + ?Sized> PushFilter for Box<F> {
    fn admit(&mut self, key: u64, update: &[f32], value: &[f32]) -> bool {
        (**self).admit(key, update, value)
    }
}

/// Sends an update when some element's accumulated change is at least `threshold` × the
/// magnitude of that element of the value (and at least `floor`, so that values near zero do
/// not admit every tiny change).
#[derive(Debug, Clone, Copy)]
pub struct Significance {
    /// Relative threshold (e.g. 0.05: a 5 % change).
    pub threshold: f32,
    /// Absolute threshold under which no change is significant.
    pub floor: f32,
}

impl PushFilter for Significance {
    fn admit(&mut self, _: u64, update: &[f32], value: &[f32]) -> bool {
        if value.len() != update.len() {
            return true;
        }
        update.iter().zip(value).any(|(u, v)| u.abs() >= self.floor && u.abs() >= self.threshold * v.abs())
    }
}

/// Holds back gradients of zero weights that the L1 penalty `l1` keeps at zero (KKT condition
/// `|g| ≤ λ₁` at `w = 0`).
#[derive(Debug, Clone, Copy)]
pub struct Kkt {
    /// The L1 penalty λ₁ the server-side updater applies.
    pub l1: f32,
}

impl PushFilter for Kkt {
    fn admit(&mut self, _: u64, update: &[f32], value: &[f32]) -> bool {
        value.len() != update.len() || update.iter().zip(value).any(|(g, w)| *w != 0.0 || g.abs() > self.l1)
    }
}

/// What a [`FilteredPusher`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FilterStats {
    /// Key updates offered by the trainer.
    pub offered: u64,
    /// Key updates sent (each possibly the sum of several offered).
    pub sent: u64,
    /// Key updates held back (at the time they were offered).
    pub held: u64,
}

/// A worker's filtered pushes to one table.
pub struct FilteredPusher<F: PushFilter> {
    table: Table,
    filter: F,
    /// Per key seen: whether something is held back, and the held-back sum (entries stay, so a
    /// key's buffer is allocated once).
    residual: HashMap<u64, (bool, Vec<f32>)>,
    keys: Vec<u64>,
    updates: Vec<f32>,
    stats: FilterStats,
}

impl<F: PushFilter> FilteredPusher<F> {
    /// Filtered pushes to `table` through `filter`.
    pub fn new(table: Table, filter: F) -> FilteredPusher<F> {
        FilteredPusher { table, filter, residual: HashMap::new(), keys: Vec::new(), updates: Vec::new(), stats: FilterStats::default() }
    }

    /// Offers `updates` of `keys` (`keys × value_len`; `values` the keys' values as pulled for
    /// this step, same shape, or empty): sends those the filter admits (with what was held back
    /// for them before) in one push, holds the others.
    pub fn push(&mut self, worker: &mut Worker, keys: &[u64], updates: &[f32], values: &[f32]) -> Result<()> {
        let len = self.table.value_len;
        if updates.len() != keys.len() * len {
            return Err(Error::WrongLength { what: "filtered push updates", expected: keys.len() * len, got: updates.len() });
        }
        if !values.is_empty() && values.len() != updates.len() {
            return Err(Error::WrongLength { what: "filtered push values", expected: updates.len(), got: values.len() });
        }
        self.keys.clear();
        self.updates.clear();
        for (i, &key) in keys.iter().enumerate() {
            let update = &updates[i * len..(i + 1) * len];
            let value = if values.is_empty() { &[][..] } else { &values[i * len..(i + 1) * len] };
            self.stats.offered += 1;
            let (held, pending) = self.residual.entry(key).or_insert_with(|| (false, vec![0.0; len]));
            for (p, u) in pending.iter_mut().zip(update) {
                *p += u;
            }
            if self.filter.admit(key, pending, value) {
                self.keys.push(key);
                self.updates.extend_from_slice(pending);
                pending.fill(0.0);
                *held = false;
                self.stats.sent += 1;
            } else {
                *held = true;
                self.stats.held += 1;
            }
        }
        if self.keys.is_empty() {
            return Ok(());
        }
        worker.push(self.table, &self.keys, &self.updates)
    }

    /// Sends everything held back.
    pub fn flush(&mut self, worker: &mut Worker) -> Result<()> {
        self.keys.clear();
        self.updates.clear();
        for (&key, (held, pending)) in self.residual.iter_mut().filter(|(_, (held, _))| *held) {
            self.keys.push(key);
            self.updates.extend_from_slice(pending);
            pending.fill(0.0);
            *held = false;
        }
        if self.keys.is_empty() {
            return Ok(());
        }
        self.stats.sent += self.keys.len() as u64;
        worker.push(self.table, &self.keys, &self.updates)
    }

    /// Keys with updates held back now.
    pub fn held_keys(&self) -> usize {
        self.residual.values().filter(|(held, _)| *held).count()
    }

    /// What it did so far.
    pub fn stats(&self) -> FilterStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn significance_compares_with_the_value() {
        let mut f = Significance { threshold: 0.1, floor: 1e-3 };
        assert!(!f.admit(0, &[0.05, 0.0], &[1.0, 1.0]));
        assert!(f.admit(0, &[0.05, 0.2], &[1.0, 1.0]));
        assert!(f.admit(0, &[0.01], &[0.0]), "any change of a zero value above the floor");
        assert!(!f.admit(0, &[1e-4], &[0.0]), "below the floor");
        assert!(f.admit(0, &[1e-4], &[]), "value unknown: sent");
    }

    #[test]
    fn kkt_holds_back_zero_weights_within_the_penalty() {
        let mut f = Kkt { l1: 0.5 };
        assert!(!f.admit(0, &[0.3], &[0.0]));
        assert!(f.admit(0, &[0.7], &[0.0]));
        assert!(f.admit(0, &[0.1], &[0.2]), "a non-zero weight always moves");
    }
}
