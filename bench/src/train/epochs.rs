//! One epoch loop for every workload in every mode.
//!
//! A workload ([`Workload`]) says what its data and model are, makes a trainer per thread
//! ([`Trainer`]: one epoch of that thread's training, and what it measures after), and computes
//! an epoch's quality. [`run`] does the rest, the same way in `single` and in a cluster:
//! creates the model's tables (plain shared arrays in `single`, Ferry tables on a node started
//! for the mode), sets their initial values, starts the training threads (each with a worker
//! of the node in a cluster), and for every epoch times the training between two barriers,
//! sums the threads' figures (over the cluster, through a metrics table), has the reporter —
//! thread 0, on rank 0 — evaluate, and reports. Everything mode-specific a trainer does itself,
//! through its [`Pass`]: a cluster's trainer reaches its worker there ([`Access::Node`]).

use std::sync::Barrier;

use anyhow::{Context, Result};
use ferry::{Node, Stats, Table, TableSpec, Worker};

use super::shared::{METRIC_FIELDS, SharedArray, all_reduce, cluster_report, field, mean_loss, pull_all, run_workers, stats_fields};
use super::{EpochReport, Event, Mode, Sink, Task};

/// Figures of an epoch, per thread and summed (positions in [`field`]).
pub type Fields = [f32; METRIC_FIELDS];

/// An epoch's quality measures (RMSE; MRR and Hits@k; …), by name.
pub type Quality = serde_json::Map<String, serde_json::Value>;

/// One table of a workload's model: Ferry's spec (its name, keys and value length, and in a
/// cluster its updater, partitioning, replication and wire options) and its initial values.
pub struct ModelTable {
    /// The table.
    pub spec: TableSpec,
    /// The initial value of element `j` of key `key`; `None`: zeros.
    pub init: Option<Box<dyn Fn(u64, usize) -> f32 + Sync>>,
}

impl ModelTable {
    /// A table of zeros.
    pub fn zeros(spec: TableSpec) -> ModelTable {
        ModelTable { spec, init: None }
    }

    /// A table whose element `j` of key `key` starts at `init(key, j)`.
    pub fn init(spec: TableSpec, init: impl Fn(u64, usize) -> f32 + Sync + 'static) -> ModelTable {
        ModelTable { spec, init: Some(Box::new(init)) }
    }
}

/// A workload's model in one mode.
pub struct Model {
    /// Its tables, in the order trainers name them by.
    pub tables: Vec<ModelTable>,
    /// Lines rank 0 of a cluster prints before training (what hybrid replicates, say).
    pub notes: Vec<String>,
}

/// A training workload, as the epoch loop runs it (see the module documentation).
pub trait Workload: Task {
    /// The loaded data, shared by the training threads.
    type Data: Sync;
    /// Loads the data.
    fn load(&self) -> Result<Self::Data>;
    /// The model in `mode`; refuses options the mode does not take.
    fn model(&self, data: &Self::Data, mode: Mode) -> Result<Model>;
    /// A last change to a cluster node's configuration (every node makes the same).
    fn configure(&self, _config: &mut ferry::Config, _mode: Mode) -> Result<()> {
        Ok(())
    }
    /// The trainer of the thread `pass` names, made once before the first epoch (after the
    /// initial values are set); what it does here (relocating keys, declaring intent) happens
    /// before every thread's first epoch.
    fn trainer<'a>(&'a self, data: &'a Self::Data, pass: &mut Pass<'_>) -> Result<Box<dyn Trainer + 'a>>;
    /// Whether the reporter reads the model after `epoch` (to evaluate or save it): the other
    /// nodes then wait until it has, instead of training on.
    fn reads_model(&self, epoch: usize) -> bool;
    /// How the model reads as a saved model, written beside every checkpoint so that it is
    /// read as one; `None`: the task saves no models.
    fn describe<'a>(&self, _data: &'a Self::Data) -> Option<super::checkpoint_model::Description<'a>> {
        None
    }
    /// The quality after `epoch`, at the reporter, which may also save the model here: `model`
    /// reads the tables, `sums` are the epoch's figures summed over every thread of every node,
    /// `threads` is how many there were, `emit` reports the evaluation's progress.
    fn evaluate(
        &self,
        data: &Self::Data,
        epoch: usize,
        model: &mut ModelReader<'_>,
        sums: &Fields,
        at: Measured,
        emit: &(dyn Fn(Event) + Sync),
    ) -> Result<Quality>;
}

/// What the loop measured of an epoch, for [`Workload::evaluate`].
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// Training seconds of the epoch.
    pub epoch_s: f64,
    /// Training threads over every node.
    pub threads: usize,
}

