//! `k3-prefill bench`: prefill throughput.
//!
//! - `--model DIR`: the whole model through the layer-major executor on the chosen backend, the
//!   path `forward` and `serve` run. On CUDA the weights stream per prompt through the same
//!   [`StreamedWeights`](crate::streamer::StreamedWeights) (`--vram-budget`, `--expert-chunk`,
//!   the source: page cache, `--pin-host`, `--direct-io`; `--resident` keeps them loaded
//!   instead). Before the prompts it measures, in the same run, the roofline's two rates (pinned
//!   host-to-device copy, a large BF16 cuBLAS GEMM) and the weight source's own read limit;
//!   each prompt length then gets seconds, tokens/s, achieved H2D GB/s, GPU compute, the ratio
//!   to the roofline `max(weight bytes / H2D rate, FLOPs / BF16 GEMM rate)` and the projection
//!   to K3's 93 layers from the per-layer times of the same run. `--profile` adds the GPU
//!   time per step; `--emulate-source-gbs GB/s` reads the weights as from a source of that rate
//!   ([`crate::source_pace`]: a user's NVMe measured on a faster box). A K3-width model that
//!   does not fit a disk: `k3-prefill synth --preset k3 --layers 3` into a tmpfs directory (the
//!   host-memory checkpoint, read by the same reader).
//! - `--kernels`: the KDA, MLA and expert kernels alone at K3 shapes (bench_kernels.rs), or the
//!   memory-bound f32 ops (`--elementwise-only`, bench_elementwise.rs).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_protocol::config::{AttnKind, LayerSpec};
use serde::Serialize;

use super::backend_args::{BackendArgs, MemoryArgs, Opened, SourceArgs};
use super::forward::StreamArgs;
use crate::backend::Backend;
use crate::cuda::CudaBackend;
use crate::executor::{ExecOptions, LogitsRows, PrefillInput};
use crate::memory_plan::{LogitsKept, PlanRequest};
use crate::prefiller::{MemoryUse, Prefiller, PrefillerOptions, WeightMode};

