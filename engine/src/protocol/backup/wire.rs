//! BACKUP and BACKUP_ACK: an owner's slot images for its backup, and the backup's
//! acknowledgement of a round.
//!
//! BACKUP: `[type][flags][table u16][round u32][count u32]`, then `count` images in runs of
//! consecutive keys, each `[first key u64][n u32]` and `n ≥ 1` images (of keys `first`,
//! `first + 1`, …), an image being the slot's value and updater state as little-endian words
//! ([`crate::store::Slot::append_all_words`]), so its size follows from the table. A round
//! reads the changed keys of 64-key blocks in order, so a bulk push's images go as a few runs,
//! without a key each (which would triple a 1-value image's bytes). The flag [`LAST`] marks a
//! round's last message (which may carry no images); links keep their order, so a backup that
//! has handled it has handled the whole round.
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

/// Bytes of a run's header: its first key and its length.
pub const RUN_HEADER: usize = 12;

/// A BACKUP or JOIN_IMAGES being written into a buffer: images are appended in runs of
/// consecutive keys ([`ImageWriter::key`], then the image's bytes) and the message is closed
/// with [`ImageWriter::finish`].
#[derive(Debug)]
pub struct ImageWriter {
    /// Where the message starts (its length prefix).
    start: usize,
    /// Images so far.
    count: u32,
    /// The open run: where its length is, and the key that would continue it.
    run: Option<(usize, u64)>,
}

impl ImageWriter {
    /// Starts a BACKUP of `table` for round `round` in `out`.
    pub fn backup(out: &mut Vec<u8>, table: u16, round: u32) -> ImageWriter {
        ImageWriter::begin(out, msg::BACKUP, table, round)
    }

    /// Starts a message of images of type `ty` (BACKUP, or JOIN_IMAGES: a hand-over to a
    /// joining node, laid out alike) in `out`.
    pub fn begin(out: &mut Vec<u8>, ty: u8, table: u16, round: u32) -> ImageWriter {
        debug_assert!(matches!(ty, msg::BACKUP | msg::JOIN_IMAGES));
        let start = begin(out, ty);
        out.push(0);
        out.extend_from_slice(&table.to_le_bytes());
        out.extend_from_slice(&round.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        ImageWriter { start, count: 0, run: None }
    }

    /// The image of `key` comes next (the caller appends its bytes right after): it continues
    /// the open run when `key` follows the run's last key, else opens a run.
    pub fn key(&mut self, out: &mut Vec<u8>, key: u64) {
        let at = match self.run {
            Some((at, next)) if next == key => {
                let n = u32_at(out, at) + 1;
                out[at..at + 4].copy_from_slice(&n.to_le_bytes());
                at
            }
            _ => {
                out.extend_from_slice(&key.to_le_bytes());
                out.extend_from_slice(&1u32.to_le_bytes());
                out.len() - 4
            }
        };
        // (A run never wraps past the largest key.)
        self.run = key.checked_add(1).map(|next| (at, next));
        self.count += 1;
    }

    /// The message's bytes so far, its length prefix included.
    pub fn len(&self, out: &[u8]) -> usize {
        out.len() - self.start
    }

    /// Where the message starts in its buffer.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Closes the message (`last`: the round's last); returns its length.
    pub fn finish(self, out: &mut [u8], last: bool) -> usize {
        // The length prefix is 4 bytes, then type and flags, table, round, count.
        let start = self.start;
        out[start + 5] = if last { LAST } else { 0 };
        out[start + 12..start + 16].copy_from_slice(&self.count.to_le_bytes());
        finish(out, start);
        out.len() - start
    }
}

/// Appends one key's image (its words, value then state) through `writer`; the round appends
/// from the slot directly (`Slot::append_all_le_bytes`).
#[cfg(test)]
pub fn push_item(writer: &mut ImageWriter, out: &mut Vec<u8>, key: u64, words: &[u32]) {
    writer.key(out, key);
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
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
    pub fn items(&self) -> Images<'a> {
        Images { rest: self.items, image_bytes: self.image_bytes, key: 0, left: 0 }
    }
}

/// The images of a decoded BACKUP, run by run (see [`Backup::items`]).
#[derive(Debug, Clone)]
pub struct Images<'a> {
    rest: &'a [u8],
    image_bytes: usize,
    /// The key of the next image of the current run.
    key: u64,
    /// Images left in the current run.
    left: u32,
}

