//! Word vectors: skip-gram with negative sampling (word2vec), evaluated on word analogies.
//!
//! Two tables of `dim` floats per word: input vectors (the embeddings) and output vectors. For
//! each kept occurrence of a word (frequent words subsampled as in word2vec), every word within a
//! random window of at most `window` on either side is a context: the pair (context, word) is
//! trained with the word as the positive and `neg` negatives drawn from the unigram
//! distribution to the power 0.75, by SGD with a linearly decaying learning rate.
//!
//! Pairs are trained in batches of `chunk` centre positions: a batch pulls the rows it needs,
//! trains on local copies and pushes the differences — one pull and one push per table per batch,
//! in every mode, so `single` and the clusters run the same algorithm. In cluster modes the
//! negatives come from Ferry's sampling API (`--negatives`: a scheme of NuPS 4.4) over that
//! distribution; `localize` moves the next batch's words here while the current one trains.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result, bail};
use clap::Args;
use ferry::{DistributionId, KeyDistribution, SampleHandle, SamplingScheme, Table, TableSpec, Ticket, Worker};
use rand::distributions::Distribution;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
// Negatives are drawn in O(1) by the alias method (a binary search over the vocabulary's
// cumulative weights cost a cache miss per level).
use rand_distr::WeightedAliasIndex;

use super::checkpoint_model::{Described, Description};
use super::epochs::{Access, Fields, Measured, Model, ModelReader, ModelTable, Pass, Quality, Trainer, Workload};
use super::mf::initial;
use super::shared::{METRIC_FIELDS, SharedArray, field, part};
use super::simd;
use super::{Common, Event, Mode, Sink};
use crate::data::text::{Analogies, Corpus, synthetic_text};

/// Options of `train w2v`.
#[derive(Debug, Clone, Args)]
pub struct W2vArgs {
    /// Corpus: `sotu` (State of the Union addresses), `lee` (gensim's Lee corpus), `gcide` (a
    /// dictionary of English, 4.1 M words), `wordnet` (WordNet's glosses, 1.5 M), `foldoc` (a
    /// dictionary of computing, 0.74 M), `jargon` (the Jargon File, 0.2 M), all fetched into the
    /// cache, `synth-text` (generated: 40 topics, for tests), or a raw text file (one sentence
    /// or paragraph per line); several, comma-separated, are one corpus (`gcide,wordnet`: 5.6 M
    /// words, a vocabulary of 45 k); `dictionaries` is the four dictionaries together (6.5 M
    /// words, a vocabulary of 50 k).
    #[arg(long, default_value = "sotu")]
    pub data: String,
    /// Analogy questions: `analogies` (questions-words.txt, fetched; with `--data synth-text`,
    /// that corpus's own 20 questions) or a file of that format.
    #[arg(long, default_value = "analogies")]
    pub analogies: String,
    /// A corpus file of your own (instead of --data; raw text, one sentence per line).
    #[arg(long, conflicts_with = "data")]
    pub train: Option<std::path::PathBuf>,
    /// Analogy questions of your own (instead of --analogies; the questions-words.txt format).
    #[arg(long, conflicts_with = "analogies")]
    pub test: Option<std::path::PathBuf>,
    /// Vector dimension.
    #[arg(long, default_value_t = 100)]
    pub dim: usize,
    /// Largest distance between a word and its contexts.
    #[arg(long, default_value_t = 5)]
    pub window: usize,
    /// Negatives per pair.
    #[arg(long, default_value_t = 5)]
    pub neg: usize,
    /// Words seen fewer times are dropped.
    #[arg(long, default_value_t = 5)]
    pub min_count: u64,
    /// Subsampling threshold of frequent words (0: off).
    #[arg(long, default_value_t = 1e-3)]
    pub sample: f64,
    /// Initial learning rate (decays linearly to 0.0001 of it).
    #[arg(long, default_value_t = 0.025)]
    pub lr: f32,
    /// Centre positions per batch.
    #[arg(long, default_value_t = 16)]
    pub chunk: usize,
    /// Where negatives come from in cluster modes: a Ferry sampling scheme over the smoothed
    /// unigram distribution (NuPS 4.4): `independent` (L1), `reuse[:POOL:USES]` (L2),
    /// `postpone[:POOL:USES]` (L3), `local` (L4), or `auto`: `local` in hybrid mode (where
    /// every word a node's sentences use is held or replicated there), `independent` in the
    /// others. In intent mode, `independent` negatives are drawn by the trainer and declared
    /// with the batch's words; with another scheme only the words are declared and the scheme
    /// serves the negatives.
    #[arg(long, default_value = "auto")]
    pub negatives: String,
    /// Intent mode: how many batches (clocks) ahead a worker declares the words and the
    /// negatives it will need (it draws the negatives itself, from the same distribution; the
    /// engine's action timing decides when to act on them). A batch takes well under a
    /// millisecond, and a key's way to a node takes several on shared cores: 128 batches left
    /// 0.1 % of accesses late on 2 nodes, 16 left 0.25–0.3 %.
    #[arg(long, default_value_t = 128)]
    pub intent_ahead: usize,
    /// Evaluate analogies every this many epochs (and after the last; 0: only after the last).
    #[arg(long, default_value_t = 0)]
    pub eval_every: usize,
    /// Options shared by all tasks.
    #[command(flatten)]
    pub common: Common,
}

