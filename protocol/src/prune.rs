//! Routed-expert pruning (docs/pruning.md): the calibration statistics a prefill node collects
//! ([`ExpertStats`], a documented JSON file carrying the model fingerprint), the choice of the
//! experts to keep per MoE layer ([`select`]), and the streaming rewrite of a checkpoint into a
//! pruned one in the release layout ([`prune_checkpoint`]).
//!
//! A pruned checkpoint keeps, in every latent-MoE layer, the same number `N` of routed experts
//! (`text_config.num_experts = N`), renumbered densely in ascending order of their source ids;
//! the router's `gate.weight` rows and `gate.e_score_correction_bias` entries are sliced to the
//! kept experts; every other tensor and every kept expert's MXFP4 bytes are copied bit-exactly.
//! Because the router scores are per-expert sigmoids (no softmax over experts), the pruned model
//! computes exactly what the source model computes when the dropped experts are excluded from
//! the top-k selection.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::checkpoint::writer::{shard_file_name, write_index, ShardWriter, INDEX_FILE};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::{FfnKind, TextConfig};
use crate::synth::rng::Rng;
use crate::tensors::{layer_tensor, Init, TensorSpec};

/// The `format` string of a statistics file.
pub const STATS_FORMAT: &str = "k3-offload expert stats v1";
/// The file a pruned checkpoint records its provenance in.
pub const RECORD_FILE: &str = "pruning.json";
/// The `format` string of [`PruneRecord`].
pub const RECORD_FORMAT: &str = "k3-offload pruning record v1";

#[derive(Debug, thiserror::Error)]
pub enum PruneError {
    #[error("cannot access {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("statistics {path}: {msg}")]
    Stats { path: String, msg: String },
    #[error("{0}")]
    Invalid(String),
    #[error("unknown criterion {0:?} (expected reap, frequency or random)")]
    UnknownCriterion(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PruneError + '_ {
    move |source| PruneError::Io { path: path.display().to_string(), source }
}

// ---- statistics --------------------------------------------------------------------------

/// Per-expert sums of one latent-MoE layer. Means are derived: REAP saliency
/// `saliency_sum[e] / count[e]`, routing frequency `count[e] / tokens`, mean gate weight
/// `gate_sum[e] / count[e]` (0 for an expert no token chose).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerStats {
    /// 0-based decoder layer index.
    pub layer: usize,
    /// Tokens that passed this layer.
    pub tokens: u64,
    /// Per expert: tokens that selected it (top-k).
    pub count: Vec<u64>,
    /// Per expert: sum over those tokens of the gate weight (the mixing weight the model
    /// applies: renormalised sigmoid score × `routed_scaling_factor`).
    pub gate_sum: Vec<f64>,
    /// Per expert: sum over those tokens of gate weight × ‖expert output‖₂ (the expert's
    /// latent-width output `W2·SiTU(W1 x, W3 x)` before weighting).
    pub saliency_sum: Vec<f64>,
}

