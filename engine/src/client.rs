//! The worker's side of an operation: what local memory serves at once (a latch and a memcpy),
//! shared by the runtime's workers and the simulated ones.

use crate::protocol::AccessKind;
use crate::store::Store;

/// Serves the rows of an access whose keys this node holds, under their latches, and collects
/// the other rows in `remote`. `input` holds push/set values (`keys.len() × value_len`), `output`
/// receives pull values at the same positions. Returns the number of rows served.
#[inline]
pub fn local_pass(store: &Store, kind: AccessKind, table: u16, keys: &[u64], input: &[f32], output: &mut [f32], remote: &mut Vec<u32>) -> usize {
    let t = store.table(table);
    let value_len = t.value_len();
    let (rows, needed) = (keys.len(), keys.len() * value_len);
    assert!(if kind == AccessKind::Pull { output.len() >= needed } else { input.len() >= needed }, "value buffer shorter than keys × value length");
    let (inp, out) = (input.as_ptr(), output.as_mut_ptr());
    let mut served = 0;
    for (row, &key) in keys.iter().enumerate() {
        // A pull first tries a seqlock read without the latch (no atomic read-modify-write).
        // SAFETY: `row < keys.len()`, and the output holds `keys.len() × value_len` floats.
        if kind == AccessKind::Pull && unsafe { t.read_optimistic(key, out.add(row * value_len)) } {
            served += 1;
            continue;
        }
        // Keys held elsewhere need no latch: only the protocol publishes keys, and a key that
        // arrives meanwhile is served when the protocol sees the request.
        if t.slot_of(key).is_none() {
            remote.push(row as u32);
            continue;
        }
        let _latch = store.latch(table, key);
        let Some(slot) = t.slot_of(key) else {
            remote.push(row as u32);
            continue;
        };
        debug_assert!(row < rows);
        // SAFETY: the key's latch is held and `slot` is the key's published slot (the protocol
        // unpublishes a key only under the same latch); `row < keys.len()` and the buffer holds
        // `keys.len() × value_len` floats (asserted above), so the row's range is in bounds.
        unsafe {
            match kind {
                AccessKind::Pull => t.read_to_f32(slot, out.add(row * value_len)),
                AccessKind::Push => t.add_from(slot, inp.add(row * value_len)),
                AccessKind::Set => t.write(slot, std::slice::from_raw_parts(inp.add(row * value_len), value_len)),
            }
        }
        served += 1;
    }
    served
}

/// Whether every key is held here; if so, copies their values into `output`.
#[inline]
pub fn pull_if_all_local(store: &Store, table: u16, keys: &[u64], output: &mut [f32]) -> bool {
    let t = store.table(table);
    let value_len = t.value_len();
    if keys.iter().any(|&k| t.slot_of(k).is_none()) {
        return false;
    }
    for (row, &key) in keys.iter().enumerate() {
        let dst = &mut output[row * value_len..(row + 1) * value_len];
        // SAFETY: `dst` holds `value_len` floats.
        if unsafe { t.read_optimistic(key, dst.as_mut_ptr()) } {
            continue;
        }
        let _latch = store.latch(table, key);
        let Some(slot) = t.slot_of(key) else { return false };
        // SAFETY: latch held, slot published for the key.
        unsafe { t.read(slot, dst) };
    }
    true
}

/// Gathers the keys and values of `rows` for a protocol request.
pub fn gather(rows: &[u32], keys: &[u64], input: &[f32], value_len: usize, carries_values: bool) -> (Vec<u64>, Vec<f32>) {
    let remote_keys = rows.iter().map(|&r| keys[r as usize]).collect();
    let mut values = Vec::new();
    if carries_values {
        values.reserve(rows.len() * value_len);
        for &r in rows {
            values.extend_from_slice(&input[r as usize * value_len..(r as usize + 1) * value_len]);
        }
    }
    (remote_keys, values)
}

/// Writes pulled values of `rows` (in row order) back to their positions in `output`.
pub fn scatter(rows: &[u32], pulled: &[f32], output: &mut [f32], value_len: usize) {
    for (i, &r) in rows.iter().enumerate() {
        output[r as usize * value_len..(r as usize + 1) * value_len].copy_from_slice(&pulled[i * value_len..(i + 1) * value_len]);
    }
}
