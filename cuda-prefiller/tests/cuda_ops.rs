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
        &[("gemm", 8e-3), ("rms_norm", 8e-3), ("situ_glu", 8e-3), ("situ_glu_linear", 8e-3), ("attn_res_mix", 8e-3), ("gated_rms_norm", 8e-3)],
        2e-6,
    );
}

/// The elementwise ops at other shapes: widths that are not a multiple of 4 (the scalar
/// kernels), K3's hidden width with 8 bank entries (the AttnRes kernel without prefetch, 7
/// float4s per thread), heads of 132 (two float4s per lane, part of a warp idle), conv windows of
/// 3 and 9, row counts that are not a multiple of any block or row run. `(t, h, head_dim, bank
/// entries, conv taps)`.
const SHAPES: [(usize, usize, usize, usize, usize); 4] = [(45, 250, 50, 2, 4), (33, 7168, 128, 8, 4), (19, 264, 132, 1, 3), (70, 384, 128, 3, 9)];

fn shaped_ops<B: Backend>(b: &B, seed: u64, (t, h, d, nbank, kc): (usize, usize, usize, usize, usize)) -> Vec<(String, Vec<f32>)> {
    let mut r = rng(seed);
    let mut out = Vec::new();
    let x = uniform(&mut r, t * h, 2.0);
    let xb = b.upload(&x, t, h).unwrap();
    let u = b.upload(&uniform(&mut r, t * h, 30.0), t, h).unwrap();
    let nw = b.load_dense(&HostTensor::from_f32("norm", 1, h, &uniform(&mut r, h, 0.5).iter().map(|v| 1.0 + v).collect::<Vec<_>>())).unwrap();
    out.push(("rms_norm".to_string(), b.download(&b.rms_norm(&xb, &nw, 1e-5).unwrap()).unwrap()));
    out.push(("situ_glu".to_string(), b.download(&b.situ_glu(&xb, &u, SituBetas { beta: 4.0, linear_beta: Some(25.0) }).unwrap()).unwrap()));
    let mut a = b.upload(&x, t, h).unwrap();
    b.sigmoid_gate_mul(&mut a, &u).unwrap();
    out.push(("sigmoid_gate_mul".to_string(), b.download(&a).unwrap()));
    b.add_assign(&mut a, &u).unwrap();
    out.push(("add_assign".to_string(), b.download(&a).unwrap()));
    let bank: Vec<B::Buf> = (0..nbank).map(|i| b.upload(&uniform(&mut r, t * h, 0.5 + i as f32), t, h).unwrap()).collect();
    let refs: Vec<&B::Buf> = bank.iter().collect();
    let pw = b.load_dense(&HostTensor::from_f32("proj", 1, h, &normal(&mut r, h, 0.125))).unwrap();
    out.push(("attn_res_mix".to_string(), b.download(&b.attn_res_mix(&refs, &xb, &nw, &pw, 1e-5).unwrap()).unwrap()));
    let cw = b.load_dense(&HostTensor::from_f32("q_conv1d", h, kc, &uniform(&mut r, h * kc, 0.5))).unwrap();
    let win0 = uniform(&mut r, (kc - 1) * h, 1.0);
    let mut win = b.upload(&win0, kc - 1, h).unwrap();
    out.push(("short_conv_silu".to_string(), b.download(&b.short_conv_silu(&xb, &cw, &mut win).unwrap()).unwrap()));
    out.push(("short_conv_window".to_string(), b.download(&win).unwrap()));
    let mut win = b.upload(&win0, kc - 1, h).unwrap();
    let scale = 1.0 / (d as f32).sqrt();
    out.push(("short_conv_silu_l2".to_string(), b.download(&b.short_conv_silu_l2(&xb, &cw, &mut win, d, 1e-6, scale).unwrap()).unwrap()));
    out.push(("short_conv_l2_window".to_string(), b.download(&win).unwrap()));
    let mut q = b.upload(&x, t, h).unwrap();
    b.l2_norm_heads(&mut q, d, 1e-6, scale).unwrap();
    out.push(("l2_norm_heads".to_string(), b.download(&q).unwrap()));
    let dims = KdaDims { heads: h / d, head_dim: d };
    let alog = b.load_dense(&HostTensor::from_f32("A_log", 1, h / d, &normal(&mut r, h / d, 0.5))).unwrap();
    let dtb = b.load_dense(&HostTensor::from_f32("dt_bias", 1, h, &normal(&mut r, h, 2.0))).unwrap();
    out.push(("kda_gate_bounded".to_string(), b.download(&b.kda_gate(&xb, &alog, &dtb, dims, Some(-5.0)).unwrap()).unwrap()));
    out.push(("kda_gate_softplus".to_string(), b.download(&b.kda_gate(&u, &alog, &dtb, dims, None).unwrap()).unwrap()));
    let onw = b.load_dense(&HostTensor::from_f32("o_norm", 1, d, &uniform(&mut r, d, 0.5).iter().map(|v| 1.0 + v).collect::<Vec<_>>())).unwrap();
    out.push(("gated_rms_norm".to_string(), b.download(&b.gated_rms_norm(&xb, &u, &onw, d, 1e-5).unwrap()).unwrap()));
    out
}

