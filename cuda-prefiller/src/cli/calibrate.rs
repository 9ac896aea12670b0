//! `k3-prefill calibrate`: routed-expert statistics over a prompt set (docs/pruning.md), by the
//! normal layer-major prefill with a MoE observer attached ([`crate::calibrate`]). The
//! statistics file is rewritten after every prompt, so an interrupted run resumes where it
//! stopped (the prompt file must still start with the prompts already done).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use k3_protocol::handoff::HandoffState;
use k3_protocol::prune::ExpertStats;
use k3_protocol::Checkpoint;

use crate::backend::Backend;
use crate::calibrate::{MoeObserverRef, StatsCollector};
use crate::cli::backend_args::{BackendArgs, Opened};
use crate::cli::forward::StreamArgs;
use crate::executor::{ExecOptions, LogitsRows, PrefillInput};
use crate::memory_plan::{LogitsKept, PlanRequest};
use crate::prefiller::{Prefiller, PrefillerOptions, WeightMode};

/// Arguments of `k3-prefill calibrate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (release layout).
    #[arg(long)]
    pub model: PathBuf,
    /// Prompts, JSON lines: each a JSON array of token ids or `{"text": "..."}` (tokenized with
    /// the checkpoint's tokenizer, as plain text); blank lines are skipped.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Statistics file (JSON, docs/pruning.md). If it exists, calibration resumes from it.
    #[arg(long)]
    pub out: PathBuf,
    /// Start over even if `--out` exists.
    #[arg(long)]
    pub fresh: bool,
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Tokens per chunk within a layer (calibration holds each chunk's expert input once per
    /// routed slot: keep it moderate on a GPU, e.g. 2048).
    #[arg(long)]
    pub chunk_tokens: Option<usize>,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub memory: crate::cli::backend_args::MemoryArgs,
}

impl Args {
    /// The command's defaults with these paths (for programs and tests that call [`run_with`]).
    pub fn with_paths(model: &Path, prompts: &Path, out: &Path) -> Self {
        use clap::{Args as _, FromArgMatches};
        let cmd = Self::augment_args(clap::Command::new("calibrate"));
        let m = cmd.get_matches_from([
            std::ffi::OsStr::new("calibrate"),
            "--model".as_ref(),
            model.as_os_str(),
            "--prompts".as_ref(),
            prompts.as_os_str(),
            "--out".as_ref(),
            out.as_os_str(),
        ]);
        Self::from_arg_matches(&m).expect("the defaults parse")
    }
}

/// The checkpoint's tokenizer, loaded on the first `{"text": ...}` prompt.
pub struct PromptTokenizer<'a> {
    dir: &'a Path,
    tok: Option<k3_protocol::tokenizer::Tokenizer>,
}

impl<'a> PromptTokenizer<'a> {
    pub fn new(model_dir: &'a Path) -> Self {
        PromptTokenizer { dir: model_dir, tok: None }
    }

    fn get(&mut self) -> anyhow::Result<&k3_protocol::tokenizer::Tokenizer> {
        if self.tok.is_none() {
            let t = k3_protocol::tokenizer::Tokenizer::from_dir(self.dir)
                .with_context(|| format!("loading the tokenizer of {} for text prompts", self.dir.display()))?;
            self.tok = Some(t);
        }
        Ok(self.tok.as_ref().expect("loaded above"))
    }
}

/// One prompt line: a JSON array of token ids, or `{"text": "..."}`, encoded with the
/// checkpoint's tokenizer as plain text (special-token names in it are not special).
pub fn parse_prompt(line: &str, lineno: usize, path: &Path, tok: &mut PromptTokenizer) -> anyhow::Result<Vec<u32>> {
    let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{} line {lineno}: not JSON", path.display()))?;
    let ids = match v {
        serde_json::Value::Array(a) => k3_protocol::files::token_ids(&a).with_context(|| format!("{} line {lineno}", path.display()))?,
        serde_json::Value::Object(o) if o.contains_key("text") => {
            let Some(text) = o.get("text").and_then(|t| t.as_str()) else {
                bail!("{} line {lineno}: \"text\" must be a string", path.display());
            };
            tok.get()
                .with_context(|| format!("{} line {lineno}", path.display()))?
                .encode(text, false)
                .with_context(|| format!("{} line {lineno}: tokenizing the text", path.display()))?
        }
        _ => bail!("{} line {lineno}: expected a JSON array of token ids or {{\"text\": \"...\"}}", path.display()),
    };
    if ids.is_empty() {
        bail!("{} line {lineno}: empty prompt", path.display());
    }
    Ok(ids)
}

/// The non-blank lines of the prompt file, trimmed, with their 1-based line numbers.
fn prompt_lines(path: &Path) -> anyhow::Result<Vec<(usize, String)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read prompts {}", path.display()))?;
    Ok(text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()).map(|(i, l)| (i + 1, l.trim().to_string())).collect())
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.backend.open()? {
        Opened::Cpu(b) => run_with(b, &args).map(drop),
        Opened::Cuda(b) => run_with(b, &args).map(drop),
    }
}

