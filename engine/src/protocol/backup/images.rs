//! The images a node keeps for its predecessor: per table and start-up home, one dense array
//! of slot images indexed like the home's keys, so that keeping an image is a copy and failover
//! walks the arrays.
//!
//! Each image remembers the node and the round it came in. Two rounds of one node may reach
//! the backup out of order: the thread that began the earlier one hands its frames to the
//! fabric only when its step ends, and another thread may begin, fill and hand on the next
//! round meanwhile. An image from an earlier round of the node that sent the one kept is older
//! and is dropped; rounds complete in order, so both rounds are in before either releases an
//! answer.

use crate::util::FastMap;

/// Images of one table's keys homed at one node on start-up.
#[derive(Debug)]
pub(crate) struct ImageSet {
    /// Bytes per image.
    image_bytes: usize,
    /// `image_bytes` per key, by the key's index among its home's keys.
    bytes: Vec<u8>,
    /// Which indices hold an image.
    present: Vec<bool>,
    /// Per index, the node and round the image came in (see the module documentation).
    origins: Vec<Origin>,
}

/// The sender of an image whose sender is gone (see [`KeptImages::forget_origin`]).
const NO_ORIGIN: u16 = u16::MAX;

/// Where an image came from: the node that sent it and the round it belongs to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Origin {
    /// The sender.
    pub from: u16,
    /// Its round.
    pub round: u32,
}

impl Origin {
    /// Whether an image from `self` is older than the one from `kept`: both came from one node,
    /// and in an earlier round.
    fn older_than(self, kept: Origin) -> bool {
        self.from == kept.from && super::later(kept.round, self.round)
    }
}

impl ImageSet {
    /// The image of the key at `index` among the home's keys, if held.
    pub fn get(&self, index: usize) -> Option<&[u8]> {
        let bytes = self.image_bytes.max(1);
        if !self.present.get(index).copied().unwrap_or(false) {
            return None;
        }
        self.bytes.get(index * bytes..(index + 1) * bytes)
    }

    /// The images held: (index among the home's keys, image).
    pub fn iter(&self) -> impl Iterator<Item = (usize, &[u8])> {
        self.bytes.chunks_exact(self.image_bytes.max(1)).enumerate().filter(|&(i, _)| self.present[i])
    }
}

/// Every image kept, per (table, start-up home).
#[derive(Debug, Default)]
pub(crate) struct KeptImages {
    sets: FastMap<(u16, u16), ImageSet>,
}

