//! The prefill node's side: [`PrefillServer`] accepts paired decoders, [`PrefillConnection`]
//! yields their requests, [`LayerSender`] streams each layer's state as soon as it exists.
//!
//! ```no_run
//! # async fn serve(cfg: k3_protocol::transport::NodeConfig, layout_for: fn(usize) -> k3_protocol::wire::StateLayout) -> Result<(), k3_protocol::transport::TransferError> {
//! use k3_protocol::transport::PrefillServer;
//! let server = PrefillServer::bind("127.0.0.1:7433".parse().unwrap(), cfg)?;
//! while let Some(conn) = server.accept().await {
//!     let Ok(mut conn) = conn else { continue }; // handshake failures are logged
//!     tokio::spawn(async move {
//!         while let Ok(Some(req)) = conn.next_request().await {
//!             let layout = layout_for(req.request.tokens.len());
//!             let mut tx = req.accept(0, layout).await?;
//!             // for each layer as the executor finishes it: tx.send_layer(l, state).await?;
//!             tx.finish(Default::default(), None).await?;
//!         }
//!         Ok::<_, k3_protocol::transport::TransferError>(())
//!     });
//! }
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, Mutex};
use tokio::task::JoinHandle;

use crate::transport::admission::{Admission, AdmissionCounts, PeerSlot};
use crate::transport::config::NodeConfig;
use crate::transport::error::{connection_lost, TransferError};
use crate::transport::framed::{finish_and_flush, write_message, FramedRecv, HANDSHAKE_MAX_FRAME};
use crate::transport::sender::LayerSender;
use crate::transport::tls::{server_config, RefusalSlot};
use crate::transport::PeerInfo;
use crate::wire::chunker::clamp_chunk_bytes;
use crate::wire::frame::CHUNK_HEADER_LEN;
use crate::wire::handshake::{answer_hello, validate_request};
use crate::wire::{Accepted, ErrorCode, ErrorMsg, Message, PrefillRequest, StateLayout, PROTOCOL_VERSION};

/// A listening prefill node.
pub struct PrefillServer {
    endpoint: quinn::Endpoint,
    incoming: Mutex<mpsc::Receiver<Result<PrefillConnection, TransferError>>>,
    accept_task: JoinHandle<()>,
    admission: Admission,
}

impl Drop for PrefillServer {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl PrefillServer {
    /// Binds a QUIC endpoint on `addr` (needs a tokio runtime). With `PeerAuth::InsecureDev`
    /// only loopback addresses are allowed, for binding and for peers.
    pub fn bind(addr: SocketAddr, cfg: NodeConfig) -> Result<PrefillServer, TransferError> {
        let insecure = cfg.peers.is_insecure();
        if insecure {
            if !addr.ip().is_loopback() {
                return Err(TransferError::InsecureNotLoopback(addr));
            }
            tracing::warn!(
                %addr,
                "INSECURE DEV MODE: certificate pinning is OFF; any loopback client may connect. Never use this across machines."
            );
        }
        let (tls, refused) = server_config(&cfg.identity, &cfg.peers)?;
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| TransferError::Identity(format!("QUIC TLS config: {e}")))?;
        let mut sc = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        sc.transport_config(Arc::new(cfg.tuning.quinn_transport()));
        // Incoming connections quinn buffers before the accept loop sees them.
        sc.max_incoming(cfg.tuning.max_handshakes.max(1) * 4);
        let endpoint = cfg.tuning.endpoint(addr, Some(sc)).map_err(|e| TransferError::Local(format!("cannot listen on {addr}: {e}")))?;
        tracing::info!(
            addr = %endpoint.local_addr().map(|a| a.to_string()).unwrap_or_default(),
            certificate = %cfg.identity.fingerprint(),
            model = %cfg.model_fingerprint.short(),
            "prefill node listening"
        );
        let (tx, rx) = mpsc::channel(16);
        let cfg = Arc::new(cfg);
        let ep = endpoint.clone();
        let admission = Admission::new(&cfg.tuning);
        let adm = admission.clone();
        let accept_task = tokio::spawn(async move {
            while let Some(incoming) = ep.accept().await {
                let remote = incoming.remote_address();
                if insecure && !remote.ip().is_loopback() {
                    tracing::warn!(%remote, "insecure dev mode: refusing a non-loopback peer");
                    incoming.refuse();
                    continue;
                }
                let Some(slot) = adm.admit(incoming) else { continue };
                let (incoming, slot) = slot;
                let (cfg, refused, tx) = (cfg.clone(), refused.clone(), tx.clone());
                tokio::spawn(async move {
                    let r = handshake(incoming, cfg, refused).await.map(|mut c| {
                        c.slot = Some(slot.established());
                        c
                    });
                    if let Err(e) = &r {
                        tracing::warn!(%remote, "handshake failed: {e}");
                    }
                    let _ = tx.send(r).await;
                });
            }
        });
        Ok(PrefillServer { endpoint, incoming: Mutex::new(rx), accept_task, admission })
    }

