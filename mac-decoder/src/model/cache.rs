//! Per-sequence decode state in MLX arrays, one small type per kind of layer (spec §4):
//! KDA keeps a fixed-size recurrent state and the conv windows; MLA keeps the latent rows
//! (`c_kv` post-norm then raw `k_pe`: 576 values per token in K3, never the expanded K/V).

use anyhow::Result;
use mlx_rs::ops::indexing::{TryIndexMutOp, TryIndexOp};
use mlx_rs::{ops, Array};

use k3_protocol::config::{AttnKind, TextConfig};

/// KDA layer state.
#[derive(Clone)]
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
/// The rows are kept as *segments*, oldest first: rows frozen by earlier forks (shared with the
/// copies, never written again), then this cache's own rows. A fork ([`MlaCache::fork`]) freezes
/// the own rows into a segment that both the copy and the original keep, so a checkpoint costs
/// no copy of the context; frozen segments are merged so that each is at least twice the size of
/// the next (at most ~log₂(rows) of them, each row copied ~log₂ times over its life, not once per
/// fork). Attention reads the segments one by one ([`MlaCache::append`] returns them).
///
/// The own rows live in a buffer with spare capacity: a decode step writes its row with MLX
/// `slice_update` (same-size buffers, so the allocator recycles them; see docs/decoder.md for
/// the measured gain over concatenation), and the buffer grows by a quarter (at least
/// [`MlaCache::GROW_ROWS`] rows) when full: at most ~25 % spare memory.
#[derive(Clone)]
pub struct MlaCache {
    /// Frozen segments `[n_i, width]`, oldest first, and their total rows.
    frozen: Vec<Array>,
    frozen_rows: usize,
    /// `[capacity, width]`; rows past `own` are unused.
    buf: Option<Array>,
    own: usize,
    pub width: usize,
}

impl MlaCache {
    /// Smallest growth step, in rows.
    pub const GROW_ROWS: usize = 1024;

    pub fn new(width: usize) -> Self {
        MlaCache { frozen: Vec::new(), frozen_rows: 0, buf: None, own: 0, width }
    }

    /// A cache holding `latent` `[rows, width]` (or nothing); later appends grow a new buffer.
    pub fn from_rows(width: usize, latent: Option<Array>) -> Self {
        let own = latent.as_ref().map_or(0, |a| a.shape()[0] as usize);
        MlaCache { frozen: Vec::new(), frozen_rows: 0, buf: latent, own, width }
    }

    pub fn rows(&self) -> usize {
        self.frozen_rows + self.own
    }

    /// Rows held without growing the buffer.
    pub fn capacity(&self) -> usize {
        self.frozen_rows + self.buf.as_ref().map_or(0, |a| a.shape()[0] as usize)
    }

    /// Segments the rows are kept in (frozen ones plus the own buffer, if it holds rows).
    pub fn segment_count(&self) -> usize {
        self.frozen.len() + usize::from(self.own > 0)
    }

    /// The own rows in use, a view of the buffer.
    fn own_rows(&self) -> Result<Option<Array>> {
        Ok(match &self.buf {
            Some(b) if self.own > 0 => Some(if b.shape()[0] as usize == self.own { b.clone() } else { b.try_index(0..self.own as i32)? }),
            _ => None,
        })
    }

    /// The rows in use as segments, oldest first (views; nothing is copied).
    pub fn segments(&self) -> Result<Vec<Array>> {
        let mut v = self.frozen.clone();
        v.extend(self.own_rows()?);
        Ok(v)
    }

    /// All rows in use as one array `[rows, width]` (a copy when there are several segments:
    /// for the hand-off and rewinds, not for decode steps), or `None` when empty.
    pub fn latent(&self) -> Result<Option<Array>> {
        let mut segs = self.segments()?;
        Ok(match segs.len() {
            0 => None,
            1 => segs.pop(),
            _ => Some(ops::concatenate(&segs, 0)?),
        })
    }

