//! The canonical prefill → decode hand-off state (spec §4, ARCHITECTURE.md):
//! KDA recurrent `[heads, k, v]` fp32; conv windows = the last `kernel-1` pre-conv projected
//! inputs, oldest first, `[kernel-1, heads*head_dim]`; MLA rows = post-norm `c_kv` then raw
//! `k_pe`, `[tokens, kv_lora + rope]`. Also the session file: the state as safetensors with the
//! golden tensor names plus metadata.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype as StDtype, TensorView as StView};

use crate::config::{AttnKind, TextConfig};
use crate::fingerprint::Fingerprint;

/// State of one KDA layer after some tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct KdaState {
    pub heads: usize,
    pub head_dim: usize,
    /// `[heads, k, v]`, fp32.
    pub recurrent: Vec<f32>,
    /// `[window, heads*head_dim]` each, oldest first; zeros on the old side for short prompts.
    pub conv_q: Vec<f32>,
    pub conv_k: Vec<f32>,
    pub conv_v: Vec<f32>,
}

/// Latent rows of one MLA layer, one per token seen.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaState {
    /// `kv_lora_rank + qk_rope_head_dim`.
    pub width: usize,
    /// `[rows, width]`.
    pub latent: Vec<f32>,
}

impl MlaState {
    pub fn rows(&self) -> usize {
        self.latent.len().checked_div(self.width).unwrap_or(0)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaState),
}

/// The whole hand-off state of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct HandoffState {
    /// Tokens consumed so far.
    pub tokens: usize,
    /// One entry per decoder layer, in order.
    pub layers: Vec<LayerState>,
}

#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    #[error("session file {path}: {msg}")]
    File { path: String, msg: String },
}

impl KdaState {
    pub fn zeros(c: &TextConfig) -> Self {
        let la = &c.linear_attn_config;
        let w = c.kda_width();
        let win = c.conv_window();
        KdaState {
            heads: la.num_heads,
            head_dim: la.head_dim,
            recurrent: vec![0.0; la.num_heads * la.head_dim * la.head_dim],
            conv_q: vec![0.0; win * w],
            conv_k: vec![0.0; win * w],
            conv_v: vec![0.0; win * w],
        }
    }
}

impl HandoffState {
    /// The empty state (no tokens) for a model.
    pub fn empty(c: &TextConfig) -> Self {
        let layers = c
            .layer_plan()
            .iter()
            .map(|s| match s.attn {
                AttnKind::Kda => LayerState::Kda(KdaState::zeros(c)),
                AttnKind::Mla => LayerState::Mla(MlaState { width: c.mla_latent_width(), latent: Vec::new() }),
            })
            .collect();
        HandoffState { tokens: 0, layers }
    }

    // `HandoffState::check` (does this state fit the model?) lives in `wire::layout` beside the
    // one per-layer shape check it runs, `LayerLayout::check_state`.

    /// Total bytes of the state in fp32.
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(k) => 4 * (k.recurrent.len() + k.conv_q.len() + k.conv_k.len() + k.conv_v.len()),
                LayerState::Mla(m) => 4 * m.latent.len(),
            })
            .sum()
    }

    /// Named fp32 tensors with the golden names, e.g. `kda.0.recurrent`, `mla.3.latent`.
    pub fn named_tensors(&self) -> Vec<(String, Vec<usize>, &[f32])> {
        let mut out = Vec::new();
        for (l, st) in self.layers.iter().enumerate() {
            match st {
                LayerState::Kda(k) => {
                    out.push((format!("kda.{l}.recurrent"), vec![k.heads, k.head_dim, k.head_dim], &k.recurrent[..]));
                    let w = k.heads * k.head_dim;
                    for (n, v) in [("conv_q", &k.conv_q), ("conv_k", &k.conv_k), ("conv_v", &k.conv_v)] {
                        out.push((format!("kda.{l}.{n}"), vec![v.len() / w.max(1), w], &v[..]));
                    }
                }
                LayerState::Mla(m) => out.push((format!("mla.{l}.latent"), vec![m.rows(), m.width], &m.latent[..])),
            }
        }
        out
    }
}

