//! `k3-prefill inspect`: validate a checkpoint (or read a config alone) and report its layer
//! plan, AttnRes bank boundaries, tensor count and bytes, fingerprint, the bytes of each
//! component, and the derived sizes of spec §1.2/§4 (routed parameters, bytes per expert,
//! hand-off state per token), all computed from the config.

use std::path::{Path, PathBuf};

use anyhow::Context;
use k3_protocol::config::{AttnKind, FfnKind};
use k3_protocol::fit::{fit_table, fit_table_hosts, FitTable};
use k3_protocol::tensors::{all_tensors, DerivedSizes, Init, TensorSpec};
use k3_protocol::{Checkpoint, K3Config, LayerSpec};
use serde::Serialize;

/// Arguments of `k3-prefill inspect`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "config"])))]
pub struct Args {
    /// Checkpoint directory (config.json, model.safetensors.index.json, shards): fully validated.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A config.json (or a directory holding one) alone: sizes from the config, no weights
    /// needed (e.g. the real K3 dimensions: `k3-prefill synth --preset k3 --config-only`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Memory held back on each Mac for macOS and the decoder's buffers in the fit table, GiB.
    #[arg(long, default_value_t = k3_protocol::fit::DEFAULT_RESERVE_GIB)]
    pub reserve_gib: f64,
    /// Also fit the model over this many Macs (decoder ranks, `k3-decode launch`): one table per
    /// host count, routed experts split by expert, e.g. `--hosts 2,4`.
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub hosts: Vec<u64>,
    /// The prefill node's GPU, GB (10^9 bytes): print the longest prompt it can prefill
    /// (`longest prompt: N tokens`, BF16, weights streamed from disk, the default budget of a
    /// card this size: its memory less the CUDA context (0.5 GB) and the plan's margin).
    #[arg(long)]
    pub gpu_memory: Option<f64>,
    /// The prefill node's host memory, GB (with `--gpu-memory`; default 64).
    #[arg(long)]
    pub host_memory: Option<f64>,
}

/// The longest prompt a prefill node of given memory can take ([`crate::memory_plan`]).
#[derive(Debug, Clone, Serialize)]
pub struct PrefillFit {
    pub gpu_memory_gb: f64,
    pub host_memory_gb: f64,
    pub longest_prompt: usize,
    /// The plan at that length (one line).
    pub plan: String,
}

/// The CUDA context of a process on a GPU, bytes (measured ~0.5 GB on the H200).
const CUDA_CONTEXT: u64 = 500_000_000;

/// [`PrefillFit`] for `cfg` on a GPU of `gpu_gb` with `host_gb` of host memory.
pub fn prefill_fit(cfg: &K3Config, gpu_gb: f64, host_gb: f64) -> anyhow::Result<PrefillFit> {
    use crate::memory_plan::*;
    anyhow::ensure!(gpu_gb > 0.0 && host_gb > 0.0, "--gpu-memory and --host-memory must be positive");
    let c = &cfg.text_config;
    let g = Geometry::of(c, &c.layer_plan())?;
    let total = (gpu_gb * 1e9) as u64;
    let be = BackendShape::cuda(true, total, crate::cuda::moe_dense::DENSE_MIN_ROWS);
    let lim = Limits { device: total.saturating_sub(CUDA_CONTEXT + DEFAULT_MARGIN), host: ((host_gb * 1e9) as u64).saturating_sub(HOST_MARGIN) };
    let k = Knobs::default();
    let n = longest_prompt(&g, &be, lim, &k);
    let plan = if n > 0 { plan(&g, &be, &[PlanRequest { base: 0, new: n }], lim, &k).map(|p| p.line()).unwrap_or_default() } else { String::new() };
    Ok(PrefillFit { gpu_memory_gb: gpu_gb, host_memory_gb: host_gb, longest_prompt: n, plan })
}

/// Bytes and parameters of one component of the model.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Component {
    pub name: &'static str,
    pub tensors: usize,
    /// Logical parameters (an MXFP4 weight counts its unpacked values; scales count none).
    pub params: u128,
    pub bytes: u64,
}

/// Hand-off state sizes (spec §4): per token for MLA, fixed for KDA.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct HandoffSizes {
    pub mla_bytes_per_token_bf16: u64,
    pub kda_state_bytes_fp32: u64,
    pub conv_window_bytes_bf16: u64,
    pub bytes_at_128k_tokens: u64,
    pub bytes_at_1m_tokens: u64,
}

