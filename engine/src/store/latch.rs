//! Striped latches: key `k` of a table is guarded by latch `(k + salt) mod L`.

use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, MutexGuard};

/// `L` cache-line-padded mutexes shared by all tables of a node.
pub struct Latches {
    stripes: Box<[CachePadded<Mutex<()>>]>,
}

impl Latches {
    /// `count` latches (at least one).
    pub fn new(count: usize) -> Latches {
        Latches { stripes: (0..count.max(1)).map(|_| CachePadded::new(Mutex::new(()))).collect() }
    }

    /// Number of latches.
    pub fn len(&self) -> usize {
        self.stripes.len()
    }

    /// Whether there are no latches (never).
    pub fn is_empty(&self) -> bool {
        self.stripes.is_empty()
    }

    /// Locks the latch of `key` in a table with the given salt.
    #[inline]
    pub fn lock(&self, salt: u64, key: u64) -> MutexGuard<'_, ()> {
        let stripe = (key.wrapping_add(salt) % self.stripes.len() as u64) as usize;
        self.stripes[stripe].lock()
    }
}
