//! Ferry from Python: `ferry.Node.start(tables)` joins the cluster the environment describes
//! (the same variables as every Ferry process), `node.worker()` gives a worker per thread, and
//! pulls, pushes, sets and localizes take NumPy arrays of `uint64` keys and `float32` values.
//! Every wait releases the GIL, so other Python threads run meanwhile. Pulls return new arrays
//! of shape `(keys, value_len)`, or write into a caller's C-contiguous array (`pull_into`, no
//! copy beyond the one from the parameter store); pushed arrays are read in place. Failures raise
//! `ferry.FerryError` with Ferry's message.

use std::collections::HashMap;

use ferry_engine as engine;

mod arrays;
mod stats;
use arrays::{Keys, Out, Values};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

create_exception!(ferry, FerryError, PyRuntimeError, "A Ferry operation failed; the message says why.");

fn failed(e: engine::Error) -> PyErr {
    FerryError::new_err(e.to_string())
}

fn argument(message: impl Into<String>) -> PyErr {
    FerryError::new_err(message.into())
}

/// A table's configuration beyond `(name, keys, value_len)`: what a push does (`updater`:
/// `add`, `sgd:LR`, `adagrad:LR[:EPS[:INIT]]`, `adam:LR[:BETA1:BETA2:EPS]` or
/// `ftrl:ALPHA:BETA:L1:L2`, applied where each key lives, with its optimizer state), how keys
/// are spread over nodes (`partitioning`: `range`, `hash` or `consistent[:VIRTUAL_NODES]`), which keys every node keeps a
/// replica of (`replicated`: keys, or a dynamic table's raw ids), how values travel (`codec`: `f32`, `bf16`, `f16`, …), key lists
/// cached from this many keys on (`key_cache_min`, 0: off), whether checkpoints leave the
/// table out (`scratch`), raw ids hashed into the keys (`feature_hashing`: `SEED[:signed]`),
/// raw ids created when first touched (`dynamic`: the ids each node holds as their home, with
/// `keys=0`; `init`: `zeros`, `uniform:SCALE[:SEED]` or `normal:STD[:SEED]`; `admission`: `all`,
/// `count:N` pushes or `probability:P[:SEED]`; `eviction`: `never`, `lfu` or `ttl:SECONDS`), and a plan of `ferry partition` whose homes the keys take (`plan`: its path; see
/// `ferry.plan_examples` for the examples it gives each node). Every node must describe its
/// tables alike.
#[pyclass(module = "ferry", frozen)]
#[derive(Clone)]
struct Table {
    spec: engine::TableSpec,
}

