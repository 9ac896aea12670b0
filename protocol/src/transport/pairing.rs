//! Whom a node trusts, from its config dir and its command line — the one pairing set-up of
//! both nodes (`k3-prefill serve --decoder-fingerprint`, `k3-decode --prefill-fingerprint`).
//!
//! Fingerprints given on the command line REPLACE the saved pins for the run (a peer paired
//! before is refused unless named again). They are written to `pinned-peers.txt` only once a
//! peer has proved, in a handshake, that it holds one of them: the saved pins of the peer's role
//! then become the explicit values proved so far, so a stale peer is no longer trusted by later
//! starts. Without explicit values the saved pins are used; with none saved the node is not
//! paired, which is an error naming the flags to use. `--insecure-dev` skips all of it.

use std::path::PathBuf;

use crate::transport::cert_fingerprint::CertFingerprint;
use crate::transport::error::TransferError;
use crate::transport::identity::{default_config_dir, NodeIdentity, NodeRole, PinnedPeers};
use crate::transport::tls::PeerAuth;

/// Why a node cannot say whom it trusts.
#[derive(Debug, thiserror::Error)]
pub enum PairingError {
    #[error("{flag} {value}: expected sha256:<64 hex digits>")]
    BadFingerprint { flag: &'static str, value: String },
    #[error("{}", not_paired_text(*.0))]
    NotPaired(NodeRole),
    #[error(transparent)]
    Identity(#[from] TransferError),
}

/// What an unpaired node of `role` tells its operator.
fn not_paired_text(role: NodeRole) -> &'static str {
    match role {
        NodeRole::Prefill => {
            "no decoder is paired with this node: pass --decoder-fingerprint sha256:... (the decoder's \
             certificate fingerprint; `k3-decode` prints it when it connects) or use --insecure-dev on loopback"
        }
        NodeRole::Decoder => {
            "no prefill node is paired with this decoder: pass --prefill-fingerprint sha256:... (printed by \
             `k3-prefill serve`) and give the node this decoder's certificate fingerprint (--decoder-fingerprint), or \
             use --insecure-dev on loopback"
        }
    }
}

impl NodeRole {
    /// The role of the node on the other end.
    pub fn peer(self) -> NodeRole {
        match self {
            NodeRole::Prefill => NodeRole::Decoder,
            NodeRole::Decoder => NodeRole::Prefill,
        }
    }

    /// The flag that names the peer's certificate fingerprints on a node of this role.
    pub fn peer_fingerprint_flag(self) -> &'static str {
        match self {
            NodeRole::Prefill => "--decoder-fingerprint",
            NodeRole::Decoder => "--prefill-fingerprint",
        }
    }
}

/// One node's pairing set-up: its config dir (certificate and pinned peers), the peer
/// fingerprints given on its command line, and whether pinning is skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pairing {
    pub role: NodeRole,
    pub dir: PathBuf,
    pub explicit: Vec<CertFingerprint>,
    pub insecure_dev: bool,
}

impl Pairing {
    /// Parses the peer fingerprints (`sha256:<hex>`, as given to the role's
    /// [`NodeRole::peer_fingerprint_flag`]); the config dir defaults to [`default_config_dir`].
    pub fn new(role: NodeRole, config_dir: Option<PathBuf>, fingerprints: &[String], insecure_dev: bool) -> Result<Pairing, PairingError> {
        let explicit = fingerprints
            .iter()
            .map(|fp| CertFingerprint::parse(fp).ok_or_else(|| PairingError::BadFingerprint { flag: role.peer_fingerprint_flag(), value: fp.clone() }))
            .collect::<Result<_, _>>()?;
        Ok(Pairing { role, dir: config_dir.unwrap_or_else(|| default_config_dir(role)), explicit, insecure_dev })
    }

    /// This node's certificate, created in the config dir on first use.
    pub fn identity(&self) -> Result<NodeIdentity, TransferError> {
        NodeIdentity::load_or_create(&self.dir)
    }

    /// Whom this node trusts for this run: nobody checked with `--insecure-dev`, else the
    /// explicit fingerprints when given, else the saved pins.
    pub fn peer_auth(&self) -> Result<PeerAuth, PairingError> {
        if self.insecure_dev {
            return Ok(PeerAuth::InsecureDev);
        }
        if !self.explicit.is_empty() {
            return Ok(PeerAuth::Pinned(self.explicit.clone()));
        }
        let pinned = PinnedPeers::load(&self.dir)?;
        if pinned.peers.is_empty() {
            return Err(PairingError::NotPaired(self.role));
        }
        Ok(PeerAuth::Pinned(pinned.fingerprints()))
    }

