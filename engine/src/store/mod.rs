//! The local parameter store of one node.
//!
//! Values live in fixed-size *slots* inside huge-page arenas. A slot is
//! `[head: u32][values: value_len × f32][tail: u32]` (12 bytes for a one-float value). Every
//! write under the
//! key's latch bumps the versions as a seqlock that a *one-sided* reader (which copies the slot in
//! ascending address order, like a NIC's DMA read) can validate without any lock:
//!
//! 1. `tail ← v + 1` (odd: a write is under way), release fence;
//! 2. write the values;
//! 3. `head ← v + 2`, then `tail ← v + 2`.
//!
//! A copy is consistent exactly when its `head` equals its `tail`: if any value byte was read
//! after step 1 of a write began, the tail was read later still and differs from the head read
//! before it. Local workers never need this; they hold the latch.
//!
//! Versions are 32 bits: a reader could only be fooled by exactly 2³¹ writes to one slot during
//! one read.
//!
//! Per key, each node keeps one `u32` slot index (`slot_map`, itself in a huge-page arena when
//! large, so that a random lookup costs no TLB miss); chunks of slots are allocated on demand (a
//! node may hold any share of a table after relocations) and freed slots are reused.

mod arena;
mod latch;

use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering, fence};

use parking_lot::Mutex;

pub use arena::{Arena, HUGE_PAGE, PageKind};
pub use latch::{AllLatches, LatchGuard, Latches};

use crate::config::{HugePages, TableSpec};
use crate::error::{Error, Result};
use crate::partition::Partitioner;

/// `slot_map` entry of a key this node does not hold (or not yet: during an incoming relocation).
pub const NO_SLOT: u32 = u32::MAX;
/// Byte offset of the values inside a slot.
pub const VALUES_OFFSET: usize = 4;
/// Values up to this many floats are read by local pulls without taking the latch.
pub const OPTIMISTIC_MAX: usize = 128;
/// Resolution of the relocation stamp carried in a slot's head word: nanoseconds >> 6.
pub const STAMP_SHIFT: u32 = 6;

/// Where a peer can reach a slot with one-sided operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteAddr {
    /// Region key (the transport's region id, or an RDMA rkey).
    pub region: u32,
    /// Address within the region's address space (an offset for TCP, a virtual address for RDMA).
    pub addr: u64,
}

/// What a fabric returns when it registers an arena chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionHandle {
    /// The key peers name the region by.
    pub region: u32,
    /// The address peers use for the chunk's first byte.
    pub remote_base: u64,
}

/// Registers parameter memory with whatever carries one-sided operations.
pub trait Registrar: Send + Sync {
    /// Makes `len` bytes at `base` reachable by peers.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped until the registrar is dropped or the region deregistered.
    unsafe fn register(&self, base: *mut u8, len: usize) -> Result<RegionHandle>;
}

/// A registrar for nodes without peers: regions are numbered, addresses are chunk offsets.
#[derive(Default)]
pub struct LocalRegistrar {
    next: AtomicU32,
}

impl Registrar for LocalRegistrar {
    unsafe fn register(&self, _base: *mut u8, _len: usize) -> Result<RegionHandle> {
        Ok(RegionHandle { region: self.next.fetch_add(1, Ordering::Relaxed), remote_base: 0 })
    }
}

struct Allocator {
    free: Vec<u32>,
    fresh: u32,
    live: usize,
    arenas: Vec<Arena>,
}

