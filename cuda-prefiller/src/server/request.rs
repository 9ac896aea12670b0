//! One prefill request, from the decoder's `PrefillRequest` to `Done`: check it, take the
//! session's base prefix, accept (announcing the state layout), queue the compute, stream every
//! layer as the worker finishes it, send the last logits, keep the new prefix.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use k3_protocol::handoff::HandoffState;
use k3_protocol::transport::{IncomingRequest, TransferError};
use k3_protocol::wire::{ErrorCode, SessionId, StateLayout, Timing};
use tokio::sync::{mpsc, oneshot};

use crate::executor::EmbeddingOverrides;
use crate::server::context::NodeContext;
use crate::server::metrics::{RequestOutcome, RequestRecord};
use crate::server::sessions::{LeaseError, Leased};
use crate::server::worker::{JobDone, PrefillJob};

/// A refusal before anything was accepted.
struct Refusal {
    code: ErrorCode,
    message: String,
}

fn refusal(code: ErrorCode, message: impl Into<String>) -> Refusal {
    Refusal { code, message: message.into() }
}

/// Checks what the model can check before any work: ids, sizes, image rows.
fn check_request(sh: &NodeContext, req: &k3_protocol::wire::PrefillRequest) -> Result<Option<EmbeddingOverrides>, Refusal> {
    let c = &sh.text_config;
    let n = req.tokens.len();
    if n == 0 {
        return Err(refusal(ErrorCode::InvalidRequest, "the request holds no tokens"));
    }
    if n > sh.opts.max_request_tokens {
        return Err(refusal(ErrorCode::TooLarge, format!("{n} new tokens exceed this node's limit of {} per request", sh.opts.max_request_tokens)));
    }
    if let Some((i, t)) = req.tokens.iter().enumerate().find(|(_, t)| **t as usize >= c.vocab_size) {
        return Err(refusal(ErrorCode::InvalidRequest, format!("token {t} at position {i} is outside the vocabulary (size {})", c.vocab_size)));
    }
    let Some(im) = &req.image_embeddings else { return Ok(None) };
    if im.width as usize != c.hidden_size {
        return Err(refusal(ErrorCode::InvalidRequest, format!("image embedding rows are {} wide, the model's hidden size is {}", im.width, c.hidden_size)));
    }
    let mut seen = vec![false; n];
    for &p in &im.positions {
        let p = p as usize;
        if p >= n || seen[p] {
            return Err(refusal(ErrorCode::InvalidRequest, format!("image embedding position {p} is past the tokens or repeated")));
        }
        seen[p] = true;
    }
    if let Some(i) = im.rows.iter().position(|x| !x.is_finite()) {
        return Err(refusal(ErrorCode::InvalidRequest, format!("image embeddings hold a non-finite value at index {i}")));
    }
    Ok(Some(EmbeddingOverrides { positions: im.positions.iter().map(|&p| p as usize).collect(), rows: im.rows.clone() }))
}

/// Where a request's starting state came from, so it can be put back if the request fails.
struct Start {
    session: SessionId,
    /// Some(tokens): the state is the leased prefix of these tokens. None: a fresh start.
    prefix: Option<Vec<u32>>,
}

impl Start {
    /// Gives the leased prefix back when `state` is still exactly it (a request that failed
    /// before the executor committed anything); otherwise the session is dropped, and the
    /// decoder's next turn resends everything.
    fn put_back(self, sh: &NodeContext, state: Option<HandoffState>) {
        let mut store = sh.sessions.lock().unwrap_or_else(|p| p.into_inner());
        match (self.prefix, state) {
            (Some(tokens), Some(state)) if state.tokens == tokens.len() => store.release(Leased { session: self.session, tokens, state }, Instant::now()),
            _ => store.forget(&self.session),
        }
    }
}