    /// After a peer proved `cert` in a handshake: when it is one of the explicit values, the
    /// saved pins of the peer's role become the explicit values proved so far. Returns whether
    /// the file was written.
    pub fn save_verified(&self, cert: CertFingerprint) -> Result<bool, TransferError> {
        if self.insecure_dev || !self.explicit.contains(&cert) {
            return Ok(false);
        }
        let name = self.role.peer().dir_name();
        let mut pinned = PinnedPeers::load(&self.dir)?;
        let ours = |p: &PinnedPeers| p.peers.iter().filter(|(_, n)| n == name).map(|(g, _)| *g).collect::<Vec<_>>();
        let saved = ours(&pinned);
        if saved.contains(&cert) && saved.iter().all(|g| self.explicit.contains(g)) {
            return Ok(false);
        }
        pinned.peers.retain(|(g, n)| n != name || self.explicit.contains(g));
        pinned.add_and_save(&self.dir, cert, name)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(b: u8) -> CertFingerprint {
        CertFingerprint([b; 32])
    }

    #[test]
    fn explicit_fingerprints_replace_the_saved_pins_and_are_saved_once_proved() {
        for role in [NodeRole::Prefill, NodeRole::Decoder] {
            let dir = tempfile::tempdir().unwrap();
            let peer = role.peer().dir_name();
            let (old, a, b, other) = (fp(0xaa), fp(0xbb), fp(0xcc), fp(0xdd));
            let mut saved = PinnedPeers::default();
            saved.add_and_save(dir.path(), old, peer).unwrap();
            saved.add_and_save(dir.path(), other, "someone-else").unwrap();
            let pairing = |pins: &[CertFingerprint]| {
                let pins: Vec<String> = pins.iter().map(|p| p.to_string()).collect();
                Pairing::new(role, Some(dir.path().to_path_buf()), &pins, false).unwrap()
            };
            // Saved pins alone.
            assert_eq!(pairing(&[]).peer_auth().unwrap(), PeerAuth::Pinned(vec![old, other]));
            // Explicit values replace them for the run, and nothing is written before a proof.
            let p = pairing(&[a, b]);
            assert_eq!(p.peer_auth().unwrap(), PeerAuth::Pinned(vec![a, b]));
            assert!(!p.save_verified(old).unwrap(), "{role:?}: a non-explicit peer changed the pins");
            assert_eq!(PinnedPeers::load(dir.path()).unwrap().fingerprints(), vec![old, other]);
            // Proved values replace the role's earlier pins; other names are kept.
            assert!(p.save_verified(a).unwrap());
            assert!(p.save_verified(b).unwrap());
            assert!(!p.save_verified(b).unwrap(), "{role:?}: an unchanged file was rewritten");
            let want = vec![(other, "someone-else".to_string()), (a, peer.to_string()), (b, peer.to_string())];
            assert_eq!(PinnedPeers::load(dir.path()).unwrap().peers, want);
        }
    }

    #[test]
    fn unpaired_malformed_and_insecure() {
        let dir = tempfile::tempdir().unwrap();
        let d = || Some(dir.path().to_path_buf());
        let e = Pairing::new(NodeRole::Prefill, d(), &[], false).unwrap().peer_auth().unwrap_err().to_string();
        assert!(e.starts_with("no decoder is paired") && e.contains("--decoder-fingerprint"), "{e}");
        let e = Pairing::new(NodeRole::Decoder, d(), &[], false).unwrap().peer_auth().unwrap_err().to_string();
        assert!(e.starts_with("no prefill node is paired") && e.contains("--prefill-fingerprint"), "{e}");
        let e = Pairing::new(NodeRole::Decoder, d(), &["sha256:00".into()], false).unwrap_err().to_string();
        assert_eq!(e, "--prefill-fingerprint sha256:00: expected sha256:<64 hex digits>");
        let p = Pairing::new(NodeRole::Prefill, d(), &[fp(1).to_string()], true).unwrap();
        assert_eq!(p.peer_auth().unwrap(), PeerAuth::InsecureDev);
        assert!(!p.save_verified(fp(1)).unwrap());
        assert!(!dir.path().join("pinned-peers.txt").exists());
    }
}