/// The memory behind a table's key → slot map.
enum SlotMapMemory {
    Heap(#[allow(dead_code)] Box<[AtomicU32]>),
    Mapped(#[allow(dead_code)] Arena),
}

/// One table's slots on this node.
pub struct TableStore {
    spec: TableSpec,
    id: u16,
    salt: u64,
    value_len: usize,
    slot_bytes: usize,
    tail_offset: usize,
    chunk_shift: u32,
    slot_map: *const AtomicU32,
    slot_map_len: usize,
    _slot_map_memory: SlotMapMemory,
    chunks: Box<[AtomicPtr<u8>]>,
    chunk_regions: Box<[AtomicU64]>,
    chunk_bases: Box<[AtomicU64]>,
    alloc: Mutex<Allocator>,
}

/// All tables of a node plus the latches that guard them.
pub struct Store {
    tables: Vec<TableStore>,
    latches: Latches,
    registrar: Arc<dyn Registrar>,
    huge_pages: HugePages,
    page_kind_logged: AtomicBool,
    worst_page_kind: Mutex<Option<PageKind>>,
    rank: usize,
}

// SAFETY: the raw chunk pointers in `TableStore` point into arenas owned by the same store and
// are only dereferenced under the rules documented on each accessor; all mutable state is
// behind atomics or mutexes.
unsafe impl Send for Store {}
// SAFETY: as above.
unsafe impl Sync for Store {}

impl Store {
    /// Builds the store of node `rank` and allocates, zeroed, the slots of its home keys.
    pub fn new(rank: usize, nodes: usize, specs: &[TableSpec], latches: usize, huge_pages: HugePages, registrar: Arc<dyn Registrar>) -> Result<Store> {
        let mut store = Store {
            tables: Vec::with_capacity(specs.len()),
            latches: Latches::new(latches),
            registrar,
            huge_pages,
            page_kind_logged: AtomicBool::new(false),
            worst_page_kind: Mutex::new(None),
            rank,
        };
        for (id, spec) in specs.iter().enumerate() {
            let partitioner = Partitioner::new(spec.keys, nodes, spec.partitioning);
            let home = partitioner.home_count(rank);
            let table = TableStore::new(id as u16, spec.clone(), home, huge_pages)?;
            store.tables.push(table);
            let table = &store.tables[id];
            for (i, key) in partitioner.home_keys(rank).enumerate() {
                let slot = store.reserve(id as u16)?;
                debug_assert_eq!(slot as usize, i);
                table.entry(key).store(slot, Ordering::Relaxed);
            }
        }
        fence(Ordering::Release);
        Ok(store)
    }

    /// The tables, indexed by table id.
    pub fn tables(&self) -> &[TableStore] {
        &self.tables
    }

    /// One table.
    #[inline]
    pub fn table(&self, id: u16) -> &TableStore {
        &self.tables[id as usize]
    }

    /// The latch of `key` in table `table`.
    #[inline]
    pub fn latch(&self, table: u16, key: u64) -> LatchGuard<'_> {
        self.latches.lock(self.tables[table as usize].salt, key)
    }

    /// Every latch at once (for applying a large batch; see [`Latches::lock_all`]).
    pub fn lock_all(&self) -> AllLatches<'_> {
        self.latches.lock_all()
    }

    /// Number of latches.
    pub fn latch_count(&self) -> usize {
        self.latches.len()
    }

    /// Takes a free slot of `table` (growing the table's arenas when needed). The slot's versions
    /// are made consistent (`head = tail`) and its values are left as they were.
    pub fn reserve(&self, table: u16) -> Result<u32> {
        let t = &self.tables[table as usize];
        let mut alloc = t.alloc.lock();
        let slot = if let Some(slot) = alloc.free.pop() {
            slot
        } else {
            let slot = alloc.fresh;
            let chunk = (slot >> t.chunk_shift) as usize;
            if chunk >= t.chunks.len() {
                return Err(Error::Memory(format!("table '{}' ran out of slot chunks", t.spec.name)));
            }
            if t.chunks[chunk].load(Ordering::Acquire).is_null() {
                self.grow(t, &mut alloc, chunk)?;
            }
            alloc.fresh += 1;
            slot
        };
        alloc.live += 1;
        drop(alloc);
        // SAFETY: the slot was just taken from the allocator, so nobody else uses it.
        unsafe {
            let p = t.slot_ptr(slot);
            let even = (*t.tail(p)).load(Ordering::Relaxed) & !1;
            (*t.tail(p)).store(even, Ordering::Relaxed);
            (*t.head(p)).store(even, Ordering::Release);
        }
        Ok(slot)
    }

