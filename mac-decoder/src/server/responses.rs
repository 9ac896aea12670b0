//! The OpenAI Responses API of `k3-decode serve`: `POST /v1/responses` (a whole response, or
//! the streamed event sequence), as Codex CLI and the `openai` SDK's `client.responses.create`
//! use it.
//!
//! A Responses body is translated into the OpenAI chat body the server already takes and
//! validated by [`api::chat_request`]; it then runs through the one chat pipeline. Mapping:
//! - `instructions` → a system message first; `input` (a string, or items) → messages:
//!   `message` items (roles `user`, `system`, `developer`, `assistant`; parts `input_text`,
//!   `output_text`, `input_image` as a data URL), `function_call` items → the assistant's tool
//!   calls, `function_call_output` → tool messages, `reasoning` items → the next assistant
//!   message's reasoning (from the sealed `encrypted_content` this server handed out, else the
//!   item's `content` text). Hosted-tool items (`web_search_call`, …) are skipped (logged).
//! - `tools`: `function` tools; a `namespace` tool's function tools are declared by their own
//!   names (a call to one names its namespace); hosted tools (`web_search`, `file_search`,
//!   `custom`, …) are not declared (logged): the model cannot call them here.
//! - `tool_choice` `auto` / `none` / `required` / `{"type": "function", "name"}`;
//!   `reasoning.effort` as `reasoning_effort` (`none` → thinking off); `max_output_tokens`;
//!   `temperature`, `top_p`; `text.format` `json_schema` / `json_object` → `response_format`.
//! - `store` (default true) with `previous_response_id`: the stored response's conversation
//!   (its input and output) goes before this request's input. `include:
//!   ["reasoning.encrypted_content"]` adds the sealed reasoning to reasoning items.
//! - `parallel_tool_calls`, `prompt_cache_key`, `client_metadata`, `metadata`, `user`,
//!   `service_tier`, `truncation`, `safety_identifier` are accepted and ignored (prefix reuse is
//!   automatic).
//! - `cache_salt`: the request's cache scope (no held prompt state, and no stored response for
//!   `previous_response_id`, is shared with another salt or none; `engine::sessions`).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json as AxJson;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::api::{self, bad, obj, s, ApiError, ChatRequest};
use super::guard::ClientKey;
use super::pipeline::{content_with_stops, fail, finish_all, now_secs, off_runtime, start_chat, AppState, ChatJob, ChatStep};
use super::seal::Sealer;
use crate::chat::parse::{FinishReason, OutputEvent, ToolCall};
use crate::chat::Json;

type R<T> = Result<T, ApiError>;

/// What a Responses request needs beyond its chat request.
#[derive(Clone)]
pub struct Extras {
    /// Tool name → its namespace (tools declared inside a `namespace` tool).
    namespaces: Vec<(String, String)>,
    include_encrypted: bool,
    store: bool,
    /// The conversation as chat messages (for the store).
    messages: Vec<Json>,
    /// Echoed in the response object.
    echo: Value,
    /// The request's cache scope: the response is stored under it.
    scope: Option<String>,
}

/// The text of a message item's `content`: a string, or parts with `text`.
fn item_parts(content: &Json, role: &str, place: &str) -> R<Json> {
    match content {
        Json::Str(_) => Ok(content.clone()),
        Json::Array(parts) => {
            let mut out = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Json::as_str) {
                    Some("input_text" | "output_text" | "text" | "summary_text" | "reasoning_text") => match p.get("text") {
                        Some(Json::Str(t)) => out.push(obj(vec![("type", s("text")), ("text", s(t.clone()))])),
                        _ => return Err(bad(format!("{place}.content[{j}]: a text part needs a string `text`"), "input")),
                    },
                    Some("refusal") => {
                        if let Some(Json::Str(t)) = p.get("refusal") {
                            out.push(obj(vec![("type", s("text")), ("text", s(t.clone()))]));
                        }
                    }
                    Some("input_image") if role == "user" => {
                        let url = match p.get("image_url") {
                            Some(Json::Str(u)) => u.clone(),
                            _ if p.get("file_id").is_some() => {
                                return Err(bad(format!("{place}.content[{j}]: `file_id` images are not supported (send a data URL in `image_url`)"), "input"))
                            }
                            _ => return Err(bad(format!("{place}.content[{j}]: an input_image part needs `image_url`"), "input")),
                        };
                        out.push(obj(vec![("type", s("image_url")), ("image_url", obj(vec![("url", s(url))]))]));
                    }
                    other => return Err(bad(format!("{place}.content[{j}]: content part type {other:?} is not supported in a {role} message"), "input")),
                }
            }
            Ok(Json::Array(out))
        }
        _ => Err(bad(format!("{place}.content must be a string or a list of parts"), "input")),
    }
}

