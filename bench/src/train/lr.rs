//! Sparse logistic regression with a server-side optimizer (the parameter server's Sections 3.3,
//! 3.6 and 4.2, and its sparse logistic regression workload, Section 5.1).
//!
//! One key per feature plus one for the bias, each a single float. Workers take mini-batches of
//! their share of the examples, pull the weights of the batch's features, and push the gradient
//! of the batch's mean log loss; Ferry applies AdaGrad (with the L2 penalty added to the
//! gradient by the worker) or FTRL-proximal (L1 and L2 in the updater) where each weight is held.
//! With `--optimizer-at worker` (the default in `intent` and `hybrid` modes) AdaGrad runs in the
//! trainer instead: a key's value is `[weight, accumulator]` and the push is the step and the
//! squared gradient, additive, so that keys several nodes need can be replicated (AdaPM 4.1;
//! `hybrid` replicates, with `--plan`, the weights that two or more nodes' examples share, and
//! otherwise those NuPS's heuristic finds hot, `--hot-factor`/`--replicate`).
//! `--filter` holds back insignificant updates ([`ferry::filter`]), `--codec` compresses values
//! on the wire, `--key-cache` sends repeated key lists by hash (each worker's mini-batches are
//! drawn once and revisited every epoch in a new order, so their key lists repeat). Quality: log
//! loss and AUC on the held-out examples, against scikit-learn's `LogisticRegression` on the
//! same split (`--sklearn`).

use anyhow::{Context, Result, bail};
use clap::Args;
use ferry::filter::{FilteredPusher, Kkt, PushFilter, Significance};
use ferry::{TableSpec, Updater};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::ahead::AheadCursor;
use super::checkpoint_model::{Described, Description};
use super::epochs::{Fields, Measured, Model, ModelReader, ModelTable, Pass, Quality, Trainer, Workload};
use super::shared::{METRIC_FIELDS, field, leading_columns};
use super::{Common, Event, Mode, Sink};
use crate::data::sparse::{Examples, load_labelled_text, load_libsvm};

/// Options of `train lr`.
#[derive(Debug, Clone, Args)]
pub struct LrArgs {
    /// Data: `agaricus` (LIBSVM), `criteo-small` (libffm), `spam` (SpamAssassin e-mails, hashed
    /// bag of words), `wordnet-pos` (WordNet's 117 659 glosses, hashed bag of words: is it a
    /// noun's?), `synth-lr` and `synth-lr-skewed` (generated, for tests: features alike, or
    /// Zipf-distributed), a LIBSVM/libffm file (split 80/20), or a
    /// directory with `train.libsvm` and `test.libsvm`. --train and --test give files instead.
    #[arg(long, default_value = "agaricus")]
    pub data: String,
    /// Training examples (LIBSVM or libffm), with --test.
    #[arg(long, requires = "test")]
    pub train: Option<std::path::PathBuf>,
    /// Held-out examples, with --train.
    #[arg(long, requires = "train")]
    pub test: Option<std::path::PathBuf>,
    /// Hash features into 2^bits keys (default: 18 for `spam` and `wordnet-pos`, none for
    /// LIBSVM files).
    #[arg(long, conflicts_with = "hash_buckets")]
    pub hash_bits: Option<u32>,
    /// Feature hashing into this many keys with Ferry's seeded hash (`ferry::FeatureHashing`,
    /// the seed from --seed), any count from 1 to 2^32: the model's size.
    #[arg(long)]
    pub hash_buckets: Option<u64>,
    /// With --hash-buckets: each feature also gets a sign, so that colliding features cancel
    /// in expectation instead of adding up.
    #[arg(long, requires = "hash_buckets")]
    pub hash_signed: bool,
    /// How features key the weights in cluster modes: `dense` (feature indices, or the buckets
    /// of --hash-bits/--hash-buckets, as keys of a table of that many) or `raw` (each feature's
    /// raw id — a LIBSVM index, a word's 62-bit hash — keys a dynamic table, created at its
    /// first push: docs/DYNAMIC.md). `single` stores the same model densely.
    #[arg(long, default_value = "dense")]
    pub ids: String,
    /// With --ids raw: the ids each node holds as their home, as a share of the training data's
    /// distinct ids over the nodes (0.25: room for a quarter of them in the cluster).
    #[arg(long, default_value_t = 2.0)]
    pub capacity_share: f64,
    /// With --ids raw: when the dynamic table evicts ids (`never`, `lfu`, `ttl:SECONDS`).
    #[arg(long, default_value = "lfu")]
    pub eviction: String,
    /// With --ids raw: which new ids the dynamic table creates: `count:N` at an id's N-th push,
    /// `probability:P[:SEED]` at a push with probability P, `all` at its first pull or push.
    /// The evaluation and --save create none.
    #[arg(long, default_value = "count:1")]
    pub admission: String,
    /// Optimizer: `adagrad` or `ftrl`.
    #[arg(long, default_value = "adagrad")]
    pub optimizer: String,
    /// Where AdaGrad runs in cluster modes: `server` (Ferry applies it where each weight is
    /// held; the accumulators never travel), `worker` (the trainer computes the step; each value
    /// carries its accumulator, and pushes are additive, so keys can be replicated), or `auto`:
    /// worker in `intent` and `hybrid` modes (without --filter), server otherwise. FTRL always runs
    /// server-side.
    #[arg(long, default_value = "auto")]
    pub optimizer_at: String,
    /// AdaGrad's learning rate, or FTRL's α.
    #[arg(long, default_value_t = 0.1)]
    pub lr: f32,
    /// L2 penalty λ₂ of the objective `mean log loss + λ₂/2 ‖w‖² + λ₁ ‖w‖₁`.
    #[arg(long, default_value_t = 1e-4)]
    pub l2: f32,
    /// L1 penalty λ₁ (FTRL only).
    #[arg(long, default_value_t = 0.0)]
    pub l1: f32,
    /// Examples per mini-batch.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Intent mode: how many mini-batches (clocks) ahead a worker declares the weights it
    /// will need (across epochs: the next epoch's first batches during this epoch's last). A
    /// mini-batch takes about 5 ms on spam, and a weight's way to a node (moved, or a replica
    /// made) takes several on shared cores: 32 left 0.06–0.2 % of accesses late on 2 nodes, 8
    /// left 1–1.5 %, both before the declarations ran on across epochs; since, 32 leaves about
    /// 0.03 %.
    #[arg(long, default_value_t = 32)]
    pub intent_ahead: usize,
    /// Push filter in cluster modes: `none`, `significance:T` (send a weight's accumulated
    /// update once it reaches T × the weight), or `kkt` (hold back gradients of zero weights
    /// within the L1 penalty).
    #[arg(long, default_value = "none")]
    pub filter: String,
    /// Cluster modes: train where a plan of `ferry partition` says (data–parameter
    /// co-partitioning): each node trains the examples the plan gives it, and each weight is
    /// homed at the node the plan names. The plan must be for --nodes and made from the same
    /// data and loader options (--data or --train/--test, --hash-*, --seed). In hybrid mode
    /// (unless --replicate says how many) the weights that the examples of two or more nodes
    /// touch are replicated on every node, so that every access is local and only the
    /// replicas' syncs travel.
    #[arg(long, conflicts_with = "arrivals")]
    pub plan: Option<std::path::PathBuf>,
    /// Cluster modes classic and localize: the training examples arrive in this many parts, one
    /// more at the start of each epoch (epoch e trains on the first min(e, K) parts), dealt
    /// round robin to the workers (see --place-arrivals). `single` trains on all of them.
    #[arg(long, default_value_t = 1)]
    pub arrivals: usize,
    /// With --arrivals: a one-pass stream: each epoch trains on the part that arrives at its
    /// start only, never again on earlier parts (at most --arrivals epochs; cluster modes).
    #[arg(long, requires = "arrivals")]
    pub stream: bool,
    /// With --arrivals: co-partition as the examples arrive (Duan and Wu 4.2): the weights are
    /// placed by a plan of the first part, and each arrival's examples go to the nodes that
    /// hold their keys. Every node computes the same from the same data.
    #[arg(long, requires = "arrivals")]
    pub place_arrivals: bool,
    /// With --place-arrivals: at each arrival also move keys where a move gains more than
    /// --move-cost (Algorithm 4), by relocation, which the cluster then runs with (in classic
    /// mode too, with location caches so that batches find moved keys without a forward by
    /// their homes).
    #[arg(long, requires = "place_arrivals")]
    pub reallocate: bool,
    /// With --reallocate: what a key's relocation costs, in remote accesses per epoch.
    #[arg(long, default_value_t = 2.0)]
    pub move_cost: f64,
    /// After training, fit scikit-learn's LogisticRegression on the same split (in a throwaway
    /// virtual environment) and print both.
    #[arg(long)]
    pub sklearn: bool,
    /// Options shared by all tasks.
    #[command(flatten)]
    pub common: Common,
}

