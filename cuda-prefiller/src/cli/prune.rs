//! `k3-prefill prune`: writes a checkpoint keeping the best routed experts of every MoE layer by
//! calibration statistics ([`k3_protocol::prune`], docs/pruning.md).

use std::path::PathBuf;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use k3_protocol::config::FfnKind;
use k3_protocol::prune::{
    check_keep, keep_for_budget, prune_checkpoint, select, select_global, total_for_budget, Criterion, ExpertStats, PruneRecord, RECORD_FORMAT,
};
use k3_protocol::Checkpoint;
use sha2::{Digest, Sha256};

/// How the kept count is spread over the layers.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The same number of experts in every MoE layer.
    Uniform,
    /// One ranking over the experts of all MoE layers: each layer keeps at least top-k, the rest
    /// of the total (`--keep` × MoE layers, or what `--budget-gb` holds) goes to the best experts
    /// of any layer. Per-layer counts then differ (`text_config.num_experts_per_layer`).
    Global,
}

/// Arguments of `k3-prefill prune`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("size").required(true).args(["keep", "budget_gb"])))]
pub struct Args {
    /// Source checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Statistics from `k3-prefill calibrate` on this model.
    #[arg(long)]
    pub stats: PathBuf,
    /// Routed experts to keep per MoE layer (`--mode global`: on average, i.e. `keep` × MoE
    /// layers in all).
    #[arg(long)]
    pub keep: Option<usize>,
    /// Keep as many experts per layer as fit this checkpoint size, in GB (10^9 bytes).
    #[arg(long)]
    pub budget_gb: Option<f64>,
    /// How the kept experts are spread over the MoE layers.
    #[arg(long, value_enum, default_value_t = Mode::Uniform)]
    pub mode: Mode,
    /// Ranking: `reap` (saliency), `frequency`, or `random` (a baseline; see --seed).
    #[arg(long, default_value = "reap")]
    pub criterion: Criterion,
    /// Seed of `--criterion random`.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (must not exist).
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let r = run_args(&args)?;
    println!(
        "wrote {} ({} shards, {} tensors, {:.3} GB) in {:.2} s: read {:.3} GB at {:.2} GB/s",
        r.dir.display(),
        r.shards,
        r.tensors,
        r.bytes_written as f64 / 1e9,
        r.seconds,
        r.bytes_read as f64 / 1e9,
        r.bytes_read as f64 / 1e9 / r.seconds.max(1e-9)
    );
    Ok(())
}

/// The command; returns what was written.
pub fn run_args(args: &Args) -> anyhow::Result<k3_protocol::prune::PruneReport> {
    let ck = Checkpoint::open(&args.model).with_context(|| format!("opening model {}", args.model.display()))?;
    let cfg = ck.config();
    let stats = ExpertStats::load(&args.stats)?;
    stats.check_model(&cfg.text_config, &ck.fingerprint(), &args.stats)?;
    if stats.tokens == 0 && args.criterion != Criterion::Random {
        bail!("{}: no calibration tokens yet; run `k3-prefill calibrate` first", args.stats.display());
    }
    let moe_layers = cfg.text_config.layer_plan().iter().filter(|s| s.ffn == FfnKind::LatentMoe).count();
    let budget = match args.budget_gb {
        Some(gb) if !(gb.is_finite() && gb > 0.0) => bail!("--budget-gb {gb} must be a positive number"),
        Some(gb) => Some((gb * 1e9) as u64),
        None => None,
    };
    let kept = match (args.mode, args.keep, budget) {
        (Mode::Uniform, Some(k), _) => select(&stats, args.criterion, k, args.seed)?,
        (Mode::Uniform, None, Some(b)) => {
            let k = keep_for_budget(cfg, b)?;
            tracing::info!(budget_gb = b as f64 / 1e9, keep = k, "experts per layer that fit the budget");
            select(&stats, args.criterion, k, args.seed)?
        }
        (Mode::Global, Some(k), _) => {
            check_keep(k, cfg.text_config.num_experts, cfg.text_config.num_experts_per_token)?;
            select_global(&stats, args.criterion, k * moe_layers, args.seed)?
        }
        (Mode::Global, None, Some(b)) => {
            let total = total_for_budget(cfg, b)?;
            tracing::info!(budget_gb = b as f64 / 1e9, total, moe_layers, "experts over all MoE layers that fit the budget");
            select_global(&stats, args.criterion, total, args.seed)?
        }
        (_, None, None) => bail!("give --keep or --budget-gb"),
    };
    let keep = kept.iter().map(|(_, k)| k.len()).max().unwrap_or(0);
    if args.mode == Mode::Global {
        let counts: Vec<usize> = kept.iter().map(|(_, k)| k.len()).collect();
        tracing::info!(?counts, total = counts.iter().sum::<usize>(), "experts kept per MoE layer (global ranking)");
    }
    let stats_bytes = std::fs::read(&args.stats).with_context(|| format!("reading {}", args.stats.display()))?;
    let record = PruneRecord {
        format: RECORD_FORMAT.into(),
        source_fingerprint: ck.fingerprint().hex(),
        source_dir: args.model.display().to_string(),
        source_num_experts: cfg.text_config.num_experts,
        num_experts: keep,
        criterion: args.criterion,
        mode: match args.mode {
            Mode::Uniform => "uniform".into(),
            Mode::Global => "global".into(),
        },
        seed: args.seed,
        stats_sha256: hex::encode(Sha256::digest(&stats_bytes)),
        stats_prompts: stats.prompts_done,
        stats_tokens: stats.tokens,
        kept: kept.iter().cloned().collect(),
    };
    // The record names the source by its fingerprint: its bytes are checked against it first
    // (every tensor, SHA-256; a forged digest cache or an edited shard is refused here).
    ck.verify_all().context("checking the source weights against the model fingerprint")?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("prune {msg} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let r = prune_checkpoint(&ck, &kept, &record, &args.out, &bar)?;
    bar.finish_and_clear();
    tracing::info!(
        keep,
        of = cfg.text_config.num_experts,
        criterion = ?args.criterion,
        gb = format!("{:.3}", r.bytes_written as f64 / 1e9),
        "pruned checkpoint written"
    );
    Ok(r)
}
