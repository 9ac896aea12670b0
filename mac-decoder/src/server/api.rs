//! OpenAI request validation and error bodies.
//!
//! Bodies are parsed into the order-preserving [`Json`] (tool-call arguments keep the client's
//! key order) and checked field by field; anything wrong is an [`ApiError`]: an OpenAI-style
//! `{"error": {message, type, param, code}}` with a 4xx status, never a panic.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::chat::grammar::ReplyShape;
use crate::chat::json::JsonLimits;
use crate::chat::render::{response_schema, RenderOptions, THINKING_EFFORTS};
use crate::chat::Json;
use crate::sampler::SamplingParams;

/// Chat defaults (spec K3_CHAT §4).
pub const DEFAULT_TEMPERATURE: f32 = 1.0;
pub const DEFAULT_TOP_P: f32 = 0.95;
pub const DEFAULT_EFFORT: &str = "max";
/// `/v1/completions` default `max_tokens` (OpenAI's).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// An OpenAI-style error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: param.map(str::to_string), code: None }
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    /// A request for a model id this server does not serve; the message lists the ids it serves.
    pub fn not_found_model(model: &str, served: &[&str]) -> Self {
        let ids: Vec<String> = served.iter().map(|id| format!("`{id}`")).collect();
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist; this server serves {} (GET /v1/models)", ids.join(", ")),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }
    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key (send `Authorization: Bearer <key>` or `x-api-key: <key>`)".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "server_error", param: None, code: None }
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::SERVICE_UNAVAILABLE, message: message.into(), kind: "server_error", param: None, code: None }
    }
    /// The metrics label of this error.
    pub fn metric_kind(&self) -> &'static str {
        match (self.status.as_u16(), self.code) {
            (_, Some(c)) => c,
            (400, _) => "invalid_request",
            (401, _) => "unauthorized",
            (404, _) => "not_found",
            (s, _) if s >= 500 => "server",
            _ => "client",
        }
    }
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

type R<T> = Result<T, ApiError>;

/// A 400 `invalid_request_error` naming `param` (the Messages and Responses translations).
pub(super) fn bad(message: impl Into<String>, param: &str) -> ApiError {
    ApiError::bad_request(message, Some(param))
}

