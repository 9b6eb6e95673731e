//! Matrix factorization with SGD: `rating ≈ μ + b_u + b_i + ⟨p_u, q_i⟩`.
//!
//! Parallelised as DSGD with parameter blocking (Lapse, section 4 and appendix A): rows (users)
//! are partitioned to nodes — each node localizes its rows once (data clustering) — and columns
//! (items) are dealt out to one block per node; in sub-epoch `s` node `n` trains its ratings of block
//! `(n + s) mod N`, after localizing that block, so that all parameter accesses within a
//! sub-epoch are local. Worker threads of a node split its rows; a cluster barrier ends every
//! sub-epoch. The `single` mode runs the same schedule over threads and plain shared arrays.

use anyhow::{Result, bail};
use clap::Args;
use ferry::TableSpec;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::DataFiles;
use super::checkpoint_model::{Described, Description};
use super::epochs::{Fields, Measured, Model, ModelReader, ModelTable, Pass, Quality, Trainer, Workload};
use super::shared::{METRIC_FIELDS, field, part, part_of};
use super::simd;
use super::{Common, Event, Mode, Sink};
use crate::data::ratings::{Ratings, Synthetic};

/// Options of `train mf`.
#[derive(Debug, Clone, Args)]
pub struct MfArgs {
    /// Ratings: `ml-100k` (fetched into the cache), `synth-small`, `synth-tiny`, or a file of
    /// `user item rating` rows, split by --test-share (one separator per file, see --sep; a
    /// header when it looks like one). --train and --test give a split of your own instead.
    #[arg(long, default_value = "ml-100k")]
    pub data: String,
    /// Rank of the factorization.
    #[arg(long, default_value_t = 20)]
    pub rank: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.01)]
    pub lr: f32,
    /// L2 regularisation.
    #[arg(long, default_value_t = 0.05)]
    pub reg: f32,
    /// Share of ratings held out for testing (files and MovieLens; `synth-small` has its own).
    #[arg(long, default_value_t = 0.2)]
    pub test_share: f64,
    /// Ratings per mini-batch: their rows and columns are pulled at once, the SGD steps run one
    /// after the other on the local copies, and each key's change is pushed at once.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Bounded delay (classic mode): workers complete `--clocks-per-epoch` clocks per epoch
    /// instead of meeting at sub-epoch barriers, and none starts clock `c` before every worker
    /// completed `c − τ − 1`. A number of clocks, or `inf` (clocks counted, never waited for).
    #[arg(long)]
    pub max_delay: Option<String>,
    /// Clocks per epoch with --max-delay.
    #[arg(long, default_value_t = 10)]
    pub clocks_per_epoch: usize,
    /// Transient stragglers, for the bounded-delay trade-off: with --max-delay, in every clock
    /// each worker pauses this many milliseconds with probability 1 / nodes (seeded).
    #[arg(long, default_value_t = 0)]
    pub straggle_ms: u64,
    /// Intent mode: clocks per sub-epoch (each worker declares the next sub-epoch's items for
    /// its next this many clocks).
    #[arg(long, default_value_t = 16)]
    pub intent_clocks: u64,
    /// How users and items key the tables in cluster modes: `dense` (numbered in order of
    /// first appearance, tables of that many keys) or `raw` (their ids in the file — a number
    /// as it is, any other name by its 64-bit hash — key two dynamic tables, each id created at
    /// its first touch: docs/DYNAMIC.md; modes classic, localize, intent and hybrid). `single` stores the
    /// same model densely.
    #[arg(long, default_value = "dense")]
    pub ids: String,
    /// Own data files.
    #[command(flatten)]
    pub files: DataFiles,
    /// Instead of training: predict the ratings of the `user item` pairs in this file with a
    /// model saved by --save (given with --model); prints `user<TAB>item<TAB>rating` lines.
    #[arg(long, requires = "model")]
    pub predict: Option<std::path::PathBuf>,
    /// A model directory written by --save (for --predict).
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// Options shared by all tasks.
    #[command(flatten)]
    pub common: Common,
}

impl MfArgs {
    /// The model as saved: the factors (`rank + 1` values per row: the bias, then the factors)
    /// with the names of users and items.
    fn description<'a>(&self, data: &'a RatingsData) -> Description<'a> {
        let (cols, train) = (self.rank + 1, &data.train);
        let meta = serde_json::json!({ "rank": self.rank, "mu": data.mu, "layout": "bias, then the rank factors; rating = mu + bias_u + bias_i + factors_u · factors_i" });
        let tables =
            vec![Described { name: "users", source: 0, cols, ids: &train.user_names }, Described { name: "items", source: 1, cols, ids: &train.item_names }];
        Description { task: "mf", meta, tables }
    }
}

