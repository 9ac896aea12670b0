//! Chunked (and recurrent) KDA on the GPU against the CPU reference, on random inputs shaped like
//! the real ones (L2-normed q/k, bounded gate, β = σ(·), non-zero initial state), in IEEE fp32.

mod cuda_util;

use cuda_prefiller::backend::{Backend, KdaDims, KdaInputs};
use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::cuda::Precision;
use cuda_util::*;

struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    s0: Vec<f32>,
}

fn inputs(t: usize, d: KdaDims, seed: u64) -> Inputs {
    let mut r = rng(seed);
    let c = d.width();
    let cpu = CpuBackend;
    let mut q = cpu.upload(&normal(&mut r, t * c, 1.0), t, c).unwrap();
    let mut k = cpu.upload(&normal(&mut r, t * c, 1.0), t, c).unwrap();
    cpu.l2_norm_heads(&mut q, d.head_dim, 1e-6, 1.0 / (d.head_dim as f32).sqrt()).unwrap();
    cpu.l2_norm_heads(&mut k, d.head_dim, 1e-6, 1.0).unwrap();
    // bounded gate: g = -5 σ(e^a · u), spread over its range
    let g: Vec<f32> = normal(&mut r, t * c, 2.0).iter().map(|u| -5.0 / (1.0 + (-(u - 3.0)).exp())).collect();
    let beta: Vec<f32> = normal(&mut r, t * d.heads, 1.5).iter().map(|u| 1.0 / (1.0 + (-u).exp())).collect();
    Inputs { q: q.data, k: k.data, v: normal(&mut r, t * c, 1.0), g, beta, s0: normal(&mut r, d.state_len(), 0.3) }
}

fn run<B: Backend>(b: &B, inp: &Inputs, t: usize, d: KdaDims, chunked: bool) -> (Vec<f32>, Vec<f32>) {
    let c = d.width();
    let q = b.upload(&inp.q, t, c).unwrap();
    let k = b.upload(&inp.k, t, c).unwrap();
    let v = b.upload(&inp.v, t, c).unwrap();
    let g = b.upload(&inp.g, t, c).unwrap();
    let beta = b.upload(&inp.beta, t, d.heads).unwrap();
    let mut s = b.upload(&inp.s0, d.heads, d.head_dim * d.head_dim).unwrap();
    let x = KdaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
    let o = if chunked { b.kda_chunked(&x, &mut s, d, 64).unwrap() } else { b.kda_recurrent(&x, &mut s, d).unwrap() };
    (b.download(&o).unwrap(), b.download(&s).unwrap())
}

#[test]
fn cuda_kda_chunked_matches_cpu() {
    let Some(gpu) = cuda(Precision::F32) else { return };
    // last two: K3's head width with several heads and a partial last chunk; head_dim 96 (the
    // scan's 6-rows-per-thread path)
    let cases = [
        (300usize, KdaDims { heads: 2, head_dim: 32 }, 1u64),
        (200, KdaDims { heads: 3, head_dim: 128 }, 2),
        (64, KdaDims { heads: 2, head_dim: 64 }, 3),
        (5, KdaDims { heads: 2, head_dim: 128 }, 4),
        (517, KdaDims { heads: 8, head_dim: 128 }, 8),
        (130, KdaDims { heads: 2, head_dim: 96 }, 9),
    ];
    for (t, d, seed) in cases {
        let inp = inputs(t, d, seed);
        let (o_ref, s_ref) = run(&CpuBackend, &inp, t, d, false);
        let (o_c, s_c) = run(&CpuBackend, &inp, t, d, true);
        let (o_g, s_g) = run(&gpu, &inp, t, d, true);
        // the CPU chunked form against the recurrence, to calibrate
        let cal = rel(&o_c, &o_ref);
        eprintln!("T={t} H={} D={}: CPU chunked vs recurrent {cal:.2e}", d.heads, d.head_dim);
        assert_rel(&format!("kda_chunked output T={t} D={}", d.head_dim), &o_g, &o_ref, 2e-5);
        assert_rel(&format!("kda_chunked state T={t} D={}", d.head_dim), &s_g, &s_ref, 2e-5);
        assert_rel(&format!("kda_chunked vs cpu chunked T={t}"), &o_g, &o_c, 2e-5);
        let _ = s_c;
    }
}

#[test]
fn cuda_kda_recurrent_matches_cpu() {
    let Some(gpu) = cuda(Precision::F32) else { return };
    for (t, d, seed) in [(40usize, KdaDims { heads: 2, head_dim: 32 }, 5u64), (3, KdaDims { heads: 4, head_dim: 128 }, 6)] {
        let inp = inputs(t, d, seed);
        let (o_ref, s_ref) = run(&CpuBackend, &inp, t, d, false);
        let (o_g, s_g) = run(&gpu, &inp, t, d, false);
        assert_rel(&format!("kda_recurrent output T={t}"), &o_g, &o_ref, 2e-6);
        assert_rel(&format!("kda_recurrent state T={t}"), &s_g, &s_ref, 2e-6);
    }
}

/// A split prefill (two calls carrying the state) equals one call.
#[test]
fn cuda_kda_split_equals_oneshot() {
    let Some(gpu) = cuda(Precision::F32) else { return };
    let d = KdaDims { heads: 2, head_dim: 128 };
    let t = 250;
    let inp = inputs(t, d, 7);
    let (o_full, s_full) = run(&gpu, &inp, t, d, true);
    let c = d.width();
    let p1 = 131;
    let b = &gpu;
    let up = |v: &[f32], r0: usize, r1: usize, w: usize| b.upload(&v[r0 * w..r1 * w], r1 - r0, w).unwrap();
    let mut s = b.upload(&inp.s0, d.heads, d.head_dim * d.head_dim).unwrap();
    let mut o = Vec::new();
    for (r0, r1) in [(0, p1), (p1, t)] {
        let out = b
            .kda_chunked(
                &KdaInputs {
                    q: &up(&inp.q, r0, r1, c),
                    k: &up(&inp.k, r0, r1, c),
                    v: &up(&inp.v, r0, r1, c),
                    g: &up(&inp.g, r0, r1, c),
                    beta: &up(&inp.beta, r0, r1, d.heads),
                },
                &mut s,
                d,
                64,
            )
            .unwrap();
        o.extend(b.download(&out).unwrap());
    }
    assert_rel("split vs one-shot output", &o, &o_full, 1e-5);
    assert_rel("split vs one-shot state", &b.download(&s).unwrap(), &s_full, 1e-5);
}