/// The options besides `--data` and `--seed` that decide which examples `train lr` loads, as
/// arguments: `--train`/`--test` and the hashing's (for the cluster's processes, and for
/// `ferry partition`, which must load the same examples).
pub(super) fn loader_args(
    train: &Option<std::path::PathBuf>,
    test: &Option<std::path::PathBuf>,
    hash_bits: Option<u32>,
    hash_buckets: Option<u64>,
    hash_signed: bool,
) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(b) = hash_bits {
        args.extend(["--hash-bits".into(), b.to_string()]);
    }
    if let Some(m) = hash_buckets {
        args.extend(["--hash-buckets".into(), m.to_string()]);
    }
    if hash_signed {
        args.push("--hash-signed".into());
    }
    if let (Some(train), Some(test)) = (train, test) {
        args.extend(["--train".into(), train.display().to_string(), "--test".into(), test.display().to_string()]);
    }
    args
}

/// AdaGrad's ε (server- and worker-side alike).
const ADAGRAD_EPS: f32 = 1e-8;

const KNOWN: &[&str] = &["agaricus", "criteo-small", "spam", "wordnet-pos", "synth-lr", "synth-lr-skewed"];

/// The split: training and held-out examples, and the number of feature keys (the bias is key
/// `dims`).
pub struct Split {
    /// Training examples.
    pub train: Examples,
    /// Held-out examples.
    pub test: Examples,
    /// Feature keys.
    pub dims: u64,
    /// The co-partitioning plan of --plan, checked against the training examples.
    pub plan: Option<ferry::copartition::Plan>,
    /// With --place-arrivals: the plan of the first part of the examples.
    pub arrival_plan: Option<ferry::copartition::Plan>,
    /// With --ids raw: the raw id of each feature key (the examples' features are renumbered
    /// densely, so that `single` and the evaluation index arrays).
    pub raw: Option<Vec<u64>>,
    /// With --save or --checkpoint-dir: the id of each key in a saved model (a feature key's
    /// number, or with --ids raw its raw id; the bias's is [`BIAS_NAME`] or [`BIAS_ID`]).
    pub names: Vec<String>,
}

/// The bias's id in a saved model of dense keys.
const BIAS_NAME: &str = "bias";

/// With --ids raw: the bias's id (no feature's: raw ids are LIBSVM indices or 62-bit hashes).
const BIAS_ID: u64 = u64::MAX;

impl Split {
    /// The training examples' keys (each example's features and the bias, key `dims`): the
    /// graph `ferry partition` co-partitions.
    pub fn incidence(&self) -> Result<ferry::copartition::Incidence> {
        self.incidence_of(0..self.train.len())
    }

    /// The same graph of the training examples `examples` only.
    pub fn incidence_of(&self, examples: std::ops::Range<usize>) -> Result<ferry::copartition::Incidence> {
        let mut graph = ferry::copartition::Incidence::new(self.dims + 1)?;
        for i in examples {
            graph.push_example(self.train.row(i).0.iter().copied().chain([self.dims]))?;
        }
        Ok(graph)
    }
}

impl super::Task for LrArgs {
    fn name(&self) -> &'static str {
        "lr"
    }

    fn common(&self) -> &super::Common {
        &self.common
    }

    /// Driver side: makes named data available; returns a description.
    fn prepare(&self) -> Result<String> {
        self.validate()?;
        let data = if let (Some(train), Some(test)) = (&self.train, &self.test) {
            format!("examples from {} (train) and {} (test)", train.display(), test.display())
        } else {
            match self.data.as_str() {
                "agaricus" | "criteo-small" | "spam" | "wordnet-pos" => {
                    crate::data::fetch(if self.data == "wordnet-pos" { "wordnet" } else { &self.data })?;
                    match self.data.as_str() {
                        "spam" if self.hash_buckets.is_none() => {
                            format!("spam: SpamAssassin e-mails, bag of words hashed into 2^{} features, split 80/20", self.spam_bits())
                        }
                        "spam" => "spam: SpamAssassin e-mails, bag of words, split 80/20".into(),
                        "wordnet-pos" if self.hash_buckets.is_none() => {
                            format!("wordnet-pos: WordNet's glosses, noun or not, bag of words hashed into 2^{} features, split 80/20", self.spam_bits())
                        }
                        "wordnet-pos" => "wordnet-pos: WordNet's glosses, noun or not, bag of words, split 80/20".into(),
                        name => format!("{name} (xlearn's train/test files)"),
                    }
                }
                "synth-lr" => "synth-lr: 4 000 generated sparse examples of a planted linear model".into(),
                "synth-lr-skewed" => "synth-lr-skewed: 4 000 generated sparse examples of a planted linear model, feature frequencies Zipf-distributed".into(),
                path => format!("examples from {}", super::user_data(path, KNOWN, true)?.display()),
            }
        };
        Ok(data + &self.hashing_note())
    }

    fn check_data(&self) -> Result<()> {
        Workload::load(self).map(drop)
    }

    /// The task's options as command-line arguments (for the cluster's processes).
    fn task_args(&self) -> Vec<String> {
        let mut args = vec![
            "--data".into(),
            self.data.clone(),
            "--optimizer".into(),
            self.optimizer.clone(),
            "--optimizer-at".into(),
            self.optimizer_at.clone(),
            "--lr".into(),
            self.lr.to_string(),
            "--l2".into(),
            self.l2.to_string(),
            "--l1".into(),
            self.l1.to_string(),
            "--batch".into(),
            self.batch.to_string(),
            "--filter".into(),
            self.filter.clone(),
            "--intent-ahead".into(),
            self.intent_ahead.to_string(),
            "--ids".into(),
            self.ids.clone(),
            "--capacity-share".into(),
            self.capacity_share.to_string(),
            "--eviction".into(),
            self.eviction.clone(),
            "--admission".into(),
            self.admission.clone(),
        ];
        args.extend(loader_args(&self.train, &self.test, self.hash_bits, self.hash_buckets, self.hash_signed));
        if let Some(plan) = &self.plan {
            args.extend(["--plan".into(), plan.display().to_string()]);
        }
        if self.arrivals > 1 || self.place_arrivals {
            args.extend(["--arrivals".into(), self.arrivals.to_string()]);
        }
        if self.place_arrivals {
            args.push("--place-arrivals".into());
        }
        if self.stream {
            args.push("--stream".into());
        }
        if self.reallocate {
            args.extend(["--reallocate".into(), "--move-cost".into(), self.move_cost.to_string()]);
        }
        args
    }

    fn train(&self, mode: Mode, emit: Sink) -> Result<()> {
        super::epochs::run(self, mode, emit)
    }

    fn after_modes(&self) -> Result<()> {
        if self.sklearn { sklearn(self) } else { Ok(()) }
    }
}

