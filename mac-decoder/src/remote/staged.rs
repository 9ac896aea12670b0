//! Streaming ingestion: each layer of a remote delta becomes MLX arrays the moment it arrives
//! verified (the copy overlaps the transfer of later layers), but nothing reaches the session
//! until every layer is in and the sender's totals matched; then
//! [`crate::remote::conversation::Conversation::commit_remote`] swaps the whole cache at once.
//! A transfer that fails half-way drops the staged arrays: no partial state is ever used.
//!
//! Same checks as [`crate::ingest`] (layer kind against the model's plan, sizes, finite values),
//! per layer instead of per state.

use anyhow::{bail, Result};
use k3_protocol::config::{AttnKind, TextConfig};
use k3_protocol::handoff::LayerState;
use mlx_rs::Array;

use crate::mlx::array_f32;
use crate::model::KdaCache;

/// One staged layer.
pub(crate) enum StagedLayer {
    Kda(KdaCache),
    /// The new latent rows (None when the delta has none).
    Mla(Option<Array>),
}

/// The layers of one delta, staged as they arrive.
pub(crate) struct StagedDelta {
    rows: usize,
    kinds: Vec<AttnKind>,
    layers: Vec<Option<StagedLayer>>,
    heads: usize,
    head_dim: usize,
    window: usize,
    width: usize,
    latent: usize,
}

fn finite(layer: u32, tensor: &str, v: &[f32]) -> Result<()> {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        bail!("layer {layer} {tensor}: non-finite value at index {i}");
    }
    Ok(())
}

impl StagedDelta {
    /// A delta of `rows` new tokens for the model `c`.
    pub(crate) fn new(c: &TextConfig, rows: usize) -> StagedDelta {
        let kinds: Vec<AttnKind> = c.layer_plan().iter().map(|s| s.attn).collect();
        let la = &c.linear_attn_config;
        StagedDelta {
            rows,
            layers: kinds.iter().map(|_| None).collect(),
            kinds,
            heads: la.num_heads,
            head_dim: la.head_dim,
            window: c.conv_window(),
            width: c.kda_width(),
            latent: c.mla_latent_width(),
        }
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Checks one verified layer and copies it into MLX arrays.
    pub(crate) fn stage(&mut self, layer: u32, st: LayerState) -> Result<()> {
        let l = layer as usize;
        let Some(kind) = self.kinds.get(l).copied() else {
            bail!("layer {layer} is past the model's {} layers", self.kinds.len());
        };
        if self.layers[l].is_some() {
            bail!("layer {layer} arrived twice");
        }
        let (h, d, win, w) = (self.heads, self.head_dim, self.window, self.width);
        let staged = match (kind, st) {
            (AttnKind::Kda, LayerState::Kda(k)) => {
                if k.recurrent.len() != h * d * d || [&k.conv_q, &k.conv_k, &k.conv_v].iter().any(|c| c.len() != win * w) {
                    bail!("layer {layer}: KDA state sizes differ from the model");
                }
                finite(layer, "recurrent", &k.recurrent)?;
                finite(layer, "conv_q", &k.conv_q)?;
                finite(layer, "conv_k", &k.conv_k)?;
                finite(layer, "conv_v", &k.conv_v)?;
                StagedLayer::Kda(KdaCache {
                    state: array_f32(&k.recurrent, &[h, d, d], &format!("kda.{l}.recurrent"))?,
                    conv_q: array_f32(&k.conv_q, &[win, w], &format!("kda.{l}.conv_q"))?,
                    conv_k: array_f32(&k.conv_k, &[win, w], &format!("kda.{l}.conv_k"))?,
                    conv_v: array_f32(&k.conv_v, &[win, w], &format!("kda.{l}.conv_v"))?,
                })
            }
            (AttnKind::Mla, LayerState::Mla(m)) => {
                if m.width != self.latent || m.latent.len() != self.rows * self.latent {
                    bail!(
                        "layer {layer}: {} latent values of width {}, expected {} rows × {}",
                        m.latent.len(),
                        m.width,
                        self.rows,
                        self.latent
                    );
                }
                finite(layer, "latent", &m.latent)?;
                StagedLayer::Mla(if self.rows > 0 { Some(array_f32(&m.latent, &[self.rows, self.latent], &format!("mla.{l}.latent"))?) } else { None })
            }
            (k, _) => bail!("layer {layer}: the state's kind differs from the model's {k:?} layer"),
        };
        self.layers[l] = Some(staged);
        Ok(())
    }

    /// Every layer, in order; an error names the first missing one.
    pub(crate) fn into_layers(self) -> Result<Vec<StagedLayer>> {
        self.layers
            .into_iter()
            .enumerate()
            .map(|(l, s)| s.ok_or_else(|| anyhow::anyhow!("layer {l} of the delta never arrived")))
            .collect()
    }
}
