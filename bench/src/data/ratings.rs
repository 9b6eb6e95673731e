//! Ratings: `user item rating` rows (one separator per file: tab, comma, semicolon or spaces; a
//! header line when it looks like one), and a synthetic generator with Zipf-skewed rows and
//! columns and a planted low-rank truth.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Result, anyhow, bail};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::delimited::{self, Format};

/// Ratings with dense user and item indices.
#[derive(Debug, Clone, Default)]
pub struct Ratings {
    /// User index per rating.
    pub users: Vec<u32>,
    /// Item index per rating.
    pub items: Vec<u32>,
    /// The ratings.
    pub values: Vec<f32>,
    /// Number of users (indices are below it).
    pub n_users: u32,
    /// Number of items.
    pub n_items: u32,
    /// The name of each user index in the data (the index itself for generated data).
    pub user_names: Vec<String>,
    /// The name of each item index.
    pub item_names: Vec<String>,
}

impl Ratings {
    /// Number of ratings.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Mean rating (0 when empty).
    pub fn mean(&self) -> f32 {
        if self.values.is_empty() { 0.0 } else { (self.values.iter().map(|&v| v as f64).sum::<f64>() / self.values.len() as f64) as f32 }
    }

    /// Largest rating magnitude accepted: beyond it a value is a data error, not a rating.
    pub const MAX_ABS: f32 = 1e6;

    /// Reads a ratings file: `user item rating` rows, further fields (a timestamp) ignored, in
    /// `format` (see [`super::delimited`]). User and item names are mapped to dense indices in
    /// order of first appearance.
    pub fn load(path: &Path, format: Format) -> Result<Ratings> {
        Ratings::load_with(path, format, &mut HashMap::new(), &mut HashMap::new())
    }

    /// Reads a training file and a test file with one numbering of users and items (the test
    /// file's new names get new indices: they are cold-start users and items).
    pub fn load_pair(train: &Path, test: &Path, format: Format) -> Result<(Ratings, Ratings)> {
        let (mut users, mut items) = (HashMap::new(), HashMap::new());
        let mut a = Ratings::load_with(train, format, &mut users, &mut items)?;
        let mut b = Ratings::load_with(test, format, &mut users, &mut items)?;
        (a.n_users, a.n_items) = (users.len() as u32, items.len() as u32);
        (b.n_users, b.n_items) = (a.n_users, a.n_items);
        (a.user_names, a.item_names) = (names(&users), names(&items));
        (b.user_names, b.item_names) = (a.user_names.clone(), a.item_names.clone());
        Ok((a, b))
    }

    fn load_with(path: &Path, format: Format, users: &mut HashMap<String, u32>, items: &mut HashMap<String, u32>) -> Result<Ratings> {
        let mut r = Ratings::default();
        delimited::read(path, format, 3, delimited::no_numbers, |row| {
            let field = row.fields[2];
            let value: f32 = field.parse().map_err(|_| anyhow!("'{field}' is not a rating (the third field of 'user item rating')"))?;
            if !value.is_finite() || value.abs() > Ratings::MAX_ABS {
                bail!("rating {field} is not a finite number of magnitude at most {}", Ratings::MAX_ABS);
            }
            let next = users.len() as u32;
            r.users.push(*users.entry(row.fields[0].to_string()).or_insert(next));
            let next = items.len() as u32;
            r.items.push(*items.entry(row.fields[1].to_string()).or_insert(next));
            r.values.push(value);
            Ok(())
        })?;
        if r.is_empty() {
            bail!("{} holds no ratings", path.display());
        }
        r.n_users = users.len() as u32;
        r.n_items = items.len() as u32;
        (r.user_names, r.item_names) = (names(users), names(items));
        Ok(r)
    }

