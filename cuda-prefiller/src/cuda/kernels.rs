//! Typed launchers for the kernels of `kernels/*.cu`: one function per kernel, arguments in the
//! order of the kernel signature. Device pointers are raw `u64` addresses; callers own the memory.

use anyhow::{bail, ensure, Result};
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use std::sync::Arc;

use super::gpu::{blocks, DevMem, Gpu, KArgs};
use crate::expert_layout::MatOff;

type P = CUdeviceptr;

/// A 1-D grid for an elementwise kernel over `n` items (grid-stride loops inside).
fn grid1(gpu: &Gpu, n: usize) -> (u32, u32, u32) {
    let b = n.div_ceil(256).clamp(1, (gpu.sm_count.max(1) as usize) * 32);
    (b as u32, 1, 1)
}

/// The float4 kernels apply: every pointer 16-byte aligned, every width and row stride a
/// multiple of 4 (null pointers pass).
fn vec4_ok(ptrs: &[P], dims: &[usize]) -> bool {
    ptrs.iter().all(|p| p % 16 == 0) && dims.iter().all(|d| d % 4 == 0)
}

/// Block width for `quads` float4 columns: a multiple of 32, at most 256.
fn quad_block(quads: usize) -> usize {
    quads.max(1).next_multiple_of(32).min(256)
}

/// Grid of the float4 row kernels: x covers `quads` column quads of a row, y walks `rows` in
/// steps of `per` (grid-stride), about 32 blocks per SM in all.
fn grid_rows4(gpu: &Gpu, quads: usize, rows: usize, per: usize) -> ((u32, u32, u32), (u32, u32, u32)) {
    let bx = quad_block(quads);
    let gx = quads.div_ceil(bx).max(1);
    let want = ((gpu.sm_count.max(1) as usize) * 32).div_ceil(gx).clamp(1, 65535);
    let gy = rows.div_ceil(per).clamp(1, want);
    ((gx as u32, gy as u32, 1), (bx as u32, 1, 1))
}

pub fn bf16_to_f32(gpu: &Gpu, inp: P, out: P, n: usize) -> Result<()> {
    let f = gpu.func("convert", &[], "bf16_to_f32")?;
    gpu.launch(f, grid1(gpu, n), (256, 1, 1), 0, &mut KArgs::new().arg(inp).arg(out).arg(n as i64), "bf16_to_f32")
}

pub fn f32_to_bf16_2d(gpu: &Gpu, inp: P, ins: usize, out: P, rows: usize, cols: usize) -> Result<()> {
    if vec4_ok(&[inp, out], &[cols, ins]) {
        let f = gpu.func("convert", &[], "f32_to_bf16_2d4")?;
        let (grid, block) = grid_rows4(gpu, cols / 4, rows, 4);
        let mut a = KArgs::new().arg(inp).arg(ins as i64).arg(out).arg(rows as i32).arg(cols as i32);
        return gpu.launch(f, grid, block, 0, &mut a, "f32_to_bf16_2d4");
    }
    let f = gpu.func("convert", &[], "f32_to_bf16_2d")?;
    let a = KArgs::new().arg(inp).arg(ins as i64).arg(out).arg(rows as i32).arg(cols as i32);
    gpu.launch(f, grid1(gpu, rows * cols), (256, 1, 1), 0, &mut { a }, "f32_to_bf16_2d")
}

/// Splits f32 `[rows, cols]` (row stride `ld`) into three dense bf16 parts (kernels/bf16_split.cu).
pub fn split_bf16x3(gpu: &Gpu, inp: P, ld: usize, p0: P, p1: P, p2: P, rows: usize, cols: usize) -> Result<()> {
    let f = gpu.func("bf16_split", &[], "split_bf16x3")?;
    let a = KArgs::new().arg(inp).arg(ld as i64).arg(p0).arg(p1).arg(p2).arg(rows as i32).arg(cols as i32);
    gpu.launch(f, (rows as u32, 1, 1), (256, 1, 1), 0, &mut { a }, "split_bf16x3")
}

pub fn add_f32(gpu: &Gpu, a: P, b: P, y: P, n: usize) -> Result<()> {
    if vec4_ok(&[a, b, y], &[n]) {
        let f = gpu.func("convert", &[], "add_f32x4")?;
        // four float4s per thread in flight
        let g = (n / 4).div_ceil(256 * 4).clamp(1, (gpu.sm_count.max(1) as usize) * 32);
        let mut args = KArgs::new().arg(a).arg(b).arg(y).arg((n / 4) as i64);
        return gpu.launch(f, (g as u32, 1, 1), (256, 1, 1), 0, &mut args, "add_f32x4");
    }
    let f = gpu.func("convert", &[], "add_f32")?;
    gpu.launch(f, grid1(gpu, n), (256, 1, 1), 0, &mut KArgs::new().arg(a).arg(b).arg(y).arg(n as i64), "add_f32")
}

pub fn mul_sigmoid(gpu: &Gpu, y: P, ys: usize, g: P, gs: usize, rows: usize, n: usize) -> Result<()> {
    if vec4_ok(&[y, g], &[n, ys, gs]) {
        let f = gpu.func("convert", &[], "mul_sigmoid4")?;
        let (grid, block) = grid_rows4(gpu, n / 4, rows, 4);
        let mut a = KArgs::new().arg(y).arg(ys as i64).arg(g).arg(gs as i64).arg(rows as i32).arg(n as i32);
        return gpu.launch(f, grid, block, 0, &mut a, "mul_sigmoid4");
    }
    let f = gpu.func("convert", &[], "mul_sigmoid")?;
    let mut a = KArgs::new().arg(y).arg(ys as i64).arg(g).arg(gs as i64).arg(rows as i32).arg(n as i32);
    gpu.launch(f, grid1(gpu, rows * n), (256, 1, 1), 0, &mut a, "mul_sigmoid")
}

pub fn embed_rows(gpu: &Gpu, table: P, ids: P, out: P, t: usize, h: usize) -> Result<()> {
    let f = gpu.func("convert", &[], "embed_rows")?;
    let mut a = KArgs::new().arg(table).arg(ids).arg(out).arg(t as i32).arg(h as i32);
    gpu.launch(f, (blocks(t, 1)?, 1, 1), (256, 1, 1), 0, &mut a, "embed_rows")
}

