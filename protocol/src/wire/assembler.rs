//! Receiver side: [`StateAssembler`] turns verified chunks into complete layers.
//!
//! For each chunk it checks, in order: the request id, the checksum (header and payload), that
//! the layer exists, that the layer has that part, that `[offset, offset+len)` lies inside the
//! part and is fp32-aligned, that the layer is not already complete, and that the bytes do not
//! overlap bytes already received (a duplicate is an overlap). Only then are the bytes copied
//! into the layer's buffer, which is allocated at its final size from the layout when the
//! layer's first chunk arrives. A layer is handed out once every byte of every part has arrived
//! — never before — and [`StateAssembler::finish`] asserts that every layer arrived exactly
//! once and the totals agree with the sender's `Done`.
//!
//! Memory is bounded: the buffers of layers in progress may total at most
//! `AssemblerLimits::max_open_bytes` (a sender that spreads its chunks over more layers than
//! its flow-control window explains is refused); completed layers leave the assembler
//! (streaming) or go into a [`StateCollector`] (whole state).

use std::collections::BTreeMap;

use crate::handoff::{HandoffState, LayerState};
use crate::wire::error::WireError;
use crate::wire::frame::ChunkHeader;
use crate::wire::layout::{part_values_mut, LayerLayout, StateLayout};
use crate::wire::part::Part;

/// Disjoint received byte ranges of one part (start → end), merged when adjacent.
#[derive(Debug, Default)]
struct RangeSet {
    ranges: BTreeMap<u64, u64>,
}

impl RangeSet {
    /// Inserts `[start, end)`; on overlap returns the first overlapping range.
    fn insert(&mut self, start: u64, end: u64) -> Result<(), (u64, u64)> {
        // The range starting at or before `start`, and the first one after it.
        if let Some((&s, &e)) = self.ranges.range(..=start).next_back() {
            if e > start {
                return Err((s, e));
            }
        }
        if let Some((&s, &e)) = self.ranges.range(start..).next() {
            if s < end {
                return Err((s, e));
            }
        }
        let mut new_start = start;
        let mut new_end = end;
        if let Some((&s, &e)) = self.ranges.range(..=start).next_back() {
            if e == start {
                new_start = s;
                self.ranges.remove(&s);
            }
        }
        if let Some(&e2) = self.ranges.get(&end) {
            self.ranges.remove(&end);
            new_end = e2;
        }
        self.ranges.insert(new_start, new_end);
        Ok(())
    }

    /// The first gap in `[0, size)`.
    fn first_gap(&self, size: u64) -> Option<(u64, u64)> {
        let mut pos = 0;
        for (&s, &e) in &self.ranges {
            if s > pos {
                return Some((pos, s));
            }
            pos = e;
        }
        (pos < size).then_some((pos, size))
    }
}

#[derive(Debug)]
enum Slot {
    Pending,
    Open { state: LayerState, received: Vec<(Part, RangeSet)>, remaining: u64 },
    Done,
}

/// Limits of a receiver.
#[derive(Debug, Clone, Copy)]
pub struct AssemblerLimits {
    /// Total bytes of the buffers of layers with some but not all bytes received. One layer
    /// may always be open, whatever its size.
    pub max_open_bytes: u64,
}

impl Default for AssemblerLimits {
    fn default() -> Self {
        AssemblerLimits { max_open_bytes: 1 << 30 }
    }
}

impl AssemblerLimits {
    /// The bound for a transfer: a sender keeps at most `in_flight` bytes unacknowledged (QUIC
    /// windows plus queued chunks), so the chunks still missing span at most that many bytes
    /// of layers beyond the two it is between; three largest layers plus twice `in_flight`
    /// leave room for reordering across streams.
    pub fn for_transfer(layout: &StateLayout, in_flight: u64) -> AssemblerLimits {
        let largest = layout.layers.iter().filter_map(|l| l.nbytes()).max().unwrap_or(0);
        AssemblerLimits { max_open_bytes: largest.saturating_mul(3).saturating_add(in_flight.saturating_mul(2)) }
    }
}

