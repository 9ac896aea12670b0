//! One prefiller: the model, where its weights come from (decided once: streamed through the
//! device slots, resident, or loaded per layer) and the memory plan of every pass
//! ([`crate::memory_plan`]). `forward`, `bench`, `serve` and `calibrate` open one and prefill
//! through it; the plan of a pass is made before any weight is read, so a prompt that cannot fit
//! the device budget and the host memory is refused up front ([`Prefiller::plan`]).
//!
//! `--emulate-gpu-memory GB` ([`MemoryOptions::emulate_gpu_memory`]) holds back the rest of a
//! larger GPU with one ballast allocation made before anything else, so that whatever goes
//! beyond GB fails as on the small card; the ballast is not counted as used.
//!
//! `--emulate-source-gbs GB/s` ([`PrefillerOptions::emulate_source_gbs`]) reads every pass's
//! weights as if from a source of that rate ([`crate::source_pace`]): a faster box measures what a
//! slower disk would do.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use k3_protocol::Checkpoint;

use crate::backend::Backend;
use crate::executor::{ExecOptions, LayerEvent, PassRequest, PrefillInput, PrefillOutput};
use crate::memory_plan::{BackendShape, Geometry, Knobs, Limits, LogitsKept, MemoryPlan, NoFit, PlanRequest, Slots, DEFAULT_MARGIN, HOST_MARGIN};
use crate::model::{Model, WeightPolicy};
use crate::source_pace::SourceRate;
use crate::streamer::{StreamOptions, StreamStats, StreamedWeights};

/// The memory flags (`--vram-budget`, `--host-memory`, `--emulate-gpu-memory`), in GB (10^9 bytes).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryOptions {
    /// Device bytes the whole pass may use (the limit itself: no margin is taken from it; at
    /// most the device's free memory). `None`: the free memory less [`DEFAULT_MARGIN`].
    pub vram_budget: Option<f64>,
    /// Host bytes the pass may use. `None`: the available memory less [`HOST_MARGIN`].
    pub host_memory: Option<f64>,
    /// CUDA: act as a card of this many GB (a ballast holds the rest).
    pub emulate_gpu_memory: Option<f64>,
}

fn gb_to_bytes(flag: &str, g: f64) -> Result<u64> {
    if !(g.is_finite() && g > 0.0) {
        bail!("{flag} {g}: expected a positive number of GB");
    }
    Ok((g * 1e9) as u64)
}

/// Where the weights come from, decided once for the node.
#[derive(Debug, Clone)]
pub enum WeightMode {
    /// CUDA: streamed per pass through the device slots the plan sizes.
    Streamed(StreamOptions),
    /// Every layer loaded once (small models; `bench --resident`).
    Resident,
    /// Each layer loaded when the executor reaches it (the CPU reference, CUDA `--sync-weights`).
    PerLayer,
}

/// How to open a [`Prefiller`].
#[derive(Debug, Clone)]
pub struct PrefillerOptions {
    pub weights: WeightMode,
    pub memory: MemoryOptions,
    /// `--chunk-tokens`: fixed instead of planned.
    pub chunk_tokens: Option<usize>,
    pub logits: LogitsKept,
    /// The passes the slots are sized for (`forward`: its prompt; `bench`: the longest length;
    /// `serve`: the longest prompt it should take): each `(session base, new tokens)`. A pass
    /// of these that fits nothing is refused here, before any weight is read. Empty: one
    /// prompt of the longest length that fits, at most `design_cap` tokens.
    pub design: Vec<PlanRequest>,
    pub design_cap: usize,
    /// `--emulate-source-gbs`: every pass reads the layers' weights no faster than this many GB/s.
    pub emulate_source_gbs: Option<f64>,
}

/// The memory-plan inputs of a node (cheap to clone; the serve worker keeps one).
#[derive(Debug, Clone)]
pub struct Planner {
    pub geometry: Geometry,
    pub shape: BackendShape,
    pub limits: Limits,
    pub knobs: Knobs,
}

