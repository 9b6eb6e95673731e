//! Raw text corpora for word vectors, and word-analogy questions.
//!
//! Text is lower-cased and split into words at every character that is not an ASCII letter
//! (the Python baseline script tokenises the same way); each line is one sentence, so context
//! windows never cross lines.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// A tokenised corpus with its vocabulary.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Words kept (at least `min_count` occurrences), most frequent first; a word's key is its
    /// position.
    pub words: Vec<String>,
    /// Occurrences of each kept word.
    pub counts: Vec<u64>,
    /// Sentences as word keys (dropped words left out).
    pub sentences: Vec<Vec<u32>>,
    /// Words of the corpus, dropped ones included.
    pub raw_words: u64,
}

/// Splits a line into lower-case ASCII words.
pub fn tokens(line: &str) -> impl Iterator<Item = String> + '_ {
    line.split(|c: char| !c.is_ascii_alphabetic()).filter(|w| !w.is_empty()).map(|w| w.to_ascii_lowercase())
}

impl Corpus {
    /// Reads raw text from `paths`, one after the other, as one corpus.
    pub fn load(paths: &[PathBuf], min_count: u64) -> Result<Corpus> {
        if paths.is_empty() {
            bail!("no corpus file given");
        }
        let names = paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(",");
        let mut text = String::new();
        for path in paths {
            let bytes = std::fs::read(path).with_context(|| format!("reading corpus {}", path.display()))?;
            text.push_str(&String::from_utf8_lossy(&bytes));
            text.push('\n');
        }
        Corpus::parse(&text, min_count).with_context(|| format!("corpus {names}"))
    }

    /// Tokenises `text` and keeps the words seen at least `min_count` times.
    pub fn parse(text: &str, min_count: u64) -> Result<Corpus> {
        let lines: Vec<Vec<String>> = text.lines().map(|l| tokens(l).collect::<Vec<_>>()).filter(|l| !l.is_empty()).collect();
        let mut counts: HashMap<&str, u64> = HashMap::new();
        let mut raw_words = 0u64;
        for line in &lines {
            for w in line {
                *counts.entry(w.as_str()).or_default() += 1;
                raw_words += 1;
            }
        }
        let mut kept: Vec<(&str, u64)> = counts.into_iter().filter(|&(_, c)| c >= min_count.max(1)).collect();
        // Most frequent first, ties by spelling: the same keys in every process.
        kept.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        if kept.len() < 2 {
            bail!("fewer than 2 words occur at least {min_count} times ({raw_words} words in all)");
        }
        if kept.len() > u32::MAX as usize {
            bail!("vocabulary of {} words is too large", kept.len());
        }
        let index: HashMap<&str, u32> = kept.iter().enumerate().map(|(i, &(w, _))| (w, i as u32)).collect();
        let sentences: Vec<Vec<u32>> =
            lines.iter().map(|l| l.iter().filter_map(|w| index.get(w.as_str()).copied()).collect::<Vec<u32>>()).filter(|s| s.len() >= 2).collect();
        Ok(Corpus { words: kept.iter().map(|&(w, _)| w.to_string()).collect(), counts: kept.iter().map(|&(_, c)| c).collect(), sentences, raw_words })
    }

