//! Image pre-processing against golden tiny-a (exact), plus the resize rule, background fill
//! and decoding on other sizes.

use std::path::PathBuf;

use mac_decoder::vision::media_config::{BgPattern, FillStage, MediaProcConfig};
use mac_decoder::vision::preprocess::{decode, fill_background, preprocess_bytes, preprocess_image, resize_plan};
use mac_decoder::vision::resample::Image8;
use safetensors::SafeTensors;

fn golden_dir() -> PathBuf {
    k3_protocol::testdata::golden_dir("tiny-a")
}

fn golden_bytes() -> Vec<u8> {
    std::fs::read(golden_dir().join("golden.safetensors")).expect("golden.safetensors")
}

fn tensor_f32(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("golden {name}: {e}"));
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
}

fn tensor_i64(st: &SafeTensors, name: &str) -> Vec<i64> {
    let t = st.tensor(name).unwrap();
    t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect()
}

fn tiny_cfg() -> MediaProcConfig {
    let ck = k3_protocol::K3Config::load(&golden_dir()).expect("tiny-a config");
    MediaProcConfig::for_vision(&ck.vision_config)
}

#[test]
fn tiny_a_pixels_and_grid_equal_golden_exactly() {
    let bytes = golden_bytes();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let png = std::fs::read(golden_dir().join("image.png")).unwrap();
    let img = preprocess_bytes(&png, &tiny_cfg()).expect("preprocess image.png");
    let grid = tensor_i64(&st, "vision.grid_thw");
    assert_eq!(img.grid_thw.iter().map(|&v| v as i64).collect::<Vec<_>>(), grid);
    let (shape, golden) = tensor_f32(&st, "vision.pixel_values");
    assert_eq!(shape, vec![img.n_patches(), 3, 14, 14]);
    assert_eq!(img.pixel_values.len(), golden.len());
    let bad: Vec<usize> = (0..golden.len()).filter(|&i| img.pixel_values[i].to_bits() != golden[i].to_bits()).take(5).collect();
    assert!(bad.is_empty(), "pixel_values differ at {bad:?}: {:?}", bad.iter().map(|&i| (img.pixel_values[i], golden[i])).collect::<Vec<_>>());
    assert_eq!(img.original_size, (80, 50));
    assert_eq!(img.num_tokens(), 6);
}

#[test]
fn decoded_png_equals_golden_rgb() {
    let bytes = golden_bytes();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("vision.image_rgb").unwrap();
    let png = std::fs::read(golden_dir().join("image.png")).unwrap();
    let img = decode(&png).unwrap();
    assert_eq!((img.height, img.width, img.channels), (t.shape()[0], t.shape()[1], t.shape()[2]));
    assert_eq!(img.data, t.data());
}

#[test]
fn spec_examples_of_the_resize_rule() {
    let cfg = MediaProcConfig::k3_default();
    // spec §5.1: 100×100 → 112×112 → grid 8×8 → 16 tokens; 896² → 64×64 → 1024 tokens.
    let p = resize_plan(100, 100, &cfg).unwrap();
    assert_eq!((p.new_width, p.new_height, p.pad_width, p.pad_height), (100, 100, 12, 12));
    assert_eq!((p.grid_thw, p.num_tokens), ([1, 8, 8], 16));
    let p = resize_plan(896, 896, &cfg).unwrap();
    assert_eq!((p.grid_thw, p.num_tokens), ([1, 64, 64], 1024));
    // 4000×3000 is inside every budget (285·214 < 65536 patches): grid 216×286, 15,444 tokens.
    let p = resize_plan(4000, 3000, &cfg).unwrap();
    assert_eq!((p.new_width, p.new_height), (4000, 3000));
    assert_eq!((p.grid_thw, p.num_tokens), ([1, 216, 286], 15444));
    // 10000×1000: the one-side limit (512 patches = 7168 px) sets s = 0.7168.
    let p = resize_plan(10000, 1000, &cfg).unwrap();
    assert_eq!((p.new_width, p.new_height, p.grid_thw, p.num_tokens), (7168, 716, [1, 52, 512], 6656));
    // 8000×6000: the patch budget gives s = sqrt(65536 / (571·428)) → 4142×3107, whose padded
    // grid is 16428 tokens > 16384; the budget shrinks until it fits.
    let p = resize_plan(8000, 6000, &cfg).unwrap();
    assert!(p.new_width < 4142 && p.new_height < 3107 && p.num_tokens <= 16384, "{p:?}");
    assert_eq!(p.num_tokens, (p.grid_thw[1] / 2) * (p.grid_thw[2] / 2));
    // 3585²: 256² patches fit the budget, but padding makes 129² = 16641 tokens > 16384, so the
    // budget shrinks until the padded grid fits.
    let p = resize_plan(3585, 3585, &cfg).unwrap();
    assert!(p.new_width < 3585 && p.num_tokens <= 16384, "{p:?}");
}

