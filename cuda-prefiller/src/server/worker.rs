//! The compute worker: one blocking thread that owns the model's turn on the backend (one GPU
//! runs one weight pass at a time) and runs the layer-major executor for queued jobs. The
//! requests waiting when a pass starts share it (up to [`WorkerOptions::pass_budget_bytes`] of
//! activations and states): each layer's weights are read once for all of them
//! ([`crate::executor::prefill_many_with`]), each request keeps its own tokens and state. Each
//! finished layer goes through a small bounded channel to its job's async sender, so the compute
//! of layer l+1 overlaps the network send of layer l, and a decoder slower than the GPU makes
//! the worker wait instead of piling layers up in memory.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_protocol::handoff::{HandoffState, LayerState};
use tokio::sync::{mpsc, oneshot};

use crate::backend::Backend;
use crate::executor::{pass_request_bytes, EmbeddingOverrides, ExecOptions, LogitsRows, PassRequest, PrefillInput};
use crate::model::Model;

/// One finished layer.
#[derive(Debug)]
pub struct LayerDone {
    pub layer: usize,
    pub state: LayerState,
    /// Compute time of the job's pass so far (network and weight-source waits excluded).
    pub compute_s: f64,
}

/// What the worker hands back: the state (advanced on success, untouched on a clean failure)
/// and the outcome.
pub struct JobDone {
    /// None when the executor panicked: the state may be half-updated and is dropped.
    pub state: Option<HandoffState>,
    pub result: anyhow::Result<Vec<f32>>,
    /// Compute time of the weight pass the job rode (shared with the other requests of the pass).
    pub compute_s: f64,
    /// The job's share of that compute (by its predicted cost; all of it when alone), for the
    /// node's compute fit.
    pub compute_share_s: f64,
    pub network_wait_s: f64,
    /// Queued → started.
    pub queue_s: f64,
    /// Requests that shared the weight pass (1: alone).
    pub pass_requests: usize,
    /// The job's token chunks: `(rows, seconds)` of compute each (empty on an asynchronous
    /// backend, whose host times are not compute times), for the node's compute fit.
    pub chunk_seconds: Vec<(usize, f64)>,
    /// Weight streaming of the pass (CUDA streamer; `None` with resident or per-layer weights).
    pub weights: Option<crate::streamer::StreamStats>,
    /// What the weight source read for the pass (streamer or throttled source; `None`: resident,
    /// or another request of the same pass reports it).
    pub source: Option<crate::server::cost::SourceRead>,
}

impl JobDone {
    fn failed(state: Option<HandoffState>, why: anyhow::Error, queue_s: f64) -> JobDone {
        JobDone {
            state,
            result: Err(why),
            compute_s: 0.0,
            compute_share_s: 0.0,
            network_wait_s: 0.0,
            queue_s,
            pass_requests: 0,
            chunk_seconds: Vec::new(),
            weights: None,
            source: None,
        }
    }
}

/// One request's prefill, queued for the compute worker.
pub struct PrefillJob {
    pub request: u64,
    pub tokens: Vec<u32>,
    pub overrides: Option<EmbeddingOverrides>,
    pub state: HandoffState,
    pub layers: mpsc::Sender<LayerDone>,
    pub done: oneshot::Sender<JobDone>,
    /// Set when the transfer died: stop at the next layer.
    pub cancel: Arc<AtomicBool>,
    pub queued_at: Instant,
}

/// Settings of the worker.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub chunk_tokens: usize,
    /// Stream each pass's weights through these (the model's backend is then CUDA).
    pub streamed: Option<Arc<crate::streamer::StreamedWeights>>,
    /// Test hook (feature `test-knobs`): sleep this long after each layer of a pass (makes a
    /// transfer slow enough to kill).
    #[cfg(feature = "test-knobs")]
    pub layer_delay: Duration,
    /// Test option: a weight source capped at this many bytes per second — layer l may finish
    /// only once `layer_bytes[..=l]` could have been read since the pass started (reads run
    /// ahead of compute, as the streamer's do).
    pub source_rate: Option<(f64, Arc<Vec<u64>>)>,
    /// Requests waiting when a pass starts join it while the sum of their
    /// [`pass_request_bytes`] stays within this (the first one always runs); 0: one request a pass.
    pub pass_budget_bytes: u64,
    /// Told when a job starts computing.
    pub meter: Option<Arc<crate::server::cost::CostMeter>>,
    /// Counts the weight passes.
    pub metrics: Option<Arc<crate::server::metrics::ServerMetrics>>,
}

