//! Hostile requests found 2026-12-01 (docs/hardening.md, "Hostile and heavy load"): each is
//! refused at once with a clear 4xx, on a server over the fake engine (context 3,000 tokens).

use std::io::{Read, Write};
use std::time::Duration;

use mac_decoder::engine::StoreOptions;
use serde_json::{json, Value};
use support::FakeEngine;

mod support;

const VOCAB: usize = 1024;
const CONTEXT: usize = 3000;

struct Server {
    addr: std::net::SocketAddr,
    _dir: tempfile::TempDir,
}

async fn start() -> Server {
    let (dir, tok) = support::synth_tokenizer(VOCAB, CONTEXT);
    let stop = tok.special_id("<|end_of_msg|>").unwrap();
    let make = move || Ok(FakeEngine::new(VOCAB, CONTEXT, vec![], stop, move |_: &[u32]| vec![300, 301, stop]));
    let state = support::app_state(make, StoreOptions { max_sessions: 4, max_bytes: 1 << 30, checkpoints: false }, tok, "synth");
    Server { addr: support::serve(state).await, _dir: dir }
}

async fn post(s: &Server, path: &str, body: String) -> (u16, Value) {
    support::post_json(s.addr, path, body).await
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn message(v: &Value) -> String {
    v["error"]["message"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_of_100k_keys_is_refused_by_the_key_cap() {
    let s = start().await;
    let mut body = String::from(r#"{"messages": [{"role": "user", "content": "hi"}], "ignored": {"#);
    for i in 0..100_000 {
        if i > 0 {
            body.push_str(", ");
        }
        body.push_str(&format!("\"k{i}\": 0"));
    }
    body.push_str("}}");
    assert!(body.len() > 1_200_000);
    let (status, v) = post(&s, "/v1/chat/completions", body).await;
    assert_eq!(status, 400, "{v}");
    assert!(message(&v).contains("more than 10000 keys"), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_over_the_context_are_refused_before_all_of_them_is_tokenized() {
    let s = start().await;
    // 4 MB of text: ten tokenizer chunks; the context (3,000 tokens) is full within the first
    let text = "many words of text ".repeat(4 << 20 >> 4);
    for (path, body) in [
        ("/tokenize", json!({"prompt": text})),
        ("/v1/completions", json!({"prompt": text, "max_tokens": 1})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1})),
        ("/tokenize", json!({"messages": [{"role": "user", "content": text}]})),
    ] {
        let (status, v) = post(&s, path, body.to_string()).await;
        assert_eq!(status, 400, "{path}: {v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{path}: {v}");
        // it stopped after one chunk (400,000 characters), not at the 4 MB's end
        let m = message(&v);
        let at: usize = m.split("tokenizing stopped at ").nth(1).and_then(|r| r.split(')').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
        assert!((CONTEXT..400_000).contains(&at), "{path}: {m}");
    }
    // within the context all is as before
    let (status, v) = post(&s, "/tokenize", json!({"prompt": "many words"}).to_string()).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["count"].as_u64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_sampling_knobs_and_schemas_out_of_range_are_refused() {
    let s = start().await;
    let long_stop = "x".repeat(2000);
    let not_schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2, 3]}});
    let false_schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": false}});
    for (extra, param, want) in [
        (json!({"stop": [""]}), "stop", "empty"),
        (json!({"stop": [long_stop]}), "stop", "at most 1024"),
        (json!({"min_p": 2}), "min_p", "[0, 1]"),
        (json!({"logit_bias": {"99999999999": 1}}), "logit_bias", "token ids"),
        (json!({"logit_bias": {"5": 1e308}}), "logit_bias", "[-100, 100]"),
        (json!({"response_format": false_schema}), "response_format", "`false`"),
        (json!({"response_format": not_schema}), "response_format", "not array"),
        (json!({"chat_template_kwargs": {"response_schema": false}}), "response_format", "`false`"),
    ] {
        let (status, v) = post(&s, "/v1/chat/completions", chat(extra.clone()).to_string()).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
        assert!(message(&v).contains(want), "{extra}: {v}");
    }
    let stops: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
    let body = json!({"model": "synth", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": stops});
    let (status, v) = post(&s, "/v1/messages", body.to_string()).await;
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("at most 16"), "{v}");
    // in range, they are served
    let (status, v) = post(&s, "/v1/chat/completions", chat(json!({"stop": ["zz"], "min_p": 0, "logit_bias": {}})).to_string()).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_tools_or_images_and_unsatisfiable_schemas_are_a_clean_400() {
    let s = start().await;
    let tools: Vec<Value> =
        (0..5000).map(|i| json!({"type": "function", "function": {"name": format!("tool_{i}"), "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}})).collect();
    let (status, v) = post(&s, "/v1/chat/completions", chat(json!({"tools": tools, "tool_choice": "required"})).to_string()).await;
    assert_eq!(status, 400, "{v}");
    assert!(message(&v).contains("at most 512"), "{v}");
    let png = "data:image/png;base64,iVBORw0KGgo=";
    let parts: Vec<Value> = (0..40).map(|_| json!({"type": "image_url", "image_url": {"url": png}})).collect();
    let body = json!({"messages": [{"role": "user", "content": parts}], "max_tokens": 4});
    let (status, v) = post(&s, "/v1/chat/completions", body.to_string()).await;
    assert_eq!(status, 400, "{v}");
    assert!(message(&v).contains("at most 16 images"), "{v}");
    // recursive $refs that never reach a value: no reply satisfies them (before: 500 after the
    // prefill, the message carrying llguidance's parser state)
    let self_ref = json!({"$ref": "#"});
    let loop_ref = json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}});
    for schema in [self_ref, loop_ref] {
        let rf = json!({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}});
        for thinking in [true, false] {
            let (status, v) =
                post(&s, "/v1/chat/completions", chat(json!({"response_format": rf, "chat_template_kwargs": {"thinking": thinking}})).to_string()).await;
            assert_eq!(status, 400, "{schema} thinking {thinking}: {v}");
            assert_eq!(v["error"]["param"], "response_format", "{v}");
            let m = message(&v);
            eprintln!("{schema}: {m}");
            assert!(!m.contains('\n') && m.len() < 400 && !m.contains("backtrace") && !m.contains(".rs:"), "{schema} thinking {thinking}: {m}");
        }
    }
}

/// One raw HTTP/1.1 request; the status code.
fn raw(addr: std::net::SocketAddr, head: &str, body: &str) -> u16 {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let req = format!("{head}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_host_or_origin_header_is_refused() {
    let s = start().await;
    let addr = s.addr;
    let body = json!({"prompt": "hi", "max_tokens": 2}).to_string();
    let codes = tokio::task::spawn_blocking(move || {
        [
            raw(addr, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1", &body),
            raw(addr, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example", &body),
            raw(addr, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://localhost\r\nOrigin: http://evil.example", &body),
        ]
    })
    .await
    .unwrap();
    assert_eq!(codes, [200, 400, 400]);
}