/// Counts of what arrived.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AssemblyTotals {
    pub layers: u32,
    pub chunks: u64,
    pub bytes: u64,
}

#[derive(Debug)]
pub struct StateAssembler {
    request: u64,
    layout: StateLayout,
    slots: Vec<Slot>,
    open: usize,
    open_bytes: u64,
    limits: AssemblerLimits,
    totals: AssemblyTotals,
}

impl StateAssembler {
    pub fn new(request: u64, layout: StateLayout, limits: AssemblerLimits) -> StateAssembler {
        let slots = layout.layers.iter().map(|_| Slot::Pending).collect();
        StateAssembler { request, layout, slots, open: 0, open_bytes: 0, limits, totals: AssemblyTotals::default() }
    }

    pub fn layout(&self) -> &StateLayout {
        &self.layout
    }

    pub fn totals(&self) -> AssemblyTotals {
        self.totals
    }

    /// Layers in progress.
    pub fn open_layers(&self) -> usize {
        self.open
    }

    /// Bytes of the buffers of layers in progress.
    pub fn open_bytes(&self) -> u64 {
        self.open_bytes
    }

    pub fn is_complete(&self) -> bool {
        self.slots.iter().all(|s| matches!(s, Slot::Done))
    }

    /// Verifies one chunk and stores its bytes. Returns the layer when this chunk completed it.
    pub fn accept(&mut self, h: &ChunkHeader, payload: &[u8]) -> Result<Option<(u32, LayerState)>, WireError> {
        if h.request != self.request {
            return Err(WireError::WrongRequest { got: h.request, want: self.request });
        }
        h.verify(payload)?;
        let li = h.layer as usize;
        let layout: LayerLayout = *self.layout.layers.get(li).ok_or(WireError::LayerOutOfRange { layer: h.layer, layers: self.layout.layers.len() })?;
        if !layout.parts().contains(&h.part) {
            return Err(WireError::NoSuchPart { layer: h.layer, part: h.part });
        }
        let size = layout.part_bytes(h.part).ok_or(WireError::LayerSizeOverflow { layer: li })?;
        let end = h.offset.checked_add(h.len as u64);
        let layer_bytes = layout.nbytes().unwrap_or(u64::MAX);
        let empty_marker = h.len == 0 && h.offset == 0 && layer_bytes == 0 && h.part == layout.parts()[0];
        let aligned = h.offset.is_multiple_of(4) && h.len.is_multiple_of(4);
        match end {
            Some(end) if aligned && end <= size && (h.len > 0 || empty_marker) => {}
            _ => return Err(WireError::OutOfRange { layer: h.layer, part: h.part, offset: h.offset, len: h.len, size }),
        }
        if matches!(self.slots[li], Slot::Done) {
            return Err(WireError::LayerAlreadyComplete { layer: h.layer });
        }
        if matches!(self.slots[li], Slot::Pending) {
            if self.open > 0 && self.open_bytes.saturating_add(layer_bytes) > self.limits.max_open_bytes {
                return Err(WireError::TooManyOpenLayers { layer: h.layer, open: self.open, open_bytes: self.open_bytes, limit: self.limits.max_open_bytes });
            }
            let state = layout.alloc();
            let received = layout.parts().iter().map(|p| (*p, RangeSet::default())).collect();
            self.slots[li] = Slot::Open { state, received, remaining: layer_bytes };
            self.open += 1;
            self.open_bytes += layer_bytes;
        }
        let Slot::Open { state, received, remaining } = &mut self.slots[li] else {
            return Err(WireError::SlotState { layer: li });
        };
        if h.len > 0 {
            let set = &mut received.iter_mut().find(|(p, _)| *p == h.part).ok_or(WireError::NoSuchPart { layer: h.layer, part: h.part })?.1;
            let start = h.offset;
            let stop = start + h.len as u64;
            set.insert(start, stop).map_err(|(ps, pe)| WireError::Overlap {
                layer: h.layer,
                part: h.part,
                offset: h.offset,
                len: h.len,
                prev_start: ps,
                prev_end: pe,
            })?;
            let values = part_values_mut(state, h.part).ok_or(WireError::NoSuchPart { layer: h.layer, part: h.part })?;
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(values);
            bytes[start as usize..stop as usize].copy_from_slice(payload);
            *remaining -= h.len as u64;
        }
        self.totals.chunks += 1;
        self.totals.bytes += h.len as u64;
        if *remaining == 0 {
            let Slot::Open { state, .. } = std::mem::replace(&mut self.slots[li], Slot::Done) else {
                return Err(WireError::SlotState { layer: li });
            };
            self.open -= 1;
            self.open_bytes -= layer_bytes;
            self.totals.layers += 1;
            return Ok(Some((h.layer, state)));
        }
        Ok(None)
    }

