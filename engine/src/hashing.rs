//! Feature hashing (Duan and Wu, *Accelerating Distributed Machine Learning with Model
//! Compression and Graph Partition*, JPDC 2023, Section 3.2; the "hashing trick"): a table of
//! `m` keys that workers address by raw ids — any `u64`, or a string's id from
//! [`feature_id`] — each id mapped to a bucket by a seeded hash, so that a model over an
//! unbounded id space takes `m` keys. Ids that share a bucket share its value (the compression
//! is the collisions); with a sign hash each id also gets a sign `±1` that multiplies what it
//! pushes, sets and pulls, so that colliding ids' contributions cancel in expectation instead of
//! adding up (the bucket holds `Σ sign(id) · w(id)`, and an id reads back `sign(id) · bucket`).
//!
//! The mapping is the table's ([`crate::TableSpec::feature_hashed`]): a worker passes raw ids
//! to every keyed call of the table's handle, and Ferry maps them before anything else sees
//! them, so relocation, replication, intent, updaters, codecs and checkpoints work on the
//! buckets unchanged. A checkpoint holds buckets; the same seed maps the same ids to them.

/// The splitmix64 finaliser: a fixed bijection of `u64` whose output bits each depend on every
/// input bit (also the consistent-hashing ring's point hash).
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// How a feature-hashed table maps raw ids to its keys (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FeatureHashing {
    /// Seed of the bucket and sign hashes: two tables with different seeds collide on different
    /// ids.
    pub seed: u64,
    /// Whether each id also gets a sign that multiplies what it pushes, sets and pulls.
    pub signed: bool,
}

impl FeatureHashing {
    /// The bucket of `id` among `buckets` keys (at least 1): the high bits of a seeded 64-bit
    /// hash, scaled by a multiplication (no division, and no bias beyond 2^-64 per bucket).
    #[inline]
    pub fn bucket(&self, id: u64, buckets: u64) -> u64 {
        ((mix(id ^ self.seed) as u128 * buckets as u128) >> 64) as u64
    }

    /// The sign of `id`: `1.0`, or `±1.0` from a second hash when the table is signed.
    #[inline]
    pub fn sign(&self, id: u64) -> f32 {
        if self.signed && mix(id ^ self.seed.rotate_left(32) ^ 0x5167_6e5f_6861_7368) & 1 == 1 { -1.0 } else { 1.0 }
    }

    /// The option as [`FeatureHashing::from_str`](std::str::FromStr) reads it: `SEED` or
    /// `SEED:signed`.
    pub fn name(&self) -> String {
        if self.signed { format!("{}:signed", self.seed) } else { self.seed.to_string() }
    }
}

impl std::str::FromStr for FeatureHashing {
    type Err = String;

    /// `SEED` (a number) or `SEED:signed`.
    fn from_str(s: &str) -> std::result::Result<FeatureHashing, String> {
        let (seed, signed) = match s.trim().split_once(':') {
            None => (s.trim(), false),
            Some((seed, "signed")) => (seed, true),
            Some(_) => return Err(format!("feature hashing '{s}': expected SEED or SEED:signed")),
        };
        let seed = seed.parse().map_err(|_| format!("feature hashing '{s}': the seed '{seed}' is not a number"))?;
        Ok(FeatureHashing { seed, signed })
    }
}

/// The raw id of a string feature (a word, a `field=value` pair): XXH3-64 of its UTF-8 bytes,
/// the same in every process, binding and version.
pub fn feature_id(text: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_even_and_the_seed_changes_them() {
        let (a, b) = (FeatureHashing { seed: 1, signed: true }, FeatureHashing { seed: 2, signed: true });
        let mut counts = [0u32; 16];
        for id in 0..160_000u64 {
            counts[a.bucket(id, 16) as usize] += 1;
        }
        // 10 000 expected per bucket; a binomial's standard deviation is about 97.
        assert!(counts.iter().all(|&c| (9_500..10_500).contains(&c)), "{counts:?}");
        let same = (0..10_000u64).filter(|&id| a.bucket(id, 1000) == b.bucket(id, 1000)).count();
        assert!(same < 50, "{same} of 10 000 ids share their bucket under both seeds");
        let negative = (0..10_000u64).filter(|&id| a.sign(id) < 0.0).count();
        assert!((4_700..5_300).contains(&negative), "{negative} negative signs of 10 000");
        let unsigned = FeatureHashing { signed: false, ..a };
        assert!((0..1000u64).all(|id| unsigned.sign(id) == 1.0 && unsigned.bucket(id, 7) == a.bucket(id, 7)));
        assert!((0..1000u64).all(|id| a.bucket(id, 1) == 0) && a.bucket(u64::MAX, 5) < 5);
    }

    #[test]
    fn the_option_reads_back_and_bad_text_is_refused() {
        for h in [FeatureHashing { seed: 7, signed: false }, FeatureHashing { seed: u64::MAX, signed: true }] {
            assert_eq!(h.name().parse::<FeatureHashing>(), Ok(h));
        }
        for bad in ["", "x", "7:sign", "-1", "7:signed:x"] {
            assert!(bad.parse::<FeatureHashing>().is_err(), "{bad:?} was read");
        }
        assert_eq!(feature_id("user=42"), feature_id("user=42"));
        assert_ne!(feature_id("user=42"), feature_id("user=43"));
    }
}