#[pymethods]
impl Table {
    #[new]
    #[pyo3(signature = (name, keys, value_len, *, updater = "add", partitioning = "range", replicated = None, codec = "f32", key_cache_min = 0, scratch = false, feature_hashing = None, plan = None, dynamic = None, init = None, admission = None, eviction = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: String,
        keys: u64,
        value_len: usize,
        updater: &str,
        partitioning: &str,
        replicated: Option<Vec<u64>>,
        codec: &str,
        key_cache_min: usize,
        scratch: bool,
        feature_hashing: Option<&str>,
        plan: Option<std::path::PathBuf>,
        dynamic: Option<u64>,
        init: Option<&str>,
        admission: Option<&str>,
        eviction: Option<&str>,
    ) -> PyResult<Table> {
        let updater: engine::Updater = updater.parse().map_err(argument)?;
        let partitioning: engine::Partitioning = partitioning.parse().map_err(argument)?;
        let codec: engine::ValueCodec = codec.parse().map_err(argument)?;
        if let Some(bad) = replicated.iter().flatten().find(|&&k| k >= keys && dynamic.is_none()) {
            return Err(argument(format!("replicated key {bad} is outside table '{name}' (keys 0..{keys})")));
        }
        let mut spec =
            engine::TableSpec::new(name, keys, value_len).with_updater(updater).partitioned(partitioning).compressed(codec).cache_keys(key_cache_min);
        match replicated {
            // A dynamic table's replicated keys are raw ids.
            Some(ids) if dynamic.is_some() => spec = spec.replicating_ids(ids),
            Some(keys) => spec = spec.replicating_keys(keys),
            None => {}
        }
        if scratch {
            spec = spec.scratch();
        }
        if let Some(hashing) = feature_hashing {
            spec = spec.feature_hashed(hashing.parse().map_err(argument)?);
        }
        if let Some(path) = plan {
            spec = spec.placed(engine::copartition::Plan::read(&path).map_err(|e| argument(e.to_string()))?.placement);
        }
        if dynamic.is_none() && admission.is_some() {
            return Err(argument(format!("table '{}': only a dynamic table (dynamic=CAPACITY) has an admission rule", spec.name)));
        }
        if dynamic.is_none() && eviction.is_some() {
            return Err(argument(format!("table '{}': only a dynamic table (dynamic=CAPACITY) has an eviction rule", spec.name)));
        }
        match (dynamic, init) {
            (Some(_), _) if keys != 0 => {
                return Err(argument(format!("table '{}' is dynamic: its keys come from its capacity per node; pass keys=0", spec.name)));
            }
            (Some(capacity), init) => {
                let init: engine::dynamic::Init = init.unwrap_or("zeros").parse().map_err(argument)?;
                let admission: engine::dynamic::Admission = admission.unwrap_or("all").parse().map_err(argument)?;
                let eviction: engine::dynamic::Eviction = eviction.unwrap_or("never").parse().map_err(argument)?;
                spec.dynamic = Some(engine::dynamic::DynamicSpec { capacity, init, seed: 0, admission, eviction });
            }
            (None, Some(_)) => return Err(argument(format!("table '{}': only a dynamic table (dynamic=CAPACITY) has an init rule", spec.name))),
            (None, None) => {}
        }
        Ok(Table { spec })
    }

    /// The table's name.
    #[getter]
    fn name(&self) -> &str {
        &self.spec.name
    }

    fn __repr__(&self) -> String {
        let s = &self.spec;
        format!(
            "ferry.Table({:?}, {}, {}, updater={:?}, partitioning={:?}, replicated keys: {}, scratch={}{})",
            s.name,
            s.keys,
            s.value_len,
            s.updater.describe(),
            s.partitioning.name(),
            s.replicated_keys(),
            if s.scratch { "True" } else { "False" },
            s.feature_hashing.map_or(String::new(), |h| format!(", feature_hashing={:?}", h.name()))
                + &s.dynamic.map_or(String::new(), |d| format!(
                    ", dynamic={}, init={:?}, admission={:?}, eviction={:?}, replicated ids: {}",
                    d.capacity,
                    d.init.name(),
                    d.admission.name(),
                    d.eviction.name(),
                    s.replicated_ids.len()
                ))
        )
    }
}

/// A table as `Node.start` takes it: a `Table`, or `(name, keys, value_len)`.
#[derive(FromPyObject)]
enum TableArg {
    Configured(Table),
    Plain((String, u64, usize)),
}

impl TableArg {
    fn spec(self) -> engine::TableSpec {
        match self {
            TableArg::Configured(t) => t.spec,
            TableArg::Plain((name, keys, len)) => engine::TableSpec::new(name, keys, len),
        }
    }
}

/// Intent's relocations held on a node for a `with` block (`Node.relocations_held()`).
#[pyclass(module = "ferry")]
struct RelocationHold {
    node: Py<Node>,
}

#[pymethods]
impl RelocationHold {
    fn __enter__(slf: PyRef<'_, Self>, py: Python<'_>) -> PyResult<()> {
        let node = slf.node.bind(py).borrow();
        let live = node.live()?;
        py.allow_threads(|| live.hold_relocations()).map_err(failed)
    }

    #[pyo3(signature = (_exc_type = None, _exc_value = None, _traceback = None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc_value: Option<&Bound<'_, PyAny>>,
        _traceback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        // A node finalized or aborted inside the block has nothing left to release.
        if let Some(live) = self.node.bind(py).borrow().node.as_ref() {
            live.release_relocations();
        }
        Ok(false)
    }
}

/// This process's node of a Ferry cluster.
#[pyclass(module = "ferry")]
struct Node {
    node: Option<engine::Node>,
    tables: Vec<(String, engine::Table)>,
}

