//! `serve` over decoder ranks (see `docs/multi-mac.md`): rank 0 runs the HTTP server with a
//! [`RankedEngine`] around its engine; every other rank runs [`follow`] on its own engine. Each
//! engine call of rank 0 that changes a session (new, prefill, step, fork; drops ride along)
//! is first broadcast to the followers through an MLX collective, and they make the same call
//! on their copy of that session — so the model's own collectives (the MoE all_sums) meet in
//! the same order on every rank.
//!
//! A message is a header of [`HEADER`] i32 (`magic, op, session id, argument, payload length`)
//! and a payload (freed session ids, then token ids), each an all_sum to which the followers
//! contribute zeros.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};

use super::engine::{GenerationEngine, MediaSupport, PrefillReport};
use crate::distributed::{watchdog, Group};
use crate::vision::PreprocessedImage;

const MAGIC: i32 = 0x4b33_5231; // "K3R1"
const HEADER: usize = 6;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
enum Op {
    New = 1,
    Prefill = 2,
    Step = 3,
    Fork = 4,
    Shutdown = 5,
}

impl Op {
    fn from_i32(v: i32) -> Option<Op> {
        [Op::New, Op::Prefill, Op::Step, Op::Fork, Op::Shutdown].into_iter().find(|o| *o as i32 == v)
    }
}

/// One message from rank 0.
#[derive(Debug, PartialEq)]
struct Msg {
    op: Op,
    session: u32,
    /// Step: the token; Fork: the source session.
    arg: i32,
    freed: Vec<u32>,
    tokens: Vec<u32>,
}

impl Msg {
    fn header(&self) -> [i32; HEADER] {
        [MAGIC, self.op as i32, self.session as i32, self.arg, self.freed.len() as i32, self.tokens.len() as i32]
    }
    fn payload(&self) -> Vec<i32> {
        self.freed.iter().chain(&self.tokens).map(|&x| x as i32).collect()
    }
}

/// Sends (rank 0) or receives (the others) one message.
fn exchange(world: &Group, msg: Option<&Msg>) -> Result<Msg> {
    let h = world.broadcast_i32(msg.map(|m| m.header()).as_ref().map(|h| &h[..]), HEADER)?;
    if h[0] != MAGIC {
        bail!("rank {}: a broadcast from rank 0 is not a ranks message (header {h:?})", world.rank());
    }
    let op = Op::from_i32(h[1]).with_context(|| format!("rank {}: unknown op {} from rank 0", world.rank(), h[1]))?;
    let (nf, nt) = (h[4], h[5]);
    if nf < 0 || nt < 0 {
        bail!("rank {}: negative lengths in a message from rank 0 ({h:?})", world.rank());
    }
    let payload = msg.map(Msg::payload);
    let p = world.broadcast_i32(payload.as_deref(), (nf + nt) as usize)?;
    let (freed, tokens) = p.split_at(nf as usize);
    Ok(Msg {
        op,
        session: h[2] as u32,
        arg: h[3],
        freed: freed.iter().map(|&x| x as u32).collect(),
        tokens: tokens.iter().map(|&x| x as u32).collect(),
    })
}

/// A session of rank 0, known to the followers by its id.
pub struct RankedSession<S> {
    id: u32,
    inner: S,
    freed: Arc<Mutex<Vec<u32>>>,
}

impl<S> Drop for RankedSession<S> {
    fn drop(&mut self) {
        // the followers drop their copy with the next message
        self.freed.lock().unwrap_or_else(|e| e.into_inner()).push(self.id);
    }
}

/// Rank 0's engine: every session-changing call is mirrored on the other ranks.
pub struct RankedEngine<E: GenerationEngine> {
    inner: E,
    world: &'static Group,
    next_id: u32,
    freed: Arc<Mutex<Vec<u32>>>,
}

impl<E: GenerationEngine> RankedEngine<E> {
    pub fn new(inner: E, world: &'static Group) -> Self {
        RankedEngine { inner, world, next_id: 0, freed: Arc::new(Mutex::new(Vec::new())) }
    }

    fn send(&mut self, op: Op, session: u32, arg: i32, tokens: &[u32]) -> Result<()> {
        let freed = std::mem::take(&mut *self.freed.lock().unwrap_or_else(|e| e.into_inner()));
        let msg = Msg { op, session, arg, freed, tokens: tokens.to_vec() };
        let _guard = watchdog::guard(&format!("rank 0 of {} sending {op:?} to the other ranks", self.world.size()), self.world.step_timeout());
        exchange(self.world, Some(&msg)).with_context(|| format!("rank 0 of {}: sending {op:?} to the other ranks", self.world.size()))?;
        Ok(())
    }

