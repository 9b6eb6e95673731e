//! ComplEx knowledge-graph embeddings trained with AdaGrad and negative sampling.
//!
//! Each entity and relation is one key. With `--adagrad server` (the default in the cluster
//! modes) its value is the embedding `[re(d), im(d)]` and Ferry applies AdaGrad at the key's
//! holder (a server-side updater, the parameter server's Section 3.3): the accumulators stay in
//! the slot, never pulled or pushed. With `--adagrad worker` (and in `single` and `hybrid`,
//! whose replicas take only additive pushes) the value is `[re(d), im(d), acc_re(d), acc_im(d)]`
//! and the trainer computes the step, pushing the embedding's change and the squared gradients. A positive triple `(h, r, t)` is
//! scored `Re⟨h, r, conj(t)⟩`; it is trained with the logistic loss against `neg` corrupted tails
//! and `neg` corrupted heads (entities drawn uniformly, each negative weighted `1/neg`).
//!
//! Distribution (Lapse, section 4 and appendix A): relations are data-clustered — triples are
//! partitioned by relation and each node localizes its relations once — and entities use latency
//! hiding — while a worker trains triple `i`, it localizes the entities of triple `i + lookahead`
//! (including that triple's pre-drawn negatives).

use std::collections::{HashSet, VecDeque};

use anyhow::{Context, Result, bail};
use clap::Args;
use ferry::{DistributionId, KeyDistribution, SampleHandle, SamplingScheme, TableSpec, Updater};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::checkpoint_model::{Described, Description};
use super::epochs::{Fields, Measured, Model, ModelReader, ModelTable, Pass, Quality, Trainer, Workload};
use super::mf::initial;
use super::shared::{METRIC_FIELDS, field};
use super::simd;
use super::{Common, Event, Mode, Sink};
use crate::data::triples::{KnowledgeGraph, Triples};

/// Options of `train kge`.
#[derive(Debug, Clone, Args)]
pub struct KgeArgs {
    /// Knowledge graph: `umls`, `kinships`, `nations`, `film`, `wordnet` (fetched into the cache),
    /// `synth-kg` (generated, for tests), a directory with `train.txt`, `valid.txt` and
    /// `test.txt`, or one file of `head relation tail` triples (split 90/5/5). --train, --valid
    /// and --test give files of your own instead.
    #[arg(long, default_value = "umls")]
    pub data: String,
    /// Complex dimension of the embeddings (each holds 2 × dim floats).
    #[arg(long, default_value_t = 100)]
    pub dim: usize,
    /// AdaGrad learning rate.
    #[arg(long, default_value_t = 0.1)]
    pub lr: f32,
    /// Corrupted tails and corrupted heads per positive triple.
    #[arg(long, default_value_t = 10)]
    pub neg: usize,
    /// L2 regularisation of the embeddings a triple touches.
    #[arg(long, default_value_t = 1e-4)]
    pub reg: f32,
    /// Evaluate filtered MRR and Hits@k on the test split every this many epochs (and after the
    /// last).
    #[arg(long, default_value_t = 10)]
    pub eval_every: usize,
    /// Evaluate at most this many test triples (0: all).
    #[arg(long, default_value_t = 0)]
    pub eval_max: usize,
    /// How many triples ahead a worker localizes entities (latency hiding).
    #[arg(long, default_value_t = 1)]
    pub lookahead: usize,
    /// Intent mode: triples per clock.
    #[arg(long, default_value_t = 16)]
    pub intent_batch: usize,
    /// Intent mode: how many clocks ahead a worker declares the entities it will need (the
    /// engine's action timing decides when to act on them). 24 left fewer accesses late than 16
    /// at about the same epoch time, 32 fewer still but 18 % slower (`docs/PERFORMANCE.md`).
    #[arg(long, default_value_t = 24)]
    pub intent_ahead: usize,
    /// Where AdaGrad runs: `server` (Ferry applies it at the key's holder; the accumulators never
    /// travel), `worker` (the trainer computes the step; values carry the accumulators), `local`
    /// (the trainer computes the step with accumulators of its own, one per entity and relation
    /// in each worker thread, which see that worker's gradients only: values are the embeddings
    /// alone, half of `worker`'s bytes, and pushes add, so keys can be replicated; the
    /// accumulators are not in checkpoints, a resumed run starts them afresh), or `auto`: server
    /// in classic and localize, worker in intent, local in hybrid. `single` runs `local` as
    /// `worker` (its threads share the arrays).
    #[arg(long, default_value = "auto")]
    pub adagrad: String,
    /// Where negatives come from in cluster modes: `direct` (the trainer draws entities
    /// uniformly and accesses them like positives), a Ferry sampling scheme over a uniform
    /// distribution of entities (NuPS 4.4): `independent` (L1), `reuse[:POOL:USES]` (L2),
    /// `postpone[:POOL:USES]` (L3), `local` (L4), or `auto`: `local` in hybrid mode (every
    /// negative a key this node holds or replicates: no negative travels), `direct` in the
    /// others.
    #[arg(long, default_value = "auto")]
    pub negatives: String,
    /// Deal the training triples to the nodes by co-partitioning them with the entities they
    /// touch (Duan and Wu, Algorithms 1–2; `ferry::copartition`, computed by every node alike
    /// when the data is loaded) and home each entity where the plan says, instead of dealing
    /// triples by relation over hash homes: in every cluster mode with this flag, in hybrid
    /// mode unless --no-copartition. In hybrid mode (unless --replicate says how many) the
    /// entities that two or more nodes' triples share are the ones replicated, so that with
    /// local negatives every access is local.
    #[arg(long, conflicts_with = "no_copartition")]
    pub copartition: bool,
    /// Hybrid mode: deal triples by relation over hash homes, and replicate the hot entities
    /// NuPS's way (by access counts), instead of co-partitioning.
    #[arg(long)]
    pub no_copartition: bool,
    /// Own data files.
    #[command(flatten)]
    pub files: super::DataFiles,
    /// Instead of training: for each `head relation` line of this file, rank every entity as the
    /// tail with a model saved by --save (given with --model); prints the --top best as
    /// `head<TAB>relation<TAB>rank<TAB>tail<TAB>score` lines.
    #[arg(long, requires = "model")]
    pub rank_tails: Option<std::path::PathBuf>,
    /// A model directory written by --save (for --rank-tails).
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// How many tails --rank-tails prints per query.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Options shared by all tasks.
    #[command(flatten)]
    pub common: Common,
}

