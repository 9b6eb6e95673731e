//! A dedicated thread that drains a completion queue.
//!
//! It polls without pause while completions arrive; when the queue runs dry it keeps polling for
//! a short spin (traffic under load resumes within microseconds, and a spinning poller answers
//! in nanoseconds), then arms the queue, polls once more (a completion that arrived before
//! arming raises no event) and blocks on the completion channel, so an idle node costs no CPU
//! and the first completion after a pause wakes it in one scheduler wake-up — not after a sleep
//! of arbitrary length. A thread that waits for a completion of its own can poll the queue
//! itself through a [`PollHandle`] (as RDMA systems' workers do) while the poller thread stays
//! out of its way.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Result, VerbsError};
use crate::queue::{Completion, CompletionQueue};

/// How a poller waits when the queue is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// How long to keep polling without pause after the last completion.
    pub spin: Duration,
    /// The longest single blocking wait; the thread checks whether it should stop between waits.
    pub block: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { spin: Duration::from_micros(50), block: Duration::from_millis(20) }
    }
}

/// Receives completions, on the poller thread or a thread polling through a [`PollHandle`]
/// (never two at once).
pub trait CompletionHandler: Send + 'static {
    /// A batch of completions, in the queue's order.
    fn on_completions(&mut self, batch: &[Completion]);
    /// Polling the queue failed (the device is broken); the thread stops after this.
    fn on_poll_error(&mut self, error: VerbsError);
}

/// What a poller thread shares with the threads that poll for it ([`PollHandle`]).
struct Shared {
    cq: Arc<CompletionQueue>,
    /// The handler with its batch buffer: whoever polls holds it from the poll to the end of
    /// the handling, so completions are handled in the queue's order.
    handling: Mutex<(Box<dyn CompletionHandler>, Vec<Completion>)>,
    /// Threads polling through a [`PollHandle`] now: the poller thread does not spin meanwhile.
    pollers: AtomicUsize,
}

/// A running poller thread.
pub struct Poller {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

/// Lets other threads drain the poller's queue themselves: a thread waiting for a completion
/// polls instead of waiting for the poller thread to wake and hand it on.
#[derive(Clone)]
pub struct PollHandle {
    shared: Arc<Shared>,
}

impl PollHandle {
    /// Polls the queue once on the calling thread and hands what it holds to the handler;
    /// whether anything came. Returns false at once when another thread is polling.
    pub fn poll_now(&self) -> bool {
        let Some(mut handling) = self.shared.handling.try_lock() else { return false };
        let (handler, batch) = &mut *handling;
        batch.clear();
        match self.shared.cq.poll(batch, 64) {
            Ok(0) => false,
            Ok(_) => {
                handler.on_completions(batch);
                true
            }
            // The poller thread meets the failure too and reports it.
            Err(_) => false,
        }
    }

    /// Counts the caller as polling until [`PollHandle::stop_polling`]: the poller thread
    /// does not spin meanwhile, so that the caller keeps its core.
    pub fn start_polling(&self) {
        self.shared.pollers.fetch_add(1, Ordering::AcqRel);
    }

    /// Ends a [`PollHandle::start_polling`].
    pub fn stop_polling(&self) {
        let _ = self.shared.pollers.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

impl Poller {
    /// Starts a thread named `name` that drains `cq` into `handler`.
    pub fn spawn(name: String, cq: Arc<CompletionQueue>, backoff: Backoff, handler: impl CompletionHandler) -> Result<Poller> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let shared = Arc::new(Shared { cq, handling: Mutex::new((Box::new(handler), Vec::with_capacity(64))), pollers: AtomicUsize::new(0) });
        let state = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let cq = &state.cq;
                let mut idle_since: Option<Instant> = None;
                let mut armed = false;
                while !flag.load(Ordering::Acquire) {
                    let polled = {
                        let mut handling = state.handling.lock();
                        let (handler, batch) = &mut *handling;
                        batch.clear();
                        match cq.poll(batch, 64) {
                            Ok(0) => false,
                            Ok(_) => {
                                handler.on_completions(batch);
                                true
                            }
                            Err(e) => return handler.on_poll_error(e),
                        }
                    };
                    if polled {
                        idle_since = None;
                        continue;
                    }
                    let since = *idle_since.get_or_insert_with(Instant::now);
                    if since.elapsed() < backoff.spin && state.pollers.load(Ordering::Acquire) == 0 {
                        std::hint::spin_loop();
                    } else if !armed {
                        if let Err(e) = cq.arm() {
                            return state.handling.lock().0.on_poll_error(e);
                        }
                        // The next poll catches what came before arming; then we block.
                        armed = true;
                    } else {
                        match cq.wait(backoff.block) {
                            // An event (possibly from an earlier burst, or for completions a
                            // polling thread took): poll, spin again, and re-arm before the
                            // next wait.
                            Ok(true) => {
                                armed = false;
                                idle_since = None;
                            }
                            Ok(false) => {}
                            Err(e) => return state.handling.lock().0.on_poll_error(e),
                        }
                    }
                }
            })
            .map_err(|e| VerbsError::Resource { what: "starting the completion poller", reason: e.to_string() })?;
        Ok(Poller { stop, thread: Some(thread), shared })
    }

    /// A handle for other threads to poll the queue themselves.
    pub fn handle(&self) -> PollHandle {
        PollHandle { shared: self.shared.clone() }
    }

    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            if t.thread().id() == std::thread::current().id() {
                // Stopped from inside a handler: the loop ends after this batch.
                return;
            }
            let _ = t.join();
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop();
    }
}
