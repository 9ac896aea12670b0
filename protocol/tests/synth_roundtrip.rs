//! Synthetic models: write → load round trips (tiny and a reduced small), every tensor's
//! shape and dtype, the weight recipe (MXFP4 invariants, A_log padding, norm gains),
//! determinism, sharding by size, the tokenizer files, and K3's derived sizes from the config.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use k3_protocol::config::AttnKind;
use k3_protocol::mxfp4;
use k3_protocol::synth::{write_model, Preset, SpecialTokens, SynthOptions};
use k3_protocol::tensors::{all_tensors, layer_tensor, DType, DerivedSizes, Init};
use k3_protocol::testdata::golden_dir;
use k3_protocol::{Checkpoint, K3Config};

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect()
}

/// Every tensor the config implies is present with its shape and dtype, and nothing else.
fn check_every_tensor(ck: &Checkpoint) {
    let specs = all_tensors(ck.config());
    assert_eq!(ck.tensor_names().count(), specs.len());
    for s in &specs {
        let e = ck.entry(&s.name).unwrap_or_else(|| panic!("{} missing", s.name));
        assert_eq!(e.shape, s.shape, "{}", s.name);
        assert_eq!(e.dtype, s.dtype, "{}", s.name);
    }
}

/// MXFP4: no NaN scale; each group's largest |value|/scale is 3, 4 or 6 (the release rule puts
/// it in (3, 6] before rounding to E2M1);
/// the decoded weights have roughly the recipe's spread 1/sqrt(in).
fn check_experts(ck: &Checkpoint) {
    let c = &ck.config().text_config;
    for l in c.first_k_dense_replace..c.num_hidden_layers {
        for e in 0..c.num_experts {
            for w in ["w1", "w2", "w3"] {
                let x = ck.expert(l, e, w).unwrap();
                let d = x.decode();
                let mut ss = 0f64;
                for r in 0..x.out_features {
                    for g in 0..x.in_features / 32 {
                        let s = x.scale[r * x.in_features / 32 + g];
                        assert_ne!(s, 255, "layer {l} expert {e} {w}: NaN scale");
                        let sc = mxfp4::e8m0(s);
                        let grp = &d[r * x.in_features + g * 32..][..32];
                        let amax = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
                        assert!([3.0, 4.0, 6.0].contains(&(amax / sc)), "layer {l} expert {e} {w} row {r} group {g}");
                    }
                }
                for v in &d {
                    ss += (*v as f64).powi(2);
                }
                let std = (ss / d.len() as f64).sqrt();
                let want = 1.0 / (x.in_features as f64).sqrt();
                assert!((std / want - 1.0).abs() < 0.25, "layer {l} expert {e} {w}: std {std}, recipe {want}");
            }
        }
    }
}

/// A_log: nonzero on the first num_heads entries, exact zeros in the padding; norm gains in
/// [0.5, 1.5]; dt_bias spread ~2.
fn check_recipe(ck: &Checkpoint) {
    let c = &ck.config().text_config;
    let heads = c.linear_attn_config.num_heads;
    for l in c.kda_layers() {
        let a = ck.tensor(&layer_tensor(l, "self_attn.A_log")).unwrap().to_f32().unwrap();
        assert_eq!(a.len(), c.linear_attn_config.head_dim.max(heads));
        assert!(a[..heads].iter().all(|&x| x != 0.0), "layer {l}: A_log heads are drawn");
        assert!(a[heads..].iter().all(|&x| x.to_bits() == 0), "layer {l}: A_log padding is +0.0");
        let prefix = ck.f32_prefix(&layer_tensor(l, "self_attn.A_log"), heads).unwrap();
        assert_eq!(prefix, a[..heads]);
        let dt = ck.tensor(&layer_tensor(l, "self_attn.dt_bias")).unwrap().to_f32().unwrap();
        let sd = (dt.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / dt.len() as f64).sqrt();
        assert!((1.5..2.5).contains(&sd), "layer {l}: dt_bias std {sd}");
    }
    for spec in all_tensors(ck.config()).iter().filter(|s| s.init == Init::NormGain) {
        let v = ck.tensor(&spec.name).unwrap().to_f32().unwrap();
        assert!(v.iter().all(|x| (0.5..=1.5).contains(x)), "{}", spec.name);
    }
}

