//! The flags `generate` and `serve` share to reach a prefill node (split inference).

use std::path::PathBuf;

/// Where the prefill node is and how it is trusted.
#[derive(clap::Args, Debug, Clone)]
pub struct PrefillNodeArgs {
    /// Prefill node `HOST:PORT`: prompts with at least --remote-min-tokens new tokens (after
    /// prefix reuse) are prefilled there, shorter ones locally; any failure falls back to local.
    #[arg(long)]
    pub prefill_node: Option<String>,
    /// Prompts with at least this many new tokens go to the prefill node.
    #[arg(long, default_value_t = 1024)]
    pub remote_min_tokens: usize,
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
}

#[cfg(feature = "mlx")]
impl PrefillNodeArgs {
    /// The client options, `None` without `--prefill-node` (the trust flags alone only warn).
    pub fn remote_options(&self) -> Option<crate::remote::RemoteOptions> {
        let Some(node) = &self.prefill_node else {
            if self.insecure_dev || !self.prefill_fingerprint.is_empty() {
                tracing::warn!("--insecure-dev / --prefill-fingerprint have no effect without --prefill-node");
            }
            return None;
        };
        let mut o = crate::remote::RemoteOptions::new(node.clone());
        o.insecure_dev = self.insecure_dev;
        o.prefill_fingerprints = self.prefill_fingerprint.clone();
        o.config_dir = self.config_dir.clone();
        o.min_tokens = self.remote_min_tokens;
        tracing::info!(node, min_tokens = o.min_tokens, "prompts with at least min_tokens new tokens are prefilled on the prefill node");
        Some(o)
    }
}