/// The text of a `function_call_output`'s `output`: a string, or text parts.
fn output_text(v: Option<&Json>, place: &str) -> R<Json> {
    match v {
        None | Some(Json::Null) => Ok(s("")),
        Some(t @ Json::Str(_)) => Ok(t.clone()),
        Some(Json::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                if let Some(t) = p.get("text").and_then(Json::as_str) {
                    text.push_str(t);
                }
            }
            Ok(s(text))
        }
        Some(_) => Err(bad(format!("{place}.output must be a string or a list of parts"), "input")),
    }
}

/// Builds chat messages from Responses input items.
struct Conversation<'a> {
    out: Vec<Json>,
    sealer: &'a Sealer,
    /// The assistant message being built: (content parts, reasoning, tool calls).
    assistant: Option<(Vec<Json>, String, Vec<Json>)>,
}

impl Conversation<'_> {
    fn flush(&mut self) {
        if let Some((parts, reasoning, calls)) = self.assistant.take() {
            let mut e = vec![("role", s("assistant")), ("content", Json::Array(parts))];
            if !reasoning.is_empty() {
                e.push(("reasoning_content", s(reasoning)));
            }
            if !calls.is_empty() {
                e.push(("tool_calls", Json::Array(calls)));
            }
            self.out.push(obj(e));
        }
    }

    fn assistant(&mut self) -> &mut (Vec<Json>, String, Vec<Json>) {
        self.assistant.get_or_insert_with(|| (Vec::new(), String::new(), Vec::new()))
    }

    fn item(&mut self, i: usize, it: &Json) -> R<()> {
        let place = format!("input[{i}]");
        if it.as_object().is_none() {
            return Err(bad(format!("{place} must be an object"), "input"));
        }
        let ty = it.get("type").and_then(Json::as_str).or(it.get("role").map(|_| "message"));
        match ty {
            Some("message") => {
                let role = match it.get("role").and_then(Json::as_str) {
                    Some("developer") => "system",
                    Some(r @ ("user" | "system" | "assistant")) => r,
                    other => return Err(bad(format!("{place}: unknown role {other:?} (user, system, developer or assistant)"), "input")),
                };
                let content = item_parts(it.get("content").unwrap_or(&Json::Null), role, &place)?;
                if role == "assistant" {
                    // An assistant message after tool calls starts a new turn.
                    if self.assistant.as_ref().is_some_and(|a| !a.2.is_empty()) {
                        self.flush();
                    }
                    let parts = match content {
                        Json::Str(t) => vec![obj(vec![("type", s("text")), ("text", s(t))])],
                        Json::Array(p) => p,
                        _ => Vec::new(),
                    };
                    self.assistant().0.extend(parts);
                } else {
                    self.flush();
                    self.out.push(obj(vec![("role", s(role)), ("content", content)]));
                }
            }
            Some("reasoning") => {
                // Reasoning opens the assistant turn it belongs to.
                if self.assistant.as_ref().is_some_and(|a| !a.0.is_empty() || !a.2.is_empty()) {
                    self.flush();
                }
                let sealed = it.get("encrypted_content").and_then(Json::as_str).and_then(|b| self.sealer.open(b));
                let text = match sealed {
                    Some(t) => t,
                    None => it
                        .get("content")
                        .and_then(Json::as_array)
                        .map(|parts| parts.iter().filter_map(|p| p.get("text").and_then(Json::as_str)).collect::<String>())
                        .unwrap_or_default(),
                };
                self.assistant().1.push_str(&text);
            }
            Some("function_call") => {
                let (Some(call_id), Some(name)) = (it.get("call_id").and_then(Json::as_str), it.get("name").and_then(Json::as_str)) else {
                    return Err(bad(format!("{place}: a function_call item needs string `call_id` and `name`"), "input"));
                };
                let args = it.get("arguments").cloned().unwrap_or(s("{}"));
                let call = obj(vec![("id", s(call_id)), ("type", s("function")), ("function", obj(vec![("name", s(name)), ("arguments", args)]))]);
                self.assistant().2.push(call);
            }
            Some("function_call_output") => {
                let Some(call_id) = it.get("call_id").and_then(Json::as_str) else {
                    return Err(bad(format!("{place}: a function_call_output item needs a string `call_id`"), "input"));
                };
                self.flush();
                let content = output_text(it.get("output"), &place)?;
                self.out.push(obj(vec![("role", s("tool")), ("tool_call_id", s(call_id)), ("content", content)]));
            }
            Some("item_reference") => {
                return Err(bad(format!("{place}: item_reference items are not supported (send the items, or previous_response_id)"), "input"))
            }
            other => {
                tracing::info!(item = ?other, "responses: input item type not handled here; skipped");
            }
        }
        Ok(())
    }
}

