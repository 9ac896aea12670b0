//! The MLX K3 engine ([`crate::decode::Engine`]) behind the server's [`GenerationEngine`] trait.
//!
//! A session is a [`Conversation`] (the decoder session, its token history and the prefix the
//! prefill node holds of it). Prompts are prefilled locally (chunked), or — with a prefill node
//! ([`MlxEngine::with_remote`]) — routed by [`RemotePrefiller`]: prompts with at least
//! `min_tokens` new tokens go to the node, shorter ones stay local, and any failure of the node
//! ends in a local prefill (reported as a fallback). A session copy (checkpoint) goes through
//! the canonical hand-off state: export, then ingest into a fresh session.
//!
//! Images: the vision tower (MoonViT-V2 + projector on MLX) is loaded on the first image; its
//! feature rows replace the `<|media_pad|>` embeddings, locally or in the prefill request.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use k3_protocol::transport::NodeConfig;
use k3_protocol::Checkpoint;

use super::generation_engine::{GenerationEngine, HeldState, MediaSupport, PrefillReport, StateIdentity};
use crate::decode::{Engine, EngineOptions, ImageEmbeds};
use crate::remote::{Conversation, RemoteOptions, RemotePrefiller, Route};
use crate::vision::{self, MediaProcConfig, MlxVisionEncoder, NormEps, PreprocessedImage, VisionEncoder};

/// Sessions decoded together by default (`k3-decode serve --max-batch`).
pub const DEFAULT_MAX_BATCH: usize = 8;

/// The tensor whose presence says the checkpoint has a vision tower.
const VISION_PROBE: &str = "vision_tower.patch_embed.proj.weight";

pub struct MlxEngine {
    engine: Engine,
    max_context: usize,
    dir: PathBuf,
    remote: Option<RemotePrefiller>,
    media: Option<MediaSupport>,
    /// Loaded on the first image.
    vision: Option<MlxVisionEncoder>,
    /// The vision memory budget in bytes (`None`: unbounded), [`MlxEngine::with_vision_memory`].
    vision_memory: Option<u64>,
    /// Sessions decoded together at most ([`GenerationEngine::max_batch`]).
    max_batch: usize,
}

impl MlxEngine {
    /// Loads the checkpoint; `max_context` 0 means the config's `max_position_embeddings`.
    pub fn load(dir: &Path, options: EngineOptions, max_context: usize) -> anyhow::Result<Self> {
        let engine = Engine::load_with(dir, options)?;
        let max_context = if max_context == 0 { engine.text_config().max_position_embeddings } else { max_context };
        let ck = Checkpoint::open(dir).with_context(|| format!("opening {}", dir.display()))?;
        let vision_memory = crate::memory::budget(None, 0);
        let media = if ck.tensor_names().any(|n| n == VISION_PROBE) {
            match MediaProcConfig::load(dir, &ck.config().vision_config, vision_memory) {
                Ok(config) => Some(MediaSupport { config, pad_id: engine.config().media_placeholder_token_id }),
                Err(e) => {
                    tracing::warn!(error = %e, "image inputs are disabled: the pre-processing config cannot be used");
                    None
                }
            }
        } else {
            tracing::info!("the checkpoint has no vision tower: image inputs are refused");
            None
        };
        Ok(MlxEngine { engine, max_context, dir: dir.to_path_buf(), remote: None, media, vision: None, vision_memory, max_batch: DEFAULT_MAX_BATCH })
    }

    /// Routes prompts through a prefill node (see [`RemotePrefiller::new`]: pairing problems do
    /// not fail here, every remote attempt then falls back with the reason).
    pub fn with_remote(mut self, opts: RemoteOptions) -> anyhow::Result<Self> {
        self.remote = Some(RemotePrefiller::new(&self.engine, opts)?);
        Ok(self)
    }

    /// The same with an explicit node config (tests: generated identities, fault hooks).
    pub fn with_remote_config(mut self, opts: RemoteOptions, cfg: NodeConfig) -> anyhow::Result<Self> {
        self.remote = Some(RemotePrefiller::with_node_config(&self.engine, opts, cfg)?);
        Ok(self)
    }

