//! Decoder ranks (`k3-decode launch`, expert parallel over MLX's ring backend on loopback):
//! greedy tokens equal the single process's on tiny-a and on synthetic variants with expert
//! counts that do not divide by the rank count, from a local prefill and from a prefill node's
//! hand-off state; a rank killed mid-decode stops the others within seconds; each rank holds
//! only its share of the routed experts.
#![cfg(feature = "mlx")]
// The tests take turns through a std Mutex held for the whole (async) test: that is the point.
#![allow(clippy::await_holding_lock)]

mod decoder_golden;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_prefiller::executor::{self, ExecOptions, PrefillInput};
use decoder_golden::{model_dir, Golden};
use k3_protocol::handoff::{save_session, HandoffState, SessionMeta};
use k3_protocol::synth::{write_model, Overrides, Preset, SynthOptions};

const BIN: &str = env!("CARGO_BIN_EXE_k3-decode");

/// The tests of this file run one at a time: each starts up to four processes that meet in
/// collectives, and CI has two cores.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn tokens_of(stdout: &[u8]) -> Vec<u32> {
    let s = String::from_utf8_lossy(stdout);
    let v: serde_json::Value = serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"));
    v["tokens"].as_array().expect("a tokens array").iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

fn check(o: &Output, what: &str) {
    assert!(o.status.success(), "{what} failed ({}): {}", o.status, String::from_utf8_lossy(&o.stderr));
}

/// `k3-decode generate …` in one process.
fn single(args: &[String]) -> Vec<u32> {
    let o = Command::new(BIN).arg("generate").args(args).output().unwrap();
    check(&o, "single-process generate");
    tokens_of(&o.stdout)
}

/// `k3-decode launch --ranks n -- generate …`.
fn launched(n: usize, args: &[String]) -> Vec<u32> {
    let o = Command::new(BIN).args(["launch", "--ranks", &n.to_string(), "--step-timeout", "20", "--", "generate"]).args(args).output().unwrap();
    check(&o, &format!("launch --ranks {n}"));
    tokens_of(&o.stdout)
}

fn s(x: impl AsRef<Path>) -> String {
    x.as_ref().display().to_string()
}

#[test]
fn tiny_a_on_two_and_four_ranks_gives_the_golden_tokens() {
    let _serial = serial();
    let g = Golden::load("tiny-a");
    // the first 12 of the 24 golden tokens (CI time: every token is a round of collectives)
    let want = g.ids("decode.tokens")[..12].to_vec();
    let dir = tempfile::tempdir().unwrap();
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, serde_json::to_string(&g.ids("input_ids")).unwrap()).unwrap();
    let model = model_dir("tiny-a");
    let base = ["--model".to_string(), s(&model), "--greedy".into(), "--max-new-tokens".into(), want.len().to_string()];
    let local: Vec<String> = base.iter().cloned().chain(["--input-ids".into(), s(&ids)]).collect();
    let handoff: Vec<String> = base.iter().cloned().chain(["--state".into(), s(model.join("golden.safetensors"))]).collect();
    for n in [2, 4] {
        assert_eq!(launched(n, &local), want, "{n} ranks, local prefill");
        assert_eq!(launched(n, &handoff), want, "{n} ranks, hand-off state");
    }
}

