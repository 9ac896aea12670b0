//! Hostile and careless files (issue 21): sizes that would exhaust memory, non-regular files
//! where a shard should be, damaged session files. Each must be a clean error naming the cause,
//! quickly, never an abort or a hang.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use k3_protocol::config::ConfigError;
use k3_protocol::handoff::{load_session, save_session, HandoffState, LayerState};
use k3_protocol::synth::{write_model, Preset, SynthOptions};
use k3_protocol::testdata::golden_dir;
use k3_protocol::{Checkpoint, K3Config};
use serde_json::Value;

fn tiny_config_json() -> Value {
    serde_json::from_slice(&std::fs::read(golden_dir("tiny-a").join("config.json")).unwrap()).unwrap()
}

/// Runs `f` on a thread; panics if it does not finish within `secs` (a hang is a failure).
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).unwrap_or_else(|_| panic!("{what}: no answer within {secs} s (hangs)"))
}

#[test]
fn a_billion_layers_is_a_clean_config_error() {
    for (field, value) in [
        ("num_hidden_layers", 1_000_000_000u64),
        ("num_experts", 1_000_000_000),
        ("hidden_size", 1 << 40),
        ("vocab_size", 1 << 40),
    ] {
        let mut cfg = tiny_config_json();
        cfg["text_config"][field] = value.into();
        match K3Config::from_json(&cfg.to_string()) {
            Err(ConfigError::Invalid(msg)) => {
                assert!(msg.contains(field) && msg.contains("exceeds the supported maximum"), "{field}: {msg}")
            }
            other => panic!("{field} = {value}: expected an Invalid config error, got {other:?}"),
        }
    }
    let mut cfg = tiny_config_json();
    cfg["vision_config"]["init_pos_emb_height"] = 1_000_000_000u64.into();
    let e = K3Config::from_json(&cfg.to_string()).unwrap_err().to_string();
    assert!(e.contains("vision_config.init_pos_emb_height"), "{e}");
}

fn tiny_model(dir: &Path) -> Vec<String> {
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.max_shard_bytes = 1_000_000;
    opts.tokenizer = false;
    write_model(dir, &opts).unwrap().shards
}

fn mkfifo(path: &Path) {
    let st = std::process::Command::new("mkfifo").arg(path).status().expect("mkfifo runs");
    assert!(st.success(), "mkfifo {}", path.display());
}

#[cfg(unix)]
#[test]
fn a_fifo_in_place_of_a_shard_or_config_is_refused_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let shards = tiny_model(dir.path());
    let victim = dir.path().join(&shards[1]);
    std::fs::remove_file(&victim).unwrap();
    mkfifo(&victim);
    let d = dir.path().to_path_buf();
    let e = within(20, "opening a checkpoint with a FIFO shard", move || Checkpoint::open(&d).err().map(|e| e.to_string()))
        .expect("a FIFO shard must not open");
    assert!(e.contains(&shards[1]) && e.contains("FIFO"), "{e}");

    // A directory where a shard should be, and a FIFO as config.json and as the index.
    std::fs::remove_file(&victim).unwrap();
    std::fs::create_dir(&victim).unwrap();
    let e = Checkpoint::open(dir.path()).err().expect("a directory shard must not open").to_string();
    assert!(e.contains("a directory"), "{e}");
    for name in ["model.safetensors.index.json", "config.json"] {
        let dir = tempfile::tempdir().unwrap();
        tiny_model(dir.path());
        std::fs::remove_file(dir.path().join(name)).unwrap();
        mkfifo(&dir.path().join(name));
        let d = dir.path().to_path_buf();
        let e = within(20, name, move || Checkpoint::open(&d).err().map(|e| e.to_string())).expect("must not open");
        assert!(e.contains(name) && e.contains("FIFO"), "{name}: {e}");
    }
}

fn golden_state() -> (K3Config, HandoffState) {
    let cfg = K3Config::load(&golden_dir("tiny-a")).unwrap();
    let st = load_session(&golden_dir("tiny-a").join("golden.safetensors"), &cfg.text_config).unwrap().state;
    (cfg, st)
}

/// Rewrites one metadata entry of a safetensors file in place (header re-serialised).
fn edit_metadata(path: &Path, key: &str, value: &str) {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Map<String, Value> = serde_json::from_slice(&b[8..8 + n]).unwrap();
    h.get_mut("__metadata__").unwrap()[key] = value.into();
    let mut hb = serde_json::to_vec(&h).unwrap();
    while hb.len() % 8 != 0 {
        hb.push(b' ');
    }
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&hb);
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(path, out).unwrap();
}

#[test]
fn session_files_carry_a_checksum_and_refuse_damage() {
    let (cfg, st) = golden_state();
    assert!(st.layers.iter().any(|l| matches!(l, LayerState::Mla(_))));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.safetensors");
    save_session(&path, &st, None, &[]).unwrap();
    assert_eq!(load_session(&path, &cfg.text_config).unwrap().state, st, "an intact file loads back");

    // One flipped bit in the last data byte (an MLA latent row or a KDA state).
    let mut b = std::fs::read(&path).unwrap();
    let last = b.len() - 3;
    b[last] ^= 0x10;
    let bad = dir.path().join("flipped.safetensors");
    std::fs::write(&bad, &b).unwrap();
    let e = load_session(&bad, &cfg.text_config).err().expect("a flipped bit must be found").to_string();
    assert!(e.contains("checksum mismatch"), "{e}");

    // tokens: -5 (and other non-counts) are refused, not replaced by the row count.
    for v in ["-5", "many", ""] {
        let p = dir.path().join("tokens.safetensors");
        std::fs::copy(&path, &p).unwrap();
        edit_metadata(&p, "tokens", v);
        let e = load_session(&p, &cfg.text_config).err().unwrap_or_else(|| panic!("tokens = {v:?} accepted")).to_string();
        assert!(e.contains("tokens"), "{v}: {e}");
    }
    // A changed token count with the old checksum is damage too.
    let p = dir.path().join("count.safetensors");
    std::fs::copy(&path, &p).unwrap();
    edit_metadata(&p, "tokens", &(st.tokens + 1).to_string());
    assert!(load_session(&p, &cfg.text_config).is_err());

    // A FIFO as the session file is refused at once.
    let fifo = dir.path().join("fifo.safetensors");
    mkfifo(&fifo);
    let tc = cfg.text_config.clone();
    let e = within(20, "session FIFO", move || load_session(&fifo, &tc).err().map(|e| e.to_string())).expect("must not load");
    assert!(e.contains("FIFO"), "{e}");
}