impl LrArgs {
    /// Bits of the words' ids in `spam` and `wordnet-pos`: with --hash-buckets nearly raw (62 bits of each
    /// word's hash), which the buckets then take in.
    fn spam_bits(&self) -> u32 {
        if self.hash_buckets.is_some() || self.raw_ids() { 62 } else { self.hash_bits.unwrap_or(18) }
    }

    /// Whether --ids raw.
    fn raw_ids(&self) -> bool {
        self.ids == "raw"
    }

    /// The feature hashing of --hash-buckets, seeded by --seed.
    fn feature_hashing(&self) -> Option<(ferry::FeatureHashing, u64)> {
        self.hash_buckets.map(|m| (ferry::FeatureHashing { seed: self.common.seed, signed: self.hash_signed }, m))
    }

    /// What the data description adds for --hash-buckets.
    fn hashing_note(&self) -> String {
        match self.feature_hashing() {
            Some((h, m)) => format!(", features hashed into {m} keys (seed {}{})", h.seed, if h.signed { ", signed" } else { "" }),
            None => String::new(),
        }
    }

    fn validate(&self) -> Result<()> {
        if self.batch == 0 {
            bail!("--batch must be at least 1");
        }
        match self.ids.as_str() {
            "dense" => {}
            "raw" => {
                if self.hash_bits.is_some() || self.hash_buckets.is_some() {
                    bail!("--ids raw keys the weights by the features' raw ids: it takes no --hash-bits or --hash-buckets");
                }
                if self.plan.is_some() || self.place_arrivals {
                    bail!("--ids raw takes no --plan or --place-arrivals (a plan homes dense keys)");
                }
                if !(self.capacity_share.is_finite() && self.capacity_share > 0.0) {
                    bail!("--capacity-share must be a positive number");
                }
                self.eviction.parse::<ferry::dynamic::Eviction>().map_err(|e| anyhow::anyhow!("--eviction: {e}"))?;
                self.admission.parse::<ferry::dynamic::Admission>().map_err(|e| anyhow::anyhow!("--admission: {e}"))?;
            }
            other => bail!("--ids {other}: expected dense or raw"),
        }
        if self.arrivals == 0 {
            bail!("--arrivals must be at least 1");
        }
        if self.arrivals > 1 && self.common.modes().any(|m| m == Mode::Intent) {
            bail!("--arrivals takes the classic and localize modes (intent declares an epoch's batches before it starts)");
        }
        if self.stream && (self.arrivals < 2 || self.common.epochs > self.arrivals) {
            bail!("--stream trains each part once: it needs --arrivals of at least 2 and at most that many --epochs");
        }
        if self.stream && self.common.modes().any(|m| m == Mode::Single) {
            bail!("--stream runs the cluster modes classic and localize (single trains on every part that arrived)");
        }
        if self.arrivals > 1 && self.common.resume.is_some() {
            bail!("--arrivals does not resume: the arrivals' placement is not in a checkpoint");
        }
        if !(self.move_cost.is_finite() && self.move_cost >= 0.0) {
            bail!("--move-cost must be a number of at least 0");
        }
        if self.hash_bits.is_some_and(|b| !(4..=30).contains(&b)) {
            bail!("--hash-bits must be in 4..=30");
        }
        if self.hash_buckets.is_some_and(|m| !(1..=1 << 32).contains(&m)) {
            bail!("--hash-buckets must be in 1..=4294967296");
        }
        let valid = |x: f32, positive: bool| x.is_finite() && if positive { x > 0.0 } else { x >= 0.0 };
        if !(valid(self.lr, true) && valid(self.l2, false) && valid(self.l1, false)) {
            bail!("--lr must be positive, --l1 and --l2 at least 0");
        }
        if self.l1 > 0.0 && self.optimizer != "ftrl" {
            bail!("--l1 needs --optimizer ftrl (AdaGrad takes no L1 step)");
        }
        self.updater()?;
        for mode in [Mode::Classic, Mode::Localize, Mode::Intent] {
            self.server_optimizer(mode)?;
        }
        if self.common.modes().any(|m| m == Mode::Hybrid) && self.server_optimizer(Mode::Hybrid)? {
            bail!(
                "train lr in hybrid mode runs AdaGrad in the trainer (--optimizer-at worker or auto, no --filter): server-side optimizers do not take replicated keys"
            );
        }
        if self.filter != "none" && self.optimizer_at == "worker" {
            bail!("--filter needs the server-side optimizer (--optimizer-at server or auto)");
        }
        self.parse_filter()?;
        Ok(())
    }

    /// The server-side updater.
    pub fn updater(&self) -> Result<Updater> {
        match self.optimizer.as_str() {
            "adagrad" => Ok(Updater::Adagrad { lr: self.lr, eps: ADAGRAD_EPS, init: 0.0 }),
            "ftrl" => Ok(Updater::Ftrl { alpha: self.lr, beta: 1.0, l1: self.l1, l2: self.l2 }),
            other => bail!("--optimizer {other}: expected adagrad or ftrl"),
        }
    }

    /// Whether the optimizer runs in Ferry (a server-side updater) in cluster mode `mode`.
    pub fn server_optimizer(&self, mode: Mode) -> Result<bool> {
        match (self.optimizer_at.as_str(), self.optimizer.as_str()) {
            ("server", _) | ("auto", "ftrl") => Ok(true),
            // A filter holds back gradients, which only a server-side optimizer takes.
            ("auto", _) => Ok(!matches!(mode, Mode::Intent | Mode::Hybrid) || self.filter != "none"),
            ("worker", "ftrl") => bail!("--optimizer-at worker: FTRL runs server-side only (use AdaGrad)"),
            ("worker", _) => Ok(false),
            (other, _) => bail!("--optimizer-at {other}: expected server, worker or auto"),
        }
    }