impl KgeArgs {
    /// The model as saved: the embeddings (real parts, then imaginary parts; AdaGrad state kept
    /// beside them is left out) with the names of entities and relations.
    fn description<'a>(&self, kg: &'a KnowledgeGraph) -> Description<'a> {
        let cols = 2 * self.dim;
        let meta = serde_json::json!({ "model": "ComplEx", "dim": self.dim, "layout": "dim real parts, then dim imaginary parts; score(h, r, t) = Re(<h, r, conj(t)>)" });
        let tables =
            vec![Described { name: "entities", source: 0, cols, ids: &kg.entities }, Described { name: "relations", source: 1, cols, ids: &kg.relations }];
        Description { task: "kge", meta, tables }
    }
}

/// `--rank-tails`: the best tails a saved ComplEx model gives each `head relation` query.
pub fn rank_tails(a: &KgeArgs) -> Result<()> {
    use std::io::Write;
    let (Some(queries), Some(dir)) = (&a.rank_tails, &a.model) else { bail!("--rank-tails needs --model DIR (a model saved with --save)") };
    let model = super::model::load_task(dir, "kge", "knowledge-graph embeddings")?;
    let (ents, rels) = (model.table("entities")?, model.table("relations")?);
    if ents.cols != rels.cols || ents.cols == 0 || ents.cols % 2 != 0 {
        bail!("{}: entities have {} values per row and relations {} (two halves of one dimension expected)", dir.display(), ents.cols, rels.cols);
    }
    let d = ents.cols / 2;
    let (entity_rows, relation_rows) = (ents.index(), rels.index());
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut query = vec![0.0f32; 2 * d];
    let mut scores = vec![0.0f32; ents.ids.len()];
    a.files.read_name_pairs(queries, |head, relation| {
        let h = *entity_rows.get(head).with_context(|| format!("entity '{head}' is not in the model"))?;
        let r = *relation_rows.get(relation).with_context(|| format!("relation '{relation}' is not in the model"))?;
        let (hv, rv) = (ents.row(h), rels.row(r));
        for k in 0..d {
            query[k] = hv[k] * rv[k] - hv[d + k] * rv[d + k];
            query[d + k] = hv[k] * rv[d + k] + hv[d + k] * rv[k];
        }
        simd::dot_rows(&ents.data, ents.cols, &query, &mut scores);
        let mut scored: Vec<(f32, usize)> = scores.iter().copied().zip(0..).collect();
        let top = a.top.min(scored.len());
        if top > 0 && top < scored.len() {
            scored.select_nth_unstable_by(top - 1, |x, y| y.0.total_cmp(&x.0));
        }
        scored.truncate(top);
        scored.sort_unstable_by(|x, y| y.0.total_cmp(&x.0));
        for (rank, (score, tail)) in scored.iter().enumerate() {
            writeln!(out, "{head}\t{relation}\t{}\t{}\t{score:.4}", rank + 1, ents.ids[*tail])?;
        }
        Ok(())
    })?;
    out.flush()?;
    Ok(())
}

/// The named knowledge graphs.
const KNOWN: &[&str] = &["umls", "kinships", "nations", "film", "wordnet", "synth-kg"];

const ADAGRAD_EPS: f32 = 1e-10;
const INITIAL_ACCUMULATOR: f32 = 0.1;

impl super::Task for KgeArgs {
    fn name(&self) -> &'static str {
        "kge"
    }

    fn common(&self) -> &super::Common {
        &self.common
    }

    /// Driver side: makes named data available; returns a description.
    fn prepare(&self) -> Result<String> {
        self.check()?;
        self.files.check()?;
        if let (Some(train), Some(test)) = (&self.files.train, &self.files.test) {
            return Ok(format!("triples from {} (train) and {} (test)", train.display(), test.display()));
        }
        match self.data.as_str() {
            "umls" | "kinships" | "nations" => {
                crate::data::fetch(&self.data)?;
                Ok(format!("{} (pykeen's train/valid/test split)", self.data))
            }
            "synth-kg" => Ok("synth-kg: a planted ComplEx graph, 30 relations over 40 entities".into()),
            "film" => {
                crate::data::fetch("film")?;
                Ok("film graph of MovieLens-100k (one relation of each inverse pair dropped, split 90/5/5)".into())
            }
            "wordnet" => {
                crate::data::fetch("wordnet")?;
                Ok("WordNet 3.0's synsets (one relation of each inverse pair dropped, split 90/5/5)".into())
            }
            path => Ok(format!("triples from {}", super::user_data(path, KNOWN, true)?.display())),
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
            "--dim".into(),
            self.dim.to_string(),
            "--lr".into(),
            self.lr.to_string(),
            "--neg".into(),
            self.neg.to_string(),
            "--reg".into(),
            self.reg.to_string(),
            "--eval-every".into(),
            self.eval_every.to_string(),
            "--eval-max".into(),
            self.eval_max.to_string(),
            "--lookahead".into(),
            self.lookahead.to_string(),
            "--intent-batch".into(),
            self.intent_batch.to_string(),
            "--intent-ahead".into(),
            self.intent_ahead.to_string(),
            "--negatives".into(),
            self.negatives.clone(),
            "--adagrad".into(),
            self.adagrad.clone(),
        ]
        .into_iter()
        .chain(self.copartition.then(|| "--copartition".to_string()))
        .chain(self.no_copartition.then(|| "--no-copartition".to_string()))
        .chain(self.files.args())
        .collect()
    }

    fn train(&self, mode: Mode, emit: Sink) -> Result<()> {
        super::epochs::run(self, mode, emit)
    }

    fn run_other(&self) -> Result<bool> {
        if self.rank_tails.is_none() {
            return Ok(false);
        }
        rank_tails(self)?;
        Ok(true)
    }
}

impl KgeArgs {
    /// The sampling scheme for negatives in `mode`, `None` for trainer-drawn ones.
    pub fn negative_scheme(&self, mode: Mode) -> Result<Option<SamplingScheme>> {
        match self.negatives.as_str() {
            "auto" if mode == Mode::Hybrid => Ok(Some(SamplingScheme::Local)),
            "direct" | "auto" => Ok(None),
            s => Ok(Some(SamplingScheme::parse(s).with_context(|| format!("--negatives {s}: expected direct or a sampling scheme"))?)),
        }
    }

    /// Refuses options that cannot train.
    fn check(&self) -> Result<()> {
        if self.dim == 0 || self.neg == 0 {
            bail!("--dim and --neg must be at least 1");
        }
        if !(self.lr.is_finite() && self.lr > 0.0 && self.reg.is_finite() && self.reg >= 0.0) {
            bail!("--lr must be a positive number and --reg a number at least 0 (not {} and {})", self.lr, self.reg);
        }
        self.negative_scheme(Mode::Hybrid)?;
        Ok(())
    }

