//! What every vision encoder shares: the [`VisionEncoder`] trait (the CPU reference and the MLX
//! tower implement it), its outputs ([`VisionTrace`], [`ImageFeatures`]), its error type and the
//! RMSNorm epsilon choice. A leaf below the tower, the projector, the reference and the prompt
//! code, which all use these types.

use k3_protocol::{CheckpointError, VisionConfig};

use super::media_config::MediaProcConfig;
use super::preprocess::{PreprocessError, PreprocessedImage};

/// The epsilon of the vision RMSNorms (norm0, norm1, final_layernorm), which the reference
/// builds without one: the dtype's machine epsilon (spec §3.0, §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NormEps {
    /// 2⁻⁷ = finfo(bfloat16).eps: the released model (tower in BF16). Golden `vision.output_bf16eps`.
    #[default]
    Bf16,
    /// 1.19e-7 = finfo(float32).eps: a float32 run of the reference. Golden `vision.output`.
    F32,
}

impl NormEps {
    pub fn value(self) -> f32 {
        match self {
            NormEps::Bf16 => 1.0 / 128.0,
            NormEps::F32 => f32::EPSILON,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error(transparent)]
    Preprocess(#[from] PreprocessError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("vision input: {0}")]
    Input(String),
    #[error("vision config: {0}")]
    Config(String),
    #[error("MLX vision tower: {0}")]
    Mlx(String),
}

/// Every stage of one image through the tower (row-major f32).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionTrace {
    pub n_patches: usize,
    /// Merged tokens (rows of `merged` and `output`).
    pub rows: usize,
    /// `[n_patches, vt_hidden]`: patch embedding + interpolated positions.
    pub embed: Vec<f32>,
    /// `[n_patches, vt_hidden]`: after the last block and final_layernorm.
    pub encoder: Vec<f32>,
    /// `[rows, merge² · vt_hidden]`: the 2×2 neighbourhoods.
    pub merged: Vec<f32>,
    /// `[rows, text_hidden]`: projector output, the rows that replace the media pads.
    pub output: Vec<f32>,
}

/// The features of one image: `rows × dim` embeddings for its media pads.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageFeatures {
    pub rows: usize,
    pub dim: usize,
    pub data: Vec<f32>,
    pub grid_thw: [usize; 3],
    /// Original pixel size `(W, H)`.
    pub original_size: (usize, usize),
}

impl ImageFeatures {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.dim..(i + 1) * self.dim]
    }
}

/// A vision tower + projector: the CPU reference or MLX.
pub trait VisionEncoder {
    fn vision_config(&self) -> &VisionConfig;
    fn media_config(&self) -> &MediaProcConfig;
    /// Runs one pre-processed image, keeping every stage.
    fn encode_trace(&self, img: &PreprocessedImage) -> Result<VisionTrace, VisionError>;

    /// Runs one pre-processed image.
    fn encode(&self, img: &PreprocessedImage) -> Result<ImageFeatures, VisionError> {
        let t = self.encode_trace(img)?;
        Ok(ImageFeatures { rows: t.rows, dim: self.vision_config().text_hidden_size, data: t.output, grid_thw: img.grid_thw, original_size: img.original_size })
    }
}
