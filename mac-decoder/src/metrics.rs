//! Prometheus metrics of the server (`GET /metrics`, OpenMetrics text through prometheus-client).

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

/// Every metric the server exports.
pub struct Metrics {
    registry: Mutex<Registry>,
    pub requests: Family<Labels, Counter>,
    pub errors: Family<Labels, Counter>,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    /// Prompt tokens served from a held session (not prefilled again).
    pub reused_tokens: Counter,
    /// Prefilled tokens by `where` = local | remote.
    pub prefill_tokens: Family<Labels, Counter>,
    pub prefill_seconds: Family<Labels, Counter<f64, AtomicU64>>,
    pub handoff_bytes: Counter,
    pub handoff_exposed_tail_seconds: Counter<f64, AtomicU64>,
    pub prefill_fallbacks: Counter,
    /// Turns whose prefill node runs a different, state-compatible model, by `outcome` =
    /// accepted (`--accept-compatible-states`) | refused.
    pub compatible_source_prefills: Family<Labels, Counter>,
    /// Images run through the vision tower, and the seconds it took.
    pub images: Counter,
    pub vision_seconds: Counter<f64, AtomicU64>,
    pub decode_seconds: Counter<f64, AtomicU64>,
    /// Part of the decode time spent computing constrained-decoding masks.
    pub constraint_mask_seconds: Counter<f64, AtomicU64>,
    /// Decode speed of the last finished request.
    pub decode_tokens_per_second: Gauge<f64, AtomicU64>,
    pub sessions_held: Gauge,
    pub session_bytes: Gauge,
    pub sessions_evicted: Counter,
    /// Jobs decoding together in the last decode step (continuous batching).
    pub batch_size: Gauge,
    /// Decode steps run, and the jobs they decoded summed over the steps: their ratio is the
    /// mean batch (one step decodes one token of every running job).
    pub decode_steps: Counter,
    pub decode_step_jobs: Counter,
    /// Jobs waiting in the engine's queue.
    pub queued: Gauge,
    /// Prompt + `max_tokens` of the requests admitted and not finished (bounded by
    /// `--max-tokens-in-flight`).
    pub tokens_in_flight: Gauge,
    /// Jobs cancelled by their handler (queued, prefilling or decoding): the client went away,
    /// or a stop string ended the reply.
    pub cancelled: Counter,
    /// Where the last prompt first differed from every held state (tokens).
    pub prefix_first_difference: Gauge,
    /// Prompt tokens equal to a held state but prefilled anyway: the held state went on past
    /// the prompt's first difference, and K3's recurrent state cannot be cut back.
    pub prefix_lost_tokens: Counter,
    /// Calls the model wrote to tools the request did not declare (reported as text).
    pub undeclared_tool_calls: Counter,
    /// Marker spellings removed from replies' text, and markers a reply ended inside.
    pub stripped_markers: Counter,
    /// Held sessions on disk, restores and evictions.
    pub store: StoreMetrics,
}

/// The session store's metrics beyond the gauges above: the disk store, restores, evictions
/// per reason, conversation keys, first-turn routes.
#[derive(Default)]
pub struct StoreMetrics {
    /// Sessions restored from disk instead of prefilled, their tokens, the seconds the restores
    /// took, and the prefill seconds they saved (tokens at the measured prefill rate).
    pub restored: Counter,
    pub restored_tokens: Counter,
    pub restore_seconds: Counter<f64, AtomicU64>,
    pub restore_seconds_saved: Counter<f64, AtomicU64>,
    /// Bytes and files of session state on disk (`--session-dir`, bounded by `--session-disk`).
    pub disk_bytes: Gauge,
    pub disk_files: Gauge,
    /// Session files written, and the seconds the writer thread took.
    pub disk_writes: Counter,
    pub disk_write_seconds: Counter<f64, AtomicU64>,
    /// Session files refused (at indexing or restore) and deleted, by `reason`.
    pub files_rejected: Family<Labels, Counter>,
    /// Entries leaving memory or disk, by `reason` = count | bytes | superseded (memory) |
    /// disk_full (disk).
    pub evictions: Family<Labels, Counter>,
    /// Distinct conversation keys among the sessions held in memory.
    pub keys_held: Gauge,
    /// Prompts that continued nothing held (first turns), by `route` = local | remote.
    pub first_turn_routes: Family<Labels, Counter>,
}