    /// The graph (identical in every process).
    pub fn load(&self) -> Result<KnowledgeGraph> {
        self.check()?;
        let format = self.files.format();
        if let (Some(train), Some(test)) = (&self.files.train, &self.files.test) {
            return KnowledgeGraph::load_files(train, self.files.valid.as_deref(), test, format);
        }
        match self.data.as_str() {
            "umls" | "kinships" | "nations" => KnowledgeGraph::load_split(&crate::data::cache_dir().join(&self.data), format),
            "film" => KnowledgeGraph::load_single(&crate::data::dataset_path("film", "ml-100k.kg"), format.with_known_header(), true, self.common.seed),
            "wordnet" => KnowledgeGraph::load_single(&crate::data::dataset_path("wordnet", "triples.tsv"), format, true, self.common.seed),
            "synth-kg" => Ok(KnowledgeGraph::synthetic(40, 30, self.common.seed)),
            path => {
                let p = super::user_data(path, KNOWN, true)?;
                if p.is_dir() { KnowledgeGraph::load_split(&p, format) } else { KnowledgeGraph::load_single(&p, format, false, self.common.seed) }
            }
        }
    }

    /// Whether AdaGrad runs in Ferry (a server-side updater) in `mode`.
    pub fn server_adagrad(&self, mode: Mode) -> Result<bool> {
        match (self.adagrad.as_str(), mode) {
            ("auto" | "server", Mode::Classic | Mode::Localize) | ("server", Mode::Intent) => Ok(true),
            ("auto" | "worker" | "local", _) => Ok(false),
            ("server", Mode::Single) => Ok(false),
            ("server", _) => {
                bail!("--adagrad server: {} replicates keys, and replicas take only additive pushes (use --adagrad worker, local or auto)", mode.name())
            }
            (other, _) => bail!("--adagrad {other}: expected server, worker, local or auto"),
        }
    }

    /// How the trainer's steps update the model in `mode`.
    fn update(&self, mode: Mode) -> Result<Update> {
        Ok(if self.server_adagrad(mode)? {
            Update::Server
        } else if (self.adagrad == "local" || (self.adagrad == "auto" && mode == Mode::Hybrid)) && mode != Mode::Single {
            Update::Local { lr: self.lr }
        } else {
            Update::Worker { lr: self.lr }
        })
    }

    /// Whether `mode` trains on a co-partitioning plan (see `--copartition`).
    fn copartitions(&self, mode: Mode) -> bool {
        mode != Mode::Single && self.common.nodes > 1 && !self.no_copartition && (self.copartition || mode == Mode::Hybrid)
    }

    /// The co-partitioning plan `mode` trains on, if any.
    fn plan<'d>(&self, data: &'d Graph, mode: Mode) -> Option<&'d CoPartition> {
        data.plan.as_ref().filter(|_| self.copartitions(mode))
    }

    fn evaluate_now(&self, epoch: usize) -> bool {
        epoch == self.common.epochs || (self.eval_every > 0 && epoch.is_multiple_of(self.eval_every))
    }
}

fn init_value(seed: u64, table: u64, key: u64, j: usize, dim: usize) -> f32 {
    if j < 2 * dim { 0.1 * initial(seed, table, key, j) } else { INITIAL_ACCUMULATOR }
}

/// A triple with its pre-drawn negatives: corrupted tails, then corrupted heads.
struct Sample {
    h: u32,
    r: u32,
    t: u32,
    negatives: Vec<u32>,
}

impl Sample {
    fn draw(train: &Triples, i: usize, entities: u32, neg: usize, rng: &mut ChaCha8Rng) -> Sample {
        Sample { h: train.heads[i], r: train.relations[i], t: train.tails[i], negatives: (0..2 * neg).map(|_| rng.gen_range(0..entities)).collect() }
    }

    /// The positive triple only: its negatives come from Ferry's sampling API.
    fn positive(train: &Triples, i: usize) -> Sample {
        Sample { h: train.heads[i], r: train.relations[i], t: train.tails[i], negatives: Vec::new() }
    }

    /// Entity keys in slot order: head, tail, negatives.
    fn entity_keys(&self) -> Vec<u64> {
        let mut k = vec![self.h as u64, self.t as u64];
        k.extend(self.negatives.iter().map(|&e| e as u64));
        k
    }
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// A scale and the three gradients it is added to: `(g, ∂a, ∂r, ∂b)`.
type Gradients<'a> = (f32, &'a mut [f32], &'a mut [f32], &'a mut [f32]);

/// Returns `score(a, r, b)` and, given `(g, ga, gr, gb)`, adds the gradient of `g · score` to the
/// three (embeddings are `[re(d), im(d)]`).
#[inline(always)]
fn score_and_grad(a: &[f32], r: &[f32], b: &[f32], d: usize, g: Option<Gradients<'_>>) -> f32 {
    // Every part cut to exactly `d` values, so the loops below carry no bounds checks and
    // vectorise.
    let (ar, ai) = (&a[..d], &a[d..2 * d]);
    let (rr, ri) = (&r[..d], &r[d..2 * d]);
    let (br, bi) = (&b[..d], &b[d..2 * d]);
    // Re⟨a, r, conj(b)⟩ = Σ br·(ar·rr − ai·ri) + bi·(ai·rr + ar·ri).
    let s = simd::dot3(br, ar, rr) - simd::dot3(br, ai, ri) + simd::dot3(bi, ai, rr) + simd::dot3(bi, ar, ri);
    if let Some((g, ga, gr, gb)) = g {
        let (gar, gai) = ga[..2 * d].split_at_mut(d);
        let (grr, gri) = gr[..2 * d].split_at_mut(d);
        let (gbr, gbi) = gb[..2 * d].split_at_mut(d);
        for k in 0..d {
            gar[k] += g * (rr[k] * br[k] + ri[k] * bi[k]);
            gai[k] += g * (rr[k] * bi[k] - ri[k] * br[k]);
            grr[k] += g * (ar[k] * br[k] + ai[k] * bi[k]);
            gri[k] += g * (ar[k] * bi[k] - ai[k] * br[k]);
            gbr[k] += g * (ar[k] * rr[k] - ai[k] * ri[k]);
            gbi[k] += g * (ai[k] * rr[k] + ar[k] * ri[k]);
        }
    }
    s
}

/// How a step turns gradients into pushes.
#[derive(Debug, Clone, Copy)]
enum Update {
    /// Values are `[embedding(2d), accumulators(2d)]`; the pushes are `[Δembedding, g²]`.
    Worker { lr: f32 },
    /// Values are the embedding (`2d`); the pushes are the gradients, for Ferry's AdaGrad.
    Server,
    /// Values are the embedding (`2d`); the pushes are `Δembedding`, from the worker's own
    /// accumulators (`--adagrad local`).
    Local { lr: f32 },
}

impl Update {
    fn value_len(self, d: usize) -> usize {
        match self {
            Update::Worker { .. } => 4 * d,
            Update::Server | Update::Local { .. } => 2 * d,
        }
    }
}

