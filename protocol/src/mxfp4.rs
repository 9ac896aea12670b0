//! The compressed-tensors `mxfp4-pack-quantized` layout (spec §2.3).
//!
//! Per 2-D weight `W[out, in]`: `weight_packed` U8 `[out, in/2]` (low nibble = element `2j`,
//! high nibble = element `2j+1`), `weight_scale` U8 `[out, in/32]` holding an E8M0 exponent per
//! 32-element group. Code `c` is FP4 E2M1: sign bit 3, magnitude `{0, .5, 1, 1.5, 2, 3, 4, 6}`.

/// E2M1 magnitudes indexed by the low three bits of a nibble.
pub const E2M1_MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// MXFP4 group size along the input dimension.
pub const GROUP: usize = 32;

/// Value of one FP4 E2M1 nibble.
#[inline]
pub fn e2m1(code: u8) -> f32 {
    let m = E2M1_MAGNITUDES[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// `2^(e - 127)` exactly, as f32 (E8M0; 255 is NaN per OCP).
#[inline]
pub fn e8m0(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        // 2^-127 is subnormal in f32: build it by bits.
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((e as u32) << 23),
    }
}

/// Why packed bytes and scales do not form an MXFP4 weight of the given shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Mxfp4Error {
    #[error("in_features {in_features} is not a multiple of the MXFP4 group {GROUP}")]
    Ungrouped { in_features: usize },
    #[error("packed data is {got} bytes, expected {want} for [{out_features}, {in_features}]")]
    PackedLength { got: usize, want: usize, out_features: usize, in_features: usize },
    #[error("scale data is {got} bytes, expected {want} for [{out_features}, {in_features}]")]
    ScaleLength { got: usize, want: usize, out_features: usize, in_features: usize },
}

/// A zero-copy view of one MXFP4 weight `[out, in]`.
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4Weight<'a> {
    pub packed: &'a [u8],
    pub scale: &'a [u8],
    pub out_features: usize,
    pub in_features: usize,
}

impl<'a> Mxfp4Weight<'a> {
    pub fn new(packed: &'a [u8], scale: &'a [u8], out_features: usize, in_features: usize) -> Result<Self, Mxfp4Error> {
        if !in_features.is_multiple_of(GROUP) {
            return Err(Mxfp4Error::Ungrouped { in_features });
        }
        if packed.len() != out_features * in_features / 2 {
            let want = out_features * in_features / 2;
            return Err(Mxfp4Error::PackedLength { got: packed.len(), want, out_features, in_features });
        }
        if scale.len() != out_features * in_features / GROUP {
            let want = out_features * in_features / GROUP;
            return Err(Mxfp4Error::ScaleLength { got: scale.len(), want, out_features, in_features });
        }
        Ok(Self { packed, scale, out_features, in_features })
    }

    /// Decodes row `r` into `out` (`in_features` values), bit-exactly.
    pub fn decode_row_into(&self, r: usize, out: &mut [f32]) {
        let half = self.in_features / 2;
        let groups = self.in_features / GROUP;
        let row = &self.packed[r * half..(r + 1) * half];
        let scales = &self.scale[r * groups..(r + 1) * groups];
        for (g, &s) in scales.iter().enumerate() {
            let sc = e8m0(s);
            let bytes = &row[g * GROUP / 2..(g + 1) * GROUP / 2];
            let dst = &mut out[g * GROUP..(g + 1) * GROUP];
            for (j, &b) in bytes.iter().enumerate() {
                dst[2 * j] = e2m1(b & 0x0f) * sc;
                dst[2 * j + 1] = e2m1(b >> 4) * sc;
            }
        }
    }

    /// The whole weight as row-major f32 `[out, in]`.
    pub fn decode(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.out_features * self.in_features];
        for r in 0..self.out_features {
            self.decode_row_into(r, &mut out[r * self.in_features..(r + 1) * self.in_features]);
        }
        out
    }
}

/// Quantises a row-major f32 `[out, in]` weight the way the release did
/// (`scale = 2^ceil(log2(amax/6))` per 32-group, round to nearest E2M1), returning
/// `(packed, scale)` in the compressed-tensors layout. Used by the synthetic-model writer.
pub fn quantize(w: &[f32], out_features: usize, in_features: usize) -> (Vec<u8>, Vec<u8>) {
    assert_eq!(w.len(), out_features * in_features);
    assert_eq!(in_features % GROUP, 0);
    let mut packed = vec![0u8; out_features * in_features / 2];
    let mut scale = vec![0u8; out_features * in_features / GROUP];
    for (k, grp) in w.chunks_exact(GROUP).enumerate() {
        let amax = grp.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        // Exponent e with 2^(e-127) = 2^ceil(log2(amax/6)), clamped to the E8M0 range.
        let e: i32 = if amax > 0.0 { ((amax / 6.0).log2().ceil() as i32 + 127).clamp(1, 254) } else { 127 };
        scale[k] = e as u8;
        // 1/scale is an exact power of two (2^-127 is a subnormal), so x * inv == x / scale.
        let inv = 1.0 / e8m0(e as u8);
        let dst = &mut packed[k * GROUP / 2..(k + 1) * GROUP / 2];
        for (d, pair) in dst.iter_mut().zip(grp.chunks_exact(2)) {
            *d = nearest_e2m1(pair[0] * inv) | nearest_e2m1(pair[1] * inv) << 4;
        }
    }
    (packed, scale)
}