/// One training thread's part of every epoch.
pub trait Trainer {
    /// Trains one epoch (timed); returns this thread's figures (loss, examples, …).
    fn epoch(&mut self, epoch: usize, pass: &mut Pass<'_>) -> Result<Fields>;
    /// After the epoch's training ended everywhere (not timed): further figures of this thread,
    /// added to the epoch's (MF's share of the test error).
    fn measure(&mut self, _epoch: usize, _pass: &mut Pass<'_>) -> Result<Fields> {
        Ok([0.0; METRIC_FIELDS])
    }
}

/// Where a trainer's parameters are.
pub enum Access<'a> {
    /// `single`: the model's tables as shared arrays.
    Shared(&'a [SharedArray]),
    /// A cluster: this thread's worker and the model's tables.
    Node {
        /// The thread's worker.
        worker: &'a mut Worker,
        /// The model's tables, in [`Model::tables`]'s order.
        tables: &'a [Table],
    },
}

/// A training thread's view of the run: who it is, its parameters, its barriers and progress.
pub struct Pass<'a> {
    /// The mode.
    pub mode: Mode,
    /// This node's rank (0 in `single`).
    pub rank: usize,
    /// Nodes (1 in `single`).
    pub nodes: usize,
    /// This thread's number on its node.
    pub thread: usize,
    /// Training threads per node.
    pub threads: usize,
    /// The parameters.
    pub access: Access<'a>,
    local_barrier: &'a Barrier,
    progress: &'a (dyn Fn(usize, f64) + Sync),
}

impl<'a> Pass<'a> {
    /// Reads rows `keys` of table `table` into `out`.
    pub fn pull(&mut self, table: usize, keys: &[u64], out: &mut [f32]) -> Result<()> {
        match &mut self.access {
            Access::Shared(arrays) => {
                let len = arrays[table].row_len();
                for (row, &key) in keys.iter().enumerate() {
                    arrays[table].read(key as usize, &mut out[row * len..(row + 1) * len]);
                }
                Ok(())
            }
            Access::Node { worker, tables } => Ok(worker.pull(tables[table], keys, out)?),
        }
    }

    /// Adds `delta` to rows `keys` of table `table` (through the table's updater in a cluster).
    pub fn push(&mut self, table: usize, keys: &[u64], delta: &[f32]) -> Result<()> {
        match &mut self.access {
            Access::Shared(arrays) => {
                let len = arrays[table].row_len();
                for (row, &key) in keys.iter().enumerate() {
                    arrays[table].add(key as usize, &delta[row * len..(row + 1) * len]);
                }
                Ok(())
            }
            // With --on-loss continue the worker drops a push the loss failed.
            Access::Node { worker, tables } => Ok(worker.push(tables[table], keys, delta)?),
        }
    }

    /// `single`'s shared arrays (`None` in a cluster).
    pub fn shared(&self) -> Option<&'a [SharedArray]> {
        match self.access {
            Access::Shared(arrays) => Some(arrays),
            Access::Node { .. } => None,
        }
    }

    /// A cluster's worker and tables (`None` in `single`).
    pub fn node(&mut self) -> Option<(&mut Worker, &[Table])> {
        match &mut self.access {
            Access::Shared(_) => None,
            Access::Node { worker, tables } => Some((worker, tables)),
        }
    }

    /// Waits for every training thread of every node (in a cluster, a worker barrier).
    pub fn barrier(&mut self) -> Result<()> {
        match &mut self.access {
            Access::Shared(_) => {
                self.local_barrier.wait();
                Ok(())
            }
            Access::Node { worker, .. } => Ok(worker.barrier()?),
        }
    }

    /// Waits for this node's training threads.
    pub fn local_barrier(&self) {
        self.local_barrier.wait();
    }

    /// Whether this thread evaluates and reports: thread 0 of the first live rank (rank 0, or
    /// with `--on-loss continue` after its loss the next; `rank` is the position among the
    /// live ranks).
    pub fn reporter(&self) -> bool {
        self.rank == 0 && self.thread == 0
    }

    /// Progress within `epoch` (0..=1); only the reporter's is shown.
    pub fn progress(&self, epoch: usize, fraction: f64) {
        if self.reporter() {
            (self.progress)(epoch, fraction);
        }
    }

    /// The run's progress report (for a trainer that lends its worker out meanwhile; only the
    /// reporter's calls should reach it).
    pub fn progress_fn(&self) -> &'a (dyn Fn(usize, f64) + Sync) {
        self.progress
    }
}

/// Reads the model's tables whole or by rows (the reporter's evaluation and saving).
pub enum ModelReader<'a> {
    /// `single`'s shared arrays.
    Shared(&'a [SharedArray]),
    /// A cluster's tables, through the reporter's worker.
    Node(&'a mut Worker, &'a [Table]),
}

