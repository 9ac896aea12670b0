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
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch, Mutex};
use tokio::task::{JoinHandle, JoinSet};

use crate::handoff::LayerState;
use crate::transport::config::NodeConfig;
use crate::transport::error::{connection_lost, TransferError};
use crate::transport::framed::{finish_and_flush, write_error, write_message, FramedRecv};
use crate::transport::hooks::FaultHooks;
use crate::transport::tls::{server_config, RefusalSlot};
use crate::transport::PeerInfo;
use crate::wire::chunker::{chunk_payload, clamp_chunk_bytes, plan_layer, ChunkSpec};
use crate::wire::frame::{ChunkHeader, CHUNK_HEADER_LEN, FRAME_HEADER_LEN};
use crate::wire::{
    Accepted, Done, ErrorCode, ErrorMsg, HelloAck, Message, PrefillRequest, Progress, StateDtype, StateLayout, Timing, WireError,
    PROTOCOL_VERSION,
};

/// Stream error code for a cancelled transfer.
pub(crate) const CANCEL_CODE: u32 = 1;
/// Largest frame on the handshake stream.
pub(crate) const HANDSHAKE_MAX_FRAME: u32 = 1 << 20;

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
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
            .map_err(|e| TransferError::Identity(format!("QUIC TLS config: {e}")))?;
        let mut sc = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        sc.transport_config(Arc::new(cfg.tuning.quinn_transport()));
        // Incoming connections quinn buffers before the accept loop sees them.
        sc.max_incoming(cfg.tuning.max_handshakes.max(1) * 4);
        let endpoint = cfg.tuning.endpoint(addr, Some(sc))
            .map_err(|e| TransferError::Local(format!("cannot listen on {addr}: {e}")))?;
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
        *self.admission.counts.lock().unwrap_or_else(|e| e.into_inner())
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

/// Who may start a handshake: a bounded number at once, Retry (address validation) for
/// unvalidated peers under load, a bounded number per IP, and a bound on established connections.
/// Counts of what the accept loop refused are kept for metrics and tests.
#[derive(Clone)]
struct Admission {
    handshakes: Arc<tokio::sync::Semaphore>,
    max_handshakes: usize,
    retry_above: usize,
    per_ip: Arc<StdMutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
    max_per_ip: usize,
    established: Arc<std::sync::atomic::AtomicUsize>,
    max_established: usize,
    counts: Arc<StdMutex<AdmissionCounts>>,
}

/// What the accept loop did with incoming connections (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionCounts {
    /// Answered with a QUIC Retry (address validation under load).
    pub retried: u64,
    /// Refused: too many handshakes, connections, or connections from one address.
    pub refused: u64,
    /// Given a handshake slot.
    pub admitted: u64,
    /// Most handshakes in progress at once so far.
    pub peak_handshakes: usize,
}

/// A handshake slot (and, once established, a connection slot) of one peer; freed on drop.
pub(crate) struct PeerSlot {
    ip: std::net::IpAddr,
    admission: Admission,
    _handshake: Option<tokio::sync::OwnedSemaphorePermit>,
    established: bool,
}

