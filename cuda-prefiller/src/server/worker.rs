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
use crate::executor::{pass_request_bytes, CancelRef, EmbeddingOverrides, ExecOptions, LogitsRows, PassRequest, PrefillInput};
use crate::model::Model;

/// One finished layer.
#[derive(Debug)]
pub(super) struct LayerDone {
    pub layer: usize,
    pub state: LayerState,
    /// Compute time of the job's pass so far (network and weight-source waits excluded).
    pub compute_s: f64,
}

/// What the worker hands back: the state (advanced on success, untouched on a clean failure)
/// and the outcome.
pub(super) struct JobDone {
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
pub(super) struct PrefillJob {
    pub request: u64,
    pub tokens: Vec<u32>,
    pub overrides: Option<EmbeddingOverrides>,
    pub state: HandoffState,
    pub layers: mpsc::Sender<LayerDone>,
    pub done: oneshot::Sender<JobDone>,
    /// Set when the transfer died or the decoder cancelled: the executor stops before its next
    /// token chunk ([`ExecOptions::cancel`]).
    pub cancel: Arc<AtomicBool>,
    pub queued_at: Instant,
    /// Told (with the seconds it waited) when the job's weight pass starts.
    pub started: Option<oneshot::Sender<f64>>,
}

/// Settings of the worker.
#[derive(Debug, Clone)]
pub(super) struct WorkerOptions {
    pub chunk_tokens: usize,
    /// Plans every pass (chunk, expert windows, bank) and refuses what cannot fit
    /// ([`crate::server::ServeOptions::planner`]).
    pub planner: Option<crate::prefiller::Planner>,
    /// Stream each pass's weights through these (the model's backend is then CUDA).
    pub streamed: Option<Arc<crate::streamer::StreamedWeights>>,
    /// Test hook (feature `test-knobs`): sleep this long after each layer of a pass (makes a
    /// transfer slow enough to kill).
    #[cfg(feature = "test-knobs")]
    pub layer_delay: Duration,
    /// The emulated weight source ([`crate::server::ServeOptions::source`]): in the pass's
    /// weight feed layer l finishes no earlier than the bytes of layers 0..=l could have been
    /// read since the pass started ([`crate::source_pace::PacedFeed`]).
    pub source: Option<crate::source_pace::SourceRate>,
    /// Requests waiting when a pass starts join it while the sum of their
    /// [`pass_request_bytes`] stays within this (the first one always runs); 0: one request a pass.
    pub pass_budget_bytes: u64,
    /// Told when a job starts computing.
    pub meter: Option<Arc<crate::server::cost::CostMeter>>,
    /// Counts the weight passes.
    pub metrics: Option<Arc<crate::server::metrics::ServerMetrics>>,
    /// Set when the node shuts down: the pass in flight stops before its next token chunk, and
    /// every waiting job is answered without compute.
    pub stop: Arc<AtomicBool>,
}

/// Starts the worker thread; it ends when every job sender is dropped and the queue is empty, or
/// once [`WorkerOptions::stop`] is set (waiting jobs are answered first, without compute).
pub(super) fn spawn<B: Backend + 'static>(
    model: Arc<Model<B>>,
    opts: WorkerOptions,
) -> std::io::Result<(std::sync::mpsc::Sender<PrefillJob>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::channel::<PrefillJob>();
    let h = std::thread::Builder::new().name("prefill-compute".into()).spawn(move || {
        let mut waiting: VecDeque<PrefillJob> = VecDeque::new();
        loop {
            if waiting.is_empty() {
                // woken now and then to see a shutdown while senders are still alive
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(j) => waiting.push_back(j),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) if opts.stop.load(Ordering::Relaxed) => break,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            while let Ok(j) = rx.try_recv() {
                waiting.push_back(j);
            }
            if opts.stop.load(Ordering::Relaxed) {
                // answered without compute (run_pass refuses every job once the node stops)
                run_pass(&model, &opts, waiting.drain(..).collect());
                continue;
            }
            let pass = take_pass(&model, &opts, &mut waiting);
            run_pass(&model, &opts, pass);
        }
        tracing::debug!("compute worker stopped");
    })?;
    Ok((tx, h))
}

