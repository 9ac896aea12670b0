//! The decoder's side: [`PrefillClient`] connects to a paired prefill node, [`Transfer`]
//! receives the state of one request layer by layer.
//!
//! ```no_run
//! # async fn run(cfg: k3_protocol::transport::NodeConfig, c: &k3_protocol::TextConfig) -> Result<(), k3_protocol::transport::TransferError> {
//! use k3_protocol::transport::{PrefillClient, TransferEvent};
//! use k3_protocol::wire::{PrefillOptions, PrefillRequest, SessionId, StateLayout};
//! let mut client = PrefillClient::connect("192.168.1.20:7433".parse().unwrap(), cfg).await?;
//! let tokens: Vec<u32> = vec![1, 2, 3];
//! let expected = StateLayout::for_model(c, tokens.len());
//! let req = PrefillRequest { session: SessionId::random(), base: None, tokens, image_embeddings: None, options: PrefillOptions::default() };
//! let mut transfer = client.prefill(req, &expected).await?;
//! while let Some(ev) = transfer.next().await? {
//!     match ev {
//!         TransferEvent::Layer { layer, state } => { /* ingest layer `layer` */ }
//!         TransferEvent::Progress(_) => {}
//!         TransferEvent::Done(summary) => { /* the state is complete and verified */ }
//!     }
//! }
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::handoff::{HandoffState, LayerState};
use crate::transport::config::NodeConfig;
use crate::transport::error::{connection_lost, is_tls_refusal, TransferError};
use crate::transport::framed::{finish_and_flush, write_message, FramedRecv};
use crate::transport::framed::{CANCEL_CODE, HANDSHAKE_MAX_FRAME};
#[cfg(feature = "fault-injection")]
use crate::transport::hooks::FaultHooks;
use crate::transport::tls::{client_config, RefusalSlot};
use crate::transport::PeerInfo;
use crate::wire::frame::{encode_control, Chunk, Frame, CHUNK_HEADER_LEN};
use crate::wire::handshake::{check_ack, AckVerdict, Refusal};
use crate::wire::{
    Accepted, AssemblerLimits, Done, ErrorCode, ErrorMsg, Hello, Message, NodeCost, PrefillRequest, Progress, StateAssembler, StateCollector, StateLayout,
    Timing, PROTOCOL_VERSION,
};

/// A connection to a prefill node, past the handshake.
pub struct PrefillClient {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    cfg: Arc<NodeConfig>,
    server: PeerInfo,
    max_frame: u32,
    cost: NodeCost,
}

