//! The session store: held sequence states keyed by their token prefix, evicted by what they
//! would cost to prefill again.
//!
//! A request whose prompt starts with a held entry's tokens continues from it, so only the new
//! tokens are prefilled. K3's KDA layers are recurrent and cannot be trimmed back, so a state
//! that went past the point where a new prompt diverges is useless to it; the server therefore
//! also keeps *checkpoints*: a copy of the state at each turn boundary (the end of a prompt,
//! before generation). The next turn usually extends the live state (prompt + reply) exactly;
//! when the client re-sends the reply differently tokenized (or edits it), the checkpoint still
//! saves the whole previous prompt.
//!
//! Eviction (past `max_entries` or `max_bytes`) drops, in this order:
//! 1. *superseded* entries: a state whose tokens a held checkpoint of the same conversation key
//!    extends (the earlier turns of a conversation: the newer checkpoint serves every prompt the
//!    older one would, unless the client edits history);
//! 2. the entry that would be cheapest to prefill again: the prefill seconds its held tokens
//!    save at the measured rate ([`SessionStore::set_rate`]; the per-token part only — a
//!    continuation pays the fixed part of a pass anyway), halved for every `2 · max_entries`
//!    requests since it was last used. Age counts requests ([`SessionStore::next_request`]),
//!    not insertions: one request leaves a checkpoint at every message boundary, so counting
//!    insertions aged a held conversation by four or more per short subagent request. A long
//!    main conversation so outlives a burst of short subagent conversations, where recency
//!    alone would drop it; a stale one still goes eventually.
//!
//! Keys: a conversation key from the client (`prompt_cache_key`, the session id in Anthropic's
//! `metadata.user_id`, ...) travels with each entry; it scopes lineage (rule 1) and breaks ties
//! between equally long matches in favour of the requester's own conversation.
//!
//! Scopes: every entry also carries the *cache scope* of the request that made it (a digest of
//! the request's `cache_salt` and, with several API keys, the key it authenticated with; `None`
//! for the shared scope of unsalted requests). A request sees only the entries of its own scope:
//! matches, the first difference it is told, and lineage never cross scopes, so `cached_tokens`
//! and timing say nothing about prompts held under another scope. The bounds are shared: a scope
//! cannot read another's entries, but its insertions may evict them.
//!
//! Images: every image of a prompt is the same run of `<|media_pad|>` ids whatever it shows, so
//! an entry also records which image (a digest of its bytes) filled which run. An entry matches
//! a prompt only when the images inside its tokens are the prompt's, and its end does not cut an
//! image run in two.

use std::ops::Range;

use k3_protocol::wire::RateFit;

/// One image of a sequence: the positions of its pad run and a digest of the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaKey {
    pub span: Range<usize>,
    pub digest: [u8; 32],
}

/// Whether a held sequence of `len` tokens with images `held` can continue a prompt with images
/// `prompt` (the tokens already match): the same images inside the first `len` tokens, none cut.
fn media_compatible(len: usize, held: &[MediaKey], prompt: &[MediaKey]) -> bool {
    let inside: Vec<&MediaKey> = prompt.iter().filter(|m| m.span.start < len).collect();
    inside.iter().all(|m| m.span.end <= len) && inside.len() == held.len() && inside.iter().zip(held).all(|(a, b)| *a == b)
}

/// One held state.
pub struct Entry<S> {
    pub tokens: Vec<u32>,
    /// The images inside `tokens`, in order.
    pub media: Vec<MediaKey>,
    pub session: S,
    pub bytes: usize,
    /// A turn-boundary copy (kept when used: the user forks it) rather than a live state
    /// (consumed when continued).
    pub checkpoint: bool,
    /// The client's conversation key, if it sent one.
    pub key: Option<String>,
    /// The cache scope of the request that made it (see the module doc).
    pub scope: Option<String>,
    /// The store's insertion-and-use clock when it was last inserted or used (order).
    last_used: u64,
    /// The request count when it was last inserted or used (age).
    last_request: u64,
}

/// Why an entry left the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictReason {
    /// Past the entry limit.
    Count,
    /// Past the byte limit.
    Bytes,
    /// A held checkpoint of the same conversation extends it.
    Superseded,
}

impl EvictReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EvictReason::Count => "count",
            EvictReason::Bytes => "bytes",
            EvictReason::Superseded => "superseded",
        }
    }
}

/// An entry the store let go, and why (the caller may keep it elsewhere, e.g. on disk).
pub struct Evicted<S> {
    pub entry: Entry<S>,
    pub reason: EvictReason,
}

/// Bounded store of session states.
pub struct SessionStore<S> {
    entries: Vec<Entry<S>>,
    max_entries: usize,
    max_bytes: usize,
    clock: u64,
    /// Requests seen ([`Self::next_request`]).
    requests: u64,
    /// Prefill cost of a held state (seconds for its tokens).
    rate: RateFit,
}

