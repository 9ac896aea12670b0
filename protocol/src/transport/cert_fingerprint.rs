//! The SHA-256 fingerprint of a node certificate: what pairing pins and what errors name.

use sha2::{Digest, Sha256};

/// SHA-256 of a certificate's DER, written `sha256:<64 hex>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CertFingerprint(pub [u8; 32]);

impl CertFingerprint {
    pub fn of_der(der: &[u8]) -> CertFingerprint {
        CertFingerprint(Sha256::digest(der).into())
    }

    /// Parses `sha256:<hex>` or bare hex (colons between bytes allowed).
    pub fn parse(s: &str) -> Option<CertFingerprint> {
        let s = s.trim();
        let s = s.strip_prefix("sha256:").or_else(|| s.strip_prefix("SHA256:")).unwrap_or(s);
        let hexs: String = s.chars().filter(|c| *c != ':').collect();
        let v = hex::decode(hexs).ok()?;
        Some(CertFingerprint(v.try_into().ok()?))
    }
}

impl std::fmt::Display for CertFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl std::fmt::Debug for CertFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CertFingerprint({self})")
    }
}
