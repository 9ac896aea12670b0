//! Sender side: how a layer's state is cut into chunks. Each part (recurrent, conv windows,
//! latent rows) is cut into pieces of at most `chunk_bytes` (a multiple of 4, so every chunk
//! holds whole fp32 values). A layer of zero bytes (an MLA delta of zero rows) still sends
//! one empty chunk, so that "every layer arrived exactly once" holds for it too.

use crate::handoff::LayerState;
use crate::wire::layout::{part_values, LayerLayout};
use crate::wire::part::Part;

#[cfg(target_endian = "big")]
compile_error!("the hand-off wire carries fp32 little-endian; big-endian hosts are not supported");

/// One chunk to send: bytes `[offset, offset+len)` of `part` of `layer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSpec {
    pub layer: u32,
    pub part: Part,
    pub offset: u64,
    pub len: u32,
}

/// Rounds a wanted chunk size to whole fp32 values, at least one.
pub fn clamp_chunk_bytes(wanted: u32, max_payload: u32) -> u32 {
    let c = wanted.min(max_payload).max(4);
    c - c % 4
}

/// The chunks of one layer, in order.
pub fn plan_layer(layer: u32, layout: &LayerLayout, chunk_bytes: u32) -> Vec<ChunkSpec> {
    let chunk = chunk_bytes.max(4) as u64;
    let mut out = Vec::new();
    for &part in layout.parts() {
        let size = layout.part_bytes(part).unwrap_or(0);
        let mut off = 0;
        while off < size {
            let len = chunk.min(size - off);
            out.push(ChunkSpec { layer, part, offset: off, len: len as u32 });
            off += len;
        }
    }
    if out.is_empty() {
        out.push(ChunkSpec { layer, part: layout.parts()[0], offset: 0, len: 0 });
    }
    out
}

/// The little-endian bytes of `part` of a state (empty if the layer has no such part).
pub fn part_bytes(st: &LayerState, part: Part) -> &[u8] {
    part_values(st, part).map(bytemuck::cast_slice).unwrap_or(&[])
}

/// The payload bytes of one chunk of `st` (empty when the spec lies outside the state).
pub fn chunk_payload<'a>(st: &'a LayerState, spec: &ChunkSpec) -> &'a [u8] {
    let b = part_bytes(st, spec.part);
    let start = (spec.offset as usize).min(b.len());
    let end = (start + spec.len as usize).min(b.len());
    &b[start..end]
}
