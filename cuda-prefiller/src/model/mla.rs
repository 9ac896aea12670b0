//! A gated NoPE MLA layer (spec §3.5): q-LoRA, kv-LoRA latent (post-norm `c_kv` + raw `k_pe`,
//! which is also the cache row), causal attention (expanded for prefill, absorbed over the
//! latent cache for decode), sigmoid output gate from the normed layer input, `o_proj`.

use k3_protocol::config::spec::MLA_LATENT_NORM_EPS;

use super::weights::MlaWeights;
use super::ModelDims;
use crate::backend::{Backend, MlaForm};

/// An MLA layer's latent cache on the backend: `latent [capacity, kv_lora+rope]`, of which
/// the first `rows` are filled.
pub struct MlaLatentBufs<B: Backend> {
    pub latent: B::Buf,
    pub rows: usize,
}

/// The MLA block on normed input `x [rows, H]` → `[rows, H]`; the new tokens' latent rows are
/// written at `cache.rows ..` (capacity must suffice) and attended causally.
pub fn mla_forward<B: Backend>(b: &B, w: &MlaWeights<B>, x: &B::Buf, cache: &mut MlaLatentBufs<B>, d: &ModelDims, form: MlaForm) -> anyhow::Result<B::Buf> {
    use crate::backend::DeviceBuf;
    let c_q = b.rms_norm(&b.gemm(x, &w.q_a)?, &w.q_a_norm, MLA_LATENT_NORM_EPS)?;
    let q = b.gemm(&c_q, &w.q_b)?;
    let latent = b.mla_latent(&b.gemm(x, &w.kv_a)?, &w.kv_a_norm, MLA_LATENT_NORM_EPS, d.mla)?;
    let pos0 = cache.rows;
    b.write_rows(&mut cache.latent, pos0, &latent)?;
    cache.rows += x.rows();
    let mut a = b.mla_attention(&q, &cache.latent, &w.kv_b, d.mla, pos0, form)?;
    b.sigmoid_gate_mul(&mut a, &b.gemm(x, &w.g_proj)?)?;
    b.gemm(&a, &w.o_proj)
}