/// A JSON object of `entries`, in order.
pub(super) fn obj(entries: Vec<(&str, Json)>) -> Json {
    Json::Object(entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
}

/// A JSON string.
pub(super) fn s(v: impl Into<String>) -> Json {
    Json::Str(v.into())
}

thread_local! {
    /// The abandon flag of the request preparation running on this thread ([`abandonable`]).
    static ABANDONED: std::cell::RefCell<Option<std::sync::Arc<std::sync::atomic::AtomicBool>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` (a request's preparation, on a blocking thread) with `flag` as its abandon flag:
/// raised when the client left, read through [`abandoned`] by the long steps.
pub(crate) fn abandonable<T>(flag: std::sync::Arc<std::sync::atomic::AtomicBool>, f: impl FnOnce() -> T) -> T {
    ABANDONED.with(|a| *a.borrow_mut() = Some(flag));
    let r = f();
    ABANDONED.with(|a| *a.borrow_mut() = None);
    r
}

/// Whether the request whose preparation runs on this thread was abandoned by its client;
/// false outside that work.
pub(crate) fn abandoned() -> bool {
    ABANDONED.with(|a| a.borrow().as_ref().is_some_and(|f| f.load(std::sync::atomic::Ordering::Relaxed)))
}

/// The error of preparation work given up because its client left (nobody reads it; counted
/// as `client_left`).
pub(crate) fn abandoned_error() -> ApiError {
    ApiError {
        status: StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        message: "the client left".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("client_left"),
    }
}

/// Parses a request body as a JSON object, within [`JsonLimits::request`] (keys per object,
/// items per array, nesting: a body past a cap is refused where the parse reaches it).
pub fn parse_body(body: &[u8]) -> R<Json> {
    let text = std::str::from_utf8(body).map_err(|_| ApiError::bad_request("the request body is not UTF-8", None))?;
    let v = Json::parse_limited(text, &JsonLimits::request(body.len()))
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}"), None))?;
    if v.as_object().is_none() {
        return Err(ApiError::bad_request("the request body must be a JSON object", None));
    }
    Ok(v)
}

fn opt_bool(v: &Json, key: &str) -> R<Option<bool>> {
    match v.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::bad_request(format!("`{key}` must be a boolean"), Some(key))),
    }
}

fn opt_num(v: &Json, key: &str) -> R<Option<f64>> {
    match v.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Int(i)) => Ok(Some(*i as f64)),
        Some(Json::UInt(u)) => Ok(Some(*u as f64)),
        Some(Json::Float(f)) => Ok(Some(*f)),
        Some(_) => Err(ApiError::bad_request(format!("`{key}` must be a number"), Some(key))),
    }
}

fn opt_int(v: &Json, key: &str) -> R<Option<i64>> {
    match v.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Int(i)) => Ok(Some(*i)),
        Some(Json::UInt(_)) => Err(ApiError::bad_request(format!("`{key}` is too large"), Some(key))),
        Some(_) => Err(ApiError::bad_request(format!("`{key}` must be an integer"), Some(key))),
    }
}

fn opt_str<'a>(v: &'a Json, key: &str) -> R<Option<&'a str>> {
    match v.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Str(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::bad_request(format!("`{key}` must be a string"), Some(key))),
    }
}

/// The request's `model` against the served one (absent is accepted).
pub fn check_model(v: &Json, served: &str) -> R<String> {
    match opt_str(v, "model")? {
        None => Ok(served.to_string()),
        Some(m) if m == served => Ok(m.to_string()),
        Some(m) => Err(ApiError::not_found_model(m, &[served])),
    }
}

/// Settings shared by both endpoints.
#[derive(Debug, Clone)]
pub struct GenSettings {
    pub stream: bool,
    pub include_usage: bool,
    /// `None`: the endpoint's default (bounded by the context).
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub return_token_ids: bool,
    /// Log-probabilities with this many alternatives per token (chat: `logprobs: true` +
    /// `top_logprobs`; completions: `logprobs: N`).
    pub logprobs: Option<usize>,
    /// Choices to generate (`n`): one prefill, then each choice decodes from a fork of the
    /// prompt's state with its own sampler seed (`seed + i`).
    pub n: usize,
    /// The client's conversation key ([`super::session_key`]).
    pub session_key: Option<String>,
    /// `cache_salt` (vLLM's field): requests with different salts share no held prompt state.
    pub cache_salt: Option<String>,
    /// Which API key the request came with, when the server has several ([`super::guard::ClientKey`]).
    pub client_key: Option<String>,
}

/// Longest `cache_salt`, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 1024;

/// The request's `cache_salt` at `v[field]`: absent or null → none; else a non-empty string of
/// at most [`MAX_CACHE_SALT_BYTES`] (400 otherwise: a salt that does not separate is worse than
/// none).
pub fn cache_salt(v: &Json, param: &str) -> R<Option<String>> {
    match v.get("cache_salt") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Str(s)) if s.is_empty() => Err(ApiError::bad_request(format!("`{param}` must be a non-empty string when given"), Some(param))),
        Some(Json::Str(s)) if s.len() > MAX_CACHE_SALT_BYTES => {
            Err(ApiError::bad_request(format!("`{param}` is {} bytes; at most {MAX_CACHE_SALT_BYTES}", s.len()), Some(param)))
        }
        Some(Json::Str(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad_request(format!("`{param}` must be a string"), Some(param))),
    }
}

impl GenSettings {
    /// The cache scope of the request ([`cache_scope`]).
    pub fn cache_scope(&self) -> Option<String> {
        cache_scope(self.client_key.as_deref(), self.cache_salt.as_deref())
    }
}

/// The cache scope (`engine::sessions`) of a request with API key digest `client_key` (set on
/// a server with several keys) and `cache_salt`: `None` (the shared scope) with neither; else a
/// digest of both. A request sees only the held prompt states (and stored responses) of its
/// own scope.
pub fn cache_scope(client_key: Option<&str>, salt: Option<&str>) -> Option<String> {
    if client_key.is_none() && salt.is_none() {
        return None;
    }
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"k3-offload cache scope v1\n");
    match client_key {
        Some(k) => h.update(format!("key {k}\n")),
        None => h.update(b"no key\n"),
    }
    match salt {
        Some(s) => {
            h.update(b"salt ");
            h.update(s.as_bytes());
        }
        None => h.update(b"no salt"),
    }
    Some(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;

/// Most Anthropic `stop_sequences` in one request (OpenAI's `stop` holds at most 4).
pub const MAX_STOP_SEQUENCES: usize = 16;

/// Refuses stop strings that are too many, empty, or longer than [`MAX_STOP_BYTES`] (matching
/// costs the stops' length at every token).
pub fn check_stops(stops: &[String], max: usize, param: &str) -> R<()> {
    if stops.len() > max {
        return Err(ApiError::bad_request(format!("`{param}` holds at most {max} strings, got {}", stops.len()), Some(param)));
    }
    for (i, s) in stops.iter().enumerate() {
        if s.is_empty() {
            return Err(ApiError::bad_request(format!("`{param}[{i}]` is empty; a stop string needs at least one character"), Some(param)));
        }
        if s.len() > MAX_STOP_BYTES {
            return Err(ApiError::bad_request(format!("`{param}[{i}]` is {} bytes; at most {MAX_STOP_BYTES}", s.len()), Some(param)));
        }
    }
    Ok(())
}

/// Most choices one request may ask for (`n`).
pub const MAX_N: usize = 16;

/// Most alternatives per token `top_logprobs` (and the legacy `logprobs`) may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Parses sampling and stream settings, with the given defaults. `legacy_logprobs`: the
/// completions API's integer `logprobs` (else chat's boolean `logprobs` + `top_logprobs`).
pub fn gen_settings(v: &Json, default_top_p: f32, seed_fallback: u64, legacy_logprobs: bool) -> R<GenSettings> {
    let stream = opt_bool(v, "stream")?.unwrap_or(false);
    let include_usage = match v.get("stream_options") {
        None | Some(Json::Null) => false,
        Some(o @ Json::Object(_)) => opt_bool(o, "include_usage")?.unwrap_or(false),
        Some(_) => return Err(ApiError::bad_request("`stream_options` must be an object", Some("stream_options"))),
    };
    let mut max_tokens = None;
    for key in ["max_completion_tokens", "max_tokens"] {
        if let Some(n) = opt_int(v, key)? {
            if n < 1 {
                return Err(ApiError::bad_request(format!("`{key}` must be at least 1, got {n}"), Some(key)));
            }
            max_tokens = Some(n as usize);
            break;
        }
    }
    let temperature = opt_num(v, "temperature")?.unwrap_or(DEFAULT_TEMPERATURE as f64);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(format!("`temperature` must be in [0, 2], got {temperature}"), Some("temperature")));
    }
    let top_p = opt_num(v, "top_p")?.unwrap_or(default_top_p as f64);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_request(format!("`top_p` must be in (0, 1], got {top_p}"), Some("top_p")));
    }
    let top_k = opt_int(v, "top_k")?.unwrap_or(0);
    if top_k < 0 {
        return Err(ApiError::bad_request(format!("`top_k` must be >= 0, got {top_k}"), Some("top_k")));
    }
    let n = match opt_int(v, "n")? {
        None => 1,
        Some(n) if (1..=MAX_N as i64).contains(&n) => n as usize,
        Some(n) => return Err(ApiError::bad_request(format!("`n` must be in [1, {MAX_N}], got {n}"), Some("n"))),
    };
    for key in ["presence_penalty", "frequency_penalty"] {
        if let Some(p) = opt_num(v, key)? {
            if !(-2.0..=2.0).contains(&p) {
                return Err(ApiError::bad_request(format!("`{key}` must be in [-2, 2], got {p}"), Some(key)));
            }
            if p != 0.0 {
                return Err(ApiError::bad_request(format!("`{key}` is not supported (only 0)"), Some(key)));
            }
        }
    }
    let logprobs = if legacy_logprobs {
        // /v1/completions: `logprobs` is the number of alternatives (0 = the chosen token's only).
        match opt_int(v, "logprobs")? {
            None => None,
            Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
            Some(n) => return Err(ApiError::bad_request(format!("`logprobs` must be in [0, {MAX_TOP_LOGPROBS}], got {n}"), Some("logprobs"))),
        }
    } else {
        let top = match opt_int(v, "top_logprobs")? {
            None => None,
            Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
            Some(n) => return Err(ApiError::bad_request(format!("`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}], got {n}"), Some("top_logprobs"))),
        };
        match opt_bool(v, "logprobs")? {
            Some(true) => Some(top.unwrap_or(0)),
            _ if top.is_some_and(|t| t > 0) => return Err(ApiError::bad_request("`top_logprobs` needs `logprobs: true`", Some("top_logprobs"))),
            _ => None,
        }
    };
    let seed = match opt_int(v, "seed")? {
        Some(s) => s as u64,
        None => seed_fallback,
    };
    let stop = match v.get("stop") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Str(s)) => vec![s.clone()],
        Some(Json::Array(a)) => {
            if a.len() > 4 {
                return Err(ApiError::bad_request("`stop` holds at most 4 strings", Some("stop")));
            }
            a.iter()
                .map(|s| s.as_str().map(str::to_string).ok_or_else(|| ApiError::bad_request("`stop` must be a string or a list of strings", Some("stop"))))
                .collect::<R<Vec<_>>>()?
        }
        Some(_) => return Err(ApiError::bad_request("`stop` must be a string or a list of strings", Some("stop"))),
    };
    check_stops(&stop, 4, "stop")?;
    // Sampling knobs this server does not apply are refused when out of range (accepting
    // them silently would hide a client's mistake); `logit_bias` is refused outright.
    if let Some(m) = opt_num(v, "min_p")? {
        if !(0.0..=1.0).contains(&m) {
            return Err(ApiError::bad_request(format!("`min_p` must be in [0, 1], got {m}"), Some("min_p")));
        }
        if m != 0.0 {
            return Err(ApiError::bad_request("`min_p` is not supported (only 0)", Some("min_p")));
        }
    }
    match v.get("logit_bias") {
        None | Some(Json::Null) => {}
        Some(Json::Object(o)) if o.is_empty() => {}
        Some(Json::Object(o)) => {
            for (k, b) in o {
                let id_ok = k.parse::<u64>().is_ok_and(|id| id < u32::MAX as u64);
                let bias_ok = match b {
                    Json::Int(i) => (-100..=100).contains(i),
                    Json::Float(f) => f.is_finite() && (-100.0..=100.0).contains(f),
                    _ => false,
                };
                if !id_ok || !bias_ok {
                    return Err(ApiError::bad_request(
                        format!("`logit_bias` maps token ids to numbers in [-100, 100]; {k:?}: {} is not one", b.dumps_compact()),
                        Some("logit_bias"),
                    ));
                }
            }
            return Err(ApiError::bad_request("`logit_bias` is not supported", Some("logit_bias")));
        }
        Some(_) => return Err(ApiError::bad_request("`logit_bias` must be an object of token ids to numbers", Some("logit_bias"))),
    }
    let return_token_ids = opt_bool(v, "return_token_ids")?.unwrap_or(false);
    let sampling = SamplingParams { greedy: temperature == 0.0, temperature: temperature as f32, top_p: top_p as f32, top_k: top_k as usize, seed };
    sampling.validate().map_err(|e| ApiError::bad_request(e.to_string(), None))?;
    let cache_salt = cache_salt(v, "cache_salt")?;
    Ok(GenSettings {
        stream,
        include_usage,
        max_tokens,
        sampling,
        stop,
        return_token_ids,
        logprobs,
        n,
        session_key: super::session_key::from_body(v),
        cache_salt,
        client_key: None,
    })
}

