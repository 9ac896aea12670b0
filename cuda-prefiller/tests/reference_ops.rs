//! The CPU reference ops against the spec's equations and against each other, on random
//! inputs: chunked vs recurrent KDA (non-zero initial state, lengths not multiples of 64),
//! split vs one-shot KDA and short conv, absorbed vs expanded MLA, AttnRes vs its 6-line
//! definition, the router's selection-only bias.

mod common;

use common::rel;
use cuda_prefiller::backend::{Backend, KdaDims, KdaInputs, MlaDims, MlaForm};
use cuda_prefiller::cpu::{attn_res, conv, kda, mla, moe, norm, CpuBackend};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn randn(rng: &mut StdRng, n: usize, s: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.gen::<f32>() * 2.0 - 1.0) * s * 1.7).collect()
}

struct KdaSample {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    s0: Vec<f32>,
}

fn kda_inputs(seed: u64, rows: usize, heads: usize, d: usize) -> KdaSample {
    let mut rng = StdRng::seed_from_u64(seed);
    let w = heads * d;
    let mut q = randn(&mut rng, rows * w, 1.0);
    let mut k = randn(&mut rng, rows * w, 1.0);
    norm::l2_norm_heads(&mut q, d, 1e-6, 1.0 / (d as f32).sqrt());
    norm::l2_norm_heads(&mut k, d, 1e-6, 1.0);
    let v = randn(&mut rng, rows * w, 1.0);
    let z = randn(&mut rng, rows * w, 2.0);
    let a_log = randn(&mut rng, heads, 0.5);
    let dt = randn(&mut rng, w, 1.0);
    let g = kda::kda_gate(&z, &a_log, &dt, heads, d, Some(-5.0));
    let beta: Vec<f32> = randn(&mut rng, rows * heads, 2.0).iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
    let s0 = randn(&mut rng, heads * d * d, 0.3);
    KdaSample { q, k, v, g, beta, s0 }
}

/// The recurrence exactly as spec §3.3 writes it, in f64, one head at a time.
fn naive_kda(x: &KdaSample, heads: usize, d: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = x.beta.len() / heads;
    let w = heads * d;
    let mut o = vec![0.0f64; rows * w];
    let mut s: Vec<f64> = x.s0.iter().map(|&a| a as f64).collect();
    for h in 0..heads {
        let sh = &mut s[h * d * d..(h + 1) * d * d];
        for t in 0..rows {
            let at = |a: &Vec<f32>, i: usize| a[t * w + h * d + i] as f64;
            for i in 0..d {
                for j in 0..d {
                    sh[i * d + j] *= at(&x.g, i).exp();
                }
            }
            let b = x.beta[t * heads + h] as f64;
            let kv: Vec<f64> = (0..d).map(|j| (0..d).map(|i| at(&x.k, i) * sh[i * d + j]).sum()).collect();
            for i in 0..d {
                for j in 0..d {
                    sh[i * d + j] += b * at(&x.k, i) * (at(&x.v, j) - kv[j]);
                }
            }
            for j in 0..d {
                o[t * w + h * d + j] = (0..d).map(|i| sh[i * d + j] * at(&x.q, i)).sum();
            }
        }
    }
    (o, s)
}

fn rel64(a: &[f32], b: &[f64]) -> f64 {
    let bf: Vec<f32> = b.iter().map(|&x| x as f32).collect();
    rel(a, &bf)
}

#[test]
fn chunked_kda_equals_recurrent_kda() {
    let (heads, d) = (3, 32);
    let mut worst = 0.0f64;
    for (seed, rows) in [(1u64, 1usize), (2, 37), (3, 64), (4, 65), (5, 150), (6, 257)] {
        let x = kda_inputs(seed, rows, heads, d);
        let mut s_rec = x.s0.clone();
        let o_rec = kda::kda_recurrent(&x.q, &x.k, &x.v, &x.g, &x.beta, &mut s_rec, heads, d);
        for chunk in [64, 16] {
            let mut s_ch = x.s0.clone();
            let o_ch = kda::kda_chunked(&x.q, &x.k, &x.v, &x.g, &x.beta, &mut s_ch, heads, d, chunk);
            let (eo, es) = (rel(&o_ch, &o_rec), rel(&s_ch, &s_rec));
            worst = worst.max(eo).max(es);
            assert!(eo <= 1e-5 && es <= 1e-5, "rows {rows}, chunk {chunk}: output {eo:.2e}, state {es:.2e}");
        }
        // Both against the spec's recurrence written out in f64.
        let (o_ref, s_ref) = naive_kda(&x, heads, d);
        assert!(rel64(&o_rec, &o_ref) <= 1e-5 && rel64(&s_rec, &s_ref) <= 1e-5, "rows {rows}: recurrent vs spec");
    }
    eprintln!("chunked vs recurrent KDA: max rel err {worst:.3e}");
}

