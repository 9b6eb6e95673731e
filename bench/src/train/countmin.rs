//! A distributed CountMin sketch over a real token stream (the parameter server, OSDI 2014,
//! Section 5.3).
//!
//! The sketch is `depth` rows of `width` counters; row `r`'s counter of a word is chosen by a
//! pairwise-independent hash `((a_r · x + b_r) mod p) mod width`. Each counter is one key of a
//! table with the `add` updater, so inserting is push-only: a worker hashes a batch of tokens
//! into `depth` keys each and pushes `+1` for every one (keys may repeat within a push). A query
//! pulls a word's `depth` counters and takes the smallest. The estimate never undercounts and,
//! with probability at least `1 − e^{−depth}`, overcounts by at most `ε·N` with `ε = e / width`
//! for a stream of `N` tokens.

use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use ferry::{Partitioning, TableSpec};

use super::epochs::{Fields, Measured, Model, ModelReader, ModelTable, Pass, Quality, Trainer, Workload};
use super::shared::{METRIC_FIELDS, field};
use super::{Common, Event, Mode, Sink};
use crate::data::text::{Corpus, synthetic_text};

/// Options of `train countmin`.
#[derive(Debug, Clone, Args)]
pub struct CountMinArgs {
    /// Token stream: `sotu` (State of the Union addresses), `lee` (gensim's Lee corpus),
    /// `synth-text` (generated, for tests), or a text file.
    #[arg(long, default_value = "sotu")]
    pub data: String,
    /// Rows of the sketch (hash functions).
    #[arg(long, default_value_t = 4)]
    pub depth: usize,
    /// Counters per row.
    #[arg(long, default_value_t = 1 << 14)]
    pub width: usize,
    /// Tokens per push without --combine.
    #[arg(long, default_value_t = 4096)]
    pub batch: usize,
    /// Combine locally (the parameter server's local aggregation): a worker counts this many
    /// tokens into a private copy of the sketch, then pushes it as one range push of every
    /// counter (a run of keys: no key list on the wire); 0 pushes each batch's keys as they come.
    #[arg(long, default_value_t = 1 << 18)]
    pub combine: usize,
    /// Options shared by all tasks.
    #[command(flatten)]
    pub common: Common,
}

const KNOWN: &[&str] = &["sotu", "lee", "synth-text"];
/// The Mersenne prime 2^61 − 1 of the hash family.
const P: u64 = (1 << 61) - 1;

impl super::Task for CountMinArgs {
    fn name(&self) -> &'static str {
        "countmin"
    }

    fn common(&self) -> &super::Common {
        &self.common
    }

    /// Driver side: makes named data available; returns a description.
    fn prepare(&self) -> Result<String> {
        self.check()?;
        match self.data.as_str() {
            "sotu" | "lee" => {
                crate::data::fetch(&self.data)?;
                Ok(format!("{}: tokens of the corpus, a {} × {} sketch", self.data, self.depth, self.width))
            }
            "synth-text" => Ok("synth-text: a generated token stream".into()),
            path => Ok(format!("tokens of {}", super::user_data(path, KNOWN, false)?.display())),
        }
    }

    fn check_data(&self) -> Result<()> {
        Workload::load(self).map(drop)
    }

    /// The task's options as command-line arguments (for the cluster's processes).
    fn task_args(&self) -> Vec<String> {
        vec![
            "--data".into(),
            self.data.clone(),
            "--depth".into(),
            self.depth.to_string(),
            "--width".into(),
            self.width.to_string(),
            "--batch".into(),
            self.batch.to_string(),
            "--combine".into(),
            self.combine.to_string(),
        ]
    }

    fn train(&self, mode: Mode, emit: Sink) -> Result<()> {
        super::epochs::run(self, mode, emit)
    }
}

impl CountMinArgs {
    fn check(&self) -> Result<()> {
        if self.depth == 0 || self.depth > 32 || self.width < 2 || self.width > 1 << 26 || self.batch == 0 {
            bail!("--depth must be in 1..=32, --width in 2..=2^26, --batch at least 1");
        }
        Ok(())
    }

    /// The token stream as word ids, and the number of distinct words.
    fn load(&self) -> Result<(Vec<u32>, usize)> {
        self.check()?;
        let corpus = match self.data.as_str() {
            "synth-text" => Corpus::parse(&synthetic_text(self.common.seed), 1)?,
            "sotu" => Corpus::load(&[crate::data::dataset_path("sotu", "sotu.txt")], 1)?,
            "lee" => Corpus::load(&[crate::data::dataset_path("lee", "lee_background.cor")], 1)?,
            path => Corpus::load(&[super::user_data(path, KNOWN, false)?], 1)?,
        };
        Ok((corpus.sentences.concat(), corpus.words.len()))
    }

