//! `k3-prefill bench --kernels`: the KDA prefill (fp32), MLA attention (bf16) and routed-expert
//! kernels alone on K3 shapes, one row per length (JSON rows feed scripts/peer_bench.py).

use std::time::Instant;

use anyhow::Result;
use serde::Serialize;

use crate::backend::{Backend, KdaInputs};
use crate::cuda::{CudaBackend, Precision};

#[derive(Serialize)]
struct KernelRow {
    tokens: usize,
    kda_ms: f64,
    kda_tflops: f64,
    mla_ms: f64,
    mla_tflops: f64,
    /// Routed-expert GEMMs (gate/up + SiTU, down) over `tokens` x 16 experts.
    #[serde(flatten)]
    moe: MoeTimes,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The chunked KDA's three kernels timed apart on the inputs `[q, k, v, g, beta]` (96 heads x
/// 128): (prep, solve, scan) ms, each summed over the workspace segments, median of `reps`.
fn kda_breakdown(b: &CudaBackend, ins: [&crate::cuda::backend::CudaBuf; 5], t: usize, reps: usize) -> Result<(f64, f64, f64)> {
    use crate::cuda::kernels as kk;
    let g = b.gpu.clone();
    let (h, d) = (96usize, 128usize);
    let [q, k, v, gg, beta] = ins;
    let out = b.empty(t, h * d)?;
    let nch_total = t.div_ceil(64);
    let seg = kk::kda_segment_chunks(h, d, nch_total);
    let ws = g.alloc(seg * kk::kda_ws_floats(d) * h * 4)?;
    let mut ms = [Vec::new(), Vec::new(), Vec::new()];
    for rep in 0..=reps {
        let s = b.zeros(h, d * d)?;
        let mut sum = [0f64; 3];
        let mut c0 = 0;
        while c0 < nch_total {
            let n = seg.min(nch_total - c0);
            let ev = [g.event()?, g.event()?, g.event()?, g.event()?];
            ev[0].record(g.stream())?;
            kk::kda_chunk_prep(&g, q.ptr(), k.ptr(), gg.ptr(), beta.ptr(), t, h, d, c0, n, ws.ptr)?;
            ev[1].record(g.stream())?;
            kk::kda_chunk_solve(&g, v.ptr(), beta.ptr(), t, h, d, c0, n, ws.ptr)?;
            ev[2].record(g.stream())?;
            kk::kda_chunk_scan(&g, ws.ptr, s.ptr(), out.ptr(), t, h, d, c0, n)?;
            ev[3].record(g.stream())?;
            ev[3].sync()?;
            for (i, x) in sum.iter_mut().enumerate() {
                *x += ev[i].ms_to(&ev[i + 1])? as f64;
            }
            c0 += n;
        }
        if rep > 0 {
            for (m, x) in ms.iter_mut().zip(sum) {
                m.push(x);
            }
        }
    }
    let [p, so, sc] = ms.map(median);
    eprintln!("KDA at {t} tokens: prep {p:.1} ms + solve {so:.1} ms + scan {sc:.1} ms ({seg} chunks per segment)");
    Ok((p, so, sc))
}

/// What `bench --kernels` times (the kernel-mode flags of `k3-prefill bench`).
pub struct KernelBench<'a> {
    pub tokens: &'a [usize],
    /// Timed repetitions (median reported).
    pub reps: usize,
    /// Only the routed experts (both BF16 paths).
    pub experts_only: bool,
    /// Only the chunked KDA (total, then prep and scan kernels apart).
    pub kda_only: bool,
    /// Only the MLA attention kernels.
    pub mla_only: bool,
    /// Extra dense-expert settings (each as `--moe-dense`, over the backend's).
    pub moe_dense_configs: &'a [String],
    /// The backend's options (`--moe-dense`, `--mla-kernel`, …).
    pub cuda: crate::cuda::CudaOptions,
}