impl Node {
    fn live(&self) -> PyResult<&engine::Node> {
        self.node.as_ref().ok_or_else(|| failed(engine::Error::ShutDown))
    }
}

#[pymethods]
impl Node {
    /// Starts this process's node with `tables`, a list of `(name, keys, value_len)` or `Table`s;
    /// the cluster (rank, node count, coordinator, secret, timeouts) comes from the environment.
    /// Blocks until every node has joined. With `restore_from`, the node starts from the
    /// checkpoint in that directory (written by `Node.checkpoint` on any node count;
    /// `FERRY_RESTORE` does the same).
    #[staticmethod]
    #[pyo3(signature = (tables, restore_from = None))]
    fn start(py: Python<'_>, tables: Vec<TableArg>, restore_from: Option<std::path::PathBuf>) -> PyResult<Node> {
        let specs: Vec<engine::TableSpec> = tables.into_iter().map(TableArg::spec).collect();
        let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
        let node = py
            .allow_threads(|| {
                let mut config = engine::Config::from_env(specs)?;
                if restore_from.is_some() {
                    config.restore_from = restore_from;
                }
                engine::Node::start(config)
            })
            .map_err(failed)?;
        let tables = names.into_iter().map(|name| node.table(&name).map(|t| (name, t))).collect::<engine::Result<Vec<_>>>().map_err(failed)?;
        Ok(Node { node: Some(node), tables })
    }

    /// This node's rank.
    #[getter]
    fn rank(&self) -> PyResult<usize> {
        Ok(self.live()?.rank())
    }

    /// The number of nodes.
    #[getter]
    fn nodes(&self) -> PyResult<usize> {
        Ok(self.live()?.nodes())
    }

    /// A new worker (use one per thread).
    fn worker(&self) -> PyResult<Worker> {
        Ok(Worker {
            worker: Some(self.live()?.worker()),
            tables: self.tables.clone(),
            pushes: HashMap::new(),
            pulls: HashMap::new(),
            distributions: Vec::new(),
            samples: HashMap::new(),
            next_ticket: 1,
        })
    }

    /// The node's counters (a `ferry.Stats`): key accesses by where they were served,
    /// relocations, messages and bytes sent (by kind too), latencies, replicas, intent.
    fn stats(&self) -> PyResult<stats::Stats> {
        Ok(stats::Stats::of(&self.live()?.stats()))
    }

    /// Writes this node's part of a checkpoint into directory `dir` (one directory per
    /// checkpoint): a collective call every node makes with the same directory, after a barrier
    /// every worker reached, the workers going on after a second barrier. Returns once the
    /// node's files are durable. See docs/CHECKPOINTS.md.
    fn checkpoint(&self, py: Python<'_>, dir: std::path::PathBuf) -> PyResult<()> {
        let node = self.live()?;
        py.allow_threads(|| node.checkpoint(dir)).map(drop).map_err(failed)
    }

    /// Holds the relocations intent signalling makes on this node, for a checkpoint; returns
    /// once those in flight landed. Where workers declare intents, call it on every node, then
    /// a barrier, before `checkpoint` (which is refused otherwise), and `release_relocations`
    /// after.
    fn hold_relocations(&self, py: Python<'_>) -> PyResult<()> {
        let node = self.live()?;
        py.allow_threads(|| node.hold_relocations()).map_err(failed)
    }

    /// Ends `hold_relocations`: the grants that waited are taken up.
    fn release_relocations(&self) -> PyResult<()> {
        self.live()?.release_relocations();
        Ok(())
    }

    /// `with node.relocations_held(): ...` holds intent's relocations for the block
    /// (`hold_relocations` on entry, `release_relocations` on leaving, also on an exception):
    /// the block makes the barrier, the checkpoint and the barrier after it.
    fn relocations_held(slf: Py<Self>) -> RelocationHold {
        RelocationHold { node: slf }
    }

    /// Leaves the cluster cleanly (a barrier with every other node); close every worker first.
    fn finalize(&mut self, py: Python<'_>) -> PyResult<()> {
        let mut node = self.node.take().ok_or_else(|| failed(engine::Error::ShutDown))?;
        py.allow_threads(|| node.finalize()).map_err(failed)
    }