impl StoreMetrics {
    fn register(&self, r: &mut Registry) {
        r.register("sessions_restored", "Held sessions restored from disk instead of prefilled", self.restored.clone());
        r.register("session_restored_tokens", "Prompt tokens restored from disk instead of prefilled", self.restored_tokens.clone());
        r.register("session_restore_seconds", "Seconds spent restoring sessions from disk", self.restore_seconds.clone());
        r.register(
            "session_restore_seconds_saved",
            "Prefill seconds the restores from disk saved (restored tokens at the measured prefill rate)",
            self.restore_seconds_saved.clone(),
        );
        r.register("session_disk_bytes", "Bytes of session state held on disk (--session-dir)", self.disk_bytes.clone());
        r.register("session_disk_files", "Session files held on disk (--session-dir)", self.disk_files.clone());
        r.register("session_disk_writes", "Session files written", self.disk_writes.clone());
        r.register("session_disk_write_seconds", "Seconds the session writer spent writing files", self.disk_write_seconds.clone());
        r.register("session_files_rejected", "Session files refused and deleted, by reason", self.files_rejected.clone());
        r.register(
            "session_evictions",
            "Held sessions evicted, by reason (count, bytes, superseded: from memory; disk_full: from disk)",
            self.evictions.clone(),
        );
        r.register("session_keys_held", "Distinct conversation keys among the sessions held in memory", self.keys_held.clone());
        r.register("first_turn_routes", "Prompts that continued no held session, by route (local or remote)", self.first_turn_routes.clone());
        for reason in ["count", "bytes", "superseded", "disk_full"] {
            let _ = self.evictions.get_or_create(&label("reason", reason));
        }
        for route in ["local", "remote"] {
            let _ = self.first_turn_routes.get_or_create(&label("route", route));
        }
    }

    pub fn evicted(&self, reason: &str) {
        self.evictions.get_or_create(&label("reason", reason)).inc();
    }

    pub fn rejected(&self, reason: &str) {
        self.files_rejected.get_or_create(&label("reason", reason)).inc();
    }

    pub fn first_turn(&self, remote: bool) {
        self.first_turn_routes.get_or_create(&label("route", if remote { "remote" } else { "local" })).inc();
    }
}

fn label(k: &str, v: &str) -> Labels {
    vec![(k.to_string(), v.to_string())]
}

