//! A [`Conversation`]: a decoder [`Session`] plus every token it holds, and what the prefill node
//! keeps of it.
//!
//! After a remote prefill the node keeps the session's prefix (all tokens so far); the decoder
//! then generates tokens locally, which the node has not seen. The next remote turn names the
//! node's prefix as `base` and sends everything after it — the generated tokens and the new
//! prompt — so the node prefills only those. The returned delta starts at the node's prefix,
//! so the decoder *rewinds* its session to that point: the MLA latent rows are cut back to the
//! prefix, and the KDA recurrent and conv states need no rewind because the delta carries them
//! whole (the full state after every token). The rows and states the decoder computed for its
//! own generated tokens are replaced by the node's.

use anyhow::{bail, Result};
use k3_protocol::config::TextConfig;
use k3_protocol::handoff::token_prefix_hash;
use k3_protocol::wire::{BasePrefix, SessionId};

use crate::decode::{Engine, ImageEmbeds, Session};
use crate::decode_loop::{GenerateOutput, GenerateParams};
use crate::ingest::StagedDelta;

/// What the prefill node holds for this conversation.
pub(crate) struct RemotePrefix {
    pub(crate) tokens: usize,
    pub(crate) hash: String,
}

/// A remote request's plan: what to send, and where the delta will start.
pub(crate) struct RemotePlan {
    pub(crate) base: Option<BasePrefix>,
    /// Tokens to prefill remotely: the conversation after the node's prefix, then the new ones.
    pub(crate) tokens: Vec<u32>,
    /// Offset of the new tokens inside `tokens` (image positions shift by it).
    pub(crate) new_offset: usize,
}

/// A decoder session with its token history and its prefix on the prefill node.
pub struct Conversation {
    session: Session,
    history: Vec<u32>,
    id: SessionId,
    pub(crate) remote: Option<RemotePrefix>,
    /// The session no longer matches `history` (a decode step failed half-way).
    broken: bool,
}

impl Conversation {
    pub fn new(engine: &Engine) -> Result<Conversation> {
        Ok(Conversation { session: engine.new_session()?, history: Vec::new(), id: SessionId::random(), remote: None, broken: false })
    }

    /// A conversation holding `tokens` from their state (a session restored from disk): the
    /// state is checked against the model and must hold exactly `tokens.len()` tokens. The
    /// prefill node holds nothing of it (a new id).
    pub fn restore(engine: &Engine, tokens: &[u32], state: &k3_protocol::handoff::HandoffState, logits: Option<Vec<f32>>) -> Result<Conversation> {
        if state.tokens != tokens.len() {
            bail!("the state holds {} tokens, {} were given", state.tokens, tokens.len());
        }
        let mut c = Conversation::new(engine)?;
        engine.ingest(&mut c.session, 0, state, logits)?;
        c.history = tokens.to_vec();
        Ok(c)
    }

    /// The decoder session (its caches and last logits).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Every token the session holds, prompts and generated ones.
    pub fn tokens(&self) -> &[u32] {
        &self.history
    }

    /// The id the prefill node knows this conversation by.
    pub fn id(&self) -> SessionId {
        self.id
    }

    /// Tokens of this conversation the prefill node holds (0 when none).
    pub fn remote_prefix_tokens(&self) -> usize {
        self.remote.as_ref().map_or(0, |r| r.tokens)
    }

    pub fn last_logits(&self) -> Option<&[f32]> {
        self.session.last_logits()
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.broken || self.history.len() != self.session.tokens() {
            bail!(
                "conversation out of step: {} tokens recorded, the session holds {} (a decode step failed earlier; start a new conversation)",
                self.history.len(),
                self.session.tokens()
            );
        }
        Ok(())
    }

    /// Prefills `tokens` locally (after everything the session holds).
    pub fn prefill_local(&mut self, engine: &Engine, tokens: &[u32], image: Option<&ImageEmbeds>) -> Result<Vec<f32>> {
        self.check()?;
        let before = self.session.tokens();
        let r = engine.prefill_local(&mut self.session, tokens, image);
        match &r {
            Ok(_) => self.history.extend_from_slice(tokens),
            Err(_) if self.session.tokens() != before => self.broken = true,
            Err(_) => {}
        }
        r
    }

    /// The decode loop ([`Engine::generate`]); every emitted token joins the history.
    pub fn generate(&mut self, engine: &Engine, params: &GenerateParams, mut on_token: impl FnMut(u32) -> bool) -> Result<GenerateOutput> {
        self.check()?;
        let before = self.session.tokens();
        let mut emitted = Vec::new();
        let r = engine.generate(&mut self.session, params, |t| {
            emitted.push(t);
            on_token(t)
        });
        // Every emitted token is fed, except when a step failed half-way.
        let fed = self.session.tokens() - before;
        if fed <= emitted.len() {
            self.history.extend_from_slice(&emitted[..fed]);
        } else {
            self.broken = true;
        }
        r
    }

