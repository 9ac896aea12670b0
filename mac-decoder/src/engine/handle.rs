//! The engine thread: owns the [`GenerationEngine`] and the [`SessionStore`] and runs the
//! admitted jobs together (continuous batching): a new job gets its prompt ready (prefix reuse,
//! prefill, checkpoint) between decode steps, then joins the running ones, and each step of the
//! decode loop ([`crate::decode_loop::decode_step`]) samples every running job's next token and
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

use super::disk_store::DiskOptions;
use super::generation_engine::{GenerationEngine, MediaSupport};
use super::jobs::{GenEvent, GenJob, Queued, StoreOptions};
use crate::metrics::Metrics;

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
        Self::spawn_with_disk(make, store, None, metrics)
    }

    /// [`Self::spawn`] with held sessions also kept on disk ([`DiskOptions`]): the directory is
    /// indexed before this returns, and the engine thread writes every held session there
    /// before it ends (when the last handle is dropped).
    pub fn spawn_with_disk<E, F>(make: F, store: StoreOptions, disk: Option<DiskOptions>, metrics: Arc<Metrics>) -> anyhow::Result<Self>
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
            super::scheduler::run(&mut engine, &mut jobs_rx, store, disk, metrics);
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
