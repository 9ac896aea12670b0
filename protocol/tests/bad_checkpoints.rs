//! Bad input to the checkpoint loader: each case gives its expected error, naming the cause
//! (shard, tensor, field), and nothing panics. The checkpoints are synthetic tiny models
//! written into temp dirs and then damaged.

use std::path::{Path, PathBuf};

use k3_protocol::checkpoint::CheckpointError;
use k3_protocol::config::ConfigError;
use k3_protocol::synth::{write_model, Preset, SynthOptions};
use k3_protocol::{Checkpoint, K3Config};
use serde_json::{json, Value};

/// A tiny synthetic model in several shards.
fn tiny(dir: &Path) -> Vec<String> {
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.max_shard_bytes = 1_000_000;
    opts.tokenizer = false;
    let rep = write_model(dir, &opts).unwrap();
    assert!(rep.shards.len() >= 3);
    rep.shards
}

fn err(dir: &Path) -> CheckpointError {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("{} opened, but it is damaged", dir.display()),
        Err(e) => e,
    }
}

fn problems(dir: &Path) -> Vec<String> {
    match err(dir) {
        CheckpointError::Invalid { problems, .. } => problems,
        e => panic!("expected a list of problems, got: {e}"),
    }
}

/// The shard holding `tensor`, from the index.
fn shard_of(dir: &Path, tensor: &str) -> PathBuf {
    let index: Value = serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    dir.join(index["weight_map"][tensor].as_str().unwrap())
}

fn read_shard(path: &Path) -> (serde_json::Map<String, Value>, Vec<u8>) {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&b[8..8 + n]).unwrap(), b[8 + n..].to_vec())
}

fn write_shard(path: &Path, header: &serde_json::Map<String, Value>, data: &[u8]) {
    let h = serde_json::to_vec(header).unwrap();
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(&h);
    b.extend_from_slice(data);
    std::fs::write(path, b).unwrap();
}

/// Edits the header entry of `tensor` in its shard.
fn edit_entry(dir: &Path, tensor: &str, f: impl FnOnce(&mut Value)) {
    let path = shard_of(dir, tensor);
    let (mut h, data) = read_shard(&path);
    f(h.get_mut(tensor).unwrap());
    write_shard(&path, &h, &data);
}

fn edit_index(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("model.safetensors.index.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

const NORM: &str = "language_model.model.layers.2.input_layernorm.weight";

#[test]
fn intact_tiny_opens() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    assert!(Checkpoint::open(d.path()).unwrap().validate().unwrap().is_empty());
}

#[test]
fn missing_shard() {
    let d = tempfile::tempdir().unwrap();
    let shards = tiny(d.path());
    std::fs::remove_file(d.path().join(&shards[1])).unwrap();
    match err(d.path()) {
        CheckpointError::Shard { shard, msg } => {
            assert_eq!(shard, shards[1]);
            assert!(msg.contains("missing"), "{msg}");
        }
        e => panic!("expected a shard error, got: {e}"),
    }
}

#[test]
fn truncated_shard() {
    let d = tempfile::tempdir().unwrap();
    let shards = tiny(d.path());
    let p = d.path().join(&shards[0]);
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(len - 100).unwrap();
    let ps = problems(d.path());
    assert!(!ps.is_empty());
    assert!(ps.iter().all(|p| p.contains(&shards[0]) && p.contains("truncated shard")), "{ps:#?}");
}

#[test]
fn shard_truncated_inside_its_header() {
    let d = tempfile::tempdir().unwrap();
    let shards = tiny(d.path());
    for len in [3u64, 200] {
        let p = d.path().join(&shards[2]);
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(len).unwrap();
        match err(d.path()) {
            CheckpointError::Shard { shard, msg } => {
                assert_eq!(shard, shards[2]);
                assert!(msg.contains("too short") || msg.contains("truncated"), "{msg}");
            }
            e => panic!("expected a shard error, got: {e}"),
        }
    }
}

#[test]
fn tensor_with_a_wrong_shape() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    edit_entry(d.path(), NORM, |e| e["shape"] = json!([64, 2]));
    let ps = problems(d.path());
    assert_eq!(ps.len(), 1, "{ps:#?}");
    let shard = shard_of(d.path(), NORM).file_name().unwrap().to_string_lossy().into_owned();
    assert!(ps[0].contains(NORM) && ps[0].contains(&shard), "{}", ps[0]);
    assert!(ps[0].contains("expected [128] BF16, found [64, 2] BF16"), "{}", ps[0]);
}

