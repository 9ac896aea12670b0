//! Byte-exact streaming decode (spec K3_CHAT §1.5).
//!
//! Tokens are byte-level, so one token can end inside a multi-byte character. A
//! [`Utf8Stream`] keeps the bytes of an incomplete character (at most 3) until the rest
//! arrives; bytes that can never become valid UTF-8 are replaced by U+FFFD at once, exactly
//! where Python's `bytes.decode(errors="replace")` puts them; [`Utf8Stream::finish`] flushes an
//! incomplete tail as U+FFFD. The concatenation of everything emitted equals the lossy decode
//! of all the bytes, and no character is ever split across two outputs.

/// Incremental UTF-8 decoder with hold-back of an incomplete trailing character.
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds bytes and returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0usize;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: from_utf8 guarantees this prefix is valid.
                    out.push_str(std::str::from_utf8(&self.pending[start..start + valid]).unwrap_or_default());
                    match e.error_len() {
                        // A valid but incomplete sequence at the end: hold it back.
                        None => {
                            start += valid;
                            break;
                        }
                        // Bytes that cannot start or continue a character: replace them now.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            start += valid + n;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Bytes held back (an incomplete character), at most 3.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: an incomplete tail becomes U+FFFD (Python's `errors="replace"`).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_incomplete_chars_and_matches_lossy_decode() {
        let inputs: [&[u8]; 5] = ["🚀🔥".as_bytes(), b"a\xe4\xbd", b"\xff\xfeok\xe4\xbd\xa0", b"\xe4\x41\xf0\x9f\x9a", "naïve".as_bytes()];
        for bytes in inputs {
            for step in 1..=3 {
                let mut s = Utf8Stream::new();
                let mut got = String::new();
                for c in bytes.chunks(step) {
                    let out = s.push(c);
                    assert!(s.pending().len() <= 3);
                    got.push_str(&out);
                }
                got.push_str(&s.finish());
                assert_eq!(got, String::from_utf8_lossy(bytes), "{bytes:02x?} step {step}");
            }
        }
    }

    #[test]
    fn never_splits_a_character() {
        let mut s = Utf8Stream::new();
        assert_eq!(s.push(&[0xF0, 0x9F]), "");
        assert_eq!(s.push(&[0x9A]), "");
        assert_eq!(s.push(&[0x80, b'x']), "🚀x");
        assert_eq!(s.finish(), "");
    }
}
