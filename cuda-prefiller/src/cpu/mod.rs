//! The CPU reference backend: f32 (f64 inside the KDA recurrence, norms and softmaxes),
//! multi-threaded with rayon. Every op is also a plain `pub fn` on slices in the submodules —
//! the references the CUDA kernels are tested against.

pub mod attn_res;
pub mod conv;
pub mod gemm;
pub mod kda;
pub mod mla;
pub mod moe;
pub mod norm;

use anyhow::{bail, ensure};

use crate::backend::{Backend, DeviceBuf, ExpertHostWeights, HostTensor, KdaDims, KdaInputs, MlaDims, MlaForm, OpResult, Routing, SituBetas};

/// A row-major f32 matrix in host memory: the CPU backend's buffers and weights.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    pub fn new(data: Vec<f32>, rows: usize, cols: usize) -> OpResult<Self> {
        ensure!(data.len() == rows * cols, "buffer of {} values is not [{rows}, {cols}]", data.len());
        Ok(CpuTensor { rows, cols, data })
    }
}

impl DeviceBuf for CpuTensor {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

/// One MoE layer's experts, dequantised to f32 at load time.
pub struct CpuExperts {
    pub experts: Vec<moe::DenseExpert>,
}

/// The CPU reference backend (no state but its arithmetic; threads come from rayon's global
/// pool). `CpuBackend` (the value) is the f32 reference; [`CpuBackend::mx`] emulates K3's MX
/// precision (`--precision mx`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CpuBackend {
    /// MXFP8 quantise–dequantise of the routed experts' inputs and SiTU outputs (their weights
    /// are MXFP4 already): MXFP4 × MXFP8 expert GEMMs, everything else f32.
    mx: bool,
}

/// The f32 reference backend as a value, under the type's own name: the many callers that
/// want the reference write `CpuBackend`, as when the type was a unit struct.
#[allow(non_upper_case_globals)]
pub const CpuBackend: CpuBackend = CpuBackend { mx: false };

impl CpuBackend {
    /// The MX emulation: the oracle of the FP8 kernels, and `forward --backend cpu --precision mx`.
    pub const fn mx() -> CpuBackend {
        CpuBackend { mx: true }
    }

    /// Whether this backend emulates MX.
    pub fn is_mx(&self) -> bool {
        self.mx
    }
}

fn same_shape(op: &str, a: &CpuTensor, b: &CpuTensor) -> OpResult<()> {
    ensure!(a.rows == b.rows && a.cols == b.cols, "{op}: shapes differ: [{}, {}] vs [{}, {}]", a.rows, a.cols, b.rows, b.cols);
    Ok(())
}

fn vec_len(op: &str, what: &str, w: &CpuTensor, n: usize) -> OpResult<()> {
    ensure!(w.data.len() == n, "{op}: {what} holds {} values, expected {n}", w.data.len());
    Ok(())
}

impl Backend for CpuBackend {
    type Buf = CpuTensor;
    type Weight = CpuTensor;
    type Experts = CpuExperts;
    type Parked = CpuTensor;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> OpResult<CpuTensor> {
        CpuTensor::new(data.to_vec(), rows, cols)
    }

    fn download(&self, x: &CpuTensor) -> OpResult<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn park(&self, x: CpuTensor) -> OpResult<CpuTensor> {
        Ok(x)
    }

    fn unpark(&self, p: &CpuTensor) -> OpResult<CpuTensor> {
        Ok(p.clone())
    }

    fn zeros(&self, rows: usize, cols: usize) -> OpResult<CpuTensor> {
        Ok(CpuTensor { rows, cols, data: vec![0.0; rows * cols] })
    }

    fn slice_rows(&self, x: &CpuTensor, row0: usize, n: usize) -> OpResult<CpuTensor> {
        ensure!(row0 + n <= x.rows, "slice_rows: rows {row0}..{} of a [{}, {}] buffer", row0 + n, x.rows, x.cols);
        Ok(CpuTensor { rows: n, cols: x.cols, data: x.data[row0 * x.cols..(row0 + n) * x.cols].to_vec() })
    }

