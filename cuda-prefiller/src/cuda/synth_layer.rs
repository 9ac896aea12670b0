//! A K3 decoder layer at real widths on raw device memory, for the benchmark's projection mode:
//! the tensors of one KDA or MLA layer with its latent MoE (spec §2.2) laid out in one host image
//! (random BF16 / F32 values, random MXFP4 codes with realistic E8M0 scales), streamed to a
//! device slot, and run through the same CUDA ops as the model. Only for timing: the values are
//! random, not a model.

use std::sync::Arc;

use anyhow::{ensure, Result};
use cudarc::driver::sys::CUdeviceptr;
use k3_protocol::config::TextConfig;

use super::backend::{CudaBackend, CudaBuf, CudaWeight, ExpertLayout, MoePlan};
use super::gpu::DevMem;
use super::profile;
use crate::backend::{Backend, DeviceBuf, KdaDims, MlaDims, MlaForm, SituBetas};
use crate::streamer::Part;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attn {
    Kda,
    Mla,
}

/// Shapes of the layer, from a K3-layout text config.
#[derive(Debug, Clone)]
pub struct Dims {
    pub hidden: usize,
    pub kda: KdaDims,
    pub mla: MlaDims,
    pub q_lora: usize,
    pub experts: usize,
    pub top_k: usize,
    pub inter: usize,
    pub latent: usize,
    pub shared: usize,
    pub conv: usize,
    pub betas: SituBetas,
}

impl Dims {
    pub fn of(c: &TextConfig) -> Self {
        Dims {
            hidden: c.hidden_size,
            kda: KdaDims { heads: c.linear_attn_config.num_heads, head_dim: c.linear_attn_config.head_dim },
            mla: MlaDims { heads: c.num_attention_heads, nope: c.qk_nope_head_dim, rope: c.qk_rope_head_dim, v: c.v_head_dim, kv_lora: c.kv_lora_rank },
            q_lora: c.q_lora_rank,
            experts: c.num_experts,
            top_k: c.num_experts_per_token,
            inter: c.moe_intermediate_size,
            latent: c.routed_expert_hidden_size,
            shared: c.shared_expert_width(),
            conv: c.linear_attn_config.short_conv_kernel_size,
            betas: SituBetas { beta: c.activation_situ_beta, linear_beta: c.activation_situ_linear_beta },
        }
    }
}

/// One dense tensor of the layer image.
#[derive(Debug, Clone)]
pub struct T {
    pub name: &'static str,
    pub rows: usize,
    pub cols: usize,
    /// 2 (BF16) or 4 (F32).
    pub esize: usize,
    pub off: usize,
}

/// Byte layout of one layer: dense tensors, then `experts` MXFP4 expert slots.
#[derive(Debug, Clone)]
pub struct LayerLayout {
    pub attn: Attn,
    pub tensors: Vec<T>,
    pub dense_bytes: usize,
    pub experts: ExpertLayout,
    pub n_experts: usize,
}

fn a256(x: usize) -> usize {
    x.div_ceil(256) * 256
}

