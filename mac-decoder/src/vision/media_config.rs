//! `preprocessor_config.json` → `media_proc_cfg` (spec §1.4): patch size, patch budgets,
//! normalisation constants and the transparent-background fill.
//!
//! A checkpoint directory may ship the file; when it does, its keys win and a missing
//! `transparent_bg_config` means "drop alpha" (the reference processor's reading). When the
//! file is absent, the published K3 values are used (chessboard fill after resize).

use std::path::Path;

use serde::Deserialize;

/// Default (and largest) bound of one attention score block of the vision tower (256 MiB); see
/// [`attention_score_bytes`] and `tower`.
pub const ATTN_SCORE_BYTES: usize = 256 << 20;

/// What fills transparent pixels.
#[derive(Debug, Clone, PartialEq)]
pub enum BgPattern {
    /// Squares of `square` px, white (`white`) at the top-left when `white_top_left`, else gray.
    Chessboard { square: u32, white_top_left: bool, white: u8, gray: u8 },
    /// One flat value for all three channels.
    Solid(u8),
}

/// When the background is composited: before or after the bicubic resize.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FillStage {
    BeforeResize,
    AfterResize,
}

/// The image pre-processing settings.
#[derive(Debug, Clone, PartialEq)]
pub struct MediaProcConfig {
    pub patch_size: usize,
    pub merge_kernel_size: usize,
    /// Patch budget before merging (65536 for K3).
    pub in_patch_limit: usize,
    /// Largest patch count along one side (512).
    pub patch_limit_on_one_side: usize,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    /// `None`: alpha is dropped (plain RGB conversion).
    pub transparent_bg: Option<BgPattern>,
    pub fill_stage: FillStage,
    /// Most patches this machine's memory can encode ([`memory_patch_limit`]); an image whose
    /// plan needs more is refused with a clear error instead of exhausting memory. `usize::MAX`
    /// when not bounded (the published settings, reference tests).
    pub memory_patch_limit: usize,
    /// Bound of one attention score block of the tower ([`attention_score_bytes`]): the blocks
    /// are evaluated one at a time, so this is the scores' share of the tower's peak memory.
    pub attention_score_bytes: usize,
}

/// Bytes of one tower activation row per patch, alive during one block (f32): pixels, the
/// residual stream and norms, q/k/v with their rotated and head-major copies, the attention
/// output, the MLP hidden layer; ×1.5 for MLX temporaries.
pub fn tower_bytes_per_patch(v: &k3_protocol::VisionConfig) -> usize {
    let (p, d, q, f) = (v.patch_size, v.vt_hidden_size, v.qkv_hidden_size, v.vt_intermediate_size);
    let floats = 3 * p * p + 6 * d + 12 * q + 2 * f;
    floats * 4 * 3 / 2
}

/// The attention score block of the tower for a memory budget: a sixteenth of the budget,
/// between 1 MiB and [`ATTN_SCORE_BYTES`] (the latter when unbounded). A machine (or a
/// `--vision-memory-bytes`) with little memory attends in smaller blocks rather than refusing
/// every image.
pub fn attention_score_bytes(budget: Option<u64>) -> usize {
    budget.map_or(ATTN_SCORE_BYTES, |b| (b / 16).clamp(1 << 20, ATTN_SCORE_BYTES as u64) as usize)
}

/// Most patches a memory budget holds: the budget less three attention score blocks of
/// [`attention_score_bytes`] (a block, its softmax, the product), divided by
/// [`tower_bytes_per_patch`].
pub fn memory_patch_limit(v: &k3_protocol::VisionConfig, budget: Option<u64>) -> usize {
    let Some(budget) = budget else { return usize::MAX };
    let scores = 3 * attention_score_bytes(Some(budget)) as u64;
    (budget.saturating_sub(scores) / tower_bytes_per_patch(v).max(1) as u64).min(usize::MAX as u64) as usize
}

