//! What the server needs from a model: a small trait, so the HTTP layer, the session store and
//! the decode loop are tested with a fake engine (`FakeEngine` in `tests/support/`, with the
//! tests), and the MLX engine plugs in behind it.

use crate::vision::PreprocessedImage;

/// How a prefill ran.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillReport {
    /// Tokens prefilled by this call.
    pub tokens: usize,
    /// Prefilled on the GPU node (else locally).
    pub remote: bool,
    pub seconds: f64,
    /// Hand-off bytes received from the prefill node.
    pub handoff_bytes: u64,
    /// Time between the prefill node's last computed layer and the state being usable here
    /// (the part of the hand-off not hidden behind compute).
    pub exposed_tail_seconds: f64,
    /// A remote prefill failed and the tokens were prefilled locally instead.
    pub fell_back: bool,
    /// Why the prompt went where it went (the threshold, or the cause of a fallback); empty
    /// when the engine has no choice.
    pub reason: String,
    /// Images run through the vision tower for this prefill, and the seconds it took.
    pub images: usize,
    pub vision_seconds: f64,
    /// The prefill node runs a different, state-compatible model: "accepted" or "refused"
    /// (`remote::CompatibleSource`).
    pub compatible_source: Option<&'static str>,
}

/// A session's state out of the engine, in the canonical hand-off layout with the logits of its
/// last position: what the disk store writes and restores (owned host data, `Send`).
#[derive(Debug, Clone, PartialEq)]
pub struct HeldState {
    pub state: k3_protocol::handoff::HandoffState,
    pub logits: Option<Vec<f32>>,
}

/// What a held state on disk must match to be used by an engine: the model's fingerprint and
/// its text config (layer kinds and sizes).
#[derive(Debug, Clone)]
pub struct StateIdentity {
    pub fingerprint: k3_protocol::Fingerprint,
    pub text_config: k3_protocol::config::TextConfig,
}

/// What the HTTP side needs to prepare images for an engine that takes them.
#[derive(Debug, Clone)]
pub struct MediaSupport {
    /// Pre-processing settings (`preprocessor_config.json` or the published defaults).
    pub config: crate::vision::MediaProcConfig,
    /// The `<|media_pad|>` id (`media_placeholder_token_id`).
    pub pad_id: u32,
}

/// A model the server can drive. The engine is built on, and only used from, one dedicated
/// thread (MLX arrays stay on the thread that made them), so it needs neither `Send` nor `Sync`.
pub trait GenerationEngine: 'static {
    /// One sequence's state (caches and the logits of its last position).
    type Session: 'static;

    /// Number of ids the model scores (`lm_head` rows).
    fn vocab_size(&self) -> usize;
    /// Longest sequence the model accepts (prompt + generated).
    fn max_context(&self) -> usize;
    fn new_session(&mut self) -> anyhow::Result<Self::Session>;
    /// Feeds `tokens` after what the session holds; afterwards [`Self::logits`] predicts the
    /// token after the last of them.
    fn prefill(&mut self, s: &mut Self::Session, tokens: &[u32]) -> anyhow::Result<PrefillReport>;
    /// Feeds one generated token.
    fn step(&mut self, s: &mut Self::Session, token: u32) -> anyhow::Result<()>;
    /// Feeds `tokens[i]` to `sessions[i]`: one decode step of several sessions (continuous
    /// batching). An engine that can stacks them into one forward pass; the default steps them
    /// one after another. Each session ends as [`Self::step`] would leave it.
    fn step_batch(&mut self, sessions: &mut [&mut Self::Session], tokens: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(sessions.len() == tokens.len(), "{} sessions for {} tokens", sessions.len(), tokens.len());
        sessions.iter_mut().zip(tokens).try_for_each(|(s, &t)| self.step(s, t))
    }
    /// Sessions decoded together at most (the rest of the admitted requests wait their turn).
    fn max_batch(&self) -> usize {
        8
    }
    /// Tokens per prefill call when the server may split a prompt's prefill into calls and run
    /// decode steps of the other requests between them (the calls continue the session, so
    /// the result is the same); `None` (the default): one call per prompt (e.g. a prompt that
    /// may go to a prefill node whole).
    fn prefill_chunk(&self) -> Option<usize> {
        None
    }
    /// The flag that cancels the prefill in progress (checked between chunks locally, and on
    /// every event of a remote transfer); `None` clears it. The default ignores it.
    fn set_cancel(&mut self, _flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>) {}
    /// Logits of the next token, if the session has any.
    fn logits<'a>(&self, s: &'a Self::Session) -> Option<&'a [f32]>;
    /// Tokens the session holds.
    fn session_len(&self, s: &Self::Session) -> usize;
    /// Bytes of state the session holds (for the store's budget).
    fn session_bytes(&self, s: &Self::Session) -> usize;
    /// An independent copy of a session (a checkpoint: KDA states cannot be rolled back, so
    /// reuse after a divergence needs a copy taken before it). `s` is mutable because the copy
    /// may share state with it (the MLX engine freezes its rows into shared segments).
    fn fork(&mut self, s: &mut Self::Session) -> anyhow::Result<Self::Session>;

    /// The identity states on disk are checked against; `None` (the default): this engine
    /// cannot export or restore states, and the server keeps none on disk.
    fn state_identity(&self) -> Option<StateIdentity> {
        None
    }
    /// A session's state as host data (for the disk store); the session is unchanged (mutable
    /// for the same reason as [`Self::fork`]).
    fn export_held(&mut self, _s: &mut Self::Session) -> anyhow::Result<HeldState> {
        anyhow::bail!("this engine does not export session states")
    }
    /// A session holding `tokens` from an exported state (the inverse of [`Self::export_held`]).
    fn import_held(&mut self, _tokens: &[u32], _held: HeldState) -> anyhow::Result<Self::Session> {
        anyhow::bail!("this engine does not restore session states")
    }

    /// Image support: `None` (the default) when the model has no vision tower.
    fn media(&self) -> Option<MediaSupport> {
        None
    }
    /// Like [`Self::prefill`], but `tokens` hold `<|media_pad|>` runs, one per image of
    /// `images` in order, each as long as that image's feature rows: the engine encodes the
    /// images and the k-th pad takes the k-th row.
    fn prefill_images(&mut self, s: &mut Self::Session, tokens: &[u32], images: &[&PreprocessedImage]) -> anyhow::Result<PrefillReport> {
        if images.is_empty() {
            return self.prefill(s, tokens);
        }
        anyhow::bail!("this engine does not take images")
    }
}
