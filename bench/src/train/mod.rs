//! ML workloads on Ferry: matrix factorization, knowledge-graph embeddings, word vectors, sparse
//! logistic regression and a CountMin sketch, each run in one or more of the modes of [`Mode`] —
//! `single` (one process, shared arrays, several threads, no parameter server), `classic`,
//! `localize`, `hybrid` and `intent` (Ferry clusters that manage parameters differently).
//!
//! The driver runs `single` in this process and starts the other modes as clusters of
//! processes of this binary (through `ferry::launch`); rank 0 of a cluster prints one `EPOCH`
//! line per epoch and `PROGRESS` lines within epochs (at most ten a second), which the driver
//! turns into a table or JSON lines, a progress bar, and optionally an SVG plot.

mod ahead;
pub mod arrivals;
pub mod checkpoint_model;
pub mod countmin;
pub mod epochs;
pub mod kge;
pub mod lr;
pub mod mf;
pub mod model;
pub mod plan;
mod plot;
pub mod resume;
mod schedule;
pub mod shared;
mod simd;
pub mod w2v;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use ferry::launch::{LaunchSpec, Stream, launch};
use indicatif::{ProgressBar, ProgressStyle};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// How parameters are managed. Each variant's doc comment is also its `--mode` help.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One process, plain shared arrays, several threads: the baseline without a parameter server.
    Single,
    /// A Ferry cluster with relocation off: every key stays at its home node.
    Classic,
    /// A Ferry cluster whose trainer relocates the keys it is about to use (`localize`; Lapse).
    Localize,
    /// A Ferry cluster that replicates hot keys and relocates the rest (NuPS).
    Hybrid,
    /// A Ferry cluster whose trainer only declares which keys it needs in which of its clocks;
    /// the engine relocates or replicates them (AdaPM).
    Intent,
}

impl Mode {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Single => "single",
            Mode::Classic => "classic",
            Mode::Localize => "localize",
            Mode::Hybrid => "hybrid",
            Mode::Intent => "intent",
        }
    }
}

/// A value of `--mode`: one mode, or `all` of the classic comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeChoice {
    /// This one mode.
    One(Mode),
    /// `single`, `classic` and `localize`, one after the other.
    All,
}

impl ModeChoice {
    fn modes(self) -> Vec<Mode> {
        match self {
            ModeChoice::One(mode) => vec![mode],
            ModeChoice::All => vec![Mode::Single, Mode::Classic, Mode::Localize],
        }
    }
}

/// Written by hand so that a mode's help text is `Mode`'s doc comment, stated once.
impl ValueEnum for ModeChoice {
    fn value_variants<'a>() -> &'a [Self] {
        &[
            ModeChoice::One(Mode::Single),
            ModeChoice::One(Mode::Classic),
            ModeChoice::One(Mode::Localize),
            ModeChoice::One(Mode::Hybrid),
            ModeChoice::One(Mode::Intent),
            ModeChoice::All,
        ]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        match self {
            ModeChoice::One(mode) => mode.to_possible_value(),
            ModeChoice::All => Some(clap::builder::PossibleValue::new("all").help("`single`, `classic` and `localize`, one after the other")),
        }
    }
}

/// What a cluster this command started does when one of its nodes is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnLoss {
    /// Fail with an error that names the lost node and why.
    Fail,
    /// Start the cluster again on the surviving node count from the newest whole checkpoint
    /// (--checkpoint-every, --checkpoint-dir): the lost node's share of the data is dealt among
    /// the others, and the epochs after the checkpoint are trained again.
    Resume,
    /// Keep training on the survivors, losing no acknowledged push: every key is backed up on
    /// its owner's successor (one backup, or `FERRY_BACKUPS=k` on the next `k` nodes, to survive
    /// `k` nodes lost at once), which serves a lost node's keys from then on;
    /// the lost node's share of the data is dealt among the survivors from the next epoch, and
    /// the run says so. Classic mode (a parameter server whose keys stay at their homes): the
    /// workers repeat a pull the loss failed (negative samples included) and drop a push or set
    /// it failed. A lost rank 0 is survived too: the next live rank coordinates barriers and
    /// reports from then on.
    Continue,
    /// As `continue`, and the driver starts a fresh process in the lost rank (any but rank 0,
    /// while rank 0 runs), which joins the running cluster, gets back the keys of its rank from
    /// the node that served them, and trains from the start of the next epoch the others
    /// begin: they deal the data among all of them again from then on.
    Replace,
}

impl OnLoss {
    /// Whether the survivors of a lost node train on (`continue`, `replace`).
    pub fn trains_on(self) -> bool {
        matches!(self, OnLoss::Continue | OnLoss::Replace)
    }
}

/// The part a process plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    /// Run the requested modes and report.
    Driver,
    /// Be one node of a cluster the driver started.
    Node,
}

