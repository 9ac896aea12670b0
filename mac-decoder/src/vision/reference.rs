//! MoonViT-V2 and the projector in plain f32 on the CPU (spec §5.2–5.4): the readable
//! reference the MLX tower is checked against, and a way to localise a mismatch stage by stage.

use rayon::prelude::*;

use super::encoder::{NormEps, VisionError, VisionTrace};
use super::positions::{interpolate_pos_emb, rope_2d};
use super::preprocess::PreprocessedImage;
use super::weights::VisionWeights;

/// `x · Wᵀ` for `x [m, k]` and `w [n, k]` (the checkpoint's `[out, in]` layout).
pub fn matmul_t(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), n * k);
    let mut out = vec![0f32; m * n];
    out.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
        let xi = &x[i * k..(i + 1) * k];
        for (j, o) in row.iter_mut().enumerate() {
            *o = dot(xi, &w[j * k..(j + 1) * k]);
        }
    });
    out
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Row-wise RMSNorm in f32: `x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = x.to_vec();
    for row in out.chunks_exact_mut(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * r * g;
        }
    }
    out
}

pub fn gelu_tanh(x: f32) -> f32 {
    let c = (2.0f32 / std::f32::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

pub fn gelu_erf(x: f32) -> f32 {
    (0.5 * x as f64 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2))) as f32
}

/// Rotates `(2p, 2p+1)` pairs of every head of `x [n, heads, hd]` by the tables of [`rope_2d`].
fn apply_rope(x: &mut [f32], n: usize, heads: usize, hd: usize, cos: &[f32], sin: &[f32]) {
    let half = hd / 2;
    for i in 0..n {
        for h in 0..heads {
            let v = &mut x[(i * heads + h) * hd..][..hd];
            for p in 0..half {
                let (c, s) = (cos[i * half + p], sin[i * half + p]);
                let (a, b) = (v[2 * p], v[2 * p + 1]);
                v[2 * p] = a * c - b * s;
                v[2 * p + 1] = a * s + b * c;
            }
        }
    }
}

/// Bidirectional softmax attention of `q, k, v [n, heads, hd]` → `[n, heads · hd]`.
fn attention(q: &[f32], k: &[f32], v: &[f32], n: usize, heads: usize, hd: usize) -> Vec<f32> {
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * heads * hd];
    out.par_chunks_mut(heads * hd).enumerate().for_each(|(i, orow)| {
        let mut s = vec![0f32; n];
        for h in 0..heads {
            let qi = &q[(i * heads + h) * hd..][..hd];
            let mut mx = f32::NEG_INFINITY;
            for (j, sj) in s.iter_mut().enumerate() {
                *sj = dot(qi, &k[(j * heads + h) * hd..][..hd]) * scale;
                mx = mx.max(*sj);
            }
            let mut z = 0f32;
            for sj in s.iter_mut() {
                *sj = (*sj - mx).exp();
                z += *sj;
            }
            let o = &mut orow[h * hd..][..hd];
            for (j, &p) in s.iter().enumerate() {
                let vj = &v[(j * heads + h) * hd..][..hd];
                for (oc, &vc) in o.iter_mut().zip(vj) {
                    *oc += p * vc;
                }
            }
            for oc in o.iter_mut() {
                *oc /= z;
            }
        }
    });
    out
}

/// sd2_tpool merge of `x [h · w, d]` (t = 1): one row per `mh × mw` neighbourhood, the
/// neighbourhood concatenated in (row-in-kernel, col-in-kernel) order.
pub fn merge_patches(x: &[f32], h: usize, w: usize, d: usize, mh: usize, mw: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for by in 0..h / mh {
        for bx in 0..w / mw {
            for ky in 0..mh {
                for kx in 0..mw {
                    let r = (by * mh + ky) * w + bx * mw + kx;
                    out.extend_from_slice(&x[r * d..(r + 1) * d]);
                }
            }
        }
    }
    out
}

/// Checks that a pre-processed image fits the tower.
pub fn check_input(c: &k3_protocol::VisionConfig, img: &PreprocessedImage) -> Result<(), VisionError> {
    let [t, h, gw] = img.grid_thw;
    let p = c.patch_size;
    let (mh, mw) = (c.merge_kernel_size[0], c.merge_kernel_size[1]);
    let why = if t != 1 {
        Some(format!("t = {t}: only images (t = 1) are supported"))
    } else if img.patch_size != p {
        Some(format!("patch size {} differs from the model's {p}", img.patch_size))
    } else if h == 0 || gw == 0 || h % mh != 0 || gw % mw != 0 {
        Some(format!("grid {h}x{gw} is not a positive multiple of the merge kernel {mh}x{mw}"))
    } else if img.pixel_values.len() != h * gw * 3 * p * p {
        Some(format!("{} pixel values for a {h}x{gw} grid of {p}x{p} patches", img.pixel_values.len()))
    } else {
        None
    };
    match why {
        Some(msg) => Err(VisionError::Input(msg)),
        None => Ok(()),
    }
}

/// The whole tower and projector for one image, keeping every stage.
pub fn encode(w: &VisionWeights, img: &PreprocessedImage, eps: NormEps) -> Result<VisionTrace, VisionError> {
    check_input(&w.cfg, img)?;
    let c = &w.cfg;
    let [_, gh, gw] = img.grid_thw;
    let n = gh * gw;
    let (d, p) = (c.vt_hidden_size, c.patch_size);
    let heads = c.vt_num_attention_heads;
    let qkv = c.qkv_hidden_size;
    let hd = qkv / heads;
    let f = c.vt_intermediate_size;
    let e = eps.value();

    // Patch embedding (a 14×14 stride-14 conv = a matmul over (c, ky, kx)) plus positions.
    let mut x = matmul_t(&img.pixel_values, n, 3 * p * p, &w.patch_embed, d);
    let pos = interpolate_pos_emb(&w.pos_emb, c.init_pos_emb_height, c.init_pos_emb_width, d, gh, gw);
    for (a, b) in x.iter_mut().zip(&pos) {
        *a += b;
    }
    let embed = x.clone();

    let (cos, sin) = rope_2d(gh, gw, hd);
    for blk in &w.blocks {
        let hn = rms_norm(&x, &blk.norm0, e);
        let y = matmul_t(&hn, n, d, &blk.wqkv, 3 * qkv);
        let (mut q, mut k, mut v) = (vec![0f32; n * qkv], vec![0f32; n * qkv], vec![0f32; n * qkv]);
        for i in 0..n {
            let row = &y[i * 3 * qkv..][..3 * qkv];
            q[i * qkv..][..qkv].copy_from_slice(&row[..qkv]);
            k[i * qkv..][..qkv].copy_from_slice(&row[qkv..2 * qkv]);
            v[i * qkv..][..qkv].copy_from_slice(&row[2 * qkv..]);
        }
        apply_rope(&mut q, n, heads, hd, &cos, &sin);
        apply_rope(&mut k, n, heads, hd, &cos, &sin);
        let a = attention(&q, &k, &v, n, heads, hd);
        let o = matmul_t(&a, n, qkv, &blk.wo, d);
        for (xi, oi) in x.iter_mut().zip(&o) {
            *xi += oi;
        }
        let hn = rms_norm(&x, &blk.norm1, e);
        let mut u = matmul_t(&hn, n, d, &blk.fc0, f);
        u.iter_mut().for_each(|v| *v = gelu_tanh(*v));
        let o = matmul_t(&u, n, f, &blk.fc1, d);
        for (xi, oi) in x.iter_mut().zip(&o) {
            *xi += oi;
        }
    }
    let encoder = rms_norm(&x, &w.final_norm, e);

    let (mh, mw) = (c.merge_kernel_size[0], c.merge_kernel_size[1]);
    let merged = merge_patches(&encoder, gh, gw, d, mh, mw);
    let rows = n / (mh * mw);
    let md = mh * mw * d;
    let mut hdn = matmul_t(&merged, rows, md, &w.proj0, md);
    hdn.iter_mut().for_each(|v| *v = gelu_erf(*v));
    let y = matmul_t(&hdn, rows, md, &w.proj2, c.text_hidden_size);
    let output = rms_norm(&y, &w.post_norm, c.projector_ln_eps);
    Ok(VisionTrace { n_patches: n, rows, embed, encoder, merged, output })
}