/// One training step. `ents` holds the pulled values of the sample's entity slots, `rel` the
/// relation's. Writes the pushes to `ent_out` and `rel_out` (see [`Update`]); returns the loss.
/// With [`Update::Local`], `acc` holds the slots' accumulators and then the relation's, and the
/// step adds to them each squared gradient `scales[slot]` times.
#[allow(clippy::too_many_arguments)]
#[multiversion::multiversion(targets = "simd")]
fn step(
    ents: &[f32],
    rel: &[f32],
    d: usize,
    neg: usize,
    update: Update,
    reg: f32,
    grads: &mut [f32],
    acc: &mut [f32],
    scales: &[f32],
    ent_out: &mut [f32],
    rel_out: &mut [f32],
) -> f32 {
    let len = update.value_len(d);
    let slots = 2 + 2 * neg;
    let emb = |slot: usize| &ents[slot * len..slot * len + 2 * d];
    grads.fill(0.0);
    // grads: one 2d gradient per entity slot, then the relation's.
    let (ent_g, rel_g) = grads.split_at_mut(slots * 2 * d);
    let wneg = 1.0 / neg as f32;
    let mut loss = 0.0;
    let apply = |a: usize, b: usize, positive: bool, ent_g: &mut [f32], rel_g: &mut [f32]| {
        let sc = score_and_grad(emb(a), &rel[..2 * d], emb(b), d, None);
        let (l, g) = if positive { (softplus(-sc), sigmoid(sc) - 1.0) } else { (wneg * softplus(sc), wneg * sigmoid(sc)) };
        let (lo, hi) = (a.min(b), a.max(b));
        let (first, rest) = ent_g.split_at_mut(hi * 2 * d);
        let (ga, gb): (&mut [f32], &mut [f32]) = if a == lo {
            (&mut first[lo * 2 * d..(lo + 1) * 2 * d], &mut rest[..2 * d])
        } else {
            (&mut rest[..2 * d], &mut first[lo * 2 * d..(lo + 1) * 2 * d])
        };
        score_and_grad(emb(a), &rel[..2 * d], emb(b), d, Some((g, ga, rel_g, gb)));
        l
    };
    loss += apply(0, 1, true, ent_g, rel_g);
    for j in 0..neg {
        loss += apply(0, 2 + j, false, ent_g, rel_g);
        loss += apply(2 + neg + j, 1, false, ent_g, rel_g);
    }
    let adagrad = |g: &mut [f32], value: &[f32], own: &mut [f32], scale: f32, out: &mut [f32]| {
        for k in 0..2 * d {
            let gk = g[k] + reg * value[k];
            match update {
                Update::Worker { lr } => {
                    let acc = value[2 * d + k] + gk * gk;
                    out[k] = -lr * gk / (acc.sqrt() + ADAGRAD_EPS);
                    out[2 * d + k] = gk * gk;
                }
                Update::Local { lr } => {
                    own[k] += scale * gk * gk;
                    out[k] = -lr * gk / (own[k].sqrt() + ADAGRAD_EPS);
                }
                Update::Server => out[k] = gk,
            }
        }
    };
    let local = matches!(update, Update::Local { .. });
    for slot in 0..slots {
        let (own, scale): (&mut [f32], f32) = if local { (&mut acc[slot * 2 * d..(slot + 1) * 2 * d], scales[slot]) } else { (&mut [], 1.0) };
        adagrad(&mut ent_g[slot * 2 * d..(slot + 1) * 2 * d], &ents[slot * len..(slot + 1) * len], own, scale, &mut ent_out[slot * len..(slot + 1) * len]);
    }
    let (own, scale): (&mut [f32], f32) = if local { (&mut acc[slots * 2 * d..(slots + 1) * 2 * d], scales[slots]) } else { (&mut [], 1.0) };
    adagrad(rel_g, rel, own, scale, rel_out);
    loss
}

/// Filtered MRR and Hits@1/3/10 of `test` (both directions), on `threads` threads.
#[allow(clippy::too_many_arguments)]
fn evaluate(
    ents: &[f32],
    rels: &[f32],
    d: usize,
    len: usize,
    n_entities: usize,
    test: &Triples,
    known: &HashSet<(u32, u32, u32)>,
    max: usize,
    threads: usize,
    progress: &(dyn Fn(f64) + Sync),
) -> serde_json::Map<String, serde_json::Value> {
    let n = if max == 0 { test.len() } else { test.len().min(max) };
    let results: Vec<(f64, [usize; 3], usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|part| {
                s.spawn(move || {
                    let (mut rr_sum, mut hits, mut queries) = (0.0f64, [0usize; 3], 0usize);
                    let mut query = vec![0.0f32; 2 * d];
                    let mut scores = vec![0.0f32; n_entities];
                    for i in (part..n).step_by(threads) {
                        if part == 0 && (i / threads).is_multiple_of(64) {
                            progress(i as f64 / n.max(1) as f64);
                        }
                        let (h, r, t) = (test.heads[i], test.relations[i], test.tails[i]);
                        let rel = &rels[r as usize * len..r as usize * len + 2 * d];
                        let emb = |e: u32| &ents[e as usize * len..e as usize * len + 2 * d];
                        for tail_side in [true, false] {
                            // score(x) = Σ query · emb(x) for every candidate x.
                            let (a, b) = (emb(h), emb(t));
                            for k in 0..d {
                                let (rr, ri) = (rel[k], rel[d + k]);
                                if tail_side {
                                    query[k] = a[k] * rr - a[d + k] * ri;
                                    query[d + k] = a[k] * ri + a[d + k] * rr;
                                } else {
                                    query[k] = rr * b[k] + ri * b[d + k];
                                    query[d + k] = rr * b[d + k] - ri * b[k];
                                }
                            }
                            simd::dot_rows(ents, len, &query, &mut scores);
                            let truth = if tail_side { t } else { h };
                            let true_score = scores[truth as usize];
                            let (mut higher, mut ties) = (0usize, 0usize);
                            for (x, &sc) in scores.iter().enumerate() {
                                let x = x as u32;
                                // The score first: only the few candidates that outrank or
                                // tie the truth are looked up among the known triples (a NaN
                                // score outranks nothing, as before).
                                let outranks = match sc.partial_cmp(&true_score) {
                                    Some(std::cmp::Ordering::Greater) => true,
                                    Some(std::cmp::Ordering::Equal) => false,
                                    _ => continue,
                                };
                                if x == truth || if tail_side { known.contains(&(h, r, x)) } else { known.contains(&(x, r, t)) } {
                                    continue;
                                }
                                if outranks {
                                    higher += 1;
                                } else {
                                    ties += 1;
                                }
                            }
                            let rank = 1.0 + higher as f64 + ties as f64 / 2.0;
                            rr_sum += 1.0 / rank;
                            for (slot, k) in [1.0, 3.0, 10.0].iter().enumerate() {
                                if rank <= *k {
                                    hits[slot] += 1;
                                }
                            }
                            queries += 1;
                        }
                    }
                    (rr_sum, hits, queries)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("evaluation thread")).collect()
    });
    let (mut rr, mut hits, mut q) = (0.0, [0usize; 3], 0usize);
    for (a, b, c) in results {
        rr += a;
        for k in 0..3 {
            hits[k] += b[k];
        }
        q += c;
    }
    let q = q.max(1) as f64;
    let mut m = serde_json::Map::new();
    m.insert("mrr".into(), (rr / q).into());
    m.insert("hits@1".into(), (hits[0] as f64 / q).into());
    m.insert("hits@3".into(), (hits[1] as f64 / q).into());
    m.insert("hits@10".into(), (hits[2] as f64 / q).into());
    m.insert("test_triples".into(), ((q / 2.0) as u64).into());
    m
}

fn eval_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).min(8)
}

