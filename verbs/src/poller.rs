//! A dedicated thread that drains a completion queue.
//!
//! It polls without pause while completions arrive; when the queue runs dry it keeps polling for
//! a short spin (traffic under load resumes within microseconds, and a spinning poller answers
//! in nanoseconds), then arms the queue, polls once more (a completion that arrived before
//! arming raises no event) and blocks on the completion channel, so an idle node costs no CPU
//! and the first completion after a pause wakes it in one scheduler wake-up — not after a sleep
//! of arbitrary length.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Receives completions on the poller thread.
pub trait CompletionHandler: Send + 'static {
    /// A batch of completions, in the queue's order.
    fn on_completions(&mut self, batch: &[Completion]);
    /// Polling the queue failed (the device is broken); the thread stops after this.
    fn on_poll_error(&mut self, error: VerbsError);
}

/// A running poller thread.
pub struct Poller {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Starts a thread named `name` that drains `cq` into `handler`.
    pub fn spawn(name: String, cq: Arc<CompletionQueue>, backoff: Backoff, mut handler: impl CompletionHandler) -> Result<Poller> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let mut batch = Vec::with_capacity(64);
                let mut idle_since: Option<Instant> = None;
                let mut armed = false;
                while !flag.load(Ordering::Acquire) {
                    batch.clear();
                    match cq.poll(&mut batch, 64) {
                        Ok(0) => {
                            let since = *idle_since.get_or_insert_with(Instant::now);
                            if since.elapsed() < backoff.spin {
                                std::hint::spin_loop();
                            } else if !armed {
                                if let Err(e) = cq.arm() {
                                    return handler.on_poll_error(e);
                                }
                                // The next poll catches what came before arming; then we block.
                                armed = true;
                            } else {
                                match cq.wait(backoff.block) {
                                    // An event (possibly from an earlier burst): poll, spin
                                    // again, and re-arm before the next wait.
                                    Ok(true) => {
                                        armed = false;
                                        idle_since = None;
                                    }
                                    Ok(false) => {}
                                    Err(e) => return handler.on_poll_error(e),
                                }
                            }
                        }
                        Ok(_) => {
                            idle_since = None;
                            handler.on_completions(&batch);
                        }
                        Err(e) => return handler.on_poll_error(e),
                    }
                }
            })
            .map_err(|e| VerbsError::Resource { what: "starting the completion poller", reason: e.to_string() })?;
        Ok(Poller { stop, thread: Some(thread) })
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
