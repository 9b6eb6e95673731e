//! Striped latches: key `k` of a table is guarded by latch `(k + salt) mod L`.
//!
//! A latch is held for a copy of one value, so it is a spin latch: one atomic exchange to take
//! it and a plain release store to drop it (a parking mutex costs a second atomic
//! read-modify-write on release). Waiters spin briefly, then yield, so a preempted holder does
//! not stall them for long.

use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_utils::CachePadded;

/// One latch.
pub struct Latch(AtomicBool);

/// Holds a latch until dropped.
pub struct LatchGuard<'a>(&'a Latch);

impl Latch {
    const fn new() -> Latch {
        Latch(AtomicBool::new(false))
    }

    /// Takes the latch.
    #[inline]
    pub fn lock(&self) -> LatchGuard<'_> {
        if self.0.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            self.lock_contended();
        }
        LatchGuard(self)
    }

    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0u32;
        loop {
            while self.0.load(Ordering::Relaxed) {
                spins += 1;
                if spins.is_multiple_of(64) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            if self.0.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return;
            }
        }
    }
}

impl Drop for LatchGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        self.0.0.store(false, Ordering::Release);
    }
}

/// `L` cache-line-padded latches shared by all tables of a node.
pub struct Latches {
    stripes: Box<[CachePadded<Latch>]>,
    /// `⌈2⁶⁴ / L⌉` for Lemire's remainder by multiplication (a 64-bit division costs tens of
    /// cycles on the hot path).
    magic: u64,
}

/// Holds every latch (taken in index order, so it cannot deadlock with single-latch holders).
pub struct AllLatches<'a> {
    latches: &'a Latches,
}

impl Drop for AllLatches<'_> {
    fn drop(&mut self) {
        for l in self.latches.stripes.iter() {
            l.0.store(false, Ordering::Release);
        }
    }
}

impl Latches {
    /// `count` latches (at least one).
    pub fn new(count: usize) -> Latches {
        let count = count.max(1);
        Latches { stripes: (0..count).map(|_| CachePadded::new(Latch::new())).collect(), magic: (u64::MAX / count as u64).wrapping_add(1) }
    }

    /// Number of latches.
    pub fn len(&self) -> usize {
        self.stripes.len()
    }

    /// Locks the latch of `key` in a table with the given salt.
    #[inline]
    pub fn lock(&self, salt: u64, key: u64) -> LatchGuard<'_> {
        self.stripes[self.stripe(key.wrapping_add(salt))].lock()
    }

    /// Asks the CPU to bring the latch of `key` in a table with the given salt closer (a
    /// hint: nothing is read or written).
    #[inline]
    pub fn prefetch(&self, salt: u64, key: u64) {
        super::slot::prefetch(&*self.stripes[self.stripe(key.wrapping_add(salt))] as *const Latch as *const u8);
    }

    /// `x mod L`.
    #[inline]
    fn stripe(&self, x: u64) -> usize {
        let l = self.stripes.len() as u64;
        if x <= u32::MAX as u64 && l > 1 {
            // Lemire, "Faster remainder by direct computation" (2019): exact for 32-bit x.
            let low = self.magic.wrapping_mul(x);
            ((low as u128 * l as u128) >> 64) as usize
        } else {
            (x % l) as usize
        }
    }

    /// Locks every latch, for applying a large batch without per-key latching.
    pub fn lock_all(&self) -> AllLatches<'_> {
        for l in self.stripes.iter() {
            // Released together by the guard's drop.
            std::mem::forget(l.lock());
        }
        AllLatches { latches: self }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn stripe_is_the_remainder() {
        for l in [1usize, 2, 3, 7, 64, 1000, 1023, 65_537] {
            let latches = Latches::new(l);
            for x in (0..5000u64).chain([u32::MAX as u64 - 1, u32::MAX as u64, u32::MAX as u64 + 1, 1 << 40, u64::MAX]) {
                assert_eq!(latches.stripe(x), (x % l as u64) as usize, "{x} mod {l}");
            }
        }
    }

    /// A counter whose increments are serialised only by latch 1.
    struct Guarded(std::cell::UnsafeCell<u64>);
    // SAFETY: every access in the test below holds latch 1 (alone or among all latches).
    unsafe impl Sync for Guarded {}

    #[test]
    fn latches_exclude_each_other() {
        let latches = Arc::new(Latches::new(3));
        let shared = Arc::new(Guarded(std::cell::UnsafeCell::new(0)));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (latches, shared) = (latches.clone(), shared.clone());
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let _guard = if i % 1000 == 0 { Ok(latches.lock_all()) } else { Err(latches.lock(0, 1)) };
                        // SAFETY: latch 1 is held.
                        unsafe { *shared.0.get() += 1 };
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        // SAFETY: all threads have finished.
        assert_eq!(unsafe { *shared.0.get() }, 80_000);
    }
}
