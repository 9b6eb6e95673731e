//! An explicit key → home placement: one home per key, chosen by whoever knows the data (the
//! co-partitioner of [`crate::copartition`], or a trainer's own plan) instead of by a hash.
//!
//! Every node holds the whole map (2 bytes a key) and, for the keys of each home, their dense
//! index among that home's keys (4 bytes a key), which is what the directory's owner array and
//! the store's slots are indexed by. A lookup is two loads.

use crate::error::{Error, Result};

/// The home node of every key of one table, the same on every node of the cluster.
///
/// Built with [`Placement::new`] from a home per key (or read from a plan file by
/// [`crate::copartition::Plan::read`]) and given to a table by [`crate::TableSpec::placed`].
#[derive(Clone)]
pub struct Placement {
    nodes: usize,
    homes: Vec<u16>,
    /// Each key's index among its home's keys.
    index: Vec<u32>,
    /// Keys per home.
    counts: Vec<u64>,
    /// A hash of the nodes and homes: the fingerprint nodes compare at start-up.
    digest: u64,
}

impl Placement {
    /// Most keys an explicit placement holds (it costs every node 6 bytes a key).
    pub const MAX_KEYS: u64 = 1 << 31;

    /// The placement of `homes.len()` keys, key `k` homed at node `homes[k]`, on a cluster of
    /// `nodes` nodes. Fails on a home outside `0..nodes`, on no keys, or on more than
    /// [`Placement::MAX_KEYS`].
    pub fn new(nodes: usize, homes: Vec<u16>) -> Result<Placement> {
        let bad = |m: String| Err(Error::Config(m));
        if nodes == 0 || nodes > u16::MAX as usize {
            return bad(format!("a placement is for 1..={} nodes, not {nodes}", u16::MAX));
        }
        if homes.is_empty() || homes.len() as u64 > Placement::MAX_KEYS {
            return bad(format!("a placement places 1..={} keys, not {}", Placement::MAX_KEYS, homes.len()));
        }
        if let Some((key, home)) = homes.iter().enumerate().find(|(_, h)| **h as usize >= nodes) {
            return bad(format!("the placement homes key {key} at node {home}, but the cluster has {nodes} nodes"));
        }
        let mut counts = vec![0u64; nodes];
        let index = homes
            .iter()
            .map(|&h| {
                let c = &mut counts[h as usize];
                *c += 1;
                (*c - 1) as u32
            })
            .collect();
        let mut digest = crate::hashing::mix(nodes as u64 ^ 0x706c_6163_6564);
        for chunk in homes.chunks(4) {
            let word = chunk.iter().enumerate().fold(0u64, |w, (i, &h)| w | (h as u64) << (16 * i));
            digest = crate::hashing::mix(digest ^ word);
        }
        Ok(Placement { nodes, homes, index, counts, digest })
    }

    /// Nodes the placement is for.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Keys it places (`0..keys`).
    pub fn keys(&self) -> u64 {
        self.homes.len() as u64
    }

    /// The home of `key` (below [`Placement::keys`]).
    #[inline]
    pub fn home(&self, key: u64) -> usize {
        self.homes[key as usize] as usize
    }

    /// The homes of all keys, in key order.
    pub fn homes(&self) -> &[u16] {
        &self.homes
    }

    /// Keys homed at `node`.
    pub fn home_count(&self, node: usize) -> u64 {
        self.counts.get(node).copied().unwrap_or(0)
    }

    /// A hash of the nodes and homes (what nodes compare at start-up, and what
    /// `Config::fingerprint_text` shows).
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// `key`'s index among its home's keys.
    #[inline]
    pub(crate) fn home_index(&self, key: u64) -> usize {
        self.index[key as usize] as usize
    }
}

impl std::fmt::Debug for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Placement {{ nodes: {}, keys: {}, per node: {:?}, digest: {:016x} }}", self.nodes, self.homes.len(), self.counts, self.digest)
    }
}

impl PartialEq for Placement {
    fn eq(&self, other: &Placement) -> bool {
        self.digest == other.digest && self.nodes == other.nodes && self.homes == other.homes
    }
}

impl Eq for Placement {}

impl std::hash::Hash for Placement {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.digest.hash(state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_indices_count_each_homes_keys_in_key_order() {
        let p = Placement::new(3, vec![2, 0, 2, 1, 0, 2]).unwrap();
        assert_eq!((p.nodes(), p.keys()), (3, 6));
        assert_eq!((0..6).map(|k| p.home_index(k)).collect::<Vec<_>>(), vec![0, 0, 1, 0, 1, 2]);
        assert_eq!((0..3).map(|n| p.home_count(n)).collect::<Vec<_>>(), vec![2, 1, 3]);
        assert_ne!(p.digest(), Placement::new(3, vec![2, 0, 2, 1, 0, 1]).unwrap().digest());
        assert_ne!(p.digest(), Placement::new(4, vec![2, 0, 2, 1, 0, 2]).unwrap().digest());
    }

    #[test]
    fn bad_placements_are_refused_with_the_reason() {
        let e = Placement::new(2, vec![0, 1, 2]).unwrap_err().to_string();
        assert!(e.contains("key 2 at node 2") && e.contains("2 nodes"), "{e}");
        assert!(Placement::new(0, vec![0]).is_err());
        assert!(Placement::new(2, Vec::new()).is_err());
    }
}