impl LayerStats {
    pub fn new(layer: usize, experts: usize) -> Self {
        LayerStats { layer, tokens: 0, count: vec![0; experts], gate_sum: vec![0.0; experts], saliency_sum: vec![0.0; experts] }
    }
    /// REAP saliency: mean over the tokens routed to `e` of gate weight × ‖output‖₂.
    pub fn reap(&self, e: usize) -> f64 {
        if self.count[e] == 0 {
            0.0
        } else {
            self.saliency_sum[e] / self.count[e] as f64
        }
    }
    /// Fraction of this layer's tokens that selected `e`.
    pub fn frequency(&self, e: usize) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.count[e] as f64 / self.tokens as f64
        }
    }
    /// Mean gate weight over the tokens routed to `e`.
    pub fn mean_gate(&self, e: usize) -> f64 {
        if self.count[e] == 0 {
            0.0
        } else {
            self.gate_sum[e] / self.count[e] as f64
        }
    }

    /// Checks that the sums could come from [`Self::add`]: every value finite and not negative,
    /// no expert chosen by more tokens than passed the layer, at most `top_k` choices per token,
    /// no sums for an expert nobody chose, and means within what f32 gate weights and output
    /// norms can reach (a statistic of 1e308 is refused, not ranked or summed into infinity).
    fn check_values(&self, top_k: usize) -> Result<(), String> {
        let f32_max = f32::MAX as f64;
        let mut chosen: u128 = 0;
        for e in 0..self.count.len() {
            let (c, g, s) = (self.count[e], self.gate_sum[e], self.saliency_sum[e]);
            if !(g.is_finite() && g >= 0.0 && s.is_finite() && s >= 0.0) {
                return Err(format!("expert {e}: gate_sum {g} / saliency_sum {s} (each must be a finite number ≥ 0)"));
            }
            if c > self.tokens {
                return Err(format!("expert {e} was chosen by {c} tokens, but {} passed the layer", self.tokens));
            }
            if c == 0 && (g != 0.0 || s != 0.0) {
                return Err(format!("expert {e} was chosen by no token but has gate_sum {g}, saliency_sum {s}"));
            }
            if c > 0 && (g / c as f64 > f32_max || s / c as f64 > f32_max * f32_max) {
                return Err(format!(
                    "expert {e}: mean gate weight {:e}, mean saliency {:e} over {c} tokens are beyond any f32 gate weight and output norm",
                    g / c as f64,
                    s / c as f64
                ));
            }
            chosen += c as u128;
        }
        if chosen > self.tokens as u128 * top_k as u128 {
            return Err(format!("{chosen} expert choices for {} tokens of top-{top_k}", self.tokens));
        }
        Ok(())
    }

    /// Adds one batch of routed tokens: `ids`, `weights` and `norms` are `[rows, top_k]`.
    pub fn add(&mut self, top_k: usize, ids: &[u32], weights: &[f32], norms: &[f32]) -> Result<(), PruneError> {
        let n = self.count.len();
        if top_k == 0 || !ids.len().is_multiple_of(top_k) || weights.len() != ids.len() || norms.len() != ids.len() {
            return Err(PruneError::Invalid(format!(
                "layer {}: routing of {} ids, {} weights, {} norms with top-k {top_k}",
                self.layer,
                ids.len(),
                weights.len(),
                norms.len()
            )));
        }
        for ((&e, &w), &y) in ids.iter().zip(weights).zip(norms) {
            let e = e as usize;
            if e >= n {
                return Err(PruneError::Invalid(format!("layer {}: expert id {e} but the layer has {n}", self.layer)));
            }
            self.count[e] += 1;
            self.gate_sum[e] += w as f64;
            self.saliency_sum[e] += w as f64 * y as f64;
        }
        self.tokens += (ids.len() / top_k) as u64;
        Ok(())
    }
}

/// Derived per-expert means of one layer, written next to the sums for readers (ignored on load).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct LayerMeans {
    pub layer: usize,
    pub reap: Vec<f64>,
    pub frequency: Vec<f64>,
    pub mean_gate: Vec<f64>,
}

/// Calibration statistics of one model over a prompt set (the file `k3-prefill calibrate`
/// writes; see docs/pruning.md for the format).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertStats {
    /// [`STATS_FORMAT`].
    pub format: String,
    /// Fingerprint (hex) of the model the statistics were collected on.
    pub model_fingerprint: String,
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Prompts of the prompt file processed so far (resuming continues after them).
    pub prompts_done: usize,
    /// SHA-256 (hex) over the processed prompt lines, each followed by `\n`: a resumed run
    /// checks that the prompt file still starts with them.
    pub prompts_digest: String,
    /// Tokens processed (all prompts).
    pub tokens: u64,
    /// One entry per latent-MoE layer, ascending.
    pub layers: Vec<LayerStats>,
}

impl ExpertStats {
    /// Empty statistics for a model.
    pub fn new(cfg: &TextConfig, fingerprint: &crate::Fingerprint) -> Self {
        let layers = cfg.layer_plan().iter().filter(|s| s.ffn == FfnKind::LatentMoe).map(|s| LayerStats::new(s.index, cfg.num_experts)).collect();
        ExpertStats {
            format: STATS_FORMAT.into(),
            model_fingerprint: fingerprint.hex(),
            num_experts: cfg.num_experts,
            experts_per_token: cfg.num_experts_per_token,
            prompts_done: 0,
            prompts_digest: hex::encode(Sha256::digest(b"")),
            tokens: 0,
            layers,
        }
    }

