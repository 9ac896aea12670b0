//! [`MoePlan`]: one MoE layer's routed rows grouped by expert on the device, as both expert
//! paths (the mma.sync kernels of [`super::backend`] and the dense path of [`super::moe_dense`])
//! read them.

use super::gpu::DevMem;

/// Device-side grouping of routed rows by expert (reused across expert chunks).
pub struct MoePlan {
    pub t: usize,
    pub k: usize,
    pub e: usize,
    pub bm: usize,
    pub max_tiles: usize,
    pub offsets: DevMem,
    pub tile_expert: DevMem,
    pub tile_row0: DevMem,
    pub tile_count: DevMem,
    pub slot_pos: DevMem,
    pub row_token: DevMem,
    /// Grouped inputs `[t*k, latent]` (bf16 or f32), intermediate `[t*k, inter]` (mma.sync
    /// kernels only: a stub on the dense path), outputs `[t*k, latent]` f32.
    pub xg: DevMem,
    pub hg: DevMem,
    /// Bytes of one row of `hg`.
    pub hg_row_bytes: usize,
    pub yg: DevMem,
    pub weights: DevMem,
    /// Runs on the dense path (BF16 dequantisation + cuBLAS) instead of the mma.sync kernel.
    pub dense: bool,
    /// Host copy of `offsets` (the dense path sizes its GEMMs from it).
    pub host_offsets: Option<Vec<i32>>,
}
