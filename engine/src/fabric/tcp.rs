//! The fabric over `ferry-tcp`: frames are mesh messages, a relocation's write is one emulated
//! one-sided write served by the target's reader thread straight into the reserved slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry_tcp::{AccessError, Handler, LandedWrite, Mesh, TransportError};
use parking_lot::Mutex;

use super::{Fabric, FabricHandler, ReadWaiters, WriteCompletion, WriteRequest};
use crate::error::{Error, Result};
use crate::store::{RegionHandle, Registrar, RemoteAddr};

/// A fabric over a TCP mesh.
pub struct TcpFabric {
    mesh: Arc<Mesh>,
    reads: Arc<ReadWaiters>,
    /// The registered landing buffer of one-sided reads (grown on demand), and its region.
    read_buffer: Mutex<Option<(Box<[u8]>, u32)>>,
    next_read: AtomicU64,
    retired: Mutex<Vec<Box<[u8]>>>,
}

impl TcpFabric {
    /// Wraps a connected, not yet started mesh.
    pub fn new(mesh: Mesh) -> TcpFabric {
        TcpFabric { mesh: Arc::new(mesh), reads: Arc::default(), read_buffer: Mutex::new(None), next_read: AtomicU64::new(1), retired: Mutex::new(Vec::new()) }
    }
}

struct MeshRegistrar {
    mesh: Arc<Mesh>,
}

impl Registrar for MeshRegistrar {
    unsafe fn register(&self, base: *mut u8, len: usize) -> Result<RegionHandle> {
        // SAFETY: the caller keeps the memory mapped for the mesh's lifetime (see `Registrar`).
        let region = unsafe { self.mesh.register(base, len) };
        Ok(RegionHandle { region, remote_base: 0 })
    }

    unsafe fn register_read_only(&self, base: *mut u8, len: usize) -> Result<RegionHandle> {
        // SAFETY: as above.
        let region = unsafe { self.mesh.register_read_only(base, len) };
        Ok(RegionHandle { region, remote_base: 0 })
    }
}

struct Adapter {
    handler: Arc<dyn FabricHandler>,
    reads: Arc<ReadWaiters>,
}

impl Handler for Adapter {
    fn on_message(&self, from: usize, payload: bytes::Bytes) {
        self.handler.on_frame(from, payload);
    }

    fn on_writes_landed(&self, from: usize, writes: &[LandedWrite]) {
        let imms: Vec<u32> = writes.iter().map(|w| w.imm).collect();
        self.handler.on_writes_landed(from, &imms);
    }

    fn on_write_error(&self, peer: usize, wr_id: u64, error: AccessError) {
        // The write was reported complete when it was copied; a refusal means the value did not
        // land, which only a bug or a corrupted peer can cause.
        tracing::error!(peer, wr_id, %error, "a peer refused a relocation write");
    }

    fn on_read_complete(&self, peer: usize, wr_id: u64, result: std::result::Result<(), AccessError>) {
        self.reads.complete(wr_id, result.map_err(|e| Error::Transport(format!("one-sided read from node {peer}: {e}"))));
    }

    fn on_peer_closed(&self, peer: usize, error: Option<&TransportError>) {
        self.handler.on_peer_closed(peer, error.map(|e| e.to_string()));
    }
}

impl Fabric for TcpFabric {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn registrar(&self) -> Arc<dyn Registrar> {
        Arc::new(MeshRegistrar { mesh: self.mesh.clone() })
    }

    fn start(&self, handler: Arc<dyn FabricHandler>) -> Result<()> {
        self.mesh.start(Arc::new(Adapter { handler, reads: self.reads.clone() }))?;
        Ok(())
    }

    fn enqueue(&self, to: usize, frame: Vec<u8>) -> Result<()> {
        self.mesh.enqueue(to, frame).map_err(Error::from)
    }

    fn flush(&self, to: usize) {
        self.mesh.flush(to);
    }

    fn wait_for_room(&self, timeout: Duration) -> Result<()> {
        self.mesh.wait_for_room(timeout).map_err(Error::from)
    }

    unsafe fn write(&self, to: usize, writes: &[WriteRequest]) -> Result<WriteCompletion> {
        let mut batch = self.mesh.write_batch();
        for w in writes {
            // SAFETY: the caller guarantees `src..src+len` is valid until completion, and this
            // fabric copies it right here.
            let data = unsafe { std::slice::from_raw_parts(w.src, w.len) };
            batch.push(w.remote.region, w.remote.addr, data, Some(w.imm), w.wr_id)?;
        }
        // Queued, not flushed: the caller records the completions first and flushes afterwards,
        // so a source slot is free before its bytes can arrive anywhere.
        batch.enqueue(to)?;
        Ok(WriteCompletion::Immediate)
    }

    fn read(&self, peer: usize, remote: RemoteAddr, out: &mut [u8], timeout: Duration) -> Result<()> {
        let mut buffer = self.read_buffer.lock();
        if buffer.as_ref().is_none_or(|(b, _)| b.len() < out.len()) {
            if let Some((_, region)) = buffer.take() {
                self.mesh.deregister(region);
            }
            let mut landing = vec![0u8; out.len().next_power_of_two()].into_boxed_slice();
            // SAFETY: the box is kept in `read_buffer` until it is deregistered (above, or when
            // the fabric drops) and its heap memory never moves.
            let region = unsafe { self.mesh.register_read_only(landing.as_mut_ptr(), landing.len()) };
            *buffer = Some((landing, region));
        }
        let region = buffer.as_ref().expect("just ensured").1;
        let id = self.next_read.fetch_add(1, Ordering::Relaxed);
        self.reads.expect(id);
        if let Err(e) = self.mesh.read(peer, remote.region, remote.addr, out.len(), region, 0, id) {
            self.reads.complete(id, Err(e.into()));
        }
        if let Err(e) = self.reads.wait(id, peer, timeout) {
            // A late answer must not land in the buffer of a later read: retire this one (kept
            // allocated, since the mesh may be copying into it right now).
            self.mesh.deregister(region);
            if let Some((landing, _)) = buffer.take() {
                self.retired.lock().push(landing);
            }
            return Err(e);
        }
        out.copy_from_slice(&buffer.as_ref().expect("kept").0[..out.len()]);
        Ok(())
    }

    fn disconnect(&self, peer: usize) {
        self.mesh.disconnect(peer);
    }

    fn is_alive(&self, peer: usize) -> bool {
        self.mesh.is_alive(peer)
    }

    fn shutdown(&self) {
        self.mesh.shutdown();
    }

    fn abort(&self) {
        self.mesh.abort();
    }
}