/// `--predict`: the ratings a saved model predicts for the pairs of a file, on stdout. A user
/// or item the model has not seen contributes nothing but the global mean (and the other's
/// bias), which is said on stderr.
pub fn predict_pairs(a: &MfArgs) -> Result<()> {
    use std::io::Write;
    let (Some(pairs), Some(dir)) = (&a.predict, &a.model) else { bail!("--predict needs --model DIR (a model saved with --save)") };
    let model = super::model::load_task(dir, "mf", "a matrix factorization")?;
    let (users, items, mu) = (model.table("users")?, model.table("items")?, model.number("mu")? as f32);
    if users.cols != items.cols || users.cols == 0 {
        bail!("{}: users have {} values per row and items {}", dir.display(), users.cols, items.cols);
    }
    let (user_rows, item_rows) = (users.index(), items.index());
    let zero = vec![0.0f32; users.cols];
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut unknown = 0usize;
    a.files.read_name_pairs(pairs, |user, item| {
        let p = user_rows.get(user).map_or(&zero[..], |&r| users.row(r));
        let q = item_rows.get(item).map_or(&zero[..], |&r| items.row(r));
        if !user_rows.contains_key(user) || !item_rows.contains_key(item) {
            unknown += 1;
        }
        writeln!(out, "{user}\t{item}\t{:.4}", predict(mu, p, q))?;
        Ok(())
    })?;
    out.flush()?;
    if unknown > 0 {
        eprintln!("{unknown} pair(s) name a user or item the model has not seen: predicted from what it knows (the global mean and known biases)");
    }
    Ok(())
}

/// The named ratings data sets.
const KNOWN: &[&str] = &["ml-100k", "synth-small", "synth-tiny"];

impl super::Task for MfArgs {
    fn name(&self) -> &'static str {
        "mf"
    }

    fn common(&self) -> &super::Common {
        &self.common
    }

    /// Driver side: makes named data available; returns a description.
    fn prepare(&self) -> Result<String> {
        self.check()?;
        self.files.check()?;
        if self.files.valid.is_some() {
            bail!("--valid: matrix factorization has no validation set (give --train and --test)");
        }
        if let (Some(train), Some(test)) = (&self.files.train, &self.files.test) {
            return Ok(format!("ratings from {} (train) and {} (test)", train.display(), test.display()));
        }
        match self.data.as_str() {
            "synth-small" => Ok("synth-small: synthetic 20 000 × 2 000 ratings, rank-10 truth, Zipf 1.1 rows and columns".into()),
            "synth-tiny" => Ok("synth-tiny: synthetic 2 000 × 200 ratings, rank-5 truth, Zipf 1.1 rows and columns".into()),
            "ml-100k" => {
                crate::data::fetch("ml-100k")?;
                Ok("MovieLens-100k, random 80/20 split".into())
            }
            path => Ok(format!("ratings from {}, random split", super::user_data(path, KNOWN, false)?.display())),
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
            "--rank".into(),
            self.rank.to_string(),
            "--lr".into(),
            self.lr.to_string(),
            "--reg".into(),
            self.reg.to_string(),
            "--test-share".into(),
            self.test_share.to_string(),
            "--batch".into(),
            self.batch.to_string(),
            "--clocks-per-epoch".into(),
            self.clocks_per_epoch.to_string(),
            "--straggle-ms".into(),
            self.straggle_ms.to_string(),
            "--intent-clocks".into(),
            self.intent_clocks.to_string(),
            "--ids".into(),
            self.ids.clone(),
        ]
        .into_iter()
        .chain(self.max_delay.iter().flat_map(|d| ["--max-delay".to_string(), d.clone()]))
        .chain(self.files.args())
        .collect()
    }

    fn train(&self, mode: Mode, emit: Sink) -> Result<()> {
        super::epochs::run(self, mode, emit)
    }

    fn run_other(&self) -> Result<bool> {
        if self.predict.is_none() {
            return Ok(false);
        }
        predict_pairs(self)?;
        Ok(true)
    }
}

impl MfArgs {
    /// Refuses options that cannot train.
    fn check(&self) -> Result<()> {
        if self.rank == 0 || self.batch == 0 {
            bail!("--rank and --batch must be at least 1");
        }
        if !(self.lr.is_finite() && self.lr > 0.0 && self.reg.is_finite() && self.reg >= 0.0) {
            bail!("--lr must be a positive number and --reg a number at least 0 (not {} and {})", self.lr, self.reg);
        }
        if !(self.test_share > 0.0 && self.test_share < 1.0) {
            bail!("--test-share must be between 0 and 1, not {}", self.test_share);
        }
        match self.ids.as_str() {
            "dense" => {}
            "raw" => {}
            other => bail!("--ids {other}: expected dense or raw"),
        }
        Ok(())
    }

    /// With --ids raw: the raw id of each user and each item index (a name that is a number is
    /// that number, any other its `ferry::feature_id` hash), refused if two names come to the
    /// same id.
    fn raw_ids(&self, train: &Ratings) -> Result<Option<[Vec<u64>; 2]>> {
        if self.ids != "raw" {
            return Ok(None);
        }
        let ids = |names: &[String], what: &str| -> Result<Vec<u64>> {
            let ids: Vec<u64> = names.iter().map(|n| n.parse::<u64>().unwrap_or_else(|_| ferry::feature_id(n))).collect();
            let mut seen = std::collections::HashMap::with_capacity(ids.len());
            for (id, name) in ids.iter().zip(names) {
                if let Some(other) = seen.insert(*id, name) {
                    bail!("--ids raw: {what} '{other}' and '{name}' have the same id {id}");
                }
            }
            Ok(ids)
        };
        Ok(Some([ids(&train.user_names, "users")?, ids(&train.item_names, "items")?]))
    }

