//! The request pipeline the OpenAI ([`super::openai`]) and Anthropic ([`super::anthropic`])
//! endpoints share: the server state, request preparation off the async runtime, admission onto
//! the engine (context and `max_tokens` checks, one generation per choice), and the chat run that
//! turns engine events into parsed reply events with stop strings applied.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api::{self, ApiError, ChatRequest, GenSettings};
use super::guard;
use super::held_responses::ResponseStore;
use super::seal::Sealer;
use super::stop::StopStrings;
use crate::chat::budget::{ReplyBudget, CLOSE_ALLOWANCE};
use crate::chat::constrain::Grammars;
use crate::chat::grammar::{GrammarError, ReplyShape};
use crate::chat::parse::{FinishReason, OutputEvent, OutputParser};
use crate::chat::render::render;
use crate::chat::Json;
use crate::engine::sessions::MediaKey;
use crate::engine::{Emitted, EngineHandle, GenEvent, GenJob, JobEvents, JobImage, LoopEnd, SubmitError};
use crate::metrics::Metrics;
use crate::sampler::TokenConstraint;
use crate::tokenizer::Tokenizer;

/// Shared server state.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub metrics: Arc<Metrics>,
    /// The model id clients send.
    pub model_id: String,
    /// Required bearer token for `/v1/*`, if set.
    pub api_key: Option<String>,
    /// Further keys accepted beside `api_key`; with any, every key has its own cache scope
    /// ([`guard::ClientKey`]).
    pub more_api_keys: Vec<String>,
    /// Default `max_tokens` of chat completions (bounded by the context).
    pub default_chat_max_tokens: usize,
    /// HTTP hardening of `/v1/*` (see [`guard`]).
    pub guard: guard::GuardOptions,
    pub(super) counter: AtomicU64,
    /// When the server started (the model's `created`).
    pub(super) created: u64,
    /// Constrained decoding's view of the tokenizer, built on first use.
    pub(super) grammars: OnceLock<Result<Arc<Grammars>, Arc<GrammarError>>>,
    /// Seals reasoning for the clients to send back (Responses `encrypted_content`, Messages
    /// thinking `signature`).
    pub sealer: Sealer,
    /// Responses kept for `previous_response_id`.
    pub responses: ResponseStore,
    /// `--max-output-tokens`: replies are closed well-formed after this many tokens
    /// ([`crate::chat::budget::ReplyBudget`]; a constrained reply keeps its own bound).
    pub max_output_tokens: Option<usize>,
}

/// An SSE comment saying how far the prefill is (clients ignore comments; a person or a proxy
/// watching the stream sees the server working through a long prompt).
pub(super) fn progress_comment(done: usize, total: usize) -> Result<axum::response::sse::Event, std::convert::Infallible> {
    Ok(axum::response::sse::Event::default().comment(format!("prefill {done}/{total} tokens")))
}

/// Responses held for `previous_response_id`.
const HELD_RESPONSES: usize = 256;

/// How many of a prompt's last message boundaries also get a checkpoint.
const BOUNDARY_CHECKPOINTS: usize = 3;

impl AppState {
    pub fn new(engine: EngineHandle, tokenizer: Arc<Tokenizer>, metrics: Arc<Metrics>, model_id: String, api_key: Option<String>) -> Self {
        let sealer = Sealer::new(&model_id, api_key.as_deref());
        AppState {
            engine,
            tokenizer,
            metrics,
            model_id,
            api_key,
            more_api_keys: Vec::new(),
            default_chat_max_tokens: 4096,
            guard: Default::default(),
            counter: AtomicU64::new(0),
            created: now_secs(),
            grammars: OnceLock::new(),
            sealer,
            responses: ResponseStore::new(HELD_RESPONSES),
            max_output_tokens: None,
        }
    }

