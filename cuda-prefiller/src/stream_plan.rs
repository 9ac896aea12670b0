//! The plan of the weight streamer (no GPU needed): where each byte of a layer's weights comes
//! from (shard, offset) and where it lands (device slot, offset); how big the slots are under a
//! VRAM budget; and the order of the transfer units.
//!
//! Two device slots per ring, used in turn, so that the next unit's copy overlaps the current
//! unit's compute:
//! - **whole layers** (the budget holds two of the largest layer): ring 0 alternates two slots
//!   each holding a whole layer (dense tensors, then its routed experts);
//! - **expert chunks** (it does not, the 32 GB card case): ring 0 alternates two slots of the
//!   largest layer's dense tensors, ring 1 two slots of `chunk` routed experts; a MoE layer's
//!   experts arrive in `ceil(experts / chunk)` units, each run over every token chunk of the
//!   prompt before the next arrives, so every weight still crosses PCIe once per prompt.
//!
//! Offsets inside a slot are 256-byte aligned per dense tensor; the routed experts use the
//! arena layout of [`ExpertLayout`] (the same bytes the CUDA backend's `load_experts` builds on the host).

use anyhow::{bail, ensure, Context, Result};
use k3_protocol::config::{FfnKind, LayerSpec, TextConfig};
use k3_protocol::tensors::{expert_tensor, DType};
use k3_protocol::Checkpoint;

use crate::expert_layout::ExpertLayout;
use crate::model::weights::layer_dense_tensors;

/// One contiguous piece of weight bytes to move: `len` bytes from the source's `(file, offset)`
/// (or host address) to byte `dst` of the destination slot.
#[derive(Debug, Clone)]
pub struct SlotCopy {
    /// For errors: the tensor name.
    pub name: String,
    /// Index of the source file (shard) or host region.
    pub src: usize,
    pub offset: u64,
    pub len: usize,
    pub dst: usize,
}

/// Alignment of every dense tensor inside a slot.
pub const SLOT_ALIGN: usize = 256;

fn align(x: usize) -> usize {
    x.div_ceil(SLOT_ALIGN) * SLOT_ALIGN
}

/// One dense tensor of a layer image: read `bytes` at `(shard, offset)`, land at `off`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotTensor {
    pub name: String,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Byte offset in the slot.
    pub off: usize,
    pub bytes: usize,
    pub shard: usize,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
}

/// One piece of a routed expert (`w1|w3|w2` × `weight_packed|weight_scale`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertPiece {
    pub name: String,
    pub shard: usize,
    pub offset: u64,
    pub bytes: usize,
    /// Byte offset within the expert's slot of `stride` bytes.
    pub off: usize,
}

/// Where one layer's weights come from and how they lie in a slot.
#[derive(Debug, Clone)]
pub struct LayerImage {
    pub layer: usize,
    pub tensors: Vec<SlotTensor>,
    /// End of the dense tensors in the slot (aligned): in whole-layer slots the experts start here.
    pub dense_bytes: usize,
    /// Per routed expert, its six pieces (empty for a dense-FFN layer).
    pub experts: Vec<[ExpertPiece; 6]>,
}

impl LayerImage {
    /// Dense bytes plus all routed experts.
    pub fn total_bytes(&self, stride: usize) -> usize {
        self.dense_bytes + self.experts.len() * stride
    }
    /// The largest dense tensor (for errors).
    fn largest(&self) -> Option<&SlotTensor> {
        self.tensors.iter().max_by_key(|t| t.bytes)
    }
}

/// One transfer into a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Layer `layer`'s dense tensors, and all its routed experts when `with_experts`.
    Dense { layer: usize, with_experts: bool },
    /// Routed experts `lo..hi` of layer `layer` (expert `lo` at the slot's start).
    Experts { layer: usize, lo: usize, hi: usize },
}

