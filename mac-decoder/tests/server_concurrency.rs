//! Aggregate decode throughput of concurrent streams through `k3-decode serve`'s HTTP API on
//! the MLX engine and a synthetic tiny model (issue 18's acceptance: 4 parallel streams ≥ 2.5×
//! one stream, median of three runs). Prints the table of 1, 2, 4 and 8 streams that
//! docs/chat-and-server.md quotes. Alone in its test binary, so nothing else competes for the
//! CPU while it measures.
#![cfg(feature = "mlx")]

use std::sync::Arc;
use std::time::Instant;

use k3_protocol::synth::{write_model, Preset, SynthOptions};
use mac_decoder::decode::EngineOptions;
use mac_decoder::server::metrics::Metrics;
use mac_decoder::server::mlx_engine::MlxEngine;
use mac_decoder::server::worker::{EngineHandle, StoreOptions};
use mac_decoder::server::{router, AppState};
use mac_decoder::tokenizer::Tokenizer;
use serde_json::{json, Value};

const TOKENS: usize = 48;

/// `n` parallel completions of `TOKENS` tokens; (tokens generated, seconds).
async fn run(client: &reqwest::Client, url: &str, n: usize, salt: u32) -> (u64, f64) {
    let t0 = Instant::now();
    let replies = futures_util::future::join_all((0..n as u32).map(|i| {
        let prompt: Vec<u32> = (0..8u32).map(|j| (j * 31 + i * 97 + salt * 13 + 3) % 900 + 10).collect();
        let body = json!({"prompt": prompt, "max_tokens": TOKENS, "temperature": 0});
        async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let v: Value = r.json().await.unwrap();
            v["usage"]["completion_tokens"].as_u64().unwrap()
        }
    }))
    .await;
    (replies.iter().sum(), t0.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_parallel_streams_decode_at_least_two_and_a_half_times_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.progress = false;
    write_model(dir.path(), &opts).unwrap();
    let tok = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
    let metrics = Arc::new(Metrics::new());
    let model = dir.path().to_path_buf();
    let max_batch = std::env::var("K3_MAX_BATCH").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let engine = EngineHandle::spawn(
        move || Ok(MlxEngine::load(&model, EngineOptions::default(), 0)?.with_max_batch(max_batch)),
        StoreOptions { max_sessions: 32, max_bytes: 1 << 30, checkpoints: false },
        metrics.clone(),
    )
    .unwrap();
    let state = Arc::new(AppState::new(engine, tok, metrics, "tiny".into(), None));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router(state)).await.unwrap() });
    let url = format!("http://{addr}/v1/completions");
    let client = reqwest::Client::new();
    run(&client, &url, 2, 99).await; // warm-up

    let mut rates = Vec::new();
    eprintln!("max batch {max_batch}, {TOKENS} tokens a stream, tiny synthetic model, MLX CPU backend");
    eprintln!("| streams | aggregate tok/s (median of 3) | runs | vs 1 stream |");
    eprintln!("|---|---|---|---|");
    for (k, n) in [1usize, 2, 4, 8].into_iter().enumerate() {
        let mut r = Vec::new();
        for rep in 0..3 {
            let (tokens, secs) = run(&client, &url, n, (k * 3 + rep) as u32).await;
            r.push(tokens as f64 / secs);
        }
        let m = median(r.clone());
        rates.push(m);
        let runs: Vec<String> = r.iter().map(|x| format!("{x:.0}")).collect();
        eprintln!("| {n} | {m:.0} | {} | {:.2}× |", runs.join(", "), m / rates[0]);
    }
    let ratio = rates[2] / rates[0];
    assert!(ratio >= 2.5, "4 parallel streams decode {:.0} tok/s, one stream {:.0} tok/s: {ratio:.2}× < 2.5×", rates[2], rates[0]);
}
