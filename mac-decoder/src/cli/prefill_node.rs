//! The flags `generate` and `serve` share to reach a prefill node (split inference).

use std::path::PathBuf;

/// Where the prefill node is and how it is trusted.
#[derive(clap::Args, Debug, Clone)]
pub struct PrefillNodeArgs {
    /// Prefill node `HOST:PORT`: a turn is prefilled there when the node's advertised cost
    /// (queue, weight pass, compute, hand-off tail) beats the local prefill with a margin, or
    /// with --remote-min-tokens when it has that many new tokens; any failure falls back to local.
    #[arg(long)]
    pub prefill_node: Option<String>,
    /// Manual override of the cost-based routing: prompts with at least this many new tokens go
    /// to the prefill node, shorter ones stay local.
    #[arg(long)]
    pub remote_min_tokens: Option<usize>,
    /// Remote must beat local by this fraction of its predicted time (cost-based routing).
    #[arg(long, default_value_t = 0.15)]
    pub route_margin: f64,
    /// Local prefill rate (tokens/s) assumed until this decoder measured its own: with
    /// --local-calibration-tokens 0, or when the calibration at start fails.
    #[arg(long, default_value_t = 120.0)]
    pub local_prefill_tok_s: f64,
    /// Tokens of the local prefill this decoder times at start, before its first routing
    /// decision, to learn its own prefill rate (0: none; --local-prefill-tok-s is used until a
    /// local turn was measured).
    #[arg(long, default_value_t = 128)]
    pub local_calibration_tokens: usize,
    /// Pin the prefill node's certificate (sha256:..., printed by `k3-prefill serve`); saved.
    #[arg(long)]
    pub prefill_fingerprint: Vec<String>,
    /// The decoder's certificate and pinned peers (default ~/.config/k3-offload/decoder).
    #[arg(long)]
    pub config_dir: Option<PathBuf>,
    /// Plain loopback to the prefill node without certificate pinning (loopback addresses
    /// only; development).
    #[arg(long)]
    pub insecure_dev: bool,
    /// Use hand-off states from a prefill node whose model differs from this decoder's but has
    /// the same state identity (docs/pruning.md): typically the full model this pruned model
    /// was made from. Without it such a node is refused (both fingerprints named) and turns
    /// are prefilled locally.
    #[arg(long)]
    pub accept_compatible_states: bool,
}

#[cfg(feature = "mlx")]
impl PrefillNodeArgs {
    /// The client options, `None` without `--prefill-node` (the trust flags alone only warn).
    pub fn remote_options(&self) -> Option<crate::remote::RemoteOptions> {
        let Some(node) = &self.prefill_node else {
            if self.insecure_dev || !self.prefill_fingerprint.is_empty() || self.accept_compatible_states {
                tracing::warn!("--insecure-dev / --prefill-fingerprint / --accept-compatible-states have no effect without --prefill-node");
            }
            return None;
        };
        let mut o = crate::remote::RemoteOptions::new(node.clone());
        o.insecure_dev = self.insecure_dev;
        o.accept_compatible_states = self.accept_compatible_states;
        o.prefill_fingerprints = self.prefill_fingerprint.clone();
        o.config_dir = self.config_dir.clone();
        o.min_tokens = self.remote_min_tokens;
        o.route.margin = self.route_margin;
        o.route.local_tok_per_s = self.local_prefill_tok_s;
        o.route.calibration_tokens = self.local_calibration_tokens;
        match o.min_tokens {
            Some(m) => tracing::info!(node, min_tokens = m, "prompts with at least min_tokens new tokens are prefilled on the prefill node"),
            None => tracing::info!(node, margin = o.route.margin, "each turn goes where its predicted prefill time is shorter"),
        }
        Some(o)
    }
}
