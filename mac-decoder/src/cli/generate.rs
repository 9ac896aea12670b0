//! `k3-decode generate`: decode tokens after a local prefill of `--input-ids`, or from a hand-off
//! state (`--state SESSION.safetensors`), or both (the ids continue the state). Prints (and with
//! `--out` writes) `{"tokens": [...]}`; speed goes to the log.
//!
//! With `--prefill-node` and/or `--next-turn` it runs a conversation of one or more turns
//! ([`crate::remote::run_turn`]), each prompt routed to the prefill node or prefilled locally,
//! the timing table of every turn on stderr; stdout (and `--out`) carry the last turn's tokens,
//! plus `"turns": [[...], ...]` when there is more than one turn. Both forms load the model the
//! same way (`--bf16`, `--prefill-chunk`) and decode with the same loop ([`crate::decode_loop`]).

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
    /// Tokens to generate after the prompt (fewer when a stop token comes first).
    #[arg(long, default_value_t = 16)]
    pub max_new_tokens: usize,
    /// Greedy decoding (argmax); otherwise sample with the parameters below.
    #[arg(long)]
    pub greedy: bool,
    /// Sampling temperature (ignored with --greedy).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus sampling: sample from the smallest set of tokens whose probability reaches this (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sample among the k most likely tokens only (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampler (the same seed, prompt and options give the same tokens).
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
    /// Context limit in tokens, prompt (with a `--state`'s tokens) + `--max-new-tokens` (0: what
    /// half the memory available beside the weights holds, capped by the config's
    /// `max_position_embeddings`, as `k3-decode serve` computes it). A longer run is refused
    /// before anything is prefilled.
    #[arg(long, default_value_t = 0)]
    pub max_context: usize,
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
    /// The sampling flags as [`crate::decode_loop::GenerateParams`]; `eos` joins the stop tokens with `--stop-at-eos`.
    pub fn generate_params(&self, eos: u32) -> crate::decode_loop::GenerateParams {
        let mut stop_tokens = self.stop.clone();
        if self.stop_at_eos {
            stop_tokens.push(eos);
        }
        crate::decode_loop::GenerateParams {
            max_new_tokens: self.max_new_tokens,
            sampling: crate::sampler::SamplingParams {
                greedy: self.greedy,
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: self.seed,
            },
            stop_tokens,
            logprobs: None,
        }
    }
}

/// The process's peak resident set (bytes), from `getrusage`.
#[cfg(feature = "mlx")]
fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0;
    }
    let v = u.ru_maxrss.max(0) as u64;
    if cfg!(target_os = "macos") {
        v
    } else {
        v * 1024
    } // bytes on macOS, KiB elsewhere
}

#[cfg(not(feature = "mlx"))]
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("k3-decode was built without the `mlx` feature; rebuild with default features")
}