    /// The training and test ratings (identical in every process).
    pub fn load(&self) -> Result<(Ratings, Ratings)> {
        self.check()?;
        let format = self.files.format();
        let (train, test) = match (&self.files.train, &self.files.test, self.data.as_str()) {
            (Some(train), Some(test), _) => Ratings::load_pair(train, test, format)?,
            (Some(_), None, _) | (None, Some(_), _) => bail!("give both --train and --test"),
            (None, None, "synth-small") => Synthetic::SMALL.generate(self.common.seed),
            (None, None, "synth-tiny") => Synthetic::TINY.generate(self.common.seed),
            (None, None, "ml-100k") => {
                Ratings::load(&crate::data::dataset_path("ml-100k", "ml-100k.inter"), format.with_known_header())?.split(self.test_share, self.common.seed)
            }
            (None, None, path) => Ratings::load(&super::user_data(path, KNOWN, false)?, format)?.split(self.test_share, self.common.seed),
        };
        if test.is_empty() {
            bail!("the test set is empty ({} training ratings, --test-share {}): there would be nothing to evaluate", train.len(), self.test_share);
        }
        if train.is_empty() {
            bail!("the training set is empty");
        }
        Ok((train, test))
    }
}

/// Deterministic initial value of element `j` of key `key` in table `table` (every process
/// computes the same).
pub(crate) fn initial(seed: u64, table: u64, key: u64, j: usize) -> f32 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ table.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ key.wrapping_mul(0x94D0_49BB_1331_11EB) ^ (j as u64);
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

fn factor_init(seed: u64, table: u64, key: u64, j: usize) -> f32 {
    if j == 0 { 0.0 } else { 0.1 * initial(seed, table, key, j) }
}

/// One SGD step on rating `r` for the row `p` and column `q` (`[bias, factors…]`); writes the
/// updates to `dp` and `dq` and returns the squared error before the step.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn sgd_step(mu: f32, r: f32, p: &[f32], q: &[f32], lr: f32, reg: f32, dp: &mut [f32], dq: &mut [f32]) -> f32 {
    let n = p.len();
    // Every slice cut to `n` values: the loop carries no bounds checks and vectorises.
    let (q, dp, dq) = (&q[..n], &mut dp[..n], &mut dq[..n]);
    let err = r - (mu + p[0] + q[0] + simd::dot(&p[1..], &q[1..]));
    dp[0] = lr * (err - reg * p[0]);
    dq[0] = lr * (err - reg * q[0]);
    for k in 1..n {
        dp[k] = lr * (err * q[k] - reg * p[k]);
        dq[k] = lr * (err * p[k] - reg * q[k]);
    }
    err * err
}

/// SGD on `ratings` in order, on the batch's local rows: rating `j` trains row
/// `row_of[j]` of `rows` against row `col_of[j]` of `cols` (each `dp.len()` values). Returns
/// the sum of squared errors.
#[allow(clippy::too_many_arguments)]
#[multiversion::multiversion(targets = "simd")]
fn train_ratings(
    ratings: &[Rating],
    row_of: &[usize],
    col_of: &[usize],
    rows: &mut [f32],
    cols: &mut [f32],
    mu: f32,
    lr: f32,
    reg: f32,
    dp: &mut [f32],
    dq: &mut [f32],
) -> f64 {
    let len = dp.len();
    let mut sse = 0.0f64;
    for ((r, &pu), &pi) in ratings.iter().zip(row_of).zip(col_of) {
        let p = &mut rows[pu * len..(pu + 1) * len];
        let q = &mut cols[pi * len..(pi + 1) * len];
        sse += f64::from(sgd_step(mu, r.value, p, q, lr, reg, dp, dq));
        simd::add(p, dp);
        simd::add(q, dq);
    }
    sse
}

/// Where a mini-batch's parameters come from and go to (a training thread's [`Pass`]: the
/// single mode's shared arrays, or a Ferry worker).
pub(crate) trait Params {
    /// Reads the values of `keys` of table `t` (0: rows, 1: columns) into `out`.
    fn pull(&mut self, t: usize, keys: &[u64], out: &mut [f32]) -> Result<()>;
    /// Adds `delta` to the values of `keys` of table `t`.
    fn push(&mut self, t: usize, keys: &[u64], delta: &[f32]) -> Result<()>;
}

/// The distinct keys of one table in a mini-batch, with each rating's position among them.
struct BatchKeys {
    /// Per key of the table: `(batch number << 32) | position`, to find repeats in O(1).
    stamp: Vec<u64>,
    keys: Vec<u64>,
    position: Vec<usize>,
    values: Vec<f32>,
    pulled: Vec<f32>,
}

impl BatchKeys {
    fn new(n: usize) -> BatchKeys {
        BatchKeys { stamp: vec![u64::MAX; n], keys: Vec::new(), position: Vec::new(), values: Vec::new(), pulled: Vec::new() }
    }

