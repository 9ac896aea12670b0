//! [`CudaBackend`]: the ops of [`crate::backend::Backend`] on one GPU.
//!
//! Two precisions:
//! - [`Precision::F32`] (check mode): every weight widened to f32, IEEE fp32 GEMMs (no TF32),
//!   f32 attention and expert GEMMs. Meant to match the fp32 golden sets.
//! - [`Precision::Bf16`] (serving): BF16 weights stay BF16, GEMM operands BF16 with f32
//!   accumulation (cuBLAS, tensor cores), the routed experts dequantised from MXFP4 to BF16 in
//!   registers (mma.sync) for short prompts, or per expert group into a BF16 scratch for
//!   cuBLAS when the rows per expert are many ([`super::moe_dense`]), BF16 flash attention;
//!   norms, gates, softmax, the router and the whole KDA recurrence stay f32, and values are
//!   rounded to BF16 where the reference casts them. The router's f32 GEMM runs at FP32 grade
//!   on the tensor cores from [`SPLIT_GEMM_MIN_ROWS`] rows (three-way BF16 split).

use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, ensure, Result};
use cudarc::driver::sys::CUdeviceptr;
use k3_protocol::tensors::DType;

use super::blas::{Blas, GemmType};
use super::gpu::{DevMem, Gpu, HostCopy};
use super::kernels as k;
use super::moe_dense::{self, MoeDenseCfg, MoePath};
use super::moe_plan::MoePlan;
use super::profile;
use crate::backend::{Backend, DeviceBuf, ExpertHostWeights, HostTensor, KdaDims, KdaInputs, MlaDims, MlaForm, OpResult, Routing, SituBetas};
use crate::expert_layout::ExpertLayout;

/// In BF16 mode, f32-weight GEMMs (the router) of at least this many rows run as six BF16
/// part products (FP32 grade, tensor cores); shorter ones on IEEE fp32 cuBLAS.
pub const SPLIT_GEMM_MIN_ROWS: usize = 1024;

/// Arithmetic precision of the CUDA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    /// K3's MX precision (MXFP4 expert weights × MXFP8 activations; `crate::mx`): emulated by
    /// the CPU backend; the FP8 kernels are not built yet.
    Mx,
}

impl std::str::FromStr for Precision {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" | "fp32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "mx" => Ok(Precision::Mx),
            _ => bail!("unknown precision {s:?} (f32, bf16 or mx)"),
        }
    }
}

/// An f32 activation matrix on the GPU.
/// [`Backend::download_later`] on CUDA: the copy on the download stream and its source, kept
/// allocated until the copy is taken.
struct CudaDownload {
    copy: crate::cuda::gpu::Download,
    _src: CudaBuf,
}

impl crate::backend::PendingDownload for CudaDownload {
    fn wait(self: Box<Self>) -> OpResult<Vec<f32>> {
        let CudaDownload { copy, _src } = *self;
        let mut v = vec![0f32; copy.len() / 4];
        copy.finish_into(bytemuck::cast_slice_mut(&mut v))?;
        drop(_src);
        Ok(v)
    }
}

pub struct CudaBuf {
    pub mem: DevMem,
    rows: usize,
    cols: usize,
}

impl CudaBuf {
    pub fn ptr(&self) -> CUdeviceptr {
        self.mem.ptr
    }
    /// Address of row `r`.
    pub fn row(&self, r: usize) -> CUdeviceptr {
        self.mem.ptr + (r * self.cols * 4) as u64
    }
}

impl DeviceBuf for CudaBuf {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

/// A resident dense weight: f32 and/or bf16 copy of a `[rows, cols]` tensor.
pub struct CudaWeight {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub f32: Option<DevMem>,
    pub bf16: Option<DevMem>,
}

impl CudaWeight {
    fn f32_ptr(&self, op: &str) -> Result<CUdeviceptr> {
        self.f32.as_ref().map(|m| m.ptr).ok_or_else(|| anyhow!("{op}: weight {} is not resident in f32", self.name))
    }
}

/// One MoE layer's routed experts, resident: `n` slots of `layout.stride` bytes.
pub struct CudaExperts {
    pub arena: DevMem,
    pub n: usize,
    pub layout: ExpertLayout,
}

/// Which parts of the computation run in BF16 ([`Precision::Bf16`] turns all on; the flag
/// `--bf16-parts gemm,round,experts,attn` picks a subset, a diagnostic for locating where BF16
/// rounding enters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16Parts {
    /// Dense GEMMs with BF16 weights and BF16 activations.
    pub gemm: bool,
    /// Rounding to BF16 where the reference casts (norm outputs, SiTU, AttnRes, KDA output).
    pub round: bool,
    /// Routed experts on the BF16 tensor-core kernel.
    pub experts: bool,
    /// MLA attention on the BF16 flash kernel.
    pub attn: bool,
}

impl Bf16Parts {
    pub const NONE: Bf16Parts = Bf16Parts { gemm: false, round: false, experts: false, attn: false };
    pub const ALL: Bf16Parts = Bf16Parts { gemm: true, round: true, experts: true, attn: true };

    /// Parses `gemm,round,experts,attn` (any subset; `all`, `none`).
    pub fn parse(s: &str) -> Result<Self> {
        let mut p = Bf16Parts::NONE;
        for part in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            match part {
                "gemm" => p.gemm = true,
                "round" => p.round = true,
                "experts" => p.experts = true,
                "attn" => p.attn = true,
                "all" => p = Bf16Parts::ALL,
                "none" => p = Bf16Parts::NONE,
                _ => bail!("unknown BF16 part {part:?} (gemm, round, experts, attn, all, none)"),
            }
        }
        Ok(p)
    }
}

impl std::str::FromStr for Bf16Parts {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Bf16Parts::parse(s)
    }
}

impl std::fmt::Display for Bf16Parts {
    /// In the form [`Bf16Parts::parse`] reads (`all`, `none`, or the parts that are on).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Bf16Parts::ALL {
            return f.write_str("all");
        }
        let on: Vec<&str> =
            [(self.gemm, "gemm"), (self.round, "round"), (self.experts, "experts"), (self.attn, "attn")].iter().filter(|x| x.0).map(|x| x.1).collect();
        f.write_str(if on.is_empty() { "none".to_string() } else { on.join(",") }.as_str())
    }
}

/// The BF16 routed-expert GEMM kernel (`kernels/moe_mma.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeKernel {
    /// Operand fragments by `ldmatrix` (the default).
    #[default]
    Ldmatrix,
    /// The first version: 32-bit shared-memory loads (diagnostic, for comparison).
    Lds32,
}

impl MoeKernel {
    /// The kernel-name suffix of the variant ([`CudaBackend::moe_variant`]).
    pub fn suffix(self) -> &'static str {
        match self {
            MoeKernel::Ldmatrix => "",
            MoeKernel::Lds32 => "_lds32",
        }
    }
}

impl std::str::FromStr for MoeKernel {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "ldmatrix" => Ok(MoeKernel::Ldmatrix),
            "lds32" => Ok(MoeKernel::Lds32),
            _ => bail!("unknown expert kernel {s:?} (ldmatrix or lds32)"),
        }
    }
}

impl std::fmt::Display for MoeKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MoeKernel::Ldmatrix => "ldmatrix",
            MoeKernel::Lds32 => "lds32",
        })
    }
}

