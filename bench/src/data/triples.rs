//! Knowledge graphs: `head relation tail` triples (one separator per file, usually a tab; see
//! [`super::delimited`]).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::{Result, bail};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::delimited::{self, Format};

/// Triples with dense entity and relation indices.
#[derive(Debug, Clone, Default)]
pub struct Triples {
    /// Head entity per triple.
    pub heads: Vec<u32>,
    /// Relation per triple.
    pub relations: Vec<u32>,
    /// Tail entity per triple.
    pub tails: Vec<u32>,
}

impl Triples {
    /// Number of triples.
    pub fn len(&self) -> usize {
        self.heads.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }

    fn push(&mut self, h: u32, r: u32, t: u32) {
        self.heads.push(h);
        self.relations.push(r);
        self.tails.push(t);
    }
}

/// A knowledge graph split into train, valid and test.
#[derive(Debug, Clone, Default)]
pub struct KnowledgeGraph {
    /// Entity names by index.
    pub entities: Vec<String>,
    /// Relation names by index.
    pub relations: Vec<String>,
    /// Training triples.
    pub train: Triples,
    /// Validation triples.
    pub valid: Triples,
    /// Test triples.
    pub test: Triples,
}

#[derive(Default)]
struct Vocab {
    entities: HashMap<String, u32>,
    relations: HashMap<String, u32>,
    entity_names: Vec<String>,
    relation_names: Vec<String>,
}

impl Vocab {
    fn entity(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.entities.get(name) {
            return i;
        }
        let i = self.entity_names.len() as u32;
        self.entities.insert(name.to_string(), i);
        self.entity_names.push(name.to_string());
        i
    }

    fn relation(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.relations.get(name) {
            return i;
        }
        let i = self.relation_names.len() as u32;
        self.relations.insert(name.to_string(), i);
        self.relation_names.push(name.to_string());
        i
    }
}

/// Reads `head relation tail` lines in `format` (a first line whose fields all carry a
/// `name:type` annotation, like RecBole's `head_id:token`, is a header).
fn read_triples(path: &Path, format: Format, vocab: &mut Vocab) -> Result<Triples> {
    let mut t = Triples::default();
    let annotated =
        |fields: &[&str]| fields.iter().all(|f| f.rsplit_once(':').is_some_and(|(name, ty)| !name.is_empty() && ty.chars().all(|c| c.is_ascii_alphabetic())));
    delimited::read(path, format, 3, annotated, |row| {
        if row.fields.len() != 3 {
            bail!("expected 'head relation tail', found {} fields", row.fields.len());
        }
        let (h, r, tl) = (vocab.entity(row.fields[0]), vocab.relation(row.fields[1]), vocab.entity(row.fields[2]));
        t.push(h, r, tl);
        Ok(())
    })?;
    Ok(t)
}

impl KnowledgeGraph {
    /// Reads `train.txt`, `valid.txt` and `test.txt` from a directory.
    pub fn load_split(dir: &Path, format: Format) -> Result<KnowledgeGraph> {
        KnowledgeGraph::load_files(&dir.join("train.txt"), Some(&dir.join("valid.txt")), &dir.join("test.txt"), format)
    }

    /// Reads a training, an optional validation and a test file, with one numbering of entities
    /// and relations.
    pub fn load_files(train: &Path, valid: Option<&Path>, test: &Path, format: Format) -> Result<KnowledgeGraph> {
        let mut vocab = Vocab::default();
        let train_triples = read_triples(train, format, &mut vocab)?;
        let valid = match valid {
            Some(v) => read_triples(v, format, &mut vocab)?,
            None => Triples::default(),
        };
        let test_triples = read_triples(test, format, &mut vocab)?;
        if train_triples.is_empty() {
            bail!("{} holds no training triples", train.display());
        }
        if test_triples.is_empty() {
            bail!("{} holds no test triples", test.display());
        }
        Ok(KnowledgeGraph { entities: vocab.entity_names, relations: vocab.relation_names, train: train_triples, valid, test: test_triples })
    }