/// Options shared by every task.
#[derive(Debug, Clone, Args)]
pub struct Common {
    /// Mode(s) to run, comma-separated, one after the other (e.g. `single,hybrid`).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "localize")]
    pub mode: Vec<ModeChoice>,
    /// Nodes (processes) of the cluster modes: classic, localize, hybrid and intent.
    #[arg(long, default_value_t = 2)]
    pub nodes: usize,
    /// Worker threads per node (default 1).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Threads of `single` (default: nodes × threads per node).
    #[arg(long)]
    pub single_threads: Option<usize>,
    /// Training epochs.
    #[arg(long, default_value_t = 10)]
    pub epochs: usize,
    /// Seed for data splits, initialisation and sampling.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// One JSON object per epoch instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Draw quality over time and over epochs into this SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// `hybrid` mode, where the data does not say which keys several nodes share (MF, KGE with
    /// --no-copartition, LR without --plan): replicate keys accessed more than this many times
    /// the mean key's frequency in the training data (NuPS's untuned heuristic uses 100).
    /// Word2vec, co-partitioned KGE and LR with --plan replicate the keys that two or more
    /// nodes' data use, and home every other key with its one user.
    #[arg(long, default_value_t = 100.0)]
    pub hot_factor: f64,
    /// `hybrid` mode: replicate the N most frequently accessed keys instead (0: the rule of
    /// `--hot-factor`).
    #[arg(long, default_value_t = 0)]
    pub replicate: usize,
    /// Save the trained model into this directory (one `.npy` matrix and one TSV of ids → rows
    /// per table, and `model.json`), after the last epoch and with --save-every.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// With --save: also save every this many epochs (0: only after the last).
    #[arg(long, default_value_t = 0, requires = "save")]
    pub save_every: usize,
    /// Write a checkpoint of the model (values, optimizer state, and in a cluster every node's
    /// share) every this many epochs into --checkpoint-dir, as `epoch-N` (0: never).
    #[arg(long, default_value_t = 0, requires = "checkpoint_dir")]
    pub checkpoint_every: usize,
    /// Where --checkpoint-every writes; the two newest whole checkpoints are kept.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Resume from the newest whole checkpoint in this directory (written by --checkpoint-dir,
    /// by any node count) at the epoch after it, with the same --epochs and settings.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Cluster modes: what to do when a node is lost (its process killed, its machine gone):
    /// fail, resume on the others from the newest checkpoint (needs --checkpoint-every and
    /// --checkpoint-dir), continue on the others with every key backed up (classic mode), or
    /// replace: continue, and start a fresh node in the lost rank, which joins the run at the
    /// next epoch. Clusters started by srun or mpirun are restarted by the scheduler.
    #[arg(long, value_enum, default_value = "fail")]
    pub on_loss: OnLoss,
    /// Cluster modes, with --on-loss continue: node RANK leaves the cluster gracefully at the
    /// start of epoch EPOCH (`RANK@EPOCH`, rank 0 excepted): it hands its keys to its successor
    /// first, so no push is lost, and the others train on without it, dealing its share of the
    /// data among them from the next epoch.
    #[arg(long, value_name = "RANK@EPOCH")]
    pub leave: Option<String>,
    /// Cluster modes: how the model's values travel — f32, bf16, f16 or int8 (a scale per
    /// message part) — the parameter server's value compression.
    #[arg(long, default_value = "f32")]
    pub codec: String,
    /// Cluster modes: key lists of at least this many keys are sent once and then by hash (key
    /// caching; 0: off).
    #[arg(long, default_value_t = 0)]
    pub key_cache: usize,
    /// Cluster modes: how the model's keys are spread over the nodes — hash (the default),
    /// range, consistent or consistent:VIRTUAL_NODES (consistent hashing).
    #[arg(long, default_value = "hash")]
    pub partitioning: String,
    /// Internal: the part this process plays.
    #[arg(long, value_enum, default_value = "driver", hide = true)]
    pub role: Role,
}