fn compare_shapes(p: Precision, bounds: &[(&str, f64)], default: f64) {
    let Some(gpu) = cuda(p) else { return };
    for shape in SHAPES {
        let want = shaped_ops(&CpuBackend, 3, shape);
        let got = shaped_ops(&gpu, 3, shape);
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            let tol = bounds.iter().find(|(n, _)| n == name).map(|x| x.1).unwrap_or(default);
            assert_rel(&format!("{p:?} {name} {shape:?}"), g, w, tol);
        }
    }
}

#[test]
fn cuda_ops_shapes_match_cpu_f32() {
    compare_shapes(Precision::F32, &[], 2e-6);
}

#[test]
fn cuda_ops_shapes_match_cpu_bf16() {
    // the same bounds as cuda_ops_match_cpu_bf16: BF16-rounded outputs of norms/activations
    compare_shapes(Precision::Bf16, &[("rms_norm", 8e-3), ("situ_glu", 8e-3), ("attn_res_mix", 8e-3), ("gated_rms_norm", 8e-3)], 2e-6);
}

/// The launchers with row strides (views into wider buffers: float4 strides and odd strides),
/// and both AttnRes float4 kernels (with and without prefetch) forced, against the CPU functions.
#[test]
fn cuda_strided_kernels_match_cpu() {
    use cuda_prefiller::cuda::kernels::{self as k, AttnResKernel};
    use cuda_prefiller::{act, cpu};
    let Some(b) = cuda(Precision::F32) else { return };
    let g = &b.gpu;
    let mut r = rng(11);
    let (t, n) = (37usize, 96usize);
    // a [t, n] view at column `off` of a [t, ld] buffer
    let view = |v: &[f32], ld: usize| -> Vec<f32> { (0..t).flat_map(|i| v[i * ld..i * ld + n].to_vec()).collect() };
    for (ld, off) in [(n + 4, 4usize), (n + 3, 1)] {
        let what = format!("stride {ld}, column offset {off}");
        let xw = uniform(&mut r, t * ld + off, 3.0);
        let uw = uniform(&mut r, t * ld + off, 30.0);
        let xb = b.upload(&xw, 1, xw.len()).unwrap();
        let ub = b.upload(&uw, 1, uw.len()).unwrap();
        let (xp, up) = (xb.ptr() + 4 * off as u64, ub.ptr() + 4 * off as u64);
        let x = view(&xw[off..], ld);
        let u = view(&uw[off..], ld);
        // f32 -> bf16 (the GEMM input): bit-exact round to nearest even
        let ob = g.alloc(t * n * 2).unwrap();
        k::f32_to_bf16_2d(g, xp, ld, ob.ptr, t, n).unwrap();
        let mut bits = vec![0u16; t * n];
        g.dtoh(&mut bits, ob.ptr).unwrap();
        let want: Vec<u16> = x.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
        assert_eq!(bits, want, "f32_to_bf16_2d, {what}");
        // SiTU into a strided output
        let ow = b.zeros(1, t * ld + off).unwrap();
        let op = ow.ptr() + 4 * off as u64;
        k::situ_glu(g, xp, ld, up, ld, op, ld, t, n, 4.0, 25.0, false).unwrap();
        let got = view(&b.download(&ow).unwrap()[off..], ld);
        assert_rel(&format!("situ_glu, {what}"), &got, &act::situ_glu(&x, &u, 4.0, Some(25.0)), 2e-6);
        // y *= sigmoid(g) in place on the strided x view
        k::mul_sigmoid(g, xp, ld, up, ld, t, n).unwrap();
        let got = view(&b.download(&xb).unwrap()[off..], ld);
        let mut want = x.clone();
        act::sigmoid_gate_mul(&mut want, &u);
        assert_rel(&format!("mul_sigmoid, {what}"), &got, &want, 2e-6);
        // RMSNorm from the strided u view into the strided output
        let w: Vec<f32> = uniform(&mut r, n, 0.5).iter().map(|v| 1.0 + v).collect();
        let wb = b.upload(&w, 1, n).unwrap();
        k::rmsnorm_rows(g, up, ld, wb.ptr(), op, ld, t, n, 1e-5, false).unwrap();
        let got = view(&b.download(&ow).unwrap()[off..], ld);
        assert_rel(&format!("rmsnorm_rows, {what}"), &got, &cpu::norm::rms_norm(&u, n, &w, 1e-5), 2e-6);
        // short conv from the strided u view into the strided output (window of 3 previous rows)
        let cw = uniform(&mut r, n * 4, 0.5);
        let cwb = b.upload(&cw, n, 4).unwrap();
        let win = uniform(&mut r, 3 * n, 1.0);
        let winb = b.upload(&win, 3, n).unwrap();
        k::short_conv_silu(g, up, ld, winb.ptr(), cwb.ptr(), op, ld, t, n, 4).unwrap();
        let got = view(&b.download(&ow).unwrap()[off..], ld);
        assert_rel(&format!("short_conv_silu, {what}"), &got, &cpu::conv::short_conv_silu(&u, n, &cw, 4, &win).0, 2e-6);
        // gated norm (heads of 32) with a strided gate
        let o = uniform(&mut r, t * n, 2.0);
        let obuf = b.upload(&o, t, n).unwrap();
        let ow2 = b.empty(t, n).unwrap();
        let w32: Vec<f32> = uniform(&mut r, 32, 0.5).iter().map(|v| 1.0 + v).collect();
        let w32b = b.upload(&w32, 1, 32).unwrap();
        k::kda_gated_norm(g, obuf.ptr(), up, ld, w32b.ptr(), ow2.ptr(), t, n / 32, 32, 1e-5, false).unwrap();
        let c = CpuBackend;
        let want = c
            .gated_rms_norm(
                &c.upload(&o, t, n).unwrap(),
                &c.upload(&u, t, n).unwrap(),
                &c.load_dense(&HostTensor::from_f32("o_norm", 1, 32, &w32)).unwrap(),
                32,
                1e-5,
            )
            .unwrap();
        assert_rel(&format!("kda_gated_norm, {what}"), &b.download(&ow2).unwrap(), &c.download(&want).unwrap(), 2e-6);
    }
    // AttnRes: both float4 kernels forced, at K3's hidden width and at a narrow one
    for (h, nbank) in [(7168usize, 3usize), (256, 6)] {
        let cands: Vec<Vec<f32>> = (0..=nbank).map(|i| uniform(&mut r, t * h, 0.5 + i as f32)).collect();
        let bufs: Vec<_> = cands.iter().map(|c| b.upload(c, t, h).unwrap()).collect();
        let nw: Vec<f32> = uniform(&mut r, h, 0.5).iter().map(|v| 1.0 + v).collect();
        let pw = normal(&mut r, h, 0.125);
        let (nwb, pwb) = (b.upload(&nw, 1, h).unwrap(), b.upload(&pw, 1, h).unwrap());
        let refs: Vec<&[f32]> = cands[..nbank].iter().map(|c| c.as_slice()).collect();
        let want = cpu::attn_res::attn_res_mix(&refs, &cands[nbank], h, &nw, &pw, 1e-5);
        let ptrs: Vec<u64> = bufs[..nbank].iter().map(|c| c.ptr()).collect();
        for kern in [AttnResKernel::Vec4 { prefetch: true }, AttnResKernel::Vec4 { prefetch: false }, AttnResKernel::Scalar] {
            let out = b.empty(t, h).unwrap();
            k::attnres_mix_variant(g, kern, &ptrs, bufs[nbank].ptr(), nwb.ptr(), pwb.ptr(), out.ptr(), t, h, 1e-5, false).unwrap();
            assert_rel(&format!("attnres_mix {kern:?}, width {h}, {nbank} bank entries"), &b.download(&out).unwrap(), &want, 2e-6);
        }
    }
}