    /// Leaves the cluster gracefully for good: this node's keys are handed to its successor
    /// first, so nothing fails and no push is lost while the other nodes go on. Needs backups
    /// (`FERRY_BACKUPS=1`) and a node other than the coordinator (rank 0 while it lives); close
    /// every worker first. A refused leave (no backups, the coordinator, workers open) leaves
    /// the node usable.
    fn leave(&mut self, py: Python<'_>) -> PyResult<()> {
        let node = self.node.as_mut().ok_or_else(|| failed(engine::Error::ShutDown))?;
        match py.allow_threads(|| node.leave()) {
            Err(e @ (engine::Error::WorkersAlive(_) | engine::Error::Config(_))) => Err(failed(e)),
            outcome => {
                self.node = None;
                outcome.map_err(failed)
            }
        }
    }

    /// Stops the node at once, without the barrier of `finalize`: its peers see it as lost (and
    /// fail what touches its keys, saying so). For a process that gives up on an error.
    fn abort(&mut self, py: Python<'_>) -> PyResult<()> {
        let node = self.node.take().ok_or_else(|| failed(engine::Error::ShutDown))?;
        py.allow_threads(|| node.abort());
        Ok(())
    }

    /// `with ferry.Node.start(tables) as node:` gives the node.
    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Leaving the `with` block finalizes the node (close its workers first), or aborts it when
    /// the block raised (the exception goes on). A node already finalized or aborted is left.
    #[pyo3(signature = (exc_type = None, _exc_value = None, _traceback = None))]
    fn __exit__(
        &mut self,
        py: Python<'_>,
        exc_type: Option<&Bound<'_, PyAny>>,
        _exc_value: Option<&Bound<'_, PyAny>>,
        _traceback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if self.node.is_none() {
            return Ok(false);
        }
        if exc_type.is_some_and(|t| !t.is_none()) {
            self.abort(py)?;
        } else {
            self.finalize(py)?;
        }
        Ok(false)
    }
}

/// A worker: pulls, pushes, sets and localizes keys of the node's tables.
#[pyclass(module = "ferry", unsendable)]
struct Worker {
    worker: Option<engine::Worker>,
    tables: Vec<(String, engine::Table)>,
    /// Outstanding pushes, sets and localizes.
    pushes: HashMap<u64, engine::Ticket>,
    /// Outstanding pulls with the shape of their answer.
    pulls: HashMap<u64, (engine::PullTicket, [usize; 2])>,
    /// Registered distributions, by the number handed to Python, with their table's value length.
    distributions: Vec<(engine::DistributionId, usize)>,
    /// Prepared samples, by handle number.
    samples: HashMap<u64, (engine::SampleHandle, usize)>,
    next_ticket: u64,
}

impl Worker {
    fn parts(&mut self, table: &str) -> PyResult<(&mut engine::Worker, engine::Table)> {
        let t = self.tables.iter().find(|(name, _)| name == table).map(|(_, t)| *t).ok_or_else(|| failed(engine::Error::UnknownTable(table.into())))?;
        let w = self.worker.as_mut().ok_or_else(|| argument("the worker is closed"))?;
        Ok((w, t))
    }

    fn ticket(&mut self) -> u64 {
        self.next_ticket += 1;
        self.next_ticket - 1
    }

    /// Keeps a push, set or localize in flight and returns its ticket.
    fn hand_out(&mut self, pending: engine::Ticket) -> u64 {
        let id = self.ticket();
        self.pushes.insert(id, pending);
        id
    }
}