/// The CUDA backend's switches, chosen once per process (`k3-prefill`'s flags of the commands
/// that run the model, `cli/backend_args.rs`) and handed to [`CudaBackend::new`]. The defaults
/// are the serving configuration; every other value is a diagnostic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CudaOptions {
    /// The parts of [`Precision::Bf16`] that run in BF16 (`--bf16-parts`); `None`: all of them
    /// (and none in the other precisions).
    pub bf16_parts: Option<Bf16Parts>,
    /// The BF16 routed-expert kernel (`--moe-kernel`).
    pub moe_kernel: MoeKernel,
    /// Sizes of the dense expert path (`--moe-dense`).
    pub moe_dense: MoeDenseCfg,
    /// The BF16 MLA attention kernel (`--mla-kernel`).
    pub mla_kernel: k::MlaKernel,
    /// How the compute stream's host <-> device copies run (`--host-copy`).
    pub host_copy: HostCopy,
    /// GPU time per step and host time blocked on the GPU are recorded (`--profile`).
    pub profile: bool,
}

/// The CUDA implementation of the ops.
pub struct CudaBackend {
    pub gpu: Arc<Gpu>,
    blas: Blas,
    pub precision: Precision,
    pub parts: Bf16Parts,
    /// Kernel-name suffix of the BF16 expert GEMMs: `""` (ldmatrix fragments, default) or
    /// `"_lds32"` (the first version, 32-bit shared loads): [`MoeKernel::suffix`] of `--moe-kernel`.
    pub moe_variant: &'static str,
    /// BF16 expert path: [`MoePath::Auto`] picks per layer and prompt by the routed rows per
    /// expert; tests and `bench --kernels` force one to compare them.
    pub moe_path: MoePath,
    /// Sizes of the dense expert path (`--moe-dense streams=4,group_mib=1024,...`).
    pub moe_dense: MoeDenseCfg,
    moe_workers: Mutex<Option<Arc<moe_dense::Workers>>>,
    /// BF16 MLA attention kernel (`Auto`: wgmma on sm_90, mma.sync elsewhere; `--mla-kernel`).
    pub mla_kernel: k::MlaKernel,
    /// Keys expanded (f32) and packed per block by the BF16 MLA attention
    /// ([`crate::memory_plan::MLA_KEY_BLOCK`], which the plan sizes; tests set a small one to
    /// cross block edges).
    pub mla_key_block: usize,
    /// Device buffers of recent parkings whose copies to the host may still run, oldest first
    /// ([`Backend::park`]; at most [`crate::memory_plan::PARKED_IN_FLIGHT`]).
    parking: Mutex<std::collections::VecDeque<(Arc<crate::cuda::gpu::Event>, CudaBuf)>>,
}

/// [`Backend::park`] on CUDA: the buffer's values in page-locked host memory.
pub struct CudaParked {
    host: crate::cuda::gpu::HostParked,
    rows: usize,
    cols: usize,
}

impl CudaBackend {
    /// Opens GPU 0 with `opts` (logged once, one line); errors (never panics) when no usable
    /// GPU, driver, NVRTC or cuBLAS exists, or when `opts` does not apply to `precision`.
    pub fn new(precision: Precision, opts: &CudaOptions) -> Result<Self> {
        if precision == Precision::Mx {
            bail!(
                "--precision mx: the FP8 (MXFP8 x MXFP4) kernels are not built yet; the CPU backend emulates MX \
                 (--backend cpu --precision mx)"
            );
        }
        let parts = match (precision, opts.bf16_parts) {
            (Precision::Bf16, p) => p.unwrap_or(Bf16Parts::ALL),
            (_, None) => Bf16Parts::NONE,
            (_, Some(p)) => bail!("--bf16-parts {p}: the BF16 parts apply to --precision bf16 only (this backend runs {precision:?})"),
        };
        let gpu = Gpu::open(opts.host_copy, opts.profile)?;
        let blas = Blas::new(gpu.stream())?;
        tracing::info!(
            ?precision,
            bf16_parts = %parts,
            moe_kernel = %opts.moe_kernel,
            moe_dense = %opts.moe_dense,
            mla_kernel = %opts.mla_kernel,
            host_copy = %opts.host_copy,
            profile = opts.profile,
            "CUDA backend options"
        );
        Ok(CudaBackend {
            gpu,
            blas,
            precision,
            parts,
            moe_variant: opts.moe_kernel.suffix(),
            moe_path: MoePath::Auto,
            moe_dense: opts.moe_dense,
            moe_workers: Mutex::new(None),
            mla_kernel: opts.mla_kernel,
            mla_key_block: crate::memory_plan::MLA_KEY_BLOCK,
            parking: Mutex::new(std::collections::VecDeque::new()),
        })
    }

    /// BF16 experts (mma kernel, bf16 grouped activations).
    fn bf16(&self) -> bool {
        self.parts.experts
    }

    /// Uninitialised `[rows, cols]` f32 buffer.
    pub fn empty(&self, rows: usize, cols: usize) -> Result<CudaBuf> {
        Ok(CudaBuf { mem: self.gpu.alloc(rows * cols * 4)?, rows, cols })
    }

    /// Wraps device memory as a buffer.
    pub fn buf_from(&self, mem: DevMem, rows: usize, cols: usize) -> Result<CudaBuf> {
        ensure!(mem.bytes >= rows * cols * 4, "buffer of {} bytes too small for [{rows}, {cols}] f32", mem.bytes);
        Ok(CudaBuf { mem, rows, cols })
    }

    /// `y[rows, n] = x[rows, k] · Wᵀ` on raw pointers (x row stride `ldx`), choosing the GEMM
    /// precision from what the weight holds.
    pub fn gemm_raw(&self, x: CUdeviceptr, ldx: usize, rows: usize, w: &CudaWeight, y: CUdeviceptr, ldy: usize) -> Result<()> {
        if let Some(wb) = &w.bf16 {
            let xb = self.gpu.alloc(rows * w.cols * 2)?;
            k::f32_to_bf16_2d(&self.gpu, x, ldx, xb.ptr, rows, w.cols)?;
            self.blas.gemm(GemmType::Bf16, xb.ptr, w.cols, wb.ptr, y, ldy, rows, w.rows, w.cols)
        } else if self.bf16() && rows >= SPLIT_GEMM_MIN_ROWS {
            self.gemm_f32_split(x, ldx, rows, w, y, ldy)
        } else {
            let wf = w.f32_ptr("gemm")?;
            self.blas.gemm(GemmType::F32, x, ldx, wf, y, ldy, rows, w.rows, w.cols)
        }
    }

