//! The responses `store: true` keeps for `previous_response_id` (the Responses API,
//! [`super::responses`]): the conversation each ended with, as chat messages, in memory, the
//! most recent ones.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::chat::Json;

/// Responses kept for `previous_response_id` (`store: true`): the conversation each ended
/// with, as chat messages, most recent last.
pub struct ResponseStore {
    /// (id, cache scope, messages): a response continues only in requests of its scope.
    held: Mutex<VecDeque<(String, Option<String>, Vec<Json>)>>,
    max: usize,
}

impl ResponseStore {
    pub fn new(max: usize) -> Self {
        ResponseStore { held: Mutex::new(VecDeque::new()), max }
    }

    /// The messages of response `id` stored in cache scope `scope` (another scope's: none).
    pub fn get(&self, id: &str, scope: Option<&str>) -> Option<Vec<Json>> {
        let held = self.held.lock().ok()?;
        held.iter().find(|(k, s, _)| k == id && s.as_deref() == scope).map(|(_, _, m)| m.clone())
    }

    pub fn put(&self, id: String, scope: Option<String>, messages: Vec<Json>) {
        if let Ok(mut held) = self.held.lock() {
            held.push_back((id, scope, messages));
            while held.len() > self.max {
                held.pop_front();
            }
        }
    }
}
