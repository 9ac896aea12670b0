//! The CUDA engines on the trained model tiny-t (issue 15), against the CPU f32 executor on the
//! same machine, on tiny-t's held-out text (`heldout.json`; model dir `$K3_TINY_T_DIR` or the
//! workspace's `tests/models/tiny-t`):
//! - F32 check mode: perplexity within 0.1 % of the reference; greedy continuations (64 tokens
//!   from 20 held-out prompts) identical to the reference's.
//! - BF16 mode: perplexity within 1 %, top-1 agreement ≥ 98 %; where a greedy continuation
//!   diverges, each engine's token is in the other's top-5 at that position (vLLM's rule).
//!
//! This replaces tiny-a's BF16 "greedy tokens identical" criterion: on random weights one BF16
//! rounding decorrelates the logits (issue 15), a trained net's peaked distributions do not.
//! The same bounds for the CPU-side engines (MLX, remote prefill) are in
//! `tests/tests/engine_agreement.rs`. Skips with the reason when no GPU is usable.

mod cuda_util;

use std::sync::Arc;

use cuda_prefiller::backend::Backend;
use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::cuda::{Bf16Parts, CudaBackend, CudaOptions, Precision};
use cuda_prefiller::executor::{decode_step, prefill, ExecOptions, LogitsRows, PrefillInput};
use cuda_prefiller::model::{Model, WeightPolicy};
use cuda_util::cuda;
use k3_protocol::checkpoint::Checkpoint;
use k3_protocol::eval::{first_divergence, tiny_t_dir, Agreement, GreedyRun, HeldOut, Scores};
use k3_protocol::handoff::HandoffState;

const PPL_TOKENS: usize = 512;
const PROMPTS: usize = 20;
const PROMPT_TOKENS: usize = 16;
const CONTINUATION: usize = 64;

fn model<B: Backend>(be: B) -> Model<B> {
    let dir = tiny_t_dir();
    let ck = Arc::new(Checkpoint::open(&dir).unwrap_or_else(|e| panic!("tiny-t checkpoint at {}: {e}", dir.display())));
    Model::new(Arc::new(be), ck, WeightPolicy::Resident).expect("model loads")
}

fn heldout() -> HeldOut {
    HeldOut::load(&tiny_t_dir()).unwrap_or_else(|e| panic!("tiny-t held-out text: {e:#}"))
}

/// Scores of the predictions of `seq[1..]` (one prefill, logits of every position).
fn scores<B: Backend>(m: &Model<B>, seq: &[u32]) -> Scores {
    let mut st = HandoffState::empty(&m.cfg);
    let opts = ExecOptions { logits: LogitsRows::All, ..Default::default() };
    let out = prefill(m, &mut st, PrefillInput::tokens(seq), &opts, |_| Ok(())).expect("prefill");
    Scores::from_logits(&out.logits[..(seq.len() - 1) * out.vocab], out.vocab, &seq[1..]).expect("finite logits")
}

fn greedy<B: Backend>(m: &Model<B>, prompt: &[u32]) -> GreedyRun {
    let mut st = HandoffState::empty(&m.cfg);
    let opts = ExecOptions { logits: LogitsRows::Last, ..Default::default() };
    let mut row = prefill(m, &mut st, PrefillInput::tokens(prompt), &opts, |_| Ok(())).expect("prefill").logits;
    let mut run = GreedyRun::default();
    for i in 0..CONTINUATION {
        let tok = run.push(&row);
        if i + 1 < CONTINUATION {
            row = decode_step(m, &mut st, tok).expect("decode step");
        }
    }
    run
}

/// The CPU f32 reference: scores and greedy runs.
fn reference(held: &HeldOut) -> (Scores, Vec<GreedyRun>) {
    let m = model(CpuBackend);
    let prompts = held.prompts(PROMPTS, PROMPT_TOKENS);
    (scores(&m, held.sequence(PPL_TOKENS)), prompts.iter().map(|p| greedy(&m, p)).collect())
}

/// Checks one CUDA configuration; returns failure messages.
fn check(name: &str, be: CudaBackend, max_delta_pct: f64, min_top1: f64, greedy_identical: bool, held: &HeldOut, r: &(Scores, Vec<GreedyRun>)) -> Vec<String> {
    let m = model(be);
    let a = Agreement::new(name, &scores(&m, held.sequence(PPL_TOKENS)), &r.0);
    eprintln!("{a}");
    let mut failures: Vec<String> = a.check(max_delta_pct, min_top1).err().map(|e| e.to_string()).into_iter().collect();
    let mut diverged = 0;
    for (i, p) in held.prompts(PROMPTS, PROMPT_TOKENS).iter().enumerate() {
        let g = greedy(&m, p);
        if let Some(d) = first_divergence(&g, &r.1[i]) {
            diverged += 1;
            eprintln!(
                "{name}, prompt {i}: first divergence from CPU f32 at token {}: {} vs {} (each in the other's top-5: {})",
                d.position,
                d.a,
                d.b,
                d.acceptable()
            );
            if greedy_identical || !d.acceptable() {
                failures.push(format!("{name}, prompt {i}: greedy continuation: {d:?}"));
            }
        }
    }
    eprintln!("{name}: {diverged} of {PROMPTS} greedy continuations of {CONTINUATION} tokens diverge from CPU f32");
    failures
}

#[test]
fn cuda_tiny_t_f32_and_bf16_agree_with_the_cpu_reference() {
    let Some(f32_backend) = cuda(Precision::F32) else { return };
    let held = heldout();
    let r = reference(&held);
    eprintln!("{}\n{}", Agreement::TABLE_HEADER, Agreement::new("CPU f32 (reference)", &r.0, &r.0));
    let mut failures = check("CUDA f32", f32_backend, 0.1, 0.0, true, &held, &r);
    // Where BF16 rounding costs most, one part at a time (diagnostic, printed; not asserted).
    for (part, parts) in [
        ("round", Bf16Parts { round: true, ..Bf16Parts::NONE }),
        ("gemm", Bf16Parts { gemm: true, ..Bf16Parts::NONE }),
        ("experts", Bf16Parts { experts: true, ..Bf16Parts::NONE }),
        ("attn", Bf16Parts { attn: true, ..Bf16Parts::NONE }),
    ] {
        let m = model(CudaBackend::new(Precision::Bf16, &CudaOptions { bf16_parts: Some(parts), ..CudaOptions::default() }).expect("backend"));
        eprintln!("{}", Agreement::new(&format!("CUDA BF16, {part} only (diagnostic)"), &scores(&m, held.sequence(PPL_TOKENS)), &r.0));
    }
    let bf16 = CudaBackend::new(Precision::Bf16, &CudaOptions::default()).expect("BF16 backend");
    failures.extend(check("CUDA BF16", bf16, 1.0, 0.98, false, &held, &r));
    assert!(failures.is_empty(), "{failures:#?}");
}
