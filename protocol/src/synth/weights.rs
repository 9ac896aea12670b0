//! The random-weight recipe of spec §6, generated chunk by chunk so that any tensor (a 2.3 GB
//! embedding table, a 17.5 MB expert) is produced in bounded memory and in parallel, with the
//! same bytes for the same seed:
//!
//! - 2-D (and conv/patch) weights `N(0, 1/fan_in)`, `fan_in` = product of the trailing dims;
//! - norm gains `U(0.5, 1.5)`; `*_res_proj` `N(0, 4/H)`;
//! - `A_log` `N(0, 0.25)` on the first `num_heads` entries, exact zeros in the padding;
//! - `dt_bias` `N(0, 4)`; router bias `N(0, 0.05²)`; embeddings `N(0, 1)`;
//!   vision position table `N(0, 0.02²)`;
//! - routed experts `N(0, 1/in)`, quantised to MXFP4 with `scale = 2^ceil(log2(amax/6))`
//!   per 32-group ([`crate::mxfp4::quantize`]) in the compressed-tensors layout.

use super::rng::Rng;
use crate::mxfp4;
use crate::tensors::{DType, Init, TensorSpec};

/// Elements per chunk of an ordinary tensor (4 MiB of output for F32, 2 MiB for BF16).
pub const CHUNK_ELEMS: usize = 1 << 20;

/// Values per generation block of an expert weight (bounded scratch memory).
const EXPERT_BLOCK_ELEMS: usize = 1 << 16;

/// One independent piece of generation work. Units are produced in file order.
#[derive(Debug, Clone)]
pub enum Unit {
    /// Elements `[chunk * CHUNK_ELEMS, …)` of an ordinary tensor.
    Plain { spec: usize, chunk: usize },
    /// A whole MXFP4 expert weight: emits its packed and/or scale tensor (the pair is adjacent
    /// in the checkpoint order, so normally one unit emits both).
    Expert { packed: Option<usize>, scale: Option<usize> },
}

/// The logical `[out, in]` and base name of an MXFP4 tensor (`…w1.weight_packed` → `…w1`).
fn expert_geometry(s: &TensorSpec) -> (String, usize, usize) {
    let (base, mult) = match s.init {
        Init::Mxfp4Packed => (s.name.strip_suffix(".weight_packed").unwrap_or(&s.name), 2),
        _ => (s.name.strip_suffix(".weight_scale").unwrap_or(&s.name), mxfp4::GROUP),
    };
    (base.to_string(), s.shape.first().copied().unwrap_or(0), s.shape.get(1).copied().unwrap_or(0) * mult)
}

/// Splits the tensor list into generation units, in file order.
pub fn units(specs: &[TensorSpec]) -> Vec<Unit> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < specs.len() {
        let s = &specs[i];
        match s.init {
            Init::Mxfp4Packed | Init::Mxfp4Scale => {
                let (base, o, n) = expert_geometry(s);
                let pair = specs.get(i + 1).filter(|t| s.init == Init::Mxfp4Packed && t.init == Init::Mxfp4Scale && expert_geometry(t) == (base.clone(), o, n));
                if pair.is_some() {
                    out.push(Unit::Expert { packed: Some(i), scale: Some(i + 1) });
                    i += 2;
                    continue;
                }
                let u = if s.init == Init::Mxfp4Packed { Unit::Expert { packed: Some(i), scale: None } } else { Unit::Expert { packed: None, scale: Some(i) } };
                out.push(u);
            }
            _ => {
                let chunks = s.numel().div_ceil(CHUNK_ELEMS).max(1);
                out.extend((0..chunks).map(|chunk| Unit::Plain { spec: i, chunk }));
            }
        }
        i += 1;
    }
    out
}

/// Output bytes of a unit (for batching and progress).
pub fn unit_bytes(specs: &[TensorSpec], u: &Unit) -> usize {
    match *u {
        Unit::Plain { spec, chunk } => {
            let s = &specs[spec];
            let n = s.numel().saturating_sub(chunk * CHUNK_ELEMS).min(CHUNK_ELEMS);
            n * s.dtype.size()
        }
        Unit::Expert { packed, scale } => packed.map_or(0, |i| specs[i].nbytes()) + scale.map_or(0, |i| specs[i].nbytes()),
    }
}

