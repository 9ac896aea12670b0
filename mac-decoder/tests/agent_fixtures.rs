//! The requests the coding-agent clients really send (captured from Claude Code 2.1.328, Codex
//! CLI 0.169.0, OpenCode 1.18.33, Qwen Code 0.24.4 and aider 0.86.2 by
//! scripts/capture-agents.sh, trimmed, in tests/fixtures/agents/) replayed against the server
//! with the fake engine: every one is served (no 4xx/5xx, no error event, the event sequence
//! each client reads), Claude Code's three turns reuse the held prefix, Codex's reasoning and
//! function-call round trip renders. A regression in the request handling shows here without
//! the clients (tests/agent_clients.rs runs the clients themselves).

use mac_decoder::engine::StoreOptions;
use mac_decoder::tokenizer::{Segment, Tokenizer};
use serde_json::{json, Value};
use support::{metric, FakeEngine};

mod support;

const VOCAB: usize = 1024;
const CONTEXT: usize = 400_000;

fn m(s: &str) -> Segment {
    Segment::markup(s)
}
fn t(s: &str) -> Segment {
    Segment::text(s)
}

struct Server {
    base: String,
    _dir: tempfile::TempDir,
}

/// The fake model: a short thought and "Hello." (a chat reply after a thinking prompt; after a
/// non-thinking prompt the thought is part of the text).
fn reply(tok: &Tokenizer) -> Vec<u32> {
    tok.encode_segments(&[
        t("A short thought."),
        m("<|close|>think<|sep|><|open|>response<|sep|>"),
        t("Hello."),
        m("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"),
    ])
    .unwrap()
}

async fn start() -> Server {
    start_with(std::time::Duration::ZERO, 2048).await
}

/// A server whose fake engine takes `per_token` per prefilled token, in chunks of `chunk`.
async fn start_with(per_token: std::time::Duration, chunk: usize) -> Server {
    let (dir, tok) = support::synth_tokenizer(VOCAB, CONTEXT);
    let marker = tok.encode_segments(&[m("<|open|>"), t("message"), t(" role"), t("=\""), t("assistant"), t("\""), m("<|sep|>")]).unwrap();
    let stop = tok.special_id("<|end_of_msg|>").unwrap();
    let tok2 = tok.clone();
    let make = move || {
        let mut e = FakeEngine::new(VOCAB, CONTEXT, marker, stop, move |_: &[u32]| reply(&tok2));
        e.prefill_chunk = Some(chunk);
        e.prefill_delay_per_token = per_token;
        Ok(e)
    };
    let state = support::app_state(make, StoreOptions { max_sessions: 16, max_bytes: 1 << 34, checkpoints: true }, tok, "tiny-t");
    Server { base: format!("http://{}", support::serve(state).await), _dir: dir }
}

fn fixture(name: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agents").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// Posts a captured request (its path with the query string, its headers); the status and the
/// body text.
async fn replay(s: &Server, f: &Value) -> (u16, String) {
    let mut r = reqwest::Client::new().post(format!("{}{}", s.base, f["path"].as_str().unwrap()));
    for (k, v) in f["headers"].as_object().unwrap() {
        r = r.header(k.as_str(), v.as_str().unwrap());
    }
    let resp = r.body(f["body"].to_string()).send().await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// Server-sent events as (event name, data).
fn events(body: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for block in body.split("\n\n") {
        let mut name = String::new();
        let mut data = String::new();
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event: ").or_else(|| line.strip_prefix("event:")) {
                name = n.trim().to_string();
            } else if let Some(d) = line.strip_prefix("data: ").or_else(|| line.strip_prefix("data:")) {
                data.push_str(d.trim_start());
            }
        }
        if data.is_empty() {
            continue;
        }
        let v = if data == "[DONE]" { json!("[DONE]") } else { serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}")) };
        out.push((name, v));
    }
    out
}

