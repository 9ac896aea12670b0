//! What a prefill costs: the node's advertised rates ([`NodeCost`], sent after `HelloAck` and
//! on request, protocol version 2) and the rate model both sides fit from their own runs
//! ([`RateFit`]). Plain numbers, no I/O; the node's meter lives in `k3-prefill`'s server, the
//! routing decision in `k3-decode`'s remote client.

use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};

/// Seconds to prefill `n` new tokens after a context of `base` tokens, fitted from measured
/// runs as `fixed_s + n · (per_token_s + per_token_ctx_s · (base + n/2))` — the per-token cost
/// grows linearly with the context the token attends to (the MLA layers), the rest is per token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RateFit {
    pub fixed_s: f64,
    pub per_token_s: f64,
    pub per_token_ctx_s: f64,
    /// Runs the fit was made from (0: nothing measured; the fit is a configured default or empty).
    pub samples: u32,
}

/// One measured run for a [`RateFit`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateSample {
    pub new_tokens: u64,
    pub base_tokens: u64,
    pub seconds: f64,
}

impl RateFit {
    /// A fit of `tok_per_s` tokens per second whatever the context (a configured default).
    pub fn flat(tok_per_s: f64) -> RateFit {
        RateFit { per_token_s: if tok_per_s > 0.0 { 1.0 / tok_per_s } else { 0.0 }, ..Default::default() }
    }

    /// Predicted seconds for `n` new tokens after `base`.
    pub fn seconds(&self, n: u64, base: u64) -> f64 {
        if n == 0 {
            return 0.0;
        }
        let n = n as f64;
        (self.fixed_s + n * (self.per_token_s + self.per_token_ctx_s * (base as f64 + n / 2.0))).max(0.0)
    }

    /// Tokens per second at this size (for logs).
    pub fn tok_per_s(&self, n: u64, base: u64) -> f64 {
        let s = self.seconds(n, base);
        if s > 0.0 {
            n as f64 / s
        } else {
            0.0
        }
    }

    /// Least squares over `samples` (the most recent ones are what a caller should pass). With
    /// too few distinct runs for three terms it fits fewer: one run gives a flat rate, runs of
    /// one context length give no context term. Coefficients never go negative.
    pub fn fit(samples: &[RateSample]) -> RateFit {
        let s: Vec<&RateSample> = samples.iter().filter(|s| s.new_tokens > 0 && s.seconds.is_finite() && s.seconds >= 0.0).collect();
        if s.is_empty() {
            return RateFit::default();
        }
        let count = s.len() as u32;
        let row = |x: &RateSample| {
            let n = x.new_tokens as f64;
            [1.0, n, n * (x.base_tokens as f64 + n / 2.0)]
        };
        let flat = || {
            let tok: f64 = s.iter().map(|x| x.new_tokens as f64).sum();
            let sec: f64 = s.iter().map(|x| x.seconds).sum();
            RateFit { per_token_s: sec / tok, samples: count, ..Default::default() }
        };
        let distinct = |f: &dyn Fn(&RateSample) -> f64| {
            let mut v: Vec<f64> = s.iter().map(|x| f(x)).collect();
            v.sort_by(|a, b| a.total_cmp(b));
            v.dedup_by(|a, b| (*a - *b).abs() <= 1e-9 * b.abs().max(1.0));
            v.len()
        };
        // Which terms the data can tell apart.
        let ctx_varies = distinct(&|x| x.base_tokens as f64 + x.new_tokens as f64 / 2.0) >= 2;
        let n_varies = distinct(&|x| x.new_tokens as f64) >= 2;
        let mut terms: Vec<usize> = vec![1];
        if n_varies && s.len() >= 3 {
            terms.push(0);
        }
        if ctx_varies && s.len() > terms.len() {
            terms.push(2);
        }
        // Drop a term whose coefficient comes out negative and refit (a non-negative fit).
        loop {
            let Some(c) = solve(&s.iter().map(|x| row(x)).collect::<Vec<_>>(), &s.iter().map(|x| x.seconds).collect::<Vec<_>>(), &terms) else {
                return flat();
            };
            if let Some(bad) = terms.iter().position(|&t| c[t] < 0.0) {
                if terms.len() == 1 {
                    return flat();
                }
                terms.remove(bad);
                continue;
            }
            return RateFit { fixed_s: c[0], per_token_s: c[1], per_token_ctx_s: c[2], samples: count };
        }
    }
}