impl ModelReader<'_> {
    /// In a cluster: the rows of those of table `table`'s keys `keys` that it holds (a
    /// dynamic table's ids, read without creating any: `Worker::pull_held`), one after the
    /// other, the others' initial values among them, and which it holds. `None` in `single`,
    /// whose arrays are dense.
    pub fn held_rows(&mut self, table: usize, keys: &[u64]) -> Result<Option<(Vec<f32>, Vec<bool>)>> {
        match self {
            ModelReader::Shared(_) => Ok(None),
            ModelReader::Node(worker, tables) => {
                let t = tables[table];
                let mut out = vec![0.0f32; keys.len() * t.value_len()];
                let mut held = Vec::with_capacity(keys.len());
                for (chunk, rows) in keys.chunks(65_536).zip(out.chunks_mut(65_536 * t.value_len().max(1))) {
                    held.extend(worker.pull_held(t, chunk, rows)?);
                }
                Ok(Some((out, held)))
            }
        }
    }

    /// Every row of table `table`, one after the other.
    pub fn all(&mut self, table: usize) -> Result<Vec<f32>> {
        match self {
            ModelReader::Shared(arrays) => Ok(arrays[table].to_vec()),
            ModelReader::Node(worker, tables) => {
                let t = tables[table];
                pull_all(worker, t, t.keys() as usize, t.value_len())
            }
        }
    }
}

/// Runs `task` in `mode`: in this process for `single`, as this process's node of a cluster
/// otherwise.
pub fn run<W: Workload>(task: &W, mode: Mode, emit: Sink) -> Result<()> {
    let data = task.load()?;
    let model = task.model(&data, mode)?;
    if mode == Mode::Single { run_single(task, &data, model, emit) } else { run_node(task, &data, model, mode, emit) }
}

/// An error if the epoch's loss is not a finite number: the training diverged (a learning rate
/// too large, say), and a run that goes on would only report NaNs.
fn check_loss(epoch: usize, loss: f64) -> Result<()> {
    if !loss.is_finite() {
        anyhow::bail!("epoch {epoch}: the training diverged: the loss is {loss} (a smaller learning rate may help)");
    }
    Ok(())
}

/// An error if a quality measure of the epoch is not a finite number (serde makes a NaN `null`).
fn check_quality(epoch: usize, quality: &Quality) -> Result<()> {
    for (name, value) in quality {
        if let Some(v) = value.as_f64().filter(|v| !v.is_finite()) {
            anyhow::bail!("epoch {epoch}: the training diverged: {name} is {v}");
        }
        if value.is_null() {
            anyhow::bail!("epoch {epoch}: the training diverged: {name} is not a number");
        }
    }
    Ok(())
}

/// Adds `more` to `fields`.
fn add_fields(fields: &mut Fields, more: &Fields) {
    for (f, m) in fields.iter_mut().zip(more) {
        *f += m;
    }
}

/// Refuses a `single` model whose arrays cannot fit in what the machine has, before any is
/// allocated, naming both figures.
fn check_arrays_fit(model: &Model) -> Result<()> {
    let bytes = model.tables.iter().try_fold(0u64, |sum, t| t.spec.keys.checked_mul(t.spec.value_len as u64 * 4).and_then(|b| sum.checked_add(b)));
    let Some(bytes) = bytes else { anyhow::bail!("the model's arrays would take more bytes than a 64-bit number counts") };
    if let Some(available) = ferry::memory::available_memory()
        && bytes > available
    {
        let largest = model.tables.iter().max_by_key(|t| t.spec.keys.saturating_mul(t.spec.value_len as u64)).expect("a model has tables");
        anyhow::bail!(
            "the model needs about {} ('{}' alone is {} rows of {} numbers), but this machine has {} available",
            ferry::memory::human(bytes),
            largest.spec.name,
            largest.spec.keys,
            largest.spec.value_len,
            ferry::memory::human(available)
        );
    }
    Ok(())
}

