//! Every tensor the release checkpoint holds, derived from the config (spec §2): names with
//! their prefixes, shapes and dtypes. The loader checks a checkpoint against this list and the
//! synthetic-model writer produces exactly this list.

use serde::{Deserialize, Serialize};

use crate::config::{AttnKind, FfnKind, K3Config, LayerSpec, TextConfig};

/// Storage dtypes that appear in a K3 checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    BF16,
    F32,
    U8,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 => 2,
            DType::F32 => 4,
            DType::U8 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F32 => "F32",
            DType::U8 => "U8",
        }
    }
}

/// How a tensor should be initialised by the synthetic-model recipe (spec §6).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Init {
    /// `N(0, 1/fan_in)` with `fan_in` the last dim (or product of trailing dims).
    Linear,
    /// Norm gains `U(0.5, 1.5)`.
    NormGain,
    /// `*_res_proj`: `N(0, 4/H)`.
    ResProj,
    /// `A_log`: `N(0, 0.25)` on the first `heads` entries, zero padding after.
    ALog { heads: usize },
    /// `dt_bias`: `N(0, 4)`.
    DtBias,
    /// Router correction bias `N(0, 0.05²)`.
    RouterBias,
    /// Embedding rows `N(0, 1)`.
    Embedding,
    /// Vision position table `N(0, 0.02²)`... scaled small like a learned table.
    PosEmb,
    /// MXFP4 packed nibbles of the named logical `[out, in]` weight (the pair is written together).
    Mxfp4Packed,
    /// E8M0 scales of an MXFP4 weight.
    Mxfp4Scale,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub init: Init,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
    /// The tensor viewed as a `[rows, cols]` matrix: `cols` is the last dim, `rows` the product
    /// of the others (1 for a vector).
    pub fn matrix(&self) -> (usize, usize) {
        match self.shape.split_last() {
            Some((&cols, rest)) => (rest.iter().product(), cols),
            None => (1, 1),
        }
    }
    /// A routed expert's MXFP4 nibbles or scales.
    pub fn is_expert(&self) -> bool {
        matches!(self.init, Init::Mxfp4Packed | Init::Mxfp4Scale)
    }
}

pub const TEXT_PREFIX: &str = "language_model.";

/// Name of a text-tower tensor from its suffix, e.g. `model.norm.weight`.
pub fn text_tensor(suffix: &str) -> String {
    format!("{TEXT_PREFIX}{suffix}")
}

/// Name of a per-layer text tensor: `language_model.model.layers.{l}.{suffix}`.
pub fn layer_tensor(l: usize, suffix: &str) -> String {
    format!("{TEXT_PREFIX}model.layers.{l}.{suffix}")
}

/// Name of a routed expert tensor: `…block_sparse_moe.experts.{e}.{w}.{part}`.
pub fn expert_tensor(l: usize, e: usize, w: &str, part: &str) -> String {
    layer_tensor(l, &format!("block_sparse_moe.experts.{e}.{w}.{part}"))
}

fn t(name: String, shape: &[usize], dtype: DType, init: Init) -> TensorSpec {
    TensorSpec { name, shape: shape.to_vec(), dtype, init }
}

/// Tensors of one decoder layer, in checkpoint order: [`layer_dense_tensors`], then the
/// routed experts.
pub fn layer_tensors(c: &TextConfig, l: usize) -> Vec<TensorSpec> {
    let spec = c.layer_plan()[l];
    let mut v = layer_dense_tensors(c, spec);
    if spec.ffn == FfnKind::LatentMoe {
        let (lat, mi) = (c.routed_expert_hidden_size, c.moe_intermediate_size);
        for e in 0..c.experts_in_layer(l) {
            for (w, out, inp) in [("w1", mi, lat), ("w2", lat, mi), ("w3", mi, lat)] {
                v.push(t(expert_tensor(l, e, w, "weight_packed"), &[out, inp / 2], DType::U8, Init::Mxfp4Packed));
                v.push(t(expert_tensor(l, e, w, "weight_scale"), &[out, inp / 32], DType::U8, Init::Mxfp4Scale));
            }
        }
    }
    v
}