/// The next pass: the oldest waiting job, then the following ones while they fit the budget
/// (and, with a memory plan, while the pass still fits the node's memory). A job that cannot fit
/// even alone is answered at once with the plan's reason.
fn take_pass<B: Backend>(model: &Model<B>, opts: &WorkerOptions, waiting: &mut VecDeque<PrefillJob>) -> Vec<PrefillJob> {
    let mut pass = Vec::new();
    let mut planned: Vec<crate::memory_plan::PlanRequest> = Vec::new();
    let mut bytes = 0u64;
    while let Some(j) = waiting.front() {
        let need = pass_request_bytes(&model.dims, model.plan.len(), j.state.tokens, j.tokens.len());
        if !pass.is_empty() && bytes.saturating_add(need) > opts.pass_budget_bytes {
            break;
        }
        if let Some(p) = &opts.planner {
            let me = crate::memory_plan::PlanRequest { base: j.state.tokens, new: j.tokens.len().max(1) };
            let mut with = planned.clone();
            with.push(me);
            if let Err(e) = p.plan(&with) {
                if pass.is_empty() {
                    let j = waiting.pop_front().expect("front exists");
                    tracing::warn!(request = j.request, tokens = j.tokens.len(), base = j.state.tokens, "refused: {e}");
                    let queue_s = j.queued_at.elapsed().as_secs_f64();
                    let _ = j.done.send(JobDone::failed(Some(j.state), anyhow::Error::new(e), queue_s));
                    continue;
                }
                break;
            }
            planned = with;
        }
        bytes = bytes.saturating_add(need);
        pass.extend(waiting.pop_front());
    }
    pass
}

