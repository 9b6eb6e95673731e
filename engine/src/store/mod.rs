//! The local parameter store of one node.
//!
//! Values live in fixed-size *slots* inside huge-page arenas. A slot is
//! `[head: u32][values: value_len × f32][tail: u32]` (12 bytes for a one-float value); the two
//! version words let latch-free readers — optimistic local pulls and one-sided reads by peers —
//! tell a consistent copy from a torn one (see [`slot`]). Every access to a slot goes through a
//! [`KeyGuard`] (the key's latch), an [`AllGuard`] (every latch) or a [`Reserved`] slot the caller
//! owns; values are atomics, so latch-free readers never race with writers.
//!
//! Per key, each node keeps one `u32` entry (`slot_map`, itself in a huge-page arena when
//! large, so that a random lookup costs no TLB miss): the key's slot, [`NO_SLOT`] when the key
//! lives elsewhere, or [`ARRIVING`] while it relocates to this node. Chunks of slots are
//! allocated on demand (a node may hold any share of a table after relocations) and freed slots
//! are reused.

mod arena;
pub mod dynamic;
mod latch;
pub mod replica;
pub mod slot;
mod snapshot;

use std::ptr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, Ordering, fence};

use parking_lot::Mutex;

pub use arena::{Arena, HUGE_PAGE, PageKind};
pub use dynamic::{DynamicReplicas, ReplicaSlots};
pub use latch::Latches;
pub use replica::ReplicaState;
pub use slot::{AllGuard, KeyGuard, Reserved, Slot};
pub use snapshot::{ImageBuffer, Snapshot};

use crate::config::{HugePages, TableSpec};
use crate::error::{Error, Result};
use crate::partition::Partitioner;

/// `slot_map` entry of a key this node does not hold.
pub const NO_SLOT: u32 = u32::MAX;
/// `slot_map` entry of a key relocating to this node (its slot is reserved, not yet published).
pub const ARRIVING: u32 = u32::MAX - 1;
/// Byte offset of the values inside a slot.
pub const VALUES_OFFSET: usize = 4;
/// Values up to this many floats are read by local pulls without taking the latch.
pub const OPTIMISTIC_MAX: usize = 128;
/// Resolution of the relocation stamp carried in a slot's head word: nanoseconds >> 6.
pub const STAMP_SHIFT: u32 = 6;
/// Keys per block of the slot map's summary.
const BLOCK: usize = 64;

/// What became of a value pulled to make a run-time replica ([`Store::install_made_replica`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MadeReplica {
    /// The replica was installed; `with_pushes` when pushes this node sent behind the pull
    /// were added to its value.
    Installed {
        /// Whether pushes sent behind the pull were added.
        with_pushes: bool,
    },
    /// Not installed: the key is held or arriving here, or was here since the pull left, so the
    /// value lacks what it took here.
    Stale,
    /// Not installed for another reason: not wanted any more, or a replica exists already.
    NotMade,
}

/// Where a key lives, as one node's slot map says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residence {
    /// Published here, in this slot.
    Here(u32),
    /// Relocating to this node.
    Arriving,
    /// Elsewhere.
    Away,
}

/// Where a peer can reach a slot with one-sided operations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
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
    /// Makes `len` bytes at `base` reachable by peers' one-sided reads and writes (slots:
    /// relocations write into them, `read_slot` reads them).
    ///
    /// # Safety
    ///
    /// The memory must stay mapped until the registrar is dropped or the region deregistered.
    unsafe fn register(&self, base: *mut u8, len: usize) -> Result<RegionHandle>;

    /// Makes `len` bytes at `base` reachable by peers' one-sided reads only (least access: the
    /// images replicas are refreshed from); their writes are refused.
    ///
    /// # Safety
    ///
    /// As for [`Registrar::register`].
    unsafe fn register_read_only(&self, base: *mut u8, len: usize) -> Result<RegionHandle>;
}

/// A registrar for nodes without peers: regions are numbered, addresses are chunk offsets.
#[derive(Default)]
#[cfg(any(test, feature = "sim"))]
pub struct LocalRegistrar {
    next: AtomicU32,
}

#[cfg(any(test, feature = "sim"))]
impl Registrar for LocalRegistrar {
    unsafe fn register(&self, _base: *mut u8, _len: usize) -> Result<RegionHandle> {
        Ok(RegionHandle { region: self.next.fetch_add(1, Ordering::Relaxed), remote_base: 0 })
    }

    unsafe fn register_read_only(&self, base: *mut u8, len: usize) -> Result<RegionHandle> {
        // SAFETY: the caller's contract is the same; nothing here reaches peers.
        unsafe { self.register(base, len) }
    }
}