/// Arguments of `k3-prefill bench`.
#[derive(clap::Args, Debug)]
#[command(mut_arg("precision", |a| a.default_value("bf16")))]
pub struct Args {
    /// Checkpoint directory (model mode).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt lengths (default: 8192,32768,65536,131072,262144 on CUDA, 256,1024 on the CPU;
    /// kernel mode 8192,32768,131072).
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<usize>>,
    // --precision defaults to bf16 (serving) here
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Print JSON instead of a table (model mode: one object per row, keys `tokens`,
    /// `median_s`, `min_s`, `max_s`, `of_roofline`, `peak_device_gb`, `peak_host_gb`, …).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub memory: MemoryArgs,
    #[command(flatten)]
    pub source: SourceArgs,
    /// Model mode: timed runs per prompt length after the warm-up (median, min and max reported;
    /// ratios on the median).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Model mode (CUDA): keep every layer resident instead of streaming the weights per prompt.
    #[arg(long)]
    pub resident: bool,
    /// Tokens per chunk within a layer (default: the memory plan's).
    #[arg(long)]
    pub chunk_tokens: Option<usize>,
    /// Model mode: also prefill this many prompts of each length together, in one shared weight
    /// pass (the serve path's batching of waiting requests), next to one alone: seconds and
    /// weight bytes of N concurrent prompts against one.
    #[arg(long, default_value_t = 1)]
    pub concurrent: usize,
    /// Model mode: the source's read limit is measured over at most this many GB of the shards.
    #[arg(long, default_value_t = 8.0)]
    pub source_probe_gb: f64,
    /// Kernel mode: time the KDA prefill (fp32) and MLA attention (bf16) kernels alone on K3
    /// shapes (96 heads; KDA 128/128, MLA qk 192 / v 128), one JSON object per length
    /// (scripts/peer_bench.py compares them with fla and PyTorch SDPA).
    #[arg(long)]
    pub kernels: bool,
    /// Kernel mode: timed repetitions (median reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Kernel mode: time only the routed experts (both BF16 paths).
    #[arg(long)]
    pub experts_only: bool,
    /// Kernel mode: time only the chunked KDA (total, then prep and scan kernels apart).
    #[arg(long)]
    pub kda_only: bool,
    /// Kernel mode: time only the memory-bound f32 ops (short conv, norms, gates, AttnRes,
    /// SiTU, adds, the BF16 GEMM-input conversion) at K3 widths, with GB/s (bench_elementwise.rs).
    #[arg(long)]
    pub elementwise_only: bool,
    /// Kernel mode: time only the MLA attention kernels (every applicable one, as without it).
    #[arg(long)]
    pub mla_only: bool,
    /// Kernel mode: also time the dense expert path with these settings, `;`-separated
    /// (each as `--moe-dense`, over its settings; e.g. `streams=8;streams=2,group_mib=2048`).
    #[arg(long, value_delimiter = ';')]
    pub moe_dense_configs: Vec<String>,
}

pub fn run(args: Args) -> Result<()> {
    let kernel_tokens = args.tokens.clone().unwrap_or_else(|| vec![8192, 32768, 131072]);
    if args.kernels && args.elementwise_only {
        return super::bench_elementwise::run(&kernel_tokens, args.reps, args.json, &args.backend.cuda.options());
    }
    if args.kernels {
        return super::bench_kernels::run(&super::bench_kernels::KernelBench {
            tokens: &kernel_tokens,
            reps: args.reps,
            experts_only: args.experts_only,
            kda_only: args.kda_only,
            mla_only: args.mla_only,
            moe_dense_configs: &args.moe_dense_configs,
            cuda: args.backend.cuda.options(),
        });
    }
    let Some(dir) = args.model.clone() else {
        bail!("bench: give --model DIR (a K3-width model that fits no disk: `k3-prefill synth --preset k3 --layers 3 --out /dev/shm/k3`), or --kernels")
    };
    let ck = Arc::new(k3_protocol::Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?);
    match args.backend.open()? {
        Opened::Cpu(b) => model_bench(b, ck, &args),
        Opened::Cuda(b) => model_bench(b, ck, &args),
    }
}

pub use crate::model::flops::layer_flops;

/// The roofline's rates and the weight source's limit, measured at the start of the run.
#[derive(Serialize, Default, Clone)]
struct Rates {
    /// Pinned host → device copy of 1 GiB on the copy stream (median of 5).
    pinned_h2d_gbs: f64,
    /// BF16 cuBLAS GEMM 16384 × 16384 × 16384, f32 accumulation (median of 5).
    bf16_gemm_tflops: f64,
    weights_from: String,
    /// The source's read rate into pinned memory at the streamer's reader count (`pread` or
    /// raw `O_DIRECT` of the same shards; NaN for pinned host memory, which is not read).
    source_read_gbs: f64,
    /// What the source can feed the GPU: min(read rate, pinned H2D); pinned H2D for pinned memory.
    source_limit_gbs: f64,
    /// `--emulate-source-gbs`: the rate every pass reads the layers' weights at (the roofline's
    /// transfer rate when below pinned H2D; `source_limit_gbs` and `of_source_limit` stay those
    /// of the real source, which the copies still run from).
    emulated_source_gbs: Option<f64>,
}

impl Rates {
    fn line(&self) -> String {
        let read = if self.source_read_gbs.is_nan() { "not read (already page-locked)".to_string() } else { format!("read {:.1} GB/s", self.source_read_gbs) };
        let emulated = self.emulated_source_gbs.map(|g| format!(" (emulated source: {g:.2} GB/s)")).unwrap_or_default();
        format!(
            "measured in this run: pinned H2D {:.1} GB/s, BF16 GEMM {:.0} TFLOP/s; weights from {}: {read}, source limit {:.1} GB/s{emulated}",
            self.pinned_h2d_gbs, self.bf16_gemm_tflops, self.weights_from, self.source_limit_gbs
        )
    }