    /// An f32-weight GEMM (the router) at FP32 grade on the BF16 tensor cores: x and W split
    /// into three bf16 parts each (kernels/bf16_split.cu), the six part products that reach
    /// 2⁻²⁴ summed in f32, smallest first. On the H200 it lands 2.7e-6 from the float64
    /// product where IEEE fp32 cuBLAS lands 3.6e-7 (k = 1536; the tensor cores' f32
    /// accumulation truncates) and one BF16 pass ~3e-3; IEEE fp32 cuBLAS (no TF32) runs on the
    /// FP32 units at a fraction of the tensor rate (`tests/cuda_router_gemm.rs`, docs/cuda.md).
    fn gemm_f32_split(&self, x: CUdeviceptr, ldx: usize, rows: usize, w: &CudaWeight, y: CUdeviceptr, ldy: usize) -> Result<()> {
        let (n, kk) = (w.rows, w.cols);
        let wf = w.f32_ptr("gemm")?;
        let g = &self.gpu;
        let xp: Vec<DevMem> = (0..3).map(|_| g.alloc(rows * kk * 2)).collect::<Result<_>>()?;
        let wp: Vec<DevMem> = (0..3).map(|_| g.alloc(n * kk * 2)).collect::<Result<_>>()?;
        k::split_bf16x3(g, x, ldx, xp[0].ptr, xp[1].ptr, xp[2].ptr, rows, kk)?;
        k::split_bf16x3(g, wf, kk, wp[0].ptr, wp[1].ptr, wp[2].ptr, n, kk)?;
        // (x part, w part), smallest terms first
        for (i, (a, b)) in [(2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0)].into_iter().enumerate() {
            let beta = if i == 0 { 0.0 } else { 1.0 };
            self.blas.gemm_beta(GemmType::Bf16, xp[a].ptr, kk, wp[b].ptr, y, ldy, rows, n, kk, beta)?;
        }
        Ok(())
    }

    /// Dense bf16 GEMM on raw pointers (benchmarks): `y = x_bf16 · W_bf16ᵀ`.
    pub fn gemm_bf16_raw(&self, xb: CUdeviceptr, w: CUdeviceptr, y: CUdeviceptr, rows: usize, n: usize, kk: usize) -> Result<()> {
        self.blas.gemm(GemmType::Bf16, xb, kk, w, y, n, rows, n, kk)
    }

    /// Groups `t*k` routed selections (`ids` i32 on the device) by expert. `host_offsets`: the
    /// grouped row offsets when the caller knows the routing on the host (else the dense path
    /// reads them back).
    pub fn moe_plan(
        &self,
        ids: CUdeviceptr,
        weights: DevMem,
        t: usize,
        top_k: usize,
        e: usize,
        layout: &ExpertLayout,
        host_offsets: Option<Vec<i32>>,
    ) -> Result<MoePlan> {
        let g = &self.gpu;
        let n = t * top_k;
        let bm = if self.bf16() { k::BF16_BM } else { k::F32_BM };
        let max_tiles = n / bm + e + 1;
        let counts = g.alloc(e * 4)?;
        g.memset0(&counts)?;
        let offsets = g.alloc((e + 1) * 4)?;
        let cursor = g.alloc(e * 4)?;
        let tile_expert = g.alloc(max_tiles * 4)?;
        let tile_row0 = g.alloc(max_tiles * 4)?;
        let tile_count = g.alloc(4)?;
        let slot_pos = g.alloc(n * 4)?;
        let row_token = g.alloc(n * 4)?;
        k::moe_count(g, ids, n, counts.ptr)?;
        k::moe_offsets(g, counts.ptr, e, bm, offsets.ptr, cursor.ptr, tile_expert.ptr, tile_row0.ptr, tile_count.ptr)?;
        k::moe_scatter(g, ids, n, top_k, offsets.ptr, cursor.ptr, slot_pos.ptr, row_token.ptr)?;
        let esz = if self.bf16() { 2 } else { 4 };
        // spare rows past the last: the dense path's GEMMs may run over rounded-up row counts
        let xg = g.alloc((n + moe_dense::MAX_ROW_GRAIN) * layout.latent * esz)?;
        let dense = self.bf16()
            && match self.moe_path {
                MoePath::Mma => false,
                MoePath::Dense => true,
                MoePath::Auto => n >= self.moe_dense.min_rows * e,
            };
        // the dense path keeps the SiTU output per worker slice, not for every routed row
        let hg = g.alloc(if dense { 256 } else { n * layout.inter * esz })?;
        let yg = g.alloc(n * layout.latent * 4)?;
        let mut plan = MoePlan {
            t,
            k: top_k,
            e,
            bm,
            max_tiles,
            offsets,
            tile_expert,
            tile_row0,
            tile_count,
            slot_pos,
            row_token,
            xg,
            hg,
            hg_row_bytes: layout.inter * esz,
            yg,
            weights,
            dense: false,
            host_offsets,
        };
        self.moe_set_dense(&mut plan, dense)?;
        Ok(plan)
    }

    /// Switches a plan between the mma.sync kernel and the dense path (BF16 mode only; the
    /// dense path needs the expert offsets on the host: one device-to-host copy).
    pub fn moe_set_dense(&self, plan: &mut MoePlan, dense: bool) -> Result<()> {
        ensure!(!dense || self.bf16(), "the dense expert path is BF16 only");
        ensure!(!dense || plan.bm == k::BF16_BM, "plan grouped for the f32 kernel");
        if dense && plan.host_offsets.is_none() {
            let mut v = vec![0i32; plan.e + 1];
            self.gpu.dtoh(&mut v, plan.offsets.ptr)?;
            plan.host_offsets = Some(v);
        }
        if !dense {
            // the mma.sync kernels keep the SiTU output of every routed row
            let need = plan.t * plan.k * plan.hg_row_bytes;
            if plan.hg.bytes < need {
                plan.hg = self.gpu.alloc(need)?;
            }
        }
        plan.dense = dense;
        Ok(())
    }

    /// The dense path's worker streams and cuBLAS handles (created on first use).
    pub fn moe_workers(&self) -> Result<Arc<moe_dense::Workers>> {
        let mut w = self.moe_workers.lock().map_err(|_| anyhow!("expert worker table poisoned"))?;
        if w.as_ref().is_none_or(|x| x.len() != self.moe_dense.streams.max(1)) {
            *w = Some(Arc::new(moe_dense::Workers::new(&self.gpu, self.moe_dense.streams)?));
        }
        Ok(w.as_ref().expect("set above").clone())
    }

    /// Exact BF16 copy of experts `lo..hi` (per expert `[W1; W3]` then `W2`, row-major), as the
    /// dense path multiplies them.
    pub fn moe_dequant_bf16(&self, experts: &CudaExperts, lo: usize, hi: usize) -> Result<DevMem> {
        ensure!(lo < hi && hi <= experts.n, "dequant: experts {lo}..{hi} of {}", experts.n);
        let l = &experts.layout;
        let dst = self.gpu.alloc((hi - lo) * moe_dense::bf16_elems(l) * 2)?;
        moe_dense::dequant(&self.gpu, self.gpu.stream(), l, experts.arena.ptr, lo, hi - lo, 0, lo, dst.ptr)?;
        Ok(dst)
    }

    /// Gathers `x_lat` rows into the plan's grouped input buffer.
    pub fn moe_gather(&self, plan: &MoePlan, x_lat: CUdeviceptr, latent: usize) -> Result<()> {
        k::moe_gather(&self.gpu, self.bf16(), x_lat, plan.row_token.ptr, plan.t * plan.k, latent, plan.xg.ptr)
    }

