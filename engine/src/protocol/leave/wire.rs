//! LEAVE_ASK, LEAVE_BEGIN, LEAVE_READY and LEFT: the messages of a graceful leave, each
//! `[type][0][node u16]`, `node` being the leaving node (LEAVE_BEGIN's is a queue entry: with
//! [`super::JOIN_BIT`] it begins a join); JOIN_ASK, JOIN_READY, JOIN_ACK, JOIN_ABANDONED and JOIN_SETTLED, laid out alike
//! about the joining node; LEAVE_KNOWN, a node's report to a new coordinator,
//! `[type][asks u8][count u16][entry u16 × count]`; JOIN_WELCOME, the nodes gone from the
//! cluster and every node's incarnation, `[type][0][count u16][node u16 × count][u8 × nodes]`;
//! JOIN_HANDED, as JOIN_ASK or followed by the generations of a node that joined already; and
//! JOINED,
//! `[type][0][node u16][workers u32][finalize u32]`, the joining node and the barrier
//! generations it takes part in from.

use super::super::wire::{begin, finish, msg, u16_at, u32_at};
use crate::error::{Error, Result};

/// Bytes of each message (from the type byte on).
pub const BYTES: usize = 4;

/// Appends a message of type `ty` about leaving node `node`; returns its length.
pub fn encode(out: &mut Vec<u8>, ty: u8, node: u16) -> usize {
    debug_assert!(matches!(
        ty,
        msg::LEAVE_ASK
            | msg::LEAVE_BEGIN
            | msg::LEAVE_READY
            | msg::LEFT
            | msg::JOIN_ASK
            | msg::JOIN_READY
            | msg::JOIN_ACK
            | msg::JOIN_ABANDONED
            | msg::JOIN_SETTLED
    ));
    let start = begin(out, ty);
    out.push(0);
    out.extend_from_slice(&node.to_le_bytes());
    finish(out, start);
    out.len() - start
}

/// Appends LEFT about `node` of incarnation `incarnation` (its spare byte; see
/// `Directory::incarnation`); returns its length.
pub fn encode_left(out: &mut Vec<u8>, node: u16, incarnation: u8) -> usize {
    let len = encode(out, msg::LEFT, node);
    let at = out.len() - len;
    out[at + 5] = incarnation;
    len
}

/// Decodes LEFT: the node that left and its incarnation.
pub fn decode_left(b: &[u8]) -> Result<(u16, u8)> {
    Ok((decode(b)?, b[1]))
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
    if let Some(bad) = queue.iter().find(|&&n| (n & !super::JOIN_BIT) as usize >= nodes) {
        return Err(Error::Protocol(format!("LEAVE_KNOWN names node {bad} of {nodes}")));
    }
    Ok((queue, b[1] == 1))
}

/// Appends JOIN_WELCOME: the nodes gone from the cluster (lost or left), and every node's
/// incarnation; returns its length.
pub fn encode_welcome(out: &mut Vec<u8>, gone: &[u16], incarnations: &[u8]) -> usize {
    let start = begin(out, msg::JOIN_WELCOME);
    out.push(0);
    out.extend_from_slice(&(gone.len() as u16).to_le_bytes());
    for node in gone {
        out.extend_from_slice(&node.to_le_bytes());
    }
    out.extend_from_slice(incarnations);
    finish(out, start);
    out.len() - start
}

/// Decodes JOIN_WELCOME (`b` from the type byte on) in a cluster of `nodes`: the gone nodes
/// and every node's incarnation.
pub fn decode_welcome(b: &[u8], nodes: usize) -> Result<(Vec<u16>, Vec<u8>)> {
    if b.len() < BYTES || b[1] != 0 {
        return Err(Error::Protocol(format!("JOIN_WELCOME of {} bytes", b.len())));
    }
    let count = u16_at(b, 2) as usize;
    if b.len() != BYTES + 2 * count + nodes || count > nodes {
        return Err(Error::Protocol(format!("JOIN_WELCOME of {} bytes naming {count} nodes of {nodes}", b.len())));
    }
    let gone: Vec<u16> = (0..count).map(|i| u16_at(b, BYTES + 2 * i)).collect();
    if let Some(bad) = gone.iter().find(|&&n| n as usize >= nodes) {
        return Err(Error::Protocol(format!("JOIN_WELCOME names node {bad} of {nodes}")));
    }
    Ok((gone, b[BYTES + 2 * count..].to_vec()))
}

