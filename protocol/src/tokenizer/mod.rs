//! K3's tokenizer (spec K3_CHAT §1): tiktoken-format BPE ranks, K3's pre-tokenization pattern,
//! the special-token block, segment-by-segment encoding and byte-exact streaming decode.
//!
//! The BPE itself is tiktoken's (`tiktoken-rs`'s `CoreBPE`, built from our ranks, our pattern
//! and our special names). This module adds what K3's `tokenization_kimi.py` does around it:
//! the 400k-character chunks and 25k-character run limit, the `allow_special` switch, and the
//! special names of unnamed slots (`<|reserved_token_{id}|>`).

mod files;
mod split;
mod stream;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use tiktoken_rs::CoreBPE;

pub use files::{config_special_ids, config_vocab_size, parse_added_tokens, parse_ranks};
pub use split::{chunk_pieces, py_isspace, MAX_ENCODE_CHARS, MAX_NO_WHITESPACE_CHARS, PAT_STR};
pub use stream::Utf8Stream;

/// Number of special slots after the base tokens in the release (`num_reserved_special_tokens`).
pub const RELEASE_SPECIAL_SLOTS: u32 = 256;

/// Names of the special tokens the chat format uses.
pub mod names {
    pub const BOS: &str = "[BOS]";
    pub const EOS: &str = "[EOS]";
    pub const END_OF_MSG: &str = "<|end_of_msg|>";
    pub const OPEN: &str = "<|open|>";
    pub const CLOSE: &str = "<|close|>";
    pub const SEP: &str = "<|sep|>";
    pub const MEDIA_BEGIN: &str = "<|media_begin|>";
    pub const MEDIA_CONTENT: &str = "<|media_content|>";
    pub const MEDIA_END: &str = "<|media_end|>";
    pub const MEDIA_PAD: &str = "<|media_pad|>";
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{file}: {source}")]
    Io { file: String, source: std::io::Error },
    #[error("{file}, line {line}: {why}")]
    Ranks { file: String, line: usize, why: String },
    #[error("{file}: {why}")]
    Config { file: String, why: String },
    #[error("tokenizer: {0}")]
    Invalid(String),
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    UnknownId { id: u32, vocab: u32 },
    /// A special token the caller needs (its name).
    #[error("the tokenizer has no {0} token")]
    MissingSpecial(&'static str),
}

/// Why [`Tokenizer::encode_segments_bounded`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum BoundedEncodeError {
    /// Past the limit after `chunks` chunks (`at_least` ids so far).
    #[error("the text is at least {at_least} tokens, more than {limit}")]
    TooMany { at_least: usize, limit: usize, chunks: usize },
    #[error("tokenizing was stopped")]
    Stopped,
    #[error(transparent)]
    Failed(TokenizerError),
}

/// A piece of a prompt with its encoding mode (spec K3_CHAT §2.1): markup is encoded with
/// special tokens recognised, everything else (tag names, attribute values, all message text)
/// without, so content can never forge structure.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Segment {
    pub text: String,
    pub markup: bool,
}

impl Segment {
    pub fn markup(text: impl Into<String>) -> Self {
        Segment { text: text.into(), markup: true }
    }
    pub fn text(text: impl Into<String>) -> Self {
        Segment { text: text.into(), markup: false }
    }
}

/// Limits of the chunking step (spec K3_CHAT §1.4); the defaults are the release's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeLimits {
    pub max_chars: usize,
    pub max_run: usize,
}

impl Default for EncodeLimits {
    fn default() -> Self {
        EncodeLimits { max_chars: MAX_ENCODE_CHARS, max_run: MAX_NO_WHITESPACE_CHARS }
    }
}

/// The K3 tokenizer.
pub struct Tokenizer {
    bpe: CoreBPE,
    /// Bytes of every id: base tokens, then the special names.
    tokens: Vec<Vec<u8>>,
    n_base: u32,
    specials: HashMap<String, u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("n_base", &self.n_base).field("vocab", &self.vocab_size()).finish()
    }
}