impl super::Task for W2vArgs {
    fn name(&self) -> &'static str {
        "w2v"
    }

    fn common(&self) -> &super::Common {
        &self.common
    }

    /// Driver side: makes named data available; returns a description.
    fn prepare(&self) -> Result<String> {
        self.check()?;
        let (corpus, questions) = (self.corpus(), self.questions());
        let analogies = if corpus == "synth-text" { "" } else { questions.as_str() };
        if analogies == "analogies" {
            crate::data::fetch(analogies)?;
        }
        if corpus != "synth-text" {
            for part in self.corpus_parts() {
                if part == "synth-text" {
                    bail!("--data {corpus}: synth-text is a corpus of its own and cannot be combined with others");
                }
                match corpus_file(&part) {
                    Some((dataset, _)) => drop(crate::data::fetch(dataset)?),
                    None => drop(super::user_data(&part, KNOWN_CORPORA, false)?),
                }
            }
        }
        if analogies != "analogies" && !analogies.is_empty() && !std::path::Path::new(analogies).is_file() {
            bail!("--analogies {analogies}: no such file, and not a known set (known: analogies)");
        }
        Ok(format!("corpus {corpus}, analogies {questions}"))
    }

    fn check_data(&self) -> Result<()> {
        let text = Workload::load(self)?;
        let corpus = &text.corpus;
        eprintln!("w2v: {} words, a vocabulary of {} (min count {})", corpus.raw_words, corpus.words.len(), self.min_count);
        Ok(())
    }

    /// The task's options as command-line arguments (for the cluster's processes).
    fn task_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        for (k, v) in [
            ("--data", self.corpus()),
            ("--analogies", self.questions()),
            ("--dim", self.dim.to_string()),
            ("--window", self.window.to_string()),
            ("--neg", self.neg.to_string()),
            ("--min-count", self.min_count.to_string()),
            ("--sample", self.sample.to_string()),
            ("--lr", self.lr.to_string()),
            ("--chunk", self.chunk.to_string()),
            ("--negatives", self.negatives.clone()),
            ("--eval-every", self.eval_every.to_string()),
            ("--intent-ahead", self.intent_ahead.to_string()),
        ] {
            a.push(k.to_string());
            a.push(v);
        }
        a
    }

    fn train(&self, mode: Mode, emit: Sink) -> Result<()> {
        super::epochs::run(self, mode, emit)
    }
}

impl W2vArgs {
    /// The corpus: a known name or a file (`--train` wins over `--data`).
    fn corpus(&self) -> String {
        self.train.as_ref().map_or_else(|| self.data.clone(), |p| p.display().to_string())
    }

    /// The corpora that make up the corpus: `--train`'s file, or `--data`'s comma-separated
    /// names and files.
    fn corpus_parts(&self) -> Vec<String> {
        match &self.train {
            Some(p) => vec![p.display().to_string()],
            None => self
                .data
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .flat_map(|p| if p == "dictionaries" { DICTIONARIES.to_vec() } else { vec![p] })
                .map(str::to_string)
                .collect(),
        }
    }

    /// The analogy questions: a known name or a file (`--test` wins over `--analogies`).
    fn questions(&self) -> String {
        self.test.as_ref().map_or_else(|| self.analogies.clone(), |p| p.display().to_string())
    }

    fn check(&self) -> Result<()> {
        if self.dim == 0 || self.window == 0 || self.neg == 0 || self.chunk == 0 {
            bail!("--dim, --window, --neg and --chunk must be at least 1");
        }
        if !(self.lr > 0.0 && self.lr.is_finite() && self.sample >= 0.0 && self.sample.is_finite()) {
            bail!("--lr must be positive and --sample non-negative");
        }
        self.negative_scheme(Mode::Hybrid)?;
        Ok(())
    }

    /// The negatives' sampling scheme in `mode`.
    fn negative_scheme(&self, mode: Mode) -> Result<SamplingScheme> {
        match self.negatives.as_str() {
            "auto" if mode == Mode::Hybrid => Ok(SamplingScheme::Local),
            "auto" => Ok(SamplingScheme::Independent),
            s => SamplingScheme::parse(s).with_context(|| format!("--negatives {s}")),
        }
    }

    /// Whether hybrid mode replicates the words that several nodes' sentences use (and homes
    /// every other word with its one user) rather than the most frequent ones.
    fn replicates_shared_words(&self) -> bool {
        self.common.replicate == 0 && self.common.nodes > 1
    }

    fn path(name: &str, dataset_file: Option<(&str, &str)>) -> PathBuf {
        match dataset_file {
            Some((dataset, file)) => crate::data::dataset_path(dataset, file),
            None => PathBuf::from(name),
        }
    }

    /// The corpus (identical in every process).
    pub fn load(&self) -> Result<Corpus> {
        self.check()?;
        let corpus = self.corpus();
        if corpus == "synth-text" {
            return Corpus::parse(&synthetic_text(self.common.seed), self.min_count);
        }
        let paths: Vec<PathBuf> = self.corpus_parts().iter().map(|part| Self::path(part, corpus_file(part))).collect();
        Corpus::load(&paths, self.min_count)
    }

    fn load_analogies(&self) -> Result<Analogies> {
        let questions = self.questions();
        if self.corpus() == "synth-text" && questions == "analogies" {
            return Ok(Analogies::synthetic());
        }
        let file = (questions == "analogies").then_some(("analogies", "questions-words.txt"));
        Analogies::load(&Self::path(&questions, file))
    }

    fn evaluate_now(&self, epoch: usize) -> bool {
        epoch == self.common.epochs || (self.eval_every > 0 && epoch.is_multiple_of(self.eval_every))
    }
}

/// The corpora known by name (besides files).
const KNOWN_CORPORA: &[&str] = &["sotu", "lee", "gcide", "wordnet", "foldoc", "jargon", "dictionaries", "synth-text"];

/// What `dictionaries` stands for: every dictionary corpus, together 6.5 M words and (at the
/// default minimum count of 5) a vocabulary of 50 079 words.
const DICTIONARIES: &[&str] = &["gcide", "wordnet", "foldoc", "jargon"];

/// The dataset and file of a corpus known by name.
fn corpus_file(name: &str) -> Option<(&'static str, &'static str)> {
    match name {
        "sotu" => Some(("sotu", "sotu.txt")),
        "lee" => Some(("lee", "lee_background.cor")),
        "gcide" => Some(("gcide", "gcide.txt")),
        "wordnet" => Some(("wordnet", "glosses.txt")),
        "foldoc" => Some(("foldoc", "foldoc.txt")),
        "jargon" => Some(("jargon", "jargon.txt")),
        _ => None,
    }
}

/// Which of the two tables.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Which {
    Input,
    Output,
}

