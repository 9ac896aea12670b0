//! MLX helpers: small safe wrappers over `mlx-sys` for what mlx-rs 0.33 lacks (MXFP4 quantized
//! matmuls), and conversions between Rust buffers and MLX arrays.

pub mod convert;
pub mod quant;

pub use convert::{array_f32, array_i32, to_vec_f32};
pub use quant::{dequantize_mxfp4, gather_qmm_mxfp4, quantized_matmul_mxfp4, Mxfp4Array};
pub(crate) use quant::{ensure_error_handler, run_op};