/// A pre-processing config that cannot be read or used: the file, or the field and value.
#[derive(Debug, thiserror::Error)]
pub enum MediaConfigError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    /// `source` is one of the variants below.
    #[error("malformed {path}: {source}")]
    Invalid { path: String, source: Box<MediaConfigError> },
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("fixed_output_tokens = {0} is not supported (the tower's token count follows the grid)")]
    FixedOutputTokens(usize),
    #[error("merge_kernel_size must be a positive integer")]
    MergeNotInteger,
    #[error("merge_kernel_size must hold positive integers")]
    MergeNotIntegers,
    /// The JSON value as written.
    #[error("merge_kernel_size {0} is not an integer or a square [k, k]")]
    MergeShape(String),
    #[error("transparent_bg_config.pattern {0:?} is not chessboard/white/black/gray")]
    BgPattern(String),
    #[error("transparent_bg_fill_stage {0:?} is not before_resize/after_resize")]
    FillStage(String),
    #[error("patch_size and merge_kernel_size must be > 0")]
    ZeroPatch,
    #[error("in_patch_limit {limit} is below one merged token ({patches} patches)")]
    InPatchLimit { limit: usize, patches: usize },
    #[error("patch_limit_on_one_side {0} is below merge_kernel_size")]
    SideLimit(usize),
    #[error("image_mean {mean:?} / image_std {std:?} are not usable")]
    Normalization { mean: [f64; 3], std: [f64; 3] },
    #[error("chessboard_square_size must be > 0")]
    ZeroSquare,
    #[error("patch_size {patch} / merge_kernel_size {merge} disagree with vision_config ({vision_patch} / {vision_merge:?})")]
    VisionMismatch { patch: usize, merge: usize, vision_patch: usize, vision_merge: [usize; 2] },
}

impl MediaProcConfig {
    /// The published K3 `media_proc_cfg` (spec §1.4).
    pub fn k3_default() -> Self {
        MediaProcConfig {
            patch_size: 14,
            merge_kernel_size: 2,
            in_patch_limit: 65536,
            patch_limit_on_one_side: 512,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            transparent_bg: Some(BgPattern::Chessboard { square: 8, white_top_left: true, white: 255, gray: 180 }),
            fill_stage: FillStage::AfterResize,
            memory_patch_limit: usize::MAX,
            attention_score_bytes: ATTN_SCORE_BYTES,
        }
    }

    /// The published values with the patch and merge sizes of a model's `vision_config`.
    pub fn for_vision(v: &k3_protocol::VisionConfig) -> Self {
        MediaProcConfig { patch_size: v.patch_size, merge_kernel_size: v.merge_kernel_size[0], ..Self::k3_default() }
    }

    /// [`Self::load_unbounded`] with [`Self::memory_patch_limit`] and
    /// [`Self::attention_score_bytes`] set for the vision memory `budget` (bytes; `None`:
    /// unbounded). The commands take it from `--vision-memory-bytes`, else half the memory
    /// available at start ([`crate::memory::budget`]).
    pub fn load(dir: &Path, v: &k3_protocol::VisionConfig, budget: Option<u64>) -> Result<Self, MediaConfigError> {
        Ok(Self::load_unbounded(dir, v)?.bounded(v, budget))
    }

    /// This config with the limits of the vision memory `budget` (bytes; `None`: unbounded).
    pub fn bounded(mut self, v: &k3_protocol::VisionConfig, budget: Option<u64>) -> Self {
        self.memory_patch_limit = memory_patch_limit(v, budget);
        self.attention_score_bytes = attention_score_bytes(budget);
        self
    }

    /// Reads `<dir>/preprocessor_config.json` when present, else [`Self::for_vision`].
    pub fn load_unbounded(dir: &Path, v: &k3_protocol::VisionConfig) -> Result<Self, MediaConfigError> {
        let path = dir.join("preprocessor_config.json");
        if !path.exists() {
            return Ok(Self::for_vision(v));
        }
        let text = std::fs::read_to_string(&path).map_err(|source| MediaConfigError::Io { path: path.display().to_string(), source })?;
        let invalid = |e| MediaConfigError::Invalid { path: path.display().to_string(), source: Box::new(e) };
        let cfg = Self::from_json(&text).map_err(invalid)?;
        if cfg.patch_size != v.patch_size || cfg.merge_kernel_size != v.merge_kernel_size[0] || v.merge_kernel_size[0] != v.merge_kernel_size[1] {
            return Err(invalid(MediaConfigError::VisionMismatch {
                patch: cfg.patch_size,
                merge: cfg.merge_kernel_size,
                vision_patch: v.patch_size,
                vision_merge: v.merge_kernel_size,
            }));
        }
        Ok(cfg)
    }

    /// Parses a `preprocessor_config.json` (its `media_proc_cfg` object, or the object itself).
    pub fn from_json(text: &str) -> Result<Self, MediaConfigError> {
        let value: serde_json::Value = serde_json::from_str(text)?;
        let obj = value.get("media_proc_cfg").cloned().unwrap_or(value);
        let raw: RawMediaProcCfg = serde_json::from_value(obj)?;
        raw.into_config()
    }

