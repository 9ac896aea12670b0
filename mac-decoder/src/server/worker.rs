//! The engine thread: owns the [`GenerationEngine`] and the [`SessionStore`] and runs the
//! admitted jobs together (continuous batching): a new job gets its prompt ready (prefix reuse,
//! prefill, checkpoint) between decode steps, then joins the running ones, and each step of the
//! decode loop ([`crate::generate::decode_step`]) samples every running job's next token and
//! feeds them all in one [`GenerationEngine::step_batch`]. At most
//! [`GenerationEngine::max_batch`] jobs decode at once; the others wait in the queue (whose
//! length the HTTP guard bounds: past its limit requests get 429 + `Retry-After`). Token ids
//! stream back to the HTTP handler over a channel.
//!
//! Admission by tokens in flight: [`EngineHandle::submit`] counts each job's prompt +
//! `max_tokens` from its submission until its handler drops its [`JobEvents`]; past the limit
//! ([`EngineHandle::set_max_tokens_in_flight`]) a job is refused with [`SubmitError::Busy`]
//! (the HTTP layer answers 429 + `Retry-After`). A job larger than the limit alone is admitted
//! when nothing else is in flight, so every request the context admits can run.
//!
//! Cancellation: a handler that goes away (client gone, stop string matched) drops its
//! [`JobEvents`], which cancels the job — skipped if still queued, stopped between prefill
//! chunks (or at the next event of a remote prefill), and at the next token when decoding; its
//! slot frees at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

use super::engine::{GenerationEngine, PrefillReport};
use super::metrics::Metrics;
use super::engine::MediaSupport;
use super::sessions::{MediaKey, SessionStore};
use crate::generate::{BatchStep, Decoding, Emitted, GenerateParams, LoopEnd};
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
}

/// A job in the engine's queue, with its way back to the handler.
struct Queued {
    job: GenJob,
    events: mpsc::UnboundedSender<GenEvent>,
    cancel: Arc<AtomicBool>,
}

impl Queued {
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.events.is_closed()
    }
}

/// The handler's end of a job: the events the engine reports. Dropping it cancels the job
/// (and gives its tokens in flight back).
pub struct JobEvents {
    rx: mpsc::UnboundedReceiver<GenEvent>,
    cancel: Arc<AtomicBool>,
    _tokens: TokenReservation,
}

/// The tokens in flight and their limit, shared by the clones of an [`EngineHandle`].
struct TokenAdmission {
    in_flight: AtomicUsize,
    /// `usize::MAX`: unbounded.
    limit: AtomicUsize,
    metrics: Arc<Metrics>,
}