/// The chat tools of a Responses `tools` list and the namespaced names.
fn tools(v: &Json) -> R<(Vec<Json>, Vec<(String, String)>)> {
    let mut fns = Vec::new();
    let mut namespaces = Vec::new();
    let Some(list) = v.as_array() else {
        return Err(bad("`tools` must be a list", "tools"));
    };
    fn function(t: &Json, i: usize) -> R<Json> {
        let Some(name) = t.get("name").and_then(Json::as_str).filter(|n| !n.is_empty()) else {
            return Err(bad(format!("tools[{i}]: a function tool needs a non-empty `name`"), "tools"));
        };
        let mut f = vec![("name", s(name))];
        if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
            f.push(("description", d.clone()));
        }
        f.push(("parameters", t.get("parameters").filter(|p| !p.is_null()).cloned().unwrap_or(obj(vec![("type", s("object")), ("properties", obj(vec![]))]))));
        Ok(obj(vec![("type", s("function")), ("function", obj(f))]))
    }
    for (i, t) in list.iter().enumerate() {
        match t.get("type").and_then(Json::as_str) {
            Some("function") => fns.push(function(t, i)?),
            Some("namespace") => {
                let ns = t.get("name").and_then(Json::as_str).unwrap_or("").to_string();
                for inner in t.get("tools").and_then(Json::as_array).unwrap_or_default() {
                    if inner.get("type").and_then(Json::as_str) == Some("function") {
                        let f = function(inner, i)?;
                        if let Some(n) = inner.get("name").and_then(Json::as_str) {
                            namespaces.push((n.to_string(), ns.clone()));
                        }
                        fns.push(f);
                    }
                }
            }
            other => tracing::info!(tool = ?other, "responses: hosted tool not available on this server; not declared"),
        }
    }
    Ok((fns, namespaces))
}