#[test]
fn tiny_preset_is_the_golden_tiny_a_configuration() {
    let golden = K3Config::load(&golden_dir("tiny-a")).unwrap();
    let cfg = SynthOptions::new(Preset::Tiny).config().unwrap();
    assert_eq!(cfg, golden);
}

#[test]
fn tiny_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.seed = 3;
    let rep = write_model(dir.path(), &opts).unwrap();
    assert_eq!(rep.shards, vec!["model-00001-of-00001.safetensors"]);
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert!(ck.validate().unwrap().is_empty(), "no unknown tensors");
    // The config file is in the release layout and reads back to the same typed config.
    let raw: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(raw["text_config"]["quantization_config"]["format"], "mxfp4-pack-quantized");
    assert_eq!(raw["text_config"]["model_type"], "kimi_linear");
    assert_eq!(raw["vision_config"]["_attn_implementation"], "flash_attention_2");
    assert_eq!(ck.config(), &K3Config::load(&golden_dir("tiny-a")).unwrap());
    check_every_tensor(&ck);
    check_experts(&ck);
    check_recipe(&ck);
    // Same config and tensor index as golden tiny-a: the same index fingerprint; the model
    // fingerprint also covers the weight bytes, which the seed changes.
    let golden = Checkpoint::open(&golden_dir("tiny-a")).unwrap();
    assert_eq!(ck.index_fingerprint(), golden.index_fingerprint());
    assert_ne!(ck.fingerprint(), golden.fingerprint());
    assert_eq!(ck.total_bytes(), 4_092_992, "golden README: tiny-a tensors total 4092992 bytes");
    assert_eq!(rep.bytes, ck.total_bytes());
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(index["metadata"]["total_size"], 4_092_992);
}

#[test]
fn tiny_tokenizer_files() {
    let dir = tempfile::tempdir().unwrap();
    let rep = write_model(dir.path(), &SynthOptions::new(Preset::Tiny)).unwrap();
    let text = std::fs::read_to_string(dir.path().join("tiktoken.model")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1000, "base tokens fill the ids below the special block");
    for (i, l) in lines.iter().enumerate() {
        let (b64, rank) = l.split_once(' ').unwrap();
        assert_eq!(rank, i.to_string());
        assert!(!b64.is_empty() && b64.len() % 4 == 0);
    }
    let tc: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("tokenizer_config.json")).unwrap()).unwrap();
    let dec = &tc["added_tokens_decoder"];
    let cfg = &rep.config;
    assert_eq!(dec[cfg.bos_token_id.to_string()]["content"], "[BOS]");
    assert_eq!(dec[cfg.eos_token_id.to_string()]["content"], "<|end_of_msg|>");
    assert_eq!(dec[cfg.pad_token_id.to_string()]["content"], "[PAD]");
    assert_eq!(dec[cfg.media_placeholder_token_id.to_string()]["content"], "<|media_pad|>");
    assert_eq!(dec["1006"]["content"], "<|media_begin|>");
    assert_eq!(dec["1007"]["content"], "<|media_content|>");
    assert_eq!(dec["1008"]["content"], "<|media_end|>");
    assert_eq!(dec["1003"]["special"], false, "<|open|> is special: false as in the release");
    for (id, _) in dec.as_object().unwrap() {
        let id: usize = id.parse().unwrap();
        assert!((1000..1024).contains(&id));
    }
}

#[test]
fn same_seed_same_bytes_other_seed_other_weights() {
    let (a, b, c) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.seed = 11;
    opts.max_shard_bytes = 1_000_000;
    write_model(a.path(), &opts).unwrap();
    write_model(b.path(), &opts).unwrap();
    opts.seed = 12;
    write_model(c.path(), &opts).unwrap();
    let (fa, fb, fc) = (files(a.path()), files(b.path()), files(c.path()));
    assert!(fa.len() >= 6, "config, index, tokenizer (2) and several shards: {:?}", fa.keys());
    assert_eq!(fa, fb, "same seed: byte-identical files");
    assert_eq!(fa.keys().collect::<Vec<_>>(), fc.keys().collect::<Vec<_>>());
    for (name, bytes) in &fa {
        if name.ends_with(".safetensors") {
            assert_ne!(bytes, &fc[name], "{name}: another seed draws other weights");
        } else {
            assert_eq!(bytes, &fc[name], "{name} does not depend on the seed");
        }
    }
}

