//! `k3-prefill bench`: prefill throughput.
//!
//! Two modes:
//! - `--model DIR`: the whole model through the layer-major executor on the chosen backend
//!   (`--backend cpu|cuda|auto`), for each `--tokens` length: tokens/s and GFLOP/s. On CUDA the
//!   weights are streamed per prompt (`--vram-budget`, `--expert-chunk`; `--resident` keeps
//!   them loaded instead), with compute vs waiting-for-weights per layer.
//! - `--project`: real K3 widths (7168 hidden, 896 MXFP4 experts) without a checkpoint. A few
//!   layers (`--layers`, pattern KDA,KDA,KDA,MLA as in K3) with random weights held in host
//!   RAM are streamed to the GPU by the [`WeightStreamer`] (pinned double-buffered staging, copy
//!   stream) while the previous unit computes; each run is timed three ways — transfer alone,
//!   compute alone, overlapped — and the per-layer times are extrapolated to K3's 69 KDA + 24
//!   MLA layers. The roofline is `max(weight bytes / PCIe, FLOPs / peak)` per layer.
//!   `--vram-budget GB` bounds the device memory of the weight slots: when two whole layers do
//!   not fit, a layer's experts stream in chunks into two expert slots.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use serde::Serialize;

use super::forward::BackendChoice;
use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::cuda::gpu::Event;
use crate::cuda::profile;
use crate::cuda::synth_layer::{self as sl, Attn, Dims, LayerLayout, LayerState, LayerWeights};
use crate::cuda::{CudaBackend, Precision};
use crate::executor::{ExecOptions, LogitsRows, PrefillInput};
use crate::model::{Model, WeightPolicy};
use crate::streamer::{HostRegions, WeightStreamer};

/// Arguments of `k3-prefill bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (model mode).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt lengths.
    #[arg(long, value_delimiter = ',', default_value = "8192,32768,131072")]
    pub tokens: Vec<usize>,
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// CUDA precision: bf16 (serving) or f32 (check mode).
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Projection mode: real K3 widths from host memory, extrapolated to all 93 layers.
    #[arg(long)]
    pub project: bool,
    /// Projection: layers to run (pattern KDA,KDA,KDA,MLA,...).
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Projection: routed experts per layer (default: K3's 896).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Projection and model mode (CUDA): device memory for weight slots, GB (default: two
    /// whole layers); below that, each layer's routed experts stream in chunks.
    #[arg(long)]
    pub vram_budget: Option<f64>,
    /// Model mode (CUDA): at most this many routed experts per streamed transfer unit.
    #[arg(long)]
    pub expert_chunk: Option<usize>,
    /// Model mode (CUDA): keep every layer resident instead of streaming the weights per prompt.
    #[arg(long)]
    pub resident: bool,
    /// Tokens per chunk within a layer.
    #[arg(long, default_value_t = 16384)]
    pub chunk_tokens: usize,
    /// Reader threads of the streamer.
    #[arg(long, default_value_t = 16)]
    pub readers: usize,
    /// Projection: keep the host weight images page-locked and DMA straight from them (a model
    /// held in pinned RAM) instead of copying through the staging buffers (a model in page cache).
    #[arg(long)]
    pub pinned_source: bool,
    /// Bytes per pinned staging buffer, MiB (two are allocated).
    #[arg(long, default_value_t = 512)]
    pub stage_mib: usize,
    /// Host-to-device bandwidth of the roofline, GB/s.
    #[arg(long, default_value_t = 55.0)]
    pub pcie_gbs: f64,
    /// Peak BF16 tensor rate of the roofline, TFLOP/s.
    #[arg(long, default_value_t = 790.0)]
    pub peak_tflops: f64,
    /// Projection: skip the transfer-alone and compute-alone runs.
    #[arg(long)]
    pub overlapped_only: bool,
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
    /// (each as `K3_MOE_DENSE`, e.g. `streams=8;streams=2,group_mib=2048`).
    #[arg(long, value_delimiter = ';')]
    pub moe_dense_configs: Vec<String>,
}

pub fn run(args: Args) -> Result<()> {
    if args.kernels && args.elementwise_only {
        return super::bench_elementwise::run(&args.tokens, args.reps, args.json);
    }
    if args.kernels {
        return kernels(&args);
    }
    if args.project {
        return project(&args);
    }
    let Some(dir) = args.model.clone() else { bail!("bench: give --model DIR, or --project for real-width layers without a checkpoint") };
    let ck = Arc::new(k3_protocol::Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?);
    match args.backend {
        BackendChoice::Cpu => model_bench(Arc::new(CpuBackend), ck, &args),
        BackendChoice::Cuda => model_bench(Arc::new(CudaBackend::new(args.precision.parse()?)?), ck, &args),
        BackendChoice::Auto => match crate::cuda::probe() {
            Ok(_) => model_bench(Arc::new(CudaBackend::new(args.precision.parse()?)?), ck, &args),
            Err(why) => {
                tracing::info!("--backend auto: no CUDA ({why}); using the CPU reference");
                model_bench(Arc::new(CpuBackend), ck, &args)
            }
        },
    }
}

