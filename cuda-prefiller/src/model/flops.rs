//! Useful FLOPs of a prefill (GEMMs, attention, the KDA chunked delta rule; not the
//! elementwise ops): the roofline of `k3-prefill bench`, and the cost a prefill node predicts
//! for itself before it has measured a pass (`server::predict`).

use k3_protocol::config::{AttnKind, FfnKind, LayerSpec, TextConfig};

/// Useful FLOPs of one layer over `t` new tokens after `pos0` earlier ones (GEMMs, attention,
/// the KDA chunked delta rule; not the elementwise ops), for the roofline.
pub fn layer_flops(c: &TextConfig, spec: &LayerSpec, t: usize, pos0: usize) -> f64 {
    let h = c.hidden_size as f64;
    let la = &c.linear_attn_config;
    let kc = (la.num_heads * la.head_dim) as f64;
    let t_ = t as f64;
    let gemm = |m: f64, n: f64, k: f64| 2.0 * m * n * k;
    let mut f = 0.0;
    match spec.attn {
        AttnKind::Kda => {
            let dd = la.head_dim as f64;
            // q, k, v, g projections and β; f_a/f_b; o
            f += gemm(t_, 3.0 * kc + kc + la.num_heads as f64, h) + gemm(t_, dd, h) + gemm(t_, kc, dd) + gemm(t_, h, kc);
            // chunked delta rule per 64-token chunk and head: pair products (A, QK), the
            // triangular solve, and the state products (W·S, Qg·S, M·V, state update)
            let per_chunk = 2.0 * (64.0 * 65.0 / 2.0) * dd * 2.0 + 64.0 * 64.0 * 2.0 * dd + 2.0 * 64.0 * dd * dd * 3.0 + 64.0 * 64.0 * dd;
            f += (t as f64 / 64.0).ceil() * la.num_heads as f64 * per_chunk;
        }
        AttnKind::Mla => {
            let (heads, nope, rope, v, kvl) =
                (c.num_attention_heads as f64, c.qk_nope_head_dim as f64, c.qk_rope_head_dim as f64, c.v_head_dim as f64, c.kv_lora_rank as f64);
            let q = c.q_lora_rank as f64;
            f += gemm(t_, q, h) + gemm(t_, heads * (nope + rope), q) + gemm(t_, kvl + rope, h);
            f += gemm((pos0 + t) as f64, heads * (nope + v), kvl);
            // output gate and o projection
            f += gemm(t_, heads * v, h) + gemm(t_, h, heads * v);
            // causal pairs: queries pos0..pos0+t see pos0+i+1 keys
            let pairs = t_ * pos0 as f64 + t_ * (t_ + 1.0) / 2.0;
            f += 2.0 * pairs * heads * (nope + rope + v);
        }
    }
    match spec.ffn {
        FfnKind::Dense => f += 3.0 * gemm(t_, c.intermediate_size as f64, h),
        FfnKind::LatentMoe => {
            let (lat, sh) = (c.routed_expert_hidden_size as f64, c.shared_expert_width() as f64);
            f += gemm(t_, c.num_experts as f64, h) + gemm(t_, lat, h) + gemm(t_, h, lat) + 3.0 * gemm(t_, sh, h);
            f += (t * c.num_experts_per_token) as f64 * 3.0 * 2.0 * c.moe_intermediate_size as f64 * lat;
        }
    }
    f
}

/// FLOPs of the whole text tower over `t` new tokens after `pos0`: every layer, plus the
/// output head for the last row (the node returns the last logits).
pub fn prefill_flops(c: &TextConfig, t: usize, pos0: usize) -> f64 {
    let layers: f64 = c.layer_plan().iter().map(|spec| layer_flops(c, spec, t, pos0)).sum();
    layers + 2.0 * c.hidden_size as f64 * c.vocab_size as f64
}
