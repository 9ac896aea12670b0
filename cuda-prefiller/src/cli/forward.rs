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
use crate::cli::backend_args::{BackendArgs, Opened};
use crate::executor::{ExecOptions, HiddenTrace, LogitsRows, PrefillInput};
use crate::model::{Model, WeightPolicy};
use crate::streamer::{prefill_maybe_streamed, streamed_weights_for, StreamOptions, WeightsFrom};

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
    /// Tokens per chunk within a layer (default: 512 on the CPU, 16384 on a GPU with ≥ 64 GiB,
    /// 4096 on smaller GPUs).
    #[arg(long)]
    pub chunk_tokens: Option<usize>,
    #[command(flatten)]
    pub stream: StreamArgs,
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
    /// CUDA: device memory for the streamer's weight slots, GB (default: two of the largest
    /// layer). When two whole layers do not fit, each layer's routed experts stream in chunks
    /// (e.g. 24 on a 32 GB card).
    #[arg(long)]
    pub vram_budget: Option<f64>,
    /// CUDA: at most this many routed experts per transfer unit (experts stream in chunks even
    /// where whole layers fit the budget).
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
            vram_budget: StreamOptions::budget_from_gb(self.vram_budget)?,
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
        })
    }

    /// Whether any streaming option was given (they only apply to the CUDA backend).
    pub fn given(&self) -> bool {
        self.vram_budget.is_some() || self.expert_chunk.is_some() || self.stream_readers.is_some() || self.pin_host || self.direct_io || self.copy_window.is_some()
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
    let model = Model::new(backend, ck, WeightPolicy::PerLayer)?;
    let mut state = match &args.state {
        Some(p) => {
            let sf = load_session(p, &model.cfg)?;
            if let Some(fp) = sf.fingerprint {
                if fp != fingerprint {
                    bail!("session {} was made with model {}, not {}", p.display(), fp.short(), fingerprint.short());
                }
            }
            sf.state
        }
        None => HandoffState::empty(&model.cfg),
    };
    let base = state.tokens;
    let opts = ExecOptions {
        chunk_tokens: args.chunk_tokens.unwrap_or_else(|| model.backend.default_chunk_tokens()).max(1),
        logits: LogitsRows::All,
        trace_last: args.dump_hidden,
        ..Default::default()
    };
    let streamed = if model.backend.streams_weights() && !args.sync_weights {
        Some(streamed_weights_for(&model, &args.stream.options()?)?)
    } else {
        if args.stream.given() {
            tracing::warn!("the weight-streaming options apply to the CUDA backend without --sync-weights; ignored");
        }
        None
    };
    let bar = ProgressBar::new(model.plan.len() as u64);
    bar.set_style(ProgressStyle::with_template("{msg} [{bar:40}] layer {pos}/{len} {elapsed}").unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_message(format!(
        "prefill {} tokens ({}{})",
        ids.len(),
        model.backend.name(),
        if streamed.is_some() { ", streamed weights" } else { "" }
    ));
    let t0 = std::time::Instant::now();
    let (out, stats) = prefill_maybe_streamed(&model, streamed.as_ref(), &mut state, PrefillInput::tokens(&ids), &opts, |ev| {
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
