//! The server's default context limit (issue 21: the default context accepted ~1M-token
//! requests, the synthetic models' and K3's `max_position_embeddings`, so a request was taken
//! in and then exhausted memory or ran for hours). Without `--max-context`, `k3-decode serve`
//! takes the limit the context memory budget holds (`context::limit`, as here); a request past
//! it gets a clear 400 before anything is allocated for it. The budget is set small, as
//! `--context-memory-bytes` sets it.
#![cfg(feature = "mlx")]

use std::sync::Arc;
use std::time::Duration;

use k3_protocol::synth::{write_model, Preset, SynthOptions};
use mac_decoder::decode::EngineOptions;
use mac_decoder::engine::context_limit as context;
use mac_decoder::engine::mlx_engine::MlxEngine;
use mac_decoder::engine::{EngineHandle, StoreOptions};
use mac_decoder::metrics::Metrics;
use mac_decoder::server::{router, AppState};
use mac_decoder::tokenizer::Tokenizer;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_the_default_context_limit_is_a_clear_400() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.progress = false;
    write_model(dir.path(), &opts).unwrap();
    let cfg = opts.config().unwrap().text_config;
    assert_eq!(cfg.max_position_embeddings, 1 << 20, "the synthetic model allows 1M positions, as K3 does");
    // A budget that holds 8,192 tokens (and a bit).
    let chunk = EngineOptions::default().prefill_chunk;
    const LIMIT: usize = 8192;
    let budget = context::bytes_per_token(&cfg, chunk) * LIMIT as u64 + 1000;

    let tok = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
    let metrics = Arc::new(Metrics::new());
    let model = dir.path().to_path_buf();
    let weights = k3_protocol::Checkpoint::open(dir.path()).unwrap().total_bytes();
    let ctx = context::limit(&cfg, chunk, 0, mac_decoder::memory::budget(Some(budget), weights));
    assert_eq!(ctx, LIMIT);
    let engine = EngineHandle::spawn(move || MlxEngine::load(&model, EngineOptions::default(), ctx), StoreOptions::default(), metrics.clone()).unwrap();
    assert_eq!(engine.max_context, LIMIT);
    let state = Arc::new(AppState::new(engine, tok, metrics, "tiny".into(), None));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router(state)).await.unwrap() });
    // Before the limit, a request for 100k tokens was accepted and generated for minutes.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let post = |body: Value| {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let r = http.post(format!("{base}/v1/completions")).json(&body).send().await.expect("no answer within 60 s");
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };

    let models: Value = http.get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["max_model_len"], LIMIT, "{models}");

    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 900) as u32 + 3).collect();
    let (status, v) = post(json!({"prompt": prompt, "max_tokens": 100_000, "temperature": 0})).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert_eq!(v["error"]["param"], "max_tokens", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("100000") && msg.contains(&LIMIT.to_string()), "{msg}");

    let long: Vec<u32> = (0..LIMIT as u32 + 500).map(|i| i % 900 + 3).collect();
    let (status, v) = post(json!({"prompt": long, "max_tokens": 1, "temperature": 0})).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains(&format!("{} tokens", LIMIT + 500)), "{v}");

    // Within the limit, requests are served.
    let (status, v) = post(json!({"prompt": prompt, "max_tokens": 4, "temperature": 0})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
}
