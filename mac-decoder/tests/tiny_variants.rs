//! The decoder's invariants on synthetic tiny variants (other widths, head counts, layer counts,
//! expert counts, AttnRes blocks, prompt lengths), against the CPU reference prefiller of
//! `cuda-prefiller`: prefill logits, the hand-off state, greedy tokens from a local prefill and
//! from the reference's hand-off state (local = remote), and split prefill = one shot.
#![cfg(feature = "mlx")]

mod decoder_golden;

use std::sync::Arc;

use cuda_prefiller::executor::{self, ExecOptions, PrefillInput};
use decoder_golden::{argmax, rel_l2, row_errors};
use k3_protocol::handoff::{HandoffState, LayerState};
use k3_protocol::synth::{write_model, Overrides, Preset, SynthOptions};
use mac_decoder::decode::{Engine, GenerateParams};
use rand::{Rng, SeedableRng};

const TOL: f64 = 1e-3;

struct Variant {
    name: &'static str,
    seed: u64,
    prompt: usize,
    overrides: Overrides,
}

fn check_variant(v: &Variant) {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.seed = v.seed;
    opts.overrides = v.overrides.clone();
    opts.tokenizer = false;
    let report = write_model(dir.path(), &opts).unwrap();
    let cfg = report.config.clone();
    let c = &cfg.text_config;
    let vocab = c.vocab_size;
    let special = [cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.media_placeholder_token_id];
    let mut rng = rand::rngs::StdRng::seed_from_u64(v.seed);
    let ids: Vec<u32> = (0..v.prompt)
        .map(|_| loop {
            let t = rng.gen_range(0..vocab as u32);
            if !special.contains(&t) {
                break t;
            }
        })
        .collect();

    // reference: the CPU prefiller
    let ck = Arc::new(k3_protocol::Checkpoint::open(&report.dir).unwrap());
    let model = cuda_prefiller::model::Model::new(Arc::new(cuda_prefiller::cpu::CpuBackend), ck, cuda_prefiller::model::WeightPolicy::Resident).unwrap();
    let mut ref_state = HandoffState::empty(c);
    let ref_out = executor::prefill(&model, &mut ref_state, PrefillInput::tokens(&ids), &ExecOptions::default(), |_| Ok(())).unwrap();
    // rows whose router margin is below ~1e-5 may legitimately differ: list them
    let exempt: Vec<usize> = (0..ids.len()).filter(|&r| ref_out.topk_gap.iter().any(|(_, g)| g[r] < 1e-5)).collect();

    // MLX: local prefill
    let engine = Engine::load(&report.dir).unwrap();
    let mut s = engine.new_session().unwrap();
    let logits = engine.prefill_logits(&mut s, &ids, None).unwrap();
    let errs = row_errors(&logits, &ref_out.logits, vocab);
    let worst = errs.iter().enumerate().filter(|(r, _)| !exempt.contains(r)).fold((0, 0f64), |a, (r, &e)| if e > a.1 { (r, e) } else { a });
    eprintln!("{}: prefill logits worst row {} error {:.2e}, exempt rows {exempt:?}", v.name, worst.0, worst.1);
    assert!(worst.1 <= TOL, "{}: prefill logits row {} error {:.2e}", v.name, worst.0, worst.1);

    // the hand-off state
    let ours = engine.export_state(&s).unwrap();
    assert_eq!(ours.tokens, ref_state.tokens);
    for (l, (a, b)) in ours.layers.iter().zip(&ref_state.layers).enumerate() {
        let pairs: Vec<(&str, &[f32], &[f32])> = match (a, b) {
            (LayerState::Kda(a), LayerState::Kda(b)) => vec![
                ("recurrent", &a.recurrent, &b.recurrent),
                ("conv_q", &a.conv_q, &b.conv_q),
                ("conv_k", &a.conv_k, &b.conv_k),
                ("conv_v", &a.conv_v, &b.conv_v),
            ],
            (LayerState::Mla(a), LayerState::Mla(b)) => vec![("latent", &a.latent, &b.latent)],
            _ => panic!("{}: layer {l} kinds differ", v.name),
        };
        for (n, x, y) in pairs {
            let e = rel_l2(x, y);
            assert!(e <= TOL, "{}: layer {l} {n} error {e:.2e}", v.name);
        }
    }

    // greedy decode: local MLX session vs the reference's decode steps
    let steps = 12;
    let first = argmax(&logits[(ids.len() - 1) * vocab..]);
    let (ref_tokens, _) = executor::greedy(&model, &mut ref_state.clone(), first, steps).unwrap();
    let local = engine.generate(&mut s, &GenerateParams::greedy(steps), |_| true).unwrap();
    assert_eq!(local.tokens, ref_tokens, "{}: greedy tokens (local prefill) differ from the reference", v.name);
    // local = remote: decode from the reference's hand-off state
    let mut r = engine.new_session().unwrap();
    engine.ingest(&mut r, 0, &ref_state, Some(ref_out.row(ids.len() - 1).to_vec())).unwrap();
    let remote = engine.generate(&mut r, &GenerateParams::greedy(steps), |_| true).unwrap();
    assert_eq!(remote.tokens, ref_tokens, "{}: greedy tokens from the hand-off state differ", v.name);

    // split prefill = one shot
    let p1 = ids.len() * 2 / 5;
    let mut sp = engine.new_session().unwrap();
    engine.prefill_local(&mut sp, &ids[..p1], None).unwrap();
    let second = engine.prefill_logits(&mut sp, &ids[p1..], None).unwrap();
    let errs = row_errors(&second, &logits[p1 * vocab..], vocab);
    for (r, e) in errs.iter().enumerate() {
        assert!(*e <= TOL || exempt.contains(&(r + p1)), "{}: split row {} error {e:.2e}", v.name, r + p1);
    }
}

