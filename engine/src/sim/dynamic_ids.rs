//! A dynamic table in the simulator ([`SimOptions::dynamic_ids`]): workers ask for the slot
//! keys of raw ids as the runtime's workers do (`worker::dynamic`): ids homed at their node from
//! its own index, the others in one ASSIGN per home, all sent before any answer comes, the
//! answers taken from the node's mailbox. Ids come from a small pool, so that several nodes
//! first touch one id at once in most runs. Checked: every asker of an id got the same slot
//! key, of its home's range, and each id was created once in the cluster.

use std::collections::BTreeMap;

use super::{Sim, SimOptions};
use crate::dynamic::Intent;
use crate::protocol::assign;

/// The dynamic table's index in the simulated configuration.
pub(super) const TABLE: u16 = 1;

/// The spec of the simulated dynamic table: room for every id of the pool at any one home.
pub(super) fn spec(opts: &SimOptions) -> crate::config::TableSpec {
    let mut spec = crate::config::TableSpec::dynamic("sim-ids", 2, opts.dynamic_ids.max(1));
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
        let mut per_home: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
        let mut answered = Vec::new();
        {
            let core = &self.nodes[node].core;
            let dir = core.directory();
            let index = core.id_index(TABLE).ok_or("the simulated dynamic table has no index")?;
            for &id in &ids {
                let group = per_home.entry(dir.id_home(index.spec(), id)).or_default();
                if !group.contains(&id) {
                    group.push(id);
                }
            }
            // Those homed here: from the node's own index, as the worker's thread does.
            if let Some(group) = per_home.remove(&(node as u16)) {
                let mut keys = Vec::new();
                core.assign_ids(TABLE, &group, Intent::Write, &mut keys).map_err(|e| format!("node {node} creating {group:?}: {e}"))?;
                answered.extend(group.into_iter().zip(keys.into_iter().map(assign::wire_value)));
            }
        }
        let mut asked = Vec::new();
        for (home, group) in per_home {
            let request = self.nodes[node].core.next_assign_request();
            self.log(format!("worker {w}@{node} asks node {home} for ids {group:?} (request {request})"));
            self.worker_event(w, |step, _| {
                step.send_assign(home, TABLE, request, Intent::Write, &group);
                Ok(())
            })?;
            asked.push((home, request, group, None));
        }
        self.record_slot_keys(node, &answered)?;
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
        }
        Ok(())
    }

    /// Records that `node` learnt these slot keys, checking each against what every other node
    /// learnt and against its id's home's range.
    fn record_slot_keys(&mut self, node: usize, pairs: &[(u64, u64)]) -> Result<(), String> {
        let capacity = self.opts.dynamic_ids.max(1);
        for &(id, key) in pairs {
            if matches!(key, assign::FULL | assign::NOT_HOME | assign::NOT_ADMITTED) {
                return Err(format!("node {node} was refused id {id} (answer {key:#x})"));
            }
            let home = self.nodes[node].core.id_index(TABLE).map_or(0, |i| i.spec().home_of(id, self.opts.nodes)) as u64;
            if key / capacity != home {
                return Err(format!("id {id} got slot key {key}, outside its home {home}'s range"));
            }
            match self.dynamic_slots.insert(id, key) {
                Some(earlier) if earlier != key => return Err(format!("id {id} got slot key {key} at node {node} and {earlier} before: created twice")),
                _ => {}
            }
        }
        Ok(())
    }

    /// At the end: each id any worker learnt was created once in the cluster.
    pub(super) fn check_dynamic_ids(&self) -> Result<(), String> {
        let created: u64 = self.nodes.iter().filter_map(|n| n.core.id_index(TABLE)).map(|i| i.created()).sum();
        if created != self.dynamic_slots.len() as u64 {
            return Err(format!("{created} ids were created for {} distinct ids the workers learnt", self.dynamic_slots.len()));
        }
        Ok(())
    }
}
