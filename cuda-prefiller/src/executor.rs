//! The layer-major executor (ARCHITECTURE.md): all new tokens pass layer 0, then layer 1, …,
//! each layer over the tokens in chunks, so a layer's weights are needed once per prompt and
//! transient activations stay bounded by the chunk size. What persists across layers per
//! token is the AttnRes residual (the bank of block sums plus the running partial sum `P`,
//! spec §3.1), kept per chunk on the backend or parked on the host.
//!
//! After each layer the executor reports that layer's hand-off state through a callback, so a
//! server can ship it while later layers compute. It continues from any [`HandoffState`] (a
//! session's next turn) with the same results as a one-shot prefill: the KDA recurrence and
//! conv windows and the MLA latent rows carry everything across calls, and AttnRes is
//! token-local. One new token is a decode step (recurrent KDA, absorbed MLA).

use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use k3_protocol::config::{AttnKind, FfnKind};
use k3_protocol::eval::argmax;
use k3_protocol::handoff::{HandoffState, LayerState, MlaState};

use crate::backend::{Backend, DeviceBuf, MlaForm, Routing};
use crate::calibrate::MoeObserverRef;
use crate::model::ffn::{latent_moe_back, latent_moe_forward, latent_moe_front, mlp_forward};
use crate::model::kda::{kda_forward, KdaForm, KdaStateBufs};
use crate::model::mla::{mla_forward, MlaLatentBufs};
use crate::model::weights::{AttnWeights, FfnWeights, HeadWeights, LayerWeights};
use crate::model::{Model, ModelDims};

/// Embedding rows that replace the token embeddings at some positions (image features at the
/// `<|media_pad|>` positions, spec §5.5). Positions count from the first NEW token.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EmbeddingOverrides {
    /// Ascending or not, each at most once.
    pub positions: Vec<usize>,
    /// `[positions.len(), hidden]`, row `i` for `positions[i]`.
    pub rows: Vec<f32>,
}

/// Which logits rows to compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRows {
    /// Every new token (the `forward` contract).
    All,
    /// Only the last new token (serving, decode).
    Last,
    /// None (prefill for a remote decoder).
    None,
}

/// Executor settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecOptions {
    /// Tokens per chunk within a layer (bounds transient activations).
    pub chunk_tokens: usize,
    /// `None`: recurrent for a single new token, chunked otherwise.
    pub kda_form: Option<KdaForm>,
    /// `None`: absorbed for a single new token, expanded otherwise.
    pub mla_form: Option<MlaForm>,
    pub logits: LogitsRows,
    /// Record the `hidden.*` vectors of the last new token.
    pub trace_last: bool,
    /// Keep each chunk's residual (bank + `P`) on the host between layers, uploading it for
    /// the chunk's turn (bounds backend memory to about one chunk's residual).
    pub park_on_host: bool,
    /// Tokens per routed-expert window of a latent-MoE layer: the pass's token chunks (of every
    /// request, in order) go through the experts in windows of at most this many tokens (at
    /// least one chunk each), fronts then experts then backs per window, so that the chunks'
    /// middles and the routed rows held at once stay bounded ([`crate::memory_plan`]). `None`:
    /// one window for the whole pass (one chunk per window with `park_on_host`). Routed experts
    /// are position-wise: the results do not depend on it.
    pub expert_window_tokens: Option<usize>,
    /// Calibration: sees every latent-MoE layer's routing and per-slot expert output norms
    /// (`k3-prefill calibrate`, [`crate::calibrate`]); the results are unchanged.
    pub moe_observer: Option<MoeObserverRef>,
    /// Asked before each token chunk of each layer (and, on a synchronous backend, before each
    /// chunk's routed experts) whether request `i` of the pass is cancelled: a cancelled request
    /// drops out of the pass at once with [`Cancelled`], its state untouched, instead of at the
    /// end of the layer (a layer of a long prompt takes minutes on a slow backend).
    pub cancel: Option<CancelRef>,
}

/// Whether request `i` of a pass has been cancelled ([`ExecOptions::cancel`]).
#[derive(Clone)]
pub struct CancelRef(pub Arc<dyn Fn(usize) -> bool + Send + Sync>);

impl CancelRef {
    fn cancelled(&self, i: usize) -> bool {
        (self.0)(i)
    }
}

impl std::fmt::Debug for CancelRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CancelRef")
    }
}

impl PartialEq for CancelRef {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.0), Arc::as_ptr(&other.0))
    }
}

/// Why a request left a pass early through [`ExecOptions::cancel`]: where it stopped, and how
/// much of that layer's chunk work had run (`done` of `of` token chunks' fronts or wholes; the
/// routed experts count per chunk as well).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cancelled in layer {layer} after {done} of its {of} token-chunk steps")]
pub struct Cancelled {
    pub layer: usize,
    pub done: usize,
    pub of: usize,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            chunk_tokens: 512,
            kda_form: None,
            mla_form: None,
            logits: LogitsRows::All,
            trace_last: false,
            park_on_host: false,
            expert_window_tokens: None,
            moe_observer: None,
            cancel: None,
        }
    }
}

impl ExecOptions {
    /// These options under a pass's memory plan: its chunk, its expert windows and the bank's
    /// place (parked on the host between layers when the plan puts it there).
    pub fn following(mut self, plan: &crate::memory_plan::MemoryPlan) -> Self {
        self.chunk_tokens = plan.chunk_tokens;
        self.expert_window_tokens = Some(plan.window_tokens);
        self.park_on_host = plan.bank == crate::memory_plan::Placement::Host;
        self
    }
}

/// The new tokens of one prefill call.
#[derive(Debug, Clone, Copy)]
pub struct PrefillInput<'a> {
    pub tokens: &'a [u32],
    pub overrides: Option<&'a EmbeddingOverrides>,
}

impl<'a> PrefillInput<'a> {
    pub fn tokens(tokens: &'a [u32]) -> Self {
        PrefillInput { tokens, overrides: None }
    }
}

