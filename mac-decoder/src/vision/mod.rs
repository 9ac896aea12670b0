//! MoonViT-V2 vision (spec §5): image pre-processing, the tower and projector, and the media
//! tokens of the prompt.
//!
//! - [`encoder`]: what every encoder shares: the [`VisionEncoder`] trait, its outputs
//!   ([`ImageFeatures`], [`VisionTrace`]), [`VisionError`], [`NormEps`].
//! - [`media_config`]: `preprocessor_config.json` (`media_proc_cfg`), defaults as published.
//! - [`preprocess`]: decode, resize rule and patch budgets, background fill, patches and grid.
//! - [`resample`]: Pillow's bicubic resize, re-implemented (the reference resizes with Pillow).
//! - [`positions`]: position-table interpolation and the 2-D rotary tables.
//! - [`weights`]: the vision tensors in f32.
//! - [`reference`]: the tower and projector in plain f32 Rust (CPU reference).
//! - `tower`, `projector` (feature `mlx`): the same on MLX.
//! - [`prompt`]: the `<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>` text
//!   and the expansion of each pad into its image's feature rows.
//!
//! Entry points for the rest of the decoder: [`encode_image_bytes`] (bytes → features, e.g. an
//! OpenAI `image_url` data URL after base64 decoding) and [`prompt::expand_media`]. This module
//! only assembles the encoders ([`ReferenceEncoder`], `MlxVisionEncoder`) from the files below it.

pub mod encoder;
pub mod media_config;
pub mod positions;
pub mod preprocess;
#[cfg(feature = "mlx")]
pub mod projector;
pub mod prompt;
pub mod reference;
pub mod resample;
#[cfg(feature = "mlx")]
pub mod tower;
pub mod weights;

use k3_protocol::{Checkpoint, VisionConfig};

pub use encoder::{ImageFeatures, NormEps, VisionEncoder, VisionError, VisionTrace};
pub use media_config::{MediaProcConfig, ATTN_SCORE_BYTES};

pub use preprocess::{preprocess_bytes, PreprocessError, PreprocessedImage};
pub use prompt::{expand_media, expand_media_ids, ExpandedIds, ExpandedPrompt, ImageEmbeds};
pub use weights::VisionWeights;

/// The CPU reference as a [`VisionEncoder`].
pub struct ReferenceEncoder {
    pub weights: VisionWeights,
    pub media: MediaProcConfig,
    pub eps: NormEps,
}

impl ReferenceEncoder {
    /// Loads the vision weights and `preprocessor_config.json` (or the published defaults),
    /// bounded by half the memory available now ([`crate::memory::budget`]).
    pub fn load(ck: &Checkpoint, eps: NormEps) -> Result<Self, VisionError> {
        Self::load_bounded(ck, eps, crate::memory::budget(None, 0))
    }

    /// The same for a vision memory `budget` in bytes (`--vision-memory-bytes`; `None`: unbounded).
    pub fn load_bounded(ck: &Checkpoint, eps: NormEps, budget: Option<u64>) -> Result<Self, VisionError> {
        let weights = VisionWeights::load(ck)?;
        let media = MediaProcConfig::load(ck.dir(), &weights.cfg, budget).map_err(|e| VisionError::Config(e.to_string()))?;
        Ok(ReferenceEncoder { weights, media, eps })
    }
}

impl VisionEncoder for ReferenceEncoder {
    fn vision_config(&self) -> &VisionConfig {
        &self.weights.cfg
    }
    fn media_config(&self) -> &MediaProcConfig {
        &self.media
    }
    fn encode_trace(&self, img: &PreprocessedImage) -> Result<VisionTrace, VisionError> {
        reference::encode(&self.weights, img, self.eps)
    }
}

/// Decodes PNG/JPEG/WebP bytes, pre-processes them with the model's settings and encodes them.
pub fn encode_image_bytes(model: &dyn VisionEncoder, bytes: &[u8]) -> Result<ImageFeatures, VisionError> {
    let img = preprocess_bytes(bytes, model.media_config())?;
    model.encode(&img)
}

/// The rows of several images, concatenated in prompt order, as the MLX engine takes them
/// (row k replaces the k-th `<|media_pad|>` of the expanded prompt).
pub fn image_embeds(features: &[ImageFeatures]) -> ImageEmbeds {
    ImageEmbeds { rows: features.iter().map(|f| f.rows).sum(), data: features.iter().flat_map(|f| f.data.iter().copied()).collect() }
}

/// The MLX tower and projector as a [`VisionEncoder`].
#[cfg(feature = "mlx")]
pub struct MlxVisionEncoder {
    pub tower: tower::VisionTower,
    pub projector: projector::Projector,
    pub cfg: VisionConfig,
    pub media: MediaProcConfig,
    pub eps: NormEps,
}

#[cfg(feature = "mlx")]
impl MlxVisionEncoder {
    /// Moves the f32 weights into MLX; the tower attends in blocks of
    /// `media.attention_score_bytes`.
    pub fn new(weights: &VisionWeights, media: MediaProcConfig, eps: NormEps) -> Result<Self, VisionError> {
        let mut tower = tower::VisionTower::new(weights)?;
        tower.set_attention_score_bytes(media.attention_score_bytes);
        Ok(MlxVisionEncoder { tower, projector: projector::Projector::new(weights)?, cfg: weights.cfg.clone(), media, eps })
    }

    /// Loads the vision weights and `preprocessor_config.json` (or the published defaults),
    /// bounded by half the memory available now ([`crate::memory::budget`]).
    pub fn load(ck: &Checkpoint, eps: NormEps) -> Result<Self, VisionError> {
        Self::load_bounded(ck, eps, crate::memory::budget(None, 0))
    }

    /// The same for a vision memory `budget` in bytes (`--vision-memory-bytes`; `None`: unbounded).
    pub fn load_bounded(ck: &Checkpoint, eps: NormEps, budget: Option<u64>) -> Result<Self, VisionError> {
        let weights = VisionWeights::load(ck)?;
        let media = MediaProcConfig::load(ck.dir(), &weights.cfg, budget).map_err(|e| VisionError::Config(e.to_string()))?;
        Self::new(&weights, media, eps)
    }

    /// The projector output `[rows, text_hidden]` as an MLX array (no copy back to the CPU).
    pub fn encode_array(&self, img: &PreprocessedImage) -> Result<mlx_rs::Array, VisionError> {
        let t = self.tower.forward(img, self.eps)?;
        self.projector.forward(&t.merged)
    }
}

#[cfg(feature = "mlx")]
impl VisionEncoder for MlxVisionEncoder {
    fn vision_config(&self) -> &VisionConfig {
        &self.cfg
    }
    fn media_config(&self) -> &MediaProcConfig {
        &self.media
    }
    fn encode_trace(&self, img: &PreprocessedImage) -> Result<VisionTrace, VisionError> {
        let t = self.tower.forward(img, self.eps)?;
        let out = self.projector.forward(&t.merged)?;
        let v = |a: &mlx_rs::Array, what: &str| crate::mlx::to_vec_f32(a).map_err(|e| VisionError::Mlx(format!("reading {what}: {e:#}")));
        let [_, gh, gw] = img.grid_thw;
        let rows = gh * gw / (self.cfg.merge_kernel_size[0] * self.cfg.merge_kernel_size[1]);
        Ok(VisionTrace {
            n_patches: gh * gw,
            rows,
            embed: v(&t.embed, "vision.embed")?,
            encoder: v(&t.encoder, "vision.encoder")?,
            merged: v(&t.merged, "vision.merged")?,
            output: v(&out, "vision.output")?,
        })
    }
}
