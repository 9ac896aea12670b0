//! The decoder engine: load a checkpoint into MLX, hold per-sequence [`Session`]s, prefill
//! locally (chunked) or ingest a hand-off state, step token by token, and run the decode loop.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use mac_decoder::decode::{Engine, GenerateParams};
//! let engine = Engine::load(std::path::Path::new("tests/golden/tiny-a"))?;
//! let mut s = engine.new_session()?;
//! engine.prefill_local(&mut s, &[1, 2, 3], None)?;
//! let out = engine.generate(&mut s, &GenerateParams::greedy(8), |tok| { println!("{tok}"); true })?;
//! println!("{:?} at {:.1} tok/s", out.tokens, out.tokens_per_second());
//! # Ok(()) }
//! ```
//!
//! An `Engine` and its `Session`s hold MLX arrays: use them from one thread (the server runs
//! the engine on a dedicated thread and talks to it over channels).

use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use k3_protocol::config::{K3Config, TextConfig};
use k3_protocol::handoff::HandoffState;
use k3_protocol::{Checkpoint, Fingerprint};
use mlx_rs::{ops, Array};

use crate::decode_loop::TokenStep;
use crate::ingest::{self, SessionFileInfo};
use crate::mlx::{array_f32, array_i32, to_vec_f32};
use crate::model::weights::WeightLoader;
use crate::model::{K3Text, KdaMode, ModelCache};

/// dtype of the weights and of the activations between the model's FP32 islands (KDA
/// recurrence, gates, router, AttnRes, MoE sum, MLA attention, caches: always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDtype {
    /// BF16 weights widened exactly: the parity path (Linux CPU, tests).
    #[default]
    F32,
    /// Weights as stored (half the bytes per decode step): the Metal path.
    Bf16,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Tokens per local-prefill chunk (each chunk runs through all layers, caches carried).
    pub prefill_chunk: usize,
    /// Show a progress bar while loading weights.
    pub progress: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { prefill_chunk: 256, progress: false }
    }
}

pub use crate::vision::ImageEmbeds;

/// The state of one sequence.
pub struct Session {
    cache: ModelCache,
    last_logits: Option<Vec<f32>>,
}

impl Session {
    /// Tokens consumed so far.
    pub fn tokens(&self) -> usize {
        self.cache.tokens
    }
    /// Logits predicting the next token (after a prefill, an ingest with logits, or a step).
    pub fn last_logits(&self) -> Option<&[f32]> {
        self.last_logits.as_deref()
    }
    pub fn cache(&self) -> &ModelCache {
        &self.cache
    }
    /// Bytes of KDA state, conv windows and MLA latents.
    pub fn state_bytes(&self) -> usize {
        self.cache.nbytes()
    }
    /// The prefill client (`crate::remote`) rewinds a session to the prefix the prefill node
    /// holds and commits the layers it streamed.
    pub(crate) fn cache_mut(&mut self) -> &mut ModelCache {
        &mut self.cache
    }
    pub(crate) fn set_last_logits(&mut self, logits: Option<Vec<f32>>) {
        self.last_logits = logits;
    }
}

pub use crate::decode_loop::{GenerateOutput, GenerateParams, LoopEnd};

/// A loaded K3 model.
pub struct Engine {
    config: K3Config,
    model: K3Text,
    fingerprint: Fingerprint,
    /// The state-compatibility identity (docs/pruning.md).
    state_identity: Fingerprint,
    options: EngineOptions,
    /// The decoder ranks this engine is one of (a group of one in a single process).
    world: &'static crate::distributed::Group,
    /// Set: the local prefill in progress stops at the next chunk ([`Self::set_cancel`]).
    cancel: std::sync::Mutex<Option<std::sync::Arc<std::sync::atomic::AtomicBool>>>,
}