    fn collect(&mut self, batch: u64, keys: impl Iterator<Item = u64>) {
        self.keys.clear();
        self.position.clear();
        for k in keys {
            let s = self.stamp[k as usize];
            let at = if s >> 32 == batch && s != u64::MAX {
                (s & 0xFFFF_FFFF) as usize
            } else {
                self.stamp[k as usize] = (batch << 32) | self.keys.len() as u64;
                self.keys.push(k);
                self.keys.len() - 1
            };
            self.position.push(at);
        }
    }
}

/// Per-worker state of mini-batched SGD.
pub(crate) struct Batcher {
    rows: BatchKeys,
    cols: BatchKeys,
    batches: u64,
    dp: Vec<f32>,
    dq: Vec<f32>,
}

impl Batcher {
    pub(crate) fn new(n_rows: usize, n_cols: usize, len: usize) -> Batcher {
        Batcher { rows: BatchKeys::new(n_rows), cols: BatchKeys::new(n_cols), batches: 0, dp: vec![0.0; len], dq: vec![0.0; len] }
    }

    /// Trains on `ratings`: pulls, steps in order, pushes the changes. Returns the sum of
    /// squared errors.
    pub(crate) fn run(&mut self, ratings: &[Rating], len: usize, mu: f32, lr: f32, reg: f32, params: &mut dyn Params) -> Result<f64> {
        self.batches = (self.batches + 1) & 0x7FFF_FFFF;
        self.rows.collect(self.batches, ratings.iter().map(|r| u64::from(r.user)));
        self.cols.collect(self.batches, ratings.iter().map(|r| u64::from(r.item)));
        for (b, t) in [(&mut self.rows, 0), (&mut self.cols, 1)] {
            b.values.resize(b.keys.len() * len, 0.0);
            params.pull(t, &b.keys, &mut b.values)?;
            b.pulled.clear();
            b.pulled.extend_from_slice(&b.values);
        }
        self.dp.resize(len, 0.0);
        self.dq.resize(len, 0.0);
        let (rows, cols) = (&mut self.rows, &mut self.cols);
        let sse = train_ratings(ratings, &rows.position, &cols.position, &mut rows.values, &mut cols.values, mu, lr, reg, &mut self.dp, &mut self.dq);
        for (b, t) in [(&mut self.rows, 0), (&mut self.cols, 1)] {
            simd::sub(&mut b.values, &b.pulled);
            params.push(t, &b.keys, &b.values)?;
        }
        Ok(sse)
    }
}

/// A cluster thread's parameters: with --ids raw, the trainer's user and item numbers become
/// their raw ids on the way to the dynamic tables.
struct Keyed<'k, 'p> {
    pass: &'k mut Pass<'p>,
    raw: Option<&'k [Vec<u64>; 2]>,
    buf: &'k mut Vec<u64>,
}

impl Keyed<'_, '_> {
    /// The table keys of `keys` of table `t`: themselves, or their raw ids in the buffer.
    fn keys<'s>(buf: &'s mut Vec<u64>, raw: Option<&[Vec<u64>; 2]>, t: usize, keys: &'s [u64]) -> &'s [u64] {
        match raw {
            None => keys,
            Some(raw) => {
                buf.clear();
                buf.extend(keys.iter().map(|&k| raw[t][k as usize]));
                buf
            }
        }
    }
}

impl Params for Keyed<'_, '_> {
    fn pull(&mut self, t: usize, keys: &[u64], out: &mut [f32]) -> Result<()> {
        let keys = Keyed::keys(self.buf, self.raw, t, keys);
        self.pass.pull(t, keys, out)
    }

    fn push(&mut self, t: usize, keys: &[u64], delta: &[f32]) -> Result<()> {
        let keys = Keyed::keys(self.buf, self.raw, t, keys);
        self.pass.push(t, keys, delta)
    }
}

/// The key of user or item number `k` in table `t`: itself, or with --ids raw its raw id.
fn table_key(raw: Option<&[Vec<u64>; 2]>, t: usize, k: u64) -> u64 {
    raw.map_or(k, |raw| raw[t][k as usize])
}

impl Params for Pass<'_> {
    fn pull(&mut self, t: usize, keys: &[u64], out: &mut [f32]) -> Result<()> {
        Pass::pull(self, t, keys, out)
    }

    fn push(&mut self, t: usize, keys: &[u64], delta: &[f32]) -> Result<()> {
        Pass::push(self, t, keys, delta)
    }
}

#[inline]
fn predict(mu: f32, p: &[f32], q: &[f32]) -> f32 {
    mu + p[0] + q[0] + p[1..].iter().zip(&q[1..]).map(|(a, b)| a * b).sum::<f32>()
}

/// One training rating, stored with its cell's others: a worker reads a shuffled cell front to
/// back, so keeping user, item and value together makes that one sequential stream instead of
/// three loads at random places of the data set per rating.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rating {
    user: u32,
    item: u32,
    value: f32,
}

