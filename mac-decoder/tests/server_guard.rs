//! HTTP hardening of `k3-decode serve` (issue 21, `server::guard`): without an API key only
//! loopback Host/Origin and JSON bodies; the key compared whole, the scheme in any case; a slow
//! body is cut off; requests past the admission limit get 429 + Retry-After.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mac_decoder::engine::{EngineHandle, StoreOptions};
use mac_decoder::server::guard::GuardOptions;
use mac_decoder::server::router;
use serde_json::json;
use support::FakeEngine;

mod support;

const VOCAB: usize = 1024;

struct Server {
    addr: std::net::SocketAddr,
    engine: EngineHandle,
    _dir: tempfile::TempDir,
}

async fn start(api_key: Option<&str>, guard: GuardOptions, step_delay: Duration) -> Server {
    start_with_context(api_key, guard, step_delay, 3000).await
}

/// [`start`] with a model context of `context` tokens.
async fn start_with_context(api_key: Option<&str>, guard: GuardOptions, step_delay: Duration, context: usize) -> Server {
    let (dir, tok) = support::synth_tokenizer(VOCAB, context);
    let stop = tok.special_id("<|end_of_msg|>").unwrap();
    let make = move || {
        // Replies with 20 ordinary tokens, then stops.
        let mut e = FakeEngine::new(VOCAB, context, vec![], stop, move |_: &[u32]| {
            let mut v: Vec<u32> = (300..320).collect();
            v.push(stop);
            v
        });
        e.step_delay = step_delay;
        Ok(e)
    };
    let mut state = support::app_state(make, StoreOptions { max_sessions: 4, max_bytes: 1 << 30, checkpoints: true }, tok, "synth");
    state.api_key = api_key.map(str::to_string);
    state.guard = guard;
    let engine = state.engine.clone();
    Server { addr: support::serve(state).await, engine, _dir: dir }
}

fn completion() -> String {
    json!({"prompt": "hello", "max_tokens": 8}).to_string()
}

