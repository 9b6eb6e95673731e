//! A dynamic table in the simulator ([`SimOptions::dynamic_ids`]): workers ask for the slot
//! keys of raw ids as the runtime's workers do (`worker::dynamic`): ids homed at their node from
//! its own index, the others in one ASSIGN per home, all sent before any answer comes, the
//! answers taken from the node's mailbox. Ids come from a small pool, so that several nodes
//! first touch one id at once in most runs. Checked: every asker of an id got the same slot
//! key, of its home's range, and each id was created once in the cluster.
//!
//! With [`SimOptions::evict_ids`] the table evicts, and nodes begin eviction rounds now and
//! then through the shipped steps (`protocol::evict`), their EVICT and EVICTED delivered in any
//! order like every frame, each node answering once its workers' pins let it. A worker then
//! looks ids up in its node's index first (counting their uses), pins itself before, learns its
//! homes' answers, and uses the slot keys at a later step of its own before it unpins. Checked
//! instead of "created once" (an evicted id is created again): whenever a worker uses a slot
//! key, and after every step for every id any node's index maps, the id's home still gives
//! that slot key to that id.
//!
//! With [`SimOptions::intend_ids`] workers also signal intent on slot keys of the table (as
//! the intent service does on the slot keys of the ids it was told of), through the shipped
//! `Step::signal_intent`, and the homes' grants become granted localizes of the slot keys and
//! run-time replicas installed through the store's own `install_made_replica` (their values are
//! not pulled: no value of the dynamic table is checked), each dropped when its node's intent
//! ends. Checked after every step: a slot key that a node holds away from its home, or has a
//! replica of, is an id's at the home.

use std::collections::BTreeMap;

use rand::Rng;

use super::{ScriptOp, Sim, SimOptions};
use crate::dynamic::Intent;
use crate::intent::IntentLevel;
use crate::protocol::{Grant, assign};

/// The dynamic table's index in the simulated configuration.
pub(super) const TABLE: u16 = 1;

/// The spec of the simulated dynamic table: room for every id of the pool at any one home.
pub(super) fn spec(opts: &SimOptions) -> crate::config::TableSpec {
    let mut spec = crate::config::TableSpec::dynamic("sim-ids", 2, opts.dynamic_ids.max(1));
    if opts.evict_ids {
        spec = spec.evicting(crate::dynamic::Eviction::Lfu);
    }
    spec.keys = opts.dynamic_ids.max(1) * opts.nodes as u64;
    spec
}

/// The raw id of entry `i` of the pool: spread over the whole `u64` range.
pub(super) fn id(i: u64) -> u64 {
    crate::hashing::mix(i) ^ (i << 60)
}

/// One home asked: its rank, the request's number, the ids, and the slot keys once they came.
type Asked = (u16, u32, Vec<u64>, Option<Vec<u64>>);

/// A worker's ids waiting for their homes' answers.
pub(super) struct AssignWait {
    asked: Vec<Asked>,
}

impl AssignWait {
    /// Whether every home answered.
    pub(super) fn answered(&self) -> bool {
        self.asked.iter().all(|a| a.3.is_some())
    }
}

