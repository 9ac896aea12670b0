//! The coding agents people use, run for real against `k3-decode serve --model
//! tests/models/tiny-t`: Claude Code 2.1.328 (three turns: `claude -p … --output-format json`,
//! then `--continue` twice), Codex CLI 0.169.0 (`codex exec -o FILE`, Responses API), the
//! `openai` SDK's `client.responses.create` (tests/clients/openai_responses.py), OpenCode
//! 1.18.33 (`opencode run`), Qwen Code 0.24.4 (`qwen -p`) and aider 0.86.2 (`aider --message`).
//!
//! The clients are installed from the npm and PyPI registries at those pinned versions by
//! scripts/setup-clients.sh (run here first; idempotent, a second run only checks; about 1.2 GB
//! in .deps-clients/). If it fails the tests fail: they never pass without the clients.
//!
//! tiny-t is a small model trained on prose: it never ends a chat message by itself, and every
//! client treats a reply cut at `max_tokens` as an error, so the server runs with
//! `--max-output-tokens 24`: replies are closed well-formed after 24 tokens (chat/budget.rs).
//!
//! Prompt size: the clients' default prompts are 10–20k tokens (Claude Code 2.1.328: 17,299 on
//! tiny-t's tokenizer), which MLX's CPU backend prefills at 30–170 tokens/s on a shared 2-core
//! box (Claude Code's first turn took 569 s at load 16; docs/chat-and-server.md). To keep this
//! part of the suite within minutes each client runs with fewer tools and, where it allows, a
//! short system prompt (the configuration is in each test); the captured default requests are
//! replayed in full by tests/agent_fixtures.rs.
#![cfg(feature = "mlx")]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Installs (or checks) the clients once per test binary; their directory.
fn clients() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let t = Instant::now();
        let script = root().join("scripts/setup-clients.sh");
        let out = Command::new("bash").arg(&script).output().expect("bash runs scripts/setup-clients.sh");
        assert!(
            out.status.success(),
            "scripts/setup-clients.sh failed (the clients could not be installed from npm/PyPI):\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = Command::new("bash").arg(&script).arg("--print").output().unwrap();
        let dir = PathBuf::from(String::from_utf8_lossy(&dir.stdout).trim());
        println!("clients ready in {} ({:.1} s)", dir.display(), t.elapsed().as_secs_f64());
        dir
    })
}

fn npm_bin(name: &str) -> PathBuf {
    clients().join("npm/node_modules/.bin").join(name)
}

/// A running `k3-decode serve` and the lines it logged.
struct Server {
    child: Child,
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start() -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_k3-decode"))
            .args(["serve", "--model"])
            .arg(root().join("tests/models/tiny-t"))
            .args(["--listen", &format!("127.0.0.1:{port}"), "--max-output-tokens", "24", "--max-context", "65536", "--prefill-chunk", "1024"])
            .env_remove("K3_API_KEY")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("k3-decode serve starts");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().unwrap();
        let l = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                l.lock().unwrap().push(line);
            }
        });
        let s = Server { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(120);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "the server did not listen within 120 s:\n{}", s.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        s
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// The server's Prometheus text (`GET /metrics`, plain HTTP/1.0).
    fn metrics(&self) -> String {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        c.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
        let mut text = String::new();
        c.read_to_string(&mut text).unwrap();
        text
    }

    /// Asserts that the server refused or failed no request so far (`k3_errors_total` by kind)
    /// and served at least one of `endpoint`.
    fn assert_served(&self, endpoint: &str, what: &str) {
        let text = self.metrics();
        let errors: Vec<&str> = text.lines().filter(|l| l.starts_with("k3_errors_total{") && !l.ends_with(" 0")).collect();
        assert!(errors.is_empty(), "{what}: the server answered errors: {errors:?}\nserver:\n{}", self.log());
        let served = text.lines().any(|l| l.starts_with(&format!("k3_requests_total{{endpoint=\"{endpoint}\"}}")) && !l.ends_with(" 0"));
        assert!(served, "{what}: no {endpoint} request reached the server\n{text}");
    }

    /// The server's `prefix:` lines (one per request).
    fn prefix_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().iter().filter(|l| l.contains("prefix: reused")).cloned().collect()
    }
}

/// Runs a client; its stdout (asserting success, with its output and the server's log).
fn run(cmd: &mut Command, what: &str, server: &Server) -> String {
    let t = Instant::now();
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{what} does not start: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    println!("{what}: {:.1} s, exit {}", t.elapsed().as_secs_f64(), out.status);
    assert!(out.status.success(), "{what} failed\nstdout:\n{stdout}\nstderr:\n{stderr}\nserver:\n{}", server.log());
    stdout
}

