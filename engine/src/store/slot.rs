//! Access to slots: through a latch guard, through an owned reservation, or optimistically.
//!
//! A slot is `[head u32][value_len × f32][state_len × f32][tail u32]` in registered memory (the
//! state is the table's optimizer state, empty for most tables; see [`crate::update`]). Every write is an
//! atomic store (`Relaxed` for values, a plain move on x86), and every read that holds no latch
//! — an optimistic local pull, the TCP emulation of a one-sided read — is an atomic load, so
//! they never race in the language's sense. A reader that holds the latch (or owns the slot)
//! excludes every writer, so it copies with a plain `memcpy`: reads do not race with reads. The
//! versions tell a latch-free reader whether its copy is consistent:
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
use crate::update::Updater;

/// Values up to this many floats are copied word by word rather than with `memcpy`.
const SHORT: usize = 8;
/// How many keys ahead the bulk walker prefetches slots (memory latency over the time a short
/// value takes).
const PREFETCH_AHEAD: usize = 64;

/// Asks the CPU to bring the cache line at `p` closer (a hint: nothing is read, nothing faults).
#[inline(always)]
pub(super) fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
use super::ARRIVING;
use super::{NO_SLOT, Residence, TableStore};

/// A view of one slot's words, for as long as the latch or reservation that grants it.
#[derive(Clone, Copy)]
pub struct Slot<'a> {
    head: &'a AtomicU32,
    values: &'a [AtomicU32],
    state: &'a [AtomicU32],
    tail: &'a AtomicU32,
    #[cfg_attr(not(test), expect(dead_code, reason = "read by the store's tests only"))]
    index: u32,
}

