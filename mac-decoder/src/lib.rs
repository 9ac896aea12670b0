//! k3-decode: the decoder node's library.

pub mod chat;
pub mod cli;
#[cfg(feature = "mlx")]
pub mod decode;
pub mod decode_loop;
#[cfg(feature = "mlx")]
pub mod distributed;
pub mod engine;
#[cfg(feature = "mlx")]
pub mod ingest;
pub mod memory;
pub mod metrics;
#[cfg(feature = "mlx")]
pub mod mlx;
#[cfg(feature = "mlx")]
pub mod model;
#[cfg(feature = "mlx")]
pub mod remote;
pub mod sampler;
pub mod server;
pub mod tokenizer;
pub mod vision;
