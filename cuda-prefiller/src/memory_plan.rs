//! One device-memory plan per prefill pass (no GPU): from the config, the prompt lengths, the
//! device budget (`--vram-budget`, default the device's free memory less [`DEFAULT_MARGIN`]) and
//! the host memory (`--host-memory`), it sizes every allocation of the pass the executor and the
//! weight streamer make, and chooses
//!
//! - the token chunk `C` (tokens per chunk within a layer: the transient activations),
//! - the routed-expert window `W` (routed rows — tokens × top-k — that go through the experts
//!   together; with experts streamed in chunks each window streams the layer's experts again),
//! - where the AttnRes bank and running sum live between layers (device, or host memory with one
//!   chunk at a time on the device),
//! - whether the BF16 embedding table sits on the device (rows gathered there) or the host,
//! - the weight slots of the streamer (two whole layers, or two dense slots + two expert slots).
//!
//! Every figure is a byte count of the allocations the code makes (see the `item` names), so the
//! plan's peak bounds the pass's device memory; a prompt that fits no choice is refused before any
//! weight is read, naming the budget, the host memory and the longest prompt that fits
//! ([`NoFit`], [`longest_prompt`]). The CPU backend plans the same allocations (its buffers are
//! the "device"), so the planned path runs in CI.

use k3_protocol::config::{AttnKind, FfnKind, LayerSpec, TextConfig};
use k3_protocol::tensors::{global_text_tensors, layer_dense_tensors, DType};

use crate::expert_layout::ExpertLayout;

/// Keys per block of the BF16 MLA attention's K/V expansion on CUDA: 8,192 keys of K3's 64
/// heads are 0.5 GB of f32 (expanded for the whole context it was 64 KB per key: 8.6 GB at 128k
/// tokens, which bounded the prompts of a 24 GB card).
pub const MLA_KEY_BLOCK: usize = 8192;

/// Residual tensors on their way to the host at once when the bank is parked there (the
/// executor waits for a parking's copy only this many parkings later, so the compute stream
/// never drains for one); each is one chunk's running sum or bank entry on the device.
pub const PARKED_IN_FLIGHT: usize = 4;

/// Taken from the device's free memory when no `--vram-budget` is given (cuBLAS and NVRTC
/// allocations beside the planned ones, allocator granularity), bytes.
pub const DEFAULT_MARGIN: u64 = 750_000_000;
/// Kept free of host memory when no `--host-memory` is given (the OS, the page cache's floor).
pub const HOST_MARGIN: u64 = 2_000_000_000;
/// The process itself on the host (binary, mapped index, thread stacks, allocator), bytes.
const HOST_PROCESS: u64 = 400_000_000;
/// CUDA: cuBLAS handles' workspaces (the compute stream's and the dense expert path's worker
/// streams), loaded kernel modules, small per-op buffers.
const CUDA_RUNTIME: u64 = 300_000_000;
/// KDA's chunk: the planned token chunks are multiples of it (so the recurrence is cut at the
/// same positions whatever the chunk, and the results do not depend on the plan).
pub const CHUNK_ALIGN: usize = k3_protocol::config::spec::KDA_CHUNK;

/// CUDA: the smallest planned chunk (shorter ones leave the GPU idle between launches).
pub const MIN_CHUNK_CUDA: usize = 512;
/// CUDA: the smallest expert window, tokens (the dense expert path needs about 128 routed
/// rows per expert to stay fast: 8,192 tokens × top-16 over 896 experts is 146).
pub const MIN_WINDOW_CUDA: usize = 8192;

/// Where a per-token tensor lives between layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Placement {
    Device,
    /// Page-locked host memory; the chunk being computed is brought to the device.
    Host,
}

impl Placement {
    pub fn name(self) -> &'static str {
        match self {
            Placement::Device => "device",
            Placement::Host => "host",
        }
    }
}

/// What the backend holds and how (the element sizes of its buffers).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BackendShape {
    /// The CUDA backend (its runtime reserve, the dense expert path's scratch, BF16 packing of
    /// the attention operands); false: the CPU reference.
    pub cuda: bool,
    /// Bytes of a GEMM operand element (2: BF16 serving, 4: f32).
    pub operand_bytes: usize,
    /// Weights stream through device slots (CUDA), else each layer is loaded whole in turn.
    pub streams_weights: bool,
    /// The backend's preferred chunk when memory allows.
    pub default_chunk: usize,
    /// Routed rows per expert (mean) from which the experts run on the dense path, which keeps
    /// the SiTU rows per worker slice instead of for every routed row (CUDA BF16; None: never).
    pub dense_experts_from: Option<usize>,
}

impl BackendShape {
    pub fn cpu() -> Self {
        BackendShape { cuda: false, operand_bytes: 4, streams_weights: false, default_chunk: 512, dense_experts_from: None }
    }
    /// `dense_from`: the backend's dense-path threshold (rows per expert), used in BF16 only.
    pub fn cuda(bf16: bool, total_device: u64, dense_from: usize) -> Self {
        BackendShape {
            cuda: true,
            operand_bytes: if bf16 { 2 } else { 4 },
            streams_weights: true,
            default_chunk: if total_device >= 64 << 30 { 16384 } else { 4096 },
            dense_experts_from: bf16.then_some(dense_from),
        }
    }
}

