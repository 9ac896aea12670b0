//! How engines are compared on a trained model (issue 15): perplexity of held-out text, top-1
//! agreement with a reference engine, the unigram baseline, and greedy continuations compared
//! with the rule vLLM uses between engines (where two greedy runs first differ, each engine's
//! token must be among the other's top-5 at that position).
//!
//! Pure arithmetic on logits rows (f64 sums): the CPU executor, CUDA and MLX tests all feed it.
//! The held-out text and its token ids live with the model (`tests/models/tiny-t/heldout.json`,
//! see [`HeldOut`]).

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Why logits could not be scored, or why an engine is outside its agreement bounds.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EvalError {
    #[error("{logits} logits for {targets} targets of a {vocab}-token vocabulary")]
    Shape { logits: usize, targets: usize, vocab: usize },
    #[error("target {target} outside a {vocab}-token row")]
    TargetOutOfRange { target: u32, vocab: usize },
    #[error("non-finite logit {value} at id {id}")]
    NonFinite { id: usize, value: f32 },
    #[error("row {row}: {source}")]
    Row { row: usize, source: Box<EvalError> },
    #[error(
        "{}: perplexity {:.4} vs reference {:.4} (Δ {:+.4} %, bound ±{max_delta_pct} %), top-1 agreement {:.2} % (bound ≥ {:.2} %) over {} positions",
        agreement.engine,
        agreement.ppl,
        agreement.reference_ppl,
        agreement.delta_ppl_pct,
        agreement.top1 * 100.0,
        min_top1 * 100.0,
        agreement.positions
    )]
    OutOfBounds { agreement: Box<Agreement>, max_delta_pct: f64, min_top1: f64 },
}

/// Natural-log loss and argmax of each position of one engine's logits on a token sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    /// `-log p(target)` per scored position.
    pub nll: Vec<f64>,
    /// The argmax (lowest id on ties, as greedy sampling) per scored position.
    pub top1: Vec<u32>,
}

impl Scores {
    /// `logits`: `targets.len()` rows of `vocab` values, row-major; row `i` is the prediction
    /// for `targets[i]`. Fails (naming the row) on a non-finite value, a length mismatch or a
    /// target outside the vocabulary.
    pub fn from_logits(logits: &[f32], vocab: usize, targets: &[u32]) -> Result<Scores, EvalError> {
        if vocab == 0 || logits.len() != vocab * targets.len() {
            return Err(EvalError::Shape { logits: logits.len(), targets: targets.len(), vocab });
        }
        let mut s = Scores { nll: Vec::with_capacity(targets.len()), top1: Vec::with_capacity(targets.len()) };
        for (i, (row, &t)) in logits.chunks_exact(vocab).zip(targets).enumerate() {
            s.push(row, t).map_err(|e| EvalError::Row { row: i, source: Box::new(e) })?;
        }
        Ok(s)
    }

    /// Appends one position: the logits row predicting `target`.
    pub fn push(&mut self, row: &[f32], target: u32) -> Result<(), EvalError> {
        if target as usize >= row.len() {
            return Err(EvalError::TargetOutOfRange { target, vocab: row.len() });
        }
        if let Some(j) = row.iter().position(|x| !x.is_finite()) {
            return Err(EvalError::NonFinite { id: j, value: row[j] });
        }
        self.nll.push(logsumexp(row) - row[target as usize] as f64);
        self.top1.push(argmax(row).map_or(0, |i| i as u32));
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.nll.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nll.is_empty()
    }

    /// `exp(mean nll)`.
    pub fn perplexity(&self) -> f64 {
        perplexity(&self.nll)
    }

    /// Fraction of positions whose argmax equals `reference`'s.
    pub fn top1_agreement(&self, reference: &Scores) -> f64 {
        assert_eq!(self.len(), reference.len(), "top-1 agreement over different position counts");
        let same = self.top1.iter().zip(&reference.top1).filter(|(a, b)| a == b).count();
        same as f64 / self.len().max(1) as f64
    }
}

