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

/// Ingests `delta` at `base` (see the module docs).
pub fn ingest_delta(c: &TextConfig, cache: &mut ModelCache, base: usize, delta: &HandoffState) -> Result<()> {
    if base != cache.tokens {
        return Err(IngestError::Base { base, held: cache.tokens }.into());
    }
    delta.check(c).map_err(|e| IngestError::Shape(e.to_string()))?;
    let la = &c.linear_attn_config;
    let (h, d) = (la.num_heads, la.head_dim);
    let win = [c.conv_window(), c.kda_width()];
    // Build every new array first; commit only when all layers passed.
    enum New {
        Kda(KdaCache),
        Mla(Option<Array>),
    }
    let mut staged = Vec::with_capacity(delta.layers.len());
    for (l, st) in delta.layers.iter().enumerate() {
        staged.push(match st {
            LayerState::Kda(k) => {
                finite(l, "recurrent", &k.recurrent)?;
                finite(l, "conv_q", &k.conv_q)?;
                finite(l, "conv_k", &k.conv_k)?;
                finite(l, "conv_v", &k.conv_v)?;
                New::Kda(KdaCache {
                    state: array_f32(&k.recurrent, &[h, d, d], &format!("kda.{l}.recurrent"))?,
                    conv_q: array_f32(&k.conv_q, &win, &format!("kda.{l}.conv_q"))?,
                    conv_k: array_f32(&k.conv_k, &win, &format!("kda.{l}.conv_k"))?,
                    conv_v: array_f32(&k.conv_v, &win, &format!("kda.{l}.conv_v"))?,
                })
            }
            LayerState::Mla(m) => {
                finite(l, "latent", &m.latent)?;
                let rows = m.rows();
                New::Mla((rows > 0).then(|| array_f32(&m.latent, &[rows, m.width], &format!("mla.{l}.latent"))).transpose()?)
            }
        });
    }
    for (l, (slot, new)) in cache.layers.iter_mut().zip(staged).enumerate() {
        match (slot, new) {
            (LayerCache::Kda(k), New::Kda(n)) => *k = n,
            (LayerCache::Mla(m), New::Mla(rows)) => {
                if let Some(rows) = rows {
                    m.append(&rows)?;
                }
            }
            _ => bail!("layer {l}: cache kind differs from the state's (checked above; internal error)"),
        }
    }
    cache.tokens = base + delta.tokens;
    mlx_rs::transforms::eval(cache.arrays())?;
    Ok(())
}

/// What a session file brought besides the state.
#[derive(Debug, Clone)]
pub struct IngestedSession {
    pub tokens: usize,
    /// The logits row of the last prompt position, when the file carries `logits`.
    pub last_logits: Option<Vec<f32>>,
    pub fingerprint: Option<Fingerprint>,
    pub token_prefix_hash: Option<String>,
}

/// Loads a session file (or a golden file: the same tensor names) into a fresh cache.
/// A fingerprint in the file must equal `expected`; a file without one is accepted with a warning.
pub fn ingest_session_file(
    c: &TextConfig,
    expected: &Fingerprint,
    cache: &mut ModelCache,
    path: &Path,
) -> Result<IngestedSession> {
    let file = load_session(path, c).with_context(|| format!("reading session file {}", path.display()))?;
    match &file.fingerprint {
        Some(fp) if fp != expected => {
            return Err(IngestError::Fingerprint {
                path: path.display().to_string(),
                found: fp.hex(),
                expected: expected.hex(),
            }
            .into())
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
    ingest_delta(c, cache, cache.tokens, &file.state)
        .with_context(|| format!("ingesting session file {}", path.display()))?;
    Ok(IngestedSession {
        tokens: file.state.tokens,
        last_logits,
        fingerprint: file.fingerprint,
        token_prefix_hash: file.token_prefix_hash,
    })
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
