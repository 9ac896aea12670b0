//! State ingestion: deltas at a base, and refusals (wrong base, shapes, non-finite values,
//! another model's fingerprint) that leave the session untouched.
#![cfg(feature = "mlx")]

mod decoder_golden;

use decoder_golden::{model_dir, Golden};
use k3_protocol::handoff::{load_session, save_session, token_prefix_hash, HandoffState, LayerState, SessionMeta};
use k3_protocol::Fingerprint;
use mac_decoder::decode::{Engine, GenerateParams};

fn golden_state(engine: &Engine) -> HandoffState {
    load_session(&model_dir("tiny-a").join("golden.safetensors"), engine.text_config()).unwrap().state
}

/// The part of a full state after `base` tokens: MLA rows `base..`, final KDA states.
fn delta_after(full: &HandoffState, base: usize) -> HandoffState {
    let layers = full
        .layers
        .iter()
        .map(|l| match l {
            LayerState::Kda(k) => LayerState::Kda(k.clone()),
            LayerState::Mla(m) => {
                let mut m = m.clone();
                m.latent = m.latent[base * m.width..].to_vec();
                LayerState::Mla(m)
            }
        })
        .collect();
    HandoffState { tokens: full.tokens - base, layers }
}

#[test]
fn a_delta_on_top_of_a_local_prefill_decodes_the_golden_tokens() {
    let g = Golden::load("tiny-a");
    let engine = Engine::load(&model_dir("tiny-a")).unwrap();
    let vocab = engine.text_config().vocab_size;
    let ids = g.ids("input_ids");
    let full = golden_state(&engine);
    let mut s = engine.new_session().unwrap();
    engine.prefill_local(&mut s, &ids[..131], None).unwrap();
    let logits = &g.f32("logits").1;
    let last = logits[(ids.len() - 1) * vocab..].to_vec();
    engine.ingest(&mut s, 131, &delta_after(&full, 131), Some(last)).unwrap();
    assert_eq!(s.tokens(), 300);
    let out = engine.generate(&mut s, &GenerateParams::greedy(24), |_| true).unwrap();
    assert_eq!(out.tokens, g.ids("decode.tokens"));
}

#[test]
fn refused_states_leave_the_session_untouched() {
    let engine = Engine::load(&model_dir("tiny-a")).unwrap();
    let full = golden_state(&engine);
    let mut s = engine.new_session().unwrap();
    engine.prefill_local(&mut s, &[1, 2, 3, 4, 5], None).unwrap();
    let before = engine.export_state(&s).unwrap();
    let before_logits = s.last_logits().unwrap().to_vec();

    // wrong base
    let err = engine.ingest(&mut s, 0, &delta_after(&full, 0), None).unwrap_err().to_string();
    assert!(err.contains("starts at token 0") && err.contains("holds 5"), "{err}");
    // MLA rows that do not match the token count
    let mut bad = delta_after(&full, 5);
    bad.tokens += 1;
    let err = format!("{:#}", engine.ingest(&mut s, 5, &bad, None).unwrap_err());
    assert!(err.contains("layer 3"), "{err}");
    // a NaN in a KDA state
    let mut bad = delta_after(&full, 5);
    if let LayerState::Kda(k) = &mut bad.layers[4] {
        k.recurrent[17] = f32::NAN;
    }
    let err = engine.ingest(&mut s, 5, &bad, None).unwrap_err().to_string();
    assert!(err.contains("layer 4") && err.contains("recurrent") && err.contains("17"), "{err}");
    // logits of the wrong width
    let err = engine.ingest(&mut s, 5, &delta_after(&full, 5), Some(vec![0.0; 3])).unwrap_err().to_string();
    assert!(err.contains("logits"), "{err}");

    assert_eq!(engine.export_state(&s).unwrap(), before);
    assert_eq!(s.last_logits().unwrap(), &before_logits[..]);
    assert_eq!(s.tokens(), 5);
}

#[test]
fn session_files_carry_and_check_the_fingerprint() {
    let engine = Engine::load(&model_dir("tiny-a")).unwrap();
    let ids: Vec<u32> = (10..40).collect();
    let mut s = engine.new_session().unwrap();
    let last = engine.prefill_local(&mut s, &ids, None).unwrap();
    let state = engine.export_state(&s).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let vocab = engine.text_config().vocab_size;

    // our own model's file round-trips, state and logits
    let good = dir.path().join("good.safetensors");
    let meta = SessionMeta { fingerprint: *engine.fingerprint(), tokens: ids.len(), token_prefix_hash: token_prefix_hash(&ids) };
    save_session(&good, &state, Some(&meta), &[("logits".into(), vec![1, vocab], &last[..])]).unwrap();
    let mut t = engine.new_session().unwrap();
    let info = engine.ingest_session_file(&mut t, &good).unwrap();
    assert_eq!(info.tokens, ids.len());
    assert_eq!(info.fingerprint.as_ref(), Some(engine.fingerprint()));
    assert_eq!(engine.export_state(&t).unwrap(), state);
    let a = engine.generate(&mut s, &GenerateParams::greedy(5), |_| true).unwrap();
    let b = engine.generate(&mut t, &GenerateParams::greedy(5), |_| true).unwrap();
    assert_eq!(a.tokens, b.tokens);

    // another model's file is refused
    let other = dir.path().join("other.safetensors");
    let meta = SessionMeta { fingerprint: Fingerprint([7; 32]), ..meta };
    save_session(&other, &state, Some(&meta), &[]).unwrap();
    let mut u = engine.new_session().unwrap();
    let err = engine.ingest_session_file(&mut u, &other).unwrap_err().to_string();
    assert!(err.contains("0707070707"), "{err}");
    assert_eq!(u.tokens(), 0);
    // and a session file only loads into a fresh session
    assert!(engine.ingest_session_file(&mut t, &good).is_err());
}
