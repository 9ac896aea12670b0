//! The Kimi K3 text tower on MLX, written to read like spec §3 (section numbers in comments).
//!
//! Activations are `[T, hidden]` for the `T` tokens of one call (a prefill chunk, or one decode
//! token); everything runs in f32 (BF16 weights widened). Per-sequence state lives in
//! [`ModelCache`]: KDA recurrent state + conv windows, MLA latent rows.

use anyhow::{bail, Result};
use mlx_rs::ops::indexing::{Ellipsis, TryIndexOp};
use mlx_rs::{fast, linalg, ops, Array, Dtype, Stream};

use k3_protocol::config::spec::{KDA_CHUNK, KDA_L2_EPS, MLA_LATENT_NORM_EPS};
use k3_protocol::config::{AttnKind, FfnKind, LayerSpec, TextConfig};
use k3_protocol::tensors::text_tensor;

use super::cache::{KdaCache, LayerCache, MlaCache, ModelCache};
use super::weights::WeightLoader;
use crate::distributed::{expert_range, Group};
use crate::mlx::{gather_qmm_mxfp4, Mxfp4Array};

/// How KDA consumes a run of tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdaMode {
    /// The delta-rule recurrence token by token (§3.3; decode).
    Recurrent,
    /// The chunked parallel form with 64-token chunks (§3.4; prefill).
    Chunked,
}

// ---------------------------------------------------------------------------------------------
// Small pieces

/// `x · Wᵀ` for a checkpoint weight `W[out, in]`: the product in the weight's dtype (BF16 GEMM
/// inputs in BF16 mode), the result widened to f32, so activations and the residual stream stay
/// in FP32, as the CUDA backend's BF16 mode keeps its residual stream (a BF16 residual stream put
/// tiny-t's top-1 agreement with the f32 reference below 98 %; see docs/engine-agreement.md).
fn linear(x: &Array, w: &Array) -> Result<Array> {
    f32(&cast(x, w.dtype())?.matmul(w.t())?)
}

/// RMSNorm in the input's dtype (MLX accumulates in f32).
fn rms_norm(x: &Array, w: &Array, eps: f32) -> Result<Array> {
    Ok(fast::rms_norm(x, Some(&cast(w, x.dtype())?), eps)?)
}

/// `x` as `dtype` (a no-op when it already is).
fn cast(x: &Array, dtype: Dtype) -> Result<Array> {
    Ok(if x.dtype() == dtype { x.clone() } else { x.as_dtype(dtype)? })
}

fn f32(x: &Array) -> Result<Array> {
    cast(x, Dtype::Float32)
}

fn sigmoid(x: &Array) -> Result<Array> {
    Ok(ops::sigmoid(x)?)
}

fn silu(x: &Array) -> Result<Array> {
    Ok(x * sigmoid(x)?)
}

/// Columns `a..b` of the last axis.
fn cols(x: &Array, a: i32, b: i32) -> Result<Array> {
    Ok(x.try_index((Ellipsis, a..b))?)
}

/// SiTU-GLU (§3.6): `β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂)`; a null β₂ leaves `u` linear.
#[derive(Debug, Clone, Copy)]
struct Situ {
    beta: f32,
    linear_beta: Option<f32>,
}

impl Situ {
    /// FP32 math; the result in `g`'s dtype.
    fn apply(&self, g: &Array, u: &Array) -> Result<Array> {
        let dtype = g.dtype();
        let (g, u) = (&f32(g)?, &f32(u)?);
        let gate = ops::tanh(g * (1.0 / self.beta))? * self.beta * sigmoid(g)?;
        let up = match self.linear_beta {
            Some(b2) => ops::tanh(u * (1.0 / b2))? * b2,
            None => u.clone(),
        };
        cast(&(gate * up), dtype)
    }
}

// ---------------------------------------------------------------------------------------------
// §3.2 AttnRes: softmax attention over depth, one scalar score per candidate.

struct AttnRes {
    /// `res_norm.weight ⊙ res_proj.weight`, `[H]`.
    score: Array,
}

impl AttnRes {
    fn load(wl: &mut WeightLoader, norm: &str, proj: &str, h: usize) -> Result<Self> {
        let n = wl.dense_f32(norm)?;
        let p = wl.dense_f32(proj)?.reshape(&[h as i32])?;
        Ok(AttnRes { score: n * p })
    }

    /// Mixes the bank `B` and the running sum `P` (each `[T, H]`), in FP32; the result in
    /// `P`'s dtype.
    fn mix(&self, bank: &[Array], p: &Array, eps: f32) -> Result<Array> {
        let mut cands: Vec<&Array> = bank.iter().collect();
        cands.push(p);
        let v = f32(&ops::stack(&cands, 0)?)?; // [n+1, T, H]
        let k = &v * ops::rsqrt(v.square()?.mean_axis(-1, true)? + eps)?;
        let s = (k * &self.score).sum_axis(-1, false)?; // [n+1, T]
        let alpha = ops::softmax_axis(&s, 0, true)?;
        cast(&(ops::expand_dims(&alpha, -1)? * v).sum_axis(0, false)?, p.dtype())
    }
}

// ---------------------------------------------------------------------------------------------
// §3.3 / §3.4 KDA (Kimi Delta Attention)

