//! Rust buffers ⇄ MLX arrays, with the shape checked before MLX sees it.

use anyhow::{bail, Context, Result};
use mlx_rs::{Array, Dtype};

fn dims(shape: &[usize], what: &str) -> Result<Vec<i32>> {
    shape.iter().map(|&d| i32::try_from(d).with_context(|| format!("{what}: dimension {d} exceeds MLX's i32 shape"))).collect()
}

/// An f32 array of `shape` holding a copy of `data`.
pub fn array_f32(data: &[f32], shape: &[usize], what: &str) -> Result<Array> {
    let n: usize = shape.iter().product();
    if n != data.len() {
        bail!("{what}: {} values for shape {shape:?} ({n} expected)", data.len());
    }
    Ok(Array::from_slice(data, &dims(shape, what)?))
}

/// An i32 array (token ids, indices).
pub fn array_i32(data: &[i32], shape: &[usize], what: &str) -> Result<Array> {
    let n: usize = shape.iter().product();
    if n != data.len() {
        bail!("{what}: {} values for shape {shape:?} ({n} expected)", data.len());
    }
    Ok(Array::from_slice(data, &dims(shape, what)?))
}

/// Evaluates `a` and copies it out as f32 row-major (widening BF16/F16 exactly; views are
/// made contiguous first).
pub fn to_vec_f32(a: &Array) -> Result<Vec<f32>> {
    let a = if a.dtype() == Dtype::Float32 { a.contiguous()? } else { a.as_dtype(Dtype::Float32)?.contiguous()? };
    a.eval()?;
    Ok(a.try_as_slice::<f32>().map_err(|e| anyhow::anyhow!("reading an MLX array: {e:?}"))?.to_vec())
}
