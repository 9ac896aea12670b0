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
//!
//! MLX's ring backend busy-polls its sockets while a collective waits, so a follower that sat
//! in the next message's all_sum while the server is idle would burn a core. Before each
//! message rank 0 rings a [`Doorbell`] — one byte on a plain TCP connection to every follower —
//! and an idle follower sleeps in a blocking read of it; it enters the collective only when a
//! message is on its way. The same connection tells a follower that rank 0 is gone (EOF).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::generation_engine::{GenerationEngine, MediaSupport, PrefillReport};
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
    Ok(Msg { op, session: h[2] as u32, arg: h[3], freed: freed.iter().map(|&x| x as u32).collect(), tokens: tokens.iter().map(|&x| x as u32).collect() })
}

/// The wake-up connections between rank 0 and the followers (see the module docs): rank 0
/// holds one stream per follower, a follower one stream to rank 0.
pub struct Doorbell {
    streams: Vec<(usize, TcpStream)>,
}

/// The host part of a `host:port` address (`[::1]:5000` → `::1`).
fn host_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_matches(|c| c == '[' || c == ']')
}

impl Doorbell {
    /// Connects rank 0 with every follower: rank 0 listens on its hostfile host (a free port,
    /// sent to the followers through a collective), each follower connects and names its rank.
    /// Every rank calls this at the same point (after loading the model).
    pub fn open(world: &Group) -> Result<Doorbell> {
        if !world.is_distributed() {
            return Ok(Doorbell { streams: Vec::new() });
        }
        let me = world.rank();
        let _guard = watchdog::guard(&format!("rank {me} of {} connecting the doorbell", world.size()), world.start_timeout());
        let host = world.addresses(0).first().map(|a| host_of(a).to_string()).context("rank 0 has no address in the hostfile")?;
        if me == 0 {
            let listener = TcpListener::bind((host.as_str(), 0)).with_context(|| format!("rank 0: binding the doorbell on {host}"))?;
            let port = listener.local_addr()?.port();
            world.broadcast_i32(Some(&[port as i32]), 1)?;
            let mut streams = Vec::with_capacity(world.size() - 1);
            while streams.len() + 1 < world.size() {
                let (mut s, peer) = listener.accept().context("rank 0: accepting a follower's doorbell connection")?;
                s.set_read_timeout(Some(Duration::from_secs(30)))?;
                let mut r = [0u8; 4];
                s.read_exact(&mut r).with_context(|| format!("rank 0: reading the rank of doorbell connection {peer}"))?;
                let r = u32::from_le_bytes(r) as usize;
                if r == 0 || r >= world.size() || streams.iter().any(|(x, _)| *x == r) {
                    bail!("rank 0: doorbell connection {peer} claims rank {r} (the group has ranks 1..{})", world.size() - 1);
                }
                s.set_read_timeout(None)?;
                s.set_nodelay(true)?;
                streams.push((r, s));
            }
            Ok(Doorbell { streams })
        } else {
            let port = world.broadcast_i32(None, 1)?[0];
            let port = u16::try_from(port).with_context(|| format!("rank {me}: rank 0 sent doorbell port {port}"))?;
            let addrs: Vec<_> = (host.as_str(), port).to_socket_addrs().with_context(|| format!("rank {me}: resolving rank 0's host {host}"))?.collect();
            let t0 = Instant::now();
            let mut s = loop {
                match addrs.iter().find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(5)).ok()) {
                    Some(s) => break s,
                    None if t0.elapsed() < Duration::from_secs(30) => std::thread::sleep(Duration::from_millis(100)),
                    None => bail!("rank {me}: could not connect to rank 0's doorbell at {host}:{port}"),
                }
            };
            s.set_nodelay(true)?;
            s.write_all(&(me as u32).to_le_bytes()).with_context(|| format!("rank {me}: greeting rank 0's doorbell"))?;
            Ok(Doorbell { streams: vec![(0, s)] })
        }
    }

    /// Rank 0: wakes every follower for the next message.
    fn ring(&mut self) -> Result<()> {
        for (r, s) in &mut self.streams {
            s.write_all(&[1]).with_context(|| format!("rank 0: waking rank {r} (its doorbell connection is gone: the rank has stopped)"))?;
        }
        Ok(())
    }

    /// A follower: sleeps until rank 0 rings (no CPU while the server is idle).
    fn wait(&mut self, me: usize) -> Result<()> {
        let Some((_, s)) = self.streams.first_mut() else { return Ok(()) };
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(1) => Ok(()),
            Ok(_) => bail!("rank {me}: rank 0 closed its doorbell connection (rank 0 has stopped)"),
            Err(e) => Err(e).with_context(|| format!("rank {me}: waiting for rank 0's next call")),
        }
    }
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
    doorbell: Doorbell,
    next_id: u32,
    freed: Arc<Mutex<Vec<u32>>>,
}

impl<E: GenerationEngine> RankedEngine<E> {
    /// Rank 0's engine; connects the doorbell (the followers do in [`follow`]).
    pub fn new(inner: E, world: &'static Group) -> Result<Self> {
        let doorbell = Doorbell::open(world)?;
        Ok(RankedEngine { inner, world, doorbell, next_id: 0, freed: Arc::new(Mutex::new(Vec::new())) })
    }

    fn send(&mut self, op: Op, session: u32, arg: i32, tokens: &[u32]) -> Result<()> {
        let freed = std::mem::take(&mut *self.freed.lock().unwrap_or_else(|e| e.into_inner()));
        let msg = Msg { op, session, arg, freed, tokens: tokens.to_vec() };
        let _guard = watchdog::guard(&format!("rank 0 of {} sending {op:?} to the other ranks", self.world.size()), self.world.step_timeout());
        self.doorbell.ring()?;
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
/// for the next call has no timeout (the server may be idle) and costs no CPU (a blocking read
/// of the doorbell); the calls themselves run under the engine's watchdog. When rank 0 is gone
/// (its doorbell connection closes) the follower fails at once.
pub fn follow<E: GenerationEngine>(mut engine: E, world: &'static Group) -> Result<()> {
    let mut sessions: HashMap<u32, E::Session> = HashMap::new();
    let me = world.rank();
    let mut doorbell = Doorbell::open(world)?;
    tracing::info!(rank = me, "following rank 0's sessions");
    loop {
        doorbell.wait(me)?;
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
