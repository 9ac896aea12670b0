//! Reading the release tokenizer files (spec K3_CHAT §1.1, §1.3).
//!
//! - `tiktoken.model`: one base token per line, `<base64 of its bytes> <rank>`; the rank is the
//!   id; blank lines are ignored; ranks must run densely from 0.
//! - `tokenizer_config.json`: `added_tokens_decoder[str(id)].content` names special slots.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use base64::Engine as _;

use super::TokenizerError;

/// Parses the text of a `tiktoken.model` file into the base tokens' bytes, indexed by rank.
///
/// `origin` names the file in errors. Every problem (bad base64, a missing or non-numeric
/// rank, a duplicate rank or duplicate bytes, a gap in the ranks) is an error naming the line.
pub fn parse_ranks(text: &str, origin: &str) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut by_rank: BTreeMap<u32, (Vec<u8>, usize)> = BTreeMap::new();
    let mut seen: HashMap<Vec<u8>, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let lineno = i + 1;
        let line = line.trim_end_matches('\r');
        if line.is_empty() {
            continue;
        }
        let bad = |why: String| TokenizerError::Ranks { file: origin.to_string(), line: lineno, why };
        let mut parts = line.split_whitespace();
        let (Some(tok), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad(format!("expected `<base64> <rank>`, got {:?}", truncate(line))));
        };
        let bytes = b64.decode(tok).map_err(|e| bad(format!("bad base64 {:?}: {e}", truncate(tok))))?;
        if bytes.is_empty() {
            return Err(bad("empty token".into()));
        }
        let rank: u32 = rank.parse().map_err(|_| bad(format!("rank {:?} is not a non-negative integer", truncate(rank))))?;
        if let Some(prev) = seen.insert(bytes.clone(), lineno) {
            return Err(bad(format!("token bytes {bytes:02x?} already given on line {prev}")));
        }
        if let Some((_, prev)) = by_rank.insert(rank, (bytes, lineno)) {
            return Err(bad(format!("rank {rank} already given on line {prev}")));
        }
    }
    let n = by_rank.len();
    if n == 0 {
        return Err(TokenizerError::Ranks { file: origin.to_string(), line: 0, why: "no tokens".into() });
    }
    let mut out = Vec::with_capacity(n);
    for (expect, (rank, (bytes, lineno))) in by_rank.into_iter().enumerate() {
        if rank as usize != expect {
            return Err(TokenizerError::Ranks {
                file: origin.to_string(),
                line: lineno,
                why: format!("ranks are not dense: rank {expect} is missing (next is {rank})"),
            });
        }
        out.push(bytes);
    }
    Ok(out)
}

fn truncate(s: &str) -> String {
    s.chars().take(40).collect()
}

/// The named special slots of `tokenizer_config.json` (`added_tokens_decoder`), id → name.
pub fn parse_added_tokens(text: &str, origin: &str) -> Result<BTreeMap<u32, String>, TokenizerError> {
    let bad = |why: String| TokenizerError::Config { file: origin.to_string(), why };
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let mut out = BTreeMap::new();
    let Some(dec) = v.get("added_tokens_decoder") else {
        return Ok(out);
    };
    let dec = dec.as_object().ok_or_else(|| bad("added_tokens_decoder is not an object".into()))?;
    for (k, entry) in dec {
        let id: u32 = k.parse().map_err(|_| bad(format!("added_tokens_decoder key {k:?} is not a token id")))?;
        let name = entry.get("content").and_then(|c| c.as_str()).ok_or_else(|| bad(format!("added_tokens_decoder[{k:?}] has no string `content`")))?;
        if name.is_empty() {
            return Err(bad(format!("added_tokens_decoder[{k:?}] has an empty name")));
        }
        out.insert(id, name.to_string());
    }
    Ok(out)
}

/// `text_config.vocab_size` (or a top-level `vocab_size`) of a `config.json`, if present.
pub fn config_vocab_size(path: &Path) -> Result<Option<u32>, TokenizerError> {
    if !path.exists() {
        return Ok(None);
    }
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::Io { file: origin.clone(), source: e })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| TokenizerError::Config { file: origin.clone(), why: format!("not JSON: {e}") })?;
    let n = v.get("text_config").and_then(|t| t.get("vocab_size")).or_else(|| v.get("vocab_size"));
    match n {
        None => Ok(None),
        Some(n) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| TokenizerError::Config { file: origin, why: format!("vocab_size {n} is not a token count") }),
    }
}

/// Special-token ids a `config.json` names (`eos_token_id`, `media_placeholder_token_id`,
/// `pad_token_id`), for the tokenizer's cross-check; missing file or keys give none.
pub fn config_special_ids(path: &Path) -> Result<Vec<(&'static str, u32)>, TokenizerError> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::Io { file: origin.clone(), source: e })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| TokenizerError::Config { file: origin.clone(), why: format!("not JSON: {e}") })?;
    let mut out = Vec::new();
    for key in ["eos_token_id", "media_placeholder_token_id"] {
        let n = v.get(key).or_else(|| v.get("text_config").and_then(|t| t.get(key)));
        if let Some(id) = n.and_then(serde_json::Value::as_u64).and_then(|n| u32::try_from(n).ok()) {
            out.push((key, id));
        }
    }
    Ok(out)
}
