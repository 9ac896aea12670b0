//! [`RemotePrefiller`]: routes prompts to the prefill node or to the local engine, streams and
//! stages the returned state, and falls back to a local prefill whenever the node cannot be used
//! — unreachable, unpaired, another model, refusing, or failing mid-transfer. The user gets the
//! same answer either way, and a log line saying why.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use k3_protocol::config::TextConfig;
use k3_protocol::transport::{NodeConfig, NodeRole, Pairing, PrefillClient, TransferError, TransferEvent, Tuning};
use k3_protocol::wire::{ErrorCode, ImageEmbeddings, PrefillOptions, PrefillRequest, StateLayout};

use crate::decode::{Engine, ImageEmbeds};
use crate::decode_loop::{GenerateOutput, GenerateParams};
use crate::ingest::StagedDelta;
use crate::remote::conversation::{Conversation, RemotePlan};
use crate::remote::route::{Outcome, RoutePolicy, Router};
use crate::remote::timing::{CompatibleSource, Route, TurnTiming};

/// How the decoder reaches its prefill node, and when it uses it.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// `HOST:PORT` of the prefill node.
    pub node: String,
    /// `--insecure-dev`: no certificate pinning (loopback only).
    pub insecure_dev: bool,
    /// `--accept-compatible-states`: use states from a node whose model differs from ours but
    /// has the same state identity (e.g. the full model this pruned one was made from).
    pub accept_compatible_states: bool,
    /// Pin these prefill-node certificates (`sha256:...`), saved in the decoder's pinned peers.
    pub prefill_fingerprints: Vec<String>,
    /// The decoder's certificate and pinned peers (default `~/.config/k3-offload/decoder`).
    pub config_dir: Option<PathBuf>,
    /// `--remote-min-tokens`: prompts with at least this many new tokens go to the node, shorter
    /// ones stay local (the manual override). None: route by predicted time (`route`).
    pub min_tokens: Option<usize>,
    /// Cost-based routing: margin, default local rate, calibration.
    pub route: RoutePolicy,
    /// Give up connecting after this long.
    pub connect_timeout: Duration,
    /// After the node could not be reached, prefill locally for this long before trying again.
    pub retry_after: Duration,
    /// Parallel data streams and chunk size asked for.
    pub streams: u16,
    pub chunk_bytes: u32,
    /// QUIC timeouts and windows.
    pub tuning: Tuning,
    /// The tokio runtime the client's network runs on (`k3-decode serve` gives its own: one
    /// runtime per process); `None`: the prefiller starts a small one of its own.
    pub runtime: Option<tokio::runtime::Handle>,
}

impl RemoteOptions {
    pub fn new(node: impl Into<String>) -> RemoteOptions {
        RemoteOptions {
            node: node.into(),
            insecure_dev: false,
            accept_compatible_states: false,
            prefill_fingerprints: Vec::new(),
            config_dir: None,
            min_tokens: None,
            route: RoutePolicy::default(),
            connect_timeout: Duration::from_secs(5),
            retry_after: Duration::from_secs(30),
            streams: 4,
            chunk_bytes: 1 << 20,
            tuning: Tuning { idle_timeout: Duration::from_secs(15), ..Tuning::default() },
            runtime: None,
        }
    }
}

/// A connection that failed in a way that will not heal by itself soon.
struct Down {
    since: Instant,
    reason: String,
    /// The node was refused for running a state-compatible other model.
    compatible_refused: bool,
}

/// The runtime a [`RemotePrefiller`] blocks on: the process's ([`RemoteOptions::runtime`]) or
/// one of its own.
enum ClientRuntime {
    Shared(tokio::runtime::Handle),
    Owned(tokio::runtime::Runtime),
}

impl ClientRuntime {
    fn handle(&self) -> &tokio::runtime::Handle {
        match self {
            ClientRuntime::Shared(h) => h,
            ClientRuntime::Owned(rt) => rt.handle(),
        }
    }
}

/// The prefill client of one decoder. Runs its network on a tokio runtime
/// ([`RemoteOptions::runtime`], else its own); call it from a plain thread (the engine's
/// thread), not from inside a tokio runtime.
pub struct RemotePrefiller {
    rt: ClientRuntime,
    opts: RemoteOptions,
    /// `Err`: why the node can never be used (pairing), kept for every attempt's fallback reason.
    node_cfg: std::result::Result<NodeConfig, Arc<anyhow::Error>>,
    text_config: TextConfig,
    media_token: u32,
    client: Option<PrefillClient>,
    down: Option<Down>,
    /// Set by the owner when the request being prefilled is abandoned (its client went away).
    cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    router: Router,
}