impl Sim {
    /// Worker `w` needs the slot keys of `ids`: those homed at its node come from the node's
    /// index, the others are asked of their homes.
    pub(super) fn assign_ids(&mut self, w: usize, ids: Vec<u64>) -> Result<(), String> {
        let node = self.workers[w].node;
        let mut per_home: Vec<Vec<u64>>;
        let mut answered = Vec::new();
        let mut known = Vec::new();
        {
            let core = &self.nodes[node].core;
            let dir = core.directory();
            let index = core.id_index(TABLE).ok_or("the simulated dynamic table has no index")?;
            let mut ids = ids;
            if let Some(pin) = &self.workers[w].pin {
                // As the runtime's worker: pinned, then the ids this node knows from its index.
                core.pins().pin(pin);
                ids.retain(|&id| match index.lookup(id) {
                    Some(key) => {
                        known.push((id, key));
                        false
                    }
                    None => true,
                });
            }
            let mut seen = crate::util::FastSet::default();
            per_home = dir.ids_by_home(index.spec(), ids, |id| seen.insert(id));
            // Those homed here: from the node's own index, as the worker's thread does.
            let group = std::mem::take(&mut per_home[node]);
            if !group.is_empty() {
                let mut keys = Vec::new();
                core.assign_ids(TABLE, &group, Intent::Write, &mut keys).map_err(|e| format!("node {node} creating {group:?}: {e}"))?;
                answered.extend(group.into_iter().zip(keys.into_iter().map(assign::wire_value)));
            }
        }
        let mut asked = Vec::new();
        for (home, group) in per_home.into_iter().enumerate().filter(|(_, group)| !group.is_empty()) {
            let home = home as u16;
            let request = self.nodes[node].core.next_assign_request();
            self.log(format!("worker {w}@{node} asks node {home} for ids {group:?} (request {request})"));
            self.worker_event(w, |step, _| {
                step.send_assign(home, TABLE, request, Intent::Write, &group);
                Ok(())
            })?;
            asked.push((home, request, group, None));
        }
        self.record_slot_keys(node, &answered)?;
        if self.opts.evict_ids {
            known.extend(answered.iter().filter(|&&(_, key)| key != assign::NOT_ADMITTED));
            self.workers[w].holding = Some(known);
        }
        if !asked.is_empty() {
            self.workers[w].assigning = Some(AssignWait { asked });
        }
        Ok(())
    }

    /// Hands each waiting worker the answers its node has for it.
    pub(super) fn take_assignments(&mut self) {
        for worker in &mut self.workers {
            let Some(wait) = worker.assigning.as_mut() else { continue };
            let core = &self.nodes[worker.node].core;
            for (home, request, _, answer) in wait.asked.iter_mut().filter(|a| a.3.is_none()) {
                *answer = core.assignments().take(*home, *request);
            }
        }
    }

    /// Worker `w`'s homes all answered: checks and records what they said.
    pub(super) fn finish_assign(&mut self, w: usize) -> Result<(), String> {
        let Some(wait) = self.workers[w].assigning.take() else { return Ok(()) };
        let node = self.workers[w].node;
        for (home, request, ids, answer) in wait.asked {
            let keys = answer.unwrap_or_default();
            if keys.len() != ids.len() {
                return Err(format!("node {home} answered request {request} of {} ids with {} slot keys", ids.len(), keys.len()));
            }
            self.log(format!("worker {w}@{node} learns {ids:?} -> {keys:?} from node {home}"));
            let pairs: Vec<(u64, u64)> = ids.into_iter().zip(keys).collect();
            self.record_slot_keys(node, &pairs)?;
            if self.opts.evict_ids {
                // As the runtime's worker: what the homes said goes into the node's index.
                let learnt: Vec<(u64, u64)> = pairs.into_iter().filter(|&(_, key)| key != assign::NOT_ADMITTED).collect();
                if let Some(index) = self.nodes[node].core.id_index(TABLE) {
                    index.learn_many(&learnt, Intent::Write);
                }
                self.workers[w].holding.get_or_insert_with(Vec::new).extend(learnt);
            }
        }
        Ok(())
    }

    /// Worker `w` uses the slot keys it got: each must still be its id's at the id's home (no
    /// round freed it meanwhile); then the worker unpins.
    pub(super) fn use_slot_keys(&mut self, w: usize) -> Result<(), String> {
        let holding = self.workers[w].holding.take().unwrap_or_default();
        let node = self.workers[w].node;
        self.log(format!("worker {w}@{node} uses slot keys {holding:?}"));
        for &(id, key) in &holding {
            self.check_slot_is_ids(id, key).map_err(|e| format!("worker {w}@{node} used slot key {key} for id {id}: {e}"))?;
        }
        if let Some(pin) = &self.workers[w].pin {
            crate::dynamic::Pins::unpin(pin);
        }
        Ok(())
    }

    /// Whether the home of slot key `key` still gives it to `id`.
    fn check_slot_is_ids(&self, id: u64, key: u64) -> Result<(), String> {
        let home = (key / self.opts.dynamic_ids.max(1)) as usize;
        let core = &self.nodes[home].core;
        if self.nodes[home].crashed {
            return Ok(());
        }
        match core.id_index(TABLE).and_then(|i| i.id_of_slot(key)) {
            Some(holder) if holder == id => Ok(()),
            Some(holder) => Err(format!("its home {home} gave it to id {holder}")),
            None => Err(format!("its home {home} freed it")),
        }
    }

