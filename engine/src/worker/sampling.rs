//! One registered distribution's state and the worker calls that use it (the distributions,
//! schemes and handles are in [`crate::sampling`]).

use std::collections::VecDeque;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{Ticket, Worker};
use crate::error::{Error, Result};
use crate::sampling::alias::AliasTable;
use crate::sampling::{DistributionId, KeyDistribution, SamplingScheme, SamplingStats, check_distribution};
use crate::table::Table;

/// Most samples one `prepare_sample` may ask for.
const MAX_SAMPLES: usize = 1 << 28;
/// Draws tried among the locally held keys before the list of them is rebuilt.
const LOCAL_TRIES: usize = 64;

/// Samples prepared by [`crate::Worker::prepare_sample`], taken with
/// [`crate::Worker::pull_sample`] in one or several portions.
#[must_use = "prepared samples are only used by pulling them"]
pub struct SampleHandle {
    pub(crate) dist: DistributionId,
    /// Keys still to hand out, with whether each was postponed already.
    pub(crate) keys: std::collections::VecDeque<(u64, bool)>,
    pub(crate) total: usize,
    /// The localize started for these samples, if any.
    pub(crate) localizing: Option<Ticket>,
}

impl SampleHandle {
    /// Samples not yet pulled.
    pub fn remaining(&self) -> usize {
        self.keys.len()
    }

    /// Samples prepared in all.
    pub fn len(&self) -> usize {
        self.total
    }

    /// Whether the handle was prepared for no samples.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The distribution the samples come from.
    pub fn distribution(&self) -> DistributionId {
        self.dist
    }
}

/// A registered distribution: what to draw from, how, and what is prepared already.
pub(crate) struct Sampler {
    table: Table,
    start: u64,
    len: u64,
    /// Weights per key of the range; `None` for a uniform distribution.
    weights: Option<Vec<f64>>,
    /// Draws over the range; `None` for a uniform distribution.
    alias: Option<AliasTable>,
    scheme: SamplingScheme,
    rng: ChaCha8Rng,
    /// Reuse schemes: samples drawn (and localized) ahead, in hand-out order.
    stream: VecDeque<u64>,
    /// Localizes started for pools or postponed samples, reaped as they finish.
    pending: Vec<Ticket>,
    /// Local sampling: the keys this node held when last looked at.
    local: Option<LocalKeys>,
    stats: SamplingStats,
}

/// Draws per key of the range that must pass before the list of local keys is built again
/// because draws keep missing (see [`Sampler::rebuild_affordable`]).
const REBUILD_DRAWS: u64 = 2;

/// The keys of the range held here, with draws over their (restricted) weights.
struct LocalKeys {
    keys: Vec<u64>,
    alias: Option<AliasTable>,
    /// Draws since the list was built, and how many of them had moved away.
    draws: u64,
    misses: u64,
}

impl Sampler {
    fn draw(&mut self) -> u64 {
        let offset = match &self.alias {
            Some(alias) => alias.draw(&mut self.rng) as u64,
            None => self.rng.gen_range(0..self.len),
        };
        self.start + offset
    }