/// How a trainer reaches the vectors: shared arrays (`single`) or Ferry.
trait Vectors {
    fn pull(&mut self, which: Which, keys: &[u64], out: &mut [f32]) -> Result<()>;
    fn push(&mut self, which: Which, keys: &[u64], delta: &[f32]) -> Result<()>;
    /// Starts getting ready for a batch with these words and `negatives` negatives.
    fn prefetch(&mut self, input: &[u64], output: &[u64], negatives: usize) -> Result<()>;
    /// Draws `keys.len()` negatives, and with them their output vectors where that costs nothing
    /// extra (a sampling scheme hands them out together): returns whether `values` was filled.
    /// If not, the trainer pulls the distinct ones it needs (a draw repeats frequent words).
    fn negatives(&mut self, keys: &mut [u64], values: &mut [f32]) -> Result<bool>;
    /// Batches to prepare ahead of the one training.
    fn ahead(&self) -> usize {
        1
    }
    /// A batch was trained.
    fn trained(&mut self) -> Result<()> {
        Ok(())
    }
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

struct SharedVectors<'a> {
    input: &'a SharedArray,
    output: &'a SharedArray,
    table: &'a WeightedAliasIndex<f64>,
    rng: ChaCha8Rng,
    dim: usize,
}

impl Vectors for SharedVectors<'_> {
    fn pull(&mut self, which: Which, keys: &[u64], out: &mut [f32]) -> Result<()> {
        let a = if which == Which::Input { self.input } else { self.output };
        for (row, &k) in out.chunks_exact_mut(self.dim).zip(keys) {
            a.read(k as usize, row);
        }
        Ok(())
    }

    fn push(&mut self, which: Which, keys: &[u64], delta: &[f32]) -> Result<()> {
        let a = if which == Which::Input { self.input } else { self.output };
        for (row, &k) in delta.chunks_exact(self.dim).zip(keys) {
            a.add(k as usize, row);
        }
        Ok(())
    }

    fn prefetch(&mut self, _: &[u64], _: &[u64], _: usize) -> Result<()> {
        Ok(())
    }

    fn negatives(&mut self, keys: &mut [u64], _: &mut [f32]) -> Result<bool> {
        for k in keys.iter_mut() {
            *k = self.table.sample(&mut self.rng) as u64;
        }
        Ok(false)
    }
}

struct FerryVectors<'w> {
    w: &'w mut Worker,
    input: Table,
    output: Table,
    dist: DistributionId,
    localize: bool,
    tickets: VecDeque<Ticket>,
    handles: VecDeque<SampleHandle>,
    /// Intent mode: the trainer draws negatives itself and declares every batch's keys.
    intent: Option<IntentBatches<'w>>,
}

/// Intent mode's state: batch `b` of the epoch trains in clock `base + b`.
struct IntentBatches<'a> {
    table: &'a WeightedAliasIndex<f64>,
    rng: ChaCha8Rng,
    ahead: usize,
    base: u64,
    prepared: u64,
    /// Negatives drawn for the prepared batches, in order.
    negatives: VecDeque<Vec<u64>>,
    /// Negatives come from Ferry's sampling scheme (not `independent`): the trainer declares
    /// only the batches' words, and the scheme serves negatives from what is already here
    /// (NuPS 4.4) instead of every node declaring, and so moving, the most frequent words.
    sampled: bool,
}

impl Vectors for FerryVectors<'_> {
    fn pull(&mut self, which: Which, keys: &[u64], out: &mut [f32]) -> Result<()> {
        Ok(self.w.pull(if which == Which::Input { self.input } else { self.output }, keys, out)?)
    }

    fn push(&mut self, which: Which, keys: &[u64], delta: &[f32]) -> Result<()> {
        Ok(self.w.push(if which == Which::Input { self.input } else { self.output }, keys, delta)?)
    }

    fn prefetch(&mut self, input: &[u64], output: &[u64], negatives: usize) -> Result<()> {
        if let Some(i) = &mut self.intent {
            let clock = i.base + i.prepared;
            i.prepared += 1;
            self.w.intent(self.input, input, clock, clock + 1)?;
            if i.sampled {
                self.w.intent(self.output, output, clock, clock + 1)?;
                self.handles.push_back(self.w.prepare_sample(self.dist, negatives)?);
                return Ok(());
            }
            let drawn: Vec<u64> = (0..negatives).map(|_| i.table.sample(&mut i.rng) as u64).collect();
            let mut outputs: Vec<u64> = output.iter().chain(&drawn).copied().collect();
            outputs.sort_unstable();
            outputs.dedup();
            self.w.intent(self.output, &outputs, clock, clock + 1)?;
            i.negatives.push_back(drawn);
            return Ok(());
        }
        if self.localize {
            self.tickets.push_back(self.w.localize_async(self.input, input)?);
            self.tickets.push_back(self.w.localize_async(self.output, output)?);
            while self.tickets.len() > 6 {
                let t = self.tickets.pop_front().expect("non-empty");
                self.w.wait(t)?;
            }
        }
        self.handles.push_back(self.w.prepare_sample(self.dist, negatives)?);
        Ok(())
    }

    fn negatives(&mut self, keys: &mut [u64], values: &mut [f32]) -> Result<bool> {
        if let Some(i) = self.intent.as_mut().filter(|i| !i.sampled) {
            let drawn = i.negatives.pop_front().filter(|d| d.len() == keys.len());
            match drawn {
                Some(d) => keys.copy_from_slice(&d),
                None => keys.iter_mut().for_each(|k| *k = i.table.sample(&mut i.rng) as u64),
            }
            return Ok(false);
        }
        let mut handle = match self.handles.pop_front() {
            Some(h) if h.remaining() == keys.len() => h,
            _ => self.w.prepare_sample(self.dist, keys.len())?,
        };
        self.w.pull_sample(&mut handle, keys, values)?;
        Ok(true)
    }

    fn ahead(&self) -> usize {
        self.intent.as_ref().map_or(1, |i| i.ahead)
    }

    fn trained(&mut self) -> Result<()> {
        if self.intent.is_some() {
            self.w.advance_clock()?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        while let Some(t) = self.tickets.pop_front() {
            self.w.wait(t)?;
        }
        self.handles.clear();
        Ok(())
    }
}

