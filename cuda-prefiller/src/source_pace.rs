//! An emulated weight source (`--emulate-source-gbs GB/s` of `bench` and `serve`): each weight
//! pass reads the layers' weights as if from a source of that rate, so that a fast box (an H200
//! fed from host memory) measures what a slower one (a user's NVMe) would do.
//!
//! [`PacedFeed`] wraps the weight feed of a pass ([`crate::executor::WeightFeed`]): layer `l`
//! finishes ([`crate::executor::WeightFeed::layer_done`], before its hand-off state is taken)
//! no earlier than every layer's bytes up to and including `l` could have been read at the rate
//! since the pass began. The reads run ahead of compute, as the streamer's readers do, and a
//! layer's compute overlaps the reading of its own weights, as the streamer's expert chunks
//! do. The bytes of a layer are those of its checkpoint tensors (`model.layers.L.*`); the
//! embedding and output head are not paced. The time the pass waited on the emulated source is
//! kept ([`SourcePass::waited`]), so a node's measured compute leaves it out.

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use k3_protocol::Checkpoint;

use crate::backend::{Backend, Routing};
use crate::executor::WeightFeed;
use crate::model::{HeadWeights, LayerWeights, Model};

/// The emulated source of a node: its rate and the bytes each layer reads (cheap to clone).
#[derive(Debug, Clone)]
pub struct SourceRate {
    bytes_per_s: f64,
    layer_bytes: Arc<Vec<u64>>,
}

impl SourceRate {
    /// A source of `gbs` GB/s (10^9 bytes per second) for `ck`'s layers; `flag` names the
    /// option in the error of a rate that is not a positive number.
    pub fn new(ck: &Checkpoint, gbs: f64, flag: &str) -> Result<Self> {
        if !(gbs.is_finite() && gbs > 0.0) {
            bail!("{flag} {gbs}: expected a positive rate in GB/s");
        }
        let layers = ck.config().text_config.num_hidden_layers;
        let layer_bytes = (0..layers)
            .map(|l| {
                let prefix = k3_protocol::tensors::layer_tensor(l, "");
                ck.tensor_names().filter(|n| n.starts_with(&prefix)).filter_map(|n| ck.entry(n)).map(|e| (e.end - e.start) as u64).sum()
            })
            .collect();
        Ok(SourceRate { bytes_per_s: gbs * 1e9, layer_bytes: Arc::new(layer_bytes) })
    }

    /// The rate, bytes per second.
    pub fn bytes_per_s(&self) -> f64 {
        self.bytes_per_s
    }

    /// The bytes one weight pass reads (every layer once).
    pub fn pass_bytes(&self) -> u64 {
        self.layer_bytes.iter().sum()
    }

    /// The seconds one weight pass takes to read at the rate.
    pub fn pass_seconds(&self) -> f64 {
        self.pass_bytes() as f64 / self.bytes_per_s
    }

    /// A pass beginning now.
    pub fn start(&self) -> SourcePass {
        SourcePass { rate: self.clone(), t0: Instant::now(), bytes: Cell::new(0), waited: Cell::new(Duration::ZERO), last: Cell::new(None) }
    }
}

/// One weight pass's reads from the emulated source (shared by the feed, which paces, and its
/// caller, which reads the counters while the pass runs).
#[derive(Debug)]
pub struct SourcePass {
    rate: SourceRate,
    t0: Instant,
    bytes: Cell<u64>,
    waited: Cell<Duration>,
    last: Cell<Option<usize>>,
}

impl SourcePass {
    /// Blocks until layer `l`'s bytes, after those of every layer read before in this pass,
    /// could have been read since the pass began (each layer counted once).
    pub fn read_layer(&self, l: usize) {
        if self.last.get() == Some(l) {
            return;
        }
        self.last.set(Some(l));
        self.bytes.set(self.bytes.get() + self.rate.layer_bytes.get(l).copied().unwrap_or(0));
        let ready = Duration::from_secs_f64(self.bytes.get() as f64 / self.rate.bytes_per_s);
        let now = self.t0.elapsed();
        if ready > now {
            std::thread::sleep(ready - now);
            self.waited.set(self.waited.get() + (ready - now));
        }
    }

    /// Bytes read from the source so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.get()
    }

    /// Seconds the source was busy reading them (bytes / rate).
    pub fn read_seconds(&self) -> f64 {
        self.bytes.get() as f64 / self.rate.bytes_per_s
    }

    /// Time the pass waited on the source so far.
    pub fn waited(&self) -> Duration {
        self.waited.get()
    }
}

/// A weight feed whose layers finish no faster than an emulated source reads them
/// ([`SourcePass::read_layer`] in `layer_done`); everything else is the wrapped feed's.
pub struct PacedFeed<'a, B: Backend> {
    inner: &'a mut dyn WeightFeed<B>,
    pass: &'a SourcePass,
}

impl<'a, B: Backend> PacedFeed<'a, B> {
    pub fn new(inner: &'a mut dyn WeightFeed<B>, pass: &'a SourcePass) -> Self {
        PacedFeed { inner, pass }
    }
}

