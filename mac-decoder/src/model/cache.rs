//! Per-sequence decode state in MLX arrays, one small type per kind of layer (spec §4):
//! KDA keeps a fixed-size recurrent state and the conv windows; MLA keeps the latent rows
//! (`c_kv` post-norm then raw `k_pe`: 576 values per token in K3, never the expanded K/V).

use anyhow::Result;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array};

use k3_protocol::config::{AttnKind, TextConfig};

/// KDA layer state.
pub struct KdaCache {
    /// `[heads, k, v]` f32, canonical hand-off layout (`o = Sᵀ q`).
    pub state: Array,
    /// The last `kernel-1` pre-conv projected inputs `[window, heads*head_dim]`, oldest first.
    pub conv_q: Array,
    pub conv_k: Array,
    pub conv_v: Array,
}

impl KdaCache {
    pub fn zeros(c: &TextConfig) -> Result<Self> {
        let la = &c.linear_attn_config;
        let (h, d) = (la.num_heads as i32, la.head_dim as i32);
        let win = [c.conv_window() as i32, c.kda_width() as i32];
        Ok(KdaCache {
            state: ops::zeros::<f32>(&[h, d, d])?,
            conv_q: ops::zeros::<f32>(&win)?,
            conv_k: ops::zeros::<f32>(&win)?,
            conv_v: ops::zeros::<f32>(&win)?,
        })
    }

    fn arrays(&self) -> [&Array; 4] {
        [&self.state, &self.conv_q, &self.conv_k, &self.conv_v]
    }
}

/// MLA layer state: the latent rows of every token seen, `[rows, kv_lora_rank + qk_rope_head_dim]`.
///
/// Appending concatenates (a copy of the layer's rows per call); a buffer with spare capacity
/// would avoid it for long contexts, but code outside this module builds the struct directly
/// (`mac_decoder::remote`), so the representation stays this plain pair for now.
pub struct MlaCache {
    pub latent: Option<Array>,
    pub width: usize,
}

impl MlaCache {
    pub fn new(width: usize) -> Self {
        MlaCache { latent: None, width }
    }

    /// A cache holding `latent` `[rows, width]` (or nothing).
    pub fn from_rows(width: usize, latent: Option<Array>) -> Self {
        MlaCache { latent, width }
    }

    pub fn rows(&self) -> usize {
        self.latent.as_ref().map_or(0, |a| a.shape()[0] as usize)
    }

    /// Appends `rows` `[n, width]` and returns the whole cache.
    pub fn append(&mut self, rows: &Array) -> Result<Array> {
        let all = match &self.latent {
            None => rows.clone(),
            Some(prev) => ops::concatenate(&[prev, rows], 0)?,
        };
        self.latent = Some(all.clone());
        Ok(all)
    }

    /// Keeps the first `rows` rows (a session rewound to a shorter prefix).
    pub fn truncate(&mut self, rows: usize) -> Result<()> {
        if rows < self.rows() {
            self.latent = if rows == 0 { None } else { Some(self.latent.as_ref().expect("rows > 0").try_index(0..rows as i32)?) };
        }
        Ok(())
    }
}

pub enum LayerCache {
    Kda(KdaCache),
    Mla(MlaCache),
}

/// The state of one sequence across all layers.
pub struct ModelCache {
    pub layers: Vec<LayerCache>,
    /// Tokens consumed so far.
    pub tokens: usize,
}

impl ModelCache {
    pub fn new(c: &TextConfig) -> Result<Self> {
        let layers = c
            .layer_plan()
            .iter()
            .map(|s| {
                Ok(match s.attn {
                    AttnKind::Kda => LayerCache::Kda(KdaCache::zeros(c)?),
                    AttnKind::Mla => LayerCache::Mla(MlaCache::new(c.mla_latent_width())),
                })
            })
            .collect::<Result<_>>()?;
        Ok(ModelCache { layers, tokens: 0 })
    }

    /// Every array of the cache (to evaluate them together with the logits, so that the lazy
    /// graph never grows across steps).
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = Vec::new();
        for l in &self.layers {
            match l {
                LayerCache::Kda(k) => v.extend(k.arrays()),
                LayerCache::Mla(m) => v.extend(m.latent.as_ref()),
            }
        }
        v
    }

    /// Bytes of state the cache holds (KDA states, conv windows, MLA rows in use).
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Kda(k) => k.arrays().iter().map(|a| a.nbytes()).sum::<usize>(),
                LayerCache::Mla(m) => m.rows() * m.width * 4,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mlx::{array_f32, to_vec_f32};

    #[test]
    fn mla_rows_append_and_truncate() {
        let mut m = MlaCache::new(2);
        assert_eq!(m.rows(), 0);
        m.append(&array_f32(&[1.0, 2.0, 3.0, 4.0], &[2, 2], "a").unwrap()).unwrap();
        let all = m.append(&array_f32(&[5.0, 6.0], &[1, 2], "b").unwrap()).unwrap();
        assert_eq!(to_vec_f32(&all).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        m.truncate(2).unwrap();
        assert_eq!(m.rows(), 2);
        assert_eq!(to_vec_f32(m.latent.as_ref().unwrap()).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        m.truncate(5).unwrap();
        assert_eq!(m.rows(), 2);
        m.truncate(0).unwrap();
        assert!(m.latent.is_none());
        let m = MlaCache::from_rows(2, Some(array_f32(&[0.0; 6], &[3, 2], "c").unwrap()));
        assert_eq!(m.rows(), 3);
    }
}