impl Unit {
    pub fn layer(&self) -> usize {
        match *self {
            Unit::Dense { layer, .. } | Unit::Experts { layer, .. } => layer,
        }
    }
    /// 0: the dense (or whole-layer) ring, 1: the expert ring.
    pub fn ring(&self) -> usize {
        match self {
            Unit::Dense { .. } => 0,
            Unit::Experts { .. } => 1,
        }
    }
}

/// The streamer's plan for one model under one budget.
#[derive(Debug, Clone)]
pub struct StreamPlan {
    pub layers: Vec<LayerImage>,
    /// Layout of one routed expert in a slot (`None`: no MoE layer).
    pub expert_layout: Option<ExpertLayout>,
    /// True: two whole-layer slots. False: two dense slots + two expert-chunk slots.
    pub whole_layers: bool,
    /// Bytes of each of the two ring-0 slots.
    pub dense_slot: usize,
    /// Bytes of each of the two ring-1 slots (0 with whole layers).
    pub expert_slot: usize,
    /// Routed experts per expert unit (all of a layer's with whole layers).
    pub chunk: usize,
    pub units: Vec<Unit>,
    /// Slot index (0/1) within its ring of every unit.
    pub slot: Vec<usize>,
    /// The unit that used the same slot before (the one whose compute must finish first).
    pub prev_in_slot: Vec<Option<usize>>,
}

fn gb(b: usize) -> String {
    if b >= 1_000_000_000 {
        format!("{:.3} GB", b as f64 / 1e9)
    } else {
        format!("{:.3} MB", b as f64 / 1e6)
    }
}
fn mb(b: usize) -> String {
    format!("{:.2} MB", b as f64 / 1e6)
}

impl StreamPlan {
    /// Plans the layers of `plan` from `ck` under `budget` bytes for the weight slots (`None`:
    /// two whole layers), with at most `max_chunk` routed experts per transfer unit when given
    /// (experts then stream in chunks even where whole layers would fit). Errors name the
    /// tensor whose bytes are wrong or the layer/tensor that does not fit.
    pub fn new(ck: &Checkpoint, cfg: &TextConfig, plan: &[LayerSpec], budget: Option<usize>, max_chunk: Option<usize>) -> Result<Self> {
        let mut layers = Vec::with_capacity(plan.len());
        let has_moe = plan.iter().any(|s| s.ffn == FfnKind::LatentMoe);
        let expert_layout = if has_moe { Some(ExpertLayout::new(cfg.moe_intermediate_size, cfg.routed_expert_hidden_size)?) } else { None };
        for &spec in plan {
            layers.push(Self::image(ck, cfg, spec, expert_layout.as_ref()).with_context(|| format!("weight streamer: layer {}", spec.index))?);
        }
        Self::with_images(layers, expert_layout, budget, max_chunk)
    }