    fn parse_filter(&self) -> Result<Option<Box<dyn PushFilter>>> {
        Ok(match self.filter.as_str() {
            "none" => None,
            "kkt" => Some(Box::new(Kkt { l1: self.l1 })),
            s => match s.strip_prefix("significance:").map(str::parse::<f32>) {
                Some(Ok(t)) if t.is_finite() && t > 0.0 => Some(Box::new(Significance { threshold: t, floor: 0.0 })),
                _ => bail!("--filter {s}: expected none, kkt or significance:T with T > 0"),
            },
        })
    }

    /// The examples (identical in every process).
    pub fn load(&self) -> Result<Split> {
        self.validate()?;
        let (train, test) = if let (Some(train), Some(test)) = (&self.train, &self.test) {
            (load_libsvm(train, self.hash_bits)?, load_libsvm(test, self.hash_bits)?)
        } else {
            match self.data.as_str() {
                "agaricus" => {
                    let dir = crate::data::cache_dir().join("agaricus");
                    (load_libsvm(&dir.join("train.libsvm"), self.hash_bits)?, load_libsvm(&dir.join("test.libsvm"), self.hash_bits)?)
                }
                "criteo-small" => {
                    let dir = crate::data::cache_dir().join("criteo-small");
                    (load_libsvm(&dir.join("train.libffm"), self.hash_bits)?, load_libsvm(&dir.join("test.libffm"), self.hash_bits)?)
                }
                "spam" => self.split(load_labelled_text(&crate::data::dataset_path("spam", "spam.tsv"), self.spam_bits())?),
                "wordnet-pos" => self.split(load_labelled_text(&crate::data::dataset_path("wordnet", "pos.tsv"), self.spam_bits())?),
                "synth-lr" => self.split(synthetic(4000, 500, self.common.seed, Frequencies::Uniform)),
                "synth-lr-skewed" => self.split(synthetic(4000, 500, self.common.seed, Frequencies::Zipf)),
                path => {
                    let p = super::user_data(path, KNOWN, true)?;
                    if p.is_dir() {
                        (load_libsvm(&p.join("train.libsvm"), self.hash_bits)?, load_libsvm(&p.join("test.libsvm"), self.hash_bits)?)
                    } else {
                        self.split(load_libsvm(&p, self.hash_bits)?)
                    }
                }
            }
        };
        let mut split = match self.feature_hashing() {
            Some((hashing, buckets)) => Split {
                train: train.hashed(hashing, buckets),
                test: test.hashed(hashing, buckets),
                dims: buckets,
                plan: None,
                arrival_plan: None,
                raw: None,
                names: Vec::new(),
            },
            None if self.raw_ids() => {
                let (mut train, mut test) = (train, test);
                let raw = Examples::renumber(&mut train, &mut test);
                Split { train, test, dims: raw.len() as u64, plan: None, arrival_plan: None, raw: Some(raw), names: Vec::new() }
            }
            None => {
                let dims = train.dims().max(test.dims()).max(self.hash_bits.map_or(0, |b| 1 << b));
                Split { train, test, dims, plan: None, arrival_plan: None, raw: None, names: Vec::new() }
            }
        };
        if self.common.save.is_some() || self.common.checkpoint_dir.is_some() {
            split.names = match &split.raw {
                Some(raw) => raw.iter().chain([&BIAS_ID]).map(u64::to_string).collect(),
                None => (0..split.dims).map(|k| k.to_string()).chain([BIAS_NAME.to_string()]).collect(),
            };
        }
        if let Some(path) = &self.plan {
            let plan = ferry::copartition::Plan::read(path)?;
            plan.check(&split.incidence()?, plan.nodes()).with_context(|| format!("--plan {}", path.display()))?;
            split.plan = Some(plan);
        }
        if self.place_arrivals && self.arrivals > 1 {
            let first = split.incidence_of(0..super::arrivals::part_end(split.train.len(), self.arrivals, 0))?;
            split.arrival_plan = Some(ferry::copartition::copartition(&first, &self.arrival_options())?);
        }
        Ok(split)
    }

    /// A seeded 80/20 split.
    fn split(&self, all: Examples) -> (Examples, Examples) {
        let mut order: Vec<usize> = (0..all.len()).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(self.common.seed ^ 0x5eed));
        let cut = all.len() * 4 / 5;
        (all.select(&order[..cut]), all.select(&order[cut..]))
    }

    /// How --place-arrivals co-partitions (for the cluster's --nodes).
    fn arrival_options(&self) -> ferry::copartition::Options {
        ferry::copartition::Options { batch: self.batch, seed: self.common.seed, ..ferry::copartition::Options::new(self.common.nodes) }
    }

    /// The model as saved: a weight per feature key, then the bias's (`names`).
    fn description<'a>(&self, split: &'a Split) -> Description<'a> {
        let meta = serde_json::json!({
            "data": self.data,
            "ids": self.ids,
            "hash_bits": self.hash_bits,
            "hash_buckets": self.hash_buckets,
            "hash_signed": self.hash_signed,
            "seed": self.common.seed,
            "bias_id": split.names.last(),
            "layout": "one weight per feature id; p(label 1) = sigmoid(weight of bias_id + sum of value x weight over the example's features)",
        });
        Description { task: "lr", meta, tables: vec![Described { name: "weights", source: 0, cols: 1, ids: &split.names }] }
    }

    /// Whether the worker adds the L2 penalty's gradient (AdaGrad) or the updater applies it.
    fn worker_l2(&self) -> f32 {
        if self.optimizer == "ftrl" { 0.0 } else { self.l2 }
    }
}

/// A planted sparse linear model: 30 active features per example out of `dims`.
fn synthetic(n: usize, dims: u64, seed: u64, frequencies: Frequencies) -> Examples {
    use rand::Rng;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x1f);
    let truth: Vec<f32> = (0..dims).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    // Zipf's law with exponent 1.1 over the features (feature 0 the most frequent), as words
    // and click features come: a quarter of them carries most occurrences.
    let cumulative: Vec<f64> = (0..dims)
        .scan(0.0, |sum, f| {
            *sum += 1.0 / ((f + 1) as f64).powf(1.1);
            Some(*sum)
        })
        .collect();
    let total = cumulative.last().copied().unwrap_or(1.0);
    let draw = |rng: &mut ChaCha8Rng| match frequencies {
        Frequencies::Uniform => rng.gen_range(0..dims),
        Frequencies::Zipf => cumulative.partition_point(|&c| c < rng.gen_range(0.0..total)).min(dims as usize - 1) as u64,
    };
    let mut lines = String::new();
    for _ in 0..n {
        let mut features: Vec<u64> = (0..30).map(|_| draw(&mut rng)).collect();
        features.sort_unstable();
        features.dedup();
        let score: f32 = features.iter().map(|&f| truth[f as usize]).sum::<f32>() * 0.5;
        let y = u8::from(rng.gen_range(0.0f32..1.0) < 1.0 / (1.0 + (-score).exp()));
        lines.push_str(&y.to_string());
        for f in features {
            lines.push_str(&format!(" {}:1", f + 1));
        }
        lines.push('\n');
    }
    let path = std::env::temp_dir().join(format!("ferry-synth-lr-{}-{seed}.svm", std::process::id()));
    let examples = std::fs::write(&path, lines).map_err(anyhow::Error::from).and_then(|()| load_libsvm(&path, None));
    let _ = std::fs::remove_file(&path);
    examples.expect("generated examples parse")
}

