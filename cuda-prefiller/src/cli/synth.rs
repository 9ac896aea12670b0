//! `k3-prefill synth`: write a random K3 model in the exact release layout (spec §6 presets,
//! overrides, MXFP4 experts, sharded safetensors, tokenizer files). See `k3_protocol::synth`.

use std::path::PathBuf;

use anyhow::Context;
use k3_protocol::synth::{self, Overrides, Preset, SynthOptions};
use k3_protocol::tensors::{all_tensors, DerivedSizes};
use k3_protocol::Checkpoint;

/// Arguments of `k3-prefill synth`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// tiny | small | medium (spec §6) | k3 (the real dimensions; combine with overrides,
    /// --config-only or --plan-only: the full model is 1.56 TB).
    #[arg(long, default_value = "tiny")]
    pub preset: Preset,
    /// Seed of the random weights (same seed → byte-identical files).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (created if missing).
    #[arg(long, required_unless_present = "plan_only")]
    pub out: Option<PathBuf>,
    /// Shard size limit, e.g. 5GB, 512MiB, 1000000 (bytes).
    #[arg(long, default_value = "5GB", value_parser = parse_size)]
    pub max_shard_size: u64,
    /// Write config.json and the tokenizer only (no weights).
    #[arg(long)]
    pub config_only: bool,
    /// Print the config summary and shard plan; write nothing.
    #[arg(long)]
    pub plan_only: bool,
    /// Do not write tiktoken.model / tokenizer_config.json.
    #[arg(long)]
    pub no_tokenizer: bool,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Number of decoder layers (MLA: every 4th layer, 1-based, plus the last).
    #[arg(long)]
    pub layers: Option<usize>,
    /// 1-based MLA layers, comma-separated (all others are KDA).
    #[arg(long, value_delimiter = ',')]
    pub full_attn_layers: Option<Vec<usize>>,
    /// Model (residual stream) width, hidden_size.
    #[arg(long)]
    pub hidden: Option<usize>,
    /// KDA and MLA head count.
    #[arg(long)]
    pub heads: Option<usize>,
    /// KDA head count (overrides --heads for the KDA layers).
    #[arg(long)]
    pub kda_heads: Option<usize>,
    /// KDA head width (key and value).
    #[arg(long)]
    pub kda_head_dim: Option<usize>,
    /// MLA head count (overrides --heads for the MLA layers).
    #[arg(long)]
    pub mla_heads: Option<usize>,
    /// MLA query low-rank width, q_lora_rank.
    #[arg(long)]
    pub q_lora_rank: Option<usize>,
    /// MLA key/value latent width, kv_lora_rank (the latent rows the hand-off ships).
    #[arg(long)]
    pub kv_lora_rank: Option<usize>,
    /// MLA query/key width per head without position, qk_nope_head_dim.
    #[arg(long)]
    pub qk_nope_head_dim: Option<usize>,
    /// MLA query/key width per head with rotary position, qk_rope_head_dim.
    #[arg(long)]
    pub qk_rope_head_dim: Option<usize>,
    /// MLA value width per head, v_head_dim.
    #[arg(long)]
    pub v_head_dim: Option<usize>,
    /// KDA short-conv kernel size.
    #[arg(long)]
    pub conv_kernel: Option<usize>,
    /// Dense FFN width.
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// Number of leading dense-FFN layers.
    #[arg(long)]
    pub first_k_dense: Option<usize>,
    /// Routed experts per MoE layer, n_routed_experts.
    #[arg(long)]
    pub experts: Option<usize>,
    /// Routed experts each token uses, num_experts_per_tok (top-k).
    #[arg(long)]
    pub experts_per_token: Option<usize>,
    /// Shared experts per MoE layer (every token uses them).
    #[arg(long)]
    pub shared_experts: Option<usize>,
    /// Routed expert intermediate width (multiple of 32).
    #[arg(long)]
    pub moe_intermediate: Option<usize>,
    /// Routed expert latent width, routed_expert_hidden_size (multiple of 32).
    #[arg(long)]
    pub latent: Option<usize>,
    /// AttnRes block size in layers.
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Vocabulary size (specials at the top: 256 slots from 2048 up, else 24).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// MoonViT-V2 vision tower: number of blocks.
    #[arg(long)]
    pub vision_layers: Option<usize>,
    /// Vision tower width.
    #[arg(long)]
    pub vision_hidden: Option<usize>,
    /// Vision tower attention heads.
    #[arg(long)]
    pub vision_heads: Option<usize>,
    /// Vision tower query/key/value width.
    #[arg(long)]
    pub vision_qkv: Option<usize>,
    /// Vision tower MLP width.
    #[arg(long)]
    pub vision_intermediate: Option<usize>,
    /// Side of the learned vision position table.
    #[arg(long)]
    pub vision_pos: Option<usize>,
}