pub fn rmsnorm_rows(gpu: &Gpu, x: P, xs: usize, w: P, y: P, ys: usize, rows: usize, n: usize, eps: f32, bf16_cast: bool) -> Result<()> {
    let bx = quad_block(n / 4);
    let nq = (n / 4).div_ceil(bx);
    if vec4_ok(&[x, w, y], &[n, xs, ys]) && (1..=8).contains(&nq) {
        let name = format!("rmsnorm_rows4_q{nq}");
        let f = gpu.func("rmsnorm", &[], &name)?;
        let mut a = KArgs::new().arg(x).arg(xs as i64).arg(w).arg(y).arg(ys as i64).arg(rows as i32).arg(n as i32).arg(eps).arg(bf16_cast as i32);
        return gpu.launch(f, (blocks(rows, 1)?, 1, 1), (bx as u32, 1, 1), 0, &mut a, &name);
    }
    let f = gpu.func("rmsnorm", &[], "rmsnorm_rows")?;
    let mut a = KArgs::new().arg(x).arg(xs as i64).arg(w).arg(y).arg(ys as i64).arg(rows as i32).arg(n as i32).arg(eps).arg(bf16_cast as i32);
    gpu.launch(f, (blocks(rows, 1)?, 1, 1), (256, 1, 1), 0, &mut a, "rmsnorm_rows")
}

pub fn mla_latent(gpu: &Gpu, kv: P, w: P, out: P, rows: usize, kv_lora: usize, rope: usize, eps: f32) -> Result<()> {
    let f = gpu.func("rmsnorm", &[], "mla_latent")?;
    let mut a = KArgs::new().arg(kv).arg(w).arg(out).arg(rows as i32).arg(kv_lora as i32).arg(rope as i32).arg(eps);
    gpu.launch(f, (blocks(rows, 1)?, 1, 1), (256, 1, 1), 0, &mut a, "mla_latent")
}

pub fn situ_glu(gpu: &Gpu, g: P, gs: usize, u: P, us: usize, out: P, os: usize, rows: usize, n: usize, b1: f32, b2: f32, bf16_out: bool) -> Result<()> {
    let vec = vec4_ok(&[g, u, out], &[n, gs, us, os]);
    let name = if vec { "situ_glu4" } else { "situ_glu" };
    let f = gpu.func("situ", &[], name)?;
    let mut a =
        KArgs::new().arg(g).arg(gs as i64).arg(u).arg(us as i64).arg(out).arg(os as i64).arg(rows as i32).arg(n as i32).arg(b1).arg(b2).arg(bf16_out as i32);
    if vec {
        let (grid, block) = grid_rows4(gpu, n / 4, rows, 4);
        return gpu.launch(f, grid, block, 0, &mut a, name);
    }
    gpu.launch(f, grid1(gpu, rows * n), (256, 1, 1), 0, &mut a, name)
}

/// Bank pointer table passed by value (matches `BankPtrs` in attnres.cu).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct BankPtrs(pub [u64; 32]);

pub fn attnres_mix(gpu: &Gpu, bank: &[P], p: P, norm_w: P, proj_w: P, out: P, t: usize, h: usize, eps: f32, bf16_out: bool) -> Result<()> {
    attnres_mix_variant(gpu, AttnResKernel::Auto, bank, p, norm_w, proj_w, out, t, h, eps, bf16_out)
}

/// Which AttnRes mix kernel runs (`Auto`: the float4 one-read kernel without prefetch where it
/// applies: on the H200 at width 7168 it moves 4.4 TB/s against 3.6 with prefetch, which needs
/// 128 registers and spills at 7 float4s per thread; docs/cuda.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnResKernel {
    Auto,
    /// `attnres_mix`: any width, every candidate read twice.
    Scalar,
    /// `attnres_mix4_q*` / `attnres_mix4np_q*`, forced prefetch on or off (errors where the float4 kernel does not apply).
    Vec4 {
        prefetch: bool,
    },
}

pub fn attnres_mix_variant(
    gpu: &Gpu,
    kernel: AttnResKernel,
    bank: &[P],
    p: P,
    norm_w: P,
    proj_w: P,
    out: P,
    t: usize,
    h: usize,
    eps: f32,
    bf16_out: bool,
) -> Result<()> {
    if bank.len() > 31 {
        bail!("attn_res_mix: {} bank entries, the kernel takes at most 31", bank.len());
    }
    let mut ptrs = [0u64; 32];
    ptrs[..bank.len()].copy_from_slice(bank);
    // one read of every candidate (online softmax, rows in registers) where the float4 kernel applies
    let bx = quad_block(h / 4);
    let nq = (h / 4).div_ceil(bx);
    let vec = vec4_ok(bank, &[h]) && vec4_ok(&[p, norm_w, proj_w, out], &[]) && (1..=8).contains(&nq);
    let prefetch = match kernel {
        AttnResKernel::Scalar => None,
        AttnResKernel::Auto => vec.then_some(false),
        AttnResKernel::Vec4 { prefetch } => {
            ensure!(vec, "attn_res_mix: width {h} or alignment does not fit the float4 kernel");
            Some(prefetch)
        }
    };
    // the float4 kernels (`bx` threads) or the scalar one (256); the same arguments
    let (name, threads) = match prefetch {
        Some(pf) => (format!("attnres_mix4{}_q{nq}", if pf { "" } else { "np" }), bx as u32),
        None => ("attnres_mix".to_string(), 256),
    };
    let f = gpu.func("attnres", &[], &name)?;
    let mut a = KArgs::new()
        .arg(BankPtrs(ptrs))
        .arg(bank.len() as i32)
        .arg(p)
        .arg(norm_w)
        .arg(proj_w)
        .arg(out)
        .arg(t as i32)
        .arg(h as i32)
        .arg(eps)
        .arg(bf16_out as i32);
    gpu.launch(f, (blocks(t, 1)?, 1, 1), (threads, 1, 1), 0, &mut a, &name)
}

pub fn short_conv_silu(gpu: &Gpu, x: P, xs: usize, state: P, w: P, y: P, ys: usize, t: usize, c: usize, kw: usize) -> Result<()> {
    if short_conv_vec4(x, xs, state, w, y, ys, c, kw) {
        return short_conv_silu4(gpu, x, xs, state, w, y, ys, t, c, kw, None);
    }
    let f = gpu.func("short_conv", &[], "short_conv_silu")?;
    let mut a = KArgs::new().arg(x).arg(xs as i64).arg(state).arg(w).arg(y).arg(ys as i64).arg(t as i32).arg(c as i32).arg(kw as i32);
    gpu.launch(f, grid1(gpu, t * c), (256, 1, 1), 0, &mut a, "short_conv_silu")
}

/// Whether the float4 short-conv kernel runs for these pointers and widths.
pub fn short_conv_vec4(x: P, xs: usize, state: P, w: P, y: P, ys: usize, c: usize, kw: usize) -> bool {
    let _ = w; // read as scalars
    vec4_ok(&[x, state, y], &[c, xs, ys]) && (2..=8).contains(&kw)
}

