//! `k3-decode encode-image` on golden tiny-a: every written tensor against its golden namesake.

use std::process::Command;

use safetensors::SafeTensors;

fn f32s(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
}

use k3_protocol::testdata::rel_l2 as rel;

fn check_backend(backend: &str) {
    let dir = k3_protocol::testdata::golden_dir("tiny-a");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("img.safetensors");
    let status = Command::new(env!("CARGO_BIN_EXE_k3-decode"))
        .args(["encode-image", "--backend", backend, "--model"])
        .arg(&dir)
        .arg("--image")
        .arg(dir.join("image.png"))
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success(), "encode-image --backend {backend} failed");
    let ours = std::fs::read(&out).unwrap();
    let ours = SafeTensors::deserialize(&ours).unwrap();
    let gold = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let gold = SafeTensors::deserialize(&gold).unwrap();

    assert_eq!(ours.tensor("vision.grid_thw").unwrap().data(), gold.tensor("vision.grid_thw").unwrap().data());
    let (s, a) = f32s(&ours, "vision.pixel_values");
    let (gs, g) = f32s(&gold, "vision.pixel_values");
    assert_eq!(s, gs);
    assert!(a.iter().zip(&g).all(|(x, y)| x.to_bits() == y.to_bits()), "pixel_values differ");
    // vision.output is the BF16-eps behaviour: it must match golden vision.output_bf16eps.
    for (ours_name, gold_name) in [
        ("vision.output", "vision.output_bf16eps"),
        ("vision.output_bf16eps", "vision.output_bf16eps"),
        ("vision.embed", "vision.embed"),
        ("vision.encoder", "vision.encoder"),
        ("vision.merged", "vision.merged"),
    ] {
        let (s, a) = f32s(&ours, ours_name);
        let (gs, g) = f32s(&gold, gold_name);
        assert_eq!(s, gs, "{ours_name} shape");
        let e = rel(&a, &g);
        assert!(e <= 1e-4, "{backend}: {ours_name} vs golden {gold_name}: rel {e:.2e}");
    }
}

#[test]
fn encode_image_reference_backend_matches_golden() {
    check_backend("reference");
}

#[cfg(feature = "mlx")]
#[test]
fn encode_image_mlx_backend_matches_golden() {
    check_backend("mlx");
}

#[test]
fn encode_image_reports_a_bad_image() {
    let dir = k3_protocol::testdata::golden_dir("tiny-a");
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.png");
    std::fs::write(&bad, b"\x89PNG\r\n\x1a\nnot really").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_k3-decode"))
        .args(["encode-image", "--backend", "reference", "--model"])
        .arg(&dir)
        .arg("--image")
        .arg(&bad)
        .arg("--out")
        .arg(tmp.path().join("o.safetensors"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.png"), "error does not name the image: {err}");
    assert!(!err.contains("panicked"), "{err}");
}