/// Starts the worker thread; it ends when every job sender is dropped and the queue is empty.
pub fn spawn<B: Backend + 'static>(model: Arc<Model<B>>, opts: WorkerOptions) -> std::io::Result<(std::sync::mpsc::Sender<PrefillJob>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::channel::<PrefillJob>();
    let h = std::thread::Builder::new().name("prefill-compute".into()).spawn(move || {
        let mut waiting: VecDeque<PrefillJob> = VecDeque::new();
        loop {
            if waiting.is_empty() {
                match rx.recv() {
                    Ok(j) => waiting.push_back(j),
                    Err(_) => break,
                }
            }
            while let Ok(j) = rx.try_recv() {
                waiting.push_back(j);
            }
            let pass = take_pass(&model, &opts, &mut waiting);
            run_pass(&model, &opts, pass);
        }
        tracing::debug!("compute worker stopped");
    })?;
    Ok((tx, h))
}

/// The next pass: the oldest waiting job, then the following ones while they fit the budget.
fn take_pass<B: Backend>(model: &Model<B>, opts: &WorkerOptions, waiting: &mut VecDeque<PrefillJob>) -> Vec<PrefillJob> {
    let mut pass = Vec::new();
    let mut bytes = 0u64;
    while let Some(j) = waiting.front() {
        let need = pass_request_bytes(&model.dims, model.plan.len(), j.state.tokens, j.tokens.len());
        if !pass.is_empty() && bytes.saturating_add(need) > opts.pass_budget_bytes {
            break;
        }
        bytes = bytes.saturating_add(need);
        pass.extend(waiting.pop_front());
    }
    pass
}

