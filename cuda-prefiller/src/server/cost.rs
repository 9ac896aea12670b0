//! The node's cost meter: what a prefill costs here, measured from the node's own requests,
//! published on the [`CostBoard`] that the transport advertises to decoders (after `HelloAck`,
//! and on `CostQuery`) and exported in the metrics.
//!
//! - **Weight pass**: seconds to read every layer's weights from the current source, from the
//!   bytes each request read and the time the source took (`bytes / time`; 0 with resident
//!   weights). Before the first streamed request: the estimate the node was started with.
//! - **Compute**: a [`RateFit`] of compute seconds (weight and network waits excluded) against
//!   new tokens and context, over the last [`SAMPLES`] requests; before the first one, the
//!   prediction from start-up measurements ([`super::predict`], `samples` 0).
//! - **Queue**: the predicted rest of the running weight pass plus the next one, which the
//!   waiting requests share: `max(pass, Σ their compute)`.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

use k3_protocol::wire::{CostBoard, NodeCost, RateFit, RateSample};

/// Requests the compute fit is made from.
pub const SAMPLES: usize = 32;

/// A weight source's read over one request: bytes and seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SourceRead {
    pub bytes: u64,
    pub seconds: f64,
}

#[derive(Debug)]
struct Pending {
    request: u64,
    /// Predicted compute seconds (weight pass excluded).
    compute_s: f64,
    started: Option<Instant>,
}

#[derive(Debug)]
struct Inner {
    samples: VecDeque<RateSample>,
    /// Measured source rate, bytes per second (None: not measured).
    rate: Option<f64>,
    passes: u64,
    pending: Vec<Pending>,
}

/// The node's cost meter; cheap to call from the request tasks and the compute thread.
#[derive(Debug)]
pub struct CostMeter {
    board: CostBoard,
    /// Weight bytes one pass reads from the source (0: resident weights).
    pass_bytes: u64,
    /// Seconds per pass assumed until one is measured.
    planned_pass_s: f64,
    /// The compute advertised until a request is measured (`samples` 0: a prediction).
    predicted: RateFit,
    inner: Mutex<Inner>,
}

impl CostMeter {
    /// `pass_bytes`: weight bytes one pass reads (0 when the weights are resident);
    /// `planned_pass_s`: the estimate until measured.
    pub fn new(board: CostBoard, pass_bytes: u64, planned_pass_s: f64) -> CostMeter {
        let m = CostMeter {
            board,
            pass_bytes,
            planned_pass_s,
            predicted: RateFit::default(),
            inner: Mutex::new(Inner { samples: VecDeque::new(), rate: None, passes: 0, pending: Vec::new() }),
        };
        m.publish();
        m
    }

    /// Advertises `fit` as the compute until a request is measured ([`super::predict`]).
    pub fn with_predicted(mut self, fit: RateFit) -> CostMeter {
        self.predicted = RateFit { samples: 0, ..fit };
        self.publish();
        self
    }

    pub fn board(&self) -> &CostBoard {
        &self.board
    }

