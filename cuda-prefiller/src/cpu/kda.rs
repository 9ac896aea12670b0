//! Kimi Delta Attention math (spec §3.3–3.4): the decay gate, the delta-rule recurrence in its
//! chunked (prefill) and recurrent (decode) forms. Layouts: `q, k, v, g [rows, H·D]`
//! (head-major columns), `beta [rows, H]`, state `[H, D(k), D(v)]` f32. Inside, every head is
//! computed in f64 (the reference the CUDA kernels are checked against).

use rayon::prelude::*;

use crate::act::{sigmoid, softplus};

/// Decay gate `g [rows, H·D]` from `z [rows, H·D]` (before `dt_bias`), `a_log [H]` (one per
/// head), `dt_bias [H·D]`. Bounded form for `Some(lb)`: `lb·σ(exp(A[h])·(z + dt_bias))`;
/// `None`: Kimi-Linear `−exp(A[h])·softplus(z + dt_bias)`.
pub fn kda_gate(z: &[f32], a_log: &[f32], dt_bias: &[f32], heads: usize, head_dim: usize, lower_bound: Option<f32>) -> Vec<f32> {
    let w = heads * head_dim;
    assert_eq!(a_log.len(), heads, "kda_gate: A_log must hold one value per head");
    assert_eq!(dt_bias.len(), w, "kda_gate: dt_bias width");
    let a: Vec<f32> = a_log.iter().map(|x| x.exp()).collect();
    let mut g = vec![0.0f32; z.len()];
    for (gr, zr) in g.chunks_mut(w).zip(z.chunks(w)) {
        for c in 0..w {
            let u = zr[c] + dt_bias[c];
            let ah = a[c / head_dim];
            gr[c] = match lower_bound {
                Some(lb) => lb * sigmoid(ah * u),
                None => -ah * softplus(u),
            };
        }
    }
    g
}

/// Per-head copies of the inputs, f64, `[rows, D]` each.
struct HeadInputs {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    g: Vec<f64>,
    beta: Vec<f64>,
}

fn head_inputs(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], heads: usize, d: usize, h: usize) -> HeadInputs {
    let w = heads * d;
    let rows = beta.len() / heads;
    let take = |x: &[f32]| -> Vec<f64> {
        let mut o = Vec::with_capacity(rows * d);
        for t in 0..rows {
            o.extend(x[t * w + h * d..t * w + (h + 1) * d].iter().map(|&a| a as f64));
        }
        o
    };
    HeadInputs { q: take(q), k: take(k), v: take(v), g: take(g), beta: (0..rows).map(|t| beta[t * heads + h] as f64).collect() }
}

fn check(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &[f32], heads: usize, d: usize) -> usize {
    let rows = beta.len() / heads.max(1);
    assert_eq!(beta.len(), rows * heads, "kda: beta is not [rows, heads]");
    for (x, n) in [(q, "q"), (k, "k"), (v, "v"), (g, "g")] {
        assert_eq!(x.len(), rows * heads * d, "kda: {n} is not [rows, heads*head_dim]");
    }
    assert_eq!(state.len(), heads * d * d, "kda: state is not [heads, head_dim, head_dim]");
    rows
}

/// Writes head `h`'s outputs `[rows, D]` and final state into the shared layouts.
fn scatter(out: &mut [f32], state: &mut [f32], results: Vec<(Vec<f64>, Vec<f64>)>, heads: usize, d: usize) {
    let w = heads * d;
    for (h, (o, s)) in results.into_iter().enumerate() {
        let rows = o.len() / d;
        for t in 0..rows {
            for j in 0..d {
                out[t * w + h * d + j] = o[t * d + j] as f32;
            }
        }
        for (dst, src) in state[h * d * d..(h + 1) * d * d].iter_mut().zip(&s) {
            *dst = *src as f32;
        }
    }
}

