//! A KDA layer (spec §3.3): projections, short conv with its window, L2 norm, bounded decay
//! gate with `A_log` per head, β, the delta rule (chunked for prefill, recurrent for
//! decode), gated per-head RMSNorm, `o_proj`.

use k3_protocol::config::spec::{KDA_CHUNK, KDA_L2_EPS};
use k3_protocol::handoff::KdaState;

use super::weights::KdaWeights;
#[cfg(feature = "test-knobs")]
use super::weights::PlantedGate;
use super::ModelDims;
use crate::backend::{Backend, KdaInputs, PendingDownload};

/// Which form of the delta-rule recurrence to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdaForm {
    /// Chunked form (spec §3.4), chunk length 64.
    Chunked,
    /// Token-by-token recurrence (spec §3.3 step 7).
    Recurrent,
}

/// A KDA layer's carried state on the backend: `S [heads, k·v]`, conv windows `[K-1, H·D]`.
pub struct KdaStateBufs<B: Backend> {
    pub state: B::Buf,
    pub conv_q: B::Buf,
    pub conv_k: B::Buf,
    pub conv_v: B::Buf,
}

impl<B: Backend> KdaStateBufs<B> {
    /// Uploads a hand-off state.
    pub fn upload(b: &B, s: &KdaState, d: &ModelDims) -> anyhow::Result<Self> {
        let w = d.kda.width();
        let win = d.conv_kernel - 1;
        Ok(KdaStateBufs {
            state: b.upload(&s.recurrent, d.kda.heads, d.kda.head_dim * d.kda.head_dim)?,
            conv_q: b.upload(&s.conv_q, win, w)?,
            conv_k: b.upload(&s.conv_k, win, w)?,
            conv_v: b.upload(&s.conv_v, win, w)?,
        })
    }

    /// Starts the download into the canonical hand-off layout ([`PendingKdaState::wait`] takes
    /// it), without waiting for the device.
    pub fn download_later(self, b: &B, d: &ModelDims) -> anyhow::Result<PendingKdaState> {
        Ok(PendingKdaState {
            heads: d.kda.heads,
            head_dim: d.kda.head_dim,
            parts: [b.download_later(self.state)?, b.download_later(self.conv_q)?, b.download_later(self.conv_k)?, b.download_later(self.conv_v)?],
        })
    }

    /// Downloads into the canonical hand-off layout.
    pub fn download(&self, b: &B, d: &ModelDims) -> anyhow::Result<KdaState> {
        Ok(KdaState {
            heads: d.kda.heads,
            head_dim: d.kda.head_dim,
            recurrent: b.download(&self.state)?,
            conv_q: b.download(&self.conv_q)?,
            conv_k: b.download(&self.conv_k)?,
            conv_v: b.download(&self.conv_v)?,
        })
    }
}

/// A KDA layer's state on its way to the host ([`KdaStateBufs::download_later`]).
pub struct PendingKdaState {
    heads: usize,
    head_dim: usize,
    /// Recurrent state, conv windows q, k, v.
    parts: [Box<dyn PendingDownload>; 4],
}

impl PendingKdaState {
    pub fn wait(self) -> anyhow::Result<KdaState> {
        let [s, q, k, v] = self.parts;
        Ok(KdaState { heads: self.heads, head_dim: self.head_dim, recurrent: s.wait()?, conv_q: q.wait()?, conv_k: k.wait()?, conv_v: v.wait()? })
    }
}

/// The KDA block on normed input `x [rows, H]` → `[rows, H]`, advancing `cache`.
pub fn kda_forward<B: Backend>(b: &B, w: &KdaWeights<B>, x: &B::Buf, cache: &mut KdaStateBufs<B>, d: &ModelDims, form: KdaForm) -> anyhow::Result<B::Buf> {
    let dk = d.kda;
    // 1–2. projections, short causal conv + SiLU (windows hold pre-conv inputs); 4. for q and k
    // the L2 norm per head in the same op (q scaled by D^-1/2).
    let q_scale = 1.0 / (dk.head_dim as f32).sqrt();
    let q = b.short_conv_silu_l2(&b.gemm(x, &w.q_proj)?, &w.q_conv, &mut cache.conv_q, dk.head_dim, KDA_L2_EPS, q_scale)?;
    let k = b.short_conv_silu_l2(&b.gemm(x, &w.k_proj)?, &w.k_conv, &mut cache.conv_k, dk.head_dim, KDA_L2_EPS, 1.0)?;
    let v = b.short_conv_silu(&b.gemm(x, &w.v_proj)?, &w.v_conv, &mut cache.conv_v)?;
    // 5. decay gate from the low-rank f_a/f_b projection.
    let z = b.gemm(&b.gemm(x, &w.f_a)?, &w.f_b)?;
    let g = decay_gate(b, &z, w, d)?;
    // 6. write strength.
    let beta = b.sigmoid(&b.gemm(x, &w.b_proj)?)?;
    // 7. delta rule.
    let inputs = KdaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
    let o = match form {
        KdaForm::Chunked => b.kda_chunked(&inputs, &mut cache.state, dk, KDA_CHUNK)?,
        KdaForm::Recurrent => b.kda_recurrent(&inputs, &mut cache.state, dk)?,
    };
    // 8–9. gated per-head norm, output projection.
    let r = b.gemm(x, &w.g_proj)?;
    let o = b.gated_rms_norm(&o, &r, &w.o_norm, dk.head_dim, d.eps)?;
    b.gemm(&o, &w.o_proj)
}

/// Step 5's gate from `z`: the backend's per-head gate, or a planted misread's.
fn decay_gate<B: Backend>(b: &B, z: &B::Buf, w: &KdaWeights<B>, d: &ModelDims) -> anyhow::Result<B::Buf> {
    #[cfg(feature = "test-knobs")]
    if let Some(planted) = &w.planted_gate {
        return planted.gate(b, z, d);
    }
    b.kda_gate(z, &w.a_log, &w.dt_bias, d.kda, d.gate_lower_bound)
}

/// The gate as the planted misread of `A_log` computes it (see [`PlantedGate`]).
#[cfg(feature = "test-knobs")]
impl PlantedGate {
    fn gate<B: Backend>(&self, b: &B, z: &B::Buf, d: &ModelDims) -> anyhow::Result<B::Buf> {
        use crate::backend::DeviceBuf;
        let dk = d.kda;
        anyhow::ensure!(self.a_log.len() >= dk.head_dim, "A_log holds {} values, fewer than head_dim", self.a_log.len());
        let zh = b.download(z)?;
        let width = dk.width();
        let lb = d.gate_lower_bound.unwrap_or(-5.0);
        let g: Vec<f32> = zh
            .iter()
            .enumerate()
            .map(|(i, &zv)| {
                let c = i % width;
                let a = self.a_log[c % dk.head_dim].exp();
                lb * crate::act::sigmoid(a * (zv + self.dt_bias[c]))
            })
            .collect();
        b.upload(&g, z.rows(), z.cols())
    }
}