struct Allocator {
    /// Free slots as ranges `start..end`: a slot freed next to the last range joins it, and a
    /// slot is taken from the last range's start, so slots freed in order are handed out again
    /// in order — the reservations of one `localize` get consecutive slots, which relocation
    /// fills with one write per run ([`Store::reserve`]).
    free: Vec<(u32, u32)>,
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
    state_len: usize,
    slot_bytes: usize,
    chunk_shift: u32,
    slot_map: *const AtomicU32,
    slot_map_len: usize,
    _slot_map_memory: SlotMapMemory,
    /// Per block of [`BLOCK`] keys, how many are published here or arriving: a run of keys
    /// held elsewhere is confirmed with one load per block instead of one per key.
    blocks: Box<[AtomicU8]>,
    chunks: Box<[AtomicPtr<u8>]>,
    chunk_regions: Box<[AtomicU64]>,
    chunk_bases: Box<[AtomicU64]>,
    alloc: Mutex<Allocator>,
    /// Replicated keys of the table, when it has any.
    replicas: Option<ReplicaState>,
    /// Per peer, the image of the replicated keys homed here that it refreshes from.
    snapshots: Box<[Option<Snapshot>]>,
    /// Replicas made at run time for intent (tables with a stateless, linear updater on
    /// clusters of several nodes).
    dynamic: Option<DynamicReplicas>,
    /// Per peer, the buffers the images of keys held here are cut into for that peer's run-time
    /// replicas (the last is current; earlier, smaller ones stay registered, unused).
    sync_images: Mutex<crate::util::FastMap<u16, Vec<Arc<ImageBuffer>>>>,
    /// The home keys as the store was built, `(first, count)`, when they are a run of keys
    /// whose slots were their offsets in it (see [`TableStore::start_slot_guess`]).
    home_run: Option<(u64, u64)>,
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

// SAFETY: the raw pointers in `TableStore` point into arenas owned by the same store (mapped
// until it drops) and are only dereferenced as atomics or under the rules of `slot`; all
// mutable state is behind atomics or mutexes.
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
            let partitioner = Partitioner::of(spec, nodes);
            let home = partitioner.home_count(rank);
            let replicas = ReplicaState::new(spec, rank, nodes);
            let dynamic = (nodes > 1 && spec.updater.is_add() && spec.replicated.is_empty()).then(|| DynamicReplicas::new(spec.keys as usize)).transpose()?;
            let table = TableStore::new(id as u16, spec.clone(), home, huge_pages, replicas, dynamic)?;
            store.tables.push(table);
            let id = id as u16;
            // Whether the home keys are a run whose slots are their offsets in it (a range's
            // keys in a fresh table are): then a key's slot can be guessed without the map.
            let mut run = None::<(u64, u64)>;
            let mut in_order = true;
            for key in partitioner.home_keys(rank) {
                let slot = store.reserve(id)?;
                let index = slot.index;
                store.lock(id, key).publish(slot);
                let (first, count) = *run.get_or_insert((key, 0));
                in_order &= key == first + count && u64::from(index) == count;
                run = Some((first, count + 1));
            }
            store.tables[id as usize].home_run = run.filter(|_| in_order);
            let (replica_keys, home_replicated): (Vec<u64>, usize) = match store.tables[id as usize].replicas() {
                Some(r) => ((0..r.replicas() as u32).map(|o| r.key(o)).collect(), r.home_keys().len()),
                None => (Vec::new(), 0),
            };
            if home_replicated > 0 {
                let bytes = home_replicated * store.tables[id as usize].slot_bytes;
                let images = (0..nodes)
                    .map(|peer| if peer == rank { Ok(None) } else { Snapshot::new(home_replicated, bytes, &*store.registrar).map(Some) })
                    .collect::<Result<Vec<_>>>()?;
                store.tables[id as usize].snapshots = images.into_boxed_slice();
            }
            for key in replica_keys {
                let slot = store.reserve(id)?;
                store.lock(id, key).publish(slot);
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

    /// Asks the CPU to bring the latch of `key` in `table` closer, for a lock soon after.
    #[inline]
    pub fn prefetch_latch(&self, table: u16, key: u64) {
        self.latches.prefetch(self.tables[table as usize].salt, key);
    }

    /// Takes the latch of `key` in `table`.
    #[inline]
    pub fn lock(&self, table: u16, key: u64) -> KeyGuard<'_> {
        let t = &self.tables[table as usize];
        KeyGuard { table: t, key, _latch: self.latches.lock(t.salt, key) }
    }