/// `single`: the model in shared arrays, the threads of this process.
fn run_single<W: Workload>(task: &W, data: &W::Data, model: Model, emit: Sink) -> Result<()> {
    let threads = task.common().single_threads();
    check_arrays_fit(&model)?;
    let specs: Vec<TableSpec> = model.tables.iter().map(|t| t.spec.clone()).collect();
    let (first_epoch, restore) = task.common().first_epoch()?;
    if let Some(dir) = &restore {
        eprintln!("resuming from {} at epoch {first_epoch}", dir.display());
    }
    let restored = restore.map(|dir| ferry::read_arrays_checkpoint(&dir, &specs).with_context(|| format!("--resume: {}", dir.display()))).transpose()?;
    let arrays: Vec<SharedArray> = model
        .tables
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (rows, len) = (t.spec.keys as usize, t.spec.value_len);
            match (&restored, &t.init) {
                (Some(values), _) => SharedArray::new(rows, len, |k, j| values[i][k * len + j]),
                (None, Some(init)) => SharedArray::new(rows, len, |k, j| init(k as u64, j)),
                (None, None) => SharedArray::new(rows, len, |_, _| 0.0),
            }
        })
        .collect();
    let shared = SingleRun {
        specs,
        first_epoch,
        writing: parking_lot::Mutex::new(None),
        barrier: Barrier::new(threads),
        emit: parking_lot::Mutex::new(emit),
        sums: parking_lot::Mutex::new([0.0f32; METRIC_FIELDS]),
        failed: std::sync::atomic::AtomicBool::new(false),
    };
    let progress = |epoch: usize, f: f64| (shared.emit.lock())(Event::Progress(epoch, f));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (arrays, shared, progress) = (&arrays, &shared, &progress);
                s.spawn(move || -> Result<()> {
                    let mut pass = Pass {
                        mode: Mode::Single,
                        rank: 0,
                        nodes: 1,
                        thread: t,
                        threads,
                        access: Access::Shared(arrays),
                        local_barrier: &shared.barrier,
                        progress,
                    };
                    shared.thread(task, data, &mut pass)
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| h.join().expect("training thread"))
    })?;
    shared.wait_for_checkpoint()?;
    if let Some(dir) = &task.common().checkpoint_dir {
        super::resume::finish(dir)?;
    }
    Ok(())
}

/// What `single`'s threads share besides the model.
struct SingleRun<'s> {
    /// The model's tables (for checkpoints).
    specs: Vec<TableSpec>,
    /// 1, or the epoch after the checkpoint resumed from.
    first_epoch: usize,
    /// The checkpoint being written.
    writing: parking_lot::Mutex<Option<std::thread::JoinHandle<Result<()>>>>,
    barrier: Barrier,
    emit: parking_lot::Mutex<Sink<'s>>,
    /// The epoch's figures, summed as the threads finish it.
    sums: parking_lot::Mutex<Fields>,
    /// A thread failed: every thread stops at the next epoch's start (a thread cannot leave
    /// while the others may wait for it in a barrier, so the failed one keeps meeting them).
    failed: std::sync::atomic::AtomicBool,
}

