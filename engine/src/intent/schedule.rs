//! When a node's intent service acts, and what the workers wait for around their barriers, as
//! a state machine with no thread, clock or lock.
//!
//! The service's driver (`worker::intent::service`) asks [`ServiceSchedule::next`] what to do
//! at the time it reads from its clock — a round, the part of a round that acts on grants and
//! replicas, a rest until some time, or stop — does it, and reports back
//! ([`ServiceSchedule::round_told`], [`ServiceSchedule::acted`]). Told to rest, it sleeps until
//! that time or until an event wakes it: every event ([`ServiceSchedule::note_clock`],
//! [`ServiceSchedule::declare`], [`ServiceSchedule::grants_arrived`], …) answers whether the
//! resting service must be woken for it, which is only when the event can change what it does
//! (a worker's clock wakes it only while it waits for one). Workers read what they wait for from
//! the same machine: a round told since they asked ([`ServiceSchedule::want_round`]), the grants
//! that waited taken up ([`ServiceSchedule::take_up_target`]).
//!
//! The cadence (AdaPM, Section 4.2: a communication round every round time): a full round —
//! the workers' clocks, the windows moved, the level changes told to the homes — every round
//! time, or at once when a worker's barrier waits for one; between rounds, each wake-up (a
//! grant) only acts. A round that moves no window while nothing is in flight and no replica is
//! kept stretches the time to the next one, doubling up to [`MAX_STRETCH`] round times: the
//! workers are slow against the round time (MF's sub-epochs complete a clock every few
//! milliseconds), and the clock-rate estimate, in clocks per round, takes a longer round's
//! clocks at once. A round that saw no worker advance, with nothing in flight, is followed by a
//! rest until a worker does (at most [`QUIET_REST`]), since the next round would see the same
//! clocks; with no window declared, no grant and no replica the service waits for work.
//!
//! Rounds are told to the homes one at a time, whether the service or a worker runs them (a
//! worker before a barrier, when no replica is kept, runs the round itself instead of waking the
//! service): the homes must learn one round's changes before the next round's, or a key's end
//! could overtake its new start. [`ServiceSchedule::claim_round`] hands that turn out.

use std::collections::BTreeMap;

/// Nanoseconds on the driver's clock (any origin; the simulator's is its simulated time).
pub(crate) type Nanos = u64;

/// Rounds that move no window, with nothing in flight and no replicas, stretch the time to
/// the next round, doubling it up to this many round times; a round that moves one resets it.
pub(crate) const MAX_STRETCH: u32 = 8;

/// The longest the service rests waiting for a worker's clock or declaration, or for work (a
/// safety net: those wake it).
pub(crate) const QUIET_REST: Nanos = 100_000_000;

/// What the service does next ([`ServiceSchedule::next`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Next {
    /// A round at the workers' `clocks`: compute the level changes, tell the homes, then
    /// report [`ServiceSchedule::round_told`]. The round's turn is the service's until then.
    Round {
        /// Each declaring worker's current clock.
        clocks: BTreeMap<u16, u64>,
    },
    /// Collect the relocations that completed, take up the grants, move the replicas along,
    /// then report [`ServiceSchedule::acted`].
    Act,
    /// Sleep until `until` or until an event answers that it must wake the service, then ask
    /// again.
    Rest {
        /// When the rest ends at the latest.
        until: Nanos,
    },
    /// The service stops.
    Stop,
}

/// Where the service is in its cadence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Deciding: a round if one is due (or wanted), else an act between rounds.
    Decide,
    /// Resting until the next round; grants and a wanted round wake it.
    Resting,
    /// Nothing declared, no grant, no replica: resting until there is work.
    Idle,
    /// A round is due but a worker is telling the homes one of its own: waiting for its turn.
    AwaitingTurn,
    /// The service's round is under way (until [`ServiceSchedule::round_told`]).
    InRound { began: Nanos, news: bool },
    /// The round was told; its act follows, whose outcome sets the next round's time.
    ActAfterRound { began: Nanos, news: bool, windows_moved: bool },
    /// Acting between rounds (a wake-up before the next round).
    ActBetween,
    /// After a round that saw no news with nothing in flight: resting until a worker advances,
    /// declares or leaves (or a grant, a wanted round, `until`); one that slept is followed by
    /// a round at once.
    AwaitingNews { until: Nanos, slept: bool },
}