/// A validated Responses request: the chat request it runs as and what the reply needs.
pub fn responses_request(v: &Json, st: &AppState, seed_fallback: u64, client_key: Option<String>) -> R<(ChatRequest, Extras)> {
    let salt = api::cache_salt(v, "cache_salt")?;
    let scope = api::cache_scope(client_key.as_deref(), salt.as_deref());
    let mut body: Vec<(&str, Json)> = Vec::new();
    if let Some(m) = v.get("model") {
        body.push(("model", m.clone()));
    }
    for key in ["background", "conversation"] {
        if v.get(key).is_some_and(Json::truthy) {
            return Err(bad(format!("`{key}` is not supported by this server"), key));
        }
    }
    let store = !matches!(v.get("store"), Some(Json::Bool(false)));
    let previous = match v.get("previous_response_id") {
        None | Some(Json::Null) => None,
        Some(Json::Str(id)) => Some(id.clone()),
        Some(_) => return Err(bad("`previous_response_id` must be a string", "previous_response_id")),
    };
    let mut conv = Conversation { out: Vec::new(), sealer: &st.sealer, assistant: None };
    if let Some(id) = &previous {
        match st.responses.get(id, scope.as_deref()) {
            Some(msgs) => conv.out = msgs,
            None => {
                return Err(ApiError {
                    status: axum::http::StatusCode::NOT_FOUND,
                    message: format!("no stored response {id:?} (responses are held in memory, the most recent ones; send the whole input, or `store: true`)"),
                    kind: "invalid_request_error",
                    param: Some("previous_response_id".into()),
                    code: Some("previous_response_not_found"),
                })
            }
        }
    }
    // Instructions go first (they are not carried over from a previous response).
    if let Some(ins) = v.get("instructions").filter(|x| !x.is_null()) {
        let Some(text) = ins.as_str() else {
            return Err(bad("`instructions` must be a string", "instructions"));
        };
        if !text.is_empty() {
            conv.out.insert(0, obj(vec![("role", s("system")), ("content", s(text))]));
        }
    }
    let start = conv.out.len();
    match v.get("input") {
        None | Some(Json::Null) => return Err(bad("`input` is required", "input")),
        Some(Json::Str(t)) => conv.out.push(obj(vec![("role", s("user")), ("content", s(t.clone()))])),
        Some(Json::Array(items)) => {
            for (i, it) in items.iter().enumerate() {
                conv.item(i, it)?;
            }
            conv.flush();
        }
        Some(_) => return Err(bad("`input` must be a string or a list of items", "input")),
    }
    if conv.out.len() == start && previous.is_none() {
        return Err(bad("`input` holds no messages", "input"));
    }
    let messages = conv.out;
    body.push(("messages", Json::Array(messages.clone())));
    let mut namespaces = Vec::new();
    if let Some(t) = v.get("tools").filter(|t| !t.is_null()) {
        let (fns, ns) = tools(t)?;
        namespaces = ns;
        if !fns.is_empty() {
            body.push(("tools", Json::Array(fns)));
        }
    }
    let has_tools = body.iter().any(|(k, _)| *k == "tools");
    match v.get("tool_choice") {
        None | Some(Json::Null) => {}
        Some(Json::Str(c)) if c == "required" && !has_tools => {
            return Err(bad("`tool_choice` is \"required\" but the request has no function tools", "tool_choice"))
        }
        Some(Json::Str(c)) if !has_tools && (c == "auto" || c == "none") => {}
        Some(c @ Json::Str(_)) => body.push(("tool_choice", c.clone())),
        Some(o @ Json::Object(_)) => match o.get("type").and_then(Json::as_str) {
            Some("function") => body.push(("tool_choice", o.clone())),
            Some("allowed_tools") => body.push(("tool_choice", s(o.get("mode").and_then(Json::as_str).unwrap_or("auto")))),
            other => return Err(bad(format!("tool_choice type {other:?} is not supported (auto, none, required or a function)"), "tool_choice")),
        },
        Some(_) => return Err(bad("`tool_choice` must be a string or an object", "tool_choice")),
    }
    let reasoning = v.get("reasoning").filter(|r| !r.is_null());
    if let Some(e) = reasoning.and_then(|r| r.get("effort")).filter(|e| !e.is_null()) {
        body.push(("reasoning_effort", e.clone()));
    }
    if let Some(m) = v.get("max_output_tokens").filter(|m| !m.is_null()) {
        body.push(("max_tokens", m.clone()));
    }
    for key in ["temperature", "top_p", "top_k", "seed", "stream"] {
        if let Some(x) = v.get(key).filter(|x| !x.is_null()) {
            body.push((key, x.clone()));
        }
    }
    if let Some(f) = v.get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null()) {
        match f.get("type").and_then(Json::as_str) {
            Some("text") | None => {}
            Some("json_object") => body.push(("response_format", obj(vec![("type", s("json_object"))]))),
            Some("json_schema") => {
                let schema = f.get("schema").cloned().unwrap_or(Json::Bool(true));
                body.push(("response_format", obj(vec![("type", s("json_schema")), ("json_schema", obj(vec![("schema", schema)]))])));
            }
            Some(other) => return Err(bad(format!("unsupported text.format type {other:?}"), "text")),
        }
    }
    let include_encrypted = v.get("include").and_then(Json::as_array).unwrap_or_default().iter().any(|x| x.as_str() == Some("reasoning.encrypted_content"));
    let mut req = api::chat_request(&obj(body), &st.model_id, seed_fallback)?;
    req.gen.cache_salt = salt;
    req.gen.client_key = client_key;
    let echo = json!({
        "instructions": v.get("instructions").map(Json::to_value).unwrap_or(Value::Null),
        "tools": v.get("tools").map(Json::to_value).unwrap_or(json!([])),
        "tool_choice": v.get("tool_choice").map(Json::to_value).unwrap_or(json!("auto")),
        "parallel_tool_calls": v.get("parallel_tool_calls").map(Json::to_value).unwrap_or(json!(true)),
        "reasoning": {"effort": reasoning.and_then(|r| r.get("effort")).map(Json::to_value).unwrap_or(Value::Null), "summary": null},
        "store": store,
        "temperature": v.get("temperature").map(Json::to_value).unwrap_or(json!(1.0)),
        "top_p": v.get("top_p").map(Json::to_value).unwrap_or(json!(1.0)),
        "max_output_tokens": v.get("max_output_tokens").map(Json::to_value).unwrap_or(Value::Null),
        "previous_response_id": previous,
        "text": {"format": v.get("text").and_then(|t| t.get("format")).map(Json::to_value).unwrap_or(json!({"type": "text"}))},
        "metadata": v.get("metadata").map(Json::to_value).unwrap_or(json!({})),
        "truncation": "disabled",
        "user": null,
    });
    Ok((req, Extras { namespaces, include_encrypted, store, messages, echo, scope }))
}

