//! The OpenAI-compatible HTTP server of `k3-decode serve` (axum).
//!
//! - `POST /v1/chat/completions`: K3 chat format in ([`crate::chat::render`]), reasoning,
//!   content and tool calls out ([`crate::chat::parse`]), non-streaming or SSE.
//! - `POST /v1/completions`: a raw prompt (text with special tokens allowed, or token ids).
//! - `POST /v1/messages`, `POST /v1/messages/count_tokens`: the Anthropic Messages API
//!   ([`anthropic`]), translated onto the same chat pipeline.
//! - `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text).
//!
//! Generation runs on one engine thread ([`worker`]) behind the [`engine::GenerationEngine`]
//! trait; requests queue for it. Held session states give prefix reuse across turns.

pub mod anthropic;
pub mod api;
pub mod context;
pub mod engine;
pub mod guard;
pub mod metrics;
#[cfg(feature = "mlx")]
pub mod mlx_engine;
#[cfg(feature = "mlx")]
pub mod ranks;
pub mod sessions;
pub mod stop;
pub mod worker;

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json as AxJson, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::chat::constrain::Grammars;
use crate::chat::grammar::{GrammarError, ReplyShape};
use crate::chat::parse::{FinishReason, OutputEvent, OutputParser, ToolCall};
use crate::chat::render::render;
use crate::generate::Emitted;
use crate::sampler::TokenConstraint;
use crate::tokenizer::Tokenizer;
use api::{ApiError, ChatRequest, GenSettings, Prompt};
use metrics::Metrics;
use sessions::MediaKey;
use stop::StopStrings;
use crate::generate;
use worker::{EngineHandle, GenEvent, GenJob, JobEvents, JobImage};

/// Largest request body: a data-URL image of [`api::MAX_IMAGE_BYTES`] is 4/3 of it in base64.
pub const MAX_BODY_BYTES: usize = api::MAX_IMAGE_BYTES / 3 * 4 + (8 << 20);

/// Shared server state.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub metrics: Arc<Metrics>,
    /// The model id clients send.
    pub model_id: String,
    /// Required bearer token for `/v1/*`, if set.
    pub api_key: Option<String>,
    /// Default `max_tokens` of chat completions (bounded by the context).
    pub default_chat_max_tokens: usize,
    /// HTTP hardening of `/v1/*` (see [`guard`]).
    pub guard: guard::GuardOptions,
    counter: AtomicU64,
    /// When the server started (the model's `created`).
    created: u64,
    /// Constrained decoding's view of the tokenizer, built on first use.
    grammars: OnceLock<Result<Arc<Grammars>, Arc<GrammarError>>>,
}

impl AppState {
    pub fn new(engine: EngineHandle, tokenizer: Arc<Tokenizer>, metrics: Arc<Metrics>, model_id: String, api_key: Option<String>) -> Self {
        AppState { engine, tokenizer, metrics, model_id, api_key, default_chat_max_tokens: 4096, guard: Default::default(), counter: AtomicU64::new(0), created: now_secs(), grammars: OnceLock::new() }
    }

    /// A constraint enforcing `shape` (built off the async threads: the first call builds the
    /// token trie of the whole vocabulary). A grammar that cannot be built is the client's
    /// schema: a 400.
    async fn constraint(self: &Arc<Self>, shape: ReplyShape, thinking: bool) -> Result<Box<dyn TokenConstraint + Send>, ApiError> {
        let st = self.clone();
        tokio::task::spawn_blocking(move || {
            let grammars = st
                .grammars
                .get_or_init(|| {
                    let t = std::time::Instant::now();
                    let g = Grammars::new(st.tokenizer.clone()).map(Arc::new).map_err(Arc::new);
                    tracing::info!(seconds = t.elapsed().as_secs_f64(), "constrained decoding ready (token trie built)");
                    g
                })
                .clone()
                .map_err(|e| ApiError::internal(format!("constrained decoding is unavailable: {e}")))?;
            let c = grammars.constraint(&shape, thinking).map_err(|e| {
                let param = if matches!(shape, ReplyShape::ToolCalls { .. }) { "tools" } else { "response_format" };
                ApiError::bad_request(format!("the reply cannot be constrained: {e}"), Some(param))
            })?;
            Ok(Box::new(c) as Box<dyn TokenConstraint + Send>)
        })
        .await
        .map_err(|e| ApiError::internal(format!("building the grammar stopped: {e}")))?
    }

    fn next_id(&self) -> u64 {
        self.counter.fetch_add(1, Ordering::Relaxed)
    }

    fn seed(&self, n: u64) -> u64 {
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    let guard = Arc::new(guard::Guard::new(state.api_key.as_deref(), state.guard.clone(), state.metrics.clone()));
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_info))
        .route("/tokenize", post(tokenize))
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

fn model_card(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "k3-offload", "max_model_len": st.engine.max_context})
}

/// Whether a request comes from an Anthropic client (they send `anthropic-version`).
fn anthropic_client(headers: &axum::http::HeaderMap) -> bool {
    headers.contains_key("anthropic-version")
}

