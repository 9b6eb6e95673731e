//! Building blocks of intent signalling (AdaPM, *Good Intentions: Adaptive Parameter Management
//! via Intent Signaling*, CIKM 2023): when to act on an intent (Section 4.2, Algorithm 1) and a
//! node's aggregated intents (Appendix B.2).
//!
//! Not wired into the protocol yet: the intent API on `Worker`, the intent messages to home nodes
//! and the adaptive choice between relocation and replication (Section 4.1) are the rest of the
//! intent issue. These pieces are deterministic and have no clock of their own, so the protocol
//! can drive them from its communication rounds.

use std::collections::BTreeMap;

/// Adaptive action timing for one worker (Algorithm 1): estimates how many clocks the worker
/// completes per communication round and acts on an intent once the worker might reach the
/// intent's start within the next two rounds.
#[derive(Debug, Clone, PartialEq)]
pub struct ActionTiming {
    /// Smoothing factor α of the rate estimate.
    pub alpha: f64,
    /// Quantile `p` of the Poisson soft upper bound (AdaPM uses 0.9999).
    pub quantile: f64,
    estimate: f64,
    last_clock: Option<u64>,
    horizon: u64,
}

impl ActionTiming {
    /// AdaPM's untuned configuration: α = 0.1, p = 0.9999, initial estimate 10 clocks per round.
    pub fn adapm() -> ActionTiming {
        ActionTiming::new(0.1, 0.9999, 10.0)
    }

    /// Timing with smoothing `alpha`, quantile `quantile` and an initial estimate of `initial`
    /// clocks per round.
    pub fn new(alpha: f64, quantile: f64, initial: f64) -> ActionTiming {
        ActionTiming { alpha: alpha.clamp(0.0, 1.0), quantile: quantile.clamp(0.5, 1.0 - 1e-12), estimate: initial.max(0.0), last_clock: None, horizon: 0 }
    }

    /// The current estimate of clocks per round.
    pub fn estimate(&self) -> f64 {
        self.estimate
    }

    /// A communication round starts with the worker at `clock`: updates the estimate (not when
    /// the worker did not advance, e.g. while the model is evaluated) and returns the horizon:
    /// intents that start before it are acted on in this round.
    pub fn round(&mut self, clock: u64) -> u64 {
        let delta = self.last_clock.map_or(0, |last| clock.saturating_sub(last));
        if delta > 0 {
            self.estimate = (1.0 - self.alpha) * self.estimate + self.alpha * delta as f64;
        }
        self.last_clock = Some(clock);
        // Two rounds: this one and the next must complete before the worker gets there.
        self.horizon = clock.saturating_add(poisson_quantile(2.0 * self.estimate.max(delta as f64), self.quantile));
        self.horizon
    }

    /// Whether to act now on an intent that starts at clock `start` (after [`ActionTiming::round`]).
    pub fn act(&self, start: u64) -> bool {
        start < self.horizon
    }
}

/// The smallest `k` with `P(X ≤ k) ≥ p` for `X ~ Poisson(λ)` (summed in log space, so large
/// rates do not underflow the first terms into a wrong answer).
pub fn poisson_quantile(lambda: f64, p: f64) -> u64 {
    // NaN, zero, negative and infinite rates have no useful quantile.
    if !(lambda.is_finite() && lambda > 0.0) {
        return 0;
    }
    let ln_lambda = lambda.ln();
    let (mut cdf, mut ln_factorial) = (0.0f64, 0.0f64);
    let limit = (lambda + 60.0 * lambda.sqrt() + 100.0) as u64;
    for k in 0..=limit {
        if k > 0 {
            ln_factorial += (k as f64).ln();
        }
        cdf += (-lambda + k as f64 * ln_lambda - ln_factorial).exp();
        if cdf >= p {
            return k;
        }
    }
    limit
}

/// One worker's intent on a key: it needs the key from clock `start` until before `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// The worker (its index on the node).
    pub worker: u16,
    /// First clock of the need.
    pub start: u64,
    /// First clock past it.
    pub end: u64,
}

