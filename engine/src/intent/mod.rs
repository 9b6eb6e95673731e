//! Intent signalling (AdaPM, *Good Intentions: Adaptive Parameter Management via Intent
//! Signaling*, CIKM 2023): workers declare which keys they will need in which window of their
//! clocks ([`crate::Worker::intent`]), and the node moves those keys here just early enough.
//!
//! * [`ActionTiming`]: when to act on an intent (Section 4.2, Algorithm 1);
//! * [`IntentTable`]: a node's intents, aggregated per key across its workers (Appendix B.2);
//! * the intent service (`service`): a background thread per node that runs AdaPM's
//!   communication rounds — each round it updates every worker's clock-rate estimate, takes the
//!   keys whose windows start within the horizon, and relocates those not here with one
//!   `localize` per table (the protocol groups it into one message per home node).
//!
//! The timing and the table are deterministic and have no clock of their own; only the service
//! thread sits around them. See `docs/INTENT.md` for what holds and what is not built yet (the
//! replication of keys several nodes intend at once, Section 4.1).

mod service;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) use service::IntentService;

use crate::stats::IntentStats;

/// A node's intent counters (see [`IntentStats`]).
#[derive(Debug, Default)]
pub struct IntentCounters {
    rounds: AtomicU64,
    declared: AtomicU64,
    acted_keys: AtomicU64,
    in_time: AtomicU64,
    lead_clocks: AtomicU64,
    late_accesses: AtomicU64,
}

impl IntentCounters {
    pub(crate) fn note_round(&self) {
        self.rounds.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn note_declared(&self, windows: u64) {
        self.declared.fetch_add(windows, Ordering::Relaxed);
    }

    /// A key relocated for an intent landed `lead` clocks before its window starts (`None`:
    /// after it started).
    pub(crate) fn note_landed(&self, lead: Option<u64>) {
        self.acted_keys.fetch_add(1, Ordering::Relaxed);
        if let Some(lead) = lead {
            self.in_time.fetch_add(1, Ordering::Relaxed);
            self.lead_clocks.fetch_add(lead, Ordering::Relaxed);
        }
    }

    pub(crate) fn note_late(&self, accesses: u64) {
        self.late_accesses.fetch_add(accesses, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> IntentStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IntentStats {
            rounds: get(&self.rounds),
            declared: get(&self.declared),
            acted_keys: get(&self.acted_keys),
            in_time: get(&self.in_time),
            lead_clocks: get(&self.lead_clocks),
            late_accesses: get(&self.late_accesses),
        }
    }
}

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
    /// the furthest clock the worker may reach before the next round ends (with probability
    /// `quantile`); intents that start at or before it are acted on in this round.
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
        start <= self.horizon
    }

