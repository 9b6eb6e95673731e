//! Applying a refresh's image to this node's replicas: the part of a round that touches the
//! store, shared by the runtime's driver and the simulator.

use crate::store::{ReplicaState, Store, TableStore};

/// Applies an image read from `home`: slot images of `table`'s replicated keys homed there, the
/// i-th at `positions[i]` among them. Each replica becomes the image's value plus this node's
/// unshipped delta. Returns (replicas refreshed, slot images rejected as torn).
pub(crate) fn apply_image(store: &Store, home: u16, table: u16, positions: &[u32], image: &[u8]) -> (u64, u64) {
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
fn apply(t: &TableStore, store: &Store, replicas: &ReplicaState, ordinal: u32, fresh: &[u8], value: &mut [f32]) {
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
