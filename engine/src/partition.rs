//! Key → home-node assignment.
//!
//! Every scheme maps a key to a *position* in `0..keys` (range: the key itself; hash and
//! consistent: a multiplicative bijection `key·m mod keys` with `m` coprime to `keys`). Range
//! and hash cut the positions into `nodes` contiguous runs of nearly equal length; consistent
//! hashing cuts them into arcs between its virtual nodes ([`ring`]). Either way a home node's
//! keys have dense indices `0..home_count`, which is what keeps its location table small and
//! array-backed. An explicit [`Placement`] gives each key its home and its dense index
//! directly.

mod ring;

use std::sync::Arc;

use crate::config::{Partitioning, TableSpec};
use crate::placement::Placement;

/// The home-node mapping of one table.
#[derive(Debug, Clone)]
pub struct Partitioner {
    keys: u64,
    nodes: u64,
    kind: Partitioning,
    mult: u64,
    inverse: u64,
    /// The ring, for consistent hashing.
    ring: Option<ring::Ring>,
    /// The explicit homes, for [`Partitioning::Placed`].
    placement: Option<Arc<Placement>>,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Inverse of `a` modulo `m` (they must be coprime).
fn mod_inverse(a: u64, m: u64) -> u64 {
    if m == 1 {
        return 0;
    }
    let (mut old_r, mut r) = (a as i128, m as i128);
    let (mut old_s, mut s) = (1i128, 0i128);
    while r != 0 {
        let q = old_r / r;
        (old_r, r) = (r, old_r - q * r);
        (old_s, s) = (s, old_s - q * s);
    }
    old_s.rem_euclid(m as i128) as u64
}

impl Partitioner {
    /// The mapping of `spec`'s keys onto `nodes` nodes, by its partitioning (and placement).
    pub fn of(spec: &TableSpec, nodes: usize) -> Partitioner {
        Partitioner::with_placement(spec.keys, nodes, spec.partitioning, spec.placement.clone())
    }

    /// The mapping of `keys` keys onto `nodes` nodes, with `placement` for
    /// [`Partitioning::Placed`] (whose counts the configuration has checked).
    pub fn with_placement(keys: u64, nodes: usize, kind: Partitioning, placement: Option<Arc<Placement>>) -> Partitioner {
        let mut p = Partitioner::new(keys, nodes, kind);
        if kind == Partitioning::Placed {
            p.placement = placement.filter(|pl| pl.keys() == p.keys && pl.nodes() == nodes);
        }
        p
    }

    /// The mapping of `keys` keys onto `nodes` nodes (a [`Partitioning::Placed`] table without
    /// its placement, which a configuration refuses, falls back to hashing).
    pub fn new(keys: u64, nodes: usize, kind: Partitioning) -> Partitioner {
        let keys = keys.max(1);
        // A multiplier near keys/φ spreads neighbours far apart; gcd(keys-1, keys) = 1 bounds
        // the search. With a single key every multiplier maps it to position 0.
        let mut mult = ((keys as f64) * 0.618_033_988_749_894_9) as u64;
        mult = mult.clamp(1, keys.saturating_sub(1).max(1));
        while keys > 1 && gcd(mult, keys) != 1 {
            mult += 1;
        }
        let inverse = mod_inverse(mult, keys);
        let ring = match kind {
            Partitioning::Consistent { virtual_nodes } => Some(ring::Ring::new(keys, nodes, virtual_nodes)),
            Partitioning::Range | Partitioning::Hash | Partitioning::Placed => None,
        };
        Partitioner { keys, nodes: nodes as u64, kind, mult, inverse, ring, placement: None }
    }

    #[inline]
    fn position(&self, key: u64) -> u64 {
        match self.kind {
            Partitioning::Range => key,
            // Below 2^32 keys the product fits 64 bits, and a 64-bit remainder is much cheaper.
            _ if self.keys <= 1 << 32 => (key * self.mult) % self.keys,
            _ => ((key as u128 * self.mult as u128) % self.keys as u128) as u64,
        }
    }

    #[inline]
    fn key_at(&self, position: u64) -> u64 {
        match self.kind {
            Partitioning::Range => position,
            Partitioning::Hash | Partitioning::Consistent { .. } | Partitioning::Placed => {
                ((position as u128 * self.inverse as u128) % self.keys as u128) as u64
            }
        }
    }

