//! Feed-forward blocks (spec §3.6): the SiTU-GLU MLP (dense layer 0, shared experts) and the
//! latent MoE (sigmoid router with selection-only bias, down to the latent, MXFP4 experts,
//! weighted sum, latent RMSNorm, up-projection, plus the shared experts on the full width).

use super::weights::{MlpWeights, MoeWeights};
use super::ModelDims;
use crate::backend::{Backend, Routing};

/// `down · SiTU(gate x, up x)`.
pub fn mlp_forward<B: Backend>(b: &B, w: &MlpWeights<B>, x: &B::Buf, d: &ModelDims) -> anyhow::Result<B::Buf> {
    let h = b.situ_glu(&b.gemm(x, &w.gate)?, &b.gemm(x, &w.up)?, d.situ)?;
    b.gemm(&h, &w.down)
}

/// The latent MoE on normed input `x [rows, H]`; also returns the routing (for diagnostics:
/// `Routing::gap` is the golden `moe.topk_gap`).
pub fn latent_moe_forward<B: Backend>(b: &B, w: &MoeWeights<B>, x: &B::Buf, d: &ModelDims) -> anyhow::Result<(B::Buf, Routing)> {
    let routing = b.route(&b.gemm(x, &w.router)?, &w.router_bias, d.top_k, d.renormalize, d.routed_scaling)?;
    let x_lat = b.gemm(x, &w.latent_down)?;
    let mut r = b.moe_experts(&x_lat, &routing, &w.experts, d.situ)?;
    if d.latent_norm {
        r = b.rms_norm(&r, &w.latent_norm, d.eps)?;
    }
    let mut y = b.gemm(&r, &w.latent_up)?;
    b.add_assign(&mut y, &mlp_forward(b, &w.shared, x, d)?)?;
    Ok((y, routing))
}