/// Normal equations over the chosen columns (scaled for conditioning); None if singular.
fn solve(rows: &[[f64; 3]], y: &[f64], terms: &[usize]) -> Option<[f64; 3]> {
    let k = terms.len();
    let scale: Vec<f64> = terms.iter().map(|&t| rows.iter().map(|r| r[t].abs()).fold(0.0, f64::max).max(1e-30)).collect();
    let mut a = vec![vec![0.0; k + 1]; k];
    for (r, &yv) in rows.iter().zip(y) {
        for i in 0..k {
            let xi = r[terms[i]] / scale[i];
            for j in 0..k {
                a[i][j] += xi * r[terms[j]] / scale[j];
            }
            a[i][k] += xi * yv;
        }
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..k {
        let p = (col..k).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[p][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, p);
        let pivot = a[col].clone();
        for (i, row) in a.iter_mut().enumerate().take(k) {
            if i != col {
                let f = row[col] / pivot[col];
                for (x, p) in row[col..=k].iter_mut().zip(&pivot[col..=k]) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut c = [0.0; 3];
    for i in 0..k {
        c[terms[i]] = a[i][k] / a[i][i] / scale[i];
    }
    Some(c)
}

/// A prefill node's cost as it advertises it (`Message::Cost`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeCost {
    /// Seconds one sweep over every layer's weights takes from the node's current weight source
    /// (weight bytes read per pass / measured read rate; 0 when the weights are resident).
    pub pass_s: f64,
    /// Weight bytes one pass reads from the source (0: resident).
    pub pass_bytes: u64,
    /// Weight passes `pass_s` was measured over (0: not measured yet, `pass_s` is the node's
    /// configured or planned estimate).
    pub passes: u64,
    /// Compute seconds of a request (weight waits and network waits excluded).
    pub compute: RateFit,
    /// Requests computing or waiting on the node now.
    pub queued: u32,
    /// Predicted seconds before a request sent now would start computing.
    pub queue_s: f64,
}

impl NodeCost {
    /// Predicted seconds on the node for `n` new tokens after `base`, queue excluded: the weight
    /// pass and the compute overlap layer by layer (the next layer's weights load while this
    /// one computes), so the slower of the two sets the time.
    pub fn work_s(&self, n: u64, base: u64) -> f64 {
        self.pass_s.max(self.compute.seconds(n, base))
    }

    /// Predicted seconds from sending a request until the node has finished its last layer.
    pub fn predict_s(&self, n: u64, base: u64) -> f64 {
        self.queue_s + self.work_s(n, base)
    }
}

/// The node's current [`NodeCost`], written by its meter, read by every connection.
pub type CostBoard = Arc<RwLock<NodeCost>>;

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: u64, base: u64, f: &RateFit) -> RateSample {
        RateSample { new_tokens: n, base_tokens: base, seconds: f.seconds(n, base) }
    }

    #[test]
    fn fit_recovers_the_three_terms() {
        let truth = RateFit { fixed_s: 0.05, per_token_s: 2e-3, per_token_ctx_s: 1e-7, samples: 0 };
        let s: Vec<_> = [(100, 0), (1000, 0), (500, 4000), (2000, 10000), (50, 20000)].iter().map(|&(n, b)| sample(n, b, &truth)).collect();
        let f = RateFit::fit(&s);
        assert_eq!(f.samples, 5);
        for (n, b) in [(300, 0), (8000, 30000)] {
            let (want, got) = (truth.seconds(n, b), f.seconds(n, b));
            assert!((got - want).abs() < 1e-6 * want.max(1.0), "{n}@{b}: {got} vs {want}");
        }
    }

    #[test]
    fn fit_with_one_run_is_flat_and_never_negative() {
        let f = RateFit::fit(&[RateSample { new_tokens: 200, base_tokens: 0, seconds: 2.0 }]);
        assert_eq!(f.samples, 1);
        assert!((f.tok_per_s(400, 1000) - 100.0).abs() < 1e-9);
        // Noisy runs that would give a negative fixed cost: the term is dropped.
        let s = [
            RateSample { new_tokens: 100, base_tokens: 0, seconds: 0.01 },
            RateSample { new_tokens: 200, base_tokens: 0, seconds: 0.5 },
            RateSample { new_tokens: 300, base_tokens: 0, seconds: 0.9 },
        ];
        let f = RateFit::fit(&s);
        assert!(f.fixed_s >= 0.0 && f.per_token_s >= 0.0 && f.per_token_ctx_s >= 0.0, "{f:?}");
        assert!(RateFit::fit(&[]).seconds(100, 0) == 0.0);
    }

    #[test]
    fn work_is_the_slower_of_pass_and_compute() {
        let c = NodeCost { pass_s: 10.0, compute: RateFit::flat(1000.0), queue_s: 2.0, ..Default::default() };
        assert_eq!(c.predict_s(1000, 0), 12.0);
        assert!((c.predict_s(20_000, 0) - 22.0).abs() < 1e-9);
    }
}
