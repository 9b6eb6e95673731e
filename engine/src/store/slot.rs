//! Access to slots: through a latch guard, through an owned reservation, or optimistically.
//!
//! A slot is `[head u32][value_len × f32][tail u32]` in registered memory. Every word is read and
//! written as an atomic (`Relaxed` for values, which compiles to plain moves on x86), so a local
//! writer under the key's latch and a latch-free reader (an optimistic local pull, or the TCP
//! emulation of a one-sided read) never race in the language's sense; the versions tell the
//! reader whether its copy is consistent:
//!
//! 1. `tail ← v + 1` (odd: a write is under way), release fence;
//! 2. write the values;
//! 3. `head ← v + 2`, then `tail ← v + 2` (release).
//!
//! A reader loads `tail` (acquire), copies the values, fences (acquire) and loads `tail` again:
//! equal and even readings bracket a consistent copy.
//!
//! Writers get a [`Slot`] only from a [`KeyGuard`] (the key's latch is held), an [`AllGuard`]
//! (every latch is held) or a [`Reserved`] slot they own, so two writers never meet in a slot.

use std::sync::atomic::{AtomicU32, Ordering, fence};

use super::latch::{AllLatches, LatchGuard};
use super::{ARRIVING, NO_SLOT, Residence, TableStore};

/// A view of one slot's words, for as long as the latch or reservation that grants it.
#[derive(Clone, Copy)]
pub struct Slot<'a> {
    head: &'a AtomicU32,
    values: &'a [AtomicU32],
    tail: &'a AtomicU32,
    index: u32,
}

impl<'a> Slot<'a> {
    /// The slot `index` of `table`.
    ///
    /// # Safety
    ///
    /// `index` must have been handed out by the table's allocator (so its chunk is mapped and
    /// stays mapped as long as the table lives).
    #[inline]
    pub(super) unsafe fn new(table: &'a TableStore, index: u32) -> Slot<'a> {
        let p = table.slot_ptr(index);
        let n = table.value_len();
        // SAFETY: the slot lies inside a mapped chunk (the caller's contract); the chunk is
        // 4-aligned (page-aligned arena, slot size a multiple of 4), so each word is a valid,
        // aligned `AtomicU32`, and the arena outlives `'a` (it lives as long as the table).
        unsafe {
            Slot {
                head: &*(p as *const AtomicU32),
                values: std::slice::from_raw_parts(p.add(super::VALUES_OFFSET) as *const AtomicU32, n),
                tail: &*(p.add(super::VALUES_OFFSET + 4 * n) as *const AtomicU32),
                index,
            }
        }
    }

    /// The slot's number in its table.
    #[inline]
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Elements per value.
    #[inline]
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the value has no elements (never: tables have at least one).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    #[inline]
    fn begin_write(&self) -> u32 {
        let v = self.tail.load(Ordering::Relaxed) & !1;
        self.tail.store(v.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        v
    }

    #[inline]
    fn end_write(&self, v: u32) {
        self.head.store(v.wrapping_add(2), Ordering::Release);
        self.tail.store(v.wrapping_add(2), Ordering::Release);
    }

    /// Copies the value into `out` (which must hold `len()` floats; a shorter or longer `out`
    /// copies the common prefix).
    #[inline]
    pub fn read(&self, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.values.len());
        for (o, v) in out.iter_mut().zip(self.values) {
            *o = f32::from_bits(v.load(Ordering::Relaxed));
        }
    }

    /// Writes the value as little-endian bytes into `out` (`4 × len()` bytes).
    #[inline]
    pub fn read_le_bytes(&self, out: &mut [u8]) {
        debug_assert_eq!(out.len(), self.values.len() * 4);
        for (o, v) in out.chunks_exact_mut(4).zip(self.values) {
            o.copy_from_slice(&v.load(Ordering::Relaxed).to_le_bytes());
        }
    }

    /// Adds `update` element-wise.
    #[inline]
    pub fn add(&self, update: &[f32]) {
        debug_assert_eq!(update.len(), self.values.len());
        let v = self.begin_write();
        for (x, u) in self.values.iter().zip(update) {
            x.store((f32::from_bits(x.load(Ordering::Relaxed)) + u).to_bits(), Ordering::Relaxed);
        }
        self.end_write(v);
    }

    /// Adds little-endian f32 bytes (as they come off the wire) element-wise.
    #[inline]
    pub fn add_le_bytes(&self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), self.values.len() * 4);
        let v = self.begin_write();
        for (x, b) in self.values.iter().zip(bytes.chunks_exact(4)) {
            let u = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            x.store((f32::from_bits(x.load(Ordering::Relaxed)) + u).to_bits(), Ordering::Relaxed);
        }
        self.end_write(v);
    }

    /// Overwrites the value.
    #[inline]
    pub fn write(&self, value: &[f32]) {
        debug_assert_eq!(value.len(), self.values.len());
        let v = self.begin_write();
        for (x, u) in self.values.iter().zip(value) {
            x.store(u.to_bits(), Ordering::Relaxed);
        }
        self.end_write(v);
    }

    /// Overwrites the value from little-endian f32 bytes.
    #[inline]
    pub fn write_le_bytes(&self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), self.values.len() * 4);
        let v = self.begin_write();
        for (x, b) in self.values.iter().zip(bytes.chunks_exact(4)) {
            x.store(u32::from_le_bytes([b[0], b[1], b[2], b[3]]), Ordering::Relaxed);
        }
        self.end_write(v);
    }

    /// A consistent copy without any latch, as a seqlock reader: `false` when a writer was
    /// active (the caller retries or takes the latch); `out` then holds garbage.
    #[inline]
    pub(super) fn read_validated(&self, out: &mut [f32]) -> bool {
        let before = self.tail.load(Ordering::Acquire);
        if before & 1 != 0 {
            return false;
        }
        self.read(out);
        fence(Ordering::Acquire);
        self.tail.load(Ordering::Relaxed) == before
    }

    /// Makes the versions consistent (`head = tail`, even) without touching the values.
    pub(super) fn settle_versions(&self) {
        let even = self.tail.load(Ordering::Relaxed) & !1;
        self.tail.store(even, Ordering::Relaxed);
        self.head.store(even, Ordering::Release);
    }

    /// The head word (a relocation carries its stamp there).
    pub(super) fn head(&self) -> &AtomicU32 {
        self.head
    }

    /// The tail word.
    pub(super) fn tail(&self) -> &AtomicU32 {
        self.tail
    }
}

