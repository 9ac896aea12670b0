//! The ops interface the layer-major executor runs the K3 text tower through (spec §3).
//!
//! Two backends implement [`Backend`]: the CPU reference ([`crate::cpu::CpuBackend`], f32,
//! what CI runs) and the CUDA backend (`crate::cuda`). The ops sit at the granularity of the
//! spec's equations, one op per equation block, so that every CUDA kernel has exactly one CPU
//! reference function to be tested against (the CPU backend's ops are also plain `pub fn`s on
//! slices in `crate::cpu`).
//!
//! Conventions shared by every op:
//! - An activation buffer ([`Backend::Buf`]) is a row-major f32 matrix `[rows, cols]`; rows are
//!   tokens. Where a width is made of heads, the head is the outer index of the columns
//!   (`[rows, heads * head_dim]`, head-major), as in the checkpoint's projections.
//! - A dense weight ([`Backend::Weight`]) is a checkpoint tensor viewed as `[out, in]`
//!   (PyTorch Linear convention); 1-D tensors are `[1, n]`; the conv weights `[C, 1, K]` are
//!   `[C, K]`. `gemm(x, W)` computes `x · Wᵀ`. A backend may keep BF16 weights as BF16 and
//!   widen inside its kernels; the CPU reference widens to f32 at load time (bit-exact).
//! - Norm epsilons are parameters: the spec uses 1e-5 (`rms_norm_eps`) for most norms, 1e-6 for
//!   the MLA `q_a_layernorm`/`kv_a_layernorm`, and `sqrt(Σx² + 1e-6)` for the KDA L2 norm (§3.0).
//! - All math of §3 that the spec puts in FP32 (norms, gates, the KDA recurrence, softmax, the
//!   router) must be FP32 or better in every backend.
//! - Ops never panic on bad shapes: they return an error naming the op and the shapes.
//!
//! Stability: this trait is shared with the CUDA engineer; extend it by adding methods, do
//! not change the meaning of existing ones.

use std::borrow::Cow;

use k3_protocol::mxfp4::Mxfp4Weight;
use k3_protocol::tensors::DType;

/// Result type of every op.
pub type OpResult<T> = anyhow::Result<T>;