impl PeerSlot {
    fn established(mut self) -> PeerSlot {
        self._handshake = None;
        self.established = true;
        self.admission.established.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        if self.established {
            self.admission.established.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        let mut m = self.admission.per_ip.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

impl Admission {
    fn new(t: &crate::transport::Tuning) -> Admission {
        let max_handshakes = t.max_handshakes.max(1);
        Admission {
            handshakes: Arc::new(tokio::sync::Semaphore::new(max_handshakes)),
            max_handshakes,
            retry_above: t.retry_above,
            per_ip: Default::default(),
            max_per_ip: t.max_connections_per_ip.max(1),
            established: Default::default(),
            max_established: t.max_connections.max(1),
            counts: Default::default(),
        }
    }

    /// Decides for one incoming connection: `None` when it was answered with Retry or refused.
    fn admit(&self, incoming: quinn::Incoming) -> Option<(quinn::Incoming, PeerSlot)> {
        let remote = incoming.remote_address();
        let in_progress = self.max_handshakes - self.handshakes.available_permits();
        let count = |f: &dyn Fn(&mut AdmissionCounts)| f(&mut self.counts.lock().unwrap_or_else(|e| e.into_inner()));
        if !incoming.remote_address_validated() && in_progress >= self.retry_above && incoming.may_retry() {
            // Stateless: only a peer that really owns its address comes back, with a token.
            if let Err(e) = incoming.retry() {
                e.into_incoming().refuse();
            }
            count(&|c| c.retried += 1);
            return None;
        }
        let refuse = |incoming: quinn::Incoming| {
            incoming.refuse();
            count(&|c| c.refused += 1);
        };
        if self.established.load(std::sync::atomic::Ordering::Relaxed) >= self.max_established {
            tracing::warn!(%remote, "refusing a connection: {} connections are open, the most allowed", self.max_established);
            refuse(incoming);
            return None;
        }
        let Ok(permit) = self.handshakes.clone().try_acquire_owned() else {
            tracing::warn!(%remote, "refusing a connection: {} handshakes in progress, the most allowed", self.max_handshakes);
            refuse(incoming);
            return None;
        };
        {
            let mut m = self.per_ip.lock().unwrap_or_else(|e| e.into_inner());
            let n = m.entry(remote.ip()).or_insert(0);
            if *n >= self.max_per_ip {
                drop(m);
                tracing::warn!(%remote, "refusing a connection: {} connections from this address, the most allowed", self.max_per_ip);
                refuse(incoming);
                return None;
            }
            *n += 1;
        }
        let now = self.max_handshakes - self.handshakes.available_permits();
        count(&|c| {
            c.admitted += 1;
            c.peak_handshakes = c.peak_handshakes.max(now);
        });
        Some((incoming, PeerSlot { ip: remote.ip(), admission: self.clone(), _handshake: Some(permit), established: false }))
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
    let caps = &cfg.capabilities;
    let ack = HelloAck {
        protocol_version: PROTOCOL_VERSION,
        model_fingerprint: cfg.model_fingerprint,
        state_identity: cfg.state_identity,
        capabilities: caps.clone(),
        node_name: cfg.node_name.clone(),
        max_frame_size: caps.max_frame_size.min(hello.capabilities.max_frame_size),
    };
    write_message(&mut send, peer, &Message::HelloAck(ack.clone())).await?;
    let err = if hello.protocol_version != PROTOCOL_VERSION {
        Some(TransferError::VersionMismatch { peer, ours: PROTOCOL_VERSION, theirs: hello.protocol_version })
    } else if hello.model_fingerprint != cfg.model_fingerprint && !cfg.state_compatible(hello.state_identity) {
        Some(TransferError::FingerprintMismatch { peer, ours: cfg.model_fingerprint, theirs: hello.model_fingerprint })
    } else if !hello.capabilities.dtypes.contains(&StateDtype::F32) {
        Some(TransferError::Refused { peer, code: ErrorCode::CapabilityMismatch, message: "the peer cannot take fp32 state".into() })
    } else if ack.max_frame_size < (FRAME_HEADER_LEN + CHUNK_HEADER_LEN + 4) as u32 {
        Some(TransferError::Refused { peer, code: ErrorCode::CapabilityMismatch, message: format!("max frame size {} is too small", ack.max_frame_size) })
    } else {
        None
    };
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
        Ok(Some(IncomingRequest {
            request,
            id,
            conn: self.conn.clone(),
            cfg: self.cfg.clone(),
            peer,
            max_frame: self.max_frame,
            send,
            recv: fr,
        }))
    }
}

fn validate_request(r: &PrefillRequest) -> Result<(), WireError> {
    if let Some(im) = &r.image_embeddings {
        let want = im.positions.len() as u64 * im.width as u64;
        if im.rows.len() as u64 != want {
            return Err(WireError::ImageEmbeddingSize {
                values: im.rows.len(),
                positions: im.positions.len(),
                width: im.width,
                want,
            });
        }
        if let Some(&position) = im.positions.iter().find(|p| **p as usize >= r.tokens.len()) {
            return Err(WireError::ImageEmbeddingPosition { position, tokens: r.tokens.len() });
        }
    }
    if r.options.streams == 0 {
        return Err(WireError::NoStreams);
    }
    Ok(())
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

        let shared = Arc::new(Shared::new());
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>(2 * streams as usize);
        let jobs_rx = Arc::new(Mutex::new(jobs_rx));
        let mut writers = JoinSet::new();
        for index in 0..streams {
            let mut s = self.conn.open_uni().await.map_err(|e| connection_lost(peer, &e))?;
            write_message(&mut s, peer, &Message::DataStream { request: self.id, index }).await?;
            writers.spawn(writer(s, jobs_rx.clone(), WriterCtx {
                request: self.id,
                peer,
                stall: tuning.stall_timeout,
                max_frame: self.max_frame,
                shared: shared.clone(),
            }));
        }
        let ctrl = Arc::new(Mutex::new(self.send));
        let watch_task = tokio::spawn(watch_client(self.recv, shared.clone(), peer, self.id));
        let (hb_stop, hb_rx) = watch::channel(false);
        let heartbeat = tokio::spawn(heartbeat(ctrl.clone(), hb_rx, tuning.heartbeat, self.id, peer));
        Ok(LayerSender {
            id: self.id,
            peer,
            sent: vec![false; layout.layers.len()],
            layout,
            chunk_bytes,
            streams,
            jobs: Some(jobs_tx),
            writers,
            ctrl,
            shared,
            hb_stop,
            heartbeat: Some(heartbeat),
            watch_task,
            hooks: self.cfg.hooks.clone(),
            conn: self.conn,
            stall: tuning.stall_timeout,
            seq: 0,
            chunks: 0,
            state_bytes: 0,
            send_wait: Duration::ZERO,
            delayed: None,
            started: Instant::now(),
            aborted: false,
        })
    }
}

/// Why a transfer must stop: the first failure of any task.
pub(crate) struct Shared {
    first: StdMutex<Option<TransferError>>,
    stop: watch::Sender<bool>,
    /// Payload bytes handed to quinn.
    written: std::sync::atomic::AtomicU64,
    /// The decoder confirmed the whole state (`Received`).
    ///
    /// `stop` and `received` are set with `send_replace`: these channels often have no receiver
    /// at the moment they are set (their first receiver is dropped at creation; `finish`
    /// subscribes only after writing `Done`), and `watch::Sender::send` then drops the value —
    /// a `Received` that arrived in that window used to be lost, and `finish` waited for the
    /// stall limit although the decoder had confirmed.
    received: watch::Sender<bool>,
}

impl Shared {
    fn new() -> Shared {
        Shared { first: StdMutex::new(None), stop: watch::channel(false).0, written: Default::default(), received: watch::channel(false).0 }
    }
    fn fail(&self, e: TransferError) {
        if let Ok(mut g) = self.first.lock() {
            if g.is_none() {
                *g = Some(e);
            }
        }
        let _ = self.stop.send_replace(true);
    }
    fn error(&self) -> Option<TransferError> {
        self.first.lock().ok().and_then(|g| g.clone())
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fault {
    None,
    Corrupt,
    Truncate,
    Oversize,
}

struct Job {
    state: Arc<LayerState>,
    spec: ChunkSpec,
    fault: Fault,
}

struct WriterCtx {
    request: u64,
    peer: SocketAddr,
    stall: Duration,
    max_frame: u32,
    shared: Arc<Shared>,
}

/// One data stream: takes chunk jobs from the shared queue and writes them.
async fn writer(mut s: quinn::SendStream, jobs: Arc<Mutex<mpsc::Receiver<Job>>>, cx: WriterCtx) {
    let mut stop = cx.shared.stop.subscribe();
    loop {
        let job = tokio::select! {
            j = async { jobs.lock().await.recv().await } => j,
            _ = stop.wait_for(|v| *v) => { let _ = s.reset(quinn::VarInt::from_u32(CANCEL_CODE)); return; }
        };
        let Some(job) = job else { break };
        let payload = chunk_payload(&job.state, &job.spec);
        let header = ChunkHeader::new(cx.request, job.spec.layer, job.spec.part, job.spec.offset, payload);
        let mut prefix = header.frame_prefix();
        let mut body: std::borrow::Cow<[u8]> = payload.into();
        match job.fault {
            Fault::None => {}
            Fault::Corrupt => {
                let mut v = payload.to_vec();
                if let Some(b) = v.get_mut(payload.len() / 2) {
                    *b ^= 0x40;
                }
                body = v.into();
            }
            Fault::Truncate => {
                let _ = s.write_all(&prefix).await;
                let _ = s.write_all(&payload[..payload.len() / 2]).await;
                let _ = s.finish();
                tracing::warn!("test hook: truncated a chunk frame and ended the stream");
                // Keep taking jobs (and dropping them) as if the stream were fine.
                while let Some(_job) = jobs.lock().await.recv().await {}
                return;
            }
            Fault::Oversize => {
                prefix[0..4].copy_from_slice(&(cx.max_frame + 1).to_le_bytes());
            }
        }
        let res = tokio::select! {
            r = tokio::time::timeout(cx.stall, async {
                s.write_all(&prefix).await?;
                s.write_all(&body).await
            }) => r,
            _ = stop.wait_for(|v| *v) => { let _ = s.reset(quinn::VarInt::from_u32(CANCEL_CODE)); return; }
        };
        match res {
            Ok(Ok(())) => {
                cx.shared.written.fetch_add(body.len() as u64, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(Err(e)) => return cx.shared.fail(write_error(cx.peer, e)),
            Err(_) => {
                return cx.shared.fail(TransferError::Stalled {
                    peer: cx.peer,
                    what: "the peer reading state (flow control blocked a write)".into(),
                    secs: cx.stall.as_secs_f64(),
                })
            }
        }
    }
    let _ = s.finish();
    // Wait until the peer has every byte of this stream (or stopped it).
    match tokio::time::timeout(cx.stall, s.stopped()).await {
        Ok(Ok(None)) => {}
        Ok(Ok(Some(code))) => cx.shared.fail(TransferError::Aborted {
            peer: cx.peer,
            code: ErrorCode::Cancelled,
            message: format!("the peer stopped a data stream (code {code})"),
        }),
        Ok(Err(quinn::StoppedError::ConnectionLost(e))) => cx.shared.fail(connection_lost(cx.peer, &e)),
        Ok(Err(e)) => cx.shared.fail(TransferError::Local(format!("data stream to {}: {e}", cx.peer))),
        Err(_) => cx.shared.fail(TransferError::Stalled {
            peer: cx.peer,
            what: "the peer acknowledging the last chunks".into(),
            secs: cx.stall.as_secs_f64(),
        }),
    }
}

/// Reads the client's side of the request stream: an Abort (or a reset) cancels the transfer.
async fn watch_client(mut fr: FramedRecv, shared: Arc<Shared>, peer: SocketAddr, id: u64) {
    match fr.next_message().await {
        Ok(Some(Message::Received { request })) if request == id => {
            let _ = shared.received.send_replace(true);
        }
        Ok(Some(Message::Abort(e))) => {
            tracing::info!(%peer, request = id, "decoder cancelled: {:?}: {}", e.code, e.message);
            shared.fail(TransferError::Aborted { peer, code: e.code, message: e.message })
        }
        Ok(Some(other)) => shared.fail(TransferError::Protocol { peer, reason: format!("unexpected {} during a transfer", other.name()) }),
        Ok(None) => shared.fail(TransferError::Protocol { peer, reason: "the decoder ended the request without confirming it".into() }),
        Err(e) => shared.fail(e),
    }
}

async fn heartbeat(ctrl: Arc<Mutex<quinn::SendStream>>, mut stop: watch::Receiver<bool>, every: Duration, request: u64, peer: SocketAddr) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|v| *v) => return,
        }
        let mut s = ctrl.lock().await;
        if *stop.borrow() {
            return;
        }
        if write_message(&mut s, peer, &Message::Heartbeat { request }).await.is_err() {
            return;
        }
    }
}

/// Streams the layers of one accepted request. Memory stays bounded: `send_layer` returns
/// once the layer's chunks are queued behind at most `2 × streams` others, and quinn buffers at
/// most `Tuning::send_window` bytes, so a slow decoder slows the sender instead of growing it.
pub struct LayerSender {
    id: u64,
    peer: SocketAddr,
    layout: StateLayout,
    sent: Vec<bool>,
    chunk_bytes: u32,
    streams: u16,
    jobs: Option<mpsc::Sender<Job>>,
    writers: JoinSet<()>,
    ctrl: Arc<Mutex<quinn::SendStream>>,
    shared: Arc<Shared>,
    hb_stop: watch::Sender<bool>,
    heartbeat: Option<JoinHandle<()>>,
    watch_task: JoinHandle<()>,
    hooks: Arc<FaultHooks>,
    conn: quinn::Connection,
    stall: Duration,
    seq: u64,
    chunks: u64,
    state_bytes: u64,
    send_wait: Duration,
    delayed: Option<Job>,
    started: Instant,
    aborted: bool,
}

impl Drop for LayerSender {
    fn drop(&mut self) {
        self.watch_task.abort();
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        // Unfinished: tell the writers to reset their streams.
        let _ = self.shared.stop.send_replace(true);
    }
}

impl LayerSender {
    pub fn request_id(&self) -> u64 {
        self.id
    }

    pub fn layout(&self) -> &StateLayout {
        &self.layout
    }

    /// Streams and chunk size in use.
    pub fn streams(&self) -> u16 {
        self.streams
    }
    pub fn chunk_bytes(&self) -> u32 {
        self.chunk_bytes
    }

    /// Payload bytes handed to QUIC so far (for tests of flow control).
    pub fn bytes_handed_to_quic(&self) -> u64 {
        self.shared.written.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The error that stopped the transfer, if any (a decoder cancel, a lost connection...).
    pub fn failure(&self) -> Option<TransferError> {
        self.shared.error()
    }

    fn check(&self) -> Result<(), TransferError> {
        match self.shared.error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn push(&mut self, job: Job) -> Result<(), TransferError> {
        let Some(tx) = self.jobs.as_ref() else {
            return Err(TransferError::Local("send after finish".into()));
        };
        let t0 = Instant::now();
        let mut stop = self.shared.stop.subscribe();
        let r = tokio::select! {
            r = tokio::time::timeout(self.stall, tx.send(job)) => r,
            _ = stop.wait_for(|v| *v) => return self.check().and(Err(TransferError::Cancelled("transfer stopped".into()))),
        };
        self.send_wait += t0.elapsed();
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => self.check().and(Err(TransferError::Local("all data streams ended".into()))),
            Err(_) => {
                let e = TransferError::Stalled {
                    peer: self.peer,
                    what: "the peer reading state (every data stream is blocked by flow control)".into(),
                    secs: self.stall.as_secs_f64(),
                };
                self.shared.fail(e.clone());
                Err(e)
            }
        }
    }

    /// Queues one layer's state (exactly once per layer, any order; layer-major order keeps the
    /// receiver's memory low). Waits while the network is behind. On an error of this side
    /// (a stalled peer, a bad layer) the decoder is sent an Abort naming it.
    ///
    /// Takes the state by value or as an `Arc` (to keep a copy for the session store without
    /// cloning the data).
    pub async fn send_layer(&mut self, layer: usize, state: impl Into<Arc<LayerState>>) -> Result<(), TransferError> {
        let r = self.send_layer_inner(layer, state.into()).await;
        if let Err(e) = &r {
            self.abort_on(e).await;
        }
        r
    }

    /// Tells the decoder why the transfer stops, unless the decoder or the link ended it.
    async fn abort_on(&mut self, e: &TransferError) {
        match e {
            TransferError::Aborted { .. } | TransferError::ConnectionLost { .. } => {}
            _ => self.abort_inner(e.code(), &e.to_string()).await,
        }
    }

    async fn send_layer_inner(&mut self, layer: usize, state: Arc<LayerState>) -> Result<(), TransferError> {
        self.check()?;
        let Some(ly) = self.layout.layers.get(layer).copied() else {
            return Err(TransferError::LayerPastLayout { layer, layers: self.layout.layers.len() });
        };
        if self.sent[layer] {
            return Err(TransferError::LayerResent { layer });
        }
        ly.check_state(&state).map_err(|source| TransferError::LayerState { layer, source })?;
        self.sent[layer] = true;
        for spec in plan_layer(layer as u32, &ly, self.chunk_bytes) {
            let seq = self.seq;
            self.seq += 1;
            self.chunks += 1;
            self.state_bytes += spec.len as u64;
            let h = self.hooks.clone();
            if h.is(h.close_at_chunk, seq) {
                tracing::warn!(seq, "test hook: closing the connection mid-transfer");
                self.conn.close(quinn::VarInt::from_u32(9), b"test hook: connection dropped");
                return Err(TransferError::Local("connection closed by a test hook".into()));
            }
            if h.is(h.drop_chunk, seq) {
                tracing::warn!(seq, "test hook: dropping a chunk");
                continue;
            }
            let fault = if h.is(h.corrupt_chunk, seq) {
                Fault::Corrupt
            } else if h.is(h.truncate_chunk, seq) {
                Fault::Truncate
            } else if h.is(h.oversize_chunk, seq) {
                Fault::Oversize
            } else {
                Fault::None
            };
            let job = Job { state: state.clone(), spec, fault };
            if h.is(h.duplicate_chunk, seq) {
                self.push(Job { state: state.clone(), spec, fault }).await?;
            }
            if h.is(h.delay_chunk, seq) {
                self.delayed = Some(job);
                continue;
            }
            self.push(job).await?;
            if let Some(d) = self.delayed.take() {
                self.push(d).await?;
            }
        }
        Ok(())
    }

    /// Reports compute progress to the decoder.
    pub async fn progress(&mut self, layers_done: u32, compute_s: f64) -> Result<(), TransferError> {
        self.check()?;
        let msg = Message::Progress(Progress { request: self.id, layers_done, layers_total: self.layout.layers.len() as u32, compute_s });
        write_message(&mut *self.ctrl.lock().await, self.peer, &msg).await
    }

    /// Waits until every chunk is delivered, sends `Done`, and waits for the decoder to confirm
    /// that the whole state arrived intact (`Received`); an `Aborted` error otherwise says what
    /// the decoder found wrong. `timing` carries the executor's compute and weight-wait times;
    /// the transport fills in bytes, chunks, send waits and the total.
    pub async fn finish(mut self, timing: Timing, last_logits: Option<Vec<f32>>) -> Result<Timing, TransferError> {
        let r = self.finish_inner(timing, last_logits).await;
        if let Err(e) = &r {
            self.abort_on(e).await;
        }
        r
    }

    async fn finish_inner(&mut self, mut timing: Timing, last_logits: Option<Vec<f32>>) -> Result<Timing, TransferError> {
        self.check()?;
        if let Some(l) = self.sent.iter().position(|s| !s) {
            return Err(TransferError::LayerNeverSent { layer: l });
        }
        if let Some(d) = self.delayed.take() {
            self.push(d).await?;
        }
        self.jobs = None; // writers drain the queue, finish their streams, wait for acks
        while self.writers.join_next().await.is_some() {}
        self.check()?;
        let _ = self.hb_stop.send(true);
        if let Some(h) = self.heartbeat.take() {
            let _ = h.await;
        }
        let written = self.bytes_handed_to_quic();
        let frame_overhead = (FRAME_HEADER_LEN + CHUNK_HEADER_LEN) as u64 * self.chunks;
        timing.send_wait_s = self.send_wait.as_secs_f64();
        timing.total_s = self.started.elapsed().as_secs_f64();
        timing.state_bytes = self.state_bytes;
        timing.chunks = self.chunks;
        timing.wire_bytes = written + frame_overhead;
        let done = Done {
            request: self.id,
            layers: self.layout.layers.len() as u32,
            chunks: self.chunks,
            state_bytes: self.state_bytes,
            timing: timing.clone(),
            last_logits,
        };
        {
            let mut s = self.ctrl.lock().await;
            write_message(&mut s, self.peer, &Message::Done(done)).await?;
            let _ = s.finish();
        }
        if let Some(d) = self.hooks.pause_after_done {
            tokio::time::sleep(d).await;
        }
        // The decoder verifies everything, then confirms (or aborts, naming the fault).
        let mut received = self.shared.received.subscribe();
        let mut stop = self.shared.stop.subscribe();
        tokio::select! {
            _ = received.wait_for(|v| *v) => {}
            _ = stop.wait_for(|v| *v) => return Err(self.check().err().unwrap_or_else(|| TransferError::Cancelled("transfer stopped".into()))),
            _ = tokio::time::sleep(self.stall) => {
                return Err(TransferError::Stalled { peer: self.peer, what: "the decoder confirming the state".into(), secs: self.stall.as_secs_f64() });
            }
        }
        tracing::info!(
            peer = %self.peer,
            request = self.id,
            bytes = self.state_bytes,
            chunks = self.chunks,
            secs = timing.total_s,
            "hand-off sent"
        );
        Ok(timing)
    }

    /// Cancels the transfer from the prefill side; the decoder gets `Aborted` with `code`.
    pub async fn abort(mut self, code: ErrorCode, message: &str) {
        self.abort_inner(code, message).await;
    }

    async fn abort_inner(&mut self, code: ErrorCode, message: &str) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        let _ = self.hb_stop.send(true);
        let mut s = self.ctrl.lock().await;
        let _ = write_message(&mut s, self.peer, &Message::Abort(ErrorMsg { code, message: message.to_string() })).await;
        finish_and_flush(&mut s, Duration::from_secs(2)).await;
        drop(s);
        self.shared.fail(TransferError::Cancelled(format!("aborted by the prefill node: {message}")));
    }
}