struct Kda {
    heads: i32,
    dim: i32,
    q_proj: Array,
    k_proj: Array,
    v_proj: Array,
    /// Depthwise conv taps `[C, kernel]` (f32; tap `kernel-1` multiplies the current token).
    q_conv: Array,
    k_conv: Array,
    v_conv: Array,
    f_a: Array,
    f_b: Array,
    dt_bias: Array,
    /// `exp(A_log[:heads])`, `[heads, 1]`.
    a: Array,
    b_proj: Array,
    g_proj: Array,
    o_norm: Array,
    o_proj: Array,
    gate_lower_bound: f32,
    eps: f32,
}

impl Kda {
    fn load(wl: &mut WeightLoader, c: &TextConfig, l: usize) -> Result<Self> {
        let la = &c.linear_attn_config;
        let (w, d, k) = (c.kda_width(), la.head_dim, la.short_conv_kernel_size);
        let Some(lb) = la.gate_lower_bound else {
            bail!("layer {l}: linear_attn_config.gate_lower_bound is null; only K3's bounded KDA gate is implemented");
        };
        let conv =
            |wl: &mut WeightLoader, p: &str| -> Result<Array> { Ok(wl.layer_f32(l, &format!("self_attn.{p}_conv1d.weight"))?.reshape(&[w as i32, k as i32])?) };
        let a_log = wl.layer_prefix(l, "self_attn.A_log", la.num_heads)?;
        Ok(Kda {
            heads: la.num_heads as i32,
            dim: d as i32,
            q_proj: wl.layer(l, "self_attn.q_proj.weight")?,
            k_proj: wl.layer(l, "self_attn.k_proj.weight")?,
            v_proj: wl.layer(l, "self_attn.v_proj.weight")?,
            q_conv: conv(wl, "q")?,
            k_conv: conv(wl, "k")?,
            v_conv: conv(wl, "v")?,
            f_a: wl.layer(l, "self_attn.f_a_proj.weight")?,
            f_b: wl.layer(l, "self_attn.f_b_proj.weight")?,
            dt_bias: wl.layer_f32(l, "self_attn.dt_bias")?.reshape(&[la.num_heads as i32, d as i32])?,
            a: a_log.exp()?.reshape(&[la.num_heads as i32, 1])?,
            b_proj: wl.layer(l, "self_attn.b_proj.weight")?,
            g_proj: wl.layer(l, "self_attn.g_proj.weight")?,
            o_norm: wl.layer_f32(l, "self_attn.o_norm.weight")?,
            o_proj: wl.layer(l, "self_attn.o_proj.weight")?,
            gate_lower_bound: lb,
            eps: c.rms_norm_eps,
        })
    }

    /// §3.3 step 2: causal depthwise conv over `[window; x]`, then SiLU, for `B` sequences at
    /// once: windows `[B, kernel-1, C]`, inputs `[B, T, C]`. Returns the outputs `[B, T, C]` and
    /// the new windows (the last `kernel-1` pre-conv inputs).
    fn short_conv(window: &Array, x: &Array, taps: &Array) -> Result<(Array, Array)> {
        let t = x.shape()[1];
        let kernel = taps.shape()[1];
        let full = ops::concatenate(&[window, x], 1)?; // [B, T + kernel-1, C]
        let mut y: Option<Array> = None;
        for j in 0..kernel {
            let term = full.try_index((.., j..j + t))? * taps.try_index((.., j))?;
            y = Some(match y {
                None => term,
                Some(acc) => acc + term,
            });
        }
        let new_window = full.try_index((.., t..t + kernel - 1))?;
        Ok((silu(&y.expect("kernel >= 2"))?, new_window))
    }

    /// `x / sqrt(Σx² + 1e-6)` over the last axis.
    fn l2norm(x: &Array) -> Result<Array> {
        Ok(x * ops::rsqrt(x.square()?.sum_axis(-1, true)? + KDA_L2_EPS)?)
    }