/// Nearest E2M1 code to `x` (ties to the even magnitude index). The magnitude index is the
/// number of decision points below `|x|`: the midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
/// between neighbouring magnitudes, where a tie goes up only to an even index.
#[inline]
fn nearest_e2m1(x: f32) -> u8 {
    let a = x.abs();
    let best = (a > 0.25) as u8 + (a >= 0.75) as u8 + (a > 1.25) as u8 + (a >= 1.75) as u8 + (a > 2.5) as u8 + (a >= 3.5) as u8 + (a > 5.0) as u8;
    let sign = if x < 0.0 && best != 0 { 8 } else { 0 };
    best | sign
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibble_table_and_scales() {
        for c in 0u8..16 {
            let v = e2m1(c);
            assert_eq!(v.abs(), E2M1_MAGNITUDES[(c & 7) as usize]);
            assert_eq!(v.is_sign_negative() && v != 0.0, c > 8);
        }
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(128), 2.0);
        assert_eq!(e8m0(120), 2f32.powi(-7));
        assert_eq!(e8m0(1), 2f32.powi(-126));
        assert_eq!(e8m0(0), 2f32.powi(-127));
        assert!(e8m0(255).is_nan());
    }

    #[test]
    fn low_nibble_is_the_even_element() {
        // Row of 32: element 0 = +1.0 (code 2), element 1 = -6.0 (code 15), scale 2^1.
        let mut packed = vec![0u8; 16];
        packed[0] = 0x2 | (0xF << 4);
        let scale = vec![128u8];
        let w = Mxfp4Weight::new(&packed, &scale, 1, 32).unwrap();
        let d = w.decode();
        assert_eq!(d[0], 2.0);
        assert_eq!(d[1], -12.0);
        assert!(d[2..].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn quantize_roundtrips_representable_values() {
        let w: Vec<f32> = (0..64).map(|i| E2M1_MAGNITUDES[i % 8] * if i % 3 == 0 { -0.25 } else { 0.25 }).collect();
        let (p, s) = quantize(&w, 1, 64);
        let d = Mxfp4Weight::new(&p, &s, 1, 64).unwrap().decode();
        assert_eq!(d, w);
    }

    /// The closed-form rounding equals an exhaustive nearest search with ties to even.
    #[test]
    fn nearest_code_matches_exhaustive_search() {
        let brute = |x: f32| -> u8 {
            let a = x.abs().min(6.0);
            let mut best = 0usize;
            for (i, &m) in E2M1_MAGNITUDES.iter().enumerate() {
                let (d, bd) = ((a - m).abs(), (a - E2M1_MAGNITUDES[best]).abs());
                if d < bd || (d == bd && i % 2 == 0 && best % 2 == 1) {
                    best = i;
                }
            }
            best as u8 | if x < 0.0 && best != 0 { 8 } else { 0 }
        };
        let mut xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.00375).collect();
        for m in [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0] {
            for d in [-1e-6f32, 0.0, 1e-6] {
                xs.push(m + d);
                xs.push(-(m + d));
            }
        }
        for x in xs {
            assert_eq!(nearest_e2m1(x), brute(x), "x = {x}");
        }
    }

    /// The group-wise quantiser equals a plain per-element reference (divide by the scale,
    /// nearest code, low nibble = even element) on values of every magnitude.
    #[test]
    fn quantize_matches_a_per_element_reference() {
        let (rows, cols) = (7, 96);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let u = (x >> 11) as f32 / (1u64 << 53) as f32 - 0.5;
                let mag = [1e-30f32, 1e-3, 1.0, 7.0, 1e20][(i / 32) % 5];
                if i % 97 == 0 {
                    0.0
                } else {
                    u * mag
                }
            })
            .collect();
        let (p, s) = quantize(&w, rows, cols);
        for r in 0..rows {
            for g in 0..cols / GROUP {
                let grp = &w[r * cols + g * GROUP..][..GROUP];
                let amax = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
                let e = if amax > 0.0 { ((amax / 6.0).log2().ceil() as i32 + 127).clamp(1, 254) } else { 127 };
                assert_eq!(s[r * cols / GROUP + g], e as u8);
                for j in 0..GROUP {
                    let i = r * cols + g * GROUP + j;
                    let code = nearest_e2m1(w[i] / e8m0(e as u8));
                    let byte = p[i / 2];
                    assert_eq!(if i.is_multiple_of(2) { byte & 15 } else { byte >> 4 }, code, "element {i}");
                }
            }
        }
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert!(Mxfp4Weight::new(&[0; 15], &[0; 1], 1, 32).is_err());
        assert!(Mxfp4Weight::new(&[0; 16], &[0; 2], 1, 32).is_err());
        assert!(Mxfp4Weight::new(&[0; 8], &[0; 1], 1, 16).is_err());
    }
}
