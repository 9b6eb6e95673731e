//! Intent signalling (AdaPM, *Good Intentions: Adaptive Parameter Management via Intent
//! Signaling*, CIKM 2023): workers declare which keys they will need in which window of their
//! clocks ([`crate::Worker::intent`]), and the node moves those keys here just early enough.
//!
//! * [`ActionTiming`]: when to act on an intent (Section 4.2, Algorithm 1);
//! * [`IntentTable`]: a node's intents, aggregated per key across its workers (Appendix B.2);
//! * `rounds`: what the node's intent service decides each communication round — the workers'
//!   horizons, the windows moved along, the level changes each key's home must learn, and what
//!   becomes of the homes' grants (moves of keys still intended, replicas, unwanted replicas);
//! * `schedule`: when the service acts — its rounds' cadence, its rests and what wakes it — and
//!   what workers wait for around a barrier (a round told, the grants taken up);
//! * `sync_marks`: which replicas' deltas are on their way and which keys a `localize` is about
//!   to move here, so that the two never meet;
//! * `replica_set` and `sync_round`: the run-time replicas of keys several nodes intend at once
//!   (Section 4.1 and Appendix B.1) — made, synced through their owners, drained and dropped.
//!
//! All of it is deterministic, with no thread, clock, lock or I/O of its own: the service's
//! thread (`worker::intent`) feeds it clocks, declarations, grants and the outcomes of what it
//! asked for, and does the I/O; the simulator (`sim`) runs the same code among simulated
//! workers and network. See `docs/INTENT.md` for what holds.

mod replica_set;
mod replica_store;
mod rounds;
mod schedule;
mod sync_marks;
mod sync_round;

use std::collections::BTreeMap;

pub(crate) use replica_set::{OpToken, ReplicaAction, ReplicaContext, ReplicaSet};
pub(crate) use rounds::{GrantsTaken, IntentRounds, LevelChanges};
pub(crate) use schedule::{Nanos, Next, ServiceSchedule};
pub(crate) use sync_marks::SyncMarks;

use crate::keymap::KeyMap;
pub use crate::protocol::IntentLevel;
pub use crate::stats::LateCause;

/// How many rounds a table counts as shared after the last replica grant for one of its keys
/// (about 16 s at the default round time; rounds pass only while workers advance). A table whose
/// keys stopped being used by several nodes at once — a phase of training that shares them, then
/// one that does not — goes back to the plain gap instead of keeping the longer one for the
/// node's life.
pub const SHARED_ROUNDS: u32 = 16_384;

/// How many rounds after telling a key's home its level a node asks again when an access
/// finds the key neither here nor on its way (about 64 ms at the default round time, several
/// times the few milliseconds a grant and a move take on a loaded machine). The home answers a
/// level only when it changes, so a grant lost to a race (the key moved on before it landed,
/// or a replica's grant went to a node the home believed held the key) would otherwise leave a
/// key that the node needs without pause remote for as long as it needs it.
pub const REASK_ROUNDS: u32 = 64;

/// Adaptive action timing for one worker (Algorithm 1): estimates how many clocks the worker
/// completes per communication round and acts on an intent once the worker might reach the
/// intent's start within the next few rounds (AdaPM: two; see
/// [`crate::config::IntentSettings::rounds_ahead`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ActionTiming {
    /// Smoothing factor α of the rate estimate.
    pub alpha: f64,
    /// Quantile `p` of the Poisson soft upper bound (AdaPM uses 0.9999).
    pub quantile: f64,
    /// Rounds the horizon covers.
    pub rounds_ahead: u32,
    estimate: f64,
    last_clock: Option<u64>,
    horizon: u64,
}

impl ActionTiming {
    /// Timing as `settings` say (their defaults are AdaPM's untuned configuration, acting four
    /// rounds ahead instead of two).
    pub fn from_settings(settings: &crate::config::IntentSettings) -> ActionTiming {
        ActionTiming { rounds_ahead: settings.rounds_ahead.max(1), ..ActionTiming::new(settings.alpha, settings.quantile, settings.initial_rate) }
    }

    /// Timing with smoothing `alpha`, quantile `quantile` and an initial estimate of `initial`
    /// clocks per round, acting two rounds ahead (AdaPM's Algorithm 1).
    pub fn new(alpha: f64, quantile: f64, initial: f64) -> ActionTiming {
        ActionTiming {
            alpha: alpha.clamp(0.0, 1.0),
            quantile: quantile.clamp(0.5, 1.0 - 1e-12),
            rounds_ahead: 2,
            estimate: initial.max(0.0),
            last_clock: None,
            horizon: 0,
        }
    }