impl SingleRun<'_> {
    /// One thread's epochs; its first error, after the others stopped too.
    fn thread<W: Workload>(&self, task: &W, data: &W::Data, pass: &mut Pass<'_>) -> Result<()> {
        let mut error = None;
        let mut attempt = |outcome: Result<()>| {
            if let Err(e) = outcome {
                self.failed.store(true, std::sync::atomic::Ordering::Release);
                error.get_or_insert(e);
            }
        };
        let mut trainer = match task.trainer(data, pass) {
            Ok(trainer) => Some(trainer),
            Err(e) => {
                attempt(Err(e));
                None
            }
        };
        let mut elapsed = 0.0;
        for epoch in self.first_epoch..=task.common().epochs {
            self.barrier.wait();
            // Every thread reads the same flag here: it changes only between barriers.
            if self.failed.load(std::sync::atomic::Ordering::Acquire) {
                break;
            }
            let Some(trainer) = trainer.as_mut() else { unreachable!("a thread without a trainer failed") };
            let started = std::time::Instant::now();
            let trained = trainer.epoch(epoch, pass);
            self.barrier.wait();
            let epoch_s = started.elapsed().as_secs_f64();
            let measured = trained.and_then(|mut fields| {
                add_fields(&mut fields, &trainer.measure(epoch, pass)?);
                add_fields(&mut self.sums.lock(), &fields);
                Ok(())
            });
            attempt(measured);
            self.barrier.wait();
            if pass.reporter() && !self.failed.load(std::sync::atomic::Ordering::Acquire) {
                // The others wait for it at the next epoch's first barrier.
                elapsed += epoch_s;
                attempt(self.report(task, data, pass, epoch, epoch_s, elapsed));
                if task.common().checkpoint_now(epoch) && !self.failed.load(std::sync::atomic::Ordering::Acquire) {
                    attempt(self.checkpoint(task, data, pass, epoch));
                }
            }
        }
        error.map_or(Ok(()), Err)
    }

    /// The reporter's checkpoint after `epoch`: a copy of the arrays (the others wait at the
    /// next epoch's barrier), written by a thread of its own while training goes on.
    fn checkpoint<W: Workload>(&self, task: &W, data: &W::Data, pass: &Pass<'_>, epoch: usize) -> Result<()> {
        let dir = task.common().checkpoint_dir.clone().expect("checkpoints have a directory");
        let started = std::time::Instant::now();
        self.wait_for_checkpoint()?;
        super::resume::prepare(&dir, epoch)?;
        describe_checkpoint(task, data, &self.specs, &dir, epoch, 1)?;
        let arrays = pass.shared().expect("single mode has shared arrays");
        let values: Vec<Vec<f32>> = arrays.iter().map(|a| a.to_vec()).collect();
        let specs = self.specs.clone();
        let thread = std::thread::Builder::new().name("checkpoint".into()).spawn(move || -> Result<()> {
            let refs: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
            ferry::write_arrays_checkpoint(super::resume::epoch_dir(&dir, epoch), &specs, &refs, epoch as u64)?;
            Ok(())
        })?;
        *self.writing.lock() = Some(thread);
        eprintln!("checkpoint after epoch {epoch}: the threads paused {:.3} s; its files are written in the background", started.elapsed().as_secs_f64());
        Ok(())
    }

    /// Waits until the last checkpoint is written.
    fn wait_for_checkpoint(&self) -> Result<()> {
        match self.writing.lock().take() {
            Some(thread) => thread.join().map_err(|_| anyhow::anyhow!("the thread writing a checkpoint panicked"))?,
            None => Ok(()),
        }
    }

    /// The reporter's end of an epoch: the quality and the report.
    fn report<W: Workload>(&self, task: &W, data: &W::Data, pass: &Pass<'_>, epoch: usize, epoch_s: f64, elapsed: f64) -> Result<()> {
        let sums = std::mem::replace(&mut *self.sums.lock(), [0.0; METRIC_FIELDS]);
        let arrays = pass.shared().expect("single mode has shared arrays");
        let emit_event = |e: Event| (self.emit.lock())(e);
        let measured = Measured { epoch_s, threads: pass.threads };
        let loss = mean_loss(&sums);
        check_loss(epoch, loss)?;
        let quality = task.evaluate(data, epoch, &mut ModelReader::Shared(arrays), &sums, measured, &emit_event)?;
        check_quality(epoch, &quality)?;
        (self.emit.lock())(Event::Epoch(Box::new(EpochReport::single(task.name(), epoch, epoch_s, elapsed, loss, quality))));
        Ok(())
    }
}

