//! The OpenAI-compatible HTTP server of `k3-decode serve` (axum).
//!
//! - `POST /v1/chat/completions`: K3 chat format in ([`crate::chat::render`]), reasoning,
//!   content and tool calls out ([`crate::chat::parse`]), non-streaming or SSE.
//! - `POST /v1/completions`: a raw prompt (text with special tokens allowed, or token ids).
//! - `POST /v1/messages`, `POST /v1/messages/count_tokens`: the Anthropic Messages API
//!   ([`anthropic`]), translated onto the same chat pipeline.
//! - `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
//!
//! HTTP only: generation runs on the engine thread of [`crate::engine`] (behind its
//! [`crate::engine::GenerationEngine`] trait); requests queue for it through
//! [`crate::engine::EngineHandle`]. Held session states give prefix reuse across turns.
//!
//! This module only wires the router: the OpenAI endpoints are in [`openai`], the Anthropic
//! ones in [`anthropic`], and what both share (server state, admission onto the engine, chat
//! runs) in [`pipeline`], below them.

pub mod anthropic;
pub mod api;
pub mod guard;
pub mod held_responses;
pub mod openai;
pub mod pipeline;
pub mod responses;
pub mod seal;
pub mod session_key;
pub mod stop;

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json as AxJson, Router};
use serde_json::{json, Value};

use api::ApiError;
pub use api::MAX_BODY_BYTES;
pub use pipeline::AppState;

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    let keys: Vec<&str> = state.api_key.iter().chain(&state.more_api_keys).map(String::as_str).collect();
    let guard = Arc::new(guard::Guard::with_keys(&keys, state.guard.clone(), state.metrics.clone()));
    let v1 = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model_info))
        .route("/tokenize", post(openai::tokenize))
        .route_layer(axum::middleware::from_fn_with_state(guard.clone(), guard::check));
    // The Anthropic routes: the same guard (one admission budget), errors in Anthropic's shape.
    let messages = Router::new()
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route_layer(axum::middleware::from_fn_with_state(guard, guard::check))
        .route_layer(axum::middleware::from_fn(anthropic::error_shape));
    Router::new()
        .merge(v1)
        .merge(messages)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn not_found() -> Response {
    ApiError { status: StatusCode::NOT_FOUND, message: "no such endpoint".into(), kind: "invalid_request_error", param: None, code: None }.into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> AxJson<Value> {
    AxJson(json!({"status": "ok", "model": st.model_id}))
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], st.metrics.render()).into_response()
}

/// Binds `addr` and serves until the process ends (or `shutdown` resolves).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.guard.conn_limits();
    guard::serve_limited(listener, router(state), limits, std::time::Duration::from_secs(60), shutdown, Default::default()).await
}
