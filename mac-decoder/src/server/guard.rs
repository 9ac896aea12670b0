//! HTTP hardening in front of `/v1/*`: authentication, where requests may come from, what they
//! may carry, how long their bodies may take, and how many may run at once.
//!
//! - **API key** (`--api-key` / `K3_API_KEY`): `Authorization: Bearer <key>` (or `x-api-key: <key>`), the scheme name in
//!   any case; the key compared in constant time over SHA-256 digests (neither its length nor a
//!   common prefix shows in the timing); whitespace around the key is not accepted.
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
//!   also bounds the tokens in flight (`--max-tokens-in-flight`, [`crate::server::worker`]):
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

use crate::server::api::ApiError;
use crate::server::metrics::Metrics;

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
        }
    }
}

/// The guard's state: options, the key digest, the admission permits.
pub struct Guard {
    opts: GuardOptions,
    key: Option<[u8; 32]>,
    permits: Arc<Semaphore>,
    metrics: Arc<Metrics>,
}

impl Guard {
    pub fn new(api_key: Option<&str>, opts: GuardOptions, metrics: Arc<Metrics>) -> Guard {
        let permits = Arc::new(Semaphore::new(opts.max_concurrent.max(1)));
        Guard { key: api_key.map(|k| Sha256::digest(k.as_bytes()).into()), opts, permits, metrics }
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

/// Whether `Authorization` carries `key` (digest): scheme `Bearer` in any case, one space; or
/// `x-api-key: <key>` (Anthropic's clients).
fn authorized(req: &Request, key: &[u8; 32]) -> bool {
    let matches = |token: &str| {
        let got: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        got.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    };
    if let Some(token) = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()) {
        return matches(token);
    }
    let Some(v) = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else { return false };
    let Some((scheme, token)) = v.split_once(' ') else { return false };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return false;
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
    let host = if let Some(r) = authority.strip_prefix('[') {
        r.split_once(']')?.0
    } else {
        authority.split(':').next()?
    };
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
                return Err(error(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    format!("Content-Type {ct:?}: send application/json"),
                    "unsupported_media_type",
                ));
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

async fn admit(g: &Arc<Guard>, req: Request, next: Next) -> Response {
    match &g.key {
        Some(key) => {
            if !authorized(&req, key) {
                return refusal(ApiError::unauthorized().into_response(), "unauthorized");
            }
        }
        None => {
            if let Err(r) = g.check_unauthenticated(&req) {
                return refusal(r, "forbidden");
            }
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
                    error(
                        StatusCode::REQUEST_TIMEOUT,
                        format!("the body did not arrive within {:.0} s", g.opts.body_timeout.as_secs_f64()),
                        "body_timeout",
                    ),
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

/// Serves `app` on `listener` until `shutdown` resolves, then lets the requests in progress finish
/// (at most `drain` more). Like `axum::serve`, plus a header read timeout: a connection that
/// does not deliver a request's headers within `header_timeout` (slowloris, idle keep-alive) is
/// closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    header_timeout: Duration,
    drain: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;

    let mut builder = Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(header_timeout);
    let builder = Arc::new(builder.http1_only());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
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
        let _ = stream.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let mut stop = stop_rx.clone();
        conns.spawn(async move {
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%remote, "HTTP connection ended: {e}");
                    }
                    return;
                }
                _ = stop.changed() => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
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