impl TokenAdmission {
    /// Counts `tokens` in, or refuses them when that would pass the limit (unless nothing is in
    /// flight: a job larger than the limit alone still runs).
    fn reserve(self: &Arc<Self>, tokens: usize) -> Result<TokenReservation, SubmitError> {
        let limit = self.limit.load(Ordering::Relaxed);
        let mut cur = self.in_flight.load(Ordering::Relaxed);
        loop {
            if cur > 0 && cur.saturating_add(tokens) > limit {
                return Err(SubmitError::Busy { tokens, in_flight: cur, limit });
            }
            match self.in_flight.compare_exchange_weak(cur, cur + tokens, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        self.metrics.tokens_in_flight.set((cur + tokens) as i64);
        Ok(TokenReservation { admission: self.clone(), tokens })
    }
}

/// A job's tokens in flight, given back on drop.
struct TokenReservation {
    admission: Arc<TokenAdmission>,
    tokens: usize,
}

impl Drop for TokenReservation {
    fn drop(&mut self) {
        let left = self.admission.in_flight.fetch_sub(self.tokens, Ordering::AcqRel) - self.tokens;
        self.admission.metrics.tokens_in_flight.set(left as i64);
    }
}

impl JobEvents {
    /// The next event; `None` when the engine dropped the job (it stopped).
    pub async fn recv(&mut self) -> Option<GenEvent> {
        self.rx.recv().await
    }

    /// The next event, or `Err(())` as soon as `out` (the client's stream) is closed: the
    /// client is gone, and the caller drops `self`, cancelling the job.
    pub async fn recv_for<T>(&mut self, out: &mpsc::UnboundedSender<T>) -> Result<Option<GenEvent>, ()> {
        tokio::select! {
            ev = self.rx.recv() => Ok(ev),
            _ = out.closed() => Err(()),
        }
    }

    /// Cancels the job (also done on drop).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Drop for JobEvents {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// What the engine thread reports about a job.
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// The prompt is in: how much was reused and how the rest was prefilled.
    Prefilled { reused_tokens: usize, report: PrefillReport },
    Token(Emitted),
    Done { finish: LoopEnd, generated: usize, decode_seconds: f64 },
    Error(String),
}

/// Handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    engine: Arc<EngineThread>,
    tokens: Arc<TokenAdmission>,
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
        let tokens = Arc::new(TokenAdmission { in_flight: AtomicUsize::new(0), limit: AtomicUsize::new(usize::MAX), metrics: metrics.clone() });
        let (jobs_tx, mut jobs_rx) = mpsc::unbounded_channel::<Queued>();
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
            let mut running: Vec<Running<E::Session>> = Vec::new();
            // a prompt being prefilled chunk by chunk between decode steps
            let mut prefilling: Option<Prefilling<E::Session>> = None;
            let mut open = true;
            loop {
                // admit: wait for work when idle, else take what is queued up to the batch limit
                if running.is_empty() && prefilling.is_none() {
                    match jobs_rx.blocking_recv() {
                        Some(q) => worker.admit(&mut engine, q, &mut running, &mut prefilling),
                        None => break,
                    }
                }
                while open && prefilling.is_none() && running.len() < engine.max_batch().max(1) {
                    match jobs_rx.try_recv() {
                        Ok(q) => worker.admit(&mut engine, q, &mut running, &mut prefilling),
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                    }
                }
                worker.metrics.queued.set(jobs_rx.len() as i64);
                if let Some(p) = prefilling.take() {
                    prefilling = worker.prefill_step(&mut engine, p, &mut running);
                }
                if !running.is_empty() {
                    worker.step(&mut engine, &mut running);
                }
            }
        })?;
        let (vocab_size, max_context, media) = ready_rx.recv().map_err(|_| anyhow::anyhow!("the engine thread died while loading"))??;
        Ok(EngineHandle { engine: Arc::new(EngineThread { jobs: Some(jobs_tx), thread: Some(thread) }), tokens, vocab_size, max_context, media })
    }

    /// Bounds the tokens in flight (prompt + `max_tokens` of the jobs submitted and not yet
    /// dropped by their handlers); `None`: unbounded (the default).
    pub fn set_max_tokens_in_flight(&self, limit: Option<usize>) {
        self.tokens.limit.store(limit.unwrap_or(usize::MAX), Ordering::Relaxed);
    }

    /// Tokens in flight now.
    pub fn tokens_in_flight(&self) -> usize {
        self.tokens.in_flight.load(Ordering::Relaxed)
    }

    /// Queues a job; its events come back through the returned [`JobEvents`] (drop it to
    /// cancel the job). Refused with [`SubmitError::Busy`] past the tokens-in-flight limit.
    pub fn submit(&self, job: GenJob) -> Result<JobEvents, SubmitError> {
        let reservation = self.tokens.reserve(job.prompt.len().saturating_add(job.max_tokens))?;
        let (events, rx) = mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        match &self.engine.jobs {
            Some(jobs) => jobs.send(Queued { job, events, cancel: cancel.clone() }).map_err(|_| SubmitError::Stopped)?,
            None => return Err(SubmitError::ShuttingDown),
        }
        Ok(JobEvents { rx, cancel, _tokens: reservation })
    }
}

/// Why a job could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the engine thread has stopped")]
    Stopped,
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// Past the tokens-in-flight limit: retry later.
    #[error(
        "{in_flight} tokens are in flight (prompt + max_tokens of the requests admitted); this request's {tokens} \
         would pass the limit of {limit} (--max-tokens-in-flight); retry later"
    )]
    Busy { tokens: usize, in_flight: usize, limit: usize },
}

