//! How long a waiting worker polls for its answer before it blocks.
//!
//! Polling costs a core and a block costs a wake-up, so the worker polls about as long as
//! answers have been taking: twice their running typical wait, at least [`PollWindow::MIN`]
//! (a fast network's round trip is well inside it) and at most [`PollWindow::MAX`] (a wait
//! longer than that is not worth a core). In the soft-RoCE VM a single-key round trip takes
//! 150–700 µs and a fixed 100 µs window blocked on every one of them.

use std::time::Duration;

/// The adaptive polling window of one worker.
#[derive(Debug, Clone)]
pub(crate) struct PollWindow {
    /// Running typical wait for an answer (an exponential average, weight 1/8), in ns.
    typical_ns: u64,
}

impl Default for PollWindow {
    fn default() -> Self {
        PollWindow { typical_ns: PollWindow::MIN.as_nanos() as u64 / 2 }
    }
}

impl PollWindow {
    /// The shortest window.
    pub const MIN: Duration = Duration::from_micros(100);
    /// The longest window.
    pub const MAX: Duration = Duration::from_millis(1);

    /// How long to poll now.
    pub fn window(&self) -> Duration {
        Duration::from_nanos(self.typical_ns.saturating_mul(2)).clamp(PollWindow::MIN, PollWindow::MAX)
    }

    /// A wait that ended with a delivery after `waited` (polling or blocked).
    pub fn record(&mut self, waited: Duration) {
        let waited = waited.min(PollWindow::MAX).as_nanos() as u64;
        self.typical_ns = (self.typical_ns * 7 + waited) / 8;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_follows_the_answers_within_its_bounds() {
        let mut w = PollWindow::default();
        assert_eq!(w.window(), PollWindow::MIN);
        for _ in 0..100 {
            w.record(Duration::from_micros(10));
        }
        assert_eq!(w.window(), PollWindow::MIN, "fast answers keep the shortest window");
        for _ in 0..100 {
            w.record(Duration::from_micros(300));
        }
        let window = w.window();
        assert!(window > Duration::from_micros(550) && window <= Duration::from_micros(600), "{window:?}");
        for _ in 0..100 {
            w.record(Duration::from_secs(5));
        }
        assert_eq!(w.window(), PollWindow::MAX, "a long wait counts as the longest window");
        for _ in 0..6 {
            w.record(Duration::from_micros(1));
        }
        assert!(w.window() < PollWindow::MAX, "a few fast answers bring it down");
    }
}
