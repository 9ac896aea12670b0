//! The decode loop — the one both `k3-decode generate` ([`crate::decode::Engine::generate`]) and
//! the server's engine thread (`engine::scheduler`) run: sample from the last logits, report the
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

/// Why the decode loop ended: the loop's own reason, which the server turns into the reply's
/// client-facing [`crate::chat::parse::FinishReason`] (`stop` / `tool_calls` / `length`) once
/// the chat parser has seen the output. A separate type because `Cancelled` never reaches a
/// client and `tool_calls` is not the loop's to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopEnd {
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
    pub finish: LoopEnd,
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

/// Several sequences decoded together: the decode loop's batched form. A model that can run
/// one step for many sequences at once (the server's continuous batching) feeds them in one
/// call; [`TokenStep`] is the batch of one.
pub trait BatchStep {
    /// Logits predicting sequence `i`'s next token (`None` before a prefill).
    fn next_logits(&self, i: usize) -> Option<&[f32]>;
    /// Feeds `tokens[j]` to sequence `seqs[j]` (ascending, distinct), as one step.
    fn feed(&mut self, seqs: &[usize], tokens: &[u32]) -> Result<()>;
}

/// A single sequence as a batch of one.
struct One<'a, T: TokenStep>(&'a mut T);

impl<T: TokenStep> BatchStep for One<'_, T> {
    fn next_logits(&self, _: usize) -> Option<&[f32]> {
        self.0.next_logits()
    }
    fn feed(&mut self, _: &[usize], tokens: &[u32]) -> Result<()> {
        tokens.iter().try_for_each(|&t| self.0.feed(t))
    }
}

/// One sequence's place in the decode loop: its sampler (own seed), constraint, the tokens
/// emitted, and why it ended.
pub struct Decoding<'c> {
    params: GenerateParams,
    sampler: Sampler,
    constraint: Option<Box<dyn TokenConstraint + 'c>>,
    scratch: Vec<f32>,
    tokens: Vec<u32>,
    started: Instant,
    mask_time: Duration,
    finish: Option<LoopEnd>,
    /// Why the sequence failed (a sampling or constraint error of its own).
    failed: Option<anyhow::Error>,
}

impl<'c> Decoding<'c> {
    pub fn new(params: GenerateParams, constraint: Option<Box<dyn TokenConstraint + 'c>>) -> Result<Self> {
        let sampler = Sampler::new(params.sampling.clone()).map_err(|e| anyhow!("sampling parameters: {e}"))?;
        let finish = (params.max_new_tokens == 0).then_some(LoopEnd::Length);
        let cap = params.max_new_tokens.min(4096);
        Ok(Decoding {
            params,
            sampler,
            constraint,
            scratch: Vec::new(),
            tokens: Vec::with_capacity(cap),
            started: Instant::now(),
            mask_time: Duration::ZERO,
            finish,
            failed: None,
        })
    }

    /// Done: finished (why) or failed.
    pub fn done(&self) -> bool {
        self.finish.is_some() || self.failed.is_some()
    }