    fn grow(&self, t: &TableStore, alloc: &mut Allocator, chunk: usize) -> Result<()> {
        let bytes = t.slot_bytes << t.chunk_shift;
        let mut arena = Arena::allocate(bytes, self.huge_pages)?;
        self.note_page_kind(arena.kind());
        let base = arena.as_mut_ptr();
        // SAFETY: the arena is kept in the allocator until the store is dropped, which outlives
        // the registrar's use of the memory (the node shuts its fabric down first).
        let handle = unsafe { self.registrar.register(base, arena.len())? };
        t.chunk_regions[chunk].store(handle.region as u64, Ordering::Relaxed);
        t.chunk_bases[chunk].store(handle.remote_base, Ordering::Relaxed);
        t.chunks[chunk].store(base, Ordering::Release);
        alloc.arenas.push(arena);
        Ok(())
    }

    fn note_page_kind(&self, kind: PageKind) {
        if !self.page_kind_logged.swap(true, Ordering::AcqRel) {
            tracing::info!(node = self.rank, "parameter arenas use {kind}");
        }
        let mut worst = self.worst_page_kind.lock();
        if let Some(previous) = *worst
            && kind > previous
        {
            tracing::warn!(node = self.rank, "huge pages ran out; further parameter arenas use {kind}");
        }
        if worst.is_none_or(|w| kind > w) {
            *worst = Some(kind);
        }
    }

    /// The worst page kind used so far (`None` before any allocation).
    pub fn page_kind(&self) -> Option<PageKind> {
        *self.worst_page_kind.lock()
    }

    /// Returns a slot to its table's free list.
    pub fn free(&self, table: u16, slot: u32) {
        let t = &self.tables[table as usize];
        let mut alloc = t.alloc.lock();
        alloc.live = alloc.live.saturating_sub(1);
        alloc.free.push(slot);
    }
}

impl TableStore {
    fn new(id: u16, spec: TableSpec, home_keys: usize, huge_pages: HugePages) -> Result<TableStore> {
        let value_len = spec.value_len;
        let value_bytes = value_len * spec.element.size();
        let slot_bytes = VALUES_OFFSET + value_bytes + 4;
        let mut per_chunk = (HUGE_PAGE / slot_bytes).max(1).next_power_of_two();
        if per_chunk * slot_bytes > HUGE_PAGE && per_chunk > 1 {
            per_chunk /= 2;
        }
        // Fewer, larger chunks for big tables: about an eighth of the home share each, at most
        // 256 MiB.
        while per_chunk * slot_bytes < home_keys * slot_bytes / 8 && per_chunk * slot_bytes * 2 <= 256 << 20 {
            per_chunk *= 2;
        }
        let chunk_shift = per_chunk.trailing_zeros();
        // A node can hold every key of the table, and briefly a second slot per key while an
        // outgoing copy completes.
        let max_chunks = ((2 * spec.keys as usize + 2).div_ceil(per_chunk)).max(1);
        let keys = spec.keys as usize;
        let (slot_map, memory) = if keys * 4 >= HUGE_PAGE / 2 {
            let mut arena = Arena::allocate(keys * 4, huge_pages)?;
            let base = arena.as_mut_ptr();
            // SAFETY: the arena holds at least `keys * 4` zeroed, 4-aligned bytes that this table
            // owns; AtomicU32 has the layout of u32, and every entry is initialised here.
            unsafe {
                std::ptr::write_bytes(base, 0xFF, keys * 4);
            }
            (base as *const AtomicU32, SlotMapMemory::Mapped(arena))
        } else {
            let boxed: Box<[AtomicU32]> = (0..keys).map(|_| AtomicU32::new(NO_SLOT)).collect();
            (boxed.as_ptr(), SlotMapMemory::Heap(boxed))
        };
        Ok(TableStore {
            salt: id as u64 * 7919,
            id,
            value_len,
            slot_bytes,
            tail_offset: VALUES_OFFSET + value_bytes,
            chunk_shift,
            slot_map,
            slot_map_len: keys,
            _slot_map_memory: memory,
            chunks: (0..max_chunks).map(|_| AtomicPtr::new(ptr::null_mut())).collect(),
            chunk_regions: (0..max_chunks).map(|_| AtomicU64::new(0)).collect(),
            chunk_bases: (0..max_chunks).map(|_| AtomicU64::new(0)).collect(),
            alloc: Mutex::new(Allocator { free: Vec::new(), fresh: 0, live: 0, arenas: Vec::new() }),
            spec,
        })
    }