/// The golden `hidden.*` vectors of one position (the last new token).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HiddenTrace {
    pub embed: Vec<f32>,
    /// Per layer: input of `input_layernorm` (the AttnRes mix; the raw embedding at layer 0).
    pub attn_in: Vec<Vec<f32>>,
    /// Per layer: attention block output (after `o_proj`).
    pub attn_out: Vec<Vec<f32>>,
    /// Per layer: input of `post_attention_layernorm`.
    pub mlp_in: Vec<Vec<f32>>,
    /// Per layer: FFN output.
    pub mlp_out: Vec<Vec<f32>>,
    /// Per layer: the partial block sum `P` after the layer.
    pub after_layer: Vec<Vec<f32>>,
    pub final_mix: Vec<f32>,
    pub final_normed: Vec<f32>,
}

/// What a prefill call returns besides the updated state. Equality compares the results, not
/// the timings (`chunk_seconds`).
#[derive(Debug, Clone, Default)]
pub struct PrefillOutput {
    /// `[logits_rows, vocab]`.
    pub logits: Vec<f32>,
    pub logits_rows: usize,
    pub vocab: usize,
    /// Per MoE layer `(layer, gap per new token)`: the router selection margin (golden `moe.topk_gap`).
    pub topk_gap: Vec<(usize, Vec<f32>)>,
    pub trace: Option<HiddenTrace>,
    /// Per token chunk, in order: `(rows, seconds)` — the host's wall time spent on the chunk's
    /// work over all layers (the routed experts shared by rows). On an asynchronous backend
    /// (CUDA) this is the time to issue the work, not to run it.
    pub chunk_seconds: Vec<(usize, f64)>,
}

impl PartialEq for PrefillOutput {
    fn eq(&self, o: &Self) -> bool {
        (self.logits_rows, self.vocab) == (o.logits_rows, o.vocab) && self.logits == o.logits && self.topk_gap == o.topk_gap && self.trace == o.trace
    }
}

impl PrefillOutput {
    /// Row `i` of the logits.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// One layer finished: its new hand-off state.
#[derive(Debug)]
pub struct LayerEvent<'a> {
    pub layer: usize,
    /// Tokens in the state before this call.
    pub base_tokens: usize,
    /// Tokens added by this call.
    pub new_tokens: usize,
    /// KDA layers: the full new state. MLA layers: only the new tokens' latent rows
    /// (positions `base_tokens ..`), which is what has to be shipped.
    pub state: &'a LayerState,
}

/// A residual tensor of one chunk: on the backend or parked on the host ([`Backend::park`]).
enum Slot<B: Backend> {
    Dev(B::Buf),
    Host(B::Parked),
    /// Taken out for the layer in progress ([`attn_half`]); [`finish_chunk`] stores it back.
    Taken,
}

enum Held<'a, B: Backend> {
    Ref(&'a B::Buf),
    Own(B::Buf),
}

impl<B: Backend> Deref for Held<'_, B> {
    type Target = B::Buf;
    fn deref(&self) -> &B::Buf {
        match self {
            Held::Ref(r) => r,
            Held::Own(o) => o,
        }
    }
}

impl<B: Backend> Slot<B> {
    fn get<'a>(&'a self, b: &B) -> anyhow::Result<Held<'a, B>> {
        Ok(match self {
            Slot::Dev(x) => Held::Ref(x),
            Slot::Host(p) => Held::Own(b.unpark(p)?),
            Slot::Taken => bail!("a chunk's running sum was read while its layer had it"),
        })
    }
    fn take(self, b: &B) -> anyhow::Result<B::Buf> {
        match self {
            Slot::Dev(x) => Ok(x),
            Slot::Host(p) => b.unpark(&p),
            Slot::Taken => bail!("a chunk's running sum was taken twice"),
        }
    }
    fn store(b: &B, x: B::Buf, park: bool) -> anyhow::Result<Self> {
        Ok(if park { Slot::Host(b.park(x)?) } else { Slot::Dev(x) })
    }
}

/// The AttnRes residual of one chunk of tokens.
struct ChunkResidual<B: Backend> {
    rows: usize,
    bank: Vec<Slot<B>>,
    p: Slot<B>,
}

fn last_row<B: Backend>(b: &B, x: &B::Buf) -> anyhow::Result<Vec<f32>> {
    b.download(&b.slice_rows(x, x.rows() - 1, 1)?)
}