    fn image(ck: &Checkpoint, cfg: &TextConfig, spec: LayerSpec, layout: Option<&ExpertLayout>) -> Result<LayerImage> {
        let mut tensors = Vec::new();
        let mut off = 0;
        for t in layer_dense_tensors(cfg, spec) {
            let e = ck.entry(&t.name).with_context(|| format!("tensor {} is not in the checkpoint", t.name))?;
            let esize = match e.dtype {
                DType::BF16 => 2,
                DType::F32 => 4,
                DType::U8 => bail!("tensor {} in {} is U8, expected BF16 or F32", t.name, ck.shard_name(e.shard)),
            };
            let numel: usize = e.shape.iter().product();
            let want = t.rows * t.cols;
            if t.prefix {
                ensure!(
                    e.shape.len() == 1 && numel >= want,
                    "tensor {} in {}: shape {:?} holds fewer than {want} entries",
                    t.name,
                    ck.shard_name(e.shard),
                    e.shape
                );
            } else {
                ensure!(numel == want, "tensor {} in {}: shape {:?} does not hold [{}, {}]", t.name, ck.shard_name(e.shard), e.shape, t.rows, t.cols);
            }
            let bytes = want * esize;
            ensure!(e.start + bytes <= e.end, "tensor {} in {}: {} bytes stored, {bytes} needed", t.name, ck.shard_name(e.shard), e.end - e.start);
            tensors.push(SlotTensor { name: t.name, dtype: e.dtype, rows: t.rows, cols: t.cols, off, bytes, shard: e.shard, offset: e.start as u64 });
            off = align(off + bytes);
        }
        let mut experts = Vec::new();
        if spec.ffn == FfnKind::LatentMoe {
            let lay = layout.context("a MoE layer without an expert layout")?;
            let (inter, lat) = (lay.inter, lay.latent);
            for ex in 0..cfg.experts_in_layer(spec.index) {
                let pieces = lay.parts().map(|(w, kind, poff, len)| -> Result<ExpertPiece> {
                    let name = expert_tensor(spec.index, ex, w, kind);
                    let e = ck.entry(&name).with_context(|| format!("tensor {name} is not in the checkpoint"))?;
                    let (rows, cols) = if w == "w2" { (lat, inter) } else { (inter, lat) };
                    let shape = if kind == "weight_packed" { [rows, cols / 2] } else { [rows, cols / 32] };
                    ensure!(e.dtype == DType::U8, "tensor {name} in {}: dtype {}, expected U8 (MXFP4)", ck.shard_name(e.shard), e.dtype.name());
                    ensure!(e.shape == shape, "tensor {name} in {}: shape {:?}, expected {shape:?}", ck.shard_name(e.shard), e.shape);
                    ensure!(e.end - e.start == len, "tensor {name} in {}: {} bytes, expected {len}", ck.shard_name(e.shard), e.end - e.start);
                    Ok(ExpertPiece { name, shard: e.shard, offset: e.start as u64, bytes: len, off: poff })
                });
                let [a, b, c, d, e, f] = pieces;
                experts.push([a?, b?, c?, d?, e?, f?]);
            }
        }
        Ok(LayerImage { layer: spec.index, tensors, dense_bytes: off, experts })
    }

    /// Sizes the slots and orders the units for already-described layers.
    pub fn with_images(layers: Vec<LayerImage>, expert_layout: Option<ExpertLayout>, budget: Option<usize>, max_chunk: Option<usize>) -> Result<Self> {
        ensure!(!layers.is_empty(), "weight streamer: the model has no layers");
        ensure!(max_chunk != Some(0), "weight streamer: --expert-chunk must be at least 1");
        let stride = expert_layout.map(|l| l.stride).unwrap_or(0);
        let biggest = layers.iter().max_by_key(|l| l.total_bytes(stride)).expect("non-empty");
        let whole_max = biggest.total_bytes(stride);
        let dense_layer = layers.iter().max_by_key(|l| l.dense_bytes).expect("non-empty");
        let dense_max = dense_layer.dense_bytes;
        let max_experts = layers.iter().map(|l| l.experts.len()).max().unwrap_or(0);
        // An explicit expert chunk (`--expert-chunk`) always sends the experts apart from the dense
        // tensors, also when it holds all of a layer's: a MoE layer's attention then starts once
        // its dense tensors are in, while its experts are still on the way.
        let whole = budget.is_none_or(|b| 2 * whole_max <= b) && (max_chunk.is_none() || max_experts == 0);
        let (dense_slot, expert_slot, chunk) = if whole {
            (whole_max, 0, max_experts)
        } else {
            let b = budget.unwrap_or(usize::MAX);
            let need = 2 * dense_max + 2 * stride;
            if max_experts == 0 || b < need {
                let big = dense_layer.largest().map(|t| format!("; its largest tensor {} is {}", t.name, mb(t.bytes))).unwrap_or_default();
                let expert = if max_experts > 0 {
                    let l = layers.iter().find(|l| !l.experts.is_empty()).expect("a MoE layer");
                    format!(
                        " plus two slots of one routed expert ({} each: layer {} expert 0, {} and its other 5 pieces)",
                        mb(stride),
                        l.layer,
                        l.experts[0][0].name
                    )
                } else {
                    String::new()
                };
                bail!(
                    "--vram-budget {} is too small for the weight streamer: it needs two slots of the largest layer's dense tensors \
                     (layer {}: {}{big}){expert}, at least {} in all (two whole layers: {})",
                    gb(b),
                    dense_layer.layer,
                    mb(dense_max),
                    gb(if max_experts > 0 { need } else { 2 * dense_max }),
                    gb(2 * whole_max)
                );
            }
            let chunk = ((b - 2 * dense_max) / (2 * stride)).min(max_experts).min(max_chunk.unwrap_or(usize::MAX));
            (dense_max, chunk * stride, chunk)
        };
        let mut p = StreamPlan {
            layers,
            expert_layout,
            whole_layers: whole,
            dense_slot,
            expert_slot,
            chunk,
            units: Vec::new(),
            slot: Vec::new(),
            prev_in_slot: Vec::new(),
        };
        p.order_units(1);
        Ok(p)
    }

