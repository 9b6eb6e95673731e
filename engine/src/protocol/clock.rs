//! Worker clocks for bounded-delay consistency (the parameter server, OSDI 2014, Sections 3.4,
//! 3.5 and 4.1).
//!
//! Every worker counts the clocks (iterations) it has completed. With a delay bound `τ`, no
//! worker starts clock `c` before every worker of the cluster has completed clock `c − τ − 1`,
//! i.e. before the cluster's smallest completed count reaches `c − τ`: `τ = 0` is bulk
//! synchronous, `τ = ∞` (no bound) fully asynchronous.
//!
//! Each node keeps its own workers' counts and, whenever their minimum grows, sends it to every
//! peer (CLOCK) if the cluster has a delay bound (without one, nobody waits for the cluster's
//! minimum, and intent signalling advances clocks every mini-batch); the cluster's minimum is
//! the smallest of the last counts every live node reported. A node's count never decreases: a
//! worker that starts later starts at its node's minimum. A node whose workers all left reports
//! "done" (`u64::MAX`) and holds nobody back any more; a worker it starts after that begins at
//! the smallest count it knows and is not waited for by the others. A lost node no longer holds
//! anybody back either. A cluster restored from a checkpoint counts on from the clock the
//! checkpoint saved ([`Clocks::checkpoint_clock`]; [`Clocks::new`]'s `first`): every node
//! starts there, and a worker's first clock is that one. The state machine has no clock and no
//! I/O: the runtime waits on [`Clocks::cluster_min`].

use super::directory::Directory;
use super::transmit::Transmit;
use super::wire;
use crate::error::{Error, Result};
use crate::stats::MessageKind;

/// One node's view of the cluster's clocks.
pub struct Clocks {
    rank: u16,
    /// Per local worker index: clocks completed (`None`: no such worker, or it left).
    local: Vec<Option<u64>>,
    /// Per node: the smallest count it reported (this node's own entry: what it last sent).
    reported: Vec<u64>,
    /// Whether a worker ever registered here (until then the node's count is 0).
    had_workers: bool,
    /// Whether the node's minimum is sent to the peers (only a delay bound needs it).
    share: bool,
    /// The count every node starts from (0, or a restored checkpoint's clock).
    first: u64,
    /// The largest count all of this node's workers had completed at once: what a checkpoint
    /// saves (a worker started late, at a smaller count, does not lower it).
    reached: u64,
}

impl Clocks {
    /// The clocks of node `rank` of `nodes`; with `share` the node tells its peers its
    /// minimum whenever it grows (needed only for a delay bound: without one, nobody waits for
    /// [`Clocks::cluster_min`], and the peers' entries stay at what they reported, if anything).
    /// Every node starts from the count `first` (the same on all: 0, or the clock of the
    /// checkpoint the cluster restored).
    pub fn new(rank: u16, nodes: usize, share: bool, first: u64) -> Clocks {
        Clocks { rank, local: Vec::new(), reported: vec![first; nodes], had_workers: false, share, first, reached: first }
    }

    /// This node's workers' smallest count: `first` before any worker started, "done" once
    /// all left.
    fn node_min(&self) -> u64 {
        match self.local.iter().flatten().copied().min() {
            Some(min) => min,
            None if self.had_workers => u64::MAX,
            None => self.first,
        }
    }

    /// The clock a worker starting now starts in: its node's slowest worker's (with no worker
    /// left, the smallest count the node knows of others, so as to hold nobody back).
    fn starting_clock(&self) -> u64 {
        match self.node_min() {
            u64::MAX => self.reported.iter().copied().filter(|&c| c != u64::MAX).min().unwrap_or(self.first),
            min => min,
        }
    }

    /// What a checkpoint taken now saves for this node: the largest count all its workers had
    /// completed at once (its slowest worker's, as long as no worker started late). A restore
    /// starts every node at the smallest such clock of all nodes.
    pub fn checkpoint_clock(&self) -> u64 {
        self.reached
    }

    /// A worker with index `worker` starts; returns the clock it starts in: its node's minimum
    /// (the smallest finite count this node knows if none of its workers is left).
    pub fn register(&mut self, worker: u16) -> u64 {
        let start = self.starting_clock();
        self.had_workers = true;
        let i = worker as usize;
        if self.local.len() <= i {
            self.local.resize(i + 1, None);
        }
        self.local[i] = Some(start);
        start
    }