#[test]
fn resize_rule_invariants_over_many_sizes() {
    let cfg = MediaProcConfig::k3_default();
    let sizes = [
        (1, 1),
        (13, 1),
        (1, 13),
        (27, 29),
        (28, 28),
        (29, 27),
        (81, 49),
        (7168, 7168),
        (7169, 5),
        (100_000, 30),
        (30, 100_000),
        (20_000, 20_000),
        (3585, 3585),
        (5000, 3000),
        (12345, 678),
    ];
    for (w, h) in sizes {
        let p = resize_plan(w, h, &cfg).unwrap();
        let [t, gh, gw] = p.grid_thw;
        assert_eq!(t, 1);
        assert!(p.new_width >= 1 && p.new_height >= 1 && p.new_width <= w && p.new_height <= h, "{w}x{h}: {p:?}");
        assert_eq!((p.new_width + p.pad_width) % 28, 0, "{w}x{h}");
        assert_eq!((p.new_height + p.pad_height) % 28, 0, "{w}x{h}");
        assert!(p.pad_width < 28 && p.pad_height < 28);
        assert_eq!((gh * 14, gw * 14), (p.new_height + p.pad_height, p.new_width + p.pad_width));
        assert!(gh <= 512 && gw <= 512, "{w}x{h}: grid {gh}x{gw}");
        assert!(p.num_tokens <= 16384, "{w}x{h}: {} tokens", p.num_tokens);
        assert_eq!(p.num_tokens, gh / 2 * (gw / 2));
        let unresized_tokens = w.div_ceil(28) * h.div_ceil(28);
        if w <= 512 * 14 && h <= 512 * 14 && (w / 14).max(1) * (h / 14).max(1) <= 65536 && unresized_tokens <= 16384 {
            // Within every budget, nothing is resized.
            assert_eq!((p.new_width, p.new_height), (w, h), "{w}x{h}");
        }
    }
}

fn png_bytes(img: &Image8) -> Vec<u8> {
    let mut out = Vec::new();
    let enc = image::codecs::png::PngEncoder::new(&mut out);
    let ct = if img.channels == 4 { image::ExtendedColorType::Rgba8 } else { image::ExtendedColorType::Rgb8 };
    image::ImageEncoder::write_image(enc, &img.data, img.width as u32, img.height as u32, ct).unwrap();
    out
}

fn denorm(v: f32) -> f32 {
    (v * 0.5 + 0.5) * 255.0
}

#[test]
fn fully_transparent_image_becomes_the_chessboard() {
    let cfg = MediaProcConfig::k3_default();
    let img = Image8::new(56, 30, 4, vec![0; 56 * 30 * 4]);
    let out = preprocess_bytes(&png_bytes(&img), &cfg).unwrap();
    assert_eq!(out.grid_thw, [1, 4, 4]);
    let p = 14;
    let at = |x: usize, y: usize, c: usize| {
        let (gx, gy, kx, ky) = (x / p, y / p, x % p, y % p);
        out.pixel_values[((gy * 4 + gx) * 3 + c) * p * p + ky * p + kx]
    };
    for y in 0..56 {
        for x in 0..56 {
            let v = denorm(at(x, y, 1));
            let expect = if y >= 30 {
                0.0
            } else if ((x / 8) + (y / 8)) % 2 == 0 {
                255.0
            } else {
                180.0
            };
            assert!((v - expect).abs() < 1e-3, "({x},{y}) = {v}, expected {expect}");
        }
    }
}

#[test]
fn semi_transparent_pixels_blend_and_opaque_pixels_stay() {
    let mut img = Image8::new(16, 8, 4, vec![0; 16 * 8 * 4]);
    for (i, px) in img.data.chunks_exact_mut(4).enumerate() {
        let x = i % 16;
        px.copy_from_slice(if x < 8 { &[10, 20, 30, 255] } else { &[0, 0, 0, 128] });
    }
    let bg = BgPattern::Chessboard { square: 8, white_top_left: true, white: 255, gray: 180 };
    let rgb = fill_background(&img, &bg);
    assert_eq!(&rgb.data[..3], &[10, 20, 30]);
    // x = 8: second square (gray 180); 0·a + (1 − 128/255)·180 truncated.
    let expect = ((1.0f32 - 128.0 / 255.0) * 180.0) as u8;
    assert_eq!(rgb.data[8 * 3], expect);
}

#[test]
fn alpha_is_dropped_without_a_background_config() {
    let cfg = MediaProcConfig { transparent_bg: None, ..MediaProcConfig::k3_default() };
    let img = Image8::new(28, 28, 4, [200u8, 100, 50, 0].repeat(28 * 28));
    let out = preprocess_bytes(&png_bytes(&img), &cfg).unwrap();
    assert!((denorm(out.pixel_values[0]) - 200.0).abs() < 1e-3);
}

