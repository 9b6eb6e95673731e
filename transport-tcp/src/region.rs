//! Memory regions registered for one-sided access by peers.

use std::sync::atomic::{AtomicU8, AtomicU32, Ordering, fence};

use parking_lot::{RwLock, RwLockReadGuard};

use crate::error::AccessError;

/// Identifies a registered region within one node.
pub type RegionId = u32;

#[derive(Clone, Copy)]
struct Region {
    base: usize,
    len: usize,
    /// Whether peers may write into it (least access: images for refreshes are read-only).
    writable: bool,
}

/// The table of registered regions. One-sided accesses hold the table's read lock while they
/// copy, so a region cannot be deregistered (and its memory freed) in the middle of an access.
#[derive(Default)]
pub struct Regions {
    table: RwLock<Vec<Option<Region>>>,
}

/// A range inside a registered region, valid while the guard lives.
pub(crate) struct Resolved<'a> {
    _guard: RwLockReadGuard<'a, Vec<Option<Region>>>,
    pub ptr: *mut u8,
}

impl Regions {
    /// Registers `len` bytes at `base` and returns the new region's id.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated and valid for reads and writes until
    /// [`Regions::deregister`] returns for this id. Peers may write into it at any time, from the
    /// transport's reader threads: the owner must only rely on bytes it knows no peer is writing.
    pub unsafe fn register(&self, base: *mut u8, len: usize) -> RegionId {
        self.insert(Region { base: base as usize, len, writable: true })
    }

    /// Registers `len` bytes at `base` for peers' one-sided reads only: their writes are refused
    /// with [`AccessError::ReadOnly`].
    ///
    /// # Safety
    ///
    /// The memory must stay allocated and valid for reads until [`Regions::deregister`] returns
    /// for this id.
    pub unsafe fn register_read_only(&self, base: *mut u8, len: usize) -> RegionId {
        self.insert(Region { base: base as usize, len, writable: false })
    }

    fn insert(&self, region: Region) -> RegionId {
        let mut table = self.table.write();
        let region = Some(region);
        if let Some(free) = table.iter().position(Option::is_none) {
            table[free] = region;
            free as RegionId
        } else {
            table.push(region);
            (table.len() - 1) as RegionId
        }
    }

    /// Removes a region; after this returns no access to it is running or will start.
    pub fn deregister(&self, id: RegionId) -> bool {
        let mut table = self.table.write();
        match table.get_mut(id as usize) {
            Some(slot @ Some(_)) => {
                *slot = None;
                true
            }
            _ => false,
        }
    }

    /// Checks that `offset..offset+len` lies inside region `id` (and, for a peer's write, that
    /// the region accepts writes) and returns a pointer to it.
    pub(crate) fn resolve(&self, id: RegionId, offset: u64, len: usize, peer_write: bool) -> Result<Resolved<'_>, AccessError> {
        let guard = self.table.read();
        let region = guard.get(id as usize).copied().flatten().ok_or(AccessError::UnknownRegion(id))?;
        if peer_write && !region.writable {
            return Err(AccessError::ReadOnly(id));
        }
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|end| end > region.len as u64) {
            return Err(AccessError::OutOfBounds { region: id, offset, len: len as u64, region_len: region.len as u64 });
        }
        let ptr = (region.base + offset as usize) as *mut u8;
        Ok(Resolved { _guard: guard, ptr })
    }
}

/// Copies `src` into registered memory at `dst`, storing it as atomic words (atomic bytes at
/// unaligned edges): the region's owner may read the same memory concurrently with atomics
/// (seqlock readers), and a plain copy would race with them.
///
/// # Safety
///
/// `dst..dst + src.len()` lies inside a registered region whose memory stays valid for the copy
/// (a [`Resolved`] guard is held).
pub(crate) unsafe fn copy_into_region(src: &[u8], dst: *mut u8) {
    let mut i = 0;
    let len = src.len();
    // SAFETY (whole block): every address written lies in `dst..dst+len`, valid per the caller,
    // and every address read in `src`; atomic types have the size and alignment of the integers
    // they wrap, and words are only stored at 4-aligned addresses.
    unsafe {
        while i < len && !(dst as usize + i).is_multiple_of(4) {
            (*(dst.add(i) as *const AtomicU8)).store(src[i], Ordering::Relaxed);
            i += 1;
        }
        let words = (len - i) / 4;
        let (from, to) = (src.as_ptr().add(i), dst.add(i) as *const AtomicU32);
        for w in 0..words {
            (*to.add(w)).store((from.add(4 * w) as *const u32).read_unaligned(), Ordering::Relaxed);
        }
        i += 4 * words;
        while i < len {
            (*(dst.add(i) as *const AtomicU8)).store(src[i], Ordering::Relaxed);
            i += 1;
        }
    }
    fence(Ordering::Release);
}

