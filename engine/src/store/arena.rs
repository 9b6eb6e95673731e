//! Memory arenas for parameter values: explicit huge pages, else transparent huge pages, else
//! normal pages.

use memmap2::{Advice, MmapMut, MmapOptions};

use crate::config::HugePages;
use crate::error::{Error, Result};

/// Size of the huge pages arenas are rounded to.
pub const HUGE_PAGE: usize = 2 << 20;

/// Which kind of pages backs an arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PageKind {
    /// `MAP_HUGETLB` pages from the kernel's huge-page pool.
    Explicit,
    /// Normal mapping advised with `MADV_HUGEPAGE`.
    Transparent,
    /// Normal pages.
    Normal,
}

impl std::fmt::Display for PageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PageKind::Explicit => "explicit 2 MiB huge pages (MAP_HUGETLB)",
            PageKind::Transparent => "transparent huge pages (madvise)",
            PageKind::Normal => "normal pages",
        })
    }
}

/// One zero-initialised, page-aligned mapping.
pub struct Arena {
    map: MmapMut,
    offset: usize,
    len: usize,
    kind: PageKind,
}

impl Arena {
    /// Maps at least `len` bytes (rounded up to [`HUGE_PAGE`]), trying the page kinds in order.
    pub fn allocate(len: usize, policy: HugePages) -> Result<Arena> {
        let len = len.max(1).div_ceil(HUGE_PAGE) * HUGE_PAGE;
        if policy == HugePages::Auto {
            if let Ok(map) = MmapOptions::new().len(len).huge(None).populate().map_anon() {
                return Ok(Arena { map, offset: 0, len, kind: PageKind::Explicit });
            }
            // Over-allocate one huge page so that the used range can start 2 MiB-aligned,
            // which transparent huge pages need.
            if let Ok(map) = MmapOptions::new().len(len + HUGE_PAGE).map_anon() {
                let offset = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
                if map.advise_range(Advice::HugePage, offset, len).is_ok() {
                    let mut arena = Arena { map, offset, len, kind: PageKind::Transparent };
                    arena.prefault();
                    return Ok(arena);
                }
            }
        }
        let map = MmapOptions::new().len(len).populate().map_anon().map_err(|e| Error::Memory(format!("cannot map {len} bytes for parameters: {e}")))?;
        Ok(Arena { map, offset: 0, len, kind: PageKind::Normal })
    }

    /// Touches every page so that first accesses on the hot path do not fault.
    fn prefault(&mut self) {
        let range = &mut self.map[self.offset..self.offset + self.len];
        for page in range.chunks_mut(4096) {
            page[0] = 0;
        }
    }

    /// Start of the usable range.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: `offset` lies within the mapping by construction.
        unsafe { self.map.as_mut_ptr().add(self.offset) }
    }

    /// Usable length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The kind of pages that back it.
    pub fn kind(&self) -> PageKind {
        self.kind
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arenas_are_rounded_zeroed_and_writable() {
        for policy in [HugePages::Auto, HugePages::Off] {
            let mut a = Arena::allocate(100, policy).unwrap();
            assert_eq!(a.len(), HUGE_PAGE);
            let p = a.as_mut_ptr();
            assert_eq!(p as usize % 4096, 0);
            // SAFETY: the arena owns `len` writable bytes at `p`.
            let bytes = unsafe { std::slice::from_raw_parts_mut(p, a.len()) };
            assert!(bytes.iter().all(|&b| b == 0));
            bytes[a.len() - 1] = 7;
            if policy == HugePages::Off {
                assert_eq!(a.kind(), PageKind::Normal);
            }
        }
    }
}