    /// `x` holds `T` rows of each of the `B` sequences of `caches` (sequence-major); their
    /// states advance together (`B` > 1: decode steps, `T` = 1).
    fn forward(&self, x: &Array, caches: &mut [&mut KdaCache], mode: KdaMode) -> Result<Array> {
        let b = caches.len() as i32;
        let rows = x.shape()[0];
        let t = rows / b;
        let (h, d) = (self.heads, self.dim);
        // the sequences' states stacked on a leading axis
        let stack = |f: fn(&KdaCache) -> &Array| -> Result<Array> {
            if b == 1 {
                return Ok(ops::expand_dims(f(caches[0]), 0)?);
            }
            let parts: Vec<&Array> = caches.iter().map(|c| f(c)).collect();
            Ok(ops::stack(&parts, 0)?)
        };
        let (cq, ck, cv) = (stack(|c| &c.conv_q)?, stack(|c| &c.conv_k)?, stack(|c| &c.conv_v)?);
        let state = stack(|c| &c.state)?.reshape(&[b * h, d, d])?;
        // 1-2. projections, short conv + SiLU (windows carried in the cache)
        // (projections in the weights' dtype; conv, gates and the recurrence in FP32)
        let proj = |w: &Array| -> Result<Array> { Ok(f32(&linear(x, w)?)?.reshape(&[b, t, h * d])?) };
        let (q, wq) = Self::short_conv(&cq, &proj(&self.q_proj)?, &self.q_conv)?;
        let (k, wk) = Self::short_conv(&ck, &proj(&self.k_proj)?, &self.k_conv)?;
        let (v, wv) = Self::short_conv(&cv, &proj(&self.v_proj)?, &self.v_conv)?;
        // 3-4. heads, L2 norm, q scaled by D^-1/2; head-major per sequence [B·H, T, D]
        let heads = |a: &Array| -> Result<Array> { Ok(a.reshape(&[b, t, h, d])?.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b * h, t, d])?) };
        let q = Self::l2norm(&heads(&q)?)? * (d as f32).powf(-0.5);
        let k = Self::l2norm(&heads(&k)?)?;
        let v = heads(&v)?;
        // 5. bounded decay gate g = lb·σ(exp(A_log[h])·z), z = W_fb W_fa x + dt_bias
        let z = f32(&linear(&linear(x, &self.f_a)?, &self.f_b)?)?.reshape(&[rows, h, d])? + &self.dt_bias;
        let g = sigmoid(&(z * &self.a))? * self.gate_lower_bound;
        let g = heads(&g)?;
        // 6. write strength β = σ(W_b x), [B·H, T]
        let beta = sigmoid(&f32(&linear(x, &self.b_proj)?)?)?.reshape(&[b, t, h])?.transpose_axes(&[0, 2, 1])?.reshape(&[b * h, t])?;
        // 7. delta rule
        let mut state = state;
        let o = match mode {
            KdaMode::Recurrent => kda_recurrent(&q, &k, &v, &g, &beta, &mut state)?,
            KdaMode::Chunked => kda_chunked(&q, &k, &v, &g, &beta, &mut state)?,
        };
        // the new states and windows back to their sequences
        let state = state.reshape(&[b, h, d, d])?;
        for (i, c) in caches.iter_mut().enumerate() {
            let i = i as i32;
            c.state = state.try_index(i)?;
            c.conv_q = wq.try_index(i)?;
            c.conv_k = wk.try_index(i)?;
            c.conv_v = wv.try_index(i)?;
        }
        // 8. gated RMSNorm per head: RMSNorm(o)·o_norm·σ(W_g x)
        let o = o.reshape(&[b, h, t, d])?.transpose_axes(&[0, 2, 1, 3])?.reshape(&[rows, h, d])?; // [B·T, H, D]
        let gate = sigmoid(&f32(&linear(x, &self.g_proj)?)?.reshape(&[rows, h, d])?)?;
        let o = rms_norm(&o, &self.o_norm, self.eps)? * gate;
        // 9. output projection
        linear(&o.reshape(&[rows, h * d])?, &self.o_proj)
    }
}

/// §3.3 step 7, token by token: `S' = diag(exp g)·S; S = S' + β k ⊗ (v − S'ᵀk); o = Sᵀq`.
/// Inputs head-major `[H, T, D]` (β `[H, T]`), state `[H, K, V]`.
pub fn kda_recurrent(q: &Array, k: &Array, v: &Array, g: &Array, beta: &Array, state: &mut Array) -> Result<Array> {
    let t = q.shape()[1];
    let mut outs = Vec::with_capacity(t as usize);
    let mut s = state.clone();
    for i in 0..t {
        let at = |a: &Array| -> Result<Array> { Ok(a.try_index((.., i..i + 1))?) }; // [H, 1, D]
        let (qt, kt, vt, gt) = (at(q)?, at(k)?, at(v)?, at(g)?);
        let bt = at(beta)?; // [H, 1]
        s = gt.exp()?.transpose_axes(&[0, 2, 1])? * &s; // decay rows (key axis)
        let kv = kt.matmul(&s)?; // [H, 1, V] = S'ᵀ k
        let delta = (vt - kv) * ops::expand_dims(&bt, -1)?;
        s = &s + kt.transpose_axes(&[0, 2, 1])?.matmul(&delta)?;
        outs.push(qt.matmul(&s)?); // [H, 1, V]
    }
    *state = s;
    Ok(ops::concatenate(&outs, 1)?)
}

/// §3.4, the chunked parallel form (chunks of [`KDA_CHUNK`] tokens, the last one shorter),
/// equal to the recurrence. Every exponent is of a non-positive number.
pub fn kda_chunked(q: &Array, k: &Array, v: &Array, g: &Array, beta: &Array, state: &mut Array) -> Result<Array> {
    let t = q.shape()[1];
    let mut outs = Vec::new();
    let mut s0 = state.clone();
    let mut c0 = 0;
    while c0 < t {
        let c1 = (c0 + KDA_CHUNK as i32).min(t);
        let l = c1 - c0;
        let sl = |a: &Array| -> Result<Array> { Ok(a.try_index((.., c0..c1))?) };
        let (qc, kc, vc, gc, bc) = (sl(q)?, sl(k)?, sl(v)?, sl(g)?, sl(beta)?);
        let gcum = ops::cumsum(&gc, 1, None, None)?; // G, [H, L, D]
                                                     // exp(G_i − G_j) for j ≤ i (masked to 0 above the diagonal before exponentiating)
        let diff = ops::expand_dims(&gcum, 2)? - ops::expand_dims(&gcum, 1)?; // [H, L, L, D]
        let idx = ops::arange::<_, i32>(None, l, None)?;
        let le = ops::expand_dims(&idx, 1)?.ge(&ops::expand_dims(&idx, 0)?)?; // [L, L], j ≤ i
        let lt = ops::expand_dims(&idx, 1)?.gt(&ops::expand_dims(&idx, 0)?)?; // j < i
        let neg_inf = Array::from_f32(f32::NEG_INFINITY);
        let decay = ops::select(&ops::expand_dims(&le, -1)?, &diff, &neg_inf)?.exp()?;
        // A[i,j] = β_i Σ_d k_i k_j exp(G_i − G_j) (j < i); Q̃K[i,j] likewise with q_i (j ≤ i)
        let kk = (ops::expand_dims(&kc, 2)? * ops::expand_dims(&kc, 1)? * &decay).sum_axis(-1, false)?;
        let a = ops::select(&lt, &kk, Array::from_f32(0.0))? * ops::expand_dims(&bc, -1)?;
        let qk = (ops::expand_dims(&qc, 2)? * ops::expand_dims(&kc, 1)? * &decay).sum_axis(-1, false)?;
        // T_w = (I + A)⁻¹ diag(β): W = T_w (exp(G) ⊙ K), U = T_w V
        let eye = ops::eye::<f32>(l, None, None)?;
        let inv = linalg_cpu(|| linalg::tri_inv(&(a + &eye), Some(false)))?;
        let b = ops::expand_dims(&bc, -1)?;
        let eg = gcum.exp()?;
        let w = inv.matmul(&(&eg * &kc * &b))?;
        let u = inv.matmul(&(&vc * &b))?;
        let vt = u - w.matmul(&s0)?; // Ṽ
        outs.push((&eg * &qc).matmul(&s0)? + qk.matmul(&vt)?);
        // S_next = diag(exp G_L) S₀ + Σ_j (exp(G_L − G_j) ⊙ k_j) ⊗ ṽ_j
        let gl = gcum.try_index((.., l - 1..l))?; // [H, 1, D]
        let kd = (&gl - &gcum).exp()? * &kc; // [H, L, D]
        s0 = gl.exp()?.transpose_axes(&[0, 2, 1])? * &s0 + kd.transpose_axes(&[0, 2, 1])?.matmul(&vt)?;
        c0 = c1;
    }
    *state = s0;
    Ok(ops::concatenate(&outs, 1)?)
}

