//! Sampling access (NuPS, SIGMOD 2022, section 4): workers ask for samples from a distribution
//! over keys instead of drawing keys themselves, so Ferry can choose where the sampled values
//! come from.
//!
//! A worker registers a distribution over a key range of a table together with a sampling
//! scheme ([`crate::Worker::register_distribution`]), asks for `n` samples
//! ([`crate::Worker::prepare_sample`], which returns at once and starts moving the sampled keys
//! here), and later takes the keys and their values, all at once or in portions
//! ([`crate::Worker::pull_sample`]). The four schemes of NuPS 4.4 trade sample quality for
//! communication, each at a conformity level of NuPS 4.1 ([`Conformity`]):
//!
//! | scheme | level | what it does |
//! | --- | --- | --- |
//! | [`SamplingScheme::Independent`] | L1 conform | draws i.i.d. from the distribution; `prepare_sample` localizes the draws, `pull_sample` pulls them (remotely if they moved away meanwhile) |
//! | [`SamplingScheme::Reuse`] | L2 bounded | draws pools of `pool` keys i.i.d. and hands each pool out `uses` times, each time in a fresh random order; pools are drawn and localized one pool ahead |
//! | [`SamplingScheme::ReusePostponing`] | L3 long-term | as `Reuse`, but a sample not held here at `pull_sample` is moved to the end of its handle once (and localized meanwhile) |
//! | [`SamplingScheme::Local`] | L4 non-conform | draws only among keys held by this node, weighted by the distribution restricted to them; never touches the network while the node holds any key of the range (a node holding none draws from the whole distribution and pulls, counted as `remote`) |
//!
//! Sampler state belongs to the worker that registered it: no locks, no shared queues. Draws
//! are seeded from the node's rank, the worker's number and the distribution's number, so a run
//! is reproducible given the same placement.

pub(crate) mod alias;

use crate::error::{Error, Result};
use crate::table::Table;

/// How closely the samples follow the target distribution (NuPS 4.1). Each level implies the
/// ones below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Conformity {
    /// L1: mutually independent samples from the target distribution.
    Conform,
    /// L2: each sample follows the target distribution; dependencies between a node's samples
    /// are bounded (by `pool × uses` for sample reuse), samples at different nodes independent.
    Bounded,
    /// L3: the long-run relative frequencies at each node match the target distribution.
    LongTerm,
    /// L4: no guarantee.
    NonConform,
}

impl Conformity {
    /// The level's name in NuPS (`L1`–`L4`).
    pub fn label(self) -> &'static str {
        match self {
            Conformity::Conform => "L1",
            Conformity::Bounded => "L2",
            Conformity::LongTerm => "L3",
            Conformity::NonConform => "L4",
        }
    }
}

/// How samples are produced (NuPS 4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SamplingScheme {
    /// I.i.d. draws, each used once ([`Conformity::Conform`]).
    Independent,
    /// Pools of `pool` i.i.d. draws, each pool handed out `uses` times in fresh random orders
    /// ([`Conformity::Bounded`]).
    Reuse {
        /// Keys drawn per pool.
        pool: usize,
        /// How often each pool is handed out.
        uses: usize,
    },
    /// [`SamplingScheme::Reuse`] plus postponing: a sample not held here when it is pulled is
    /// moved once to the end of its handle ([`Conformity::LongTerm`]).
    ReusePostponing {
        /// Keys drawn per pool.
        pool: usize,
        /// How often each pool is handed out.
        uses: usize,
    },
    /// Draws only among the keys this node holds ([`Conformity::NonConform`]); a node that holds
    /// none of the range draws from the whole distribution instead.
    Local,
}

impl SamplingScheme {
    /// Pool size of the reuse schemes when chosen by level.
    pub const DEFAULT_POOL: usize = 1024;
    /// Use frequency of the reuse schemes when chosen by level.
    pub const DEFAULT_USES: usize = 4;

    /// The conformity level this scheme provides.
    pub fn conformity(&self) -> Conformity {
        match self {
            SamplingScheme::Independent => Conformity::Conform,
            SamplingScheme::Reuse { .. } => Conformity::Bounded,
            SamplingScheme::ReusePostponing { .. } => Conformity::LongTerm,
            SamplingScheme::Local => Conformity::NonConform,
        }
    }

    /// The cheapest scheme that provides `level` (NuPS's sampling manager), with the default
    /// pool size and use frequency for the reuse schemes.
    pub fn for_level(level: Conformity) -> SamplingScheme {
        let (pool, uses) = (Self::DEFAULT_POOL, Self::DEFAULT_USES);
        match level {
            Conformity::Conform => SamplingScheme::Independent,
            Conformity::Bounded => SamplingScheme::Reuse { pool, uses },
            Conformity::LongTerm => SamplingScheme::ReusePostponing { pool, uses },
            Conformity::NonConform => SamplingScheme::Local,
        }
    }