    /// The slot-map entry of `key`, which must be below the table's key count.
    #[inline]
    fn entry(&self, key: u64) -> &AtomicU32 {
        assert!((key as usize) < self.slot_map_len, "key {key} beyond table '{}'", self.spec.name);
        // SAFETY: checked above; the map lives as long as the table.
        unsafe { &*self.slot_map.add(key as usize) }
    }

    /// The table's specification.
    pub fn spec(&self) -> &TableSpec {
        &self.spec
    }

    /// The table id.
    pub fn id(&self) -> u16 {
        self.id
    }

    /// Elements per value.
    #[inline]
    pub fn value_len(&self) -> usize {
        self.value_len
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The latch salt of this table.
    #[inline]
    pub fn salt(&self) -> u64 {
        self.salt
    }

    /// The slot holding `key` here, if this node holds it and serves it locally. Callers that
    /// act on the slot must hold the key's latch while they check and use it.
    #[inline]
    pub fn slot_of(&self, key: u64) -> Option<u32> {
        if key as usize >= self.slot_map_len {
            return None;
        }
        // SAFETY: bounds checked above; the map lives as long as the table.
        let slot = unsafe { &*self.slot_map.add(key as usize) }.load(Ordering::Acquire);
        (slot != NO_SLOT).then_some(slot)
    }

    /// Makes `slot` the local home of `key` (latch held by the caller).
    #[inline]
    pub fn publish(&self, key: u64, slot: u32) {
        self.entry(key).store(slot, Ordering::Release);
    }

    /// Stops serving `key` locally (latch held by the caller).
    #[inline]
    pub fn unpublish(&self, key: u64) {
        self.entry(key).store(NO_SLOT, Ordering::Release);
    }

    /// Start of a slot.
    #[inline]
    pub fn slot_ptr(&self, slot: u32) -> *mut u8 {
        let chunk = (slot >> self.chunk_shift) as usize;
        let index = (slot & ((1 << self.chunk_shift) - 1)) as usize;
        let base = self.chunks[chunk].load(Ordering::Acquire);
        debug_assert!(!base.is_null());
        // SAFETY: `slot` was handed out by the allocator, so its chunk exists and the offset lies
        // inside it.
        unsafe { base.add(index * self.slot_bytes) }
    }

    /// Where peers reach `slot` (its first byte, the head version).
    pub fn remote_addr(&self, slot: u32) -> RemoteAddr {
        let chunk = (slot >> self.chunk_shift) as usize;
        let index = (slot & ((1 << self.chunk_shift) - 1)) as u64;
        RemoteAddr {
            region: self.chunk_regions[chunk].load(Ordering::Relaxed) as u32,
            addr: self.chunk_bases[chunk].load(Ordering::Relaxed) + index * self.slot_bytes as u64,
        }
    }

    #[inline]
    fn head(&self, p: *mut u8) -> *const AtomicU32 {
        p as *const AtomicU32
    }

    #[inline]
    fn tail(&self, p: *mut u8) -> *const AtomicU32 {
        // SAFETY (for callers): the tail lies inside the slot, 4-byte aligned.
        p.wrapping_add(self.tail_offset) as *const AtomicU32
    }

    /// Copies the value of `slot` into `out` (`value_len` floats).
    ///
    /// # Safety
    ///
    /// The caller holds the latch of the key stored in `slot`, or otherwise owns the slot.
    #[inline]
    pub unsafe fn read(&self, slot: u32, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.value_len);
        let p = self.slot_ptr(slot);
        // SAFETY: the values occupy `value_len` f32 at offset 4, inside the slot; the caller
        // excludes local writers (latch). Short values are copied inline: a call to memcpy
        // costs more than the copy.
        unsafe {
            let src = p.add(VALUES_OFFSET) as *const f32;
            if self.value_len <= 32 {
                for i in 0..self.value_len {
                    *out.get_unchecked_mut(i) = *src.add(i);
                }
            } else {
                ptr::copy_nonoverlapping(src, out.as_mut_ptr(), self.value_len);
            }
        }
    }

