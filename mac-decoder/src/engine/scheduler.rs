//! The scheduler loop of the engine thread (continuous batching): a new job gets its prompt
//! ready (prefix reuse, prefill, checkpoint) between decode steps, then joins the running
//! ones, and each step of the decode loop ([`crate::decode_loop::decode_step`]) samples every
//! running job's next token and feeds them all in one [`GenerationEngine::step_batch`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

use super::disk_store::DiskOptions;
use super::generation_engine::{GenerationEngine, PrefillReport};
use super::held::HeldSessions;
use super::jobs::{GenEvent, JobImage, Queued, StoreOptions};
use super::sessions::MediaKey;
use crate::decode_loop::{BatchStep, Decoding, GenerateParams, LoopEnd};
use crate::metrics::Metrics;
use crate::sampler::TokenConstraint;
use crate::vision::PreprocessedImage;

/// The engine thread's loop: admit queued jobs up to the batch limit, run one prefill chunk,
/// then one decode step of every running job; returns when the queue closes and all is done.
/// After the loop the held sessions are written to `disk` (when given).
///
/// **Prefill policy: round-robin by chunk.** Admitted prompts longer than one prefill chunk
/// wait in `prefilling` (at most `max_batch` jobs with the running ones); each turn of the
/// loop prefills one chunk of the prompt at its head, which then goes to the back, followed by
/// one decode step of every running job. A prompt of at most one chunk is prefilled when it is
/// admitted. So a short chat queued behind a long prompt starts after at most one of the long
/// prompt's chunks, and prompts of any length share the engine with each other and with the
/// running decodes, each getting a chunk in turn.
pub(crate) fn run<E: GenerationEngine>(
    engine: &mut E,
    jobs_rx: &mut mpsc::UnboundedReceiver<Queued>,
    store: StoreOptions,
    disk: Option<DiskOptions>,
    metrics: Arc<Metrics>,
) {
    let held = HeldSessions::new(engine, store.max_sessions, store.max_bytes, disk.as_ref(), metrics.clone());
    let mut worker = Worker { store: held, checkpoints: store.checkpoints, metrics };
    let mut running: Vec<Running<E::Session>> = Vec::new();
    // prompts being prefilled chunk by chunk, in turn, between decode steps
    let mut prefilling: VecDeque<Prefilling<E::Session>> = VecDeque::new();
    let mut open = true;
    loop {
        // admit: wait for work when idle, else take what is queued up to the batch limit
        if running.is_empty() && prefilling.is_empty() {
            worker.metrics.batch_size.set(0);
            match jobs_rx.blocking_recv() {
                Some(q) => worker.admit(engine, q, &mut running, &mut prefilling),
                None => break,
            }
        }
        while open && running.len() + prefilling.len() < engine.max_batch().max(1) {
            match jobs_rx.try_recv() {
                Ok(q) => worker.admit(engine, q, &mut running, &mut prefilling),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        worker.metrics.queued.set(jobs_rx.len() as i64);
        if let Some(p) = prefilling.pop_front() {
            if let Some(p) = worker.prefill_step(engine, p, &mut running) {
                prefilling.push_back(p);
            }
        }
        if !running.is_empty() {
            worker.step(engine, &mut running);
        }
    }
    worker.store.shutdown(engine);
}

struct Worker<S> {
    store: HeldSessions<S>,
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
    /// Where the prompt first differed from every held state.
    diff: usize,
    /// The client left once the prefill was well under way: it is finished and held (a
    /// checkpoint) for the client's retry, not decoded.
    orphan: bool,
}

/// A prefill at least this far along when its client leaves is finished and held for a retry
/// (clients give up at fixed deadlines and send the same prompt again).
const HOLD_AFTER_FRACTION: f64 = 0.5;

// One value per started request, moved once into the loop: boxing would only add an allocation.
#[allow(clippy::large_enum_variant)]
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
    /// The client's conversation key.
    key: Option<String>,
    /// The request's cache scope ([`super::sessions`]).
    scope: Option<String>,
}

impl<S: 'static> Worker<S> {
    fn gauges(&self) {
        self.store.gauges();
    }

    /// Takes a queued job: its prompt ready, it joins `running`; or, when the engine prefills
    /// in chunks and more than one chunk is left, it joins `prefilling` (the loop runs one
    /// chunk of one of them, in turn, between decode steps, so the running streams go on). Reports why a job cannot run.
    fn admit<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, q: Queued, running: &mut Vec<Running<S>>, prefilling: &mut VecDeque<Prefilling<S>>) {
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
            Ok(Begun::Prefilling(p)) => prefilling.push_back(p),
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
        let diff = self.store.memory.first_difference(&q.job.prompt, q.job.cache_scope.as_deref());
        if let (true, Some(chunk)) = (q.job.images.is_empty(), engine.prefill_chunk()) {
            let (session, held) = self.store.held_state(engine, &q.job.prompt, &media, q.job.session_key.as_deref(), q.job.cache_scope.as_deref())?;
            let mut p = Prefilling { q, media, session, reused: held, done: held, report: PrefillReport::default(), diff, orphan: false };
            if p.q.job.prompt.len() - held > chunk {
                return Ok(Begun::Prefilling(p));
            }
            let len = p.q.job.prompt.len();
            self.advance(engine, &mut p, len)?;
            let Prefilling { q, media, session, report, .. } = p;
            return Ok(Begun::Ready(self.start(engine, q, media, session, held, diff, report)?));
        }
        let (session, reused, report) =
            self.prepare(engine, &q.job.prompt, &q.job.images, &media, q.job.session_key.as_deref(), q.job.cache_scope.as_deref())?;
        Ok(Begun::Ready(self.start(engine, q, media, session, reused, diff, report)?))
    }

    /// Prefills `p` up to prompt position `end`, leaving a checkpoint at each of the job's
    /// `checkpoint_at` positions on the way (when checkpoints are on).
    fn advance<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, p: &mut Prefilling<S>, end: usize) -> anyhow::Result<()> {
        while p.done < end {
            let stop = if self.checkpoints { p.q.job.checkpoint_at.iter().copied().find(|&b| b > p.done && b < end).unwrap_or(end) } else { end };
            let rep = engine.prefill(&mut p.session, &p.q.job.prompt[p.done..stop])?;
            p.report.tokens += rep.tokens;
            p.report.seconds += rep.seconds;
            p.report.remote |= rep.remote;
            p.done = stop;
            if stop < end || (stop < p.q.job.prompt.len() && p.q.job.checkpoint_at.contains(&stop)) {
                let (key, scope) = (p.q.job.session_key.clone(), p.q.job.cache_scope.clone());
                self.checkpoint(engine, &mut p.session, &p.q.job.prompt[..stop], &p.media, key, scope);
            }
        }
        Ok(())
    }

    /// Keeps a copy of `session` (which holds `tokens`) in the store.
    fn checkpoint<E: GenerationEngine<Session = S>>(
        &mut self,
        engine: &mut E,
        session: &mut S,
        tokens: &[u32],
        media: &[MediaKey],
        key: Option<String>,
        scope: Option<String>,
    ) {
        match engine.fork(session) {
            Ok(copy) => {
                let inside: Vec<MediaKey> = media.iter().filter(|m| m.span.end <= tokens.len()).cloned().collect();
                self.store.insert(engine, tokens.to_vec(), inside, key, scope, copy, true);
            }
            Err(e) => tracing::warn!(error = %e, "could not checkpoint the session"),
        }
    }

    /// Prefills the next chunk of `p`'s prompt; the job joins `running` after its last chunk.
    /// Returns the job while chunks are left.
    fn prefill_step<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, mut p: Prefilling<S>, running: &mut Vec<Running<S>>) -> Option<Prefilling<S>> {
        let (len, new) = (p.q.job.prompt.len(), p.q.job.prompt.len() - p.reused);
        if p.q.cancelled() && !p.orphan {
            let done = p.done - p.reused;
            if self.checkpoints && done as f64 >= HOLD_AFTER_FRACTION * new as f64 {
                // Clients give up at fixed deadlines and retry the same prompt: a prefill this
                // far along is finished and held, so the retry does not start from zero.
                tracing::info!(prefilled = done, of = new, "the client left during the prefill; finishing it and holding the prompt for a retry");
                p.orphan = true;
            } else {
                self.metrics.cancelled.inc();
                tracing::info!(prefilled = done, of = new, "a request was cancelled while its prompt was prefilled");
                return None;
            }
        }
        let end = len.min(p.done + engine.prefill_chunk().unwrap_or(usize::MAX));
        // Once half done, a leaving client no longer stops the chunk in progress (the next step
        // finds it gone and finishes the prefill for its retry).
        let holdable = self.checkpoints && (p.done - p.reused) as f64 >= HOLD_AFTER_FRACTION * new as f64;
        engine.set_cancel(if p.orphan || holdable { None } else { Some(p.q.cancel.clone()) });
        let r = self.advance(engine, &mut p, end);
        engine.set_cancel(None);
        if let Err(e) = r {
            self.failed(e, &p.q.events, &p.q.cancel);
            return None;
        }
        if p.done < len {
            let _ = p.q.events.send(GenEvent::Progress { done: p.done, total: len });
            return Some(p);
        }
        if p.orphan {
            let Prefilling { q, media, session, report, .. } = p;
            self.metrics.cancelled.inc();
            self.metrics.prefill(report.remote, report.tokens, report.seconds);
            self.store.insert(engine, q.job.prompt, media, q.job.session_key, q.job.cache_scope, session, true);
            tracing::info!(tokens = len, "prefill finished for a client that left; the prompt is held for its retry");
            self.gauges();
            return None;
        }
        let Prefilling { q, media, session, reused, report, diff, .. } = p;
        let (events, cancel) = (q.events.clone(), q.cancel.clone());
        match self.start(engine, q, media, session, reused, diff, report) {
            Ok(run) => running.push(run),
            Err(e) => self.failed(e, &events, &cancel),
        }
        self.gauges();
        None
    }

    /// Finds the best held state for the prompt and brings it to the end of the prompt.
    fn prepare<E: GenerationEngine<Session = S>>(
        &mut self,
        engine: &mut E,
        prompt: &[u32],
        images: &[JobImage],
        media: &[MediaKey],
        key: Option<&str>,
        scope: Option<&str>,
    ) -> anyhow::Result<(S, usize, PrefillReport)> {
        let (mut session, held) = self.store.held_state(engine, prompt, media, key, scope)?;
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
        diff: usize,
        report: PrefillReport,
    ) -> anyhow::Result<Running<S>> {
        let Queued { job, events, cancel } = q;
        drop(job.images);
        self.metrics.reused_tokens.inc_by(reused as u64);
        // Where this prompt left the held states: the tokens between the reuse and the first
        // difference matched a held state that went on past them, which K3's recurrent KDA
        // state cannot be cut back to.
        let diff = diff.max(reused);
        tracing::info!("prefix: reused {reused} of {} tokens (first difference at {diff})", job.prompt.len());
        self.metrics.prefix_first_difference.set(diff as i64);
        self.metrics.prefix_lost_tokens.inc_by((diff - reused) as u64);
        if report.tokens > 0 {
            self.metrics.prefill(report.remote, report.tokens, report.seconds);
            self.store.prefilled(reused, &report);
        }
        if reused == 0 && !report.reason.is_empty() {
            self.metrics.store.first_turn(report.remote);
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
        let _ = events.send(GenEvent::Prefilled { reused_tokens: reused, first_difference: diff, report });
        if self.checkpoints {
            match engine.fork(&mut session) {
                Ok(copy) => self.store.insert(engine, job.prompt.clone(), media.clone(), job.session_key.clone(), job.cache_scope.clone(), copy, true),
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
        Ok(Running { session, dec, events, cancel, prompt: job.prompt, media, key: job.session_key, scope: job.cache_scope })
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
        let fed = crate::decode_loop::decode_step(&mut batch, &mut decs, |i, e| {
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
        let Running { session, dec, events, prompt, media, key, scope, .. } = r;
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
        self.store.insert(engine, tokens, media, key, scope, session, false);
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
