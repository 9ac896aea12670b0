//! Memory of `/tokenize` under a large prompt, alone in its test binary (the peak resident
//! memory of the process is measured, so no other test may run beside it).

use mac_decoder::engine::StoreOptions;
use serde_json::{json, Value};
use support::FakeEngine;

mod support;

const VOCAB: usize = 1024;

struct Server {
    addr: std::net::SocketAddr,
    _dir: tempfile::TempDir,
}

async fn post(s: &Server, path: &str, body: String) -> (u16, Value) {
    support::post_json(s.addr, path, body).await
}

/// This process's resident memory (`VmRSS`) or its peak (`VmHWM`) from /proc, bytes.
fn proc_status_kb(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("{field} in /proc/self/status"));
    line.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()).unwrap() * 1024
}

/// `/tokenize` of a 24 MB prompt (varied words: about 6M tokens) on a server with K3's context
/// of 1,048,576 tokens: refused as longer than the context, and the process's peak resident
/// memory grows by less than 200 MB meanwhile (the bound; the body, its parsed string
/// and at most a context of ids are alive, not the ids of the whole text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_of_24_mb_stays_under_200_mb_of_extra_memory() {
    const K3_CONTEXT: usize = 1 << 20;
    let (dir, tok) = support::synth_tokenizer(VOCAB, K3_CONTEXT);
    let stop = tok.special_id("<|end_of_msg|>").unwrap();
    let make = move || Ok(FakeEngine::new(VOCAB, K3_CONTEXT, vec![], stop, move |_: &[u32]| vec![stop]));
    let state = support::app_state(make, StoreOptions { max_sessions: 4, max_bytes: 1 << 30, checkpoints: false }, tok, "synth");
    let s = Server { addr: support::serve(state).await, _dir: dir };
    let text = support::varied_words(24 << 20, 0x2545_F491_4F6C_DD1D);
    let body = json!({"prompt": text}).to_string();
    drop(text);
    // the peak from here on (Linux: writing 5 to clear_refs resets VmHWM to the current RSS)
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let base = proc_status_kb("VmRSS:");
    let t = std::time::Instant::now();
    let (status, v) = post(&s, "/tokenize", body).await;
    let took = t.elapsed().as_secs_f64();
    let extra = proc_status_kb("VmHWM:").saturating_sub(base);
    eprintln!("/tokenize of 24 MB: {status} in {took:.2} s, peak resident memory +{:.1} MB", extra as f64 / 1e6);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert!(extra < 200_000_000, "/tokenize of 24 MB took {:.1} MB of extra resident memory", extra as f64 / 1e6);
}