    /// The same plan for a pass whose latent-MoE layers take their routed experts in `passes`
    /// windows (the executor's expert windows of the memory plan): with experts in chunks,
    /// each layer's expert units come `passes` times in a row (the weight bytes of a window are
    /// the layer's experts again); with whole layers the experts stay in the layer's slot and
    /// nothing changes.
    pub fn with_expert_passes(&self, passes: usize) -> StreamPlan {
        let mut p = self.clone();
        p.order_units(passes.max(1));
        p
    }

    /// The units in transfer order (each layer's expert chunks `passes` times) and their slots.
    fn order_units(&mut self, passes: usize) {
        let (whole, chunk) = (self.whole_layers, self.chunk);
        let mut units = Vec::new();
        for l in &self.layers {
            if whole || l.experts.is_empty() {
                units.push(Unit::Dense { layer: l.layer, with_experts: !l.experts.is_empty() });
                continue;
            }
            units.push(Unit::Dense { layer: l.layer, with_experts: false });
            for _ in 0..passes {
                let mut lo = 0;
                while lo < l.experts.len() {
                    let hi = (lo + chunk).min(l.experts.len());
                    units.push(Unit::Experts { layer: l.layer, lo, hi });
                    lo = hi;
                }
            }
        }
        let mut slot = Vec::with_capacity(units.len());
        let mut prev_in_slot = Vec::with_capacity(units.len());
        let mut last: [[Option<usize>; 2]; 2] = [[None; 2]; 2];
        let mut count = [0usize; 2];
        for (i, u) in units.iter().enumerate() {
            let r = u.ring();
            let s = count[r] % 2;
            count[r] += 1;
            slot.push(s);
            prev_in_slot.push(last[r][s]);
            last[r][s] = Some(i);
        }
        (self.units, self.slot, self.prev_in_slot) = (units, slot, prev_in_slot);
    }

    /// Device bytes of all four (or two) slots.
    /// Bytes one prompt moves (every unit once).
    pub fn prompt_bytes(&self) -> usize {
        (0..self.units.len()).map(|u| self.unit_bytes(u)).sum()
    }

    pub fn slot_bytes(&self) -> usize {
        2 * self.dense_slot + 2 * self.expert_slot
    }

    /// Index of layer `l`'s image.
    pub fn image_of(&self, l: usize) -> Result<&LayerImage> {
        self.layers.iter().find(|i| i.layer == l).with_context(|| format!("weight streamer: no plan for layer {l}"))
    }

    /// Bytes that unit `u` moves.
    pub fn unit_bytes(&self, u: usize) -> usize {
        self.copies(u).map(|p| p.iter().map(|x| x.len).sum()).unwrap_or(0)
    }

