//! Router top-k and the grouped MXFP4 expert GEMMs on the GPU against the CPU reference.
//! Experts are random weights quantised to MXFP4 with the release's scale rule.

mod cuda_util;

use std::borrow::Cow;

use cuda_prefiller::backend::{Backend, ExpertHostWeights, HostTensor, Routing, SituBetas};
use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::cuda::moe_dense::MoePath;
use cuda_prefiller::cuda::{CudaBackend, Precision};
use cuda_util::*;
use k3_protocol::mxfp4::{quantize, Mxfp4Weight};
use k3_protocol::tensors::DType;

struct Ex {
    w: Vec<(Vec<u8>, Vec<u8>)>, // w1, w3, w2 (packed, scale)
}

fn experts(n: usize, inter: usize, latent: usize, seed: u64) -> Vec<Ex> {
    let mut r = rng(seed);
    (0..n)
        .map(|_| {
            let w1 = quantize(&normal(&mut r, inter * latent, 1.0 / (latent as f32).sqrt()), inter, latent);
            let w3 = quantize(&normal(&mut r, inter * latent, 1.0 / (latent as f32).sqrt()), inter, latent);
            let w2 = quantize(&normal(&mut r, latent * inter, 1.0 / (inter as f32).sqrt()), latent, inter);
            Ex { w: vec![w1, w3, w2] }
        })
        .collect()
}

fn host<'a>(ex: &'a [Ex], inter: usize, latent: usize) -> Vec<ExpertHostWeights<'a>> {
    ex.iter()
        .map(|e| ExpertHostWeights {
            w1: Mxfp4Weight::new(&e.w[0].0, &e.w[0].1, inter, latent).unwrap(),
            w3: Mxfp4Weight::new(&e.w[1].0, &e.w[1].1, inter, latent).unwrap(),
            w2: Mxfp4Weight::new(&e.w[2].0, &e.w[2].1, latent, inter).unwrap(),
        })
        .collect()
}

fn run<B: Backend>(b: &B, ex: &[Ex], t: usize, inter: usize, latent: usize, top_k: usize, seed: u64) -> (Vec<u32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut r = rng(seed);
    let e = ex.len();
    let logits = b.upload(&normal(&mut r, t * e, 2.0), t, e).unwrap();
    let bias = b.load_dense(&HostTensor::from_f32("e_score_correction_bias", 1, e, &normal(&mut r, e, 0.05))).unwrap();
    let routing = b.route(&logits, &bias, top_k, true, 1.0).unwrap();
    let x = b.upload(&normal(&mut r, t * latent, 1.0), t, latent).unwrap();
    let experts = b.load_experts(&host(ex, inter, latent)).unwrap();
    let y = b.moe_experts(&x, &routing, &experts, SituBetas { beta: 4.0, linear_beta: Some(25.0) }).unwrap();
    (routing.ids.clone(), routing.weights.clone(), routing.gap.clone(), b.download(&y).unwrap())
}