/// `exp(mean of nll)` (1 for no positions).
pub fn perplexity(nll: &[f64]) -> f64 {
    if nll.is_empty() {
        return 1.0;
    }
    (nll.iter().sum::<f64>() / nll.len() as f64).exp()
}

/// `log Σ exp(x)` in f64.
pub fn logsumexp(row: &[f32]) -> f64 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
}

/// Index of the largest value, the lowest on ties; NaNs are skipped (`None` for an empty or
/// all-NaN row). The one greedy pick of the workspace: the decoder's sampler, the prefill
/// node's greedy continuation and the evaluation scores use it.
pub fn argmax(row: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// The `k` largest ids, largest first (lower id first on ties).
pub fn top_k(row: &[f32], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..row.len() as u32).filter(|&i| !row[i as usize].is_nan()).collect();
    ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    ids.truncate(k);
    ids
}

/// Perplexity of `ids` under their own unigram distribution (counts estimated on `ids`):
/// the baseline a language model must beat.
pub fn unigram_perplexity(ids: &[u32]) -> f64 {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &t in ids {
        *counts.entry(t).or_default() += 1;
    }
    let n = ids.len() as f64;
    let entropy: f64 = counts.values().map(|&c| -(c as f64 / n) * (c as f64 / n).ln()).sum();
    entropy.exp()
}

/// One engine against the reference on the same positions.
#[derive(Debug, Clone, PartialEq)]
pub struct Agreement {
    pub engine: String,
    pub positions: usize,
    pub ppl: f64,
    pub reference_ppl: f64,
    /// `(ppl − reference) / reference`, in percent.
    pub delta_ppl_pct: f64,
    /// Fraction of positions with the reference's argmax.
    pub top1: f64,
}

impl Agreement {
    pub fn new(engine: &str, scores: &Scores, reference: &Scores) -> Agreement {
        let (ppl, reference_ppl) = (scores.perplexity(), reference.perplexity());
        Agreement {
            engine: engine.to_string(),
            positions: scores.len(),
            ppl,
            reference_ppl,
            delta_ppl_pct: (ppl - reference_ppl) / reference_ppl * 100.0,
            top1: scores.top1_agreement(reference),
        }
    }

    /// `Err` naming the engine and the numbers when `|Δppl| > max_delta_pct` or the top-1
    /// agreement is below `min_top1`.
    pub fn check(&self, max_delta_pct: f64, min_top1: f64) -> Result<(), EvalError> {
        if self.delta_ppl_pct.abs() <= max_delta_pct && self.top1 >= min_top1 {
            Ok(())
        } else {
            Err(EvalError::OutOfBounds { agreement: Box::new(self.clone()), max_delta_pct, min_top1 })
        }
    }

    /// The header of [`Agreement`]'s `Display` rows (a Markdown table).
    pub const TABLE_HEADER: &'static str = "| engine | positions | ppl | Δppl % | top-1 agreement |\n|---|---|---|---|---|";
}

impl fmt::Display for Agreement {
    /// One Markdown table row.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "| {} | {} | {:.4} | {:+.4} | {:.2} % |", self.engine, self.positions, self.ppl, self.delta_ppl_pct, self.top1 * 100.0)
    }
}

/// A greedy continuation with the top-5 ids of every step's logits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GreedyRun {
    pub tokens: Vec<u32>,
    pub top5: Vec<Vec<u32>>,
}

impl GreedyRun {
    /// Records the step whose logits are `row`; returns the greedy token (argmax, lowest id on ties).
    pub fn push(&mut self, row: &[f32]) -> u32 {
        let top5 = top_k(row, 5);
        let tok = argmax(row).map_or(0, |i| i as u32);
        self.tokens.push(tok);
        self.top5.push(top5);
        tok
    }
}

