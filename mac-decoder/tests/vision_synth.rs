//! Vision on synthetic models (protocol's synth, release layout) with other vision widths, head
//! counts, qkv widths, depths and position tables: there is no golden, so the invariants are
//! checked — shapes, the grid rule, token counts, the MLX tower equal to the CPU reference, and
//! (with MLX) a multimodal prompt prefilled locally equal to the CPU prefiller's logits.

use std::sync::Arc;

use k3_protocol::synth::{presets::Overrides, write_model, Preset, SynthOptions};
use mac_decoder::vision::preprocess::{preprocess_image, resize_plan};
use mac_decoder::vision::resample::Image8;
use mac_decoder::vision::{reference, MediaProcConfig, NormEps, ReferenceEncoder, VisionEncoder, VisionWeights};

struct Variant {
    name: &'static str,
    ov: Overrides,
}

fn variants() -> Vec<Variant> {
    let v = |layers, hidden, heads, qkv, inter, pos| Overrides {
        vision_layers: Some(layers),
        vision_hidden: Some(hidden),
        vision_heads: Some(heads),
        vision_qkv: Some(qkv),
        vision_intermediate: Some(inter),
        vision_pos: Some(pos),
        ..Overrides::default()
    };
    vec![
        Variant { name: "3 heads x 16, qkv = hidden, pos 6", ov: v(3, 48, 3, 48, 80, 6) },
        Variant { name: "4 heads x 24, qkv 96 > hidden 64, pos 12", ov: v(2, 64, 4, 96, 96, 12) },
        Variant { name: "1 head x 32, 1 layer, pos 3", ov: v(1, 32, 1, 32, 64, 3) },
    ]
}

fn synth(dir: &std::path::Path, ov: &Overrides, seed: u64) -> k3_protocol::Checkpoint {
    let mut o = SynthOptions::new(Preset::Tiny);
    o.overrides = ov.clone();
    o.seed = seed;
    o.tokenizer = false;
    write_model(dir, &o).expect("synth model");
    k3_protocol::Checkpoint::open(dir).expect("synth checkpoint opens")
}

fn image(w: usize, h: usize, alpha: bool) -> Image8 {
    let ch = if alpha { 4 } else { 3 };
    let data = (0..w * h * ch).map(|i| ((i * 2654435761usize) >> 7) as u8).collect();
    Image8::new(w, h, ch, data)
}

const SIZES: [(usize, usize, bool); 6] = [(1, 1, false), (5, 3, true), (81, 49, false), (150, 9, false), (13, 120, true), (64, 64, true)];

#[test]
fn synthetic_vision_configs_shapes_tokens_and_reference() {
    for (i, v) in variants().iter().enumerate() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = synth(tmp.path(), &v.ov, 11 + i as u64);
        let enc = ReferenceEncoder::load(&ck, NormEps::Bf16).unwrap();
        let c = enc.vision_config().clone();
        assert_eq!(enc.weights.blocks.len(), c.vt_num_hidden_layers, "{}", v.name);
        for &(w, h, alpha) in &SIZES {
            let img = preprocess_image(&image(w, h, alpha), enc.media_config()).unwrap();
            let plan = resize_plan(w, h, enc.media_config()).unwrap();
            assert_eq!(img.grid_thw, plan.grid_thw);
            let t = enc.encode_trace(&img).unwrap();
            let [_, gh, gw] = img.grid_thw;
            assert_eq!((t.n_patches, t.rows), (gh * gw, (gh / 2) * (gw / 2)), "{} {w}x{h}", v.name);
            assert_eq!(t.rows, plan.num_tokens);
            assert_eq!(t.embed.len(), gh * gw * c.vt_hidden_size);
            assert_eq!(t.merged.len(), t.rows * 4 * c.vt_hidden_size);
            assert_eq!(t.output.len(), t.rows * c.text_hidden_size);
            assert!(t.output.iter().all(|x| x.is_finite()), "{} {w}x{h}", v.name);
            // Post-norm rows: RMS ≈ the gain's scale, never 0 or huge.
            let rms = (t.output[..c.text_hidden_size].iter().map(|x| x * x).sum::<f32>() / c.text_hidden_size as f32).sqrt();
            assert!(rms > 0.2 && rms < 3.0, "{} {w}x{h}: output row RMS {rms}", v.name);
        }
    }
}

