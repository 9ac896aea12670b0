//! A small tokenizer in the release's format (spec K3_CHAT §1): `tiktoken.model` (one line per
//! base token: base64 of its bytes, a space, its rank = id) and `tokenizer_config.json` whose
//! `added_tokens_decoder` names the special slots at the top of the id range.
//!
//! The ranks are valid byte-level BPE ranks: the 256 single bytes first (GPT-2
//! `bytes_to_unicode` order, as in the release), then merges learned from a built-in English
//! text, then (for large vocabularies) further merges, each the concatenation of two
//! lower-ranked tokens, so the ordinary tiktoken algorithm works on them.
//!
//! Special-token layout for a vocabulary of `V` ids:
//! - `V >= 2048`: the release layout, 256 slots `[V-256, V)` at the release's offsets
//!   (for `V = 163840` these are exactly K3's ids: `[BOS]` 163584, `<|end_of_msg|>` 163586,
//!   `<|media_pad|>` 163605, `[PAD]` 163839, ...);
//! - `V < 2048`: a compact block of 24 slots `[V-24, V)` laid out like golden tiny-a
//!   (`V = 1024`: `[BOS]` 1000, `<|end_of_msg|>` 1002, `<|media_pad|>` 1005,
//!   `<|media_begin|>` 1006, `<|media_content|>` 1007, `<|media_end|>` 1008, `[PAD]` 1023).
//!
//! The config's `bos_token_id` is `[BOS]`, `eos_token_id` is `<|end_of_msg|>` (the chat stop
//! token, as in the release), `pad_token_id` is `[PAD]`, `media_placeholder_token_id` is
//! `<|media_pad|>`.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::corpus::CORPUS;
use super::rng::Rng;
use super::SynthError;

/// Vocabularies at least this large use the release's 256-slot special block.
pub const RELEASE_LAYOUT_MIN_VOCAB: usize = 2048;

/// Named special tokens of the release and their offsets in its 256-slot block, with the HF
/// `special` flag (`<|open|>`, `<|close|>`, `<|sep|>` are `special: false`).
const RELEASE_SPECIALS: [(u32, &str, bool); 16] = [
    (0, "[BOS]", true),
    (1, "[EOS]", true),
    (2, "<|end_of_msg|>", true),
    (3, "<|open|>", false),
    (4, "<|close|>", false),
    (5, "<|sep|>", false),
    (6, "[start_header_id]", true),
    (7, "[end_header_id]", true),
    (9, "[EOT]", true),
    (18, "<|media_begin|>", true),
    (19, "<|media_content|>", true),
    (20, "<|media_end|>", true),
    (21, "<|media_pad|>", true),
    (65, "<osagent_mode>", true),
    (254, "[UNK]", true),
    (255, "[PAD]", true),
];

/// The compact 24-slot block of small vocabularies (golden tiny-a's ids for `V = 1024`).
const COMPACT_SPECIALS: [(u32, &str, bool); 16] = [
    (0, "[BOS]", true),
    (1, "[EOS]", true),
    (2, "<|end_of_msg|>", true),
    (3, "<|open|>", false),
    (4, "<|close|>", false),
    (5, "<|media_pad|>", true),
    (6, "<|media_begin|>", true),
    (7, "<|media_content|>", true),
    (8, "<|media_end|>", true),
    (9, "<|sep|>", false),
    (10, "[start_header_id]", true),
    (11, "[end_header_id]", true),
    (12, "[EOT]", true),
    (13, "<osagent_mode>", true),
    (22, "[UNK]", true),
    (23, "[PAD]", true),
];

/// Where the special tokens of a synthetic vocabulary sit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Number of base (BPE) tokens = first special id.
    pub base: u32,
    pub vocab: u32,
    /// `(id, name, special flag)` of the named slots; the others are `<|reserved_token_{id}|>`.
    pub named: Vec<(u32, &'static str, bool)>,
}