    /// The statistics of decoder layer `l`.
    pub fn layer_mut(&mut self, l: usize) -> Option<&mut LayerStats> {
        self.layers.iter_mut().find(|s| s.layer == l)
    }

    /// The digest after appending `line` to the processed prompts whose digest is `digest`:
    /// SHA-256 chained as `sha256(prev_hex || line || "\n")`.
    pub fn chain_digest(digest: &str, line: &str) -> String {
        let mut h = Sha256::new();
        h.update(digest.as_bytes());
        h.update(line.as_bytes());
        h.update(b"\n");
        hex::encode(h.finalize())
    }

    /// Checks that the statistics fit a model with this config and fingerprint.
    pub fn check_model(&self, cfg: &TextConfig, fingerprint: &crate::Fingerprint, path: &Path) -> Result<(), PruneError> {
        let err = |msg: String| PruneError::Stats { path: path.display().to_string(), msg };
        if self.model_fingerprint != fingerprint.hex() {
            return Err(err(format!(
                "collected on model {}, but this model is {} (statistics from another model)",
                short(&self.model_fingerprint),
                fingerprint.short()
            )));
        }
        let want = Self::new(cfg, fingerprint);
        let got: Vec<usize> = self.layers.iter().map(|l| l.layer).collect();
        let exp: Vec<usize> = want.layers.iter().map(|l| l.layer).collect();
        if got != exp || self.num_experts != cfg.num_experts || self.experts_per_token != cfg.num_experts_per_token {
            return Err(err(format!(
                "layers {got:?} with {} experts top-{}, the model has MoE layers {exp:?} with {} top-{}",
                self.num_experts, self.experts_per_token, cfg.num_experts, cfg.num_experts_per_token
            )));
        }
        // A gate weight is a sigmoid score (renormalised over the top-k) × the scaling factor:
        // its mean over an expert's tokens cannot exceed the factor (f32 rounding aside).
        let max_gate = cfg.routed_scaling_factor.abs() as f64 * (1.0 + 1e-4) + 1e-6;
        for l in &self.layers {
            if let Some(e) = (0..self.num_experts).find(|&e| !(l.mean_gate(e) <= max_gate)) {
                return Err(err(format!(
                    "layer {}: expert {e}'s mean gate weight is {:e}, above the model's routed_scaling_factor {} (a gate weight cannot exceed it)",
                    l.layer,
                    l.mean_gate(e),
                    cfg.routed_scaling_factor
                )));
            }
        }
        Ok(())
    }

    fn validate(&self, path: &Path) -> Result<(), PruneError> {
        let err = |msg: String| PruneError::Stats { path: path.display().to_string(), msg };
        if self.format != STATS_FORMAT {
            return Err(err(format!("format {:?}, expected {STATS_FORMAT:?}", self.format)));
        }
        for l in &self.layers {
            let n = self.num_experts;
            if l.count.len() != n || l.gate_sum.len() != n || l.saliency_sum.len() != n {
                return Err(err(format!("layer {}: per-expert arrays are not {n} long", l.layer)));
            }
            l.check_values(self.experts_per_token).map_err(|m| err(format!("layer {}: {m}", l.layer)))?;
        }
        Ok(())
    }

    /// Reads and checks the format of a statistics file.
    pub fn load(path: &Path) -> Result<Self, PruneError> {
        #[derive(Deserialize)]
        struct File {
            #[serde(flatten)]
            stats: ExpertStats,
        }
        let text = std::fs::read_to_string(path).map_err(io(path))?;
        let f: File = serde_json::from_str(&text).map_err(|e| PruneError::Stats { path: path.display().to_string(), msg: format!("malformed: {e}") })?;
        f.stats.validate(path)?;
        Ok(f.stats)
    }