#[test]
fn tensor_with_a_wrong_dtype() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    // Same bytes read as 64 F32 values.
    edit_entry(d.path(), NORM, |e| {
        e["dtype"] = json!("F32");
        e["shape"] = json!([64]);
    });
    let ps = problems(d.path());
    assert_eq!(ps.len(), 1, "{ps:#?}");
    assert!(ps[0].contains(NORM) && ps[0].contains("expected [128] BF16, found [64] F32"), "{}", ps[0]);
    // A dtype the checkpoint never uses.
    edit_entry(d.path(), NORM, |e| {
        e["dtype"] = json!("F16");
        e["shape"] = json!([128]);
    });
    let ps = problems(d.path());
    assert!(ps.iter().any(|p| p.contains(NORM) && p.contains("unsupported dtype F16")), "{ps:#?}");
}

#[test]
fn data_offsets_that_disagree_with_the_shape() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    edit_entry(d.path(), NORM, |e| e["shape"] = json!([100]));
    let ps = problems(d.path());
    assert!(ps.iter().any(|p| p.contains(NORM) && p.contains("do not match shape")), "{ps:#?}");
}

#[test]
fn hostile_sizes_do_not_overflow() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    edit_entry(d.path(), NORM, |e| e["shape"] = json!([1u64 << 40, 1u64 << 40]));
    assert!(problems(d.path()).iter().any(|p| p.contains(NORM)));
    edit_entry(d.path(), NORM, |e| {
        e["shape"] = json!([usize::MAX / 2]);
        e["data_offsets"] = json!([0, usize::MAX - 1]);
    });
    assert!(problems(d.path()).iter().any(|p| p.contains(NORM)));
}

#[test]
fn missing_tensor() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    let name = "language_model.model.layers.4.block_sparse_moe.experts.3.w2.weight_scale";
    let path = shard_of(d.path(), name);
    let (mut h, data) = read_shard(&path);
    h.remove(name);
    write_shard(&path, &h, &data);
    // Still in the index: reported as absent from its shard.
    let ps = problems(d.path());
    assert!(ps.iter().any(|p| p.contains(name) && p.contains("absent from that shard")), "{ps:#?}");
    // Gone from the index too: reported as missing, with the expected shape.
    edit_index(d.path(), |v| {
        v["weight_map"].as_object_mut().unwrap().remove(name);
    });
    // (its bytes, still in the shard, belong to no tensor now: a hole, also reported)
    let ps = problems(d.path());
    assert_eq!(ps[0], format!("{name}: missing (expected [64, 2] U8)"));
    assert!(ps.len() == 2 && ps[1].contains("belong to no tensor"), "{ps:#?}");
}

#[test]
fn extra_unknown_tensor_is_a_warning() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    let extra = "language_model.model.layers.0.self_attn.rotary_emb.inv_freq";
    let path = shard_of(d.path(), NORM);
    let (mut h, mut data) = read_shard(&path);
    let end = data.len();
    data.extend_from_slice(&[0u8; 16]);
    h.insert(extra.into(), json!({"dtype": "F32", "shape": [4], "data_offsets": [end, end + 16]}));
    write_shard(&path, &h, &data);
    let file = path.file_name().unwrap().to_string_lossy().into_owned();
    edit_index(d.path(), |v| v["weight_map"][extra] = json!(file));
    let ck = Checkpoint::open(d.path()).expect("an unknown tensor is not an error");
    let warnings = ck.validate().unwrap();
    assert_eq!(warnings, vec![format!("{extra} in {file}: unknown tensor, ignored")]);
    // The known tensors still read correctly.
    assert_eq!(ck.tensor(NORM).unwrap().to_f32().unwrap().len(), 128);
}

#[test]
fn tensor_in_another_shard_than_the_index_says() {
    let d = tempfile::tempdir().unwrap();
    let shards = tiny(d.path());
    let other = shards.iter().find(|s| d.path().join(s) != shard_of(d.path(), NORM)).unwrap().clone();
    edit_index(d.path(), |v| v["weight_map"][NORM] = json!(other));
    let ps = problems(d.path());
    assert!(ps.iter().any(|p| p.contains(NORM) && p.contains(&format!("index says shard {other}"))), "{ps:#?}");
}

#[test]
fn malformed_config_json() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    std::fs::write(d.path().join("config.json"), b"{\"text_config\": {\"hidden_size\": 128,").unwrap();
    match err(d.path()) {
        CheckpointError::Config(ConfigError::Json { path, .. }) => assert!(path.ends_with("config.json"), "{path}"),
        e => panic!("expected a config JSON error, got: {e}"),
    }
    // Valid JSON, wrong types.
    edit_config_raw(d.path(), "{\"bos_token_id\": \"one\"}");
    assert!(matches!(err(d.path()), CheckpointError::Config(ConfigError::Json { .. })));
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert!(matches!(err(d.path()), CheckpointError::Config(ConfigError::Io { .. })));
}

