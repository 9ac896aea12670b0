//! Golden parity of the CPU reference forward on tiny-a (tests/golden/tiny-a): logits per
//! prompt position, the hand-off state, the per-layer hidden vectors, split prefill, greedy
//! decode, a multimodal prompt (embedding overrides) and chunked/parked execution.
//! Tolerances from the golden README (1e-3 relative), never loosened.

mod common;

use std::sync::OnceLock;

use common::*;
use cuda_prefiller::backend::MlaForm;
use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::executor::{self, EmbeddingOverrides, ExecOptions, LogitsRows, PrefillInput, PrefillOutput};
use cuda_prefiller::model::kda::KdaForm;
use cuda_prefiller::model::{Misread, Model};
use k3_protocol::eval::argmax;
use k3_protocol::handoff::{load_session, save_session, HandoffState, LayerState};

struct Fixture {
    golden: Golden,
    model: Model<CpuBackend>,
    ids: Vec<u32>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let golden = tiny_a_golden();
        let model = cpu_model(checkpoint(&tiny_a_dir()), Misread::default()).expect("tiny-a loads");
        let ids = golden.ids("input_ids");
        Fixture { golden, model, ids }
    })
}

/// The one-shot prefill of the whole prompt (computed once per test binary).
fn one_shot() -> &'static (HandoffState, PrefillOutput, Vec<usize>) {
    static R: OnceLock<(HandoffState, PrefillOutput, Vec<usize>)> = OnceLock::new();
    R.get_or_init(|| {
        let f = fixture();
        let mut st = HandoffState::empty(&f.model.cfg);
        let mut seen = Vec::new();
        let opts = ExecOptions { trace_last: true, ..Default::default() };
        let out = executor::prefill(&f.model, &mut st, PrefillInput::tokens(&f.ids), &opts, |ev| {
            seen.push(ev.layer);
            Ok(())
        })
        .expect("prefill");
        (st, out, seen)
    })
}

#[test]
fn logits_match_per_position() {
    let f = fixture();
    let (_, out, _) = one_shot();
    let (shape, reference) = f.golden.f32("logits");
    assert_eq!(shape, vec![f.ids.len(), f.model.dims.vocab]);
    assert_eq!(out.logits_rows, f.ids.len());
    let exempt = near_tie_rows(&f.golden, f.ids.len());
    check_logits("tiny-a logits", &out.logits, &reference, f.model.dims.vocab, &exempt);
}

#[test]
fn handoff_state_matches() {
    let f = fixture();
    let (st, _, seen) = one_shot();
    assert_eq!(seen, &(0..f.model.plan.len()).collect::<Vec<_>>(), "one callback per layer, in order");
    assert_eq!(st.tokens, f.ids.len());
    let mut worst = 0.0f64;
    let named = st.named_tensors();
    assert_eq!(named.len(), 6 * 4 + 3, "tiny-a has 6 KDA layers (4 tensors) and 3 MLA layers");
    for (name, shape, data) in named {
        let (gs, gv) = f.golden.f32(&name);
        assert_eq!(shape, gs, "{name}: shape");
        let e = rel(data, &gv);
        eprintln!("{name}: rel err {e:.3e}");
        assert!(e <= TOL, "{name}: rel err {e:.3e} > {TOL}");
        worst = worst.max(e);
    }
    eprintln!("hand-off state: max rel err {worst:.3e}");
}

#[test]
fn hidden_vectors_match_per_layer() {
    let f = fixture();
    let (_, out, _) = one_shot();
    let t = out.trace.as_ref().expect("trace requested");
    let h = f.model.dims.hidden;
    let mut worst = 0.0f64;
    let mut check = |name: &str, ours: &[f32], reference: &[f32]| {
        let e = rel(ours, reference);
        assert!(e <= TOL, "{name}: rel err {e:.3e} > {TOL}");
        worst = worst.max(e);
    };
    check("hidden.embed", &t.embed, &f.golden.f32("hidden.embed").1);
    check("hidden.final_mix", &t.final_mix, &f.golden.f32("hidden.final_mix").1);
    check("hidden.final_normed", &t.final_normed, &f.golden.f32("hidden.final_normed").1);
    for (name, ours) in [
        ("hidden.attn_in", &t.attn_in),
        ("hidden.attn_out", &t.attn_out),
        ("hidden.mlp_in", &t.mlp_in),
        ("hidden.mlp_out", &t.mlp_out),
        ("hidden.after_layer", &t.after_layer),
    ] {
        let (shape, reference) = f.golden.f32(name);
        assert_eq!(shape, vec![f.model.plan.len(), h], "{name}: shape");
        assert_eq!(ours.len(), f.model.plan.len(), "{name}: one vector per layer");
        for (l, v) in ours.iter().enumerate() {
            check(&format!("{name}[{l}]"), v, &reference[l * h..(l + 1) * h]);
        }
    }
    eprintln!("hidden.*: max rel err {worst:.3e}");
}

#[test]
fn split_prefill_continues_from_the_session_file() {
    let f = fixture();
    let p1 = f.golden.i64("split.p1")[0] as usize;
    let mut st = HandoffState::empty(&f.model.cfg);
    let opts = ExecOptions { logits: LogitsRows::None, ..Default::default() };
    executor::prefill(&f.model, &mut st, PrefillInput::tokens(&f.ids[..p1]), &opts, |_| Ok(())).unwrap();
    // Through the session file, as a server would keep it between turns.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("session.safetensors");
    save_session(&path, &st, None, &[]).unwrap();
    let mut st2 = load_session(&path, &f.model.cfg).unwrap().state;
    assert_eq!(st2, st);
    let out = executor::prefill(&f.model, &mut st2, PrefillInput::tokens(&f.ids[p1..]), &ExecOptions::default(), |_| Ok(())).unwrap();
    let (shape, reference) = f.golden.f32("split.logits");
    assert_eq!(shape[0], f.ids.len() - p1);
    let exempt: Vec<usize> = near_tie_rows(&f.golden, f.ids.len()).into_iter().filter(|&r| r >= p1).map(|r| r - p1).collect();
    check_logits("tiny-a split.logits", &out.logits, &reference, f.model.dims.vocab, &exempt);
    assert_eq!(st2.tokens, f.ids.len());
}

