//! The routed experts on cuBLAS for long prompts ("dense path").
//!
//! With many rows per expert the register-dequant mma.sync kernel (`kernels/moe_gemm.cu`) is
//! limited by its tensor-core rate; here a group of experts' MXFP4 weights is dequantised once,
//! exactly, to BF16 in a bounded scratch (two buffers: the next group is dequantised while the
//! current one multiplies), and each expert's gate|up and down projections run as cuBLAS GEMMs
//! (bf16 operands, f32 accumulation) spread over a few worker streams, with the fused SiTU-GLU
//! in between. A group's rows (contiguous in the grouped order) are taken in windows of at most
//! `slice_rows` (about a worker's share), so the f32 gate|up scratch stays bounded whatever the
//! routing; per window one GEMM per expert piece and projection, with one SiTU launch over the
//! whole window in between (2 launches per expert + 1 per window; cuBLAS's grouped GEMM,
//! `cublasGemmGroupedBatchedEx` with BF16 operands and f32 output, was refused on the H200 box:
//! docs/cuda.md).
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::sync::Arc;

use anyhow::{anyhow, ensure, Result};
use cudarc::driver::sys::{self, CUdeviceptr, CUstream};

use super::blas::{Blas, GemmType};
use super::gpu::{ck, DevMem, Event, Gpu};
use super::kernels as k;
use super::moe_plan::MoePlan;
use crate::backend::SituBetas;
use crate::expert_layout::ExpertLayout;

/// Which expert implementation runs in BF16 mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoePath {
    /// The dense path when the average rows per expert reach [`MoeDenseCfg::min_rows`].
    Auto,
    /// Always the register-dequant mma.sync kernel.
    Mma,
    /// Always the dense path (dequantise to BF16 + cuBLAS).
    Dense,
}

impl std::str::FromStr for MoePath {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(MoePath::Auto),
            "mma" => Ok(MoePath::Mma),
            "dense" | "cublas" => Ok(MoePath::Dense),
            _ => Err(anyhow!("unknown expert path {s:?} (auto, mma, dense)")),
        }
    }
}

/// Sizes of the dense path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeDenseCfg {
    /// [`MoePath::Auto`] takes the dense path from this many routed rows per expert (average).
    pub min_rows: usize,
    /// Bytes of the two BF16 weight buffers together (sets the experts per group).
    pub weight_bytes: usize,
    /// Most rows of one expert per GEMM (bounds the f32 gate|up scratch of each worker).
    pub slice_rows: usize,
    /// Worker streams (each with its own cuBLAS handle).
    pub streams: usize,
    /// Each expert piece's GEMMs run over its rows rounded up to a multiple of this (1: exact;
    /// at most [`MAX_ROW_GRAIN`]), so that an unevenly routed layer's GEMMs come in a few shapes
    /// whose cuBLAS heuristics are cached instead of one new shape per expert; the extra rows
    /// are computed into scratch and dropped.
    pub row_grain: usize,
}

/// Largest [`MoeDenseCfg::row_grain`] (the grouped inputs of a plan keep this many spare rows).
pub const MAX_ROW_GRAIN: usize = 128;

impl Default for MoeDenseCfg {
    fn default() -> Self {
        MoeDenseCfg { min_rows: DENSE_MIN_ROWS, weight_bytes: 1 << 30, slice_rows: 8192, streams: 4, row_grain: 1 }
    }
}

impl MoeDenseCfg {
    /// Overrides from `streams=4,group_mib=1024,slice=8192,min_rows=128,row_grain=1` (any subset; the
    /// backend's `--moe-dense` and `bench --moe-dense-configs`).
    pub fn parse(s: &str, base: MoeDenseCfg) -> Result<Self> {
        let mut c = base;
        for kv in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let (k, v) = kv.split_once('=').ok_or_else(|| anyhow!("dense expert setting {kv:?} is not key=value"))?;
            let v: usize = v.trim().parse().map_err(|_| anyhow!("dense expert setting {kv:?}: {v:?} is not a number"))?;
            ensure!(v > 0, "dense expert setting {kv:?} must be positive");
            match k.trim() {
                "streams" => c.streams = v.min(32),
                "group_mib" => c.weight_bytes = v << 20,
                "slice" => c.slice_rows = v,
                "min_rows" => c.min_rows = v,
                "row_grain" => {
                    ensure!(v <= MAX_ROW_GRAIN, "dense expert setting {kv:?}: at most {MAX_ROW_GRAIN}");
                    c.row_grain = v
                }
                _ => return Err(anyhow!("unknown dense expert setting {k:?} (streams, group_mib, slice, min_rows, row_grain)")),
            }
        }
        Ok(c)
    }
}

