//! The prefill node's layer sender: an accepted request's data streams, the writers that put
//! each layer's state chunks on them, the watch on the decoder's control stream (cancel,
//! `Received`), the heartbeat, and `Done` with the totals the decoder checks.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch, Mutex};
use tokio::task::{JoinHandle, JoinSet};

use crate::handoff::LayerState;
use crate::transport::config::NodeConfig;
use crate::transport::error::{connection_lost, TransferError};
use crate::transport::framed::{finish_and_flush, write_error, write_message, FramedRecv, CANCEL_CODE};
#[cfg(feature = "fault-injection")]
use crate::transport::hooks::{self, ChunkPlan, Fault, FaultHooks};
use crate::wire::chunker::{chunk_payload, plan_layer, ChunkSpec};
use crate::wire::frame::{ChunkHeader, CHUNK_HEADER_LEN, FRAME_HEADER_LEN};
use crate::wire::{Done, ErrorCode, ErrorMsg, Message, Progress, StateLayout, Timing};

impl LayerSender {
    /// Opens the data streams of an accepted request (its `Accepted` already written on
    /// `send`) and starts the writers, the watch on the decoder's control stream and the
    /// heartbeat.
    pub(crate) async fn open(
        conn: quinn::Connection,
        send: quinn::SendStream,
        recv: FramedRecv,
        cfg: &NodeConfig,
        id: u64,
        peer: SocketAddr,
        // The decoder's largest frame (the oversize fault writes one past it).
        #[cfg_attr(not(feature = "fault-injection"), allow(unused_variables))] max_frame: u32,
        layout: StateLayout,
        streams: u16,
        chunk_bytes: u32,
    ) -> Result<LayerSender, TransferError> {
        let tuning = &cfg.tuning;
        let shared = Arc::new(Shared::new());
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>(2 * streams as usize);
        let jobs_rx = Arc::new(Mutex::new(jobs_rx));
        let mut writers = JoinSet::new();
        for index in 0..streams {
            let mut s = conn.open_uni().await.map_err(|e| connection_lost(peer, &e))?;
            write_message(&mut s, peer, &Message::DataStream { request: id, index }).await?;
            writers.spawn(writer(
                s,
                jobs_rx.clone(),
                WriterCtx {
                    request: id,
                    peer,
                    stall: tuning.stall_timeout,
                    #[cfg(feature = "fault-injection")]
                    max_frame,
                    shared: shared.clone(),
                },
            ));
        }
        let ctrl = Arc::new(Mutex::new(send));
        let watch_task = tokio::spawn(watch_client(recv, shared.clone(), peer, id));
        let (hb_stop, hb_rx) = watch::channel(false);
        let heartbeat = tokio::spawn(heartbeat(ctrl.clone(), hb_rx, tuning.heartbeat, id, peer));
        Ok(LayerSender {
            id,
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
            #[cfg(feature = "fault-injection")]
            hooks: cfg.hooks.clone(),
            #[cfg(feature = "fault-injection")]
            conn,
            stall: tuning.stall_timeout,
            chunks: 0,
            state_bytes: 0,
            send_wait: Duration::ZERO,
            #[cfg(feature = "fault-injection")]
            delayed: None,
            started: Instant::now(),
            aborted: false,
        })
    }
}

/// Why a transfer must stop: the first failure of any task, except that the decoder's own
/// `Abort` (its stated reason) replaces a data stream's stop, which a cancelling decoder causes
/// too and which can reach the writer first.
pub(crate) struct Shared {
    first: StdMutex<Option<(TransferError, bool)>>,
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
        self.record(e, false, false);
    }
    /// A data stream the decoder stopped reading: the transfer stops, and a reason the decoder
    /// sends on the request stream still takes its place.
    fn fail_stream_stopped(&self, e: TransferError) {
        self.record(e, true, false);
    }
    /// The decoder's `Abort` on the request stream.
    fn fail_peer_abort(&self, e: TransferError) {
        self.record(e, false, true);
    }
    fn record(&self, e: TransferError, stream_stop: bool, peer_abort: bool) {
        if let Ok(mut g) = self.first.lock() {
            let replace = match &*g {
                None => true,
                Some((_, was_stream_stop)) => *was_stream_stop && peer_abort,
            };
            if replace {
                *g = Some((e, stream_stop));
            }
        }
        let _ = self.stop.send_replace(true);
    }
    fn error(&self) -> Option<TransferError> {
        self.first.lock().ok().and_then(|g| g.as_ref().map(|(e, _)| e.clone()))
    }
}

