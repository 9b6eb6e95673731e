//! Server-side update functions (the parameter server, OSDI 2014, Section 3.3).
//!
//! A table's [`Updater`] says what a push does to a value: `add` it (the default: pushes are
//! cumulative updates), or treat it as a gradient and take an optimizer step — `sgd`, `adagrad`,
//! `adam`, or a rule of the trainer's own ([`UpdateRule`]). The step is taken wherever the key is
//! held: by a worker serving a local key under its latch, or by the owner serving a remote push,
//! so every push is applied exactly once, in the key's order.
//!
//! An optimizer's state (AdaGrad's sum of squared gradients, Adam's moments and step count)
//! lives in the slot next to the value: `[head][value][state][tail]`. A relocation moves it with
//! the value (one one-sided write of the whole slot); a pull never returns it, so it never
//! crosses the network on pulls or pushes. A `set` overwrites the value and keeps the state.
//! Replicated keys take only `add` (a replica adds pushes to a delta that its home adds to the
//! authoritative value; a non-linear step on a stale replica would not be the home's step).

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// A user-defined update function, registered with the table on every node.
///
/// The rule must be deterministic and identical on every node (its [`UpdateRule::describe`]
/// text is part of the configuration fingerprint that nodes compare at start-up).
pub trait UpdateRule: Send + Sync {
    /// Name and parameters, e.g. `"clipped-sgd(lr=0.1,clip=5)"`.
    fn describe(&self) -> String;
    /// Floats of optimizer state kept per value of `value_len` floats (zero at the start).
    fn state_len(&self, value_len: usize) -> usize;
    /// Applies one pushed `gradient` to `value` and `state` (`value` and `gradient` hold
    /// `value_len` floats, `state` `state_len(value_len)`).
    fn apply(&self, value: &mut [f32], state: &mut [f32], gradient: &[f32]);
}

/// What a push does to a value.
#[derive(Clone, Default)]
pub enum Updater {
    /// `value += update` (pushes are cumulative updates; no state).
    #[default]
    Add,
    /// `value -= lr · gradient` (no state).
    Sgd {
        /// Learning rate.
        lr: f32,
    },
    /// AdaGrad: `h += g²; value -= lr · g / (√h + eps)` per element, `h` starting at `init`
    /// (state: `h − init`, so that a fresh slot's zeroed state is the initial accumulator).
    Adagrad {
        /// Learning rate.
        lr: f32,
        /// Added to the denominator.
        eps: f32,
        /// The accumulator's initial value (0 in the original AdaGrad; TensorFlow uses 0.1).
        init: f32,
    },
    /// Adam with bias correction (state: first and second moments, and the step count).
    Adam {
        /// Learning rate.
        lr: f32,
        /// Decay of the first moment.
        beta1: f32,
        /// Decay of the second moment.
        beta2: f32,
        /// Added to the denominator.
        eps: f32,
    },
    /// FTRL-proximal (McMahan et al., 2013) per element, with L1 and L2 regularisation: the
    /// value is the weight the state `(z, n)` implies after each gradient (state: `z` and `n`).
    Ftrl {
        /// Learning-rate scale α.
        alpha: f32,
        /// Learning-rate smoothing β.
        beta: f32,
        /// L1 penalty λ₁ (weights whose `|z| ≤ λ₁` are exactly zero).
        l1: f32,
        /// L2 penalty λ₂.
        l2: f32,
    },
    /// A rule of the trainer's own.
    Custom(Arc<dyn UpdateRule>),
}

/// A word of a value or its state: an atomic in a slot, or a plain float.
pub(crate) trait Word {
    fn get(&self) -> f32;
    fn set(&self, x: f32);
    fn get_bits(&self) -> u32;
    fn set_bits(&self, bits: u32);
}

