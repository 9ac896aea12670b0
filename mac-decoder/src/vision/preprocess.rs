//! Image pre-processing (spec §5.1): decode (PNG, JPEG, WebP), the NaViT resize rule with the
//! patch budgets, transparent-background fill, black padding to multiples of patch × merge,
//! normalisation to [−1, 1], and 14×14 patches with their (t, h, w) grid.

use super::media_config::{BgPattern, FillStage, MediaConfigError, MediaProcConfig};
use super::resample::{resize_channels, resize_rgba, Image8};

/// Largest encoded image accepted (bytes).
pub const MAX_ENCODED_BYTES: usize = 64 << 20;
/// Largest decoded image accepted (pixels); the resize rule brings it down afterwards.
pub const MAX_DECODED_PIXELS: u64 = 100_000_000;

#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    #[error("image is {0} bytes, above the {MAX_ENCODED_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("image format not recognised (PNG, JPEG and WebP are supported): {0}")]
    Format(String),
    #[error("cannot decode image: {0}")]
    Decode(String),
    #[error("image is {w}x{h}: {msg}")]
    BadSize { w: u64, h: u64, msg: String },
    #[error("media_proc_cfg: {0}")]
    Config(#[from] MediaConfigError),
    #[error("media_proc_cfg: no patch budget fits {width}x{height}")]
    NoPatchBudget { width: usize, height: usize },
}

/// How an image of a given size is resized, padded and tokenised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResizePlan {
    pub new_width: usize,
    pub new_height: usize,
    pub pad_width: usize,
    pub pad_height: usize,
    /// Patch grid (t = 1 for images).
    pub grid_thw: [usize; 3],
    /// Merged tokens = (grid_h / merge) · (grid_w / merge).
    pub num_tokens: usize,
}

/// One rule application: scale by the budgets, floor, pad to multiples of patch × merge.
fn navit_plan(w: usize, h: usize, cfg: &MediaProcConfig, in_patch_limit: usize) -> ResizePlan {
    let p = cfg.patch_size;
    let side = cfg.patch_limit_on_one_side;
    let pw = ((w / p) as f64).max(1.0);
    let ph = ((h / p) as f64).max(1.0);
    let s1 = (in_patch_limit as f64 / (pw * ph)).sqrt();
    let s2 = (side * p) as f64 / w as f64;
    let s3 = (side * p) as f64 / h as f64;
    let scale = 1.0f64.min(s1).min(s2).min(s3);
    let new_w = ((w as f64 * scale) as usize).max(1).min(side * p);
    let new_h = ((h as f64 * scale) as usize).max(1).min(side * p);
    let factor = cfg.merge_kernel_size * p;
    let pad_w = (factor - new_w % factor) % factor;
    let pad_h = (factor - new_h % factor) % factor;
    let (gh, gw) = ((new_h + pad_h) / p, (new_w + pad_w) / p);
    let m = cfg.merge_kernel_size;
    ResizePlan { new_width: new_w, new_height: new_h, pad_width: pad_w, pad_height: pad_h, grid_thw: [1, gh, gw], num_tokens: (gh / m) * (gw / m) }
}

/// The resize rule of the reference processor: apply the budgets; while the padded token
/// count exceeds `in_patch_limit / merge²`, shrink the patch budget and apply them again.
pub fn resize_plan(width: usize, height: usize, cfg: &MediaProcConfig) -> Result<ResizePlan, PreprocessError> {
    cfg.validate()?;
    if width == 0 || height == 0 {
        return Err(PreprocessError::BadSize { w: width as u64, h: height as u64, msg: "empty image".into() });
    }
    let max_tokens = cfg.in_patch_limit / (cfg.merge_kernel_size * cfg.merge_kernel_size);
    let mut limit = cfg.in_patch_limit as i64;
    loop {
        let plan = navit_plan(width, height, cfg, limit.max(0) as usize);
        if plan.num_tokens <= max_tokens {
            return Ok(plan);
        }
        let reduced = (limit as f64 * max_tokens as f64 / plan.num_tokens as f64) as i64;
        limit = (limit - 1).min(reduced);
        if limit < 0 {
            // Unreachable for a validated config (a budget of 0 gives a single token).
            return Err(PreprocessError::NoPatchBudget { width, height });
        }
    }
}

