//! The MLX K3 engine ([`crate::decode::Engine`]) behind the server's [`GenerationEngine`] trait.
//! Prompts are prefilled locally (chunked); a session copy (checkpoint) goes through the
//! canonical hand-off state: export, then ingest into a fresh session.

use std::path::Path;
use std::time::Instant;

use super::engine::{GenerationEngine, PrefillReport};
use crate::decode::{Engine, EngineOptions, Session};

pub struct MlxEngine {
    engine: Engine,
    max_context: usize,
}

impl MlxEngine {
    /// Loads the checkpoint; `max_context` 0 means the config's `max_position_embeddings`.
    pub fn load(dir: &Path, options: EngineOptions, max_context: usize) -> anyhow::Result<Self> {
        let engine = Engine::load_with(dir, options)?;
        let max_context = if max_context == 0 { engine.text_config().max_position_embeddings } else { max_context };
        Ok(MlxEngine { engine, max_context })
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

impl GenerationEngine for MlxEngine {
    type Session = Session;

    fn vocab_size(&self) -> usize {
        self.engine.text_config().vocab_size
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn new_session(&mut self) -> anyhow::Result<Session> {
        self.engine.new_session()
    }
    fn prefill(&mut self, s: &mut Session, tokens: &[u32]) -> anyhow::Result<PrefillReport> {
        let t0 = Instant::now();
        self.engine.prefill_local(s, tokens, None)?;
        Ok(PrefillReport { tokens: tokens.len(), seconds: t0.elapsed().as_secs_f64(), ..Default::default() })
    }
    fn step(&mut self, s: &mut Session, token: u32) -> anyhow::Result<()> {
        self.engine.step(s, token).map(|_| ())
    }
    fn logits<'a>(&self, s: &'a Session) -> Option<&'a [f32]> {
        s.last_logits()
    }
    fn session_len(&self, s: &Session) -> usize {
        s.tokens()
    }
    fn session_bytes(&self, s: &Session) -> usize {
        s.state_bytes()
    }
    fn fork(&mut self, s: &Session) -> anyhow::Result<Session> {
        let state = self.engine.export_state(s)?;
        let mut copy = self.engine.new_session()?;
        self.engine.ingest(&mut copy, 0, &state, s.last_logits().map(<[f32]>::to_vec))?;
        Ok(copy)
    }
}
