//! The engines agree on a trained model (issue 15). On tiny-t (`tests/models/tiny-t`, or
//! `$K3_TINY_T_DIR`), with its held-out text (`heldout.json`: a page the model was not trained
//! on, and its ids under the model's own tokenizer):
//! - the CPU f32 executor (`k3-prefill forward --backend cpu`) is the reference; its perplexity
//!   on the whole page is at most 0.2 × the page's unigram perplexity (the model learned something);
//! - on the first 512 tokens: MLX f32 local prefill, and remote prefill (a prefill node over
//!   loopback QUIC, CPU backend) + MLX f32 decode steps, within 0.1 % of the reference's
//!   perplexity; MLX BF16 within 1 % with top-1 agreement ≥ 98 %;
//! - greedy continuations of 64 tokens from 20 held-out prompts: no divergence between f32
//!   engines; where BF16 diverges, each engine's token is in the other's top-5 there (vLLM's rule).
//!
//! The CUDA engines get the same bounds in `cuda-prefiller/tests/cuda_tiny_t.rs` (GPU box).
//! Numbers: docs/engine-agreement.md.

use std::path::PathBuf;

use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::executor::{self, decode_step, ExecOptions, LogitsRows, PrefillInput};
use cuda_prefiller::model::Model;
use cuda_prefiller::server::ServeOptions;
use k3_e2e_tests::*;
use k3_protocol::eval::{self, first_divergence, Agreement, GreedyRun, HeldOut, Scores};
use k3_protocol::handoff::HandoffState;
use mac_decoder::decode::{ComputeDtype, Engine, EngineOptions};
use mac_decoder::remote::{Conversation, Route};
use mac_decoder::tokenizer::Tokenizer;

/// The remote engine prefills this many held-out tokens on the node, then MLX decode steps are
/// fed the next `REMOTE_STEPS` (scored against the reference's predictions at the same positions).
const REMOTE_PREFIX: usize = 256;
const REMOTE_STEPS: usize = 256;
/// Held-out tokens the engines are compared on (MLX on the CPU is slow: CI time). The
/// model-quality check scores the whole held-out page.
const PPL_TOKENS: usize = REMOTE_PREFIX + REMOTE_STEPS;
const PROMPTS: usize = 20;
const PROMPT_TOKENS: usize = 16;
const CONTINUATION: usize = 64;

fn tiny_t() -> (PathBuf, HeldOut) {
    let dir = eval::tiny_t_dir();
    let held = HeldOut::load(&dir).unwrap_or_else(|e| panic!("the trained test model (K3_TINY_T_DIR or tests/models/tiny-t): {e:#}"));
    (dir, held)
}

/// Scores of the rows predicting `seq[1..]` from `[T, vocab]` logits of `seq`.
fn scores(logits: &[f32], vocab: usize, seq: &[u32]) -> Scores {
    Scores::from_logits(&logits[..(seq.len() - 1) * vocab], vocab, &seq[1..]).expect("finite logits")
}

fn cpu_scores(model: &Model<CpuBackend>, seq: &[u32]) -> Scores {
    let mut st = HandoffState::empty(&model.cfg);
    let opts = ExecOptions { logits: LogitsRows::All, ..Default::default() };
    let out = executor::prefill(model, &mut st, PrefillInput::tokens(seq), &opts, |_| Ok(())).expect("cpu prefill");
    scores(&out.logits, out.vocab, seq)
}

fn mlx_scores(engine: &Engine, seq: &[u32]) -> Scores {
    let mut s = engine.new_session().unwrap();
    let logits = engine.prefill_logits(&mut s, seq, None).expect("MLX prefill");
    scores(&logits, engine.text_config().vocab_size, seq)
}

/// Positions `from..from + n` of a score list (the positions the remote engine scores).
fn window(s: &Scores, from: usize, n: usize) -> Scores {
    Scores { nll: s.nll[from..from + n].to_vec(), top1: s.top1[from..from + n].to_vec() }
}

