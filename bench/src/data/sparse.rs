//! Labelled sparse examples for classification: LIBSVM and libffm files, and labelled text
//! turned into hashed bag-of-words features.
//!
//! LIBSVM lines are `label index:value …`; libffm lines `label field:index:value …` (the field is
//! ignored). Labels `1`/`+1` are positive, `0`/`-1` negative. Text lines are `label<TAB>text`:
//! lower-cased runs of ASCII letters and digits (two characters or more) are hashed into
//! `2^bits` features (feature hashing, as in *Accelerating Distributed Machine Learning with
//! Model Compression and Graph Partition*, Section 3.2), each present token counting once, the
//! example scaled to unit length.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};

/// Labelled sparse examples in compressed rows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Examples {
    /// Per example: 1.0 (positive) or 0.0.
    pub labels: Vec<f32>,
    /// Example `i`'s features are `features[offsets[i]..offsets[i + 1]]`.
    pub offsets: Vec<usize>,
    /// Feature indices.
    pub features: Vec<u64>,
    /// Feature values.
    pub values: Vec<f32>,
}

impl Examples {
    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Example `i`: its features and their values.
    pub fn row(&self, i: usize) -> (&[u64], &[f32]) {
        let r = self.offsets[i]..self.offsets[i + 1];
        (&self.features[r.clone()], &self.values[r])
    }

    /// One more than the largest feature index (0 without features).
    pub fn dims(&self) -> u64 {
        self.features.iter().max().map_or(0, |m| m + 1)
    }

    fn push(&mut self, label: f32, row: impl IntoIterator<Item = (u64, f32)>) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        self.labels.push(label);
        for (f, v) in row {
            self.features.push(f);
            self.values.push(v);
        }
        self.offsets.push(self.features.len());
    }

    /// The same examples with every feature index hashed into `buckets` buckets by `hashing`
    /// (Ferry's feature hashing, `ferry::FeatureHashing`) and its value multiplied by the
    /// index's sign: for a linear model the same as a feature-hashed table addressed by the raw
    /// indices. Features of one example that land in one bucket are added up.
    pub fn hashed(&self, hashing: ferry::FeatureHashing, buckets: u64) -> Examples {
        let mut out = Examples::default();
        let mut row: Vec<(u64, f32)> = Vec::new();
        for i in 0..self.len() {
            let (f, v) = self.row(i);
            row.clear();
            row.extend(f.iter().zip(v).map(|(&f, &v)| (hashing.bucket(f, buckets), hashing.sign(f) * v)));
            row.sort_unstable_by_key(|&(f, _)| f);
            row.dedup_by(|later, kept| {
                let same = later.0 == kept.0;
                if same {
                    kept.1 += later.1;
                }
                same
            });
            out.push(self.labels[i], row.iter().copied());
        }
        if out.offsets.is_empty() {
            out.offsets.push(0);
        }
        out
    }

    /// Renumbers the features of `train` and `test` densely (0.. in order of first appearance,
    /// the training examples first), returning the raw index of each new one: the same model
    /// as keys of the raw indices, stored densely (`train lr --ids raw`'s `single`).
    pub fn renumber(train: &mut Examples, test: &mut Examples) -> Vec<u64> {
        let mut dense: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
        let mut raw = Vec::new();
        for examples in [train, test] {
            for f in &mut examples.features {
                *f = *dense.entry(*f).or_insert_with(|| {
                    raw.push(*f);
                    raw.len() as u64 - 1
                });
            }
        }
        raw
    }

    /// The examples at `indices`, in that order.
    pub fn select(&self, indices: &[usize]) -> Examples {
        let mut out = Examples::default();
        for &i in indices {
            let (f, v) = self.row(i);
            out.push(self.labels[i], f.iter().copied().zip(v.iter().copied()));
        }
        if out.offsets.is_empty() {
            out.offsets.push(0);
        }
        out
    }

    /// Writes the examples as LIBSVM (1-based indices, as LIBSVM tools expect; labels 0/1).
    pub fn write_libsvm(&self, path: &Path) -> Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?);
        for i in 0..self.len() {
            write!(out, "{}", self.labels[i] as u8)?;
            let (f, v) = self.row(i);
            let mut pairs: Vec<(u64, f32)> = f.iter().copied().zip(v.iter().copied()).collect();
            pairs.sort_by_key(|p| p.0);
            for (f, v) in pairs {
                write!(out, " {}:{v}", f + 1)?;
            }
            writeln!(out)?;
        }
        out.flush()?;
        Ok(())
    }
}