/// Where two greedy runs first differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    pub position: usize,
    pub a: u32,
    pub b: u32,
    /// `a`'s token is among `b`'s top-5 at that position.
    pub a_in_b_top5: bool,
    pub b_in_a_top5: bool,
}

impl Divergence {
    /// vLLM's rule: each engine's token is in the other's top-5.
    pub fn acceptable(&self) -> bool {
        self.a_in_b_top5 && self.b_in_a_top5
    }
}

/// The first position where `a` and `b` chose different tokens (`None`: equal over the shorter run).
pub fn first_divergence(a: &GreedyRun, b: &GreedyRun) -> Option<Divergence> {
    let i = a.tokens.iter().zip(&b.tokens).position(|(x, y)| x != y)?;
    Some(Divergence {
        position: i,
        a: a.tokens[i],
        b: b.tokens[i],
        a_in_b_top5: b.top5[i].contains(&a.tokens[i]),
        b_in_a_top5: a.top5[i].contains(&b.tokens[i]),
    })
}

/// The held-out evaluation text of a trained test model and its token ids under the model's
/// own tokenizer (`heldout.json` next to the weights): `{"source", "text", "ids"}`. The ids are
/// stored so that engines without a tokenizer (the CUDA tests) read the same input; a test in
/// `k3-e2e-tests` checks they equal the tokenizer's encoding of `text`.
#[derive(Debug, Clone, Deserialize)]
pub struct HeldOut {
    /// Where the text comes from and why the model has not seen it.
    pub source: String,
    pub text: String,
    pub ids: Vec<u32>,
}

impl HeldOut {
    pub const FILE: &'static str = "heldout.json";