    /// The tokens emitted so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// What the sequence produced, or the error that ended it.
    pub fn into_output(self) -> Result<GenerateOutput> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let out = GenerateOutput {
            tokens: self.tokens,
            finish: self.finish.unwrap_or(LoopEnd::Cancelled),
            decode_time: self.started.elapsed(),
            mask_time: self.mask_time,
        };
        tracing::debug!(tokens = out.tokens.len(), tok_per_s = out.tokens_per_second(), finish = ?out.finish, mask_s = out.mask_time.as_secs_f64(), "decode");
        Ok(out)
    }

    /// Picks the next token from `logits` (masked by the constraint, which follows it).
    fn choose(&mut self, logits: Option<&[f32]>) -> Result<Emitted> {
        let logits = logits.ok_or_else(|| anyhow!("the session has no logits to sample from: prefill or ingest (with logits) first"))?;
        let tok = match self.constraint.as_deref_mut() {
            None => self.sampler.sample(logits).map_err(|e| anyhow!("sampling: {e}"))?,
            Some(c) => {
                self.scratch.clear();
                self.scratch.extend_from_slice(logits);
                let tm = Instant::now();
                c.mask(&mut self.scratch).map_err(|e| anyhow!("constrained decoding: {e}"))?;
                self.mask_time += tm.elapsed();
                let tok = self.sampler.sample(&self.scratch).map_err(|e| anyhow!("sampling: {e}"))?;
                c.commit(tok).map_err(|e| anyhow!("constrained decoding: {e}"))?;
                tok
            }
        };
        let (logprob, top) = match self.params.logprobs {
            Some(k) => {
                let (lp, top) = logprobs_of(logits, tok, k);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        Ok(Emitted { token: tok, logprob, top })
    }

    /// Records an emitted token (it is fed next) and whether the caller wants more.
    fn record(&mut self, tok: u32, go_on: bool) {
        self.tokens.push(tok);
        if self.params.stop_tokens.contains(&tok) {
            self.finish = Some(LoopEnd::Stop);
        } else if !go_on {
            self.finish = Some(LoopEnd::Cancelled);
        } else if self.tokens.len() >= self.params.max_new_tokens {
            self.finish = Some(LoopEnd::Length);
        }
    }
}

/// The decode loop's step, over any number of sequences: each one not done samples from its
/// logits and reports the token to `on_token(i, ..)` (false stops that sequence); then every
/// emitted token is fed, all in one [`BatchStep::feed`]. Every emitted token is fed, so a
/// sequence afterwards holds its prompt and the output. A sequence whose own sampling fails
/// ends failed (see [`Decoding::into_output`]); an error of the shared feed is returned.
pub fn decode_step(batch: &mut impl BatchStep, seqs: &mut [&mut Decoding<'_>], mut on_token: impl FnMut(usize, &Emitted) -> bool) -> Result<()> {
    let mut fed = Vec::with_capacity(seqs.len());
    let mut toks = Vec::with_capacity(seqs.len());
    for (i, d) in seqs.iter_mut().enumerate() {
        if d.done() {
            continue;
        }
        match d.choose(batch.next_logits(i)) {
            Ok(e) => {
                let go_on = on_token(i, &e);
                d.record(e.token, go_on);
                fed.push(i);
                toks.push(e.token);
            }
            Err(e) => d.failed = Some(e),
        }
    }
    if fed.is_empty() {
        return Ok(());
    }
    batch.feed(&fed, &toks)
}

/// The decode loop on one sequence: samples from `seq`'s logits, reports each token to
/// `on_token` (return false to stop), feeds it, until `max_new_tokens` or a stop token.
pub fn generate(seq: &mut impl TokenStep, params: &GenerateParams, mut on_token: impl FnMut(u32) -> bool) -> Result<GenerateOutput> {
    generate_constrained(seq, params, None, |e| on_token(e.token))
}

/// [`generate`] with the tokens restricted by `constraint` (constrained decoding): each step
/// masks the logits before sampling and commits the chosen token to the constraint.
pub fn generate_constrained(
    seq: &mut impl TokenStep,
    params: &GenerateParams,
    constraint: Option<&mut dyn TokenConstraint>,
    mut on_token: impl FnMut(&Emitted) -> bool,
) -> Result<GenerateOutput> {
    let mut d = Decoding::new(params.clone(), constraint.map(|c| Box::new(c) as Box<dyn TokenConstraint + '_>))?;
    let mut one = One(seq);
    while !d.done() {
        decode_step(&mut one, &mut [&mut d], |_, e| on_token(e))?;
    }
    d.into_output()
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
        assert_eq!((out.tokens.clone(), out.finish), (vec![2, 3, 4], LoopEnd::Length));
        assert_eq!(c.fed, out.tokens);

        let mut c = counter();
        let p = GenerateParams { stop_tokens: vec![5], ..GenerateParams::greedy(10) };
        let out = generate(&mut c, &p, |_| true).unwrap();
        assert_eq!((out.tokens.clone(), out.finish), (vec![2, 3, 4, 5], LoopEnd::Stop));
        assert_eq!(c.fed, out.tokens);

        let mut c = counter();
        let out = generate(&mut c, &GenerateParams::greedy(10), |t| t != 3).unwrap();
        assert_eq!((out.tokens.clone(), out.finish), (vec![2, 3], LoopEnd::Cancelled));
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
            fn mask(&mut self, logits: &mut [f32]) -> Result<(), crate::sampler::SamplingError> {
                logits.iter_mut().step_by(2).for_each(|x| *x = f32::NEG_INFINITY);
                Ok(())
            }
            fn commit(&mut self, token: u32) -> Result<(), crate::sampler::SamplingError> {
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

    /// Counters stepped together, fed through one batched call.
    struct Counters {
        seqs: Vec<Counter>,
        feeds: Vec<Vec<usize>>,
    }
    impl BatchStep for Counters {
        fn next_logits(&self, i: usize) -> Option<&[f32]> {
            self.seqs[i].next_logits()
        }
        fn feed(&mut self, seqs: &[usize], tokens: &[u32]) -> Result<()> {
            self.feeds.push(seqs.to_vec());
            seqs.iter().zip(tokens).try_for_each(|(&i, &t)| self.seqs[i].feed(t))
        }
    }

    #[test]
    fn a_batch_steps_each_sequence_as_alone() {
        let params = [
            GenerateParams::greedy(3),
            GenerateParams { stop_tokens: vec![4], ..GenerateParams::greedy(10) },
            GenerateParams { logprobs: Some(1), ..GenerateParams::greedy(5) },
        ];
        let alone: Vec<GenerateOutput> = params.iter().map(|p| generate(&mut counter(), p, |_| true).unwrap()).collect();
        let mut batch = Counters { seqs: (0..3).map(|_| counter()).collect(), feeds: vec![] };
        let mut decs: Vec<Decoding> = params.iter().map(|p| Decoding::new(p.clone(), None).unwrap()).collect();
        let mut seen = vec![Vec::new(); 3];
        while decs.iter().any(|d| !d.done()) {
            let mut refs: Vec<&mut Decoding> = decs.iter_mut().collect();
            decode_step(&mut batch, &mut refs, |i, e| {
                seen[i].push(e.token);
                true
            })
            .unwrap();
        }
        for (i, d) in decs.into_iter().enumerate() {
            let out = d.into_output().unwrap();
            assert_eq!((&out.tokens, out.finish), (&alone[i].tokens, alone[i].finish), "sequence {i}");
            assert_eq!(seen[i], out.tokens);
            assert_eq!(batch.seqs[i].fed, out.tokens);
        }
        // one feed call per step, the finished sequences dropping out
        assert_eq!(batch.feeds, vec![vec![0, 1, 2], vec![0, 1, 2], vec![0, 1, 2], vec![2], vec![2]]);
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