    /// The current estimate of clocks per round.
    #[cfg(test)]
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
        // This round and the next `rounds_ahead - 1` must complete before the worker gets there.
        let rate = self.estimate.max(delta as f64);
        self.horizon = clock.saturating_add(poisson_quantile(f64::from(self.rounds_ahead) * rate, self.quantile));
        self.horizon
    }

    /// Whether to act now on an intent that starts at clock `start` (after [`ActionTiming::round`]).
    #[cfg(test)]
    pub fn act(&self, start: u64) -> bool {
        start <= self.horizon
    }

    /// The horizon computed by the last [`ActionTiming::round`].
    #[cfg(test)]
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

/// An entry of the clock-ordered indexes: (table, key, worker, start) of a window. A worker
/// has at most one window per key with a given start, and a window's start never changes (a
/// window only grows at its end), so these name it for its whole life.
type Entry = (u16, u64, u16, u64);

/// A key on a node: its windows, and the level its home was last told.
#[derive(Debug, Default)]
struct KeyState {
    /// Usually one or two: inline.
    windows: smallvec::SmallVec<[WindowState; 2]>,
    /// What the key's home was last told ([`IntentTable::relevel`]). Kept with the windows, so
    /// that a round finds both with one lookup: a key outlives its last window until its home
    /// has been told `None`.
    signalled: IntentLevel,
    /// How far the home's answer to the level told got on this node (for the causes of late
    /// accesses); back to [`Answer::Awaited`] when the key's intent ends.
    answer: Answer,
    /// The round in which the home was last told the key's level (or asked again).
    asked: u32,
}

/// What became of a key's intent after the node told its home.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Answer {
    /// No grant yet.
    #[default]
    Awaited,
    /// The home granted a move here; the key is on its way.
    Moving,
    /// The home granted a replica here; it is being made (or waits for the key to leave).
    Replicating,
    /// A relocation the grant started completed.
    Landed,
}

impl KeyState {
    /// No window left and nothing told to the home that it must still take back: the entry
    /// can go.
    fn idle(&self) -> bool {
        self.windows.is_empty() && self.signalled == IntentLevel::None
    }
}

/// One window of a key and how far it got.
#[derive(Debug, Clone, Copy)]
struct WindowState {
    window: Window,
    /// Its start came within its worker's action horizon.
    taken: bool,
    /// Its worker reached its start.
    started: bool,
}

/// A node's intents, aggregated per key across its workers and overlapping windows (AdaPM B.2).
///
/// A window is *taken* once its start comes within its worker's action horizon, *started*
/// once its worker reaches its start, and dropped once the worker reaches its end;
/// [`IntentTable::advance`] moves windows along and names the keys whose state changed, and
/// [`IntentTable::level`] says what the node needs of a key. Indexes bucketed by start and end
/// clock are walked only as far as the clocks reach, so a round costs what changes, not what
/// is declared. A window that grows keeps its entries (a key declared clock after clock costs
/// a lookup, not three index entries per clock): its end entry, once reached, is moved to the
/// window's current end; an entry whose window no longer exists is skipped when walked. Each
/// key also keeps the level its home was last told ([`IntentTable::relevel`]), so a round
/// learns what to tell the homes with one lookup per changed key.
#[derive(Debug, Default)]
pub struct IntentTable {
    /// A window that begins at most this many clocks after one of the same worker on the same
    /// key ends extends it.
    pub gap: u64,
    /// The gap on the keys of tables marked shared ([`IntentTable::mark_shared`]).
    pub shared_gap: u64,
    /// Per table id: the round of the last replica grant for one of its keys, while its keys
    /// count as shared with other nodes ([`SHARED_ROUNDS`]).
    shared: Vec<Option<u32>>,
    /// Rounds so far ([`IntentTable::advance`] calls), for [`KeyState::asked`].
    rounds: u32,
    /// Keys whose home is to be asked again ([`IntentTable::note_late`]).
    reask: Vec<(u16, u64)>,
    /// Per key with windows, or whose home was told it is needed (found through a dense
    /// index: a round visits its keys in order, see [`crate::keymap`]).
    windows: KeyMap<KeyState>,
    /// Windows not taken yet, by start.
    pending: BTreeMap<u64, Vec<Entry>>,
    /// Windows not started yet, by start.
    unstarted: BTreeMap<u64, Vec<Entry>>,
    /// Every window, by end.
    ends: BTreeMap<u64, Vec<Entry>>,
}