    /// Writes the value of `slot` at `dst` (`value_len × 4` bytes).
    ///
    /// # Safety
    ///
    /// As for [`TableStore::read`]; `dst` is valid for `value_len × 4` bytes of writes.
    #[inline]
    pub unsafe fn read_to(&self, slot: u32, dst: *mut u8) {
        let p = self.slot_ptr(slot);
        // SAFETY: the source lies inside the slot, the destination is valid per the contract.
        unsafe {
            let src = p.add(VALUES_OFFSET);
            if self.value_len <= 8 {
                for i in 0..self.value_len {
                    (dst as *mut u32).add(i).write_unaligned((src as *const u32).add(i).read());
                }
            } else {
                ptr::copy_nonoverlapping(src, dst, self.value_len * 4);
            }
        }
    }

    /// Reads the value of `key` without its latch, as a seqlock reader: returns `false` (having
    /// written garbage to `dst`) when the key is not published here, a writer was active, or the
    /// key moved meanwhile; the caller then takes the latch. Writers set the tail version odd
    /// before they change the values and even after; a relocation that reuses the slot bumps it
    /// as well before the slot is published again, so a copy taken between two equal, even tail
    /// readings of a slot still mapped to `key` is a value `key` had.
    ///
    /// # Safety
    ///
    /// `dst` is valid for `value_len` floats of writes.
    #[inline]
    pub unsafe fn read_optimistic(&self, key: u64, dst: *mut f32) -> bool {
        // Long values are copied faster under the latch (a vectorised copy) than element by
        // element here; the latch's atomic only matters next to a short copy.
        if self.value_len > OPTIMISTIC_MAX {
            return false;
        }
        let Some(slot) = self.slot_of(key) else { return false };
        let p = self.slot_ptr(slot);
        // SAFETY: the slot lies in a live arena (slots are never unmapped while the store lives);
        // its values may be written concurrently, so they are read with relaxed atomic loads,
        // and the versions decide whether the copy is kept.
        unsafe {
            let tail = &*self.tail(p);
            let before = tail.load(Ordering::Acquire);
            if before & 1 != 0 {
                return false;
            }
            let src = p.add(VALUES_OFFSET) as *const AtomicU32;
            for i in 0..self.value_len {
                *dst.add(i) = f32::from_bits((*src.add(i)).load(Ordering::Relaxed));
            }
            fence(Ordering::Acquire);
            tail.load(Ordering::Relaxed) == before && self.slot_of(key) == Some(slot)
        }
    }

    /// Copies the value of `slot` to `dst` (`value_len` floats).
    ///
    /// # Safety
    ///
    /// As for [`TableStore::read`]; `dst` is valid for `value_len` floats of writes and does not
    /// overlap the slot.
    #[inline]
    pub unsafe fn read_to_f32(&self, slot: u32, dst: *mut f32) {
        let p = self.slot_ptr(slot);
        // SAFETY: per the contract and the slot layout.
        unsafe { ptr::copy_nonoverlapping(p.add(VALUES_OFFSET) as *const f32, dst, self.value_len) };
    }

    /// Adds `value_len` floats at `src` to the value of `slot`.
    ///
    /// # Safety
    ///
    /// As for [`TableStore::read`]; `src` is valid for `value_len` floats of reads and does not
    /// overlap the slot.
    #[inline]
    pub unsafe fn add_from(&self, slot: u32, src: *const f32) {
        let p = self.slot_ptr(slot);
        // SAFETY: exclusive access by the latch; the values lie inside the slot; no overlap.
        unsafe {
            let v = self.begin_write(p);
            let values = std::slice::from_raw_parts_mut(p.add(VALUES_OFFSET) as *mut f32, self.value_len);
            let update = std::slice::from_raw_parts(src, self.value_len);
            for (x, u) in values.iter_mut().zip(update) {
                *x += *u;
            }
            self.end_write(p, v);
        }
    }

