//! The MLX tower and projector: against golden tiny-a stage by stage, and against the CPU
//! reference on other vision configs and image sizes (odd, wide, tall, tiny, transparent).
#![cfg(feature = "mlx")]

use mac_decoder::vision::resample::Image8;
use mac_decoder::vision::{preprocess::preprocess_image, reference, MediaProcConfig, MlxVisionEncoder, NormEps, VisionEncoder, VisionTrace, VisionWeights};
use safetensors::SafeTensors;

fn golden_f32(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("golden {name}: {e}"));
    t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn max_row_rel(out: &[f32], golden: &[f32], width: usize) -> f64 {
    assert_eq!(out.len(), golden.len());
    out.chunks(width)
        .zip(golden.chunks(width))
        .map(|(o, g)| {
            let num: f64 = o.iter().zip(g).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
            let den: f64 = g.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().max(1e-30);
            (num / den).sqrt()
        })
        .fold(0.0, f64::max)
}

fn compare(a: &VisionTrace, b: &VisionTrace, d: usize, text: usize) -> Vec<(&'static str, f64)> {
    assert_eq!((a.n_patches, a.rows), (b.n_patches, b.rows));
    vec![
        ("embed", max_row_rel(&a.embed, &b.embed, d)),
        ("encoder", max_row_rel(&a.encoder, &b.encoder, d)),
        ("merged", max_row_rel(&a.merged, &b.merged, 4 * d)),
        ("output", max_row_rel(&a.output, &b.output, text)),
    ]
}

#[test]
fn mlx_tower_matches_golden_tiny_a() {
    let dir = k3_protocol::testdata::golden_dir("tiny-a");
    let ck = k3_protocol::Checkpoint::open(&dir).unwrap();
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let png = std::fs::read(dir.join("image.png")).unwrap();
    let mut report = String::new();
    let mut worst = 0f64;
    for (eps, out_name) in [(NormEps::F32, "vision.output"), (NormEps::Bf16, "vision.output_bf16eps")] {
        let enc = MlxVisionEncoder::load(&ck, eps).unwrap();
        let img = mac_decoder::vision::preprocess_bytes(&png, enc.media_config()).unwrap();
        let t = enc.encode_trace(&img).unwrap();
        let (d, text) = (enc.cfg.vt_hidden_size, enc.cfg.text_hidden_size);
        let mut cases = vec![(out_name, &t.output, text)];
        if eps == NormEps::F32 {
            // The golden intermediates come from the float32-eps run.
            cases.extend([("vision.embed", &t.embed, d), ("vision.encoder", &t.encoder, d), ("vision.merged", &t.merged, 4 * d)]);
        }
        for (name, out, width) in cases {
            let e = max_row_rel(out, &golden_f32(&st, name), width);
            report += &format!("{name}: max row rel {e:.2e}\n");
            worst = worst.max(e);
        }
        // The public entry point gives the same rows.
        let f = mac_decoder::vision::encode_image_bytes(&enc, &png).unwrap();
        assert_eq!((f.rows, f.dim, f.original_size), (6, text, (80, 50)));
        assert_eq!(f.data, t.output);
    }
    eprint!("{report}");
    assert!(worst <= 1e-4, "MLX vs golden:\n{report}");
}

fn config(
    base: &k3_protocol::VisionConfig,
    d: usize,
    heads: usize,
    qkv: usize,
    inter: usize,
    layers: usize,
    pos: (usize, usize),
    text: usize,
) -> k3_protocol::VisionConfig {
    let mut c = base.clone();
    c.vt_hidden_size = d;
    c.mm_hidden_size = d;
    c.vt_num_attention_heads = heads;
    c.qkv_hidden_size = qkv;
    c.vt_intermediate_size = inter;
    c.vt_num_hidden_layers = layers;
    c.init_pos_emb_height = pos.0;
    c.init_pos_emb_width = pos.1;
    c.text_hidden_size = text;
    c.validate(text).unwrap();
    c
}

fn test_image(w: usize, h: usize, alpha: bool, seed: usize) -> Image8 {
    let ch = if alpha { 4 } else { 3 };
    let mut data = Vec::with_capacity(w * h * ch);
    for y in 0..h {
        for x in 0..w {
            data.extend_from_slice(&[(x * 7 + y * 3 + seed) as u8, (x * x + 2 * y * y) as u8, (255 + 6 * y - 4 * x % 256) as u8]);
            if alpha {
                data.push(((x + y) * 37 % 256) as u8);
            }
        }
    }
    Image8::new(w, h, ch, data)
}

