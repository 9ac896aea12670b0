//! What a node needs to speak the hand-off protocol, and the QUIC transport settings.

#[cfg(feature = "fault-injection")]
use std::sync::Arc;
use std::time::Duration;

use crate::fingerprint::Fingerprint;
#[cfg(feature = "fault-injection")]
use crate::transport::hooks::FaultHooks;
use crate::transport::identity::NodeIdentity;
use crate::transport::tls::PeerAuth;
use crate::wire::frame::{DEFAULT_MAX_CONTROL_FRAME, DEFAULT_MAX_FRAME};
use crate::wire::{Capabilities, CostBoard, StateDtype};

/// Timeouts, windows and limits. Defaults suit a LAN or Thunderbolt link.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// QUIC idle timeout: the connection dies after this long without a packet.
    pub idle_timeout: Duration,
    /// QUIC keep-alive PINGs (transport heartbeat).
    pub keep_alive: Duration,
    /// Application heartbeat on a request stream while the prefill node computes.
    pub heartbeat: Duration,
    /// Receiver: no frame of the transfer for this long → `Stalled`.
    pub inactivity_timeout: Duration,
    /// Sender: a write blocked by flow control for this long → `Stalled` (peer stopped reading).
    pub stall_timeout: Duration,
    /// Per-stream and per-connection QUIC receive windows (bytes).
    pub stream_receive_window: u32,
    pub receive_window: u32,
    /// Bytes quinn may buffer unacknowledged per connection (bounds the sender's memory).
    pub send_window: u64,
    /// Upper bound for QUIC path-MTU discovery (1452 on a normal LAN; jumbo frames allow more).
    pub mtu_upper_bound: u16,
    /// Largest control frame (requests carry token ids and image embeddings).
    pub max_control_frame: u32,
    /// Largest state accepted in one transfer.
    pub max_state_bytes: u64,
    /// Most parallel data streams per transfer.
    pub max_streams: u16,
    /// Server: handshakes in progress at once; more incoming connections are refused.
    pub max_handshakes: usize,
    /// Server: with this many handshakes in progress, a peer whose address is not yet validated
    /// gets a QUIC Retry first (stateless: a flood of spoofed or half-open Initials then holds
    /// nothing).
    pub retry_above: usize,
    /// Server: connections (handshaking or established) per peer IP address.
    pub max_connections_per_ip: usize,
    /// Server: established connections at once.
    pub max_connections: usize,
    /// Server: the TLS handshake and Hello must complete within this.
    pub handshake_timeout: Duration,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            heartbeat: Duration::from_secs(5),
            inactivity_timeout: Duration::from_secs(300),
            stall_timeout: Duration::from_secs(60),
            stream_receive_window: 8 << 20,
            receive_window: 32 << 20,
            send_window: 32 << 20,
            mtu_upper_bound: 1452,
            max_control_frame: DEFAULT_MAX_CONTROL_FRAME,
            max_state_bytes: 64 << 30,
            max_streams: 16,
            max_handshakes: 64,
            retry_above: 8,
            max_connections_per_ip: 16,
            max_connections: 64,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

impl Tuning {
    /// Limits that notice a dead peer within about 2 s (loopback drills that kill a node).
    /// Too tight where success is expected on a loaded machine: a starved process can miss its
    /// keep-alives.
    pub fn quick_failure() -> Tuning {
        Tuning {
            idle_timeout: std::time::Duration::from_secs(2),
            keep_alive: std::time::Duration::from_millis(300),
            heartbeat: std::time::Duration::from_millis(300),
            inactivity_timeout: std::time::Duration::from_secs(10),
            stall_timeout: std::time::Duration::from_secs(5),
            ..Tuning::default()
        }
    }

    /// A quinn endpoint on `addr` whose UDP payloads may reach `mtu_upper_bound` (quinn's
    /// default caps them at 1472 bytes whatever the path allows).
    pub(crate) fn endpoint(&self, addr: std::net::SocketAddr, server: Option<quinn::ServerConfig>) -> std::io::Result<quinn::Endpoint> {
        let mut ec = quinn::EndpointConfig::default();
        ec.max_udp_payload_size(self.mtu_upper_bound.clamp(1472, 65_527)).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let socket = std::net::UdpSocket::bind(addr)?;
        let runtime = quinn::default_runtime().ok_or_else(|| std::io::Error::other("no async runtime (call from inside tokio)"))?;
        quinn::Endpoint::new(ec, server, socket, runtime)
    }

