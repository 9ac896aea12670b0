//! Pre-tokenization (spec K3_CHAT §1.2) and the chunking of long inputs (§1.4 steps 1–2).

/// K3's pre-tokenization pattern, verbatim. It needs fancy-regex (the `\s+(?!\S)` lookahead).
pub const PAT_STR: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Input is cut into chunks of this many code points before encoding (tiktoken's limit).
pub const MAX_ENCODE_CHARS: usize = 400_000;
/// No piece handed to tiktoken holds a run of more than this many whitespace (or
/// non-whitespace) characters.
pub const MAX_NO_WHITESPACE_CHARS: usize = 25_000;

/// Python's `str.isspace()`: Unicode `White_Space` plus U+001C..U+001F (which Rust's
/// `char::is_whitespace` leaves out).
pub fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The pieces `text` is encoded in: chunks of `max_chars` code points, each cut so that no
/// piece has a run of more than `max_run` consecutive whitespace or non-whitespace characters
/// (a run reaching `max_run + 1` starts a new piece at that character). Empty text gives one
/// empty piece, as upstream.
pub fn chunk_pieces(text: &str, max_chars: usize, max_run: usize) -> Vec<&str> {
    let max_chars = max_chars.max(1);
    let max_run = max_run.max(1);
    let mut out = Vec::new();
    let mut chunk_start = 0usize;
    let mut count = 0usize;
    let mut chunks = Vec::new();
    for (i, _) in text.char_indices() {
        if count == max_chars {
            chunks.push(&text[chunk_start..i]);
            chunk_start = i;
            count = 0;
        }
        count += 1;
    }
    chunks.push(&text[chunk_start..]);
    for chunk in chunks {
        split_runs(chunk, max_run, &mut out);
    }
    out
}

fn split_runs<'a>(s: &'a str, max_run: usize, out: &mut Vec<&'a str>) {
    let mut run_len = 0usize;
    let mut run_is_space = s.chars().next().is_some_and(py_isspace);
    let mut slice_start = 0usize;
    for (i, c) in s.char_indices() {
        let sp = py_isspace(c);
        if sp != run_is_space {
            run_len = 1;
            run_is_space = sp;
        } else {
            run_len += 1;
            if run_len > max_run {
                out.push(&s[slice_start..i]);
                slice_start = i;
                run_len = 1;
            }
        }
    }
    out.push(&s[slice_start..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_compiles_in_fancy_regex_and_splits_lookahead_cases() {
        let re = fancy_regex::Regex::new(PAT_STR).unwrap();
        let split = |s: &str| re.find_iter(s).map(|m| m.unwrap().as_str().to_string()).collect::<Vec<_>>();
        assert_eq!(split("a    b"), ["a", "   ", " b"]);
        assert_eq!(split("IT'S"), ["IT'S"]);
        assert_eq!(split("你a好b世c"), ["你", "a", "好", "b", "世", "c"]);
        assert_eq!(split("1234567890"), ["123", "456", "789", "0"]);
        assert_eq!(split("text   \n   more"), ["text", "   \n", "  ", " more"]);
    }

    #[test]
    fn isspace_follows_python() {
        assert!(py_isspace('\u{1c}') && py_isspace('\u{1f}') && py_isspace(' ') && py_isspace('\u{3000}'));
        assert!(!py_isspace('a') && !py_isspace('\u{200b}'));
    }

    #[test]
    fn run_splitting_is_greedy() {
        assert_eq!(chunk_pieces("abcdefghij", 100, 4), ["abcd", "efgh", "ij"]);
        assert_eq!(chunk_pieces("ab   ab", 100, 2), ["ab  ", " ab"]);
        assert_eq!(chunk_pieces("", 100, 4), [""]);
        assert_eq!(chunk_pieces("aaaaaaa", 3, 100), ["aaa", "aaa", "a"]);
    }
}
