//! The release `config.json`: a multimodal wrapper holding `text_config` (with the
//! compressed-tensors `quantization_config`) and `vision_config` (spec §1), parsed into typed
//! structs, validated, and turned into a per-layer plan.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Everything that can be wrong with a config, each naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("malformed config {path}: {source}")]
    Json { path: String, source: serde_json::Error },
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// Upper bounds on config sizes, checked before anything is allocated by them. Each is far above
/// the release (93 layers, hidden 7168, 896 experts, vocab 163,840, heads of 128) and far below
/// what would exhaust memory building the tensor list or the hand-off state.
pub mod limits {
    pub const LAYERS: usize = 1024;
    pub const WIDTH: usize = 1 << 18;
    pub const VOCAB: usize = 1 << 23;
    pub const HEADS: usize = 1024;
    pub const HEAD_DIM: usize = 1024;
    pub const CONV_KERNEL: usize = 64;
    pub const EXPERTS: usize = 1 << 14;
    /// Layers × routed experts (the release has 93 × 896 = 83,328).
    pub const LAYER_EXPERTS: usize = 1 << 20;
    pub const PATCH: usize = 256;
    pub const POS_TABLE: usize = 4096;
    /// `config.json` and the index are read whole; larger files are refused unread.
    pub const JSON_FILE_BYTES: u64 = 256 << 20;
}

/// Constants of the model that `config.json` does not carry; both nodes compute with these.
pub mod spec {
    /// ε of the MLA latent norms (`q_a_layernorm`, `kv_a_layernorm`), built without an explicit
    /// eps (spec §3.0, §8).
    pub const MLA_LATENT_NORM_EPS: f32 = 1e-6;
    /// ε inside the KDA q/k L2 norm `x / sqrt(Σx² + eps)` (fla, spec §3.0).
    pub const KDA_L2_EPS: f32 = 1e-6;
    /// KDA chunk length of the chunked (prefill) form; the last chunk may be shorter (spec §3.4).
    pub const KDA_CHUNK: usize = 64;
}

/// Top-level `config.json` of `KimiK3ForConditionalGeneration`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct K3Config {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: String,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub pad_token_id: u32,
    pub media_placeholder_token_id: u32,
    #[serde(default)]
    pub image_placeholder: Option<String>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub text_config: TextConfig,
    pub vision_config: VisionConfig,
}

/// `text_config` (model_type `kimi_linear`), field names as released.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TextConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub intermediate_size: usize,
    pub first_k_dense_replace: usize,
    #[serde(default = "one")]
    pub moe_layer_freq: usize,
    pub hidden_act: String,
    pub activation_situ_beta: f32,
    /// `null` leaves the up branch linear.
    #[serde(default)]
    pub activation_situ_linear_beta: Option<f32>,
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub max_position_embeddings: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    #[serde(default = "yes")]
    pub mla_use_nope: bool,
    #[serde(default = "yes")]
    pub mla_use_output_gate: bool,
    pub linear_attn_config: LinearAttnConfig,
    pub num_experts: usize,
    /// k3-offload's extension for checkpoints pruned with `k3-prefill prune --mode global`: the
    /// routed experts of each decoder layer (0 for dense layers); `num_experts` is then their
    /// maximum. Absent (the release, uniform pruning): every MoE layer has `num_experts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_experts_per_layer: Option<Vec<usize>>,
    pub num_experts_per_token: usize,
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub routed_expert_hidden_size: usize,
    #[serde(default = "yes")]
    pub latent_moe_use_norm: bool,
    pub routed_scaling_factor: f32,
    #[serde(default = "sigmoid")]
    pub moe_router_activation_func: String,
    #[serde(default = "yes")]
    pub moe_renormalize: bool,
    #[serde(default)]
    pub topk_method: String,
    #[serde(default = "one")]
    pub num_expert_group: usize,
    #[serde(default = "one")]
    pub topk_group: usize,
    pub attn_res_block_size: usize,
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub quantization_config: QuantizationConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LinearAttnConfig {
    /// 1-based indices of the MLA ("full attention") layers.
    pub full_attn_layers: Vec<usize>,
    /// 1-based indices of the KDA layers.
    pub kda_layers: Vec<usize>,
    pub num_heads: usize,
    pub head_dim: usize,
    pub short_conv_kernel_size: usize,
    #[serde(default = "yes")]
    pub use_full_rank_gate: bool,
    /// `Some(-5.0)` in K3 selects the bounded ("safe") decay gate.
    #[serde(default)]
    pub gate_lower_bound: Option<f32>,
}