    /// The roofline's weight transfer rate: pinned H2D, or the emulated source if slower.
    fn feed_gbs(&self) -> f64 {
        self.emulated_source_gbs.map_or(self.pinned_h2d_gbs, |g| g.min(self.pinned_h2d_gbs))
    }
}

fn measure_rates(b: &CudaBackend, ck: &k3_protocol::Checkpoint, sw: Option<&crate::streamer::StreamedWeights>, probe_gb: f64) -> Result<Rates> {
    let g = &b.gpu;
    let mut r = Rates::default();
    // the source: pinned H2D, and the read rate where the streamer reads shards
    let feed = match sw {
        Some(sw) => sw.measure_feed(ck, (probe_gb * 1e9) as usize)?,
        None => crate::streamer::FeedRates { pinned_h2d_gbs: crate::streamer::pinned_h2d_gbs(g)?, source_read_gbs: f64::NAN },
    };
    r.pinned_h2d_gbs = feed.pinned_h2d_gbs;
    r.source_read_gbs = feed.source_read_gbs;
    r.source_limit_gbs = feed.limit_gbs();
    r.weights_from = sw.map(|s| s.weights_from).unwrap_or_default().name().into();
    // BF16 GEMM
    let m = 16384usize;
    let (xb, wb, y) = (g.alloc_sync(m * m * 2)?, g.alloc_sync(m * m * 2)?, g.alloc_sync(m * m * 4)?);
    for p in [&xb, &wb] {
        // small finite bf16 values (0x3c00 ≈ 0.0078)
        unsafe { crate::cuda::gpu::ck(cudarc::driver::sys::cuMemsetD16_v2(p.ptr, 0x3c00, m * m), "filling the GEMM operands")? };
    }
    let mut v = Vec::new();
    for i in 0..6 {
        let (e0, e1) = (g.event()?, g.event()?);
        e0.record(g.stream())?;
        b.gemm_bf16_raw(xb.ptr, wb.ptr, y.ptr, m, m, m)?;
        e1.record(g.stream())?;
        e1.sync()?;
        if i > 0 {
            v.push(2.0 * (m as f64).powi(3) / 1e12 / (e0.ms_to(&e1)? as f64 / 1e3));
        }
    }
    r.bf16_gemm_tflops = median(&mut v);
    Ok(r)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

#[derive(Serialize, Default)]
struct ModelRow {
    backend: String,
    weights_from: String,
    /// New tokens of each prompt.
    tokens: usize,
    /// Prompts prefilled together in one weight pass.
    requests: usize,
    /// Median of the timed runs (`seconds` too), their min and max, and how many.
    median_s: f64,
    min_s: f64,
    max_s: f64,
    repeats: usize,
    seconds: f64,
    /// Peak device memory over the runs: the allocator's high-water mark and the device's used
    /// memory (context and pool reservations included; a ballast not counted), and the host's
    /// peak resident memory, GB.
    peak_device_gb: f64,
    peak_device_used_gb: f64,
    peak_host_gb: f64,
    /// The pass's memory plan (one line) and its planned device peak, GB.
    plan: String,
    plan_peak_gb: f64,
    rates: Option<Rates>,
    /// All prompts' tokens per second.
    tokens_per_s: f64,
    /// Layer FLOPs (+ lm_head of the last row).
    tflop: f64,
    /// Weights streamed per prompt (CUDA) or resident.
    streamed: bool,
    weight_gb: f64,
    /// Σ over layers: GPU compute, GPU waiting for weights, executor waiting for the readers,
    /// copy stream busy (streamed only).
    compute_s: f64,
    wait_s: f64,
    host_wait_s: f64,
    copy_s: f64,
    /// Weight bytes / copy-stream time.
    h2d_gbs: f64,
    /// `h2d_gbs` / the source's measured limit.
    of_source_limit: f64,
    /// Wall time outside the layers' GPU spans (embedding, uploads, host waits between layers,
    /// output head).
    outside_s: f64,
    /// seconds / max(transfer alone, Σ GPU compute): how well the weight feed hides behind compute.
    overlap_ratio: f64,
    /// max(weight bytes / pinned H2D (or `--emulate-source-gbs` when slower), FLOPs / BF16 GEMM
    /// rate), both measured in this run.
    roofline_s: f64,
    of_roofline: f64,
    /// K3's 93 layers from this run's per-layer times (layer kinds as in K3's plan) plus this
    /// run's time outside the layers (embedding, output head).
    k3_93_layers_s: f64,
    k3_93_tokens_per_s: f64,
    k3_93_roofline_s: f64,
    k3_93_of_roofline: f64,
    per_layer: Vec<crate::streamer::LayerStreamTime>,
    /// `--profile`: GPU ms per step.
    profile: Vec<(String, f64)>,
    /// `--profile`: host time blocked on the GPU `(what, step, calls, ms, bytes)`.
    host_blocked: Vec<(String, String, usize, f64, usize)>,
    /// Shared pass: max |Δ| of the first prompt's last logits against the same prompt alone.
    logits_max_abs_diff_vs_alone: Option<f64>,
}

fn model_bench<B: Backend + 'static>(b: Arc<B>, ck: Arc<k3_protocol::Checkpoint>, args: &Args) -> Result<()> {
    let stream = b.streams_weights() && !args.resident;
    let sopts = args.stream.options()?;
    if args.concurrent == 0 {
        bail!("bench: --concurrent must be at least 1");
    }
    if args.repeats == 0 {
        bail!("bench: --repeats must be at least 1");
    }
    let tokens = args.tokens.clone().unwrap_or_else(|| if b.streams_weights() { vec![8192, 32768, 65536, 131072, 262144] } else { vec![256, 1024] });
    let max_t = tokens.iter().copied().max().unwrap_or(1);
    // the plan of the longest pass first: nothing is read from the shards before it fits
    let pf = Prefiller::open(
        b.clone(),
        ck.clone(),
        &PrefillerOptions {
            weights: if stream { WeightMode::Streamed(sopts.clone()) } else { WeightMode::Resident },
            memory: args.memory.options(),
            chunk_tokens: args.chunk_tokens,
            logits: LogitsKept::Last,
            design: vec![PlanRequest { base: 0, new: max_t }; args.concurrent],
            design_cap: usize::MAX,
            emulate_source_gbs: args.source.emulate_source_gbs,
        },
    )?;
    let runs: Vec<(usize, usize)> = tokens.iter().flat_map(|&t| if args.concurrent > 1 { vec![(t, 1), (t, args.concurrent)] } else { vec![(t, 1)] }).collect();
    for &(t, nreq) in &runs {
        let p = pf.plan(&vec![PlanRequest { base: 0, new: t }; nreq]).map_err(anyhow::Error::new).with_context(|| format!("bench: {nreq} × {t} tokens"))?;
        eprintln!("{nreq} × {t} tokens: {}", p.line());
    }
    let model = &*pf.model;
    let sw = pf.streamed.as_deref();
    if let Some(sw) = sw {
        eprintln!("weight streamer: {} (from {}, {} readers)", sw.plan().describe(), sw.weights_from.name(), sopts.readers);
    }
    let cuda = crate::cuda::cuda_model(model).map(|m| &*m.backend);
    let rates = match cuda {
        Some(c) => {
            let mut r = measure_rates(c, &ck, sw, args.source_probe_gb)?;
            r.emulated_source_gbs = pf.source.as_ref().map(|s| s.bytes_per_s() / 1e9);
            Some(r)
        }
        None => None,
    };
    if let Some(r) = &rates {
        eprintln!("{}", r.line());
    }
    let cfg = model.cfg.clone();
    warn_if_long(model, &runs, args.repeats, rates.as_ref(), if stream { ck.total_bytes() as f64 } else { 0.0 });
    let opts = ExecOptions { logits: LogitsRows::Last, ..ExecOptions::default() };
    let ids_of = |t: usize| -> Vec<u32> { (0..t).map(|i| ((i as u64 * 2654435761) % (cfg.vocab_size.min(1000) as u64)) as u32).collect() };
    // prompt `r` of a shared pass: other ids of the same length
    let ids_of_req =
        |t: usize, r: usize| -> Vec<u32> { (0..t).map(|i| (((i + 7919 * r) as u64 * 2654435761) % (cfg.vocab_size.min(1000) as u64)) as u32).collect() };
    // warm-up (kernel compilation, cuBLAS heuristics, allocator pools; long enough for the dense
    // expert path), untimed
    let warm = tokens.iter().copied().min().unwrap_or(256).min(16384);
    let mut state = k3_protocol::handoff::HandoffState::empty(&cfg);
    pf.prefill(&mut state, PrefillInput::tokens(&ids_of(warm)), &opts, |_| Ok(()))?;
    // the weight feed alone (no compute), for the overlap ratio
    let transfer_alone = match &sw {
        Some(sw) => {
            let t = sw.transfer_alone()?;
            eprintln!("transfer alone: {:.3} s for {:.2} GB ({:.1} GB/s)", t, sw.plan().prompt_bytes() as f64 / 1e9, sw.plan().prompt_bytes() as f64 / 1e9 / t);
            Some(t)
        }
        None => None,
    };
    // K3's layer plan, for the projection
    let k3_plan = k3_protocol::synth::presets::build_config(k3_protocol::synth::presets::Preset::K3, &Default::default())
        .map_err(|e| anyhow::anyhow!("K3 config: {e}"))?
        .text_config;
    let k3_specs = k3_plan.layer_plan();
    let mut rows = Vec::new();
    let mut alone_logits: std::collections::HashMap<usize, Vec<f32>> = Default::default();
    for (t, nreq) in runs {
        let prompts: Vec<Vec<u32>> = (0..nreq).map(|r| if r == 0 { ids_of(t) } else { ids_of_req(t, r) }).collect();
        // `repeats` timed runs; the row's details come from the median one
        let mut timed: Vec<TimedRun> = Vec::new();
        for rep in 0..args.repeats {
            let mut states: Vec<_> = (0..nreq).map(|_| k3_protocol::handoff::HandoffState::empty(&cfg)).collect();
            crate::cuda::profile::reset();
            pf.reset_memory_peak()?;
            let t0 = Instant::now();
            let (outs, st, plan) = {
                let mut reqs: Vec<crate::executor::PassRequest<'_, '_>> =
                    states.iter_mut().zip(&prompts).map(|(state, p)| crate::executor::PassRequest { state, input: PrefillInput::tokens(p) }).collect();
                pf.prefill_many(&mut reqs, &opts, |_, _| Ok(()))?
            };
            let s = t0.elapsed().as_secs_f64();
            let mem = pf.memory_use()?;
            let mut first_logits = Vec::new();
            for (r, o) in outs.into_iter().enumerate() {
                let o = o.with_context(|| format!("prompt {r} of {nreq} ({t} tokens), run {rep}"))?;
                if r == 0 {
                    first_logits = o.logits;
                }
            }
            if let Some(c) = cuda {
                crate::cuda::profile::begin(&c.gpu, "-")?;
            }
            let profile = crate::cuda::profile::report()?.into_iter().map(|(n, ms)| (n.to_string(), ms)).collect();
            let host_blocked = crate::cuda::host_wait::host_report().into_iter().map(|(w, st, c, ms, by)| (w.to_string(), st.to_string(), c, ms, by)).collect();
            eprintln!(
                "{nreq} × {t} tokens, run {}/{}: {s:.3} s; peak device {:.3} GB allocated, {:.3} GB used; host {:.3} GB",
                rep + 1,
                args.repeats,
                mem.device_allocated as f64 / 1e9,
                mem.device_used as f64 / 1e9,
                mem.host_peak as f64 / 1e9
            );
            timed.push(TimedRun { s, st, first_logits, mem, plan, profile, host_blocked });
        }
        let mut secs: Vec<f64> = timed.iter().map(|x| x.s).collect();
        let median_s = median(&mut secs);
        let (min_s, max_s) = (secs.first().copied().unwrap_or(f64::NAN), secs.last().copied().unwrap_or(f64::NAN));
        let peak = timed.iter().fold(MemoryUse::default(), |a, x| MemoryUse {
            device_allocated: a.device_allocated.max(x.mem.device_allocated),
            device_used: a.device_used.max(x.mem.device_used),
            host_peak: a.host_peak.max(x.mem.host_peak),
        });
        let mid = timed.iter().position(|x| x.s == median_s).unwrap_or(0);
        let TimedRun { s, st, first_logits, plan, profile, host_blocked, .. } = timed.swap_remove(mid);
        // The first prompt of a shared pass is the prompt run alone just before: its last logits
        // against those (identical on the CPU reference; the GPU's expert path over several token
        // chunks may round differently).
        let vs_alone = if nreq > 1 {
            alone_logits.get(&t).map(|a: &Vec<f32>| a.iter().zip(&first_logits).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max) as f64)
        } else {
            alone_logits.insert(t, first_logits);
            None
        };
        let layer_fl: Vec<f64> = model.plan.iter().map(|spec| layer_flops(&cfg, spec, t, 0)).collect();
        let flops = nreq as f64 * (layer_fl.iter().sum::<f64>() + 2.0 * (cfg.hidden_size * cfg.vocab_size) as f64);
        let st = st.unwrap_or_default();
        let mut row = ModelRow {
            backend: b.name().into(),
            weights_from: rates.as_ref().map(|r| r.weights_from.clone()).unwrap_or_default(),
            tokens: t,
            requests: nreq,
            median_s,
            min_s,
            max_s,
            repeats: args.repeats,
            seconds: s,
            peak_device_gb: peak.device_allocated as f64 / 1e9,
            peak_device_used_gb: peak.device_used as f64 / 1e9,
            peak_host_gb: peak.host_peak as f64 / 1e9,
            plan: plan.line(),
            plan_peak_gb: plan.peak_device as f64 / 1e9,
            rates: rates.clone(),
            tokens_per_s: (nreq * t) as f64 / s,
            tflop: flops / 1e12,
            streamed: stream,
            weight_gb: st.bytes as f64 / 1e9,
            compute_s: st.compute_s,
            wait_s: st.wait_s,
            host_wait_s: st.host_wait_s,
            copy_s: st.copy_s,
            h2d_gbs: if st.copy_s > 0.0 { st.bytes as f64 / 1e9 / st.copy_s } else { f64::NAN },
            per_layer: st.layers.clone(),
            profile,
            host_blocked,
            logits_max_abs_diff_vs_alone: vs_alone,
            ..Default::default()
        };
        if let (Some(r), true) = (&rates, stream) {
            row.of_source_limit = row.h2d_gbs / r.source_limit_gbs;
            let roof = |bytes: f64, fl: f64| (bytes / 1e9 / r.feed_gbs()).max(fl / 1e12 / r.bf16_gemm_tflops);
            row.roofline_s = roof(st.bytes as f64, flops);
            row.of_roofline = row.roofline_s / s;
            // projection: each K3 layer takes the time (GPU compute + wait for weights) of the
            // last layer of the same kind in this run; the time outside the layers once
            let span = |l: &crate::streamer::LayerStreamTime| (l.compute_ms + l.wait_ms) / 1e3;
            let inside: f64 = st.layers.iter().map(span).sum();
            let outside = (s - inside).max(0.0);
            row.outside_s = outside;
            row.overlap_ratio = s / transfer_alone.unwrap_or(0.0).max(st.compute_s);
            let kind = |sp: &LayerSpec| (sp.attn, sp.ffn);
            let (mut p_s, mut p_bytes, mut p_fl, mut missing) = (outside, 0.0, 2.0 * (cfg.hidden_size * cfg.vocab_size) as f64, Vec::new());
            for ks in &k3_specs {
                match st.layers.iter().rev().find(|l| model.plan.get(l.layer).map(kind) == Some(kind(ks))) {
                    Some(l) => {
                        p_s += span(l);
                        p_bytes += l.bytes as f64;
                        p_fl += nreq as f64 * layer_flops(&cfg, &model.plan[l.layer], t, 0);
                    }
                    None => missing.push(ks.index),
                }
            }
            if missing.is_empty() {
                row.k3_93_layers_s = p_s;
                row.k3_93_tokens_per_s = (nreq * t) as f64 / p_s;
                row.k3_93_roofline_s = roof(p_bytes, p_fl);
                row.k3_93_of_roofline = row.k3_93_roofline_s / p_s;
            } else {
                eprintln!("no 93-layer projection: this model has no layer of the kind of K3 layers {missing:?}");
            }
        }
        if args.json {
            // each row as soon as it is measured (a later row may be cut off)
            println!("{}", serde_json::to_string(&row)?);
        }
        rows.push(row);
    }
    // N concurrent prompts against one: time and weight bytes of the shared pass.
    let shared: Vec<serde_json::Value> = rows
        .iter()
        .filter(|r| r.requests > 1)
        .filter_map(|r| {
            let one = rows.iter().find(|o| o.tokens == r.tokens && o.requests == 1)?;
            Some(serde_json::json!({
                "tokens": r.tokens,
                "requests": r.requests,
                "seconds_one": one.seconds,
                "seconds_all": r.seconds,
                "time_ratio": r.seconds / one.seconds,
                "weight_gb_one": one.weight_gb,
                "weight_gb_all": r.weight_gb,
                "weight_ratio": if one.weight_gb > 0.0 { r.weight_gb / one.weight_gb } else { f64::NAN },
                "logits_max_abs_diff_vs_alone": r.logits_max_abs_diff_vs_alone,
            }))
        })
        .collect();
    if args.json {
        for x in &shared {
            println!("{}", serde_json::json!({ "shared_pass": x }));
        }
        return Ok(());
    }
    for r in rows.iter() {
        if r.streamed {
            println!("\n== {} × {} tokens, streamed weights: per layer (GPU ms) ==", r.requests, r.tokens);
            println!("{:>5} {:>4} {:>9} {:>6} {:>11} {:>9} {:>12} {:>9}", "layer", "attn", "MB", "units", "compute ms", "wait ms", "host wait ms", "copy ms");
            for l in &r.per_layer {
                let attn = match model.plan.get(l.layer).map(|s| s.attn) {
                    Some(AttnKind::Mla) => "MLA",
                    _ => "KDA",
                };
                println!(
                    "{:>5} {:>4} {:>9.1} {:>6} {:>11.2} {:>9.2} {:>12.2} {:>9.2}",
                    l.layer,
                    attn,
                    l.bytes as f64 / 1e6,
                    l.units,
                    l.compute_ms,
                    l.wait_ms,
                    l.host_wait_ms,
                    l.copy_ms
                );
            }
        }
        if !r.profile.is_empty() {
            let total: f64 = r.profile.iter().map(|x| x.1).sum();
            println!("\n== {} × {} tokens: GPU time per step (--profile) ==", r.requests, r.tokens);
            for (n, ms) in &r.profile {
                println!("{:>40} {:>10.1} ms {:>6.1} %", n, ms, 100.0 * ms / total);
            }
        }
        if !r.host_blocked.is_empty() {
            let copies = cuda.map_or("-", |c| c.gpu.host_copy.name());
            println!("\n== {} tokens: executor thread blocked on the GPU (--profile; host copies: {copies}) ==", r.tokens);
            println!("{:>32} {:>40} {:>6} {:>10} {:>10}", "what", "in step", "calls", "ms", "MB");
            for (w, st, c, ms, by) in &r.host_blocked {
                println!("{:>32} {:>40} {:>6} {:>10.1} {:>10.1}", w, st, c, ms, *by as f64 / 1e6);
            }
        }
    }
    if let Some(r) = &rates {
        println!("\n{}", r.line());
    }
    for r in &rows {
        println!("{} × {} tokens: {}", r.requests, r.tokens, r.plan);
    }
    // Rows with resident weights (the CPU backend) have no weight stream, copy rate or roofline:
    // their table holds only what was measured.
    let resident: Vec<&ModelRow> = rows.iter().filter(|r| !r.streamed).collect();
    if !resident.is_empty() {
        println!(
            "\n{:>8} {:>4} {:>8} {:>9} {:>8} {:>8} {:>7} {:>10} {:>8} {:>9}",
            "backend", "reqs", "tokens", "median s", "min s", "max s", "host GB", "tokens/s", "GFLOP", "GFLOP/s"
        );
        for r in &resident {
            println!(
                "{:>8} {:>4} {:>8} {:>9.3} {:>8.3} {:>8.3} {:>7.3} {:>10.1} {:>8.3} {:>9.2}",
                r.backend,
                r.requests,
                r.tokens,
                r.median_s,
                r.min_s,
                r.max_s,
                r.peak_host_gb,
                r.tokens_per_s,
                r.tflop * 1e3,
                r.tflop * 1e3 / r.median_s
            );
        }
    }
    let streamed: Vec<&ModelRow> = rows.iter().filter(|r| r.streamed).collect();
    if streamed.is_empty() {
        print_shared(&shared);
        return Ok(());
    }
    println!(
        "\n{:>8} {:>4} {:>8} {:>9} {:>8} {:>8} {:>7} {:>7} {:>7} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9} {:>10} {:>9} {:>8}",
        "backend",
        "reqs",
        "tokens",
        "median s",
        "min s",
        "max s",
        "dev GB",
        "used GB",
        "host GB",
        "tokens/s",
        "TFLOP",
        "weight GB",
        "H2D GB/s",
        "of src",
        "compute s",
        "wait s",
        "outside s",
        "o/max",
        "roofl. s",
        "of roofl",
        "K3 93L s",
        "K3 tok/s",
        "93L roof"
    );
    for r in &streamed {
        println!(
            "{:>8} {:>4} {:>8} {:>9.3} {:>8.3} {:>8.3} {:>7.2} {:>7.2} {:>7.2} {:>10.1} {:>8.1} {:>9.2} {:>9.1} {:>8.1}% {:>9.3} {:>9.3} {:>9.3} {:>7.3} {:>9.3} {:>8.1}% {:>10.1} {:>9.0} {:>7.1}%",
            r.backend,
            r.requests,
            r.tokens,
            r.median_s,
            r.min_s,
            r.max_s,
            r.peak_device_gb,
            r.peak_device_used_gb,
            r.peak_host_gb,
            r.tokens_per_s,
            r.tflop,
            r.weight_gb,
            r.h2d_gbs,
            100.0 * r.of_source_limit,
            r.compute_s,
            r.wait_s,
            r.outside_s,
            r.overlap_ratio,
            r.roofline_s,
            100.0 * r.of_roofline,
            r.k3_93_layers_s,
            r.k3_93_tokens_per_s,
            100.0 * r.k3_93_of_roofline
        );
    }
    print_shared(&shared);
    Ok(())
}