struct Job {
    state: Arc<LayerState>,
    spec: ChunkSpec,
    #[cfg(feature = "fault-injection")]
    fault: Fault,
}

struct WriterCtx {
    request: u64,
    peer: SocketAddr,
    stall: Duration,
    #[cfg(feature = "fault-injection")]
    max_frame: u32,
    shared: Arc<Shared>,
}

/// One data stream: takes chunk jobs from the shared queue and writes them.
// `body` is a slice without the `fault-injection` feature and an owned buffer with it: the one
// `&body` serves both.
#[cfg_attr(not(feature = "fault-injection"), allow(clippy::needless_borrow))]
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
        #[cfg_attr(not(feature = "fault-injection"), allow(unused_mut))]
        let mut prefix = header.frame_prefix();
        #[cfg(feature = "fault-injection")]
        let Some(body) = hooks::apply(job.fault, &mut s, &mut prefix, payload, cx.max_frame).await
        else {
            // The fault ended the stream: keep taking jobs (and dropping them) as if it were fine.
            while let Some(_job) = jobs.lock().await.recv().await {}
            return;
        };
        #[cfg(not(feature = "fault-injection"))]
        let body = payload;
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
            Ok(Err(e @ quinn::WriteError::Stopped(_))) => return cx.shared.fail_stream_stopped(write_error(cx.peer, e)),
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
        Ok(Ok(Some(code))) => cx.shared.fail_stream_stopped(TransferError::Aborted {
            peer: cx.peer,
            code: ErrorCode::Cancelled,
            message: format!("the peer stopped a data stream (code {code})"),
        }),
        Ok(Err(quinn::StoppedError::ConnectionLost(e))) => cx.shared.fail(connection_lost(cx.peer, &e)),
        Ok(Err(e)) => cx.shared.fail(TransferError::Local(format!("data stream to {}: {e}", cx.peer))),
        Err(_) => cx.shared.fail(TransferError::Stalled { peer: cx.peer, what: "the peer acknowledging the last chunks".into(), secs: cx.stall.as_secs_f64() }),
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
            shared.fail_peer_abort(TransferError::Aborted { peer, code: e.code, message: e.message })
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
    #[cfg(feature = "fault-injection")]
    hooks: Arc<FaultHooks>,
    #[cfg(feature = "fault-injection")]
    conn: quinn::Connection,
    stall: Duration,
    chunks: u64,
    state_bytes: u64,
    send_wait: Duration,
    #[cfg(feature = "fault-injection")]
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

    /// Resolves, with the error, once the transfer has failed: the decoder cancelled or went
    /// away, the link was lost or stalled. Pending while the transfer is healthy, so a node can
    /// wait on it beside its compute and stop that compute as soon as nobody is waiting for it.
    pub async fn stopped(&self) -> TransferError {
        let mut stop = self.shared.stop.subscribe();
        let _ = stop.wait_for(|v| *v).await;
        self.shared.error().unwrap_or_else(|| TransferError::Cancelled("transfer stopped".into()))
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
            self.chunks += 1;
            self.state_bytes += spec.len as u64;
            #[cfg(feature = "fault-injection")]
            {
                let seq = self.chunks - 1;
                let (fault, duplicate, delay) = match self.hooks.chunk(seq) {
                    ChunkPlan::Close => {
                        tracing::warn!(seq, "test hook: closing the connection mid-transfer");
                        self.conn.close(quinn::VarInt::from_u32(9), b"test hook: connection dropped");
                        return Err(TransferError::Local("connection closed by a test hook".into()));
                    }
                    ChunkPlan::Drop => continue,
                    ChunkPlan::Send { fault, duplicate, delay } => (fault, duplicate, delay),
                };
                let job = Job { state: state.clone(), spec, fault };
                if duplicate {
                    self.push(Job { state: state.clone(), spec, fault }).await?;
                }
                if delay {
                    self.delayed = Some(job);
                    continue;
                }
                self.push(job).await?;
                if let Some(d) = self.delayed.take() {
                    self.push(d).await?;
                }
            }
            #[cfg(not(feature = "fault-injection"))]
            self.push(Job { state: state.clone(), spec }).await?;
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
        #[cfg(feature = "fault-injection")]
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
        #[cfg(feature = "fault-injection")]
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
