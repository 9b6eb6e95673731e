//! Timestamps of the points an operation's messages pass in this process, for measuring where
//! a single-key operation's time goes (`ferry-bench micro --only stages`).
//!
//! Off unless [`start`] was called; then each [`mark`] takes the monotonic clock (shared by the
//! processes of one host, so two nodes' points can be put in one order) and appends to a fixed
//! buffer. Off, a mark costs one relaxed load and a branch.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crate::monotonic_ns;

/// A point a message passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Point {
    /// A caller starts an operation (marked by the caller).
    Call = 0,
    /// A protocol step ended: its messages are encoded, not yet handed to the connection.
    Stepped = 1,
    /// Frames are about to be written to a connection (a send system call, or a verbs post,
    /// starts: on loopback the send call itself carries the bytes to the peer and wakes it).
    Sending = 2,
    /// Bytes were read from a connection (a receive system call, or a verbs receive
    /// completion, returned).
    Received = 3,
    /// A caller's operation returned (marked by the caller).
    Return = 4,
}

impl Point {
    const ALL: [Point; 5] = [Point::Call, Point::Stepped, Point::Sending, Point::Received, Point::Return];

    /// The point whose number (`point as u8`) is `n`, if any: how a trace written out as
    /// numbers is read back.
    pub fn from_number(n: u64) -> Option<Point> {
        Point::ALL.get(usize::try_from(n).ok()?).copied()
    }
}

/// Points a trace holds at most; later marks are dropped.
const CAPACITY: usize = 1 << 20;

struct Recorder {
    entries: Box<[AtomicU64]>,
    next: AtomicUsize,
}

static ON: AtomicBool = AtomicBool::new(false);
static RECORDER: OnceLock<Recorder> = OnceLock::new();

/// Starts recording (anew: points of an earlier trace are forgotten).
pub fn start() {
    let recorder = RECORDER.get_or_init(|| Recorder { entries: (0..CAPACITY).map(|_| AtomicU64::new(0)).collect(), next: AtomicUsize::new(0) });
    recorder.next.store(0, Ordering::Release);
    ON.store(true, Ordering::Release);
}

/// Stops recording and returns the points marked since [`start`], as (point, monotonic ns), in
/// the order they were appended.
pub fn stop() -> Vec<(Point, u64)> {
    ON.store(false, Ordering::Release);
    let Some(recorder) = RECORDER.get() else { return Vec::new() };
    let n = recorder.next.load(Ordering::Acquire).min(CAPACITY);
    recorder.entries[..n]
        .iter()
        .filter_map(|e| {
            let word = e.load(Ordering::Acquire);
            let point = Point::from_number(word & 7)?;
            (word != 0).then_some((point, word >> 3))
        })
        .collect()
}

/// Notes that this process passed `point` now, if a trace is being recorded.
#[inline]
pub fn mark(point: Point) {
    if ON.load(Ordering::Relaxed) {
        record(point);
    }
}

#[cold]
fn record(point: Point) {
    let Some(recorder) = RECORDER.get() else { return };
    let at = monotonic_ns();
    let i = recorder.next.fetch_add(1, Ordering::AcqRel);
    if let Some(entry) = recorder.entries.get(i) {
        entry.store(at << 3 | point as u64, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_are_kept_in_order_only_while_recording() {
        // Other tests of this process may send frames meanwhile and mark theirs: only the
        // caller's points are looked at.
        let callers = |trace: Vec<(Point, u64)>| trace.into_iter().filter(|&(p, _)| matches!(p, Point::Call | Point::Return)).collect::<Vec<_>>();
        mark(Point::Call);
        start();
        mark(Point::Call);
        mark(Point::Return);
        mark(Point::Call);
        let trace = callers(stop());
        mark(Point::Return);
        let points: Vec<Point> = trace.iter().map(|&(p, _)| p).collect();
        assert_eq!(points, [Point::Call, Point::Return, Point::Call]);
        assert!(trace.windows(2).all(|w| w[0].1 <= w[1].1), "times never go back: {trace:?}");
        start();
        assert!(callers(stop()).is_empty(), "a new trace starts empty");
    }
}