/// Ids of one response's items.
struct Ids {
    resp: String,
    stamp: String,
}

impl Ids {
    fn reasoning(&self) -> String {
        format!("rs_{}", self.stamp)
    }
    fn message(&self) -> String {
        format!("msg_{}", self.stamp)
    }
    fn call(&self, i: usize) -> String {
        format!("fc_{}_{i}", self.stamp)
    }
}

fn reasoning_item(ids: &Ids, text: &str, ex: &Extras, sealer: &Sealer) -> Value {
    let mut item = json!({"id": ids.reasoning(), "type": "reasoning", "summary": [],
                          "content": [{"type": "reasoning_text", "text": text}], "status": "completed"});
    if ex.include_encrypted {
        item["encrypted_content"] = json!(sealer.seal(text));
    }
    item
}

fn message_item(ids: &Ids, text: &str, status: &str) -> Value {
    json!({"id": ids.message(), "type": "message", "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
}

fn call_item(ids: &Ids, t: &ToolCall, ex: &Extras, status: &str, arguments: &str) -> Value {
    let mut item = json!({"id": ids.call(t.index), "type": "function_call", "status": status,
                          "call_id": t.id, "name": t.name, "arguments": arguments});
    if let Some((_, ns)) = ex.namespaces.iter().find(|(n, _)| *n == t.name) {
        item["namespace"] = json!(ns);
    }
    item
}

fn usage(job: &ChatJob) -> Value {
    let run = &job.runs[0];
    json!({
        "input_tokens": job.prompt.len(),
        "input_tokens_details": {"cached_tokens": run.reused, "first_difference": run.first_difference},
        "output_tokens": run.tokens.len(),
        "output_tokens_details": {"reasoning_tokens": run.parser.output().reasoning_tokens},
        "total_tokens": job.prompt.len() + run.tokens.len(),
    })
}

fn response_object(ids: &Ids, req: &ChatRequest, ex: &Extras, created: u64, status: &str, output: Vec<Value>, usage: Value) -> Value {
    let mut r = json!({
        "id": ids.resp, "object": "response", "created_at": created, "status": status, "model": req.model,
        "output": output, "usage": usage, "error": null,
        "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
    });
    if let (Some(o), Some(e)) = (r.as_object_mut(), ex.echo.as_object()) {
        for (k, v) in e {
            o.insert(k.clone(), v.clone());
        }
    }
    r
}

/// The output items of a finished run.
fn output_items(job: &ChatJob, ids: &Ids, ex: &Extras, req: &ChatRequest, sealer: &Sealer) -> Vec<Value> {
    let run = &job.runs[0];
    let out = run.parser.output();
    let mut items = Vec::new();
    if !out.reasoning.is_empty() {
        items.push(reasoning_item(ids, &out.reasoning, ex, sealer));
    }
    let text = content_with_stops(&out.content, &req.gen.stop);
    let calls = if run.stopped_by_string { &[][..] } else { &out.tool_calls[..] };
    if !text.is_empty() || calls.is_empty() {
        items.push(message_item(ids, &text, "completed"));
    }
    items.extend(calls.iter().map(|t| call_item(ids, t, ex, "completed", &t.arguments)));
    items
}

/// Keeps the response's conversation (input + output) for `previous_response_id`.
fn remember(st: &AppState, ids: &Ids, ex: &Extras, job: &ChatJob) {
    if !ex.store {
        return;
    }
    let out = job.runs[0].parser.output();
    let mut msgs = ex.messages.clone();
    let mut e = vec![("role", s("assistant")), ("content", s(out.content.clone()))];
    if !out.reasoning.is_empty() {
        e.push(("reasoning_content", s(out.reasoning.clone())));
    }
    if !out.tool_calls.is_empty() {
        let calls = out
            .tool_calls
            .iter()
            .map(|t| {
                obj(vec![
                    ("id", s(t.id.clone())),
                    ("type", s("function")),
                    ("function", obj(vec![("name", s(t.name.clone())), ("arguments", s(t.arguments.clone()))])),
                ])
            })
            .collect();
        e.push(("tool_calls", Json::Array(calls)));
    }
    msgs.push(obj(e));
    st.responses.put(ids.resp.clone(), ex.scope.clone(), msgs);
}

fn status_of(finish: FinishReason) -> &'static str {
    if finish == FinishReason::Length {
        "incomplete"
    } else {
        "completed"
    }
}

/// `POST /v1/responses`.
pub async fn responses(State(st): State<Arc<AppState>>, key: Option<Extension<ClientKey>>, body: Bytes) -> Response {
    st.metrics.request("responses");
    let n = st.next_id();
    let (req, ex) = match off_runtime({
        let st = st.clone();
        move || responses_request(&api::parse_body(&body)?, &st, st.seed(n), key.map(|k| k.0 .0))
    })
    .await
    {
        Ok(r) => r,
        Err(e) => return fail(&st, e),
    };
    let stamp = format!("{:x}{:04x}", now_secs(), n & 0xffff);
    let job = match start_chat(&st, &req, &format!("call_{stamp}")).await {
        Ok(j) => j,
        Err(e) => return fail(&st, e),
    };
    let ids = Ids { resp: format!("resp_{stamp}"), stamp };
    if req.gen.stream {
        stream(st, job, ids, req, ex).await
    } else {
        whole(st, job, ids, req, ex).await
    }
}

async fn whole(st: Arc<AppState>, mut job: ChatJob, ids: Ids, req: ChatRequest, ex: Extras) -> Response {
    let finish = match finish_all(&mut job).await {
        Ok(f) => f[0],
        Err(e) => return fail(&st, e),
    };
    let output = output_items(&job, &ids, &ex, &req, &st.sealer);
    remember(&st, &ids, &ex, &job);
    AxJson(response_object(&ids, &req, &ex, now_secs(), status_of(finish), output, usage(&job))).into_response()
}

/// The streamed events: every event carries its `type` and a `sequence_number`.
struct Events {
    tx: mpsc::UnboundedSender<Result<Event, Infallible>>,
    seq: u64,
}

impl Events {
    fn send(&mut self, mut v: Value) -> bool {
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        let name = v["type"].as_str().unwrap_or("error").to_string();
        self.tx.send(Ok(Event::default().event(name).data(v.to_string()))).is_ok()
    }
}

/// The item open in the stream.
#[derive(PartialEq)]
enum Open {
    None,
    Reasoning,
    Message,
}

struct Writer<'a> {
    ev: Events,
    ids: &'a Ids,
    ex: &'a Extras,
    sealer: &'a Sealer,
    open: Open,
    next_index: usize,
    reasoning: String,
    text: String,
    /// The finished items, in order.
    done: Vec<Value>,
}