/// One raw HTTP/1.1 request; the status code (0 when the server closed without answering).
fn raw(addr: std::net::SocketAddr, head: &str, body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let req = format!("{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let code = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_only_loopback_json_requests_are_served() {
    let s = start(None, GuardOptions::default(), Duration::ZERO).await;
    let a = s.addr;
    let post = move |host: &str, extra: &str, ct: &str| {
        let head = format!("POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: {ct}{extra}");
        raw(a, &head, &completion())
    };
    let port = a.port();
    let ok = tokio::task::spawn_blocking(move || {
        let json = "application/json";
        vec![
            ("loopback JSON", post(&format!("127.0.0.1:{port}"), "", json).0, 200),
            ("localhost + charset", post(&format!("localhost:{port}"), "", "application/json; charset=utf-8").0, 200),
            ("text/plain (a form post needs no preflight)", post(&format!("127.0.0.1:{port}"), "", "text/plain").0, 415),
            ("form", post(&format!("127.0.0.1:{port}"), "", "application/x-www-form-urlencoded").0, 415),
            ("DNS rebinding Host", post(&format!("attacker.example:{port}"), "", json).0, 403),
            ("lookalike Host", post(&format!("127.0.0.1.attacker.example:{port}"), "", json).0, 403),
            ("cross-site Origin", post(&format!("127.0.0.1:{port}"), "\r\nOrigin: https://attacker.example", json).0, 403),
            ("loopback Origin", post(&format!("127.0.0.1:{port}"), &format!("\r\nOrigin: http://localhost:{port}"), json).0, 200),
        ]
    })
    .await
    .unwrap();
    for (what, got, want) in ok {
        assert_eq!(got, want, "{what}");
    }
    // A host named with --allow-host is served.
    let s = start(None, GuardOptions { allowed_hosts: vec!["box.lan".into()], ..Default::default() }, Duration::ZERO).await;
    let a = s.addr;
    let code =
        tokio::task::spawn_blocking(move || raw(a, "POST /v1/completions HTTP/1.1\r\nHost: box.lan:8000\r\nContent-Type: application/json", &completion()).0)
            .await
            .unwrap();
    assert_eq!(code, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_compared_whole_and_the_scheme_in_any_case() {
    let s = start(Some("sekret"), GuardOptions::default(), Duration::ZERO).await;
    let a = s.addr;
    let codes = tokio::task::spawn_blocking(move || {
        let with = |auth: &str| {
            let head = format!("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: {auth}");
            raw(a, &head, &completion()).0
        };
        vec![
            ("Bearer", with("Bearer sekret"), 200),
            ("lowercase bearer", with("bearer sekret"), 200),
            ("BEARER", with("BEARER sekret"), 200),
            // (Trailing whitespace is not part of an HTTP field value: the parser drops it.)
            ("leading space", with("Bearer  sekret"), 401),
            ("prefix", with("Bearer sekre"), 401),
            ("longer", with("Bearer sekrets"), 401),
            ("other scheme", with("Basic sekret"), 401),
        ]
    })
    .await
    .unwrap();
    for (what, got, want) in codes {
        assert_eq!(got, want, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_arrive_is_cut_off() {
    let s = start(None, GuardOptions { body_timeout: Duration::from_secs(1), ..Default::default() }, Duration::ZERO).await;
    let a = s.addr;
    let (code, secs) = tokio::task::spawn_blocking(move || {
        let mut c = std::net::TcpStream::connect(a).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        // Announces 1000 bytes, sends 10, then waits.
        let head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":";
        c.write_all(head.as_bytes()).unwrap();
        let t0 = Instant::now();
        let mut out = [0u8; 512];
        let n = c.read(&mut out).unwrap_or(0);
        let text = String::from_utf8_lossy(&out[..n]).to_string();
        (text.split_whitespace().nth(1).and_then(|c| c.parse::<u16>().ok()).unwrap_or(0), t0.elapsed().as_secs_f64())
    })
    .await
    .unwrap();
    assert_eq!(code, 408, "a slow body must get 408");
    assert!(secs < 5.0, "cut off after {secs:.1} s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_admission_limit_get_429_with_retry_after() {
    // Slow engine: each request runs ~20 × 50 ms.
    let s = start(None, GuardOptions { max_concurrent: 2, ..Default::default() }, Duration::from_millis(50)).await;
    let url = format!("http://{}/v1/completions", s.addr);
    let client = reqwest::Client::new();
    let body = json!({"prompt": "hello", "max_tokens": 20, "stream": true});
    let mut running = Vec::new();
    for _ in 0..2 {
        let r = client.post(&url).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        running.push(r); // the stream holds its slot until its last event
    }
    let r = client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "too_many_requests");
    // Once the streams end, requests are admitted again.
    for r in running {
        let _ = r.text().await.unwrap();
    }
    let r = client.post(&url).json(&json!({"prompt": "hello", "max_tokens": 2})).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

/// Issue 21: admission bounded by tokens in flight (prompt + max_tokens of the requests admitted
/// and not finished). Before, only the request count was bounded: a few requests of the full
/// context each queued unbounded work. Past the limit: 429 `too_many_tokens` with
/// `Retry-After`, counted in the metrics; once the running request ends its tokens are given
/// back; a request larger than the limit alone runs when nothing else is in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_tokens_in_flight_limit_get_429_with_retry_after() {
    // Slow engine: each request runs ~20 × 50 ms.
    let s = start(None, GuardOptions::default(), Duration::from_millis(50)).await;
    s.engine.set_max_tokens_in_flight(Some(60));
    let base = format!("http://{}", s.addr);
    let client = reqwest::Client::new();
    // 3 prompt tokens + 40 = 43 tokens in flight while it streams.
    let body = |max: usize| json!({"prompt": [300, 301, 302], "max_tokens": max, "stream": true});
    let running = client.post(format!("{base}/v1/completions")).json(&body(40)).send().await.unwrap();
    assert_eq!(running.status(), 200);
    assert_eq!(s.engine.tokens_in_flight(), 43);
    let metrics = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("k3_tokens_in_flight 43"), "{metrics}");
    // 43 + 3 + 20 = 66 > 60: refused; 43 + 3 + 10 = 56: admitted.
    let r = client.post(format!("{base}/v1/completions")).json(&body(20)).send().await.unwrap();
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "too_many_tokens", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--max-tokens-in-flight"), "{v}");
    let r = client.post(format!("{base}/v1/completions")).json(&json!({"prompt": [300, 301, 302], "max_tokens": 10})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.text().await.unwrap();
    let metrics = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("k3_errors_total{kind=\"too_many_tokens\"} 1"), "{metrics}");
    // The stream ends: its tokens are given back, and a request larger than the limit alone runs.
    let _ = running.text().await.unwrap();
    let t0 = Instant::now();
    while s.engine.tokens_in_flight() != 0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "{} tokens still in flight", s.engine.tokens_in_flight());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = client.post(format!("{base}/v1/completions")).json(&json!({"prompt": [300, 301, 302], "max_tokens": 100})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let _ = r.text().await.unwrap();
}

/// Issue 21: the HTTP server had no header read timeout; a connection that never finished its
/// headers (or an idle keep-alive one) stayed open indefinitely.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let (_dir, tok) = support::synth_tokenizer(VOCAB, 3000);
    let make = move || Ok(FakeEngine::new(VOCAB, 3000, vec![], 1, |_: &[u32]| vec![1]));
    let state = Arc::new(support::app_state(make, StoreOptions { max_sessions: 1, max_bytes: 1 << 20, checkpoints: false }, tok, "synth"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(mac_decoder::server::guard::serve(listener, router(state), Duration::from_secs(1), Duration::from_secs(5), async move {
        let _ = stop_rx.await;
    }));
    let closed_after = tokio::task::spawn_blocking(move || {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ").unwrap();
        let t0 = Instant::now();
        let mut buf = [0u8; 256];
        let _ = c.read(&mut buf); // 0 (closed) or a 408, either way an answer
        t0.elapsed().as_secs_f64()
    })
    .await
    .unwrap();
    assert!(closed_after < 5.0, "the half-sent request stayed open {closed_after:.1} s");
    // /health still answers, and the server stops cleanly when asked.
    let r = reqwest::get(format!("http://{addr}/health")).await.unwrap();
    assert_eq!(r.status(), 200);
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), server).await.expect("the server did not stop").unwrap().unwrap();
}

/// Request preparation runs off the async workers (issue 21: tokenization ran on them, so
/// `/health` stalled 4–5 s under large bodies). Three large completions (a text prompt of about
/// 12 MB each, more than 3M tokens, tokenized until they pass the context of 2M tokens —
/// tokenizing stops there — then refused; 4 MB against 1M tokens took 0.19 s on CI, too quick
/// to show a stall) are sent while `/health` is polled
/// from another thread; `/health` must answer within a quarter of the time the quickest large
/// request took. Before, with the server's two workers busy tokenizing, it waited about as long
/// as a large request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_body_does_not_stall_other_requests() {
    let s = start_with_context(None, GuardOptions::default(), Duration::ZERO, 1 << 21).await;
    let addr = s.addr;
    // Varied words, so the tokenizer does real work on every one.
    let text = support::varied_words(12 << 20, 0x9E37_79B9_7F4A_7C15);
    let body = Arc::new(json!({"prompt": text, "max_tokens": 1}).to_string());
    let head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json";
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let health = std::thread::spawn({
        let done = done.clone();
        move || {
            let mut worst = 0.0f64;
            let mut n = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                let (code, _) = raw(addr, "GET /health HTTP/1.1\r\nHost: 127.0.0.1", "");
                assert_eq!(code, 200);
                worst = worst.max(t.elapsed().as_secs_f64());
                n += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            (worst, n)
        }
    });
    std::thread::sleep(Duration::from_millis(100));
    let big: Vec<_> = (0..3)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let (code, out) = raw(addr, head, &body);
                (code, out, t.elapsed().as_secs_f64())
            })
        })
        .collect();
    let big: Vec<_> = big.into_iter().map(|h| h.join().unwrap()).collect();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let (worst, polls) = health.join().unwrap();
    let quickest = big.iter().map(|b| b.2).fold(f64::MAX, f64::min);
    eprintln!(
        "large requests took {:?} s; /health answered {polls} times, worst {worst:.3} s",
        big.iter().map(|b| (b.2 * 1000.0).round() / 1000.0).collect::<Vec<_>>()
    );
    for (code, out, _) in &big {
        assert_eq!(*code, 400, "{}", &out[..out.len().min(400)]);
        assert!(out.contains("context_length_exceeded"), "{}", &out[..out.len().min(400)]);
    }
    assert!(quickest > 0.2, "a large body took only {quickest:.3} s to prepare: too quick to show a stall on this machine");
    assert!(worst < quickest / 4.0, "/health waited {worst:.3} s while large bodies were prepared ({quickest:.3} s each at least)");
}