impl IntentTable {
    /// Worker `worker` will need `key` of `table` in clocks `start..end` (an empty window, and a
    /// window the worker already declared, are ignored). Returns whether it was added.
    pub fn add(&mut self, table: u16, key: u64, worker: u16, start: u64, end: u64) -> bool {
        if start >= end {
            return false;
        }
        let gap = self.gap_of(table);
        let windows = &mut self.windows.get_or_default(table, key).windows;
        // A window that overlaps or continues one of the same worker extends it: a key needed
        // in consecutive clocks stays needed, instead of ending and beginning again.
        if let Some(w) = windows.iter_mut().find(|w| w.window.worker == worker && w.window.start <= start && start <= w.window.end.saturating_add(gap)) {
            if end <= w.window.end {
                return false;
            }
            // Its entries stay: the end entry moves to the new end when the walk reaches it.
            w.window.end = end;
            return true;
        }
        windows.push(WindowState { window: Window { worker, start, end }, taken: false, started: false });
        let entry = (table, key, worker, start);
        self.pending.entry(start).or_default().push(entry);
        self.unstarted.entry(start).or_default().push(entry);
        self.ends.entry(end).or_default().push(entry);
        true
    }

    /// The homes granted this node a replica of a key of `table`: its keys are used by several
    /// nodes at once, so its windows bridge [`IntentTable::shared_gap`] clocks until
    /// [`SHARED_ROUNDS`] rounds pass without another such grant.
    pub fn mark_shared(&mut self, table: u16) {
        let t = table as usize;
        if self.shared.len() <= t {
            self.shared.resize(t + 1, None);
        }
        self.shared[t] = Some(self.rounds);
    }

    /// The gap a window of `table` may leave and still continue one before it.
    fn gap_of(&self, table: u16) -> u64 {
        if self.shared.get(table as usize).is_some_and(Option::is_some) { self.shared_gap } else { self.gap }
    }

