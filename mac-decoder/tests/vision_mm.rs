//! The multimodal prompt of golden tiny-a end to end: image.png through this crate's vision,
//! golden `mm.input_ids` (one `<|media_pad|>`) through `expand_media`, then the text model —
//! the CPU reference prefiller (`cuda-prefiller`, embedding overrides) and, with MLX, the
//! decoder engine — against golden `mm.logits` (≤ 1e-3 relative per row).
//!
//! Golden `mm.logits` were made with the float32-eps vision features (`mm.image_embeds` ==
//! `vision.output`), so these tests encode with `NormEps::F32`.

use cuda_prefiller::executor::{self, EmbeddingOverrides, ExecOptions, PrefillInput};
use k3_protocol::HandoffState;
use mac_decoder::vision::{expand_media, ImageFeatures, NormEps, ReferenceEncoder};
use safetensors::SafeTensors;
use std::sync::Arc;

struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    fn load() -> Self {
        Golden { bytes: std::fs::read(k3_protocol::testdata::tiny_a_golden()).unwrap() }
    }
    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).unwrap()
    }
    fn ids(&self, name: &str) -> Vec<u32> {
        self.st().tensor(name).unwrap().data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect()
    }
    fn f32(&self, name: &str) -> Vec<f32> {
        self.st().tensor(name).unwrap().data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    }
}

fn worst_row(got: &[f32], want: &[f32], width: usize) -> (usize, f64) {
    assert_eq!(got.len(), want.len());
    got.chunks(width)
        .zip(want.chunks(width))
        .map(|(o, g)| {
            let num: f64 = o.iter().zip(g).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            let den: f64 = g.iter().map(|b| (*b as f64).powi(2)).sum();
            (num / den).sqrt()
        })
        .enumerate()
        .fold((0, 0.0), |a, (i, e)| if e > a.1 { (i, e) } else { a })
}

fn image_png() -> Vec<u8> {
    std::fs::read(k3_protocol::testdata::golden_dir("tiny-a").join("image.png")).unwrap()
}

/// Vision features (float32 eps) of image.png, from the CPU reference.
fn reference_features(ck: &k3_protocol::Checkpoint) -> ImageFeatures {
    let enc = ReferenceEncoder::load(ck, NormEps::F32).unwrap();
    mac_decoder::vision::encode_image_bytes(&enc, &image_png()).unwrap()
}

#[test]
fn mm_logits_through_the_cpu_prefiller() {
    let g = Golden::load();
    let dir = k3_protocol::testdata::golden_dir("tiny-a");
    let ck = Arc::new(k3_protocol::Checkpoint::open(&dir).unwrap());
    let features = [reference_features(&ck)];
    let pad = ck.config().media_placeholder_token_id;
    let e = expand_media(&g.ids("mm.input_ids"), pad, &features).unwrap();
    assert_eq!(e.ids, g.ids("mm.input_ids_expanded"));
    let ov = EmbeddingOverrides { positions: e.overrides.iter().map(|o| o.0).collect(), rows: e.overrides.iter().flat_map(|o| o.1.iter().copied()).collect() };
    let model =
        cuda_prefiller::model::Model::new(Arc::new(cuda_prefiller::cpu::CpuBackend), ck.clone(), cuda_prefiller::model::WeightPolicy::Resident).unwrap();
    let mut st = HandoffState::empty(&model.cfg);
    let out = executor::prefill(&model, &mut st, PrefillInput { tokens: &e.ids, overrides: Some(&ov) }, &ExecOptions::default(), |_| Ok(())).unwrap();
    let vocab = ck.config().text_config.vocab_size;
    let (row, err) = worst_row(&out.logits, &g.f32("mm.logits"), vocab);
    eprintln!("CPU prefiller mm.logits: worst row {row}, relative error {err:.2e}");
    assert!(err <= 1e-3, "mm.logits row {row}: {err:.2e}");
}

#[cfg(feature = "mlx")]
mod mlx {
    use super::*;
    use mac_decoder::decode::{Engine, ImageEmbeds};
    use mac_decoder::vision::MlxVisionEncoder;

