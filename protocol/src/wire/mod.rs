//! The hand-off wire protocol, sans I/O: messages, framing, chunking, checksums and state
//! assembly. Nothing here touches a socket; [`crate::transport`] drives it over QUIC, and the
//! tests drive it with plain byte buffers. See docs/handoff-protocol.md.

pub mod assembler;
pub mod checksum;
pub mod chunker;
pub mod cost;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod layout;
pub mod messages;
pub mod part;

pub use assembler::{AssemblerLimits, AssemblyTotals, StateAssembler, StateCollector};
pub use chunker::{plan_layer, ChunkSpec};
pub use cost::{CostBoard, NodeCost, RateFit, RateSample};
pub use error::WireError;
pub use frame::{encode_control, Chunk, ChunkHeader, Frame, FrameDecoder};
pub use layout::{LayerLayout, StateLayout};
pub use messages::*;
pub use part::Part;