/// The service's cadence and what its workers wait for (see the module documentation).
#[derive(Debug)]
pub(crate) struct ServiceSchedule {
    round_time: Nanos,
    sync_every: Nanos,
    phase: Phase,
    /// When the next round is due.
    next_round: Nanos,
    /// Round times to the next round (see [`MAX_STRETCH`]).
    stretch: u32,
    /// When the last sync round of the replicas started.
    last_sync: Nanos,
    /// Each declaring worker's current clock.
    clocks: BTreeMap<u16, u64>,
    /// A worker advanced, declared or left since the last round began.
    news: bool,
    /// Some window is declared (as of the last round or declaration).
    windows: bool,
    /// Replicas are kept or replica operations are in flight (as of the service's last act).
    replicas_busy: bool,
    /// A worker waits for a round to tell the homes (before a barrier).
    round_wanted: bool,
    /// Somebody (the service or a worker) holds the turn to tell the homes a round.
    telling: bool,
    /// Rounds that took the news, and rounds told to the homes.
    rounds_started: u64,
    rounds_told: u64,
    /// Times the service took the waiting grants, and times it then had started their moves
    /// and replicas.
    takes_begun: u64,
    takes_done: u64,
    /// Workers waiting for quiet replicas around a barrier: no sync round of the service's own
    /// starts meanwhile.
    barrier_syncs: usize,
    /// Relocations are held (a checkpoint's cut comes): no grant is taken up.
    held: bool,
    /// While held: the service's relocations in flight have all landed since the hold began.
    settled: bool,
    running: bool,
    stopped: bool,
}

impl ServiceSchedule {
    /// A schedule with rounds every `round_time` and the replicas' sync rounds every
    /// `sync_every` (both in nanoseconds); its times are set when it starts
    /// ([`ServiceSchedule::start`]).
    pub fn new(round_time: Nanos, sync_every: Nanos) -> ServiceSchedule {
        ServiceSchedule {
            round_time,
            sync_every,
            phase: Phase::Decide,
            next_round: 0,
            stretch: 1,
            last_sync: 0,
            clocks: BTreeMap::new(),
            news: false,
            windows: false,
            replicas_busy: false,
            round_wanted: false,
            telling: false,
            rounds_started: 0,
            rounds_told: 0,
            takes_begun: 0,
            takes_done: 0,
            barrier_syncs: 0,
            held: false,
            settled: false,
            running: false,
            stopped: false,
        }
    }

    /// Whether the service is resting in a way that `event` ends: every event that can change
    /// what the service does asks this.
    fn resting_for(&self, event: Wake) -> bool {
        match self.phase {
            Phase::Resting => matches!(event, Wake::Grants | Wake::RoundWanted | Wake::Hold),
            Phase::Idle => matches!(event, Wake::Grants | Wake::RoundWanted | Wake::Declared | Wake::Hold),
            Phase::AwaitingNews { .. } => event != Wake::Turn,
            Phase::AwaitingTurn => event == Wake::Turn,
            _ => false,
        }
    }