impl Planner {
    /// The plan of a pass of `reqs`, or why it cannot fit (budget, host memory, longest prompt).
    pub fn plan(&self, reqs: &[PlanRequest]) -> Result<MemoryPlan, NoFit> {
        crate::memory_plan::plan(&self.geometry, &self.shape, reqs, self.limits, &self.knobs)
    }
    pub fn longest_prompt(&self) -> usize {
        crate::memory_plan::longest_prompt(&self.geometry, &self.shape, self.limits, &self.knobs)
    }
}

/// What a pass used: peak device memory (allocator high-water mark and the device's used
/// memory, the ballast not counted) and the host's peak resident memory, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct MemoryUse {
    pub device_allocated: u64,
    pub device_used: u64,
    pub host_peak: u64,
}

/// The model, its weight source and its memory plan.
pub struct Prefiller<B: Backend> {
    pub model: Arc<Model<B>>,
    pub streamed: Option<Arc<StreamedWeights>>,
    pub planner: Planner,
    /// The plan the node was opened with (its design passes).
    pub design_plan: MemoryPlan,
    /// The emulated weight source every pass reads from (`--emulate-source-gbs`).
    pub source: Option<SourceRate>,
    ballast: Option<crate::cuda::DevMem>,
}

/// Host memory available now (`MemAvailable`), bytes; `None` where it cannot be read.
pub fn host_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The process's peak resident memory since [`reset_host_peak`] (`VmHWM`), bytes.
pub fn host_peak() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Restarts the peak resident memory (`echo 5 > /proc/self/clear_refs`); best effort.
pub fn reset_host_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