#[inline]
fn normal(rng: &mut Rng) -> f32 {
    rng.normal()
}

#[inline]
fn uniform01(rng: &mut Rng) -> f32 {
    (rng.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

fn fan_in(s: &TensorSpec) -> usize {
    if s.shape.len() >= 2 {
        s.shape[1..].iter().product::<usize>().max(1)
    } else {
        s.numel().max(1)
    }
}

/// Value of element `idx` of an ordinary tensor, drawing from the chunk's stream.
#[inline]
fn draw(init: Init, idx: usize, scale: f32, rng: &mut Rng) -> f32 {
    match init {
        Init::NormGain => 0.5 + uniform01(rng),
        Init::ALog { heads } => {
            if idx < heads {
                0.5 * normal(rng)
            } else {
                0.0
            }
        }
        _ => scale * normal(rng),
    }
}

/// Standard deviation of the normal draws of an ordinary tensor.
fn std_of(s: &TensorSpec) -> f32 {
    match s.init {
        Init::Linear => 1.0 / (fan_in(s) as f32).sqrt(),
        Init::ResProj => 2.0 / (s.shape.last().copied().unwrap_or(1).max(1) as f32).sqrt(),
        Init::DtBias => 2.0,
        Init::RouterBias => 0.05,
        Init::Embedding => 1.0,
        Init::PosEmb => 0.02,
        _ => 1.0,
    }
}

/// Generates a unit's bytes: `(spec index, bytes)` pieces in file order.
pub fn generate(specs: &[TensorSpec], seed: u64, u: &Unit) -> Vec<(usize, Vec<u8>)> {
    match *u {
        Unit::Plain { spec, chunk } => {
            let s = &specs[spec];
            let start = chunk * CHUNK_ELEMS;
            let end = s.numel().min(start + CHUNK_ELEMS);
            let mut rng = Rng::from_parts(seed, &s.name, chunk as u64);
            let sd = std_of(s);
            let mut out = Vec::with_capacity((end - start) * s.dtype.size());
            match s.dtype {
                DType::BF16 => {
                    for idx in start..end {
                        let v = draw(s.init, idx, sd, &mut rng);
                        out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
                    }
                }
                DType::F32 => {
                    for idx in start..end {
                        out.extend_from_slice(&draw(s.init, idx, sd, &mut rng).to_le_bytes());
                    }
                }
                DType::U8 => {
                    for _ in start..end {
                        out.push(rng.next_u64() as u8);
                    }
                }
            }
            vec![(spec, out)]
        }
        Unit::Expert { packed, scale } => {
            let first = &specs[packed.or(scale).expect("an expert unit names a tensor")];
            let (base, rows, cols) = expert_geometry(first);
            let mut rng = Rng::from_parts(seed, &base, 0);
            let sd = 1.0 / (cols.max(1) as f32).sqrt();
            let mut p_out = Vec::with_capacity(rows * cols / 2);
            let mut s_out = Vec::with_capacity(rows * cols / mxfp4::GROUP);
            if cols > 0 && cols % mxfp4::GROUP == 0 {
                let block_rows = (EXPERT_BLOCK_ELEMS / cols).max(1);
                let mut w = vec![0f32; block_rows * cols];
                let mut r = 0;
                while r < rows {
                    let n = block_rows.min(rows - r);
                    let w = &mut w[..n * cols];
                    for x in w.iter_mut() {
                        *x = sd * normal(&mut rng);
                    }
                    let (p, s) = mxfp4::quantize(w, n, cols);
                    p_out.extend_from_slice(&p);
                    s_out.extend_from_slice(&s);
                    r += n;
                }
            }
            let mut v = Vec::new();
            if let Some(i) = packed {
                v.push((i, p_out));
            }
            if let Some(i) = scale {
                v.push((i, s_out));
            }
            v
        }
    }
}
