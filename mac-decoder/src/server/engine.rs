//! What the server needs from a model: a small trait, so the HTTP layer, the session store and
//! the decode loop are tested with a fake engine, and the MLX engine plugs in behind it.

use std::time::Duration;

use crate::vision::PreprocessedImage;

/// How a prefill ran.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillReport {
    /// Tokens prefilled by this call.
    pub tokens: usize,
    /// Prefilled on the GPU node (else locally).
    pub remote: bool,
    pub seconds: f64,
    /// Hand-off bytes received from the prefill node.
    pub handoff_bytes: u64,
    /// Time between the prefill node's last computed layer and the state being usable here
    /// (the part of the hand-off not hidden behind compute).
    pub exposed_tail_seconds: f64,
    /// A remote prefill failed and the tokens were prefilled locally instead.
    pub fell_back: bool,
    /// Why the prompt went where it went (the threshold, or the cause of a fallback); empty
    /// when the engine has no choice.
    pub reason: String,
    /// Images run through the vision tower for this prefill, and the seconds it took.
    pub images: usize,
    pub vision_seconds: f64,
    /// The prefill node runs a different, state-compatible model: "accepted" or "refused"
    /// (`remote::CompatibleSource`).
    pub compatible_source: Option<&'static str>,
}

/// What the HTTP side needs to prepare images for an engine that takes them.
#[derive(Debug, Clone)]
pub struct MediaSupport {
    /// Pre-processing settings (`preprocessor_config.json` or the published defaults).
    pub config: crate::vision::MediaProcConfig,
    /// The `<|media_pad|>` id (`media_placeholder_token_id`).
    pub pad_id: u32,
}

/// A model the server can drive. The engine is built on, and only used from, one dedicated
/// thread (MLX arrays stay on the thread that made them), so it needs neither `Send` nor `Sync`.
pub trait GenerationEngine: 'static {
    /// One sequence's state (caches and the logits of its last position).
    type Session: 'static;

    /// Number of ids the model scores (`lm_head` rows).
    fn vocab_size(&self) -> usize;
    /// Longest sequence the model accepts (prompt + generated).
    fn max_context(&self) -> usize;
    fn new_session(&mut self) -> anyhow::Result<Self::Session>;
    /// Feeds `tokens` after what the session holds; afterwards [`Self::logits`] predicts the
    /// token after the last of them.
    fn prefill(&mut self, s: &mut Self::Session, tokens: &[u32]) -> anyhow::Result<PrefillReport>;
    /// Feeds one generated token.
    fn step(&mut self, s: &mut Self::Session, token: u32) -> anyhow::Result<()>;
    /// Feeds `tokens[i]` to `sessions[i]`: one decode step of several sessions (continuous
    /// batching). An engine that can stacks them into one forward pass; the default steps them
    /// one after another. Each session ends as [`Self::step`] would leave it.
    fn step_batch(&mut self, sessions: &mut [&mut Self::Session], tokens: &[u32]) -> anyhow::Result<()> {
        anyhow::ensure!(sessions.len() == tokens.len(), "{} sessions for {} tokens", sessions.len(), tokens.len());
        sessions.iter_mut().zip(tokens).try_for_each(|(s, &t)| self.step(s, t))
    }
    /// Sessions decoded together at most (the rest of the admitted requests wait their turn).
    fn max_batch(&self) -> usize {
        8
    }
    /// Tokens per prefill call when the server may split a prompt's prefill into calls and run
    /// decode steps of the other requests between them (the calls continue the session, so
    /// the result is the same); `None` (the default): one call per prompt (e.g. a prompt that
    /// may go to a prefill node whole).
    fn prefill_chunk(&self) -> Option<usize> {
        None
    }
    /// The flag that cancels the prefill in progress (checked between chunks locally, and on
    /// every event of a remote transfer); `None` clears it. The default ignores it.
    fn set_cancel(&mut self, _flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>) {}
    /// Logits of the next token, if the session has any.
    fn logits<'a>(&self, s: &'a Self::Session) -> Option<&'a [f32]>;
    /// Tokens the session holds.
    fn session_len(&self, s: &Self::Session) -> usize;
    /// Bytes of state the session holds (for the store's budget).
    fn session_bytes(&self, s: &Self::Session) -> usize;
    /// An independent copy of a session (a checkpoint: KDA states cannot be rolled back, so
    /// reuse after a divergence needs a copy taken before it). `s` is mutable because the copy
    /// may share state with it (the MLX engine freezes its rows into shared segments).
    fn fork(&mut self, s: &mut Self::Session) -> anyhow::Result<Self::Session>;

    /// Image support: `None` (the default) when the model has no vision tower.
    fn media(&self) -> Option<MediaSupport> {
        None
    }
    /// Like [`Self::prefill`], but `tokens` hold `<|media_pad|>` runs, one per image of
    /// `images` in order, each as long as that image's feature rows: the engine encodes the
    /// images and the k-th pad takes the k-th row.
    fn prefill_images(&mut self, s: &mut Self::Session, tokens: &[u32], images: &[&PreprocessedImage]) -> anyhow::Result<PrefillReport> {
        if images.is_empty() {
            return self.prefill(s, tokens);
        }
        anyhow::bail!("this engine does not take images")
    }
}

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
pub struct FakeEngine {
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
pub struct FakeSession {
    pub tokens: Vec<u32>,
    logits: Option<Vec<f32>>,
}

impl FakeEngine {
    pub fn new(
        vocab: usize,
        max_context: usize,
        reply_marker: Vec<u32>,
        stop_id: u32,
        responder: impl Fn(&[u32]) -> Vec<u32> + Send + 'static,
    ) -> Self {
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