impl<B: Backend + 'static> Prefiller<B> {
    /// Plans the design passes first (from the config alone: nothing is read from the shards
    /// before a pass is known to fit), then loads the model and its weight source with the slots
    /// and tables the plan chose.
    pub fn open(backend: Arc<B>, ck: Arc<Checkpoint>, opts: &PrefillerOptions) -> Result<Self> {
        let cfg = ck.config().text_config.clone();
        let source = opts.emulate_source_gbs.map(|g| SourceRate::new(&ck, g, "--emulate-source-gbs")).transpose()?;
        if let Some(s) = &source {
            tracing::info!(
                gbs = s.bytes_per_s() / 1e9,
                pass_gb = s.pass_bytes() as f64 / 1e9,
                pass_s = s.pass_seconds(),
                "--emulate-source-gbs: each pass reads the layers' weights at this rate"
            );
        }
        let layer_plan = cfg.layer_plan();
        let geometry = Geometry::of(&cfg, &layer_plan)?;
        let cuda = (&*backend as &dyn std::any::Any).downcast_ref::<crate::cuda::CudaBackend>();
        let streamed = matches!(opts.weights, WeightMode::Streamed(_));
        if streamed && cuda.is_none() {
            bail!("weight streaming needs the CUDA backend (this model runs on {})", backend.name());
        }
        // the ballast first, then the device's free memory
        let mut ballast = None;
        let (shape, device_limit) = match cuda {
            Some(c) => {
                let g = &c.gpu;
                if let Some(e) = opts.memory.emulate_gpu_memory {
                    let want = gb_to_bytes("--emulate-gpu-memory", e)?;
                    let (free, total) = g.mem_info()?;
                    let used = (total - free) as u64;
                    anyhow::ensure!(want > used, "--emulate-gpu-memory {e}: this process already uses {:.3} GB of the GPU", used as f64 / 1e9);
                    let keep_free = want - used;
                    if (free as u64) > keep_free {
                        let bytes = free - keep_free as usize;
                        ballast = Some(
                            g.alloc_sync(bytes).with_context(|| format!("--emulate-gpu-memory {e}: holding back {:.3} GB of the GPU", bytes as f64 / 1e9))?,
                        );
                        eprintln!(
                            "--emulate-gpu-memory {e}: {:.3} GB of the GPU's {:.3} held back (ballast); {:.3} GB free",
                            bytes as f64 / 1e9,
                            total as f64 / 1e9,
                            keep_free as f64 / 1e9
                        );
                    } else {
                        tracing::warn!("--emulate-gpu-memory {e}: the GPU has only {:.3} GB free; no ballast", free as f64 / 1e9);
                    }
                }
                let (free, _) = g.mem_info()?;
                let emulated_total = opts.memory.emulate_gpu_memory.map(|e| (e * 1e9) as u64).unwrap_or(g.mem_info()?.1 as u64);
                let shape = BackendShape::cuda(c.precision == crate::cuda::Precision::Bf16, emulated_total, c.moe_dense.min_rows);
                let limit = match opts.memory.vram_budget {
                    Some(b) => {
                        let b = gb_to_bytes("--vram-budget", b)?;
                        if b > free as u64 {
                            tracing::warn!(
                                "--vram-budget {:.3} GB is more than the {:.3} GB free on the GPU: planning within the free memory",
                                b as f64 / 1e9,
                                free as f64 / 1e9
                            );
                        }
                        b.min(free as u64)
                    }
                    None => (free as u64).saturating_sub(DEFAULT_MARGIN),
                };
                (if streamed { shape } else { BackendShape { streams_weights: false, ..shape } }, limit)
            }
            None => {
                let limit = match opts.memory.vram_budget {
                    Some(b) => gb_to_bytes("--vram-budget", b)?,
                    None => host_available().unwrap_or(16_000_000_000).saturating_sub(HOST_MARGIN),
                };
                (BackendShape::cpu(), limit)
            }
        };
        let host_limit = match opts.memory.host_memory {
            Some(h) => gb_to_bytes("--host-memory", h)?,
            None => host_available().unwrap_or(16_000_000_000).saturating_sub(HOST_MARGIN),
        };
        let (stage_bytes, pin_host_bytes, expert_chunk) = match &opts.weights {
            WeightMode::Streamed(s) => (s.stage_bytes, (s.weights_from == crate::streamer::WeightsFrom::PinHost).then(|| ck.total_bytes()), s.expert_chunk),
            _ => (0, None, None),
        };
        let mut knobs = Knobs {
            chunk_tokens: opts.chunk_tokens,
            expert_chunk,
            logits: opts.logits,
            pin_host_bytes,
            stage_bytes,
            resident: matches!(opts.weights, WeightMode::Resident),
            slots: None,
            embed_on_device: None,
        };
        let mut planner = Planner { geometry, shape, limits: Limits { device: device_limit, host: host_limit }, knobs: knobs.clone() };
        let design = if opts.design.is_empty() {
            let n = planner.longest_prompt().min(opts.design_cap.max(1));
            anyhow::ensure!(
                n > 0,
                "no prompt fits a device budget of {:.3} GB with {:.3} GB of host memory",
                device_limit as f64 / 1e9,
                host_limit as f64 / 1e9
            );
            vec![PlanRequest { base: 0, new: n }]
        } else {
            opts.design.clone()
        };
        let design_plan = planner.plan(&design).map_err(anyhow::Error::new)?;
        tracing::debug!(plan = %design_plan.line(), "memory plan of the design pass, by item:\n{}", design_plan.items());

        let policy = match opts.weights {
            WeightMode::Resident => WeightPolicy::Resident,
            _ => WeightPolicy::PerLayer,
        };
        let model = Arc::new(Model::new(backend, ck, policy)?);
        let streamed = match &opts.weights {
            WeightMode::Streamed(s) => {
                let mut s = s.clone();
                // the slots the plan chose; a little room for the tensors' alignment in a slot
                s.vram_budget = Some(design_plan.slot_bytes as usize + (64 << 20));
                s.expert_chunk = if design_plan.whole_layers { s.expert_chunk } else { Some(design_plan.expert_chunk) };
                s.embed_on_device = design_plan.embed_on_device;
                let sw = crate::streamer::streamed_weights_for(&model, &s)?;
                let p = sw.plan();
                knobs.slots = Some(Slots { whole_layers: p.whole_layers, expert_chunk: p.chunk, bytes: p.slot_bytes() as u64 });
                knobs.embed_on_device = Some(design_plan.embed_on_device);
                Some(Arc::new(sw))
            }
            _ => None,
        };
        planner.knobs = knobs;
        Ok(Prefiller { model, streamed, planner, design_plan, source, ballast })
    }

    /// The plan of a pass of `reqs` within the node's slots and limits.
    pub fn plan(&self, reqs: &[PlanRequest]) -> Result<MemoryPlan, NoFit> {
        self.planner.plan(reqs)
    }

    /// A pass of `reqs` under its memory plan (chunks, expert windows, the bank's place) with
    /// the node's weights; also returns the plan and the streaming timing.
    pub fn prefill_many(
        &self,
        reqs: &mut [PassRequest<'_, '_>],
        base: &ExecOptions,
        on_layer: impl FnMut(usize, LayerEvent<'_>) -> Result<()>,
    ) -> Result<(Vec<Result<PrefillOutput>>, Option<StreamStats>, MemoryPlan)> {
        let pr: Vec<PlanRequest> = reqs.iter().map(|r| PlanRequest { base: r.state.tokens, new: r.input.tokens.len() }).collect();
        let plan = self.plan(&pr).map_err(anyhow::Error::new)?;
        let opts = base.clone().following(&plan);
        let pace = self.source.as_ref().map(SourceRate::start);
        let (outs, st) = crate::streamer::prefill_many_maybe_streamed(&self.model, self.streamed.as_deref(), pace.as_ref(), reqs, &opts, on_layer)?;
        if let Some(p) = &pace {
            tracing::debug!(gb = p.bytes() as f64 / 1e9, read_s = p.read_seconds(), waited_s = p.waited().as_secs_f64(), "emulated weight source");
        }
        Ok((outs, st, plan))
    }

    /// One prompt ([`Prefiller::prefill_many`] of one request).
    pub fn prefill(
        &self,
        state: &mut k3_protocol::handoff::HandoffState,
        input: PrefillInput<'_>,
        base: &ExecOptions,
        mut on_layer: impl FnMut(LayerEvent<'_>) -> Result<()>,
    ) -> Result<(PrefillOutput, Option<StreamStats>, MemoryPlan)> {
        let mut reqs = [PassRequest { state, input }];
        let (mut outs, st, plan) = self.prefill_many(&mut reqs, base, |_, ev| on_layer(ev))?;
        Ok((outs.pop().expect("one result per request")?, st, plan))
    }

    /// Restarts the device and host high-water marks (before a measured pass).
    pub fn reset_memory_peak(&self) -> Result<()> {
        if let Some(c) = crate::cuda::cuda_model(&self.model) {
            c.backend.gpu.reset_memory_peak()?;
        }
        reset_host_peak();
        Ok(())
    }

    /// The peaks since [`Prefiller::reset_memory_peak`] (the ballast not counted).
    pub fn memory_use(&self) -> Result<MemoryUse> {
        let ballast = self.ballast.as_ref().map_or(0, |b| b.bytes as u64);
        let (device_allocated, device_used) = match crate::cuda::cuda_model(&self.model) {
            Some(c) => {
                let g = &c.backend.gpu;
                g.sync()?;
                let (free, total) = g.mem_info()?;
                // the pool keeps what it reserved (release threshold: never), so the device's
                // used memory now is its high-water mark since the trim of the reset
                (g.allocated_peak().saturating_sub(ballast), ((total - free) as u64).saturating_sub(ballast))
            }
            None => (0, 0),
        };
        Ok(MemoryUse { device_allocated, device_used, host_peak: host_peak().unwrap_or(0) })
    }
}
