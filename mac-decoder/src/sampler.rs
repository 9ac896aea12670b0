//! Choosing the next token from a logits row: greedy, or temperature / top-k / top-p sampling
//! from a seeded generator. Pure Rust (no MLX), so the server can share it.

use k3_protocol::eval::argmax;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Why a token could not be picked: parameters that describe no distribution, a row with
/// nothing to pick, or a constraint that failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature {0} must be a finite value >= 0")]
    Temperature(f32),
    #[error("top_p {0} must be in (0, 1]")]
    TopP(f32),
    #[error("logits row is empty or all NaN")]
    NoCandidate,
    /// The constraint's matcher refused (its message).
    #[error("grammar: {0}")]
    Grammar(String),
    #[error("the grammar allows no token")]
    NothingAllowed,
}

/// How to pick tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// `true` (or `temperature == 0`): argmax, lowest id on ties.
    pub greedy: bool,
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { greedy: true, temperature: 1.0, top_p: 1.0, top_k: 0, seed: 0 }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Rejects values that cannot describe a distribution.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        Ok(())
    }
}

/// A restriction of the next token (constrained decoding): a grammar that says which tokens may
/// come next and follows the tokens chosen.
pub trait TokenConstraint {
    /// Sets the logits of every token the constraint does not allow next to `-inf`. Errors when
    /// it allows none (or the constraint is broken).
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), SamplingError>;
    /// Records the token chosen (one the last mask allowed).
    fn commit(&mut self, token: u32) -> Result<(), SamplingError>;
}

impl<T: TokenConstraint + ?Sized> TokenConstraint for &mut T {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), SamplingError> {
        (**self).mask(logits)
    }
    fn commit(&mut self, token: u32) -> Result<(), SamplingError> {
        (**self).commit(token)
    }
}

/// A seeded sampler.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        let rng = StdRng::seed_from_u64(params.seed);
        Ok(Sampler { params, rng })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token id from one logits row.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        let p = &self.params;
        if p.greedy || p.temperature == 0.0 {
            return argmax(logits).map(|i| i as u32).ok_or(SamplingError::NoCandidate);
        }
        // candidates sorted by logit, descending (stable: lower id first on ties)
        let mut idx: Vec<usize> = (0..logits.len()).filter(|&i| !logits[i].is_nan()).collect();
        if idx.is_empty() {
            return Err(SamplingError::NoCandidate);
        }
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if p.top_k > 0 && p.top_k < idx.len() {
            idx.truncate(p.top_k);
        }
        let max = logits[idx[0]];
        let mut probs: Vec<f64> = idx.iter().map(|&i| (((logits[i] - max) / p.temperature) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (n, &x) in probs.iter().enumerate() {
                acc += x;
                if acc >= p.top_p as f64 {
                    keep = n + 1;
                    break;
                }
            }
            probs.truncate(keep);
            idx.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= total);
        }
        let r: f64 = self.rng.gen::<f64>();
        let mut acc = 0.0;
        for (n, &x) in probs.iter().enumerate() {
            acc += x;
            if r < acc {
                return Ok(idx[n] as u32);
            }
        }
        Ok(*idx.last().expect("non-empty") as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_lowest_index_of_the_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0]).unwrap(), 1);
        assert_eq!(s.sample(&[f32::NAN, -2.0, -1.0]).unwrap(), 2);
        assert!(s.sample(&[]).is_err());
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_repeat() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams { greedy: false, temperature: 0.8, top_k: 1, ..Default::default() };
        let mut s = Sampler::new(p).unwrap();
        let g = argmax(&logits).unwrap() as u32;
        for _ in 0..20 {
            assert_eq!(s.sample(&logits).unwrap(), g);
        }
        let p = SamplingParams { greedy: false, temperature: 1.0, seed: 7, ..Default::default() };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone()).unwrap();
            (0..30).map(|_| s.sample(&logits).unwrap()).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p).unwrap();
            (0..30).map(|_| s.sample(&logits).unwrap()).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 1, "sampling at T=1 should vary");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // probabilities ~ [0.7, 0.2, 0.1]: top_p 0.6 keeps only token 0, 0.85 keeps 0 and 1
        let logits = [0.7f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        let mut s = Sampler::new(SamplingParams { greedy: false, top_p: 0.6, seed: 3, ..Default::default() }).unwrap();
        assert!((0..100).all(|_| s.sample(&logits).unwrap() == 0));
        let mut s = Sampler::new(SamplingParams { greedy: false, top_p: 0.85, seed: 3, ..Default::default() }).unwrap();
        let seen: std::collections::HashSet<u32> = (0..300).map(|_| s.sample(&logits).unwrap()).collect();
        assert_eq!(seen, [0u32, 1].into_iter().collect());
    }

    #[test]
    fn bad_params_are_rejected() {
        assert!(Sampler::new(SamplingParams { temperature: -1.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingParams { top_p: 0.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplingParams { top_p: f32::NAN, ..Default::default() }).is_err());
    }
}