impl PrefillClient {
    /// Connects, verifies the server's pinned certificate (mutual TLS 1.3), and exchanges
    /// Hello/HelloAck: protocol version, model fingerprint, capabilities.
    pub async fn connect(addr: SocketAddr, cfg: NodeConfig) -> Result<PrefillClient, TransferError> {
        let insecure = cfg.peers.is_insecure();
        if insecure {
            if !addr.ip().is_loopback() {
                return Err(TransferError::InsecureNotLoopback(addr));
            }
            tracing::warn!(%addr, "INSECURE DEV MODE: the prefill node's certificate is NOT checked. Loopback testing only.");
        }
        let (tls, refused) = client_config(&cfg.identity, &cfg.peers)?;
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| TransferError::Identity(format!("QUIC TLS config: {e}")))?;
        let mut cc = quinn::ClientConfig::new(Arc::new(crypto));
        cc.transport_config(Arc::new(cfg.tuning.quinn_transport()));
        let bind: SocketAddr = match (addr.is_ipv6(), addr.ip().is_loopback()) {
            (false, true) => ([127, 0, 0, 1], 0).into(),
            (false, false) => ([0, 0, 0, 0], 0).into(),
            (true, true) => (std::net::Ipv6Addr::LOCALHOST, 0).into(),
            (true, false) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let endpoint = cfg.tuning.endpoint(bind, None).map_err(|e| TransferError::Connect { peer: addr, reason: format!("binding {bind}: {e}") })?;
        let connecting = endpoint.connect_with(cc, addr, "k3-offload").map_err(|e| TransferError::Connect { peer: addr, reason: e.to_string() })?;
        let t = cfg.tuning.idle_timeout;
        let ours = cfg.identity.fingerprint();
        let conn = match tokio::time::timeout(t, connecting).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(handshake_error(addr, &e, &refused, ours)),
            Err(_) => return Err(TransferError::Connect { peer: addr, reason: format!("no answer within {:.0} s", t.as_secs_f64()) }),
        };
        let certificate = crate::transport::peer_certificate(&conn);
        let conn_err = |e: &quinn::ConnectionError| handshake_error(addr, e, &refused, ours);
        let (mut send, recv) = conn.open_bi().await.map_err(|e| conn_err(&e))?;
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            model_fingerprint: cfg.model_fingerprint,
            state_identity: cfg.state_identity,
            capabilities: cfg.capabilities.clone(),
            node_name: cfg.node_name.clone(),
        };
        write_message(&mut send, addr, &Message::Hello(hello)).await.map_err(|e| tls_refusal_or(e, &conn, addr, ours))?;
        let mut fr = FramedRecv::new(recv, HANDSHAKE_MAX_FRAME, addr);
        let ack = match tokio::time::timeout(t, fr.next_message()).await {
            Ok(Ok(Some(Message::HelloAck(a)))) => a,
            Ok(Ok(Some(Message::Error(e)))) => return Err(TransferError::Refused { peer: addr, code: e.code, message: e.message }),
            Ok(Ok(Some(m))) => return Err(TransferError::Protocol { peer: addr, reason: format!("expected HelloAck, got {}", m.name()) }),
            Ok(Ok(None)) => return Err(TransferError::Protocol { peer: addr, reason: "handshake stream ended before HelloAck".into() }),
            Ok(Err(e)) => return Err(tls_refusal_or(e, &conn, addr, ours)),
            Err(_) => return Err(TransferError::Stalled { peer: addr, what: "HelloAck".into(), secs: t.as_secs_f64() }),
        };
        match check_ack(&cfg.announce(), cfg.accept_compatible_states, &ack) {
            Ok(AckVerdict::SameModel) => {}
            Ok(AckVerdict::CompatibleStates { state_identity }) => tracing::warn!(
                peer = %addr,
                ours = %cfg.model_fingerprint,
                theirs = %ack.model_fingerprint,
                state_identity = %state_identity.short(),
                "the prefill node runs another model whose states are state-compatible with this one (same state identity); \
                 accepting its states (--accept-compatible-states): they are the states ITS model computes"
            ),
            Err(r) => {
                let reason: &[u8] = match r {
                    Refusal::VersionMismatch { .. } => b"protocol version mismatch",
                    Refusal::CompatibleModelNotAccepted { .. } => b"state-compatible model not accepted",
                    _ => b"model fingerprint mismatch",
                };
                conn.close(quinn::VarInt::from_u32(2), reason);
                return Err(TransferError::from_refusal(addr, r));
            }
        }
        // After its HelloAck the server refuses (e.g. capabilities) or advertises its cost.
        let cost = match tokio::time::timeout(t, fr.next_message()).await {
            Ok(Ok(Some(Message::Cost(c)))) => c,
            Ok(Ok(Some(Message::Error(e)))) => return Err(TransferError::Refused { peer: addr, code: e.code, message: e.message }),
            Ok(Ok(Some(m))) => return Err(TransferError::Protocol { peer: addr, reason: format!("expected Cost after HelloAck, got {}", m.name()) }),
            Ok(Ok(None)) => return Err(TransferError::Protocol { peer: addr, reason: "handshake stream ended before Cost".into() }),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(TransferError::Stalled { peer: addr, what: "Cost".into(), secs: t.as_secs_f64() }),
        };
        let _ = send.finish();
        let server = PeerInfo {
            addr,
            certificate,
            node_name: ack.node_name,
            capabilities: ack.capabilities,
            model_fingerprint: ack.model_fingerprint,
            state_identity: ack.state_identity,
        };
        tracing::info!(peer = %addr, name = %server.node_name, backend = %server.capabilities.backend, "connected to prefill node");
        Ok(PrefillClient { endpoint, conn, cfg: Arc::new(cfg), server, max_frame: ack.max_frame_size, cost })
    }

    /// The node's cost as last advertised (in the handshake, or by [`PrefillClient::query_cost`]).
    pub fn cost(&self) -> &NodeCost {
        &self.cost
    }

    /// Asks the node for its current cost (queue included) on a stream of its own.
    pub async fn query_cost(&mut self) -> Result<NodeCost, TransferError> {
        let peer = self.server.addr;
        let (mut send, recv) = self.conn.open_bi().await.map_err(|e| connection_lost(peer, &e))?;
        write_message(&mut send, peer, &Message::CostQuery).await?;
        let _ = send.finish();
        let mut fr = FramedRecv::new(recv, HANDSHAKE_MAX_FRAME, peer);
        let t = self.cfg.tuning.idle_timeout;
        match tokio::time::timeout(t, fr.next_message()).await {
            Ok(Ok(Some(Message::Cost(c)))) => {
                self.cost = c.clone();
                Ok(c)
            }
            Ok(Ok(Some(Message::Error(e)))) => Err(TransferError::Refused { peer, code: e.code, message: e.message }),
            Ok(Ok(Some(m))) => Err(TransferError::Protocol { peer, reason: format!("expected Cost, got {}", m.name()) }),
            Ok(Ok(None)) => Err(TransferError::Protocol { peer, reason: "cost stream ended before Cost".into() }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(TransferError::Stalled { peer, what: "Cost".into(), secs: t.as_secs_f64() }),
        }
    }

    pub fn server(&self) -> &PeerInfo {
        &self.server
    }

    /// QUIC statistics (bytes and datagrams on the wire).
    pub fn stats(&self) -> quinn::ConnectionStats {
        self.conn.stats()
    }

    /// Sends a request and waits for it to be accepted. `expected` is the layout the decoder
    /// computed for it (e.g. `StateLayout::for_model(cfg, tokens.len())`); the server's must
    /// be identical.
    pub async fn prefill(&mut self, request: PrefillRequest, expected: &StateLayout) -> Result<Transfer<'_>, TransferError> {
        let peer = self.server.addr;
        let tuning = &self.cfg.tuning;
        expected.validate(tuning.max_state_bytes).map_err(|e| TransferError::Local(format!("expected layout: {e}")))?;
        let (mut send, recv) = self.conn.open_bi().await.map_err(|e| connection_lost(peer, &e))?;
        #[cfg(feature = "fault-injection")]
        let raw_sent = self.cfg.hooks.send_raw_request(&mut send, peer).await?;
        #[cfg(not(feature = "fault-injection"))]
        let raw_sent = false;
        if !raw_sent {
            write_message(&mut send, peer, &Message::PrefillRequest(request)).await?;
        }
        let mut ctrl = FramedRecv::new(recv, tuning.max_control_frame, peer);
        let t = tuning.inactivity_timeout;
        let accepted = loop {
            match tokio::time::timeout(t, ctrl.next_message()).await {
                Ok(Ok(Some(Message::Accepted(a)))) => break a,
                Ok(Ok(Some(Message::Heartbeat { .. }))) => continue,
                Ok(Ok(Some(Message::Error(e)))) => return Err(TransferError::Refused { peer, code: e.code, message: e.message }),
                Ok(Ok(Some(m))) => return Err(TransferError::Protocol { peer, reason: format!("expected Accepted, got {}", m.name()) }),
                Ok(Ok(None)) => return Err(TransferError::Protocol { peer, reason: "request stream ended before Accepted".into() }),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(TransferError::Stalled { peer, what: "the answer to a request".into(), secs: t.as_secs_f64() }),
            }
        };
        let refuse = |reason: String| TransferError::Protocol { peer, reason };
        let problem = if accepted.layout != *expected {
            Some(refuse(format!("the server's state layout differs from ours: {}", layout_diff(expected, &accepted.layout))))
        } else if accepted.streams == 0 || accepted.streams > tuning.max_streams.max(1) {
            Some(refuse(format!("{} data streams (limit {})", accepted.streams, tuning.max_streams)))
        } else if accepted.chunk_bytes as u64 + 1 + CHUNK_HEADER_LEN as u64 > self.max_frame as u64 {
            Some(refuse(format!("chunk size {} exceeds the negotiated frame size {}", accepted.chunk_bytes, self.max_frame)))
        } else {
            None
        };
        if let Some(e) = problem {
            let _ = write_message(&mut send, peer, &Message::Abort(ErrorMsg { code: ErrorCode::InvalidRequest, message: e.to_string() })).await;
            let _ = send.finish();
            return Err(e);
        }
        Ok(Transfer::start(self, accepted, send, ctrl))
    }

    /// Closes the connection politely.
    pub async fn close(self) {
        self.conn.close(quinn::VarInt::from_u32(0), b"done");
        let _ = tokio::time::timeout(Duration::from_secs(1), self.endpoint.wait_idle()).await;
    }
}