fn temp_home() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn claude_code_three_turns_reuse_the_prefix() {
    let claude = npm_bin("claude");
    let server = Server::start();
    let home = temp_home();
    let project = tempfile::tempdir().unwrap();
    let mut previous_prompt = 0u64;
    for (turn, prompt) in ["Say hello.", "What is 2+2?", "And 3+3?"].iter().enumerate() {
        let mut cmd = Command::new(&claude);
        cmd.current_dir(project.path())
            .env("HOME", home.path())
            .env("ANTHROPIC_BASE_URL", server.base())
            .env("ANTHROPIC_API_KEY", "unused")
            .env("ANTHROPIC_DEFAULT_HAIKU_MODEL", "tiny-t")
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .env("DISABLE_TELEMETRY", "1")
            .env("DISABLE_AUTOUPDATER", "1")
            .env("CLAUDE_CODE_ATTRIBUTION_HEADER", "0")
            .args(["-p", prompt, "--model", "tiny-t", "--output-format", "json", "--tools", "Bash"]);
        if turn > 0 {
            cmd.arg("--continue");
        }
        let out = run(&mut cmd, &format!("claude turn {}", turn + 1), &server);
        let v: Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("claude's JSON: {e}\n{out}"));
        assert_eq!(v["is_error"], false, "turn {}: {out}\nserver:\n{}", turn + 1, server.log());
        assert!(v["api_error_status"].is_null(), "{out}");
        let u = &v["usage"];
        let read = u["cache_read_input_tokens"].as_u64().unwrap();
        let prompt_tokens = u["input_tokens"].as_u64().unwrap() + read + u["cache_creation_input_tokens"].as_u64().unwrap();
        println!("claude turn {}: prompt {prompt_tokens} tokens, cache_read_input_tokens {read}, result {:?}", turn + 1, v["result"]);
        if turn > 0 {
            assert!(
                read as f64 >= 0.9 * previous_prompt as f64,
                "turn {}: {read} tokens reused of the previous prompt's {previous_prompt}\nserver:\n{}",
                turn + 1,
                server.log()
            );
        }
        previous_prompt = prompt_tokens;
    }
    server.assert_served("messages", "claude");
    let lines = server.prefix_lines();
    for l in &lines {
        println!("{l}");
    }
    assert!(lines.len() >= 3, "the server logs a prefix line per request:\n{}", server.log());
}

#[test]
fn codex_exec_completes_a_turn() {
    let codex = npm_bin("codex");
    let server = Server::start();
    let home = temp_home();
    std::fs::create_dir_all(home.path().join(".codex")).unwrap();
    std::fs::write(
        home.path().join(".codex/config.toml"),
        format!(
            "model = \"tiny-t\"\nmodel_provider = \"k3\"\n[model_providers.k3]\nname = \"k3-decode\"\nbase_url = \"{}/v1\"\nwire_api = \"responses\"\nenv_key = \"K3_CODEX_KEY\"\n",
            server.base()
        ),
    )
    .unwrap();
    let project = tempfile::tempdir().unwrap();
    let last = project.path().join("last.txt");
    let instructions = home.path().join("instructions.md");
    std::fs::write(&instructions, "You are a coding agent. Be brief.\n").unwrap();
    let mut cmd = Command::new(&codex);
    cmd.current_dir(project.path())
        .env("HOME", home.path())
        .env("K3_CODEX_KEY", "unused")
        .args(["exec", "--skip-git-repo-check"])
        // a shorter prompt: own instructions, no sub-agent, goal or web-search tools
        .arg("-c")
        .arg(format!("model_instructions_file={:?}", instructions.display().to_string()))
        .args(["-c", "features.multi_agent=false", "-c", "features.goals=false", "-c", "web_search=\"disabled\"", "-o"])
        .arg(&last)
        .arg("Say hello.");
    let out = run(&mut cmd, "codex exec", &server);
    let text = std::fs::read_to_string(&last).unwrap_or_default();
    println!("codex last message: {text:?}");
    assert!(!text.trim().is_empty(), "codex wrote no last message\n{out}\nserver:\n{}", server.log());
    server.assert_served("responses", "codex");
    assert!(!server.prefix_lines().is_empty());
}