/// The prefill rate assumed before one is measured (tokens/s; only the ratio between entries
/// matters for eviction).
const DEFAULT_TOK_PER_S: f64 = 120.0;

impl<S> SessionStore<S> {
    /// At most `max_entries` states and `max_bytes` of state.
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        SessionStore { entries: Vec::new(), max_entries, max_bytes, clock: 0, requests: 0, rate: RateFit::flat(DEFAULT_TOK_PER_S) }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn total_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Distinct conversation keys among the held entries.
    pub fn keys(&self) -> usize {
        let mut k: Vec<&str> = self.entries.iter().filter_map(|e| e.key.as_deref()).collect();
        k.sort_unstable();
        k.dedup();
        k.len()
    }

    /// The prefill rate eviction weighs entries by (measured prefills).
    pub fn set_rate(&mut self, rate: RateFit) {
        self.rate = rate;
    }

    /// Prefill seconds that holding a state of `tokens` tokens saves at the current rate: a
    /// pass over them, less the fixed part every pass (the continuation's too) pays.
    pub fn prefill_cost_s(&self, tokens: usize) -> f64 {
        (self.rate.seconds(tokens as u64, 0) - self.rate.fixed_s.max(0.0)).max(0.0)
    }

    /// A new request begins (entries age by requests, see the module doc).
    pub fn next_request(&mut self) {
        self.requests += 1;
    }

    /// The entry with the longest token list that is a prefix of `prompt` and holds the same
    /// images (`media`: the prompt's, in order) (ties: a live state before a checkpoint, then
    /// the requester's key, then the most recent).
    pub fn best_match(&self, prompt: &[u32], media: &[MediaKey]) -> Option<usize> {
        self.best_match_keyed(prompt, media, None, None)
    }