/// Everything `inspect` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// "checkpoint" (validated weights) or "config" (config alone).
    pub source: &'static str,
    pub path: String,
    pub fingerprint: Option<String>,
    pub shards: Option<usize>,
    pub tensors: usize,
    pub tensor_bytes: u64,
    pub warnings: Vec<String>,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub kda_layers: Vec<usize>,
    pub mla_layers: Vec<usize>,
    pub dense_layers: Vec<usize>,
    pub bank_boundaries: Vec<usize>,
    pub layer_plan: Vec<LayerSpec>,
    pub components: Vec<Component>,
    pub derived: DerivedSizes,
    pub handoff: HandoffSizes,
    pub special_token_ids: SpecialIds,
    /// Which expert counts fit which Mac Studio at which context length.
    pub fit: FitTable,
    /// The same over several Macs (`--hosts`), one table per host count.
    pub fit_hosts: Vec<FitTable>,
    /// `--gpu-memory`: the longest prompt the prefill node can take.
    pub prefill_fit: Option<PrefillFit>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpecialIds {
    pub bos: u32,
    pub eos: u32,
    pub pad: u32,
    pub media_placeholder: u32,
}

const COMPONENTS: [&str; 12] = [
    "embedding",
    "lm_head",
    "final norm + output AttnRes mix",
    "layer norms + AttnRes",
    "KDA attention",
    "MLA attention",
    "dense FFN",
    "MoE router",
    "MoE latent projections",
    "shared experts",
    "routed experts (MXFP4)",
    "vision tower + projector",
];

/// The component a tensor belongs to.
fn component_of(s: &TensorSpec, plan: &[LayerSpec]) -> &'static str {
    let n = s.name.as_str();
    if n.starts_with("vision_tower.") || n.starts_with("mm_projector.") {
        return COMPONENTS[11];
    }
    if n.ends_with("embed_tokens.weight") {
        return COMPONENTS[0];
    }
    if n.ends_with("lm_head.weight") {
        return COMPONENTS[1];
    }
    let Some(rest) = n.strip_prefix("language_model.model.layers.") else {
        return COMPONENTS[2];
    };
    let (idx, suffix) = rest.split_once('.').unwrap_or((rest, ""));
    let attn = idx.parse::<usize>().ok().and_then(|l| plan.get(l)).map(|p| p.attn);
    if matches!(s.init, Init::Mxfp4Packed | Init::Mxfp4Scale) {
        COMPONENTS[10]
    } else if suffix.starts_with("self_attn.") {
        if attn == Some(AttnKind::Mla) {
            COMPONENTS[5]
        } else {
            COMPONENTS[4]
        }
    } else if suffix.starts_with("mlp.") {
        COMPONENTS[6]
    } else if suffix.starts_with("block_sparse_moe.gate.") {
        COMPONENTS[7]
    } else if suffix.starts_with("block_sparse_moe.shared_experts.") {
        COMPONENTS[9]
    } else if suffix.starts_with("block_sparse_moe.") {
        COMPONENTS[8]
    } else {
        COMPONENTS[3]
    }
}

fn components(cfg: &K3Config, specs: &[TensorSpec]) -> Vec<Component> {
    let plan = cfg.text_config.layer_plan();
    let mut out: Vec<Component> = COMPONENTS.iter().map(|&name| Component { name, tensors: 0, params: 0, bytes: 0 }).collect();
    for s in specs {
        let k = COMPONENTS.iter().position(|&c| c == component_of(s, &plan)).expect("a listed component");
        out[k].tensors += 1;
        out[k].bytes += s.nbytes() as u64;
        out[k].params += match s.init {
            Init::Mxfp4Packed => s.numel() as u128 * 2,
            Init::Mxfp4Scale => 0,
            _ => s.numel() as u128,
        };
    }
    out.retain(|c| c.tensors > 0);
    out
}