/// (context, word) pairs of one batch, with its distinct keys (computed once, for the
/// prefetch and for training).
struct Batch {
    pairs: Vec<(u32, u32)>,
    /// Distinct contexts and distinct words, each in first-seen order.
    contexts: Vec<u64>,
    words: Vec<u64>,
    /// Each pair's context as a row of `contexts`, and its word as a row of `words`.
    context_rows: Vec<u32>,
    word_rows: Vec<u32>,
}

impl Batch {
    fn new(pairs: Vec<(u32, u32)>, rows: &mut RowOf) -> Batch {
        let mut contexts = Vec::new();
        let context_rows = pairs.iter().map(|p| rows.row(p.0 as u64, &mut contexts)).collect();
        rows.clear(&contexts);
        let mut words = Vec::new();
        let word_rows = pairs.iter().map(|p| rows.row(p.1 as u64, &mut words)).collect();
        rows.clear(&words);
        Batch { pairs, contexts, words, context_rows, word_rows }
    }
}

/// Rows of a batch's distinct keys, by key: a dense map over the vocabulary (the inner loops
/// look keys up for every pair and negative; hashing them cost more than the arithmetic), left
/// empty after each use by clearing the keys it was given.
#[derive(Default)]
struct RowOf {
    rows: Vec<u32>,
}

impl RowOf {
    const NONE: u32 = u32::MAX;

    /// The row of `key` among `keys`, appending it if it is not there yet.
    #[inline]
    fn row(&mut self, key: u64, keys: &mut Vec<u64>) -> u32 {
        let k = key as usize;
        if k >= self.rows.len() {
            self.rows.resize(k + 1, Self::NONE);
        }
        if self.rows[k] == Self::NONE {
            self.rows[k] = keys.len() as u32;
            keys.push(key);
        }
        self.rows[k]
    }

    /// Forgets `keys` (every key given to [`RowOf::row`] since the last clear).
    fn clear(&mut self, keys: &[u64]) {
        for &k in keys {
            self.rows[k as usize] = Self::NONE;
        }
    }
}

/// Cuts the sentences into batches of at most `chunk` centre positions after subsampling
/// (a long sentence spans several batches; its windows still see the whole sentence).
struct Batcher<'a> {
    sentences: Vec<&'a [u32]>,
    keep: &'a [f32],
    window: usize,
    chunk: usize,
    next: usize,
    /// The subsampled sentence being cut, and the next centre position in it.
    current: Vec<u32>,
    position: usize,
    rows: RowOf,
}