    /// What the service does now, at `now`, with grants waiting for it or not (see [`Next`]).
    /// While relocations are held, grants wait without waking it.
    pub fn next(&mut self, now: Nanos, grants_waiting: bool) -> Next {
        let grants_waiting = grants_waiting && !self.held;
        loop {
            if self.stopped {
                return Next::Stop;
            }
            // A hold begun: an act at once (before a round that is due), which waits for the
            // relocations in flight to land.
            if self.held && !self.settled && matches!(self.phase, Phase::Decide | Phase::Resting | Phase::Idle | Phase::AwaitingNews { .. }) {
                self.phase = Phase::ActBetween;
                return Next::Act;
            }
            match self.phase {
                Phase::Decide => {
                    if now < self.next_round && !self.round_wanted {
                        self.phase = Phase::ActBetween;
                        return Next::Act;
                    }
                    if !self.windows && !grants_waiting && !self.replicas_busy && !self.round_wanted {
                        self.phase = Phase::Idle;
                        return Next::Rest { until: now.saturating_add(QUIET_REST) };
                    }
                    if !self.claim_round() {
                        self.phase = Phase::AwaitingTurn;
                        return Next::Rest { until: now.saturating_add(QUIET_REST) };
                    }
                    let (clocks, news) = self.begin_round();
                    self.phase = Phase::InRound { began: now, news };
                    return Next::Round { clocks };
                }
                Phase::Resting => {
                    if !grants_waiting && !self.round_wanted && now < self.next_round {
                        return Next::Rest { until: self.next_round };
                    }
                    self.phase = Phase::Decide;
                }
                Phase::Idle => {
                    if !self.windows && !grants_waiting && !self.replicas_busy && !self.round_wanted {
                        return Next::Rest { until: now.saturating_add(QUIET_REST) };
                    }
                    self.phase = Phase::Decide;
                }
                Phase::AwaitingTurn => {
                    if self.telling {
                        return Next::Rest { until: now.saturating_add(QUIET_REST) };
                    }
                    self.phase = Phase::Decide;
                }
                Phase::AwaitingNews { until, slept } => {
                    let woken = self.news || grants_waiting || self.round_wanted;
                    if !woken && now < until {
                        self.phase = Phase::AwaitingNews { until, slept: true };
                        return Next::Rest { until };
                    }
                    if slept {
                        // Something happened while it rested (or the rest ran out): a round now.
                        self.next_round = now;
                    }
                    self.phase = Phase::Resting;
                }
                // The driver is doing what it was told; asked again, it is told the same.
                Phase::InRound { .. } => return Next::Rest { until: now },
                Phase::ActAfterRound { .. } | Phase::ActBetween => return Next::Act,
            }
        }
    }

    /// The service's round (the last [`Next::Round`]) was told to the homes, or a worker's
    /// round was (see [`ServiceSchedule::claim_round`]); `windows`: whether any window is
    /// still declared; `windows_moved`: whether the round took, started or dropped one.
    /// Returns whether the resting service must be woken (its turn to tell a round came).
    pub fn round_told(&mut self, windows: bool, windows_moved: bool) -> bool {
        self.telling = false;
        self.rounds_told = self.rounds_started;
        self.windows = windows;
        if let Phase::InRound { began, news } = self.phase {
            self.phase = Phase::ActAfterRound { began, news, windows_moved };
        }
        self.resting_for(Wake::Turn)
    }

    /// The service acted ([`Next::Act`]) at `now`; `idle`: no relocation it started is still in
    /// flight. After a round, sets the next round's time (see [`MAX_STRETCH`]).
    pub fn acted(&mut self, now: Nanos, idle: bool) {
        if self.held && idle {
            self.settled = true;
        }
        match self.phase {
            Phase::ActAfterRound { began, news, windows_moved } => {
                let quiet = idle && !self.replicas_busy;
                self.stretch = if quiet && !windows_moved { (self.stretch * 2).min(MAX_STRETCH) } else { 1 };
                self.next_round = began.saturating_add(self.round_time * self.stretch as u64);
                self.phase = if quiet && !news { Phase::AwaitingNews { until: now.saturating_add(QUIET_REST), slept: false } } else { Phase::Resting };
            }
            Phase::ActBetween => self.phase = Phase::Resting,
            _ => {}
        }
    }

