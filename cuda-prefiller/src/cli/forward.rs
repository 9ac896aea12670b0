//! `k3-prefill forward`: one prompt through the layer-major executor; writes the logits of every
//! prompt position and the hand-off state under the golden tensor names (golden/README.md):
//! `logits [T, vocab]`, `kda.{l}.recurrent|conv_q|conv_k|conv_v`, `mla.{l}.latent`, plus the
//! `hidden.*` vectors of the last position with `--dump-hidden`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use k3_protocol::handoff::{load_session, save_session, token_prefix_hash, HandoffState, SessionMeta};
use k3_protocol::Checkpoint;

use crate::backend::Backend;
use crate::cli::backend_args::{BackendArgs, MemoryArgs, Opened};
use crate::executor::{ExecOptions, HiddenTrace, LogitsRows, PrefillInput};
use crate::memory_plan::{LogitsKept, PlanRequest};
use crate::prefiller::{Prefiller, PrefillerOptions, WeightMode};
use crate::streamer::{StreamOptions, WeightsFrom};

/// Arguments of `k3-prefill forward`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (release layout).
    #[arg(long)]
    pub model: PathBuf,
    /// JSON array of token ids.
    #[arg(long)]
    pub input_ids: PathBuf,
    /// Output safetensors file: `logits` and the hand-off state (golden names, fp32).
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Continue from a session file (a previous `--out`): the ids are the NEW tokens.
    #[arg(long)]
    pub state: Option<PathBuf>,
    /// Also write the golden `hidden.*` vectors of the last position.
    #[arg(long)]
    pub dump_hidden: bool,
    /// Tokens per chunk within a layer (default: the memory plan's, at most 512 on the CPU,
    /// 16384 on a GPU with ≥ 64 GiB, 4096 on smaller GPUs).
    #[arg(long)]
    pub chunk_tokens: Option<usize>,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// CUDA: load each layer's weights synchronously when the executor reaches it instead of
    /// streaming them (the former path; for comparison).
    #[arg(long)]
    pub sync_weights: bool,
}

/// Weight streaming on the CUDA backend (`forward`, `serve`): the next layer's weights are read
/// by a pool of threads into pinned staging and copied on the copy stream while the current
/// layer computes; each prompt's weights cross PCIe once (layer-major).
#[derive(clap::Args, Debug, Clone)]
pub struct StreamArgs {
    /// CUDA: at most this many routed experts per transfer unit (experts stream in chunks even
    /// where whole layers fit the budget, in units of their own after the layer's dense tensors,
    /// also when N holds all of a layer's experts: the layer's attention starts before they arrive).
    #[arg(long)]
    pub expert_chunk: Option<usize>,
    /// CUDA: reader threads filling the staging buffers (default: half the cores, 2 to 8).
    #[arg(long)]
    pub stream_readers: Option<usize>,
    /// CUDA: bytes per pinned staging buffer, MiB (two are allocated).
    #[arg(long, default_value_t = 256)]
    pub stage_mib: usize,
    /// CUDA: copy every shard once into page-locked host memory at start; the GPU then copies
    /// the weights straight from it (a machine whose RAM holds the model).
    #[arg(long, conflicts_with = "direct_io")]
    pub pin_host: bool,
    /// CUDA: read the shards with O_DIRECT (NVMe straight into the pinned staging, no page
    /// cache; the file system must support direct I/O).
    #[arg(long)]
    pub direct_io: bool,
    /// CUDA, with --pin-host: at most this many 64 MiB weight copies in flight, so the compute
    /// stream's own small uploads do not queue behind a whole layer (default: no limit).
    #[arg(long)]
    pub copy_window: Option<usize>,
}

impl StreamArgs {
    pub fn options(&self) -> anyhow::Result<StreamOptions> {
        let d = StreamOptions::default();
        anyhow::ensure!(self.stage_mib > 0, "--stage-mib must be at least 1");
        Ok(StreamOptions {
            // the memory plan sizes the slots (crate::prefiller)
            vram_budget: None,
            readers: self.stream_readers.unwrap_or(d.readers).max(1),
            stage_bytes: self.stage_mib << 20,
            expert_chunk: self.expert_chunk,
            weights_from: if self.pin_host {
                WeightsFrom::PinHost
            } else if self.direct_io {
                WeightsFrom::Direct
            } else {
                WeightsFrom::PageCache
            },
            copy_window: self.copy_window,
            embed_on_device: true,
        })
    }

    /// Whether any streaming option was given (they only apply to the CUDA backend).
    pub fn given(&self) -> bool {
        self.expert_chunk.is_some() || self.stream_readers.is_some() || self.pin_host || self.direct_io || self.copy_window.is_some()
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.backend.open()? {
        Opened::Cpu(b) => run_with(b, &args),
        Opened::Cuda(b) => run_with(b, &args),
    }
}

fn hidden_tensors(t: &HiddenTrace, h: usize) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = vec![
        ("hidden.embed".to_string(), vec![h], t.embed.clone()),
        ("hidden.final_mix".to_string(), vec![h], t.final_mix.clone()),
        ("hidden.final_normed".to_string(), vec![h], t.final_normed.clone()),
    ];
    for (name, rows) in [
        ("hidden.attn_in", &t.attn_in),
        ("hidden.attn_out", &t.attn_out),
        ("hidden.mlp_in", &t.mlp_in),
        ("hidden.mlp_out", &t.mlp_out),
        ("hidden.after_layer", &t.after_layer),
    ] {
        out.push((name.to_string(), vec![rows.len(), h], rows.concat()));
    }
    out
}

