//! Where a turn is prefilled: by predicted time, unless `--remote-min-tokens` fixes it.
//!
//! - local: `tokens / local rate(context)`, from a [`RateFit`] of this decoder's own local
//!   prefills (seeded by a short calibration prefill, or the configured default rate);
//! - remote: the node's queue + `max(weight pass, compute(tokens, context))` (they overlap layer
//!   by layer on the node) + the hand-off tail measured on earlier remote turns.
//!
//! A turn goes remote only when `remote · (1 + margin) < local`. Both predictions and the
//! decision go to the log and the turn's [`TurnTiming`](crate::remote::TurnTiming); after the
//! turn the measured time is recorded next to the prediction.

use std::collections::VecDeque;

use k3_protocol::wire::{NodeCost, RateFit, RateSample};

/// Local prefills the local fit is made from.
const SAMPLES: usize = 32;

/// The hand-off tail assumed before a remote turn measured one (seconds).
pub const DEFAULT_TAIL_S: f64 = 0.25;

/// How the decoder routes.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutePolicy {
    /// `--remote-min-tokens N`: turns with at least N new tokens go remote, whatever the cost.
    pub min_tokens: Option<usize>,
    /// Remote must beat local by this fraction (0.15: remote · 1.15 < local).
    pub margin: f64,
    /// Local prefill rate assumed before any local prefill was measured (tokens/s).
    pub local_tok_per_s: f64,
    /// Tokens of the calibration prefill run before the first cost-based decision (0: none; the
    /// default rate is used until a local turn is measured).
    pub calibration_tokens: usize,
}

impl Default for RoutePolicy {
    fn default() -> Self {
        RoutePolicy { min_tokens: None, margin: 0.15, local_tok_per_s: 120.0, calibration_tokens: 128 }
    }
}

/// One routing decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub remote: bool,
    /// Predicted seconds for a local prefill.
    pub local_s: f64,
    /// Predicted seconds for a remote prefill (None: no cost from the node).
    pub remote_s: Option<f64>,
    pub reason: String,
}

/// A turn's prediction next to what it took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub remote: bool,
    pub predicted_s: f64,
    pub measured_s: f64,
}

/// The decoder's routing state: its local rate, the measured tail, the history.
#[derive(Debug, Clone)]
pub struct Router {
    pub policy: RoutePolicy,
    local: VecDeque<RateSample>,
    local_fit: RateFit,
    tail_s: Option<f64>,
    history: Vec<Outcome>,
}

impl Router {
    pub fn new(policy: RoutePolicy) -> Router {
        let local_fit = RateFit::flat(policy.local_tok_per_s);
        Router { policy, local: VecDeque::new(), local_fit, tail_s: None, history: Vec::new() }
    }

    /// Whether a local rate has been measured (else the configured default is in use).
    pub fn local_measured(&self) -> bool {
        !self.local.is_empty()
    }

    pub fn local_fit(&self) -> &RateFit {
        &self.local_fit
    }

    /// Predicted local seconds for `n` new tokens after `base`.
    pub fn local_s(&self, n: u64, base: u64) -> f64 {
        self.local_fit.seconds(n, base)
    }

    /// The hand-off tail in use (measured, or the default).
    pub fn tail_s(&self) -> f64 {
        self.tail_s.unwrap_or(DEFAULT_TAIL_S)
    }

    /// Predicted remote seconds for `n` new tokens after `base` on a node advertising `cost`.
    pub fn remote_s(&self, cost: &NodeCost, n: u64, base: u64) -> f64 {
        cost.predict_s(n, base) + self.tail_s()
    }

    /// The route of a turn: `local` = (new tokens, context) of a local prefill, `remote` = the
    /// same for the node (which may also need the generated tokens it has not seen); `cost`: the
    /// node's, if it could be asked.
    pub fn decide(&self, local: (u64, u64), remote: (u64, u64), cost: Option<&NodeCost>) -> Decision {
        let (n, base) = local;
        let local_s = self.local_s(n, base);
        let remote_s = cost.map(|c| self.remote_s(c, remote.0, remote.1));
        if let Some(min) = self.policy.min_tokens {
            let remote = n as usize >= min;
            let reason =
                if remote { format!("{n} new tokens, at least --remote-min-tokens {min}") } else { format!("{n} new tokens, below --remote-min-tokens {min}") };
            return Decision { remote, local_s, remote_s, reason };
        }
        let Some(c) = cost else {
            return Decision { remote: false, local_s, remote_s, reason: "no cost from the prefill node".into() };
        };
        // A node that advertises nothing at all (an older node, or one that could not measure
        // its start-up rates): route as the fixed threshold did. A fresh node advertises its
        // predicted cost (`compute.samples` 0), which is routed on like a measured one.
        let advertised = c.compute.fixed_s > 0.0 || c.compute.per_token_s > 0.0 || c.compute.per_token_ctx_s > 0.0 || c.pass_s > 0.0;
        if !advertised {
            let remote = n >= 1024;
            let reason = format!("the prefill node has measured nothing yet: {n} new tokens against the default threshold of 1024");
            return Decision { remote, local_s, remote_s, reason };
        }
        let r = remote_s.unwrap_or(f64::INFINITY);
        let go_remote = r * (1.0 + self.policy.margin) < local_s;
        let local_src = if self.local_measured() { "measured" } else { "default" };
        let node_src = if c.compute.samples == 0 { ", node cost predicted from its start-up measurements" } else { "" };
        let reason = format!(
            "predicted remote {r:.3} s (queue {:.3} + max(pass {:.3}, compute {:.3}) + tail {:.3}) vs local {local_s:.3} s ({:.1} tok/s, {local_src}); margin {:.0} %{node_src}",
            c.queue_s,
            c.pass_s,
            c.compute.seconds(remote.0, remote.1),
            self.tail_s(),
            self.local_fit.tok_per_s(n, base),
            self.policy.margin * 100.0
        );
        Decision { remote: go_remote, local_s, remote_s, reason }
    }

