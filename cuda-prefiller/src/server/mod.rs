//! The prefill server (`k3-prefill serve`): accepts paired decoders over QUIC
//! ([`k3_protocol::transport::PrefillServer`]), runs the layer-major executor for their
//! requests on one compute worker (one prefill at a time per backend; later requests queue, a
//! full queue is refused as `Busy`), ships each layer's state the moment it is done, and keeps
//! each session's prefix in a bounded [`sessions::PrefixStore`] so the next turn prefills only
//! its new tokens.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use std::sync::Arc;
//! use cuda_prefiller::{cpu::CpuBackend, model::{Model, WeightPolicy}, server::{PrefillNode, ServeOptions}};
//! # let node_config: k3_protocol::transport::NodeConfig = todo!();
//! let ck = Arc::new(k3_protocol::Checkpoint::open(std::path::Path::new("tests/golden/tiny-a"))?);
//! let model = Model::new(Arc::new(CpuBackend), ck, WeightPolicy::Resident)?;
//! let node = PrefillNode::start(model, "127.0.0.1:0".parse()?, node_config, ServeOptions::default())?;
//! println!("listening on {}", node.local_addr());
//! node.shutdown();
//! # Ok(()) }
//! ```

mod context;
pub mod cost;
pub mod metrics;
pub mod predict;
mod request;
pub mod sessions;
mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use k3_protocol::transport::{NodeConfig, PrefillConnection, PrefillServer, TransferError};
use tokio::sync::watch;

use crate::backend::Backend;
use crate::model::Model;
use context::NodeContext;
pub use context::{OnVerified, ServeOptions};
pub use metrics::{MetricsSnapshot, RequestOutcome, RequestRecord, ServerMetrics};
pub use sessions::{PrefixStore, StoreLimits, StoreStats};

/// A running prefill node: its own tokio runtime (network), one compute thread (model).
/// Dropping it shuts it down gracefully.
pub struct PrefillNode {
    addr: SocketAddr,
    backend: String,
    shared: Arc<NodeContext>,
    stop: watch::Sender<bool>,
    runtime: Option<tokio::runtime::Runtime>,
    serve_task: Option<tokio::task::JoinHandle<()>>,
    worker: Option<std::thread::JoinHandle<()>>,
    /// Set at shutdown: the compute worker abandons its pass before the next token chunk.
    stopping: Arc<AtomicBool>,
}

/// Weight bytes a streamed node moves to the GPU at start-up to predict its weight pass.
const STARTUP_FEED_PROBE_BYTES: usize = 4 << 30;

/// How long a graceful shutdown waits for each part: the accept loop and its connections, the
/// network runtime's remaining tasks, the compute worker (which abandons its pass within a
/// token chunk). Together under the 5 s a service manager allows after SIGTERM.
const SHUTDOWN_SERVE: Duration = Duration::from_millis(1500);
const SHUTDOWN_RUNTIME: Duration = Duration::from_millis(500);
const SHUTDOWN_WORKER: Duration = Duration::from_millis(2000);