#[pymethods]
impl Worker {
    /// The values of `keys` as a new `float32` array of shape `(len(keys), value_len)`; with
    /// `out` (a C-contiguous `float32` array or CPU tensor of `len(keys) × value_len`
    /// elements), written into it without an intermediate copy, and `out` returned.
    #[pyo3(signature = (table, keys, out = None))]
    fn pull<'py>(&mut self, py: Python<'py>, table: &str, keys: Keys<'py>, out: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        if let Some(target) = out {
            self.pull_into(py, table, keys, target.extract()?)?;
            return Ok(target);
        }
        let (w, t) = self.parts(table)?;
        let k = keys.slice()?;
        let mut values = vec![0.0f32; k.len() * t.value_len()];
        py.allow_threads(|| w.pull(t, k, &mut values)).map_err(failed)?;
        Ok(PyArray1::from_vec(py, values).reshape([k.len(), t.value_len()])?.into_any())
    }

    /// The values of those of `keys` the table holds and which it holds: `(values, held)`, a
    /// `float32` array of shape `(len(keys), value_len)` (the others' rows at their initial
    /// values) and a `bool` array. Creates no key of a dynamic table, whatever its admission:
    /// how its contents are read.
    fn pull_held<'py>(&mut self, py: Python<'py>, table: &str, keys: Keys<'py>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let (w, t) = self.parts(table)?;
        let k = keys.slice()?;
        let mut values = vec![0.0f32; k.len() * t.value_len()];
        let held = py.allow_threads(|| w.pull_held(t, k, &mut values)).map_err(failed)?;
        Ok((PyArray1::from_vec(py, values).reshape([k.len(), t.value_len()])?.into_any(), PyArray1::from_vec(py, held).into_any()))
    }

    /// Writes the values of `keys` into `out`, a C-contiguous `float32` array (or CPU tensor)
    /// of `len(keys) × value_len` elements, without an intermediate copy.
    fn pull_into(&mut self, py: Python<'_>, table: &str, keys: Keys<'_>, mut out: Out<'_>) -> PyResult<()> {
        let (w, t) = self.parts(table)?;
        let (k, out) = (keys.slice()?, out.slice_mut()?);
        py.allow_threads(|| w.pull(t, k, out)).map_err(failed)
    }

    /// Adds `values` (`len(keys) × value_len` floats, any shape) to the keys' values.
    fn push(&mut self, py: Python<'_>, table: &str, keys: Keys<'_>, values: Values<'_>) -> PyResult<()> {
        let (w, t) = self.parts(table)?;
        let (k, v) = (keys.slice()?, values.slice()?);
        py.allow_threads(|| w.push(t, k, v)).map_err(failed)
    }

    /// Pushes `values` to the keys and returns their values right after (a new `float32`
    /// array of shape `(len(keys), value_len)`), in one round trip per node.
    fn push_pull<'py>(&mut self, py: Python<'py>, table: &str, keys: Keys<'py>, values: Values<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (w, t) = self.parts(table)?;
        let (k, v) = (keys.slice()?, values.slice()?);
        let mut out = vec![0.0f32; k.len() * t.value_len()];
        py.allow_threads(|| w.push_pull(t, k, v, &mut out)).map_err(failed)?;
        Ok(PyArray1::from_vec(py, out).reshape([k.len(), t.value_len()])?.into_any())
    }

    /// Starts a push-pull; returns a ticket for `wait_pull` (the values after the push).
    fn push_pull_async(&mut self, table: &str, keys: Keys<'_>, values: Values<'_>) -> PyResult<u64> {
        let (w, t) = self.parts(table)?;
        let k = keys.slice()?;
        let pending = w.push_pull_async(t, k, values.slice()?).map_err(failed)?;
        let shape = [k.len(), t.value_len()];
        let id = self.ticket();
        self.pulls.insert(id, (pending, shape));
        Ok(id)
    }

    /// The values of keys `start..end` (end exclusive) as a new `float32` array of shape
    /// `(end - start, value_len)`: one message per node holding a part of the range.
    fn pull_range<'py>(&mut self, py: Python<'py>, table: &str, start: u64, end: u64) -> PyResult<Bound<'py, PyAny>> {
        let (w, t) = self.parts(table)?;
        if start > end || end > t.keys() {
            return Err(argument(format!("range {start}..{end} is not within table '{table}' (keys 0..{})", t.keys())));
        }
        let rows = (end - start) as usize;
        let mut out = vec![0.0f32; rows * t.value_len()];
        py.allow_threads(|| w.pull_range(t, start..end, &mut out)).map_err(failed)?;
        Ok(PyArray1::from_vec(py, out).reshape([rows, t.value_len()])?.into_any())
    }

    /// Pushes `values` (`(end - start) × value_len` floats) to keys `start..end`.
    fn push_range(&mut self, py: Python<'_>, table: &str, start: u64, end: u64, values: Values<'_>) -> PyResult<()> {
        let (w, t) = self.parts(table)?;
        let v = values.slice()?;
        py.allow_threads(|| w.push_range(t, start..end, v)).map_err(failed)
    }

    /// Registers a distribution to sample keys of `table` from (NuPS's sampling): keys
    /// `start..end`, uniformly or with `weights` (one per key), drawn by `scheme`
    /// (`independent`, `reuse[:POOL:USES]`, `postpone[:POOL:USES]`, `local`, or a conformity
    /// level `L1`–`L4`). Returns its number for `prepare_sample`.
    #[pyo3(signature = (table, start, end, scheme = "independent", weights = None))]
    fn register_distribution(&mut self, table: &str, start: u64, end: u64, scheme: &str, weights: Option<Vec<f64>>) -> PyResult<usize> {
        let (w, t) = self.parts(table)?;
        let dist = match weights {
            None => engine::KeyDistribution::uniform(start..end),
            Some(weights) => {
                if weights.len() as u64 != end.saturating_sub(start) {
                    return Err(argument(format!("{} weights for the {} keys {start}..{end}", weights.len(), end.saturating_sub(start))));
                }
                engine::KeyDistribution::Weighted { start, weights }
            }
        };
        let scheme = engine::SamplingScheme::parse(scheme).map_err(failed)?;
        let id = w.register_distribution(t, dist, scheme).map_err(failed)?;
        self.distributions.push((id, t.value_len()));
        Ok(self.distributions.len() - 1)
    }

    /// Draws `n` samples from distribution `distribution` (`register_distribution`'s number);
    /// returns a handle for `pull_sample`, which hands them out.
    fn prepare_sample(&mut self, distribution: usize, n: usize) -> PyResult<u64> {
        let &(id, len) =
            self.distributions.get(distribution).ok_or_else(|| argument(format!("no distribution {distribution} was registered by this worker")))?;
        let w = self.worker.as_mut().ok_or_else(|| argument("the worker is closed"))?;
        let handle = w.prepare_sample(id, n).map_err(failed)?;
        let ticket = self.ticket();
        self.samples.insert(ticket, (handle, len));
        Ok(ticket)
    }

    /// The next `count` samples of `handle`: `(keys, values)`, a `uint64` array and a `float32`
    /// array of shape `(count, value_len)`. A handle whose samples are all handed out is gone.
    fn pull_sample<'py>(&mut self, py: Python<'py>, handle: u64, count: usize) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let (sample, len) = self.samples.get_mut(&handle).ok_or_else(|| argument(format!("{handle} is not a prepared sample of this worker")))?;
        let len = *len;
        if count > sample.remaining() {
            return Err(argument(format!("{count} samples asked for, {} left in the handle", sample.remaining())));
        }
        let w = self.worker.as_mut().ok_or_else(|| argument("the worker is closed"))?;
        let (mut keys, mut values) = (vec![0u64; count], vec![0.0f32; count * len]);
        py.allow_threads(|| w.pull_sample(sample, &mut keys, &mut values)).map_err(failed)?;
        if sample.remaining() == 0 {
            self.samples.remove(&handle);
        }
        Ok((PyArray1::from_vec(py, keys).into_any(), PyArray1::from_vec(py, values).reshape([count, len])?.into_any()))
    }

    /// Replaces the keys' values with `values`.
    fn set(&mut self, py: Python<'_>, table: &str, keys: Keys<'_>, values: Values<'_>) -> PyResult<()> {
        let (w, t) = self.parts(table)?;
        let (k, v) = (keys.slice()?, values.slice()?);
        py.allow_threads(|| w.set(t, k, v)).map_err(failed)
    }

    /// Moves the keys to this node and waits until they are here.
    fn localize(&mut self, py: Python<'_>, table: &str, keys: Keys<'_>) -> PyResult<()> {
        let (w, t) = self.parts(table)?;
        let k = keys.slice()?;
        py.allow_threads(|| w.localize(t, k)).map_err(failed)
    }

    /// Starts a pull; returns a ticket for `wait_pull`.
    fn pull_async(&mut self, table: &str, keys: Keys<'_>) -> PyResult<u64> {
        let (w, t) = self.parts(table)?;
        let k = keys.slice()?;
        let pending = w.pull_async(t, k).map_err(failed)?;
        let shape = [k.len(), t.value_len()];
        let id = self.ticket();
        self.pulls.insert(id, (pending, shape));
        Ok(id)
    }

    /// Starts a push (the values are copied before this returns); returns a ticket for `wait`.
    fn push_async(&mut self, table: &str, keys: Keys<'_>, values: Values<'_>) -> PyResult<u64> {
        let (w, t) = self.parts(table)?;
        let pending = w.push_async(t, keys.slice()?, values.slice()?).map_err(failed)?;
        Ok(self.hand_out(pending))
    }

    /// Starts a set (the values are copied before this returns); returns a ticket for `wait`.
    fn set_async(&mut self, table: &str, keys: Keys<'_>, values: Values<'_>) -> PyResult<u64> {
        let (w, t) = self.parts(table)?;
        let pending = w.set_async(t, keys.slice()?, values.slice()?).map_err(failed)?;
        Ok(self.hand_out(pending))
    }

    /// Starts moving keys to this node; returns a ticket for `wait`.
    fn localize_async(&mut self, table: &str, keys: Keys<'_>) -> PyResult<u64> {
        let (w, t) = self.parts(table)?;
        let pending = w.localize_async(t, keys.slice()?).map_err(failed)?;
        Ok(self.hand_out(pending))
    }

    /// Waits for a push, set or localize ticket.
    fn wait(&mut self, py: Python<'_>, ticket: u64) -> PyResult<()> {
        let pending =
            self.pushes.remove(&ticket).ok_or_else(|| argument(format!("ticket {ticket} is not an outstanding push, set or localize of this worker")))?;
        let w = self.worker.as_mut().ok_or_else(|| argument("the worker is closed"))?;
        py.allow_threads(|| w.wait(pending)).map_err(failed)
    }

    /// Waits for a pull ticket; returns its values as a `float32` array of shape
    /// `(keys, value_len)`.
    fn wait_pull<'py>(&mut self, py: Python<'py>, ticket: u64) -> PyResult<Bound<'py, PyAny>> {
        let (pending, shape) = self.pulls.remove(&ticket).ok_or_else(|| argument(format!("ticket {ticket} is not an outstanding pull of this worker")))?;
        let w = self.worker.as_mut().ok_or_else(|| argument("the worker is closed"))?;
        let values = py.allow_threads(|| w.wait_pull(pending)).map_err(failed)?;
        Ok(PyArray1::from_vec(py, values).reshape(shape)?.into_any())
    }

    /// Declares that this worker will need the keys in its clocks `start..end` (start
    /// inclusive, end exclusive), so that the node moves them here in time (intent signalling).
    fn intent(&mut self, table: &str, keys: Keys<'_>, start: u64, end: u64) -> PyResult<()> {
        let (w, t) = self.parts(table)?;
        let k = keys.slice()?;
        w.intent(t, k, start, end).map_err(failed)
    }

    /// Completes this worker's clock and returns the new one (its asynchronous operations
    /// complete first; with a delay bound it waits for slower workers).
    fn advance_clock(&mut self, py: Python<'_>) -> PyResult<u64> {
        let w = self.worker.as_mut().ok_or_else(|| argument("the worker is closed"))?;
        py.allow_threads(|| w.advance_clock()).map_err(failed)
    }

    /// The clock this worker is in (the number of clocks it completed).
    fn current_clock(&self) -> PyResult<u64> {
        Ok(self.worker.as_ref().ok_or_else(|| argument("the worker is closed"))?.current_clock())
    }

    /// Waits for this worker's asynchronous operations, then for every worker of every node.
    fn barrier(&mut self, py: Python<'_>) -> PyResult<()> {
        let w = self.worker.as_mut().ok_or_else(|| argument("the worker is closed"))?;
        py.allow_threads(|| w.barrier()).map_err(failed)
    }

    /// Releases the worker (outstanding tickets are forgotten); needed before `Node.finalize`.
    fn close(&mut self) {
        self.pushes.clear();
        self.pulls.clear();
        self.samples.clear();
        self.worker = None;
    }

    /// For the bindings' benchmark (`python/benchmarks/pull.py`): seconds that `repetitions`
    /// pulls of `keys` into one buffer take from Rust, without Python in between — what the
    /// same pulls through `pull` are measured against.
    fn _time_pulls(&mut self, py: Python<'_>, table: &str, keys: Keys<'_>, repetitions: usize) -> PyResult<f64> {
        let (w, t) = self.parts(table)?;
        let k = keys.slice()?;
        let mut out = vec![0.0f32; k.len() * t.value_len()];
        py.allow_threads(|| {
            let started = std::time::Instant::now();
            for _ in 0..repetitions {
                w.pull(t, k, &mut out)?;
            }
            Ok(started.elapsed().as_secs_f64())
        })
        .map_err(failed)
    }
}

