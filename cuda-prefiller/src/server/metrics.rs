//! Counters of a running prefill node and a short history of its requests, for logs, tests and
//! whoever exports metrics. Cheap to update from any task; [`ServerMetrics::snapshot`] reads
//! everything at once.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::Serialize;

use crate::server::sessions::StoreStats;

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Outcome {
    /// Every layer delivered, `Done` sent.
    Completed,
    /// Refused before any compute (busy, base not held, invalid, too large).
    Refused { code: String, message: String },
    /// Accepted, then failed (decoder gone, cancelled, compute error).
    Failed { reason: String },
}

/// One request, as the node saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestRecord {
    pub request: u64,
    pub peer: String,
    pub session: String,
    /// Tokens the request's base prefix covered (0 without a base).
    pub base_tokens: u64,
    /// Tokens prefilled by this request.
    pub new_tokens: u64,
    pub outcome: Outcome,
    /// Waiting for the compute worker.
    pub queue_s: f64,
    /// Layer compute (waits for the network excluded).
    pub compute_s: f64,
    /// The compute worker blocked because the network was behind.
    pub network_wait_s: f64,
    /// Accepted → Done sent.
    pub total_s: f64,
    pub state_bytes: u64,
}

/// Counters since start.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Counters {
    pub connections: u64,
    pub handshake_failures: u64,
    pub requests: u64,
    pub completed: u64,
    pub refused: u64,
    pub failed: u64,
    pub tokens_prefilled: u64,
    pub state_bytes_sent: u64,
    pub compute_s: f64,
    /// Requests waiting for the compute worker right now, and the one computing.
    pub in_flight: u64,
    /// Layers whose state went to the network (all requests).
    pub layers_sent: u64,
}

/// Everything at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricsSnapshot {
    pub counters: Counters,
    pub sessions: StoreStats,
    pub recent: Vec<RequestRecord>,
}

/// Shared by every task of a server.
#[derive(Debug, Default)]
pub struct ServerMetrics {
    inner: Mutex<(Counters, VecDeque<RequestRecord>)>,
}

/// Requests kept in the history.
const RECENT: usize = 256;

impl ServerMetrics {
    pub fn update(&self, f: impl FnOnce(&mut Counters)) {
        if let Ok(mut g) = self.inner.lock() {
            f(&mut g.0);
        }
    }

    pub fn record(&self, r: RequestRecord) {
        if let Ok(mut g) = self.inner.lock() {
            let c = &mut g.0;
            match &r.outcome {
                Outcome::Completed => {
                    c.completed += 1;
                    c.tokens_prefilled += r.new_tokens;
                    c.state_bytes_sent += r.state_bytes;
                }
                Outcome::Refused { .. } => c.refused += 1,
                Outcome::Failed { .. } => c.failed += 1,
            }
            c.compute_s += r.compute_s;
            if g.1.len() == RECENT {
                g.1.pop_front();
            }
            g.1.push_back(r);
        }
    }

    /// Changes the outcome of a recorded request (a `Completed` one whose delivery then failed).
    pub fn amend(&self, request: u64, peer: &str, outcome: Outcome) {
        if let Ok(mut g) = self.inner.lock() {
            let (c, recent) = &mut *g;
            let Some(r) = recent.iter_mut().rev().find(|r| r.request == request && r.peer == peer) else { return };
            let old = std::mem::replace(&mut r.outcome, outcome.clone());
            if old == Outcome::Completed && outcome != Outcome::Completed {
                c.completed = c.completed.saturating_sub(1);
                c.tokens_prefilled = c.tokens_prefilled.saturating_sub(r.new_tokens);
                c.state_bytes_sent = c.state_bytes_sent.saturating_sub(r.state_bytes);
                c.failed += 1;
            }
        }
    }

    pub fn counters(&self) -> Counters {
        self.inner.lock().map(|g| g.0.clone()).unwrap_or_default()
    }

    pub fn recent(&self) -> Vec<RequestRecord> {
        self.inner.lock().map(|g| g.1.iter().cloned().collect()).unwrap_or_default()
    }
}
