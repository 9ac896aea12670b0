//! Opening the files a checkpoint, a session or a config names: only regular files, with a size
//! bound where the file is read whole. A FIFO, a socket or a device in place of a shard would
//! block `open` or `read` forever (or stream without end); a directory fails later with a less
//! helpful message. Both are refused here, before anything is opened.
//!
//! Also the one reader of a token-id file (`--input-ids`, `--ids`): a JSON array of integers.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

/// What kind of non-regular file a path names, for the error message.
fn kind(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_block_device() || t.is_char_device() {
            return "a device";
        }
    }
    "not a regular file"
}

/// Opens `path` for reading if it is a regular file (symbolic links are followed); anything
/// else is an `InvalidInput` error naming what it is, and is never opened.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is {}, not a regular file", path.display(), kind(&meta))));
    }
    let file = File::open(path)?;
    // The path may have been replaced between the two calls: check what was opened.
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is {}, not a regular file", path.display(), kind(&meta))));
    }
    Ok(file)
}

/// Reads a whole regular file of at most `max_bytes`.
pub fn read_regular(path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
    let file = open_regular(path)?;
    let len = file.metadata()?.len();
    if len > max_bytes {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{} is {len} bytes, more than the {max_bytes} accepted", path.display())));
    }
    let mut out = Vec::with_capacity(len as usize);
    // `take` bounds the read even if the file grows meanwhile.
    file.take(max_bytes + 1).read_to_end(&mut out)?;
    if out.len() as u64 > max_bytes {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("{} grew past the {max_bytes} bytes accepted while being read", path.display())));
    }
    Ok(out)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_to_string(path: &Path, max_bytes: u64) -> io::Result<String> {
    String::from_utf8(read_regular(path, max_bytes)?).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{} is not UTF-8: {e}", path.display())))
}

/// Token ids from the entries of a JSON array: each must be an integer in `u32` range; the error
/// names the first entry that is not (`entry 3 (-1) is not a token id`).
pub fn token_ids(vals: &[serde_json::Value]) -> anyhow::Result<Vec<u32>> {
    vals.iter()
        .enumerate()
        .map(|(i, v)| v.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| anyhow::anyhow!("entry {i} ({v}) is not a token id")))
        .collect()
}

/// Reads a file holding a JSON array of token ids (see [`token_ids`]); errors name the path.
pub fn read_token_ids(path: &Path) -> anyhow::Result<Vec<u32>> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read token ids {}", path.display()))?;
    let vals: Vec<serde_json::Value> = serde_json::from_str(&text).with_context(|| format!("{}: expected a JSON array of token ids", path.display()))?;
    token_ids(&vals).with_context(|| path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_accept_u32_and_name_the_first_bad_entry() {
        let ok: Vec<serde_json::Value> = serde_json::from_str("[0, 7, 4294967295]").unwrap();
        assert_eq!(token_ids(&ok).unwrap(), vec![0, 7, u32::MAX]);
        for (text, bad) in
            [("[1, -1]", "entry 1 (-1)"), ("[4294967296]", "entry 0 (4294967296)"), ("[2, 3.5]", "entry 1 (3.5)"), ("[\"a\"]", "entry 0 (\"a\")")]
        {
            let vals: Vec<serde_json::Value> = serde_json::from_str(text).unwrap();
            let err = token_ids(&vals).unwrap_err().to_string();
            assert!(err.contains(bad), "{text}: {err}");
        }
    }

    #[test]
    fn read_token_ids_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("ids.json");
        std::fs::write(&good, "[5, 6]").unwrap();
        assert_eq!(read_token_ids(&good).unwrap(), vec![5, 6]);
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{\"ids\": [5]}").unwrap();
        let err = format!("{:#}", read_token_ids(&bad).unwrap_err());
        assert!(err.contains("bad.json") && err.contains("JSON array"), "{err}");
        let neg = dir.path().join("neg.json");
        std::fs::write(&neg, "[5, -6]").unwrap();
        let err = format!("{:#}", read_token_ids(&neg).unwrap_err());
        assert!(err.contains("neg.json") && err.contains("entry 1 (-6)"), "{err}");
    }
}
