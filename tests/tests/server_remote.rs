//! The server with `--prefill-node`: an in-process prefill node (CPU backend) on loopback QUIC,
//! the MLX engine on a synthetic tiny model, requests over HTTP.
//!
//! - Prompts with at least `min_tokens` new tokens are prefilled on the node, and the greedy
//!   completion equals a plain local prefill + greedy decode of the same ids; shorter prompts stay
//!   local. A second turn sends the node only what it has not seen (the first reply and the new
//!   tokens, on top of the first prompt it holds): node records and server metrics say so.
//! - An image request prefilled on the node equals a local prefill with the same image rows.
//! - A node that is not there, or serves another model, ends in a local prefill with the same
//!   tokens, a log line saying why, and the fallback counted.
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cuda_prefiller::server::{PrefillNode, ServeOptions};
use k3_e2e_tests::{app_state, fingerprint_of as fingerprint, serve_http, start_node};
use k3_protocol::process::MemoryLog;
use k3_protocol::transport::{NodeConfig, Tuning};
use k3_protocol::{Checkpoint, Fingerprint};
use mac_decoder::decode::{Engine, EngineOptions, GenerateParams};
use mac_decoder::engine::mlx_engine::MlxEngine;
use mac_decoder::engine::StoreOptions;
use mac_decoder::remote::RemoteOptions;
use mac_decoder::tokenizer::{names, Tokenizer};
use mac_decoder::vision::{self, MlxVisionEncoder, NormEps};
use serde_json::{json, Value};

/// Prompts with at least this many new tokens go to the node.
const MIN_TOKENS: usize = 32;

// ---- logs of every thread (the engine thread logs the fallbacks) ----

/// Everything logged (info and up) by this test binary so far; tests tell their lines apart by
/// the node address in them.
fn logs() -> String {
    static BUF: OnceLock<MemoryLog> = OnceLock::new();
    let buf = BUF.get_or_init(|| {
        let b = MemoryLog::default();
        let _ = tracing::subscriber::set_global_default(b.subscriber());
        b
    });
    buf.text()
}

// ---- the two nodes ----

fn synth(seed: u64, layers: Option<usize>) -> tempfile::TempDir {
    k3_e2e_tests::synth(seed, |o| o.layers = layers)
}

fn tuning() -> Tuning {
    Tuning::quick_failure()
}

/// A prefill node's and a decoder's configs pinning each other's fresh certificates, with
/// limits that notice a dead peer quickly.
fn paired(server_model: Fingerprint, client_model: Fingerprint) -> (NodeConfig, NodeConfig) {
    let (mut server, mut client) = k3_e2e_tests::paired(server_model, client_model);
    server.tuning = tuning();
    client.tuning = tuning();
    (server, client)
}

fn remote_options(addr: SocketAddr) -> RemoteOptions {
    let mut o = RemoteOptions::new(addr.to_string());
    o.min_tokens = Some(MIN_TOKENS);
    o.connect_timeout = Duration::from_secs(2);
    o.tuning = tuning();
    o.streams = 3;
    o.chunk_bytes = 16 << 10;
    o
}

struct Server {
    base: String,
}

/// The OpenAI server on `model`, prefilling through the node at `node` with `client` as its
/// identity.
async fn start_server(model: &Path, node: SocketAddr, client: NodeConfig) -> Server {
    let tok = Arc::new(Tokenizer::from_dir(model).unwrap());
    let dir = model.to_path_buf();
    let make = move || MlxEngine::load(&dir, EngineOptions::default(), 0)?.with_remote_config(remote_options(node), client);
    let addr = serve_http(app_state(make, StoreOptions::default(), tok, "tiny")).await;
    Server { base: format!("http://{addr}") }
}