/// The column block of `item` out of `blocks`: items are dealt out in turn rather than cut into
/// contiguous ranges. Item numbers follow first appearance in the data, so the popular items
/// come first, and contiguous ranges put most ratings in block 0 (ml-100k, 2 nodes: 86 % of
/// the ratings in the two sub-epochs' larger cells, where dealing puts 54 %); every node then
/// waits in the barrier for the one whose cell is heavy.
fn column_block(item: u32, blocks: usize) -> usize {
    item as usize % blocks.max(1)
}

/// The items of column block `block` out of `blocks` (see [`column_block`]).
fn column_block_items(n_items: u32, blocks: usize, block: usize) -> Vec<u64> {
    (block as u64..u64::from(n_items)).step_by(blocks.max(1)).collect()
}

/// The training ratings of row stratum `stratum` of `strata` over `rows`, per column block.
fn cells(train: &Ratings, rows: std::ops::Range<usize>, strata: usize, stratum: usize, blocks: usize) -> Vec<Vec<Rating>> {
    let mut cells = vec![Vec::new(); blocks];
    for i in 0..train.len() {
        let u = train.users[i] as usize;
        if !rows.contains(&u) || part_of(u - rows.start, rows.len(), strata) != stratum {
            continue;
        }
        let block = column_block(train.items[i], blocks);
        cells[block].push(Rating { user: train.users[i], item: train.items[i], value: train.values[i] });
    }
    cells
}

/// The training and test ratings, and the mean rating.
pub struct RatingsData {
    train: Ratings,
    test: Ratings,
    mu: f32,
    /// With --ids raw: the raw id of each user index and of each item index.
    raw: Option<[Vec<u64>; 2]>,
}

impl MfArgs {
    /// The bounded delay `τ` of `--max-delay` in `mode` (`None`: none; `Some(None)`: `inf`).
    fn max_delay(&self, mode: Mode) -> Result<Option<Option<u64>>> {
        match &self.max_delay {
            None => Ok(None),
            Some(_) if mode == Mode::Single => Ok(None),
            Some(_) if mode != Mode::Classic => {
                bail!("--max-delay works in classic mode: localize and hybrid need the sub-epoch barriers that keep blocks apart")
            }
            Some(_) if self.clocks_per_epoch == 0 => bail!("--clocks-per-epoch must be at least 1"),
            Some(d) => Ok(Some(ferry::parse_max_delay(d).map_err(|e| anyhow::anyhow!("--max-delay: {e}"))?)),
        }
    }
}

impl Workload for MfArgs {
    type Data = RatingsData;

    fn load(&self) -> Result<RatingsData> {
        let (train, test) = MfArgs::load(self)?;
        let mu = train.mean();
        let raw = self.raw_ids(&train)?;
        Ok(RatingsData { train, test, mu, raw })
    }

    fn model(&self, data: &RatingsData, mode: Mode) -> Result<Model> {
        let (seed, len, train) = (self.common.seed, self.rank + 1, &data.train);
        if mode == Mode::Intent && self.intent_clocks == 0 {
            bail!("--intent-clocks must be at least 1");
        }
        let max_delay = self.max_delay(mode)?;
        let mut notes = Vec::new();
        let mut item_spec = self.common.on_the_wire(TableSpec::new("items", train.n_items as u64, len))?;
        let mut hot_items = Vec::new();
        if mode == Mode::Hybrid {
            // Column keys the frequency heuristic finds hot are replicated (with the default
            // factor of 100, none on MovieLens: its most rated film has about ten times the mean).
            let mut counts = ferry::AccessCounts::new(train.n_items as u64);
            for &i in &train.items {
                counts.add(i as u64, 1);
            }
            let hot = self.common.hot_keys(&counts);
            notes.push(format!("hybrid: {} of {} items replicated ({:.1}% of accesses)", hot.len(), train.n_items, 100.0 * counts.share(&hot)));
            item_spec = item_spec.replicating(ferry::as_ranges(&hot));
            hot_items = hot;
        }
        if let Some(tau) = max_delay {
            notes.push(format!("bounded delay: τ = {}, {} clocks per epoch", tau.map_or("∞".to_string(), |t| t.to_string()), self.clocks_per_epoch));
        }
        if data.raw.is_some() && mode != Mode::Single {
            // Dynamic tables with room for twice each node's share of the ids (homes by a hash
            // differ by about the square root), each id created when first touched: localize
            // mode's first localize of a node's users creates them there, as the dense tables
            // hold every user and item from the start. Every element starts uniform in ±0.1
            // from a hash of the id (the bias too: a dynamic table's rule is one for the row).
            let nodes = self.common.nodes.max(1) as u64;
            // Hybrid: the hot items (above) replicated by their raw ids.
            let replicated = |table: u64| -> Vec<u64> {
                match (&data.raw, table) {
                    (Some(raw), 1) => hot_items.iter().map(|&i| raw[1][i as usize]).collect(),
                    _ => Vec::new(),
                }
            };
            let dynamic = |name: &str, n: u32, table: u64| -> Result<ModelTable> {
                let spec = TableSpec::dynamic(name, len, (2 * u64::from(n)).div_ceil(nodes).max(64))
                    .initialised(ferry::dynamic::Init::Uniform { scale: 0.1, seed: seed ^ table })
                    .replicating_ids(replicated(table));
                Ok(ModelTable::zeros(self.common.on_the_wire(spec)?.partitioned(ferry::Partitioning::Range)))
            };
            notes.push(format!("raw ids: {} users and {} items in two dynamic tables", train.n_users, train.n_items));
            return Ok(Model { tables: vec![dynamic("users", train.n_users, 0)?, dynamic("items", train.n_items, 1)?], notes });
        }
        let tables = vec![
            ModelTable::init(self.common.on_the_wire(TableSpec::new("users", train.n_users as u64, len))?, move |k, j| factor_init(seed, 0, k, j)),
            ModelTable::init(item_spec, move |k, j| factor_init(seed, 1, k, j)),
        ];
        Ok(Model { tables, notes })
    }