    /// Writes the file atomically (a temporary file renamed over `path`), with the derived means.
    pub fn save(&self, path: &Path) -> Result<(), PruneError> {
        let means: Vec<LayerMeans> = self
            .layers
            .iter()
            .map(|l| LayerMeans {
                layer: l.layer,
                reap: (0..self.num_experts).map(|e| l.reap(e)).collect(),
                frequency: (0..self.num_experts).map(|e| l.frequency(e)).collect(),
                mean_gate: (0..self.num_experts).map(|e| l.mean_gate(e)).collect(),
            })
            .collect();
        let mut v = serde_json::to_value(self).expect("stats serialise");
        v["means"] = serde_json::to_value(means).expect("means serialise");
        let tmp = path.with_extension("partial");
        std::fs::write(&tmp, serde_json::to_vec(&v).expect("JSON value serialises")).map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))
    }
}

fn short(hex: &str) -> &str {
    &hex[..hex.len().min(16)]
}

// ---- selection -----------------------------------------------------------------------------

/// How experts are ranked within a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Criterion {
    /// Highest REAP saliency first.
    Reap,
    /// Most often routed first.
    Frequency,
    /// A seeded random permutation (a baseline).
    Random,
}

impl std::str::FromStr for Criterion {
    type Err = PruneError;
    fn from_str(s: &str) -> Result<Self, PruneError> {
        match s {
            "reap" => Ok(Criterion::Reap),
            "frequency" => Ok(Criterion::Frequency),
            "random" => Ok(Criterion::Random),
            _ => Err(PruneError::UnknownCriterion(s.to_string())),
        }
    }
}

/// A layer's experts, best first by `criterion` (ties: the lower id; `seed` only for
/// [`Criterion::Random`]), with the score each was ranked by (random: a uniform draw in [0, 1)).
fn ranked(l: &LayerStats, n: usize, criterion: Criterion, seed: u64) -> Vec<(usize, f64)> {
    let mut scored: Vec<(usize, f64)> = match criterion {
        Criterion::Random => {
            let mut rng = Rng::from_parts(seed, "prune", l.layer as u64);
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            // The permutation's rank as the score: comparable across layers.
            order.iter().enumerate().map(|(r, &e)| (e, 1.0 - r as f64 / n as f64)).collect()
        }
        Criterion::Reap => (0..n).map(|e| (e, l.reap(e))).collect(),
        Criterion::Frequency => (0..n).map(|e| (e, l.frequency(e))).collect(),
    };
    scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    scored
}

/// The experts to keep in each MoE layer: `(layer, ascending source ids)`, `keep` per layer, the
/// `keep` best by `criterion` (ties: the lower id wins; `seed` only for [`Criterion::Random`]).
pub fn select(stats: &ExpertStats, criterion: Criterion, keep: usize, seed: u64) -> Result<Vec<(usize, Vec<usize>)>, PruneError> {
    check_keep(keep, stats.num_experts, stats.experts_per_token)?;
    Ok(stats
        .layers
        .iter()
        .map(|l| {
            let mut kept: Vec<usize> = ranked(l, stats.num_experts, criterion, seed)[..keep].iter().map(|(e, _)| *e).collect();
            kept.sort_unstable();
            (l.layer, kept)
        })
        .collect())
}

/// `--mode global`: `total` experts over all MoE layers, chosen by one ranking across layers —
/// every layer first keeps its own top-k best (the floor: a layer needs at least top-k experts),
/// the rest go to the best remaining experts of any layer by `criterion`'s score (ties: the lower
/// layer, then the lower id). `total` must lie in `layers × top_k ..= layers × experts`.
pub fn select_global(stats: &ExpertStats, criterion: Criterion, total: usize, seed: u64) -> Result<Vec<(usize, Vec<usize>)>, PruneError> {
    let (n, k, layers) = (stats.num_experts, stats.experts_per_token, stats.layers.len());
    if total > layers * n {
        return Err(PruneError::Invalid(format!("{total} experts in all exceed the model's {layers} MoE layers × {n} experts")));
    }
    if total < layers * k {
        return Err(PruneError::Invalid(format!(
            "{total} experts in all are below the floor of top-k ({k}) in each of the {layers} MoE layers ({})",
            layers * k
        )));
    }
    let ranks: Vec<Vec<(usize, f64)>> = stats.layers.iter().map(|l| ranked(l, n, criterion, seed)).collect();
    let mut kept: Vec<Vec<usize>> = ranks.iter().map(|r| r[..k].iter().map(|(e, _)| *e).collect()).collect();
    // (score, layer position, expert) of everything above the floor, best first.
    let mut rest: Vec<(f64, usize, usize)> = ranks.iter().enumerate().flat_map(|(i, r)| r[k..].iter().map(move |&(e, s)| (s, i, e))).collect();
    rest.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    for &(_, i, e) in rest.iter().take(total - layers * k) {
        kept[i].push(e);
    }
    Ok(stats
        .layers
        .iter()
        .zip(kept)
        .map(|(l, mut ids)| {
            ids.sort_unstable();
            (l.layer, ids)
        })
        .collect())
}

