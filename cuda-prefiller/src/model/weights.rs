//! Layer weights fetched from a [`Checkpoint`] by their checkpoint names (spec §2) and made
//! resident on a backend. Names come from `k3_protocol::tensors`, dispatch by layer kind
//! (`g_proj` means the KDA output gate in KDA layers and the MLA output gate in MLA layers).

use std::borrow::Cow;

use anyhow::{ensure, Context};
use k3_protocol::config::{AttnKind, FfnKind, LayerSpec, TextConfig};
use k3_protocol::tensors::{self, layer_tensor, Init};
use k3_protocol::Checkpoint;

use crate::backend::{Backend, ExpertHostWeights, HostTensor};

/// Loads one dense checkpoint tensor as a `[rows, cols]` backend weight, checking its size.
pub fn load_dense<B: Backend>(b: &B, ck: &Checkpoint, name: &str, rows: usize, cols: usize) -> anyhow::Result<B::Weight> {
    let v = ck.tensor(name)?;
    ensure!(v.numel() == rows * cols, "tensor {name} in {}: shape {:?} does not hold [{rows}, {cols}]", v.shard, v.shape);
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
    /// The planted per-channel `A_log` misread (feature `test-knobs`; set by `Model` only).
    #[cfg(feature = "test-knobs")]
    pub planted_gate: Option<PlantedGate>,
    pub b_proj: B::Weight,
    pub g_proj: B::Weight,
    pub o_norm: B::Weight,
    pub o_proj: B::Weight,
}

/// The planted misread of `A_log` (feature `test-knobs`: tests only): `exp(A_log[d])` per key
/// channel `d` instead of per head, computed on the host from the stored tensors.
#[cfg(feature = "test-knobs")]
#[derive(Debug, Clone)]
pub struct PlantedGate {
    /// The stored `A_log` (all entries) and `dt_bias`.
    pub(crate) a_log: Vec<f32>,
    pub(crate) dt_bias: Vec<f32>,
}

#[cfg(feature = "test-knobs")]
impl PlantedGate {
    pub fn load(ck: &Checkpoint, l: usize) -> anyhow::Result<Self> {
        let t = |s: &str| ck.tensor(&layer_tensor(l, s))?.to_f32();
        Ok(PlantedGate { a_log: t("self_attn.A_log")?, dt_bias: t("self_attn.dt_bias")? })
    }
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
    /// The routed experts; `None` when a weight feed streams them in chunks (the layer does
    /// not fit the VRAM budget, see [`crate::executor::WeightFeed::experts_in_chunks`]).
    pub experts: Option<B::Experts>,
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

/// One dense tensor a layer reads, as the executor views it (`[rows, cols]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenseTensor {
    /// Checkpoint name.
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    /// Only the first `rows * cols` values of a longer 1-D tensor are read (`A_log`, stored
    /// padded to `head_dim`; one value per head is used, spec §3.8).
    pub prefix: bool,
}

/// Every dense tensor of layer `spec.index` (everything but the routed experts) as the executor
/// views it, in the order of [`tensors::layer_dense_tensors`], which it is derived from. The
/// synchronous loader and the weight streamer both fetch exactly this list.
pub fn layer_dense_tensors(c: &TextConfig, spec: LayerSpec) -> Vec<DenseTensor> {
    tensors::layer_dense_tensors(c, spec)
        .into_iter()
        .map(|t| match t.init {
            // Stored padded to head_dim; one value per head is read (spec §3.8).
            Init::ALog { heads } => DenseTensor { name: t.name, rows: 1, cols: heads, prefix: true },
            _ => {
                let (rows, cols) = t.matrix();
                DenseTensor { name: t.name, rows, cols, prefix: false }
            }
        })
        .collect()
}

/// The routed experts of one MoE layer in the checkpoint, as [`Backend::load_experts`] takes them.
pub fn layer_experts<'a>(ck: &'a Checkpoint, c: &TextConfig, l: usize) -> anyhow::Result<Vec<ExpertHostWeights<'a>>> {
    (0..c.experts_in_layer(l)).map(|e| Ok(ExpertHostWeights { w1: ck.expert(l, e, "w1")?, w3: ck.expert(l, e, "w3")?, w2: ck.expert(l, e, "w2")? })).collect()
}

impl<B: Backend> LayerWeights<B> {
    /// Loads layer `spec.index` as `spec` says it is (KDA or MLA, dense or latent MoE).
    pub fn load(b: &B, ck: &Checkpoint, c: &TextConfig, spec: LayerSpec) -> anyhow::Result<Self> {
        let experts = match spec.ffn {
            FfnKind::Dense => None,
            FfnKind::LatentMoe => {
                let host = layer_experts(ck, c, spec.index)?;
                Some(b.load_experts(&host).with_context(|| format!("layer {}: routed experts", spec.index))?)
            }
        };
        Self::assemble(c, spec, experts, |t| {
            if t.prefix {
                let v = ck.f32_prefix(&t.name, t.rows * t.cols)?;
                b.load_dense(&HostTensor::from_f32(t.name.clone(), t.rows, t.cols, &v))
            } else {
                load_dense(b, ck, &t.name, t.rows, t.cols)
            }
        })
    }