impl Word for AtomicU32 {
    #[inline(always)]
    fn get(&self) -> f32 {
        f32::from_bits(self.load(Ordering::Relaxed))
    }
    #[inline(always)]
    fn set(&self, x: f32) {
        self.store(x.to_bits(), Ordering::Relaxed)
    }
    #[inline(always)]
    fn get_bits(&self) -> u32 {
        self.load(Ordering::Relaxed)
    }
    #[inline(always)]
    fn set_bits(&self, bits: u32) {
        self.store(bits, Ordering::Relaxed)
    }
}

impl Word for Cell<f32> {
    #[inline(always)]
    fn get(&self) -> f32 {
        Cell::get(self)
    }
    #[inline(always)]
    fn set(&self, x: f32) {
        Cell::set(self, x)
    }
    #[inline(always)]
    fn get_bits(&self) -> u32 {
        Cell::get(self).to_bits()
    }
    #[inline(always)]
    fn set_bits(&self, bits: u32) {
        Cell::set(self, f32::from_bits(bits))
    }
}

impl Updater {
    /// AdaGrad with the usual `eps` of 1e-10 and an accumulator starting at 0.
    pub fn adagrad(lr: f32) -> Updater {
        Updater::Adagrad { lr, eps: 1e-10, init: 0.0 }
    }

    /// Adam with the usual β1 = 0.9, β2 = 0.999, eps = 1e-8.
    pub fn adam(lr: f32) -> Updater {
        Updater::Adam { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8 }
    }

    /// A user-defined rule.
    pub fn custom(rule: impl UpdateRule + 'static) -> Updater {
        Updater::Custom(Arc::new(rule))
    }

    /// Whether pushes simply add (the fast path, and the only updater replicas take).
    #[inline(always)]
    pub fn is_add(&self) -> bool {
        matches!(self, Updater::Add)
    }

    /// Floats of state per value of `value_len` floats.
    pub fn state_len(&self, value_len: usize) -> usize {
        match self {
            Updater::Add | Updater::Sgd { .. } => 0,
            Updater::Adagrad { .. } => value_len,
            Updater::Adam { .. } => 2 * value_len + 1,
            Updater::Ftrl { .. } => 2 * value_len,
            Updater::Custom(rule) => rule.state_len(value_len),
        }
    }

    /// The updater and its parameters as text (exact: floats by their bits' decimal value).
    pub fn describe(&self) -> String {
        match self {
            Updater::Add => "add".into(),
            Updater::Sgd { lr } => format!("sgd(lr={lr:?})"),
            Updater::Adagrad { lr, eps, init } => format!("adagrad(lr={lr:?},eps={eps:?},init={init:?})"),
            Updater::Adam { lr, beta1, beta2, eps } => format!("adam(lr={lr:?},beta1={beta1:?},beta2={beta2:?},eps={eps:?})"),
            Updater::Ftrl { alpha, beta, l1, l2 } => format!("ftrl(alpha={alpha:?},beta={beta:?},l1={l1:?},l2={l2:?})"),
            Updater::Custom(rule) => format!("custom:{}", rule.describe()),
        }
    }

    /// Checks the parameters: finite, positive learning rate and epsilon, decays in `[0, 1)`.
    pub fn validate(&self) -> Result<(), String> {
        let positive =
            |name: &str, x: f32| if x.is_finite() && x > 0.0 { Ok(()) } else { Err(format!("{} needs a finite {name} above 0, not {x}", self.describe())) };
        let decay = |name: &str, x: f32| if (0.0..1.0).contains(&x) { Ok(()) } else { Err(format!("{} needs {name} in [0, 1), not {x}", self.describe())) };
        match *self {
            Updater::Add | Updater::Custom(_) => Ok(()),
            Updater::Sgd { lr } => positive("lr", lr),
            Updater::Adagrad { lr, eps, init } => positive("lr", lr).and(positive("eps", eps)).and(if init.is_finite() && init >= 0.0 {
                Ok(())
            } else {
                Err(format!("{} needs a finite init of at least 0, not {init}", self.describe()))
            }),
            Updater::Adam { lr, beta1, beta2, eps } => positive("lr", lr).and(positive("eps", eps)).and(decay("beta1", beta1)).and(decay("beta2", beta2)),
            Updater::Ftrl { alpha, beta, l1, l2 } => {
                let non_negative = |name: &str, x: f32| {
                    if x.is_finite() && x >= 0.0 { Ok(()) } else { Err(format!("{} needs a finite {name} of at least 0, not {x}", self.describe())) }
                };
                positive("alpha", alpha).and(non_negative("beta", beta)).and(non_negative("l1", l1)).and(non_negative("l2", l2))
            }
        }
    }

