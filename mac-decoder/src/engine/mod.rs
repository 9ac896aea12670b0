//! The decoder's engine, apart from HTTP: what a model must offer the server
//! ([`generation_engine`]: the [`GenerationEngine`] trait), the jobs that flow through it
//! ([`jobs`]), the handle the HTTP side submits through with its tokens-in-flight admission
//! ([`handle`]), the engine thread's scheduler loop ([`scheduler`]), the prefix-keyed held
//! sessions ([`sessions`]) and their copies on disk ([`disk_store`], fronted on the engine thread
//! by `held`), the context-length limit ([`context_limit`]), and the engines: K3 on
//! MLX ([`mlx_engine`]) and its mirroring over decoder ranks ([`ranks`]).
//!
//! Nothing here knows HTTP; `server/` translates requests onto [`EngineHandle`].

pub mod context_limit;
pub mod disk_store;
pub mod generation_engine;
pub mod handle;
mod held;
pub mod jobs;
#[cfg(feature = "mlx")]
pub mod mlx_engine;
#[cfg(feature = "mlx")]
pub mod ranks;
pub mod responses;
pub mod scheduler;
pub mod sessions;

pub use disk_store::DiskOptions;
pub use generation_engine::{GenerationEngine, HeldState, MediaSupport, PrefillReport, StateIdentity};
pub use handle::{EngineHandle, JobEvents, SubmitError};
pub use jobs::{Emitted, GenEvent, GenJob, JobImage, LoopEnd, StoreOptions};