impl Batcher<'_> {
    /// The next batch and the corpus words it finished (counted when a sentence is taken up).
    fn next_batch(&mut self, rng: &mut ChaCha8Rng) -> Option<(Batch, usize)> {
        let mut pairs = Vec::new();
        let mut words = 0;
        let mut positions = 0;
        while positions < self.chunk {
            if self.position >= self.current.len() {
                let Some(sentence) = self.sentences.get(self.next) else { break };
                self.next += 1;
                words += sentence.len();
                self.current.clear();
                self.current.extend(sentence.iter().copied().filter(|&w| rng.r#gen::<f32>() < self.keep[w as usize]));
                self.position = 0;
                continue;
            }
            let (i, kept) = (self.position, &self.current);
            let b = rng.gen_range(1..=self.window);
            for j in i.saturating_sub(b)..(i + b + 1).min(kept.len()) {
                if j != i {
                    pairs.push((kept[j], kept[i]));
                }
            }
            self.position += 1;
            positions += 1;
        }
        (words > 0 || !pairs.is_empty()).then(|| (Batch::new(pairs, &mut self.rows), words))
    }
}

/// word2vec's sigmoid table (as word2vec.c and gensim keep it): the sigmoid and its logarithm at
/// `SIGMOID_STEPS` points over `[-MAX_EXP, MAX_EXP]`, scores beyond taken as the ends. A lookup
/// instead of an `exp` and a `ln` per pair and sample.
struct SigmoidTable {
    sigmoid: [f32; SIGMOID_STEPS],
    log_sigmoid: [f32; SIGMOID_STEPS],
}

/// Scores beyond ±this are taken as ±this.
const MAX_EXP: f32 = 6.0;
/// Points of the table.
const SIGMOID_STEPS: usize = 1024;

impl SigmoidTable {
    fn new() -> SigmoidTable {
        let x = |i: usize| (i as f32 + 0.5) / SIGMOID_STEPS as f32 * 2.0 * MAX_EXP - MAX_EXP;
        SigmoidTable { sigmoid: std::array::from_fn(|i| 1.0 / (1.0 + (-x(i)).exp())), log_sigmoid: std::array::from_fn(|i| -(-x(i)).exp().ln_1p()) }
    }

    /// The table's point for score `f`.
    #[inline(always)]
    fn index(f: f32) -> usize {
        // `as` saturates (and maps NaN to 0), so the index is always in the table.
        (((f + MAX_EXP) * (SIGMOID_STEPS as f32 / (2.0 * MAX_EXP))) as usize).min(SIGMOID_STEPS - 1)
    }
}

static SIGMOIDS: std::sync::LazyLock<SigmoidTable> = std::sync::LazyLock::new(SigmoidTable::new);

/// Scratch buffers of one trainer.
#[derive(Default)]
struct Scratch {
    /// Rows of the batch's distinct contexts and distinct output words (targets, then
    /// negatives not among them), as pulled and as trained.
    input: Vec<f32>,
    input_start: Vec<f32>,
    output: Vec<f32>,
    output_start: Vec<f32>,
    neg_keys: Vec<u64>,
    neg: Vec<f32>,
    /// Each negative's row of `output` ([`SKIP`] where it is the pair's own word).
    neg_rows: Vec<u32>,
    neu: Vec<f32>,
    /// The batch's distinct output words, then negatives not among them.
    outputs: Vec<u64>,
    rows: RowOf,
}

/// A negative that is its pair's word, left out as word2vec does.
const SKIP: u32 = u32::MAX;

/// Trains one batch with SGD on local copies of its distinct rows, then pushes each row's
/// change once; returns the batch's loss.
fn train_batch(v: &mut impl Vectors, batch: &Batch, dim: usize, neg: usize, lr: f32, s: &mut Scratch) -> Result<f64> {
    let p = batch.pairs.len();
    if p == 0 {
        return Ok(0.0);
    }
    let contexts = &batch.contexts;
    // One local copy per distinct output word: a negative that is also a target (or drawn
    // twice) trains the same copy.
    s.outputs.clear();
    for &k in &batch.words {
        s.rows.row(k, &mut s.outputs);
    }
    s.input.resize(contexts.len() * dim, 0.0);
    s.output.resize(s.outputs.len() * dim, 0.0);
    s.neg_keys.clear();
    s.neg_keys.resize(p * neg, 0);
    s.neg.resize(p * neg * dim, 0.0);
    s.neu.resize(dim, 0.0);
    v.pull(Which::Input, contexts, &mut s.input)?;
    v.pull(Which::Output, &s.outputs, &mut s.output)?;
    let filled = v.negatives(&mut s.neg_keys, &mut s.neg)?;
    let targets = s.outputs.len();
    s.neg_rows.clear();
    for (n, &k) in s.neg_keys.iter().enumerate() {
        let known = s.outputs.len();
        let row = s.rows.row(k, &mut s.outputs);
        if filled && row as usize == known {
            s.output.extend_from_slice(&s.neg[n * dim..(n + 1) * dim]);
        }
        let word = batch.pairs[n / neg].1 as u64;
        s.neg_rows.push(if k == word { SKIP } else { row });
    }
    s.rows.clear(&s.outputs);
    if !filled {
        s.output.resize(s.outputs.len() * dim, 0.0);
        v.pull(Which::Output, &s.outputs[targets..], &mut s.output[targets * dim..])?;
    }
    s.input_start.clear();
    s.input_start.extend_from_slice(&s.input);
    s.output_start.clear();
    s.output_start.extend_from_slice(&s.output);
    let loss = train_pairs(&mut s.input, &mut s.output, &mut s.neu, &batch.context_rows, &batch.word_rows, &s.neg_rows, lr);
    simd::sub(&mut s.input, &s.input_start);
    simd::sub(&mut s.output, &s.output_start);
    v.push(Which::Input, contexts, &s.input)?;
    v.push(Which::Output, &s.outputs, &s.output)?;
    Ok(loss)
}

/// Skip-gram with negative sampling on a batch's rows: pair `i` trains context row
/// `context_rows[i]` of `input` against its word's row `word_rows[i]` of `output` (label 1) and
/// the rows `neg_rows[i·neg..]` (label 0). Returns the loss.
#[multiversion::multiversion(targets = "simd")]
fn train_pairs(input: &mut [f32], output: &mut [f32], neu: &mut [f32], context_rows: &[u32], word_rows: &[u32], neg_rows: &[u32], lr: f32) -> f64 {
    let dim = neu.len();
    let neg = neg_rows.len() / context_rows.len().max(1);
    let table: &SigmoidTable = &SIGMOIDS;
    let mut loss = 0.0f64;
    for (i, (&c, &word)) in context_rows.iter().zip(word_rows).enumerate() {
        let l1 = &mut input[c as usize * dim..(c as usize + 1) * dim];
        neu.fill(0.0);
        let samples = std::iter::once((word, 1.0f32)).chain(neg_rows[i * neg..(i + 1) * neg].iter().map(|&o| (o, 0.0)));
        for (o, label) in samples {
            if o == SKIP {
                continue;
            }
            let row = &mut output[o as usize * dim..(o as usize + 1) * dim];
            let f = simd::dot(l1, row);
            let sig = table.sigmoid[SigmoidTable::index(f)];
            // −log σ(f) for the word, −log σ(−f) = −log(1 − σ(f)) for a negative.
            loss -= f64::from(table.log_sigmoid[SigmoidTable::index(if label > 0.5 { f } else { -f })]);
            let g = (label - sig) * lr;
            simd::axpy(neu, g, row);
            simd::axpy(row, g, l1);
        }
        simd::add(l1, neu);
    }
    loss
}

/// What one trainer did in an epoch.
#[derive(Default, Clone, Copy)]
struct Done {
    loss: f64,
    pairs: u64,
    words: u64,
}

/// Trains `sentences` (this trainer's share) for one epoch. `progress(words)` is called now and
/// then with the words done so far.
#[allow(clippy::too_many_arguments)]
fn train_epoch(
    v: &mut impl Vectors,
    a: &W2vArgs,
    sentences: Vec<&[u32]>,
    keep: &[f32],
    epoch: usize,
    rng: &mut ChaCha8Rng,
    mut progress: impl FnMut(u64),
) -> Result<Done> {
    let total: usize = sentences.iter().map(|s| s.len()).sum::<usize>().max(1);
    let mut batcher = Batcher { sentences, keep, window: a.window, chunk: a.chunk, next: 0, current: Vec::new(), position: 0, rows: RowOf::default() };
    let mut scratch = Scratch::default();
    let mut done = Done::default();
    let mut ahead: VecDeque<(Batch, usize)> = VecDeque::new();
    loop {
        // Batches ahead: their words start moving here while the current one trains.
        while ahead.len() <= v.ahead() {
            let Some(next) = batcher.next_batch(rng) else { break };
            v.prefetch(&next.0.contexts, &next.0.words, next.0.pairs.len() * a.neg)?;
            ahead.push_back(next);
        }
        let Some((batch, words)) = ahead.pop_front() else { break };
        let fraction = ((epoch - 1) as f64 + done.words as f64 / total as f64) / a.common.epochs as f64;
        let lr = a.lr * (1.0 - fraction as f32).max(1e-4);
        done.loss += train_batch(v, &batch, a.dim, a.neg, lr, &mut scratch)?;
        done.pairs += batch.pairs.len() as u64;
        done.words += words as u64;
        v.trained()?;
        progress(done.words);
    }
    v.finish()?;
    Ok(done)
}

/// Analogy accuracy (3CosAdd over unit vectors, the question's three words excluded) on the
/// questions whose four words are all in the vocabulary.
fn evaluate(
    vectors: &[f32],
    dim: usize,
    corpus: &Corpus,
    analogies: &Analogies,
    threads: usize,
    progress: &(dyn Fn(f64) + Sync),
) -> serde_json::Map<String, serde_json::Value> {
    let index: std::collections::HashMap<&str, usize> = corpus.words.iter().enumerate().map(|(i, w)| (w.as_str(), i)).collect();
    let mut unit = vectors.to_vec();
    for row in unit.chunks_exact_mut(dim) {
        let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
        row.iter_mut().for_each(|x| *x /= norm);
    }
    let questions: Vec<[usize; 4]> = analogies
        .questions
        .iter()
        .filter_map(|(_, q)| Some([index.get(q[0].as_str())?, index.get(q[1].as_str())?, index.get(q[2].as_str())?, index.get(q[3].as_str())?].map(|&i| i)))
        .collect();
    let next = AtomicUsize::new(0);
    let correct: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|_| {
                let (unit, questions, next) = (&unit, &questions, &next);
                s.spawn(move || {
                    let mut correct = 0;
                    let mut query = vec![0.0f32; dim];
                    let mut scores = vec![0.0f32; unit.len() / dim.max(1)];
                    loop {
                        let q = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&[a, b, c, d]) = questions.get(q) else { break };
                        if q.is_multiple_of(256) {
                            progress(q as f64 / questions.len().max(1) as f64);
                        }
                        for j in 0..dim {
                            query[j] = unit[b * dim + j] - unit[a * dim + j] + unit[c * dim + j];
                        }
                        simd::dot_rows(unit, dim, &query, &mut scores);
                        let mut best = (f32::NEG_INFINITY, usize::MAX);
                        for (w, &score) in scores.iter().enumerate() {
                            if score > best.0 && w != a && w != b && w != c {
                                best = (score, w);
                            }
                        }
                        correct += usize::from(best.1 == d);
                    }
                    correct
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("evaluation thread")).sum()
    });
    let mut m = serde_json::Map::new();
    m.insert("analogy".into(), (correct as f64 / questions.len().max(1) as f64).into());
    m.insert("analogy_questions".into(), questions.len().into());
    m.insert("analogy_all_questions".into(), analogies.questions.len().into());
    m
}