    /// Reads one file of triples, drops one relation of each inverse pair (when asked), and
    /// splits it 90/5/5 with a fixed seed.
    pub fn load_single(path: &Path, format: Format, drop_inverses: bool, seed: u64) -> Result<KnowledgeGraph> {
        let mut vocab = Vocab::default();
        let all = read_triples(path, format, &mut vocab)?;
        if all.len() < 20 {
            bail!("{} holds {} triples: too few to split 90/5/5 (give --train and --test files instead)", path.display(), all.len());
        }
        let dropped: HashSet<u32> = if drop_inverses { inverse_relations(&all, &vocab.relation_names) } else { HashSet::new() };
        let mut idx: Vec<usize> = (0..all.len()).filter(|&i| !dropped.contains(&all.relations[i])).collect();
        idx.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        let n = idx.len();
        let (n_valid, n_test) = (n / 20, n / 20);
        let mut parts = [Triples::default(), Triples::default(), Triples::default()];
        for (pos, &i) in idx.iter().enumerate() {
            let part = if pos < n_test {
                2
            } else if pos < n_test + n_valid {
                1
            } else {
                0
            };
            parts[part].push(all.heads[i], all.relations[i], all.tails[i]);
        }
        let [train, valid, test] = parts;
        Ok(KnowledgeGraph { entities: vocab.entity_names, relations: vocab.relation_names, train, valid, test })
    }

    /// A synthetic graph for tests, planted from a ComplEx model: random complex embeddings
    /// (dimension 8) for every entity and relation, and for every head `h` and relation `r` the
    /// triple `(h, r, t)` whose tail scores highest. Held-out triples follow from the shared
    /// structure, so the graph is learnable. Split 90/5/5 with a fixed seed.
    pub fn synthetic(entities: u32, relations: u32, seed: u64) -> KnowledgeGraph {
        const DIM: usize = 4;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let vector = |rng: &mut ChaCha8Rng| -> Vec<f32> { (0..2 * DIM).map(|_| rand::Rng::gen_range(rng, -1.0f32..1.0)).collect() };
        let ent: Vec<Vec<f32>> = (0..entities).map(|_| vector(&mut rng)).collect();
        let rel: Vec<Vec<f32>> = (0..relations).map(|_| vector(&mut rng)).collect();
        let score = |h: &[f32], r: &[f32], t: &[f32]| -> f32 {
            (0..DIM).map(|k| t[k] * (h[k] * r[k] - h[DIM + k] * r[DIM + k]) + t[DIM + k] * (h[DIM + k] * r[k] + h[k] * r[DIM + k])).sum()
        };
        let mut all = Vec::new();
        for r in 0..relations {
            for h in 0..entities {
                let t = (0..entities)
                    .filter(|&t| t != h)
                    .max_by(|&a, &b| {
                        score(&ent[h as usize], &rel[r as usize], &ent[a as usize]).total_cmp(&score(&ent[h as usize], &rel[r as usize], &ent[b as usize]))
                    })
                    .expect("at least two entities");
                all.push((h, r, t));
            }
        }
        all.shuffle(&mut rng);
        let n = all.len();
        let mut parts = [Triples::default(), Triples::default(), Triples::default()];
        for (pos, &(h, r, t)) in all.iter().enumerate() {
            let part = if pos < n / 20 {
                2
            } else if pos < n / 10 {
                1
            } else {
                0
            };
            parts[part].push(h, r, t);
        }
        let [train, valid, test] = parts;
        KnowledgeGraph {
            entities: (0..entities).map(|e| format!("e{e}")).collect(),
            relations: (0..relations).map(|r| format!("r{r}")).collect(),
            train,
            valid,
            test,
        }
    }

