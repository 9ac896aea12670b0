//! The hand-off protocol over QUIC (quinn + rustls, TLS 1.3, mutual certificate pinning).
//! A thin layer: framing, checksums and state assembly live in [`crate::wire`].
//!
//! - [`PrefillServer`] / [`PrefillConnection`] / [`IncomingRequest`] (`server`: bind, accept,
//!   handshake, request intake), `admission` (who may connect), [`LayerSender`] (`sender`: the
//!   data streams of an accepted request): the prefill node's side. The decisions of the
//!   handshake and of request validation are pure functions in [`crate::wire::handshake`].
//! - [`PrefillClient`] / [`Transfer`]: the decoder's side.
//! - [`NodeIdentity`], [`PinnedPeers`], [`PeerAuth`], [`Pairing`]: certificates and pairing.
//!
//! Streams of one connection: the client opens a bidirectional *handshake* stream
//! (Hello/HelloAck), then one bidirectional *request* stream per prefill (PrefillRequest →
//! Accepted, Progress, Heartbeat, Done | Error/Abort; the client may send Abort), and the
//! server opens `Accepted::streams` unidirectional *data* streams per request (DataStream
//! header, then chunk frames). See docs/handoff-protocol.md.

mod admission;
pub mod cert_fingerprint;
pub mod client;
pub mod config;
pub mod error;
mod framed;
#[cfg(feature = "fault-injection")]
pub mod hooks;
pub mod identity;
pub mod pairing;
pub mod sender;
pub mod server;
pub mod tls;

use std::net::SocketAddr;

pub use admission::AdmissionCounts;
pub use cert_fingerprint::CertFingerprint;
pub use client::{PrefillClient, Transfer, TransferEvent, TransferSummary};
pub use config::{NodeConfig, Tuning};
pub use error::TransferError;
pub use identity::{default_config_dir, NodeIdentity, NodeRole, PinnedPeers};
pub use pairing::{Pairing, PairingError};
pub use sender::LayerSender;
pub use server::{IncomingRequest, PrefillConnection, PrefillServer};
pub use tls::PeerAuth;

use crate::fingerprint::Fingerprint;
use crate::wire::Capabilities;

/// Who is on the other end.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub addr: SocketAddr,
    /// Fingerprint of the certificate the peer presented.
    pub certificate: Option<CertFingerprint>,
    pub node_name: String,
    pub capabilities: Capabilities,
    pub model_fingerprint: Fingerprint,
    /// The peer's state-compatibility identity, if it gave one.
    pub state_identity: Option<Fingerprint>,
}

pub(crate) fn peer_certificate(conn: &quinn::Connection) -> Option<CertFingerprint> {
    let any = conn.peer_identity()?;
    let certs = any.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok()?;
    certs.first().map(|c| CertFingerprint::of_der(c))
}