    /// [`Self::best_match`] for a request with conversation key `key`, among the entries of
    /// cache scope `scope` only.
    pub fn best_match_keyed(&self, prompt: &[u32], media: &[MediaKey], key: Option<&str>, scope: Option<&str>) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.scope.as_deref() == scope)
            .filter(|(_, e)| e.tokens.len() <= prompt.len() && prompt[..e.tokens.len()] == e.tokens[..])
            .filter(|(_, e)| media_compatible(e.tokens.len(), &e.media, media))
            .max_by_key(|(_, e)| (e.tokens.len(), !e.checkpoint, key.is_some() && e.key.as_deref() == key, e.last_used))
            .map(|(i, _)| i)
    }

    /// The longest common prefix of `prompt` with any held entry's tokens of cache scope
    /// `scope` (usable or not): where the prompt first differs from everything held there.
    pub fn first_difference(&self, prompt: &[u32], scope: Option<&str>) -> usize {
        self.entries.iter().filter(|e| e.scope.as_deref() == scope).map(|e| e.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count()).max().unwrap_or(0)
    }

    pub fn get(&self, i: usize) -> &Entry<S> {
        &self.entries[i]
    }

    /// The entry, to fork its session (a fork may share state with the original).
    pub fn get_mut(&mut self, i: usize) -> &mut Entry<S> {
        &mut self.entries[i]
    }

    /// Marks an entry as just used.
    pub fn touch(&mut self, i: usize) {
        self.clock += 1;
        self.entries[i].last_used = self.clock;
        self.entries[i].last_request = self.requests;
    }

    /// Removes and returns an entry.
    pub fn take(&mut self, i: usize) -> Entry<S> {
        self.entries.swap_remove(i)
    }

    /// Removes and returns every entry (shutdown).
    pub fn drain(&mut self) -> Vec<Entry<S>> {
        std::mem::take(&mut self.entries)
    }

    /// Adds a state (replacing one with the same tokens) and evicts beyond the limits (see the
    /// module doc). Returns the evicted entries.
    pub fn insert(&mut self, tokens: Vec<u32>, media: Vec<MediaKey>, session: S, bytes: usize, checkpoint: bool) -> Vec<Evicted<S>> {
        self.insert_keyed(tokens, media, None, None, session, bytes, checkpoint)
    }

    /// [`Self::insert`] with the conversation key and the cache scope of the request that made
    /// the state.
    pub fn insert_keyed(
        &mut self,
        tokens: Vec<u32>,
        media: Vec<MediaKey>,
        key: Option<String>,
        scope: Option<String>,
        session: S,
        bytes: usize,
        checkpoint: bool,
    ) -> Vec<Evicted<S>> {
        self.entries.retain(|e| !(e.tokens == tokens && e.media == media && e.checkpoint == checkpoint && e.scope == scope));
        self.clock += 1;
        self.entries.push(Entry { tokens, media, session, bytes, checkpoint, key, scope, last_used: self.clock, last_request: self.requests });
        let mut evicted = Vec::new();
        if self.max_entries == 0 {
            evicted.extend(self.entries.drain(..).map(|entry| Evicted { entry, reason: EvictReason::Count }));
            return evicted;
        }
        loop {
            let reason = if self.entries.len() > self.max_entries {
                EvictReason::Count
            } else if self.total_bytes() > self.max_bytes && self.entries.len() > 1 {
                EvictReason::Bytes
            } else {
                break;
            };
            let Some((i, superseded)) = self.victim() else { break };
            let entry = self.entries.swap_remove(i);
            evicted.push(Evicted { entry, reason: if superseded { EvictReason::Superseded } else { reason } });
        }
        evicted
    }

    /// Whether a held checkpoint of the same key strictly extends entry `i`.
    fn superseded(&self, i: usize) -> bool {
        let e = &self.entries[i];
        self.entries.iter().enumerate().any(|(j, o)| {
            j != i
                && o.checkpoint
                && o.key == e.key
                && o.scope == e.scope
                && o.tokens.len() > e.tokens.len()
                && o.tokens[..e.tokens.len()] == e.tokens[..]
                && media_compatible(e.tokens.len(), &e.media, &o.media)
        })
    }

    /// The entry to evict next (never the newest) and whether it is superseded.
    fn victim(&self) -> Option<(usize, bool)> {
        let newest = self.entries.iter().enumerate().max_by_key(|(_, e)| e.last_used).map(|(i, _)| i)?;
        let candidates = (0..self.entries.len()).filter(|&i| i != newest);
        if let Some(i) = candidates.clone().filter(|&i| self.superseded(i)).min_by_key(|&i| self.entries[i].last_used) {
            return Some((i, true));
        }
        let half_life = (2 * self.max_entries).max(4) as f64;
        let value = |e: &Entry<S>| self.prefill_cost_s(e.tokens.len()) * 0.5f64.powf((self.requests - e.last_request) as f64 / half_life);
        candidates
            .min_by(|&a, &b| value(&self.entries[a]).total_cmp(&value(&self.entries[b])).then(self.entries[a].last_used.cmp(&self.entries[b].last_used)))
            .map(|i| (i, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_prefix_wins_and_the_cheapest_to_prefill_goes() {
        let mut s: SessionStore<&str> = SessionStore::new(2, usize::MAX);
        s.insert(vec![1, 2], vec![], "a", 1, true);
        s.insert(vec![1, 2, 3, 4], vec![], "b", 1, false);
        assert_eq!(s.get(s.best_match(&[1, 2, 3, 4, 5], &[]).unwrap()).session, "b");
        assert_eq!(s.get(s.best_match(&[1, 2, 9], &[]).unwrap()).session, "a");
        assert!(s.best_match(&[2], &[]).is_none());
        let a = s.best_match(&[1, 2], &[]).unwrap();
        s.touch(a);
        // "a" (2 tokens, just used) is worth less than "b" (4 tokens): "b" stays, "a" goes.
        let ev = s.insert(vec![7], vec![], "c", 1, false);
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].entry.session, "a");
        assert_eq!(ev[0].reason, EvictReason::Count);
        assert!(s.best_match(&[1, 2, 3, 4], &[]).map(|i| s.get(i).session) == Some("b"));
        let mut small: SessionStore<&str> = SessionStore::new(10, 3);
        small.insert(vec![1], vec![], "x", 2, false);
        small.insert(vec![2], vec![], "y", 2, false);
        assert_eq!(small.len(), 1);
        assert_eq!(small.total_bytes(), 2);
    }

    #[test]
    fn superseded_turns_go_first_and_a_long_conversation_outlives_short_ones() {
        let k = || Some("main".to_string());
        let mut s: SessionStore<&str> = SessionStore::new(2, usize::MAX);
        let main: Vec<u32> = (0..400).collect();
        s.insert_keyed(main[..100].to_vec(), vec![], k(), None, "turn1", 1, true);
        s.insert_keyed(main.clone(), vec![], k(), None, "turn2", 1, true);
        // The first turn's checkpoint is extended by the second's: superseded.
        let ev = s.insert_keyed(vec![9000, 1], vec![], k(), None, "sub0", 1, true);
        assert_eq!((ev.len(), ev[0].entry.session, ev[0].reason), (1, "turn1", EvictReason::Superseded));
        // Short conversations come and go; the 400-token one stays.
        for i in 0..6u32 {
            s.next_request();
            let ev = s.insert_keyed(vec![9001 + i; 20], vec![], k(), None, "sub", 1, true);
            assert!(ev.iter().all(|e| e.entry.session != "turn2"), "the long conversation was evicted at subagent {i}");
        }
        assert_eq!(s.get(s.best_match(&main, &[]).unwrap()).session, "turn2");
        assert_eq!(s.keys(), 1);
    }

    /// Each request leaves a checkpoint at every message boundary, and a measured rate has a
    /// fixed part: neither may age out a long conversation under a burst of short ones (the
    /// decoder's main agent under ten subagent requests, as in tests/session_disk.rs). A
    /// conversation left alone long enough still goes.
    #[test]
    fn checkpoints_per_request_and_a_fixed_cost_do_not_age_a_long_conversation_out() {
        let k = || Some("main".to_string());
        let mut s: SessionStore<&str> = SessionStore::new(4, usize::MAX);
        s.set_rate(RateFit { fixed_s: 0.5, per_token_s: 0.005, per_token_ctx_s: 0.0, samples: 7 });
        let main: Vec<u32> = (0..466).collect();
        s.next_request();
        s.insert_keyed(main.clone(), vec![], k(), None, "main", 1, true);
        let sub = |i: u32, n: usize| -> Vec<u32> { (0..100).chain((0..n as u32).map(|j| 10_000 + 100 * i + j)).collect() };
        let mut gone_at = None;
        for i in 0..40u32 {
            s.next_request();
            // a shared 100-token system prefix, then three more boundaries, then the live state
            for (n, ckpt) in [(0, true), (30, true), (50, true), (56, false)] {
                let ev = s.insert_keyed(sub(i, n), vec![], k(), None, "sub", 1, ckpt);
                if ev.iter().any(|e| e.entry.session == "main") {
                    gone_at.get_or_insert(i);
                }
            }
        }
        let gone_at = gone_at.expect("a conversation unused for 40 requests is still held");
        assert!(gone_at >= 10, "the 466-token conversation went after {gone_at} subagent requests of 4 insertions each");
        assert!((s.prefill_cost_s(466) - 466.0 * 0.005).abs() < 1e-9, "the fixed part is not a saving: {}", s.prefill_cost_s(466));
    }

    #[test]
    fn images_must_match_and_stay_whole() {
        let key = |span: Range<usize>, d: u8| MediaKey { span, digest: [d; 32] };
        let pad = 9;
        let mut s: SessionStore<&str> = SessionStore::new(8, usize::MAX);
        // [1, pad, pad, pad, 2]: image A at 1..4.
        s.insert(vec![1, pad, pad, pad, 2], vec![key(1..4, 0xA)], "a", 1, true);
        s.insert(vec![1], vec![], "text", 1, true);
        let prompt = [1, pad, pad, pad, 2, 3];
        assert_eq!(s.get(s.best_match(&prompt, &[key(1..4, 0xA)]).unwrap()).session, "a");
        // Same ids, another image: only the text-only prefix before it is usable.
        assert_eq!(s.get(s.best_match(&prompt, &[key(1..4, 0xB)]).unwrap()).session, "text");
        // A held state that ends inside the prompt's image run is not used.
        s.insert(vec![1, pad, pad], vec![key(1..3, 0xC)], "cut", 1, true);
        assert_eq!(s.get(s.best_match(&prompt, &[key(1..4, 0xC)]).unwrap()).session, "text");
        // The same tokens with another image are another entry.
        s.insert(vec![1, pad, pad, pad, 2], vec![key(1..4, 0xB)], "b", 1, true);
        assert_eq!(s.len(), 4);
        assert_eq!(s.get(s.best_match(&prompt, &[key(1..4, 0xB)]).unwrap()).session, "b");
    }

    #[test]
    fn scopes_see_only_their_own_entries() {
        let mut s: SessionStore<&str> = SessionStore::new(8, usize::MAX);
        let a = || Some("a".to_string());
        s.insert_keyed(vec![1, 2, 3, 4], vec![], None, a(), "salted", 1, true);
        s.insert_keyed(vec![1, 2], vec![], None, None, "shared", 1, true);
        let prompt = [1, 2, 3, 4, 5];
        assert_eq!(s.get(s.best_match_keyed(&prompt, &[], None, Some("a")).unwrap()).session, "salted");
        assert_eq!(s.get(s.best_match(&prompt, &[]).unwrap()).session, "shared", "the shared scope does not see the salted entry");
        assert!(s.best_match_keyed(&prompt, &[], None, Some("b")).is_none(), "another salt sees nothing");
        assert_eq!((s.first_difference(&prompt, Some("a")), s.first_difference(&prompt, None), s.first_difference(&prompt, Some("b"))), (4, 2, 0));
        // the same tokens under another scope are another entry, not a replacement
        s.insert_keyed(vec![1, 2, 3, 4], vec![], None, Some("b".into()), "b", 1, true);
        assert_eq!(s.len(), 3);
        assert_eq!(s.get(s.best_match_keyed(&prompt, &[], None, Some("a")).unwrap()).session, "salted");
    }
}
