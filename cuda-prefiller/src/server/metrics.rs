//! Counters of a running prefill node and a short history of its requests, for logs, tests and
//! the `GET /metrics` endpoint ([`openmetrics`]: OpenMetrics text through a prometheus-client
//! registry, `serve --metrics-listen`). Cheap to update from any task.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use serde::Serialize;

use crate::server::sessions::StoreStats;

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum RequestOutcome {
    /// Every layer delivered, `Done` sent.
    Completed,
    /// Refused before any compute (busy, base not held, invalid, too large).
    Refused { code: String, message: String },
    /// Accepted, then failed (decoder gone, cancelled, compute error).
    Failed { reason: String },
}

/// One request, as the node saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    pub request: u64,
    pub peer: String,
    pub session: String,
    /// Tokens the request's base prefix covered (0 without a base).
    pub base_tokens: u64,
    /// Tokens prefilled by this request.
    pub new_tokens: u64,
    pub outcome: RequestOutcome,
    /// Waiting for the compute worker.
    pub queue_s: f64,
    /// Layer compute (waits for the network excluded).
    pub compute_s: f64,
    /// The compute worker blocked because the network was behind.
    pub network_wait_s: f64,
    /// Accepted → Done sent.
    pub total_s: f64,
    pub state_bytes: u64,
    /// Weight streaming of the pass this request rode (CUDA streamer only; shared with the
    /// other requests of the pass).
    pub weights: Option<WeightTiming>,
    /// Requests that shared this request's weight pass (1: alone; 0: it never reached one).
    pub pass_requests: u32,
}

/// What streaming one prompt's weights cost (from [`crate::streamer::StreamStats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct WeightTiming {
    /// Weight bytes copied to the GPU for the prompt.
    pub bytes: u64,
    /// Copy stream busy with them.
    pub transfer_s: f64,
    /// GPU compute of the layers (waits excluded).
    pub gpu_compute_s: f64,
    /// Compute waiting for weights (GPU side, plus the executor thread waiting for the readers).
    pub wait_s: f64,
}

impl WeightTiming {
    pub fn of(s: &crate::streamer::StreamStats) -> Self {
        WeightTiming { bytes: s.bytes as u64, transfer_s: s.copy_s, gpu_compute_s: s.compute_s, wait_s: s.wait_s + s.host_wait_s }
    }
}

/// Counters since start.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Counters {
    pub connections: u64,
    pub handshake_failures: u64,
    pub requests: u64,
    pub completed: u64,
    pub refused: u64,
    pub failed: u64,
    pub tokens_prefilled: u64,
    pub state_bytes_sent: u64,
    pub compute_s: f64,
    /// Requests waiting for the compute worker right now, and the one computing.
    pub in_flight: u64,
    /// Layers whose state went to the network (all requests).
    pub layers_sent: u64,
    /// Sweeps of the executor over the layers (one per weight pass, however many requests shared it).
    pub weight_passes: u64,
    /// Requests that ran in those passes (`pass_requests / weight_passes`: the mean sharing).
    pub pass_requests: u64,
    /// Streamed weights, summed over weight passes (see [`WeightTiming`]).
    pub weight_bytes: u64,
    pub weight_transfer_s: f64,
    pub weight_gpu_compute_s: f64,
    pub weight_wait_s: f64,
}

/// Everything at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricsSnapshot {
    pub counters: Counters,
    pub sessions: StoreStats,
    pub recent: Vec<RequestRecord>,
}

/// Shared by every task of a server.
#[derive(Debug, Default)]
pub struct ServerMetrics {
    inner: Mutex<(Counters, VecDeque<RequestRecord>)>,
}

/// Requests kept in the history.
const RECENT: usize = 256;

impl ServerMetrics {
    pub fn update(&self, f: impl FnOnce(&mut Counters)) {
        if let Ok(mut g) = self.inner.lock() {
            f(&mut g.0);
        }
    }

    pub fn record(&self, r: RequestRecord) {
        if let Ok(mut g) = self.inner.lock() {
            let c = &mut g.0;
            match &r.outcome {
                RequestOutcome::Completed => {
                    c.completed += 1;
                    c.tokens_prefilled += r.new_tokens;
                    c.state_bytes_sent += r.state_bytes;
                }
                RequestOutcome::Refused { .. } => c.refused += 1,
                RequestOutcome::Failed { .. } => c.failed += 1,
            }
            c.compute_s += r.compute_s;
            if g.1.len() == RECENT {
                g.1.pop_front();
            }
            g.1.push_back(r);
        }
    }