/// The whole command over a chosen backend; returns the final statistics.
pub fn run_with<B: Backend + 'static>(backend: Arc<B>, args: &Args) -> anyhow::Result<ExpertStats> {
    let lines = prompt_lines(&args.prompts)?;
    if lines.is_empty() {
        bail!("{}: no prompts", args.prompts.display());
    }
    let mut tok = PromptTokenizer::new(&args.model);
    let prompts: Vec<Vec<u32>> = lines.iter().map(|(n, l)| parse_prompt(l, *n, &args.prompts, &mut tok)).collect::<anyhow::Result<_>>()?;
    let ck = Arc::new(Checkpoint::open(&args.model).with_context(|| format!("opening model {}", args.model.display()))?);
    let fingerprint = ck.fingerprint();
    let streams = backend.streams_weights();
    let chunk = args.chunk_tokens.unwrap_or_else(|| backend.default_chunk_tokens().min(2048)).max(1);
    let pf = Prefiller::open(
        backend,
        ck,
        &PrefillerOptions {
            weights: if streams { WeightMode::Streamed(args.stream.options()?) } else { WeightMode::PerLayer },
            memory: args.memory.options(),
            chunk_tokens: Some(chunk),
            logits: LogitsKept::None,
            design: vec![PlanRequest { base: 0, new: prompts.iter().map(Vec::len).max().unwrap_or(1).max(1) }],
            design_cap: usize::MAX,
            emulate_source_gbs: None,
        },
    )?;
    eprintln!("{}", pf.design_plan.line());
    let model = &*pf.model;

    let stats = if args.out.exists() && !args.fresh {
        let s = ExpertStats::load(&args.out)?;
        s.check_model(&model.cfg, &fingerprint, &args.out)?;
        if s.prompts_done > lines.len() {
            bail!("{}: {} prompts already done, but {} holds only {}", args.out.display(), s.prompts_done, args.prompts.display(), lines.len());
        }
        let digest =
            lines[..s.prompts_done].iter().fold(ExpertStats::new(&model.cfg, &fingerprint).prompts_digest, |d, (_, l)| ExpertStats::chain_digest(&d, l));
        if digest != s.prompts_digest {
            bail!(
                "{}: its first {} prompts differ from those in {} (resume with the same prompt file, or pass --fresh)",
                args.prompts.display(),
                s.prompts_done,
                args.out.display()
            );
        }
        tracing::info!(done = s.prompts_done, total = lines.len(), "resuming calibration");
        s
    } else {
        ExpertStats::new(&model.cfg, &fingerprint)
    };
    let done = stats.prompts_done;
    if done == lines.len() {
        tracing::info!(out = %args.out.display(), "calibration already complete");
        return Ok(stats);
    }
    let collector = StatsCollector::new(stats);
    let opts = ExecOptions { chunk_tokens: chunk, logits: LogitsRows::None, moe_observer: Some(MoeObserverRef(collector.clone())), ..Default::default() };
    let todo: u64 = prompts[done..].iter().map(|p| p.len() as u64).sum();
    let bar = ProgressBar::new(todo);
    bar.set_style(
        ProgressStyle::with_template("calibrate [{elapsed_precise}] {wide_bar} {pos}/{len} tokens {per_sec} {msg} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let t0 = std::time::Instant::now();
    for (i, ids) in prompts.iter().enumerate().skip(done) {
        bar.set_message(format!("prompt {}/{}", i + 1, prompts.len()));
        let before = collector.snapshot();
        let mut state = HandoffState::empty(&model.cfg);
        // The statistics carry the fingerprint: the weights that made them are checked against
        // it (each layer once per process, SHA-256; see `forward`).
        let r = model
            .ck
            .verify_outside_layers()
            .map_err(anyhow::Error::from)
            .and_then(|()| pf.prefill(&mut state, PrefillInput::tokens(ids), &opts, |ev| Ok(model.ck.verify_layer(ev.layer)?)));
        if let Err(e) = r {
            collector.restore(before);
            return Err(e.context(format!("prompt {} ({} line {})", i + 1, args.prompts.display(), lines[i].0)));
        }
        let mut s = collector.snapshot();
        s.prompts_done = i + 1;
        s.prompts_digest = ExpertStats::chain_digest(&s.prompts_digest, &lines[i].1);
        s.tokens += ids.len() as u64;
        s.save(&args.out)?;
        collector.restore(s);
        bar.inc(ids.len() as u64);
    }
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    tracing::info!(
        prompts = prompts.len() - done,
        tokens = todo,
        secs = format!("{secs:.3}"),
        tokens_per_s = format!("{:.1}", todo as f64 / secs.max(1e-9)),
        out = %args.out.display(),
        "calibration done"
    );
    Ok(collector.snapshot())
}