    /// Takes every latch (for applying a large batch; see [`Latches::lock_all`]).
    pub fn lock_all(&self) -> AllGuard<'_> {
        AllGuard { store: self, _latches: self.latches.lock_all() }
    }

    /// Number of latches.
    pub fn latch_count(&self) -> usize {
        self.latches.len()
    }

    /// Takes a free slot of `table` (growing the table's arenas when needed). The slot's versions
    /// are made consistent (`head = tail`) and its values are left as they were. Consecutive
    /// calls tend to return consecutive slots (free ranges are taken from their start, fresh
    /// slots in order).
    pub fn reserve(&self, table: u16) -> Result<Reserved> {
        let t = &self.tables[table as usize];
        let mut alloc = t.alloc.lock();
        let slot = if let Some(range) = alloc.free.last_mut() {
            let slot = range.0;
            range.0 += 1;
            if range.0 == range.1 {
                alloc.free.pop();
            }
            slot
        } else {
            let slot = alloc.fresh;
            let chunk = (slot >> t.chunk_shift) as usize;
            if chunk >= t.chunks.len() || slot >= ARRIVING {
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
        // SAFETY: the slot was just handed out by the allocator.
        let settled = unsafe { Slot::new(t, slot) }.settle_versions();
        Ok(Reserved { table, index: slot, settled: Some(settled) })
    }

    /// Makes a run-time replica of the key `guard` latches, holding `value` with an empty delta.
    /// Returns false, changing nothing, when the key is held or arriving here, already has a
    /// replica, or its table takes none.
    pub fn install_replica(&self, guard: &KeyGuard<'_>, value: &[f32]) -> Result<bool> {
        let t = guard.table;
        let Some(dynamic) = t.dynamic() else { return Ok(false) };
        if t.residence(guard.key) != Residence::Away || dynamic.get(guard.key).is_some() || value.len() != t.value_len {
            return Ok(false);
        }
        let mut value_slot = self.reserve(t.id)?;
        let mut delta_slot = match self.reserve(t.id) {
            Ok(s) => s,
            Err(e) => {
                self.free(value_slot);
                return Err(e);
            }
        };
        self.reserved(&mut value_slot).write(value);
        self.reserved(&mut delta_slot).write(&vec![0.0; value.len()]);
        let slots = ReplicaSlots { value: value_slot.index, delta: delta_slot.index };
        Ok(dynamic.set(guard.key, slots))
    }

    /// The pull that made replicas was answered with `value` for `key` of `table`, sent when
    /// the key's replica incarnation was `incarnation` ([`dynamic::DynamicReplicas::incarnation`]):
    /// installs the replica if it is still `wanted`, the key is still elsewhere and of that
    /// incarnation, adding to its value the pushes this node sent behind the pull
    /// ([`dynamic::DynamicReplicas::begin_making`]); ends the key's making either way. The
    /// replica is visible before its making ends (see `Step::look_at_replicas`), so a push
    /// queued meanwhile was either added up or finds it. One function for the intent service
    /// and the simulator, so that the simulator runs the service's rule.
    pub fn install_made_replica(&self, table: u16, key: u64, incarnation: u32, wanted: bool, value: &[f32]) -> Result<MadeReplica> {
        let t = &self.tables[table as usize];
        let guard = self.lock(table, key);
        // A key that arrived meanwhile needs no replica (the pushes sent to it travel with it);
        // one that was here since the pull left (its incarnation changed) took pushes the value
        // lacks, so the value is not installed.
        let current = t.dynamic().is_some_and(|d| d.incarnation(key) == incarnation);
        let installed = if wanted && current { self.install_replica(&guard, value) } else { Ok(false) };
        let sent_behind = t.dynamic().and_then(|d| d.end_making(key));
        if !installed? {
            return Ok(if !current || t.residence(key) != Residence::Away { MadeReplica::Stale } else { MadeReplica::NotMade });
        }
        let mut with_pushes = false;
        tracing::trace!(target: "ferry::replica_trace",  table, key, ?value, sum = ?sent_behind, "replica made");
        if let (Some(sum), Some((value_slot, _))) = (sent_behind, guard.replica())
            && sum.iter().any(|&s| s != 0.0)
        {
            value_slot.add(&sum);
            with_pushes = true;
        }
        Ok(MadeReplica::Installed { with_pushes })
    }

    /// The key `guard` latches just left this node from `slot` (unpublished, not yet sent):
    /// if it is wanted as a replica here ([`dynamic::DynamicReplicas::want`]), keeps its
    /// departing value as one, so that a node that will need the key again does not have to
    /// pull it back. Returns whether it did.
    pub fn keep_departing_replica(&self, guard: &KeyGuard<'_>, slot: &mut Reserved) -> Result<bool> {
        let t = guard.table;
        let Some(dynamic) = t.dynamic().filter(|d| d.wanted(guard.key)) else { return Ok(false) };
        let departing = self.reserved(slot);
        let mut value = vec![0.0; departing.len()];
        departing.read(&mut value);
        let kept = self.install_replica(guard, &value)?;
        tracing::trace!(target: "ferry::replica_trace",  table = t.id, key = guard.key, ?value, kept, "departing value kept as a replica");
        if kept {
            dynamic.note_kept(guard.key);
        }
        Ok(kept)
    }

    /// Ends the run-time replica of the key `guard` latches: its slots are freed and its
    /// unsent delta copied to `delta` (which must hold one value). False when it has none.
    pub fn remove_replica(&self, guard: &KeyGuard<'_>, delta: &mut [f32]) -> bool {
        let t = guard.table;
        let Some(slots) = t.dynamic().and_then(|d| d.clear(guard.key)) else { return false };
        let mut delta_slot = Reserved { table: t.id, index: slots.delta, settled: None };
        self.reserved(&mut delta_slot).read(delta);
        tracing::trace!(target: "ferry::replica_trace",  table = t.id, key = guard.key, ?delta, "replica removed");
        self.free(delta_slot);
        self.free(Reserved { table: t.id, index: slots.value, settled: None });
        true
    }

    /// The key `guard` latches lands here in `slot` (not yet published; the caller holds the
    /// key's shard until it is): a run-time replica of it ends, and its unsent delta — pushes of
    /// this node's workers that the replica took while the key was on its way — is added to the
    /// arriving value before the value serves anything, so that no access reads the key
    /// without them. The key's replica incarnation changes either way
    /// ([`dynamic::DynamicReplicas::incarnation`]). Returns whether there was a replica.
    pub fn fold_replica_into_arrival(&self, guard: &KeyGuard<'_>, slot: &mut Reserved) -> bool {
        let t = guard.table;
        let Some(dynamic) = t.dynamic() else { return false };
        if dynamic.get(guard.key).is_none() {
            // A value pulled for a replica before now lacks what the key takes here.
            dynamic.note_landing(guard.key);
            return false;
        }
        let mut delta = vec![0.0; t.value_len];
        if !self.remove_replica(guard, &mut delta) {
            return false;
        }
        tracing::trace!(target: "ferry::replica_trace",  table = t.id, key = guard.key, ?delta, "replica delta folded into the arriving key");
        self.reserved(slot).add(&delta);
        true
    }

    /// Takes over `key` of `table` from a lost node's backup: a slot of its own holding `image`
    /// (value and updater state as little-endian words, [`Slot::append_all_words`]),
    /// published. Returns false, changing nothing, when the key is held or arriving here
    /// already or the image has the wrong size.
    pub fn adopt(&self, table: u16, key: u64, image: &[u8]) -> Result<bool> {
        let t = self.table(table);
        if key >= t.spec.keys || image.len() != 4 * (t.value_len + t.state_len) {
            return Ok(false);
        }
        let mut guard = self.lock(table, key);
        if guard.residence() != Residence::Away {
            return Ok(false);
        }
        let mut slot = self.reserve(table)?;
        self.reserved(&mut slot).write_all_le_bytes(image);
        guard.publish(slot);
        Ok(true)
    }

    /// A view of a slot the caller holds, for reading or writing its value.
    pub fn reserved<'a>(&'a self, slot: &'a mut Reserved) -> Slot<'a> {
        // SAFETY: a reservation is only made by `reserve` or `unpublish`, so the allocator
        // handed the slot out.
        unsafe { Slot::new(&self.tables[slot.table as usize], slot.index) }
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

    /// Cuts `peer`'s image of `table`'s replicated keys homed here: the slots whose version
    /// moved since they last went into this peer's image (all of them with `full`), each copied
    /// under its latch and packed from the image's start. Returns where the peer reads it and
    /// the positions (among the replicated keys homed here, in key order) of the slots it
    /// holds; `None` when this node is home to none of the table's replicated keys.
    pub fn cut_snapshot(&self, table: u16, peer: usize, full: bool) -> Option<(RemoteAddr, Vec<u32>)> {
        let t = self.tables.get(table as usize)?;
        let replicas = t.replicas()?;
        let image = t.snapshots.get(peer)?.as_ref()?;
        if full {
            image.forget_sent();
        }
        let slot_words = t.slot_bytes / 4;
        let mut positions = Vec::new();
        for (i, &key) in replicas.home_keys().iter().enumerate() {
            let guard = self.lock(table, key);
            if let Some(slot) = guard.slot() {
                let version = slot.version();
                let sent = image.sent(i);
                if sent.load(Ordering::Relaxed) != version {
                    image.put(positions.len(), slot_words, version, slot.words());
                    sent.store(version, Ordering::Relaxed);
                    positions.push(i as u32);
                }
            }
        }
        Some((image.remote(), positions))
    }

    /// The buffer the images of `table`'s keys for `peer`'s run-time replicas are cut into,
    /// with room for at least `slots` slot images. A buffer too small is replaced by one twice
    /// its size (or `slots`, if more); the old one stays registered, so that a read of an image
    /// cut into it earlier still finds it. At most `table`'s key count: a peer cannot have more
    /// replicas.
    pub fn sync_image(&self, table: u16, peer: u16, slots: usize) -> Result<Arc<ImageBuffer>> {
        let t = self.tables.get(table as usize).ok_or_else(|| Error::Protocol(format!("no table {table}")))?;
        if slots as u64 > t.spec.keys {
            return Err(Error::Protocol(format!("{slots} slot images asked of table {table}, which has {} keys", t.spec.keys)));
        }
        let slot_words = t.slot_bytes / 4;
        let mut images = t.sync_images.lock();
        let buffers = images.entry(peer).or_default();
        if let Some(current) = buffers.last().filter(|b| b.capacity(slot_words) >= slots) {
            return Ok(current.clone());
        }
        let room = buffers.last().map_or(slots, |b| b.capacity(slot_words) * 2).max(slots).min(t.spec.keys as usize);
        let buffer = Arc::new(ImageBuffer::new(room * t.slot_bytes, &*self.registrar)?);
        buffers.push(buffer.clone());
        Ok(buffer)
    }

    /// The first `slots` slot images of `peer`'s current image of `table`, as a one-sided read
    /// would copy them (for simulators and tests).
    #[cfg(any(test, feature = "sim"))]
    pub fn snapshot_bytes(&self, table: u16, peer: usize, slots: usize) -> Option<Vec<u8>> {
        let t = self.tables.get(table as usize)?;
        let image = t.snapshots.get(peer)?.as_ref()?;
        let words = slots * t.slot_bytes / 4;
        Some(image.words().get(..words)?.iter().flat_map(|w| w.load(Ordering::Acquire).to_le_bytes()).collect())
    }

    /// Returns a slot to its table's free list.
    pub fn free(&self, slot: Reserved) {
        let t = &self.tables[slot.table as usize];
        let mut alloc = t.alloc.lock();
        alloc.live = alloc.live.saturating_sub(1);
        let i = slot.index;
        match alloc.free.last_mut() {
            Some(range) if range.1 == i => range.1 += 1,
            Some(range) if range.0 == i + 1 => range.0 = i,
            _ => alloc.free.push((i, i + 1)),
        }
    }

    /// Stores `stamp` (cluster nanoseconds >> [`STAMP_SHIFT`], wrapping) in the head word of a
    /// slot that is about to leave this node: the relocation's one-sided write carries it to the
    /// new owner, which measures blocking time with it and then restores the head from the tail.
    pub fn stamp_outgoing(&self, slot: &mut Reserved, stamp: u32) {
        self.reserved(slot).head().store(stamp, Ordering::Release);
    }

    /// Reads the stamp an incoming relocation wrote into `slot` and makes the slot's versions
    /// consistent again (one step past where they were when the slot was reserved, so a
    /// latch-free reader that saw this slot serve another key before cannot mistake it for
    /// unchanged: a run's write also carries the sender's tail words into every slot but its
    /// last, which is why the reserved version, not the tail found now, is the base).
    pub fn take_incoming_stamp(&self, slot: &mut Reserved) -> u32 {
        let settled = slot.settled;
        let view = self.reserved(slot);
        let stamp = view.head().load(Ordering::Acquire);
        let next = settled.unwrap_or_else(|| view.tail().load(Ordering::Relaxed) & !1).wrapping_add(2);
        view.tail().store(next, Ordering::Relaxed);
        view.head().store(next, Ordering::Release);
        stamp
    }
}

impl TableStore {
    fn new(
        id: u16,
        spec: TableSpec,
        home_keys: usize,
        huge_pages: HugePages,
        replicas: Option<ReplicaState>,
        dynamic: Option<DynamicReplicas>,
    ) -> Result<TableStore> {
        let value_len = spec.value_len;
        let state_len = spec.state_len();
        let value_bytes = value_len * spec.element.size();
        let slot_bytes = VALUES_OFFSET + value_bytes + 4 * state_len + 4;
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
        // outgoing copy completes; a run-time replica takes two (value and delta).
        let per_key = if dynamic.is_some() { 4 } else { 2 };
        let max_chunks = ((per_key * spec.keys as usize + 2).div_ceil(per_chunk)).max(1);
        let keys = spec.keys as usize;
        let (slot_map, memory) = if keys * 4 >= HUGE_PAGE / 2 {
            let mut arena = Arena::allocate(keys * 4, huge_pages)?;
            let base = arena.as_mut_ptr();
            // SAFETY: the arena holds at least `keys * 4` writable, 4-aligned bytes that this
            // table owns; every entry is initialised to NO_SLOT (all ones) here, and AtomicU32
            // has the layout of u32.
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
            state_len,
            slot_bytes,
            chunk_shift,
            slot_map,
            slot_map_len: keys,
            _slot_map_memory: memory,
            blocks: (0..keys.div_ceil(BLOCK)).map(|_| AtomicU8::new(0)).collect(),
            chunks: (0..max_chunks).map(|_| AtomicPtr::new(ptr::null_mut())).collect(),
            chunk_regions: (0..max_chunks).map(|_| AtomicU64::new(0)).collect(),
            chunk_bases: (0..max_chunks).map(|_| AtomicU64::new(0)).collect(),
            alloc: Mutex::new(Allocator { free: Vec::new(), fresh: 0, live: 0, arenas: Vec::new() }),
            replicas,
            snapshots: Box::new([]),
            dynamic,
            sync_images: Mutex::new(Default::default()),
            home_run: None,
            spec,
        })
    }

    /// The slot-map entry of `key`; `None` beyond the table.
    #[inline]
    fn entry(&self, key: u64) -> Option<&AtomicU32> {
        if key as usize >= self.slot_map_len {
            return None;
        }
        // SAFETY: bounds checked above; the map lives as long as the table.
        Some(unsafe { &*self.slot_map.add(key as usize) })
    }

    /// The slot-map entries of keys `first..first+count`; `None` when they leave the table.
    #[inline]
    fn entries(&self, first: u64, count: usize) -> Option<&[AtomicU32]> {
        let end = (first as usize).checked_add(count)?;
        if end > self.slot_map_len {
            return None;
        }
        // SAFETY: bounds checked above; the map lives as long as the table.
        Some(unsafe { std::slice::from_raw_parts(self.slot_map.add(first as usize), count) })
    }

    /// The chunk a slot lies in and its byte offset there.
    #[inline]
    fn chunk_of(&self, slot: u32) -> (usize, usize) {
        ((slot >> self.chunk_shift) as usize, (slot & ((1 << self.chunk_shift) - 1)) as usize * self.slot_bytes)
    }

    /// The base address of a chunk (null if it was never allocated).
    #[inline]
    fn chunk_base(&self, chunk: usize) -> *mut u8 {
        self.chunks.get(chunk).map_or(ptr::null_mut(), |c| c.load(Ordering::Acquire))
    }

    /// Whether `key` is neither published here nor arriving (true beyond the table).
    #[inline]
    pub fn is_away(&self, key: u64) -> bool {
        self.entry(key).is_none_or(|e| e.load(Ordering::Acquire) == NO_SLOT)
    }

    /// Whether every key of `first..first+count` is neither published here nor arriving, as
    /// far as the block summary says (a key that changes meanwhile may be missed, as with
    /// [`TableStore::is_away`] on each key). Blocks that hold something are checked key by key.
    pub fn run_is_away(&self, first: u64, count: usize) -> bool {
        let Some(end) = (first as usize).checked_add(count).filter(|&e| e <= self.slot_map_len) else { return false };
        let mut key = first as usize;
        while key < end {
            let block = key / BLOCK;
            let block_end = ((block + 1) * BLOCK).min(end);
            if self.blocks[block].load(Ordering::Acquire) != 0 && !(key..block_end).all(|k| self.is_away(k as u64)) {
                return false;
            }
            key = block_end;
        }
        true
    }

    /// Changes a key's slot-map entry and keeps the block summary (the caller holds the key's
    /// latch, so entry and count change together for every other writer).
    #[inline]
    fn set_entry(&self, key: u64, value: u32) {
        let Some(entry) = self.entry(key) else { return };
        let was_here = entry.load(Ordering::Relaxed) != NO_SLOT;
        let is_here = value != NO_SLOT;
        let block = &self.blocks[key as usize / BLOCK];
        if is_here && !was_here {
            block.fetch_add(1, Ordering::AcqRel);
        }
        entry.store(value, Ordering::Release);
        if was_here && !is_here {
            block.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The table's replicated keys on this node (`None` when it replicates nothing).
    #[inline]
    pub fn replicas(&self) -> Option<&ReplicaState> {
        self.replicas.as_ref()
    }

    /// Whether `key` is replicated (a replica here, or homed here and replicated elsewhere).
    #[inline]
    pub fn is_replicated(&self, key: u64) -> bool {
        self.replicas.as_ref().is_some_and(|r| r.is_replicated(key))
    }

    /// Where an operation routed away from the local pass should go for `key`: a replica
    /// counts as elsewhere (only a set of a replicated key is routed, and it goes home).
    #[inline]
    pub fn route_residence(&self, key: u64) -> Residence {
        if self.replicas.as_ref().is_some_and(|r| r.ordinal(key).is_some()) { Residence::Away } else { self.residence(key) }
    }

    /// The table's run-time replicas (`None` when the table takes none).
    #[inline]
    pub fn dynamic(&self) -> Option<&DynamicReplicas> {
        self.dynamic.as_ref()
    }

    /// Whether this node has a run-time replica of `key` (a hint without the latch).
    #[inline]
    pub fn has_dynamic_replica(&self, key: u64) -> bool {
        self.dynamic.as_ref().is_some_and(|d| d.get(key).is_some())
    }

    /// Whether any run-time replica of the table exists here.
    #[inline]
    pub fn any_dynamic_replica(&self) -> bool {
        self.dynamic.as_ref().is_some_and(DynamicReplicas::any)
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

    /// Floats of optimizer state per slot (after the value; see [`crate::update`]).
    #[inline]
    pub fn state_len(&self) -> usize {
        self.state_len
    }

    /// What a push does to a value here.
    #[inline(always)]
    pub fn updater(&self) -> &crate::update::Updater {
        &self.spec.updater
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The slot holding `key` here, if this node holds it and serves it locally. Acting on the
    /// slot needs the key's latch ([`Store::lock`]); this is for routing decisions.
    #[inline]
    pub fn slot_of(&self, key: u64) -> Option<u32> {
        let slot = self.entry(key)?.load(Ordering::Acquire);
        (slot < ARRIVING).then_some(slot)
    }

    /// The version of `key`'s slot read without its latch (odd while a write is under way), if
    /// the key is held here: a hint of whether it changed since a version seen before.
    #[inline]
    pub fn version_hint(&self, key: u64) -> Option<u32> {
        let slot = self.slot_of(key)?;
        // SAFETY: a published slot was handed out by the allocator and slots are never
        // unmapped while the store lives; only the tail version word is loaded, atomically.
        Some(unsafe { Slot::new(self, slot) }.version_acquire())
    }

    /// Where `key` lives, as this node's slot map says right now.
    #[inline]
    pub fn residence(&self, key: u64) -> Residence {
        match self.entry(key).map(|e| e.load(Ordering::Acquire)) {
            None | Some(NO_SLOT) => Residence::Away,
            Some(ARRIVING) => Residence::Arriving,
            Some(slot) => Residence::Here(slot),
        }
    }

    /// Reads the value of `key` without its latch, as a seqlock reader: `false` (with garbage in
    /// `out`) when the key is not published here, a writer was active, the key moved meanwhile,
    /// or the value is too long to be worth it; the caller then takes the latch.
    #[inline]
    pub fn read_optimistic(&self, key: u64, out: &mut [f32]) -> bool {
        // Long values are copied faster under the latch than with the version checks; the
        // latch's atomic only matters next to a short copy.
        if self.value_len > OPTIMISTIC_MAX || out.len() != self.value_len {
            return false;
        }
        let Some(slot) = self.slot_of(key) else { return false };
        // SAFETY: a published slot was handed out by the allocator; slots are never unmapped
        // while the store lives, so reading one that was freed meanwhile is harmless, and the
        // map check below rejects such a copy. This view holds no latch, so only its atomic,
        // validated read is used.
        let view = unsafe { Slot::new(self, slot) };
        view.read_validated(out) && self.slot_of(key) == Some(slot)
    }

    /// Whether two slots lie in the same arena chunk (one registered region: a one-sided write
    /// may span slots only within one).
    #[inline]
    pub fn same_chunk(&self, a: u32, b: u32) -> bool {
        a >> self.chunk_shift == b >> self.chunk_shift
    }

    /// Start of a slot in registered memory (for fabrics posting one-sided writes from it).
    #[inline]
    pub fn slot_ptr(&self, slot: u32) -> *mut u8 {
        let chunk = (slot >> self.chunk_shift) as usize;
        let index = (slot & ((1 << self.chunk_shift) - 1)) as usize;
        let base = self.chunks.get(chunk).map_or(ptr::null_mut(), |c| c.load(Ordering::Acquire));
        debug_assert!(!base.is_null());
        base.wrapping_add(index * self.slot_bytes)
    }

    /// The slot `key` had when the store was built, if it is one of the home keys then
    /// reserved in key order: where its value most likely still is (unless it moved since).
    /// Only a hint for [`TableStore::prefetch_slot`]; the map says where the key is.
    #[inline]
    pub fn start_slot_guess(&self, key: u64) -> Option<u32> {
        let (first, count) = self.home_run?;
        let offset = key.checked_sub(first)?;
        (offset < count).then_some(offset as u32)
    }

    /// Asks the CPU to bring `slot`'s first and last lines (its versions) closer, if a chunk
    /// holds that slot number; a stale or made-up slot number costs a useless fetch, nothing
    /// more (a hint: nothing is read, nothing faults).
    #[inline]
    pub fn prefetch_slot(&self, slot: u32) {
        let chunk = (slot >> self.chunk_shift) as usize;
        let Some(base) = self.chunks.get(chunk).map(|c| c.load(Ordering::Acquire)).filter(|b| !b.is_null()) else { return };
        let start = base.wrapping_add((slot & ((1 << self.chunk_shift) - 1)) as usize * self.slot_bytes);
        slot::prefetch(start);
        slot::prefetch(start.wrapping_add(self.slot_bytes - 4));
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

    /// Bytes a relocation transfers: the head word (carrying the stamp), the values and the
    /// optimizer state.
    pub fn transfer_bytes(&self) -> usize {
        VALUES_OFFSET + (self.value_len + self.state_len) * 4
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

/// Checks a copy of a slot taken without the latch (a one-sided read): returns the values when
/// the copy's versions agree, `None` when it caught a write in progress and must be retried.
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

    fn le(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|f| f.to_le_bytes()).collect()
    }

    /// A range's home keys are reserved in key order, so a key's slot at start is its offset
    /// in the range, which the guess gives (and nothing for other nodes' keys); hashed home
    /// keys are no run, and get no guess.
    #[test]
    fn range_home_keys_slots_are_guessed_from_their_offsets() {
        let specs = [TableSpec::new("t", 100, 2)];
        let s = Store::new(1, 3, &specs, 16, HugePages::Off, Arc::new(LocalRegistrar::default())).unwrap();
        let t = s.table(0);
        let p = Partitioner::new(100, 3, Partitioning::Range);
        let mut guessed = 0;
        for key in 0..100 {
            if p.home(key) == 1 {
                assert_eq!(t.start_slot_guess(key), t.slot_of(key), "key {key}");
                guessed += 1;
            } else {
                assert_eq!(t.start_slot_guess(key), None, "key {key}");
            }
        }
        assert_eq!(guessed, p.home_count(1));
        let hashed = store(100, 2, 2, 1);
        assert!((0..100).all(|k| hashed.table(0).start_slot_guess(k).is_none()));
    }

    #[test]
    fn home_keys_get_zeroed_slots_and_others_none() {
        let s = store(100, 3, 2, 1);
        let p = Partitioner::new(100, 2, Partitioning::Hash);
        let t = s.table(0);
        for key in 0..100 {
            assert_eq!(t.slot_of(key).is_some(), p.home(key) == 1, "key {key}");
            assert_eq!(t.residence(key) == Residence::Away, p.home(key) != 1);
        }
        let key = p.home_keys(1).next().unwrap();
        let mut out = [1.0f32; 3];
        s.lock(0, key).slot().unwrap().read(&mut out);
        assert_eq!(out, [0.0; 3]);
        assert_eq!(t.slot_of(100), None, "beyond the table");
        assert_eq!(t.residence(u64::MAX), Residence::Away);
    }

    #[test]
    fn run_time_replicas_live_beside_the_slot_map_and_give_back_their_delta() {
        let s = store(100, 2, 2, 1);
        let p = Partitioner::new(100, 2, Partitioning::Hash);
        let t = s.table(0);
        let (away, held) = ((0..100).find(|&k| p.home(k) == 0).unwrap(), p.home_keys(1).next().unwrap());
        let live = t.slot_usage().0;
        assert!(!s.install_replica(&s.lock(0, held), &[1.0, 2.0]).unwrap(), "a key held here needs no replica");
        let guard = s.lock(0, away);
        assert!(s.install_replica(&guard, &[1.0, 2.0]).unwrap());
        assert!(!s.install_replica(&guard, &[5.0, 5.0]).unwrap(), "one replica per key");
        assert!(t.any_dynamic_replica() && t.has_dynamic_replica(away));
        assert_eq!(t.residence(away), Residence::Away, "the protocol still sees the key elsewhere");
        assert!(guard.slot().is_none());
        let (value, delta) = guard.replica().unwrap();
        value.add(&[0.5, 0.5]);
        delta.add(&[0.5, 0.5]);
        let mut out = [0.0; 2];
        value.read(&mut out);
        assert_eq!(out, [1.5, 2.5]);
        assert_eq!(t.slot_usage().0, live + 2, "value and delta slots");
        assert!(s.remove_replica(&guard, &mut out));
        assert_eq!(out, [0.5, 0.5]);
        assert!(!s.remove_replica(&guard, &mut out));
        assert!(guard.replica().is_none() && !t.any_dynamic_replica());
        assert_eq!(t.slot_usage().0, live, "both slots freed");
        drop(guard);
        // A key arriving here takes no replica either.
        s.lock(0, away).set_arriving(true);
        assert!(!s.install_replica(&s.lock(0, away), &[0.0, 0.0]).unwrap());
    }

    #[test]
    fn a_departing_key_stays_as_a_replica_only_where_it_is_wanted() {
        let s = store(100, 2, 2, 1);
        let p = Partitioner::new(100, 2, Partitioning::Hash);
        let t = s.table(0);
        let mut held = p.home_keys(1);
        let (wanted, unwanted) = (held.next().unwrap(), held.next().unwrap());
        for key in [wanted, unwanted] {
            s.lock(0, key).slot().unwrap().write(&[key as f32, 1.0]);
        }
        let dynamic = t.dynamic().unwrap();
        dynamic.open_marks();
        dynamic.want(wanted, true);
        for key in [wanted, unwanted] {
            let mut guard = s.lock(0, key);
            let mut slot = guard.unpublish().unwrap();
            let kept = s.keep_departing_replica(&guard, &mut slot).unwrap();
            assert_eq!(kept, key == wanted, "key {key}");
            s.free(slot);
        }
        assert!(!t.has_dynamic_replica(unwanted) && t.residence(wanted) == Residence::Away);
        let guard = s.lock(0, wanted);
        let (value, delta) = guard.replica().expect("kept on departure");
        let mut out = [0.0; 2];
        value.read(&mut out);
        assert_eq!(out, [wanted as f32, 1.0], "the departing value");
        delta.read(&mut out);
        assert_eq!(out, [0.0, 0.0], "nothing pushed to it yet");
        drop(guard);
        dynamic.want(wanted, false);
        assert!(!dynamic.wanted(wanted));
    }

    #[test]
    fn tables_with_an_optimizer_or_fixed_replicas_take_no_run_time_replicas() {
        let specs = [
            TableSpec::new("sgd", 10, 1).with_updater(crate::update::Updater::Sgd { lr: 0.1 }),
            TableSpec::new("fixed", 10, 1).replicating(std::iter::once(0..2)),
            TableSpec::new("plain", 10, 1),
        ];
        let s = Store::new(0, 2, &specs, 16, HugePages::Off, Arc::new(LocalRegistrar::default())).unwrap();
        assert!(s.table(0).dynamic().is_none() && s.table(1).dynamic().is_none() && s.table(2).dynamic().is_some());
        let single = Store::new(0, 1, &specs[2..], 16, HugePages::Off, Arc::new(LocalRegistrar::default())).unwrap();
        assert!(single.table(0).dynamic().is_none(), "one node has nobody to share with");
    }

    #[test]
    fn add_write_and_versions() {
        let s = store(10, 5, 1, 0);
        let t = s.table(0);
        let guard = s.lock(0, 3);
        let slot = guard.slot().unwrap();
        slot.add(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        slot.add_le_bytes(&le(&[1.0; 5]));
        let mut out = [0.0; 5];
        slot.read(&mut out);
        assert_eq!(out, [2.0, 3.0, 4.0, 5.0, 6.0]);
        let mut bytes = [0u8; 20];
        slot.read_le_bytes(&mut bytes);
        assert_eq!(bytes.to_vec(), le(&out));
        // SAFETY: the test holds the key's latch, so no writer changes the slot during the copy.
        let copy = unsafe { std::slice::from_raw_parts(t.slot_ptr(slot.index()), t.slot_bytes()) }.to_vec();
        let values = validate_slot_copy(&copy, 5).expect("consistent");
        assert_eq!(&values[..4], &2.0f32.to_le_bytes());
        assert_eq!(u32::from_le_bytes(copy[..4].try_into().unwrap()), 4, "two writes bump by 2 each");
        // A torn copy: the tail says a write is under way.
        let mut torn = copy.clone();
        let tail_at = torn.len() - 4;
        torn[tail_at] = 5;
        assert!(validate_slot_copy(&torn, 5).is_none());
        assert!(validate_slot_copy(&copy[1..], 5).is_none(), "wrong length");
        slot.write(&[9.0; 5]);
        slot.read(&mut out);
        assert_eq!(out, [9.0; 5]);
        slot.write_le_bytes(&le(&[7.0; 5]));
        slot.read(&mut out);
        assert_eq!(out, [7.0; 5]);
        drop(guard);
        let mut optimistic = [0.0; 5];
        assert!(t.read_optimistic(3, &mut optimistic));
        assert_eq!(optimistic, [7.0; 5]);
        assert!(!t.read_optimistic(3, &mut [0.0; 4]), "wrong output length");
    }

    #[test]
    fn slots_freed_in_order_are_reserved_again_in_order() {
        let s = store(8, 2, 1, 0);
        let t = s.table(0);
        let first: Vec<Reserved> = (0..40).map(|_| s.reserve(0).unwrap()).collect();
        let indices: Vec<u32> = first.iter().map(Reserved::index).collect();
        assert!(indices.windows(2).all(|w| w[1] == w[0] + 1), "fresh slots come in order: {indices:?}");
        let live = t.slot_usage().0;
        for slot in first {
            s.free(slot);
        }
        assert_eq!(t.slot_usage().0, live - 40);
        let again: Vec<u32> = (0..40).map(|_| s.reserve(0).unwrap().index()).collect();
        assert_eq!(again, indices, "a run freed in order is reserved again as the same run");
        // Freed out of order, each slot is still handed out exactly once.
        let mut scattered: Vec<Reserved> = again.iter().map(|&index| Reserved { table: 0, index, settled: None }).collect();
        scattered.reverse();
        let (odd, even): (Vec<Reserved>, Vec<Reserved>) = scattered.into_iter().partition(|r| r.index % 2 == 1);
        for slot in odd.into_iter().chain(even) {
            s.free(slot);
        }
        let mut back: Vec<u32> = (0..40).map(|_| s.reserve(0).unwrap().index()).collect();
        back.sort_unstable();
        assert_eq!(back, indices);
        assert_eq!(t.slot_usage().0, live);
        // A run of slots for one write stays within a chunk (one registered region).
        let per_chunk = 1u32 << t.chunk_shift;
        assert!(t.same_chunk(per_chunk - 2, per_chunk - 1) && !t.same_chunk(per_chunk - 1, per_chunk));
    }

    #[test]
    fn a_landing_steps_past_the_reserved_version_whatever_the_write_carried() {
        let s = store(8, 2, 1, 0);
        let t = s.table(0);
        let mut slot = s.reserve(0).unwrap();
        let settled = slot.settled;
        // A run's write carries the sender's tail word into the slot: here an older version.
        // SAFETY: the slot is reserved by this test and nobody else uses it.
        let view = unsafe { Slot::new(t, slot.index()) };
        let settled = settled.expect("a reserved slot knows its version");
        view.tail().store(settled.wrapping_sub(8) & !1, Ordering::Relaxed);
        s.take_incoming_stamp(&mut slot);
        assert_eq!(view.tail().load(Ordering::Relaxed), settled.wrapping_add(2), "the landing steps past the reserved version");
        s.free(slot);
    }

    #[test]
    fn publish_unpublish_and_arriving() {
        let s = store(8, 2, 2, 0);
        let t = s.table(0);
        let away = (0..8).find(|&k| t.slot_of(k).is_none()).unwrap();
        let here = (0..8).find(|&k| t.slot_of(k).is_some()).unwrap();
        s.lock(0, away).set_arriving(true);
        assert_eq!(t.residence(away), Residence::Arriving);
        assert_eq!(t.slot_of(away), None);
        let mut incoming = s.reserve(0).unwrap();
        s.reserved(&mut incoming).write(&[4.0, 5.0]);
        s.lock(0, away).publish(incoming);
        assert!(matches!(t.residence(away), Residence::Here(_)));
        let mut out = [0.0; 2];
        assert!(t.read_optimistic(away, &mut out));
        assert_eq!(out, [4.0, 5.0]);
        // Marking a published key as arriving changes nothing.
        s.lock(0, away).set_arriving(true);
        assert!(t.slot_of(away).is_some());
        let mut outgoing = s.lock(0, here).unpublish().unwrap();
        assert_eq!(t.residence(here), Residence::Away);
        assert!(s.lock(0, here).unpublish().is_none(), "nothing left to unpublish");
        s.stamp_outgoing(&mut outgoing, 1234);
        assert_eq!(s.take_incoming_stamp(&mut outgoing), 1234);
        // SAFETY: the slot is reserved by this test and nobody else uses it.
        let copy = unsafe { std::slice::from_raw_parts(t.slot_ptr(outgoing.index()), t.slot_bytes()) }.to_vec();
        assert!(validate_slot_copy(&copy, 2).is_some(), "versions settled after the stamp");
        let (live, _) = t.slot_usage();
        s.free(outgoing);
        assert_eq!(t.slot_usage().0, live - 1);
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
                    s.lock(0, 2).slot().unwrap().write(&[i as f32; 64]);
                }
                i
            })
        };
        let (mut accepted, mut refused) = (0u64, 0u64);
        let mut out = [0.0f32; 64];
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(300);
        while std::time::Instant::now() < deadline {
            if s.table(0).read_optimistic(2, &mut out) {
                assert!(out.iter().all(|&v| v == out[0]), "torn value accepted: {out:?}");
                accepted += 1;
            } else {
                refused += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let writes = writer.join().unwrap();
        assert!(accepted > 100 && writes > 100, "accepted {accepted}, refused {refused}, writes {writes}");
    }

    #[test]
    fn slots_are_reused_and_chunks_grow() {
        let s = store(100_000, 1, 4, 0);
        let t = s.table(0);
        let (live, created) = t.slot_usage();
        assert_eq!(live, 25_000);
        let extra: Vec<Reserved> = (0..100_000).map(|_| s.reserve(0).unwrap()).collect();
        assert_eq!(t.slot_usage(), (125_000, 125_000));
        let a = t.remote_addr(extra[0].index());
        let b = t.remote_addr(extra[1].index());
        assert!(a.region != b.region || a.addr.abs_diff(b.addr) == t.slot_bytes() as u64);
        for slot in extra {
            s.free(slot);
        }
        let again: Vec<Reserved> = (0..50_000).map(|_| s.reserve(0).unwrap()).collect();
        assert_eq!(t.slot_usage(), (75_000, 125_000), "freed slots are reused");
        assert!(created == 25_000);
        for slot in again {
            s.free(slot);
        }
    }

    #[test]
    fn all_guard_reaches_every_published_key() {
        let s = store(64, 1, 1, 0);
        {
            let all = s.lock_all();
            for key in 0..64 {
                all.slot(0, key).unwrap().add(&[key as f32]);
            }
            assert!(all.slot(0, 64).is_none());
        }
        let mut out = [0.0];
        for key in 0..64 {
            assert!(s.table(0).read_optimistic(key, &mut out));
            assert_eq!(out[0], key as f32);
        }
    }

    #[test]
    fn images_hold_the_slots_that_changed_since_the_last_cut() {
        // Rank 0 of 2, range partitioning: keys 0..8 homed here, 2, 3 and 6 replicated.
        let specs = [TableSpec::new("t", 16, 2).replicating_keys([2, 3, 6, 12])];
        let store = Store::new(0, 2, &specs, 16, HugePages::Off, Arc::new(LocalRegistrar::default())).unwrap();
        let (_, all) = store.cut_snapshot(0, 1, false).unwrap();
        assert_eq!(all, vec![0, 1, 2], "the first image holds every replicated slot homed here");
        assert_eq!(store.cut_snapshot(0, 1, false).unwrap().1, Vec::<u32>::new(), "nothing changed since");
        store.lock(0, 6).slot().unwrap().add(&[1.0, 2.0]);
        assert_eq!(store.cut_snapshot(0, 1, false).unwrap().1, vec![2]);
        let image = store.snapshot_bytes(0, 1, 1).unwrap();
        assert_eq!(validate_slot_copy(&image, 2).unwrap(), &le(&[1.0, 2.0])[..]);
        assert_eq!(store.cut_snapshot(0, 1, true).unwrap().1, vec![0, 1, 2], "a full cut holds every slot again");
        assert!(store.cut_snapshot(0, 0, false).is_none(), "no image for this node itself");
        // Key 12 is a replica here: pushes to it are the replica's, not the image's.
        assert!(store.table(0).replicas().unwrap().ordinal(12).is_some());
    }
}
