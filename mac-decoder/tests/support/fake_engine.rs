//! The deterministic stand-in model of the server tests: a [`GenerationEngine`] whose next
//! token is a function of every token the session has consumed, with simulated prefill and step
//! times. Lives with the tests (the server's trait is all it needs).

use std::time::Duration;

use mac_decoder::engine::{GenerationEngine, PrefillReport};

/// The fake engine's script: the whole reply to a prompt.
type Responder = Box<dyn Fn(&[u32]) -> Vec<u32> + Send>;

/// A deterministic stand-in model for tests: the next token is a function of every token the
/// session has consumed, so a wrongly reused or corrupted session changes the output.
///
/// `responder(prompt)` gives the whole reply for a prompt; a reply starts after the last
/// occurrence of `reply_marker` (the generation prompt's ids) in the session. Past the end of
/// the reply it emits `stop_id`. Without a reply marker in the history (raw completions) the
/// next token is a hash of the whole history. Logits are one-hot, so greedy and any sampling
/// agree.
pub(crate) struct FakeEngine {
    vocab: usize,
    max_context: usize,
    reply_marker: Vec<u32>,
    stop_id: u32,
    responder: Responder,
    /// Simulated time per prefilled token.
    pub prefill_delay_per_token: Duration,
    /// Simulated time per generated token (per batched step: see [`GenerationEngine::step_batch`]).
    pub step_delay: Duration,
    /// Set by the worker around a prefill: a simulated prefill stops when it is raised.
    cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// [`GenerationEngine::prefill_chunk`] (default `None`).
    pub prefill_chunk: Option<usize>,
}

/// A [`FakeEngine`] session: the tokens consumed and the next-token logits.
pub(crate) struct FakeSession {
    pub tokens: Vec<u32>,
    logits: Option<Vec<f32>>,
}

impl FakeEngine {
    pub(crate) fn new(vocab: usize, max_context: usize, reply_marker: Vec<u32>, stop_id: u32, responder: impl Fn(&[u32]) -> Vec<u32> + Send + 'static) -> Self {
        FakeEngine {
            vocab,
            max_context,
            reply_marker,
            stop_id,
            responder: Box::new(responder),
            prefill_delay_per_token: Duration::ZERO,
            step_delay: Duration::ZERO,
            cancel: None,
            prefill_chunk: None,
        }
    }

    fn next_token(&self, history: &[u32]) -> u32 {
        let m = &self.reply_marker;
        let start = (m.len()..=history.len()).rev().find(|&end| !m.is_empty() && history[end - m.len()..end] == m[..]);
        match start {
            Some(start) => {
                let reply = (self.responder)(&history[..start]);
                reply.get(history.len() - start).copied().unwrap_or(self.stop_id)
            }
            // Outside a chat reply: a deterministic function of the whole history (FNV-1a),
            // an ordinary id below 256 (a byte token).
            None => {
                let h = history.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ t as u64).wrapping_mul(0x100_0000_01b3));
                (h % 200) as u32 + 40
            }
        }
    }

    fn set_logits(&self, s: &mut FakeSession) {
        let next = self.next_token(&s.tokens) as usize;
        let mut l = vec![0.0f32; self.vocab];
        if next < self.vocab {
            l[next] = 10.0;
        }
        s.logits = Some(l);
    }
}

impl GenerationEngine for FakeEngine {
    type Session = FakeSession;

    fn vocab_size(&self) -> usize {
        self.vocab
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn new_session(&mut self) -> anyhow::Result<FakeSession> {
        Ok(FakeSession { tokens: Vec::new(), logits: None })
    }
    fn prefill(&mut self, s: &mut FakeSession, tokens: &[u32]) -> anyhow::Result<PrefillReport> {
        anyhow::ensure!(!tokens.is_empty(), "prefill of no tokens");
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            anyhow::bail!("token {bad} is outside the vocabulary (size {})", self.vocab);
        }
        let t0 = std::time::Instant::now();
        // the simulated time in slices of at most 10 ms, each checking the cancel flag
        let total = self.prefill_delay_per_token * tokens.len() as u32;
        while t0.elapsed() < total {
            if self.cancel.as_ref().is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed)) {
                anyhow::bail!("prefill cancelled");
            }
            std::thread::sleep((total - t0.elapsed()).min(Duration::from_millis(10)));
        }
        s.tokens.extend_from_slice(tokens);
        self.set_logits(s);
        Ok(PrefillReport { tokens: tokens.len(), seconds: t0.elapsed().as_secs_f64(), ..Default::default() })
    }
    fn step(&mut self, s: &mut FakeSession, token: u32) -> anyhow::Result<()> {
        std::thread::sleep(self.step_delay);
        s.tokens.push(token);
        self.set_logits(s);
        Ok(())
    }
    fn set_cancel(&mut self, flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>) {
        self.cancel = flag;
    }
    fn prefill_chunk(&self) -> Option<usize> {
        self.prefill_chunk
    }
    /// A batched step: the simulated step time is paid once for the whole batch.
    fn step_batch(&mut self, sessions: &mut [&mut FakeSession], tokens: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(sessions.len() == tokens.len(), "{} sessions for {} tokens", sessions.len(), tokens.len());
        std::thread::sleep(self.step_delay);
        for (s, &t) in sessions.iter_mut().zip(tokens) {
            s.tokens.push(t);
            self.set_logits(s);
        }
        Ok(())
    }
    fn logits<'a>(&self, s: &'a FakeSession) -> Option<&'a [f32]> {
        s.logits.as_deref()
    }
    fn session_len(&self, s: &FakeSession) -> usize {
        s.tokens.len()
    }
    fn session_bytes(&self, s: &FakeSession) -> usize {
        s.tokens.len() * 4 + 64
    }
    fn fork(&mut self, s: &mut FakeSession) -> anyhow::Result<FakeSession> {
        Ok(FakeSession { tokens: s.tokens.clone(), logits: s.logits.clone() })
    }
}
