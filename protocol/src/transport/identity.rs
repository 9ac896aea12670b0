//! Node identity and pairing. Each node has a self-signed certificate, generated on first run
//! and kept in its config dir (`node-cert.der`, `node-key.der` with mode 0600). Nodes trust each
//! other by pinning the SHA-256 fingerprint of the peer's certificate — no CA, no names.
//! Pairing = each node prints its fingerprint, the operator gives it to the other side.

use std::path::{Path, PathBuf};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::transport::cert_fingerprint::CertFingerprint;
use crate::transport::error::TransferError;

const CERT_FILE: &str = "node-cert.der";
const KEY_FILE: &str = "node-key.der";
const PEERS_FILE: &str = "pinned-peers.txt";

/// Which side of the hand-off a node is (for pairing texts and default dirs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRole {
    Prefill,
    Decoder,
}

impl NodeRole {
    pub fn dir_name(self) -> &'static str {
        match self {
            NodeRole::Prefill => "prefill",
            NodeRole::Decoder => "decoder",
        }
    }
}

/// `$K3_CONFIG_DIR/<role>`, else `$XDG_CONFIG_HOME/k3-offload/<role>`, else `~/.config/k3-offload/<role>`.
pub fn default_config_dir(role: NodeRole) -> PathBuf {
    if let Some(d) = std::env::var_os("K3_CONFIG_DIR") {
        return PathBuf::from(d).join(role.dir_name());
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from("."));
    base.join("k3-offload").join(role.dir_name())
}

/// A node's certificate and private key.
#[derive(Debug)]
pub struct NodeIdentity {
    cert: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
    fingerprint: CertFingerprint,
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        NodeIdentity { cert: self.cert.clone(), key: self.key.clone_key(), fingerprint: self.fingerprint }
    }
}

impl NodeIdentity {
    /// A fresh self-signed certificate (ECDSA P-256), valid for the name `k3-offload`.
    pub fn generate() -> Result<NodeIdentity, TransferError> {
        let ck = rcgen::generate_simple_self_signed(vec!["k3-offload".to_string()])
            .map_err(|e| TransferError::Identity(format!("generating a certificate: {e}")))?;
        let cert = ck.cert.der().clone();
        let key = PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der());
        Ok(NodeIdentity { fingerprint: CertFingerprint::of_der(&cert), cert, key })
    }

    /// Loads the identity kept in `dir`, creating it (and the dir) on first run.
    pub fn load_or_create(dir: &Path) -> Result<NodeIdentity, TransferError> {
        let cert_path = dir.join(CERT_FILE);
        let key_path = dir.join(KEY_FILE);
        let err = |what: &str, p: &Path, e: std::io::Error| TransferError::Identity(format!("{what} {}: {e}", p.display()));
        if cert_path.exists() || key_path.exists() {
            let cert = std::fs::read(&cert_path).map_err(|e| err("reading", &cert_path, e))?;
            let key = std::fs::read(&key_path).map_err(|e| err("reading", &key_path, e))?;
            let id = NodeIdentity { fingerprint: CertFingerprint::of_der(&cert), cert: CertificateDer::from(cert), key: PrivatePkcs8KeyDer::from(key) };
            // Check that the pair is usable now rather than at the first handshake.
            rustls::crypto::ring::sign::any_supported_type(&id.private_key())
                .map_err(|e| TransferError::Identity(format!("key {} is not a usable PKCS#8 key: {e}", key_path.display())))?;
            return Ok(id);
        }
        std::fs::create_dir_all(dir).map_err(|e| err("creating", dir, e))?;
        let id = NodeIdentity::generate()?;
        write_private(&key_path, id.key.secret_pkcs8_der()).map_err(|e| err("writing", &key_path, e))?;
        std::fs::write(&cert_path, id.cert.as_ref()).map_err(|e| err("writing", &cert_path, e))?;
        tracing::info!(dir = %dir.display(), fingerprint = %id.fingerprint, "generated a new node certificate");
        Ok(id)
    }

    pub fn fingerprint(&self) -> CertFingerprint {
        self.fingerprint
    }

    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    pub(crate) fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }

    /// What to show the operator when pairing: this node's fingerprint and the line to use
    /// on the other node.
    pub fn pairing_text(&self, role: NodeRole) -> String {
        let fp = self.fingerprint;
        match role {
            NodeRole::Prefill => format!(
                "This prefill node's certificate fingerprint:\n  {fp}\n\
                 On the decoder (Mac), pin it with:\n  --prefill-fingerprint {fp}\n\
                 and give this node the decoder's fingerprint (--decoder-fingerprint sha256:...)."
            ),
            NodeRole::Decoder => format!(
                "This decoder's certificate fingerprint:\n  {fp}\n\
                 On the prefill node, pin it with:\n  --decoder-fingerprint {fp}\n\
                 and give this node the prefill node's fingerprint (--prefill-fingerprint sha256:...)."
            ),
        }
    }
}

#[cfg(unix)]
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(bytes)
}

#[cfg(not(unix))]
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::write(path, bytes)
}

/// The peers a node trusts, kept as `pinned-peers.txt` in its config dir: one
/// `sha256:<hex> [name]` per line, `#` comments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PinnedPeers {
    pub peers: Vec<(CertFingerprint, String)>,
}

impl PinnedPeers {
    pub fn load(dir: &Path) -> Result<PinnedPeers, TransferError> {
        let path = dir.join(PEERS_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(PinnedPeers::default()),
            Err(e) => return Err(TransferError::Identity(format!("reading {}: {e}", path.display()))),
        };
        let mut peers = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (fp, name) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
            let fp = CertFingerprint::parse(fp)
                .ok_or_else(|| TransferError::Identity(format!("{} line {}: not a sha256 fingerprint: {fp}", path.display(), n + 1)))?;
            peers.push((fp, name.trim().to_string()));
        }
        Ok(PinnedPeers { peers })
    }

    /// Adds (or renames) a peer and writes the file.
    pub fn add_and_save(&mut self, dir: &Path, fp: CertFingerprint, name: &str) -> Result<(), TransferError> {
        self.peers.retain(|(f, _)| *f != fp);
        self.peers.push((fp, name.to_string()));
        let mut text = String::from("# k3-offload pinned peer certificates: sha256:<hex> name\n");
        for (f, n) in &self.peers {
            text.push_str(&format!("{f} {n}\n"));
        }
        std::fs::create_dir_all(dir).map_err(|e| TransferError::Identity(format!("creating {}: {e}", dir.display())))?;
        let path = dir.join(PEERS_FILE);
        std::fs::write(&path, text).map_err(|e| TransferError::Identity(format!("writing {}: {e}", path.display())))
    }

    pub fn fingerprints(&self) -> Vec<CertFingerprint> {
        self.peers.iter().map(|(f, _)| *f).collect()
    }
}
