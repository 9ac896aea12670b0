//! AttnRes: attention over depth (spec §3.2), token-local.

use rayon::prelude::*;

use super::norm::inv_rms;

/// Per row, softmax mix of the candidates `[bank..., p]` (each `[rows, h]`):
/// `s_i = Σ_d rms(V_i)[d] · w_n[d] · w_p[d]` (no 1/√d), `α = softmax(s)`, out `Σ_i α_i V_i`
/// over the RAW candidates.
pub fn attn_res_mix(bank: &[&[f32]], p: &[f32], h: usize, norm_w: &[f32], proj_w: &[f32], eps: f32) -> Vec<f32> {
    assert_eq!(norm_w.len(), h, "attn_res_mix: norm weight width");
    assert_eq!(proj_w.len(), h, "attn_res_mix: proj weight width");
    for b in bank {
        assert_eq!(b.len(), p.len(), "attn_res_mix: bank entry and p differ in size");
    }
    let score: Vec<f32> = norm_w.iter().zip(proj_w).map(|(a, b)| a * b).collect();
    let mut out = vec![0.0f32; p.len()];
    out.par_chunks_mut(h.max(1)).enumerate().for_each(|(r, o)| {
        let row = |i: usize| -> &[f32] {
            if i < bank.len() {
                &bank[i][r * h..(r + 1) * h]
            } else {
                &p[r * h..(r + 1) * h]
            }
        };
        let n = bank.len() + 1;
        let mut s = vec![0.0f64; n];
        for (i, si) in s.iter_mut().enumerate() {
            let v = row(i);
            let f = inv_rms(v, eps) as f64;
            *si = v.iter().zip(&score).map(|(&x, &w)| x as f64 * f * w as f64).sum();
        }
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        let mut acc = vec![0.0f64; h];
        for (i, ei) in e.iter().enumerate() {
            let a = ei / z;
            for (acc, &x) in acc.iter_mut().zip(row(i)) {
                *acc += a * x as f64;
            }
        }
        for (o, a) in o.iter_mut().zip(acc) {
            *o = a as f32;
        }
    });
    out
}