    /// Takes the turn to tell the homes a round; false if somebody holds it (a worker then waits
    /// for it to be given back, and tries again). Give it back with
    /// [`ServiceSchedule::round_told`] or [`ServiceSchedule::release_round`].
    pub fn claim_round(&mut self) -> bool {
        if self.telling {
            return false;
        }
        self.telling = true;
        true
    }

    /// Whether somebody holds the turn to tell the homes a round (tests).
    #[cfg(test)]
    pub fn turn_taken(&self) -> bool {
        self.telling
    }

    /// Gives back a turn claimed for a round that was not run. Returns whether the resting
    /// service must be woken.
    pub fn release_round(&mut self) -> bool {
        self.telling = false;
        self.resting_for(Wake::Turn)
    }

    /// Starts a round with the turn held: counts it, takes the news and the wanted round, and
    /// returns the workers' clocks and whether there was news.
    pub fn begin_round(&mut self) -> (BTreeMap<u16, u64>, bool) {
        debug_assert!(self.telling, "a round begins with the turn to tell it");
        self.rounds_started += 1;
        self.round_wanted = false;
        (self.clocks.clone(), std::mem::take(&mut self.news))
    }

    /// Claims the turn and begins a round, as the service or a worker would (tests).
    #[cfg(test)]
    pub fn begin_round_for_test(&mut self) -> (BTreeMap<u16, u64>, bool) {
        assert!(self.claim_round(), "the turn is free");
        let round = self.begin_round();
        self.round_told(self.windows, false);
        round
    }

    /// Rounds started and rounds told (tests).
    #[cfg(test)]
    pub fn rounds_for_test(&self) -> (u64, u64) {
        (self.rounds_started, self.rounds_told)
    }

    /// Each declaring worker's current clock.
    pub fn clocks(&self) -> &BTreeMap<u16, u64> {
        &self.clocks
    }

    /// Whether a worker advanced, declared or left since the last round began.
    pub fn has_news(&self) -> bool {
        self.news
    }

    /// Worker `worker` declared windows in clock `clock`. Returns whether the resting service
    /// must be woken.
    pub fn declare(&mut self, worker: u16, clock: u64) -> bool {
        self.clocks.insert(worker, clock);
        self.news = true;
        self.windows = true;
        self.resting_for(Wake::Declared)
    }

    /// Whether the service thread should be started now, at `now` (once, unless stopped):
    /// marks it running; its first round is due at once, its first sync round one sync period
    /// later (replicas are made fresh). A driver that then cannot start it calls
    /// [`ServiceSchedule::not_started`].
    pub fn start(&mut self, now: Nanos) -> bool {
        if self.running || self.stopped {
            return false;
        }
        self.running = true;
        (self.next_round, self.last_sync) = (now, now);
        true
    }

    /// The service thread could not be started.
    pub fn not_started(&mut self) {
        self.running = false;
    }

    /// Whether the service thread runs.
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Worker `worker` is in clock `clock` now (ignored for a worker that never declared).
    /// Returns whether the resting service must be woken: only while it waits for news, so that
    /// a worker completing a clock every few hundred microseconds does not wake it for each.
    pub fn note_clock(&mut self, worker: u16, clock: u64) -> bool {
        let Some(c) = self.clocks.get_mut(&worker) else { return false };
        *c = clock;
        self.news = true;
        self.resting_for(Wake::News)
    }

    /// Worker `worker` left (its windows end at the next round). Returns whether the resting
    /// service must be woken.
    pub fn forget_worker(&mut self, worker: u16) -> bool {
        if self.clocks.remove(&worker).is_none() {
            return false;
        }
        self.news = true;
        self.resting_for(Wake::News)
    }

    /// The homes granted this node moves or replicas (or a worker leaving a barrier is about to
    /// wait for their take-up). Returns whether the resting service must be woken.
    pub fn grants_arrived(&self) -> bool {
        !self.held && self.resting_for(Wake::Grants)
    }