impl Metrics {
    pub fn new() -> Self {
        let m = Metrics {
            registry: Mutex::new(Registry::with_prefix("k3")),
            requests: Family::default(),
            errors: Family::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            reused_tokens: Counter::default(),
            prefill_tokens: Family::default(),
            prefill_seconds: Family::default(),
            handoff_bytes: Counter::default(),
            handoff_exposed_tail_seconds: Counter::default(),
            prefill_fallbacks: Counter::default(),
            compatible_source_prefills: Family::default(),
            images: Counter::default(),
            vision_seconds: Counter::default(),
            decode_seconds: Counter::default(),
            constraint_mask_seconds: Counter::default(),
            decode_tokens_per_second: Gauge::default(),
            sessions_held: Gauge::default(),
            session_bytes: Gauge::default(),
            sessions_evicted: Counter::default(),
            batch_size: Gauge::default(),
            decode_steps: Counter::default(),
            decode_step_jobs: Counter::default(),
            queued: Gauge::default(),
            tokens_in_flight: Gauge::default(),
            cancelled: Counter::default(),
            prefix_first_difference: Gauge::default(),
            prefix_lost_tokens: Counter::default(),
            undeclared_tool_calls: Counter::default(),
            stripped_markers: Counter::default(),
            store: StoreMetrics::default(),
        };
        {
            let mut r = m.registry.lock().unwrap_or_else(|e| e.into_inner());
            r.register("requests", "HTTP requests by endpoint", m.requests.clone());
            r.register("errors", "Failed requests by kind", m.errors.clone());
            r.register("prompt_tokens", "Prompt tokens of completed requests", m.prompt_tokens.clone());
            r.register("generated_tokens", "Tokens generated", m.generated_tokens.clone());
            r.register("reused_prompt_tokens", "Prompt tokens continued from a held session instead of prefilled", m.reused_tokens.clone());
            r.register("prefill_tokens", "Tokens prefilled, by where (local or remote)", m.prefill_tokens.clone());
            r.register("prefill_seconds", "Seconds spent prefilling, by where (local or remote)", m.prefill_seconds.clone());
            r.register("handoff_bytes", "Hand-off state bytes received from the prefill node", m.handoff_bytes.clone());
            r.register("handoff_exposed_tail_seconds", "Hand-off time not hidden behind the prefill node's compute", m.handoff_exposed_tail_seconds.clone());
            r.register("prefill_fallbacks", "Remote prefills that fell back to local prefill", m.prefill_fallbacks.clone());
            r.register(
                "compatible_source_prefills",
                "Turns whose prefill node runs another model with this model's state identity (e.g. the full model of a pruned decoder), by outcome (accepted with --accept-compatible-states, else refused)",
                m.compatible_source_prefills.clone(),
            );
            r.register("images", "Images encoded by the vision tower", m.images.clone());
            r.register("vision_seconds", "Seconds spent encoding images (vision tower and projector)", m.vision_seconds.clone());
            r.register("decode_seconds", "Seconds spent in decode steps", m.decode_seconds.clone());
            r.register("constraint_mask_seconds", "Seconds of the decode time spent computing constrained-decoding masks", m.constraint_mask_seconds.clone());
            r.register("decode_tokens_per_second", "Decode speed of the last finished request", m.decode_tokens_per_second.clone());
            r.register("sessions_held", "Session states held for prefix reuse", m.sessions_held.clone());
            r.register("session_state_bytes", "Bytes of held session state", m.session_bytes.clone());
            r.register("sessions_evicted", "Session states evicted from memory (see session_evictions for the reasons)", m.sessions_evicted.clone());
            r.register("decode_batch_size", "Requests decoding together in the last decode step", m.batch_size.clone());
            r.register("decode_steps", "Decode steps run (each decodes one token of every running request)", m.decode_steps.clone());
            r.register(
                "decode_step_requests",
                "Requests decoded, summed over the decode steps (divided by decode_steps: the mean batch)",
                m.decode_step_jobs.clone(),
            );
            r.register("queued_requests", "Requests waiting for the engine", m.queued.clone());
            r.register(
                "tokens_in_flight",
                "Prompt + max_tokens of the requests admitted and not finished (--max-tokens-in-flight bounds it)",
                m.tokens_in_flight.clone(),
            );
            r.register("cancelled_requests", "Requests cancelled because their client went away or a stop string ended them", m.cancelled.clone());
            r.register(
                "prefix_first_difference",
                "Where the last prompt first differed from every held session state (tokens)",
                m.prefix_first_difference.clone(),
            );
            r.register(
                "prefix_lost_tokens",
                "Prompt tokens equal to a held state but prefilled again: the held state went past the prompt's first difference (recurrent state cannot be cut back)",
                m.prefix_lost_tokens.clone(),
            );
            r.register(
                "undeclared_tool_calls",
                "Tool calls the model wrote to tools the request did not declare (reported as text, not returned)",
                m.undeclared_tool_calls.clone(),
            );
            r.register("stripped_markers", "Marker spellings removed from replies' text, and markers a reply ended inside", m.stripped_markers.clone());
            m.store.register(&mut r);
        }
        // Make the label sets visible from the start.
        for w in ["local", "remote"] {
            let _ = m.prefill_tokens.get_or_create(&label("where", w));
            let _ = m.prefill_seconds.get_or_create(&label("where", w));
        }
        for o in ["accepted", "refused"] {
            let _ = m.compatible_source_prefills.get_or_create(&label("outcome", o));
        }
        m
    }

    pub fn request(&self, endpoint: &str) {
        self.requests.get_or_create(&label("endpoint", endpoint)).inc();
    }

    pub fn error(&self, kind: &str) {
        self.errors.get_or_create(&label("kind", kind)).inc();
    }

    pub fn prefill(&self, remote: bool, tokens: usize, seconds: f64) {
        let w = if remote { "remote" } else { "local" };
        self.prefill_tokens.get_or_create(&label("where", w)).inc_by(tokens as u64);
        self.prefill_seconds.get_or_create(&label("where", w)).inc_by(seconds);
    }

    /// A turn whose prefill node runs a different, state-compatible model.
    /// `outcome`: "accepted" | "refused".
    pub fn compatible_source(&self, outcome: &str) {
        self.compatible_source_prefills.get_or_create(&label("outcome", outcome)).inc();
    }

    /// Tokens prefilled so far, by where.
    pub fn prefilled(&self, remote: bool) -> u64 {
        self.prefill_tokens.get_or_create(&label("where", if remote { "remote" } else { "local" })).get()
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if encode(&mut s, &r).is_err() {
            s.push_str("# metrics encoding failed\n");
        }
        s
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compatible_source_turns_are_counted_by_outcome() {
        let m = Metrics::new();
        let text = m.render();
        assert!(text.contains("k3_compatible_source_prefills_total{outcome=\"accepted\"} 0"), "{text}");
        m.compatible_source("accepted");
        m.compatible_source("accepted");
        m.compatible_source("refused");
        let text = m.render();
        assert!(text.contains("k3_compatible_source_prefills_total{outcome=\"accepted\"} 2"), "{text}");
        assert!(text.contains("k3_compatible_source_prefills_total{outcome=\"refused\"} 1"), "{text}");
    }
}
