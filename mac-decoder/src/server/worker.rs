//! The engine thread: owns the [`GenerationEngine`] and the [`SessionStore`], runs one
//! generation job at a time (prefix reuse, prefill, checkpoint, the decode loop of
//! [`crate::generate`]) and streams
//! token ids back to the HTTP handler over a channel. A handler that goes away (client gone,
//! stop string matched) drops its receiver, which cancels the job at the next token.

use std::sync::Arc;
use tokio::sync::mpsc;

use super::engine::{GenerationEngine, PrefillReport};
use super::metrics::Metrics;
use super::engine::MediaSupport;
use super::sessions::{MediaKey, SessionStore};
use crate::generate::{Emitted, FinishReason, GenerateParams, TokenStep};
use crate::sampler::{SamplingParams, TokenConstraint};
use crate::vision::PreprocessedImage;

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
    pub events: mpsc::UnboundedSender<GenEvent>,
}

/// What the engine thread reports about a job.
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// The prompt is in: how much was reused and how the rest was prefilled.
    Prefilled { reused_tokens: usize, report: PrefillReport },
    Token(Emitted),
    Done { finish: FinishReason, generated: usize, decode_seconds: f64 },
    Error(String),
}

/// Handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    engine: Arc<EngineThread>,
    pub vocab_size: usize,
    pub max_context: usize,
    /// Image support of the engine (None: the model has no vision tower).
    pub media: Option<MediaSupport>,
}

impl EngineHandle {
    /// Starts the engine thread; `make` builds the engine on that thread (MLX state stays on
    /// the thread that created it). Returns once the engine is loaded, or its load error.
    pub fn spawn<E, F>(make: F, store: StoreOptions, metrics: Arc<Metrics>) -> anyhow::Result<Self>
    where
        E: GenerationEngine,
        F: FnOnce() -> anyhow::Result<E> + Send + 'static,
    {
        let (jobs_tx, mut jobs_rx) = mpsc::unbounded_channel::<GenJob>();
        type Ready = (usize, usize, Option<MediaSupport>);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<Ready>>();
        let thread = std::thread::Builder::new().name("k3-engine".into()).spawn(move || {
            let mut engine = match make() {
                Ok(e) => e,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok((engine.vocab_size(), engine.max_context(), engine.media())));
            let mut worker = Worker { store: SessionStore::new(store.max_sessions, store.max_bytes), checkpoints: store.checkpoints, metrics };
            while let Some(job) = jobs_rx.blocking_recv() {
                worker.run(&mut engine, job);
            }
        })?;
        let (vocab_size, max_context, media) = ready_rx.recv().map_err(|_| anyhow::anyhow!("the engine thread died while loading"))??;
        Ok(EngineHandle { engine: Arc::new(EngineThread { jobs: Some(jobs_tx), thread: Some(thread) }), vocab_size, max_context, media })
    }

    /// Queues a job.
    pub fn submit(&self, job: GenJob) -> Result<(), String> {
        match &self.engine.jobs {
            Some(jobs) => jobs.send(job).map_err(|_| "the engine thread has stopped".to_string()),
            None => Err("the engine is shutting down".to_string()),
        }
    }
}

/// The engine thread and its queue, shared by the clones of an [`EngineHandle`].
struct EngineThread {
    /// `None` only while dropping (closing the queue ends the engine thread).
    jobs: Option<mpsc::UnboundedSender<GenJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for EngineThread {
    /// When the last handle goes: closes the queue and waits until the engine thread has
    /// finished its job and dropped its
    /// MLX state. Without the wait the process could reach its exit handlers (MLX's static
    /// allocator going away) while that thread still frees arrays: heap corruption at exit,
    /// seen as `corrupted double-linked list` aborts of a test binary after its tests passed.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
    }
}

struct Worker<S> {
    store: SessionStore<S>,
    checkpoints: bool,
    metrics: Arc<Metrics>,
}