/// A failed remote attempt: why, and whether the node's prefix for this conversation is gone.
struct Failure {
    reason: String,
    base_not_held: bool,
    /// The node runs a state-compatible other model, refused without `--accept-compatible-states`.
    compatible_refused: bool,
}

impl Failure {
    fn new(reason: impl Into<String>) -> Failure {
        Failure { reason: reason.into(), base_not_held: false, compatible_refused: false }
    }
}

/// Why [`RemotePrefiller::prefill`] gave up without a fallback: the request was abandoned.
#[derive(Debug, thiserror::Error)]
#[error("prefill cancelled: {0}")]
pub struct Cancelled(pub String);

const CANCELLED: &str = "the request was cancelled";

impl From<TransferError> for Failure {
    fn from(e: TransferError) -> Failure {
        let base_not_held = matches!(&e, TransferError::Refused { code: ErrorCode::BaseNotHeld, .. });
        let compatible_refused = matches!(&e, TransferError::CompatibleModelNotAccepted { .. });
        Failure { reason: e.to_string(), base_not_held, compatible_refused }
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Failure {
        Failure::new(format!("{e:#}"))
    }
}

/// The decoder's pairing set-up: its config dir and the `--prefill-fingerprint` values, which
/// REPLACE the saved pins for this run and are saved once a node proved it holds one
/// ([`Pairing`]).
pub(crate) fn pairing(opts: &RemoteOptions) -> Result<Pairing> {
    Ok(Pairing::new(NodeRole::Decoder, opts.config_dir.clone(), &opts.prefill_fingerprints, opts.insecure_dev)?)
}

/// The decoder's identity and who it trusts, from its config dir and the options.
fn node_config(engine: &Engine, opts: &RemoteOptions) -> Result<NodeConfig> {
    let pairing = pairing(opts)?;
    let identity = pairing.identity()?;
    let peers = pairing.peer_auth().map_err(|e| anyhow!("{e:#}; this decoder's certificate is {}", identity.fingerprint()))?;
    tracing::info!(certificate = %identity.fingerprint(), "decoder identity (give it to the prefill node with --decoder-fingerprint)");
    let mut cfg = NodeConfig::new(identity, peers, *engine.fingerprint(), "mlx").with_state_identity(*engine.state_identity());
    cfg.tuning = opts.tuning.clone();
    Ok(cfg)
}

impl RemotePrefiller {
    /// A prefiller for `engine`'s model. Pairing problems do not fail here: every remote attempt
    /// then falls back with the reason.
    ///
    /// Measures this decoder's local prefill rate here, at start (a short calibration prefill,
    /// `RoutePolicy::calibration_tokens`), so that the first routing decision and every
    /// predicted local time use it instead of the configured default, and no turn's clock pays
    /// for it.
    pub fn new(engine: &Engine, opts: RemoteOptions) -> Result<RemotePrefiller> {
        let cfg = node_config(engine, &opts).map_err(Arc::new);
        if let Err(e) = &cfg {
            tracing::warn!("the prefill node cannot be used: {e:#}");
        }
        let mut p = Self::build(engine, opts, cfg)?;
        if p.node_cfg.is_ok() {
            p.calibrate(engine);
        }
        Ok(p)
    }

    /// With an explicit node config (tests: fault hooks, generated identities).
    pub fn with_node_config(engine: &Engine, opts: RemoteOptions, cfg: NodeConfig) -> Result<RemotePrefiller> {
        Self::build(engine, opts, Ok(cfg))
    }

    fn build(engine: &Engine, opts: RemoteOptions, mut node_cfg: std::result::Result<NodeConfig, Arc<anyhow::Error>>) -> Result<RemotePrefiller> {
        if let Ok(cfg) = node_cfg.as_mut() {
            cfg.accept_compatible_states = opts.accept_compatible_states;
        }
        let rt = match &opts.runtime {
            Some(h) => ClientRuntime::Shared(h.clone()),
            None => ClientRuntime::Owned(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("prefill-client")
                    .enable_all()
                    .build()
                    .context("starting the prefill client's runtime")?,
            ),
        };
        Ok(RemotePrefiller {
            rt,
            node_cfg,
            text_config: engine.text_config().clone(),
            media_token: engine.config().media_placeholder_token_id,
            client: None,
            down: None,
            cancel: None,
            router: Router::new(RoutePolicy { min_tokens: opts.min_tokens, ..opts.route.clone() }),
            opts,
        })
    }