    /// Holds the relocations (a checkpoint's cut comes, which must find every key at rest): no
    /// grant is taken up until [`ServiceSchedule::release_moves`], and the service acts at once
    /// to see its relocations in flight land ([`ServiceSchedule::settling`]); then
    /// [`ServiceSchedule::moves_settled`]. Rounds go on (a worker's barrier waits for them), and
    /// so do the replicas' operations, which move no key. Returns whether the resting service
    /// must be woken.
    pub fn hold_moves(&mut self) -> bool {
        self.held = true;
        self.settled = false;
        self.resting_for(Wake::Hold)
    }

    /// Ends a hold: the grants that waited are taken up. Returns whether the resting service
    /// must be woken (`grants_waiting`: grants wait).
    pub fn release_moves(&mut self, grants_waiting: bool) -> bool {
        self.held = false;
        self.settled = false;
        grants_waiting && self.resting_for(Wake::Grants)
    }

    /// Whether relocations are held and none started by the service is in flight (none ever
    /// was if the service does not run).
    pub fn moves_settled(&self) -> bool {
        self.held && (self.settled || !self.running)
    }

    /// Whether the service's act waits for all of its relocations in flight (a hold began and
    /// they have not landed yet).
    pub fn settling(&self) -> bool {
        self.held && !self.settled
    }

    /// Whether the service may take up grants now (relocations are not held).
    pub fn may_take_up(&self) -> bool {
        !self.held
    }

    /// Whether replicas are kept or replica operations in flight, as the service's act left
    /// them: the service keeps running rounds while so.
    pub fn set_replicas_busy(&mut self, busy: bool) {
        self.replicas_busy = busy;
    }

    /// A worker before a barrier wants the homes told every change of this node's levels:
    /// `None` if nothing happened since the last round and that round was told (a round now
    /// would find the same clocks and horizons); else the count of rounds started now — the
    /// worker waits until [`ServiceSchedule::told_since`] it — and whether the resting service
    /// must be woken.
    pub fn want_round(&mut self) -> Option<(u64, bool)> {
        if !self.news && self.rounds_told == self.rounds_started {
            return None;
        }
        self.round_wanted = true;
        Some((self.rounds_started, self.resting_for(Wake::RoundWanted)))
    }

    /// Whether a round that started after `started` rounds has been told.
    pub fn told_since(&self, started: u64) -> bool {
        self.rounds_told > started
    }

    /// The service takes the grants waiting for it (the driver takes them from the protocol
    /// with this schedule held, so that a worker's [`ServiceSchedule::take_up_target`] sees
    /// either the grants or the take-up).
    pub fn begin_take(&mut self) {
        self.takes_begun += 1;
    }

    /// The grants taken have their moves and replicas started. Workers waiting for it go on.
    pub fn finish_take(&mut self) {
        self.takes_done += 1;
    }

    /// The take-up a worker leaving a barrier waits for (see
    /// [`ServiceSchedule::taken_up`]): the next one if grants wait, else the one in progress;
    /// `None` if neither, or the service does not run.
    pub fn take_up_target(&self, grants_waiting: bool) -> Option<u64> {
        if !self.running || self.held {
            None
        } else if grants_waiting {
            Some(self.takes_begun + 1)
        } else if self.takes_done < self.takes_begun {
            Some(self.takes_begun)
        } else {
            None
        }
    }

    /// Whether take-up `target` has its moves and replicas started.
    pub fn taken_up(&self, target: u64) -> bool {
        self.takes_done >= target
    }

    /// A worker waits for quiet replicas around a barrier: the service starts no sync round of
    /// its own until [`ServiceSchedule::release_syncs`].
    pub fn hold_off_syncs(&mut self) {
        self.barrier_syncs += 1;
    }

    /// The worker stopped waiting for quiet replicas.
    pub fn release_syncs(&mut self) {
        self.barrier_syncs = self.barrier_syncs.saturating_sub(1);
    }

    /// Whether the service starts a sync round of its replicas now (its replicas being quiet
    /// and not empty): none while a barrier holds them off, else one every `sync_every`.
    /// Counts it as started if so.
    pub fn sync_due(&mut self, now: Nanos) -> bool {
        if self.barrier_syncs > 0 || now.saturating_sub(self.last_sync) < self.sync_every {
            return false;
        }
        self.last_sync = now;
        true
    }