impl Writer<'_> {
    fn close(&mut self) -> bool {
        let index = self.next_index;
        let ok = match std::mem::replace(&mut self.open, Open::None) {
            Open::None => return true,
            Open::Reasoning => {
                let item = reasoning_item(self.ids, &self.reasoning, self.ex, self.sealer);
                self.ev.send(json!({"type": "response.reasoning_text.done", "item_id": self.ids.reasoning(), "output_index": index, "content_index": 0, "text": self.reasoning}))
                    && self.ev.send(json!({"type": "response.output_item.done", "output_index": index, "item": item.clone()}))
                    && {
                        self.done.push(item);
                        true
                    }
            }
            Open::Message => {
                let item = message_item(self.ids, &self.text, "completed");
                let part = json!({"type": "output_text", "text": self.text, "annotations": [], "logprobs": []});
                self.ev.send(json!({"type": "response.output_text.done", "item_id": self.ids.message(), "output_index": index, "content_index": 0, "text": self.text, "logprobs": []}))
                    && self.ev.send(json!({"type": "response.content_part.done", "item_id": self.ids.message(), "output_index": index, "content_index": 0, "part": part}))
                    && self.ev.send(json!({"type": "response.output_item.done", "output_index": index, "item": item.clone()}))
                    && {
                        self.done.push(item);
                        true
                    }
            }
        };
        self.next_index += 1;
        ok
    }

    fn open_message(&mut self) -> bool {
        if self.open == Open::Message {
            return true;
        }
        if !self.close() {
            return false;
        }
        self.open = Open::Message;
        let index = self.next_index;
        self.ev.send(json!({"type": "response.output_item.added", "output_index": index, "item": message_item(self.ids, "", "in_progress")}))
            && self.ev.send(json!({"type": "response.content_part.added", "item_id": self.ids.message(), "output_index": index, "content_index": 0,
                                  "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
    }

    fn push(&mut self, e: OutputEvent) -> bool {
        match e {
            OutputEvent::Reasoning(t) => {
                if self.open != Open::Reasoning {
                    if !self.close() {
                        return false;
                    }
                    self.open = Open::Reasoning;
                    let item = json!({"id": self.ids.reasoning(), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"});
                    if !self.ev.send(json!({"type": "response.output_item.added", "output_index": self.next_index, "item": item})) {
                        return false;
                    }
                }
                self.reasoning.push_str(&t);
                self.ev.send(json!({"type": "response.reasoning_text.delta", "item_id": self.ids.reasoning(), "output_index": self.next_index, "content_index": 0, "delta": t}))
            }
            OutputEvent::Content(t) => {
                if !self.open_message() {
                    return false;
                }
                self.text.push_str(&t);
                self.ev.send(json!({"type": "response.output_text.delta", "item_id": self.ids.message(), "output_index": self.next_index, "content_index": 0, "delta": t, "logprobs": []}))
            }
            OutputEvent::ToolCall(t) => {
                if !self.close() {
                    return false;
                }
                let index = self.next_index;
                let id = self.ids.call(t.index);
                let item = call_item(self.ids, &t, self.ex, "completed", &t.arguments);
                let ok = self.ev.send(json!({"type": "response.output_item.added", "output_index": index, "item": call_item(self.ids, &t, self.ex, "in_progress", "")}))
                    && self.ev.send(json!({"type": "response.function_call_arguments.delta", "item_id": id, "output_index": index, "delta": t.arguments}))
                    && self.ev.send(json!({"type": "response.function_call_arguments.done", "item_id": id, "output_index": index, "name": t.name, "arguments": t.arguments}))
                    && self.ev.send(json!({"type": "response.output_item.done", "output_index": index, "item": item.clone()}));
                self.done.push(item);
                self.next_index += 1;
                ok
            }
        }
    }
}

async fn stream(st: Arc<AppState>, mut job: ChatJob, ids: Ids, req: ChatRequest, ex: Extras) -> Response {
    let (tx, out_rx) = mpsc::unbounded_channel::<Result<Event, Infallible>>();
    let created = now_secs();
    tokio::spawn(async move {
        let closed = tx.clone();
        let mut w = Writer {
            ev: Events { tx, seq: 0 },
            ids: &ids,
            ex: &ex,
            sealer: &st.sealer,
            open: Open::None,
            next_index: 0,
            reasoning: String::new(),
            text: String::new(),
            done: Vec::new(),
        };
        let start = response_object(&ids, &req, &ex, created, "in_progress", vec![], Value::Null);
        if !w.ev.send(json!({"type": "response.created", "response": start.clone()})) || !w.ev.send(json!({"type": "response.in_progress", "response": start}))
        {
            return;
        }
        let mut finish = None;
        // a client that leaves ends the loop at once (dropping the job cancels the generation)
        while let Some((_, e)) = match job.next_for(&closed).await {
            Ok(got) => got,
            Err(()) => return,
        } {
            let Some(e) = e else { break };
            let evs = match job.runs[0].on(e) {
                Ok(Some(ChatStep::Events(evs))) => evs,
                Ok(Some(ChatStep::Finished(r, tail))) => {
                    finish = Some(r);
                    tail
                }
                Ok(Some(ChatStep::Progress { done, total })) => {
                    if w.ev.tx.send(super::pipeline::progress_comment(done, total)).is_err() {
                        return;
                    }
                    continue;
                }
                Ok(None) => Vec::new(),
                Err(err) => {
                    st.metrics.error("generation");
                    let _ = w.ev.send(json!({"type": "error", "code": "server_error", "message": err.message, "param": null}));
                    return;
                }
            };
            for e in evs {
                if job.runs[0].stopped_by_string && matches!(e, OutputEvent::ToolCall(_)) {
                    continue;
                }
                if !w.push(e) {
                    return; // client gone
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
            st.metrics.error("generation");
            let _ = w.ev.send(json!({"type": "error", "code": "server_error", "message": "the engine stopped during generation", "param": null}));
            return;
        };
        // A reply with neither text nor calls still answers with an (empty) message.
        let has = |w: &Writer, ty: &str| w.done.iter().any(|i| i["type"] == ty);
        if w.open != Open::Message && !has(&w, "function_call") && !has(&w, "message") {
            w.open_message();
        }
        w.close();
        let status = status_of(finish);
        let output = std::mem::take(&mut w.done);
        remember(&st, &ids, &ex, &job);
        let done = response_object(&ids, &req, &ex, created, status, output, usage(&job));
        let kind = if status == "incomplete" { "response.incomplete" } else { "response.completed" };
        let _ = w.ev.send(json!({"type": kind, "response": done}));
    });
    let stream = futures_util::stream::unfold(out_rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}
