//! Test support: a full-size K3-layout tokenizer built around the ids of the golden cases.
//!
//! The real `tiktoken.model` is not in the repository. `tests/data/k3_chat/partial_vocab.json`
//! gives bytes for every id the golden cases use (plus prefix tokens so BPE can reach them);
//! every other rank gets an unreachable filler (bytes 0xF8, which never occur in UTF-8), so
//! the vocabulary has the release's 163,584 base tokens and 256 special slots, and the named
//! specials of the release's `tokenizer_config.json`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use mac_decoder::tokenizer::Tokenizer;

pub(crate) const N_BASE: usize = 163_584;

pub(crate) fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/k3_chat")
}

pub(crate) fn cases() -> serde_json::Value {
    let text = std::fs::read_to_string(data_dir().join("k3-tokenizer-cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// GPT-2 `bytes_to_unicode` order: rank i is byte `order[i]`.
pub(crate) fn byte_order() -> Vec<u8> {
    let mut v: Vec<u8> = (b'!'..=b'~').chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let rest: Vec<u8> = (0u8..=255).filter(|b| !v.contains(b)).collect();
    v.extend(rest);
    v
}

/// Base-token bytes by rank (163,584 of them).
pub(crate) fn ranks() -> Vec<Vec<u8>> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(data_dir().join("partial_vocab.json")).unwrap()).unwrap();
    let mut ranks: Vec<Option<Vec<u8>>> = vec![None; N_BASE];
    for (i, b) in byte_order().into_iter().enumerate() {
        ranks[i] = Some(vec![b]);
    }
    for table in ["golden", "intermediate"] {
        for (id, hex) in v[table].as_object().unwrap() {
            let id: usize = id.parse().unwrap();
            let hex = hex.as_str().unwrap();
            let bytes: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
            assert!(ranks[id].is_none(), "rank {id} given twice");
            ranks[id] = Some(bytes);
        }
    }
    ranks.into_iter().enumerate().map(|(r, t)| t.unwrap_or_else(|| vec![0xF8, 0xF8, (r >> 16) as u8, (r >> 8) as u8, r as u8])).collect()
}

pub(crate) fn named_specials() -> BTreeMap<u32, String> {
    cases()["named_specials"].as_object().unwrap().iter().map(|(k, v)| (k.parse().unwrap(), v.as_str().unwrap().to_string())).collect()
}

/// The shared test tokenizer (built once per test binary).
pub(crate) fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(Tokenizer::from_parts(ranks(), &named_specials(), 256).unwrap())).clone()
}
