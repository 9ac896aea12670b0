//! What flows through the engine: a generation job, its images, the events it reports, and the
//! session store's limits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

use super::generation_engine::PrefillReport;
use super::sessions::MediaKey;
use crate::sampler::{SamplingParams, TokenConstraint};
use crate::vision::PreprocessedImage;

/// What a job's token events carry (the decode loop's output), named here so the HTTP side
/// speaks the engine's vocabulary only.
pub use crate::decode_loop::{Emitted, LoopEnd};

/// Limits of the session store.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub max_sessions: usize,
    pub max_bytes: usize,
    /// Keep a copy of the state at each prompt's end (turn boundary).
    pub checkpoints: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions { max_sessions: 16, max_bytes: 8 << 30, checkpoints: true }
    }
}

/// One image of a prompt: the tower's input and which pad run of the prompt it fills.
pub struct JobImage {
    pub image: PreprocessedImage,
    /// Its pad run in the (expanded) prompt and a digest of the image bytes.
    pub key: MediaKey,
}

/// One generation request.
pub struct GenJob {
    pub prompt: Vec<u32>,
    /// The images of the prompt, in order (their pad runs already expanded in `prompt`).
    pub images: Vec<JobImage>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends after emitting one of these (it is reported and fed).
    pub stop_ids: Vec<u32>,
    /// Constrained decoding (structured output, forced tool calls): masks every step.
    pub constraint: Option<Box<dyn TokenConstraint + Send>>,
    /// Report log-probabilities with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Prompt positions (ascending, inside the prompt) where the prefill also leaves a
    /// checkpoint: the ends of the prompt's last messages, so a next turn that changes the last
    /// message (a trailing reminder dropped, an edited question) still continues the rest.
    pub checkpoint_at: Vec<usize>,
    /// The client's conversation key (`prompt_cache_key`, the session id of Anthropic's
    /// `metadata.user_id`, ...): the held sessions are tracked per key.
    pub session_key: Option<String>,
    /// The cache scope (a digest of the request's `cache_salt` and API key; `None`: the shared
    /// scope): the job continues, and leaves, held states of this scope only
    /// ([`super::sessions`]).
    pub cache_scope: Option<String>,
}

/// A job in the engine's queue, with its way back to the handler.
pub(crate) struct Queued {
    pub(crate) job: GenJob,
    pub(crate) events: mpsc::UnboundedSender<GenEvent>,
    pub(crate) cancel: Arc<AtomicBool>,
}

impl Queued {
    pub(crate) fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.events.is_closed()
    }
}

/// What the engine thread reports about a job.
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// The prompt is in: how much was reused, where the prompt first differed from every held
    /// state (its longest common prefix with any of them: `first_difference` ≥ `reused_tokens`;
    /// the tokens between could not be continued, K3's recurrent state cannot be cut back), and
    /// how the rest was prefilled.
    Prefilled {
        reused_tokens: usize,
        first_difference: usize,
        report: PrefillReport,
    },
    /// Prefill progress: `done` of the prompt's `total` tokens are in (after each chunk).
    Progress {
        done: usize,
        total: usize,
    },
    Token(Emitted),
    Done {
        finish: LoopEnd,
        generated: usize,
        decode_seconds: f64,
    },
    Error(String),
}
