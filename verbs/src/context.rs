//! An opened device: protection domain, memory registration, and factories for completion
//! queues and queue pairs.

use std::sync::Arc;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::device::DeviceInfo as _;
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::memory_region::MemoryRegion as RawRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::device::{Chosen, PortInfo, Selection, choose, describe, device_list};
use crate::error::{Result, VerbsError};

/// What peers (and the local device) may do with registered memory. Local write is always
/// granted: the device writes into it for RECV and READ, and remote write requires it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    /// Peers may RDMA WRITE into it.
    pub remote_write: bool,
    /// Peers may RDMA READ from it.
    pub remote_read: bool,
}

impl Access {
    /// Only this node's device touches it (send and receive buffers).
    pub const LOCAL: Access = Access { remote_write: false, remote_read: false };
    /// Peers may read and write it (parameter memory).
    pub const REMOTE: Access = Access { remote_write: true, remote_read: true };
    /// Peers may read it.
    pub const REMOTE_READ: Access = Access { remote_write: false, remote_read: true };

    fn flags(self) -> AccessFlags {
        let mut flags = AccessFlags::LocalWrite;
        if self.remote_write {
            flags |= AccessFlags::RemoteWrite;
        }
        if self.remote_read {
            flags |= AccessFlags::RemoteRead;
        }
        flags
    }
}

/// An opened verbs device with a protection domain on the chosen port.
pub struct Context {
    pub(crate) device: Arc<DeviceContext>,
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) chosen: Chosen,
    pub(crate) port: PortInfo,
    pub(crate) gid: [u8; 16],
    pub(crate) max_rd_atomic: u8,
}

impl Context {
    /// Opens the device, port and GID that `selection` resolves to.
    pub fn open(selection: &Selection) -> Result<Context> {
        let list = device_list()?;
        let mut infos = Vec::new();
        let mut contexts = Vec::new();
        for device in list.iter() {
            let name = device.name();
            let ctx = device.open().map_err(|e| VerbsError::Resource { what: "opening a device", reason: format!("{name}: {e}") })?;
            infos.push(describe(&ctx, name)?);
            contexts.push(ctx);
        }
        let chosen = choose(&infos, selection)?;
        let index = infos.iter().position(|d| d.name == chosen.device).expect("chosen from this list");
        let device = contexts.swap_remove(index);
        let port = infos[index].ports.iter().find(|p| p.port == chosen.port).expect("chosen port exists").clone();
        let gid = port.gids.iter().find(|g| g.index == chosen.gid_index).map(|g| g.gid).unwrap_or([0; 16]);
        let attr = device.query_device().map_err(|e| VerbsError::Resource { what: "querying the device", reason: e.to_string() })?;
        // Outstanding RDMA READs per queue pair, as initiator and as responder: the smaller of
        // both device limits, capped at 16 (what common HCAs offer).
        let max_rd_atomic = attr.max_qp_rd_atom().min(attr.max_qp_init_rd_atom()).clamp(1, 16) as u8;
        let pd = device.alloc_pd().map_err(|e| VerbsError::Resource { what: "allocating a protection domain", reason: e.to_string() })?;
        Ok(Context { device, pd, chosen, port, gid, max_rd_atomic })
    }

    /// The device, port and GID in use.
    pub fn chosen(&self) -> &Chosen {
        &self.chosen
    }

    /// The port in use.
    pub fn port(&self) -> &PortInfo {
        &self.port
    }

    /// Registers `len` bytes at `addr` with the device. Huge-page memory should be registered
    /// whole (one region per mapping), which keeps the device's translation tables small.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped while the returned region (or any work request using it)
    /// exists.
    pub unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(VerbsError::Invalid("cannot register an empty region".into()));
        }
        // SAFETY: forwarded from the caller: `addr..addr+len` stays mapped while the region lives.
        match unsafe { self.pd.reg_mr(addr as usize, len, access.flags()) } {
            Ok(mr) => Ok(MemoryRegion { mr, addr: addr as u64, len }),
            Err(e) => {
                let errno = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<std::io::Error>()).and_then(|io| io.raw_os_error());
                let reason = match errno {
                    Some(code) => std::io::Error::from_raw_os_error(code).to_string(),
                    None => e.to_string(),
                };
                let hint = if matches!(errno, Some(libc::ENOMEM) | Some(libc::EPERM) | Some(libc::EAGAIN)) { memlock_hint(len) } else { String::new() };
                Err(VerbsError::Registration { len, reason, hint })
            }
        }
    }

    /// Allocates `len` bytes of page-aligned, zeroed memory and registers it.
    pub fn alloc(&self, len: usize, access: Access) -> Result<RegisteredBuffer> {
        let mut map = memmap2::MmapMut::map_anon(len.max(1)).map_err(|e| VerbsError::Resource { what: "allocating a buffer", reason: e.to_string() })?;
        // SAFETY: the mapping is owned by the returned buffer, which drops the region first.
        let region = unsafe { self.register(map.as_mut_ptr(), len.max(1), access)? };
        Ok(RegisteredBuffer { region, map })
    }
}