/// The report of a config (and optionally the checkpoint it came with).
pub fn report(cfg: &K3Config, path: &Path, ck: Option<(&Checkpoint, Vec<String>)>, reserve_gib: f64, hosts: &[u64]) -> Report {
    let c = &cfg.text_config;
    let plan = c.layer_plan();
    let specs = all_tensors(cfg);
    let derived = DerivedSizes::of(cfg);
    let fixed = derived.kda_state_bytes_fp32 + derived.conv_window_bytes_bf16;
    let handoff = HandoffSizes {
        mla_bytes_per_token_bf16: derived.mla_state_bytes_per_token_bf16,
        kda_state_bytes_fp32: derived.kda_state_bytes_fp32,
        conv_window_bytes_bf16: derived.conv_window_bytes_bf16,
        bytes_at_128k_tokens: fixed + 131_072 * derived.mla_state_bytes_per_token_bf16,
        bytes_at_1m_tokens: fixed + 1_048_576 * derived.mla_state_bytes_per_token_bf16,
    };
    let (source, fingerprint, shards, tensors, tensor_bytes, warnings) = match ck {
        Some((ck, warnings)) => {
            let shards = ck.tensor_names().filter_map(|n| ck.entry(n)).map(|e| e.shard + 1).max().unwrap_or(0);
            ("checkpoint", Some(ck.fingerprint().hex()), Some(shards), ck.tensor_names().count(), ck.total_bytes(), warnings)
        }
        None => ("config", None, None, specs.len(), derived.checkpoint_bytes, Vec::new()),
    };
    Report {
        source,
        path: path.display().to_string(),
        fingerprint,
        shards,
        tensors,
        tensor_bytes,
        warnings,
        hidden_size: c.hidden_size,
        num_layers: c.num_hidden_layers,
        vocab_size: c.vocab_size,
        num_experts: c.num_experts,
        experts_per_token: c.num_experts_per_token,
        kda_layers: c.kda_layers(),
        mla_layers: c.mla_layers(),
        dense_layers: plan.iter().filter(|s| s.ffn == FfnKind::Dense).map(|s| s.index).collect(),
        bank_boundaries: plan.iter().filter(|s| s.bank_boundary).map(|s| s.index).collect(),
        layer_plan: plan,
        components: components(cfg, &specs),
        derived,
        handoff,
        special_token_ids: SpecialIds {
            bos: cfg.bos_token_id,
            eos: cfg.eos_token_id,
            pad: cfg.pad_token_id,
            media_placeholder: cfg.media_placeholder_token_id,
        },
        fit: fit_table(cfg, reserve_gib),
        fit_hosts: hosts.iter().map(|&h| fit_table_hosts(cfg, reserve_gib, h as usize)).collect(),
        prefill_fit: None,
    }
}

