//! The Kimi K3 text tower (spec §3) over the ops interface: weights fetched by checkpoint
//! names ([`weights`]), one module per block ([`kda`], [`mla`], [`ffn`]), the model-wide
//! geometry ([`ModelDims`]) and the loaded model ([`Model`]). The layer-major loop over these
//! blocks lives in [`crate::executor`].

pub mod ffn;
pub mod flops;
pub mod kda;
pub mod mla;
pub mod weights;

use std::sync::Arc;

use anyhow::{bail, Context};
use k3_protocol::config::{AttnKind, FfnKind, LayerSpec, TextConfig};
use k3_protocol::Checkpoint;

use crate::backend::{Backend, KdaDims, MlaDims, SituBetas};
pub use weights::{HeadWeights, LayerWeights};

/// Everything the block code needs from the config, in one place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelDims {
    pub hidden: usize,
    pub vocab: usize,
    /// `rms_norm_eps`: every text norm except the MLA latent norms and the KDA L2 norm.
    pub eps: f32,
    pub kda: KdaDims,
    pub conv_kernel: usize,
    /// `Some(-5.0)` in K3: the bounded decay gate.
    pub gate_lower_bound: Option<f32>,
    pub mla: MlaDims,
    pub situ: SituBetas,
    pub top_k: usize,
    pub renormalize: bool,
    pub routed_scaling: f32,
    pub latent_norm: bool,
    /// AttnRes block length in layers.
    pub block: usize,
}

impl ModelDims {
    pub fn of(c: &TextConfig) -> Self {
        let la = &c.linear_attn_config;
        ModelDims {
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            eps: c.rms_norm_eps,
            kda: KdaDims { heads: la.num_heads, head_dim: la.head_dim },
            conv_kernel: la.short_conv_kernel_size,
            gate_lower_bound: la.gate_lower_bound,
            mla: MlaDims { heads: c.num_attention_heads, nope: c.qk_nope_head_dim, rope: c.qk_rope_head_dim, v: c.v_head_dim, kv_lora: c.kv_lora_rank },
            situ: SituBetas { beta: c.activation_situ_beta, linear_beta: c.activation_situ_linear_beta },
            top_k: c.num_experts_per_token,
            renormalize: c.moe_renormalize,
            routed_scaling: c.routed_scaling_factor,
            latent_norm: c.latent_moe_use_norm,
            block: c.attn_res_block_size,
        }
    }
}

/// Deliberate misreadings of the spec, planted by tests to show that each one breaks parity
/// with the golden outputs (feature `test-knobs`: tests only).
#[cfg(feature = "test-knobs")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Misread {
    /// Read `kda_layers`/`full_attn_layers` as 0-based (`is_kda(l) ⇔ l ∈ kda_layers`).
    pub layer_lists_zero_based: bool,
    /// Bank at sublayer boundaries `(2ℓ)%B == 0` (attention) / `(2ℓ+1)%B == 0` (MLP), the FLA
    /// convention, instead of `ℓ % B == 0` in layers.
    pub bank_boundary_sublayers: bool,
    /// Feed `P` to the final norm instead of the output AttnRes mix.
    pub skip_output_mix: bool,
    /// Use `exp(A_log[d])` per key channel instead of `exp(A_log[h])` per head.
    pub a_log_per_channel: bool,
}

#[cfg(feature = "test-knobs")]
impl Misread {
    /// The layer plan as this (mis)reading derives it.
    pub fn layer_plan(&self, c: &TextConfig) -> Vec<LayerSpec> {
        let mut plan = c.layer_plan();
        if self.layer_lists_zero_based {
            let la = &c.linear_attn_config;
            for s in &mut plan {
                s.attn = if la.kda_layers.contains(&s.index) { AttnKind::Kda } else { AttnKind::Mla };
            }
        }
        plan
    }
}

/// Whether layer weights stay loaded between forwards or are fetched per layer per forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPolicy {
    /// Load every layer once (small models; repeated decode steps).
    Resident,
    /// Load each layer when the executor reaches it and drop it after (bounded memory).
    PerLayer,
}

/// A loaded K3 text tower on backend `B`.
pub struct Model<B: Backend> {
    pub backend: Arc<B>,
    pub ck: Arc<Checkpoint>,
    pub cfg: TextConfig,
    pub plan: Vec<LayerSpec>,
    pub dims: ModelDims,
    pub policy: WeightPolicy,
    #[cfg(feature = "test-knobs")]
    pub misread: Misread,
    resident: Vec<Arc<LayerWeights<B>>>,
    head: Option<Arc<HeadWeights<B>>>,
}

