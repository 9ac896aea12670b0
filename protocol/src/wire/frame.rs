//! Framing. Every stream carries a sequence of frames:
//!
//! ```text
//! frame   = len:u32 LE (bytes after this field) | kind:u8 | body
//! kind 1  = Control: body is one bincode-2 `Message`
//! kind 2  = Chunk:   body is a 32-byte `ChunkHeader` then `header.len` payload bytes (fp32 LE)
//! ```
//!
//! [`FrameDecoder`] is a push decoder: feed it whatever bytes arrived, take complete frames
//! out. It checks the declared length against the maximum before buffering anything, never
//! allocates more than what actually arrived, and never panics on any input (property test
//! and fuzz target).

use bytes::{Buf, Bytes, BytesMut};

use crate::wire::checksum::chunk_crc;
use crate::wire::error::WireError;
use crate::wire::messages::Message;
use crate::wire::part::Part;

pub const FRAME_HEADER_LEN: usize = 5;
pub const CHUNK_HEADER_LEN: usize = 32;
pub const KIND_CONTROL: u8 = 1;
pub const KIND_CHUNK: u8 = 2;

/// Hard cap on any frame (control frames carry requests with image embeddings).
pub const ABSOLUTE_MAX_FRAME: u32 = 1 << 30;
/// Default max data-stream frame: 1 MiB chunks plus headers.
pub const DEFAULT_MAX_FRAME: u32 = (1 << 20) + 64;
/// Default max frame on control (handshake / request) streams.
pub const DEFAULT_MAX_CONTROL_FRAME: u32 = 256 << 20;

fn bincode_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<{ ABSOLUTE_MAX_FRAME as usize }>()
}

/// Fixed-size header of a state chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub request: u64,
    pub layer: u32,
    pub part: Part,
    /// Byte offset within the part.
    pub offset: u64,
    /// Payload bytes.
    pub len: u32,
    /// CRC-32C of the header (this field zeroed) and the payload.
    pub crc: u32,
}

impl ChunkHeader {
    pub fn encode(&self) -> [u8; CHUNK_HEADER_LEN] {
        let mut b = [0u8; CHUNK_HEADER_LEN];
        b[0..8].copy_from_slice(&self.request.to_le_bytes());
        b[8..12].copy_from_slice(&self.layer.to_le_bytes());
        b[12] = self.part as u8;
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..32].copy_from_slice(&self.crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<ChunkHeader, WireError> {
        if b.len() < CHUNK_HEADER_LEN {
            return Err(WireError::ShortFrame { kind: KIND_CHUNK, len: b.len() + 1 });
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
        let part = Part::from_u8(b[12]).ok_or(WireError::UnknownPart(b[12]))?;
        if b[13..16] != [0, 0, 0] {
            return Err(WireError::ReservedBits);
        }
        Ok(ChunkHeader { request: u64_at(0), layer: u32_at(8), part, offset: u64_at(16), len: u32_at(24), crc: u32_at(28) })
    }

    /// The checksum this header (whatever its `crc` field says) and `payload` should carry.
    pub fn compute_crc(&self, payload: &[u8]) -> u32 {
        let mut h = *self;
        h.crc = 0;
        chunk_crc(&h.encode()[..28], payload)
    }

    /// A header for `payload` with its checksum filled in.
    pub fn new(request: u64, layer: u32, part: Part, offset: u64, payload: &[u8]) -> ChunkHeader {
        let mut h = ChunkHeader { request, layer, part, offset, len: payload.len() as u32, crc: 0 };
        h.crc = h.compute_crc(payload);
        h
    }

    /// Checks the payload length and checksum.
    pub fn verify(&self, payload: &[u8]) -> Result<(), WireError> {
        if payload.len() != self.len as usize {
            return Err(WireError::ChunkLength { header: self.len, frame: payload.len() });
        }
        let got = self.compute_crc(payload);
        if got != self.crc {
            return Err(WireError::Checksum { layer: self.layer, part: self.part, offset: self.offset, len: self.len, got, want: self.crc });
        }
        Ok(())
    }

    /// The frame prefix (length, kind, header) that goes before the payload on the wire.
    pub fn frame_prefix(&self) -> [u8; FRAME_HEADER_LEN + CHUNK_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN + CHUNK_HEADER_LEN];
        let len = 1 + CHUNK_HEADER_LEN as u32 + self.len;
        b[0..4].copy_from_slice(&len.to_le_bytes());
        b[4] = KIND_CHUNK;
        b[5..].copy_from_slice(&self.encode());
        b
    }
}

/// A state chunk as received (checksum not yet verified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub header: ChunkHeader,
    pub payload: Bytes,
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    Control(Message),
    Chunk(Chunk),
}