async fn post(s: &Server, path: &str, body: Value) -> Value {
    let r = reqwest::Client::new().post(format!("{}{path}", s.base)).json(&body).send().await.unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    v
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// A metric's value from the exposition (`name` with its labels, e.g. `k3_x_total{where="local"}`).
async fn metric(s: &Server, name: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", s.base)).await.unwrap().text().await.unwrap();
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

const REMOTE: &str = "k3_prefill_tokens_total{where=\"remote\"}";
const LOCAL: &str = "k3_prefill_tokens_total{where=\"local\"}";
const FALLBACKS: &str = "k3_prefill_fallbacks_total";

/// The reference: a plain local prefill of `prompt` (with image rows) then greedy decoding with
/// the server's stop ids, on a separately loaded engine.
fn local_greedy(model: &Path, prompt: &[u32], image: Option<&vision::ImageFeatures>, n: usize) -> Vec<u32> {
    let engine = Engine::load(model).unwrap();
    let tok = Tokenizer::from_dir(model).unwrap();
    let mut s = engine.new_session().unwrap();
    let embeds = image.map(|f| vision::image_embeds(std::slice::from_ref(f)));
    engine.prefill_local(&mut s, prompt, embeds.as_ref()).unwrap();
    let mut params = GenerateParams::greedy(n);
    params.stop_tokens = [names::END_OF_MSG, names::EOS].iter().filter_map(|n| tok.special_id(n)).collect();
    engine.generate(&mut s, &params, |_| true).unwrap().tokens
}

fn chat(content: Value, max_tokens: usize) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, "return_token_ids": true})
}

