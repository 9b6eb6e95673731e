//! Walker's alias method: O(1) draws from a fixed discrete distribution after O(n) set-up.

use rand::Rng;

use crate::error::{Error, Result};

/// A discrete distribution over `0..n` prepared for constant-time draws (Vose's variant of
/// Walker's alias method).
#[derive(Debug, Clone)]
pub(crate) struct AliasTable {
    /// Probability of keeping column `i` rather than taking its alias, scaled to `[0, 1]`.
    keep: Vec<f64>,
    alias: Vec<u32>,
}

impl AliasTable {
    /// Builds the table from non-negative, finite weights with a positive sum.
    pub(crate) fn new(weights: &[f64]) -> Result<AliasTable> {
        let n = weights.len();
        if n == 0 {
            return Err(Error::Sampling("a distribution needs at least one key".into()));
        }
        if n > u32::MAX as usize {
            return Err(Error::Sampling(format!("a weighted distribution over {n} keys is too large (at most {})", u32::MAX)));
        }
        if let Some((i, w)) = weights.iter().enumerate().find(|(_, w)| !w.is_finite() || **w < 0.0) {
            return Err(Error::Sampling(format!("weight {i} is {w}; weights must be finite and non-negative")));
        }
        let total: f64 = weights.iter().sum();
        if !(total > 0.0 && total.is_finite()) {
            return Err(Error::Sampling(format!("the weights sum to {total}; they must sum to a positive, finite number")));
        }
        let mut scaled: Vec<f64> = weights.iter().map(|w| w * n as f64 / total).collect();
        let mut alias = vec![0u32; n];
        let mut keep = vec![1.0f64; n];
        let (mut small, mut large): (Vec<u32>, Vec<u32>) = (Vec::new(), Vec::new());
        for (i, &p) in scaled.iter().enumerate() {
            if p < 1.0 { small.push(i as u32) } else { large.push(i as u32) }
        }
        while let (Some(&s), Some(&l)) = (small.last(), large.last()) {
            small.pop();
            keep[s as usize] = scaled[s as usize];
            alias[s as usize] = l;
            scaled[l as usize] -= 1.0 - scaled[s as usize];
            if scaled[l as usize] < 1.0 {
                large.pop();
                small.push(l);
            }
        }
        // What is left is 1 up to rounding: keep those columns whole.
        for i in small.into_iter().chain(large) {
            keep[i as usize] = 1.0;
            alias[i as usize] = i;
        }
        Ok(AliasTable { keep, alias })
    }

    /// Number of outcomes.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.keep.len()
    }

    /// Draws one outcome.
    #[inline]
    pub(crate) fn draw(&self, rng: &mut impl Rng) -> usize {
        let column = rng.gen_range(0..self.keep.len());
        if rng.r#gen::<f64>() < self.keep[column] { column } else { self.alias[column] as usize }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;

    #[test]
    fn reproduces_the_weights() {
        let weights = [5.0, 0.0, 1.0, 2.0, 0.5, 1.5];
        let table = AliasTable::new(&weights).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let draws = 600_000;
        let mut counts = [0usize; 6];
        for _ in 0..draws {
            counts[table.draw(&mut rng)] += 1;
        }
        assert_eq!(counts[1], 0, "a key of weight 0 is never drawn");
        let total: f64 = weights.iter().sum();
        for (i, &w) in weights.iter().enumerate() {
            let expected = w / total;
            let got = counts[i] as f64 / draws as f64;
            assert!((got - expected).abs() < 0.005, "outcome {i}: {got} vs {expected}");
        }
    }

    #[test]
    fn rejects_bad_weights() {
        assert!(AliasTable::new(&[]).is_err());
        assert!(AliasTable::new(&[0.0, 0.0]).is_err());
        assert!(AliasTable::new(&[1.0, -1.0]).is_err());
        assert!(AliasTable::new(&[1.0, f64::NAN]).is_err());
        assert!(AliasTable::new(&[f64::INFINITY]).is_err());
        assert_eq!(AliasTable::new(&[0.0, 3.0]).unwrap().len(), 2);
    }
}