/// A validated chat request: what to render and how to generate.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Json>,
    pub render: RenderOptions,
    pub gen: GenSettings,
    /// The images of the messages, in rendering order (user messages only).
    pub images: Vec<ImageInput>,
    pub tool_choice: ToolChoice,
    /// The request declares at least one tool.
    pub has_tools: bool,
}

impl ChatRequest {
    /// What constrained decoding must enforce, if anything: a forced tool call (`tool_choice`
    /// "required" or named) first, else the `response_format` JSON.
    pub fn reply_shape(&self) -> Option<ReplyShape> {
        let tools = || self.render.tools.clone().unwrap_or(Json::Array(Vec::new()));
        match &self.tool_choice {
            ToolChoice::Required => return Some(ReplyShape::ToolCalls { tools: tools(), only: None }),
            ToolChoice::Named(n) => return Some(ReplyShape::ToolCalls { tools: tools(), only: Some(n.clone()) }),
            _ => {}
        }
        let rf = self.render.response_format.as_ref()?;
        match rf.get("type").and_then(Json::as_str) {
            Some("json_object") => Some(ReplyShape::JsonObject),
            Some("json_schema") => Some(ReplyShape::JsonSchema(response_schema(rf).cloned().unwrap_or(Json::Bool(true)))),
            _ => None,
        }
    }