    /// A constraint enforcing `shape` (built off the async threads: the first call builds the
    /// token trie of the whole vocabulary). A grammar that cannot be built is the client's
    /// schema: a 400.
    pub(super) async fn constraint(self: &Arc<Self>, shape: ReplyShape, thinking: bool) -> Result<Box<dyn TokenConstraint + Send>, ApiError> {
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
            let refuse = |e: GrammarError| {
                let param = if matches!(shape, ReplyShape::ToolCalls { .. }) { "tools" } else { "response_format" };
                ApiError::bad_request(format!("the reply cannot be constrained: {e}"), Some(param))
            };
            // With thinking, the first mask is the reasoning's: the reply's own grammar is
            // checked from its start too, so a reply that cannot begin is a 400 now, not a
            // failure after the prefill.
            if thinking {
                grammars.constraint(&shape, false).map_err(refuse)?;
            }
            let c = grammars.constraint(&shape, thinking).map_err(refuse)?;
            Ok(Box::new(c) as Box<dyn TokenConstraint + Send>)
        })
        .await
        .map_err(|e| ApiError::internal(format!("building the grammar stopped: {e}")))?
    }

    pub(super) fn next_id(&self) -> u64 {
        self.counter.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn seed(&self, n: u64) -> u64 {
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The error response of a refused request (counted, logged); a 429 says when to retry
/// (`Retry-After`, the guard's setting).
pub(super) fn fail(st: &AppState, e: ApiError) -> Response {
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
///
/// The work is abandoned when its request is: dropping the returned future (hyper drops the
/// handler of a connection that closed) raises a flag that [`abandoned`] reads on the blocking
/// thread, and the long steps check it (between images, between tokenizer chunks), so a client
/// that leaves does not keep a blocking thread busy for minutes.
///
/// [`abandoned`]: api::abandoned
pub(super) async fn off_runtime<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    struct RaiseOnDrop(Arc<AtomicBool>);
    impl Drop for RaiseOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let flag = Arc::new(AtomicBool::new(false));
    let _raise = RaiseOnDrop(flag.clone());
    tokio::task::spawn_blocking(move || api::abandonable(flag, f)).await.map_err(|e| ApiError::internal(format!("request preparation stopped: {e}")))?
}

/// Resolves `max_tokens` against the context and queues the job.
pub(super) fn start(
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
        return Err(ApiError::bad_request(format!("the prompt is {} tokens; this model's context is {ctx} tokens", prompt.len()), Some("messages"))
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
    // Checkpoints at the ends of the prompt's last messages (besides the prompt's end).
    let checkpoint_at = match st.tokenizer.special_id(crate::tokenizer::names::END_OF_MSG) {
        Some(end) => {
            let mut at: Vec<usize> = prompt.iter().enumerate().filter(|(_, &t)| t == end).map(|(i, _)| i + 1).filter(|&p| p < prompt.len()).collect();
            at.drain(..at.len().saturating_sub(BOUNDARY_CHECKPOINTS));
            at
        }
        None => Vec::new(),
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
        .submit(GenJob {
            prompt: prompt.to_vec(),
            images,
            max_tokens,
            sampling: gen.sampling.clone(),
            stop_ids,
            constraint,
            logprobs: gen.logprobs,
            checkpoint_at,
            session_key: gen.session_key.clone(),
            cache_scope: gen.cache_scope(),
        })
        .map_err(|e| match e {
            SubmitError::Busy { .. } => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: e.to_string(),
                kind: "invalid_request_error",
                param: None,
                code: Some("too_many_tokens"),
            },
            e => ApiError::unavailable(e.to_string()),
        })?;
    Ok((rx, max_tokens))
}

/// Drives one chat generation: parses ids into events, applies stop strings to the content.
pub(super) struct ChatRun {
    pub(super) parser: OutputParser,
    pub(super) stops: StopStrings,
    pub(super) tokens: Vec<u32>,
    pub(super) reused: usize,
    /// Where the prompt first differed from every held state (the engine's report).
    pub(super) first_difference: usize,
    pub(super) stopped_by_string: bool,
    /// Per-token log-probabilities (OpenAI's `logprobs.content` entries), when asked for.
    pub(super) logprobs: Option<LogprobLog>,
    pub(super) metrics: Arc<Metrics>,
}

/// Log-probability entries of the generated tokens; `sent` of them went out in stream chunks.
pub(super) struct LogprobLog {
    pub(super) tok: Arc<Tokenizer>,
    pub(super) entries: Vec<Emitted>,
    pub(super) sent: usize,
}

impl LogprobLog {
    pub(super) fn new(tok: Arc<Tokenizer>) -> Self {
        LogprobLog { tok, entries: Vec::new(), sent: 0 }
    }

    /// A token's text and bytes (special tokens by name).
    pub(super) fn piece(&self, id: u32) -> (String, Vec<u8>) {
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
    pub(super) fn chat(&self, from: usize) -> Value {
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
    pub(super) fn legacy(&self, from: usize, text_offset: usize) -> Value {
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
    pub(super) fn take_chat(&mut self) -> Option<Value> {
        if self.sent == self.entries.len() {
            return None;
        }
        let v = self.chat(self.sent);
        self.sent = self.entries.len();
        Some(v)
    }
}

/// One step of a chat run, for the response writer.
pub(super) enum ChatStep {
    Events(Vec<OutputEvent>),
    /// The finish reason and the last events (held-back text).
    Finished(FinishReason, Vec<OutputEvent>),
    /// Prefill progress: `done` of `total` prompt tokens are in (streams say so, so a client
    /// waiting through a long prefill sees the server working).
    Progress {
        done: usize,
        total: usize,
    },
}

impl ChatRun {
    /// Handles one engine event; `None` when the event needs no output.
    pub(super) fn on(&mut self, ev: GenEvent) -> Result<Option<ChatStep>, ApiError> {
        match ev {
            GenEvent::Prefilled { reused_tokens, first_difference, .. } => {
                self.reused = reused_tokens;
                self.first_difference = first_difference;
                Ok(None)
            }
            GenEvent::Progress { done, total } => Ok(Some(ChatStep::Progress { done, total })),
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
                    LoopEnd::Length => FinishReason::Length,
                    _ => FinishReason::Stop,
                };
                let tail = self.filter_tail(reason);
                let out = self.parser.output();
                self.metrics.undeclared_tool_calls.inc_by(out.undeclared_tool_calls.len() as u64);
                self.metrics.stripped_markers.inc_by(out.stripped_markers as u64);
                let r = out.finish_reason.unwrap_or(reason);
                Ok(Some(ChatStep::Finished(r, tail)))
            }
            GenEvent::Error(e) => Err(ApiError::internal(format!("generation failed: {e}"))),
        }
    }

    /// Applies stop strings to content events.
    pub(super) fn filter(&mut self, evs: Vec<OutputEvent>) -> Vec<OutputEvent> {
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
    pub(super) fn filter_tail(&mut self, reason: FinishReason) -> Vec<OutputEvent> {
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

/// A chat request on the engine: its prompt and one generation per choice.
pub(super) struct ChatJob {
    pub(super) prompt: Vec<u32>,
    /// Per choice: its engine events (`None` once the choice is finished or cancelled:
    /// dropping the receiver cancels its generation) and its run.
    pub(super) events: Vec<Option<JobEvents>>,
    pub(super) runs: Vec<ChatRun>,
}

impl ChatJob {
    /// The next engine event of any unfinished choice: `(choice, event)`, where the event is
    /// `None` if the engine dropped that choice's channel. `None` when every choice is done.
    pub(super) async fn next(&mut self) -> Option<(usize, Option<GenEvent>)> {
        next_event(&mut self.events).await
    }

    /// [`Self::next`], or `Err(())` as soon as `out` (the client's stream) is closed: the
    /// client is gone, and dropping the job cancels every choice.
    pub(super) async fn next_for<T>(&mut self, out: &mpsc::UnboundedSender<T>) -> Result<Option<(usize, Option<GenEvent>)>, ()> {
        tokio::select! {
            got = self.next() => Ok(got),
            _ = out.closed() => Err(()),
        }
    }

    /// Ends choice `i` (drops its receiver: the engine stops generating it).
    pub(super) fn close(&mut self, i: usize) {
        self.events[i] = None;
    }
}

/// The next engine event of any open receiver of `events`: `(index, event)`, where the event
/// is `None` if the engine dropped that channel. `None` when every receiver is closed.
pub(super) async fn next_event(events: &mut [Option<JobEvents>]) -> Option<(usize, Option<GenEvent>)> {
    let waiting: Vec<_> = events.iter_mut().enumerate().filter_map(|(i, rx)| rx.as_mut().map(|rx| Box::pin(async move { (i, rx.recv().await) }))).collect();
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
pub(super) async fn queue_choices(
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
        let imgs =
            if i + 1 == n { std::mem::take(&mut images) } else { images.iter().map(|im| JobImage { image: im.image.clone(), key: im.key.clone() }).collect() };
        let (mut rx, _max) = start(st, prompt, imgs, &g, default_max, constraint)?;
        if i == 0 && n > 1 {
            // The prompt state must be in the store before the other choices look for it.
            let mut ev = rx.recv().await;
            while let Some(GenEvent::Progress { .. }) = ev {
                ev = rx.recv().await;
            }
            match ev {
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
pub(super) async fn start_chat(st: &Arc<AppState>, req: &ChatRequest, call_id_prefix: &str) -> Result<ChatJob, ApiError> {
    let (prompt, images) = chat_prompt(st, req).await?;
    let n = req.gen.n.max(1);
    let mut constraints = Vec::with_capacity(n);
    let mut gen = req.gen.clone();
    // `--max-output-tokens`: a reply longer than the cap is closed well-formed at it (a
    // constrained one, whose grammar decides its end, keeps the request's own bound).
    let room = st.engine.max_context.saturating_sub(prompt.len());
    // Agent clients send a fixed max_tokens whatever the prompt (Claude Code, OpenCode and Qwen
    // Code: 32,000): a chat reply is bounded by the context left (raw completions still refuse).
    if let Some(m) = gen.max_tokens.filter(|&m| m > room && room > 0) {
        tracing::debug!(max_tokens = m, room, "max_tokens above the context left; clamped");
        gen.max_tokens = Some(room);
    }
    let wanted = gen.max_tokens.unwrap_or(st.default_chat_max_tokens).min(room);
    let budget = st.max_output_tokens.filter(|&cap| cap < wanted && req.reply_shape().is_none());
    for _ in 0..n {
        constraints.push(match (req.reply_shape(), budget) {
            (Some(shape), _) => Some(st.constraint(shape, req.render.thinking).await?),
            (None, Some(cap)) => {
                Some(Box::new(ReplyBudget::half(st.tokenizer.clone(), req.render.thinking, cap).map_err(|e| ApiError::internal(e.to_string()))?)
                    as Box<dyn TokenConstraint + Send>)
            }
            (None, None) => None,
        });
    }
    if let Some(cap) = budget {
        gen.max_tokens = Some((cap + CLOSE_ALLOWANCE).min(room.max(1)));
    }
    let (events, first) = queue_choices(st, &prompt, images, &gen, st.default_chat_max_tokens, constraints).await?;
    let declared: Vec<String> = req
        .render
        .tools
        .as_ref()
        .and_then(Json::as_array)
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t.get("function").and_then(|f| f.get("name")).and_then(Json::as_str).map(str::to_string))
        .collect();
    let mut runs = Vec::with_capacity(n);
    for i in 0..n {
        let prefix = if n > 1 { format!("{call_id_prefix}_{i}") } else { call_id_prefix.to_string() };
        let parser = OutputParser::new(st.tokenizer.clone(), req.render.thinking, prefix).map_err(|e| ApiError::internal(e.to_string()))?;
        let parser = if req.tool_calls_allowed() { parser.with_declared_tools(declared.clone()) } else { parser.without_tool_calls() };
        let logprobs = req.gen.logprobs.map(|_| LogprobLog::new(st.tokenizer.clone()));
        runs.push(ChatRun {
            parser,
            stops: StopStrings::new(req.gen.stop.clone()),
            tokens: Vec::new(),
            reused: 0,
            first_difference: 0,
            stopped_by_string: false,
            logprobs,
            metrics: st.metrics.clone(),
        });
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
pub(super) async fn chat_prompt(st: &Arc<AppState>, req: &ChatRequest) -> Result<(Vec<u32>, Vec<JobImage>), ApiError> {
    let (st, req) = (st.clone(), req.clone());
    off_runtime(move || render_chat_prompt(&st, &req)).await
}

/// [`chat_prompt`]'s work (blocking).
pub(super) fn render_chat_prompt(st: &AppState, req: &ChatRequest) -> Result<(Vec<u32>, Vec<JobImage>), ApiError> {
    let mut opts = req.render.clone();
    if !req.images.is_empty() {
        let Some(media) = st.engine.media.clone() else {
            return Err(ApiError::bad_request("this model has no vision tower: image inputs are not accepted", Some("messages")));
        };
        let prepared = req
            .images
            .iter()
            .map(|im| {
                if api::abandoned() {
                    return Err(api::abandoned_error());
                }
                let pre = crate::vision::preprocess_bytes(&im.bytes, &media.config)
                    .map_err(|e| ApiError::bad_request(format!("{}: the image cannot be used: {e}", im.place()), Some("messages")))?;
                let digest: [u8; 32] = {
                    use sha2::Digest;
                    sha2::Sha256::digest(&im.bytes).into()
                };
                Ok((pre, digest))
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        opts.image_prompts =
            Some(prepared.iter().map(|(p, _)| crate::chat::render::image_prompt(p.original_size.0 as u32, p.original_size.1 as u32)).collect());
        let pad = media.pad_id;
        let segments = render(&req.messages, &opts).map_err(|e| ApiError::bad_request(e.0, Some("messages")))?;
        let ids = api::encode_prompt(&st.tokenizer, &segments, st.engine.max_context, "messages")?;
        let counts: Vec<usize> = prepared.iter().map(|(p, _)| p.num_tokens()).collect();
        let expanded = crate::vision::expand_media_ids(&ids, pad, &counts)
            .map_err(|e| ApiError::bad_request(format!("placing the images in the prompt: {e}"), Some("messages")))?;
        let images = prepared.into_iter().zip(expanded.image_spans).map(|((image, digest), span)| JobImage { image, key: MediaKey { span, digest } }).collect();
        return Ok((expanded.ids, images));
    }
    let (_, prompt) = api::render_chat_within(&st.tokenizer, req, st.engine.max_context)?;
    if let Some(pad) = st.engine.media.as_ref().map(|m| m.pad_id) {
        if prompt.contains(&pad) {
            return Err(ApiError::bad_request("the prompt holds a media pad token but no image", Some("messages")));
        }
    }
    Ok((prompt, Vec::new()))
}

/// Waits until every choice of `job` has finished; its finish reasons.
pub(super) async fn finish_all(job: &mut ChatJob) -> Result<Vec<FinishReason>, ApiError> {
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

/// The content cut at the first stop string (the parser's aggregate is pre-filter).
pub(super) fn content_with_stops(content: &str, stops: &[String]) -> String {
    match stops.iter().filter(|s| !s.is_empty()).filter_map(|s| content.find(s.as_str())).min() {
        Some(p) => content[..p].to_string(),
        None => content.to_string(),
    }
}
