//! The compute worker: one blocking thread that owns the model's turn on the backend (one GPU
//! runs one prefill at a time) and runs the layer-major executor for queued jobs. Each finished
//! layer goes through a small bounded channel to the job's async sender, so the compute of layer
//! l+1 overlaps the network send of layer l, and a decoder slower than the GPU makes the worker
//! wait instead of piling layers up in memory.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_protocol::handoff::{HandoffState, LayerState};
use tokio::sync::{mpsc, oneshot};

use crate::backend::Backend;
use crate::executor::{EmbeddingOverrides, ExecOptions, LogitsRows, PrefillInput};
use crate::model::Model;

/// One finished layer.
#[derive(Debug)]
pub struct LayerDone {
    pub layer: usize,
    pub state: LayerState,
    /// Compute time of the job so far (network waits excluded).
    pub compute_s: f64,
}

/// What the worker hands back: the state (advanced on success, untouched on a clean failure)
/// and the outcome.
pub struct JobDone {
    /// None when the executor panicked: the state may be half-updated and is dropped.
    pub state: Option<HandoffState>,
    pub result: anyhow::Result<Vec<f32>>,
    pub compute_s: f64,
    pub network_wait_s: f64,
    /// Queued → started.
    pub queue_s: f64,
    /// Weight streaming of the prompt (CUDA streamer; `None` with resident or per-layer weights).
    pub weights: Option<crate::streamer::StreamStats>,
    /// What the weight source read for the prompt (streamer or throttled source; `None`: resident).
    pub source: Option<crate::server::cost::SourceRead>,
}

pub struct Job {
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
    /// Stream each prompt's weights through these (the model's backend is then CUDA).
    pub streamed: Option<Arc<crate::streamer::StreamedWeights>>,
    /// Test hook: sleep this long after each layer (makes a transfer slow enough to kill).
    pub layer_delay: Duration,
    /// Test option: a weight source capped at this many bytes per second — layer l may finish
    /// only once `layer_bytes[..=l]` could have been read since the prompt started (reads run
    /// ahead of compute, as the streamer's do).
    pub source_rate: Option<(f64, Arc<Vec<u64>>)>,
    /// Told when a job starts computing.
    pub meter: Option<Arc<crate::server::cost::CostMeter>>,
}

/// Starts the worker thread; it ends when every job sender is dropped.
pub fn spawn<B: Backend + 'static>(model: Arc<Model<B>>, opts: WorkerOptions) -> std::io::Result<(std::sync::mpsc::Sender<Job>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let h = std::thread::Builder::new().name("prefill-compute".into()).spawn(move || {
        while let Ok(job) = rx.recv() {
            run_job(&model, &opts, job);
        }
        tracing::debug!("compute worker stopped");
    })?;
    Ok((tx, h))
}

fn run_job<B: Backend + 'static>(model: &Model<B>, opts: &WorkerOptions, job: Job) {
    let Job { request, tokens, overrides, mut state, layers, done, cancel, queued_at } = job;
    let queue_s = queued_at.elapsed().as_secs_f64();
    if cancel.load(Ordering::Relaxed) {
        let _ = done.send(JobDone {
            state: Some(state),
            result: Err(anyhow::anyhow!("cancelled while queued")),
            compute_s: 0.0,
            network_wait_s: 0.0,
            queue_s,
            weights: None,
            source: None,
        });
        return;
    }
    if let Some(m) = &opts.meter {
        m.started(request);
    }
    let span = tracing::info_span!("prefill", request, tokens = tokens.len(), base = state.tokens);
    let _g = span.enter();
    let exec = ExecOptions { chunk_tokens: opts.chunk_tokens, logits: LogitsRows::Last, ..Default::default() };
    let t0 = Instant::now();
    let mut waited = Duration::ZERO;
    let mut source_wait = Duration::ZERO;
    let mut source_bytes = 0u64;
    let input = PrefillInput { tokens: &tokens, overrides: overrides.as_ref() };
    let res = catch_unwind(AssertUnwindSafe(|| {
        crate::streamer::prefill_maybe_streamed(model, opts.streamed.as_deref(), &mut state, input, &exec, |ev| {
            if cancel.load(Ordering::Relaxed) {
                anyhow::bail!("the transfer was cancelled");
            }
            // The layer's weight bytes against the digest its fingerprint was made from (once
            // per layer per process): a shard damaged since is refused before its state leaves.
            model.ck.verify_layer(ev.layer)?;
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
            let compute_s = (t0.elapsed() - waited - source_wait).as_secs_f64();
            let w0 = Instant::now();
            let sent = layers.blocking_send(LayerDone { layer: ev.layer, state: ev.state.clone(), compute_s });
            waited += w0.elapsed();
            sent.map_err(|_| anyhow::anyhow!("the transfer ended before layer {} could be sent", ev.layer))
        })
    }));
    drop(layers);
    let compute_s = (t0.elapsed() - waited - source_wait).as_secs_f64();
    let network_wait_s = waited.as_secs_f64();
    let mut weights: Option<crate::streamer::StreamStats> = None;
    let (state, result) = match res {
        Ok(Ok((out, st))) => {
            weights = st;
            if out.logits_rows == 1 && out.logits.len() == out.vocab {
                (Some(state), Ok(out.logits))
            } else {
                (Some(state), Err(anyhow::anyhow!("executor returned {} logits rows, expected 1", out.logits_rows)))
            }
        }
        Ok(Err(e)) => (Some(state), Err(e)),
        Err(p) => {
            let what = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            tracing::error!(request, "the executor panicked: {what}; the session prefix is dropped");
            (None, Err(anyhow::anyhow!("internal error in the executor: {what}")))
        }
    };
    // The time the weight source was busy reading the prompt's weights: the throttled source's
    // reads at its cap; the streamer's readers filling staging (or the copy stream, if longer).
    let source = match (&opts.source_rate, &weights) {
        (Some((rate, _)), _) if source_bytes > 0 => {
            Some(crate::server::cost::SourceRead { bytes: source_bytes, seconds: source_bytes as f64 / rate })
        }
        (_, Some(w)) => Some(crate::server::cost::SourceRead { bytes: w.bytes as u64, seconds: w.fill_s.max(w.copy_s) }),
        _ => None,
    };
    let _ = done.send(JobDone { state, result, compute_s, network_wait_s, queue_s, weights, source });
}