/// The model's sizes the plan needs, from the config alone (no checkpoint: `inspect --config`).
#[derive(Debug, Clone, PartialEq)]
pub struct Geometry {
    pub layers: usize,
    pub hidden: usize,
    pub vocab: usize,
    /// Bank entries a token holds after the last layer (one per AttnRes block started).
    pub bank_entries: usize,
    pub mla_layers: usize,
    pub moe_layers: usize,
    pub kda_layers: usize,
    /// Latent row width of MLA (`kv_lora_rank + qk_rope_head_dim`).
    pub mla_latent: usize,
    pub mla_heads: usize,
    pub mla_nope: usize,
    pub mla_rope: usize,
    pub mla_v: usize,
    pub q_lora: usize,
    pub kda_heads: usize,
    pub kda_head_dim: usize,
    pub conv_kernel: usize,
    pub experts: usize,
    pub top_k: usize,
    pub latent: usize,
    pub moe_inter: usize,
    pub shared_width: usize,
    pub dense_inter: usize,
    /// Bytes of one routed expert in a slot (MXFP4, [`ExpertLayout`]).
    pub expert_stride: usize,
    /// Largest layer's dense tensors (all but the routed experts), as stored (BF16/F32).
    pub dense_layer_max: usize,
    /// Largest whole layer (dense + routed experts).
    pub whole_layer_max: usize,
    /// Σ over layers of dense bytes / routed-expert bytes (one prompt's weight traffic).
    pub dense_total: usize,
    pub experts_total: usize,
    /// The output head (lm_head, final norms) and the embedding table, as stored.
    pub head_bytes: usize,
    pub embed_bytes: usize,
    pub embed_bf16: bool,
    /// Σ of the F32/BF16 dense bytes as f32 (the CPU reference converts on load).
    pub dense_layer_max_f32: usize,
}

impl Geometry {
    pub fn of(c: &TextConfig, plan: &[LayerSpec]) -> anyhow::Result<Geometry> {
        anyhow::ensure!(!plan.is_empty(), "memory plan: the model has no layers");
        let has_moe = plan.iter().any(|s| s.ffn == FfnKind::LatentMoe);
        let stride = if has_moe { ExpertLayout::new(c.moe_intermediate_size, c.routed_expert_hidden_size)?.stride } else { 0 };
        let (mut dense_max, mut whole_max, mut dense_total, mut experts_total, mut f32_max) = (0, 0, 0, 0, 0);
        for &s in plan {
            let ts = layer_dense_tensors(c, s);
            let dense: usize = ts.iter().map(|t| t.nbytes()).sum();
            let as_f32: usize = ts.iter().map(|t| t.numel() * 4).sum();
            let ex = if s.ffn == FfnKind::LatentMoe { c.experts_in_layer(s.index) * stride } else { 0 };
            dense_max = dense_max.max(dense);
            f32_max = f32_max.max(as_f32);
            whole_max = whole_max.max(dense + ex);
            dense_total += dense;
            experts_total += ex;
        }
        let g = global_text_tensors(c);
        let embed = g.iter().find(|t| t.name.ends_with("embed_tokens.weight")).expect("the embedding is a global tensor");
        let head_bytes = g.iter().filter(|t| !t.name.ends_with("embed_tokens.weight")).map(|t| t.nbytes()).sum();
        let la = &c.linear_attn_config;
        Ok(Geometry {
            layers: plan.len(),
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            bank_entries: plan.iter().filter(|s| s.bank_boundary).count(),
            mla_layers: plan.iter().filter(|s| s.attn == AttnKind::Mla).count(),
            moe_layers: plan.iter().filter(|s| s.ffn == FfnKind::LatentMoe).count(),
            kda_layers: plan.iter().filter(|s| s.attn == AttnKind::Kda).count(),
            mla_latent: c.kv_lora_rank + c.qk_rope_head_dim,
            mla_heads: c.num_attention_heads,
            mla_nope: c.qk_nope_head_dim,
            mla_rope: c.qk_rope_head_dim,
            mla_v: c.v_head_dim,
            q_lora: c.q_lora_rank,
            kda_heads: la.num_heads,
            kda_head_dim: la.head_dim,
            conv_kernel: la.short_conv_kernel_size,
            experts: plan.iter().filter(|s| s.ffn == FfnKind::LatentMoe).map(|s| c.experts_in_layer(s.index)).max().unwrap_or(0),
            top_k: c.num_experts_per_token,
            latent: c.routed_expert_hidden_size,
            moe_inter: c.moe_intermediate_size,
            shared_width: c.shared_expert_width(),
            dense_inter: c.intermediate_size,
            expert_stride: stride,
            dense_layer_max: dense_max,
            whole_layer_max: whole_max,
            dense_total,
            experts_total,
            head_bytes,
            embed_bytes: embed.nbytes(),
            embed_bf16: embed.dtype == DType::BF16,
            dense_layer_max_f32: f32_max,
        })
    }

    /// f32 values alive per token of a chunk at the widest point of a layer (the AttnRes mixes
    /// and norms, the attention projections and their short convolutions, the FFN's
    /// intermediates), an upper bound over the layer kinds of the model.
    fn chunk_values_per_token(&self) -> usize {
        let h = self.hidden;
        let common = 6 * h;
        let kc = self.kda_heads * self.kda_head_dim;
        let kda = if self.kda_layers > 0 { 10 * kc + 2 * self.kda_heads + self.kda_head_dim + 2 * h } else { 0 };
        let mla = if self.mla_layers > 0 {
            let hq = self.mla_heads * (self.mla_nope + self.mla_rope);
            self.q_lora * 2 + 2 * hq + 2 * self.mla_latent + 3 * self.mla_heads * self.mla_v + 2 * h
        } else {
            0
        };
        let dense = if self.moe_layers < self.layers { 3 * self.dense_inter + h } else { 0 };
        let moe = if self.moe_layers > 0 { self.experts + 3 * self.latent + 3 * self.shared_width + 2 * h } else { 0 };
        common + kda.max(mla) + dense.max(moe)
    }