fn eval_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).min(8)
}

fn init_input(seed: u64, key: usize, j: usize, dim: usize) -> f32 {
    initial(seed, 7, key as u64, j) * 0.5 / dim as f32
}

impl W2vArgs {
    /// The model as saved: the word vectors (`words`: the input vectors, the embeddings one
    /// uses) and the context vectors (`contexts`: the output vectors), both keyed by word.
    fn description<'a>(&self, corpus: &'a Corpus) -> Description<'a> {
        let meta = serde_json::json!({ "model": "skip-gram with negative sampling", "dim": self.dim, "window": self.window });
        let (cols, ids) = (self.dim, &corpus.words[..]);
        Description { task: "w2v", meta, tables: vec![Described { name: "words", source: 0, cols, ids }, Described { name: "contexts", source: 1, cols, ids }] }
    }
}

/// The sentences node `rank` of `nodes` trains, every epoch: a random share (the same on every
/// node for one `seed`), not a contiguous block — a corpus in document order (`sotu` is
/// chronological) split into blocks has nodes train different eras side by side, which cost
/// analogy accuracy (`docs/WORKLOADS.md`); the share stays fixed so that the words a node
/// trains stay there from epoch to epoch.
fn node_sentences(sentences: usize, seed: u64, nodes: usize, rank: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..sentences).collect();
    all.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_5EED));
    let mut mine = all[part(sentences, nodes, rank)].to_vec();
    mine.sort_unstable();
    mine
}

/// The corpus, what training draws from it, and (at the reporter) the analogy questions.
pub struct Text {
    corpus: Corpus,
    /// Per word: the probability that an occurrence is kept (subsampling).
    keep: Vec<f32>,
    /// The negatives' weights (unigram counts to the power 0.75).
    weights: Vec<f64>,
    unigram: WeightedAliasIndex<f64>,
    analogies: std::sync::OnceLock<Analogies>,
    /// Which nodes' sentences use each word (when hybrid mode replicates the shared words).
    users: Option<WordUsers>,
}

/// Per word: how many nodes' sentences use it, and the node whose sentences use it most.
struct WordUsers {
    count: Vec<u16>,
    most: Vec<u16>,
}

impl WordUsers {
    /// Counts the words of each node's share of the sentences (`node_sentences`).
    fn of(corpus: &Corpus, nodes: usize, seed: u64) -> WordUsers {
        let v = corpus.words.len();
        let (mut count, mut most, mut best) = (vec![0u16; v], vec![0u16; v], vec![0u64; v]);
        let mut uses = vec![0u64; v];
        for node in 0..nodes {
            uses.iter_mut().for_each(|u| *u = 0);
            for i in node_sentences(corpus.sentences.len(), seed, nodes, node) {
                for &w in &corpus.sentences[i] {
                    uses[w as usize] += 1;
                }
            }
            for w in 0..v {
                if uses[w] > 0 {
                    count[w] += 1;
                }
                if uses[w] > best[w] {
                    (best[w], most[w]) = (uses[w], node as u16);
                }
            }
        }
        WordUsers { count, most }
    }
}

impl Workload for W2vArgs {
    type Data = Text;

    fn load(&self) -> Result<Text> {
        let corpus = W2vArgs::load(self)?;
        let keep = corpus.keep_probabilities(self.sample);
        let weights = corpus.negative_weights();
        let unigram = WeightedAliasIndex::new(weights.clone()).context("negative distribution")?;
        let users = (self.replicates_shared_words() && self.common.modes().any(|m| m == Mode::Hybrid))
            .then(|| WordUsers::of(&corpus, self.common.nodes, self.common.seed));
        Ok(Text { corpus, keep, weights, unigram, analogies: std::sync::OnceLock::new(), users })
    }