    /// After every step: each id any live node's index maps is still its slot key's at home,
    /// and no two nodes map an id to different slot keys (it was not created twice).
    pub(super) fn check_id_mappings(&self) -> Result<(), String> {
        let mut mapped: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
        for (n, node) in self.nodes.iter().enumerate().filter(|(_, n)| !n.crashed) {
            let Some(index) = node.core.id_index(TABLE) else { continue };
            for (id, key) in index.pairs() {
                self.check_slot_is_ids(id, key).map_err(|e| format!("node {n} maps id {id} to slot key {key}, but {e}"))?;
                if let Some((other, m)) = mapped.insert(id, (key, n))
                    && other != key
                {
                    return Err(format!("node {n} maps id {id} to slot key {key}, node {m} to {other}: created twice"));
                }
            }
        }
        Ok(())
    }

    /// Worker `w`'s node needs slot keys `keys` at `level` (as its intent service would tell
    /// their homes). A need that ended drops the node's replicas of them first, as the service
    /// does, or, one time in two, at a later step of the worker, as the service's replicas
    /// whose drop it put off (their keys were arriving) or whose deltas drain end after it told
    /// the homes.
    pub(super) fn intend_slot_keys(&mut self, w: usize, keys: Vec<u64>, level: IntentLevel) -> Result<(), String> {
        let node = self.workers[w].node;
        self.log(format!("worker {w}@{node} intent {level:?} on slot keys {keys:?}"));
        for &key in &keys {
            self.slot_intents[node].insert(key, level);
        }
        if level == IntentLevel::None {
            if self.rng.gen_bool(0.5) {
                self.drop_slot_replicas(w, &keys);
            } else {
                let script = &mut self.workers[w].script;
                let at = self.rng.gen_range(0..=script.len());
                script.insert(at, ScriptOp::DropSlotReplicas { keys: keys.clone() });
            }
        }
        self.worker_event(w, |step, _| {
            step.signal_intent(TABLE, &keys, level);
            Ok(())
        })?;
        Ok(())
    }

    /// Worker `w`'s node ends its replicas of those of `keys` it no longer intends.
    pub(super) fn drop_slot_replicas(&mut self, w: usize, keys: &[u64]) {
        let node = self.workers[w].node;
        let store = self.nodes[node].core.store().clone();
        let mut delta = vec![0.0f32; store.table(TABLE).value_len()];
        let ended: Vec<u64> = keys
            .iter()
            .copied()
            .filter(|k| self.slot_intents[node].get(k).is_none_or(|l| *l == IntentLevel::None))
            .filter(|&key| store.remove_replica(&store.lock(TABLE, key), &mut delta))
            .collect();
        if !ended.is_empty() {
            self.log(format!("node {node} ends its replicas of slot keys {ended:?}"));
        }
    }

    /// Node `node` was granted slot keys of the dynamic table: of those it still intends, a
    /// move becomes a granted localize at the front of worker `w`'s script, a replica is
    /// installed where the key is not (through the store's `install_made_replica`, with zeros:
    /// no value of the table is checked).
    pub(super) fn grant_slot_keys(&mut self, node: usize, w: usize, grant: Grant, keys: Vec<u64>) {
        let keys: Vec<u64> = keys.into_iter().filter(|k| self.slot_intents[node].get(k).is_some_and(|l| *l != IntentLevel::None)).collect();
        if keys.is_empty() {
            return;
        }
        self.log(format!("node {node} granted slot keys {keys:?} ({grant:?})"));
        self.intent_grants += keys.len();
        if grant == Grant::Move {
            self.workers[w].script.push_front(ScriptOp::LocalizeIds { keys });
            return;
        }
        let store = self.nodes[node].core.store();
        let t = store.table(TABLE);
        let Some(replicas) = t.dynamic() else { return };
        let zeros = vec![0.0f32; t.value_len()];
        for key in keys {
            if t.slot_of(key).is_none() && replicas.get(key).is_none() {
                let _ = store.install_made_replica(TABLE, key, replicas.incarnation(key), true, &zeros);
            }
        }
    }