    fn pick(&self, idx: &[usize]) -> Ratings {
        Ratings {
            users: idx.iter().map(|&i| self.users[i]).collect(),
            items: idx.iter().map(|&i| self.items[i]).collect(),
            values: idx.iter().map(|&i| self.values[i]).collect(),
            n_users: self.n_users,
            n_items: self.n_items,
            user_names: self.user_names.clone(),
            item_names: self.item_names.clone(),
        }
    }

    /// A random split into (train, test) with `test_share` of the ratings in test.
    pub fn split(&self, test_share: f64, seed: u64) -> (Ratings, Ratings) {
        let mut idx: Vec<usize> = (0..self.len()).collect();
        idx.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        let n_test = (self.len() as f64 * test_share).round() as usize;
        (self.pick(&idx[n_test..]), self.pick(&idx[..n_test]))
    }
}

/// Names by index, from a map of names to indices.
fn names(map: &HashMap<String, u32>) -> Vec<String> {
    let mut names = vec![String::new(); map.len()];
    for (name, &i) in map {
        names[i as usize] = name.clone();
    }
    names
}

/// Shape of a synthetic ratings matrix.
#[derive(Debug, Clone, Copy)]
pub struct Synthetic {
    /// Rows (users).
    pub rows: u32,
    /// Columns (items).
    pub cols: u32,
    /// Rank of the planted truth.
    pub rank: usize,
    /// Training entries.
    pub train: usize,
    /// Test entries.
    pub test: usize,
    /// Zipf exponent of row and column popularity.
    pub zipf: f64,
    /// Standard deviation of the noise added to each entry.
    pub noise: f32,
}

impl Synthetic {
    /// `synth-small`: 20 000 × 2 000, rank 10, 600 000 training and 60 000 test entries, Zipf 1.1.
    pub const SMALL: Synthetic = Synthetic { rows: 20_000, cols: 2_000, rank: 10, train: 600_000, test: 60_000, zipf: 1.1, noise: 0.1 };
    /// `synth-tiny`: 2 000 × 200, rank 5, 40 000 training and 4 000 test entries (for tests).
    pub const TINY: Synthetic = Synthetic { rows: 2_000, cols: 200, rank: 5, train: 40_000, test: 4_000, zipf: 1.1, noise: 0.1 };

    /// Generates (train, test). Rows and columns are drawn from Zipf distributions (popular ones
    /// scattered over the index space); values are `⟨u_row, v_col⟩ + noise` for a random rank-r
    /// truth scaled to unit variance.
    pub fn generate(&self, seed: u64) -> (Ratings, Ratings) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let scale = (self.rank as f64).powf(-0.25) as f32;
        let normal = |rng: &mut ChaCha8Rng| -> f32 {
            // Box–Muller.
            let (u1, u2): (f64, f64) = (rng.r#gen::<f64>().max(1e-12), rng.r#gen());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        };
        let truth_rows: Vec<f32> = (0..self.rows as usize * self.rank).map(|_| normal(&mut rng) * scale).collect();
        let truth_cols: Vec<f32> = (0..self.cols as usize * self.rank).map(|_| normal(&mut rng) * scale).collect();
        let rows = Zipf::new(self.rows, self.zipf, &mut rng);
        let cols = Zipf::new(self.cols, self.zipf, &mut rng);
        let make = |n: usize, rng: &mut ChaCha8Rng| {
            let (user_names, item_names) = ((0..self.rows).map(|i| i.to_string()).collect(), (0..self.cols).map(|i| i.to_string()).collect());
            let mut r = Ratings { n_users: self.rows, n_items: self.cols, user_names, item_names, ..Default::default() };
            for _ in 0..n {
                let (u, i) = (rows.sample(rng), cols.sample(rng));
                let dot: f32 = (0..self.rank).map(|k| truth_rows[u as usize * self.rank + k] * truth_cols[i as usize * self.rank + k]).sum();
                r.users.push(u);
                r.items.push(i);
                r.values.push(dot + normal(rng) * self.noise);
            }
            r
        };
        let train = make(self.train, &mut rng);
        let test = make(self.test, &mut rng);
        (train, test)
    }
}

/// A Zipf distribution over `0..n` whose ranks are scattered by a random permutation.
struct Zipf {
    cdf: Vec<f64>,
    index_of_rank: Vec<u32>,
}

impl Zipf {
    fn new(n: u32, s: f64, rng: &mut ChaCha8Rng) -> Zipf {
        let mut cdf = Vec::with_capacity(n as usize);
        let mut total = 0.0;
        for k in 1..=n {
            total += 1.0 / (k as f64).powf(s);
            cdf.push(total);
        }
        for c in &mut cdf {
            *c /= total;
        }
        let mut index_of_rank: Vec<u32> = (0..n).collect();
        index_of_rank.shuffle(rng);
        Zipf { cdf, index_of_rank }
    }

