//! `k3-prefill bench --kernels --elementwise-only`: the memory-bound f32 ops of a real-width K3
//! layer timed one by one (K3 widths: hidden 7168, KDA 96 heads x 128, shared experts 6144), as
//! the backend runs them, with the bytes each must move at least (every input read once, every
//! output written once) turned into GB/s. A device-to-device copy of the same size is the
//! practical bandwidth ceiling printed first.

use anyhow::Result;
use k3_protocol::config::spec::KDA_L2_EPS;

use crate::backend::{Backend, HostTensor, KdaDims, SituBetas};
use crate::cuda::backend::CudaBuf;
use crate::cuda::kernels::{self, AttnResKernel};
use crate::cuda::{CudaBackend, Precision};

/// Reference bandwidth the brief measures against (H200 HBM3e, achievable), GB/s.
const REF_GBS: f64 = 4300.0;

/// A `[rows, cols]` buffer of pseudo-random values in `[lo, hi)`: 256 distinct rows made on the
/// host, repeated on the device (the values do not matter for timing, only that they are finite
/// and not all equal).
fn rand_buf(b: &CudaBackend, rows: usize, cols: usize, seed: u64, lo: f32, hi: f32) -> Result<CudaBuf> {
    let base = rows.min(256);
    let v: Vec<f32> = (0..base * cols)
        .map(|i| {
            let h = ((i as u64) ^ seed.wrapping_mul(0xA076_1D64_78BD_642F)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            lo + (hi - lo) * (h as f32 / (1u64 << 24) as f32)
        })
        .collect();
    let out = b.empty(rows, cols)?;
    b.gpu.htod(out.ptr(), &v)?;
    let mut have = base;
    while have < rows {
        let n = have.min(rows - have);
        b.gpu.dtod(out.row(have), out.ptr(), n * cols * 4)?;
        have += n;
    }
    Ok(out)
}

/// Median milliseconds of `reps` timed calls of `f` (after one untimed call).
fn time(b: &CudaBackend, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let g = &b.gpu;
    let mut v = Vec::new();
    for rep in 0..=reps.max(1) {
        let (e0, e1) = (g.event()?, g.event()?);
        e0.record(g.stream())?;
        f()?;
        e1.record(g.stream())?;
        e1.sync()?;
        if rep > 0 {
            v.push(e0.ms_to(&e1)? as f64);
        }
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

#[derive(serde::Serialize)]
struct Row {
    op: &'static str,
    tokens: usize,
    shape: String,
    ms: f64,
    gb: f64,
    gbs: f64,
    /// Share of [`REF_GBS`].
    frac: f64,
}

/// Times every op at each length of `tokens`; prints one JSON line per op, then a table.
pub fn run(tokens: &[usize], reps: usize, json: bool, cuda: &crate::cuda::CudaOptions) -> Result<()> {
    let b = CudaBackend::new(Precision::Bf16, cuda)?;
    let (hid, kh, kd, shared) = (7168usize, 96usize, 128usize, 6144usize);
    let c = kh * kd;
    let dims = KdaDims { heads: kh, head_dim: kd };
    let w = |name: &str, rows: usize, cols: usize, lo: f32, hi: f32| -> Result<_> {
        let v: Vec<f32> = (0..rows * cols).map(|i| lo + (hi - lo) * ((i * 7919 % 1000) as f32 / 1000.0)).collect();
        b.load_dense(&HostTensor::from_f32(name, rows, cols, &v))
    };
    let conv_w = w("q_conv1d", c, 4, -0.5, 0.5)?;
    let a_log = w("A_log", 1, kh, -1.0, 1.0)?;
    let dt_bias = w("dt_bias", 1, c, -0.1, 0.1)?;
    let o_norm = w("o_norm", 1, kd, 0.75, 1.25)?;
    let norm_w = w("norm", 1, hid, 0.75, 1.25)?;
    let proj_w = w("proj", 1, hid, -0.1, 0.1)?;
    let betas = SituBetas { beta: 4.0, linear_beta: Some(25.0) };
    let mut rows = Vec::new();
    for &t in tokens {
        let mut push = |op: &'static str, shape: String, ms: f64, bytes: f64| {
            let gbs = bytes / ms / 1e6;
            let r = Row { op, tokens: t, shape, ms, gb: bytes / 1e9, gbs, frac: gbs / REF_GBS };
            if json {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
            }
            rows.push(r);
        };
        let (tc, th) = ((t * c * 4) as f64, (t * hid * 4) as f64);
        // KDA width [t, 12288]
        {
            let x = rand_buf(&b, t, c, 1, -2.0, 2.0)?;
            let y = b.empty(t, c)?;
            let ms = time(&b, reps, || b.gpu.dtod(y.ptr(), x.ptr(), t * c * 4))?;
            push("copy d2d (ceiling)", format!("{t}x{c}"), ms, 2.0 * tc);
            drop(y);
            let mut win = b.zeros(3, c)?;
            let ms = time(&b, reps, || b.short_conv_silu(&x, &conv_w, &mut win).map(drop))?;
            push("short_conv_silu", format!("{t}x{c} K4"), ms, 2.0 * tc);
            let ms = time(&b, reps, || b.short_conv_silu_l2(&x, &conv_w, &mut win, kd, KDA_L2_EPS, 1.0).map(drop))?;
            push("short_conv_silu_l2 (fused op)", format!("{t}x{c} K4"), ms, 2.0 * tc);
            let mut q = b.short_conv_silu(&x, &conv_w, &mut win)?;
            let ms = time(&b, reps, || b.l2_norm_heads(&mut q, kd, KDA_L2_EPS, 1.0 / (kd as f32).sqrt()))?;
            push("l2_norm_heads", format!("{t}x{kh}x{kd}"), ms, 2.0 * tc);
            drop(q);
            let ms = time(&b, reps, || b.kda_gate(&x, &a_log, &dt_bias, dims, Some(-5.0)).map(drop))?;
            push("kda_gate", format!("{t}x{c}"), ms, 2.0 * tc);
            let r = rand_buf(&b, t, c, 2, -3.0, 3.0)?;
            let ms = time(&b, reps, || b.gated_rms_norm(&x, &r, &o_norm, kd, 1e-5).map(drop))?;
            push("gated_rms_norm", format!("{t}x{kh}x{kd}"), ms, 3.0 * tc);
            let mut a = rand_buf(&b, t, c, 3, -1.0, 1.0)?;
            let ms = time(&b, reps, || b.sigmoid_gate_mul(&mut a, &r))?;
            push("sigmoid_gate_mul (MLA)", format!("{t}x{c}"), ms, 3.0 * tc);
        }
        // hidden width [t, 7168]
        {
            let p = rand_buf(&b, t, hid, 4, -1.0, 1.0)?;
            let bank = [rand_buf(&b, t, hid, 5, -2.0, 2.0)?, rand_buf(&b, t, hid, 6, -0.5, 0.5)?];
            let refs: Vec<&CudaBuf> = bank.iter().collect();
            let ms = time(&b, reps, || b.attn_res_mix(&refs, &p, &norm_w, &proj_w, 1e-5).map(drop))?;
            push("attn_res_mix (2 bank + P)", format!("{t}x{hid}"), ms, 4.0 * th);
            let ptrs: Vec<u64> = bank.iter().map(|x| x.ptr()).collect();
            let out = b.empty(t, hid)?;
            let (nwp, pwp) = (norm_w.f32.as_ref().map(|m| m.ptr).unwrap_or(0), proj_w.f32.as_ref().map(|m| m.ptr).unwrap_or(0));
            for (name, kern) in [
                ("attn_res_mix, float4 + prefetch", AttnResKernel::Vec4 { prefetch: true }),
                ("attn_res_mix, float4, no prefetch", AttnResKernel::Vec4 { prefetch: false }),
                ("attn_res_mix, scalar (reads twice)", AttnResKernel::Scalar),
            ] {
                if kernels::attnres_mix_variant(&b.gpu, kern, &ptrs, p.ptr(), nwp, pwp, out.ptr(), t, hid, 1e-5, true).is_err() {
                    continue;
                }
                let ms = time(&b, reps, || kernels::attnres_mix_variant(&b.gpu, kern, &ptrs, p.ptr(), nwp, pwp, out.ptr(), t, hid, 1e-5, true))?;
                push(name, format!("{t}x{hid}"), ms, 4.0 * th);
            }
            drop(out);
            drop(bank);
            let ms = time(&b, reps, || b.rms_norm(&p, &norm_w, 1e-5).map(drop))?;
            push("rms_norm", format!("{t}x{hid}"), ms, 2.0 * th);
            let mut acc = rand_buf(&b, t, hid, 7, -1.0, 1.0)?;
            let ms = time(&b, reps, || b.add_assign(&mut acc, &p))?;
            push("add_assign", format!("{t}x{hid}"), ms, 3.0 * th);
            drop(acc);
            let xb = b.gpu.alloc(t * hid * 2)?;
            let ms = time(&b, reps, || kernels::f32_to_bf16_2d(&b.gpu, p.ptr(), hid, xb.ptr, t, hid))?;
            push("f32_to_bf16_2d (GEMM input)", format!("{t}x{hid}"), ms, 1.5 * th);
        }
        // shared experts [t, 6144]
        {
            let g = rand_buf(&b, t, shared, 8, -6.0, 6.0)?;
            let u = rand_buf(&b, t, shared, 9, -30.0, 30.0)?;
            let ms = time(&b, reps, || b.situ_glu(&g, &u, betas).map(drop))?;
            push("situ_glu", format!("{t}x{shared}"), ms, (3 * t * shared * 4) as f64);
        }
    }
    println!("| op | tokens | shape | ms | GB moved | GB/s | of {:.1} TB/s |", REF_GBS / 1000.0);
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!("| {} | {} | {} | {:.3} | {:.2} | {:.0} | {:.0} % |", r.op, r.tokens, r.shape, r.ms, r.gb, r.gbs, 100.0 * r.frac);
    }
    Ok(())
}