/// A cluster: this process's node, its worker threads.
fn run_node<W: Workload>(task: &W, data: &W::Data, model: Model, mode: Mode, emit: Sink) -> Result<()> {
    let common = task.common();
    let epochs = common.epochs;
    let mut specs: Vec<TableSpec> = model.tables.iter().map(|t| t.spec.clone()).collect();
    // Per-epoch figures, sized by this run's epochs: not in checkpoints, so that a run resumes
    // with more epochs, or in `single`, which has no such table.
    specs.push(TableSpec::new("metrics", epochs as u64 + 2, METRIC_FIELDS).scratch());
    // Where the epochs begin, for a node that joins mid-run (`schedule`).
    specs.push(TableSpec::new(super::schedule::TABLE, 1, super::schedule::FIELDS).scratch());
    let mut config = ferry::Config::from_env(specs)?;
    config.relocation = mode != Mode::Classic;
    let continuing = common.on_loss.trains_on();
    let joining = config.join.is_some();
    if joining && !continuing {
        anyhow::bail!(
            "a node joins a training run (FERRY_JOIN) only with --on-loss continue or replace: the others must train on without a lost node to take a fresh one in"
        );
    }
    let leaving = common.leaving()?;
    if continuing {
        // `Common::check` allows it in classic mode only. One backup per key unless
        // FERRY_BACKUPS asks for more (to survive that many nodes lost at once).
        config.backups = config.backups.max(1);
    }
    task.configure(&mut config, mode)?;
    let (first_epoch, restore) = common.first_epoch()?;
    // A joining node takes its keys from the running cluster, not from the checkpoint the run
    // resumed from.
    if let Some(dir) = restore.filter(|_| !joining) {
        if config.rank == 0 {
            eprintln!("resuming from {} at epoch {first_epoch}", dir.display());
        }
        config.restore_from = Some(dir);
    }
    let restoring = config.restore_from.is_some();
    let replicated: u64 = config.tables.iter().map(|t| t.replicated_keys()).sum();
    if replicated > 0 && config.rank == 0 {
        eprintln!("replicated keys: {replicated}, staleness bound {:?}", config.staleness);
    }
    let mut node = Node::start(config)?;
    let (rank, nodes, threads) = (node.rank(), node.nodes(), common.threads());
    if rank == 0 {
        eprintln!("transport: {}", node.transport());
        for note in &model.notes {
            eprintln!("{note}");
        }
    }
    let tables: Vec<Table> = model.tables.iter().map(|t| node.table(&t.spec.name)).collect::<ferry::Result<_>>()?;
    let metrics = node.table("metrics")?;
    let schedule = node.table(super::schedule::TABLE)?;
    let local_barrier = Barrier::new(threads);
    // --on-loss continue: the live ranks the trainers were made for, as thread 0 saw them at
    // the start of the epoch (every thread of the node then uses the same).
    let members = parking_lot::Mutex::new(membership(&node));
    let emit = parking_lot::Mutex::new(emit);
    let progress = |epoch: usize, f: f64| (emit.lock())(Event::Progress(epoch, f));
    // --leave: this node leaves at the start of that epoch (every thread stops there).
    let leaves_at = leaving.filter(|&(r, _)| r == rank).map(|(_, epoch)| epoch);
    run_workers(&node, threads, |t, mut w| -> Result<()> {
        let (node, tables, model) = (&node, &tables, &model);
        // A push or set a lost node failed may or may not have been applied: training takes it
        // as noise and goes on.
        w.drop_lost_writes(continuing);
        // A node that joined mid-run passes the others' barriers until it is where an epoch
        // begins (or the run ends), and trains with them from there.
        let (first_epoch, (pass_rank, pass_nodes)) = if joining {
            let epoch = super::schedule::join_at_an_epoch(&mut w, schedule)?;
            if t == 0 {
                *members.lock() = membership(node);
                if epoch <= epochs {
                    eprintln!("node {rank} joined the run: it trains from epoch {epoch}");
                }
            }
            local_barrier.wait();
            let live = members.lock().clone();
            (epoch, (live.iter().position(|&(r, _)| r == rank).unwrap_or(0), live.len()))
        } else {
            if rank == 0 && t == 0 && !restoring {
                set_initial_values(&mut w, tables, &model.tables)?;
            }
            w.barrier()?;
            (first_epoch, (rank, nodes))
        };
        let mut pass = Pass {
            mode,
            rank: pass_rank,
            nodes: pass_nodes,
            thread: t,
            threads,
            access: Access::Node { worker: &mut w, tables },
            local_barrier: &local_barrier,
            progress: &progress,
        };
        let mut trainer = task.trainer(data, &mut pass)?;
        if !joining {
            pass.barrier()?;
        }
        let (mut elapsed, mut writing): (f64, Option<ferry::CheckpointWriting>) = (0.0, None);
        let mut trained_for = members.lock().clone();
        // A joining node is past the barrier that begins its first epoch (or ends the run).
        let mut opening_passed = joining;
        for epoch in first_epoch..=epochs {
            if !std::mem::take(&mut opening_passed) {
                if continuing && t == 0 {
                    super::schedule::note_epoch_start(&mut pass, schedule, epoch)?;
                }
                pass.barrier()?;
            }
            if continuing {
                // Thread 0 reads who is left; every thread deals the data among them.
                if t == 0 {
                    *members.lock() = membership(node);
                }
                local_barrier.wait();
                if leaving.is_some_and(|(_, at)| at == epoch) {
                    // Every node reads who is left before the leaver begins to go (after this
                    // barrier): otherwise its LEFT could reach one node before that node's read
                    // and another after, and the two would deal the data (and count the
                    // epoch's barriers) for different clusters. The next epoch's read comes
                    // after a barrier the coordinator releases only once it has handled the
                    // LEFT, which it relays to every node ahead of the release.
                    pass.barrier()?;
                }
            }
            if leaves_at == Some(epoch) {
                if t == 0 {
                    eprintln!("node {rank} leaves the cluster at the start of epoch {epoch}, handing its keys over");
                }
                // Its last checkpoint's files are complete before it goes.
                if let Some(last) = writing.take() {
                    last.wait()?;
                }
                return Ok(());
            }
            if continuing {
                let live = members.lock().clone();
                if live != trained_for {
                    (pass.rank, pass.nodes) = (live.iter().position(|&(r, _)| r == rank).unwrap_or(0), live.len());
                    trainer = task.trainer(data, &mut pass)?;
                    if pass.rank == 0 && t == 0 {
                        // Ranks no longer live, and fresh nodes (a rank lost and taken back
                        // within one epoch is among these only).
                        let gone: Vec<String> = trained_for.iter().filter(|&&(r, _)| !live.iter().any(|&(l, _)| l == r)).map(|(r, _)| r.to_string()).collect();
                        let joined: Vec<String> = live.iter().filter(|m| !trained_for.contains(m)).map(|(r, _)| r.to_string()).collect();
                        if !gone.is_empty() {
                            let left = node.lost_nodes().iter().filter(|(_, why)| why == ferry::LEFT_REASON).count() == gone.len();
                            let (what, whence) = if left { ("left", "handed over") } else { ("lost", "served from their backups") };
                            eprintln!(
                                "node {} {what}: training goes on on {} nodes, which deal its share of the data among them from epoch {epoch} (its keys are {whence})",
                                gone.join(", node "),
                                live.len()
                            );
                        }
                        if !joined.is_empty() {
                            eprintln!(
                                "node {} joined: training goes on on {} nodes, which deal the data among them from epoch {epoch} (its keys came back from the node that served them since its rank was lost)",
                                joined.join(", node "),
                                live.len()
                            );
                        }
                    }
                    trained_for = live;
                }
            }
            let (stats, started) = (node.stats(), std::time::Instant::now());
            let mut fields = trainer.epoch(epoch, &mut pass)?;
            pass.barrier()?;
            let (epoch_s, delta) = (started.elapsed().as_secs_f64(), node.stats().since(&stats));
            add_fields(&mut fields, &trainer.measure(epoch, &mut pass)?);
            let Access::Node { worker, .. } = &mut pass.access else { unreachable!("a cluster's pass has a worker") };
            let ended = EpochEnd {
                task,
                data,
                node_stats: (t == 0).then_some(&delta),
                metrics,
                mode,
                epoch,
                epoch_s,
                threads: pass.nodes * threads,
                continue_after_loss: continuing,
            };
            // Thread 0 of the lowest live rank reports (rank 0, or after its loss the next).
            let reporter = || t == 0 && live_ranks(node).first() == Some(&rank);
            if let Some(mut report) = ended.end(worker, tables, fields, &reporter, &local_barrier, &emit)? {
                elapsed += epoch_s;
                report.elapsed_s = elapsed;
                (emit.lock())(Event::Epoch(Box::new(report)));
            }
            if let Some(dir) = common.checkpoint_dir.as_deref().filter(|_| common.checkpoint_now(epoch)) {
                checkpoint((task, data), node, &mut pass, dir, epoch, &mut writing)?;
            }
        }
        // The end of the run, for a node that joins during the last epoch.
        if continuing && !opening_passed {
            if t == 0 {
                super::schedule::note_epoch_start(&mut pass, schedule, epochs + 1)?;
            }
            pass.barrier()?;
        }
        if let Some(dir) = common.checkpoint_dir.as_deref() {
            finish_checkpoints(&mut pass, dir, writing)?;
        }
        Ok(())
    })?;
    if leaves_at.is_some() {
        node.leave()?;
    } else {
        node.finalize()?;
    }
    Ok(())
}

