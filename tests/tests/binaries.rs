//! The real binaries, as the demo drives them: `k3-prefill serve` on loopback and
//! `k3-decode generate --prefill-node` (two turns, then two decoders at once), compared with
//! local runs; a decoder that is not paired falls back locally with a message saying so; and
//! SIGTERM ends `serve` within 5 s while a long pass computes.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k3_e2e_tests::*;

/// Builds (if needed) and returns `k3-prefill` and `k3-decode` of this workspace.
fn binaries() -> (PathBuf, PathBuf) {
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        let cargo = option_env!("CARGO").unwrap_or("cargo");
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--bins", "-p", "cuda-prefiller", "-p", "mac-decoder"]).current_dir(env!("CARGO_MANIFEST_DIR"));
        // The variables cargo sets for this test process would make the build look different
        // (ring's build script tracks CARGO_MANIFEST_DIR) and rebuild everything every time.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().into_owned();
            if (k.starts_with("CARGO_") && k != "CARGO_HOME" && k != "CARGO_TARGET_DIR") || k == "OUT_DIR" {
                cmd.env_remove(k);
            }
        }
        let status = cmd.status().expect("running cargo build");
        assert!(status.success(), "cargo build of the binaries failed");
    });
    let (p, d) = (workspace_binary("k3-prefill"), workspace_binary("k3-decode"));
    assert!(p.exists() && d.exists(), "{} / {} missing", p.display(), d.display());
    (p, d)
}

/// A running `k3-prefill serve`, killed on drop; its stderr is kept.
struct Server {
    child: Child,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(model: &Path, config_dir: &Path) -> Server {
    let (prefill, _) = binaries();
    let mut child = Command::new(prefill)
        .args(["serve", "--model"])
        .arg(model)
        .args(["--listen", "127.0.0.1:0", "--backend", "auto", "--insecure-dev", "--config-dir"])
        .arg(config_dir)
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("starting k3-prefill serve");
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = mpsc::channel();
    let l = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("k3-prefill: serving on ") {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            }
            l.lock().unwrap().push_str(&line);
            l.lock().unwrap().push('\n');
        }
    });
    let addr = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(a) => a,
        Err(_) => {
            let _ = child.kill();
            panic!("k3-prefill serve did not start:\n{}", log.lock().unwrap());
        }
    };
    Server { child, addr, log }
}

fn write_ids(dir: &Path, name: &str, ids: &[u32]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string(ids).unwrap()).unwrap();
    p
}

/// Runs `k3-decode generate` with `args`; returns (stdout JSON, stderr).
fn generate(model: &Path, args: &[&str]) -> (serde_json::Value, String) {
    let (_, decode) = binaries();
    let out = Command::new(decode)
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--greedy", "--max-new-tokens", "8"])
        .args(args)
        .env("RUST_LOG", "info")
        .output()
        .expect("running k3-decode generate");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "k3-decode generate failed:\n{stderr}");
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}", String::from_utf8_lossy(&out.stdout)));
    (json, stderr)
}

fn turns(v: &serde_json::Value) -> Vec<Vec<u64>> {
    serde_json::from_value(v["turns"].clone()).expect("a turns array")
}

