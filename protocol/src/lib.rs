//! k3-protocol: the contract both k3-offload nodes share.
//!
//! - [`config`]: the release `config.json`, typed and validated, and the per-layer plan.
//! - [`tensors`]: every checkpoint tensor derived from the config (names, shapes, dtypes).
//! - [`checkpoint`]: the safetensors index and shards through memmap2, checked up front.
//! - [`files`]: opening only regular files (a FIFO in place of a shard is refused, never waited on).
//! - [`mxfp4`]: the compressed-tensors MXFP4 layout, decoded bit-exactly.
//! - [`fingerprint`]: the model fingerprint both nodes compare.
//! - [`weight_digest`]: the per-tensor weight digests a checkpoint caches (data only).
//! - [`prune`]: routed-expert pruning: calibration statistics, selection, the pruned checkpoint.
//! - [`fit`]: which (pruned) model and context length fit which Mac.
//! - [`handoff`]: the canonical hand-off state and its session file.
//! - [`synth`]: synthetic models in the release layout (presets of spec §6), and their tokenizer.
//! - [`testdata`]: where the golden sets live in this repository.
//! - [`eval`]: perplexity, top-1 agreement and greedy-divergence checks between engines.
//! - [`wire`]: the hand-off protocol without I/O (messages, frames, chunks, state assembly).
//! - [`transport`]: the hand-off protocol over QUIC (pinned TLS, prefill server and client).
//! - [`process`]: logging set-up and error exit shared by the two binaries.

pub mod checkpoint;
pub mod config;
pub mod eval;
pub mod files;
pub mod fingerprint;
pub mod fit;
pub mod handoff;
pub mod mxfp4;
pub mod process;
pub mod prune;
pub mod synth;
pub mod tensors;
pub mod testdata;
pub mod tokenizer;
pub mod transport;
pub mod weight_digest;
pub mod wire;

pub use checkpoint::{Checkpoint, CheckpointError, TensorView};
pub use config::{AttnKind, FfnKind, K3Config, LayerSpec, TextConfig, VisionConfig};
pub use fingerprint::Fingerprint;
pub use handoff::{HandoffState, KdaState, LayerState, MlaState};