    /// One weight pass ran, shared by `requests` requests; `weights`: what its streaming moved.
    pub fn weight_pass(&self, requests: usize, weights: Option<&crate::streamer::StreamStats>) {
        if let Ok(mut g) = self.inner.lock() {
            let c = &mut g.0;
            c.weight_passes += 1;
            c.pass_requests += requests as u64;
            if let Some(w) = weights.map(WeightTiming::of) {
                c.weight_bytes += w.bytes;
                c.weight_transfer_s += w.transfer_s;
                c.weight_gpu_compute_s += w.gpu_compute_s;
                c.weight_wait_s += w.wait_s;
            }
        }
    }

    /// Changes the outcome of a recorded request (a `Completed` one whose delivery then failed).
    pub fn amend(&self, request: u64, peer: &str, outcome: RequestOutcome) {
        if let Ok(mut g) = self.inner.lock() {
            let (c, recent) = &mut *g;
            let Some(r) = recent.iter_mut().rev().find(|r| r.request == request && r.peer == peer) else { return };
            let old = std::mem::replace(&mut r.outcome, outcome.clone());
            if old == RequestOutcome::Completed && outcome != RequestOutcome::Completed {
                c.completed = c.completed.saturating_sub(1);
                c.tokens_prefilled = c.tokens_prefilled.saturating_sub(r.new_tokens);
                c.state_bytes_sent = c.state_bytes_sent.saturating_sub(r.state_bytes);
                c.failed += 1;
            }
        }
    }

    pub fn counters(&self) -> Counters {
        self.inner.lock().map(|g| g.0.clone()).unwrap_or_default()
    }

    pub fn recent(&self) -> Vec<RequestRecord> {
        self.inner.lock().map(|g| g.1.iter().cloned().collect()).unwrap_or_default()
    }
}

/// The node's metrics in the OpenMetrics text format (prefix `k3_prefill_`): counters since
/// start, the session store, and the last request's timing (compute, streamed-weight transfer
/// and waits).
/// `cost`: what the node advertises to decoders (weight pass, compute fit, queue).
pub fn openmetrics(c: &Counters, sessions: &StoreStats, last: Option<&RequestRecord>, cost: Option<&k3_protocol::wire::NodeCost>) -> String {
    let mut r = Registry::with_prefix("k3_prefill");
    let count = |r: &mut Registry, name: &str, help: &str, v: u64| {
        let m: Counter = Counter::default();
        m.inc_by(v);
        r.register(name, help, m);
    };
    let seconds = |r: &mut Registry, name: &str, help: &str, v: f64| {
        let m: Counter<f64, AtomicU64> = Counter::default();
        m.inc_by(v.max(0.0));
        r.register(name, help, m);
    };
    let gauge = |r: &mut Registry, name: &str, help: &str, v: f64| {
        let m: Gauge<f64, AtomicU64> = Gauge::default();
        m.set(v);
        r.register(name, help, m);
    };
    count(&mut r, "connections", "Decoder connections accepted", c.connections);
    count(&mut r, "handshake_failures", "Decoders that could not connect", c.handshake_failures);
    count(&mut r, "requests", "Prefill requests received", c.requests);
    count(&mut r, "requests_completed", "Prefill requests completed", c.completed);
    count(&mut r, "requests_refused", "Prefill requests refused", c.refused);
    count(&mut r, "requests_failed", "Prefill requests failed after acceptance", c.failed);
    count(&mut r, "weight_passes", "Weight passes (sweeps of the executor over the layers; requests waiting together share one)", c.weight_passes);
    count(&mut r, "pass_requests", "Requests run in those weight passes", c.pass_requests);
    count(&mut r, "tokens_prefilled", "Tokens prefilled by completed requests", c.tokens_prefilled);
    count(&mut r, "state_bytes_sent", "Hand-off state bytes delivered", c.state_bytes_sent);
    count(&mut r, "layers_sent", "Layer states sent", c.layers_sent);
    seconds(&mut r, "compute_seconds", "Executor time (network waits excluded)", c.compute_s);
    count(&mut r, "weight_bytes", "Weight bytes streamed to the GPU (once per weight pass)", c.weight_bytes);
    seconds(&mut r, "weight_transfer_seconds", "Copy stream busy with streamed weights", c.weight_transfer_s);
    seconds(&mut r, "weight_gpu_compute_seconds", "GPU compute of streamed layers (waits excluded)", c.weight_gpu_compute_s);
    seconds(&mut r, "weight_wait_seconds", "Compute waiting for streamed weights", c.weight_wait_s);
    gauge(&mut r, "in_flight", "Requests computing or queued", c.in_flight as f64);
    gauge(&mut r, "sessions", "Session prefixes held", sessions.sessions as f64);
    gauge(&mut r, "session_bytes", "Bytes of the held session prefixes", sessions.bytes as f64);
    if let Some(k) = cost {
        gauge(&mut r, "cost_pass_seconds", "Advertised seconds per weight pass from the current source (0: resident)", k.pass_s);
        gauge(&mut r, "cost_pass_bytes", "Weight bytes one pass reads from the source", k.pass_bytes as f64);
        gauge(&mut r, "cost_passes_measured", "Weight passes the advertised pass time was measured over", k.passes as f64);
        gauge(&mut r, "cost_compute_fixed_seconds", "Compute fit: fixed seconds per request", k.compute.fixed_s);
        gauge(&mut r, "cost_compute_seconds_per_token", "Compute fit: seconds per new token at context 0", k.compute.per_token_s);
        gauge(&mut r, "cost_compute_seconds_per_token_per_context", "Compute fit: extra seconds per new token per context token", k.compute.per_token_ctx_s);
        gauge(&mut r, "cost_compute_samples", "Requests the compute fit was made from", k.compute.samples as f64);
        gauge(&mut r, "cost_queue_seconds", "Predicted seconds before a new request would start", k.queue_s);
        gauge(&mut r, "cost_queued", "Requests computing or waiting, as advertised", k.queued as f64);
    }
    if let Some(l) = last {
        gauge(&mut r, "last_request_tokens", "New tokens of the last request", l.new_tokens as f64);
        gauge(&mut r, "last_request_compute_seconds", "Executor time of the last request", l.compute_s);
        if let Some(w) = &l.weights {
            gauge(&mut r, "last_request_weight_transfer_seconds", "Weight transfer of the last request", w.transfer_s);
            gauge(&mut r, "last_request_weight_gpu_compute_seconds", "GPU compute of the last request", w.gpu_compute_s);
            gauge(&mut r, "last_request_weight_wait_seconds", "Waiting for weights in the last request", w.wait_s);
        }
    }
    let mut out = String::new();
    if let Err(e) = encode(&mut out, &r) {
        tracing::warn!("metrics: encoding failed: {e}");
    }
    out
}