    /// Occurrences of kept words.
    pub fn kept_words(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The negative-sampling distribution: counts to the power 0.75 (word2vec's smoothing).
    pub fn negative_weights(&self) -> Vec<f64> {
        self.counts.iter().map(|&c| (c as f64).powf(0.75)).collect()
    }

    /// Probability of keeping one occurrence of each word under word2vec's subsampling of
    /// frequent words with threshold `sample` (1 when `sample` is 0).
    pub fn keep_probabilities(&self, sample: f64) -> Vec<f32> {
        let total = self.kept_words() as f64;
        self.counts
            .iter()
            .map(|&c| {
                if sample <= 0.0 {
                    return 1.0;
                }
                let threshold = sample * total;
                let f = c as f64;
                (((f / threshold).sqrt() + 1.0) * threshold / f).min(1.0) as f32
            })
            .collect()
    }
}

/// A generated corpus for tests: 40 topics of 10 words; each of 3 000 lines draws its words from
/// one topic plus a few common words, so words of a topic share contexts. Words are letters only
/// (`t` + topic + `w` + word, digits spelled `a`–`j`).
pub fn synthetic_text(seed: u64) -> String {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut text = String::new();
    for _ in 0..3000 {
        let topic = rng.gen_range(0..40);
        for j in 0..12 {
            if j > 0 {
                text.push(' ');
            }
            if j % 5 == 4 {
                text.push_str(["the", "of", "and"][rng.gen_range(0..3)]);
            } else {
                text.push_str(&synthetic_word(topic, rng.gen_range(0..10)));
            }
        }
        text.push('\n');
    }
    text
}

fn synthetic_word(topic: usize, i: usize) -> String {
    let letters = |n: usize| n.to_string().bytes().map(|d| (b'a' + d - b'0') as char).collect::<String>();
    format!("t{}w{}", letters(topic), letters(i))
}

/// Analogy questions `a : b :: c : d`, grouped in sections.
#[derive(Debug, Clone, Default)]
pub struct Analogies {
    /// `(section, [a, b, c, d])`, lower-cased.
    pub questions: Vec<(String, [String; 4])>,
}

impl Analogies {
    /// Reads the `questions-words.txt` format: `: section` lines, then four words per line.
    pub fn load(path: &Path) -> Result<Analogies> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading analogies {}", path.display()))?;
        Analogies::parse(&text).with_context(|| format!("analogies {}", path.display()))
    }

    /// Questions over [`synthetic_text`]'s words: "word 0 is to word 1 of a topic as word 0 is
    /// to word 1 of another topic" (20 questions).
    pub fn synthetic() -> Analogies {
        let questions = (0..20)
            .map(|t| ("topics".to_string(), [synthetic_word(t, 0), synthetic_word(t, 1), synthetic_word(t + 20, 0), synthetic_word(t + 20, 1)]))
            .collect();
        Analogies { questions }
    }

    /// Parses the `questions-words.txt` format.
    pub fn parse(text: &str) -> Result<Analogies> {
        let mut section = String::from("(none)");
        let mut questions = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(name) = line.strip_prefix(':') {
                section = name.trim().to_string();
                continue;
            }
            let words: Vec<String> = line.split_whitespace().map(|w| w.to_lowercase()).collect();
            let Ok(q) = <[String; 4]>::try_from(words) else {
                bail!("line {}: expected four words, got '{line}'", n + 1);
            };
            questions.push((section.clone(), q));
        }
        if questions.is_empty() {
            bail!("no analogy questions");
        }
        Ok(Analogies { questions })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenises_counts_and_orders_by_frequency() {
        let c = Corpus::parse("The cat, the DOG.\n\nthe cat's toy\nx\n", 2).unwrap();
        assert_eq!(c.words, vec!["the", "cat"]);
        assert_eq!(c.counts, vec![3, 2]);
        assert_eq!(c.raw_words, 9);
        // "x" alone and sentences with fewer than two kept words are dropped.
        assert_eq!(c.sentences, vec![vec![0, 1, 0], vec![0, 1]]);
        assert!(Corpus::parse("a b c", 2).is_err());
        let keep = c.keep_probabilities(0.1);
        assert!(keep[0] < keep[1] || keep[1] == 1.0);
        assert_eq!(c.keep_probabilities(0.0), vec![1.0, 1.0]);
    }

    #[test]
    fn synthetic_corpus_covers_its_questions() {
        let c = Corpus::parse(&synthetic_text(1), 5).unwrap();
        assert_eq!(c.words.len(), 403, "400 topic words and 3 common ones");
        let words: std::collections::HashSet<&str> = c.words.iter().map(String::as_str).collect();
        assert!(Analogies::synthetic().questions.iter().all(|(_, q)| q.iter().all(|w| words.contains(w.as_str()))));
        assert_eq!(synthetic_text(1), synthetic_text(1));
    }

    #[test]
    fn analogies_parse() {
        let a = Analogies::parse(": capitals\nAthens Greece Baghdad Iraq\n\n: family\nboy girl brother sister\n").unwrap();
        assert_eq!(a.questions.len(), 2);
        assert_eq!(a.questions[0].0, "capitals");
        assert_eq!(a.questions[1].1[3], "sister");
        assert!(Analogies::parse(": s\na b c\n").is_err());
        assert!(Analogies::parse("").is_err());
    }
}