#[test]
fn kda_through_the_backend_splits_like_one_shot() {
    // Two calls carrying the state = one call (what continuation relies on).
    let (heads, d) = (2, 16);
    let dims = KdaDims { heads, head_dim: d };
    let rows = 133;
    let x = kda_inputs(9, rows, heads, d);
    let b = CpuBackend;
    let up = |v: &[f32], r0: usize, n: usize, cols: usize| b.upload(&v[r0 * cols..(r0 + n) * cols], n, cols).unwrap();
    let w = heads * d;
    let mut s1 = b.upload(&x.s0, heads, d * d).unwrap();
    let one = b
        .kda_chunked(
            &KdaInputs {
                q: &up(&x.q, 0, rows, w),
                k: &up(&x.k, 0, rows, w),
                v: &up(&x.v, 0, rows, w),
                g: &up(&x.g, 0, rows, w),
                beta: &up(&x.beta, 0, rows, heads),
            },
            &mut s1,
            dims,
            64,
        )
        .unwrap();
    let mut s2 = b.upload(&x.s0, heads, d * d).unwrap();
    let mut parts = Vec::new();
    for (r0, n) in [(0, 70), (70, 63)] {
        let o = b
            .kda_chunked(
                &KdaInputs { q: &up(&x.q, r0, n, w), k: &up(&x.k, r0, n, w), v: &up(&x.v, r0, n, w), g: &up(&x.g, r0, n, w), beta: &up(&x.beta, r0, n, heads) },
                &mut s2,
                dims,
                64,
            )
            .unwrap();
        parts.extend(b.download(&o).unwrap());
    }
    assert!(rel(&parts, &one.data) <= 1e-5);
    assert!(rel(&s2.data, &s1.data) <= 1e-5);
    // Wrong shapes are errors, not panics.
    assert!(b
        .kda_chunked(
            &KdaInputs { q: &up(&x.q, 0, 3, w), k: &up(&x.k, 0, 2, w), v: &up(&x.v, 0, 3, w), g: &up(&x.g, 0, 3, w), beta: &up(&x.beta, 0, 3, heads) },
            &mut s2,
            dims,
            64
        )
        .is_err());
}

#[test]
fn short_conv_window_carries_across_calls() {
    let mut rng = StdRng::seed_from_u64(3);
    let (c, kern, rows) = (24, 4, 11);
    let x = randn(&mut rng, rows * c, 1.0);
    let w = randn(&mut rng, c * kern, 0.5);
    let win0 = randn(&mut rng, (kern - 1) * c, 1.0);
    let (y, win) = conv::short_conv_silu(&x, c, &w, kern, &win0);
    // Definition: y_t[ch] = SiLU(Σ_j w[ch, j] x̂_{t-3+j}[ch]) over x̂ = win0 ++ x.
    let xh: Vec<f32> = win0.iter().chain(&x).cloned().collect();
    for t in 0..rows {
        for ch in 0..c {
            let a: f32 = (0..kern).map(|j| w[ch * kern + j] * xh[(t + j) * c + ch]).sum();
            let e = a / (1.0 + (-a).exp());
            assert!((y[t * c + ch] - e).abs() <= 1e-5 * (1.0 + e.abs()));
        }
    }
    assert_eq!(win, xh[(rows) * c..].to_vec(), "window = last K-1 inputs, oldest first");
    let (y1, w1) = conv::short_conv_silu(&x[..5 * c], c, &w, kern, &win0);
    let (y2, w2) = conv::short_conv_silu(&x[5 * c..], c, &w, kern, &w1);
    assert_eq!([y1, y2].concat(), y);
    assert_eq!(w2, win);
    // Fewer rows than the window: the old side stays.
    let (_, w3) = conv::short_conv_silu(&x[..c], c, &w, kern, &win0);
    assert_eq!(w3, [&win0[c..], &x[..c]].concat());
}

