//! The `k3-decode generate` contract: `--input-ids IDS.json ... --greedy --out OUT.json` prints
//! and writes `{"tokens": [...]}` (local prefill), and `--state SESSION.safetensors` decodes
//! from a hand-off state; both give the golden tiny-a tokens.
#![cfg(feature = "mlx")]

mod decoder_golden;

use std::process::Command;

use decoder_golden::{model_dir, Golden};

fn tokens_of(json: &str) -> Vec<u32> {
    let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {json}"));
    v["tokens"].as_array().expect("a tokens array").iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

#[test]
fn generate_from_ids_and_from_state_prints_and_writes_the_golden_tokens() {
    let g = Golden::load("tiny-a");
    let want = g.ids("decode.tokens");
    let dir = tempfile::tempdir().unwrap();
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, serde_json::to_string(&g.ids("input_ids")).unwrap()).unwrap();
    let out = dir.path().join("out.json");
    let model = model_dir("tiny-a");
    let run = |extra: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_k3-decode"))
            .args(["generate", "--model"])
            .arg(&model)
            .args(["--max-new-tokens", &want.len().to_string(), "--greedy", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "k3-decode failed: {}", String::from_utf8_lossy(&o.stderr));
        let printed = tokens_of(&String::from_utf8_lossy(&o.stdout));
        let written = tokens_of(&std::fs::read_to_string(&out).unwrap());
        assert_eq!(printed, written);
        printed
    };
    assert_eq!(run(&["--input-ids", ids.to_str().unwrap()]), want);
    let state = model.join("golden.safetensors");
    assert_eq!(run(&["--state", state.to_str().unwrap()]), want);

    // bad input is an error naming the cause, not a panic
    std::fs::write(&ids, "[1, 2, 99999]").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_k3-decode"))
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--input-ids", ids.to_str().unwrap(), "--greedy"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("99999") && err.contains("vocabulary"), "{err}");
}

