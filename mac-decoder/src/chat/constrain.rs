//! Constrained decoding with llguidance: the tokenizer as a token trie (built once per
//! tokenizer), and per request a matcher of a [`super::grammar`] grammar that masks the
//! sampler's logits ([`crate::sampler::TokenConstraint`]).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use super::grammar::{reply_grammar, GrammarError, ReplyShape};
use crate::sampler::{SamplingError, TokenConstraint};
use crate::tokenizer::{names, Tokenizer, TokenizerError};

/// The tokenizer as llguidance sees it: ordinary tokens by their bytes, special tokens as
/// `\xff` + their name (how llguidance marks specials), `<|end_of_msg|>` as the end token.
struct K3TokEnv {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for K3TokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s).ok().and_then(|t| self.tok.encode(t, false).ok()) {
            Some(ids) => ids,
            None => self.trie.greedy_tokenize(s),
        }
    }
}

/// Builds constraints for one tokenizer (the token trie and llguidance's parser factory are
/// made once: about a second for K3's 163,840 ids).
pub struct Grammars {
    factory: ParserFactory,
    end_of_msg: u32,
}

impl Grammars {
    pub fn new(tok: Arc<Tokenizer>) -> Result<Self, GrammarError> {
        let end_of_msg = tok.special_id(names::END_OF_MSG).ok_or(TokenizerError::MissingSpecial(names::END_OF_MSG))?;
        let n = tok.vocab_size();
        let mut words = Vec::with_capacity(n as usize);
        for id in 0..n {
            if tok.is_special(id) {
                let name = tok.decode(&[id]);
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(name.as_bytes());
                words.push(w);
            } else {
                words.push(tok.token_bytes(id).ok_or(GrammarError::TokenWithoutBytes(id))?.to_vec());
            }
        }
        let info = TokRxInfo::new(n, end_of_msg);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(K3TokEnv { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Llguidance(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory, end_of_msg })
    }

    /// A constraint for a reply of `shape` after a thinking (or non-thinking) generation prompt.
    pub fn constraint(&self, shape: &ReplyShape, thinking: bool) -> Result<GrammarConstraint, GrammarError> {
        let lark = reply_grammar(shape, thinking)?;
        if lark.len() > MAX_GRAMMAR_BYTES {
            return Err(GrammarError::Unusable(format!("the grammar is {} bytes; at most {MAX_GRAMMAR_BYTES}", lark.len())));
        }
        self.from_lark(&lark)
    }

    /// A constraint from a Lark grammar (llguidance syntax). The first mask is computed here, so
    /// a grammar that cannot start (an unsatisfiable recursive `$ref`, a grammar llguidance
    /// fails on) is refused before its request is queued, with a one-line message.
    pub fn from_lark(&self, lark: &str) -> Result<GrammarConstraint, GrammarError> {
        let parser =
            self.factory.create_parser(TopLevelGrammar::from_lark(lark.to_string())).map_err(|e| GrammarError::Unusable(short_error(&e.to_string())))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Unusable(short_error(&e)));
        }
        match matcher.compute_mask() {
            Ok(m) if m.num_set() == 0 => return Err(GrammarError::Unusable("no reply satisfies it".into())),
            Ok(_) => {}
            Err(e) => return Err(GrammarError::Unusable(short_error(&e.to_string()))),
        }
        Ok(GrammarConstraint { matcher, end_of_msg: self.end_of_msg, vocab: self.factory.tok_env().tok_trie().vocab_size() })
    }
}

/// Largest grammar (Lark text) one request may build.
pub const MAX_GRAMMAR_BYTES: usize = 2 << 20;

/// An llguidance error as a client may read it: its first line, at most 200 characters; a
/// caught panic (whose text carries a backtrace and build paths) or an internal parser state
/// is named, not shown.
pub fn short_error(e: &str) -> String {
    let lower = e.to_ascii_lowercase();
    if lower.contains("panic") || lower.contains("backtrace") {
        return "llguidance failed on it".into();
    }
    let line = e.lines().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
    if line == "NoExtensionBias" {
        // the parser's name for "no token can start": the grammar derives no reply
        return "no reply satisfies it (a rule that never reaches a value, such as a $ref loop)".into();
    }
    let mut out: String = line.chars().take(200).collect();
    if out.len() < line.len() {
        out.push('…');
    }
    out
}

/// One request's grammar state.
pub struct GrammarConstraint {
    matcher: Matcher,
    end_of_msg: u32,
    vocab: usize,
}

impl TokenConstraint for GrammarConstraint {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), SamplingError> {
        let allowed = self.matcher.compute_mask_or_eos().map_err(|e| SamplingError::Grammar(e.to_string()))?;
        let n = logits.len().min(self.vocab);
        allowed.iter_unset_entries(|i| {
            if i < n {
                logits[i] = f32::NEG_INFINITY;
            }
        });
        // Ids the tokenizer does not have (padding rows of the output layer) never fit.
        for l in logits.iter_mut().skip(self.vocab) {
            *l = f32::NEG_INFINITY;
        }
        if allowed.num_set() == 0 {
            return Err(SamplingError::NothingAllowed);
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), SamplingError> {
        if token == self.end_of_msg && self.matcher.is_stopped() {
            return Ok(()); // the end of a finished grammar
        }
        self.matcher.consume_token(token).map_err(|e| SamplingError::Grammar(e.to_string()))
    }
}