/// The delta-rule recurrence token by token (spec §3.3 step 7), per head:
/// `S' = diag(exp(g_t)) S`, `S = S' + β_t k_t ⊗ (v_t − S'ᵀ k_t)`, `o_t = Sᵀ q_t`.
/// `state` is read as the initial state and overwritten with the final one. Returns `o`.
pub fn kda_recurrent(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], heads: usize, d: usize) -> Vec<f32> {
    per_head(q, k, v, g, beta, state, heads, d, |x, rows, s, o| {
        let mut kv = vec![0.0f64; d];
        for t in 0..rows {
            let (qt, kt, vt, gt) = (&x.q[t * d..(t + 1) * d], &x.k[t * d..(t + 1) * d], &x.v[t * d..(t + 1) * d], &x.g[t * d..(t + 1) * d]);
            kv.iter_mut().for_each(|a| *a = 0.0);
            for i in 0..d {
                let a = gt[i].exp();
                let row = &mut s[i * d..(i + 1) * d];
                for (sv, kvj) in row.iter_mut().zip(kv.iter_mut()) {
                    *sv *= a;
                    *kvj += kt[i] * *sv;
                }
            }
            let b = x.beta[t];
            let u: Vec<f64> = (0..d).map(|j| b * (vt[j] - kv[j])).collect();
            let ot = &mut o[t * d..(t + 1) * d];
            for i in 0..d {
                let row = &mut s[i * d..(i + 1) * d];
                for j in 0..d {
                    row[j] += kt[i] * u[j];
                    ot[j] += qt[i] * row[j];
                }
            }
        }
    })
}

/// The chunked (parallel) form of the same recurrence (spec §3.4), chunk length `chunk`;
/// the last chunk may be partial. Equal to [`kda_recurrent`] up to rounding. The state is
/// carried between chunks in f32 (f64 inside a chunk), as it is between calls, so a prompt split
/// into calls at multiples of `chunk` (the executor's token chunks under a memory plan) gives
/// bit-identical results to one call.
pub fn kda_chunked(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], heads: usize, d: usize, chunk: usize) -> Vec<f32> {
    let chunk = chunk.max(1);
    per_head(q, k, v, g, beta, state, heads, d, |x, rows, s, o| {
        let mut c0 = 0;
        while c0 < rows {
            let n = chunk.min(rows - c0);
            chunk_step(x, c0, n, d, s, &mut o[c0 * d..(c0 + n) * d]);
            s.iter_mut().for_each(|v| *v = *v as f32 as f64);
            c0 += n;
        }
    })
}

/// Runs `head(inputs, rows, state, out)` for every head in parallel, in f64, from the initial
/// `state`, and writes the outputs `[rows, H·D]` and the final states back.
fn per_head<F>(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], state: &mut [f32], heads: usize, d: usize, head: F) -> Vec<f32>
where
    F: Fn(&HeadInputs, usize, &mut [f64], &mut [f64]) + Sync,
{
    let rows = check(q, k, v, g, beta, state, heads, d);
    let init: &[f32] = state;
    let results: Vec<(Vec<f64>, Vec<f64>)> = (0..heads)
        .into_par_iter()
        .map(|h| {
            let x = head_inputs(q, k, v, g, beta, heads, d, h);
            let mut s: Vec<f64> = init[h * d * d..(h + 1) * d * d].iter().map(|&a| a as f64).collect();
            let mut o = vec![0.0f64; rows * d];
            head(&x, rows, &mut s, &mut o);
            (o, s)
        })
        .collect();
    let mut out = vec![0.0f32; rows * heads * d];
    scatter(&mut out, state, results, heads, d);
    out
}

