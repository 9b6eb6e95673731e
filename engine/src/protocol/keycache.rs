//! Key caching (the parameter server, OSDI 2014, Section 4.2): a worker that sends the same key
//! list to the same node again sends only the list's hash.
//!
//! Both ends keep, per (sender node, worker, receiver), the same first-in-first-out cache of key
//! lists: the sender marks a message whose list the receiver should keep (FLAG_KEYS_REMEMBER),
//! and later refers to it by hash (FLAG_KEYS_CACHED). A worker's messages to one node arrive in
//! the order it sent them, and both ends insert and evict in that order with the same capacity,
//! so the receiver holds every list the sender believes it holds (after a worker slot is reused
//! the receiver may hold more: older entries, evicted first). Remembering a list again moves it
//! to the newest position on both ends, so handling a message twice (a step resumed) changes
//! nothing. The sender compares the bytes of a list it finds by hash, so a hash collision costs a
//! full list, never a wrong one.

use std::collections::{HashMap, VecDeque};

/// Keys one (sender, worker, receiver) cache holds at most.
pub const KEY_CACHE_KEYS: usize = 1 << 20;

/// One end's cache of key lists (as little-endian `u64` bytes).
#[derive(Default)]
pub struct KeyCache {
    lists: HashMap<u64, Vec<u8>>,
    order: VecDeque<u64>,
    keys: usize,
}

impl KeyCache {
    /// Keeps `bytes` under `hash` as the newest entry, evicting the oldest beyond capacity.
    pub fn remember(&mut self, hash: u64, bytes: &[u8]) {
        if let Some(old) = self.lists.remove(&hash) {
            self.keys -= old.len() / 8;
            self.order.retain(|&h| h != hash);
        }
        self.lists.insert(hash, bytes.to_vec());
        self.order.push_back(hash);
        self.keys += bytes.len() / 8;
        while self.keys > KEY_CACHE_KEYS
            && let Some(oldest) = self.order.pop_front()
        {
            if let Some(gone) = self.lists.remove(&oldest) {
                self.keys -= gone.len() / 8;
            }
        }
    }

    /// The list kept under `hash`.
    pub fn get(&self, hash: u64) -> Option<&[u8]> {
        self.lists.get(&hash).map(Vec::as_slice)
    }

    /// Whether exactly `bytes` is kept under `hash` (the sender's check).
    pub fn holds(&self, hash: u64, bytes: &[u8]) -> bool {
        self.get(hash) == Some(bytes)
    }
}

/// The hash a key list is referred to by (FNV-1a over its bytes, as the configuration
/// fingerprint).
pub fn list_hash(bytes: &[u8]) -> u64 {
    crate::config::fnv1a(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ends_evict_alike() {
        let (mut a, mut b) = (KeyCache::default(), KeyCache::default());
        let list = |n: usize, seed: u8| vec![seed; n * 8];
        for (i, n) in [KEY_CACHE_KEYS / 2, KEY_CACHE_KEYS / 4, KEY_CACHE_KEYS / 2].into_iter().enumerate() {
            let l = list(n, i as u8);
            a.remember(list_hash(&l), &l);
            b.remember(list_hash(&l), &l);
        }
        let first = list(KEY_CACHE_KEYS / 2, 0);
        assert!(a.get(list_hash(&first)).is_none() && b.get(list_hash(&first)).is_none(), "the oldest went");
        let second = list(KEY_CACHE_KEYS / 4, 1);
        assert!(a.holds(list_hash(&second), &second) && b.holds(list_hash(&second), &second));
        // Remembering again moves to the newest position (idempotent for the newest).
        a.remember(list_hash(&second), &second);
        a.remember(list_hash(&second), &second);
        assert_eq!(a.order.back(), Some(&list_hash(&second)));
        assert!(!a.holds(list_hash(&second), &list(KEY_CACHE_KEYS / 4, 9)), "same hash, other bytes: not held");
    }
}
