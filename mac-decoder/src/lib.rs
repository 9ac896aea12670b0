//! k3-decode: the decoder node's library.

pub mod chat;
pub mod cli;
pub mod generate;
pub mod memory;
pub mod sampler;
pub mod server;
#[cfg(feature = "mlx")]
pub mod decode;
#[cfg(feature = "mlx")]
pub mod distributed;
#[cfg(feature = "mlx")]
pub mod ingest;
#[cfg(feature = "mlx")]
pub mod mlx;
#[cfg(feature = "mlx")]
pub mod model;
#[cfg(feature = "mlx")]
pub mod remote;
pub mod tokenizer;
pub mod vision;