impl SpecialTokens {
    pub fn for_vocab(vocab: usize) -> Result<Self, SynthError> {
        let (slots, table): (usize, &[(u32, &str, bool)]) = if vocab >= RELEASE_LAYOUT_MIN_VOCAB { (256, &RELEASE_SPECIALS) } else { (24, &COMPACT_SPECIALS) };
        if vocab < 256 + slots || vocab > u32::MAX as usize {
            return Err(SynthError::VocabTooSmall { vocab, slots });
        }
        let base = (vocab - slots) as u32;
        Ok(SpecialTokens { base, vocab: vocab as u32, named: table.iter().map(|&(o, n, s)| (base + o, n, s)).collect() })
    }

    /// Id of a named special token.
    pub fn id(&self, name: &str) -> Option<u32> {
        self.named.iter().find(|(_, n, _)| *n == name).map(|(id, _, _)| *id)
    }
    fn must(&self, name: &str) -> u32 {
        self.id(name).expect("every layout names this token")
    }
    pub fn bos(&self) -> u32 {
        self.must("[BOS]")
    }
    /// `<|end_of_msg|>`, the chat stop token (config `eos_token_id`).
    pub fn eos(&self) -> u32 {
        self.must("<|end_of_msg|>")
    }
    pub fn pad(&self) -> u32 {
        self.must("[PAD]")
    }
    pub fn media_pad(&self) -> u32 {
        self.must("<|media_pad|>")
    }
}

/// The 256 single bytes in GPT-2 `bytes_to_unicode` order: printable `!..~`, `¡..¬`, `®..ÿ`,
/// then the rest in increasing order. Rank `i` is the `i`-th byte of this list.
pub fn byte_rank_order() -> Vec<u8> {
    let mut v: Vec<u8> = (b'!'..=b'~').chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let printable: HashSet<u8> = v.iter().copied().collect();
    v.extend((0u8..=255).filter(|b| !printable.contains(b)));
    v
}

/// Splits ASCII-ish text roughly like the K3 pre-tokenizer (letters with one leading space,
/// 1–3 digits, punctuation runs, whitespace runs that leave their last space to a word).
fn pretokenize(text: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let n = text.len();
    let is_letter = |c: u8| c.is_ascii_alphabetic() || c >= 0x80;
    let is_punct = |c: u8| !c.is_ascii_whitespace() && !c.is_ascii_alphanumeric() && c < 0x80;
    let mut i = 0;
    while i < n {
        let start = i;
        let c = text[i];
        let lead = (c == b' ' && i + 1 < n && !text[i + 1].is_ascii_whitespace() && !text[i + 1].is_ascii_digit()) as usize;
        let c1 = text[i + lead.min(n - 1 - i)];
        if is_letter(c1) {
            i += lead;
            while i < n && is_letter(text[i]) {
                i += 1;
            }
            // English contractions stay with their word.
            if i + 1 < n && text[i] == b'\'' && b"stdm".contains(&text[i + 1].to_ascii_lowercase()) {
                i += 2;
            }
        } else if c.is_ascii_digit() {
            while i < n && i - start < 3 && text[i].is_ascii_digit() {
                i += 1;
            }
        } else if is_punct(c1) {
            i += lead;
            while i < n && is_punct(text[i]) {
                i += 1;
            }
            while i < n && (text[i] == b'\n' || text[i] == b'\r') {
                i += 1;
            }
        } else {
            while i < n && text[i].is_ascii_whitespace() {
                i += 1;
            }
            // A space run before a word gives its last space to the word.
            if i < n && i - start >= 2 && text[i - 1] == b' ' {
                i -= 1;
            }
        }
        if i == start {
            i += 1;
        }
        out.push(&text[start..i]);
    }
    out
}

