//! A worker's calls on a feature-hashed table ([`crate::hashing`]): raw ids mapped to buckets
//! (and the values of signed tables multiplied by each id's sign) in buffers the worker keeps,
//! then the same call on the buckets.

use super::{PullTicket, Worker};
use crate::error::Result;
use crate::hashing::FeatureHashing;
use crate::table::Table;

impl Worker {
    /// Runs `op` on the buckets of `ids` through the table's bucket handle, with `input` (a
    /// row per id, or empty) multiplied by each id's sign for a signed table. The buffers are
    /// the worker's, kept between calls: no allocation once they are large enough.
    pub(super) fn through_buckets<R>(
        &mut self,
        table: Table,
        hashing: FeatureHashing,
        ids: &[u64],
        input: &[f32],
        op: impl FnOnce(&mut Worker, Table, &[u64], &[f32]) -> Result<R>,
    ) -> Result<R> {
        if let [id] = ids
            && !hashing.signed
        {
            // One id: its bucket on the stack.
            return op(self, table.buckets(), &[hashing.bucket(*id, table.keys)], input);
        }
        let mut buckets = std::mem::take(&mut self.hashed_keys);
        buckets.clear();
        buckets.extend(ids.iter().map(|&id| hashing.bucket(id, table.keys)));
        let mut signed = std::mem::take(&mut self.hashed_values);
        signed.clear();
        let input = if hashing.signed && !input.is_empty() {
            for (row, &id) in input.chunks(table.value_len.max(1)).zip(ids) {
                let sign = hashing.sign(id);
                signed.extend(row.iter().map(|v| v * sign));
            }
            &signed[..]
        } else {
            input
        };
        let result = op(self, table.buckets(), &buckets, input);
        self.hashed_keys = buckets;
        self.hashed_values = signed;
        result
    }

    /// Multiplies each row of `out` (one per id) by its id's sign, for a signed table.
    pub(super) fn sign_rows(hashing: FeatureHashing, value_len: usize, ids: &[u64], out: &mut [f32]) {
        if !hashing.signed {
            return;
        }
        for (row, &id) in out.chunks_mut(value_len.max(1)).zip(ids) {
            if hashing.sign(id) < 0.0 {
                row.iter_mut().for_each(|v| *v = -*v);
            }
        }
    }

    /// An asynchronous pull (or push-pull) of a feature-hashed table: a signed table's ticket
    /// keeps the ids, whose signs [`Worker::wait_pull`] applies to the values.
    pub(super) fn hashed_pull_async(
        &mut self,
        table: Table,
        hashing: FeatureHashing,
        ids: &[u64],
        input: &[f32],
        start: impl FnOnce(&mut Worker, Table, &[u64], &[f32]) -> Result<PullTicket>,
    ) -> Result<PullTicket> {
        let mut ticket = self.through_buckets(table, hashing, ids, input, start)?;
        if hashing.signed {
            ticket.signs = Some(SignedRows { hashing, value_len: table.value_len, ids: ids.to_vec() });
        }
        Ok(ticket)
    }
}

/// What an asynchronous pull of a signed feature-hashed table needs to sign its rows once the
/// values are in ([`Worker::sign_rows`], the same as a synchronous pull's).
pub(super) struct SignedRows {
    pub(super) hashing: FeatureHashing,
    pub(super) value_len: usize,
    pub(super) ids: Vec<u64>,
}