    pub(crate) fn quinn_transport(&self) -> quinn::TransportConfig {
        let mut t = quinn::TransportConfig::default();
        t.max_idle_timeout(quinn::IdleTimeout::try_from(self.idle_timeout).ok());
        t.keep_alive_interval(Some(self.keep_alive));
        t.stream_receive_window(quinn::VarInt::from_u32(self.stream_receive_window));
        t.receive_window(quinn::VarInt::from_u32(self.receive_window));
        t.send_window(self.send_window);
        t.max_concurrent_uni_streams(quinn::VarInt::from_u32(2 * self.max_streams as u32 + 8));
        t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(16));
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(self.mtu_upper_bound.max(1200));
        t.mtu_discovery_config(Some(mtu));
        t
    }
}

/// One node's side of the protocol.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub identity: NodeIdentity,
    pub peers: PeerAuth,
    /// Fingerprint of the loaded model (`Checkpoint::fingerprint()`).
    pub model_fingerprint: Fingerprint,
    /// Its state-compatibility identity (`Checkpoint::state_identity()`), set with
    /// [`NodeConfig::with_state_identity`]; `None` (the default): compatible with no other model.
    pub state_identity: Option<Fingerprint>,
    /// Decoder: accept a prefill node whose model has another fingerprint but this state
    /// identity (e.g. the full model this pruned one was made from). Without it such a node is
    /// refused with [`crate::transport::TransferError::CompatibleModelNotAccepted`]. A prefill
    /// node always serves such decoders (the decoder decides).
    pub accept_compatible_states: bool,
    pub capabilities: Capabilities,
    pub node_name: String,
    pub tuning: Tuning,
    /// A prefill node's current cost, advertised after `HelloAck` and on `CostQuery`
    /// (the node's meter writes it; a decoder leaves it at the default).
    pub cost: CostBoard,
    /// Fault injection for tests (only with the `fault-injection` feature); leave default.
    #[cfg(feature = "fault-injection")]
    pub hooks: Arc<FaultHooks>,
}

impl NodeConfig {
    /// A config with default capabilities (fp32, 1 MiB chunks) and tuning.
    pub fn new(identity: NodeIdentity, peers: PeerAuth, model_fingerprint: Fingerprint, backend: &str) -> NodeConfig {
        NodeConfig {
            identity,
            peers,
            model_fingerprint,
            state_identity: None,
            accept_compatible_states: false,
            capabilities: Capabilities {
                dtypes: vec![StateDtype::F32],
                max_frame_size: DEFAULT_MAX_FRAME,
                backend: backend.to_string(),
                max_streams: Tuning::default().max_streams,
            },
            node_name: hostname(),
            tuning: Tuning::default(),
            cost: CostBoard::default(),
            #[cfg(feature = "fault-injection")]
            hooks: Arc::new(FaultHooks::default()),
        }
    }
}

impl NodeConfig {
    /// Whether a peer announcing `theirs` runs a model whose states this node's model can use:
    /// both identities given and equal.
    pub fn state_compatible(&self, theirs: Option<Fingerprint>) -> bool {
        crate::wire::handshake::state_compatible(self.state_identity, theirs)
    }

    /// What this node says of itself in the handshake.
    pub fn announce(&self) -> crate::wire::handshake::Announce {
        crate::wire::handshake::Announce {
            model_fingerprint: self.model_fingerprint,
            state_identity: self.state_identity,
            capabilities: self.capabilities.clone(),
            node_name: self.node_name.clone(),
        }
    }

    /// The same config announcing `state_identity` (`Checkpoint::state_identity()`).
    pub fn with_state_identity(mut self, state_identity: Fingerprint) -> NodeConfig {
        self.state_identity = Some(state_identity);
        self
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "k3-node".to_string())
}