/// The members of the cluster as this node knows them, in rank order: each live rank and how
/// many times a fresh node joined in it (a rank lost and taken back is a new member).
fn membership(node: &Node) -> Vec<(usize, u8)> {
    live_ranks(node).into_iter().map(|r| (r, node.incarnation(r))).collect()
}

/// The ranks of the cluster this node does not know lost, in order.
fn live_ranks(node: &Node) -> Vec<usize> {
    let lost: Vec<usize> = node.lost_nodes().into_iter().map(|(n, _)| n).collect();
    (0..node.nodes()).filter(|r| !lost.contains(r)).collect()
}

/// The cluster's checkpoint after `epoch` into `dir`. Every worker meets at a barrier with its
/// pushes acknowledged; rank 0's thread 0 makes room (each node's previous checkpoint finished
/// writing before it came) and each node's thread 0 holds intent's relocations; after a second
/// barrier each node's thread 0 takes the node's cut while the others wait at a third, its
/// files are written in the background (`writing`), and relocations go on.
fn checkpoint<W: Workload>(
    (task, data): (&W, &W::Data),
    node: &Node,
    pass: &mut Pass<'_>,
    dir: &std::path::Path,
    epoch: usize,
    writing: &mut Option<ferry::CheckpointWriting>,
) -> Result<()> {
    let started = std::time::Instant::now();
    if let Some(previous) = writing.take() {
        previous.wait()?;
    }
    pass.barrier()?;
    if pass.rank == 0 && pass.thread == 0 {
        super::resume::prepare(dir, epoch)?;
        describe_checkpoint(task, data, &node.config().tables, dir, epoch, pass.nodes)?;
    }
    if pass.thread == 0 {
        // Intent's relocations wait on every node before any node cuts (a no-op in the modes
        // that declare no intents).
        node.hold_relocations()?;
    }
    pass.barrier()?;
    if pass.thread == 0 {
        *writing = Some(node.checkpoint_in_background(super::resume::epoch_dir(dir, epoch))?);
    }
    pass.barrier()?;
    if pass.thread == 0 {
        node.release_relocations();
    }
    if pass.rank == 0 && pass.thread == 0 {
        eprintln!("checkpoint after epoch {epoch}: the workers paused {:.3} s; its files are written in the background", started.elapsed().as_secs_f64());
    }
    Ok(())
}