    /// A local prefill of `n` tokens after `base` took `seconds`.
    pub fn record_local(&mut self, n: u64, base: u64, seconds: f64) {
        if n == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        if self.local.len() == SAMPLES {
            self.local.pop_front();
        }
        self.local.push_back(RateSample { new_tokens: n, base_tokens: base, seconds });
        self.local_fit = RateFit::fit(&self.local.iter().copied().collect::<Vec<_>>());
    }

    /// A remote turn's measured hand-off tail (last layer done on the node → state usable here).
    pub fn record_tail(&mut self, tail_s: f64) {
        if tail_s.is_finite() && tail_s >= 0.0 {
            self.tail_s = Some(self.tail_s.map_or(tail_s, |t| 0.5 * t + 0.5 * tail_s));
        }
    }

    /// A turn's predicted and measured time, for checking the estimates.
    pub fn record_outcome(&mut self, o: Outcome) {
        self.history.push(o);
    }

    pub fn history(&self) -> &[Outcome] {
        &self.history
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(pass_s: f64, tok_s: f64) -> NodeCost {
        NodeCost { pass_s, passes: 1, compute: RateFit { samples: 1, ..RateFit::flat(tok_s) }, ..Default::default() }
    }

    #[test]
    fn short_turns_stay_local_long_ones_go_remote() {
        // A PC streaming from one NVMe: 111 s a pass, 2000 tok/s compute; the Mac at 120 tok/s.
        let r = Router::new(RoutePolicy::default());
        let c = node(111.0, 2000.0);
        let short = r.decide((2_000, 0), (2_000, 0), Some(&c));
        assert!(!short.remote, "{short:?}");
        assert!((short.local_s - 2000.0 / 120.0).abs() < 1e-9);
        let long = r.decide((20_000, 0), (20_000, 0), Some(&c));
        assert!(long.remote, "{long:?}");
        // Break-even with the margin: 120 · 111.25 · 1.15 ≈ 15.4k tokens.
        assert!(!r.decide((15_000, 0), (15_000, 0), Some(&c)).remote);
        assert!(r.decide((15_600, 0), (15_600, 0), Some(&c)).remote);
        // A queue on the node moves it.
        let busy = NodeCost { queue_s: 100.0, ..c.clone() };
        assert!(!r.decide((20_000, 0), (20_000, 0), Some(&busy)).remote);
    }

    #[test]
    fn manual_threshold_and_unknown_costs() {
        let r = Router::new(RoutePolicy { min_tokens: Some(500), ..Default::default() });
        let c = node(1000.0, 10.0);
        assert!(r.decide((500, 0), (500, 0), Some(&c)).remote, "the override wins over the cost");
        assert!(!r.decide((499, 0), (499, 0), None).remote);
        let r = Router::new(RoutePolicy::default());
        assert!(!r.decide((100_000, 0), (100_000, 0), None).remote, "no cost: local");
        let silent = NodeCost::default();
        assert!(!r.decide((1000, 0), (1000, 0), Some(&silent)).remote && r.decide((1024, 0), (1024, 0), Some(&silent)).remote);
        // A fresh node's predicted cost (no sample measured yet) is routed on: a fast node takes
        // a 600-token turn, a slow one does not get a 3,000-token one.
        let fast = NodeCost { compute: RateFit { samples: 0, ..RateFit::flat(20_000.0) }, ..Default::default() };
        let d = r.decide((600, 0), (600, 0), Some(&fast));
        assert!(d.remote && d.reason.contains("predicted from its start-up"), "{d:?}");
        let slow = NodeCost { compute: RateFit { samples: 0, ..RateFit::flat(50.0) }, ..Default::default() };
        assert!(!r.decide((3000, 0), (3000, 0), Some(&slow)).remote);
    }

    #[test]
    fn local_rate_and_tail_are_learned() {
        let mut r = Router::new(RoutePolicy::default());
        assert!(!r.local_measured());
        r.record_local(100, 0, 0.5);
        assert!(r.local_measured());
        assert!((r.local_s(400, 0) - 2.0).abs() < 1e-9);
        r.record_tail(1.0);
        r.record_tail(0.5);
        assert!((r.tail_s() - 0.75).abs() < 1e-12);
        r.record_outcome(Outcome { remote: true, predicted_s: 1.0, measured_s: 1.1 });
        assert_eq!(r.history().len(), 1);
    }
}