/// A node's intents, aggregated per key across its workers and overlapping windows (AdaPM B.2).
#[derive(Debug, Default)]
pub struct IntentTable {
    windows: BTreeMap<(u16, u64), Vec<Window>>,
}

impl IntentTable {
    /// Worker `worker` will need `key` of `table` in clocks `start..end` (an empty window is
    /// ignored).
    pub fn add(&mut self, table: u16, key: u64, worker: u16, start: u64, end: u64) {
        if start < end {
            self.windows.entry((table, key)).or_default().push(Window { worker, start, end });
        }
    }

    /// Keys with a window that starts before `horizon(worker)` and has not ended at
    /// `clock(worker)`: the ones to act on now, given each worker's horizon and clock.
    pub fn due(&self, horizon: impl Fn(u16) -> u64, clock: impl Fn(u16) -> u64) -> Vec<(u16, u64)> {
        self.windows.iter().filter(|(_, ws)| ws.iter().any(|w| w.start < horizon(w.worker) && w.end > clock(w.worker))).map(|(k, _)| *k).collect()
    }

    /// Drops windows that ended (at each worker's current clock); returns the keys whose last
    /// window ended, for which the node no longer has intent.
    pub fn expire(&mut self, clock: impl Fn(u16) -> u64) -> Vec<(u16, u64)> {
        let mut ended = Vec::new();
        self.windows.retain(|key, ws| {
            ws.retain(|w| w.end > clock(w.worker));
            if ws.is_empty() {
                ended.push(*key);
                false
            } else {
                true
            }
        });
        ended
    }

    /// Keys with any window.
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// Whether no intent is registered.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_quantiles_match_known_values() {
        // P(X ≤ 3) for λ = 1 is 0.981; P(X ≤ 2) is 0.920.
        assert_eq!(poisson_quantile(1.0, 0.95), 3);
        assert_eq!(poisson_quantile(1.0, 0.9), 2);
        assert_eq!(poisson_quantile(20.0, 0.5), 20);
        assert_eq!(poisson_quantile(0.0, 0.9999), 0);
        // Large rates: close to λ + z·√λ (z(0.9999) ≈ 3.72).
        let q = poisson_quantile(10_000.0, 0.9999) as f64;
        assert!((q - (10_000.0 + 3.72 * 100.0)).abs() < 10.0, "{q}");
        assert!(poisson_quantile(20.0, 0.9999) > poisson_quantile(20.0, 0.99));
    }

    #[test]
    fn timing_learns_the_clock_rate_and_ignores_pauses() {
        let mut t = ActionTiming::new(0.5, 0.9999, 1.0);
        t.round(0);
        let early = t.round(100); // 100 clocks in one round: max(estimate, Δ) takes over at once
        assert!(t.act(150) && early >= 200, "horizon {early}");
        for c in (200..=1000).step_by(100) {
            t.round(c);
        }
        assert!((t.estimate() - 100.0).abs() < 5.0, "{}", t.estimate());
        let before = t.estimate();
        t.round(1000); // a pause (evaluation): the estimate stays
        assert_eq!(t.estimate(), before);
        assert!(!t.act(1000 + 600), "far-away intents wait");
        assert!(t.act(1000 + 150), "two rounds ahead are acted on");
    }

    #[test]
    fn intents_aggregate_per_key_and_expire() {
        let mut it = IntentTable::default();
        it.add(0, 7, 0, 5, 10);
        it.add(0, 7, 1, 20, 30);
        it.add(0, 8, 0, 40, 50);
        it.add(0, 9, 0, 3, 3);
        assert_eq!(it.len(), 2);
        // Worker 0 at clock 2 with horizon 8; worker 1 at clock 2 with horizon 12.
        let clock = |_| 2;
        assert_eq!(it.due(|w| if w == 0 { 8 } else { 12 }, clock), vec![(0, 7)]);
        // At clock 12 worker 0's window on key 7 ended, worker 1's has not.
        assert!(it.expire(|_| 12).is_empty());
        assert_eq!(it.expire(|_| 60), vec![(0, 7), (0, 8)]);
        assert!(it.is_empty());
    }
}