    fn model(&self, text: &Text, mode: Mode) -> Result<Model> {
        let (seed, dim, v) = (self.common.seed, self.dim, text.corpus.words.len());
        if mode == Mode::Intent && self.intent_ahead == 0 {
            bail!("--intent-ahead must be at least 1");
        }
        let (mut input_spec, mut output_spec) = (TableSpec::new("input", v as u64, dim), TableSpec::new("output", v as u64, dim));
        let mut notes = Vec::new();
        if mode != Mode::Single {
            input_spec = self.common.on_the_wire(input_spec)?;
            output_spec = self.common.on_the_wire(output_spec)?;
        }
        if let (Mode::Hybrid, Some(users)) = (mode, &text.users) {
            // Every word a node's sentences use is local there: replicated when other nodes'
            // sentences use it too, homed at its one user otherwise.
            let shared = ferry::as_ranges(&ferry::copartition::shared(&users.count));
            let n: u64 = shared.iter().map(|r| r.end - r.start).sum();
            notes.push(format!("hybrid: {n} of {v} words used by more than one node's sentences replicated, the others homed with their user"));
            let placement = std::sync::Arc::new(ferry::Placement::new(self.common.nodes, users.most.clone())?);
            input_spec = input_spec.placed(placement.clone()).replicating(shared.clone());
            output_spec = output_spec.placed(placement).replicating(shared);
        } else if mode == Mode::Hybrid {
            // The frequency heuristic on word counts: a word's input vector is accessed once per
            // occurrence, its output vector once per occurrence as a context and as a negative.
            let counts = ferry::AccessCounts::from_counts(text.corpus.counts.clone());
            let hot = ferry::as_ranges(&self.common.hot_keys(&counts));
            let n: u64 = hot.iter().map(|r| r.end - r.start).sum();
            let share = counts.share(&hot.iter().flat_map(|r| r.clone()).collect::<Vec<_>>());
            notes.push(format!("hybrid: the {n} most frequent of {v} words replicated ({:.1}% of occurrences)", 100.0 * share));
            input_spec = input_spec.replicating(hot.clone());
            output_spec = output_spec.replicating(hot);
        }
        Ok(Model { tables: vec![ModelTable::init(input_spec, move |k, j| init_input(seed, k as usize, j, dim)), ModelTable::zeros(output_spec)], notes })
    }

    fn trainer<'a>(&'a self, text: &'a Text, pass: &mut Pass<'_>) -> Result<Box<dyn Trainer + 'a>> {
        if pass.reporter() && text.analogies.get().is_none() {
            // Loaded before training, so that a missing file is found at once.
            let _ = text.analogies.set(self.load_analogies()?);
        }
        if pass.mode == Mode::Single {
            return Ok(Box::new(W2vTrainer { a: self, text, mine: (0..text.corpus.sentences.len()).collect(), dist: None }));
        }
        let mine = node_sentences(text.corpus.sentences.len(), self.common.seed, pass.nodes, pass.rank);
        let scheme = self.negative_scheme(pass.mode)?;
        let (w, tables) = pass.node().expect("a cluster's pass has a worker");
        let dist = w.register_distribution(tables[1], KeyDistribution::Weighted { start: 0, weights: text.weights.clone() }, scheme)?;
        Ok(Box::new(W2vTrainer { a: self, text, mine, dist: Some(dist) }))
    }

    fn reads_model(&self, epoch: usize) -> bool {
        self.evaluate_now(epoch) || self.common.save_now(epoch)
    }

    fn describe<'a>(&self, data: &'a Text) -> Option<Description<'a>> {
        Some(self.description(&data.corpus))
    }

    fn evaluate(&self, text: &Text, epoch: usize, model: &mut ModelReader<'_>, sums: &Fields, at: Measured, emit: &(dyn Fn(Event) + Sync)) -> Result<Quality> {
        let (evaluating, saving) = (self.evaluate_now(epoch), self.common.save_now(epoch));
        let mut quality = Quality::new();
        if evaluating || saving {
            let words = model.all(0)?;
            if let Some(analogies) = text.analogies.get().filter(|_| evaluating) {
                quality = evaluate(&words, self.dim, &text.corpus, analogies, eval_threads(), &|f| emit(Event::Evaluating(epoch, f)));
            }
            if saving {
                let d = self.description(&text.corpus);
                self.common.save_model(&d, epoch, &[d.saved(0, &words, self.dim), d.saved(1, &model.all(1)?, self.dim)])?;
            }
        }
        quality.insert("corpus_words".into(), text.corpus.raw_words.into());
        quality.insert("vocabulary".into(), text.corpus.words.len().into());
        quality.insert("words_per_s_per_thread".into(), (sums[field::TEST_COUNT] as f64 / at.epoch_s / at.threads as f64).into());
        Ok(quality)
    }
}

/// One thread's share of the sentences: `single`'s part of a shuffled order of all of them, a
/// cluster thread's part of its node's.
struct W2vTrainer<'a> {
    a: &'a W2vArgs,
    text: &'a Text,
    /// The sentences this thread's node trains (`single`: all).
    mine: Vec<usize>,
    /// The negatives' distribution in Ferry (a cluster).
    dist: Option<DistributionId>,
}

