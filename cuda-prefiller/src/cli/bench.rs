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
//!   not fit, a layer's experts stream in chunks into two expert slots (bench_project.rs).
//! - `--kernels`: the KDA, MLA and expert kernels alone at K3 shapes (bench_kernels.rs), or the
//!   memory-bound f32 ops (`--elementwise-only`, bench_elementwise.rs).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::forward::BackendChoice;
use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::cuda::synth_layer::{self as sl, Attn, Dims};
use crate::cuda::CudaBackend;
use crate::executor::{ExecOptions, LogitsRows, PrefillInput};
use crate::model::{Model, WeightPolicy};

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
        return super::bench_kernels::run(&args);
    }
    if args.project {
        return super::bench_project::run(&args);
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