async fn models(State(st): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> AxJson<Value> {
    st.metrics.request("models");
    if anthropic_client(&headers) {
        return AxJson(json!({"data": [anthropic::model_card(&st)], "has_more": false, "first_id": st.model_id, "last_id": st.model_id}));
    }
    AxJson(json!({"object": "list", "data": [model_card(&st)]}))
}

async fn model_info(State(st): State<Arc<AppState>>, headers: axum::http::HeaderMap, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    st.metrics.request("models");
    if id != st.model_id {
        let resp = fail(&st, ApiError::not_found_model(&id));
        return if anthropic_client(&headers) { anthropic::reshape_error(resp).await } else { resp };
    }
    if anthropic_client(&headers) {
        return AxJson(anthropic::model_card(&st)).into_response();
    }
    AxJson(model_card(&st)).into_response()
}

/// `POST /tokenize` (vLLM's shape): a chat request's prompt (`messages`, tools, kwargs) or a raw
/// `prompt` → `{"count", "max_model_len", "tokens", "token_strs"?}`, plus for chat requests the
/// rendered `text` and `segments` (`[[string, is_special], ...]`).
async fn tokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    st.metrics.request("tokenize");
    match off_runtime({
        let st = st.clone();
        move || {
            let v = api::parse_body(&body)?;
            let strs = v.get("return_token_strs").is_some_and(|b| matches!(b, crate::chat::Json::Bool(true)));
            let mut out = if v.get("messages").is_some() {
                let req = api::chat_request(&v, &st.model_id, 0)?;
                api::render_json(&st.tokenizer, &req)?
            } else {
                match v.get("prompt").and_then(crate::chat::Json::as_str) {
                    Some(p) => match st.tokenizer.encode(p, true) {
                        Ok(ids) => json!({"ids": ids}),
                        Err(e) => return Err(ApiError::bad_request(format!("tokenizing the prompt: {e}"), Some("prompt"))),
                    },
                    None => return Err(ApiError::bad_request("give `messages` (a chat request) or a string `prompt`", Some("prompt"))),
                }
            };
            let ids: Vec<u32> = out["ids"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect()).unwrap_or_default();
            out["count"] = json!(ids.len());
            out["max_model_len"] = json!(st.engine.max_context);
            if strs {
                out["token_strs"] = json!(ids.iter().map(|&i| st.tokenizer.decode(&[i])).collect::<Vec<_>>());
            }
            out["tokens"] = json!(ids);
            if let Some(o) = out.as_object_mut() {
                o.remove("ids");
            }
            Ok(out)
        }
    })
    .await
    {
        Ok(out) => AxJson(out).into_response(),
        Err(e) => fail(&st, e),
    }
}

/// The error response of a refused request (counted, logged); a 429 says when to retry
/// (`Retry-After`, the guard's setting).
fn fail(st: &AppState, e: ApiError) -> Response {
    st.metrics.error(e.metric_kind());
    tracing::info!(status = e.status.as_u16(), message = %e.message, "request refused");
    let busy = e.status == StatusCode::TOO_MANY_REQUESTS;
    let mut r = e.into_response();
    if busy {
        r.headers_mut().insert(header::RETRY_AFTER, axum::http::HeaderValue::from(st.guard.retry_after_s));
    }
    r
}

/// Runs a request's CPU-heavy preparation (JSON parsing, base64 and image decoding, rendering,
/// tokenizing: seconds for a body of tens of MB) on tokio's blocking pool, so a large body does
/// not hold one of the few async workers that every other request (`/health`, streams) needs.
async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("request preparation stopped: {e}")))?
}

/// Resolves `max_tokens` against the context and queues the job.
fn start(
    st: &AppState,
    prompt: &[u32],
    images: Vec<JobImage>,
    gen: &GenSettings,
    default_max: usize,
    constraint: Option<Box<dyn TokenConstraint + Send>>,
) -> Result<(JobEvents, usize), ApiError> {
    let ctx = st.engine.max_context;
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty", Some("prompt")));
    }
    if prompt.len() >= ctx {
        return Err(ApiError::bad_request(
            format!("the prompt is {} tokens; this model's context is {ctx} tokens", prompt.len()),
            Some("messages"),
        )
        .with_code("context_length_exceeded"));
    }
    let room = ctx - prompt.len();
    let max_tokens = match gen.max_tokens {
        Some(m) if m > room => {
            return Err(ApiError::bad_request(
                format!("prompt ({} tokens) + max_tokens ({m}) exceeds the context of {ctx} tokens", prompt.len()),
                Some("max_tokens"),
            )
            .with_code("context_length_exceeded"))
        }
        Some(m) => m,
        None => default_max.min(room),
    };
    let mut stop_ids = vec![];
    if let Some(i) = st.tokenizer.special_id(crate::tokenizer::names::END_OF_MSG) {
        stop_ids.push(i);
    }
    if let Some(i) = st.tokenizer.special_id(crate::tokenizer::names::EOS) {
        stop_ids.push(i);
    }
    let rx = st
        .engine
        .submit(GenJob { prompt: prompt.to_vec(), images, max_tokens, sampling: gen.sampling.clone(), stop_ids, constraint, logprobs: gen.logprobs })
        .map_err(|e| match e {
            worker::SubmitError::Busy { .. } => {
                ApiError { status: StatusCode::TOO_MANY_REQUESTS, message: e.to_string(), kind: "invalid_request_error", param: None, code: Some("too_many_tokens") }
            }
            e => ApiError::unavailable(e.to_string()),
        })?;
    Ok((rx, max_tokens))
}

