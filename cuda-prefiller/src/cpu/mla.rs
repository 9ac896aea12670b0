//! Gated NoPE MLA attention (spec §3.5): the expanded form (prefill) and the absorbed form over
//! the latent cache (decode). Softmax in f64. Layouts: `q [rows, H·(nope+rope)]` (per head
//! `[q_nope | q_pe]`), `cache [ctx, kv_lora+rope]` (post-norm `c_kv` then raw `k_pe`),
//! `kv_b [H·(nope+v), kv_lora]` (per head `[k_nope rows ; v rows]`), output `[rows, H·v]`.

use rayon::prelude::*;

use super::gemm::{dot, gemm};
use crate::backend::MlaDims;

fn softmax_in_place(s: &mut [f64]) {
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut z = 0.0;
    for x in s.iter_mut() {
        *x = (*x - m).exp();
        z += *x;
    }
    for x in s.iter_mut() {
        *x /= z;
    }
}

fn check(q: &[f32], cache: &[f32], kv_b: &[f32], dm: MlaDims, pos0: usize) -> usize {
    let rows = q.len() / (dm.heads * dm.qk()).max(1);
    assert_eq!(q.len(), rows * dm.heads * dm.qk(), "mla: q is not [rows, heads*(nope+rope)]");
    assert!(cache.len() >= (pos0 + rows) * dm.latent(), "mla: cache holds fewer than pos0+rows rows");
    assert_eq!(cache.len() % dm.latent(), 0, "mla: cache is not [ctx, kv_lora+rope]");
    assert_eq!(kv_b.len(), dm.heads * (dm.nope + dm.v) * dm.kv_lora, "mla: kv_b is not [heads*(nope+v), kv_lora]");
    rows
}

/// Expanded form: `[k_nope | v] = kv_b · c_kv` per context row, then causal softmax attention;
/// query row `i` sits at position `pos0 + i` and sees cache rows `0 ..= pos0 + i`.
pub fn mla_attention_expanded(q: &[f32], cache: &[f32], kv_b: &[f32], dm: MlaDims, pos0: usize) -> Vec<f32> {
    let rows = check(q, cache, kv_b, dm, pos0);
    let ctx = pos0 + rows;
    let lw = dm.latent();
    let mut ckv = Vec::with_capacity(ctx * dm.kv_lora);
    for s in 0..ctx {
        ckv.extend_from_slice(&cache[s * lw..s * lw + dm.kv_lora]);
    }
    let kvw = dm.nope + dm.v;
    let kv = gemm(&ckv, ctx, dm.kv_lora, kv_b, dm.heads * kvw); // [ctx, H·(nope+v)]
    let scale = dm.scale() as f64;
    per_query_head(q, rows, dm, pos0, |h, qn, qp, sc, oh| {
        for (s, x) in sc.iter_mut().enumerate() {
            let kn = &kv[s * dm.heads * kvw + h * kvw..s * dm.heads * kvw + h * kvw + dm.nope];
            let kp = &cache[s * lw + dm.kv_lora..(s + 1) * lw];
            *x = (dot(qn, kn) as f64 + dot(qp, kp) as f64) * scale;
        }
        softmax_in_place(sc);
        let mut acc = vec![0.0f64; dm.v];
        for (s, &a) in sc.iter().enumerate() {
            let vh = &kv[s * dm.heads * kvw + h * kvw + dm.nope..s * dm.heads * kvw + (h + 1) * kvw];
            for (acc, &x) in acc.iter_mut().zip(vh) {
                *acc += a * x as f64;
            }
        }
        for (o, a) in oh.iter_mut().zip(acc) {
            *o = a as f32;
        }
    })
}

/// Runs `head(h, q_nope, q_pe, scores, out_h)` for every query row (in parallel) and head:
/// `scores` has one slot per visible cache row (`pos0 + i + 1` for row `i`), `out_h` is the
/// head's `[v]` slice of the output `[rows, H·v]`.
fn per_query_head<F>(q: &[f32], rows: usize, dm: MlaDims, pos0: usize, head: F) -> Vec<f32>
where
    F: Fn(usize, &[f32], &[f32], &mut [f64], &mut [f32]) + Sync,
{
    let mut out = vec![0.0f32; rows * dm.heads * dm.v];
    out.par_chunks_mut(dm.heads * dm.v).enumerate().for_each(|(i, orow)| {
        let mut sc = vec![0.0f64; pos0 + i + 1];
        for h in 0..dm.heads {
            let qh = &q[(i * dm.heads + h) * dm.qk()..(i * dm.heads + h + 1) * dm.qk()];
            let (qn, qp) = qh.split_at(dm.nope);
            head(h, qn, qp, &mut sc, &mut orow[h * dm.v..(h + 1) * dm.v]);
        }
    });
    out
}

/// Absorbed form: `q̃_h = W_UKʰᵀ q_nope_h`, scores `q̃_h·c_kv + q_pe_h·k_pe`, then
/// `ō_h = W_UVʰ (Σ_s p_s c_kv,s)`. Same causal rule as [`mla_attention_expanded`].
pub fn mla_attention_absorbed(q: &[f32], cache: &[f32], kv_b: &[f32], dm: MlaDims, pos0: usize) -> Vec<f32> {
    let rows = check(q, cache, kv_b, dm, pos0);
    let lw = dm.latent();
    let r = dm.kv_lora;
    let kvw = dm.nope + dm.v;
    let scale = dm.scale() as f64;
    per_query_head(q, rows, dm, pos0, |h, qn, qp, sc, oh| {
        // q̃ = Σ_n q_nope[n] · W_UK[n, :]
        let mut qt = vec![0.0f64; r];
        for (n, &qv) in qn.iter().enumerate() {
            let wrow = &kv_b[(h * kvw + n) * r..(h * kvw + n + 1) * r];
            for (a, &w) in qt.iter_mut().zip(wrow) {
                *a += qv as f64 * w as f64;
            }
        }
        for (s, x) in sc.iter_mut().enumerate() {
            let row = &cache[s * lw..(s + 1) * lw];
            let c: f64 = qt.iter().zip(&row[..r]).map(|(a, &b)| a * b as f64).sum();
            *x = (c + dot(qp, &row[r..]) as f64) * scale;
        }
        softmax_in_place(sc);
        let mut cbar = vec![0.0f64; r];
        for (s, &a) in sc.iter().enumerate() {
            for (acc, &x) in cbar.iter_mut().zip(&cache[s * lw..s * lw + r]) {
                *acc += a * x as f64;
            }
        }
        for (j, o) in oh.iter_mut().enumerate() {
            let wrow = &kv_b[(h * kvw + dm.nope + j) * r..(h * kvw + dm.nope + j + 1) * r];
            *o = wrow.iter().zip(&cbar).map(|(&w, &c)| w as f64 * c).sum::<f64>() as f32;
        }
    })
}