    /// Per token of an expert window, held from the FFN's input until the window's backs run:
    /// the chunk's middle (running sum, new bank entry, normed FFN input) and the latent input
    /// and output of the experts.
    fn window_values_per_token(&self) -> usize {
        3 * self.hidden + 2 * self.latent
    }

    /// Bytes per routed row inside the experts: the grouped input (operand size), the f32
    /// grouped output, ids/weights/positions, and the SiTU rows (operand size) unless the
    /// dense path keeps them per worker slice.
    fn expert_row_bytes(&self, operand: usize, situ_rows: bool) -> usize {
        self.latent * (operand + 4) + if situ_rows { self.moe_inter * operand } else { 0 } + 16
    }

    /// MLA attention over `tk` context positions, per key whose operands exist at once: the
    /// expanded K/V (f32) and, on CUDA, the packed operands (operand size: K of q/k width, V or
    /// Vᵀ of v width). CUDA in BF16 takes the keys a block at a time ([`Self::attn_bytes`]).
    fn attn_bytes_per_key(&self, be: &BackendShape) -> usize {
        let h = self.mla_heads;
        let f32_kv = h * (self.mla_nope + self.mla_v) * 4;
        if be.cuda && be.operand_bytes == 2 {
            h * (self.mla_nope + self.mla_rope + self.mla_v) * 2
        } else if be.cuda {
            f32_kv + h * (self.mla_nope + self.mla_rope + self.mla_v) * be.operand_bytes
        } else {
            f32_kv
        }
    }

    /// MLA attention's key-side workspace over `tk` context positions for `tq` queries: per key
    /// ([`Self::attn_bytes_per_key`]) for the whole context, or, on CUDA in BF16, for one block
    /// of keys ([`MLA_KEY_BLOCK`]: expanded to f32 from its BF16 latent input, packed, and
    /// attended before the next, with the query rows' running sums carried between blocks).
    fn attn_bytes(&self, be: &BackendShape, tq: usize, tk: usize) -> usize {
        if be.cuda && be.operand_bytes == 2 {
            let rows = tk.min(MLA_KEY_BLOCK);
            let expand = rows * (self.mla_heads * (self.mla_nope + self.mla_v) * 4 + self.mla_latent * 2);
            let carry = if tk > MLA_KEY_BLOCK { tq * self.mla_heads * 8 * 4 } else { 0 };
            rows * self.attn_bytes_per_key(be) + expand + carry
        } else {
            tk * self.attn_bytes_per_key(be)
        }
    }
}

/// One request of the pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanRequest {
    /// Tokens already in the session (its MLA rows are part of the context).
    pub base: usize,
    pub new: usize,
}

/// Which logits the pass keeps on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsKept {
    All,
    Last,
    None,
}

/// Fixed choices of the command (flags) the plan works within.
#[derive(Debug, Clone, PartialEq)]
pub struct Knobs {
    /// `--chunk-tokens`: the chunk, not chosen.
    pub chunk_tokens: Option<usize>,
    /// `--expert-chunk`: at most this many experts per streamed unit.
    pub expert_chunk: Option<usize>,
    pub logits: LogitsKept,
    /// `--pin-host`: the whole checkpoint in page-locked host memory.
    pub pin_host_bytes: Option<u64>,
    /// Pinned staging buffers of the streamer (two of them).
    pub stage_bytes: usize,
    /// Weights resident on the device (`bench --resident`).
    pub resident: bool,
    /// The streamer's slots as allocated (a node plans them once, for its longest prompt; each
    /// pass then plans within them).
    pub slots: Option<Slots>,
    /// Where the embedding table was put (decided with the slots).
    pub embed_on_device: Option<bool>,
}

/// Weight slots already allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slots {
    pub whole_layers: bool,
    pub expert_chunk: usize,
    pub bytes: u64,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            chunk_tokens: None,
            expert_chunk: None,
            logits: LogitsKept::Last,
            pin_host_bytes: None,
            stage_bytes: 256 << 20,
            resident: false,
            slots: None,
            embed_on_device: None,
        }
    }
}

/// The limits a pass must fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Device bytes (`--vram-budget`, or free memory less the margin).
    pub device: u64,
    /// Host bytes (`--host-memory`, or available memory less the margin).
    pub host: u64,
}

