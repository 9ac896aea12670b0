//! Causal MLA prefill attention on the GPU against the CPU reference (expanded form), with the
//! real K3 head widths (qk 192, v 128) and the tiny ones, from position 0 and mid-sequence.

mod cuda_util;

use std::borrow::Cow;

use cuda_prefiller::backend::{Backend, HostTensor, MlaDims, MlaForm};
use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::cuda::kernels::{MlaKernel, MLA_SM90_VARIANTS};
use cuda_prefiller::cuda::{CudaBackend, Precision};
use cuda_util::*;
use k3_protocol::tensors::DType;

fn run<B: Backend>(b: &B, dm: MlaDims, tq: usize, pos0: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    let tk = pos0 + tq;
    let q = normal(&mut r, tq * dm.heads * dm.qk(), 1.0);
    let cache = normal(&mut r, tk * dm.latent(), 1.0);
    let (kvb, _) = to_bf16(&normal(&mut r, dm.heads * (dm.nope + dm.v) * dm.kv_lora, 1.5 / (dm.kv_lora as f32).sqrt()));
    let w = b
        .load_dense(&HostTensor {
            name: Cow::Borrowed("kv_b_proj.weight"),
            dtype: DType::BF16,
            rows: dm.heads * (dm.nope + dm.v),
            cols: dm.kv_lora,
            bytes: Cow::Owned(kvb),
        })
        .unwrap();
    let qb = b.upload(&q, tq, dm.heads * dm.qk()).unwrap();
    let cb = b.upload(&cache, tk, dm.latent()).unwrap();
    b.download(&b.mla_attention(&qb, &cb, &w, dm, pos0, MlaForm::Expanded).unwrap()).unwrap()
}

fn check(p: Precision, tol: f64) {
    let Some(gpu) = cuda(p) else { return };
    check_on(&gpu, p, tol);
}

fn check_on(gpu: &CudaBackend, p: Precision, tol: f64) {
    let k3 = MlaDims { heads: 4, nope: 128, rope: 64, v: 128, kv_lora: 512 };
    let tiny = MlaDims { heads: 2, nope: 32, rope: 16, v: 32, kv_lora: 64 };
    for (dm, tq, pos0, seed) in [(k3, 300usize, 0usize, 1u64), (k3, 77, 190, 2), (tiny, 300, 0, 3), (tiny, 1, 299, 4), (k3, 1, 40, 5)] {
        let want = run(&CpuBackend, dm, tq, pos0, seed);
        let got = run(gpu, dm, tq, pos0, seed);
        assert_rel(&format!("{p:?} {:?} mla_attention qk={} tq={tq} pos0={pos0}", gpu.mla_kernel, dm.qk()), &got, &want, tol);
    }
}

#[test]
fn cuda_mla_attention_matches_cpu_f32() {
    check(Precision::F32, 2e-5);
}

#[test]
fn cuda_mla_attention_matches_cpu_bf16() {
    // bf16 q/k/v and probabilities, f32 softmax and accumulation; the kernel the device picks
    check(Precision::Bf16, 2e-2);
}

#[test]
fn cuda_mla_attention_mma_sync_matches_cpu_bf16() {
    // the mma.sync kernel (every architecture), also where the device would pick wgmma
    let Some(mut gpu) = cuda(Precision::Bf16) else { return };
    gpu.mla_kernel = MlaKernel::MmaSync;
    check_on(&gpu, Precision::Bf16, 2e-2);
}

#[test]
fn cuda_mla_attention_wgmma_matches_cpu_bf16() {
    let Some(mut gpu) = cuda(Precision::Bf16) else { return };
    if gpu.gpu.cc != (9, 0) {
        eprintln!("SKIPPED: the wgmma kernel is sm_90 only (device is sm_{}{})", gpu.gpu.cc.0, gpu.gpu.cc.1);
        return;
    }
    let k3 = MlaDims { heads: 4, nope: 128, rope: 64, v: 128, kv_lora: 512 };
    let qk128 = MlaDims { heads: 3, nope: 64, rope: 64, v: 128, kv_lora: 256 };
    let two = MlaDims { heads: 2, ..k3 };
    // every configuration (`--mla-kernel wgmma:<name>` picks among the same list)
    for var in MLA_SM90_VARIANTS {
        gpu.mla_kernel = MlaKernel::Wgmma(var); // an error (not a fallback) if it does not apply
                                                // several query blocks and key tiles, T not a multiple of the tiles, split prefill (pos0 > 0
                                                // and not a multiple of the tiles), a single row, another q/k width
        for (dm, tq, pos0, seed) in
            [(k3, 300usize, 0usize, 11u64), (k3, 77, 190, 12), (k3, 260, 131, 13), (k3, 1, 40, 14), (k3, 128, 0, 15), (qk128, 200, 57, 16), (two, 1100, 0, 17)]
        {
            let want = run(&CpuBackend, dm, tq, pos0, seed);
            let got = run(&gpu, dm, tq, pos0, seed);
            assert_rel(&format!("{} mla_attention qk={} heads={} tq={tq} pos0={pos0}", var.name, dm.qk(), dm.heads), &got, &want, 2e-2);
        }
    }
}

/// The BF16 path expands and packs the keys block by block (`mla_key_block`): block edges that
/// fall inside query tiles, a partial last block, a context of one block and a half, and split
/// prefill, on the kernel the device picks and on mma.sync — against the CPU reference and
/// against the same backend with one block for the whole context.
#[test]
fn cuda_mla_attention_keys_in_blocks_match_one_block_bf16() {
    let Some(mut gpu) = cuda(Precision::Bf16) else { return };
    let k3 = MlaDims { heads: 4, nope: 128, rope: 64, v: 128, kv_lora: 512 };
    let kernels = [gpu.mla_kernel, MlaKernel::MmaSync];
    for kernel in kernels {
        gpu.mla_kernel = kernel;
        for (block, tq, pos0, seed) in [(128usize, 300usize, 0usize, 21u64), (256, 77, 190, 22), (384, 576, 0, 23), (128, 1, 299, 24), (640, 260, 131, 25)] {
            gpu.mla_key_block = usize::MAX;
            let whole = run(&gpu, k3, tq, pos0, seed);
            gpu.mla_key_block = block;
            let got = run(&gpu, k3, tq, pos0, seed);
            let want = run(&CpuBackend, k3, tq, pos0, seed);
            let what = format!("{kernel:?} mla_attention keys in blocks of {block}, tq={tq} pos0={pos0}");
            assert_rel(&what, &got, &want, 2e-2);
            // cuBLAS may pick another algorithm for the block's rows: close, not bit-equal
            assert_rel(&format!("{what}, against one block"), &got, &whole, 5e-3);
        }
    }
}