impl Common {
    /// The modes --mode asks for, in order.
    pub fn modes(&self) -> impl Iterator<Item = Mode> + '_ {
        self.mode.iter().flat_map(|m| m.modes())
    }

    /// Refuses counts that cannot run (zero threads, nodes or epochs), a hot factor that is
    /// not a positive number and table options that do not parse, before any node starts.
    pub fn check(&self) -> Result<()> {
        self.on_the_wire(ferry::TableSpec::new("check", 1, 1))?;
        for (flag, value) in
            [("--nodes", Some(self.nodes)), ("--threads", self.threads), ("--single-threads", self.single_threads), ("--epochs", Some(self.epochs))]
        {
            if value == Some(0) {
                bail!("{flag} must be at least 1");
            }
        }
        if !(self.hot_factor.is_finite() && self.hot_factor > 0.0) {
            bail!("--hot-factor must be a positive number, not {}", self.hot_factor);
        }
        if self.checkpoint_dir.is_some() || self.resume.is_some() {
            let modes: Vec<Mode> = self.modes().collect();
            if modes.len() != 1 {
                bail!("--checkpoint-dir and --resume take one --mode (each mode would write over the other's checkpoints)");
            }
        }
        if self.on_loss == OnLoss::Resume && (self.checkpoint_dir.is_none() || self.checkpoint_every == 0) {
            bail!("--on-loss resume resumes from the newest checkpoint: it needs --checkpoint-every N and --checkpoint-dir DIR");
        }
        if let Some((rank, epoch)) = self.leaving()? {
            if !self.on_loss.trains_on() {
                bail!("--leave needs --on-loss continue: the others train on without the node, its keys served from their backups");
            }
            if rank == 0 || rank >= self.nodes {
                bail!("--leave {rank}@{epoch}: the leaving rank must be one of 1..{} (rank 0 coordinates the cluster)", self.nodes);
            }
            if epoch < 2 || epoch > self.epochs {
                bail!("--leave {rank}@{epoch}: the node leaves at the start of an epoch from 2 to --epochs ({})", self.epochs);
            }
        }
        if self.on_loss.trains_on() && self.modes().any(|m| !matches!(m, Mode::Single | Mode::Classic | Mode::Localize)) {
            bail!(
                "--on-loss continue (or replace) keeps training on the survivors of a cluster whose keys are backed up, which replicates none: use --mode classic or localize"
            );
        }
        if self.on_loss == OnLoss::Replace && self.modes().any(|m| m == Mode::Localize) {
            bail!("--on-loss replace needs a node to join, which a cluster that relocates keys cannot do yet: use --mode classic");
        }
        Ok(())
    }

    /// Worker threads per node.
    pub fn threads(&self) -> usize {
        self.threads.unwrap_or(1).max(1)
    }

    /// Threads of the `single` mode.
    pub fn single_threads(&self) -> usize {
        self.single_threads.unwrap_or(self.nodes * self.threads()).max(1)
    }

    fn node_args(&self, mode: Mode) -> Vec<String> {
        let mut a = vec!["--mode".into(), mode.name().into(), "--nodes".into(), self.nodes.to_string(), "--threads".into(), self.threads().to_string()];
        a.extend(["--epochs".into(), self.epochs.to_string(), "--seed".into(), self.seed.to_string(), "--role".into(), "node".into()]);
        a.extend(["--hot-factor".into(), self.hot_factor.to_string(), "--replicate".into(), self.replicate.to_string()]);
        a.extend(["--codec".into(), self.codec.clone(), "--key-cache".into(), self.key_cache.to_string()]);
        a.extend(["--partitioning".into(), self.partitioning.clone()]);
        if let Some(dir) = &self.save {
            a.extend(["--save".into(), dir.display().to_string(), "--save-every".into(), self.save_every.to_string()]);
        }
        if let Some(dir) = &self.checkpoint_dir {
            a.extend(["--checkpoint-dir".into(), dir.display().to_string(), "--checkpoint-every".into(), self.checkpoint_every.to_string()]);
        }
        if let Some(dir) = &self.resume {
            a.extend(["--resume".into(), dir.display().to_string()]);
        }
        if let Some(value) = self.on_loss.trains_on().then(|| self.on_loss.to_possible_value()).flatten() {
            a.extend(["--on-loss".into(), value.get_name().into()]);
        }
        if let Some(leave) = &self.leave {
            a.extend(["--leave".into(), leave.clone()]);
        }
        a
    }

    /// Whether a checkpoint is written after `epoch`.
    pub fn checkpoint_now(&self, epoch: usize) -> bool {
        self.checkpoint_dir.is_some() && self.checkpoint_every > 0 && epoch.is_multiple_of(self.checkpoint_every)
    }

    /// --leave as (rank, epoch), if given.
    pub fn leaving(&self) -> Result<Option<(usize, usize)>> {
        let Some(text) = &self.leave else { return Ok(None) };
        let parsed = text.split_once('@').and_then(|(r, e)| Some((r.trim().parse().ok()?, e.trim().parse().ok()?)));
        parsed.map(Some).with_context(|| format!("--leave '{text}' is not RANK@EPOCH (e.g. 2@5)"))
    }

    /// The first epoch to train: after the newest whole checkpoint with --resume (and where it
    /// is), else 1.
    pub fn first_epoch(&self) -> Result<(usize, Option<PathBuf>)> {
        let Some(dir) = &self.resume else { return Ok((1, None)) };
        let (epoch, path) = resume::latest(dir)?;
        if epoch >= self.epochs {
            bail!("--resume {}: its newest checkpoint is after epoch {epoch}, and --epochs is {}: nothing is left to train", dir.display(), self.epochs);
        }
        Ok((epoch + 1, Some(path)))
    }

    /// `spec` with the cluster's table options (--codec, --key-cache, --partitioning): for the
    /// model's tables.
    pub fn on_the_wire(&self, spec: ferry::TableSpec) -> Result<ferry::TableSpec> {
        let codec = self.codec.parse::<ferry::ValueCodec>().map_err(|e| anyhow::anyhow!("--codec: {e}"))?;
        let partitioning = self.partitioning.parse::<ferry::Partitioning>().map_err(|e| anyhow::anyhow!("--partitioning: {e}"))?;
        Ok(spec.compressed(codec).cache_keys(self.key_cache).partitioned(partitioning))
    }

    /// Whether the model is saved after `epoch`.
    pub fn save_now(&self, epoch: usize) -> bool {
        self.save.is_some() && (epoch == self.epochs || (self.save_every > 0 && epoch.is_multiple_of(self.save_every)))
    }

    /// Saves a model (`tables`, as `description` says) into `--save` (when given), saying so
    /// on stderr.
    pub fn save_model(&self, description: &checkpoint_model::Description<'_>, epoch: usize, tables: &[model::SavedTable]) -> Result<()> {
        let Some(dir) = &self.save else { return Ok(()) };
        model::save(dir, description.task, epoch, description.meta.clone(), tables).with_context(|| format!("saving the model into {}", dir.display()))?;
        eprintln!("model after epoch {epoch} saved to {}", dir.display());
        Ok(())
    }

    /// The keys `hybrid` mode replicates, from their access counts in the training data.
    pub fn hot_keys(&self, counts: &ferry::AccessCounts) -> Vec<u64> {
        if self.replicate > 0 { counts.top(self.replicate) } else { counts.hot(self.hot_factor) }
    }
}

/// A task's own data files, instead of a named data set (`--data`), and how to read them.
#[derive(Debug, Clone, Default, Args)]
pub struct DataFiles {
    /// Training data file (instead of --data; needs --test): ratings rows for mf, triples for
    /// kge.
    #[arg(long, requires = "test")]
    pub train: Option<PathBuf>,
    /// Validation triples (kge, with --train).
    #[arg(long, requires = "train")]
    pub valid: Option<PathBuf>,
    /// Test data file (with --train): evaluated, never trained on.
    #[arg(long, requires = "train")]
    pub test: Option<PathBuf>,
    /// Field separator of data files: tab, comma, semicolon or space (default: detected per file
    /// from its first data line — a tab if it has one, else a comma, else a semicolon, else
    /// spaces). Every line of a file uses the same one.
    #[arg(long)]
    pub sep: Option<crate::data::delimited::Separator>,
    /// The first line of every data file is a header (default: only when it looks like one,
    /// which is then said on stderr).
    #[arg(long, conflicts_with = "no_header")]
    pub header: bool,
    /// No data file has a header: the first line is data like any other.
    #[arg(long)]
    pub no_header: bool,
}

impl DataFiles {
    /// How data files are read.
    pub fn format(&self) -> crate::data::delimited::Format {
        use crate::data::delimited::{Format, Header};
        let header = if self.header {
            Header::Yes
        } else if self.no_header {
            Header::No
        } else {
            Header::Auto
        };
        Format { separator: self.sep, header }
    }

    /// Reads a file of name pairs (`user item`, `head relation`; further fields ignored) in the
    /// data-file format, calling `pair` for each with the line's two names. A line of names
    /// cannot be told from a header, so there is none unless --header says so.
    pub fn read_name_pairs(&self, path: &Path, mut pair: impl FnMut(&str, &str) -> Result<()>) -> Result<()> {
        let mut format = self.format();
        if format.header == crate::data::delimited::Header::Auto {
            format.header = crate::data::delimited::Header::No;
        }
        crate::data::delimited::read(path, format, 2, |_| false, |row| pair(row.fields[0], row.fields[1]))
    }