    /// First position of `node`'s run.
    #[inline]
    fn start(&self, node: u64) -> u64 {
        // keys < 2^42 and nodes < 2^16 (configuration limits), so the product fits 64 bits.
        node * self.keys / self.nodes
    }

    /// The scheme.
    pub fn kind(&self) -> Partitioning {
        self.kind
    }

    /// The home node of `key` (which must be below the table's key count).
    #[inline]
    pub fn home(&self, key: u64) -> usize {
        if let Some(placement) = &self.placement {
            return placement.home(key);
        }
        let pos = self.position(key);
        match &self.ring {
            Some(ring) => ring.node(pos),
            None => self.node_at(pos),
        }
    }

    /// The node whose run of positions holds `pos` (range and hash partitioning).
    #[inline]
    fn node_at(&self, pos: u64) -> usize {
        (((pos + 1) * self.nodes - 1) / self.keys) as usize
    }

    /// The node whose run holds `pos`, from `hint` (the last run found: start, end, node) when
    /// it lies there, else found and remembered (range and hash partitioning).
    #[inline]
    fn node_at_cached(&self, pos: u64, hint: &mut (u64, u64, usize)) -> usize {
        if pos < hint.0 || pos >= hint.1 {
            let node = self.node_at(pos);
            *hint = (self.start(node as u64), self.start(node as u64 + 1), node);
        }
        hint.2
    }

    /// The home node of `key`, remembering the last run of positions found in `hint` (start,
    /// end, node) so that runs of keys homed together — range partitioning's neighbours —
    /// cost a comparison, not a division. A fresh hint is `(0, 0, 0)`.
    #[inline]
    pub fn home_cached(&self, key: u64, hint: &mut (u64, u64, usize)) -> usize {
        if self.placement.is_some() || self.ring.is_some() {
            return self.home(key);
        }
        self.node_at_cached(self.position(key), hint)
    }

    /// The dense index of `key` among its home node's keys.
    #[inline]
    pub fn home_index(&self, key: u64) -> usize {
        if let Some(placement) = &self.placement {
            return placement.home_index(key);
        }
        let pos = self.position(key);
        match &self.ring {
            Some(ring) => ring.locate(pos).1 as usize,
            None => (pos - self.start(self.node_at(pos) as u64)) as usize,
        }
    }

    /// The home node of `key` and its index among that node's keys ([`Partitioner::home`] and
    /// [`Partitioner::home_index`] at once), with a hint as [`Partitioner::home_cached`] keeps
    /// it: keys homed together — range partitioning's neighbours, a hash partitioning home's
    /// keys in home-index order — cost a comparison and a subtraction, not divisions.
    #[inline]
    pub fn locate_cached(&self, key: u64, hint: &mut (u64, u64, usize)) -> (usize, usize) {
        if self.placement.is_some() || self.ring.is_some() {
            return (self.home(key), self.home_index(key));
        }
        let pos = self.position(key);
        let home = self.node_at_cached(pos, hint);
        (home, (pos - hint.0) as usize)
    }

    /// Number of keys homed at `node`.
    pub fn home_count(&self, node: usize) -> usize {
        if let Some(placement) = &self.placement {
            return placement.home_count(node) as usize;
        }
        match &self.ring {
            Some(ring) => ring.count(node) as usize,
            None => (self.start(node as u64 + 1) - self.start(node as u64)) as usize,
        }
    }