fn label(token: &str, path: &Path, line: usize) -> Result<f32> {
    match token {
        "1" | "+1" | "1.0" => Ok(1.0),
        "0" | "-1" | "0.0" | "-1.0" => Ok(0.0),
        other => bail!("{}:{line}: label '{other}' is not 0/1 or -1/+1", path.display()),
    }
}

/// Reads a LIBSVM or libffm file. With `hash_bits`, feature indices are hashed into
/// `2^hash_bits` buckets; otherwise they are kept (1-based LIBSVM indices become 0-based).
pub fn load_libsvm(path: &Path, hash_bits: Option<u32>) -> Result<Examples> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Examples { offsets: vec![0], ..Examples::default() };
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut tokens = line.split_whitespace();
        let y = label(tokens.next().unwrap_or(""), path, n + 1)?;
        let mut row = Vec::new();
        for t in tokens {
            let parts: Vec<&str> = t.split(':').collect();
            let (index, value) = match parts[..] {
                [i, v] | [_, i, v] => (i, v),
                _ => bail!("{}:{}: '{t}' is neither index:value nor field:index:value", path.display(), n + 1),
            };
            let index: u64 = index.parse().with_context(|| format!("{}:{}: feature index '{index}'", path.display(), n + 1))?;
            let value: f32 = value.parse().with_context(|| format!("{}:{}: feature value '{value}'", path.display(), n + 1))?;
            if !value.is_finite() {
                bail!("{}:{}: feature value '{value}' is not finite", path.display(), n + 1);
            }
            let feature = match hash_bits {
                Some(bits) => hash(index.to_le_bytes().as_slice()) & ((1 << bits) - 1),
                None => index.saturating_sub(1),
            };
            row.push((feature, value));
        }
        out.push(y, row);
    }
    if out.is_empty() {
        bail!("{}: no examples", path.display());
    }
    Ok(out)
}

/// Reads `label<TAB>text` lines as hashed, unit-length bag-of-words examples.
pub fn load_labelled_text(path: &Path, hash_bits: u32) -> Result<Examples> {
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Examples { offsets: vec![0], ..Examples::default() };
    let mask = (1u64 << hash_bits) - 1;
    let mut row: Vec<u64> = Vec::new();
    for (n, line) in text.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let Some(tab) = line.iter().position(|&b| b == b'\t') else { bail!("{}:{}: no tab after the label", path.display(), n + 1) };
        let y = label(std::str::from_utf8(&line[..tab]).unwrap_or("?").trim(), path, n + 1)?;
        row.clear();
        for token in line[tab + 1..].split(|b| !b.is_ascii_alphanumeric()).filter(|t| t.len() >= 2) {
            let lower: Vec<u8> = token.iter().map(u8::to_ascii_lowercase).collect();
            row.push(hash(&lower) & mask);
        }
        row.sort_unstable();
        row.dedup();
        let scale = 1.0 / (row.len().max(1) as f32).sqrt();
        out.push(y, row.iter().map(|&f| (f, scale)));
    }
    if out.is_empty() {
        bail!("{}: no examples", path.display());
    }
    Ok(out)
}

/// FNV-1a, 64 bits.
fn hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("ferry-sparse-{}-{name}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn libsvm_and_libffm_parse() {
        let p = file("a.svm", "1 1:0.5 3:1\n-1 2:2 # comment\n\n0 0:1:4\n");
        let e = load_libsvm(&p, None).unwrap();
        assert_eq!(e.labels, [1.0, 0.0, 0.0]);
        assert_eq!(e.row(0), (&[0u64, 2][..], &[0.5f32, 1.0][..]));
        assert_eq!(e.row(2), (&[0u64][..], &[4.0f32][..]), "libffm: field 0, index 1");
        let hashed = load_libsvm(&p, Some(4)).unwrap();
        assert!(hashed.features.iter().all(|&f| f < 16));
        let round = file("b.svm", "");
        e.write_libsvm(&round).unwrap();
        assert_eq!(load_libsvm(&round, None).unwrap(), e);
        for bad in ["2 1:1\n", "1 x:1\n", "1 1:nan\n", "1 1\n", ""] {
            assert!(load_libsvm(&file("c.svm", bad), None).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn text_is_hashed_to_unit_length() {
        let p = file("t.tsv", "1\tBuy NOW, buy cheap!\n0\tmeeting at 10am\n");
        let e = load_labelled_text(&p, 10).unwrap();
        assert_eq!(e.labels, [1.0, 0.0]);
        let (f, v) = e.row(0);
        assert_eq!(f.len(), 3, "buy, now, cheap: 'buy' counted once");
        assert!((v.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(load_labelled_text(&file("u.tsv", "1 no tab\n"), 10).is_err());
    }
}