/// The usage of an Anthropic SSE reply (message_delta's), asserting the event order.
fn anthropic_usage(body: &str) -> Value {
    let evs = events(body);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert!(!names.contains(&"error"), "{body}");
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(names.last(), Some(&"message_stop"), "{names:?}");
    let text: String = evs.iter().filter_map(|(_, v)| v["delta"]["text"].as_str()).collect();
    assert_eq!(text, "Hello.");
    let (_, delta) = evs.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    delta["usage"].clone()
}

fn prompt_of(u: &Value) -> u64 {
    ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"].iter().map(|k| u[*k].as_u64().unwrap()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_turns_are_served_and_reuse_the_prefix() {
    let s = start().await;
    let mut last_prompt = 0;
    for (i, name) in ["claude-code-turn1.json", "claude-code-turn2.json", "claude-code-turn3.json"].iter().enumerate() {
        let f = fixture(name);
        // the shapes the issue names
        let b = &f["body"];
        assert_eq!(b["thinking"]["type"], "adaptive");
        assert_eq!(b["messages"][1]["role"], "system");
        assert!(f["path"].as_str().unwrap().ends_with("?beta=true"));
        let (status, body) = replay(&s, &f).await;
        assert_eq!(status, 200, "{name}: {body}");
        if i == 0 {
            // a long prompt's prefill is reported as it goes (SSE comments clients skip)
            assert!(body.contains(": prefill 2048/"), "no prefill progress in the stream");
        }
        let u = anthropic_usage(&body);
        let prompt = prompt_of(&u);
        println!("{name}: prompt {prompt}, usage {u}");
        if i > 0 {
            let read = u["cache_read_input_tokens"].as_u64().unwrap();
            assert!(read as f64 >= 0.9 * last_prompt as f64, "{name}: {read} of the previous prompt's {last_prompt} reused");
        }
        // count_tokens on the same body says the same prompt size
        let mut count = f.clone();
        count["path"] = json!("/v1/messages/count_tokens?beta=true");
        let (status, body) = replay(&s, &count).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["input_tokens"].as_u64(), Some(prompt));
        last_prompt = prompt;
    }
    // The tool round trip: another server's thinking signature and a tool_result block.
    let (status, body) = replay(&s, &fixture("claude-code-tool-result.json")).await;
    assert_eq!(status, 200, "{body}");
    anthropic_usage(&body);
    let text = reqwest::get(format!("{}/metrics", s.base)).await.unwrap().text().await.unwrap();
    assert!(metric(&text, "k3_reused_prompt_tokens_total") > 0.0);
}