/// Mix of the chunk's bank and `p` with one layer's AttnRes weights (or `p` itself while the
/// bank is empty: layer 0).
fn mix<B: Backend>(b: &B, bank: &[Held<'_, B>], p: &B::Buf, norm: &B::Weight, proj: &B::Weight, eps: f32) -> anyhow::Result<Option<B::Buf>> {
    if bank.is_empty() {
        return Ok(None);
    }
    let refs: Vec<&B::Buf> = bank.iter().map(|h| &**h).collect();
    Ok(Some(b.attn_res_mix(&refs, p, norm, proj, eps)?))
}

/// Where a prefill gets each layer's weights. [`ModelWeights`] takes them from the model
/// (resident, or loaded synchronously per layer); the CUDA weight streamer
/// ([`crate::streamer::StreamedWeights`]) copies the next layer's weights on the copy stream
/// while the current layer computes, and may hand a layer out without its routed experts
/// (`MoeWeights::experts == None`) when the layer does not fit the VRAM budget: those then come
/// through [`WeightFeed::experts_in_chunks`].
pub trait WeightFeed<B: Backend> {
    /// The weights of layer `l`; called once per layer, for `l = 0, 1, …` in order.
    fn layer(&mut self, model: &Model<B>, l: usize) -> anyhow::Result<Arc<LayerWeights<B>>>;

    /// For a latent MoE layer handed out without its experts: the routed-expert output of each
    /// `(x_lat, routing)` input (one per token chunk), the same as [`Backend::moe_experts`]
    /// over all of the layer's experts.
    fn experts_in_chunks(&mut self, _model: &Model<B>, l: usize, _inputs: &[(&B::Buf, &Routing)]) -> anyhow::Result<Vec<B::Buf>> {
        bail!("layer {l}: the routed experts are not resident and this weight feed does not stream them")
    }

    /// Every op that reads layer `l`'s weights has been issued (its weight slot may be reused
    /// once they have run).
    fn layer_done(&mut self, _model: &Model<B>, _l: usize) -> anyhow::Result<()> {
        Ok(())
    }

    /// The embeddings of `ids` as a `[ids.len(), hidden]` buffer on the backend, when the feed
    /// gathers them there (ids are checked against the vocabulary first); `None`: the executor
    /// gathers them on the host and uploads them.
    fn embed(&mut self, _model: &Model<B>, _ids: &[u32]) -> anyhow::Result<Option<B::Buf>> {
        Ok(None)
    }

    /// The output head (final norms, `lm_head`); the model's own by default.
    fn head(&mut self, model: &Model<B>) -> anyhow::Result<Arc<HeadWeights<B>>> {
        model.head()
    }
}

/// The model's own weights: resident, or loaded synchronously when the executor reaches a layer
/// ([`Model::layer`]).
pub struct ModelWeights;

impl<B: Backend> WeightFeed<B> for ModelWeights {
    fn layer(&mut self, model: &Model<B>, l: usize) -> anyhow::Result<Arc<LayerWeights<B>>> {
        model.layer(l)
    }
}

/// Prefills `input` on top of `state` through every layer, with the model's own weights
/// ([`ModelWeights`]); see [`prefill_with`].
pub fn prefill<B: Backend>(
    model: &Model<B>,
    state: &mut HandoffState,
    input: PrefillInput<'_>,
    opts: &ExecOptions,
    on_layer: impl FnMut(LayerEvent<'_>) -> anyhow::Result<()>,
) -> anyhow::Result<PrefillOutput> {
    prefill_with(model, &mut ModelWeights, state, input, opts, on_layer)
}

/// A layer's attention cache on the backend.
enum Cache<B: Backend> {
    Kda(KdaStateBufs<B>),
    Mla(MlaLatentBufs<B>),
}

/// What one layer needs besides its weights, for the per-chunk halves.
struct LayerCtx<'a, B: Backend> {
    b: &'a B,
    d: &'a ModelDims,
    w: &'a LayerWeights<B>,
    l: usize,
    bank_before_attn: bool,
    bank_before_mlp: bool,
    kda_form: KdaForm,
    mla_form: MlaForm,
    park: bool,
}

/// A chunk between its attention and FFN sublayers.
struct Mid<B: Backend> {
    p_now: B::Buf,
    new_bank: Vec<B::Buf>,
    /// Normed FFN input.
    x2: B::Buf,
}

/// The attention sublayer of one chunk and the FFN's input (AttnRes mix, norm). Takes the
/// chunk's `P` out of `ch` ([`finish_chunk`] puts the new one back).
fn attn_half<B: Backend>(cx: &LayerCtx<'_, B>, ch: &mut ChunkResidual<B>, cache: &mut Cache<B>, mut trace: Option<&mut HiddenTrace>) -> anyhow::Result<Mid<B>> {
    let (b, d, w) = (cx.b, cx.d, cx.w);
    let mut bank: Vec<Held<'_, B>> = Vec::with_capacity(ch.bank.len() + 2);
    for s in &ch.bank {
        bank.push(s.get(b)?);
    }
    let mut new_bank: Vec<B::Buf> = Vec::new();
    let mut p = Some(std::mem::replace(&mut ch.p, Slot::Taken).take(b)?);

    let hmix = mix(b, &bank, p.as_ref().unwrap(), &w.attn_res.norm, &w.attn_res.proj, d.eps)?;
    let x = b.rms_norm(hmix.as_ref().unwrap_or(p.as_ref().unwrap()), &w.input_layernorm, d.eps)?;
    if let Some(t) = trace.as_mut() {
        t.attn_in.push(last_row(b, hmix.as_ref().unwrap_or(p.as_ref().unwrap()))?);
    }
    drop(hmix);
    if cx.bank_before_attn {
        let banked = p.take().unwrap();
        new_bank.push(banked);
    }
    let u = match (&w.attn, cache) {
        (AttnWeights::Kda(kw), Cache::Kda(kc)) => kda_forward(b, kw, &x, kc, d, cx.kda_form)?,
        (AttnWeights::Mla(mw), Cache::Mla(mc)) => mla_forward(b, mw, &x, mc, d, cx.mla_form)?,
        _ => bail!("layer {}: weights and cache kinds differ", cx.l),
    };
    drop(x);
    if let Some(t) = trace.as_mut() {
        t.attn_out.push(last_row(b, &u)?);
    }
    let p_now = match p.take() {
        None => u,
        Some(mut p0) => {
            b.add_assign(&mut p0, &u)?;
            p0
        }
    };
    let h2 = {
        let mut all: Vec<&B::Buf> = bank.iter().map(|x| &**x).collect();
        all.extend(new_bank.iter());
        b.attn_res_mix(&all, &p_now, &w.mlp_res.norm, &w.mlp_res.proj, d.eps)?
    };
    if let Some(t) = trace.as_mut() {
        t.mlp_in.push(last_row(b, &h2)?);
    }
    let x2 = b.rms_norm(&h2, &w.post_attention_layernorm, d.eps)?;
    Ok(Mid { p_now, new_bank, x2 })
}

/// Adds the FFN output `m` of one chunk into its residual and stores the residual back in `ch`.
fn finish_chunk<B: Backend>(
    cx: &LayerCtx<'_, B>,
    ch: &mut ChunkResidual<B>,
    mid: Mid<B>,
    m: B::Buf,
    mut trace: Option<&mut HiddenTrace>,
) -> anyhow::Result<()> {
    let b = cx.b;
    let Mid { mut p_now, mut new_bank, x2 } = mid;
    drop(x2);
    if let Some(t) = trace.as_mut() {
        t.mlp_out.push(last_row(b, &m)?);
    }
    if cx.bank_before_mlp {
        new_bank.push(p_now);
        p_now = m;
    } else {
        b.add_assign(&mut p_now, &m)?;
    }
    if let Some(t) = trace.as_mut() {
        t.after_layer.push(last_row(b, &p_now)?);
    }
    for nb in new_bank {
        ch.bank.push(Slot::store(b, nb, cx.park)?);
    }
    ch.p = Slot::store(b, p_now, cx.park)?;
    Ok(())
}

/// Prefills `input` on top of `state` through every layer, taking each layer's weights from
/// `feed`; `state` is updated only when the whole call succeeds (an error leaves it as it was).
/// `on_layer` sees each layer's new state in layer order, once the next layer's work is issued
/// (its download overlaps that layer; the last one's after the output head); an error it
/// returns aborts the call. A weight pass of one request ([`prefill_many_with`]).
pub fn prefill_with<B: Backend>(
    model: &Model<B>,
    feed: &mut dyn WeightFeed<B>,
    state: &mut HandoffState,
    input: PrefillInput<'_>,
    opts: &ExecOptions,
    mut on_layer: impl FnMut(LayerEvent<'_>) -> anyhow::Result<()>,
) -> anyhow::Result<PrefillOutput> {
    let mut reqs = [PassRequest { state, input }];
    let mut out = prefill_many_with(model, feed, &mut reqs, opts, |_, ev| on_layer(ev))?;
    out.pop().expect("one result per request")
}

/// One request of a shared weight pass: its own state (session base) and new tokens.
pub struct PassRequest<'s, 'a> {
    pub state: &'s mut HandoffState,
    pub input: PrefillInput<'a>,
}

/// A request's progress through a pass.
struct InPass<B: Backend> {
    base: usize,
    n: usize,
    kda_form: KdaForm,
    mla_form: MlaForm,
    chunks: Vec<ChunkResidual<B>>,
    trace: Option<HiddenTrace>,
    new_layers: Vec<LayerState>,
    topk_gap: Vec<(usize, Vec<f32>)>,
    /// Wall seconds spent on each chunk so far.
    chunk_s: Vec<f64>,
    /// The hand-off state of the last layer done, on its way to the host (layer, state).
    handoff: Option<(usize, PendingState)>,
    /// Values per MLA latent row.
    mla_width: usize,
    /// Token-chunk steps of the current layer: (done, planned) ([`Cancelled`]).
    steps: (usize, usize),
}

/// A layer's new hand-off state on its way to the host ([`Backend::download_later`]).
enum PendingState {
    Kda(crate::model::kda::PendingKdaState),
    Mla(Box<dyn crate::backend::PendingDownload>),
}

/// Takes request `i`'s pending hand-off state (if any) and hands it to `on_layer`.
fn finish_handoff<B: Backend>(r: &mut InPass<B>, i: usize, on_layer: &mut impl FnMut(usize, LayerEvent<'_>) -> anyhow::Result<()>) -> anyhow::Result<()> {
    let Some((l, p)) = r.handoff.take() else { return Ok(()) };
    let layer_state = match p {
        PendingState::Kda(k) => LayerState::Kda(k.wait().with_context(|| format!("layer {l}: hand-off state download"))?),
        PendingState::Mla(m) => {
            LayerState::Mla(MlaState { width: r.mla_width, latent: m.wait().with_context(|| format!("layer {l}: hand-off state download"))? })
        }
    };
    on_layer(i, LayerEvent { layer: l, base_tokens: r.base, new_tokens: r.n, state: &layer_state }).with_context(|| format!("layer {l}: hand-off callback"))?;
    r.new_layers.push(layer_state);
    Ok(())
}

/// A request's residual chunks, built from its embeddings (checks the ids and the overrides).
fn enter_pass<B: Backend>(
    model: &Model<B>,
    feed: &mut dyn WeightFeed<B>,
    state: &HandoffState,
    input: PrefillInput<'_>,
    opts: &ExecOptions,
) -> anyhow::Result<InPass<B>> {
    let b = &*model.backend;
    let d = &model.dims;
    let h = d.hidden;
    let n = input.tokens.len();
    ensure!(n > 0, "prefill: no new tokens");
    state.check(&model.cfg).context("prefill: the given hand-off state does not fit the model")?;
    let park = opts.park_on_host;

    // Embeddings: gathered on the backend by the weight feed where it can (no overrides), else on
    // the host with the overrides spliced in, then uploaded per chunk.
    if let Some((pos, id)) = input.tokens.iter().enumerate().find(|(_, &id)| id as usize >= d.vocab) {
        bail!("token id {id} at position {pos} is outside the vocabulary (size {})", d.vocab);
    }
    let mut host_emb: Option<Vec<f32>> = None;
    let host_embeddings = |input: &PrefillInput<'_>| -> anyhow::Result<Vec<f32>> {
        let mut emb = embed_parallel(model, input.tokens)?;
        if let Some(ov) = input.overrides {
            ensure!(ov.rows.len() == ov.positions.len() * h, "embedding overrides: {} values for {} positions of width {h}", ov.rows.len(), ov.positions.len());
            let mut seen = vec![false; n];
            for (i, &pos) in ov.positions.iter().enumerate() {
                ensure!(pos < n, "embedding override for position {pos}, but only {n} new tokens");
                ensure!(!seen[pos], "embedding override for position {pos} given twice");
                seen[pos] = true;
                emb[pos * h..(pos + 1) * h].copy_from_slice(&ov.rows[i * h..(i + 1) * h]);
            }
        }
        Ok(emb)
    };
    if input.overrides.is_some() {
        host_emb = Some(host_embeddings(&input)?);
    }
    let mut chunks: Vec<ChunkResidual<B>> = Vec::new();
    let mut row0 = 0;
    while row0 < n {
        let rows = opts.chunk_tokens.min(n - row0);
        let on_device = match host_emb {
            None => feed.embed(model, &input.tokens[row0..row0 + rows])?,
            Some(_) => None,
        };
        let p = match on_device {
            Some(p) => p,
            None => {
                if host_emb.is_none() {
                    host_emb = Some(host_embeddings(&input)?);
                }
                let emb = host_emb.as_ref().expect("set above");
                b.upload(&emb[row0 * h..(row0 + rows) * h], rows, h)?
            }
        };
        chunks.push(ChunkResidual { rows, bank: Vec::new(), p: Slot::store(b, p, park)? });
        row0 += rows;
    }
    let trace = match opts.trace_last {
        false => None,
        true => Some(HiddenTrace {
            embed: match &host_emb {
                Some(emb) => emb[(n - 1) * h..].to_vec(),
                None => model.embed_rows(&input.tokens[n - 1..])?,
            },
            ..Default::default()
        }),
    };
    Ok(InPass {
        base: state.tokens,
        n,
        kda_form: opts.kda_form.unwrap_or(if n == 1 { KdaForm::Recurrent } else { KdaForm::Chunked }),
        mla_form: opts.mla_form.unwrap_or(if n == 1 { MlaForm::Absorbed } else { MlaForm::Expanded }),
        chunk_s: vec![0.0; chunks.len()],
        chunks,
        trace,
        new_layers: Vec::with_capacity(model.plan.len()),
        topk_gap: Vec::new(),
        handoff: None,
        mla_width: d.mla.latent(),
        steps: (0, 0),
    })
}

/// A request's attention cache for layer `l`, from its state before the pass.
fn layer_cache<B: Backend>(model: &Model<B>, state: &HandoffState, r: &InPass<B>, l: usize, attn: AttnKind) -> anyhow::Result<Cache<B>> {
    let (b, d) = (&*model.backend, &model.dims);
    Ok(match (&state.layers[l], attn) {
        (LayerState::Kda(s), AttnKind::Kda) => Cache::Kda(KdaStateBufs::upload(b, s, d)?),
        (LayerState::Mla(s), AttnKind::Mla) => {
            let mut latent = b.zeros(r.base + r.n, d.mla.latent())?;
            if r.base > 0 {
                b.write_rows(&mut latent, 0, &b.upload(&s.latent, r.base, d.mla.latent())?)?;
            }
            Cache::Mla(MlaLatentBufs { latent, rows: r.base })
        }
        _ => bail!("layer {l}: the hand-off state's kind differs from the model's {attn:?} layer"),
    })
}

/// Output head of one request: the logits rows `opts.logits` asks for (and the trace's last mix).
fn head_rows<B: Backend>(model: &Model<B>, head: &HeadWeights<B>, r: &mut InPass<B>, opts: &ExecOptions) -> anyhow::Result<(Vec<f32>, usize)> {
    let (b, d) = (&*model.backend, &model.dims);
    let mut logits = Vec::new();
    let mut logits_rows = 0;
    let nchunks = r.chunks.len();
    for (ci, ch) in r.chunks.iter().enumerate() {
        let is_last = ci + 1 == nchunks;
        let want = match opts.logits {
            LogitsRows::All => true,
            LogitsRows::Last => is_last,
            LogitsRows::None => false,
        };
        if !want && (!is_last || r.trace.is_none()) {
            continue;
        }
        let mut bank: Vec<Held<'_, B>> = Vec::with_capacity(ch.bank.len());
        for s in &ch.bank {
            bank.push(s.get(b)?);
        }
        let p = ch.p.get(b)?;
        #[cfg(feature = "test-knobs")]
        let skip_output_mix = model.misread.skip_output_mix;
        #[cfg(not(feature = "test-knobs"))]
        let skip_output_mix = false;
        let z = if skip_output_mix {
            b.slice_rows(&p, 0, ch.rows)?
        } else {
            let refs: Vec<&B::Buf> = bank.iter().map(|x| &**x).collect();
            b.attn_res_mix(&refs, &p, &head.output_res.norm, &head.output_res.proj, d.eps)?
        };
        let zn = b.rms_norm(&z, &head.norm, d.eps)?;
        if let (Some(t), true) = (r.trace.as_mut(), is_last) {
            t.final_mix = last_row(b, &z)?;
            t.final_normed = last_row(b, &zn)?;
        }
        if !want {
            continue;
        }
        let zn = if opts.logits == LogitsRows::Last { b.slice_rows(&zn, ch.rows - 1, 1)? } else { zn };
        let lg = b.gemm(&zn, &head.lm_head)?;
        logits_rows += lg.rows();
        logits.extend(b.download(&lg)?);
    }
    Ok((logits, logits_rows))
}

/// A **shared weight pass**: prefills every request of `reqs` in one sweep over the layers —
/// each layer's weights are taken from `feed` once and serve all of them — while each request
/// keeps its own tokens, positions, session base and state. Each request computes exactly what
/// [`prefill_with`] would compute for it alone (the same ops in the same order on its own
/// buffers; only the routed experts of a latent-MoE layer run as one backend call over every
/// request's token chunks, which is position-wise), so the results are those of separate runs.
///
/// `on_layer(i, event)` sees request `i`'s state of each layer as soon as the layer is done.
/// A request whose input is refused, whose compute fails or whose callback returns an error
/// drops out of the pass with that error and its state untouched; the others go on. The outer
/// error is the pass's own (the weight feed, the routed experts over all requests): then no
/// state changed. On success each request's state holds its new tokens.
pub fn prefill_many_with<B: Backend>(
    model: &Model<B>,
    feed: &mut dyn WeightFeed<B>,
    reqs: &mut [PassRequest<'_, '_>],
    opts: &ExecOptions,
    mut on_layer: impl FnMut(usize, LayerEvent<'_>) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<anyhow::Result<PrefillOutput>>> {
    let b = &*model.backend;
    let d = &model.dims;
    ensure!(opts.chunk_tokens > 0, "prefill: chunk_tokens is 0");
    let park = opts.park_on_host;

    let mut errors: Vec<Option<anyhow::Error>> = (0..reqs.len()).map(|_| None).collect();
    let mut pass: Vec<Option<InPass<B>>> = Vec::with_capacity(reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        match enter_pass(model, feed, &*r.state, r.input, opts) {
            Ok(p) => pass.push(Some(p)),
            Err(e) => {
                errors[i] = Some(e);
                pass.push(None);
            }
        }
    }
    // Drops request `i` out of the pass with `e`.
    fn drop_out<B: Backend>(pass: &mut [Option<InPass<B>>], errors: &mut [Option<anyhow::Error>], i: usize, e: anyhow::Error) {
        pass[i] = None;
        errors[i] = Some(e);
    }
    // Runs `step(cx, chunk, trace)` over request `i`'s token chunks `cr` in order (the trace
    // with the request's last chunk only), adding each chunk's wall time to the request. The
    // first error drops the request out of the pass: then, as for a request no longer in the
    // pass, `false`.
    // A cancelled request (`cancel`) stops before its next chunk with [`Cancelled`].
    fn each_chunk<'a, B: Backend + 'a>(
        pass: &mut [Option<InPass<B>>],
        errors: &mut [Option<anyhow::Error>],
        i: usize,
        cr: std::ops::Range<usize>,
        cancel: Option<&CancelRef>,
        cx_of: &impl Fn(&InPass<B>) -> LayerCtx<'a, B>,
        mut step: impl FnMut(&LayerCtx<'a, B>, &mut ChunkResidual<B>, Option<&mut HiddenTrace>) -> anyhow::Result<()>,
    ) -> bool {
        let Some(r) = pass[i].as_mut() else { return false };
        let cx = cx_of(r);
        let nchunks = r.chunks.len();
        let InPass { chunks, trace, chunk_s, steps, .. } = r;
        let res = chunks.iter_mut().enumerate().skip(cr.start).take(cr.end.saturating_sub(cr.start)).try_for_each(|(ci, ch)| {
            if cancel.is_some_and(|c| c.cancelled(i)) {
                return Err(anyhow::Error::new(Cancelled { layer: cx.l, done: steps.0, of: steps.1 }));
            }
            let tc = Instant::now();
            step(&cx, ch, trace.as_mut().filter(|_| ci + 1 == nchunks))?;
            chunk_s[ci] += tc.elapsed().as_secs_f64();
            steps.0 += 1;
            anyhow::Ok(())
        });
        match res {
            Ok(()) => true,
            Err(e) => {
                let e = if e.is::<Cancelled>() { e } else { e.context(format!("layer {}", cx.l)) };
                drop_out(pass, errors, i, e);
                false
            }
        }
    }
    // The expert windows of the pass, fixed at its start from the requests' lengths (a request
    // that drops out leaves its chunks' places empty, so a streamed layer's experts still come
    // once per window).
    let windows = expert_windows(&reqs.iter().map(|r| r.input.tokens.len()).collect::<Vec<_>>(), opts);

    for (l, spec) in model.plan.iter().enumerate() {
        if pass.iter().all(Option::is_none) {
            break;
        }
        let w = feed.layer(model, l)?;
        let span = tracing::debug_span!("layer", l, attn = ?spec.attn, ffn = ?spec.ffn, requests = pass.iter().flatten().count());
        let _g = span.enter();
        // the bank boundary before this layer's attention (spec §3.1); a planted misread moves it
        // to sublayer boundaries
        let (bank_before_attn, bank_before_mlp) = (spec.bank_boundary, false);
        #[cfg(feature = "test-knobs")]
        let (bank_before_attn, bank_before_mlp) = match model.misread.bank_boundary_sublayers {
            true => ((2 * l) % d.block == 0, (2 * l + 1) % d.block == 0),
            false => (bank_before_attn, bank_before_mlp),
        };
        let cx_of = |r: &InPass<B>| LayerCtx { b, d, w: &w, l, bank_before_attn, bank_before_mlp, kda_form: r.kda_form, mla_form: r.mla_form, park };

        let mut caches: Vec<Option<Cache<B>>> = Vec::with_capacity(pass.len());
        for i in 0..pass.len() {
            let c = match &pass[i] {
                Some(r) => match layer_cache(model, &*reqs[i].state, r, l, spec.attn) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        drop_out(&mut pass, &mut errors, i, e);
                        None
                    }
                },
                None => None,
            };
            caches.push(c);
        }
        let mut gaps: Vec<Vec<f32>> = vec![Vec::new(); pass.len()];
        let total_chunks: usize = pass.iter().flatten().map(|r| r.chunks.len()).sum();
        let windowed = matches!(&w.ffn, FfnWeights::LatentMoe(mw) if mw.experts.is_none() || (total_chunks > 1 && windows.len() < total_chunks) || opts.moe_observer.is_some());
        // With a cancel check on a synchronous backend, resident routed experts run one token
        // chunk at a time (what the backend's default `moe_experts_many` does), so that a
        // cancel is seen between chunks there too.
        let cancel = opts.cancel.as_ref();
        let experts_per_chunk = windowed
            && cancel.is_some()
            && b.synchronous()
            && opts.moe_observer.is_none()
            && matches!(&w.ffn, FfnWeights::LatentMoe(mw) if mw.experts.is_some());
        for r in pass.iter_mut().flatten() {
            let per_chunk = if experts_per_chunk {
                3
            } else if windowed {
                2
            } else {
                1
            };
            r.steps = (0, per_chunk * r.chunks.len());
        }
        match &w.ffn {
            FfnWeights::LatentMoe(mw) if windowed => {
                // Per expert window (consecutive token chunks of the pass, every request's in
                // order): every chunk's front first, then the routed experts of the window's
                // chunks, then the backs. Streamed experts come in chunks, each over all the
                // window's token chunks (they cross PCIe once per window); resident ones run once
                // over the window (a backend may share work between chunks: the CUDA dense path
                // dequantises each expert group once). Routed experts are position-wise, so the
                // results equal chunk-by-chunk order whatever the windows.
                for win in &windows {
                    let mut mids: Vec<Vec<Mid<B>>> = (0..pass.len()).map(|_| Vec::new()).collect();
                    let mut fronts: Vec<Vec<crate::model::ffn::MoeFront<B>>> = (0..pass.len()).map(|_| Vec::new()).collect();
                    for &(i, c0, c1) in win {
                        let Some(cache) = caches[i].as_mut() else { continue };
                        let (gaps_i, mids_i, fronts_i) = (&mut gaps[i], &mut mids[i], &mut fronts[i]);
                        let ok = each_chunk(&mut pass, &mut errors, i, c0..c1, cancel, &cx_of, |cx, ch, trace| {
                            let mid = attn_half(cx, ch, cache, trace)?;
                            let f = latent_moe_front(b, mw, &mid.x2, d)?;
                            gaps_i.extend_from_slice(&f.routing.gap);
                            mids_i.push(mid);
                            fronts_i.push(f);
                            Ok(())
                        });
                        if !ok {
                            mids[i].clear();
                            fronts[i].clear();
                        }
                    }
                    // a request that dropped out in this window: none of its chunks go on
                    for i in 0..pass.len() {
                        if pass[i].is_none() {
                            mids[i].clear();
                            fronts[i].clear();
                        }
                    }
                    let mut inputs: Vec<(&B::Buf, &Routing)> = fronts.iter().flatten().map(|f| (&f.x_lat, &f.routing)).collect();
                    let n_inputs = inputs.len();
                    // Calibration: one more input per chunk, the per-slot flattened one (same pass).
                    let slots = match &opts.moe_observer {
                        Some(_) => {
                            fronts.iter().flatten().map(|f| crate::calibrate::slot_inputs(b, &f.x_lat, &f.routing)).collect::<anyhow::Result<Vec<_>>>()?
                        }
                        None => Vec::new(),
                    };
                    inputs.extend(slots.iter().map(|(x, r)| (x, r)));
                    let te = Instant::now();
                    // requests cancelled during the routed experts (their outputs are left out)
                    let mut cancelled_here: Vec<(usize, Cancelled)> = Vec::new();
                    let mut outs = match &mw.experts {
                        Some(_) if inputs.is_empty() => Ok(Vec::new()),
                        Some(ex) if experts_per_chunk => {
                            let mut all = Vec::with_capacity(inputs.len());
                            let mut k = 0;
                            for (i, f) in fronts.iter().enumerate() {
                                let mine = &inputs[k..k + f.len()];
                                k += f.len();
                                let mut got = Vec::with_capacity(mine.len());
                                for inp in mine {
                                    let Some(r) = pass[i].as_mut() else { break };
                                    if cancel.is_some_and(|c| c.cancelled(i)) {
                                        cancelled_here.push((i, Cancelled { layer: l, done: r.steps.0, of: r.steps.1 }));
                                        break;
                                    }
                                    got.extend(
                                        b.moe_experts_many(std::slice::from_ref(inp), ex, d.situ).with_context(|| format!("layer {l}: routed experts"))?,
                                    );
                                    r.steps.0 += 1;
                                }
                                if got.len() == mine.len() {
                                    all.extend(got);
                                }
                            }
                            Ok(all)
                        }
                        Some(ex) => b.moe_experts_many(&inputs, ex, d.situ),
                        None => feed.experts_in_chunks(model, l, &inputs),
                    }
                    .with_context(|| format!("layer {l}: routed experts"))?;
                    let left_out: usize = cancelled_here.iter().map(|(i, _)| fronts[*i].len()).sum();
                    ensure!(
                        outs.len() + left_out == inputs.len(),
                        "layer {l}: the weight feed returned {} expert outputs for {} inputs",
                        outs.len(),
                        inputs.len() - left_out
                    );
                    if let Some(obs) = &opts.moe_observer {
                        for (f, y) in fronts.iter().flatten().zip(outs.split_off(n_inputs)) {
                            obs.0.observe(l, &f.routing, &crate::calibrate::slot_norms(b, &y)?).with_context(|| format!("layer {l}: MoE observer"))?;
                        }
                    }
                    drop(inputs);
                    drop(slots);
                    let mut counts: Vec<usize> = fronts.iter().map(Vec::len).collect();
                    drop(fronts);
                    for (i, c) in cancelled_here {
                        counts[i] = 0;
                        mids[i].clear();
                        drop_out(&mut pass, &mut errors, i, anyhow::Error::new(c));
                    }
                    // The experts' time, shared by the window's rows.
                    let expert_s = te.elapsed().as_secs_f64();
                    let rows_all: usize = win
                        .iter()
                        .filter(|w| pass[w.0].is_some())
                        .map(|&(i, c0, c1)| pass[i].as_ref().map_or(0, |r| r.chunks[c0..c1].iter().map(|c| c.rows).sum::<usize>()))
                        .sum();
                    for &(i, c0, c1) in win {
                        let Some(r) = pass[i].as_mut() else { continue };
                        for ci in c0..c1 {
                            r.chunk_s[ci] += expert_s * r.chunks[ci].rows as f64 / rows_all.max(1) as f64;
                        }
                    }
                    let mut outs = outs.into_iter();
                    let mut mids: Vec<std::vec::IntoIter<Mid<B>>> = mids.into_iter().map(Vec::into_iter).collect();
                    let mut youts: Vec<std::vec::IntoIter<B::Buf>> = counts.iter().map(|&n| outs.by_ref().take(n).collect::<Vec<_>>().into_iter()).collect();
                    for &(i, c0, c1) in win {
                        if counts[i] == 0 {
                            continue;
                        }
                        // one front, hence one middle and one expert output, per chunk of the window
                        let (mids_i, youts_i) = (&mut mids[i], &mut youts[i]);
                        each_chunk(&mut pass, &mut errors, i, c0..c1, cancel, &cx_of, |cx, ch, trace| {
                            let mid = mids_i.next().context("a chunk without a middle")?;
                            let y = youts_i.next().context("a chunk without routed-expert output")?;
                            let m = latent_moe_back(b, mw, &mid.x2, y, d)?;
                            finish_chunk(cx, ch, mid, m, trace)
                        });
                    }
                }
            }
            ffn => {
                for i in 0..pass.len() {
                    let Some(cache) = caches[i].as_mut() else { continue };
                    let gaps_i = &mut gaps[i];
                    let nc = pass[i].as_ref().map_or(0, |r| r.chunks.len());
                    each_chunk(&mut pass, &mut errors, i, 0..nc, cancel, &cx_of, |cx, ch, mut trace| {
                        let mid = attn_half(cx, ch, cache, trace.as_deref_mut())?;
                        let m = match ffn {
                            FfnWeights::Dense(mw) => mlp_forward(b, mw, &mid.x2, d)?,
                            FfnWeights::LatentMoe(mw) => {
                                let (y, routing) = latent_moe_forward(b, mw, &mid.x2, d)?;
                                gaps_i.extend_from_slice(&routing.gap);
                                y
                            }
                        };
                        finish_chunk(cx, ch, mid, m, trace)
                    });
                }
            }
        }
        feed.layer_done(model, l)?;
        drop(w);
        for (i, cache) in caches.into_iter().enumerate() {
            let (Some(r), Some(cache)) = (pass[i].as_mut(), cache) else { continue };
            if spec.ffn == FfnKind::LatentMoe {
                r.topk_gap.push((l, std::mem::take(&mut gaps[i])));
            }
            let (base, n) = (r.base, r.n);
            // The previous layer's hand-off state, whose download was started a layer ago (the
            // host did not wait for the device to reach it), then this layer's download started.
            let res = finish_handoff(r, i, &mut on_layer).and_then(|()| {
                r.handoff = Some(match cache {
                    Cache::Kda(kc) => (l, PendingState::Kda(kc.download_later(b, d)?)),
                    Cache::Mla(mc) => (l, PendingState::Mla(b.download_later(b.slice_rows(&mc.latent, base, n)?)?)),
                });
                Ok(())
            });
            if let Err(e) = res {
                drop_out(&mut pass, &mut errors, i, e);
            }
        }
        tracing::debug!(l, "layer done");
    }

    // Output head: output AttnRes mix, final norm, lm_head.
    let mut outputs: Vec<Option<PrefillOutput>> = (0..pass.len()).map(|_| None).collect();
    if pass.iter().any(Option::is_some) {
        let head = feed.head(model)?;
        for i in 0..pass.len() {
            let Some(r) = pass[i].as_mut() else { continue };
            match head_rows(model, &head, r, opts) {
                Ok((logits, logits_rows)) => {
                    let (topk_gap, trace) = (std::mem::take(&mut r.topk_gap), r.trace.take());
                    let chunk_seconds = r.chunks.iter().map(|c| c.rows).zip(r.chunk_s.iter().copied()).collect();
                    outputs[i] = Some(PrefillOutput { logits, logits_rows, vocab: d.vocab, topk_gap, trace, chunk_seconds });
                }
                Err(e) => drop_out(&mut pass, &mut errors, i, e.context("output head")),
            }
        }
    }

    // The last layer's hand-off states.
    for i in 0..pass.len() {
        let Some(r) = pass[i].as_mut() else { continue };
        if let Err(e) = finish_handoff(r, i, &mut on_layer) {
            drop_out(&mut pass, &mut errors, i, e);
        }
    }

    // Commit each finished request's new state.
    let mut results = Vec::with_capacity(reqs.len());
    for (i, ((req, r), out)) in reqs.iter_mut().zip(pass).zip(outputs).enumerate() {
        match (r, out, errors[i].take()) {
            (Some(r), Some(out), None) => {
                for (l, ns) in r.new_layers.into_iter().enumerate() {
                    match (&mut req.state.layers[l], ns) {
                        (LayerState::Mla(old), LayerState::Mla(new)) => old.latent.extend_from_slice(&new.latent),
                        (slot, ns) => *slot = ns,
                    }
                }
                req.state.tokens = r.base + r.n;
                results.push(Ok(out));
            }
            (_, _, Some(e)) => results.push(Err(e)),
            _ => results.push(Err(anyhow::anyhow!("prefill: the request left the pass without a result"))),
        }
    }
    Ok(results)
}

/// [`Model::embed_rows`] over blocks of tokens on the rayon pool (a long prompt's rows are
/// gigabytes of bf16 → f32 conversion); the same values, in order.
fn embed_parallel<B: Backend>(model: &Model<B>, ids: &[u32]) -> anyhow::Result<Vec<f32>> {
    use rayon::prelude::*;
    const BLOCK: usize = 1024;
    if ids.len() <= BLOCK {
        return model.embed_rows(ids);
    }
    let (h, vocab) = (model.dims.hidden, model.dims.vocab);
    if let Some((pos, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        bail!("token id {id} at position {pos} is outside the vocabulary (size {vocab})");
    }
    let mut out = vec![0f32; ids.len() * h];
    out.par_chunks_mut(BLOCK * h).zip(ids.par_chunks(BLOCK)).enumerate().try_for_each(|(i, (dst, blk))| -> anyhow::Result<()> {
        let rows = model.embed_rows(blk).with_context(|| format!("embedding tokens {}..{}", i * BLOCK, i * BLOCK + blk.len()))?;
        dst.copy_from_slice(&rows);
        Ok(())
    })?;
    Ok(out)
}

/// One decode step: feeds `token` at position `state.tokens` (recurrent KDA, absorbed MLA) and
/// returns the next-token logits `[vocab]`.
pub fn decode_step<B: Backend>(model: &Model<B>, state: &mut HandoffState, token: u32) -> anyhow::Result<Vec<f32>> {
    let opts = ExecOptions { logits: LogitsRows::Last, ..Default::default() };
    Ok(prefill(model, state, PrefillInput::tokens(&[token]), &opts, |_| Ok(()))?.logits)
}

/// Greedy continuation: `first` is fed, then each argmax, for `steps` tokens in all; returns
/// the fed tokens and the logits after each.
pub fn greedy<B: Backend>(model: &Model<B>, state: &mut HandoffState, first: u32, steps: usize) -> anyhow::Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut tokens = Vec::with_capacity(steps);
    let mut all = Vec::with_capacity(steps);
    let mut tok = first;
    for _ in 0..steps {
        tokens.push(tok);
        let lg = decode_step(model, state, tok)?;
        tok = argmax(&lg).context("decode: logits are all NaN")? as u32;
        all.push(lg);
    }
    Ok((tokens, all))
}

/// The routed-expert windows of a pass of requests of `new_tokens` each under `opts`
/// ([`ExecOptions::expert_window_tokens`]): `(request, first chunk, end chunk)` lists, in order.
/// The weight feed streams a layer's experts once per window.
pub fn expert_windows(new_tokens: &[usize], opts: &ExecOptions) -> Vec<Vec<(usize, usize, usize)>> {
    let rows: Vec<Vec<usize>> = new_tokens.iter().map(|&n| crate::memory_plan::chunk_rows(n, opts.chunk_tokens)).collect();
    let w = match opts.expert_window_tokens {
        Some(w) => w,
        None if opts.park_on_host => 1,
        None => usize::MAX,
    };
    crate::memory_plan::windows_of(&rows, w)
}

/// Bytes a request of `n` new tokens after `base` holds during a weight pass besides the
/// weights: its residual (the AttnRes bank and `P` of every new token, at most one bank entry
/// per block of layers) and the largest per-layer attention cache (the MLA latent rows of the
/// whole context). What a shared pass budgets per request.
pub fn pass_request_bytes(dims: &ModelDims, layers: usize, base: usize, n: usize) -> u64 {
    let residual = (layers.div_ceil(dims.block.max(1)) + 2) * n * dims.hidden * 4;
    let latent = (base + n) * dims.mla.latent() * 4;
    (residual + latent) as u64
}