/// Encodes a control message as a whole frame.
pub fn encode_control(msg: &Message) -> Result<Vec<u8>, WireError> {
    let body = bincode::serde::encode_to_vec(msg, bincode_config()).map_err(|e| WireError::BadMessage(e.to_string()))?;
    let len = body.len() as u64 + 1;
    if len > ABSOLUTE_MAX_FRAME as u64 {
        return Err(WireError::Oversized { len, max: ABSOLUTE_MAX_FRAME as u64 });
    }
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.push(KIND_CONTROL);
    out.extend_from_slice(&body);
    Ok(out)
}

/// Encodes a whole chunk frame (prefix + payload) into one buffer (tests, fuzz seeds).
pub fn encode_chunk(header: &ChunkHeader, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + CHUNK_HEADER_LEN + payload.len());
    out.extend_from_slice(&header.frame_prefix());
    out.extend_from_slice(payload);
    out
}

/// Decodes a control message body, requiring it to use every byte.
pub fn decode_message(body: &[u8]) -> Result<Message, WireError> {
    let (msg, used): (Message, usize) = bincode::serde::decode_from_slice(body, bincode_config()).map_err(|e| WireError::BadMessage(e.to_string()))?;
    if used != body.len() {
        return Err(WireError::BadMessage(format!("{} trailing bytes after a {}", body.len() - used, msg.name())));
    }
    Ok(msg)
}

/// Push decoder of frames on one stream.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: BytesMut,
    max_frame: u32,
    /// Length of `buf` before an uncommitted [`FrameDecoder::prepare`].
    prepared: Option<usize>,
}

impl FrameDecoder {
    /// `max_frame`: the largest `len` field accepted (kind byte + body).
    pub fn new(max_frame: u32) -> FrameDecoder {
        FrameDecoder { buf: BytesMut::new(), max_frame: max_frame.min(ABSOLUTE_MAX_FRAME), prepared: None }
    }

    pub fn max_frame(&self) -> u32 {
        self.max_frame
    }

    /// Appends received bytes.
    pub fn push(&mut self, data: &[u8]) {
        self.rollback();
        self.buf.extend_from_slice(data);
    }

    /// A zeroed space of `n` bytes at the end of the buffer for a reader to fill in place;
    /// [`FrameDecoder::commit`] then keeps the first `read` of them.
    pub fn prepare(&mut self, n: usize) -> &mut [u8] {
        self.rollback();
        let old = self.buf.len();
        self.prepared = Some(old);
        self.buf.resize(old + n, 0);
        &mut self.buf[old..]
    }

    /// Keeps `read` bytes of the space handed out by the last [`FrameDecoder::prepare`].
    pub fn commit(&mut self, read: usize) {
        if let Some(old) = self.prepared.take() {
            let end = (old + read).min(self.buf.len());
            self.buf.truncate(end);
        }
    }

    fn rollback(&mut self) {
        if let Some(old) = self.prepared.take() {
            self.buf.truncate(old);
        }
    }

    /// Bytes buffered and not yet returned as frames.
    pub fn buffered(&mut self) -> usize {
        self.rollback();
        self.buf.len()
    }

    /// Bytes still missing for the frame in progress (0 when none is started), so a reader
    /// can ask its stream for just that much.
    pub fn wanted(&mut self) -> usize {
        self.rollback();
        if self.buf.len() < FRAME_HEADER_LEN {
            return FRAME_HEADER_LEN - self.buf.len();
        }
        let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        (4 + len).saturating_sub(self.buf.len())
    }

    /// The next complete frame, Ok(None) when more bytes are needed. After an error the
    /// stream is unusable (the caller drops it).
    pub fn next_frame(&mut self) -> Result<Option<Frame>, WireError> {
        self.rollback();
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]);
        if len > self.max_frame {
            return Err(WireError::Oversized { len: len as u64, max: self.max_frame as u64 });
        }
        if len == 0 {
            return Err(WireError::ShortFrame { kind: 0, len: 0 });
        }
        if self.buf.len() < 4 + len as usize {
            return Ok(None);
        }
        self.buf.advance(4);
        let mut body = self.buf.split_to(len as usize).freeze();
        let kind = body[0];
        body.advance(1);
        match kind {
            KIND_CONTROL => Ok(Some(Frame::Control(decode_message(&body)?))),
            KIND_CHUNK => {
                if body.len() < CHUNK_HEADER_LEN {
                    return Err(WireError::ShortFrame { kind, len: body.len() + 1 });
                }
                let header = ChunkHeader::decode(&body[..CHUNK_HEADER_LEN])?;
                let payload = body.slice(CHUNK_HEADER_LEN..);
                if payload.len() != header.len as usize {
                    return Err(WireError::ChunkLength { header: header.len, frame: payload.len() });
                }
                Ok(Some(Frame::Chunk(Chunk { header, payload })))
            }
            k => Err(WireError::UnknownFrameKind(k)),
        }
    }

    /// The stream ended: an error if a frame was left half-received.
    pub fn finish(&mut self) -> Result<(), WireError> {
        self.rollback();
        if self.buf.is_empty() {
            return Ok(());
        }
        let need = if self.buf.len() < 4 { 4 } else { 4 + u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize };
        Err(WireError::Truncated { have: self.buf.len(), need })
    }
}