/// The float4 short conv + SiLU (see [`short_conv_vec4`]); with `l2 = Some((eps, scale))` also
/// the per-head L2 norm of the output, heads of 128 columns (`c` a multiple of 128).
pub fn short_conv_silu4(gpu: &Gpu, x: P, xs: usize, state: P, w: P, y: P, ys: usize, t: usize, c: usize, kw: usize, l2: Option<(f32, f32)>) -> Result<()> {
    if !short_conv_vec4(x, xs, state, w, y, ys, c, kw) || (l2.is_some() && !c.is_multiple_of(128)) {
        bail!("short_conv_silu4: widths {c} (strides {xs}/{ys}, window {kw}) or alignment do not fit the float4 kernel");
    }
    let name = format!("short_conv_silu4_w{kw}");
    let f = gpu.func("short_conv", &[], &name)?;
    let bx = quad_block(c / 4);
    let gx = (c / 4).div_ceil(bx);
    let gy = t.div_ceil(16).clamp(1, 65535); // 16 rows per thread (CONV_ROWS)
    let (eps, scale) = l2.unwrap_or((0.0, 1.0));
    let mut a =
        KArgs::new().arg(x).arg(xs as i64).arg(state).arg(w).arg(y).arg(ys as i64).arg(t as i32).arg(c as i32).arg(l2.is_some() as i32).arg(eps).arg(scale);
    gpu.launch(f, (gx as u32, gy as u32, 1), (bx as u32, 1, 1), 0, &mut a, &name)
}

pub fn conv_window_update(gpu: &Gpu, x: P, xs: usize, state_in: P, state_out: P, t: usize, c: usize, kw: usize) -> Result<()> {
    let f = gpu.func("short_conv", &[], "conv_window_update")?;
    let mut a = KArgs::new().arg(x).arg(xs as i64).arg(state_in).arg(state_out).arg(t as i32).arg(c as i32).arg(kw as i32);
    gpu.launch(f, grid1(gpu, (kw - 1) * c), (256, 1, 1), 0, &mut a, "conv_window_update")
}

pub fn router_topk(gpu: &Gpu, logits: P, bias: P, t: usize, e: usize, k: usize, renorm: bool, scale: f32, idx: P, w: P, gap: P) -> Result<()> {
    if k == 0 || k > 64 || k > e {
        bail!("router: top-{k} of {e} experts is not supported (1 <= k <= min(64, E))");
    }
    let f = gpu.func("router", &[], "router_topk")?;
    let mut a = KArgs::new().arg(logits).arg(bias).arg(t as i32).arg(e as i32).arg(k as i32).arg(renorm as i32).arg(scale).arg(idx).arg(w).arg(gap);
    gpu.launch(f, (blocks(t, 1)?, 1, 1), (256, 1, 1), (e * 4) as u32, &mut a, "router_topk")
}

// ---- KDA ---------------------------------------------------------------------------------

pub fn l2_norm_heads(gpu: &Gpu, x: P, rows: usize, h: usize, d: usize, eps: f32, scale: f32) -> Result<()> {
    let nv = d.div_ceil(128);
    if vec4_ok(&[x], &[d]) && (1..=4).contains(&nv) {
        let name = format!("l2_norm_heads4_v{nv}");
        let f = gpu.func("kda", &[], &name)?;
        let mut a = KArgs::new().arg(x).arg(rows as i32).arg(h as i32).arg(d as i32).arg(eps).arg(scale);
        // one warp per two (row, head) units
        return gpu.launch(f, grid1(gpu, (rows * h).div_ceil(2) * 32), (256, 1, 1), 0, &mut a, &name);
    }
    let f = gpu.func("kda", &[], "l2_norm_heads")?;
    let mut a = KArgs::new().arg(x).arg(rows as i32).arg(h as i32).arg(d as i32).arg(eps).arg(scale);
    gpu.launch(f, grid1(gpu, rows * h * 32), (256, 1, 1), 0, &mut a, "l2_norm_heads")
}

pub fn kda_gate(gpu: &Gpu, z: P, a_log: P, dt_bias: P, g: P, rows: usize, h: usize, d: usize, lower_bound: Option<f32>) -> Result<()> {
    let vec = vec4_ok(&[z, dt_bias, g], &[d]);
    let name = if vec { "kda_gate4" } else { "kda_gate" };
    let f = gpu.func("kda", &[], name)?;
    let mut a = KArgs::new()
        .arg(z)
        .arg(a_log)
        .arg(dt_bias)
        .arg(g)
        .arg(rows as i32)
        .arg(h as i32)
        .arg(d as i32)
        .arg(lower_bound.is_some() as i32)
        .arg(lower_bound.unwrap_or(0.0));
    if vec {
        let (grid, block) = grid_rows4(gpu, h * d / 4, rows, 4);
        return gpu.launch(f, grid, block, 0, &mut a, name);
    }
    gpu.launch(f, grid1(gpu, rows * h * d), (256, 1, 1), 0, &mut a, name)
}

pub fn sigmoid(gpu: &Gpu, x: P, y: P, n: usize) -> Result<()> {
    let f = gpu.func("kda", &[], "sigmoid_f32")?;
    gpu.launch(f, grid1(gpu, n), (256, 1, 1), 0, &mut KArgs::new().arg(x).arg(y).arg(n as i64), "sigmoid")
}

/// Floats of one (chunk, head) workspace entry of the chunked KDA (mirrors `kda_ws_floats`).
pub fn kda_ws_floats(d: usize) -> usize {
    4 * 64 * d + 2 * 64 * 64 + d
}

/// Whether the chunked KDA kernels run for `head_dim` on this device (tiling: a multiple of 32,
/// at most 128; shared memory: 96 KiB at 128).
pub fn kda_chunked_supported(gpu: &Gpu, d: usize) -> bool {
    d.is_multiple_of(32) && d <= 128 && kda_prep_smem(d) <= gpu.smem_optin.max(0) as usize
}

/// Chunks per prep/scan segment of the chunked KDA: the workspace is held to about 2 GiB.
pub fn kda_segment_chunks(h: usize, d: usize, nch_total: usize) -> usize {
    ((2usize << 30) / (kda_ws_floats(d) * h * 4)).clamp(1, nch_total.max(1))
}

fn kda_prep_smem(d: usize) -> usize {
    (64 + 3 * 64 * d) * 4
}

/// Asks for the largest shared-memory carveout, so that the blocks per SM the kernels are sized
/// for (two prep, three scan) fit.
fn max_carveout(f: super::gpu::Func, what: &str) -> Result<()> {
    use cudarc::driver::sys;
    // SAFETY: f is a loaded kernel; the attribute takes a percentage.
    unsafe { super::gpu::ck(sys::cuFuncSetAttribute(f.0, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100), what) }
}