/// MLX's linear algebra runs on the CPU stream only (also on a Mac, where the default is GPU).
fn linalg_cpu(f: impl FnOnce() -> mlx_rs::error::Result<Array>) -> Result<Array> {
    Ok(mlx_rs::with_stream(&Stream::cpu(), f)?)
}

// ---------------------------------------------------------------------------------------------
// §3.5 MLA (gated, NoPE), absorbed form over the latent cache

struct Mla {
    heads: i32,
    nope: i32,
    rope: i32,
    v_dim: i32,
    rank: i32,
    q_a: Array,
    q_a_norm: Array,
    q_b: Array,
    kv_a: Array,
    kv_a_norm: Array,
    /// `W_UK^h`, `[H, nope, rank]`.
    w_uk: Array,
    /// `W_UV^h` transposed, `[H, rank, v]`.
    w_uv_t: Array,
    g_proj: Array,
    o_proj: Array,
}

impl Mla {
    fn load(wl: &mut WeightLoader, c: &TextConfig, l: usize) -> Result<Self> {
        let nh = c.num_attention_heads;
        let (dn, dr, dv, r) = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank);
        let kv_b = wl.layer(l, "self_attn.kv_b_proj.weight")?;
        let kv_b = kv_b.reshape(&[nh as i32, (dn + dv) as i32, r as i32])?; // per head [k_nope; v]
        Ok(Mla {
            heads: nh as i32,
            nope: dn as i32,
            rope: dr as i32,
            v_dim: dv as i32,
            rank: r as i32,
            q_a: wl.layer(l, "self_attn.q_a_proj.weight")?,
            q_a_norm: wl.layer(l, "self_attn.q_a_layernorm.weight")?,
            q_b: wl.layer(l, "self_attn.q_b_proj.weight")?,
            kv_a: wl.layer(l, "self_attn.kv_a_proj_with_mqa.weight")?,
            kv_a_norm: wl.layer(l, "self_attn.kv_a_layernorm.weight")?,
            w_uk: kv_b.try_index((.., 0..dn as i32))?,
            w_uv_t: kv_b.try_index((.., dn as i32..(dn + dv) as i32))?.transpose_axes(&[0, 2, 1])?,
            g_proj: wl.layer(l, "self_attn.g_proj.weight")?,
            o_proj: wl.layer(l, "self_attn.o_proj.weight")?,
        })
    }

    /// The latent rows of `x`: post-norm `c_kv` then raw `k_pe`, `[T, rank + rope]`.
    fn latent_rows(&self, x: &Array) -> Result<Array> {
        let kv = f32(&linear(x, &self.kv_a)?)?; // the cache is FP32 (canonical hand-off)
        let c_kv = rms_norm(&cols(&kv, 0, self.rank)?, &self.kv_a_norm, MLA_LATENT_NORM_EPS)?;
        let k_pe = cols(&kv, self.rank, self.rank + self.rope)?;
        Ok(ops::concatenate(&[&c_kv, &k_pe], -1)?)
    }

    /// `x` holds `T` rows of each of the `B` sequences of `caches` (sequence-major). Every
    /// sequence attends over its own latent rows (their lengths differ): the projections run
    /// on all rows at once, the attention per sequence.
    fn forward(&self, x: &Array, caches: &mut [&mut MlaCache]) -> Result<Array> {
        let b = caches.len() as i32;
        let rows = x.shape()[0];
        let t = rows / b;
        let (h, dn, dr) = (self.heads, self.nope, self.rope);
        // queries: c_q = RMSNorm(W_qa x), q = W_qb c_q → [H, rows, nope | rope]
        let c_q = rms_norm(&linear(x, &self.q_a)?, &self.q_a_norm, MLA_LATENT_NORM_EPS)?;
        let q = f32(&linear(&c_q, &self.q_b)?)?.reshape(&[rows, h, dn + dr])?.transpose_axes(&[1, 0, 2])?;
        let q_nope = cols(&q, 0, dn)?;
        let q_pe = cols(&q, dn, dn + dr)?;
        // absorbed queries: q̃_h = W_UKᵀ q_nope_h
        let q_abs = q_nope.matmul(&f32(&self.w_uk)?)?; // [H, rows, rank]
        let latent = self.latent_rows(x)?; // [rows, rank + rope]
        let scale = 1.0 / ((dn + dr) as f32).sqrt();
        let mut ctx = Vec::with_capacity(caches.len());
        for (i, cache) in caches.iter_mut().enumerate() {
            let (r0, r1) = (i as i32 * t, (i as i32 + 1) * t);
            let own = |a: &Array| -> Result<Array> {
                if b == 1 {
                    Ok(a.clone())
                } else {
                    Ok(a.try_index((.., r0..r1))?)
                }
            };
            let past = cache.rows() as i32;
            // the latent cache, with this call's rows appended: segments [n_i, rank + rope]
            let segs = cache.append(&if b == 1 { latent.clone() } else { latent.try_index(r0..r1)? })?;
            let (q_abs_i, q_pe_i) = (own(&q_abs)?, own(&q_pe)?);
            let mut c_kvs = Vec::with_capacity(segs.len());
            let mut parts = Vec::with_capacity(segs.len());
            for seg in &segs {
                let c_kv = cols(seg, 0, self.rank)?;
                let k_pe = cols(seg, self.rank, self.rank + dr)?;
                // q̃·c_kv + q_pe·k_pe, per segment of keys
                parts.push(q_abs_i.matmul(c_kv.t())? + q_pe_i.matmul(k_pe.t())?);
                c_kvs.push(c_kv);
            }
            // (q̃·c_kv + q_pe·k_pe)/√(nope+rope)
            let scores = if parts.len() == 1 { parts.pop().expect("one") } else { ops::concatenate(&parts, -1)? } * scale;
            let n = past + t;
            let scores = if t > 1 {
                // causal: query t (absolute past + t) sees keys s ≤ past + t
                let qpos = ops::arange::<_, i32>(past, n, None)?;
                let kpos = ops::arange::<_, i32>(None, n, None)?;
                let ok = ops::expand_dims(&kpos, 0)?.le(&ops::expand_dims(&qpos, 1)?)?; // [T, n]
                ops::select(&ok, &scores, Array::from_f32(f32::NEG_INFINITY))?
            } else {
                scores
            };
            let p = ops::softmax_axis(&scores, -1, true)?;
            // Σ_s p_s c_kv,s, [H, T, rank], segment by segment
            let mut acc: Option<Array> = None;
            let mut k0 = 0;
            for c_kv in &c_kvs {
                let k1 = k0 + c_kv.shape()[0];
                let p_i = if c_kvs.len() == 1 { p.clone() } else { p.try_index((.., .., k0..k1))? };
                let part = p_i.matmul(c_kv)?;
                acc = Some(match acc {
                    None => part,
                    Some(a) => a + part,
                });
                k0 = k1;
            }
            ctx.push(acc.expect("at least the rows of this call"));
        }
        let ctx = if ctx.len() == 1 { ctx.pop().expect("one") } else { ops::concatenate(&ctx, 1)? };
        // ō_h = W_UV^h (Σ_s p_s c_kv,s)
        let o = ctx.matmul(&f32(&self.w_uv_t)?)?; // [H, rows, v]
        let o = o.transpose_axes(&[1, 0, 2])?.reshape(&[rows, h * self.v_dim])?;
        let o = o * sigmoid(&f32(&linear(x, &self.g_proj)?)?)?;
        linear(&o, &self.o_proj)
    }
}

