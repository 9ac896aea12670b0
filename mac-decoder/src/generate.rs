//! The decode loop — the one both `k3-decode generate` ([`crate::decode::Engine::generate`]) and
//! the server's engine thread (`server::worker`) run: sample from the last logits, report the
//! token, feed it, until `max_new_tokens`, a stop token, or the caller says stop.
//!
//! Pure Rust (no MLX): a model plugs in through [`TokenStep`] (the logits predicting the next
//! token, and feeding one token).

use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use crate::sampler::{Sampler, SamplingParams, TokenConstraint};

/// A sequence being decoded: its next-token logits and a way to feed a token.
pub trait TokenStep {
    /// Logits predicting the next token (`None` before a prefill).
    fn next_logits(&self) -> Option<&[f32]>;
    /// Feeds one token; afterwards [`Self::next_logits`] predicts the one after it.
    fn feed(&mut self, token: u32) -> Result<()>;
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends after emitting one of these (it is emitted and fed).
    pub stop_tokens: Vec<u32>,
    /// Report each token's log-probability and this many most likely alternatives
    /// (`Some(0)`: the chosen token's only); `None`: none.
    pub logprobs: Option<usize>,
}

impl GenerateParams {
    pub fn greedy(max_new_tokens: usize) -> Self {
        GenerateParams { max_new_tokens, sampling: SamplingParams::greedy(), stop_tokens: Vec::new(), logprobs: None }
    }
}

/// One token the loop emitted.
#[derive(Debug, Clone, PartialEq)]
pub struct Emitted {
    pub token: u32,
    /// Its log-probability under the model's distribution (the raw logits' log-softmax, before
    /// temperature, top-p and constraints), when asked for.
    pub logprob: Option<f32>,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}

/// The chosen token's log-probability and the `top` best `(id, logprob)` of a logits row.
pub fn logprobs_of(logits: &[f32], token: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().filter(|x| !x.is_nan()).map(|&x| ((x - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |x: f32| (x as f64 - lse) as f32;
    let chosen = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&x| lp(x));
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &x) in logits.iter().enumerate() {
            if x.is_nan() || (best.len() == top && x <= best[top - 1].1) {
                continue;
            }
            let at = best.partition_point(|&(_, y)| y >= x);
            best.insert(at, (i as u32, x));
            best.truncate(top);
        }
    }
    (chosen, best.into_iter().map(|(i, x)| (i, lp(x))).collect())
}

/// Why the loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop token was emitted.
    Stop,
    /// `on_token` returned false.
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    /// Time spent in decode steps (sampling included).
    pub decode_time: Duration,
    /// Part of `decode_time` spent computing constraint masks.
    pub mask_time: Duration,
}

