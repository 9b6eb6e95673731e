//! Where a training run's epochs begin, for a node that joins it mid-run (`--on-loss replace`,
//! or `FERRY_JOIN` with `--on-loss continue`).
//!
//! Barriers are numbered alike on every node, and a node that joins takes part in them from a
//! generation the cluster gives it ([`ferry::Worker::barriers_passed`]) — most likely in the
//! middle of an epoch, whose barriers (sub-epochs, evaluation, checkpoints) it cannot tell
//! apart. So before each epoch's opening barrier, thread 0 of every node sets one key of a
//! scratch table to the epoch and the generation of that barrier (all nodes set the same
//! values), and before the closing barrier of the run the epoch after the last. The joining
//! node's threads pass barriers until the key names the one they just passed: they are then
//! where that epoch begins, with every other node.
//!
//! The key read after barrier `g` is the one set before it: the next set comes only after the
//! nodes passed at least one more barrier, which waits for the joining node (every epoch has
//! an opening and a closing barrier).

use anyhow::Result;
use ferry::{Table, Worker};

use super::epochs::Pass;

/// The scratch table's name.
pub const TABLE: &str = "schedule";

/// Values of its one key: epoch and barrier generation, each as two 16-bit halves (exact in
/// `f32`).
pub const FIELDS: usize = 4;

/// How long a joining node waits in a barrier for the others: up to an epoch and an evaluation
/// (a lost node still fails the wait within the liveness timeout).
const JOIN_WAIT: std::time::Duration = super::shared::EVALUATION_WAIT;

/// The record of `epoch` beginning at barrier generation `generation`.
fn encode(epoch: u32, generation: u32) -> [f32; FIELDS] {
    let half = |v: u32, shift: u32| ((v >> shift) & 0xffff) as f32;
    [half(epoch, 16), half(epoch, 0), half(generation, 16), half(generation, 0)]
}

/// (epoch, generation) of a record; `None` for values no node sets (a fresh table's zeros
/// read as epoch 0, which no run has).
fn decode(values: &[f32; FIELDS]) -> Option<(u32, u32)> {
    let half = |v: f32| (v.fract() == 0.0 && (0.0..65536.0).contains(&v)).then_some(v as u32);
    let (eh, el, gh, gl) = (half(values[0])?, half(values[1])?, half(values[2])?, half(values[3])?);
    let epoch = eh << 16 | el;
    (epoch > 0).then_some((epoch, gh << 16 | gl))
}

/// Before the barrier that begins `epoch` (or, as the epoch after the last, ends the run):
/// notes where it begins (thread 0 of each node).
pub fn note_epoch_start(pass: &mut Pass<'_>, schedule: Table, epoch: usize) -> Result<()> {
    let Some((worker, _)) = pass.node() else { return Ok(()) };
    let epoch = u32::try_from(epoch)?;
    worker.set(schedule, &[0], &encode(epoch, worker.barriers_passed().wrapping_add(1)))?;
    Ok(())
}

/// A node that just joined: passes the others' barriers until the one that begins an epoch,
/// and returns that epoch (the one after the last when the run ends there).
pub fn join_at_an_epoch(worker: &mut Worker, schedule: Table) -> Result<usize> {
    loop {
        worker.barrier_within(JOIN_WAIT)?;
        let mut values = [0.0f32; FIELDS];
        worker.pull(schedule, &[0], &mut values)?;
        match decode(&values) {
            Some((epoch, generation)) if generation == worker.barriers_passed() => return Ok(epoch as usize),
            Some(_) | None => continue,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_keep_epochs_and_generations_exactly() {
        for (epoch, generation) in [(1, 1), (7, 65_535), (65_536, 65_537), (300, 16_777_217), (u32::MAX, u32::MAX)] {
            assert_eq!(decode(&encode(epoch, generation)), Some((epoch, generation)));
        }
        assert_eq!(decode(&[0.0; FIELDS]), None, "a table never set");
        assert_eq!(decode(&[0.0, 1.5, 0.0, 3.0]), None, "not whole");
    }
}