/// The raw id of the string feature `text` (a word, a `field=value` pair), for a table made
/// with `feature_hashing`: the same id in every process and binding.
#[pyfunction]
fn feature_id(text: &str) -> u64 {
    engine::feature_id(text)
}

/// The examples a plan of `ferry partition` gives node `node`: their indices, in order, for the
/// trainer to take (the table made with `plan=` homes the keys). Raises `FerryError` on a file
/// that is not a plan, or on a node the plan does not have.
#[pyfunction]
fn plan_examples(path: std::path::PathBuf, node: usize) -> PyResult<Vec<u64>> {
    let plan = engine::copartition::Plan::read(&path).map_err(failed)?;
    if node >= plan.nodes() {
        return Err(argument(format!("the plan has nodes 0..{}; there is no node {node}", plan.nodes())));
    }
    Ok(plan.examples_of(node).map(|i| i as u64).collect())
}

/// Reads a whole checkpoint (written by `Node.checkpoint` on any number of nodes, or by a
/// training run's `--checkpoint-dir`) outside a cluster: a dict of every table's values by
/// name, each a `float32` array of shape `(keys, value_len)` (optimizer state left out); for a
/// dynamic table a pair `(ids, values)`: its ids ascending (`uint64`) and their rows.
/// Raises `FerryError` naming the file when the checkpoint is incomplete or damaged.
#[pyfunction]
fn read_checkpoint<'py>(py: Python<'py>, dir: std::path::PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let tables = py.allow_threads(|| engine::read_checkpoint(&dir)).map_err(failed)?;
    let out = PyDict::new(py);
    for t in tables {
        let shape = [t.keys as usize, t.value_len];
        let values = PyArray1::from_vec(py, t.values).reshape(shape)?;
        if t.dynamic {
            out.set_item(t.name, (PyArray1::from_vec(py, t.ids), values))?;
        } else {
            out.set_item(t.name, values)?;
        }
    }
    Ok(out)
}