    /// The options as command-line arguments (for the cluster's processes).
    pub fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        for (flag, path) in [("--train", &self.train), ("--valid", &self.valid), ("--test", &self.test)] {
            if let Some(p) = path {
                a.extend([flag.to_string(), p.display().to_string()]);
            }
        }
        if let Some(sep) = self.sep {
            a.extend(["--sep".into(), sep.name().into()]);
        }
        if self.header {
            a.push("--header".into());
        }
        if self.no_header {
            a.push("--no-header".into());
        }
        a
    }

    /// Checks that the given files exist (before any cluster starts).
    pub fn check(&self) -> Result<()> {
        for path in [&self.train, &self.valid, &self.test].into_iter().flatten() {
            if !path.is_file() {
                bail!("{} is not a file", path.display());
            }
        }
        Ok(())
    }
}

/// `args` (`--flag value` pairs and switches) with each value that starts with a dash (a
/// negative number, a file name) attached to its flag as `--flag=value`: passed on as two
/// arguments, a rank's parser would take `-1` for a flag of its own.
fn attach_dashed_values(args: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(args.len());
    for arg in args {
        match out.last_mut() {
            Some(flag) if flag.starts_with("--") && !flag.contains('=') && arg.starts_with('-') && !arg.starts_with("--") => {
                flag.push('=');
                flag.push_str(&arg);
            }
            _ => out.push(arg),
        }
    }
    out
}

/// A data set named on the command line that is not one of `known`: it must be a file (or, with
/// `dirs`, a directory); otherwise the error lists the known names.
pub fn user_data(name: &str, known: &[&str], dirs: bool) -> Result<PathBuf> {
    let path = PathBuf::from(name);
    if path.is_file() || (dirs && path.is_dir()) {
        return Ok(path);
    }
    let what = if dirs { "file or directory" } else { "file" };
    bail!("--data {name}: no such {what}, and not a known data set (known: {})", known.join(", "))
}

/// The `train` subcommand: which task, with its options.
#[derive(Debug, Clone, Subcommand)]
pub enum TrainCommand {
    /// Low-rank matrix factorization with SGD (DSGD parameter blocking).
    Mf(mf::MfArgs),
    /// ComplEx knowledge-graph embeddings with AdaGrad and negative sampling.
    Kge(kge::KgeArgs),
    /// Word vectors: skip-gram with negative sampling (word2vec), scored on word analogies.
    W2v(w2v::W2vArgs),
    /// Sparse logistic regression with a server-side optimizer (AdaGrad or FTRL), push filters
    /// and compressed values, scored by log loss and AUC.
    Lr(lr::LrArgs),
    /// A distributed CountMin sketch of a token stream: push-only inserts, error against exact
    /// counts, insert rate against the raw stream.
    Countmin(countmin::CountMinArgs),
}

impl TrainCommand {
    /// The task: the one place that names every workload (a new one adds its variant above and
    /// its arm here).
    pub fn task(&self) -> &dyn Task {
        match self {
            TrainCommand::Mf(a) => a,
            TrainCommand::Kge(a) => a,
            TrainCommand::W2v(a) => a,
            TrainCommand::Lr(a) => a,
            TrainCommand::Countmin(a) => a,
        }
    }

    /// The options every task shares.
    pub fn common(&self) -> &Common {
        self.task().common()
    }
}

/// A training workload: its options and data, and how it trains in each mode. The driver, the
/// schedulers' entry and the cluster launch go through this alone, so a new workload is one
/// module that implements it and one variant of [`TrainCommand`].
pub trait Task: Sync {
    /// The subcommand's name (`mf`, `kge`, …), also the reports' `task`.
    fn name(&self) -> &'static str;
    /// The options every task shares.
    fn common(&self) -> &Common;
    /// Loads (or fetches) the data and checks the options; returns a line describing the run.
    fn prepare(&self) -> Result<String>;
    /// The task's own options as a cluster node's command line takes them.
    fn task_args(&self) -> Vec<String>;
    /// Trains in `mode`: `single` in this process, a cluster mode as one node of the cluster
    /// (the shared epoch loop, [`epochs::run`]).
    fn train(&self, mode: Mode, emit: Sink) -> Result<()>;
    /// Reads the data once and drops it, so that a bad file is found (and said once) before a
    /// cluster's ranks start, each to find it.
    fn check_data(&self) -> Result<()>;
    /// A command of the task that does not train (MF's `--predict`, KGE's `--rank-tails`): runs
    /// it and says so, or says there is none.
    fn run_other(&self) -> Result<bool> {
        Ok(false)
    }
    /// After every requested mode trained (LR's scikit-learn baseline).
    fn after_modes(&self) -> Result<()> {
        Ok(())
    }
}