/// Serializes a free-form JSON value with its object keys sorted at every depth, whether or not
/// serde_json's `preserve_order` feature is on (a crate of the build can turn it on for all:
/// llguidance does): the model fingerprint hashes this text, and both nodes must agree on it.
fn sorted_json<S: serde::Serializer>(v: &Option<serde_json::Value>, s: S) -> Result<S::Ok, S::Error> {
    struct Sorted<'a>(&'a serde_json::Value);
    impl Serialize for Sorted<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::{SerializeMap, SerializeSeq};
            match self.0 {
                serde_json::Value::Object(m) => {
                    let mut e: Vec<_> = m.iter().collect();
                    e.sort_by(|a, b| a.0.cmp(b.0));
                    let mut map = s.serialize_map(Some(e.len()))?;
                    for (k, v) in e {
                        map.serialize_entry(k, &Sorted(v))?;
                    }
                    map.end()
                }
                serde_json::Value::Array(a) => {
                    let mut seq = s.serialize_seq(Some(a.len()))?;
                    for v in a {
                        seq.serialize_element(&Sorted(v))?;
                    }
                    seq.end()
                }
                other => other.serialize(s),
            }
        }
    }
    v.as_ref().map(Sorted).serialize(s)
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct QuantizationConfig {
    pub quant_method: String,
    pub format: String,
    pub config_groups: std::collections::BTreeMap<String, QuantGroup>,
    #[serde(default)]
    pub ignore: Vec<String>,
    #[serde(default)]
    pub quantization_status: Option<String>,
    #[serde(default, serialize_with = "sorted_json")]
    pub kv_cache_scheme: Option<serde_json::Value>,
    #[serde(default, serialize_with = "sorted_json")]
    pub global_compression_ratio: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct QuantGroup {
    #[serde(default)]
    pub format: Option<String>,
    #[serde(default)]
    pub targets: Vec<String>,
    pub weights: QuantWeights,
    #[serde(default, serialize_with = "sorted_json")]
    pub input_activations: Option<serde_json::Value>,
    #[serde(default, serialize_with = "sorted_json")]
    pub output_activations: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct QuantWeights {
    pub num_bits: u32,
    #[serde(rename = "type")]
    pub kind: String,
    pub strategy: String,
    pub group_size: usize,
    pub symmetric: bool,
    #[serde(default)]
    pub scale_dtype: Option<String>,
    #[serde(default)]
    pub dynamic: bool,
    #[serde(default)]
    pub observer: Option<String>,
    #[serde(default, serialize_with = "sorted_json")]
    pub actorder: Option<serde_json::Value>,
    #[serde(default, serialize_with = "sorted_json")]
    pub block_structure: Option<serde_json::Value>,
    #[serde(default, serialize_with = "sorted_json")]
    pub observer_kwargs: Option<serde_json::Value>,
    #[serde(default, serialize_with = "sorted_json")]
    pub zp_dtype: Option<serde_json::Value>,
}

/// `vision_config` (MoonViT-V2 + patchmergerv2 projector, spec §1.3).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct VisionConfig {
    pub patch_size: usize,
    pub vt_hidden_size: usize,
    pub vt_num_hidden_layers: usize,
    pub vt_num_attention_heads: usize,
    pub qkv_hidden_size: usize,
    pub vt_intermediate_size: usize,
    pub activation_func: String,
    pub norm_type: String,
    #[serde(default)]
    pub attn_bias: bool,
    #[serde(default)]
    pub linear_bias: bool,
    #[serde(default)]
    pub patch_embed_proj_bias: bool,
    pub init_pos_emb_height: usize,
    pub init_pos_emb_width: usize,
    #[serde(default = "four")]
    pub init_pos_emb_time: usize,
    #[serde(default)]
    pub pos_emb_type: String,
    #[serde(default = "bilinear")]
    pub pos_emb_interpolation_mode: String,
    pub merge_kernel_size: [usize; 2],
    #[serde(default)]
    pub merge_type: String,
    #[serde(default)]
    pub mm_projector_type: String,
    pub mm_hidden_size: usize,
    #[serde(default)]
    pub projector_hidden_act: String,
    pub projector_ln_eps: f32,
    pub text_hidden_size: usize,
    #[serde(default)]
    pub mlp_type: String,
}

fn one() -> usize {
    1
}
fn four() -> usize {
    4
}
fn yes() -> bool {
    true
}
fn sigmoid() -> String {
    "sigmoid".into()
}
fn bilinear() -> String {
    "bilinear".into()
}

/// Attention kind of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub enum AttnKind {
    Kda,
    Mla,
}

