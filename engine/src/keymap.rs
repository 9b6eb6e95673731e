//! Per-key bookkeeping indexed by key, for state touched key after key in key order.
//!
//! The intent service and the homes keep a record per intended key and visit thousands of
//! them per round, in sorted batches. In a hash map each visit lands on a random cache line,
//! and with the workers' training data filling the caches between rounds most visits missed
//! (MF in intent mode: 60 % of the homes' bookkeeping time was one load). [`KeyMap`] finds a
//! key through a dense index instead — per table, pages of [`PAGE`] slot numbers, made when a
//! key of the page first gets a record — and keeps the records in a slab whose slots are
//! reused, so that keys visited in order touch neighbouring index entries and, as far as the
//! records were made in order, neighbouring records: the hardware prefetcher follows. Memory
//! is four bytes per key of a touched page plus the records alive (at their peak).

/// Keys per index page (4 KiB of slot numbers).
pub const PAGE: usize = 1024;

/// Per table, pages of `P` covering [`PAGE`] keys each, made on first use (the part
/// [`KeyMap`]'s index and [`KeySet`]'s bits share).
#[derive(Debug)]
struct Pages<P> {
    tables: Vec<Vec<Option<Box<P>>>>,
}

impl<P> Default for Pages<P> {
    fn default() -> Self {
        Pages { tables: Vec::new() }
    }
}

/// The page of `key` and its position in it.
fn split(key: u64) -> (usize, usize) {
    ((key / PAGE as u64) as usize, (key % PAGE as u64) as usize)
}

impl<P> Pages<P> {
    /// Page `page` of `table`, if it was made.
    fn get(&self, table: u16, page: usize) -> Option<&P> {
        self.tables.get(table as usize)?.get(page)?.as_deref()
    }

    /// Page `page` of `table`, if it was made, to change.
    fn get_mut(&mut self, table: u16, page: usize) -> Option<&mut P> {
        self.tables.get_mut(table as usize)?.get_mut(page)?.as_deref_mut()
    }

    /// Page `page` of `table`, made with `make` if it was not.
    fn get_or_make(&mut self, table: u16, page: usize, make: impl FnOnce() -> Box<P>) -> &mut P {
        if self.tables.len() <= table as usize {
            self.tables.resize_with(table as usize + 1, Vec::new);
        }
        let pages = &mut self.tables[table as usize];
        if pages.len() <= page {
            pages.resize_with(page + 1, || None);
        }
        pages[page].get_or_insert_with(make)
    }
}

/// Records per `(table, key)`, found through a paged dense index.
#[derive(Debug)]
pub struct KeyMap<V> {
    /// Each key's slot in `slots` plus one (0: no record).
    index: Pages<[u32; PAGE]>,
    /// The records; a `None` slot is in `free`, for reuse.
    slots: Vec<Option<((u16, u64), V)>>,
    free: Vec<u32>,
}

impl<V> Default for KeyMap<V> {
    fn default() -> Self {
        KeyMap { index: Pages::default(), slots: Vec::new(), free: Vec::new() }
    }
}

impl<V> KeyMap<V> {
    /// The slot (plus one) recorded for `key` of `table`; 0 when none.
    fn slot_of(&self, table: u16, key: u64) -> u32 {
        let (page, at) = split(key);
        self.index.get(table, page).map_or(0, |p| p[at])
    }

    /// The record of `key` of `table`.
    pub fn get(&self, table: u16, key: u64) -> Option<&V> {
        match self.slot_of(table, key) {
            0 => None,
            s => self.slots[s as usize - 1].as_ref().map(|(_, v)| v),
        }
    }

    /// The record of `key` of `table`, to change.
    pub fn get_mut(&mut self, table: u16, key: u64) -> Option<&mut V> {
        match self.slot_of(table, key) {
            0 => None,
            s => self.slots[s as usize - 1].as_mut().map(|(_, v)| v),
        }
    }

    /// The record of `key` of `table`, made with `V::default()` if it has none.
    pub fn get_or_default(&mut self, table: u16, key: u64) -> &mut V
    where
        V: Default,
    {
        let (page, at) = split(key);
        let entry = &mut self.index.get_or_make(table, page, || Box::new([0; PAGE]))[at];
        if *entry == 0 {
            let slot = match self.free.pop() {
                Some(s) => {
                    self.slots[s as usize] = Some(((table, key), V::default()));
                    s
                }
                None => {
                    self.slots.push(Some(((table, key), V::default())));
                    u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 records")
                }
            };
            *entry = slot + 1;
        }
        let slot = *entry as usize - 1;
        &mut self.slots[slot].as_mut().expect("an indexed slot holds a record").1
    }

    /// Removes the record of `key` of `table` and returns it.
    pub fn remove(&mut self, table: u16, key: u64) -> Option<V> {
        let (page, at) = split(key);
        let entry = &mut self.index.get_mut(table, page)?[at];
        let slot = std::mem::take(entry).checked_sub(1)?;
        self.free.push(slot);
        self.slots[slot as usize].take().map(|(_, v)| v)
    }

