//! MoonViT-V2 on MLX (spec §5.2–5.3): patch embedding, the resized position table, 27 blocks
//! of 2-D-rotary bidirectional attention and tanh-GELU MLP, final RMSNorm, and the 2×2 merge
//! (sd2_tpool, t = 1). Computes in f32; the position table and rotary tables come from
//! [`super::positions`] (small, on the CPU), the rest runs in MLX.

use mlx_rs::{fast, nn, ops, Array};

use super::encoder::{NormEps, VisionError};
use super::positions::{interpolate_pos_emb, rope_2d};
use super::preprocess::PreprocessedImage;
use super::reference::check_input;
use super::weights::VisionWeights;
use crate::mlx::array_f32;

type R<T> = Result<T, VisionError>;

fn mlx<T>(r: Result<T, mlx_rs::error::Exception>, what: &str) -> R<T> {
    r.map_err(|e| VisionError::Mlx(format!("{what}: {e}")))
}

fn arr(data: &[f32], shape: &[usize], what: &str) -> R<Array> {
    array_f32(data, shape, what).map_err(|e| VisionError::Mlx(format!("{e:#}")))
}

/// `x · Wᵀ` for a checkpoint weight `W[out, in]`.
pub(super) fn linear(x: &Array, w: &Array, what: &str) -> R<Array> {
    mlx(x.matmul(w.t()), what)
}

struct Block {
    norm0: Array,
    wqkv: Array,
    wo: Array,
    norm1: Array,
    fc0: Array,
    fc1: Array,
}

/// The tower's weights in MLX.
pub struct VisionTower {
    cfg: k3_protocol::VisionConfig,
    patch_embed: Array,
    /// Kept on the CPU: resized per grid.
    pos_emb: Vec<f32>,
    blocks: Vec<Block>,
    final_norm: Array,
    /// Upper bound on one attention score tensor (`heads × q_rows × n` f32); longer images are
    /// attended in query blocks so that MLX backends without a fused kernel (the CPU) do not
    /// materialise `heads × n²` scores.
    attn_score_bytes: usize,
}

/// Default bound of one attention score tensor (256 MiB). Each query block is evaluated before
/// the next is built, so this bounds the scores alive at once (MLX is lazy: blocks left unevaluated
/// are all materialised together when the result is used, and the bound would not hold).
pub const DEFAULT_ATTN_SCORE_BYTES: usize = super::media_config::ATTN_SCORE_BYTES;

/// The tower's outputs for one image, as MLX arrays.
pub struct TowerOutput {
    /// `[n, d]`
    pub embed: Array,
    /// `[n, d]`
    pub encoder: Array,
    /// `[rows, merge² · d]`
    pub merged: Array,
}

impl VisionTower {
    pub fn new(w: &VisionWeights) -> R<Self> {
        let c = &w.cfg;
        let (d, p, q, f) = (c.vt_hidden_size, c.patch_size, c.qkv_hidden_size, c.vt_intermediate_size);
        let mut blocks = Vec::with_capacity(w.blocks.len());
        for (i, b) in w.blocks.iter().enumerate() {
            let n = |s: &str| format!("vision_tower.encoder.blocks.{i}.{s}");
            blocks.push(Block {
                norm0: arr(&b.norm0, &[d], &n("norm0.weight"))?,
                wqkv: arr(&b.wqkv, &[3 * q, d], &n("wqkv.weight"))?,
                wo: arr(&b.wo, &[d, q], &n("wo.weight"))?,
                norm1: arr(&b.norm1, &[d], &n("norm1.weight"))?,
                fc0: arr(&b.fc0, &[f, d], &n("mlp.fc0.weight"))?,
                fc1: arr(&b.fc1, &[d, f], &n("mlp.fc1.weight"))?,
            });
        }
        Ok(VisionTower {
            patch_embed: arr(&w.patch_embed, &[d, 3 * p * p], "vision_tower.patch_embed.proj.weight")?,
            pos_emb: w.pos_emb.clone(),
            blocks,
            final_norm: arr(&w.final_norm, &[d], "vision_tower.encoder.final_layernorm.weight")?,
            cfg: c.clone(),
            attn_score_bytes: DEFAULT_ATTN_SCORE_BYTES,
        })
    }

    /// Sets the bound of one attention score tensor (see [`DEFAULT_ATTN_SCORE_BYTES`]).
    pub fn set_attention_score_bytes(&mut self, bytes: usize) {
        self.attn_score_bytes = bytes.max(1);
    }

    /// Query rows per attention block for `n` patches.
    fn query_block(&self, n: usize) -> usize {
        let per_row = self.cfg.vt_num_attention_heads * n * 4;
        (self.attn_score_bytes / per_row.max(1)).clamp(1, n.max(1))
    }

    /// Bidirectional attention of `q, k, v [1, heads, n, hd]`, in query blocks when long.
    fn attention(&self, q: &Array, k: &Array, v: &Array, n: usize, scale: f32, what: &str) -> R<Array> {
        let rows = self.query_block(n);
        if rows >= n {
            return mlx(fast::scaled_dot_product_attention(q, k, v, scale, None, None), what);
        }
        let cuts: Vec<i32> = (rows..n).step_by(rows).map(|c| c as i32).collect();
        let blocks = mlx(q.split_at_indices(&cuts, 2), what)?;
        // k and v once, before the blocks share them.
        mlx(mlx_rs::transforms::eval([k, v]), what)?;
        let outs = blocks
            .iter()
            .map(|qb| {
                let o = mlx(fast::scaled_dot_product_attention(qb, k, v, scale, None, None), what)?;
                // Forced here: the block's scores are freed before the next block's exist.
                mlx(o.eval(), what)?;
                Ok(o)
            })
            .collect::<R<Vec<Array>>>()?;
        mlx(ops::concatenate(&outs, 2), what)
    }

