//! Soak test (issue 21): both servers in one process — a prefill node (CPU backend, loopback
//! QUIC) and `k3-decode serve`'s HTTP server (MLX engine, synthetic tiny model, prefilling long
//! prompts on the node) — under mixed load for a bounded time: streamed and plain chats, streams
//! abandoned after their first events, image requests, short local and long remote prefills,
//! malformed and unwanted requests. Every answer must be correct in kind (200 with a body, or a
//! clean 4xx / 429 / 503); resident memory and open descriptors must stay flat between the end of
//! the warm-up and the end.
//!
//! Short form (CI): `K3_SOAK_SECS` unset → 40 s of load. Long form by hand:
//! `K3_SOAK_SECS=600 cargo test -p mac-decoder --release --test soak -- --nocapture`.
#![cfg(feature = "mlx")]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::model::{Model, WeightPolicy};
use cuda_prefiller::server::{PrefillNode, ServeOptions};
use k3_protocol::synth::{write_model, Preset, SynthOptions};
use k3_protocol::transport::{NodeConfig, NodeIdentity, PeerAuth, Tuning};
use k3_protocol::Checkpoint;
use mac_decoder::decode::EngineOptions;
use mac_decoder::remote::RemoteOptions;
use mac_decoder::server::metrics::Metrics;
use mac_decoder::server::mlx_engine::MlxEngine;
use mac_decoder::server::worker::{EngineHandle, StoreOptions};
use mac_decoder::server::AppState;
use mac_decoder::tokenizer::Tokenizer;
use serde_json::{json, Value};

fn rss_mb() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn png(w: u32, h: u32, seed: u32) -> String {
    use base64::Engine as _;
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7 + seed) as u8, (y * 13 + seed) as u8, ((x ^ y) * 5) as u8]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(out.into_inner()))
}

fn start_node(dir: &Path, cfg: NodeConfig) -> PrefillNode {
    let ck = Arc::new(Checkpoint::open(dir).unwrap());
    let model = Model::new(Arc::new(CpuBackend), ck, WeightPolicy::Resident).unwrap();
    PrefillNode::start(model, "127.0.0.1:0".parse().unwrap(), cfg, ServeOptions::default()).unwrap()
}

async fn start_server(model: &Path, node: SocketAddr, client: NodeConfig) -> String {
    let tok = Arc::new(Tokenizer::from_dir(model).unwrap());
    let metrics = Arc::new(Metrics::new());
    let dir = model.to_path_buf();
    let mut ro = RemoteOptions::new(node.to_string());
    ro.min_tokens = Some(48);
    ro.connect_timeout = Duration::from_secs(5);
    ro.chunk_bytes = 16 << 10;
    let engine = EngineHandle::spawn(
        move || MlxEngine::load(&dir, EngineOptions::default(), 0)?.with_remote_config(ro, client),
        StoreOptions { max_sessions: 8, max_bytes: 256 << 20, checkpoints: true },
        metrics.clone(),
    )
    .unwrap();
    let mut state = AppState::new(engine, tok, metrics, "tiny".into(), None);
    state.guard.max_concurrent = 8;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(mac_decoder::server::serve(listener, Arc::new(state), std::future::pending()));
    format!("http://{addr}")
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    refused_busy: AtomicU64,
    client_errors: AtomicU64,
    abandoned: AtomicU64,
}