    /// The flag that cancels the prefill in progress: checked every 50 ms during a remote
    /// transfer, which is then cancelled on the node too (its worker stops before its next token
    /// chunk). A cancelled prefill returns [`Cancelled`] and does not fall back to a local
    /// prefill. `None` removes it.
    pub fn set_cancel(&mut self, flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>) {
        self.cancel = flag;
    }

    fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
    }

    pub fn options(&self) -> &RemoteOptions {
        &self.opts
    }

    /// Changes the manual override (`--remote-min-tokens`): `Some(n)` sends turns of at least `n`
    /// new tokens to the node, `None` routes by predicted time.
    pub fn set_min_tokens(&mut self, min_tokens: Option<usize>) {
        self.opts.min_tokens = min_tokens;
        self.router.policy.min_tokens = min_tokens;
    }

    /// The routing state: local rate, tail, predicted against measured times.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The node's current cost, connecting first if needed (None: it cannot be reached).
    fn node_cost(&mut self) -> std::result::Result<k3_protocol::wire::NodeCost, Failure> {
        let cfg = self.node_cfg.as_ref().map_err(|e| Failure::new(format!("{e:#}")))?.clone();
        let opts = self.opts.clone();
        let slot = &mut self.client;
        let r = self.rt.handle().block_on(async {
            Self::connect(&opts, &cfg, slot).await?;
            slot.as_mut().expect("connected above").query_cost().await.map_err(classify)
        });
        r.map_err(|(f, sev)| {
            if sev != Severity::Keep {
                self.client = None;
            }
            if sev == Severity::Down {
                self.down = Some(Down { since: Instant::now(), reason: f.reason.clone(), compatible_refused: f.compatible_refused });
            }
            f
        })
    }

    /// A first measurement of the local rate: a short prefill on a scratch conversation, timed
    /// on its second run. The first, untimed, run of the same tokens pays what a cold engine pays
    /// once — kernel compilation, allocation, and the lazy weights (MLX evaluates a dequantized
    /// expert when a token first reaches it; the same tokens reach the same experts) — which
    /// later prefills do not (an 8-token warm-up reaches too few experts of a 64-expert model
    /// to take that cost, and the cold 128-token rate came out several times too slow).
    fn calibrate(&mut self, engine: &Engine) {
        let n = self.router.policy.calibration_tokens;
        if n == 0 || self.router.local_measured() {
            return;
        }
        let vocab = engine.text_config().vocab_size.max(2) as u32;
        let ids: Vec<u32> = (0..n as u32).map(|i| 1 + (i * 7919) % (vocab - 1)).filter(|&t| t != self.media_token).collect();
        let t = Instant::now();
        if let Err(e) = Conversation::new(engine).and_then(|mut c| c.prefill_local(engine, &ids, None)) {
            tracing::warn!("local prefill warm-up failed: {e:#}");
        }
        let cold_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        match Conversation::new(engine).and_then(|mut c| c.prefill_local(engine, &ids, None)) {
            Ok(_) => {
                let s = t.elapsed().as_secs_f64();
                self.router.record_local(ids.len() as u64, 0, s);
                tracing::info!(
                    tokens = ids.len(),
                    seconds = format!("{s:.3}"),
                    tok_per_s = format!("{:.1}", ids.len() as f64 / s),
                    cold_seconds = format!("{cold_s:.3}"),
                    "local prefill rate calibrated (the second of two runs)"
                );
            }
            Err(e) => tracing::warn!("local prefill calibration failed: {e:#}; using the default rate"),
        }
    }

    /// Backend and name of the connected node, if connected.
    pub fn node(&self) -> Option<(String, String)> {
        self.client.as_ref().map(|c| (c.server().node_name.clone(), c.server().capabilities.backend.clone()))
    }