/// Runs longer than this get a warning before they start.
const LONG_RUN_S: f64 = 600.0;

/// One timed run of a prompt length: seconds, the streamer's counters, the first prompt's last
/// logits, the memory measured, the plan, the per-step GPU times and the host's blocking calls
/// (`--profile`).
struct TimedRun {
    s: f64,
    st: Option<crate::streamer::StreamStats>,
    first_logits: Vec<f32>,
    mem: MemoryUse,
    plan: crate::memory_plan::MemoryPlan,
    profile: Vec<(String, f64)>,
    host_blocked: Vec<(String, String, usize, f64, usize)>,
}

/// Warns before a run estimated at over ten minutes: every timed run at the
/// slower of the model's FLOPs at the measured GEMM rate (CUDA: the BF16 rate of the rates line;
/// otherwise the backend's GEMM timed on the model's width now) and its weight bytes at the
/// pinned copy rate. A lower bound: work outside the GEMMs is not in it.
fn warn_if_long<B: Backend>(model: &crate::model::Model<B>, runs: &[(usize, usize)], repeats: usize, rates: Option<&Rates>, weight_bytes: f64) {
    let flops_per_s = match rates {
        Some(r) => r.bf16_gemm_tflops * 1e12,
        None => match crate::server::predict::measure(&*model.backend, &model.cfg, 256) {
            Some(m) => m.gemm_flops_per_s,
            None => return,
        },
    };
    let copy_s = rates.map_or(0.0, |r| weight_bytes / 1e9 / r.pinned_h2d_gbs);
    let total: f64 = runs
        .iter()
        .map(|&(t, nreq)| {
            let compute = nreq as f64 * crate::model::flops::prefill_flops(&model.cfg, t, 0) / flops_per_s;
            repeats as f64 * compute.max(copy_s)
        })
        .sum();
    if total > LONG_RUN_S {
        tracing::warn!(estimated_min = format!("{:.0}", total / 60.0), "long bench run");
        eprintln!(
            "bench: this run is estimated at {:.0} minutes or more ({} lengths x {} timed runs at {:.1} GFLOP/s); fewer or shorter --tokens or a smaller --repeats shorten it",
            total / 60.0,
            runs.len(),
            repeats,
            flops_per_s / 1e9
        );
    }
}

/// The shared weight pass lines (`--concurrent`).
fn print_shared(shared: &[serde_json::Value]) {
    for x in shared {
        println!(
            "shared weight pass: {} concurrent {}-token prompts in {:.3} s = {:.2}x one prompt's {:.3} s; weight bytes {:.2} GB = {:.2}x one prompt's {:.2} GB; first prompt's logits vs alone: max |diff| {:.3e}",
            x["requests"], x["tokens"], x["seconds_all"].as_f64().unwrap_or(f64::NAN), x["time_ratio"].as_f64().unwrap_or(f64::NAN),
            x["seconds_one"].as_f64().unwrap_or(f64::NAN), x["weight_gb_all"].as_f64().unwrap_or(f64::NAN),
            x["weight_ratio"].as_f64().unwrap_or(f64::NAN), x["weight_gb_one"].as_f64().unwrap_or(f64::NAN),
            x["logits_max_abs_diff_vs_alone"].as_f64().unwrap_or(f64::NAN)
        );
    }
}
