//! Feed-forward blocks (spec §3.6): the SiTU-GLU MLP (dense layer 0, shared experts) and the
//! latent MoE (sigmoid router with selection-only bias, down to the latent, MXFP4 experts,
//! weighted sum, latent RMSNorm, up-projection, plus the shared experts on the full width).
//!
//! The latent MoE is also available in its three parts ([`latent_moe_front`], the routed
//! experts, [`latent_moe_back`]) for a layer whose experts are streamed in chunks: the executor
//! then runs the front of every token chunk, the experts chunk by chunk, then the backs. The
//! parts are the same ops in the same order, so both ways give identical results.

use anyhow::Context;

use super::weights::{MlpWeights, MoeWeights};
use super::ModelDims;
use crate::backend::{Backend, Routing};

/// `down · SiTU(gate x, up x)`.
pub fn mlp_forward<B: Backend>(b: &B, w: &MlpWeights<B>, x: &B::Buf, d: &ModelDims) -> anyhow::Result<B::Buf> {
    let h = b.situ_glu(&b.gemm(x, &w.gate)?, &b.gemm(x, &w.up)?, d.situ)?;
    b.gemm(&h, &w.down)
}

/// What the routed experts of a latent MoE need (and what its back adds in).
pub struct MoeFront<B: Backend> {
    pub routing: Routing,
    /// `[rows, latent]`: the input of the routed experts.
    pub x_lat: B::Buf,
}

/// Router and down-projection to the latent on normed input `x [rows, H]`.
pub fn latent_moe_front<B: Backend>(b: &B, w: &MoeWeights<B>, x: &B::Buf, d: &ModelDims) -> anyhow::Result<MoeFront<B>> {
    let routing = b.route(&b.gemm(x, &w.router)?, &w.router_bias, d.top_k, d.renormalize, d.routed_scaling)?;
    let x_lat = b.gemm(x, &w.latent_down)?;
    Ok(MoeFront { routing, x_lat })
}

/// Latent norm and up-projection of the routed experts' output `r [rows, latent]`, plus the
/// shared experts on `x`.
pub fn latent_moe_back<B: Backend>(b: &B, w: &MoeWeights<B>, x: &B::Buf, r: B::Buf, d: &ModelDims) -> anyhow::Result<B::Buf> {
    let r = if d.latent_norm { b.rms_norm(&r, &w.latent_norm, d.eps)? } else { r };
    let mut y = b.gemm(&r, &w.latent_up)?;
    b.add_assign(&mut y, &mlp_forward(b, &w.shared, x, d)?)?;
    Ok(y)
}

/// The latent MoE on normed input `x [rows, H]`; also returns the routing (for diagnostics:
/// `Routing::gap` is the golden `moe.topk_gap`). The layer's experts must be resident.
pub fn latent_moe_forward<B: Backend>(b: &B, w: &MoeWeights<B>, x: &B::Buf, d: &ModelDims) -> anyhow::Result<(B::Buf, Routing)> {
    let experts = w.experts.as_ref().context("latent MoE: the routed experts are not resident (they are streamed in chunks)")?;
    let f = latent_moe_front(b, w, x, d)?;
    let r = b.moe_experts(&f.x_lat, &f.routing, experts, d.situ)?;
    drop(f.x_lat);
    Ok((latent_moe_back(b, w, x, r, d)?, f.routing))
}
