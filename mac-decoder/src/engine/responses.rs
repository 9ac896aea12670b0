//! What a `previous_response_id` names: the conversation a stored response ended, as the HTTP
//! side serialises it (its input items and its output, JSON text). The state itself is held by
//! the session stores (prefix-keyed, in memory and on disk): a request that re-renders the
//! stored conversation plus its new input continues the held state like any other turn. This
//! log only keeps the text, bounded, in memory and — with a session directory — as
//! `DIR/responses/ID.json`, so an id still resolves after a restart.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Longest id kept (the OpenAI ids are ~50 characters).
const MAX_ID: usize = 128;

/// A bounded log of stored responses by id.
pub struct ResponseLog {
    dir: Option<PathBuf>,
    max: usize,
    mem: Mutex<VecDeque<(String, String)>>,
}

/// Whether `id` may name a file (letters, digits, `_`, `-`, `.` not first).
fn valid_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_ID && !id.starts_with('.') && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

impl ResponseLog {
    /// At most `max` responses; `session_dir`: also kept on disk under `responses/` there.
    pub fn new(session_dir: Option<&Path>, max: usize) -> ResponseLog {
        let dir = session_dir.map(|d| d.join("responses")).filter(|d| match std::fs::create_dir_all(d) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(dir = %d.display(), "stored responses stay in memory only: {e}");
                false
            }
        });
        ResponseLog { dir, max: max.max(1), mem: Mutex::new(VecDeque::new()) }
    }

    /// Stores `record` (JSON text) under `id`; an id that cannot name a file is refused.
    pub fn put(&self, id: &str, record: String) -> anyhow::Result<()> {
        anyhow::ensure!(valid_id(id), "a response id holds letters, digits, '_', '-' and '.' (at most {MAX_ID}), not {id:?}");
        if let Some(d) = &self.dir {
            let (tmp, path) = (d.join(format!("{id}.json.tmp")), d.join(format!("{id}.json")));
            std::fs::write(&tmp, &record).and_then(|()| std::fs::rename(&tmp, &path))?;
        }
        let mut m = self.mem.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|(k, _)| k != id);
        m.push_back((id.to_string(), record));
        while m.len() > self.max {
            if let Some((old, _)) = m.pop_front() {
                if let Some(d) = &self.dir {
                    let _ = std::fs::remove_file(d.join(format!("{old}.json")));
                }
            }
        }
        Ok(())
    }

    /// The record stored under `id` (from memory, else from its file).
    pub fn get(&self, id: &str) -> Option<String> {
        if !valid_id(id) {
            return None;
        }
        if let Some((_, r)) = self.mem.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|(k, _)| k == id) {
            return Some(r.clone());
        }
        let d = self.dir.as_ref()?;
        let r = std::fs::read_to_string(d.join(format!("{id}.json"))).ok()?;
        let _ = self.put(id, r.clone());
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_survive_a_restart_and_stay_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let log = ResponseLog::new(Some(dir.path()), 2);
        log.put("resp_1", "{\"a\":1}".into()).unwrap();
        log.put("resp_2", "{\"a\":2}".into()).unwrap();
        assert!(log.put("../x", "{}".into()).is_err());
        assert_eq!(log.get("resp_1").as_deref(), Some("{\"a\":1}"));
        log.put("resp_3", "{\"a\":3}".into()).unwrap();
        assert_eq!(log.get("resp_1"), None, "the oldest goes past the bound");
        drop(log);
        let again = ResponseLog::new(Some(dir.path()), 2);
        assert_eq!(again.get("resp_3").as_deref(), Some("{\"a\":3}"));
        assert_eq!(ResponseLog::new(None, 4).get("resp_3"), None);
    }
}
