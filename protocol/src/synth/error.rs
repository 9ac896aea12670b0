//! The error of synthetic-model writing: a bad config or override, an I/O failure naming the
//! file, or an inconsistency found while planning or writing.

use std::path::Path;

use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("synthetic config: {0}")]
    Config(#[from] ConfigError),
    #[error("cannot write {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
    #[error("unknown preset {0:?} (expected tiny, small, medium or k3)")]
    UnknownPreset(String),
    #[error("vocab_size {vocab} is too small: it needs 256 single-byte tokens plus {slots} special slots")]
    VocabTooSmall { vocab: usize, slots: usize },
}

impl SynthError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        SynthError::Io { path: path.display().to_string(), source }
    }
}

/// `std::fs::write` with an error that names the file.
pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), SynthError> {
    std::fs::write(path, bytes).map_err(|e| SynthError::io(path, e))
}
