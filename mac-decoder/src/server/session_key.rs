//! The conversation key a client sends with a request, which the engine tracks held sessions
//! by: OpenAI's `prompt_cache_key` (Codex), the `session_id` inside Anthropic's
//! `metadata.user_id` (Claude Code sends a JSON string `{"device_id", "account_uuid",
//! "session_id"}`), a `session_id` field, or OpenAI's `user` — the first one present.

use crate::chat::Json;

/// Longest key kept (longer ones are cut: a key names a conversation, nothing more).
const MAX_KEY: usize = 200;

/// The request body's conversation key, if it names one.
pub fn from_body(v: &Json) -> Option<String> {
    let s = |j: Option<&Json>| j.and_then(Json::as_str).map(str::trim).filter(|s| !s.is_empty()).map(str::to_string);
    let key = s(v.get("prompt_cache_key"))
        .or_else(|| v.get("metadata").and_then(|m| m.get("user_id")).and_then(Json::as_str).and_then(anthropic_session))
        .or_else(|| s(v.get("session_id")))
        .or_else(|| s(v.get("metadata").and_then(|m| m.get("session_id"))))
        .or_else(|| s(v.get("user")))?;
    Some(key.chars().take(MAX_KEY).collect())
}

/// The session id of Claude Code's `metadata.user_id` (a JSON object in a string), else the
/// whole value (other Anthropic clients put a plain user id there).
fn anthropic_session(user_id: &str) -> Option<String> {
    let t = user_id.trim();
    if t.is_empty() {
        return None;
    }
    if let Ok(Json::Object(o)) = Json::parse(t) {
        if let Some((_, Json::Str(id))) = o.iter().find(|(k, _)| k == "session_id") {
            if !id.is_empty() {
                return Some(format!("session:{id}"));
            }
        }
    }
    Some(format!("user:{t}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(body: &str) -> Option<String> {
        from_body(&Json::parse(body).unwrap())
    }

    #[test]
    fn keys_of_the_captured_clients() {
        // Codex (fixtures/agents/codex-turn1.json) and Claude Code (claude-code-turn1.json).
        assert_eq!(key(r#"{"prompt_cache_key": "01a233c2-2932-78e3-b0a2-518c17c8a99e"}"#).as_deref(), Some("01a233c2-2932-78e3-b0a2-518c17c8a99e"));
        let cc = r#"{"metadata": {"user_id": "{\"device_id\":\"00\",\"account_uuid\":\"\",\"session_id\":\"9eb2394d-4a87-4535-b91a-0ae46cade56b\"}"}}"#;
        assert_eq!(key(cc).as_deref(), Some("session:9eb2394d-4a87-4535-b91a-0ae46cade56b"));
        assert_eq!(key(r#"{"metadata": {"user_id": "alice"}}"#).as_deref(), Some("user:alice"));
        assert_eq!(key(r#"{"session_id": "s1", "user": "u"}"#).as_deref(), Some("s1"));
        assert_eq!(key(r#"{"user": "u"}"#).as_deref(), Some("u"));
        assert_eq!(key(r#"{"user": "  ", "messages": []}"#), None);
        assert_eq!(key(&format!(r#"{{"user": "{}"}}"#, "x".repeat(500))).map(|k| k.len()), Some(MAX_KEY));
    }

    #[test]
    fn every_captured_fixture_parses() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agents");
        let Ok(rd) = std::fs::read_dir(&dir) else { return };
        for e in rd.flatten() {
            let text = std::fs::read_to_string(e.path()).unwrap();
            let v = Json::parse(&text).unwrap();
            let body = v.get("body").unwrap();
            let k = from_body(body);
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("claude-code") {
                assert!(k.as_deref().is_some_and(|k| k.starts_with("session:")), "{name}: {k:?}");
            } else if name.starts_with("codex") {
                assert!(k.is_some(), "{name}");
            }
        }
    }
}