/// An activation buffer: a row-major f32 matrix `[rows, cols]` owned by a backend.
pub trait DeviceBuf: Send + Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    fn len(&self) -> usize {
        self.rows() * self.cols()
    }
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dense checkpoint tensor on the host, as the loader hands it to [`Backend::load_dense`]:
/// BF16 or F32 little-endian bytes viewed as `[rows, cols]` (see the module docs for how
/// 1-D and 3-D checkpoint tensors map to two dimensions).
#[derive(Debug, Clone)]
pub struct HostTensor<'a> {
    /// Checkpoint name (for error messages).
    pub name: Cow<'a, str>,
    /// `BF16` or `F32` (`U8` is an error: MXFP4 goes through [`ExpertHostWeights`]).
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols * dtype.size()` bytes, little-endian.
    pub bytes: Cow<'a, [u8]>,
}

impl HostTensor<'_> {
    /// An owned F32 tensor from values (e.g. the per-head prefix of `A_log`).
    pub fn from_f32(name: impl Into<String>, rows: usize, cols: usize, data: &[f32]) -> HostTensor<'static> {
        HostTensor { name: Cow::Owned(name.into()), dtype: DType::F32, rows, cols, bytes: Cow::Owned(bytemuck::cast_slice(data).to_vec()) }
    }

    /// Widens the data to f32 (bit-exact for BF16), checking the byte count.
    pub fn to_f32(&self) -> OpResult<Vec<f32>> {
        let n = self.rows * self.cols;
        let esize = match self.dtype {
            DType::BF16 => 2,
            DType::F32 => 4,
            DType::U8 => anyhow::bail!("tensor {}: U8 data is not a dense BF16/F32 weight", self.name),
        };
        if self.bytes.len() != n * esize {
            anyhow::bail!("tensor {}: {} bytes, expected {} for [{}, {}] {}", self.name, self.bytes.len(), n * esize, self.rows, self.cols, self.dtype.name());
        }
        Ok(match self.dtype {
            DType::F32 => self.bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            _ => self.bytes.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect(),
        })
    }
}

/// One routed expert's three MXFP4 weights (compressed-tensors layout, spec §2.3), zero-copy.
/// `w1` = gate `[moe_inter, latent]`, `w3` = up `[moe_inter, latent]`, `w2` = down `[latent, moe_inter]`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertHostWeights<'a> {
    pub w1: Mxfp4Weight<'a>,
    pub w3: Mxfp4Weight<'a>,
    pub w2: Mxfp4Weight<'a>,
}

/// KDA head geometry: `heads × head_dim`, `d_k = d_v = head_dim` (spec §3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KdaDims {
    pub heads: usize,
    pub head_dim: usize,
}

impl KdaDims {
    /// Channel width `heads * head_dim`.
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Values in one layer's recurrent state `[heads, k, v]`.
    pub fn state_len(&self) -> usize {
        self.heads * self.head_dim * self.head_dim
    }
}

/// The per-row inputs of the KDA delta rule (spec §3.4): `q, k, v, g: [rows, H·D]` (q, k
/// L2-normed, q scaled), `beta [rows, H]`.
pub struct KdaInputs<'a, B> {
    pub q: &'a B,
    pub k: &'a B,
    pub v: &'a B,
    pub g: &'a B,
    pub beta: &'a B,
}

impl<B: DeviceBuf> KdaInputs<'_, B> {
    /// Rows of the inputs.
    pub fn rows(&self) -> usize {
        self.q.rows()
    }
    /// Checks the shapes against `dims` (and the state `[H, D·D]`); the error names `op` and the tensor.
    pub fn check(&self, op: &str, state: &B, dims: KdaDims) -> OpResult<()> {
        let (t, w) = (self.rows(), dims.width());
        for (n, x) in [("q", self.q), ("k", self.k), ("v", self.v), ("g", self.g)] {
            anyhow::ensure!(x.rows() == t && x.cols() == w, "{op}: {n} is [{}, {}], expected [{t}, {w}]", x.rows(), x.cols());
        }
        let beta = self.beta;
        anyhow::ensure!(beta.rows() == t && beta.cols() == dims.heads, "{op}: beta is [{}, {}], expected [{t}, {}]", beta.rows(), beta.cols(), dims.heads);
        anyhow::ensure!(state.len() == dims.state_len(), "{op}: state holds {} values, expected {}", state.len(), dims.state_len());
        Ok(())
    }
}

/// MLA geometry (spec §3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaDims {
    pub heads: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim` (never rotated: NoPE).
    pub rope: usize,
    /// `v_head_dim`.
    pub v: usize,
    /// `kv_lora_rank`.
    pub kv_lora: usize,
}

impl MlaDims {
    /// Query/key width per head: `nope + rope`.
    pub fn qk(&self) -> usize {
        self.nope + self.rope
    }
    /// Width of one latent cache row: post-norm `c_kv` then raw `k_pe`.
    pub fn latent(&self) -> usize {
        self.kv_lora + self.rope
    }
    /// Softmax scale `1/sqrt(nope + rope)`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.qk() as f32).sqrt()
    }
}

/// SiTU-GLU parameters (spec §3.6): `β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂)`; `linear_beta = None`
/// leaves the up branch linear.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SituBetas {
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

/// Which form of MLA attention to evaluate (both give the same result, spec §3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlaForm {
    /// Expand `k_nope`/`v` per head from the latent rows through `kv_b_proj` (prefill).
    Expanded,
    /// Attend over the latent rows directly (MQA over a 576-wide key; decode).
    Absorbed,
}

/// Router decision for a batch of rows (spec §3.6), on the host: the expert grouping a
/// grouped GEMM needs is decided there anyway.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per row (`num_experts_per_token`).
    pub top_k: usize,
    /// `[rows, top_k]` selected expert ids, in descending biased score.
    pub ids: Vec<u32>,
    /// `[rows, top_k]` mixing weights: unbiased sigmoid scores, renormalised, times the scaling factor.
    pub weights: Vec<f32>,
    /// `[rows]` selection margin: k-th minus (k+1)-th largest biased score (golden `moe.topk_gap`);
    /// `+inf` when every expert is selected.
    pub gap: Vec<f32>,
}

impl Routing {
    pub fn rows(&self) -> usize {
        self.gap.len()
    }
}