/// The text appended to a registration failure that the memlock limit probably caused.
pub fn memlock_hint(len: usize) -> String {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid, writable rlimit.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0;
    if !ok || limit.rlim_cur == libc::RLIM_INFINITY {
        return String::new();
    }
    format!(
        "; registration pins memory and the memlock limit is {} KiB (needed here: at least {} KiB more): raise it with \
         'ulimit -l unlimited', '* - memlock unlimited' in /etc/security/limits.conf, LimitMEMLOCK=infinity for systemd \
         units, or PropagateResourceLimitsExcept=MEMLOCK in slurm.conf",
        limit.rlim_cur / 1024,
        len.div_ceil(1024)
    )
}

/// A registered memory region.
pub struct MemoryRegion {
    mr: Arc<RawRegion>,
    addr: u64,
    len: usize,
}

impl MemoryRegion {
    /// The key local work requests name this region by.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The key peers name this region by.
    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// First byte's address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: registration refuses empty regions).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What a peer needs to reach this region.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion { addr: self.addr, len: self.len as u64, rkey: self.rkey() }
    }

    /// `len` bytes at `offset` as a local buffer for work requests.
    pub fn slice(&self, offset: usize, len: usize) -> Result<LocalSlice> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) || len > u32::MAX as usize {
            return Err(VerbsError::Invalid(format!("{len} bytes at offset {offset} do not fit a region of {} bytes", self.len)));
        }
        Ok(LocalSlice { addr: self.addr + offset as u64, len: len as u32, lkey: self.lkey() })
    }

    /// The local buffer for `len` bytes at address `addr`, if the region covers them.
    pub fn slice_at(&self, addr: u64, len: usize) -> Option<LocalSlice> {
        let offset = addr.checked_sub(self.addr)? as usize;
        self.slice(offset, len).ok()
    }
}

/// Registered memory owned by this crate (send and receive buffers, test buffers).
pub struct RegisteredBuffer {
    // Declared before `map`: the registration is dropped before the memory is unmapped.
    region: MemoryRegion,
    map: memmap2::MmapMut,
}

impl RegisteredBuffer {
    /// The registration.
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }

    /// Whether the buffer is empty (never).
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }

    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }

    /// Copies `data` in at `offset`. The caller must not race with work requests on those bytes.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.region.slice(offset, data.len())?;
        // SAFETY: the range was checked against the mapping, which this buffer owns.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset), data.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out into `out`. The caller must not race with work requests on
    /// those bytes.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.region.slice(offset, out.len())?;
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// `len` bytes at `offset` as a local buffer for work requests.
    pub fn slice(&self, offset: usize, len: usize) -> Result<LocalSlice> {
        self.region.slice(offset, len)
    }
}

/// Local memory a work request reads from or writes into: an address within a registered
/// region and that region's lkey.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSlice {
    addr: u64,
    len: u32,
    lkey: u32,
}

impl LocalSlice {
    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region's local key.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }
}

/// A peer's registered region, as it told us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// First byte's address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The peer's rkey.
    pub rkey: u32,
}

impl RemoteRegion {
    /// Encoded size.
    pub const BYTES: usize = 20;

    /// `len` bytes at `offset`, checked against the region's bounds.
    pub fn slice(&self, offset: u64, len: u64) -> Result<RemoteSlice> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(VerbsError::Invalid(format!("{len} bytes at offset {offset} do not fit a remote region of {} bytes", self.len)));
        }
        Ok(RemoteSlice { addr: self.addr + offset, rkey: self.rkey })
    }

    /// Little-endian encoding for the connection exchange.
    pub fn encode(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        out[..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..].copy_from_slice(&self.rkey.to_le_bytes());
        out
    }

    /// Decodes [`RemoteRegion::encode`]'s output.
    pub fn decode(bytes: &[u8]) -> Result<RemoteRegion> {
        if bytes.len() != Self::BYTES {
            return Err(VerbsError::Exchange(format!("a remote region is {} bytes, got {}", Self::BYTES, bytes.len())));
        }
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        Ok(RemoteRegion { addr: u64_at(0), len: u64_at(8), rkey: u32::from_le_bytes(bytes[16..20].try_into().expect("4 bytes")) })
    }
}

/// A place in a peer's memory: an address and the rkey of the region holding it. Any value is
/// safe to use: the peer's device checks it and fails the request with a remote access error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Address in the peer's address space.
    pub addr: u64,
    /// The region's rkey.
    pub rkey: u32,
}