#[test]
fn serve_and_generate_binaries_match_local() {
    init_tracing();
    let model = golden_dir("tiny-a");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("config");
    let p1 = write_ids(tmp.path(), "t1.json", &prompt(301, 260, 1000));
    let p2 = write_ids(tmp.path(), "t2.json", &prompt(302, 50, 1000));
    let p1s = p1.to_str().unwrap();
    let p2s = p2.to_str().unwrap();
    let server = serve(&model, &cfg);
    let timing = tmp.path().join("timing.json");
    let cfgs = cfg.to_str().unwrap();
    let common = ["--input-ids", p1s, "--next-turn", p2s, "--config-dir", cfgs];

    // Two turns through the node.
    let mut args = common.to_vec();
    args.extend(["--prefill-node", &server.addr, "--insecure-dev", "--remote-min-tokens", "32", "--timing-json", timing.to_str().unwrap()]);
    let (remote, stderr) = generate(&model, &args);
    let t: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&timing).unwrap()).unwrap();
    assert_eq!(t.len(), 2);
    for (i, turn) in t.iter().enumerate() {
        assert_eq!(turn["route"], "remote", "turn {}: {}\n{stderr}", i + 1, turn["reason"]);
    }
    assert_eq!(t[1]["prefill_tokens"], 8 + 50, "turn 2 prefills only the generated tokens and its prompt");
    assert!(stderr.contains("exposed") || stderr.contains("tail"), "no timing table:\n{stderr}");
    assert!(stderr.contains("remote") && stderr.contains("1st tok"), "no timing table:\n{stderr}");

    // The same conversation, local only.
    let (local, _) = generate(&model, &common);
    assert_eq!(turns(&remote), turns(&local), "remote and local conversations differ");
    assert_eq!(remote["tokens"], local["tokens"]);

    // One turn, the plain contract: {"tokens": [...]} only.
    let (one, _) = generate(&model, &["--input-ids", p1s, "--prefill-node", &server.addr, "--insecure-dev", "--remote-min-tokens", "1", "--config-dir", cfgs]);
    assert_eq!(one.as_object().unwrap().len(), 1, "{one}");
    assert_eq!(one["tokens"], turns(&local)[0].iter().map(|&x| serde_json::json!(x)).collect::<serde_json::Value>());

    // Two decoders at once.
    let handles: Vec<_> = (0..2)
        .map(|d| {
            let ids = prompt(400 + d, 200 + 30 * d as usize, 1000);
            let path = write_ids(tmp.path(), &format!("d{d}.json"), &ids);
            let (model, addr, cfgs) = (model.clone(), server.addr.clone(), cfgs.to_string());
            std::thread::spawn(move || {
                let p = path.to_str().unwrap().to_string();
                let (v, e) =
                    generate(&model, &["--input-ids", &p, "--prefill-node", &addr, "--insecure-dev", "--remote-min-tokens", "1", "--config-dir", &cfgs]);
                assert!(e.contains("remote prefill ingested"), "decoder {d} did not use the node:\n{e}");
                (ids, v)
            })
        })
        .collect();
    let engine = mac_decoder::decode::Engine::load(&model).unwrap();
    for h in handles {
        let (ids, v) = h.join().unwrap();
        let want = local_greedy(&engine, &ids, 8).0;
        let got: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
        assert_eq!(got, want, "a concurrent decoder got other tokens");
    }
    // The node logs each request once the decoder has all of it.
    let t0 = std::time::Instant::now();
    loop {
        let log = server.log.lock().unwrap().clone();
        let n = log.matches("prefill done").count();
        if n == 5 {
            break;
        }
        assert!(n < 5 && t0.elapsed() < Duration::from_secs(10), "{n} requests done, expected 5; server log:\n{log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn unpaired_decoder_falls_back_with_a_reason() {
    init_tracing();
    let model = golden_dir("tiny-a");
    let tmp = tempfile::tempdir().unwrap();
    let p = write_ids(tmp.path(), "p.json", &prompt(501, 120, 1000));
    let cfg = tmp.path().join("decoder-config");
    let (v, stderr) = generate(
        &model,
        &["--input-ids", p.to_str().unwrap(), "--prefill-node", "127.0.0.1:9", "--remote-min-tokens", "1", "--config-dir", cfg.to_str().unwrap()],
    );
    assert!(stderr.contains("no prefill node is paired"), "{stderr}");
    assert!(stderr.contains("fallback"), "{stderr}");
    let engine = mac_decoder::decode::Engine::load(&model).unwrap();
    let got: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(got, local_greedy(&engine, &prompt(501, 120, 1000), 8).0);
}

/// Issue 19: decoder ranks fed by a prefill node. `k3-decode launch --ranks N -- generate
/// --prefill-node` (every rank asks the node and ingests its hand-off) prints the tokens of a
/// single local process, for 2 and 4 ranks.
#[test]
fn decoder_ranks_decode_a_prefill_nodes_handoff() {
    init_tracing();
    let model = golden_dir("tiny-a");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("config");
    let cfgs = cfg.to_str().unwrap();
    let p = write_ids(tmp.path(), "p.json", &prompt(303, 120, 1000));
    let ps = p.to_str().unwrap();
    let server = serve(&model, &cfg);
    let (local, _) = generate(&model, &["--input-ids", ps]);
    let (_, decode) = binaries();
    for n in [2usize, 4] {
        let out = Command::new(&decode)
            .args(["launch", "--ranks", &n.to_string(), "--step-timeout", "20", "--", "generate", "--model"])
            .arg(&model)
            .args(["--greedy", "--max-new-tokens", "8", "--input-ids", ps, "--prefill-node", &server.addr, "--insecure-dev"])
            .args(["--remote-min-tokens", "1", "--config-dir", cfgs])
            .env("RUST_LOG", "info")
            .output()
            .expect("running k3-decode launch");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "launch --ranks {n} failed:\n{stderr}");
        assert_eq!(stderr.matches("remote prefill ingested").count(), n, "every rank ingests the node's hand-off:\n{stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["tokens"], local["tokens"], "{n} ranks from the node's hand-off vs one local process");
    }
}

/// SIGTERM used to leave `k3-prefill serve` computing until its pass ended (minutes for a long
/// prompt: SIGKILL was needed). Now the node abandons the pass in flight before its next token
/// chunk and exits within 5 s. Here a 300,000-token prompt (a layer takes tens of seconds on the
/// CPU backend) is computing when the signal comes.
#[test]
fn sigterm_ends_serve_within_five_seconds_while_a_long_pass_computes() {
    use k3_protocol::transport::{NodeConfig, NodeIdentity, PeerAuth, PrefillClient, TransferEvent};
    use k3_protocol::wire::{PrefillOptions, PrefillRequest, SessionId, StateLayout};
    init_tracing();
    let model = golden_dir("tiny-a");
    let tmp = tempfile::tempdir().unwrap();
    let mut server = serve(&model, &tmp.path().join("config"));
    let addr: std::net::SocketAddr = server.addr.parse().unwrap();
    let c = k3_protocol::Checkpoint::open(&model).unwrap().config().text_config.clone();
    let cfg = NodeConfig::new(NodeIdentity::generate().unwrap(), PeerAuth::InsecureDev, fingerprint_of(&model), "mlx");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let n = 300_000;
    // The transfer stays open (in a task) until the end: the node must not wait for its decoder.
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let held = rt.spawn(async move {
        let mut client = PrefillClient::connect(addr, cfg).await.expect("connect");
        let request = PrefillRequest {
            session: SessionId::random(),
            base: None,
            tokens: prompt(11, n, 1000),
            image_embeddings: None,
            options: PrefillOptions { keep_session: true, return_last_logits: true, ..PrefillOptions::default() },
        };
        let mut t = client.prefill(request, &StateLayout::for_model(&c, n)).await.expect("accepted");
        match t.next().await.expect("transfer") {
            Some(TransferEvent::Progress(p)) if p.layers_done == 0 => started_tx.send(()).unwrap(),
            other => panic!("expected the start first: {other:?}"),
        }
        let _ = release_rx.await;
    });
    started_rx.recv_timeout(Duration::from_secs(60)).expect("the node started the prompt");
    std::thread::sleep(Duration::from_secs(1));
    let pid = server.child.id().to_string();
    let t0 = std::time::Instant::now();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "k3-prefill serve still runs 5 s after SIGTERM; log:\n{}", server.log.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    eprintln!("k3-prefill serve exited {:.2} s after SIGTERM ({status})", took.as_secs_f64());
    std::thread::sleep(Duration::from_millis(200)); // the log reader catches up
    let log = server.log.lock().unwrap().clone();
    assert!(status.success(), "exit status {status}; log:\n{log}");
    assert!(log.contains("terminated; shutting down") && log.contains("prefill node stopped"), "{log}");
    let _ = release_tx.send(());
    let _ = rt.block_on(held);
}

/// Weight identity across the two binaries: a checkpoint whose shard was edited in place
/// (size and mtime kept, so its digest cache still looks current) is refused by
/// `k3-prefill forward`; run again, forward hashes the weights afresh and labels the state with
/// the edited checkpoint's true fingerprint, which `k3-decode generate --state` on the
/// original checkpoint refuses. Before, the state carried the original fingerprint and the
/// decoder took it (other tokens).
#[test]
fn a_state_from_edited_weights_is_not_taken_for_the_original_model() {
    let (prefill, decode) = binaries();
    let a = synth(1, |_| {});
    let b = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(a.path()).unwrap().flatten() {
        if !e.file_name().to_string_lossy().starts_with('.') {
            std::fs::copy(e.path(), b.path().join(e.file_name())).unwrap();
        }
    }
    let fa = fingerprint_of(a.path());
    assert_eq!(fingerprint_of(b.path()), fa, "the copy hashes to the same fingerprint (its digest is cached now)");
    let name = "language_model.model.layers.2.input_layernorm.weight";
    let (path, at) = {
        let ck = k3_protocol::Checkpoint::open(b.path()).unwrap();
        let e = ck.entry(name).unwrap().clone();
        (b.path().join(ck.shard_name(e.shard)), e.start)
    };
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    std::fs::File::options().write(true).open(&path).unwrap().set_modified(mtime).unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let ids = write_ids(tmp.path(), "ids.json", &[3, 17, 250, 9, 44, 100]);
    let forward = |model: &Path, out: &Path| {
        Command::new(&prefill).args(["forward", "--backend", "cpu", "--model"]).arg(model).arg("--input-ids").arg(&ids).arg("--out").arg(out).output().unwrap()
    };
    let state_b = tmp.path().join("b.safetensors");
    let o = forward(b.path(), &state_b);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(name) && err.contains("differ from the weight digest"), "forward used the edited weights:\n{err}");
    assert!(!state_b.exists());
    let o = forward(b.path(), &state_b);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let fb = fingerprint_of(b.path());
    assert_ne!(fb, fa);

    let run = |state: &Path| {
        Command::new(&decode).args(["generate", "--greedy", "--max-new-tokens", "4", "--model"]).arg(a.path()).arg("--state").arg(state).output().unwrap()
    };
    let o = run(&state_b);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the decoder took a state of other weights:\n{err}");
    assert!(err.contains(&fb.hex()[..16]) || err.contains(&fb.hex()), "the refusal names the state's model:\n{err}");
    // the original checkpoint's own state is taken
    let state_a = tmp.path().join("a.safetensors");
    assert!(forward(a.path(), &state_a).status.success());
    let o = run(&state_a);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