/// One chunk of rows `c0 .. c0+n` of one head: outputs into `o [n, D]`, state `s` advanced.
fn chunk_step(x: &HeadInputs, c0: usize, n: usize, d: usize, s: &mut [f64], o: &mut [f64]) {
    let r = |i: usize| (c0 + i) * d..(c0 + i + 1) * d;
    // G_i = Σ_{r≤i} g_r (cumulative log decay within the chunk), [n, D].
    let mut gc = vec![0.0f64; n * d];
    for i in 0..n {
        for j in 0..d {
            let prev = if i > 0 { gc[(i - 1) * d + j] } else { 0.0 };
            gc[i * d + j] = prev + x.g[(c0 + i) * d + j];
        }
    }
    let gi = |i: usize| &gc[i * d..(i + 1) * d];
    // A[i,j] = β_i Σ k_i k_j exp(G_i − G_j) (j < i); QK[i,j] = Σ q_i k_j exp(G_i − G_j) (j ≤ i).
    let mut a = vec![0.0f64; n * n];
    let mut qk = vec![0.0f64; n * n];
    for i in 0..n {
        let (ki, qi, g_i) = (&x.k[r(i)], &x.q[r(i)], gi(i));
        for j in 0..=i {
            let (kj, g_j) = (&x.k[r(j)], gi(j));
            let (mut kk, mut qq) = (0.0f64, 0.0f64);
            for c in 0..d {
                let e = (g_i[c] - g_j[c]).exp();
                kk += ki[c] * kj[c] * e;
                qq += qi[c] * kj[c] * e;
            }
            if j < i {
                a[i * n + j] = x.beta[c0 + i] * kk;
            }
            qk[i * n + j] = qq;
        }
    }
    // (I + A) X = diag(β) [exp(G) ⊙ K | V]: forward substitution; W = X[:, :D], U = X[:, D:].
    let mut wm = vec![0.0f64; n * d];
    let mut um = vec![0.0f64; n * d];
    for i in 0..n {
        let b = x.beta[c0 + i];
        let (ki, vi, g_i) = (&x.k[r(i)], &x.v[r(i)], gi(i));
        for c in 0..d {
            wm[i * d + c] = b * g_i[c].exp() * ki[c];
            um[i * d + c] = b * vi[c];
        }
        for j in 0..i {
            let aij = a[i * n + j];
            if aij != 0.0 {
                for c in 0..d {
                    wm[i * d + c] -= aij * wm[j * d + c];
                    um[i * d + c] -= aij * um[j * d + c];
                }
            }
        }
    }
    // Ṽ = U − W S₀.
    let mut vt = um;
    for i in 0..n {
        for kk in 0..d {
            let w = wm[i * d + kk];
            if w != 0.0 {
                let srow = &s[kk * d..(kk + 1) * d];
                for c in 0..d {
                    vt[i * d + c] -= w * srow[c];
                }
            }
        }
    }
    // O = (exp(G) ⊙ Q) S₀ + QK Ṽ.
    for i in 0..n {
        let (qi, g_i) = (&x.q[r(i)], gi(i));
        let oi = &mut o[i * d..(i + 1) * d];
        for kk in 0..d {
            let f = qi[kk] * g_i[kk].exp();
            let srow = &s[kk * d..(kk + 1) * d];
            for c in 0..d {
                oi[c] += f * srow[c];
            }
        }
        for j in 0..=i {
            let f = qk[i * n + j];
            for c in 0..d {
                oi[c] += f * vt[j * d + c];
            }
        }
    }
    // S ← diag(exp(G_L)) S₀ + Σ_j (exp(G_L − G_j) ⊙ k_j) ⊗ ṽ_j.
    let gl = gi(n - 1).to_vec();
    for kk in 0..d {
        let e = gl[kk].exp();
        let srow = &mut s[kk * d..(kk + 1) * d];
        for v in srow.iter_mut() {
            *v *= e;
        }
        for j in 0..n {
            let f = (gl[kk] - gc[j * d + kk]).exp() * x.k[(c0 + j) * d + kk];
            if f != 0.0 {
                for c in 0..d {
                    srow[c] += f * vt[j * d + c];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_token_matches_the_spec_equations() {
        // One head, D = 2, written out by hand.
        let (q, k, v) = ([1.0f32, 0.0], [0.6f32, 0.8], [2.0f32, -1.0]);
        let g = [-0.5f32, -1.0];
        let beta = [0.5f32];
        let s0 = [0.1f32, 0.2, 0.3, 0.4];
        let mut s = s0;
        let o = kda_recurrent(&q, &k, &v, &g, &beta, &mut s, 1, 2);
        // S' = diag(e^g) S0
        let sp = [0.1 * (-0.5f64).exp(), 0.2 * (-0.5f64).exp(), 0.3 * (-1.0f64).exp(), 0.4 * (-1.0f64).exp()];
        let kv = [0.6 * sp[0] + 0.8 * sp[2], 0.6 * sp[1] + 0.8 * sp[3]];
        let u = [0.5 * (2.0 - kv[0]), 0.5 * (-1.0 - kv[1])];
        let s1 = [sp[0] + 0.6 * u[0], sp[1] + 0.6 * u[1], sp[2] + 0.8 * u[0], sp[3] + 0.8 * u[1]];
        for i in 0..4 {
            assert!((s[i] as f64 - s1[i]).abs() < 1e-6);
        }
        assert!((o[0] as f64 - s1[0]).abs() < 1e-6 && (o[1] as f64 - s1[1]).abs() < 1e-6);
    }
}
