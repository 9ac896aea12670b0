//! K3's MX precision (OCP Microscaling v1.0) as the prefill node applies it: MXFP8, FP8 E4M3
//! elements sharing one E8M0 scale per 32 consecutive values along the reduction dimension.
//! Under `--precision mx` the routed experts' gate and up projections run MXFP4 weights × MXFP8
//! activations (their inputs pass [`mxfp8_rows`]); the down projection takes the SiTU output
//! unquantised (BF16 on the GPU). docs/mx.md gives the accuracy measured with the SiTU output
//! and the other projections in MX too, and why they stay out. The CPU backend's `--precision mx`
//! emulates it with these functions (quantise, then compute in f32 on the dequantised values),
//! and they are the oracle of the FP8 kernels.
//!
//! The block rule (OCP MX §6.3): for a block of 32 values with largest magnitude `amax`, the
//! shared scale is `X = 2^(⌊log2 amax⌋ − 8)` (8 = the exponent of E4M3's largest normal,
//! 448 = 1.75 · 2^8), clamped to E8M0's range `2^-127 … 2^127`; each element is `v / X`
//! rounded to the nearest E4M3 value (ties to even), saturating at ±448. A block of zeros keeps
//! zeros.

/// Values per MX block (along the reduction dimension).
pub const BLOCK: usize = 32;
/// E4M3's largest finite magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// The unbiased exponent of E4M3's largest normal value.
const E4M3_EMAX: i32 = 8;
/// E4M3's smallest normal exponent; below it values are subnormal, in steps of 2^-9.
const E4M3_EMIN: i32 = -6;
/// Mantissa bits of E4M3.
const E4M3_MANT: i32 = 3;

/// `v` rounded to the nearest FP8 E4M3 (OCP "E4M3FN": no infinities) value, ties to even,
/// saturating at ±448; NaN stays NaN.
pub fn round_e4m3(v: f32) -> f32 {
    if v.is_nan() {
        return v;
    }
    let a = v.abs();
    if a == 0.0 {
        return v;
    }
    // The exponent of a (the subnormal range shares the smallest normal's step).
    let e = (a.log2().floor() as i32).max(E4M3_EMIN);
    // Powers of two are exact in f32, and so is a / step for the exponents reached here.
    let step = (2.0f32).powi(e - E4M3_MANT);
    let q = ((a / step).round_ties_even() * step).min(E4M3_MAX);
    q.copysign(v)
}

/// The E8M0 exponent (unbiased) of a block whose largest magnitude is `amax`; `None` for a
/// block of zeros (or non-finite values, which MX does not scale).
pub fn block_exponent(amax: f32) -> Option<i32> {
    if !(amax > 0.0) || !amax.is_finite() {
        return None;
    }
    Some((amax.log2().floor() as i32 - E4M3_EMAX).clamp(-127, 127))
}

/// Quantises then dequantises one row in place: MXFP8 blocks of [`BLOCK`] values along the row
/// (a last partial block is a block of its own).
pub fn mxfp8_row(row: &mut [f32]) {
    for block in row.chunks_mut(BLOCK) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let Some(e) = block_exponent(amax) else { continue };
        let scale = (2.0f32).powi(e);
        for v in block.iter_mut() {
            *v = round_e4m3(*v / scale) * scale;
        }
    }
}

/// [`mxfp8_row`] on every row of a row-major `[rows, cols]` matrix (blocks along `cols`, the
/// reduction dimension of `x · Wᵀ`).
pub fn mxfp8_rows(data: &mut [f32], cols: usize) {
    use rayon::prelude::*;
    data.par_chunks_mut(cols.max(1)).for_each(mxfp8_row);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_rounds_to_its_grid_with_ties_to_even_and_saturates() {
        // normal range: 3 mantissa bits
        assert_eq!(round_e4m3(1.0), 1.0);
        assert_eq!(round_e4m3(1.0625), 1.0, "halfway between 1 and 1.125: ties to even");
        assert_eq!(round_e4m3(1.1875), 1.25, "halfway between 1.125 and 1.25: ties to even");
        assert_eq!(round_e4m3(1.07), 1.125);
        assert_eq!(round_e4m3(-3.3), -3.25);
        assert_eq!(round_e4m3(1.97), 2.0, "rounding carries into the next binade");
        assert_eq!(round_e4m3(448.0), 448.0);
        assert_eq!(round_e4m3(470.0), 448.0, "saturates");
        assert_eq!(round_e4m3(1e30), 448.0);
        // subnormals: steps of 2^-9 below 2^-6
        assert_eq!(round_e4m3(2f32.powi(-9)), 2f32.powi(-9));
        assert_eq!(round_e4m3(3.0 * 2f32.powi(-10)), 2.0 * 2f32.powi(-9), "1.5 steps: ties to even");
        assert_eq!(round_e4m3(2f32.powi(-11)), 0.0);
        assert!(round_e4m3(f32::NAN).is_nan());
        // every value of the grid is a fixed point
        for e in -6..=8 {
            for m in 0..8 {
                let v = (1.0 + m as f32 / 8.0) * 2f32.powi(e);
                if v <= E4M3_MAX {
                    assert_eq!(round_e4m3(v), v, "{v}");
                }
            }
        }
    }

    #[test]
    fn a_block_shares_the_scale_of_its_largest_value() {
        let mut row: Vec<f32> = (0..BLOCK).map(|i| (i as f32 - 15.5) * 0.37).collect();
        row[7] = 100.0;
        let orig = row.clone();
        mxfp8_row(&mut row);
        // amax 100 → exponent 6 − 8 = −2: scale 0.25; 100 / 0.25 = 400 lies halfway between
        // E4M3's 384 and 416: ties to even gives 384, so 96
        assert_eq!(row[7], 96.0);
        for (q, v) in row.iter().zip(&orig) {
            let err = (q - v).abs();
            // half a step of E4M3 at the element's binade, in scaled units, or the subnormal step
            let bound = (v.abs() / 16.0).max(0.25 * 2f32.powi(-9));
            assert!(err <= bound, "{v} → {q}");
        }
        assert_ne!(row, orig, "the emulation is not a no-op");
        let mut zeros = vec![0.0f32; 40];
        mxfp8_row(&mut zeros);
        assert!(zeros.iter().all(|&v| v == 0.0));
        assert_eq!(block_exponent(448.0), Some(0));
        assert_eq!(block_exponent(1e-40), Some(-127), "E8M0's range bounds the scale");
    }
}