/// `keep` must lie in `top_k ..= experts`.
pub fn check_keep(keep: usize, experts: usize, top_k: usize) -> Result<(), PruneError> {
    if keep > experts {
        return Err(PruneError::Invalid(format!("--keep {keep} exceeds the model's {experts} routed experts per layer")));
    }
    if keep < top_k {
        return Err(PruneError::Invalid(format!("--keep {keep} is below the router's top-k ({top_k} experts per token); keep at least {top_k}")));
    }
    Ok(())
}

/// Checkpoint sizes of a config as a function of the routed experts kept per MoE layer
/// (computed once from the tensor list; [`PrunedSizes::bytes`] is then a formula).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrunedSizes {
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Checkpoint bytes with every expert.
    pub full_bytes: u64,
    /// Bytes one expert adds over all MoE layers: its MXFP4 weights, one router row (BF16) and
    /// one correction-bias entry (F32) per layer.
    pub bytes_per_expert_all_layers: u64,
}

impl PrunedSizes {
    pub fn of(cfg: &crate::K3Config) -> Self {
        let d = crate::tensors::DerivedSizes::of(cfg);
        let c = &cfg.text_config;
        let moe = c.layer_plan().iter().filter(|s| s.ffn == FfnKind::LatentMoe).count() as u64;
        PrunedSizes {
            num_experts: c.num_experts,
            experts_per_token: c.num_experts_per_token,
            full_bytes: d.checkpoint_bytes,
            bytes_per_expert_all_layers: moe * (d.bytes_per_expert + c.hidden_size as u64 * 2 + 4),
        }
    }

    /// Checkpoint bytes (all tensors) pruned to `keep` experts per MoE layer.
    pub fn bytes(&self, keep: usize) -> u64 {
        self.full_bytes - self.bytes_per_expert_all_layers * (self.num_experts - keep.min(self.num_experts)) as u64
    }

    /// The most experts per layer (top-k ..= all) whose checkpoint fits `budget` bytes.
    pub fn max_keep(&self, budget: i128) -> Option<usize> {
        (self.experts_per_token..=self.num_experts).rev().find(|&k| self.bytes(k) as i128 <= budget)
    }

    /// `--mode global`: the most experts over all `moe_layers` MoE layers (at least top-k in
    /// each) whose checkpoint fits `budget` bytes (every expert of any layer costs the same).
    pub fn max_total(&self, budget: i128, moe_layers: usize) -> Option<usize> {
        let per = (self.bytes_per_expert_all_layers / moe_layers.max(1) as u64) as i128;
        let floor = self.bytes(self.experts_per_token) as i128;
        if floor > budget || moe_layers == 0 {
            return None;
        }
        let extra = if per > 0 { ((budget - floor) / per) as usize } else { usize::MAX };
        Some((moe_layers * self.experts_per_token).saturating_add(extra).min(moe_layers * self.num_experts))
    }
}

/// Checkpoint bytes (all tensors) of this config pruned to `keep` experts per MoE layer.
pub fn pruned_bytes(cfg: &crate::K3Config, keep: usize) -> u64 {
    PrunedSizes::of(cfg).bytes(keep)
}

fn nothing_fits(s: &PrunedSizes, budget: u64) -> PruneError {
    PruneError::Invalid(format!(
        "no pruned model fits {:.3} GB: even the minimum of {} experts per layer (the top-k) needs {:.3} GB",
        budget as f64 / 1e9,
        s.experts_per_token,
        s.bytes(s.experts_per_token) as f64 / 1e9
    ))
}

