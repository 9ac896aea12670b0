//! The K3 text tower on MLX ([`k3`]), its per-sequence caches ([`cache`]) and the checkpoint
//! loader that feeds it ([`weights`]).

pub mod cache;
pub mod k3;
pub mod weights;

pub use cache::{KdaCache, LayerCache, MlaCache, ModelCache};
pub use k3::{K3Text, KdaMode};
