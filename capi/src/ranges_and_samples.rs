//! The C ABI's range operations, asynchronous push-pulls and sampling (NuPS): the same calls as
//! the Rust `Worker`'s, with tickets, distribution numbers and sample handles kept by the
//! worker handle.

use std::ffi::c_char;

use super::{FerryWorker, argument, ferry_err, guard, handle, put, slice, slice_mut, start_with_values, text};

/// Reads the values of keys `start..end` (end exclusive) into `out` (`(end - start) ×
/// value_len` floats, `out_len` of them): one message per node holding a part of the range.
///
/// # Safety
///
/// `worker` is null or a live worker; `out` has room for `out_len` floats (null when 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_pull_range(worker: *mut FerryWorker, table: u32, start: u64, end: u64, out: *mut f32, out_len: usize) -> i32 {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (w, out) = unsafe { (handle(worker, "worker")?, slice_mut(out, out_len, "out")?) };
        let t = w.table(table)?;
        w.worker.pull_range(t, start..end, out).map_err(ferry_err)
    })
}

/// Pushes `values` (`(end - start) × value_len` floats, `n_values` of them) to keys
/// `start..end`.
///
/// # Safety
///
/// `worker` is null or a live worker; `values` holds `n_values` floats (null when 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_push_range(worker: *mut FerryWorker, table: u32, start: u64, end: u64, values: *const f32, n_values: usize) -> i32 {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (w, values) = unsafe { (handle(worker, "worker")?, slice(values, n_values, "values")?) };
        let t = w.table(table)?;
        w.worker.push_range(t, start..end, values).map_err(ferry_err)
    })
}

/// Starts a push-pull; `*ticket` identifies it for `ferry_wait_pull`, which gives the values
/// right after the push.
///
/// # Safety
///
/// `worker` is null or a live worker; `keys` holds `n_keys` keys and `values` `n_values` floats
/// (copied before this returns); `ticket` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_push_pull_async(
    worker: *mut FerryWorker,
    table: u32,
    keys: *const u64,
    n_keys: usize,
    values: *const f32,
    n_values: usize,
    ticket: *mut u64,
) -> i32 {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        start_with_values(worker, table, keys, n_keys, values, n_values, ticket, |w, t, keys, values| w.push_pull_async(t, keys, values), |w| &mut w.pulls)
    }
}

/// Registers a distribution to sample keys `start..end` of `table` from: uniformly when
/// `weights` is null, else key `start + i` with weight `weights[i]` (`n_weights` = `end -
/// start`); drawn by `scheme` (`independent`, `reuse[:POOL:USES]`, `postpone[:POOL:USES]`,
/// `local`, or a conformity level `L1`–`L4`). `*distribution` is its number for
/// `ferry_prepare_sample`.
///
/// # Safety
///
/// `worker` is null or a live worker; `scheme` is null or NUL-terminated; `weights` holds
/// `n_weights` doubles or is null; `distribution` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_register_distribution(
    worker: *mut FerryWorker,
    table: u32,
    start: u64,
    end: u64,
    weights: *const f64,
    n_weights: usize,
    scheme: *const c_char,
    distribution: *mut u32,
) -> i32 {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (w, scheme) = unsafe { (handle(worker, "worker")?, text(scheme, "scheme")?) };
        let dist = if weights.is_null() {
            ferry::KeyDistribution::uniform(start..end)
        } else {
            // SAFETY: forwarded from this function's contract.
            let weights = unsafe { slice(weights, n_weights, "weights")? };
            if weights.len() as u64 != end.saturating_sub(start) {
                return Err(argument(format!("{} weights for the {} keys {start}..{end}", weights.len(), end.saturating_sub(start))));
            }
            ferry::KeyDistribution::Weighted { start, weights: weights.to_vec() }
        };
        let scheme = ferry::SamplingScheme::parse(scheme).map_err(ferry_err)?;
        let t = w.table(table)?;
        let id = w.worker.register_distribution(t, dist, scheme).map_err(ferry_err)?;
        w.distributions.push(id);
        // SAFETY: forwarded from this function's contract.
        unsafe { put(distribution, (w.distributions.len() - 1) as u32, "distribution") }
    })
}

/// Draws `n` samples from `distribution`; `*sample` is the handle `ferry_pull_sample` hands
/// them out from.
///
/// # Safety
///
/// `worker` is null or a live worker; `sample` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_prepare_sample(worker: *mut FerryWorker, distribution: u32, n: usize, sample: *mut u64) -> i32 {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let w = unsafe { handle(worker, "worker")? };
        let id =
            *w.distributions.get(distribution as usize).ok_or_else(|| argument(format!("no distribution {distribution} was registered by this worker")))?;
        let prepared = w.worker.prepare_sample(id, n).map_err(ferry_err)?;
        let number = w.ticket();
        w.samples.insert(number, prepared);
        // SAFETY: forwarded from this function's contract.
        unsafe { put(sample, number, "sample") }
    })
}

/// The next `count` samples of `sample`: their keys into `keys` (`count` of them) and values
/// into `values` (`count × value_len` floats, `n_values` of them). A handle whose samples are
/// all handed out is gone.
///
/// # Safety
///
/// `worker` is null or a live worker; `keys` has room for `count` keys and `values` for
/// `n_values` floats (each null when its length is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_pull_sample(worker: *mut FerryWorker, sample: u64, count: usize, keys: *mut u64, values: *mut f32, n_values: usize) -> i32 {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (w, keys, values) = unsafe { (handle(worker, "worker")?, slice_mut(keys, count, "keys")?, slice_mut(values, n_values, "values")?) };
        let prepared = w.samples.get_mut(&sample).ok_or_else(|| argument(format!("{sample} is not a prepared sample of this worker")))?;
        if count > prepared.remaining() {
            return Err(argument(format!("{count} samples asked for, {} left in the handle", prepared.remaining())));
        }
        w.worker.pull_sample(prepared, keys, values).map_err(ferry_err)?;
        if prepared.remaining() == 0 {
            w.samples.remove(&sample);
        }
        Ok(())
    })
}