    /// Reads `dir/heldout.json`.
    pub fn load(dir: &Path) -> anyhow::Result<HeldOut> {
        let path = dir.join(Self::FILE);
        let bytes = std::fs::read(&path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        let h: HeldOut = serde_json::from_slice(&bytes).map_err(|e| anyhow::anyhow!("parsing {}: {e}", path.display()))?;
        if h.ids.len() < 2 {
            anyhow::bail!("{}: {} held-out ids, need at least 2", path.display(), h.ids.len());
        }
        Ok(h)
    }

    /// The first `n` ids (all when fewer): the perplexity sequence.
    pub fn sequence(&self, n: usize) -> &[u32] {
        &self.ids[..n.min(self.ids.len())]
    }

    /// `count` prompts of `len` ids, starting at evenly spaced offsets of the held-out ids.
    pub fn prompts(&self, count: usize, len: usize) -> Vec<&[u32]> {
        let span = self.ids.len().saturating_sub(len);
        (0..count).map(|i| &self.ids[span * i / count.max(1)..][..len.min(self.ids.len())]).collect()
    }
}

/// The trained test model: `$K3_TINY_T_DIR`, else this workspace's `tests/models/tiny-t`.
pub fn tiny_t_dir() -> PathBuf {
    std::env::var_os("K3_TINY_T_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("tests").join("models").join("tiny-t"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perplexity_of_uniform_logits_is_the_vocabulary() {
        let s = Scores::from_logits(&[0.0; 8 * 3], 8, &[1, 5, 7]).unwrap();
        assert!((s.perplexity() - 8.0).abs() < 1e-9);
        assert!((logsumexp(&[1000.0, 1000.0]) - (1000.0 + 2f64.ln())).abs() < 1e-9, "stable for large logits");
    }

    #[test]
    fn loss_and_argmax_per_row() {
        // row 0 predicts 2 with p = e^2 / (1 + 1 + e^2); row 1 ties at 0 and 1: lowest id.
        let s = Scores::from_logits(&[0.0, 0.0, 2.0, 3.0, 3.0, 0.0], 3, &[2, 2]).unwrap();
        let p0 = 2f64.exp() / (2.0 + 2f64.exp());
        assert!((s.nll[0] + p0.ln()).abs() < 1e-12);
        assert_eq!(s.top1, vec![2, 0]);
        assert!(Scores::from_logits(&[0.0, f32::NAN], 2, &[0]).unwrap_err().to_string().contains("row 0"));
        assert!(Scores::from_logits(&[0.0, 1.0], 2, &[2]).is_err());
        assert!(Scores::from_logits(&[0.0; 3], 2, &[0]).is_err());
    }

    #[test]
    fn agreement_and_bounds() {
        let r = Scores { nll: vec![1.0, 1.0, 1.0, 1.0], top1: vec![1, 2, 3, 4] };
        let e = Scores { nll: vec![1.0, 1.0, 1.0, 1.004], top1: vec![1, 2, 3, 9] };
        let a = Agreement::new("x", &e, &r);
        assert!((a.delta_ppl_pct - ((0.001f64).exp() - 1.0) * 100.0).abs() < 1e-9);
        assert_eq!(a.top1, 0.75);
        assert!(a.check(0.2, 0.75).is_ok());
        assert!(a.check(0.05, 0.0).unwrap_err().to_string().contains("x: perplexity"));
        assert!(a.check(1.0, 0.98).unwrap_err().to_string().contains("75.00 %"));
        assert!(a.to_string().starts_with("| x | 4 |"));
    }

    #[test]
    fn unigram_baseline() {
        assert!((unigram_perplexity(&[1, 2, 3, 4]) - 4.0).abs() < 1e-9);
        assert!((unigram_perplexity(&[7, 7, 7]) - 1.0).abs() < 1e-12);
        // p = (1/2, 1/4, 1/4): H = 1.5 bits
        assert!((unigram_perplexity(&[1, 1, 2, 3]) - 2f64.powf(1.5)).abs() < 1e-9);
    }

    #[test]
    fn top_k_orders_and_breaks_ties_by_id() {
        assert_eq!(top_k(&[0.5, 2.0, 2.0, -1.0, 1.0, 3.0], 5), vec![5, 1, 2, 4, 0]);
        assert_eq!(top_k(&[1.0, f32::NAN], 5), vec![0]);
    }

    #[test]
    fn divergence_rule() {
        let mut a = GreedyRun::default();
        let mut b = GreedyRun::default();
        assert_eq!(a.push(&[0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0]), 1);
        assert_eq!(b.push(&[0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0]), 1);
        assert_eq!(first_divergence(&a, &b), None);
        // step 2: a picks 2 (b's second), b picks 1 (a's second): acceptable
        a.push(&[0.0, 4.0, 5.0, 0.0, 0.0, 0.0, 0.0]);
        b.push(&[0.0, 5.0, 4.9, 0.0, 0.0, 0.0, 0.0]);
        let d = first_divergence(&a, &b).unwrap();
        assert_eq!((d.position, d.a, d.b), (1, 2, 1));
        assert!(d.acceptable());
        // a token outside the other's top-5 is not
        let mut c = GreedyRun::default();
        c.push(&[0.0, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0]);
        c.push(&[9.0, 1.0, -1.0, 3.0, 4.0, 5.0, 6.0]);
        let d = first_divergence(&a, &c).unwrap();
        assert_eq!((d.a, d.b), (2, 0));
        assert!(!d.a_in_b_top5 && d.b_in_a_top5 && !d.acceptable(), "{d:?}");
    }

    #[test]
    fn prompts_are_spread_over_the_text() {
        let h = HeldOut { source: String::new(), text: String::new(), ids: (0..100).collect() };
        let p = h.prompts(4, 10);
        assert_eq!(p.len(), 4);
        assert_eq!(p[0], &(0..10).collect::<Vec<u32>>()[..]);
        assert_eq!(p[3][0], 67);
        assert!(p.iter().all(|x| x.len() == 10));
        assert_eq!(h.sequence(1000).len(), 100);
    }
}
