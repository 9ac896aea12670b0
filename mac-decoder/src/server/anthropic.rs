//! The Anthropic Messages API of `k3-decode serve`: `POST /v1/messages` (whole replies or
//! Anthropic's server-sent events) and `POST /v1/messages/count_tokens`.
//!
//! A Messages body is translated into the OpenAI chat body the server already takes and
//! validated by [`api::chat_request`]; it then runs through the one chat pipeline (rendering,
//! constrained decoding for forced tools, the engine, the output parser, stop strings). Only
//! the reply is written in Anthropic's shape: `thinking`, `text` and `tool_use` content blocks,
//! `stop_reason`, `usage`. Errors (including the guard's refusals) are rewritten by
//! [`error_shape`] into `{"type": "error", "error": {"type", "message"}}`.
//!
//! The mapping:
//! - `system` (a string or text blocks) → a system message; `tool_result` blocks of a user
//!   message → tool messages (before the message's other blocks); `tool_use` blocks of an
//!   assistant message → its tool calls; `thinking` blocks → its reasoning; `image` blocks with
//!   a `base64` source → image parts (data URLs).
//! - `tools` (`name`, `description`, `input_schema`) → function tools; `tool_choice` `auto`,
//!   `any`, `tool` (named) and `none` → OpenAI's `auto`, `required`, named and `none`.
//! - `thinking`: `enabled` (with `budget_tokens`), `adaptive` and `between_tools` turn K3's
//!   thinking on, `disabled` or absent turn it off. The effort note is `output_config.effort`
//!   (`low`; `medium`, `high` → `high`; `xhigh`, `max` → `max`), else chosen by the budget
//!   (≤ 4,096: `low`, ≤ 16,384: `high`, else `max`; K3 has no token budget), else `max`.
//! - `output_config.format` (`json_schema`) → `response_format` json_schema (constrained).
//! - `stop_sequences` → stop strings (any number); `max_tokens` (required), `temperature`
//!   (0–1), `top_p`, `top_k` as given (older clients send them); `seed` (an extension) fixes
//!   the sampler.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json as AxJson;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api::{self, bad, obj, s, ApiError, ChatRequest};
use super::pipeline::{chat_prompt, content_with_stops, fail, finish_all, now_secs, off_runtime, start_chat, AppState, ChatJob, ChatStep};
use super::seal::Sealer;
use crate::chat::parse::{FinishReason, OutputEvent, ToolCall};
use crate::chat::Json;
use crate::engine::GenEvent;

type R<T> = Result<T, ApiError>;

/// Thinking effort note for an Anthropic `budget_tokens`.
fn effort_of_budget(budget: i64) -> &'static str {
    match budget {
        ..=4096 => "low",
        4097..=16384 => "high",
        _ => "max",
    }
}

/// The text of a `system` value or of a `tool_result`'s content: a string, or text blocks.
fn text_blocks(v: &Json, what: &str) -> R<Json> {
    match v {
        Json::Str(_) => Ok(v.clone()),
        Json::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (j, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Json::as_str), b.get("text")) {
                    (Some("text"), Some(Json::Str(t))) => parts.push(obj(vec![("type", s("text")), ("text", s(t.clone()))])),
                    (ty, _) => return Err(bad(format!("{what}[{j}]: only text blocks are accepted here, not {ty:?}"), "messages")),
                }
            }
            Ok(Json::Array(parts))
        }
        _ => Err(bad(format!("{what} must be a string or a list of text blocks"), "messages")),
    }
}

/// An `image` block's source as an OpenAI image part.
fn image_part(b: &Json, place: &str) -> R<Json> {
    let Some(src) = b.get("source").filter(|x| x.as_object().is_some()) else {
        return Err(bad(format!("{place}: an image block needs a `source` object"), "messages"));
    };
    let url = match src.get("type").and_then(Json::as_str) {
        Some("base64") => {
            let media = src.get("media_type").and_then(Json::as_str).unwrap_or("");
            let Some(data) = src.get("data").and_then(Json::as_str) else {
                return Err(bad(format!("{place}: a base64 image source needs string `data`"), "messages"));
            };
            format!("data:{media};base64,{data}")
        }
        // Refused downstream with the reason (this server does not fetch URLs).
        Some("url") => src.get("url").and_then(Json::as_str).unwrap_or("").to_string(),
        other => return Err(bad(format!("{place}: unsupported image source type {other:?} (send `base64`)"), "messages")),
    };
    Ok(obj(vec![("type", s("image_url")), ("image_url", obj(vec![("url", s(url))]))]))
}