    /// Builds the layer from its dense tensors, each made by `weight` (called once per entry of
    /// [`layer_dense_tensors`], in order), and its routed experts (`None` for a latent MoE layer
    /// whose experts a weight feed streams in chunks).
    pub fn assemble(
        c: &TextConfig,
        spec: LayerSpec,
        experts: Option<B::Experts>,
        mut weight: impl FnMut(&DenseTensor) -> anyhow::Result<B::Weight>,
    ) -> anyhow::Result<Self> {
        let l = spec.index;
        let mut got = std::collections::HashMap::new();
        for t in layer_dense_tensors(c, spec) {
            let w = weight(&t)?;
            got.insert(t.name, w);
        }
        let mut d = |s: &str| got.remove(&layer_tensor(l, s)).with_context(|| format!("layer {l}: tensor {} was not fetched", layer_tensor(l, s)));
        let attn = match spec.attn {
            AttnKind::Kda => AttnWeights::Kda(KdaWeights {
                q_proj: d("self_attn.q_proj.weight")?,
                k_proj: d("self_attn.k_proj.weight")?,
                v_proj: d("self_attn.v_proj.weight")?,
                q_conv: d("self_attn.q_conv1d.weight")?,
                k_conv: d("self_attn.k_conv1d.weight")?,
                v_conv: d("self_attn.v_conv1d.weight")?,
                f_a: d("self_attn.f_a_proj.weight")?,
                f_b: d("self_attn.f_b_proj.weight")?,
                dt_bias: d("self_attn.dt_bias")?,
                a_log: d("self_attn.A_log")?,
                #[cfg(feature = "test-knobs")]
                planted_gate: None,
                b_proj: d("self_attn.b_proj.weight")?,
                g_proj: d("self_attn.g_proj.weight")?,
                o_norm: d("self_attn.o_norm.weight")?,
                o_proj: d("self_attn.o_proj.weight")?,
            }),
            AttnKind::Mla => AttnWeights::Mla(MlaWeights {
                q_a: d("self_attn.q_a_proj.weight")?,
                q_a_norm: d("self_attn.q_a_layernorm.weight")?,
                q_b: d("self_attn.q_b_proj.weight")?,
                kv_a: d("self_attn.kv_a_proj_with_mqa.weight")?,
                kv_a_norm: d("self_attn.kv_a_layernorm.weight")?,
                kv_b: d("self_attn.kv_b_proj.weight")?,
                g_proj: d("self_attn.g_proj.weight")?,
                o_proj: d("self_attn.o_proj.weight")?,
            }),
        };
        let ffn = match spec.ffn {
            FfnKind::Dense => {
                FfnWeights::Dense(MlpWeights { gate: d("mlp.gate_proj.weight")?, up: d("mlp.up_proj.weight")?, down: d("mlp.down_proj.weight")? })
            }
            FfnKind::LatentMoe => FfnWeights::LatentMoe(MoeWeights {
                router: d("block_sparse_moe.gate.weight")?,
                router_bias: d("block_sparse_moe.gate.e_score_correction_bias")?,
                latent_down: d("block_sparse_moe.routed_expert_down_proj.weight")?,
                latent_norm: d("block_sparse_moe.routed_expert_norm.weight")?,
                latent_up: d("block_sparse_moe.routed_expert_up_proj.weight")?,
                shared: MlpWeights {
                    gate: d("block_sparse_moe.shared_experts.gate_proj.weight")?,
                    up: d("block_sparse_moe.shared_experts.up_proj.weight")?,
                    down: d("block_sparse_moe.shared_experts.down_proj.weight")?,
                },
                experts,
            }),
        };
        Ok(LayerWeights {
            spec,
            input_layernorm: d("input_layernorm.weight")?,
            post_attention_layernorm: d("post_attention_layernorm.weight")?,
            attn_res: ResWeights { norm: d("self_attention_res_norm.weight")?, proj: d("self_attention_res_proj.weight")? },
            mlp_res: ResWeights { norm: d("mlp_res_norm.weight")?, proj: d("mlp_res_proj.weight")? },
            attn,
            ffn,
        })
    }
}

impl<B: Backend> HeadWeights<B> {
    pub fn load(b: &B, ck: &Checkpoint, c: &TextConfig) -> anyhow::Result<Self> {
        let globals = tensors::global_text_tensors(c);
        let g = |s: &str| {
            let name = tensors::text_tensor(s);
            let t = globals.iter().find(|t| t.name == name).with_context(|| format!("{name} is not a text tensor of the model"))?;
            let (rows, cols) = t.matrix();
            load_dense(b, ck, &name, rows, cols)
        };
        Ok(HeadWeights {
            output_res: ResWeights { norm: g("model.output_attn_res_norm.weight")?, proj: g("model.output_attn_res_proj.weight")? },
            norm: g("model.norm.weight")?,
            lm_head: g("lm_head.weight")?,
        })
    }
}