/// Metadata written with a session file.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionMeta {
    pub fingerprint: Fingerprint,
    pub tokens: usize,
    /// SHA-256 of the token ids (little-endian u32), hex.
    pub token_prefix_hash: String,
}

/// Version 2 adds `checksum`; version 1 files (no checksum) still load, with a warning.
pub const SESSION_FORMAT_VERSION: &str = "2";

/// SHA-256 over a session's metadata (all but `checksum`, sorted by key) and every tensor
/// (sorted by name: name, dtype, shape, bytes), hex. Stored as the `checksum` metadata entry, so
/// a flipped bit anywhere in the latent rows or the metadata is found on loading.
fn session_checksum<'a>(md: &HashMap<String, String>, tensors: impl Iterator<Item = (&'a str, String, &'a [usize], &'a [u8])>) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"k3-offload session checksum v1\n");
    let mut keys: Vec<&String> = md.keys().filter(|k| k.as_str() != "checksum").collect();
    keys.sort();
    for k in keys {
        for part in [k.as_bytes(), b"=", md[k].as_bytes(), b"\n"] {
            h.update(part);
        }
    }
    let mut ts: Vec<_> = tensors.collect();
    ts.sort_by(|a, b| a.0.cmp(b.0));
    for (name, dtype, shape, bytes) in ts {
        h.update(name.as_bytes());
        h.update([0]);
        h.update(dtype.as_bytes());
        for d in shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    hex::encode(h.finalize())
}

/// Hash of a token prefix, as carried in session files and prefill requests.
pub fn token_prefix_hash(tokens: &[u32]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    hex::encode(h.finalize())
}

fn f32_bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Writes the state (and optional extra fp32 tensors such as `logits`) as a safetensors file.
pub fn save_session(path: &Path, state: &HandoffState, meta: Option<&SessionMeta>, extra: &[(String, Vec<usize>, &[f32])]) -> Result<(), HandoffError> {
    save_session_with(path, state, meta, extra, &[])
}

/// [`save_session`] with further metadata entries (`extra_md`: key, value; covered by the
/// checksum like the rest; the keys of the format itself are refused).
pub fn save_session_with(
    path: &Path,
    state: &HandoffState,
    meta: Option<&SessionMeta>,
    extra: &[(String, Vec<usize>, &[f32])],
    extra_md: &[(&str, String)],
) -> Result<(), HandoffError> {
    let err = |msg: String| HandoffError::File { path: path.display().to_string(), msg };
    let named = state.named_tensors();
    let mut views = Vec::new();
    for (name, shape, data) in named.iter().chain(extra.iter()) {
        let v = StView::new(StDtype::F32, shape.clone(), f32_bytes(data)).map_err(|e| err(format!("{name}: {e}")))?;
        views.push((name.clone(), v));
    }
    let mut md = HashMap::new();
    md.insert("format".to_string(), "k3-offload-session".to_string());
    md.insert("format_version".to_string(), SESSION_FORMAT_VERSION.to_string());
    md.insert("tokens".to_string(), state.tokens.to_string());
    if let Some(m) = meta {
        md.insert("fingerprint".to_string(), m.fingerprint.hex());
        md.insert("token_prefix_hash".to_string(), m.token_prefix_hash.clone());
    }
    for (k, v) in extra_md {
        if md.contains_key(*k) || *k == "checksum" {
            return Err(err(format!("metadata key {k:?} belongs to the session format")));
        }
        md.insert(k.to_string(), v.clone());
    }
    let sum = session_checksum(
        &md,
        named.iter().chain(extra.iter()).map(|(n, shape, data)| (n.as_str(), format!("{:?}", StDtype::F32), &shape[..], f32_bytes(data))),
    );
    md.insert("checksum".to_string(), sum);
    safetensors::serialize_to_file(views, Some(md), path).map_err(|e| err(e.to_string()))
}

/// A loaded session file.
pub struct SessionFile {
    pub state: HandoffState,
    pub fingerprint: Option<Fingerprint>,
    pub token_prefix_hash: Option<String>,
    /// Other fp32 tensors in the file (e.g. `logits`), by name: (shape, data).
    pub extra: HashMap<String, (Vec<usize>, Vec<f32>)>,
    /// Every metadata entry of the file (the format's and those of [`save_session_with`]).
    pub metadata: HashMap<String, String>,
}