#[test]
fn one_image_is_independent_of_another() {
    // Per-image encoding (no cross-image attention): a patch grid's features depend only on
    // that image.
    let tmp = tempfile::tempdir().unwrap();
    let ck = synth(tmp.path(), &variants()[0].ov, 3);
    let w = VisionWeights::load(&ck).unwrap();
    let media = MediaProcConfig::load(ck.dir(), &w.cfg, mac_decoder::memory::budget(None, 0)).unwrap();
    let a = preprocess_image(&image(40, 30, false), &media).unwrap();
    let r1 = reference::encode(&w, &a, NormEps::Bf16).unwrap();
    let r2 = reference::encode(&w, &a, NormEps::Bf16).unwrap();
    assert_eq!(r1, r2);
    // And it does depend on the pixels.
    let b = preprocess_image(&image(41, 30, false), &media).unwrap();
    assert_eq!(a.grid_thw, b.grid_thw);
    assert_ne!(reference::encode(&w, &b, NormEps::Bf16).unwrap().output, r1.output);
}

#[cfg(feature = "mlx")]
mod mlx {
    use super::*;
    use cuda_prefiller::executor::{self, EmbeddingOverrides, ExecOptions, PrefillInput};
    use k3_protocol::HandoffState;
    use mac_decoder::decode::{Engine, ImageEmbeds};
    use mac_decoder::vision::{expand_media, MlxVisionEncoder};

    fn max_row_rel(a: &[f32], b: &[f32], width: usize) -> f64 {
        a.chunks(width)
            .zip(b.chunks(width))
            .map(|(o, g)| {
                let num: f64 = o.iter().zip(g).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
                let den: f64 = g.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().max(1e-30);
                (num / den).sqrt()
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn mlx_tower_equals_reference_and_local_prefill_equals_cpu_prefiller() {
        for (i, v) in variants().iter().enumerate() {
            let tmp = tempfile::tempdir().unwrap();
            let ck = Arc::new(synth(tmp.path(), &v.ov, 21 + i as u64));
            let cpu = ReferenceEncoder::load(&ck, NormEps::Bf16).unwrap();
            let gpu = MlxVisionEncoder::load(&ck, NormEps::Bf16).unwrap();
            let mut feats = Vec::new();
            for &(w, h, alpha) in &SIZES {
                let img = preprocess_image(&image(w, h, alpha), cpu.media_config()).unwrap();
                let a = gpu.encode_trace(&img).unwrap();
                let b = cpu.encode_trace(&img).unwrap();
                let c = cpu.vision_config();
                for (stage, x, y, width) in [
                    ("embed", &a.embed, &b.embed, c.vt_hidden_size),
                    ("encoder", &a.encoder, &b.encoder, c.vt_hidden_size),
                    ("merged", &a.merged, &b.merged, 4 * c.vt_hidden_size),
                    ("output", &a.output, &b.output, c.text_hidden_size),
                ] {
                    let e = max_row_rel(x, y, width);
                    assert!(e <= 1e-4, "{} {w}x{h} {stage}: MLX vs reference {e:.2e}", v.name);
                }
                if feats.len() < 2 {
                    feats.push(gpu.encode(&img).unwrap());
                }
            }

            // A two-image prompt: MLX local prefill vs the CPU prefiller with overrides.
            let cfg = ck.config();
            let pad = cfg.media_placeholder_token_id;
            let ids: Vec<u32> = [5, 17, 300, pad, 42, 9, pad, 77, 8].to_vec();
            let e = expand_media(&ids, pad, &feats).unwrap();
            assert_eq!(e.ids.len(), ids.len() - 2 + feats[0].rows + feats[1].rows);
            let engine = Engine::load(ck.dir()).unwrap();
            let mut s = engine.new_session().unwrap();
            let embeds = ImageEmbeds { rows: feats.iter().map(|f| f.rows).sum(), data: feats.iter().flat_map(|f| f.data.iter().copied()).collect() };
            let local = engine.prefill_logits(&mut s, &e.ids, Some(&embeds)).unwrap();
            let model = cuda_prefiller::model::Model::new(Arc::new(cuda_prefiller::cpu::CpuBackend), ck.clone(), cuda_prefiller::model::WeightPolicy::Resident)
                .unwrap();
            let ov = EmbeddingOverrides {
                positions: e.overrides.iter().map(|o| o.0).collect(),
                rows: e.overrides.iter().flat_map(|o| o.1.iter().copied()).collect(),
            };
            let mut st = HandoffState::empty(&model.cfg);
            let out = executor::prefill(&model, &mut st, PrefillInput { tokens: &e.ids, overrides: Some(&ov) }, &ExecOptions::default(), |_| Ok(())).unwrap();
            let err = max_row_rel(&local, &out.logits, cfg.text_config.vocab_size);
            assert!(err <= 1e-3, "{}: MLX local prefill vs CPU prefiller logits {err:.2e}", v.name);
            // The image rows matter: without them (plain pad embeddings) the logits change.
            let model_plain =
                executor::prefill(&model, &mut HandoffState::empty(&model.cfg), PrefillInput::tokens(&e.ids), &ExecOptions::default(), |_| Ok(())).unwrap();
            assert!(max_row_rel(&model_plain.logits, &out.logits, cfg.text_config.vocab_size) > 1e-2);
        }
    }
}
