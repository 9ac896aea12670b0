//! The decoder's side of split inference: a prefill client with a routing policy and a local
//! fallback (docs/e2e.md).
//!
//! - [`Conversation`]: a [`crate::decode::Session`] with its token history and the prefix the
//!   prefill node holds of it, so a later turn sends only what the node has not seen (the
//!   generated tokens and the new prompt).
//! - [`RemotePrefiller`]: prompts with at least `min_tokens` new tokens go to the node over QUIC;
//!   each layer is staged into MLX as it arrives, the session changes only once every layer is in
//!   and verified; any failure (node unreachable, unpaired, another model, a refusal, a dropped
//!   connection, a corrupt chunk) ends in a local prefill with the same result and a log line.
//! - [`TurnTiming`]: the per-request breakdown (tokens, remote compute, transfer, exposed tail,
//!   ingest, first-token latency, decode tok/s), printed by `k3-decode generate` and meant to be
//!   exported as metrics by the OpenAI server.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use mac_decoder::decode::{Engine, GenerateParams};
//! use mac_decoder::remote::{run_turn, Conversation, RemoteOptions, RemotePrefiller};
//! let engine = Engine::load(std::path::Path::new("model"))?;
//! let mut opts = RemoteOptions::new("192.168.1.20:7433");
//! opts.prefill_fingerprints.push("sha256:...".into());
//! let mut remote = RemotePrefiller::new(&engine, opts)?;
//! let mut conv = Conversation::new(&engine)?;
//! let prompt: Vec<u32> = vec![1, 2, 3];
//! let (out, timing) = run_turn(&engine, &mut conv, Some(&mut remote), &prompt, None, &GenerateParams::greedy(16), |_| true)?;
//! eprintln!("{}", mac_decoder::remote::format_table(&[timing]));
//! # let _ = out; Ok(()) }
//! ```

mod client;
mod conversation;
pub mod route;
pub mod timing;

pub use client::{run_turn, Cancelled, RemoteOptions, RemotePrefiller};
pub use conversation::Conversation;
pub use route::{Decision, RoutePolicy, Router};
pub use timing::{format_table, CompatibleSource, Route, TurnTiming};