/// Loads a session file (or a golden file: the same names) for a model, checking every shape.
pub fn load_session(path: &Path, c: &TextConfig) -> Result<SessionFile, HandoffError> {
    let err = |msg: String| HandoffError::File { path: path.display().to_string(), msg };
    let bytes = {
        use std::io::Read;
        let mut f = crate::files::open_regular(path).map_err(|e| err(e.to_string()))?;
        let mut b = Vec::new();
        f.read_to_end(&mut b).map_err(|e| err(e.to_string()))?;
        b
    };
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| err(e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| err(e.to_string()))?;
    let md = header.metadata().clone().unwrap_or_default();
    let ours = md.get("format").is_some_and(|f| f == "k3-offload-session");
    match md.get("checksum") {
        Some(want) => {
            let tensors = st.tensors();
            let got = session_checksum(&md, tensors.iter().map(|(n, t)| (n.as_str(), format!("{:?}", t.dtype()), t.shape(), t.data())));
            if &got != want {
                return Err(err(format!("checksum mismatch (file says {want}, contents give {got}): the file is damaged or was edited")));
            }
        }
        None if ours && md.get("format_version").is_some_and(|v| v != "1") => {
            return Err(err("format_version 2 requires a checksum, and this file has none".into()));
        }
        None if ours => tracing::warn!(path = %path.display(), "session file of format version 1 carries no checksum; its contents are not verified"),
        None => {}
    }
    let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>, HandoffError> {
        let t = st.tensor(name).map_err(|_| err(format!("tensor {name} missing")))?;
        if t.dtype() != StDtype::F32 || t.shape() != shape {
            return Err(err(format!("tensor {name}: {:?} {:?}, expected F32 {shape:?}", t.dtype(), t.shape())));
        }
        Ok(t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    };
    let mut state = HandoffState::empty(c);
    // Token count: metadata if present, else the MLA row count.
    let mut tokens: Option<usize> = match md.get("tokens") {
        None => None,
        Some(s) => Some(s.trim().parse().map_err(|_| err(format!("metadata tokens = {s:?} is not a token count")))?),
    };
    let la = &c.linear_attn_config;
    let w = c.kda_width();
    let win = c.conv_window();
    let mut names = std::collections::HashSet::new();
    for (l, layer) in state.layers.iter_mut().enumerate() {
        match layer {
            LayerState::Kda(k) => {
                k.recurrent = get(&format!("kda.{l}.recurrent"), &[la.num_heads, la.head_dim, la.head_dim])?;
                k.conv_q = get(&format!("kda.{l}.conv_q"), &[win, w])?;
                k.conv_k = get(&format!("kda.{l}.conv_k"), &[win, w])?;
                k.conv_v = get(&format!("kda.{l}.conv_v"), &[win, w])?;
                for n in ["recurrent", "conv_q", "conv_k", "conv_v"] {
                    names.insert(format!("kda.{l}.{n}"));
                }
            }
            LayerState::Mla(m) => {
                let name = format!("mla.{l}.latent");
                let t = st.tensor(&name).map_err(|_| err(format!("tensor {name} missing")))?;
                let rows = t.shape().first().copied().unwrap_or(0);
                let n = *tokens.get_or_insert(rows);
                if rows != n {
                    return Err(err(format!("tensor {name} has {rows} rows, the session holds {n} tokens")));
                }
                m.latent = get(&name, &[n, m.width])?;
                names.insert(name);
            }
        }
    }
    state.tokens = tokens.unwrap_or(0);
    let mut extra = HashMap::new();
    for (name, t) in st.tensors() {
        if names.contains(&name) || t.dtype() != StDtype::F32 {
            continue;
        }
        let data = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        extra.insert(name, (t.shape().to_vec(), data));
    }
    Ok(SessionFile {
        state,
        fingerprint: md.get("fingerprint").and_then(|s| Fingerprint::from_hex(s)),
        token_prefix_hash: md.get("token_prefix_hash").cloned(),
        extra,
        metadata: md,
    })
}