fn handshake_error(peer: SocketAddr, e: &quinn::ConnectionError, refused: &RefusalSlot, ours: crate::transport::CertFingerprint) -> TransferError {
    if let Some((got, pinned)) = refused.lock().ok().and_then(|mut g| g.take()) {
        let pinned = pinned.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ");
        return TransferError::PeerCertificateNotPinned { peer, got, pinned };
    }
    if is_tls_refusal(e) {
        return TransferError::CertificateRefusedByPeer { peer, ours };
    }
    TransferError::Connect { peer, reason: e.to_string() }
}

/// In TLS 1.3 the server checks our certificate after our side of the handshake finished, so
/// its refusal shows up as the connection closing with a TLS alert at the first read/write.
fn tls_refusal_or(e: TransferError, conn: &quinn::Connection, peer: SocketAddr, ours: crate::transport::CertFingerprint) -> TransferError {
    match conn.close_reason() {
        Some(r) if is_tls_refusal(&r) => TransferError::CertificateRefusedByPeer { peer, ours },
        _ => e,
    }
}

fn layout_diff(a: &StateLayout, b: &StateLayout) -> String {
    if a.layers.len() != b.layers.len() {
        return format!("{} layers expected, {} announced", a.layers.len(), b.layers.len());
    }
    for (l, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        if x != y {
            return format!("layer {l}: expected {x:?}, announced {y:?}");
        }
    }
    "identical".into()
}

