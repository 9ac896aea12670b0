//! `k3-prefill serve`: the prefill node. Loads the model on the chosen backend, listens for
//! paired decoders over QUIC, prefills their prompts layer-major and streams the state back
//! layer by layer; keeps session prefixes so a conversation's next turn only prefills its new
//! tokens. See docs/e2e.md.
//!
//! Pairing: the node's certificate lives in `--config-dir` (default
//! `~/.config/k3-offload/prefill`, created on first run). Give the decoder this node's
//! fingerprint (printed at start) and pass the decoder's with `--decoder-fingerprint`. Explicit
//! values REPLACE the saved pins for the run (a decoder paired before is refused unless named
//! again) and are saved in `pinned-peers.txt`, replacing the earlier `decoder` entries, once a
//! decoder has proved it holds one; later starts without the flag use the saved pins.
//! `--insecure-dev` skips pinning on loopback.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use k3_protocol::transport::{NodeConfig, NodeIdentity, NodeRole, Pairing, PeerAuth};
use k3_protocol::Checkpoint;

use crate::backend::Backend;
use crate::cli::backend_args::{BackendArgs, Opened};
use crate::cli::forward::StreamArgs;
use crate::cli::synth::parse_size;
use crate::model::WeightPolicy;
use crate::server::{PrefillNode, ServeOptions, StoreLimits};

/// `--weights auto` keeps a checkpoint under this many bytes resident; a larger one is streamed
/// (CUDA) or read per layer (CPU).
pub const RESIDENT_MAX_BYTES: u64 = 8_000_000_000;

/// Weight residency.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Weights {
    /// Resident when the checkpoint is under 8 GB (and no streaming option is given), else
    /// streamed on CUDA and per layer on the CPU.
    Auto,
    /// CUDA: each prompt's weights streamed layer by layer (next layer copied while the current
    /// one computes; the memory plan sizes the slots within `--vram-budget`).
    Streamed,
    /// Every layer loaded once at start.
    Resident,
    /// Each layer loaded when the executor reaches it (bounded memory, large models).
    PerLayer,
}

/// Arguments of `k3-prefill serve`.
#[derive(clap::Args, Debug)]
#[command(mut_arg("precision", |a| a.default_value("bf16")))]
pub struct Args {
    /// Checkpoint directory (release layout).
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on (UDP), e.g. 0.0.0.0:7433 or 127.0.0.1:7433.
    #[arg(long)]
    pub listen: SocketAddr,
    // --precision defaults to bf16 here (on the trained tiny-t +0.28 % perplexity and 99 %
    // top-1 agreement with f32, docs/engine-agreement.md); f32 is the check mode (the same
    // greedy tokens as a local f32 prefill)
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Plain loopback testing without certificate pinning (loopback addresses only).
    #[arg(long)]
    pub insecure_dev: bool,
    /// Where this node's certificate and pinned peers live.
    #[arg(long)]
    pub config_dir: Option<PathBuf>,
    /// Trust only this decoder certificate (sha256:...) for this run; repeatable. Replaces the
    /// saved pins; saved for later starts once a decoder has proved it.
    #[arg(long)]
    pub decoder_fingerprint: Vec<String>,
    /// Memory for session prefixes kept between turns, e.g. 16GiB.
    #[arg(long, default_value = "16GiB", value_parser = parse_size)]
    pub session_memory: u64,
    /// A session prefix unused this long (seconds) is dropped.
    #[arg(long, default_value_t = 1800)]
    pub session_lease_secs: u64,
    /// Requests that may wait behind the running one; more are refused (the decoder then
    /// prefills locally).
    #[arg(long, default_value_t = 8)]
    pub max_queue: usize,
    /// Most new tokens per request.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_request_tokens: usize,
    /// Shared weight pass: requests waiting when a pass starts are prefilled together (each
    /// layer's weights read once) while their activations and states fit this, e.g. 16GiB;
    /// 0: one request per pass.
    #[arg(long, default_value = "16GiB", value_parser = parse_size)]
    pub pass_memory: u64,
    /// Executor: tokens per chunk within a layer (default: each pass's memory plan's, at most
    /// 512 on the CPU, 16384 on a GPU with ≥ 64 GiB, 4096 on smaller GPUs).
    #[arg(long)]
    pub chunk_tokens: Option<usize>,
    /// Where the weights live between prompts.
    #[arg(long, value_enum, default_value_t = Weights::Auto)]
    pub weights: Weights,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub memory: crate::cli::backend_args::MemoryArgs,
    #[command(flatten)]
    pub source: crate::cli::backend_args::SourceArgs,
    /// Serve the node's metrics (OpenMetrics text: requests, tokens, compute, streamed-weight
    /// transfer and waits) at `GET /metrics` on this TCP address, e.g. 127.0.0.1:9433.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Testing (feature `test-knobs`): sleep this many milliseconds after each layer.
    #[cfg(feature = "test-knobs")]
    #[arg(long, default_value_t = 0, hide = true)]
    pub debug_layer_delay_ms: u64,
}

