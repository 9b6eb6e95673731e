//! The eviction thread of a node with a dynamic table that evicts (`protocol::evict`): it
//! begins a round where this node is a home that runs short of slot keys or whose time to live
//! passed, answers rounds whose grace periods ended, and lets rounds go of lost nodes. The
//! decisions are the protocol's; this thread only looks at the clock and takes the steps.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::NodeInner;
use crate::protocol::Progress;

/// How often the thread looks: a home that fills defers new ids until a round frees room, so
/// the thread looks often (a look is a lock and a few loads per table).
const LOOK: Duration = Duration::from_millis(1);

impl NodeInner {
    /// Whether any table evicts ids (the node then runs [`NodeInner::run_eviction`]).
    pub fn evicts(&self) -> bool {
        self.config.tables.iter().any(|t| t.dynamic.is_some_and(|d| d.eviction.evicts()))
    }

    /// The eviction thread (see the module documentation).
    pub fn run_eviction(&self) {
        let tables: Vec<(u16, Option<Duration>)> = self
            .config
            .tables
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.dynamic.filter(|d| d.eviction.evicts()).map(|d| (i as u16, d.eviction.ttl_millis().map(Duration::from_millis))))
            .collect();
        let mut last_ttl_round: Vec<Instant> = vec![Instant::now(); tables.len()];
        while !self.stopping.load(Ordering::Acquire) {
            std::thread::sleep(LOOK);
            let _ = self.run_pooled(|step, _, _| {
                step.evictions_after_loss();
                for (i, &(table, ttl)) in tables.iter().enumerate() {
                    let ttl_due = ttl.is_some_and(|ttl| last_ttl_round[i].elapsed() >= ttl);
                    let short = step.core.id_index(table).is_some_and(|index| index.runs_short());
                    if (short || ttl_due) && !step.core.evictions().lock().round_open(table) {
                        step.begin_eviction_round(table, short);
                        if ttl_due {
                            last_ttl_round[i] = Instant::now();
                        }
                    }
                }
                // After beginning rounds: a node whose workers are idle answers its own at once.
                step.answer_evictions();
                Ok(Progress::Done)
            });
        }
    }
}