/// What one epoch of one run did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpochReport {
    /// `mf`, `kge`, `w2v`, `lr` or `countmin`.
    pub task: String,
    /// The mode.
    pub mode: Mode,
    /// Epoch number, from 1.
    pub epoch: usize,
    /// Nodes that trained the epoch (1 for `single`; fewer than --nodes after a lost node with
    /// --on-loss resume).
    #[serde(default)]
    pub nodes: usize,
    /// Training time of this epoch (evaluation excluded).
    pub epoch_s: f64,
    /// Training time so far.
    pub elapsed_s: f64,
    /// Mean training loss of the epoch.
    pub loss: f64,
    /// Quality measures (RMSE; MRR and Hits@k), when evaluated this epoch.
    pub quality: serde_json::Map<String, serde_json::Value>,
    /// Share of key accesses served locally (1 for `single`).
    pub local_share: f64,
    /// Relocations during the epoch.
    pub relocations: u64,
    /// Messages sent during the epoch (all nodes).
    pub messages: u64,
    /// Bytes sent during the epoch (all nodes).
    pub bytes: u64,
    /// Bytes the busiest node sent and received during the epoch (0 for `single`).
    #[serde(default)]
    pub busiest_node_bytes: u64,
    /// Share of key accesses served by replicas (0 without replication).
    #[serde(default)]
    pub replica_share: f64,
    /// Age of replicas when read, 99th percentile (mean over nodes; 0 without replication).
    #[serde(default)]
    pub staleness_p99_ms: f64,
    /// Bytes the replica refreshes read during the epoch (all nodes).
    #[serde(default)]
    pub refresh_bytes: u64,
    /// Share of key accesses that found a key the worker had declared intent for elsewhere
    /// ("late"; 0 outside `intent` mode).
    #[serde(default)]
    pub late_share: f64,
    /// Mean number of clocks between an intent's key arriving and its window starting (mean
    /// over nodes; 0 outside `intent` mode).
    #[serde(default)]
    pub intent_lead: f64,
    /// Keys whose homes the nodes asked again because they stayed remote although needed
    /// (summed over nodes; 0 outside `intent` mode).
    #[serde(default)]
    pub reasked: u64,
    /// Moves the nodes asked for on a grant that the homes declined, because they had since
    /// granted the key to another node (summed over nodes; 0 outside `intent` mode).
    #[serde(default)]
    pub declined: u64,
    /// Dropped run-time replicas a worker pushed to while they drained, after the node's
    /// intent on the key had ended (summed over nodes; 0 outside `intent` mode).
    #[serde(default)]
    pub drained_again: u64,
    /// Run-time replicas made while the node pushed to the key, whose install added the pushes
    /// sent behind their pull (summed over nodes; 0 outside `intent` mode).
    #[serde(default)]
    pub made_with_pushes: u64,
    /// Granted moves the intent service put off while a sync round carried the keys' replica
    /// deltas (summed over nodes; 0 outside `intent` mode).
    #[serde(default)]
    pub moves_put_off: u64,
    /// How the late accesses split by cause (shares of them; all 0 without late accesses).
    #[serde(default)]
    pub late_causes: LateCauses,
}

/// Shares of an epoch's late accesses by cause (`ferry::LateCause`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LateCauses {
    /// The window was not acted on yet (the action timing left no lead).
    pub unacted: f64,
    /// The home was told, nothing was on its way yet and no grant had arrived.
    pub unanswered: f64,
    /// The home's grant had arrived; the intent service had not taken it up yet.
    #[serde(default)]
    pub untaken: f64,
    /// The relocation was on its way.
    pub moving: f64,
    /// The replica was being made.
    pub replicating: f64,
    /// The key had landed for the intent and left again.
    pub left: f64,
}

impl LateCauses {
    /// Shares from counts (unacted, unanswered, untaken, moving, replicating, left).
    pub fn from_counts(counts: [f64; 6]) -> LateCauses {
        let total: f64 = counts.iter().sum();
        if total <= 0.0 {
            return LateCauses::default();
        }
        let [unacted, unanswered, untaken, moving, replicating, left] = counts.map(|n| n / total);
        LateCauses { unacted, unanswered, untaken, moving, replicating, left }
    }
}

impl EpochReport {
    /// The report of a `single` epoch: everything local, nothing sent.
    pub fn single(task: &str, epoch: usize, epoch_s: f64, elapsed_s: f64, loss: f64, quality: serde_json::Map<String, serde_json::Value>) -> EpochReport {
        EpochReport {
            task: task.into(),
            mode: Mode::Single,
            epoch,
            nodes: 1,
            epoch_s,
            elapsed_s,
            loss,
            quality,
            local_share: 1.0,
            relocations: 0,
            messages: 0,
            bytes: 0,
            busiest_node_bytes: 0,
            replica_share: 0.0,
            staleness_p99_ms: 0.0,
            refresh_bytes: 0,
            late_share: 0.0,
            intent_lead: 0.0,
            reasked: 0,
            declined: 0,
            drained_again: 0,
            made_with_pushes: 0,
            moves_put_off: 0,
            late_causes: LateCauses::default(),
        }
    }

    /// The headline quality figure and its name, when evaluated.
    pub fn headline(&self) -> Option<(&str, f64)> {
        ["rmse", "mrr", "analogy", "auc", "within_bound"].into_iter().find_map(|k| self.quality.get(k).and_then(|v| v.as_f64()).map(|v| (k, v)))
    }
}

/// The shortest time between two progress lines of a node: a line is a write to a pipe and wakes
/// the driver, which on a machine with few cores takes that time from the trainers; and the
/// lines must not come more often in one mode than in another (MF's intent mode reports every
/// clock, sixteen per sub-epoch), or the modes' epoch times are not compared fairly.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// Lets through the progress lines a node prints: the first of each epoch and of its
/// evaluation, then at most one per [`PROGRESS_EVERY`].
#[derive(Debug, Default)]
struct ProgressThrottle {
    /// The epoch and phase (evaluating or not) of the last line, and when it was printed.
    last: Option<(usize, bool, Instant)>,
}

impl ProgressThrottle {
    /// Whether a progress line of `epoch` (`evaluating` or training) at `now` is printed.
    fn due(&mut self, epoch: usize, evaluating: bool, now: Instant) -> bool {
        let due = match self.last {
            Some((e, phase, at)) => (e, phase) != (epoch, evaluating) || now.duration_since(at) >= PROGRESS_EVERY,
            None => true,
        };
        if due {
            self.last = Some((epoch, evaluating, now));
        }
        due
    }
}

/// Where a run's reports go.
pub type Sink<'a> = &'a mut (dyn FnMut(Event) + Send);

/// What a run reports while it trains.
#[derive(Debug, Clone)]
pub enum Event {
    /// Progress within an epoch (0..=1).
    Progress(usize, f64),
    /// Progress of the evaluation after an epoch (0..=1).
    Evaluating(usize, f64),
    /// An epoch finished (boxed: a report is large beside the other events).
    Epoch(Box<EpochReport>),
}