    /// After every step with [`SimOptions::intend_ids`]: every slot key a live node holds away
    /// from its home, or has a replica of, is an id's at the home (offered in a round
    /// included).
    pub(super) fn check_slots_away(&self) -> Result<(), String> {
        let capacity = self.opts.dynamic_ids.max(1);
        for (n, node) in self.nodes.iter().enumerate().filter(|(_, n)| !n.crashed) {
            let t = node.core.store().table(TABLE);
            for key in 0..capacity * self.opts.nodes as u64 {
                let home = (key / capacity) as usize;
                let away = home != n && t.slot_of(key).is_some();
                let replica = t.dynamic().is_some_and(|d| d.get(key).is_some());
                if !(away || replica) || self.nodes[home].crashed {
                    continue;
                }
                if self.nodes[home].core.id_index(TABLE).and_then(|i| i.id_of_slot(key)).is_none() {
                    let what = if away { "holds" } else { "has a replica of" };
                    return Err(format!("node {n} {what} slot key {key}, which its home {home} freed"));
                }
            }
        }
        Ok(())
    }

    /// The live nodes with an eviction answer whose grace period ended.
    pub(super) fn graces_ended(&self) -> Vec<usize> {
        (0..self.opts.nodes)
            .filter(|&n| !self.nodes[n].crashed && self.opts.evict_ids)
            .filter(|&n| {
                let core = &self.nodes[n].core;
                core.evictions().lock().grace_ended(core.pins())
            })
            .collect()
    }

    /// A node at random begins an eviction round of the dynamic table, as its eviction thread
    /// does when it runs short or a time to live passed.
    pub(super) fn begin_eviction_round(&mut self) -> Result<(), String> {
        let node = self.rng.gen_range(0..self.opts.nodes);
        if self.nodes[node].crashed {
            return Ok(());
        }
        let short = self.rng.gen_bool(0.5);
        let mut began = false;
        self.node_event(node, |step, _, _| {
            began = step.begin_eviction_round(TABLE, short);
            Ok(crate::protocol::Progress::Done)
        })?;
        if began {
            self.log(format!("node {node} begins an eviction round"));
        }
        Ok(())
    }

    /// Records that `node` learnt these slot keys, checking each against what every other node
    /// learnt and against its id's home's range.
    fn record_slot_keys(&mut self, node: usize, pairs: &[(u64, u64)]) -> Result<(), String> {
        let capacity = self.opts.dynamic_ids.max(1);
        for &(id, key) in pairs {
            // (A home short of room that evicts may not admit a new id yet.)
            if key == assign::NOT_ADMITTED && self.opts.evict_ids {
                continue;
            }
            if matches!(key, assign::FULL | assign::NOT_HOME | assign::NOT_ADMITTED) {
                return Err(format!("node {node} was refused id {id} (answer {key:#x})"));
            }
            let home = self.nodes[node].core.id_index(TABLE).map_or(0, |i| i.spec().home_of(id, self.opts.nodes)) as u64;
            if key / capacity != home {
                return Err(format!("id {id} got slot key {key}, outside its home {home}'s range"));
            }
            match self.dynamic_slots.insert(id, key) {
                // (An evicted id is created again, in whichever slot: `check_id_mappings`.)
                Some(earlier) if earlier != key && !self.opts.evict_ids => {
                    return Err(format!("id {id} got slot key {key} at node {node} and {earlier} before: created twice"));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// At the end: each id any worker learnt was created once in the cluster.
    pub(super) fn check_dynamic_ids(&self) -> Result<(), String> {
        let created: u64 = self.nodes.iter().filter_map(|n| n.core.id_index(TABLE)).map(|i| i.created()).sum();
        if self.opts.evict_ids {
            return self.check_id_mappings();
        }
        if created != self.dynamic_slots.len() as u64 {
            return Err(format!("{created} ids were created for {} distinct ids the workers learnt", self.dynamic_slots.len()));
        }
        Ok(())
    }
}
