//! End-to-end tests of the OpenAI-compatible server with a real HTTP client (reqwest) against a
//! running server on the synthetic model's tokenizer, with the deterministic fake engine
//! (`tests/support/fake_engine.rs`): chat (streamed and not), prefix reuse across turns, a tool
//! call round trip, concurrent clients, completions, and every kind of bad request.

use std::sync::Arc;

use mac_decoder::engine::StoreOptions;
use mac_decoder::tokenizer::{Segment, Tokenizer};
use serde_json::{json, Value};
use support::{metric, FakeEngine};

mod support;

const VOCAB: usize = 1024;
const CONTEXT: usize = 3000;

fn m(s: &str) -> Segment {
    Segment::markup(s)
}
fn t(s: &str) -> Segment {
    Segment::text(s)
}

/// What the fake model answers, from the prompt text.
fn reply(tok: &Tokenizer, prompt: &[u32]) -> Vec<u32> {
    let text = tok.decode(prompt);
    let last_user = text.rsplit("role=\"user\"<|sep|>").next().unwrap_or("").split("<|close|>").next().unwrap_or("").to_string();
    let after_tool = text.rsplit("<|end_of_msg|>").nth(1).is_some_and(|m| m.contains("role=\"tool\""));
    let segs = if after_tool {
        vec![
            t("Got the weather."),
            m("<|close|>think<|sep|><|open|>response<|sep|>"),
            t("It is 18C in Paris."),
            m("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"),
        ]
    } else if last_user.contains("weather") {
        vec![
            t("Need the weather tool."),
            m("<|close|>think<|sep|><|open|>response<|sep|>"),
            t("Checking."),
            m("<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>"),
            t("Paris"),
            m("<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>"),
            t("2"),
            m("<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"),
        ]
    } else {
        vec![
            t(&format!("Thinking about: {last_user}")),
            m("<|close|>think<|sep|><|open|>response<|sep|>"),
            t(&format!("Echo: {last_user}")),
            m("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"),
        ]
    };
    tok.encode_segments(&segs).unwrap()
}

struct Server {
    base: String,
    tok: Arc<Tokenizer>,
    _dir: tempfile::TempDir,
}

async fn start(api_key: Option<&str>) -> Server {
    // The synthetic model's tokenizer (release format, compact special block for vocab 1024).
    let (dir, tok) = support::synth_tokenizer(VOCAB, CONTEXT);
    let marker = tok
        .encode_segments(&[m("<|open|>"), t("message"), t(" role"), t("=\""), t("assistant"), t("\""), m("<|sep|>"), m("<|open|>"), t("think"), m("<|sep|>")])
        .unwrap();
    let stop = tok.special_id("<|end_of_msg|>").unwrap();
    let tok2 = tok.clone();
    let make = move || {
        let mut e = FakeEngine::new(VOCAB, CONTEXT, marker, stop, move |p: &[u32]| reply(&tok2, p));
        e.step_delay = std::time::Duration::from_micros(200);
        Ok(e)
    };
    let mut state = support::app_state(make, StoreOptions { max_sessions: 8, max_bytes: 1 << 30, checkpoints: true }, tok.clone(), "k3-synth");
    state.api_key = api_key.map(str::to_string);
    Server { base: format!("http://{}", support::serve(state).await), tok, _dir: dir }
}