    /// Applies one update `gradient` to a plain `value` and `state` (`state_len(value.len())`
    /// floats): what a table with this updater does to a slot, for code that keeps values of
    /// its own (a single-process baseline, a test's reference).
    pub fn apply(&self, value: &mut [f32], state: &mut [f32], gradient: &[f32]) {
        let (value, state) = (Cell::from_mut(value).as_slice_of_cells(), Cell::from_mut(state).as_slice_of_cells());
        self.apply_words(value, state, |i| gradient[i]);
    }

    /// Applies one update to a slot's words (the caller excludes every other writer: it holds
    /// the key's latch or owns the slot). `update(i)` is element `i` of the pushed update.
    #[inline(always)]
    pub(crate) fn apply_words<W: Word>(&self, values: &[W], state: &[W], update: impl Fn(usize) -> f32) {
        let load = |w: &W| w.get();
        let store = |w: &W, x: f32| w.set(x);
        match *self {
            Updater::Add => {
                for (i, x) in values.iter().enumerate() {
                    store(x, load(x) + update(i));
                }
            }
            Updater::Sgd { lr } => {
                for (i, x) in values.iter().enumerate() {
                    store(x, load(x) - lr * update(i));
                }
            }
            Updater::Adagrad { lr, eps, init } => {
                for (i, (x, h)) in values.iter().zip(state).enumerate() {
                    let g = update(i);
                    let grown = load(h) + g * g;
                    store(h, grown);
                    store(x, load(x) - lr * g / ((init + grown).sqrt() + eps));
                }
            }
            Updater::Adam { lr, beta1, beta2, eps } => {
                let n = values.len();
                let (m, rest) = state.split_at(n);
                let (v, step) = rest.split_at(n);
                // The step count is kept as an integer in a float word (exact past 2^24 steps).
                let t = step[0].get_bits().saturating_add(1);
                step[0].set_bits(t);
                let t = t.min(i32::MAX as u32) as i32;
                let (c1, c2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
                for (i, x) in values.iter().enumerate() {
                    let g = update(i);
                    let mi = beta1 * load(&m[i]) + (1.0 - beta1) * g;
                    let vi = beta2 * load(&v[i]) + (1.0 - beta2) * g * g;
                    store(&m[i], mi);
                    store(&v[i], vi);
                    store(x, load(x) - lr * (mi / c1) / ((vi / c2).sqrt() + eps));
                }
            }
            Updater::Ftrl { alpha, beta, l1, l2 } => {
                let n = values.len();
                let (z, sq) = state.split_at(n);
                for (i, x) in values.iter().enumerate() {
                    let g = update(i);
                    let (w, ni) = (load(x), load(&sq[i]));
                    let grown = ni + g * g;
                    let sigma = (grown.sqrt() - ni.sqrt()) / alpha;
                    let zi = load(&z[i]) + g - sigma * w;
                    store(&z[i], zi);
                    store(&sq[i], grown);
                    let w = if zi.abs() <= l1 { 0.0 } else { -(zi - zi.signum() * l1) / ((beta + grown.sqrt()) / alpha + l2) };
                    store(x, w);
                }
            }
            Updater::Custom(ref rule) => SCRATCH.with_borrow_mut(|(value, st, grad)| {
                value.clear();
                value.extend(values.iter().map(load));
                st.clear();
                st.extend(state.iter().map(load));
                grad.clear();
                grad.extend((0..values.len()).map(&update));
                rule.apply(value, st, grad);
                for (w, &x) in values.iter().zip(value.iter()) {
                    store(w, x);
                }
                for (w, &x) in state.iter().zip(st.iter()) {
                    store(w, x);
                }
            }),
        }
    }
}

thread_local! {
    /// Per thread, buffers for user-defined rules (they take slices; the slot's words are
    /// atomics): allocated on first use, reused after.
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

impl fmt::Debug for Updater {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

impl PartialEq for Updater {
    fn eq(&self, other: &Updater) -> bool {
        self.describe() == other.describe()
    }
}

impl Eq for Updater {}

impl std::hash::Hash for Updater {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.describe().hash(state);
    }
}

impl std::str::FromStr for Updater {
    type Err = String;

    /// Parses `add`, `sgd:LR`, `adagrad:LR[:EPS[:INIT]]`, `adam:LR[:BETA1:BETA2:EPS]` or
    /// `ftrl:ALPHA:BETA:L1:L2`.
    fn from_str(s: &str) -> Result<Updater, String> {
        let mut parts = s.split(':');
        let name = parts.next().unwrap_or_default();
        let numbers: Vec<f32> = parts.map(|p| p.parse::<f32>().map_err(|_| format!("updater '{s}': '{p}' is not a number"))).collect::<Result<_, _>>()?;
        let u = match (name, numbers.as_slice()) {
            ("add", []) => Updater::Add,
            ("sgd", [lr]) => Updater::Sgd { lr: *lr },
            ("adagrad", [lr]) => Updater::adagrad(*lr),
            ("adagrad", [lr, eps]) => Updater::Adagrad { lr: *lr, eps: *eps, init: 0.0 },
            ("adagrad", [lr, eps, init]) => Updater::Adagrad { lr: *lr, eps: *eps, init: *init },
            ("adam", [lr]) => Updater::adam(*lr),
            ("adam", [lr, beta1, beta2, eps]) => Updater::Adam { lr: *lr, beta1: *beta1, beta2: *beta2, eps: *eps },
            ("ftrl", [alpha, beta, l1, l2]) => Updater::Ftrl { alpha: *alpha, beta: *beta, l1: *l1, l2: *l2 },
            _ => return Err(format!("updater '{s}': expected add, sgd:LR, adagrad:LR[:EPS[:INIT]] adam:LR[:BETA1:BETA2:EPS] or ftrl:ALPHA:BETA:L1:L2")),
        };
        u.validate()?;
        Ok(u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(v: &[f32]) -> Vec<AtomicU32> {
        v.iter().map(|x| AtomicU32::new(x.to_bits())).collect()
    }

    fn floats(w: &[AtomicU32]) -> Vec<f32> {
        w.iter().map(|x| f32::from_bits(x.load(Ordering::Relaxed))).collect()
    }

    fn step(u: &Updater, value: &[AtomicU32], state: &[AtomicU32], g: &[f32]) {
        u.apply_words(value, state, |i| g[i]);
    }

    #[test]
    fn add_and_sgd_are_linear() {
        let v = words(&[1.0, 2.0]);
        step(&Updater::Add, &v, &[], &[0.5, -1.0]);
        assert_eq!(floats(&v), [1.5, 1.0]);
        step(&Updater::Sgd { lr: 0.5 }, &v, &[], &[1.0, -2.0]);
        assert_eq!(floats(&v), [1.0, 2.0]);
    }

    #[test]
    fn adagrad_matches_its_formula() {
        let u = Updater::Adagrad { lr: 0.1, eps: 1e-6, init: 0.1 };
        let (v, h) = (words(&[0.0]), words(&[0.0]));
        let mut x = 0.0f32;
        let mut acc = 0.1f32;
        for g in [1.0f32, -3.0, 0.5] {
            step(&u, &v, &h, &[g]);
            acc += g * g;
            x -= 0.1 * g / (acc.sqrt() + 1e-6);
        }
        assert!((floats(&h)[0] - (acc - 0.1)).abs() < 1e-6, "the state holds h − init");
        assert!((floats(&v)[0] - x).abs() < 1e-7);
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        // With bias correction the first step is lr · g / (|g| + eps): about lr in g's sign.
        let u = Updater::adam(0.01);
        let v = words(&[1.0, 1.0]);
        let state = words(&vec![0.0; u.state_len(2)]);
        step(&u, &v, &state, &[4.0, -0.2]);
        let got = floats(&v);
        assert!((got[0] - 0.99).abs() < 1e-5 && (got[1] - 1.01).abs() < 1e-5, "{got:?}");
        assert_eq!(state[4].load(Ordering::Relaxed), 1, "one step counted");
    }

    struct CountPushes;
    impl UpdateRule for CountPushes {
        fn describe(&self) -> String {
            "count".into()
        }
        fn state_len(&self, _: usize) -> usize {
            1
        }
        fn apply(&self, value: &mut [f32], state: &mut [f32], gradient: &[f32]) {
            for (x, g) in value.iter_mut().zip(gradient) {
                *x += g;
            }
            state[0] += 1.0;
        }
    }

    #[test]
    fn custom_rules_see_value_state_and_gradient() {
        let u = Updater::custom(CountPushes);
        let (v, s) = (words(&[1.0, 1.0]), words(&[0.0]));
        step(&u, &v, &s, &[1.0, 2.0]);
        step(&u, &v, &s, &[1.0, 2.0]);
        assert_eq!((floats(&v), floats(&s)), (vec![3.0, 5.0], vec![2.0]));
        assert_eq!(u.describe(), "custom:count");
    }

    #[test]
    fn ftrl_zeroes_weights_within_l1_and_plain_slices_match_slots() {
        let u = Updater::Ftrl { alpha: 0.5, beta: 1.0, l1: 1.0, l2: 0.1 };
        let (mut value, mut state) = (vec![0.0f32; 2], vec![0.0f32; u.state_len(2)]);
        u.apply(&mut value, &mut state, &[0.5, 3.0]);
        assert_eq!(value[0], 0.0, "|z| = 0.5 ≤ λ₁");
        // z = 3, n = 9: w = -(3 - 1) / ((1 + 3) / 0.5 + 0.1).
        assert!((value[1] + 2.0 / 8.1).abs() < 1e-6, "{value:?}");
        // The same steps on slot words give the same bits.
        let (v, s) = (words(&[0.0, 0.0]), words(&[0.0; 4]));
        step(&u, &v, &s, &[0.5, 3.0]);
        assert_eq!(floats(&v), value);
        assert_eq!(floats(&s), state);
        let a = Updater::adam(0.01);
        let (mut x, mut st) = (vec![1.0f32], vec![0.0f32; 3]);
        a.apply(&mut x, &mut st, &[4.0]);
        assert!((x[0] - 0.99).abs() < 1e-5 && st[2].to_bits() == 1);
    }

    #[test]
    fn parses_and_rejects() {
        assert_eq!("adagrad:0.1".parse::<Updater>().unwrap(), Updater::adagrad(0.1));
        assert_eq!("adam:0.1:0.8:0.9:1e-6".parse::<Updater>().unwrap(), Updater::Adam { lr: 0.1, beta1: 0.8, beta2: 0.9, eps: 1e-6 });
        assert!("sgd".parse::<Updater>().is_err());
        assert!("sgd:-1".parse::<Updater>().is_err());
        assert!("adam:0.1:1.0:0.9:1e-6".parse::<Updater>().is_err());
        assert!("momentum:0.1".parse::<Updater>().is_err());
        assert_eq!("ftrl:0.1:1:0.5:0".parse::<Updater>().unwrap(), Updater::Ftrl { alpha: 0.1, beta: 1.0, l1: 0.5, l2: 0.0 });
        assert!("ftrl:0.1:1:-1:0".parse::<Updater>().is_err());
    }
}
