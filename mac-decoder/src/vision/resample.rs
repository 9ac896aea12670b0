//! Bicubic resampling with the arithmetic of Pillow's `Image.resize(..., BICUBIC)`, which is
//! what Moonshot's image processor calls: a separable convolution (horizontal pass first, only
//! over the rows the vertical pass reads), the Keys cubic with a = −0.5 stretched by the
//! downscale factor (so it antialiases), per-output normalised weights turned into 22-bit
//! fixed point, and 8-bit rounding between the two passes. RGBA is resampled premultiplied
//! (Pillow converts RGBA → RGBa → resize → RGBA), so colour hidden under transparent pixels
//! does not bleed. Written from the algorithm's description, not from Pillow's code.

/// An 8-bit interleaved image: `channels` values per pixel, rows top to bottom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image8 {
    pub width: usize,
    pub height: usize,
    pub channels: usize,
    pub data: Vec<u8>,
}

impl Image8 {
    pub fn new(width: usize, height: usize, channels: usize, data: Vec<u8>) -> Self {
        assert_eq!(data.len(), width * height * channels, "Image8 buffer size");
        Image8 { width, height, channels, data }
    }
}

const PRECISION_BITS: u32 = 32 - 8 - 2;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per output index: the first input index, the tap count, and the fixed-point weights.
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

fn precompute(in_size: usize, out_size: usize) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's (int) cast truncates toward zero; both ends are then clamped to the image.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin);
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(n) {
            let w = bicubic(((x + xmin) as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        for x in 0..n {
            let w = if ww != 0.0 { k[x] / ww } else { k[x] };
            let fixed = w * (1u32 << PRECISION_BITS) as f64;
            weights[xx * ksize + x] = if w < 0.0 { (fixed - 0.5) as i32 } else { (fixed + 0.5) as i32 };
        }
        bounds.push((xmin, n));
    }
    Coeffs { ksize, bounds, weights }
}

fn clip8(v: i64) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Horizontal pass over rows `y0..y0 + rows` of `src`.
fn horizontal(src: &Image8, y0: usize, rows: usize, out_w: usize, c: &Coeffs) -> Image8 {
    let ch = src.channels;
    let mut out = vec![0u8; out_w * rows * ch];
    for y in 0..rows {
        let row = &src.data[(y0 + y) * src.width * ch..(y0 + y + 1) * src.width * ch];
        for (xx, &(xmin, n)) in c.bounds.iter().enumerate() {
            let k = &c.weights[xx * c.ksize..xx * c.ksize + n];
            for chn in 0..ch {
                let mut ss: i64 = 1 << (PRECISION_BITS - 1);
                for (x, &w) in k.iter().enumerate() {
                    ss += row[(xmin + x) * ch + chn] as i64 * w as i64;
                }
                out[(y * out_w + xx) * ch + chn] = clip8(ss);
            }
        }
    }
    Image8::new(out_w, rows, ch, out)
}

fn vertical(src: &Image8, out_h: usize, c: &Coeffs, shift: usize) -> Image8 {
    let ch = src.channels;
    let stride = src.width * ch;
    let mut out = vec![0u8; stride * out_h];
    for (yy, &(ymin, n)) in c.bounds.iter().enumerate() {
        let ymin = ymin - shift;
        let k = &c.weights[yy * c.ksize..yy * c.ksize + n];
        for i in 0..stride {
            let mut ss: i64 = 1 << (PRECISION_BITS - 1);
            for (y, &w) in k.iter().enumerate() {
                ss += src.data[(ymin + y) * stride + i] as i64 * w as i64;
            }
            out[yy * stride + i] = clip8(ss);
        }
    }
    Image8::new(src.width, out_h, ch, out)
}

/// Resizes without premultiplication (each channel on its own).
pub fn resize_channels(src: &Image8, out_w: usize, out_h: usize) -> Image8 {
    assert!(out_w > 0 && out_h > 0 && src.width > 0 && src.height > 0, "resize to/from an empty image");
    if out_w == src.width && out_h == src.height {
        return src.clone();
    }
    let cv = precompute(src.height, out_h);
    let need_h = out_w != src.width;
    let need_v = out_h != src.height;
    let mut img = src.clone();
    let mut shift = 0;
    if need_h {
        let ch = precompute(src.width, out_w);
        let first = cv.bounds[0].0;
        let (lmin, ln) = cv.bounds[out_h - 1];
        let last = lmin + ln;
        // Only the rows the vertical pass reads (all of them when there is no vertical pass).
        let (y0, rows) = if need_v { (first, last - first) } else { (0, src.height) };
        img = horizontal(src, y0, rows, out_w, &ch);
        shift = if need_v { first } else { 0 };
    }
    if need_v {
        img = vertical(&img, out_h, &cv, shift);
    }
    img
}

fn muldiv255(a: u32, b: u32) -> u8 {
    let t = a * b + 128;
    (((t >> 8) + t) >> 8) as u8
}

/// Resizes an RGBA image the way Pillow does: premultiply, resample, un-premultiply.
pub fn resize_rgba(src: &Image8, out_w: usize, out_h: usize) -> Image8 {
    assert_eq!(src.channels, 4, "resize_rgba needs 4 channels");
    if out_w == src.width && out_h == src.height {
        return src.clone();
    }
    let mut pre = src.clone();
    for px in pre.data.chunks_exact_mut(4) {
        let a = px[3] as u32;
        for v in &mut px[..3] {
            *v = muldiv255(*v as u32, a);
        }
    }
    let mut out = resize_channels(&pre, out_w, out_h);
    for px in out.data.chunks_exact_mut(4) {
        let a = px[3] as u32;
        if a != 0 && a != 255 {
            for v in &mut px[..3] {
                *v = ((255 * *v as u32) / a).min(255) as u8;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for (i, o) in [(100, 37), (37, 100), (7168, 13), (5, 5), (1, 9), (9, 1)] {
            let c = precompute(i, o);
            for (xx, &(_, n)) in c.bounds.iter().enumerate() {
                let s: i64 = c.weights[xx * c.ksize..xx * c.ksize + n].iter().map(|&w| w as i64).sum();
                assert!((s - (1 << PRECISION_BITS)).abs() <= n as i64, "{i}->{o} at {xx}: sum {s}");
            }
        }
    }

    #[test]
    fn constant_image_stays_constant() {
        let src = Image8::new(31, 17, 3, vec![123; 31 * 17 * 3]);
        for (w, h) in [(7, 5), (64, 40), (31, 3), (2, 17)] {
            let out = resize_channels(&src, w, h);
            assert!(out.data.iter().all(|&v| v == 123), "{w}x{h}");
        }
    }

    #[test]
    fn transparent_colour_does_not_bleed() {
        let mut a = Image8::new(16, 16, 4, vec![0; 16 * 16 * 4]);
        let mut b = a.clone();
        for y in 0..16 {
            for x in 0..16 {
                let i = (y * 16 + x) * 4;
                if x < 8 {
                    a.data[i..i + 4].copy_from_slice(&[200, 100, 50, 255]);
                    b.data[i..i + 4].copy_from_slice(&[200, 100, 50, 255]);
                } else {
                    a.data[i..i + 4].copy_from_slice(&[0, 0, 0, 0]);
                    b.data[i..i + 4].copy_from_slice(&[255, 0, 255, 0]);
                }
            }
        }
        assert_eq!(resize_rgba(&a, 5, 7), resize_rgba(&b, 5, 7));
    }
}