// Every method of the trait is forwarded (a default method not forwarded would bypass the
// wrapped feed).
impl<B: Backend> WeightFeed<B> for PacedFeed<'_, B> {
    fn layer(&mut self, model: &Model<B>, l: usize) -> Result<Arc<LayerWeights<B>>> {
        self.inner.layer(model, l)
    }

    fn experts_in_chunks(&mut self, model: &Model<B>, l: usize, inputs: &[(&B::Buf, &Routing)]) -> Result<Vec<B::Buf>> {
        self.inner.experts_in_chunks(model, l, inputs)
    }

    fn layer_done(&mut self, model: &Model<B>, l: usize) -> Result<()> {
        self.inner.layer_done(model, l)?;
        self.pass.read_layer(l);
        Ok(())
    }

    fn embed(&mut self, model: &Model<B>, ids: &[u32]) -> Result<Option<B::Buf>> {
        self.inner.embed(model, ids)
    }

    fn head(&mut self, model: &Model<B>) -> Result<Arc<HeadWeights<B>>> {
        self.inner.head(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_reads_each_layer_once_and_no_faster_than_the_rate() {
        // 1 MB per layer at 0.05 GB/s: 20 ms per layer
        let rate = SourceRate { bytes_per_s: 0.05e9, layer_bytes: Arc::new(vec![1_000_000; 3]) };
        assert_eq!(rate.pass_bytes(), 3_000_000);
        assert!((rate.pass_seconds() - 0.06).abs() < 1e-12);
        let pass = rate.start();
        pass.read_layer(0);
        pass.read_layer(0); // the same layer again (another request of the pass): not read twice
        assert_eq!(pass.bytes(), 1_000_000);
        pass.read_layer(1);
        pass.read_layer(2);
        assert_eq!(pass.bytes(), 3_000_000);
        assert!((pass.read_seconds() - 0.06).abs() < 1e-12);
        // the sleeps end no earlier than the source could have read the bytes
        assert!(pass.t0.elapsed() >= Duration::from_millis(60), "{:?}", pass.t0.elapsed());
        assert!(pass.waited() > Duration::ZERO && pass.waited() <= pass.t0.elapsed());
    }

    /// A paced pass reads every layer once, takes no less than the source needs, and computes
    /// the same logits and states as an unpaced one (the wrapper changes when, never what).
    #[test]
    fn a_paced_pass_computes_the_same_and_takes_the_sources_time() {
        use crate::executor::{ExecOptions, LogitsRows, PassRequest, PrefillInput};
        use k3_protocol::handoff::HandoffState;
        let ck = Arc::new(Checkpoint::open(&k3_protocol::testdata::golden_dir("tiny-a")).unwrap());
        let model = Model::new(Arc::new(crate::cpu::CpuBackend), ck.clone(), crate::model::WeightPolicy::Resident).unwrap();
        let ids: Vec<u32> = (0..40u32).map(|i| (i * 37) % 500).collect();
        let opts = ExecOptions { chunk_tokens: 16, logits: LogitsRows::Last, ..ExecOptions::default() };
        let run = |pace: Option<&SourcePass>| {
            let mut states = [HandoffState::empty(&model.cfg), HandoffState::empty(&model.cfg)];
            let outs = {
                let mut reqs: Vec<PassRequest<'_, '_>> = states.iter_mut().map(|state| PassRequest { state, input: PrefillInput::tokens(&ids) }).collect();
                crate::streamer::prefill_many_maybe_streamed(&model, None, pace, &mut reqs, &opts, |_, _| Ok(())).unwrap().0
            };
            let logits: Vec<Vec<f32>> = outs.into_iter().map(|o| o.unwrap().logits).collect();
            (logits, states)
        };
        let (want_logits, want_states) = run(None);
        let layer_bytes = SourceRate::new(&ck, 1.0, "--emulate-source-gbs").unwrap().pass_bytes();
        // the layers' bytes in about 50 ms
        let rate = SourceRate::new(&ck, layer_bytes as f64 / 0.05 / 1e9, "--emulate-source-gbs").unwrap();
        let pass = rate.start();
        let (got_logits, got_states) = run(Some(&pass));
        assert_eq!(got_logits, want_logits);
        assert_eq!(got_states, want_states);
        assert_eq!(got_states[0].tokens, ids.len());
        // two requests in the pass, every layer read once
        assert_eq!(pass.bytes(), rate.pass_bytes());
        assert!(pass.t0.elapsed().as_secs_f64() >= rate.pass_seconds(), "{:?} < {} s", pass.t0.elapsed(), rate.pass_seconds());
    }

    #[test]
    fn the_rate_must_be_positive_and_the_error_names_the_flag() {
        let ck = Checkpoint::open(&k3_protocol::testdata::golden_dir("tiny-a")).unwrap();
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = SourceRate::new(&ck, bad, "--emulate-source-gbs").unwrap_err().to_string();
            assert!(e.contains("--emulate-source-gbs") && e.contains("GB/s"), "{e}");
        }
        let r = SourceRate::new(&ck, 2.0, "--emulate-source-gbs").unwrap();
        let layers = ck.config().text_config.num_hidden_layers;
        assert_eq!(r.layer_bytes.len(), layers);
        assert!(r.layer_bytes.iter().all(|&b| b > 0) && r.pass_bytes() < ck.total_bytes());
        assert_eq!(r.bytes_per_s(), 2e9);
    }
}
