//! Media tokens in the prompt (spec §5.5, §8).
//!
//! Moonshot's processor writes, per image, ONE `<|media_pad|>` inside
//! `<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>` (W×H = the original
//! pixel size, ordinary BPE text). Before the model runs, that single pad is repeated N times
//! (N = the image's merged token count) and the k-th pad position of the prompt takes the k-th
//! feature row, in order across all images. Both forms give identical logits (spec §8).

use std::ops::Range;

use super::encoder::ImageFeatures;

pub const MEDIA_BEGIN: &str = "<|media_begin|>";
pub const MEDIA_CONTENT: &str = "<|media_content|>";
pub const MEDIA_END: &str = "<|media_end|>";
pub const MEDIA_PAD: &str = "<|media_pad|>";
/// The placeholder a chat template leaves where an image goes (`config.image_placeholder`).
pub const IMAGE_PLACEHOLDER: &str = "<|kimi_image_placeholder|>";

/// Image features for a multimodal prefill: `[rows, hidden]` f32, one row per `<|media_pad|>`
/// token of the expanded prompt, in prompt order (spec §5.5).
#[derive(Debug, Clone)]
pub struct ImageEmbeds {
    pub rows: usize,
    pub data: Vec<f32>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PromptError {
    #[error("the prompt holds {found} image placeholder(s) ({what}) but {expected} image(s) were given")]
    CountMismatch { what: String, found: usize, expected: usize },
    #[error("image {image} has no feature rows")]
    EmptyImage { image: usize },
}

/// The text that stands for one image: `<|media_begin|>image {W}x{H}<|media_content|>` followed by
/// `pads` × `<|media_pad|>` and `<|media_end|>`. `pads` is 1 in the processor's form.
pub fn image_prompt_text(width: usize, height: usize, pads: usize) -> String {
    format!("{MEDIA_BEGIN}image {width}x{height}{MEDIA_CONTENT}{}{MEDIA_END}", MEDIA_PAD.repeat(pads))
}

/// Replaces each `placeholder` in `text` by [`image_prompt_text`] of the matching image size
/// (one pad each). The number of placeholders must equal the number of sizes.
pub fn render_image_placeholders(text: &str, placeholder: &str, sizes: &[(usize, usize)]) -> Result<String, PromptError> {
    let parts: Vec<&str> = text.split(placeholder).collect();
    if parts.len() - 1 != sizes.len() {
        return Err(PromptError::CountMismatch { what: placeholder.to_string(), found: parts.len() - 1, expected: sizes.len() });
    }
    let mut out = String::with_capacity(text.len() + sizes.len() * 64);
    out.push_str(parts[0]);
    for (&(w, h), rest) in sizes.iter().zip(&parts[1..]) {
        out.push_str(&image_prompt_text(w, h, 1));
        out.push_str(rest);
    }
    Ok(out)
}

/// A prompt whose pads have been expanded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpandedIds {
    pub ids: Vec<u32>,
    /// For image i, the positions of its pads in `ids` (contiguous).
    pub image_spans: Vec<Range<usize>>,
}

/// Expands each single `pad_id` into `token_counts[i]` pads (image i = the i-th pad).
pub fn expand_media_ids(ids: &[u32], pad_id: u32, token_counts: &[usize]) -> Result<ExpandedIds, PromptError> {
    let found = ids.iter().filter(|&&t| t == pad_id).count();
    if found != token_counts.len() {
        return Err(PromptError::CountMismatch { what: format!("media pad id {pad_id}"), found, expected: token_counts.len() });
    }
    if let Some(image) = token_counts.iter().position(|&n| n == 0) {
        return Err(PromptError::EmptyImage { image });
    }
    let mut out = Vec::with_capacity(ids.len() + token_counts.iter().sum::<usize>());
    let mut spans = Vec::with_capacity(token_counts.len());
    let mut next = 0;
    for &t in ids {
        if t == pad_id {
            let n = token_counts[next];
            spans.push(out.len()..out.len() + n);
            out.extend(std::iter::repeat_n(pad_id, n));
            next += 1;
        } else {
            out.push(t);
        }
    }
    Ok(ExpandedIds { ids: out, image_spans: spans })
}

/// Expanded prompt ids plus the embedding overrides: `(position, feature row)`.
#[derive(Debug, Clone)]
pub struct ExpandedPrompt<'a> {
    pub ids: Vec<u32>,
    pub overrides: Vec<(usize, &'a [f32])>,
}

/// Expands each single `pad_id` into its image's feature rows; the k-th pad position of the
/// result takes the k-th row, in order across `images`.
pub fn expand_media<'a>(ids: &[u32], pad_id: u32, images: &'a [ImageFeatures]) -> Result<ExpandedPrompt<'a>, PromptError> {
    let counts: Vec<usize> = images.iter().map(|f| f.rows).collect();
    let e = expand_media_ids(ids, pad_id, &counts)?;
    let mut overrides = Vec::with_capacity(counts.iter().sum());
    for (img, span) in images.iter().zip(&e.image_spans) {
        for (r, pos) in span.clone().enumerate() {
            overrides.push((pos, img.row(r)));
        }
    }
    Ok(ExpandedPrompt { ids: e.ids, overrides })
}