/// The engine thread and its queue, shared by the clones of an [`EngineHandle`].
struct EngineThread {
    /// `None` only while dropping (closing the queue ends the engine thread).
    jobs: Option<mpsc::UnboundedSender<Queued>>,
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

/// A job whose prompt is prefilled chunk by chunk, one chunk between decode steps.
struct Prefilling<S> {
    q: Queued,
    media: Vec<MediaKey>,
    session: S,
    /// Prompt tokens continued from a held state.
    reused: usize,
    /// Prompt tokens the session holds.
    done: usize,
    /// The chunks so far.
    report: PrefillReport,
}

enum Begun<S> {
    Ready(Running<S>),
    Prefilling(Prefilling<S>),
}

/// A job decoding: its session, its place in the decode loop, and its way back.
struct Running<S> {
    session: S,
    dec: Decoding<'static>,
    events: mpsc::UnboundedSender<GenEvent>,
    cancel: Arc<AtomicBool>,
    prompt: Vec<u32>,
    media: Vec<MediaKey>,
}

impl<S: 'static> Worker<S> {
    fn gauges(&self) {
        self.metrics.sessions_held.set(self.store.len() as i64);
        self.metrics.session_bytes.set(self.store.total_bytes() as i64);
    }

    /// Takes a queued job: its prompt ready, it joins `running`; or, when the engine prefills
    /// in chunks and more than one chunk is left, it becomes `prefilling` (the loop runs one
    /// chunk between decode steps, so the running streams go on). Reports why a job cannot run.
    fn admit<E: GenerationEngine<Session = S>>(
        &mut self,
        engine: &mut E,
        q: Queued,
        running: &mut Vec<Running<S>>,
        prefilling: &mut Option<Prefilling<S>>,
    ) {
        if q.cancelled() {
            self.metrics.cancelled.inc();
            tracing::debug!("a queued request was cancelled before it started");
            return;
        }
        let (events, cancel) = (q.events.clone(), q.cancel.clone());
        engine.set_cancel(Some(cancel.clone()));
        let r = self.begin(engine, q);
        engine.set_cancel(None);
        match r {
            Ok(Begun::Ready(run)) => running.push(run),
            Ok(Begun::Prefilling(p)) => *prefilling = Some(p),
            Err(e) => self.failed(e, &events, &cancel),
        }
        self.gauges();
    }

    /// Reports a job that failed before decoding (or counts it cancelled).
    fn failed(&self, e: anyhow::Error, events: &mpsc::UnboundedSender<GenEvent>, cancel: &AtomicBool) {
        if cancel.load(Ordering::Relaxed) || events.is_closed() {
            self.metrics.cancelled.inc();
            tracing::info!(error = %format!("{e:#}"), "a request was cancelled while its prompt was prefilled");
        } else {
            tracing::error!(error = %format!("{e:#}"), "generation failed");
            let _ = events.send(GenEvent::Error(format!("{e:#}")));
        }
    }

