//! One replication round, run by the node's replication thread and by barriers: ship, wait for
//! the acknowledgements, refresh with one-sided reads (see the module documentation).

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::protocol::Progress;
use crate::protocol::wire::ReplicaImage;
use crate::runtime::NodeInner;
use crate::store::TableStore;

/// Rounds of one node; held while a round runs, so rounds never overlap.
#[derive(Debug)]
pub(crate) struct RoundState {
    /// The last round's number.
    round: u32,
    /// Cluster time at which the last completed round began (0: none yet).
    last_completed_start: u64,
    /// How long the last round took.
    pub last_duration: Duration,
    /// The last round did not refresh everything (or none ran yet): ask for full images.
    stale: bool,
}

impl Default for RoundState {
    fn default() -> RoundState {
        RoundState { round: 0, last_completed_start: 0, last_duration: Duration::ZERO, stale: true }
    }
}

/// Runs a round unless one that began at or after cluster time `since` has completed.
pub(crate) fn sync_since(node: &NodeInner, since: u64) -> Result<()> {
    let mut state = node.replication_rounds.lock();
    if state.last_completed_start >= since {
        return Ok(());
    }
    run_round(node, &mut state)
}

/// Runs one round now.
pub(crate) fn run_round(node: &NodeInner, state: &mut RoundState) -> Result<()> {
    let began = Instant::now();
    let start = node.now();
    state.round = state.round.wrapping_add(1);
    let round = state.round;
    let rank = node.config.rank;
    let homes: Vec<u16> = (0..node.config.nodes).filter(|&h| h != rank && node.fabric.is_alive(h)).map(|h| h as u16).collect();
    let mut sent = Vec::new();
    let full = state.stale;
    node.run_pooled(|step, _, _| {
        sent = step.ship_replica_deltas(round, &homes, full);
        Ok(Progress::Done)
    })?;
    let replication = node.core.replication();
    let deadline = Instant::now() + node.config.op_timeout;
    let (acks, complete) = replication.mailbox().wait(round, &sent, deadline, |h| node.fabric.is_alive(h as usize));
    let mut outcome = if complete {
        Ok(())
    } else {
        let mut nodes: Vec<usize> = sent.iter().filter(|(h, t)| !acks.iter().any(|a| a.from == *h && a.table == *t)).map(|(h, _)| *h as usize).collect();
        nodes.dedup();
        Err(Error::Timeout { what: "replica deltas to be acknowledged", millis: node.config.op_timeout.as_millis() as u64, nodes })
    };
    let reads_began = node.now();
    let mut refreshed_tables = vec![true; node.config.tables.len()];
    for ack in &acks {
        // A split shipment is acknowledged once per message; the last one carries the image.
        let Some(image) = &ack.image else { continue };
        if let Err(e) = refresh(node, ack.from, ack.table, image) {
            refreshed_tables[ack.table as usize] = false;
            if outcome.is_ok() {
                outcome = Err(e);
            }
        }
    }
    state.stale = outcome.is_err();
    if complete {
        for (table, ok) in refreshed_tables.into_iter().enumerate() {
            if ok && node.core.store().table(table as u16).replicas().is_some() {
                replication.note_refreshed(table as u16, reads_began);
            }
        }
        state.last_completed_start = start;
    }
    state.last_duration = began.elapsed();
    replication.note_round(state.last_duration.as_nanos() as u64);
    outcome
}

/// Refreshes this node's replicas of `table` homed at `home` from `image`: one one-sided read,
/// each slot image's versions checked. A torn slot image fails the refresh (the next round asks
/// for full images).
fn refresh(node: &NodeInner, home: u16, table: u16, image: &ReplicaImage) -> Result<()> {
    let store = node.core.store();
    let t = store.table(table);
    if t.replicas().is_none() || image.positions.is_empty() {
        return Ok(());
    }
    let mut copy = vec![0u8; image.positions.len() * t.slot_bytes()];
    node.fabric.read(home as usize, image.remote, &mut copy, node.config.op_timeout)?;
    let (refreshed, torn) = apply_image(store, home, table, &image.positions, &copy);
    let replication = node.core.replication();
    replication.note_reads(1, copy.len() as u64);
    replication.note_refreshed_keys(refreshed, torn);
    if torn > 0 {
        return Err(Error::Protocol(format!("{torn} slot images read from node {home} were torn")));
    }
    Ok(())
}

/// Applies an image read from `home`: slot images of `table`'s replicated keys homed there, the
/// i-th at `positions[i]` among them. Each replica becomes the image's value plus this node's
/// unshipped delta. Returns (replicas refreshed, slot images rejected as torn).
pub(crate) fn apply_image(store: &crate::store::Store, home: u16, table: u16, positions: &[u32], image: &[u8]) -> (u64, u64) {
    let t = store.table(table);
    let Some(replicas) = t.replicas() else { return (0, 0) };
    let homed = replicas.homed_at(home as usize);
    let mut value = vec![0f32; t.value_len()];
    let (mut refreshed, mut torn) = (0, 0);
    for (&position, slot_image) in positions.iter().zip(image.chunks_exact(t.slot_bytes())) {
        let ordinal = homed.start + position;
        if ordinal >= homed.end {
            break;
        }
        match crate::store::validate_slot_copy(slot_image, t.value_len()) {
            Some(fresh) => {
                apply(t, store, replicas, ordinal, fresh, &mut value);
                refreshed += 1;
            }
            // Only a peer that broke the round's order could leave a torn image: this replica
            // keeps its value until the next round.
            None => torn += 1,
        }
    }
    (refreshed, torn)
}

/// Sets replica `ordinal` to the home's `fresh` value plus this node's unshipped delta.
fn apply(t: &TableStore, store: &crate::store::Store, replicas: &crate::store::ReplicaState, ordinal: u32, fresh: &[u8], value: &mut [f32]) {
    for (v, b) in value.iter_mut().zip(fresh.chunks_exact(4)) {
        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    let key = replicas.key(ordinal);
    let guard = store.lock(t.id(), key);
    if let Some(slot) = guard.slot() {
        replicas.add_current_delta(ordinal, value);
        slot.write(value);
    }
}