/// The graph, and the triples known to be true (for the filtered ranking; made when first
/// evaluated, by the reporter alone).
pub struct Graph {
    kg: KnowledgeGraph,
    known: std::sync::OnceLock<HashSet<(u32, u32, u32)>>,
    /// With --copartition on more than one node: the plan, and who uses what.
    plan: Option<CoPartition>,
}

impl Workload for KgeArgs {
    type Data = Graph;

    fn load(&self) -> Result<Graph> {
        let kg = KgeArgs::load(self)?;
        let wanted = self.common.modes().any(|m| self.copartitions(m));
        let plan = if wanted { Some(copartition(&kg, self.common.nodes, self.common.seed)?) } else { None };
        Ok(Graph { kg, known: std::sync::OnceLock::new(), plan })
    }

    fn model(&self, data: &Graph, mode: Mode) -> Result<Model> {
        let kg = &data.kg;
        let update = self.update(mode)?;
        let (seed, d, len) = (self.common.seed, self.dim, update.value_len(self.dim));
        let (n_e, n_r) = (kg.entities.len(), kg.relations.len());
        if mode == Mode::Intent && self.negative_scheme(mode)?.is_some() {
            bail!("--mode intent: the trainer declares the negatives it draws, so use --negatives direct");
        }
        if mode == Mode::Intent && (self.intent_batch == 0 || self.intent_ahead == 0) {
            bail!("--intent-batch and --intent-ahead must be at least 1");
        }
        let updater =
            if matches!(update, Update::Server) { Updater::Adagrad { lr: self.lr, eps: ADAGRAD_EPS, init: INITIAL_ACCUMULATOR } } else { Updater::Add };
        let (mut entity_spec, mut relation_spec) =
            (TableSpec::new("entities", n_e as u64, len).with_updater(updater.clone()), TableSpec::new("relations", n_r as u64, len).with_updater(updater));
        let mut notes = Vec::new();
        if mode != Mode::Single {
            (entity_spec, relation_spec) = (self.common.on_the_wire(entity_spec)?, self.common.on_the_wire(relation_spec)?);
        }
        // The entities two or more nodes' triples touch (hybrid mode replicates them).
        let copartition = self.plan(data, mode);
        let shared = copartition.map(|c| ferry::copartition::shared(&c.entity_users));
        if let (Some(CoPartition { plan, .. }), Some(shared)) = (copartition, &shared) {
            let per_node: Vec<usize> = (0..plan.nodes()).map(|n| plan.examples_of(n).count()).collect();
            notes.push(format!("co-partitioned: {:?} training triples per node, {} of {n_e} entities used by more than one node", per_node, shared.len()));
            entity_spec = entity_spec.placed(plan.placement.clone());
        }
        if mode == Mode::Hybrid {
            // NuPS's choice (Section 5.1): hot entities and every relation replicated, the long
            // tail of entities relocated; with --copartition the entities the plan's nodes
            // share are the hot ones.
            let mut counts = ferry::AccessCounts::new(n_e as u64);
            for i in 0..kg.train.len() {
                counts.add(kg.train.heads[i] as u64, 1);
                counts.add(kg.train.tails[i] as u64, 1);
            }
            let hot = match shared {
                Some(shared) if self.common.replicate == 0 => shared,
                _ => self.common.hot_keys(&counts),
            };
            notes.push(format!(
                "hybrid: {} of {n_e} entities replicated ({:.1}% of positive accesses), all {n_r} relations",
                hot.len(),
                100.0 * counts.share(&hot)
            ));
            entity_spec = entity_spec.replicating(ferry::as_ranges(&hot));
            relation_spec = relation_spec.replicating(std::iter::once(0..n_r as u64));
        }
        Ok(Model {
            tables: vec![
                ModelTable::init(entity_spec, move |k, j| init_value(seed, 0, k, j, d)),
                ModelTable::init(relation_spec, move |k, j| init_value(seed, 1, k, j, d)),
            ],
            notes,
        })
    }

