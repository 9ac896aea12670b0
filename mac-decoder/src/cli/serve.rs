//! `k3-decode serve`: the OpenAI-compatible HTTP server (see `docs/chat-and-server.md`).

use std::net::SocketAddr;
use std::path::PathBuf;

/// Arguments of `k3-decode serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Checkpoint directory (release layout, with `tiktoken.model` and `tokenizer_config.json`).
    #[arg(long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub node: super::prefill_node::PrefillNodeArgs,
    /// Address to listen on. Loopback by default; anything else must be asked for.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Require `Authorization: Bearer <KEY>` on `/v1/*` (also read from `K3_API_KEY`).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Model id served (default: the model directory's name).
    #[arg(long)]
    pub model_id: Option<String>,
    /// Session states held for prefix reuse (LRU).
    #[arg(long, default_value_t = 16)]
    pub max_sessions: usize,
    /// Bytes of session state held at most.
    #[arg(long, default_value_t = 8 << 30)]
    pub max_session_bytes: usize,
    /// Do not keep turn-boundary checkpoints (less memory; reuse then needs the exact reply).
    #[arg(long)]
    pub no_checkpoints: bool,
    /// Context limit in tokens, prompt + generated (0: what half the memory available beside the
    /// model at start holds, or `K3_CONTEXT_MEMORY_BYTES`, capped by the config's
    /// `max_position_embeddings`).
    #[arg(long, default_value_t = 0)]
    pub max_context: usize,
    /// Default `max_tokens` of a chat completion.
    #[arg(long, default_value_t = 4096)]
    pub default_max_tokens: usize,
    /// Tokens per local-prefill chunk.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Without an API key only loopback `Host` / `Origin` values are served; also accept this
    /// host name (repeatable).
    #[arg(long = "allow-host")]
    pub allow_hosts: Vec<String>,
    /// `/v1/*` requests running at once; more get 429 with `Retry-After`.
    #[arg(long, default_value_t = 64)]
    pub max_concurrent_requests: usize,
    /// Tokens in flight: prompt + max_tokens of the requests admitted and not finished; past it,
    /// 429 with `Retry-After` (0: what the context memory budget holds, at least the context
    /// limit; unbounded where the memory cannot be read).
    #[arg(long, default_value_t = 0)]
    pub max_tokens_in_flight: usize,
    /// Seconds a client may take to send a request's headers (also how long an idle keep-alive
    /// connection stays open); the connection is closed past it.
    #[arg(long, default_value_t = 30.0)]
    pub header_read_timeout: f64,
    /// Seconds a POST body may take to arrive; 408 past it.
    #[arg(long, default_value_t = 30.0)]
    pub body_read_timeout: f64,
    /// Requests decoded together, their decode steps batched into one pass over the weights
    /// (continuous batching); further admitted requests wait. 1 decodes one at a time.
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
}

#[cfg(not(feature = "mlx"))]
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("k3-decode was built without the `mlx` feature; rebuild with default features to serve a model")
}

#[cfg(feature = "mlx")]
pub fn run(args: Args) -> anyhow::Result<()> {
    use std::sync::Arc;

    use anyhow::Context;

    use crate::decode::EngineOptions;
    use crate::server::mlx_engine::MlxEngine;
    use crate::server::metrics::Metrics;
    use crate::server::worker::{EngineHandle, StoreOptions};
    use crate::server::AppState;
    use crate::tokenizer::Tokenizer;

    let tokenizer = Arc::new(Tokenizer::from_dir(&args.model).with_context(|| format!("loading the tokenizer of {}", args.model.display()))?);
    let remote = args.node.remote_options();
    if !args.listen.ip().is_loopback() {
        tracing::warn!(addr = %args.listen, auth = args.api_key.is_some(), "listening beyond loopback");
    }
    let metrics = Arc::new(Metrics::new());
    let dir = args.model.clone();
    let opts = EngineOptions { prefill_chunk: args.prefill_chunk, progress: std::io::IsTerminal::is_terminal(&std::io::stderr()), ..Default::default() };
    let ck = k3_protocol::Checkpoint::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?;
    let text = &ck.config().text_config;
    let max_context = crate::server::context::limit(text, args.prefill_chunk, args.max_context, ck.total_bytes());
    let max_tokens_in_flight = crate::server::context::tokens_in_flight(text, args.prefill_chunk, max_context, args.max_tokens_in_flight, ck.total_bytes());
    drop(ck);
    let secs = |s: f64, flag: &str| -> anyhow::Result<std::time::Duration> {
        anyhow::ensure!(s.is_finite() && s > 0.0, "{flag} must be a positive number of seconds, not {s}");
        Ok(std::time::Duration::from_secs_f64(s))
    };
    let header_timeout = secs(args.header_read_timeout, "--header-read-timeout")?;
    let body_timeout = secs(args.body_read_timeout, "--body-read-timeout")?;
    let max_batch = args.max_batch;
    let store = StoreOptions { max_sessions: args.max_sessions, max_bytes: args.max_session_bytes, checkpoints: !args.no_checkpoints };
    let load = move || {
        let e = MlxEngine::load(&dir, opts, max_context)?.with_max_batch(max_batch);
        match remote {
            Some(o) => e.with_remote(o),
            None => Ok(e),
        }
    };
    // decoder ranks: rank 0 serves, the others follow its sessions (docs/multi-mac.md)
    let world = crate::distributed::world()?;
    if world.rank() > 0 {
        return crate::server::ranks::follow(load()?, world);
    }
    let engine = if world.is_distributed() {
        EngineHandle::spawn(move || Ok(crate::server::ranks::RankedEngine::new(load()?, world)?), store, metrics.clone())?
    } else {
        EngineHandle::spawn(load, store, metrics.clone())?
    };
    engine.set_max_tokens_in_flight(max_tokens_in_flight);
    if engine.vocab_size < tokenizer.vocab_size() as usize {
        anyhow::bail!("the tokenizer has {} ids but the model scores only {}", tokenizer.vocab_size(), engine.vocab_size);
    }
    let model_id = args
        .model_id
        .clone()
        .unwrap_or_else(|| args.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "k3".into()));
    let api_key = args.api_key.clone().or_else(|| std::env::var("K3_API_KEY").ok()).filter(|k| !k.is_empty());
    let mut state = AppState::new(engine, tokenizer, metrics, model_id.clone(), api_key);
    state.default_chat_max_tokens = args.default_max_tokens;
    state.guard.allowed_hosts = args.allow_hosts.clone();
    state.guard.max_concurrent = args.max_concurrent_requests.max(1);
    state.guard.header_timeout = header_timeout;
    state.guard.body_timeout = body_timeout;
    let state = Arc::new(state);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        tracing::info!(addr = %listener.local_addr()?, model = %model_id, "serving the OpenAI API");
        // SIGINT or SIGTERM: stop accepting, let running requests finish, then exit 0.
        #[cfg(unix)]
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let shutdown = async move {
            #[cfg(unix)]
            tokio::select! {
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
                _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            }
            #[cfg(not(unix))]
            {
                let _ = tokio::signal::ctrl_c().await;
                tracing::info!("shutting down");
            }
        };
        crate::server::serve(listener, state, shutdown).await.context("HTTP server")
    })
}