/// Runs `command` as this process's role and reports (the entry point of `ferry-bench train`
/// and `ferry train`).
pub fn run(command: &TrainCommand) -> Result<Vec<EpochReport>> {
    let (task, common) = (command.task(), command.common());
    common.check()?;
    if task.run_other()? {
        return Ok(Vec::new());
    }
    if common.role == Role::Node {
        // The parent that started this node has read the files and said what it found.
        crate::data::delimited::leave_notices_to_others();
        let mode = match common.mode[..] {
            [ModeChoice::One(mode)] if mode != Mode::Single => mode,
            _ => bail!("a cluster node runs in classic, localize, hybrid or intent mode"),
        };
        let mut throttle = ProgressThrottle::default();
        let mut emit = |e: Event| match e {
            Event::Progress(epoch, f) if throttle.due(epoch, false, Instant::now()) => println!("PROGRESS {epoch} {f:.3}"),
            Event::Evaluating(epoch, f) if throttle.due(epoch, true, Instant::now()) => println!("EVALUATING {epoch} {f:.3}"),
            Event::Progress(..) | Event::Evaluating(..) => {}
            Event::Epoch(r) => println!("EPOCH {}", serde_json::to_string(&r).expect("reports serialise")),
        };
        task.train(mode, &mut emit)?;
        return Ok(Vec::new());
    }
    let env = ferry::ClusterEnv::detect(|name| std::env::var(name).ok())?;
    if env.nodes > 1 {
        return run_scheduled(command, common, &env);
    }
    let description = task.prepare()?;
    eprintln!("{}: {description}", task.name());
    if common.modes().any(|m| m != Mode::Single) {
        task.check_data()?;
    }
    let mut all = Vec::new();
    for mode in common.modes() {
        let reports = run_mode(command, common, mode)?;
        all.extend(reports);
    }
    task.after_modes()?;
    if let Some(path) = &common.plot {
        plot::draw(path, task.name(), &all).with_context(|| format!("drawing {}", path.display()))?;
        eprintln!("plot written to {}", path.display());
    }
    Ok(all)
}

fn progress_bar(mode: Mode, epochs: usize) -> ProgressBar {
    let bar = ProgressBar::new(1000);
    bar.set_style(ProgressStyle::with_template("{prefix:>9} epoch {msg} [{bar:40}] {percent:>3}%").expect("valid template").progress_chars("=> "));
    bar.set_prefix(mode.name());
    bar.set_message(format!("1/{epochs}"));
    bar
}

fn print_header(json: bool) {
    if !json {
        println!(
            "{:>9} {:>5} {:>9} {:>10} {:>10} {:>9} {:>8} {:>8} {:>11} {:>10} {:>11}  more quality",
            "mode", "epoch", "epoch[s]", "elapsed[s]", "loss", "quality", "local", "replicas", "relocations", "messages", "bytes"
        );
    }
}

/// Quality figures beyond the headline (MF's mean absolute error; KGE's Hits@1/3/10; word2vec's
/// vocabulary, analogy questions in it and its speed; LR's log loss, non-zero weights and
/// filtered share), for the table.
fn more_quality(r: &EpochReport) -> String {
    let numbers = ["mae", "hits@1", "hits@3", "hits@10", "logloss", "mean_overcount", "vs_raw"]
        .iter()
        .filter_map(|k| r.quality.get(*k).and_then(|v| v.as_f64()).map(|v| format!("{k} {v:.4}")));
    let counts = ["nonzero", "vocabulary"].iter().filter_map(|k| r.quality.get(*k).and_then(|v| v.as_u64()).map(|v| format!("{k} {v}")));
    let count = |k: &str| r.quality.get(k).and_then(|v| v.as_u64());
    let questions = count("analogy_questions").zip(count("analogy_all_questions")).map(|(asked, all)| format!("questions {asked}/{all}"));
    let speed = r.quality.get("words_per_s_per_thread").and_then(|v| v.as_f64()).map(|v| format!("words/s/thread {v:.0}"));
    let texts = ["filtered"].iter().filter_map(|k| r.quality.get(*k).and_then(|v| v.as_str()).map(|v| format!("{k} {v}")));
    let intent = (r.mode == Mode::Intent).then(|| {
        let c = &r.late_causes;
        let causes = [
            ("unacted", c.unacted),
            ("unanswered", c.unanswered),
            ("untaken", c.untaken),
            ("moving", c.moving),
            ("replicating", c.replicating),
            ("left", c.left),
        ]
        .iter()
        .filter(|(_, share)| *share > 0.0)
        .map(|(name, share)| format!("{name} {:.0}%", share * 100.0))
        .collect::<Vec<_>>()
        .join(" ");
        let causes = if causes.is_empty() { String::new() } else { format!(" ({causes})") };
        let reasked = if r.reasked > 0 { format!(" reasked {}", r.reasked) } else { String::new() };
        let declined = if r.declined > 0 { format!(" declined {}", r.declined) } else { String::new() };
        let drained = if r.drained_again > 0 { format!(" redrained {}", r.drained_again) } else { String::new() };
        let behind = if r.made_with_pushes > 0 { format!(" made-behind {}", r.made_with_pushes) } else { String::new() };
        let put_off = if r.moves_put_off > 0 { format!(" put-off {}", r.moves_put_off) } else { String::new() };
        format!("late {:.3}%{causes} lead {:.1}{reasked}{declined}{drained}{behind}{put_off}", r.late_share * 100.0, r.intent_lead)
    });
    let busiest = (r.busiest_node_bytes > 0).then(|| format!("busiest-node {:.2} MB", r.busiest_node_bytes as f64 / 1e6));
    numbers.chain(counts).chain(questions).chain(speed).chain(texts).chain(intent).chain(busiest).collect::<Vec<_>>().join(" ")
}