    /// Checks the values the resize rule divides by or loops on.
    pub fn validate(&self) -> Result<(), MediaConfigError> {
        if self.patch_size == 0 || self.merge_kernel_size == 0 {
            return Err(MediaConfigError::ZeroPatch);
        }
        if self.in_patch_limit < self.merge_kernel_size * self.merge_kernel_size {
            let patches = self.merge_kernel_size * self.merge_kernel_size;
            return Err(MediaConfigError::InPatchLimit { limit: self.in_patch_limit, patches });
        }
        if self.patch_limit_on_one_side < self.merge_kernel_size {
            return Err(MediaConfigError::SideLimit(self.patch_limit_on_one_side));
        }
        if self.image_std.iter().any(|s| *s == 0.0 || !s.is_finite()) || self.image_mean.iter().any(|m| !m.is_finite()) {
            return Err(MediaConfigError::Normalization { mean: self.image_mean, std: self.image_std });
        }
        if let Some(BgPattern::Chessboard { square: 0, .. }) = self.transparent_bg {
            return Err(MediaConfigError::ZeroSquare);
        }
        Ok(())
    }
}

#[derive(Deserialize)]
struct RawMediaProcCfg {
    patch_size: usize,
    merge_kernel_size: serde_json::Value,
    in_patch_limit: usize,
    patch_limit_on_one_side: usize,
    #[serde(default)]
    fixed_output_tokens: Option<usize>,
    #[serde(default = "half3")]
    image_mean: [f64; 3],
    #[serde(default = "half3")]
    image_std: [f64; 3],
    #[serde(default)]
    transparent_bg_config: Option<RawBg>,
    #[serde(default)]
    transparent_bg_fill_stage: Option<String>,
}

#[derive(Deserialize)]
struct RawBg {
    pattern: String,
    #[serde(default)]
    chessboard_square_size: Option<u32>,
    #[serde(default)]
    chessboard_square_on_top_left: Option<bool>,
    #[serde(default)]
    chessboard_white_value: Option<u8>,
    #[serde(default)]
    chessboard_gray_value: Option<u8>,
}

fn half3() -> [f64; 3] {
    [0.5; 3]
}

impl RawMediaProcCfg {
    fn into_config(self) -> Result<MediaProcConfig, MediaConfigError> {
        if let Some(n) = self.fixed_output_tokens {
            return Err(MediaConfigError::FixedOutputTokens(n));
        }
        let merge = match &self.merge_kernel_size {
            serde_json::Value::Number(n) => n.as_u64().ok_or(MediaConfigError::MergeNotInteger)? as usize,
            serde_json::Value::Array(a) if a.len() == 2 && a[0] == a[1] => a[0].as_u64().ok_or(MediaConfigError::MergeNotIntegers)? as usize,
            other => return Err(MediaConfigError::MergeShape(other.to_string())),
        };
        let transparent_bg = match self.transparent_bg_config {
            None => None,
            Some(b) => Some(match b.pattern.as_str() {
                "chessboard" => BgPattern::Chessboard {
                    square: b.chessboard_square_size.unwrap_or(8),
                    white_top_left: b.chessboard_square_on_top_left.unwrap_or(true),
                    white: b.chessboard_white_value.unwrap_or(255),
                    gray: b.chessboard_gray_value.unwrap_or(180),
                },
                "white" => BgPattern::Solid(255),
                "black" => BgPattern::Solid(0),
                "gray" => BgPattern::Solid(128),
                p => return Err(MediaConfigError::BgPattern(p.to_string())),
            }),
        };
        let fill_stage = match self.transparent_bg_fill_stage.as_deref() {
            None | Some("before_resize") => FillStage::BeforeResize,
            Some("after_resize") => FillStage::AfterResize,
            Some(s) => return Err(MediaConfigError::FillStage(s.to_string())),
        };
        let cfg = MediaProcConfig {
            patch_size: self.patch_size,
            merge_kernel_size: merge,
            in_patch_limit: self.in_patch_limit,
            patch_limit_on_one_side: self.patch_limit_on_one_side,
            image_mean: self.image_mean,
            image_std: self.image_std,
            transparent_bg,
            fill_stage,
            memory_patch_limit: usize::MAX,
            attention_score_bytes: ATTN_SCORE_BYTES,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