fn check(p: Precision, tol: f64, cases: &[(usize, usize, usize, usize, usize)]) {
    let Some(mut gpu) = cuda(p) else { return };
    // (expert path, kernel variant): the mma.sync kernel, its first version (`--moe-kernel lds32`),
    // and the dense path (BF16 dequantisation + cuBLAS) in groups of 3 experts and 64-row slices
    let configs: &[(MoePath, &'static str)] =
        if p == Precision::Bf16 { &[(MoePath::Mma, ""), (MoePath::Mma, "_lds32"), (MoePath::Dense, "")] } else { &[(MoePath::Mma, "")] };
    gpu.moe_dense.slice_rows = 64;
    for &(n, inter, latent, t, top_k) in cases {
        let ex = experts(n, inter, latent, 11 + n as u64);
        let (ids_c, w_c, gap_c, y_c) = run(&CpuBackend, &ex, t, inter, latent, top_k, 3);
        dense_groups_of(&mut gpu, 3, inter, latent);
        for &(path, variant) in configs {
            gpu.moe_path = path;
            gpu.moe_variant = variant;
            let (ids_g, w_g, gap_g, y_g) = run(&gpu, &ex, t, inter, latent, top_k, 3);
            assert_eq!(ids_g, ids_c, "router selections differ");
            assert_rel("router weights", &w_g, &w_c, 1e-6);
            assert_rel("router gap", &gap_g, &gap_c, 1e-5);
            assert_rel(&format!("{p:?} {path:?}{variant} experts E={n} I={inter} L={latent} T={t} k={top_k}"), &y_g, &y_c, tol);
        }
    }
}

/// Sizes the dense path's weight buffers for groups of `g` experts.
fn dense_groups_of(gpu: &mut CudaBackend, g: usize, inter: usize, latent: usize) {
    gpu.moe_dense.weight_bytes = 2 * g * 3 * inter * latent * 2;
}

/// Uneven routing: experts with no rows next to experts with every token, ids fixed by hand.
/// `pick(t, j)` gives the expert of slot j of token t.
fn uneven(
    gpu: &mut CudaBackend,
    n: usize,
    inter: usize,
    latent: usize,
    t: usize,
    top_k: usize,
    pick: impl Fn(usize, usize) -> u32,
    group: usize,
    slice: usize,
) {
    let ex = experts(n, inter, latent, 40 + n as u64);
    let hw = host(&ex, inter, latent);
    let mut r = rng(5);
    let ids: Vec<u32> = (0..t * top_k).map(|i| pick(i / top_k, i % top_k)).collect();
    let counts: Vec<usize> = (0..n).map(|e| ids.iter().filter(|&&i| i as usize == e).count()).collect();
    assert!(counts.contains(&0) && counts.iter().any(|&c| c >= t / 2), "routing is not uneven: {counts:?}");
    let weights: Vec<f32> = uniform(&mut r, t * top_k, 1.0).iter().map(|w| 0.25 + w.abs()).collect();
    let routing = Routing { top_k, ids, weights, gap: vec![1.0; t] };
    let x = normal(&mut r, t * latent, 1.0);
    let betas = SituBetas { beta: 4.0, linear_beta: Some(25.0) };
    let ce = CpuBackend.load_experts(&hw).unwrap();
    let want = CpuBackend.download(&CpuBackend.moe_experts(&CpuBackend.upload(&x, t, latent).unwrap(), &routing, &ce, betas).unwrap()).unwrap();
    let ge = gpu.load_experts(&hw).unwrap();
    let xg = gpu.upload(&x, t, latent).unwrap();
    dense_groups_of(gpu, group, inter, latent);
    gpu.moe_dense.slice_rows = slice;
    // the dense path also with each piece's GEMMs over rows rounded up to 64 (spare rows dropped)
    for (path, grain) in [(MoePath::Dense, 1), (MoePath::Dense, 64), (MoePath::Mma, 1)] {
        gpu.moe_path = path;
        gpu.moe_dense.row_grain = grain;
        let got = gpu.download(&gpu.moe_experts(&xg, &routing, &ge, betas).unwrap()).unwrap();
        assert_rel(
            &format!("Bf16 {path:?} row_grain {grain} uneven routing E={n} I={inter} L={latent} T={t} k={top_k} rows/expert {counts:?}"),
            &got,
            &want,
            1e-2,
        );
    }
    gpu.moe_dense.row_grain = 1;
}

#[test]
fn cuda_moe_dense_uneven_routing_bf16() {
    let Some(mut gpu) = cuda(Precision::Bf16) else { return };
    // 16 experts, top-4: expert 0 gets every token (11 slices of 64 rows), 3 almost every one,
    // 9 a few, 4..8, 10, 11, 14, 15 none; groups of 3 experts (some groups empty, skipped)
    let pick = |t: usize, j: usize| -> u32 {
        match j {
            0 => 0,
            1 => 1 + (t % 2) as u32,
            2 => {
                if t.is_multiple_of(50) {
                    9
                } else {
                    3
                }
            }
            _ => 12 + t.is_multiple_of(4) as u32,
        }
    };
    uneven(&mut gpu, 16, 192, 256, 700, 4, pick, 3, 64);
    // K3 widths: 6 experts, top-2, experts 1, 3, 4 without rows, groups of 2
    uneven(
        &mut gpu,
        6,
        3072,
        3584,
        64,
        2,
        |t, j| {
            if j == 0 {
                0
            } else if t % 16 == 0 {
                5
            } else {
                2
            }
        },
        2,
        8192,
    );
}

/// The dense path's BF16 copy of the MXFP4 weights is exact: every bit equals the host decode,
/// over the whole E8M0 range (scales 0..=254: subnormal, normal, overflow to ±inf) and all codes.
#[test]
fn cuda_mxfp4_dequant_bf16_bit_exact() {
    let Some(gpu) = cuda(Precision::Bf16) else { return };
    use rand::Rng;
    let (n, inter, latent) = (3, 96, 128);
    let mut r = rng(21);
    let ex: Vec<Ex> = (0..n)
        .map(|_| {
            let mut mat = |o: usize, i: usize| -> (Vec<u8>, Vec<u8>) {
                ((0..o * i / 2).map(|_| r.gen::<u8>()).collect(), (0..o * i / 32).map(|_| r.gen_range(0u8..=254)).collect())
            };
            Ex { w: vec![mat(inter, latent), mat(inter, latent), mat(latent, inter)] }
        })
        .collect();
    let hw = host(&ex, inter, latent);
    let ge = gpu.load_experts(&hw).unwrap();
    let per = 3 * inter * latent;
    let (lo, hi) = (1, 3);
    let d = gpu.moe_dequant_bf16(&ge, lo, hi).unwrap();
    let mut got = vec![0u16; (hi - lo) * per];
    gpu.gpu.dtoh(&mut got, d.ptr).unwrap();
    let mut checked = 0;
    for e in lo..hi {
        let want: Vec<f32> = [&hw[e].w1, &hw[e].w3, &hw[e].w2].iter().flat_map(|w| w.decode()).collect();
        assert_eq!(want.len(), per);
        for (i, &v) in want.iter().enumerate() {
            let b = half::bf16::from_f32(v);
            assert_eq!(b.to_f32().to_bits(), v.to_bits(), "host value {v:e} is not a bf16");
            assert_eq!(got[(e - lo) * per + i], b.to_bits(), "expert {e} element {i}: device {:#06x}, host {v:e}", got[(e - lo) * per + i]);
            checked += 1;
        }
    }
    eprintln!("dequant bf16: {checked} values bit-identical (incl. {} infinities)", got.iter().filter(|&&b| b & 0x7fff == 0x7f80).count());
}

#[test]
fn cuda_moe_matches_cpu_f32() {
    check(Precision::F32, 2e-6, &[(16, 64, 64, 300, 4), (8, 192, 256, 100, 2)]);
}

#[test]
fn cuda_moe_matches_cpu_bf16() {
    // bf16 activations (weights are exact in bf16 after MXFP4 dequantisation)
    check(Precision::Bf16, 1e-2, &[(16, 64, 64, 300, 4), (8, 192, 256, 100, 2), (4, 3072, 3584, 40, 2)]);
}

/// MXFP4 dequantisation on the GPU is bit-exact: an identity-like input picks out weight columns.
#[test]
fn cuda_mxfp4_dequant_bit_exact() {
    let Some(gpu) = cuda(Precision::F32) else { return };
    let (inter, latent) = (64, 64);
    let ex = experts(1, inter, latent, 99);
    let hw = host(&ex, inter, latent);
    let experts = gpu.load_experts(&hw).unwrap();
    // x = unit vectors; the linear up-branch and a huge beta make SiTU nearly linear... instead
    // check the down projection through a one-hot routed row: y = W2 · situ(W1 e_i, W3 e_i).
    // Compare with the host decode of the same bytes, exactly in f32 arithmetic of the CPU ref.
    let mut x = vec![0f32; latent * latent];
    for i in 0..latent {
        x[i * latent + i] = 1.0;
    }
    let xb = gpu.upload(&x, latent, latent).unwrap();
    let routing = cuda_prefiller::backend::Routing { top_k: 1, ids: vec![0; latent], weights: vec![1.0; latent], gap: vec![1.0; latent] };
    let y = gpu.download(&gpu.moe_experts(&xb, &routing, &experts, SituBetas { beta: 4.0, linear_beta: Some(25.0) }).unwrap()).unwrap();
    let cpu_e = CpuBackend.load_experts(&hw).unwrap();
    let xc = CpuBackend.upload(&x, latent, latent).unwrap();
    let yc = CpuBackend.download(&CpuBackend.moe_experts(&xc, &routing, &cpu_e, SituBetas { beta: 4.0, linear_beta: Some(25.0) }).unwrap()).unwrap();
    assert_rel("one-hot expert outputs", &y, &yc, 1e-6);
    let _ = (DType::U8, Cow::Borrowed("unused"));
}

/// `moe_experts_many` (the token chunks of one layer in one pass over the experts; on the dense
/// path each expert group is dequantised once for all chunks) gives each chunk what
/// `moe_experts` gives it alone, on both BF16 paths, with uneven chunk sizes (one of 1 row).
#[test]
fn cuda_moe_many_chunks_equal_one_by_one() {
    let Some(mut gpu) = cuda(Precision::Bf16) else { return };
    let (n, inter, latent, top_k) = (16, 192, 256, 4);
    let ex = experts(n, inter, latent, 77);
    let hw = host(&ex, inter, latent);
    let ge = gpu.load_experts(&hw).unwrap();
    let betas = SituBetas { beta: 4.0, linear_beta: Some(25.0) };
    let mut r = rng(9);
    let chunks: Vec<(usize, Routing, Vec<f32>)> = [300usize, 1, 399]
        .iter()
        .map(|&t| {
            let ids: Vec<u32> = (0..t * top_k).map(|i| ((i * 7 + i / top_k) % n) as u32).collect();
            let weights: Vec<f32> = uniform(&mut r, t * top_k, 1.0).iter().map(|w| 0.25 + w.abs()).collect();
            (t, Routing { top_k, ids, weights, gap: vec![1.0; t] }, normal(&mut r, t * latent, 1.0))
        })
        .collect();
    dense_groups_of(&mut gpu, 3, inter, latent);
    gpu.moe_dense.slice_rows = 64;
    for path in [MoePath::Dense, MoePath::Mma] {
        gpu.moe_path = path;
        let xs: Vec<_> = chunks.iter().map(|(t, _, x)| gpu.upload(x, *t, latent).unwrap()).collect();
        let inputs: Vec<(&_, &Routing)> = xs.iter().zip(&chunks).map(|(x, c)| (x, &c.1)).collect();
        let many = gpu.moe_experts_many(&inputs, &ge, betas).unwrap();
        assert_eq!(many.len(), chunks.len());
        for (ci, ((x, routing), y)) in inputs.iter().zip(&many).enumerate() {
            let alone = gpu.download(&gpu.moe_experts(x, routing, &ge, betas).unwrap()).unwrap();
            let got = gpu.download(y).unwrap();
            let d = rel(&got, &alone);
            eprintln!("{path:?}: chunk {ci} ({} rows): all chunks in one pass vs alone: rel diff {d:.2e}", routing.rows());
            assert!(d <= 1e-6, "{path:?}: chunk {ci} differs by {d:.2e} when run with the other chunks");
        }
    }
}