#[test]
fn narrow_variant_with_three_heads_and_small_blocks() {
    check_variant(&Variant {
        name: "narrow",
        seed: 21,
        prompt: 97,
        overrides: Overrides {
            layers: Some(7),
            full_attn_layers: Some(vec![3, 6, 7]),
            hidden: Some(96),
            heads: Some(3),
            kda_head_dim: Some(16),
            q_lora_rank: Some(48),
            kv_lora_rank: Some(32),
            qk_nope_head_dim: Some(16),
            qk_rope_head_dim: Some(8),
            v_head_dim: Some(16),
            intermediate: Some(192),
            experts: Some(8),
            experts_per_token: Some(2),
            moe_intermediate: Some(32),
            latent: Some(64),
            block_size: Some(2),
            vocab: Some(512),
            ..Default::default()
        },
    });
}

#[test]
fn deeper_variant_with_more_experts_and_long_prompt() {
    check_variant(&Variant {
        name: "deeper",
        seed: 33,
        prompt: 203,
        overrides: Overrides {
            layers: Some(12),
            heads: Some(4),
            kda_head_dim: Some(16),
            experts: Some(24),
            experts_per_token: Some(6),
            moe_intermediate: Some(96),
            latent: Some(32),
            block_size: Some(5),
            conv_kernel: Some(3),
            ..Default::default()
        },
    });
}

/// The BF16 path (BF16 weights and GEMM inputs, FP32 activations) against the
/// f32 path. The random test networks amplify input rounding steeply with depth: a 2e-3
/// relative perturbation of the f32 embeddings alone moves the logits by 2e-2 (2 layers),
/// 0.41 (3 layers) and 1.47 (tiny-a, 9 layers), measured. So the comparison uses a 2-layer
/// variant that still has every block kind (KDA + dense FFN, MLA + latent MoE, AttnRes), with a
/// loose bound (see below). Rows with a router margin below 1e-3 are listed (golden README).
#[test]
fn bf16_path_tracks_f32_on_a_two_layer_variant() {
    use mac_decoder::decode::{ComputeDtype, EngineOptions};
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.seed = 4;
    opts.tokenizer = false;
    opts.overrides = Overrides { layers: Some(2), full_attn_layers: Some(vec![2]), block_size: Some(2), ..Default::default() };
    let report = write_model(dir.path(), &opts).unwrap();
    let vocab = report.config.text_config.vocab_size;
    let ids: Vec<u32> = (0..80).map(|i| (i * 37 % 997) as u32).collect();
    let f = Engine::load(&report.dir).unwrap();
    let b = Engine::load_with_dtype(&report.dir, EngineOptions::default(), ComputeDtype::Bf16).unwrap();
    assert!(b.weight_bytes() < f.weight_bytes() * 6 / 10, "BF16 weights should take about half the bytes");
    let (mut sf, mut sb) = (f.new_session().unwrap(), b.new_session().unwrap());
    let lf = f.prefill_logits(&mut sf, &ids, None).unwrap();
    let lb = b.prefill_logits(&mut sb, &ids, None).unwrap();
    // router margins from the CPU reference
    let ck = Arc::new(k3_protocol::Checkpoint::open(&report.dir).unwrap());
    let model = cuda_prefiller::model::Model::new(Arc::new(cuda_prefiller::cpu::CpuBackend), ck, cuda_prefiller::model::WeightPolicy::Resident).unwrap();
    let mut st = HandoffState::empty(&report.config.text_config);
    let out = executor::prefill(&model, &mut st, PrefillInput::tokens(&ids), &ExecOptions::default(), |_| Ok(())).unwrap();
    // A row is compared only where no router choice can flip under BF16 rounding: the GEMM
    // inputs carry one BF16 rounding (relative 2^-8 at most), so a top-k margin below that can
    // swap an expert and move the row by O(0.1) — a different but equally valid route, not an
    // arithmetic error. (Measured with seed 4: the one row past 2.3e-2 is row 2, margin 3.3e-3,
    // error 9.6e-2; every row with a margin above 2^-8 is within 2.3e-2.)
    const BF16_ULP: f32 = 1.0 / 256.0;
    let exempt: Vec<usize> = (0..ids.len()).filter(|&r| out.topk_gap.iter().any(|(_, g)| g[r] < BF16_ULP)).collect();
    let errs = row_errors(&lb, &lf, vocab);
    let worst = errs.iter().enumerate().filter(|(r, _)| !exempt.contains(r)).fold(0f64, |m, (_, &e)| m.max(e));
    eprintln!("bf16 vs f32: worst row {worst:.3e} over {} rows, exempt (router margin < 2^-8) {exempt:?}", ids.len() - exempt.len());
    assert!(ids.len() - exempt.len() >= 20, "too few comparable rows");
    // Not the BF16 accuracy criterion (judged on the trained tiny-t: tests/tests/engine_agreement.rs),
    // but a real bound on the rows no routing flip can explain: measured 2.2e-2 (seed 4).
    assert!(worst <= 5e-2, "bf16 logits: worst row {worst:.3e}");
    // and decode steps stay on the same track
    let (a, c) = (f.step(&mut sf, 7).unwrap(), b.step(&mut sb, 7).unwrap());
    let e = rel_l2(&c, &a);
    // measured 3.2e-3
    assert!(e <= 5e-2, "bf16 decode step: {e:.3e}");
}