    /// What the accept loop did with incoming connections so far.
    pub fn admission_counts(&self) -> AdmissionCounts {
        self.admission.counts()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint.local_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// The next decoder that completed the handshake, or the error of one that did not (the
    /// server keeps running: log it and call again). None once the endpoint is closed.
    pub async fn accept(&self) -> Option<Result<PrefillConnection, TransferError>> {
        self.incoming.lock().await.recv().await
    }

    /// Stops accepting and closes every connection.
    pub fn close(&self) {
        self.endpoint.close(quinn::VarInt::from_u32(0), b"prefill node shutting down");
    }
}

async fn handshake(incoming: quinn::Incoming, cfg: Arc<NodeConfig>, refused: RefusalSlot) -> Result<PrefillConnection, TransferError> {
    let peer = incoming.remote_address();
    let conn = match tokio::time::timeout(cfg.tuning.handshake_timeout, incoming).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            if let Some((got, pinned)) = refused.lock().ok().and_then(|mut g| g.take()) {
                return Err(TransferError::PeerCertificateNotPinned { peer, got, pinned: fmt_list(&pinned) });
            }
            if crate::transport::error::is_tls_refusal(&e) {
                return Err(TransferError::CertificateRefusedByPeer { peer, ours: cfg.identity.fingerprint() });
            }
            return Err(TransferError::Connect { peer, reason: e.to_string() });
        }
        Err(_) => return Err(TransferError::Connect { peer, reason: "TLS handshake timed out".into() }),
    };
    let certificate = crate::transport::peer_certificate(&conn);
    let t = cfg.tuning.idle_timeout.min(cfg.tuning.handshake_timeout);
    let (mut send, recv) = match tokio::time::timeout(t, conn.accept_bi()).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(connection_lost(peer, &e)),
        Err(_) => return Err(TransferError::Stalled { peer, what: "Hello".into(), secs: t.as_secs_f64() }),
    };
    let mut fr = FramedRecv::new(recv, HANDSHAKE_MAX_FRAME, peer);
    let hello = match tokio::time::timeout(t, fr.next_message()).await {
        Ok(Ok(Some(Message::Hello(h)))) => h,
        Ok(Ok(Some(other))) => {
            return Err(refuse_handshake(&conn, &mut send, peer, ErrorCode::Malformed, format!("expected Hello, got {}", other.name())).await)
        }
        Ok(Ok(None)) => return Err(TransferError::Protocol { peer, reason: "handshake stream ended before Hello".into() }),
        Ok(Err(e)) => {
            // A Hello of another protocol version has other fields and does not decode: say so.
            let msg = format!("{e} (expected a Hello of protocol version {PROTOCOL_VERSION}; a peer of another version must be upgraded)");
            let _ = refuse_handshake(&conn, &mut send, peer, ErrorCode::Malformed, msg).await;
            return Err(e);
        }
        Err(_) => return Err(TransferError::Stalled { peer, what: "Hello".into(), secs: t.as_secs_f64() }),
    };
    // Every Hello gets our HelloAck, so the client can name both sides in its own error.
    let (ack, refusal) = answer_hello(&cfg.announce(), &hello);
    write_message(&mut send, peer, &Message::HelloAck(ack.clone())).await?;
    let err = refusal.map(|r| TransferError::from_refusal(peer, r));
    if let Some(e) = err {
        let _ = refuse_handshake(&conn, &mut send, peer, e.code(), e.to_string()).await;
        return Err(e);
    }
    let cost = cfg.cost.read().map(|c| c.clone()).unwrap_or_default();
    write_message(&mut send, peer, &Message::Cost(cost)).await?;
    finish_and_flush(&mut send, t).await;
    let info = PeerInfo {
        addr: peer,
        certificate,
        node_name: hello.node_name,
        capabilities: hello.capabilities,
        model_fingerprint: hello.model_fingerprint,
        state_identity: hello.state_identity,
    };
    if info.model_fingerprint != cfg.model_fingerprint {
        // Its model differs but its states are interchangeable with ours: the decoder decides
        // (`--accept-compatible-states`); serving it is safe for this node.
        tracing::info!(
            %peer,
            ours = %cfg.model_fingerprint.short(),
            theirs = %info.model_fingerprint.short(),
            state_identity = %cfg.state_identity.map(|f| f.short()).unwrap_or_default(),
            "decoder runs another model with this model's state identity (e.g. pruned from it)"
        );
    }
    tracing::info!(%peer, name = %info.node_name, certificate = ?info.certificate, "decoder connected");
    Ok(PrefillConnection { conn, cfg, peer: info, max_frame: ack.max_frame_size, next_id: 1, slot: None })
}