fn usage(prompt: usize, completion: usize, reused: usize, reasoning: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reused},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    })
}

fn tool_call_json(t: &ToolCall) -> Value {
    json!({"index": t.index, "id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}})
}

/// Drives one chat generation: parses ids into events, applies stop strings to the content.
struct ChatRun {
    parser: OutputParser,
    stops: StopStrings,
    tokens: Vec<u32>,
    reused: usize,
    stopped_by_string: bool,
    /// Per-token log-probabilities (OpenAI's `logprobs.content` entries), when asked for.
    logprobs: Option<LogprobLog>,
}

/// Log-probability entries of the generated tokens; `sent` of them went out in stream chunks.
struct LogprobLog {
    tok: Arc<Tokenizer>,
    entries: Vec<Emitted>,
    sent: usize,
}

impl LogprobLog {
    fn new(tok: Arc<Tokenizer>) -> Self {
        LogprobLog { tok, entries: Vec::new(), sent: 0 }
    }

    /// A token's text and bytes (special tokens by name).
    fn piece(&self, id: u32) -> (String, Vec<u8>) {
        match self.tok.token_bytes(id) {
            Some(b) if !self.tok.is_special(id) => (String::from_utf8_lossy(b).into_owned(), b.to_vec()),
            _ => {
                let s = self.tok.decode(&[id]);
                let b = s.clone().into_bytes();
                (s, b)
            }
        }
    }

    /// Chat entries: `{"token", "logprob", "bytes", "top_logprobs": [...]}`.
    fn chat(&self, from: usize) -> Value {
        let entries: Vec<Value> = self.entries[from..]
            .iter()
            .map(|e| {
                let (t, b) = self.piece(e.token);
                let top: Vec<Value> = e
                    .top
                    .iter()
                    .map(|&(id, lp)| {
                        let (t, b) = self.piece(id);
                        json!({"token": t, "logprob": lp, "bytes": b})
                    })
                    .collect();
                json!({"token": t, "logprob": e.logprob, "bytes": b, "top_logprobs": top})
            })
            .collect();
        json!({"content": entries})
    }

    /// Legacy completions shape: `tokens`, `token_logprobs`, `top_logprobs` (a map per token).
    fn legacy(&self, from: usize, text_offset: usize) -> Value {
        let mut tokens = Vec::new();
        let mut lps = Vec::new();
        let mut tops = Vec::new();
        let mut offsets = Vec::new();
        let mut off = text_offset;
        for e in &self.entries[from..] {
            let (t, _) = self.piece(e.token);
            offsets.push(off);
            off += t.len();
            tokens.push(t);
            lps.push(e.logprob);
            let mut m = serde_json::Map::new();
            for &(id, lp) in &e.top {
                m.insert(self.piece(id).0, json!(lp));
            }
            tops.push(Value::Object(m));
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }

    /// The chat entries not yet streamed (marks them sent); None when there are none.
    fn take_chat(&mut self) -> Option<Value> {
        if self.sent == self.entries.len() {
            return None;
        }
        let v = self.chat(self.sent);
        self.sent = self.entries.len();
        Some(v)
    }
}

/// One step of a chat run, for the response writer.
enum ChatStep {
    Events(Vec<OutputEvent>),
    /// The finish reason and the last events (held-back text).
    Finished(FinishReason, Vec<OutputEvent>),
}

impl ChatRun {
    /// Handles one engine event; `None` when the event needs no output.
    fn on(&mut self, ev: GenEvent) -> Result<Option<ChatStep>, ApiError> {
        match ev {
            GenEvent::Prefilled { reused_tokens, .. } => {
                self.reused = reused_tokens;
                Ok(None)
            }
            GenEvent::Token(e) => {
                let t = e.token;
                self.tokens.push(t);
                if let Some(l) = self.logprobs.as_mut() {
                    l.entries.push(e);
                }
                let evs = self.parser.push(t);
                let evs = self.filter(evs);
                if self.stopped_by_string {
                    let mut evs = evs;
                    evs.extend(self.filter_tail(FinishReason::Stop));
                    return Ok(Some(ChatStep::Events(evs)));
                }
                Ok(Some(ChatStep::Events(evs)))
            }
            GenEvent::Done { finish, .. } => {
                let reason = match finish {
                    generate::FinishReason::Length => FinishReason::Length,
                    _ => FinishReason::Stop,
                };
                let tail = self.filter_tail(reason);
                let r = self.parser.output().finish_reason.unwrap_or(reason);
                Ok(Some(ChatStep::Finished(r, tail)))
            }
            GenEvent::Error(e) => Err(ApiError::internal(format!("generation failed: {e}"))),
        }
    }

    /// Applies stop strings to content events.
    fn filter(&mut self, evs: Vec<OutputEvent>) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        for e in evs {
            match e {
                OutputEvent::Content(c) => {
                    if self.stops.hit() {
                        continue;
                    }
                    let s = self.stops.push(&c);
                    if !s.is_empty() {
                        out.push(OutputEvent::Content(s));
                    }
                    if self.stops.hit() {
                        self.stopped_by_string = true;
                    }
                }
                other if !self.stops.hit() => out.push(other),
                _ => {}
            }
        }
        out
    }

    /// Ends the parser (if the engine did not already) and flushes held text.
    fn filter_tail(&mut self, reason: FinishReason) -> Vec<OutputEvent> {
        let evs = self.parser.finish(reason);
        let mut out = self.filter(evs);
        if !self.stops.hit() {
            let rest = self.stops.finish();
            if !rest.is_empty() {
                out.push(OutputEvent::Content(rest));
            }
        }
        out
    }
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    st.metrics.request("chat_completions");
    let n = st.next_id();
    let req = match off_runtime({
        let st = st.clone();
        move || api::chat_request(&api::parse_body(&body)?, &st.model_id, st.seed(n))
    })
    .await
    {
        Ok(r) => r,
        Err(e) => return fail(&st, e),
    };
    let job = match start_chat(&st, &req, &format!("call_{:x}{:04x}", now_secs(), n & 0xffff)).await {
        Ok(j) => j,
        Err(e) => return fail(&st, e),
    };
    let id = format!("chatcmpl-{:x}{:04x}", now_secs(), n & 0xffff);
    if req.gen.stream {
        chat_stream(st, job, id, req.model, req.gen).await
    } else {
        chat_whole(st, job, id, req.model, req.gen).await
    }
}

/// A chat request on the engine: its prompt and one generation per choice.
struct ChatJob {
    prompt: Vec<u32>,
    /// Per choice: its engine events (`None` once the choice is finished or cancelled:
    /// dropping the receiver cancels its generation) and its run.
    events: Vec<Option<JobEvents>>,
    runs: Vec<ChatRun>,
}

impl ChatJob {
    /// The next engine event of any unfinished choice: `(choice, event)`, where the event is
    /// `None` if the engine dropped that choice's channel. `None` when every choice is done.
    async fn next(&mut self) -> Option<(usize, Option<GenEvent>)> {
        next_event(&mut self.events).await
    }

    /// [`Self::next`], or `Err(())` as soon as `out` (the client's stream) is closed: the
    /// client is gone, and dropping the job cancels every choice.
    async fn next_for<T>(&mut self, out: &mpsc::UnboundedSender<T>) -> Result<Option<(usize, Option<GenEvent>)>, ()> {
        tokio::select! {
            got = self.next() => Ok(got),
            _ = out.closed() => Err(()),
        }
    }

    /// Ends choice `i` (drops its receiver: the engine stops generating it).
    fn close(&mut self, i: usize) {
        self.events[i] = None;
    }
}

/// The next engine event of any open receiver of `events`: `(index, event)`, where the event
/// is `None` if the engine dropped that channel. `None` when every receiver is closed.
async fn next_event(events: &mut [Option<JobEvents>]) -> Option<(usize, Option<GenEvent>)> {
    let waiting: Vec<_> =
        events.iter_mut().enumerate().filter_map(|(i, rx)| rx.as_mut().map(|rx| Box::pin(async move { (i, rx.recv().await) }))).collect();
    if waiting.is_empty() {
        return None;
    }
    let (got, _, _) = futures_util::future::select_all(waiting).await;
    Some(got)
}

/// Queues one generation per choice of a prompt (`constraints.len()` of them, choice `i` with
/// sampler seed `seed + i`). With several, the first one's prefill is awaited before the others
/// are queued: they start from the prompt state it checkpointed (shared prefill, forked
/// decode). Returns the receivers and the first choice's `Prefilled` event if it was taken.
async fn queue_choices(
    st: &AppState,
    prompt: &[u32],
    mut images: Vec<JobImage>,
    gen: &GenSettings,
    default_max: usize,
    constraints: Vec<Option<Box<dyn TokenConstraint + Send>>>,
) -> Result<(Vec<Option<JobEvents>>, Option<GenEvent>), ApiError> {
    let n = constraints.len();
    let mut events = Vec::with_capacity(n);
    let mut first = None;
    for (i, constraint) in constraints.into_iter().enumerate() {
        let mut g = gen.clone();
        g.sampling.seed = g.sampling.seed.wrapping_add(i as u64);
        // Every choice carries the images: the store keys the prompt's checkpoint by them (a
        // choice that finds it does not run the tower again).
        let imgs = if i + 1 == n {
            std::mem::take(&mut images)
        } else {
            images.iter().map(|im| JobImage { image: im.image.clone(), key: im.key.clone() }).collect()
        };
        let (mut rx, _max) = start(st, prompt, imgs, &g, default_max, constraint)?;
        if i == 0 && n > 1 {
            // The prompt state must be in the store before the other choices look for it.
            match rx.recv().await {
                Some(ev @ GenEvent::Prefilled { .. }) => first = Some(ev),
                Some(GenEvent::Error(e)) => return Err(ApiError::internal(format!("generation failed: {e}"))),
                Some(other) => return Err(ApiError::internal(format!("the engine reported {other:?} before the prefill"))),
                None => return Err(ApiError::internal("the engine stopped during the prefill")),
            }
        }
        events.push(Some(rx));
    }
    Ok((events, first))
}

/// Renders a chat request, builds its constraints and queues one generation per choice. With
/// `n` > 1 the first choice's prefill is awaited before the others are queued: they then start
/// from the prompt state it checkpointed (shared prefill, forked decode), each with its own
/// sampler seed (`seed + i`). `call_id_prefix` names the tool calls of the reply.
async fn start_chat(st: &Arc<AppState>, req: &ChatRequest, call_id_prefix: &str) -> Result<ChatJob, ApiError> {
    let (prompt, images) = chat_prompt(st, req).await?;
    let n = req.gen.n.max(1);
    let mut constraints = Vec::with_capacity(n);
    for _ in 0..n {
        constraints.push(match req.reply_shape() {
            Some(shape) => Some(st.constraint(shape, req.render.thinking).await?),
            None => None,
        });
    }
    let (events, first) = queue_choices(st, &prompt, images, &req.gen, st.default_chat_max_tokens, constraints).await?;
    let mut runs = Vec::with_capacity(n);
    for i in 0..n {
        let prefix = if n > 1 { format!("{call_id_prefix}_{i}") } else { call_id_prefix.to_string() };
        let parser = OutputParser::new(st.tokenizer.clone(), req.render.thinking, prefix).map_err(|e| ApiError::internal(e.to_string()))?;
        let parser = if req.tool_calls_allowed() { parser } else { parser.without_tool_calls() };
        let logprobs = req.gen.logprobs.map(|_| LogprobLog::new(st.tokenizer.clone()));
        runs.push(ChatRun { parser, stops: StopStrings::new(req.gen.stop.clone()), tokens: Vec::new(), reused: 0, stopped_by_string: false, logprobs });
    }
    if let Some(ev) = first {
        runs[0].on(ev)?;
    }
    st.metrics.prompt_tokens.inc_by(prompt.len() as u64);
    Ok(ChatJob { prompt, events, runs })
}

/// Renders and tokenizes a chat request on tokio's blocking pool ([`off_runtime`]): images are
/// decoded and pre-processed, their media blocks rendered, and each image's single
/// `<|media_pad|>` expanded into as many pads as the image has feature rows; the engine thread
/// runs the tower.
async fn chat_prompt(st: &Arc<AppState>, req: &ChatRequest) -> Result<(Vec<u32>, Vec<JobImage>), ApiError> {
    let (st, req) = (st.clone(), req.clone());
    off_runtime(move || render_chat_prompt(&st, &req)).await
}

/// [`chat_prompt`]'s work (blocking).
fn render_chat_prompt(st: &AppState, req: &ChatRequest) -> Result<(Vec<u32>, Vec<JobImage>), ApiError> {
    let mut opts = req.render.clone();
    if !req.images.is_empty() {
        let Some(media) = st.engine.media.clone() else {
            return Err(ApiError::bad_request("this model has no vision tower: image inputs are not accepted", Some("messages")));
        };
        let prepared = req
            .images
            .iter()
            .map(|im| {
                let pre = crate::vision::preprocess_bytes(&im.bytes, &media.config)
                    .map_err(|e| ApiError::bad_request(format!("{}: the image cannot be used: {e}", im.place()), Some("messages")))?;
                let digest: [u8; 32] = {
                    use sha2::Digest;
                    sha2::Sha256::digest(&im.bytes).into()
                };
                Ok((pre, digest))
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        opts.image_prompts = Some(
            prepared
                .iter()
                .map(|(p, _)| crate::chat::render::image_prompt(p.original_size.0 as u32, p.original_size.1 as u32))
                .collect(),
        );
        let pad = media.pad_id;
        let segments = render(&req.messages, &opts).map_err(|e| ApiError::bad_request(e.0, Some("messages")))?;
        let ids = st.tokenizer.encode_segments(&segments).map_err(|e| ApiError::bad_request(format!("tokenizing the prompt: {e}"), Some("messages")))?;
        let counts: Vec<usize> = prepared.iter().map(|(p, _)| p.num_tokens()).collect();
        let expanded = crate::vision::expand_media_ids(&ids, pad, &counts)
            .map_err(|e| ApiError::bad_request(format!("placing the images in the prompt: {e}"), Some("messages")))?;
        let images = prepared
            .into_iter()
            .zip(expanded.image_spans)
            .map(|((image, digest), span)| JobImage { image, key: MediaKey { span, digest } })
            .collect();
        return Ok((expanded.ids, images));
    }
    let (_, prompt) = api::render_chat(&st.tokenizer, req)?;
    if let Some(pad) = st.engine.media.as_ref().map(|m| m.pad_id) {
        if prompt.contains(&pad) {
            return Err(ApiError::bad_request("the prompt holds a media pad token but no image", Some("messages")));
        }
    }
    Ok((prompt, Vec::new()))
}

/// Waits until every choice of `job` has finished; its finish reasons.
async fn finish_all(job: &mut ChatJob) -> Result<Vec<FinishReason>, ApiError> {
    let mut finish = vec![None; job.runs.len()];
    while let Some((i, ev)) = job.next().await {
        let Some(ev) = ev else {
            return Err(ApiError::internal("the engine stopped during generation"));
        };
        let run = &mut job.runs[i];
        match run.on(ev)? {
            Some(ChatStep::Finished(r, _)) => {
                finish[i] = Some(if run.stopped_by_string { FinishReason::Stop } else { r });
                job.close(i);
            }
            _ if run.stopped_by_string => {
                finish[i] = Some(FinishReason::Stop);
                job.close(i); // cancels this choice's generation
            }
            _ => {}
        }
    }
    Ok(finish.into_iter().map(|f| f.unwrap_or(FinishReason::Stop)).collect())
}

/// Usage of a whole job: the prompt once, the completion tokens of every choice.
fn job_usage(job: &ChatJob) -> Value {
    let completion = job.runs.iter().map(|r| r.tokens.len()).sum();
    let reasoning = job.runs.iter().map(|r| r.parser.output().reasoning_tokens).sum();
    usage(job.prompt.len(), completion, job.runs.first().map_or(0, |r| r.reused), reasoning)
}

async fn chat_whole(st: Arc<AppState>, mut job: ChatJob, id: String, model: String, gen: GenSettings) -> Response {
    let finish = match finish_all(&mut job).await {
        Ok(f) => f,
        Err(e) => return fail(&st, e),
    };
    let mut choices = Vec::with_capacity(job.runs.len());
    for (i, (run, finish)) in job.runs.iter().zip(finish).enumerate() {
        let out = run.parser.output();
        let content = if out.content.is_empty() { Value::Null } else { Value::String(content_with_stops(&out.content, &gen.stop)) };
        let mut message = json!({"role": "assistant", "content": content});
        if !out.reasoning.is_empty() {
            message["reasoning_content"] = Value::String(out.reasoning.clone());
        }
        if !out.tool_calls.is_empty() && !run.stopped_by_string {
            message["tool_calls"] = Value::Array(
                out.tool_calls
                    .iter()
                    .map(|t| {
                        let mut v = tool_call_json(t);
                        if let Some(o) = v.as_object_mut() {
                            o.remove("index");
                        }
                        v
                    })
                    .collect(),
            );
        }
        let lp = run.logprobs.as_ref().map_or(Value::Null, |l| l.chat(0));
        let mut choice = json!({"index": i, "message": message, "finish_reason": finish.as_str(), "logprobs": lp});
        if gen.return_token_ids {
            choice["token_ids"] = json!(run.tokens);
        }
        choices.push(choice);
    }
    let mut body = json!({
        "id": id, "object": "chat.completion", "created": now_secs(), "model": model,
        "choices": choices,
        "usage": job_usage(&job),
    });
    if gen.return_token_ids {
        body["prompt_token_ids"] = json!(job.prompt);
    }
    AxJson(body).into_response()
}

/// The content cut at the first stop string (the parser's aggregate is pre-filter).
fn content_with_stops(content: &str, stops: &[String]) -> String {
    match stops.iter().filter(|s| !s.is_empty()).filter_map(|s| content.find(s.as_str())).min() {
        Some(p) => content[..p].to_string(),
        None => content.to_string(),
    }
}

/// Sends parser events as chunks (the first carries the log-probabilities of the tokens not yet
/// streamed); false when the client is gone.
fn send_events(
    tx: &mpsc::UnboundedSender<Result<Event, Infallible>>,
    chunk: &impl Fn(Value, Option<&str>) -> Value,
    evs: Vec<OutputEvent>,
    logprobs: &mut Option<LogprobLog>,
) -> bool {
    for e in evs {
        let delta = match e {
            OutputEvent::Reasoning(s) => json!({"reasoning_content": s}),
            OutputEvent::Content(s) => json!({"content": s}),
            OutputEvent::ToolCall(t) => json!({"tool_calls": [tool_call_json(&t)]}),
        };
        let mut c = chunk(delta, None);
        if let Some(lp) = logprobs.as_mut().and_then(LogprobLog::take_chat) {
            c["choices"][0]["logprobs"] = lp;
        }
        if tx.send(sse(&c)).is_err() {
            return false;
        }
    }
    true
}

fn sse(v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

async fn chat_stream(st: Arc<AppState>, mut job: ChatJob, id: String, model: String, gen: GenSettings) -> Response {
    let (tx, out_rx) = mpsc::unbounded_channel::<Result<Event, Infallible>>();
    let created = now_secs();
    let chunk = move |index: usize, delta: Value, finish: Option<&str>| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": null}]})
    };
    let metrics = st.metrics.clone();
    tokio::spawn(async move {
        for i in 0..job.runs.len() {
            let _ = tx.send(sse(&chunk(i, json!({"role": "assistant", "content": ""}), None)));
        }
        let mut finished = vec![false; job.runs.len()];
        // a client that leaves ends the loop at once (dropping the job cancels its choices)
        while let Some((i, ev)) = match job.next_for(&tx).await {
            Ok(got) => got,
            Err(()) => return,
        } {
            let Some(ev) = ev else { break };
            let run = &mut job.runs[i];
            let at = |d: Value, f: Option<&str>| chunk(i, d, f);
            let finish = match run.on(ev) {
                Ok(Some(ChatStep::Events(evs))) => {
                    if !send_events(&tx, &at, evs, &mut run.logprobs) {
                        return; // client gone: dropping the receivers cancels the jobs
                    }
                    run.stopped_by_string.then_some(FinishReason::Stop)
                }
                Ok(Some(ChatStep::Finished(r, tail))) => {
                    send_events(&tx, &at, tail, &mut run.logprobs);
                    Some(if run.stopped_by_string { FinishReason::Stop } else { r })
                }
                Ok(None) => None,
                Err(e) => {
                    metrics.error("generation");
                    let _ = tx.send(sse(&e.body()));
                    let _ = tx.send(Ok(Event::default().data("[DONE]")));
                    return;
                }
            };
            if let Some(finish) = finish {
                let mut last = at(json!({}), Some(finish.as_str()));
                if let Some(lp) = run.logprobs.as_mut().and_then(LogprobLog::take_chat) {
                    last["choices"][0]["logprobs"] = lp;
                }
                let _ = tx.send(sse(&last));
                finished[i] = true;
                job.close(i);
            }
        }
        if finished.iter().any(|f| !f) {
            metrics.error("generation");
            let _ = tx.send(sse(&ApiError::internal("the engine stopped during generation").body()));
            let _ = tx.send(Ok(Event::default().data("[DONE]")));
            return;
        }
        if gen.include_usage {
            let mut u = chunk(0, Value::Null, None);
            u["choices"] = json!([]);
            u["usage"] = job_usage(&job);
            let _ = tx.send(sse(&u));
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]")));
    });
    let stream = futures_util::stream::unfold(out_rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

async fn completions(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    st.metrics.request("completions");
    let n = st.next_id();
    let (req, prompt) = match off_runtime({
        let st = st.clone();
        move || {
            let v = api::parse_body(&body)?;
            let req = api::completion_request(&v, &st.model_id, st.tokenizer.vocab_size() as usize, st.seed(n))?;
            let prompt = match &req.prompt {
                Prompt::Ids(ids) => ids.clone(),
                Prompt::Text(t) => {
                    st.tokenizer.encode(t, true).map_err(|e| ApiError::bad_request(format!("tokenizing the prompt: {e}"), Some("prompt")))?
                }
            };
            Ok((req, prompt))
        }
    })
    .await
    {
        Ok(x) => x,
        Err(e) => return fail(&st, e),
    };
    if let Some(pad) = st.engine.media.as_ref().map(|m| m.pad_id) {
        if prompt.contains(&pad) {
            return fail(
                &st,
                ApiError::bad_request("the prompt holds <|media_pad|> tokens, which need an image: send images through /v1/chat/completions", Some("prompt")),
            );
        }
    }
    let nchoices = req.gen.n.max(1);
    let (mut events, first) =
        match queue_choices(&st, &prompt, Vec::new(), &req.gen, api::DEFAULT_COMPLETION_MAX_TOKENS, (0..nchoices).map(|_| None).collect()).await {
            Ok(x) => x,
            Err(e) => return fail(&st, e),
        };
    st.metrics.prompt_tokens.inc_by(prompt.len() as u64);
    let id = format!("cmpl-{:x}{:04x}", now_secs(), n & 0xffff);
    let tok = st.tokenizer.clone();
    let stop_ids: Vec<u32> = [crate::tokenizer::names::END_OF_MSG, crate::tokenizer::names::EOS].iter().filter_map(|n| tok.special_id(n)).collect();
    let gen = req.gen.clone();
    let model = req.model.clone();
    let created = now_secs();

    // Shared by both forms: text deltas (stop ids are not text), stop strings, finish reason.
    struct Run {
        utf8: crate::tokenizer::Utf8Stream,
        stops: StopStrings,
        tokens: Vec<u32>,
        reused: usize,
        logprobs: Option<LogprobLog>,
        /// Characters of text sent so far (the next entry's `text_offset`).
        text_len: usize,
    }
    let mut runs: Vec<Run> = (0..nchoices)
        .map(|_| Run {
            utf8: Default::default(),
            stops: StopStrings::new(gen.stop.clone()),
            tokens: Vec::new(),
            reused: 0,
            logprobs: gen.logprobs.map(|_| LogprobLog::new(tok.clone())),
            text_len: 0,
        })
        .collect();
    // Returns (text delta, finish reason if finished).
    let step = move |run: &mut Run, ev: GenEvent| -> Result<(String, Option<&'static str>), ApiError> {
        match ev {
            GenEvent::Prefilled { reused_tokens, .. } => {
                run.reused = reused_tokens;
                Ok((String::new(), None))
            }
            GenEvent::Token(e) => {
                let t = e.token;
                run.tokens.push(t);
                if let Some(l) = run.logprobs.as_mut() {
                    l.entries.push(e);
                }
                if stop_ids.contains(&t) {
                    return Ok((String::new(), None));
                }
                let s = run.utf8.push(tok.token_bytes(t).unwrap_or(b"\xEF\xBF\xBD"));
                let s = run.stops.push(&s);
                Ok((s, if run.stops.hit() { Some("stop") } else { None }))
            }
            GenEvent::Done { finish, .. } => {
                let tail = run.utf8.finish();
                let mut s = run.stops.push(&tail);
                if !run.stops.hit() {
                    s.push_str(&run.stops.finish());
                }
                Ok((s, Some(if finish == generate::FinishReason::Length && !run.stops.hit() { "length" } else { "stop" })))
            }
            GenEvent::Error(e) => Err(ApiError::internal(format!("generation failed: {e}"))),
        }
    };

    if let Some(ev) = first {
        if let Err(e) = step(&mut runs[0], ev) {
            return fail(&st, e);
        }
    }
    let prompt_len = prompt.len();
    let total_usage = move |runs: &[Run]| usage(prompt_len, runs.iter().map(|r| r.tokens.len()).sum(), runs[0].reused, 0);

    if !gen.stream {
        let mut texts = vec![String::new(); nchoices];
        let mut finish = vec![None; nchoices];
        while let Some((i, ev)) = next_event(&mut events).await {
            let Some(ev) = ev else {
                return fail(&st, ApiError::internal("the engine stopped during generation"));
            };
            match step(&mut runs[i], ev) {
                Ok((s, f)) => {
                    texts[i].push_str(&s);
                    if f.is_some() {
                        finish[i] = f;
                        events[i] = None; // finished (or cut by a stop string: cancels it)
                    }
                }
                Err(e) => return fail(&st, e),
            }
        }
        let choices: Vec<Value> = runs
            .iter()
            .zip(texts)
            .zip(finish)
            .enumerate()
            .map(|(i, ((run, text), finish))| {
                let lp = run.logprobs.as_ref().map_or(Value::Null, |l| l.legacy(0, 0));
                let mut choice = json!({"index": i, "text": text, "finish_reason": finish.unwrap_or("stop"), "logprobs": lp});
                if gen.return_token_ids {
                    choice["token_ids"] = json!(run.tokens);
                }
                choice
            })
            .collect();
        let mut body = json!({"id": id, "object": "text_completion", "created": created, "model": model,
                              "choices": choices, "usage": total_usage(&runs)});
        if gen.return_token_ids {
            body["prompt_token_ids"] = json!(prompt);
        }
        return AxJson(body).into_response();
    }

    let (tx, out_rx) = mpsc::unbounded_channel::<Result<Event, Infallible>>();
    let metrics = st.metrics.clone();
    tokio::spawn(async move {
        let chunk = |index: usize, text: &str, finish: Option<&str>| {
            json!({"id": id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": index, "text": text, "finish_reason": finish, "logprobs": null}]})
        };
        // A chunk carrying the log-probabilities of the tokens not yet streamed.
        let with_logprobs = |run: &mut Run, mut c: Value| {
            if let Some(l) = run.logprobs.as_mut().filter(|l| l.sent < l.entries.len()) {
                c["choices"][0]["logprobs"] = l.legacy(l.sent, run.text_len);
                l.sent = l.entries.len();
            }
            c
        };
        let mut finished = 0;
        loop {
            // a client that leaves ends the loop at once (dropping the receivers cancels the jobs)
            let got = tokio::select! {
                got = next_event(&mut events) => got,
                _ = tx.closed() => return,
            };
            let Some((i, ev)) = got else { break };
            let Some(ev) = ev else { break };
            match step(&mut runs[i], ev) {
                Ok((s, f)) => {
                    let run = &mut runs[i];
                    if !s.is_empty() {
                        let c = with_logprobs(run, chunk(i, &s, None));
                        run.text_len += s.len();
                        if tx.send(sse(&c)).is_err() {
                            return;
                        }
                    }
                    if let Some(f) = f {
                        let c = with_logprobs(run, chunk(i, "", Some(f)));
                        let _ = tx.send(sse(&c));
                        events[i] = None;
                        finished += 1;
                    }
                }
                Err(e) => {
                    metrics.error("generation");
                    let _ = tx.send(sse(&e.body()));
                    let _ = tx.send(Ok(Event::default().data("[DONE]")));
                    return;
                }
            }
        }
        if finished < runs.len() {
            metrics.error("generation");
            let _ = tx.send(sse(&ApiError::internal("the engine stopped during generation").body()));
            let _ = tx.send(Ok(Event::default().data("[DONE]")));
            return;
        }
        if gen.include_usage {
            let mut u = chunk(0, "", None);
            u["choices"] = json!([]);
            u["usage"] = total_usage(&runs);
            let _ = tx.send(sse(&u));
        }
        let _ = tx.send(Ok(Event::default().data("[DONE]")));
    });
    let stream = futures_util::stream::unfold(out_rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// Binds `addr` and serves until the process ends (or `shutdown` resolves).
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<AppState>, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    let header_timeout = state.guard.header_timeout;
    guard::serve(listener, router(state), header_timeout, std::time::Duration::from_secs(60), shutdown).await
}