    fn trainer<'a>(&'a self, data: &'a Graph, pass: &mut Pass<'_>) -> Result<Box<dyn Trainer + 'a>> {
        let kg = &data.kg;
        let update = self.update(pass.mode)?;
        let (len, slots) = (update.value_len(self.dim), 2 + 2 * self.neg);
        let buffers = Buffers {
            keys: vec![0u64; slots],
            ev: vec![0.0; slots * len],
            rv: vec![0.0; len],
            eo: vec![0.0; slots * len],
            ro: vec![0.0; len],
            grads: vec![0.0; (slots + 1) * 2 * self.dim],
            acc: vec![0.0; (slots + 1) * 2 * self.dim],
            scales: vec![1.0; slots + 1],
        };
        if pass.mode == Mode::Single {
            return Ok(Box::new(KgeTrainer { a: self, kg, mine: (0..kg.train.len()).collect(), update, len, buffers, negatives: None, accumulators: None }));
        }
        let copartition = self.plan(data, pass.mode);
        let accumulators = matches!(update, Update::Local { .. }).then(|| {
            // How many nodes train each key: from the plan, or every node for an entity and the
            // relation's owner alone (triples are dealt by relation).
            let (entities, relations) = match copartition {
                Some(c) => (c.entity_users.iter().map(|&u| u.max(1) as f32).collect(), c.relation_users.iter().map(|&u| u.max(1) as f32).collect()),
                None => (vec![pass.nodes as f32; kg.entities.len()], vec![1.0; kg.relations.len()]),
            };
            Accumulators::new(entities, relations, 2 * self.dim)
        });
        let (rank, nodes, t, threads) = (pass.rank, pass.nodes, pass.thread, pass.threads);
        let (localize, hybrid, intent) = (matches!(pass.mode, Mode::Localize | Mode::Hybrid), pass.mode == Mode::Hybrid, pass.mode == Mode::Intent);
        let n_r = kg.relations.len();
        let owners = relation_owners(&kg.train, n_r, nodes);
        let mine: Vec<usize> = match copartition {
            Some(c) => c.plan.examples_of(rank).skip(t).step_by(threads).collect(),
            None => (0..kg.train.len()).filter(|&i| owners[kg.train.relations[i] as usize] == rank).skip(t).step_by(threads).collect(),
        };
        let my_relations: Vec<u64> = (0..n_r).filter(|&r| owners[r] == rank).map(|r| r as u64).collect();
        let scheme = self.negative_scheme(pass.mode)?;
        let (w, tables) = pass.node().expect("a cluster's pass has a worker");
        if localize && !hybrid && t == 0 && copartition.is_none() {
            // Data clustering: this node's relations stay here.
            w.localize(tables[1], &my_relations)?;
        }
        if intent && copartition.is_none() {
            // The same, said as intent: this node's relations, for the whole run.
            w.intent(tables[1], &my_relations, 0, u64::MAX)?;
        }
        let negatives = match scheme {
            Some(scheme) => Some(w.register_distribution(tables[0], KeyDistribution::uniform(0..kg.entities.len() as u64), scheme)?),
            None => None,
        };
        Ok(Box::new(KgeTrainer { a: self, kg, mine, update, len, buffers, negatives, accumulators }))
    }

    fn reads_model(&self, epoch: usize) -> bool {
        self.evaluate_now(epoch) || self.common.save_now(epoch)
    }

    fn describe<'a>(&self, data: &'a Graph) -> Option<Description<'a>> {
        Some(self.description(&data.kg))
    }

    fn evaluate(&self, data: &Graph, epoch: usize, model: &mut ModelReader<'_>, _: &Fields, _: Measured, emit: &(dyn Fn(Event) + Sync)) -> Result<Quality> {
        let (evaluating, saving) = (self.evaluate_now(epoch), self.common.save_now(epoch));
        if !(evaluating || saving) {
            return Ok(Quality::new());
        }
        let (kg, d) = (&data.kg, self.dim);
        let (e_all, r_all) = (model.all(0)?, model.all(1)?);
        let len = e_all.len() / kg.entities.len().max(1);
        if saving {
            let d = self.description(kg);
            self.common.save_model(&d, epoch, &[d.saved(0, &e_all, len), d.saved(1, &r_all, len)])?;
        }
        if !evaluating {
            return Ok(Quality::new());
        }
        let known = data.known.get_or_init(|| kg.known());
        let progress = |f: f64| emit(Event::Evaluating(epoch, f));
        Ok(evaluate(&e_all, &r_all, d, len, kg.entities.len(), &kg.test, known, self.eval_max, eval_threads(), &progress))
    }
}

/// A training thread's buffers for one triple: its entities' keys, values and changes, the
/// relation's value and change, and the gradients.
struct Buffers {
    keys: Vec<u64>,
    ev: Vec<f32>,
    rv: Vec<f32>,
    eo: Vec<f32>,
    ro: Vec<f32>,
    grads: Vec<f32>,
    /// `--adagrad local`: the accumulators of the triple's entity slots and relation, and how
    /// many times each counts a squared gradient.
    acc: Vec<f32>,
    scales: Vec<f32>,
}

/// One thread's share of the triples: `single`'s every `threads`-th of a shuffled order (Hogwild
/// over the shared arrays), a cluster thread's of its node's relations (with its entities
/// localized ahead, declared as intent, or sampled by Ferry).
struct KgeTrainer<'a> {
    a: &'a KgeArgs,
    kg: &'a KnowledgeGraph,
    /// The triples this thread trains (`single`: all of them, shared by the threads).
    mine: Vec<usize>,
    update: Update,
    len: usize,
    buffers: Buffers,
    /// Negatives drawn by Ferry under a sampling scheme (`--negatives`).
    negatives: Option<DistributionId>,
    /// `--adagrad local`: this thread's own AdaGrad accumulators.
    accumulators: Option<Accumulators>,
}

/// A worker's own AdaGrad accumulators (`--adagrad local`): `width` floats per entity and per
/// relation, from the initial accumulator on. A worker sees only its own gradients of a key that
/// `n` nodes train, so it counts each squared gradient `n` times: an estimate of the sum over
/// every node's, which the steps' size depends on (counted once, a key four nodes train took
/// twice the steps it should, and WordNet's MRR fell to 0.22 from `single`'s 0.30).
struct Accumulators {
    entities: Vec<f32>,
    relations: Vec<f32>,
    /// Per entity and per relation: the nodes that train it.
    entity_scale: Vec<f32>,
    relation_scale: Vec<f32>,
    width: usize,
}

impl Accumulators {
    fn new(entity_scale: Vec<f32>, relation_scale: Vec<f32>, width: usize) -> Accumulators {
        Accumulators {
            entities: vec![INITIAL_ACCUMULATOR; entity_scale.len() * width],
            relations: vec![INITIAL_ACCUMULATOR; relation_scale.len() * width],
            entity_scale,
            relation_scale,
            width,
        }
    }

    /// Copies the accumulators of a triple's entity slots (`entities`), then its relation's,
    /// into `out`, and their scales into `scales`.
    fn gather(&self, entities: &[u64], relation: u64, out: &mut [f32], scales: &mut [f32]) {
        let w = self.width;
        for (slot, &e) in entities.iter().enumerate() {
            out[slot * w..(slot + 1) * w].copy_from_slice(&self.entities[e as usize * w..(e as usize + 1) * w]);
            scales[slot] = self.entity_scale[e as usize];
        }
        let at = entities.len() * w;
        out[at..at + w].copy_from_slice(&self.relations[relation as usize * w..(relation as usize + 1) * w]);
        scales[entities.len()] = self.relation_scale[relation as usize];
    }

    /// Writes back what [`Accumulators::gather`] copied, as the step left it (an entity in two
    /// slots keeps its later slot's).
    fn scatter(&mut self, entities: &[u64], relation: u64, from: &[f32]) {
        let w = self.width;
        for (slot, &e) in entities.iter().enumerate() {
            self.entities[e as usize * w..(e as usize + 1) * w].copy_from_slice(&from[slot * w..(slot + 1) * w]);
        }
        let at = entities.len() * w;
        self.relations[relation as usize * w..(relation as usize + 1) * w].copy_from_slice(&from[at..at + w]);
    }
}