fn run_pass<B: Backend + 'static>(model: &Model<B>, opts: &WorkerOptions, jobs: Vec<PrefillJob>) {
    let mut live = Vec::with_capacity(jobs.len());
    for mut job in jobs {
        let queue_s = job.queued_at.elapsed().as_secs_f64();
        if opts.stop.load(Ordering::Relaxed) {
            let _ = job.done.send(JobDone::failed(Some(job.state), anyhow::anyhow!("the node is shutting down"), queue_s));
        } else if job.cancel.load(Ordering::Relaxed) {
            let _ = job.done.send(JobDone::failed(Some(job.state), anyhow::anyhow!("cancelled while queued"), queue_s));
        } else {
            if let Some(s) = job.started.take() {
                let _ = s.send(queue_s);
            }
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
        let PrefillJob { request: _, tokens, overrides, state, layers, done, cancel, queued_at: _, started: _ } = j;
        meta.push((done, queue_s));
        states.push(state);
        inputs.push((tokens, overrides));
        senders.push(Some(layers));
        cancels.push(cancel);
    }
    // Each request's cancel (and the node's stop) is checked before every token chunk.
    let cancel = {
        let (flags, stop) = (cancels.clone(), opts.stop.clone());
        CancelRef(Arc::new(move |i: usize| stop.load(Ordering::Relaxed) || flags.get(i).is_some_and(|f| f.load(Ordering::Relaxed))))
    };
    let mut exec = ExecOptions { chunk_tokens: opts.chunk_tokens, logits: LogitsRows::Last, cancel: Some(cancel), ..Default::default() };
    if let Some(p) = &opts.planner {
        let reqs: Vec<crate::memory_plan::PlanRequest> =
            states.iter().zip(&inputs).map(|(s, (t, _))| crate::memory_plan::PlanRequest { base: s.tokens, new: t.len().max(1) }).collect();
        match p.plan(&reqs) {
            Ok(plan) => {
                tracing::info!("{}", plan.line());
                exec = exec.following(&plan);
            }
            // checked when the pass was taken; the executor's own checks answer anything else
            Err(e) => tracing::warn!("{e}"),
        }
    }
    let t0 = Instant::now();
    let mut waited = Duration::ZERO;
    // One-time costs inside the pass, left out of its measured compute (which predicts later
    // requests): the weight digest checks (each layer once per process) and the backend's
    // kernel loading.
    let one_time0 = model.backend.one_time_seconds();
    let mut checked = Duration::ZERO;
    let pace = opts.source.as_ref().map(crate::source_pace::SourceRate::start);
    let source_wait = || pace.as_ref().map_or(Duration::ZERO, |p| p.waited());
    let mut paced: Option<usize> = None;
    let res = {
        let mut reqs: Vec<PassRequest<'_, '_>> = states
            .iter_mut()
            .zip(&inputs)
            .map(|(state, (tokens, overrides))| PassRequest { state, input: PrefillInput { tokens, overrides: overrides.as_ref() } })
            .collect();
        catch_unwind(AssertUnwindSafe(|| {
            // The embedding, norm and output head against the digest (once per process), as
            // each layer is below: a state leaves only computed from checked weights.
            let v0 = Instant::now();
            model.ck.verify_outside_layers()?;
            checked += v0.elapsed();
            crate::streamer::prefill_many_maybe_streamed(model, opts.streamed.as_deref(), pace.as_ref(), &mut reqs, &exec, |i, ev| {
                if cancels[i].load(Ordering::Relaxed) {
                    anyhow::bail!("the transfer was cancelled");
                }
                // The layer's weight bytes against the digest its fingerprint was made from (once
                // per layer per process): a shard damaged since is refused before its state leaves.
                let v0 = Instant::now();
                model.ck.verify_layer(ev.layer)?;
                checked += v0.elapsed();
                // Once per layer of the pass, whatever the number of requests in it.
                if paced != Some(ev.layer) {
                    paced = Some(ev.layer);
                    #[cfg(feature = "test-knobs")]
                    if !opts.layer_delay.is_zero() {
                        std::thread::sleep(opts.layer_delay);
                    }
                }
                let compute_s = (t0.elapsed() - waited - source_wait() - checked).as_secs_f64() - (model.backend.one_time_seconds() - one_time0);
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
    let one_time_s = checked.as_secs_f64() + (model.backend.one_time_seconds() - one_time0);
    if one_time_s > 0.05 {
        tracing::info!(seconds = format!("{one_time_s:.3}"), "one-time costs in this pass (weight digest checks, kernel loading), not counted as compute");
    }
    let weights = match &res {
        Ok(Ok((_, st))) => st.clone(),
        _ => None,
    };
    let wall_compute_s = ((t0.elapsed() - waited - source_wait()).as_secs_f64() - one_time_s).max(0.0);
    // Streamed weights: the pass's time blocked on weight copies (the GPU waiting for a slot, the
    // executor waiting for the readers) is the weight pass's, not compute. Left in, a
    // weight-bound pass teaches the fit that compute takes the whole pass, and a longer prompt
    // is then predicted several times too slow. Never below the GPU's own busy time.
    let compute_s = match &weights {
        Some(w) => (wall_compute_s - w.wait_s - w.host_wait_s).max(w.compute_s).min(wall_compute_s),
        None => wall_compute_s,
    };
    let network_wait_s = waited.as_secs_f64();
    // The time the weight source was busy reading the pass's weights: the emulated source's
    // reads at its rate; the streamer's readers filling staging (or the copy stream, if longer).
    let source = match (&pace, &weights) {
        (Some(p), _) if p.bytes() > 0 => Some(crate::server::cost::SourceRead { bytes: p.bytes(), seconds: p.read_seconds() }),
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
            let what =
                p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "unknown panic".into());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory_plan::{BackendShape, Geometry, Knobs, Limits};

    fn job(request: u64, n: usize, cfg: &k3_protocol::config::TextConfig) -> (PrefillJob, oneshot::Receiver<JobDone>, mpsc::Receiver<LayerDone>) {
        let (done, done_rx) = oneshot::channel();
        let (layers, layers_rx) = mpsc::channel(64);
        let j = PrefillJob {
            request,
            tokens: (0..n as u32).map(|i| i % 500).collect(),
            overrides: None,
            state: HandoffState::empty(cfg),
            layers,
            done,
            cancel: Arc::new(AtomicBool::new(false)),
            queued_at: Instant::now(),
            started: None,
        };
        (j, done_rx, layers_rx)
    }

    /// A request beyond the node's memory plan is answered with the plan's reason before any
    /// weight is read, and one that fits still runs, under the plan.
    #[test]
    fn a_request_beyond_the_plan_is_refused_with_its_reason() {
        let ck = Arc::new(k3_protocol::Checkpoint::open(&k3_protocol::testdata::golden_dir("tiny-a")).unwrap());
        let model = Arc::new(Model::new(Arc::new(crate::cpu::CpuBackend), ck, crate::model::WeightPolicy::PerLayer).unwrap());
        let cfg = model.cfg.clone();
        let planner = crate::prefiller::Planner {
            geometry: Geometry::of(&cfg, &model.plan).unwrap(),
            shape: BackendShape::cpu(),
            limits: Limits { device: 8_000_000, host: 4_000_000_000 },
            knobs: Knobs::default(),
        };
        let longest = planner.longest_prompt();
        assert!(longest > 100 && longest < 1_000_000, "{longest}");
        let opts = WorkerOptions {
            chunk_tokens: 512,
            planner: Some(planner),
            streamed: None,
            #[cfg(feature = "test-knobs")]
            layer_delay: Duration::ZERO,
            source: None,
            pass_budget_bytes: 16 << 30,
            meter: None,
            metrics: None,
            stop: Arc::new(AtomicBool::new(false)),
        };
        let (tx, h) = spawn(model, opts).unwrap();
        let (big, big_rx, _l1) = job(1, longest + 1, &cfg);
        let (small, small_rx, mut l2) = job(2, 100, &cfg);
        tx.send(big).unwrap();
        tx.send(small).unwrap();
        let drain = std::thread::spawn(move || while l2.blocking_recv().is_some() {});
        let big = big_rx.blocking_recv().unwrap();
        let e = format!("{:#}", big.result.expect_err("refused"));
        assert!(e.contains("--vram-budget") && e.contains(&format!("the longest prompt that fits is {longest} tokens")), "{e}");
        assert!(big.state.is_some(), "the refused request's state comes back untouched");
        let small = small_rx.blocking_recv().unwrap();
        assert!(small.result.is_ok(), "{:?}", small.result.err());
        drop(tx);
        h.join().unwrap();
        drain.join().unwrap();
    }
}
