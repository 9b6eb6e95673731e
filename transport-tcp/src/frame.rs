//! The frame format on every connection.
//!
//! Every frame starts with an 8-byte header: a magic byte, the frame kind, 16 flag bits and the
//! payload length (little endian). Kinds other than [`FrameKind::Message`] start their payload with
//! a fixed, kind-specific header; see the `*_HEADER` constants.

use crate::error::TransportError;

/// First byte of every frame; anything else means the stream is corrupt.
pub const MAGIC: u8 = 0xF7;
/// Size of the common frame header.
pub const HEADER_LEN: usize = 8;
/// Payload header of a one-sided write: region u32, imm u32, offset u64, wr_id u64.
pub const WRITE_HEADER: usize = 24;
/// Payload of a read request: wr_id u64, region u32, len u32, offset u64.
pub const READ_REQUEST_LEN: usize = 24;
/// Payload header of a read response: wr_id u64, status u32, region u32.
pub const READ_RESPONSE_HEADER: usize = 16;
/// Payload of a write error report: wr_id u64, code u32, region u32.
pub const WRITE_ERROR_LEN: usize = 16;
/// Payload of a heartbeat: the bytes of the receiver's stream the sender has read, u64.
pub const HEARTBEAT_LEN: usize = 8;

/// Flag bit of a write frame: an immediate value is to be delivered at the target.
pub const FLAG_IMM: u16 = 1;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// A two-sided message for the peer's handler.
    Message = 1,
    /// A one-sided write into a registered region of the peer.
    Write = 2,
    /// A request to read bytes from a registered region of the peer.
    ReadRequest = 3,
    /// The answer to a read request.
    ReadResponse = 4,
    /// The target refused a one-sided write.
    WriteError = 5,
    /// Keeps an idle connection alive, and says how much of the receiver's stream the sender
    /// has read.
    Heartbeat = 6,
    /// The sender is shutting down cleanly; no more frames follow.
    Goodbye = 7,
}

impl FrameKind {
    fn from_u8(byte: u8) -> Option<FrameKind> {
        Some(match byte {
            1 => FrameKind::Message,
            2 => FrameKind::Write,
            3 => FrameKind::ReadRequest,
            4 => FrameKind::ReadResponse,
            5 => FrameKind::WriteError,
            6 => FrameKind::Heartbeat,
            7 => FrameKind::Goodbye,
            _ => return None,
        })
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The frame kind.
    pub kind: FrameKind,
    /// Kind-specific flag bits.
    pub flags: u16,
    /// Length of the payload that follows the header.
    pub len: u32,
}

impl Header {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0] = MAGIC;
        out[1] = self.kind as u8;
        out[2..4].copy_from_slice(&self.flags.to_le_bytes());
        out[4..8].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Decodes and validates a header; `max_payload` bounds the announced length.
    pub fn decode(bytes: &[u8; HEADER_LEN], peer: usize, max_payload: usize) -> Result<Header, TransportError> {
        let malformed = |reason: String| TransportError::Malformed { peer, reason };
        if bytes[0] != MAGIC {
            return Err(malformed(format!("bad magic byte {:#04x}", bytes[0])));
        }
        let kind = FrameKind::from_u8(bytes[1]).ok_or_else(|| malformed(format!("unknown frame kind {}", bytes[1])))?;
        let flags = u16::from_le_bytes([bytes[2], bytes[3]]);
        let len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        if len as usize > max_payload {
            return Err(malformed(format!("frame of {len} bytes exceeds the limit of {max_payload}")));
        }
        let fixed = match kind {
            FrameKind::Write => WRITE_HEADER,
            FrameKind::ReadRequest => READ_REQUEST_LEN,
            FrameKind::ReadResponse => READ_RESPONSE_HEADER,
            FrameKind::WriteError => WRITE_ERROR_LEN,
            FrameKind::Heartbeat => HEARTBEAT_LEN,
            FrameKind::Message | FrameKind::Goodbye => 0,
        };
        let exact = matches!(kind, FrameKind::ReadRequest | FrameKind::WriteError | FrameKind::Heartbeat | FrameKind::Goodbye);
        if (exact && len as usize != fixed) || (len as usize) < fixed {
            return Err(malformed(format!("{kind:?} frame with a payload of {len} bytes")));
        }
        Ok(Header { kind, flags, len })
    }
}

/// Little-endian field readers over a payload whose length was validated by [`Header::decode`].
pub(crate) fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

pub(crate) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = Header { kind: FrameKind::Write, flags: FLAG_IMM, len: 4096 };
        assert_eq!(Header::decode(&h.encode(), 3, 1 << 20).unwrap(), h);
    }

    #[test]
    fn rejects_bad_magic_kind_and_size() {
        let mut bytes = Header { kind: FrameKind::Message, flags: 0, len: 10 }.encode();
        bytes[0] = 0;
        assert!(Header::decode(&bytes, 1, 100).is_err());
        let mut bytes = Header { kind: FrameKind::Message, flags: 0, len: 10 }.encode();
        bytes[1] = 99;
        assert!(Header::decode(&bytes, 1, 100).is_err());
        let bytes = Header { kind: FrameKind::Message, flags: 0, len: 1000 }.encode();
        assert!(Header::decode(&bytes, 1, 100).is_err());
        let bytes = Header { kind: FrameKind::ReadRequest, flags: 0, len: 3 }.encode();
        assert!(Header::decode(&bytes, 1, 100).is_err());
        let bytes = Header { kind: FrameKind::Write, flags: 0, len: 3 }.encode();
        assert!(Header::decode(&bytes, 1, 100).is_err());
    }
}
