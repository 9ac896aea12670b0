//! Framing: control messages and chunks round-trip through `FrameDecoder` however the bytes
//! are split; bad frames (truncated, oversized, unknown kind, bad header, trailing bytes) give
//! named errors; arbitrary bytes never panic (proptest).

use k3_protocol::fingerprint::Fingerprint;
use k3_protocol::wire::frame::{encode_chunk, encode_control, ChunkHeader, Frame, FrameDecoder, DEFAULT_MAX_FRAME, KIND_CHUNK, KIND_CONTROL};
use k3_protocol::wire::*;
use proptest::prelude::*;

fn sample_messages() -> Vec<Message> {
    let caps = Capabilities { dtypes: vec![StateDtype::F32], max_frame_size: DEFAULT_MAX_FRAME, backend: "cuda".into(), max_streams: 8 };
    vec![
        Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            model_fingerprint: Fingerprint([7; 32]),
            state_identity: Some(Fingerprint([8; 32])),
            capabilities: caps.clone(),
            node_name: "mac".into(),
        }),
        Message::HelloAck(HelloAck {
            protocol_version: PROTOCOL_VERSION,
            model_fingerprint: Fingerprint([7; 32]),
            state_identity: Some(Fingerprint([8; 32])),
            capabilities: caps,
            node_name: "gpu".into(),
            max_frame_size: 4096,
        }),
        Message::PrefillRequest(PrefillRequest {
            session: SessionId([3; 16]),
            base: Some(BasePrefix { tokens: 131, token_prefix_hash: k3_protocol::handoff::token_prefix_hash(&[1, 2, 3]) }),
            tokens: (0..1000).collect(),
            image_embeddings: Some(ImageEmbeddings { positions: vec![4, 5], width: 3, rows: vec![0.5; 6] }),
            options: PrefillOptions::default(),
        }),
        Message::Accepted(Accepted {
            request: 9,
            base_tokens: 131,
            layout: StateLayout { layers: vec![LayerLayout::Kda { heads: 2, head_dim: 32, window: 3 }, LayerLayout::Mla { width: 80, rows: 169 }] },
            streams: 4,
            chunk_bytes: 1 << 20,
        }),
        Message::DataStream { request: 9, index: 3 },
        Message::Progress(Progress { request: 9, layers_done: 4, layers_total: 9, compute_s: 1.5 }),
        Message::Heartbeat { request: 9 },
        Message::Done(Done {
            request: 9,
            layers: 9,
            chunks: 12,
            state_bytes: 123456,
            timing: Timing { compute_s: 2.0, weight_wait_s: 0.1, send_wait_s: 0.2, total_s: 2.5, state_bytes: 123456, wire_bytes: 123900, chunks: 12 },
            last_logits: Some(vec![0.25; 1024]),
        }),
        Message::Error(ErrorMsg { code: ErrorCode::BaseNotHeld, message: "evicted".into() }),
        Message::Abort(ErrorMsg { code: ErrorCode::Cancelled, message: "user pressed ^C".into() }),
    ]
}

fn sample_chunk(len: usize) -> (ChunkHeader, Vec<u8>) {
    let payload: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    (ChunkHeader::new(9, 3, Part::Latent, 4096, &payload), payload)
}

fn stream_bytes() -> (Vec<u8>, usize) {
    let mut bytes = Vec::new();
    let msgs = sample_messages();
    for m in &msgs {
        bytes.extend(encode_control(m).unwrap());
    }
    let (h, p) = sample_chunk(4000);
    bytes.extend(encode_chunk(&h, &p));
    (bytes, msgs.len() + 1)
}

fn decode_all(bytes: &[u8], split: &[usize], max: u32) -> Result<Vec<Frame>, WireError> {
    let mut dec = FrameDecoder::new(max);
    let mut out = Vec::new();
    let mut pos = 0;
    for &s in split.iter().chain(std::iter::once(&bytes.len())) {
        let end = s.clamp(pos, bytes.len());
        dec.push(&bytes[pos..end]);
        pos = end;
        while let Some(f) = dec.next_frame()? {
            out.push(f);
        }
    }
    dec.finish()?;
    Ok(out)
}

