//! Memory-bounded vision (issue 21): the tower's attention query blocks are evaluated one by
//! one, so the scores alive at once stay near one block (MLX is lazy; unevaluated blocks were all
//! materialised together, and one small PNG took the decoder to 21 GB). Images whose patch count
//! the machine's memory cannot hold are refused with a clear error.
#![cfg(feature = "mlx")]

use mac_decoder::vision::media_config::{attention_score_bytes, memory_patch_limit, tower_bytes_per_patch};
use mac_decoder::vision::preprocess::preprocess_image;
use mac_decoder::vision::resample::Image8;
use mac_decoder::vision::{MediaProcConfig, MlxVisionEncoder, NormEps, VisionWeights};

fn flat_image(w: usize, h: usize) -> Image8 {
    let data = (0..w * h * 3).map(|i| (i * 31 % 251) as u8).collect();
    Image8::new(w, h, 3, data)
}

#[test]
fn attention_blocks_are_evaluated_one_at_a_time() {
    let base = k3_protocol::K3Config::load(&k3_protocol::testdata::golden_dir("tiny-a")).unwrap().vision_config;
    let w = VisionWeights::synthetic(&base, 2);
    let media = MediaProcConfig::for_vision(&base);
    // 1120² pixels → 80 × 80 = 6400 patches: all scores together are 2 heads × 6400² × 4 B = 328 MB.
    let img = preprocess_image(&flat_image(1120, 1120), &media).unwrap();
    let n = img.n_patches();
    assert_eq!(n, 6400);
    let all_scores = base.vt_num_attention_heads * n * n * 4;
    let mut enc = MlxVisionEncoder::new(&w, media, NormEps::Bf16).unwrap();
    let block = 4 << 20;
    enc.tower.set_attention_score_bytes(block);
    mlx_rs::memory::reset_peak_memory().unwrap();
    let before = mlx_rs::memory::active_memory().unwrap();
    let out = enc.encode_array(&img).unwrap();
    out.eval().unwrap();
    let peak = mlx_rs::memory::peak_memory().unwrap().saturating_sub(before);
    eprintln!("peak MLX memory above the start: {:.1} MB (all scores at once: {:.1} MB)", peak as f64 / 1e6, all_scores as f64 / 1e6);
    assert!(peak > 0, "MLX reports no memory use: the measurement does not work here");
    assert!(peak < all_scores / 2, "peak {peak} B: the query blocks of {block} B were not evaluated one at a time (all scores: {all_scores} B)");
}

#[test]
fn images_beyond_the_memory_budget_are_refused_clearly() {
    let base = k3_protocol::K3Config::load(&k3_protocol::testdata::golden_dir("tiny-a")).unwrap().vision_config;
    let per = tower_bytes_per_patch(&base);
    // A small budget attends in the smallest blocks (1 MiB): 1000 patches beyond three of them.
    let budget = 3 * (1 << 20) + 1000 * per as u64;
    assert_eq!(attention_score_bytes(Some(budget)), 1 << 20);
    let limit = memory_patch_limit(&base, Some(budget));
    assert_eq!(limit, 1000);
    assert_eq!(memory_patch_limit(&base, None), usize::MAX);
    // A large one in blocks of a sixteenth of it, up to the default bound.
    assert_eq!(attention_score_bytes(Some(160 << 20)), 10 << 20);
    assert_eq!(attention_score_bytes(Some(1 << 40)), mac_decoder::vision::ATTN_SCORE_BYTES);
    assert_eq!(attention_score_bytes(None), mac_decoder::vision::ATTN_SCORE_BYTES);
    let media = MediaProcConfig { memory_patch_limit: limit, ..MediaProcConfig::for_vision(&base) };
    // 28 × 28 patches = 784: fits. 448 × 448 px = 32 × 32 = 1024 patches: refused.
    assert!(preprocess_image(&flat_image(392, 392), &media).is_ok());
    let e = preprocess_image(&flat_image(448, 448), &media).unwrap_err().to_string();
    assert!(e.contains("1024 patches") && e.contains("memory") && e.contains("smaller image"), "{e}");
}