/// A download started by [`Backend::download_later`].
pub trait PendingDownload: Send {
    /// The buffer's values, row-major (waits for the copy if it is not done yet).
    fn wait(self: Box<Self>) -> OpResult<Vec<f32>>;
}

/// A download already done.
pub struct Downloaded(pub Vec<f32>);

impl PendingDownload for Downloaded {
    fn wait(self: Box<Self>) -> OpResult<Vec<f32>> {
        Ok(self.0)
    }
}

/// The ops of the K3 text tower. See the module docs for layouts and conventions.
pub trait Backend: Send + Sync {
    /// Activation buffer, f32 `[rows, cols]`.
    type Buf: DeviceBuf;
    /// A resident dense weight (BF16 or F32 `[out, in]`).
    type Weight: Send + Sync;
    /// One MoE layer's routed experts (MXFP4).
    type Experts: Send + Sync;
    /// A buffer parked in host memory ([`Backend::park`]).
    type Parked: Send;

    /// Short name (`"cpu"`, `"cuda"`), for logs. Callers ask what a backend can do through the
    /// methods below, never its name or type.
    fn name(&self) -> &'static str;

    /// Tokens per executor chunk when none is given (what suits the backend's memory and GEMM
    /// sizes): 512 unless the backend says otherwise.
    fn default_chunk_tokens(&self) -> usize {
        512
    }

    /// Whether the weight streamer can feed this backend (`crate::streamer`: weights copied to
    /// the device while the previous layer computes); one that cannot keeps its weights resident
    /// or reads them per layer.
    fn streams_weights(&self) -> bool {
        false
    }

    /// Seconds this backend has spent so far on one-time set-up inside its ops (CUDA: compiling
    /// and loading each kernel module the first time it is used); a node leaves them out of
    /// its measured compute, which predicts later requests.
    fn one_time_seconds(&self) -> f64 {
        0.0
    }

    /// Whether an op returns only once its result is computed, so that host times are compute
    /// times (the CPU reference); false for a device that queues the work (CUDA).
    fn synchronous(&self) -> bool {
        true
    }

    // ---- memory -------------------------------------------------------------------------

    /// Copies host values `[rows, cols]` into a new buffer.
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> OpResult<Self::Buf>;
    /// Copies a buffer back to the host, row-major.
    fn download(&self, x: &Self::Buf) -> OpResult<Vec<f32>>;
    /// Starts copying `x` back to the host and returns the copy to be taken later
    /// ([`PendingDownload::wait`]), so that the caller need not wait for the device now (a
    /// queueing device copies on its own stream after the work issued so far). The default
    /// downloads at once.
    fn download_later(&self, x: Self::Buf) -> OpResult<Box<dyn PendingDownload>> {
        Ok(Box::new(Downloaded(self.download(&x)?)))
    }
    /// Moves `x` to host memory, where it stays until it is dropped (the executor parks the
    /// AttnRes residual there between layers when the memory plan says so). A queueing device
    /// starts the copy and does not wait for it; it keeps the device memory of at most
    /// [`crate::memory_plan::PARKED_IN_FLIGHT`] parkings whose copies may still run.
    fn park(&self, x: Self::Buf) -> OpResult<Self::Parked>;
    /// A new device copy of a parked buffer (the parked one stays, to be read again).
    fn unpark(&self, p: &Self::Parked) -> OpResult<Self::Buf>;
    /// A zero-filled buffer.
    fn zeros(&self, rows: usize, cols: usize) -> OpResult<Self::Buf>;
    /// Rows `row0 .. row0+n` of `x` as a new buffer.
    fn slice_rows(&self, x: &Self::Buf, row0: usize, n: usize) -> OpResult<Self::Buf>;
    /// Overwrites rows `row0 .. row0+src.rows()` of `dst` with `src` (same `cols`).
    fn write_rows(&self, dst: &mut Self::Buf, row0: usize, src: &Self::Buf) -> OpResult<()>;
    /// `a += b` elementwise (same shape).
    fn add_assign(&self, a: &mut Self::Buf, b: &Self::Buf) -> OpResult<()>;

    // ---- weights ------------------------------------------------------------------------