/// The state-independent products of chunks `c0 .. c0+nch` that need no solve (one block of 288
/// threads per chunk and head; two blocks per SM at head_dim 128). [`kda_chunk_solve`] follows.
pub fn kda_chunk_prep(gpu: &Gpu, q: P, k: P, g: P, beta: P, t: usize, h: usize, d: usize, c0: usize, nch: usize, ws: P) -> Result<()> {
    if !d.is_multiple_of(32) || d > 128 {
        bail!("chunked KDA kernel needs head_dim a multiple of 32 and <= 128, got {d}");
    }
    let f = gpu.func("kda", &[], "kda_chunk_prep")?;
    max_carveout(f, "kda_chunk_prep: shared memory carveout")?;
    let mut a = KArgs::new().arg(q).arg(k).arg(g).arg(beta).arg(t as i32).arg(h as i32).arg(d as i32).arg(c0 as i32).arg(ws);
    gpu.launch(f, (nch as u32, h as u32, 1), (288, 1, 1), kda_prep_smem(d) as u32, &mut a, "kda_chunk_prep")
}

/// W and U of chunks `c0 .. c0+nch` by forward substitution (one block of 256 threads per chunk and
/// head, one thread per column), after [`kda_chunk_prep`] on the same workspace.
pub fn kda_chunk_solve(gpu: &Gpu, v: P, beta: P, t: usize, h: usize, d: usize, c0: usize, nch: usize, ws: P) -> Result<()> {
    if !d.is_multiple_of(32) || d > 128 {
        bail!("chunked KDA kernel needs head_dim a multiple of 32 and <= 128, got {d}");
    }
    let f = gpu.func("kda", &[], "kda_chunk_solve")?;
    let smem = ((64 * 64 + 64) * 4) as u32;
    let mut a = KArgs::new().arg(v).arg(beta).arg(t as i32).arg(h as i32).arg(d as i32).arg(c0 as i32).arg(ws);
    gpu.launch(f, (nch as u32, h as u32, 1), (256, 1, 1), smem, &mut a, "kda_chunk_solve")
}

/// Walks chunks `c0 .. c0+nch` in order: one block of 128 threads per head and 32 value columns
/// of its state (three blocks per SM at head_dim 128).
pub fn kda_chunk_scan(gpu: &Gpu, ws: P, s: P, out: P, t: usize, h: usize, d: usize, c0: usize, nch: usize) -> Result<()> {
    if !d.is_multiple_of(32) || d > 128 {
        bail!("chunked KDA kernel needs head_dim a multiple of 32 and <= 128, got {d}");
    }
    let f = gpu.func("kda", &[], "kda_chunk_scan")?;
    max_carveout(f, "kda_chunk_scan: shared memory carveout")?;
    let smem = ((3 * 4096 + 32 * d + 64 * 32) * 4) as u32;
    let mut a = KArgs::new().arg(ws).arg(s).arg(out).arg(t as i32).arg(h as i32).arg(d as i32).arg(c0 as i32).arg(nch as i32);
    gpu.launch(f, (h as u32, (d / 32) as u32, 1), (128, 1, 1), smem, &mut a, "kda_chunk_scan")
}

pub fn kda_recurrent(gpu: &Gpu, q: P, k: P, v: P, g: P, beta: P, s: P, out: P, t: usize, h: usize, d: usize) -> Result<()> {
    if d > 1024 {
        bail!("recurrent KDA kernel needs head_dim <= 1024, got {d}");
    }
    let f = gpu.func("kda", &[], "kda_recurrent")?;
    let smem = ((d * d + 3 * d) * 4) as u32;
    let mut a = KArgs::new().arg(q).arg(k).arg(v).arg(g).arg(beta).arg(s).arg(out).arg(t as i32).arg(h as i32).arg(d as i32);
    gpu.launch(f, (h as u32, 1, 1), (d as u32, 1, 1), smem, &mut a, "kda_recurrent")
}

pub fn kda_gated_norm(gpu: &Gpu, o: P, r: P, rs: usize, w: P, out: P, t: usize, h: usize, d: usize, eps: f32, bf16_out: bool) -> Result<()> {
    let nv = d.div_ceil(128);
    // the float4 kernel (one warp per two (t, h) units) or the scalar one (a warp per unit); the same arguments
    let (name, warps) = if vec4_ok(&[o, r, w, out], &[d, rs]) && (1..=4).contains(&nv) {
        (format!("kda_gated_norm4_v{nv}"), (t * h).div_ceil(2))
    } else {
        ("kda_gated_norm".to_string(), t * h)
    };
    let f = gpu.func("kda", &[], &name)?;
    let mut a = KArgs::new().arg(o).arg(r).arg(rs as i64).arg(w).arg(out).arg(t as i32).arg(h as i32).arg(d as i32).arg(eps).arg(bf16_out as i32);
    gpu.launch(f, grid1(gpu, warps * 32), (256, 1, 1), 0, &mut a, &name)
}

// ---- MLA ---------------------------------------------------------------------------------

/// The f32 operands of one causal MLA attention call: q (`[tq][h*(dn+dr)]`, row stride `qs`),
/// the expanded k/v rows (`kv [tk][h*(dn+dv)]`, stride `kvs`) and the shared rope key rows
/// (`kpe`, stride `kps`), for `tk = pos0 + tq` key positions.
#[derive(Debug, Clone, Copy)]
pub struct MlaOperands {
    pub q: P,
    pub qs: usize,
    pub kv: P,
    pub kvs: usize,
    pub kpe: P,
    pub kps: usize,
    pub tq: usize,
    pub pos0: usize,
    pub h: usize,
    pub dn: usize,
    pub dr: usize,
    pub dv: usize,
}

pub fn mla_attn_f32(gpu: &Gpu, m: &MlaOperands, out: P, os: usize, scale: f32) -> Result<()> {
    let f = gpu.func("mla_attn", &[], "mla_attn_f32")?;
    let nt = 128usize;
    let smem = ((m.dn + m.dr + m.dv + nt) * 4) as u32;
    let mut a = KArgs::new()
        .arg(m.q)
        .arg(m.qs as i64)
        .arg(m.kv)
        .arg(m.kvs as i64)
        .arg(m.kpe)
        .arg(m.kps as i64)
        .arg(out)
        .arg(os as i64)
        .arg(m.pos0 as i32)
        .arg(m.h as i32)
        .arg(m.dn as i32)
        .arg(m.dr as i32)
        .arg(m.dv as i32)
        .arg(scale);
    gpu.launch(f, (m.tq as u32, m.h as u32, 1), (nt as u32, 1, 1), smem, &mut a, "mla_attn_f32")
}

fn mla_defines(dqk: usize, dv: usize) -> Vec<String> {
    vec![format!("MLA_DQK={dqk}"), format!("MLA_DV={dv}")]
}