    /// One round: takes the windows whose start is at or before `horizon(worker)` (at most
    /// `max_horizon`), starts those whose start is at or before `clock(worker)` and drops those
    /// whose end is (both at most `max_clock`). Returns the keys whose windows changed, sorted,
    /// each once.
    pub fn advance(&mut self, max_horizon: u64, horizon: impl Fn(u16) -> u64, max_clock: u64, clock: impl Fn(u16) -> u64) -> Vec<(u16, u64)> {
        self.rounds = self.rounds.wrapping_add(1);
        let rounds = self.rounds;
        for mark in self.shared.iter_mut() {
            if mark.is_some_and(|at| rounds.wrapping_sub(at) >= SHARED_ROUNDS) {
                *mark = None;
            }
        }
        let mut touched = Vec::new();
        let windows = &mut self.windows;
        // The window of an index entry, if it still exists as the entry describes it.
        fn find<'w>(windows: &'w mut KeyMap<KeyState>, e: &Entry) -> Option<&'w mut WindowState> {
            windows.get_mut(e.0, e.1)?.windows.iter_mut().find(|s| s.window.worker == e.2 && s.window.start == e.3)
        }
        // Marks the window of `e` taken (or started) once `at` is within `limit` of its worker;
        // returns whether the entry stays in its index.
        let mut reach = |at: u64, e: &Entry, limit: u64, flag: fn(&mut WindowState) -> &mut bool| {
            let Some(done) = find(windows, e).map(flag).filter(|done| !**done) else { return false };
            if at > limit {
                return true;
            }
            *done = true;
            touched.push((e.0, e.1));
            false
        };
        walk(&mut self.pending, max_horizon, |at, e| reach(at, e, horizon(e.2), |s| &mut s.taken));
        walk(&mut self.unstarted, max_clock, |at, e| reach(at, e, clock(e.2), |s| &mut s.started));
        // End entries of windows that grew since they were made move to the current end.
        let mut moved = Vec::new();
        walk(&mut self.ends, max_clock, |at, e| {
            let Some(end) = find(windows, e).map(|s| s.window.end) else { return false };
            if clock(e.2) < end {
                if end == at {
                    return true;
                }
                moved.push((end, *e));
                return false;
            }
            Self::remove_window(windows, e.0, e.1, e.2, e.3);
            touched.push((e.0, e.1));
            false
        });
        for (end, e) in moved {
            self.ends.entry(end).or_default().push(e);
        }
        touched.sort_unstable();
        touched.dedup();
        touched
    }

    fn remove_window(windows: &mut KeyMap<KeyState>, table: u16, key: u64, worker: u16, start: u64) {
        if let Some(ks) = windows.get_mut(table, key) {
            ks.windows.retain(|x| x.window.worker != worker || x.window.start != start);
            if ks.idle() {
                windows.remove(table, key);
            }
        }
    }

    /// The level of `key` of `table` (as [`IntentTable::level`]) if it differs from the one its
    /// home was last told, which it becomes; `None` if unchanged. A key without windows is
    /// forgotten once its home has been told `None`.
    pub fn relevel(&mut self, table: u16, key: u64, clock: impl Fn(u16) -> u64) -> Option<IntentLevel> {
        let ks = self.windows.get_mut(table, key)?;
        let level = Self::level_of(&ks.windows, clock);
        if level == ks.signalled {
            return None;
        }
        ks.signalled = level;
        ks.asked = self.rounds;
        if level == IntentLevel::None {
            ks.answer = Answer::Awaited;
        }
        if ks.idle() {
            self.windows.remove(table, key);
        }
        Some(level)
    }

    /// The level `key` of `table` was last told to its home.
    pub fn signalled(&self, table: u16, key: u64) -> IntentLevel {
        self.windows.get(table, key).map_or(IntentLevel::None, |ks| ks.signalled)
    }

    /// What this node needs of `key` of `table`, given each worker's `clock`: `Now` when a
    /// taken window has started, `Soon` when a taken window has not, else `None`.
    #[cfg(test)]
    pub fn level(&self, table: u16, key: u64, clock: impl Fn(u16) -> u64) -> IntentLevel {
        self.windows.get(table, key).map_or(IntentLevel::None, |ks| Self::level_of(&ks.windows, clock))
    }

    fn level_of(windows: &[WindowState], clock: impl Fn(u16) -> u64) -> IntentLevel {
        windows
            .iter()
            .filter(|s| s.taken && s.window.end > clock(s.window.worker))
            .map(|s| if s.window.start <= clock(s.window.worker) { IntentLevel::Now } else { IntentLevel::Soon })
            .max()
            .unwrap_or(IntentLevel::None)
    }

    /// If worker `worker`, in clock `clock`, declared that it needs `key` of `table` now: why
    /// the key is not here, as far as this node knows (called for keys an access did not find
    /// here).
    pub fn why_away(&self, table: u16, key: u64, worker: u16, clock: u64) -> Option<LateCause> {
        let ks = self.windows.get(table, key)?;
        let window = ks.windows.iter().find(|s| s.window.worker == worker && s.window.start <= clock && clock < s.window.end)?;
        Some(match (window.taken, ks.answer) {
            (false, _) => LateCause::Unacted,
            (true, Answer::Awaited) => LateCause::Unanswered,
            (true, Answer::Moving) => LateCause::Moving,
            (true, Answer::Replicating) => LateCause::Replicating,
            (true, Answer::Landed) => LateCause::Left,
        })
    }

    /// [`IntentTable::why_away`], for an access that went remote; and if the key should have
    /// been here or replicated here long ago — the home was told [`REASK_ROUNDS`] rounds ago or
    /// more and nothing is on its way (nothing was granted, or the key landed and left without
    /// a replica) — the key is listed to ask its home again ([`IntentTable::take_reasks`]).
    pub fn note_late(&mut self, table: u16, key: u64, worker: u16, clock: u64) -> Option<LateCause> {
        let cause = self.why_away(table, key, worker, clock)?;
        if matches!(cause, LateCause::Unanswered | LateCause::Left)
            && let Some(ks) = self.windows.get_mut(table, key)
            && ks.signalled != IntentLevel::None
            && self.rounds.wrapping_sub(ks.asked) >= REASK_ROUNDS
        {
            ks.asked = self.rounds;
            self.reask.push((table, key));
        }
        Some(cause)
    }

    /// The keys to ask their homes about again, each with the level the home was last told
    /// (still not `None`), by level and table.
    pub fn take_reasks(&mut self) -> BTreeMap<(IntentLevel, u16), Vec<u64>> {
        let mut out: BTreeMap<(IntentLevel, u16), Vec<u64>> = BTreeMap::new();
        for (table, key) in std::mem::take(&mut self.reask) {
            let level = self.signalled(table, key);
            if level != IntentLevel::None {
                out.entry((level, table)).or_default().push(key);
            }
        }
        // Each key at most once (its `asked` round moved on when it was listed); sorted, as
        // the homes take their batches.
        for keys in out.values_mut() {
            keys.sort_unstable();
        }
        out
    }

    /// The home granted a move of `key` of `table` here (`replica` false) or a replica of it
    /// here (`replica` true) while this node intends it.
    pub fn note_granted(&mut self, table: u16, key: u64, replica: bool) {
        if let Some(ks) = self.windows.get_mut(table, key) {
            ks.answer = if replica { Answer::Replicating } else { Answer::Moving };
        }
    }

    /// A relocation of `key` of `table` for its intent completed.
    pub fn note_landed(&mut self, table: u16, key: u64) {
        if let Some(ks) = self.windows.get_mut(table, key) {
            ks.answer = Answer::Landed;
        }
    }

    /// The earliest window on `key` of `table` that has not ended at its worker's `clock`.
    pub fn earliest(&self, table: u16, key: u64, clock: impl Fn(u16) -> u64) -> Option<Window> {
        self.windows.get(table, key).and_then(|ks| ks.windows.iter().map(|s| s.window).filter(|w| w.end > clock(w.worker)).min_by_key(|w| w.start))
    }

    /// Forgets every window of worker `worker` (it left); returns the keys that lost windows
    /// (their index entries are skipped when walked).
    pub fn forget_worker(&mut self, worker: u16) -> Vec<(u16, u64)> {
        let mut touched = Vec::new();
        self.windows.retain(|key, ks| {
            let before = ks.windows.len();
            ks.windows.retain(|s| s.window.worker != worker);
            if ks.windows.len() != before {
                touched.push(key);
            }
            !ks.idle()
        });
        touched.sort_unstable();
        touched
    }

    /// Keys with any window or whose home was last told they are needed.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// Whether no intent is registered and no key's home was last told it is needed.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }
}

