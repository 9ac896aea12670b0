//! `--backend`, `--precision` and the CUDA backend's options ([`CudaArgs`]), shared by the
//! subcommands that run the model (`forward`, `calibrate`, `bench`, `serve`), and the one place
//! that opens the backend they choose.

use std::sync::Arc;

use anyhow::Context;

use crate::cpu::CpuBackend;
use crate::cuda::gpu::HostCopy;
use crate::cuda::kernels::MlaKernel;
use crate::cuda::moe_dense::MoeDenseCfg;
use crate::cuda::{Bf16Parts, CudaBackend, CudaOptions, MoeKernel, Precision};

/// Which ops backend runs the command.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// The f32 CPU reference.
    Cpu,
    /// The CUDA backend.
    Cuda,
    /// CUDA when a usable GPU is present, else the CPU reference.
    Auto,
}

/// The backend options of a command. `--precision` defaults to `f32` (check mode); a command
/// that serves defaults it to `bf16` with
/// `#[command(mut_arg("precision", |a| a.default_value("bf16")))]` on its own arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct BackendArgs {
    /// Which backend runs the model.
    #[arg(long = "backend", value_enum, default_value_t = BackendChoice::Auto)]
    pub choice: BackendChoice,
    /// CUDA arithmetic: `f32` (check mode: the CPU reference's arithmetic, matches the fp32
    /// golden sets) or `bf16` (serving: BF16 GEMM operands and attention, f32 accumulation,
    /// norms and recurrences; docs/engine-agreement.md). `mx`: K3's own MX precision (the routed
    /// experts' gate and up projections as MXFP4 weights × MXFP8 activations), emulated by the CPU backend (the CUDA
    /// FP8 kernels are not built yet: refused there).
    #[arg(long, default_value = "f32")]
    pub precision: Precision,
    #[command(flatten)]
    pub cuda: CudaArgs,
}

/// The CUDA backend's options ([`CudaOptions`]). Without them the backend runs its serving
/// configuration; every other value is a diagnostic, for locating an error or comparing a kernel
/// or copy path with the one that serves.
#[derive(clap::Args, Debug, Clone, Default)]
#[command(next_help_heading = "CUDA backend (diagnostics: the defaults are the serving configuration)")]
pub struct CudaArgs {
    /// CUDA, `--precision bf16`: only these parts run in BF16, a comma-separated subset of
    /// `gemm` (dense GEMMs), `round` (rounding to BF16 where the reference casts), `experts`
    /// (routed experts on the BF16 kernels), `attn` (MLA flash attention), or `all` / `none`.
    /// Default: all. Diagnostic: a subset locates where BF16 rounding enters.
    #[arg(long, value_name = "PARTS")]
    pub bf16_parts: Option<Bf16Parts>,
    /// CUDA: the BF16 routed-expert GEMM kernel: `ldmatrix` (the default) or `lds32` (its first
    /// version, 32-bit shared-memory loads; diagnostic).
    #[arg(long, value_name = "KERNEL", default_value = "ldmatrix")]
    pub moe_kernel: MoeKernel,
    /// CUDA: sizes of the dense expert path (BF16 dequantisation + cuBLAS), any subset of
    /// `streams=4,group_mib=1024,slice=8192,min_rows=128,row_grain=1` (the defaults): worker
    /// streams, MiB of the BF16 weight buffers, most rows of one expert per GEMM, routed rows per
    /// expert from which the dense path is taken, GEMM rows rounded up to a multiple of this
    /// (1: exact; at most 128). Diagnostic.
    #[arg(long, value_name = "KEY=N,...")]
    pub moe_dense: Option<MoeDenseCfg>,
    /// CUDA: the BF16 MLA attention kernel: `auto` (the default: wgmma on sm_90 where the
    /// widths allow, else mma.sync), `mma`, `wgmma` (its default configuration) or
    /// `wgmma:<entry point>` (mla_attn_sm90_m192, mla_attn_sm90, mla_attn_sm90_m192s3).
    /// Diagnostic; a wgmma kernel that does not apply is an error, not a fallback.
    #[arg(long, value_name = "KERNEL", default_value = "auto")]
    pub mla_kernel: MlaKernel,
    /// CUDA: how the compute stream's host <-> device copies run: `split` (the default: uploads
    /// by a copy kernel on the SMs, downloads on a copy stream of their own), `streams` (both
    /// directions on copy streams: the uploads queue behind the weights), `kernel` (both by the
    /// copy kernel), `engine` (pageable copies on the compute stream plus a synchronisation).
    /// Diagnostic.
    #[arg(long, value_name = "PATH", default_value = "split")]
    pub host_copy: HostCopy,
    /// CUDA: record the GPU time of each step (an event per backend op, about 1 % slower) and the
    /// host time blocked on the GPU per step, and log the routing spread and the dense expert
    /// path's enqueue time per layer. Diagnostic for `bench --model`, which prints both tables
    /// per run (other commands keep recording until they exit).
    #[arg(long)]
    pub profile: bool,
}