/// Appends JOIN_HANDED of `node`: laid out as JOIN_ASK, followed by the barrier generations
/// it takes part in from (workers, finalize) when it joined already; returns its length.
pub fn encode_handed(out: &mut Vec<u8>, node: u16, joined: Option<[u32; 2]>) -> usize {
    let start = begin(out, msg::JOIN_HANDED);
    out.push(0);
    out.extend_from_slice(&node.to_le_bytes());
    if let Some(from) = joined {
        out.extend_from_slice(&from[0].to_le_bytes());
        out.extend_from_slice(&from[1].to_le_bytes());
    }
    finish(out, start);
    out.len() - start
}

/// Decodes JOIN_HANDED: the joining node, and its first barrier generations if it joined.
pub fn decode_handed(b: &[u8]) -> Result<(u16, Option<[u32; 2]>)> {
    match b.len() {
        BYTES => Ok((u16_at(b, 2), None)),
        JOINED_BYTES => Ok((u16_at(b, 2), Some([u32_at(b, 4), u32_at(b, 8)]))),
        n => Err(Error::Protocol(format!("JOIN_HANDED of {n} bytes"))),
    }
}

/// Bytes of JOINED.
pub const JOINED_BYTES: usize = 12;

/// Appends JOINED: `node` is a member again, taking part in barriers from generations
/// `from` (workers, finalize); returns its length.
pub fn encode_joined(out: &mut Vec<u8>, node: u16, from: [u32; 2]) -> usize {
    let start = begin(out, msg::JOINED);
    out.push(0);
    out.extend_from_slice(&node.to_le_bytes());
    out.extend_from_slice(&from[0].to_le_bytes());
    out.extend_from_slice(&from[1].to_le_bytes());
    finish(out, start);
    out.len() - start
}

/// Decodes JOINED (`b` from the type byte on): the node and its first barrier generations.
pub fn decode_joined(b: &[u8]) -> Result<(u16, [u32; 2])> {
    if b.len() != JOINED_BYTES {
        return Err(Error::Protocol(format!("JOINED of {} bytes, not {JOINED_BYTES}", b.len())));
    }
    Ok((u16_at(b, 2), [u32_at(b, 4), u32_at(b, 8)]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::wire::Messages;

    #[test]
    fn leave_messages_round_trip_and_reject_wrong_sizes() {
        let mut frame = Vec::new();
        let len = encode_left(&mut frame, 5, 3);
        assert_eq!(len, frame.len());
        let body = Messages::new(&frame).next().unwrap().unwrap();
        assert_eq!((body[0], decode(body).unwrap()), (msg::LEFT, 5));
        assert_eq!(decode_left(body).unwrap(), (5, 3));
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
        // A join in a queue names its node below the join bit.
        let mut frame = Vec::new();
        encode_known(&mut frame, &[super::super::JOIN_BIT | 2], false);
        let body = Messages::new(&frame).next().unwrap().unwrap();
        assert_eq!(decode_known(body, 3).unwrap().0, vec![super::super::JOIN_BIT | 2]);
        assert!(decode_known(body, 2).is_err(), "a join of node 2 of 2");
    }

    #[test]
    fn welcomes_and_joined_round_trip_and_reject_bad_input() {
        let mut frame = Vec::new();
        let len = encode_welcome(&mut frame, &[0, 3], &[1, 0, 2, 0]);
        encode_joined(&mut frame, 2, [7, 1]);
        assert!(len < frame.len());
        let bodies: Vec<&[u8]> = Messages::new(&frame).map(|m| m.unwrap()).collect();
        assert_eq!(decode_welcome(bodies[0], 4).unwrap(), (vec![0, 3], vec![1, 0, 2, 0]));
        assert!(decode_welcome(bodies[0], 3).is_err(), "incarnations of 4 nodes in a cluster of 3");
        assert!(decode_welcome(&bodies[0][..bodies[0].len() - 2], 4).is_err(), "cut short");
        let mut claims_more = bodies[0].to_vec();
        claims_more[2] = 200;
        assert!(decode_welcome(&claims_more, 4).is_err(), "a count the bytes do not hold");
        assert_eq!(decode_joined(bodies[1]).unwrap(), (2, [7, 1]));
        assert!(decode_joined(&bodies[1][..11]).is_err());
        let mut frame = Vec::new();
        encode_handed(&mut frame, 3, None);
        encode_handed(&mut frame, 3, Some([9, 2]));
        let bodies: Vec<&[u8]> = Messages::new(&frame).map(|m| m.unwrap()).collect();
        assert_eq!(decode_handed(bodies[0]).unwrap(), (3, None));
        assert_eq!(decode_handed(bodies[1]).unwrap(), (3, Some([9, 2])));
        assert!(decode_handed(&bodies[1][..7]).is_err());
    }
}