// ---------------------------------------------------------------------------------------------
// §3.6 FFN blocks

struct DenseMlp {
    gate: Array,
    up: Array,
    down: Array,
}

impl DenseMlp {
    fn forward(&self, x: &Array, situ: Situ) -> Result<Array> {
        linear(&situ.apply(&linear(x, &self.gate)?, &linear(x, &self.up)?)?, &self.down)
    }
}

struct LatentMoe {
    top_k: i32,
    renormalize: bool,
    scaling: f32,
    router: Array,
    router_bias: Array,
    down_proj: Array,
    latent_norm: Option<Array>,
    up_proj: Array,
    /// Routed experts, MXFP4 stacks `[E, out, in]`: w1 gate, w3 up, w2 down (with ranks: only
    /// this rank's block `[experts.len(), out, in]`).
    w1: Mxfp4Array,
    w3: Mxfp4Array,
    w2: Mxfp4Array,
    shared: DenseMlp,
    eps: f32,
    /// Expert parallel: the group and this rank's experts; `None` in a single process.
    shard: Option<ExpertShard>,
}

/// The routed experts one rank holds, and the group that sums the ranks' partial outputs.
struct ExpertShard {
    group: &'static Group,
    experts: std::ops::Range<usize>,
}

impl LatentMoe {
    fn load(wl: &mut WeightLoader, c: &TextConfig, l: usize, group: Option<&'static Group>) -> Result<Self> {
        let (e, lat, inter) = (c.experts_in_layer(l), c.routed_expert_hidden_size, c.moe_intermediate_size);
        let p = |s: &str| format!("block_sparse_moe.{s}");
        let shard = group.filter(|g| g.is_distributed()).map(|group| ExpertShard { group, experts: expert_range(e, group.rank(), group.size()) });
        let mine = shard.as_ref().map_or(0..e, |s| s.experts.clone());
        Ok(LatentMoe {
            top_k: c.num_experts_per_token as i32,
            renormalize: c.moe_renormalize,
            scaling: c.routed_scaling_factor,
            router: wl.layer_f32(l, &p("gate.weight"))?,
            router_bias: wl.layer_f32(l, &p("gate.e_score_correction_bias"))?,
            down_proj: wl.layer(l, &p("routed_expert_down_proj.weight"))?,
            latent_norm: if c.latent_moe_use_norm { Some(wl.layer(l, &p("routed_expert_norm.weight"))?) } else { None },
            up_proj: wl.layer(l, &p("routed_expert_up_proj.weight"))?,
            w1: wl.experts(l, mine.clone(), "w1", inter, lat)?,
            w3: wl.experts(l, mine.clone(), "w3", inter, lat)?,
            w2: wl.experts(l, mine, "w2", lat, inter)?,
            shared: DenseMlp {
                gate: wl.layer(l, &p("shared_experts.gate_proj.weight"))?,
                up: wl.layer(l, &p("shared_experts.up_proj.weight"))?,
                down: wl.layer(l, &p("shared_experts.down_proj.weight"))?,
            },
            eps: c.rms_norm_eps,
            shard,
        })
    }