    fn wrap(&self, id: u32, inner: E::Session) -> RankedSession<E::Session> {
        RankedSession { id, inner, freed: self.freed.clone() }
    }

    fn new_id(&mut self) -> u32 {
        self.next_id = self.next_id.wrapping_add(1);
        self.next_id
    }
}

impl<E: GenerationEngine> Drop for RankedEngine<E> {
    fn drop(&mut self) {
        if let Err(e) = self.send(Op::Shutdown, 0, 0, &[]) {
            tracing::warn!(error = %format!("{e:#}"), "could not tell the other ranks to stop");
        }
    }
}

impl<E: GenerationEngine> GenerationEngine for RankedEngine<E> {
    type Session = RankedSession<E::Session>;

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn new_session(&mut self) -> Result<Self::Session> {
        let id = self.new_id();
        self.send(Op::New, id, 0, &[])?;
        let s = self.inner.new_session()?;
        Ok(self.wrap(id, s))
    }
    fn prefill(&mut self, s: &mut Self::Session, tokens: &[u32]) -> Result<PrefillReport> {
        self.send(Op::Prefill, s.id, 0, tokens)?;
        self.inner.prefill(&mut s.inner, tokens)
    }
    fn step(&mut self, s: &mut Self::Session, token: u32) -> Result<()> {
        self.send(Op::Step, s.id, token as i32, &[])?;
        self.inner.step(&mut s.inner, token)
    }
    fn logits<'a>(&self, s: &'a Self::Session) -> Option<&'a [f32]> {
        self.inner.logits(&s.inner)
    }
    fn session_len(&self, s: &Self::Session) -> usize {
        self.inner.session_len(&s.inner)
    }
    fn session_bytes(&self, s: &Self::Session) -> usize {
        self.inner.session_bytes(&s.inner)
    }
    fn fork(&mut self, s: &mut Self::Session) -> Result<Self::Session> {
        let id = self.new_id();
        self.send(Op::Fork, id, s.id as i32, &[])?;
        let c = self.inner.fork(&mut s.inner)?;
        Ok(self.wrap(id, c))
    }
    fn media(&self) -> Option<MediaSupport> {
        None // images are not mirrored to the other ranks yet
    }
    fn prefill_images(&mut self, s: &mut Self::Session, tokens: &[u32], images: &[&PreprocessedImage]) -> Result<PrefillReport> {
        if !images.is_empty() {
            bail!("image inputs are not supported with decoder ranks yet");
        }
        self.prefill(s, tokens)
    }
}

/// A follower rank: makes rank 0's session calls on `engine` until rank 0 shuts down. Waiting
/// for the next call has no timeout (the server may be idle); the calls themselves run under
/// the engine's watchdog.
pub fn follow<E: GenerationEngine>(mut engine: E, world: &'static Group) -> Result<()> {
    let mut sessions: HashMap<u32, E::Session> = HashMap::new();
    let me = world.rank();
    tracing::info!(rank = me, "following rank 0's sessions");
    loop {
        let m = exchange(world, None)?;
        for id in &m.freed {
            sessions.remove(id);
        }
        let missing = |id: u32| anyhow::anyhow!("rank {me}: rank 0 refers to session {id}, which this rank does not hold");
        match m.op {
            Op::New => {
                let s = engine.new_session()?;
                sessions.insert(m.session, s);
            }
            Op::Prefill => {
                let s = sessions.get_mut(&m.session).ok_or_else(|| missing(m.session))?;
                engine.prefill(s, &m.tokens).with_context(|| format!("rank {me}: prefill of session {}", m.session))?;
            }
            Op::Step => {
                let s = sessions.get_mut(&m.session).ok_or_else(|| missing(m.session))?;
                engine.step(s, m.arg as u32).with_context(|| format!("rank {me}: step of session {}", m.session))?;
            }
            Op::Fork => {
                let src = sessions.get_mut(&(m.arg as u32)).ok_or_else(|| missing(m.arg as u32))?;
                let c = engine.fork(src)?;
                sessions.insert(m.session, c);
            }
            Op::Shutdown => {
                tracing::info!(rank = me, "rank 0 shut down");
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_through_their_integers() {
        let m = Msg { op: Op::Prefill, session: 7, arg: 0, freed: vec![3, 4], tokens: vec![1, 163839, 0] };
        let h = m.header();
        let p = m.payload();
        assert_eq!(h[0], MAGIC);
        assert_eq!(Op::from_i32(h[1]), Some(Op::Prefill));
        assert_eq!(p, vec![3, 4, 1, 163839, 0]);
        assert_eq!(Op::from_i32(0), None);
    }
}