/// Whether the bf16 tensor-core attention kernel supports these head widths.
pub fn mla_bf16_supported(dqk: usize, dv: usize) -> bool {
    dqk.is_multiple_of(16) && dv.is_multiple_of(16) && dqk <= 256 && dv <= 256
}

pub fn mla_pack_q(gpu: &Gpu, q: P, qs: usize, qb: P, tq: usize, h: usize, dqk: usize, dv: usize) -> Result<()> {
    let f = gpu.func("mla_attn", &mla_defines(dqk, dv), "mla_pack_q")?;
    let mut a = KArgs::new().arg(q).arg(qs as i64).arg(qb).arg(tq as i32).arg(h as i32).arg(dqk as i32);
    gpu.launch(f, (tq as u32, h as u32, 1), (128, 1, 1), 0, &mut a, "mla_pack_q")
}

/// Keys `k0 .. k0 + rows` of `Kb`/`Vb` (`[h][tk][..]`), from `kv`/`kpe` rows `0 .. rows` (the
/// caller passes them at key `k0`). `vb == 0`: K only.
pub fn mla_pack_kv(
    gpu: &Gpu,
    kv: P,
    kvs: usize,
    kpe: P,
    kps: usize,
    kb: P,
    vb: P,
    tk: usize,
    k0: usize,
    rows: usize,
    h: usize,
    dn: usize,
    dr: usize,
    dv: usize,
) -> Result<()> {
    if k0 + rows > tk {
        bail!("mla_pack_kv: keys {k0}..{} of {tk}", k0 + rows);
    }
    let kb = kb + (k0 * (dn + dr) * 2) as u64;
    let vb = if vb == 0 { 0 } else { vb + (k0 * dv * 2) as u64 };
    let f = gpu.func("mla_attn", &mla_defines(dn + dr, dv), "mla_pack_kv")?;
    let mut a =
        KArgs::new().arg(kv).arg(kvs as i64).arg(kpe).arg(kps as i64).arg(kb).arg(vb).arg(tk as i32).arg(h as i32).arg(dn as i32).arg(dr as i32).arg(dv as i32);
    gpu.launch(f, (rows as u32, h as u32, 1), (128, 1, 1), 0, &mut a, "mla_pack_kv")
}

/// The keys one attention call sees: `kbase .. kbase + nk` of the context, `kld` per head in the
/// K/V operands, the carried running sums at `st` (0 when the call sees every key).
#[derive(Debug, Clone, Copy)]
pub struct MlaBlock {
    pub kbase: usize,
    pub nk: usize,
    pub kld: usize,
    pub st: P,
}

/// The parameters both MLA attention kernels take after their operands: the output, the
/// queries' rows and positions, the heads, the key block and the softmax scale.
fn mla_call_args(a: KArgs, out: P, os: usize, tq: usize, pos0: usize, h: usize, b: MlaBlock, scale: f32) -> KArgs {
    a.arg(out).arg(os as i64).arg(tq as i32).arg(pos0 as i32).arg(h as i32).arg(b.kbase as i32).arg(b.nk as i32).arg(b.kld as i32).arg(b.st).arg(scale)
}

#[allow(clippy::too_many_arguments)]
pub fn mla_attn_bf16(
    gpu: &Gpu,
    qb: P,
    kb: P,
    vb: P,
    out: P,
    os: usize,
    tq: usize,
    pos0: usize,
    h: usize,
    dqk: usize,
    dv: usize,
    b: MlaBlock,
    scale: f32,
) -> Result<()> {
    let f = gpu.func("mla_attn", &mla_defines(dqk, dv), "mla_attn_bf16")?;
    let smem = (2 * 64 * ((dqk + 8) + (dv + 8)) * 2) as u32;
    let mut a = mla_call_args(KArgs::new().arg(qb).arg(kb).arg(vb), out, os, tq, pos0, h, b, scale);
    gpu.launch(f, (blocks(tq, 128)?, h as u32, 1), (256, 1, 1), smem, &mut a, "mla_attn_bf16")
}

/// Which BF16 MLA attention kernel runs. `Auto`: the wgmma kernel (default configuration) where it
/// applies (sm_90, v width 128, q/k width a multiple of 64), else the mma.sync one.
/// `--mla-kernel mma|wgmma|wgmma:<entry point>|auto` sets the backend's choice (diagnostic).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MlaKernel {
    #[default]
    Auto,
    /// `mla_attn_bf16` (mma.sync m16n8k16): every architecture.
    MmaSync,
    /// `kernels/mla_attn_sm90.cu` (wgmma) in one of `MLA_SM90_VARIANTS`: Hopper only.
    Wgmma(Sm90Variant),
}

impl std::str::FromStr for MlaKernel {
    type Err = anyhow::Error;
    /// `auto`, `mma`, `wgmma` (the default configuration) or `wgmma:<entry point>` of one of
    /// [`MLA_SM90_VARIANTS`].
    fn from_str(s: &str) -> Result<MlaKernel> {
        match s {
            "auto" => Ok(MlaKernel::Auto),
            "mma" => Ok(MlaKernel::MmaSync),
            "wgmma" => Ok(MlaKernel::Wgmma(MLA_SM90_VARIANTS[0])),
            other => match other.strip_prefix("wgmma:").and_then(|n| MLA_SM90_VARIANTS.iter().find(|v| v.name == n)) {
                Some(v) => Ok(MlaKernel::Wgmma(*v)),
                None => bail!(
                    "unknown MLA kernel {other:?} (auto, mma, wgmma or wgmma:<{}>)",
                    MLA_SM90_VARIANTS.iter().map(|v| v.name).collect::<Vec<_>>().join("|")
                ),
            },
        }
    }
}

impl std::fmt::Display for MlaKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MlaKernel::Auto => f.write_str("auto"),
            MlaKernel::MmaSync => f.write_str("mma"),
            MlaKernel::Wgmma(v) => write!(f, "wgmma:{}", v.name),
        }
    }
}

impl MlaKernel {
    /// The kernel that runs for these widths on `gpu` (`Wgmma` asked where it does not apply is an error).
    pub fn resolve(self, gpu: &Gpu, dqk: usize, dv: usize) -> Result<MlaKernel> {
        let wg = mla_sm90_supported(gpu, dqk, dv);
        match self {
            MlaKernel::Auto => Ok(if wg { MlaKernel::Wgmma(MLA_SM90_VARIANTS[0]) } else { MlaKernel::MmaSync }),
            MlaKernel::Wgmma(_) if !wg => bail!(
                "the wgmma MLA kernel needs an sm_90 device (this one is sm_{}{}), v width 128 (got {dv}) and q/k width a multiple of 64 that fits shared memory (got {dqk})",
                gpu.cc.0,
                gpu.cc.1
            ),
            k => Ok(k),
        }
    }
}