/// One request of kind `k`; panics on an answer that is not a success, a clean client error, or
/// a clean "busy".
async fn one(c: &reqwest::Client, base: &str, k: u64, t: &Tally) {
    let words = |n: u64| (0..n).map(|i| format!("w{} ", (i * 7 + k) % 97)).collect::<String>();
    let chat = |content: Value, stream: bool| json!({"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0, "stream": stream});
    let url = format!("{base}/v1/chat/completions");
    let resp = match k % 6 {
        // Long prompt: prefilled on the node.
        0 => c.post(&url).json(&chat(json!(words(80)), false)).send().await,
        // Short prompt, local.
        1 => c.post(format!("{base}/v1/completions")).json(&json!({"prompt": words(5), "max_tokens": 4})).send().await,
        // A stream abandoned after its first event.
        2 => {
            let r = c.post(&url).json(&chat(json!(words(60)), true)).send().await.unwrap();
            if r.status() == 200 {
                let mut r = r;
                let _ = r.chunk().await;
                drop(r);
                t.abandoned.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Ok(r)
        }
        // An image.
        3 => {
            let content = json!([{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": png(56 + (k % 3) as u32 * 28, 56, k as u32)}}]);
            c.post(&url).json(&chat(content, false)).send().await
        }
        // A streamed chat read to the end.
        4 => c.post(&url).json(&chat(json!(words(20)), true)).send().await,
        // Unwanted: a text/plain body (415) or malformed JSON (400).
        _ => {
            let ct = if k % 12 == 5 { "text/plain" } else { "application/json" };
            c.post(&url).header("content-type", ct).body("{not json").send().await
        }
    };
    let r = resp.expect("the server answers");
    let status = r.status().as_u16();
    let body = r.text().await.unwrap_or_default();
    match status {
        200 => {
            assert!(body.contains("choices"), "a 200 without choices: {body}");
            t.ok.fetch_add(1, Ordering::Relaxed);
        }
        429 | 503 => {
            t.refused_busy.fetch_add(1, Ordering::Relaxed);
        }
        400 | 415 if k % 6 == 5 => {
            assert!(body.contains("\"error\""), "{body}");
            t.client_errors.fetch_add(1, Ordering::Relaxed);
        }
        s => panic!("request kind {} got {s}: {body}", k % 6),
    }
}

#[test]
fn soak_both_servers_under_mixed_load() {
    let secs: u64 = std::env::var("K3_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
    let dir = tempfile::tempdir().unwrap();
    let mut o = SynthOptions::new(Preset::Tiny);
    o.seed = 11;
    o.progress = false;
    write_model(dir.path(), &o).unwrap();
    let fp = Checkpoint::open(dir.path()).unwrap().fingerprint();
    let (s, c) = (NodeIdentity::generate().unwrap(), NodeIdentity::generate().unwrap());
    let mut scfg = NodeConfig::new(s.clone(), PeerAuth::pinned(c.fingerprint()), fp, "cpu");
    let mut ccfg = NodeConfig::new(c, PeerAuth::pinned(s.fingerprint()), fp, "mlx");
    scfg.tuning = Tuning::default();
    ccfg.tuning = Tuning::default();
    let node = start_node(dir.path(), scfg);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let base = rt.block_on(start_server(dir.path(), node.local_addr(), ccfg));
    let tally = Arc::new(Tally::default());
    let t0 = Instant::now();
    let warmup = Duration::from_secs(secs / 4);
    let end = Duration::from_secs(secs);
    let baseline = Arc::new(std::sync::Mutex::new(None::<(f64, usize)>));
    rt.block_on(async {
        let mut tasks = Vec::new();
        for w in 0..4u64 {
            let (base, tally, baseline) = (base.clone(), tally.clone(), baseline.clone());
            tasks.push(tokio::spawn(async move {
                let c = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
                let mut k = w;
                while t0.elapsed() < end {
                    one(&c, &base, k, &tally).await;
                    k += 4;
                    if w == 0 && t0.elapsed() >= warmup {
                        let mut b = baseline.lock().unwrap();
                        if b.is_none() {
                            *b = Some((rss_mb(), open_fds()));
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.expect("a load task failed");
        }
    });
    // Let abandoned work and closed connections settle.
    std::thread::sleep(Duration::from_secs(2));
    let (rss0, fds0) = baseline.lock().unwrap().expect("the warm-up ended");
    let (rss1, fds1) = (rss_mb(), open_fds());
    let snap = node.snapshot();
    eprintln!(
        "soak {secs} s: ok {} busy {} client-errors {} abandoned {}; node requests {} completed {} failed {}; \
         RSS {rss0:.0} → {rss1:.0} MB; fds {fds0} → {fds1}",
        tally.ok.load(Ordering::Relaxed),
        tally.refused_busy.load(Ordering::Relaxed),
        tally.client_errors.load(Ordering::Relaxed),
        tally.abandoned.load(Ordering::Relaxed),
        snap.counters.requests,
        snap.counters.completed,
        snap.counters.failed,
    );
    assert!(tally.ok.load(Ordering::Relaxed) >= 10, "too few successful requests");
    assert!(snap.counters.completed >= 1, "no prefill completed on the node");
    assert!(rss1 - rss0 < 150.0, "RSS grew from {rss0:.0} to {rss1:.0} MB after the warm-up");
    assert!(fds1 <= fds0 + 16, "open descriptors grew from {fds0} to {fds1}");
}