/// A synthetic model whose expert count (7) and head counts (3 KDA, 3 MLA heads) divide by
/// neither 2 nor 4, its prompt, and the reference prefiller's hand-off state (the prefill
/// node's result) as a session file.
fn synth_case(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.seed = 19;
    opts.tokenizer = false;
    opts.overrides = Overrides {
        layers: Some(5),
        full_attn_layers: Some(vec![2, 5]),
        first_k_dense: Some(1),
        experts: Some(7),
        experts_per_token: Some(3),
        heads: Some(3),
        block_size: Some(2),
        vocab: Some(512),
        ..Default::default()
    };
    let report = write_model(&dir.join("model"), &opts).unwrap();
    let cfg = &report.config;
    let special = [cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.media_placeholder_token_id];
    let ids: Vec<u32> = (0..70u32).map(|i| (i * 131 + 7) % 512).filter(|t| !special.contains(t)).collect();
    let ids_path = dir.join("ids.json");
    std::fs::write(&ids_path, serde_json::to_string(&ids).unwrap()).unwrap();
    let ck = Arc::new(k3_protocol::Checkpoint::open(&report.dir).unwrap());
    let fingerprint = ck.fingerprint();
    let model = cuda_prefiller::model::Model::new(Arc::new(cuda_prefiller::cpu::CpuBackend), ck, cuda_prefiller::model::WeightPolicy::Resident).unwrap();
    let mut state = HandoffState::empty(&cfg.text_config);
    let out = executor::prefill(&model, &mut state, PrefillInput::tokens(&ids), &ExecOptions::default(), |_| Ok(())).unwrap();
    let vocab = cfg.text_config.vocab_size;
    let last = out.row(ids.len() - 1).to_vec();
    let meta = SessionMeta { fingerprint, tokens: ids.len(), token_prefix_hash: k3_protocol::handoff::token_prefix_hash(&ids) };
    let session = dir.join("session.safetensors");
    save_session(&session, &state, Some(&meta), &[("logits".into(), vec![1, vocab], &last[..])]).unwrap();
    (report.dir.clone(), ids_path, session)
}

#[test]
fn seven_experts_over_two_and_four_ranks_match_the_single_process() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (model, ids, session) = synth_case(dir.path());
    let base = ["--model".to_string(), s(&model), "--greedy".into(), "--max-new-tokens".into(), "10".into()];
    let local: Vec<String> = base.iter().cloned().chain(["--input-ids".into(), s(&ids)]).collect();
    let handoff: Vec<String> = base.iter().cloned().chain(["--state".into(), s(&session)]).collect();
    let want_local = single(&local);
    let want_handoff = single(&handoff);
    assert_eq!(want_local.len(), 10);
    assert_eq!(want_local, want_handoff, "local prefill and the reference hand-off decode alike in one process");
    for n in [2, 4] {
        assert_eq!(launched(n, &local), want_local, "{n} ranks, local prefill");
        assert_eq!(launched(n, &handoff), want_handoff, "{n} ranks, hand-off state");
    }
}

/// Starts the ranks of a loopback ring by hand (what `launch` does), each with its own pipes.
fn spawn_ranks(n: usize, args: &[String], extra_env: &[(&str, &str)], dir: &Path) -> Vec<Child> {
    let ports: Vec<u16> = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).map(|l| l.local_addr().unwrap().port()).collect();
    let hosts: Vec<Vec<String>> = ports.iter().map(|p| vec![format!("127.0.0.1:{p}")]).collect();
    let hostfile = dir.join("hostfile.json");
    std::fs::write(&hostfile, serde_json::to_string(&hosts).unwrap()).unwrap();
    (0..n)
        .map(|r| {
            let mut c = Command::new(BIN);
            c.arg("generate").args(args).env("MLX_RANK", r.to_string()).env("MLX_HOSTFILE", &hostfile).env("RUST_LOG", "info");
            for (k, v) in extra_env {
                c.env(k, v);
            }
            c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
        })
        .collect()
}

