//! Layer weights fetched from a [`Checkpoint`] by their checkpoint names (spec §2) and made
//! resident on a backend. Names come from `k3_protocol::tensors`, dispatch by layer kind
//! (`g_proj` means the KDA output gate in KDA layers and the MLA output gate in MLA layers).

use std::borrow::Cow;

use anyhow::{ensure, Context};
use k3_protocol::config::{AttnKind, FfnKind, LayerSpec, TextConfig};
use k3_protocol::tensors::{layer_tensor, TEXT_PREFIX};
use k3_protocol::Checkpoint;

use crate::backend::{Backend, ExpertHostWeights, HostTensor};

/// Loads one dense checkpoint tensor as a `[rows, cols]` backend weight, checking its size.
pub fn load_dense<B: Backend>(b: &B, ck: &Checkpoint, name: &str, rows: usize, cols: usize) -> anyhow::Result<B::Weight> {
    let v = ck.tensor(name)?;
    ensure!(
        v.numel() == rows * cols,
        "tensor {name} in {}: shape {:?} does not hold [{rows}, {cols}]",
        v.shard,
        v.shape
    );
    let host = HostTensor { name: Cow::Borrowed(name), dtype: v.dtype, rows, cols, bytes: Cow::Borrowed(v.bytes) };
    b.load_dense(&host).with_context(|| format!("loading {name} from {}", v.shard))
}

/// AttnRes weights of one mix (`*_res_norm.weight`, `*_res_proj.weight`).
pub struct ResWeights<B: Backend> {
    pub norm: B::Weight,
    pub proj: B::Weight,
}

pub struct KdaWeights<B: Backend> {
    pub q_proj: B::Weight,
    pub k_proj: B::Weight,
    pub v_proj: B::Weight,
    pub q_conv: B::Weight,
    pub k_conv: B::Weight,
    pub v_conv: B::Weight,
    pub f_a: B::Weight,
    pub f_b: B::Weight,
    pub dt_bias: B::Weight,
    /// One value per head: the first `num_heads` entries of the stored `[head_dim]` tensor.
    pub a_log: B::Weight,
    /// Host copies of the stored `A_log` (all entries) and `dt_bias`, for the planted
    /// per-channel misread only.
    #[doc(hidden)]
    pub a_log_stored: Vec<f32>,
    #[doc(hidden)]
    pub dt_bias_host: Vec<f32>,
    pub b_proj: B::Weight,
    pub g_proj: B::Weight,
    pub o_norm: B::Weight,
    pub o_proj: B::Weight,
}

pub struct MlaWeights<B: Backend> {
    pub q_a: B::Weight,
    pub q_a_norm: B::Weight,
    pub q_b: B::Weight,
    pub kv_a: B::Weight,
    pub kv_a_norm: B::Weight,
    pub kv_b: B::Weight,
    pub g_proj: B::Weight,
    pub o_proj: B::Weight,
}

pub enum AttnWeights<B: Backend> {
    Kda(KdaWeights<B>),
    Mla(MlaWeights<B>),
}

/// A SiTU-GLU MLP (`gate_proj`, `up_proj`, `down_proj`): the dense FFN and the shared experts.
pub struct MlpWeights<B: Backend> {
    pub gate: B::Weight,
    pub up: B::Weight,
    pub down: B::Weight,
}

pub struct MoeWeights<B: Backend> {
    pub router: B::Weight,
    pub router_bias: B::Weight,
    pub latent_down: B::Weight,
    pub latent_norm: B::Weight,
    pub latent_up: B::Weight,
    pub shared: MlpWeights<B>,
    pub experts: B::Experts,
}

pub enum FfnWeights<B: Backend> {
    Dense(MlpWeights<B>),
    LatentMoe(MoeWeights<B>),
}

/// Everything one decoder layer reads.
pub struct LayerWeights<B: Backend> {
    pub spec: LayerSpec,
    pub input_layernorm: B::Weight,
    pub post_attention_layernorm: B::Weight,
    pub attn_res: ResWeights<B>,
    pub mlp_res: ResWeights<B>,
    pub attn: AttnWeights<B>,
    pub ffn: FfnWeights<B>,
}

/// The output side: output AttnRes mix, final norm, `lm_head`.
pub struct HeadWeights<B: Backend> {
    pub output_res: ResWeights<B>,
    pub norm: B::Weight,
    pub lm_head: B::Weight,
}

fn mlp<B: Backend>(b: &B, ck: &Checkpoint, prefix: &str, width: usize, h: usize) -> anyhow::Result<MlpWeights<B>> {
    Ok(MlpWeights {
        gate: load_dense(b, ck, &format!("{prefix}.gate_proj.weight"), width, h)?,
        up: load_dense(b, ck, &format!("{prefix}.up_proj.weight"), width, h)?,
        down: load_dense(b, ck, &format!("{prefix}.down_proj.weight"), h, width)?,
    })
}