    /// Prefills `tokens` (the new tokens of a turn, after everything the conversation holds):
    /// remotely when there are at least `min_tokens` of them and the node works, else locally.
    /// Errors only when the local prefill fails too.
    pub fn prefill(&mut self, engine: &Engine, conv: &mut Conversation, tokens: &[u32], image: Option<&ImageEmbeds>) -> Result<TurnTiming> {
        let t0 = Instant::now();
        let mut timing = TurnTiming { prompt_tokens: tokens.len(), ..Default::default() };
        let manual_local = self.opts.min_tokens.filter(|&m| tokens.len() < m);
        let why_local = if let Some(m) = manual_local {
            Some((Route::Local, format!("{} new tokens, below --remote-min-tokens {m}", tokens.len())))
        } else if let Err(e) = &self.node_cfg {
            Some((Route::Fallback, format!("{e:#}")))
        } else if let Some(d) = self.down.as_ref().filter(|d| d.since.elapsed() < self.opts.retry_after) {
            timing.compatible_source = d.compatible_refused.then_some(CompatibleSource::Refused);
            Some((
                Route::Fallback,
                format!(
                    "prefill node {} failed {:.0} s ago ({}); retrying after {:.0} s",
                    self.opts.node,
                    d.since.elapsed().as_secs_f64(),
                    d.reason,
                    self.opts.retry_after.as_secs_f64()
                ),
            ))
        } else {
            None
        };
        if let Some((route, reason)) = why_local {
            if route == Route::Fallback {
                tracing::warn!("prefilling locally: {reason}");
            } else {
                tracing::info!("prefilling locally: {reason}");
            }
            return self.local(engine, conv, tokens, image, timing, route, reason, t0);
        }
        if self.cancelled() {
            return Err(Cancelled(CANCELLED.into()).into());
        }
        // The route by predicted time (or the manual threshold, which is met here).
        let local_n = (tokens.len() as u64, conv.session().tokens() as u64);
        let remote_n = match conv.plan_remote(tokens, self.media_token) {
            Ok(p) => (p.tokens.len() as u64, p.base.as_ref().map_or(0, |b| b.tokens)),
            Err(_) => local_n,
        };
        let cost = if self.opts.min_tokens.is_none() {
            self.calibrate(engine);
            match self.node_cost() {
                Ok(c) => Some(c),
                Err(f) => {
                    timing.compatible_source = f.compatible_refused.then_some(CompatibleSource::Refused);
                    let reason = format!("prefill node {} cannot be asked for its cost: {}", self.opts.node, f.reason);
                    tracing::warn!("prefilling locally: {reason}");
                    return self.local(engine, conv, tokens, image, timing, Route::Fallback, reason, t0);
                }
            }
        } else {
            self.client.as_ref().map(|c| c.cost().clone())
        };
        let d = self.router.decide(local_n, remote_n, cost.as_ref());
        timing.predicted_local_s = Some(d.local_s);
        timing.predicted_remote_s = d.remote_s;
        tracing::info!(
            route = if d.remote { "remote" } else { "local" },
            new_tokens = tokens.len(),
            local_s = format!("{:.3}", d.local_s),
            remote_s = d.remote_s.map(|v| format!("{v:.3}")).unwrap_or_default(),
            "routing: {}",
            d.reason
        );
        if !d.remote {
            return self.local(engine, conv, tokens, image, timing, Route::Local, d.reason, t0);
        }
        timing.reason = d.reason;
        let attempt = Instant::now();
        let mut r = self.remote(engine, conv, tokens, image, &mut timing);
        if matches!(&r, Err(f) if f.reason == CANCELLED) {
            tracing::info!(node = %self.opts.node, "remote prefill cancelled: the request was abandoned");
            return Err(Cancelled(CANCELLED.into()).into());
        }
        if let Err(f) = &r {
            if f.base_not_held && conv.remote_prefix_tokens() > 0 {
                tracing::info!("the prefill node no longer holds this conversation ({}); resending all of it", f.reason);
                conv.drop_remote();
                r = self.remote(engine, conv, tokens, image, &mut timing);
            }
        }
        match r {
            Ok(()) => {
                timing.route = Route::Remote;
                timing.prefill_s = t0.elapsed().as_secs_f64();
                timing.context_tokens = conv.session().tokens();
                if let Some(tail) = timing.exposed_tail_s {
                    self.router.record_tail(tail);
                }
                if let Some(p) = timing.predicted_remote_s {
                    // From the request on (the cost query and calibration are not the node's time).
                    let measured_s = attempt.elapsed().as_secs_f64();
                    self.router.record_outcome(Outcome { remote: true, predicted_s: p, measured_s });
                }
                Ok(timing)
            }
            Err(f) => {
                let reason = format!("remote prefill on {} failed: {}", self.opts.node, f.reason);
                tracing::warn!("{reason}; prefilling locally instead");
                timing = TurnTiming {
                    prompt_tokens: tokens.len(),
                    failed_attempt_s: Some(attempt.elapsed().as_secs_f64()),
                    compatible_source: f.compatible_refused.then_some(CompatibleSource::Refused),
                    ..Default::default()
                };
                self.local(engine, conv, tokens, image, timing, Route::Fallback, reason, t0)
            }
        }
    }

