//! HTTP hardening in front of `/v1/*`: authentication, where requests may come from, what they
//! may carry, how long their bodies may take, and how many may run at once.
//!
//! - **API key** (`--api-key` / `K3_API_KEY`): `Authorization: Bearer <key>` (or `x-api-key: <key>`), the scheme name in
//!   any case; the key compared in constant time over SHA-256 digests (neither its length nor a
//!   common prefix shows in the timing); whitespace around the key is not accepted. With several
//!   keys (`--api-key` repeated, or comma-separated in `K3_API_KEY`) each is compared, and the
//!   request carries which one matched ([`ClientKey`]): every key has its own cache scope (held
//!   prompt states are not shared between keys; [`crate::engine::sessions`]).
//! - **Without an API key** the server trusts its network position, so it refuses what a web
//!   page could send: a `Host` or `Origin` that is not loopback (DNS rebinding, cross-site
//!   requests) unless named with `--allow-host`, and POST bodies that are not
//!   `application/json` (a form or `text/plain` post needs no CORS preflight).
//! - **Body read timeout**: a POST body must arrive within [`GuardOptions::body_timeout`]
//!   (408 otherwise), so a slow sender cannot hold a request slot.
//! - **Header read timeout**: a connection must deliver a request's headers within
//!   [`GuardOptions::header_timeout`] ([`serve`] closes it otherwise; slowloris, idle keep-alive).
//! - **Admission**: at most [`GuardOptions::max_concurrent`] `/v1/*` requests run at once
//!   (streams count until their last event); past that, 429 with `Retry-After`. The engine
//!   also bounds the tokens in flight (`--max-tokens-in-flight`, [`crate::engine::handle`]):
//!   past it, 429 `too_many_tokens` with `Retry-After`.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use crate::metrics::Metrics;
use crate::server::api::ApiError;

/// Settings of the guard.
#[derive(Debug, Clone)]
pub struct GuardOptions {
    /// Extra `Host` / `Origin` host names accepted without an API key (`--allow-host`).
    pub allowed_hosts: Vec<String>,
    /// `/v1/*` requests running at once; more get 429.
    pub max_concurrent: usize,
    /// Time a POST body may take to arrive (`--body-read-timeout`).
    pub body_timeout: Duration,
    /// Time a client may take to send a request's headers, and an idle keep-alive connection
    /// may stay open (`--header-read-timeout`; applied by [`serve`]).
    pub header_timeout: Duration,
    /// Largest body read.
    pub max_body_bytes: usize,
    /// Seconds sent in `Retry-After` with a 429.
    pub retry_after_s: u64,
    /// Open HTTP connections at most (`--max-connections`; 0: [`default_max_connections`]).
    pub max_connections: usize,
    /// Open HTTP connections of one peer address at most (`--max-connections-per-peer`; 0: a
    /// quarter of `max_connections`).
    pub max_connections_per_peer: usize,
}

impl GuardOptions {
    /// The connection limits of [`serve_limited`] these options give.
    pub fn conn_limits(&self) -> ConnLimits {
        let mut l = ConnLimits::new(self.header_timeout);
        if self.max_connections > 0 {
            l.max_connections = self.max_connections;
            l.max_per_peer = (self.max_connections / 4).max(1);
        }
        if self.max_connections_per_peer > 0 {
            l.max_per_peer = self.max_connections_per_peer;
        }
        l
    }
}

impl Default for GuardOptions {
    fn default() -> Self {
        GuardOptions {
            allowed_hosts: Vec::new(),
            max_concurrent: 64,
            body_timeout: Duration::from_secs(30),
            header_timeout: HEADER_READ_TIMEOUT,
            max_body_bytes: crate::server::api::MAX_BODY_BYTES,
            retry_after_s: 2,
            max_connections: 0,
            max_connections_per_peer: 0,
        }
    }
}

/// The guard's state: options, the key digests, the admission permits.
pub struct Guard {
    opts: GuardOptions,
    keys: Vec<[u8; 32]>,
    permits: Arc<Semaphore>,
    metrics: Arc<Metrics>,
}

impl Guard {
    pub fn new(api_key: Option<&str>, opts: GuardOptions, metrics: Arc<Metrics>) -> Guard {
        Self::with_keys(&api_key.into_iter().collect::<Vec<_>>(), opts, metrics)
    }

