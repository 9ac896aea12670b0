//! Frames over quinn streams: the sans-I/O [`FrameDecoder`] fed from a `RecvStream`, and
//! control messages written to a `SendStream`.

use std::net::SocketAddr;

use crate::transport::error::{connection_lost, TransferError};
use crate::wire::frame::{encode_control, Frame, FrameDecoder, FRAME_HEADER_LEN};
use crate::wire::Message;

/// Largest single read from a stream.
const READ_MAX: usize = 1 << 20;

pub(crate) struct FramedRecv {
    pub(crate) stream: quinn::RecvStream,
    dec: FrameDecoder,
    peer: SocketAddr,
}

impl FramedRecv {
    pub(crate) fn new(stream: quinn::RecvStream, max_frame: u32, peer: SocketAddr) -> FramedRecv {
        FramedRecv { stream, dec: FrameDecoder::new(max_frame), peer }
    }

    pub(crate) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The next frame; Ok(None) when the peer finished the stream on a frame boundary.
    pub(crate) async fn next(&mut self) -> Result<Option<Frame>, TransferError> {
        loop {
            if let Some(f) = self.dec.next_frame().map_err(|e| TransferError::Corrupt { peer: self.peer, source: e })? {
                return Ok(Some(f));
            }
            let want = self.dec.wanted().clamp(FRAME_HEADER_LEN, READ_MAX);
            let space = self.dec.prepare(want);
            match self.stream.read(space).await {
                Ok(Some(n)) => self.dec.commit(n),
                Ok(None) => {
                    self.dec.commit(0);
                    self.dec.finish().map_err(|e| TransferError::Corrupt { peer: self.peer, source: e })?;
                    return Ok(None);
                }
                Err(e) => {
                    self.dec.commit(0);
                    return Err(read_error(self.peer, e));
                }
            }
        }
    }

    /// The next frame, which must be a control message.
    pub(crate) async fn next_message(&mut self) -> Result<Option<Message>, TransferError> {
        match self.next().await? {
            None => Ok(None),
            Some(Frame::Control(m)) => Ok(Some(m)),
            Some(Frame::Chunk(c)) => {
                Err(TransferError::Protocol { peer: self.peer, reason: format!("a state chunk (layer {}) on a control stream", c.header.layer) })
            }
        }
    }
}

pub(crate) fn read_error(peer: SocketAddr, e: quinn::ReadError) -> TransferError {
    match e {
        quinn::ReadError::ConnectionLost(c) => connection_lost(peer, &c),
        quinn::ReadError::Reset(code) => {
            TransferError::Aborted { peer, code: crate::wire::ErrorCode::Cancelled, message: format!("the peer reset the stream (code {code})") }
        }
        other => TransferError::Protocol { peer, reason: format!("stream read: {other}") },
    }
}

pub(crate) fn write_error(peer: SocketAddr, e: quinn::WriteError) -> TransferError {
    match e {
        quinn::WriteError::ConnectionLost(c) => connection_lost(peer, &c),
        quinn::WriteError::Stopped(code) => {
            TransferError::Aborted { peer, code: crate::wire::ErrorCode::Cancelled, message: format!("the peer stopped reading the stream (code {code})") }
        }
        other => TransferError::Local(format!("stream write to {peer}: {other}")),
    }
}

/// Writes one control message as a frame.
pub(crate) async fn write_message(send: &mut quinn::SendStream, peer: SocketAddr, msg: &Message) -> Result<(), TransferError> {
    let bytes = encode_control(msg).map_err(|e| TransferError::Local(format!("encoding {}: {e}", msg.name())))?;
    send.write_all(&bytes).await.map_err(|e| write_error(peer, e))
}

/// Finishes a stream and waits (bounded) until the peer has received everything on it.
pub(crate) async fn finish_and_flush(send: &mut quinn::SendStream, within: std::time::Duration) {
    let _ = send.finish();
    let _ = tokio::time::timeout(within, send.stopped()).await;
}

/// Stream error code for a cancelled transfer.
pub(crate) const CANCEL_CODE: u32 = 1;
/// Largest frame on the handshake stream.
pub(crate) const HANDSHAKE_MAX_FRAME: u32 = 1 << 20;
