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
    for (field, value) in [("num_hidden_layers", 1_000_000_000u64), ("num_experts", 1_000_000_000), ("hidden_size", 1 << 40), ("vocab_size", 1 << 40)] {
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
    let e =
        within(20, "opening a checkpoint with a FIFO shard", move || Checkpoint::open(&d).err().map(|e| e.to_string())).expect("a FIFO shard must not open");
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
    while !hb.len().is_multiple_of(8) {
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

// ---- weight identity: the fingerprint is checked against the bytes it names ---------------

fn synth_tiny(dir: &Path, seed: u64) {
    let mut o = SynthOptions::new(Preset::Tiny);
    o.seed = seed;
    o.tokenizer = false;
    write_model(dir, &o).unwrap();
}

/// Flips one byte of `tensor` in its shard, keeping the file's size and mtime (so the digest
/// cache, keyed by both, still looks current).
fn edit_in_place(dir: &Path, tensor: &str) {
    let ck = Checkpoint::open(dir).unwrap();
    let e = ck.entry(tensor).unwrap().clone();
    let path = dir.join(ck.shard_name(e.shard));
    drop(ck);
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[e.start] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    std::fs::File::options().write(true).open(&path).unwrap().set_modified(mtime).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), mtime);
}

const LAYER1: &str = "language_model.model.layers.1.input_layernorm.weight";
const EMBED: &str = "language_model.model.embed_tokens.weight";

#[test]
fn a_shard_edited_in_place_fails_verification_and_its_digest_cache_is_rebuilt() {
    for (tensor, layer) in [(LAYER1, Some(1)), (EMBED, None)] {
        let d = tempfile::tempdir().unwrap();
        synth_tiny(d.path(), 1);
        let original = Checkpoint::open(d.path()).unwrap().fingerprint(); // hashed, cached
        let cache = d.path().join(k3_protocol::fingerprint::DIGEST_FILE);
        assert!(cache.exists());
        edit_in_place(d.path(), tensor);
        let ck = Checkpoint::open(d.path()).unwrap();
        assert_eq!(ck.fingerprint(), original, "size and mtime kept: the cache is read");
        let e = match layer {
            Some(l) => ck.verify_layer(l).unwrap_err().to_string(),
            None => ck.verify_outside_layers().unwrap_err().to_string(),
        };
        assert!(e.contains(tensor) && e.contains("differ from the weight digest"), "{e}");
        assert!(ck.verify_all().is_err());
        assert!(!cache.exists(), "the digest cache that does not match was not deleted");
        drop(ck);
        let again = Checkpoint::open(d.path()).unwrap();
        assert_ne!(again.fingerprint(), original, "{tensor}: rehashed, the edited checkpoint has its own fingerprint");
        again.verify_all().unwrap();
    }
}

#[test]
fn a_forged_digest_cache_is_refused_even_with_the_real_crcs() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    synth_tiny(a.path(), 1);
    synth_tiny(b.path(), 2);
    let ca = Checkpoint::open(a.path()).unwrap();
    let cb = Checkpoint::open(b.path()).unwrap();
    let (fa, fb) = (ca.fingerprint(), cb.fingerprint());
    assert_ne!(fa, fb);
    // B's cache replaced by A's digest, with B's shard stamps and B's real CRCs: every check of
    // the cache's keys and every CRC agree with B's bytes; only the SHA-256 values are A's.
    let mut forged = ca.weight_digest().clone();
    forged.shards = cb.weight_digest().shards.clone();
    for (name, t) in forged.tensors.iter_mut() {
        t.crc32c = cb.weight_digest().tensors[name].crc32c;
    }
    drop((ca, cb));
    let cache = b.path().join(k3_protocol::fingerprint::DIGEST_FILE);
    std::fs::write(&cache, serde_json::to_vec(&forged).unwrap()).unwrap();
    let ck = Checkpoint::open(b.path()).unwrap();
    assert_eq!(ck.fingerprint(), fa, "the forged cache is what the fingerprint is made from");
    let e = ck.verify_all().unwrap_err().to_string();
    assert!(e.contains("differ from the weight digest"), "{e}");
    assert!(!cache.exists());
    drop(ck);
    let again = Checkpoint::open(b.path()).unwrap();
    assert_eq!(again.fingerprint(), fb, "rebuilt from the bytes: B's own fingerprint");
    again.verify_all().unwrap();
}
