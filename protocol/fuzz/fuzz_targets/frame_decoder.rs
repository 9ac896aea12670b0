//! Arbitrary bytes, split at arbitrary points, into the frame decoder: it must return frames
//! or errors and never panic, hang, or buffer more than it was given.
#![no_main]

use k3_protocol::wire::frame::{Frame, FrameDecoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    // First two bytes: the max frame size (in units of 16 bytes) and the split step.
    let max = u16::from_le_bytes([data[0], data[1]]) as u32 * 16;
    let step = (data[2] as usize).max(1);
    let body = &data[3..];
    let mut dec = FrameDecoder::new(max);
    for piece in body.chunks(step) {
        dec.push(piece);
        loop {
            match dec.next_frame() {
                Ok(Some(Frame::Chunk(c))) => {
                    let _ = c.header.verify(&c.payload);
                }
                Ok(Some(Frame::Control(m))) => {
                    let _ = m.name();
                }
                Ok(None) | Err(_) => break,
            }
        }
        assert!(dec.buffered() <= body.len());
    }
    let _ = dec.finish();
});