fn run_pass<B: Backend + 'static>(model: &Model<B>, opts: &WorkerOptions, jobs: Vec<PrefillJob>) {
    let mut live = Vec::with_capacity(jobs.len());
    for job in jobs {
        let queue_s = job.queued_at.elapsed().as_secs_f64();
        if job.cancel.load(Ordering::Relaxed) {
            let _ = job.done.send(JobDone::failed(Some(job.state), anyhow::anyhow!("cancelled while queued"), queue_s));
        } else {
            live.push((job, queue_s));
        }
    }
    if live.is_empty() {
        return;
    }
    if let Some(m) = &opts.meter {
        for (j, _) in &live {
            m.started(j.request);
        }
    }
    let count = live.len();
    let new_tokens: usize = live.iter().map(|(j, _)| j.tokens.len()).sum();
    let span = tracing::info_span!("weight pass", requests = count, tokens = new_tokens);
    let _g = span.enter();
    if count > 1 {
        let ids: Vec<u64> = live.iter().map(|(j, _)| j.request).collect();
        tracing::info!(?ids, tokens = new_tokens, "{count} requests share one weight pass");
    }
    // The job's share of the pass compute, by the node's current compute fit (tokens without one).
    let weights_of: Vec<f64> = {
        let fit = opts.meter.as_ref().map(|m| m.current().compute).unwrap_or_default();
        let w: Vec<f64> = live.iter().map(|(j, _)| fit.seconds(j.tokens.len() as u64, j.state.tokens as u64)).collect();
        if w.iter().all(|&x| x > 0.0) {
            w
        } else {
            live.iter().map(|(j, _)| j.tokens.len() as f64).collect()
        }
    };
    let weight_sum: f64 = weights_of.iter().sum::<f64>().max(1e-12);

    let mut meta = Vec::with_capacity(count);
    let mut states = Vec::with_capacity(count);
    let mut inputs = Vec::with_capacity(count);
    let mut senders = Vec::with_capacity(count);
    let mut cancels = Vec::with_capacity(count);
    for (j, queue_s) in live {
        let PrefillJob { request: _, tokens, overrides, state, layers, done, cancel, queued_at: _ } = j;
        meta.push((done, queue_s));
        states.push(state);
        inputs.push((tokens, overrides));
        senders.push(Some(layers));
        cancels.push(cancel);
    }
    let exec = ExecOptions { chunk_tokens: opts.chunk_tokens, logits: LogitsRows::Last, ..Default::default() };
    let t0 = Instant::now();
    let mut waited = Duration::ZERO;
    let mut source_wait = Duration::ZERO;
    let mut source_bytes = 0u64;
    let mut paced: Option<usize> = None;
    let res = {
        let mut reqs: Vec<PassRequest<'_, '_>> = states
            .iter_mut()
            .zip(&inputs)
            .map(|(state, (tokens, overrides))| PassRequest { state, input: PrefillInput { tokens, overrides: overrides.as_ref() } })
            .collect();
        catch_unwind(AssertUnwindSafe(|| {
            crate::streamer::prefill_many_maybe_streamed(model, opts.streamed.as_deref(), &mut reqs, &exec, |i, ev| {
                if cancels[i].load(Ordering::Relaxed) {
                    anyhow::bail!("the transfer was cancelled");
                }
                // The layer's weight bytes against the digest its fingerprint was made from (once
                // per layer per process): a shard damaged since is refused before its state leaves.
                model.ck.verify_layer(ev.layer)?;
                // Once per layer of the pass, whatever the number of requests in it.
                if paced != Some(ev.layer) {
                    paced = Some(ev.layer);
                    #[cfg(feature = "test-knobs")]
                    if !opts.layer_delay.is_zero() {
                        std::thread::sleep(opts.layer_delay);
                    }
                    if let Some((rate, bytes)) = &opts.source_rate {
                        source_bytes += bytes.get(ev.layer).copied().unwrap_or(0);
                        let ready = Duration::from_secs_f64(source_bytes as f64 / rate);
                        let now = t0.elapsed();
                        if ready > now {
                            std::thread::sleep(ready - now);
                            source_wait += ready - now;
                        }
                    }
                }
                let compute_s = (t0.elapsed() - waited - source_wait).as_secs_f64();
                let w0 = Instant::now();
                let sent = match &senders[i] {
                    Some(tx) => tx.blocking_send(LayerDone { layer: ev.layer, state: ev.state.clone(), compute_s }).is_ok(),
                    None => false,
                };
                waited += w0.elapsed();
                if !sent {
                    senders[i] = None;
                    anyhow::bail!("the transfer ended before layer {} could be sent", ev.layer);
                }
                Ok(())
            })
        }))
    };
    drop(senders);
    let compute_s = (t0.elapsed() - waited - source_wait).as_secs_f64();
    let network_wait_s = waited.as_secs_f64();
    // The time the weight source was busy reading the pass's weights: the throttled source's
    // reads at its cap; the streamer's readers filling staging (or the copy stream, if longer).
    let weights = match &res {
        Ok(Ok((_, st))) => st.clone(),
        _ => None,
    };
    let source = match (&opts.source_rate, &weights) {
        (Some((rate, _)), _) if source_bytes > 0 => Some(crate::server::cost::SourceRead { bytes: source_bytes, seconds: source_bytes as f64 / rate }),
        (_, Some(w)) => Some(crate::server::cost::SourceRead { bytes: w.bytes as u64, seconds: w.fill_s.max(w.copy_s) }),
        _ => None,
    };
    if let Some(m) = &opts.metrics {
        m.weight_pass(count, weights.as_ref());
    }
    let host_timed = model.backend.synchronous();
    let mut results: Vec<(Option<HandoffState>, anyhow::Result<Vec<f32>>, Vec<(usize, f64)>)> = Vec::with_capacity(count);
    match res {
        Ok(Ok((outs, _))) => {
            for (state, out) in states.into_iter().zip(outs) {
                let chunks = match (&out, host_timed) {
                    (Ok(o), true) => o.chunk_seconds.clone(),
                    _ => Vec::new(),
                };
                let r = out.and_then(|out| {
                    anyhow::ensure!(out.logits_rows == 1 && out.logits.len() == out.vocab, "executor returned {} logits rows, expected 1", out.logits_rows);
                    Ok(out.logits)
                });
                results.push((Some(state), r, chunks));
            }
        }
        Ok(Err(e)) => {
            let why = format!("{e:#}");
            for state in states {
                results.push((Some(state), Err(anyhow::anyhow!("{why}")), Vec::new()));
            }
        }
        Err(p) => {
            let what = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!(requests = count, "the executor panicked: {what}; the sessions' prefixes are dropped");
            for _ in 0..count {
                results.push((None, Err(anyhow::anyhow!("internal error in the executor: {what}")), Vec::new()));
            }
        }
    }
    for (i, ((done, queue_s), (state, result, chunk_seconds))) in meta.into_iter().zip(results).enumerate() {
        let _ = done.send(JobDone {
            state,
            result,
            compute_s,
            compute_share_s: compute_s * weights_of[i] / weight_sum,
            network_wait_s,
            queue_s,
            pass_requests: count,
            chunk_seconds,
            weights: weights.clone(),
            source: if i == 0 { source } else { None },
        });
    }
}