/// Feed-forward kind of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash)]
pub enum FfnKind {
    Dense,
    LatentMoe,
}

/// What one decoder layer is, derived from the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSpec {
    pub index: usize,
    pub attn: AttnKind,
    pub ffn: FfnKind,
    /// `index % attn_res_block_size == 0`: the running sum is banked before this layer.
    pub bank_boundary: bool,
}

impl K3Config {
    /// Reads and validates `DIR/config.json`.
    pub fn load(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let text = crate::files::read_regular_to_string(&path, limits::JSON_FILE_BYTES)
            .map_err(|source| ConfigError::Io { path: path.display().to_string(), source })?;
        Self::from_json(&text).map_err(|e| match e {
            ConfigError::Json { source, .. } => ConfigError::Json { path: path.display().to_string(), source },
            other => other,
        })
    }

    /// Parses and validates config JSON text.
    pub fn from_json(text: &str) -> Result<Self, ConfigError> {
        let cfg: K3Config = serde_json::from_str(text).map_err(|source| ConfigError::Json { path: "<text>".into(), source })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.text_config.validate()?;
        self.vision_config.validate(self.text_config.hidden_size)
    }
}

impl TextConfig {
    /// Checks layer lists, widths and the quantization scheme; every problem is reported.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let n = self.num_hidden_layers;
        let la = &self.linear_attn_config;
        if n == 0 {
            problems.push("num_hidden_layers is 0".to_string());
        }
        // Bounds first: later checks, the tensor list and the state allocate by these sizes.
        let out_of_range = self.out_of_range();
        if !out_of_range.is_empty() {
            problems.extend(out_of_range);
            return Err(ConfigError::Invalid(problems.join("; ")));
        }
        let mut seen = vec![0u8; n];
        for (list, name) in [(&la.kda_layers, "kda_layers"), (&la.full_attn_layers, "full_attn_layers")] {
            for &l in list {
                if l == 0 {
                    problems.push(format!("linear_attn_config.{name} contains 0, but the lists are 1-based (1..={n})"));
                } else if l > n {
                    problems.push(format!("linear_attn_config.{name} contains {l}, beyond num_hidden_layers = {n} (lists are 1-based)"));
                } else {
                    seen[l - 1] += 1;
                }
            }
        }
        let doubled: Vec<usize> = (0..n).filter(|&i| seen[i] > 1).map(|i| i + 1).collect();
        if !doubled.is_empty() {
            problems.push(format!("layers {doubled:?} (1-based) appear twice in kda_layers/full_attn_layers"));
        }
        let missing: Vec<usize> = (0..n).filter(|&i| seen[i] == 0).map(|i| i + 1).collect();
        if !missing.is_empty() {
            problems.push(format!("layers {missing:?} (1-based) are in neither kda_layers nor full_attn_layers"));
        }
        let div = |a: usize, b: usize, what: &str, problems: &mut Vec<String>| {
            if b == 0 || !a.is_multiple_of(b) {
                problems.push(format!("{what}: {a} is not divisible by {b}"));
            }
        };
        if la.num_heads == 0 || la.head_dim == 0 {
            problems.push("linear_attn_config.num_heads and head_dim must be > 0".into());
        }
        if la.short_conv_kernel_size < 2 {
            problems.push(format!("linear_attn_config.short_conv_kernel_size = {} (must be >= 2)", la.short_conv_kernel_size));
        }
        if !la.use_full_rank_gate {
            problems.push("linear_attn_config.use_full_rank_gate = false (g_a/g_b gates) is not K3".into());
        }
        if self.num_attention_heads == 0 {
            problems.push("num_attention_heads is 0".into());
        }
        if self.attn_res_block_size == 0 {
            problems.push("attn_res_block_size is 0".into());
        }
        if self.num_experts_per_token == 0 || self.num_experts_per_token > self.num_experts {
            problems.push(format!("num_experts_per_token = {} must be in 1..={} (num_experts)", self.num_experts_per_token, self.num_experts));
        }
        if let Some(per) = &self.num_experts_per_layer {
            if per.len() != n {
                problems.push(format!("num_experts_per_layer has {} entries for {n} layers", per.len()));
            } else {
                for (l, &e) in per.iter().enumerate() {
                    let moe = l >= self.first_k_dense_replace;
                    if moe && (e < self.num_experts_per_token || e > self.num_experts) {
                        problems.push(format!(
                            "num_experts_per_layer[{l}] = {e} must be in {}..={} (num_experts_per_token..=num_experts)",
                            self.num_experts_per_token, self.num_experts
                        ));
                    } else if !moe && e != 0 {
                        problems.push(format!("num_experts_per_layer[{l}] = {e}, but layer {l} is dense (must be 0)"));
                    }
                }
                if per.iter().max().copied().unwrap_or(0) != self.num_experts && n > self.first_k_dense_replace {
                    problems.push(format!("num_experts = {} must be the maximum of num_experts_per_layer", self.num_experts));
                }
            }
        }
        if self.first_k_dense_replace > n {
            problems.push(format!("first_k_dense_replace = {} exceeds the layer count {n}", self.first_k_dense_replace));
        }
        if self.moe_layer_freq != 1 {
            problems.push(format!("moe_layer_freq = {} (only 1 is supported, as in K3)", self.moe_layer_freq));
        }
        if self.num_expert_group != 1 || self.topk_group != 1 {
            problems.push(format!("num_expert_group = {}, topk_group = {} (K3 uses one group)", self.num_expert_group, self.topk_group));
        }
        if self.hidden_act != "situ" {
            problems.push(format!("hidden_act = {:?} (K3 uses \"situ\")", self.hidden_act));
        }
        if self.moe_router_activation_func != "sigmoid" {
            problems.push(format!("moe_router_activation_func = {:?} (K3 uses sigmoid)", self.moe_router_activation_func));
        }
        if !self.mla_use_nope {
            problems.push("mla_use_nope = false (rotary MLA) is not supported".into());
        }
        // MXFP4 experts: the group is 32 and every expert input width divides into groups.
        let q = &self.quantization_config;
        if q.format != "mxfp4-pack-quantized" {
            problems.push(format!("quantization_config.format = {:?} (expected mxfp4-pack-quantized)", q.format));
        }
        if q.config_groups.is_empty() {
            problems.push("quantization_config.config_groups is empty".into());
        }
        for (name, g) in &q.config_groups {
            let w = &g.weights;
            if w.group_size != 32 {
                problems.push(format!("quantization_config.config_groups.{name}.weights.group_size = {} (MXFP4 needs 32)", w.group_size));
            }
            if w.num_bits != 4 || w.kind != "float" {
                problems.push(format!("quantization_config.config_groups.{name}.weights: num_bits {} type {:?} (MXFP4 needs 4-bit float)", w.num_bits, w.kind));
            }
        }
        div(self.routed_expert_hidden_size, 32, "routed_expert_hidden_size (MXFP4 group 32)", &mut problems);
        div(self.moe_intermediate_size, 32, "moe_intermediate_size (MXFP4 group 32)", &mut problems);
        if self.hidden_size == 0 || self.vocab_size == 0 {
            problems.push("hidden_size and vocab_size must be > 0".into());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems.join("; ")))
        }
    }

    /// Sizes beyond [`limits`]: each names the field, its value and the bound. Checked before
    /// anything is allocated by them (a hostile or mistyped `num_hidden_layers: 1000000000` must be
    /// an error, not an allocation failure).
    fn out_of_range(&self) -> Vec<String> {
        let la = &self.linear_attn_config;
        let mut p = Vec::new();
        let mut bound = |field: &str, v: usize, max: usize| {
            if v > max {
                p.push(format!("{field} = {v} exceeds the supported maximum {max}"));
            }
        };
        bound("num_hidden_layers", self.num_hidden_layers, limits::LAYERS);
        bound("hidden_size", self.hidden_size, limits::WIDTH);
        bound("vocab_size", self.vocab_size, limits::VOCAB);
        bound("intermediate_size", self.intermediate_size, limits::WIDTH);
        bound("num_attention_heads", self.num_attention_heads, limits::HEADS);
        bound("q_lora_rank", self.q_lora_rank, limits::WIDTH);
        bound("kv_lora_rank", self.kv_lora_rank, limits::WIDTH);
        bound("qk_nope_head_dim", self.qk_nope_head_dim, limits::HEAD_DIM);
        bound("qk_rope_head_dim", self.qk_rope_head_dim, limits::HEAD_DIM);
        bound("v_head_dim", self.v_head_dim, limits::HEAD_DIM);
        bound("linear_attn_config.num_heads", la.num_heads, limits::HEADS);
        bound("linear_attn_config.head_dim", la.head_dim, limits::HEAD_DIM);
        bound("linear_attn_config.short_conv_kernel_size", la.short_conv_kernel_size, limits::CONV_KERNEL);
        bound("linear_attn_config.kda_layers (length)", la.kda_layers.len(), limits::LAYERS);
        bound("linear_attn_config.full_attn_layers (length)", la.full_attn_layers.len(), limits::LAYERS);
        bound("num_experts", self.num_experts, limits::EXPERTS);
        bound("num_shared_experts", self.num_shared_experts, limits::EXPERTS);
        bound("moe_intermediate_size", self.moe_intermediate_size, limits::WIDTH);
        bound("routed_expert_hidden_size", self.routed_expert_hidden_size, limits::WIDTH);
        bound("num_nextn_predict_layers", self.num_nextn_predict_layers, limits::LAYERS);
        if p.is_empty() && self.num_hidden_layers.saturating_mul(self.num_experts) > limits::LAYER_EXPERTS {
            p.push(format!(
                "num_hidden_layers × num_experts = {} × {} exceeds the supported maximum {} expert instances",
                self.num_hidden_layers,
                self.num_experts,
                limits::LAYER_EXPERTS
            ));
        }
        p
    }

    /// Routed experts of MoE layer `l`: `num_experts_per_layer[l]` when the checkpoint was pruned
    /// per layer (`--mode global`), else `num_experts`.
    pub fn experts_in_layer(&self, l: usize) -> usize {
        self.num_experts_per_layer.as_ref().and_then(|v| v.get(l).copied()).unwrap_or(self.num_experts)
    }

    /// The per-layer plan. The config's lists are 1-based: `is_kda(l) ⇔ (l+1) ∈ kda_layers`.
    pub fn layer_plan(&self) -> Vec<LayerSpec> {
        let la = &self.linear_attn_config;
        (0..self.num_hidden_layers)
            .map(|l| LayerSpec {
                index: l,
                attn: if la.kda_layers.contains(&(l + 1)) { AttnKind::Kda } else { AttnKind::Mla },
                ffn: if l < self.first_k_dense_replace { FfnKind::Dense } else { FfnKind::LatentMoe },
                bank_boundary: l % self.attn_res_block_size == 0,
            })
            .collect()
    }

    pub fn kda_layers(&self) -> Vec<usize> {
        self.layer_plan().iter().filter(|s| s.attn == AttnKind::Kda).map(|s| s.index).collect()
    }

    pub fn mla_layers(&self) -> Vec<usize> {
        self.layer_plan().iter().filter(|s| s.attn == AttnKind::Mla).map(|s| s.index).collect()
    }

    /// KDA channel width `num_heads × head_dim`.
    pub fn kda_width(&self) -> usize {
        self.linear_attn_config.num_heads * self.linear_attn_config.head_dim
    }

    /// MLA query/key head width (nope + rope).
    pub fn mla_qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Values per token per MLA layer in the latent cache: `c_kv` then `k_pe`.
    pub fn mla_latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Width of the fused shared experts' MLP.
    pub fn shared_expert_width(&self) -> usize {
        self.num_shared_experts * self.moe_intermediate_size
    }

    /// Rows of the conv windows handed off per KDA projection.
    pub fn conv_window(&self) -> usize {
        self.linear_attn_config.short_conv_kernel_size - 1
    }
}