    fn local(
        &mut self,
        engine: &Engine,
        conv: &mut Conversation,
        tokens: &[u32],
        image: Option<&ImageEmbeds>,
        mut timing: TurnTiming,
        route: Route,
        reason: String,
        t0: Instant,
    ) -> Result<TurnTiming> {
        let t = Instant::now();
        let base = conv.session().tokens() as u64;
        conv.prefill_local(engine, tokens, image)?;
        let s = t.elapsed().as_secs_f64();
        timing.local_prefill_s = Some(s);
        if let Some(p) = timing.predicted_local_s {
            self.router.record_outcome(Outcome { remote: false, predicted_s: p, measured_s: s });
        }
        self.router.record_local(tokens.len() as u64, base, s);
        timing.route = route;
        timing.reason = reason;
        timing.prefill_tokens = tokens.len();
        timing.context_tokens = conv.session().tokens();
        timing.prefill_s = t0.elapsed().as_secs_f64();
        Ok(timing)
    }

    /// Connects if needed.
    async fn connect(opts: &RemoteOptions, cfg: &NodeConfig, client: &mut Option<PrefillClient>) -> std::result::Result<(), (Failure, Severity)> {
        if client.is_some() {
            return Ok(());
        }
        let addr: SocketAddr = opts
            .node
            .to_socket_addrs()
            .map_err(|e| (Failure::new(format!("cannot resolve {}: {e}", opts.node)), Severity::Down))?
            .next()
            .ok_or_else(|| (Failure::new(format!("{} resolves to no address", opts.node)), Severity::Down))?;
        let c = match tokio::time::timeout(opts.connect_timeout, PrefillClient::connect(addr, cfg.clone())).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(classify(e)),
            Err(_) => {
                let reason = format!("cannot reach {addr}: no answer within {:.1} s", opts.connect_timeout.as_secs_f64());
                return Err((Failure::new(reason), Severity::Down));
            }
        };
        if let Some(cert) = c.server().certificate {
            if let Err(e) = pairing(opts).and_then(|p| Ok(p.save_verified(cert)?)) {
                tracing::warn!("could not save the verified prefill pin: {e:#}");
            }
        }
        *client = Some(c);
        Ok(())
    }

    /// One remote attempt; on success the conversation holds the new state.
    fn remote(
        &mut self,
        engine: &Engine,
        conv: &mut Conversation,
        tokens: &[u32],
        image: Option<&ImageEmbeds>,
        timing: &mut TurnTiming,
    ) -> std::result::Result<(), Failure> {
        let cfg = self.node_cfg.as_ref().map_err(|e| Failure::new(format!("{e:#}")))?.clone();
        let plan = conv.plan_remote(tokens, self.media_token)?;
        let image_embeddings = image_rows(engine, &plan, tokens, image)?;
        let c = &self.text_config;
        let request = PrefillRequest {
            session: conv.id(),
            base: plan.base.clone(),
            tokens: plan.tokens.clone(),
            image_embeddings,
            options: PrefillOptions { keep_session: true, return_last_logits: true, streams: self.opts.streams, chunk_bytes: self.opts.chunk_bytes },
        };
        let expected = StateLayout::for_model(c, plan.tokens.len());
        let mut staged = StagedDelta::new(c, plan.tokens.len());
        let opts = self.opts.clone();
        let client_slot = &mut self.client;
        let cancel = self.cancel.clone();
        let is_cancelled = move || cancel.as_ref().is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed));
        // The queue rule: a request the node has not started (no progress yet) once this
        // decoder could have prefilled the turn itself is taken back and prefilled here.
        let queue_limit = queue_limit(self.router.local_s(tokens.len() as u64, conv.session().tokens() as u64));
        let sent_at = Instant::now();
        let outcome: std::result::Result<Received, (Failure, Severity)> = self.rt.handle().block_on(async {
            Self::connect(&opts, &cfg, client_slot).await?;
            let client = client_slot.as_mut().expect("connected above");
            let rtt = client.stats().path.rtt;
            let mut transfer = client.prefill(request, &expected).await.map_err(classify)?;
            let accepted_at = Instant::now();
            let mut started = false;
            let mut ingest = Duration::ZERO;
            let mut last_layer_done: Option<Instant> = None;
            loop {
                // The next event, unless the request is abandoned or has waited too long in the
                // node's queue first (both checked every 50 ms; the transfer is then given up,
                // so `next` being dropped midway does not matter).
                let deadline = (!started).then(|| accepted_at + queue_limit);
                let watch = async {
                    loop {
                        if is_cancelled() {
                            return None;
                        }
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            return Some(accepted_at.elapsed());
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                };
                let ev = tokio::select! {
                    ev = transfer.next() => ev.map_err(classify)?,
                    waited = watch => {
                        let Some(waited) = waited else {
                            transfer.cancel(CANCELLED).await;
                            return Err((Failure::new(CANCELLED), Severity::Keep));
                        };
                        let reason = format!(
                            "waited {:.1} s in the node's queue, longer than a local prefill of this turn ({:.1} s predicted)",
                            waited.as_secs_f64(),
                            queue_limit.as_secs_f64()
                        );
                        transfer.cancel(&reason).await;
                        return Err((Failure::new(reason), Severity::Keep));
                    }
                };
                match ev {
                    Some(TransferEvent::Layer { layer, state }) => {
                        started = true;
                        let t = Instant::now();
                        staged.stage(layer as usize, &state).map_err(|e| (Failure::from(e.context("staging a layer")), Severity::Reconnect))?;
                        ingest += t.elapsed();
                    }
                    Some(TransferEvent::Progress(p)) => {
                        // the node started the request (a node sends progress 0 when it does)
                        started = true;
                        if p.layers_done >= p.layers_total {
                            last_layer_done = Some(Instant::now());
                        }
                    }
                    Some(TransferEvent::Done(summary)) => {
                        return Ok(Received { summary, ingest, last_layer_done, rtt });
                    }
                    None => return Err((Failure::new("the transfer ended without Done"), Severity::Reconnect)),
                }
            }
        });
        let got = match outcome {
            Ok(g) => g,
            Err((f, sev)) => {
                if sev != Severity::Keep {
                    self.client = None;
                }
                if sev == Severity::Down {
                    self.down = Some(Down { since: Instant::now(), reason: f.reason.clone(), compatible_refused: f.compatible_refused });
                }
                return Err(f);
            }
        };
        self.down = None;
        // A node past the handshake with another fingerprint runs a state-compatible model that
        // this decoder was told to accept (the transport refuses it otherwise).
        let source = self.client.as_ref().map(|c| c.server().model_fingerprint).filter(|fp| *fp != cfg.model_fingerprint);
        timing.compatible_source = source.map(|_| CompatibleSource::Accepted);
        let transfer_s = sent_at.elapsed().as_secs_f64();
        let logits = got.summary.last_logits.clone().ok_or_else(|| Failure::new("the prefill node sent no last logits"))?;
        let t = Instant::now();
        conv.commit_remote(c, &plan, tokens, staged, logits)?;
        let usable = Instant::now();
        let ingest = got.ingest + t.elapsed();
        timing.prefill_tokens = plan.tokens.len();
        timing.remote_compute_s = Some(got.summary.server_timing.compute_s);
        timing.transfer_s = Some(transfer_s);
        timing.exposed_tail_s = got.last_layer_done.map(|d| (usable - d + got.rtt / 2).as_secs_f64());
        timing.ingest_s = Some(ingest.as_secs_f64());
        timing.state_bytes = got.summary.state_bytes;
        tracing::info!(
            node = %self.opts.node,
            base = plan.base.as_ref().map_or(0, |b| b.tokens),
            tokens = plan.tokens.len(),
            compute_s = format!("{:.3}", got.summary.server_timing.compute_s),
            transfer_s = format!("{transfer_s:.3}"),
            tail_s = timing.exposed_tail_s.map(|v| format!("{v:.3}")).unwrap_or_default(),
            mb = format!("{:.2}", got.summary.state_bytes as f64 / 1e6),
            source_model = source.map(|f| f.short()).unwrap_or_else(|| "this model".into()),
            "remote prefill ingested"
        );
        Ok(())
    }
}