/// What happened, after the last layer.
#[derive(Debug, Clone)]
pub struct TransferSummary {
    pub request: u64,
    pub base_tokens: u64,
    pub layers: u32,
    pub chunks: u64,
    pub state_bytes: u64,
    /// The prefill node's timing (compute, waits, bytes).
    pub server_timing: Timing,
    pub last_logits: Option<Vec<f32>>,
    /// Accepted → every layer verified, on this side.
    pub elapsed_s: f64,
    /// Accepted → first complete layer.
    pub first_layer_s: Option<f64>,
}

/// One step of a transfer.
#[derive(Debug)]
pub enum TransferEvent {
    /// A layer whose every byte arrived and was verified. The whole state is usable only after
    /// [`TransferEvent::Done`]: if the transfer fails later, discard the layers taken so far.
    Layer {
        layer: u32,
        state: LayerState,
    },
    Progress(Progress),
    /// Every layer arrived exactly once and the totals match the sender's.
    Done(TransferSummary),
}

enum DataEvent {
    Chunk(Chunk),
    StreamEnded,
    Failed(TransferError),
}

/// A request in flight. Dropping it cancels the transfer.
pub struct Transfer<'c> {
    client: &'c mut PrefillClient,
    accepted: Accepted,
    ctrl_send: quinn::SendStream,
    ctrl_rx: mpsc::Receiver<Result<Message, TransferError>>,
    ctrl_open: bool,
    data_rx: mpsc::Receiver<DataEvent>,
    streams_ended: u16,
    tasks: JoinSet<()>,
    assembler: StateAssembler,
    done: Option<Done>,
    finished: bool,
    started: Instant,
    first_layer_s: Option<f64>,
}

impl Drop for Transfer<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.ctrl_send.reset(quinn::VarInt::from_u32(CANCEL_CODE));
        }
    }
}