/// Reads a spill file (`FERRY_SPILL_DIR/TABLE.node-R.spill`: the ids a dynamic table's home
/// evicted, with their values): `(ids, values)`, a `uint64` array in the order they were
/// evicted and a `float32` array of shape `(len(ids), value_len)`. Raises `FerryError` on a
/// file that is not one.
#[pyfunction]
fn read_spill<'py>(py: Python<'py>, path: std::path::PathBuf) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let spill = py.allow_threads(|| engine::dynamic::read_spill(&path)).map_err(failed)?;
    let rows = spill.ids.len();
    Ok((PyArray1::from_vec(py, spill.ids).into_any(), PyArray1::from_vec(py, spill.values).reshape([rows, spill.value_len])?.into_any()))
}

/// The native part of the `ferry` package (`ferry._native`; `python/ferry/__init__.py`
/// re-exports it).
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(read_spill, m)?)?;
    m.add_function(wrap_pyfunction!(feature_id, m)?)?;
    m.add_function(wrap_pyfunction!(plan_examples, m)?)?;
    m.add_class::<Node>()?;
    m.add_class::<RelocationHold>()?;
    m.add_class::<Table>()?;
    m.add_class::<stats::Stats>()?;
    m.add_class::<Worker>()?;
    m.add("FerryError", m.py().get_type::<FerryError>())?;
    Ok(())
}
