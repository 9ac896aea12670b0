//! The synthetic model configurations of spec §6 (tiny, small, medium) and the real K3
//! dimensions, with per-field overrides. Every preset keeps K3's structure: KDA layers with
//! short conv and bounded gate, MLA every 4th layer plus the last (double-MLA tail), a dense
//! layer 0, latent MoE with MXFP4 experts and 2 fused shared experts, AttnRes banks.

use std::collections::BTreeMap;

use crate::config::{K3Config, LinearAttnConfig, QuantGroup, QuantWeights, QuantizationConfig, TextConfig, VisionConfig};

use super::tokenizer::SpecialTokens;
use super::SynthError;

/// A named starting configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Preset {
    /// Spec §6 tiny: hidden 128, 9 layers, vocab 1024 (the configuration of golden tiny-a).
    Tiny,
    /// Spec §6 small: hidden 1024, 17 layers, 64 experts, vocab 163840 (≈ 1.45 GB).
    Small,
    /// Spec §6 medium: K3's per-layer shapes, 13 layers, 256 experts (≈ 74 GB).
    Medium,
    /// The released Kimi K3 dimensions (93 layers, 896 experts; ≈ 1.56 TB — use overrides or
    /// config-only output).
    K3,
}

impl Preset {
    pub const ALL: [Preset; 4] = [Preset::Tiny, Preset::Small, Preset::Medium, Preset::K3];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::Medium => "medium",
            Preset::K3 => "k3",
        }
    }
}