    /// Draws one pool and appends its `uses` traversals, each in a fresh random order; returns
    /// the pool's distinct keys.
    fn draw_pool(&mut self, pool: usize, uses: usize) -> Vec<u64> {
        let mut keys: Vec<u64> = (0..pool).map(|_| self.draw()).collect();
        for _ in 0..uses {
            keys.shuffle(&mut self.rng);
            self.stream.extend(keys.iter().copied());
        }
        self.stats.pools += 1;
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// Whether the list of locally held keys should be built again before drawing from it.
    fn local_list_stale(&self) -> bool {
        match &self.local {
            None => true,
            // An empty list is looked at again after as many draws as a full one (fallback draws
            // count), so a node holding nothing does not rescan the range every time.
            Some(l) => l.draws >= self.len.max(1024) || (self.rebuild_affordable() && l.misses * 10 > l.draws),
        }
    }

    /// Whether enough draws came since the list was built to pay for building it again: a
    /// rebuild scans the whole range, so it may come at most once per `range / REBUILD_DRAWS`
    /// draws (a few key lookups per draw). Without this bound a node whose keys keep moving
    /// (intent mode relocates them all the time) rebuilt after every 128 draws, and the scans
    /// took more CPU than the training.
    fn rebuild_affordable(&self) -> bool {
        self.local.as_ref().is_none_or(|l| l.draws >= (self.len / REBUILD_DRAWS).max(128))
    }

    fn draw_local(&mut self) -> Option<u64> {
        let local = self.local.as_mut()?;
        if local.keys.is_empty() {
            local.draws += 1;
            return None;
        }
        let i = match &local.alias {
            Some(alias) => alias.draw(&mut self.rng),
            None => self.rng.gen_range(0..local.keys.len()),
        };
        local.draws += 1;
        Some(local.keys[i])
    }
}

impl Worker {
    /// Registers a distribution over keys of `table` to draw samples from with `scheme`
    /// (NuPS's `register_distribution`). Distributions belong to this worker.
    pub fn register_distribution(&mut self, table: Table, dist: KeyDistribution, scheme: SamplingScheme) -> Result<DistributionId> {
        let name = self.checked_table_name(table)?;
        if table.hashing.is_some() {
            return Err(Error::Sampling(format!(
                "table '{name}' is feature-hashed: a distribution over its keys would draw buckets, not ids (sample ids yourself and pull them)"
            )));
        }
        check_distribution(table, &dist, &name)?;
        scheme.validate()?;
        let range = dist.range();
        let (weights, alias) = match dist {
            KeyDistribution::Uniform { .. } => (None, None),
            KeyDistribution::Weighted { weights, .. } => {
                let alias = AliasTable::new(&weights)?;
                (Some(weights), Some(alias))
            }
        };
        let index = self.samplers.len() as u32;
        let seed = ((self.rank() as u64) << 40) ^ ((self.id() as u64) << 20) ^ u64::from(index) ^ 0x5eed_f3e7_0000_0000;
        self.samplers.push(Sampler {
            table,
            start: range.start,
            len: range.end - range.start,
            weights,
            alias,
            scheme,
            rng: ChaCha8Rng::seed_from_u64(seed),
            stream: VecDeque::new(),
            pending: Vec::new(),
            local: None,
            stats: SamplingStats::default(),
        });
        Ok(DistributionId { worker: self.id() as u16, index })
    }

    /// Prepares `n` samples from `dist` (NuPS's `PrepareSample`): draws the keys and starts
    /// moving them here where the scheme says so; returns at once.
    pub fn prepare_sample(&mut self, dist: DistributionId, n: usize) -> Result<SampleHandle> {
        let index = self.sampler_index(dist)?;
        if n > MAX_SAMPLES {
            return Err(Error::Sampling(format!("{n} samples asked for at once; at most {MAX_SAMPLES}")));
        }
        let mut samplers = std::mem::take(&mut self.samplers);
        let result = self.prepare_with(&mut samplers[index], dist, n);
        self.samplers = samplers;
        result
    }

    /// Takes the next `keys.len()` samples of `handle`: their keys into `keys` and their values
    /// into `values` (`keys.len() × value_len` floats) (NuPS's `PullSample`). Call it once for
    /// all samples or several times for portions.
    pub fn pull_sample(&mut self, handle: &mut SampleHandle, keys: &mut [u64], values: &mut [f32]) -> Result<()> {
        let index = self.sampler_index(handle.dist)?;
        let table = self.samplers[index].table;
        if keys.len() > handle.remaining() {
            return Err(Error::Sampling(format!("{} samples asked for, {} remain in the handle", keys.len(), handle.remaining())));
        }
        let expected = keys.len() * table.value_len();
        if values.len() != expected {
            return Err(Error::WrongLength { what: "sample values", expected, got: values.len() });
        }
        if let Some(ticket) = handle.localizing.take() {
            if self.is_done(&ticket) {
                self.wait(ticket)?;
            } else {
                handle.localizing = Some(ticket);
            }
        }
        let mut samplers = std::mem::take(&mut self.samplers);
        let result = self.pull_with(&mut samplers[index], handle, keys, values);
        self.samplers = samplers;
        result
    }

    /// What the distribution has done so far.
    pub fn sampling_stats(&self, dist: DistributionId) -> Result<SamplingStats> {
        Ok(self.samplers[self.sampler_index(dist)?].stats)
    }

    fn sampler_index(&self, dist: DistributionId) -> Result<usize> {
        if dist.worker as usize != self.id() {
            return Err(Error::Sampling(format!("distribution of worker {} used by worker {}", dist.worker, self.id())));
        }
        let index = dist.index as usize;
        if index >= self.samplers.len() {
            return Err(Error::Sampling(format!("no distribution #{index} registered by worker {}", self.id())));
        }
        Ok(index)
    }

