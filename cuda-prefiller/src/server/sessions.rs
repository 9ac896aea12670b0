//! Session prefixes the prefill node keeps between turns: for each decoder session, the tokens
//! it has prefilled so far and the hand-off state after them (the MLA latent rows of every
//! token plus the KDA recurrent and conv states of the latest turn). The next turn names that
//! prefix as its `base` and only its new tokens are prefilled.
//!
//! Bounded three ways:
//! - **bytes**: the sum of held states stays under `max_bytes`; the least recently used idle
//!   prefix is evicted first;
//! - **lease**: a prefix unused for `lease` is dropped (a decoder that went away does not pin
//!   memory forever);
//! - **one request at a time**: a request takes its base prefix out of the store (leases it)
//!   while it computes; a second request naming the same session meanwhile is refused as busy.
//!
//! A prefix is replaced only by a request that completed (every byte delivered): a failed
//! request gives its base back unchanged, or drops it when the executor may have touched it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k3_protocol::handoff::{token_prefix_hash, HandoffState};
use k3_protocol::wire::{BasePrefix, SessionId};

/// Limits of a [`PrefixStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreLimits {
    /// Most bytes of held state (fp32 state plus 4 bytes per token id).
    pub max_bytes: u64,
    /// A prefix idle for this long is dropped.
    pub lease: Duration,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits { max_bytes: 16 << 30, lease: Duration::from_secs(30 * 60) }
    }
}

/// A prefix taken out of the store for one request.
#[derive(Debug)]
pub struct Leased {
    pub session: SessionId,
    /// Every token the state covers.
    pub tokens: Vec<u32>,
    pub state: HandoffState,
}

/// Why a base prefix cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    #[error("session {0} holds no prefix on this node (never stored, evicted, or expired)")]
    Unknown(SessionId),
    #[error("session {session}: the request names a base of {asked} tokens, this node holds {held}")]
    Length { session: SessionId, asked: u64, held: u64 },
    #[error("session {0}: the base's token hash differs from the prefix held here")]
    Hash(SessionId),
    #[error("session {0} is in use by another request")]
    Busy(SessionId),
}

#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    hash: String,
    /// None while leased.
    state: Option<HandoffState>,
    bytes: u64,
    last_used: Instant,
}

/// What the store holds, for metrics and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreStats {
    pub sessions: usize,
    pub leased: usize,
    pub bytes: u64,
    pub evicted: u64,
    pub expired: u64,
}

/// The bounded store of session prefixes. Not synchronised: keep it behind a mutex.
#[derive(Debug)]
pub struct PrefixStore {
    limits: StoreLimits,
    entries: HashMap<SessionId, Entry>,
    evicted: u64,
    expired: u64,
}

fn entry_bytes(tokens: &[u32], state: &HandoffState) -> u64 {
    state.nbytes() as u64 + 4 * tokens.len() as u64
}

impl PrefixStore {
    pub fn new(limits: StoreLimits) -> PrefixStore {
        PrefixStore { limits, entries: HashMap::new(), evicted: 0, expired: 0 }
    }

    pub fn limits(&self) -> StoreLimits {
        self.limits
    }

    pub fn stats(&self) -> StoreStats {
        StoreStats {
            sessions: self.entries.len(),
            leased: self.entries.values().filter(|e| e.state.is_none()).count(),
            bytes: self.entries.values().map(|e| e.bytes).sum(),
            evicted: self.evicted,
            expired: self.expired,
        }
    }

    /// Tokens held for `session` (None when nothing is held).
    pub fn held_tokens(&self, session: &SessionId) -> Option<usize> {
        self.entries.get(session).map(|e| e.tokens.len())
    }

    /// Takes the prefix `base` of `session` out of the store for one request.
    pub fn lease(&mut self, session: SessionId, base: &BasePrefix, now: Instant) -> Result<Leased, LeaseError> {
        self.expire(now);
        let e = self.entries.get_mut(&session).ok_or(LeaseError::Unknown(session))?;
        if e.state.is_none() {
            return Err(LeaseError::Busy(session));
        }
        if base.tokens != e.tokens.len() as u64 {
            return Err(LeaseError::Length { session, asked: base.tokens, held: e.tokens.len() as u64 });
        }
        if base.token_prefix_hash != e.hash {
            return Err(LeaseError::Hash(session));
        }
        e.last_used = now;
        let state = e.state.take().ok_or(LeaseError::Busy(session))?;
        Ok(Leased { session, tokens: e.tokens.clone(), state })
    }