/// The event types of a streamed Responses reply, checked for the sequence Codex reads.
fn responses_events(body: &str) -> Vec<(String, Value)> {
    let evs = events(body);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert!(!names.contains(&"error"), "{body}");
    assert_eq!(&names[..2], &["response.created", "response.in_progress"], "{names:?}");
    assert_eq!(names.last(), Some(&"response.completed"), "{names:?}");
    for (i, (n, v)) in evs.iter().enumerate() {
        assert_eq!(v["type"].as_str(), Some(n.as_str()));
        assert_eq!(v["sequence_number"].as_u64(), Some(i as u64), "{n}");
    }
    for need in
        ["response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.done", "response.output_item.done"]
    {
        assert!(names.contains(&need), "{need} missing in {names:?}");
    }
    evs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_requests_are_served_with_the_responses_events() {
    let s = start().await;
    let f = fixture("codex-turn1.json");
    assert_eq!(f["path"], "/v1/responses");
    let (status, body) = replay(&s, &f).await;
    assert_eq!(status, 200, "{body}");
    let evs = responses_events(&body);
    let done = &evs.last().unwrap().1["response"];
    assert_eq!(done["status"], "completed");
    let items = done["output"].as_array().unwrap();
    // include: ["reasoning.encrypted_content"]: the reasoning item carries the sealed blob
    let reasoning = items.iter().find(|i| i["type"] == "reasoning").expect("a reasoning item");
    let blob = reasoning["encrypted_content"].as_str().expect("encrypted_content").to_string();
    assert!(blob.starts_with("k3r1."));
    let msg = items.iter().find(|i| i["type"] == "message").unwrap();
    assert_eq!(msg["content"][0]["text"], "Hello.");
    let first_prompt = done["usage"]["input_tokens"].as_u64().unwrap();

    // The next turn as Codex sends it: the input again, our reasoning item (sealed) and
    // message, then a new user message. The sealed reasoning renders back exactly: the whole
    // first prompt and reply are reused.
    let mut next = f.clone();
    let input = next["body"]["input"].as_array_mut().unwrap();
    input.push(json!({"type": "reasoning", "id": reasoning["id"], "summary": [], "content": null, "encrypted_content": blob}));
    input.push(json!({"type": "message", "role": "assistant", "id": msg["id"], "content": [{"type": "output_text", "text": "Hello."}]}));
    input.push(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And again."}]}));
    let (status, body) = replay(&s, &next).await;
    assert_eq!(status, 200, "{body}");
    let evs = responses_events(&body);
    let u = &evs.last().unwrap().1["response"]["usage"];
    let cached = u["input_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > first_prompt, "the reply was reused too ({cached} cached, first prompt {first_prompt}): {u}");

    // The captured round trip: another server's encrypted_content (not ours: its content, none,
    // is used), a function call and its output.
    let (status, body) = replay(&s, &fixture("codex-tool-output.json")).await;
    assert_eq!(status, 200, "{body}");
    responses_events(&body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_clients_requests_are_served() {
    let s = start().await;
    for name in ["opencode-title.json", "opencode-turn1.json", "qwen-code-turn1.json", "qwen-code-memory.json", "aider-turn1.json"] {
        let f = fixture(name);
        assert_eq!(f["path"], "/v1/chat/completions");
        let (status, body) = replay(&s, &f).await;
        assert_eq!(status, 200, "{name}: {body}");
        let evs = events(&body);
        assert_eq!(evs.last().map(|(_, v)| v.clone()), Some(json!("[DONE]")), "{name}");
        assert!(evs.iter().all(|(_, v)| v.get("error").is_none()), "{name}: {body}");
        let text: String = evs.iter().filter_map(|(_, v)| v["choices"][0]["delta"]["content"].as_str()).collect();
        assert!(text.contains("Hello."), "{name}: {text:?}");
        let finish: Vec<&str> = evs.iter().filter_map(|(_, v)| v["choices"][0]["finish_reason"].as_str()).collect();
        assert_eq!(finish, ["stop"], "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_well_under_way_is_held_for_the_clients_retry() {
    // 2 ms per token in chunks of 100: a ~1,600-token prompt prefills in about 3.2 s. The client
    // gives up after 2.4 s (about 3/4 done), as Claude Code does at its deadline.
    let s = start_with(std::time::Duration::from_millis(2), 100).await;
    let long = "word ".repeat(700);
    let body = json!({"model": "tiny-t", "messages": [{"role": "user", "content": long}], "max_tokens": 8});
    let url = format!("{}/v1/chat/completions", s.base);
    let quick = reqwest::Client::builder().timeout(std::time::Duration::from_millis(2400)).build().unwrap();
    assert!(quick.post(&url).json(&body).send().await.is_err(), "the client gave up");
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    // The retry finds the whole prompt held: nothing to prefill.
    let v: Value = reqwest::Client::new().post(&url).json(&body).send().await.unwrap().json().await.unwrap();
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"], "{v}");
    // A client that leaves early (less than half done) cancels its prefill.
    let other = json!({"model": "tiny-t", "messages": [{"role": "user", "content": "other ".repeat(700)}], "max_tokens": 8});
    let early = reqwest::Client::builder().timeout(std::time::Duration::from_millis(300)).build().unwrap();
    assert!(early.post(&url).json(&other).send().await.is_err());
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    let v: Value = reqwest::Client::new().post(&url).json(&other).send().await.unwrap().json().await.unwrap();
    // (only the shared opening, the thinking-effort note up to its checkpoint, is reused)
    let u = &v["usage"];
    assert!(u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() * 4 < u["prompt_tokens"].as_u64().unwrap(), "{v}");
    let text = reqwest::get(format!("{}/metrics", s.base)).await.unwrap().text().await.unwrap();
    assert!(metric(&text, "k3_cancelled_requests_total") >= 2.0);
}
