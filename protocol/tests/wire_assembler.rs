//! State assembly without a network: chunking then assembling gives back the exact state in
//! any chunk order; every kind of bad chunk (corrupt, duplicate, overlapping, misplaced,
//! missing, surplus) is refused with an error naming layer, part and bytes; a layer is only
//! handed out complete; `finish` asserts every layer arrived exactly once.

use k3_protocol::handoff::{load_session, HandoffState, KdaState, LayerState, MlaState};
use k3_protocol::testdata::{golden_dir, tiny_a_golden};
use k3_protocol::wire::chunker::{chunk_payload, plan_layer, ChunkSpec};
use k3_protocol::wire::frame::ChunkHeader;
use k3_protocol::wire::*;
use k3_protocol::Checkpoint;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const REQ: u64 = 42;

fn synthetic_state(rows: usize, seed: u64) -> HandoffState {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = |n: usize| (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect::<Vec<f32>>();
    let kda = |v: &mut dyn FnMut(usize) -> Vec<f32>| {
        LayerState::Kda(KdaState { heads: 2, head_dim: 8, recurrent: v(2 * 8 * 8), conv_q: v(3 * 16), conv_k: v(3 * 16), conv_v: v(3 * 16) })
    };
    let layers = vec![
        kda(&mut v),
        kda(&mut v),
        LayerState::Mla(MlaState { width: 24, latent: v(rows * 24) }),
        kda(&mut v),
        LayerState::Mla(MlaState { width: 24, latent: v(rows * 24) }),
    ];
    HandoffState { tokens: rows, layers }
}

fn chunks_of(st: &HandoffState, chunk_bytes: u32) -> Vec<(ChunkHeader, Vec<u8>)> {
    let layout = StateLayout::of_state(st);
    let mut out = Vec::new();
    for (l, ly) in layout.layers.iter().enumerate() {
        for spec in plan_layer(l as u32, ly, chunk_bytes) {
            let p = chunk_payload(&st.layers[l], &spec).to_vec();
            out.push((ChunkHeader::new(REQ, spec.layer, spec.part, spec.offset, &p), p));
        }
    }
    out
}

/// Feeds chunks, collecting completed layers; returns the first error.
fn assemble(layout: &StateLayout, chunks: &[(ChunkHeader, Vec<u8>)]) -> Result<(StateAssembler, StateCollector), WireError> {
    let mut asm = StateAssembler::new(REQ, layout.clone(), AssemblerLimits { max_open_bytes: u64::MAX });
    let mut col = StateCollector::new(layout);
    for (h, p) in chunks {
        if let Some((l, st)) = asm.accept(h, p)? {
            col.put(l, st)?;
        }
    }
    Ok((asm, col))
}

#[test]
fn round_trip_in_order_and_shuffled() {
    let st = synthetic_state(37, 1);
    let layout = StateLayout::of_state(&st);
    for chunk_bytes in [4, 100, 1000, 1 << 20] {
        let mut chunks = chunks_of(&st, chunk_bytes);
        let n = chunks.len() as u64;
        let bytes = layout.nbytes().unwrap();
        for shuffle in [false, true] {
            if shuffle {
                chunks.shuffle(&mut rand::rngs::StdRng::seed_from_u64(chunk_bytes as u64));
            }
            let (asm, col) = assemble(&layout, &chunks).unwrap();
            let t = asm.finish(5, n, bytes).unwrap();
            assert_eq!(t, AssemblyTotals { layers: 5, chunks: n, bytes });
            assert_eq!(col.into_state().unwrap(), st, "chunk {chunk_bytes} shuffled {shuffle}");
        }
    }
}

#[test]
fn a_layer_is_handed_out_only_when_complete() {
    let st = synthetic_state(50, 2);
    let layout = StateLayout::of_state(&st);
    let chunks = chunks_of(&st, 64);
    let mut asm = StateAssembler::new(REQ, layout.clone(), AssemblerLimits::default());
    let mut done = [false; 5];
    for (i, (h, p)) in chunks.iter().enumerate() {
        let out = asm.accept(h, p).unwrap();
        let last_of_layer = chunks.get(i + 1).is_none_or(|(n, _)| n.layer != h.layer);
        assert_eq!(out.is_some(), last_of_layer, "chunk {i} of layer {}", h.layer);
        if let Some((l, s)) = out {
            assert_eq!(s, st.layers[l as usize]);
            done[l as usize] = true;
        }
    }
    assert!(done.iter().all(|d| *d));
    assert!(asm.is_complete());
}

#[test]
fn golden_tiny_a_state_layout_and_round_trip() {
    let ck = Checkpoint::open(&golden_dir("tiny-a")).unwrap();
    let c = &ck.config().text_config;
    let s = load_session(&tiny_a_golden(), c).unwrap().state;
    let layout = StateLayout::for_model(c, s.tokens);
    assert_eq!(layout, StateLayout::of_state(&s));
    assert_eq!(layout.nbytes().unwrap() as usize, s.nbytes());
    assert_eq!(layout.rows(), Some(300));
    let chunks = chunks_of(&s, 4096);
    let (asm, col) = assemble(&layout, &chunks).unwrap();
    asm.finish(c.num_hidden_layers as u32, chunks.len() as u64, s.nbytes() as u64).unwrap();
    let back = col.into_state().unwrap();
    back.check(c).unwrap();
    // Bit-exact.
    for (a, b) in back.named_tensors().iter().zip(s.named_tensors()) {
        assert_eq!(a.0, b.0);
        assert!(a.2.iter().zip(b.2).all(|(x, y)| x.to_bits() == y.to_bits()), "{}", a.0);
    }
}

#[test]
fn corrupt_payload_is_refused_and_named() {
    let st = synthetic_state(10, 3);
    let layout = StateLayout::of_state(&st);
    let mut chunks = chunks_of(&st, 128);
    let i = chunks.iter().position(|(h, _)| h.layer == 2 && h.offset == 256).unwrap();
    chunks[i].1[7] ^= 0x10;
    match assemble(&layout, &chunks).unwrap_err() {
        WireError::Checksum { layer: 2, part: Part::Latent, offset: 256, len: 128, .. } => {}
        e => panic!("{e}"),
    }
}

#[test]
fn duplicate_and_overlapping_chunks_are_refused() {
    let st = synthetic_state(10, 4);
    let layout = StateLayout::of_state(&st);
    let chunks = chunks_of(&st, 128);
    // Exact duplicate inside an open layer.
    let i = chunks.iter().position(|(h, _)| h.layer == 2 && h.offset == 128).unwrap();
    let mut dup = chunks[..=i].to_vec();
    dup.push(chunks[i].clone());
    match assemble(&layout, &dup).unwrap_err() {
        WireError::Overlap { layer: 2, part: Part::Latent, offset: 128, prev_start: 0, prev_end: 256, .. } => {}
        e => panic!("{e}"),
    }
    // A duplicate of a layer that is already complete.
    let j = chunks.iter().position(|(h, _)| h.layer == 1).unwrap();
    let mut dup = chunks.clone();
    dup.push(chunks[j].clone());
    assert_eq!(assemble(&layout, &dup).unwrap_err(), WireError::LayerAlreadyComplete { layer: 1 });
    // A partial overlap: a valid chunk (correct checksum) straddling two received ones.
    let p = st.layers[2].clone();
    let spec = ChunkSpec { layer: 2, part: Part::Latent, offset: 64, len: 128 };
    let payload = chunk_payload(&p, &spec).to_vec();
    let straddle = (ChunkHeader::new(REQ, 2, Part::Latent, 64, &payload), payload);
    let mut v = chunks[..=i].to_vec();
    v.push(straddle);
    assert!(matches!(assemble(&layout, &v).unwrap_err(), WireError::Overlap { layer: 2, offset: 64, .. }));
}

#[test]
fn misplaced_chunks_are_refused() {
    let st = synthetic_state(10, 5);
    let layout = StateLayout::of_state(&st);
    let mk = |layer: u32, part: Part, offset: u64, len: usize| {
        let p = vec![0u8; len];
        (ChunkHeader::new(REQ, layer, part, offset, &p), p)
    };
    let one = |c: (ChunkHeader, Vec<u8>)| assemble(&layout, &[c]).unwrap_err();
    assert_eq!(one(mk(5, Part::Latent, 0, 4)), WireError::LayerOutOfRange { layer: 5, layers: 5 });
    assert_eq!(one(mk(0, Part::Latent, 0, 4)), WireError::NoSuchPart { layer: 0, part: Part::Latent });
    assert_eq!(one(mk(2, Part::Recurrent, 0, 4)), WireError::NoSuchPart { layer: 2, part: Part::Recurrent });
    // Past the end of the part (10 rows × 24 × 4 = 960 bytes).
    assert!(matches!(one(mk(2, Part::Latent, 960, 4)), WireError::OutOfRange { size: 960, .. }));
    assert!(matches!(one(mk(2, Part::Latent, 900, 64)), WireError::OutOfRange { .. }));
    assert!(matches!(one(mk(2, Part::Latent, u64::MAX - 1, 4)), WireError::OutOfRange { .. }));
    // Not fp32-aligned, or empty.
    assert!(matches!(one(mk(2, Part::Latent, 2, 4)), WireError::OutOfRange { .. }));
    assert!(matches!(one(mk(2, Part::Latent, 0, 3)), WireError::OutOfRange { .. }));
    assert!(matches!(one(mk(2, Part::Latent, 0, 0)), WireError::OutOfRange { .. }));
    // Another request's chunk.
    let p = vec![0u8; 4];
    let h = ChunkHeader::new(REQ + 1, 2, Part::Latent, 0, &p);
    assert_eq!(assemble(&layout, &[(h, p)]).unwrap_err(), WireError::WrongRequest { got: REQ + 1, want: REQ });
}

#[test]
fn missing_chunk_is_found_by_finish_with_its_range() {
    let st = synthetic_state(10, 6);
    let layout = StateLayout::of_state(&st);
    let mut chunks = chunks_of(&st, 128);
    let n = chunks.len() as u64;
    let i = chunks.iter().position(|(h, _)| h.layer == 4 && h.offset == 384).unwrap();
    chunks.remove(i);
    let (asm, col) = assemble(&layout, &chunks).unwrap();
    assert!(!asm.is_complete());
    let e = asm.finish(5, n, layout.nbytes().unwrap()).unwrap_err();
    assert!(e.to_string().contains("layer 4 latent bytes [384, 512) never arrived"), "{e}");
    assert!(col.into_state().is_err(), "an incomplete state must not be usable");
    // A layer that never started.
    let chunks: Vec<_> = chunks_of(&st, 128).into_iter().filter(|(h, _)| h.layer != 3).collect();
    let (asm, _) = assemble(&layout, &chunks).unwrap();
    let e = asm.finish(5, n, 0).unwrap_err();
    assert!(e.to_string().contains("layer 3 never arrived"), "{e}");
}

#[test]
fn totals_must_match_the_senders() {
    let st = synthetic_state(4, 7);
    let layout = StateLayout::of_state(&st);
    let chunks = chunks_of(&st, 256);
    let n = chunks.len() as u64;
    let b = layout.nbytes().unwrap();
    let (asm, _) = assemble(&layout, &chunks).unwrap();
    assert!(matches!(asm.finish(5, n + 1, b), Err(WireError::TotalsMismatch { what: "chunks", .. })));
    assert!(matches!(asm.finish(5, n, b + 4), Err(WireError::TotalsMismatch { what: "bytes", .. })));
    assert!(matches!(asm.finish(6, n, b), Err(WireError::TotalsMismatch { what: "layers", .. })));
    asm.finish(5, n, b).unwrap();
}

#[test]
fn open_layers_are_bounded_in_bytes() {
    let st = synthetic_state(10, 8);
    let layout = StateLayout::of_state(&st);
    let kda = layout.layers[0].nbytes().unwrap();
    let chunks = chunks_of(&st, 64);
    // Room for two KDA layers in progress.
    let mut asm = StateAssembler::new(REQ, layout.clone(), AssemblerLimits { max_open_bytes: 2 * kda });
    let firsts: Vec<_> = [0u32, 1, 3].iter().map(|l| chunks.iter().find(|(h, _)| h.layer == *l).unwrap().clone()).collect();
    asm.accept(&firsts[0].0, &firsts[0].1).unwrap();
    asm.accept(&firsts[1].0, &firsts[1].1).unwrap();
    assert_eq!((asm.open_layers(), asm.open_bytes()), (2, 2 * kda));
    assert!(matches!(asm.accept(&firsts[2].0, &firsts[2].1), Err(WireError::TooManyOpenLayers { layer: 3, open: 2, .. })));
    // One layer may always be open, however big.
    let mut asm = StateAssembler::new(REQ, layout.clone(), AssemblerLimits { max_open_bytes: 1 });
    asm.accept(&firsts[0].0, &firsts[0].1).unwrap();
    // The bound of a transfer covers three of its largest layers.
    let l = AssemblerLimits::for_transfer(&layout, 1000);
    assert_eq!(l.max_open_bytes, 3 * layout.layers.iter().map(|x| x.nbytes().unwrap()).max().unwrap() + 2000);
}

#[test]
fn zero_row_delta_still_arrives_exactly_once() {
    let st = synthetic_state(0, 9);
    let layout = StateLayout::of_state(&st);
    assert_eq!(layout.rows(), Some(0));
    let chunks = chunks_of(&st, 128);
    assert_eq!(chunks.iter().filter(|(h, _)| h.layer == 2).count(), 1, "one empty marker chunk");
    let (asm, col) = assemble(&layout, &chunks).unwrap();
    asm.finish(5, chunks.len() as u64, layout.nbytes().unwrap()).unwrap();
    assert_eq!(col.into_state().unwrap(), st);
    // The marker twice is a duplicate.
    let mut dup = chunks.clone();
    let m = chunks.iter().find(|(h, _)| h.layer == 2).unwrap().clone();
    dup.push(m);
    assert_eq!(assemble(&layout, &dup).unwrap_err(), WireError::LayerAlreadyComplete { layer: 2 });
}

#[test]
fn layouts_from_peers_are_validated() {
    let huge = StateLayout { layers: vec![LayerLayout::Mla { width: u32::MAX, rows: u64::MAX }] };
    assert!(huge.validate(u64::MAX).is_err());
    let big = StateLayout { layers: vec![LayerLayout::Mla { width: 1024, rows: 1 << 30 }] };
    assert!(big.validate(1 << 30).unwrap_err().to_string().contains("exceeds the limit"));
    let disagree = StateLayout { layers: vec![LayerLayout::Mla { width: 8, rows: 3 }, LayerLayout::Mla { width: 8, rows: 4 }] };
    assert!(disagree.validate(1 << 30).is_err());
}
