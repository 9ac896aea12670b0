//! Dense GEMMs through cuBLAS: `y[rows, out] = x[rows, in] · W[out, in]ᵀ`, f32 output.
//! F32 weights use IEEE fp32 arithmetic (`CUBLAS_COMPUTE_32F_PEDANTIC`: no TF32); BF16 weights
//! take BF16 activations and accumulate in f32 on the tensor cores.

use std::ffi::c_void;

use anyhow::{anyhow, bail, Result};
use cudarc::cublas::sys as cb;
use cudarc::driver::sys::CUdeviceptr;

pub struct Blas {
    h: cb::cublasHandle_t,
}
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

fn ckb(r: cb::cublasStatus_t, what: &str) -> Result<()> {
    if r == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(anyhow!("cuBLAS error in {what}: {r:?}"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmType {
    /// A (weights) and B (activations) f32, IEEE fp32 math.
    F32,
    /// A and B bf16, f32 accumulation.
    Bf16,
}

impl Blas {
    pub fn new(stream: cudarc::driver::sys::CUstream) -> Result<Self> {
        let mut h = std::ptr::null_mut();
        unsafe {
            ckb(cb::cublasCreate_v2(&mut h), "cublasCreate")?;
            ckb(cb::cublasSetStream_v2(h, stream as _), "cublasSetStream")?;
        }
        Ok(Blas { h })
    }

    /// `y[rows, n_out] = x[rows, k] · W[n_out, k]ᵀ` with row strides `ldx` (elements of x) and
    /// `ldy` (of y); W is dense `[n_out, k]`.
    pub fn gemm(
        &self,
        ty: GemmType,
        x: CUdeviceptr,
        ldx: usize,
        w: CUdeviceptr,
        y: CUdeviceptr,
        ldy: usize,
        rows: usize,
        n_out: usize,
        k: usize,
    ) -> Result<()> {
        self.gemm_beta(ty, x, ldx, w, y, ldy, rows, n_out, k, 0.0)
    }

    /// [`Blas::gemm`] with `y = x · Wᵀ + beta · y` (f32 `y`).
    pub fn gemm_beta(
        &self,
        ty: GemmType,
        x: CUdeviceptr,
        ldx: usize,
        w: CUdeviceptr,
        y: CUdeviceptr,
        ldy: usize,
        rows: usize,
        n_out: usize,
        k: usize,
        beta: f32,
    ) -> Result<()> {
        if rows == 0 || n_out == 0 {
            return Ok(());
        }
        let (m, n, kk) = (i32::try_from(n_out)?, i32::try_from(rows)?, i32::try_from(k)?);
        let (lda, ldb, ldc) = (i32::try_from(k)?, i32::try_from(ldx)?, i32::try_from(ldy)?);
        if ldx < k || ldy < n_out {
            bail!("gemm: leading dimensions {ldx}/{ldy} smaller than {k}/{n_out}");
        }
        let alpha = 1.0f32;
        let (dt, ct) = match ty {
            GemmType::F32 => (cb::cudaDataType::CUDA_R_32F, cb::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC),
            GemmType::Bf16 => (cb::cudaDataType::CUDA_R_16BF, cb::cublasComputeType_t::CUBLAS_COMPUTE_32F),
        };
        unsafe {
            ckb(
                cb::cublasGemmEx(
                    self.h,
                    cb::cublasOperation_t::CUBLAS_OP_T,
                    cb::cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n,
                    kk,
                    &alpha as *const f32 as *const c_void,
                    w as *const c_void,
                    dt,
                    lda,
                    x as *const c_void,
                    dt,
                    ldb,
                    &beta as *const f32 as *const c_void,
                    y as *mut c_void,
                    cb::cudaDataType::CUDA_R_32F,
                    ldc,
                    ct,
                    cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                ),
                &format!("gemm [{rows}x{k}]·[{n_out}x{k}]ᵀ ({ty:?})"),
            )
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        unsafe {
            let _ = cb::cublasDestroy_v2(self.h);
        }
    }
}
