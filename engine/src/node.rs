//! A running node: start-up, the public handle, shutdown.
//!
//! There is no protocol thread: whoever has an event runs it on the shared protocol state
//! (see [`crate::runtime`]). A node's threads are the fabric's (connection readers and writers,
//! or the verbs poller), the timer, and the trainer's own worker threads.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::fabric::Fabric;
use crate::protocol::{BarrierKind, Core, Settings};
use crate::runtime::{Callbacks, NodeInner};
use crate::stats::Stats;
use crate::store::{PageKind, Store};
use crate::table::Table;
use crate::worker::{IntentService, Worker};

/// A running node: one process's share of the cluster.
pub struct Node {
    inner: Arc<NodeInner>,
    /// The workers' intents and the thread acting on them (handed to every worker).
    intents: Arc<IntentService>,
    timer: Option<JoinHandle<()>>,
    replication: Option<JoinHandle<()>>,
    /// The backup rounds' thread ([`Config::backups`]).
    backups: Option<JoinHandle<()>>,
    /// The eviction thread (a dynamic table that evicts ids).
    eviction: Option<JoinHandle<()>>,
    /// The metrics endpoint ([`Config::metrics`]), if served.
    metrics: Option<crate::metrics::MetricsServer>,
    finished: bool,
    /// Checkpoints taken so far ([`Node::checkpoint`]).
    checkpoints: AtomicU64,
    /// The buffers of the last checkpoint's cut, for the next.
    spare_cuts: crate::checkpoint::SpareCuts,
}

/// A slot in a node's registered memory, as [`Node::slot_address`] gives it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAddress {
    /// The node holding the slot.
    pub node: usize,
    /// Its region key (an rkey over verbs).
    pub region: u32,
    /// Its address in that node's region address space.
    pub addr: u64,
    /// Elements of the value.
    pub value_len: usize,
    /// Words of optimizer state between the value and the slot's tail version.
    pub state_len: usize,
}

impl Node {
    /// Starts this node: joins the cluster at the coordinator, connects to every peer, checks
    /// that all nodes have the same tables and settings, and allocates the home keys' values.
    /// With [`Config::join`] set (`FERRY_JOIN`), joins a running cluster instead ([`Node::join`]).
    pub fn start(mut config: Config) -> Result<Node> {
        if let Some(contact) = config.join.clone() {
            return Node::join(config, &contact);
        }
        config.resolve_dynamic_tables();
        config.validate()?;
        crate::memory::check_tables_fit(&config)?;
        let (fabric, clock_offset) = crate::fabric::select::connect(&config)?;
        let node = Self::assemble(config, fabric, clock_offset, None)?;
        node.admit_joins();
        Ok(node)
    }