    /// Runs both expert GEMMs for experts `e_lo..e_hi` whose weights sit at `wbase` (slot 0 = `e_lo`).
    pub fn moe_run_chunk(
        &self,
        plan: &MoePlan,
        layout: &ExpertLayout,
        wbase: CUdeviceptr,
        e_lo: usize,
        e_hi: usize,
        betas: SituBetas,
        stream: Option<cudarc::driver::sys::CUstream>,
    ) -> Result<()> {
        if plan.dense {
            return moe_dense::run(&self.gpu, self.moe_dense, &*self.moe_workers()?, plan, layout, wbase, e_lo, e_hi, betas, stream);
        }
        let b2 = betas.linear_beta.unwrap_or(0.0);
        let bf = self.bf16();
        k::expert_gemm(
            &self.gpu,
            self.moe_variant,
            stream,
            bf,
            true,
            plan.xg.ptr,
            plan.tile_expert.ptr,
            plan.tile_row0.ptr,
            plan.tile_count.ptr,
            plan.offsets.ptr,
            plan.max_tiles,
            wbase,
            layout.stride,
            layout.w1,
            layout.w3,
            e_lo,
            e_hi,
            layout.inter,
            layout.latent,
            plan.hg.ptr,
            betas.beta,
            b2,
        )?;
        k::expert_gemm(
            &self.gpu,
            self.moe_variant,
            stream,
            bf,
            false,
            plan.hg.ptr,
            plan.tile_expert.ptr,
            plan.tile_row0.ptr,
            plan.tile_count.ptr,
            plan.offsets.ptr,
            plan.max_tiles,
            wbase,
            layout.stride,
            layout.w2,
            layout.w2,
            e_lo,
            e_hi,
            layout.latent,
            layout.inter,
            plan.yg.ptr,
            0.0,
            0.0,
        )
    }

    /// Weighted combine of the grouped outputs back to `[t, latent]`.
    pub fn moe_combine(&self, plan: &MoePlan, latent: usize) -> Result<CudaBuf> {
        let out = self.empty(plan.t, latent)?;
        k::moe_combine(&self.gpu, plan.yg.ptr, plan.slot_pos.ptr, plan.weights.ptr, plan.t, plan.k, latent, out.ptr())?;
        Ok(out)
    }

    /// Router on the device: `(ids i32 [t,k], weights f32 [t,k], gap f32 [t])`.
    pub fn route_device(&self, logits: &CudaBuf, bias: &CudaWeight, top_k: usize, renorm: bool, scaling: f32) -> Result<(DevMem, DevMem, DevMem)> {
        let (t, e) = (logits.rows, logits.cols);
        ensure!(bias.rows * bias.cols == e, "route: bias {} has {} values for {e} experts", bias.name, bias.rows * bias.cols);
        let ids = self.gpu.alloc(t * top_k * 4)?;
        let w = self.gpu.alloc(t * top_k * 4)?;
        let gap = self.gpu.alloc(t * 4)?;
        k::router_topk(&self.gpu, logits.ptr(), bias.f32_ptr("route")?, t, e, top_k, renorm, scaling, ids.ptr, w.ptr, gap.ptr)?;
        Ok((ids, w, gap))
    }

    /// Uploads host bytes into a fresh device allocation.
    pub fn upload_bytes(&self, bytes: &[u8]) -> Result<DevMem> {
        let m = self.gpu.alloc(bytes.len())?;
        self.gpu.htod(m.ptr, bytes)?;
        Ok(m)
    }

    /// A dense weight from its checkpoint bytes already on the device (`raw`: BF16 or F32
    /// `[rows, cols]`, e.g. a view into a weight-streamer slot): kept as is where this precision
    /// reads it so, else widened to f32 on the compute stream. `load_dense` = upload + this.
    pub fn dense_from_device(&self, name: &str, dtype: DType, rows: usize, cols: usize, raw: DevMem) -> Result<CudaWeight> {
        let n = rows * cols;
        let esize = match dtype {
            DType::BF16 => 2,
            DType::F32 => 4,
            DType::U8 => bail!("tensor {name}: U8 (MXFP4) data is not a dense weight"),
        };
        ensure!(raw.bytes >= n * esize, "tensor {name}: {} device bytes for [{rows}, {cols}] {}", raw.bytes, dtype.name());
        // The router's logits are FP32 by the spec (§3.6): keep its weight f32 in every precision.
        let is_router = name.ends_with("block_sparse_moe.gate.weight");
        let keep_bf16 = self.parts.gemm && dtype == DType::BF16 && rows > 1 && !is_router;
        let (f32m, bf16m) = match (dtype, keep_bf16) {
            (DType::BF16, true) => (None, Some(raw)),
            (DType::BF16, false) => {
                let f = self.gpu.alloc(n * 4)?;
                k::bf16_to_f32(&self.gpu, raw.ptr, f.ptr, n)?;
                (Some(f), None)
            }
            _ => (Some(raw), None),
        };
        Ok(CudaWeight { name: name.to_string(), rows, cols, f32: f32m, bf16: bf16m })
    }

    fn check_same(&self, op: &str, a: &CudaBuf, b: &CudaBuf) -> Result<()> {
        ensure!(a.rows == b.rows && a.cols == b.cols, "{op}: shapes [{}, {}] and [{}, {}] differ", a.rows, a.cols, b.rows, b.cols);
        Ok(())
    }
}

impl CudaBackend {
    /// A plan for host-side `routing` of `x_lat` over `n` experts (ids checked, uploaded; the
    /// grouped offsets taken from the host routing, so no read-back).
    pub fn moe_plan_for(&self, x_lat: &CudaBuf, routing: &Routing, n: usize, layout: &ExpertLayout) -> Result<MoePlan> {
        let (t, kk) = (x_lat.rows, routing.top_k);
        ensure!(routing.ids.len() == t * kk && routing.weights.len() == t * kk, "moe_experts: routing for {} rows, x has {t}", routing.rows());
        let mut counts = vec![0i32; n + 1];
        for &e in &routing.ids {
            ensure!((e as usize) < n, "moe_experts: expert id {e} out of range (layer has {n} experts)");
            counts[e as usize + 1] += 1;
        }
        if self.gpu.profile {
            let rows = &counts[1..];
            let max = rows.iter().copied().max().unwrap_or(0);
            let empty = rows.iter().filter(|&&c| c == 0).count();
            tracing::info!(rows = t * kk, experts = n, mean = (t * kk) as f64 / n.max(1) as f64, max, empty, "routed rows per expert (--profile)");
        }
        for i in 0..n {
            counts[i + 1] += counts[i];
        }
        let ids: Vec<i32> = routing.ids.iter().map(|&e| e as i32).collect();
        let ids_d = self.upload_bytes(bytemuck::cast_slice(&ids))?;
        let w_d = self.upload_bytes(bytemuck::cast_slice(&routing.weights))?;
        ensure!(x_lat.cols == layout.latent, "moe: x_lat has {} columns, experts take {}", x_lat.cols, layout.latent);
        let plan = self.moe_plan(ids_d.ptr, w_d, t, kk, n, layout, Some(counts))?;
        self.moe_gather(&plan, x_lat.ptr(), layout.latent)?;
        Ok(plan)
    }

