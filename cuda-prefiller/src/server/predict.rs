//! What a prefill node predicts for itself before it has served anything: the compute of a
//! request from the model's FLOPs ([`crate::model::flops`]) at the GEMM rate this backend
//! measures at start-up on the model's own shapes, and the weight pass from the weight bytes at
//! the source's rate (the emulated source's pacing, or for streamed weights the read rate and
//! pinned copy rate measured at start-up: `StreamedWeights::measure_feed`). Advertised as a
//! [`RateFit`] with `samples == 0` (predicted, not measured) until the first measured request
//! replaces it ([`super::cost::CostMeter`]).

use std::time::Instant;

use k3_protocol::config::TextConfig;
use k3_protocol::wire::{RateFit, RateSample};

use crate::backend::{Backend, HostTensor};
use crate::model::flops::prefill_flops;

/// The start-up measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StartupRates {
    /// Dense GEMM rate of the backend at `[chunk, hidden] · [hidden, 4·hidden]ᵀ`, FLOP/s.
    pub gemm_flops_per_s: f64,
    /// Seconds the measurement took.
    pub seconds: f64,
    /// Seconds a pass costs whatever its size (per-layer launches, the head); 0 from the GEMM
    /// timing alone, fitted by [`measure_model`].
    pub fixed_s: f64,
}

/// Times the backend's GEMM on the model's width (a few repeats after a warm-up, the median);
/// `None` when the backend refuses the shapes. Rows: the chunk (64 to 4,096). Each sample queues
/// products (enough to take ~10x a download, at most [`MAX_GEMMS_PER_SAMPLE`]) and downloads
/// the last; the download's own time, measured apart, is taken out (on a GPU one download of
/// the product takes many times the product itself).
pub fn measure<B: Backend>(b: &B, c: &TextConfig, chunk: usize) -> Option<StartupRates> {
    let t0 = Instant::now();
    let (m, k) = (chunk.clamp(64, 4096), c.hidden_size);
    let n = 4 * k;
    let x: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
    let w: Vec<f32> = (0..n * k).map(|i| ((i % 89) as f32 - 44.0) * 1e-3).collect();
    let xb = b.upload(&x, m, k).ok()?;
    let wb = b.load_dense(&HostTensor::from_f32("startup.gemm", n, k, &w)).ok()?;
    let flops = 2.0 * (m * n * k) as f64;
    let y = b.gemm(&xb, &wb).ok()?;
    b.download(&y).ok()?;
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let mut dl = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        b.download(&y).ok()?;
        dl.push(t.elapsed().as_secs_f64());
    }
    let download_s = median(dl);
    // products per sample: enough that they take ~10x the download (1 on the CPU, up to 64)
    let t = Instant::now();
    let y = b.gemm(&xb, &wb).ok()?;
    b.download(&y).ok()?;
    let one = (t.elapsed().as_secs_f64() - download_s).max(1e-6);
    let reps = ((10.0 * download_s / one).ceil() as usize).clamp(1, MAX_GEMMS_PER_SAMPLE);
    let mut times = Vec::new();
    // At least 5 samples and 50 ms of them (small models: one GEMM takes microseconds).
    while times.len() < 6 || (times.iter().sum::<f64>() < 0.05 && times.len() < 200) {
        let t = Instant::now();
        let mut y = b.gemm(&xb, &wb).ok()?;
        for _ in 1..reps {
            y = b.gemm(&xb, &wb).ok()?;
        }
        let _ = b.download(&y).ok()?;
        times.push((t.elapsed().as_secs_f64() - download_s).max(1e-9) / reps as f64);
    }
    times.remove(0);
    let med = median(times);
    (med > 0.0).then(|| StartupRates { gemm_flops_per_s: flops / med, seconds: t0.elapsed().as_secs_f64(), fixed_s: 0.0 })
}

/// At most this many GEMMs are queued per timed sample of [`measure`].
const MAX_GEMMS_PER_SAMPLE: usize = 64;

/// The compute fit predicted from the model's FLOPs at `rates` (fitted through the FLOPs of a
/// spread of request sizes and contexts, so the attention's growth with the context is in it),
/// marked as predicted (`samples` 0).
pub fn predicted_compute(c: &TextConfig, rates: &StartupRates) -> RateFit {
    let samples: Vec<RateSample> = [(64u64, 0u64), (512, 0), (2048, 0), (8192, 0), (512, 8192), (2048, 32768), (8192, 65536)]
        .iter()
        .map(|&(n, base)| RateSample {
            new_tokens: n,
            base_tokens: base,
            seconds: rates.fixed_s + prefill_flops(c, n as usize, base as usize) / rates.gemm_flops_per_s,
        })
        .collect();
    RateFit { samples: 0, ..RateFit::fit(&samples) }
}

/// With resident weights, the GEMM rate alone misses what the model spends outside its GEMMs
/// (norms, routing and expert gathers, the KDA recurrence, attention's softmax): on the CPU
/// backend with a tiny model the first measured pass took 3.3x the GEMM-only prediction. So the
/// node also prefills two scratch prompts through the whole model (32 and 256 tokens, after a
/// warm-up) and fits `fixed + FLOPs / rate` through them: the rate those passes reached on the
/// model's FLOPs (never above the GEMM rate) and what a pass costs whatever its size. Streamed
/// weights are not measured this way: a scratch pass would read every weight.
pub fn measure_model<B: Backend>(model: &crate::model::Model<B>, rates: &StartupRates, chunk: usize) -> Option<StartupRates> {
    let t0 = Instant::now();
    let c = &model.cfg;
    let vocab = c.vocab_size.max(2) as u32;
    let opts = crate::executor::ExecOptions { chunk_tokens: chunk.max(1), logits: crate::executor::LogitsRows::Last, ..Default::default() };
    let pass = |n: usize| -> Option<f64> {
        let ids: Vec<u32> = (0..n as u32).map(|i| 1 + (i * 7919) % (vocab - 1)).collect();
        let mut state = k3_protocol::handoff::HandoffState::empty(c);
        let t = Instant::now();
        crate::executor::prefill(model, &mut state, crate::executor::PrefillInput::tokens(&ids), &opts, |_| Ok(())).ok()?;
        Some(t.elapsed().as_secs_f64())
    };
    let (n1, n2) = (32usize, chunk.clamp(64, 256));
    pass(n2)?;
    let (t1, t2) = (pass(n1)?, pass(n2)?);
    let (f1, f2) = (prefill_flops(c, n1, 0), prefill_flops(c, n2, 0));
    // seconds per FLOP from the two sizes; when noise makes it non-positive, the larger pass alone
    let slope = if t2 > t1 { (t2 - t1) / (f2 - f1) } else { t2 / f2 };
    let fixed_s = (t2 - slope * f2).max(0.0);
    let effective = 1.0 / slope;
    (effective.is_finite() && effective > 0.0).then(|| StartupRates {
        gemm_flops_per_s: effective.min(rates.gemm_flops_per_s),
        seconds: rates.seconds + t0.elapsed().as_secs_f64(),
        fixed_s,
    })
}