fn print_report(r: &EpochReport, json: bool) {
    if json {
        println!("{}", serde_json::to_string(r).expect("reports serialise"));
        return;
    }
    let quality = r.headline().map_or("-".to_string(), |(k, v)| format!("{k} {v:.4}"));
    println!(
        "{:>9} {:>5} {:>9.3} {:>10.3} {:>10.5} {:>9} {:>7.2}% {:>7.2}% {:>11} {:>10} {:>11}  {}",
        r.mode.name(),
        r.epoch,
        r.epoch_s,
        r.elapsed_s,
        r.loss,
        quality,
        r.local_share * 100.0,
        r.replica_share * 100.0,
        r.relocations,
        r.messages,
        r.bytes,
        more_quality(r)
    );
}

/// What shows a run's progress and prints its reports: a progress bar, the handler of the run's
/// events (a table or JSON lines on stdout), and the reports gathered.
fn reporter(common: &Common, mode: Mode) -> (ProgressBar, impl FnMut(Event) + Send + 'static, Arc<Mutex<Vec<EpochReport>>>) {
    let bar = progress_bar(mode, common.epochs);
    let reports: Arc<Mutex<Vec<EpochReport>>> = Arc::default();
    let (json, epochs) = (common.json, common.epochs);
    let handle = {
        let (bar, reports) = (bar.clone(), reports.clone());
        move |e: Event| match e {
            Event::Progress(epoch, f) => {
                bar.set_message(format!("{epoch}/{epochs}"));
                bar.set_position((f * 1000.0) as u64);
            }
            Event::Evaluating(epoch, f) => {
                bar.set_message(format!("{epoch}/{epochs}, evaluating"));
                bar.set_position((f * 1000.0) as u64);
            }
            Event::Epoch(r) => {
                let first = reports.lock().is_empty();
                // The header comes with the first row: an error before it prints alone.
                bar.suspend(|| {
                    if first {
                        print_header(json);
                    }
                    print_report(&r, json)
                });
                reports.lock().push(*r);
            }
        }
    };
    (bar, handle, reports)
}

/// `ferry train` started by a scheduler (`srun`, `mpirun`, or `ferry launch`): rank variables
/// say this process is one node of a cluster of several, so it runs as that node — no processes
/// of its own — and rank 0 prints the table (or JSON). One cluster mode per run.
fn run_scheduled(command: &TrainCommand, common: &Common, env: &ferry::ClusterEnv) -> Result<Vec<EpochReport>> {
    let mode = match common.modes().collect::<Vec<_>>()[..] {
        [mode] if mode != Mode::Single => mode,
        _ => bail!(
            "started by {} as rank {} of {}: this process is one node of a cluster, so it runs exactly one cluster mode (--mode classic, localize, hybrid or intent)",
            env.source,
            env.rank,
            env.nodes
        ),
    };
    if env.rank != 0 {
        crate::data::delimited::leave_notices_to_others();
    }
    let description = command.task().prepare()?;
    if env.rank == 0 {
        eprintln!("{description}; {} mode on {} nodes started by {}", mode.name(), env.nodes, env.source);
    }
    let (bar, mut handle, reports) = reporter(common, mode);
    if env.rank != 0 {
        bar.finish_and_clear();
    }
    command.task().train(mode, &mut handle)?;
    bar.finish_and_clear();
    let out = std::mem::take(&mut *reports.lock());
    Ok(out)
}

/// Runs one mode: in this process for `single`, as a launched cluster otherwise.
pub fn run_mode(command: &TrainCommand, common: &Common, mode: Mode) -> Result<Vec<EpochReport>> {
    let (bar, handle, reports) = reporter(common, mode);
    let task = command.task();
    if mode == Mode::Single {
        let mut handle = handle;
        task.train(Mode::Single, &mut handle)?;
    } else {
        let exe = std::env::current_exe().context("locating this program")?;
        let handle = Arc::new(Mutex::new(handle));
        let mut current = common.clone();
        loop {
            let mut args: Vec<String> = vec!["train".into(), task.name().into()];
            args.extend(attach_dashed_values(task.task_args()));
            args.extend(attach_dashed_values(current.node_args(mode)));
            let elapsed_before = reports.lock().last().map_or(0.0, |r| r.elapsed_s);
            let mut spec = LaunchSpec::new(current.nodes, exe.clone(), args);
            if current.on_loss.trains_on() {
                // The survivors of a lost node train on to the end, however long that takes.
                spec.grace = Duration::from_secs(6 * 3600);
            }
            spec.replace_lost = current.on_loss == OnLoss::Replace;
            let outcome = launch_cluster(spec, elapsed_before, &handle, &bar)?;
            let (outcome, errors) = match outcome {
                Ok(()) => break,
                Err(failed) => failed,
            };
            let failure = errors.failure(&format!("the {} cluster", mode.name()), &outcome);
            let lost = lost_ranks(&outcome);
            // --on-loss continue: the survivors trained on and finished (after a lost rank 0,
            // the next live rank coordinated and reported).
            // Every process the run started with succeeded or was lost. A fresh node that could
            // not take part (one started as the run ended cannot join it) does not fail the run
            // the others finished.
            let survivors_done = outcome
                .statuses
                .iter()
                .enumerate()
                .filter(|&(i, _)| !outcome.is_replacement(i))
                .all(|(_, s)| s.is_some_and(|s| s.success() || s.signal().is_some()));
            if current.on_loss.trains_on() && outcome.interrupted.is_none() && !lost.is_empty() && lost.len() < current.nodes && survivors_done {
                let failed_fresh: Vec<usize> = (0..outcome.ranks.len())
                    .filter(|&i| outcome.is_replacement(i) && outcome.statuses[i].is_none_or(|s| !s.success() && s.signal().is_none()))
                    .map(|i| outcome.ranks[i])
                    .collect();
                if !failed_fresh.is_empty() {
                    bar.suspend(|| eprintln!("warning: {:#}", errors.failure("the fresh node started in a lost rank", &outcome)));
                }
                let replaced: Vec<usize> = outcome.replaced_ranks().into_iter().filter(|r| !failed_fresh.contains(r)).collect();
                bar.suspend(|| {
                    let ranks: Vec<String> = lost.iter().map(|r| r.to_string()).collect();
                    let (count, nodes, ranks) = (lost.len(), current.nodes, ranks.join(", "));
                    if replaced.is_empty() {
                        eprintln!("{count} of {nodes} nodes lost (rank {ranks}); the others trained on and finished the run");
                    } else {
                        let fresh: Vec<String> = replaced.iter().map(|r| r.to_string()).collect();
                        eprintln!(
                            "{count} of {nodes} nodes lost (rank {ranks}); the others trained on, a fresh node joined in rank {} and they finished the run",
                            fresh.join(", ")
                        );
                    }
                });
                break;
            }
            if current.on_loss != OnLoss::Resume || outcome.interrupted.is_some() || lost.is_empty() || lost.len() >= current.nodes {
                bar.finish_and_clear();
                return Err(failure);
            }
            // `Common::check` refuses --on-loss resume without a checkpoint directory.
            let Some(dir) = current.checkpoint_dir.clone() else {
                bar.finish_and_clear();
                return Err(failure);
            };
            let (epoch, _) = match resume::latest(&dir) {
                Ok(found) => found,
                Err(e) => {
                    bar.finish_and_clear();
                    return Err(failure.context(format!("--on-loss resume found nothing to resume from: {e:#}")));
                }
            };
            let survivors = current.nodes - lost.len();
            bar.suspend(|| {
                eprintln!(
                    "{} of {} nodes lost ({failure:#}); resuming from the checkpoint after epoch {epoch} on {survivors} nodes, which deal the lost nodes' share of the data among them",
                    lost.len(),
                    current.nodes
                )
            });
            // Epochs after the checkpoint are trained again.
            reports.lock().retain(|r| r.epoch <= epoch);
            (current.nodes, current.resume) = (survivors, Some(dir));
        }
    }
    bar.finish_and_clear();
    let out = std::mem::take(&mut *reports.lock());
    Ok(out)
}

