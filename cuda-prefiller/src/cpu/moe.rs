//! Latent MoE pieces (spec §3.6): the sigmoid router with the selection-only correction bias,
//! and the routed MXFP4 expert MLPs (weights dequantised bit-exactly, math in f32).

use rayon::prelude::*;

use k3_protocol::mxfp4::{e2m1, e8m0, Mxfp4Weight, GROUP};

use super::gemm::gemm;
use crate::act::{sigmoid, situ};
use crate::backend::Routing;

/// Dequantises an MXFP4 weight to row-major f32 `[out, in]`, bit-identical to
/// `Mxfp4Weight::decode` (same products `e2m1(code) · 2^(e−127)`), through a byte → pair table
/// and in parallel over rows.
pub fn dequant_mxfp4(w: &Mxfp4Weight<'_>) -> Vec<f32> {
    let lut: Vec<[f32; 2]> = (0..=255u8).map(|b| [e2m1(b & 0x0f), e2m1(b >> 4)]).collect();
    let (inf, half, groups) = (w.in_features, w.in_features / 2, w.in_features / GROUP);
    let mut out = vec![0.0f32; w.out_features * inf];
    out.par_chunks_mut(inf.max(1)).enumerate().for_each(|(r, row)| {
        let packed = &w.packed[r * half..(r + 1) * half];
        let scales = &w.scale[r * groups..(r + 1) * groups];
        for (g, &e) in scales.iter().enumerate() {
            let sc = e8m0(e);
            let dst = &mut row[g * GROUP..(g + 1) * GROUP];
            for (j, &b) in packed[g * GROUP / 2..(g + 1) * GROUP / 2].iter().enumerate() {
                let [lo, hi] = lut[b as usize];
                dst[2 * j] = lo * sc;
                dst[2 * j + 1] = hi * sc;
            }
        }
    });
    out
}

/// Router over `logits [rows, E]`: `s = σ(logits)`, top-k of `s + bias` (ties: lower index),
/// weights = selected `s`, renormalised by `Σ + 1e-20` if asked, times `scaling`.
pub fn route(logits: &[f32], experts: usize, bias: &[f32], top_k: usize, renormalize: bool, scaling: f32) -> Routing {
    assert_eq!(bias.len(), experts, "route: bias width");
    assert!(top_k >= 1 && top_k <= experts, "route: top_k out of range");
    let rows = logits.len() / experts.max(1);
    let mut ids = vec![0u32; rows * top_k];
    let mut weights = vec![0.0f32; rows * top_k];
    let mut gap = vec![f32::INFINITY; rows];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for t in 0..rows {
        let s: Vec<f32> = logits[t * experts..(t + 1) * experts].iter().map(|&x| sigmoid(x)).collect();
        let biased: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
        order.clear();
        order.extend(0..experts);
        order.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]).then(a.cmp(&b)));
        if top_k < experts {
            gap[t] = biased[order[top_k - 1]] - biased[order[top_k]];
        }
        let sum: f32 = order[..top_k].iter().map(|&e| s[e]).sum();
        for j in 0..top_k {
            let e = order[j];
            let mut w = s[e];
            if renormalize {
                w /= sum + 1e-20;
            }
            ids[t * top_k + j] = e as u32;
            weights[t * top_k + j] = w * scaling;
        }
    }
    Routing { top_k, ids, weights, gap }
}

/// One routed expert, dequantised: `w1`, `w3` `[inter, latent]`, `w2` `[latent, inter]`.
#[derive(Debug, Clone)]
pub struct DenseExpert {
    pub inter: usize,
    pub latent: usize,
    pub w1: Vec<f32>,
    pub w3: Vec<f32>,
    pub w2: Vec<f32>,
}

/// `Σ_j weights[t,j] · W2_e SiTU(W1_e x_t, W3_e x_t)` for every row of `x_lat [rows, latent]`;
/// rows are grouped by expert (one GEMM per expert) and the weighted sum is accumulated per row
/// in the routing's slot order (deterministic). `mx`: the experts' inputs pass MXFP8 first
/// (`crate::mx`; the weights are MXFP4 already), the SiTU outputs do not.
pub fn moe_experts(x_lat: &[f32], routing: &Routing, experts: &[DenseExpert], beta: f32, linear_beta: Option<f32>, mx: bool) -> Vec<f32> {
    let rows = routing.rows();
    let k = routing.top_k;
    let Some(first) = experts.first() else { return vec![0.0; x_lat.len()] };
    let (lat, inter) = (first.latent, first.inter);
    assert_eq!(x_lat.len(), rows * lat, "moe_experts: x_lat is not [rows, latent]");
    // Slots per expert: (row, slot).
    let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); experts.len()];
    for t in 0..rows {
        for j in 0..k {
            let e = routing.ids[t * k + j] as usize;
            assert!(e < experts.len(), "moe_experts: expert id {e} out of range");
            by_expert[e].push((t, j));
        }
    }
    // y[(t, j)] for every slot, computed per expert.
    let per_expert: Vec<(usize, Vec<f32>)> = by_expert
        .par_iter()
        .enumerate()
        .filter(|(_, s)| !s.is_empty())
        .map(|(e, slots)| {
            let ex = &experts[e];
            let mut xs = Vec::with_capacity(slots.len() * lat);
            for &(t, _) in slots {
                xs.extend_from_slice(&x_lat[t * lat..(t + 1) * lat]);
            }
            if mx {
                crate::mx::mxfp8_rows(&mut xs, lat);
            }
            let g = gemm(&xs, slots.len(), lat, &ex.w1, inter);
            let u = gemm(&xs, slots.len(), lat, &ex.w3, inter);
            // The SiTU output enters the down projection unquantised (BF16 on the GPU): MXFP8
            // there too cost tiny-t 0.8 points of top-1 agreement (docs/mx.md).
            let a: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| situ(g, u, beta, linear_beta)).collect();
            (e, gemm(&a, slots.len(), inter, &ex.w2, lat))
        })
        .collect();
    let mut ys = vec![0.0f32; rows * k * lat];
    for (e, y) in per_expert {
        for (n, &(t, j)) in by_expert[e].iter().enumerate() {
            ys[(t * k + j) * lat..(t * k + j + 1) * lat].copy_from_slice(&y[n * lat..(n + 1) * lat]);
        }
    }
    let mut out = vec![0.0f32; rows * lat];
    out.par_chunks_mut(lat).enumerate().for_each(|(t, o)| {
        for j in 0..k {
            let w = routing.weights[t * k + j];
            for (o, &y) in o.iter_mut().zip(&ys[(t * k + j) * lat..(t * k + j + 1) * lat]) {
                *o += w * y;
            }
        }
    });
    out
}