/// Sends an Error, waits until it is delivered, closes the connection; returns the error.
async fn refuse_handshake(conn: &quinn::Connection, send: &mut quinn::SendStream, peer: SocketAddr, code: ErrorCode, message: String) -> TransferError {
    let _ = write_message(send, peer, &Message::Error(ErrorMsg { code, message: message.clone() })).await;
    finish_and_flush(send, Duration::from_secs(2)).await;
    conn.close(quinn::VarInt::from_u32(2), message.as_bytes());
    TransferError::Refused { peer, code, message }
}

fn fmt_list<T: std::fmt::Display>(v: &[T]) -> String {
    v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")
}

/// One connected, handshaken decoder.
pub struct PrefillConnection {
    conn: quinn::Connection,
    cfg: Arc<NodeConfig>,
    peer: PeerInfo,
    max_frame: u32,
    next_id: u64,
    /// This connection's admission slot (per-IP and total counts), freed with it.
    slot: Option<PeerSlot>,
}

impl PrefillConnection {
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }

    /// QUIC statistics (bytes and datagrams on the wire).
    pub fn stats(&self) -> quinn::ConnectionStats {
        self.conn.stats()
    }

    pub fn close(&self, reason: &str) {
        self.conn.close(quinn::VarInt::from_u32(0), reason.as_bytes());
    }

    /// The next request; Ok(None) once the connection is over (closed by the decoder, timed
    /// out, lost: the reason is logged). A malformed or invalid request is answered with an
    /// Error and returned as Err; the connection stays up and calling again waits for the next
    /// request, so a serving loop is:
    /// `loop { match conn.next_request().await { Ok(Some(r)) => .., Ok(None) => break, Err(e) => warn!(..) } }`.
    pub async fn next_request(&mut self) -> Result<Option<IncomingRequest>, TransferError> {
        let peer = self.peer.addr;
        let t = self.cfg.tuning.idle_timeout;
        // A `CostQuery` stream is answered here and the wait goes on for a request.
        let (mut send, fr, request) = loop {
            let (mut send, recv) = match self.conn.accept_bi().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::info!(%peer, "decoder connection over: {}", connection_lost(peer, &e));
                    return Ok(None);
                }
            };
            let mut fr = FramedRecv::new(recv, self.cfg.tuning.max_control_frame, peer);
            let first = tokio::time::timeout(t, fr.next_message()).await;
            if let Ok(Ok(Some(Message::CostQuery))) = first {
                let cost = self.cfg.cost.read().map(|c| c.clone()).unwrap_or_default();
                if write_message(&mut send, peer, &Message::Cost(cost)).await.is_ok() {
                    let _ = send.finish();
                }
                continue;
            }
            break (send, fr, first);
        };
        let request = match request {
            Ok(Ok(Some(Message::PrefillRequest(r)))) => r,
            Ok(Ok(Some(other))) => {
                let reason = format!("expected PrefillRequest, got {}", other.name());
                reply_error(&mut send, peer, ErrorCode::Malformed, &reason).await;
                return Err(TransferError::Protocol { peer, reason });
            }
            Ok(Ok(None)) => return Err(TransferError::Protocol { peer, reason: "request stream ended before a request".into() }),
            Ok(Err(e)) => {
                reply_error(&mut send, peer, e.code(), &e.to_string()).await;
                return Err(e);
            }
            Err(_) => return Err(TransferError::Stalled { peer, what: "request".into(), secs: t.as_secs_f64() }),
        };
        if let Err(e) = validate_request(&request) {
            let reason = e.to_string();
            reply_error(&mut send, peer, ErrorCode::InvalidRequest, &reason).await;
            return Err(TransferError::Protocol { peer, reason });
        }
        let id = self.next_id;
        self.next_id += 1;
        tracing::info!(%peer, request = id, session = %request.session, tokens = request.tokens.len(), base = ?request.base.as_ref().map(|b| b.tokens), "prefill request");
        Ok(Some(IncomingRequest { request, id, conn: self.conn.clone(), cfg: self.cfg.clone(), peer, max_frame: self.max_frame, send, recv: fr }))
    }
}