/// The plan of one pass.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemoryPlan {
    pub budget: u64,
    pub host_limit: u64,
    pub chunk_tokens: usize,
    /// Routed rows per expert window (tokens × top-k; 0 without MoE layers).
    pub expert_window_rows: usize,
    /// Tokens per expert window (a multiple of the chunk, or the whole pass).
    pub window_tokens: usize,
    /// Windows per MoE layer (each streams the experts again when they come in chunks).
    pub windows: usize,
    pub bank: Placement,
    pub embed_on_device: bool,
    /// Two whole-layer slots (the experts resident for the layer); else two dense slots and two
    /// expert slots of `expert_chunk` experts.
    pub whole_layers: bool,
    pub expert_chunk: usize,
    /// Bytes for the streamer's weight slots (its `StreamOptions::vram_budget`); 0 without streaming.
    pub slot_bytes: u64,
    /// Weight bytes that cross to the device per pass (experts once per window when chunked).
    pub weight_traffic: u64,
    /// Device and host allocations, by item, bytes; the peaks are their sums.
    pub device: Vec<(&'static str, u64)>,
    pub host: Vec<(&'static str, u64)>,
    pub peak_device: u64,
    pub peak_host: u64,
}

impl MemoryPlan {
    /// `memory plan: budget B GB, chunk C tokens, expert window W rows, bank device|host, peak P GB`.
    pub fn line(&self) -> String {
        format!(
            "memory plan: budget {:.3} GB, chunk {} tokens, expert window {} rows, bank {}, peak {:.3} GB (host {:.3} of {:.3} GB; {} window{} per MoE layer, {}, embedding table on the {})",
            self.budget as f64 / 1e9,
            self.chunk_tokens,
            self.expert_window_rows,
            self.bank.name(),
            self.peak_device as f64 / 1e9,
            self.peak_host as f64 / 1e9,
            self.host_limit as f64 / 1e9,
            self.windows,
            if self.windows == 1 { "" } else { "s" },
            if self.slot_bytes == 0 {
                "weights per layer".to_string()
            } else if self.whole_layers {
                format!("two whole-layer slots of {:.3} GB", self.slot_bytes as f64 / 2e9)
            } else {
                format!("expert slots of {} experts", self.expert_chunk)
            },
            if self.embed_on_device { "device" } else { "host" },
        )
    }

    /// The items, one per line (logs, `inspect`).
    pub fn items(&self) -> String {
        let mut s = String::new();
        for (what, list) in [("device", &self.device), ("host", &self.host)] {
            for (n, b) in list.iter() {
                s.push_str(&format!("  {what:>6} {n:<44} {:>10.3} GB\n", *b as f64 / 1e9));
            }
        }
        s
    }
}

/// A pass that fits no plan: names the limits and the longest prompt that fits them.
#[derive(Debug, Clone, PartialEq)]
pub struct NoFit {
    pub tokens: usize,
    pub budget: u64,
    pub host: u64,
    /// The longest single prompt (no session base) that fits the same limits.
    pub longest: usize,
    /// The smallest plan tried for this pass: its largest items.
    pub why: String,
}

impl std::fmt::Display for NoFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a prompt of {} tokens does not fit a device budget of {:.3} GB (--vram-budget) with {:.3} GB of host memory (--host-memory): \
             the longest prompt that fits is {} tokens ({})",
            self.tokens,
            self.budget as f64 / 1e9,
            self.host as f64 / 1e9,
            self.longest,
            self.why
        )
    }
}

impl std::error::Error for NoFit {}

