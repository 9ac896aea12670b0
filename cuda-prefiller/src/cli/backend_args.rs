//! `--backend` and `--precision`, shared by the subcommands that run the model (`forward`,
//! `calibrate`, `bench`, `serve`), and the one place that opens the backend they choose.

use std::sync::Arc;

use anyhow::Context;

use crate::cpu::CpuBackend;
use crate::cuda::{CudaBackend, Precision};

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
    #[arg(long = "backend", value_enum, default_value_t = BackendChoice::Auto)]
    pub choice: BackendChoice,
    /// CUDA arithmetic: `f32` (check mode: the CPU reference's arithmetic, matches the fp32
    /// golden sets) or `bf16` (serving: BF16 GEMM operands and attention, f32 accumulation,
    /// norms and recurrences; docs/engine-agreement.md).
    #[arg(long, default_value = "f32")]
    pub precision: Precision,
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
        Ok(if cuda {
            Opened::Cuda(Arc::new(CudaBackend::new(self.precision).context("--backend cuda: opening the GPU")?))
        } else {
            Opened::Cpu(Arc::new(CpuBackend))
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
}
