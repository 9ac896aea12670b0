//! State ingestion: a hand-off state (from a session file or assembled by the prefill client)
//! into the MLX caches, and back out (for session files and parity checks).
//!
//! A *delta* is a [`HandoffState`] whose `tokens` counts the NEW tokens it covers: its MLA
//! latents hold exactly those rows and its KDA entries are the full states after them. Ingesting
//! it at `base` (= the tokens the session already holds) appends the rows and replaces the KDA
//! states. A whole state is the delta at base 0. Everything is checked (layer kinds, shapes,
//! finite values, base, fingerprint) before anything in the cache changes: no partial state.

use std::path::Path;

use anyhow::{bail, Context, Result};
use k3_protocol::config::TextConfig;
use k3_protocol::handoff::{load_session, HandoffState, KdaState, LayerState, MlaState};
use k3_protocol::wire::{LayerLayout, StateLayout};
use k3_protocol::Fingerprint;
use mlx_rs::Array;

use crate::mlx::{array_f32, to_vec_f32};
use crate::model::{KdaCache, LayerCache, ModelCache};

/// Why a state was refused.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("hand-off state starts at token {base}, the session holds {held} tokens")]
    Base { base: usize, held: usize },
    #[error("hand-off state does not fit the model: {0}")]
    Shape(String),
    #[error("hand-off state layer {layer} ({tensor}) holds a non-finite value at index {index}")]
    NonFinite { layer: usize, tensor: &'static str, index: usize },
    #[error("session file {path} was made by model {found}, this is model {expected}")]
    Fingerprint { path: String, found: String, expected: String },
}

fn finite(layer: usize, tensor: &'static str, v: &[f32]) -> Result<(), IngestError> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(IngestError::NonFinite { layer, tensor, index }),
        None => Ok(()),
    }
}

/// One layer of a delta, checked and in MLX arrays.
enum StagedLayer {
    Kda(KdaCache),
    /// The new latent rows (None when the delta has none).
    Mla(Option<Array>),
}

/// A delta being checked and copied into MLX arrays layer by layer, in any order (a remote
/// transfer hands over each layer as it arrives verified, so the copy overlaps the transfer of
/// later layers). Nothing reaches a session until [`StagedDelta::commit`]: a delta that fails
/// half-way is dropped with its arrays, and no partial state is ever used.
pub struct StagedDelta {
    rows: usize,
    layout: StateLayout,
    layers: Vec<Option<StagedLayer>>,
}