/// `generate` had no context check: 10M ids were prefilled until 5.2 GB of RSS. A run past the
/// context limit (the config's 1,048,576 on tiny-t, or `--max-context`) is now refused before
/// the model loads, naming the limit; one within it runs.
#[test]
fn generate_refuses_a_prompt_past_the_context_before_prefilling() {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models/tiny-t");
    let dir = tempfile::tempdir().unwrap();
    let ids = dir.path().join("ids.json");
    let run = |ids_list: Vec<u32>, extra: &[&str]| {
        std::fs::write(&ids, serde_json::to_string(&ids_list).unwrap()).unwrap();
        Command::new(env!("CARGO_BIN_EXE_k3-decode"))
            .args(["generate", "--model"])
            .arg(&model)
            .arg("--input-ids")
            .arg(&ids)
            .args(["--greedy", "--max-new-tokens", "4"])
            .args(extra)
            .env("RUST_LOG", "info")
            .output()
            .unwrap()
    };
    let o = run((0..1_100_000u32).map(|i| 10 + i % 4000).collect(), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "1.1M ids were accepted: {err}");
    assert!(err.contains("1100000 prompt tokens") && err.contains("exceed the context limit of") && err.contains("--max-context"), "{err}");
    assert!(!err.contains("model loaded") && !err.contains("local prefill"), "it loaded or prefilled first: {err}");
    // --max-context: 20 ids + 4 new pass a limit of 24, not one of 23
    let o = run((10..30).collect(), &["--max-context", "23"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("exceed the context limit of 23 tokens"), "{err}");
    let o = run((10..30).collect(), &["--max-context", "24"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(tokens_of(&String::from_utf8_lossy(&o.stdout)).len(), 4);
}

/// Issue 21: SIGTERM skipped the graceful shutdown of `k3-decode serve` (the process died by the
/// signal). It now stops accepting, finishes what runs, and exits 0 with a log line.
#[cfg(unix)]
#[test]
fn serve_shuts_down_gracefully_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let mut o = k3_protocol::synth::SynthOptions::new(k3_protocol::synth::Preset::Tiny);
    o.seed = 5;
    k3_protocol::synth::write_model(dir.path(), &o).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3-decode"))
        .args(["serve", "--model"])
        .arg(dir.path())
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let t0 = std::time::Instant::now();
    let mut log = String::new();
    loop {
        let line = lines.next().expect("k3-decode serve ended before serving").unwrap();
        log.push_str(&line);
        log.push('\n');
        if line.contains("serving the OpenAI API") {
            break;
        }
        assert!(t0.elapsed().as_secs() < 120, "not serving after 120 s:\n{log}");
    }
    let st = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    for line in lines.map_while(Result::ok) {
        log.push_str(&line);
        log.push('\n');
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "k3-decode serve ended with {status:?} on SIGTERM:\n{log}");
    assert!(log.contains("SIGTERM: shutting down"), "{log}");
}

/// A `k3-decode serve` process on a synthetic tiny model (with a vision tower), killed on drop;
/// its log is collected while it runs.
#[cfg(target_os = "linux")]
struct Serve {
    child: std::process::Child,
    addr: std::net::SocketAddr,
    log: std::sync::Arc<std::sync::Mutex<String>>,
    _dir: tempfile::TempDir,
}

#[cfg(target_os = "linux")]
impl Serve {
    fn start(args: &[&str]) -> Serve {
        use std::io::{BufRead, BufReader};
        use std::process::Stdio;
        let dir = tempfile::tempdir().unwrap();
        let mut o = k3_protocol::synth::SynthOptions::new(k3_protocol::synth::Preset::Tiny);
        o.seed = 21;
        o.progress = false;
        k3_protocol::synth::write_model(dir.path(), &o).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_k3-decode"));
        cmd.args(["serve", "--model"]).arg(dir.path()).args(["--listen", "127.0.0.1:0"]).args(args);
        cmd.env("RUST_LOG", "info").env("NO_COLOR", "1").stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = log.clone();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("serving the OpenAI API") {
                    let addr = line.split_whitespace().find_map(|w| w.strip_prefix("addr=")).and_then(|a| a.parse().ok());
                    let _ = tx.send(addr);
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(Some(a)) => a,
            _ => {
                let _ = child.kill();
                panic!("k3-decode serve is not serving:\n{}", log.lock().unwrap());
            }
        };
        Serve { child, addr, log, _dir: dir }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// A `/proc/<pid>/status` field in MB (`VmRSS`, `VmHWM`).
    fn status_mb(&self, field: &str) -> f64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: f64 = s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)).unwrap().parse().unwrap();
        kb / 1024.0
    }

    /// One HTTP/1.1 request on a fresh connection: (status, body); status 0 when the server
    /// closed without answering or did not answer within `timeout`.
    fn request(&self, method: &str, path: &str, body: &str, timeout: std::time::Duration) -> (u16, String) {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(timeout)).unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body.as_bytes()).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let out = String::from_utf8_lossy(&out).into_owned();
        let code = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (code, body)
    }
}

#[cfg(target_os = "linux")]
impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A chat request with one PNG of `side`² pixels (smooth, so it compresses to little).
#[cfg(target_os = "linux")]
fn image_chat(side: u32) -> String {
    use base64::Engine as _;
    let img = image::RgbImage::from_fn(side, side, |x, y| image::Rgb([(x / 8) as u8, (y / 8) as u8, ((x + y) / 16) as u8]));
    let mut png = std::io::Cursor::new(Vec::new());
    img.write_to(&mut png, image::ImageFormat::Png).unwrap();
    let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png.into_inner()));
    serde_json::json!({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}],
        "max_tokens": 1,
        "temperature": 0,
    })
    .to_string()
}