impl<B: Backend> LayerWeights<B> {
    /// Loads layer `spec.index` as `spec` says it is (KDA or MLA, dense or latent MoE).
    pub fn load(b: &B, ck: &Checkpoint, c: &TextConfig, spec: LayerSpec) -> anyhow::Result<Self> {
        let l = spec.index;
        let h = c.hidden_size;
        let t = |s: &str| layer_tensor(l, s);
        let d = |s: &str, rows: usize, cols: usize| load_dense(b, ck, &t(s), rows, cols);
        let attn = match spec.attn {
            AttnKind::Kda => {
                let la = &c.linear_attn_config;
                let w = c.kda_width();
                let kern = la.short_conv_kernel_size;
                let a_name = t("self_attn.A_log");
                let a_heads = ck.f32_prefix(&a_name, la.num_heads)?;
                let a_log_stored = ck.tensor(&a_name)?.to_f32()?;
                AttnWeights::Kda(KdaWeights {
                    q_proj: d("self_attn.q_proj.weight", w, h)?,
                    k_proj: d("self_attn.k_proj.weight", w, h)?,
                    v_proj: d("self_attn.v_proj.weight", w, h)?,
                    q_conv: d("self_attn.q_conv1d.weight", w, kern)?,
                    k_conv: d("self_attn.k_conv1d.weight", w, kern)?,
                    v_conv: d("self_attn.v_conv1d.weight", w, kern)?,
                    f_a: d("self_attn.f_a_proj.weight", la.head_dim, h)?,
                    f_b: d("self_attn.f_b_proj.weight", w, la.head_dim)?,
                    dt_bias: d("self_attn.dt_bias", 1, w)?,
                    a_log: b.load_dense(&HostTensor::from_f32(a_name.clone(), 1, la.num_heads, &a_heads))?,
                    a_log_stored,
                    dt_bias_host: ck.tensor(&t("self_attn.dt_bias"))?.to_f32()?,
                    b_proj: d("self_attn.b_proj.weight", la.num_heads, h)?,
                    g_proj: d("self_attn.g_proj.weight", w, h)?,
                    o_norm: d("self_attn.o_norm.weight", 1, la.head_dim)?,
                    o_proj: d("self_attn.o_proj.weight", h, w)?,
                })
            }
            AttnKind::Mla => {
                let nh = c.num_attention_heads;
                AttnWeights::Mla(MlaWeights {
                    q_a: d("self_attn.q_a_proj.weight", c.q_lora_rank, h)?,
                    q_a_norm: d("self_attn.q_a_layernorm.weight", 1, c.q_lora_rank)?,
                    q_b: d("self_attn.q_b_proj.weight", nh * c.mla_qk_head_dim(), c.q_lora_rank)?,
                    kv_a: d("self_attn.kv_a_proj_with_mqa.weight", c.mla_latent_width(), h)?,
                    kv_a_norm: d("self_attn.kv_a_layernorm.weight", 1, c.kv_lora_rank)?,
                    kv_b: d("self_attn.kv_b_proj.weight", nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)?,
                    g_proj: d("self_attn.g_proj.weight", nh * c.v_head_dim, h)?,
                    o_proj: d("self_attn.o_proj.weight", h, nh * c.v_head_dim)?,
                })
            }
        };
        let ffn = match spec.ffn {
            FfnKind::Dense => FfnWeights::Dense(mlp(b, ck, &t("mlp"), c.intermediate_size, h)?),
            FfnKind::LatentMoe => {
                let lat = c.routed_expert_hidden_size;
                let ne = c.num_experts;
                let mut host = Vec::with_capacity(ne);
                for e in 0..ne {
                    host.push(ExpertHostWeights { w1: ck.expert(l, e, "w1")?, w3: ck.expert(l, e, "w3")?, w2: ck.expert(l, e, "w2")? });
                }
                FfnWeights::LatentMoe(MoeWeights {
                    router: d("block_sparse_moe.gate.weight", ne, h)?,
                    router_bias: d("block_sparse_moe.gate.e_score_correction_bias", 1, ne)?,
                    latent_down: d("block_sparse_moe.routed_expert_down_proj.weight", lat, h)?,
                    latent_norm: d("block_sparse_moe.routed_expert_norm.weight", 1, lat)?,
                    latent_up: d("block_sparse_moe.routed_expert_up_proj.weight", h, lat)?,
                    shared: mlp(b, ck, &t("block_sparse_moe.shared_experts"), c.shared_expert_width(), h)?,
                    experts: b.load_experts(&host).with_context(|| format!("layer {l}: routed experts"))?,
                })
            }
        };
        Ok(LayerWeights {
            spec,
            input_layernorm: d("input_layernorm.weight", 1, h)?,
            post_attention_layernorm: d("post_attention_layernorm.weight", 1, h)?,
            attn_res: ResWeights { norm: d("self_attention_res_norm.weight", 1, h)?, proj: d("self_attention_res_proj.weight", 1, h)? },
            mlp_res: ResWeights { norm: d("mlp_res_norm.weight", 1, h)?, proj: d("mlp_res_proj.weight", 1, h)? },
            attn,
            ffn,
        })
    }
}

impl<B: Backend> HeadWeights<B> {
    pub fn load(b: &B, ck: &Checkpoint, c: &TextConfig) -> anyhow::Result<Self> {
        let h = c.hidden_size;
        let g = |s: &str, rows: usize, cols: usize| load_dense(b, ck, &format!("{TEXT_PREFIX}{s}"), rows, cols);
        Ok(HeadWeights {
            output_res: ResWeights {
                norm: g("model.output_attn_res_norm.weight", 1, h)?,
                proj: g("model.output_attn_res_proj.weight", 1, h)?,
            },
            norm: g("model.norm.weight", 1, h)?,
            lm_head: g("lm_head.weight", c.vocab_size, h)?,
        })
    }
}