#[test]
fn reduced_small_roundtrip_with_several_shards() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Small);
    opts.overrides.layers = Some(5);
    opts.overrides.experts = Some(8);
    opts.overrides.vocab = Some(4096);
    opts.overrides.vision_layers = Some(1);
    opts.overrides.vision_pos = Some(16);
    opts.max_shard_bytes = 12 << 20;
    let rep = write_model(dir.path(), &opts).unwrap();
    let c = &rep.config.text_config;
    assert_eq!(c.hidden_size, 1024);
    assert_eq!(c.linear_attn_config.full_attn_layers, vec![4, 5], "every 4th layer plus the last");
    assert_eq!(c.attn_res_block_size, 4);
    assert!(rep.shards.len() >= 4, "sharded by size: {:?}", rep.shards);
    let n = rep.shards.len();
    for (i, s) in rep.shards.iter().enumerate() {
        assert_eq!(s, &format!("model-{:05}-of-{:05}.safetensors", i + 1, n));
    }
    let ck = Checkpoint::open(dir.path()).unwrap();
    check_every_tensor(&ck);
    check_experts(&ck);
    check_recipe(&ck);
    // Shards respect the limit unless one tensor alone exceeds it; file = header + data.
    let mut per_shard: HashMap<String, u64> = HashMap::new();
    for name in ck.tensor_names() {
        let e = ck.entry(name).unwrap();
        *per_shard.entry(ck.shard_name(e.shard).to_string()).or_default() += (e.end - e.start) as u64;
    }
    let biggest = all_tensors(ck.config()).iter().map(|s| s.nbytes() as u64).max().unwrap();
    for (s, bytes) in &per_shard {
        assert!(*bytes <= (12u64 << 20).max(biggest), "{s} holds {bytes} bytes");
        let len = std::fs::metadata(dir.path().join(s)).unwrap().len();
        let hdr = u64::from_le_bytes(std::fs::read(dir.path().join(s)).unwrap()[..8].try_into().unwrap());
        assert_eq!(len, 8 + hdr + bytes, "{s}: no gaps, no trailing bytes");
        assert_eq!((8 + hdr) % 8, 0, "{s}: header padded to 8 bytes");
    }
    // The release-layout special block of a 4096 vocabulary.
    let sp = SpecialTokens::for_vocab(4096).unwrap();
    assert_eq!((rep.config.bos_token_id, rep.config.eos_token_id), (sp.bos(), sp.eos()));
    assert_eq!((rep.config.pad_token_id, rep.config.media_placeholder_token_id), (4095, 3840 + 21));
    let ranks = std::fs::read_to_string(dir.path().join("tiktoken.model")).unwrap();
    assert_eq!(ranks.lines().count(), 3840);
}

#[test]
fn overrides_reach_the_config_and_bad_ones_are_errors() {
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.overrides.layers = Some(13);
    opts.overrides.heads = Some(4);
    opts.overrides.block_size = Some(5);
    opts.overrides.experts = Some(6);
    opts.overrides.experts_per_token = Some(2);
    opts.overrides.hidden = Some(96);
    opts.overrides.vocab = Some(512);
    let cfg = opts.config().unwrap();
    let c = &cfg.text_config;
    assert_eq!(c.linear_attn_config.full_attn_layers, vec![4, 8, 12, 13]);
    assert_eq!(c.linear_attn_config.kda_layers.len(), 9);
    assert_eq!((c.num_attention_heads, c.linear_attn_config.num_heads), (4, 4));
    assert_eq!(cfg.vision_config.text_hidden_size, 96);
    assert_eq!((cfg.bos_token_id, cfg.pad_token_id), (488, 511));
    let banks: Vec<usize> = c.layer_plan().iter().filter(|s| s.bank_boundary).map(|s| s.index).collect();
    assert_eq!(banks, vec![0, 5, 10]);
    assert_eq!(c.layer_plan()[12].attn, AttnKind::Mla);

    let mut bad = SynthOptions::new(Preset::Tiny);
    bad.overrides.moe_intermediate = Some(48);
    let e = bad.config().unwrap_err().to_string();
    assert!(e.contains("moe_intermediate_size") && e.contains("32"), "{e}");
    let mut bad = SynthOptions::new(Preset::Tiny);
    bad.overrides.vocab = Some(100);
    assert!(bad.config().unwrap_err().to_string().contains("vocab_size 100"));
    let mut bad = SynthOptions::new(Preset::Tiny);
    bad.overrides.full_attn_layers = Some(vec![0, 4]);
    assert!(bad.config().unwrap_err().to_string().contains("1-based"));
    let dir = tempfile::tempdir().unwrap();
    assert!(write_model(dir.path(), &bad).is_err());
    assert!(!dir.path().join("config.json").exists(), "nothing is written for an invalid config");
}

