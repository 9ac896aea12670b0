//! Concurrent requests on the engine thread (issues 18 and 21): admitted requests decode
//! together (continuous batching; the fake engine's batched step costs one step, as a batched
//! pass over the weights does), each reply equal to the one it gets alone; a long prompt's
//! prefill runs chunk by chunk between the running streams' steps; and a client that
//! leaves — streamed or not, while its request is queued, prefilling or decoding — cancels
//! its job, whose slot frees at once.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use mac_decoder::engine::StoreOptions;
use serde_json::{json, Value};
use support::FakeEngine;

mod support;

const VOCAB: usize = 1024;
const CONTEXT: usize = 6000;

struct Server {
    addr: std::net::SocketAddr,
    _dir: tempfile::TempDir,
}

/// A server on a fake engine that replies with ordinary ids derived from the whole history
/// (never a stop id: replies run to `max_tokens`).
async fn start(step_delay: Duration, prefill_delay_per_token: Duration) -> Server {
    start_chunked(step_delay, prefill_delay_per_token, None).await
}

async fn start_chunked(step_delay: Duration, prefill_delay_per_token: Duration, prefill_chunk: Option<usize>) -> Server {
    let (dir, tok) = support::synth_tokenizer(VOCAB, 3000);
    let make = move || {
        let mut e = FakeEngine::new(VOCAB, CONTEXT, vec![], 1, |_: &[u32]| vec![]);
        e.step_delay = step_delay;
        e.prefill_delay_per_token = prefill_delay_per_token;
        e.prefill_chunk = prefill_chunk;
        Ok(e)
    };
    let state = support::app_state(make, StoreOptions { max_sessions: 16, max_bytes: 1 << 30, checkpoints: false }, tok, "synth");
    Server { addr: support::serve(state).await, _dir: dir }
}

fn url(s: &Server) -> String {
    format!("http://{}/v1/completions", s.addr)
}

async fn metric(s: &Server, name: &str) -> f64 {
    support::metric(&reqwest::get(format!("http://{}/metrics", s.addr)).await.unwrap().text().await.unwrap(), name)
}

