//! Soak test (issue 21): both servers in one process — a prefill node (CPU backend, loopback
//! QUIC) and `k3-decode serve`'s HTTP server (MLX engine, synthetic tiny model, prefilling long
//! prompts on the node) — under mixed load for a bounded time: streamed and plain chats, streams
//! abandoned after their first events, image requests, short local and long remote prefills,
//! malformed and unwanted requests. The decoder reaches the node through a faulty relay that
//! cycles through a clean phase, a lossy one (datagrams dropped, corrupted, duplicated) and a
//! stall (every datagram held longer than the QUIC idle timeout, then released late), so
//! hand-offs break mid-transfer. Every answer must be correct in kind (200 with a body, or a
//! clean 4xx / 429 / 503: a broken hand-off falls back to a local prefill); some prefills must
//! complete on the node and some must fall back; resident memory and open descriptors must stay
//! flat between the end of the warm-up and the end.
//!
//! Short form (CI): `K3_SOAK_SECS` unset → 40 s of load. Long form by hand:
//! `K3_SOAK_SECS=600 cargo test -p k3-e2e-tests --release --test soak -- --nocapture`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_prefiller::server::{PrefillNode, ServeOptions, StoreLimits};
use k3_e2e_tests::start_node;
use k3_protocol::synth::{write_model, Preset, SynthOptions};
use k3_protocol::transport::{NodeConfig, NodeIdentity, PeerAuth, Tuning};
use k3_protocol::Checkpoint;
use mac_decoder::decode::EngineOptions;
use mac_decoder::engine::mlx_engine::MlxEngine;
use mac_decoder::engine::{EngineHandle, StoreOptions};
use mac_decoder::metrics::Metrics;
use mac_decoder::remote::RemoteOptions;
use mac_decoder::server::AppState;
use mac_decoder::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// The prefill node's prefix-store limit in the soak (about 50 prefixes of the tiny model).
const NODE_STORE_BYTES: u64 = 16 << 20;

/// Most RSS growth allowed from the end of the warm-up to the end (300 s measured: +8 MB).
const RSS_GROWTH_MB: f64 = 64.0;

fn rss_mb() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<f64>().ok()).map_or(0.0, |kb| kb / 1024.0)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// One line of the drift trace: time, RSS, descriptors, MLX's active and cached memory, and the
/// decoder's held session state (from its metrics) and the node's, so that growth can be told apart.
async fn sample(base: &str, t0: Instant, node: &PrefillNode) -> String {
    let mb = |b: usize| b as f64 / 1e6;
    let active = mlx_rs::memory::active_memory().map_or(f64::NAN, mb);
    let cache = mlx_rs::memory::cache_memory().map_or(f64::NAN, mb);
    let metrics = match reqwest::get(format!("{base}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    };
    let gauge = |name: &str| -> f64 {
        metrics.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
    };
    let held = node.snapshot().sessions;
    format!(
        "t {:>4.0} s  RSS {:>4.0} MB  fds {:>3}  MLX active {:>5.1} MB cache {:>5.1} MB  sessions {:>2} ({:.1} MB)  node sessions {:>2} ({:.1} MB)",
        t0.elapsed().as_secs_f64(),
        rss_mb(),
        open_fds(),
        active,
        cache,
        gauge("k3_sessions_held"),
        gauge("k3_session_state_bytes") / 1e6,
        held.sessions,
        held.bytes as f64 / 1e6,
    )
}

fn png(w: u32, h: u32, seed: u32) -> String {
    use base64::Engine as _;
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7 + seed) as u8, (y * 13 + seed) as u8, ((x ^ y) * 5) as u8]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(out.into_inner()))
}

/// What the relay does to datagrams at a moment of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Clean,
    /// Drop 10 %, corrupt 5 % (one byte flipped), duplicate 5 %.
    Lossy,
    /// Hold every datagram; release them all when the phase ends (by then the QUIC idle timeout
    /// has passed, so the connection is gone and they arrive at a closed one).
    Stall,
}

/// The relay's cycle: 4 s clean, 3 s lossy, 5 s stalled.
fn phase(t: Duration) -> Phase {
    match t.as_millis() % 12_000 {
        0..=3_999 => Phase::Clean,
        4_000..=6_999 => Phase::Lossy,
        _ => Phase::Stall,
    }
}

#[derive(Default)]
struct RelayTally {
    forwarded: AtomicU64,
    dropped: AtomicU64,
    corrupted: AtomicU64,
    duplicated: AtomicU64,
    held: AtomicU64,
    /// Upstream sockets open now (one per decoder address seen in the last 10 s, as a NAT keeps).
    upstreams: AtomicU64,
}

