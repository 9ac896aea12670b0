//! `k3-prefill forward` end to end on tiny-a: the output file holds exactly the golden names,
//! shapes and values (logits, hand-off state, hidden.* with --dump-hidden), continuation from
//! a session file gives split.logits, and `--backend cuda` without a GPU and bad ids fail clearly.

mod common;

use std::process::Command;

use common::*;
use safetensors::SafeTensors;

fn k3_prefill() -> Command {
    Command::new(env!("CARGO_BIN_EXE_k3-prefill"))
}

fn write_ids(dir: &std::path::Path, name: &str, ids: &[u32]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string(ids).unwrap()).unwrap();
    p
}

#[test]
fn forward_writes_the_golden_tensors() {
    let golden = tiny_a_golden();
    let ids = golden.ids("input_ids");
    let dir = tempfile::tempdir().unwrap();
    let ids_path = write_ids(dir.path(), "ids.json", &ids);
    let out = dir.path().join("out.safetensors");
    let st = k3_prefill()
        .args(["forward", "--model"])
        .arg(tiny_a_dir())
        .arg("--input-ids")
        .arg(&ids_path)
        .arg("--out")
        .arg(&out)
        .args(["--backend", "cpu", "--dump-hidden"])
        .status()
        .unwrap();
    assert!(st.success());
    let ours = Golden::open(&out);
    let bytes = std::fs::read(&out).unwrap();
    let names: Vec<String> = SafeTensors::deserialize(&bytes).unwrap().names().into_iter().map(|n| n.to_string()).collect();
    let gbytes = std::fs::read(k3_protocol::testdata::tiny_a_golden()).unwrap();
    let gst = SafeTensors::deserialize(&gbytes).unwrap();
    let mut expected: Vec<String> = gst
        .names()
        .into_iter()
        .filter(|n| *n == "logits" || n.starts_with("kda.") || n.starts_with("mla.") || n.starts_with("hidden."))
        .map(|n| n.to_string())
        .collect();
    let mut got = names.clone();
    expected.sort();
    got.sort();
    assert_eq!(got, expected, "tensor names");
    let vocab = 1024;
    for name in &expected {
        let (gs, gv) = golden.f32(name);
        let (os, ov) = ours.f32(name);
        assert_eq!(os, gs, "{name}: shape");
        if name == "logits" {
            check_logits("forward --out logits", &ov, &gv, vocab, &near_tie_rows(&golden, ids.len()));
        } else {
            let e = rel(&ov, &gv);
            assert!(e <= TOL, "{name}: rel err {e:.3e}");
        }
    }
}

#[test]
fn forward_continues_from_a_session_file() {
    let golden = tiny_a_golden();
    let ids = golden.ids("input_ids");
    let p1 = golden.i64("split.p1")[0] as usize;
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first.safetensors");
    let second = dir.path().join("second.safetensors");
    let run = |ids_file: &std::path::Path, out: &std::path::Path, state: Option<&std::path::Path>| {
        let mut c = k3_prefill();
        c.args(["forward", "--backend", "cpu", "--model"]).arg(tiny_a_dir()).arg("--input-ids").arg(ids_file).arg("--out").arg(out);
        if let Some(s) = state {
            c.arg("--state").arg(s);
        }
        assert!(c.status().unwrap().success());
    };
    run(&write_ids(dir.path(), "a.json", &ids[..p1]), &first, None);
    run(&write_ids(dir.path(), "b.json", &ids[p1..]), &second, Some(&first));
    let (shape, logits) = Golden::open(&second).f32("logits");
    assert_eq!(shape, vec![ids.len() - p1, 1024]);
    let exempt: Vec<usize> = near_tie_rows(&golden, ids.len()).into_iter().filter(|&r| r >= p1).map(|r| r - p1).collect();
    check_logits("forward --state split.logits", &logits, &golden.f32("split.logits").1, 1024, &exempt);
    let (ms, _) = Golden::open(&second).f32("mla.3.latent");
    assert_eq!(ms[0], ids.len(), "the continued state holds every token's latent row");
}