    fn argmax(x: &[f32]) -> u32 {
        x.iter().enumerate().fold((0, f32::NEG_INFINITY), |a, (i, &v)| if v > a.1 { (i, v) } else { a }).0 as u32
    }

    fn mlx_features(ck: &k3_protocol::Checkpoint) -> ImageFeatures {
        let enc = MlxVisionEncoder::load(ck, NormEps::F32).unwrap();
        mac_decoder::vision::encode_image_bytes(&enc, &image_png()).unwrap()
    }

    fn embeds(f: &[ImageFeatures]) -> ImageEmbeds {
        mac_decoder::vision::image_embeds(f)
    }

    #[test]
    fn mm_logits_through_the_mlx_decoder() {
        let g = Golden::load();
        let dir = k3_protocol::testdata::golden_dir("tiny-a");
        let ck = k3_protocol::Checkpoint::open(&dir).unwrap();
        let features = [mlx_features(&ck)];
        let pad = ck.config().media_placeholder_token_id;
        let e = expand_media(&g.ids("mm.input_ids"), pad, &features).unwrap();
        let engine = Engine::load(&dir).unwrap();
        let mut s = engine.new_session().unwrap();
        let logits = engine.prefill_logits(&mut s, &e.ids, Some(&embeds(&features))).unwrap();
        let vocab = engine.text_config().vocab_size;
        let (row, err) = worst_row(&logits, &g.f32("mm.logits"), vocab);
        eprintln!("MLX decoder mm.logits: worst row {row}, relative error {err:.2e}");
        assert!(err <= 1e-3, "mm.logits row {row}: {err:.2e}");
    }

    /// The prompt with the image prefilled by the CPU reference prefiller (as the GPU node
    /// would), its hand-off state ingested by the MLX decoder, gives the same greedy tokens as
    /// a local MLX prefill of the same prompt and image.
    #[test]
    fn remote_style_prefill_gives_the_local_greedy_tokens() {
        let g = Golden::load();
        let dir = k3_protocol::testdata::golden_dir("tiny-a");
        let ck = Arc::new(k3_protocol::Checkpoint::open(&dir).unwrap());
        let features = [mlx_features(&ck)];
        let pad = ck.config().media_placeholder_token_id;
        let e = expand_media(&g.ids("mm.input_ids"), pad, &features).unwrap();
        let steps = 8;
        let engine = Engine::load(&dir).unwrap();

        let mut local = engine.new_session().unwrap();
        let l = engine.prefill_logits(&mut local, &e.ids, Some(&embeds(&features))).unwrap();
        let vocab = engine.text_config().vocab_size;
        let mut want = vec![argmax(&l[l.len() - vocab..])];
        for _ in 1..steps {
            want.push(argmax(&engine.step(&mut local, *want.last().unwrap()).unwrap()));
        }

        let model =
            cuda_prefiller::model::Model::new(Arc::new(cuda_prefiller::cpu::CpuBackend), ck.clone(), cuda_prefiller::model::WeightPolicy::Resident).unwrap();
        let ov =
            EmbeddingOverrides { positions: e.overrides.iter().map(|o| o.0).collect(), rows: e.overrides.iter().flat_map(|o| o.1.iter().copied()).collect() };
        let mut st = HandoffState::empty(&model.cfg);
        let opts = ExecOptions { logits: executor::LogitsRows::Last, ..ExecOptions::default() };
        let out = executor::prefill(&model, &mut st, PrefillInput { tokens: &e.ids, overrides: Some(&ov) }, &opts, |_| Ok(())).unwrap();
        let mut remote = engine.new_session().unwrap();
        engine.ingest(&mut remote, 0, &st, Some(out.logits[out.logits.len() - vocab..].to_vec())).unwrap();
        let mut got = vec![argmax(remote.last_logits().unwrap())];
        for _ in 1..steps {
            got.push(argmax(&engine.step(&mut remote, *got.last().unwrap()).unwrap()));
        }
        assert_eq!(got, want, "greedy tokens after a remote-style prefill differ from the local prefill");
    }
}