pub fn run(args: &KernelBench) -> Result<()> {
    use crate::backend::KdaDims;
    let mut b = CudaBackend::new(Precision::Bf16, &args.cuda)?;
    let g = b.gpu.clone();
    let (h, d) = (96usize, 128usize);
    let kd = KdaDims { heads: h, head_dim: d };
    let mut rows = Vec::new();
    let moe_bench = MoeBench::new(&b)?;
    let rnd = |n: usize, seed: u64, lo: f32, hi: f32| -> Vec<f32> {
        (0..n).map(|i| lo + (hi - lo) * ((((i as u64) ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / (1u64 << 24) as f32)).collect()
    };
    for &t in args.tokens {
        if args.experts_only {
            let moe = moe_bench.time(&mut b, t, args.reps, args.moe_dense_configs)?;
            let r = KernelRow { tokens: t, kda_ms: f64::NAN, kda_tflops: f64::NAN, mla_ms: f64::NAN, mla_tflops: f64::NAN, moe };
            println!("{}", serde_json::to_string(&r)?);
            rows.push(r);
            continue;
        }
        if args.mla_only {
            mla_times(&b, t, args.reps)?;
            continue;
        }
        // KDA, fp32
        let c = h * d;
        let mut q = b.upload(&rnd(t * c, 1, -1.0, 1.0), t, c)?;
        let mut k = b.upload(&rnd(t * c, 2, -1.0, 1.0), t, c)?;
        b.l2_norm_heads(&mut q, d, k3_protocol::config::spec::KDA_L2_EPS, 1.0 / (d as f32).sqrt())?;
        b.l2_norm_heads(&mut k, d, k3_protocol::config::spec::KDA_L2_EPS, 1.0)?;
        let v = b.upload(&rnd(t * c, 3, -1.0, 1.0), t, c)?;
        let gg = b.upload(&rnd(t * c, 4, -5.0, 0.0), t, c)?;
        let beta = b.upload(&rnd(t * h, 5, 0.0, 1.0), t, h)?;
        let mut times = Vec::new();
        for rep in 0..=args.reps {
            let mut s = b.zeros(h, d * d)?;
            let e0 = g.event()?;
            let e1 = g.event()?;
            e0.record(g.stream())?;
            let o = b.kda_chunked(&KdaInputs { q: &q, k: &k, v: &v, g: &gg, beta: &beta }, &mut s, kd, 64)?;
            e1.record(g.stream())?;
            e1.sync()?;
            drop(o);
            if rep > 0 {
                times.push(e0.ms_to(&e1)? as f64);
            }
        }
        let parts = if args.kda_only { Some(kda_breakdown(&b, [&q, &k, &v, &gg, &beta], t, args.reps)?) } else { None };
        drop((q, k, v, gg, beta));
        let kda_ms = median(times);
        // chunk products only (the same count layer_flops uses)
        let per_chunk = 2.0 * (64.0 * 65.0 / 2.0) * d as f64 * 2.0 + 64.0 * 64.0 * 2.0 * d as f64 + 2.0 * 64.0 * (d * d) as f64 * 3.0 + 64.0 * 64.0 * d as f64;
        let kflops = (t as f64 / 64.0).ceil() * h as f64 * per_chunk;
        if let Some((prep_ms, solve_ms, scan_ms)) = parts {
            let r = serde_json::json!({ "tokens": t, "kda_ms": kda_ms, "kda_tflops": kflops / kda_ms / 1e9, "kda_prep_ms": prep_ms, "kda_solve_ms": solve_ms, "kda_scan_ms": scan_ms });
            println!("{r}");
            continue;
        }
        let (mla_ms, mflops) = mla_times(&b, t, args.reps)?;
        let m = moe_bench.time(&mut b, t, args.reps, args.moe_dense_configs)?;
        let r = KernelRow { tokens: t, kda_ms, kda_tflops: kflops / kda_ms / 1e9, mla_ms, mla_tflops: mflops / mla_ms / 1e9, moe: m };
        println!("{}", serde_json::to_string(&r)?);
        rows.push(r);
    }
    moe_table(rows.iter().map(|r| &r.moe));
    Ok(())
}

/// MLA attention (bf16 flash kernels on packed head-major inputs, K3 shapes) at `t` tokens: every
/// applicable kernel timed and logged; returns the backend pick's median ms and the FLOPs counted.
fn mla_times(b: &CudaBackend, t: usize, reps: usize) -> Result<(f64, f64)> {
    use crate::cuda::kernels as kk;
    let g = b.gpu.clone();
    let (h, dqk, dv) = (96usize, 192usize, 128usize);
    let rnd = |n: usize, seed: u64, lo: f32, hi: f32| -> Vec<f32> {
        (0..n).map(|i| lo + (hi - lo) * ((((i as u64) ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / (1u64 << 24) as f32)).collect()
    };
    // MLA, bf16 flash kernel on packed head-major inputs
    let qf = b.upload(&rnd(t * h * dqk, 6, -1.0, 1.0), t, h * dqk)?;
    let kvf = b.upload(&rnd(t * h * (128 + dv), 7, -1.0, 1.0), t, h * (128 + dv))?;
    let kpe = b.upload(&rnd(t * 64, 8, -1.0, 1.0), t, 64)?;
    // every applicable kernel (mma.sync; each wgmma configuration on sm_90), the backend's pick
    // reported; the first and last 512 output rows of each are compared with mma.sync's
    let mflops = 2.0 * (t as f64 * (t as f64 + 1.0) / 2.0) * (h * (dqk + dv)) as f64;
    let mut mla_ms = f64::NAN;
    let mut first: Option<Vec<f32>> = None;
    let pick = kk::MlaKernel::Auto.resolve(&g, dqk, dv)?;
    let mut kernels_run = vec![kk::MlaKernel::MmaSync];
    if kk::mla_sm90_supported(&g, dqk, dv) {
        kernels_run.extend(kk::MLA_SM90_VARIANTS.iter().map(|v| kk::MlaKernel::Wgmma(*v)));
    }
    let (kvs, (dn, dr)) = (h * (128 + dv), (128, 64));
    let operands = kk::MlaOperands { q: qf.ptr(), qs: h * dqk, kv: kvf.ptr(), kvs, kpe: kpe.ptr(), kps: 64, tq: t, pos0: 0, h, dn, dr, dv };
    for kern in kernels_run {
        let packed = kk::mla_pack(&g, kern, &operands)?;
        let out = b.empty(t, h * dv)?;
        let mut times = Vec::new();
        for rep in 0..=reps {
            let e0 = g.event()?;
            let e1 = g.event()?;
            e0.record(g.stream())?;
            kk::mla_attn_packed(&g, &packed, out.ptr(), h * dv, 1.0 / (dqk as f32).sqrt())?;
            e1.record(g.stream())?;
            e1.sync()?;
            if rep > 0 {
                times.push(e0.ms_to(&e1)? as f64);
            }
        }
        let ms = median(times);
        if kern == pick {
            mla_ms = ms;
        }
        let rows = t.min(512);
        let mut o = vec![0f32; 2 * rows * h * dv];
        g.dtoh(&mut o[..rows * h * dv], out.ptr())?;
        g.dtoh(&mut o[rows * h * dv..], out.ptr() + ((t - rows) * h * dv * 4) as u64)?;
        let diff = match &first {
            None => String::new(),
            Some(f) => {
                let (n, d) = o.iter().zip(f).fold((0f64, 0f64), |(n, d), (&x, &y)| (n + ((x - y) as f64).powi(2), d + (y as f64).powi(2)));
                format!(", rel diff to mma.sync {:.2e} (first/last {rows} rows)", (n / d.max(1e-300)).sqrt())
            }
        };
        let name = match kern {
            kk::MlaKernel::Wgmma(v) => v.name,
            _ => "mla_attn_bf16 (mma.sync)",
        };
        eprintln!("MLA attention {name}: {ms:.1} ms, {:.0} TFLOP/s at {t} tokens{diff}", mflops / ms / 1e9);
        first.get_or_insert(o);
    }
    drop((qf, kvf, kpe));
    Ok((mla_ms, mflops))
}

/// Routed-expert timings of one length: both BF16 paths on the same plan.
#[derive(Serialize)]
struct MoeTimes {
    moe_tokens: usize,
    moe_rows_per_expert: f64,
    /// The path `--backend cuda` takes at this length (`MoePath::Auto`).
    moe_path: &'static str,
    moe_ms: f64,
    moe_tflops: f64,
    moe_mma_ms: f64,
    moe_mma_tflops: f64,
    moe_dense_ms: f64,
    moe_dense_tflops: f64,
}

/// The routed experts of one K3 layer (896 MXFP4 experts of 3072 x 3584, top-16), all resident.
struct MoeBench {
    /// Routed experts in the layer.
    experts: usize,
    /// The K3 config's dims (top-k, SiTU betas) as the model derives them.
    d: crate::model::ModelDims,
    lay: crate::expert_layout::ExpertLayout,
    arena: crate::cuda::DevMem,
}

impl MoeBench {
    fn new(b: &CudaBackend) -> Result<Self> {
        let c = k3_protocol::synth::presets::build_config(k3_protocol::synth::presets::Preset::K3, &Default::default())
            .map_err(|e| anyhow::anyhow!("K3 config: {e}"))?
            .text_config;
        let (experts, d) = (c.num_experts, crate::model::ModelDims::of(&c));
        let lay = crate::expert_layout::ExpertLayout::new(c.moe_intermediate_size, c.routed_expert_hidden_size)?;
        let arena = b.gpu.alloc_sync(lay.stride * experts)?;
        // every code 7 (6.0), every scale 2^-8
        unsafe {
            crate::cuda::gpu::ck(cudarc::driver::sys::cuMemsetD8_v2(arena.ptr, 0x77, arena.bytes), "filling the expert arena")?;
        }
        Ok(MoeBench { experts, d, lay, arena })
    }

    /// Both expert GEMMs (gate/up + SiTU, down; not the gather and combine) over `t` tokens with
    /// uniform routing, on the mma.sync kernel and on the dense path (median of `reps`).
    fn time(&self, b: &mut CudaBackend, t: usize, reps: usize, dense_configs: &[String]) -> Result<MoeTimes> {
        let (d, g, lay) = (&self.d, b.gpu.clone(), &self.lay);
        let (experts, inter, latent) = (self.experts, lay.inter, lay.latent);
        let ids: Vec<i32> = (0..t * d.top_k).map(|i| (((i / d.top_k) * 7919 + (i % d.top_k) * 56) % experts) as i32).collect();
        let ids_d = b.upload_bytes(bytemuck::cast_slice(&ids))?;
        let w_d = b.upload_bytes(bytemuck::cast_slice(&vec![1.0f32 / d.top_k as f32; t * d.top_k]))?;
        let x: Vec<f32> = (0..t * latent).map(|i| ((((i as u64) ^ 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / (1u64 << 23) as f32) - 1.0).collect();
        let xl = b.upload(&x, t, latent)?;
        drop(x);
        let saved = b.moe_path;
        b.moe_path = crate::cuda::moe_dense::MoePath::Auto;
        let mut plan = b.moe_prepare(&xl, ids_d.ptr, w_d, d.top_k, experts, &self.lay)?;
        b.moe_path = saved;
        drop(xl);
        let auto_dense = plan.dense;
        let eflops = (t * d.top_k) as f64 * 3.0 * 2.0 * (inter * latent) as f64;
        // GPU time from events; the host's enqueue time is logged (a path bound by launches
        // shows GPU time ~ enqueue time)
        let timed = |b: &CudaBackend, plan: &crate::cuda::moe_plan::MoePlan| -> Result<(f64, f64)> {
            let (mut times, mut host) = (Vec::new(), Vec::new());
            for rep in 0..=reps {
                let e0 = g.event()?;
                let e1 = g.event()?;
                e0.record(g.stream())?;
                let h0 = Instant::now();
                b.moe_run_chunk(plan, &self.lay, self.arena.ptr, 0, experts, d.situ, None)?;
                host.push(h0.elapsed().as_secs_f64() * 1e3);
                e1.record(g.stream())?;
                e1.sync()?;
                if rep > 0 {
                    times.push(e0.ms_to(&e1)? as f64);
                }
            }
            Ok((median(times), median(host)))
        };
        let mut ms = [f64::NAN; 2];
        for (i, dense) in [false, true].into_iter().enumerate() {
            b.moe_set_dense(&mut plan, dense)?;
            let (m, host) = timed(b, &plan)?;
            ms[i] = m;
            let what = if dense { "dense (bf16 dequant + cuBLAS)" } else { "mma.sync" };
            eprintln!("routed experts, {what}: {m:.1} ms, {:.0} TFLOP/s at {t} tokens (host enqueue {host:.1} ms)", eflops / m / 1e9);
        }
        let saved = b.moe_dense;
        for c in dense_configs {
            b.moe_dense = crate::cuda::moe_dense::MoeDenseCfg::parse(c, saved)?;
            let (m, host) = timed(b, &plan)?;
            eprintln!("routed experts, dense {c}: {m:.1} ms, {:.0} TFLOP/s at {t} tokens (host enqueue {host:.1} ms)", eflops / m / 1e9);
        }
        b.moe_dense = saved;
        let pick = if auto_dense { ms[1] } else { ms[0] };
        Ok(MoeTimes {
            moe_tokens: t,
            moe_rows_per_expert: (t * d.top_k) as f64 / experts as f64,
            moe_path: if auto_dense { "dense" } else { "mma" },
            moe_ms: pick,
            moe_tflops: eflops / pick / 1e9,
            moe_mma_ms: ms[0],
            moe_mma_tflops: eflops / ms[0] / 1e9,
            moe_dense_ms: ms[1],
            moe_dense_tflops: eflops / ms[1] / 1e9,
        })
    }
}

fn moe_table<'a>(rows: impl Iterator<Item = &'a MoeTimes>) {
    println!("\nrouted experts (896 x MXFP4 3072x3584, top-16, bf16; gate/up + SiTU + down):");
    println!("{:>8} {:>12} {:>10} {:>10} {:>10} {:>10} {:>6}", "tokens", "rows/expert", "mma ms", "TFLOP/s", "dense ms", "TFLOP/s", "auto");
    for m in rows {
        println!(
            "{:>8} {:>12.0} {:>10.1} {:>10.0} {:>10.1} {:>10.0} {:>6}",
            m.moe_tokens, m.moe_rows_per_expert, m.moe_mma_ms, m.moe_mma_tflops, m.moe_dense_ms, m.moe_dense_tflops, m.moe_path
        );
    }
}