/// Every tensor of layer `spec.index` but the routed experts, as a layer of kind `spec` has
/// them, in checkpoint order.
pub fn layer_dense_tensors(c: &TextConfig, spec: LayerSpec) -> Vec<TensorSpec> {
    use DType::*;
    let h = c.hidden_size;
    let l = spec.index;
    let mut v = Vec::new();
    let lt = |s: &str| layer_tensor(l, s);
    v.push(t(lt("input_layernorm.weight"), &[h], BF16, Init::NormGain));
    v.push(t(lt("post_attention_layernorm.weight"), &[h], BF16, Init::NormGain));
    v.push(t(lt("self_attention_res_norm.weight"), &[h], BF16, Init::NormGain));
    v.push(t(lt("self_attention_res_proj.weight"), &[1, h], BF16, Init::ResProj));
    v.push(t(lt("mlp_res_norm.weight"), &[h], BF16, Init::NormGain));
    v.push(t(lt("mlp_res_proj.weight"), &[1, h], BF16, Init::ResProj));
    match spec.attn {
        AttnKind::Kda => {
            let la = &c.linear_attn_config;
            let w = c.kda_width();
            let k = la.short_conv_kernel_size;
            for p in ["q", "k", "v"] {
                v.push(t(lt(&format!("self_attn.{p}_proj.weight")), &[w, h], BF16, Init::Linear));
            }
            for p in ["q", "k", "v"] {
                v.push(t(lt(&format!("self_attn.{p}_conv1d.weight")), &[w, 1, k], F32, Init::Linear));
            }
            v.push(t(lt("self_attn.f_a_proj.weight"), &[la.head_dim, h], BF16, Init::Linear));
            v.push(t(lt("self_attn.f_b_proj.weight"), &[w, la.head_dim], BF16, Init::Linear));
            v.push(t(lt("self_attn.dt_bias"), &[w], F32, Init::DtBias));
            v.push(t(lt("self_attn.A_log"), &[la.head_dim.max(la.num_heads)], F32, Init::ALog { heads: la.num_heads }));
            v.push(t(lt("self_attn.b_proj.weight"), &[la.num_heads, h], BF16, Init::Linear));
            v.push(t(lt("self_attn.g_proj.weight"), &[w, h], BF16, Init::Linear));
            v.push(t(lt("self_attn.o_norm.weight"), &[la.head_dim], F32, Init::NormGain));
            v.push(t(lt("self_attn.o_proj.weight"), &[h, w], BF16, Init::Linear));
        }
        AttnKind::Mla => {
            let nh = c.num_attention_heads;
            let qk = c.mla_qk_head_dim();
            v.push(t(lt("self_attn.q_a_proj.weight"), &[c.q_lora_rank, h], BF16, Init::Linear));
            v.push(t(lt("self_attn.q_a_layernorm.weight"), &[c.q_lora_rank], BF16, Init::NormGain));
            v.push(t(lt("self_attn.q_b_proj.weight"), &[nh * qk, c.q_lora_rank], BF16, Init::Linear));
            v.push(t(lt("self_attn.kv_a_proj_with_mqa.weight"), &[c.mla_latent_width(), h], BF16, Init::Linear));
            v.push(t(lt("self_attn.kv_a_layernorm.weight"), &[c.kv_lora_rank], BF16, Init::NormGain));
            v.push(t(lt("self_attn.kv_b_proj.weight"), &[nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank], BF16, Init::Linear));
            v.push(t(lt("self_attn.g_proj.weight"), &[nh * c.v_head_dim, h], BF16, Init::Linear));
            v.push(t(lt("self_attn.o_proj.weight"), &[h, nh * c.v_head_dim], BF16, Init::Linear));
        }
    }
    match spec.ffn {
        FfnKind::Dense => {
            let i = c.intermediate_size;
            v.push(t(lt("mlp.gate_proj.weight"), &[i, h], BF16, Init::Linear));
            v.push(t(lt("mlp.up_proj.weight"), &[i, h], BF16, Init::Linear));
            v.push(t(lt("mlp.down_proj.weight"), &[h, i], BF16, Init::Linear));
        }
        FfnKind::LatentMoe => {
            let ne = c.experts_in_layer(spec.index);
            let lat = c.routed_expert_hidden_size;
            let sw = c.shared_expert_width();
            let m = |s: &str| lt(&format!("block_sparse_moe.{s}"));
            v.push(t(m("gate.weight"), &[ne, h], BF16, Init::Linear));
            v.push(t(m("gate.e_score_correction_bias"), &[ne], F32, Init::RouterBias));
            v.push(t(m("routed_expert_down_proj.weight"), &[lat, h], BF16, Init::Linear));
            v.push(t(m("routed_expert_norm.weight"), &[lat], BF16, Init::NormGain));
            v.push(t(m("routed_expert_up_proj.weight"), &[h, lat], BF16, Init::Linear));
            v.push(t(m("shared_experts.gate_proj.weight"), &[sw, h], BF16, Init::Linear));
            v.push(t(m("shared_experts.up_proj.weight"), &[sw, h], BF16, Init::Linear));
            v.push(t(m("shared_experts.down_proj.weight"), &[h, sw], BF16, Init::Linear));
        }
    }
    v
}

