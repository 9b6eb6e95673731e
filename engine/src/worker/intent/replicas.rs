//! The intent service's driver of its run-time replicas: executes what the replica set
//! ([`crate::intent::ReplicaSet`], a state machine with no I/O) asks for — pulls that make
//! replicas, drains' pushes, REPLICA_SYNCs, one-sided reads of the owners' images, routed
//! push-pulls — through the service's worker and the node's fabric, and hands their outcomes
//! back. The simulator drives the same machine among simulated workers and network.
//!
//! The service issues everything asynchronously and completes it in its next rounds (at most
//! one sync round in flight), so that a round never waits for the network; a barrier's sync
//! waits until nothing is in flight and then runs one round synchronously through the barrier's
//! worker (the keys it finds lost are dropped by the service's next poll, whose worker owns the
//! drains' pushes).
//!
//! The service does not wait for the image reads, so its rounds come every round time rather
//! than every read (an image read over loopback TCP took 6.6 ms behind the relocations' frames).
//! Sampling the windows that often, a pause in a word's use became a release and the key went
//! back and forth between nodes, unless the pause is bridged: tables whose keys are shared
//! bridge longer pauses (`IntentSettings::shared_gap`).

use std::time::Instant;

use crate::error::{Error, Result};
use crate::fabric::PostedRead;
use crate::intent::{OpToken, ReplicaAction, ReplicaContext, ReplicaSet, SyncMarks};
use crate::runtime::NodeInner;
use crate::worker::{PullTicket, Ticket, Worker};

/// The service's run-time replicas and the operations it issued for them, by token.
pub(crate) struct ReplicaDriver {
    set: ReplicaSet,
    makes: Vec<(OpToken, PullTicket)>,
    pushes: Vec<(OpToken, Ticket)>,
    /// The sync round's routed push-pulls.
    routed: Vec<(OpToken, PullTicket)>,
    /// The sync round's image reads.
    reads: Vec<(OpToken, PostedRead)>,
    /// When the sync round in flight stops waiting for an acknowledgement or a read.
    deadline: Instant,
    /// Granted moves put off because the sync round in flight carried their keys' deltas
    /// (see [`SyncMarks`]): granted again once it has ended.
    put_off_moves: Vec<(u16, Vec<u64>)>,
    /// The node's sync marks (the service's, shared with the workers' `localize`).
    marks: std::sync::Arc<SyncMarks>,
}

impl ReplicaDriver {
    /// A driver whose replica set marks the deltas it carries in `marks`.
    pub fn new(marks: std::sync::Arc<SyncMarks>) -> Self {
        ReplicaDriver {
            set: ReplicaSet::default(),
            makes: Vec::new(),
            pushes: Vec::new(),
            routed: Vec::new(),
            reads: Vec::new(),
            deadline: Instant::now(),
            put_off_moves: Vec::new(),
            marks,
        }
    }
}

/// What the replica set works on at `node`; `alive` says whether the fabric reaches a node.
fn context<'a>(node: &'a NodeInner, alive: &'a dyn Fn(u16) -> bool, marks: &'a SyncMarks) -> ReplicaContext<'a> {
    ReplicaContext {
        store: node.core.store(),
        directory: node.core.directory(),
        counters: node.core.intent_counters(),
        alive,
        max_message_bytes: node.core.settings().max_message_bytes,
        marks,
    }
}

/// Keeps the first error of several steps that all run (`outcome` is what is reported).
pub(super) fn keep_first_error(outcome: &mut Result<()>, result: Result<()>) {
    if outcome.is_ok() {
        *outcome = result;
    }
}

impl ReplicaDriver {
    /// Whether no replica is kept, being made or granted.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }

    /// Whether a sync round is in flight (tests).
    #[cfg(test)]
    pub fn sync_in_flight(&self) -> bool {
        self.set.sync_in_flight()
    }

    /// Whether no sync round is in flight and no dropped replica drains.
    pub fn quiet(&self) -> bool {
        self.set.quiet()
    }

    /// Whether anything is kept or in flight.
    pub fn busy(&self) -> bool {
        self.set.busy()
    }

    /// Takes over the replicas departing keys left here ([`ReplicaSet::adopt_kept`]).
    pub fn adopt_kept(&mut self, node: &NodeInner) {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        self.set.adopt_kept(&context(node, &alive, &self.marks));
    }

