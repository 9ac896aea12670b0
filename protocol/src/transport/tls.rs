//! TLS 1.3 configs with mutual certificate pinning. Each side presents its self-signed node
//! certificate and accepts the peer's only if its SHA-256 fingerprint is pinned (or, in
//! `--insecure-dev` mode on loopback, any certificate). The handshake signature is still
//! verified against the presented certificate, so a peer must hold the pinned key.

use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::transport::cert_fingerprint::CertFingerprint;
use crate::transport::error::TransferError;
use crate::transport::identity::NodeIdentity;
use crate::wire::ALPN;

/// How a node decides whether to trust its peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerAuth {
    /// Trust exactly these certificate fingerprints.
    Pinned(Vec<CertFingerprint>),
    /// `--insecure-dev`: trust any certificate, loopback addresses only, logged loudly.
    InsecureDev,
}

impl PeerAuth {
    pub fn pinned(fp: CertFingerprint) -> PeerAuth {
        PeerAuth::Pinned(vec![fp])
    }
    pub fn is_insecure(&self) -> bool {
        matches!(self, PeerAuth::InsecureDev)
    }
}

/// The last certificate a verifier refused: (what it saw, what was pinned).
pub(crate) type RefusalSlot = Arc<Mutex<Option<(CertFingerprint, Vec<CertFingerprint>)>>>;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

#[derive(Debug)]
struct Pinning {
    auth: PeerAuth,
    provider: Arc<CryptoProvider>,
    refused: RefusalSlot,
}

impl Pinning {
    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        let fp = CertFingerprint::of_der(end_entity);
        match &self.auth {
            PeerAuth::InsecureDev => Ok(()),
            PeerAuth::Pinned(list) if list.contains(&fp) => Ok(()),
            PeerAuth::Pinned(list) => {
                if let Ok(mut g) = self.refused.lock() {
                    *g = Some((fp, list.clone()));
                }
                tracing::warn!(peer_certificate = %fp, "refusing a peer certificate that is not pinned");
                Err(rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure))
            }
        }
    }

    fn tls13(&self, message: &[u8], cert: &CertificateDer<'_>, dss: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// The signature checks both pin verifiers share (the rustls client and server verifier traits
/// declare the same three methods): TLS 1.3 only, the pinned key's schemes.
macro_rules! pinned_signature_checks {
    () => {
        fn verify_tls12_signature(&self, _: &[u8], _: &CertificateDer<'_>, _: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::General("TLS 1.2 is not accepted".into()))
        }

        fn verify_tls13_signature(&self, m: &[u8], c: &CertificateDer<'_>, d: &DigitallySignedStruct) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.0.tls13(m, c, d)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.schemes()
        }
    };
}

#[derive(Debug)]
struct ServerPinVerifier(Pinning);

impl ServerCertVerifier for ServerPinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.check(end_entity).map(|_| ServerCertVerified::assertion())
    }

    pinned_signature_checks!();
}

#[derive(Debug)]
struct ClientPinVerifier(Pinning);

impl ClientCertVerifier for ClientPinVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(&self, end_entity: &CertificateDer<'_>, _: &[CertificateDer<'_>], _: UnixTime) -> Result<ClientCertVerified, rustls::Error> {
        self.0.check(end_entity).map(|_| ClientCertVerified::assertion())
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    pinned_signature_checks!();
}

fn tls_err(e: impl std::fmt::Display) -> TransferError {
    TransferError::Identity(format!("TLS configuration: {e}"))
}

/// The rustls client config of a decoder: TLS 1.3 only, our certificate, pinned server.
pub(crate) fn client_config(identity: &NodeIdentity, auth: &PeerAuth) -> Result<(rustls::ClientConfig, RefusalSlot), TransferError> {
    let refused = RefusalSlot::default();
    let provider = provider();
    let verifier = Arc::new(ServerPinVerifier(Pinning { auth: auth.clone(), provider: provider.clone(), refused: refused.clone() }));
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(vec![identity.cert_der().clone()], identity.private_key())
        .map_err(tls_err)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok((cfg, refused))
}

/// The rustls server config of a prefill node: TLS 1.3 only, client certificates mandatory
/// and pinned.
pub(crate) fn server_config(identity: &NodeIdentity, auth: &PeerAuth) -> Result<(rustls::ServerConfig, RefusalSlot), TransferError> {
    let refused = RefusalSlot::default();
    let provider = provider();
    let verifier = Arc::new(ClientPinVerifier(Pinning { auth: auth.clone(), provider: provider.clone(), refused: refused.clone() }));
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![identity.cert_der().clone()], identity.private_key())
        .map_err(tls_err)?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok((cfg, refused))
}