async fn post(s: &Server, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{}{path}", s.base)).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

async fn metrics_text(s: &Server) -> String {
    reqwest::get(format!("{}/metrics", s.base)).await.unwrap().text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streamed_chat_completion() {
    let s = start(None).await;
    let (st, v) = post(&s, "/v1/chat/completions", json!({"model": "k3-synth", "messages": [{"role": "user", "content": "hello there"}]})).await;
    assert_eq!(st, 200, "{v}");
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["content"], "Echo: hello there");
    assert_eq!(msg["reasoning_content"], "Thinking about: hello there");
    assert!(msg.get("tool_calls").is_none());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["object"], "chat.completion");
    let u = &v["usage"];
    assert_eq!(u["total_tokens"].as_u64(), Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()));
    // The prompt is the K3 rendering with the default effort note.
    let want = mac_decoder::chat::render::render(
        &[mac_decoder::chat::Json::parse(r#"{"role":"user","content":"hello there"}"#).unwrap()],
        &mac_decoder::chat::RenderOptions { thinking_effort: Some("max".into()), ..Default::default() },
    )
    .unwrap();
    assert_eq!(u["prompt_tokens"].as_u64().unwrap() as usize, s.tok.encode_segments(&want).unwrap().len());
}

/// Parses an SSE body into its JSON events (and checks it ends with `[DONE]`).
fn sse_events(body: &str) -> Vec<Value> {
    let datas: Vec<&str> = body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(datas.last(), Some(&"[DONE]"), "{body}");
    datas[..datas.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_chat_completion_with_usage() {
    let s = start(None).await;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"messages": [{"role": "user", "content": "stream ünïcode 🚀 please"}], "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let events = sse_events(&r.text().await.unwrap());
    let (mut reasoning, mut content, mut finish, mut usage) = (String::new(), String::new(), None, None);
    let mut deltas = 0;
    for e in &events {
        if let Some(u) = e.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
            assert_eq!(e["choices"], json!([]));
            continue;
        }
        let c = &e["choices"][0];
        assert_eq!(e["object"], "chat.completion.chunk");
        if let Some(r) = c["delta"]["reasoning_content"].as_str() {
            reasoning.push_str(r);
            deltas += 1;
        }
        if let Some(t) = c["delta"]["content"].as_str() {
            content.push_str(t);
            deltas += 1;
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert!(deltas > 5, "the answer arrives in several deltas ({deltas})");
    assert_eq!(reasoning, "Thinking about: stream ünïcode 🚀 please");
    assert_eq!(content, "Echo: stream ünïcode 🚀 please");
    assert_eq!(finish.as_deref(), Some("stop"));
    let usage = usage.expect("a usage chunk");
    assert!(usage["completion_tokens"].as_u64().unwrap() > 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_turn_reuses_the_first_turns_state() {
    let s = start(None).await;
    let first = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first question"}]);
    let (st, v1) = post(&s, "/v1/chat/completions", json!({"messages": first})).await;
    assert_eq!(st, 200, "{v1}");
    let p1 = v1["usage"]["prompt_tokens"].as_u64().unwrap();
    let c1 = v1["usage"]["completion_tokens"].as_u64().unwrap();
    let local_after_1 = metric(&metrics_text(&s).await, "k3_prefill_tokens_total{where=\"local\"}");
    assert_eq!(local_after_1, p1 as f64, "turn 1 prefills its whole prompt");

    let msg = &v1["choices"][0]["message"];
    let mut second = first.as_array().unwrap().clone();
    second.push(json!({"role": "assistant", "content": msg["content"], "reasoning_content": msg["reasoning_content"]}));
    second.push(json!({"role": "user", "content": "second question"}));
    let (st, v2) = post(&s, "/v1/chat/completions", json!({"messages": second})).await;
    assert_eq!(st, 200, "{v2}");
    assert_eq!(v2["choices"][0]["message"]["content"], "Echo: second question");
    let p2 = v2["usage"]["prompt_tokens"].as_u64().unwrap();
    // Turn 1's prompt and reply (stop token included) are held: only the new tokens are prefilled.
    assert_eq!(v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(p1 + c1));
    let text = metrics_text(&s).await;
    let prefilled_2 = metric(&text, "k3_prefill_tokens_total{where=\"local\"}") - local_after_1;
    assert_eq!(prefilled_2, (p2 - p1 - c1) as f64, "turn 2 prefills only its new tokens");
    assert_eq!(metric(&text, "k3_reused_prompt_tokens_total"), (p1 + c1) as f64);
    assert!(metric(&text, "k3_sessions_held") >= 2.0);

    // A client that edits the reply diverges from the live state: the turn-1 checkpoint (its
    // prompt) is reused instead.
    let mut edited = second.clone();
    edited[2]["content"] = json!("An edited answer.");
    let before = metric(&metrics_text(&s).await, "k3_prefill_tokens_total{where=\"local\"}");
    let (st, v3) = post(&s, "/v1/chat/completions", json!({"messages": edited})).await;
    assert_eq!(st, 200);
    assert_eq!(v3["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(p1));
    let after = metric(&metrics_text(&s).await, "k3_prefill_tokens_total{where=\"local\"}");
    assert_eq!(after - before, (v3["usage"]["prompt_tokens"].as_u64().unwrap() - p1) as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_call_round_trip() {
    let s = start(None).await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]);
    let mut messages = vec![json!({"role": "user", "content": "What is the weather in Paris?"})];
    let (st, v) = post(&s, "/v1/chat/completions", json!({"messages": messages, "tools": tools, "tool_choice": "auto"})).await;
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["content"], "Checking.");
    let calls = c["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 2}));
    let id = calls[0]["id"].as_str().unwrap().to_string();

    // Send the call back with its result: the model sees the tool message and answers.
    messages
        .push(json!({"role": "assistant", "content": c["message"]["content"], "reasoning_content": c["message"]["reasoning_content"], "tool_calls": calls}));
    messages.push(json!({"role": "tool", "tool_call_id": id, "content": "{\"temp_c\": 18}"}));
    let (st, v2) = post(&s, "/v1/chat/completions", json!({"messages": messages, "tools": tools})).await;
    assert_eq!(st, 200, "{v2}");
    assert_eq!(v2["choices"][0]["message"]["content"], "It is 18C in Paris.");
    assert_eq!(v2["choices"][0]["finish_reason"], "stop");
    // The re-rendered call matched what the model generated: the whole first turn was reused.
    let u1 = &v["usage"];
    assert_eq!(
        v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(u1["prompt_tokens"].as_u64().unwrap() + u1["completion_tokens"].as_u64().unwrap())
    );

    // Streamed: the call arrives whole in one delta.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"messages": [{"role": "user", "content": "weather?"}], "tools": tools, "stream": true}))
        .send()
        .await
        .unwrap();
    let events = sse_events(&r.text().await.unwrap());
    let call_deltas: Vec<&Value> = events.iter().filter_map(|e| e["choices"][0]["delta"].get("tool_calls")).collect();
    assert_eq!(call_deltas.len(), 1);
    assert_eq!(call_deltas[0][0]["function"]["name"], "get_weather");
    assert_eq!(call_deltas[0][0]["index"], 0);
    assert!(events.iter().any(|e| e["choices"][0]["finish_reason"] == "tool_calls"));

    // The same reply under tool_choice "none", and to a request declaring no tools: the call the
    // model writes is dropped (vLLM, SGLang), the response channel stays, the finish is "stop".
    for body in [
        json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": tools, "tool_choice": "none"}),
        json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}]}),
        json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tool_choice": "none"}),
    ] {
        let (st, v) = post(&s, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        assert!(c["message"].get("tool_calls").is_none(), "{body} -> {v}");
        assert_eq!(c["finish_reason"], "stop", "{body} -> {v}");
        assert_eq!(c["message"]["content"], "Checking.");
        let mut b = body.clone();
        b["stream"] = json!(true);
        let r = reqwest::Client::new().post(format!("{}/v1/chat/completions", s.base)).json(&b).send().await.unwrap();
        let events = sse_events(&r.text().await.unwrap());
        assert!(events.iter().all(|e| e["choices"][0]["delta"].get("tool_calls").is_none()), "{b}");
        assert!(events.iter().any(|e| e["choices"][0]["finish_reason"] == "stop"), "{b}");
    }
    // A named tool_choice is accepted (a declared tool).
    let (st, v) = post(
        &s,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": tools,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_clients_each_get_their_answer() {
    let s = Arc::new(start(None).await);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let stream = i % 2 == 0;
            let body = json!({"messages": [{"role": "user", "content": format!("client {i}")}], "stream": stream});
            let r = reqwest::Client::new().post(format!("{}/v1/chat/completions", s.base)).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            if stream {
                sse_events(&r.text().await.unwrap()).iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str().map(str::to_string)).collect::<String>()
            } else {
                let v: Value = r.json().await.unwrap();
                v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
            }
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), format!("Echo: client {i}"));
    }
    assert_eq!(metric(&metrics_text(&s).await, "k3_requests_total{endpoint=\"chat_completions\"}"), 8.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_completion_equals_the_engine_run_directly() {
    use mac_decoder::engine::GenerationEngine;
    let s = start(None).await;
    let prompt: Vec<u32> = (0..50).map(|i| (i * 7 % 250) as u32).collect();
    let (st, v) = post(&s, "/v1/completions", json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": true})).await;
    assert_eq!(st, 200, "{v}");
    let got: Vec<u32> = v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    // The same prompt through the engine by hand: prefill, argmax, step.
    let mut e = FakeEngine::new(VOCAB, CONTEXT, vec![u32::MAX], 0, |_: &[u32]| vec![]);
    let mut sess = e.new_session().unwrap();
    e.prefill(&mut sess, &prompt).unwrap();
    let mut want = Vec::new();
    for _ in 0..12 {
        let l = e.logits(&sess).unwrap();
        let t = k3_protocol::eval::argmax(l).unwrap() as u32;
        want.push(t);
        e.step(&mut sess, t).unwrap();
    }
    assert_eq!(got, want);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["text"], s.tok.decode(&want));
    // Text prompts are encoded with special tokens allowed.
    let (st, v) = post(&s, "/v1/completions", json!({"prompt": "<|open|>hi", "max_tokens": 3, "return_token_ids": true})).await;
    assert_eq!(st, 200);
    assert_eq!(v["prompt_token_ids"][0].as_u64(), Some(s.tok.special_id("<|open|>").unwrap() as u64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let s = start(None).await;
    let client = reqwest::Client::new();
    // Malformed JSON.
    let r = client.post(format!("{}/v1/chat/completions", s.base)).header("content-type", "application/json").body("{not json").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("JSON"));
    let long = "word ".repeat(4000);
    let user = |c: &str| json!([{"role": "user", "content": c}]);
    let cases: Vec<(Value, u16, &str)> = vec![
        (json!({"model": "gpt-4", "messages": user("hi")}), 404, "model"),
        (json!({"messages": user(&long)}), 400, "context"),
        (json!({"messages": user("hi"), "temperature": 3.5}), 400, "temperature"),
        (json!({"messages": user("hi"), "temperature": "hot"}), 400, "temperature"),
        (json!({"messages": user("hi"), "top_p": 0}), 400, "top_p"),
        (json!({"messages": user("hi"), "max_tokens": 0}), 400, "max_tokens"),
        (json!({"messages": user("hi"), "n": 17}), 400, "n"),
        (json!({"messages": user("hi"), "n": 0}), 400, "n"),
        (json!({"messages": user("hi"), "presence_penalty": 0.5}), 400, "presence_penalty"),
        (json!({"messages": []}), 400, "messages"),
        (json!({"prompt": "hi"}), 400, "messages"),
        (json!({"messages": [{"role": "wizard", "content": "hi"}]}), 400, "role"),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "image"),
        (
            json!({"messages": user("hi"), "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            400,
            "tool_choice",
        ),
        (json!({"messages": user("hi"), "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}}), 400, "tool_choice"),
        (json!({"messages": user("hi"), "reasoning_effort": "extreme"}), 400, "reasoning_effort"),
        (json!({"messages": [{"role": "tool", "content": "orphan result"}]}), 400, "tool"),
        (json!({"messages": user("hi"), "response_format": {"type": "xml"}}), 400, "response_format"),
        (json!({"messages": user("hi"), "stop": ["a", "b", "c", "d", "e"]}), 400, "stop"),
        (json!([1, 2, 3]), 400, "object"),
    ];
    // max_tokens past the context left is clamped to it (clients send a fixed 32,000), not refused.
    let (st, v) = post(&s, "/v1/chat/completions", json!({"messages": user("hi"), "max_tokens": 5000})).await;
    assert_eq!(st, 200, "{v}");
    for (body, status, word) in cases {
        let (st, v) = post(&s, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, status, "{body} -> {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_else(|| panic!("no error message for {body}: {v}"));
        assert!(msg.contains(word) || v["error"]["param"].as_str().is_some_and(|p| p.contains(word)), "{body} -> {v}");
    }
    // A 404 for a model id names the ids served (GET /v1/models).
    let served =
        client.get(format!("{}/v1/models", s.base)).send().await.unwrap().json::<Value>().await.unwrap()["data"][0]["id"].as_str().unwrap().to_string();
    let (st, v) = post(&s, "/v1/chat/completions", json!({"model": "kimi-k3-other", "messages": user("hi")})).await;
    assert_eq!(st, 404, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("`kimi-k3-other`") && msg.contains(&format!("serves `{served}`")), "{msg}");
    for (body, word) in [
        (json!({"prompt": [1, 2, 99999]}), "prompt"),
        (json!({"prompt": {"a": 1}}), "prompt"),
        (json!({}), "prompt"),
        (json!({"prompt": "x", "echo": true}), "echo"),
    ] {
        let (st, v) = post(&s, "/v1/completions", body.clone()).await;
        assert_eq!(st, 400, "{body} -> {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(word), "{v}");
    }
    let r = client.get(format!("{}/v1/nothing", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    // The server is still fine and counted the errors.
    let (st, _) = post(&s, "/v1/chat/completions", json!({"messages": user("still alive?")})).await;
    assert_eq!(st, 200);
    assert!(metric(&metrics_text(&s).await, "k3_errors_total{kind=\"invalid_request\"}") >= 15.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_models_health_metrics_and_stop_strings() {
    let s = start(Some("sekret")).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", s.base);
    let body = json!({"messages": [{"role": "user", "content": "abc: def"}], "stop": ["de"]});
    let r = client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let r = client.post(&url).bearer_auth("wrong").json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = client.post(&url).bearer_auth("sekret").json(&body).send().await.unwrap().json().await.unwrap();
    // The stop string applies to the content only; the reasoning keeps it.
    assert_eq!(v["choices"][0]["message"]["content"], "Echo: abc: ");
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "Thinking about: abc: def");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let models: Value = client.get(format!("{}/v1/models", s.base)).bearer_auth("sekret").send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "k3-synth");
    // (A stop-string request returns before the engine notices the cancel; a plain one after
    // the engine's bookkeeping.)
    let r = client.post(&url).bearer_auth("sekret").json(&json!({"messages": [{"role": "user", "content": "x"}]})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let health: Value = reqwest::get(format!("{}/health", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(health["status"], "ok");
    let text = metrics_text(&s).await;
    for name in [
        "k3_prompt_tokens_total",
        "k3_generated_tokens_total",
        "k3_prefill_tokens_total{where=\"remote\"}",
        "k3_prefill_seconds_total{where=\"local\"}",
        "k3_handoff_bytes_total",
        "k3_handoff_exposed_tail_seconds_total",
        "k3_decode_tokens_per_second",
        "k3_sessions_held",
        "k3_prefill_fallbacks_total",
        "k3_errors_total{kind=\"unauthorized\"}",
    ] {
        metric(&text, name);
    }
    assert!(metric(&text, "k3_decode_tokens_per_second") > 0.0);
    assert_eq!(metric(&text, "k3_errors_total{kind=\"unauthorized\"}"), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_models_tokenize_and_reasoning_tokens() {
    let s = start(None).await;
    let user = json!([{"role": "user", "content": "Hello there"}]);
    // Chat logprobs: one entry per generated token, top alternatives sorted, the chosen one first
    // (the fake model's logits are one-hot).
    let (st, v) = post(&s, "/v1/chat/completions", json!({"messages": user, "logprobs": true, "top_logprobs": 2, "return_token_ids": true})).await;
    assert_eq!(st, 200, "{v}");
    let c = &v["choices"][0];
    let entries = c["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len(), c["token_ids"].as_array().unwrap().len());
    for e in entries {
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["token"], e["token"]);
        assert!(top[0]["logprob"].as_f64().unwrap() >= top[1]["logprob"].as_f64().unwrap());
    }
    // reasoning tokens are counted in usage
    let rt = v["usage"]["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
    assert!(rt > 0 && rt < v["usage"]["completion_tokens"].as_u64().unwrap(), "{v}");
    // Streamed: the entries arrive across the chunks, as many as tokens.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"messages": user, "logprobs": true, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    let events = sse_events(&r.text().await.unwrap());
    let streamed: usize = events.iter().filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array()).map(|a| a.len()).sum();
    let usage = events.iter().find(|e| e.get("usage").is_some_and(|u| !u.is_null())).unwrap();
    assert_eq!(streamed as u64, usage["usage"]["completion_tokens"].as_u64().unwrap());
    // Legacy completions: `logprobs` is an integer.
    let (st, v) = post(&s, "/v1/completions", json!({"prompt": "abc", "max_tokens": 4, "logprobs": 3})).await;
    assert_eq!(st, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 3);
    for bad in [json!({"messages": user, "top_logprobs": 3}), json!({"messages": user, "logprobs": true, "top_logprobs": 21})] {
        let (st, _) = post(&s, "/v1/chat/completions", bad).await;
        assert_eq!(st, 400);
    }
    // GET /v1/models/{id}, a real `created`.
    let m: Value = reqwest::get(format!("{}/v1/models/k3-synth", s.base)).await.unwrap().json().await.unwrap();
    assert_eq!(m["id"], "k3-synth");
    assert!(m["created"].as_u64().unwrap() > 1_700_000_000);
    let r = reqwest::get(format!("{}/v1/models/other", s.base)).await.unwrap();
    assert_eq!(r.status(), 404);
    // POST /tokenize: the chat render (= what the chat endpoint prefilled) and raw prompts.
    let (st, t) = post(&s, "/tokenize", json!({"messages": user, "return_token_strs": true})).await;
    assert_eq!(st, 200, "{t}");
    let (_, v) = post(&s, "/v1/chat/completions", json!({"messages": user, "return_token_ids": true})).await;
    assert_eq!(t["tokens"], v["prompt_token_ids"]);
    assert_eq!(t["count"].as_u64(), v["usage"]["prompt_tokens"].as_u64());
    assert!(t["text"].as_str().unwrap().ends_with("<|open|>think<|sep|>"));
    assert_eq!(t["token_strs"].as_array().unwrap().len(), t["count"].as_u64().unwrap() as usize);
    assert!(t["segments"].as_array().unwrap().iter().any(|seg| seg[1] == json!(true)));
    let (st, t) = post(&s, "/tokenize", json!({"prompt": "hi"})).await;
    assert_eq!(st, 200);
    assert!(t["count"].as_u64().unwrap() >= 1);
}

/// Parses an Anthropic SSE body into `(event name, JSON)` pairs (the name must repeat the JSON's
/// `type`).
fn anthropic_events(body: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut name = None;
    for line in body.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = Some(n.to_string());
        } else if let Some(d) = line.strip_prefix("data: ") {
            let v: Value = serde_json::from_str(d).unwrap();
            let n = name.take().unwrap_or_else(|| panic!("data without an event name: {d}"));
            assert_eq!(v["type"], n.as_str(), "{body}");
            out.push((n, v));
        }
    }
    out
}

const WEATHER_TOOL: &str = r#"[{"name": "get_weather", "description": "Weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}]"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_thinking_tools_and_tool_results() {
    let s = start(None).await;
    let think = json!({"type": "enabled", "budget_tokens": 2048});
    // Plain reply with thinking: a thinking block, then a text block; usage matches count_tokens.
    let body = json!({"model": "k3-synth", "max_tokens": 200, "system": "Be brief.", "thinking": think,
                      "messages": [{"role": "user", "content": "hello there"}]});
    let (st, v) = post(&s, "/v1/messages", body.clone()).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    // The signature is this server's seal of the reasoning (it round-trips; see below).
    let signature = v["content"][0]["signature"].as_str().unwrap().to_string();
    assert!(signature.starts_with("k3r1."), "{v}");
    assert_eq!(
        v["content"],
        json!([{"type": "thinking", "thinking": "Thinking about: hello there", "signature": signature}, {"type": "text", "text": "Echo: hello there"}])
    );
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["stop_sequence"], Value::Null);
    let mut count_body = body.clone();
    count_body.as_object_mut().unwrap().remove("max_tokens");
    let (st, c) = post(&s, "/v1/messages/count_tokens", count_body).await;
    assert_eq!(st, 200, "{c}");
    let u = &v["usage"];
    assert_eq!(u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(), c["input_tokens"].as_u64().unwrap());
    assert!(u["output_tokens"].as_u64().unwrap() > 10);
    // The same prompt through the OpenAI endpoint renders identically (one pipeline).
    let (_, o) = post(
        &s,
        "/tokenize",
        json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
                                              "chat_template_kwargs": {"thinking": true, "thinking_effort": "low"}}),
    )
    .await;
    assert_eq!(o["count"], c["input_tokens"]);

    // Stop sequences cut the text and are named.
    let mut stopped = body.clone();
    stopped["stop_sequences"] = json!(["zzz", "there"]);
    let (_, v) = post(&s, "/v1/messages", stopped).await;
    assert_eq!(v["content"][1], json!({"type": "text", "text": "Echo: hello "}));
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], "there");

    // A tool call: text, then a tool_use block with the parsed input; stop_reason tool_use.
    let tools: Value = serde_json::from_str(WEATHER_TOOL).unwrap();
    let turn1 = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let (st, v) = post(&s, "/v1/messages", json!({"max_tokens": 300, "thinking": think, "tools": tools, "messages": turn1})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["stop_reason"], "tool_use");
    let blocks = v["content"].as_array().unwrap();
    assert_eq!(blocks.len(), 3, "{v}");
    assert_eq!(blocks[1], json!({"type": "text", "text": "Checking."}));
    assert_eq!(blocks[2]["type"], "tool_use");
    assert_eq!(blocks[2]["name"], "get_weather");
    assert_eq!(blocks[2]["input"], json!({"city": "Paris", "days": 2}));
    let tool_id = blocks[2]["id"].as_str().unwrap().to_string();
    assert!(tool_id.starts_with("toolu_"), "{tool_id}");

    // The round trip: the assistant turn as returned, a tool_result in the next user turn.
    let mut turn2 = turn1.as_array().unwrap().clone();
    turn2.push(json!({"role": "assistant", "content": v["content"]}));
    turn2
        .push(json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": [{"type": "text", "text": "{\"temp_c\": 18}"}]}]}));
    let (st, v2) = post(&s, "/v1/messages", json!({"max_tokens": 300, "thinking": think, "tools": tools, "messages": turn2})).await;
    assert_eq!(st, 200, "{v2}");
    assert_eq!(v2["content"][1], json!({"type": "text", "text": "It is 18C in Paris."}));
    assert_eq!(v2["stop_reason"], "end_turn");
    // The first turn's state is reused: the assistant turn renders as the model wrote it.
    assert!(v2["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 0, "{v2}");

    // tool_choice none: the call the model writes is dropped.
    let (_, v) =
        post(&s, "/v1/messages", json!({"max_tokens": 300, "thinking": think, "tools": tools, "tool_choice": {"type": "none"}, "messages": turn1})).await;
    assert!(v["content"].as_array().unwrap().iter().all(|b| b["type"] != "tool_use"), "{v}");
    assert_eq!(v["stop_reason"], "end_turn");

    // Claude Code's shape: thinking adaptive with display "omitted", output_config.effort, a
    // `system` message inside `messages`, context_management, metadata, cache_control, and
    // max_tokens past the context (clamped). The thinking block comes back empty with the
    // sealed signature; sent back as is, the turn re-renders exactly: the whole first turn,
    // reply included, is reused.
    let omitted = json!({"type": "adaptive", "display": "omitted"});
    let extras = json!({"output_config": {"effort": "high"}, "metadata": {"user_id": "u"}, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}});
    let t1 = json!([{"role": "user", "content": [{"type": "text", "text": "<system-reminder>x</system-reminder>\n"}, {"type": "text", "text": "tell me", "cache_control": {"type": "ephemeral"}}]},
                    {"role": "system", "content": "# Environment"}]);
    let mut b1 = json!({"max_tokens": 32000, "thinking": omitted, "messages": t1});
    b1.as_object_mut().unwrap().extend(extras.as_object().unwrap().clone());
    let (st, a) = post(&s, "/v1/messages", b1.clone()).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["content"][0]["type"], "thinking");
    assert_eq!(a["content"][0]["thinking"], "");
    assert!(a["content"][0]["signature"].as_str().unwrap().starts_with("k3r1."));
    let u1 = &a["usage"];
    let prompt1 = u1["input_tokens"].as_u64().unwrap() + u1["cache_read_input_tokens"].as_u64().unwrap();
    let mut t2 = t1.as_array().unwrap().clone();
    t2.push(json!({"role": "assistant", "content": a["content"]}));
    t2.push(json!({"role": "user", "content": "more"}));
    let mut b2 = b1.clone();
    b2["messages"] = json!(t2);
    let (st, a2) = post(&s, "/v1/messages?beta=true", b2.clone()).await;
    assert_eq!(st, 200, "{a2}");
    let read = a2["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read > prompt1, "the reply re-rendered from its signature is reused too: {read} cached, first prompt {prompt1}");
    // clear_thinking keeping no turn: the old reasoning is not rendered, so less is reused.
    b2["context_management"] = json!({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]});
    let (st, a3) = post(&s, "/v1/messages", b2).await;
    assert_eq!(st, 200, "{a3}");
    assert!(a3["usage"]["cache_read_input_tokens"].as_u64().unwrap() < read);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_streamed_events() {
    let s = start(None).await;
    let tools: Value = serde_json::from_str(WEATHER_TOOL).unwrap();
    let r = reqwest::Client::new()
        .post(format!("{}/v1/messages", s.base))
        .json(&json!({"max_tokens": 300, "stream": true, "thinking": {"type": "enabled", "budget_tokens": 20000}, "tools": tools,
                      "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let events = anthropic_events(&r.text().await.unwrap());
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    // Blocks: thinking (index 0), text (1), tool_use (2); deltas rebuild them.
    let mut kinds = Vec::new();
    let mut texts = vec![String::new(); 3];
    let mut open = None;
    for (n, v) in &events {
        match n.as_str() {
            "content_block_start" => {
                assert_eq!(open, None, "a block starts while another is open");
                let i = v["index"].as_u64().unwrap() as usize;
                assert_eq!(i, kinds.len());
                kinds.push(v["content_block"]["type"].as_str().unwrap().to_string());
                open = Some(i);
            }
            "content_block_delta" => {
                let i = v["index"].as_u64().unwrap() as usize;
                assert_eq!(open, Some(i));
                let d = &v["delta"];
                if d["type"] == "signature_delta" {
                    assert_eq!(kinds[i], "thinking", "a signature ends a thinking block");
                    assert!(d["signature"].as_str().unwrap().starts_with("k3r1."));
                    continue;
                }
                let piece = d["thinking"].as_str().or(d["text"].as_str()).or(d["partial_json"].as_str()).unwrap();
                texts[i].push_str(piece);
            }
            "content_block_stop" => {
                assert_eq!(open, Some(v["index"].as_u64().unwrap() as usize));
                open = None;
            }
            _ => {}
        }
    }
    assert_eq!(kinds, ["thinking", "text", "tool_use"]);
    assert_eq!(texts[0], "Need the weather tool.");
    assert_eq!(texts[1], "Checking.");
    assert_eq!(serde_json::from_str::<Value>(&texts[2]).unwrap(), json!({"city": "Paris", "days": 2}));
    let (_, delta) = &events[events.len() - 2];
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 10);
    let (_, start) = &events[0];
    assert!(start["message"]["usage"]["input_tokens"].as_u64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_errors_have_anthropics_shape() {
    let s = start(Some("sekret")).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/messages", s.base);
    let ok = json!({"max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]});
    // Anthropic's clients send the key as x-api-key; a missing key is an authentication_error.
    let r = client.post(&url).json(&ok).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "authentication_error");
    let r = client.post(&url).header("x-api-key", "sekret").json(&ok).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let tools: Value = serde_json::from_str(WEATHER_TOOL).unwrap();
    let cases: Vec<(Value, u16, &str, &str)> = vec![
        (json!({"messages": [{"role": "user", "content": "hi"}]}), 400, "invalid_request_error", "max_tokens"),
        (json!({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}), 404, "not_found_error", "claude-x"),
        (json!({"max_tokens": 5, "messages": []}), 400, "invalid_request_error", "messages"),
        (json!({"max_tokens": 5, "messages": [{"role": "tool", "content": "hi"}]}), 400, "invalid_request_error", "role"),
        (json!({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}), 400, "invalid_request_error", "temperature"),
        (
            json!({"max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 10}, "messages": [{"role": "user", "content": "hi"}]}),
            400,
            "invalid_request_error",
            "budget_tokens",
        ),
        (
            json!({"max_tokens": 5, "tools": tools, "tool_choice": {"type": "tool", "name": "nope"}, "messages": [{"role": "user", "content": "hi"}]}),
            400,
            "invalid_request_error",
            "nope",
        ),
        (
            json!({"max_tokens": 5, "tools": tools, "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 2000},
                "messages": [{"role": "user", "content": "hi"}]}),
            400,
            "invalid_request_error",
            "thinking",
        ),
        (
            json!({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}], "messages": [{"role": "user", "content": "hi"}]}),
            400,
            "invalid_request_error",
            "server tool",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}),
            400,
            "invalid_request_error",
            "not fetched",
        ),
        (json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}), 400, "invalid_request_error", "document"),
        (
            json!({"max_tokens": 5, "thinking": {"type": "adaptive", "display": "hidden"}, "messages": [{"role": "user", "content": "hi"}]}),
            400,
            "invalid_request_error",
            "display",
        ),
        (
            json!({"max_tokens": 5, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "some"}]}, "messages": [{"role": "user", "content": "hi"}]}),
            400,
            "invalid_request_error",
            "keep",
        ),
    ];
    for (body, status, kind, word) in cases {
        let r = client.post(&url).header("x-api-key", "sekret").json(&body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["type"], "error", "{body} -> {v}");
        assert_eq!(v["error"]["type"], kind, "{body} -> {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(word), "{body} -> {v}");
    }
    // GET /v1/models from an Anthropic client (it sends anthropic-version): Anthropic's shapes.
    let get = |path: &str| client.get(format!("{}{path}", s.base)).header("x-api-key", "sekret").header("anthropic-version", "2023-06-01").send();
    let v: Value = get("/v1/models").await.unwrap().json().await.unwrap();
    assert_eq!(v["data"][0]["type"], "model", "{v}");
    assert_eq!(v["data"][0]["id"], "k3-synth");
    assert_eq!(v["has_more"], false);
    let created = v["data"][0]["created_at"].as_str().unwrap();
    assert!(created.starts_with("20") && created.contains('T') && created.ends_with('Z'), "{created}");
    let v: Value = get("/v1/models/k3-synth").await.unwrap().json().await.unwrap();
    assert_eq!(v["display_name"], "k3-synth");
    let r = get("/v1/models/claude-x").await.unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "not_found_error", "{v}");

    // Malformed JSON, through the same shape.
    let r = client.post(&url).header("x-api-key", "sekret").header("content-type", "application/json").body("{nope").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_one_prefill() {
    let s = start(None).await;
    let user3 = json!([{"role": "user", "content": "three answers"}]);
    let prefilled = |t: &str| metric(t, "k3_prefill_tokens_total{where=\"local\"}");
    let reused = |t: &str| metric(t, "k3_reused_prompt_tokens_total");
    let before = metrics_text(&s).await;
    let (st, v) = post(&s, "/v1/chat/completions", json!({"messages": user3, "n": 3})).await;
    assert_eq!(st, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], "Echo: three answers");
        assert_eq!(c["finish_reason"], "stop");
    }
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap();
    // One prefill: the other two choices start from copies of the prompt's checkpoint.
    let after = metrics_text(&s).await;
    assert_eq!(prefilled(&after) - prefilled(&before), p as f64, "the prompt is prefilled once");
    assert_eq!(reused(&after) - reused(&before), 2.0 * p as f64, "choices 1 and 2 reuse the whole prompt");
    // Usage sums the choices: three times the tokens of the same reply alone.
    let (_, one) = post(&s, "/v1/chat/completions", json!({"messages": user3})).await;
    let per_choice = one["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(3 * per_choice), "usage sums the choices");
    assert_eq!(v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);

    // Streamed: every choice's deltas carry its index; each ends with its finish reason.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"messages": user3, "n": 2, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    let events = sse_events(&r.text().await.unwrap());
    let mut content = vec![String::new(); 2];
    let mut finish = vec![None; 2];
    let mut usage = None;
    for e in &events {
        if let Some(u) = e.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
            continue;
        }
        let c = &e["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        if let Some(t) = c["delta"]["content"].as_str() {
            content[i].push_str(t);
        }
        if let Some(f) = c["finish_reason"].as_str() {
            assert!(finish[i].is_none(), "one finish per choice");
            finish[i] = Some(f.to_string());
        }
    }
    assert_eq!(content, ["Echo: three answers", "Echo: three answers"]);
    assert_eq!(finish, [Some("stop".to_string()), Some("stop".to_string())]);
    assert_eq!(usage.unwrap()["completion_tokens"].as_u64(), Some(2 * per_choice));

    // Legacy completions: n = 2 (the fake model's text is a function of the history, so both
    // choices are the n = 1 text), one prefill, usage sums; streamed by index.
    let (st, one) = post(&s, "/v1/completions", json!({"prompt": "raw text prompt", "temperature": 0, "max_tokens": 6})).await;
    assert_eq!(st, 200, "{one}");
    let before = metrics_text(&s).await;
    let (st, two) = post(&s, "/v1/completions", json!({"prompt": "raw text prompt", "temperature": 0, "max_tokens": 6, "n": 2})).await;
    assert_eq!(st, 200, "{two}");
    for (i, c) in two["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], one["choices"][0]["text"]);
    }
    assert_eq!(two["usage"]["completion_tokens"].as_u64(), Some(12));
    let after = metrics_text(&s).await;
    assert_eq!(prefilled(&after), prefilled(&before), "the prompt's checkpoint serves both choices");
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.base))
        .json(&json!({"prompt": "raw text prompt", "temperature": 0, "max_tokens": 6, "n": 2, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    let events = sse_events(&r.text().await.unwrap());
    let mut texts = vec![String::new(); 2];
    let mut finishes = 0;
    for e in &events {
        if let Some(u) = e.get("usage").filter(|u| !u.is_null()) {
            assert_eq!(u["completion_tokens"], 12);
            continue;
        }
        let c = &e["choices"][0];
        texts[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
        finishes += c["finish_reason"].is_string() as usize;
    }
    assert_eq!(finishes, 2);
    assert_eq!(texts, [one["choices"][0]["text"].as_str().unwrap(); 2]);
}

/// The prompt cache is partitioned by `cache_salt` (chat completions, completions, responses,
/// Anthropic messages at the top level or in `metadata`) and, on a server with several API
/// keys, by the key: a request reuses, and is told about (`cached_tokens`,
/// `first_difference`), only held prompts of its own salt and key. The same prompt under
/// another salt, no salt, or another key starts from nothing. A response stored under one
/// scope is not found (`previous_response_id`) from another. Before, every client shared one
/// store: a guessed prompt's `cached_tokens` said whether anyone had sent it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salt_and_api_keys_partition_the_prompt_cache() {
    let (dir, tok) = support::synth_tokenizer(VOCAB, CONTEXT);
    let marker = tok
        .encode_segments(&[m("<|open|>"), t("message"), t(" role"), t("=\""), t("assistant"), t("\""), m("<|sep|>"), m("<|open|>"), t("think"), m("<|sep|>")])
        .unwrap();
    let stop = tok.special_id("<|end_of_msg|>").unwrap();
    let tok2 = tok.clone();
    let make = move || Ok(FakeEngine::new(VOCAB, CONTEXT, marker, stop, move |p: &[u32]| reply(&tok2, p)));
    let mut state = support::app_state(make, StoreOptions { max_sessions: 64, max_bytes: 1 << 30, checkpoints: true }, tok.clone(), "k3-synth");
    state.api_key = Some("key-one".into());
    state.more_api_keys = vec!["key-two".into()];
    let base = format!("http://{}", support::serve(state).await);
    let _dir = dir;
    let send = |path: &'static str, key: &'static str, body: Value| {
        let base = base.clone();
        async move {
            let r = reqwest::Client::new().post(format!("{base}{path}")).bearer_auth(key).json(&body).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let messages = json!([{"role": "system", "content": "You are the assistant of a secret project called Bluebird."}, {"role": "user", "content": "what is the launch date"}]);
    let chat = |salt: Option<&str>| {
        let mut b = json!({"messages": messages.clone()});
        if let Some(s) = salt {
            b["cache_salt"] = json!(s);
        }
        b
    };
    let usage = |v: &Value| {
        (v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(), v["usage"]["prompt_tokens_details"]["first_difference"].as_u64().unwrap())
    };

    let (st, v) = send("/v1/chat/completions", "key-one", chat(Some("alice"))).await;
    assert_eq!(st, 200, "{v}");
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage(&v), (0, 0));
    // the same salt and key: reused
    let (_, v) = send("/v1/chat/completions", "key-one", chat(Some("alice"))).await;
    let (cached, _) = usage(&v);
    assert!(cached > 0 && cached <= p, "the same salt did not reuse its prompt: {v}");
    // another salt, no salt, the same salt under another key: nothing held, nothing told
    for (key, salt) in [("key-one", Some("bob")), ("key-one", None), ("key-two", Some("alice"))] {
        let (st, v) = send("/v1/chat/completions", key, chat(salt)).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(usage(&v), (0, 0), "{key} / {salt:?} saw another scope's prompt: {v}");
    }
    // ... and each of those now has its own held prompt
    let (_, v) = send("/v1/chat/completions", "key-one", chat(None)).await;
    assert!(usage(&v).0 > 0, "{v}");

    // completions: the same text under two salts
    let prompt = json!({"prompt": "The Bluebird launch is on", "max_tokens": 2, "cache_salt": "carol"});
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let (st, v) = send("/v1/completions", "key-one", prompt.clone()).await;
    assert_eq!((st, cached(&v)), (200, 0), "{v}");
    let (_, v) = send("/v1/completions", "key-one", prompt.clone()).await;
    assert!(cached(&v) > 0, "{v}");
    let mut other = prompt.clone();
    other["cache_salt"] = json!("dave");
    let (_, v) = send("/v1/completions", "key-one", other).await;
    assert_eq!(cached(&v), 0, "{v}");

    // Anthropic messages: metadata.cache_salt and the top-level field are one salt
    let am = |salt: Value| {
        let mut b = json!({"model": "k3-synth", "max_tokens": 64, "system": "Bluebird notes.", "messages": [{"role": "user", "content": "the launch date?"}]});
        b.as_object_mut().unwrap().extend(salt.as_object().unwrap().clone());
        b
    };
    let read = |v: &Value| v["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    let (st, v) = send("/v1/messages", "key-one", am(json!({"metadata": {"cache_salt": "erin"}}))).await;
    assert_eq!((st, read(&v)), (200, 0), "{v}");
    let (_, v) = send("/v1/messages", "key-one", am(json!({"cache_salt": "erin"}))).await;
    assert!(read(&v) > 0, "{v}");
    let (_, v) = send("/v1/messages", "key-one", am(json!({"metadata": {"cache_salt": "frank"}}))).await;
    assert_eq!(read(&v), 0, "{v}");
    let (st, v) = send("/v1/messages", "key-one", am(json!({"cache_salt": "erin", "metadata": {"cache_salt": "frank"}}))).await;
    assert_eq!(st, 400, "{v}");

    // responses: cached tokens and stored responses per scope
    let (st, v) = send("/v1/responses", "key-one", json!({"input": "Bluebird status?", "cache_salt": "gina"})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["input_tokens_details"]["cached_tokens"].as_u64(), Some(0));
    let id = v["id"].as_str().unwrap().to_string();
    let (st, v) = send("/v1/responses", "key-one", json!({"input": "more", "previous_response_id": id, "cache_salt": "gina"})).await;
    assert_eq!(st, 200, "{v}");
    assert!(v["usage"]["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{v}");
    for (key, salt) in [("key-one", json!("hank")), ("key-one", Value::Null), ("key-two", json!("gina"))] {
        let (st, v) = send("/v1/responses", key, json!({"input": "more", "previous_response_id": id, "cache_salt": salt})).await;
        assert_eq!(st, 404, "{key} / {salt}: {v}");
    }

    // a salt that would not separate is refused
    for bad in [json!(""), json!(5), json!("x".repeat(2000))] {
        let mut b = chat(None);
        b["cache_salt"] = bad.clone();
        let (st, v) = send("/v1/chat/completions", "key-one", b).await;
        assert_eq!(st, 400, "{bad}: {v}");
        assert_eq!(v["error"]["param"], "cache_salt");
    }
    // either key is accepted, another is not
    let (st, _) = send("/v1/chat/completions", "key-three", chat(None)).await;
    assert_eq!(st, 401);
}