/// Translates one Anthropic message into OpenAI messages (a user message with `tool_result`
/// blocks becomes tool messages followed by the rest).
fn message(i: usize, m: &Json, out: &mut Vec<Json>, sealer: &Sealer) -> R<()> {
    if m.as_object().is_none() {
        return Err(bad(format!("messages[{i}] must be an object"), "messages"));
    }
    let role = match m.get("role").and_then(Json::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        // Claude Code sends its environment description as a `system` message inside
        // `messages`: rendered where it stands, as K3's system message.
        Some("system") => {
            let content = match m.get("content") {
                None | Some(Json::Null) => s(""),
                Some(c) => text_blocks(c, &format!("messages[{i}].content"))?,
            };
            out.push(obj(vec![("role", s("system")), ("content", content)]));
            return Ok(());
        }
        Some(other) => return Err(bad(format!("messages[{i}]: unknown role {other:?} (user, assistant or system)"), "messages")),
        None => return Err(bad(format!("messages[{i}] has no string `role`"), "messages")),
    };
    let blocks = match m.get("content") {
        Some(c @ Json::Str(_)) => {
            out.push(obj(vec![("role", s(role)), ("content", c.clone())]));
            return Ok(());
        }
        Some(Json::Array(b)) => b,
        _ => return Err(bad(format!("messages[{i}].content must be a string or a list of content blocks"), "messages")),
    };
    let mut parts = Vec::new();
    let mut tool_messages = Vec::new();
    let mut tool_calls = Vec::new();
    let mut reasoning = String::new();
    for (j, b) in blocks.iter().enumerate() {
        let place = format!("messages[{i}].content[{j}]");
        let ty = b.get("type").and_then(Json::as_str);
        match (role, ty) {
            (_, Some("text")) => match b.get("text") {
                Some(Json::Str(t)) => parts.push(obj(vec![("type", s("text")), ("text", s(t.clone()))])),
                _ => return Err(bad(format!("{place}: a text block needs a string `text`"), "messages")),
            },
            ("user", Some("image")) => parts.push(image_part(b, &place)?),
            ("user", Some("tool_result")) => {
                let Some(id) = b.get("tool_use_id").and_then(Json::as_str) else {
                    return Err(bad(format!("{place}: a tool_result block needs a string `tool_use_id`"), "messages"));
                };
                let content = match b.get("content") {
                    None | Some(Json::Null) => s(""),
                    Some(c) => text_blocks(c, &format!("{place}.content"))?,
                };
                tool_messages.push(obj(vec![("role", s("tool")), ("tool_call_id", s(id)), ("content", content)]));
            }
            ("assistant", Some("tool_use")) => {
                let (Some(id), Some(name)) = (b.get("id").and_then(Json::as_str), b.get("name").and_then(Json::as_str)) else {
                    return Err(bad(format!("{place}: a tool_use block needs string `id` and `name`"), "messages"));
                };
                let input = b.get("input").filter(|x| x.as_object().is_some()).cloned().unwrap_or(Json::Object(Vec::new()));
                tool_calls.push(obj(vec![("id", s(id)), ("type", s("function")), ("function", obj(vec![("name", s(name)), ("arguments", input)]))]));
            }
            ("assistant", Some("thinking")) => {
                // The signature this server sealed holds the reasoning exactly (also when the
                // client never saw it: `display: "omitted"`); else the block's own text.
                match b.get("signature").and_then(Json::as_str).and_then(|sig| sealer.open(sig)) {
                    Some(t) => reasoning.push_str(&t),
                    None => {
                        if let Some(t) = b.get("thinking").and_then(Json::as_str) {
                            reasoning.push_str(t);
                        }
                    }
                }
            }
            // Nothing to render: the model never wrote it in K3's format.
            ("assistant", Some("redacted_thinking")) => {}
            (_, other) => return Err(bad(format!("{place}: content block type {other:?} is not supported in a {role} message"), "messages")),
        }
    }
    out.extend(tool_messages);
    if role == "user" {
        if !parts.is_empty() {
            out.push(obj(vec![("role", s("user")), ("content", Json::Array(parts))]));
        }
        return Ok(());
    }
    let mut e = vec![("role", s("assistant")), ("content", Json::Array(parts))];
    if !reasoning.is_empty() {
        e.push(("reasoning_content", s(reasoning)));
    }
    if !tool_calls.is_empty() {
        e.push(("tool_calls", Json::Array(tool_calls)));
    }
    out.push(obj(e));
    Ok(())
}

