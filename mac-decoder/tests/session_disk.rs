//! Held sessions on disk and eviction by cost, on the trained tiny K3 (tests/models/tiny-t):
//! - `k3-decode serve` stopped by SIGTERM after four chat turns and started again continues
//!   the fifth turn from its `*.k3session` files: only the new tokens are prefilled, and the
//!   greedy reply is token-identical to an uninterrupted run;
//! - 30 concurrent conversations under a memory bound of 4 sessions: every later turn is
//!   restored (from disk), never prefilled again, replies as without the bound, disk use under
//!   `--session-disk`;
//! - a main conversation and 10 short subagent conversations sharing its key, 4 sessions in
//!   memory, no disk: the main one is never prefilled again (recency alone would drop it);
//! - a corrupted, a truncated and an other-model session file: a warning naming the file, the
//!   file deleted, never used (the turn is prefilled, the reply unchanged); the server may
//!   write a valid file of the same tokens again at exit.
#![cfg(feature = "mlx")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mac_decoder::decode::EngineOptions;
use mac_decoder::engine::mlx_engine::MlxEngine;
use mac_decoder::engine::{DiskOptions, EngineHandle, StoreOptions};
use mac_decoder::metrics::Metrics;
use mac_decoder::server::AppState;
use mac_decoder::tokenizer::Tokenizer;
use serde_json::{json, Value};

mod support;

fn tiny_t() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/models/tiny-t")
}

/// One chat turn's answer: the reply's ids and text, the prompt's size and reuse.
#[derive(Debug, Clone, PartialEq)]
struct Turn {
    ids: Vec<u32>,
    content: Value,
    reasoning: Value,
    prompt_tokens: u64,
    cached: u64,
}