#[test]
fn forward_cuda_without_gpu_and_bad_ids_fail_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let ids = write_ids(dir.path(), "ids.json", &[1, 2, 3]);
    let out = dir.path().join("o.safetensors");
    let o = forward_output(&["--backend", "cuda"], &tiny_a_dir(), &ids, &out);
    match cuda_prefiller::cuda::probe() {
        // No usable GPU here: the CUDA backend must say so, naming CUDA.
        Err(_) => {
            assert!(!o.status.success());
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(err.contains("CUDA") && err.contains("error"), "{err}");
            assert!(!out.exists());
        }
        Ok(_) => assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr)),
    }
    let _ = std::fs::remove_file(&out);
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "[1, -2, 3]").unwrap();
    let o =
        k3_prefill().args(["forward", "--backend", "cpu", "--model"]).arg(tiny_a_dir()).arg("--input-ids").arg(&bad).arg("--out").arg(&out).output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("entry 1"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!out.exists());
}

/// Weight identity: `forward` labels the state with the model fingerprint only after the
/// weights the pass read matched the digest it is made from. With a shard edited in place (size
/// and mtime kept) or a forged digest cache (another model's hashes beside this model's real
/// shard stamps and CRCs), `forward` refuses and deletes the cache; the next run hashes the
/// weights again and labels its state with the checkpoint's true fingerprint. Before, both
/// states carried the original fingerprint.
#[test]
fn forward_labels_states_only_with_checked_weights() {
    use k3_protocol::fingerprint::{WeightDigest, DIGEST_FILE};
    use k3_protocol::synth::{write_model, Preset, SynthOptions};
    let synth = |dir: &std::path::Path, seed: u64| {
        let mut o = SynthOptions::new(Preset::Tiny);
        o.seed = seed;
        o.tokenizer = false;
        write_model(dir, &o).unwrap();
        k3_protocol::Checkpoint::open(dir).unwrap().fingerprint()
    };
    let label = |out: &std::path::Path, dir: &std::path::Path| {
        let cfg = k3_protocol::K3Config::load(dir).unwrap().text_config;
        k3_protocol::handoff::load_session(out, &cfg).unwrap().fingerprint.unwrap()
    };
    let tmp = tempfile::tempdir().unwrap();
    let ids = write_ids(tmp.path(), "ids.json", &[5, 9, 200, 31, 7]);
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let fa = synth(&a, 1);
    let fb = synth(&b, 2);

    // 1. a shard of A edited in place: one byte of layer 1, size and mtime kept
    let name = "language_model.model.layers.1.input_layernorm.weight";
    let (path, at) = {
        let ck = k3_protocol::Checkpoint::open(&a).unwrap();
        let e = ck.entry(name).unwrap().clone();
        (a.join(ck.shard_name(e.shard)), e.start)
    };
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    std::fs::File::options().write(true).open(&path).unwrap().set_modified(mtime).unwrap();
    let out = tmp.path().join("a.safetensors");
    let o = forward_output(&["--backend", "cpu"], &a, &ids, &out);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(name) && err.contains("differ from the weight digest"), "{err}");
    assert!(!out.exists(), "a state was written from unchecked weights");
    assert!(!a.join(DIGEST_FILE).exists(), "the digest cache that does not match was kept");
    let o = forward_output(&["--backend", "cpu"], &a, &ids, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let fa_edited = k3_protocol::Checkpoint::open(&a).unwrap().fingerprint();
    assert_ne!(fa_edited, fa);
    assert_eq!(label(&out, &a), fa_edited, "the state carries the edited checkpoint's true fingerprint");

    // 2. B's digest cache forged: A's hashes (as edited) with B's stamps and B's real CRCs
    let read = |d: &std::path::Path| -> WeightDigest { serde_json::from_slice(&std::fs::read(d.join(DIGEST_FILE)).unwrap()).unwrap() };
    let (da, db) = (read(&a), read(&b));
    let mut forged = da.clone();
    forged.shards = db.shards.clone();
    for (n, t) in forged.tensors.iter_mut() {
        t.crc32c = db.tensors[n].crc32c;
    }
    std::fs::write(b.join(DIGEST_FILE), serde_json::to_vec(&forged).unwrap()).unwrap();
    assert_eq!(k3_protocol::Checkpoint::open(&b).unwrap().fingerprint(), fa_edited, "the forged cache is read");
    let out = tmp.path().join("b.safetensors");
    let o = forward_output(&["--backend", "cpu"], &b, &ids, &out);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("differ from the weight digest"), "{err}");
    assert!(!out.exists());
    let o = forward_output(&["--backend", "cpu"], &b, &ids, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(label(&out, &b), fb, "rebuilt: B's own fingerprint");
}