/// How often the generated examples' features occur.
#[derive(Clone, Copy)]
enum Frequencies {
    /// All alike.
    Uniform,
    /// By Zipf's law (exponent 1.1).
    Zipf,
}

/// The order (as indices into its batches) in which worker `worker_index`, of `batches`
/// mini-batches, trains them in epoch `epoch` (drawn from the seed, so that intent mode can
/// declare an epoch's first batches before it starts).
fn epoch_order(batches: usize, seed: u64, epoch: usize, worker_index: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..batches).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ ((epoch as u64) << 32) ^ worker_index as u64));
    order
}

/// `examples` cut into mini-batches of `size` once (seeded): every epoch revisits the same
/// batches in a new order (so their key lists repeat, for key caching).
fn fixed_batches(examples: &[usize], size: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut order = examples.to_vec();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ 0xba7c4));
    order.chunks(size.max(1)).map(<[usize]>::to_vec).collect()
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The batch's distinct keys (features, then the bias) and, per example, each feature's position
/// among them.
#[derive(Default)]
struct Batch {
    keys: Vec<u64>,
    positions: Vec<usize>,
    weights: Vec<f32>,
    gradient: Vec<f32>,
    /// Worker-side AdaGrad: the pulled `[weight, accumulator]` per key, and the pushed
    /// `[step, squared gradient]`.
    values: Vec<f32>,
    update: Vec<f32>,
}

impl Batch {
    fn gather(&mut self, data: &Examples, batch: &[usize], bias: u64) {
        self.keys.clear();
        for &i in batch {
            self.keys.extend_from_slice(data.row(i).0);
        }
        self.keys.sort_unstable();
        self.keys.dedup();
        self.keys.push(bias);
        self.positions.clear();
        for &i in batch {
            self.positions.extend(data.row(i).0.iter().map(|f| self.keys.binary_search(f).unwrap_or(0)));
        }
        self.weights.resize(self.keys.len(), 0.0);
        self.gradient.resize(self.keys.len(), 0.0);
    }

    /// Worker-side AdaGrad, with `values` pulled and the gradient computed: the additive
    /// update of each `[weight, accumulator]`, the step the server-side updater would take.
    fn adagrad_update(&mut self, lr: f32) {
        self.update.resize(self.values.len(), 0.0);
        for ((g, value), out) in self.gradient.iter().zip(self.values.chunks_exact(2)).zip(self.update.chunks_exact_mut(2)) {
            let accumulator = value[1] + g * g;
            out[0] = -lr * g / (accumulator.sqrt() + ADAGRAD_EPS);
            out[1] = g * g;
        }
    }

    /// With `weights` pulled: the gradient of the batch's mean log loss (plus `l2 · w` per key
    /// present); returns the batch's summed log loss.
    fn gradient(&mut self, data: &Examples, batch: &[usize], l2: f32) -> f64 {
        self.gradient.fill(0.0);
        let bias = self.keys.len() - 1;
        let scale = 1.0 / batch.len() as f32;
        let mut loss = 0.0f64;
        let mut at = 0;
        for &i in batch {
            let (_, values) = data.row(i);
            let positions = &self.positions[at..at + values.len()];
            at += values.len();
            let score = self.weights[bias] + positions.iter().zip(values).map(|(&p, v)| self.weights[p] * v).sum::<f32>();
            let p = sigmoid(score);
            let y = data.labels[i];
            loss += log_loss(p, y);
            let g = (p - y) * scale;
            for (&pos, v) in positions.iter().zip(values) {
                self.gradient[pos] += g * v;
            }
            self.gradient[bias] += g;
        }
        if l2 > 0.0 {
            for (g, w) in self.gradient[..bias].iter_mut().zip(&self.weights) {
                *g += l2 * w;
            }
        }
        loss
    }
}

fn log_loss(p: f32, y: f32) -> f64 {
    let p = (p as f64).clamp(1e-7, 1.0 - 1e-7);
    -(y as f64 * p.ln() + (1.0 - y as f64) * (1.0 - p).ln())
}

/// Log loss and AUC of the weights (`dims` features, then the bias) on `data`.
pub fn evaluate(weights: &[f32], data: &Examples) -> serde_json::Map<String, serde_json::Value> {
    let bias = weights[weights.len() - 1];
    let mut scored: Vec<(f32, f32)> = (0..data.len())
        .map(|i| {
            let (f, v) = data.row(i);
            let s = bias + f.iter().zip(v).map(|(&f, v)| weights.get(f as usize).copied().unwrap_or(0.0) * v).sum::<f32>();
            (s, data.labels[i])
        })
        .collect();
    let loss = scored.iter().map(|&(s, y)| log_loss(sigmoid(s), y)).sum::<f64>() / data.len().max(1) as f64;
    let mut q = serde_json::Map::new();
    q.insert("logloss".into(), loss.into());
    q.insert("auc".into(), auc(&mut scored).into());
    q.insert("nonzero".into(), weights.iter().filter(|w| **w != 0.0).count().into());
    q
}

/// Area under the ROC curve: the probability that a positive outscores a negative (ties count
/// half).
fn auc(scored: &mut [(f32, f32)]) -> f64 {
    scored.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut rank_sum, mut positives) = (0.0f64, 0usize);
    let mut i = 0;
    while i < scored.len() {
        let mut j = i;
        while j < scored.len() && scored[j].0 == scored[i].0 {
            j += 1;
        }
        let mean_rank = (i + j + 1) as f64 / 2.0;
        for s in &scored[i..j] {
            if s.1 > 0.5 {
                rank_sum += mean_rank;
                positives += 1;
            }
        }
        i = j;
    }
    let negatives = scored.len() - positives;
    if positives == 0 || negatives == 0 {
        return 0.5;
    }
    (rank_sum - (positives * (positives + 1)) as f64 / 2.0) / (positives * negatives) as f64
}

impl Workload for LrArgs {
    type Data = Split;

    fn load(&self) -> Result<Split> {
        LrArgs::load(self)
    }

    /// `--reallocate` moves keys by relocation in any cluster mode; in classic mode nodes also
    /// remember where moved keys went (location caches: the trainer's pulls and pushes are
    /// synchronous there, which keeps them sequentially consistent), or every batch that
    /// touches one goes by its home.
    fn configure(&self, config: &mut ferry::Config, mode: Mode) -> Result<()> {
        if self.reallocate && self.arrivals > 1 {
            config.relocation = true;
            config.location_caches |= mode == Mode::Classic;
        }
        Ok(())
    }