impl<'c> Transfer<'c> {
    fn start(client: &'c mut PrefillClient, accepted: Accepted, ctrl_send: quinn::SendStream, ctrl: FramedRecv) -> Transfer<'c> {
        let peer = client.server.addr;
        let tuning = &client.cfg.tuning;
        let mut tasks = JoinSet::new();
        let (ctrl_tx, ctrl_rx) = mpsc::channel(16);
        tasks.spawn(read_control(ctrl, ctrl_tx));
        let (data_tx, data_rx) = mpsc::channel(2 * accepted.streams as usize);
        tasks.spawn(accept_data_streams(
            client.conn.clone(),
            peer,
            accepted.request,
            accepted.streams,
            client.max_frame,
            ReadHooks::of(&client.cfg),
            data_tx,
            tuning.inactivity_timeout,
        ));
        // What the sender can have in flight: QUIC windows, plus chunks queued in our readers.
        let in_flight = tuning.receive_window as u64
            + tuning.stream_receive_window as u64 * accepted.streams as u64
            + 4 * accepted.streams as u64 * accepted.chunk_bytes as u64;
        let assembler = StateAssembler::new(accepted.request, accepted.layout.clone(), AssemblerLimits::for_transfer(&accepted.layout, in_flight));
        Transfer {
            client,
            accepted,
            ctrl_send,
            ctrl_rx,
            ctrl_open: true,
            data_rx,
            streams_ended: 0,
            tasks,
            assembler,
            done: None,
            finished: false,
            started: Instant::now(),
            first_layer_s: None,
        }
    }

    pub fn accepted(&self) -> &Accepted {
        &self.accepted
    }

    pub fn peer(&self) -> SocketAddr {
        self.client.server.addr
    }

    /// The next event; Ok(None) after `Done`. An error ends the transfer (the server is told).
    pub async fn next(&mut self) -> Result<Option<TransferEvent>, TransferError> {
        let peer = self.peer();
        let inactivity = self.client.cfg.tuning.inactivity_timeout;
        loop {
            if self.finished {
                return Ok(None);
            }
            if self.streams_ended == self.accepted.streams {
                if let Some(done) = &self.done {
                    let r = self.assembler.finish(done.layers, done.chunks, done.state_bytes);
                    if let Err(e) = r {
                        return self.fail(TransferError::Corrupt { peer, source: e }).await;
                    }
                    let done = self.done.take().expect("checked above");
                    self.finished = true;
                    let ack = Message::Received { request: done.request };
                    if let Err(e) = write_message(&mut self.ctrl_send, peer, &ack).await {
                        tracing::warn!(%peer, "could not confirm the hand-off: {e}");
                    }
                    // One round trip: the confirmation must not die with a connection closed next.
                    finish_and_flush(&mut self.ctrl_send, Duration::from_secs(2)).await;
                    let summary = TransferSummary {
                        request: done.request,
                        base_tokens: self.accepted.base_tokens,
                        layers: done.layers,
                        chunks: done.chunks,
                        state_bytes: done.state_bytes,
                        server_timing: done.timing,
                        last_logits: done.last_logits,
                        elapsed_s: self.started.elapsed().as_secs_f64(),
                        first_layer_s: self.first_layer_s,
                    };
                    tracing::info!(%peer, request = summary.request, bytes = summary.state_bytes, secs = summary.elapsed_s, "hand-off received and verified");
                    return Ok(Some(TransferEvent::Done(summary)));
                }
                if !self.ctrl_open {
                    return self.fail(TransferError::Protocol { peer, reason: "request stream ended without Done".into() }).await;
                }
            }
            let data_open = self.streams_ended < self.accepted.streams;
            tokio::select! {
                m = self.ctrl_rx.recv(), if self.ctrl_open => match m {
                    Some(Ok(Message::Progress(p))) => return Ok(Some(TransferEvent::Progress(p))),
                    Some(Ok(Message::Heartbeat { .. })) => {}
                    Some(Ok(Message::Done(d))) => {
                        if d.request != self.accepted.request || self.done.is_some() {
                            return self.fail(TransferError::Protocol { peer, reason: format!("unexpected Done for request {}", d.request) }).await;
                        }
                        self.done = Some(d);
                    }
                    Some(Ok(Message::Error(e))) | Some(Ok(Message::Abort(e))) => {
                        return self.fail(TransferError::Aborted { peer, code: e.code, message: e.message }).await;
                    }
                    Some(Ok(other)) => {
                        return self.fail(TransferError::Protocol { peer, reason: format!("unexpected {} on the request stream", other.name()) }).await;
                    }
                    Some(Err(e)) => return self.fail(e).await,
                    None => self.ctrl_open = false,
                },
                d = self.data_rx.recv(), if data_open => match d {
                    Some(DataEvent::Chunk(c)) => match self.assembler.accept(&c.header, &c.payload) {
                        Ok(Some((layer, state))) => {
                            self.first_layer_s.get_or_insert(self.started.elapsed().as_secs_f64());
                            return Ok(Some(TransferEvent::Layer { layer, state }));
                        }
                        Ok(None) => {}
                        Err(e) => return self.fail(TransferError::Corrupt { peer, source: e }).await,
                    },
                    Some(DataEvent::StreamEnded) => self.streams_ended += 1,
                    Some(DataEvent::Failed(e)) => {
                        // A reset data stream usually comes with the server's Abort: prefer it.
                        if let Ok(Ok(Message::Abort(a))) | Ok(Ok(Message::Error(a))) = self.ctrl_rx.try_recv() {
                            return self.fail(TransferError::Aborted { peer, code: a.code, message: a.message }).await;
                        }
                        return self.fail(e).await;
                    }
                    None => {
                        return self.fail(TransferError::Protocol { peer, reason: "data streams ended unexpectedly".into() }).await;
                    }
                },
                _ = tokio::time::sleep(inactivity) => {
                    return self.fail(TransferError::Stalled { peer, what: "the prefill node (no data, progress or heartbeat)".into(), secs: inactivity.as_secs_f64() }).await;
                }
            }
        }
    }

    async fn fail<T>(&mut self, e: TransferError) -> Result<T, TransferError> {
        tracing::warn!(peer = %self.peer(), request = self.accepted.request, "hand-off failed: {e}");
        self.finished = true;
        // Tell the prefill node first (and wait, briefly, until it has the message), then stop
        // reading: so it learns the cause rather than just seeing its streams stopped.
        if !matches!(e, TransferError::ConnectionLost { .. } | TransferError::Aborted { .. }) {
            let msg = Message::Abort(ErrorMsg { code: e.code(), message: e.to_string() });
            if let Ok(bytes) = encode_control(&msg) {
                if let Ok(Ok(())) = tokio::time::timeout(Duration::from_millis(500), self.ctrl_send.write_all(&bytes)).await {
                    finish_and_flush(&mut self.ctrl_send, Duration::from_secs(1)).await;
                }
            }
        }
        let _ = self.ctrl_send.finish();
        self.tasks.abort_all();
        Err(e)
    }

    /// Receives everything and returns the whole (delta) state: `state.tokens` is the number of
    /// rows it carries; every layer is present exactly once and verified.
    pub async fn collect(mut self) -> Result<(HandoffState, TransferSummary), TransferError> {
        let mut col = StateCollector::new(&self.accepted.layout);
        let peer = self.peer();
        while let Some(ev) = self.next().await? {
            match ev {
                TransferEvent::Layer { layer, state } => col.put(layer, state).map_err(|e| TransferError::Corrupt { peer, source: e })?,
                TransferEvent::Progress(_) => {}
                TransferEvent::Done(s) => {
                    let st = col.into_state().map_err(|e| TransferError::Corrupt { peer, source: e })?;
                    return Ok((st, s));
                }
            }
        }
        Err(TransferError::Local("transfer already finished".into()))
    }

    /// Cancels from the decoder's side; the prefill node's `send_layer` returns `Aborted`.
    pub async fn cancel(mut self, reason: &str) {
        self.finished = true;
        let peer = self.peer();
        let msg = Message::Abort(ErrorMsg { code: ErrorCode::Cancelled, message: reason.to_string() });
        let _ = write_message(&mut self.ctrl_send, peer, &msg).await;
        // The readers go after the reason has been acknowledged, so the node learns why
        // before its data streams are stopped.
        finish_and_flush(&mut self.ctrl_send, Duration::from_secs(2)).await;
        // Then, bounded, until the node ends its side of the request stream (it does once it
        // has read the reason and stopped): a connection closed right after the cancel would
        // otherwise reach the node before the reason.
        let _ = tokio::time::timeout(Duration::from_secs(1), async { while let Some(Ok(_)) = self.ctrl_rx.recv().await {} }).await;
        self.tasks.abort_all();
    }
}

async fn read_control(mut fr: FramedRecv, tx: mpsc::Sender<Result<Message, TransferError>>) {
    loop {
        match fr.next_message().await {
            Ok(Some(m)) => {
                if tx.send(Ok(m)).await.is_err() {
                    return;
                }
            }
            Ok(None) => return,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                return;
            }
        }
    }
}