async fn chat(base: &str, messages: &[Value], extra: Value) -> Turn {
    let mut body = json!({"messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": true});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    let r = reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let c = &v["choices"][0];
    Turn {
        ids: c["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
        content: c["message"]["content"].clone(),
        reasoning: c["message"]["reasoning_content"].clone(),
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap(),
        cached: v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
    }
}

/// The conversation after `t`: its reply, then the next user message.
fn extend(messages: &mut Vec<Value>, t: &Turn, next: &str) {
    messages.push(json!({"role": "assistant", "content": t.content, "reasoning_content": t.reasoning}));
    messages.push(json!({"role": "user", "content": next}));
}

async fn metrics_text(base: &str) -> String {
    reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap()
}

fn user_turns(conv: usize) -> Vec<String> {
    (0..5).map(|t| format!("Conversation {conv}, turn {t}: tell me about the number {}.", conv * 7 + t)).collect()
}

/// `k3-decode serve` on tiny-t as a child process, its log in a file.
struct ServeProcess {
    child: Child,
    base: String,
    log: PathBuf,
}

impl ServeProcess {
    async fn start(session_dir: &Path, log: PathBuf, extra: &[&str]) -> ServeProcess {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(env!("CARGO_BIN_EXE_k3-decode"))
            .args(["serve", "--model"])
            .arg(tiny_t())
            .args(["--listen", &format!("127.0.0.1:{port}"), "--session-dir"])
            .arg(session_dir)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let t = Instant::now();
        loop {
            if let Ok(r) = reqwest::get(format!("{base}/health")).await {
                if r.status() == 200 {
                    break;
                }
            }
            assert!(t.elapsed() < Duration::from_secs(60), "the server did not come up: {}", std::fs::read_to_string(&log).unwrap_or_default());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        ServeProcess { child, base, log }
    }

    /// SIGTERM, then the exit status (the server writes its held sessions before it exits).
    fn stop(mut self) -> String {
        // SAFETY: the child's own pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let st = self.child.wait().unwrap();
        let log = std::fs::read_to_string(&self.log).unwrap();
        assert!(st.success(), "serve exited with {st}: {log}");
        log
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn session_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "k3session")).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_continues_the_fifth_turn_from_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let users = user_turns(1);
    // Uninterrupted: five turns on one server.
    let a = ServeProcess::start(&tmp.path().join("a"), tmp.path().join("a.log"), &[]).await;
    let mut msgs = vec![json!({"role": "user", "content": users[0]})];
    let mut want = Vec::new();
    for t in 0..5 {
        let turn = chat(&a.base, &msgs, json!({})).await;
        if t < 4 {
            extend(&mut msgs, &turn, &users[t + 1]);
        }
        want.push(turn);
    }
    a.stop();
    // Four turns, SIGTERM, start again, the fifth.
    let dir = tmp.path().join("b");
    let b = ServeProcess::start(&dir, tmp.path().join("b1.log"), &[]).await;
    let mut msgs = vec![json!({"role": "user", "content": users[0]})];
    for (t, w) in want.iter().enumerate().take(4) {
        let turn = chat(&b.base, &msgs, json!({})).await;
        assert_eq!(&turn, w, "turn {}", t + 1);
        extend(&mut msgs, &turn, &users[t + 1]);
    }
    let log = b.stop();
    assert!(log.contains("held sessions written"), "{log}");
    assert!(!session_files(&dir).is_empty());
    let c = ServeProcess::start(&dir, tmp.path().join("b2.log"), &[]).await;
    let before = metrics_text(&c.base).await;
    assert_eq!(support::metric(&before, "k3_session_disk_files"), session_files(&dir).len() as f64);
    let t5 = chat(&c.base, &msgs, json!({})).await;
    assert_eq!(t5.ids, want[4].ids, "turn 5 after the restart is token-identical");
    assert_eq!(t5.prompt_tokens, want[4].prompt_tokens);
    assert_eq!(t5.cached, want[4].cached, "turn 5 reuses as much as without the restart");
    assert!(t5.cached >= want[3].prompt_tokens, "turn 5 continues at least turn 4's prompt ({} < {})", t5.cached, want[3].prompt_tokens);
    let m = metrics_text(&c.base).await;
    assert_eq!(support::metric(&m, "k3_prefill_tokens_total{where=\"local\"}"), (t5.prompt_tokens - t5.cached) as f64, "only the new tokens are prefilled");
    assert_eq!(support::metric(&m, "k3_sessions_restored_total"), 1.0);
    assert_eq!(support::metric(&m, "k3_session_restored_tokens_total"), t5.cached as f64);
    assert!(support::metric(&m, "k3_session_restore_seconds_saved_total") > 0.0);
    let log = c.stop();
    assert!(log.contains("session restored from disk instead of prefilled"), "{log}");
}

/// The server state over the MLX engine on tiny-t, held sessions bounded and on `disk`.
fn state(max_sessions: usize, disk: Option<DiskOptions>) -> AppState {
    let model = tiny_t();
    let tok = Arc::new(Tokenizer::from_dir(&model).unwrap());
    let metrics = Arc::new(Metrics::new());
    let store = StoreOptions { max_sessions, max_bytes: 1 << 30, checkpoints: true };
    let engine = EngineHandle::spawn_with_disk(move || MlxEngine::load(&model, EngineOptions::default(), 0), store, disk, metrics.clone()).unwrap();
    AppState::new(engine, tok, metrics, "tiny-t".into(), None)
}

/// Runs `convs` conversations of `turns` turns concurrently; each conversation's turns.
async fn conversations(base: &str, convs: usize, turns: usize) -> Vec<Vec<Turn>> {
    let tasks: Vec<_> = (0..convs)
        .map(|c| {
            let base = base.to_string();
            tokio::spawn(async move {
                let users = user_turns(c);
                let mut msgs = vec![json!({"role": "user", "content": users[0]})];
                let mut out = Vec::new();
                for t in 0..turns {
                    let turn = chat(&base, &msgs, json!({})).await;
                    extend(&mut msgs, &turn, &users[t + 1]);
                    out.push(turn);
                }
                out
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.push(t.await.unwrap());
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_conversations_over_four_sessions_in_memory_continue_from_disk() {
    const CONVS: usize = 30;
    const TURNS: usize = 3;
    let want = {
        let addr = support::serve(state(256, None)).await;
        conversations(&format!("http://{addr}"), CONVS, TURNS).await
    };
    let tmp = tempfile::tempdir().unwrap();
    let limit: u64 = 200_000_000;
    let addr = support::serve(state(4, Some(DiskOptions { dir: tmp.path().to_path_buf(), max_bytes: limit }))).await;
    let base = format!("http://{addr}");
    let got = conversations(&base, CONVS, TURNS).await;
    let mut new_tokens = 0;
    for (c, (g, w)) in got.iter().zip(&want).enumerate() {
        for t in 0..TURNS {
            assert_eq!(g[t].ids, w[t].ids, "conversation {c}, turn {}: the reply differs from the unbounded run", t + 1);
            if t > 0 {
                assert!(
                    g[t].cached >= g[t - 1].prompt_tokens,
                    "conversation {c}, turn {}: prefilled again ({} cached, the previous prompt was {})",
                    t + 1,
                    g[t].cached,
                    g[t - 1].prompt_tokens
                );
            }
            new_tokens += g[t].prompt_tokens - g[t].cached;
        }
    }
    let m = metrics_text(&base).await;
    assert_eq!(support::metric(&m, "k3_prefill_tokens_total{where=\"local\"}"), new_tokens as f64, "only new tokens were prefilled");
    let restored = support::metric(&m, "k3_sessions_restored_total");
    assert!(restored >= (CONVS * (TURNS - 1) / 2) as f64, "{restored} restores for {} later turns", CONVS * (TURNS - 1));
    assert!(support::metric(&m, "k3_sessions_held") <= 4.0);
    let disk = support::metric(&m, "k3_session_disk_bytes");
    // the writer may rename a `.tmp` file while the directory is listed
    let on_disk: u64 = std::fs::read_dir(tmp.path()).unwrap().flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum();
    assert!(disk <= limit as f64 && on_disk <= limit, "disk use {disk} ({on_disk} in the directory) above --session-disk {limit}");
    eprintln!(
        "30 conversations × {TURNS} turns: {restored} restores, {:.1} MB on disk, restore {:.3} s, prefill saved {:.3} s",
        disk / 1e6,
        support::metric(&m, "k3_session_restore_seconds_total"),
        support::metric(&m, "k3_session_restore_seconds_saved_total")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_main_conversation_outlives_ten_subagents_in_memory() {
    // Claude Code's subagents send the parent's session id (metadata.user_id).
    let key = json!({"metadata": {"user_id": "{\"device_id\":\"0\",\"account_uuid\":\"\",\"session_id\":\"4e73b6db-e60a-401b-a86c-c133a280b67e\"}"}});
    let addr = support::serve(state(4, None)).await;
    let base = format!("http://{addr}");
    let system = "You are the main agent. ".repeat(40) + "Work through the repository carefully and delegate searches to subagents.";
    let mut main = vec![json!({"role": "system", "content": system}), json!({"role": "user", "content": "Fix the failing test."})];
    let mut prev = chat(&base, &main, key.clone()).await;
    let mut sub = 0;
    for round in 0..3 {
        for _ in 0..if round == 2 { 0 } else { 5 } {
            let msgs = vec![json!({"role": "user", "content": format!("Subagent {sub}: search for symbol s{sub}.")})];
            chat(&base, &msgs, key.clone()).await;
            sub += 1;
        }
        if round == 2 {
            break;
        }
        extend(&mut main, &prev, &format!("The subagents reported back (round {round}). Continue."));
        let t = chat(&base, &main, key.clone()).await;
        assert!(
            t.cached >= prev.prompt_tokens,
            "main turn {}: prefilled again ({} cached of {}, the previous prompt was {})",
            round + 2,
            t.cached,
            t.prompt_tokens,
            prev.prompt_tokens
        );
        prev = t;
    }
    assert_eq!(sub, 10);
    let m = metrics_text(&base).await;
    assert!(
        support::metric(&m, "k3_session_evictions_total{reason=\"count\"}") + support::metric(&m, "k3_session_evictions_total{reason=\"superseded\"}") > 0.0
    );
    assert_eq!(support::metric(&m, "k3_session_keys_held"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_truncated_and_other_model_files_are_named_deleted_and_never_used() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sessions");
    let users = user_turns(3);
    let first = vec![json!({"role": "user", "content": users[0]})];
    // The reference: turn 1, then turn 2 from memory.
    let s = ServeProcess::start(&dir, tmp.path().join("0.log"), &[]).await;
    let t1 = chat(&s.base, &first, json!({})).await;
    let mut second = first.clone();
    extend(&mut second, &t1, &users[1]);
    let t2 = chat(&s.base, &second, json!({})).await;
    assert!(t2.cached > 0);
    s.stop();
    std::fs::remove_dir_all(&dir).unwrap();
    // Turn 1 alone, then the files it leaves.
    let s = ServeProcess::start(&dir, tmp.path().join("1.log"), &[]).await;
    assert_eq!(chat(&s.base, &first, json!({})).await, t1);
    s.stop();
    let good: Vec<(PathBuf, Vec<u8>)> = session_files(&dir).into_iter().map(|p| (p.clone(), std::fs::read(&p).unwrap())).collect();
    assert!(!good.is_empty());
    let cfg = k3_protocol::Checkpoint::open(&tiny_t()).unwrap().config().text_config.clone();
    type Damage = fn(&Path, &[u8], &k3_protocol::config::TextConfig);
    let cases: [(&str, Damage); 3] = [
        ("damaged", |p, b, _| {
            let mut b = b.to_vec();
            let i = b.len() - 1000; // inside the tensor data
            b[i] ^= 0x40;
            std::fs::write(p, b).unwrap();
        }),
        ("torn", |p, b, _| std::fs::write(p, &b[..b.len() / 2]).unwrap()),
        ("other_model", |p, _, c| {
            let f = k3_protocol::handoff::load_session(p, c).unwrap();
            let meta = k3_protocol::handoff::SessionMeta {
                fingerprint: k3_protocol::Fingerprint([7; 32]),
                tokens: f.state.tokens,
                token_prefix_hash: f.token_prefix_hash.clone().unwrap(),
            };
            let extra: Vec<(String, Vec<usize>, &[f32])> = f.extra.iter().map(|(n, (s, d))| (n.clone(), s.clone(), &d[..])).collect();
            k3_protocol::handoff::save_session(p, &f.state, Some(&meta), &extra).unwrap();
        }),
    ];
    for (i, (reason, damage)) in cases.iter().enumerate() {
        for f in session_files(&dir) {
            std::fs::remove_file(f).unwrap();
        }
        let mut bad = Vec::new();
        for (p, b) in &good {
            std::fs::write(p, b).unwrap();
            damage(p, b, &cfg);
            bad.push(std::fs::read(p).unwrap());
        }
        let s = ServeProcess::start(&dir, tmp.path().join(format!("{reason}.log")), &[]).await;
        let t = chat(&s.base, &second, json!({})).await;
        assert_eq!(t.ids, t2.ids, "{reason}: the reply is unchanged");
        assert_eq!(t.cached, 0, "{reason}: nothing of a bad file is used");
        let m = metrics_text(&s.base).await;
        assert_eq!(support::metric(&m, "k3_sessions_restored_total"), 0.0, "{reason}");
        assert!(support::metric(&m, &format!("k3_session_files_rejected_total{{reason=\"{reason}\"}}")) >= 1.0, "{reason}: {m}");
        let log = s.stop();
        for (p, _) in &good {
            let name = p.file_name().unwrap().to_string_lossy();
            assert!(log.contains(&*name) && log.contains("session file not used and deleted"), "case {i} ({reason}): no warning naming {name}:\n{log}");
        }
        // What the run left is its own state of turn 2, none of the bad files: turn 2 leaves a
        // checkpoint at every message boundary, one of them turn 1's prompt, so the server
        // writes a file of the same name at exit — a whole, valid one, not the bad bytes.
        for ((p, _), bad) in good.iter().zip(&bad) {
            if p.exists() {
                assert_ne!(&std::fs::read(p).unwrap(), bad, "{reason}: {} was not deleted", p.display());
                let f = k3_protocol::handoff::load_session(p, &cfg).unwrap_or_else(|e| panic!("{reason}: {} left behind: {e:#}", p.display()));
                assert_ne!(f.token_prefix_hash, None, "{reason}: {}", p.display());
            }
        }
    }
}
