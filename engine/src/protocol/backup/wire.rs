//! BACKUP and BACKUP_ACK: an owner's slot images for its backup, and the backup's
//! acknowledgement of a round.
//!
//! BACKUP: `[type][flags][table u16][round u32][count u32]`, then `count` items of
//! `[key u64][image]`, an image being the slot's value and updater state as little-endian
//! words ([`crate::store::Slot::append_all_words`]), so its size follows from the table. The
//! flag [`LAST`] marks a round's last message (which may carry no items); links keep their
//! order, so a backup that has handled it has handled the whole round.
//!
//! BACKUP_ACK: `[type][0][0 u16][round u32]`.
//!
//! JOIN_IMAGES, the images a joining node is handed (`protocol::join`), is laid out as BACKUP
//! with round 0.

use super::super::wire::{begin, finish, msg, u16_at, u32_at, u64_at};
use crate::error::{Error, Result};

/// Flag: the round's last message.
pub const LAST: u8 = 1;
/// Header bytes of BACKUP (after the length prefix, from the type byte on).
pub const HEADER: usize = 12;
/// Bytes of BACKUP_ACK.
pub const ACK_BYTES: usize = 8;

/// Starts a BACKUP of `table` for round `round` in `out`; returns where it starts. Items are
/// appended (the key, then the image's bytes) and the message closed with [`finish_backup`].
pub fn begin_backup(out: &mut Vec<u8>, table: u16, round: u32) -> usize {
    begin_images(out, msg::BACKUP, table, round)
}

/// Starts a message of images of type `ty` (BACKUP, or JOIN_IMAGES: a hand-over to a joining
/// node, laid out alike) in `out`; returns where it starts.
pub fn begin_images(out: &mut Vec<u8>, ty: u8, table: u16, round: u32) -> usize {
    debug_assert!(matches!(ty, msg::BACKUP | msg::JOIN_IMAGES));
    let start = begin(out, ty);
    out.push(0);
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&round.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    start
}

/// Appends one key's image (its words, value then state); the round appends from the slot
/// directly (`Slot::append_all_le_bytes`).
#[cfg(test)]
pub fn push_item(out: &mut Vec<u8>, key: u64, words: &[u32]) {
    out.extend_from_slice(&key.to_le_bytes());
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// Closes the BACKUP begun at `start` with `count` items (`last`: the round's last message).
/// Returns the message's length.
pub fn finish_backup(out: &mut [u8], start: usize, count: u32, last: bool) -> usize {
    // The length prefix is 4 bytes, then type and flags, table, round, count.
    out[start + 5] = if last { LAST } else { 0 };
    out[start + 12..start + 16].copy_from_slice(&count.to_le_bytes());
    finish(out, start);
    out.len() - start
}

/// A decoded BACKUP.
#[derive(Debug)]
pub struct Backup<'a> {
    /// The table of the images.
    pub table: u16,
    /// The owner's round.
    pub round: u32,
    /// Whether this is the round's last message.
    pub last: bool,
    /// Bytes per image.
    pub image_bytes: usize,
    items: &'a [u8],
}

impl<'a> Backup<'a> {
    /// The items: (key, image bytes).
    pub fn items(&self) -> impl Iterator<Item = (u64, &'a [u8])> + '_ {
        self.items.chunks_exact(8 + self.image_bytes).map(|item| (u64_at(item, 0), &item[8..]))
    }
}

/// Decodes a BACKUP (`b` from the type byte on); `image_bytes` gives a table's image size
/// (`None`: no such table). Its size must match its count exactly.
pub fn decode_backup(b: &[u8], image_bytes: impl Fn(u16) -> Option<usize>) -> Result<Backup<'_>> {
    if b.len() < HEADER {
        return Err(Error::Protocol("BACKUP too short".into()));
    }
    let (flags, table, round, count) = (b[1], u16_at(b, 2), u32_at(b, 4), u32_at(b, 8) as usize);
    let items = &b[HEADER..];
    if count == 0 {
        if !items.is_empty() {
            return Err(Error::Protocol("BACKUP of no items carries bytes".into()));
        }
        return Ok(Backup { table, round, last: flags & LAST != 0, image_bytes: 0, items });
    }
    let image = image_bytes(table).ok_or_else(|| Error::Protocol(format!("BACKUP of unknown table {table}")))?;
    if items.len() / (8 + image) != count || !items.len().is_multiple_of(8 + image) {
        return Err(Error::Protocol(format!("BACKUP of {count} items of {image} bytes has {} bytes", items.len())));
    }
    Ok(Backup { table, round, last: flags & LAST != 0, image_bytes: image, items })
}

/// Encodes BACKUP_ACK of `round`; returns its length.
pub fn encode_ack(out: &mut Vec<u8>, round: u32) -> usize {
    let start = begin(out, msg::BACKUP_ACK);
    out.extend_from_slice(&[0, 0, 0]);
    out.extend_from_slice(&round.to_le_bytes());
    finish(out, start);
    out.len() - start
}

/// Decodes BACKUP_ACK: the round.
pub fn decode_ack(b: &[u8]) -> Result<u32> {
    if b.len() != ACK_BYTES {
        return Err(Error::Protocol("BACKUP_ACK of wrong size".into()));
    }
    Ok(u32_at(b, 4))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::wire::Messages;

    #[test]
    fn backups_round_trip_and_reject_wrong_sizes() {
        let mut frame = Vec::new();
        let start = begin_backup(&mut frame, 3, 77);
        push_item(&mut frame, 5, &[1, 2]);
        push_item(&mut frame, 9, &[3, 4]);
        finish_backup(&mut frame, start, 2, false);
        let start = begin_backup(&mut frame, 0, 77);
        finish_backup(&mut frame, start, 0, true);
        encode_ack(&mut frame, 77);
        let bodies: Vec<&[u8]> = Messages::new(&frame).map(|m| m.unwrap()).collect();
        let b = decode_backup(bodies[0], |t| (t == 3).then_some(8)).unwrap();
        assert_eq!((b.table, b.round, b.last), (3, 77, false));
        let items: Vec<(u64, Vec<u8>)> = b.items().map(|(k, i)| (k, i.to_vec())).collect();
        assert_eq!(items, vec![(5, [1u32, 2].iter().flat_map(|w| w.to_le_bytes()).collect()), (9, [3u32, 4].iter().flat_map(|w| w.to_le_bytes()).collect())]);
        let end = decode_backup(bodies[1], |_| None).unwrap();
        assert!(end.last && end.items().count() == 0);
        assert_eq!(decode_ack(bodies[2]).unwrap(), 77);
        // A table of other image sizes, an unknown table, cut messages.
        assert!(decode_backup(bodies[0], |_| Some(12)).is_err());
        assert!(decode_backup(bodies[0], |_| None).is_err());
        assert!(decode_backup(&bodies[0][..bodies[0].len() - 1], |_| Some(8)).is_err());
        assert!(decode_backup(&bodies[0][..5], |_| Some(8)).is_err());
        assert!(decode_ack(&bodies[2][..7]).is_err());
    }
}