    /// Starts this node in the rank of a node that left or was lost, and joins the running
    /// cluster through `contact`: a member's join address ([`Node::join_addresses`]; rank 0
    /// takes joins at its rendezvous address, `FERRY_COORDINATOR`, too). `config` has the
    /// cluster's tables and settings, and this node's rank and the node count. Over TCP only,
    /// with backups and without bounded delay.
    ///
    /// Returns once the node has joined: it holds the keys it stands in for (its own share,
    /// handed back from the backups of the node that served them), takes part in barriers from
    /// the next ones, and every member counts it, so that its workers may start. Workers
    /// elsewhere see a short pause while the keys move.
    pub fn join(mut config: Config, contact: &str) -> Result<Node> {
        config.resolve_dynamic_tables();
        config.validate()?;
        crate::memory::check_tables_fit(&config)?;
        if config.restore_from.is_some() {
            return Err(Error::Config("a joining node takes its keys from the running cluster, not from a checkpoint (FERRY_RESTORE)".into()));
        }
        if config.backups == 0 {
            return Err(Error::Config(
                "a node can join only with backups (FERRY_BACKUPS=1): its keys come back from the backups of whoever serves them".into(),
            ));
        }
        if config.max_delay.is_some() {
            return Err(Error::Config("a node cannot join a cluster whose workers share clocks (bounded delay)".into()));
        }
        if config.relocation {
            return Err(Error::Config(
                "a node can join only a cluster that does not relocate keys, so far (Config::relocation = false; the training commands' --mode classic)".into(),
            ));
        }
        let (fabric, coordinator) = crate::fabric::select::join(&config, contact)?;
        // Cluster time is the coordinator's clock, which only bounded delay compares across
        // nodes: a joining node takes its own.
        let node = Self::assemble(config, fabric, 0, Some(coordinator))?;
        let timeout = node.inner.config.op_timeout * node.inner.config.nodes as u32;
        let deadline = std::time::Instant::now() + timeout;
        while !node.inner.core.join_state().1 {
            if let Some(why) = node.inner.core.join_given_up() {
                // A refusal, as the ask's (the node stops; the members take it for lost).
                return Err(Error::Config(format!("node {} could not join the cluster: {why}", node.inner.config.rank)));
            }
            if std::time::Instant::now() > deadline {
                return Err(Error::Timeout { what: "joining the cluster", millis: timeout.as_millis() as u64, nodes: vec![coordinator as usize] });
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let from = node.inner.core.barriers().lock().first_generations(node.inner.config.rank as u16);
        node.inner.start_barriers_at(from);
        tracing::info!(node = node.inner.config.rank, barriers_from = ?from, "joined the cluster");
        node.admit_joins();
        Ok(node)
    }

    /// From now on, nodes may join through this one in the rank of a lost or departed peer.
    fn admit_joins(&self) {
        if self.inner.config.backups > 0 && self.inner.config.max_delay.is_none() {
            self.inner.fabric.admit_joins(crate::fabric::select::join_info(self.inner.fabric.name(), &self.inner.config));
            tracing::info!(node = self.inner.config.rank, addresses = ?self.join_addresses(), "nodes may join the cluster through this one (FERRY_JOIN)");
        }
    }

    /// The addresses at which a node may join the cluster through this one (see
    /// [`Node::join`]); empty when this node takes no joins (a single node, or verbs).
    pub fn join_addresses(&self) -> Vec<std::net::SocketAddr> {
        self.inner.fabric.join_addresses()
    }

    /// Builds the node over a connected fabric and starts it; a node that joins (`joining`: the
    /// member to ask) asks before any of its services runs.
    fn assemble(config: Config, fabric: Arc<dyn Fabric>, clock_offset: i64, joining: Option<u16>) -> Result<Node> {
        let store = Arc::new(Store::new(config.rank, config.nodes, &config.tables, config.latches, config.huge_pages, fabric.registrar())?);
        // Dynamic tables' indexes, made before a restore fills them.
        let id_indexes: Vec<_> = config
            .tables
            .iter()
            .map(|t| t.dynamic.map(|d| crate::dynamic::IdIndex::with_replicated(d, config.rank, config.nodes, &t.replicated_ids)))
            .collect();
        // Replicated ids start at their initial values in every copy (a restore then overwrites
        // those it saved).
        for (table, index) in id_indexes.iter().enumerate() {
            if let Some(index) = index {
                start_replicated(&store, table as u16, index)?;
            }
        }
        let first_clock = match &config.restore_from {
            Some(dir) => crate::checkpoint::restore(dir, &store, &config, &id_indexes)?,
            None => 0,
        };
        let settings = Settings {
            relocation: config.relocation,
            backups: config.backups,
            location_caches: config.location_caches,
            max_message_bytes: config.max_message_bytes,
            part_bytes: config.part_bytes,
            small_operation_rows: crate::protocol::SMALL_OPERATION_ROWS,
            op_timeout_ns: config.op_timeout.as_nanos() as u64,
            loss_grace_ns: (config.peer_timeout * 2).as_nanos() as u64,
            shards: config.shards,
            share_clocks: config.max_delay.is_some(),
            first_clock,
        };
        let mut core = Core::new(config.rank, config.nodes, &config.tables, store, settings);
        core.set_id_indexes(id_indexes);
        let spiller = match &config.spill_dir {
            Some(dir) if config.tables.iter().any(|t| t.dynamic.is_some_and(|d| d.eviction.evicts())) => {
                // A restored checkpoint's spilled rows of the ids homed here start the files.
                let seed = match &config.restore_from {
                    Some(checkpoint) => crate::checkpoint::spilled_rows(checkpoint, &config)?,
                    None => Vec::new(),
                };
                core.spill_evicted();
                let evicting: Vec<_> =
                    config.tables.iter().map(|t| t.dynamic.filter(|d| d.eviction.evicts()).map(|_| (t.name.as_str(), t.value_len))).collect();
                Some(crate::dynamic::spill::Spiller::open(dir, config.rank, &evicting, seed)?)
            }
            _ => None,
        };
        let inner = Arc::new(NodeInner::new(config, core, fabric.clone(), clock_offset, spiller));
        let metrics = match &inner.config.metrics {
            Some(base) => {
                let server = crate::metrics::MetricsServer::start(inner.clone(), &crate::metrics::address(base, inner.config.rank)?)?;
                tracing::info!(node = inner.config.rank, address = %server.address, "serving metrics at /metrics");
                Some(server)
            }
            None => None,
        };
        fabric.start(Arc::new(Callbacks { node: Arc::downgrade(&inner) }))?;
        if let Some(coordinator) = joining {
            // Before the backup thread starts: a round now would ship the fresh home keys' zeros
            // as this rank's images, which the ask drops.
            inner.run_pooled(|step, _, _| step.ask_to_join(coordinator))?;
        }
        let timer = spawn_service(&inner, "timer", "timer", NodeInner::run_timer)?;
        let replication = inner.replicates().then(|| spawn_service(&inner, "replicas", "replication", NodeInner::run_replication)).transpose()?;
        let backups = (inner.config.backups > 0).then(|| spawn_service(&inner, "backups", "backup", NodeInner::run_backups)).transpose()?;
        let eviction = inner.evicts().then(|| spawn_service(&inner, "eviction", "eviction", NodeInner::run_eviction)).transpose()?;
        let intents = Arc::new(IntentService::new(&inner.config));
        let listener: Arc<dyn crate::runtime::GrantListener> = intents.clone();
        inner.listen_for_grants(Arc::downgrade(&listener));
        Ok(Node {
            inner,
            intents,
            timer: Some(timer),
            replication,
            backups,
            eviction,
            metrics,
            finished: false,
            checkpoints: AtomicU64::new(0),
            spare_cuts: Default::default(),
        })
    }

    /// Starts `nodes` nodes inside this process, connected over loopback TCP, with `template`'s
    /// tables and settings (its rank, node count and coordinator are replaced; without a secret,
    /// the nodes share a fresh one). For tests and single-machine benchmarks.
    pub fn start_local_cluster(nodes: usize, mut template: Config) -> Result<Vec<Node>> {
        if template.membership.secret.is_none() && !template.no_secret {
            template.membership.secret = Some(crate::config::generate_secret().into_bytes());
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| Error::Transport(e.to_string()))?.port();
        let handles: Vec<_> = (0..nodes)
            .map(|rank| {
                let mut config = template.clone();
                config.rank = rank;
                config.nodes = nodes;
                config.coordinator = format!("127.0.0.1:{port}");
                std::thread::spawn(move || Node::start(config))
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| Error::Transport("a node's start-up panicked".into()))?).collect()
    }

    /// The node's shared state (engine unit tests drive its parts directly).
    #[cfg(test)]
    pub(crate) fn inner(&self) -> &Arc<NodeInner> {
        &self.inner
    }

    /// This node's rank.
    pub fn rank(&self) -> usize {
        self.inner.config.rank
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.inner.config.nodes
    }

    /// Cluster time in nanoseconds: this host's monotonic clock aligned to rank 0's at start-up,
    /// so that times taken on different nodes compare (within the alignment's error, tens of
    /// microseconds on one host).
    pub fn cluster_time_ns(&self) -> u64 {
        self.inner.now()
    }

    /// The nodes this one knows are lost, with why, in the order of the losses. With backups
    /// ([`Config::backups`]) their keys are served by their successors; without, operations
    /// on their keys fail.
    pub fn lost_nodes(&self) -> Vec<(usize, String)> {
        self.inner.core.directory().lost_nodes().into_iter().map(|(n, why)| (n as usize, why)).collect()
    }

    /// How many times a fresh node joined in `rank` since the cluster started (wrapping at 256;
    /// 0 for the node the cluster started with, and for a rank beyond the cluster): a rank lost
    /// and taken back by a fresh node ([`Node::join`]) is a new member, with none of the old
    /// one's local state.
    pub fn incarnation(&self, rank: usize) -> u8 {
        u16::try_from(rank).map_or(0, |r| self.inner.core.directory().incarnation(r))
    }

    /// The configuration the node runs with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Name of the fabric in use ("tcp" or "verbs").
    pub fn transport(&self) -> &'static str {
        self.inner.fabric.name()
    }

    /// The kind of pages backing parameter memory (the worst used, if huge pages ran out).
    pub fn page_kind(&self) -> Option<PageKind> {
        self.inner.core.store().page_kind()
    }

    /// Looks a table up by name.
    pub fn table(&self, name: &str) -> Result<Table> {
        self.inner.table(name)
    }

    /// A handle for one trainer thread.
    pub fn worker(&self) -> Worker {
        Worker::new(self.inner.clone(), self.intents.clone())
    }

    /// This node's statistics.
    pub fn stats(&self) -> Stats {
        self.inner.core.stats()
    }

    /// Runs a replication round now (see [`crate::replication`]): ships this node's replica
    /// deltas to their home nodes, waits until they are applied, and refreshes this node's
    /// replicas. Returns at once when no table replicates keys. Rounds also run by themselves,
    /// at least every half of [`Config::staleness`], and around every worker barrier.
    pub fn sync_replicas(&self) -> Result<()> {
        self.inner.replication_sync()
    }

    /// Writes this node's part of a checkpoint into `dir` (see `docs/CHECKPOINTS.md`): the
    /// values and optimizer state of every key it owns, with their keys, then a manifest. A
    /// collective call: every node calls it with the same directory, which holds one
    /// checkpoint; it is whole once every node's call returned, and
    /// [`Config::restore_from`] starts a cluster of any node count from it.
    ///
    /// The cut is taken when the call runs, after a replication round folded replicated keys'
    /// updates into their homes: call it when no worker of any node pushes and no key
    /// relocates — after a barrier that every worker reached with its pushes acknowledged, and,
    /// where workers declare intents, with [`Node::hold_relocations`] called on every node and
    /// another barrier passed (refused otherwise) — and let workers go on after a further
    /// barrier. A key found on its
    /// way to this node is an error rather than a key left out.
    pub fn checkpoint(&self, dir: impl AsRef<std::path::Path>) -> Result<crate::CheckpointInfo> {
        self.checkpoint_in_background(dir)?.wait()
    }

    /// [`Node::checkpoint`], returning once the cut is taken (a copy of the node's keys in
    /// memory, taken with every latch held): the files are written by a thread of their own
    /// while training goes on, and [`crate::CheckpointWriting::wait`] says when they are
    /// durable. The workers may push again once every node's call returned (a barrier after
    /// it), so that no node's cut holds a push of the next phase.
    pub fn checkpoint_in_background(&self, dir: impl AsRef<std::path::Path>) -> Result<crate::CheckpointWriting> {
        if !self.intents.at_rest() {
            return Err(Error::Checkpoint(
                "intent may be relocating keys: call Node::hold_relocations on every node, then a barrier, before a checkpoint (and Node::release_relocations after it)".into(),
            ));
        }
        self.sync_replicas()?;
        let sequence = self.checkpoints.fetch_add(1, Ordering::Relaxed) + 1;
        let config = &self.inner.config;
        let indexes: Vec<_> = (0..config.tables.len()).map(|t| self.inner.core.id_index(t as u16)).collect();
        let cuts = crate::checkpoint::cut(self.inner.core.store(), &config.tables, &indexes, config.rank, config.nodes, &self.spare_cuts)?;
        let clock = self.inner.core.clocks().lock().checkpoint_clock();
        // Lost nodes whose keys failed over, and nodes that left: their keys are in the files
        // of the nodes that took them over. (Without backups a lost node's keys are gone, and
        // the checkpoint is not whole without its files.)
        let directory = self.inner.core.directory();
        let mut absent: Vec<usize> = if directory.failover() { directory.lost_nodes().into_iter().map(|(n, _)| n as usize).collect() } else { Vec::new() };
        absent.sort_unstable();
        // Rows evicted up to now are in the spill files (rows evicted after the cut too: an id
        // both in the cut and in its spill file is one evicted meanwhile).
        let spills = self.inner.write_spilled(true)?;
        let admission = indexes.iter().enumerate().filter_map(|(t, index)| Some((t as u16, index.as_ref()?.admission_state()?))).collect();
        let cut = crate::checkpoint::Cut { sequence, clock, absent, spills, admission };
        crate::checkpoint::write_in_background(dir.as_ref().to_path_buf(), config.clone(), cut, cuts, self.spare_cuts.clone())
    }

    /// Holds the relocations that intent signalling makes on this node, for a checkpoint: the
    /// homes' grants wait until [`Node::release_relocations`], and this returns once every
    /// relocation the node's intent service started has landed. Called on every node, then a
    /// barrier: from there no key moves between nodes (the workers' own `localize` calls
    /// aside), so each node's cut finds every key where the others' do. Rounds, run-time
    /// replicas and their sync rounds go on meanwhile. Returns at once on a node whose workers
    /// never declared an intent.
    pub fn hold_relocations(&self) -> Result<()> {
        self.intents.hold_moves(&self.inner)
    }

    /// Ends [`Node::hold_relocations`] (after the checkpoint's cut, on every node): the grants
    /// that waited are taken up.
    pub fn release_relocations(&self) {
        self.intents.release_moves(&self.inner);
    }

    /// Where this node serves its metrics for Prometheus (`GET /metrics`), if it does
    /// ([`Config::metrics`], `FERRY_METRICS`).
    pub fn metrics_address(&self) -> Option<std::net::SocketAddr> {
        self.metrics.as_ref().map(|m| m.address)
    }

    /// Forgets the relocation and blocking times recorded so far, so that the next
    /// [`Node::stats`] describes only what follows.
    pub fn reset_latencies(&self) {
        self.inner.core.reset_latencies();
    }

    /// Slots of `table` in use here and bytes of arena memory mapped for it.
    pub fn memory(&self, table: Table) -> (usize, usize) {
        let t = self.inner.core.store().table(table.id);
        (t.slot_usage().0, t.arena_bytes())
    }

    /// Where `key`'s value lives in this node's registered memory, for one-sided readers on
    /// other nodes (replica refresh); `None` when this node does not hold the key. The address
    /// stays valid while the key stays here: relocating the key away frees the slot.
    pub fn slot_address(&self, table: Table, key: u64) -> Result<Option<SlotAddress>> {
        self.inner.check_table(table)?;
        if key >= table.keys {
            return Err(Error::UnknownKey { table: self.inner.config.tables[table.id as usize].name.clone(), key, keys: table.keys });
        }
        let t = self.inner.core.store().table(table.id);
        Ok(t.slot_of(key).map(|slot| {
            let remote = t.remote_addr(slot);
            SlotAddress { node: self.rank(), region: remote.region, addr: remote.addr, value_len: table.value_len, state_len: t.state_len() }
        }))
    }

    /// Reads the value at `at` — a slot on another node — with one-sided reads, validated by
    /// the slot's version: a copy that may have caught a write in progress is read again.
    /// Returns how many copies were discarded.
    ///
    /// Neither RDMA nor `memcpy` promises the order in which the bytes of one read are fetched,
    /// so the copy is bracketed seqlock-style: the slot's write counter is read alone before
    /// and after the copy, and the copy is kept only when both are equal and even (no write
    /// began or ended in between). That is three dependent reads; over verbs each is one RDMA
    /// READ, over TCP the peer's connection thread serves them without its engine.
    pub fn read_slot(&self, at: &SlotAddress, out: &mut [f32]) -> Result<u32> {
        if out.len() != at.value_len {
            return Err(Error::WrongLength { what: "read_slot output", expected: at.value_len, got: out.len() });
        }
        if at.node == self.rank() || at.node >= self.inner.config.nodes {
            return Err(Error::Config(format!("node {} is not a peer of node {}", at.node, self.rank())));
        }
        let fabric = &self.inner.fabric;
        let timeout = self.inner.config.op_timeout;
        // The copy covers the state too (it lies between the value and the tail version).
        let stored = at.value_len + at.state_len;
        let mut copy = vec![0u8; crate::store::slot_copy_len(stored)];
        let slot = crate::store::RemoteAddr { region: at.region, addr: at.addr };
        let counter = crate::store::RemoteAddr { region: at.region, addr: at.addr + crate::store::slot_counter_offset(stored) as u64 };
        let (mut before, mut after) = ([0u8; 4], [0u8; 4]);
        const ATTEMPTS: u32 = 10_000;
        fabric.read(at.node, counter, &mut before, timeout)?;
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                // The last attempt's closing read is this one's opening read.
                before = after;
                if u32::from_le_bytes(before) % 2 != 0 {
                    std::thread::yield_now();
                    fabric.read(at.node, counter, &mut before, timeout)?;
                }
            }
            if u32::from_le_bytes(before) % 2 == 0 {
                fabric.read(at.node, slot, &mut copy, timeout)?;
                fabric.read(at.node, counter, &mut after, timeout)?;
                if before == after
                    && let Some(words) = crate::store::validate_slot_copy(&copy, stored)
                {
                    for (o, c) in out.iter_mut().zip(words.chunks_exact(4)) {
                        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                    return Ok(attempt);
                }
            } else {
                after = before;
            }
        }
        Err(Error::Contended { attempts: ATTEMPTS })
    }

