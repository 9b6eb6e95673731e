//! The fabric over `ferry-tcp`: frames are mesh messages, a relocation's write is one emulated
//! one-sided write served by the target's reader thread straight into the reserved slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry_tcp::{AccessError, Handler, LandedWrite, Mesh, TransportError};

use super::{Fabric, FabricHandler, Landed, Landing, Landings, PostedRead, ReadWaiters, WriteCompletion, WriteRequest};
use crate::error::{Error, Result};
use crate::store::{RegionHandle, Registrar, RemoteAddr};

/// A fabric over a TCP mesh.
pub struct TcpFabric {
    mesh: Arc<Mesh>,
    reads: Arc<ReadWaiters>,
    /// The registered buffers one-sided reads land in.
    landings: Landings<TcpLanding>,
    next_read: AtomicU64,
}

/// A buffer registered with the mesh for reads to land in.
struct TcpLanding {
    bytes: Box<[u8]>,
    region: u32,
}

impl Landing for TcpLanding {
    fn capacity(&self) -> usize {
        self.bytes.len()
    }
}

impl TcpFabric {
    /// Wraps a connected, not yet started mesh.
    pub fn new(mesh: Mesh) -> TcpFabric {
        TcpFabric { mesh: Arc::new(mesh), reads: Arc::default(), landings: Landings::default(), next_read: AtomicU64::new(1) }
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
        let landed: Vec<Landed> = writes.iter().map(|w| Landed { imm: w.imm, len: w.len }).collect();
        self.handler.on_writes_landed(from, &landed);
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

    fn on_peer_connected(&self, peer: usize) {
        self.handler.on_peer_connected(peer);
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

    fn queued_bytes(&self, peer: usize) -> Option<u64> {
        Some(self.mesh.queued_bytes(peer))
    }

    fn start_polling(&self) {
        self.mesh.start_polling();
    }

    fn stop_polling(&self) {
        self.mesh.stop_polling();
    }

    fn poll_receive(&self) -> bool {
        self.mesh.poll_receive()
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

    fn post_read(&self, peer: usize, remote: RemoteAddr, len: usize) -> Result<PostedRead> {
        let id = self.next_read.fetch_add(1, Ordering::Relaxed);
        let make = |size: usize| {
            let mut bytes = vec![0u8; size].into_boxed_slice();
            // SAFETY: the box lives in `landings` (free, lent or retired) until it is
            // deregistered — when discarded, or never — and its heap memory never moves.
            let region = unsafe { self.mesh.register_read_only(bytes.as_mut_ptr(), bytes.len()) };
            Ok(TcpLanding { bytes, region })
        };
        // A free buffer is no read's target: once deregistered, nothing writes into it.
        let discard = |old: TcpLanding| {
            self.mesh.deregister(old.region);
        };
        let region = self.landings.lend(id, len, make, discard, |b| b.region)?;
        self.reads.expect(id);
        if let Err(e) = self.mesh.read(peer, remote.region, remote.addr, len, region, 0, id) {
            // Not sent (the mesh forgot it too): no answer will land in the buffer.
            self.landings.unsent(&self.reads, id);
            return Err(e.into());
        }
        Ok(PostedRead { id, peer, len })
    }

    fn read_done(&self, read: &PostedRead) -> bool {
        self.reads.is_done(read.id)
    }

    fn finish_read(&self, read: PostedRead, out: &mut [u8], timeout: Duration) -> Result<()> {
        self.landings.finish(&self.reads, read, out, timeout, |b, out| {
            out.copy_from_slice(&b.bytes[..out.len()]);
            Ok(())
        })
    }

    fn disconnect(&self, peer: usize) {
        self.mesh.disconnect(peer);
    }

    fn is_alive(&self, peer: usize) -> bool {
        self.mesh.is_alive(peer)
    }

    fn admit_joins(&self, info: Vec<u8>) {
        self.mesh.admit_joins(info);
    }

    fn join_addresses(&self) -> Vec<std::net::SocketAddr> {
        self.mesh.join_addresses()
    }

    fn shutdown(&self) {
        self.mesh.shutdown();
    }

    fn abort(&self) {
        self.mesh.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_tcp::{MeshConfig, join_cluster};

    /// A handler for a fabric whose frames the test does not look at.
    struct Quiet;

    impl FabricHandler for Quiet {
        fn on_frame(&self, _: usize, _: bytes::Bytes) {}
        fn on_writes_landed(&self, _: usize, _: &[Landed]) {}
        #[cfg(feature = "verbs")]
        fn on_write_done(&self, _: u64, _: Result<()>) {}
        fn on_peer_closed(&self, _: usize, _: Option<String>) {}
    }

    /// Two started fabrics over loopback.
    fn pair() -> Vec<TcpFabric> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let coordinator = format!("127.0.0.1:{port}");
        let joins: Vec<_> = (0..2)
            .map(|rank| {
                let coordinator = coordinator.clone();
                std::thread::spawn(move || join_cluster(rank, 2, &coordinator, MeshConfig::default()).map(|(_, mesh)| mesh))
            })
            .collect();
        let fabrics: Vec<TcpFabric> = joins.into_iter().map(|j| TcpFabric::new(j.join().unwrap().unwrap())).collect();
        for f in &fabrics {
            f.start(Arc::new(Quiet)).unwrap();
        }
        fabrics
    }

    #[test]
    fn reads_in_flight_together_each_land_in_their_own_buffer() {
        let fabrics = pair();
        let mut served: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        // SAFETY: `served` outlives both fabrics (they are shut down below, before it drops)
        // and is not moved.
        let region = unsafe { fabrics[1].registrar().register_read_only(served.as_mut_ptr(), served.len()) }.unwrap().region;
        let at = |addr: u64| RemoteAddr { region, addr };
        let timeout = Duration::from_secs(10);
        let spans = [(0u64, 100usize), (1000, 3000), (4000, 96), (17, 1)];
        let posted: Vec<PostedRead> = spans.iter().map(|&(addr, len)| fabrics[0].post_read(1, at(addr), len).unwrap()).collect();
        // Finished in the reverse order of posting.
        for (read, &(addr, len)) in posted.into_iter().zip(&spans).rev() {
            assert_eq!((read.peer(), read.len()), (1, len));
            let mut out = vec![0u8; len];
            fabrics[0].finish_read(read, &mut out, timeout).unwrap();
            assert_eq!(out, served[addr as usize..addr as usize + len], "read at {addr}");
        }
        // A read past the region fails alone; the reads around it are served.
        let bad = fabrics[0].post_read(1, at(4000), 200).unwrap();
        let good = fabrics[0].post_read(1, at(8), 8).unwrap();
        let mut out = vec![0u8; 8];
        fabrics[0].finish_read(good, &mut out, timeout).unwrap();
        assert_eq!(out, served[8..16]);
        let deadline = std::time::Instant::now() + timeout;
        while !fabrics[0].read_done(&bad) {
            assert!(std::time::Instant::now() < deadline, "the bad read never completed");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(fabrics[0].finish_read(bad, &mut [0u8; 200], timeout).is_err());
        let mut again = vec![0u8; 50];
        fabrics[0].read(1, at(50), &mut again, timeout).unwrap();
        assert_eq!(again, served[50..100]);
        // A read towards a closed connection is never sent: it fails when posted.
        fabrics[0].disconnect(1);
        while fabrics[0].is_alive(1) {
            assert!(std::time::Instant::now() < deadline, "the connection never closed");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(fabrics[0].post_read(1, at(0), 8).is_err());
        for f in &fabrics {
            f.shutdown();
        }
    }
}
