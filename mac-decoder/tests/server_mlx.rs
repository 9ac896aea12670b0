//! The server on the real MLX engine and a synthetic K3 model (release layout, its own
//! tokenizer), over HTTP: greedy `/v1/completions` equals `k3-decode generate` on the same ids,
//! chat completions (streamed and not) parse, and a second turn continues the first turn's
//! held state (only the new tokens are prefilled; a checkpoint copy continues identically).
#![cfg(feature = "mlx")]

use serde_json::{json, Value};

mod support;

struct Server {
    base: String,
    dir: tempfile::TempDir,
}

async fn start() -> Server {
    let dir = support::tiny_model(None);
    let addr = support::serve(support::mlx_state(dir.path())).await;
    Server { base: format!("http://{addr}"), dir }
}

async fn post(s: &Server, path: &str, body: Value) -> Value {
    let r = reqwest::Client::new().post(format!("{}{path}", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

async fn local_prefilled(s: &Server) -> f64 {
    let text = reqwest::get(format!("{}/metrics", s.base)).await.unwrap().text().await.unwrap();
    text.lines().find(|l| l.starts_with("k3_prefill_tokens_total{where=\"local\"}")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_on_the_mlx_engine() {
    let s = start().await;

    // Greedy completion through the server = `k3-decode generate --greedy` on the same ids.
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 900) as u32 + 3).collect();
    let v = post(&s, "/v1/completions", json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": true})).await;
    let served = ids(&v["choices"][0]["token_ids"]);
    assert_eq!(served.len(), 10);
    let ids_path = s.dir.path().join("ids.json");
    let out_path = s.dir.path().join("out.json");
    std::fs::write(&ids_path, serde_json::to_string(&prompt).unwrap()).unwrap();
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_k3-decode"))
        .args(["generate", "--model"])
        .arg(s.dir.path())
        .arg("--input-ids")
        .arg(&ids_path)
        .args(["--max-new-tokens", "10", "--greedy", "--out"])
        .arg(&out_path)
        .status()
        .unwrap();
    assert!(st.success());
    let cli: Value = serde_json::from_str(&std::fs::read_to_string(&out_path).unwrap()).unwrap();
    assert_eq!(served, ids(&cli["tokens"]), "server greedy tokens = k3-decode generate tokens");

    // The same prompt again: served from the prompt checkpoint (a copy through the hand-off
    // state), no prefill, identical tokens.
    let before = local_prefilled(&s).await;
    let v = post(&s, "/v1/completions", json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": true})).await;
    assert_eq!(ids(&v["choices"][0]["token_ids"]), served);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(prompt.len() as u64));
    assert_eq!(local_prefilled(&s).await, before);

    // Chat, non-streamed then a second turn on top of it.
    let first = json!([{"role": "user", "content": "Hello, tiny model."}]);
    let v1 = post(&s, "/v1/chat/completions", json!({"messages": first, "max_tokens": 12, "temperature": 0})).await;
    let c = &v1["choices"][0];
    assert!(["stop", "length", "tool_calls"].contains(&c["finish_reason"].as_str().unwrap()), "{v1}");
    let p1 = v1["usage"]["prompt_tokens"].as_u64().unwrap();
    let mut second = first.as_array().unwrap().clone();
    second.push(json!({"role": "assistant", "content": c["message"]["content"], "reasoning_content": c["message"]["reasoning_content"]}));
    second.push(json!({"role": "user", "content": "And again?"}));
    let before = local_prefilled(&s).await;
    let v2 = post(&s, "/v1/chat/completions", json!({"messages": second, "max_tokens": 6, "temperature": 0})).await;
    let p2 = v2["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= p1, "turn 2 continues at least turn 1's prompt ({cached} < {p1})");
    assert_eq!(local_prefilled(&s).await - before, (p2 - cached) as f64, "only the new tokens are prefilled");

    // Streamed chat ends with a finish reason, usage and [DONE].
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&json!({"messages": [{"role": "user", "content": "Stream it."}], "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    let body = r.text().await.unwrap();
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    assert!(body.contains("\"finish_reason\":\"") && body.contains("\"usage\":{"), "{body}");
}