#[test]
fn real_k3_widths_give_k3_per_expert_and_per_token_sizes() {
    // Real expert and MLA widths, few layers and experts and a narrow trunk: a loadable model.
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::K3);
    opts.overrides.layers = Some(2);
    opts.overrides.experts = Some(2);
    opts.overrides.experts_per_token = Some(1);
    opts.overrides.hidden = Some(256);
    opts.overrides.heads = Some(2);
    opts.overrides.intermediate = Some(256);
    opts.overrides.vocab = Some(1024);
    opts.overrides.vision_layers = Some(1);
    opts.overrides.vision_hidden = Some(64);
    opts.overrides.vision_heads = Some(2);
    opts.overrides.vision_qkv = Some(64);
    opts.overrides.vision_intermediate = Some(128);
    opts.overrides.vision_pos = Some(8);
    write_model(dir.path(), &opts).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    check_every_tensor(&ck);
    let d = DerivedSizes::of(ck.config());
    assert_eq!(d.bytes_per_expert, 17_547_264, "spec §2.3");
    assert_eq!(ck.config().text_config.mla_layers(), vec![1]);
    assert_eq!(d.mla_state_bytes_per_token_bf16, 1_152, "spec §4: 1,152 B per token per MLA layer");
    let e = ck.expert(1, 1, "w2").unwrap();
    assert_eq!((e.out_features, e.in_features), (3584, 3072));

    // The whole K3 from its config alone.
    let k3 = SynthOptions::new(Preset::K3).config().unwrap();
    let d = DerivedSizes::of(&k3);
    assert_eq!(d.routed_expert_params, 92 * 896 * 3 * 3072 * 3584);
    assert_eq!(format!("{:.2}", d.routed_expert_params as f64 / 1e12), "2.72");
    assert_eq!(d.bytes_per_expert, 17_547_264);
    assert_eq!(d.mla_state_bytes_per_token_bf16, 27_648);
    assert_eq!(d.kda_state_bytes_fp32, 434_110_464, "spec §4");
    // Spec §1.2: 497,220 tensors, metadata.total_size 1,560,860,324,864 bytes.
    let specs = all_tensors(&k3);
    assert_eq!(specs.len(), 497_220);
    assert_eq!(d.checkpoint_bytes, 1_560_860_324_864);
    assert_eq!(specs.iter().filter(|s| s.dtype == DType::U8).count(), 92 * 896 * 6);
}

#[test]
fn a_tensor_does_not_depend_on_the_rest_of_the_model() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.seed = 5;
    opts.tokenizer = false;
    write_model(a.path(), &opts).unwrap();
    opts.overrides.layers = Some(5);
    write_model(b.path(), &opts).unwrap();
    let (ca, cb) = (Checkpoint::open(a.path()).unwrap(), Checkpoint::open(b.path()).unwrap());
    for l in 0..3 {
        for name in all_tensors(cb.config()).iter().map(|s| &s.name).filter(|n| n.contains(&format!("layers.{l}."))) {
            assert_eq!(ca.tensor(name).unwrap().bytes, cb.tensor(name).unwrap().bytes, "{name}");
        }
    }
    let emb = "language_model.model.embed_tokens.weight";
    assert_eq!(ca.tensor(emb).unwrap().bytes, cb.tensor(emb).unwrap().bytes);
}
