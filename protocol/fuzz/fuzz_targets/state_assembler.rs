//! Arbitrary chunk frames into a `StateAssembler` of a small fixed layout: any sequence of
//! chunks gives layers or named errors, never a panic; a layer is only handed out complete.
#![no_main]

use k3_protocol::wire::frame::{Frame, FrameDecoder};
use k3_protocol::wire::{AssemblerLimits, LayerLayout, StateAssembler, StateLayout};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let layout = StateLayout {
        layers: vec![
            LayerLayout::Kda { heads: 1, head_dim: 4, window: 2 },
            LayerLayout::Mla { width: 4, rows: 3 },
            LayerLayout::Mla { width: 4, rows: 3 },
        ],
    };
    let mut asm = StateAssembler::new(0, layout.clone(), AssemblerLimits { max_open_bytes: 128 });
    let mut dec = FrameDecoder::new(4096);
    dec.push(data);
    while let Ok(Some(frame)) = dec.next_frame() {
        if let Frame::Chunk(c) = frame {
            match asm.accept(&c.header, &c.payload) {
                Ok(Some((l, st))) => assert!(layout.layers[l as usize].check_state(&st).is_ok()),
                Ok(None) => {}
                Err(_) => break,
            }
        }
    }
    let _ = asm.finish(3, 0, 0);
});