/// A configuration of `kernels/mla_attn_sm90.cu`: its entry point, warpgroups (64 query rows
/// each), keys per tile, cp.async stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sm90Variant {
    pub name: &'static str,
    pub warpgroups: usize,
    pub keys: usize,
    pub stages: usize,
}

/// Every configuration of the wgmma kernel; the first is the default (H200, K3 widths, 96 heads:
/// 448 / 448 TFLOP/s at 32k / 128k tokens, against 420 / 422 for 128 rows x 128 keys and 436 / 439
/// with 3 stages; docs/cuda.md).
pub const MLA_SM90_VARIANTS: [Sm90Variant; 3] = [
    Sm90Variant { name: "mla_attn_sm90_m192", warpgroups: 3, keys: 64, stages: 2 },
    Sm90Variant { name: "mla_attn_sm90", warpgroups: 2, keys: 128, stages: 2 },
    Sm90Variant { name: "mla_attn_sm90_m192s3", warpgroups: 3, keys: 64, stages: 3 },
];

impl Sm90Variant {
    /// Shared memory: the Q block, `stages` K and V^T tiles, alignment slack.
    fn smem(&self, dqk: usize, dv: usize) -> usize {
        64 * self.warpgroups * dqk * 2 + self.stages * (self.keys * dqk * 2 + dv * self.keys * 2) + 1024
    }
}

/// Whether `mla_attn_sm90` (every configuration) runs for these widths on `gpu`.
pub fn mla_sm90_supported(gpu: &Gpu, dqk: usize, dv: usize) -> bool {
    gpu.cc == (9, 0) && dv == 128 && dqk.is_multiple_of(64) && dqk > 0 && MLA_SM90_VARIANTS.iter().all(|v| v.smem(dqk, dv) <= gpu.smem_optin.max(0) as usize)
}

/// Row stride of the packed V^T of `tk` keys for `mla_attn_sm90` (whole key tiles, zero padded).
pub fn mla_vt_ld(tk: usize) -> usize {
    tk.div_ceil(128).max(1) * 128
}

/// Keys `k0 .. k0 + rows` of `Vt[h][d][s]` (bf16, row stride `ld`, a multiple of 64, zeros past
/// `tk`) from the v part of `kv` rows `0 .. rows` (the caller passes them at key `k0`). `k0` is a
/// multiple of 64, and so is `rows` unless the block is the last (`k0 + rows == tk`: the
/// padding columns up to `ld` are zeroed with it).
pub fn mla_pack_vt(gpu: &Gpu, kv: P, kvs: usize, vt: P, ld: usize, tk: usize, k0: usize, rows: usize, h: usize, dn: usize, dv: usize) -> Result<()> {
    if !ld.is_multiple_of(64) || ld < tk {
        bail!("mla_pack_vt: row stride {ld} must be a multiple of 64 and at least the {tk} keys");
    }
    let last = k0 + rows == tk;
    if !k0.is_multiple_of(64) || k0 + rows > tk || (!last && !rows.is_multiple_of(64)) {
        bail!("mla_pack_vt: key block {k0}..{} of {tk} (blocks start at multiples of 64; only the last may be partial)", k0 + rows);
    }
    let tiles = if last { (ld - k0) / 64 } else { rows / 64 };
    let f = gpu.func("mla_attn", &mla_defines(dn + 64, dv), "mla_pack_vt")?;
    let vt = vt + (k0 * 2) as u64;
    let mut a = KArgs::new().arg(kv).arg(kvs as i64).arg(vt).arg(ld as i64).arg(rows as i32).arg(h as i32).arg(dn as i32);
    gpu.launch(f, (tiles as u32, h as u32, 1), (256, 1, 1), 0, &mut a, "mla_pack_vt")
}

/// The wgmma flash attention (sm_90) in configuration `var`: Qb/Kb as for `mla_attn_bf16`, V
/// transposed (`mla_pack_vt`).
pub fn mla_attn_sm90(
    gpu: &Gpu,
    var: Sm90Variant,
    qb: P,
    kb: P,
    vt: P,
    vt_ld: usize,
    out: P,
    os: usize,
    tq: usize,
    pos0: usize,
    h: usize,
    dqk: usize,
    dv: usize,
    b: MlaBlock,
    scale: f32,
) -> Result<()> {
    if !mla_sm90_supported(gpu, dqk, dv) || var.smem(dqk, dv) > gpu.smem_optin.max(0) as usize || !vt_ld.is_multiple_of(128) || vt_ld < b.nk {
        bail!("mla_attn_sm90: not applicable (device sm_{}{}, qk {dqk}, v {dv}, V^T stride {vt_ld} for {} keys)", gpu.cc.0, gpu.cc.1, b.nk);
    }
    let f = gpu.func("mla_attn_sm90", &mla_defines(dqk, dv), var.name)?;
    let smem = var.smem(dqk, dv) as u32;
    let mut a = mla_call_args(KArgs::new().arg(qb).arg(kb).arg(vt).arg(vt_ld as i64), out, os, tq, pos0, h, b, scale);
    let rows = 64 * var.warpgroups;
    gpu.launch(f, (blocks(tq, rows)?, h as u32, 1), ((128 * var.warpgroups) as u32, 1, 1), smem, &mut a, var.name)
}

/// Packed bf16 operands of one causal MLA attention call, laid out for the kernel that will run:
/// the queries, and the keys of every position or of one block of them at a time (the blocks in
/// order, each attended before the next is packed: the rows' running sums are carried between
/// them, so the result is bit for bit the one over every key while the K/V operands exist for one
/// block only).
pub struct MlaPacked {
    pub kernel: MlaKernel,
    pub qb: DevMem,
    pub kb: DevMem,
    /// `Vb [h][kcap][dv]` for mma.sync, `Vt [h][dv][vt_ld]` for wgmma.
    pub v: DevMem,
    pub vt_ld: usize,
    pub tq: usize,
    pub pos0: usize,
    pub h: usize,
    pub dqk: usize,
    /// The no-rope part of `dqk`.
    pub dn: usize,
    pub dv: usize,
    /// Keys per head the K/V operands hold (every key, or one block).
    pub kcap: usize,
    /// The keys packed now: `kbase .. kbase + nk`.
    pub kbase: usize,
    pub nk: usize,
    /// Rows' running sums between key blocks (`[tq][h][8]` f32), when the keys come in blocks.
    carry: Option<DevMem>,
}

/// Keys of a block (a multiple of every kernel's key tile, so that the blocks cut the tiles where
/// one call over every key would).
pub const MLA_BLOCK_ALIGN: usize = 128;