impl std::str::FromStr for MoeDenseCfg {
    type Err = anyhow::Error;
    /// [`MoeDenseCfg::parse`] over the defaults.
    fn from_str(s: &str) -> Result<Self> {
        MoeDenseCfg::parse(s, MoeDenseCfg::default())
    }
}

impl std::fmt::Display for MoeDenseCfg {
    /// In the form [`MoeDenseCfg::parse`] reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "streams={},group_mib={},slice={},min_rows={},row_grain={}",
            self.streams,
            self.weight_bytes >> 20,
            self.slice_rows,
            self.min_rows,
            self.row_grain
        )
    }
}

/// Fewest rows of a work window of the dense path (unless the group has fewer).
const WINDOW_MIN_ROWS: usize = 256;

/// Average routed rows per expert from which [`MoePath::Auto`] takes the dense path.
pub const DENSE_MIN_ROWS: usize = 128;

/// Worker streams and their cuBLAS handles (created on first use, kept by the backend).
pub struct Workers {
    blas: Vec<Blas>,
    streams: Vec<CUstream>,
}
// SAFETY: stream handles are driver objects usable from any thread once the context is bound.
unsafe impl Send for Workers {}
unsafe impl Sync for Workers {}

impl Workers {
    pub fn new(gpu: &Gpu, n: usize) -> Result<Self> {
        gpu.bind()?;
        let mut streams = Vec::new();
        let mut blas = Vec::new();
        for _ in 0..n.max(1) {
            let mut s = std::ptr::null_mut();
            // SAFETY: the context is bound to this thread.
            unsafe { ck(sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32), "creating an expert worker stream")? };
            streams.push(s);
            blas.push(Blas::new(s)?);
        }
        Ok(Workers { blas, streams })
    }
    pub fn len(&self) -> usize {
        self.streams.len()
    }
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.blas.clear();
        for &s in &self.streams {
            // SAFETY: streams created in `new`, destroyed once.
            unsafe {
                let _ = sys::cuStreamDestroy_v2(s);
            }
        }
    }
}

/// Elements of one expert's BF16 copy: `[W1; W3]` (`[2·inter, latent]`) then `W2` (`[latent, inter]`).
pub fn bf16_elems(layout: &ExpertLayout) -> usize {
    3 * layout.inter * layout.latent
}

/// Dequantises experts `s0..s0+n` of an arena (slot 0 at `wbase`) into `dst` (one
/// [`bf16_elems`] block per expert) on `stream`; `offsets` (device, or 0) skips experts without
/// rows, `e0` is the absolute id of slot `s0`.
pub fn dequant(
    gpu: &Gpu,
    stream: CUstream,
    layout: &ExpertLayout,
    wbase: CUdeviceptr,
    s0: usize,
    n: usize,
    offsets: CUdeviceptr,
    e0: usize,
    dst: CUdeviceptr,
) -> Result<()> {
    let (i, l) = (layout.inter, layout.latent);
    let per = bf16_elems(layout);
    for (m, rows, kk, at) in [(layout.w1, i, l, 0), (layout.w3, i, l, i * l), (layout.w2, l, i, 2 * i * l)] {
        k::expert_dequant_bf16(gpu, stream, wbase, layout.stride, s0, m, rows, kk, offsets, e0, n, dst + (at * 2) as u64, per)?;
    }
    Ok(())
}

/// Both expert GEMMs of experts `e_lo..e_hi` (slot 0 at `wbase` = expert `e_lo`) on the dense
/// path, ordered after earlier work of `stream` and before later work of it.
pub fn run(
    g: &Arc<Gpu>,
    cfg: MoeDenseCfg,
    workers: &Workers,
    plan: &MoePlan,
    layout: &ExpertLayout,
    wbase: CUdeviceptr,
    e_lo: usize,
    e_hi: usize,
    betas: SituBetas,
    stream: Option<CUstream>,
) -> Result<()> {
    run_many(g, cfg, workers, &[plan], layout, wbase, e_lo, e_hi, betas, stream)
}

