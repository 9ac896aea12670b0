//! Typed errors of the QUIC hand-off. Every variant names the peer and the cause; a decoder
//! can match on them to decide on a local fallback.

use std::net::SocketAddr;

use crate::fingerprint::Fingerprint;
use crate::transport::cert_fingerprint::CertFingerprint;
use crate::wire::{ErrorCode, WireError};

#[derive(Debug, Clone, thiserror::Error)]
pub enum TransferError {
    #[error("cannot reach {peer}: {reason}")]
    Connect { peer: SocketAddr, reason: String },
    #[error("{peer} presented certificate {got}, which is not pinned (pinned: {pinned}); pair the nodes again if it was regenerated")]
    PeerCertificateNotPinned { peer: SocketAddr, got: CertFingerprint, pinned: String },
    #[error("{peer} refused our certificate {ours}: this node is not paired with it (give it our fingerprint)")]
    CertificateRefusedByPeer { peer: SocketAddr, ours: CertFingerprint },
    #[error("model fingerprint mismatch with {peer}: this node has {ours}, the peer has {theirs}")]
    FingerprintMismatch { peer: SocketAddr, ours: Fingerprint, theirs: Fingerprint },
    #[error(
        "{peer} runs another model ({theirs}) than this node ({ours}); its states are compatible with this model \
         (same state identity {state_identity}, e.g. the full model this one was pruned from), but using them is not \
         enabled: pass --accept-compatible-states to accept them"
    )]
    CompatibleModelNotAccepted { peer: SocketAddr, ours: Fingerprint, theirs: Fingerprint, state_identity: Fingerprint },
    #[error("protocol version mismatch with {peer}: this node speaks {ours}, the peer {theirs}")]
    VersionMismatch { peer: SocketAddr, ours: u32, theirs: u32 },
    #[error("{peer} refused: {code:?}: {message}")]
    Refused { peer: SocketAddr, code: ErrorCode, message: String },
    #[error("{peer} aborted the transfer: {code:?}: {message}")]
    Aborted { peer: SocketAddr, code: ErrorCode, message: String },
    #[error("connection to {peer} lost: {reason}")]
    ConnectionLost { peer: SocketAddr, reason: String },
    #[error("bad data from {peer}: {source}")]
    Corrupt { peer: SocketAddr, source: WireError },
    #[error("{peer} broke the protocol: {reason}")]
    Protocol { peer: SocketAddr, reason: String },
    #[error("{peer} stalled: {what} made no progress for {secs:.1} s")]
    Stalled { peer: SocketAddr, what: String, secs: f64 },
    #[error("transfer cancelled: {0}")]
    Cancelled(String),
    #[error("--insecure-dev works on loopback only, and {0} is not a loopback address")]
    InsecureNotLoopback(SocketAddr),
    #[error("send_layer: layer {layer}: {source}")]
    LayerState { layer: usize, source: WireError },
    #[error("send_layer: layer {layer} is past the layout's {layers} layers")]
    LayerPastLayout { layer: usize, layers: usize },
    #[error("send_layer: layer {layer} was already sent")]
    LayerResent { layer: usize },
    #[error("finish: layer {layer} was never sent")]
    LayerNeverSent { layer: usize },
    #[error("node identity: {0}")]
    Identity(String),
    #[error("{0}")]
    Local(String),
}

impl TransferError {
    /// A handshake refusal ([`crate::wire::handshake`]) as the error that names the peer.
    pub fn from_refusal(peer: SocketAddr, r: crate::wire::handshake::Refusal) -> TransferError {
        use crate::wire::handshake::Refusal;
        match r {
            Refusal::VersionMismatch { ours, theirs } => TransferError::VersionMismatch { peer, ours, theirs },
            Refusal::FingerprintMismatch { ours, theirs } => TransferError::FingerprintMismatch { peer, ours, theirs },
            Refusal::CompatibleModelNotAccepted { ours, theirs, state_identity } => {
                TransferError::CompatibleModelNotAccepted { peer, ours, theirs, state_identity }
            }
            Refusal::Capability { message } => TransferError::Refused { peer, code: ErrorCode::CapabilityMismatch, message },
        }
    }

    /// The code to send to the peer when this error ends a transfer.
    pub fn code(&self) -> ErrorCode {
        match self {
            TransferError::FingerprintMismatch { .. } | TransferError::CompatibleModelNotAccepted { .. } => ErrorCode::FingerprintMismatch,
            TransferError::VersionMismatch { .. } => ErrorCode::VersionMismatch,
            TransferError::Corrupt { .. } | TransferError::Protocol { .. } => ErrorCode::Malformed,
            TransferError::Stalled { .. } => ErrorCode::Timeout,
            TransferError::Cancelled(_) => ErrorCode::Cancelled,
            TransferError::Refused { code, .. } | TransferError::Aborted { code, .. } => *code,
            _ => ErrorCode::Internal,
        }
    }
}

/// Turns a quinn connection error into ours.
pub(crate) fn connection_lost(peer: SocketAddr, e: &quinn::ConnectionError) -> TransferError {
    use quinn::ConnectionError as C;
    let reason = match e {
        C::TimedOut => "idle timeout: no packets from the peer".to_string(),
        C::ApplicationClosed(a) => {
            format!("closed by the peer (code {}): {}", a.error_code, String::from_utf8_lossy(&a.reason))
        }
        C::ConnectionClosed(c) => format!("closed by the peer's QUIC stack: {c}"),
        C::Reset => "reset by the peer (it no longer knows this connection)".to_string(),
        C::LocallyClosed => "closed locally".to_string(),
        other => other.to_string(),
    };
    TransferError::ConnectionLost { peer, reason }
}

/// True when the peer closed the connection with a TLS alert (it refused our certificate).
pub(crate) fn is_tls_refusal(e: &quinn::ConnectionError) -> bool {
    match e {
        quinn::ConnectionError::ConnectionClosed(c) => {
            let code = u64::from(c.error_code);
            (0x100..0x200).contains(&code)
        }
        _ => false,
    }
}