fn cpu_greedy(model: &Model<CpuBackend>, prompt: &[u32]) -> GreedyRun {
    let (mut st, mut row) = cpu_prefill(model, prompt);
    let mut run = GreedyRun::default();
    for i in 0..CONTINUATION {
        let tok = run.push(&row);
        if i + 1 < CONTINUATION {
            row = decode_step(model, &mut st, tok).expect("cpu decode step");
        }
    }
    run
}

/// `until_diverging_from`: stop after the first token that differs from this run (only the first
/// divergence is judged; saves the slow BF16 steps after it).
fn mlx_greedy(engine: &Engine, prompt: &[u32], until_diverging_from: Option<&GreedyRun>) -> GreedyRun {
    let mut s = engine.new_session().unwrap();
    let mut row = engine.prefill_local(&mut s, prompt, None).expect("MLX prefill");
    let mut run = GreedyRun::default();
    for i in 0..CONTINUATION {
        let tok = run.push(&row);
        if until_diverging_from.is_some_and(|r| r.tokens[i] != tok) {
            break;
        }
        if i + 1 < CONTINUATION {
            row = engine.step(&mut s, tok).expect("MLX step");
        }
    }
    run
}

struct Split {
    _node: cuda_prefiller::server::PrefillNode,
    engine: Engine,
    remote: mac_decoder::remote::RemotePrefiller,
}

fn split(dir: &std::path::Path) -> Split {
    let fp = fingerprint_of(dir);
    let (scfg, ccfg) = paired(fp, fp);
    let node = start_node(dir, scfg, ServeOptions::default());
    let engine = Engine::load(dir).unwrap();
    let remote = remote(&engine, node.local_addr(), ccfg, 1);
    Split { _node: node, engine, remote }
}

/// Prefills `prompt` on the node, ingests the state, and returns the conversation.
fn remote_prefill(s: &mut Split, prompt: &[u32]) -> Conversation {
    let mut conv = Conversation::new(&s.engine).unwrap();
    let t = s.remote.prefill(&s.engine, &mut conv, prompt, None).unwrap();
    assert_eq!(t.route, Route::Remote, "{}", t.reason);
    conv
}

/// Remote prefill of `seq[..REMOTE_PREFIX]`, then MLX decode steps fed the rest of `seq`:
/// scores of the predictions of `seq[REMOTE_PREFIX..]`.
fn remote_scores(s: &mut Split, seq: &[u32]) -> Scores {
    let mut conv = remote_prefill(s, &seq[..REMOTE_PREFIX]);
    let mut out = Scores { nll: Vec::new(), top1: Vec::new() };
    let mut row = conv.last_logits().expect("the node sent the last logits").to_vec();
    for t in REMOTE_PREFIX..seq.len() {
        out.push(&row, seq[t]).expect("finite logits");
        if t + 1 < seq.len() {
            row = conv.step(&s.engine, seq[t]).expect("MLX step");
        }
    }
    out
}

fn remote_greedy(s: &mut Split, prompt: &[u32]) -> GreedyRun {
    let mut conv = remote_prefill(s, prompt);
    let mut row = conv.last_logits().unwrap().to_vec();
    let mut run = GreedyRun::default();
    for i in 0..CONTINUATION {
        let tok = run.push(&row);
        if i + 1 < CONTINUATION {
            row = conv.step(&s.engine, tok).expect("MLX step");
        }
    }
    run
}

fn bf16_engine(dir: &std::path::Path) -> Engine {
    Engine::load_with_dtype(dir, EngineOptions::default(), ComputeDtype::Bf16).unwrap()
}

