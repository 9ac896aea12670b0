//! Per-sequence decode state in MLX arrays, one small type per kind of layer (spec §4):
//! KDA keeps a fixed-size recurrent state and the conv windows; MLA keeps the latent rows
//! (`c_kv` post-norm then raw `k_pe`: 576 values per token in K3, never the expanded K/V).

use anyhow::Result;
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
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
/// The rows live in a buffer with spare capacity: a decode step writes its row with MLX
/// `slice_update` (same-size buffers, so the allocator recycles them; see docs/decoder.md for
/// the measured gain over concatenation), and the buffer grows by a quarter (at least
/// [`MlaCache::GROW_ROWS`] rows) when full: at most ~25 % spare memory.
pub struct MlaCache {
    /// `[capacity, width]`; rows past `rows` are unused.
    buf: Option<Array>,
    rows: usize,
    pub width: usize,
}

impl MlaCache {
    /// Smallest growth step, in rows.
    pub const GROW_ROWS: usize = 1024;

    pub fn new(width: usize) -> Self {
        MlaCache { buf: None, rows: 0, width }
    }

    /// A cache holding `latent` `[rows, width]` (or nothing); later appends grow a new buffer.
    pub fn from_rows(width: usize, latent: Option<Array>) -> Self {
        let rows = latent.as_ref().map_or(0, |a| a.shape()[0] as usize);
        MlaCache { buf: latent, rows, width }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows the buffer holds room for.
    pub fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |a| a.shape()[0] as usize)
    }

    /// The rows in use, `[rows, width]` (a view of the buffer), or `None` when empty.
    pub fn latent(&self) -> Result<Option<Array>> {
        match &self.buf {
            None => Ok(None),
            Some(_) if self.rows == 0 => Ok(None),
            Some(b) if b.shape()[0] as usize == self.rows => Ok(Some(b.clone())),
            Some(b) => Ok(Some(b.try_index(0..self.rows as i32)?)),
        }
    }

    /// The buffer itself (for evaluation together with the step's logits).
    pub fn buffer(&self) -> Option<&Array> {
        self.buf.as_ref()
    }

    /// Appends `rows` `[n, width]` and returns the rows in use (a view).
    pub fn append(&mut self, rows: &Array) -> Result<Array> {
        let n = rows.shape()[0] as usize;
        let need = self.rows + n;
        if need > self.capacity() {
            let cap = need.max(self.capacity() + (self.capacity() / 4).max(Self::GROW_ROWS));
            let grown = ops::zeros_dtype(&[cap as i32, self.width as i32], rows.dtype())?;
            self.buf = Some(match (self.buf.take(), self.rows) {
                (Some(old), r) if r > 0 => {
                    let used = if old.shape()[0] as usize == r { old } else { old.try_index(0..r as i32)? };
                    ops::concatenate(&[used, grown.try_index(r as i32..cap as i32)?], 0)?
                }
                _ => grown,
            });
        }
        let buf = self.buf.as_mut().expect("allocated above");
        buf.try_index_mut(self.rows as i32..need as i32, rows)?;
        self.rows = need;
        Ok(buf.try_index(0..need as i32)?)
    }

    /// Keeps the first `rows` rows (a session rewound to a shorter prefix).
    pub fn truncate(&mut self, rows: usize) -> Result<()> {
        if rows < self.rows {
            self.rows = rows;
            if rows == 0 {
                self.buf = None;
            }
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
                LayerCache::Mla(m) => v.extend(m.buffer()),
            }
        }
        v
    }

    /// Bytes of state the cache holds (KDA states, conv windows, MLA buffers with their spare rows).
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Kda(k) => k.arrays().iter().map(|a| a.nbytes()).sum::<usize>(),
                LayerCache::Mla(m) => m.buffer().map_or(0, |a| a.nbytes()),
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
        assert_eq!(to_vec_f32(&m.latent().unwrap().unwrap()).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        // after a rewind, appends overwrite the dropped rows
        let all = m.append(&array_f32(&[7.0, 8.0], &[1, 2], "d").unwrap()).unwrap();
        assert_eq!(to_vec_f32(&all).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 7.0, 8.0]);
        m.truncate(5).unwrap();
        assert_eq!(m.rows(), 3);
        m.truncate(0).unwrap();
        assert!(m.latent().unwrap().is_none());
        let m = MlaCache::from_rows(2, Some(array_f32(&[0.0; 6], &[3, 2], "c").unwrap()));
        assert_eq!(m.rows(), 3);
    }

    #[test]
    fn mla_rows_grow_in_steps_and_keep_every_row() {
        let mut m = MlaCache::new(3);
        let mut want = Vec::new();
        // a prefill of 1000 rows, then single-row decode steps across two growths
        let first: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        m.append(&array_f32(&first, &[1000, 3], "p").unwrap()).unwrap();
        want.extend_from_slice(&first);
        assert_eq!(m.capacity(), MlaCache::GROW_ROWS);
        let mut caps = vec![m.capacity()];
        for step in 0..1100 {
            let row = [-(step as f32), 0.5 * step as f32, 7.0];
            let all = m.append(&array_f32(&row, &[1, 3], "s").unwrap()).unwrap();
            want.extend_from_slice(&row);
            mlx_rs::transforms::eval([m.buffer().unwrap()]).unwrap();
            if step % 97 == 0 || step == 1099 {
                assert_eq!(to_vec_f32(&all).unwrap(), want, "after step {step}");
            }
            if *caps.last().unwrap() != m.capacity() {
                caps.push(m.capacity());
            }
        }
        assert_eq!(m.rows(), 2100);
        // 1024 → 2048 → 3072 (a quarter, at least GROW_ROWS), never more than needed + a step
        assert_eq!(caps, vec![1024, 2048, 3072]);
        assert_eq!(to_vec_f32(&m.latent().unwrap().unwrap()).unwrap(), want);
    }
}