impl KgeTrainer<'_> {
    /// `single`: the threads' shares of one shuffled order.
    fn single_epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<(f64, usize)> {
        let (a, kg, len) = (self.a, self.kg, self.len);
        let (seed, d, t, threads, n_e) = (a.common.seed, a.dim, pass.thread, pass.threads, kg.entities.len());
        // One order of every triple, shuffled anew each epoch from the first order (every thread
        // the same way): an epoch's order depends on the epoch alone, so a run resumed from a
        // checkpoint trains as the uninterrupted one would have.
        let mut order = self.mine.clone();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ ((epoch as u64) << 20)));
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((epoch as u64) << 32) ^ t as u64);
        let Buffers { keys, ev, rv, eo, ro, grads, acc, scales } = &mut self.buffers;
        let (mut loss, mut n) = (0.0f64, 0usize);
        let mine: Vec<usize> = order.iter().copied().skip(t).step_by(threads).collect();
        for (x, &i) in mine.iter().enumerate() {
            let sample = Sample::draw(&kg.train, i, n_e as u32, a.neg, &mut rng);
            keys.clear();
            keys.extend(sample.entity_keys());
            pass.pull(0, keys, ev)?;
            pass.pull(1, &[sample.r as u64], rv)?;
            loss += step(ev, rv, d, a.neg, self.update, a.reg, grads, acc, scales, eo, ro) as f64;
            pass.push(0, keys, &eo[..keys.len() * len])?;
            pass.push(1, &[sample.r as u64], ro)?;
            n += 1;
            if x.is_multiple_of(512) {
                pass.progress(epoch, x as f64 / mine.len().max(1) as f64);
            }
        }
        Ok((loss, n))
    }

    /// A cluster thread: its triples in a new order, their entities moved here ahead (localize),
    /// declared for their clock (intent), or their negatives drawn by Ferry.
    fn node_epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<(f64, usize)> {
        let (a, kg, len) = (self.a, self.kg, self.len);
        let (seed, d, rank, t, n_e) = (a.common.seed, a.dim, pass.rank, pass.thread, kg.entities.len());
        let (localize, intent) = (matches!(pass.mode, Mode::Localize | Mode::Hybrid), pass.mode == Mode::Intent);
        let slots = 2 + 2 * a.neg;
        let negatives = self.negatives;
        let mut order = self.mine.clone();
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((epoch as u64) << 32) ^ ((rank as u64) << 16) ^ t as u64);
        order.shuffle(&mut rng);
        let Buffers { keys, ev, rv, eo, ro, grads, acc, scales } = &mut self.buffers;
        let (w, tables) = pass.node().expect("a cluster's pass has a worker");
        let (entities, relations) = (tables[0], tables[1]);
        let (mut loss, mut n) = (0.0f64, 0usize);
        // Samples drawn ahead, so that their entities can be localized ahead.
        let mut ahead: VecDeque<(Sample, Option<SampleHandle>)> = VecDeque::new();
        let mut tickets: VecDeque<ferry::Ticket> = VecDeque::new();
        let mut next = 0usize;
        // Intent mode: triple `x` of the epoch is trained in clock `base + x / batch`; its
        // entities are declared for that clock when it is drawn, `intent_ahead` clocks early.
        let (batch, base) = (a.intent_batch.max(1), w.current_clock());
        let lookahead = if intent { a.intent_ahead * batch } else { a.lookahead };
        let mut declared: Vec<u64> = Vec::new();
        let mut fill = |ahead: &mut VecDeque<(Sample, Option<SampleHandle>)>, w: &mut ferry::Worker| -> Result<()> {
            while ahead.len() <= lookahead && next < order.len() {
                let (sample, handle) = match negatives {
                    // Ferry draws the negatives and moves them here as the scheme says.
                    Some(dist) => (Sample::positive(&kg.train, order[next]), Some(w.prepare_sample(dist, 2 * a.neg)?)),
                    None => (Sample::draw(&kg.train, order[next], n_e as u32, a.neg, &mut rng), None),
                };
                if localize {
                    tickets.push_back(w.localize_async(entities, &sample.entity_keys())?);
                }
                if intent {
                    declared.extend(sample.entity_keys());
                    if (next + 1).is_multiple_of(batch) || next + 1 == order.len() {
                        let clock = base + (next / batch) as u64;
                        declared.sort_unstable();
                        declared.dedup();
                        w.intent(entities, &declared, clock, clock + 1)?;
                        declared.clear();
                    }
                }
                ahead.push_back((sample, handle));
                next += 1;
            }
            while tickets.len() > 2 * a.lookahead + 4 {
                let t = tickets.pop_front().expect("non-empty");
                w.wait(t)?;
            }
            Ok(())
        };
        let total = order.len();
        let mut x = 0usize;
        loop {
            let (w, _) = pass.node().expect("a cluster's pass has a worker");
            fill(&mut ahead, w)?;
            let Some((sample, handle)) = ahead.pop_front() else { break };
            match handle {
                None => {
                    keys.clear();
                    keys.extend(sample.entity_keys());
                    w.pull(entities, keys, ev)?;
                }
                Some(mut handle) => {
                    keys.clear();
                    keys.extend([sample.h as u64, sample.t as u64]);
                    keys.resize(slots, 0);
                    w.pull(entities, &keys[..2], &mut ev[..2 * len])?;
                    w.pull_sample(&mut handle, &mut keys[2..], &mut ev[2 * len..])?;
                }
            }
            w.pull(relations, &[sample.r as u64], rv)?;
            if let Some(own) = &self.accumulators {
                own.gather(keys, sample.r as u64, acc, scales);
            }
            loss += step(ev, rv, d, a.neg, self.update, a.reg, grads, acc, scales, eo, ro) as f64;
            if let Some(own) = &mut self.accumulators {
                own.scatter(keys, sample.r as u64, acc);
            }
            w.push(entities, keys, eo)?;
            w.push(relations, &[sample.r as u64], ro)?;
            n += 1;
            x += 1;
            if intent && (x.is_multiple_of(batch) || x == total) {
                w.advance_clock()?;
            }
            if x.is_multiple_of(512) {
                pass.progress(epoch, x as f64 / total.max(1) as f64);
            }
        }
        let (w, _) = pass.node().expect("a cluster's pass has a worker");
        for ticket in tickets {
            w.wait(ticket)?;
        }
        Ok((loss, n))
    }
}

impl Trainer for KgeTrainer<'_> {
    fn epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<Fields> {
        let (loss, n) = if pass.mode == Mode::Single { self.single_epoch(epoch, pass)? } else { self.node_epoch(epoch, pass)? };
        let mut v = [0.0f32; METRIC_FIELDS];
        v[field::LOSS] = loss as f32;
        v[field::EXAMPLES] = n as f32;
        Ok(v)
    }
}

/// `--copartition`: the plan, and how many nodes train each entity and each relation.
struct CoPartition {
    plan: ferry::copartition::Plan,
    /// Per entity, the nodes whose triples touch it.
    entity_users: Vec<u16>,
    /// Per relation, the nodes whose triples hold it.
    relation_users: Vec<u16>,
}