    /// `single`: the weights (one thread trains them in plain arrays with the updater's state
    /// beside them, and copies them here after each epoch). A cluster: the weights, with the optimizer as the table's updater, or
    /// as `[weight, accumulator]` values that the trainer's AdaGrad adds to.
    fn model(&self, split: &Split, mode: Mode) -> Result<Model> {
        let n = split.dims + 1;
        if mode == Mode::Intent && self.intent_ahead == 0 {
            bail!("--intent-ahead must be at least 1");
        }
        let mut notes = Vec::new();
        let tables = if mode == Mode::Single {
            vec![ModelTable::zeros(TableSpec::new("weights", n, 1))]
        } else {
            // Worker-side AdaGrad: each value is `[weight, accumulator]` and pushes add.
            let (value_len, updater) = if self.server_optimizer(mode)? { (1, self.updater()?) } else { (2, Updater::Add) };
            let table = match &split.raw {
                // Raw ids: a dynamic table, each id created at its first push (evaluating
                // reads the test's ids without creating them).
                Some(raw) => {
                    let train_ids = {
                        let mut seen = vec![false; raw.len()];
                        split.train.features.iter().for_each(|&f| seen[f as usize] = true);
                        seen.iter().filter(|&&s| s).count() as u64 + 1
                    };
                    let capacity = ((train_ids as f64 * self.capacity_share / self.common.nodes as f64).ceil() as u64).max(1);
                    notes.push(format!(
                        "raw ids: a dynamic table of {capacity} ids per node ({:.0}% of the {train_ids} distinct training ids over {} nodes), eviction {}, admission {}",
                        100.0 * self.capacity_share,
                        self.common.nodes,
                        self.eviction,
                        self.admission
                    ));
                    TableSpec::dynamic("weights", value_len, capacity)
                        .admitting(self.admission.parse().map_err(|e| anyhow::anyhow!("--admission: {e}"))?)
                        .evicting(self.eviction.parse().map_err(|e| anyhow::anyhow!("--eviction: {e}"))?)
                }
                None => TableSpec::new("weights", n, value_len),
            };
            let mut spec = self.common.on_the_wire(table.with_updater(updater))?;
            if split.raw.is_some() {
                // A dynamic table's ids are homed by a hash of the id: --partitioning is moot.
                spec = spec.partitioned(ferry::Partitioning::Range);
            }
            if let Some(plan) = split.plan.as_ref().or(split.arrival_plan.as_ref()) {
                spec = spec.placed(plan.placement.clone());
            }
            if mode == Mode::Hybrid {
                // Replicated weights (NuPS), pushed to and read from locally, synced within the
                // staleness bound.
                let mut counts = ferry::AccessCounts::new(n);
                for i in 0..split.train.len() {
                    for &key in split.train.row(i).0 {
                        counts.add(key, 1);
                    }
                    counts.add(split.dims, 1);
                }
                // With a plan and no --replicate: the weights the plan's examples share
                // between nodes (the rest are each used by one node, which the plan homes them
                // at); otherwise the heuristic over all accesses.
                let hot = match &split.plan {
                    Some(plan) if self.common.replicate == 0 => plan.shared_keys(&split.incidence()?)?,
                    _ => self.common.hot_keys(&counts),
                };
                notes.push(format!("hybrid: {} of {} weights replicated ({:.1}% of accesses)", hot.len(), n, 100.0 * counts.share(&hot)));
                spec = match &split.raw {
                    // By raw id: the bias's is its own.
                    Some(raw) => spec.replicating_ids(hot.iter().map(|&k| raw.get(k as usize).copied().unwrap_or(BIAS_ID))),
                    None => spec.replicating(ferry::as_ranges(&hot)),
                };
            }
            vec![ModelTable::zeros(spec)]
        };
        Ok(Model { tables, notes })
    }

    fn trainer<'a>(&'a self, split: &'a Split, pass: &mut Pass<'_>) -> Result<Box<dyn Trainer + 'a>> {
        if pass.mode == Mode::Single {
            let all: Vec<usize> = (0..split.train.len()).collect();
            let (updater, n) = (self.updater()?, split.dims as usize + 1);
            let state = vec![0.0; n * updater.state_len(1)];
            let batches = fixed_batches(&all, self.batch, self.common.seed);
            return Ok(Box::new(SingleLr { a: self, split, updater, batches, batch: Batch::default(), weights: vec![0.0; n], state }));
        }
        let worker_index = pass.rank * pass.threads + pass.thread;
        let workers = pass.nodes * pass.threads;
        let arrivals = (self.arrivals > 1).then(|| {
            let move_cost = self.reallocate.then_some(self.move_cost);
            super::arrivals::Arrivals::new(self.arrivals, split.train.len(), split.arrival_plan.as_ref(), self.arrival_options(), move_cost)
                .streamed(self.stream)
        });
        let mine: Vec<usize> = match (&split.plan, &arrivals) {
            // The node's examples from the plan, dealt to its threads.
            (Some(plan), _) => plan.examples_of(pass.rank).enumerate().filter(|(j, _)| j % pass.threads == pass.thread).map(|(_, i)| i).collect(),
            (None, Some(arrivals)) => arrivals.mine(1, pass.rank, pass.thread, pass.threads, pass.nodes),
            (None, None) => (0..split.train.len()).filter(|i| i % workers == worker_index).collect(),
        };
        let batches = fixed_batches(&mine, self.batch, self.common.seed ^ worker_index as u64);
        let mode = pass.mode;
        let (w, tables) = pass.node().expect("a cluster's pass has a worker");
        // Intent mode: batch `x` of epoch `e` trains in clock `start + (e - 1) * batches + x`;
        // its weights are declared `intent_ahead` clocks early, the next epoch's first batches
        // during this epoch's last ones (see `super::ahead`).
        let cursor = (mode == Mode::Intent).then(|| AheadCursor::new(w.current_clock(), batches.len(), self.common.epochs, self.intent_ahead));
        let mut trainer = NodeLr {
            a: self,
            split,
            server: self.server_optimizer(mode)?,
            localize: mode == Mode::Localize,
            intent: mode == Mode::Intent,
            worker_index,
            examples: mine.len(),
            batches,
            pusher: self.parse_filter()?.map(|f| FilteredPusher::new(tables[0], f)),
            batch: Batch::default(),
            next: Batch::default(),
            peek: Batch::default(),
            cursor,
            declaring: None,
            arrivals,
        };
        // The first epoch's first batches, declared before the workers meet to start it: the
        // service acts on them meanwhile.
        trainer.declare(pass, 1, 0)?;
        Ok(Box::new(trainer))
    }

    fn reads_model(&self, _: usize) -> bool {
        true
    }

    fn describe<'a>(&self, split: &'a Split) -> Option<Description<'a>> {
        Some(self.description(split))
    }

    fn evaluate(&self, split: &Split, epoch: usize, model: &mut ModelReader<'_>, sums: &Fields, _: Measured, _: &(dyn Fn(Event) + Sync)) -> Result<Quality> {
        let (values, held) = match &split.raw {
            // In a cluster, every feature's weight by its raw id, then the bias's: read without
            // creating them, with which ids the table holds. (`single` stores them densely.)
            Some(raw) => match model.held_rows(0, &raw.iter().copied().chain([BIAS_ID]).collect::<Vec<_>>())? {
                Some((rows, held)) => (rows, Some(held)),
                None => (model.all(0)?, None),
            },
            None => (model.all(0)?, None),
        };
        let value_len = values.len() / (split.dims as usize + 1);
        let weights = leading_columns(&values, value_len, 1);
        if self.common.save_now(epoch) {
            let d = self.description(split);
            let saved = match &held {
                Some(held) => d.saved_held(0, &values, value_len, held),
                None => d.saved(0, &values, value_len),
            };
            self.common.save_model(&d, epoch, &[saved])?;
        }
        let mut quality = evaluate(&weights, &split.test);
        if let Some(held) = &held {
            // The ids the dynamic table holds (the model's size, whatever their weights).
            quality.insert("ids_held".into(), held.iter().filter(|h| **h).count().into());
        }
        if sums[field::FILTER_OFFERED] > 0.0 {
            quality.insert("filtered".into(), format!("{:.1}% held", 100.0 * sums[field::FILTER_HELD] as f64 / sums[field::FILTER_OFFERED] as f64).into());
        }
        Ok(quality)
    }
}