impl Tokenizer {
    /// Loads `tiktoken.model` and `tokenizer_config.json` from a model directory. The number of
    /// special slots is `text_config.vocab_size - base tokens` when the directory has a
    /// `config.json` (synthetic models with small vocabularies use a compact block), else 256.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let ranks_path = dir.join("tiktoken.model");
        let cfg_path = dir.join("tokenizer_config.json");
        let ranks_text = std::fs::read_to_string(&ranks_path).map_err(|e| TokenizerError::Io { file: ranks_path.display().to_string(), source: e })?;
        let ranks = parse_ranks(&ranks_text, &ranks_path.display().to_string())?;
        let cfg_text = std::fs::read_to_string(&cfg_path).map_err(|e| TokenizerError::Io { file: cfg_path.display().to_string(), source: e })?;
        let named = parse_added_tokens(&cfg_text, &cfg_path.display().to_string())?;
        let n_base = ranks.len() as u32;
        let slots = match config_vocab_size(&dir.join("config.json"))? {
            Some(vocab) if vocab >= n_base => vocab - n_base,
            Some(vocab) => {
                return Err(TokenizerError::Invalid(format!(
                    "{}: vocab_size {vocab} is smaller than the {n_base} base tokens of {}",
                    dir.join("config.json").display(),
                    ranks_path.display()
                )))
            }
            None => RELEASE_SPECIAL_SLOTS,
        };
        // What the chat format relies on must be where the files say: the markers inside the
        // special block, and the ids config.json names spelled as K3 spells them.
        let vocab = n_base + slots;
        for (id, name) in &named {
            if [names::END_OF_MSG, names::OPEN, names::CLOSE, names::SEP, names::MEDIA_PAD].contains(&name.as_str()) && !(n_base..vocab).contains(id) {
                return Err(TokenizerError::Invalid(format!(
                    "{} names {name} as id {id}, but {} has {n_base} ranks, so the special ids are {n_base}..{vocab}: the two files do not belong together",
                    cfg_path.display(),
                    ranks_path.display()
                )));
            }
        }
        for (key, id) in config_special_ids(&dir.join("config.json"))? {
            let want: &[&str] = if key == "eos_token_id" { &[names::END_OF_MSG, names::EOS] } else { &[names::MEDIA_PAD] };
            let got = named.get(&id).map(String::as_str).unwrap_or("(no name)");
            if (n_base..vocab).contains(&id) && !want.contains(&got) {
                return Err(TokenizerError::Invalid(format!(
                    "{} says {key} = {id}, which {} names {got}, not {}",
                    dir.join("config.json").display(),
                    cfg_path.display(),
                    want.join(" or ")
                )));
            }
        }
        Self::from_parts(ranks, &named, slots)
    }

    /// Builds a tokenizer from base-token bytes (index = rank = id), the named special slots
    /// (id → name) and the number of special slots after the base tokens. Named ids outside
    /// the special block are ignored (as upstream), with a warning.
    pub fn from_parts(ranks: Vec<Vec<u8>>, named: &BTreeMap<u32, String>, special_slots: u32) -> Result<Self, TokenizerError> {
        let n_base = u32::try_from(ranks.len()).map_err(|_| TokenizerError::Invalid("too many base tokens".into()))?;
        let vocab = n_base.checked_add(special_slots).ok_or_else(|| TokenizerError::Invalid("vocabulary size overflows u32".into()))?;
        let mut encoder = rustc_hash::FxHashMap::default();
        for (rank, bytes) in ranks.iter().enumerate() {
            if bytes.is_empty() {
                return Err(TokenizerError::Invalid(format!("base token {rank} is empty")));
            }
            if encoder.insert(bytes.clone(), rank as u32).is_some() {
                return Err(TokenizerError::Invalid(format!("base token {rank} repeats the bytes {bytes:02x?}")));
            }
        }
        for (id, name) in named {
            if !(n_base..vocab).contains(id) {
                tracing::warn!(id, name, n_base, vocab, "tokenizer_config names a token outside the special block; ignored");
            }
        }
        let mut specials = HashMap::new();
        let mut tokens = ranks;
        for id in n_base..vocab {
            let name = named.get(&id).cloned().unwrap_or_else(|| format!("<|reserved_token_{id}|>"));
            if let Some(prev) = specials.insert(name.clone(), id) {
                return Err(TokenizerError::Invalid(format!("special tokens {prev} and {id} share the name {name:?}")));
            }
            tokens.push(name.into_bytes());
        }
        let special_map: rustc_hash::FxHashMap<String, u32> = specials.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let bpe = CoreBPE::new(encoder, special_map, PAT_STR).map_err(|e| TokenizerError::Invalid(format!("building the BPE: {e}")))?;
        Ok(Tokenizer { bpe, tokens, n_base, specials })
    }

    /// Total number of ids (base tokens + special slots).
    pub fn vocab_size(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// Number of base (BPE) tokens = the first special id.
    pub fn n_base(&self) -> u32 {
        self.n_base
    }

    /// Id of a special token by name (named or `<|reserved_token_N|>`).
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.specials.get(name).copied()
    }

    /// Whether `id` is in the special block.
    pub fn is_special(&self, id: u32) -> bool {
        id >= self.n_base && id < self.vocab_size()
    }

    /// The bytes of one id (a special id gives its name).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.tokens.get(id as usize).map(|v| v.as_slice())
    }

    /// `encode(text)` as `tokenization_kimi.py` does it, with the release's chunk limits.
    /// `allow_special = true` recognises all special names (raw completion prompts, markup);
    /// `false` never does (user text).
    pub fn encode(&self, text: &str, allow_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with_limits(text, allow_special, EncodeLimits::default())
    }

    /// [`Tokenizer::encode`] with explicit chunk limits (tests pin the chunking with small ones).
    pub fn encode_with_limits(&self, text: &str, allow_special: bool, limits: EncodeLimits) -> Result<Vec<u32>, TokenizerError> {
        if text.is_empty() {
            return Ok(Vec::new());
        }
        if allow_special {
            if let Some(&id) = self.specials.get(text) {
                return Ok(vec![id]);
            }
        }
        let allowed: HashSet<&str> = if allow_special { self.specials.keys().map(|s| s.as_str()).collect() } else { HashSet::new() };
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        for piece in chunk_pieces(text, limits.max_chars, limits.max_run) {
            if piece.is_empty() {
                continue;
            }
            let (ids, _) = self.bpe.encode(piece, &allowed).map_err(|e| TokenizerError::Encode(e.to_string()))?;
            out.extend(ids);
        }
        Ok(out)
    }

    /// Encodes each segment on its own and concatenates the ids (spec K3_CHAT §2.1).
    pub fn encode_segments(&self, segments: &[Segment]) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        for s in segments {
            out.extend(self.encode(&s.text, s.markup)?);
        }
        Ok(out)
    }

    /// [`Tokenizer::encode_segments`] that gives up once the ids pass `max_tokens` (a prompt
    /// over a context limit is refused without tokenizing all of it) or `stop()` says so (its
    /// client left). Both are checked after every chunk of at most [`MAX_ENCODE_CHARS`]
    /// characters, so the work past the limit is at most one chunk. The ids are the same as
    /// `encode_segments`'s (the chunks are the ones it encodes).
    pub fn encode_segments_bounded(&self, segments: &[Segment], max_tokens: usize, stop: &dyn Fn() -> bool) -> Result<Vec<u32>, BoundedEncodeError> {
        let mut out = Vec::new();
        let mut chunks = 0usize;
        for s in segments {
            if s.text.is_empty() {
                continue;
            }
            if s.markup {
                if let Some(&id) = self.specials.get(s.text.as_str()) {
                    out.push(id);
                    continue;
                }
            }
            let allowed: HashSet<&str> = if s.markup { self.specials.keys().map(|s| s.as_str()).collect() } else { HashSet::new() };
            for piece in chunk_pieces(&s.text, MAX_ENCODE_CHARS, MAX_NO_WHITESPACE_CHARS) {
                if piece.is_empty() {
                    continue;
                }
                let (ids, _) = self.bpe.encode(piece, &allowed).map_err(|e| BoundedEncodeError::Failed(TokenizerError::Encode(e.to_string())))?;
                out.extend(ids);
                chunks += 1;
                if out.len() > max_tokens {
                    return Err(BoundedEncodeError::TooMany { at_least: out.len(), limit: max_tokens, chunks });
                }
                if stop() {
                    return Err(BoundedEncodeError::Stopped);
                }
            }
        }
        Ok(out)
    }

    /// The concatenated bytes of `ids`; an id outside the vocabulary is an error.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::new();
        for &id in ids {
            let b = self.token_bytes(id).ok_or(TokenizerError::UnknownId { id, vocab: self.vocab_size() })?;
            out.extend_from_slice(b);
        }
        Ok(out)
    }

    /// `decode(ids)` with `errors="replace"`: special ids decode to their names; an id outside
    /// the vocabulary decodes to U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            match self.token_bytes(id) {
                Some(b) => bytes.extend_from_slice(b),
                None => bytes.extend_from_slice("\u{FFFD}".as_bytes()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