    /// Parses `independent`, `reuse[:POOL:USES]`, `postpone[:POOL:USES]`, `local`, or a level
    /// `L1`–`L4`.
    pub fn parse(text: &str) -> Result<SamplingScheme> {
        let mut parts = text.split(':');
        let name = parts.next().unwrap_or_default().to_ascii_lowercase();
        let numbers: Vec<&str> = parts.collect();
        let sizes = |numbers: &[&str]| -> Result<(usize, usize)> {
            match numbers {
                [] => Ok((Self::DEFAULT_POOL, Self::DEFAULT_USES)),
                [pool, uses] => {
                    let number =
                        |s: &str, what: &str| s.parse::<usize>().map_err(|_| Error::Sampling(format!("{what} '{s}' in scheme '{text}' is not a number")));
                    Ok((number(pool, "pool size")?, number(uses, "use frequency")?))
                }
                _ => Err(Error::Sampling(format!("scheme '{text}': give both pool size and use frequency, as reuse:1024:4"))),
            }
        };
        let scheme = match name.as_str() {
            "independent" | "l1" if numbers.is_empty() => SamplingScheme::Independent,
            "local" | "l4" if numbers.is_empty() => SamplingScheme::Local,
            "l2" | "l3" if numbers.is_empty() => SamplingScheme::for_level(if name == "l2" { Conformity::Bounded } else { Conformity::LongTerm }),
            "reuse" => {
                let (pool, uses) = sizes(&numbers)?;
                SamplingScheme::Reuse { pool, uses }
            }
            "postpone" | "reuse-postponing" => {
                let (pool, uses) = sizes(&numbers)?;
                SamplingScheme::ReusePostponing { pool, uses }
            }
            _ => {
                return Err(Error::Sampling(format!(
                    "unknown sampling scheme '{text}' (independent, reuse[:POOL:USES], postpone[:POOL:USES], local, or L1–L4)"
                )));
            }
        };
        scheme.validate()?;
        Ok(scheme)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if let SamplingScheme::Reuse { pool, uses } | SamplingScheme::ReusePostponing { pool, uses } = *self {
            if pool == 0 || uses == 0 {
                return Err(Error::Sampling(format!("pool size ({pool}) and use frequency ({uses}) must both be at least 1")));
            }
            if pool.saturating_mul(uses) > 1 << 28 {
                return Err(Error::Sampling(format!("a pool of {pool} keys used {uses} times is too large (at most 2^28 samples)")));
            }
        }
        Ok(())
    }
}

/// A target distribution over a contiguous range of a table's keys.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyDistribution {
    /// Every key of `start..end` equally likely.
    Uniform {
        /// First key.
        start: u64,
        /// One past the last key.
        end: u64,
    },
    /// Key `start + i` with probability proportional to `weights[i]` (non-negative, finite,
    /// positive sum).
    Weighted {
        /// First key.
        start: u64,
        /// One weight per key.
        weights: Vec<f64>,
    },
}

impl KeyDistribution {
    /// Uniform over `keys`.
    pub fn uniform(keys: std::ops::Range<u64>) -> KeyDistribution {
        KeyDistribution::Uniform { start: keys.start, end: keys.end }
    }

    /// The keys the distribution covers.
    pub fn range(&self) -> std::ops::Range<u64> {
        match self {
            KeyDistribution::Uniform { start, end } => *start..*end,
            KeyDistribution::Weighted { start, weights } => *start..start.saturating_add(weights.len() as u64),
        }
    }

    /// The probability of `key` (0 outside the range).
    pub fn probability(&self, key: u64) -> f64 {
        let range = self.range();
        if !range.contains(&key) {
            return 0.0;
        }
        match self {
            KeyDistribution::Uniform { start, end } => 1.0 / (end - start) as f64,
            KeyDistribution::Weighted { start, weights } => weights[(key - start) as usize] / weights.iter().sum::<f64>(),
        }
    }
}

/// A registered distribution of one worker; pass it to [`crate::Worker::prepare_sample`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DistributionId {
    pub(crate) worker: u16,
    pub(crate) index: u32,
}

/// What one registered distribution has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SamplingStats {
    /// Samples handed out by `pull_sample`.
    pub samples: u64,
    /// Of those, served from this node's memory.
    pub local: u64,
    /// Of those, pulled from another node.
    pub remote: u64,
    /// Samples moved to the end of their handle because they were not here (postponing).
    pub postponed: u64,
    /// Keys this distribution asked to localize.
    pub localized: u64,
    /// Pools drawn (reuse schemes).
    pub pools: u64,
    /// Times the list of locally held keys was rebuilt (local sampling).
    pub local_rebuilds: u64,
    /// Local sampling: drawn keys that had left this node by the time they were pulled, each
    /// replaced by another local draw.
    pub replaced: u64,
}

pub(crate) fn check_distribution(table: Table, dist: &KeyDistribution, table_name: &str) -> Result<()> {
    let range = dist.range();
    if range.is_empty() {
        return Err(Error::Sampling(format!("the distribution's key range {range:?} is empty")));
    }
    if range.end > table.keys() || range.start >= table.keys() {
        return Err(Error::Sampling(format!("the distribution's keys {range:?} are outside table '{table_name}' (keys 0..{})", table.keys())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_parse_and_carry_their_level() {
        assert_eq!(SamplingScheme::parse("independent").unwrap(), SamplingScheme::Independent);
        assert_eq!(SamplingScheme::parse("reuse:16:3").unwrap(), SamplingScheme::Reuse { pool: 16, uses: 3 });
        assert_eq!(SamplingScheme::parse("postpone").unwrap().conformity(), Conformity::LongTerm);
        assert_eq!(SamplingScheme::parse("L4").unwrap(), SamplingScheme::Local);
        assert_eq!(SamplingScheme::parse("l2").unwrap().conformity().label(), "L2");
        for bad in ["", "reuse:0:3", "reuse:4", "reuse:x:2", "local:3", "sometimes"] {
            assert!(SamplingScheme::parse(bad).is_err(), "{bad}");
        }
        for level in [Conformity::Conform, Conformity::Bounded, Conformity::LongTerm, Conformity::NonConform] {
            assert_eq!(SamplingScheme::for_level(level).conformity(), level);
        }
    }

    #[test]
    fn probabilities() {
        let d = KeyDistribution::Weighted { start: 10, weights: vec![1.0, 3.0] };
        assert_eq!(d.range(), 10..12);
        assert_eq!(d.probability(11), 0.75);
        assert_eq!(d.probability(12), 0.0);
        assert_eq!(KeyDistribution::uniform(0..4).probability(3), 0.25);
    }
}