    fn forward(&self, x: &Array, situ: Situ) -> Result<Array> {
        let t = x.shape()[0];
        // router (FP32): sigmoid scores; the correction bias only selects
        let s = sigmoid(&linear(&f32(x)?, &self.router)?)?; // [T, E]
        let biased = &s + &self.router_bias;
        let sel = ops::argpartition_axis(&ops::negative(&biased)?, self.top_k - 1, -1)?;
        let sel = sel.try_index((.., 0..self.top_k))?; // [T, k]
        let mut w = s.take_along_axis(&sel, -1)?;
        if self.renormalize {
            w = &w / (w.sum_axis(-1, true)? + 1e-20);
        }
        let w = w * self.scaling;
        // routed experts in latent space: y_e = W2_e · SiTU(W1_e x_lat, W3_e x_lat)
        let x_lat = linear(x, &self.down_proj)?;
        let mut r = match &self.shard {
            None => {
                let x_lat = x_lat.reshape(&[t, 1, 1, -1])?;
                let g = gather_qmm_mxfp4(&x_lat, &self.w1, &sel, false)?; // [T, k, 1, inter]
                let u = gather_qmm_mxfp4(&x_lat, &self.w3, &sel, false)?;
                let y = gather_qmm_mxfp4(&situ.apply(&g, &u)?, &self.w2, &sel, false)?; // [T, k, 1, lat]
                let y = y.squeeze_axes(&[2])?;
                (f32(&y)? * ops::expand_dims(&w, -1)?).sum_axis(1, false)? // Σ_j w_j y_j, FP32
            }
            Some(shard) => shard.group.all_sum(&self.local_experts(shard, &x_lat, &sel, &w, situ)?)?,
        };
        if let Some(n) = &self.latent_norm {
            r = rms_norm(&r, n, self.eps)?;
        }
        let r = linear(&r, &self.up_proj)?;
        Ok(r + self.shared.forward(x, situ)?)
    }

    /// Expert parallel: this rank's share of `Σ_j w_j y_j`, f32 `[T, lat]` — the selections
    /// `(t, j)` that fall in its experts, and zeros for the rest (the ranks' shares sum to the
    /// single-process value). The selection is read back to the host so that only the experts
    /// actually chosen here are computed (a fixed-shape masked gather would run all `k` slots
    /// on every rank and read `k` experts per rank, not `k / ranks`).
    fn local_experts(&self, shard: &ExpertShard, x_lat: &Array, sel: &Array, w: &Array, situ: Situ) -> Result<Array> {
        let (t, k) = (sel.shape()[0], sel.shape()[1]);
        let lat = x_lat.shape()[1];
        let sel = sel.as_dtype(Dtype::Int32)?;
        sel.eval()?;
        let (e0, e1) = (shard.experts.start as i32, shard.experts.end as i32);
        // (flat selection index, local expert), ordered by expert for the gathered matmul
        let mut picks: Vec<(i32, i32)> =
            sel.as_slice::<i32>().iter().enumerate().filter(|(_, &e)| e >= e0 && e < e1).map(|(i, &e)| (i as i32, e - e0)).collect();
        if picks.is_empty() {
            return Ok(ops::zeros::<f32>(&[t, lat])?);
        }
        picks.sort_by_key(|&(i, e)| (e, i));
        let p = picks.len() as i32;
        let flat: Vec<i32> = picks.iter().map(|&(i, _)| i).collect();
        let local: Vec<i32> = picks.iter().map(|&(_, e)| e).collect();
        let rows: Vec<i32> = flat.iter().map(|&i| i / k).collect();
        let flat = Array::from_slice(&flat, &[p]);
        let rows = Array::from_slice(&rows, &[p]);
        let local = Array::from_slice(&local, &[p]);
        let xs = x_lat.take_axis(&rows, 0)?.reshape(&[p, 1, lat])?; // [P, M=1, lat], batch P
        let g = gather_qmm_mxfp4(&xs, &self.w1, &local, true)?; // [P, 1, inter]
        let u = gather_qmm_mxfp4(&xs, &self.w3, &local, true)?;
        let y = gather_qmm_mxfp4(&situ.apply(&g, &u)?, &self.w2, &local, true)?.reshape(&[p, lat])?;
        let wp = w.reshape(&[t * k])?.take_axis(&flat, 0)?; // [P]
                                                            // scatter-add the weighted rows back to their tokens: onehot[t, p] · w_p · y_p
        let onehot = ops::arange::<_, i32>(None, t, None)?.reshape(&[t, 1])?.eq(&rows.reshape(&[1, p])?)?;
        let route = onehot.as_dtype(Dtype::Float32)? * wp.reshape(&[1, p])?;
        Ok(route.matmul(&f32(&y)?)?)
    }
}

