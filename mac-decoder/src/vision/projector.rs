//! The patchmergerv2 projector on MLX (spec §5.4): `Linear(4d → 4d) → GELU(erf) →
//! Linear(4d → text_hidden) → RMSNorm(ε = projector_ln_eps)`, no biases, no pre-norm.

use mlx_rs::{fast, nn, Array};

use super::encoder::VisionError;
use super::tower::linear;
use super::weights::VisionWeights;
use crate::mlx::array_f32;

pub struct Projector {
    proj0: Array,
    proj2: Array,
    post_norm: Array,
    eps: f32,
}

impl Projector {
    pub fn new(w: &VisionWeights) -> Result<Self, VisionError> {
        let c = &w.cfg;
        let m = c.merge_kernel_size[0] * c.merge_kernel_size[1] * c.mm_hidden_size;
        let a = |d: &[f32], s: &[usize], what: &str| array_f32(d, s, what).map_err(|e| VisionError::Mlx(format!("{e:#}")));
        Ok(Projector {
            proj0: a(&w.proj0, &[m, m], "mm_projector.proj.0.weight")?,
            proj2: a(&w.proj2, &[c.text_hidden_size, m], "mm_projector.proj.2.weight")?,
            post_norm: a(&w.post_norm, &[c.text_hidden_size], "mm_projector.post_norm.weight")?,
            eps: c.projector_ln_eps,
        })
    }

    /// `merged [rows, 4d]` → `[rows, text_hidden]`.
    pub fn forward(&self, merged: &Array) -> Result<Array, VisionError> {
        let e = |r: Result<Array, mlx_rs::error::Exception>, what: &str| r.map_err(|x| VisionError::Mlx(format!("{what}: {x}")));
        let h = e(nn::gelu(linear(merged, &self.proj0, "mm_projector.proj.0")?), "projector gelu")?;
        let y = linear(&h, &self.proj2, "mm_projector.proj.2")?;
        e(fast::rms_norm(&y, Some(&self.post_norm), self.eps), "mm_projector.post_norm")
    }
}