/// Time a client of the metrics endpoint has to send a request's headers (the first, or the
/// next on a kept-alive connection); the connection is closed past it, so a client that stalls
/// mid-request or idles holds nothing longer.
pub(crate) const METRICS_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Metrics connections open at once; one more is closed on arrival.
const METRICS_MAX_CONNECTIONS: usize = 32;

const OPENMETRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The endpoint's routes: `GET /metrics` (and `GET /`) render `page`; anything else is 404.
fn metrics_router(page: Arc<dyn Fn() -> String + Send + Sync>) -> axum::Router {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    let render = move || {
        let page = page.clone();
        async move { ([(header::CONTENT_TYPE, OPENMETRICS_TYPE)], page()).into_response() }
    };
    axum::Router::new()
        .route("/metrics", axum::routing::get(render.clone()))
        .route("/", axum::routing::get(render))
        .fallback(|| async { (StatusCode::NOT_FOUND, "only GET /metrics here\n") })
}

/// Serves `GET /metrics` over HTTP/1.1 (hyper, as the decoder's server) until told to stop:
/// a connection that does not deliver a request's headers within [`METRICS_READ_TIMEOUT`] is
/// closed, and at most [`METRICS_MAX_CONNECTIONS`] are open at once. `page` renders the body.
pub(crate) async fn serve_http(listener: tokio::net::TcpListener, page: impl Fn() -> String + Send + Sync + 'static, stop: tokio::sync::watch::Receiver<bool>) {
    serve_router(listener, metrics_router(Arc::new(page)), METRICS_READ_TIMEOUT, stop).await
}

