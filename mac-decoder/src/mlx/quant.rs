//! MXFP4 through MLX: the checkpoint's compressed-tensors bytes become MLX `mxfp4` quantized
//! weights by REINTERPRETATION (never requantisation, spec §8): `weight_packed` U8 `[out, in/2]`
//! read as little-endian u32 words `[out, in/8]`, `weight_scale` kept as the u8 E8M0 exponents
//! `[out, in/32]`. mlx-rs 0.33's safe quantized ops hard-code the `affine` mode, so the three
//! mlx-c entry points are called here with mode `"mxfp4"`, group 32, 4 bits and null biases.

use std::ffi::CStr;
use std::sync::Once;

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype, Stream};
use mlx_sys::mlx_array;

pub const MXFP4_GROUP: i32 = 32;
pub const MXFP4_BITS: i32 = 4;
const MODE: &CStr = c"mxfp4";

/// One MXFP4 weight `[out, in]`, or a stack of them `[n, out, in]` (the routed experts of a layer).
pub struct Mxfp4Array {
    /// u32 `[.., out, in/8]`.
    pub weight: Array,
    /// u8 `[.., out, in/32]`.
    pub scales: Array,
    pub out_features: usize,
    pub in_features: usize,
}

impl Mxfp4Array {
    /// Builds a stack of `parts.len()` weights `[out, in]` from compressed-tensors bytes
    /// `(packed, scale)`; a single weight is a stack of one (leading dim 1 is dropped if `squeeze`).
    pub fn from_compressed(parts: &[(&[u8], &[u8])], out_features: usize, in_features: usize, what: &str) -> Result<Self> {
        if !in_features.is_multiple_of(MXFP4_GROUP as usize) {
            bail!("{what}: in_features {in_features} is not a multiple of the MXFP4 group {MXFP4_GROUP}");
        }
        let packed_len = out_features * in_features / 2;
        let scale_len = out_features * in_features / MXFP4_GROUP as usize;
        let mut words = Vec::with_capacity(parts.len() * packed_len / 4);
        let mut scales = Vec::with_capacity(parts.len() * scale_len);
        for (i, (packed, scale)) in parts.iter().enumerate() {
            if packed.len() != packed_len || scale.len() != scale_len {
                bail!(
                    "{what}[{i}]: packed {} B / scale {} B, expected {packed_len} / {scale_len} for [{out_features}, {in_features}]",
                    packed.len(),
                    scale.len()
                );
            }
            words.extend(packed.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])));
            scales.extend_from_slice(scale);
        }
        let n = parts.len() as i32;
        let (o, i) = (out_features as i32, in_features as i32);
        Ok(Mxfp4Array {
            weight: Array::from_slice(&words, &[n, o, i / 8]),
            scales: Array::from_slice(&scales, &[n, o, i / MXFP4_GROUP]),
            out_features,
            in_features,
        })
    }

    /// Element `[k]` of a stack, as a single 2-D weight.
    pub fn get(&self, k: i32) -> Result<Mxfp4Array> {
        Ok(Mxfp4Array {
            weight: self.weight.take_axis(Array::from_int(k), 0)?,
            scales: self.scales.take_axis(Array::from_int(k), 0)?,
            out_features: self.out_features,
            in_features: self.in_features,
        })
    }

    /// Total bytes of packed data and scales.
    pub fn nbytes(&self) -> usize {
        self.weight.nbytes() + self.scales.nbytes()
    }
}

/// mlx-rs installs its error handler (which stores MLX's message instead of exiting) the first
/// time one of its own ops runs; make sure that has happened before calling mlx-c directly.
pub(crate) fn ensure_error_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = Array::from_int(0).abs();
    });
}

/// Runs one mlx-c op that writes an array, turning a failure status into an error.
pub(crate) fn run_op(what: &str, f: impl FnOnce(*mut mlx_array) -> i32) -> Result<Array> {
    ensure_error_handler();
    // SAFETY: mlx_array_new returns an empty handle that the op fills; on failure we free it.
    let mut res = unsafe { mlx_sys::mlx_array_new() };
    let status = f(&mut res);
    if status != 0 {
        unsafe { mlx_sys::mlx_array_free(res) };
        bail!("MLX {what} failed (status {status})");
    }
    // SAFETY: the op succeeded, so `res` is a valid array handle we now own.
    Ok(unsafe { Array::from_ptr(res) })
}

fn opt_int(v: i32) -> mlx_sys::mlx_optional_int {
    mlx_sys::mlx_optional_int { value: v, has_value: true }
}

