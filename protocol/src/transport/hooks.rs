//! Fault injection for the transport tests. Chunk numbers count the chunks of a transfer in
//! the order the sender plans them (0-based). Production configs leave everything off.

use std::sync::atomic::{AtomicU64, Ordering};

#[doc(hidden)]
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

impl FaultHooks {
    pub(crate) fn is(&self, hook: Option<u64>, seq: u64) -> bool {
        hook == Some(seq)
    }

    /// Receiver: true once it must stop reading.
    pub(crate) fn reader_must_stop(&self) -> bool {
        match self.stop_reading_after {
            Some(n) => self.read_count.fetch_add(1, Ordering::Relaxed) >= n,
            None => false,
        }
    }
}