impl LayerLayout {
    pub fn new(attn: Attn, d: &Dims) -> Result<Self> {
        let (h, c) = (d.hidden, d.kda.width());
        let mut v: Vec<(&'static str, usize, usize, usize)> = vec![
            ("input_layernorm", 1, h, 4),
            ("post_attention_layernorm", 1, h, 4),
            ("self_attention_res_norm", 1, h, 4),
            ("self_attention_res_proj", 1, h, 4),
            ("mlp_res_norm", 1, h, 4),
            ("mlp_res_proj", 1, h, 4),
            ("g_proj", d.mla.heads * d.mla.v, h, 2),
            ("o_proj", h, c, 2),
        ];
        match attn {
            Attn::Kda => v.extend([
                ("q_proj", c, h, 2),
                ("k_proj", c, h, 2),
                ("v_proj", c, h, 2),
                ("q_conv1d", c, d.conv, 4),
                ("k_conv1d", c, d.conv, 4),
                ("v_conv1d", c, d.conv, 4),
                ("f_a_proj", d.kda.head_dim, h, 2),
                ("f_b_proj", c, d.kda.head_dim, 2),
                ("dt_bias", 1, c, 4),
                ("A_log", 1, d.kda.heads, 4),
                ("b_proj", d.kda.heads, h, 2),
                ("o_norm", 1, d.kda.head_dim, 4),
            ]),
            Attn::Mla => v.extend([
                ("q_a_proj", d.q_lora, h, 2),
                ("q_a_layernorm", 1, d.q_lora, 4),
                ("q_b_proj", d.mla.heads * d.mla.qk(), d.q_lora, 2),
                ("kv_a_proj_with_mqa", d.mla.latent(), h, 2),
                ("kv_a_layernorm", 1, d.mla.kv_lora, 4),
                ("kv_b_proj", d.mla.heads * (d.mla.nope + d.mla.v), d.mla.kv_lora, 2),
            ]),
        }
        v.extend([
            ("gate", d.experts, h, 4), // router: f32 (its logits are f32, spec §3.6)
            ("e_score_correction_bias", 1, d.experts, 4),
            ("routed_expert_down_proj", d.latent, h, 2),
            ("routed_expert_norm", 1, d.latent, 4),
            ("routed_expert_up_proj", h, d.latent, 2),
            ("shared_gate_proj", d.shared, h, 2),
            ("shared_up_proj", d.shared, h, 2),
            ("shared_down_proj", h, d.shared, 2),
        ]);
        let mut off = 0;
        let tensors = v
            .into_iter()
            .map(|(name, rows, cols, esize)| {
                let t = T { name, rows, cols, esize, off };
                off = a256(off + rows * cols * esize);
                t
            })
            .collect();
        Ok(LayerLayout { attn, tensors, dense_bytes: off, experts: ExpertLayout::new(d.inter, d.latent)?, n_experts: d.experts })
    }

    pub fn expert_bytes(&self) -> usize {
        self.experts.stride * self.n_experts
    }
    pub fn total_bytes(&self) -> usize {
        self.dense_bytes + self.expert_bytes()
    }

    /// The streamer parts of the dense tensors (from host region `region`, offset 0).
    pub fn dense_parts(&self, region: usize) -> Vec<Part> {
        vec![Part { name: format!("{:?} dense tensors", self.attn), src: region, offset: 0, len: self.dense_bytes, dst: 0 }]
    }
    /// The streamer parts of experts `lo..hi` from host region `region` (an experts image),
    /// landing at `dst` (the slot offset of expert `lo`).
    pub fn expert_parts(&self, region: usize, lo: usize, hi: usize, dst: usize) -> Vec<Part> {
        let s = self.experts.stride;
        vec![Part { name: format!("experts {lo}..{hi}"), src: region, offset: (lo * s) as u64, len: (hi - lo) * s, dst }]
    }