impl KeptImages {
    /// Keeps the images `(home, index, image)` of `table`, all from `origin`: each for the key
    /// at `index` among the keys of `table` homed at `home` on start-up, whose count `keys`
    /// gives (an array is sized from this node's own partitioning, never from what a peer
    /// says; images out of range or of another size than the set's are dropped, and so is one
    /// older than the image held, see [`Origin`]). Returns how many were kept.
    pub fn keep_all<'a>(&mut self, table: u16, origin: Origin, images: impl Iterator<Item = (u16, usize, &'a [u8])>, keys: impl Fn(u16) -> usize) -> usize {
        let mut kept = 0;
        // The set of the home the last image had (images come in runs of one home).
        let mut set: Option<(u16, &mut ImageSet)> = None;
        for (home, index, image) in images {
            if set.as_ref().is_none_or(|(h, _)| *h != home) {
                let n = keys(home);
                let s = self.sets.entry((table, home)).or_insert_with(|| ImageSet {
                    image_bytes: image.len(),
                    bytes: vec![0; n * image.len()],
                    present: vec![false; n],
                    origins: vec![Origin::default(); n],
                });
                set = Some((home, s));
            }
            let Some((_, s)) = set.as_mut() else { continue };
            if s.image_bytes != image.len() || index >= s.present.len() || (s.present[index] && origin.older_than(s.origins[index])) {
                continue;
            }
            s.bytes[index * image.len()..(index + 1) * image.len()].copy_from_slice(image);
            s.present[index] = true;
            s.origins[index] = origin;
            kept += 1;
        }
        kept
    }

    /// Takes the sets of the homes `take` selects.
    pub fn take(&mut self, take: impl Fn(u16) -> bool) -> Vec<((u16, u16), ImageSet)> {
        let keys: Vec<(u16, u16)> = self.sets.keys().copied().filter(|&(_, home)| take(home)).collect();
        keys.into_iter().filter_map(|k| self.sets.remove(&k).map(|set| (k, set))).collect()
    }

    /// The image kept of the key at `index` among those of `table` homed at `home` on
    /// start-up, if any.
    pub fn get(&self, table: u16, home: u16, index: usize) -> Option<&[u8]> {
        self.sets.get(&(table, home))?.get(index)
    }

    /// `peer` is gone: its images stay, but no longer count as from it. A node that joins in
    /// its rank later numbers its rounds afresh, and its images must not count as older.
    pub fn forget_origin(&mut self, peer: u16) {
        for set in self.sets.values_mut() {
            set.origins.iter_mut().filter(|o| o.from == peer).for_each(|o| o.from = NO_ORIGIN);
        }
    }

    /// Images held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.sets.values().map(|s| s.present.iter().filter(|&&p| p).count()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_kept_by_home_and_index_and_taken_per_home() {
        let mut k = KeptImages::default();
        let images: [(u16, usize, &[u8]); 5] = [(2, 1, &[1, 2]), (2, 1, &[3, 4]), (2, 3, &[5, 6]), (2, 9, &[0, 0]), (2, 0, &[0, 0, 0])];
        let origin = Origin { from: 2, round: 7 };
        assert_eq!(k.keep_all(0, origin, images.into_iter(), |_| 4), 3);
        assert_eq!(k.keep_all(1, origin, [(0u16, 0usize, &[7u8][..])].into_iter(), |_| 2), 1);
        assert_eq!(k.len(), 3, "out of range and wrong sizes are not kept");
        let taken = k.take(|home| home == 2);
        assert_eq!(taken.len(), 1);
        let images: Vec<(usize, Vec<u8>)> = taken[0].1.iter().map(|(i, b)| (i, b.to_vec())).collect();
        assert_eq!(images, vec![(1, vec![3, 4]), (3, vec![5, 6])]);
        assert_eq!(taken[0].1.get(3), Some(&[5u8, 6][..]));
        assert_eq!(taken[0].1.get(2), None, "never kept");
        assert_eq!(taken[0].1.get(99), None, "beyond the home's keys");
        assert_eq!(k.len(), 1);
    }

    #[test]
    fn an_image_from_an_earlier_round_of_the_same_node_is_dropped() {
        let mut k = KeptImages::default();
        let keep = |k: &mut KeptImages, from: u16, round: u32, image: &[u8]| k.keep_all(0, Origin { from, round }, [(1u16, 0usize, image)].into_iter(), |_| 1);
        assert_eq!(keep(&mut k, 1, 5, &[5]), 1);
        assert_eq!(keep(&mut k, 1, 4, &[4]), 0, "round 4 arrived after round 5");
        assert_eq!(keep(&mut k, 1, 5, &[6]), 1, "a later message of the same round");
        assert_eq!(keep(&mut k, 3, 1, &[7]), 1, "another node (it took the key over since)");
        assert_eq!(keep(&mut k, 1, u32::MAX, &[8]), 1, "node 1 again: an image from another node lies between");
        assert_eq!(keep(&mut k, 1, 2, &[9]), 1, "round numbers wrap");
        assert_eq!(keep(&mut k, 1, u32::MAX, &[1]), 0);
        // Node 1 is gone; a fresh node in its rank begins at round 1 again.
        k.forget_origin(1);
        assert_eq!(keep(&mut k, 1, 1, &[9]), 1);
        assert_eq!(k.take(|_| true)[0].1.get(0), Some(&[9u8][..]));
    }
}