    /// Appends the value of `slot` to `out` as little-endian bytes.
    ///
    /// # Safety
    ///
    /// As for [`TableStore::read`].
    #[inline]
    pub unsafe fn read_bytes_into(&self, slot: u32, out: &mut Vec<u8>) {
        let n = self.value_len * 4;
        let p = self.slot_ptr(slot);
        out.reserve(n);
        let len = out.len();
        // SAFETY: `reserve` made room for `n` bytes; the source range lies inside the slot.
        unsafe {
            ptr::copy_nonoverlapping(p.add(VALUES_OFFSET), out.as_mut_ptr().add(len), n);
            out.set_len(len + n);
        }
    }

    #[inline]
    unsafe fn begin_write(&self, p: *mut u8) -> u32 {
        // SAFETY: head and tail lie inside the slot, 4-byte aligned; writers are serialised by
        // the latch, so the read-modify-write below needs no atomic RMW.
        unsafe {
            let tail = &*self.tail(p);
            let v = tail.load(Ordering::Relaxed) & !1;
            tail.store(v.wrapping_add(1), Ordering::Relaxed);
            fence(Ordering::Release);
            v
        }
    }

    #[inline]
    unsafe fn end_write(&self, p: *mut u8, v: u32) {
        // SAFETY: as in `begin_write`.
        unsafe {
            (*self.head(p)).store(v.wrapping_add(2), Ordering::Release);
            (*self.tail(p)).store(v.wrapping_add(2), Ordering::Release);
        }
    }

    /// Adds `update` element-wise to the value of `slot`.
    ///
    /// # Safety
    ///
    /// As for [`TableStore::read`].
    #[inline]
    pub unsafe fn add(&self, slot: u32, update: &[f32]) {
        debug_assert_eq!(update.len(), self.value_len);
        let p = self.slot_ptr(slot);
        // SAFETY: exclusive access by the latch; the values lie inside the slot.
        unsafe {
            let v = self.begin_write(p);
            let values = p.add(VALUES_OFFSET) as *mut f32;
            for (i, u) in update.iter().enumerate() {
                *values.add(i) += *u;
            }
            self.end_write(p, v);
        }
    }