/// A slot this node holds for no published key: reserved for an incoming relocation, or taken
/// out of service for an outgoing one. Whoever holds it is its only user, so it grants write
/// access without a latch. It is not `Clone`: it returns to the allocator exactly once, through
/// [`super::Store::free`] or by being published ([`KeyGuard::publish`]).
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reserved slot must be published or freed, or it leaks"]
pub struct Reserved {
    pub(super) table: u16,
    pub(super) index: u32,
}

impl Reserved {
    /// The table.
    pub fn table(&self) -> u16 {
        self.table
    }

    /// The slot's number in its table.
    pub fn index(&self) -> u32 {
        self.index
    }
}

/// The latch of one key, held: the only way to change where the key lives on this node and,
/// through [`KeyGuard::slot`], to write its value.
pub struct KeyGuard<'s> {
    pub(super) table: &'s TableStore,
    pub(super) key: u64,
    pub(super) _latch: LatchGuard<'s>,
}

impl<'s> KeyGuard<'s> {
    /// The key's published slot, if this node serves the key.
    #[inline]
    pub fn slot(&self) -> Option<Slot<'_>> {
        // SAFETY: a published slot was handed out by the allocator.
        self.table.slot_of(self.key).map(|s| unsafe { Slot::new(self.table, s) })
    }

    /// Where the key lives, as this node sees it.
    pub fn residence(&self) -> Residence {
        self.table.residence(self.key)
    }

    /// Makes `slot` the key's local home: from now on local workers serve the key.
    pub fn publish(&mut self, slot: Reserved) {
        debug_assert_eq!(slot.table, self.table.id());
        debug_assert!(self.table.slot_of(self.key).is_none(), "key {} published twice", self.key);
        if let Some(entry) = self.table.entry(self.key) {
            entry.store(slot.index, Ordering::Release);
        }
    }

    /// Stops serving the key locally and hands its slot to the caller (an outgoing relocation).
    pub fn unpublish(&mut self) -> Option<Reserved> {
        let entry = self.table.entry(self.key)?;
        let slot = entry.load(Ordering::Acquire);
        if slot == NO_SLOT || slot == ARRIVING {
            return None;
        }
        entry.store(NO_SLOT, Ordering::Release);
        Some(Reserved { table: self.table.id(), index: slot })
    }

    /// Marks the key as relocating to this node (`true`) or no longer (`false`). Only for a key
    /// that is not published here; workers then route its operations through the protocol.
    pub fn set_arriving(&mut self, arriving: bool) {
        if let Some(entry) = self.table.entry(self.key) {
            let now = entry.load(Ordering::Acquire);
            if now == NO_SLOT || now == ARRIVING {
                entry.store(if arriving { ARRIVING } else { NO_SLOT }, Ordering::Release);
            }
        }
    }
}

/// Every latch, held (taken in index order, so it cannot deadlock with single-latch holders):
/// for applying a large batch of keys in one pass.
pub struct AllGuard<'s> {
    pub(super) store: &'s super::Store,
    pub(super) _latches: AllLatches<'s>,
}

impl AllGuard<'_> {
    /// The published slot of `key` in `table`, if this node serves it.
    #[inline]
    pub fn slot(&self, table: u16, key: u64) -> Option<Slot<'_>> {
        let t = self.store.table(table);
        // SAFETY: a published slot was handed out by the allocator.
        t.slot_of(key).map(|s| unsafe { Slot::new(t, s) })
    }
}