/// The whole command over a chosen backend.
pub fn run_with<B: Backend + 'static>(backend: Arc<B>, args: &Args) -> anyhow::Result<()> {
    let ids = k3_protocol::files::read_token_ids(&args.input_ids)?;
    if ids.is_empty() {
        bail!("{}: no token ids", args.input_ids.display());
    }
    let ck = Arc::new(Checkpoint::open(&args.model).with_context(|| format!("opening model {}", args.model.display()))?);
    let fingerprint = ck.fingerprint();
    let cfg = ck.config().text_config.clone();
    let mut state = match &args.state {
        Some(p) => {
            let sf = load_session(p, &cfg)?;
            if let Some(fp) = sf.fingerprint {
                if fp != fingerprint {
                    bail!("session {} was made with model {}, not {}", p.display(), fp.short(), fingerprint.short());
                }
            }
            sf.state
        }
        None => HandoffState::empty(&cfg),
    };
    let base = state.tokens;
    let weights = if backend.streams_weights() && !args.sync_weights {
        WeightMode::Streamed(args.stream.options()?)
    } else {
        if args.stream.given() {
            tracing::warn!("the weight-streaming options apply to the CUDA backend without --sync-weights; ignored");
        }
        WeightMode::PerLayer
    };
    // the plan first: a prompt that cannot fit is refused before any weight is read
    let pf = Prefiller::open(
        backend,
        ck,
        &PrefillerOptions {
            weights,
            memory: args.memory.options(),
            chunk_tokens: args.chunk_tokens.map(|c| c.max(1)),
            logits: LogitsKept::All,
            design: vec![PlanRequest { base, new: ids.len() }],
            design_cap: usize::MAX,
            emulate_source_gbs: None,
        },
    )?;
    eprintln!("{}", pf.design_plan.line());
    let model = &pf.model;
    let opts = ExecOptions { logits: LogitsRows::All, trace_last: args.dump_hidden, ..Default::default() };
    let bar = ProgressBar::new(model.plan.len() as u64);
    bar.set_style(ProgressStyle::with_template("{msg} [{bar:40}] layer {pos}/{len} {elapsed}").unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_message(format!("prefill {} tokens ({}{})", ids.len(), model.backend.name(), if pf.streamed.is_some() { ", streamed weights" } else { "" }));
    let t0 = std::time::Instant::now();
    // Weight identity: the state is labelled with the fingerprint only once every tensor the
    // pass read matched the digest the fingerprint is made from (SHA-256, as `serve` checks each
    // layer); a forged digest cache or a shard edited in place is refused, and its cache deleted.
    model.ck.verify_outside_layers().context("checking the weights against the model fingerprint")?;
    let (out, stats, _plan) = pf.prefill(&mut state, PrefillInput::tokens(&ids), &opts, |ev| {
        model.ck.verify_layer(ev.layer).context("checking the weights against the model fingerprint")?;
        bar.inc(1);
        tracing::debug!(layer = ev.layer, "layer state ready");
        Ok(())
    })?;
    bar.finish_and_clear();
    tracing::info!(tokens = ids.len(), base, secs = t0.elapsed().as_secs_f64(), "forward done");
    if let Some(st) = &stats {
        tracing::info!(
            weights_gb = format!("{:.3}", st.bytes as f64 / 1e9),
            compute_s = format!("{:.3}", st.compute_s),
            waiting_for_weights_s = format!("{:.3}", st.wait_s + st.host_wait_s),
            copy_s = format!("{:.3}", st.copy_s),
            "weights streamed"
        );
    }

    // every layer was checked as it ran; this answers from those results
    model.ck.verify_all().context("checking the weights against the model fingerprint")?;
    let mut extra: Vec<(String, Vec<usize>, Vec<f32>)> = vec![("logits".into(), vec![out.logits_rows, out.vocab], out.logits)];
    if let Some(t) = &out.trace {
        extra.extend(hidden_tensors(t, model.dims.hidden));
    }
    let extra_refs: Vec<(String, Vec<usize>, &[f32])> = extra.iter().map(|(n, s, d)| (n.clone(), s.clone(), &d[..])).collect();
    // The prefix hash covers only the tokens of this call when continuing (earlier ids are not known here).
    let meta = SessionMeta { fingerprint, tokens: state.tokens, token_prefix_hash: token_prefix_hash(&ids) };
    save_session(&args.out, &state, if base == 0 { Some(&meta) } else { None }, &extra_refs)?;
    tracing::info!(out = %args.out.display(), "wrote logits and hand-off state");
    Ok(())
}
