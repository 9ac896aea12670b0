//! Shared helpers of the QUIC tests: paired node configs, synthetic states generated on the
//! fly, a prefill-server task, and a userspace UDP relay that can cut the link.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k3_protocol::fingerprint::Fingerprint;
use k3_protocol::handoff::{HandoffState, KdaState, LayerState, MlaState};
use k3_protocol::transport::hooks::FaultHooks;
use k3_protocol::transport::*;
use k3_protocol::wire::*;
use tokio::task::JoinHandle;

pub(crate) const MODEL: Fingerprint = Fingerprint([0x4b; 32]);

pub(crate) use k3_protocol::process::init_test_logging as init_tracing;

/// Timeouts short enough for tests.
pub(crate) fn test_tuning() -> Tuning {
    Tuning {
        idle_timeout: Duration::from_secs(5),
        keep_alive: Duration::from_millis(500),
        heartbeat: Duration::from_millis(500),
        inactivity_timeout: Duration::from_secs(10),
        stall_timeout: Duration::from_secs(5),
        ..Tuning::default()
    }
}

/// Two configs that pin each other's certificates.
pub(crate) fn paired() -> (NodeConfig, NodeConfig) {
    let s = NodeIdentity::generate().unwrap();
    let c = NodeIdentity::generate().unwrap();
    let mut server = NodeConfig::new(s.clone(), PeerAuth::pinned(c.fingerprint()), MODEL, "cpu");
    let mut client = NodeConfig::new(c, PeerAuth::pinned(s.fingerprint()), MODEL, "mlx");
    server.node_name = "test-prefill".into();
    client.node_name = "test-decoder".into();
    server.tuning = test_tuning();
    client.tuning = test_tuning();
    (server, client)
}

pub(crate) fn with_hooks(mut cfg: NodeConfig, hooks: FaultHooks) -> NodeConfig {
    cfg.hooks = Arc::new(hooks);
    cfg
}

/// Deterministic finite values in [-0.5, 0.5) for (seed, layer, part).
pub(crate) fn fill(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32) * (1.0 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// A layer of `layout` filled from `seed`.
pub(crate) fn make_layer(layout: &LayerLayout, seed: u64) -> LayerState {
    match *layout {
        LayerLayout::Kda { heads, head_dim, window } => {
            let (h, d, w) = (heads as usize, head_dim as usize, window as usize);
            LayerState::Kda(KdaState {
                heads: h,
                head_dim: d,
                recurrent: fill(seed * 8 + 1, h * d * d),
                conv_q: fill(seed * 8 + 2, w * h * d),
                conv_k: fill(seed * 8 + 3, w * h * d),
                conv_v: fill(seed * 8 + 4, w * h * d),
            })
        }
        LayerLayout::Mla { width, rows } => LayerState::Mla(MlaState { width: width as usize, latent: fill(seed * 8 + 5, width as usize * rows as usize) }),
    }
}

/// A small K3-shaped layout: `kda` KDA layers then interleaved MLA layers of `rows` rows.
pub(crate) fn small_layout(rows: u64) -> StateLayout {
    let mut layers = Vec::new();
    for l in 0..9 {
        if l % 3 == 2 {
            layers.push(LayerLayout::Mla { width: 80, rows });
        } else {
            layers.push(LayerLayout::Kda { heads: 2, head_dim: 32, window: 3 });
        }
    }
    StateLayout { layers }
}

/// K3's real per-layer shapes (spec §4: 69 KDA layers [96,128,128] + conv windows 3×[3,12288],
/// 24 MLA layers of width 576, fp32), with the MLA row count chosen so the whole state is about
/// `bytes` (at least one row).
pub(crate) fn k3_layout_of_size(bytes: u64) -> StateLayout {
    let kda = LayerLayout::Kda { heads: 96, head_dim: 128, window: 3 };
    let kda_bytes = 69 * kda.nbytes().unwrap();
    let rows = (bytes.saturating_sub(kda_bytes) / (24 * 576 * 4)).max(1);
    let mla = LayerLayout::Mla { width: 576, rows };
    // K3: every 4th layer is MLA (3, 7, ..., 91) plus the last (92).
    let mut layers = Vec::new();
    let mut n_mla = 0;
    for l in 0..93 {
        if (l % 4 == 3 && n_mla < 23) || l == 92 {
            layers.push(mla);
            n_mla += 1;
        } else {
            layers.push(kda);
        }
    }
    StateLayout { layers }
}

pub(crate) fn state_of(layout: &StateLayout, seed: u64) -> HandoffState {
    HandoffState {
        tokens: layout.rows().unwrap_or(0) as usize,
        layers: layout.layers.iter().enumerate().map(|(l, ly)| make_layer(ly, seed * 1000 + l as u64)).collect(),
    }
}

pub(crate) fn request(tokens: usize, streams: u16, chunk_bytes: u32) -> PrefillRequest {
    PrefillRequest {
        session: SessionId::random(),
        base: None,
        tokens: (0..tokens as u32).collect(),
        image_embeddings: None,
        options: PrefillOptions { keep_session: false, return_last_logits: true, streams, chunk_bytes },
    }
}

/// What the test server does with each request.
#[derive(Clone)]
pub(crate) enum Behaviour {
    /// Send every layer of `state_of(layout, seed)`, layer by layer, with progress.
    Serve {
        seed: u64,
    },
    Refuse(ErrorCode),
    /// Abort after this many layers.
    AbortAfter(usize),
}

/// Spawns a server that serves one connection with `behaviour` for each request, returning
/// each request's outcome.
pub(crate) async fn spawn_server(cfg: NodeConfig, behaviour: Behaviour) -> (SocketAddr, Arc<PrefillServer>, JoinHandle<Vec<Result<Timing, TransferError>>>) {
    let server = Arc::new(PrefillServer::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap());
    let addr = server.local_addr();
    let srv = server.clone();
    let task = tokio::spawn(async move {
        let mut results = Vec::new();
        let mut conn = match srv.accept().await {
            Some(Ok(c)) => c,
            Some(Err(e)) => return vec![Err(e)],
            None => return results,
        };
        loop {
            let req = match conn.next_request().await {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    results.push(Err(e));
                    continue;
                }
            };
            let rows = req.request.tokens.len() as u64;
            let layout = small_or_bulk_layout(rows);
            results.push(serve_one(req, layout, behaviour.clone()).await);
        }
        results
    });
    (addr, server, task)
}