/// [`run`] for several plans over the same experts (the token chunks of one layer): each expert
/// group is dequantised once and multiplied with the rows of every plan.
pub fn run_many(
    g: &Arc<Gpu>,
    cfg: MoeDenseCfg,
    workers: &Workers,
    plans: &[&MoePlan],
    layout: &ExpertLayout,
    wbase: CUdeviceptr,
    e_lo: usize,
    e_hi: usize,
    betas: SituBetas,
    stream: Option<CUstream>,
) -> Result<()> {
    let mut offs = Vec::with_capacity(plans.len());
    for p in plans {
        let o = p.host_offsets.as_ref().ok_or_else(|| anyhow!("dense expert path: the plan holds no host copy of the expert offsets"))?;
        ensure!(e_hi <= p.e && o.len() == p.e + 1, "dense expert path: experts {e_lo}..{e_hi} of a {}-expert plan", p.e);
        offs.push(o);
    }
    let rows_of = |pi: usize, e: usize| (offs[pi][e + 1] - offs[pi][e]).max(0) as usize;
    if (0..plans.len()).all(|pi| (e_lo..e_hi).all(|e| rows_of(pi, e) == 0)) {
        return Ok(());
    }
    let t_host = std::time::Instant::now();
    let nw = workers.len();
    let s = stream.unwrap_or(g.stream());
    let (inter, lat) = (layout.inter, layout.latent);
    let per = bf16_elems(layout);
    let gsize = (cfg.weight_bytes / 2 / (per * 2)).clamp(1, e_hi - e_lo);
    // groups: consecutive slot ranges of gsize experts holding at least one routed row
    let groups: Vec<(usize, usize)> = (e_lo..e_hi)
        .step_by(gsize)
        .map(|a| (a, (a + gsize).min(e_hi)))
        .filter(|&(a, z)| (a..z).any(|e| (0..plans.len()).any(|pi| rows_of(pi, e) > 0)))
        .collect();
    // one plan: its device offsets let the dequantisation skip experts without rows
    let skip_offsets = if plans.len() == 1 { plans[0].offsets.ptr } else { 0 };
    let slice = cfg.slice_rows.max(1);
    let b2 = betas.linear_beta.unwrap_or(0.0);
    // Work items: per group, per plan, the group's rows (contiguous in the plan's grouped order)
    // in windows of at most `slice` rows (about a worker's share of the group), each on one
    // worker stream; a window's problems are its experts' pieces (expert, first row, rows). Per
    // window: one gate|up GEMM per problem, one SiTU over the window's rows, one down GEMM per
    // problem.
    struct Win {
        gi: usize,
        pi: usize,
        r0: usize,
        rows: usize,
        w: usize,
        probs: std::ops::Range<usize>,
    }
    let mut wins: Vec<Win> = Vec::new();
    let mut probs: Vec<(usize, usize, usize)> = Vec::new();
    let mut load = vec![0usize; nw];
    for (gi, &(a, z)) in groups.iter().enumerate() {
        for (pi, o) in offs.iter().enumerate() {
            let (lo, hi) = (o[a].max(0) as usize, o[z].max(0) as usize);
            let share = slice.min((hi - lo).div_ceil(nw).max(WINDOW_MIN_ROWS));
            let mut r0 = lo;
            while r0 < hi {
                let rows = share.min(hi - r0);
                let first = probs.len();
                for e in a..z {
                    let (s0, s1) = (o[e].max(0) as usize, o[e + 1].max(0) as usize);
                    let (p0, p1) = (s0.max(r0), s1.min(r0 + rows));
                    if p0 < p1 {
                        probs.push((e, p0, p1 - p0));
                    }
                }
                let w = (0..nw).min_by_key(|&w| load[w]).unwrap_or(0);
                load[w] += rows;
                wins.push(Win { gi, pi, r0, rows, w, probs: first..probs.len() });
                r0 += rows;
            }
        }
    }
    // scratch, stream-ordered on the compute stream (freed there after the join below)
    let grain = cfg.row_grain.clamp(1, MAX_ROW_GRAIN);
    if grain > 1 {
        for p in plans {
            ensure!(p.xg.bytes >= (p.t * p.k + grain - 1) * lat * 2, "dense expert path: the plan's grouped inputs keep no spare rows for row_grain {grain}");
        }
    }
    // rows a GEMM of an `n`-row piece runs over
    let padded = |n: usize| n.div_ceil(grain) * grain;
    let wmax = wins.iter().map(|w| w.rows).max().unwrap_or(1) + grain - 1;
    let wbuf: Vec<DevMem> = (0..groups.len().min(2)).map(|_| g.alloc(gsize * per * 2)).collect::<Result<_>>()?;
    let gu: Vec<DevMem> = (0..nw).map(|_| g.alloc(wmax * 2 * inter * 4)).collect::<Result<_>>()?;
    let hs: Vec<DevMem> = (0..nw).map(|_| g.alloc(wmax * inter * 2)).collect::<Result<_>>()?;
    // with padded pieces the down projection lands in a window scratch first (the spare rows of a
    // window's last piece would overwrite the next window's rows), then the window's rows are copied
    let ys: Vec<DevMem> = if grain > 1 { (0..nw).map(|_| g.alloc(wmax * lat * 4)).collect::<Result<_>>()? } else { Vec::new() };
    if s != g.stream() {
        let e = g.event()?;
        e.record(g.stream())?;
        e.wait_on(s)?;
    }
    let mut done: Vec<Vec<Event>> = Vec::new();
    let mut wi = 0;
    for (gi, &(a, z)) in groups.iter().enumerate() {
        let buf = &wbuf[gi % 2];
        if gi >= 2 {
            // the buffer was last read by group gi - 2
            for ev in &done[gi - 2] {
                ev.wait_on(s)?;
            }
        }
        dequant(g, s, layout, wbase, a - e_lo, z - a, skip_offsets, a, buf.ptr)?;
        let ready = g.event()?;
        ready.record(s)?;
        for &ws in &workers.streams {
            ready.wait_on(ws)?;
        }
        while wi < wins.len() && wins[wi].gi == gi {
            let win = &wins[wi];
            let plan = plans[win.pi];
            let (ws, blas) = (workers.streams[win.w], &workers.blas[win.w]);
            // (pieces in row order on one stream: a piece's spare rows are overwritten by the next piece)
            for &(e, row, n) in &probs[win.probs.clone()] {
                let wgu = buf.ptr + ((e - a) * per * 2) as u64;
                blas.gemm(
                    GemmType::Bf16,
                    plan.xg.ptr + (row * lat * 2) as u64,
                    lat,
                    wgu,
                    gu[win.w].ptr + ((row - win.r0) * 2 * inter * 4) as u64,
                    2 * inter,
                    padded(n),
                    2 * inter,
                    lat,
                )?;
            }
            k::expert_situ_bf16(g, ws, gu[win.w].ptr, win.rows, inter, hs[win.w].ptr, betas.beta, b2)?;
            for &(e, row, n) in &probs[win.probs.clone()] {
                let wd = buf.ptr + ((e - a) * per * 2 + 2 * inter * lat * 2) as u64;
                let y = match ys.get(win.w) {
                    Some(ys) => ys.ptr + ((row - win.r0) * lat * 4) as u64,
                    None => plan.yg.ptr + (row * lat * 4) as u64,
                };
                blas.gemm(GemmType::Bf16, hs[win.w].ptr + ((row - win.r0) * inter * 2) as u64, inter, wd, y, lat, padded(n), lat, inter)?;
            }
            if let Some(ys) = ys.get(win.w) {
                // SAFETY: both ranges lie inside their allocations (window rows of yg, scratch of wmax rows).
                unsafe {
                    ck(
                        sys::cuMemcpyDtoDAsync_v2(plan.yg.ptr + (win.r0 * lat * 4) as u64, ys.ptr, win.rows * lat * 4, ws),
                        "dense expert path: copying a window's outputs",
                    )?
                };
            }
            wi += 1;
        }
        let evs = workers
            .streams
            .iter()
            .map(|&ws| {
                let e = g.event()?;
                e.record(ws)?;
                Ok(e)
            })
            .collect::<Result<Vec<_>>>()?;
        done.push(evs);
    }
    // join: each worker stream is in order, so its last event covers all its work
    if let Some(last) = done.last() {
        for ev in last {
            ev.wait_on(s)?;
        }
    }
    if s != g.stream() {
        let e = g.event()?;
        e.record(s)?;
        e.wait_on(g.stream())?;
    }
    drop((wbuf, gu, hs, ys));
    if g.profile {
        tracing::info!(
            groups = groups.len(),
            windows = wins.len(),
            gemms = 2 * probs.len(),
            host_ms = t_host.elapsed().as_secs_f64() * 1e3,
            "dense expert path enqueued (--profile)"
        );
    }
    Ok(())
}
