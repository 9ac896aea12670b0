//! A stable model fingerprint: SHA-256 over the typed config and the tensor index (names,
//! dtypes, shapes, sizes; not the data). Both nodes compare it before exchanging state.

use sha2::{Digest, Sha256};

use crate::checkpoint::Checkpoint;
use crate::config::K3Config;

/// 32-byte model fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
    /// The first 16 hex digits, for logs.
    pub fn short(&self) -> String {
        self.hex()[..16].to_string()
    }
    pub fn from_hex(s: &str) -> Option<Self> {
        let v = hex::decode(s).ok()?;
        Some(Fingerprint(v.try_into().ok()?))
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", self.short())
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hex())
    }
}

/// Fingerprint of a config and a list of `(name, dtype, shape)` entries (order-independent).
pub fn fingerprint_of(config: &K3Config, tensors: &mut [(String, &'static str, Vec<usize>)]) -> Fingerprint {
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut h = Sha256::new();
    h.update(b"k3-offload model fingerprint v1\n");
    // The typed config re-serialised: independent of key order and whitespace in the file.
    h.update(serde_json::to_vec(config).expect("config serialises"));
    h.update(b"\n");
    for (name, dtype, shape) in tensors.iter() {
        h.update(name.as_bytes());
        h.update([0]);
        h.update(dtype.as_bytes());
        for d in shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update([b'\n']);
    }
    Fingerprint(h.finalize().into())
}

impl Checkpoint {
    /// The fingerprint of this checkpoint's config and tensor index.
    pub fn fingerprint(&self) -> Fingerprint {
        let mut list: Vec<(String, &'static str, Vec<usize>)> = self
            .tensor_names()
            .map(|n| {
                let e = self.entry(n).expect("listed");
                (n.to_string(), e.dtype.name(), e.shape.clone())
            })
            .collect();
        fingerprint_of(self.config(), &mut list)
    }
}