impl<'a> Iterator for Images<'a> {
    type Item = (u64, &'a [u8]);

    fn next(&mut self) -> Option<(u64, &'a [u8])> {
        if self.left == 0 {
            // (The runs were checked when the message was decoded.)
            let header = self.rest.get(..RUN_HEADER)?;
            (self.key, self.left) = (u64_at(header, 0), u32_at(header, 8));
            self.rest = &self.rest[RUN_HEADER..];
        }
        let image = self.rest.get(..self.image_bytes)?;
        self.rest = &self.rest[self.image_bytes..];
        let key = self.key;
        self.key = self.key.wrapping_add(1);
        self.left -= 1;
        Some((key, image))
    }
}

/// Decodes a BACKUP (`b` from the type byte on); `image_bytes` gives a table's image size
/// (`None`: no such table). Its runs must hold exactly its count of images, none empty, none
/// past the largest key.
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
    let bad = |why: &str| Error::Protocol(format!("BACKUP of {count} images of {image} bytes in {} bytes: {why}", items.len()));
    let (mut at, mut images) = (0usize, 0usize);
    while at < items.len() {
        let header = items.get(at..at + RUN_HEADER).ok_or_else(|| bad("a run's header is cut"))?;
        let (first, n) = (u64_at(header, 0), u32_at(header, 8) as u64);
        if n == 0 || first.checked_add(n - 1).is_none() {
            return Err(bad("a run is empty or passes the largest key"));
        }
        let bytes = (n as usize).checked_mul(image).filter(|&b| b <= items.len() - at - RUN_HEADER).ok_or_else(|| bad("a run is cut"))?;
        at += RUN_HEADER + bytes;
        images += n as usize;
    }
    if images != count {
        return Err(bad("the runs hold another count"));
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
        let mut w = ImageWriter::backup(&mut frame, 3, 77);
        // Keys 5, 6, 7 go as one run, 9 as another, u64::MAX and 0 as two more.
        for (key, words) in [(5, [1, 2]), (6, [3, 4]), (7, [5, 6]), (9, [7, 8]), (u64::MAX, [9, 10]), (0, [11, 12])] {
            push_item(&mut w, &mut frame, key, &words);
        }
        assert_eq!(w.len(&frame), 4 + HEADER + 4 * RUN_HEADER + 6 * 8);
        w.finish(&mut frame, false);
        let w = ImageWriter::backup(&mut frame, 0, 77);
        w.finish(&mut frame, true);
        encode_ack(&mut frame, 77);
        let bodies: Vec<&[u8]> = Messages::new(&frame).map(|m| m.unwrap()).collect();
        let b = decode_backup(bodies[0], |t| (t == 3).then_some(8)).unwrap();
        assert_eq!((b.table, b.round, b.last), (3, 77, false));
        let items: Vec<(u64, Vec<u8>)> = b.items().map(|(k, i)| (k, i.to_vec())).collect();
        let image = |a: u32, b: u32| [a, b].iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(items, vec![(5, image(1, 2)), (6, image(3, 4)), (7, image(5, 6)), (9, image(7, 8)), (u64::MAX, image(9, 10)), (0, image(11, 12))]);
        let end = decode_backup(bodies[1], |_| None).unwrap();
        assert!(end.last && end.items().count() == 0);
        assert_eq!(decode_ack(bodies[2]).unwrap(), 77);
        // A table of other image sizes, an unknown table, cut messages.
        assert!(decode_backup(bodies[0], |_| Some(12)).is_err());
        assert!(decode_backup(bodies[0], |_| None).is_err());
        assert!(decode_backup(&bodies[0][..bodies[0].len() - 1], |_| Some(8)).is_err());
        assert!(decode_backup(&bodies[0][..5], |_| Some(8)).is_err());
        assert!(decode_ack(&bodies[2][..7]).is_err());
        // Runs that disagree with the count, an empty run, a run past the largest key.
        let mut body = bodies[0].to_vec();
        body[8..12].copy_from_slice(&7u32.to_le_bytes());
        assert!(decode_backup(&body, |_| Some(8)).is_err(), "count 7, runs of 6");
        let run_of = |first: u64, n: u32| {
            let mut b = bodies[0][..HEADER].to_vec();
            b[8..12].copy_from_slice(&n.max(1).to_le_bytes());
            b.extend_from_slice(&first.to_le_bytes());
            b.extend_from_slice(&n.to_le_bytes());
            b.extend(std::iter::repeat_n(0u8, 8 * n.max(1) as usize));
            b
        };
        assert_eq!(decode_backup(&run_of(3, 2), |_| Some(8)).unwrap().items().map(|(k, _)| k).collect::<Vec<_>>(), [3, 4]);
        assert!(decode_backup(&run_of(3, 0), |_| Some(8)).is_err(), "an empty run");
        assert!(decode_backup(&run_of(u64::MAX, 1), |_| Some(8)).is_ok());
        let mut past = run_of(u64::MAX - 1, 3);
        past[8..12].copy_from_slice(&3u32.to_le_bytes());
        assert!(decode_backup(&past, |_| Some(8)).is_err(), "a run past the largest key");
    }
}