enum Attention {
    Kda(Kda),
    Mla(Mla),
}

enum Ffn {
    Dense(DenseMlp),
    Moe(LatentMoe),
}

struct DecoderLayer {
    spec: LayerSpec,
    input_norm: Array,
    post_norm: Array,
    attn_res: AttnRes,
    mlp_res: AttnRes,
    attn: Attention,
    ffn: Ffn,
}

impl DecoderLayer {
    fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.input_norm, &self.post_norm, &self.attn_res.score, &self.mlp_res.score];
        match &self.attn {
            Attention::Kda(a) => v.extend([
                &a.q_proj, &a.k_proj, &a.v_proj, &a.q_conv, &a.k_conv, &a.v_conv, &a.f_a, &a.f_b, &a.dt_bias, &a.a, &a.b_proj, &a.g_proj, &a.o_norm, &a.o_proj,
            ]),
            Attention::Mla(a) => v.extend([&a.q_a, &a.q_a_norm, &a.q_b, &a.kv_a, &a.kv_a_norm, &a.w_uk, &a.w_uv_t, &a.g_proj, &a.o_proj]),
        }
        match &self.ffn {
            Ffn::Dense(d) => v.extend([&d.gate, &d.up, &d.down]),
            Ffn::Moe(m) => {
                v.extend([&m.router, &m.router_bias, &m.down_proj, &m.up_proj]);
                v.extend(m.latent_norm.as_ref());
                for q in [&m.w1, &m.w3, &m.w2] {
                    v.extend([&q.weight, &q.scales]);
                }
                v.extend([&m.shared.gate, &m.shared.up, &m.shared.down]);
            }
        }
        v
    }

    fn load(wl: &mut WeightLoader, c: &TextConfig, spec: LayerSpec, group: Option<&'static Group>) -> Result<Self> {
        let (l, h) = (spec.index, c.hidden_size);
        let name = |s: &str| k3_protocol::tensors::layer_tensor(l, s);
        Ok(DecoderLayer {
            spec,
            input_norm: wl.layer(l, "input_layernorm.weight")?,
            post_norm: wl.layer(l, "post_attention_layernorm.weight")?,
            attn_res: AttnRes::load(wl, &name("self_attention_res_norm.weight"), &name("self_attention_res_proj.weight"), h)?,
            mlp_res: AttnRes::load(wl, &name("mlp_res_norm.weight"), &name("mlp_res_proj.weight"), h)?,
            attn: match spec.attn {
                AttnKind::Kda => Attention::Kda(Kda::load(wl, c, l)?),
                AttnKind::Mla => Attention::Mla(Mla::load(wl, c, l)?),
            },
            ffn: match spec.ffn {
                FfnKind::Dense => Ffn::Dense(DenseMlp {
                    gate: wl.layer(l, "mlp.gate_proj.weight")?,
                    up: wl.layer(l, "mlp.up_proj.weight")?,
                    down: wl.layer(l, "mlp.down_proj.weight")?,
                }),
                FfnKind::LatentMoe => Ffn::Moe(LatentMoe::load(wl, c, l, group)?),
            },
        })
    }
}

// ---------------------------------------------------------------------------------------------
// §3.1 / §3.7 the whole text tower

/// The K3 text model on MLX.
pub struct K3Text {
    pub config: TextConfig,
    /// dtype of weights and activations between the FP32 islands (f32 or bf16).
    pub dtype: Dtype,
    embed: Array,
    layers: Vec<DecoderLayer>,
    out_res: AttnRes,
    norm: Array,
    lm_head: Array,
    situ: Situ,
}

impl K3Text {
    /// Loads every text weight; `progress` is called after each layer with (done, total).
    /// With a distributed `group` (decoder ranks) only this rank's routed experts are loaded and
    /// the MoE layers sum the ranks' shares; everything else is replicated.
    pub fn load(wl: &mut WeightLoader, c: &TextConfig, group: Option<&'static Group>, mut progress: impl FnMut(usize, usize)) -> Result<Self> {
        let h = c.hidden_size;
        let embed = wl.dense(&text_tensor("model.embed_tokens.weight"))?;
        let plan = c.layer_plan();
        let mut layers = Vec::with_capacity(plan.len());
        for (i, spec) in plan.iter().enumerate() {
            let layer = DecoderLayer::load(wl, c, *spec, group)?;
            // the layer's bytes against the digest (once, as they were read; the embedding with it)
            wl.check_read()?;
            // materialise derived weights (fused scores, transposes) once, not per forward
            mlx_rs::transforms::eval(layer.arrays())?;
            layers.push(layer);
            progress(i + 1, plan.len());
        }
        let out_res = AttnRes::load(wl, &text_tensor("model.output_attn_res_norm.weight"), &text_tensor("model.output_attn_res_proj.weight"), h)?;
        let norm = wl.dense(&text_tensor("model.norm.weight"))?;
        let lm_head = wl.dense(&text_tensor("lm_head.weight"))?;
        wl.check_read()?;
        Ok(K3Text {
            config: c.clone(),
            dtype: wl.dtype,
            embed,
            layers,
            out_res,
            norm,
            lm_head,
            situ: Situ { beta: c.activation_situ_beta, linear_beta: c.activation_situ_linear_beta },
        })
    }