    /// One plan over the rows of several inputs (the token chunks of a layer), in order: the
    /// routed experts then run once for all of them (one launch sequence per expert, not per
    /// chunk). Undo with [`CudaBackend::moe_split`].
    pub fn moe_plan_merged(&self, inputs: &[(&CudaBuf, &Routing)], n: usize, layout: &ExpertLayout) -> Result<MoePlan> {
        ensure!(!inputs.is_empty(), "moe: no inputs");
        if inputs.len() == 1 {
            return self.moe_plan_for(inputs[0].0, inputs[0].1, n, layout);
        }
        let k = inputs[0].1.top_k;
        ensure!(inputs.iter().all(|(_, r)| r.top_k == k), "moe: token chunks routed with different top-k");
        let rows: usize = inputs.iter().map(|(x, _)| x.rows).sum();
        let cols = inputs[0].0.cols;
        let x = self.empty(rows, cols)?;
        let mut routing = Routing { top_k: k, ids: Vec::with_capacity(rows * k), weights: Vec::with_capacity(rows * k), gap: Vec::new() };
        let mut r0 = 0;
        for (xi, ri) in inputs {
            ensure!(xi.cols == cols, "moe: token chunks of {} and {cols} columns", xi.cols);
            self.gpu.dtod(x.row(r0), xi.ptr(), xi.len() * 4)?;
            routing.ids.extend_from_slice(&ri.ids);
            routing.weights.extend_from_slice(&ri.weights);
            r0 += xi.rows;
        }
        self.moe_plan_for(&x, &routing, n, layout)
    }

    /// Plans for inputs routed with different top-k (calibration adds a top-1 input beside the
    /// layer's top-k chunks, docs/pruning.md): one merged plan per distinct top-k, each with the
    /// indices of its inputs in `inputs`. Every expert chunk then runs against each plan, so
    /// streamed experts still cross PCIe once.
    pub fn moe_plans_by_k(&self, inputs: &[(&CudaBuf, &Routing)], n: usize, layout: &ExpertLayout) -> Result<Vec<(Vec<usize>, MoePlan)>> {
        let mut ks: Vec<usize> = inputs.iter().map(|(_, r)| r.top_k).collect();
        ks.sort_unstable();
        ks.dedup();
        ks.into_iter()
            .map(|k| {
                let idx: Vec<usize> = (0..inputs.len()).filter(|&i| inputs[i].1.top_k == k).collect();
                let group: Vec<(&CudaBuf, &Routing)> = idx.iter().map(|&i| inputs[i]).collect();
                Ok((idx, self.moe_plan_merged(&group, n, layout)?))
            })
            .collect()
    }

    /// The outputs of [`CudaBackend::moe_plans_by_k`]'s plans (after their expert runs), back in
    /// the order of `inputs`.
    pub fn moe_outputs_by_k(&self, plans: Vec<(Vec<usize>, MoePlan)>, inputs: &[(&CudaBuf, &Routing)], latent: usize) -> Result<Vec<CudaBuf>> {
        let mut out: Vec<Option<CudaBuf>> = (0..inputs.len()).map(|_| None).collect();
        for (idx, plan) in plans {
            let rows: Vec<usize> = idx.iter().map(|&i| inputs[i].0.rows).collect();
            let parts = self.moe_split(self.moe_combine(&plan, latent)?, &rows)?;
            for (i, b) in idx.into_iter().zip(parts) {
                out[i] = Some(b);
            }
        }
        out.into_iter().enumerate().map(|(i, b)| b.ok_or_else(|| anyhow::anyhow!("moe: input {i} has no output"))).collect()
    }

    /// Splits a combined `[Σ rows, cols]` output back into the inputs' row counts.
    pub fn moe_split(&self, out: CudaBuf, rows: &[usize]) -> Result<Vec<CudaBuf>> {
        ensure!(rows.iter().sum::<usize>() == out.rows, "moe: {} output rows for {} input rows", out.rows, rows.iter().sum::<usize>());
        if rows.len() == 1 {
            return Ok(vec![out]);
        }
        let mut v = Vec::with_capacity(rows.len());
        let mut r0 = 0;
        for &r in rows {
            let b = self.empty(r, out.cols)?;
            self.gpu.dtod(b.ptr(), out.row(r0), r * out.cols * 4)?;
            v.push(b);
            r0 += r;
        }
        Ok(v)
    }

    pub fn moe_prepare(&self, x_lat: &CudaBuf, ids: CUdeviceptr, weights: DevMem, top_k: usize, e: usize, layout: &ExpertLayout) -> Result<MoePlan> {
        ensure!(x_lat.cols == layout.latent, "moe: x_lat has {} columns, experts take {}", x_lat.cols, layout.latent);
        let plan = self.moe_plan(ids, weights, x_lat.rows, top_k, e, layout, None)?;
        self.moe_gather(&plan, x_lat.ptr(), layout.latent)?;
        Ok(plan)
    }
}