impl CudaArgs {
    /// The options these flags choose.
    pub fn options(&self) -> CudaOptions {
        CudaOptions {
            bf16_parts: self.bf16_parts,
            moe_kernel: self.moe_kernel,
            moe_dense: self.moe_dense.unwrap_or_default(),
            mla_kernel: self.mla_kernel,
            host_copy: self.host_copy,
            profile: self.profile,
        }
    }
}

/// The memory limits of a prefill pass (`forward`, `bench`, `serve`, `calibrate`), in GB
/// (10^9 bytes): [`crate::memory_plan`] plans every allocation of the pass within them and
/// refuses, before any weight is read, a prompt that cannot fit.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct MemoryArgs {
    /// Device memory the whole prefill pass may use, GB: weight slots and tables, activations,
    /// routed-expert rows, the AttnRes bank, MLA rows and the attention workspace (the CPU
    /// backend plans the same allocations). The limit itself, no margin taken from it (at most
    /// the free memory). Default: the device's free memory less 0.75 GB.
    #[arg(long)]
    pub vram_budget: Option<f64>,
    /// Host memory the pass may use, GB (the parked AttnRes bank, hand-off states, staging,
    /// `--pin-host`'s copy of the checkpoint, logits). Default: available memory less 2 GB.
    #[arg(long)]
    pub host_memory: Option<f64>,
    /// CUDA: act as a card of this many GB (a ballast allocation holds back the rest of a larger
    /// GPU, not counted as used), so that anything beyond it fails as on the small card.
    #[arg(long)]
    pub emulate_gpu_memory: Option<f64>,
}

impl MemoryArgs {
    pub fn options(&self) -> crate::prefiller::MemoryOptions {
        crate::prefiller::MemoryOptions { vram_budget: self.vram_budget, host_memory: self.host_memory, emulate_gpu_memory: self.emulate_gpu_memory }
    }
}

/// The emulated weight source of `bench` and `serve` ([`crate::source_pace`]).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SourceArgs {
    /// Read each pass's layer weights no faster than this many GB/s (10^9 bytes per second), as
    /// from a slower source: a box fed from host memory or a fast disk measures what a user's
    /// NVMe of that rate would do (layer l finishes no earlier than the bytes of layers 0..=l
    /// could have been read since the pass began; the time waited is left out of the node's
    /// measured compute). Default: the weights come as fast as their source reads them.
    #[arg(long, value_name = "GB/s", value_parser = positive_gbs)]
    pub emulate_source_gbs: Option<f64>,
}

fn positive_gbs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(g) if g.is_finite() && g > 0.0 => Ok(g),
        _ => Err("expected a positive rate in GB/s, e.g. 3.5".into()),
    }
}

/// The backend a command runs on, opened.
pub enum Opened {
    Cpu(Arc<CpuBackend>),
    Cuda(Arc<CudaBackend>),
}

