//! `ferry-verbs`: a safe wrapper over libibverbs for reliable-connected RDMA, knowing nothing
//! about parameters.
//!
//! libibverbs is loaded when the process starts (through `sideway`'s run-time loader), so the
//! same binary runs on hosts without it: [`list_devices`] and [`probe`] then report
//! [`VerbsError::Unavailable`] with the reason (library missing, no kernel support, no device,
//! no active port).
//!
//! The pieces: [`Context`] (an opened device and protection domain) registers caller memory
//! ([`Context::register`]) and owned buffers ([`Context::alloc`]); [`CompletionQueue`]s collect
//! completions, drained by a [`Poller`] thread; [`QueuePair`]s are reliable-connected and are
//! joined by exchanging [`Endpoint`]s (and [`RemoteRegion`]s for one-sided access) over an
//! existing connection ([`exchange`]). Work requests: SEND (with or without immediate), RDMA
//! WRITE, RDMA WRITE WITH IMMEDIATE, and RDMA READ; failed completions come back as
//! [`VerbsError::Completion`] with a [`CompletionStatus`].

#![warn(missing_docs)]

mod context;
mod device;
mod error;
mod poller;
mod queue;

use std::io::{Read, Write};

pub use context::{Access, Context, LocalSlice, MemoryRegion, RegisteredBuffer, RemoteRegion, RemoteSlice, memlock_hint};
pub use device::{Chosen, DeviceInfo, GidInfo, GidKind, LinkLayer, PortInfo, Selection, choose, default_gid_index, list_devices, probe};
pub use error::{CompletionStatus, Result, VerbsError};
pub use poller::{Backoff, CompletionHandler, PollHandle, Poller};
pub use queue::{Completion, CompletionKind, CompletionQueue, Endpoint, Operation, Payload, QueuePair, QueuePairCaps, SendRequest};

/// Largest blob [`exchange`] accepts.
const MAX_EXCHANGE: usize = 1 << 20;

/// Sends `local` over `stream` and returns what the peer sent the same way (both sides call
/// this; blobs are length-prefixed). Use it to trade [`Endpoint`]s and [`RemoteRegion`]s over
/// a TCP connection.
pub fn exchange<S: Read + Write>(stream: &mut S, local: &[u8]) -> Result<Vec<u8>> {
    let io = |e: std::io::Error| VerbsError::Exchange(e.to_string());
    if local.len() > MAX_EXCHANGE {
        return Err(VerbsError::Exchange(format!("{} bytes is more than the {MAX_EXCHANGE} an exchange carries", local.len())));
    }
    stream.write_all(&(local.len() as u32).to_le_bytes()).map_err(io)?;
    stream.write_all(local).map_err(io)?;
    stream.flush().map_err(io)?;
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).map_err(io)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_EXCHANGE {
        return Err(VerbsError::Exchange(format!("the peer announced {len} bytes")));
    }
    let mut remote = vec![0u8; len];
    stream.read_exact(&mut remote).map_err(io)?;
    Ok(remote)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trip_and_rejects() {
        let e = Endpoint { qpn: 0x1234, psn: 0xabcdef, lid: 7, gid: [9; 16], mtu: 4096, link_layer: LinkLayer::Ethernet };
        assert_eq!(Endpoint::decode(&e.encode()).unwrap(), e);
        let mut bytes = e.encode();
        bytes[0] = b'X';
        assert!(Endpoint::decode(&bytes).is_err());
        let mut bytes = e.encode();
        bytes[2] = 99;
        assert!(Endpoint::decode(&bytes).is_err());
        let mut bytes = e.encode();
        bytes[8..12].copy_from_slice(&0x0100_0000u32.to_le_bytes());
        assert!(Endpoint::decode(&bytes).is_err(), "psn wider than 24 bits");
        assert!(Endpoint::decode(&bytes[..10]).is_err());
    }

    #[test]
    fn remote_region_round_trip_and_bounds() {
        let r = RemoteRegion { addr: 0x7f00_0000_1000, len: 4096, rkey: 0xdead };
        assert_eq!(RemoteRegion::decode(&r.encode()).unwrap(), r);
        assert!(RemoteRegion::decode(&[0; 3]).is_err());
        assert_eq!(r.slice(4000, 96).unwrap(), RemoteSlice { addr: 0x7f00_0000_1000 + 4000, rkey: 0xdead });
        assert!(r.slice(4000, 97).is_err());
        assert!(r.slice(u64::MAX, 2).is_err());
    }

    #[test]
    fn exchange_over_a_socket_pair() {
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || exchange(&mut b, b"from b").unwrap());
        assert_eq!(exchange(&mut a, b"from a").unwrap(), b"from b");
        assert_eq!(t.join().unwrap(), b"from a");
    }

    #[test]
    fn completion_status_mapping() {
        assert_eq!(CompletionStatus::from_raw(10), CompletionStatus::RemoteAccess);
        assert_eq!(CompletionStatus::from_raw(5), CompletionStatus::Flushed);
        assert!(CompletionStatus::from_raw(12).is_connection_loss());
        assert_eq!(CompletionStatus::from_raw(77), CompletionStatus::Other(77));
    }
}