async fn accept_data_streams(
    conn: quinn::Connection,
    peer: SocketAddr,
    request: u64,
    streams: u16,
    max_frame: u32,
    hooks: ReadHooks,
    tx: mpsc::Sender<DataEvent>,
    wait: Duration,
) {
    let mut readers = JoinSet::new();
    let mut got = 0;
    while got < streams {
        let s = match tokio::time::timeout(wait, conn.accept_uni()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let _ = tx.send(DataEvent::Failed(connection_lost(peer, &e))).await;
                return;
            }
            Err(_) => {
                let _ = tx.send(DataEvent::Failed(TransferError::Stalled { peer, what: "opening data streams".into(), secs: wait.as_secs_f64() })).await;
                return;
            }
        };
        let mut fr = FramedRecv::new(s, max_frame, peer);
        match fr.next().await {
            Ok(Some(Frame::Control(Message::DataStream { request: r, .. }))) if r == request => {
                got += 1;
                readers.spawn(read_data(fr, tx.clone(), hooks.clone()));
            }
            Ok(Some(Frame::Control(Message::DataStream { request: r, .. }))) => {
                // A stream of an earlier, cancelled request: ignore it.
                tracing::debug!(request = r, "ignoring a data stream of another request");
                let _ = fr.stream.stop(quinn::VarInt::from_u32(CANCEL_CODE));
            }
            Ok(_) => {
                let _ = tx.send(DataEvent::Failed(TransferError::Protocol { peer, reason: "a data stream without a DataStream header".into() })).await;
                return;
            }
            Err(e) => {
                let _ = tx.send(DataEvent::Failed(e)).await;
                return;
            }
        }
    }
    while readers.join_next().await.is_some() {}
}