    /// Whether the reply may hold tool calls: the request declares tools and does not say
    /// `tool_choice: "none"`. Otherwise calls the model writes are dropped (vLLM, SGLang).
    pub fn tool_calls_allowed(&self) -> bool {
        self.has_tools && self.tool_choice != ToolChoice::None
    }
}

/// The prompt of a chat request without images: its segments and ids. (The server renders
/// requests with images itself: their media blocks need the pre-processed sizes.)
pub fn render_chat(tok: &crate::tokenizer::Tokenizer, req: &ChatRequest) -> R<(Vec<crate::tokenizer::Segment>, Vec<u32>)> {
    render_chat_within(tok, req, usize::MAX)
}

/// [`render_chat`] for a model whose context is `context` tokens: a prompt that does not fit is
/// refused as soon as the tokenizer passes it ([`encode_prompt`]).
pub fn render_chat_within(tok: &crate::tokenizer::Tokenizer, req: &ChatRequest, context: usize) -> R<(Vec<crate::tokenizer::Segment>, Vec<u32>)> {
    if !req.images.is_empty() {
        return Err(ApiError::bad_request("requests with images are rendered by the chat endpoint only", Some("messages")));
    }
    let segments = crate::chat::render::render(&req.messages, &req.render).map_err(|e| ApiError::bad_request(e.0, Some("messages")))?;
    let ids = encode_prompt(tok, &segments, context, "messages")?;
    Ok((segments, ids))
}

/// Tokenizes a prompt for a context of `context` tokens: it stops (400
/// `context_length_exceeded`) as soon as the ids fill the context, so a prompt far over it costs
/// at most one tokenizer chunk more than the context; and when the request was abandoned by its
/// client ([`abandoned`]).
pub fn encode_prompt(tok: &crate::tokenizer::Tokenizer, segments: &[crate::tokenizer::Segment], context: usize, param: &str) -> R<Vec<u32>> {
    use crate::tokenizer::BoundedEncodeError as B;
    let stop = abandoned;
    tok.encode_segments_bounded(segments, context.saturating_sub(1), &stop).map_err(|e| match e {
        B::TooMany { at_least, .. } => ApiError::bad_request(
            format!(
                "the prompt is more than {} tokens (tokenizing stopped at {at_least}); this model's context is {context} tokens",
                context.saturating_sub(1)
            ),
            Some(param),
        )
        .with_code("context_length_exceeded"),
        B::Stopped => abandoned_error(),
        B::Failed(e) => ApiError::bad_request(format!("tokenizing the prompt: {e}"), Some(param)),
    })
}

/// The render of a chat request as JSON: `{"text", "segments": [[string, is_special], ...],
/// "ids"}` (`k3-decode render`, `POST /tokenize`).
pub fn render_json(tok: &crate::tokenizer::Tokenizer, req: &ChatRequest) -> R<serde_json::Value> {
    render_json_within(tok, req, usize::MAX)
}

