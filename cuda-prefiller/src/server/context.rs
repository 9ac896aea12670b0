//! What the prefill node's parts share: its settings ([`ServeOptions`]) and the context every
//! connection and request task reads ([`NodeContext`]). Below the tasks that use it
//! (`request`, the accept loop in `mod.rs`), above the parts it holds (`sessions`, `metrics`,
//! `cost`, the `worker`'s queue).

use std::net::SocketAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
#[cfg(feature = "test-knobs")]
use std::time::Duration;

use k3_protocol::config::TextConfig;

use super::cost::CostMeter;
use super::metrics::ServerMetrics;
use super::sessions::{PrefixStore, StoreLimits};
use super::worker::PrefillJob;

/// Settings of a prefill node.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Session prefixes: byte limit and idle lease.
    pub store: StoreLimits,
    /// Requests that may wait behind the computing one; more are refused as `Busy`.
    pub max_queue: usize,
    /// Most new tokens in one request (`TooLarge` past it).
    pub max_request_tokens: usize,
    /// Executor: tokens per chunk within a layer.
    pub chunk_tokens: usize,
    /// Finished layers the worker may hold while the network is behind.
    pub layer_buffer: usize,
    /// Test hook (feature `test-knobs`): the worker sleeps this long after each layer.
    #[cfg(feature = "test-knobs")]
    pub layer_delay: Duration,
    /// Stream each prompt's weights through these (CUDA backend; `None`: the model's own).
    pub streamed: Option<Arc<crate::streamer::StreamedWeights>>,
    /// Serve the metrics in the OpenMetrics text format at `GET /metrics` on this TCP address.
    pub metrics_listen: Option<SocketAddr>,
    /// The emulated weight source (`--emulate-source-gbs`, [`crate::source_pace`]): every pass
    /// reads the layers' weights no faster than its rate (a PC's NVMe measured on a faster box,
    /// or on the CPU stand-in); the node measures and advertises that pass.
    pub source: Option<crate::source_pace::SourceRate>,
    /// Called with the certificate of each decoder whose handshake succeeded (`serve` saves an
    /// explicitly given `--decoder-fingerprint` only once a decoder has proved it).
    pub on_verified: Option<OnVerified>,
    /// Shared weight pass: requests waiting when a pass starts join it while their activations
    /// and states ([`crate::executor::pass_request_bytes`]) sum to at most this many bytes (the
    /// first always runs); 0: every request has a pass of its own.
    pub pass_budget_bytes: u64,
    /// The node's memory plan ([`crate::prefiller::Planner`]): every pass is planned within the
    /// node's device budget and host memory before it starts (its chunk, expert windows and the
    /// bank's place); a request that cannot fit is refused with the plan's reason (the decoder
    /// then prefills locally), and a waiting request joins a shared pass only if the pass still
    /// fits. `None`: `chunk_tokens`, everything on the backend.
    pub planner: Option<crate::prefiller::Planner>,
}

/// A callback on a verified decoder certificate (see [`ServeOptions::on_verified`]).
#[derive(Clone)]
pub struct OnVerified(pub Arc<dyn Fn(k3_protocol::transport::CertFingerprint) + Send + Sync>);

impl std::fmt::Debug for OnVerified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnVerified(..)")
    }
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            store: StoreLimits::default(),
            max_queue: 8,
            max_request_tokens: 1 << 20,
            chunk_tokens: 512,
            layer_buffer: 2,
            #[cfg(feature = "test-knobs")]
            layer_delay: Duration::ZERO,
            streamed: None,
            metrics_listen: None,
            source: None,
            on_verified: None,
            pass_budget_bytes: 16 << 30,
            planner: None,
        }
    }
}

/// What every connection and request task of a prefill node reads: its options, the session
/// prefixes it holds, its counters and cost meter, and the compute worker's job queue.
pub(crate) struct NodeContext {
    pub(crate) text_config: TextConfig,
    pub(crate) opts: ServeOptions,
    pub(crate) sessions: Mutex<PrefixStore>,
    pub(crate) metrics: Arc<ServerMetrics>,
    pub(crate) jobs: Mutex<std::sync::mpsc::Sender<PrefillJob>>,
    pub(crate) in_flight: AtomicUsize,
    pub(crate) cost: Arc<CostMeter>,
}
