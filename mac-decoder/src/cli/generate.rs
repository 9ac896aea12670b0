//! `k3-decode generate`: decode tokens after a local prefill of `--input-ids`, or from a hand-off
//! state (`--state SESSION.safetensors`), or both (the ids continue the state). Prints (and with
//! `--out` writes) `{"tokens": [...]}`; speed goes to the log.

use std::path::PathBuf;

/// Arguments of `k3-decode generate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (release layout).
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt token ids: a JSON array of integers.
    #[arg(long)]
    pub input_ids: Option<PathBuf>,
    /// Decode from a hand-off state (session file, or a golden file: same tensor names).
    #[arg(long)]
    pub state: Option<PathBuf>,
    #[arg(long, default_value_t = 16)]
    pub max_new_tokens: usize,
    /// Greedy decoding (argmax); otherwise sample with the parameters below.
    #[arg(long)]
    pub greedy: bool,
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop after emitting any of these token ids (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub stop: Vec<u32>,
    /// Also stop at the model's eos_token_id.
    #[arg(long)]
    pub stop_at_eos: bool,
    /// Weights in BF16 as stored (the Metal path; MLX's CPU backend is faster in f32, the default).
    #[arg(long)]
    pub bf16: bool,
    /// Tokens per local-prefill chunk.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Write `{"tokens": [...]}` here as well.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Split inference (see crate::remote).
    #[command(flatten)]
    pub node: super::prefill_node::PrefillNodeArgs,
    /// More turns of the same conversation: each file's ids follow the previous turn's output.
    #[arg(long)]
    pub next_turn: Vec<PathBuf>,
    /// Write the per-turn timing breakdown (JSON) here.
    #[arg(long)]
    pub timing_json: Option<PathBuf>,
}

#[cfg(feature = "mlx")]
impl Args {
    /// The sampling flags as [`crate::decode::GenerateParams`]; `eos` joins the stop tokens with `--stop-at-eos`.
    pub fn generate_params(&self, eos: u32) -> crate::decode::GenerateParams {
        let mut stop_tokens = self.stop.clone();
        if self.stop_at_eos {
            stop_tokens.push(eos);
        }
        crate::decode::GenerateParams {
            max_new_tokens: self.max_new_tokens,
            sampling: crate::sampler::SamplingParams {
                greedy: self.greedy,
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: self.seed,
            },
            stop_tokens,
        }
    }
}

/// Reads a JSON array of token ids.
pub fn read_ids(path: &std::path::Path) -> anyhow::Result<Vec<u32>> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: Vec<i64> = serde_json::from_str(&text)
        .with_context(|| format!("{}: expected a JSON array of integer token ids", path.display()))?;
    v.iter()
        .enumerate()
        .map(|(i, &x)| {
            u32::try_from(x).map_err(|_| anyhow::anyhow!("{}: token {x} at position {i} is not a valid id", path.display()))
        })
        .collect()
}

#[cfg(not(feature = "mlx"))]
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("k3-decode was built without the `mlx` feature; rebuild with default features")
}

#[cfg(feature = "mlx")]
pub fn run(args: Args) -> anyhow::Result<()> {
    use crate::decode::{ComputeDtype, Engine, EngineOptions};

    if args.node.prefill_node.is_some() || !args.next_turn.is_empty() {
        return crate::remote::cli::run_generate(&args);
    }
    if args.input_ids.is_none() && args.state.is_none() {
        anyhow::bail!("give --input-ids (local prefill), --state (hand-off state), or both");
    }
    let ids = args.input_ids.as_deref().map(read_ids).transpose()?;
    let engine = Engine::load_with_dtype(
        &args.model,
        EngineOptions { prefill_chunk: args.prefill_chunk, progress: std::io::IsTerminal::is_terminal(&std::io::stderr()) },
        if args.bf16 { ComputeDtype::Bf16 } else { ComputeDtype::F32 },
    )?;
    let mut session = engine.new_session()?;
    if let Some(state) = &args.state {
        let info = engine.ingest_session_file(&mut session, state)?;
        tracing::info!(tokens = info.tokens, path = %state.display(), "hand-off state ingested");
    }
    if let Some(ids) = &ids {
        let t0 = std::time::Instant::now();
        engine.prefill_local(&mut session, ids, None)?;
        let secs = t0.elapsed().as_secs_f64();
        tracing::info!(tokens = ids.len(), seconds = secs, tok_per_s = ids.len() as f64 / secs, "local prefill");
    }
    let params = args.generate_params(engine.eos_token());
    let out = engine.generate(&mut session, &params, |_| true)?;
    tracing::info!(
        tokens = out.tokens.len(),
        tok_per_s = format!("{:.2}", out.tokens_per_second()),
        finish = ?out.finish,
        "decode"
    );
    let json = serde_json::json!({ "tokens": out.tokens });
    println!("{json}");
    if let Some(path) = &args.out {
        std::fs::write(path, format!("{json}\n")).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}