    /// A guard accepting any of `keys` (none: the unauthenticated checks).
    pub fn with_keys(keys: &[&str], opts: GuardOptions, metrics: Arc<Metrics>) -> Guard {
        let permits = Arc::new(Semaphore::new(opts.max_concurrent.max(1)));
        Guard { keys: keys.iter().map(|k| Sha256::digest(k.as_bytes()).into()).collect(), opts, permits, metrics }
    }

    /// Requests admitted and not finished.
    pub fn in_flight(&self) -> usize {
        self.opts.max_concurrent.max(1) - self.permits.available_permits()
    }
}

fn error(status: StatusCode, message: String, code: &'static str) -> Response {
    let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
    ApiError { status, message, kind, param: None, code: Some(code) }.into_response()
}

/// Which API key a request authenticated with, when the server has several (a request
/// extension the guard sets; the handlers put it in the request's cache scope). Its value is a
/// digest of the key, never the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientKey(pub String);

/// Which of `keys` (digests) `Authorization` carries, if any: scheme `Bearer` in any case, one
/// space; or `x-api-key: <key>` (Anthropic's clients). Every key is compared, each in constant
/// time.
fn authorized(req: &Request, keys: &[[u8; 32]]) -> Option<usize> {
    let matches = |token: &str| {
        let got: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        keys.iter().enumerate().fold(None, |found, (i, key)| {
            let same = got.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
            if same {
                Some(i)
            } else {
                found
            }
        })
    };
    if let Some(token) = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()) {
        return matches(token);
    }
    let v = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok())?;
    let (scheme, token) = v.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    matches(token)
}

/// The host part of a `Host` value or an `Origin` URL, lowercased, without port or brackets.
fn host_of(v: &str) -> Option<String> {
    let v = v.trim();
    let rest = match v.split_once("://") {
        Some((_, r)) => r,
        None => v,
    };
    let authority = rest.split('/').next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let host = if let Some(r) = authority.strip_prefix('[') { r.split_once(']')?.0 } else { authority.split(':').next()? };
    (!host.is_empty()).then(|| host.to_ascii_lowercase())
}