fn edit_config_raw(dir: &Path, text: &str) {
    std::fs::write(dir.join("config.json"), text).unwrap();
}

#[test]
fn malformed_index_json() {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    let p = d.path().join("model.safetensors.index.json");
    std::fs::write(&p, b"{\"weight_map\": [1, 2").unwrap();
    match err(d.path()) {
        CheckpointError::Index { path, .. } => assert!(path.ends_with("model.safetensors.index.json")),
        e => panic!("expected an index error, got: {e}"),
    }
    std::fs::write(&p, b"{\"metadata\": {}}").unwrap();
    assert!(matches!(err(d.path()), CheckpointError::Index { .. }), "no weight_map");
    std::fs::write(&p, br#"{"weight_map": {"x": "../outside.safetensors"}}"#).unwrap();
    match err(d.path()) {
        CheckpointError::Index { msg, .. } => assert!(msg.contains("not a plain file name"), "{msg}"),
        e => panic!("expected an index error, got: {e}"),
    }
    std::fs::remove_file(&p).unwrap();
    assert!(matches!(err(d.path()), CheckpointError::Io { .. }));
}

#[test]
fn malformed_shard_header() {
    let d = tempfile::tempdir().unwrap();
    let shards = tiny(d.path());
    let p = d.path().join(&shards[0]);
    let mut b = std::fs::read(&p).unwrap();
    b[8] = b'[';
    std::fs::write(&p, &b).unwrap();
    match err(d.path()) {
        CheckpointError::Shard { shard, msg } => {
            assert_eq!(shard, shards[0]);
            assert!(msg.contains("header JSON"), "{msg}");
        }
        e => panic!("expected a shard error, got: {e}"),
    }
    // A header length beyond the file.
    b[..8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    std::fs::write(&p, &b).unwrap();
    assert!(matches!(err(d.path()), CheckpointError::Shard { .. }));
}

fn layer_lists_error(kda: Value, full: Value) -> String {
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    edit_config(d.path(), |v| {
        v["text_config"]["linear_attn_config"]["kda_layers"] = kda;
        v["text_config"]["linear_attn_config"]["full_attn_layers"] = full;
    });
    match err(d.path()) {
        CheckpointError::Config(ConfigError::Invalid(m)) => m,
        e => panic!("expected an invalid config, got: {e}"),
    }
}

#[test]
fn zero_based_layer_lists() {
    // The classic misreading: 0-based lists, which also leave layer 9 uncovered.
    let m = layer_lists_error(json!([0, 1, 2, 4, 5, 6]), json!([3, 7, 8]));
    assert!(m.contains("kda_layers contains 0, but the lists are 1-based"), "{m}");
    assert!(m.contains("layers [9] (1-based) are in neither"), "{m}");
}

#[test]
fn layer_lists_that_do_not_cover_all_layers() {
    let m = layer_lists_error(json!([1, 2, 3, 5, 6]), json!([4, 8, 9]));
    assert_eq!(m, "layers [7] (1-based) are in neither kda_layers nor full_attn_layers");
}

#[test]
fn overlapping_layer_lists() {
    let m = layer_lists_error(json!([1, 2, 3, 4, 5, 6, 7]), json!([4, 8, 9]));
    assert_eq!(m, "layers [4] (1-based) appear twice in kda_layers/full_attn_layers");
}

#[test]
fn layer_lists_beyond_the_layer_count() {
    let m = layer_lists_error(json!([1, 2, 3, 5, 6, 7]), json!([4, 8, 9, 10]));
    assert!(m.contains("full_attn_layers contains 10, beyond num_hidden_layers = 9"), "{m}");
}

fn tiny_config() -> Value {
    serde_json::from_slice(&std::fs::read(k3_protocol::testdata::golden_dir("tiny-a").join("config.json")).unwrap()).unwrap()
}

fn invalid(v: &Value) -> String {
    match K3Config::from_json(&v.to_string()) {
        Err(ConfigError::Invalid(m)) => m,
        Err(e) => panic!("expected an invalid config, got: {e}"),
        Ok(_) => panic!("accepted an invalid config"),
    }
}

#[test]
fn mxfp4_group_size_not_32() {
    let mut v = tiny_config();
    v["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = json!(16);
    let m = invalid(&v);
    assert!(m.contains("config_groups.group_0.weights.group_size = 16 (MXFP4 needs 32)"), "{m}");
}

#[test]
fn widths_that_do_not_divide() {
    let mut v = tiny_config();
    v["text_config"]["moe_intermediate_size"] = json!(48);
    let m = invalid(&v);
    assert!(m.contains("moe_intermediate_size (MXFP4 group 32): 48 is not divisible by 32"), "{m}");
    let mut v = tiny_config();
    v["text_config"]["routed_expert_hidden_size"] = json!(80);
    assert!(invalid(&v).contains("routed_expert_hidden_size (MXFP4 group 32): 80"));
    let mut v = tiny_config();
    v["vision_config"]["qkv_hidden_size"] = json!(65);
    assert!(invalid(&v).contains("qkv_hidden_size 65 is not divisible by vt_num_attention_heads 2"));
    let mut v = tiny_config();
    v["vision_config"]["text_hidden_size"] = json!(256);
    assert!(invalid(&v).contains("text_hidden_size 256 differs from text_config.hidden_size 128"));
}

#[test]
fn random_header_corruption_never_panics() {
    let d = tempfile::tempdir().unwrap();
    let shards = tiny(d.path());
    let p = d.path().join(&shards[1]);
    let orig = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(orig[..8].try_into().unwrap()) as usize;
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let (mut ok, mut bad) = (0, 0);
    for _ in 0..150 {
        let mut b = orig.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % (8 + n);
            b[at] = match next() % 3 {
                0 => b"0123456789"[(next() % 10) as usize],
                1 => next() as u8,
                _ => b"[]{},:\""[(next() % 7) as usize],
            };
        }
        std::fs::write(&p, &b).unwrap();
        match Checkpoint::open(d.path()) {
            Ok(ck) => {
                ok += 1;
                // Whatever opened must still read within bounds.
                for name in ck.tensor_names().map(String::from).collect::<Vec<_>>() {
                    let _ = ck.tensor(&name).unwrap().bytes.len();
                }
            }
            Err(e) => {
                bad += 1;
                assert!(!e.to_string().is_empty());
            }
        }
    }
    assert!(bad > 0, "corruption was detected at least once ({ok} opened)");
}

/// A header naming one tensor twice (parsers keep one or the other), a shard padded with bytes
/// no tensor owns (a 200 GB sparse file), and a hole between tensors are refused at open,
/// naming the shard.
#[test]
fn duplicate_names_holes_and_padded_shards_are_refused() {
    // the name twice: spliced into the header text (a JSON map cannot hold it twice)
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    let path = shard_of(d.path(), NORM);
    let b = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let text = std::str::from_utf8(&b[8..8 + n]).unwrap().trim_end().to_string();
    let h: serde_json::Map<String, Value> = serde_json::from_str(&text).unwrap();
    let entry = serde_json::to_string(&h[NORM]).unwrap();
    let spliced = format!("{},\"{NORM}\":{entry}}}", &text[..text.len() - 1]);
    let mut out = (spliced.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(spliced.as_bytes());
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(&path, out).unwrap();
    match err(d.path()) {
        CheckpointError::Shard { msg, .. } => assert!(msg.contains("twice") && msg.contains(NORM), "{msg}"),
        e => panic!("expected a shard error, got: {e}"),
    }

    // trailing bytes: a shard made 200 GB by a sparse extension (no data written)
    let d = tempfile::tempdir().unwrap();
    let shards = tiny(d.path());
    let p = d.path().join(&shards[1]);
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(200_000_000_000).unwrap();
    let ps = problems(d.path());
    assert!(ps.len() == 1 && ps[0].starts_with(&shards[1]) && ps[0].contains("trailing bytes belong to no tensor"), "{ps:#?}");

    // a hole: one tensor's range moved past a gap
    let d = tempfile::tempdir().unwrap();
    tiny(d.path());
    let path = shard_of(d.path(), NORM);
    let (mut h, mut data) = read_shard(&path);
    let end = data.len() as u64;
    let len = {
        let o = h[NORM]["data_offsets"].as_array().unwrap();
        o[1].as_u64().unwrap() - o[0].as_u64().unwrap()
    };
    h.get_mut(NORM).unwrap()["data_offsets"] = serde_json::json!([end + 16, end + 16 + len]);
    data.extend(std::iter::repeat_n(0u8, 16 + len as usize));
    write_shard(&path, &h, &data);
    let ps = problems(d.path());
    assert!(ps.iter().any(|p| p.contains("belong to no tensor (a hole before")), "{ps:#?}");
}