impl VisionConfig {
    pub fn validate(&self, text_hidden: usize) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        let mut bound = |field: &str, v: usize, max: usize| {
            if v > max {
                problems.push(format!("vision_config.{field} = {v} exceeds the supported maximum {max}"));
            }
        };
        bound("patch_size", self.patch_size, limits::PATCH);
        bound("vt_hidden_size", self.vt_hidden_size, limits::WIDTH);
        bound("vt_num_hidden_layers", self.vt_num_hidden_layers, limits::LAYERS);
        bound("vt_num_attention_heads", self.vt_num_attention_heads, limits::HEADS);
        bound("qkv_hidden_size", self.qkv_hidden_size, limits::WIDTH);
        bound("vt_intermediate_size", self.vt_intermediate_size, limits::WIDTH);
        bound("init_pos_emb_height", self.init_pos_emb_height, limits::POS_TABLE);
        bound("init_pos_emb_width", self.init_pos_emb_width, limits::POS_TABLE);
        bound("init_pos_emb_time", self.init_pos_emb_time, limits::POS_TABLE);
        bound("merge_kernel_size[0]", self.merge_kernel_size[0], limits::PATCH);
        bound("merge_kernel_size[1]", self.merge_kernel_size[1], limits::PATCH);
        bound("mm_hidden_size", self.mm_hidden_size, limits::WIDTH);
        bound("text_hidden_size", self.text_hidden_size, limits::WIDTH);
        if !problems.is_empty() {
            return Err(ConfigError::Invalid(problems.join("; ")));
        }
        if self.vt_num_attention_heads == 0 || !self.qkv_hidden_size.is_multiple_of(self.vt_num_attention_heads) {
            problems.push(format!(
                "vision_config.qkv_hidden_size {} is not divisible by vt_num_attention_heads {}",
                self.qkv_hidden_size, self.vt_num_attention_heads
            ));
        } else if !(self.qkv_hidden_size / self.vt_num_attention_heads).is_multiple_of(4) {
            problems.push(format!("vision head dim {} must be a multiple of 4 (2-D rotary pairs)", self.qkv_hidden_size / self.vt_num_attention_heads));
        }
        if self.text_hidden_size != text_hidden {
            problems.push(format!("vision_config.text_hidden_size {} differs from text_config.hidden_size {text_hidden}", self.text_hidden_size));
        }
        if self.mm_hidden_size != self.vt_hidden_size {
            problems.push(format!("vision_config.mm_hidden_size {} differs from vt_hidden_size {}", self.mm_hidden_size, self.vt_hidden_size));
        }
        if self.patch_size == 0 || self.merge_kernel_size.contains(&0) {
            problems.push("vision_config.patch_size and merge_kernel_size must be > 0".into());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems.join("; ")))
        }
    }

    pub fn head_dim(&self) -> usize {
        self.qkv_hidden_size / self.vt_num_attention_heads
    }
}
