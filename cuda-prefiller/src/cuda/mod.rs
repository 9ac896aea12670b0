//! The CUDA backend: a cudarc driver context, NVRTC-compiled kernels from `kernels/*.cu` (cached
//! on disk per GPU architecture), cuBLAS for the dense BF16/F32 GEMMs, and [`CudaBackend`], the
//! [`crate::backend::Backend`] implementation.
//!
//! Nothing here needs a CUDA toolkit to build: cudarc loads `libcuda`, `libnvrtc` and `libcublas`
//! at run time. [`probe`] checks that they exist before anything touches them (cudarc panics on a
//! missing library), so a machine without a GPU gets a clear error instead.

pub mod backend;
pub mod blas;
pub mod gpu;
pub mod host_wait;
pub mod kernels;
pub mod moe_dense;
pub mod moe_plan;
pub mod nvrtc;
pub mod profile;

pub use backend::{Bf16Parts, CudaBackend, CudaOptions, MoeKernel, Precision, SPLIT_GEMM_MIN_ROWS};
pub use gpu::{DevMem, Gpu, PinnedBuf};

/// Why no CUDA device can be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    #[error("the NVIDIA driver library (libcuda.so) was not found: no NVIDIA GPU driver on this machine")]
    NoDriver,
    #[error("NVRTC (libnvrtc.so) was not found: install the CUDA runtime compiler library")]
    NoNvrtc,
    #[error("cuBLAS (libcublas.so) was not found: install the CUDA cuBLAS library")]
    NoCublas,
    #[error("CUDA driver present but unusable: {0}")]
    Driver(cudarc::driver::DriverError),
    #[error("the CUDA driver reports no GPU")]
    NoGpu,
    #[error("cannot open GPU 0: {0}")]
    Open(cudarc::driver::DriverError),
    #[error("cannot read the compute capability: {0}")]
    ComputeCapability(cudarc::driver::DriverError),
}

/// The device's name and compute capability, or why no CUDA device can be used.
pub fn probe() -> Result<String, ProbeError> {
    // SAFETY: these only try to dlopen the libraries.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Err(ProbeError::NoDriver);
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Err(ProbeError::NoNvrtc);
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Err(ProbeError::NoCublas);
        }
    }
    let n = cudarc::driver::CudaContext::device_count().map_err(ProbeError::Driver)?;
    if n < 1 {
        return Err(ProbeError::NoGpu);
    }
    let ctx = cudarc::driver::CudaContext::new(0).map_err(ProbeError::Open)?;
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
    let (ma, mi) = ctx.compute_capability().map_err(ProbeError::ComputeCapability)?;
    Ok(format!("{name} (sm_{ma}{mi})"))
}

/// `model` as the CUDA model it is when its backend is CUDA: the one place where generic code
/// reaches CUDA-only code (the weight streamer, `bench`'s device rates). Ask
/// [`crate::backend::Backend`]'s capability methods for anything else.
pub fn cuda_model<B: crate::backend::Backend + 'static>(model: &crate::model::Model<B>) -> Option<&crate::model::Model<CudaBackend>> {
    (model as &dyn std::any::Any).downcast_ref::<crate::model::Model<CudaBackend>>()
}

/// True when [`probe`] succeeds.
pub fn available() -> bool {
    probe().is_ok()
}
