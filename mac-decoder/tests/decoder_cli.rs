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