impl Drop for RemotePrefiller {
    /// Says goodbye to the node (it would otherwise keep the connection until its idle timeout).
    /// The goodbye runs as a task of the runtime, waited for at most 2 s outside a runtime: a
    /// shared runtime may be shutting down (then the task never runs) while the engine drops.
    fn drop(&mut self) {
        if let Some(c) = self.client.take() {
            let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
            self.rt.handle().spawn(async move {
                c.close().await;
                let _ = done_tx.send(());
            });
            if tokio::runtime::Handle::try_current().is_err() {
                let _ = done_rx.recv_timeout(Duration::from_secs(2));
            }
        }
    }
}

/// The shortest wait in the node's queue that makes a turn fall back (scheduling jitter on a
/// loaded host must not send short turns local).
const QUEUE_LIMIT_FLOOR: Duration = Duration::from_secs(2);

/// How long a turn may wait in the node's queue (accepted, not started) before it is taken back
/// and prefilled locally: its predicted local prefill time, at least [`QUEUE_LIMIT_FLOOR`]. Past
/// it a local prefill would already be done; the turn then takes at most about twice its local
/// time, however long the node's queue.
pub(crate) fn queue_limit(local_s: f64) -> Duration {
    let s = if local_s > 0.0 { local_s.min(86_400.0) } else { 0.0 }; // NaN: not > 0
    Duration::from_secs_f64(s).max(QUEUE_LIMIT_FLOOR)
}