/// Packs the operands `m` for `kernel` (resolved on `gpu`): the queries and every key.
pub fn mla_pack(gpu: &Arc<Gpu>, kernel: MlaKernel, m: &MlaOperands) -> Result<MlaPacked> {
    let &MlaOperands { q, qs, kv, kvs, kpe, kps, tq, pos0, h, dn, dr, dv } = m;
    let mut p = mla_pack_queries(gpu, kernel, q, qs, tq, pos0, h, dn, dr, dv, pos0 + tq)?;
    mla_pack_keys(gpu, &mut p, kv, kvs, kpe, kps, 0, pos0 + tq)?;
    Ok(p)
}

/// Packs the queries for `kernel` (resolved on `gpu`) and allocates K/V operands for `kcap` keys
/// (all `pos0 + tq` of them, or a block: a multiple of [`MLA_BLOCK_ALIGN`]), to be filled with
/// [`mla_pack_keys`].
#[allow(clippy::too_many_arguments)]
pub fn mla_pack_queries(
    gpu: &Arc<Gpu>,
    kernel: MlaKernel,
    q: P,
    qs: usize,
    tq: usize,
    pos0: usize,
    h: usize,
    dn: usize,
    dr: usize,
    dv: usize,
    kcap: usize,
) -> Result<MlaPacked> {
    let (dqk, tk) = (dn + dr, pos0 + tq);
    let kcap = kcap.min(tk).max(1);
    if kcap < tk && !kcap.is_multiple_of(MLA_BLOCK_ALIGN) {
        bail!("mla_pack_queries: key blocks of {kcap} (a multiple of {MLA_BLOCK_ALIGN} when shorter than the {tk} keys)");
    }
    let kernel = kernel.resolve(gpu, dqk, dv)?;
    let qb = gpu.alloc(tq * h * dqk * 2)?;
    let kb = gpu.alloc(kcap * h * dqk * 2)?;
    mla_pack_q(gpu, q, qs, qb.ptr, tq, h, dqk, dv)?;
    let (v, vt_ld) = if matches!(kernel, MlaKernel::Wgmma(_)) {
        let ld = mla_vt_ld(kcap);
        (gpu.alloc(h * dv * ld * 2)?, ld)
    } else {
        (gpu.alloc(kcap * h * dv * 2)?, 0)
    };
    let carry = if kcap < tk { Some(gpu.alloc(tq * h * 8 * 4)?) } else { None };
    Ok(MlaPacked { kernel, qb, kb, v, vt_ld, tq, pos0, h, dqk, dn, dv, kcap, kbase: 0, nk: 0, carry })
}

/// Packs keys `kbase .. kbase + rows` into `p` (replacing the block packed before) from their
/// f32 expansion `kv` (`[rows, h·(dn+dv)]`, row stride `kvs`) and rope parts `kpe` (row stride
/// `kps`), both given at key `kbase`. Blocks start at multiples of [`MLA_BLOCK_ALIGN`] and only
/// the last may be shorter than that.
#[allow(clippy::too_many_arguments)]
pub fn mla_pack_keys(gpu: &Gpu, p: &mut MlaPacked, kv: P, kvs: usize, kpe: P, kps: usize, kbase: usize, rows: usize) -> Result<()> {
    let (tk, dr) = (p.pos0 + p.tq, p.dqk - p.dn);
    let last = kbase + rows == tk;
    if rows == 0 || rows > p.kcap || kbase + rows > tk || !kbase.is_multiple_of(MLA_BLOCK_ALIGN) || (!last && !rows.is_multiple_of(MLA_BLOCK_ALIGN)) {
        bail!(
            "mla_pack_keys: key block {kbase}..{} of {tk} in operands for {} keys (blocks start at multiples of {MLA_BLOCK_ALIGN}; only the last may be partial)",
            kbase + rows,
            p.kcap
        );
    }
    if matches!(p.kernel, MlaKernel::Wgmma(_)) {
        mla_pack_kv(gpu, kv, kvs, kpe, kps, p.kb.ptr, 0, p.kcap, 0, rows, p.h, p.dn, dr, p.dv)?; // K only
                                                                                                 // zeros past the block's keys up to the row stride
        mla_pack_vt(gpu, kv, kvs, p.v.ptr, p.vt_ld, rows, 0, rows, p.h, p.dn, p.dv)?;
    } else {
        mla_pack_kv(gpu, kv, kvs, kpe, kps, p.kb.ptr, p.v.ptr, p.kcap, 0, rows, p.h, p.dn, dr, p.dv)?;
    }
    p.kbase = kbase;
    p.nk = rows;
    Ok(())
}

/// Attends the queries of `p` to its packed keys, into `out` (`[tq][h*dv]` f32, row stride `os`):
/// rows whose last key is in this block get their output, the others keep running sums for the
/// next block's call (their `out` rows hold them until then).
pub fn mla_attn_packed(gpu: &Gpu, p: &MlaPacked, out: P, os: usize, scale: f32) -> Result<()> {
    if p.nk == 0 {
        bail!("mla_attn_packed: no keys packed");
    }
    let st = match (&p.carry, p.kbase == 0 && p.nk == p.pos0 + p.tq) {
        (_, true) => 0,
        (Some(c), false) => c.ptr,
        (None, false) => bail!("mla_attn_packed: keys {}..{} of {} without a carry buffer", p.kbase, p.kbase + p.nk, p.pos0 + p.tq),
    };
    let b = MlaBlock { kbase: p.kbase, nk: p.nk, kld: p.kcap, st };
    match p.kernel {
        MlaKernel::Wgmma(var) => mla_attn_sm90(gpu, var, p.qb.ptr, p.kb.ptr, p.v.ptr, p.vt_ld, out, os, p.tq, p.pos0, p.h, p.dqk, p.dv, b, scale),
        _ => mla_attn_bf16(gpu, p.qb.ptr, p.kb.ptr, p.v.ptr, out, os, p.tq, p.pos0, p.h, p.dqk, p.dv, b, scale),
    }
}

// ---- MoE ---------------------------------------------------------------------------------

pub fn moe_count(gpu: &Gpu, idx: P, n: usize, counts: P) -> Result<()> {
    let f = gpu.func("moe_route", &[], "moe_count")?;
    gpu.launch(f, grid1(gpu, n), (256, 1, 1), 0, &mut KArgs::new().arg(idx).arg(n as i32).arg(counts), "moe_count")
}

pub fn moe_offsets(gpu: &Gpu, counts: P, e: usize, bm: usize, offsets: P, cursor: P, tile_expert: P, tile_row0: P, tile_count: P) -> Result<()> {
    let f = gpu.func("moe_route", &[], "moe_offsets")?;
    let mut a = KArgs::new().arg(counts).arg(e as i32).arg(bm as i32).arg(offsets).arg(cursor).arg(tile_expert).arg(tile_row0).arg(tile_count);
    gpu.launch(f, (1, 1, 1), (32, 1, 1), 0, &mut a, "moe_offsets")
}

