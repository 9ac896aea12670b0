//! The OpenAI-compatible endpoints: `POST /v1/chat/completions` (non-streaming or SSE),
//! `POST /v1/completions`, `GET /v1/models`, `POST /tokenize`. Built on the shared request
//! pipeline ([`super::pipeline`]).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json as AxJson;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::anthropic;
use super::api::{self, ApiError, GenSettings, Prompt};
use super::pipeline::{
    content_with_stops, fail, finish_all, next_event, now_secs, off_runtime, queue_choices, start_chat, AppState, ChatJob, ChatStep, LogprobLog,
};
use super::stop::StopStrings;
use crate::chat::parse::{FinishReason, OutputEvent, ToolCall};
use crate::engine::GenEvent;

fn model_card(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "k3-offload", "max_model_len": st.engine.max_context})
}

/// Whether a request comes from an Anthropic client (they send `anthropic-version`).
fn anthropic_client(headers: &axum::http::HeaderMap) -> bool {
    headers.contains_key("anthropic-version")
}

pub(super) async fn models(State(st): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> AxJson<Value> {
    st.metrics.request("models");
    if anthropic_client(&headers) {
        return AxJson(json!({"data": [anthropic::model_card(&st)], "has_more": false, "first_id": st.model_id, "last_id": st.model_id}));
    }
    AxJson(json!({"object": "list", "data": [model_card(&st)]}))
}

pub(super) async fn model_info(
    State(st): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    st.metrics.request("models");
    if id != st.model_id {
        let resp = fail(&st, ApiError::not_found_model(&id, &[&st.model_id]));
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
pub(super) async fn tokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    st.metrics.request("tokenize");
    match off_runtime({
        let st = st.clone();
        move || {
            let v = api::parse_body(&body)?;
            let strs = v.get("return_token_strs").is_some_and(|b| matches!(b, crate::chat::Json::Bool(true)));
            let mut out = if v.get("messages").is_some() {
                let req = api::chat_request(&v, &st.model_id, 0)?;
                api::render_json_within(&st.tokenizer, &req, st.engine.max_context)?
            } else {
                match v.get("prompt").and_then(crate::chat::Json::as_str) {
                    Some(p) => {
                        let ids = api::encode_prompt(&st.tokenizer, &[crate::tokenizer::Segment::markup(p)], st.engine.max_context, "prompt")?;
                        json!({"ids": ids})
                    }
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

pub(super) async fn chat_completions(State(st): State<Arc<AppState>>, key: Option<axum::Extension<super::guard::ClientKey>>, body: Bytes) -> Response {
    st.metrics.request("chat_completions");
    let n = st.next_id();
    let mut req = match off_runtime({
        let st = st.clone();
        move || api::chat_request(&api::parse_body(&body)?, &st.model_id, st.seed(n))
    })
    .await
    {
        Ok(r) => r,
        Err(e) => return fail(&st, e),
    };
    req.gen.client_key = key.map(|k| k.0 .0);
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

/// Usage of a whole job: the prompt once, the completion tokens of every choice.
fn job_usage(job: &ChatJob) -> Value {
    let completion = job.runs.iter().map(|r| r.tokens.len()).sum();
    let reasoning = job.runs.iter().map(|r| r.parser.output().reasoning_tokens).sum();
    let mut u = usage(job.prompt.len(), completion, job.runs.first().map_or(0, |r| r.reused), reasoning);
    u["prompt_tokens_details"]["first_difference"] = json!(job.runs.first().map_or(0, |r| r.first_difference));
    u
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
                Ok(Some(ChatStep::Progress { done, total })) => {
                    if i == 0 && tx.send(super::pipeline::progress_comment(done, total)).is_err() {
                        return;
                    }
                    None
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

pub(super) async fn completions(State(st): State<Arc<AppState>>, key: Option<axum::Extension<super::guard::ClientKey>>, body: Bytes) -> Response {
    st.metrics.request("completions");
    let n = st.next_id();
    let (mut req, prompt) = match off_runtime({
        let st = st.clone();
        move || {
            let v = api::parse_body(&body)?;
            let req = api::completion_request(&v, &st.model_id, st.tokenizer.vocab_size() as usize, st.seed(n))?;
            let prompt = match &req.prompt {
                Prompt::Ids(ids) => ids.clone(),
                Prompt::Text(t) => api::encode_prompt(&st.tokenizer, &[crate::tokenizer::Segment::markup(t.as_str())], st.engine.max_context, "prompt")?,
            };
            Ok((req, prompt))
        }
    })
    .await
    {
        Ok(x) => x,
        Err(e) => return fail(&st, e),
    };
    req.gen.client_key = key.map(|k| k.0 .0);
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
            GenEvent::Progress { .. } => Ok((String::new(), None)),
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
                Ok((s, Some(if finish == crate::engine::LoopEnd::Length && !run.stops.hit() { "length" } else { "stop" })))
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