/// What a finished transfer brought.
struct Received {
    summary: k3_protocol::transport::TransferSummary,
    ingest: Duration,
    last_layer_done: Option<Instant>,
    rtt: Duration,
}

/// What a failure means for the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Severity {
    /// The node answered (a refusal): keep the connection.
    Keep,
    /// This transfer broke: reconnect next time.
    Reconnect,
    /// The node cannot be used (unreachable, unpaired, another model): stay local for a while.
    Down,
}

/// A transfer error and what it means for the connection.
fn classify(e: TransferError) -> (Failure, Severity) {
    use TransferError as T;
    let sev = match &e {
        T::Refused { .. } => Severity::Keep,
        T::Connect { .. }
        | T::ConnectionLost { .. }
        | T::Stalled { .. }
        | T::FingerprintMismatch { .. }
        | T::CompatibleModelNotAccepted { .. }
        | T::VersionMismatch { .. }
        | T::PeerCertificateNotPinned { .. }
        | T::CertificateRefusedByPeer { .. }
        | T::InsecureNotLoopback(_)
        | T::Identity(_) => Severity::Down,
        _ => Severity::Reconnect,
    };
    (e.into(), sev)
}

/// Image rows for the request: the decoder's local merge puts image row k at the k-th
/// `<|media_pad|>` of the new tokens and zeroes `pad_token_id` positions when an image is
/// given; the node gets exactly those rows as embedding overrides.
fn image_rows(engine: &Engine, plan: &RemotePlan, new: &[u32], image: Option<&ImageEmbeds>) -> Result<Option<ImageEmbeddings>> {
    let cfg = engine.config();
    let h = engine.text_config().hidden_size;
    let pads: Vec<usize> = (0..new.len()).filter(|&i| new[i] == cfg.media_placeholder_token_id).collect();
    let Some(img) = image else {
        if !pads.is_empty() {
            anyhow::bail!("the prompt holds {} media placeholder token(s) but no image embeddings were given", pads.len());
        }
        return Ok(None);
    };
    if img.rows != pads.len() || img.data.len() != img.rows * h {
        anyhow::bail!("{} image embedding rows ({} values) for {} media placeholder tokens of width {h}", img.rows, img.data.len(), pads.len());
    }
    let mut positions = Vec::new();
    let mut rows = Vec::new();
    for (k, &p) in pads.iter().enumerate() {
        positions.push((plan.new_offset + p) as u32);
        rows.extend_from_slice(&img.data[k * h..(k + 1) * h]);
    }
    for (i, &t) in new.iter().enumerate() {
        if t == cfg.pad_token_id && t != cfg.media_placeholder_token_id {
            positions.push((plan.new_offset + i) as u32);
            rows.extend(std::iter::repeat_n(0.0, h));
        }
    }
    Ok(Some(ImageEmbeddings { positions, width: h as u32, rows }))
}