/// The OpenAI chat body of a Messages body (`count`: a count_tokens body, which has no
/// `max_tokens`), and its stop sequences.
fn translate(v: &Json, count: bool, sealer: &Sealer) -> R<(Json, Vec<String>, Shown)> {
    let mut body: Vec<(&str, Json)> = Vec::new();
    if let Some(m) = v.get("model") {
        body.push(("model", m.clone()));
    }
    if !count {
        match v.get("max_tokens") {
            Some(Json::Int(n)) if *n >= 1 => body.push(("max_tokens", Json::Int(*n))),
            Some(other) => return Err(bad(format!("`max_tokens` must be an integer >= 1, got {}", other.dumps_compact()), "max_tokens")),
            None => return Err(bad("`max_tokens` is required", "max_tokens")),
        }
    }
    let mut messages = Vec::new();
    match v.get("system") {
        None | Some(Json::Null) => {}
        Some(sys) => messages.push(obj(vec![("role", s("system")), ("content", text_blocks(sys, "system")?)])),
    }
    let Some(msgs) = v.get("messages").and_then(Json::as_array) else {
        return Err(bad("`messages` is required and must be a list", "messages"));
    };
    if msgs.is_empty() {
        return Err(bad("`messages` must not be empty", "messages"));
    }
    for (i, m) in msgs.iter().enumerate() {
        message(i, m, &mut messages, sealer)?;
    }
    clear_thinking(v, &mut messages)?;
    body.push(("messages", Json::Array(messages)));

    let mut has_tools = false;
    match v.get("tools") {
        None | Some(Json::Null) => {}
        Some(Json::Array(tools)) => {
            let mut fns = Vec::with_capacity(tools.len());
            for (i, t) in tools.iter().enumerate() {
                if let Some(ty) = t.get("type").and_then(Json::as_str).filter(|ty| *ty != "custom") {
                    return Err(bad(format!("tools[{i}]: server tool {ty:?} is not supported (only client tools with `input_schema`)"), "tools"));
                }
                let Some(name) = t.get("name").and_then(Json::as_str).filter(|n| !n.is_empty()) else {
                    return Err(bad(format!("tools[{i}] needs a non-empty `name`"), "tools"));
                };
                let Some(schema) = t.get("input_schema").filter(|x| x.as_object().is_some()) else {
                    return Err(bad(format!("tools[{i}] ({name}) needs an `input_schema` object"), "tools"));
                };
                let mut f = vec![("name", s(name))];
                if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
                    f.push(("description", d.clone()));
                }
                f.push(("parameters", schema.clone()));
                fns.push(obj(vec![("type", s("function")), ("function", obj(f))]));
            }
            has_tools = !fns.is_empty();
            body.push(("tools", Json::Array(fns)));
        }
        Some(_) => return Err(bad("`tools` must be a list", "tools")),
    }
    let mut forced = false;
    match v.get("tool_choice") {
        None | Some(Json::Null) => {}
        Some(tc @ Json::Object(_)) => {
            let choice = match tc.get("type").and_then(Json::as_str) {
                Some("auto") => s("auto"),
                Some("none") => s("none"),
                Some("any") if !has_tools => return Err(bad("`tool_choice` is \"any\" but the request has no tools", "tool_choice")),
                Some("any") => s("required"),
                Some("tool") => {
                    let Some(name) = tc.get("name").and_then(Json::as_str) else {
                        return Err(bad("`tool_choice` of type \"tool\" needs a `name`", "tool_choice"));
                    };
                    obj(vec![("type", s("function")), ("function", obj(vec![("name", s(name))]))])
                }
                other => return Err(bad(format!("unknown tool_choice type {other:?} (auto, any, tool or none)"), "tool_choice")),
            };
            forced = matches!(tc.get("type").and_then(Json::as_str), Some("any" | "tool"));
            body.push(("tool_choice", choice));
        }
        Some(_) => return Err(bad("`tool_choice` must be an object such as {\"type\": \"auto\"}", "tool_choice")),
    }

    // Thinking: K3's switch, and the effort note from `output_config.effort`, else from the
    // budget of `enabled`, else K3's default (`max`).
    let output_config = v.get("output_config").filter(|o| !o.is_null());
    if output_config.is_some_and(|o| o.as_object().is_none()) {
        return Err(bad("`output_config` must be an object", "output_config"));
    }
    let mut effort = match output_config.and_then(|o| o.get("effort")).filter(|e| !e.is_null()) {
        None => None,
        Some(Json::Str(e)) => Some(match e.as_str() {
            "low" => "low",
            "medium" | "high" => "high",
            "xhigh" | "max" => "max",
            other => return Err(bad(format!("unknown `output_config.effort` {other:?} (low, medium, high, xhigh or max)"), "output_config")),
        }),
        Some(_) => return Err(bad("`output_config.effort` must be a string", "output_config")),
    };
    let thinking = match v.get("thinking") {
        None | Some(Json::Null) => false,
        Some(t @ Json::Object(_)) => match t.get("type").and_then(Json::as_str) {
            Some("disabled") => false,
            Some("enabled") => {
                let budget = match t.get("budget_tokens") {
                    Some(Json::Int(b)) if *b >= 1024 => *b,
                    _ => return Err(bad("`thinking.budget_tokens` must be an integer >= 1024", "thinking")),
                };
                effort = effort.or(Some(effort_of_budget(budget)));
                true
            }
            Some("adaptive" | "between_tools") => true,
            other => return Err(bad(format!("unknown thinking type {other:?} (enabled, adaptive, between_tools or disabled)"), "thinking")),
        },
        Some(_) => return Err(bad("`thinking` must be an object", "thinking")),
    };
    let shown = match v.get("thinking").and_then(|t| t.get("display")).filter(|d| !d.is_null()) {
        None => Shown::Summarized,
        Some(Json::Str(d)) if d == "summarized" => Shown::Summarized,
        Some(Json::Str(d)) if d == "omitted" => Shown::Omitted,
        Some(other) => return Err(bad(format!("unknown thinking.display {} (summarized or omitted)", other.dumps_compact()), "thinking")),
    };
    if thinking && forced {
        return Err(bad("thinking may not be enabled when `tool_choice` forces tool use", "thinking"));
    }
    let mut kwargs = vec![("thinking", Json::Bool(thinking))];
    if let Some(e) = effort.filter(|_| thinking) {
        kwargs.push(("thinking_effort", s(e)));
    }
    // Structured output: `output_config.format` = {"type": "json_schema", "schema": {...}}.
    match output_config.and_then(|o| o.get("format")).filter(|f| !f.is_null()) {
        None => {}
        Some(f) if f.get("type").and_then(Json::as_str) == Some("json_schema") && f.get("schema").is_some_and(|x| x.as_object().is_some()) => {
            let schema = f.get("schema").cloned().unwrap_or(Json::Null);
            body.push(("response_format", obj(vec![("type", s("json_schema")), ("json_schema", obj(vec![("schema", schema)]))])));
        }
        Some(_) => return Err(bad("`output_config.format` must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config")),
    }
    body.push(("chat_template_kwargs", obj(kwargs)));

    if let Some(t) = v.get("temperature").filter(|t| !t.is_null()) {
        let ok = match t {
            Json::Int(i) => (0..=1).contains(i),
            Json::Float(f) => (0.0..=1.0).contains(f),
            _ => false,
        };
        if !ok {
            return Err(bad(format!("`temperature` must be a number in [0, 1], got {}", t.dumps_compact()), "temperature"));
        }
        body.push(("temperature", t.clone()));
    }
    for key in ["top_p", "top_k", "seed", "stream"] {
        if let Some(x) = v.get(key).filter(|x| !x.is_null()) {
            body.push((key, x.clone()));
        }
    }
    let stops = match v.get("stop_sequences") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(|| bad("`stop_sequences` must be a list of strings", "stop_sequences")))
            .collect::<R<Vec<_>>>()?,
        Some(_) => return Err(bad("`stop_sequences` must be a list of strings", "stop_sequences")),
    };
    Ok((obj(body), stops, shown))
}