    /// Adds little-endian f32 bytes (as they come off the wire) to the value of `slot`.
    ///
    /// # Safety
    ///
    /// As for [`TableStore::read`]; `bytes` holds exactly `value_len` floats.
    #[inline]
    pub unsafe fn add_bytes(&self, slot: u32, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), self.value_len * 4);
        let p = self.slot_ptr(slot);
        // SAFETY: exclusive access by the latch; the values lie inside the slot.
        unsafe {
            let v = self.begin_write(p);
            let values = p.add(VALUES_OFFSET) as *mut f32;
            for (i, c) in bytes.chunks_exact(4).enumerate() {
                *values.add(i) += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            self.end_write(p, v);
        }
    }

    /// Overwrites the value of `slot`.
    ///
    /// # Safety
    ///
    /// As for [`TableStore::read`].
    #[inline]
    pub unsafe fn write(&self, slot: u32, value: &[f32]) {
        debug_assert_eq!(value.len(), self.value_len);
        let p = self.slot_ptr(slot);
        // SAFETY: exclusive access by the latch; the values lie inside the slot.
        unsafe {
            let v = self.begin_write(p);
            let dst = p.add(VALUES_OFFSET) as *mut f32;
            if self.value_len <= 32 {
                for i in 0..self.value_len {
                    *dst.add(i) = *value.get_unchecked(i);
                }
            } else {
                ptr::copy_nonoverlapping(value.as_ptr(), dst, self.value_len);
            }
            self.end_write(p, v);
        }
    }

    /// Overwrites the value of `slot` from little-endian f32 bytes.
    ///
    /// # Safety
    ///
    /// As for [`TableStore::add_bytes`].
    #[inline]
    pub unsafe fn write_bytes(&self, slot: u32, bytes: &[u8]) {
        debug_assert_eq!(bytes.len(), self.value_len * 4);
        let p = self.slot_ptr(slot);
        // SAFETY: exclusive access by the latch; the values lie inside the slot.
        unsafe {
            let v = self.begin_write(p);
            ptr::copy_nonoverlapping(bytes.as_ptr(), p.add(VALUES_OFFSET), bytes.len());
            self.end_write(p, v);
        }
    }

    /// Stores `stamp` (cluster nanoseconds >> [`STAMP_SHIFT`], wrapping) in the head word of a
    /// slot that is about to leave this node: the relocation's one-sided write carries it to the
    /// new owner, which measures blocking time with it and then restores the head from the tail.
    ///
    /// # Safety
    ///
    /// The slot is no longer published (no local reader or writer can reach it).
    pub unsafe fn stamp_outgoing(&self, slot: u32, stamp: u32) {
        // SAFETY: the head lies inside the slot; nobody else uses the slot.
        unsafe { (*self.head(self.slot_ptr(slot))).store(stamp, Ordering::Release) };
    }

    /// Reads the stamp an incoming relocation wrote into `slot` and makes the slot's versions
    /// consistent again.
    ///
    /// # Safety
    ///
    /// The slot is reserved for an incoming relocation that has landed and is not published.
    pub unsafe fn take_incoming_stamp(&self, slot: u32) -> u32 {
        let p = self.slot_ptr(slot);
        // SAFETY: head and tail lie inside the slot; nobody else uses it yet.
        unsafe {
            let stamp = (*self.head(p)).load(Ordering::Acquire);
            let tail = (*self.tail(p)).load(Ordering::Relaxed) & !1;
            (*self.tail(p)).store(tail.wrapping_add(2), Ordering::Relaxed);
            (*self.head(p)).store(tail.wrapping_add(2), Ordering::Release);
            stamp
        }
    }

    /// Bytes a relocation transfers: the head word (carrying the stamp) and the values.
    pub fn transfer_bytes(&self) -> usize {
        VALUES_OFFSET + self.value_len * 4
    }

    /// Slots currently handed out, and slots ever created (the arena's high-water mark).
    pub fn slot_usage(&self) -> (usize, usize) {
        let alloc = self.alloc.lock();
        (alloc.live, alloc.fresh as usize)
    }

    /// Bytes of arena memory mapped for this table.
    pub fn arena_bytes(&self) -> usize {
        self.alloc.lock().arenas.iter().map(Arena::len).sum()
    }
}

/// Bytes of a slot as a one-sided read copies it: head version, values, tail version.
pub fn slot_copy_len(value_len: usize) -> usize {
    VALUES_OFFSET + value_len * 4 + 4
}

/// Offset of a slot's write counter (the tail version: odd while a write is under way).
pub fn slot_counter_offset(value_len: usize) -> usize {
    VALUES_OFFSET + value_len * 4
}