    /// What to send for `new` tokens. Refuses (Err) when the resent part holds media
    /// placeholders: their image embeddings are not kept, so only a local prefill is correct.
    pub(crate) fn plan_remote(&self, new: &[u32], media_token: u32) -> Result<RemotePlan> {
        self.check()?;
        let from = self.remote.as_ref().map_or(0, |r| r.tokens);
        let resend = &self.history[from..];
        if resend.contains(&media_token) {
            bail!("the {} tokens the prefill node has not seen hold an image placeholder whose embeddings are gone", resend.len());
        }
        let base = self.remote.as_ref().map(|r| BasePrefix { tokens: r.tokens as u64, token_prefix_hash: r.hash.clone() });
        let mut tokens = resend.to_vec();
        tokens.extend_from_slice(new);
        Ok(RemotePlan { base, tokens, new_offset: resend.len() })
    }

    /// Forgets the node's prefix (it said it no longer holds it).
    pub(crate) fn drop_remote(&mut self) {
        self.remote = None;
    }

    /// Installs a verified remote delta: the session rewound to the node's prefix, the staged
    /// layers on top, `logits` as the last logits. Builds the whole new cache before touching the
    /// session, so an error leaves the conversation as it was.
    pub(crate) fn commit_remote(&mut self, c: &TextConfig, plan: &RemotePlan, new: &[u32], staged: StagedDelta, logits: Vec<f32>) -> Result<()> {
        self.check()?;
        if logits.len() != c.vocab_size {
            bail!("last logits hold {} values, the vocabulary has {}", logits.len(), c.vocab_size);
        }
        if let Some(i) = logits.iter().position(|x| !x.is_finite()) {
            bail!("last logits hold a non-finite value at index {i}");
        }
        let base = plan.base.as_ref().map_or(0, |b| b.tokens as usize);
        if staged.rows() != plan.tokens.len() {
            bail!("the delta holds {} rows, {} tokens were sent", staged.rows(), plan.tokens.len());
        }
        if base > 0 && self.remote.as_ref().map(|r| r.tokens) != Some(base) {
            bail!("internal: the delta starts at token {base}, which is not the prefix this conversation recorded");
        }
        let new_cache = staged.commit(self.session.cache_mut(), base)?;
        // Commit.
        *self.session.cache_mut() = new_cache;
        self.session.set_last_logits(Some(logits));
        self.history.truncate(base);
        self.history.extend_from_slice(&plan.tokens[..plan.new_offset.min(plan.tokens.len())]);
        self.history.extend_from_slice(new);
        debug_assert_eq!(self.history.len(), self.session.tokens());
        self.remote = Some(RemotePrefix { tokens: self.history.len(), hash: token_prefix_hash(&self.history) });
        Ok(())
    }
}

/// For callers that run their own decode loop and keep copies (the OpenAI server).
impl Conversation {
    /// Feeds one token the caller sampled; it joins the history. Returns the next logits.
    pub fn step(&mut self, engine: &Engine, token: u32) -> Result<Vec<f32>> {
        self.check()?;
        let before = self.session.tokens();
        match engine.step(&mut self.session, token) {
            Ok(logits) => {
                self.history.push(token);
                Ok(logits)
            }
            Err(e) => {
                if self.session.tokens() != before {
                    self.broken = true;
                }
                Err(e)
            }
        }
    }

    /// One decode step of several conversations at once ([`Engine::step_batch`]); each one's
    /// token joins its history. A step that fails half-way marks the conversations it changed
    /// as broken.
    pub fn step_batch(engine: &Engine, convs: &mut [&mut Conversation], tokens: &[u32]) -> Result<()> {
        convs.iter().try_for_each(|c| c.check())?;
        let before: Vec<usize> = convs.iter().map(|c| c.session.tokens()).collect();
        let mut sessions: Vec<&mut Session> = convs.iter_mut().map(|c| &mut c.session).collect();
        let r = engine.step_batch(&mut sessions, tokens);
        for ((c, b), &t) in convs.iter_mut().zip(before).zip(tokens) {
            match &r {
                Ok(()) => c.history.push(t),
                Err(_) if c.session.tokens() != b => c.broken = true,
                Err(_) => {}
            }
        }
        r
    }

    /// An independent copy (a checkpoint): the same state (sharing its arrays, nothing is
    /// copied), the same history, and the same id and node prefix. Whichever copy continues first
    /// extends the node's prefix; the node checks a base's length and hash, so the other copy's
    /// next remote turn is refused as `BaseNotHeld` and resent whole.
    pub fn fork(&mut self, engine: &Engine) -> Result<Conversation> {
        self.check()?;
        let session = engine.fork_session(&mut self.session)?;
        Ok(Conversation {
            session,
            history: self.history.clone(),
            id: self.id,
            remote: self.remote.as_ref().map(|r| RemotePrefix { tokens: r.tokens, hash: r.hash.clone() }),
            broken: false,
        })
    }
}