    /// What is still missing, e.g. "layer 3 latent bytes [1048576, 2097152)", or None.
    pub fn first_missing(&self) -> Option<String> {
        for (l, slot) in self.slots.iter().enumerate() {
            match slot {
                Slot::Done => {}
                Slot::Pending => return Some(format!("layer {l} never arrived")),
                Slot::Open { received, .. } => {
                    let layout = self.layout.layers[l];
                    for (p, set) in received {
                        if let Some((s, e)) = set.first_gap(layout.part_bytes(*p).unwrap_or(0)) {
                            return Some(format!("layer {l} {p} bytes [{s}, {e}) never arrived"));
                        }
                    }
                    return Some(format!("layer {l} incomplete"));
                }
            }
        }
        None
    }

    /// Asserts every layer arrived exactly once and the sender's totals match ours.
    pub fn finish(&self, sender_layers: u32, sender_chunks: u64, sender_bytes: u64) -> Result<AssemblyTotals, WireError> {
        if let Some(m) = self.first_missing() {
            let done = self.totals.layers;
            return Err(WireError::Incomplete(format!("{m} ({done} of {} layers complete)", self.slots.len())));
        }
        let t = self.totals;
        if sender_layers as u64 != t.layers as u64 {
            return Err(WireError::TotalsMismatch { what: "layers", said: sender_layers as u64, got: t.layers as u64 });
        }
        if sender_chunks != t.chunks {
            return Err(WireError::TotalsMismatch { what: "chunks", said: sender_chunks, got: t.chunks });
        }
        if sender_bytes != t.bytes {
            return Err(WireError::TotalsMismatch { what: "bytes", said: sender_bytes, got: t.bytes });
        }
        Ok(t)
    }
}

/// Collects completed layers into a whole [`HandoffState`].
#[derive(Debug)]
pub struct StateCollector {
    rows: usize,
    layers: Vec<Option<LayerState>>,
}

impl StateCollector {
    pub fn new(layout: &StateLayout) -> StateCollector {
        StateCollector { rows: layout.rows().unwrap_or(0) as usize, layers: layout.layers.iter().map(|_| None).collect() }
    }

    /// Stores one completed layer; a second copy of a layer is an error.
    pub fn put(&mut self, layer: u32, st: LayerState) -> Result<(), WireError> {
        let n = self.layers.len();
        let slot = self.layers.get_mut(layer as usize).ok_or(WireError::LayerOutOfRange { layer, layers: n })?;
        if slot.is_some() {
            return Err(WireError::LayerAlreadyComplete { layer });
        }
        *slot = Some(st);
        Ok(())
    }

    /// The state, when every layer is present. `tokens` of the result is the number of
    /// rows this (delta) state carries.
    pub fn into_state(self) -> Result<HandoffState, WireError> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for (l, s) in self.layers.into_iter().enumerate() {
            layers.push(s.ok_or_else(|| WireError::Incomplete(format!("layer {l} never arrived")))?);
        }
        Ok(HandoffState { tokens: self.rows, layers })
    }
}
