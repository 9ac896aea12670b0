//! Opening the files a checkpoint, a session or a config names: only regular files, with a size
//! bound where the file is read whole. A FIFO, a socket or a device in place of a shard would
//! block `open` or `read` forever (or stream without end); a directory fails later with a less
//! helpful message. Both are refused here, before anything is opened.

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
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is {}, not a regular file", path.display(), kind(&meta)),
        ));
    }
    let file = File::open(path)?;
    // The path may have been replaced between the two calls: check what was opened.
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is {}, not a regular file", path.display(), kind(&meta)),
        ));
    }
    Ok(file)
}

/// Reads a whole regular file of at most `max_bytes`.
pub fn read_regular(path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
    let file = open_regular(path)?;
    let len = file.metadata()?.len();
    if len > max_bytes {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is {len} bytes, more than the {max_bytes} accepted", path.display()),
        ));
    }
    let mut out = Vec::with_capacity(len as usize);
    // `take` bounds the read even if the file grows meanwhile.
    file.take(max_bytes + 1).read_to_end(&mut out)?;
    if out.len() as u64 > max_bytes {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} grew past the {max_bytes} bytes accepted while being read", path.display()),
        ));
    }
    Ok(out)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_to_string(path: &Path, max_bytes: u64) -> io::Result<String> {
    String::from_utf8(read_regular(path, max_bytes)?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{} is not UTF-8: {e}", path.display())))
}