/// The largest `keep` whose pruned checkpoint fits `budget` bytes.
pub fn keep_for_budget(cfg: &crate::K3Config, budget: u64) -> Result<usize, PruneError> {
    let s = PrunedSizes::of(cfg);
    s.max_keep(budget as i128).ok_or_else(|| nothing_fits(&s, budget))
}

/// `--mode global`: the most experts over all MoE layers whose pruned checkpoint fits `budget`.
pub fn total_for_budget(cfg: &crate::K3Config, budget: u64) -> Result<usize, PruneError> {
    let s = PrunedSizes::of(cfg);
    let moe = cfg.text_config.layer_plan().iter().filter(|l| l.ffn == FfnKind::LatentMoe).count();
    s.max_total(budget as i128, moe).ok_or_else(|| nothing_fits(&s, budget))
}

// ---- the pruned checkpoint -------------------------------------------------------------------

/// Provenance of a pruned checkpoint, written as [`RECORD_FILE`] next to its config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PruneRecord {
    pub format: String,
    /// Fingerprint (hex) of the source model.
    pub source_fingerprint: String,
    pub source_dir: String,
    pub source_num_experts: usize,
    pub num_experts: usize,
    pub criterion: Criterion,
    /// `uniform`: the same count in every MoE layer.
    pub mode: String,
    pub seed: u64,
    /// SHA-256 (hex) of the statistics file, and what it covered.
    pub stats_sha256: String,
    pub stats_prompts: usize,
    pub stats_tokens: u64,
    /// Per MoE layer: the source ids of the kept experts; new id `i` is `kept[i]`.
    pub kept: BTreeMap<usize, Vec<usize>>,
}