/// Whether the reply's thinking text is shown (`display: "summarized"`, the default: K3's
/// reasoning as is) or left out (`"omitted"`: an empty `thinking` with the sealed signature).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shown {
    Summarized,
    Omitted,
}

/// `context_management.edits`: `clear_thinking_20251015` drops the reasoning of all but the
/// last `keep` assistant turns (`{"type": "thinking_turns", "value": N}`; `"all"` keeps every
/// one); other edits (`clear_tool_uses_…`) are accepted and not applied (logged).
fn clear_thinking(v: &Json, messages: &mut [Json]) -> R<()> {
    let Some(edits) = v.get("context_management").and_then(|c| c.get("edits")) else { return Ok(()) };
    let Some(edits) = edits.as_array() else {
        return Err(bad("`context_management.edits` must be a list", "context_management"));
    };
    for e in edits {
        match e.get("type").and_then(Json::as_str) {
            Some(t) if t.starts_with("clear_thinking") => {
                let keep = match e.get("keep") {
                    None | Some(Json::Null) => 1,
                    Some(Json::Str(k)) if k == "all" => continue,
                    Some(k) if k.get("type").and_then(Json::as_str) == Some("thinking_turns") => match k.get("value") {
                        Some(Json::Int(n)) if *n >= 0 => *n as usize,
                        _ => return Err(bad("`keep.value` of a clear_thinking edit must be an integer >= 0", "context_management")),
                    },
                    Some(other) => return Err(bad(format!("unknown `keep` of a clear_thinking edit: {}", other.dumps_compact()), "context_management")),
                };
                let turns: Vec<usize> =
                    messages.iter().enumerate().filter(|(_, m)| m.get("role").and_then(Json::as_str) == Some("assistant")).map(|(i, _)| i).collect();
                for &i in &turns[..turns.len().saturating_sub(keep)] {
                    if let Json::Object(entries) = &mut messages[i] {
                        entries.retain(|(k, _)| k != "reasoning_content");
                    }
                }
            }
            other => tracing::debug!(edit = ?other, "context_management edit accepted, not applied"),
        }
    }
    Ok(())
}

