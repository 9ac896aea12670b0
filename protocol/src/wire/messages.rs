//! Control messages (bincode 2, standard config). They travel in `Control` frames on the
//! handshake stream, the per-request stream, and at the head of each data stream. State bytes
//! never go through bincode: they travel as raw `Chunk` frames (see [`crate::wire::frame`]).

use serde::{Deserialize, Serialize};

use crate::fingerprint::Fingerprint;
use crate::wire::cost::NodeCost;
use crate::wire::layout::StateLayout;

/// Bumped on any incompatible change of frames or messages. 2: the node's cost
/// (`Message::Cost` after `HelloAck`, `Message::CostQuery` on a request stream); a version-1
/// peer is refused in the handshake with `VersionMismatch` naming both versions. 3: `Hello` and
/// `HelloAck` carry the model's state identity (docs/pruning.md) beside its fingerprint.
pub const PROTOCOL_VERSION: u32 = 3;
/// TLS ALPN id of this protocol.
pub const ALPN: &[u8] = b"k3-handoff/1";

/// Dtypes a node can send or receive state in. The canonical hand-off state is fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StateDtype {
    F32,
}

/// What a node can do; exchanged in the handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    pub dtypes: Vec<StateDtype>,
    /// Largest frame this node accepts on a data stream (frame kind + chunk header + payload).
    pub max_frame_size: u32,
    /// Compute backend of the node ("cuda", "cpu", "mlx", ...), for logs and routing.
    pub backend: String,
    /// Most parallel data streams per transfer this node wants.
    pub max_streams: u16,
}

/// Client → server, first frame on the first bidirectional stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol_version: u32,
    pub model_fingerprint: Fingerprint,
    /// The model's state-compatibility identity (`Checkpoint::state_identity`): equal for a
    /// model and the models pruned from it, whose hand-off states are interchangeable. `None`:
    /// not given (compatible with its own fingerprint only).
    pub state_identity: Option<Fingerprint>,
    pub capabilities: Capabilities,
    /// Free-form node name for logs.
    pub node_name: String,
}

/// Server → client, the answer to a matching [`Hello`] (a mismatch gets [`Message::Error`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HelloAck {
    pub protocol_version: u32,
    pub model_fingerprint: Fingerprint,
    pub state_identity: Option<Fingerprint>,
    pub capabilities: Capabilities,
    pub node_name: String,
    /// Negotiated: min of both sides' `max_frame_size`.
    pub max_frame_size: u32,
}

/// A decoder-chosen id naming a conversation whose prefix the prefill node may keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SessionId(pub [u8; 16]);

impl SessionId {
    pub fn random() -> SessionId {
        SessionId(rand::random())
    }
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hex())
    }
}

/// A prefix of the session the prefill node already holds: its length and
/// [`crate::handoff::token_prefix_hash`] of its tokens. Only tokens after it travel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BasePrefix {
    pub tokens: u64,
    pub token_prefix_hash: String,
}

/// Image embeddings to splice in at placeholder positions (relative to the new tokens).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageEmbeddings {
    /// Positions in `tokens` (0-based, relative to the start of the new tokens).
    pub positions: Vec<u32>,
    /// Row width (the text hidden size).
    pub width: u32,
    /// `[positions.len(), width]`, fp32.
    pub rows: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillOptions {
    /// Keep the resulting state for this session (the next turn can name it as `base`).
    pub keep_session: bool,
    /// Return the logits of the last position in `Done`.
    pub return_last_logits: bool,
    /// Parallel data streams wanted (the server may use fewer).
    pub streams: u16,
    /// Chunk payload size wanted in bytes (the server clamps it to the negotiated frame size).
    pub chunk_bytes: u32,
}

impl Default for PrefillOptions {
    fn default() -> Self {
        PrefillOptions { keep_session: true, return_last_logits: true, streams: 4, chunk_bytes: 1 << 20 }
    }
}

/// Decoder → prefill node: prefill these tokens after `base`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillRequest {
    pub session: SessionId,
    /// None: `tokens` is the whole sequence.
    pub base: Option<BasePrefix>,
    /// The new tokens.
    pub tokens: Vec<u32>,
    pub image_embeddings: Option<ImageEmbeddings>,
    pub options: PrefillOptions,
}

/// Server → client on the request stream: the request is taken; state of `layout` follows on
/// `streams` data streams in chunks of at most `chunk_bytes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Accepted {
    pub request: u64,
    pub base_tokens: u64,
    pub layout: StateLayout,
    pub streams: u16,
    pub chunk_bytes: u32,
}

/// Progress of the compute on the prefill node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    pub request: u64,
    pub layers_done: u32,
    pub layers_total: u32,
    pub compute_s: f64,
}

/// Where the time went on the prefill node, and how many bytes moved.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Layer compute.
    pub compute_s: f64,
    /// Waiting for weights (disk / PCIe) not hidden behind compute.
    pub weight_wait_s: f64,
    /// Time `send_layer` spent blocked on the network (flow control).
    pub send_wait_s: f64,
    /// Request accepted → `Done` sent.
    pub total_s: f64,
    /// State payload bytes sent.
    pub state_bytes: u64,
    /// Protocol bytes written on data streams (frame headers + payload).
    pub wire_bytes: u64,
    pub chunks: u64,
}

/// Server → client: every chunk has been written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Done {
    pub request: u64,
    pub layers: u32,
    pub chunks: u64,
    pub state_bytes: u64,
    pub timing: Timing,
    pub last_logits: Option<Vec<f32>>,
}

/// Why something was refused or aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    VersionMismatch,
    FingerprintMismatch,
    CapabilityMismatch,
    /// The named base prefix is not (or no longer) held: resend with the whole sequence.
    BaseNotHeld,
    Busy,
    InvalidRequest,
    TooLarge,
    Malformed,
    Cancelled,
    Timeout,
    Internal,
    ShuttingDown,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMsg {
    pub code: ErrorCode,
    pub message: String,
}

/// Every control message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    Hello(Hello),
    HelloAck(HelloAck),
    PrefillRequest(PrefillRequest),
    Accepted(Accepted),
    /// First frame of each data (unidirectional) stream of a transfer.
    DataStream {
        request: u64,
        index: u16,
    },
    Progress(Progress),
    /// Keeps the request alive while a long layer computes.
    Heartbeat {
        request: u64,
    },
    Done(Done),
    /// Client → server after `Done`: every layer arrived exactly once and passed every check.
    Received {
        request: u64,
    },
    /// Refusal or failure reported by the peer.
    Error(ErrorMsg),
    /// Cancellation from either side.
    Abort(ErrorMsg),
    /// Client → server, alone on a new bidirectional stream: what would a prefill cost now?
    CostQuery,
    /// Server → client: the node's current cost (after `HelloAck`, and as the answer to `CostQuery`).
    Cost(NodeCost),
}

impl Message {
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "Hello",
            Message::HelloAck(_) => "HelloAck",
            Message::PrefillRequest(_) => "PrefillRequest",
            Message::Accepted(_) => "Accepted",
            Message::DataStream { .. } => "DataStream",
            Message::Progress(_) => "Progress",
            Message::Heartbeat { .. } => "Heartbeat",
            Message::Done(_) => "Done",
            Message::Received { .. } => "Received",
            Message::Error(_) => "Error",
            Message::Abort(_) => "Abort",
            Message::CostQuery => "CostQuery",
            Message::Cost(_) => "Cost",
        }
    }
}
