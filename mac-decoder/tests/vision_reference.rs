//! The f32 CPU reference tower against golden tiny-a, stage by stage.

use mac_decoder::vision::{reference, MediaProcConfig, NormEps, VisionWeights};
use safetensors::SafeTensors;

fn golden_f32(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("golden {name}: {e}"));
    (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
}

/// Largest per-row relative L2 error.
fn max_row_rel(out: &[f32], golden: &[f32], width: usize) -> f64 {
    assert_eq!(out.len(), golden.len());
    out.chunks(width)
        .zip(golden.chunks(width))
        .map(|(o, g)| {
            let num: f64 = o.iter().zip(g).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            let den: f64 = g.iter().map(|b| (*b as f64).powi(2)).sum();
            (num / den).sqrt()
        })
        .fold(0.0, f64::max)
}

#[test]
fn reference_tower_matches_golden_tiny_a() {
    let dir = k3_protocol::testdata::golden_dir("tiny-a");
    let ck = k3_protocol::Checkpoint::open(&dir).expect("tiny-a checkpoint");
    let w = VisionWeights::load(&ck).expect("vision weights");
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let png = std::fs::read(dir.join("image.png")).unwrap();
    let img = mac_decoder::vision::preprocess_bytes(&png, &MediaProcConfig::for_vision(&w.cfg)).unwrap();

    let fp32 = reference::encode(&w, &img, NormEps::F32).unwrap();
    let bf16 = reference::encode(&w, &img, NormEps::Bf16).unwrap();
    let d = w.cfg.vt_hidden_size;
    let cases: [(&str, &[f32], usize); 5] = [
        ("vision.embed", &fp32.embed, d),
        ("vision.encoder", &fp32.encoder, d),
        ("vision.merged", &fp32.merged, 4 * d),
        ("vision.output", &fp32.output, w.cfg.text_hidden_size),
        ("vision.output_bf16eps", &bf16.output, w.cfg.text_hidden_size),
    ];
    let mut report = String::new();
    let mut worst = 0f64;
    for (name, out, width) in cases {
        let (shape, golden) = golden_f32(&st, name);
        assert_eq!(shape, vec![out.len() / width, width], "{name} shape");
        let e = max_row_rel(out, &golden, width);
        report += &format!("{name}: max row rel {e:.2e}\n");
        worst = worst.max(e);
    }
    eprint!("{report}");
    assert!(worst <= 1e-4, "reference vs golden:\n{report}");
    // The two eps variants really differ (~1.5%), so the bf16 check is not vacuous.
    let (_, g_fp32) = golden_f32(&st, "vision.output");
    assert!(max_row_rel(&bf16.output, &g_fp32, w.cfg.text_hidden_size) > 1e-3);
}
