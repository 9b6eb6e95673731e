//! A worker's calls on a dynamic table ([`crate::dynamic`]): raw ids looked up in the node's
//! index, those it does not know asked of their homes (created there if new), then the same
//! call on the slot keys.

use std::time::Instant;

use super::Worker;
use crate::dynamic::{IdIndex, table_full};
use crate::error::{Error, Result};
use crate::protocol::{Progress, assign};
use crate::table::Table;
use crate::util::FastMap;

impl Worker {
    /// Runs `op` on the slot keys of `ids` through the table's slot-key handle. Known ids cost
    /// a lookup each; unknown ones one ASSIGN per home they belong to. The key buffer is the
    /// worker's, kept between calls.
    pub(super) fn through_index<R>(&mut self, table: Table, ids: &[u64], op: impl FnOnce(&mut Worker, Table, &[u64]) -> Result<R>) -> Result<R> {
        // One known id: its slot key on the stack, with no reference counted.
        if let [id] = ids
            && let Some(key) = self.node.core.id_index(table.id).and_then(|index| index.lookup(*id))
        {
            return op(self, table.slot_keys(), &[key]);
        }
        let node = self.node.clone();
        let Some(index) = node.core.id_index(table.id) else {
            return Err(Error::UnknownTable(format!("#{} (a dynamic handle of a table that is not dynamic)", table.id)));
        };
        let mut keys = std::mem::take(&mut self.hashed_keys);
        keys.clear();
        let mut missing = Vec::new();
        index.lookup_many(ids, &mut keys, &mut missing);
        let outcome = match self.assign_missing(table, index, ids, &missing) {
            Ok(learnt) => {
                for &i in &missing {
                    keys[i] = learnt.get(&ids[i]).copied().unwrap_or_default();
                }
                op(self, table.slot_keys(), &keys)
            }
            Err(e) => Err(e),
        };
        self.hashed_keys = keys;
        outcome
    }

    /// Learns the slot keys of the ids at `missing` (positions in `ids`) from their homes: this
    /// node's own index for those homed here, one ASSIGN per other home, all sent before the
    /// first answer is awaited. Returns them (also remembered in the index).
    fn assign_missing(&mut self, table: Table, index: &IdIndex, ids: &[u64], missing: &[usize]) -> Result<FastMap<u64, u64>> {
        let mut learnt = FastMap::default();
        if missing.is_empty() {
            return Ok(learnt);
        }
        let node = self.node.clone();
        let dir = node.core.directory();
        let mut per_home: Vec<Vec<u64>> = vec![Vec::new(); dir.nodes()];
        for &i in missing {
            per_home[dir.id_home(index.spec(), ids[i]) as usize].push(ids[i]);
        }
        // Each id once, in the order the ids came: a home creates them in that order, so the
        // ids of a batch that came first take consecutive slot keys.
        for group in &mut per_home {
            group.retain(|&id| learnt.insert(id, 0).is_none());
        }
        let name = || node.config.tables[table.id as usize].name.clone();
        let capacity = index.spec().capacity;
        let rank = dir.rank();
        let mut asked = Vec::new();
        for (home, group) in per_home.iter().enumerate() {
            if group.is_empty() || home == rank as usize {
                continue;
            }
            if dir.is_lost(home as u16) {
                return Err(dir.lost_error(home as u16));
            }
            let request = node.core.next_assign_request();
            node.run(&mut self.tx, |step, _, _| {
                step.send_assign(home as u16, table.id, request, group);
                Ok(Progress::Done)
            })?;
            asked.push((home as u16, request));
        }
        // Those homed here meanwhile: no message. (A failure here still takes the other homes'
        // answers: their ids are learnt, and the mailbox keeps nothing nobody waits for.)
        let mut outcome = Ok(());
        let own = &per_home[rank as usize];
        if !own.is_empty() {
            let mut keys = Vec::with_capacity(own.len());
            match node.core.assign_ids(table.id, own, &mut keys) {
                Ok(_) => {
                    for (&id, key) in own.iter().zip(&keys) {
                        match *key {
                            Some(key) => _ = learnt.insert(id, key),
                            None => outcome = outcome.and(Err(table_full(&name(), rank as usize, capacity))),
                        }
                    }
                }
                Err(e) => outcome = Err(e),
            }
        }
        let timeout = node.config.op_timeout;
        let deadline = Instant::now() + timeout;
        for (home, request) in asked {
            let alive = || node.fabric.is_alive(home as usize) && !dir.is_lost(home);
            let Some(keys) = node.core.assignments().wait(home, request, deadline, alive) else {
                if outcome.is_ok() {
                    outcome = Err(if dir.is_lost(home) {
                        dir.lost_error(home)
                    } else {
                        Error::Timeout { what: "the slot keys of new ids of a dynamic table", millis: timeout.as_millis() as u64, nodes: vec![home as usize] }
                    });
                }
                continue;
            };
            let group = &per_home[home as usize];
            if keys.len() != group.len() {
                outcome = outcome.and(Err(Error::Protocol(format!("node {home} answered {} ids with {} slot keys", group.len(), keys.len()))));
                continue;
            }
            let mut answered = Vec::with_capacity(keys.len());
            for (&id, &key) in group.iter().zip(&keys) {
                match key {
                    assign::FULL => outcome = outcome.and(Err(table_full(&name(), home as usize, capacity))),
                    assign::NOT_HOME => outcome = outcome.and(Err(Error::Protocol(format!("node {home} is not the home of id {id} of table '{}'", name())))),
                    key => {
                        answered.push((id, key));
                        learnt.insert(id, key);
                    }
                }
            }
            index.learn_many(&answered);
        }
        outcome.map(|()| learnt)
    }
}