/// Waits (up to `within`) until `name` reaches `at_least` (a series not yet shown counts as 0);
/// the time it took.
async fn wait_metric(s: &Server, name: &str, at_least: f64, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let text = reqwest::get(format!("http://{}/metrics", s.addr)).await.unwrap().text().await.unwrap();
        let v = support::find_metric(&text, name).unwrap_or(0.0);
        if v >= at_least {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < within, "{name} is {v} after {:.1} s, expected >= {at_least}", within.as_secs_f64());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn complete(client: &reqwest::Client, s: &Server, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": true, "temperature": 0});
    let r = client.post(url(s)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parallel_requests_decode_together_and_each_gets_its_own_reply() {
    // 30 steps of 20 ms: ~0.6 s alone; four one after another would take ~2.4 s.
    let s = start(Duration::from_millis(20), Duration::ZERO).await;
    let client = reqwest::Client::new();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| (0..(3 + 5 * i)).map(|j| 100 + (j * 7 + i) % 50).collect()).collect();
    let t0 = Instant::now();
    let alone = complete(&client, &s, &prompts[0], 30).await;
    let one = t0.elapsed().as_secs_f64();
    let mut want = vec![alone];
    for p in &prompts[1..] {
        want.push(complete(&client, &s, p, 30).await);
    }
    let t0 = Instant::now();
    let got = futures_util::future::join_all(prompts.iter().map(|p| complete(&client, &s, p, 30))).await;
    let four = t0.elapsed().as_secs_f64();
    assert_eq!(got, want, "a reply decoded in a batch differs from the same request alone");
    assert!(want.iter().all(|w| w.len() == 30));
    eprintln!("one request {one:.2} s, four in parallel {four:.2} s");
    assert!(four < 2.0 * one, "four parallel requests took {four:.2} s, one alone {one:.2} s: they did not decode together");
    // more requests than steps decoded: some steps decoded several (the batch-size gauge reads
    // 0 once the server is idle)
    assert!(metric(&s, "k3_decode_step_requests_total").await > metric(&s, "k3_decode_steps_total").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_streaming_client_that_leaves_stops_its_decode() {
    let s = start(Duration::from_millis(5), Duration::ZERO).await;
    let client = reqwest::Client::new();
    let body = json!({"prompt": [100, 101, 102], "max_tokens": 4000, "stream": true});
    let mut r = client.post(url(&s)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty());
    drop(r); // the client goes away
    let took = wait_metric(&s, "k3_cancelled_requests_total", 1.0, Duration::from_secs(5)).await;
    let generated = metric(&s, "k3_generated_tokens_total").await;
    eprintln!("cancelled {:.0} ms after the client left, {generated} tokens generated", took.as_secs_f64() * 1e3);
    assert!(generated < 1000.0, "{generated} tokens generated for a client that left after the first chunk");
    // the slot is free: a new request is served at once
    let t0 = Instant::now();
    assert_eq!(complete(&client, &s, &[100, 101], 3).await.len(), 3);
    assert!(t0.elapsed() < Duration::from_secs(2));
}

/// Sends a non-streamed completion over a raw socket, waits `wait`, then closes the socket.
fn send_and_leave(addr: std::net::SocketAddr, body: &Value, wait: Duration) {
    let body = body.to_string();
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    write!(sock, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    std::thread::sleep(wait);
    sock.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    assert!(sock.read(&mut buf).is_err(), "the server answered before the client left");
    drop(sock);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_non_streamed_client_that_leaves_stops_its_decode() {
    let s = start(Duration::from_millis(5), Duration::ZERO).await;
    let addr = s.addr;
    tokio::task::spawn_blocking(move || send_and_leave(addr, &json!({"prompt": [100, 101, 102], "max_tokens": 4000}), Duration::from_millis(300)))
        .await
        .unwrap();
    let took = wait_metric(&s, "k3_cancelled_requests_total", 1.0, Duration::from_secs(5)).await;
    let generated = metric(&s, "k3_generated_tokens_total").await;
    eprintln!("cancelled {:.0} ms after the client left, {generated} tokens generated", took.as_secs_f64() * 1e3);
    assert!(generated < 1000.0, "{generated} tokens generated for a client that left after 0.3 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_that_leave_during_a_prefill_or_in_the_queue_cost_nothing_more() {
    // A 2000-token prompt prefills for ~2 s (1 ms a token).
    let s = start(Duration::from_millis(1), Duration::from_millis(1)).await;
    let addr = s.addr;
    let long: Vec<u32> = (0..2000).map(|i| 100 + i % 300).collect();
    // the first client leaves 0.3 s into its prefill; a second one queued behind it leaves too
    let a = tokio::task::spawn_blocking({
        let body = json!({"prompt": long, "max_tokens": 5});
        move || send_and_leave(addr, &body, Duration::from_millis(300))
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let b = tokio::task::spawn_blocking({
        let body = json!({"prompt": (0..1500).map(|i| 200 + i % 300).collect::<Vec<u32>>(), "max_tokens": 5});
        move || send_and_leave(addr, &body, Duration::from_millis(100))
    });
    a.await.unwrap();
    b.await.unwrap();
    let took = wait_metric(&s, "k3_cancelled_requests_total", 2.0, Duration::from_secs(5)).await;
    eprintln!("both cancelled {:.0} ms after the first client left", took.as_secs_f64() * 1e3);
    assert!(took < Duration::from_millis(1500), "the abandoned prefill ran on for {:.1} s", took.as_secs_f64());
    assert_eq!(metric(&s, "k3_prefill_tokens_total{where=\"local\"}").await, 0.0, "an abandoned prompt was prefilled");
    assert_eq!(metric(&s, "k3_generated_tokens_total").await, 0.0);
    // the engine is free again
    let client = reqwest::Client::new();
    let t0 = Instant::now();
    assert_eq!(complete(&client, &s, &[100, 101], 3).await.len(), 3);
    assert!(t0.elapsed() < Duration::from_secs(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_prefill_does_not_stall_the_running_streams() {
    // prefill 1 ms a token in chunks of 100; decode steps of 5 ms
    let s = start_chunked(Duration::from_millis(5), Duration::from_millis(1), Some(100)).await;
    let client = reqwest::Client::new();
    let long: Vec<u32> = (0..1500).map(|i| 100 + i % 300).collect();
    let alone = complete(&client, &s, &long, 5).await;
    // a stream running while the long prompt (1.5 s of prefill) arrives
    let body = json!({"prompt": [100, 101, 102], "max_tokens": 600, "stream": true, "temperature": 0});
    let mut r = client.post(url(&s)).json(&body).send().await.unwrap();
    r.chunk().await.unwrap().unwrap();
    let other = {
        let (client, long) = (client.clone(), long.clone());
        let u = url(&s);
        tokio::spawn(async move {
            let body = json!({"prompt": long, "max_tokens": 5, "return_token_ids": true, "temperature": 0});
            let v: Value = client.post(u).json(&body).send().await.unwrap().json().await.unwrap();
            v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<u32>>()
        })
    };
    let (t0, mut last, mut worst) = (Instant::now(), Instant::now(), Duration::ZERO);
    while t0.elapsed() < Duration::from_millis(1500) {
        let Some(_) = r.chunk().await.unwrap() else { break };
        worst = worst.max(last.elapsed());
        last = Instant::now();
    }
    drop(r);
    assert_eq!(other.await.unwrap(), alone, "a prompt prefilled in chunks between decode steps replies differently");
    eprintln!("longest pause of the running stream during a 1.5-s prefill: {:.0} ms", worst.as_secs_f64() * 1e3);
    assert!(worst < Duration::from_millis(700), "the running stream paused {:.2} s during another prompt's prefill", worst.as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_prompts_are_prefilled_in_turn_so_short_ones_finish_first() {
    // Head-of-line blocking (found 2026-12-01): a 37-token chat queued behind a 6,036-token
    // prompt waited for all of its prefill, because chunks interleaved only with decodes.
    // Round-robin by chunk: a 3,000-token prompt (30 chunks of 100, 1 ms a token), then a
    // 3-token and a 600-token prompt queued behind it; each finishes in order of its length.
    let s = start_chunked(Duration::from_millis(5), Duration::from_millis(1), Some(100)).await;
    let client = reqwest::Client::new();
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::<&'static str>::new()));
    let send = |name: &'static str, len: u32| {
        let (client, u, order) = (client.clone(), url(&s), order.clone());
        let prompt: Vec<u32> = (0..len).map(|i| 100 + i % 300).collect();
        tokio::spawn(async move {
            let body = json!({"prompt": prompt, "max_tokens": 2, "temperature": 0});
            let r = client.post(u).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200, "{name}");
            order.lock().unwrap().push(name);
        })
    };
    let long = send("long", 3000);
    // the long prompt is on the engine (its first chunks prefilled) before the others arrive
    wait_metric(&s, "k3_requests_total{endpoint=\"completions\"}", 1.0, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let short = send("short", 3);
    let medium = send("medium", 600);
    for t in [short, medium, long] {
        t.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["short", "medium", "long"], "prompts finished in this order");
    // idle again: the batch-size gauge says so (it kept the last step's size before)
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(metric(&s, "k3_decode_batch_size").await, 0.0);
}