fn loopback_host(h: &str) -> bool {
    h == "localhost" || h.ends_with(".localhost") || h.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl Guard {
    fn host_allowed(&self, h: &str) -> bool {
        loopback_host(h) || self.opts.allowed_hosts.iter().any(|a| a.eq_ignore_ascii_case(h))
    }

    /// The checks made without an API key: loopback Host and Origin, JSON bodies.
    fn check_unauthenticated(&self, req: &Request) -> Result<(), Response> {
        // one Host and at most one Origin: with two, only the first was checked
        for name in [header::HOST, header::ORIGIN] {
            if req.headers().get_all(&name).iter().count() > 1 {
                return Err(error(StatusCode::BAD_REQUEST, format!("the request has more than one {name} header"), "duplicate_header"));
            }
        }
        let host = req.headers().get(header::HOST).and_then(|v| v.to_str().ok()).and_then(host_of);
        match host {
            Some(h) if self.host_allowed(&h) => {}
            other => {
                return Err(error(
                    StatusCode::FORBIDDEN,
                    format!(
                        "Host {:?} is not loopback; without an API key only loopback hosts are served \
                         (set --api-key, or name the host with --allow-host)",
                        other.unwrap_or_default()
                    ),
                    "host_not_allowed",
                ))
            }
        }
        if let Some(origin) = req.headers().get(header::ORIGIN) {
            let o = origin.to_str().ok().and_then(host_of);
            if !o.as_deref().is_some_and(|h| self.host_allowed(h)) {
                return Err(error(
                    StatusCode::FORBIDDEN,
                    format!("Origin {origin:?} is not loopback; without an API key cross-origin requests are refused"),
                    "origin_not_allowed",
                ));
            }
        }
        if req.method() == Method::POST {
            let ct = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
            let media = ct.split(';').next().unwrap_or("").trim();
            if !media.eq_ignore_ascii_case("application/json") {
                return Err(error(StatusCode::UNSUPPORTED_MEDIA_TYPE, format!("Content-Type {ct:?}: send application/json"), "unsupported_media_type"));
            }
        }
        Ok(())
    }
}

/// The middleware (`axum::middleware::from_fn_with_state(guard, guard::check)`).
pub async fn check(State(g): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    let resp = admit(&g, req, next).await;
    let status = resp.status();
    if status.is_client_error() || status == StatusCode::SERVICE_UNAVAILABLE {
        if let Some(kind) = resp.extensions().get::<GuardRefusal>() {
            g.metrics.error(kind.0);
        }
    }
    resp
}

/// Marks a response the guard itself gave (its metrics label).
#[derive(Clone, Copy)]
struct GuardRefusal(&'static str);

fn refusal(mut r: Response, kind: &'static str) -> Response {
    r.extensions_mut().insert(GuardRefusal(kind));
    r
}

async fn admit(g: &Arc<Guard>, mut req: Request, next: Next) -> Response {
    if g.keys.is_empty() {
        if let Err(r) = g.check_unauthenticated(&req) {
            return refusal(r, "forbidden");
        }
    } else {
        let Some(i) = authorized(&req, &g.keys) else {
            return refusal(ApiError::unauthorized().into_response(), "unauthorized");
        };
        if g.keys.len() > 1 {
            let d = Sha256::digest([b"k3-offload client key\n".as_slice(), &g.keys[i]].concat());
            req.extensions_mut().insert(ClientKey(d.iter().map(|b| format!("{b:02x}")).collect()));
        }
    }
    let Ok(permit) = g.permits.clone().try_acquire_owned() else {
        let mut r = error(
            StatusCode::TOO_MANY_REQUESTS,
            format!("{} requests are running, the most this server admits; retry later", g.opts.max_concurrent),
            "too_many_requests",
        );
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(g.opts.retry_after_s));
        return refusal(r, "too_many_requests");
    };
    let req = if req.method() == Method::POST {
        let (parts, body) = req.into_parts();
        match tokio::time::timeout(g.opts.body_timeout, axum::body::to_bytes(body, g.opts.max_body_bytes)).await {
            Ok(Ok(bytes)) => Request::from_parts(parts, Body::from(bytes)),
            Ok(Err(e)) => {
                return refusal(error(StatusCode::PAYLOAD_TOO_LARGE, format!("reading the body: {e}"), "body_too_large"), "body_too_large");
            }
            Err(_) => {
                return refusal(
                    error(StatusCode::REQUEST_TIMEOUT, format!("the body did not arrive within {:.0} s", g.opts.body_timeout.as_secs_f64()), "body_timeout"),
                    "body_timeout",
                );
            }
        }
    } else {
        req
    };
    let resp = next.run(req).await;
    // The permit lives as long as the response body (a stream holds it to its last event).
    let (parts, body) = resp.into_parts();
    let body = Body::from_stream(body.into_data_stream().map(move |chunk| {
        let _held = &permit;
        chunk
    }));
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_parsing() {
        assert_eq!(host_of("127.0.0.1:8080").as_deref(), Some("127.0.0.1"));
        assert_eq!(host_of("[::1]:80").as_deref(), Some("::1"));
        assert_eq!(host_of("http://LOCALHOST:3000").as_deref(), Some("localhost"));
        assert_eq!(host_of("https://evil.example/path").as_deref(), Some("evil.example"));
        assert_eq!(host_of("http://127.0.0.1.evil.example").as_deref(), Some("127.0.0.1.evil.example"));
        assert!(loopback_host("127.0.0.2") && loopback_host("::1") && loopback_host("localhost"));
        assert!(!loopback_host("127.0.0.1.evil.example") && !loopback_host("10.0.0.1") && !loopback_host("null"));
    }
}

/// Time a client may take to send a request's headers (and an idle keep-alive connection may stay
/// open without starting its next request).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How many HTTP connections [`serve`] keeps open, and how long idle ones may stay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Open connections at most (`--max-connections`).
    pub max_connections: usize,
    /// Open connections of one peer address at most (`--max-connections-per-peer`).
    pub max_per_peer: usize,
    /// The header read timeout (`--header-read-timeout`).
    pub header_timeout: Duration,
    /// The header read timeout of a connection accepted while more than half of
    /// `max_connections` are open (under pressure idle connections are closed sooner).
    pub pressured_header_timeout: Duration,
}