    /// Starts a job: validation, the held state to continue from, then either the whole
    /// prefill now, or a [`Prefilling`] for the loop.
    fn begin<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, q: Queued) -> anyhow::Result<Begun<S>> {
        anyhow::ensure!(!q.job.prompt.is_empty(), "empty prompt");
        q.job.sampling.validate().map_err(|e| anyhow::anyhow!("sampling parameters: {e}"))?;
        let media: Vec<MediaKey> = q.job.images.iter().map(|i| i.key.clone()).collect();
        if let (true, Some(chunk)) = (q.job.images.is_empty(), engine.prefill_chunk()) {
            let (session, held) = self.held_state(engine, &q.job.prompt, &media)?;
            let p = Prefilling { q, media, session, reused: held, done: held, report: PrefillReport::default() };
            if p.q.job.prompt.len() - held > chunk {
                return Ok(Begun::Prefilling(p));
            }
            let Prefilling { q, media, mut session, .. } = p;
            let report = if held < q.job.prompt.len() { engine.prefill(&mut session, &q.job.prompt[held..])? } else { PrefillReport::default() };
            return Ok(Begun::Ready(self.start(engine, q, media, session, held, report)?));
        }
        let (session, reused, report) = self.prepare(engine, &q.job.prompt, &q.job.images, &media)?;
        Ok(Begun::Ready(self.start(engine, q, media, session, reused, report)?))
    }

    /// Prefills the next chunk of `p`'s prompt; the job joins `running` after its last chunk.
    /// Returns the job while chunks are left.
    fn prefill_step<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, mut p: Prefilling<S>, running: &mut Vec<Running<S>>) -> Option<Prefilling<S>> {
        if p.q.cancelled() {
            self.metrics.cancelled.inc();
            tracing::info!(prefilled = p.done - p.reused, of = p.q.job.prompt.len() - p.reused, "a request was cancelled while its prompt was prefilled");
            return None;
        }
        let end = p.q.job.prompt.len().min(p.done + engine.prefill_chunk().unwrap_or(usize::MAX));
        engine.set_cancel(Some(p.q.cancel.clone()));
        let r = engine.prefill(&mut p.session, &p.q.job.prompt[p.done..end]);
        engine.set_cancel(None);
        match r {
            Ok(rep) => {
                p.report.tokens += rep.tokens;
                p.report.seconds += rep.seconds;
                p.done = end;
            }
            Err(e) => {
                self.failed(e, &p.q.events, &p.q.cancel);
                return None;
            }
        }
        if p.done < p.q.job.prompt.len() {
            return Some(p);
        }
        let Prefilling { q, media, session, reused, report, .. } = p;
        let (events, cancel) = (q.events.clone(), q.cancel.clone());
        match self.start(engine, q, media, session, reused, report) {
            Ok(run) => running.push(run),
            Err(e) => self.failed(e, &events, &cancel),
        }
        self.gauges();
        None
    }

    /// The best held state to continue `prompt` from (a checkpoint's copy, or a live state
    /// taken from the store) and the tokens of the prompt it holds; else a new session.
    fn held_state<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, prompt: &[u32], media: &[MediaKey]) -> anyhow::Result<(S, usize)> {
        if let Some(i) = self.store.best_match(prompt, media) {
            let held = self.store.get(i).tokens.len();
            let session = if self.store.get(i).checkpoint {
                self.store.touch(i);
                engine.fork(&mut self.store.get_mut(i).session)?
            } else {
                self.store.take(i).session
            };
            if held < prompt.len() || engine.logits(&session).is_some() {
                return Ok((session, held));
            }
            tracing::debug!("held state matches the whole prompt but has no logits; prefilling afresh");
        }
        Ok((engine.new_session()?, 0))
    }

    /// Finds the best held state for the prompt and brings it to the end of the prompt.
    fn prepare<E: GenerationEngine<Session = S>>(
        &mut self,
        engine: &mut E,
        prompt: &[u32],
        images: &[JobImage],
        media: &[MediaKey],
    ) -> anyhow::Result<(S, usize, PrefillReport)> {
        let (mut session, held) = self.held_state(engine, prompt, media)?;
        if held == prompt.len() {
            return Ok((session, held, PrefillReport::default()));
        }
        // prompt[held..] with the images whose pad runs lie there (a held state never ends
        // inside an image run, see SessionStore::best_match)
        let imgs: Vec<&PreprocessedImage> = images.iter().filter(|i| i.key.span.start >= held).map(|i| &i.image).collect();
        let report = engine.prefill_images(&mut session, &prompt[held..], &imgs)?;
        Ok((session, held, report))
    }

    /// The prompt is in `session`: metrics, the `Prefilled` event, the checkpoint, the decode.
    fn start<E: GenerationEngine<Session = S>>(
        &mut self,
        engine: &mut E,
        q: Queued,
        media: Vec<MediaKey>,
        mut session: S,
        reused: usize,
        report: PrefillReport,
    ) -> anyhow::Result<Running<S>> {
        let Queued { job, events, cancel } = q;
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
        if let Some(c) = report.compatible_source {
            self.metrics.compatible_source(c);
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
        let _ = events.send(GenEvent::Prefilled { reused_tokens: reused, report });
        if self.checkpoints {
            match engine.fork(&mut session) {
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
        let constraint = job.constraint.map(|c| c as Box<dyn TokenConstraint>);
        let dec = Decoding::new(params, constraint)?;
        Ok(Running { session, dec, events, cancel, prompt: job.prompt, media })
    }

    /// One step of the decode loop over every running job; the jobs that end leave `running`.
    fn step<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, running: &mut Vec<Running<S>>) {
        let n = running.len();
        self.metrics.batch_size.set(n as i64);
        self.metrics.decode_steps.inc();
        self.metrics.decode_step_jobs.inc_by(n as u64);
        let mut sessions: Vec<&mut S> = Vec::with_capacity(n);
        let mut decs: Vec<&mut Decoding<'static>> = Vec::with_capacity(n);
        let mut outs: Vec<(&mpsc::UnboundedSender<GenEvent>, &AtomicBool)> = Vec::with_capacity(n);
        for r in running.iter_mut() {
            sessions.push(&mut r.session);
            decs.push(&mut r.dec);
            outs.push((&r.events, &r.cancel));
        }
        let mut batch = EngineBatch { engine: &mut *engine, sessions };
        let fed = crate::generate::decode_step(&mut batch, &mut decs, |i, e| {
            let (events, cancel) = outs[i];
            !cancel.load(Ordering::Relaxed) && events.send(GenEvent::Token(e.clone())).is_ok()
        });
        drop(decs);
        drop(outs);
        if let Err(e) = fed {
            // the shared step failed: every job of the batch ends with the error
            tracing::error!(error = %format!("{e:#}"), batch = n, "decode step failed");
            for r in running.drain(..) {
                let _ = r.events.send(GenEvent::Error(format!("{e:#}")));
            }
            self.gauges();
            return;
        }
        let mut i = 0;
        while i < running.len() {
            if running[i].dec.done() {
                let r = running.swap_remove(i);
                self.finish(engine, r);
            } else {
                i += 1;
            }
        }
        self.gauges();
    }

    /// A job's decode ended: metrics, the session back to the store, the last event.
    fn finish<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, r: Running<S>) {
        let Running { session, dec, events, prompt, media, .. } = r;
        let out = match dec.into_output() {
            Ok(o) => o,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "generation failed");
                let _ = events.send(GenEvent::Error(format!("{e:#}")));
                return;
            }
        };
        self.metrics.constraint_mask_seconds.inc_by(out.mask_time.as_secs_f64());
        let (generated, finish) = (out.tokens, out.finish);
        let decode_seconds = out.decode_time.as_secs_f64();
        if finish == LoopEnd::Cancelled {
            self.metrics.cancelled.inc();
        }
        self.metrics.generated_tokens.inc_by(generated.len() as u64);
        self.metrics.decode_seconds.inc_by(decode_seconds);
        if !generated.is_empty() && decode_seconds > 0.0 {
            self.metrics.decode_tokens_per_second.set(generated.len() as f64 / decode_seconds);
        }
        let n = generated.len();
        let mut tokens = prompt;
        tokens.extend(generated);
        let bytes = engine.session_bytes(&session);
        let ev = self.store.insert(tokens, media, session, bytes, false);
        self.metrics.sessions_evicted.inc_by(ev as u64);
        let _ = events.send(GenEvent::Done { finish, generated: n, decode_seconds });
    }
}

/// The running sessions of a [`GenerationEngine`], as the decode loop drives them.
struct EngineBatch<'a, E: GenerationEngine> {
    engine: &'a mut E,
    sessions: Vec<&'a mut E::Session>,
}

impl<E: GenerationEngine> BatchStep for EngineBatch<'_, E> {
    fn next_logits(&self, i: usize) -> Option<&[f32]> {
        self.engine.logits(self.sessions[i])
    }
    fn feed(&mut self, seqs: &[usize], tokens: &[u32]) -> anyhow::Result<()> {
        let mut picked: Vec<&mut E::Session> = Vec::with_capacity(seqs.len());
        let mut want = seqs.iter().peekable();
        for (i, s) in self.sessions.iter_mut().enumerate() {
            if want.peek() == Some(&&i) {
                want.next();
                picked.push(&mut **s);
            }
        }
        self.engine.step_batch(&mut picked, tokens)
    }
}