    /// Every array the cache holds (to evaluate them together with the logits).
    pub fn arrays(&self) -> Vec<&Array> {
        self.frozen.iter().chain(self.buf.as_ref()).collect()
    }

    /// Bytes held: the frozen segments (shared with forks, counted in each) and the buffer with
    /// its spare rows.
    pub fn nbytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }

    /// Appends `rows` `[n, width]` and returns the rows in use as segments, oldest first.
    pub fn append(&mut self, rows: &Array) -> Result<Vec<Array>> {
        let n = rows.shape()[0] as usize;
        let need = self.own + n;
        let capacity = self.buf.as_ref().map_or(0, |a| a.shape()[0] as usize);
        if need > capacity {
            let cap = need.max(capacity + (capacity / 4).max(Self::GROW_ROWS));
            let grown = ops::zeros_dtype(&[cap as i32, self.width as i32], rows.dtype())?;
            self.buf = Some(match self.own_rows()? {
                Some(used) => ops::concatenate(&[used, grown.try_index(self.own as i32..cap as i32)?], 0)?,
                None => grown,
            });
        }
        let buf = self.buf.as_mut().expect("allocated above");
        buf.try_index_mut(self.own as i32..need as i32, rows)?;
        self.own = need;
        self.segments()
    }

    /// Keeps the first `rows` rows (a session rewound to a shorter prefix).
    pub fn truncate(&mut self, rows: usize) -> Result<()> {
        if rows >= self.rows() {
            return Ok(());
        }
        if rows >= self.frozen_rows {
            self.own = rows - self.frozen_rows;
        } else {
            let mut kept = Vec::new();
            let mut have = 0;
            for seg in self.frozen.drain(..) {
                let n = seg.shape()[0] as usize;
                if have + n <= rows {
                    kept.push(seg);
                    have += n;
                } else {
                    if have < rows {
                        kept.push(seg.try_index(0..(rows - have) as i32)?);
                        have = rows;
                    }
                    break;
                }
            }
            self.frozen = kept;
            self.frozen_rows = have;
            self.buf = None;
            self.own = 0;
        }
        if self.own == 0 {
            self.buf = None;
        }
        Ok(())
    }

    /// A copy holding the same rows, sharing them: the own rows become a frozen segment of both
    /// this cache and the copy (no rows are copied; later appends go to new buffers).
    pub fn fork(&mut self) -> Result<MlaCache> {
        if let Some(rows) = self.own_rows()? {
            self.frozen.push(rows);
            self.frozen_rows += self.own;
            self.buf = None;
            self.own = 0;
            // Keep segment sizes geometric: merge the newest two while the newer is at least
            // half the older.
            while self.frozen.len() >= 2 {
                let k = self.frozen.len();
                let (older, newer) = (self.frozen[k - 2].shape()[0], self.frozen[k - 1].shape()[0]);
                if 2 * newer < older {
                    break;
                }
                let b = self.frozen.pop().expect("two segments");
                let a = self.frozen.pop().expect("two segments");
                self.frozen.push(ops::concatenate(&[a, b], 0)?);
            }
        }
        Ok(self.clone())
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
                LayerCache::Mla(m) => v.extend(m.arrays()),
            }
        }
        v
    }

    /// A copy of the state that shares the arrays (see [`MlaCache::fork`]); O(layers), not
    /// O(context).
    pub fn fork(&mut self) -> Result<ModelCache> {
        let layers = self
            .layers
            .iter_mut()
            .map(|l| {
                Ok(match l {
                    LayerCache::Kda(k) => LayerCache::Kda(k.clone()),
                    LayerCache::Mla(m) => LayerCache::Mla(m.fork()?),
                })
            })
            .collect::<Result<_>>()?;
        Ok(ModelCache { layers, tokens: self.tokens })
    }

    /// Bytes of state the cache holds (KDA states, conv windows, MLA buffers with their spare rows).
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Kda(k) => k.arrays().iter().map(|a| a.nbytes()).sum::<usize>(),
                LayerCache::Mla(m) => m.nbytes(),
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mlx::{array_f32, to_vec_f32};

    /// The segments' rows, in order.
    fn flat(segs: &[Array]) -> Vec<f32> {
        segs.iter().flat_map(|a| to_vec_f32(a).unwrap()).collect()
    }

    fn rows(v: &[f32], width: usize) -> Array {
        array_f32(v, &[v.len() / width, width], "rows").unwrap()
    }

    #[test]
    fn forks_share_rows_and_diverge() {
        let mut a = MlaCache::new(2);
        a.append(&rows(&[1.0, 2.0, 3.0, 4.0], 2)).unwrap();
        let mut b = a.fork().unwrap();
        // both froze the two rows into one shared segment; nothing of their own yet
        assert_eq!((a.segment_count(), b.segment_count(), a.rows(), b.rows()), (1, 1, 2, 2));
        let sa = a.append(&rows(&[5.0, 6.0], 2)).unwrap();
        let sb = b.append(&rows(&[7.0, 8.0, 9.0, 10.0], 2)).unwrap();
        assert_eq!(flat(&sa), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(flat(&sb), vec![1.0, 2.0, 3.0, 4.0, 7.0, 8.0, 9.0, 10.0]);
        // the original keeps its rows after the copy grows past its buffer
        let mut c = b.fork().unwrap();
        for i in 0..1500 {
            c.append(&rows(&[i as f32, 0.0], 2)).unwrap();
        }
        assert_eq!(to_vec_f32(&b.latent().unwrap().unwrap()).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 7.0, 8.0, 9.0, 10.0]);
        assert_eq!(c.rows(), 1504);
        // truncating into a frozen segment keeps exactly the prefix
        c.truncate(3).unwrap();
        assert_eq!(to_vec_f32(&c.latent().unwrap().unwrap()).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 7.0, 8.0]);
        let s = c.append(&rows(&[0.5, 0.25], 2)).unwrap();
        assert_eq!(flat(&s), vec![1.0, 2.0, 3.0, 4.0, 7.0, 8.0, 0.5, 0.25]);
    }

    #[test]
    fn repeated_forks_keep_few_segments() {
        // a long session checkpointed after every turn: a 4096-row prompt, then 200 turns of
        // 64 rows, forked each time
        let mut m = MlaCache::new(1);
        let first: Vec<f32> = (0..4096).map(|i| i as f32).collect();
        m.append(&rows(&first, 1)).unwrap();
        let mut want = first;
        let mut most = 0;
        for turn in 0..200 {
            let new: Vec<f32> = (0..64).map(|i| (100_000 + turn * 64 + i) as f32).collect();
            m.append(&rows(&new, 1)).unwrap();
            want.extend_from_slice(&new);
            let _checkpoint = m.fork().unwrap();
            most = most.max(m.segment_count());
        }
        assert_eq!(to_vec_f32(&m.latent().unwrap().unwrap()).unwrap(), want);
        // geometric sizes: at most ~log2(rows / 64) + 2 segments
        assert!(most <= 10, "{most} segments");
    }

    #[test]
    fn mla_rows_append_and_truncate() {
        let mut m = MlaCache::new(2);
        assert_eq!(m.rows(), 0);
        m.append(&array_f32(&[1.0, 2.0, 3.0, 4.0], &[2, 2], "a").unwrap()).unwrap();
        let all = m.append(&array_f32(&[5.0, 6.0], &[1, 2], "b").unwrap()).unwrap();
        assert_eq!(flat(&all), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        m.truncate(2).unwrap();
        assert_eq!(m.rows(), 2);
        assert_eq!(to_vec_f32(&m.latent().unwrap().unwrap()).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        // after a rewind, appends overwrite the dropped rows
        let all = m.append(&array_f32(&[7.0, 8.0], &[1, 2], "d").unwrap()).unwrap();
        assert_eq!(flat(&all), vec![1.0, 2.0, 3.0, 4.0, 7.0, 8.0]);
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
            mlx_rs::transforms::eval(m.arrays()).unwrap();
            if step % 97 == 0 || step == 1099 {
                assert_eq!(flat(&all), want, "after step {step}");
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