    /// The keys homed at `node`, in home-index order.
    pub fn home_keys(&self, node: usize) -> Box<dyn Iterator<Item = u64> + '_> {
        if let Some(placement) = &self.placement {
            return Box::new(placement.homes().iter().enumerate().filter(move |(_, h)| **h as usize == node).map(|(k, _)| k as u64));
        }
        match &self.ring {
            Some(ring) => Box::new(ring.arcs_of(node).flat_map(move |arc| arc.map(move |p| self.key_at(p)))),
            None => Box::new((self.start(node as u64)..self.start(node as u64 + 1)).map(move |p| self.key_at(p))),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn check(keys: u64, nodes: usize, kind: Partitioning) {
        let p = Partitioner::new(keys, nodes, kind);
        let mut seen = vec![false; keys as usize];
        let mut total = 0;
        for node in 0..nodes {
            let count = p.home_count(node);
            if !matches!(kind, Partitioning::Consistent { .. }) {
                assert!(count as u64 <= keys / nodes as u64 + 1);
            }
            for (i, key) in p.home_keys(node).enumerate() {
                assert!(key < keys);
                assert!(!seen[key as usize], "key {key} twice");
                seen[key as usize] = true;
                assert_eq!(p.home(key), node, "home of {key}");
                assert_eq!(p.home_index(key), i, "index of {key}");
                total += 1;
            }
            assert_eq!(total, (0..=node).map(|n| p.home_count(n)).sum::<usize>());
        }
        assert_eq!(total as u64, keys);
        // The cached lookup agrees, whatever order the keys come in and whatever the hint holds.
        let mut hint = (0, 0, 0);
        for key in (0..keys).chain((0..keys).rev()).chain((0..keys).step_by(3)) {
            assert_eq!(p.locate_cached(key, &mut hint), (p.home(key), p.home_index(key)), "key {key}");
            assert_eq!(p.home_cached(key, &mut hint), p.home(key), "key {key}");
        }
    }

    #[test]
    fn small_cases() {
        for keys in 1..40 {
            for nodes in 1..6 {
                check(keys, nodes, Partitioning::Range);
                check(keys, nodes, Partitioning::Hash);
                check(keys, nodes, Partitioning::Consistent { virtual_nodes: 3 });
            }
        }
    }

    #[test]
    fn hash_scatters_neighbours() {
        let p = Partitioner::new(1_000_000, 4, Partitioning::Hash);
        let differing = (0..1000u64).filter(|&k| p.home(k) != p.home(k + 1)).count();
        assert!(differing > 500, "only {differing} of 1000 neighbour pairs differ");
    }

    /// The share of `keys` keys whose home differs between `nodes` and `nodes + 1` nodes.
    fn moved_share(keys: u64, nodes: usize, kind: Partitioning) -> f64 {
        let (before, after) = (Partitioner::new(keys, nodes, kind), Partitioner::new(keys, nodes + 1, kind));
        (0..keys).filter(|&k| before.home(k) != after.home(k)).count() as f64 / keys as f64
    }

    #[test]
    fn only_consistent_hashing_moves_few_keys_when_a_node_joins() {
        for nodes in [2, 3, 7] {
            let ideal = 1.0 / (nodes + 1) as f64;
            let consistent = moved_share(200_000, nodes, Partitioning::consistent());
            assert!(consistent < 1.3 * ideal, "consistent, {nodes} → {}: {consistent:.3} moved", nodes + 1);
            for kind in [Partitioning::Range, Partitioning::Hash] {
                let share = moved_share(200_000, nodes, kind);
                assert!(share > 0.45, "{kind:?}, {nodes} → {}: {share:.3} moved", nodes + 1);
            }
        }
    }

    #[test]
    fn consistent_hashing_scatters_neighbours() {
        let p = Partitioner::new(1_000_000, 4, Partitioning::consistent());
        let differing = (0..1000u64).filter(|&k| p.home(k) != p.home(k + 1)).count();
        assert!(differing > 500, "only {differing} of 1000 neighbour pairs differ");
    }

    #[test]
    fn names_read_back() {
        for kind in [Partitioning::Range, Partitioning::Hash, Partitioning::consistent(), Partitioning::Consistent { virtual_nodes: 7 }] {
            assert_eq!(kind.name().parse::<Partitioning>(), Ok(kind));
        }
        assert_eq!("consistent".parse::<Partitioning>(), Ok(Partitioning::Consistent { virtual_nodes: Partitioning::DEFAULT_VIRTUAL_NODES }));
        for bad in ["", "ring", "consistent:", "consistent:0", "consistent:x", "consistent:4097", "consistent:-1"] {
            assert!(bad.parse::<Partitioning>().is_err(), "{bad:?} was read");
        }
    }

    proptest! {
        #[test]
        fn every_key_has_exactly_one_home(keys in 1u64..5000, nodes in 1usize..9) {
            check(keys, nodes, Partitioning::Hash);
            check(keys, nodes, Partitioning::Range);
            check(keys, nodes, Partitioning::Consistent { virtual_nodes: 16 });
        }
    }
}