impl<'a> Slot<'a> {
    /// A view of the slot at `p` (slot number `index`) with `value_len` values and
    /// `state_len` words of state.
    ///
    /// # Safety
    ///
    /// `p` is the start of a slot handed out by its table's allocator, with `value_len` values
    /// and `state_len` state words.
    #[inline(always)]
    pub(super) unsafe fn at(p: *mut u8, value_len: usize, state_len: usize, index: u32) -> Slot<'a> {
        let state_at = super::VALUES_OFFSET + 4 * value_len;
        // SAFETY: per the contract, as in `new`.
        unsafe {
            Slot {
                head: &*(p as *const AtomicU32),
                values: std::slice::from_raw_parts(p.add(super::VALUES_OFFSET) as *const AtomicU32, value_len),
                state: std::slice::from_raw_parts(p.add(state_at) as *const AtomicU32, state_len),
                tail: &*(p.add(state_at + 4 * state_len) as *const AtomicU32),
                index,
            }
        }
    }

    /// The slot `index` of `table`.
    ///
    /// # Safety
    ///
    /// `index` must have been handed out by the table's allocator (so its chunk is mapped and
    /// stays mapped as long as the table lives).
    #[inline]
    pub(super) unsafe fn new(table: &'a TableStore, index: u32) -> Slot<'a> {
        let p = table.slot_ptr(index);
        // SAFETY: the slot lies inside a mapped chunk (the caller's contract); the chunk is
        // 4-aligned (page-aligned arena, slot size a multiple of 4), so each word is a valid,
        // aligned `AtomicU32`, and the arena outlives `'a` (it lives as long as the table).
        unsafe { Slot::at(p, table.value_len(), table.state_len(), index) }
    }

    /// The slot's number in its table.
    #[inline]
    #[cfg(test)]
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Elements per value.
    #[inline]
    pub fn len(&self) -> usize {
        self.values.len()
    }

    #[inline(always)]
    fn begin_write(&self) -> u32 {
        let v = self.tail.load(Ordering::Relaxed) & !1;
        self.tail.store(v.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        v
    }

    #[inline(always)]
    fn end_write(&self, v: u32) {
        self.head.store(v.wrapping_add(2), Ordering::Release);
        self.tail.store(v.wrapping_add(2), Ordering::Release);
    }

    /// Copies the value into `out` (which must hold `len()` floats; a shorter or longer `out`
    /// copies the common prefix).
    #[inline(always)]
    pub fn read(&self, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.values.len());
        let n = out.len().min(self.values.len());
        if n <= SHORT {
            // A call to memcpy costs more than copying a few words.
            for (o, v) in out.iter_mut().zip(self.values) {
                // SAFETY: as below; a plain load of a word nobody writes meanwhile.
                *o = f32::from_bits(unsafe { *v.as_ptr() });
            }
            return;
        }
        // SAFETY: a `Slot` is handed out only while its holder excludes every writer (the key's
        // latch, every latch, or ownership of a reserved slot), so nothing writes these words
        // during the copy; latch-free readers only read. `n` values fit both buffers, which
        // cannot overlap (`out` is borrowed mutably).
        unsafe { std::ptr::copy_nonoverlapping(self.values.as_ptr() as *const f32, out.as_mut_ptr(), n) };
    }

    /// Appends the value to `out` as little-endian bytes.
    #[inline(always)]
    pub fn append_le_bytes(&self, out: &mut Vec<u8>) {
        let n = self.values.len() * 4;
        if self.values.len() <= SHORT {
            for v in self.values {
                // SAFETY: as below; a plain load of a word nobody writes meanwhile.
                out.extend_from_slice(&unsafe { *v.as_ptr() }.to_le_bytes());
            }
            return;
        }
        out.reserve(n);
        // SAFETY: as in `read`, nothing writes the slot during the copy; `reserve` made room for
        // `n` bytes after the vector's length, which are initialised before `set_len`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.values.as_ptr() as *const u8, out.as_mut_ptr().add(out.len()), n);
            out.set_len(out.len() + n);
        }
    }

    /// Appends the value's and then the optimizer state's words as little-endian bytes to
    /// `out` (one copy of the slot's contiguous words; [`Slot::write_all_le_bytes`] is the
    /// reverse).
    #[inline]
    pub fn append_all_le_bytes(&self, out: &mut Vec<u8>) {
        let n = (self.values.len() + self.state.len()) * 4;
        out.reserve(n);
        // SAFETY: as in `append_all_words`: nothing writes the slot during the copy, the state
        // words follow the value's in the slot, so the `n` bytes from the value's start are the
        // slot's; `reserve` made room for them after the vector's length, and they are
        // initialised before `set_len`. The words are stored little-endian (x86 and the other
        // targets Ferry builds for), as the wire wants them.
        unsafe {
            std::ptr::copy_nonoverlapping(self.values.as_ptr() as *const u8, out.as_mut_ptr().add(out.len()), n);
            out.set_len(out.len() + n);
        }
    }

    /// Copies the value's `4 × len()` bytes to `dst`.
    ///
    /// # Safety
    ///
    /// `dst` is valid for `4 × len()` bytes of writes and does not overlap the slot.
    #[inline(always)]
    pub unsafe fn copy_to(&self, dst: *mut u8) {
        if self.values.len() <= SHORT {
            for (i, v) in self.values.iter().enumerate() {
                // SAFETY: as in `read`, nothing writes the word meanwhile; `dst` holds the
                // value's bytes (the caller's contract).
                unsafe { (dst as *mut u32).add(i).write_unaligned(*v.as_ptr()) };
            }
            return;
        }
        // SAFETY: as in `read`; `dst` holds the value's bytes (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(self.values.as_ptr() as *const u8, dst, self.values.len() * 4) };
    }

    /// Writes the value as little-endian bytes into `out` (`4 × len()` bytes).
    #[inline]
    pub fn read_le_bytes(&self, out: &mut [u8]) {
        debug_assert_eq!(out.len(), self.values.len() * 4);
        let n = out.len().min(self.values.len() * 4);
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(self.values.as_ptr() as *const u8, out.as_mut_ptr(), n) };
    }

    /// The write counter (even: no write in progress, which holds under the key's latch).
    pub fn version(&self) -> u32 {
        self.tail.load(Ordering::Relaxed)
    }

    /// The write counter read with acquire ordering, for readers that hold no latch (odd while
    /// a write is under way).
    pub fn version_acquire(&self) -> u32 {
        self.tail.load(Ordering::Acquire)
    }

    /// The value's words (f32 bits), for copying into a snapshot.
    pub fn words(&self) -> impl Iterator<Item = u32> + '_ {
        self.values.iter().map(|v| v.load(Ordering::Relaxed))
    }

    /// Copies the value with atomic loads (for readers that hold no latch).
    #[inline]
    fn read_atomic(&self, out: &mut [f32]) {
        for (o, v) in out.iter_mut().zip(self.values) {
            *o = f32::from_bits(v.load(Ordering::Relaxed));
        }
    }

    /// Adds `update` element-wise.
    #[inline(always)]
    pub fn add(&self, update: &[f32]) {
        debug_assert_eq!(update.len(), self.values.len());
        let v = self.begin_write();
        for (x, u) in self.values.iter().zip(update) {
            x.store((f32::from_bits(x.load(Ordering::Relaxed)) + u).to_bits(), Ordering::Relaxed);
        }
        self.end_write(v);
    }

    /// Applies a pushed update with the table's `updater` (an add for most tables).
    #[inline(always)]
    pub fn push(&self, updater: &Updater, update: &[f32]) {
        if updater.is_add() {
            return self.add(update);
        }
        debug_assert_eq!(update.len(), self.values.len());
        let v = self.begin_write();
        updater.apply_words(self.values, self.state, |i| update[i]);
        self.end_write(v);
    }

    /// [`Slot::push`] of little-endian f32 bytes (as they come off the wire).
    #[inline(always)]
    pub fn push_le_bytes(&self, updater: &Updater, bytes: &[u8]) {
        if updater.is_add() {
            return self.add_le_bytes(bytes);
        }
        debug_assert_eq!(bytes.len(), self.values.len() * 4);
        let v = self.begin_write();
        updater.apply_words(self.values, self.state, |i| f32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]));
        self.end_write(v);
    }

    /// The optimizer state (f32 bits), for tests and diagnostics.
    #[cfg(any(test, feature = "sim"))]
    pub fn state(&self) -> Vec<f32> {
        self.state.iter().map(|w| f32::from_bits(w.load(Ordering::Relaxed))).collect()
    }

    /// Adds little-endian f32 bytes (as they come off the wire) element-wise.
    #[inline(always)]
    pub fn add_le_bytes(&self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), self.values.len() * 4);
        let v = self.begin_write();
        for (x, b) in self.values.iter().zip(bytes.chunks_exact(4)) {
            let u = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            x.store((f32::from_bits(x.load(Ordering::Relaxed)) + u).to_bits(), Ordering::Relaxed);
        }
        self.end_write(v);
    }

    /// Appends the value's and then the optimizer state's words (f32 bits) to `out`, for a
    /// checkpoint's cut: one copy of the slot's contiguous words.
    #[inline]
    pub fn append_all_words(&self, out: &mut Vec<u32>) {
        let n = self.values.len() + self.state.len();
        out.reserve(n);
        // SAFETY: as in `read`, nothing writes the slot during the copy (its holder excludes
        // writers); the state words follow the value's in the slot (`Slot::at`), so the `n`
        // words from the value's start are the slot's; `reserve` made room for them after the
        // vector's length, and they are initialised before `set_len`.
        unsafe {
            std::ptr::copy_nonoverlapping(self.values.as_ptr() as *const u32, out.as_mut_ptr().add(out.len()), n);
            out.set_len(out.len() + n);
        }
    }

    /// Overwrites the value and the optimizer state with little-endian `bytes` (value first, as
    /// [`Slot::append_all_words`] gives them), for a restore.
    pub fn write_all_le_bytes(&self, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), 4 * (self.values.len() + self.state.len()));
        let v = self.begin_write();
        for (x, b) in self.values.iter().chain(self.state).zip(bytes.chunks_exact(4)) {
            x.store(u32::from_le_bytes([b[0], b[1], b[2], b[3]]), Ordering::Relaxed);
        }
        self.end_write(v);
    }

    /// Overwrites the value.
    #[inline(always)]
    pub fn write(&self, value: &[f32]) {
        debug_assert_eq!(value.len(), self.values.len());
        let v = self.begin_write();
        for (x, u) in self.values.iter().zip(value) {
            x.store(u.to_bits(), Ordering::Relaxed);
        }
        self.end_write(v);
    }

    /// Overwrites the value from little-endian f32 bytes.
    #[inline(always)]
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
        self.read_atomic(out);
        fence(Ordering::Acquire);
        self.tail.load(Ordering::Relaxed) == before
    }

    /// Makes the versions consistent (`head = tail`, even) without touching the values;
    /// returns the version.
    pub(super) fn settle_versions(&self) -> u32 {
        let even = self.tail.load(Ordering::Relaxed) & !1;
        self.tail.store(even, Ordering::Relaxed);
        self.head.store(even, Ordering::Release);
        even
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
    /// The slot's version when it was reserved (none for a slot taken out of service): an
    /// incoming relocation's landing steps past it ([`super::Store::take_incoming_stamp`]).
    pub(super) settled: Option<u32>,
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

    /// The key's run-time replica here (value, delta), if it has one and is not held here.
    #[inline]
    pub fn replica(&self) -> Option<(Slot<'_>, Slot<'_>)> {
        let slots = self.table.dynamic()?.get(self.key)?;
        // SAFETY: a replica's slots were handed out by the allocator and are freed only with
        // the replica, under this latch.
        Some(unsafe { (Slot::new(self.table, slots.value), Slot::new(self.table, slots.delta)) })
    }

    /// The key.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// Where the key lives, as this node sees it.
    pub fn residence(&self) -> Residence {
        self.table.residence(self.key)
    }

    /// Makes `slot` the key's local home: from now on local workers serve the key.
    pub fn publish(&mut self, slot: Reserved) {
        debug_assert_eq!(slot.table, self.table.id());
        debug_assert!(self.table.slot_of(self.key).is_none(), "key {} published twice", self.key);
        self.table.set_entry(self.key, slot.index);
    }

    /// Stops serving the key locally and hands its slot to the caller (an outgoing relocation).
    pub fn unpublish(&mut self) -> Option<Reserved> {
        let slot = self.table.slot_of(self.key)?;
        self.table.set_entry(self.key, NO_SLOT);
        Some(Reserved { table: self.table.id(), index: slot, settled: None })
    }

    /// Marks the key as relocating to this node (`true`) or no longer (`false`). Only for a key
    /// that is not published here; workers then route its operations through the protocol.
    pub fn set_arriving(&mut self, arriving: bool) {
        if matches!(self.table.residence(self.key), Residence::Away | Residence::Arriving) {
            self.table.set_entry(self.key, if arriving { ARRIVING } else { NO_SLOT });
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

    /// Calls `f(i, slot)` for keys `first + i`, `i` in `0..count`, in order, while they are
    /// published here; returns how many it called `f` for. The bulk path: the slot map is read
    /// as one slice and a chunk's base address looked up once per chunk, not once per key.
    #[inline(always)]
    pub fn for_each_in_run(&self, table: u16, first: u64, count: usize, mut f: impl FnMut(usize, &Slot<'_>)) -> usize {
        let t = self.store.table(table);
        let Some(entries) = t.entries(first, count) else { return 0 };
        let (value_len, state_len) = (t.value_len(), t.state_len());
        let mut chunk = usize::MAX;
        let mut base: *mut u8 = std::ptr::null_mut();
        for (i, entry) in entries.iter().enumerate() {
            // Each slot's address comes from the map entry just read; a cold slot would stall
            // its iteration, so the slot `PREFETCH_AHEAD` keys ahead is asked for now.
            if let Some(ahead) = entries.get(i + PREFETCH_AHEAD) {
                let slot = ahead.load(Ordering::Relaxed);
                if slot < ARRIVING {
                    let (c, offset) = t.chunk_of(slot);
                    prefetch(t.chunk_base(c).wrapping_add(offset));
                }
            }
            // Every latch is held, so nothing publishes or unpublishes meanwhile.
            let slot = entry.load(Ordering::Relaxed);
            if slot >= ARRIVING {
                return i;
            }
            let (c, offset) = t.chunk_of(slot);
            if c != chunk {
                chunk = c;
                base = t.chunk_base(c);
            }
            // SAFETY: a published slot was handed out by the allocator, so its chunk is mapped
            // (`base`, loaded for this chunk) and the slot lies at `offset` in it.
            let view = unsafe { Slot::at(base.add(offset), value_len, state_len, slot) };
            f(i, &view);
        }
        count
    }
}