/// A pre-processed image: what the tower consumes.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessedImage {
    /// `[n_patches, 3, patch, patch]`, row-major over the patch grid, channel-first in a patch.
    pub pixel_values: Vec<f32>,
    pub grid_thw: [usize; 3],
    pub patch_size: usize,
    /// The original pixel size (written into the prompt as `image {W}x{H}`).
    pub original_size: (usize, usize),
    pub plan: ResizePlan,
}

impl PreprocessedImage {
    pub fn n_patches(&self) -> usize {
        self.grid_thw.iter().product()
    }
    pub fn num_tokens(&self) -> usize {
        self.plan.num_tokens
    }
}

/// Decodes PNG / JPEG / WebP bytes into 8-bit RGB (3 channels) or RGBA (4, when the file has
/// alpha or a transparency chunk). 16-bit samples keep their high byte.
pub fn decode(bytes: &[u8]) -> Result<Image8, PreprocessError> {
    use image::{DynamicImage, ImageFormat, ImageReader};
    if bytes.len() > MAX_ENCODED_BYTES {
        return Err(PreprocessError::TooLarge(bytes.len()));
    }
    let reader = ImageReader::new(std::io::Cursor::new(bytes)).with_guessed_format().map_err(|e| PreprocessError::Format(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP) => {}
        Some(f) => return Err(PreprocessError::Format(format!("{f:?}"))),
        None => return Err(PreprocessError::Format("unknown signature".into())),
    }
    let (w, h) = reader.into_dimensions().map_err(|e| PreprocessError::Decode(e.to_string()))?;
    // into_dimensions consumed the reader; start again for the pixels.
    if w == 0 || h == 0 || (w as u64) * (h as u64) > MAX_DECODED_PIXELS {
        return Err(PreprocessError::BadSize { w: w as u64, h: h as u64, msg: format!("outside 1..={MAX_DECODED_PIXELS} pixels") });
    }
    let mut reader = ImageReader::new(std::io::Cursor::new(bytes)).with_guessed_format().map_err(|e| PreprocessError::Format(e.to_string()))?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(w);
    limits.max_image_height = Some(h);
    limits.max_alloc = Some(MAX_DECODED_PIXELS * 8 + (64 << 20));
    reader.limits(limits);
    let img = reader.decode().map_err(|e| PreprocessError::Decode(e.to_string()))?;
    let (w, h) = (img.width() as usize, img.height() as usize);
    let high_byte = |v: &[u16]| v.iter().map(|&x| (x >> 8) as u8).collect::<Vec<u8>>();
    Ok(match img {
        DynamicImage::ImageRgb8(b) => Image8::new(w, h, 3, b.into_raw()),
        DynamicImage::ImageRgba8(b) => Image8::new(w, h, 4, b.into_raw()),
        DynamicImage::ImageRgb16(b) => Image8::new(w, h, 3, high_byte(b.as_raw())),
        DynamicImage::ImageRgba16(b) => Image8::new(w, h, 4, high_byte(b.as_raw())),
        DynamicImage::ImageLuma16(b) => Image8::new(w, h, 3, b.as_raw().iter().flat_map(|&x| [(x >> 8) as u8; 3]).collect()),
        DynamicImage::ImageLumaA16(b) => Image8::new(
            w,
            h,
            4,
            b.as_raw()
                .chunks_exact(2)
                .flat_map(|p| {
                    let (l, a) = ((p[0] >> 8) as u8, (p[1] >> 8) as u8);
                    [l, l, l, a]
                })
                .collect(),
        ),
        other if other.color().has_alpha() => Image8::new(w, h, 4, other.to_rgba8().into_raw()),
        other => Image8::new(w, h, 3, other.to_rgb8().into_raw()),
    })
}