/// Ranks of a failed launch that a signal ended (killed from outside, or crashed) rather than an
/// error of their own: the lost nodes. The launch itself was not interrupted.
fn lost_ranks(outcome: &ferry::launch::LaunchOutcome) -> Vec<usize> {
    let mut lost: Vec<usize> = outcome.ranks.iter().zip(&outcome.statuses).filter(|(_, s)| s.is_some_and(|s| s.signal().is_some())).map(|(&r, _)| r).collect();
    lost.sort_unstable();
    lost.dedup();
    lost
}

/// How a launched cluster run ended: `Ok(())` when every rank succeeded, else how the ranks
/// ended and their last words.
type Launched = std::result::Result<(), (ferry::launch::LaunchOutcome, crate::cluster::RankErrors)>;

/// Launches one cluster run whose reports go to `handle` (training time counted from
/// `elapsed_before`, that of the epochs a resumed run kept). Rank 0 reports; with
/// `--on-loss continue`, after its loss the next live rank does: reports are taken from any
/// rank, an epoch's once.
fn launch_cluster(mut spec: LaunchSpec, elapsed_before: f64, handle: &Arc<Mutex<impl FnMut(Event) + Send + 'static>>, bar: &ProgressBar) -> Result<Launched> {
    spec.timeout = Some(Duration::from_secs(6 * 3600));
    let errors = crate::cluster::RankErrors::default();
    let (held, above, handle) = (errors.clone(), bar.clone(), handle.clone());
    let last_epoch = std::sync::atomic::AtomicUsize::new(0);
    let outcome = launch(&spec, move |rank, stream, line| {
        if stream == Stream::Stderr && held.hold(rank, line) {
            return;
        }
        if stream == Stream::Stdout {
            if let Some(rest) = line.strip_prefix("EPOCH ") {
                match serde_json::from_str::<EpochReport>(rest) {
                    // A rank that took over reporting as its predecessor died may repeat an epoch.
                    Ok(r) if last_epoch.fetch_max(r.epoch, std::sync::atomic::Ordering::Relaxed) >= r.epoch => {}
                    Ok(mut r) => {
                        r.elapsed_s += elapsed_before;
                        (handle.lock())(Event::Epoch(Box::new(r)))
                    }
                    Err(e) => eprintln!("[{rank}] unreadable report ({e})"),
                }
                return;
            }
            for (prefix, evaluating) in [("PROGRESS ", false), ("EVALUATING ", true)] {
                if let Some(rest) = line.strip_prefix(prefix) {
                    let mut parts = rest.split(' ');
                    if let (Some(Ok(epoch)), Some(Ok(f))) = (parts.next().map(str::parse), parts.next().map(str::parse)) {
                        (handle.lock())(if evaluating { Event::Evaluating(epoch, f) } else { Event::Progress(epoch, f) });
                    }
                    return;
                }
            }
        }
        // Above the progress bar, not into it.
        above.suspend(|| eprintln!("[{rank}] {line}"));
    })?;
    if !outcome.success() || outcome.interrupted.is_some() {
        return Ok(Err((outcome, errors)));
    }
    Ok(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dashed_values_are_attached_to_their_flags() {
        let args = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            attach_dashed_values(args(&["--lr", "-1", "--header", "--data", "-odd name", "--reg", "0.5", "--seed", "-"])),
            args(&["--lr=-1", "--header", "--data=-odd name", "--reg", "0.5", "--seed=-"])
        );
    }

    #[test]
    fn a_node_prints_the_first_progress_line_of_each_phase_then_one_per_interval() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut throttle = ProgressThrottle::default();
        assert!(throttle.due(1, false, at(0)), "the first line of a run");
        assert!(!throttle.due(1, false, at(10)) && !throttle.due(1, false, at(99)), "within the interval");
        assert!(throttle.due(1, false, at(100)), "an interval after the last line printed");
        assert!(!throttle.due(1, false, at(150)));
        // A new phase or epoch is shown at once, however soon.
        assert!(throttle.due(1, true, at(151)), "the epoch's evaluation begins");
        assert!(!throttle.due(1, true, at(160)));
        assert!(throttle.due(2, false, at(161)), "the next epoch begins");
        assert!(!throttle.due(2, false, at(260)) && throttle.due(2, false, at(261)));
    }
}