    /// A host image of the dense tensors: values ~ U(-a, a), a = sqrt(3/fan_in); norm gains ~1.
    pub fn dense_image(&self) -> Vec<u8> {
        let mut img = vec![0u8; self.dense_bytes];
        for t in &self.tensors {
            let bytes = &mut img[t.off..t.off + t.rows * t.cols * t.esize];
            let a = (3.0 / t.cols as f32).sqrt();
            let is_norm = t.rows == 1 && !matches!(t.name, "dt_bias" | "A_log" | "e_score_correction_bias");
            let esize = t.esize;
            let name = t.name;
            let rows = t.rows;
            let per = bytes.len().div_ceil(16).div_ceil(esize) * esize;
            std::thread::scope(|sc| {
                for (ci, chunk) in bytes.chunks_mut(per.max(esize)).enumerate() {
                    sc.spawn(move || {
                        let first = ci * per / esize;
                        for (i, e) in chunk.chunks_mut(esize).enumerate() {
                            let k = (first + i) as u32;
                            let u = (k.wrapping_mul(2654435761) >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0;
                            let v = if is_norm {
                                1.0 + 0.25 * u
                            } else if name.ends_with("conv1d") {
                                0.5 * u
                            } else if rows == 1 {
                                0.1 * u
                            } else {
                                a * u
                            };
                            if esize == 4 {
                                e.copy_from_slice(&v.to_le_bytes());
                            } else {
                                e.copy_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
                            }
                        }
                    });
                }
            });
        }
        img
    }

    /// A host image of all experts: random E2M1 codes with E8M0 scales 2^-8..2^-7 (weights of
    /// about 1/sqrt(fan_in)), filled by `threads` threads.
    pub fn experts_image(&self, seed: u64, threads: usize) -> Vec<u8> {
        let l = self.experts;
        let mut img = vec![0u8; self.expert_bytes()];
        let per = self.n_experts.div_ceil(threads.max(1)).max(1);
        std::thread::scope(|sc| {
            for (ci, chunk) in img.chunks_mut(per * l.stride).enumerate() {
                sc.spawn(move || {
                    let mut s = seed ^ (ci as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    for slot in chunk.chunks_mut(l.stride) {
                        for (_, kind, off, len) in l.parts() {
                            let dst = &mut slot[off..off + len];
                            if kind == "weight_scale" {
                                for (i, b) in dst.iter_mut().enumerate() {
                                    *b = 119 + (i % 2) as u8;
                                }
                            } else {
                                for b in dst.chunks_mut(8) {
                                    s ^= s << 13;
                                    s ^= s >> 7;
                                    s ^= s << 17;
                                    let r = s.to_le_bytes();
                                    b.copy_from_slice(&r[..b.len()]);
                                }
                            }
                        }
                    }
                });
            }
        });
        img
    }
}

/// A layer's weights resident at `base` (dense tensors; experts at `experts_base`).
pub struct LayerWeights {
    pub layout: LayerLayout,
    pub w: std::collections::HashMap<&'static str, CudaWeight>,
}

impl LayerWeights {
    /// Views into device memory (nothing is copied or freed).
    pub fn view(b: &CudaBackend, layout: &LayerLayout, base: CUdeviceptr) -> Self {
        let mut w = std::collections::HashMap::new();
        for t in &layout.tensors {
            let mem = DevMem::borrowed(b.gpu.clone(), base + t.off as u64, t.rows * t.cols * t.esize);
            let (f, h) = if t.esize == 4 { (Some(mem), None) } else { (None, Some(mem)) };
            w.insert(t.name, CudaWeight { name: t.name.to_string(), rows: t.rows, cols: t.cols, f32: f, bf16: h });
        }
        LayerWeights { layout: layout.clone(), w }
    }
    fn g(&self, n: &str) -> &CudaWeight {
        &self.w[n]
    }
}

/// Per-layer running state of the benchmark (KDA recurrent state and windows, MLA cache).
pub struct LayerState {
    pub kda_s: Option<CudaBuf>,
    pub win: Vec<CudaBuf>,
    pub cache: Option<CudaBuf>,
}

impl LayerState {
    pub fn new(b: &CudaBackend, attn: Attn, d: &Dims, total_tokens: usize) -> Result<Self> {
        Ok(match attn {
            Attn::Kda => LayerState {
                kda_s: Some(b.zeros(d.kda.heads, d.kda.head_dim * d.kda.head_dim)?),
                win: (0..3).map(|_| b.zeros(d.conv - 1, d.kda.width())).collect::<Result<_>>()?,
                cache: None,
            },
            Attn::Mla => LayerState { kda_s: None, win: Vec::new(), cache: Some(b.zeros(total_tokens, d.mla.latent())?) },
        })
    }
}

/// Attention half of a layer for token rows `pos0..pos0+x.rows()` (x = the layer input `P`,
/// `bank` the AttnRes bank); returns `(P + attn_out, normed MoE input)`.
pub fn attention(b: &CudaBackend, w: &LayerWeights, d: &Dims, bank: &[&CudaBuf], p: &CudaBuf, st: &mut LayerState, pos0: usize) -> Result<(CudaBuf, CudaBuf)> {
    let m = |name: &'static str| profile::mark(&b.gpu, name);
    m("-")?;
    let h = b.attn_res_mix(bank, p, w.g("self_attention_res_norm"), w.g("self_attention_res_proj"), 1e-5)?;
    m("attn_res mix")?;
    let xn = b.rms_norm(&h, w.g("input_layernorm"), 1e-5)?;
    m("norms")?;
    drop(h);
    let y = match w.layout.attn {
        Attn::Kda => {
            let kd = d.kda;
            let mut win = std::mem::take(&mut st.win);
            let mut proj = |name: &str, conv: &str, wi: usize| -> Result<CudaBuf> {
                let raw = b.gemm(&xn, w.g(name))?;
                m("gemm qkvg/o")?;
                let r = b.short_conv_silu(&raw, w.g(conv), &mut win[wi]);
                m("kda elementwise")?;
                r
            };
            let mut q = proj("q_proj", "q_conv1d", 0)?;
            let mut k = proj("k_proj", "k_conv1d", 1)?;
            let v = proj("v_proj", "v_conv1d", 2)?;
            st.win = win;
            b.l2_norm_heads(&mut q, kd.head_dim, 1e-6, 1.0 / (kd.head_dim as f32).sqrt())?;
            b.l2_norm_heads(&mut k, kd.head_dim, 1e-6, 1.0)?;
            m("kda elementwise")?;
            let z = b.gemm(&b.gemm(&xn, w.g("f_a_proj"))?, w.g("f_b_proj"))?;
            m("gemm small (gate, beta, router)")?;
            let g = b.kda_gate(&z, w.g("A_log"), w.g("dt_bias"), kd, Some(-5.0))?;
            drop(z);
            m("kda elementwise")?;
            let beta = b.sigmoid(&b.gemm(&xn, w.g("b_proj"))?)?;
            m("gemm small (gate, beta, router)")?;
            let s = st.kda_s.as_mut().expect("KDA state");
            let o = b.kda_chunked(&q, &k, &v, &g, &beta, s, kd, 64)?;
            drop((q, k, v, g, beta));
            m("kda recurrence")?;
            let r = b.gemm(&xn, w.g("g_proj"))?;
            m("gemm qkvg/o")?;
            let o = b.gated_rms_norm(&o, &r, w.g("o_norm"), kd.head_dim, 1e-5)?;
            m("kda elementwise")?;
            let y = b.gemm(&o, w.g("o_proj"))?;
            m("gemm qkvg/o")?;
            y
        }
        Attn::Mla => {
            let md = d.mla;
            let cq = b.rms_norm(&b.gemm(&xn, w.g("q_a_proj"))?, w.g("q_a_layernorm"), 1e-6)?;
            let q = b.gemm(&cq, w.g("q_b_proj"))?;
            let kv = b.gemm(&xn, w.g("kv_a_proj_with_mqa"))?;
            let lat = b.mla_latent(&kv, w.g("kv_a_layernorm"), 1e-6, md)?;
            let cache = st.cache.as_mut().expect("MLA cache");
            b.write_rows(cache, pos0, &lat)?;
            m("mla projections + latent")?;
            let mut a = b.mla_attention(&q, cache, w.g("kv_b_proj"), md, pos0, MlaForm::Expanded)?;
            m("mla attention (incl. K/V expansion)")?;
            let gate = b.gemm(&xn, w.g("g_proj"))?;
            b.sigmoid_gate_mul(&mut a, &gate)?;
            let y = b.gemm(&a, w.g("o_proj"))?;
            m("gemm qkvg/o")?;
            y
        }
    };
    let mut p2 = b.slice_rows(p, 0, p.rows())?;
    b.add_assign(&mut p2, &y)?;
    let h2 = b.attn_res_mix(bank, &p2, w.g("mlp_res_norm"), w.g("mlp_res_proj"), 1e-5)?;
    m("attn_res mix")?;
    let xn2 = b.rms_norm(&h2, w.g("post_attention_layernorm"), 1e-5)?;
    m("norms")?;
    Ok((p2, xn2))
}

/// The non-expert front of the latent MoE: routing, the expert plan (grouped inputs), and the
/// shared experts' output.
pub fn moe_front(b: &CudaBackend, w: &LayerWeights, d: &Dims, xn2: &CudaBuf) -> Result<(MoePlan, CudaBuf)> {
    let m = |name: &'static str| profile::mark(&b.gpu, name);
    m("-")?;
    let logits = b.gemm(xn2, w.g("gate"))?;
    m("gemm small (gate, beta, router)")?;
    let (ids, wts, _gap) = b.route_device(&logits, w.g("e_score_correction_bias"), d.top_k, true, 1.0)?;
    drop(logits);
    m("moe routing + grouping")?;
    let xl = b.gemm(xn2, w.g("routed_expert_down_proj"))?;
    m("gemm latent down/up")?;
    let plan = b.moe_prepare(&xl, ids.ptr, wts, d.top_k, d.experts, &w.layout.experts)?;
    drop(ids);
    m("moe routing + grouping")?;
    let sg = b.gemm(xn2, w.g("shared_gate_proj"))?;
    let su = b.gemm(xn2, w.g("shared_up_proj"))?;
    m("gemm shared experts")?;
    let s = b.situ_glu(&sg, &su, d.betas)?;
    drop((sg, su));
    m("norms")?;
    let sh = b.gemm(&s, w.g("shared_down_proj"))?;
    m("gemm shared experts")?;
    Ok((plan, sh))
}

/// The back of the latent MoE once every expert chunk ran: combine, norm, up-projection, and
/// the update of `P`.
pub fn moe_back(b: &CudaBackend, w: &LayerWeights, d: &Dims, plan: &MoePlan, sh: &CudaBuf, p: &mut CudaBuf) -> Result<()> {
    let m = |name: &'static str| profile::mark(&b.gpu, name);
    m("-")?;
    let r = b.moe_combine(plan, d.latent)?;
    m("moe routing + grouping")?;
    let r = b.rms_norm(&r, w.g("routed_expert_norm"), 1e-5)?;
    m("norms")?;
    let r = b.gemm(&r, w.g("routed_expert_up_proj"))?;
    m("gemm latent down/up")?;
    b.add_assign(p, &r)?;
    b.add_assign(p, sh)?;
    m("norms")
}

/// Useful FLOPs of one layer over `t` new tokens after `pos0` earlier ones (for the roofline).
pub fn layer_flops(attn: Attn, d: &Dims, t: usize, pos0: usize) -> f64 {
    let (h, c) = (d.hidden as f64, d.kda.width() as f64);
    let t_ = t as f64;
    let gemm = |m: f64, n: f64, k: f64| 2.0 * m * n * k;
    let mut f = 0.0;
    // attention
    match attn {
        Attn::Kda => {
            let dd = d.kda.head_dim as f64;
            f += gemm(t_, 3.0 * c + c + d.kda.heads as f64, h) + gemm(t_, dd, h) + gemm(t_, c, dd) + gemm(t_, h, c);
            // chunked delta rule per 64-token chunk and head: pair products (A, QK), the
            // triangular solve, and the state products (W·S, Qg·S, M·V, state update)
            let per_chunk = 2.0 * (64.0 * 65.0 / 2.0) * dd * 2.0 + 64.0 * 64.0 * 2.0 * dd + 2.0 * 64.0 * dd * dd * 3.0 + 64.0 * 64.0 * dd;
            f += (t as f64 / 64.0).ceil() * d.kda.heads as f64 * per_chunk;
        }
        Attn::Mla => {
            let m = d.mla;
            let q = d.q_lora as f64;
            f += gemm(t_, q, h) + gemm(t_, (m.heads * m.qk()) as f64, q) + gemm(t_, m.latent() as f64, h);
            f += gemm((pos0 + t) as f64, (m.heads * (m.nope + m.v)) as f64, m.kv_lora as f64);
            f += gemm(t_, c, h) + gemm(t_, h, c);
            // causal pairs: queries pos0..pos0+t see pos0+i+1 keys
            let pairs = t_ * pos0 as f64 + t_ * (t_ + 1.0) / 2.0;
            f += 2.0 * pairs * (m.heads * (m.qk() + m.v)) as f64;
        }
    }
    // latent MoE
    let (lat, sh) = (d.latent as f64, d.shared as f64);
    f += gemm(t_, d.experts as f64, h) + gemm(t_, lat, h) + gemm(t_, h, lat) + 3.0 * gemm(t_, sh, h);
    f += (t * d.top_k) as f64 * 3.0 * 2.0 * d.inter as f64 * lat;
    f
}

/// Keeps an `Arc` alive for as long as views into it exist.
pub type Keep = Arc<DevMem>;

/// Checks the device has room for `bytes` more.
pub fn ensure_room(b: &CudaBackend, bytes: usize, what: &str) -> Result<()> {
    let (free, total) = b.gpu.mem_info()?;
    ensure!(bytes <= free, "{what}: needs {:.1} GB, the GPU has {:.1} of {:.1} GB free", bytes as f64 / 1e9, free as f64 / 1e9, total as f64 / 1e9);
    Ok(())
}
