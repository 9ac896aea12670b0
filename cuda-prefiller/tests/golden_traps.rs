//! Each known misreading of the spec, planted on purpose, must break golden parity on tiny-a
//! (spec §3.1, §3.8, §1.2): 0-based layer lists, the `(2ℓ)%B` sublayer bank boundary, a
//! missing output AttnRes mix, `A_log` read per channel. A correct reading passes
//! (`golden_tiny_a.rs`); here every trap must push some logits row far past the 1e-3 bound.

mod common;

use common::*;
use cuda_prefiller::executor::{self, ExecOptions, PrefillInput};
use cuda_prefiller::model::Misread;
use k3_protocol::handoff::HandoffState;

/// Runs tiny-a under `misread`; returns the worst per-row logits error vs golden, or the
/// error that stopped the forward.
fn run(misread: Misread) -> Result<f64, String> {
    let golden = tiny_a_golden();
    let ids = golden.ids("input_ids");
    let model = cpu_model(checkpoint(&tiny_a_dir()), misread).map_err(|e| format!("{e:#}"))?;
    let mut st = HandoffState::empty(&model.cfg);
    let out = executor::prefill(&model, &mut st, PrefillInput::tokens(&ids), &ExecOptions::default(), |_| Ok(())).map_err(|e| format!("{e:#}"))?;
    Ok(max(&row_rel(&out.logits, &golden.f32("logits").1, model.dims.vocab)))
}

fn assert_breaks(what: &str, misread: Misread) {
    let e = run(misread).unwrap_or_else(|e| panic!("{what}: forward failed instead of running: {e}"));
    eprintln!("{what}: worst logits row rel err {e:.3e}");
    assert!(e > 100.0 * TOL, "{what}: logits still within {:.0e} of golden (worst {e:.3e})", 100.0 * TOL);
}

#[test]
fn control_correct_reading_passes() {
    let e = run(Misread::default()).unwrap();
    assert!(e <= TOL, "control run: {e:.3e}");
}

#[test]
fn zero_based_layer_lists_break_parity() {
    // Read 0-based, tiny-a's kda_layers [1,2,3,5,6,7] make layer 0 an MLA layer: its weights
    // are not in the checkpoint, so the misread cannot even load — it never yields logits.
    let m = Misread { layer_lists_zero_based: true, ..Default::default() };
    let plan = m.layer_plan(&checkpoint(&tiny_a_dir()).config().text_config);
    let correct = checkpoint(&tiny_a_dir()).config().text_config.layer_plan();
    assert_ne!(plan, correct, "the misread plan differs");
    let err = run(m).expect_err("a 0-based reading must not produce logits");
    eprintln!("0-based lists: {err}");
    assert!(err.contains("layer 0") && err.contains("q_a_proj") && err.contains("not in the checkpoint"), "{err}");
}

#[test]
fn sublayer_bank_boundary_breaks_parity() {
    assert_breaks("(2l)%B bank boundary", Misread { bank_boundary_sublayers: true, ..Default::default() });
}

#[test]
fn missing_output_mix_breaks_parity() {
    assert_breaks("missing output AttnRes mix", Misread { skip_output_mix: true, ..Default::default() });
}

#[test]
fn a_log_per_channel_breaks_parity() {
    assert_breaks("A_log per channel", Misread { a_log_per_channel: true, ..Default::default() });
}