/// `single`: one thread, the weights and the optimizer state in plain arrays, the same updater
/// applied where the trainer runs; the weights are copied into the model's table after each
/// epoch, for the evaluation.
struct SingleLr<'a> {
    a: &'a LrArgs,
    split: &'a Split,
    updater: Updater,
    batches: Vec<Vec<usize>>,
    batch: Batch,
    weights: Vec<f32>,
    state: Vec<f32>,
}

impl Trainer for SingleLr<'_> {
    fn epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<Fields> {
        let mut v = [0.0f32; METRIC_FIELDS];
        if pass.thread != 0 {
            return Ok(v);
        }
        let (split, a) = (self.split, self.a);
        let state_len = self.updater.state_len(1);
        self.batches.shuffle(&mut ChaCha8Rng::seed_from_u64(a.common.seed ^ ((epoch as u64) << 20)));
        let mut loss = 0.0;
        for (x, chunk) in self.batches.iter().enumerate() {
            let batch = &mut self.batch;
            batch.gather(&split.train, chunk, split.dims);
            for (w, &k) in batch.weights.iter_mut().zip(&batch.keys) {
                *w = self.weights[k as usize];
            }
            loss += batch.gradient(&split.train, chunk, a.worker_l2());
            for (&k, &g) in batch.keys.iter().zip(&batch.gradient) {
                let k = k as usize;
                self.updater.apply(&mut self.weights[k..k + 1], &mut self.state[k * state_len..(k + 1) * state_len], &[g]);
            }
            if x % 256 == 0 {
                pass.progress(epoch, x as f64 / self.batches.len().max(1) as f64);
            }
        }
        v[field::LOSS] = loss as f32;
        v[field::EXAMPLES] = split.train.len() as f32;
        Ok(v)
    }

    /// The weights into the model's table (the evaluation reads them there).
    fn measure(&mut self, _: usize, pass: &mut Pass<'_>) -> Result<Fields> {
        if pass.thread == 0 {
            let arrays = pass.shared().expect("single mode has shared arrays");
            for (k, w) in self.weights.iter().enumerate() {
                arrays[0].write(k, std::slice::from_ref(w));
            }
        }
        Ok([0.0; METRIC_FIELDS])
    }
}

/// A cluster worker's share of the examples, in fixed mini-batches.
struct NodeLr<'a> {
    a: &'a LrArgs,
    split: &'a Split,
    /// Whether the optimizer runs in Ferry (else AdaGrad in the trainer).
    server: bool,
    localize: bool,
    intent: bool,
    worker_index: usize,
    examples: usize,
    batches: Vec<Vec<usize>>,
    pusher: Option<FilteredPusher<Box<dyn PushFilter>>>,
    batch: Batch,
    next: Batch,
    peek: Batch,
    cursor: Option<AheadCursor>,
    /// The epoch whose order the declarations have reached, and that order.
    declaring: Option<(usize, Vec<usize>)>,
    /// `--arrivals`: the examples so far.
    arrivals: Option<super::arrivals::Arrivals>,
}

/// With --ids raw (`raw`): a gathered batch's dense feature keys replaced by their raw ids, the
/// bias's by [`BIAS_ID`] (the positions are into the key list, which keeps its order).
fn raw_keys(batch: &mut Batch, raw: Option<&[u64]>) {
    if let Some(raw) = raw
        && let Some((bias, features)) = batch.keys.split_last_mut()
    {
        for k in features {
            *k = raw[*k as usize];
        }
        *bias = BIAS_ID;
    }
}

impl NodeLr<'_> {
    fn order(&self, epoch: usize) -> Vec<usize> {
        epoch_order(self.batches.len(), self.a.common.seed, epoch, self.worker_index)
    }

    /// Intent mode: declares the batches due at batch `x` of `epoch`.
    fn declare(&mut self, pass: &mut Pass<'_>, epoch: usize, x: usize) -> Result<()> {
        let Some(cursor) = self.cursor.as_mut() else { return Ok(()) };
        let due = cursor.due(epoch, x);
        let (w, tables) = pass.node().expect("a cluster's pass has a worker");
        for due in due {
            if self.declaring.as_ref().is_none_or(|d| d.0 != due.epoch) {
                self.declaring = Some((due.epoch, epoch_order(self.batches.len(), self.a.common.seed, due.epoch, self.worker_index)));
            }
            if let Some((_, order)) = &self.declaring {
                self.peek.gather(&self.split.train, &self.batches[order[due.index]], self.split.dims);
                raw_keys(&mut self.peek, self.split.raw.as_deref());
                w.intent(tables[0], &self.peek.keys, due.clock, due.clock + 1)?;
            }
        }
        Ok(())
    }
}