/// A validated Messages request: the chat request it runs as (its stop strings are the
/// `stop_sequences`).
pub fn messages_request(v: &Json, served_model: &str, seed_fallback: u64, count: bool, sealer: &Sealer) -> R<(ChatRequest, Shown)> {
    let (body, stops, shown) = translate(v, count, sealer)?;
    let mut req = api::chat_request(&body, served_model, seed_fallback)?;
    api::check_stops(&stops, api::MAX_STOP_SEQUENCES, "stop_sequences")?;
    req.gen.stop = stops;
    req.gen.session_key = super::session_key::from_body(v);
    // `cache_salt` at the top level (as vLLM takes it) or in `metadata`
    let top = api::cache_salt(v, "cache_salt")?;
    let inner = match v.get("metadata") {
        Some(m @ Json::Object(_)) => api::cache_salt(m, "metadata.cache_salt")?,
        _ => None,
    };
    if let (Some(a), Some(b)) = (&top, &inner) {
        if a != b {
            return Err(bad("`cache_salt` and `metadata.cache_salt` differ; send one", "cache_salt"));
        }
    }
    req.gen.cache_salt = top.or(inner);
    Ok((req, shown))
}

/// `POST /v1/messages`.
pub async fn messages(State(st): State<Arc<AppState>>, key: Option<axum::Extension<super::guard::ClientKey>>, body: Bytes) -> Response {
    st.metrics.request("messages");
    let n = st.next_id();
    let (mut req, shown) = match off_runtime({
        let st = st.clone();
        move || messages_request(&api::parse_body(&body)?, &st.model_id, st.seed(n), false, &st.sealer)
    })
    .await
    {
        Ok(r) => r,
        Err(e) => return fail(&st, e),
    };
    req.gen.client_key = key.map(|k| k.0 .0);
    let stamp = format!("{:x}{:04x}", now_secs(), n & 0xffff);
    let job = match start_chat(&st, &req, &format!("toolu_{stamp}")).await {
        Ok(j) => j,
        Err(e) => return fail(&st, e),
    };
    let id = format!("msg_{stamp}");
    if req.gen.stream {
        stream(st, job, id, req, shown).await
    } else {
        whole(st, job, id, req, shown).await
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt the same body would run.
pub async fn count_tokens(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    st.metrics.request("count_tokens");
    let req = match off_runtime({
        let st = st.clone();
        move || messages_request(&api::parse_body(&body)?, &st.model_id, 0, true, &st.sealer).map(|(r, _)| r)
    })
    .await
    {
        Ok(r) => r,
        Err(e) => return fail(&st, e),
    };
    match chat_prompt(&st, &req).await {
        Ok((ids, _)) => AxJson(json!({"input_tokens": ids.len()})).into_response(),
        Err(e) => fail(&st, e),
    }
}

/// The stop sequence that cut `content` (the earliest in the text).
fn matched_stop(content: &str, stops: &[String]) -> Option<String> {
    stops.iter().filter(|s| !s.is_empty()).filter_map(|s| content.find(s.as_str()).map(|p| (p, s))).min_by_key(|(p, _)| *p).map(|(_, s)| s.clone())
}

/// `stop_reason` and `stop_sequence` of a finished run.
fn stop_reason(finish: FinishReason, stopped_by_string: bool, content: &str, stops: &[String]) -> (&'static str, Value) {
    if stopped_by_string {
        return ("stop_sequence", matched_stop(content, stops).map_or(Value::Null, Value::String));
    }
    let r = match finish {
        FinishReason::Stop => "end_turn",
        FinishReason::ToolCalls => "tool_use",
        FinishReason::Length => "max_tokens",
    };
    (r, Value::Null)
}

/// A tool call's arguments as the block's `input` object (arguments that are not a JSON object,
/// which only an unconstrained model writes, are kept whole under `"arguments"`).
fn tool_input(t: &ToolCall) -> Value {
    match serde_json::from_str::<Value>(&t.arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            tracing::warn!(tool = %t.name, "tool call arguments are not a JSON object; sent as {{\"arguments\": <text>}}");
            json!({"arguments": t.arguments})
        }
    }
}

fn tool_use_block(t: &ToolCall) -> Value {
    json!({"type": "tool_use", "id": t.id, "name": t.name, "input": tool_input(t)})
}

fn usage(job: &ChatJob) -> Value {
    let run = &job.runs[0];
    json!({
        "input_tokens": job.prompt.len() - run.reused.min(job.prompt.len()),
        "output_tokens": run.tokens.len(),
        "cache_read_input_tokens": run.reused,
        "cache_creation_input_tokens": 0,
        // where the prompt first differed from the server's held states (an extension)
        "prefix_first_difference": run.first_difference,
    })
}

async fn whole(st: Arc<AppState>, mut job: ChatJob, id: String, req: ChatRequest, shown: Shown) -> Response {
    let finish = match finish_all(&mut job).await {
        Ok(f) => f[0],
        Err(e) => return fail(&st, e),
    };
    let run = &job.runs[0];
    let out = run.parser.output();
    let mut content = Vec::new();
    if !out.reasoning.is_empty() {
        let text = if shown == Shown::Omitted { "" } else { out.reasoning.as_str() };
        content.push(json!({"type": "thinking", "thinking": text, "signature": st.sealer.seal(&out.reasoning)}));
    }
    let text = content_with_stops(&out.content, &req.gen.stop);
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    if !run.stopped_by_string {
        content.extend(out.tool_calls.iter().map(tool_use_block));
    }
    let (reason, seq) = stop_reason(finish, run.stopped_by_string, &out.content, &req.gen.stop);
    AxJson(json!({
        "id": id, "type": "message", "role": "assistant", "model": req.model,
        "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": usage(&job),
    }))
    .into_response()
}

/// One server-sent event: `event: <type>` and its JSON (which repeats the type).
fn ev(data: Value) -> Result<Event, Infallible> {
    let name = data["type"].as_str().unwrap_or("error").to_string();
    Ok(Event::default().event(name).data(data.to_string()))
}

fn error_event(e: &ApiError) -> Result<Event, Infallible> {
    ev(json!({"type": "error", "error": {"type": error_type(e.status), "message": e.message}}))
}

#[derive(Clone, Copy, PartialEq)]
enum Open {
    Thinking,
    Text,
}

/// Turns parser events into content-block events, one block per run of the same kind. A
/// thinking block ends with its sealed signature (`signature_delta`); with `display:
/// "omitted"` it carries no `thinking_delta` at all.
struct Blocks {
    next: usize,
    open: Option<Open>,
    shown: Shown,
    sealer: Sealer,
    /// The open thinking block's text (for its signature).
    reasoning: String,
}

impl Blocks {
    fn new(shown: Shown, sealer: Sealer) -> Self {
        Blocks { next: 0, open: None, shown, sealer, reasoning: String::new() }
    }

    fn close(&mut self, out: &mut Vec<Value>) {
        if let Some(kind) = self.open.take() {
            if kind == Open::Thinking {
                let signature = self.sealer.seal(&std::mem::take(&mut self.reasoning));
                out.push(json!({"type": "content_block_delta", "index": self.next, "delta": {"type": "signature_delta", "signature": signature}}));
            }
            out.push(json!({"type": "content_block_stop", "index": self.next}));
            self.next += 1;
        }
    }

    fn text(&mut self, kind: Open, text: String, out: &mut Vec<Value>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(kind) {
            self.close(out);
            let block = match kind {
                Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                Open::Text => json!({"type": "text", "text": ""}),
            };
            out.push(json!({"type": "content_block_start", "index": self.next, "content_block": block}));
            self.open = Some(kind);
        }
        let delta = match kind {
            Open::Thinking => {
                self.reasoning.push_str(&text);
                if self.shown == Shown::Omitted {
                    return;
                }
                json!({"type": "thinking_delta", "thinking": text})
            }
            Open::Text => json!({"type": "text_delta", "text": text}),
        };
        out.push(json!({"type": "content_block_delta", "index": self.next, "delta": delta}));
    }

    fn push(&mut self, e: OutputEvent, out: &mut Vec<Value>) {
        match e {
            OutputEvent::Reasoning(t) => self.text(Open::Thinking, t, out),
            OutputEvent::Content(t) => self.text(Open::Text, t, out),
            OutputEvent::ToolCall(t) => {
                self.close(out);
                let i = self.next;
                out.push(json!({"type": "content_block_start", "index": i,
                                "content_block": {"type": "tool_use", "id": t.id, "name": t.name, "input": {}}}));
                // The model's own text when it is an object (its key order), else the fallback.
                let partial = match serde_json::from_str::<Value>(&t.arguments) {
                    Ok(Value::Object(_)) => t.arguments.clone(),
                    _ => tool_input(&t).to_string(),
                };
                out.push(json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": partial}}));
                out.push(json!({"type": "content_block_stop", "index": i}));
                self.next += 1;
            }
        }
    }
}

async fn stream(st: Arc<AppState>, mut job: ChatJob, id: String, req: ChatRequest, shown: Shown) -> Response {
    let (tx, out_rx) = mpsc::unbounded_channel::<Result<Event, Infallible>>();
    let metrics = st.metrics.clone();
    let sealer = st.sealer.clone();
    tokio::spawn(async move {
        let mut blocks = Blocks::new(shown, sealer);
        let mut started = false;
        let start = |job: &ChatJob| {
            ev(json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": req.model, "content": [],
                "stop_reason": null, "stop_sequence": null, "usage": usage(job),
            }}))
        };
        let mut finish = None;
        // a client that leaves ends the loop at once (dropping the job cancels the generation)
        while let Some((_, e)) = match job.next_for(&tx).await {
            Ok(got) => got,
            Err(()) => return,
        } {
            let Some(e) = e else { break };
            let prefilled = matches!(e, GenEvent::Prefilled { .. });
            let step = job.runs[0].on(e);
            let mut out = Vec::new();
            let evs = match step {
                Ok(Some(ChatStep::Events(evs))) => evs,
                Ok(Some(ChatStep::Finished(r, tail))) => {
                    finish = Some(r);
                    tail
                }
                Ok(Some(ChatStep::Progress { done, total })) => {
                    // An SSE comment: every client skips it; the connection shows life.
                    if tx.send(super::pipeline::progress_comment(done, total)).is_err() {
                        return;
                    }
                    continue;
                }
                Ok(None) => Vec::new(),
                Err(err) => {
                    metrics.error("generation");
                    let _ = tx.send(error_event(&err));
                    return;
                }
            };
            if !started && (prefilled || !evs.is_empty() || finish.is_some()) {
                started = true;
                if tx.send(start(&job)).is_err() {
                    return;
                }
                let _ = tx.send(ev(json!({"type": "ping"})));
            }
            for e in evs {
                blocks.push(e, &mut out);
            }
            for v in out {
                if tx.send(ev(v)).is_err() {
                    return; // client gone: dropping the job cancels the generation
                }
            }
            if job.runs[0].stopped_by_string && finish.is_none() {
                finish = Some(FinishReason::Stop);
            }
            if finish.is_some() {
                job.close(0);
            }
        }
        let Some(finish) = finish else {
            metrics.error("generation");
            let _ = tx.send(error_event(&ApiError::internal("the engine stopped during generation")));
            return;
        };
        let mut out = Vec::new();
        blocks.close(&mut out);
        for v in out {
            let _ = tx.send(ev(v));
        }
        let run = &job.runs[0];
        let (reason, seq) = stop_reason(finish, run.stopped_by_string, &run.parser.output().content, &req.gen.stop);
        let _ = tx.send(ev(json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(&job)})));
        let _ = tx.send(ev(json!({"type": "message_stop"})));
    });
    let stream = futures_util::stream::unfold(out_rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// Anthropic's error `type` for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// The served model as Anthropic's model object (`GET /v1/models` from an Anthropic client).
pub fn model_card(st: &AppState) -> Value {
    let created = time::OffsetDateTime::from_unix_timestamp(st.created as i64)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_else(|| "1970-01-01T00:00:00Z".into());
    json!({"type": "model", "id": st.model_id, "display_name": st.model_id, "created_at": created, "lifecycle": "active",
           "max_input_tokens": st.engine.max_context})
}

/// Middleware of the Anthropic routes: rewrites every error response (the handlers' and the
/// guard's OpenAI-shaped `{"error": {...}}`, or a plain-text rejection) into Anthropic's
/// `{"type": "error", "error": {"type", "message"}}`, keeping status and headers.
pub async fn error_shape(req: Request, next: Next) -> Response {
    reshape_error(next.run(req).await).await
}

/// [`error_shape`] of one response (success responses pass unchanged).
pub async fn reshape_error(resp: Response) -> Response {
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap_or_default();
    let message = match serde_json::from_slice::<Value>(&bytes) {
        Ok(v) => v["error"]["message"].as_str().map(str::to_string).unwrap_or_else(|| v.to_string()),
        Err(_) => String::from_utf8_lossy(&bytes).trim().to_string(),
    };
    let body = json!({"type": "error", "error": {"type": error_type(status), "message": message}}).to_string();
    // Overload is Anthropic's 529 `overloaded_error` (clients retry it, after `retry-after`).
    if status == StatusCode::SERVICE_UNAVAILABLE {
        parts.status = StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    }
    if matches!(parts.status.as_u16(), 429 | 529) && !parts.headers.contains_key(header::RETRY_AFTER) {
        parts.headers.insert(header::RETRY_AFTER, HeaderValue::from_static("2"));
    }
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(body))
}