#[test]
fn mlx_tower_matches_reference_on_other_configs_and_sizes() {
    let base = k3_protocol::K3Config::load(&k3_protocol::testdata::golden_dir("tiny-a")).unwrap().vision_config;
    let configs = [
        // qkv width ≠ hidden (as in K3: 1536 vs 1024), odd head count, non-square position table.
        config(&base, 48, 3, 48, 80, 3, (6, 10), 40),
        config(&base, 64, 4, 96, 96, 2, (16, 16), 72),
    ];
    let images = [(1, 1, false), (81, 49, false), (300, 20, false), (17, 140, true), (56, 56, true)];
    let mut report = String::new();
    let mut worst = 0f64;
    for (ci, cfg) in configs.iter().enumerate() {
        let w = VisionWeights::synthetic(cfg, 7 + ci as u64);
        // A small patch budget so that the wide image is resized (exercises the resize path).
        let media = MediaProcConfig { patch_limit_on_one_side: 16, ..MediaProcConfig::for_vision(cfg) };
        for eps in [NormEps::Bf16, NormEps::F32] {
            let enc = MlxVisionEncoder::new(&w, media.clone(), eps).unwrap();
            for (i, &(iw, ih, alpha)) in images.iter().enumerate() {
                let img = preprocess_image(&test_image(iw, ih, alpha, i), &media).unwrap();
                let [_, gh, gw] = img.grid_thw;
                assert!(gh <= 16 && gw <= 16, "{iw}x{ih}: grid {gh}x{gw}");
                let mlx = enc.encode_trace(&img).unwrap();
                let cpu = reference::encode(&w, &img, eps).unwrap();
                assert_eq!(mlx.rows, gh * gw / 4);
                assert_eq!(mlx.output.len(), mlx.rows * cfg.text_hidden_size);
                for (stage, e) in compare(&mlx, &cpu, cfg.vt_hidden_size, cfg.text_hidden_size) {
                    if e > 1e-5 {
                        report += &format!("config {ci} {eps:?} {iw}x{ih} {stage}: {e:.2e}\n");
                    }
                    worst = worst.max(e);
                }
            }
        }
    }
    eprintln!("worst MLX vs reference: {worst:.2e}\n{report}");
    assert!(worst <= 1e-4, "MLX vs reference:\n{report}");
}

#[test]
fn bad_grids_are_rejected() {
    let base = k3_protocol::K3Config::load(&k3_protocol::testdata::golden_dir("tiny-a")).unwrap().vision_config;
    let w = VisionWeights::synthetic(&base, 1);
    let media = MediaProcConfig::for_vision(&base);
    let enc = MlxVisionEncoder::new(&w, media.clone(), NormEps::Bf16).unwrap();
    let mut img = preprocess_image(&test_image(30, 30, false, 0), &media).unwrap();
    img.grid_thw = [1, 3, 4];
    assert!(enc.encode_trace(&img).is_err());
    img.grid_thw = [2, 2, 2];
    assert!(enc.encode_trace(&img).is_err());
}

#[test]
fn attention_in_query_blocks_equals_one_block() {
    let base = k3_protocol::K3Config::load(&k3_protocol::testdata::golden_dir("tiny-a")).unwrap().vision_config;
    let w = VisionWeights::synthetic(&base, 5);
    let media = MediaProcConfig::for_vision(&base);
    let img = preprocess_image(&test_image(100, 70, false, 3), &media).unwrap();
    let n = img.n_patches();
    let whole = MlxVisionEncoder::new(&w, media.clone(), NormEps::Bf16).unwrap().encode_trace(&img).unwrap();
    // 7 query rows per block (uneven last block), and 1 row per block.
    for rows in [7, 1] {
        let mut enc = MlxVisionEncoder::new(&w, media.clone(), NormEps::Bf16).unwrap();
        enc.tower.set_attention_score_bytes(rows * base.vt_num_attention_heads * n * 4);
        let blocked = enc.encode_trace(&img).unwrap();
        let e = max_row_rel(&blocked.output, &whole.output, base.text_hidden_size);
        assert!(e <= 1e-6, "{rows}-row blocks vs one block: {e:.2e}");
    }
}
