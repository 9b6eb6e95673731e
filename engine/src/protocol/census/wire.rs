//! The census's messages.
//!
//! CENSUS_FLUSH and CENSUS_DONE: `[type][0][0 u16][epoch u32]`.
//!
//! CENSUS: `[type][flags][table u16][epoch u32][count u32]`, then `count` claims, each
//! `[key u64][kind u8][value u32][region u32][addr u64]`: kind 0 held (value 0), 1 arriving
//! (value: the reservation; region and address: the slot reserved for it), 2 handing over
//! and 3 handing over once arrived (value: the node it goes to); region and address are zero
//! but for an arrival. The flag [`LAST`] marks the sender's
//! last CENSUS to this node (it may carry no claim).

use super::super::wire::{begin, finish, msg, u16_at, u32_at, u64_at};
use super::Claim;
use crate::error::{Error, Result};
use crate::store::RemoteAddr;

/// Flag: the sender's last CENSUS to this node.
pub const LAST: u8 = 1;
/// Bytes of CENSUS_FLUSH and CENSUS_DONE.
pub const SHORT_BYTES: usize = 8;
/// Header bytes of CENSUS.
pub const HEADER: usize = 12;
/// Bytes of a claim.
pub const CLAIM: usize = 25;

/// Appends CENSUS_FLUSH or CENSUS_DONE (`ty`) of census `epoch`; returns its length.
pub fn encode_short(out: &mut Vec<u8>, ty: u8, epoch: u32) -> usize {
    debug_assert!(matches!(ty, msg::CENSUS_FLUSH | msg::CENSUS_DONE));
    let start = begin(out, ty);
    out.push(0);
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&epoch.to_le_bytes());
    finish(out, start);
    out.len() - start
}

/// The epoch of a CENSUS_FLUSH or CENSUS_DONE.
pub fn decode_short(body: &[u8]) -> Result<u32> {
    if body.len() != SHORT_BYTES {
        return Err(Error::Protocol(format!("census message of {} bytes", body.len())));
    }
    Ok(u32_at(body, 4))
}

/// Appends one CENSUS of `table` with `claims`; returns its length.
pub fn encode_census(out: &mut Vec<u8>, table: u16, epoch: u32, last: bool, claims: &[(u64, Claim)]) -> usize {
    let start = begin(out, msg::CENSUS);
    out.push(if last { LAST } else { 0 });
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&epoch.to_le_bytes());
    out.extend_from_slice(&(claims.len() as u32).to_le_bytes());
    for &(key, claim) in claims {
        out.extend_from_slice(&key.to_le_bytes());
        let (kind, value, at) = match claim {
            Claim::Held => (0u8, 0u32, RemoteAddr::default()),
            Claim::Arriving(resv, at) => (1, resv, at),
            Claim::Handing(to) => (2, to as u32, RemoteAddr::default()),
            Claim::Then(to) => (3, to as u32, RemoteAddr::default()),
        };
        out.push(kind);
        out.extend_from_slice(&value.to_le_bytes());
        out.extend_from_slice(&at.region.to_le_bytes());
        out.extend_from_slice(&at.addr.to_le_bytes());
    }
    finish(out, start);
    out.len() - start
}

/// A decoded CENSUS.
#[derive(Debug)]
pub struct CensusMessage<'a> {
    /// Its table.
    pub table: u16,
    /// The census it belongs to.
    pub epoch: u32,
    /// Whether it is the sender's last.
    pub last: bool,
    body: &'a [u8],
    count: usize,
}

impl CensusMessage<'_> {
    /// Decodes a CENSUS; the claims are checked as they are read ([`CensusMessage::claims`]).
    pub fn decode(body: &[u8]) -> Result<CensusMessage<'_>> {
        if body.len() < HEADER {
            return Err(Error::Protocol(format!("CENSUS of {} bytes", body.len())));
        }
        let count = u32_at(body, 8) as usize;
        if body.len() != HEADER + count.saturating_mul(CLAIM) {
            return Err(Error::Protocol(format!("CENSUS of {} bytes claims {count} keys", body.len())));
        }
        Ok(CensusMessage { table: u16_at(body, 2), epoch: u32_at(body, 4), last: body[1] & LAST != 0, body, count })
    }

    /// The claims: (key, claim); an unknown kind or a node beyond `nodes` is an error.
    pub fn claims(&self, nodes: usize) -> impl Iterator<Item = Result<(u64, Claim)>> + '_ {
        (0..self.count).map(move |i| {
            let at = HEADER + i * CLAIM;
            let (key, kind, value) = (u64_at(self.body, at), self.body[at + 8], u32_at(self.body, at + 9));
            let slot = RemoteAddr { region: u32_at(self.body, at + 13), addr: u64_at(self.body, at + 17) };
            let claim = match kind {
                0 => Claim::Held,
                1 => Claim::Arriving(value, slot),
                2 if (value as usize) < nodes => Claim::Handing(value as u16),
                3 if (value as usize) < nodes => Claim::Then(value as u16),
                _ => return Err(Error::Protocol(format!("CENSUS claim of kind {kind} ({value}) for key {key}"))),
            };
            Ok((key, claim))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn census_messages_round_trip_and_reject_bad_claims() {
        let mut out = Vec::new();
        encode_short(&mut out, msg::CENSUS_FLUSH, 3);
        assert_eq!(decode_short(&out[4..]).unwrap(), 3);
        assert!(decode_short(&out[4..7]).is_err());
        let mut out = Vec::new();
        let claims = [(5u64, Claim::Held), (6, Claim::Arriving(77, RemoteAddr { region: 3, addr: 1 << 40 })), (9, Claim::Handing(2)), (9, Claim::Then(0))];
        encode_census(&mut out, 1, 4, true, &claims);
        let m = CensusMessage::decode(&out[4..]).unwrap();
        assert_eq!((m.table, m.epoch, m.last), (1, 4, true));
        assert_eq!(m.claims(3).collect::<Result<Vec<_>>>().unwrap(), claims.to_vec());
        assert!(m.claims(2).any(|c| c.is_err()), "node 2 of 2");
        assert!(CensusMessage::decode(&out[4..out.len() - 1]).is_err());
        let mut bad = out[4..].to_vec();
        bad[HEADER + 8] = 7;
        assert!(CensusMessage::decode(&bad).unwrap().claims(3).any(|c| c.is_err()));
    }
}