/// A byte size argument that does not parse (the text as given).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("bad size {0:?}")]
    Number(String),
    #[error("unknown size unit {unit:?} in {text:?}")]
    Unit { unit: String, text: String },
    #[error("size {0:?} out of range")]
    Range(String),
}

/// Parses `123`, `5GB`, `1.5GiB`, `512MiB`, `64KB` into bytes.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| SizeError::Number(s.to_string()))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" | "k" => 1e3,
        "mb" | "m" => 1e6,
        "gb" | "g" => 1e9,
        "tb" | "t" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        u => return Err(SizeError::Unit { unit: u.to_string(), text: s.to_string() }),
    };
    let v = n * mult;
    if !(1.0..1.8e19).contains(&v) {
        return Err(SizeError::Range(s.to_string()));
    }
    Ok(v as u64)
}

impl Args {
    pub fn options(&self) -> SynthOptions {
        let mut o = SynthOptions::new(self.preset);
        o.seed = self.seed;
        o.max_shard_bytes = self.max_shard_size;
        o.progress = !self.no_progress;
        o.tokenizer = !self.no_tokenizer;
        o.weights = !self.config_only;
        o.overrides = Overrides {
            layers: self.layers,
            full_attn_layers: self.full_attn_layers.clone(),
            hidden: self.hidden,
            heads: self.heads,
            kda_heads: self.kda_heads,
            kda_head_dim: self.kda_head_dim,
            mla_heads: self.mla_heads,
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: self.kv_lora_rank,
            qk_nope_head_dim: self.qk_nope_head_dim,
            qk_rope_head_dim: self.qk_rope_head_dim,
            v_head_dim: self.v_head_dim,
            conv_kernel: self.conv_kernel,
            intermediate: self.intermediate,
            first_k_dense: self.first_k_dense,
            experts: self.experts,
            experts_per_token: self.experts_per_token,
            shared_experts: self.shared_experts,
            moe_intermediate: self.moe_intermediate,
            latent: self.latent,
            block_size: self.block_size,
            vocab: self.vocab,
            vision_layers: self.vision_layers,
            vision_hidden: self.vision_hidden,
            vision_heads: self.vision_heads,
            vision_qkv: self.vision_qkv,
            vision_intermediate: self.vision_intermediate,
            vision_pos: self.vision_pos,
        };
        o
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let opts = args.options();
    let cfg = opts.config().context("building the synthetic config")?;
    if args.plan_only {
        let specs = all_tensors(&cfg);
        let plans = synth::plan_shards(&specs, opts.max_shard_bytes);
        let d = DerivedSizes::of(&cfg);
        let c = &cfg.text_config;
        println!("preset {} (seed {}): nothing written (--plan-only)", opts.preset, opts.seed);
        println!(
            "layers {} (KDA {:?}, MLA {:?}, 0-based), hidden {}, experts {} (top {}), vocab {}",
            c.num_hidden_layers,
            c.kda_layers(),
            c.mla_layers(),
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_token,
            c.vocab_size
        );
        println!("tensors {}, shards {}, bytes {}", specs.len(), plans.len(), d.checkpoint_bytes);
        for p in &plans {
            println!("  {}  {} tensors  {} data bytes", p.file, p.end - p.first, p.data_bytes);
        }
        return Ok(());
    }
    let out = args.out.as_deref().context("--out is required")?;
    let rep = synth::write_checkpoint(out, &cfg, &opts.write_options()).with_context(|| format!("writing the synthetic model to {}", out.display()))?;
    if opts.weights {
        let ck = Checkpoint::open(out).context("re-opening the written checkpoint")?;
        let mbps = rep.bytes as f64 / 1e6 / rep.seconds.max(1e-9);
        tracing::info!(
            dir = %out.display(),
            shards = rep.shards.len(),
            tensors = rep.tensors,
            bytes = rep.bytes,
            seconds = format!("{:.2}", rep.seconds),
            mb_per_s = format!("{mbps:.1}"),
            "synthetic model written"
        );
        println!(
            "wrote {} ({} preset, seed {}): {} tensors, {} shard(s), {} bytes in {:.2} s ({:.1} MB/s), fingerprint {}",
            out.display(),
            opts.preset,
            opts.seed,
            rep.tensors,
            rep.shards.len(),
            rep.bytes,
            rep.seconds,
            mbps,
            ck.fingerprint()
        );
    } else {
        println!(
            "wrote {} ({} preset): config.json{} only; inspect it with `k3-prefill inspect --config {}`",
            out.display(),
            opts.preset,
            if opts.tokenizer { " and the tokenizer" } else { "" },
            out.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::parse_args;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("5XB").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn flags_reach_the_options() {
        let args = parse_args::<Args>(&[
            "synth",
            "--preset",
            "small",
            "--seed",
            "9",
            "--out",
            "/tmp/x",
            "--layers",
            "6",
            "--experts",
            "4",
            "--hidden",
            "256",
            "--vocab",
            "4096",
            "--full-attn-layers",
            "3,6",
            "--max-shard-size",
            "64MiB",
        ])
        .unwrap();
        let o = args.options();
        assert_eq!((o.preset, o.seed, o.max_shard_bytes), (Preset::Small, 9, 64 << 20));
        let cfg = o.config().unwrap();
        assert_eq!(cfg.text_config.num_hidden_layers, 6);
        assert_eq!(cfg.text_config.linear_attn_config.full_attn_layers, vec![3, 6]);
        assert_eq!(cfg.text_config.linear_attn_config.kda_layers, vec![1, 2, 4, 5]);
        assert_eq!((cfg.text_config.num_experts, cfg.text_config.hidden_size, cfg.text_config.vocab_size), (4, 256, 4096));
        assert!(parse_args::<Args>(&["synth", "--preset", "huge", "--out", "x"]).is_err());
        assert!(parse_args::<Args>(&["synth"]).is_err(), "--out is required unless --plan-only");
        assert!(parse_args::<Args>(&["synth", "--plan-only", "--preset", "k3"]).is_ok());
    }

    #[test]
    fn writes_a_loadable_tiny_model() {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("m");
        let args = parse_args::<Args>(&["synth", "--out", out.to_str().unwrap(), "--no-progress", "--layers", "5"]).unwrap();
        run(args).unwrap();
        let ck = Checkpoint::open(&out).unwrap();
        assert_eq!(ck.config().text_config.num_hidden_layers, 5);
        assert!(out.join("tiktoken.model").exists() && out.join("tokenizer_config.json").exists());
        let cfg_only = d.path().join("c");
        let args = parse_args::<Args>(&["synth", "--preset", "k3", "--config-only", "--out", cfg_only.to_str().unwrap()]).unwrap();
        run(args).unwrap();
        assert!(cfg_only.join("config.json").exists());
        assert!(!cfg_only.join("model.safetensors.index.json").exists());
    }
}