    /// Makes a dense BF16/F32 checkpoint tensor resident.
    fn load_dense(&self, w: &HostTensor<'_>) -> OpResult<Self::Weight>;
    /// Makes one MoE layer's routed experts resident (index = expert id).
    fn load_experts(&self, experts: &[ExpertHostWeights<'_>]) -> OpResult<Self::Experts>;

    // ---- dense math ---------------------------------------------------------------------

    /// `x · Wᵀ`: `x [rows, in]`, `W [out, in]` → `[rows, out]`, f32 accumulation.
    fn gemm(&self, x: &Self::Buf, w: &Self::Weight) -> OpResult<Self::Buf>;
    /// RMSNorm over each row: `x / sqrt(mean(x²) + eps) ⊙ w`, `w [1, cols]` (spec §3.0).
    fn rms_norm(&self, x: &Self::Buf, w: &Self::Weight, eps: f32) -> OpResult<Self::Buf>;
    /// SiTU-GLU of a gate and an up projection of equal shape (spec §3.6).
    fn situ_glu(&self, gate: &Self::Buf, up: &Self::Buf, betas: SituBetas) -> OpResult<Self::Buf>;
    /// `σ(x)` elementwise (the KDA write strength β).
    fn sigmoid(&self, x: &Self::Buf) -> OpResult<Self::Buf>;
    /// `a ⊙ σ(gate)` in place (the MLA output gate).
    fn sigmoid_gate_mul(&self, a: &mut Self::Buf, gate: &Self::Buf) -> OpResult<()>;

    // ---- AttnRes (spec §3.2) ------------------------------------------------------------

    /// Softmax mix over depth of the candidates `[bank..., p]` (each `[rows, H]`), per row:
    /// `s_i = Σ_d rms(V_i)[d]·w_n[d]·w_p[d]` (eps inside the rms, no 1/√d), `α = softmax(s)`,
    /// output `Σ_i α_i V_i` on the RAW candidates. `norm_w [1, H]`, `proj_w [1, H]`.
    fn attn_res_mix(&self, bank: &[&Self::Buf], p: &Self::Buf, norm_w: &Self::Weight, proj_w: &Self::Weight, eps: f32) -> OpResult<Self::Buf>;

    // ---- KDA (spec §3.3, §3.4) ----------------------------------------------------------

    /// Short causal depthwise conv + SiLU over `x [rows, C]` with weights `w [C, K]`
    /// (tap `K-1` multiplies the current row). `window [K-1, C]` holds the previous K-1
    /// PRE-conv inputs, oldest first (zeros at sequence start); on return it holds the last
    /// K-1 inputs of `window ++ x`.
    fn short_conv_silu(&self, x: &Self::Buf, w: &Self::Weight, window: &mut Self::Buf) -> OpResult<Self::Buf>;
    /// In place, per head of `head_dim` columns: `x ← scale · x / sqrt(Σ x² + eps)`.
    fn l2_norm_heads(&self, x: &mut Self::Buf, head_dim: usize, eps: f32, scale: f32) -> OpResult<()>;
    /// [`Backend::short_conv_silu`] followed by [`Backend::l2_norm_heads`] on its output (the q
    /// and k paths of KDA), as one op so that a backend can do both in one pass over the data.
    fn short_conv_silu_l2(&self, x: &Self::Buf, w: &Self::Weight, window: &mut Self::Buf, head_dim: usize, eps: f32, scale: f32) -> OpResult<Self::Buf> {
        let mut y = self.short_conv_silu(x, w, window)?;
        self.l2_norm_heads(&mut y, head_dim, eps, scale)?;
        Ok(y)
    }
    /// Decay gate in log space from `z = f_b(f_a(x))` (`[rows, H·D]`, before the bias):
    /// `u = z + dt_bias`; bounded form (`lower_bound = Some(b)`): `g = b·σ(exp(A_log[h])·u)`;
    /// Kimi-Linear form (`None`): `g = −exp(A_log[h])·softplus(u)`. `a_log [1, heads]` holds ONE
    /// value per head (the checkpoint's `[head_dim]` tensor truncated to `heads`, spec §3.8),
    /// `dt_bias [1, H·D]`.
    fn kda_gate(&self, z: &Self::Buf, a_log: &Self::Weight, dt_bias: &Self::Weight, dims: KdaDims, lower_bound: Option<f32>) -> OpResult<Self::Buf>;
    /// Delta-rule recurrence over the rows of `x`, chunked form (spec §3.4) with chunk length
    /// `chunk` (64; any row count, the last chunk may be partial). `state [H, D·D]` is
    /// `S[h, k, v]`, read as the initial state and overwritten with the final one. Returns
    /// `o [rows, H·D]`.
    fn kda_chunked(&self, x: &KdaInputs<'_, Self::Buf>, state: &mut Self::Buf, dims: KdaDims, chunk: usize) -> OpResult<Self::Buf>;
    /// The same recurrence token by token (spec §3.3 step 7; decode). Same layouts as
    /// [`Backend::kda_chunked`].
    fn kda_recurrent(&self, x: &KdaInputs<'_, Self::Buf>, state: &mut Self::Buf, dims: KdaDims) -> OpResult<Self::Buf>;
    /// KDA output gate + norm, per head: `RMSNorm_D(o_h; eps) ⊙ w ⊙ σ(gate_h)`, `w [1, D]`
    /// shared by all heads; `o, gate: [rows, H·D]`.
    fn gated_rms_norm(&self, o: &Self::Buf, gate: &Self::Buf, w: &Self::Weight, head_dim: usize, eps: f32) -> OpResult<Self::Buf>;

    // ---- MLA (spec §3.5) ----------------------------------------------------------------

    /// Latent cache rows from `kv = W_kva x` (`[rows, kv_lora + rope]`): RMSNorm (weight `w
    /// [1, kv_lora]`, `eps` = 1e-6) on the first `kv_lora` columns, the `rope` columns (`k_pe`)
    /// copied raw.
    fn mla_latent(&self, kv: &Self::Buf, w: &Self::Weight, eps: f32, dims: MlaDims) -> OpResult<Self::Buf>;
    /// Causal NoPE attention of the query rows `q [rows, heads·(nope+rope)]` (per head
    /// `[q_nope | q_pe]`), at absolute positions `pos0 .. pos0+rows`, over the latent cache
    /// rows `0 .. pos0+rows` of `cache [>= pos0+rows, kv_lora+rope]`. `kv_b [heads·(nope+v),
    /// kv_lora]` (per head `[k_nope rows ; v rows]`). Score scale `1/sqrt(nope+rope)`, FP32
    /// softmax. Returns `[rows, heads·v]` (before the output gate). `form` chooses how to
    /// evaluate; both must agree.
    fn mla_attention(&self, q: &Self::Buf, cache: &Self::Buf, kv_b: &Self::Weight, dims: MlaDims, pos0: usize, form: MlaForm) -> OpResult<Self::Buf>;

    // ---- latent MoE (spec §3.6) ---------------------------------------------------------

    /// Router from `logits = W_r x` (`[rows, E]`, f32): `s = σ(logits)`, select top-k of
    /// `s + bias` (`bias [1, E]`, selection only; ties: lower index wins), weights = unbiased
    /// `s` of the selected, divided by `(Σ + 1e-20)` when `renormalize`, times `scaling`.
    fn route(&self, logits: &Self::Buf, bias: &Self::Weight, top_k: usize, renormalize: bool, scaling: f32) -> OpResult<Routing>;
    /// Grouped MXFP4 expert MLPs in the latent space: for each row `t`,
    /// `Σ_j weights[t,j] · W2_e · SiTU(W1_e x_t, W3_e x_t)`, `e = ids[t,j]`, accumulated in
    /// f32. `x_lat [rows, latent]` → `[rows, latent]`.
    fn moe_experts(&self, x_lat: &Self::Buf, routing: &Routing, experts: &Self::Experts, betas: SituBetas) -> OpResult<Self::Buf>;

    /// [`Backend::moe_experts`] of several inputs (the token chunks of one layer) over the same
    /// experts, with the same results; a backend may share work between them (the CUDA dense
    /// path dequantises each expert group once for all).
    fn moe_experts_many(&self, inputs: &[(&Self::Buf, &Routing)], experts: &Self::Experts, betas: SituBetas) -> OpResult<Vec<Self::Buf>> {
        inputs.iter().map(|(x, r)| self.moe_experts(x, r, experts, betas)).collect()
    }
}