    /// Whether a key on its way here has a replica with a delta ([`ReplicaSet::replicas_arriving`]).
    pub fn replicas_arriving(&self, node: &NodeInner) -> bool {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        self.set.replicas_arriving(&context(node, &alive, &self.marks))
    }

    /// Takes a replica grant for `keys` ([`ReplicaSet::start_make`]) and issues the pulls it
    /// asks for through `worker` (which bypasses replicas). Returns whether the grant was
    /// taken; an error (a pull could not be sent) leaves it taken, and [`ReplicaDriver::remake`]
    /// tries again.
    pub fn start_make(&mut self, node: &NodeInner, worker: &mut Worker, table: u16, keys: &[u64]) -> Result<bool> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        let taken = self.set.start_make(&context(node, &alive, &self.marks), table, keys);
        self.execute(node, worker).map(|()| taken)
    }

    /// Makes replicas of `keys` of `table` through `worker` and installs them, waiting (tests).
    #[cfg(test)]
    pub(super) fn make_now(&mut self, node: &NodeInner, worker: &mut Worker, table: u16, keys: &[u64]) {
        assert!(self.start_make(node, worker, table, keys).unwrap(), "the table keeps no run-time replicas");
        self.poll(node, worker, true).unwrap();
    }

    /// The replica set itself (tests).
    #[cfg(test)]
    pub(super) fn machine(&self) -> &ReplicaSet {
        &self.set
    }

    /// Makes the replicas of granted keys that are elsewhere now and have none
    /// ([`ReplicaSet::remake`]).
    pub fn remake(&mut self, node: &NodeInner, worker: &mut Worker, all: bool) -> Result<()> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        self.set.remake(&context(node, &alive, &self.marks), all);
        self.execute(node, worker)
    }

    /// Drops the replicas of `keys` of `table` ([`ReplicaSet::drop_keys`]).
    pub fn drop_keys(&mut self, node: &NodeInner, worker: &mut Worker, table: u16, keys: &[u64]) -> Result<()> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        self.set.drop_keys(&context(node, &alive, &self.marks), table, keys);
        self.execute(node, worker)
    }

    /// Of `keys` of `table`, granted to move here, those to move now: the keys whose deltas the
    /// sync round in flight carries are put off until it has ended (counted), and granted again
    /// then by [`ReplicaDriver::repost_put_off_moves`].
    pub fn put_off_moves_carried(&mut self, node: &NodeInner, table: u16, mut keys: Vec<u64>) -> Vec<u64> {
        if !self.set.sync_in_flight() {
            return keys;
        }
        let put_off = self.marks.carried(table, &keys);
        if !put_off.is_empty() {
            keys.retain(|k| !put_off.contains(k));
            node.core.intent_counters().note_moves_put_off(put_off.len() as u64);
            self.put_off_moves.push((table, put_off));
        }
        keys
    }

    /// Grants again the moves put off for a sync round, once no sync round is in flight, so
    /// that the service's next act moves them before another round can take their deltas.
    /// Returns whether it did.
    pub fn repost_put_off_moves(&mut self, node: &NodeInner) -> bool {
        if self.put_off_moves.is_empty() || self.set.sync_in_flight() {
            return false;
        }
        for (table, keys) in self.put_off_moves.drain(..) {
            node.core.post_intent_go(table, crate::protocol::Grant::Move, keys);
        }
        true
    }

    /// Drops again the replicas whose drops were put off ([`ReplicaSet::retry_put_off_drops`]).
    pub fn retry_put_off_drops(&mut self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        self.set.retry_put_off_drops(&context(node, &alive, &self.marks));
        self.execute(node, worker)
    }

    /// Starts a sync round unless one is in flight or a replica drains; [`ReplicaDriver::poll`]
    /// completes it.
    pub fn start_sync(&mut self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        let ctx = context(node, &alive, &self.marks);
        self.set.start_sync(&ctx);
        self.set.forget_found_lost(&ctx);
        self.execute(node, worker)
    }

    /// A sync round now, through `worker`, waiting for it (around a barrier; nothing may be in
    /// flight, and no key with a replica here may be on its way here: see
    /// [`ReplicaSet::replicas_arriving`]). Keys it finds lost are dropped by the service's next
    /// poll.
    pub fn sync_now(&mut self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        self.set.sync_now(&context(node, &alive, &self.marks));
        let mut outcome = self.execute(node, worker);
        while self.set.sync_in_flight() {
            keep_first_error(&mut outcome, self.complete_round(node, worker, true));
            keep_first_error(&mut outcome, self.execute(node, worker));
        }
        outcome
    }

    /// Drops every replica and waits until their deltas reached the owners (the service stops).
    pub fn drop_all(&mut self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        self.set.begin_stop(&context(node, &alive, &self.marks));
        let mut outcome = self.poll(node, worker, true);
        self.set.drop_all(&context(node, &alive, &self.marks));
        keep_first_error(&mut outcome, self.execute(node, worker));
        keep_first_error(&mut outcome, self.poll(node, worker, true));
        outcome
    }

    /// Completes what finished (everything, waiting, with `wait`): hands the replica set the
    /// answers of its pulls, pushes, REPLICA_SYNCs and reads, drops the keys found lost, and
    /// issues what that asks for.
    pub fn poll(&mut self, node: &NodeInner, worker: &mut Worker, wait: bool) -> Result<()> {
        self.adopt_kept(node);
        let mut outcome = Ok(());
        loop {
            keep_first_error(&mut outcome, self.complete_ops(node, worker, wait));
            keep_first_error(&mut outcome, self.complete_round(node, worker, wait));
            let alive = |n: u16| node.fabric.is_alive(n as usize);
            self.set.forget_found_lost(&context(node, &alive, &self.marks));
            keep_first_error(&mut outcome, self.execute(node, worker));
            if !wait || self.nothing_in_flight() {
                return outcome;
            }
        }
    }

    fn nothing_in_flight(&self) -> bool {
        self.makes.is_empty() && self.pushes.is_empty() && self.routed.is_empty() && self.reads.is_empty() && self.set.awaiting_acks().is_empty()
    }

    /// Hands the replica set the outcomes of the makes' pulls and the drains' pushes that
    /// completed (all of them, waiting, with `wait`).
    fn complete_ops(&mut self, node: &NodeInner, worker: &mut Worker, wait: bool) -> Result<()> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        let ctx = context(node, &alive, &self.marks);
        let mut outcome = Ok(());
        let mut i = 0;
        while i < self.makes.len() {
            if !wait && !worker.is_pull_done(&self.makes[i].1) {
                i += 1;
                continue;
            }
            let (op, ticket) = self.makes.swap_remove(i);
            keep_first_error(&mut outcome, self.set.handle_pulled(&ctx, op, worker.wait_pull(ticket)));
        }
        let mut j = 0;
        while j < self.pushes.len() {
            if !wait && !worker.is_done(&self.pushes[j].1) {
                j += 1;
                continue;
            }
            let (op, ticket) = self.pushes.swap_remove(j);
            keep_first_error(&mut outcome, self.set.handle_pushed(&ctx, op, worker.wait(ticket)));
        }
        outcome
    }

    /// Hands the replica set what arrived of its sync round (everything, waiting until the
    /// round's deadline, with `wait`): acknowledgements, finished image reads, routed
    /// push-pulls' answers; gives up a message whose owner is gone or silent past the deadline.
    fn complete_round(&mut self, node: &NodeInner, worker: &mut Worker, wait: bool) -> Result<()> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        let ctx = context(node, &alive, &self.marks);
        let mut outcome = Ok(());
        let acks = node.core.replica_sync_acks();
        for (owner, id) in self.set.awaiting_acks() {
            let reachable = || node.fabric.is_alive(owner as usize) && !node.core.directory().is_lost(owner);
            let ack = if wait { acks.wait(owner, id, self.deadline, reachable) } else { acks.take(owner, id) };
            if let Some(ack) = ack {
                keep_first_error(&mut outcome, self.set.handle_sync_ack(&ctx, owner, id, ack));
                continue;
            }
            if !wait && reachable() && Instant::now() < self.deadline {
                continue;
            }
            // Like a push to a node that is gone or silent: its deltas may be lost.
            acks.abandon(owner, id);
            let error = if reachable() {
                Error::Timeout {
                    what: "run-time replica deltas to be acknowledged",
                    millis: node.config.op_timeout.as_millis() as u64,
                    nodes: vec![owner as usize],
                }
            } else {
                node.core.directory().lost_error(owner)
            };
            keep_first_error(&mut outcome, self.set.handle_sync_unanswered(&ctx, owner, id, error));
        }
        let mut k = 0;
        while k < self.reads.len() {
            if !wait && !node.fabric.read_done(&self.reads[k].1) && Instant::now() < self.deadline {
                k += 1;
                continue;
            }
            let (op, read) = self.reads.swap_remove(k);
            let mut copy = vec![0u8; read.len()];
            // On failure the deltas were applied all the same; the replicas keep their values
            // until next time.
            let done = node.fabric.finish_read(read, &mut copy, self.deadline.saturating_duration_since(Instant::now())).map(|()| copy);
            keep_first_error(&mut outcome, self.set.handle_read(&ctx, op, done));
        }
        let mut j = 0;
        while j < self.routed.len() {
            if !wait && !worker.is_pull_done(&self.routed[j].1) {
                j += 1;
                continue;
            }
            let (op, ticket) = self.routed.swap_remove(j);
            keep_first_error(&mut outcome, self.set.handle_pulled(&ctx, op, worker.wait_pull(ticket)));
        }
        outcome
    }

    /// Issues what the replica set asks for, through `worker` and the node's fabric; what
    /// cannot even be issued is handed back as failed at once.
    fn execute(&mut self, node: &NodeInner, worker: &mut Worker) -> Result<()> {
        let alive = |n: u16| node.fabric.is_alive(n as usize);
        let ctx = context(node, &alive, &self.marks);
        let mut outcome = Ok(());
        while let Some(action) = self.set.poll_action() {
            let result = match action {
                ReplicaAction::MakePull { op, table, keys } => match worker.pull_to_make_replicas(node.table_by_id(table), &keys) {
                    Ok(ticket) => {
                        self.makes.push((op, ticket));
                        Ok(())
                    }
                    Err(e) => self.set.handle_pulled(&ctx, op, Err(e)),
                },
                ReplicaAction::DrainPush { op, table, keys, deltas } => match worker.push_async(node.table_by_id(table), &keys, &deltas) {
                    Ok(ticket) => {
                        self.pushes.push((op, ticket));
                        Ok(())
                    }
                    Err(e) => self.set.handle_drain_unsent(&ctx, op, &keys, &deltas, e),
                },
                ReplicaAction::RoutedSync { op, table, keys, deltas } => match worker.push_pull_async(node.table_by_id(table), &keys, &deltas) {
                    Ok(ticket) => {
                        self.routed.push((op, ticket));
                        Ok(())
                    }
                    Err(e) => self.set.handle_pulled(&ctx, op, Err(e)),
                },
                ReplicaAction::SendSyncs { op } => {
                    self.deadline = Instant::now() + node.config.op_timeout;
                    let syncs = self.set.syncs_to_send(op);
                    // Queuing cannot fail; were it to, whether a message left would be unknown,
                    // so the deltas are never sent a second way: an unanswered message times out.
                    node.run_pooled(|step, _, _| Ok(step.send_replica_syncs(&syncs)))
                }
                ReplicaAction::ReadImages { op, owner, remote, bytes } => match node.fabric.post_read(owner as usize, remote, bytes) {
                    Ok(read) => {
                        self.reads.push((op, read));
                        Ok(())
                    }
                    // The deltas were applied; the replicas keep their values until next time.
                    Err(e) => self.set.handle_read(&ctx, op, Err(e)),
                },
            };
            keep_first_error(&mut outcome, result);
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::store::Residence;
    use crate::{Config, Node, Table, TableSpec};

    /// Two in-process nodes, node 1's shared state, a trainer and a service worker on node 1
    /// (the service's bypasses replicas), table `t`'s id, and a key held at node 0.
    fn two_nodes() -> (Vec<Node>, std::sync::Arc<NodeInner>, Worker, Worker, u16, u64) {
        let mut config = Config::new(vec![TableSpec::new("t", 16, 2)]);
        config.latches = 16;
        let nodes = Node::start_local_cluster(2, config).unwrap();
        let node = nodes[1].inner().clone();
        let (trainer, mut service) = (nodes[1].worker(), nodes[1].worker());
        service.bypass_replicas(true);
        let table = trainer.table("t").unwrap().id;
        let key = (0..16).find(|&k| node.core.store().table(table).residence(k) == Residence::Away).unwrap();
        (nodes, node, trainer, service, table, key)
    }

    /// Polls `set` until nothing drains or syncs (at most 10 s).
    fn settle(set: &mut ReplicaDriver, node: &NodeInner, service: &mut Worker) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !set.quiet() {
            assert!(Instant::now() < deadline, "the replicas never drained");
            set.poll(node, service, false).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The key's value as its owner, node 0, reads it.
    fn owner_value(nodes: &[Node], handle: Table, key: u64) -> [f32; 2] {
        let mut out = [0.0; 2];
        nodes[0].worker().pull(handle, &[key], &mut out).unwrap();
        out
    }

    fn shut_down(nodes: Vec<Node>, workers: [Worker; 2]) {
        drop(workers);
        crate::node::finalize_all(nodes);
    }

    #[test]
    fn a_dropped_replica_serves_until_the_owner_has_its_delta() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        set.make_now(&node, &mut service, table, &[key]);
        assert!(t.has_dynamic_replica(key), "the replica was not made");
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();

        // Dropped, the replica drains: it still serves this node's workers, their pushes
        // included, until the owner has acknowledged the push carrying its delta.
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        assert!(t.has_dynamic_replica(key) && !set.quiet(), "the replica went before its delta reached the owner");
        let before = node.core.stats();
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0]);
        assert_eq!(node.core.stats().since(&before).remote_accesses, 0, "a draining replica serves");
        // A push while it drains leaves with a second drain; then the replica goes.
        trainer.push(handle, &[key], &[10.0, 20.0]).unwrap();
        settle(&mut set, &node, &mut service);
        assert!(!t.has_dynamic_replica(key), "the drained replica stayed");
        let intent = node.core.stats().intent;
        assert_eq!((intent.drained, intent.drained_again), (1, 1), "{intent:?}");
        let before = node.core.stats();
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(node.core.stats().since(&before).remote_accesses, 1);
        assert_eq!(out, [11.0, 22.0], "a push was lost or counted twice");
        assert_eq!(owner_value(&nodes, handle, key), [11.0, 22.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_drained_delta_holds_a_localize_off_until_the_owner_has_it() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        let d = set.marks.clone();
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();

        // A `localize` is about to move the key here: the drop leaves the delta for its
        // landing (a push issued after the localize's request would reach the key after it
        // landed, and this node would read the key without its own pushes meanwhile).
        assert!(d.begin_localize(table, &[key]).is_empty());
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        assert!(set.machine().put_off(table, key) && set.quiet(), "the delta was taken under a localize");
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0]);
        d.end_localize(table, &[key]);

        // Given up, the localize lets the drop go on: the delta's push marks the key until the
        // owner has it, and a `localize` learns that it must wait.
        set.retry_put_off_drops(&node, &mut service).unwrap();
        assert!(!set.machine().put_off(table, key) && !set.quiet());
        assert_eq!(d.carried(table, &[key]), vec![key], "the drain's push does not mark its key");
        assert_eq!(d.begin_localize(table, &[key]), vec![key]);
        d.end_localize(table, &[key]);
        // The mark ends when the service sees the push acknowledged.
        settle(&mut set, &node, &mut service);
        assert!(d.carried(table, &[key]).is_empty() && !t.has_dynamic_replica(key));
        assert!(d.wait_synced(table, &[key], Instant::now()));
        assert_eq!(owner_value(&nodes, handle, key), [1.0, 2.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_stopping_service_pushes_the_delta_of_a_drop_it_put_off() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        let d = set.marks.clone();
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();
        // A `localize` about to move the key here puts the drop off; the service stops before
        // the localize goes on (or is given up). The stop must not leave the replica, and its
        // delta, behind: the simulator found a stop that did.
        assert!(d.begin_localize(table, &[key]).is_empty());
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        assert!(set.machine().put_off(table, key));
        set.drop_all(&node, &mut service).unwrap();
        d.end_localize(table, &[key]);
        assert!(!t.has_dynamic_replica(key), "a stopped service left a replica whose drop was put off");
        assert_eq!(owner_value(&nodes, handle, key), [1.0, 2.0], "the put-off replica's delta was lost");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_sync_round_is_queued_behind_the_steps_routing_its_keys() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();

        // A step that routed an access to the key holds its shard until it has queued its
        // frames (its thread may wait for a CPU meanwhile). A REPLICA_SYNC queued before them
        // would reach the owner first, whose image would then lack a push the replica's
        // making counted as sent behind its pull: the round's message waits for the step.
        let mut tx = node.core.transmit();
        let mut routing = node.core.step(&mut tx, node.now());
        assert!(routing.try_acquire_keys([(table, key)]));
        let (sent_tx, sent_rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let (node, set, service) = (&*node, &mut set, &mut service);
            scope.spawn(move || {
                let outcome = set.start_sync(node, service);
                let _ = sent_tx.send(outcome);
            });
            assert!(
                matches!(sent_rx.recv_timeout(Duration::from_millis(300)), Err(std::sync::mpsc::RecvTimeoutError::Timeout)),
                "a REPLICA_SYNC was queued while a step holding its key's shard had not queued its frames"
            );
            drop(routing);
            sent_rx.recv_timeout(Duration::from_secs(10)).expect("the round never started").unwrap();
        });
        settle(&mut set, &node, &mut service);
        assert_eq!(owner_value(&nodes, handle, key), [1.0, 2.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_grant_keeps_a_draining_replica() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 1.0]).unwrap();
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        // Granted again while it drains: the replica stays, is synced like any other, and is
        // not pulled anew.
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        assert!(set.machine().makes_in_flight() == 0, "a replica that is still here was made again");
        settle(&mut set, &node, &mut service);
        assert!(t.has_dynamic_replica(key), "the drain removed a replica granted again");
        trainer.push(handle, &[key], &[2.0, 2.0]).unwrap();
        set.start_sync(&node, &mut service).unwrap();
        settle(&mut set, &node, &mut service);
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        settle(&mut set, &node, &mut service);
        assert_eq!(owner_value(&nodes, handle, key), [3.0, 3.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_drain_whose_owner_is_lost_ends() {
        let (mut nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 1.0]).unwrap();
        nodes.remove(0).abort();
        // This node learns of the loss (an access to the key fails) before the drop.
        let (mut out, known) = ([0.0; 2], Instant::now() + Duration::from_secs(10));
        while service.pull(handle, &[key], &mut out).is_ok() {
            assert!(Instant::now() < known, "the owner's loss went unnoticed");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The push to the lost owner fails: the replica goes with its delta instead of
        // draining (and holding back every sync round) for ever.
        let outcome = set.drop_keys(&node, &mut service, table, &[key]);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut errors = usize::from(outcome.is_err());
        while !set.quiet() {
            assert!(Instant::now() < deadline, "a drain to a lost owner never ended");
            errors += usize::from(set.poll(&node, &mut service, false).is_err());
            std::thread::sleep(Duration::from_micros(200));
        }
        assert!(!t.has_dynamic_replica(key) && errors >= 1, "errors {errors}");
        drop((trainer, service));
        for n in nodes {
            n.abort();
        }
    }

    #[test]
    fn a_replica_made_while_this_node_pushes_has_those_pushes() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        trainer.push(handle, &[key], &[100.0, 200.0]).unwrap();
        assert!(set.start_make(&node, &mut service, table, &[key]).unwrap());
        // The pull that makes the replica is on its way: this push reaches the owner after the
        // owner answered it (one ordered connection), so the value pulled lacks it.
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();
        set.poll(&node, &mut service, true).unwrap();
        assert!(t.has_dynamic_replica(key), "the replica was not made");
        let before = node.core.stats();
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(node.core.stats().since(&before).remote_accesses, 0, "the replica does not serve");
        assert_eq!(out, [101.0, 202.0], "the new replica lacks this node's own earlier push");
        assert_eq!(node.core.stats().intent.made_with_pushes, 1);
        // The owner has each push once, and the replica, synced, agrees with it.
        trainer.push(handle, &[key], &[10.0, 20.0]).unwrap();
        set.start_sync(&node, &mut service).unwrap();
        settle(&mut set, &node, &mut service);
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [111.0, 222.0]);
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        settle(&mut set, &node, &mut service);
        assert_eq!(owner_value(&nodes, handle, key), [111.0, 222.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_key_granted_again_while_its_pull_is_on_its_way_is_made_from_that_pull() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        trainer.push(handle, &[key], &[1.0, 1.0]).unwrap();
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        trainer.push(handle, &[key], &[2.0, 2.0]).unwrap();
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        assert_eq!(set.machine().makes_in_flight(), 1, "a second pull for a key whose first is on its way");
        trainer.push(handle, &[key], &[4.0, 4.0]).unwrap();
        set.poll(&node, &mut service, true).unwrap();
        assert!(t.has_dynamic_replica(key), "the replica was not made");
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [7.0, 7.0], "the replica lacks pushes sent behind its pull");
        set.drop_keys(&node, &mut service, table, &[key]).unwrap();
        settle(&mut set, &node, &mut service);
        assert_eq!(owner_value(&nodes, handle, key), [7.0, 7.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_key_landing_where_it_has_a_replica_keeps_this_nodes_pushes() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        set.make_now(&node, &mut service, table, &[key]);
        // The push stays in the replica's delta (no sync round runs); then the key moves here.
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();
        trainer.localize(handle, &[key]).unwrap();
        assert!(t.slot_of(key).is_some() && !t.has_dynamic_replica(key), "the key did not land, or its replica stayed");
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0], "the landed key lacks the push its replica took");
        // The sync rounds after it find the key here and add nothing twice.
        set.start_sync(&node, &mut service).unwrap();
        settle(&mut set, &node, &mut service);
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0], "a push was counted twice");
        assert_eq!(owner_value(&nodes, handle, key), [1.0, 2.0]);
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_localize_waits_until_no_sync_round_carries_the_keys_delta() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        set.make_now(&node, &mut service, table, &[key]);
        trainer.push(handle, &[key], &[1.0, 2.0]).unwrap();
        // The round takes the delta and sends it straight to the owner; a localize now would
        // race it (the key could leave the owner before the delta gets there).
        set.start_sync(&node, &mut service).unwrap();
        assert!(set.sync_in_flight());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let mover = std::thread::spawn(move || {
            trainer.localize(handle, &[key]).unwrap();
            let mut out = [0.0; 2];
            trainer.pull(handle, &[key], &mut out).unwrap();
            done_tx.send(out).unwrap();
            trainer
        });
        assert!(done_rx.recv_timeout(Duration::from_millis(200)).is_err(), "the localize did not wait for the sync round");
        assert!(t.slot_of(key).is_none() && t.residence(key) == Residence::Away);
        settle(&mut set, &node, &mut service);
        let out = done_rx.recv_timeout(Duration::from_secs(10)).expect("the localize never went on");
        assert_eq!(out, [1.0, 2.0], "the landed key lacks the push its replica's delta carried");
        let trainer = mover.join().unwrap();
        assert_eq!(owner_value(&nodes, handle, key), [1.0, 2.0], "a push was lost or counted twice");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_sync_round_does_not_refresh_a_replica_made_after_the_key_was_here() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        set.make_now(&node, &mut service, table, &[key]);
        // A round for the clean replica is in flight (its image will be the owner's [0, 0]).
        set.start_sync(&node, &mut service).unwrap();
        assert!(set.sync_in_flight());
        // Meanwhile the key lands here, takes a push, leaves, and a new replica is made from
        // the owner's value, which has that push.
        trainer.localize(handle, &[key]).unwrap();
        trainer.push(handle, &[key], &[5.0, 5.0]).unwrap();
        nodes[0].worker().localize(handle, &[key]).unwrap();
        assert!(t.residence(key) == Residence::Away);
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !t.has_dynamic_replica(key) {
            assert!(Instant::now() < deadline, "the new replica was not made");
            set.poll(&node, &mut service, false).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        // The old round's image predates the push: the new replica keeps its value.
        settle(&mut set, &node, &mut service);
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [5.0, 5.0], "an old round's image overwrote a newer replica");
        shut_down(nodes, [trainer, service]);
    }

    #[test]
    fn a_value_pulled_before_the_key_was_here_makes_no_replica() {
        let (nodes, node, mut trainer, mut service, table, key) = two_nodes();
        let t = node.core.store().table(table);
        let handle = node.table_by_id(table);
        let mut set = ReplicaDriver::new(service.intent_service.marks_handle());
        // The pull that makes the replica is answered with the owner's [0, 0]; before it is
        // installed, the key lands here, takes a push and leaves.
        set.start_make(&node, &mut service, table, &[key]).unwrap();
        trainer.localize(handle, &[key]).unwrap();
        trainer.push(handle, &[key], &[5.0, 5.0]).unwrap();
        nodes[0].worker().localize(handle, &[key]).unwrap();
        set.poll(&node, &mut service, true).unwrap();
        let mut out = [0.0; 2];
        trainer.pull(handle, &[key], &mut out).unwrap();
        assert_eq!(out, [5.0, 5.0], "a replica was made from a value older than this node's push");
        assert!(!t.has_dynamic_replica(key));
        shut_down(nodes, [trainer, service]);
    }
}
