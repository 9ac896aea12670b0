//! Where each patch is, for the tower: the learned position table resized to the patch grid
//! (spec §5.3) and the 2-D rotary tables (spec §5.2). Both are small and computed on the CPU;
//! the CPU reference and the MLX tower use the same tables.

/// PyTorch `F.interpolate(mode="bilinear", align_corners=False)` source taps along one axis:
/// per output index `(i0, i1, w0, w1)` in f32 as PyTorch's CPU kernel computes them.
fn bilinear_taps(in_size: usize, out_size: usize) -> Vec<(usize, usize, f32, f32)> {
    let scale = in_size as f32 / out_size as f32;
    (0..out_size)
        .map(|o| {
            let src = (scale * (o as f32 + 0.5) - 0.5).max(0.0);
            let i0 = (src as usize).min(in_size - 1);
            let i1 = if i0 < in_size - 1 { i0 + 1 } else { i0 };
            let l1 = src - i0 as f32;
            (i0, i1, 1.0 - l1, l1)
        })
        .collect()
}

/// Resizes the `[in_h, in_w, d]` table to `[h, w, d]` bilinearly (align_corners=False, no
/// antialias); the table itself when the sizes agree.
pub fn interpolate_pos_emb(table: &[f32], in_h: usize, in_w: usize, d: usize, h: usize, w: usize) -> Vec<f32> {
    assert_eq!(table.len(), in_h * in_w * d, "position table size");
    if (in_h, in_w) == (h, w) {
        return table.to_vec();
    }
    let ty = bilinear_taps(in_h, h);
    let tx = bilinear_taps(in_w, w);
    let mut out = vec![0f32; h * w * d];
    for (oy, &(y0, y1, wy0, wy1)) in ty.iter().enumerate() {
        for (ox, &(x0, x1, wx0, wx1)) in tx.iter().enumerate() {
            let o = &mut out[(oy * w + ox) * d..][..d];
            let p00 = &table[(y0 * in_w + x0) * d..][..d];
            let p01 = &table[(y0 * in_w + x1) * d..][..d];
            let p10 = &table[(y1 * in_w + x0) * d..][..d];
            let p11 = &table[(y1 * in_w + x1) * d..][..d];
            for c in 0..d {
                o[c] = wy0 * (wx0 * p00[c] + wx1 * p01[c]) + wy1 * (wx0 * p10[c] + wx1 * p11[c]);
            }
        }
    }
    out
}

/// 2-D rotary tables for an `h × w` grid: `(cos, sin)`, each `[h · w, head_dim / 2]`,
/// patches row-major. Pair slot `2i` rotates by `col · ω_i`, slot `2i + 1` by `row · ω_i`,
/// `ω_i = 10000^(−4i / head_dim)` (f32, as the reference builds them).
pub fn rope_2d(h: usize, w: usize, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let freqs: Vec<f32> = (0..head_dim / 4).map(|i| 1.0 / 10000f32.powf((4 * i) as f32 / head_dim as f32)).collect();
    let mut cos = Vec::with_capacity(h * w * half);
    let mut sin = Vec::with_capacity(h * w * half);
    for r in 0..h {
        for c in 0..w {
            for &f in &freqs {
                for pos in [c as f32, r as f32] {
                    let a = pos * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        }
    }
    (cos, sin)
}