    /// The copies of unit `u`, with destinations relative to its slot.
    pub fn copies(&self, u: usize) -> Result<Vec<SlotCopy>> {
        let unit = *self.units.get(u).with_context(|| format!("weight streamer: no unit {u}"))?;
        let img = self.image_of(unit.layer())?;
        let stride = self.expert_layout.map(|l| l.stride).unwrap_or(0);
        let mut parts = Vec::new();
        let experts = |lo: usize, hi: usize, base: usize, parts: &mut Vec<SlotCopy>| {
            for (k, e) in img.experts[lo..hi].iter().enumerate() {
                for p in e {
                    parts.push(SlotCopy { name: p.name.clone(), src: p.shard, offset: p.offset, len: p.bytes, dst: base + k * stride + p.off });
                }
            }
        };
        match unit {
            Unit::Dense { with_experts, .. } => {
                for t in &img.tensors {
                    parts.push(SlotCopy { name: t.name.clone(), src: t.shard, offset: t.offset, len: t.bytes, dst: t.off });
                }
                if with_experts {
                    experts(0, img.experts.len(), img.dense_bytes, &mut parts);
                }
            }
            Unit::Experts { lo, hi, .. } => experts(lo, hi, 0, &mut parts),
        }
        Ok(coalesce(parts))
    }

    /// One line for logs.
    pub fn describe(&self) -> String {
        let bytes: usize = self.layers.iter().map(|l| l.total_bytes(self.expert_layout.map(|x| x.stride).unwrap_or(0))).sum();
        if self.whole_layers {
            format!("{} layers ({}), two whole-layer slots of {}", self.layers.len(), gb(bytes), gb(self.dense_slot))
        } else {
            format!(
                "{} layers ({}), two dense slots of {} + two expert slots of {} experts ({}); {} transfer units",
                self.layers.len(),
                gb(bytes),
                gb(self.dense_slot),
                self.chunk,
                gb(self.expert_slot),
                self.units.len()
            )
        }
    }
}

/// Merges consecutive parts that are contiguous both in the source and in the slot (a run of
/// experts laid out in checkpoint order is then one copy, not six per expert); the merged part is
/// named by its first and last tensor.
pub fn coalesce(parts: Vec<SlotCopy>) -> Vec<SlotCopy> {
    let mut out: Vec<SlotCopy> = Vec::with_capacity(parts.len());
    let mut last_name = String::new();
    let mut merged = 0usize;
    for p in parts {
        if let Some(q) = out.last_mut() {
            if q.src == p.src && q.offset + q.len as u64 == p.offset && q.dst + q.len == p.dst {
                q.len += p.len;
                last_name = p.name;
                merged += 1;
                continue;
            }
            if merged > 0 {
                q.name = format!("{} … {last_name} ({} tensors)", q.name, merged + 1);
            }
        }
        merged = 0;
        out.push(p);
    }
    if let (Some(q), true) = (out.last_mut(), merged > 0) {
        q.name = format!("{} … {last_name} ({} tensors)", q.name, merged + 1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(name: &str, src: usize, offset: u64, len: usize, dst: usize) -> SlotCopy {
        SlotCopy { name: name.into(), src, offset, len, dst }
    }

    #[test]
    fn coalesce_merges_only_runs_contiguous_in_source_and_slot() {
        let parts = vec![
            part("a", 0, 100, 10, 0),
            part("b", 0, 110, 5, 10), // contiguous with a in both
            part("c", 0, 115, 5, 16), // source contiguous, slot gap
            part("d", 1, 120, 5, 21), // another shard
            part("e", 1, 125, 3, 26), // contiguous with d
        ];
        let got = coalesce(parts);
        let spans: Vec<(usize, u64, usize, usize)> = got.iter().map(|p| (p.src, p.offset, p.len, p.dst)).collect();
        assert_eq!(spans, vec![(0, 100, 15, 0), (0, 115, 5, 16), (1, 120, 8, 21)]);
        assert_eq!(got[0].name, "a … b (2 tensors)");
        assert_eq!(got[1].name, "c");
        assert_eq!(got[2].name, "d … e (2 tensors)");
    }
}