impl Args {
    fn options(&self) -> ServeOptions {
        ServeOptions {
            store: StoreLimits { max_bytes: self.session_memory, lease: Duration::from_secs(self.session_lease_secs) },
            max_queue: self.max_queue,
            max_request_tokens: self.max_request_tokens,
            pass_budget_bytes: self.pass_memory,
            chunk_tokens: self.chunk_tokens.unwrap_or(512).max(1),
            #[cfg(feature = "test-knobs")]
            layer_delay: Duration::from_millis(self.debug_layer_delay_ms),
            metrics_listen: self.metrics_listen,
            ..ServeOptions::default()
        }
    }
}

/// The node's pairing set-up: its config dir and the `--decoder-fingerprint` values, which
/// REPLACE the saved pins for this run ([`Pairing`]).
fn pairing(args: &Args) -> anyhow::Result<Pairing> {
    Ok(Pairing::new(NodeRole::Prefill, args.config_dir.clone(), &args.decoder_fingerprint, args.insecure_dev)?)
}

/// The node's identity and who it trusts: the explicit `--decoder-fingerprint` values when
/// given (replacing the saved pins for this run), else the saved pins.
fn peer_auth(args: &Args) -> anyhow::Result<(NodeIdentity, PeerAuth)> {
    let pairing = pairing(args)?;
    let identity = pairing.identity()?;
    if args.insecure_dev {
        if !args.listen.ip().is_loopback() {
            bail!("--insecure-dev works on loopback only; {} is not a loopback address", args.listen);
        }
        if let Some(m) = args.metrics_listen.filter(|m| !m.ip().is_loopback()) {
            bail!("--insecure-dev works on loopback only; --metrics-listen {m} is not a loopback address");
        }
        return Ok((identity, PeerAuth::InsecureDev));
    }
    eprintln!("{}", identity.pairing_text(NodeRole::Prefill));
    for f in &pairing.explicit {
        tracing::info!(fingerprint = %f, "decoder pinned for this run (saved once it connects)");
    }
    Ok((identity, pairing.peer_auth()?))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let ck = Arc::new(Checkpoint::open(&args.model).with_context(|| format!("opening model {}", args.model.display()))?);
    match args.backend.open()? {
        Opened::Cpu(b) => serve_with(b, ck, &args),
        Opened::Cuda(b) => serve_with(b, ck, &args),
    }
}

