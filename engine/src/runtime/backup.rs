//! Around the node's backup rounds (`protocol::backup`): the workers' wait for their round, and
//! a watchdog thread.
//!
//! Rounds need no thread of their own: the step that holds an answer for a round, completes a
//! round with answers or workers still waiting, or takes over a lost node's keys begins the
//! next round itself, and a worker that waits for a round begins it when none under way began
//! after its write. The watchdog gives the rounds under way up when one was not acknowledged
//! within the operation timeout (the next round then sends every image), and begins a round
//! that is due should none of the above have.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::NodeInner;
use crate::error::{Error, Result};
use crate::protocol::Progress;

/// How often the watchdog looks when nothing wakes it.
const WATCH: Duration = Duration::from_millis(50);

impl NodeInner {
    /// The watchdog thread (see the module documentation).
    pub fn run_backups(&self) {
        let counters = self.core.backup_counters();
        let mut round_began: Option<(u32, Instant)> = None;
        while !self.stopping.load(Ordering::Acquire) {
            {
                let mut guard = self.backup_lock.lock();
                if !self.stopping.load(Ordering::Acquire) {
                    self.backup_cv.wait_for(&mut guard, WATCH);
                }
            }
            if self.core.backup_round_due() || self.core.leave_check_due() {
                let _ = self.run_pooled(|step, _, _| {
                    // (A node leaving a cluster that relocates keys checks how far it got.)
                    step.advance_leave();
                    step.begin_backup_round_if_due();
                    Ok(Progress::Done)
                });
            }
            let (_, under_way) = self.core.backup_pending();
            if !under_way {
                round_began = None;
                continue;
            }
            let number = counters.last_begun();
            let began = match round_began {
                Some((n, at)) if n == number => at,
                _ => round_began.insert((number, Instant::now())).1,
            };
            if began.elapsed() >= self.config.op_timeout {
                tracing::warn!(node = self.config.rank, round = number, "a backup round was not acknowledged in time; the next one sends every image");
                let _ = self.run_pooled(|step, _, _| {
                    step.give_up_backup_round();
                    step.begin_backup_round_if_due();
                    Ok(Progress::Done)
                });
            }
        }
    }

    /// Asks for round `round` (or a later one) to run, without waiting: begins it here when
    /// none is under way.
    pub fn want_backup(&self, round: u32) {
        self.core.backup_counters().want(round);
        let _ = self.run_pooled(|step, _, _| {
            step.begin_backup_round_if_due();
            Ok(Progress::Done)
        });
    }

    /// Waits until backup round `round` (or a later one) has completed: the writes applied
    /// before it began are on their backups. At most the operation timeout.
    pub fn await_backup(&self, round: u32) -> Result<()> {
        let counters = self.core.backup_counters();
        if counters.completed(round) {
            return Ok(());
        }
        self.want_backup(round);
        let deadline = Instant::now() + self.config.op_timeout;
        let mut guard = self.backup_lock.lock();
        while !counters.completed(round) {
            if self.stopping.load(Ordering::Acquire) {
                return Err(Error::ShutDown);
            }
            let now = Instant::now();
            if now >= deadline {
                let nodes = self.core.directory().backup_targets().into_iter().map(usize::from).collect();
                return Err(Error::Timeout { what: "pushes to be backed up", millis: self.config.op_timeout.as_millis() as u64, nodes });
            }
            self.backup_cv.wait_until(&mut guard, deadline.min(now + WATCH));
        }
        Ok(())
    }

    /// Wakes the workers waiting for rounds and the watchdog (a step changed backup state, or
    /// the node stops).
    pub(crate) fn wake_backups(&self) {
        let _guard = self.backup_lock.lock();
        self.backup_cv.notify_all();
    }
}