/// The byte strings of `n_base` BPE ranks (index = rank).
pub fn bpe_ranks(n_base: usize) -> Vec<Vec<u8>> {
    let mut tokens: Vec<Vec<u8>> = byte_rank_order().into_iter().map(|b| vec![b]).collect();
    tokens.truncate(n_base);
    let mut index: HashMap<Vec<u8>, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    // Learn merges from the corpus: words as symbol sequences with their counts.
    let mut counts: HashMap<&[u8], u64> = HashMap::new();
    for p in pretokenize(CORPUS.as_bytes()) {
        *counts.entry(p).or_default() += 1;
    }
    let mut words: Vec<(Vec<u32>, u64)> = counts.into_iter().map(|(w, c)| (w.iter().map(|b| index[&vec![*b]]).collect(), c)).collect();
    words.sort();
    while tokens.len() < n_base {
        let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
        for (w, c) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0], p[1])).or_default() += c;
            }
        }
        // Most frequent pair; ties go to the lowest ranks, so the result is deterministic.
        let Some((&(a, b), _)) = pairs.iter().max_by(|x, y| x.1.cmp(y.1).then_with(|| y.0.cmp(x.0))) else {
            break;
        };
        let bytes = [tokens[a as usize].as_slice(), tokens[b as usize].as_slice()].concat();
        let id = match index.get(&bytes) {
            Some(&id) => id,
            None => {
                let id = tokens.len() as u32;
                index.insert(bytes.clone(), id);
                tokens.push(bytes);
                id
            }
        };
        for (w, _) in &mut words {
            let mut j = 0;
            let mut out = Vec::with_capacity(w.len());
            while j < w.len() {
                if j + 1 < w.len() && w[j] == a && w[j + 1] == b {
                    out.push(id);
                    j += 2;
                } else {
                    out.push(w[j]);
                    j += 1;
                }
            }
            *w = out;
        }
    }
    // Larger vocabularies: more merges, each joining two lower-ranked tokens (short ones).
    let mut rng = Rng::from_parts(0x006b_3374_6f6b_656e, "synthetic tokenizer fill", 0);
    while tokens.len() < n_base {
        let n = tokens.len() as u64;
        let a = (rng.next_u64() % n) as usize;
        let b = (rng.next_u64() % n) as usize;
        if tokens[a].len() + tokens[b].len() > 12 {
            continue;
        }
        let bytes = [tokens[a].as_slice(), tokens[b].as_slice()].concat();
        if !index.contains_key(&bytes) {
            index.insert(bytes.clone(), tokens.len() as u32);
            tokens.push(bytes);
        }
    }
    tokens
}

/// Standard base64 (RFC 4648, with padding).
pub fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let v = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        s.push(A[(v >> 18) as usize & 63] as char);
        s.push(A[(v >> 12) as usize & 63] as char);
        s.push(if c.len() > 1 { A[(v >> 6) as usize & 63] as char } else { '=' });
        s.push(if c.len() > 2 { A[v as usize & 63] as char } else { '=' });
    }
    s
}

/// The text of `tiktoken.model` for the given ranks.
pub fn tiktoken_model_text(ranks: &[Vec<u8>]) -> String {
    let mut s = String::new();
    for (i, t) in ranks.iter().enumerate() {
        s.push_str(&base64(t));
        s.push(' ');
        s.push_str(&i.to_string());
        s.push('\n');
    }
    s
}