/// A node's request records once it has at least `n` (it records after the answer went out).
fn records(node: &PrefillNode, n: usize) -> Vec<cuda_prefiller::server::RequestRecord> {
    let t0 = std::time::Instant::now();
    loop {
        let r = node.snapshot().recent;
        if r.len() >= n || t0.elapsed() > Duration::from_secs(10) {
            return r;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The prefill node runs its own runtime, so tests start it outside the HTTP side's.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

#[test]
fn remote_prefill_equals_local_and_the_next_turn_sends_only_new_tokens() {
    let model = synth(3, None);
    let fp = fingerprint(model.path());
    let (scfg, ccfg) = paired(fp, fp);
    let node = start_node(model.path(), scfg, ServeOptions::default());
    runtime().block_on(async {
        let s = start_server(model.path(), node.local_addr(), ccfg).await;

        // Turn 1: a chat prompt, all new, goes to the node.
        let v1 = post(&s, "/v1/chat/completions", chat(json!("Tell me about the split between prefill and decode."), 8)).await;
        let p1 = ids(&v1["prompt_token_ids"]);
        let g1 = ids(&v1["choices"][0]["token_ids"]);
        assert!(p1.len() >= MIN_TOKENS && !g1.is_empty());
        assert_eq!(metric(&s, REMOTE).await, p1.len() as f64, "turn 1 prefilled on the node");
        assert_eq!(metric(&s, LOCAL).await, 0.0);
        assert!(metric(&s, "k3_handoff_bytes_total").await > 0.0);
        assert!(metric(&s, "k3_prefill_seconds_total{where=\"remote\"}").await > 0.0);
        assert!(metric(&s, "k3_handoff_exposed_tail_seconds_total").await > 0.0);
        assert_eq!(metric(&s, FALLBACKS).await, 0.0);
        assert_eq!(g1, local_greedy(model.path(), &p1, None, 8), "remote-prefilled greedy tokens = local ones");
        let r = records(&node, 1);
        assert_eq!((r[0].base_tokens, r[0].new_tokens), (0, p1.len() as u64));

        // Turn 2 continues turn 1 (its prompt, the reply, new tokens): the server reuses its live
        // state, and the node, which holds turn 1's prompt, gets only the reply and the new tokens.
        let extra: Vec<u32> = (0..40).map(|i| (i * 29 % 700) as u32 + 40).collect();
        let mut p2 = p1.clone();
        p2.extend(&g1);
        p2.extend(&extra);
        let v2 = post(&s, "/v1/completions", json!({"prompt": p2, "max_tokens": 6, "temperature": 0, "return_token_ids": true})).await;
        assert_eq!(v2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some((p1.len() + g1.len()) as u64));
        let sent = (g1.len() + extra.len()) as u64;
        assert_eq!(metric(&s, REMOTE).await, (p1.len() as u64 + sent) as f64, "turn 2 sends the node only what it has not seen");
        let r = records(&node, 2);
        assert_eq!((r[1].base_tokens, r[1].new_tokens), (p1.len() as u64, sent), "{r:?}");
        assert_eq!(
            ids(&v2["choices"][0]["token_ids"]),
            local_greedy(model.path(), &p2, None, 6),
            "turn 2 = a one-shot local prefill of the whole conversation"
        );

        // An edited reply: the server continues turn 1's prompt checkpoint (a copy that names
        // the node's old prefix); the node now holds turn 2's, refuses that base, and the whole
        // conversation is sent again. Still the one-shot answer.
        let mut p2b = p1.clone();
        p2b.extend((0..12).map(|i| i as u32 + 300));
        p2b.extend(&extra);
        let v2b = post(&s, "/v1/completions", json!({"prompt": p2b, "max_tokens": 6, "temperature": 0, "return_token_ids": true})).await;
        assert_eq!(v2b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(p1.len() as u64));
        let r = records(&node, 4);
        assert_eq!((r[3].base_tokens, r[3].new_tokens), (0, p2b.len() as u64), "resent whole after the refusal: {r:?}");
        assert_eq!(metric(&s, REMOTE).await, (p1.len() as u64 + sent + p2b.len() as u64) as f64);
        assert_eq!(ids(&v2b["choices"][0]["token_ids"]), local_greedy(model.path(), &p2b, None, 6));
        let remote_before_short = metric(&s, REMOTE).await;

        // Fewer new tokens than the threshold: local.
        let short: Vec<u32> = (0..10).map(|i| i as u32 + 50).collect();
        let v3 = post(&s, "/v1/completions", json!({"prompt": short, "max_tokens": 3, "temperature": 0, "return_token_ids": true})).await;
        assert_eq!(metric(&s, LOCAL).await, 10.0);
        assert_eq!(metric(&s, REMOTE).await, remote_before_short);
        assert_eq!(ids(&v3["choices"][0]["token_ids"]), local_greedy(model.path(), &short, None, 3));
        assert_eq!(metric(&s, FALLBACKS).await, 0.0);
    });
}

/// A small RGB PNG with a deterministic pattern.
fn png(w: u32, h: u32, seed: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7 + seed) as u8, (y * 13 + seed * 3) as u8, ((x ^ y) * 5) as u8]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

fn data_url(bytes: &[u8]) -> String {
    use base64::Engine as _;
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

#[test]
fn image_prompt_prefilled_on_the_node_equals_local() {
    let model = synth(4, None);
    let fp = fingerprint(model.path());
    let (scfg, ccfg) = paired(fp, fp);
    let node = start_node(model.path(), scfg, ServeOptions::default());
    runtime().block_on(async {
        let s = start_server(model.path(), node.local_addr(), ccfg).await;

        let img = png(84, 50, 1);
        let content = json!([{"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": data_url(&img)}}]);
        let v = post(&s, "/v1/chat/completions", chat(content, 8)).await;
        let prompt = ids(&v["prompt_token_ids"]);
        assert_eq!(metric(&s, REMOTE).await, prompt.len() as f64, "prefilled on the node, image rows included");
        assert_eq!(metric(&s, "k3_images_total").await, 1.0);
        let r = records(&node, 1);
        assert_eq!(r[0].new_tokens, prompt.len() as u64);

        let ck = Checkpoint::open(model.path()).unwrap();
        let enc = MlxVisionEncoder::load(&ck, NormEps::Bf16).unwrap();
        let features = vision::encode_image_bytes(&enc, &img).unwrap();
        let pad = ck.config().media_placeholder_token_id;
        assert_eq!(prompt.iter().filter(|&&t| t == pad).count(), features.rows);
        assert_eq!(ids(&v["choices"][0]["token_ids"]), local_greedy(model.path(), &prompt, Some(&features), 8));
    });
}

/// A fallback for every request: same tokens as a local run, counted, and logged with the cause.
async fn check_fallbacks(model: &Path, s: &Server, node: SocketAddr, cause: &str) {
    let v = post(s, "/v1/chat/completions", chat(json!("Is anybody there?"), 6)).await;
    let p = ids(&v["prompt_token_ids"]);
    assert_eq!(ids(&v["choices"][0]["token_ids"]), local_greedy(model, &p, None, 6), "the fallback answers like a local prefill");
    assert_eq!(metric(s, FALLBACKS).await, 1.0);
    assert_eq!(metric(s, REMOTE).await, 0.0);
    assert_eq!(metric(s, LOCAL).await, p.len() as f64);
    let log = logs();
    let line = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains(&format!("remote prefill on {node} failed")))
        .unwrap_or_else(|| panic!("no warning naming {node}:\n{log}"));
    eprintln!("{line}");
    assert!(line.contains(cause) && line.contains("prefilling locally"), "{line}");

    // The node stays marked down for a while: the next prompt falls back at once, counted again.
    let t0 = std::time::Instant::now();
    let v = post(s, "/v1/completions", json!({"prompt": (0..50).map(|i| i + 60).collect::<Vec<u32>>(), "max_tokens": 2, "temperature": 0})).await;
    assert_eq!(v["usage"]["completion_tokens"].as_u64(), Some(2));
    assert!(t0.elapsed() < Duration::from_secs(2), "the second request waited on the dead node again");
    assert_eq!(metric(s, FALLBACKS).await, 2.0);
}

#[test]
fn unreachable_node_falls_back_to_local_prefill() {
    logs();
    let model = synth(5, None);
    let fp = fingerprint(model.path());
    let (_scfg, ccfg) = paired(fp, fp);
    // A loopback port nobody serves.
    let addr = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    runtime().block_on(async {
        let s = start_server(model.path(), addr, ccfg).await;
        check_fallbacks(model.path(), &s, addr, "cannot reach").await;
    });
}

#[test]
fn node_with_another_model_falls_back_to_local_prefill() {
    logs();
    let model = synth(6, None);
    let other = synth(7, Some(5));
    let (theirs, ours) = (fingerprint(other.path()), fingerprint(model.path()));
    assert_ne!(theirs, ours);
    let (scfg, ccfg) = paired(theirs, ours);
    let node = start_node(other.path(), scfg, ServeOptions::default());
    runtime().block_on(async {
        let s = start_server(model.path(), node.local_addr(), ccfg).await;
        check_fallbacks(model.path(), &s, node.local_addr(), "fingerprint mismatch").await;
    });
    assert_eq!(node.snapshot().counters.requests, 0, "no request reached the other model's node");
}

/// Issue 21: a client that left during a remote prefill cost the node the whole prompt (a
/// disconnect at 2 s still cost the node 25 s of compute). Now the engine thread's cancel flag
/// reaches the prefill client, which cancels the request on the node: the node's record ends
/// failed long before the slowed prefill (9 layers × 400 ms) would have finished, and nothing
/// falls back to a local prefill.
#[test]
fn a_client_that_leaves_during_a_remote_prefill_cancels_it_on_the_node() {
    let model = synth(5, None);
    let fp = fingerprint(model.path());
    let (scfg, ccfg) = paired(fp, fp);
    let opts = ServeOptions { layer_delay: Duration::from_millis(400), ..Default::default() };
    let node = start_node(model.path(), scfg, opts);
    runtime().block_on(async {
        let s = start_server(model.path(), node.local_addr(), ccfg).await;
        let prompt: Vec<u32> = (0..64u32).map(|i| 10 + (i * 7) % 900).collect();
        let req = reqwest::Client::new().post(format!("{}/v1/completions", s.base)).json(&json!({"prompt": prompt, "max_tokens": 4}));
        let t0 = std::time::Instant::now();
        // the client gives up after 0.6 s: dropping the request closes its connection
        assert!(tokio::time::timeout(Duration::from_millis(600), req.send()).await.is_err(), "the request finished before the client left");
        while metric(&s, "k3_cancelled_requests_total").await < 1.0 {
            assert!(t0.elapsed() < Duration::from_secs(3), "the abandoned request was not cancelled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let cancelled_at = t0.elapsed().as_secs_f64();
        let rec = records(&node, 1);
        assert_eq!(rec.len(), 1);
        assert!(matches!(rec[0].outcome, cuda_prefiller::server::RequestOutcome::Failed { .. }), "the node's record: {:?}", rec[0].outcome);
        assert!(rec[0].total_s < 2.5, "the node worked {:.1} s on an abandoned prompt", rec[0].total_s);
        assert_eq!(metric(&s, LOCAL).await, 0.0, "the abandoned prompt was prefilled locally");
        assert_eq!(metric(&s, FALLBACKS).await, 0.0);
        eprintln!("cancelled {cancelled_at:.2} s after the request started; the node stopped after {:.2} s: {:?}", rec[0].total_s, rec[0].outcome);
    });
}