async fn serve_router(listener: tokio::net::TcpListener, app: axum::Router, header_timeout: std::time::Duration, mut stop: tokio::sync::watch::Receiver<bool>) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;

    let mut builder = Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(header_timeout);
    let builder = Arc::new(builder.http1_only());
    let open = Arc::new(tokio::sync::Semaphore::new(METRICS_MAX_CONNECTIONS));
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let (stream, remote) = tokio::select! {
            // (the guard `wait_for` returns is not `Send`: dropped inside)
            _ = async { let _ = stop.wait_for(|v| *v).await; } => break,
            a = listener.accept() => match a {
                Ok(x) => x,
                Err(e) => {
                    // out of descriptors and the like: wait instead of spinning
                    tracing::warn!("metrics: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tracing::debug!(%remote, "metrics: {METRICS_MAX_CONNECTIONS} connections open; closing a new one");
            continue;
        };
        let svc = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        conns.spawn(async move {
            if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
                tracing::debug!(%remote, "metrics connection ended: {e}");
            }
            drop(permit);
        });
    }
    conns.abort_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A metrics client that sends part of its request and stalls is closed after the header
    /// timeout; a request split across packets is answered whole; other paths get 404.
    #[tokio::test]
    async fn a_stalled_metrics_client_is_closed_and_a_split_request_is_answered() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let app = metrics_router(Arc::new(|| "k3_prefill_requests_total 7\n# EOF\n".to_string()));
        let server = tokio::spawn(serve_router(listener, app, std::time::Duration::from_millis(300), stop));
        let read_all = |mut c: tokio::net::TcpStream| async move {
            let mut out = Vec::new();
            let _ = c.read_to_end(&mut out).await;
            String::from_utf8_lossy(&out).into_owned()
        };
        let limit = std::time::Duration::from_secs(20);

        // stalled mid-request: the server closes it without an answer (read_to_end returns)
        let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
        stalled.write_all(b"GET /metr").await.unwrap();
        let got = tokio::time::timeout(limit, read_all(stalled)).await.expect("the stalled connection was closed");
        assert!(!got.contains("k3_prefill_requests_total"), "a partial request was answered: {got}");

        // split across two packets: answered
        let mut split = tokio::net::TcpStream::connect(addr).await.unwrap();
        split.write_all(b"GET /metr").await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        split.write_all(b"ics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let got = tokio::time::timeout(limit, read_all(split)).await.unwrap();
        assert!(got.starts_with("HTTP/1.1 200") && got.contains("openmetrics-text") && got.contains("k3_prefill_requests_total 7"), "{got}");

        let mut other = tokio::net::TcpStream::connect(addr).await.unwrap();
        other.write_all(b"GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let got = tokio::time::timeout(limit, read_all(other)).await.unwrap();
        assert!(got.starts_with("HTTP/1.1 404"), "{got}");

        // a head without end is not buffered without end: the connection is refused or closed
        let mut long = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = long.write_all(&vec![b'a'; 1 << 20]).await;
        let got = tokio::time::timeout(limit, read_all(long)).await.expect("the endless head's connection was closed");
        assert!(!got.contains("200 OK"), "{got}");

        stop_tx.send(true).unwrap();
        tokio::time::timeout(limit, server).await.expect("the server stops when told").unwrap();
    }

    fn record(id: u64, weights: Option<WeightTiming>) -> RequestRecord {
        RequestRecord {
            request: id,
            peer: "p".into(),
            session: "s".into(),
            base_tokens: 0,
            new_tokens: 100,
            outcome: RequestOutcome::Completed,
            queue_s: 0.0,
            compute_s: 2.0,
            network_wait_s: 0.0,
            total_s: 2.5,
            state_bytes: 10,
            weights,
            pass_requests: 1,
        }
    }

    #[test]
    fn streamed_weight_timing_is_summed_per_pass_and_exported() {
        let m = ServerMetrics::default();
        let stats = |bytes, copy_s, compute_s, wait_s| crate::streamer::StreamStats { bytes, copy_s, compute_s, wait_s, ..Default::default() };
        // Two passes: the first shared by requests 1 and 3, the second request 2's alone.
        m.weight_pass(2, Some(&stats(3_000, 0.5, 1.5, 0.25)));
        m.weight_pass(1, Some(&stats(1_000, 0.25, 1.0, 0.5)));
        m.record(record(1, Some(WeightTiming { bytes: 3_000, transfer_s: 0.5, gpu_compute_s: 1.5, wait_s: 0.25 })));
        m.record(record(2, Some(WeightTiming { bytes: 1_000, transfer_s: 0.25, gpu_compute_s: 1.0, wait_s: 0.5 })));
        m.record(record(3, Some(WeightTiming { bytes: 3_000, transfer_s: 0.5, gpu_compute_s: 1.5, wait_s: 0.25 })));
        let c = m.counters();
        assert_eq!((c.completed, c.weight_bytes, c.weight_passes, c.pass_requests), (3, 4_000, 2, 3));
        assert_eq!((c.weight_transfer_s, c.weight_gpu_compute_s, c.weight_wait_s), (0.75, 2.5, 0.75));
        let recent = m.recent();
        let cost = k3_protocol::wire::NodeCost { pass_s: 28.5, queue_s: 3.0, ..Default::default() };
        let text = openmetrics(&c, &StoreStats::default(), recent.iter().rev().nth(1), Some(&cost));
        for line in [
            "k3_prefill_weight_bytes_total 4000",
            "k3_prefill_weight_transfer_seconds_total 0.75",
            "k3_prefill_weight_wait_seconds_total 0.75",
            "k3_prefill_weight_gpu_compute_seconds_total 2.5",
            "k3_prefill_requests_completed_total 3",
            "k3_prefill_weight_passes_total 2",
            "k3_prefill_last_request_weight_wait_seconds 0.5",
            "k3_prefill_last_request_compute_seconds 2.0",
            "k3_prefill_cost_pass_seconds 28.5",
            "k3_prefill_cost_queue_seconds 3.0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        assert!(text.trim_end().ends_with("# EOF"));
    }
}