    fn configure(&self, config: &mut ferry::Config, mode: Mode) -> Result<()> {
        // Bounded delay: clocks instead of sub-epoch barriers (only where no block must be
        // exclusive, i.e. in classic mode).
        if let Some(tau) = self.max_delay(mode)? {
            config.max_delay = tau;
        }
        Ok(())
    }

    fn trainer<'a>(&'a self, data: &'a RatingsData, pass: &mut Pass<'_>) -> Result<Box<dyn Trainer + 'a>> {
        let (train, len) = (&data.train, self.rank + 1);
        let batcher = Batcher::new(train.n_users as usize, train.n_items as usize, len);
        if pass.mode == Mode::Single {
            // The same schedule over threads: thread `t` trains row stratum `t` of every user,
            // in its cell of each column block in turn.
            let cells = cells(train, 0..train.n_users as usize, pass.threads, pass.thread, pass.threads);
            let test = (pass.thread..data.test.len()).step_by(pass.threads).map(|i| i as u32).collect();
            return Ok(Box::new(MfTrainer { a: self, data, cells, batcher, raw: None, raw_keys: Vec::new(), rng: None, test, node: None }));
        }
        let (rank, nodes, t, threads) = (pass.rank, pass.nodes, pass.thread, pass.threads);
        let my_rows = part(train.n_users as usize, nodes, rank);
        let cells = cells(train, my_rows.clone(), threads, t, nodes);
        // Test error of this thread's share of the node's test ratings.
        let test = (0..data.test.len() as u32).filter(|&i| my_rows.contains(&(data.test.users[i as usize] as usize))).skip(t).step_by(threads).collect();
        let (localize, intent) = (matches!(pass.mode, Mode::Localize | Mode::Hybrid), pass.mode == Mode::Intent);
        let distinct = |ids: &mut dyn Iterator<Item = u32>| -> Vec<u64> {
            let mut v: Vec<u64> = ids.map(u64::from).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        // Intent mode: the users this thread trains and the items of each block it touches.
        // (Table keys: with --ids raw, the items' raw ids.)
        let my_items: Vec<Vec<u64>> = if intent {
            (0..nodes).map(|b| distinct(&mut cells[b].iter().map(|r| r.item)).into_iter().map(|i| table_key(data.raw.as_ref(), 1, i)).collect()).collect()
        } else {
            Vec::new()
        };
        let (w, tables) = pass.node().expect("a cluster's pass has a worker");
        if localize && t == 0 {
            // Data clustering: this node's rows stay here for the whole run.
            let rows: Vec<u64> = my_rows.map(|u| table_key(data.raw.as_ref(), 0, u as u64)).collect();
            w.localize(tables[0], &rows)?;
        }
        if intent {
            // The trainer only says what it will need: its users throughout, and the first
            // sub-epoch's items in its first clocks (counted from the clock it starts in, which
            // a resumed run takes from its checkpoint).
            let my_users: Vec<u64> = distinct(&mut cells.iter().flatten().map(|r| r.user)).into_iter().map(|u| table_key(data.raw.as_ref(), 0, u)).collect();
            let base = w.current_clock();
            w.intent(tables[0], &my_users, base, u64::MAX)?;
            w.intent(tables[1], &my_items[rank % nodes], base, base + self.intent_clocks)?;
        }
        let rng = ChaCha8Rng::seed_from_u64(self.common.seed ^ ((rank as u64) << 40) ^ t as u64);
        let node = NodeSchedule { localize, intent, max_delay: self.max_delay(pass.mode)?.is_some(), my_items };
        Ok(Box::new(MfTrainer { a: self, data, cells, batcher, raw: data.raw.as_ref(), raw_keys: Vec::new(), rng: Some(rng), test, node: Some(node) }))
    }

    fn reads_model(&self, epoch: usize) -> bool {
        self.common.save_now(epoch)
    }

    fn describe<'a>(&self, data: &'a RatingsData) -> Option<Description<'a>> {
        Some(self.description(data))
    }

    fn evaluate(
        &self,
        data: &RatingsData,
        epoch: usize,
        model: &mut ModelReader<'_>,
        sums: &Fields,
        _: Measured,
        _: &(dyn Fn(Event) + Sync),
    ) -> Result<Quality> {
        if self.common.save_now(epoch) {
            let d = self.description(data);
            let tables = [saved_table(&d, data, model, 0, self.rank + 1)?, saved_table(&d, data, model, 1, self.rank + 1)?];
            self.common.save_model(&d, epoch, &tables)?;
        }
        let mut quality = Quality::new();
        let count = (sums[field::TEST_COUNT] as f64).max(1.0);
        quality.insert("rmse".into(), (sums[field::TEST_SSE] as f64 / count).sqrt().into());
        quality.insert("mae".into(), (sums[field::TEST_AE] as f64 / count).into());
        Ok(quality)
    }
}