/// Walks the buckets of `index` up to clock `limit` in order; `keep(clock, entry)` says
/// whether an entry stays. Empty buckets go.
fn walk(index: &mut BTreeMap<u64, Vec<Entry>>, limit: u64, mut keep: impl FnMut(u64, &Entry) -> bool) {
    let mut emptied = Vec::new();
    for (&at, bucket) in index.range_mut(..=limit) {
        bucket.retain(|e| keep(at, e));
        if bucket.is_empty() {
            emptied.push(at);
        }
    }
    for at in emptied {
        index.remove(&at);
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
    fn the_horizon_covers_the_rounds_ahead_the_settings_ask_for() {
        let settings = crate::config::IntentSettings { initial_rate: 100.0, ..Default::default() };
        assert_eq!(settings.rounds_ahead, 4);
        let mut ours = ActionTiming::from_settings(&settings);
        let mut adapm = ActionTiming::new(settings.alpha, settings.quantile, settings.initial_rate);
        assert_eq!(ours.round(1000), 1000 + poisson_quantile(400.0, settings.quantile));
        assert_eq!(adapm.round(1000), 1000 + poisson_quantile(200.0, settings.quantile));
        assert!(ours.act(1000 + 390) && !adapm.act(1000 + 390));
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
    fn windows_are_taken_started_and_dropped_as_clocks_advance() {
        use IntentLevel::*;
        let mut it = IntentTable::default();
        assert!(it.add(0, 7, 0, 5, 10));
        assert!(!it.add(0, 7, 0, 5, 10), "the same window twice is one window");
        assert!(!it.add(0, 7, 0, 6, 8), "a window inside another adds nothing");
        assert!(it.add(0, 7, 1, 20, 30));
        assert!(it.add(0, 8, 0, 40, 50));
        assert!(!it.add(0, 9, 0, 3, 3), "an empty window is ignored");
        assert_eq!(it.len(), 2);
        let active = |it: &IntentTable, worker, clock| it.why_away(0, 7, worker, clock).is_some();
        assert!(active(&it, 0, 5) && active(&it, 0, 9) && !active(&it, 0, 10) && !active(&it, 1, 5));
        // Both workers at clock 2; worker 0's horizon 8, worker 1's 12: only (0, 7) of worker 0
        // is within reach.
        let horizon = |w| if w == 0 { 8 } else { 12 };
        assert_eq!(it.advance(12, horizon, 2, |_| 2), vec![(0, 7)]);
        assert_eq!((it.level(0, 7, |_| 2), it.level(0, 8, |_| 2)), (Soon, None));
        assert!(it.advance(12, horizon, 2, |_| 2).is_empty(), "nothing changed");
        // Worker 0 reaches clock 5: its window started.
        assert_eq!(it.advance(12, horizon, 5, |w| if w == 0 { 5 } else { 2 }), vec![(0, 7)]);
        assert_eq!(it.level(0, 7, |w| if w == 0 { 5 } else { 2 }), Now);
        // At clock 10 worker 0's window ended; worker 1's (20..30) is within reach at horizon 20:
        // the key is needed soon again, not now.
        let at10 = |_| 10;
        assert_eq!(it.advance(20, |_| 20, 10, at10), vec![(0, 7)]);
        assert_eq!(it.level(0, 7, at10), Soon);
        // A window that starts exactly at the horizon is taken; windows that ended are dropped.
        assert_eq!(it.advance(40, |_| 40, 30, |_| 30), vec![(0, 7), (0, 8)]);
        assert_eq!((it.level(0, 7, |_| 30), it.level(0, 8, |_| 30)), (None, Soon));
        assert_eq!(it.len(), 1);
        assert_eq!(it.earliest(0, 8, |_| 30), Some(Window { worker: 0, start: 40, end: 50 }));
        assert_eq!(it.advance(60, |_| 60, 60, |_| 60), vec![(0, 8)]);
        assert!(it.is_empty() && it.pending.is_empty() && it.unstarted.is_empty() && it.ends.is_empty());
    }

    #[test]
    fn consecutive_windows_of_a_worker_merge() {
        let mut it = IntentTable::default();
        it.add(0, 1, 0, 3, 4);
        assert_eq!(it.advance(3, |_| 3, 3, |_| 3), vec![(0, 1)]);
        assert_eq!(it.level(0, 1, |_| 3), IntentLevel::Now);
        // The next clock's window continues it: at clock 4 the key is still needed now.
        assert!(it.add(0, 1, 0, 4, 5));
        assert!(it.add(0, 1, 1, 4, 5), "another worker's window stays apart");
        it.advance(4, |_| 4, 4, |_| 4);
        assert_eq!(it.level(0, 1, |_| 4), IntentLevel::Now);
        assert_eq!(it.earliest(0, 1, |_| 4), Some(Window { worker: 0, start: 3, end: 5 }));
        it.advance(5, |_| 5, 5, |_| 5);
        assert!(it.is_empty() && it.pending.is_empty() && it.unstarted.is_empty() && it.ends.is_empty());
        // A window that grows before it is taken is taken once, with its new end: the entries
        // of its old extent are skipped.
        assert!(it.add(0, 2, 0, 10, 12) && it.add(0, 2, 0, 12, 15));
        assert_eq!(it.advance(10, |_| 10, 10, |_| 10), vec![(0, 2)]);
        assert!(it.advance(12, |_| 12, 12, |_| 12).is_empty(), "the old end is no end");
        assert_eq!(it.level(0, 2, |_| 12), IntentLevel::Now);
        assert_eq!(it.advance(15, |_| 15, 15, |_| 15), vec![(0, 2)]);
        assert!(it.is_empty() && it.pending.is_empty() && it.unstarted.is_empty() && it.ends.is_empty());
    }

    #[test]
    fn a_window_declared_clock_after_clock_keeps_one_entry_per_index() {
        let mut it = IntentTable::default();
        // The key is declared 4 clocks ahead in every clock: one window that keeps growing.
        for clock in 0..100u64 {
            it.add(0, 1, 0, clock + 4, clock + 5);
            it.advance(clock + 4, |_| clock + 4, clock, |_| clock);
            for index in [&it.pending, &it.unstarted, &it.ends] {
                let entries: usize = index.values().map(Vec::len).sum();
                assert!(entries <= 1, "clock {clock}: {entries} entries of one window in an index");
            }
        }
        assert_eq!(it.earliest(0, 1, |_| 100), Some(Window { worker: 0, start: 4, end: 104 }));
        assert_eq!(it.level(0, 1, |_| 100), IntentLevel::Now);
        // Its end entry was moved along; at the window's last end it goes.
        assert!(it.advance(104, |_| 104, 103, |_| 103).is_empty());
        assert_eq!(it.advance(104, |_| 104, 104, |_| 104), vec![(0, 1)]);
        assert!(it.is_empty() && it.pending.is_empty() && it.unstarted.is_empty() && it.ends.is_empty());
    }

    #[test]
    fn a_short_gap_between_windows_of_a_worker_is_bridged() {
        let mut it = IntentTable { gap: 2, ..IntentTable::default() };
        it.add(0, 1, 0, 3, 4);
        // Two clocks without the key, then again: one window, needed throughout.
        assert!(it.add(0, 1, 0, 6, 7));
        assert_eq!(it.earliest(0, 1, |_| 3), Some(Window { worker: 0, start: 3, end: 7 }));
        it.advance(5, |_| 5, 5, |_| 5);
        assert_eq!(it.level(0, 1, |_| 5), IntentLevel::Now, "still needed in the gap");
        // Three clocks without it: a window of its own.
        assert!(it.add(0, 1, 0, 10, 11));
        assert_eq!(it.advance(7, |_| 7, 7, |_| 7), vec![(0, 1)]);
        assert_eq!(it.level(0, 1, |_| 7), IntentLevel::None);
        assert_eq!(it.earliest(0, 1, |_| 7), Some(Window { worker: 0, start: 10, end: 11 }));
    }

    #[test]
    fn a_key_still_remote_long_after_its_home_was_told_is_asked_about_again() {
        let mut it = IntentTable::default();
        it.add(0, 5, 0, 0, 1000);
        it.advance(0, |_| 0, 0, |_| 0);
        assert_eq!(it.relevel(0, 5, |_| 0), Some(IntentLevel::Now));
        assert_eq!(it.note_late(0, 5, 0, 0), Some(LateCause::Unanswered));
        assert!(it.take_reasks().is_empty(), "the answer may still be on its way");
        for _ in 0..REASK_ROUNDS {
            it.advance(0, |_| 0, 0, |_| 0);
        }
        assert_eq!(it.note_late(0, 5, 0, 0), Some(LateCause::Unanswered));
        assert_eq!(it.note_late(0, 5, 0, 0), Some(LateCause::Unanswered));
        assert_eq!(it.take_reasks(), BTreeMap::from([((IntentLevel::Now, 0), vec![5])]), "once, with the level told");
        it.note_granted(0, 5, false);
        for _ in 0..REASK_ROUNDS {
            it.advance(0, |_| 0, 0, |_| 0);
        }
        assert_eq!(it.note_late(0, 5, 0, 0), Some(LateCause::Moving));
        assert!(it.take_reasks().is_empty(), "a key on its way is waited for");
        it.note_landed(0, 5);
        assert_eq!(it.note_late(0, 5, 0, 0), Some(LateCause::Left));
        assert_eq!(it.take_reasks().len(), 1, "a key that landed and left without a replica is asked about again");
        assert_eq!(it.note_late(7, 5, 0, 0), None, "no window: not late");
    }

    #[test]
    fn a_shared_table_bridges_its_own_longer_gap() {
        let mut it = IntentTable { gap: 2, shared_gap: 10, ..IntentTable::default() };
        it.mark_shared(3);
        for table in [0, 3] {
            it.add(table, 1, 0, 3, 4);
            it.add(table, 1, 0, 12, 13);
        }
        assert_eq!(it.earliest(0, 1, |_| 3), Some(Window { worker: 0, start: 3, end: 4 }), "8 clocks apart: two windows");
        assert_eq!(it.earliest(3, 1, |_| 3), Some(Window { worker: 0, start: 3, end: 13 }), "one window on the shared table");
        it.add(3, 1, 0, 24, 25);
        it.advance(24, |_| 24, 20, |_| 20);
        assert_eq!(it.level(3, 1, |_| 20), IntentLevel::Soon, "11 clocks apart: released in between");
        // Rounds without another replica grant: the table is no longer shared, and bridges the
        // plain gap again; a grant makes it shared anew.
        for _ in 0..SHARED_ROUNDS - 2 {
            it.advance(24, |_| 24, 20, |_| 20);
        }
        it.add(3, 2, 0, 30, 31);
        it.add(3, 2, 0, 35, 36);
        assert_eq!(it.earliest(3, 2, |_| 30), Some(Window { worker: 0, start: 30, end: 36 }), "still shared");
        it.advance(24, |_| 24, 20, |_| 20);
        it.add(3, 3, 0, 30, 31);
        it.add(3, 3, 0, 35, 36);
        assert_eq!(it.earliest(3, 3, |_| 30), Some(Window { worker: 0, start: 30, end: 31 }), "no longer shared: two windows");
        it.mark_shared(3);
        it.add(3, 4, 0, 30, 31);
        it.add(3, 4, 0, 35, 36);
        assert_eq!(it.earliest(3, 4, |_| 30), Some(Window { worker: 0, start: 30, end: 36 }), "shared again");
    }

    #[test]
    fn a_key_is_kept_until_its_home_was_told_it_is_no_longer_needed() {
        use IntentLevel::*;
        let mut it = IntentTable::default();
        it.add(0, 7, 0, 2, 4);
        assert_eq!(it.relevel(0, 7, |_| 0), Option::None, "not taken yet: nothing to tell");
        assert_eq!(it.advance(2, |_| 2, 0, |_| 0), vec![(0, 7)]);
        assert_eq!(it.relevel(0, 7, |_| 0), Some(Soon));
        assert_eq!(it.relevel(0, 7, |_| 0), Option::None, "told already");
        assert_eq!(it.advance(2, |_| 2, 2, |_| 2), vec![(0, 7)]);
        assert_eq!((it.relevel(0, 7, |_| 2), it.signalled(0, 7)), (Some(Now), Now));
        // The window ends: the key stays until its home is told.
        assert_eq!(it.advance(4, |_| 4, 4, |_| 4), vec![(0, 7)]);
        assert_eq!((it.len(), it.level(0, 7, |_| 4), it.signalled(0, 7)), (1, None, Now));
        assert!(!it.is_empty());
        assert_eq!(it.relevel(0, 7, |_| 4), Some(None));
        assert!(it.is_empty() && it.signalled(0, 7) == None && it.relevel(0, 7, |_| 4).is_none());
        // A leaving worker's key likewise stays until its home is told.
        it.add(0, 8, 1, 0, 10);
        it.advance(0, |_| 0, 0, |_| 0);
        assert_eq!(it.relevel(0, 8, |_| 0), Some(Now));
        assert_eq!(it.forget_worker(1), vec![(0, 8)]);
        assert_eq!((it.len(), it.relevel(0, 8, |_| 0)), (1, Some(None)));
        assert!(it.is_empty());
    }

    #[test]
    fn a_leaving_worker_takes_its_windows_along() {
        let mut it = IntentTable::default();
        it.add(0, 7, 0, 5, 10);
        it.add(0, 7, 1, 5, 10);
        it.add(1, 3, 1, 0, 4);
        assert_eq!(it.forget_worker(1), vec![(0, 7), (1, 3)]);
        assert_eq!(it.len(), 1);
        assert!(it.why_away(0, 7, 1, 6).is_none() && it.why_away(0, 7, 0, 6).is_some());
        assert_eq!(it.advance(u64::MAX, |_| u64::MAX, 10, |_| 10), vec![(0, 7)]);
        assert!(it.is_empty() && it.pending.is_empty() && it.unstarted.is_empty());
    }

    #[test]
    fn a_late_access_is_told_why_its_key_is_not_here() {
        use LateCause::*;
        let mut it = IntentTable::default();
        it.add(0, 7, 0, 2, 6);
        assert_eq!(it.why_away(0, 7, 0, 1), Option::None, "before the window: not late");
        assert_eq!(it.why_away(0, 7, 1, 2), Option::None, "another worker's window");
        assert_eq!(it.why_away(0, 7, 0, 2), Some(Unacted));
        it.advance(2, |_| 2, 2, |_| 2);
        it.relevel(0, 7, |_| 2);
        assert_eq!(it.why_away(0, 7, 0, 2), Some(Unanswered));
        it.note_granted(0, 7, true);
        assert_eq!(it.why_away(0, 7, 0, 3), Some(Replicating));
        it.note_granted(0, 7, false);
        assert_eq!(it.why_away(0, 7, 0, 3), Some(Moving));
        it.note_landed(0, 7);
        assert_eq!(it.why_away(0, 7, 0, 3), Some(Left));
        // The intent ends (its home told): a later window starts over.
        it.add(0, 7, 0, 8, 9);
        it.advance(6, |_| 6, 6, |_| 6);
        assert_eq!(it.relevel(0, 7, |_| 6), Some(IntentLevel::None));
        it.advance(8, |_| 8, 8, |_| 8);
        it.relevel(0, 7, |_| 8);
        assert_eq!(it.why_away(0, 7, 0, 8), Some(Unanswered));
        // Grants for keys without intent leave no trace.
        it.note_granted(0, 99, false);
        it.note_landed(0, 99);
        assert_eq!((it.len(), it.why_away(0, 99, 0, 8)), (1, Option::None));
    }
}