#[test]
fn fill_stage_before_resize_differs_from_after() {
    let mut cfg = MediaProcConfig { patch_limit_on_one_side: 4, ..MediaProcConfig::k3_default() };
    let img = Image8::new(300, 300, 4, vec![0; 300 * 300 * 4]);
    let after = preprocess_image(&img, &cfg).unwrap();
    cfg.fill_stage = FillStage::BeforeResize;
    let before = preprocess_image(&img, &cfg).unwrap();
    assert_eq!(after.grid_thw, before.grid_thw);
    assert_eq!(after.grid_thw, [1, 4, 4]);
    assert_ne!(after.pixel_values, before.pixel_values);
}

#[test]
fn odd_wide_tall_and_tiny_images() {
    let cfg = MediaProcConfig::k3_default();
    for (w, h) in [(1, 1), (3, 2), (81, 49), (1000, 3), (5, 777), (8000, 40)] {
        let data: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 251) as u8).collect();
        let img = Image8::new(w, h, 3, data);
        let out = preprocess_bytes(&png_bytes(&img), &cfg).unwrap();
        let plan = resize_plan(w, h, &cfg).unwrap();
        assert_eq!(out.grid_thw, plan.grid_thw);
        assert_eq!(out.pixel_values.len(), out.n_patches() * 3 * 14 * 14);
        assert_eq!(out.original_size, (w, h));
        assert!(out.pixel_values.iter().all(|v| (-1.0..=1.0).contains(v)));
        // The padding (right of new_width, below new_height) is black = −1.
        let [_, gh, gw] = out.grid_thw;
        let p = 14;
        let y = gh * p - 1;
        if plan.pad_height > 0 {
            let (gy, ky) = (y / p, y % p);
            for c in 0..3 {
                assert_eq!(out.pixel_values[((gy * gw) * 3 + c) * p * p + ky * p], -1.0, "{w}x{h}");
            }
        }
        if plan.new_width == w && plan.new_height == h {
            // Not resized: the first pixel is the source pixel.
            assert!((denorm(out.pixel_values[0]) - img.data[0] as f32).abs() < 1e-3, "{w}x{h}");
        }
    }
}

#[test]
fn jpeg_and_webp_decode() {
    let img = Image8::new(40, 30, 3, (0..40 * 30 * 3).map(|i| (i % 256) as u8).collect());
    let mut jpg = Vec::new();
    image::ImageEncoder::write_image(image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpg, 95), &img.data, 40, 30, image::ExtendedColorType::Rgb8)
        .unwrap();
    let d = decode(&jpg).unwrap();
    assert_eq!((d.width, d.height, d.channels), (40, 30, 3));
    let mut webp = Vec::new();
    image::ImageEncoder::write_image(image::codecs::webp::WebPEncoder::new_lossless(&mut webp), &img.data, 40, 30, image::ExtendedColorType::Rgb8).unwrap();
    let d = decode(&webp).unwrap();
    assert_eq!(d.data, img.data);
}

#[test]
fn bad_input_gets_an_error_not_a_panic() {
    assert!(decode(b"not an image").is_err());
    assert!(decode(&[]).is_err());
    let png = std::fs::read(golden_dir().join("image.png")).unwrap();
    for cut in [8, 30, 100, png.len() / 2, png.len() - 5] {
        assert!(decode(&png[..cut]).is_err(), "truncated at {cut}");
    }
    let gif = b"GIF89a\x01\x00\x01\x00\x00\x00\x00;";
    let e = decode(gif).unwrap_err().to_string();
    assert!(e.contains("format"), "{e}");
}

#[test]
fn preprocessor_config_json() {
    let text = r#"{"media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536,
        "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 16384, "fixed_output_tokens": null,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "sample_fps": 8.0,
        "temporal_merge_kernel_size": 4,
        "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
            "chessboard_square_on_top_left": true, "chessboard_white_value": 255, "chessboard_gray_value": 180},
        "transparent_bg_fill_stage": "after_resize"}}"#;
    assert_eq!(MediaProcConfig::from_json(text).unwrap(), MediaProcConfig::k3_default());
    let no_bg = r#"{"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536, "patch_limit_on_one_side": 512}"#;
    let c = MediaProcConfig::from_json(no_bg).unwrap();
    assert_eq!((c.transparent_bg, c.fill_stage), (None, FillStage::BeforeResize));
    assert!(MediaProcConfig::from_json(r#"{"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 1, "patch_limit_on_one_side": 512}"#).is_err());
    assert!(MediaProcConfig::from_json(
        r#"{"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 100, "patch_limit_on_one_side": 512, "fixed_output_tokens": 64}"#
    )
    .is_err());
}
