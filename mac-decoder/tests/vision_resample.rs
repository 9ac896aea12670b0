//! Our bicubic resize against Pillow's (fixtures in tests/data/vision_resize, made by
//! Pillow 13.0.0): bit-exact, RGB and premultiplied RGBA, up, down, one axis, very wide.

use mac_decoder::vision::preprocess::decode;
use mac_decoder::vision::resample::{resize_channels, resize_rgba};

const CASES: [(&str, usize, usize); 7] =
    [("rgb_down", 40, 25), ("rgb_up", 75, 50), ("rgb_h_only", 33, 7), ("rgb_v_only", 9, 31), ("rgb_wide", 224, 14), ("rgba_down", 23, 17), ("rgba_up", 27, 21)];

#[test]
fn bicubic_resize_equals_pillow() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vision_resize");
    let mut bad = Vec::new();
    for (name, w, h) in CASES {
        let src = decode(&std::fs::read(dir.join(format!("{name}.in.png"))).unwrap()).unwrap();
        let want = decode(&std::fs::read(dir.join(format!("{name}.out.png"))).unwrap()).unwrap();
        assert_eq!((want.width, want.height, want.channels), (w, h, src.channels), "{name}");
        let got = if src.channels == 4 { resize_rgba(&src, w, h) } else { resize_channels(&src, w, h) };
        let diff = got.data.iter().zip(&want.data).filter(|(a, b)| a != b).count();
        let max = got.data.iter().zip(&want.data).map(|(a, b)| (*a as i32 - *b as i32).abs()).max().unwrap();
        if diff > 0 {
            bad.push(format!("{name}: {diff} of {} bytes differ (max {max})", want.data.len()));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// A transparent image that the rule shrinks (one-side limit 4 patches), through the whole
/// pre-processing, against the same steps written with numpy + Pillow (make_pipeline.py).
#[test]
fn transparent_resized_image_pipeline_equals_numpy_pillow() {
    use mac_decoder::vision::{preprocess_bytes, MediaProcConfig};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/vision_resize");
    let cfg = MediaProcConfig { patch_limit_on_one_side: 4, ..MediaProcConfig::k3_default() };
    let img = preprocess_bytes(&std::fs::read(dir.join("pipeline.in.png")).unwrap(), &cfg).unwrap();
    assert_eq!((img.plan.new_width, img.plan.new_height, img.plan.pad_width, img.plan.pad_height), (56, 16, 0, 12));
    assert_eq!(img.grid_thw, [1, 2, 4]);
    let want: Vec<f32> =
        std::fs::read(dir.join("pipeline.pixel_values.f32")).unwrap().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(img.pixel_values.len(), want.len());
    let diff: Vec<usize> = (0..want.len()).filter(|&i| img.pixel_values[i].to_bits() != want[i].to_bits()).collect();
    assert!(diff.is_empty(), "{} values differ, first at {:?}", diff.len(), diff.first());
}