impl PruneRecord {
    /// The record of a pruned checkpoint directory, if it has one.
    pub fn load(dir: &Path) -> Result<Option<Self>, PruneError> {
        let path = dir.join(RECORD_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        let r: PruneRecord = serde_json::from_str(&text).map_err(|e| PruneError::Invalid(format!("{}: malformed pruning record: {e}", path.display())))?;
        if r.format != RECORD_FORMAT {
            return Err(PruneError::Invalid(format!("{}: format {:?}, expected {RECORD_FORMAT:?}", path.display(), r.format)));
        }
        Ok(Some(r))
    }
}

/// What one source tensor becomes.
enum Action {
    /// The bytes as they are (under the new name for a renumbered expert).
    Copy,
    /// Rows `ids` of a `[rows, …]` tensor (the router weight, the bias).
    Rows { ids: Vec<usize>, row_bytes: usize },
}

/// Parses `language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{rest}`.
fn expert_of(name: &str) -> Option<(usize, usize, &str)> {
    let rest = name.strip_prefix("language_model.model.layers.")?;
    let (l, rest) = rest.split_once('.')?;
    let rest = rest.strip_prefix("block_sparse_moe.experts.")?;
    let (e, rest) = rest.split_once('.')?;
    Some((l.parse().ok()?, e.parse().ok()?, rest))
}

/// What was written.
#[derive(Debug, Clone)]
pub struct PruneReport {
    pub dir: PathBuf,
    pub shards: usize,
    pub tensors: usize,
    /// Bytes read from the source shards.
    pub bytes_read: u64,
    /// Tensor bytes written.
    pub bytes_written: u64,
    pub seconds: f64,
}

/// Writes `src` pruned to the experts `kept` (per MoE layer, ascending source ids, the same count
/// in every layer) into `out`, in the release layout: shards in the source's order (each output
/// shard holds what remains of one source shard; empty ones are left out), the index,
/// `config.json` with `num_experts` updated, [`RECORD_FILE`] and every other file of the source
/// directory (tokenizer, ...). The source is read tensor by tensor through its memory map, so
/// memory stays bounded by the largest sliced tensor (a router matrix). The directory is built
/// as `out.partial` and renamed when complete: an interrupted run leaves no `out`.
pub fn prune_checkpoint(
    src: &Checkpoint,
    kept: &[(usize, Vec<usize>)],
    record: &PruneRecord,
    out: &Path,
    progress: &indicatif::ProgressBar,
) -> Result<PruneReport, PruneError> {
    let t0 = std::time::Instant::now();
    let c = &src.config().text_config;
    let moe: Vec<usize> = c.layer_plan().iter().filter(|s| s.ffn == FfnKind::LatentMoe).map(|s| s.index).collect();
    let kept_layers: Vec<usize> = kept.iter().map(|(l, _)| *l).collect();
    if kept_layers != moe {
        return Err(PruneError::Invalid(format!("kept experts given for layers {kept_layers:?}, the model's MoE layers are {moe:?}")));
    }
    if c.num_experts_per_layer.is_some() {
        return Err(PruneError::Invalid(format!("{} was itself pruned per layer (--mode global); prune its source model instead", src.dir().display())));
    }
    for (l, ids) in kept {
        if ids.windows(2).any(|w| w[0] >= w[1]) || ids.iter().any(|&e| e >= c.num_experts) {
            return Err(PruneError::Invalid(format!("layer {l}: kept ids must be ascending, distinct and below {}", c.num_experts)));
        }
        check_keep(ids.len(), c.num_experts, c.num_experts_per_token).map_err(|e| PruneError::Invalid(format!("layer {l}: {e}")))?;
    }
    // The same count everywhere: the release layout. Otherwise per-layer counts in the config.
    let keep = kept.iter().map(|(_, k)| k.len()).max().unwrap_or(c.num_experts);
    let uniform = kept.iter().all(|(_, k)| k.len() == keep);
    if out.exists() {
        return Err(PruneError::Invalid(format!("output {} already exists; choose a new directory", out.display())));
    }
    let partial = PathBuf::from(format!("{}.partial", out.display()));
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io(&partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io(&partial))?;

    // New id of each kept expert, per layer.
    let mut new_id: BTreeMap<usize, Vec<Option<usize>>> = BTreeMap::new();
    for (l, ids) in kept {
        let mut m = vec![None; c.num_experts];
        for (i, &e) in ids.iter().enumerate() {
            m[e] = Some(i);
        }
        new_id.insert(*l, m);
    }
    let kept_of: BTreeMap<usize, &Vec<usize>> = kept.iter().map(|(l, k)| (*l, k)).collect();
    let router_w = |l: usize| layer_tensor(l, "block_sparse_moe.gate.weight");
    let router_b = |l: usize| layer_tensor(l, "block_sparse_moe.gate.e_score_correction_bias");

    // Plan: per source shard, its tensors by offset and what each becomes.
    let mut by_shard: BTreeMap<usize, Vec<(&str, &crate::checkpoint::TensorEntry)>> = BTreeMap::new();
    for n in src.tensor_names() {
        let e = src.entry(n).expect("listed");
        by_shard.entry(e.shard).or_default().push((n, e));
    }
    type Planned<'a> = (&'a str, Action, TensorSpec, &'a crate::checkpoint::TensorEntry);
    let mut plans: Vec<(usize, Vec<Planned<'_>>)> = Vec::new();
    for (shard, mut list) in by_shard {
        list.sort_by_key(|(_, e)| e.start);
        let mut acts = Vec::new();
        for (name, e) in list {
            let spec = |name: String, shape: Vec<usize>| TensorSpec { name, shape, dtype: e.dtype, init: Init::Linear };
            if let Some((l, ex, rest)) = expert_of(name) {
                let Some(map) = new_id.get(&l) else {
                    return Err(PruneError::Invalid(format!("{name}: routed expert tensor in layer {l}, which is not a MoE layer")));
                };
                match map.get(ex) {
                    Some(Some(i)) => {
                        let nn = layer_tensor(l, &format!("block_sparse_moe.experts.{i}.{rest}"));
                        acts.push((name, Action::Copy, spec(nn, e.shape.clone()), e));
                    }
                    Some(None) => {}
                    None => return Err(PruneError::Invalid(format!("{name}: expert {ex} beyond the config's {} experts", c.num_experts))),
                }
                continue;
            }
            let sliced = kept_of.iter().find_map(|(&l, ids)| (name == router_w(l) || name == router_b(l)).then_some((l, *ids)));
            match sliced {
                Some((l, ids)) => {
                    let rows = e.shape.first().copied().unwrap_or(0);
                    if rows != c.num_experts {
                        return Err(PruneError::Invalid(format!("{name} (layer {l}): {rows} rows, the config has {} experts", c.num_experts)));
                    }
                    let row_bytes = (e.end - e.start) / rows.max(1);
                    let mut shape = e.shape.clone();
                    shape[0] = ids.len();
                    acts.push((name, Action::Rows { ids: ids.clone(), row_bytes }, spec(name.to_string(), shape), e));
                }
                None => acts.push((name, Action::Copy, spec(name.to_string(), e.shape.clone()), e)),
            }
        }
        if !acts.is_empty() {
            plans.push((shard, acts));
        }
    }

    let total_read: u64 = plans.iter().flat_map(|(_, a)| a.iter()).map(|(_, _, _, e)| (e.end - e.start) as u64).sum();
    progress.set_length(total_read);
    let nshards = plans.len();
    let mut weight_map = BTreeMap::new();
    let mut written = 0u64;
    let mut tensors = 0usize;
    for (k, (shard, acts)) in plans.iter().enumerate() {
        let file = shard_file_name(k, nshards);
        progress.set_message(format!("{} → {file}", src.shard_name(*shard)));
        let path = partial.join(&file);
        let specs: Vec<TensorSpec> = acts.iter().map(|(_, _, s, _)| s.clone()).collect();
        let mut w = ShardWriter::create(&path, &specs).map_err(io(&path))?;
        for (src_name, act, spec, _) in acts {
            let view = src.tensor(src_name)?;
            match act {
                Action::Copy => w.write(view.bytes).map_err(io(&path))?,
                Action::Rows { ids, row_bytes, .. } => {
                    for &r in ids {
                        w.write(&view.bytes[r * row_bytes..(r + 1) * row_bytes]).map_err(io(&path))?;
                    }
                }
            }
            debug_assert_eq!(spec.dtype, view.dtype);
            written += spec.nbytes() as u64;
            tensors += 1;
            weight_map.insert(spec.name.clone(), file.clone());
            progress.inc(view.bytes.len() as u64);
        }
        w.finish(true).map_err(io(&path))?;
    }

    // config.json: the source's JSON (informational fields kept) with num_experts updated.
    let cfg_path = src.dir().join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| PruneError::Invalid(format!("{}: {e}", cfg_path.display())))?;
    cfg["text_config"]["num_experts"] = serde_json::json!(keep);
    if !uniform {
        let per: Vec<usize> = (0..c.num_hidden_layers).map(|l| kept_of.get(&l).map_or(0, |k| k.len())).collect();
        cfg["text_config"]["num_experts_per_layer"] = serde_json::json!(per);
    }
    let out_cfg = partial.join("config.json");
    std::fs::write(&out_cfg, serde_json::to_string_pretty(&cfg).expect("JSON serialises")).map_err(io(&out_cfg))?;
    let idx_path = partial.join(INDEX_FILE);
    write_index(&partial, &weight_map, written).map_err(io(&idx_path))?;
    let rec_path = partial.join(RECORD_FILE);
    std::fs::write(&rec_path, serde_json::to_string_pretty(record).expect("record serialises")).map_err(io(&rec_path))?;
    // Every other file of the source directory (tokenizer, templates, ...).
    let shard_names: std::collections::HashSet<String> = src.tensor_names().map(|n| src.shard_name(src.entry(n).expect("listed").shard).to_string()).collect();
    for entry in std::fs::read_dir(src.dir()).map_err(io(src.dir()))? {
        let entry = entry.map_err(io(src.dir()))?;
        let name = entry.file_name().to_string_lossy().to_string();
        let skip = shard_names.contains(&name) || ["config.json", INDEX_FILE, RECORD_FILE, crate::fingerprint::DIGEST_FILE].contains(&name.as_str());
        if !skip && entry.file_type().map_err(io(&entry.path()))?.is_file() {
            std::fs::copy(entry.path(), partial.join(&name)).map_err(io(&entry.path()))?;
        }
    }
    // Check the result loads before it takes its final name.
    let check = Checkpoint::open(&partial)?;
    drop(check);
    std::fs::rename(&partial, out).map_err(io(out))?;
    Ok(PruneReport { dir: out.to_path_buf(), shards: nshards, tensors, bytes_read: total_read, bytes_written: written, seconds: t0.elapsed().as_secs_f64() })
}
