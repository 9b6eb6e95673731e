//! The driver of the node's replication rounds: runs the [`Rounds`] machine with the node's
//! protocol, fabric and clock, for the replication thread and for barriers.

use std::time::Instant;

use super::NodeInner;
use crate::error::{Error, Result};
use crate::protocol::Progress;
use crate::replication::{Round, Rounds};

/// How long a round waits for acknowledgements between checks of the homes' liveness.
const LIVENESS_CHECK: std::time::Duration = std::time::Duration::from_millis(50);

/// Runs a round unless one that began at or after cluster time `since` has completed.
pub(crate) fn sync_since(node: &NodeInner, since: u64) -> Result<()> {
    let mut rounds = node.replication_rounds.lock();
    if rounds.completed_since(since) {
        return Ok(());
    }
    run_round(node, &mut rounds)
}

/// Runs one round now, waiting at most the operation timeout for its acknowledgements.
pub(crate) fn run_round(node: &NodeInner, rounds: &mut Rounds) -> Result<()> {
    let began = Instant::now();
    let mut round = rounds.begin(node.now());
    let rank = node.config.rank;
    let homes: Vec<u16> = (0..node.config.nodes).filter(|&h| h != rank && node.fabric.is_alive(h)).map(|h| h as u16).collect();
    let mut sent = Vec::new();
    let shipped = node.run_pooled(|step, _, _| {
        sent = step.ship_replica_deltas(round.number(), &homes, round.full());
        Ok(Progress::Done)
    });
    round.shipped(sent);
    if let Err(e) = shipped {
        // The round fails and the next asks for full images.
        round.fail(e.clone());
        let _ = rounds.end(round);
        return Err(e);
    }
    wait_for_acks(node, &mut round);
    let reads_began = node.now();
    for read in round.take_reads() {
        let result = refresh(node, read.home, read.table, &read.image);
        round.handle_read(read.table, result);
    }
    let end = rounds.end(round);
    let replication = node.core.replication();
    if end.complete {
        for table in end.refreshed {
            if node.core.store().table(table).replicas().is_some() {
                replication.note_refreshed(table, reads_began);
            }
        }
    }
    replication.note_round(began.elapsed().as_nanos() as u64);
    end.outcome
}

/// Feeds the round the homes' acknowledgements and losses until it has them all, or gives it
/// up once the operation timeout has passed.
fn wait_for_acks(node: &NodeInner, round: &mut Round) {
    let mailbox = node.core.replication().mailbox();
    let deadline = Instant::now() + node.config.op_timeout;
    loop {
        for home in round.waiting_for() {
            if !node.fabric.is_alive(home as usize) {
                round.handle_lost(home);
            }
        }
        if round.acknowledged() {
            return;
        }
        let now = Instant::now();
        if now >= deadline {
            round.give_up(node.config.op_timeout.as_millis() as u64);
            return;
        }
        for ack in mailbox.wait_take(deadline.min(now + LIVENESS_CHECK)) {
            round.handle_ack(ack);
        }
    }
}

/// Refreshes this node's replicas of `table` homed at `home` from `image`: one one-sided read,
/// each slot image's versions checked. A torn slot image fails the refresh (the next round asks
/// for full images).
fn refresh(node: &NodeInner, home: u16, table: u16, image: &crate::protocol::wire::ReplicaImage) -> Result<()> {
    let store = node.core.store();
    let t = store.table(table);
    if t.replicas().is_none() || image.positions.is_empty() {
        return Ok(());
    }
    let mut copy = vec![0u8; image.positions.len() * t.slot_bytes()];
    node.fabric.read(home as usize, image.remote, &mut copy, node.config.op_timeout)?;
    let (refreshed, torn) = crate::replication::apply_image(store, home, table, &image.positions, &copy);
    let replication = node.core.replication();
    replication.note_reads(1, copy.len() as u64);
    replication.note_refreshed_keys(refreshed, torn);
    if torn > 0 {
        return Err(Error::Protocol(format!("{torn} slot images read from node {home} were torn")));
    }
    Ok(())
}