impl<S: 'static> Worker<S> {
    fn run<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, job: GenJob) {
        let events = job.events.clone();
        if let Err(e) = self.generate(engine, job) {
            tracing::error!(error = %format!("{e:#}"), "generation failed");
            let _ = events.send(GenEvent::Error(format!("{e:#}")));
        }
        self.metrics.sessions_held.set(self.store.len() as i64);
        self.metrics.session_bytes.set(self.store.total_bytes() as i64);
    }

    /// Finds the best held state for the prompt and brings it to the end of the prompt.
    fn prepare<E: GenerationEngine<Session = S>>(
        &mut self,
        engine: &mut E,
        prompt: &[u32],
        images: &[JobImage],
        media: &[MediaKey],
    ) -> anyhow::Result<(S, usize, PrefillReport)> {
        // Prefills prompt[from..]: the images whose pad runs lie there go with it (a held state
        // never ends inside an image run, see SessionStore::best_match).
        let prefill_from = |engine: &mut E, session: &mut S, from: usize| {
            let imgs: Vec<&PreprocessedImage> = images.iter().filter(|i| i.key.span.start >= from).map(|i| &i.image).collect();
            engine.prefill_images(session, &prompt[from..], &imgs)
        };
        if let Some(i) = self.store.best_match(prompt, media) {
            let held = self.store.get(i).tokens.len();
            let mut session = if self.store.get(i).checkpoint {
                self.store.touch(i);
                engine.fork(&self.store.get(i).session)?
            } else {
                self.store.take(i).session
            };
            if held < prompt.len() {
                let report = prefill_from(engine, &mut session, held)?;
                return Ok((session, held, report));
            }
            if engine.logits(&session).is_some() {
                return Ok((session, held, PrefillReport::default()));
            }
            tracing::debug!("held state matches the whole prompt but has no logits; prefilling afresh");
        }
        let mut session = engine.new_session()?;
        let report = prefill_from(engine, &mut session, 0)?;
        Ok((session, 0, report))
    }

    fn generate<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, job: GenJob) -> anyhow::Result<()> {
        anyhow::ensure!(!job.prompt.is_empty(), "empty prompt");
        job.sampling.validate().map_err(|e| anyhow::anyhow!("sampling parameters: {e}"))?;
        let media: Vec<MediaKey> = job.images.iter().map(|i| i.key.clone()).collect();
        let (mut session, reused, report) = self.prepare(engine, &job.prompt, &job.images, &media)?;
        drop(job.images);
        self.metrics.reused_tokens.inc_by(reused as u64);
        if report.tokens > 0 {
            self.metrics.prefill(report.remote, report.tokens, report.seconds);
        }
        self.metrics.handoff_bytes.inc_by(report.handoff_bytes);
        self.metrics.handoff_exposed_tail_seconds.inc_by(report.exposed_tail_seconds);
        if report.fell_back {
            self.metrics.prefill_fallbacks.inc();
            tracing::info!(reason = %report.reason, "prefill fallback counted");
        }
        self.metrics.images.inc_by(report.images as u64);
        self.metrics.vision_seconds.inc_by(report.vision_seconds);
        tracing::debug!(
            prompt = job.prompt.len(),
            reused,
            prefilled = report.tokens,
            remote = report.remote,
            images = report.images,
            reason = %report.reason,
            "prompt ready"
        );
        let _ = job.events.send(GenEvent::Prefilled { reused_tokens: reused, report });
        if self.checkpoints {
            match engine.fork(&session) {
                Ok(copy) => {
                    let bytes = engine.session_bytes(&copy);
                    let ev = self.store.insert(job.prompt.clone(), media.clone(), copy, bytes, true);
                    self.metrics.sessions_evicted.inc_by(ev as u64);
                }
                Err(e) => tracing::warn!(error = %e, "could not checkpoint the session"),
            }
        }

        let params = GenerateParams {
            max_new_tokens: job.max_tokens.min(engine.max_context().saturating_sub(job.prompt.len())),
            sampling: job.sampling,
            stop_tokens: job.stop_ids,
            logprobs: job.logprobs,
        };
        let events = job.events.clone();
        let mut constraint = job.constraint;
        let out = crate::generate::generate_constrained(
            &mut EngineSession { engine, session: &mut session },
            &params,
            constraint.as_deref_mut().map(|c| c as &mut dyn TokenConstraint),
            |e| events.send(GenEvent::Token(e.clone())).is_ok(),
        )?;
        self.metrics.constraint_mask_seconds.inc_by(out.mask_time.as_secs_f64());
        let (generated, finish) = (out.tokens, out.finish);
        let decode_seconds = out.decode_time.as_secs_f64();
        self.metrics.generated_tokens.inc_by(generated.len() as u64);
        self.metrics.decode_seconds.inc_by(decode_seconds);
        if !generated.is_empty() && decode_seconds > 0.0 {
            self.metrics.decode_tokens_per_second.set(generated.len() as f64 / decode_seconds);
        }
        let n = generated.len();
        let mut tokens = job.prompt;
        tokens.extend(generated);
        let bytes = engine.session_bytes(&session);
        let ev = self.store.insert(tokens, media, session, bytes, false);
        self.metrics.sessions_evicted.inc_by(ev as u64);
        let _ = job.events.send(GenEvent::Done { finish, generated: n, decode_seconds });
        Ok(())
    }
}

/// A session of a [`GenerationEngine`], as the decode loop drives it.
struct EngineSession<'a, E: GenerationEngine> {
    engine: &'a mut E,
    session: &'a mut E::Session,
}

impl<E: GenerationEngine> TokenStep for EngineSession<'_, E> {
    fn next_logits(&self) -> Option<&[f32]> {
        self.engine.logits(self.session)
    }
    fn feed(&mut self, token: u32) -> anyhow::Result<()> {
        self.engine.step(self.session, token)
    }
}