impl ConnLimits {
    /// The defaults for `header_timeout`: [`default_max_connections`], a quarter of them per
    /// peer, 2 s (or less) to send headers under pressure.
    pub fn new(header_timeout: Duration) -> Self {
        let max = default_max_connections();
        ConnLimits {
            max_connections: max,
            max_per_peer: (max / 4).max(1),
            header_timeout,
            pressured_header_timeout: header_timeout.min(Duration::from_secs(2)),
        }
    }
}

/// Connections the server keeps open by default: 4,096, or, when the process's descriptor limit
/// (`RLIMIT_NOFILE`) is lower, three quarters of it less 64 (the model's files, the engine, the
/// prefill link and the listener keep theirs), at least 16. Past it the server never runs out
/// of descriptors, so `accept` keeps working.
pub fn default_max_connections() -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 { lim.rlim_cur } else { 1024 };
    let fit = (soft.saturating_mul(3) / 4).saturating_sub(64).max(16);
    fit.min(4096) as usize
}

/// One open connection, as [`serve`] tracks it.
struct Conn {
    peer: IpAddr,
    /// Milliseconds since the server started, of the connection's last read or write.
    last_activity: std::sync::atomic::AtomicU64,
    /// Requests in progress (from their head to the end of their response body).
    busy: std::sync::atomic::AtomicUsize,
    /// Told to close (evicted to make room).
    evict: tokio::sync::Notify,
}

/// The open connections: which to close to make room.
struct ConnTable {
    start: std::time::Instant,
    conns: std::sync::Mutex<std::collections::HashMap<u64, Arc<Conn>>>,
    evicted: std::sync::atomic::AtomicU64,
    refused: std::sync::atomic::AtomicU64,
}

impl ConnTable {
    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Makes room for a connection from `peer`: when the server or the peer is at its limit,
    /// the idle connection (no request in progress) with the oldest activity — of that peer
    /// when the peer is at its limit — is told to close. False when there is no room and
    /// nothing idle to close (the new connection is refused).
    fn admit(&self, id: u64, peer: IpAddr, limits: &ConnLimits) -> Option<(Arc<Conn>, usize)> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        let of_peer = conns.values().filter(|c| c.peer == peer).count();
        let full = conns.len() >= limits.max_connections;
        let peer_full = of_peer >= limits.max_per_peer;
        if full || peer_full {
            let victim = conns
                .iter()
                .filter(|(_, c)| c.busy.load(Relaxed) == 0 && (!peer_full || c.peer == peer))
                .min_by_key(|(_, c)| c.last_activity.load(Relaxed))
                .map(|(id, _)| *id);
            match victim.and_then(|v| conns.remove(&v)) {
                Some(c) => {
                    c.evict.notify_one();
                    self.evicted.fetch_add(1, Relaxed);
                }
                None => {
                    self.refused.fetch_add(1, Relaxed);
                    return None;
                }
            }
        }
        let c = Arc::new(Conn {
            peer,
            last_activity: std::sync::atomic::AtomicU64::new(self.now_ms()),
            busy: std::sync::atomic::AtomicUsize::new(0),
            evict: tokio::sync::Notify::new(),
        });
        conns.insert(id, c.clone());
        Some((c, conns.len()))
    }

    fn remove(&self, id: u64) {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }
}

/// A connection's stream, marking its activity on every read and write.
struct Tracked {
    inner: tokio::net::TcpStream,
    conn: Arc<Conn>,
    table: Arc<ConnTable>,
}

impl Tracked {
    fn touch(&self) {
        self.conn.last_activity.store(self.table.now_ms(), std::sync::atomic::Ordering::Relaxed);
    }
}

