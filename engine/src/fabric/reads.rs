//! One-sided reads in flight: their completions, and the registered buffers they land in.
//!
//! A read is posted into a landing buffer of the fabric's own and finished later, so a caller
//! can post several reads and do other work instead of waiting a network round trip per read
//! (the intent service's sync round does), and readers on several threads are not served one
//! at a time. Each read in flight has a buffer to itself; a finished read's buffer is reused by
//! the next. A read that failed or timed out may still be answered, so its buffer is retired:
//! kept, still registered, and never reused, so a late answer lands where nobody looks.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

/// A one-sided read in flight ([`super::Fabric::post_read`]); [`super::Fabric::finish_read`]
/// takes its bytes.
#[derive(Debug)]
#[must_use = "a posted read holds a landing buffer until it is finished"]
pub struct PostedRead {
    pub(super) id: u64,
    pub(super) peer: usize,
    pub(super) len: usize,
}

impl PostedRead {
    /// How many bytes the read fetches.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The peer read from.
    #[cfg(test)]
    pub fn peer(&self) -> usize {
        self.peer
    }
}

/// Outstanding one-sided reads and the threads waiting for them.
#[derive(Default)]
pub(crate) struct ReadWaiters {
    done: Mutex<HashMap<u64, Option<Result<()>>>>,
    changed: Condvar,
}

impl ReadWaiters {
    /// Registers read `id` before it is posted.
    pub(crate) fn expect(&self, id: u64) {
        self.done.lock().insert(id, None);
    }

    /// Forgets read `id`, which was never sent.
    fn forget(&self, id: u64) {
        self.done.lock().remove(&id);
    }

    /// Records read `id`'s outcome (ignored when nobody waits for it any more).
    pub(crate) fn complete(&self, id: u64, result: Result<()>) {
        let mut done = self.done.lock();
        if let Some(slot) = done.get_mut(&id) {
            *slot = Some(result);
            self.changed.notify_all();
        }
    }

    /// Fails every outstanding read (the connection they depend on is gone).
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn fail_all(&self, error: &Error) {
        let mut done = self.done.lock();
        for slot in done.values_mut().filter(|s| s.is_none()) {
            *slot = Some(Err(error.clone()));
        }
        self.changed.notify_all();
    }

    /// Whether read `id` has an outcome (or is not known: then waiting for it would not help).
    pub(crate) fn is_done(&self, id: u64) -> bool {
        !matches!(self.done.lock().get(&id), Some(None))
    }

    /// Waits for read `id` from `peer`; forgets it either way.
    pub(crate) fn wait(&self, id: u64, peer: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut done = self.done.lock();
        loop {
            match done.get(&id) {
                Some(Some(_)) => return done.remove(&id).flatten().expect("present"),
                Some(None) => {}
                None => return Err(Error::Transport(format!("one-sided read {id} from node {peer} is not in flight"))),
            }
            if self.changed.wait_until(&mut done, deadline).timed_out() {
                done.remove(&id);
                return Err(Error::Timeout { what: "one-sided read", millis: timeout.as_millis() as u64, nodes: vec![peer] });
            }
        }
    }
}

/// A registered buffer reads land in.
pub(crate) trait Landing {
    /// Its size in bytes.
    fn capacity(&self) -> usize;
}

/// The landing buffers of a fabric's reads: free ones, the ones lent to reads in flight, and
/// retired ones.
pub(crate) struct Landings<B> {
    state: Mutex<LandingState<B>>,
}

struct LandingState<B> {
    free: Vec<B>,
    lent: HashMap<u64, B>,
    retired: Vec<B>,
}

impl<B> Default for Landings<B> {
    fn default() -> Self {
        Landings { state: Mutex::new(LandingState { free: Vec::new(), lent: HashMap::new(), retired: Vec::new() }) }
    }
}

impl<B: Landing> Landings<B> {
    /// Lends read `id` a free buffer of at least `len` bytes, or one `make` makes (given the
    /// size to make: `len` rounded up to a power of two, so that growing reads soon stop
    /// making buffers), and returns what `view` makes of it (the address the read lands at).
    /// Free buffers too small for any read to come are not kept: when none fits, the smallest
    /// free one goes to `discard`.
    pub(crate) fn lend<R>(&self, id: u64, len: usize, make: impl FnOnce(usize) -> Result<B>, discard: impl FnOnce(B), view: impl FnOnce(&B) -> R) -> Result<R> {
        let found = {
            let mut state = self.state.lock();
            match state.free.iter().position(|b| b.capacity() >= len) {
                Some(at) => Some(state.free.swap_remove(at)),
                None => {
                    if let Some(at) = (0..state.free.len()).min_by_key(|&i| state.free[i].capacity()) {
                        discard(state.free.swap_remove(at));
                    }
                    None
                }
            }
        };
        let buffer = match found {
            Some(b) => b,
            None => make(len.max(1).next_power_of_two())?,
        };
        let viewed = view(&buffer);
        self.state.lock().lent.insert(id, buffer);
        Ok(viewed)
    }

    /// Read `id` was never sent, so nothing will land in its buffer: it is free again, and
    /// `waiters` forget the read.
    pub(crate) fn unsent(&self, waiters: &ReadWaiters, id: u64) {
        waiters.forget(id);
        let mut state = self.state.lock();
        if let Some(b) = state.lent.remove(&id) {
            state.free.push(b);
        }
    }

