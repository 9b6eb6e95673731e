//! The eviction thread of a node with a dynamic table that evicts (`protocol::evict`): it
//! begins a round where this node is a home that runs short of slot keys or whose time to live
//! passed, answers rounds whose grace periods ended, and lets rounds go of lost nodes; where
//! evicted rows are spilled, it writes the rows the rounds freed to the spill files. The
//! decisions are the protocol's; this thread only looks at the clock, takes the steps and does
//! the I/O.

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
        let mut spill_failing = false;
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
            // Said once while it keeps failing (every millisecond otherwise).
            match self.write_spilled(false) {
                Err(e) if !spill_failing => {
                    spill_failing = true;
                    tracing::error!(node = self.config.rank, error = %e, "writing evicted rows to the spill file failed: their rows are not in it");
                }
                Err(_) => {}
                Ok(_) => spill_failing = false,
            }
        }
        if let Err(e) = self.write_spilled(true) {
            tracing::error!(node = self.config.rank, error = %e, "writing evicted rows to the spill file failed");
        }
    }

    /// Writes the rows the protocol freed since the last call to the spill files, where they
    /// are spilled (`sync`: and makes them durable); returns each spill file (table, path,
    /// bytes) when synced.
    pub fn write_spilled(&self, sync: bool) -> crate::error::Result<Vec<(u16, std::path::PathBuf, u64)>> {
        let Some(spiller) = &self.spiller else { return Ok(Vec::new()) };
        // The queue is taken under the files' lock: a checkpoint's sync then finds every row
        // queued before it written (none taken by the eviction thread and not yet appended).
        let mut spiller = spiller.lock();
        let rows = self.core.take_spilled();
        let mut written = Ok(());
        for r in &rows {
            // A failed write loses no row the table still holds (they were evicted anyway), but
            // the archive misses them: said once per call.
            written = written.and(spiller.append(r.table, &r.ids, &r.values));
        }
        written?;
        if sync {
            spiller.sync()
        } else {
            // Each round's rows readable in the file soon after it closes.
            if !rows.is_empty() {
                spiller.flush()?;
            }
            Ok(Vec::new())
        }
    }
}