/// Table `t` of the model as saved (`len` values per key): every key's row, or with --ids raw
/// in a cluster the rows of the ids the dynamic table holds (read without creating any).
fn saved_table(d: &Description<'_>, data: &RatingsData, model: &mut ModelReader<'_>, t: usize, len: usize) -> Result<super::model::SavedTable> {
    if let Some(raw) = &data.raw
        && let Some((values, held)) = model.held_rows(t, &raw[t])?
    {
        return Ok(d.saved_held(t, &values, len, &held));
    }
    Ok(d.saved(t, &model.all(t)?, len))
}

/// What a cluster thread does besides the blocks' SGD.
struct NodeSchedule {
    localize: bool,
    intent: bool,
    /// Bounded delay: clocks instead of sub-epoch barriers.
    max_delay: bool,
    /// Intent mode: the items of each column block this thread touches.
    my_items: Vec<Vec<u64>>,
}

/// One thread's DSGD: its row stratum's cells of every column block, one block per sub-epoch.
struct MfTrainer<'a> {
    a: &'a MfArgs,
    data: &'a RatingsData,
    /// Per column block: this thread's ratings in it.
    cells: Vec<Vec<Rating>>,
    batcher: Batcher,
    /// With --ids raw in a cluster: the raw id of each user and item number, and a buffer of
    /// a call's raw ids.
    raw: Option<&'a [Vec<u64>; 2]>,
    raw_keys: Vec<u64>,
    /// A cluster thread's generator, kept across epochs (`single` draws one per epoch).
    rng: Option<ChaCha8Rng>,
    /// This thread's share of the test ratings.
    test: Vec<u32>,
    node: Option<NodeSchedule>,
}

impl MfTrainer<'_> {
    /// `single`: DSGD over the threads and the shared arrays.
    fn single_epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<(f64, usize)> {
        let (a, t, threads) = (self.a, pass.thread, pass.threads);
        let (len, mu) = (a.rank + 1, self.data.mu);
        let mut rng = ChaCha8Rng::seed_from_u64(a.common.seed ^ ((epoch as u64) << 20) ^ t as u64);
        let (mut loss, mut n) = (0.0f64, 0usize);
        for sub in 0..threads {
            let mut order = self.cells[(t + sub) % threads].clone();
            order.shuffle(&mut rng);
            for (x, batch) in order.chunks(a.batch.max(1)).enumerate() {
                loss += self.batcher.run(batch, len, mu, a.lr, a.reg, pass)?;
                n += batch.len();
                if x.is_multiple_of(64) {
                    pass.progress(epoch, (sub as f64 + n as f64 / order.len().max(1) as f64 / (sub + 1) as f64) / threads as f64);
                }
            }
            // The last sub-epoch's barrier is the loop's.
            if sub + 1 < threads {
                pass.barrier()?;
            }
        }
        Ok((loss, n))
    }

    /// A cluster thread: bounded-delay clocks, or the sub-epochs' blocks with their localizes
    /// or intents.
    fn node_epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<(f64, usize)> {
        let (a, rank, nodes, t) = (self.a, pass.rank, pass.nodes, pass.thread);
        let (len, mu, k) = (a.rank + 1, self.data.mu, a.intent_clocks);
        let node = self.node.as_ref().expect("a cluster thread's schedule");
        let (localize, intent) = (node.localize, node.intent);
        let rng = self.rng.as_mut().expect("a cluster thread's generator");
        let (mut loss, mut n) = (0.0f64, 0usize);
        if node.max_delay {
            // All of this worker's ratings, in clocks_per_epoch clocks.
            let mut order: Vec<Rating> = self.cells.iter().flatten().copied().collect();
            order.shuffle(rng);
            let clocks = a.clocks_per_epoch;
            for c in 0..clocks {
                if a.straggle_ms > 0 && rng.gen_range(0..nodes) == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(a.straggle_ms));
                }
                let share = &order[c * order.len() / clocks..(c + 1) * order.len() / clocks];
                for batch in share.chunks(a.batch.max(1)) {
                    loss += self.batcher.run(batch, len, mu, a.lr, a.reg, &mut Keyed { pass, raw: self.raw, buf: &mut self.raw_keys })?;
                    n += batch.len();
                }
                pass.progress(epoch, (c + 1) as f64 / clocks as f64);
                pass.node().expect("a cluster's pass has a worker").0.advance_clock()?;
            }
            return Ok((loss, n));
        }
        for sub in 0..nodes {
            let block = (rank + sub) % nodes;
            if localize && t == 0 {
                let keys: Vec<u64> = column_block_items(self.data.train.n_items, nodes, block).into_iter().map(|i| table_key(self.raw, 1, i)).collect();
                let (w, tables) = pass.node().expect("a cluster's pass has a worker");
                w.localize(tables[1], &keys)?;
            }
            pass.local_barrier();
            let mut order = self.cells[block].clone();
            order.shuffle(rng);
            if intent {
                // The next sub-epoch's items, for the next sub-epoch's clocks (after this
                // sub-epoch's k clocks and the barrier's).
                let next = (rank + sub + 1) % nodes;
                let (w, tables) = pass.node().expect("a cluster's pass has a worker");
                let base = w.current_clock();
                w.intent(tables[1], &node.my_items[next], base + k + 1, base + 2 * k + 1)?;
            }
            let clocks = if intent { k as usize } else { 1 };
            for c in 0..clocks {
                let share = &order[c * order.len() / clocks..(c + 1) * order.len() / clocks];
                for (x, batch) in share.chunks(a.batch.max(1)).enumerate() {
                    loss += self.batcher.run(batch, len, mu, a.lr, a.reg, &mut Keyed { pass, raw: self.raw, buf: &mut self.raw_keys })?;
                    n += batch.len();
                    if x.is_multiple_of(64) {
                        let done = (c * order.len() / clocks + x * a.batch) as f64 / order.len().max(1) as f64;
                        pass.progress(epoch, (sub as f64 + done) / nodes as f64);
                    }
                }
                if intent {
                    pass.node().expect("a cluster's pass has a worker").0.advance_clock()?;
                }
            }
            // The last sub-epoch's barrier is the loop's (its clock, in intent mode, is taken in
            // `measure`, right after it).
            if sub + 1 < nodes {
                pass.barrier()?;
                if intent {
                    // The barrier is a clock of its own: a node waiting in it has finished its
                    // block and does not need the next one yet, so the homes see the block's
                    // current user release it before its next user needs it, and move it
                    // instead of replicating it on the way.
                    pass.node().expect("a cluster's pass has a worker").0.advance_clock()?;
                }
            }
        }
        Ok((loss, n))
    }
}

