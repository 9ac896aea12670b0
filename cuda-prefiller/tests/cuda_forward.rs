//! tiny-a forward on the GPU against the golden set (spec/golden README), F32 check mode:
//! logits per row ≤ 1e-3 relative (rows whose router margin `moe.topk_gap` is below 1e-5 are
//! listed and exempt), KDA states / conv windows / MLA latents ≤ 1e-3, greedy decode tokens
//! identical. BF16 is checked on the trained model instead (`cuda_tiny_t.rs`, issue 15): on
//! tiny-a's random weights one BF16 rounding decorrelates the logits (57 % argmax agreement
//! measured), so tiny-a's BF16 "greedy identical" criterion was withdrawn.
//! Golden directory: `$K3_GOLDEN_DIR` or the workspace's `tests/golden/tiny-a`.

mod cuda_util;

use std::path::PathBuf;
use std::sync::Arc;

use cuda_prefiller::cuda::{CudaBackend, Precision};
use cuda_prefiller::executor::{greedy, prefill, ExecOptions, PrefillInput};
use cuda_prefiller::model::{Model, WeightPolicy};
use cuda_util::*;
use k3_protocol::checkpoint::Checkpoint;
use k3_protocol::handoff::{HandoffState, LayerState};
use safetensors::SafeTensors;

fn golden_dir() -> PathBuf {
    std::env::var("K3_GOLDEN_DIR").map(PathBuf::from).unwrap_or_else(|_| k3_protocol::testdata::golden_dir("tiny-a"))
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("golden tensor {name}: {e}"));
    t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}
fn i64s(st: &SafeTensors, name: &str) -> Vec<i64> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("golden tensor {name}: {e}"));
    t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect()
}

/// Rows over the bound, whether greedy decode matches, the per-layer error of the last position.
struct Outcome {
    failures: Vec<(usize, f64, f32)>,
    greedy_same: bool,
    layer_err: Vec<f64>,
}

fn run(p: Precision, logit_tol: f64, gap_exempt: f32, state_tol: f64) {
    let Some(be) = cuda(p) else { return };
    let o = forward(be, p, logit_tol, gap_exempt, state_tol, true);
    eprintln!("{p:?}: last-position P error by layer: {}", o.layer_err.iter().map(|e| format!("{e:.1e}")).collect::<Vec<_>>().join(" "));
    assert!(o.failures.is_empty(), "{p:?}: logits rows over {logit_tol:e} (row, err, margin): {:?}", o.failures);
    assert!(o.greedy_same, "{p:?}: greedy tokens differ from the golden decode");
}

fn forward(be: CudaBackend, p: Precision, logit_tol: f64, gap_exempt: f32, state_tol: f64, check_state: bool) -> Outcome {
    let dir = golden_dir();
    let bytes = std::fs::read(dir.join("golden.safetensors")).expect("golden.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ck = Arc::new(Checkpoint::open(&dir).expect("tiny-a checkpoint"));
    let model = Model::new(Arc::new(be), ck, WeightPolicy::Resident).expect("model on the GPU");
    let ids: Vec<u32> = i64s(&st, "input_ids").iter().map(|&x| x as u32).collect();
    let mut state = HandoffState::empty(&model.cfg);
    let opts = ExecOptions { trace_last: true, ..ExecOptions::default() };
    let out = prefill(&model, &mut state, PrefillInput::tokens(&ids), &opts, |_| Ok(())).expect("prefill");
    let gold_after = f32s(&st, "hidden.after_layer");
    let h = model.dims.hidden;
    let layer_err: Vec<f64> =
        out.trace.as_ref().map(|tr| tr.after_layer.iter().enumerate().map(|(l, v)| rel(v, &gold_after[l * h..(l + 1) * h])).collect()).unwrap_or_default();
    let want = f32s(&st, "logits");
    let vocab = out.vocab;
    let t = ids.len();
    assert_eq!(out.logits_rows, t);
    // smallest router margin per token over the MoE layers (golden)
    let gaps = f32s(&st, "moe.topk_gap");
    let nmoe = gaps.len() / t;
    let min_gap: Vec<f32> = (0..t).map(|i| (0..nmoe).map(|l| gaps[l * t + i]).fold(f32::INFINITY, f32::min)).collect();
    let mut worst = 0f64;
    let mut exempt = Vec::new();
    let mut failures = Vec::new();
    for i in 0..t {
        let r = rel(out.row(i), &want[i * vocab..(i + 1) * vocab]);
        if min_gap[i] < gap_exempt {
            exempt.push((i, min_gap[i], r));
            continue;
        }
        worst = worst.max(r);
        if r > logit_tol {
            failures.push((i, r, min_gap[i]));
        }
    }
    if check_state {
        eprintln!("{p:?}: worst logits row rel err {worst:.3e} over {} rows (bound {logit_tol:.0e})", t - exempt.len());
        for (i, g, r) in &exempt {
            eprintln!("{p:?}: row {i} exempt (router margin {g:.2e} < {gap_exempt:.0e}): rel err {r:.3e}");
        }
    }
    // hand-off state
    for (l, ls) in state.layers.iter().enumerate().filter(|_| check_state) {
        match ls {
            LayerState::Kda(k) => {
                assert_rel(&format!("{p:?} kda.{l}.recurrent"), &k.recurrent, &f32s(&st, &format!("kda.{l}.recurrent")), state_tol);
                assert_rel(&format!("{p:?} kda.{l}.conv_q"), &k.conv_q, &f32s(&st, &format!("kda.{l}.conv_q")), state_tol);
                assert_rel(&format!("{p:?} kda.{l}.conv_k"), &k.conv_k, &f32s(&st, &format!("kda.{l}.conv_k")), state_tol);
                assert_rel(&format!("{p:?} kda.{l}.conv_v"), &k.conv_v, &f32s(&st, &format!("kda.{l}.conv_v")), state_tol);
            }
            LayerState::Mla(m) => assert_rel(&format!("{p:?} mla.{l}.latent"), &m.latent, &f32s(&st, &format!("mla.{l}.latent")), state_tol),
        }
    }
    // greedy decode from the prefilled state
    let gold_tokens: Vec<u32> = i64s(&st, "decode.tokens").iter().map(|&x| x as u32).collect();
    let first = k3_protocol::eval::argmax(out.row(t - 1)).unwrap() as u32;
    let (tokens, _) = greedy(&model, &mut state, first, gold_tokens.len()).expect("greedy decode");
    if check_state {
        eprintln!("{p:?}: greedy decode {:?}\n{p:?}: golden decode {:?}", tokens, gold_tokens);
    }
    Outcome { failures, greedy_same: tokens == gold_tokens, layer_err }
}

#[test]
fn cuda_tiny_a_forward_f32_matches_golden() {
    run(Precision::F32, 1e-3, 1e-5, 1e-3);
}

#[test]
fn cuda_backend_error_is_clear_without_gpu() {
    if cuda_prefiller::cuda::available() {
        eprintln!("SKIPPED: a GPU is present; this test covers the no-GPU error");
        return;
    }
    let err = CudaBackend::new(Precision::Bf16, &cuda_prefiller::cuda::CudaOptions::default()).err().expect("no GPU: the CUDA backend must fail");
    let msg = format!("{err:#}");
    assert!(msg.contains("CUDA backend unavailable"), "unclear error: {msg}");
}