#[test]
fn every_message_and_a_chunk_round_trip() {
    let (bytes, n) = stream_bytes();
    let frames = decode_all(&bytes, &[], DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(frames.len(), n);
    for (f, m) in frames.iter().zip(sample_messages()) {
        assert_eq!(f, &Frame::Control(m));
    }
    let Frame::Chunk(c) = frames.last().unwrap() else { panic!("last frame is not a chunk") };
    let (h, p) = sample_chunk(4000);
    assert_eq!(c.header, h);
    assert_eq!(&c.payload[..], &p[..]);
    c.header.verify(&c.payload).unwrap();
}

#[test]
fn byte_by_byte_feeding_gives_the_same_frames() {
    let (bytes, n) = stream_bytes();
    let split: Vec<usize> = (1..bytes.len()).collect();
    let frames = decode_all(&bytes, &split, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(frames.len(), n);
    assert_eq!(frames, decode_all(&bytes, &[], DEFAULT_MAX_FRAME).unwrap());
}

#[test]
fn truncated_stream_is_an_error_naming_the_missing_bytes() {
    let (h, p) = sample_chunk(1000);
    let bytes = encode_chunk(&h, &p);
    for cut in [1, 4, 5, 20, 37, 500, bytes.len() - 1] {
        let err = decode_all(&bytes[..cut], &[], DEFAULT_MAX_FRAME).unwrap_err();
        match err {
            WireError::Truncated { have, need } => {
                assert_eq!(have, cut);
                assert_eq!(need, if cut < 4 { 4 } else { bytes.len() });
            }
            e => panic!("cut at {cut}: {e}"),
        }
    }
}

#[test]
fn oversized_frame_is_refused_before_its_body_arrives() {
    let mut dec = FrameDecoder::new(1024);
    dec.push(&(1025u32).to_le_bytes());
    let e = dec.next_frame().unwrap_err();
    assert_eq!(e, WireError::Oversized { len: 1025, max: 1024 });
    assert!(e.to_string().contains("exceeds the maximum frame size of 1024"));
    // A real chunk over the limit.
    let (h, p) = sample_chunk(2000);
    assert!(matches!(decode_all(&encode_chunk(&h, &p), &[], 1024), Err(WireError::Oversized { .. })));
    // u32::MAX claims are refused too, without allocating.
    let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
    dec.push(&[0xff, 0xff, 0xff, 0xff, 1]);
    assert!(matches!(dec.next_frame(), Err(WireError::Oversized { .. })));
}

#[test]
fn malformed_frames_get_named_errors() {
    // Unknown kind.
    assert_eq!(decode_all(&[1, 0, 0, 0, 9], &[], 64).unwrap_err(), WireError::UnknownFrameKind(9));
    // Zero length.
    assert!(matches!(decode_all(&[0, 0, 0, 0], &[], 64).unwrap_err(), WireError::ShortFrame { .. }));
    // Chunk frame shorter than its header.
    let mut b = vec![11, 0, 0, 0, KIND_CHUNK];
    b.extend([0u8; 10]);
    assert!(matches!(decode_all(&b, &[], 64).unwrap_err(), WireError::ShortFrame { .. }));
    // Bad part tag.
    let (h, p) = sample_chunk(8);
    let mut b = encode_chunk(&h, &p);
    b[5 + 12] = 77;
    assert_eq!(decode_all(&b, &[], 1024).unwrap_err(), WireError::UnknownPart(77));
    // Reserved bytes set.
    let mut b = encode_chunk(&h, &p);
    b[5 + 14] = 1;
    assert_eq!(decode_all(&b, &[], 1024).unwrap_err(), WireError::ReservedBits);
    // Header length disagrees with the frame.
    let mut b = encode_chunk(&h, &p);
    b[5 + 24] = 9;
    assert!(matches!(decode_all(&b, &[], 1024).unwrap_err(), WireError::ChunkLength { header: 9, frame: 8 }));
    // Garbage control body, and a valid message with trailing bytes.
    assert!(matches!(decode_all(&[3, 0, 0, 0, KIND_CONTROL, 0xfe, 0xff], &[], 64).unwrap_err(), WireError::BadMessage(_)));
    let mut b = encode_control(&Message::Heartbeat { request: 1 }).unwrap();
    b.push(0);
    let len = u32::from_le_bytes(b[0..4].try_into().unwrap()) + 1;
    b[0..4].copy_from_slice(&len.to_le_bytes());
    let e = decode_all(&b, &[], 64).unwrap_err();
    assert!(e.to_string().contains("trailing"), "{e}");
}

#[test]
fn checksum_covers_header_and_payload() {
    let (h, p) = sample_chunk(256);
    h.verify(&p).unwrap();
    let mut bad = p.clone();
    bad[100] ^= 1;
    assert!(matches!(h.verify(&bad), Err(WireError::Checksum { layer: 3, offset: 4096, .. })));
    let moved = ChunkHeader { offset: 8192, ..h };
    assert!(matches!(moved.verify(&p), Err(WireError::Checksum { .. })), "a changed offset must fail the checksum");
    let other_layer = ChunkHeader { layer: 4, ..h };
    assert!(other_layer.verify(&p).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    /// Arbitrary bytes, split arbitrarily: the decoder returns frames or errors, never panics,
    /// and never buffers more than it was given.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048), cuts in proptest::collection::vec(0usize..2048, 0..8), max in 0u32..4096) {
        let mut cuts = cuts;
        cuts.sort();
        let mut dec = FrameDecoder::new(max);
        let mut pos = 0;
        for &c in cuts.iter().chain(std::iter::once(&bytes.len())) {
            let end = c.clamp(pos, bytes.len());
            dec.push(&bytes[pos..end]);
            pos = end;
            loop {
                match dec.next_frame() {
                    Ok(Some(Frame::Chunk(c))) => { let _ = c.header.verify(&c.payload); }
                    Ok(Some(Frame::Control(_))) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            prop_assert!(dec.buffered() <= bytes.len());
        }
        let _ = dec.finish();
    }

    /// Valid frames with random corruption of one byte: never a panic, and a corrupted chunk
    /// never passes its checksum unless the flipped byte was outside what the CRC covers.
    #[test]
    fn one_flipped_byte_never_panics(len in 4usize..600, at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let len = len - len % 4;
        let (h, p) = sample_chunk(len);
        let mut b = encode_chunk(&h, &p);
        let i = at.index(b.len());
        b[i] ^= 1 << bit;
        let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
        dec.push(&b);
        if let Ok(Some(Frame::Chunk(c))) = dec.next_frame() {
            // Only the length field (bytes 0..4) and checksum-covered bytes exist; a flip in
            // bytes 5.. is covered by the CRC (or is the CRC itself).
            if i >= 5 {
                prop_assert!(c.header.verify(&c.payload).is_err(), "flip at {} passed the checksum", i);
            }
        }
    }

    /// Any message sequence round-trips through any split.
    #[test]
    fn messages_round_trip_through_any_split(cuts in proptest::collection::vec(0usize..12000, 0..16)) {
        let (bytes, n) = stream_bytes();
        let mut cuts = cuts;
        cuts.sort();
        let frames = decode_all(&bytes, &cuts, DEFAULT_MAX_FRAME).unwrap();
        prop_assert_eq!(frames.len(), n);
    }
}