impl Trainer for MfTrainer<'_> {
    fn epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<Fields> {
        let (loss, n) = if self.node.is_some() { self.node_epoch(epoch, pass)? } else { self.single_epoch(epoch, pass)? };
        let mut v = [0.0f32; METRIC_FIELDS];
        v[field::LOSS] = loss as f32;
        v[field::EXAMPLES] = n as f32;
        Ok(v)
    }

    /// The last sub-epoch's barrier clock (intent mode), then the squared error of this
    /// thread's share of the test ratings.
    fn measure(&mut self, _: usize, pass: &mut Pass<'_>) -> Result<Fields> {
        if self.node.as_ref().is_some_and(|n| n.intent && !n.max_delay) {
            pass.node().expect("a cluster's pass has a worker").0.advance_clock()?;
        }
        let (test, len, mu) = (&self.data.test, self.a.rank + 1, self.data.mu);
        let (mut sse, mut ae) = (0.0f64, 0.0f64);
        for chunk in self.test.chunks(1024) {
            let us: Vec<u64> = chunk.iter().map(|&i| test.users[i as usize] as u64).collect();
            let is: Vec<u64> = chunk.iter().map(|&i| test.items[i as usize] as u64).collect();
            let (mut pu, mut qi) = (vec![0.0; us.len() * len], vec![0.0; is.len() * len]);
            let mut params = Keyed { pass, raw: self.raw, buf: &mut self.raw_keys };
            params.pull(0, &us, &mut pu)?;
            params.pull(1, &is, &mut qi)?;
            for (j, &i) in chunk.iter().enumerate() {
                let e = (test.values[i as usize] - predict(mu, &pu[j * len..(j + 1) * len], &qi[j * len..(j + 1) * len])) as f64;
                sse += e * e;
                ae += e.abs();
            }
        }
        let mut v = [0.0f32; METRIC_FIELDS];
        v[field::TEST_SSE] = sse as f32;
        v[field::TEST_AE] = ae as f32;
        v[field::TEST_COUNT] = self.test.len() as f32;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_blocks_deal_every_item_to_exactly_one_block() {
        for (n_items, blocks) in [(1682u32, 2usize), (10, 3), (5, 4), (3, 8)] {
            let mut seen = vec![0u32; n_items as usize];
            for b in 0..blocks {
                for item in column_block_items(n_items, blocks, b) {
                    assert_eq!(column_block(item as u32, blocks), b, "item {item} listed in block {b}");
                    seen[item as usize] += 1;
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{n_items} items over {blocks} blocks: {seen:?}");
        }
    }

    #[test]
    fn popular_first_items_spread_over_the_blocks() {
        // Ratings concentrated on the first items (as in data numbered by first appearance):
        // contiguous halves would give block 0 all of them; dealt out, each block gets half.
        let mut train = Ratings::default();
        for i in 0..100u32 {
            train.users.push(i % 10);
            train.items.push(i % 20);
            train.values.push(1.0);
        }
        (train.n_users, train.n_items) = (10, 200);
        let cells = cells(&train, 0..10, 1, 0, 2);
        assert_eq!((cells[0].len(), cells[1].len()), (50, 50));
    }
}