/// What a data-stream reader checks before each chunk (nothing in a build without the
/// `fault-injection` feature).
#[derive(Clone)]
struct ReadHooks {
    #[cfg(feature = "fault-injection")]
    hooks: Arc<FaultHooks>,
}

impl ReadHooks {
    fn of(_cfg: &NodeConfig) -> ReadHooks {
        ReadHooks {
            #[cfg(feature = "fault-injection")]
            hooks: _cfg.hooks.clone(),
        }
    }

    async fn before_chunk(&self) {
        #[cfg(feature = "fault-injection")]
        if self.hooks.stop_reading_after.is_some() && self.hooks.reader_must_stop() {
            tracing::warn!("test hook: this receiver stops reading");
            std::future::pending::<()>().await;
        }
    }
}

async fn read_data(mut fr: FramedRecv, tx: mpsc::Sender<DataEvent>, hooks: ReadHooks) {
    loop {
        hooks.before_chunk().await;
        let ev = match fr.next().await {
            Ok(Some(Frame::Chunk(c))) => DataEvent::Chunk(c),
            Ok(Some(Frame::Control(m))) => {
                DataEvent::Failed(TransferError::Protocol { peer: fr_peer(&fr), reason: format!("a {} message on a data stream", m.name()) })
            }
            Ok(None) => DataEvent::StreamEnded,
            Err(e) => DataEvent::Failed(e),
        };
        let last = !matches!(ev, DataEvent::Chunk(_));
        if tx.send(ev).await.is_err() || last {
            return;
        }
    }
}

fn fr_peer(fr: &FramedRecv) -> SocketAddr {
    fr.peer()
}
