//! The session store: held sequence states keyed by their token prefix, with LRU eviction.
//!
//! A request whose prompt starts with a held entry's tokens continues from it, so only the new
//! tokens are prefilled. K3's KDA layers are recurrent and cannot be trimmed back, so a state
//! that went past the point where a new prompt diverges is useless to it; the server therefore
//! also keeps *checkpoints*: a copy of the state at each turn boundary (the end of a prompt,
//! before generation). The next turn usually extends the live state (prompt + reply) exactly;
//! when the client re-sends the reply differently tokenized (or edits it), the checkpoint still
//! saves the whole previous prompt.
//!
//! Images: every image of a prompt is the same run of `<|media_pad|>` ids whatever it shows, so
//! an entry also records which image (a digest of its bytes) filled which run. An entry matches
//! a prompt only when the images inside its tokens are the prompt's, and its end does not cut an
//! image run in two.

use std::ops::Range;

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
    last_used: u64,
}

/// Bounded LRU store of session states.
pub struct SessionStore<S> {
    entries: Vec<Entry<S>>,
    max_entries: usize,
    max_bytes: usize,
    clock: u64,
}

impl<S> SessionStore<S> {
    /// At most `max_entries` states and `max_bytes` of state (the least recently used go first).
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        SessionStore { entries: Vec::new(), max_entries, max_bytes, clock: 0 }
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

    /// The entry with the longest token list that is a prefix of `prompt` and holds the same
    /// images (`media`: the prompt's, in order) (ties: a live state before a checkpoint, then
    /// the most recent).
    pub fn best_match(&self, prompt: &[u32], media: &[MediaKey]) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tokens.len() <= prompt.len() && prompt[..e.tokens.len()] == e.tokens[..])
            .filter(|(_, e)| media_compatible(e.tokens.len(), &e.media, media))
            .max_by_key(|(_, e)| (e.tokens.len(), !e.checkpoint, e.last_used))
            .map(|(i, _)| i)
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
    }

    /// Removes and returns an entry.
    pub fn take(&mut self, i: usize) -> Entry<S> {
        self.entries.swap_remove(i)
    }

    /// Adds a state (replacing one with the same tokens) and evicts least recently used
    /// entries beyond the limits. Returns how many were evicted.
    pub fn insert(&mut self, tokens: Vec<u32>, media: Vec<MediaKey>, session: S, bytes: usize, checkpoint: bool) -> usize {
        self.entries.retain(|e| !(e.tokens == tokens && e.media == media && e.checkpoint == checkpoint));
        self.clock += 1;
        self.entries.push(Entry { tokens, media, session, bytes, checkpoint, last_used: self.clock });
        let mut evicted = 0;
        while self.entries.len() > self.max_entries || (self.total_bytes() > self.max_bytes && self.entries.len() > 1) {
            let Some(lru) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else { break };
            self.entries.swap_remove(lru);
            evicted += 1;
        }
        if self.max_entries == 0 {
            evicted += self.entries.len();
            self.entries.clear();
        }
        evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_prefix_wins_and_lru_evicts() {
        let mut s: SessionStore<&str> = SessionStore::new(2, usize::MAX);
        s.insert(vec![1, 2], vec![], "a", 1, true);
        s.insert(vec![1, 2, 3, 4], vec![], "b", 1, false);
        assert_eq!(s.get(s.best_match(&[1, 2, 3, 4, 5], &[]).unwrap()).session, "b");
        assert_eq!(s.get(s.best_match(&[1, 2, 9], &[]).unwrap()).session, "a");
        assert!(s.best_match(&[2], &[]).is_none());
        let a = s.best_match(&[1, 2], &[]).unwrap();
        s.touch(a);
        assert_eq!(s.insert(vec![7], vec![], "c", 1, false), 1); // evicts "b", the least recently used
        assert!(s.best_match(&[1, 2, 3, 4], &[]).map(|i| s.get(i).session) == Some("a"));
        let mut small: SessionStore<&str> = SessionStore::new(10, 3);
        small.insert(vec![1], vec![], "x", 2, false);
        small.insert(vec![2], vec![], "y", 2, false);
        assert_eq!(small.len(), 1);
        assert_eq!(small.total_bytes(), 2);
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
}