impl Engine {
    /// Opens a checkpoint directory (release layout) and loads the text tower.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, EngineOptions::default())
    }

    pub fn load_with(dir: &Path, options: EngineOptions) -> Result<Self> {
        Self::load_with_dtype(dir, options, ComputeDtype::F32)
    }

    /// Loads with weights in `dtype` ([`ComputeDtype::Bf16`] on Metal halves the bytes read).
    pub fn load_with_dtype(dir: &Path, options: EngineOptions, compute: ComputeDtype) -> Result<Self> {
        if options.prefill_chunk == 0 {
            bail!("prefill_chunk must be > 0");
        }
        let t0 = Instant::now();
        let ck = Checkpoint::open(dir).with_context(|| format!("opening checkpoint {}", dir.display()))?;
        let config = ck.config().clone();
        let fingerprint = ck.fingerprint();
        let state_identity = ck.state_identity();
        let dtype = match compute {
            ComputeDtype::F32 => mlx_rs::Dtype::Float32,
            ComputeDtype::Bf16 => mlx_rs::Dtype::Bfloat16,
        };
        let mut wl = WeightLoader::with_dtype(&ck, dtype);
        let n_layers = config.text_config.num_hidden_layers;
        let bar = if options.progress {
            let b = indicatif::ProgressBar::new(n_layers as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template("loading {bar:30} {pos}/{len} layers {elapsed}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        } else {
            indicatif::ProgressBar::hidden()
        };
        let world = crate::distributed::world()?;
        let model = K3Text::load(&mut wl, &config.text_config, Some(world), |done, _| bar.set_position(done as u64))?;
        bar.finish_and_clear();
        world.barrier("every rank has loaded its part of the model", world.start_timeout())?;
        tracing::info!(
            dir = %dir.display(),
            fingerprint = %fingerprint.short(),
            layers = n_layers,
            dtype = ?compute,
            weight_mb = model.weight_bytes() as f64 / 1e6,
            seconds = t0.elapsed().as_secs_f64(),
            rank = world.rank(),
            ranks = world.size(),
            "model loaded"
        );
        Ok(Engine { config, model, fingerprint, state_identity, options, world, cancel: Default::default() })
    }

    /// The flag that cancels local prefills: while it is set, a prefill stops before its next
    /// chunk with an error (the session then holds the chunks already run). `None` clears it.
    pub fn set_cancel(&self, flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>) {
        *self.cancel.lock().unwrap_or_else(|e| e.into_inner()) = flag;
    }

    fn cancelled(&self) -> bool {
        self.cancel.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }

    pub fn config(&self) -> &K3Config {
        &self.config
    }
    pub fn text_config(&self) -> &TextConfig {
        &self.config.text_config
    }
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }
    /// The state-compatibility identity: equal for this model and any model pruned from the
    /// same source (or that source), whose hand-off states this model can continue.
    pub fn state_identity(&self) -> &Fingerprint {
        &self.state_identity
    }
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }
    /// Bytes of all weights held in MLX.
    pub fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }
    /// Weight bytes one decode step reads (see [`K3Text::decode_weight_bytes`]).
    pub fn decode_weight_bytes(&self) -> usize {
        self.model.decode_weight_bytes()
    }
    /// The `eos_token_id` (`<|end_of_msg|>` in K3).
    pub fn eos_token(&self) -> u32 {
        self.config.eos_token_id
    }

    pub fn new_session(&self) -> Result<Session> {
        Ok(Session { cache: ModelCache::new(self.text_config())?, last_logits: None })
    }

    fn check_ids(&self, tokens: &[u32]) -> Result<Vec<i32>> {
        let vocab = self.text_config().vocab_size;
        tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| if (t as usize) < vocab { Ok(t as i32) } else { Err(anyhow!("token {t} at position {i} is outside the vocabulary (size {vocab})")) })
            .collect()
    }

    /// Input embeddings `[T, H]`; image rows replace the `<|media_pad|>` positions in order and
    /// `pad_token_id` positions are zeroed (the reference multimodal merge, spec §8).
    fn embeddings(&self, tokens: &[u32], image: Option<&ImageEmbeds>) -> Result<Array> {
        let ids = self.check_ids(tokens)?;
        let emb = self.model.embed(&array_i32(&ids, &[ids.len()], "input ids")?)?;
        let pads: Vec<usize> = (0..tokens.len()).filter(|&i| tokens[i] == self.config.media_placeholder_token_id).collect();
        let Some(img) = image else {
            if !pads.is_empty() {
                bail!("the prompt holds {} media placeholder token(s) but no image embeddings were given", pads.len());
            }
            return Ok(emb);
        };
        let h = self.text_config().hidden_size;
        if img.rows != pads.len() {
            bail!("{} image embedding rows for {} media placeholder tokens", img.rows, pads.len());
        }
        if let Some(i) = img.data.iter().position(|x| !x.is_finite()) {
            bail!("image embeddings hold a non-finite value at index {i}");
        }
        let img_arr = array_f32(&img.data, &[img.rows, h], "image embeddings")?.as_dtype(emb.dtype())?;
        let mut map = vec![0i32; tokens.len()];
        let mut is_img = vec![false; tokens.len()];
        for (k, &p) in pads.iter().enumerate() {
            map[p] = k as i32;
            is_img[p] = true;
        }
        let is_pad: Vec<bool> = tokens.iter().map(|&t| t == self.config.pad_token_id).collect();
        let n = tokens.len() as i32;
        let gathered = if img.rows > 0 { img_arr.take_axis(array_i32(&map, &[tokens.len()], "map")?, 0)? } else { emb.clone() };
        let is_img = Array::from_slice(&is_img, &[n, 1]);
        let is_pad = Array::from_slice(&is_pad, &[n, 1]);
        let emb = ops::select(&is_img, &gathered, &emb)?;
        Ok(ops::select(&is_pad, Array::from_f32(0.0), &emb)?)
    }

    /// Runs `tokens` through the model in chunks; returns the logits of every position
    /// (`all`) or of the last one, flattened row-major.
    fn prefill(&self, s: &mut Session, tokens: &[u32], image: Option<&ImageEmbeds>, all: bool) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            bail!("prefill of an empty prompt");
        }
        let t0 = Instant::now();
        let x = self.embeddings(tokens, image)?;
        let mut out = Vec::new();
        let n = tokens.len();
        let mut c0 = 0;
        while c0 < n {
            if self.cancelled() {
                bail!("prefill cancelled after {c0} of {n} tokens: the request was abandoned");
            }
            let c1 = (c0 + self.options.prefill_chunk).min(n);
            let xc = x.try_index_range(c0, c1)?;
            // forward reads each MoE layer's routing back (collectives run there too)
            let wait = self.rank_wait(|| format!("prefilling tokens {c0}..{c1}"), c1 - c0);
            let hidden = wait.check(self.model.forward(&xc, &mut s.cache, KdaMode::Chunked))?;
            let hidden = if all || c1 < n { hidden } else { hidden.try_index_range(c1 - c0 - 1, c1 - c0)? };
            let logits = if all || c1 == n { Some(self.model.logits(&hidden)?) } else { None };
            let mut to_eval = s.cache.arrays();
            to_eval.extend(logits.as_ref());
            wait.check(mlx_rs::transforms::eval(to_eval).map_err(anyhow::Error::from))?;
            drop(wait);
            if let Some(l) = logits {
                if all || c1 == n {
                    out.extend(to_vec_f32(&l)?);
                }
            }
            c0 = c1;
        }
        let vocab = self.text_config().vocab_size;
        s.last_logits = Some(out[out.len() - vocab..].to_vec());
        let secs = t0.elapsed().as_secs_f64();
        tracing::debug!(tokens = n, seconds = secs, tok_per_s = n as f64 / secs, "local prefill");
        Ok(out)
    }

    /// Local prefill: feeds `tokens` (after whatever the session holds) and returns the logits
    /// row of the last position (also kept in the session for [`Self::generate`]).
    pub fn prefill_local(&self, s: &mut Session, tokens: &[u32], image: Option<&ImageEmbeds>) -> Result<Vec<f32>> {
        self.prefill(s, tokens, image, false)
    }

    /// Like [`Self::prefill_local`] but returns the logits of every position, `[T, vocab]`
    /// row-major (parity checks against a reference).
    pub fn prefill_logits(&self, s: &mut Session, tokens: &[u32], image: Option<&ImageEmbeds>) -> Result<Vec<f32>> {
        self.prefill(s, tokens, image, true)
    }

    /// Ingests a hand-off delta at `base` (see [`crate::ingest`]); `last_logits`, when the
    /// prefill node sent them, are the logits of the last prefilled position.
    pub fn ingest(&self, s: &mut Session, base: usize, delta: &HandoffState, last_logits: Option<Vec<f32>>) -> Result<()> {
        if let Some(l) = &last_logits {
            if l.len() != self.text_config().vocab_size {
                bail!("last logits hold {} values, the vocabulary has {}", l.len(), self.text_config().vocab_size);
            }
        }
        ingest::ingest_delta(self.text_config(), &mut s.cache, base, delta)?;
        s.last_logits = last_logits;
        Ok(())
    }

    /// Loads a session file (state, and the last logits row when it carries `logits`) into a
    /// fresh session.
    pub fn ingest_session_file(&self, s: &mut Session, path: &Path) -> Result<SessionFileInfo> {
        if s.tokens() != 0 {
            bail!("a session file loads into a fresh session (this one holds {} tokens)", s.tokens());
        }
        let info = ingest::ingest_session_file(self.text_config(), &self.fingerprint, &mut s.cache, path)?;
        s.last_logits = info.last_logits.clone();
        Ok(info)
    }

    /// The session's state in the canonical hand-off layout.
    /// A copy of `s` (a checkpoint) that shares its arrays: no state is copied, whatever the
    /// context length (MLA rows become segments shared by both; see `model::cache`).
    pub fn fork_session(&self, s: &mut Session) -> Result<Session> {
        Ok(Session { cache: s.cache.fork()?, last_logits: s.last_logits.clone() })
    }

    pub fn export_state(&self, s: &Session) -> Result<HandoffState> {
        ingest::export_state(self.text_config(), &s.cache)
    }

    /// Feeds one token (recurrent KDA, absorbed MLA over the latent cache) and returns the
    /// logits predicting the next one.
    pub fn step(&self, s: &mut Session, token: u32) -> Result<Vec<f32>> {
        self.advance(s, token)?;
        Ok(s.last_logits.clone().expect("set by advance"))
    }

    /// [`Self::step`] keeping the logits in the session only.
    fn advance(&self, s: &mut Session, token: u32) -> Result<()> {
        let ids = self.check_ids(&[token])?;
        let ids = array_i32(&ids, &[1], "token")?;
        // with ranks: every rank feeds rank 0's token (and checks below that they all agree)
        let wait = self.rank_wait(|| format!("decoding the token after position {}", s.cache.tokens), 1);
        let proposed = self.world.all_gather(&ids)?;
        let fed = if self.world.is_distributed() { proposed.try_index_range(0, 1)? } else { ids };
        let x = self.model.embed(&fed)?;
        let hidden = wait.check(self.model.forward(&x, &mut s.cache, KdaMode::Recurrent))?;
        let logits = self.model.logits(&hidden)?;
        let mut to_eval = s.cache.arrays();
        to_eval.push(&logits);
        to_eval.push(&proposed);
        wait.check(mlx_rs::transforms::eval(to_eval).map_err(anyhow::Error::from))?;
        drop(wait);
        if self.world.is_distributed() {
            let p = proposed.as_slice::<i32>();
            if let Some(r) = p.iter().position(|&x| x != p[0]) {
                bail!("decoder ranks disagree on the token at position {}: rank 0 fed {}, rank {r} sampled {}", s.cache.tokens - 1, p[0], p[r]);
            }
        }
        s.last_logits = Some(to_vec_f32(&logits)?);
        Ok(())
    }

    /// One decode step of several sessions at once (continuous batching): feeds `tokens[i]`
    /// to `sessions[i]` and keeps each one's next logits. The sessions' rows go through the
    /// layers together (one pass over the weights for the whole batch); each session's KDA
    /// states and MLA latent rows stay its own, whatever its length. Equal to stepping them
    /// one by one up to float rounding (tested). With decoder ranks the sessions are stepped
    /// one after another.
    pub fn step_batch(&self, sessions: &mut [&mut Session], tokens: &[u32]) -> Result<()> {
        if sessions.len() != tokens.len() {
            bail!("{} sessions for {} tokens", sessions.len(), tokens.len());
        }
        if sessions.len() <= 1 || self.world.is_distributed() {
            return sessions.iter_mut().zip(tokens).try_for_each(|(s, &t)| self.advance(s, t));
        }
        let ids = self.check_ids(tokens)?;
        let b = ids.len();
        let x = self.model.embed(&array_i32(&ids, &[b], "tokens")?)?;
        let mut caches: Vec<&mut ModelCache> = sessions.iter_mut().map(|s| &mut s.cache).collect();
        let hidden = self.model.forward_batch(&x, &mut caches, KdaMode::Recurrent)?;
        let logits = self.model.logits(&hidden)?; // [B, vocab]
        let mut to_eval: Vec<&Array> = caches.iter().flat_map(|c| c.arrays()).collect();
        to_eval.push(&logits);
        mlx_rs::transforms::eval(to_eval)?;
        drop(caches);
        let all = to_vec_f32(&logits)?;
        let vocab = self.text_config().vocab_size;
        if all.len() != b * vocab {
            bail!("a batched step returned {} logits for {b} sessions of vocabulary {vocab}", all.len());
        }
        for (s, row) in sessions.iter_mut().zip(all.chunks_exact(vocab)) {
            s.last_logits = Some(row.to_vec());
        }
        Ok(())
    }

    /// The decoder ranks this engine belongs to.
    pub fn world(&self) -> &'static crate::distributed::Group {
        self.world
    }

    /// Arms the rank watchdog around work that holds collectives: a decode step (`tokens` 1)
    /// gets the step timeout, a prefill chunk of `T` tokens `1 + ⌈T/16⌉` of them; a single
    /// process arms nothing.
    fn rank_wait(&self, what: impl FnOnce() -> String, tokens: usize) -> RankWait {
        if !self.world.is_distributed() {
            return RankWait(None);
        }
        let steps = if tokens <= 1 { 1 } else { 1 + tokens.div_ceil(16) };
        let timeout = self.world.step_timeout() * steps as u32;
        let what = format!("rank {} of {} {}", self.world.rank(), self.world.size(), what());
        let guard = crate::distributed::watchdog::guard(&what, timeout);
        RankWait(Some((guard, what)))
    }

    /// The decode loop ([`crate::decode_loop::generate`]) on one session: samples from its last
    /// logits, reports each token to `on_token` (return false to stop), feeds it, until
    /// `max_new_tokens` or a stop token. Every emitted token is fed, so the session afterwards
    /// holds prompt + output.
    pub fn generate(&self, s: &mut Session, params: &GenerateParams, on_token: impl FnMut(u32) -> bool) -> Result<GenerateOutput> {
        crate::decode_loop::generate(&mut Stepping { engine: self, session: s }, params, on_token)
    }
}

/// A session of an engine, as the decode loop drives it.
struct Stepping<'a> {
    engine: &'a Engine,
    session: &'a mut Session,
}

impl TokenStep for Stepping<'_> {
    fn next_logits(&self) -> Option<&[f32]> {
        self.session.last_logits()
    }
    fn feed(&mut self, token: u32) -> Result<()> {
        self.engine.advance(self.session, token)
    }
}

/// A watchdog guard and what it waits for (see [`Engine::rank_wait`]).
struct RankWait(Option<(crate::distributed::watchdog::Guard, String)>);

impl RankWait {
    /// Names the rank and the step in an error (a peer rank that went away surfaces here as
    /// MLX's "connection to a peer was lost").
    fn check<T>(&self, r: Result<T>) -> Result<T> {
        match &self.0 {
            Some((_, what)) => r.with_context(|| what.clone()),
            None => r,
        }
    }
}

/// Row slicing on the first axis.
trait RowRange {
    fn try_index_range(&self, a: usize, b: usize) -> Result<Array>;
}

impl RowRange for Array {
    fn try_index_range(&self, a: usize, b: usize) -> Result<Array> {
        use mlx_rs::ops::indexing::TryIndexOp;
        Ok(self.try_index(a as i32..b as i32)?)
    }
}