/// [`render_json`] within a context of `context` tokens ([`render_chat_within`]).
pub fn render_json_within(tok: &crate::tokenizer::Tokenizer, req: &ChatRequest, context: usize) -> R<serde_json::Value> {
    let (segments, ids) = render_chat_within(tok, req, context)?;
    let text: String = segments.iter().map(|s| s.text.as_str()).collect();
    let segs: Vec<serde_json::Value> = segments.iter().map(|s| serde_json::json!([s.text, s.markup])).collect();
    Ok(serde_json::json!({"text": text, "segments": segs, "ids": ids}))
}

/// The request's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// `"auto"` or absent.
    Auto,
    None,
    Required,
    /// `{"type": "function", "function": {"name": ...}}`: a call to this tool.
    Named(String),
}

/// Maps `reasoning_effort` to (thinking, effort). Policy (spec §2.7, §5.2): `none` turns
/// thinking off; `medium` runs as `high`, `minimal` as `low`, `xhigh` as `max` (the encoder
/// only knows low/high/max).
fn effort_policy(e: &str) -> R<(bool, Option<String>)> {
    let mapped = match e {
        "none" => return Ok((false, None)),
        "minimal" => "low",
        "medium" => "high",
        "xhigh" => "max",
        other => other,
    };
    if THINKING_EFFORTS.contains(&mapped) {
        Ok((true, Some(mapped.to_string())))
    } else {
        Err(ApiError::bad_request(format!("unsupported reasoning_effort {e:?}; use none, low, medium, high or max"), Some("reasoning_effort")))
    }
}

