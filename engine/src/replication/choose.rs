//! Choosing the management technique per key: NuPS's frequency heuristic (Section 5.1)
//! replicates a key when it is accessed more than a factor (100 in the paper's untuned setting)
//! times the mean key's frequency; the long tail stays relocated.

use std::ops::Range;

/// Access counts per key of one table: given by the caller (dataset statistics) or counted
/// during a warm-up pass over the data.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessCounts {
    counts: Vec<u64>,
}

impl AccessCounts {
    /// Zero counts for `keys` keys.
    pub fn new(keys: u64) -> AccessCounts {
        AccessCounts { counts: vec![0; keys as usize] }
    }

    /// Counts given per key.
    pub fn from_counts(counts: Vec<u64>) -> AccessCounts {
        AccessCounts { counts }
    }

    /// Counts `n` more accesses of `key` (keys beyond the table are ignored).
    pub fn add(&mut self, key: u64, n: u64) {
        if let Some(c) = self.counts.get_mut(key as usize) {
            *c += n;
        }
    }

    /// The count of `key`.
    pub fn get(&self, key: u64) -> u64 {
        self.counts.get(key as usize).copied().unwrap_or(0)
    }

    /// Mean accesses per key.
    pub fn mean(&self) -> f64 {
        if self.counts.is_empty() { 0.0 } else { self.counts.iter().sum::<u64>() as f64 / self.counts.len() as f64 }
    }

    /// The keys the heuristic replicates: accessed more than `factor` × the mean.
    pub fn hot(&self, factor: f64) -> Vec<u64> {
        hot_keys(&self.counts, factor)
    }

    /// The `n` most accessed keys (ties broken by key), in key order.
    pub fn top(&self, n: usize) -> Vec<u64> {
        let mut order: Vec<u64> = (0..self.counts.len() as u64).filter(|&k| self.counts[k as usize] > 0).collect();
        order.sort_by(|&a, &b| self.counts[b as usize].cmp(&self.counts[a as usize]).then(a.cmp(&b)));
        order.truncate(n);
        order.sort_unstable();
        order
    }

    /// Share of all accesses that go to `keys`.
    pub fn share(&self, keys: &[u64]) -> f64 {
        let total: u64 = self.counts.iter().sum();
        if total == 0 { 0.0 } else { keys.iter().map(|&k| self.get(k)).sum::<u64>() as f64 / total as f64 }
    }
}

/// Keys (in order) whose count exceeds `factor` × the mean count over all keys.
pub fn hot_keys(counts: &[u64], factor: f64) -> Vec<u64> {
    if counts.is_empty() {
        return Vec::new();
    }
    let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
    let threshold = factor * mean;
    (0..counts.len() as u64).filter(|&k| counts[k as usize] as f64 > threshold).collect()
}

/// Keys as the fewest half-open ranges (for [`crate::TableSpec::replicating`]).
pub fn as_ranges(keys: &[u64]) -> Vec<Range<u64>> {
    let mut sorted = keys.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut ranges: Vec<Range<u64>> = Vec::new();
    for k in sorted {
        match ranges.last_mut() {
            Some(r) if r.end == k => r.end += 1,
            _ => ranges.push(k..k + 1),
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heuristic_picks_keys_above_factor_times_mean() {
        let mut counts = vec![1u64; 1000];
        counts[7] = 500;
        counts[300] = 90;
        let c = AccessCounts::from_counts(counts);
        // mean = (998 + 590) / 1000 = 1.588
        assert_eq!(c.hot(100.0), vec![7]);
        assert_eq!(c.hot(50.0), vec![7, 300]);
        assert_eq!(c.top(2), vec![7, 300]);
        assert!((c.share(&[7]) - 500.0 / 1588.0).abs() < 1e-9);
        assert!(hot_keys(&[], 1.0).is_empty());
    }

    #[test]
    fn ranges_merge_neighbours() {
        assert_eq!(as_ranges(&[5, 1, 2, 3, 9, 5]), vec![1..4, 5..6, 9..10]);
    }
}
