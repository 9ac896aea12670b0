//! Locations of the golden reference sets copied into this repository (`tests/golden/`).

use std::path::PathBuf;

/// `tests/golden/<name>` of this workspace.
pub fn golden_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join("tests").join("golden").join(name)
}

/// `tests/golden/tiny-a/golden.safetensors`.
pub fn tiny_a_golden() -> PathBuf {
    golden_dir("tiny-a").join("golden.safetensors")
}