pub fn chat_request(v: &Json, served_model: &str, seed_fallback: u64) -> R<ChatRequest> {
    let model = check_model(v, served_model)?;
    let Some(messages) = v.get("messages") else {
        return Err(ApiError::bad_request("`messages` is required", Some("messages")));
    };
    let Some(messages) = messages.as_array() else {
        return Err(ApiError::bad_request("`messages` must be a list", Some("messages")));
    };
    if messages.is_empty() {
        return Err(ApiError::bad_request("`messages` must not be empty", Some("messages")));
    }
    let mut msgs = Vec::with_capacity(messages.len());
    let mut images = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let Some(entries) = m.as_object() else {
            return Err(ApiError::bad_request(format!("messages[{i}] must be an object"), Some("messages")));
        };
        let role =
            m.get("role").and_then(Json::as_str).ok_or_else(|| ApiError::bad_request(format!("messages[{i}] has no string `role`"), Some("messages")))?;
        let role = match role {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            other => return Err(ApiError::bad_request(format!("messages[{i}] has an unknown role {other:?}"), Some("messages"))),
        };
        // Image parts are taken out here (their bytes go to `images`); the renderer sees a bare
        // `{"type": "image_url"}` in their place and takes the media block of the next image.
        let mut content_parts: Option<Vec<Json>> = None;
        if let Some(Json::Array(parts)) = m.get("content") {
            let mut kept = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Json::as_str) {
                    Some("text") => {
                        if p.get("text").and_then(Json::as_str).is_none() {
                            return Err(ApiError::bad_request(format!("messages[{i}]: a text part needs a string `text`"), Some("messages")));
                        }
                        kept.push(p.clone());
                    }
                    Some(ty @ ("image_url" | "input_image")) => {
                        if role != "user" {
                            return Err(ApiError::bad_request(
                                format!("messages[{i}]: images are accepted in user messages only (this one is {role:?})"),
                                Some("messages"),
                            ));
                        }
                        if images.len() == MAX_IMAGES {
                            return Err(ApiError::bad_request(format!("a request holds at most {MAX_IMAGES} images"), Some("messages")));
                        }
                        let bytes = image_part_bytes(p, ty).map_err(|e| ApiError::bad_request(format!("messages[{i}].content[{j}]: {e}"), Some("messages")))?;
                        images.push(ImageInput { bytes, message: i, part: j });
                        kept.push(Json::Object(vec![("type".into(), Json::Str("image_url".into()))]));
                    }
                    Some("image") => {
                        return Err(ApiError::bad_request(
                            format!("messages[{i}].content[{j}]: send images as `image_url` parts with a data URL (data:image/png;base64,...)"),
                            Some("messages"),
                        ))
                    }
                    other => return Err(ApiError::bad_request(format!("messages[{i}]: unsupported content part type {other:?}"), Some("messages"))),
                }
            }
            content_parts = Some(kept);
        }
        let mut e: Vec<(String, Json)> = entries.to_vec();
        if let Some(slot) = e.iter_mut().find(|(k, _)| k == "role") {
            slot.1 = Json::Str(role.to_string());
        }
        if let Some(parts) = content_parts {
            if let Some(slot) = e.iter_mut().find(|(k, _)| k == "content") {
                slot.1 = Json::Array(parts);
            }
        }
        msgs.push(Json::Object(e));
    }

    let tools = match v.get("tools") {
        None | Some(Json::Null) => None,
        Some(t @ Json::Array(items)) => {
            if items.len() > MAX_TOOLS {
                return Err(ApiError::bad_request(format!("`tools` holds {} tools; at most {MAX_TOOLS}", items.len()), Some("tools")));
            }
            for (i, tool) in items.iter().enumerate() {
                let name = tool.get("function").and_then(|f| f.get("name")).and_then(Json::as_str);
                if name.is_none_or(str::is_empty) {
                    return Err(ApiError::bad_request(format!("tools[{i}] needs `function.name`"), Some("tools")));
                }
            }
            Some(t.clone())
        }
        Some(_) => return Err(ApiError::bad_request("`tools` must be a list", Some("tools"))),
    };
    let has_tools = tools.as_ref().is_some_and(Json::truthy);
    let tool_choice = match v.get("tool_choice") {
        None | Some(Json::Null) => ToolChoice::Auto,
        Some(Json::Str(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "required" if !has_tools => return Err(ApiError::bad_request("`tool_choice` is \"required\" but the request has no tools", Some("tool_choice"))),
            "required" => ToolChoice::Required,
            "none" => ToolChoice::None,
            other => return Err(ApiError::bad_request(format!("unknown tool_choice {other:?}"), Some("tool_choice"))),
        },
        Some(o @ Json::Object(_)) => {
            // {"type": "function", "function": {"name": ...}} (chat), or {"type": "function", "name": ...} (responses)
            if o.get("type").and_then(Json::as_str).is_some_and(|t| t != "function") {
                return Err(ApiError::bad_request("a named `tool_choice` must have type \"function\"", Some("tool_choice")));
            }
            let name = o.get("function").and_then(|f| f.get("name")).or_else(|| o.get("name")).and_then(Json::as_str);
            let Some(name) = name else {
                return Err(ApiError::bad_request("a named `tool_choice` needs `function.name`", Some("tool_choice")));
            };
            let declared = tools.as_ref().and_then(Json::as_array).unwrap_or_default();
            if !declared.iter().any(|t| t.get("function").and_then(|f| f.get("name")).and_then(Json::as_str) == Some(name)) {
                return Err(ApiError::bad_request(format!("`tool_choice` names the tool {name:?}, which is not in `tools`"), Some("tool_choice")));
            }
            ToolChoice::Named(name.to_string())
        }
        Some(_) => return Err(ApiError::bad_request("`tool_choice` must be a string or an object", Some("tool_choice"))),
    };
    let response_format = match v.get("response_format") {
        None | Some(Json::Null) => None,
        Some(rf @ Json::Object(_)) => match rf.get("type").and_then(Json::as_str) {
            Some("text") => None,
            Some("json_object") => Some(rf.clone()),
            Some("json_schema") => {
                if rf.get("json_schema").is_none_or(|s| s.as_object().is_none()) {
                    return Err(ApiError::bad_request("`response_format.json_schema` must be an object", Some("response_format")));
                }
                Some(rf.clone())
            }
            other => return Err(ApiError::bad_request(format!("unsupported response_format type {other:?}"), Some("response_format"))),
        },
        Some(_) => return Err(ApiError::bad_request("`response_format` must be an object", Some("response_format"))),
    };

    // Thinking: chat_template_kwargs.thinking / enable_thinking, reasoning_effort.
    let kwargs = v.get("chat_template_kwargs").filter(|k| !k.is_null());
    if kwargs.is_some_and(|k| k.as_object().is_none()) {
        return Err(ApiError::bad_request("`chat_template_kwargs` must be an object", Some("chat_template_kwargs")));
    }
    let mut thinking = true;
    let mut effort = Some(DEFAULT_EFFORT.to_string());
    if let Some(e) = opt_str(v, "reasoning_effort")? {
        (thinking, effort) = effort_policy(e)?;
    }
    if let Some(k) = kwargs {
        if let Some(e) = opt_str(k, "thinking_effort")? {
            (thinking, effort) = effort_policy(e)?;
        }
        for key in ["thinking", "enable_thinking"] {
            if let Some(t) = opt_bool(k, key)? {
                thinking = t;
            }
        }
    }
    // The release encoder's `response_schema` keyword: a JSON schema for the reply, the same
    // as `response_format: {"type": "json_schema", "json_schema": {"schema": ...}}`.
    let mut response_format = response_format;
    if let Some(schema) = kwargs.and_then(|k| k.get("response_schema")).filter(|s| !s.is_null()) {
        if !matches!(schema, Json::Object(_) | Json::Bool(_)) {
            return Err(ApiError::bad_request("`chat_template_kwargs.response_schema` must be a JSON schema object", Some("chat_template_kwargs")));
        }
        if response_format.is_some() {
            return Err(ApiError::bad_request("give either `response_format` or `chat_template_kwargs.response_schema`, not both", Some("response_format")));
        }
        response_format = Some(Json::Object(vec![
            ("type".into(), Json::Str("json_schema".into())),
            ("json_schema".into(), Json::Object(vec![("schema".into(), schema.clone())])),
        ]));
    }
    if let Some(rf) = &response_format {
        check_schema(rf)?;
    }
    if let Some(t) = opt_bool(v, "enable_thinking")? {
        thinking = t;
    }
    if thinking && effort.is_none() {
        effort = Some(DEFAULT_EFFORT.to_string());
    }

    let gen = gen_settings(v, DEFAULT_TOP_P, seed_fallback, false)?;
    // The note of spec §2.6: "required" and "none" (the latter only with tools: OpenAI clients
    // often send it by default); a named choice renders nothing, as the release encoder does
    // with an object, and is enforced by constrained decoding.
    let rendered_choice = match &tool_choice {
        ToolChoice::Required => Some(Json::Str("required".into())),
        ToolChoice::None if has_tools => Some(Json::Str("none".into())),
        _ => None,
    };
    let render = RenderOptions {
        tools,
        tool_choice: rendered_choice,
        response_format,
        thinking,
        thinking_effort: effort,
        add_generation_prompt: true,
        image_prompts: None,
        placeholders_in_text: false,
    };
    Ok(ChatRequest { model, messages: msgs, render, gen, images, tool_choice, has_tools })
}

