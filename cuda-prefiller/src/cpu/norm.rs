//! Norms (spec §3.0): RMSNorm, the per-head L2 norm of KDA q/k, KDA's gated output norm and the
//! MLA latent norm. Sums of squares accumulate in f64; results are f32.

use rayon::prelude::*;

use crate::act::sigmoid;

/// `1 / sqrt(mean(x²) + eps)`.
#[inline]
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    (1.0 / (ss / x.len().max(1) as f64 + eps as f64).sqrt()) as f32
}

/// RMSNorm of every row of `x [rows, cols]`: `x / sqrt(mean(x²) + eps) ⊙ w`, `w [cols]`.
pub fn rms_norm(x: &[f32], cols: usize, w: &[f32], eps: f32) -> Vec<f32> {
    assert_eq!(w.len(), cols, "rms_norm: weight width");
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(cols.max(1)).zip(x.par_chunks(cols.max(1))).for_each(|(o, xr)| {
        let s = inv_rms(xr, eps);
        for ((o, &v), &g) in o.iter_mut().zip(xr).zip(w) {
            *o = v * s * g;
        }
    });
    out
}

/// In place, per head of `head_dim` values: `x ← scale · x / sqrt(Σ x² + eps)` (KDA q/k).
pub fn l2_norm_heads(x: &mut [f32], head_dim: usize, eps: f32, scale: f32) {
    x.par_chunks_mut(head_dim.max(1)).for_each(|h| {
        let ss: f64 = h.iter().map(|&v| v as f64 * v as f64).sum();
        let f = (scale as f64 / (ss + eps as f64).sqrt()) as f32;
        for v in h.iter_mut() {
            *v *= f;
        }
    });
}

/// KDA output gate + norm per head: `RMSNorm_D(o_h; eps) ⊙ w ⊙ σ(gate_h)`, `w [head_dim]`.
pub fn gated_rms_norm(o: &[f32], gate: &[f32], w: &[f32], head_dim: usize, eps: f32) -> Vec<f32> {
    assert_eq!(o.len(), gate.len(), "gated_rms_norm: o and gate differ in size");
    assert_eq!(w.len(), head_dim, "gated_rms_norm: weight width");
    let mut out = vec![0.0f32; o.len()];
    out.par_chunks_mut(head_dim.max(1)).zip(o.par_chunks(head_dim.max(1)).zip(gate.par_chunks(head_dim.max(1)))).for_each(|(y, (oh, gh))| {
        let s = inv_rms(oh, eps);
        for d in 0..head_dim {
            y[d] = oh[d] * s * w[d] * sigmoid(gh[d]);
        }
    });
    out
}

/// MLA latent rows from `kv [rows, kv_lora + rope]`: RMSNorm (`w [kv_lora]`) on the first
/// `kv_lora` columns (`c_kv`), the rest (`k_pe`) copied raw.
pub fn mla_latent(kv: &[f32], kv_lora: usize, rope: usize, w: &[f32], eps: f32) -> Vec<f32> {
    let width = kv_lora + rope;
    assert_eq!(w.len(), kv_lora, "mla_latent: weight width");
    let mut out = kv.to_vec();
    out.par_chunks_mut(width.max(1)).for_each(|row| {
        let s = inv_rms(&row[..kv_lora], eps);
        for d in 0..kv_lora {
            row[d] = row[d] * s * w[d];
        }
    });
    out
}
