//! What the server tests share (each includes it with `mod support;`): the deterministic fake
//! engine, and the set-up every one of them repeats — a tokenizer or a synthetic model in a
//! temporary directory, an engine thread with its metrics, the HTTP server on a free loopback
//! port.
// Each test binary uses its own part of this module.
#![allow(dead_code, unused_imports)]

pub(crate) mod fake_engine;

use std::net::SocketAddr;
use std::sync::Arc;

pub(crate) use fake_engine::FakeEngine;
use mac_decoder::engine::GenerationEngine;
use mac_decoder::engine::{EngineHandle, StoreOptions};
use mac_decoder::metrics::Metrics;
use mac_decoder::server::{router, AppState};
use mac_decoder::tokenizer::Tokenizer;

/// The synthetic model's tokenizer for `vocab` ids (release format; `max_len` its model length)
/// and a `config.json` naming the vocabulary, in a fresh temporary directory (kept alive by the
/// returned guard).
pub(crate) fn synth_tokenizer(vocab: usize, max_len: usize) -> (tempfile::TempDir, Arc<Tokenizer>) {
    let dir = tempfile::tempdir().unwrap();
    k3_protocol::synth::tokenizer::write_tokenizer(dir.path(), vocab, max_len).unwrap();
    std::fs::write(dir.path().join("config.json"), serde_json::json!({"text_config": {"vocab_size": vocab}}).to_string()).unwrap();
    let tok = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
    (dir, tok)
}

/// A random-weight Tiny model (release layout, its own tokenizer) with `seed` (the preset's
/// default when `None`), in a fresh temporary directory.
pub(crate) fn tiny_model(seed: Option<u64>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = k3_protocol::synth::SynthOptions::new(k3_protocol::synth::Preset::Tiny);
    opts.progress = false;
    if let Some(seed) = seed {
        opts.seed = seed;
    }
    k3_protocol::synth::write_model(dir.path(), &opts).unwrap();
    dir
}

/// The server state over an engine thread running the engine `make` builds (fresh metrics, no
/// API key; tests set `api_key` / `guard` on the result before serving it).
pub(crate) fn app_state<E, F>(make: F, store: StoreOptions, tok: Arc<Tokenizer>, model_id: &str) -> AppState
where
    E: GenerationEngine,
    F: FnOnce() -> anyhow::Result<E> + Send + 'static,
{
    let metrics = Arc::new(Metrics::new());
    let engine = EngineHandle::spawn(make, store, metrics.clone()).unwrap();
    AppState::new(engine, tok, metrics, model_id.into(), None)
}

/// The server state over the MLX engine on the model in `model` (its own tokenizer, default
/// engine options and store, model id `tiny`).
#[cfg(feature = "mlx")]
pub(crate) fn mlx_state(model: &std::path::Path) -> AppState {
    use mac_decoder::decode::EngineOptions;
    use mac_decoder::engine::mlx_engine::MlxEngine;
    let tok = Arc::new(Tokenizer::from_dir(model).unwrap());
    let model = model.to_path_buf();
    app_state(move || MlxEngine::load(&model, EngineOptions::default(), 0), StoreOptions::default(), tok, "tiny")
}

/// Serves `state` (every route of [`router`]) on a free loopback port in the background; its
/// address.
pub(crate) async fn serve(state: AppState) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let state = Arc::new(state);
    tokio::spawn(async move { axum::serve(listener, router(state)).await.unwrap() });
    addr
}

/// The value of the metric `name` (the whole series name, labels included) in a Prometheus text;
/// panics naming it when it is missing.
pub(crate) fn metric(text: &str, name: &str) -> f64 {
    find_metric(text, name).unwrap_or_else(|| panic!("metric {name} missing in\n{text}"))
}

/// The value of the metric `name` in a Prometheus text, `None` when the series is absent (a
/// labelled series appears at its first use).
pub(crate) fn find_metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .map(|v| v.parse().unwrap_or_else(|e| panic!("metric {name}: value {v:?}: {e}")))
}

/// A JSON `body` POSTed to `http://{addr}{path}` (60 s timeout): the status and the answer
/// (parsed, or as a string when it is not JSON).
pub(crate) async fn post_json(addr: SocketAddr, path: &str, body: String) -> (u16, serde_json::Value) {
    let r = reqwest::Client::new()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .timeout(std::time::Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)))
}

/// About `bytes` of text in words of 2–10 random lowercase letters (xorshift from `seed`),
/// separated by spaces and now and then a newline: every word new work for the tokenizer.
pub(crate) fn varied_words(bytes: usize, seed: u64) -> String {
    let mut x = seed | 1;
    let mut text = String::with_capacity(bytes + 16);
    while text.len() < bytes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 2 + (x % 9) as usize;
        text.extend((0..len).map(|k| (b'a' + ((x >> (5 * k)) % 26) as u8) as char));
        text.push(if x.is_multiple_of(7) { '\n' } else { ' ' });
    }
    text
}