    /// Finishes `read`: waits for it in `waiters` at most `timeout`, then has `copy` copy its
    /// buffer's first bytes into `out`, and frees the buffer — or retires it if the read did not
    /// complete successfully.
    pub(crate) fn finish(
        &self,
        waiters: &ReadWaiters,
        read: PostedRead,
        out: &mut [u8],
        timeout: Duration,
        copy: impl FnOnce(&B, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        if let Err(e) = waiters.wait(read.id, read.peer, timeout) {
            self.retire(read.id);
            return Err(e);
        }
        // Completed: nothing writes into the buffer any more, so it is copied outside the lock.
        let buffer = self.state.lock().lent.remove(&read.id);
        let Some(buffer) = buffer else {
            return Err(Error::Transport(format!("one-sided read {} has no landing buffer", read.id)));
        };
        let copied = if out.len() == read.len {
            copy(&buffer, out)
        } else {
            Err(Error::Transport(format!("a one-sided read of {} bytes finished into {} bytes", read.len, out.len())))
        };
        self.state.lock().free.push(buffer);
        copied
    }

    /// Read `id` failed or timed out and may still be answered: its buffer is never reused.
    fn retire(&self, id: u64) {
        let mut state = self.state.lock();
        if let Some(b) = state.lent.remove(&id) {
            state.retired.push(b);
        }
    }

    /// How many buffers are free, lent and retired.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize, usize) {
        let state = self.state.lock();
        (state.free.len(), state.lent.len(), state.retired.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Buf(usize);

    impl Landing for Buf {
        fn capacity(&self) -> usize {
            self.0
        }
    }

    /// Lends read `id` a buffer for `len` bytes, recording what was made and discarded; returns
    /// the read and its buffer's size.
    fn lend(landings: &Landings<Buf>, waiters: &ReadWaiters, id: u64, len: usize, made: &mut Vec<usize>, discarded: &mut Vec<usize>) -> (PostedRead, usize) {
        let size = landings
            .lend(
                id,
                len,
                |n| {
                    made.push(n);
                    Ok(Buf(n))
                },
                |b| discarded.push(b.0),
                |b| b.0,
            )
            .unwrap();
        waiters.expect(id);
        (PostedRead { id, peer: 0, len }, size)
    }

    #[test]
    fn landings_are_reused_grown_and_retired() {
        let (landings, waiters): (Landings<Buf>, ReadWaiters) = Default::default();
        let (mut made, mut discarded) = (Vec::new(), Vec::new());
        let copy = |b: &Buf, out: &mut [u8]| {
            out.fill(b.0 as u8);
            Ok(())
        };
        let (one, size) = lend(&landings, &waiters, 1, 100, &mut made, &mut discarded);
        let (two, _) = lend(&landings, &waiters, 2, 10, &mut made, &mut discarded);
        assert_eq!(made, [128, 16], "each read in flight has a buffer of its own, a power of two");
        assert_eq!(size, 128);
        waiters.complete(1, Ok(()));
        let mut out = [0u8; 100];
        landings.finish(&waiters, one, &mut out, Duration::ZERO, copy).unwrap();
        assert_eq!(out[99], 128, "copied from the read's own buffer");
        waiters.complete(2, Ok(()));
        let err = landings.finish(&waiters, two, &mut [0u8; 9], Duration::ZERO, copy);
        assert!(err.is_err(), "a wrong length is refused");
        assert_eq!(landings.counts(), (2, 0, 0), "completed reads free their buffers");
        let (three, size) = lend(&landings, &waiters, 3, 120, &mut made, &mut discarded);
        assert_eq!((size, made.len()), (128, 2), "a free buffer that fits is reused");
        let (four, _) = lend(&landings, &waiters, 4, 1000, &mut made, &mut discarded);
        assert_eq!((made.len(), discarded.as_slice()), (3, [16].as_slice()), "a free buffer too small for it was let go");
        assert!(matches!(landings.finish(&waiters, four, &mut [0u8; 1000], Duration::from_millis(1), copy), Err(Error::Timeout { .. })));
        waiters.complete(3, Err(Error::ShutDown));
        assert!(landings.finish(&waiters, three, &mut [0u8; 120], Duration::ZERO, copy).is_err());
        assert_eq!(landings.counts(), (0, 0, 2), "a failed or timed-out read's buffer is never free again");
        assert!(landings.lend(5, 4096, |_| Err(Error::Memory("no".into())), |_| {}, |_| ()).is_err());
        assert_eq!(landings.counts(), (0, 0, 2), "a failed make lends nothing");
        let (never_sent, _) = lend(&landings, &waiters, 6, 50, &mut made, &mut discarded);
        landings.unsent(&waiters, never_sent.id);
        assert_eq!(landings.counts(), (1, 0, 2), "a read never sent frees its buffer");
        assert!(waiters.is_done(never_sent.id), "and nobody waits for it");
    }

    #[test]
    fn waiters_report_outcomes_and_time_out() {
        let waiters = ReadWaiters::default();
        waiters.expect(1);
        assert!(!waiters.is_done(1));
        waiters.complete(1, Ok(()));
        assert!(waiters.is_done(1));
        assert!(waiters.wait(1, 0, Duration::ZERO).is_ok());
        assert!(waiters.wait(1, 0, Duration::ZERO).is_err(), "forgotten once waited for");
        waiters.expect(2);
        assert!(matches!(waiters.wait(2, 3, Duration::from_millis(1)), Err(Error::Timeout { .. })));
        waiters.complete(2, Ok(()));
        assert!(waiters.is_done(2), "a read nobody waits for is never pending");
    }
}