#[test]
fn openai_sdk_responses_create() {
    let server = Server::start();
    let py = std::env::var_os("K3_PY_CLIENTS").map(PathBuf::from).unwrap_or_else(|| root().join(".deps/pyclients"));
    assert!(py.join("openai").is_dir(), "the openai SDK is not in {} (run scripts/setup.sh)", py.display());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_responses.py");
    let mut cmd = Command::new("python3");
    cmd.arg(&script).arg(server.base()).arg("tiny-t").env("PYTHONPATH", &py);
    let out = run(&mut cmd, "openai responses script", &server);
    println!("{out}");
    assert!(out.contains("ALL OK"));
}

#[test]
fn opencode_qwen_code_and_aider_complete_a_turn() {
    let server = Server::start();
    let project = tempfile::tempdir().unwrap();

    // OpenCode: a provider on the OpenAI-compatible package, `opencode run`.
    let home = temp_home();
    let cfg = home.path().join(".config/opencode");
    std::fs::create_dir_all(&cfg).unwrap();
    std::fs::write(
        cfg.join("opencode.json"),
        serde_json::json!({
            "provider": {"k3": {"npm": "@ai-sdk/openai-compatible", "name": "k3-decode",
                                "options": {"baseURL": format!("{}/v1", server.base()), "apiKey": "unused"},
                                "models": {"tiny-t": {"name": "tiny-t"}}}},
            "model": "k3/tiny-t", "small_model": "k3/tiny-t", "autoupdate": false, "share": "disabled",
            // a shorter prompt: the shell tool only, a one-line agent prompt
            "tools": {"*": false, "bash": true},
            "agent": {"build": {"prompt": "You are a coding agent. Be brief."}}
        })
        .to_string(),
    )
    .unwrap();
    let mut cmd = Command::new(npm_bin("opencode"));
    cmd.current_dir(project.path()).env("HOME", home.path()).args(["run", "Say hello.", "-m", "k3/tiny-t"]);
    let out = run(&mut cmd, "opencode run", &server);
    println!("opencode: {:?}", out.trim());
    assert!(!out.trim().is_empty() && !out.contains("APICallError"), "{out}");
    server.assert_served("chat_completions", "opencode");

    // Qwen Code: the OpenAI auth type from the environment, `qwen -p`; a shorter prompt (own
    // system prompt, fewer tools, no background memory extraction).
    let home = temp_home();
    std::fs::create_dir_all(home.path().join(".qwen")).unwrap();
    std::fs::write(
        home.path().join(".qwen/settings.json"),
        serde_json::json!({
            "tools": {"core": ["run_shell_command"], "exclude": ["agent", "get_goal", "list_agents", "skill", "tool_call", "tool_search", "update_goal"]},
            "memory": {"enableManagedAutoMemory": false}
        })
        .to_string(),
    )
    .unwrap();
    std::fs::write(home.path().join("system.md"), "You are a coding agent. Be brief.\n").unwrap();
    let mut cmd = Command::new(npm_bin("qwen"));
    cmd.current_dir(project.path())
        .env("HOME", home.path())
        .env("QWEN_SYSTEM_MD", home.path().join("system.md"))
        .env("OPENAI_BASE_URL", format!("{}/v1", server.base()))
        .env("OPENAI_API_KEY", "unused")
        .env("OPENAI_MODEL", "tiny-t")
        .args(["-p", "Say hello.", "--auth-type", "openai"]);
    let out = run(&mut cmd, "qwen -p", &server);
    println!("qwen: {:?}", out.trim());
    assert!(!out.trim().is_empty() && !out.contains("API Error"), "{out}");
    server.assert_served("chat_completions", "qwen");

    // aider: an `openai/` model on the server's base URL, one `--message`.
    let home = temp_home();
    let mut cmd = Command::new(clients().join("aider/bin/aider"));
    cmd.current_dir(project.path())
        .env("HOME", home.path())
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .args(["--model", "openai/tiny-t", "--openai-api-base", &format!("{}/v1", server.base()), "--openai-api-key", "unused"])
        .args(["--message", "Say hello.", "--yes-always", "--no-git", "--no-check-update", "--no-show-model-warnings", "--analytics-disable", "--no-pretty"]);
    let out = run(&mut cmd, "aider --message", &server);
    println!("aider: {:?}", out.lines().last());
    assert!(out.contains("Tokens:"), "aider reports the tokens of a completed turn:\n{out}");
    assert!(!out.contains("litellm.") && !out.contains("APIError"), "{out}");
    server.assert_served("chat_completions", "aider");
    assert!(server.prefix_lines().len() >= 3);
}