impl Trainer for NodeLr<'_> {
    fn epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<Fields> {
        let (a, split) = (self.a, self.split);
        if let Some(arrivals) = self.arrivals.as_mut()
            && epoch > 1
            && arrivals.arrived(epoch) > arrivals.arrived(epoch - 1)
        {
            // New examples: placed and the keys reallocated (the same on every node and thread);
            // one thread of the node relocates the keys that move here.
            let here = arrivals.arrive(split, epoch, pass.rank)?;
            let mine = arrivals.mine(epoch, pass.rank, pass.thread, pass.threads, pass.nodes);
            self.examples = mine.len();
            self.batches = fixed_batches(&mine, a.batch, a.common.seed ^ self.worker_index as u64);
            if pass.thread == 0 && !here.is_empty() {
                let (w, tables) = pass.node().expect("a cluster's pass has a worker");
                w.localize(tables[0], &here)?;
            }
        }
        let order = self.order(epoch);
        if let Some(cursor) = &self.cursor {
            // One clock per batch and none in between, or the declared windows are off.
            let expected = cursor.clock(epoch, 0);
            let clock = pass.node().expect("a cluster's pass has a worker").0.current_clock();
            if clock != expected {
                bail!("epoch {epoch} starts in clock {clock}, not {expected}: the intent windows declared for it are off");
            }
        }
        let mut loss = 0.0;
        let mut ticket = None;
        for (x, &b) in order.iter().enumerate() {
            self.declare(pass, epoch, x)?;
            let chunk = &self.batches[b];
            if self.localize && x > 0 {
                // Gathered ahead, when its localize was issued.
                std::mem::swap(&mut self.batch, &mut self.next);
            } else {
                self.batch.gather(&split.train, chunk, split.dims);
                raw_keys(&mut self.batch, split.raw.as_deref());
            }
            let (w, tables) = pass.node().expect("a cluster's pass has a worker");
            let weights = tables[0];
            if self.localize {
                // Latency hiding: the next batch's weights move here while this one trains.
                if let Some(t) = ticket.take() {
                    w.wait(t)?;
                }
                if x == 0 {
                    w.localize(weights, &self.batch.keys)?;
                }
                if let Some(&following) = order.get(x + 1) {
                    self.next.gather(&split.train, &self.batches[following], split.dims);
                    raw_keys(&mut self.next, split.raw.as_deref());
                    ticket = Some(w.localize_async(weights, &self.next.keys)?);
                }
            }
            let batch = &mut self.batch;
            if self.server {
                w.pull(weights, &batch.keys, &mut batch.weights)?;
            } else {
                batch.values.resize(batch.keys.len() * 2, 0.0);
                w.pull(weights, &batch.keys, &mut batch.values)?;
                for (weight, value) in batch.weights.iter_mut().zip(batch.values.chunks_exact(2)) {
                    *weight = value[0];
                }
            }
            loss += batch.gradient(&split.train, chunk, a.worker_l2());
            match self.pusher.as_mut() {
                Some(p) => p.push(w, &batch.keys, &batch.gradient, &batch.weights)?,
                None if self.server => w.push(weights, &batch.keys, &batch.gradient)?,
                None => {
                    batch.adagrad_update(a.lr);
                    w.push(weights, &batch.keys, &batch.update)?;
                }
            }
            if self.intent {
                w.advance_clock()?;
            }
            if x % 256 == 0 {
                pass.progress(epoch, x as f64 / order.len().max(1) as f64);
            }
        }
        let (w, _) = pass.node().expect("a cluster's pass has a worker");
        if let Some(t) = ticket.take() {
            w.wait(t)?;
        }
        if let Some(p) = self.pusher.as_mut() {
            // Nothing is lost: what the filter held back goes out before the evaluation.
            p.flush(w)?;
        }
        if epoch < a.common.epochs {
            // The next epoch's first batches, declared before the workers meet to start it.
            self.declare(pass, epoch + 1, 0)?;
        }
        let mut v = [0.0f32; METRIC_FIELDS];
        v[field::LOSS] = loss as f32;
        v[field::EXAMPLES] = self.examples as f32;
        if let Some(p) = &self.pusher {
            let stats = p.stats();
            v[field::FILTER_HELD] = stats.held as f32;
            v[field::FILTER_OFFERED] = stats.offered as f32;
        }
        Ok(v)
    }
}

/// Fits scikit-learn's LogisticRegression on the same split (scripts/sklearn-baseline) and
/// prints its figures: `C = 1 / (λ · n)` matches the mean-loss objective's penalty.
pub fn sklearn(a: &LrArgs) -> Result<()> {
    let split = a.load()?;
    let split = &split;
    let dir = std::env::temp_dir().join(format!("ferry-lr-sklearn-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (train, test) = (dir.join("train.libsvm"), dir.join("test.libsvm"));
    split.train.write_libsvm(&train)?;
    split.test.write_libsvm(&test)?;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/sklearn-baseline");
    // The penalty scikit-learn takes: L1 when one is set (liblinear has no mix), else L2.
    let (penalty, lambda) = if a.l1 > 0.0 { ("l1", a.l1) } else { ("l2", a.l2) };
    let c = if lambda > 0.0 { 1.0 / (lambda as f64 * split.train.len() as f64) } else { 1e12 };
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg(&train)
        .arg(&test)
        .arg(c.to_string())
        .arg(penalty)
        .arg(split.dims.to_string())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let _ = std::fs::remove_dir_all(&dir);
    if !out.status.success() {
        bail!("scikit-learn baseline failed: {}", String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or(""));
    }
    println!("sklearn {}", String::from_utf8_lossy(&out.stdout).trim());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_counts_ordered_pairs() {
        assert_eq!(auc(&mut [(0.1, 0.0), (0.4, 1.0), (0.35, 0.0), (0.8, 1.0)]), 1.0);
        assert_eq!(auc(&mut [(0.9, 0.0), (0.1, 1.0)]), 0.0);
        assert_eq!(auc(&mut [(0.5, 0.0), (0.5, 1.0)]), 0.5);
        assert!((auc(&mut [(0.1, 1.0), (0.2, 0.0), (0.3, 1.0), (0.4, 0.0)]) - 0.25).abs() < 1e-12);
    }

    /// Skewed examples' features come by Zipf's law: the first tenth of the features carries
    /// over half the occurrences (a tenth of them when all are alike).
    #[test]
    fn skewed_examples_use_a_few_features_most() {
        let share_of_first_tenth = |frequencies| {
            let data = synthetic(2_000, 500, 5, frequencies);
            let first = data.features.iter().filter(|&&feature| feature <= 50).count();
            first as f64 / data.features.len() as f64
        };
        assert!(share_of_first_tenth(Frequencies::Zipf) > 0.5);
        assert!(share_of_first_tenth(Frequencies::Uniform) < 0.15);
    }

    #[test]
    fn batch_gradient_matches_finite_differences() {
        let data = synthetic(50, 40, 3, Frequencies::Uniform);
        let idx: Vec<usize> = (0..10).collect();
        let mut b = Batch::default();
        b.gather(&data, &idx, 40);
        for (i, w) in b.weights.iter_mut().enumerate() {
            *w = (i as f32 * 0.37).sin() * 0.3;
        }
        b.gradient(&data, &idx, 0.01);
        let analytic = b.gradient.clone();
        let objective = |b: &mut Batch| {
            let l2: f64 = b.weights[..b.keys.len() - 1].iter().map(|w| 0.01 * (*w as f64).powi(2) / 2.0).sum();
            b.gradient(&data, &idx, 0.0) / idx.len() as f64 + l2
        };
        for k in [0, 3, b.keys.len() - 1] {
            let eps = 1e-2;
            b.weights[k] += eps;
            let up = objective(&mut b);
            b.weights[k] -= 2.0 * eps;
            let down = objective(&mut b);
            b.weights[k] += eps;
            let numeric = (up - down) / (2.0 * eps as f64);
            assert!((numeric - analytic[k] as f64).abs() < 2e-3, "key {k}: {numeric} vs {}", analytic[k]);
        }
    }
}