/// Copies registered memory at `src` into `dst`, loading atomic words (atomic bytes at
/// unaligned edges): the region's owner may write the same memory concurrently with atomics.
/// A copy taken while a writer is active may mix old and new words, exactly as a one-sided RDMA
/// read may; readers validate what they read.
///
/// # Safety
///
/// `src..src + dst.len()` lies inside a registered region whose memory stays valid for the copy.
pub(crate) unsafe fn copy_from_region(src: *const u8, dst: &mut [u8]) {
    fence(Ordering::Acquire);
    let mut i = 0;
    let len = dst.len();
    // SAFETY (whole block): every address read lies in `src..src+len`, valid per the caller, and
    // every address written in `dst`; words are only loaded from 4-aligned addresses.
    unsafe {
        while i < len && !(src as usize + i).is_multiple_of(4) {
            dst[i] = (*(src.add(i) as *const AtomicU8)).load(Ordering::Relaxed);
            i += 1;
        }
        let words = (len - i) / 4;
        let (from, to) = (src.add(i) as *const AtomicU32, dst.as_mut_ptr().add(i));
        for w in 0..words {
            (to.add(4 * w) as *mut u32).write_unaligned((*from.add(w)).load(Ordering::Relaxed));
        }
        i += 4 * words;
        while i < len {
            dst[i] = (*(src.add(i) as *const AtomicU8)).load(Ordering::Relaxed);
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_enforced_and_ids_reused() {
        let regions = Regions::default();
        let mut a = vec![0u8; 64];
        let mut b = vec![0u8; 16];
        // SAFETY: both vectors outlive the table's use of them in this test.
        let (ra, rb) = unsafe { (regions.register(a.as_mut_ptr(), a.len()), regions.register(b.as_mut_ptr(), b.len())) };
        assert!(regions.resolve(ra, 0, 64, true).is_ok());
        assert!(regions.resolve(ra, 60, 4, false).is_ok());
        assert!(matches!(regions.resolve(ra, 61, 4, false), Err(AccessError::OutOfBounds { .. })));
        assert!(matches!(regions.resolve(ra, u64::MAX, 2, false), Err(AccessError::OutOfBounds { .. })));
        assert!(matches!(regions.resolve(9, 0, 1, false), Err(AccessError::UnknownRegion(9))));
        assert!(regions.deregister(ra));
        assert!(regions.resolve(ra, 0, 1, false).is_err());
        // SAFETY: as above.
        let rc = unsafe { regions.register(a.as_mut_ptr(), 8) };
        assert_eq!(rc, ra);
        assert!(regions.resolve(rb, 0, 16, true).is_ok());
        // A read-only region: peers read it, their writes are refused.
        // SAFETY: as above.
        let ro = unsafe { regions.register_read_only(b.as_mut_ptr(), b.len()) };
        assert!(regions.resolve(ro, 0, 16, false).is_ok());
        assert!(matches!(regions.resolve(ro, 0, 16, true), Err(AccessError::ReadOnly(r)) if r == ro));
        assert_eq!(AccessError::from_code(AccessError::ReadOnly(ro).code(), ro), AccessError::ReadOnly(ro));
    }

    #[test]
    fn atomic_copies_match_plain_ones_at_any_alignment() {
        let src: Vec<u8> = (0..67u8).collect();
        for offset in 0..4 {
            for len in [0, 1, 3, 4, 5, 17, 63] {
                let mut region = vec![0u8; 80];
                // SAFETY: the range lies inside `region`, which nobody else uses.
                unsafe { copy_into_region(&src[..len], region.as_mut_ptr().add(offset)) };
                assert_eq!(&region[offset..offset + len], &src[..len]);
                let mut back = vec![0u8; len];
                // SAFETY: as above.
                unsafe { copy_from_region(region.as_ptr().add(offset), &mut back) };
                assert_eq!(back, &src[..len]);
            }
        }
    }
}