/// Reads a child's stderr on a thread; lines are sent as they come.
fn stderr_lines(c: &mut Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    let err = c.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Starts `n` ranks decoding tiny-a "forever" and returns them once rank `victim` decodes.
fn decoding_ranks(n: usize, victim: usize, timeout_s: &str, dir: &Path) -> (Vec<Child>, Vec<std::sync::mpsc::Receiver<String>>) {
    let g = Golden::load("tiny-a");
    let ids = dir.join("ids.json");
    std::fs::write(&ids, serde_json::to_string(&g.ids("input_ids")[..40]).unwrap()).unwrap();
    let args: Vec<String> =
        ["--model", &s(model_dir("tiny-a")), "--input-ids", &s(&ids), "--greedy", "--max-new-tokens", "1000000"].iter().map(|x| x.to_string()).collect();
    let mut ranks = spawn_ranks(n, &args, &[("K3_RANK_TIMEOUT_S", timeout_s)], dir);
    let logs: Vec<_> = ranks.iter_mut().map(stderr_lines).collect();
    let t0 = Instant::now();
    let mut seen = Vec::new();
    loop {
        match logs[victim].recv_timeout(Duration::from_secs(120)) {
            Ok(l) if l.contains("local prefill") => break,
            Ok(l) => seen.push(l),
            Err(e) => panic!("rank {victim} never finished its prefill ({e}):\n{}", seen.join("\n")),
        }
        assert!(t0.elapsed() < Duration::from_secs(120));
    }
    std::thread::sleep(Duration::from_millis(300));
    (ranks, logs)
}

/// Waits for rank `r` to end (at most `limit` after `since`); returns its status, when, and its log.
fn ended(c: &mut Child, log: &std::sync::mpsc::Receiver<String>, r: usize, since: Instant, limit: Duration) -> (std::process::ExitStatus, Duration, String) {
    let status = loop {
        if let Some(st) = c.try_wait().unwrap() {
            break st;
        }
        if since.elapsed() > limit {
            let _ = c.kill();
            let _ = c.wait();
            panic!("rank {r} still ran {:?} after its peer went away", since.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = since.elapsed();
    std::thread::sleep(Duration::from_millis(100)); // let the reader drain the pipe
    (status, took, log.try_iter().collect::<Vec<_>>().join("\n"))
}

#[test]
fn a_rank_killed_or_stalled_mid_decode_stops_the_others_within_seconds() {
    let _serial = serial();
    // killed: its sockets close, MLX's ring reports the lost connection at once
    let dir = tempfile::tempdir().unwrap();
    let (mut ranks, logs) = decoding_ranks(3, 2, "3", dir.path());
    ranks[2].kill().unwrap();
    let killed = Instant::now();
    ranks[2].wait().unwrap();
    for r in 0..2 {
        let (status, took, log) = ended(&mut ranks[r], &logs[r], r, killed, Duration::from_secs(20));
        eprintln!("killed peer: rank {r} stopped {took:?} after rank 2 was killed ({status})");
        assert!(!status.success(), "rank {r}: {log}");
        assert!(log.contains(&format!("rank {r} of 3 decoding the token")), "rank {r} does not name its step: {log}");
        assert!(log.contains("connection to a peer was lost") || log.contains("a peer rank is gone or stalled"), "rank {r}: {log}");
        assert!(took < Duration::from_secs(13), "rank {r} took {took:?}");
    }

    // stalled (SIGSTOP: its sockets stay open, the ring would wait forever): the watchdog
    let dir = tempfile::tempdir().unwrap();
    let (mut ranks, logs) = decoding_ranks(2, 1, "3", dir.path());
    let pid = ranks[1].id() as i32;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let stopped = Instant::now();
    let (status, took, log) = ended(&mut ranks[0], &logs[0], 0, stopped, Duration::from_secs(25));
    ranks[1].kill().unwrap();
    ranks[1].wait().unwrap();
    eprintln!("stalled peer: rank 0 stopped {took:?} after rank 1 was stopped ({status})");
    assert_eq!(status.code(), Some(75), "rank 0: {log}");
    assert!(log.contains("a peer rank is gone or stalled") && log.contains("rank 0 of 2"), "rank 0: {log}");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(13), "rank 0 took {took:?}");
}

#[test]
fn launch_reports_a_failing_rank_and_checks_its_arguments() {
    let _serial = serial();
    let o = Command::new(BIN)
        .args(["launch", "--ranks", "2", "--", "generate", "--model", "/nonexistent/k3", "--input-ids", "/nonexistent/ids.json"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("rank") && err.contains("failed"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("hosts.json");
    std::fs::write(&bad, r#"[["127.0.0.1:5000"], ["127.0.0.1"]]"#).unwrap();
    let o = Command::new(BIN).args(["launch", "--hostfile", &s(&bad), "--", "generate"]).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("rank 1") && err.contains("host:port"), "{err}");

    // a hostfile of remote hosts: the per-rank commands are printed
    let hosts = dir.path().join("remote.json");
    std::fs::write(&hosts, r#"[["10.0.0.1:5000"], ["10.0.0.2:5000"]]"#).unwrap();
    let o = Command::new(BIN).args(["launch", "--hostfile", &s(&hosts), "--print-only", "--", "generate", "--model", "m"]).output().unwrap();
    check(&o, "launch --print-only");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("MLX_RANK=0 ") && out.contains("MLX_RANK=1 ") && out.contains("generate --model m"), "{out}");
}

/// Peak RSS (MB) a rank logged at the end of `generate`.
fn peak_rss_mb(log: &str) -> f64 {
    // drop the log's colour codes (ESC [ … m)
    let mut plain = String::with_capacity(log.len());
    let mut it = log.chars();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            for d in it.by_ref() {
                if d == 'm' {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    let log = plain;
    let l = log.lines().rev().find(|l| l.contains("peak_rss_mb")).unwrap_or_else(|| panic!("no peak_rss_mb in:\n{log}"));
    let v = l.split("peak_rss_mb=").nth(1).unwrap().split_whitespace().next().unwrap();
    v.trim_matches('"').parse().unwrap()
}

#[test]
fn each_rank_holds_only_its_share_of_the_experts() {
    let _serial = serial();
    // routed experts dominate: 128 experts of 3 x [1024 x 512] per MoE layer, 2 MoE layers
    // (213 MB of MXFP4; each ring rank also holds MLX's 32 MB of all-reduce buffers)
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.seed = 5;
    opts.tokenizer = false;
    opts.overrides = Overrides {
        layers: Some(3),
        full_attn_layers: Some(vec![3]),
        first_k_dense: Some(1),
        experts: Some(128),
        experts_per_token: Some(4),
        moe_intermediate: Some(1024),
        latent: Some(512),
        vocab: Some(512),
        ..Default::default()
    };
    let report = write_model(&dir.path().join("model"), &opts).unwrap();
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, "[1, 2, 3, 4, 5, 6, 7, 8]").unwrap();
    let args: Vec<String> = ["--model", &s(&report.dir), "--input-ids", &s(&ids), "--greedy", "--max-new-tokens", "4"].iter().map(|x| x.to_string()).collect();
    let o = Command::new(BIN).arg("generate").args(&args).env("RUST_LOG", "info").output().unwrap();
    check(&o, "single process");
    let one = peak_rss_mb(&String::from_utf8_lossy(&o.stderr));
    let want = tokens_of(&o.stdout);
    let n = 4;
    let ranks = spawn_ranks(n, &args, &[], dir.path());
    let mut per_rank = Vec::new();
    for (r, c) in ranks.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        check(&out, &format!("rank {r}"));
        if r == 0 {
            assert_eq!(tokens_of(&out.stdout), want);
        }
        per_rank.push(peak_rss_mb(&String::from_utf8_lossy(&out.stderr)));
    }
    eprintln!("peak RSS: one process {one:.1} MB, {n} ranks {per_rank:?} MB");
    for (r, m) in per_rank.iter().enumerate() {
        assert!(*m < one * 0.6, "rank {r}: {m:.1} MB is not clearly below one process's {one:.1} MB");
    }
}

/// Polls `GET {base}/v1/models` until the server answers.
async fn wait_ready(base: &str, rank0: &mut Child) {
    let t0 = Instant::now();
    loop {
        if let Ok(r) = reqwest::get(format!("{base}/v1/models")).await {
            if r.status().is_success() {
                return;
            }
        }
        if let Some(st) = rank0.try_wait().unwrap() {
            panic!("rank 0 ended before serving ({st})");
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "the ranked server did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_over_two_ranks_answers_like_generate_and_reports_a_lost_rank() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.progress = false;
    opts.overrides = Overrides { experts: Some(7), experts_per_token: Some(3), ..Default::default() };
    let report = write_model(&dir.path().join("model"), &opts).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 900) as u32 + 3).collect();
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, serde_json::to_string(&prompt).unwrap()).unwrap();
    let want = single(&["--model".into(), s(&report.dir), "--input-ids".into(), s(&ids), "--greedy".into(), "--max-new-tokens".into(), "8".into()]);

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let base = format!("http://127.0.0.1:{port}");
    let ports: Vec<u16> = (0..2).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).map(|l| l.local_addr().unwrap().port()).collect();
    let hostfile = dir.path().join("hostfile.json");
    std::fs::write(&hostfile, serde_json::to_string(&ports.iter().map(|p| vec![format!("127.0.0.1:{p}")]).collect::<Vec<_>>()).unwrap()).unwrap();
    let mut ranks: Vec<Child> = (0..2)
        .map(|r| {
            Command::new(BIN)
                .args(["serve", "--model", &s(&report.dir), "--listen", &format!("127.0.0.1:{port}")])
                .env("MLX_RANK", r.to_string())
                .env("MLX_HOSTFILE", &hostfile)
                .env("K3_RANK_TIMEOUT_S", "5")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let logs: Vec<_> = ranks.iter_mut().map(stderr_lines).collect();
    wait_ready(&base, &mut ranks[0]).await;
    let client = reqwest::Client::new();
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": true});
    for round in 0..2 {
        // the second round starts from the prompt checkpoint (a fork, mirrored on rank 1)
        let r = client.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "round {round}");
        let v: serde_json::Value = r.json().await.unwrap();
        let got: Vec<u32> = v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        assert_eq!(got, want, "round {round}: served tokens = single-process generate");
    }

    // a follower dies: the next request fails with an error that says so
    ranks[1].kill().unwrap();
    ranks[1].wait().unwrap();
    let r = client.post(format!("{base}/v1/completions")).json(&serde_json::json!({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})).send().await;
    let text = match r {
        Ok(r) => {
            assert!(!r.status().is_success(), "a request succeeded with a rank gone");
            r.text().await.unwrap()
        }
        Err(e) => format!("{e}"),
    };
    let _ = ranks[0].kill();
    let _ = ranks[0].wait();
    let log: String = logs[0].try_iter().collect::<Vec<_>>().join("\n");
    assert!(text.contains("rank 0 of 2") || log.contains("a peer rank is gone or stalled"), "the server does not report the lost rank: {text}\n{log}");
}

/// CPU seconds (user + system) a process has used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        let Some(close) = stat.rfind(')') else { continue };
        let ppid: Option<u32> = stat[close + 2..].split_whitespace().nth(1).and_then(|x| x.parse().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out.sort();
    out
}

fn alive(pid: u32) -> bool {
    // a zombie still has /proc/PID; its state is Z
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.rfind(')').is_some_and(|c| !s[c + 2..].starts_with('Z')))
}

/// A synthetic model with a tokenizer for `serve` (7 experts: uneven over 2 ranks).
fn serve_model(dir: &Path) -> PathBuf {
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.progress = false;
    opts.overrides = Overrides { experts: Some(7), experts_per_token: Some(3), ..Default::default() };
    write_model(&dir.join("model"), &opts).unwrap().dir.clone()
}

/// Issue 19: an idle follower of `serve` sleeps (no core spinning in a ring collective), and
/// when rank 0 dies it stops at once with a message that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_follower_sleeps_and_stops_when_rank_0_is_gone() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let model = serve_model(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let base = format!("http://127.0.0.1:{port}");
    let ports: Vec<u16> = (0..2).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).map(|l| l.local_addr().unwrap().port()).collect();
    let hostfile = dir.path().join("hostfile.json");
    std::fs::write(&hostfile, serde_json::to_string(&ports.iter().map(|p| vec![format!("127.0.0.1:{p}")]).collect::<Vec<_>>()).unwrap()).unwrap();
    let mut ranks: Vec<Child> = (0..2)
        .map(|r| {
            Command::new(BIN)
                .args(["serve", "--model", &s(&model), "--listen", &format!("127.0.0.1:{port}")])
                .env("MLX_RANK", r.to_string())
                .env("MLX_HOSTFILE", &hostfile)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let logs: Vec<_> = ranks.iter_mut().map(stderr_lines).collect();
    wait_ready(&base, &mut ranks[0]).await;
    // one request, so the follower has taken part in collectives before it idles
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&serde_json::json!({"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = ranks[1].id();
    let (c0, t0) = (cpu_seconds(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (used, wall) = (cpu_seconds(pid) - c0, t0.elapsed().as_secs_f64());
    eprintln!("idle follower: {used:.2} s of CPU in {wall:.1} s");
    assert!(used < 0.1 * wall, "an idle follower used {used:.2} s of CPU in {wall:.1} s (spinning in a collective?)");

    ranks[0].kill().unwrap();
    ranks[0].wait().unwrap();
    let killed = Instant::now();
    let (status, took, log) = ended(&mut ranks[1], &logs[1], 1, killed, Duration::from_secs(10));
    eprintln!("follower stopped {took:?} after rank 0 was killed ({status})");
    assert!(!status.success());
    assert!(log.contains("rank 0 closed its doorbell connection") || log.contains("connection to a peer was lost"), "{log}");
    assert!(took < Duration::from_secs(5), "the follower took {took:?}");
}

/// Issue 19: `launch` forwards SIGTERM/SIGINT to its ranks and exits with their status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launch_forwards_signals_and_exits_with_the_ranks_status() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let model = serve_model(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let base = format!("http://127.0.0.1:{port}");
    let mut launcher = Command::new(BIN)
        .args(["launch", "--ranks", "2", "--", "serve", "--model", &s(&model), "--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = stderr_lines(&mut launcher);
    wait_ready(&base, &mut launcher).await;
    let ranks = children_of(launcher.id());
    assert_eq!(ranks.len(), 2, "launch --ranks 2 runs two processes: {ranks:?}");
    // SIGTERM to the launcher: rank 0 shuts the server down and stops its follower; status 0
    assert_eq!(unsafe { libc::kill(launcher.id() as i32, libc::SIGTERM) }, 0);
    let t0 = Instant::now();
    let (status, took, text) = ended(&mut launcher, &log, 0, t0, Duration::from_secs(30));
    eprintln!("serve: launcher ended {took:?} after SIGTERM ({status})");
    assert!(status.success(), "launch -- serve after SIGTERM: {status}\n{text}");
    assert!(text.contains("SIGTERM: shutting down"), "rank 0 did not get the signal:\n{text}");
    for p in &ranks {
        assert!(!alive(*p), "rank process {p} outlived its launcher");
    }

    // SIGINT while generating: rank 0 ends by the signal, the launcher exits 128 + 2
    let g = Golden::load("tiny-a");
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, serde_json::to_string(&g.ids("input_ids")[..40]).unwrap()).unwrap();
    let mut launcher = Command::new(BIN)
        .args([
            "launch",
            "--ranks",
            "2",
            "--",
            "generate",
            "--model",
            &s(model_dir("tiny-a")),
            "--input-ids",
            &s(&ids),
            "--greedy",
            "--max-new-tokens",
            "1000000",
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = stderr_lines(&mut launcher);
    let t0 = Instant::now();
    loop {
        match log.recv_timeout(Duration::from_secs(120)) {
            Ok(l) if l.contains("local prefill") => break,
            Ok(_) => {}
            Err(e) => panic!("the ranks never decoded ({e})"),
        }
        assert!(t0.elapsed() < Duration::from_secs(120));
    }
    let ranks = children_of(launcher.id());
    assert_eq!(ranks.len(), 2);
    assert_eq!(unsafe { libc::kill(launcher.id() as i32, libc::SIGINT) }, 0);
    let t0 = Instant::now();
    let (status, took, text) = ended(&mut launcher, &log, 0, t0, Duration::from_secs(30));
    eprintln!("generate: launcher ended {took:?} after SIGINT ({status})");
    assert_eq!(status.code(), Some(130), "{text}");
    assert!(text.contains("stopped by signal 2"), "{text}");
    for p in &ranks {
        assert!(!alive(*p), "rank process {p} outlived its launcher");
    }
}