    /// The cost now.
    pub fn current(&self) -> NodeCost {
        self.board.read().map(|c| c.clone()).unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request entered the queue.
    pub fn queued(&self, request: u64, new_tokens: u64, base_tokens: u64) {
        let compute_s = self.current().compute.seconds(new_tokens, base_tokens);
        self.lock().pending.push(Pending { request, compute_s, started: None });
        self.publish();
    }

    /// The compute thread took the request.
    pub fn started(&self, request: u64) {
        if let Some(p) = self.lock().pending.iter_mut().find(|p| p.request == request) {
            p.started = Some(Instant::now());
        }
        self.publish();
    }

    /// The request left the node. `compute`: its measured compute (only for a completed
    /// request; [`compute_samples`]); `source`: what its weight source read.
    pub fn finished(&self, request: u64, compute: Vec<RateSample>, source: Option<SourceRead>) {
        {
            let mut g = self.lock();
            g.pending.retain(|p| p.request != request);
            for s in compute {
                if g.samples.len() == SAMPLES {
                    g.samples.pop_front();
                }
                g.samples.push_back(s);
            }
            if let Some(r) = source.filter(|r| r.bytes > 0 && r.seconds > 0.0) {
                let rate = r.bytes as f64 / r.seconds;
                // A moving average that follows a changed source (page cache warming, another
                // drive) within a few passes.
                g.rate = Some(g.rate.map_or(rate, |old| 0.5 * old + 0.5 * rate));
                g.passes += 1;
            }
        }
        self.publish();
    }

    fn publish(&self) {
        let g = self.lock();
        let compute = if g.samples.is_empty() { self.predicted } else { RateFit::fit(&g.samples.iter().copied().collect::<Vec<_>>()) };
        let pass_s = match g.rate {
            _ if self.pass_bytes == 0 => 0.0,
            Some(r) => self.pass_bytes as f64 / r,
            None => self.planned_pass_s,
        };
        // The running pass (its requests started together) and the next one (every waiting
        // request shares it).
        let now = Instant::now();
        let running = g.pending.iter().filter(|p| p.started.is_some());
        let first = running.clone().filter_map(|p| p.started).min();
        let run_left = match first {
            Some(t) => (pass_s.max(running.map(|p| p.compute_s).sum()) - now.duration_since(t).as_secs_f64()).max(0.0),
            None => 0.0,
        };
        let waiting: Vec<f64> = g.pending.iter().filter(|p| p.started.is_none()).map(|p| p.compute_s).collect();
        let next = if waiting.is_empty() { 0.0 } else { pass_s.max(waiting.iter().sum()) };
        let queue_s = run_left + next;
        let cost = NodeCost { pass_s, pass_bytes: self.pass_bytes, passes: g.passes, compute, queued: g.pending.len() as u32, queue_s };
        drop(g);
        if let Ok(mut b) = self.board.write() {
            *b = cost;
        }
    }
}

/// What a request's compute teaches the fit: the whole request (`n` new tokens after `base` in
/// `seconds`), and, from its token chunks' times (`chunks`: `(rows, seconds)` in order), the
/// requests its first chunks would have been — each prefix of `k` chunks costs the request's
/// time outside the chunks plus those chunks' times. One long prompt so shows how the cost grows
/// with the context the tokens attend to, which a single whole-request sample cannot.
pub fn compute_samples(n: u64, base: u64, seconds: f64, chunks: &[(usize, f64)]) -> Vec<RateSample> {
    let mut out = Vec::with_capacity(chunks.len().max(1));
    let inside: f64 = chunks.iter().map(|c| c.1).sum();
    if chunks.len() > 1 && inside > 0.0 && chunks.iter().map(|c| c.0 as u64).sum::<u64>() == n {
        // Chunk times scaled so that the prefixes end at the request's own time.
        let (outside, scale) = if inside <= seconds { (seconds - inside, 1.0) } else { (0.0, seconds / inside) };
        let (mut rows, mut t) = (0u64, outside);
        for c in &chunks[..chunks.len() - 1] {
            rows += c.0 as u64;
            t += c.1 * scale;
            out.push(RateSample { new_tokens: rows, base_tokens: base, seconds: t });
        }
    }
    out.push(RateSample { new_tokens: n, base_tokens: base, seconds });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meter_measures_pass_compute_and_queue() {
        let m = CostMeter::new(CostBoard::default(), 1_000_000, 5.0);
        assert_eq!(m.current().pass_s, 5.0, "planned until measured");
        m.queued(1, 100, 0);
        m.started(1);
        m.finished(1, vec![RateSample { new_tokens: 100, base_tokens: 0, seconds: 1.0 }], Some(SourceRead { bytes: 1_000_000, seconds: 2.0 }));
        let c = m.current();
        assert_eq!((c.pass_s, c.passes, c.queued), (2.0, 1, 0));
        assert!((c.compute.seconds(200, 0) - 2.0).abs() < 1e-9);
        // Two waiting requests of 200 tokens share the next pass: max(pass 2 s, 2 × 2 s compute).
        m.queued(2, 200, 0);
        m.queued(3, 200, 0);
        let c = m.current();
        assert_eq!(c.queued, 2);
        assert!((c.queue_s - 4.0).abs() < 1e-9, "{c:?}");
        // Two short ones: the pass (2 s) bounds their shared pass.
        m.queued(4, 10, 0);
        m.queued(5, 10, 0);
        m.finished(2, Vec::new(), None);
        m.finished(3, Vec::new(), None);
        let c = m.current();
        assert!((c.queue_s - 2.0).abs() < 1e-9, "{c:?}");
        m.finished(4, Vec::new(), None);
        m.finished(5, Vec::new(), None);
        m.finished(2, Vec::new(), None);
        m.finished(3, Vec::new(), None);
        assert_eq!(m.current().queue_s, 0.0);
    }

    #[test]
    fn chunk_times_give_prefix_samples() {
        // 3 chunks of 100 tokens, each slower than the one before (more context), 0.5 s outside.
        let s = compute_samples(300, 50, 6.5, &[(100, 1.0), (100, 2.0), (100, 3.0)]);
        let got: Vec<(u64, u64, f64)> = s.iter().map(|x| (x.new_tokens, x.base_tokens, x.seconds)).collect();
        assert_eq!(got, vec![(100, 50, 1.5), (200, 50, 3.5), (300, 50, 6.5)]);
        // A context-dependent cost is recovered from one request.
        let truth = RateFit { fixed_s: 0.0, per_token_s: 1e-3, per_token_ctx_s: 1e-6, samples: 0 };
        let chunks: Vec<(usize, f64)> = (0..4).map(|k| (500, truth.seconds(500, 500 * k))).collect();
        let total: f64 = chunks.iter().map(|c| c.1).sum();
        let f = RateFit::fit(&compute_samples(2000, 0, total, &chunks));
        assert!((f.seconds(8000, 0) - truth.seconds(8000, 0)).abs() < 1e-6 * truth.seconds(8000, 0), "{f:?}");
        // One chunk, or chunks that do not add up: the request alone.
        assert_eq!(compute_samples(100, 0, 1.0, &[(100, 0.9)]).len(), 1);
        assert_eq!(compute_samples(100, 0, 1.0, &[(40, 0.4), (40, 0.4)]).len(), 1);
    }
}