    /// Marks `session` as in use by a request that starts from scratch (no base), so that a
    /// concurrent request on the same session is refused. Err(Busy) when it already is.
    pub fn claim_fresh(&mut self, session: SessionId, now: Instant) -> Result<Option<Leased>, LeaseError> {
        self.expire(now);
        match self.entries.get_mut(&session) {
            Some(e) if e.state.is_none() => Err(LeaseError::Busy(session)),
            Some(e) => {
                e.last_used = now;
                let state = e.state.take().ok_or(LeaseError::Busy(session))?;
                Ok(Some(Leased { session, tokens: e.tokens.clone(), state }))
            }
            None => Ok(None),
        }
    }

    /// Gives a leased prefix back unchanged (the request failed before touching it).
    pub fn release(&mut self, leased: Leased, now: Instant) {
        match self.entries.get_mut(&leased.session) {
            Some(e) if e.state.is_none() && e.tokens == leased.tokens => {
                e.state = Some(leased.state);
                e.last_used = now;
            }
            _ => tracing::debug!(session = %leased.session, "released prefix no longer has a slot; dropped"),
        }
        self.evict(now);
    }

    /// Drops whatever is held (or leased) for `session`.
    pub fn forget(&mut self, session: &SessionId) {
        self.entries.remove(session);
    }

    /// Drops `session`'s prefix if it is exactly `tokens` and no request holds it.
    pub fn forget_if_idle(&mut self, session: &SessionId, tokens: &[u32]) {
        if self.entries.get(session).is_some_and(|e| e.state.is_some() && e.tokens == tokens) {
            self.entries.remove(session);
        }
    }

    /// Stores the prefix after a completed request (replacing the session's previous one, leased
    /// or not), then evicts down to the byte limit. Returns false when the state alone is over
    /// the limit and was not kept.
    pub fn store(&mut self, session: SessionId, tokens: Vec<u32>, state: HandoffState, now: Instant) -> bool {
        let bytes = entry_bytes(&tokens, &state);
        if bytes > self.limits.max_bytes {
            tracing::warn!(
                %session,
                bytes,
                limit = self.limits.max_bytes,
                "session prefix larger than the whole store; not kept (the next turn resends everything)"
            );
            self.entries.remove(&session);
            return false;
        }
        let hash = token_prefix_hash(&tokens);
        self.entries.insert(session, Entry { tokens, hash, state: Some(state), bytes, last_used: now });
        self.evict(now);
        self.entries.contains_key(&session)
    }

    /// Drops prefixes idle longer than the lease.
    pub fn expire(&mut self, now: Instant) {
        let lease = self.limits.lease;
        let before = self.entries.len();
        self.entries.retain(|id, e| {
            let keep = e.state.is_none() || now.saturating_duration_since(e.last_used) <= lease;
            if !keep {
                tracing::info!(session = %id, tokens = e.tokens.len(), bytes = e.bytes, "session prefix expired (lease over)");
            }
            keep
        });
        self.expired += (before - self.entries.len()) as u64;
    }