/// Handles one request to its end; never panics on what the decoder sent.
pub(crate) async fn handle(sh: Arc<NodeContext>, req: IncomingRequest) {
    let peer = req.peer().to_string();
    let r = &req.request;
    let session = r.session;
    let new_tokens = r.tokens.len() as u64;
    let mut record = RequestRecord {
        request: req.id(),
        peer: peer.clone(),
        session: session.to_string(),
        base_tokens: r.base.as_ref().map_or(0, |b| b.tokens),
        new_tokens,
        outcome: RequestOutcome::Completed,
        queue_s: 0.0,
        compute_s: 0.0,
        network_wait_s: 0.0,
        total_s: 0.0,
        state_bytes: 0,
        weights: None,
        pass_requests: 0,
    };
    sh.metrics.update(|c| c.requests += 1);

    // 1. What can be refused without work.
    let overrides = match check_request(&sh, r) {
        Ok(o) => o,
        Err(f) => return refuse(&sh, req, f, record).await,
    };
    // 2. The base prefix (leased out of the store for this request), or a fresh state.
    let now = Instant::now();
    let lease = {
        let mut store = sh.sessions.lock().unwrap_or_else(|p| p.into_inner());
        match &r.base {
            Some(b) => store.lease(session, b, now).map(|l| (Start { session, prefix: Some(l.tokens) }, l.state)),
            None => store.claim_fresh(session, now).map(|_old| (Start { session, prefix: None }, HandoffState::empty(&sh.text_config))),
        }
    };
    let (start, state) = match lease {
        Ok(x) => x,
        Err(LeaseError::Busy(s)) => return refuse(&sh, req, refusal(ErrorCode::Busy, format!("session {s} is in use by another request")), record).await,
        Err(e) => return refuse(&sh, req, refusal(ErrorCode::BaseNotHeld, e.to_string()), record).await,
    };
    let total_tokens = state.tokens + r.tokens.len();
    if total_tokens > sh.text_config.max_position_embeddings {
        start.put_back(&sh, Some(state));
        let msg = format!("the session would hold {total_tokens} tokens, past the model's max_position_embeddings {}", sh.text_config.max_position_embeddings);
        return refuse(&sh, req, refusal(ErrorCode::TooLarge, msg), record).await;
    }
    // The node's memory plan caps the prompt: one that cannot fit even alone is refused here,
    // with the plan's reason (the longest prompt that fits), before it waits in the queue.
    if let Some(p) = &sh.opts.planner {
        if let Err(e) = p.plan(&[crate::memory_plan::PlanRequest { base: state.tokens, new: r.tokens.len() }]) {
            start.put_back(&sh, Some(state));
            tracing::warn!(%peer, %session, tokens = new_tokens, "refused: {e}");
            return refuse(&sh, req, refusal(ErrorCode::TooLarge, e.to_string()), record).await;
        }
    }
    // 3. Room in the queue? (`in_flight` counts the computing request and the waiting ones.)
    let ahead = sh.in_flight.fetch_add(1, Ordering::SeqCst);
    if ahead > sh.opts.max_queue {
        sh.in_flight.fetch_sub(1, Ordering::SeqCst);
        start.put_back(&sh, Some(state));
        let msg = format!("{ahead} requests are running or queued here (limit {}); prefill locally or retry", sh.opts.max_queue + 1);
        return refuse(&sh, req, refusal(ErrorCode::Busy, msg), record).await;
    }
    let in_flight_guard = InFlight(sh.clone());
    sh.metrics.update(|c| c.in_flight = ahead as u64 + 1);
    let keep = r.options.keep_session;
    let want_logits = r.options.return_last_logits;
    let tokens = r.tokens.clone();
    let layout = StateLayout::for_model(&sh.text_config, tokens.len());
    let state_bytes = layout.nbytes().unwrap_or(0);
    let base = state.tokens as u64;

    // 4. Accept: the decoder learns the layout, the data streams open.
    let accepted_at = Instant::now();
    let mut tx = match req.accept(base, layout).await {
        Ok(tx) => tx,
        Err(e) => {
            start.put_back(&sh, Some(state));
            record.outcome = RequestOutcome::Failed { reason: format!("accept: {e}") };
            tracing::warn!(%peer, %session, "could not accept the request: {e}");
            return sh.metrics.record(record);
        }
    };
    if ahead > 0 {
        tracing::info!(%peer, %session, request = tx.request_id(), ahead, "request queued behind others");
    }

    // 5. Compute on the worker thread; stream each layer as it comes.
    let (layer_tx, mut layer_rx) = mpsc::channel(sh.opts.layer_buffer.max(1));
    let (done_tx, done_rx) = oneshot::channel::<JobDone>();
    let (started_tx, mut started_rx) = oneshot::channel::<f64>();
    let cancel = Arc::new(AtomicBool::new(false));
    // This task may be dropped (the node shutting down aborts its connections): the job stops then.
    let _cancel_on_drop = CancelOnDrop(cancel.clone());
    let job_id = tx.request_id();
    sh.cost.queued(job_id, new_tokens, base);
    let job = PrefillJob {
        request: job_id,
        tokens: tokens.clone(),
        overrides,
        state,
        layers: layer_tx,
        done: done_tx,
        cancel: cancel.clone(),
        queued_at: Instant::now(),
        started: Some(started_tx),
    };
    let submitted = match sh.jobs.lock() {
        Ok(j) => j.send(job).map_err(|e| e.0),
        Err(_) => Err(job),
    };
    if let Err(job) = submitted {
        sh.cost.finished(job_id, Vec::new(), None);
        start.put_back(&sh, Some(job.state));
        tx.abort(ErrorCode::ShuttingDown, "the compute worker is gone").await;
        record.outcome = RequestOutcome::Failed { reason: "the compute worker is gone".into() };
        return sh.metrics.record(record);
    }
    // Each layer as the worker finishes it; meanwhile the transfer is watched, so that a decoder
    // that cancels or goes away stops the compute within a token chunk (not at the layer's end).
    let mut send_err: Option<TransferError> = None;
    let mut waiting_start = true;
    loop {
        enum Ev {
            Stopped(TransferError),
            Started(Option<f64>),
            Layer(Option<crate::server::worker::LayerDone>),
        }
        let ev = tokio::select! {
            biased;
            e = tx.stopped() => Ev::Stopped(e),
            q = &mut started_rx, if waiting_start => Ev::Started(q.ok()),
            ld = layer_rx.recv() => Ev::Layer(ld),
        };
        let sent = match ev {
            Ev::Stopped(e) => Err((e, None)),
            Ev::Started(q) => {
                waiting_start = false;
                match q {
                    // Progress 0: the decoder learns that its request left the queue.
                    Some(q) => tx.progress(0, 0.0).await.map_err(|e| (e, None)).inspect(|()| tracing::debug!(request = job_id, queue_s = q, "compute started")),
                    None => Ok(()),
                }
            }
            Ev::Layer(None) => break,
            // Progress first: it tells the decoder when the layer finished on this node.
            Ev::Layer(Some(ld)) => match tx.progress(ld.layer as u32 + 1, ld.compute_s).await {
                Ok(()) => tx.send_layer(ld.layer, ld.state).await.map(|()| sh.metrics.update(|c| c.layers_sent += 1)).map_err(|e| (e, Some(ld.layer))),
                Err(e) => Err((e, Some(ld.layer))),
            },
        };
        if let Err((e, layer)) = sent {
            tracing::warn!(%peer, %session, layer, "stopping the prefill: {e}");
            cancel.store(true, Ordering::Relaxed);
            send_err = Some(e);
            break; // the executor sees the cancel before its next token chunk
        }
    }
    drop(layer_rx);
    let done = done_rx.await.unwrap_or_else(|_| JobDone {
        state: None,
        result: Err(anyhow::anyhow!("the compute worker stopped")),
        compute_s: 0.0,
        compute_share_s: 0.0,
        network_wait_s: 0.0,
        queue_s: 0.0,
        pass_requests: 0,
        chunk_seconds: Vec::new(),
        weights: None,
        source: None,
    });
    drop(in_flight_guard);
    let measured = match send_err.is_none() && done.result.is_ok() {
        true => crate::server::cost::compute_samples(new_tokens, base, done.compute_share_s, &done.chunk_seconds),
        false => Vec::new(),
    };
    sh.cost.finished(job_id, measured, done.source);
    record.weights = done.weights.as_ref().map(crate::server::metrics::WeightTiming::of);
    record.queue_s = done.queue_s;
    record.compute_s = done.compute_s;
    record.pass_requests = done.pass_requests as u32;
    record.network_wait_s = done.network_wait_s;
    let failure = match (&send_err, &done.result, &done.state) {
        // where the compute stopped, too (the executor's cancel names the layer and chunk)
        (Some(e), Err(c), _) => Some(format!("transfer: {e}; compute: {c:#}")),
        (Some(e), _, _) => Some(format!("transfer: {e}")),
        (None, Err(e), _) => Some(format!("compute: {e:#}")),
        (None, Ok(_), None) => Some("compute: the state was lost".to_string()),
        (None, Ok(_), Some(_)) => None,
    };
    if let Some(reason) = failure {
        // The executor leaves the state untouched when it stops early: the old prefix stays
        // valid and goes back. Anything else drops the session.
        start.put_back(&sh, done.state);
        if send_err.is_none() {
            tx.abort(ErrorCode::Internal, &reason).await;
        }
        tracing::warn!(%peer, %session, "prefill request failed: {reason}");
        record.outcome = RequestOutcome::Failed { reason };
        record.total_s = accepted_at.elapsed().as_secs_f64();
        return sh.metrics.record(record);
    }
    let (Ok(logits), Some(new_state)) = (done.result, done.state) else { unreachable!("failure handled above") };
    let timing = Timing { compute_s: done.compute_s, ..Default::default() };

    // 6. Keep the new prefix now, before `Done` goes out: the decoder may name it in its next
    // request as soon as it has `Done`, while `finish` still waits for the last acknowledgements.
    let mut all = start.prefix.unwrap_or_default();
    all.extend_from_slice(&tokens);
    let stats = {
        let mut store = sh.sessions.lock().unwrap_or_else(|p| p.into_inner());
        if keep {
            store.store(session, all.clone(), new_state, Instant::now());
        } else {
            store.forget(&session);
        }
        store.stats()
    };
    record.state_bytes = state_bytes;
    record.total_s = accepted_at.elapsed().as_secs_f64();
    sh.metrics.record(record.clone());
    tracing::info!(
        %peer,
        %session,
        base,
        new = new_tokens,
        compute_s = format!("{:.3}", done.compute_s),
        queue_s = format!("{:.3}", done.queue_s),
        network_wait_s = format!("{:.3}", done.network_wait_s),
        total_s = format!("{:.3}", record.total_s),
        tok_per_s = format!("{:.1}", new_tokens as f64 / done.compute_s.max(1e-9)),
        pass_requests = done.pass_requests,
        state_mb = format!("{:.2}", state_bytes as f64 / 1e6),
        weights_gb = record.weights.as_ref().map(|w| format!("{:.3}", w.bytes as f64 / 1e9)).unwrap_or_default(),
        weights_wait_s = record.weights.as_ref().map(|w| format!("{:.3}", w.wait_s)).unwrap_or_default(),
        sessions = stats.sessions,
        sessions_mb = format!("{:.1}", stats.bytes as f64 / 1e6),
        "prefill done"
    );

    // 7. Done (returns once the decoder acknowledged every byte).
    if let Err(e) = tx.finish(timing, want_logits.then_some(logits)).await {
        // The decoder may not have everything. Drop the prefix stored above unless the decoder
        // already named it in a new request (then it did get `Done`).
        sh.sessions.lock().unwrap_or_else(|p| p.into_inner()).forget_if_idle(&session, &all);
        tracing::warn!(%peer, %session, "hand-off not delivered: {e}");
        sh.metrics.amend(record.request, &record.peer, RequestOutcome::Failed { reason: format!("transfer: {e}") });
    }
}

/// Cancels the request's compute when its task ends or is dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Decrements the in-flight count when the request leaves the queue or the worker.
struct InFlight(Arc<NodeContext>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let n = self.0.in_flight.fetch_sub(1, Ordering::SeqCst).saturating_sub(1);
        self.0.metrics.update(|c| c.in_flight = n as u64);
    }
}

async fn refuse(sh: &NodeContext, req: IncomingRequest, f: Refusal, mut record: RequestRecord) {
    let code = format!("{:?}", f.code);
    if let Err(e) = req.refuse(f.code, &f.message).await {
        tracing::debug!("refusal not delivered: {e}");
    }
    record.outcome = RequestOutcome::Refused { code, message: f.message };
    sh.metrics.record(record);
}