    /// Worker `worker` completed a clock; returns how many it has completed. Tells the peers
    /// when the node's minimum grew.
    pub fn advance(&mut self, worker: u16, directory: &Directory, tx: &mut Transmit) -> u64 {
        // A worker the node does not know (cannot happen through the API) starts at the minimum.
        if !matches!(self.local.get(worker as usize), Some(Some(_))) {
            self.register(worker);
        }
        let mut completed = 0;
        if let Some(Some(c)) = self.local.get_mut(worker as usize) {
            *c += 1;
            completed = *c;
        }
        self.report(directory, tx);
        completed
    }

    /// Worker `worker` left: it no longer holds anybody back.
    pub fn retire(&mut self, worker: u16, directory: &Directory, tx: &mut Transmit) {
        if let Some(c) = self.local.get_mut(worker as usize) {
            *c = None;
        }
        self.report(directory, tx);
    }

    /// Sends the node's minimum to every live peer if it grew (and the clocks are shared).
    fn report(&mut self, directory: &Directory, tx: &mut Transmit) {
        let min = self.node_min();
        if min != u64::MAX {
            self.reached = self.reached.max(min);
        }
        let own = &mut self.reported[self.rank as usize];
        if min <= *own {
            return;
        }
        *own = min;
        if !self.share {
            return;
        }
        for node in 0..self.reported.len() as u16 {
            if node != self.rank && !directory.is_lost(node) {
                wire::encode_clock(tx.buf(node), min);
                tx.sent(node, MessageKind::Barrier, wire::CLOCK_BYTES);
            }
        }
    }

    /// Handles CLOCK from `from`.
    pub fn handle_message(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let min = wire::decode_clock(body)?;
        let Some(r) = self.reported.get_mut(from as usize) else {
            return Err(Error::Protocol(format!("CLOCK from node {from}, which is not a member")));
        };
        if from == self.rank {
            return Err(Error::Protocol("CLOCK from this node itself".into()));
        }
        // Reports only grow; an older one overtaken by a newer is ignored.
        *r = (*r).max(min);
        Ok(())
    }

    /// The smallest completed count over every live node.
    pub fn cluster_min(&self, directory: &Directory) -> u64 {
        // This node's own workers count as they are (a late worker holds back its own node).
        let own = self.node_min();
        (0..self.reported.len()).filter(|&n| n != self.rank as usize && !directory.is_lost(n as u16)).map(|n| self.reported[n]).fold(own, u64::min)
    }

    /// The live nodes whose count is below `target` (for a timeout's message).
    pub fn behind(&self, target: u64, directory: &Directory) -> Vec<usize> {
        (0..self.reported.len())
            .filter(|&n| {
                let count = if n == self.rank as usize { self.node_min().max(self.reported[n]) } else { self.reported[n] };
                count < target && !directory.is_lost(n as u16)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TableSpec;

    #[test]
    fn a_restored_cluster_counts_on_from_its_checkpoints_clock() {
        let directory = Directory::new(0, 2, 1, &[TableSpec::new("t", 4, 1)], false);
        let mut tx = Transmit::new(0, 2, 1 << 16, &Default::default());
        let mut clocks = Clocks::new(0, 2, true, 7);
        assert_eq!(clocks.checkpoint_clock(), 7, "no worker yet: the first clock");
        assert_eq!(clocks.cluster_min(&directory), 7);
        assert_eq!((clocks.register(0), clocks.register(1)), (7, 7));
        assert_eq!(clocks.advance(0, &directory, &mut tx), 8);
        assert_eq!(clocks.advance(0, &directory, &mut tx), 9);
        assert_eq!(clocks.advance(1, &directory, &mut tx), 8);
        assert_eq!(clocks.checkpoint_clock(), 8, "the slowest worker's");
        // Workers that left, and a worker started late at a smaller count (the smallest count
        // the node knows: its peer's first), leave it where all had been.
        clocks.retire(0, &directory, &mut tx);
        clocks.retire(1, &directory, &mut tx);
        assert_eq!(clocks.checkpoint_clock(), 8);
        assert_eq!(clocks.register(2), 7, "a late worker holds nobody back: the smallest count known");
        assert_eq!(clocks.checkpoint_clock(), 8);
        assert_eq!(clocks.advance(2, &directory, &mut tx), 8);
        assert_eq!(clocks.advance(2, &directory, &mut tx), 9);
        assert_eq!(clocks.checkpoint_clock(), 9);
    }
}