/// Checks a copy of a slot taken without the latch (a one-sided read, copied in ascending
/// address order): returns the values when the copy is consistent, `None` when it caught a write
/// in progress and must be retried.
pub fn validate_slot_copy(copy: &[u8], value_len: usize) -> Option<&[u8]> {
    let value_bytes = value_len * 4;
    if copy.len() != VALUES_OFFSET + value_bytes + 4 {
        return None;
    }
    let head = u32::from_le_bytes(copy[..4].try_into().ok()?);
    let tail = u32::from_le_bytes(copy[VALUES_OFFSET + value_bytes..].try_into().ok()?);
    (head == tail && head % 2 == 0).then(|| &copy[VALUES_OFFSET..VALUES_OFFSET + value_bytes])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Partitioning;

    fn store(keys: u64, value_len: usize, nodes: usize, rank: usize) -> Store {
        let specs = [TableSpec::new("t", keys, value_len).partitioned(Partitioning::Hash)];
        Store::new(rank, nodes, &specs, 16, HugePages::Off, Arc::new(LocalRegistrar::default())).unwrap()
    }

    #[test]
    fn home_keys_get_zeroed_slots_and_others_none() {
        let s = store(100, 3, 2, 1);
        let p = Partitioner::new(100, 2, Partitioning::Hash);
        let t = s.table(0);
        for key in 0..100 {
            assert_eq!(t.slot_of(key).is_some(), p.home(key) == 1, "key {key}");
        }
        let slot = t.slot_of(p.home_keys(1).next().unwrap()).unwrap();
        let mut out = [1.0f32; 3];
        // SAFETY: single-threaded test owns every slot.
        unsafe { t.read(slot, &mut out) };
        assert_eq!(out, [0.0; 3]);
    }

    #[test]
    fn add_write_and_versions() {
        let s = store(10, 5, 1, 0);
        let t = s.table(0);
        let slot = t.slot_of(3).unwrap();
        // SAFETY: single-threaded test owns every slot.
        unsafe {
            t.add(slot, &[1.0, 2.0, 3.0, 4.0, 5.0]);
            t.add_bytes(slot, &[1.0f32, 1.0, 1.0, 1.0, 1.0].iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<_>>());
            let mut out = [0.0; 5];
            t.read(slot, &mut out);
            assert_eq!(out, [2.0, 3.0, 4.0, 5.0, 6.0]);
            let copy = std::slice::from_raw_parts(t.slot_ptr(slot), t.slot_bytes()).to_vec();
            let values = validate_slot_copy(&copy, 5).expect("consistent");
            assert_eq!(&values[..4], &2.0f32.to_le_bytes());
            assert_eq!(u32::from_le_bytes(copy[..4].try_into().unwrap()), 4, "two writes bump by 2 each");
            // A torn copy: tail says a write is under way.
            let mut torn = copy.clone();
            let tail_at = torn.len() - 4;
            torn[tail_at] = 5;
            assert!(validate_slot_copy(&torn, 5).is_none());
            t.write(slot, &[9.0; 5]);
            t.read(slot, &mut out);
            assert_eq!(out, [9.0; 5]);
        }
    }

    #[test]
    fn optimistic_reads_never_accept_a_torn_value() {
        let s = Arc::new(store(4, 64, 1, 0));
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let t = s.table(0);
                    let _latch = s.latch(0, 2);
                    // SAFETY: the key's latch is held.
                    unsafe { t.write(t.slot_of(2).unwrap(), &[i as f32; 64]) };
                }
                i
            })
        };
        let (mut accepted, mut refused) = (0u64, 0u64);
        let mut out = [0.0f32; 64];
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(300);
        while std::time::Instant::now() < deadline {
            // SAFETY: `out` holds 64 floats.
            if unsafe { s.table(0).read_optimistic(2, out.as_mut_ptr()) } {
                assert!(out.iter().all(|&v| v == out[0]), "torn value accepted: {out:?}");
                accepted += 1;
            } else {
                refused += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let writes = writer.join().unwrap();
        assert!(accepted > 100 && writes > 100, "accepted {accepted}, refused {refused}, writes {writes}");
        // SAFETY: as above.
        assert!(!unsafe { s.table(0).read_optimistic(3, out.as_mut_ptr()) } || s.table(0).slot_of(3).is_some());
    }

    #[test]
    fn slots_are_reused_and_chunks_grow() {
        let s = store(100_000, 1, 4, 0);
        let t = s.table(0);
        let (live, created) = t.slot_usage();
        assert_eq!(live, 25_000);
        let extra: Vec<u32> = (0..100_000).map(|_| s.reserve(0).unwrap()).collect();
        assert_eq!(t.slot_usage(), (125_000, 125_000));
        for &slot in &extra {
            s.free(0, slot);
        }
        for _ in 0..50_000 {
            s.reserve(0).unwrap();
        }
        assert_eq!(t.slot_usage(), (75_000, 125_000), "freed slots are reused");
        assert!(created == 25_000);
        let a = t.remote_addr(extra[0]);
        let b = t.remote_addr(extra[1]);
        assert!(a.region != b.region || a.addr.abs_diff(b.addr) == t.slot_bytes() as u64);
    }
}