/// One chat turn: prefill `prompt` (routed, with fallback), then generate. `remote` None means
/// no prefill node is configured. `on_token` sees each token as it is sampled (return false to
/// stop). The timing covers the whole turn.
pub fn run_turn(
    engine: &Engine,
    conv: &mut Conversation,
    remote: Option<&mut RemotePrefiller>,
    prompt: &[u32],
    image: Option<&ImageEmbeds>,
    params: &GenerateParams,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<(GenerateOutput, TurnTiming)> {
    let t0 = Instant::now();
    let mut timing = match remote {
        Some(r) => r.prefill(engine, conv, prompt, image)?,
        None => {
            let t = Instant::now();
            conv.prefill_local(engine, prompt, image)?;
            let s = t.elapsed().as_secs_f64();
            TurnTiming {
                route: Route::Local,
                reason: "no prefill node configured".into(),
                prompt_tokens: prompt.len(),
                prefill_tokens: prompt.len(),
                context_tokens: conv.session().tokens(),
                local_prefill_s: Some(s),
                prefill_s: s,
                ..Default::default()
            }
        }
    };
    let mut first: Option<f64> = None;
    let out = conv.generate(engine, params, |tok| {
        first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        on_token(tok)
    })?;
    timing.first_token_s = first;
    timing.decode_tokens = out.tokens.len();
    timing.decode_tok_per_s = (!out.tokens.is_empty()).then(|| out.tokens_per_second());
    Ok((out, timing))
}

#[cfg(test)]
mod queue_tests {
    use super::*;

    /// The queue rule: a turn waits in the node's queue at most its predicted local prefill
    /// time, and never less than the floor (nor forever on a nonsense prediction).
    #[test]
    fn a_queued_turn_waits_at_most_its_local_time_and_at_least_the_floor() {
        assert_eq!(queue_limit(7.5), Duration::from_secs_f64(7.5));
        assert_eq!(queue_limit(0.1), QUEUE_LIMIT_FLOOR);
        for bad in [f64::NAN, -1.0, 0.0] {
            assert_eq!(queue_limit(bad), QUEUE_LIMIT_FLOOR, "{bad}");
        }
        assert_eq!(queue_limit(f64::INFINITY), Duration::from_secs(86_400));
    }
}

#[cfg(test)]
mod pin_tests {
    use super::*;
    use k3_protocol::transport::{CertFingerprint, PeerAuth, PinnedPeers};

    fn fp(b: u8) -> CertFingerprint {
        CertFingerprint::parse(&format!("sha256:{}", hex_byte(b).repeat(32))).unwrap()
    }
    fn hex_byte(b: u8) -> String {
        format!("{b:02x}")
    }

    /// Issue 21: after one pairing, `--prefill-fingerprint <other>` still trusted the old node,
    /// and the new (unverified) value was appended to pinned-peers.txt.
    #[test]
    fn an_explicit_prefill_fingerprint_replaces_the_saved_pins_and_is_saved_only_once_verified() {
        let dir = tempfile::tempdir().unwrap();
        let old = fp(0xaa);
        let new = fp(0xbb);
        PinnedPeers::default().add_and_save(dir.path(), old, "prefill").unwrap();
        let mut opts = RemoteOptions::new("127.0.0.1:1");
        opts.config_dir = Some(dir.path().to_path_buf());
        // Saved pins alone: the old node is trusted.
        assert_eq!(pairing(&opts).unwrap().peer_auth().unwrap(), PeerAuth::Pinned(vec![old]));
        // An explicit pin replaces them for this run...
        opts.prefill_fingerprints = vec![new.to_string()];
        assert_eq!(pairing(&opts).unwrap().peer_auth().unwrap(), PeerAuth::Pinned(vec![new]));
        // ...and is not written before a node proved it holds that certificate.
        assert_eq!(PinnedPeers::load(dir.path()).unwrap().fingerprints(), vec![old]);
        // A node presenting another certificate never changes the file.
        assert!(!pairing(&opts).unwrap().save_verified(old).unwrap());
        assert_eq!(PinnedPeers::load(dir.path()).unwrap().fingerprints(), vec![old]);
        // The verified one replaces the old prefill pin.
        assert!(pairing(&opts).unwrap().save_verified(new).unwrap());
        assert_eq!(PinnedPeers::load(dir.path()).unwrap().fingerprints(), vec![new]);
        // A malformed value is an error, not a pin.
        opts.prefill_fingerprints = vec!["sha256:000".into()];
        assert!(pairing(&opts).is_err());
    }
}