impl StagedDelta {
    /// A delta of `rows` new tokens for the model `c`.
    pub fn new(c: &TextConfig, rows: usize) -> StagedDelta {
        let layout = StateLayout::for_model(c, rows);
        StagedDelta { rows, layers: layout.layers.iter().map(|_| None).collect(), layout }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Checks layer `layer` of the delta against the model's layout (kind, sizes, finite values)
    /// and copies it into MLX arrays.
    pub fn stage(&mut self, layer: usize, st: &LayerState) -> Result<()> {
        let Some(want) = self.layout.layers.get(layer).copied() else {
            return Err(IngestError::Shape(format!("layer {layer} is past the model's {} layers", self.layout.layers.len())).into());
        };
        if self.layers[layer].is_some() {
            return Err(IngestError::Shape(format!("layer {layer} arrived twice")).into());
        }
        want.check_state(st).map_err(|e| IngestError::Shape(format!("layer {layer}: {e}")))?;
        let l = layer;
        let staged = match (want, st) {
            (LayerLayout::Kda { heads, head_dim, window }, LayerState::Kda(k)) => {
                let (h, d, win) = (heads as usize, head_dim as usize, window as usize);
                finite(l, "recurrent", &k.recurrent)?;
                finite(l, "conv_q", &k.conv_q)?;
                finite(l, "conv_k", &k.conv_k)?;
                finite(l, "conv_v", &k.conv_v)?;
                StagedLayer::Kda(KdaCache {
                    state: array_f32(&k.recurrent, &[h, d, d], &format!("kda.{l}.recurrent"))?,
                    conv_q: array_f32(&k.conv_q, &[win, h * d], &format!("kda.{l}.conv_q"))?,
                    conv_k: array_f32(&k.conv_k, &[win, h * d], &format!("kda.{l}.conv_k"))?,
                    conv_v: array_f32(&k.conv_v, &[win, h * d], &format!("kda.{l}.conv_v"))?,
                })
            }
            (LayerLayout::Mla { width, .. }, LayerState::Mla(m)) => {
                finite(l, "latent", &m.latent)?;
                let rows = self.rows;
                StagedLayer::Mla((rows > 0).then(|| array_f32(&m.latent, &[rows, width as usize], &format!("mla.{l}.latent"))).transpose()?)
            }
            _ => return Err(IngestError::Shape(format!("layer {layer}: the state's kind differs from the model's")).into()),
        };
        self.layers[layer] = Some(staged);
        Ok(())
    }

    /// The session's cache with the delta applied at `base` (tokens the session keeps): KDA
    /// states replaced, each MLA layer's first `base` rows kept and the new rows appended. The
    /// kept rows are shared with `cache` ([`crate::model::MlaCache::fork`]), not copied; `cache` keeps its
    /// contents, so the caller swaps the result in only once it has it whole.
    pub fn commit(self, cache: &mut ModelCache, base: usize) -> Result<ModelCache> {
        let rows = self.rows;
        if cache.layers.len() != self.layers.len() {
            bail!("the delta has {} layers, the session {}", self.layers.len(), cache.layers.len());
        }
        let mut out = Vec::with_capacity(self.layers.len());
        for (l, (old, new)) in cache.layers.iter_mut().zip(self.layers).enumerate() {
            let Some(new) = new else {
                bail!("layer {l} of the delta never arrived");
            };
            out.push(match (old, new) {
                (LayerCache::Kda(_), StagedLayer::Kda(k)) => LayerCache::Kda(k),
                (LayerCache::Mla(m), StagedLayer::Mla(new_rows)) => {
                    if m.rows() < base {
                        bail!("layer {l}: the session holds {} latent rows, fewer than the delta's base {base}", m.rows());
                    }
                    let mut kept = m.fork()?;
                    kept.truncate(base)?;
                    if let Some(r) = new_rows {
                        kept.append(&r).with_context(|| format!("layer {l}: appending latent rows"))?;
                    }
                    LayerCache::Mla(kept)
                }
                _ => bail!("layer {l}: the delta's layer kind differs from the session's"),
            });
        }
        let new_cache = ModelCache { layers: out, tokens: base + rows };
        mlx_rs::transforms::eval(new_cache.arrays()).context("evaluating the ingested state")?;
        Ok(new_cache)
    }
}

/// Ingests `delta` at `base` (see the module docs).
pub fn ingest_delta(c: &TextConfig, cache: &mut ModelCache, base: usize, delta: &HandoffState) -> Result<()> {
    if base != cache.tokens {
        return Err(IngestError::Base { base, held: cache.tokens }.into());
    }
    let mut staged = StagedDelta::new(c, delta.tokens);
    if delta.layers.len() != staged.layout.layers.len() {
        return Err(IngestError::Shape(format!("{} layers in the state, {} in the model", delta.layers.len(), staged.layout.layers.len())).into());
    }
    for (l, st) in delta.layers.iter().enumerate() {
        staged.stage(l, st)?;
    }
    *cache = staged.commit(cache, base)?;
    Ok(())
}

/// What a session file brought besides the state.
#[derive(Debug, Clone)]
pub struct SessionFileInfo {
    pub tokens: usize,
    /// The logits row of the last prompt position, when the file carries `logits`.
    pub last_logits: Option<Vec<f32>>,
    pub fingerprint: Option<Fingerprint>,
    pub token_prefix_hash: Option<String>,
}

/// Loads a session file (or a golden file: the same tensor names) into a fresh cache.
/// A fingerprint in the file must equal `expected`; a file without one is accepted with a warning.
pub fn ingest_session_file(c: &TextConfig, expected: &Fingerprint, cache: &mut ModelCache, path: &Path) -> Result<SessionFileInfo> {
    let file = load_session(path, c).with_context(|| format!("reading session file {}", path.display()))?;
    match &file.fingerprint {
        Some(fp) if fp != expected => {
            return Err(IngestError::Fingerprint { path: path.display().to_string(), found: fp.hex(), expected: expected.hex() }.into())
        }
        Some(_) => {}
        None => tracing::warn!(path = %path.display(), "session file carries no model fingerprint; shapes checked only"),
    }
    let last_logits = match file.extra.get("logits") {
        Some((shape, data)) => {
            if shape.len() != 2 || shape[1] != c.vocab_size || shape[0] == 0 {
                bail!("session file {}: logits {shape:?}, expected [rows, {}]", path.display(), c.vocab_size);
            }
            let row = &data[(shape[0] - 1) * shape[1]..];
            finite(0, "logits", row)?;
            Some(row.to_vec())
        }
        None => None,
    };
    ingest_delta(c, cache, cache.tokens, &file.state).with_context(|| format!("ingesting session file {}", path.display()))?;
    Ok(SessionFileInfo { tokens: file.state.tokens, last_logits, fingerprint: file.fingerprint, token_prefix_hash: file.token_prefix_hash })
}

/// The cache as a canonical hand-off state (all rows from token 0).
pub fn export_state(c: &TextConfig, cache: &ModelCache) -> Result<HandoffState> {
    let la = &c.linear_attn_config;
    let mut layers = Vec::with_capacity(cache.layers.len());
    for lc in &cache.layers {
        layers.push(match lc {
            LayerCache::Kda(k) => LayerState::Kda(KdaState {
                heads: la.num_heads,
                head_dim: la.head_dim,
                recurrent: to_vec_f32(&k.state)?,
                conv_q: to_vec_f32(&k.conv_q)?,
                conv_k: to_vec_f32(&k.conv_k)?,
                conv_v: to_vec_f32(&k.conv_v)?,
            }),
            LayerCache::Mla(m) => LayerState::Mla(MlaState {
                width: m.width,
                latent: match m.latent()? {
                    Some(a) => to_vec_f32(&a)?,
                    None => Vec::new(),
                },
            }),
        });
    }
    Ok(HandoffState { tokens: cache.tokens, layers })
}