async fn reply_error(send: &mut quinn::SendStream, peer: SocketAddr, code: ErrorCode, message: &str) {
    let _ = write_message(send, peer, &Message::Error(ErrorMsg { code, message: message.to_string() })).await;
    finish_and_flush(send, Duration::from_secs(2)).await;
}

/// A request not yet accepted or refused.
pub struct IncomingRequest {
    pub request: PrefillRequest,
    id: u64,
    conn: quinn::Connection,
    cfg: Arc<NodeConfig>,
    peer: SocketAddr,
    max_frame: u32,
    send: quinn::SendStream,
    recv: FramedRecv,
}

impl IncomingRequest {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Refuses the request (e.g. `BaseNotHeld`, `Busy`, `TooLarge`).
    pub async fn refuse(mut self, code: ErrorCode, message: &str) -> Result<(), TransferError> {
        tracing::info!(peer = %self.peer, request = self.id, ?code, "refusing: {message}");
        write_message(&mut self.send, self.peer, &Message::Error(ErrorMsg { code, message: message.to_string() })).await?;
        finish_and_flush(&mut self.send, Duration::from_secs(5)).await;
        Ok(())
    }

    /// Accepts the request: announces the state layout (the delta after `base_tokens`) and
    /// opens the data streams. Then call [`LayerSender::send_layer`] for every layer.
    pub async fn accept(mut self, base_tokens: u64, layout: StateLayout) -> Result<LayerSender, TransferError> {
        let peer = self.peer;
        let tuning = &self.cfg.tuning;
        if let Err(e) = layout.validate(tuning.max_state_bytes) {
            let msg = e.to_string();
            let _ = self.refuse(ErrorCode::TooLarge, &msg).await;
            return Err(TransferError::Local(msg));
        }
        let opts = &self.request.options;
        let streams = opts.streams.clamp(1, tuning.max_streams.max(1));
        let max_payload = self.max_frame.saturating_sub((1 + CHUNK_HEADER_LEN) as u32);
        let chunk_bytes = clamp_chunk_bytes(opts.chunk_bytes, max_payload);
        let accepted = Accepted { request: self.id, base_tokens, layout: layout.clone(), streams, chunk_bytes };
        write_message(&mut self.send, peer, &Message::Accepted(accepted)).await?;

        LayerSender::open(self.conn, self.send, self.recv, &self.cfg, self.id, peer, self.max_frame, layout, streams, chunk_bytes).await
    }
}
