//! LEAVE_ASK, LEAVE_BEGIN, LEAVE_READY and LEFT: the messages of a graceful leave, each
//! `[type][0][node u16]`, `node` being the leaving node.

use super::super::wire::{begin, finish, msg, u16_at};
use crate::error::{Error, Result};

/// Bytes of each message (from the type byte on).
pub const BYTES: usize = 4;

/// Appends a message of type `ty` about leaving node `node`; returns its length.
pub fn encode(out: &mut Vec<u8>, ty: u8, node: u16) -> usize {
    debug_assert!(matches!(ty, msg::LEAVE_ASK | msg::LEAVE_BEGIN | msg::LEAVE_READY | msg::LEFT));
    let start = begin(out, ty);
    out.push(0);
    out.extend_from_slice(&node.to_le_bytes());
    finish(out, start);
    out.len() - start
}

/// Decodes one of these messages (`b` from the type byte on): the leaving node.
pub fn decode(b: &[u8]) -> Result<u16> {
    if b.len() != BYTES {
        return Err(Error::Protocol(format!("leave message (type {}) of {} bytes, not {BYTES}", b.first().copied().unwrap_or(0), b.len())));
    }
    Ok(u16_at(b, 2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::wire::Messages;

    #[test]
    fn leave_messages_round_trip_and_reject_wrong_sizes() {
        let mut frame = Vec::new();
        let len = encode(&mut frame, msg::LEFT, 5);
        assert_eq!(len, frame.len());
        let body = Messages::new(&frame).next().unwrap().unwrap();
        assert_eq!((body[0], decode(body).unwrap()), (msg::LEFT, 5));
        assert!(decode(&body[..3]).is_err());
        let mut longer = body.to_vec();
        longer.push(0);
        assert!(decode(&longer).is_err());
    }
}