    /// Keeps only the records for which `keep` is true (visited in slot order).
    pub fn retain(&mut self, mut keep: impl FnMut((u16, u64), &mut V) -> bool) {
        let mut gone = Vec::new();
        for record in self.slots.iter_mut().flatten() {
            if !keep(record.0, &mut record.1) {
                gone.push(record.0);
            }
        }
        for (table, key) in gone {
            self.remove(table, key);
        }
    }

    /// Every record with its key, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = ((u16, u64), &V)> {
        self.slots.iter().flatten().map(|(k, v)| (*k, v))
    }

    /// How many keys have a record (every slot not free).
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether no key has a record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A set of `(table, key)`, as bits in pages of [`PAGE`] keys made on first use.
#[derive(Debug, Default)]
pub struct KeySet {
    bits: Pages<[u64; PAGE / 64]>,
}

impl KeySet {
    /// Whether `key` of `table` is in the set.
    pub fn contains(&self, table: u16, key: u64) -> bool {
        let (page, at) = split(key);
        self.bits.get(table, page).is_some_and(|p| p[at / 64] & (1 << (at % 64)) != 0)
    }

    /// Adds `key` of `table`.
    pub fn insert(&mut self, table: u16, key: u64) {
        let (page, at) = split(key);
        self.bits.get_or_make(table, page, || Box::new([0; PAGE / 64]))[at / 64] |= 1 << (at % 64);
    }

    /// Takes `key` of `table` out (its page stays).
    pub fn remove(&mut self, table: u16, key: u64) {
        let (page, at) = split(key);
        if let Some(p) = self.bits.get_mut(table, page) {
            p[at / 64] &= !(1 << (at % 64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn a_key_map_agrees_with_a_btree_map_under_random_operations() {
        // A small deterministic generator: keys across page borders and tables, with reuse.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut map: KeyMap<u64> = KeyMap::default();
        let mut model: BTreeMap<(u16, u64), u64> = BTreeMap::new();
        for step in 0..20_000u64 {
            let table = (next() % 3) as u16;
            let key = next() % (3 * PAGE as u64) + if next() % 8 == 0 { 40 * PAGE as u64 } else { 0 };
            match next() % 4 {
                0 | 1 => {
                    *map.get_or_default(table, key) += step;
                    *model.entry((table, key)).or_default() += step;
                }
                2 => assert_eq!(map.remove(table, key), model.remove(&(table, key))),
                _ => {
                    if let Some(v) = map.get_mut(table, key) {
                        *v ^= 1;
                    }
                    if let Some(v) = model.get_mut(&(table, key)) {
                        *v ^= 1;
                    }
                }
            }
            assert_eq!(map.get(table, key), model.get(&(table, key)));
            assert_eq!(map.len(), model.len());
        }
        map.retain(|_, v| *v % 2 == 0);
        model.retain(|_, v| *v % 2 == 0);
        let mut all: Vec<((u16, u64), u64)> = map.iter().map(|(k, v)| (k, *v)).collect();
        all.sort_unstable();
        assert_eq!(all, model.into_iter().collect::<Vec<_>>());
        assert_eq!(map.len(), all.len());
        assert!(map.get(7, 0).is_none() && map.remove(7, 0).is_none(), "an unknown table has no records");
    }

    #[test]
    fn a_removed_key_frees_its_slot_for_the_next() {
        let mut map: KeyMap<u8> = KeyMap::default();
        *map.get_or_default(0, 5) = 1;
        *map.get_or_default(0, 6) = 2;
        assert_eq!(map.remove(0, 5), Some(1));
        assert_eq!(map.remove(0, 5), None, "removed once");
        *map.get_or_default(1, 9) = 3;
        assert_eq!((map.slots.len(), map.len()), (2, 2), "the freed slot was reused");
        assert_eq!((map.get(0, 6), map.get(1, 9), map.get(0, 5)), (Some(&2), Some(&3), None));
        assert!(!map.is_empty());
    }

    #[test]
    fn a_key_set_holds_what_was_inserted() {
        let mut set = KeySet::default();
        assert!(!set.contains(0, 0) && !set.contains(3, u64::MAX / 4096));
        for (t, k) in [(0, 0), (0, 63), (0, 64), (2, PAGE as u64), (1, 5 * PAGE as u64 + 7)] {
            set.insert(t, k);
        }
        assert!(set.contains(0, 0) && set.contains(0, 63) && set.contains(0, 64));
        assert!(!set.contains(0, 1) && !set.contains(1, 0) && !set.contains(2, PAGE as u64 + 1));
        assert!(set.contains(2, PAGE as u64) && set.contains(1, 5 * PAGE as u64 + 7));
        set.remove(0, 63);
        set.remove(4, 1);
        assert!(!set.contains(0, 63) && set.contains(0, 0) && set.contains(0, 64), "only that key left");
        assert!(!set.contains(4, 1), "removing from an unknown table does nothing");
    }
}