    /// The horizon computed by the last [`ActionTiming::round`].
    pub fn horizon(&self) -> u64 {
        self.horizon
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

/// An entry of the start- and end-ordered indexes: (clock, table, key, worker, other clock).
type Entry = (u64, u16, u64, u16, u64);

/// A node's intents, aggregated per key across its workers and overlapping windows (AdaPM B.2).
///
/// Each window is acted on once: [`IntentTable::take_due`] hands out windows whose start came
/// within reach, in start order, and [`IntentTable::expire`] drops windows that ended. Both walk
/// ordered indexes only as far as the clocks reach, so a round costs what it acts on, not what
/// is declared.
#[derive(Debug, Default)]
pub struct IntentTable {
    windows: BTreeMap<(u16, u64), Vec<Window>>,
    /// Windows not acted on yet, by start.
    pending: BTreeSet<Entry>,
    /// Every window, by end.
    ends: BTreeSet<Entry>,
}

impl IntentTable {
    /// Worker `worker` will need `key` of `table` in clocks `start..end` (an empty window, and a
    /// window the worker already declared, are ignored). Returns whether it was added.
    pub fn add(&mut self, table: u16, key: u64, worker: u16, start: u64, end: u64) -> bool {
        if start >= end {
            return false;
        }
        let window = Window { worker, start, end };
        let windows = self.windows.entry((table, key)).or_default();
        if windows.contains(&window) {
            return false;
        }
        windows.push(window);
        self.pending.insert((start, table, key, worker, end));
        self.ends.insert((end, table, key, worker, start));
        true
    }

    /// Takes the windows not acted on yet that start at or before `horizon(worker)` (at most
    /// `limit`, the largest horizon) and have not ended at `clock(worker)`: the keys to act on
    /// now. Each key comes once, with its earliest such window; the windows taken are not
    /// handed out again.
    pub fn take_due(&mut self, limit: u64, horizon: impl Fn(u16) -> u64, clock: impl Fn(u16) -> u64) -> Vec<((u16, u64), Window)> {
        let reached: Vec<Entry> = self.pending.range(..=(limit, u16::MAX, u64::MAX, u16::MAX, u64::MAX)).filter(|e| e.0 <= horizon(e.3)).copied().collect();
        let mut seen = BTreeSet::new();
        let mut due = Vec::new();
        for e @ (start, table, key, worker, end) in reached {
            self.pending.remove(&e);
            if end > clock(worker) && seen.insert((table, key)) {
                due.push(((table, key), Window { worker, start, end }));
            }
        }
        due
    }

    /// Drops windows that ended at their worker's `clock(worker)` (at most `limit`, the largest
    /// clock); returns the keys whose last window ended, for which the node no longer has intent.
    pub fn expire(&mut self, limit: u64, clock: impl Fn(u16) -> u64) -> Vec<(u16, u64)> {
        let ended: Vec<Entry> = self.ends.range(..=(limit, u16::MAX, u64::MAX, u16::MAX, u64::MAX)).filter(|e| e.0 <= clock(e.3)).copied().collect();
        let mut gone = Vec::new();
        for (end, table, key, worker, start) in ended {
            self.remove(table, key, Window { worker, start, end });
            if !self.windows.contains_key(&(table, key)) {
                gone.push((table, key));
            }
        }
        gone
    }

    fn remove(&mut self, table: u16, key: u64, w: Window) {
        self.ends.remove(&(w.end, table, key, w.worker, w.start));
        self.pending.remove(&(w.start, table, key, w.worker, w.end));
        if let Some(ws) = self.windows.get_mut(&(table, key)) {
            ws.retain(|x| *x != w);
            if ws.is_empty() {
                self.windows.remove(&(table, key));
            }
        }
    }

    /// Whether worker `worker`, in clock `clock`, declared that it needs `key` of `table` now.
    pub fn active(&self, table: u16, key: u64, worker: u16, clock: u64) -> bool {
        self.windows.get(&(table, key)).is_some_and(|ws| ws.iter().any(|w| w.worker == worker && w.start <= clock && clock < w.end))
    }

    /// Forgets every window of worker `worker` (it left).
    pub fn forget_worker(&mut self, worker: u16) {
        let mine: Vec<(u16, u64, Window)> =
            self.windows.iter().flat_map(|(&(t, k), ws)| ws.iter().filter(|w| w.worker == worker).map(move |w| (t, k, *w))).collect();
        for (t, k, w) in mine {
            self.remove(t, k, w);
        }
    }

    /// Keys with any window.
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// Whether no intent is registered.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Windows not acted on yet.
    pub fn pending(&self) -> usize {
        self.pending.len()
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
        assert!(t.act(t.horizon()) && !t.act(t.horizon() + 1), "the horizon itself is acted on");
        assert!(t.act(1000 + 150), "two rounds ahead are acted on");
    }

    #[test]
    fn intents_aggregate_per_key_are_acted_on_once_and_expire() {
        let mut it = IntentTable::default();
        assert!(it.add(0, 7, 0, 5, 10));
        assert!(!it.add(0, 7, 0, 5, 10), "the same window twice is one window");
        assert!(it.add(0, 7, 1, 20, 30));
        assert!(it.add(0, 8, 0, 40, 50));
        assert!(!it.add(0, 9, 0, 3, 3), "an empty window is ignored");
        assert_eq!(it.len(), 2);
        assert!(it.active(0, 7, 0, 5) && it.active(0, 7, 0, 9) && !it.active(0, 7, 0, 10) && !it.active(0, 7, 1, 5));
        // Worker 0 at clock 2 with horizon 8; worker 1 at clock 2 with horizon 12.
        let horizon = |w| if w == 0 { 8 } else { 12 };
        assert_eq!(it.take_due(12, horizon, |_| 2), vec![((0, 7), Window { worker: 0, start: 5, end: 10 })]);
        assert!(it.take_due(12, horizon, |_| 2).is_empty(), "a window is acted on once");
        // A window starting exactly at the horizon is due; one that ended is not.
        assert_eq!(it.take_due(20, |_| 20, |_| 2), vec![((0, 7), Window { worker: 1, start: 20, end: 30 })]);
        let mut late = IntentTable::default();
        late.add(0, 1, 0, 0, 5);
        assert!(late.take_due(9, |_| 9, |_| 5).is_empty(), "a window that ended is not acted on");
        assert_eq!(late.pending(), 0);
        // At clock 12 worker 0's window on key 7 ended, worker 1's has not.
        assert!(it.expire(12, |_| 12).is_empty());
        assert!(!it.active(0, 7, 0, 9) && it.active(0, 7, 1, 25));
        assert_eq!(it.expire(60, |_| 60), vec![(0, 7), (0, 8)]);
        assert!(it.is_empty() && it.pending() == 0);
    }

    #[test]
    fn a_leaving_worker_takes_its_windows_along() {
        let mut it = IntentTable::default();
        it.add(0, 7, 0, 5, 10);
        it.add(0, 7, 1, 5, 10);
        it.add(1, 3, 1, 0, 4);
        it.forget_worker(1);
        assert_eq!(it.len(), 1);
        assert!(!it.active(0, 7, 1, 6) && it.active(0, 7, 0, 6));
        assert_eq!(it.take_due(u64::MAX, |_| u64::MAX, |_| 0).len(), 1);
        assert!(it.expire(u64::MAX, |_| 10) == vec![(0, 7)] && it.is_empty());
    }
}