/// The `--profile` step of a GEMM, by its weight's name.
fn gemm_step(w: &str) -> &'static str {
    if w.contains("lm_head") {
        "lm_head"
    } else if w.contains("shared_experts") {
        "shared experts (GEMMs)"
    } else if w.ends_with("block_sparse_moe.gate.weight") {
        "router GEMM"
    } else if w.contains("block_sparse_moe") || w.contains("latent") {
        "latent down/up projections"
    } else if w.contains(".mlp.") {
        "dense FFN (GEMMs)"
    } else if w.contains(".f_a_proj") || w.contains(".f_b_proj") || w.contains(".b_proj") {
        "small GEMMs (f_a/f_b, beta)"
    } else {
        "attention projections (GEMMs)"
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Weight = CudaWeight;
    type Parked = CudaParked;
    type Experts = CudaExperts;

    fn name(&self) -> &'static str {
        "cuda"
    }

    /// 16384 on a GPU with at least 64 GiB (large GEMMs, and enough rows per routed expert for
    /// the dense expert path), 4096 on smaller GPUs (a 32 GB card also holds the weight slots).
    fn default_chunk_tokens(&self) -> usize {
        match self.gpu.mem_info() {
            Ok((_, total)) if total >= 64 << 30 => 16384,
            _ => 4096,
        }
    }

    fn streams_weights(&self) -> bool {
        true
    }

    fn one_time_seconds(&self) -> f64 {
        self.gpu.module_load_seconds()
    }

    fn synchronous(&self) -> bool {
        false
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "uploads, downloads")?;
        ensure!(data.len() == rows * cols, "upload: {} values for [{rows}, {cols}]", data.len());
        let b = self.empty(rows, cols)?;
        self.gpu.htod(b.ptr(), data)?;
        Ok(b)
    }

    fn download(&self, x: &CudaBuf) -> OpResult<Vec<f32>> {
        profile::begin(&self.gpu, "uploads, downloads")?;
        let mut v = vec![0f32; x.len()];
        self.gpu.dtoh(&mut v, x.ptr())?;
        Ok(v)
    }

    fn park(&self, x: CudaBuf) -> OpResult<CudaParked> {
        profile::begin(&self.gpu, "uploads, downloads")?;
        let (rows, cols) = (x.rows, x.cols);
        let host = self.gpu.park(x.ptr(), x.len() * 4)?;
        // the source stays allocated until its copy is done: keep the last few, and wait only
        // for the one that falls out (long done, as a rule)
        let oldest = {
            let mut q = self.parking.lock().map_err(|_| anyhow!("parking queue poisoned"))?;
            // sources whose copies are done are freed now
            while q.front().is_some_and(|(copied, _)| copied.is_done()) {
                q.pop_front();
            }
            q.push_back((host.copied.clone(), x));
            if q.len() > crate::memory_plan::PARKED_IN_FLIGHT {
                q.pop_front()
            } else {
                None
            }
        };
        if let Some((copied, src)) = oldest {
            copied.sync()?;
            drop(src);
        }
        Ok(CudaParked { host, rows, cols })
    }

    fn unpark(&self, p: &CudaParked) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "uploads, downloads")?;
        let b = self.empty(p.rows, p.cols)?;
        ensure!(p.host.len() == b.len() * 4, "a parked buffer of {} bytes for [{}, {}]", p.host.len(), p.rows, p.cols);
        self.gpu.unpark(&p.host, b.ptr())?;
        Ok(b)
    }

    fn download_later(&self, x: CudaBuf) -> OpResult<Box<dyn crate::backend::PendingDownload>> {
        profile::begin(&self.gpu, "uploads, downloads")?;
        let copy = self.gpu.dtoh_start(x.ptr(), x.len() * 4)?;
        Ok(Box::new(CudaDownload { copy, _src: x }))
    }

    fn zeros(&self, rows: usize, cols: usize) -> OpResult<CudaBuf> {
        let b = self.empty(rows, cols)?;
        self.gpu.memset0(&b.mem)?;
        Ok(b)
    }

    fn slice_rows(&self, x: &CudaBuf, row0: usize, n: usize) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "adds, copies")?;
        ensure!(row0 + n <= x.rows, "slice_rows: rows {row0}..{} of a {}-row buffer", row0 + n, x.rows);
        let b = self.empty(n, x.cols)?;
        self.gpu.dtod(b.ptr(), x.row(row0), n * x.cols * 4)?;
        Ok(b)
    }

    fn write_rows(&self, dst: &mut CudaBuf, row0: usize, src: &CudaBuf) -> OpResult<()> {
        ensure!(dst.cols == src.cols, "write_rows: {} columns into {}", src.cols, dst.cols);
        ensure!(row0 + src.rows <= dst.rows, "write_rows: rows {row0}..{} into a {}-row buffer", row0 + src.rows, dst.rows);
        self.gpu.dtod(dst.row(row0), src.ptr(), src.len() * 4)
    }

    fn add_assign(&self, a: &mut CudaBuf, b: &CudaBuf) -> OpResult<()> {
        profile::begin(&self.gpu, "adds, copies")?;
        self.check_same("add_assign", a, b)?;
        k::add_f32(&self.gpu, a.ptr(), b.ptr(), a.ptr(), a.len())
    }

    fn load_dense(&self, w: &HostTensor<'_>) -> OpResult<CudaWeight> {
        let n = w.rows * w.cols;
        let esize = match w.dtype {
            DType::BF16 => 2,
            DType::F32 => 4,
            DType::U8 => bail!("tensor {}: U8 (MXFP4) data is not a dense weight", w.name),
        };
        ensure!(w.bytes.len() == n * esize, "tensor {}: {} bytes, expected {} for [{}, {}]", w.name, w.bytes.len(), n * esize, w.rows, w.cols);
        let raw = self.upload_bytes(&w.bytes)?;
        self.dense_from_device(&w.name, w.dtype, w.rows, w.cols, raw)
    }

    fn load_experts(&self, experts: &[ExpertHostWeights<'_>]) -> OpResult<CudaExperts> {
        ensure!(!experts.is_empty(), "load_experts: no experts");
        let e0 = &experts[0];
        let layout = ExpertLayout::new(e0.w1.out_features, e0.w1.in_features)?;
        let mut host = vec![0u8; layout.stride * experts.len()];
        for (i, e) in experts.iter().enumerate() {
            layout.fill_slot(e, &mut host[i * layout.stride..(i + 1) * layout.stride]).map_err(|err| anyhow!("expert {i}: {err}"))?;
        }
        let arena = self.upload_bytes(&host)?;
        Ok(CudaExperts { arena, n: experts.len(), layout })
    }

    fn gemm(&self, x: &CudaBuf, w: &CudaWeight) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, gemm_step(&w.name))?;
        ensure!(x.cols == w.cols, "gemm: x [{}, {}] · {} [{}, {}]ᵀ", x.rows, x.cols, w.name, w.rows, w.cols);
        let y = self.empty(x.rows, w.rows)?;
        self.gemm_raw(x.ptr(), x.cols, x.rows, w, y.ptr(), w.rows)?;
        Ok(y)
    }

    fn rms_norm(&self, x: &CudaBuf, w: &CudaWeight, eps: f32) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "norms")?;
        ensure!(w.rows * w.cols == x.cols, "rms_norm: weight {} has {} values for {} columns", w.name, w.rows * w.cols, x.cols);
        let y = self.empty(x.rows, x.cols)?;
        k::rmsnorm_rows(&self.gpu, x.ptr(), x.cols, w.f32_ptr("rms_norm")?, y.ptr(), x.cols, x.rows, x.cols, eps, self.parts.round)?;
        Ok(y)
    }

    fn situ_glu(&self, gate: &CudaBuf, up: &CudaBuf, betas: SituBetas) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "SiTU")?;
        self.check_same("situ_glu", gate, up)?;
        let y = self.empty(gate.rows, gate.cols)?;
        let b2 = betas.linear_beta.unwrap_or(0.0);
        k::situ_glu(&self.gpu, gate.ptr(), gate.cols, up.ptr(), up.cols, y.ptr(), y.cols, gate.rows, gate.cols, betas.beta, b2, self.parts.round)?;
        Ok(y)
    }

    fn sigmoid(&self, x: &CudaBuf) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "gates (sigmoid)")?;
        let y = self.empty(x.rows, x.cols)?;
        k::sigmoid(&self.gpu, x.ptr(), y.ptr(), x.len())?;
        Ok(y)
    }

    fn sigmoid_gate_mul(&self, a: &mut CudaBuf, gate: &CudaBuf) -> OpResult<()> {
        profile::begin(&self.gpu, "gates (sigmoid)")?;
        self.check_same("sigmoid_gate_mul", a, gate)?;
        k::mul_sigmoid(&self.gpu, a.ptr(), a.cols, gate.ptr(), gate.cols, a.rows, a.cols)
    }

    fn attn_res_mix(&self, bank: &[&CudaBuf], p: &CudaBuf, norm_w: &CudaWeight, proj_w: &CudaWeight, eps: f32) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "AttnRes mixes")?;
        for b in bank {
            self.check_same("attn_res_mix", b, p)?;
        }
        ensure!(norm_w.rows * norm_w.cols == p.cols && proj_w.rows * proj_w.cols == p.cols, "attn_res_mix: weights do not match width {}", p.cols);
        let out = self.empty(p.rows, p.cols)?;
        let ptrs: Vec<u64> = bank.iter().map(|b| b.ptr()).collect();
        k::attnres_mix(&self.gpu, &ptrs, p.ptr(), norm_w.f32_ptr("attn_res")?, proj_w.f32_ptr("attn_res")?, out.ptr(), p.rows, p.cols, eps, self.parts.round)?;
        Ok(out)
    }

    fn short_conv_silu(&self, x: &CudaBuf, w: &CudaWeight, window: &mut CudaBuf) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "KDA short conv + L2 norms")?;
        let (c, kw) = (w.rows, w.cols);
        ensure!(
            x.cols == c && window.cols == c && window.rows + 1 == kw,
            "short_conv_silu: x [{}, {}], w [{c}, {kw}], window [{}, {}]",
            x.rows,
            x.cols,
            window.rows,
            window.cols
        );
        let y = self.empty(x.rows, c)?;
        k::short_conv_silu(&self.gpu, x.ptr(), c, window.ptr(), w.f32_ptr("short_conv")?, y.ptr(), c, x.rows, c, kw)?;
        let nw = self.empty(kw - 1, c)?;
        k::conv_window_update(&self.gpu, x.ptr(), c, window.ptr(), nw.ptr(), x.rows, c, kw)?;
        *window = nw;
        Ok(y)
    }

    fn short_conv_silu_l2(&self, x: &CudaBuf, w: &CudaWeight, window: &mut CudaBuf, head_dim: usize, eps: f32, scale: f32) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "KDA short conv + L2 norms")?;
        let (c, kw) = (w.rows, w.cols);
        ensure!(
            x.cols == c && window.cols == c && window.rows + 1 == kw,
            "short_conv_silu_l2: x [{}, {}], w [{c}, {kw}], window [{}, {}]",
            x.rows,
            x.cols,
            window.rows,
            window.cols
        );
        ensure!(head_dim > 0 && c.is_multiple_of(head_dim), "short_conv_silu_l2: {c} columns not a multiple of {head_dim}");
        let wp = w.f32_ptr("short_conv")?;
        let y = self.empty(x.rows, c)?;
        if head_dim != 128 || !k::short_conv_vec4(x.ptr(), c, window.ptr(), wp, y.ptr(), c, c, kw) {
            // the fused kernel covers heads of 128 (one warp); otherwise the two ops
            drop(y);
            let mut y = self.short_conv_silu(x, w, window)?;
            self.l2_norm_heads(&mut y, head_dim, eps, scale)?;
            return Ok(y);
        }
        k::short_conv_silu4(&self.gpu, x.ptr(), c, window.ptr(), wp, y.ptr(), c, x.rows, c, kw, Some((eps, scale)))?;
        let nw = self.empty(kw - 1, c)?;
        k::conv_window_update(&self.gpu, x.ptr(), c, window.ptr(), nw.ptr(), x.rows, c, kw)?;
        *window = nw;
        Ok(y)
    }

    fn l2_norm_heads(&self, x: &mut CudaBuf, head_dim: usize, eps: f32, scale: f32) -> OpResult<()> {
        profile::begin(&self.gpu, "KDA short conv + L2 norms")?;
        ensure!(head_dim > 0 && x.cols.is_multiple_of(head_dim), "l2_norm_heads: {} columns not a multiple of {head_dim}", x.cols);
        k::l2_norm_heads(&self.gpu, x.ptr(), x.rows, x.cols / head_dim, head_dim, eps, scale)
    }

    fn kda_gate(&self, z: &CudaBuf, a_log: &CudaWeight, dt_bias: &CudaWeight, dims: KdaDims, lower_bound: Option<f32>) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "KDA gate, gated norm")?;
        ensure!(z.cols == dims.width(), "kda_gate: z has {} columns, heads*dim = {}", z.cols, dims.width());
        ensure!(a_log.rows * a_log.cols >= dims.heads, "kda_gate: A_log has fewer than {} values", dims.heads);
        ensure!(dt_bias.rows * dt_bias.cols == dims.width(), "kda_gate: dt_bias has {} values", dt_bias.rows * dt_bias.cols);
        let g = self.empty(z.rows, z.cols)?;
        k::kda_gate(&self.gpu, z.ptr(), a_log.f32_ptr("kda_gate")?, dt_bias.f32_ptr("kda_gate")?, g.ptr(), z.rows, dims.heads, dims.head_dim, lower_bound)?;
        Ok(g)
    }

    fn kda_chunked(&self, x: &KdaInputs<'_, CudaBuf>, state: &mut CudaBuf, dims: KdaDims, chunk: usize) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "KDA recurrence (chunked)")?;
        x.check("kda_chunked", state, dims)?;
        let (t, h, d) = (x.rows(), dims.heads, dims.head_dim);
        if chunk != 64 {
            tracing::debug!(chunk, "kda_chunked: the CUDA kernel always uses 64-row chunks (same result)");
        }
        let out = self.empty(t, dims.width())?;
        if t == 0 {
            return Ok(out);
        }
        if !k::kda_chunked_supported(&self.gpu, d) {
            // the chunked kernels' tiling (or shared memory) does not fit; the recurrence is the same function
            return self.kda_recurrent(x, state, dims);
        }
        let nch_total = t.div_ceil(64);
        let per_chunk = k::kda_ws_floats(d) * h * 4;
        let seg = k::kda_segment_chunks(h, d, nch_total);
        let ws = self.gpu.alloc(seg * per_chunk)?;
        let mut c0 = 0;
        while c0 < nch_total {
            let n = seg.min(nch_total - c0);
            k::kda_chunk_prep(&self.gpu, x.q.ptr(), x.k.ptr(), x.g.ptr(), x.beta.ptr(), t, h, d, c0, n, ws.ptr)?;
            k::kda_chunk_solve(&self.gpu, x.v.ptr(), x.beta.ptr(), t, h, d, c0, n, ws.ptr)?;
            k::kda_chunk_scan(&self.gpu, ws.ptr, state.ptr(), out.ptr(), t, h, d, c0, n)?;
            c0 += n;
        }
        Ok(out)
    }

    fn kda_recurrent(&self, x: &KdaInputs<'_, CudaBuf>, state: &mut CudaBuf, dims: KdaDims) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "KDA recurrence")?;
        x.check("kda_recurrent", state, dims)?;
        let t = x.rows();
        let out = self.empty(t, dims.width())?;
        let (q, kk, v, g, beta) = (x.q.ptr(), x.k.ptr(), x.v.ptr(), x.g.ptr(), x.beta.ptr());
        k::kda_recurrent(&self.gpu, q, kk, v, g, beta, state.ptr(), out.ptr(), t, dims.heads, dims.head_dim)?;
        Ok(out)
    }

    fn gated_rms_norm(&self, o: &CudaBuf, gate: &CudaBuf, w: &CudaWeight, head_dim: usize, eps: f32) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "KDA gate, gated norm")?;
        self.check_same("gated_rms_norm", o, gate)?;
        ensure!(
            head_dim > 0 && o.cols.is_multiple_of(head_dim) && w.rows * w.cols == head_dim,
            "gated_rms_norm: widths {} / {head_dim} / weight {}",
            o.cols,
            w.rows * w.cols
        );
        let y = self.empty(o.rows, o.cols)?;
        k::kda_gated_norm(
            &self.gpu,
            o.ptr(),
            gate.ptr(),
            gate.cols,
            w.f32_ptr("gated_rms_norm")?,
            y.ptr(),
            o.rows,
            o.cols / head_dim,
            head_dim,
            eps,
            self.parts.round,
        )?;
        Ok(y)
    }

    fn mla_latent(&self, kv: &CudaBuf, w: &CudaWeight, eps: f32, dims: MlaDims) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "MLA latent")?;
        ensure!(kv.cols == dims.latent(), "mla_latent: kv has {} columns, expected {}", kv.cols, dims.latent());
        ensure!(w.rows * w.cols == dims.kv_lora, "mla_latent: norm weight has {} values", w.rows * w.cols);
        let y = self.empty(kv.rows, kv.cols)?;
        k::mla_latent(&self.gpu, kv.ptr(), w.f32_ptr("mla_latent")?, y.ptr(), kv.rows, dims.kv_lora, dims.rope, eps)?;
        Ok(y)
    }

    fn mla_attention(&self, q: &CudaBuf, cache: &CudaBuf, kv_b: &CudaWeight, dims: MlaDims, pos0: usize, _form: MlaForm) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "MLA attention (incl. K/V expansion)")?;
        // Both forms compute the same function; the GPU always evaluates the expanded one.
        let (tq, h) = (q.rows, dims.heads);
        let tk = pos0 + tq;
        ensure!(q.cols == h * dims.qk(), "mla_attention: q has {} columns, expected {}", q.cols, h * dims.qk());
        ensure!(cache.cols == dims.latent() && cache.rows >= tk, "mla_attention: cache [{}, {}] for {tk} positions", cache.rows, cache.cols);
        ensure!(kv_b.rows == h * (dims.nope + dims.v) && kv_b.cols == dims.kv_lora, "mla_attention: kv_b is [{}, {}]", kv_b.rows, kv_b.cols);
        let kvw = h * (dims.nope + dims.v);
        let kpe = cache.ptr() + (dims.kv_lora * 4) as u64;
        let out = self.empty(tq, h * dims.v)?;
        let (dqk, dv) = (dims.qk(), dims.v);
        let (dn, dr) = (dims.nope, dims.rope);
        if self.parts.attn && k::mla_bf16_supported(dqk, dv) {
            // A block of keys at a time: expanded (kv_b), packed to BF16 and attended, the rows'
            // running sums carried to the next block; neither the f32 expansion nor the packed
            // K/V ever exists for the whole context.
            let block = self.mla_key_block.max(k::MLA_BLOCK_ALIGN) / k::MLA_BLOCK_ALIGN * k::MLA_BLOCK_ALIGN;
            let mut packed = k::mla_pack_queries(&self.gpu, self.mla_kernel, q.ptr(), q.cols, tq, pos0, h, dn, dr, dv, block)?;
            let kv = self.empty(block.min(tk), kvw)?;
            let row = (cache.cols * 4) as u64;
            for k0 in (0..tk).step_by(block) {
                let n = block.min(tk - k0);
                self.gemm_raw(cache.ptr() + k0 as u64 * row, cache.cols, n, kv_b, kv.ptr(), kvw)?;
                k::mla_pack_keys(&self.gpu, &mut packed, kv.ptr(), kvw, kpe + k0 as u64 * row, cache.cols, k0, n)?;
                k::mla_attn_packed(&self.gpu, &packed, out.ptr(), h * dv, dims.scale())?;
            }
        } else {
            let kv = self.empty(tk, kvw)?;
            self.gemm_raw(cache.ptr(), cache.cols, tk, kv_b, kv.ptr(), kvw)?;
            let m = k::MlaOperands { q: q.ptr(), qs: q.cols, kv: kv.ptr(), kvs: kvw, kpe, kps: cache.cols, tq, pos0, h, dn, dr, dv };
            k::mla_attn_f32(&self.gpu, &m, out.ptr(), h * dv, dims.scale())?;
        }
        Ok(out)
    }

    fn route(&self, logits: &CudaBuf, bias: &CudaWeight, top_k: usize, renormalize: bool, scaling: f32) -> OpResult<Routing> {
        profile::begin(&self.gpu, "MoE routing, grouping, combine")?;
        let t = logits.rows;
        let (ids, w, gap) = self.route_device(logits, bias, top_k, renormalize, scaling)?;
        let mut ids_h = vec![0i32; t * top_k];
        let mut w_h = vec![0f32; t * top_k];
        let mut gap_h = vec![0f32; t];
        // all three copies queued before the host waits for the first (one wait, not three)
        let copies = [ids.ptr, w.ptr, gap.ptr]
            .into_iter()
            .zip([t * top_k * 4, t * top_k * 4, t * 4])
            .map(|(p, n)| self.gpu.dtoh_start(p, n))
            .collect::<Result<Vec<_>>>()?;
        let mut copies = copies.into_iter();
        let mut next = || copies.next().ok_or_else(|| anyhow::anyhow!("route: a readback is missing"));
        next()?.finish_into(bytemuck::cast_slice_mut(&mut ids_h))?;
        next()?.finish_into(bytemuck::cast_slice_mut(&mut w_h))?;
        next()?.finish_into(bytemuck::cast_slice_mut(&mut gap_h))?;
        drop((ids, w, gap));
        Ok(Routing { top_k, ids: ids_h.into_iter().map(|i| i as u32).collect(), weights: w_h, gap: gap_h })
    }

    fn moe_experts(&self, x_lat: &CudaBuf, routing: &Routing, experts: &CudaExperts, betas: SituBetas) -> OpResult<CudaBuf> {
        profile::begin(&self.gpu, "routed experts")?;
        let layout = experts.layout;
        let plan = self.moe_plan_for(x_lat, routing, experts.n, &layout)?;
        self.moe_run_chunk(&plan, &layout, experts.arena.ptr, 0, experts.n, betas, None)?;
        self.moe_combine(&plan, layout.latent)
    }

    /// The token chunks in groups that fit half the available device memory, each group as one
    /// plan ([`CudaBackend::moe_plan_merged`]) in one pass over the experts.
    fn moe_experts_many(&self, inputs: &[(&CudaBuf, &Routing)], experts: &CudaExperts, betas: SituBetas) -> OpResult<Vec<CudaBuf>> {
        profile::begin(&self.gpu, "routed experts")?;
        let layout = experts.layout;
        let esz = if self.bf16() { 2 } else { 4 };
        // grouped input and f32 output per routed row (+ the SiTU rows the mma.sync path keeps)
        let per_row = layout.latent * (esz + 4) + layout.inter * esz;
        let budget = self.gpu.mem_available()? / 2;
        let mut out = Vec::with_capacity(inputs.len());
        let mut i = 0;
        while i < inputs.len() {
            let (mut j, mut bytes) = (i, 0usize);
            while j < inputs.len() && (j == i || bytes + inputs[j].1.ids.len() * per_row <= budget) {
                bytes += inputs[j].1.ids.len() * per_row;
                j += 1;
            }
            profile::begin(&self.gpu, "routed experts: plan, gather")?;
            let plans = self.moe_plans_by_k(&inputs[i..j], experts.n, &layout)?;
            profile::begin(&self.gpu, "routed experts")?;
            for (_, plan) in &plans {
                self.moe_run_chunk(plan, &layout, experts.arena.ptr, 0, experts.n, betas, None)?;
            }
            profile::begin(&self.gpu, "routed experts: combine")?;
            out.extend(self.moe_outputs_by_k(plans, &inputs[i..j], layout.latent)?);
            i = j;
        }
        Ok(out)
    }
}
