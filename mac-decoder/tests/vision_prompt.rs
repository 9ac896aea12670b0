//! Media-token expansion (spec §5.5) against golden tiny-a `mm.input_ids(_expanded)`.

use mac_decoder::vision::prompt::{expand_media, expand_media_ids, image_prompt_text, render_image_placeholders, PromptError, IMAGE_PLACEHOLDER};
use mac_decoder::vision::ImageFeatures;
use safetensors::SafeTensors;

fn golden_ids(st: &SafeTensors, name: &str) -> Vec<u32> {
    st.tensor(name).unwrap().data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect()
}

fn features(rows: usize, dim: usize, tag: f32) -> ImageFeatures {
    ImageFeatures { rows, dim, data: (0..rows * dim).map(|i| tag + i as f32).collect(), grid_thw: [1, 2, 2 * rows], original_size: (10, 10) }
}

#[test]
fn golden_mm_prompt_expands_to_golden_expanded_ids() {
    let dir = k3_protocol::testdata::golden_dir("tiny-a");
    let cfg = k3_protocol::K3Config::load(&dir).unwrap();
    let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = golden_ids(&st, "mm.input_ids");
    let expanded = golden_ids(&st, "mm.input_ids_expanded");
    let pad = cfg.media_placeholder_token_id;
    let n = expanded.len() + 1 - ids.len();
    let f = [features(n, 4, 0.0)];
    let e = expand_media(&ids, pad, &f).unwrap();
    assert_eq!(e.ids, expanded);
    let pads: Vec<usize> = (0..expanded.len()).filter(|&i| expanded[i] == pad).collect();
    assert_eq!(e.overrides.iter().map(|o| o.0).collect::<Vec<_>>(), pads);
    for (k, (_, row)) in e.overrides.iter().enumerate() {
        assert_eq!(*row, f[0].row(k));
    }
}

#[test]
fn several_images_take_their_rows_in_order() {
    let ids = [1, 2, 9, 3, 9, 9, 4];
    let f = [features(2, 3, 0.0), features(1, 3, 100.0), features(3, 3, 200.0)];
    let e = expand_media(&ids, 9, &f).unwrap();
    assert_eq!(e.ids, vec![1, 2, 9, 9, 3, 9, 9, 9, 9, 4]);
    let pos: Vec<usize> = e.overrides.iter().map(|o| o.0).collect();
    assert_eq!(pos, vec![2, 3, 5, 6, 7, 8]);
    assert_eq!(e.overrides[2].1, f[1].row(0));
    assert_eq!(e.overrides[5].1, f[2].row(2));
    let spans = expand_media_ids(&ids, 9, &[2, 1, 3]).unwrap().image_spans;
    assert_eq!(spans, vec![2..4, 5..6, 6..9]);
}

#[test]
fn count_mismatches_are_errors() {
    assert!(matches!(expand_media_ids(&[1, 9, 2], 9, &[]), Err(PromptError::CountMismatch { found: 1, expected: 0, .. })));
    assert!(matches!(expand_media_ids(&[1, 2], 9, &[4]), Err(PromptError::CountMismatch { found: 0, expected: 1, .. })));
    assert!(matches!(expand_media_ids(&[9], 9, &[0]), Err(PromptError::EmptyImage { image: 0 })));
    assert!(render_image_placeholders("a <|kimi_image_placeholder|>", IMAGE_PLACEHOLDER, &[]).is_err());
}

#[test]
fn placeholder_text_is_the_k3_media_block() {
    assert_eq!(image_prompt_text(80, 50, 1), "<|media_begin|>image 80x50<|media_content|><|media_pad|><|media_end|>");
    assert_eq!(image_prompt_text(3, 4, 3).matches("<|media_pad|>").count(), 3);
    let t = render_image_placeholders("see <|kimi_image_placeholder|> and <|kimi_image_placeholder|>!", IMAGE_PLACEHOLDER, &[(80, 50), (1, 2)]).unwrap();
    assert_eq!(
        t,
        "see <|media_begin|>image 80x50<|media_content|><|media_pad|><|media_end|> and \
         <|media_begin|>image 1x2<|media_content|><|media_pad|><|media_end|>!"
    );
}