impl Trainer for W2vTrainer<'_> {
    fn epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<Fields> {
        let (a, text) = (self.a, self.text);
        let (seed, dim, rank, t, threads) = (a.common.seed, a.dim, pass.rank, pass.thread, pass.threads);
        let single = pass.mode == Mode::Single;
        // `single` shuffles one order of every sentence anew each epoch, a cluster node its
        // sentences with its rank in the seed, both from their first order: an epoch's order
        // depends on the epoch alone (a run resumed from a checkpoint trains as the
        // uninterrupted one would have).
        let order = if single {
            let mut order = self.mine.clone();
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ ((epoch as u64) << 20)));
            order
        } else {
            let mut order = self.mine.clone();
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ ((epoch as u64) << 20) ^ rank as u64));
            order
        };
        let share: Vec<&[u32]> = order[part(order.len(), threads, t)].iter().map(|&i| text.corpus.sentences[i].as_slice()).collect();
        let mut last = 0u64;
        let done = if single {
            let arrays = pass.shared().expect("single mode has shared arrays");
            let total_words = text.corpus.sentences.iter().map(|s| s.len()).sum::<usize>() as f64 / threads as f64;
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((epoch as u64) << 32) ^ t as u64);
            let rng_negatives = ChaCha8Rng::seed_from_u64(seed ^ 0xAB ^ t as u64 ^ ((epoch as u64) << 8));
            let mut vectors = SharedVectors { input: &arrays[0], output: &arrays[1], table: &text.unigram, rng: rng_negatives, dim };
            let progress = |words: u64| {
                if words - last > 20_000 {
                    last = words;
                    pass.progress(epoch, words as f64 / total_words);
                }
            };
            train_epoch(&mut vectors, a, share, &text.keep, epoch, &mut rng, progress)?
        } else {
            let total_words = share.iter().map(|s| s.len()).sum::<usize>().max(1) as f64;
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((epoch as u64) << 32) ^ ((rank as u64) << 16) ^ t as u64);
            let (localize, intent) = (matches!(pass.mode, Mode::Localize | Mode::Hybrid), pass.mode == Mode::Intent);
            let dist = self.dist.expect("a cluster thread's negatives");
            let scheme = a.negative_scheme(pass.mode)?;
            let reporter = pass.reporter();
            let progress_of = pass.progress_fn();
            let Access::Node { worker, tables } = &mut pass.access else { unreachable!("a cluster's pass has a worker") };
            let base = worker.current_clock();
            let intent = intent.then(|| IntentBatches {
                table: &text.unigram,
                rng: ChaCha8Rng::seed_from_u64(rng.r#gen()),
                ahead: a.intent_ahead,
                base,
                prepared: 0,
                negatives: VecDeque::new(),
                sampled: scheme != SamplingScheme::Independent,
            });
            let mut vectors =
                FerryVectors { w: worker, input: tables[0], output: tables[1], dist, localize, tickets: VecDeque::new(), handles: VecDeque::new(), intent };
            let progress = |words: u64| {
                if reporter && words - last > 20_000 {
                    last = words;
                    progress_of(epoch, words as f64 / total_words);
                }
            };
            train_epoch(&mut vectors, a, share, &text.keep, epoch, &mut rng, progress)?
        };
        let mut m = [0.0f32; METRIC_FIELDS];
        m[field::LOSS] = done.loss as f32;
        m[field::EXAMPLES] = done.pairs as f32;
        m[field::TEST_COUNT] = done.words as f32;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sigmoid_table_follows_the_sigmoid_and_holds_its_ends() {
        let t = SigmoidTable::new();
        for i in -700..=700 {
            let f = i as f32 / 100.0;
            let (sig, exact) = (t.sigmoid[SigmoidTable::index(f)], 1.0 / (1.0 + (-f).exp()));
            let clamped = 1.0 / (1.0 + (-f.clamp(-MAX_EXP, MAX_EXP)).exp());
            assert!((sig - clamped).abs() < 0.004, "σ({f}) = {exact}, table {sig}");
            let log = t.log_sigmoid[SigmoidTable::index(f)];
            assert!((log - clamped.ln()).abs() < 0.01, "log σ({f}) = {}, table {log}", clamped.ln());
        }
        for f in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30] {
            assert!(SigmoidTable::index(f) < SIGMOID_STEPS);
        }
    }

    #[test]
    fn nodes_train_disjoint_random_shares_of_the_sentences() {
        let shares: Vec<Vec<usize>> = (0..3).map(|r| node_sentences(1000, 7, 3, r)).collect();
        let mut all: Vec<usize> = shares.concat();
        all.sort_unstable();
        assert_eq!(all, (0..1000).collect::<Vec<_>>(), "every sentence on exactly one node");
        assert_eq!(shares[1], node_sentences(1000, 7, 3, 1), "the same share for the same seed");
        // Not a contiguous block: a share spans the corpus.
        for share in &shares {
            assert!(share.len() >= 300 && share[0] < 50 && *share.last().unwrap() > 950, "{:?}", &share[..5]);
        }
    }

    #[test]
    fn a_batch_moves_the_pair_together_and_negatives_apart() {
        let corpus = Corpus::parse("a b\n", 1).unwrap();
        let input = SharedArray::new(2, 4, |k, j| if k == j { 0.5 } else { 0.1 });
        let output = SharedArray::new(2, 4, |_, _| 0.1);
        let table = WeightedAliasIndex::new(vec![0.0, 1.0]).unwrap();
        let mut v = SharedVectors { input: &input, output: &output, table: &table, rng: ChaCha8Rng::seed_from_u64(1), dim: 4 };
        let score = |v: &SharedVectors, a: usize, b: usize| {
            let (mut x, mut y) = ([0.0; 4], [0.0; 4]);
            v.input.read(a, &mut x);
            v.output.read(b, &mut y);
            x.iter().zip(&y).map(|(p, q)| p * q).sum::<f32>()
        };
        let before = (score(&v, 0, 0), score(&v, 0, 1));
        // Pair (context 0, word 0): word 0 is the positive, the only negative is word 1.
        let batch = Batch::new(vec![(0, 0)], &mut RowOf::default());
        let mut s = Scratch::default();
        let loss = train_batch(&mut v, &batch, 4, 1, 0.5, &mut s).unwrap();
        assert!(loss > 0.0);
        let after = (score(&v, 0, 0), score(&v, 0, 1));
        assert!(after.0 > before.0, "the positive pair scores higher: {before:?} -> {after:?}");
        assert!(after.1 < before.1, "the negative scores lower: {before:?} -> {after:?}");
        assert_eq!(corpus.words.len(), 2);
    }

    #[test]
    fn analogy_evaluation_finds_planted_offsets() {
        // king - man + woman = queen with planted 2-d vectors.
        let corpus = Corpus::parse("king man woman queen apple\nking man woman queen apple\n", 1).unwrap();
        let mut vectors = vec![0.0f32; corpus.words.len() * 2];
        let planted = [("king", [1.0, 1.0]), ("man", [1.0, 0.0]), ("woman", [0.0, 1.0]), ("queen", [0.1, 1.9]), ("apple", [-1.0, -0.2])];
        for (w, x) in planted {
            let i = corpus.words.iter().position(|c| c == w).unwrap();
            vectors[i * 2..i * 2 + 2].copy_from_slice(&x);
        }
        let analogies = Analogies::parse(": t\nman king woman queen\nman woman king apple\nfoo bar baz qux\n").unwrap();
        let m = evaluate(&vectors, 2, &corpus, &analogies, 2, &|_| {});
        assert_eq!(m["analogy_questions"], 2);
        assert_eq!(m["analogy"], 0.5);
    }
}