fn serve_with<B: Backend + 'static>(backend: Arc<B>, ck: Arc<Checkpoint>, args: &Args) -> anyhow::Result<()> {
    let (identity, peers) = peer_auth(args)?;
    let fingerprint = ck.fingerprint();
    let state_identity = ck.state_identity();
    let total_bytes: u64 = ck.total_bytes();
    let streams = backend.streams_weights();
    let stream = match args.weights {
        Weights::Streamed if !streams => bail!("--weights streamed needs the CUDA backend (this node runs on {})", backend.name()),
        Weights::Streamed => true,
        Weights::Auto => streams && (total_bytes >= RESIDENT_MAX_BYTES || args.stream.given()),
        Weights::Resident | Weights::PerLayer => false,
    };
    if args.stream.given() && !stream {
        tracing::warn!("the weight-streaming options apply to --weights streamed (or auto) on CUDA; ignored");
    }
    let policy = match args.weights {
        Weights::Resident => WeightPolicy::Resident,
        Weights::Auto if !stream && total_bytes < RESIDENT_MAX_BYTES => WeightPolicy::Resident,
        _ => WeightPolicy::PerLayer,
    };
    let t0 = std::time::Instant::now();
    let name = backend.name().to_string();
    let weights = if stream {
        crate::prefiller::WeightMode::Streamed(args.stream.options()?)
    } else if policy == WeightPolicy::Resident {
        crate::prefiller::WeightMode::Resident
    } else {
        crate::prefiller::WeightMode::PerLayer
    };
    // the node's slots are planned for the longest prompt it can take (at most
    // --max-request-tokens); each pass is then planned within them
    let pf = crate::prefiller::Prefiller::open(
        backend,
        ck,
        &crate::prefiller::PrefillerOptions {
            weights,
            memory: args.memory.options(),
            chunk_tokens: args.chunk_tokens.map(|c| c.max(1)),
            logits: crate::memory_plan::LogitsKept::Last,
            design: Vec::new(),
            design_cap: args.max_request_tokens,
            emulate_source_gbs: args.source.emulate_source_gbs,
        },
    )
    .context("loading the model")?;
    eprintln!("{}", pf.design_plan.line());
    let mut opts = args.options();
    opts.chunk_tokens = args.chunk_tokens.unwrap_or_else(|| pf.model.backend.default_chunk_tokens()).max(1);
    opts.streamed = pf.streamed.clone();
    opts.planner = Some(pf.planner.clone());
    opts.source = pf.source.clone();
    let model = pf.model.clone();
    let pairing = pairing(args)?;
    if !pairing.explicit.is_empty() && !pairing.insecure_dev {
        opts.on_verified = Some(crate::server::OnVerified(Arc::new(move |cert| match pairing.save_verified(cert) {
            Ok(true) => tracing::info!(fingerprint = %cert, dir = %pairing.dir.display(), "decoder pin saved"),
            Ok(false) => {}
            Err(e) => tracing::warn!("could not save the decoder pin: {e:#}"),
        })));
    }
    tracing::info!(
        model = %args.model.display(),
        fingerprint = %fingerprint.short(),
        state_identity = %state_identity.short(),
        backend = %name,
        ?policy,
        streamed = stream,
        secs = format!("{:.2}", t0.elapsed().as_secs_f64()),
        "model loaded"
    );
    let node_cfg = NodeConfig::new(identity, peers, fingerprint, &name).with_state_identity(state_identity);
    let node = PrefillNode::start(model, args.listen, node_cfg, opts)?;
    // `k3-prefill serve` scripts wait for this exact line on stderr.
    eprintln!("k3-prefill: serving on {} (backend {name}, model {})", node.local_addr(), fingerprint.short());
    node.run_until_signal();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::parse_args;
    use k3_protocol::transport::{CertFingerprint, PinnedPeers};

    /// Issue 14: `serve` runs BF16 on CUDA unless told otherwise; `--precision f32` (check mode)
    /// stays available, and anything else is refused when the arguments are parsed.
    #[test]
    fn serve_defaults_to_bf16_and_keeps_f32() {
        let parse = |extra: &[&str]| {
            let mut a = vec!["serve", "--model", "m", "--listen", "127.0.0.1:0"];
            a.extend_from_slice(extra);
            parse_args::<Args>(&a)
        };
        assert_eq!(parse(&[]).unwrap().backend.precision, crate::cuda::Precision::Bf16);
        assert_eq!(parse(&["--precision", "f32"]).unwrap().backend.precision, crate::cuda::Precision::F32);
        assert!(parse(&["--precision", "fp7"]).is_err());
    }

    /// Issue 21: an `--insecure-dev` node accepted `--metrics-listen 0.0.0.0`.
    #[test]
    fn insecure_dev_refuses_metrics_off_loopback() {
        let dir = tempfile::tempdir().unwrap();
        let parse = |metrics: &str| {
            parse_args::<Args>(&[
                "serve",
                "--model",
                "m",
                "--listen",
                "127.0.0.1:0",
                "--insecure-dev",
                "--metrics-listen",
                metrics,
                "--config-dir",
                dir.path().to_str().unwrap(),
            ])
            .unwrap()
        };
        let e = peer_auth(&parse("0.0.0.0:9100")).expect_err("refused").to_string();
        assert!(e.contains("--metrics-listen 0.0.0.0:9100") && e.contains("loopback"), "{e}");
        assert!(matches!(peer_auth(&parse("127.0.0.1:9100")).unwrap().1, PeerAuth::InsecureDev));
    }

    /// Issue 21: pins only accumulated. After one pairing, `--decoder-fingerprint` with another
    /// value still trusted the old decoder, and the (unproved) value was appended to
    /// `pinned-peers.txt` at start.
    #[test]
    fn an_explicit_decoder_fingerprint_replaces_the_saved_pins_and_is_saved_only_once_proved() {
        let dir = tempfile::tempdir().unwrap();
        let fp = |b: u8| CertFingerprint([b; 32]);
        let (old, new, other) = (fp(0xaa), fp(0xbb), fp(0xcc));
        let mut saved = PinnedPeers::default();
        saved.add_and_save(dir.path(), old, "decoder").unwrap();
        let file = || std::fs::read_to_string(dir.path().join("pinned-peers.txt")).unwrap();
        let before = file();
        let args = |pins: &[CertFingerprint]| {
            let mut v = vec![
                "serve".to_string(),
                "--model".into(),
                "m".into(),
                "--listen".into(),
                "0.0.0.0:7433".into(),
                "--config-dir".into(),
                dir.path().to_str().unwrap().into(),
            ];
            for p in pins {
                v.extend(["--decoder-fingerprint".to_string(), p.to_string()]);
            }
            parse_args::<Args>(&v.iter().map(String::as_str).collect::<Vec<_>>()).unwrap()
        };
        // Without the flag: the saved pin.
        let PeerAuth::Pinned(p) = peer_auth(&args(&[])).unwrap().1 else { panic!("pinned expected") };
        assert_eq!(p, vec![old]);
        // With it: only the explicit value is trusted, and nothing is written yet.
        let PeerAuth::Pinned(p) = peer_auth(&args(&[new])).unwrap().1 else { panic!("pinned expected") };
        assert_eq!(p, vec![new], "the old decoder must not be trusted");
        assert_eq!(file(), before, "an unproved fingerprint was saved");
        // A decoder that is not an explicit value changes nothing; the explicit one, once proved,
        // replaces the old pin.
        let pairing = pairing(&args(&[new])).unwrap();
        assert!(!pairing.save_verified(other).unwrap());
        assert_eq!(file(), before);
        assert!(pairing.save_verified(new).unwrap());
        assert_eq!(PinnedPeers::load(dir.path()).unwrap().peers, vec![(new, "decoder".to_string())]);
        let PeerAuth::Pinned(p) = peer_auth(&args(&[])).unwrap().1 else { panic!("pinned expected") };
        assert_eq!(p, vec![new]);
        // A malformed value is an error naming it.
        let mut a = args(&[]);
        a.decoder_fingerprint = vec!["sha256:00".into()];
        let e = format!("{:#}", peer_auth(&a).err().unwrap());
        assert!(e.contains("--decoder-fingerprint sha256:00"), "{e}");
    }
}