    fn write_rows(&self, dst: &mut CpuTensor, row0: usize, src: &CpuTensor) -> OpResult<()> {
        ensure!(
            src.cols == dst.cols && row0 + src.rows <= dst.rows,
            "write_rows: [{}, {}] at row {row0} into [{}, {}]",
            src.rows,
            src.cols,
            dst.rows,
            dst.cols
        );
        dst.data[row0 * dst.cols..(row0 + src.rows) * dst.cols].copy_from_slice(&src.data);
        Ok(())
    }

    fn add_assign(&self, a: &mut CpuTensor, b: &CpuTensor) -> OpResult<()> {
        same_shape("add_assign", a, b)?;
        for (x, y) in a.data.iter_mut().zip(&b.data) {
            *x += y;
        }
        Ok(())
    }

    fn load_dense(&self, w: &HostTensor<'_>) -> OpResult<CpuTensor> {
        CpuTensor::new(w.to_f32()?, w.rows, w.cols)
    }

    fn load_experts(&self, experts: &[ExpertHostWeights<'_>]) -> OpResult<CpuExperts> {
        let mut out = Vec::with_capacity(experts.len());
        for (e, x) in experts.iter().enumerate() {
            let (inter, latent) = (x.w1.out_features, x.w1.in_features);
            ensure!(
                x.w3.out_features == inter && x.w3.in_features == latent && x.w2.out_features == latent && x.w2.in_features == inter,
                "expert {e}: w1 [{inter}, {latent}], w3 [{}, {}], w2 [{}, {}] do not form an MLP",
                x.w3.out_features,
                x.w3.in_features,
                x.w2.out_features,
                x.w2.in_features
            );
            out.push(moe::DenseExpert { inter, latent, w1: moe::dequant_mxfp4(&x.w1), w3: moe::dequant_mxfp4(&x.w3), w2: moe::dequant_mxfp4(&x.w2) });
        }
        Ok(CpuExperts { experts: out })
    }

    fn gemm(&self, x: &CpuTensor, w: &CpuTensor) -> OpResult<CpuTensor> {
        ensure!(x.cols == w.cols, "gemm: x [{}, {}] · Wᵀ with W [{}, {}]", x.rows, x.cols, w.rows, w.cols);
        Ok(CpuTensor { rows: x.rows, cols: w.rows, data: gemm::gemm(&x.data, x.rows, x.cols, &w.data, w.rows) })
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuTensor, eps: f32) -> OpResult<CpuTensor> {
        vec_len("rms_norm", "weight", w, x.cols)?;
        Ok(CpuTensor { rows: x.rows, cols: x.cols, data: norm::rms_norm(&x.data, x.cols, &w.data, eps) })
    }

    fn situ_glu(&self, gate: &CpuTensor, up: &CpuTensor, b: SituBetas) -> OpResult<CpuTensor> {
        same_shape("situ_glu", gate, up)?;
        Ok(CpuTensor { rows: gate.rows, cols: gate.cols, data: crate::act::situ_glu(&gate.data, &up.data, b.beta, b.linear_beta) })
    }

    fn sigmoid(&self, x: &CpuTensor) -> OpResult<CpuTensor> {
        Ok(CpuTensor { rows: x.rows, cols: x.cols, data: crate::act::sigmoid_all(&x.data) })
    }

    fn sigmoid_gate_mul(&self, a: &mut CpuTensor, gate: &CpuTensor) -> OpResult<()> {
        same_shape("sigmoid_gate_mul", a, gate)?;
        crate::act::sigmoid_gate_mul(&mut a.data, &gate.data);
        Ok(())
    }

    fn attn_res_mix(&self, bank: &[&CpuTensor], p: &CpuTensor, norm_w: &CpuTensor, proj_w: &CpuTensor, eps: f32) -> OpResult<CpuTensor> {
        for b in bank {
            same_shape("attn_res_mix", b, p)?;
        }
        vec_len("attn_res_mix", "norm weight", norm_w, p.cols)?;
        vec_len("attn_res_mix", "proj weight", proj_w, p.cols)?;
        let banks: Vec<&[f32]> = bank.iter().map(|b| &b.data[..]).collect();
        Ok(CpuTensor { rows: p.rows, cols: p.cols, data: attn_res::attn_res_mix(&banks, &p.data, p.cols, &norm_w.data, &proj_w.data, eps) })
    }

    fn short_conv_silu(&self, x: &CpuTensor, w: &CpuTensor, window: &mut CpuTensor) -> OpResult<CpuTensor> {
        ensure!(w.rows == x.cols && w.cols >= 2, "short_conv_silu: weight [{}, {}] for {} channels", w.rows, w.cols, x.cols);
        ensure!(
            window.rows == w.cols - 1 && window.cols == x.cols,
            "short_conv_silu: window [{}, {}], expected [{}, {}]",
            window.rows,
            window.cols,
            w.cols - 1,
            x.cols
        );
        let (y, nw) = conv::short_conv_silu(&x.data, x.cols, &w.data, w.cols, &window.data);
        window.data = nw;
        Ok(CpuTensor { rows: x.rows, cols: x.cols, data: y })
    }

    fn l2_norm_heads(&self, x: &mut CpuTensor, head_dim: usize, eps: f32, scale: f32) -> OpResult<()> {
        ensure!(head_dim > 0 && x.cols.is_multiple_of(head_dim), "l2_norm_heads: {} columns are not whole heads of {head_dim}", x.cols);
        norm::l2_norm_heads(&mut x.data, head_dim, eps, scale);
        Ok(())
    }

    fn kda_gate(&self, z: &CpuTensor, a_log: &CpuTensor, dt_bias: &CpuTensor, dims: KdaDims, lower_bound: Option<f32>) -> OpResult<CpuTensor> {
        ensure!(z.cols == dims.width(), "kda_gate: z has {} columns, expected {}", z.cols, dims.width());
        vec_len("kda_gate", "A_log (one per head)", a_log, dims.heads)?;
        vec_len("kda_gate", "dt_bias", dt_bias, dims.width())?;
        Ok(CpuTensor { rows: z.rows, cols: z.cols, data: kda::kda_gate(&z.data, &a_log.data, &dt_bias.data, dims.heads, dims.head_dim, lower_bound) })
    }

    fn kda_chunked(&self, x: &KdaInputs<'_, CpuTensor>, state: &mut CpuTensor, dims: KdaDims, chunk: usize) -> OpResult<CpuTensor> {
        x.check("kda_chunked", state, dims)?;
        ensure!(chunk > 0, "kda_chunked: chunk length 0");
        let (q, k, v, g, beta) = (&x.q.data, &x.k.data, &x.v.data, &x.g.data, &x.beta.data);
        let o = kda::kda_chunked(q, k, v, g, beta, &mut state.data, dims.heads, dims.head_dim, chunk);
        Ok(CpuTensor { rows: x.q.rows, cols: x.q.cols, data: o })
    }

    fn kda_recurrent(&self, x: &KdaInputs<'_, CpuTensor>, state: &mut CpuTensor, dims: KdaDims) -> OpResult<CpuTensor> {
        x.check("kda_recurrent", state, dims)?;
        let (q, k, v, g, beta) = (&x.q.data, &x.k.data, &x.v.data, &x.g.data, &x.beta.data);
        let o = kda::kda_recurrent(q, k, v, g, beta, &mut state.data, dims.heads, dims.head_dim);
        Ok(CpuTensor { rows: x.q.rows, cols: x.q.cols, data: o })
    }

    fn gated_rms_norm(&self, o: &CpuTensor, gate: &CpuTensor, w: &CpuTensor, head_dim: usize, eps: f32) -> OpResult<CpuTensor> {
        same_shape("gated_rms_norm", o, gate)?;
        ensure!(head_dim > 0 && o.cols.is_multiple_of(head_dim), "gated_rms_norm: {} columns are not whole heads of {head_dim}", o.cols);
        vec_len("gated_rms_norm", "weight", w, head_dim)?;
        Ok(CpuTensor { rows: o.rows, cols: o.cols, data: norm::gated_rms_norm(&o.data, &gate.data, &w.data, head_dim, eps) })
    }

    fn mla_latent(&self, kv: &CpuTensor, w: &CpuTensor, eps: f32, dims: MlaDims) -> OpResult<CpuTensor> {
        ensure!(kv.cols == dims.latent(), "mla_latent: kv has {} columns, expected {}", kv.cols, dims.latent());
        vec_len("mla_latent", "kv_a_layernorm weight", w, dims.kv_lora)?;
        Ok(CpuTensor { rows: kv.rows, cols: kv.cols, data: norm::mla_latent(&kv.data, dims.kv_lora, dims.rope, &w.data, eps) })
    }

    fn mla_attention(&self, q: &CpuTensor, cache: &CpuTensor, kv_b: &CpuTensor, dims: MlaDims, pos0: usize, form: MlaForm) -> OpResult<CpuTensor> {
        ensure!(q.cols == dims.heads * dims.qk(), "mla_attention: q has {} columns, expected {}", q.cols, dims.heads * dims.qk());
        ensure!(cache.cols == dims.latent(), "mla_attention: cache has {} columns, expected {}", cache.cols, dims.latent());
        ensure!(cache.rows >= pos0 + q.rows, "mla_attention: cache holds {} rows, queries reach position {}", cache.rows, pos0 + q.rows);
        ensure!(
            kv_b.rows == dims.heads * (dims.nope + dims.v) && kv_b.cols == dims.kv_lora,
            "mla_attention: kv_b [{}, {}], expected [{}, {}]",
            kv_b.rows,
            kv_b.cols,
            dims.heads * (dims.nope + dims.v),
            dims.kv_lora
        );
        // Only the causal context is read.
        let ctx = &cache.data[..(pos0 + q.rows) * cache.cols];
        let data = match form {
            MlaForm::Expanded => mla::mla_attention_expanded(&q.data, ctx, &kv_b.data, dims, pos0),
            MlaForm::Absorbed => mla::mla_attention_absorbed(&q.data, ctx, &kv_b.data, dims, pos0),
        };
        Ok(CpuTensor { rows: q.rows, cols: dims.heads * dims.v, data })
    }

    fn route(&self, logits: &CpuTensor, bias: &CpuTensor, top_k: usize, renormalize: bool, scaling: f32) -> OpResult<Routing> {
        vec_len("route", "correction bias", bias, logits.cols)?;
        if top_k == 0 || top_k > logits.cols {
            bail!("route: top_k = {top_k} with {} experts", logits.cols);
        }
        Ok(moe::route(&logits.data, logits.cols, &bias.data, top_k, renormalize, scaling))
    }

    fn moe_experts(&self, x_lat: &CpuTensor, routing: &Routing, experts: &CpuExperts, betas: SituBetas) -> OpResult<CpuTensor> {
        ensure!(routing.rows() == x_lat.rows, "moe_experts: routing for {} rows, x_lat has {}", routing.rows(), x_lat.rows);
        ensure!(routing.ids.len() == routing.rows() * routing.top_k && routing.weights.len() == routing.ids.len(), "moe_experts: malformed routing");
        if let Some(e) = routing.ids.iter().find(|&&e| e as usize >= experts.experts.len()) {
            bail!("moe_experts: expert id {e} but the layer has {} experts", experts.experts.len());
        }
        if let Some(f) = experts.experts.first() {
            ensure!(x_lat.cols == f.latent, "moe_experts: x_lat has {} columns, experts take {}", x_lat.cols, f.latent);
        }
        Ok(CpuTensor {
            rows: x_lat.rows,
            cols: x_lat.cols,
            data: moe::moe_experts(&x_lat.data, routing, &experts.experts, betas.beta, betas.linear_beta, self.mx),
        })
    }
}