/// One candidate's choices.
#[derive(Debug, Clone, Copy)]
struct Choice {
    chunk: usize,
    window_tokens: usize,
    bank: Placement,
    embed_on_device: bool,
    whole_layers: bool,
}

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Plans a pass of `reqs` within `lim`: the cheapest choice (weight traffic, then host traffic
/// of the bank, then larger chunks) whose device and host peaks fit, or [`NoFit`].
pub fn plan(g: &Geometry, be: &BackendShape, reqs: &[PlanRequest], lim: Limits, k: &Knobs) -> Result<MemoryPlan, NoFit> {
    match plan_inner(g, be, reqs, lim, k) {
        Ok(p) => Ok(p),
        Err(why) => {
            let tokens = reqs.iter().map(|r| r.new).sum();
            Err(NoFit { tokens, budget: lim.device, host: lim.host, longest: longest_prompt(g, be, lim, k), why })
        }
    }
}

/// The longest single prompt (no session base) any plan fits within `lim`; 0 when none does.
pub fn longest_prompt(g: &Geometry, be: &BackendShape, lim: Limits, k: &Knobs) -> usize {
    let fits = |n: usize| plan_inner(g, be, &[PlanRequest { base: 0, new: n }], lim, k).is_ok();
    if !fits(1) {
        return 0;
    }
    let (mut lo, mut hi) = (1usize, 2usize);
    while hi <= 1 << 26 && fits(hi) {
        lo = hi;
        hi *= 2;
    }
    if hi > 1 << 26 {
        return lo;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

fn plan_inner(g: &Geometry, be: &BackendShape, reqs: &[PlanRequest], lim: Limits, k: &Knobs) -> Result<MemoryPlan, String> {
    if reqs.is_empty() || reqs.iter().any(|r| r.new == 0) {
        return Err("no new tokens".into());
    }
    let total: usize = reqs.iter().map(|r| r.new).sum();
    let longest = reqs.iter().map(|r| r.new).max().unwrap_or(1);
    // chunk candidates: the given one, else the backend's default (at most the longest prompt)
    // halved down to KDA's chunk
    let chunks: Vec<usize> = match k.chunk_tokens {
        Some(c) => vec![c.max(1)],
        None => {
            let mut v = Vec::new();
            let floor = if be.cuda { MIN_CHUNK_CUDA } else { CHUNK_ALIGN };
            let mut c = be.default_chunk.min(align_up(longest, CHUNK_ALIGN)).max(CHUNK_ALIGN);
            c = c / CHUNK_ALIGN * CHUNK_ALIGN;
            loop {
                v.push(c);
                if c <= floor {
                    break;
                }
                c = (c / 2 / CHUNK_ALIGN).max(1) * CHUNK_ALIGN;
            }
            v
        }
    };
    let banks = [Placement::Device, Placement::Host];
    let embeds: &[bool] = match k.embed_on_device {
        Some(true) => &[true],
        Some(false) => &[false],
        None if be.cuda && g.embed_bf16 && !k.resident && be.streams_weights => &[true, false],
        None => &[false],
    };
    let slot_modes: &[bool] = match k.slots {
        Some(s) if s.whole_layers => &[true],
        Some(_) => &[false],
        None if be.streams_weights && !k.resident && g.experts > 0 => &[true, false],
        None => &[true],
    };
    let mut best: Option<(f64, MemoryPlan)> = None;
    let mut smallest: Option<(u64, String)> = None;
    for &chunk in &chunks {
        // windows: the whole pass, then fewer chunks per window down to one chunk
        let mut windows = vec![align_up(total, chunk)];
        let mut w = align_up(total, chunk) / 2 / chunk * chunk;
        let floor = if be.cuda { MIN_WINDOW_CUDA.max(chunk) } else { chunk };
        while w >= floor && g.moe_layers > 0 {
            windows.push(w);
            w = w / 2 / chunk * chunk;
        }
        let last = align_up(floor, chunk);
        if g.moe_layers > 0 && *windows.last().expect("one") > last {
            windows.push(last);
        }
        for &window_tokens in &windows {
            for &bank in &banks {
                for &embed_on_device in embeds {
                    for &whole_layers in slot_modes {
                        let c = Choice { chunk, window_tokens, bank, embed_on_device, whole_layers };
                        let p = size(g, be, reqs, lim, k, c);
                        let over = p.peak_device.saturating_sub(lim.device) + p.peak_host.saturating_sub(lim.host);
                        if over > 0 {
                            let worst = |l: &[(&'static str, u64)]| {
                                l.iter().max_by_key(|x| x.1).map(|x| format!("{} {:.3} GB", x.0, x.1 as f64 / 1e9)).unwrap_or_default()
                            };
                            let why = format!(
                                "smallest plan: device peak {:.3} GB (largest: {}), host {:.3} GB (largest: {})",
                                p.peak_device as f64 / 1e9,
                                worst(&p.device),
                                p.peak_host as f64 / 1e9,
                                worst(&p.host)
                            );
                            if smallest.as_ref().is_none_or(|(o, _)| over < *o) {
                                smallest = Some((over, why));
                            }
                            continue;
                        }
                        let cost = cost(g, reqs, &p);
                        if best.as_ref().is_none_or(|(b, _)| cost < *b) {
                            best = Some((cost, p));
                        }
                    }
                }
            }
        }
    }
    match best {
        Some((_, mut p)) => {
            grow_slots(g, be, k, &mut p, lim);
            Ok(p)
        }
        None => Err(smallest.map(|s| s.1).unwrap_or_else(|| "no plan".into())),
    }
}

/// Seconds the choice adds (a coarse model to rank the choices that fit): weight and bank
/// traffic over PCIe (~25 GB/s), the host-side embedding upload, and the per-chunk overheads
/// of small chunks and windows.
fn cost(g: &Geometry, reqs: &[PlanRequest], p: &MemoryPlan) -> f64 {
    let pcie = 25e9;
    let total: usize = reqs.iter().map(|r| r.new).sum();
    let mut s = p.weight_traffic as f64 / pcie;
    if p.bank == Placement::Host {
        // each layer reads and writes every token's residual (the bank grows to `bank_entries`)
        s += g.layers as f64 * 2.0 * (g.bank_entries as f64 / 2.0 + 1.0) * (total * g.hidden * 4) as f64 / pcie;
    }
    if !p.embed_on_device {
        s += (total * g.hidden * 4) as f64 / pcie + 0.01;
    }
    let chunks = total.div_ceil(p.chunk_tokens) as f64;
    s += chunks * g.layers as f64 * 2e-3;
    s += (p.windows * g.moe_layers) as f64 * 2e-3;
    s
}

/// Sizes every allocation of choice `c`.
fn size(g: &Geometry, be: &BackendShape, reqs: &[PlanRequest], lim: Limits, k: &Knobs, c: Choice) -> MemoryPlan {
    let h = g.hidden;
    let total: usize = reqs.iter().map(|r| r.new).sum();
    let ctx_max = reqs.iter().map(|r| r.base + r.new).max().unwrap_or(0);
    let chunk = c.chunk;
    let win = c.window_tokens.min(align_up(total, chunk)).max(chunk.min(total));
    let windows = if g.moe_layers > 0 { total_windows(reqs, chunk, win) } else { 1 };
    let mut dev: Vec<(&'static str, u64)> = Vec::new();
    let mut host: Vec<(&'static str, u64)> = Vec::new();
    let u = |x: usize| x as u64;

    // weights
    let (mut slot_bytes, mut expert_chunk, mut traffic) = (0u64, g.experts, u(g.dense_total + g.experts_total));
    if be.cuda {
        dev.push(("CUDA runtime (cuBLAS workspaces, kernel modules)", CUDA_RUNTIME));
    }
    if be.streams_weights && !k.resident {
        if let Some(sl) = k.slots {
            slot_bytes = sl.bytes;
            expert_chunk = sl.expert_chunk;
            if !sl.whole_layers {
                traffic = u(g.dense_total + windows * g.experts_total);
            }
        } else if c.whole_layers {
            slot_bytes = u(2 * g.whole_layer_max);
        } else {
            let min_chunk = k.expert_chunk.unwrap_or(usize::MAX).min(g.experts).clamp(1, 8);
            expert_chunk = min_chunk;
            slot_bytes = u(2 * g.dense_layer_max + 2 * min_chunk * g.expert_stride);
            traffic = u(g.dense_total + windows * g.experts_total);
        }
        dev.push(("weight slots", slot_bytes));
        dev.push(("output head (lm_head, final norms)", u(g.head_bytes)));
        if c.embed_on_device {
            dev.push(("embedding table (BF16, rows gathered on the device)", u(g.embed_bytes)));
        }
        host.push(("pinned staging (two buffers)", u(2 * k.stage_bytes.min(g.whole_layer_max.max(1 << 20)))));
        if let Some(b) = k.pin_host_bytes {
            host.push(("checkpoint in page-locked memory (--pin-host)", b));
        }
    } else if k.resident || !be.streams_weights && be.cuda {
        dev.push(("resident weights", u(g.dense_total + g.experts_total + g.head_bytes + g.embed_bytes)));
    } else {
        // the CPU reference: one layer at a time, converted to f32 (experts decoded per expert), and the head
        let dense_f32 = g.dense_layer_max_f32;
        let experts_f32 = g.experts * 3 * g.moe_inter * g.latent * 4;
        dev.push(("one layer's weights (f32)", u(dense_f32 + experts_f32)));
        dev.push(("output head and embedding (f32)", u((g.head_bytes + g.embed_bytes) * 2)));
    }
    // residual between layers
    let resid_per_token = (g.bank_entries + 1) * h * 4;
    match c.bank {
        Placement::Device => dev.push(("AttnRes bank and running sum, every token", u(total * resid_per_token))),
        Placement::Host => {
            dev.push(("AttnRes bank and running sum, one chunk", u(chunk.min(total) * resid_per_token)));
            dev.push(("AttnRes residuals on their way to the host", u(PARKED_IN_FLIGHT * chunk.min(total) * h * 4)));
            host.push(("AttnRes bank and running sum (parked)", u(total * resid_per_token)));
        }
    }
    // the layer's attention caches: MLA latent rows of every request's context (one layer at a
    // time), KDA states
    let latent_rows: usize = reqs.iter().map(|r| r.base + r.new).sum();
    if g.mla_layers > 0 {
        dev.push(("MLA latent rows of one layer (whole context)", u(latent_rows * g.mla_latent * 4)));
    }
    if g.kda_layers > 0 {
        let st = g.kda_heads * g.kda_head_dim * g.kda_head_dim * 4 + 3 * (g.conv_kernel.saturating_sub(1)) * g.kda_heads * g.kda_head_dim * 4;
        dev.push(("KDA states and conv windows of one layer", u(2 * reqs.len() * st)));
    }
    // transient per chunk, and the window's middles
    let c_rows = chunk.min(total);
    dev.push(("chunk activations", u(c_rows * g.chunk_values_per_token() * 4)));
    let win_rows = win.min(total);
    let attn = if g.mla_layers > 0 {
        let q = c_rows * g.mla_heads * ((g.mla_nope + g.mla_rope) * be.operand_bytes + g.mla_v * 4);
        g.attn_bytes(be, c_rows, ctx_max) + q
    } else {
        0
    };
    let experts = if g.moe_layers > 0 {
        let scratch = if be.cuda && be.operand_bytes == 2 { (1usize << 30) + 4 * 8192 * g.moe_inter * 10 } else { 0 };
        let cpu_dequant = if be.cuda { 0 } else { 3 * g.moe_inter * g.latent * 4 };
        let dense = be.dense_experts_from.is_some_and(|m| win_rows * g.top_k >= m * g.experts);
        win_rows * g.top_k * g.expert_row_bytes(be.operand_bytes, !dense) + scratch + cpu_dequant
    } else {
        0
    };
    if g.moe_layers > 0 {
        dev.push(("expert window: chunk middles and latent rows", u(win_rows * g.window_values_per_token() * 4)));
    }
    if attn >= experts {
        dev.push(("MLA attention workspace (expanded K/V of a key block)", u(attn)));
    } else {
        dev.push(("routed experts of one window (grouped rows, scratch)", u(experts)));
    }
    if be.cuda {
        // short-lived copies beside the planned buffers: row slices of the hand-off downloads,
        // the experts' output split per chunk, BF16 copies of GEMM inputs, allocator rounding
        let fixed = [
            "CUDA runtime (cuBLAS workspaces, kernel modules)",
            "weight slots",
            "output head (lm_head, final norms)",
            "embedding table (BF16, rows gathered on the device)",
            "resident weights",
        ];
        let transient: u64 = dev.iter().filter(|x| !fixed.contains(&x.0)).map(|x| x.1).sum();
        dev.push(("temporaries (slices, splits, operand copies): 10 %", transient / 10));
    }
    // host: the process, embeddings gathered on the host, hand-off states, routing, logits
    host.push(("process", HOST_PROCESS));
    if !c.embed_on_device {
        host.push(("embeddings of every new token (f32)", u(total * h * 4)));
    }
    host.push((
        "hand-off state (MLA rows, KDA states)",
        u(2 * g.mla_layers * latent_rows * g.mla_latent * 4 + reqs.len() * g.kda_layers * g.kda_heads * g.kda_head_dim * g.kda_head_dim * 4),
    ));
    if g.moe_layers > 0 {
        host.push(("routing of a window, router margins", u(win_rows * g.top_k * 8 + g.moe_layers * total * 4)));
    }
    let logits = match k.logits {
        LogitsKept::All => total * g.vocab * 4,
        LogitsKept::Last => reqs.len() * g.vocab * 4,
        LogitsKept::None => 0,
    };
    host.push(("logits", u(logits)));
    let peak_device = dev.iter().map(|x| x.1).sum();
    let peak_host = host.iter().map(|x| x.1).sum();
    MemoryPlan {
        budget: lim.device,
        host_limit: lim.host,
        chunk_tokens: chunk,
        expert_window_rows: if g.moe_layers > 0 { win * g.top_k } else { 0 },
        window_tokens: win,
        windows,
        bank: c.bank,
        embed_on_device: c.embed_on_device,
        whole_layers: c.whole_layers,
        expert_chunk,
        slot_bytes,
        weight_traffic: traffic,
        device: dev,
        host,
        peak_device,
        peak_host,
    }
}

/// Windows per MoE layer: every request's chunks in order, cut after `window_tokens` tokens
/// (the executor's [`windows_of`] over the same rows).
fn total_windows(reqs: &[PlanRequest], chunk: usize, window_tokens: usize) -> usize {
    if let [r] = reqs {
        // one request: full chunks per window, at least one
        let per = (window_tokens / chunk).max(1);
        return r.new.div_ceil(chunk).div_ceil(per);
    }
    let rows: Vec<Vec<usize>> = reqs.iter().map(|r| chunk_rows(r.new, chunk)).collect();
    windows_of(&rows, window_tokens).len()
}

/// The rows of each token chunk of a request of `n` new tokens.
pub fn chunk_rows(n: usize, chunk: usize) -> Vec<usize> {
    let chunk = chunk.max(1);
    (0..n.div_ceil(chunk)).map(|i| chunk.min(n - i * chunk)).collect()
}

/// Expert windows over the chunks of a pass (`rows[i]`: request `i`'s chunk rows): each
/// window a list of `(request, first chunk, end chunk)`, consecutive chunks of the pass in
/// order, cut once a window holds `window_tokens` tokens (a window has at least one chunk).
pub fn windows_of(rows: &[Vec<usize>], window_tokens: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let mut out: Vec<Vec<(usize, usize, usize)>> = Vec::new();
    let mut cur: Vec<(usize, usize, usize)> = Vec::new();
    let mut held = 0usize;
    for (i, rs) in rows.iter().enumerate() {
        for (ci, &r) in rs.iter().enumerate() {
            if held > 0 && held + r > window_tokens.max(1) {
                out.push(std::mem::take(&mut cur));
                held = 0;
            }
            match cur.last_mut() {
                Some(last) if last.0 == i && last.2 == ci => last.2 = ci + 1,
                _ => cur.push((i, ci, ci + 1)),
            }
            held += r;
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// With a chosen plan in chunked-slot mode, gives what the device has left to larger expert
/// slots (fewer, larger transfer units), up to a whole layer's experts.
fn grow_slots(g: &Geometry, be: &BackendShape, k: &Knobs, p: &mut MemoryPlan, lim: Limits) {
    if !be.streams_weights || k.resident || p.whole_layers || g.expert_stride == 0 || k.slots.is_some() {
        return;
    }
    let spare = lim.device.saturating_sub(p.peak_device);
    let more = (spare / (2 * g.expert_stride as u64)) as usize;
    let cap = k.expert_chunk.unwrap_or(usize::MAX).min(g.experts);
    let chunk = (p.expert_chunk + more).min(cap);
    if chunk > p.expert_chunk {
        let add = (2 * (chunk - p.expert_chunk) * g.expert_stride) as u64;
        p.expert_chunk = chunk;
        p.slot_bytes += add;
        p.peak_device += add;
        if let Some(x) = p.device.iter_mut().find(|x| x.0 == "weight slots") {
            x.1 += add;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_protocol::synth::presets::{build_config, Preset};

    fn k3() -> Geometry {
        let c = build_config(Preset::K3, &Default::default()).unwrap().text_config;
        Geometry::of(&c, &c.layer_plan()).unwrap()
    }

    const GB: u64 = 1_000_000_000;

    /// A card of `card` GB as the plan sees it by default: free memory (the card less the CUDA
    /// context, ~0.5 GB) less the margin.
    fn card(card: u64, host: u64) -> Limits {
        Limits { device: card * GB - 500_000_000 - DEFAULT_MARGIN, host: host * GB - HOST_MARGIN }
    }

    #[test]
    fn k3_geometry_from_the_release_config() {
        let g = k3();
        assert_eq!((g.layers, g.hidden, g.experts, g.top_k, g.bank_entries), (93, 7168, 896, 16, 8));
        assert_eq!((g.mla_layers, g.kda_layers, g.mla_latent), (24, 69, 576));
        // an MXFP4 expert: 3 × 3072 × 3584 × (1/2 + 1/32) bytes, aligned
        assert!(g.expert_stride >= 3 * 3072 * 3584 * 17 / 32 && g.expert_stride < 3 * 3072 * 3584 * 17 / 32 + 1024);
        assert!(g.experts_total as f64 > 1.4e12, "K3's routed experts are ~1.5 TB: {}", g.experts_total);
    }

    #[test]
    fn k3_plans_on_24_32_80_141_gb_cards() {
        let g = k3();
        let be = BackendShape::cuda(true, 24 << 30, 128);
        let k = Knobs::default();
        let mut table = Vec::new();
        for (c, host) in
            [(24, 64), (24, 128), (24, 192), (32, 64), (32, 128), (32, 192), (80, 64), (80, 128), (80, 192), (141, 64), (141, 125), (141, 128), (141, 192)]
        {
            let be = if c >= 64 { BackendShape::cuda(true, c << 30, 128) } else { be };
            let lim = card(c, host);
            let n = longest_prompt(&g, &be, lim, &k);
            let p = plan(&g, &be, &[PlanRequest { base: 0, new: n }], lim, &k).unwrap();
            assert!(p.peak_device <= lim.device && p.peak_host <= lim.host, "{c} GB / {host} GB: {}", p.line());
            // one token more does not fit, and is refused naming both limits and the longest prompt
            let e = plan(&g, &be, &[PlanRequest { base: 0, new: n + 1 }], lim, &k).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("--vram-budget") && msg.contains("--host-memory") && msg.contains(&format!("longest prompt that fits is {n} tokens")),
                "{msg}"
            );
            table.push((c, host, n, p.line()));
        }
        for (c, host, n, line) in &table {
            eprintln!("{c:>4} GB card, {host:>3} GB host: longest prompt {n:>8} tokens; at it: {line}");
        }
        let longest = |c: u64, h: u64| table.iter().find(|x| x.0 == c && x.1 == h).unwrap().2;
        // more memory never fits less
        assert!(longest(24, 64) <= longest(32, 64) && longest(32, 128) <= longest(80, 128) && longest(80, 128) <= longest(141, 192));
        assert!(longest(24, 64) <= longest(24, 192));
        // the targets for K3's release config, weights streamed (the MLA keys expanded a
        // block at a time; expanded whole, 74,302 and 119,182 tokens fit)
        assert!(longest(24, 64) >= 131_072, "24 GB card, 64 GB host: {}", longest(24, 64));
        assert!(longest(32, 128) >= 262_144, "32 GB card, 128 GB host: {}", longest(32, 128));
    }

    #[test]
    fn plans_fit_their_limits_and_choose_less_traffic_first() {
        let g = k3();
        let be = BackendShape::cuda(true, 24 << 30, 128);
        let k = Knobs::default();
        let lim = card(32, 128);
        let p = plan(&g, &be, &[PlanRequest { base: 0, new: 8192 }], lim, &k).unwrap();
        assert!(p.peak_device <= lim.device);
        assert!(!p.whole_layers, "two whole K3 layers (~33 GB) do not fit a 32 GB card");
        // an H200 holds two whole layers at 8k: the experts cross once
        let be141 = BackendShape::cuda(true, 141 << 30, 128);
        let p = plan(&g, &be141, &[PlanRequest { base: 0, new: 8192 }], card(141, 125), &k).unwrap();
        assert!(p.whole_layers && p.windows == 1 && p.bank == Placement::Device, "{}", p.line());
        assert_eq!(p.weight_traffic, (g.dense_total + g.experts_total) as u64);
    }

    #[test]
    fn an_explicit_chunk_is_kept_or_refused() {
        let g = k3();
        let be = BackendShape::cuda(true, 24 << 30, 128);
        let k = Knobs { chunk_tokens: Some(1000), ..Default::default() };
        let p = plan(&g, &be, &[PlanRequest { base: 0, new: 5000 }], card(32, 128), &k).unwrap();
        assert_eq!(p.chunk_tokens, 1000);
        let tiny = Limits { device: GB, host: 64 * GB };
        assert!(plan(&g, &be, &[PlanRequest { base: 0, new: 5000 }], tiny, &k).is_err());
    }

    #[test]
    fn windows_cover_every_chunk_once_in_order() {
        let rows = vec![chunk_rows(300, 64), chunk_rows(10, 64), chunk_rows(129, 64)];
        for w in [1, 64, 100, 128, 200, 1000] {
            let ws = windows_of(&rows, w);
            let mut seen = Vec::new();
            for win in &ws {
                let held: usize = win.iter().map(|&(i, a, b)| rows[i][a..b].iter().sum::<usize>()).sum();
                assert!(held <= w.max(64) || win.len() == 1 && win[0].2 - win[0].1 == 1, "window {win:?} holds {held} > {w}");
                for &(i, a, b) in win {
                    for ci in a..b {
                        seen.push((i, ci));
                    }
                }
            }
            let want: Vec<(usize, usize)> = rows.iter().enumerate().flat_map(|(i, r)| (0..r.len()).map(move |c| (i, c))).collect();
            assert_eq!(seen, want, "window {w}");
        }
        assert_eq!(windows_of(&rows, usize::MAX).len(), 1);
    }

    #[test]
    fn tiny_models_plan_small_on_the_cpu() {
        let c = build_config(Preset::Tiny, &Default::default()).unwrap().text_config;
        let g = Geometry::of(&c, &c.layer_plan()).unwrap();
        let be = BackendShape::cpu();
        let lim = Limits { device: 64_000_000, host: 4 * GB };
        let p = plan(&g, &be, &[PlanRequest { base: 0, new: 300 }], lim, &Knobs::default()).unwrap();
        assert!(p.peak_device <= 64_000_000, "{}", p.line());
        // a tight budget forces small chunks, the bank on the host and several windows
        let n = 300;
        let loose = plan(&g, &be, &[PlanRequest { base: 0, new: n }], lim, &Knobs::default()).unwrap();
        let tight_lim = Limits { device: loose.peak_device - loose.device.iter().find(|x| x.0.starts_with("AttnRes")).unwrap().1 / 2, host: 4 * GB };
        let tight = plan(&g, &be, &[PlanRequest { base: 0, new: n }], tight_lim, &Knobs::default()).unwrap();
        assert!(tight.peak_device <= tight_lim.device);
        assert!(tight.chunk_tokens < n || tight.bank == Placement::Host, "{}", tight.line());
    }

    #[test]
    fn an_absurd_prompt_is_refused_fast() {
        let c = build_config(Preset::Tiny, &Default::default()).unwrap().text_config;
        let g = Geometry::of(&c, &c.layer_plan()).unwrap();
        let t0 = std::time::Instant::now();
        let e = plan(&g, &BackendShape::cpu(), &[PlanRequest { base: 0, new: 50_000_000 }], Limits { device: 16_000_000, host: 64 * GB }, &Knobs::default())
            .unwrap_err();
        assert!(t0.elapsed().as_secs_f64() < 2.0);
        assert!(e.longest > 0 && e.longest < 50_000_000, "{e}");
    }
}