#[test]
fn greedy_decode_matches() {
    let f = fixture();
    let (st, out, _) = one_shot();
    let tokens = f.golden.ids("decode.tokens");
    let (shape, reference) = f.golden.f32("decode.logits");
    assert_eq!(shape[0], tokens.len());
    let first = argmax(out.row(f.ids.len() - 1)).unwrap() as u32;
    assert_eq!(first, tokens[0], "argmax of the last prompt row");
    let mut st = st.clone();
    let (fed, logits) = executor::greedy(&f.model, &mut st, first, tokens.len()).unwrap();
    assert_eq!(fed, tokens, "greedy tokens");
    let flat: Vec<f32> = logits.concat();
    check_logits("tiny-a decode.logits", &flat, &reference, f.model.dims.vocab, &[]);
    assert_eq!(st.tokens, f.ids.len() + tokens.len());
}

#[test]
fn recurrent_kda_and_absorbed_mla_prefill_match() {
    // The decode forms run over the whole prompt: same logits within the golden bound.
    let f = fixture();
    let mut st = HandoffState::empty(&f.model.cfg);
    let opts = ExecOptions { kda_form: Some(KdaForm::Recurrent), mla_form: Some(MlaForm::Absorbed), chunk_tokens: 97, ..Default::default() };
    let out = executor::prefill(&f.model, &mut st, PrefillInput::tokens(&f.ids), &opts, |_| Ok(())).unwrap();
    let exempt = near_tie_rows(&f.golden, f.ids.len());
    check_logits("tiny-a logits (recurrent KDA, absorbed MLA, chunks of 97)", &out.logits, &f.golden.f32("logits").1, f.model.dims.vocab, &exempt);
}

#[test]
fn chunked_and_parked_execution_matches_golden_state() {
    // Token chunks of 100 with the residual parked on the host between layers.
    let f = fixture();
    let mut st = HandoffState::empty(&f.model.cfg);
    let opts = ExecOptions { chunk_tokens: 100, park_on_host: true, logits: LogitsRows::Last, ..Default::default() };
    let mut mla_rows = Vec::new();
    let out = executor::prefill(&f.model, &mut st, PrefillInput::tokens(&f.ids), &opts, |ev| {
        if let LayerState::Mla(m) = ev.state {
            mla_rows.push(m.rows());
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(mla_rows, vec![f.ids.len(); 3], "MLA events carry the new rows");
    assert_eq!(out.logits_rows, 1);
    let (_, reference) = f.golden.f32("logits");
    let v = f.model.dims.vocab;
    let e = rel(&out.logits, &reference[(f.ids.len() - 1) * v..]);
    assert!(e <= TOL, "last row rel err {e:.3e}");
    for (name, _, data) in st.named_tensors() {
        let e = rel(data, &f.golden.f32(&name).1);
        assert!(e <= TOL, "{name}: rel err {e:.3e} > {TOL}");
    }
}

#[test]
fn multimodal_prompt_with_embedding_overrides_matches() {
    let f = fixture();
    let ids = f.golden.ids("mm.input_ids_expanded");
    let (eshape, embeds) = f.golden.f32("mm.image_embeds");
    let pad = f.model.ck.config().media_placeholder_token_id;
    let positions: Vec<usize> = ids.iter().enumerate().filter(|(_, &t)| t == pad).map(|(i, _)| i).collect();
    assert_eq!(positions.len(), eshape[0], "one <|media_pad|> per image feature row");
    let ov = EmbeddingOverrides { positions, rows: embeds };
    let mut st = HandoffState::empty(&f.model.cfg);
    let out = executor::prefill(&f.model, &mut st, PrefillInput { tokens: &ids, overrides: Some(&ov) }, &ExecOptions::default(), |_| Ok(())).unwrap();
    check_logits("tiny-a mm.logits", &out.logits, &f.golden.f32("mm.logits").1, f.model.dims.vocab, &[]);
}

#[test]
fn bad_inputs_are_errors_and_leave_the_state_alone() {
    let f = fixture();
    let mut st = HandoffState::empty(&f.model.cfg);
    let e = executor::prefill(&f.model, &mut st, PrefillInput::tokens(&[1, 5000, 2]), &ExecOptions::default(), |_| Ok(())).unwrap_err();
    assert!(format!("{e:#}").contains("position 1"), "{e:#}");
    let ov = EmbeddingOverrides { positions: vec![7], rows: vec![0.0; f.model.dims.hidden] };
    let e = executor::prefill(&f.model, &mut st, PrefillInput { tokens: &[1, 2], overrides: Some(&ov) }, &ExecOptions::default(), |_| Ok(())).unwrap_err();
    assert!(format!("{e:#}").contains("position 7"), "{e:#}");
    // A callback error aborts the call without touching the state.
    let e = executor::prefill(&f.model, &mut st, PrefillInput::tokens(&[1, 2]), &ExecOptions::default(), |ev| {
        anyhow::ensure!(ev.layer < 2, "peer gone");
        Ok(())
    })
    .unwrap_err();
    assert!(format!("{e:#}").contains("peer gone"), "{e:#}");
    assert_eq!(st, HandoffState::empty(&f.model.cfg));
}