#[test]
fn absorbed_mla_equals_expanded_mla() {
    let mut rng = StdRng::seed_from_u64(5);
    let dm = MlaDims { heads: 3, nope: 16, rope: 8, v: 12, kv_lora: 20 };
    let (ctx, pos0) = (41, 29);
    let rows = ctx - pos0;
    let q = randn(&mut rng, rows * dm.heads * dm.qk(), 1.0);
    let cache = randn(&mut rng, ctx * dm.latent(), 1.0);
    let kv_b = randn(&mut rng, dm.heads * (dm.nope + dm.v) * dm.kv_lora, 0.4);
    let e = mla::mla_attention_expanded(&q, &cache, &kv_b, dm, pos0);
    let a = mla::mla_attention_absorbed(&q, &cache, &kv_b, dm, pos0);
    let err = rel(&a, &e);
    eprintln!("absorbed vs expanded MLA: rel err {err:.3e}");
    assert!(err <= 1e-5);
    // Causality: rows past a query's position do not change it.
    let mut cache2 = cache.clone();
    for v in &mut cache2[(pos0 + 1) * dm.latent()..] {
        *v = 7.0;
    }
    let e2 = mla::mla_attention_expanded(&q[..dm.heads * dm.qk()], &cache2[..(pos0 + 1) * dm.latent()], &kv_b, dm, pos0);
    assert!(rel(&e2, &e[..dm.heads * dm.v]) <= 1e-6);
    // Through the backend, with a cache larger than the context.
    let b = CpuBackend;
    let big = [cache.clone(), vec![99.0; 5 * dm.latent()]].concat();
    let out = b
        .mla_attention(
            &b.upload(&q, rows, dm.heads * dm.qk()).unwrap(),
            &b.upload(&big, ctx + 5, dm.latent()).unwrap(),
            &b.upload(&kv_b, dm.heads * (dm.nope + dm.v), dm.kv_lora).unwrap(),
            dm,
            pos0,
            MlaForm::Absorbed,
        )
        .unwrap();
    assert!(rel(&out.data, &e) <= 1e-5);
}

#[test]
fn attn_res_matches_its_definition() {
    let mut rng = StdRng::seed_from_u64(8);
    let (rows, h) = (5, 40);
    let bank: Vec<Vec<f32>> = (0..3).map(|_| randn(&mut rng, rows * h, 2.0)).collect();
    let p = randn(&mut rng, rows * h, 1.0);
    let wn = randn(&mut rng, h, 1.0);
    let wp = randn(&mut rng, h, 1.0);
    let refs: Vec<&[f32]> = bank.iter().map(|b| &b[..]).collect();
    let out = attn_res::attn_res_mix(&refs, &p, h, &wn, &wp, 1e-5);
    for r in 0..rows {
        let vs: Vec<&[f32]> = bank.iter().map(|b| &b[r * h..(r + 1) * h]).chain([&p[r * h..(r + 1) * h]]).collect();
        let s: Vec<f64> = vs
            .iter()
            .map(|v| {
                let ms = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / h as f64;
                (0..h).map(|d| v[d] as f64 / (ms + 1e-5).sqrt() * wn[d] as f64 * wp[d] as f64).sum()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for d in 0..h {
            let e: f64 = vs.iter().zip(&s).map(|(v, si)| (si - m).exp() / z * v[d] as f64).sum();
            assert!((out[r * h + d] as f64 - e).abs() <= 1e-5 * (1.0 + e.abs()));
        }
    }
}

#[test]
fn router_bias_selects_but_does_not_weigh() {
    // Two experts out of four; the bias promotes expert 3, weights use the unbiased scores.
    let logits = [2.0f32, 1.0, 0.0, -1.0];
    let bias = [0.0f32, 0.0, 0.0, 10.0];
    let r = moe::route(&logits, 4, &bias, 2, true, 1.0);
    assert_eq!(r.ids, vec![3, 0]);
    let s = |x: f32| 1.0 / (1.0 + (-x).exp());
    let (a, b) = (s(-1.0), s(2.0));
    assert!((r.weights[0] - a / (a + b)).abs() < 1e-6 && (r.weights[1] - b / (a + b)).abs() < 1e-6);
    assert!((r.gap[0] - (s(2.0) - s(1.0))).abs() < 1e-6);
    // Ties: the lower index wins.
    let r = moe::route(&[0.5, 0.5, 0.5], 3, &[0.0; 3], 1, true, 1.0);
    assert_eq!(r.ids, vec![0]);
}

#[test]
fn mxfp4_dequant_is_bit_exact_on_tiny_a_experts() {
    let ck = common::checkpoint(&common::tiny_a_dir());
    let c = &ck.config().text_config;
    let mut n = 0;
    for l in c.first_k_dense_replace..c.num_hidden_layers {
        for e in 0..c.num_experts {
            for w in ["w1", "w2", "w3"] {
                let x = ck.expert(l, e, w).unwrap();
                let ours = moe::dequant_mxfp4(&x);
                let theirs = x.decode();
                assert!(ours.iter().zip(&theirs).all(|(a, b)| a.to_bits() == b.to_bits()), "layer {l} expert {e} {w}");
                n += 1;
            }
        }
    }
    assert_eq!(n, 8 * 16 * 3);
}