impl<B: Backend> Model<B> {
    /// Builds the model over an opened checkpoint; with [`WeightPolicy::Resident`] every layer
    /// is loaded now.
    pub fn new(backend: Arc<B>, ck: Arc<Checkpoint>, policy: WeightPolicy) -> anyhow::Result<Self> {
        let cfg = ck.config().text_config.clone();
        let plan = cfg.layer_plan();
        let dims = ModelDims::of(&cfg);
        let mut m = Model {
            backend,
            ck,
            cfg,
            plan,
            dims,
            policy,
            #[cfg(feature = "test-knobs")]
            misread: Misread::default(),
            resident: Vec::new(),
            head: None,
        };
        m.load_resident()?;
        Ok(m)
    }

    /// [`Model::new`] under a planted misreading (feature `test-knobs`: tests only).
    #[cfg(feature = "test-knobs")]
    pub fn with_misread(backend: Arc<B>, ck: Arc<Checkpoint>, policy: WeightPolicy, misread: Misread) -> anyhow::Result<Self> {
        let mut m = Self::new(backend, ck, WeightPolicy::PerLayer)?;
        m.plan = misread.layer_plan(&m.cfg);
        m.misread = misread;
        m.policy = policy;
        m.load_resident()?;
        Ok(m)
    }

    /// With [`WeightPolicy::Resident`], loads every layer and the head now.
    fn load_resident(&mut self) -> anyhow::Result<()> {
        if self.policy == WeightPolicy::Resident {
            let mut layers = Vec::with_capacity(self.plan.len());
            for &spec in &self.plan {
                layers.push(Arc::new(self.load_layer(spec)?));
            }
            self.resident = layers;
            self.head = Some(Arc::new(self.load_head()?));
        }
        tracing::debug!(layers = self.plan.len(), backend = self.backend.name(), policy = ?self.policy, "model ready");
        Ok(())
    }

    fn load_layer(&self, spec: LayerSpec) -> anyhow::Result<LayerWeights<B>> {
        #[allow(unused_mut)]
        let mut w = LayerWeights::load(&*self.backend, &self.ck, &self.cfg, spec).with_context(|| {
            format!(
                "layer {} ({} attention, {} FFN)",
                spec.index,
                match spec.attn {
                    AttnKind::Kda => "KDA",
                    AttnKind::Mla => "MLA",
                },
                match spec.ffn {
                    FfnKind::Dense => "dense",
                    FfnKind::LatentMoe => "latent MoE",
                }
            )
        })?;
        #[cfg(feature = "test-knobs")]
        if let (true, weights::AttnWeights::Kda(k)) = (self.misread.a_log_per_channel, &mut w.attn) {
            k.planted_gate = Some(weights::PlantedGate::load(&self.ck, spec.index)?);
        }
        Ok(w)
    }

    fn load_head(&self) -> anyhow::Result<HeadWeights<B>> {
        HeadWeights::load(&*self.backend, &self.ck, &self.cfg).context("output head")
    }

    /// The weights of layer `l` (resident, or loaded now).
    pub fn layer(&self, l: usize) -> anyhow::Result<Arc<LayerWeights<B>>> {
        if let Some(w) = self.resident.get(l) {
            return Ok(w.clone());
        }
        let Some(&spec) = self.plan.get(l) else { bail!("layer {l} does not exist ({} layers)", self.plan.len()) };
        Ok(Arc::new(self.load_layer(spec)?))
    }

    /// The output head weights (resident, or loaded now).
    pub fn head(&self) -> anyhow::Result<Arc<HeadWeights<B>>> {
        match &self.head {
            Some(h) => Ok(h.clone()),
            None => Ok(Arc::new(self.load_head()?)),
        }
    }

    /// Embedding rows `[ids.len(), hidden]` read straight from the checkpoint (the table never
    /// goes to the backend). An id outside the vocabulary is an error naming its position.
    pub fn embed_rows(&self, ids: &[u32]) -> anyhow::Result<Vec<f32>> {
        let name = k3_protocol::tensors::text_tensor("model.embed_tokens.weight");
        let v = self.ck.tensor(&name)?;
        let h = self.dims.hidden;
        let vocab = self.dims.vocab;
        let es = v.dtype.size();
        if v.numel() != vocab * h {
            bail!("tensor {name} in {}: shape {:?}, expected [{vocab}, {h}]", v.shard, v.shape);
        }
        let mut out = Vec::with_capacity(ids.len() * h);
        for (pos, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= vocab {
                bail!("token id {id} at position {pos} is outside the vocabulary (size {vocab})");
            }
            let bytes = &v.bytes[id * h * es..(id + 1) * h * es];
            match v.dtype {
                k3_protocol::tensors::DType::BF16 => out.extend(bytes.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))),
                k3_protocol::tensors::DType::F32 => out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
                k3_protocol::tensors::DType::U8 => bail!("tensor {name} is U8, expected BF16/F32"),
            }
        }
        Ok(out)
    }
}