    fn keys(&self) -> u64 {
        (self.depth * self.width) as u64
    }
}

/// The sketch's hash functions: `(a_r, b_r)` per row, the same in every process.
struct Hashes {
    rows: Vec<(u64, u64)>,
    width: u64,
}

impl Hashes {
    fn new(depth: usize, width: usize, seed: u64) -> Hashes {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0xc0_417);
        Hashes { rows: (0..depth).map(|_| (rng.gen_range(1..P), rng.gen_range(0..P))).collect(), width: width as u64 }
    }

    /// Appends the keys of `word`'s counters, one per row.
    #[inline]
    fn keys(&self, word: u32, out: &mut Vec<u64>) {
        for (r, &(a, b)) in self.rows.iter().enumerate() {
            let h = ((a as u128 * word as u128 + b as u128) % P as u128) as u64;
            out.push(r as u64 * self.width + h % self.width);
        }
    }
}

/// How well the sketch answers: per distinct word, the estimate against the exact count.
fn evaluate(a: &CountMinArgs, sketch: &[f32], stream: &[u32], words: usize, passes: usize, hashes: &Hashes) -> serde_json::Map<String, serde_json::Value> {
    let mut exact = vec![0u64; words];
    for &w in stream {
        exact[w as usize] += passes as u64;
    }
    let n = (stream.len() * passes) as f64;
    let bound = std::f64::consts::E / a.width as f64 * n;
    let (mut within, mut error, mut under) = (0usize, 0f64, 0usize);
    let mut keys = Vec::with_capacity(a.depth);
    for (word, &count) in exact.iter().enumerate() {
        keys.clear();
        hashes.keys(word as u32, &mut keys);
        let estimate = keys.iter().map(|&k| sketch[k as usize] as f64).fold(f64::INFINITY, f64::min);
        let over = estimate - count as f64;
        under += (over < 0.0) as usize;
        within += (over <= bound) as usize;
        error += over.abs();
    }
    let mut q = serde_json::Map::new();
    q.insert("within_bound".into(), (within as f64 / words.max(1) as f64).into());
    q.insert("mean_overcount".into(), (error / words.max(1) as f64).into());
    q.insert("bound".into(), bound.into());
    q.insert("undercounts".into(), under.into());
    q
}

/// Keys per second of the raw stream: hashing every token into its keys, nothing inserted.
fn raw_rate(stream: &[u32], hashes: &Hashes, batch: usize) -> f64 {
    let started = Instant::now();
    let mut keys = Vec::with_capacity(batch * hashes.rows.len());
    let mut total = 0usize;
    for chunk in stream.chunks(batch) {
        keys.clear();
        for &w in chunk {
            hashes.keys(w, &mut keys);
        }
        total += std::hint::black_box(&keys).len();
    }
    total as f64 / started.elapsed().as_secs_f64().max(1e-9)
}

fn rates(q: &mut serde_json::Map<String, serde_json::Value>, keys: usize, seconds: f64, raw: f64) {
    let rate = keys as f64 / seconds.max(1e-9);
    q.insert("keys_per_s".into(), rate.into());
    q.insert("raw_keys_per_s".into(), raw.into());
    q.insert("vs_raw".into(), (rate / raw).into());
}

/// The token stream, its distinct words and the sketch's hash functions.
pub struct Stream {
    tokens: Vec<u32>,
    words: usize,
    hashes: Hashes,
}

impl Workload for CountMinArgs {
    type Data = Stream;

    fn load(&self) -> Result<Stream> {
        let (tokens, words) = CountMinArgs::load(self)?;
        Ok(Stream { tokens, words, hashes: Hashes::new(self.depth, self.width, self.common.seed) })
    }

    fn model(&self, _: &Stream, mode: Mode) -> Result<Model> {
        if !matches!(mode, Mode::Single | Mode::Classic) {
            bail!("train countmin runs in classic mode (its counters are pushed to, never worked on where they are)");
        }
        // Combined pushes cover every counter: range partitioning makes them one run per node.
        let partitioning = if self.combine > 0 { Partitioning::Range } else { Partitioning::Hash };
        Ok(Model { tables: vec![ModelTable::zeros(TableSpec::new("sketch", self.keys(), 1).partitioned(partitioning))], notes: Vec::new() })
    }

