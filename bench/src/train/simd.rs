//! The vector arithmetic of the trainers' inner loops.
//!
//! Written as fixed-width lanes so that the compiler turns each loop into SIMD instructions
//! without reassociating floating point on its own (a plain `iter().sum()` is a serial chain,
//! which it must keep). The kernels that call these helpers are compiled once per instruction
//! set by `multiversion` (AVX-512, AVX2 + FMA, SSE, NEON, …) and the best one the CPU has is
//! picked at run time, so one binary is fast on every x86-64 or ARM machine without
//! `-C target-cpu`. The helpers are `#[inline(always)]` so they take on the instruction set of
//! the kernel they are inlined into.

/// Lanes of the partial sums: 16 `f32` fill one AVX-512 register or two AVX ones, enough
/// independent chains to hide the latency of a vector add.
const LANES: usize = 16;

/// `Σ a[i]·b[i]` over the shorter of the two.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let (a_lanes, a_tail) = a.as_chunks::<LANES>();
    let (b_lanes, b_tail) = b.as_chunks::<LANES>();
    let mut acc = [0.0f32; LANES];
    for (x, y) in a_lanes.iter().zip(b_lanes) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = horizontal_sum(acc);
    for (x, y) in a_tail.iter().zip(b_tail) {
        s += x * y;
    }
    s
}

/// `Σ a[i]·b[i]·c[i]` over the shortest of the three.
#[inline(always)]
pub(crate) fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    let (a_lanes, a_tail) = a.as_chunks::<LANES>();
    let (b_lanes, b_tail) = b.as_chunks::<LANES>();
    let (c_lanes, c_tail) = c.as_chunks::<LANES>();
    let mut acc = [0.0f32; LANES];
    for ((x, y), z) in a_lanes.iter().zip(b_lanes).zip(c_lanes) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l] * z[l];
        }
    }
    let mut s = horizontal_sum(acc);
    for ((x, y), z) in a_tail.iter().zip(b_tail).zip(c_tail) {
        s += x * y * z;
    }
    s
}

/// `y += a·x` over the shorter of the two.
#[inline(always)]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `y += x` over the shorter of the two.
#[inline(always)]
pub(crate) fn add(y: &mut [f32], x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += x;
    }
}

/// `y -= x` over the shorter of the two.
#[inline(always)]
pub(crate) fn sub(y: &mut [f32], x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y -= x;
    }
}

/// `out[r] = rows[r] · query` for the rows of `rows`, one every `stride` values (a row's first
/// `query.len()` values count; the rest of a stride, optimiser state, say, does not).
#[multiversion::multiversion(targets = "simd")]
pub(crate) fn dot_rows(rows: &[f32], stride: usize, query: &[f32], out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        let start = (r * stride).min(rows.len());
        *o = dot(&rows[start..(start + query.len()).min(rows.len())], query);
    }
}

#[inline(always)]
fn horizontal_sum(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serial_dot(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum()
    }

    #[test]
    fn dot_products_match_a_serial_sum_at_every_length() {
        for n in [0, 1, 7, 15, 16, 17, 31, 32, 33, 100, 128, 257] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) / 2.0).collect();
            let c: Vec<f32> = (0..n).map(|i| 1.0 + (i % 3) as f32).collect();
            assert!((f64::from(dot(&a, &b)) - serial_dot(&a, &b)).abs() < 1e-3, "dot of length {n}");
            let ac: Vec<f32> = a.iter().zip(&c).map(|(x, z)| x * z).collect();
            assert!((f64::from(dot3(&a, &b, &c)) - serial_dot(&ac, &b)).abs() < 1e-3, "dot3 of length {n}");
        }
        assert_eq!(dot(&[1.0, 2.0, 3.0], &[1.0]), 1.0, "the shorter length counts");
    }

    #[test]
    fn every_row_is_scored_against_the_query() {
        let rows: Vec<f32> = (0..5 * 3).map(|i| i as f32).collect();
        let mut out = vec![0.0; 5];
        dot_rows(&rows, 3, &[1.0, 0.0, 2.0], &mut out);
        assert_eq!(out, [4.0, 13.0, 22.0, 31.0, 40.0]);
        let mut strided = vec![0.0; 2];
        dot_rows(&rows, 6, &[1.0, 0.0, 2.0], &mut strided);
        assert_eq!(strided, [4.0, 22.0], "a stride skips the rest of each row");
    }

    #[test]
    fn elementwise_updates_touch_every_element_once() {
        let x: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let mut y = vec![1.0f32; 37];
        axpy(&mut y, 2.0, &x);
        assert!(y.iter().enumerate().all(|(i, v)| *v == 1.0 + 2.0 * i as f32));
        add(&mut y, &x);
        sub(&mut y, &x);
        sub(&mut y, &x);
        assert!(y.iter().enumerate().all(|(i, v)| *v == 1.0 + i as f32));
    }
}
