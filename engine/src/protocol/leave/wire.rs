//! LEAVE_ASK, LEAVE_BEGIN, LEAVE_READY and LEFT: the messages of a graceful leave, each
//! `[type][0][node u16]`, `node` being the leaving node; and LEAVE_KNOWN, a node's report to a
//! new coordinator, `[type][asks u8][count u16][node u16 × count]`.

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

/// Appends LEAVE_KNOWN: the departures this node knows were begun (`queue`, in order) and
/// whether it asked to leave (`asks`); returns its length.
pub fn encode_known(out: &mut Vec<u8>, queue: &[u16], asks: bool) -> usize {
    let start = begin(out, msg::LEAVE_KNOWN);
    out.push(asks as u8);
    out.extend_from_slice(&(queue.len() as u16).to_le_bytes());
    for node in queue {
        out.extend_from_slice(&node.to_le_bytes());
    }
    finish(out, start);
    out.len() - start
}

/// Decodes LEAVE_KNOWN (`b` from the type byte on) in a cluster of `nodes`: the queue and
/// whether the sender asked to leave.
pub fn decode_known(b: &[u8], nodes: usize) -> Result<(Vec<u16>, bool)> {
    if b.len() < BYTES || b[1] > 1 {
        return Err(Error::Protocol(format!("LEAVE_KNOWN of {} bytes", b.len())));
    }
    let count = u16_at(b, 2) as usize;
    if b.len() != BYTES + 2 * count || count > nodes {
        return Err(Error::Protocol(format!("LEAVE_KNOWN of {} bytes naming {count} departures among {nodes} nodes", b.len())));
    }
    let queue: Vec<u16> = (0..count).map(|i| u16_at(b, BYTES + 2 * i)).collect();
    if let Some(bad) = queue.iter().find(|&&n| n as usize >= nodes) {
        return Err(Error::Protocol(format!("LEAVE_KNOWN names node {bad} of {nodes}")));
    }
    Ok((queue, b[1] == 1))
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

    #[test]
    fn reports_to_a_new_coordinator_round_trip_and_reject_bad_counts() {
        let mut frame = Vec::new();
        let len = encode_known(&mut frame, &[3, 1], true);
        assert_eq!(len, frame.len());
        let body = Messages::new(&frame).next().unwrap().unwrap();
        assert_eq!(body[0], msg::LEAVE_KNOWN);
        assert_eq!(decode_known(body, 4).unwrap(), (vec![3, 1], true));
        assert!(decode_known(body, 3).is_err(), "node 3 of 3");
        assert!(decode_known(&body[..body.len() - 1], 4).is_err(), "cut short");
        let mut frame = Vec::new();
        encode_known(&mut frame, &[], false);
        let body = Messages::new(&frame).next().unwrap().unwrap();
        assert_eq!(decode_known(body, 2).unwrap(), (vec![], false));
        let mut claims_more = body.to_vec();
        claims_more[2] = 9;
        assert!(decode_known(&claims_more, 2).is_err(), "a count the bytes do not hold");
    }
}
