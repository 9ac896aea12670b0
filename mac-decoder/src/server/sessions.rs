//! The session store: held sequence states keyed by their token prefix, with LRU eviction.
//!
//! A request whose prompt starts with a held entry's tokens continues from it, so only the new
//! tokens are prefilled. K3's KDA layers are recurrent and cannot be trimmed back, so a state
//! that went past the point where a new prompt diverges is useless to it; the server therefore
//! also keeps *checkpoints*: a copy of the state at each turn boundary (the end of a prompt,
//! before generation). The next turn usually extends the live state (prompt + reply) exactly;
//! when the client re-sends the reply differently tokenized (or edits it), the checkpoint still
//! saves the whole previous prompt.

/// One held state.
pub struct Entry<S> {
    pub tokens: Vec<u32>,
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

    /// The entry with the longest token list that is a prefix of `prompt` (ties: a live state
    /// before a checkpoint, then the most recent).
    pub fn best_match(&self, prompt: &[u32]) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tokens.len() <= prompt.len() && prompt[..e.tokens.len()] == e.tokens[..])
            .max_by_key(|(_, e)| (e.tokens.len(), !e.checkpoint, e.last_used))
            .map(|(i, _)| i)
    }

    pub fn get(&self, i: usize) -> &Entry<S> {
        &self.entries[i]
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
    pub fn insert(&mut self, tokens: Vec<u32>, session: S, bytes: usize, checkpoint: bool) -> usize {
        self.entries.retain(|e| !(e.tokens == tokens && e.checkpoint == checkpoint));
        self.clock += 1;
        self.entries.push(Entry { tokens, session, bytes, checkpoint, last_used: self.clock });
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
        s.insert(vec![1, 2], "a", 1, true);
        s.insert(vec![1, 2, 3, 4], "b", 1, false);
        assert_eq!(s.get(s.best_match(&[1, 2, 3, 4, 5]).unwrap()).session, "b");
        assert_eq!(s.get(s.best_match(&[1, 2, 9]).unwrap()).session, "a");
        assert!(s.best_match(&[2]).is_none());
        let a = s.best_match(&[1, 2]).unwrap();
        s.touch(a);
        assert_eq!(s.insert(vec![7], "c", 1, false), 1); // evicts "b", the least recently used
        assert!(s.best_match(&[1, 2, 3, 4]).map(|i| s.get(i).session) == Some("a"));
        let mut small: SessionStore<&str> = SessionStore::new(10, 3);
        small.insert(vec![1], "x", 2, false);
        small.insert(vec![2], "y", 2, false);
        assert_eq!(small.len(), 1);
        assert_eq!(small.total_bytes(), 2);
    }
}
