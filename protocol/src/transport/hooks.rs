//! Fault injection for the transport tests, compiled only with the `fault-injection` feature
//! (which only dev-dependencies enable: a normal build has no hooks, no hook checks on the send
//! and read paths, and no `NodeConfig::hooks`). Chunk numbers count the chunks of a transfer in
//! the order the sender plans them (0-based).

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::transport::error::TransferError;
use crate::transport::framed::write_error;

#[derive(Debug, Default)]
pub struct FaultHooks {
    /// Sender: flip one payload byte of this chunk after its checksum was computed.
    pub corrupt_chunk: Option<u64>,
    /// Sender: send this chunk twice.
    pub duplicate_chunk: Option<u64>,
    /// Sender: never send this chunk.
    pub drop_chunk: Option<u64>,
    /// Sender: send this chunk after the next one.
    pub delay_chunk: Option<u64>,
    /// Sender: write half of this chunk's frame, then end the stream.
    pub truncate_chunk: Option<u64>,
    /// Sender: write this chunk's frame with a length field over the receiver's maximum.
    pub oversize_chunk: Option<u64>,
    /// Sender: close the whole connection when this chunk is due.
    pub close_at_chunk: Option<u64>,
    /// Sender: after writing `Done`, wait this long before waiting for the decoder's
    /// confirmation (so that the confirmation arrives first).
    pub pause_after_done: Option<std::time::Duration>,
    /// Receiver: stop reading data streams after this many chunks (the connection stays up).
    pub stop_reading_after: Option<u64>,
    /// Client: send these bytes on the request stream instead of the encoded request.
    pub raw_request: Option<Vec<u8>>,
    /// Counts chunks the receiver read (for `stop_reading_after`).
    pub read_count: AtomicU64,
}

/// What the sender does with one planned chunk.
pub(crate) enum ChunkPlan {
    /// Close the whole connection now.
    Close,
    /// Never send it.
    Drop,
    /// Send it (with `fault` applied by the writer), twice if `duplicate`, after the next one
    /// if `delay`.
    Send { fault: Fault, duplicate: bool, delay: bool },
}

/// What a writer does to a chunk frame.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Fault {
    None,
    Corrupt,
    Truncate,
    Oversize,
}

impl FaultHooks {
    fn is(&self, hook: Option<u64>, seq: u64) -> bool {
        hook == Some(seq)
    }

    /// Sender: the plan for chunk `seq`.
    pub(crate) fn chunk(&self, seq: u64) -> ChunkPlan {
        if self.is(self.close_at_chunk, seq) {
            return ChunkPlan::Close;
        }
        if self.is(self.drop_chunk, seq) {
            tracing::warn!(seq, "test hook: dropping a chunk");
            return ChunkPlan::Drop;
        }
        let fault = if self.is(self.corrupt_chunk, seq) {
            Fault::Corrupt
        } else if self.is(self.truncate_chunk, seq) {
            Fault::Truncate
        } else if self.is(self.oversize_chunk, seq) {
            Fault::Oversize
        } else {
            Fault::None
        };
        ChunkPlan::Send { fault, duplicate: self.is(self.duplicate_chunk, seq), delay: self.is(self.delay_chunk, seq) }
    }

    /// Receiver: true once it must stop reading.
    pub(crate) fn reader_must_stop(&self) -> bool {
        match self.stop_reading_after {
            Some(n) => self.read_count.fetch_add(1, Ordering::Relaxed) >= n,
            None => false,
        }
    }

    /// Client: writes `raw_request` instead of the request when set; true if it did.
    pub(crate) async fn send_raw_request(&self, send: &mut quinn::SendStream, peer: SocketAddr) -> Result<bool, TransferError> {
        let Some(raw) = &self.raw_request else { return Ok(false) };
        send.write_all(raw).await.map_err(|e| write_error(peer, e))?;
        let _ = send.finish();
        Ok(true)
    }
}

/// Writer: applies `fault` to a chunk frame (`prefix` + `payload`). Returns the body to write,
/// or `None` when the fault already wrote (and ended) the stream.
pub(crate) async fn apply<'p>(fault: Fault, s: &mut quinn::SendStream, prefix: &mut [u8], payload: &'p [u8], max_frame: u32) -> Option<Cow<'p, [u8]>> {
    match fault {
        Fault::None => Some(payload.into()),
        Fault::Corrupt => {
            let mut v = payload.to_vec();
            if let Some(b) = v.get_mut(payload.len() / 2) {
                *b ^= 0x40;
            }
            Some(v.into())
        }
        Fault::Truncate => {
            let _ = s.write_all(prefix).await;
            let _ = s.write_all(&payload[..payload.len() / 2]).await;
            let _ = s.finish();
            tracing::warn!("test hook: truncated a chunk frame and ended the stream");
            None
        }
        Fault::Oversize => {
            prefix[0..4].copy_from_slice(&(max_frame + 1).to_le_bytes());
            Some(payload.into())
        }
    }
}