    /// Shuts down cleanly: a cluster-wide barrier (so that no node leaves while others still
    /// talk to it), then every connection closed and every thread joined. All worker handles
    /// must be dropped first; otherwise this returns [`Error::WorkersAlive`] and changes nothing.
    /// After it, operations fail with [`Error::ShutDown`].
    pub fn finalize(&mut self) -> Result<()> {
        self.check_stoppable()?;
        self.intents.stop();
        // The replication thread stops first (a round of its own could still be talking to a
        // peer that already left); then the replicas' last pushes go home before anyone leaves.
        self.stop_replication();
        let shipped = self.inner.replication_sync();
        self.inner.finalizing.store(true, Ordering::Release);
        let result = self.inner.barrier_round(BarrierKind::Finalize).and(shipped);
        self.close(false);
        result
    }

    /// Leaves the cluster gracefully, for good: this node's keys (and those it took over from
    /// lost nodes) are handed to its successor first, so no operation fails and no push is
    /// lost; the others go on without it, their workers pausing for a few round trips at most
    /// while it hands over. Then every connection is closed and every thread joined, as
    /// [`Node::finalize`] does for a node that stays to the end.
    ///
    /// In a cluster that relocates keys, it first gives the keys of other homes it holds back
    /// to their homes, and the others take a census of where its own keys are once it left
    /// (docs/ARCHITECTURE.md, "A node that leaves").
    ///
    /// Needs backups (`Config::backups = 1`: the keys go over as a last backup round) and a
    /// node other than the coordinator (rank 0, or after its loss the lowest-ranked live node,
    /// which coordinates barriers and departures). Departures run one at a time in the order
    /// the coordinator began them; a coordinator lost meanwhile is succeeded, and the
    /// departure goes on. All worker handles must be dropped first;
    /// otherwise this returns [`Error::WorkersAlive`] and changes nothing. Fails with
    /// [`Error::Timeout`] when the hand-over does not complete within the operation timeout
    /// per node still in the cluster.
    pub fn leave(&mut self) -> Result<()> {
        self.check_stoppable()?;
        self.inner.run_pooled(|step, _, _| step.ask_to_leave().map(|_| crate::protocol::Progress::Done))?;
        self.intents.stop();
        let timeout = self.inner.config.op_timeout * self.inner.config.nodes as u32;
        let deadline = std::time::Instant::now() + timeout;
        while !self.inner.core.leave_state().1 {
            if std::time::Instant::now() > deadline {
                return Err(Error::Timeout { what: "leaving the cluster", millis: timeout.as_millis() as u64, nodes: Vec::new() });
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Every peer closes its connection once it has handled LEFT; until then this node
        // still answers, say, its predecessor's backup round.
        let rank = self.inner.config.rank;
        let deadline = std::time::Instant::now() + self.inner.config.op_timeout;
        while (0..self.inner.config.nodes).any(|p| p != rank && self.inner.fabric.is_alive(p)) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        self.close(false);
        Ok(())
    }

    /// Whether the node may stop (finalize or leave): not stopped yet, and no worker handle
    /// alive.
    fn check_stoppable(&self) -> Result<()> {
        if self.finished {
            return Err(Error::ShutDown);
        }
        match self.inner.live_workers.load(Ordering::Acquire) {
            0 => Ok(()),
            live => Err(Error::WorkersAlive(live)),
        }
    }

    fn stop_replication(&mut self) {
        self.inner.replication_stop.store(true, Ordering::Release);
        self.inner.wake_timer();
        if let Some(t) = self.replication.take() {
            let _ = t.join();
        }
    }

    /// Stops the node at once, as a crash would (peers see it as lost). For fault injection.
    pub fn abort(mut self) {
        self.close(true);
    }

    fn close(&mut self, abort: bool) {
        if self.finished {
            return;
        }
        self.finished = true;
        // The metrics thread holds the node: it stops first.
        self.metrics = None;
        if !abort {
            // (A crash, which `abort` stands for, says nothing.)
            self.inner.announce_leaving();
        }
        self.inner.stopping.store(true, Ordering::Release);
        if abort {
            self.inner.fabric.abort();
        } else {
            self.inner.fabric.shutdown();
        }
        self.inner.wake_timer();
        if let Some(t) = self.timer.take() {
            let _ = t.join();
        }
        self.stop_replication();
        self.inner.wake_backups();
        if let Some(t) = self.backups.take() {
            let _ = t.join();
        }
        if let Some(t) = self.eviction.take() {
            let _ = t.join();
        }
        // Fail whatever still waits, so that no worker stays blocked (the intent thread's
        // worker included, which then ends).
        self.inner.shut_down_workers();
        self.intents.stop();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.close(false);
    }
}

/// Starts a thread of the node's own, `ferryRANK-NAME`, running `run` on the node (`what`
/// names it in the error).
fn spawn_service(inner: &Arc<NodeInner>, name: &str, what: &str, run: fn(&NodeInner)) -> Result<JoinHandle<()>> {
    let node = inner.clone();
    std::thread::Builder::new()
        .name(format!("ferry{}-{name}", inner.config.rank))
        .spawn(move || run(&node))
        .map_err(|e| Error::Transport(format!("cannot start the {what} thread: {e}")))
}

impl NodeInner {
    pub(crate) fn table(&self, name: &str) -> Result<Table> {
        self.config
            .tables
            .iter()
            .position(|t| t.name == name)
            .map(|i| {
                let t = &self.config.tables[i];
                Table {
                    id: i as u16,
                    value_len: t.value_len,
                    keys: t.keys,
                    cluster: self.fingerprint,
                    hashing: t.feature_hashing,
                    dynamic: t.dynamic.is_some(),
                }
            })
            .ok_or_else(|| Error::UnknownTable(name.to_string()))
    }

    /// The handle of table number `id` (which must exist).
    pub(crate) fn table_by_id(&self, id: u16) -> Table {
        let t = &self.config.tables[id as usize];
        Table { id, value_len: t.value_len, keys: t.keys, cluster: self.fingerprint, hashing: None, dynamic: false }
    }

    #[inline]
    pub(crate) fn check_table(&self, table: Table) -> Result<()> {
        if table.cluster == self.fingerprint {
            Ok(())
        } else {
            Err(Error::UnknownTable(format!("#{} (a handle from another cluster configuration)", table.id)))
        }
    }
}

/// Writes the initial value of every replicated id of dynamic table `table` (indexed by
/// `index`) into its copy on this node: the home's slot or the replica (the initial values are
/// a function of the id, so every copy starts the same without a message).
fn start_replicated(store: &Store, table: u16, index: &crate::dynamic::IdIndex) -> Result<()> {
    let mut value = vec![0.0f32; store.table(table).value_len()];
    for (id, key) in index.replicated() {
        index.spec().init.fill(id, &mut value);
        let guard = store.lock(table, key);
        let slot = guard.slot().ok_or_else(|| Error::Protocol(format!("slot key {key} of replicated id {id} of table {table} has no copy on this node")))?;
        slot.write(&value);
    }
    Ok(())
}

/// Finalizes every node of an in-process cluster, all at once (a node's `finalize` waits for
/// its peers), for the crate's unit tests.
#[cfg(test)]
pub(crate) fn finalize_all(nodes: Vec<Node>) {
    std::thread::scope(|s| {
        for mut n in nodes {
            s.spawn(move || n.finalize().unwrap());
        }
    });
}