#[derive(Serialize)]
struct ModelRow {
    backend: String,
    tokens: usize,
    seconds: f64,
    tokens_per_s: f64,
    gflop: f64,
    gflop_per_s: f64,
    /// Weights streamed per prompt (CUDA) or resident.
    streamed: bool,
    weight_gb: f64,
    /// Σ over layers: GPU compute, GPU waiting for weights, executor waiting for the readers,
    /// copy stream busy (streamed only).
    compute_s: f64,
    wait_s: f64,
    host_wait_s: f64,
    copy_s: f64,
    h2d_gbs: f64,
    per_layer: Vec<crate::streamer::LayerStreamTime>,
}

fn model_bench<B: Backend + 'static>(b: Arc<B>, ck: Arc<k3_protocol::Checkpoint>, args: &Args) -> Result<()> {
    let stream = crate::streamer::is_cuda_backend(&*b) && !args.resident;
    let model = Model::new(b.clone(), ck, if stream { WeightPolicy::PerLayer } else { WeightPolicy::Resident })?;
    let sw = if stream {
        let opts = crate::streamer::StreamOptions {
            vram_budget: crate::streamer::StreamOptions::budget_from_gb(args.vram_budget)?,
            readers: args.readers.max(1),
            stage_bytes: args.stage_mib.max(1) << 20,
            expert_chunk: args.expert_chunk,
        };
        let sw = crate::streamer::streamed_weights_for(&model, &opts)?;
        eprintln!("weight streamer: {}", sw.plan().describe());
        Some(sw)
    } else {
        None
    };
    let cfg = model.cfg.clone();
    let d = Dims::of(&cfg);
    let opts = ExecOptions { chunk_tokens: args.chunk_tokens, logits: LogitsRows::Last, ..ExecOptions::default() };
    let ids_of = |t: usize| -> Vec<u32> { (0..t).map(|i| ((i as u64 * 2654435761) % (cfg.vocab_size.min(1000) as u64)) as u32).collect() };
    // warm-up (kernel compilation, allocator pools), untimed
    let mut state = k3_protocol::handoff::HandoffState::empty(&cfg);
    crate::streamer::prefill_maybe_streamed(&model, sw.as_ref(), &mut state, PrefillInput::tokens(&ids_of(256)), &opts, |_| Ok(()))?;
    let mut rows = Vec::new();
    for &t in &args.tokens {
        let ids = ids_of(t);
        let mut state = k3_protocol::handoff::HandoffState::empty(&cfg);
        let t0 = Instant::now();
        let (_, st) = crate::streamer::prefill_maybe_streamed(&model, sw.as_ref(), &mut state, PrefillInput::tokens(&ids), &opts, |_| Ok(()))?;
        let s = t0.elapsed().as_secs_f64();
        let mut flops = 0.0;
        for spec in &model.plan {
            let attn = if spec.attn == k3_protocol::config::AttnKind::Mla { Attn::Mla } else { Attn::Kda };
            flops += sl::layer_flops(attn, &d, t, 0);
        }
        flops += 2.0 * (cfg.hidden_size * cfg.vocab_size) as f64;
        let st = st.unwrap_or_default();
        rows.push(ModelRow {
            backend: b.name().into(),
            tokens: t,
            seconds: s,
            tokens_per_s: t as f64 / s,
            gflop: flops / 1e9,
            gflop_per_s: flops / 1e9 / s,
            streamed: stream,
            weight_gb: st.bytes as f64 / 1e9,
            compute_s: st.compute_s,
            wait_s: st.wait_s,
            host_wait_s: st.host_wait_s,
            copy_s: st.copy_s,
            h2d_gbs: if st.copy_s > 0.0 { st.bytes as f64 / 1e9 / st.copy_s } else { f64::NAN },
            per_layer: st.layers,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    for r in rows.iter().filter(|r| r.streamed) {
        println!("\n== {} tokens, streamed weights: per layer (GPU ms) ==", r.tokens);
        println!("{:>5} {:>4} {:>9} {:>6} {:>11} {:>9} {:>12} {:>9}", "layer", "attn", "MB", "units", "compute ms", "wait ms", "host wait ms", "copy ms");
        for l in &r.per_layer {
            let attn = match model.plan.get(l.layer).map(|s| s.attn) {
                Some(k3_protocol::config::AttnKind::Mla) => "MLA",
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
    println!(
        "\n{:>8} {:>8} {:>10} {:>12} {:>10} {:>10} {:>9} {:>10} {:>9} {:>10} {:>9} {:>9}",
        "backend", "tokens", "seconds", "tokens/s", "GFLOP", "GFLOP/s", "weight GB", "compute s", "wait s", "host wait", "copy s", "H2D GB/s"
    );
    for r in &rows {
        println!(
            "{:>8} {:>8} {:>10.3} {:>12.1} {:>10.1} {:>10.1} {:>9.3} {:>10.3} {:>9.3} {:>10.3} {:>9.3} {:>9.1}",
            r.backend, r.tokens, r.seconds, r.tokens_per_s, r.gflop, r.gflop_per_s, r.weight_gb, r.compute_s, r.wait_s, r.host_wait_s, r.copy_s, r.h2d_gbs
        );
    }
    Ok(())
}

// ---- projection mode ----------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Unit {
    /// Dense tensors of layer `l` (and all its experts when `whole`).
    Dense { l: usize, whole: bool },
    /// Experts `lo..hi` of layer `l`.
    Experts { l: usize, lo: usize, hi: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Transfer,
    Compute,
    Overlap,
}

#[derive(Serialize, Default, Clone)]
struct LayerTime {
    layer: usize,
    attn: String,
    weight_gb: f64,
    tflop: f64,
    compute_ms: f64,
    wait_ms: f64,
    roofline_ms: f64,
}

#[derive(Serialize, Default)]
struct ProjRow {
    tokens: usize,
    layers_run: usize,
    experts: usize,
    whole_layer_slots: bool,
    expert_chunk: usize,
    transfer_alone_s: f64,
    compute_alone_s: f64,
    overlapped_s: f64,
    overlap_ratio: f64,
    h2d_gbs: f64,
    host_fill_gbs: f64,
    compute_tflops: f64,
    per_layer: Vec<LayerTime>,
    roofline_s: f64,
    roofline_fraction: f64,
    k3_93_layers_s: f64,
    k3_93_roofline_s: f64,
    k3_tokens_per_s: f64,
}

struct Proj<'a> {
    b: &'a CudaBackend,
    d: Dims,
    lay: [LayerLayout; 2],
    regions: HostRegions,
    attn: Vec<Attn>,
    units: Vec<Unit>,
    dense_slots: [crate::cuda::DevMem; 2],
    expert_slots: Vec<crate::cuda::DevMem>,
    whole: bool,
    chunk: usize,
}

fn li(a: Attn) -> usize {
    if a == Attn::Kda {
        0
    } else {
        1
    }
}

fn project(args: &Args) -> Result<()> {
    let prec: Precision = args.precision.parse()?;
    let b = CudaBackend::new(prec)?;
    let mut cfg = k3_protocol::synth::presets::build_config(k3_protocol::synth::presets::Preset::K3, &Default::default())
        .map_err(|e| anyhow::anyhow!("K3 config: {e}"))?
        .text_config;
    if let Some(e) = args.experts {
        cfg.num_experts = e;
    }
    let d = Dims::of(&cfg);
    let lay = [LayerLayout::new(Attn::Kda, &d)?, LayerLayout::new(Attn::Mla, &d)?];
    let attn: Vec<Attn> = (0..args.layers).map(|i| if i % 4 == 3 { Attn::Mla } else { Attn::Kda }).collect();
    let t0 = Instant::now();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    let mut regions = HostRegions::new(vec![Arc::new(lay[0].dense_image()), Arc::new(lay[1].dense_image()), Arc::new(lay[0].experts_image(7, threads))]);
    if args.pinned_source {
        let t1 = Instant::now();
        regions.pin(&b.gpu)?;
        eprintln!("host images page-locked in {:.1} s: the streamer copies straight from them", t1.elapsed().as_secs_f64());
    }
    let host_gb = regions.0.iter().map(|r| r.len()).sum::<usize>() as f64 / 1e9;
    eprintln!("host weight images: {host_gb:.1} GB in {:.1} s", t0.elapsed().as_secs_f64());
    // slots
    let max_total = lay.iter().map(|l| l.total_bytes()).max().unwrap_or(0);
    let max_dense = lay.iter().map(|l| l.dense_bytes).max().unwrap_or(0);
    let stride = lay[0].experts.stride;
    let budget = args.vram_budget.map(|g| (g * 1e9) as usize).unwrap_or(2 * max_total);
    let whole = 2 * max_total <= budget;
    let chunk = if whole {
        d.experts
    } else {
        ensure!(budget > 2 * max_dense + 2 * stride, "--vram-budget {:.1} GB is below two dense layers plus two experts", budget as f64 / 1e9);
        ((budget - 2 * max_dense) / 2 / stride).min(d.experts)
    };
    let dense_slot = if whole { max_total } else { max_dense };
    sl::ensure_room(&b, 2 * dense_slot + if whole { 0 } else { 2 * chunk * stride }, "weight slots")?;
    let dense_slots = [b.gpu.alloc_sync(dense_slot)?, b.gpu.alloc_sync(dense_slot)?];
    let expert_slots = if whole { Vec::new() } else { vec![b.gpu.alloc_sync(chunk * stride)?, b.gpu.alloc_sync(chunk * stride)?] };
    let mut units = Vec::new();
    for l in 0..args.layers {
        units.push(Unit::Dense { l, whole });
        if !whole {
            let mut lo = 0;
            while lo < d.experts {
                let hi = (lo + chunk).min(d.experts);
                units.push(Unit::Experts { l, lo, hi });
                lo = hi;
            }
        }
    }
    eprintln!(
        "weight slots: {} ({:.1} GB each){}; layer = {:.2} GB (dense {:.2} GB)",
        if whole { "2 whole layers" } else { "2 dense + 2 expert chunks" },
        dense_slot as f64 / 1e9,
        if whole { String::new() } else { format!(", {chunk} experts per chunk ({:.1} GB)", (chunk * stride) as f64 / 1e9) },
        max_total as f64 / 1e9,
        max_dense as f64 / 1e9
    );
    let p = Proj { b: &b, d, lay, regions, attn, units, dense_slots, expert_slots, whole, chunk };
    let mut streamer = WeightStreamer::new(b.gpu.clone(), args.stage_mib << 20, args.readers)?;
    // Warm-up, untimed: the kernels compile (NVRTC) at first use, which would otherwise land in
    // the first timed run. 8192 tokens reach every kernel the timed lengths use (incl. the dense
    // expert path, taken from 128 rows per expert).
    if let Some(&t_max) = args.tokens.iter().max() {
        let w0 = Instant::now();
        run_mode(&p, &mut streamer, t_max.min(8192), args, Mode::Compute)?;
        profile::reset();
        eprintln!("warm-up (kernel compilation, {} tokens): {:.1} s", t_max.min(8192), w0.elapsed().as_secs_f64());
    }
    let mut rows = Vec::new();
    for &t in &args.tokens {
        let mut row = ProjRow { tokens: t, layers_run: args.layers, experts: p.d.experts, whole_layer_slots: p.whole, expert_chunk: p.chunk, ..Default::default() };
        if !args.overlapped_only {
            let (s, _, bytes, fill) = run_mode(&p, &mut streamer, t, args, Mode::Transfer)?;
            row.transfer_alone_s = s;
            row.h2d_gbs = bytes as f64 / 1e9 / s;
            // no host fill when the source is page-locked (direct DMA)
            row.host_fill_gbs = if fill > 0.0 { bytes as f64 / 1e9 / fill } else { f64::NAN };
            let (s, _, _, _) = run_mode(&p, &mut streamer, t, args, Mode::Compute)?;
            row.compute_alone_s = s;
        }
        let (s, per_layer, bytes, _) = run_mode(&p, &mut streamer, t, args, Mode::Overlap)?;
        row.overlapped_s = s;
        if args.overlapped_only {
            row.h2d_gbs = f64::NAN;
        }
        let total_flops: f64 = per_layer.iter().map(|l| l.tflop).sum::<f64>() * 1e12;
        row.compute_tflops = if row.compute_alone_s > 0.0 { total_flops / row.compute_alone_s / 1e12 } else { f64::NAN };
        row.overlap_ratio = s / row.transfer_alone_s.max(row.compute_alone_s);
        row.roofline_s = per_layer.iter().map(|l| l.roofline_ms).sum::<f64>() / 1e3;
        row.roofline_fraction = row.roofline_s / s;
        // extrapolation to 93 layers: 69 KDA + 24 MLA, per-layer time = compute + wait of the
        // steady-state layers (the first layer's pipeline fill is left out when possible)
        let steady = |a: &str| -> (f64, f64) {
            let v: Vec<&LayerTime> = per_layer.iter().filter(|l| l.attn == a).collect();
            let v: Vec<&LayerTime> = if v.len() > 1 { v.into_iter().filter(|l| l.layer > 0).collect() } else { v };
            let n = v.len().max(1) as f64;
            (v.iter().map(|l| l.compute_ms + l.wait_ms).sum::<f64>() / n, v.iter().map(|l| l.roofline_ms).sum::<f64>() / n)
        };
        let (kt, kr) = steady("KDA");
        let (mt, mr) = steady("MLA");
        let (mt, mr) = if per_layer.iter().any(|l| l.attn == "MLA") { (mt, mr) } else { (f64::NAN, f64::NAN) };
        row.k3_93_layers_s = (69.0 * kt + 24.0 * mt) / 1e3;
        row.k3_93_roofline_s = (69.0 * kr + 24.0 * mr) / 1e3;
        row.k3_tokens_per_s = t as f64 / row.k3_93_layers_s;
        let _ = bytes;
        row.per_layer = per_layer;
        rows.push(row);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    for r in &rows {
        println!("\n== {} tokens, {} layers, {} experts/layer ==", r.tokens, r.layers_run, r.experts);
        println!("{:>5} {:>4} {:>8} {:>8} {:>10} {:>9} {:>11} {:>7}", "layer", "attn", "GB", "TFLOP", "compute ms", "wait ms", "roofline ms", "ratio");
        for l in &r.per_layer {
            println!(
                "{:>5} {:>4} {:>8.2} {:>8.1} {:>10.1} {:>9.1} {:>11.1} {:>7.2}",
                l.layer,
                l.attn,
                l.weight_gb,
                l.tflop,
                l.compute_ms,
                l.wait_ms,
                l.roofline_ms,
                l.roofline_ms / (l.compute_ms + l.wait_ms)
            );
        }
    }
    println!("\n{:>8} {:>10} {:>10} {:>10} {:>7} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9}", "tokens", "xfer s", "compute s", "overlap s", "o/max", "H2D GB/s", "fill GB/s", "TFLOP/s", "roofl. s", "of roofl", "K3 93L s", "K3 tok/s");
    for r in &rows {
        println!(
            "{:>8} {:>10.3} {:>10.3} {:>10.3} {:>7.3} {:>8.1} {:>8.1} {:>8.1} {:>9.3} {:>8.1}% {:>9.1} {:>9.0}",
            r.tokens,
            r.transfer_alone_s,
            r.compute_alone_s,
            r.overlapped_s,
            r.overlap_ratio,
            r.h2d_gbs,
            r.host_fill_gbs,
            r.compute_tflops,
            r.roofline_s,
            100.0 * r.roofline_fraction,
            r.k3_93_layers_s,
            r.k3_tokens_per_s
        );
    }
    Ok(())
}

/// One run over all units; returns (wall seconds, per-layer times, bytes moved, host fill seconds).
fn run_mode(p: &Proj<'_>, st: &mut WeightStreamer, t: usize, args: &Args, mode: Mode) -> Result<(f64, Vec<LayerTime>, usize, f64)> {
    let b = p.b;
    let g = &b.gpu;
    let h = p.d.hidden;
    let c = args.chunk_tokens.min(t).max(1);
    let nchunks = t.div_ceil(c);
    // activations: the running sum P and two bank entries per token chunk
    let (mut pc, bank): (Vec<_>, Vec<Vec<_>>) = if mode == Mode::Transfer {
        (Vec::new(), Vec::new())
    } else {
        let mut pc = Vec::new();
        let mut bank = Vec::new();
        for ci in 0..nchunks {
            let rows = c.min(t - ci * c);
            let mk = |seed: u64| -> Result<_> {
                let v: Vec<f32> = (0..rows * h).map(|i| (((i as u64 ^ seed).wrapping_mul(2654435761) >> 8) % 2000) as f32 / 1000.0 - 1.0).collect();
                b.upload(&v, rows, h)
            };
            pc.push(mk(ci as u64)?);
            bank.push(vec![mk(1000 + ci as u64)?, mk(2000 + ci as u64)?]);
        }
        (pc, bank)
    };
    let mut states: Vec<Option<LayerState>> = (0..args.layers).map(|_| None).collect();
    if mode != Mode::Transfer {
        for (l, s) in states.iter_mut().enumerate() {
            *s = Some(LayerState::new(b, p.attn[l], &p.d, t)?);
        }
    }
    g.sync()?;
    profile::reset();
    let wall0 = Instant::now();
    let mut ev_t: Vec<(usize, Event, Event, Event)> = Vec::new(); // (unit, before wait, after wait, done)
    // which slot each unit uses, and the previous unit on the same slot
    let mut slot_of = Vec::new();
    {
        let (mut nd, mut ne) = (0usize, 0usize);
        for u in &p.units {
            match u {
                Unit::Dense { .. } => {
                    slot_of.push(nd % 2);
                    nd += 1;
                }
                Unit::Experts { .. } => {
                    slot_of.push(ne % 2);
                    ne += 1;
                }
            }
        }
    }
    // The unit whose compute must end before unit i's slot may be overwritten: the previous
    // expert unit on the same expert slot, or, for a dense slot, the last unit of the layer that
    // held it (its expert units still read the dense weights in moe_back).
    let layer_of = |u: &Unit| match *u {
        Unit::Dense { l, .. } | Unit::Experts { l, .. } => l,
    };
    let free_after: Vec<Option<usize>> = (0..p.units.len())
        .map(|i| {
            let same_ring = |j: &usize| matches!(p.units[*j], Unit::Dense { .. }) == matches!(p.units[i], Unit::Dense { .. }) && slot_of[*j] == slot_of[i];
            let prev = (0..i).rev().find(same_ring)?;
            match p.units[i] {
                Unit::Experts { .. } => Some(prev),
                Unit::Dense { .. } => (prev..i).rev().find(|&j| layer_of(&p.units[j]) == layer_of(&p.units[prev])),
            }
        })
        .collect();
    // the dense slot of each layer (expert units need the layer's dense weights for moe_back)
    let upload = |st: &mut WeightStreamer, i: usize, free: Option<&Event>| -> Result<(Event, crate::streamer::UploadStats)> {
        match p.units[i] {
            Unit::Dense { l, whole } => {
                let lay = &p.lay[li(p.attn[l])];
                let dst = p.dense_slots[slot_of[i]].ptr;
                let mut parts = lay.dense_parts(li(p.attn[l]));
                if whole {
                    parts.extend(lay.expert_parts(2, 0, p.d.experts, lay.dense_bytes));
                }
                st.upload(&p.regions, &parts, dst, free)
            }
            Unit::Experts { l, lo, hi } => {
                let lay = &p.lay[li(p.attn[l])];
                st.upload(&p.regions, &lay.expert_parts(2, lo, hi, 0), p.expert_slots[slot_of[i]].ptr, free)
            }
        }
    };
    // per-layer carry between units: MoE plans when experts come in chunks
    let mut plans: Vec<(crate::cuda::backend::MoePlan, crate::cuda::backend::CudaBuf)> = Vec::new();
    let mut new_p: Vec<crate::cuda::backend::CudaBuf> = Vec::new();
    let mut dense_slot_of_layer = vec![0usize; args.layers];
    let n_units = p.units.len();
    let st = std::sync::Mutex::new(st);
    let mut bytes = 0usize;
    let mut fill = 0.0;
    let mut stall = 0.0;
    std::thread::scope(|sc| -> Result<()> {
        // Uploads run ahead on their own thread, in unit order, each as soon as the unit that last
        // used its slot has been issued on the compute stream (the copy stream then waits for it
        // on the GPU). The compute thread blocks at times (the dense expert path reads the
        // per-expert row counts back), which must not hold up the transfers.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(usize, Event, crate::streamer::UploadStats)>>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<(usize, Event)>();
        let uploader = if mode != Mode::Compute {
            let (upload, free_after, st) = (&upload, &free_after, &st);
            Some(sc.spawn(move || -> Result<(f64, Vec<(Event, Event)>, f64)> {
                let mut done: Vec<Option<Event>> = (0..n_units).map(|_| None).collect();
                // diagnostics: host time waiting for compute to issue a slot's previous user, and
                // the copy stream's GPU time waiting for that user to finish
                let (mut host_wait, mut gpu_waits) = (0.0, Vec::new());
                for n in 0..n_units {
                    if let Some(f) = free_after[n].filter(|_| mode == Mode::Overlap) {
                        let t0 = Instant::now();
                        while done[f].is_none() {
                            match done_rx.recv() {
                                Ok((u, e)) => done[u] = Some(e),
                                Err(_) => return Ok((host_wait, gpu_waits, 0.0)), // the compute side stopped (an error)
                            }
                        }
                        host_wait += t0.elapsed().as_secs_f64();
                        let (a, b) = (g.event()?, g.event()?);
                        a.record(g.copy_stream())?;
                        done[f].as_ref().expect("received above").wait_on(g.copy_stream())?;
                        b.record(g.copy_stream())?;
                        gpu_waits.push((a, b));
                    }
                    let r = st.lock().map_err(|_| anyhow::anyhow!("streamer lock poisoned")).and_then(|mut s| upload(&mut s, n, None)).map(|(e, s)| (n, e, s));
                    let failed = r.is_err();
                    if ready_tx.send(r).is_err() || failed {
                        break;
                    }
                }
                Ok((host_wait, gpu_waits, wall0.elapsed().as_secs_f64()))
            }))
        } else {
            None
        };
        let (mut wait_uploads, mut issue) = (0.0, 0.0);
        for i in 0..n_units {
            let ready = if mode == Mode::Compute {
                // compute alone: load the unit's weights first, untimed (only GPU compute intervals count)
                g.sync()?;
                let mut guard = st.lock().map_err(|_| anyhow::anyhow!("streamer lock poisoned"))?;
                let (e, _) = upload(&mut guard, i, None)?;
                drop(guard);
                e.sync()?;
                None
            } else {
                let t0 = Instant::now();
                let (u, e, s) = ready_rx.recv().map_err(|_| anyhow::anyhow!("unit {i}: the upload thread stopped"))??;
                wait_uploads += t0.elapsed().as_secs_f64();
                ensure!(u == i, "unit {u} uploaded, {i} expected");
                bytes += s.bytes;
                fill += s.fill_s;
                stall += s.stall_s;
                Some(e)
            };
            let t_issue = Instant::now();
            if mode != Mode::Transfer {
                let e0 = g.event()?;
                e0.record(g.stream())?;
                if let Some(r) = ready.as_ref().filter(|_| mode == Mode::Overlap) {
                    r.wait_on(g.stream())?;
                }
                let e1 = g.event()?;
                e1.record(g.stream())?;
                match p.units[i] {
                    Unit::Dense { l, whole } => {
                        dense_slot_of_layer[l] = slot_of[i];
                        let lay = &p.lay[li(p.attn[l])];
                        let base = p.dense_slots[slot_of[i]].ptr;
                        let w = LayerWeights::view(b, lay, base);
                        let stt = states[l].as_mut().expect("state");
                        plans.clear();
                        new_p.clear();
                        for ci in 0..nchunks {
                            let bank_refs: Vec<&crate::cuda::backend::CudaBuf> = bank[ci].iter().collect();
                            let (p2, xn2) = sl::attention(b, &w, &p.d, &bank_refs, &pc[ci], stt, ci * c)?;
                            let (plan, sh) = sl::moe_front(b, &w, &p.d, &xn2)?;
                            drop(xn2);
                            plans.push((plan, sh));
                            new_p.push(p2);
                        }
                        if whole {
                            // the routed experts of all token chunks at once (one dequantisation)
                            let refs: Vec<&crate::cuda::backend::MoePlan> = plans.iter().map(|(pl, _)| pl).collect();
                            profile::mark(g, "-")?;
                            b.moe_run_chunks(&refs, &lay.experts, base + lay.dense_bytes as u64, 0, p.d.experts, p.d.betas, None)?;
                            profile::mark(g, "routed experts")?;
                            for (ci, (plan, sh)) in plans.iter().enumerate() {
                                sl::moe_back(b, &w, &p.d, plan, sh, &mut new_p[ci])?;
                            }
                            for (ci, np) in new_p.drain(..).enumerate() {
                                pc[ci] = np;
                            }
                            plans.clear();
                        }
                    }
                    Unit::Experts { l, lo, hi } => {
                        let lay = &p.lay[li(p.attn[l])];
                        profile::mark(g, "-")?;
                        let refs: Vec<&crate::cuda::backend::MoePlan> = plans.iter().map(|(pl, _)| pl).collect();
                        b.moe_run_chunks(&refs, &lay.experts, p.expert_slots[slot_of[i]].ptr, lo, hi, p.d.betas, None)?;
                        profile::mark(g, "routed experts")?;
                        if hi == p.d.experts {
                            let w = LayerWeights::view(b, lay, p.dense_slots[dense_slot_of_layer[l]].ptr);
                            for (ci, (plan, sh)) in plans.iter().enumerate() {
                                sl::moe_back(b, &w, &p.d, plan, sh, &mut new_p[ci])?;
                            }
                            for (ci, np) in new_p.drain(..).enumerate() {
                                pc[ci] = np;
                            }
                            plans.clear();
                        }
                    }
                }
                let e2 = g.event()?;
                e2.record(g.stream())?;
                ev_t.push((i, e0, e1, e2));
                if mode == Mode::Overlap {
                    let d = g.event()?;
                    d.record(g.stream())?;
                    // the upload thread has ended once every unit is uploaded: fine
                    let _ = done_tx.send((i, d));
                }
            }
            issue += t_issue.elapsed().as_secs_f64();
        }
        drop(done_tx);
        if let Some(h) = uploader {
            let (host_wait, gpu_waits, up_end) = h.join().map_err(|_| anyhow::anyhow!("the upload thread panicked"))??;
            if mode == Mode::Overlap {
                g.sync_copy()?;
                g.sync()?;
                let gpu_wait: f64 = gpu_waits.iter().map(|(a, b)| a.ms_to(b).map(|x| x as f64 / 1e3)).sum::<Result<f64>>()?;
                eprintln!(
                    "overlap at {t} tokens: uploads waited {host_wait:.3} s for compute to issue a slot's previous user, the copy stream {gpu_wait:.3} s for it to finish; compute waited {wait_uploads:.3} s for uploads and took {issue:.3} s to issue; the last upload was issued at {up_end:.3} s, the GPU done at {:.3} s", wall0.elapsed().as_secs_f64()
                );
            }
        }
        Ok(())
    })?;
    g.sync()?;
    g.sync_copy()?;
    if mode == Mode::Compute && profile::enabled() {
        let steps = profile::report()?;
        let total: f64 = steps.iter().map(|s| s.1).sum();
        eprintln!("K3_PROFILE: {t} tokens, {} layers, GPU time per step (compute alone)", args.layers);
        for (name, ms) in &steps {
            eprintln!("  {name:<40} {ms:>10.1} ms  {:>5.1} %", 100.0 * ms / total.max(1e-9));
        }
    }
    let mut wall = wall0.elapsed().as_secs_f64();
    if mode == Mode::Compute {
        wall = 0.0;
        for (_, _, e1, e2) in &ev_t {
            wall += e1.ms_to(e2)? as f64 / 1e3;
        }
    }
    // per-layer accounting
    let mut per: Vec<LayerTime> = (0..args.layers)
        .map(|l| {
            let lay = &p.lay[li(p.attn[l])];
            let fl = sl::layer_flops(p.attn[l], &p.d, t, 0);
            let gb = lay.total_bytes() as f64 / 1e9;
            LayerTime {
                layer: l,
                attn: if p.attn[l] == Attn::Kda { "KDA".into() } else { "MLA".into() },
                weight_gb: gb,
                tflop: fl / 1e12,
                roofline_ms: 1e3 * (gb / args.pcie_gbs).max(fl / 1e12 / args.peak_tflops),
                ..Default::default()
            }
        })
        .collect();
    for (i, e0, e1, e2) in &ev_t {
        let l = match p.units[*i] {
            Unit::Dense { l, .. } | Unit::Experts { l, .. } => l,
        };
        per[l].wait_ms += e0.ms_to(e1)? as f64;
        per[l].compute_ms += e1.ms_to(e2)? as f64;
    }
    if mode == Mode::Compute {
        eprintln!("{mode:?} run at {t} tokens: {wall:.3} s");
    } else {
        // host side of the uploads: filling the staging buffers, and waiting for a staging
        // buffer's previous DMA (copy stream behind: PCIe, or a slot not yet free)
        eprintln!("{mode:?} run at {t} tokens: {wall:.3} s (staging fill {fill:.3} s, waits for staging {stall:.3} s)");
    }
    Ok((wall, per, bytes, fill))
}

// ---- kernel mode ---------------------------------------------------------------------------

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

fn kernels(args: &Args) -> Result<()> {
    use crate::backend::KdaDims;
    let mut b = CudaBackend::new(Precision::Bf16)?;
    let g = b.gpu.clone();
    let (h, d) = (96usize, 128usize);
    let kd = KdaDims { heads: h, head_dim: d };
    let mut rows = Vec::new();
    let moe_bench = MoeBench::new(&b)?;
    let rnd = |n: usize, seed: u64, lo: f32, hi: f32| -> Vec<f32> {
        (0..n).map(|i| lo + (hi - lo) * ((((i as u64) ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / (1u64 << 24) as f32)).collect()
    };
    for &t in &args.tokens {
        if args.experts_only {
            let moe = moe_bench.time(&mut b, t, args.reps, &args.moe_dense_configs)?;
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
        b.l2_norm_heads(&mut q, d, 1e-6, 1.0 / (d as f32).sqrt())?;
        b.l2_norm_heads(&mut k, d, 1e-6, 1.0)?;
        let v = b.upload(&rnd(t * c, 3, -1.0, 1.0), t, c)?;
        let gg = b.upload(&rnd(t * c, 4, -5.0, 0.0), t, c)?;
        let beta = b.upload(&rnd(t * h, 5, 0.0, 1.0), t, h)?;
        let mut times = Vec::new();
        for rep in 0..=args.reps {
            let mut s = b.zeros(h, d * d)?;
            let e0 = g.event()?;
            let e1 = g.event()?;
            e0.record(g.stream())?;
            let o = b.kda_chunked(&q, &k, &v, &gg, &beta, &mut s, kd, 64)?;
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
        let m = moe_bench.time(&mut b, t, args.reps, &args.moe_dense_configs)?;
        let r = KernelRow {
            tokens: t,
            kda_ms,
            kda_tflops: kflops / kda_ms / 1e9,
            mla_ms,
            mla_tflops: mflops / mla_ms / 1e9,
            moe: m,
        };
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
        // a configuration outside that list (the pipelined ones) when K3_MLA_KERNEL names it
        if let kk::MlaKernel::Wgmma(v) = kk::MlaKernel::from_env()? {
            if !kk::MLA_SM90_VARIANTS.contains(&v) {
                kernels_run.push(kk::MlaKernel::Wgmma(v));
            }
        }
    }
    for kern in kernels_run {
        let packed = kk::mla_pack(&g, kern, qf.ptr(), h * dqk, kvf.ptr(), h * (128 + dv), kpe.ptr(), 64, t, 0, h, 128, 64, dv)?;
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
    /// The path `--backend cuda` takes at this length (`K3_MOE_PATH=auto`).
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
    d: Dims,
    lay: crate::cuda::backend::ExpertLayout,
    arena: crate::cuda::DevMem,
}

impl MoeBench {
    fn new(b: &CudaBackend) -> Result<Self> {
        let d = Dims::of(
            &k3_protocol::synth::presets::build_config(k3_protocol::synth::presets::Preset::K3, &Default::default())
                .map_err(|e| anyhow::anyhow!("K3 config: {e}"))?
                .text_config,
        );
        let lay = crate::cuda::backend::ExpertLayout::new(d.inter, d.latent)?;
        let arena = b.gpu.alloc_sync(lay.stride * d.experts)?;
        // every code 7 (6.0), every scale 2^-8
        unsafe {
            crate::cuda::gpu::ck(cudarc::driver::sys::cuMemsetD8_v2(arena.ptr, 0x77, arena.bytes), "filling the expert arena")?;
        }
        Ok(MoeBench { d, lay, arena })
    }

    /// Both expert GEMMs (gate/up + SiTU, down; not the gather and combine) over `t` tokens with
    /// uniform routing, on the mma.sync kernel and on the dense path (median of `reps`).
    fn time(&self, b: &mut CudaBackend, t: usize, reps: usize, dense_configs: &[String]) -> Result<MoeTimes> {
        let (d, g) = (&self.d, b.gpu.clone());
        let ids: Vec<i32> = (0..t * d.top_k).map(|i| (((i / d.top_k) * 7919 + (i % d.top_k) * 56) % d.experts) as i32).collect();
        let ids_d = b.upload_bytes(bytemuck::cast_slice(&ids))?;
        let w_d = b.upload_bytes(bytemuck::cast_slice(&vec![1.0f32 / d.top_k as f32; t * d.top_k]))?;
        let x: Vec<f32> = (0..t * d.latent).map(|i| ((((i as u64) ^ 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / (1u64 << 23) as f32) - 1.0).collect();
        let xl = b.upload(&x, t, d.latent)?;
        drop(x);
        let saved = b.moe_path;
        b.moe_path = crate::cuda::moe_dense::MoePath::Auto;
        let mut plan = b.moe_prepare(&xl, ids_d.ptr, w_d, d.top_k, d.experts, &self.lay)?;
        b.moe_path = saved;
        drop(xl);
        let auto_dense = plan.dense;
        let eflops = (t * d.top_k) as f64 * 3.0 * 2.0 * (d.inter * d.latent) as f64;
        // GPU time from events; the host's enqueue time is logged (a path bound by launches
        // shows GPU time ~ enqueue time)
        let timed = |b: &CudaBackend, plan: &crate::cuda::backend::MoePlan| -> Result<(f64, f64)> {
            let (mut times, mut host) = (Vec::new(), Vec::new());
            for rep in 0..=reps {
                let e0 = g.event()?;
                let e1 = g.event()?;
                e0.record(g.stream())?;
                let h0 = Instant::now();
                b.moe_run_chunk(plan, &self.lay, self.arena.ptr, 0, d.experts, d.betas, None)?;
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
            moe_rows_per_expert: (t * d.top_k) as f64 / d.experts as f64,
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