/// Global text tensors (embedding, head, final norm, output AttnRes mix).
pub fn global_text_tensors(c: &TextConfig) -> Vec<TensorSpec> {
    use DType::*;
    let h = c.hidden_size;
    vec![
        t(text_tensor("model.embed_tokens.weight"), &[c.vocab_size, h], BF16, Init::Embedding),
        t(text_tensor("lm_head.weight"), &[c.vocab_size, h], BF16, Init::Linear),
        t(text_tensor("model.norm.weight"), &[h], BF16, Init::NormGain),
        t(text_tensor("model.output_attn_res_norm.weight"), &[h], BF16, Init::NormGain),
        t(text_tensor("model.output_attn_res_proj.weight"), &[1, h], BF16, Init::ResProj),
    ]
}

/// Vision tower and projector tensors (spec §2.4), all BF16.
pub fn vision_tensors(cfg: &K3Config) -> Vec<TensorSpec> {
    use DType::*;
    let v = &cfg.vision_config;
    let d = v.vt_hidden_size;
    let p = v.patch_size;
    let mut out = vec![
        t("vision_tower.patch_embed.proj.weight".into(), &[d, 3, p, p], BF16, Init::Linear),
        t("vision_tower.patch_embed.pos_emb.weight".into(), &[v.init_pos_emb_height, v.init_pos_emb_width, d], BF16, Init::PosEmb),
    ];
    for b in 0..v.vt_num_hidden_layers {
        let n = |s: &str| format!("vision_tower.encoder.blocks.{b}.{s}");
        out.push(t(n("norm0.weight"), &[d], BF16, Init::NormGain));
        out.push(t(n("wqkv.weight"), &[3 * v.qkv_hidden_size, d], BF16, Init::Linear));
        out.push(t(n("wo.weight"), &[d, v.qkv_hidden_size], BF16, Init::Linear));
        out.push(t(n("norm1.weight"), &[d], BF16, Init::NormGain));
        out.push(t(n("mlp.fc0.weight"), &[v.vt_intermediate_size, d], BF16, Init::Linear));
        out.push(t(n("mlp.fc1.weight"), &[d, v.vt_intermediate_size], BF16, Init::Linear));
    }
    out.push(t("vision_tower.encoder.final_layernorm.weight".into(), &[d], BF16, Init::NormGain));
    let m = v.merge_kernel_size[0] * v.merge_kernel_size[1] * v.mm_hidden_size;
    out.push(t("mm_projector.proj.0.weight".into(), &[m, m], BF16, Init::Linear));
    out.push(t("mm_projector.proj.2.weight".into(), &[v.text_hidden_size, m], BF16, Init::Linear));
    out.push(t("mm_projector.post_norm.weight".into(), &[v.text_hidden_size], BF16, Init::NormGain));
    out
}