    /// Rotates the `(2p, 2p+1)` pairs of `x [n, heads, hd]` by `cos/sin [n, 1, hd/2, 1]`.
    fn rope(x: &Array, cos: &Array, sin: &Array, n: i32, heads: i32, hd: i32) -> R<Array> {
        let x = mlx(x.reshape(&[n, heads, hd / 2, 2]), "rope reshape")?;
        let ab = mlx(x.split_equal(2, -1), "rope split")?;
        let (a, b) = (&ab[0], &ab[1]);
        let ra = mlx(a.multiply(cos).and_then(|ac| ac.subtract(&b.multiply(sin)?)), "rope")?;
        let rb = mlx(a.multiply(sin).and_then(|as_| as_.add(&b.multiply(cos)?)), "rope")?;
        let out = mlx(ops::concatenate(&[ra, rb], -1), "rope concat")?;
        mlx(out.reshape(&[n, heads, hd]), "rope reshape")
    }

    /// Runs one pre-processed image through the tower.
    pub fn forward(&self, img: &PreprocessedImage, eps: NormEps) -> R<TowerOutput> {
        check_input(&self.cfg, img)?;
        let c = &self.cfg;
        let [_, gh, gw] = img.grid_thw;
        let n = gh * gw;
        let (d, p) = (c.vt_hidden_size, c.patch_size);
        let heads = c.vt_num_attention_heads;
        let q = c.qkv_hidden_size;
        let hd = q / heads;
        let e = eps.value();
        let (ni, hi, hdi, qi) = (n as i32, heads as i32, hd as i32, q as i32);

        let px = arr(&img.pixel_values, &[n, 3 * p * p], "vision.pixel_values")?;
        let pos = interpolate_pos_emb(&self.pos_emb, c.init_pos_emb_height, c.init_pos_emb_width, d, gh, gw);
        let pos = arr(&pos, &[n, d], "interpolated pos_emb")?;
        let mut x = mlx(linear(&px, &self.patch_embed, "patch_embed")?.add(&pos), "patch_embed + pos")?;
        let embed = x.clone();

        let (cos, sin) = rope_2d(gh, gw, hd);
        let cos = arr(&cos, &[n, 1, hd / 2, 1], "rope cos")?;
        let sin = arr(&sin, &[n, 1, hd / 2, 1], "rope sin")?;
        let scale = 1.0 / (hd as f32).sqrt();
        for (i, b) in self.blocks.iter().enumerate() {
            let what = |s: &str| format!("vision block {i}: {s}");
            let h = mlx(fast::rms_norm(&x, Some(&b.norm0), e), &what("norm0"))?;
            let qkv = linear(&h, &b.wqkv, &what("wqkv"))?;
            let parts = mlx(qkv.split_equal(3, -1), &what("qkv split"))?;
            let shape = [ni, hi, hdi];
            let qh = Self::rope(&mlx(parts[0].reshape(&shape), &what("q"))?, &cos, &sin, ni, hi, hdi)?;
            let kh = Self::rope(&mlx(parts[1].reshape(&shape), &what("k"))?, &cos, &sin, ni, hi, hdi)?;
            let vh = mlx(parts[2].reshape(&shape), &what("v"))?;
            // [n, heads, hd] → [1, heads, n, hd]
            let bh = |a: &Array| mlx(a.transpose_axes(&[1, 0, 2]).and_then(|t| t.reshape(&[1, hi, ni, hdi])), &what("to heads"));
            let o = self.attention(&bh(&qh)?, &bh(&kh)?, &bh(&vh)?, n, scale, &what("attention"))?;
            let o = mlx(o.reshape(&[hi, ni, hdi]).and_then(|t| t.transpose_axes(&[1, 0, 2])), &what("from heads"))?;
            let o = mlx(o.reshape(&[ni, qi]), &what("attn out"))?;
            x = mlx(x.add(&linear(&o, &b.wo, &what("wo"))?), &what("residual"))?;
            let h = mlx(fast::rms_norm(&x, Some(&b.norm1), e), &what("norm1"))?;
            let u = mlx(nn::gelu_approximate(linear(&h, &b.fc0, &what("fc0"))?), &what("gelu_tanh"))?;
            x = mlx(x.add(&linear(&u, &b.fc1, &what("fc1"))?), &what("residual"))?;
            // One block at a time: the graph (and the memory it holds) never spans blocks.
            mlx(x.eval(), &what("eval"))?;
        }
        let encoder = mlx(fast::rms_norm(&x, Some(&self.final_norm), e), "final_layernorm")?;

        let (mh, mw) = (c.merge_kernel_size[0], c.merge_kernel_size[1]);
        let merged = mlx(
            encoder
                .reshape(&[(gh / mh) as i32, mh as i32, (gw / mw) as i32, mw as i32, d as i32])
                .and_then(|t| t.transpose_axes(&[0, 2, 1, 3, 4]))
                .and_then(|t| t.reshape(&[(n / (mh * mw)) as i32, (mh * mw * d) as i32])),
            "sd2_tpool merge",
        )?;
        Ok(TowerOutput { embed, encoder, merged })
    }
}