/// `K3_WRITE_HELDOUT_IDS=1`: (re)writes the `ids` of `heldout.json` from its `text` (after the
/// text or the tokenizer changed), then checks as usual.
#[test]
fn heldout_ids_are_the_tokenizers_encoding() {
    let dir = eval::tiny_t_dir();
    let tok = Tokenizer::from_dir(&dir).expect("tiny-t's tokenizer");
    if std::env::var_os("K3_WRITE_HELDOUT_IDS").is_some() {
        let path = dir.join(HeldOut::FILE);
        let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let ids = tok.encode(v["text"].as_str().expect("heldout.json: text"), false).unwrap();
        v["ids"] = serde_json::json!(ids);
        let mut out = serde_json::to_string_pretty(&serde_json::json!({"source": v["source"], "text": v["text"]})).unwrap();
        // ids on one line: the file stays readable
        out.truncate(out.len() - 2);
        out.push_str(&format!(",\n  \"ids\": {}\n}}\n", serde_json::to_string(&ids).unwrap()));
        std::fs::write(&path, out).unwrap();
        eprintln!("wrote {} ids to {}", ids.len(), path.display());
    }
    let (_, held) = tiny_t();
    let ids = tok.encode(&held.text, false).unwrap();
    assert_eq!(ids, held.ids, "heldout.json: the ids are not the tokenizer's encoding of the text");
    assert!(held.ids.len() >= REMOTE_PREFIX + REMOTE_STEPS, "{} held-out ids, too few for the checks", held.ids.len());
    assert_eq!(tok.decode(&held.ids), held.text);
}