impl PrefillNode {
    /// Binds `listen` and starts serving `model`.
    pub fn start<B: Backend + 'static>(
        model: impl Into<Arc<Model<B>>>,
        listen: SocketAddr,
        node: NodeConfig,
        opts: ServeOptions,
    ) -> anyhow::Result<PrefillNode> {
        let model: Arc<Model<B>> = model.into();
        let backend = model.backend.name().to_string();
        let text_config = model.cfg.clone();
        // What one weight pass reads: every layer's tensors from the emulated source, the
        // checkpoint from the streamer's, nothing with resident weights.
        let pass_bytes = match (&opts.source, &opts.streamed) {
            (Some(s), _) => s.pass_bytes(),
            (None, Some(_)) => model.ck.total_bytes(),
            (None, None) => 0,
        };
        // Until a pass is measured: the emulated source's pacing, or the streamer's feed as
        // measured now (the first few GB of a pass moved to the GPU).
        let feed_s = match &opts.streamed {
            Some(sw) => match sw.feed_gbs(STARTUP_FEED_PROBE_BYTES) {
                Ok(gbs) => {
                    tracing::info!(feed_gbs = format!("{gbs:.2}"), pass_gb = format!("{:.2}", pass_bytes as f64 / 1e9), "start-up weight feed");
                    model.ck.total_bytes() as f64 / 1e9 / gbs
                }
                Err(e) => {
                    tracing::warn!("could not measure the weight feed at start-up ({e:#}); its pass is advertised from the emulated source or as 0 s until a request is measured");
                    0.0
                }
            },
            None => 0.0,
        };
        let planned_pass_s = opts.source.as_ref().map_or(feed_s, |s| s.pass_seconds().max(feed_s));
        // Before serving: the compute predicted from the model's FLOPs at the GEMM rate measured
        // here now, advertised until the first request is measured.
        let predicted = predict::measure(&*model.backend, &text_config, opts.chunk_tokens).map(|gemm| {
            let r = match opts.streamed {
                None => predict::measure_model(&model, &gemm, opts.chunk_tokens).unwrap_or(gemm),
                Some(_) => gemm,
            };
            let fit = predict::predicted_compute(&text_config, &r);
            tracing::info!(
                gemm_gflops = format!("{:.2}", gemm.gemm_flops_per_s / 1e9),
                effective_gflops = format!("{:.2}", r.gemm_flops_per_s / 1e9),
                fixed_ms = format!("{:.1}", r.fixed_s * 1e3),
                measured_in_s = format!("{:.3}", r.seconds),
                predicted_1k_s = format!("{:.3}", fit.seconds(1024, 0)),
                pass_s = format!("{planned_pass_s:.3}"),
                "start-up cost prediction"
            );
            fit
        });
        let meter = Arc::new(cost::CostMeter::new(node.cost.clone(), pass_bytes, planned_pass_s).with_predicted(predicted.unwrap_or_default()));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("prefill-net")
            .enable_all()
            .build()
            .context("starting the network runtime")?;
        let server = {
            let _g = runtime.enter();
            PrefillServer::bind(listen, node).with_context(|| format!("listening on {listen}"))?
        };
        let addr = server.local_addr();
        let metrics = Arc::new(ServerMetrics::default());
        let stopping = Arc::new(AtomicBool::new(false));
        // The weights against the digest their fingerprint was made from, every layer once per
        // process before a state computed from it leaves: started now, beside serving, so that
        // the first request does not wait for the hashing of every layer (a request reaching a
        // layer not checked yet checks it itself).
        {
            let (ck, stop) = (model.ck.clone(), stopping.clone());
            let layers = text_config.num_hidden_layers;
            std::thread::Builder::new()
                .name("weight-check".into())
                .spawn(move || {
                    let t0 = std::time::Instant::now();
                    if let Err(e) = ck.verify_outside_layers() {
                        tracing::warn!("weight check: {e}");
                    }
                    for l in 0..layers {
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            return;
                        }
                        if let Err(e) = ck.verify_layer(l) {
                            tracing::warn!("weight check: {e}");
                        }
                    }
                    tracing::info!(layers, seconds = format!("{:.2}", t0.elapsed().as_secs_f64()), "weights checked against their digest");
                })
                .context("starting the weight check")?;
        }
        let (jobs, worker) = worker::spawn(
            model,
            worker::WorkerOptions {
                chunk_tokens: opts.chunk_tokens,
                planner: opts.planner.clone(),
                streamed: opts.streamed.clone(),
                #[cfg(feature = "test-knobs")]
                layer_delay: opts.layer_delay,
                source: opts.source.clone(),
                pass_budget_bytes: opts.pass_budget_bytes,
                meter: Some(meter.clone()),
                metrics: Some(metrics.clone()),
                stop: stopping.clone(),
            },
        )
        .context("starting the compute thread")?;
        let shared = Arc::new(NodeContext {
            text_config,
            sessions: Mutex::new(PrefixStore::new(opts.store)),
            opts,
            metrics,
            jobs: Mutex::new(jobs),
            in_flight: AtomicUsize::new(0),
            cost: meter,
        });
        let (stop, stop_rx) = watch::channel(false);
        if let Some(maddr) = shared.opts.metrics_listen {
            let listener = {
                let _g = runtime.enter();
                let std_listener = std::net::TcpListener::bind(maddr).with_context(|| format!("metrics: listening on {maddr}"))?;
                std_listener.set_nonblocking(true).context("metrics listener")?;
                tokio::net::TcpListener::from_std(std_listener).context("metrics listener")?
            };
            tracing::info!(addr = %maddr, "metrics at GET /metrics");
            let sh = shared.clone();
            let page = move || {
                let sessions = sh.sessions.lock().map(|s| s.stats()).unwrap_or_default();
                let recent = sh.metrics.recent();
                metrics::openmetrics(&sh.metrics.counters(), &sessions, recent.last(), Some(&sh.cost.current()))
            };
            runtime.spawn(metrics::serve_http(listener, page, stop_rx.clone()));
        }
        let serve_task = runtime.spawn(serve(server, shared.clone(), stop_rx));
        tracing::info!(%addr, backend, "prefill node ready");
        Ok(PrefillNode { addr, backend, shared, stop, runtime: Some(runtime), serve_task: Some(serve_task), worker: Some(worker), stopping })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Name of the compute backend ("cpu", "cuda").
    pub fn backend(&self) -> &str {
        &self.backend
    }

    /// The cost this node advertises now (weight pass, compute fit, queue).
    pub fn cost(&self) -> k3_protocol::wire::NodeCost {
        self.shared.cost.current()
    }

    pub fn metrics(&self) -> Arc<ServerMetrics> {
        self.shared.metrics.clone()
    }

    /// Counters, session store and recent requests at this instant.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let sessions = self.shared.sessions.lock().map(|s| s.stats()).unwrap_or_default();
        MetricsSnapshot { counters: self.shared.metrics.counters(), sessions, recent: self.shared.metrics.recent() }
    }

    /// Serves until SIGINT/SIGTERM (or a stop through [`PrefillNode::stop_handle`]), then shuts
    /// down gracefully.
    pub fn run_until_signal(mut self) {
        if let (Some(rt), Some(task)) = (self.runtime.as_ref(), self.serve_task.as_mut()) {
            let stop = self.stop.clone();
            rt.block_on(async {
                #[cfg(unix)]
                let term = async {
                    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                        Ok(mut s) => {
                            s.recv().await;
                        }
                        Err(_) => std::future::pending::<()>().await,
                    }
                };
                #[cfg(not(unix))]
                let term = std::future::pending::<()>();
                tokio::select! {
                    _ = task => {}
                    _ = tokio::signal::ctrl_c() => tracing::info!("interrupted; shutting down"),
                    _ = term => tracing::info!("terminated; shutting down"),
                }
                let _ = stop.send(true);
            });
        }
        let snap = self.snapshot();
        tracing::info!(
            requests = snap.counters.requests,
            completed = snap.counters.completed,
            refused = snap.counters.refused,
            failed = snap.counters.failed,
            weight_passes = snap.counters.weight_passes,
            tokens = snap.counters.tokens_prefilled,
            state_mb = format!("{:.1}", snap.counters.state_bytes_sent as f64 / 1e6),
            compute_s = format!("{:.2}", snap.counters.compute_s),
            "prefill node summary"
        );
        self.shutdown_inner(true);
    }

    /// A handle that asks the node to stop (from a signal handler task, another thread...).
    pub fn stop_handle(&self) -> watch::Sender<bool> {
        self.stop.clone()
    }

    /// Stops accepting, closes every connection politely, stops the compute (the pass in flight
    /// is abandoned before its next token chunk) and waits for the compute thread, all within
    /// about 4 s.
    pub fn shutdown(mut self) {
        self.shutdown_inner(true);
    }

    /// Test hook: dies like a killed process — no goodbye on any connection, every task dropped
    /// at once. Decoders notice only through their timeouts.
    #[doc(hidden)]
    pub fn kill(mut self) {
        self.shutdown_inner(false);
    }

    fn shutdown_inner(&mut self, graceful: bool) {
        let Some(rt) = self.runtime.take() else { return };
        // The compute stops first: the pass in flight before its next token chunk, the waiting
        // jobs without compute (a killed process computes nothing either).
        self.stopping.store(true, Ordering::SeqCst);
        if graceful {
            let _ = self.stop.send(true);
            if let Some(task) = self.serve_task.take() {
                let _ = rt.block_on(async { tokio::time::timeout(SHUTDOWN_SERVE, task).await });
            }
            rt.shutdown_timeout(SHUTDOWN_RUNTIME);
        } else {
            rt.shutdown_background();
        }
        // Closing the job channel ends the worker.
        if let Ok(mut j) = self.shared.jobs.lock() {
            let (dead, _) = std::sync::mpsc::channel();
            *j = dead;
        }
        if let Some(w) = self.worker.take() {
            if graceful {
                let t0 = Instant::now();
                while !w.is_finished() && t0.elapsed() < SHUTDOWN_WORKER {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if w.is_finished() {
                    let _ = w.join();
                } else {
                    // One backend call longer than the bound (a token chunk on a very slow
                    // backend): the thread is left to end with the process.
                    tracing::warn!("the compute thread did not stop within {:.1} s; leaving it", SHUTDOWN_WORKER.as_secs_f64());
                }
            }
        }
        tracing::info!(addr = %self.addr, graceful, "prefill node stopped");
    }
}