    fn sample(&self, rng: &mut ChaCha8Rng) -> u32 {
        let x: f64 = rng.r#gen();
        let rank = self.cdf.partition_point(|&c| c < x).min(self.cdf.len() - 1);
        self.index_of_rank[rank]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_headers_separators_and_splits() {
        let dir = std::env::temp_dir().join(format!("ferry-ratings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.tsv");
        let load = |text: &str| {
            std::fs::write(&path, text).unwrap();
            Ratings::load(&path, Format::default())
        };
        let r = load("user_id:token\titem_id:token\trating:float\ttimestamp:float\n7\ta\t3\t1\n8\tb\t4.5\t2\n7\tb\t1\t3\n").unwrap();
        assert_eq!((r.len(), r.n_users, r.n_items), (3, 2, 2));
        assert_eq!((r.users.clone(), r.items.clone()), (vec![0, 1, 0], vec![0, 1, 1]));
        let r = load("bob,Apollo 13,4\nann,Apollo 13,5\n").unwrap();
        assert_eq!((r.n_items, r.values.clone()), (1, vec![4.0, 5.0]), "one separator per file: names keep their spaces");
        assert!(load("1 2\n").is_err());
        let e = load("1 2 3\n1 2 x\n").unwrap_err();
        assert!(format!("{e:#}").contains(":2:"), "the error names the line: {e:#}");
        for absurd in ["1e30", "inf", "NaN", "-2e6"] {
            let e = load(&format!("1 2 3\n1 3 {absurd}\n")).unwrap_err();
            assert!(format!("{e:#}").contains("finite number of magnitude"), "{absurd}: {e:#}");
        }
        let test = dir.join("test.tsv");
        std::fs::write(&path, "a 1 3\nb 2 4\n").unwrap();
        std::fs::write(&test, "b 1 5\nc 3 2\n").unwrap();
        let (train, held) = Ratings::load_pair(&path, &test, Format::default()).unwrap();
        assert_eq!((held.users.clone(), held.items.clone()), (vec![1, 2], vec![0, 2]), "one numbering for both files");
        assert_eq!((train.n_users, held.n_users, train.n_items), (3, 3, 3));
        assert!(Ratings::load(&dir.join("missing"), Format::default()).is_err());
        let big = Synthetic { rows: 100, cols: 50, rank: 3, train: 1000, test: 100, zipf: 1.1, noise: 0.1 }.generate(3);
        assert_eq!((big.0.len(), big.1.len()), (1000, 100));
        let (a, b) = big.0.split(0.2, 9);
        assert_eq!((a.len(), b.len()), (800, 200));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn zipf_rows_are_skewed() {
        let (train, _) = Synthetic { rows: 1000, cols: 100, rank: 2, train: 50_000, test: 0, zipf: 1.1, noise: 0.0 }.generate(1);
        let mut counts = vec![0usize; 1000];
        for &u in &train.users {
            counts[u as usize] += 1;
        }
        counts.sort_unstable_by(|a, b| b.cmp(a));
        assert!(counts[0] > 50 * counts[500].max(1), "top {} vs median {}", counts[0], counts[500]);
    }
}