    /// Waits for localizes that have finished, so their errors surface; keeps the others.
    fn reap(&mut self, s: &mut Sampler) -> Result<()> {
        let mut first_error = None;
        for ticket in std::mem::take(&mut s.pending) {
            if self.is_done(&ticket) {
                if let Err(e) = self.wait(ticket) {
                    first_error.get_or_insert(e);
                }
            } else {
                s.pending.push(ticket);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Starts localizing the keys among `keys` that are not here; returns the ticket if any.
    fn localize_missing(&mut self, s: &mut Sampler, keys: &[u64]) -> Result<Option<Ticket>> {
        if !self.relocation_enabled() {
            return Ok(None);
        }
        let mut missing: Vec<u64> = keys.iter().copied().filter(|&k| !self.holds(s.table, k)).collect();
        if missing.is_empty() {
            return Ok(None);
        }
        missing.sort_unstable();
        missing.dedup();
        s.stats.localized += missing.len() as u64;
        self.localize_async(s.table, &missing).map(Some)
    }

    fn prepare_with(&mut self, s: &mut Sampler, dist: DistributionId, n: usize) -> Result<SampleHandle> {
        self.reap(s)?;
        let mut localizing = None;
        let keys: VecDeque<(u64, bool)> = match s.scheme {
            SamplingScheme::Independent => {
                let keys: Vec<u64> = (0..n).map(|_| s.draw()).collect();
                localizing = self.localize_missing(s, &keys)?;
                keys.into_iter().map(|k| (k, false)).collect()
            }
            SamplingScheme::Reuse { pool, uses } | SamplingScheme::ReusePostponing { pool, uses } => {
                // Keep one whole pool's samples ahead of what is handed out, so a pool is
                // localized one preparation before its samples are pulled.
                let ahead = pool * uses;
                while s.stream.len() < n + ahead {
                    let distinct = s.draw_pool(pool, uses);
                    if let Some(ticket) = self.localize_missing(s, &distinct)? {
                        s.pending.push(ticket);
                    }
                }
                let keys: Vec<u64> = s.stream.drain(..n).collect();
                // Keys that moved away since their pool was localized come back (only once the
                // pools' own localizes finished: until then they are on their way).
                if s.pending.is_empty() {
                    localizing = self.localize_missing(s, &keys)?;
                }
                keys.into_iter().map(|k| (k, false)).collect()
            }
            SamplingScheme::Local => {
                if s.local_list_stale() {
                    self.rebuild_local(s);
                }
                // A node that holds none of the range draws from the whole distribution (and will
                // pull remotely): training goes on, the statistics show it.
                (0..n).map(|_| (s.draw_local().unwrap_or_else(|| s.draw()), false)).collect()
            }
        };
        Ok(SampleHandle { dist, total: keys.len(), keys, localizing })
    }

    fn pull_with(&mut self, s: &mut Sampler, handle: &mut SampleHandle, keys: &mut [u64], values: &mut [f32]) -> Result<()> {
        let n = keys.len();
        let value_len = s.table.value_len();
        match s.scheme {
            SamplingScheme::Independent | SamplingScheme::Reuse { .. } => {
                for (slot, (key, _)) in keys.iter_mut().zip(handle.keys.drain(..n)) {
                    *slot = key;
                }
                let local = keys.iter().filter(|&&k| self.holds(s.table, k)).count() as u64;
                s.stats.local += local;
                s.stats.remote += n as u64 - local;
                self.pull(s.table, keys, values)?;
            }
            SamplingScheme::ReusePostponing { .. } => {
                let mut remote_rows = Vec::new();
                let mut postponed = Vec::new();
                let mut row = 0;
                while row < n {
                    let Some((key, was_postponed)) = handle.keys.pop_front() else {
                        return Err(Error::Sampling("the handle ran out of samples".into()));
                    };
                    let out = &mut values[row * value_len..(row + 1) * value_len];
                    if self.pull_if_local(s.table, &[key], out)? {
                        s.stats.local += 1;
                    } else if !was_postponed {
                        // Not here: use it later (once), and bring it here meanwhile.
                        handle.keys.push_back((key, true));
                        postponed.push(key);
                        s.stats.postponed += 1;
                        continue;
                    } else {
                        remote_rows.push(row);
                    }
                    keys[row] = key;
                    row += 1;
                }
                if let Some(ticket) = self.localize_missing(s, &postponed)? {
                    s.pending.push(ticket);
                }
                if !remote_rows.is_empty() {
                    let remote_keys: Vec<u64> = remote_rows.iter().map(|&r| keys[r]).collect();
                    let mut remote_values = vec![0.0; remote_keys.len() * value_len];
                    self.pull(s.table, &remote_keys, &mut remote_values)?;
                    for (i, &r) in remote_rows.iter().enumerate() {
                        values[r * value_len..(r + 1) * value_len].copy_from_slice(&remote_values[i * value_len..(i + 1) * value_len]);
                    }
                    s.stats.remote += remote_rows.len() as u64;
                }
            }
            SamplingScheme::Local => {
                for row in 0..n {
                    let Some((mut key, _)) = handle.keys.pop_front() else {
                        return Err(Error::Sampling("the handle ran out of samples".into()));
                    };
                    let out = &mut values[row * value_len..(row + 1) * value_len];
                    let mut tries = 0;
                    // A key that left since it was drawn is replaced by another local draw: local
                    // sampling does not wait for the network while this node holds any key of the
                    // range.
                    let local = loop {
                        if self.pull_if_local(s.table, &[key], out)? {
                            break true;
                        }
                        if let Some(l) = s.local.as_mut() {
                            l.misses += 1;
                        }
                        tries += 1;
                        // One sample missing again and again means the list is mostly stale:
                        // that rebuild pays (unlike rebuilding for scattered misses).
                        if tries % LOCAL_TRIES == 0 {
                            self.rebuild_local(s);
                        }
                        match s.draw_local() {
                            Some(k) if tries <= 4 * LOCAL_TRIES => {
                                s.stats.replaced += 1;
                                key = k;
                            }
                            _ => break false,
                        }
                    };
                    if local {
                        s.stats.local += 1;
                    } else {
                        // Nothing of the range is here (or keeps being here): take the drawn key
                        // from wherever it is.
                        self.pull(s.table, &[key], out)?;
                        s.stats.remote += 1;
                    }
                    keys[row] = key;
                }
            }
        }
        s.stats.samples += n as u64;
        Ok(())
    }

    /// Lists the keys of the range held here, weighted by the distribution restricted to them.
    fn rebuild_local(&mut self, s: &mut Sampler) {
        s.stats.local_rebuilds += 1;
        let held = |k: &u64| self.holds(s.table, *k);
        let keys: Vec<u64> = match &s.weights {
            None => (s.start..s.start + s.len).filter(held).collect(),
            Some(w) => (s.start..s.start + s.len).filter(|&k| w[(k - s.start) as usize] > 0.0 && held(&k)).collect(),
        };
        let alias = s.weights.as_ref().and_then(|w| {
            let restricted: Vec<f64> = keys.iter().map(|&k| w[(k - s.start) as usize]).collect();
            AliasTable::new(&restricted).ok()
        });
        s.local = Some(LocalKeys { keys, alias, draws: 0, misses: 0 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_handed_out_uses_times_each() {
        let mut s = Sampler {
            table: Table::for_tests(100, 1),
            start: 0,
            len: 100,
            weights: None,
            alias: None,
            scheme: SamplingScheme::Reuse { pool: 5, uses: 3 },
            rng: ChaCha8Rng::seed_from_u64(1),
            stream: VecDeque::new(),
            pending: Vec::new(),
            local: None,
            stats: SamplingStats::default(),
        };
        s.draw_pool(5, 3);
        let drawn: Vec<u64> = s.stream.iter().copied().collect();
        assert_eq!(drawn.len(), 15);
        let mut first: Vec<u64> = drawn[..5].to_vec();
        first.sort_unstable();
        for pass in drawn.chunks(5) {
            let mut p = pass.to_vec();
            p.sort_unstable();
            assert_eq!(p, first, "every traversal holds the same pool");
        }
    }

    #[test]
    fn a_list_of_local_keys_is_rebuilt_for_misses_only_once_the_draws_pay_for_its_scan() {
        let sampler = |len: u64, draws: u64, misses: u64| Sampler {
            table: Table::for_tests(len, 1),
            start: 0,
            len,
            weights: None,
            alias: None,
            scheme: SamplingScheme::Local,
            rng: ChaCha8Rng::seed_from_u64(1),
            stream: VecDeque::new(),
            pending: Vec::new(),
            local: Some(LocalKeys { keys: vec![0], alias: None, draws, misses }),
            stats: SamplingStats::default(),
        };
        assert!(Sampler { local: None, ..sampler(10, 0, 0) }.local_list_stale(), "no list yet");
        // Half the draws missed, but 200 draws do not pay for scanning 10 000 keys.
        assert!(!sampler(10_000, 200, 100).local_list_stale());
        assert!(!sampler(10_000, 200, 100).rebuild_affordable());
        assert!(sampler(10_000, 10_000 / REBUILD_DRAWS, 600).local_list_stale(), "many misses, enough draws");
        assert!(!sampler(10_000, 10_000 / REBUILD_DRAWS, 10).local_list_stale(), "enough draws, few misses");
        assert!(sampler(10_000, 10_000, 0).local_list_stale(), "a full range's draws rebuild anyway");
        // A small range keeps the floor of 128 draws.
        assert!(!sampler(100, 127, 100).local_list_stale());
        assert!(sampler(100, 128, 100).local_list_stale());
    }
}