/// Issue 21, finding 1 (one small image took the decoder down: a 9 KB 1792² PNG drove
/// `k3-decode serve` to 2.24 GB, a 2240² one to 5.3 GB; MLX built every attention block's scores
/// lazily and evaluated them together). Here `serve` runs with a vision memory budget of
/// 128 MB (`--vision-memory-bytes`): a 2240² PNG (25,600 patches) cannot fit and gets a clean 400
/// within seconds, before any tower work; a 1120² PNG (6,400 patches, whose scores alone are
/// 2 heads × 6400² × 4 B = 328 MB when built at once) is answered, and the server's peak
/// resident memory (VmHWM, reset just before) grows by less than the budget + 64 MB.
#[cfg(target_os = "linux")]
#[test]
fn serve_bounds_the_memory_of_an_image_and_refuses_what_cannot_fit() {
    use std::time::{Duration, Instant};
    const BUDGET_MB: f64 = 128.0;
    let budget = ((BUDGET_MB * 1e6) as u64).to_string();
    let s = Serve::start(&["--vision-memory-bytes", &budget]);

    let t0 = Instant::now();
    let (code, body) = s.request("POST", "/v1/chat/completions", &image_chat(2240), Duration::from_secs(60));
    let refused_s = t0.elapsed().as_secs_f64();
    assert_eq!(code, 400, "a 2240² image past the budget: {body}\n{}", s.log());
    assert!(body.contains("25600 patches") && body.contains("memory"), "{body}");
    assert!(refused_s < 30.0, "refused only after {refused_s:.1} s");

    // VmHWM back to the current RSS (write 5 to clear_refs), then one image that fits.
    std::fs::write(format!("/proc/{}/clear_refs", s.child.id()), "5").unwrap();
    let before = s.status_mb("VmRSS:");
    let t0 = Instant::now();
    let (code, body) = s.request("POST", "/v1/chat/completions", &image_chat(1120), Duration::from_secs(300));
    let secs = t0.elapsed().as_secs_f64();
    assert_eq!(code, 200, "a 1120² image within the budget: {body}\n{}", s.log());
    let peak = s.status_mb("VmHWM:");
    eprintln!(
        "1120² image: {secs:.1} s; RSS before {before:.0} MB, peak {peak:.0} MB (+{:.0} MB; budget {BUDGET_MB} MB); 2240² refused in {refused_s:.2} s",
        peak - before
    );
    assert!(peak - before < BUDGET_MB + 64.0, "peak resident memory grew by {:.0} MB for a 6,400-patch image (budget {BUDGET_MB} MB)", peak - before);
}

/// Issue 21: read timeouts of `k3-decode serve`, set by flags. A client that sends part of its
/// headers and stalls is disconnected after `--header-read-timeout`; one that sends its headers
/// and part of the announced body gets 408 after `--body-read-timeout` (defaults 30 s each).
#[cfg(target_os = "linux")]
#[test]
fn serve_disconnects_clients_that_stall_mid_request() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let s = Serve::start(&["--header-read-timeout", "1", "--body-read-timeout", "1.5"]);
    let stall = |sent: &str| {
        let mut c = std::net::TcpStream::connect(s.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        c.write_all(sent.as_bytes()).unwrap();
        let t0 = Instant::now();
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out); // ends when the server closes
        (t0.elapsed().as_secs_f64(), String::from_utf8_lossy(&out).into_owned())
    };
    let (secs, _) = stall("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ");
    assert!((0.9..6.0).contains(&secs), "a partial header was held {secs:.1} s (timeout 1 s)");
    let (secs, answer) =
        stall("POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":");
    assert!(answer.starts_with("HTTP/1.1 408"), "a partial body: {answer}");
    assert!((1.4..6.5).contains(&secs), "a partial body was held {secs:.1} s (timeout 1.5 s)");
    // the server still answers
    let (code, body) = s.request("GET", "/health", "", Duration::from_secs(10));
    assert_eq!(code, 200, "{body}");
    assert!(s.log().contains("tokens-in-flight limit"), "{}", s.log());
}

/// `k3-decode serve` with a prefill node runs one tokio runtime (the HTTP server's, which the
/// prefill client's network shares: no `prefill-client` threads of a second one), and logs its
/// memory budgets once at start, as given by `--context-memory-bytes` / `--vision-memory-bytes`.
#[cfg(target_os = "linux")]
#[test]
fn serve_runs_one_tokio_runtime_and_logs_its_memory_budgets_once() {
    let config = tempfile::tempdir().unwrap();
    let s = Serve::start(&[
        "--prefill-node",
        "127.0.0.1:9",
        "--insecure-dev",
        "--config-dir",
        config.path().to_str().unwrap(),
        "--context-memory-bytes",
        "500000000",
        "--vision-memory-bytes",
        "128000000",
    ]);
    let threads: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", s.child.id()))
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect();
    assert!(threads.iter().any(|n| n.starts_with("tokio-")), "no tokio worker among {threads:?}");
    assert!(!threads.iter().any(|n| n == "prefill-client"), "the prefill client runs a runtime of its own: {threads:?}");
    let log = s.log();
    assert_eq!(log.matches("memory budgets").count(), 1, "{log}");
    assert!(log.contains("context_mb=500") && log.contains("vision_mb=128"), "{log}");
}
