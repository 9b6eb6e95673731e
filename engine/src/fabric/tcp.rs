//! The fabric over `ferry-tcp`: frames are mesh messages, a relocation's write is one emulated
//! one-sided write served by the target's reader thread straight into the reserved slot.

use std::sync::Arc;

use ferry_tcp::{AccessError, Handler, LandedWrite, Mesh, TransportError};

use super::{Fabric, FabricHandler, WriteCompletion, WriteRequest};
use crate::error::{Error, Result};
use crate::store::{RegionHandle, Registrar};

/// A fabric over a TCP mesh.
pub struct TcpFabric {
    mesh: Arc<Mesh>,
}

impl TcpFabric {
    /// Wraps a connected, not yet started mesh.
    pub fn new(mesh: Mesh) -> TcpFabric {
        TcpFabric { mesh: Arc::new(mesh) }
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
}

struct Adapter {
    handler: Arc<dyn FabricHandler>,
}

impl Handler for Adapter {
    fn on_message(&self, from: usize, payload: &[u8]) {
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
        tracing::debug!(peer, wr_id, ?result, "one-sided read completed");
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
        self.mesh.start(Arc::new(Adapter { handler }))?;
        Ok(())
    }

    fn enqueue(&self, to: usize, frame: Vec<u8>) -> Result<()> {
        self.mesh.enqueue(to, frame).map_err(Error::from)
    }

    fn flush(&self, to: usize) {
        self.mesh.flush(to);
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