    fn trainer<'a>(&'a self, data: &'a Stream, _: &mut Pass<'_>) -> Result<Box<dyn Trainer + 'a>> {
        let combining = self.combine > 0;
        Ok(Box::new(Inserter { a: self, data, keys: Vec::with_capacity(self.batch * self.depth), ones: Vec::new(), combined: Vec::new(), combining }))
    }

    fn reads_model(&self, _: usize) -> bool {
        true
    }

    fn evaluate(&self, data: &Stream, epoch: usize, model: &mut ModelReader<'_>, sums: &Fields, at: Measured, _: &(dyn Fn(Event) + Sync)) -> Result<Quality> {
        let sketch = model.all(0)?;
        let mut quality = evaluate(self, &sketch, &data.tokens, data.words, epoch, &data.hashes);
        // The raw stream's rate, measured now beside the epoch's (the machine is shared).
        let raw = raw_rate(&data.tokens, &data.hashes, self.batch);
        rates(&mut quality, sums[field::EXAMPLES] as usize * self.depth, at.epoch_s, raw);
        Ok(quality)
    }
}

/// A thread inserting its share of the stream.
struct Inserter<'a> {
    a: &'a CountMinArgs,
    data: &'a Stream,
    keys: Vec<u64>,
    ones: Vec<f32>,
    /// A private copy of the sketch that chunks are counted into (combining: cleared per
    /// chunk), or in `single` the sketch itself (kept across epochs).
    combined: Vec<f32>,
    combining: bool,
}

impl Inserter<'_> {
    /// Counts `tokens` into the private sketch, a batch of tokens' keys at a time.
    fn count(&mut self, tokens: &[u32]) {
        let (keys, combined, hashes) = (&mut self.keys, &mut self.combined, &self.data.hashes);
        combined.resize(self.a.keys() as usize, 0.0);
        for batch in tokens.chunks(self.a.batch) {
            keys.clear();
            for &word in batch {
                hashes.keys(word, keys);
            }
            for &k in keys.iter() {
                combined[k as usize] += 1.0;
            }
        }
    }
}

impl Trainer for Inserter<'_> {
    /// `single`: the sketch into the model's table (the evaluation reads it there).
    fn measure(&mut self, _: usize, pass: &mut Pass<'_>) -> Result<Fields> {
        if pass.mode == Mode::Single && pass.thread == 0 {
            let arrays = pass.shared().expect("single mode has shared arrays");
            for (k, count) in self.combined.iter().enumerate() {
                arrays[0].write(k, std::slice::from_ref(count));
            }
        }
        Ok([0.0; METRIC_FIELDS])
    }

    fn epoch(&mut self, _: usize, pass: &mut Pass<'_>) -> Result<Fields> {
        let a = self.a;
        let mut v = [0.0f32; METRIC_FIELDS];
        if pass.mode == Mode::Single {
            // One thread counts the whole stream into its plain array, the sketch (the others
            // have nothing to do); `measure` copies it into the model's table.
            if pass.thread == 0 {
                let data = self.data;
                self.count(&data.tokens);
                v[field::EXAMPLES] = self.data.tokens.len() as f32;
            }
            return Ok(v);
        }
        let (worker_index, workers) = (pass.rank * pass.threads + pass.thread, pass.nodes * pass.threads);
        let (w, tables) = pass.node().expect("a cluster's pass has a worker");
        let sketch = tables[0];
        let chunk_tokens = if self.combining { a.combine } else { a.batch };
        let mut inserted = 0usize;
        for chunk in self.data.tokens.chunks(chunk_tokens).skip(worker_index).step_by(workers) {
            if self.combining {
                self.combined.clear();
                self.count(chunk);
                w.push_range(sketch, 0..a.keys(), &self.combined)?;
            } else {
                for part in chunk.chunks(a.batch) {
                    self.keys.clear();
                    for &word in part {
                        self.data.hashes.keys(word, &mut self.keys);
                    }
                    self.ones.resize(self.keys.len(), 1.0f32);
                    w.push(sketch, &self.keys, &self.ones)?;
                }
            }
            inserted += chunk.len();
        }
        v[field::EXAMPLES] = inserted as f32;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_spread_and_stay_in_their_rows() {
        let h = Hashes::new(3, 100, 1);
        let mut keys = Vec::new();
        for w in 0..1000u32 {
            keys.clear();
            h.keys(w, &mut keys);
            for (r, &k) in keys.iter().enumerate() {
                assert!((r as u64 * 100..(r as u64 + 1) * 100).contains(&k));
            }
        }
        let mut load = vec![0usize; 100];
        for w in 0..10_000u32 {
            keys.clear();
            h.keys(w, &mut keys);
            load[keys[0] as usize] += 1;
        }
        assert!(load.iter().all(|&l| (50..=150).contains(&l)), "{load:?}");
    }
}