#[cfg(feature = "mlx")]
pub fn run(args: Args) -> anyhow::Result<()> {
    use anyhow::{bail, Context};

    use crate::decode::{ComputeDtype, Engine, EngineOptions};
    use k3_protocol::files::read_token_ids;

    // A timing table needs the per-turn path (it times local turns too: the demo compares both).
    let conversation = args.node.prefill_node.is_some() || !args.next_turn.is_empty() || args.timing_json.is_some();
    // Read every input before the (slow) model load, so a wrong path fails at once.
    let turns = if conversation {
        if args.state.is_some() {
            bail!("--state cannot be combined with --prefill-node, --next-turn or --timing-json (a conversation starts from its prompt ids)");
        }
        let first = args.input_ids.as_deref().context("--prefill-node, --next-turn and --timing-json need --input-ids (the first turn's prompt)")?;
        let mut turns = vec![read_token_ids(first)?];
        for p in &args.next_turn {
            turns.push(read_token_ids(p)?);
        }
        if let Some((i, _)) = turns.iter().enumerate().find(|(_, t)| t.is_empty()) {
            bail!("turn {} has no token ids", i + 1);
        }
        turns
    } else {
        if args.input_ids.is_none() && args.state.is_none() {
            bail!("give --input-ids (local prefill), --state (hand-off state), or both");
        }
        args.input_ids.as_deref().map(read_token_ids).transpose()?.into_iter().collect()
    };
    // The context limit before the (slow) model load: a prompt past it is refused now, not
    // after hours of prefill and gigabytes of state.
    let max_context = {
        let ck = k3_protocol::Checkpoint::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?;
        let budget = crate::memory::budget(None, ck.total_bytes());
        crate::engine::context_limit::limit(&ck.config().text_config, args.prefill_chunk, args.max_context, budget)
    };
    let prompt_tokens: usize = turns.iter().map(Vec::len).sum();
    check_context(max_context, 0, prompt_tokens, turns.len().max(1) * args.max_new_tokens)?;
    let engine = Engine::load_with_dtype(
        &args.model,
        EngineOptions { prefill_chunk: args.prefill_chunk, progress: std::io::IsTerminal::is_terminal(&std::io::stderr()) },
        if args.bf16 { ComputeDtype::Bf16 } else { ComputeDtype::F32 },
    )?;
    let params = args.generate_params(engine.eos_token());
    let json = if conversation {
        run_conversation(&args, &engine, &params, &turns)?
    } else {
        let mut session = engine.new_session()?;
        if let Some(state) = &args.state {
            let info = engine.ingest_session_file(&mut session, state)?;
            tracing::info!(tokens = info.tokens, path = %state.display(), "hand-off state ingested");
            check_context(max_context, info.tokens, prompt_tokens, args.max_new_tokens)?;
        }
        if let Some(ids) = turns.first() {
            let t0 = std::time::Instant::now();
            engine.prefill_local(&mut session, ids, None)?;
            let secs = t0.elapsed().as_secs_f64();
            tracing::info!(tokens = ids.len(), seconds = secs, tok_per_s = ids.len() as f64 / secs, "local prefill");
        }
        let out = engine.generate(&mut session, &params, |_| true)?;
        tracing::info!(
            tokens = out.tokens.len(),
            tok_per_s = format!("{:.2}", out.tokens_per_second()),
            finish = ?out.finish,
            rank = engine.world().rank(),
            peak_rss_mb = format!("{:.1}", peak_rss_bytes() as f64 / 1e6),
            "decode"
        );
        serde_json::json!({ "tokens": out.tokens })
    };
    println!("{json}");
    if let Some(path) = &args.out {
        std::fs::write(path, format!("{json}\n")).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(feature = "mlx")]
/// Refuses a run past the context limit `limit`: `held` tokens of a state, `prompt` new ones,
/// `new` to generate.
fn check_context(limit: usize, held: usize, prompt: usize, new: usize) -> anyhow::Result<()> {
    let total = held.saturating_add(prompt).saturating_add(new);
    if total > limit {
        let state = if held > 0 { format!("a state of {held} tokens + ") } else { String::new() };
        anyhow::bail!(
            "{state}{prompt} prompt tokens + {new} to generate = {total} tokens exceed the context limit of {limit} tokens \
             (set another with --max-context; nothing was prefilled)"
        );
    }
    Ok(())
}

/// The turns of one conversation, routed through the prefill node when one is configured;
/// prints the timing table and returns the JSON to print.
#[cfg(feature = "mlx")]
fn run_conversation(
    args: &Args,
    engine: &crate::decode::Engine,
    params: &crate::decode_loop::GenerateParams,
    turns: &[Vec<u32>],
) -> anyhow::Result<serde_json::Value> {
    use anyhow::Context;

    use crate::remote::{format_table, run_turn, Conversation, RemotePrefiller};

    let mut remote = match args.node.remote_options() {
        Some(mut o) => {
            o.retry_after = std::time::Duration::from_secs(30);
            Some(RemotePrefiller::new(engine, o)?)
        }
        None => None,
    };
    let mut conv = Conversation::new(engine)?;
    let mut outputs = Vec::new();
    let mut timings = Vec::new();
    for (i, prompt) in turns.iter().enumerate() {
        let (out, t) = run_turn(engine, &mut conv, remote.as_mut(), prompt, None, params, |_| true).with_context(|| format!("turn {}", i + 1))?;
        tracing::info!(
            turn = i + 1,
            route = t.route.as_str(),
            prompt = prompt.len(),
            context = t.context_tokens,
            generated = out.tokens.len(),
            first_token_s = t.first_token_s.map(|v| format!("{v:.3}")).unwrap_or_default(),
            "turn done"
        );
        outputs.push(out.tokens);
        timings.push(t);
    }
    eprintln!("\n{}", format_table(&timings));
    if let Some(path) = &args.timing_json {
        let text = serde_json::to_string_pretty(&timings)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    let last = outputs.last().cloned().unwrap_or_default();
    Ok(if outputs.len() == 1 { serde_json::json!({ "tokens": last }) } else { serde_json::json!({ "tokens": last, "turns": outputs }) })
}