fn check_pair(w: &Array, scales: &Array, what: &str) -> Result<()> {
    if w.dtype() != Dtype::Uint32 || scales.dtype() != Dtype::Uint8 {
        bail!("{what}: MXFP4 wants u32 words and u8 scales, got {:?} / {:?}", w.dtype(), scales.dtype());
    }
    let (ws, ss) = (w.shape(), scales.shape());
    if ws.len() != ss.len() || ws[..ws.len() - 1] != ss[..ss.len() - 1] || ws[ws.len() - 1] * 8 != ss[ss.len() - 1] * MXFP4_GROUP {
        bail!("{what}: words {ws:?} and scales {ss:?} do not describe one MXFP4 weight");
    }
    Ok(())
}

/// Dequantises MXFP4 words + E8M0 scales to f32 `[.., out, in]`.
pub fn dequantize_mxfp4(w: &Array, scales: &Array) -> Result<Array> {
    check_pair(w, scales, "dequantize")?;
    let stream = Stream::thread_local_or_default();
    // SAFETY: all handles are valid for the duration of the call; null biases/global scale are
    // empty arrays as mlx-c documents for "may be null".
    let none = unsafe { mlx_sys::mlx_array_new() };
    let out = run_op("dequantize(mxfp4)", |res| unsafe {
        mlx_sys::mlx_dequantize(
            res,
            w.as_ptr(),
            scales.as_ptr(),
            none,
            opt_int(MXFP4_GROUP),
            opt_int(MXFP4_BITS),
            MODE.as_ptr(),
            none,
            mlx_sys::mlx_optional_dtype { value: mlx_sys::mlx_dtype__MLX_FLOAT32, has_value: true },
            stream.as_ptr(),
        )
    });
    unsafe { mlx_sys::mlx_array_free(none) };
    out
}

/// `x · Wᵀ` with an MXFP4 weight `[out, in]`: `x` is `[.., in]`, the result `[.., out]`.
pub fn quantized_matmul_mxfp4(x: &Array, w: &Mxfp4Array) -> Result<Array> {
    check_pair(&w.weight, &w.scales, "quantized_matmul")?;
    if x.shape().last().copied() != Some(w.in_features as i32) {
        bail!("quantized_matmul: x {:?} does not end in in_features {}", x.shape(), w.in_features);
    }
    let stream = Stream::thread_local_or_default();
    let none = unsafe { mlx_sys::mlx_array_new() };
    let out = run_op("quantized_matmul(mxfp4)", |res| unsafe {
        mlx_sys::mlx_quantized_matmul(
            res,
            x.as_ptr(),
            w.weight.as_ptr(),
            w.scales.as_ptr(),
            none,
            true,
            opt_int(MXFP4_GROUP),
            opt_int(MXFP4_BITS),
            MODE.as_ptr(),
            stream.as_ptr(),
        )
    });
    unsafe { mlx_sys::mlx_array_free(none) };
    out
}

/// Gathered MXFP4 matmul over a stack of weights `[n, out, in]`: for `x` `[B.., M, in]` and
/// `indices` (i32/u32, broadcastable to `B..`), returns `x[b] · W[indices[b]]ᵀ` as `[B.., M, out]`.
pub fn gather_qmm_mxfp4(x: &Array, w: &Mxfp4Array, indices: &Array, sorted: bool) -> Result<Array> {
    check_pair(&w.weight, &w.scales, "gather_qmm")?;
    if w.weight.ndim() != 3 {
        bail!("gather_qmm: wants a stack [n, out, in/8], got {:?}", w.weight.shape());
    }
    if x.shape().last().copied() != Some(w.in_features as i32) {
        bail!("gather_qmm: x {:?} does not end in in_features {}", x.shape(), w.in_features);
    }
    let stream = Stream::thread_local_or_default();
    let none = unsafe { mlx_sys::mlx_array_new() };
    let out = run_op("gather_qmm(mxfp4)", |res| unsafe {
        mlx_sys::mlx_gather_qmm(
            res,
            x.as_ptr(),
            w.weight.as_ptr(),
            w.scales.as_ptr(),
            none,
            none,
            indices.as_ptr(),
            true,
            opt_int(MXFP4_GROUP),
            opt_int(MXFP4_BITS),
            MODE.as_ptr(),
            sorted,
            stream.as_ptr(),
        )
    });
    unsafe { mlx_sys::mlx_array_free(none) };
    out
}
