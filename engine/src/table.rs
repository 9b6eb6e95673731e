//! The handle a trainer names a table by.

/// A table as the API names it: id, value length and key count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Table {
    pub(crate) id: u16,
    pub(crate) value_len: usize,
    pub(crate) keys: u64,
    /// Fingerprint of the cluster configuration the handle belongs to: a handle is valid on
    /// every node of that cluster, and checking it costs one comparison.
    pub(crate) cluster: u64,
}

impl Table {
    /// Elements per value.
    pub fn value_len(&self) -> usize {
        self.value_len
    }

    /// Number of keys.
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// The table id (its position in the configuration).
    pub fn id(&self) -> usize {
        self.id as usize
    }

    #[cfg(test)]
    pub(crate) fn for_tests(keys: u64, value_len: usize) -> Table {
        Table { id: 0, value_len, keys, cluster: 0 }
    }
}