impl BackendArgs {
    /// Opens the chosen backend; `auto` takes CUDA when [`crate::cuda::probe`] finds a usable
    /// GPU, else the CPU reference (logged either way).
    pub fn open(&self) -> anyhow::Result<Opened> {
        let cuda = match self.choice {
            BackendChoice::Cpu => false,
            BackendChoice::Cuda => true,
            BackendChoice::Auto => match crate::cuda::probe() {
                Ok(gpu) => {
                    tracing::info!(%gpu, "--backend auto: using CUDA");
                    true
                }
                Err(why) => {
                    tracing::info!("--backend auto: no usable GPU ({why}); using the CPU reference");
                    false
                }
            },
        };
        if !cuda && self.cuda.options() != CudaOptions::default() {
            tracing::warn!("the CUDA backend's options ({:?}) are unused on the CPU reference", self.cuda.options());
        }
        Ok(if cuda {
            Opened::Cuda(Arc::new(CudaBackend::new(self.precision, &self.cuda.options()).context("--backend cuda: opening the GPU")?))
        } else {
            Opened::Cpu(Arc::new(if self.precision == Precision::Mx { CpuBackend::mx() } else { CpuBackend }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Args, Debug)]
    struct Check {
        #[command(flatten)]
        backend: BackendArgs,
    }

    #[derive(clap::Args, Debug)]
    #[command(mut_arg("precision", |a| a.default_value("bf16")))]
    struct Serving {
        #[command(flatten)]
        backend: BackendArgs,
    }

    #[test]
    fn precision_is_typed_and_its_default_per_command() {
        let a: Check = crate::cli::parse_args(&["x"]).unwrap();
        assert_eq!((a.backend.choice, a.backend.precision), (BackendChoice::Auto, Precision::F32));
        let a: Serving = crate::cli::parse_args(&["x"]).unwrap();
        assert_eq!(a.backend.precision, Precision::Bf16);
        let a: Serving = crate::cli::parse_args(&["x", "--backend", "cpu", "--precision", "fp32"]).unwrap();
        assert_eq!((a.backend.choice, a.backend.precision), (BackendChoice::Cpu, Precision::F32));
        let e = crate::cli::parse_args::<Check>(&["x", "--precision", "fp16"]).unwrap_err().to_string();
        assert!(e.contains("unknown precision \"fp16\""), "{e}");
    }

    #[test]
    fn no_cuda_flag_keeps_the_serving_configuration() {
        let a: Serving = crate::cli::parse_args(&["x"]).unwrap();
        let o = a.backend.cuda.options();
        assert_eq!(o, CudaOptions::default());
        assert_eq!(
            (o.bf16_parts, o.moe_kernel, o.moe_dense, o.mla_kernel, o.host_copy, o.profile),
            (None, MoeKernel::Ldmatrix, MoeDenseCfg::default(), MlaKernel::Auto, HostCopy::Split, false)
        );
        assert_eq!(o.moe_kernel.suffix(), "");
    }

    #[test]
    fn each_cuda_flag_parses() {
        let o = |args: &[&str]| -> CudaOptions {
            let argv: Vec<&str> = std::iter::once("x").chain(args.iter().copied()).collect();
            crate::cli::parse_args::<Serving>(&argv).unwrap().backend.cuda.options()
        };
        assert_eq!(o(&["--bf16-parts", "gemm,attn"]).bf16_parts, Some(Bf16Parts { gemm: true, attn: true, ..Bf16Parts::NONE }));
        assert_eq!(o(&["--bf16-parts", "none"]).bf16_parts, Some(Bf16Parts::NONE));
        assert_eq!(o(&["--bf16-parts", "all"]).bf16_parts, Some(Bf16Parts::ALL));
        assert_eq!(o(&["--moe-kernel", "lds32"]).moe_kernel.suffix(), "_lds32");
        let d = o(&["--moe-dense", "streams=8,row_grain=64"]).moe_dense;
        assert_eq!((d.streams, d.row_grain, d.weight_bytes), (8, 64, MoeDenseCfg::default().weight_bytes));
        assert_eq!(o(&["--mla-kernel", "mma"]).mla_kernel, MlaKernel::MmaSync);
        assert_eq!(o(&["--mla-kernel", "wgmma"]).mla_kernel, MlaKernel::Wgmma(crate::cuda::kernels::MLA_SM90_VARIANTS[0]));
        let v = crate::cuda::kernels::MLA_SM90_VARIANTS[2];
        assert_eq!(o(&["--mla-kernel", &format!("wgmma:{}", v.name)]).mla_kernel, MlaKernel::Wgmma(v));
        for (name, h) in HostCopy::NAMES {
            assert_eq!(o(&["--host-copy", name]).host_copy, h);
            assert_eq!(h.to_string(), name);
        }
        assert!(o(&["--profile"]).profile);
        // the logged forms read back as the same options
        let all = o(&["--bf16-parts", "round,experts", "--moe-dense", "slice=64,min_rows=2", "--mla-kernel", "mma"]);
        assert_eq!(all.bf16_parts.map(|p| p.to_string()).as_deref(), Some("round,experts"));
        assert_eq!(all.moe_dense.to_string().parse::<MoeDenseCfg>().unwrap(), all.moe_dense);
        assert_eq!(all.mla_kernel.to_string().parse::<MlaKernel>().unwrap(), all.mla_kernel);
    }

    #[test]
    fn a_bad_cuda_flag_value_is_refused_naming_the_flag_and_the_accepted_values() {
        for (flag, value, accepted) in [
            ("--bf16-parts", "gemm,fp8", "gemm, round, experts, attn, all, none"),
            ("--moe-kernel", "lds64", "ldmatrix or lds32"),
            ("--moe-dense", "streams=0", "must be positive"),
            ("--moe-dense", "row_grain=256", "at most 128"),
            ("--moe-dense", "lanes=4", "streams, group_mib, slice, min_rows, row_grain"),
            ("--mla-kernel", "wgmma:nope", "auto, mma, wgmma or wgmma:<mla_attn_sm90_m192|"),
            ("--host-copy", "dma", "split, streams, kernel or engine"),
        ] {
            let e = crate::cli::parse_args::<Serving>(&["x", flag, value]).unwrap_err().to_string();
            assert!(e.contains(flag) && e.contains(value) && e.contains(accepted), "{flag} {value}: {e}");
        }
        let e = crate::cli::parse_args::<Serving>(&["x", "--profile=yes"]).unwrap_err().to_string();
        assert!(e.contains("--profile"), "{e}");
    }

    #[test]
    fn the_emulated_source_rate_parses_and_a_bad_one_is_refused_naming_the_flag() {
        #[derive(clap::Args, Debug)]
        struct Src {
            #[command(flatten)]
            source: SourceArgs,
        }
        assert_eq!(crate::cli::parse_args::<Src>(&["x"]).unwrap().source.emulate_source_gbs, None);
        assert_eq!(crate::cli::parse_args::<Src>(&["x", "--emulate-source-gbs", "3.5"]).unwrap().source.emulate_source_gbs, Some(3.5));
        for bad in ["0", "-2", "fast", "inf"] {
            let e = crate::cli::parse_args::<Src>(&["x", &format!("--emulate-source-gbs={bad}")]).unwrap_err().to_string();
            assert!(e.contains("--emulate-source-gbs") && e.contains("positive rate in GB/s"), "{bad}: {e}");
        }
    }

    /// Refused before any GPU is touched (so checked on a machine without one too).
    #[test]
    fn bf16_parts_outside_bf16_are_refused_naming_the_flag() {
        let a: Check = crate::cli::parse_args(&["x", "--backend", "cuda", "--bf16-parts", "gemm"]).unwrap();
        let e = a.backend.open().err().expect("--bf16-parts with --precision f32 is refused");
        let e = format!("{e:#}");
        assert!(e.contains("--bf16-parts gemm") && e.contains("--precision bf16"), "{e}");
    }
}