/// `tokenizer_config.json` naming the special slots.
pub fn tokenizer_config_json(sp: &SpecialTokens, max_len: usize) -> serde_json::Value {
    let mut decoder = serde_json::Map::new();
    for &(id, name, special) in &sp.named {
        decoder.insert(
            id.to_string(),
            serde_json::json!({
                "content": name,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": special,
            }),
        );
    }
    serde_json::json!({
        "added_tokens_decoder": decoder,
        "auto_map": { "AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null] },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": false,
        "model_max_length": max_len,
        "tokenizer_class": "TikTokenTokenizer",
    })
}

/// Writes `tiktoken.model` and `tokenizer_config.json` for a vocabulary of `vocab` ids.
pub fn write_tokenizer(dir: &Path, vocab: usize, max_len: usize) -> Result<SpecialTokens, SynthError> {
    let sp = SpecialTokens::for_vocab(vocab)?;
    let ranks = bpe_ranks(sp.base as usize);
    super::error::write_file(&dir.join("tiktoken.model"), tiktoken_model_text(&ranks).as_bytes())?;
    let cfg = serde_json::to_string_pretty(&tokenizer_config_json(&sp, max_len)).expect("JSON value serialises");
    super::error::write_file(&dir.join("tokenizer_config.json"), cfg.as_bytes())?;
    Ok(sp)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// tiktoken's `byte_pair_merge`: repeatedly join the adjacent pair of lowest rank.
    fn bpe_encode(index: &HashMap<Vec<u8>, u32>, piece: &[u8]) -> Vec<u32> {
        if let Some(&r) = index.get(piece) {
            return vec![r];
        }
        let mut parts: Vec<Vec<u8>> = piece.iter().map(|b| vec![*b]).collect();
        loop {
            let best =
                (0..parts.len().saturating_sub(1)).filter_map(|i| index.get(&[parts[i].as_slice(), parts[i + 1].as_slice()].concat()).map(|&r| (r, i))).min();
            let Some((_, i)) = best else { break };
            let joined = [parts[i].as_slice(), parts[i + 1].as_slice()].concat();
            parts[i] = joined;
            parts.remove(i + 1);
        }
        parts.iter().map(|p| index[p]).collect()
    }

    #[test]
    fn byte_ranks_follow_gpt2_order() {
        let o = byte_rank_order();
        assert_eq!(o.len(), 256);
        assert_eq!(o.iter().copied().collect::<HashSet<u8>>().len(), 256);
        // Spec K3_CHAT §1.1: '"' = 1, 'a' = 64, '\n' = 198, ' ' = 220, '\x00' = 188.
        let rank = |b: u8| o.iter().position(|&x| x == b).unwrap();
        assert_eq!((rank(b'"'), rank(b'a'), rank(b'\n'), rank(b' '), rank(0)), (1, 64, 198, 220, 188));
    }

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (i, o) in [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foob", "Zm9vYg=="), ("fooba", "Zm9vYmE="), ("foobar", "Zm9vYmFy")] {
            assert_eq!(base64(i.as_bytes()), o);
        }
    }

    #[test]
    fn ranks_are_valid_bpe_and_roundtrip_text() {
        for n in [1000usize, 3000, 20000] {
            let ranks = bpe_ranks(n);
            assert_eq!(ranks.len(), n);
            let index: HashMap<Vec<u8>, u32> = ranks.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
            assert_eq!(index.len(), n, "token byte strings are unique");
            for (r, t) in ranks.iter().enumerate().skip(256) {
                assert!(
                    (1..t.len()).any(|k| matches!((index.get(&t[..k]), index.get(&t[k..])), (Some(&x), Some(&y)) if (x as usize) < r && (y as usize) < r)),
                    "rank {r} ({t:?}) is not a merge of two lower-ranked tokens"
                );
            }
            let text = "The engineer reads the numbers every evening, then sends 1234 values to the office.\n";
            let mut ids = Vec::new();
            for p in pretokenize(text.as_bytes()) {
                ids.extend(bpe_encode(&index, p));
            }
            let back: Vec<u8> = ids.iter().flat_map(|&i| ranks[i as usize].clone()).collect();
            assert_eq!(back, text.as_bytes());
            assert!(ids.len() * 3 < text.len(), "learned merges compress English ({} ids for {} bytes)", ids.len(), text.len());
        }
    }

    #[test]
    fn special_layouts() {
        let t = SpecialTokens::for_vocab(1024).unwrap();
        assert_eq!((t.base, t.bos(), t.eos(), t.pad(), t.media_pad()), (1000, 1000, 1002, 1023, 1005));
        assert_eq!((t.id("<|media_begin|>"), t.id("<|media_content|>"), t.id("<|media_end|>")), (Some(1006), Some(1007), Some(1008)));
        let r = SpecialTokens::for_vocab(163840).unwrap();
        assert_eq!((r.base, r.bos(), r.eos(), r.pad(), r.media_pad()), (163584, 163584, 163586, 163839, 163605));
        assert_eq!((r.id("<|open|>"), r.id("<|sep|>"), r.id("<osagent_mode>"), r.id("[UNK]")), (Some(163587), Some(163589), Some(163649), Some(163838)));
        assert!(SpecialTokens::for_vocab(279).is_err());
        assert!(SpecialTokens::for_vocab(280).is_ok());
        assert!(SpecialTokens::for_vocab(RELEASE_LAYOUT_MIN_VOCAB).unwrap().base as usize == RELEASE_LAYOUT_MIN_VOCAB - 256);
    }

    #[test]
    fn tiktoken_file_format() {
        let ranks = bpe_ranks(300);
        let text = tiktoken_model_text(&ranks);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 300);
        assert_eq!(lines[1], "Ig== 1");
        assert_eq!(lines[220], "IA== 220");
        assert!(text.ends_with('\n'));
    }
}
