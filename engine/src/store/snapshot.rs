//! Per-peer images of the replicated keys homed at this node, for one-sided refresh reads.
//!
//! A replica node refreshes by reading its home's values with one-sided reads. Reading the
//! live slots does not work for hot keys: the home's own workers write them every few
//! microseconds, so a copy of a run of slots bracketed by version reads almost always caught a
//! write somewhere, and retries starve (measured: a 2 000-key run of 100-float values under
//! constant pushes failed 100 retries in a row; refresh rounds took up to 370 ms against a
//! 40 ms bound). Instead the home cuts an *image* when it applies a peer's deltas — each key
//! copied under its latch, in slot format (version, values, version) — into a registered buffer
//! of that peer's own, and acknowledges; the peer reads the image with one READ per table. No
//! one writes a peer's image between the acknowledgement and that peer's read (the peer sends
//! its next deltas only after reading), so the read needs no retries; the versions are checked
//! anyway.
//!
//! Only slots whose version moved since they last went into that peer's image are cut (packed at
//! the image's start, their positions listed in the acknowledgement): a replica whose home slot
//! did not change is still its home value plus the peer's own unshipped pushes. A peer whose
//! refresh failed asks for everything again (REPLICA_FULL).

use std::sync::atomic::{AtomicU32, Ordering};

use super::{Registrar, RemoteAddr};
use crate::error::Result;

/// Registered words that peers read slot images from with one-sided reads: a replica node's
/// [`Snapshot`], and the images a key's owner cuts for a run-time replica's refresh
/// ([`super::Store::sync_image`]).
pub struct ImageBuffer {
    /// Heap memory is enough: the image is read sequentially, and its address never moves.
    words: Box<[AtomicU32]>,
    remote: RemoteAddr,
}

impl ImageBuffer {
    /// A zeroed buffer of at least `bytes` bytes, registered with `registrar` for peers'
    /// one-sided reads only.
    pub fn new(bytes: usize, registrar: &dyn Registrar) -> Result<ImageBuffer> {
        let words: Box<[AtomicU32]> = (0..bytes.div_ceil(4).max(1)).map(|_| AtomicU32::new(0)).collect();
        // SAFETY: the boxed slice stays allocated, at the same address, as long as the buffer,
        // which the store keeps until it is dropped after the fabric shut down. Peers only read
        // images: registered without remote write access.
        let handle = unsafe { registrar.register_read_only(words.as_ptr() as *mut u8, words.len() * 4)? };
        Ok(ImageBuffer { words, remote: RemoteAddr { region: handle.region, addr: handle.remote_base } })
    }

    /// The buffer as words.
    #[cfg(any(test, feature = "sim"))]
    pub fn words(&self) -> &[AtomicU32] {
        &self.words
    }

    /// How many slot images of `slot_words` words it holds.
    pub fn capacity(&self, slot_words: usize) -> usize {
        self.words.len() / slot_words.max(1)
    }

    /// Where peers read slot image `index` (of `slot_words` words each).
    pub fn remote_at(&self, index: usize, slot_words: usize) -> RemoteAddr {
        RemoteAddr { region: self.remote.region, addr: self.remote.addr + (index * slot_words * 4) as u64 }
    }

    /// Writes slot image `index`: `version`, the value's words, `version`.
    pub fn put(&self, index: usize, slot_words: usize, version: u32, values: impl Iterator<Item = u32>) {
        let words = &self.words[index * slot_words..(index + 1) * slot_words];
        words[0].store(version, Ordering::Relaxed);
        for (w, v) in words[1..slot_words - 1].iter().zip(values) {
            w.store(v, Ordering::Relaxed);
        }
        words[slot_words - 1].store(version, Ordering::Release);
    }
}

/// One peer's image of the replicated keys homed here.
pub struct Snapshot {
    image: ImageBuffer,
    /// Per replicated key (by position): its slot version when last put into this image;
    /// `NEVER` before the first time, or after the peer asked for everything.
    sent: Box<[AtomicU32]>,
}

/// A version no slot has (versions are even outside a write).
pub const NEVER: u32 = u32::MAX;

impl Snapshot {
    /// An image of up to `keys` slot images of `bytes` bytes in all (zeroed), registered with
    /// `registrar` for peers' one-sided reads.
    pub fn new(keys: usize, bytes: usize, registrar: &dyn Registrar) -> Result<Snapshot> {
        let sent = (0..keys).map(|_| AtomicU32::new(NEVER)).collect();
        Ok(Snapshot { image: ImageBuffer::new(bytes, registrar)?, sent })
    }

    /// The image as words.
    #[cfg(any(test, feature = "sim"))]
    pub fn words(&self) -> &[AtomicU32] {
        self.image.words()
    }

    /// Where peers read the image.
    pub fn remote(&self) -> RemoteAddr {
        self.image.remote
    }

    /// The version of the key at `position` when last put into this image (`NEVER`: not yet).
    pub fn sent(&self, position: usize) -> &AtomicU32 {
        &self.sent[position]
    }

    /// Forgets what was sent: the next cut holds every key.
    pub fn forget_sent(&self) {
        for s in self.sent.iter() {
            s.store(NEVER, Ordering::Relaxed);
        }
    }

    /// Writes slot `index` of the image: `version`, the value's words, `version`.
    pub fn put(&self, index: usize, slot_words: usize, version: u32, values: impl Iterator<Item = u32>) {
        self.image.put(index, slot_words, version, values);
    }
}
