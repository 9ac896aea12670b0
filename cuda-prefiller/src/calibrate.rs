//! Expert calibration (`k3-prefill calibrate`, docs/pruning.md): the normal layer-major prefill
//! over a prompt set with a [`MoeObserver`] attached, accumulating per MoE layer and routed
//! expert the routing count, the gate weight and the REAP saliency (gate weight × ‖expert
//! output‖₂) into [`ExpertStats`].
//!
//! The executor reports, for every latent-MoE layer and token chunk, the routing and the L2 norm
//! of each routed slot's expert output. It gets those outputs by running the layer's experts
//! once more on a flattened input (one row per `(token, slot)`, top-1 routing with weight 1),
//! in the same call as the normal expert pass, so streamed experts still cross PCIe once; the
//! model's own outputs are untouched (calibration computes the same logits and states as a
//! plain prefill).

use std::sync::{Arc, Mutex};

use anyhow::Context;
use k3_protocol::prune::ExpertStats;

use crate::backend::{Backend, Routing};

/// Receives what calibration needs from each latent-MoE layer.
pub trait MoeObserver: Send + Sync {
    /// One token chunk of MoE layer `layer`: its routing and, for every routed slot
    /// (`[rows, top_k]`, the layout of `routing.ids`), the L2 norm of that expert's output.
    fn observe(&self, layer: usize, routing: &Routing, slot_norms: &[f32]) -> anyhow::Result<()>;
}

/// A shared observer in [`crate::executor::ExecOptions`] (compared by identity).
#[derive(Clone)]
pub struct MoeObserverRef(pub Arc<dyn MoeObserver>);

impl std::fmt::Debug for MoeObserverRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MoeObserverRef")
    }
}

impl PartialEq for MoeObserverRef {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.0), Arc::as_ptr(&other.0))
    }
}

/// The flattened expert input of one chunk: row `t·k + j` is `x_lat[t]`, routed to expert
/// `ids[t, j]` alone with weight 1, so the experts' output row `t·k + j` is that expert's raw
/// output for token `t`.
pub fn slot_inputs<B: Backend>(b: &B, x_lat: &B::Buf, routing: &Routing) -> anyhow::Result<(B::Buf, Routing)> {
    use crate::backend::DeviceBuf;
    let (rows, lat, k) = (x_lat.rows(), x_lat.cols(), routing.top_k);
    anyhow::ensure!(routing.rows() == rows, "calibration: routing for {} rows, x_lat has {rows}", routing.rows());
    let x = b.download(x_lat)?;
    let mut flat = Vec::with_capacity(rows * k * lat);
    for t in 0..rows {
        for _ in 0..k {
            flat.extend_from_slice(&x[t * lat..(t + 1) * lat]);
        }
    }
    let n = rows * k;
    let r = Routing { top_k: 1, ids: routing.ids.clone(), weights: vec![1.0; n], gap: vec![f32::INFINITY; n] };
    Ok((b.upload(&flat, n, lat)?, r))
}

/// Row L2 norms of the flattened experts' output (f64 accumulation).
pub fn slot_norms<B: Backend>(b: &B, y: &B::Buf) -> anyhow::Result<Vec<f32>> {
    use crate::backend::DeviceBuf;
    let cols = y.cols().max(1);
    Ok(b.download(y)?.chunks(cols).map(|r| r.iter().map(|&v| v as f64 * v as f64).sum::<f64>().sqrt() as f32).collect())
}

/// Accumulates observations into [`ExpertStats`].
pub struct StatsCollector {
    pub stats: Mutex<ExpertStats>,
}

impl StatsCollector {
    pub fn new(stats: ExpertStats) -> Arc<Self> {
        Arc::new(StatsCollector { stats: Mutex::new(stats) })
    }
    /// A copy of the statistics so far.
    pub fn snapshot(&self) -> ExpertStats {
        self.stats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    /// Replaces the statistics (restores a snapshot after a failed prompt).
    pub fn restore(&self, s: ExpertStats) {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }
}

impl MoeObserver for StatsCollector {
    fn observe(&self, layer: usize, routing: &Routing, slot_norms: &[f32]) -> anyhow::Result<()> {
        let mut s = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        let ls = s.layer_mut(layer).with_context(|| format!("calibration: layer {layer} is not a MoE layer of the statistics"))?;
        ls.add(routing.top_k, &routing.ids, &routing.weights, slot_norms)?;
        Ok(())
    }
}