/// Requests of up to 100k tokens get `small_layout(tokens)`; bigger ones (bulk tests) name
/// the state size in MiB as their token count minus 100k, and get `k3_layout_of_size`.
pub(crate) fn small_or_bulk_layout(tokens: u64) -> StateLayout {
    if tokens <= 100_000 {
        small_layout(tokens)
    } else {
        k3_layout_of_size((tokens - 100_000) << 20)
    }
}

pub(crate) async fn serve_one(req: IncomingRequest, layout: StateLayout, behaviour: Behaviour) -> Result<Timing, TransferError> {
    match behaviour {
        Behaviour::Refuse(code) => {
            req.refuse(code, "test refusal").await?;
            Ok(Timing::default())
        }
        Behaviour::Serve { seed } => {
            let mut tx = req.accept(0, layout.clone()).await?;
            for (l, ly) in layout.layers.iter().enumerate() {
                tx.send_layer(l, make_layer(ly, seed * 1000 + l as u64)).await?;
                tx.progress(l as u32 + 1, 0.0).await?;
            }
            tx.finish(Timing { compute_s: 1.0, ..Timing::default() }, Some(vec![0.5, -0.25, 1.0])).await
        }
        Behaviour::AbortAfter(n) => {
            let mut tx = req.accept(0, layout.clone()).await?;
            for (l, ly) in layout.layers.iter().enumerate().take(n) {
                tx.send_layer(l, make_layer(ly, l as u64)).await?;
            }
            tx.abort(ErrorCode::Internal, "GPU fell over").await;
            Err(TransferError::Cancelled("aborted by the test".into()))
        }
    }
}

/// A UDP relay between a client and a server on loopback; `cut()` drops every packet from
/// then on (a pulled cable); `cut_after` cuts once that many bytes went server → client.
pub(crate) struct UdpRelay {
    pub addr: SocketAddr,
    pub cut: Arc<AtomicBool>,
    pub to_client: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Drop for UdpRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl UdpRelay {
    pub(crate) async fn start(server: SocketAddr, cut_after: Option<u64>) -> UdpRelay {
        let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        let back = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
        back.connect(server).await.unwrap();
        let addr = front.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let to_client = Arc::new(AtomicU64::new(0));
        let (c2, t2) = (cut.clone(), to_client.clone());
        let task = tokio::spawn(async move {
            let mut client: Option<SocketAddr> = None;
            let mut a = vec![0u8; 65536];
            let mut b = vec![0u8; 65536];
            loop {
                tokio::select! {
                    r = front.recv_from(&mut a) => {
                        let Ok((n, from)) = r else { return };
                        client = Some(from);
                        if !c2.load(Ordering::Relaxed) { let _ = back.send(&a[..n]).await; }
                    }
                    r = back.recv(&mut b) => {
                        let Ok(n) = r else { return };
                        let total = t2.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
                        if let Some(limit) = cut_after {
                            if total > limit && !c2.swap(true, Ordering::Relaxed) {
                                tracing::warn!(total, "relay: link cut");
                            }
                        }
                        if let (false, Some(c)) = (c2.load(Ordering::Relaxed), client) { let _ = front.send_to(&b[..n], c).await; }
                    }
                }
            }
        });
        UdpRelay { addr, cut, to_client, task }
    }
}