/// Most images one chat request may hold (each runs the vision tower).
pub const MAX_IMAGES: usize = 16;

/// Most tools one request may declare (OpenAI's limit is 128).
pub const MAX_TOOLS: usize = 512;

/// A `json_schema` response format's schema must be an object or `true`: `false` accepts no
/// reply at all, and anything else (`[1,2,3]`, a string) is not a schema (both were taken
/// before and gave unconstrained output).
fn check_schema(rf: &Json) -> R<()> {
    if rf.get("type").and_then(Json::as_str) != Some("json_schema") {
        return Ok(());
    }
    match response_schema(rf) {
        None | Some(Json::Object(_)) | Some(Json::Bool(true)) => Ok(()),
        Some(Json::Bool(false)) => Err(ApiError::bad_request("the response schema is `false`, which no reply satisfies", Some("response_format"))),
        Some(other) => {
            Err(ApiError::bad_request(format!("the response schema must be a JSON schema object, not {}", other.xtml_type()), Some("response_format")))
        }
    }
}

/// One image of a chat request: the decoded bytes of its data URL and where it was.
#[derive(Debug, Clone)]
pub struct ImageInput {
    pub bytes: Vec<u8>,
    pub message: usize,
    pub part: usize,
}

impl ImageInput {
    /// `messages[i].content[j]`, for errors.
    pub fn place(&self) -> String {
        format!("messages[{}].content[{}]", self.message, self.part)
    }
}

/// The URL of an image part: `{"type": "image_url", "image_url": {"url": ...}}` (OpenAI chat),
/// `"image_url": "..."` (a common shorthand), `{"type": "input_image", "image_url": "..."}`
/// (OpenAI responses).
fn image_part_url<'a>(p: &'a Json, ty: &str) -> Result<&'a str, ImageUrlError> {
    match p.get("image_url") {
        Some(Json::Str(u)) => Ok(u),
        Some(o @ Json::Object(_)) => o.get("url").and_then(Json::as_str).ok_or(ImageUrlError::UrlNotString),
        _ => Err(ImageUrlError::MissingUrl(ty.to_string())),
    }
}

/// Largest decoded image accepted (the pre-processor's own limit).
pub const MAX_IMAGE_BYTES: usize = 64 << 20;

/// Largest request body: a data-URL image of [`MAX_IMAGE_BYTES`] is 4/3 of it in base64.
pub const MAX_BODY_BYTES: usize = MAX_IMAGE_BYTES / 3 * 4 + (8 << 20);

/// Why an image part gives no image bytes (a client error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageUrlError {
    #[error("`image_url.url` must be a string")]
    UrlNotString,
    /// The part's type.
    #[error("an {0} part needs `image_url` (an object with `url`, or a string)")]
    MissingUrl(String),
    /// An http(s) URL (its first 48 characters).
    #[error("image URLs are not fetched ({0:?}): this server does not reach the internet; send the image inline as a data URL (data:image/png;base64,...)")]
    NotFetched(String),
    /// Any other non-`data:` URL (its first 48 characters).
    #[error("unsupported image URL {0:?}; send the image inline as a data URL (data:image/png;base64,...)")]
    Unsupported(String),
    #[error("the data URL has no `,` before its data")]
    NoComma,
    /// The declared media type.
    #[error("the data URL holds {0:?}, not an image")]
    NotImage(String),
    #[error("the data URL must be base64-encoded (data:image/png;base64,...)")]
    NotBase64,
    #[error("the image is larger than {} MiB", MAX_IMAGE_BYTES >> 20)]
    TooLarge,
    #[error("the data URL's base64 is invalid: {0}")]
    Base64(base64::DecodeError),
    #[error("the data URL holds no data")]
    Empty,
}

/// The image bytes of an image part: only `data:` URLs (the decoder node does not fetch URLs).
fn image_part_bytes(p: &Json, ty: &str) -> Result<Vec<u8>, ImageUrlError> {
    let url = image_part_url(p, ty)?;
    decode_data_url(url)
}