/// An upstream socket unused this long is closed (its decoder endpoint is gone).
const RELAY_IDLE: Duration = Duration::from_secs(10);

/// A UDP relay in front of `node` applying [`phase`] to both directions; returns its address.
async fn faulty_relay(node: SocketAddr, t0: Instant, tally: Arc<RelayTally>) -> SocketAddr {
    use tokio::net::UdpSocket;
    let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
    let addr = front.local_addr().unwrap();
    // One upstream socket per decoder address; the held datagrams: (to node?, peer, bytes).
    type Held = Arc<std::sync::Mutex<Vec<(Option<Arc<UdpSocket>>, SocketAddr, Vec<u8>)>>>;
    let held: Held = Default::default();
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut coin = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % 100
    };
    // Sends one datagram through the current phase.
    async fn pass(sock: &UdpSocket, to: SocketAddr, mut d: Vec<u8>, p: Phase, roll: (u64, u64), t: &RelayTally) {
        if p == Phase::Lossy {
            if roll.0 < 10 {
                t.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            if roll.0 < 15 && !d.is_empty() {
                let i = roll.1 as usize % d.len();
                d[i] ^= 0x5a;
                t.corrupted.fetch_add(1, Ordering::Relaxed);
            } else if roll.0 < 20 {
                let _ = sock.send_to(&d, to).await;
                t.duplicated.fetch_add(1, Ordering::Relaxed);
            }
        }
        let _ = sock.send_to(&d, to).await;
        t.forwarded.fetch_add(1, Ordering::Relaxed);
    }
    // Releases what a stall held, once the stall is over.
    tokio::spawn({
        let (held, front, tally) = (held.clone(), front.clone(), tally.clone());
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if phase(t0.elapsed()) == Phase::Stall {
                    continue;
                }
                let batch = std::mem::take(&mut *held.lock().unwrap());
                for (up, to, d) in batch {
                    let sock = up.as_deref().unwrap_or(&front);
                    pass(sock, to, d, Phase::Clean, (100, 0), &tally).await;
                }
            }
        }
    });
    tokio::spawn(async move {
        // Per decoder address: the upstream socket and when it was last used (ms since t0).
        type Ups = Arc<std::sync::Mutex<HashMap<SocketAddr, (Arc<UdpSocket>, Arc<AtomicU64>)>>>;
        let ups: Ups = Default::default();
        let now_ms = move || t0.elapsed().as_millis() as u64;
        let mut buf = vec![0u8; 65536];
        loop {
            let Ok((n, from)) = front.recv_from(&mut buf).await else { return };
            let known = ups.lock().unwrap().get(&from).cloned();
            let up = match known {
                Some((u, last)) => {
                    last.store(now_ms(), Ordering::Relaxed);
                    u
                }
                None => {
                    let u = Arc::new(UdpSocket::bind("127.0.0.1:0").await.unwrap());
                    let last = Arc::new(AtomicU64::new(now_ms()));
                    ups.lock().unwrap().insert(from, (u.clone(), last.clone()));
                    tally.upstreams.fetch_add(1, Ordering::Relaxed);
                    // The node's answers to this decoder address, until it has been idle for
                    // RELAY_IDLE; then the socket is closed.
                    let (u2, front, held, tally, ups) = (u.clone(), front.clone(), held.clone(), tally.clone(), ups.clone());
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 65536];
                        let mut rng = from.port() as u64 | 1 << 40;
                        loop {
                            let r = match tokio::time::timeout(Duration::from_secs(1), u2.recv_from(&mut buf)).await {
                                Ok(r) => r,
                                Err(_) if now_ms().saturating_sub(last.load(Ordering::Relaxed)) > RELAY_IDLE.as_millis() as u64 => {
                                    ups.lock().unwrap().remove(&from);
                                    tally.upstreams.fetch_sub(1, Ordering::Relaxed);
                                    return;
                                }
                                Err(_) => continue,
                            };
                            let Ok((n, _)) = r else { return };
                            last.store(now_ms(), Ordering::Relaxed);
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            let p = phase(t0.elapsed());
                            if p == Phase::Stall {
                                let mut h = held.lock().unwrap();
                                if h.len() < 20_000 {
                                    h.push((None, from, buf[..n].to_vec()));
                                    tally.held.fetch_add(1, Ordering::Relaxed);
                                }
                                continue;
                            }
                            pass(&front, from, buf[..n].to_vec(), p, (rng % 100, rng >> 32), &tally).await;
                        }
                    });
                    u
                }
            };
            let p = phase(t0.elapsed());
            if p == Phase::Stall {
                let mut h = held.lock().unwrap();
                if h.len() < 20_000 {
                    h.push((Some(up), node, buf[..n].to_vec()));
                    tally.held.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            }
            let roll = (coin(), coin() * 7919);
            pass(&up, node, buf[..n].to_vec(), p, roll, &tally).await;
        }
    });
    addr
}