/// `1234567` → `1,234,567`.
pub fn grouped(n: u128) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Parameter counts with an SI suffix: `2.72 T`, `56.74 B`, `3.0 M`.
pub fn params_si(n: u128) -> String {
    let x = n as f64;
    for (div, unit) in [(1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")] {
        if x >= div {
            return format!("{:.2} {unit}", x / div);
        }
    }
    n.to_string()
}

/// Bytes with a binary suffix.
pub fn bytes_iec(n: u64) -> String {
    let x = n as f64;
    for (div, unit) in [(1u64 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")] {
        if x >= div as f64 {
            return format!("{:.2} {unit}", x / div as f64);
        }
    }
    format!("{n} B")
}

/// The human-readable report.
pub fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let d = &r.derived;
    let _ = writeln!(s, "{} {}", if r.source == "checkpoint" { "checkpoint" } else { "config (no weights)" }, r.path);
    if let Some(f) = &r.fingerprint {
        let _ = writeln!(s, "fingerprint       {f}");
    }
    let shards = r.shards.map(|n| format!(" in {n} shard(s)")).unwrap_or_default();
    let _ = writeln!(s, "tensors           {}{shards}, {} bytes ({})", grouped(r.tensors as u128), grouped(r.tensor_bytes as u128), bytes_iec(r.tensor_bytes));
    for w in &r.warnings {
        let _ = writeln!(s, "warning           {w}");
    }
    let _ = writeln!(
        s,
        "model             hidden {}, {} layers ({} KDA, {} MLA), vocab {}, {} experts top-{}",
        r.hidden_size,
        r.num_layers,
        r.kda_layers.len(),
        r.mla_layers.len(),
        r.vocab_size,
        r.num_experts,
        r.experts_per_token
    );
    let ids = &r.special_token_ids;
    let _ = writeln!(s, "special ids       bos {}, eos {}, pad {}, media_placeholder {}", ids.bos, ids.eos, ids.pad, ids.media_placeholder);
    let _ = writeln!(s, "KDA layers        {:?}", r.kda_layers);
    let _ = writeln!(s, "MLA layers        {:?}", r.mla_layers);
    let _ = writeln!(s, "dense FFN layers  {:?}", r.dense_layers);
    let _ = writeln!(s, "bank boundaries   {:?} (the running sum is banked before these layers)", r.bank_boundaries);
    let _ = writeln!(s, "\nlayer plan (0-based; * = bank boundary)");
    for l in &r.layer_plan {
        let attn = match l.attn {
            AttnKind::Kda => "KDA",
            AttnKind::Mla => "MLA",
        };
        let ffn = match l.ffn {
            FfnKind::Dense => "dense FFN",
            FfnKind::LatentMoe => "latent MoE",
        };
        let _ = writeln!(s, "  {:>3}{} {attn} + {ffn}", l.index, if l.bank_boundary { "*" } else { " " });
    }
    let _ = writeln!(s, "\ncomponents");
    for c in &r.components {
        let _ = writeln!(s, "  {:<32} {:>9} tensors  {:>12} params  {:>12}", c.name, grouped(c.tensors as u128), params_si(c.params), bytes_iec(c.bytes));
    }
    let _ = writeln!(s, "\nderived sizes (from the config)");
    let _ = writeln!(s, "  routed expert params      {} ({})", params_si(d.routed_expert_params), grouped(d.routed_expert_params));
    let _ = writeln!(s, "  other text params         {} ({})", params_si(d.other_text_params), grouped(d.other_text_params));
    let _ = writeln!(s, "  vision params             {} ({})", params_si(d.vision_params), grouped(d.vision_params));
    let _ = writeln!(s, "  total params              {} ({})", params_si(d.total_params), grouped(d.total_params));
    let _ = writeln!(s, "  active params / token     {} ({})", params_si(d.active_params_per_token), grouped(d.active_params_per_token));
    let _ = writeln!(s, "  bytes per expert          {} ({})", grouped(d.bytes_per_expert as u128), bytes_iec(d.bytes_per_expert));
    let _ = writeln!(s, "  expert bytes / MoE layer  {} ({})", grouped(d.expert_bytes_per_moe_layer as u128), bytes_iec(d.expert_bytes_per_moe_layer));
    let _ = writeln!(s, "  checkpoint bytes          {} ({})", grouped(d.checkpoint_bytes as u128), bytes_iec(d.checkpoint_bytes));
    let h = &r.handoff;
    let _ = writeln!(s, "\nhand-off state (spec §4)");
    let _ = writeln!(s, "  MLA latent, BF16          {} B / token", grouped(h.mla_bytes_per_token_bf16 as u128));
    let _ = writeln!(s, "  KDA recurrent, FP32       {} B ({})", grouped(h.kda_state_bytes_fp32 as u128), bytes_iec(h.kda_state_bytes_fp32));
    let _ = writeln!(s, "  KDA conv windows, BF16    {} B ({})", grouped(h.conv_window_bytes_bf16 as u128), bytes_iec(h.conv_window_bytes_bf16));
    let _ = writeln!(s, "  total at 131,072 tokens   {} B ({})", grouped(h.bytes_at_128k_tokens as u128), bytes_iec(h.bytes_at_128k_tokens));
    let _ = writeln!(s, "  total at 1,048,576 tokens {} B ({})", grouped(h.bytes_at_1m_tokens as u128), bytes_iec(h.bytes_at_1m_tokens));
    let _ = writeln!(s);
    s.push_str(&r.fit.render());
    for t in &r.fit_hosts {
        let _ = writeln!(s);
        s.push_str(&t.render());
    }
    s
}

/// Loads a config from a `config.json` path or a directory holding one.
fn load_config(path: &Path) -> anyhow::Result<K3Config> {
    if path.is_dir() {
        return Ok(K3Config::load(path)?);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    K3Config::from_json(&text).with_context(|| format!("config {}", path.display()))
}

/// Builds the report for the given arguments.
pub fn build(args: &Args) -> anyhow::Result<Report> {
    if let Some(dir) = &args.model {
        let ck = Checkpoint::open(dir).with_context(|| format!("checkpoint {}", dir.display()))?;
        let warnings = ck.validate()?;
        Ok(report(ck.config(), dir, Some((&ck, warnings)), args.reserve_gib, &args.hosts))
    } else {
        let path = args.config.as_ref().context("--model or --config is required")?;
        Ok(report(&load_config(path)?, path, None, args.reserve_gib, &args.hosts))
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut r = build(&args)?;
    if let Some(g) = args.gpu_memory {
        let cfg = match &args.model {
            Some(dir) => K3Config::load(dir).with_context(|| format!("config of {}", dir.display()))?,
            None => load_config(args.config.as_ref().context("--model or --config is required")?)?,
        };
        r.prefill_fit = Some(prefill_fit(&cfg, g, args.host_memory.unwrap_or(64.0))?);
    } else if args.host_memory.is_some() {
        anyhow::bail!("--host-memory goes with --gpu-memory");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", render(&r));
        if let Some(f) = &r.prefill_fit {
            println!("\nprefill node: {} GB GPU, {} GB host memory (BF16, weights streamed)", f.gpu_memory_gb, f.host_memory_gb);
            println!("longest prompt: {} tokens", f.longest_prompt);
            if !f.plan.is_empty() {
                println!("  at it: {}", f.plan);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_protocol::synth::{write_model, Preset, SynthOptions};
    use k3_protocol::testdata::golden_dir;

    fn args(model: Option<&Path>, config: Option<&Path>) -> Args {
        Args {
            model: model.map(Path::to_path_buf),
            config: config.map(Path::to_path_buf),
            json: true,
            reserve_gib: k3_protocol::fit::DEFAULT_RESERVE_GIB,
            hosts: Vec::new(),
            gpu_memory: None,
            host_memory: None,
        }
    }

    /// Issue 21: the fingerprint covered the config and the tensor index only, so checkpoints
    /// of one architecture and different weights printed the same line.
    #[test]
    fn the_fingerprint_line_tells_weights_apart() {
        let line = |seed: u64| {
            let dir = tempfile::tempdir().unwrap();
            let mut o = k3_protocol::synth::SynthOptions::new(k3_protocol::synth::Preset::Tiny);
            o.seed = seed;
            o.tokenizer = false;
            k3_protocol::synth::write_model(dir.path(), &o).unwrap();
            let text = render(&build(&args(Some(dir.path()), None)).unwrap());
            text.lines().find(|l| l.starts_with("fingerprint")).unwrap().to_string()
        };
        let (a, b) = (line(1), line(2));
        assert_ne!(a, b, "seeds 1 and 2 (equal configs, different weights) print the same fingerprint");
        assert_eq!(a, line(1), "the fingerprint is a function of the bytes");
    }

    #[test]
    fn golden_tiny_a_report() {
        let r = build(&args(Some(&golden_dir("tiny-a")), None)).unwrap();
        assert_eq!(r.source, "checkpoint");
        assert_eq!(r.kda_layers, vec![0, 1, 2, 4, 5, 6]);
        assert_eq!(r.mla_layers, vec![3, 7, 8]);
        assert_eq!(r.bank_boundaries, vec![0, 3, 6]);
        assert_eq!(r.dense_layers, vec![0]);
        assert_eq!(r.shards, Some(2));
        assert_eq!(r.tensor_bytes, 4_092_992);
        assert_eq!(r.components.iter().map(|c| c.bytes).sum::<u64>(), 4_092_992, "components partition the bytes");
        assert_eq!(r.components.iter().map(|c| c.tensors).sum::<usize>(), r.tensors);
        let experts = r.components.iter().find(|c| c.name == "routed experts (MXFP4)").unwrap();
        assert_eq!(experts.tensors, 8 * 16 * 6);
        assert_eq!(experts.params, r.derived.routed_expert_params);
        // 3 MLA layers × (64 + 16) values × 2 bytes.
        assert_eq!(r.handoff.mla_bytes_per_token_bf16, 480);
        assert_eq!(r.fingerprint.as_deref().map(str::len), Some(64));
        let v: serde_json::Value = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(v["derived"]["bytes_per_expert"], 3 * (64 * 32 + 64 * 2) as u64);
        let text = render(&r);
        assert!(text.contains("bank boundaries   [0, 3, 6]"), "{text}");
    }

    #[test]
    fn k3_config_alone_reports_the_real_sizes() {
        let d = tempfile::tempdir().unwrap();
        let mut o = SynthOptions::new(Preset::K3);
        o.weights = false;
        write_model(d.path(), &o).unwrap();
        for p in [d.path().to_path_buf(), d.path().join("config.json")] {
            let r = build(&args(None, Some(&p))).unwrap();
            assert_eq!(r.source, "config");
            assert_eq!(params_si(r.derived.routed_expert_params), "2.72 T");
            assert_eq!(r.derived.bytes_per_expert, 17_547_264);
            assert_eq!(r.handoff.mla_bytes_per_token_bf16, 27_648);
            assert_eq!(r.tensors, 497_220);
            assert_eq!(r.tensor_bytes, 1_560_860_324_864);
            // Spec §4: 4,073,250,816 B at 128k tokens (BF16 latent, FP32 S, BF16 conv).
            assert_eq!(r.handoff.bytes_at_128k_tokens, 4_073_250_816);
            assert_eq!(r.handoff.bytes_at_1m_tokens, 29_440_401_408);
            assert_eq!(r.mla_layers.len(), 24);
            assert_eq!(r.bank_boundaries, (0..93).step_by(12).collect::<Vec<_>>());
            let text = render(&r);
            assert!(text.contains("routed expert params      2.72 T"), "{text}");
            assert!(text.contains("bytes per expert          17,547,264"), "{text}");
            assert!(text.contains("MLA latent, BF16          27,648 B / token"), "{text}");
        }
    }

    #[test]
    fn inspect_prints_host_tables() {
        let d = tempfile::tempdir().unwrap();
        let mut o = SynthOptions::new(Preset::K3);
        o.weights = false;
        write_model(d.path(), &o).unwrap();
        let mut a = args(None, Some(d.path()));
        a.hosts = vec![2, 4];
        let r = build(&a).unwrap();
        assert_eq!(r.fit_hosts.iter().map(|t| t.hosts).collect::<Vec<_>>(), vec![2, 4]);
        assert_eq!(r.fit.hosts, 1);
        let four = &r.fit_hosts[1];
        assert_eq!(four.full_split.iter().map(|s| s.experts.len()).collect::<Vec<_>>(), vec![224; 4]);
        // four 512 GB Macs hold the whole model at every context; two never do
        assert!(four.cells.iter().filter(|c| c.memory_gb == 512).all(|c| c.max_experts == Some(896)));
        assert!(r.fit_hosts[0].cells.iter().all(|c| c.max_experts < Some(896)));
        let text = render(&r);
        assert!(text.contains("fit on 2 Mac Studios") && text.contains("fit on 4 Mac Studios"), "{text}");
        assert!(text.contains("224 + 224 + 224 + 224 per rank and layer"), "{text}");
        let v: serde_json::Value = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(v["fit_hosts"][1]["full_split"][3]["experts"]["end"], 896);
    }

    #[test]
    fn real_widths_model_reports_k3_per_expert_and_per_layer_sizes() {
        let d = tempfile::tempdir().unwrap();
        let mut o = SynthOptions::new(Preset::K3);
        o.overrides.layers = Some(4);
        o.overrides.full_attn_layers = Some(vec![2, 4]);
        o.overrides.experts = Some(1);
        o.overrides.experts_per_token = Some(1);
        o.overrides.hidden = Some(128);
        o.overrides.heads = Some(1);
        o.overrides.intermediate = Some(128);
        o.overrides.vocab = Some(512);
        o.overrides.vision_layers = Some(0);
        o.overrides.vision_hidden = Some(32);
        o.overrides.vision_heads = Some(1);
        o.overrides.vision_qkv = Some(32);
        o.overrides.vision_intermediate = Some(32);
        o.overrides.vision_pos = Some(2);
        write_model(d.path(), &o).unwrap();
        let r = build(&args(Some(d.path()), None)).unwrap();
        assert_eq!(r.derived.bytes_per_expert, 17_547_264);
        assert_eq!(r.mla_layers, vec![1, 3]);
        assert_eq!(r.handoff.mla_bytes_per_token_bf16, 2 * 1_152);
        assert_eq!(r.derived.routed_expert_params, 3 * 3 * 3072 * 3584);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let d = tempfile::tempdir().unwrap();
        assert!(build(&args(Some(d.path()), None)).is_err());
        assert!(build(&args(None, Some(&d.path().join("nope.json")))).is_err());
        std::fs::write(d.path().join("config.json"), "{").unwrap();
        let e = format!("{:#}", build(&args(None, Some(d.path()))).unwrap_err());
        assert!(e.contains("malformed config"), "{e}");
    }

    #[test]
    fn number_formats() {
        assert_eq!(grouped(17_547_264), "17,547,264");
        assert_eq!(grouped(999), "999");
        assert_eq!(params_si(2_722_675_752_960), "2.72 T");
        assert_eq!(bytes_iec(1536), "1.50 KiB");
    }
}