/// Composites an RGBA image on the background: `a·fg + (1 − a)·bg` in f32 with `a = A/255`,
/// truncated to 8 bits. Returns RGB.
pub fn fill_background(img: &Image8, bg: &BgPattern) -> Image8 {
    assert_eq!(img.channels, 4, "fill_background needs RGBA");
    let mut out = Vec::with_capacity(img.width * img.height * 3);
    for y in 0..img.height {
        for x in 0..img.width {
            let b = match *bg {
                BgPattern::Chessboard { square, white_top_left, white, gray } => {
                    let odd = ((y / square as usize) + (x / square as usize)) % 2 == 1;
                    if odd == white_top_left {
                        gray
                    } else {
                        white
                    }
                }
                BgPattern::Solid(v) => v,
            } as f32;
            let px = &img.data[(y * img.width + x) * 4..][..4];
            let a = px[3] as f32 / 255.0;
            for &c in &px[..3] {
                out.push((a * c as f32 + (1.0 - a) * b) as u8);
            }
        }
    }
    Image8::new(img.width, img.height, 3, out)
}

fn drop_alpha(img: &Image8) -> Image8 {
    if img.channels == 3 {
        return img.clone();
    }
    let data = img.data.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect();
    Image8::new(img.width, img.height, 3, data)
}

/// Resize, fill, pad, normalise and patchify an 8-bit RGB/RGBA image.
pub fn preprocess_image(img: &Image8, cfg: &MediaProcConfig) -> Result<PreprocessedImage, PreprocessError> {
    if img.channels != 3 && img.channels != 4 {
        return Err(PreprocessError::Decode(format!("{} channels (need RGB or RGBA)", img.channels)));
    }
    let plan = resize_plan(img.width, img.height, cfg)?;
    let patches = plan.grid_thw.iter().product::<usize>();
    if patches > cfg.memory_patch_limit {
        return Err(PreprocessError::BadSize {
            w: img.width as u64,
            h: img.height as u64,
            msg: format!(
                "needs {patches} patches, more than this machine's memory lets the vision tower encode ({}); send a smaller image",
                cfg.memory_patch_limit
            ),
        });
    }
    let (nw, nh) = (plan.new_width, plan.new_height);
    let rgb = match (&cfg.transparent_bg, img.channels) {
        (_, 3) => resize_channels(img, nw, nh),
        (None, _) => resize_channels(&drop_alpha(img), nw, nh),
        (Some(bg), _) => match cfg.fill_stage {
            FillStage::BeforeResize => resize_channels(&fill_background(img, bg), nw, nh),
            FillStage::AfterResize => fill_background(&resize_rgba(img, nw, nh), bg),
        },
    };
    let p = cfg.patch_size;
    let [_, gh, gw] = plan.grid_thw;
    let (hp, wp) = (gh * p, gw * p);
    // Per-channel lookup: f32(v/255) − mean, then × 1/std, each rounded to f32 (the reference's
    // numpy steps). Padding is black (byte 0) before normalisation.
    let mut lut = [[0f32; 256]; 3];
    for (c, table) in lut.iter_mut().enumerate() {
        let inv_std = 1.0 / cfg.image_std[c];
        for (v, out) in table.iter_mut().enumerate() {
            let x = (v as f64 / 255.0) as f32;
            let x = (x as f64 - cfg.image_mean[c]) as f32;
            *out = (x as f64 * inv_std) as f32;
        }
    }
    let mut pixel_values = vec![0f32; gh * gw * 3 * p * p];
    for py in 0..gh {
        for px in 0..gw {
            let patch = &mut pixel_values[((py * gw + px) * 3 * p * p)..][..3 * p * p];
            for c in 0..3 {
                for ky in 0..p {
                    for kx in 0..p {
                        let (y, x) = (py * p + ky, px * p + kx);
                        let v = if y < nh && x < nw { rgb.data[(y * nw + x) * 3 + c] } else { 0 };
                        patch[(c * p + ky) * p + kx] = lut[c][v as usize];
                    }
                }
            }
        }
    }
    debug_assert_eq!((hp, wp), (nh + plan.pad_height, nw + plan.pad_width));
    Ok(PreprocessedImage { pixel_values, grid_thw: plan.grid_thw, patch_size: p, original_size: (img.width, img.height), plan })
}

/// Decode and pre-process encoded image bytes.
pub fn preprocess_bytes(bytes: &[u8], cfg: &MediaProcConfig) -> Result<PreprocessedImage, PreprocessError> {
    let img = decode(bytes)?;
    preprocess_image(&img, cfg)
}