/// QUIC limits that notice the relay's stalls within seconds (a stall outlasts the idle timeout).
fn soak_tuning() -> Tuning {
    Tuning {
        idle_timeout: Duration::from_secs(4),
        keep_alive: Duration::from_secs(1),
        heartbeat: Duration::from_secs(1),
        inactivity_timeout: Duration::from_secs(30),
        stall_timeout: Duration::from_secs(4),
        ..Tuning::default()
    }
}

/// The node's options: its prefix store at a size the run fills within its warm-up (the
/// default, 16 GiB for 30 min, would grow all run long by design: the drift the trace showed).
fn node_options() -> ServeOptions {
    let store = StoreLimits { max_bytes: NODE_STORE_BYTES, ..StoreLimits::default() };
    ServeOptions { store, ..ServeOptions::default() }
}

async fn start_server(model: &Path, node: SocketAddr, client: NodeConfig) -> String {
    let tok = Arc::new(Tokenizer::from_dir(model).unwrap());
    let metrics = Arc::new(Metrics::new());
    let dir = model.to_path_buf();
    let mut ro = RemoteOptions::new(node.to_string());
    ro.min_tokens = Some(48);
    ro.connect_timeout = Duration::from_secs(5);
    ro.retry_after = Duration::from_secs(2);
    ro.chunk_bytes = 16 << 10;
    ro.tuning = soak_tuning();
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
            let content =
                json!([{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": png(56 + (k % 3) as u32 * 28, 56, k as u32)}}]);
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
    scfg.tuning = soak_tuning();
    ccfg.tuning = soak_tuning();
    let node = Arc::new(start_node(dir.path(), scfg, node_options()));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let t0 = Instant::now();
    let relay_tally = Arc::new(RelayTally::default());
    let relay = rt.block_on(faulty_relay(node.local_addr(), t0, relay_tally.clone()));
    let base = rt.block_on(start_server(dir.path(), relay, ccfg));
    let tally = Arc::new(Tally::default());
    let warmup = Duration::from_secs(secs / 4);
    let end = Duration::from_secs(secs);
    let baseline = Arc::new(std::sync::Mutex::new(None::<(f64, usize)>));
    // The drift trace: ten samples over the run (every 30 s at most).
    let every = Duration::from_secs((secs / 10).clamp(1, 30));
    let sampler = rt.spawn({
        let (base, node) = (base.clone(), node.clone());
        async move {
            while t0.elapsed() < end {
                eprintln!("{}", sample(&base, t0, &node).await);
                tokio::time::sleep(every).await;
            }
        }
    });
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
    // Let the relay close the sockets of decoder endpoints that are gone (a NAT's idle expiry).
    std::thread::sleep(RELAY_IDLE + Duration::from_secs(2));
    sampler.abort();
    eprintln!("{} (end, after settling)", rt.block_on(sample(&base, t0, &node)));
    let (rss0, fds0) = baseline.lock().unwrap().expect("the warm-up ended");
    let (rss1, fds1) = (rss_mb(), open_fds());
    let snap = node.snapshot();
    let metrics = rt.block_on(async { reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap() });
    let counter = |name: &str| -> f64 {
        metrics.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0.0)
    };
    let (remote, fallbacks) = (counter("k3_prefill_tokens_total{where=\"remote\"}"), counter("k3_prefill_fallbacks_total"));
    let r = &relay_tally;
    eprintln!(
        "relay: forwarded {} dropped {} corrupted {} duplicated {} held by stalls {}, upstream sockets open {}; decoder: remote prefill tokens {remote}, fallbacks {fallbacks}",
        r.forwarded.load(Ordering::Relaxed),
        r.dropped.load(Ordering::Relaxed),
        r.corrupted.load(Ordering::Relaxed),
        r.duplicated.load(Ordering::Relaxed),
        r.held.load(Ordering::Relaxed),
        r.upstreams.load(Ordering::Relaxed),
    );
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
    assert!(remote > 0.0, "no remote prefill reached the decoder through the relay");
    assert!(
        r.dropped.load(Ordering::Relaxed) > 0 && r.corrupted.load(Ordering::Relaxed) > 0 && r.held.load(Ordering::Relaxed) > 0,
        "the relay's faults did not happen"
    );
    assert!(fallbacks >= 1.0, "no hand-off broke: the faulty relay did not reach a transfer");
    assert!(rss1 - rss0 < RSS_GROWTH_MB, "RSS grew from {rss0:.0} to {rss1:.0} MB after the warm-up");
    assert!(fds1 <= fds0 + 16, "open descriptors grew from {fds0} to {fds1}");
}