impl Drop for PrefillNode {
    fn drop(&mut self) {
        self.shutdown_inner(true);
    }
}

/// Accepts decoders until told to stop.
async fn serve(server: PrefillServer, sh: Arc<NodeContext>, mut stop: watch::Receiver<bool>) {
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let next = tokio::select! {
            c = server.accept() => c,
            _ = stop.wait_for(|v| *v) => break,
        };
        match next {
            Some(Ok(conn)) => {
                sh.metrics.update(|c| c.connections += 1);
                if let (Some(f), Some(cert)) = (&sh.opts.on_verified, conn.peer().certificate) {
                    (f.0)(cert);
                }
                conns.spawn(serve_connection(conn, sh.clone()));
            }
            Some(Err(e)) => {
                sh.metrics.update(|c| c.handshake_failures += 1);
                tracing::warn!("a decoder could not connect: {e}");
            }
            None => break,
        }
        while conns.try_join_next().is_some() {}
    }
    server.close();
    let n = conns.len();
    if n > 0 {
        tracing::info!(connections = n, "closing decoder connections");
    }
    conns.abort_all();
    while conns.join_next().await.is_some() {}
}

/// One decoder's connection. Each request runs in its own task: a decoder sends its next
/// request as soon as it has `Done`, while the previous request's task may still be waiting for
/// the last acknowledgements (and the compute worker orders the actual work).
async fn serve_connection(mut conn: PrefillConnection, sh: Arc<NodeContext>) {
    let peer = conn.peer().addr;
    let name = conn.peer().node_name.clone();
    let mut errors = 0;
    let mut requests = tokio::task::JoinSet::new();
    loop {
        while requests.try_join_next().is_some() {}
        match conn.next_request().await {
            Ok(Some(req)) => {
                errors = 0;
                requests.spawn(request::handle(sh.clone(), req));
            }
            Ok(None) => {
                tracing::info!(%peer, %name, "decoder disconnected");
                break;
            }
            Err(e @ (TransferError::ConnectionLost { .. } | TransferError::Stalled { .. })) => {
                tracing::info!(%peer, %name, "decoder connection ended: {e}");
                break;
            }
            Err(e) => {
                // Already answered with an Error; the connection stays up unless it keeps failing.
                sh.metrics.update(|c| {
                    c.requests += 1;
                    c.refused += 1;
                });
                tracing::warn!(%peer, %name, "bad request: {e}");
                errors += 1;
                if errors >= 8 {
                    tracing::warn!(%peer, %name, "too many bad requests in a row; closing the connection");
                    conn.close("too many bad requests");
                    break;
                }
            }
        }
    }
    // Requests still running end on their own once the connection is gone.
    while requests.join_next().await.is_some() {}
}