pub fn moe_scatter(gpu: &Gpu, idx: P, n: usize, k: usize, offsets: P, cursor: P, slot_pos: P, row_token: P) -> Result<()> {
    let f = gpu.func("moe_route", &[], "moe_scatter")?;
    let mut a = KArgs::new().arg(idx).arg(n as i32).arg(k as i32).arg(offsets).arg(cursor).arg(slot_pos).arg(row_token);
    gpu.launch(f, grid1(gpu, n), (256, 1, 1), 0, &mut a, "moe_scatter")
}

pub fn moe_gather(gpu: &Gpu, bf16: bool, x: P, row_token: P, rows: usize, k: usize, xg: P) -> Result<()> {
    let name = if bf16 { "moe_gather_bf16" } else { "moe_gather_f32" };
    let f = gpu.func("moe_route", &[], name)?;
    let mut a = KArgs::new().arg(x).arg(row_token).arg(rows as i32).arg(k as i32).arg(xg);
    gpu.launch(f, (blocks(rows, 1)?, 1, 1), (256, 1, 1), 0, &mut a, name)
}

pub fn moe_combine(gpu: &Gpu, yg: P, slot_pos: P, w: P, t: usize, k: usize, n: usize, out: P) -> Result<()> {
    let f = gpu.func("moe_route", &[], "moe_combine")?;
    let mut a = KArgs::new().arg(yg).arg(slot_pos).arg(w).arg(t as i32).arg(k as i32).arg(n as i32).arg(out);
    gpu.launch(f, (blocks(t, 1)?, 1, 1), (256, 1, 1), 0, &mut a, "moe_combine")
}

/// Row-tile height of the grouped expert GEMMs (f32 / bf16 kernels).
pub const F32_BM: usize = 32;
pub const BF16_BM: usize = 128;

/// Grouped expert GEMM launch: rows grouped by expert through the tile table (`max_tiles` upper
/// bound on its length), experts `e_lo..e_hi` at `wbase + (e - e_lo) * estride`.
pub fn expert_gemm(
    gpu: &Gpu,
    variant: &str,
    stream: Option<CUstream>,
    bf16: bool,
    fused: bool,
    x: P,
    tile_expert: P,
    tile_row0: P,
    tile_count: P,
    offsets: P,
    max_tiles: usize,
    wbase: P,
    estride: usize,
    m1: MatOff,
    m2: MatOff,
    e_lo: usize,
    e_hi: usize,
    n: usize,
    k: usize,
    out: P,
    b1: f32,
    b2: f32,
) -> Result<()> {
    if !k.is_multiple_of(32) {
        bail!("expert GEMM: inner width {k} is not a multiple of 32 (MXFP4 group)");
    }
    if max_tiles > 65535 {
        bail!("expert GEMM: {max_tiles} row tiles exceed the grid limit; split the batch");
    }
    let stream = stream.unwrap_or(gpu.stream());
    // Three kernels, one argument list: the f32 kernel takes both matrices and the `fused` flag,
    // the bf16 gate/up kernel both matrices, the bf16 down kernel one matrix and no SiTU bounds.
    let (name, tile_n) = match (bf16, fused) {
        (false, _) => ("expert_gemm_f32".to_string(), 32),
        (true, true) => (format!("expert_gateup_bf16{variant}"), 64),
        (true, false) => (format!("expert_down_bf16{variant}"), 128),
    };
    let two_mats = fused || !bf16;
    let f = gpu.func("moe_gemm", &[], &name)?;
    let mut a = KArgs::new()
        .arg(x)
        .arg(tile_expert)
        .arg(tile_row0)
        .arg(tile_count)
        .arg(offsets)
        .arg(wbase)
        .arg(estride as i64)
        .arg(m1.packed as i64)
        .arg(m1.scale as i64);
    if two_mats {
        a = a.arg(m2.packed as i64).arg(m2.scale as i64);
    }
    if !bf16 {
        a = a.arg(fused as i32);
    }
    a = a.arg(e_lo as i32).arg(e_hi as i32).arg(n as i32).arg(k as i32).arg(out);
    if two_mats {
        a = a.arg(b1).arg(b2);
    }
    gpu.launch_on(stream, f, (blocks(n, tile_n)?, max_tiles as u32, 1), (256, 1, 1), 0, &mut a, &name)
}

/// Exact BF16 copy of one MXFP4 matrix (`rows` x `k`, at `m` in each slot) of `n_experts`
/// consecutive arena slots from `s0`, to `dst + j * dst_estride` elements for slot `s0 + j`.
/// `offsets` (device, absolute expert ids from `e0`) skips experts without rows; 0 = none.
pub fn expert_dequant_bf16(
    gpu: &Gpu,
    stream: CUstream,
    wbase: P,
    estride: usize,
    s0: usize,
    m: MatOff,
    rows: usize,
    k: usize,
    offsets: P,
    e0: usize,
    n_experts: usize,
    dst: P,
    dst_estride: usize,
) -> Result<()> {
    if !k.is_multiple_of(32) || !m.packed.is_multiple_of(16) || !estride.is_multiple_of(16) || !dst_estride.is_multiple_of(8) {
        bail!("expert dequant: width {k}, packed offset {}, strides {estride}/{dst_estride} are not aligned", m.packed);
    }
    let words = rows * k / 8;
    let f = gpu.func("moe_gemm", &[], "expert_dequant_bf16")?;
    let mut a = KArgs::new()
        .arg(wbase)
        .arg(estride as i64)
        .arg(s0 as i32)
        .arg(m.packed as i64)
        .arg(m.scale as i64)
        .arg(words as i64)
        .arg(offsets)
        .arg(e0 as i32)
        .arg(dst)
        .arg(dst_estride as i64);
    let gx = words.div_ceil(256).clamp(1, 1 << 16) as u32;
    gpu.launch_on(stream, f, (gx, n_experts as u32, 1), (256, 1, 1), 0, &mut a, "expert_dequant_bf16")
}

/// `h[rows, n]` (bf16) = SiTU-GLU of `gu[rows, 2n]` (f32, gate | up).
pub fn expert_situ_bf16(gpu: &Gpu, stream: CUstream, gu: P, rows: usize, n: usize, h: P, b1: f32, b2: f32) -> Result<()> {
    if !n.is_multiple_of(4) {
        bail!("expert SiTU: width {n} is not a multiple of 4");
    }
    let f = gpu.func("moe_gemm", &[], "expert_situ_bf16")?;
    let mut a = KArgs::new().arg(gu).arg(rows as i64).arg(n as i32).arg(h).arg(b1).arg(b2);
    gpu.launch_on(stream, f, grid1(gpu, rows * n / 4), (256, 1, 1), 0, &mut a, "expert_situ_bf16")
}
