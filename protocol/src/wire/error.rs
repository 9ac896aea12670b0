//! Errors of the sans-I/O wire layer. Each names what was wrong and where (layer, part, byte
//! offset), so a transport error can say which chunk of which peer was bad.

use crate::wire::part::Part;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame of {len} bytes exceeds the maximum frame size of {max} bytes")]
    Oversized { len: u64, max: u64 },
    #[error("stream ended inside a frame: {have} bytes buffered, the frame needs {need}")]
    Truncated { have: usize, need: usize },
    #[error("unknown frame kind {0}")]
    UnknownFrameKind(u8),
    #[error("frame of kind {kind} too short: {len} bytes")]
    ShortFrame { kind: u8, len: usize },
    #[error("control message does not decode: {0}")]
    BadMessage(String),
    #[error("chunk header: unknown part tag {0}")]
    UnknownPart(u8),
    #[error("chunk header: reserved bytes are not zero")]
    ReservedBits,
    #[error("chunk header says {header} payload bytes, the frame holds {frame}")]
    ChunkLength { header: u32, frame: usize },
    #[error("layer {layer} {part} bytes [{offset}, +{len}): checksum {got:08x}, the chunk says {want:08x}")]
    Checksum { layer: u32, part: Part, offset: u64, len: u32, got: u32, want: u32 },
    #[error("chunk for request {got}, this transfer is request {want}")]
    WrongRequest { got: u64, want: u64 },
    #[error("chunk for layer {layer}, the state has {layers} layers")]
    LayerOutOfRange { layer: u32, layers: usize },
    #[error("chunk for layer {layer} part {part}, which that layer does not have")]
    NoSuchPart { layer: u32, part: Part },
    #[error("layer {layer} {part} bytes [{offset}, +{len}) lie outside the part's {size} bytes or are not fp32-aligned")]
    OutOfRange { layer: u32, part: Part, offset: u64, len: u32, size: u64 },
    #[error("layer {layer} {part} bytes [{offset}, +{len}) overlap bytes already received [{prev_start}, {prev_end})")]
    Overlap { layer: u32, part: Part, offset: u64, len: u32, prev_start: u64, prev_end: u64 },
    #[error("chunk for layer {layer}, which already arrived complete")]
    LayerAlreadyComplete { layer: u32 },
    #[error("layer {layer} started while {open} layers ({open_bytes} bytes) are unfinished, over the limit of {limit} bytes")]
    TooManyOpenLayers { layer: u32, open: usize, open_bytes: u64, limit: u64 },
    #[error("state incomplete: {0}")]
    Incomplete(String),
    #[error("totals differ: the sender says {what} {said}, received {got}")]
    TotalsMismatch { what: &'static str, said: u64, got: u64 },
    #[error("bad state layout: layer {layer} size overflows")]
    LayerSizeOverflow { layer: usize },
    #[error("bad state layout: layer {layer}: slot in an impossible state")]
    SlotState { layer: usize },
    #[error("bad state layout: state size overflows u64")]
    StateSizeOverflow,
    #[error("bad state layout: state of {bytes} bytes exceeds the limit of {limit}")]
    StateTooLarge { bytes: u64, limit: u64 },
    #[error("bad state layout: MLA layer {layer} has {rows} rows, others {others}")]
    MlaRows { layer: usize, rows: u64, others: u64 },
    #[error("KDA {part} holds {got} values, the layout wants {want}")]
    KdaPartLength { part: Part, got: usize, want: u64 },
    #[error("KDA heads×head_dim {heads}×{head_dim}, the layout wants {want_heads}×{want_head_dim}")]
    KdaHeads { heads: usize, head_dim: usize, want_heads: u32, want_head_dim: u32 },
    #[error("MLA latent holds {values} values of width {width}, the layout wants {want_rows} rows × {want_width}")]
    MlaLatent { values: usize, width: usize, want_rows: u64, want_width: u32 },
    #[error("an MLA state for a KDA layer")]
    MlaStateForKdaLayer,
    #[error("a KDA state for an MLA layer")]
    KdaStateForMlaLayer,
    #[error("{got} layers in the state, {want} in the layout")]
    StateLayers { got: usize, want: usize },
    #[error("layer {layer}: {source}")]
    StateLayer { layer: usize, source: Box<WireError> },
    #[error("image embeddings hold {values} values, {positions} positions × width {width} need {want}")]
    ImageEmbeddingSize { values: usize, positions: usize, width: u32, want: u64 },
    #[error("image embedding position {position} is past the {tokens} new tokens")]
    ImageEmbeddingPosition { position: u32, tokens: usize },
    #[error("options.streams is 0")]
    NoStreams,
}