    /// Token embeddings `[T, H]` (ids must be < vocab: checked by the caller).
    pub fn embed(&self, ids: &Array) -> Result<Array> {
        Ok(self.embed.take_axis(ids, 0)?)
    }

    /// The text forward of §3.1 over `x` `[T, H]` (embeddings of the next T tokens), advancing
    /// `cache`. Returns the final normed hidden states `[T, H]` (feed to [`Self::logits`]).
    pub fn forward(&self, x: &Array, cache: &mut ModelCache, kda_mode: KdaMode) -> Result<Array> {
        self.forward_batch(x, &mut [cache], kda_mode)
    }

    /// [`Self::forward`] of several sequences at once: `x` `[B·T, H]` holds the next `T`
    /// tokens of each of the `B` sequences of `caches` (sequence-major). Every row-wise part
    /// (projections, norms, MoE, AttnRes) runs on all rows together — one pass over the
    /// weights for the whole batch; KDA states advance stacked, MLA attends per sequence.
    pub fn forward_batch(&self, x: &Array, caches: &mut [&mut ModelCache], kda_mode: KdaMode) -> Result<Array> {
        let eps = self.config.rms_norm_eps;
        let b = caches.len();
        let rows = x.shape()[0] as usize;
        if b == 0 || !rows.is_multiple_of(b) {
            bail!("{rows} input rows do not split evenly over {b} sequences");
        }
        let t = rows / b;
        let mut p: Option<Array> = Some(f32(x)?); // P := embedding (FP32 residual stream)
        let mut bank: Vec<Array> = Vec::new(); // B
        for (li, layer) in self.layers.iter().enumerate() {
            let cur = p.take().expect("P is set between layers");
            let h = if bank.is_empty() { cur.clone() } else { layer.attn_res.mix(&bank, &cur, eps)? };
            let mut cur = Some(cur);
            if layer.spec.bank_boundary {
                bank.push(cur.take().expect("P")); // bank the raw running sum, restart
            }
            let xin = rms_norm(&h, &layer.input_norm, eps)?;
            let kind_mismatch = || anyhow::anyhow!("layer {}: cache kind does not match the layer kind", layer.spec.index);
            let u = match &layer.attn {
                Attention::Kda(a) => {
                    let mut cs = Vec::with_capacity(b);
                    for c in caches.iter_mut() {
                        match c.layers.get_mut(li) {
                            Some(LayerCache::Kda(k)) => cs.push(k),
                            _ => return Err(kind_mismatch()),
                        }
                    }
                    a.forward(&xin, &mut cs, kda_mode)?
                }
                Attention::Mla(a) => {
                    let mut cs = Vec::with_capacity(b);
                    for c in caches.iter_mut() {
                        match c.layers.get_mut(li) {
                            Some(LayerCache::Mla(m)) => cs.push(m),
                            _ => return Err(kind_mismatch()),
                        }
                    }
                    a.forward(&xin, &mut cs)?
                }
            };
            let pu = match cur {
                None => u,
                Some(prev) => prev + u,
            };
            let h2 = layer.mlp_res.mix(&bank, &pu, eps)?;
            let xm = rms_norm(&h2, &layer.post_norm, eps)?;
            let m = match &layer.ffn {
                Ffn::Dense(d) => d.forward(&xm, self.situ)?,
                Ffn::Moe(moe) => moe.forward(&xm, self.situ)?,
            };
            p = Some(pu + m);
        }
        for c in caches.iter_mut() {
            c.tokens += t;
        }
        let z = self.out_res.mix(&bank, &p.expect("P after the last layer"), eps)?;
        rms_norm(&z, &self.norm, eps)
    }

    /// `lm_head` over normed hidden states `[T, H]` → f32 `[T, vocab]`. In BF16 mode the
    /// operands are BF16 (the hidden state rounded, the weight as stored) and the product is
    /// accumulated and kept in f32: a BF16 product rounds every logit to 8 significant bits
    /// (steps of 0.06 at a logit of 10), which flips near ties of the greedy token.
    pub fn logits(&self, hidden: &Array) -> Result<Array> {
        let x = f32(&cast(hidden, self.lm_head.dtype())?)?;
        Ok(x.matmul(f32(&self.lm_head)?.t())?)
    }

    /// Every weight array.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![&self.embed, &self.lm_head, &self.norm, &self.out_res.score];
        for l in &self.layers {
            v.extend(l.arrays());
        }
        v
    }

    /// Bytes of all weights held in MLX.
    pub fn weight_bytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }

    /// Weight bytes one decode step reads: everything except the embedding table (one row is
    /// read) and the routed experts that are not selected (`top_k` of `E` per MoE layer).
    pub fn decode_weight_bytes(&self) -> usize {
        let vocab = self.config.vocab_size.max(1);
        let mut n = self.weight_bytes() - self.embed.nbytes() + self.embed.nbytes() / vocab;
        for l in &self.layers {
            if let Ffn::Moe(m) = &l.ffn {
                let all = m.w1.nbytes() + m.w2.nbytes() + m.w3.nbytes();
                // This layer's experts (the router's rows): pruned per layer, counts differ.
                let e = m.router.shape().first().copied().unwrap_or(1).max(1) as usize;
                n = n - all + all * self.config.num_experts_per_token / e;
            }
        }
        n
    }
}