    /// Evicts expired prefixes, then idle ones by least recent use, until under the byte limit.
    fn evict(&mut self, now: Instant) {
        self.expire(now);
        loop {
            let total: u64 = self.entries.values().map(|e| e.bytes).sum();
            if total <= self.limits.max_bytes {
                return;
            }
            let victim = self.entries.iter().filter(|(_, e)| e.state.is_some()).min_by_key(|(_, e)| e.last_used).map(|(id, _)| *id);
            let Some(id) = victim else { return }; // only leased entries left: they come back later
            if let Some(e) = self.entries.remove(&id) {
                self.evicted += 1;
                tracing::info!(session = %id, tokens = e.tokens.len(), bytes = e.bytes, total, limit = self.limits.max_bytes, "session prefix evicted (least recently used)");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_protocol::handoff::{LayerState, MlaState};

    fn state(tokens: usize) -> HandoffState {
        HandoffState { tokens, layers: vec![LayerState::Mla(MlaState { width: 4, latent: vec![0.5; 4 * tokens] })] }
    }

    fn base(tokens: &[u32]) -> BasePrefix {
        BasePrefix { tokens: tokens.len() as u64, token_prefix_hash: token_prefix_hash(tokens) }
    }

    fn sid(b: u8) -> SessionId {
        SessionId([b; 16])
    }

    #[test]
    fn lease_checks_length_and_hash_then_is_exclusive() {
        let now = Instant::now();
        let mut s = PrefixStore::new(StoreLimits::default());
        assert!(s.store(sid(1), vec![1, 2, 3], state(3), now));
        assert_eq!(s.lease(sid(2), &base(&[1, 2, 3]), now).unwrap_err(), LeaseError::Unknown(sid(2)));
        assert!(matches!(s.lease(sid(1), &base(&[1, 2]), now), Err(LeaseError::Length { asked: 2, held: 3, .. })));
        assert_eq!(s.lease(sid(1), &base(&[1, 2, 4]), now).unwrap_err(), LeaseError::Hash(sid(1)));
        let l = s.lease(sid(1), &base(&[1, 2, 3]), now).unwrap();
        assert_eq!(l.state.tokens, 3);
        assert_eq!(s.lease(sid(1), &base(&[1, 2, 3]), now).unwrap_err(), LeaseError::Busy(sid(1)));
        assert_eq!(s.claim_fresh(sid(1), now).unwrap_err(), LeaseError::Busy(sid(1)));
        s.release(l, now);
        assert_eq!(s.lease(sid(1), &base(&[1, 2, 3]), now).unwrap().tokens, vec![1, 2, 3]);
    }

    #[test]
    fn evicts_least_recently_used_idle_prefix_and_expires_old_ones() {
        let t0 = Instant::now();
        let one = entry_bytes(&[0; 10], &state(10));
        let mut s = PrefixStore::new(StoreLimits { max_bytes: 2 * one, lease: Duration::from_secs(60) });
        let toks: Vec<u32> = (0..10).collect();
        assert!(s.store(sid(1), toks.clone(), state(10), t0));
        assert!(s.store(sid(2), toks.clone(), state(10), t0 + Duration::from_secs(1)));
        // Touch 1, so 2 is the least recently used.
        let l = s.lease(sid(1), &base(&toks), t0 + Duration::from_secs(2)).unwrap();
        s.release(l, t0 + Duration::from_secs(2));
        assert!(s.store(sid(3), toks.clone(), state(10), t0 + Duration::from_secs(3)));
        assert_eq!(s.held_tokens(&sid(2)), None);
        assert_eq!(s.held_tokens(&sid(1)), Some(10));
        assert_eq!(s.held_tokens(&sid(3)), Some(10));
        assert_eq!(s.stats().evicted, 1);
        assert!(s.stats().bytes <= 2 * one);
        // A leased entry is never evicted.
        let l1 = s.lease(sid(1), &base(&toks), t0 + Duration::from_secs(4)).unwrap();
        assert!(s.store(sid(4), toks.clone(), state(10), t0 + Duration::from_secs(5)));
        assert_eq!(s.held_tokens(&sid(1)), Some(10));
        assert_eq!(s.held_tokens(&sid(3)), None);
        s.release(l1, t0 + Duration::from_secs(5));
        // Lease: idle past 60 s → gone.
        s.expire(t0 + Duration::from_secs(70));
        assert_eq!(s.stats().sessions, 0);
        assert_eq!(s.stats().expired, 2);
    }

    #[test]
    fn a_state_over_the_limit_is_not_kept() {
        let now = Instant::now();
        let mut s = PrefixStore::new(StoreLimits { max_bytes: 10, lease: Duration::from_secs(60) });
        assert!(!s.store(sid(1), vec![1, 2, 3], state(3), now));
        assert_eq!(s.stats().sessions, 0);
    }
}
