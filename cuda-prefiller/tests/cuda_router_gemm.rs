//! The router's f32-weight GEMM in BF16 mode: from `SPLIT_GEMM_MIN_ROWS` rows it runs as six
//! BF16 part products on the tensor cores (kernels/bf16_split.cu); it must stay at FP32 grade
//! (the spec keeps router math in FP32): within 10x of IEEE fp32 cuBLAS's distance to the
//! float64 product, ~1000x closer than one BF16 pass. Skips without a GPU.

mod cuda_util;

use cuda_prefiller::backend::{Backend, HostTensor};
use cuda_prefiller::cuda::{Precision, SPLIT_GEMM_MIN_ROWS};
use cuda_util::*;

/// Per-row relative error of `got` against the float64 product of `x` and `wᵀ`; the worst row.
fn worst_row_err(got: &[f32], x: &[f32], w: &[f32], rows: usize, n: usize, k: usize) -> f64 {
    let mut worst = 0f64;
    for r in 0..rows {
        let (mut num, mut den) = (0f64, 0f64);
        for j in 0..n {
            let want: f64 = (0..k).map(|i| x[r * k + i] as f64 * w[j * k + i] as f64).sum();
            num += (got[r * n + j] as f64 - want).powi(2);
            den += want * want;
        }
        worst = worst.max((num / den.max(1e-300)).sqrt());
    }
    worst
}

#[test]
fn router_gemm_in_bf16_mode_is_fp32_grade() {
    let (Some(bf), Some(f32b)) = (cuda(Precision::Bf16), cuda(Precision::F32)) else { return };
    let (n, k) = (96, 1536);
    let mut r = rng(11);
    let w: Vec<f32> = normal(&mut r, n * k, 0.03);
    let wt = HostTensor::from_f32("model.layers.1.block_sparse_moe.gate.weight", n, k, &w);
    for rows in [SPLIT_GEMM_MIN_ROWS + 77, 100] {
        // activations with a wide dynamic range (RMSNorm outputs times gains, a few outliers)
        let x: Vec<f32> = normal(&mut r, rows * k, 1.0).iter().enumerate().map(|(i, v)| if i % 97 == 0 { v * 300.0 } else { *v }).collect();
        let mut errs = Vec::new();
        for (name, b) in [("bf16 mode", &bf), ("f32 mode", &f32b)] {
            let xb = b.upload(&x, rows, k).unwrap();
            let wd = b.load_dense(&wt).unwrap();
            let y = b.download(&b.gemm(&xb, &wd).unwrap()).unwrap();
            let e = worst_row_err(&y, &x, &w, rows, n, k);
            eprintln!("router gemm {rows} x {k} -> {n}, {name}: worst row rel err vs float64 {e:.3e}");
            errs.push(e);
        }
        // IEEE fp32 over k = 1536: 3.6e-7 on the H200; the split: 2.7e-6 (the tensor cores'
        // f32 accumulation truncates; ~sqrt(k) * 2^-24); one BF16 pass would be ~3e-3
        assert!(errs[0] <= 1e-5, "{rows} rows: BF16-mode router GEMM error {:.3e} is not FP32 grade", errs[0]);
        assert!(errs[1] <= 2e-6, "{rows} rows: F32-mode router GEMM error {:.3e}", errs[1]);
    }
}
