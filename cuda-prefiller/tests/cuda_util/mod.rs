//! Shared helpers of the CUDA tests: skip cleanly without a GPU, random inputs, error norms.
#![allow(dead_code)]

use cuda_prefiller::cuda::{CudaBackend, CudaOptions, Precision};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The CUDA backend (its default options), or `None` after printing why the test is skipped
/// (CI has no GPU).
pub(crate) fn cuda(p: Precision) -> Option<CudaBackend> {
    match cuda_prefiller::cuda::probe() {
        Err(why) => {
            eprintln!("SKIPPED: no usable CUDA device: {why}");
            None
        }
        Ok(_) => match CudaBackend::new(p, &CudaOptions::default()) {
            Ok(b) => Some(b),
            Err(e) => panic!("a CUDA device is present but the backend failed to start: {e:#}"),
        },
    }
}

pub(crate) use k3_protocol::testdata::rel_l2 as rel;

pub(crate) fn assert_rel(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let r = rel(got, want);
    eprintln!("{what}: rel err {r:.3e} (bound {tol:.1e})");
    assert!(r <= tol, "{what}: relative error {r:.3e} exceeds {tol:.1e}");
}

pub(crate) fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Uniform in [-a, a), never all zeros.
pub(crate) fn uniform(r: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(-a..a)).collect()
}

/// Approximately normal (sum of uniforms) with standard deviation `s`.
pub(crate) fn normal(r: &mut StdRng, n: usize, s: f32) -> Vec<f32> {
    (0..n).map(|_| (0..4).map(|_| r.gen_range(-1.0f32..1.0)).sum::<f32>() * s * 0.866).collect()
}

/// BF16 bytes (round to nearest even) of f32 values, and the values they hold.
pub(crate) fn to_bf16(v: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::with_capacity(v.len() * 2);
    let mut vals = Vec::with_capacity(v.len());
    for &x in v {
        let h = half::bf16::from_f32(x);
        bytes.extend_from_slice(&h.to_bits().to_le_bytes());
        vals.push(h.to_f32());
    }
    (bytes, vals)
}