    /// The service stops: [`ServiceSchedule::next`] says so from now on (the driver wakes it and
    /// the workers waiting for it).
    pub fn stop(&mut self) {
        self.stopped = true;
    }

    /// Whether the service was told to stop.
    pub fn stopped(&self) -> bool {
        self.stopped
    }
}

/// The events that can end the service's rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// A worker advanced, declared or left.
    News,
    /// A worker declared windows.
    Declared,
    /// The homes granted moves or replicas.
    Grants,
    /// A worker waits for a round.
    RoundWanted,
    /// The turn to tell a round was given back.
    Turn,
    /// Relocations are to be held.
    Hold,
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    /// A schedule of 1 ms rounds and 20 ms syncs, running, with worker 0 declared at clock 0.
    fn declared() -> ServiceSchedule {
        let mut s = ServiceSchedule::new(MS, 20 * MS);
        assert!(s.start(0) && !s.start(0), "started once");
        s.declare(0, 0);
        s
    }

    /// Runs the service's round at `now` (told at once, `moved` windows), then its act.
    fn round(s: &mut ServiceSchedule, now: Nanos, moved: bool, idle: bool) {
        assert!(matches!(s.next(now, false), Next::Round { .. }));
        s.round_told(true, moved);
        assert_eq!(s.next(now, false), Next::Act);
        s.acted(now, idle);
    }

    #[test]
    fn rounds_come_every_round_time_and_grants_between_them_only_act() {
        let mut s = declared();
        s.note_clock(0, 1);
        round(&mut s, 0, true, false);
        assert_eq!(s.next(MS / 2, false), Next::Rest { until: MS });
        // A grant arrives: the resting service is woken, acts, and rests again.
        assert!(s.grants_arrived());
        assert_eq!(s.next(MS / 2, true), Next::Act);
        assert!(!s.grants_arrived(), "an acting service needs no wake-up");
        s.acted(MS / 2, false);
        assert_eq!(s.next(MS / 2, false), Next::Rest { until: MS });
        // A clock does not wake it while it rests for the next round.
        assert!(!s.note_clock(0, 2));
        let Next::Round { clocks } = s.next(MS, false) else { panic!("no round at the round time") };
        assert_eq!(clocks.get(&0), Some(&2));
    }

    #[test]
    fn rounds_that_move_nothing_stretch_up_to_the_limit_and_one_that_moves_resets() {
        let mut s = declared();
        let mut now = 0;
        let mut gaps = Vec::new();
        for _ in 0..5 {
            s.note_clock(0, now);
            round(&mut s, now, false, true);
            let Next::Rest { until } = s.next(now, false) else { panic!("no rest") };
            gaps.push((until - now) / MS);
            now = until;
        }
        assert_eq!(gaps, vec![2, 4, 8, 8, 8]);
        s.note_clock(0, now);
        round(&mut s, now, true, true);
        assert_eq!(s.next(now, false), Next::Rest { until: now + MS });
        // Something in flight resets it too.
        s.note_clock(0, now + MS);
        round(&mut s, now + MS, false, false);
        assert_eq!(s.next(now + MS, false), Next::Rest { until: now + 2 * MS });
    }

    #[test]
    fn a_round_without_news_rests_until_a_worker_advances_and_then_rounds_at_once() {
        let mut s = declared();
        round(&mut s, 0, true, true);
        // The round took the news: the next one would see the same clocks.
        round(&mut s, MS, false, true);
        assert_eq!(s.next(MS, false), Next::Rest { until: MS + QUIET_REST });
        // A clock wakes it now, and the round comes at once, not at the round time.
        assert!(s.note_clock(0, 1));
        assert!(matches!(s.next(MS + 10, false), Next::Round { .. }));
        // That round had news: the cadence goes on (stretched: it moved nothing).
        s.round_told(true, false);
        assert_eq!(s.next(MS + 10, false), Next::Act);
        s.acted(MS + 10, true);
        let at = MS + 10 + 4 * MS;
        assert_eq!(s.next(MS + 10, false), Next::Rest { until: at });
        // Without news, the rest for it runs out after QUIET_REST and a round follows.
        round(&mut s, at, false, true);
        assert_eq!(s.next(at, false), Next::Rest { until: at + QUIET_REST });
        assert!(matches!(s.next(at + QUIET_REST, false), Next::Round { .. }));
    }

    #[test]
    fn news_before_the_quiet_rest_keeps_the_cadence() {
        let mut s = declared();
        round(&mut s, 0, true, true);
        // No news in the round, but a clock came during its act: no rest for news.
        assert!(matches!(s.next(MS, false), Next::Round { .. }));
        s.round_told(true, false);
        assert_eq!(s.next(MS, false), Next::Act);
        s.note_clock(0, 5);
        s.acted(MS, true);
        assert_eq!(s.next(MS, false), Next::Rest { until: 3 * MS }, "rests for the stretched round time instead");
    }

    #[test]
    fn with_nothing_declared_granted_or_kept_the_service_waits_for_work() {
        let mut s = ServiceSchedule::new(MS, 20 * MS);
        s.start(0);
        assert_eq!(s.next(0, false), Next::Rest { until: QUIET_REST });
        assert!(!s.note_clock(3, 1), "a worker that never declared is no news");
        assert!(s.declare(3, 1), "a declaration wakes it");
        assert!(matches!(s.next(10, false), Next::Round { .. }));
        // Grants alone make work too.
        s.round_told(false, true);
        assert_eq!(s.next(10, false), Next::Act);
        s.acted(10, true);
        assert_eq!(s.next(MS + 10, false), Next::Rest { until: MS + 10 + QUIET_REST });
        assert!(s.grants_arrived());
        assert!(matches!(s.next(MS + 20, true), Next::Round { .. }));
    }

    #[test]
    fn a_worker_wanting_a_round_gets_one_started_after_it_asked() {
        let mut s = declared();
        round(&mut s, 0, true, false);
        // Told, and nothing happened since: nothing to wait for.
        assert_eq!(s.want_round(), None);
        s.note_clock(0, 1);
        let (started, wake) = s.want_round().expect("news to tell");
        assert!(wake, "the resting service is woken for it");
        // The round is run at once, not at the round time.
        assert!(matches!(s.next(10, false), Next::Round { .. }));
        assert!(!s.told_since(started));
        s.round_told(true, false);
        assert!(s.told_since(started));
        // A round under way when the worker asks is not enough: it took the news before.
        s.acted(10, false);
        assert!(matches!(s.next(MS + 10, false), Next::Round { .. }));
        let (started, _) = s.want_round().expect("the round under way is not told");
        s.round_told(true, false);
        assert!(!s.told_since(started), "the round that was under way does not count");
    }

    #[test]
    fn rounds_are_told_one_at_a_time() {
        let mut s = declared();
        // A worker tells a round of its own.
        assert!(s.claim_round());
        let (clocks, news) = s.begin_round();
        assert!(news && clocks.contains_key(&0));
        s.note_clock(0, 1);
        // The service's round waits for its turn, and is woken when the worker told its round.
        assert_eq!(s.next(0, false), Next::Rest { until: QUIET_REST });
        assert!(!s.claim_round(), "one turn at a time");
        assert!(!s.grants_arrived(), "waiting for its turn, grants do not wake it");
        assert!(s.round_told(true, true), "the service is woken for its turn");
        assert!(matches!(s.next(1, false), Next::Round { .. }));
        assert!(!s.claim_round(), "the service holds the turn during its round");
        s.round_told(true, true);
        // A claimed turn given back unused wakes a waiting service too.
        s.acted(1, false);
        assert!(s.claim_round());
        s.note_clock(0, 2);
        assert_eq!(s.next(MS + 1, false), Next::Rest { until: MS + 1 + QUIET_REST });
        assert!(s.release_round());
        assert!(matches!(s.next(MS + 2, false), Next::Round { .. }));
    }

    #[test]
    fn a_worker_leaving_a_barrier_waits_for_the_take_up_of_grants_waiting_or_in_progress() {
        let mut s = declared();
        assert_eq!(s.take_up_target(false), None);
        let target = s.take_up_target(true).expect("grants wait");
        assert!(!s.taken_up(target));
        s.begin_take();
        assert_eq!(s.take_up_target(false), Some(target), "a take-up in progress is waited for");
        s.finish_take();
        assert!(s.taken_up(target));
        assert_eq!(s.take_up_target(false), None);
        // Without the service there is nothing to wait for.
        let stopped = ServiceSchedule::new(MS, MS);
        assert_eq!(stopped.take_up_target(true), None);
    }

    #[test]
    fn sync_rounds_come_every_sync_period_unless_a_barrier_holds_them_off() {
        let mut s = declared();
        assert!(!s.sync_due(10 * MS));
        s.hold_off_syncs();
        assert!(!s.sync_due(20 * MS), "held off by a barrier");
        s.release_syncs();
        assert!(s.sync_due(20 * MS));
        assert!(!s.sync_due(30 * MS), "counted from the last one");
        assert!(s.sync_due(40 * MS));
    }

    #[test]
    fn a_hold_acts_at_once_takes_up_no_grant_until_released_and_settles_when_nothing_is_in_flight() {
        let mut s = declared();
        s.note_clock(0, 1);
        round(&mut s, 0, true, false);
        assert_eq!(s.next(MS / 2, false), Next::Rest { until: MS });
        assert!(!s.moves_settled());
        // Held while resting with a relocation in flight: woken, and acts before the next round.
        assert!(s.hold_moves(), "the resting service is woken");
        assert!(s.settling() && !s.may_take_up());
        assert_eq!(s.next(MS / 2, false), Next::Act);
        s.acted(MS / 2, false);
        assert!(!s.moves_settled(), "a relocation is still in flight");
        assert_eq!(s.next(MS / 2, false), Next::Act, "it acts again until they land");
        s.acted(MS / 2, true);
        assert!(s.moves_settled() && !s.settling());
        // Grants neither wake nor move it while held, and no barrier waits for their take-up.
        assert!(!s.grants_arrived());
        assert_eq!(s.take_up_target(true), None);
        assert_eq!(s.next(MS / 2, true), Next::Rest { until: MS });
        // Rounds go on while held.
        let Next::Round { .. } = s.next(MS, true) else { panic!("no round while held") };
        s.round_told(true, false);
        assert_eq!(s.next(MS, true), Next::Act);
        s.acted(MS, true);
        // Released: the grants that waited wake it and are taken up.
        assert!(s.release_moves(true));
        assert!(s.may_take_up() && !s.moves_settled());
        assert_eq!(s.next(MS + MS / 2, true), Next::Act);
        assert_eq!(s.take_up_target(true), Some(1));
        // A service that never ran has nothing in flight: settled at once.
        let mut idle = ServiceSchedule::new(MS, MS);
        idle.hold_moves();
        assert!(idle.moves_settled());
    }

    #[test]
    fn busy_replicas_keep_rounds_coming_and_a_stop_ends_everything() {
        let mut s = ServiceSchedule::new(MS, MS);
        s.start(0);
        s.set_replicas_busy(true);
        assert!(matches!(s.next(0, false), Next::Round { .. }));
        s.round_told(false, false);
        s.acted(0, true);
        assert_eq!(s.next(0, false), Next::Rest { until: MS }, "no stretch and no rest for news while replicas are kept");
        s.stop();
        assert_eq!(s.next(0, false), Next::Stop);
        assert!(!s.start(0), "a stopped service is not started again");
    }
}
