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
    /// How raw ids map to the table's keys, for a feature-hashed table's handle (the handles
    /// Ferry uses inside address the buckets themselves).
    pub(crate) hashing: Option<crate::hashing::FeatureHashing>,
    /// Whether workers address the table by raw ids mapped to its keys when first touched
    /// ([`crate::TableSpec::dynamic`]; the handles Ferry uses inside address the slot keys).
    pub(crate) dynamic: bool,
}

impl Table {
    /// Elements per value.
    pub fn value_len(&self) -> usize {
        self.value_len
    }

    /// Number of keys (of buckets, for a feature-hashed table; of slot keys, for a dynamic
    /// table, whose ids are any `u64`).
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// How the table maps raw ids to its keys, if it is feature-hashed.
    pub fn feature_hashing(&self) -> Option<crate::hashing::FeatureHashing> {
        self.hashing
    }

    /// Whether the table is dynamic: addressed by raw ids, created when first touched.
    pub fn is_dynamic(&self) -> bool {
        self.dynamic
    }

    /// The handle that addresses the buckets themselves.
    pub(crate) fn buckets(self) -> Table {
        Table { hashing: None, ..self }
    }

    /// The handle that addresses a dynamic table's slot keys themselves.
    pub(crate) fn slot_keys(self) -> Table {
        Table { dynamic: false, ..self }
    }

    /// The table id (its position in the configuration).
    pub fn id(&self) -> usize {
        self.id as usize
    }

    #[cfg(test)]
    pub(crate) fn for_tests(keys: u64, value_len: usize) -> Table {
        Table { id: 0, value_len, keys, cluster: 0, hashing: None, dynamic: false }
    }
}