    /// Decode at most `n` sessions together (1: one after another, as before batching).
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n.max(1);
        self
    }

    /// Bounds image work by a vision memory `budget` in bytes (`None`: unbounded); the default
    /// of [`MlxEngine::load`] is half the memory available then ([`crate::memory::budget`]).
    pub fn with_vision_memory(mut self, budget: Option<u64>) -> Self {
        self.vision_memory = budget;
        if let Some(m) = self.media.take() {
            let v = &self.engine.config().vision_config;
            self.media = Some(MediaSupport { config: m.config.bounded(v, self.vision_memory), ..m });
        }
        self.vision = None;
        self
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn remote(&self) -> Option<&RemotePrefiller> {
        self.remote.as_ref()
    }

    fn vision(&mut self) -> anyhow::Result<&MlxVisionEncoder> {
        if self.media.is_none() {
            anyhow::bail!("this model has no vision tower");
        }
        if self.vision.is_none() {
            let t = Instant::now();
            let ck = Checkpoint::open(&self.dir).with_context(|| format!("opening {}", self.dir.display()))?;
            let enc = MlxVisionEncoder::load_bounded(&ck, NormEps::default(), self.vision_memory).context("loading the vision tower")?;
            tracing::info!(seconds = format!("{:.2}", t.elapsed().as_secs_f64()), "vision tower loaded");
            self.vision = Some(enc);
        }
        Ok(self.vision.as_ref().expect("loaded above"))
    }

    /// Prefills `tokens` (with image rows for their pads): through the prefill client when
    /// there is one, else locally.
    fn prefill_embeds(&mut self, s: &mut Conversation, tokens: &[u32], image: Option<&ImageEmbeds>) -> anyhow::Result<PrefillReport> {
        let Some(remote) = self.remote.as_mut() else {
            let t0 = Instant::now();
            s.prefill_local(&self.engine, tokens, image)?;
            return Ok(PrefillReport { tokens: tokens.len(), seconds: t0.elapsed().as_secs_f64(), ..Default::default() });
        };
        let t = remote.prefill(&self.engine, s, tokens, image)?;
        let remote_route = t.route == Route::Remote;
        Ok(PrefillReport {
            tokens: t.prefill_tokens,
            remote: remote_route,
            // A local or fallback prefill counts its own time (a failed attempt is not prefill).
            seconds: if remote_route { t.prefill_s } else { t.local_prefill_s.unwrap_or(t.prefill_s) },
            handoff_bytes: t.state_bytes,
            exposed_tail_seconds: t.exposed_tail_s.unwrap_or(0.0),
            fell_back: t.route == Route::Fallback,
            compatible_source: t.compatible_source.map(|c| c.as_str()),
            reason: t.reason,
            ..Default::default()
        })
    }
}

impl GenerationEngine for MlxEngine {
    type Session = Conversation;

    fn vocab_size(&self) -> usize {
        self.engine.text_config().vocab_size
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn new_session(&mut self) -> anyhow::Result<Conversation> {
        Conversation::new(&self.engine)
    }
    fn prefill(&mut self, s: &mut Conversation, tokens: &[u32]) -> anyhow::Result<PrefillReport> {
        self.prefill_embeds(s, tokens, None)
    }
    fn step(&mut self, s: &mut Conversation, token: u32) -> anyhow::Result<()> {
        s.step(&self.engine, token).map(|_| ())
    }
    fn step_batch(&mut self, sessions: &mut [&mut Conversation], tokens: &[u32]) -> anyhow::Result<()> {
        Conversation::step_batch(&self.engine, sessions, tokens)
    }
    fn max_batch(&self) -> usize {
        self.max_batch
    }
    /// Local prefills run chunk by chunk between the decode steps of the running requests; with
    /// a prefill node a prompt stays whole (its route is chosen for the whole prompt).
    fn prefill_chunk(&self) -> Option<usize> {
        self.remote.is_none().then(|| self.engine.options().prefill_chunk)
    }
    fn set_cancel(&mut self, flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>) {
        if let Some(r) = self.remote.as_mut() {
            r.set_cancel(flag.clone());
        }
        self.engine.set_cancel(flag);
    }
    fn logits<'a>(&self, s: &'a Conversation) -> Option<&'a [f32]> {
        s.last_logits()
    }
    fn session_len(&self, s: &Conversation) -> usize {
        s.session().tokens()
    }
    fn session_bytes(&self, s: &Conversation) -> usize {
        s.session().state_bytes() + 4 * s.tokens().len()
    }
    fn fork(&mut self, s: &mut Conversation) -> anyhow::Result<Conversation> {
        s.fork(&self.engine)
    }
    fn state_identity(&self) -> Option<StateIdentity> {
        Some(StateIdentity { fingerprint: *self.engine.fingerprint(), text_config: self.engine.text_config().clone() })
    }
    fn export_held(&mut self, s: &mut Conversation) -> anyhow::Result<HeldState> {
        Ok(HeldState { state: self.engine.export_state(s.session())?, logits: s.last_logits().map(|l| l.to_vec()) })
    }
    fn import_held(&mut self, tokens: &[u32], held: HeldState) -> anyhow::Result<Conversation> {
        Conversation::restore(&self.engine, tokens, &held.state, held.logits)
    }
    fn media(&self) -> Option<MediaSupport> {
        self.media.clone()
    }
    fn prefill_images(&mut self, s: &mut Conversation, tokens: &[u32], images: &[&PreprocessedImage]) -> anyhow::Result<PrefillReport> {
        if images.is_empty() {
            return self.prefill(s, tokens);
        }
        let t0 = Instant::now();
        let enc = self.vision()?;
        let mut features = Vec::with_capacity(images.len());
        for (i, img) in images.iter().enumerate() {
            features.push(enc.encode(img).with_context(|| format!("encoding image {} of {}", i + 1, images.len()))?);
        }
        let embeds = vision::image_embeds(&features);
        let vision_seconds = t0.elapsed().as_secs_f64();
        let mut report = self.prefill_embeds(s, tokens, Some(&embeds))?;
        report.images = images.len();
        report.vision_seconds = vision_seconds;
        Ok(report)
    }
}
