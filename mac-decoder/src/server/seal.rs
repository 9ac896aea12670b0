//! Sealed reasoning: the blob the server hands out for a reply's reasoning (the Responses API's
//! `encrypted_content`, the Messages API's thinking `signature`) and takes back in the next
//! turn's history, so past reasoning re-renders exactly, even when the client never saw it
//! (`display: "omitted"`, `include: ["reasoning.encrypted_content"]` with `store: false`).
//!
//! Format: `k3r1.` + base64url(the reasoning's UTF-8) + `.` + base64url(the first 16 bytes of
//! HMAC-SHA256 over the version and the text). The key derives from the served model id and the
//! server's API key (when set), so blobs survive a restart of the same server and a blob from
//! another model or server is refused (then the block's own text, if any, is used). The blob
//! is authenticated, not secret: the client may read the reasoning (it could anyway, with
//! `display` other than `omitted`); what matters is that a blob round-trips unchanged.

use base64::Engine as _;
use sha2::{Digest, Sha256};

const PREFIX: &str = "k3r1.";
const TAG_BYTES: usize = 16;

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
}

/// Seals and opens reasoning blobs for one server.
#[derive(Clone)]
pub struct Sealer {
    key: [u8; 32],
}

impl Sealer {
    /// A sealer for the model `model_id` served with API key `secret` (if any).
    pub fn new(model_id: &str, secret: Option<&str>) -> Self {
        let mut h = Sha256::new();
        h.update(b"k3-offload reasoning seal v1\0");
        h.update(model_id.as_bytes());
        h.update([0]);
        h.update(secret.unwrap_or("").as_bytes());
        Sealer { key: h.finalize().into() }
    }

    fn tag(&self, text: &[u8]) -> [u8; 32] {
        // HMAC-SHA256 (RFC 2104) over `PREFIX || text`.
        let mut k = [0u8; 64];
        k[..32].copy_from_slice(&self.key);
        let mut inner = Sha256::new();
        inner.update(k.map(|b| b ^ 0x36));
        inner.update(PREFIX.as_bytes());
        inner.update(text);
        let mut outer = Sha256::new();
        outer.update(k.map(|b| b ^ 0x5c));
        outer.update(inner.finalize());
        outer.finalize().into()
    }

    /// The blob of `reasoning`.
    pub fn seal(&self, reasoning: &str) -> String {
        let tag = self.tag(reasoning.as_bytes());
        format!("{PREFIX}{}.{}", b64().encode(reasoning.as_bytes()), b64().encode(&tag[..TAG_BYTES]))
    }

    /// The reasoning a blob of this server holds; `None` for anything else (another server's
    /// or model's blob, a changed one, another provider's signature).
    pub fn open(&self, blob: &str) -> Option<String> {
        let rest = blob.strip_prefix(PREFIX)?;
        let (body, tag) = rest.rsplit_once('.')?;
        let text = b64().decode(body).ok()?;
        let tag = b64().decode(tag).ok()?;
        let want = self.tag(&text);
        // constant-time comparison of the tag
        if tag.len() != TAG_BYTES || tag.iter().zip(&want[..TAG_BYTES]).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0 {
            return None;
        }
        String::from_utf8(text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::Sealer;

    #[test]
    fn blobs_round_trip_and_refuse_tampering() {
        let s = Sealer::new("tiny-t", None);
        for text in ["", "Think about 2+2.\nIt is 4. ünïcode 🚀", &"x".repeat(10_000)] {
            let blob = s.seal(text);
            assert!(blob.starts_with("k3r1."));
            assert_eq!(s.open(&blob).as_deref(), Some(text));
            // Deterministic: the same server seals the same text the same way (a restart too).
            assert_eq!(Sealer::new("tiny-t", None).seal(text), blob);
        }
        let blob = s.seal("secret plan");
        assert_eq!(Sealer::new("other-model", None).open(&blob), None);
        assert_eq!(Sealer::new("tiny-t", Some("key")).open(&blob), None);
        let forged = blob.replacen("c2VjcmV0", "c2VjcmVU", 1);
        assert_ne!(forged, blob);
        assert_eq!(s.open(&forged), None);
        for junk in ["", "SIGNATURE-STUB", "k3r1.", "k3r1.abc", "k3r1.!!.??", "EqQBCkgIBhABGAIiQL"] {
            assert_eq!(s.open(junk), None, "{junk}");
        }
    }
}
