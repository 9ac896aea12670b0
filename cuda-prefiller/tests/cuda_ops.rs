//! Elementwise / norm / GEMM / conv / AttnRes kernels against the CPU reference backend, on
//! random inputs, in both precisions. Skips (with the reason printed) when no GPU is present.

mod cuda_util;

use std::borrow::Cow;

use cuda_prefiller::backend::{Backend, HostTensor, KdaDims, MlaDims, SituBetas};
use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::cuda::Precision;
use cuda_util::*;
use k3_protocol::tensors::DType;

fn bf16_weight(name: &str, rows: usize, cols: usize, vals: &[f32]) -> (HostTensor<'static>, Vec<f32>) {
    let (bytes, v) = to_bf16(vals);
    (HostTensor { name: Cow::Owned(name.into()), dtype: DType::BF16, rows, cols, bytes: Cow::Owned(bytes) }, v)
}

/// Runs every op once on backend `b` with inputs from `seed`; returns the named outputs.
fn ops<B: Backend>(b: &B, seed: u64) -> Vec<(&'static str, Vec<f32>)> {
    let mut r = rng(seed);
    let mut out = Vec::new();
    let (t, h) = (77, 256);
    let x = uniform(&mut r, t * h, 2.0);
    let xb = b.upload(&x, t, h).unwrap();
    // gemm with a BF16 weight [out=192, in=256]
    let (wt, _) = bf16_weight("model.layers.0.self_attn.q_proj.weight", 192, h, &normal(&mut r, 192 * h, 0.06));
    let w = b.load_dense(&wt).unwrap();
    out.push(("gemm", b.download(&b.gemm(&xb, &w).unwrap()).unwrap()));
    // rms norm
    let (nw, _) = bf16_weight("model.layers.0.input_layernorm.weight", 1, h, &uniform(&mut r, h, 1.0).iter().map(|v| 1.0 + 0.5 * v).collect::<Vec<_>>());
    let nw = b.load_dense(&nw).unwrap();
    out.push(("rms_norm", b.download(&b.rms_norm(&xb, &nw, 1e-5).unwrap()).unwrap()));
    // situ
    let u = b.upload(&uniform(&mut r, t * h, 30.0), t, h).unwrap();
    let betas = SituBetas { beta: 4.0, linear_beta: Some(25.0) };
    out.push(("situ_glu", b.download(&b.situ_glu(&xb, &u, betas).unwrap()).unwrap()));
    out.push(("situ_glu_linear", b.download(&b.situ_glu(&xb, &u, SituBetas { beta: 4.0, linear_beta: None }).unwrap()).unwrap()));
    out.push(("sigmoid", b.download(&b.sigmoid(&u).unwrap()).unwrap()));
    let mut a = b.upload(&x, t, h).unwrap();
    b.sigmoid_gate_mul(&mut a, &u).unwrap();
    out.push(("sigmoid_gate_mul", b.download(&a).unwrap()));
    let mut a2 = b.upload(&x, t, h).unwrap();
    b.add_assign(&mut a2, &u).unwrap();
    out.push(("add_assign", b.download(&a2).unwrap()));
    let mut dst = b.upload(&uniform(&mut r, 100 * h, 1.0), 100, h).unwrap();
    let s = b.slice_rows(&xb, 10, 20).unwrap();
    b.write_rows(&mut dst, 50, &s).unwrap();
    out.push(("slice_write_rows", b.download(&dst).unwrap()));
    // AttnRes over 4 bank entries + P
    let bank: Vec<B::Buf> = (0..4).map(|i| b.upload(&uniform(&mut r, t * h, 1.0 + i as f32), t, h).unwrap()).collect();
    let refs: Vec<&B::Buf> = bank.iter().collect();
    let (pw, _) = bf16_weight("model.layers.3.mlp_res_proj.weight", 1, h, &normal(&mut r, h, 0.125));
    let pw = b.load_dense(&pw).unwrap();
    out.push(("attn_res_mix", b.download(&b.attn_res_mix(&refs, &xb, &nw, &pw, 1e-5).unwrap()).unwrap()));
    // short conv + window (C = 256, K = 4)
    let cw = HostTensor::from_f32("model.layers.0.self_attn.q_conv1d.weight", h, 4, &uniform(&mut r, h * 4, 0.5));
    let cw = b.load_dense(&cw).unwrap();
    let mut win = b.upload(&uniform(&mut r, 3 * h, 1.0), 3, h).unwrap();
    out.push(("short_conv_silu", b.download(&b.short_conv_silu(&xb, &cw, &mut win).unwrap()).unwrap()));
    out.push(("short_conv_window", b.download(&win).unwrap()));
    let x2 = b.upload(&x[..2 * h], 2, h).unwrap();
    out.push(("short_conv_silu_2rows", b.download(&b.short_conv_silu(&x2, &cw, &mut win).unwrap()).unwrap()));
    out.push(("short_conv_window_2rows", b.download(&win).unwrap()));
    // KDA helpers: 2 heads x 128
    let dims = KdaDims { heads: 2, head_dim: 128 };
    let mut q = b.upload(&x, t, h).unwrap();
    b.l2_norm_heads(&mut q, 128, 1e-6, 1.0 / (128f32).sqrt()).unwrap();
    out.push(("l2_norm_heads", b.download(&q).unwrap()));
    let alog = HostTensor::from_f32("A_log", 1, 2, &normal(&mut r, 2, 0.5));
    let alog = b.load_dense(&alog).unwrap();
    let dtb = HostTensor::from_f32("dt_bias", 1, h, &normal(&mut r, h, 2.0));
    let dtb = b.load_dense(&dtb).unwrap();
    out.push(("kda_gate_bounded", b.download(&b.kda_gate(&xb, &alog, &dtb, dims, Some(-5.0)).unwrap()).unwrap()));
    out.push(("kda_gate_softplus", b.download(&b.kda_gate(&u, &alog, &dtb, dims, None).unwrap()).unwrap()));
    let onw = HostTensor::from_f32("o_norm", 1, 128, &uniform(&mut r, 128, 0.5).iter().map(|v| 1.0 + v).collect::<Vec<_>>());
    let onw = b.load_dense(&onw).unwrap();
    out.push(("gated_rms_norm", b.download(&b.gated_rms_norm(&xb, &u, &onw, 128, 1e-5).unwrap()).unwrap()));
    // MLA latent: kv [t, 512 + 64]
    let md = MlaDims { heads: 2, nope: 128, rope: 64, v: 128, kv_lora: 512 };
    let kv = b.upload(&uniform(&mut r, t * 576, 3.0), t, 576).unwrap();
    let (lw, _) = bf16_weight("kv_a_layernorm.weight", 1, 512, &uniform(&mut r, 512, 0.5).iter().map(|v| 1.0 + v).collect::<Vec<_>>());
    let lw = b.load_dense(&lw).unwrap();
    out.push(("mla_latent", b.download(&b.mla_latent(&kv, &lw, 1e-6, md).unwrap()).unwrap()));
    out
}

fn compare(p: Precision, bounds: &[(&str, f64)], default: f64) {
    let Some(gpu) = cuda(p) else { return };
    for seed in [1u64, 2] {
        let want = ops(&CpuBackend, seed);
        let got = ops(&gpu, seed);
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            let tol = bounds.iter().find(|(n, _)| n == name).map(|x| x.1).unwrap_or(default);
            assert_rel(&format!("{p:?} {name} seed {seed}"), g, w, tol);
        }
    }
}

#[test]
fn cuda_ops_match_cpu_f32() {
    // f32 everywhere: only summation order and libm ulps differ.
    compare(Precision::F32, &[], 2e-6);
}

#[test]
fn cuda_ops_match_cpu_bf16() {
    // BF16 GEMM operands (x rounded to bf16: ~2^-9 relative per element) and BF16-rounded
    // outputs of norms/activations; the pure-f32 ops keep the f32 bound.
    compare(
        Precision::Bf16,
        &[
            ("gemm", 8e-3),
            ("rms_norm", 8e-3),
            ("situ_glu", 8e-3),
            ("situ_glu_linear", 8e-3),
            ("attn_res_mix", 8e-3),
            ("gated_rms_norm", 8e-3),
        ],
        2e-6,
    );
}