fn agreement_table(rows: &[(Agreement, f64, f64)]) {
    eprintln!("{}", Agreement::TABLE_HEADER);
    for (a, _, _) in rows {
        eprintln!("{a}");
    }
    let failures: Vec<String> = rows.iter().filter_map(|(a, d, t)| a.check(*d, *t).err().map(|e| e.to_string())).collect();
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The model-quality check: perplexity of the whole held-out page ≤ 0.2 × its unigram perplexity.
#[test]
fn tiny_t_beats_the_unigram_baseline() {
    let (dir, held) = tiny_t();
    let t0 = std::time::Instant::now();
    let reference = cpu_scores(&cpu_model(&dir), &held.ids);
    let unigram = eval::unigram_perplexity(&held.ids[1..]);
    let ppl = reference.perplexity();
    eprintln!(
        "CPU f32 executor: held-out perplexity {ppl:.3} over {} positions; unigram perplexity of the same text {unigram:.3}; ratio {:.3} ({:.1} s)",
        reference.len(),
        ppl / unigram,
        t0.elapsed().as_secs_f64()
    );
    assert!(ppl <= 0.2 * unigram, "held-out perplexity {ppl:.3} is above 0.2 × the unigram perplexity {unigram:.3}");
}

/// MLX f32 local prefill and remote prefill + MLX decode steps vs the CPU f32 executor.
#[test]
fn f32_engines_agree_on_heldout_perplexity() {
    init_tracing();
    let (dir, held) = tiny_t();
    let seq = held.sequence(PPL_TOKENS);
    let t0 = std::time::Instant::now();
    let reference = cpu_scores(&cpu_model(&dir), seq);
    let mlx_f32 = mlx_scores(&Engine::load(&dir).unwrap(), seq);
    let mut s = split(&dir);
    let remote = remote_scores(&mut s, seq);
    agreement_table(&[
        (Agreement::new("CPU f32 executor (reference)", &reference, &reference), 0.0, 1.0),
        (Agreement::new("MLX f32, local prefill", &mlx_f32, &reference), 0.1, 0.0),
        (
            Agreement::new(
                &format!("remote prefill of {REMOTE_PREFIX} tokens (CPU node, QUIC) + {REMOTE_STEPS} MLX f32 decode steps"),
                &remote,
                &window(&reference, REMOTE_PREFIX - 1, REMOTE_STEPS),
            ),
            0.1,
            0.0,
        ),
    ]);
    eprintln!("({:.1} s)", t0.elapsed().as_secs_f64());
}

/// MLX BF16 local prefill vs the CPU f32 executor: within 1 % perplexity, top-1 ≥ 98 %.
#[test]
fn mlx_bf16_agrees_on_heldout_perplexity() {
    init_tracing();
    let (dir, held) = tiny_t();
    let seq = held.sequence(PPL_TOKENS);
    let t0 = std::time::Instant::now();
    let reference = cpu_scores(&cpu_model(&dir), seq);
    let bf16 = mlx_scores(&bf16_engine(&dir), seq);
    agreement_table(&[(Agreement::new("MLX BF16, local prefill", &bf16, &reference), 1.0, 0.98)]);
    eprintln!("({:.1} s)", t0.elapsed().as_secs_f64());
}

fn judge(name: &str, runs: &[GreedyRun], reference: &[GreedyRun], f32_engine: bool) -> Vec<String> {
    let mut failures = Vec::new();
    let mut diverged = 0;
    for (i, (a, b)) in runs.iter().zip(reference).enumerate() {
        if let Some(d) = first_divergence(a, b) {
            diverged += 1;
            let verdict = if d.acceptable() { "each in the other's top-5" } else { "NOT in the other's top-5" };
            eprintln!("{name} vs CPU f32, prompt {i}: first divergence at token {}: {} vs {} ({verdict})", d.position, d.a, d.b);
            if f32_engine || !d.acceptable() {
                failures.push(format!("{name}, prompt {i}: {d:?}"));
            }
        } else {
            assert_eq!(a.tokens.len(), CONTINUATION, "{name}, prompt {i}");
        }
    }
    eprintln!("{name}: {diverged} of {PROMPTS} greedy continuations of {CONTINUATION} tokens diverge from the CPU f32 executor");
    failures
}

fn greedy_reference(dir: &std::path::Path, held: &HeldOut) -> Vec<GreedyRun> {
    let cpu = cpu_model(dir);
    held.prompts(PROMPTS, PROMPT_TOKENS).iter().map(|p| cpu_greedy(&cpu, p)).collect()
}

/// 64 greedy tokens from 20 held-out prompts: MLX f32 and remote prefill + MLX decode never
/// diverge from the CPU f32 executor.
#[test]
fn f32_greedy_continuations_are_identical() {
    init_tracing();
    let (dir, held) = tiny_t();
    let t0 = std::time::Instant::now();
    let prompts = held.prompts(PROMPTS, PROMPT_TOKENS);
    let reference = greedy_reference(&dir, &held);
    if let Ok(tok) = Tokenizer::from_dir(&dir) {
        eprintln!("prompt 0: {:?}\n  continuation (CPU f32): {:?}", tok.decode(prompts[0]), tok.decode(&reference[0].tokens));
    }
    let f32_engine = Engine::load(&dir).unwrap();
    let mlx_f32: Vec<GreedyRun> = prompts.iter().map(|p| mlx_greedy(&f32_engine, p, None)).collect();
    let mut s = split(&dir);
    let remote: Vec<GreedyRun> = prompts.iter().map(|p| remote_greedy(&mut s, p)).collect();
    let mut failures = judge("MLX f32", &mlx_f32, &reference, true);
    failures.extend(judge("remote prefill + MLX f32 decode", &remote, &reference, true));
    eprintln!("({:.1} s)", t0.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "greedy continuations: {failures:#?}");
}

/// The same prompts on MLX BF16: where a continuation diverges from the CPU f32 executor, each
/// engine's token is in the other's top-5 there (vLLM's rule).
#[test]
fn bf16_greedy_divergences_stay_in_the_top5() {
    init_tracing();
    let (dir, held) = tiny_t();
    let t0 = std::time::Instant::now();
    let reference = greedy_reference(&dir, &held);
    let e = bf16_engine(&dir);
    let prompts = held.prompts(PROMPTS, PROMPT_TOKENS);
    let bf16: Vec<GreedyRun> = prompts.iter().zip(&reference).map(|(p, r)| mlx_greedy(&e, p, Some(r))).collect();
    let failures = judge("MLX BF16", &bf16, &reference, false);
    eprintln!("({:.1} s)", t0.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "greedy continuations: {failures:#?}");
}