/// Writes the model's description (`model.json` and ids, [`super::checkpoint_model`]) into the
/// checkpoint after `epoch` in `dir`, before any node's files: `specs` are the checkpoint's
/// tables, `nodes` the node count writing it.
fn describe_checkpoint<W: Workload>(task: &W, data: &W::Data, specs: &[TableSpec], dir: &std::path::Path, epoch: usize, nodes: usize) -> Result<()> {
    let Some(description) = task.describe(data) else { return Ok(()) };
    description.write_beside_checkpoint(&super::resume::epoch_dir(dir, epoch), epoch, specs, nodes)
}

/// After the last epoch: every node's checkpoint is written, and rank 0 keeps the two newest.
fn finish_checkpoints(pass: &mut Pass<'_>, dir: &std::path::Path, writing: Option<ferry::CheckpointWriting>) -> Result<()> {
    if let Some(last) = writing {
        last.wait()?;
    }
    pass.barrier()?;
    if pass.rank == 0 && pass.thread == 0 {
        super::resume::finish(dir)?;
    }
    Ok(())
}

/// Sets the initial values of the model's tables that do not start at zero (rank 0's reporter
/// alone, before the first barrier).
fn set_initial_values(w: &mut Worker, tables: &[Table], model: &[ModelTable]) -> Result<()> {
    for (table, spec) in tables.iter().zip(model) {
        let Some(init) = &spec.init else { continue };
        let (keys, len): (Vec<u64>, usize) = ((0..table.keys()).collect(), table.value_len());
        for chunk in keys.chunks(4096) {
            let values: Vec<f32> = chunk.iter().flat_map(|&k| (0..len).map(move |j| init(k, j))).collect();
            w.set(*table, chunk, &values)?;
        }
    }
    Ok(())
}

/// The end of a cluster epoch on one thread: the node's statistics (from thread 0) and the
/// thread's figures summed over the cluster, rank 0's evaluation — the others waiting while it
/// reads the model —, and the report.
struct EpochEnd<'a, W: Workload> {
    task: &'a W,
    data: &'a W::Data,
    node_stats: Option<&'a Stats>,
    metrics: Table,
    mode: Mode,
    epoch: usize,
    epoch_s: f64,
    threads: usize,
    /// `--on-loss continue`: the sums tolerate a node lost meanwhile (see `all_reduce`).
    continue_after_loss: bool,
}

impl<W: Workload> EpochEnd<'_, W> {
    /// Returns the report at the reporter (its elapsed time left for the caller). Whether this
    /// thread reports is asked once the epoch's sums are in: a node lost during the epoch is
    /// known everywhere by then (the sums end in a barrier, which a coordinator releases only
    /// after telling every node of the loss), so a lost rank 0's successor reports that epoch.
    fn end(
        self,
        worker: &mut Worker,
        tables: &[Table],
        mut fields: Fields,
        reporter: &dyn Fn() -> bool,
        local_barrier: &Barrier,
        emit: &parking_lot::Mutex<Sink>,
    ) -> Result<Option<EpochReport>> {
        if let Some(stats) = self.node_stats {
            stats_fields(stats, worker.rank(), &mut fields);
            fields[field::EPOCH_S] = self.epoch_s as f32;
        }
        let sums = all_reduce(worker, self.metrics, self.epoch as u64, &fields, self.continue_after_loss)?;
        // Every node sees the same sums: all of them stop here, saying why.
        check_loss(self.epoch, mean_loss(&sums))?;
        let reporter = reporter();
        let quality = if reporter {
            let emit_event = |e: Event| (emit.lock())(e);
            let measured = Measured { epoch_s: self.epoch_s, threads: self.threads };
            let quality = self.task.evaluate(self.data, self.epoch, &mut ModelReader::Node(worker, tables), &sums, measured, &emit_event)?;
            check_quality(self.epoch, &quality)?;
            quality
        } else {
            Quality::new()
        };
        if self.task.reads_model(self.epoch) {
            // Nobody trains on while rank 0 reads the model.
            worker.barrier_within(super::shared::EVALUATION_WAIT)?;
        }
        local_barrier.wait();
        Ok(reporter.then(|| cluster_report(self.task.name(), self.mode, self.epoch, self.epoch_s, 0.0, &sums, quality)))
    }
}