impl GenerateOutput {
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens.len() as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// The decode loop: samples from `seq`'s logits, reports each token to `on_token` (return false
/// to stop), feeds it, until `max_new_tokens` or a stop token. Every emitted token is fed, so
/// the sequence afterwards holds its prompt and the output.
pub fn generate(seq: &mut impl TokenStep, params: &GenerateParams, mut on_token: impl FnMut(u32) -> bool) -> Result<GenerateOutput> {
    generate_constrained(seq, params, None, |e| on_token(e.token))
}

/// [`generate`] with the tokens restricted by `constraint` (constrained decoding): each step
/// masks the logits before sampling and commits the chosen token to the constraint.
pub fn generate_constrained(
    seq: &mut impl TokenStep,
    params: &GenerateParams,
    mut constraint: Option<&mut dyn TokenConstraint>,
    mut on_token: impl FnMut(&Emitted) -> bool,
) -> Result<GenerateOutput> {
    let mut sampler = Sampler::new(params.sampling.clone()).map_err(|e| anyhow!("sampling parameters: {e}"))?;
    let t0 = Instant::now();
    let mut mask_time = Duration::ZERO;
    let mut scratch = Vec::new();
    let mut tokens = Vec::with_capacity(params.max_new_tokens.min(4096));
    let mut finish = FinishReason::Length;
    while tokens.len() < params.max_new_tokens {
        let logits = seq
            .next_logits()
            .ok_or_else(|| anyhow!("the session has no logits to sample from: prefill or ingest (with logits) first"))?;
        let tok = match constraint.as_deref_mut() {
            None => sampler.sample(logits).map_err(|e| anyhow!("sampling: {e}"))?,
            Some(c) => {
                scratch.clear();
                scratch.extend_from_slice(logits);
                let tm = Instant::now();
                c.mask(&mut scratch).map_err(|e| anyhow!("constrained decoding: {e}"))?;
                mask_time += tm.elapsed();
                let tok = sampler.sample(&scratch).map_err(|e| anyhow!("sampling: {e}"))?;
                c.commit(tok).map_err(|e| anyhow!("constrained decoding: {e}"))?;
                tok
            }
        };
        let (logprob, top) = match params.logprobs {
            Some(k) => {
                let (lp, top) = logprobs_of(logits, tok, k);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        tokens.push(tok);
        let go_on = on_token(&Emitted { token: tok, logprob, top });
        seq.feed(tok)?;
        if params.stop_tokens.contains(&tok) {
            finish = FinishReason::Stop;
            break;
        }
        if !go_on {
            finish = FinishReason::Cancelled;
            break;
        }
    }
    let out = GenerateOutput { tokens, finish, decode_time: t0.elapsed(), mask_time };
    tracing::debug!(tokens = out.tokens.len(), tok_per_s = out.tokens_per_second(), ?finish, mask_s = mask_time.as_secs_f64(), "decode");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits one-hot at (last fed token + 1) mod vocab.
    struct Counter {
        fed: Vec<u32>,
        logits: Vec<f32>,
    }
    impl TokenStep for Counter {
        fn next_logits(&self) -> Option<&[f32]> {
            Some(&self.logits)
        }
        fn feed(&mut self, token: u32) -> Result<()> {
            self.fed.push(token);
            self.logits = vec![0.0; 8];
            self.logits[(token as usize + 1) % 8] = 5.0;
            Ok(())
        }
    }

    fn counter() -> Counter {
        let mut logits = vec![0.0; 8];
        logits[2] = 5.0;
        Counter { fed: vec![], logits }
    }

    #[test]
    fn stops_at_length_stop_token_and_cancel_and_feeds_every_token() {
        let mut c = counter();
        let out = generate(&mut c, &GenerateParams::greedy(3), |_| true).unwrap();
        assert_eq!((out.tokens.clone(), out.finish), (vec![2, 3, 4], FinishReason::Length));
        assert_eq!(c.fed, out.tokens);

        let mut c = counter();
        let p = GenerateParams { stop_tokens: vec![5], ..GenerateParams::greedy(10) };
        let out = generate(&mut c, &p, |_| true).unwrap();
        assert_eq!((out.tokens.clone(), out.finish), (vec![2, 3, 4, 5], FinishReason::Stop));
        assert_eq!(c.fed, out.tokens);

        let mut c = counter();
        let out = generate(&mut c, &GenerateParams::greedy(10), |t| t != 3).unwrap();
        assert_eq!((out.tokens.clone(), out.finish), (vec![2, 3], FinishReason::Cancelled));
        assert_eq!(c.fed, out.tokens);
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_top_is_sorted() {
        let logits = [1.0f32, 3.0, 2.0, f32::NAN, 3.0];
        let (lp, top) = logprobs_of(&logits, 2, 3);
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0].iter().map(|x| x.exp()).sum();
        assert!((lp as f64 - (2.0 - z.ln())).abs() < 1e-5);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 4, 2]);
        assert!((top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-5);
        let mut c = counter();
        let p = GenerateParams { logprobs: Some(2), ..GenerateParams::greedy(2) };
        let mut seen = Vec::new();
        generate_constrained(&mut c, &p, None, |e| {
            seen.push(e.clone());
            true
        })
        .unwrap();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].top[0].0, seen[0].token);
        assert!(seen[0].logprob.unwrap() < 0.0 && seen[0].top.len() == 2);
    }

    #[test]
    fn a_constraint_masks_every_step() {
        /// Allows only odd ids.
        struct Odd(Vec<u32>);
        impl TokenConstraint for Odd {
            fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
                logits.iter_mut().step_by(2).for_each(|x| *x = f32::NEG_INFINITY);
                Ok(())
            }
            fn commit(&mut self, token: u32) -> Result<(), String> {
                self.0.push(token);
                Ok(())
            }
        }
        let mut c = counter(); // would emit 2, 3, 4, ... unconstrained
        let mut odd = Odd(vec![]);
        let out = generate_constrained(&mut c, &GenerateParams::greedy(4), Some(&mut odd), |_| true).unwrap();
        assert!(out.tokens.iter().all(|t| t % 2 == 1), "{:?}", out.tokens);
        assert_eq!(odd.0, out.tokens);
    }

    #[test]
    fn no_logits_is_an_error() {
        struct Empty;
        impl TokenStep for Empty {
            fn next_logits(&self) -> Option<&[f32]> {
                None
            }
            fn feed(&mut self, _: u32) -> Result<()> {
                Ok(())
            }
        }
        assert!(generate(&mut Empty, &GenerateParams::greedy(1), |_| true).is_err());
    }
}