    /// Every known triple (train, valid and test), for filtered ranking.
    pub fn known(&self) -> HashSet<(u32, u32, u32)> {
        let mut s = HashSet::new();
        for t in [&self.train, &self.valid, &self.test] {
            for i in 0..t.len() {
                s.insert((t.heads[i], t.relations[i], t.tails[i]));
            }
        }
        s
    }
}

/// Relations that are the inverse of another one (the same pairs, reversed, for at least 90 %
/// of their triples, with equal counts); of each pair the one with the larger name is returned.
fn inverse_relations(all: &Triples, names: &[String]) -> HashSet<u32> {
    let mut pairs: HashMap<u32, HashSet<(u32, u32)>> = HashMap::new();
    for i in 0..all.len() {
        pairs.entry(all.relations[i]).or_default().insert((all.heads[i], all.tails[i]));
    }
    let mut rels: Vec<u32> = pairs.keys().copied().collect();
    rels.sort_by(|a, b| names[*a as usize].cmp(&names[*b as usize]));
    let mut dropped = HashSet::new();
    for (x, &a) in rels.iter().enumerate() {
        for &b in &rels[x + 1..] {
            if dropped.contains(&a) || dropped.contains(&b) {
                continue;
            }
            let (pa, pb) = (&pairs[&a], &pairs[&b]);
            if pa.len() != pb.len() {
                continue;
            }
            let reversed = pa.iter().filter(|(h, t)| pb.contains(&(*t, *h))).count();
            if reversed * 10 >= pa.len() * 9 {
                dropped.insert(b);
            }
        }
    }
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_pairs_are_dropped_and_splits_are_complete() {
        let dir = std::env::temp_dir().join(format!("ferry-kg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut text = String::from("head_id:token\trelation_id:token\ttail_id:token\n");
        for i in 0..100 {
            text.push_str(&format!("a{i}\tlikes\tb{i}\nb{i}\tliked_by\ta{i}\na{i}\tknows\tb{}\n", (i + 1) % 100));
        }
        std::fs::write(dir.join("kg.tsv"), &text).unwrap();
        let kg = KnowledgeGraph::load_single(&dir.join("kg.tsv"), Format::default(), true, 5).unwrap();
        let kept: HashSet<&str> =
            [&kg.train, &kg.valid, &kg.test].iter().flat_map(|t| t.relations.iter().map(|&r| kg.relations[r as usize].as_str())).collect();
        assert_eq!(kept, HashSet::from(["liked_by", "knows"]), "of an inverse pair the larger name (likes) is dropped");
        assert_eq!(kg.train.len() + kg.valid.len() + kg.test.len(), 200);
        assert_eq!((kg.valid.len(), kg.test.len()), (10, 10));
        std::fs::write(dir.join("bad.tsv"), "a b c\n").unwrap();
        assert!(KnowledgeGraph::load_single(&dir.join("bad.tsv"), Format::default(), false, 1).is_err(), "too few to split");
        // Own train and test files: names with spaces (tab separated), one numbering.
        std::fs::write(dir.join("train.tsv"), "New York\tin\tUSA\nParis\tin\tFrance\n").unwrap();
        std::fs::write(dir.join("test.tsv"), "Lyon\tin\tFrance\n").unwrap();
        let kg = KnowledgeGraph::load_files(&dir.join("train.tsv"), None, &dir.join("test.tsv"), Format::default()).unwrap();
        assert_eq!(kg.entities, ["New York", "USA", "Paris", "France", "Lyon"]);
        assert_eq!((kg.test.heads.clone(), kg.test.tails.clone()), (vec![4], vec![3]));
        std::fs::write(dir.join("test.tsv"), "Lyon\tin\tFrance\nNice\tin\n").unwrap();
        let e = KnowledgeGraph::load_files(&dir.join("train.tsv"), None, &dir.join("test.tsv"), Format::default()).unwrap_err();
        assert!(format!("{e:#}").contains("test.tsv:2"), "{e:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