/// The training triples and the entities they touch (head and tail; the relations are few and
/// every node uses most of them) co-partitioned over `nodes` nodes. Every node computes the
/// same plan from the same data and seed.
fn copartition(kg: &KnowledgeGraph, nodes: usize, seed: u64) -> Result<CoPartition> {
    let mut graph = ferry::copartition::Incidence::new(kg.entities.len() as u64)?;
    for i in 0..kg.train.len() {
        graph.push_example([kg.train.heads[i] as u64, kg.train.tails[i] as u64])?;
    }
    // A triple is trained alone: each access is its own mini-batch.
    let options = ferry::copartition::Options { batch: 1, seed, ..ferry::copartition::Options::new(nodes) };
    let plan = ferry::copartition::copartition(&graph, &options).context("co-partitioning the training triples")?;
    let entity_users = plan.users(&graph)?;
    let mut seen = vec![vec![false; nodes]; kg.relations.len()];
    for i in 0..kg.train.len() {
        seen[kg.train.relations[i] as usize][plan.examples[i] as usize] = true;
    }
    let relation_users = seen.iter().map(|s| s.iter().filter(|&&b| b).count() as u16).collect();
    Ok(CoPartition { plan, entity_users, relation_users })
}

/// Assigns relations to nodes so that each node gets about the same number of triples.
fn relation_owners(train: &Triples, relations: usize, nodes: usize) -> Vec<usize> {
    let mut counts = vec![0usize; relations];
    for &r in &train.relations {
        counts[r as usize] += 1;
    }
    let mut by_size: Vec<usize> = (0..relations).collect();
    by_size.sort_by(|a, b| counts[*b].cmp(&counts[*a]).then(a.cmp(b)));
    let mut load = vec![0usize; nodes];
    let mut owner = vec![0usize; relations];
    for r in by_size {
        let n = (0..nodes).min_by_key(|&n| (load[n], n)).expect("at least one node");
        owner[r] = n;
        load[n] += counts[r];
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gradients_match_finite_differences() {
        let d = 3;
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let v = |rng: &mut ChaCha8Rng| (0..2 * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect::<Vec<_>>();
        let (a, r, b) = (v(&mut rng), v(&mut rng), v(&mut rng));
        let (mut ga, mut gr, mut gb) = (vec![0.0; 2 * d], vec![0.0; 2 * d], vec![0.0; 2 * d]);
        score_and_grad(&a, &r, &b, d, Some((1.0, &mut ga, &mut gr, &mut gb)));
        let eps = 1e-3;
        for (which, grad) in [(0, &ga), (1, &gr), (2, &gb)] {
            for k in 0..2 * d {
                let mut x = [a.clone(), r.clone(), b.clone()];
                x[which][k] += eps;
                let up = score_and_grad(&x[0], &x[1], &x[2], d, None);
                x[which][k] -= 2.0 * eps;
                let down = score_and_grad(&x[0], &x[1], &x[2], d, None);
                let numeric = (up - down) / (2.0 * eps);
                assert!((numeric - grad[k]).abs() < 1e-2, "operand {which} element {k}: {numeric} vs {}", grad[k]);
            }
        }
    }

    #[test]
    fn local_accumulators_step_as_the_value_carried_ones() {
        // From the same embeddings and accumulators, `--adagrad local` pushes the same change of
        // the embeddings as `worker`, and adds to its own accumulators what `worker` pushes.
        let (d, neg) = (3, 2);
        let slots = 2 + 2 * neg;
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut draw = |n: usize| (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect::<Vec<f32>>();
        let (emb, rel_emb) = (draw(slots * 2 * d), draw(2 * d));
        let acc0: Vec<f32> = (0..(slots + 1) * 2 * d).map(|i| 0.1 + 0.01 * i as f32).collect();
        // Worker values: each slot's embedding, then its accumulators.
        let with_acc = |e: &[f32], a: &[f32]| e.chunks(2 * d).zip(a.chunks(2 * d)).flat_map(|(e, a)| e.iter().chain(a).copied()).collect::<Vec<f32>>();
        let (ents_w, rel_w) = (with_acc(&emb, &acc0[..slots * 2 * d]), with_acc(&rel_emb, &acc0[slots * 2 * d..]));
        let mut grads = vec![0.0; (slots + 1) * 2 * d];
        let (mut eo_w, mut ro_w) = (vec![0.0; slots * 4 * d], vec![0.0; 4 * d]);
        let loss_w = step(&ents_w, &rel_w, d, neg, Update::Worker { lr: 0.1 }, 0.01, &mut grads, &mut [], &[], &mut eo_w, &mut ro_w);
        let mut acc = acc0.clone();
        let (mut eo_l, mut ro_l) = (vec![0.0; slots * 2 * d], vec![0.0; 2 * d]);
        let loss_l = step(&emb, &rel_emb, d, neg, Update::Local { lr: 0.1 }, 0.01, &mut grads, &mut acc, &vec![1.0; slots + 1], &mut eo_l, &mut ro_l);
        assert!((loss_w - loss_l).abs() < 1e-6);
        let pushed_w: Vec<f32> = eo_w.chunks(4 * d).chain([&ro_w[..]]).flat_map(|c| c.to_vec()).collect();
        let pushed_l: Vec<f32> = eo_l.chunks(2 * d).chain([&ro_l[..]]).flat_map(|c| c.to_vec()).collect();
        for (i, (w, l)) in pushed_w.chunks(4 * d).zip(pushed_l.chunks(2 * d)).enumerate() {
            for k in 0..2 * d {
                assert!((w[k] - l[k]).abs() < 1e-6, "slot {i} element {k}: change {} vs {}", w[k], l[k]);
                let added = acc[i * 2 * d + k] - acc0[i * 2 * d + k];
                assert!((w[2 * d + k] - added).abs() < 1e-6, "slot {i} element {k}: accumulator +{added}, worker pushed {}", w[2 * d + k]);
            }
        }
        // A key `n` nodes train counts each squared gradient `n` times.
        let mut scaled = acc0.clone();
        let scales: Vec<f32> = (0..=slots).map(|s| 1.0 + s as f32).collect();
        step(&emb, &rel_emb, d, neg, Update::Local { lr: 0.1 }, 0.01, &mut grads, &mut scaled, &scales, &mut eo_l, &mut ro_l);
        for (i, w) in pushed_w.chunks(4 * d).enumerate() {
            for k in 0..2 * d {
                let added = scaled[i * 2 * d + k] - acc0[i * 2 * d + k];
                assert!((scales[i] * w[2 * d + k] - added).abs() < 1e-5, "slot {i} element {k}: accumulator +{added}");
            }
        }
    }

    #[test]
    fn relations_are_balanced_over_nodes() {
        let t = Triples { heads: vec![0; 10], relations: vec![0, 0, 0, 0, 1, 1, 1, 2, 2, 3], tails: vec![0; 10] };
        let owners = relation_owners(&t, 4, 2);
        let load: Vec<usize> = (0..2).map(|n| t.relations.iter().filter(|&&r| owners[r as usize] == n).count()).collect();
        assert_eq!(load, vec![5, 5]);
    }
}
