//! The server driven by the official client libraries (the `openai` and `anthropic` Python
//! SDKs, installed by scripts/setup.sh into .deps/pyclients) on the MLX engine and a
//! random-weight synthetic model: tests/clients/openai_sdk.py checks chat, streaming,
//! constrained decoding (json_schema and a forced named tool 20/20, json_object), tool_choice
//! handling and `n` > 1; tests/clients/anthropic_sdk.py the Messages API (plain, streamed,
//! thinking on/off, a forced tool 20/20, count_tokens, errors).
#![cfg(feature = "mlx")]

use std::path::PathBuf;
use std::process::Command;

mod support;

/// Where scripts/setup.sh installed the client libraries.
fn py_clients() -> PathBuf {
    let dir = std::env::var_os("K3_PY_CLIENTS").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.deps/pyclients"));
    assert!(
        dir.join("openai").is_dir() && dir.join("anthropic").is_dir(),
        "the openai and anthropic Python SDKs are not in {} (run scripts/setup.sh)",
        dir.display()
    );
    dir
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// A server on a fresh random-weight Tiny model: its base URL and the model directory (kept
/// alive by the returned guard).
async fn serve_tiny() -> (String, tempfile::TempDir) {
    let dir = support::tiny_model(None);
    let base = format!("http://{}", support::serve(support::mlx_state(dir.path())).await);
    (base, dir)
}

/// Runs tests/clients/<script> against `base`; its stdout (asserting it ended with ALL OK).
async fn run_script(script: &str, base: &str) -> String {
    let clients = py_clients();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients").join(script);
    let b = base.to_string();
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3").arg(&script).arg(&b).arg("tiny").env("PYTHONPATH", &clients).output().expect("python3 runs")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{stdout}");
    assert!(out.status.success(), "the script failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("ALL OK"));
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sdk_against_the_server() {
    let (base, _dir) = serve_tiny().await;
    run_script("openai_sdk.py", &base).await;
    let text = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    let mask = metric(&text, "k3_constraint_mask_seconds_total");
    let decode = metric(&text, "k3_decode_seconds_total");
    println!("constrained-decoding masks: {mask:.3} s of {decode:.3} s decode ({:.1} %)", 100.0 * mask / decode.max(1e-9));
    assert!(mask > 0.0, "constrained requests computed masks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_sdk_against_the_server() {
    let (base, _dir) = serve_tiny().await;
    run_script("anthropic_sdk.py", &base).await;
    let text = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    assert!(metric(&text, "k3_constraint_mask_seconds_total") > 0.0, "forced tools were constrained");
}