impl std::str::FromStr for Preset {
    type Err = SynthError;
    fn from_str(s: &str) -> Result<Self, SynthError> {
        Preset::ALL.into_iter().find(|p| p.name().eq_ignore_ascii_case(s)).ok_or_else(|| SynthError::UnknownPreset(s.to_string()))
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-field overrides applied on top of a preset. `None` keeps the preset's value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    /// `num_hidden_layers`. The MLA layers default to every 4th layer (1-based) plus the last.
    pub layers: Option<usize>,
    /// 1-based MLA ("full attention") layers; all other layers become KDA.
    pub full_attn_layers: Option<Vec<usize>>,
    pub hidden: Option<usize>,
    /// Sets both the KDA and the MLA head counts.
    pub heads: Option<usize>,
    pub kda_heads: Option<usize>,
    pub kda_head_dim: Option<usize>,
    pub mla_heads: Option<usize>,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: Option<usize>,
    pub qk_nope_head_dim: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub v_head_dim: Option<usize>,
    pub conv_kernel: Option<usize>,
    /// Dense FFN width of the first `first_k_dense` layers.
    pub intermediate: Option<usize>,
    pub first_k_dense: Option<usize>,
    pub experts: Option<usize>,
    pub experts_per_token: Option<usize>,
    pub shared_experts: Option<usize>,
    pub moe_intermediate: Option<usize>,
    /// `routed_expert_hidden_size` (the latent width of the routed experts).
    pub latent: Option<usize>,
    /// `attn_res_block_size`.
    pub block_size: Option<usize>,
    pub vocab: Option<usize>,
    pub vision_layers: Option<usize>,
    pub vision_hidden: Option<usize>,
    pub vision_heads: Option<usize>,
    /// `qkv_hidden_size` of the vision attention.
    pub vision_qkv: Option<usize>,
    pub vision_intermediate: Option<usize>,
    /// Side of the learned vision position table (`init_pos_emb_height = width`).
    pub vision_pos: Option<usize>,
}

/// The values a preset fixes before overrides.
struct Dims {
    hidden: usize,
    layers: usize,
    kda_heads: usize,
    kda_head_dim: usize,
    mla_heads: usize,
    q_lora: usize,
    kv_lora: usize,
    nope: usize,
    rope: usize,
    v: usize,
    intermediate: usize,
    experts: usize,
    per_token: usize,
    shared: usize,
    moe_inter: usize,
    latent: usize,
    block: usize,
    vocab: usize,
    vt_hidden: usize,
    vt_heads: usize,
    vt_qkv: usize,
    vt_inter: usize,
    vt_layers: usize,
    vt_pos: usize,
}

fn dims(p: Preset) -> Dims {
    match p {
        Preset::Tiny => Dims {
            hidden: 128,
            layers: 9,
            kda_heads: 2,
            kda_head_dim: 32,
            mla_heads: 2,
            q_lora: 96,
            kv_lora: 64,
            nope: 32,
            rope: 16,
            v: 32,
            intermediate: 384,
            experts: 16,
            per_token: 4,
            shared: 2,
            moe_inter: 64,
            latent: 64,
            block: 3,
            vocab: 1024,
            vt_hidden: 64,
            vt_heads: 2,
            vt_qkv: 64,
            vt_inter: 128,
            vt_layers: 2,
            vt_pos: 8,
        },
        Preset::Small => Dims {
            hidden: 1024,
            layers: 17,
            kda_heads: 8,
            kda_head_dim: 128,
            mla_heads: 8,
            q_lora: 384,
            kv_lora: 512,
            nope: 128,
            rope: 64,
            v: 128,
            intermediate: 4864,
            experts: 64,
            per_token: 8,
            shared: 2,
            moe_inter: 512,
            latent: 512,
            block: 4,
            vocab: 163840,
            vt_hidden: 1024,
            vt_heads: 12,
            vt_qkv: 1536,
            vt_inter: 4096,
            vt_layers: 4,
            vt_pos: 64,
        },
        Preset::Medium | Preset::K3 => Dims {
            hidden: 7168,
            layers: if p == Preset::K3 { 93 } else { 13 },
            kda_heads: 96,
            kda_head_dim: 128,
            mla_heads: 96,
            q_lora: 1536,
            kv_lora: 512,
            nope: 128,
            rope: 64,
            v: 128,
            intermediate: 33792,
            experts: if p == Preset::K3 { 896 } else { 256 },
            per_token: 16,
            shared: 2,
            moe_inter: 3072,
            latent: 3584,
            block: 12,
            vocab: 163840,
            vt_hidden: 1024,
            vt_heads: 12,
            vt_qkv: 1536,
            vt_inter: 4096,
            vt_layers: 27,
            vt_pos: 64,
        },
    }
}

/// The default 1-based MLA layers of an `n`-layer model: every 4th layer plus the last.
pub fn default_full_attn_layers(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (1..=n).filter(|l| l % 4 == 0).collect();
    if n > 0 && v.last() != Some(&n) {
        v.push(n);
    }
    v
}

/// The release's compressed-tensors MXFP4 scheme (spec §2.3).
pub fn release_quantization_config() -> QuantizationConfig {
    let weights = QuantWeights {
        num_bits: 4,
        kind: "float".into(),
        strategy: "group".into(),
        group_size: 32,
        symmetric: true,
        scale_dtype: Some("torch.uint8".into()),
        dynamic: false,
        observer: Some("minmax".into()),
        actorder: None,
        block_structure: None,
        observer_kwargs: Some(serde_json::json!({})),
        zp_dtype: None,
    };
    let group =
        QuantGroup { format: Some("mxfp4-pack-quantized".into()), targets: vec!["Linear".into()], weights, input_activations: None, output_activations: None };
    QuantizationConfig {
        quant_method: "compressed-tensors".into(),
        format: "mxfp4-pack-quantized".into(),
        config_groups: BTreeMap::from([("group_0".to_string(), group)]),
        ignore: [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ]
        .map(String::from)
        .to_vec(),
        quantization_status: Some("compressed".into()),
        kv_cache_scheme: None,
        global_compression_ratio: None,
    }
}

/// The typed config of a preset with overrides applied (not yet validated).
pub fn build_config(preset: Preset, o: &Overrides) -> Result<K3Config, SynthError> {
    let d = dims(preset);
    let pick = |x: Option<usize>, dflt: usize| x.unwrap_or(dflt);
    let layers = pick(o.layers, d.layers);
    let full = o.full_attn_layers.clone().unwrap_or_else(|| default_full_attn_layers(layers));
    let kda: Vec<usize> = (1..=layers).filter(|l| !full.contains(l)).collect();
    let hidden = pick(o.hidden, d.hidden);
    let experts = pick(o.experts, d.experts);
    let vocab = pick(o.vocab, d.vocab);
    let specials = SpecialTokens::for_vocab(vocab)?;
    let vt_hidden = pick(o.vision_hidden, d.vt_hidden);
    let vt_pos = pick(o.vision_pos, d.vt_pos);
    let text = TextConfig {
        hidden_size: hidden,
        num_hidden_layers: layers,
        vocab_size: vocab,
        intermediate_size: pick(o.intermediate, d.intermediate),
        first_k_dense_replace: pick(o.first_k_dense, 1),
        moe_layer_freq: 1,
        hidden_act: "situ".into(),
        activation_situ_beta: 4.0,
        activation_situ_linear_beta: Some(25.0),
        rms_norm_eps: 1e-5,
        max_position_embeddings: 1_048_576,
        num_attention_heads: pick(o.mla_heads.or(o.heads), d.mla_heads),
        q_lora_rank: pick(o.q_lora_rank, d.q_lora),
        kv_lora_rank: pick(o.kv_lora_rank, d.kv_lora),
        qk_nope_head_dim: pick(o.qk_nope_head_dim, d.nope),
        qk_rope_head_dim: pick(o.qk_rope_head_dim, d.rope),
        v_head_dim: pick(o.v_head_dim, d.v),
        mla_use_nope: true,
        mla_use_output_gate: true,
        linear_attn_config: LinearAttnConfig {
            full_attn_layers: full,
            kda_layers: kda,
            num_heads: pick(o.kda_heads.or(o.heads), d.kda_heads),
            head_dim: pick(o.kda_head_dim, d.kda_head_dim),
            short_conv_kernel_size: pick(o.conv_kernel, 4),
            use_full_rank_gate: true,
            gate_lower_bound: Some(-5.0),
        },
        num_experts: experts,
        // Fewer experts than the preset's top-k: top-k follows unless it is set explicitly.
        num_experts_per_layer: None,
        num_experts_per_token: pick(o.experts_per_token, d.per_token.min(experts)),
        num_shared_experts: pick(o.shared_experts, d.shared),
        moe_intermediate_size: pick(o.moe_intermediate, d.moe_inter),
        routed_expert_hidden_size: pick(o.latent, d.latent),
        latent_moe_use_norm: true,
        routed_scaling_factor: 1.0,
        moe_router_activation_func: "sigmoid".into(),
        moe_renormalize: true,
        topk_method: "noaux_tc".into(),
        num_expert_group: 1,
        topk_group: 1,
        attn_res_block_size: pick(o.block_size, d.block),
        num_nextn_predict_layers: 0,
        tie_word_embeddings: false,
        quantization_config: release_quantization_config(),
    };
    let vision = VisionConfig {
        patch_size: 14,
        vt_hidden_size: vt_hidden,
        vt_num_hidden_layers: pick(o.vision_layers, d.vt_layers),
        vt_num_attention_heads: pick(o.vision_heads, d.vt_heads),
        qkv_hidden_size: pick(o.vision_qkv, d.vt_qkv),
        vt_intermediate_size: pick(o.vision_intermediate, d.vt_inter),
        activation_func: "gelu_pytorch_tanh".into(),
        norm_type: "rmsnorm".into(),
        attn_bias: false,
        linear_bias: false,
        patch_embed_proj_bias: false,
        init_pos_emb_height: vt_pos,
        init_pos_emb_width: vt_pos,
        init_pos_emb_time: 4,
        pos_emb_type: "divided_fixed".into(),
        pos_emb_interpolation_mode: "bilinear".into(),
        merge_kernel_size: [2, 2],
        merge_type: "sd2_tpool".into(),
        mm_projector_type: "patchmergerv2".into(),
        mm_hidden_size: vt_hidden,
        projector_hidden_act: "gelu".into(),
        projector_ln_eps: 1e-5,
        text_hidden_size: hidden,
        mlp_type: "mlp2".into(),
    };
    Ok(K3Config {
        architectures: vec!["KimiK3ForConditionalGeneration".into()],
        model_type: "kimi_k3".into(),
        bos_token_id: specials.bos(),
        eos_token_id: specials.eos(),
        pad_token_id: specials.pad(),
        media_placeholder_token_id: specials.media_pad(),
        image_placeholder: Some("<|kimi_image_placeholder|>".into()),
        tie_word_embeddings: false,
        text_config: text,
        vision_config: vision,
    })
}
