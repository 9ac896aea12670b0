//! The engine thread's held sessions: the memory store ([`SessionStore`]) in front of the disk
//! store ([`DiskStore`]). What memory lets go is written to disk (unless superseded or holding
//! images); a prompt continues the longest held prefix, from memory or restored from disk;
//! at shutdown every session in memory is written. The prefill rate measured here weighs
//! eviction and prices the restores (the prefill seconds they saved).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use k3_protocol::wire::{RateFit, RateSample};

use super::disk_store::{DiskOptions, DiskStore};
use super::generation_engine::{GenerationEngine, PrefillReport};
use super::sessions::{Entry, EvictReason, Evicted, MediaKey, SessionStore};
use crate::metrics::Metrics;

/// Prefills the rate is fitted from.
const RATE_SAMPLES: usize = 32;

pub(crate) struct HeldSessions<S> {
    pub(crate) memory: SessionStore<S>,
    disk: Option<DiskStore>,
    samples: VecDeque<RateSample>,
    metrics: Arc<Metrics>,
}

impl<S: 'static> HeldSessions<S> {
    /// The memory store; with `disk` (and an engine that can export states) the disk store too.
    /// A disk store that cannot be opened is reported and left out.
    pub(crate) fn new<E: GenerationEngine<Session = S>>(
        engine: &E,
        max_sessions: usize,
        max_bytes: usize,
        disk: Option<&DiskOptions>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let disk = match (disk, engine.state_identity()) {
            (Some(o), Some(id)) => match DiskStore::open(o, id, metrics.clone()) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::warn!("held sessions stay in memory only: {e:#}");
                    None
                }
            },
            (Some(_), None) => {
                tracing::info!("this engine cannot export session states: held sessions stay in memory only");
                None
            }
            (None, _) => None,
        };
        HeldSessions { memory: SessionStore::new(max_sessions, max_bytes), disk, samples: VecDeque::new(), metrics }
    }

    pub(crate) fn gauges(&self) {
        self.metrics.sessions_held.set(self.memory.len() as i64);
        self.metrics.session_bytes.set(self.memory.total_bytes() as i64);
        self.metrics.store.keys_held.set(self.memory.keys() as i64);
    }

    /// A prefill of `report.tokens` after `base` tokens ran (local or remote): the rate.
    pub(crate) fn prefilled(&mut self, base: usize, report: &PrefillReport) {
        if report.tokens == 0 || !(report.seconds > 0.0) {
            return;
        }
        if self.samples.len() == RATE_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back(RateSample { new_tokens: report.tokens as u64, base_tokens: base as u64, seconds: report.seconds });
        self.memory.set_rate(RateFit::fit(&self.samples.iter().copied().collect::<Vec<_>>()));
    }

    /// The best held state to continue `prompt` from and the tokens of the prompt it holds —
    /// a checkpoint's copy, a live state taken from memory, or a state restored from disk when
    /// a file holds more of the prompt — else a new session. Only states of cache scope
    /// `scope` are considered (see [`super::sessions`]).
    pub(crate) fn held_state<E: GenerationEngine<Session = S>>(
        &mut self,
        engine: &mut E,
        prompt: &[u32],
        media: &[MediaKey],
        key: Option<&str>,
        scope: Option<&str>,
    ) -> anyhow::Result<(S, usize)> {
        self.memory.next_request();
        let mem = self.memory.best_match_keyed(prompt, media, key, scope);
        let mem_len = mem.map_or(0, |i| self.memory.get(i).tokens.len());
        // Files hold no images: only a prefix before the prompt's first image can come from one.
        let before_media = media.iter().map(|m| m.span.start).min().unwrap_or(prompt.len());
        // A file that fails its checks leaves the index (deleted): the next best one is tried.
        let mut tried = 0;
        while let Some((name, n)) = self.disk.as_ref().and_then(|d| d.best_match(&prompt[..before_media], mem_len, scope)) {
            tried += 1;
            match self.restore(engine, &name, &prompt[..n]) {
                Some(s) if n < prompt.len() || engine.logits(&s).is_some() => return Ok((s, n)),
                Some(_) => break,
                None if tried >= 8 => break,
                None => {}
            }
        }
        if let Some(i) = mem {
            let held = self.memory.get(i).tokens.len();
            let session = if self.memory.get(i).checkpoint {
                self.memory.touch(i);
                engine.fork(&mut self.memory.get_mut(i).session)?
            } else {
                self.memory.take(i).session
            };
            if held < prompt.len() || engine.logits(&session).is_some() {
                return Ok((session, held));
            }
            tracing::debug!("held state matches the whole prompt but has no logits; prefilling afresh");
        }
        Ok((engine.new_session()?, 0))
    }

    /// A session from file `name` holding `tokens`; `None` (logged) when it cannot be used.
    fn restore<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, name: &str, tokens: &[u32]) -> Option<S> {
        let disk = self.disk.as_ref()?;
        let t = Instant::now();
        let r = disk.load(name, tokens).and_then(|r| {
            let from_file = r.from_file;
            engine.import_held(tokens, r.held).map(|s| (s, from_file))
        });
        match r {
            Ok((s, from_file)) => {
                let secs = t.elapsed().as_secs_f64();
                let saved = self.memory.prefill_cost_s(tokens.len());
                self.metrics.store.restored.inc();
                self.metrics.store.restored_tokens.inc_by(tokens.len() as u64);
                self.metrics.store.restore_seconds.inc_by(secs);
                self.metrics.store.restore_seconds_saved.inc_by(saved);
                tracing::info!(
                    tokens = tokens.len(),
                    file = name,
                    from = if from_file { "file" } else { "write queue" },
                    seconds = format!("{secs:.3}"),
                    prefill_s = format!("{saved:.3}"),
                    "session restored from disk instead of prefilled"
                );
                Some(s)
            }
            Err(e) => {
                tracing::warn!(tokens = tokens.len(), "could not restore a held session; prefilling instead: {e:#}");
                None
            }
        }
    }

    /// Holds `session` (the state of `tokens`); what memory evicts goes to disk.
    pub(crate) fn insert<E: GenerationEngine<Session = S>>(
        &mut self,
        engine: &mut E,
        tokens: Vec<u32>,
        media: Vec<MediaKey>,
        key: Option<String>,
        scope: Option<String>,
        session: S,
        checkpoint: bool,
    ) {
        let bytes = engine.session_bytes(&session);
        let evicted = self.memory.insert_keyed(tokens, media, key, scope, session, bytes, checkpoint);
        self.metrics.sessions_evicted.inc_by(evicted.len() as u64);
        for Evicted { entry, reason } in evicted {
            self.metrics.store.evicted(reason.as_str());
            if reason != EvictReason::Superseded {
                self.spill(engine, entry);
            }
        }
        self.gauges();
    }

    /// Writes an entry to disk (when there is a disk store and it holds no image).
    fn spill<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E, mut e: Entry<S>) {
        let Some(disk) = self.disk.as_ref() else { return };
        if !e.media.is_empty() || e.tokens.is_empty() {
            return;
        }
        match engine.export_held(&mut e.session) {
            Ok(held) => disk.put(&e.tokens, e.key.clone(), e.scope.clone(), held),
            Err(e) => tracing::warn!("could not export a held session for the disk: {e:#}"),
        }
    }

    /// Writes every session held in memory to disk and waits for the writer (shutdown).
    pub(crate) fn shutdown<E: GenerationEngine<Session = S>>(&mut self, engine: &mut E) {
        if self.disk.is_none() {
            return;
        }
        let t = Instant::now();
        let entries = self.memory.drain();
        let n = entries.len();
        for e in entries {
            self.spill(engine, e);
        }
        if let Some(d) = self.disk.as_mut() {
            d.flush();
            tracing::info!(
                sessions = n,
                files = d.files(),
                mb = format!("{:.1}", d.bytes() as f64 / 1e6),
                seconds = format!("{:.3}", t.elapsed().as_secs_f64()),
                dir = %d.dir().display(),
                "held sessions written"
            );
        }
        self.gauges();
    }
}