impl tokio::io::AsyncRead for Tracked {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl tokio::io::AsyncWrite for Tracked {
    fn poll_write(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>, b: &[u8]) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.inner).poll_write(cx, b);
        if matches!(r, std::task::Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }
    fn poll_flush(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// What [`serve_limited`] did to keep within its [`ConnLimits`].
#[derive(Debug, Clone, Default)]
pub struct ConnCounts {
    pub evicted: Arc<std::sync::atomic::AtomicU64>,
    pub refused: Arc<std::sync::atomic::AtomicU64>,
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets the requests in progress finish
/// (at most `drain` more). Like `axum::serve`, plus a header read timeout: a connection that
/// does not deliver a request's headers within `header_timeout` (slowloris, idle keep-alive) is
/// closed. Connections within [`ConnLimits::new`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    header_timeout: Duration,
    drain: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_limited(listener, app, ConnLimits::new(header_timeout), drain, shutdown, ConnCounts::default()).await
}

/// [`serve`] within `limits`: at most `max_connections` open (`max_per_peer` of one address);
/// a connection past a limit closes the idle one with the oldest activity to make room (or is
/// refused when every one has a request in progress), and connections accepted while more
/// than half of the limit are open get the shorter `pressured_header_timeout`. So idle
/// connections, however many are opened, neither exhaust the descriptors nor keep a new
/// client (`/health`) out. `counts` tells the evictions and refusals.
pub async fn serve_limited(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    drain: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    counts: ConnCounts,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;

    let builder_with = |timeout: Duration| {
        let mut builder = Builder::new(TokioExecutor::new());
        builder.http1().timer(TokioTimer::new()).header_read_timeout(timeout);
        Arc::new(builder.http1_only())
    };
    let (relaxed, pressured) = (builder_with(limits.header_timeout), builder_with(limits.pressured_header_timeout));
    let table = Arc::new(ConnTable { start: std::time::Instant::now(), conns: Default::default(), evicted: Default::default(), refused: Default::default() });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    let mut next_id = 0u64;
    tokio::pin!(shutdown);
    loop {
        let (stream, remote) = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors and the like: wait instead of spinning.
                    tracing::warn!("accepting an HTTP connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        next_id += 1;
        let id = next_id;
        let admitted = table.admit(id, remote.ip(), &limits);
        counts.evicted.store(table.evicted.load(std::sync::atomic::Ordering::Relaxed), std::sync::atomic::Ordering::Relaxed);
        counts.refused.store(table.refused.load(std::sync::atomic::Ordering::Relaxed), std::sync::atomic::Ordering::Relaxed);
        let Some((conn, open)) = admitted else {
            tracing::debug!(%remote, "HTTP connection refused: every open connection has a request in progress");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let busy = conn.clone();
        let app = app.clone().layer(axum::middleware::from_fn(move |req: Request, next: Next| {
            let busy = busy.clone();
            async move {
                struct Busy(Arc<Conn>);
                impl Drop for Busy {
                    fn drop(&mut self) {
                        self.0.busy.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                busy.busy.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let held = Busy(busy);
                let (parts, body) = next.run(req).await.into_parts();
                // busy until the response body's last chunk (a stream is not idle)
                let body = Body::from_stream(body.into_data_stream().map(move |chunk| {
                    let _held = &held;
                    chunk
                }));
                Response::from_parts(parts, body)
            }
        }));
        let svc = TowerToHyperService::new(app);
        let builder = if open * 2 > limits.max_connections { pressured.clone() } else { relaxed.clone() };
        let mut stop = stop_rx.clone();
        let io = Tracked { inner: stream, conn: conn.clone(), table: table.clone() };
        let table = table.clone();
        conns.spawn(async move {
            let conn_fut = builder.serve_connection_with_upgrades(TokioIo::new(io), svc);
            tokio::pin!(conn_fut);
            tokio::select! {
                r = conn_fut.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%remote, "HTTP connection ended: {e}");
                    }
                    table.remove(id);
                    return;
                }
                _ = conn.evict.notified() => {
                    tracing::debug!(%remote, "idle HTTP connection closed to make room");
                    return;
                }
                _ = stop.changed() => conn_fut.as_mut().graceful_shutdown(),
            }
            let _ = conn_fut.await;
            table.remove(id);
        });
    }
    let _ = stop_tx.send(true);
    let open = conns.len();
    if open > 0 {
        tracing::info!(connections = open, "waiting for the requests in progress to finish");
    }
    if tokio::time::timeout(drain, async { while conns.join_next().await.is_some() {} }).await.is_err() {
        tracing::warn!(connections = conns.len(), "requests still running after {:.0} s; closing them", drain.as_secs_f64());
        conns.abort_all();
    }
    Ok(())
}
