//! Helpers for the workspace-level end-to-end tests: a prefill node in-process (CPU backend,
//! loopback QUIC, paired certificates), a decoder engine with its prefill client, synthetic
//! model variants, references, comparisons, and a log capture for "a clear log line" checks.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::executor::{self, ExecOptions, LogitsRows, PrefillInput};
use cuda_prefiller::model::{Model, WeightPolicy};
use cuda_prefiller::server::{PrefillNode, ServeOptions};
use k3_protocol::handoff::HandoffState;
use k3_protocol::synth::{write_model, Overrides, Preset, SynthOptions};
use k3_protocol::transport::{NodeConfig, NodeIdentity, PeerAuth, Tuning};
use k3_protocol::{Checkpoint, Fingerprint};
use mac_decoder::decode::{Engine, GenerateParams};
use mac_decoder::engine::{EngineHandle, GenerationEngine, StoreOptions};
use mac_decoder::metrics::Metrics;
use mac_decoder::remote::{RemoteOptions, RemotePrefiller};
use mac_decoder::server::AppState;
use mac_decoder::tokenizer::Tokenizer;

pub use k3_protocol::process::MemoryLog;
pub use k3_protocol::testdata::{golden_dir, rel_l2};

pub use k3_protocol::process::init_test_logging as init_tracing;

/// Timeouts for tests that kill a node: a dead peer is noticed within ~2 s. Too tight for tests
/// that expect success on a loaded 2-core box (a starved process can miss its keep-alives):
/// [`paired`] uses the production limits.
pub fn test_tuning() -> Tuning {
    Tuning::quick_failure()
}

/// A prefill node's and a decoder's configs that pin each other's fresh certificates.
/// `server_model` / `client_model`: the fingerprints each side announces.
pub fn paired(server_model: Fingerprint, client_model: Fingerprint) -> (NodeConfig, NodeConfig) {
    let s = NodeIdentity::generate().expect("server certificate");
    let c = NodeIdentity::generate().expect("client certificate");
    let mut server = NodeConfig::new(s.clone(), PeerAuth::pinned(c.fingerprint()), server_model, "cpu");
    let mut client = NodeConfig::new(c, PeerAuth::pinned(s.fingerprint()), client_model, "mlx");
    server.node_name = "e2e-prefill".into();
    client.node_name = "e2e-decoder".into();
    (server, client)
}

pub fn fingerprint_of(dir: &Path) -> Fingerprint {
    Checkpoint::open(dir).expect("checkpoint opens").fingerprint()
}

/// The CPU reference model of `dir`, every layer resident.
pub fn cpu_model(dir: &Path) -> Model<CpuBackend> {
    let ck = Arc::new(Checkpoint::open(dir).expect("checkpoint opens"));
    Model::new(Arc::new(CpuBackend), ck, WeightPolicy::Resident).expect("model loads")
}

/// A prefill node serving `dir` on the CPU backend, on a loopback port.
pub fn start_node(dir: &Path, cfg: NodeConfig, opts: ServeOptions) -> PrefillNode {
    PrefillNode::start(cpu_model(dir), "127.0.0.1:0".parse().unwrap(), cfg, opts).expect("prefill node starts")
}

/// The decoder's HTTP server state over an engine thread running the engine `make` builds
/// (fresh metrics, no API key; tests set `guard` on the result before serving it).
pub fn app_state<E, F>(make: F, store: StoreOptions, tok: Arc<Tokenizer>, model_id: &str) -> AppState
where
    E: GenerationEngine,
    F: FnOnce() -> anyhow::Result<E> + Send + 'static,
{
    let metrics = Arc::new(Metrics::new());
    let engine = EngineHandle::spawn(make, store, metrics.clone()).expect("engine thread starts");
    AppState::new(engine, tok, metrics, model_id.into(), None)
}

/// Serves `state` (`k3-decode serve`'s HTTP server) on a free loopback port in the background of
/// the current tokio runtime; its address.
pub async fn serve_http(state: AppState) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
    let addr = listener.local_addr().expect("bound");
    tokio::spawn(mac_decoder::server::serve(listener, Arc::new(state), std::future::pending()));
    addr
}

/// Remote options for tests: short timeouts, every prompt of at least `min_tokens` goes remote.
pub fn remote_options(addr: SocketAddr, min_tokens: usize) -> RemoteOptions {
    let mut o = RemoteOptions::new(addr.to_string());
    o.min_tokens = Some(min_tokens);
    o.connect_timeout = Duration::from_secs(10);
    o.streams = 3;
    o.chunk_bytes = 16 << 10; // several chunks per layer even for tiny models
    o
}

pub fn remote(engine: &Engine, addr: SocketAddr, client: NodeConfig, min_tokens: usize) -> RemotePrefiller {
    RemotePrefiller::with_node_config(engine, remote_options(addr, min_tokens), client).expect("prefill client")
}

/// A synthetic model (tiny preset + `edit` on the overrides) in a temp dir.
pub fn synth(seed: u64, edit: impl FnOnce(&mut Overrides)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut o = SynthOptions::new(Preset::Tiny);
    o.seed = seed;
    edit(&mut o.overrides);
    write_model(dir.path(), &o).expect("synthetic model");
    dir
}

/// Deterministic token ids in [0, limit).
pub fn prompt(seed: u64, n: usize, limit: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % limit as u64) as u32
        })
        .collect()
}

/// Local prefill of `prompt` then `n` greedy tokens: (tokens, logits after the prefill).
pub fn local_greedy(engine: &Engine, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut s = engine.new_session().expect("session");
    let logits = engine.prefill_local(&mut s, prompt, None).expect("local prefill");
    let out = engine.generate(&mut s, &GenerateParams::greedy(n), |_| true).expect("generate");
    (out.tokens, logits)
}

/// The CPU reference executor's one-shot prefill: (state, last logits row).
pub fn cpu_prefill(model: &Model<CpuBackend>, tokens: &[u32]) -> (HandoffState, Vec<f32>) {
    let mut st = HandoffState::empty(&model.cfg);
    let opts = ExecOptions { logits: LogitsRows::Last, ..Default::default() };
    let out = executor::prefill(model, &mut st, PrefillInput::tokens(tokens), &opts, |_| Ok(())).expect("cpu prefill");
    (st, out.logits)
}

/// Top-1 minus top-2 of a logits row (how safe a greedy comparison is).
pub fn top_margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in row {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// Collects what `tracing` writes on the current thread while a guard is held.
pub struct LogCapture;

impl LogCapture {
    /// Captures this thread's log lines (info and up) until the guard drops.
    pub fn start() -> (MemoryLog, tracing::subscriber::DefaultGuard) {
        let cap = MemoryLog::default();
        let guard = tracing::subscriber::set_default(cap.subscriber());
        (cap, guard)
    }
}

/// `target/<profile>/<name>` next to this test binary (`target/<profile>/deps/<test>`).
pub fn workspace_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>");
    dir.join(name)
}

/// The node's request history once it holds at least `n` records (the node records a request
/// after the decoder already has its answer, so tests wait a moment for it).
pub fn records(node: &PrefillNode, n: usize) -> Vec<cuda_prefiller::server::RequestRecord> {
    let t0 = std::time::Instant::now();
    loop {
        let r = node.snapshot().recent;
        if r.len() >= n {
            return r;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the node recorded {} requests, expected {n}", r.len());
        std::thread::sleep(Duration::from_millis(5));
    }
}