/// Every tensor of the checkpoint, in writing order: globals, layers, vision.
pub fn all_tensors(cfg: &K3Config) -> Vec<TensorSpec> {
    let c = &cfg.text_config;
    let mut v = global_text_tensors(c);
    for l in 0..c.num_hidden_layers {
        v.extend(layer_tensors(c, l));
    }
    v.extend(vision_tensors(cfg));
    v
}

/// Sizes derived from the config (spec §1.2 and §4), for `inspect`.
#[derive(Debug, Clone, Serialize)]
pub struct DerivedSizes {
    pub routed_expert_params: u128,
    pub other_text_params: u128,
    pub vision_params: u128,
    pub total_params: u128,
    pub active_params_per_token: u128,
    pub bytes_per_expert: u64,
    pub expert_bytes_per_moe_layer: u64,
    pub checkpoint_bytes: u64,
    pub mla_state_bytes_per_token_bf16: u64,
    pub kda_state_bytes_fp32: u64,
    pub conv_window_bytes_bf16: u64,
}

impl DerivedSizes {
    pub fn of(cfg: &K3Config) -> Self {
        let c = &cfg.text_config;
        let mut routed = 0u128;
        let mut other = 0u128;
        let mut bytes = 0u64;
        let mut expert_bytes = 0u64;
        let plan = c.layer_plan();
        let first_moe = plan.iter().find(|s| s.ffn == FfnKind::LatentMoe).map(|s| s.index);
        for spec in global_text_tensors(c).into_iter().chain((0..c.num_hidden_layers).flat_map(|l| layer_tensors(c, l))) {
            bytes += spec.nbytes() as u64;
            match spec.init {
                Init::Mxfp4Packed => routed += spec.numel() as u128 * 2,
                Init::Mxfp4Scale => {}
                _ => other += spec.numel() as u128,
            }
        }
        let mut per_expert = 0u64;
        if let Some(l) = first_moe {
            expert_bytes = layer_tensors(c, l).iter().filter(|s| s.is_expert()).map(|s| s.nbytes() as u64).sum();
            per_expert = expert_bytes / c.experts_in_layer(l).max(1) as u64;
        }
        let vision: u128 = vision_tensors(cfg).iter().map(|s| s.numel() as u128).sum();
        bytes += vision_tensors(cfg).iter().map(|s| s.nbytes() as u64).sum::<u64>();
        let n_moe = plan.iter().filter(|s| s.ffn == FfnKind::LatentMoe).count() as u128;
        let per_expert_params = 3 * c.moe_intermediate_size as u128 * c.routed_expert_hidden_size as u128;
        let active = other + n_moe * c.num_experts_per_token as u128 * per_expert_params;
        let n_mla = c.mla_layers().len() as u64;
        let n_kda = c.kda_layers().len() as u64;
        let la = &c.linear_attn_config;
        DerivedSizes {
            routed_expert_params: routed,
            other_text_params: other,
            vision_params: vision,
            total_params: routed + other + vision,
            active_params_per_token: active,
            bytes_per_expert: per_expert,
            expert_bytes_per_moe_layer: expert_bytes,
            checkpoint_bytes: bytes,
            mla_state_bytes_per_token_bf16: n_mla * c.mla_latent_width() as u64 * 2,
            kda_state_bytes_fp32: n_kda * (la.num_heads * la.head_dim * la.head_dim) as u64 * 4,
            conv_window_bytes_bf16: n_kda * 3 * (c.conv_window() * c.kda_width()) as u64 * 2,
        }
    }
}
