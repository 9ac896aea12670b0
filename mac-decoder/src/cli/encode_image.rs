//! `k3-decode encode-image --model DIR --image FILE --out OUT.safetensors`: one image through
//! the pre-processing, MoonViT-V2 and the projector. Writes, under the golden names:
//! `vision.output` (and the same tensor as `vision.output_bf16eps`): the features with the
//! released model's BF16 RMSNorm epsilon; `vision.pixel_values`, `vision.grid_thw`,
//! `vision.embed`; and `vision.encoder` / `vision.merged` from a float32-epsilon pass, which is
//! what those golden names hold (skip that second pass with `--no-f32-stages`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use safetensors::{tensor::TensorView, Dtype};

use crate::vision::{preprocess_bytes, NormEps, VisionEncoder, VisionTrace};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The MLX tower (needs the `mlx` feature).
    Mlx,
    /// The plain f32 CPU reference.
    Reference,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Eps {
    /// 2^-7: the released model's BF16 vision RMSNorms (golden `vision.output_bf16eps`).
    Bf16,
    /// 1.19e-7: a float32 run of the reference (golden `vision.output`).
    F32,
}

/// Arguments of `k3-decode encode-image`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (release layout).
    #[arg(long)]
    pub model: PathBuf,
    /// PNG, JPEG or WebP file.
    #[arg(long)]
    pub image: PathBuf,
    /// Output safetensors file.
    #[arg(long)]
    pub out: PathBuf,
    /// Which implementation runs the tower.
    #[arg(long, value_enum, default_value_t = default_backend())]
    pub backend: Backend,
    /// Epsilon of the vision RMSNorms for `vision.output`.
    #[arg(long, value_enum, default_value_t = Eps::Bf16)]
    pub eps: Eps,
    /// Skip the float32-epsilon pass that provides `vision.encoder` and `vision.merged`.
    #[arg(long)]
    pub no_f32_stages: bool,
    /// Bytes the vision tower may use (bounds the image's patches and the attention blocks;
    /// default: half the memory available at start).
    #[arg(long, value_name = "BYTES")]
    pub vision_memory_bytes: Option<u64>,
}

fn default_backend() -> Backend {
    if cfg!(feature = "mlx") {
        Backend::Mlx
    } else {
        Backend::Reference
    }
}

fn encoder(ck: &k3_protocol::Checkpoint, backend: Backend, eps: NormEps, budget: Option<u64>) -> Result<Box<dyn VisionEncoder>> {
    Ok(match backend {
        Backend::Reference => Box::new(crate::vision::ReferenceEncoder::load_bounded(ck, eps, budget)?),
        #[cfg(feature = "mlx")]
        Backend::Mlx => Box::new(crate::vision::MlxVisionEncoder::load_bounded(ck, eps, budget)?),
        #[cfg(not(feature = "mlx"))]
        Backend::Mlx => bail!("this k3-decode was built without the `mlx` feature; use --backend reference"),
    })
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn run(args: Args) -> Result<()> {
    let ck = k3_protocol::Checkpoint::open(&args.model).with_context(|| format!("opening checkpoint {}", args.model.display()))?;
    let bytes = std::fs::read(&args.image).with_context(|| format!("reading {}", args.image.display()))?;
    let eps = match args.eps {
        Eps::Bf16 => NormEps::Bf16,
        Eps::F32 => NormEps::F32,
    };
    let budget = crate::memory::budget(args.vision_memory_bytes, 0);
    tracing::info!(
        vision_mb = budget.map(|b| b / 1_000_000),
        given = args.vision_memory_bytes.is_some(),
        "vision memory budget (set another with --vision-memory-bytes)"
    );
    let t0 = Instant::now();
    let enc = encoder(&ck, args.backend, eps, budget)?;
    tracing::info!(backend = ?args.backend, "vision weights loaded in {:.2?}", t0.elapsed());
    let img = preprocess_bytes(&bytes, enc.media_config()).with_context(|| format!("image {}", args.image.display()))?;
    let [t, gh, gw] = img.grid_thw;
    tracing::info!(
        "{}: {}x{} → resized {}x{}, grid {t}x{gh}x{gw}, {} tokens",
        args.image.display(),
        img.original_size.0,
        img.original_size.1,
        img.plan.new_width,
        img.plan.new_height,
        img.num_tokens()
    );
    let t1 = Instant::now();
    let main = enc.encode_trace(&img)?;
    tracing::info!("tower + projector ({eps:?} eps) in {:.2?}", t1.elapsed());
    let f32_trace: Option<VisionTrace> = if args.no_f32_stages {
        None
    } else if eps == NormEps::F32 {
        Some(main.clone())
    } else {
        Some(encoder(&ck, args.backend, NormEps::F32, budget)?.encode_trace(&img)?)
    };

    let c = enc.vision_config();
    let (d, p) = (c.vt_hidden_size, c.patch_size);
    let m = c.merge_kernel_size[0] * c.merge_kernel_size[1] * d;
    let n = img.n_patches();
    let grid: Vec<u8> = img.grid_thw.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = vec![
        ("vision.pixel_values".into(), Dtype::F32, vec![n, 3, p, p], f32_bytes(&img.pixel_values)),
        ("vision.grid_thw".into(), Dtype::I64, vec![3], grid),
        ("vision.embed".into(), Dtype::F32, vec![n, d], f32_bytes(&main.embed)),
        ("vision.output".into(), Dtype::F32, vec![main.rows, c.text_hidden_size], f32_bytes(&main.output)),
    ];
    if eps == NormEps::Bf16 {
        tensors.push(("vision.output_bf16eps".into(), Dtype::F32, vec![main.rows, c.text_hidden_size], f32_bytes(&main.output)));
    }
    if let Some(f) = &f32_trace {
        tensors.push(("vision.encoder".into(), Dtype::F32, vec![n, d], f32_bytes(&f.encoder)));
        tensors.push(("vision.merged".into(), Dtype::F32, vec![f.rows, m], f32_bytes(&f.merged)));
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, dt, shape, data)| Ok((name.clone(), TensorView::new(*dt, shape.clone(), data)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            bail!("output directory {} does not exist", dir.display());
        }
    }
    safetensors::serialize_to_file(views, None, &args.out).with_context(|| format!("writing {}", args.out.display()))?;
    tracing::info!("wrote {} ({} tensors)", args.out.display(), tensors.len());
    Ok(())
}