/// Decodes `data:[<media type>][;params];base64,<data>`. The media type, when given, must be an
/// image type; the bytes themselves are sniffed by the image decoder (PNG, JPEG, WebP).
pub fn decode_data_url(url: &str) -> Result<Vec<u8>, ImageUrlError> {
    use base64::Engine as _;
    let is_data = url.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("data:"));
    if !is_data {
        let shown: String = url.chars().take(48).collect();
        let scheme = url.split_once(':').map(|(s, _)| s).filter(|s| s.len() < 16 && !s.is_empty());
        return Err(match scheme {
            Some(s) if s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https") => ImageUrlError::NotFetched(shown),
            _ => ImageUrlError::Unsupported(shown),
        });
    }
    let rest = &url[5..];
    let Some((meta, data)) = rest.split_once(',') else {
        return Err(ImageUrlError::NoComma);
    };
    let mut fields = meta.split(';');
    let mime = fields.next().unwrap_or("").trim();
    let base64 = fields.any(|f| f.trim().eq_ignore_ascii_case("base64"));
    if !mime.is_empty() && !mime.to_ascii_lowercase().starts_with("image/") {
        return Err(ImageUrlError::NotImage(mime.to_string()));
    }
    if !base64 {
        return Err(ImageUrlError::NotBase64);
    }
    // Lenient on whitespace (wrapped base64) and on missing padding.
    let clean: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    if clean.len() / 4 * 3 > MAX_IMAGE_BYTES + 3 {
        return Err(ImageUrlError::TooLarge);
    }
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new().with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let bytes = engine.decode(clean.as_bytes()).map_err(ImageUrlError::Base64)?;
    if bytes.is_empty() {
        return Err(ImageUrlError::Empty);
    }
    Ok(bytes)
}

/// A validated `/v1/completions` request.
#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    pub gen: GenSettings,
}

pub fn completion_request(v: &Json, served_model: &str, vocab: usize, seed_fallback: u64) -> R<CompletionRequest> {
    let model = check_model(v, served_model)?;
    let ids_of = |a: &[Json]| -> R<Vec<u32>> {
        a.iter()
            .map(|x| match x {
                Json::Int(i) if *i >= 0 && (*i as u64) < vocab as u64 => Ok(*i as u32),
                _ => Err(ApiError::bad_request(format!("prompt token {x:?} is not an id in [0, {vocab})"), Some("prompt"))),
            })
            .collect()
    };
    let prompt = match v.get("prompt") {
        None | Some(Json::Null) => return Err(ApiError::bad_request("`prompt` is required", Some("prompt"))),
        Some(Json::Str(s)) => Prompt::Text(s.clone()),
        Some(Json::Array(a)) if a.len() == 1 && a[0].as_str().is_some() => Prompt::Text(a[0].as_str().unwrap_or_default().to_string()),
        Some(Json::Array(a)) if a.len() == 1 && a[0].as_array().is_some() => Prompt::Ids(ids_of(a[0].as_array().unwrap_or_default())?),
        Some(Json::Array(a)) if a.iter().all(|x| matches!(x, Json::Int(_) | Json::UInt(_))) => Prompt::Ids(ids_of(a)?),
        Some(_) => return Err(ApiError::bad_request("`prompt` must be a string, a list of token ids, or a list with one of them", Some("prompt"))),
    };
    if opt_bool(v, "echo")?.unwrap_or(false) {
        return Err(ApiError::bad_request("`echo` is not supported", Some("echo")));
    }
    if opt_int(v, "best_of")?.is_some_and(|b| b != 1) {
        return Err(ApiError::bad_request("only `best_of` = 1 is supported", Some("best_of")));
    }
    let gen = gen_settings(v, 1.0, seed_fallback, true)?;
    Ok(CompletionRequest { model, prompt, gen })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    #[test]
    fn tokenizing_stops_at_the_context_and_when_its_client_left() {
        let dir = tempfile::tempdir().unwrap();
        k3_protocol::synth::tokenizer::write_tokenizer(dir.path(), 1024, 3000).unwrap();
        std::fs::write(dir.path().join("config.json"), r#"{"text_config": {"vocab_size": 1024}}"#).unwrap();
        let tok = crate::tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
        // 2 MB: five tokenizer chunks of 400,000 characters
        let segs = [crate::tokenizer::Segment::text("many words ".repeat(2 << 20 >> 4 << 1))];
        let whole = encode_prompt(&tok, &segs, usize::MAX, "prompt").unwrap();
        assert_eq!(whole, tok.encode_segments(&segs).unwrap(), "bounded encoding gives the same ids");
        // a client that left: the first chunk is the last
        let e = abandonable(Arc::new(AtomicBool::new(true)), || encode_prompt(&tok, &segs, usize::MAX, "prompt")).unwrap_err();
        assert_eq!(e.code, Some("client_left"), "{}", e.message);
        // a context of 1,000 tokens: refused after the first chunk
        let e = encode_prompt(&tok, &segs, 1000, "prompt").unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert!(e.message.contains("tokenizing stopped at"), "{}", e.message);
        assert!(abandonable(Arc::new(AtomicBool::new(false)), || encode_prompt(&tok, &segs, usize::MAX, "prompt")).is_ok());
    }
}
