//! Calibration and pruning on the CPU reference (docs/pruning.md):
//! - the MoE observer leaves logits and state bit-identical, and its statistics add up;
//! - `calibrate` resumes to exactly the statistics of one uninterrupted run;
//! - keeping every expert is a no-op (bit-identical logits);
//! - a pruned model computes exactly what the full model computes with the dropped experts
//!   masked out of routing (their selection bias set to −1e30 in a copy of the checkpoint);
//! - bad inputs get errors that name the cause.

use std::path::Path;
use std::sync::Arc;

use cuda_prefiller::calibrate::{MoeObserverRef, StatsCollector};
use cuda_prefiller::cli::backend_args::BackendChoice;
use cuda_prefiller::cli::calibrate as cal;
use cuda_prefiller::cli::prune as pr;
use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::executor::{self, ExecOptions, PrefillInput, PrefillOutput};
use cuda_prefiller::model::{Model, WeightPolicy};
use k3_protocol::handoff::HandoffState;
use k3_protocol::prune::{Criterion, ExpertStats, PruneRecord};
use k3_protocol::synth::{write_model, Preset, SynthOptions};
use k3_protocol::tensors::layer_tensor;
use k3_protocol::Checkpoint;

fn synth(dir: &Path, seed: u64, layers: usize) {
    let mut o = SynthOptions::new(Preset::Tiny);
    o.seed = seed;
    o.overrides.layers = Some(layers);
    o.overrides.vocab = Some(512);
    write_model(dir, &o).unwrap();
}

fn prompt(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % 480) as u32
        })
        .collect()
}

fn model(dir: &Path) -> Model<CpuBackend> {
    Model::new(Arc::new(CpuBackend), Arc::new(Checkpoint::open(dir).unwrap()), WeightPolicy::Resident).unwrap()
}

fn run(m: &Model<CpuBackend>, ids: &[u32], opts: &ExecOptions) -> (PrefillOutput, HandoffState) {
    let mut st = HandoffState::empty(&m.cfg);
    let out = executor::prefill(m, &mut st, PrefillInput::tokens(ids), opts, |_| Ok(())).unwrap();
    (out, st)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn write_prompts(path: &Path, prompts: &[Vec<u32>]) {
    let text: Vec<String> = prompts.iter().map(|p| serde_json::to_string(p).unwrap()).collect();
    std::fs::write(path, text.join("\n\n") + "\n").unwrap();
}

fn cal_args(model: &Path, prompts: &Path, out: &Path) -> cal::Args {
    let mut a = cal::Args::with_paths(model, prompts, out);
    a.backend.choice = BackendChoice::Cpu;
    a.chunk_tokens = Some(16);
    a
}

fn prune_args(model: &Path, stats: &Path, keep: Option<usize>, out: &Path) -> pr::Args {
    pr::Args {
        model: model.to_path_buf(),
        stats: stats.to_path_buf(),
        keep,
        budget_gb: None,
        mode: pr::Mode::Uniform,
        criterion: Criterion::Reap,
        seed: 0,
        out: out.to_path_buf(),
    }
}

#[test]
fn observer_changes_nothing_and_its_statistics_add_up() {
    let d = tempfile::tempdir().unwrap();
    synth(d.path(), 1, 5);
    let m = model(d.path());
    let ids = prompt(3, 40);
    let plain = ExecOptions { chunk_tokens: 16, ..Default::default() };
    let (a, sa) = run(&m, &ids, &plain);
    let ck = Checkpoint::open(d.path()).unwrap();
    let col = StatsCollector::new(ExpertStats::new(&m.cfg, &ck.fingerprint()));
    let observed = ExecOptions { moe_observer: Some(MoeObserverRef(col.clone())), ..plain.clone() };
    let (b, sb) = run(&m, &ids, &observed);
    assert_eq!(bits(&a.logits), bits(&b.logits), "calibration changes no logit");
    for ((n, _, x), (_, _, y)) in sa.named_tensors().into_iter().zip(sb.named_tensors()) {
        assert_eq!(bits(x), bits(y), "{n}");
    }
    let s = col.snapshot();
    let (k, n) = (m.cfg.num_experts_per_token, m.cfg.num_experts);
    assert_eq!(s.layers.len(), 4, "layers 1..5 are MoE");
    for l in &s.layers {
        assert_eq!(l.tokens, 40, "layer {}", l.layer);
        assert_eq!(l.count.iter().sum::<u64>(), 40 * k as u64);
        // Renormalised weights × routed_scaling_factor sum to the factor per token.
        let g: f64 = l.gate_sum.iter().sum();
        assert!((g - 40.0 * m.cfg.routed_scaling_factor as f64).abs() < 1e-3, "layer {}: gate sum {g}", l.layer);
        for e in 0..n {
            assert_eq!(l.count[e] == 0, l.saliency_sum[e] == 0.0, "layer {} expert {e}", l.layer);
            assert!(l.reap(e) >= 0.0 && l.reap(e).is_finite());
            assert!(l.mean_gate(e) <= m.cfg.routed_scaling_factor as f64 + 1e-6);
        }
        assert!(l.count.iter().filter(|&&c| c > 0).count() > k, "layer {}: routing spreads over experts", l.layer);
    }
}

/// Counts, tokens and digests equal; the f64 sums equal up to the last bit or two (they pass
/// through the JSON file, whose parser is not correctly rounded in every case).
fn same_stats(a: &ExpertStats, b: &ExpertStats) {
    assert_eq!((a.prompts_done, &a.prompts_digest, a.tokens), (b.prompts_done, &b.prompts_digest, b.tokens));
    assert_eq!(a.layers.len(), b.layers.len());
    for (x, y) in a.layers.iter().zip(&b.layers) {
        assert_eq!((x.layer, x.tokens, &x.count), (y.layer, y.tokens, &y.count));
        for (u, v) in x.gate_sum.iter().zip(&y.gate_sum).chain(x.saliency_sum.iter().zip(&y.saliency_sum)) {
            assert!((u - v).abs() <= 1e-14 * u.abs().max(1.0), "layer {}: {u} vs {v}", x.layer);
        }
    }
}

#[test]
fn calibration_resumes_to_the_same_statistics() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    synth(&dir, 2, 4);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(10 + i, 9 + 5 * i as usize)).collect();
    let all = d.path().join("all.jsonl");
    write_prompts(&all, &prompts);
    let once = cal::run_with(Arc::new(CpuBackend), &cal_args(&dir, &all, &d.path().join("once.json"))).unwrap();
    assert_eq!(once.prompts_done, 3);
    assert_eq!(once.tokens, 9 + 14 + 19);
    // Two prompts, then resume with all three.
    let first = d.path().join("first.jsonl");
    write_prompts(&first, &prompts[..2]);
    let out = d.path().join("resumed.json");
    let part = cal::run_with(Arc::new(CpuBackend), &cal_args(&dir, &first, &out)).unwrap();
    assert_eq!(part.prompts_done, 2);
    let resumed = cal::run_with(Arc::new(CpuBackend), &cal_args(&dir, &all, &out)).unwrap();
    same_stats(&resumed, &once);
    same_stats(&ExpertStats::load(&out).unwrap(), &once);
    // A prompt file that no longer starts with the prompts done is refused.
    let other = d.path().join("other.jsonl");
    write_prompts(&other, &[prompt(99, 5), prompt(98, 5), prompt(97, 5)]);
    let e = format!("{:#}", cal::run_with(Arc::new(CpuBackend), &cal_args(&dir, &other, &out)).unwrap_err());
    assert!(e.contains("differ"), "{e}");
    // Bad prompt lines name the line.
    std::fs::write(&other, "[1, 2]\n{\"text\": 5}\n").unwrap();
    let e = format!("{:#}", cal::run_with(Arc::new(CpuBackend), &cal_args(&dir, &other, &d.path().join("x.json"))).unwrap_err());
    assert!(e.contains("line 2") && e.contains("must be a string"), "{e}");
    std::fs::write(&other, "[1, -2]\n").unwrap();
    let e = format!("{:#}", cal::run_with(Arc::new(CpuBackend), &cal_args(&dir, &other, &d.path().join("x.json"))).unwrap_err());
    assert!(e.contains("line 1") && e.contains("entry 1"), "{e}");
}

/// `{"text": ...}` prompts are tokenized with the checkpoint's tokenizer: the statistics equal
/// those of the same prompts given as token ids.
#[test]
fn text_prompts_use_the_checkpoints_tokenizer() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("m");
    synth(&dir, 11, 3);
    let texts = ["The quick brown fox jumps over the lazy dog.", "Pruning keeps the experts that matter; 12345 <|im_end|> stays text."];
    let tok = k3_protocol::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let ids: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, false).unwrap()).collect();
    assert!(ids.iter().all(|p| p.len() > 5), "{ids:?}");
    let text_file = d.path().join("text.jsonl");
    let lines: Vec<String> = texts.iter().map(|t| serde_json::json!({ "text": t }).to_string()).collect();
    std::fs::write(&text_file, lines.join("\n") + "\n").unwrap();
    let id_file = d.path().join("ids.jsonl");
    write_prompts(&id_file, &ids);
    let a = cal::run_with(Arc::new(CpuBackend), &cal_args(&dir, &text_file, &d.path().join("a.json"))).unwrap();
    let mut b = cal::run_with(Arc::new(CpuBackend), &cal_args(&dir, &id_file, &d.path().join("b.json"))).unwrap();
    assert_eq!(a.tokens, ids.iter().map(|p| p.len() as u64).sum::<u64>());
    assert_ne!(a.prompts_digest, b.prompts_digest, "the digest covers the lines as written");
    b.prompts_digest = a.prompts_digest.clone();
    same_stats(&a, &b);
    // A model directory without a tokenizer is named.
    std::fs::remove_file(dir.join("tiktoken.model")).unwrap();
    let e = format!("{:#}", cal::run_with(Arc::new(CpuBackend), &cal_args(&dir, &text_file, &d.path().join("c.json"))).unwrap_err());
    assert!(e.contains("line 1") && e.contains("tokenizer") && e.contains("tiktoken.model"), "{e}");
}

/// A copy of `src` whose routers never select the experts outside `kept` (bias −1e30).
fn masked_copy(src: &Path, dst: &Path, kept: &[(usize, Vec<usize>)]) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    let ck = Checkpoint::open(src).unwrap();
    for (l, ids) in kept {
        let name = layer_tensor(*l, "block_sparse_moe.gate.e_score_correction_bias");
        let entry = ck.entry(&name).unwrap().clone();
        let path = dst.join(ck.shard_name(entry.shard));
        let mut bytes = std::fs::read(&path).unwrap();
        for e in 0..entry.shape[0] {
            if !ids.contains(&e) {
                let at = entry.start + 4 * e;
                bytes[at..at + 4].copy_from_slice(&(-1e30f32).to_le_bytes());
            }
        }
        std::fs::write(&path, bytes).unwrap();
    }
}

#[test]
fn pruning_equals_masked_routing_and_keeping_all_is_a_no_op() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    synth(&src, 4, 5);
    let prompts: Vec<Vec<u32>> = (0..2).map(|i| prompt(20 + i, 24)).collect();
    let pf = d.path().join("p.jsonl");
    write_prompts(&pf, &prompts);
    let stats = d.path().join("stats.json");
    cal::run_with(Arc::new(CpuBackend), &cal_args(&src, &pf, &stats)).unwrap();
    let ids = prompt(77, 33);
    let opts = ExecOptions { chunk_tokens: 16, ..Default::default() };
    let (full, _) = run(&model(&src), &ids, &opts);

    // Keep all 16: the same logits, bit for bit.
    let all = d.path().join("all");
    pr::run_args(&prune_args(&src, &stats, Some(16), &all)).unwrap();
    let (same, _) = run(&model(&all), &ids, &opts);
    assert_eq!(bits(&same.logits), bits(&full.logits));

    // Keep 6 of 16 (top-4): equal to the full model with the other 10 masked out of routing.
    let six = d.path().join("six");
    pr::run_args(&prune_args(&src, &stats, Some(6), &six)).unwrap();
    let rec = PruneRecord::load(&six).unwrap().unwrap();
    assert_eq!(rec.num_experts, 6);
    assert_eq!(rec.source_fingerprint, Checkpoint::open(&src).unwrap().fingerprint().hex());
    let kept: Vec<(usize, Vec<usize>)> = rec.kept.clone().into_iter().collect();
    let masked = d.path().join("masked");
    masked_copy(&src, &masked, &kept);
    let (p, _) = run(&model(&six), &ids, &opts);
    let (q, _) = run(&model(&masked), &ids, &opts);
    assert_eq!(bits(&p.logits), bits(&q.logits), "pruned = masked routing");
    assert_ne!(bits(&p.logits), bits(&full.logits), "dropping experts changes the model");
    assert_ne!(Checkpoint::open(&six).unwrap().fingerprint(), Checkpoint::open(&src).unwrap().fingerprint());

    // --mode global, 6 per layer on average: per-layer counts from one ranking (at least top-4
    // each), the config says so, and the model still equals masked routing bit for bit.
    let global = d.path().join("global");
    let mut a = prune_args(&src, &stats, Some(6), &global);
    a.mode = pr::Mode::Global;
    pr::run_args(&a).unwrap();
    let rec = PruneRecord::load(&global).unwrap().unwrap();
    assert_eq!(rec.mode, "global");
    let counts: Vec<usize> = rec.kept.values().map(|k| k.len()).collect();
    assert_eq!(counts.iter().sum::<usize>(), 6 * counts.len());
    assert!(counts.iter().all(|&c| (4..=16).contains(&c)), "{counts:?}");
    assert!(counts.iter().any(|&c| c != 6), "a global ranking of this model gave uniform counts {counts:?}");
    let gck = Checkpoint::open(&global).unwrap();
    let tc = &gck.config().text_config;
    assert_eq!(tc.num_experts, *counts.iter().max().unwrap());
    for (l, ids) in &rec.kept {
        assert_eq!(tc.experts_in_layer(*l), ids.len());
    }
    // The global ranking: every expert kept above a layer's floor scores at least as high as
    // every expert dropped (REAP saliency).
    let st = ExpertStats::load(&stats).unwrap();
    let (mut min_kept, mut max_dropped) = (f64::INFINITY, f64::NEG_INFINITY);
    for ls in &st.layers {
        let ids = &rec.kept[&ls.layer];
        let mut kept_scores: Vec<f64> = ids.iter().map(|&e| ls.reap(e)).collect();
        kept_scores.sort_by(|a, b| b.total_cmp(a));
        min_kept = kept_scores[4..].iter().copied().fold(min_kept, f64::min);
        max_dropped = (0..16).filter(|e| !ids.contains(e)).map(|e| ls.reap(e)).fold(max_dropped, f64::max);
    }
    assert!(min_kept >= max_dropped, "kept above the floor {min_kept} < dropped {max_dropped}");
    let kept: Vec<(usize, Vec<usize>)> = rec.kept.clone().into_iter().collect();
    let gmasked = d.path().join("gmasked");
    masked_copy(&src, &gmasked, &kept);
    let (p, _) = run(&model(&global), &ids, &opts);
    let (q, _) = run(&model(&gmasked), &ids, &opts);
    assert_eq!(bits(&p.logits), bits(&q.logits), "global pruning = masked routing");
    assert_eq!(gck.state_identity(), Checkpoint::open(&src).unwrap().state_identity());
    // A per-layer pruned model is not pruned again.
    let gstats = d.path().join("gstats.json");
    ExpertStats::new(tc, &gck.fingerprint()).save(&gstats).unwrap();
    let mut a = prune_args(&global, &gstats, Some(4), &d.path().join("again"));
    a.criterion = Criterion::Random;
    let e = format!("{:#}", pr::run_args(&a).unwrap_err());
    assert!(e.contains("pruned per layer"), "{e}");
}

#[test]
fn bad_prune_inputs_name_the_cause() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    synth(&src, 5, 4);
    let other = d.path().join("other");
    synth(&other, 5, 5);
    let pf = d.path().join("p.jsonl");
    write_prompts(&pf, &[prompt(1, 8)]);
    let stats = d.path().join("stats.json");
    cal::run_with(Arc::new(CpuBackend), &cal_args(&src, &pf, &stats)).unwrap();
    let err = |a: pr::Args| format!("{:#}", pr::run_args(&a).unwrap_err());
    let out = d.path().join("out");
    let e = err(prune_args(&src, &stats, Some(17), &out));
    assert!(e.contains("--keep 17 exceeds") && e.contains("16"), "{e}");
    let e = err(prune_args(&src, &stats, Some(3), &out));
    assert!(e.contains("below the router's top-k (4"), "{e}");
    let e = err(prune_args(&other, &stats, Some(8), &out));
    assert!(e.contains("another model"), "{e}");
    let mut a = prune_args(&src, &stats, None, &out);
    a.budget_gb = Some(0.0001);
    let e = err(a);
    assert!(e.contains("no pruned model fits"), "{e}");
    for gb in [0.0, -1.0, f64::NAN] {
        let mut a = prune_args(&src, &stats, None, &out);
        a.budget_gb = Some(gb);
        let e = err(a);
        assert!(e.contains("must be a positive number"), "{e}");
    }
    let global = |keep: Option<usize>, gb: Option<f64>| {
        let mut a = prune_args(&src, &stats, keep, &out);
        a.mode = pr::Mode::Global;
        a.budget_gb = gb;
        a
    };
    let e = err(global(Some(3), None));
    assert!(e.contains("below the router's top-k (4"), "{e}");
    let e = err(global(Some(17), None));
    assert!(e.contains("--keep 17 exceeds"), "{e}");
    let e = err(global(None, Some(0.0001)));
    assert!(e.contains("no pruned model fits"), "{e}");
    // Statistics without tokens rank nothing (random selection needs none).
    let empty = d.path().join("empty.json");
    let ck = Checkpoint::open(&src).unwrap();
    ExpertStats::new(&ck.config().text_config, &ck.fingerprint()).save(&empty).unwrap();
    let e = err(prune_args(&src, &empty, Some(8), &out));
    assert!(e.contains("no calibration tokens"), "{e}");
    // Calibration does not resume statistics of another model.
    let e = format!("{:#}", cal::run_with(Arc::new(CpuBackend), &cal_args(&other, &pf, &stats)).unwrap_err());
    assert!(e.contains("another model"), "{e}");
    assert!(!out.exists(), "no output after errors");
    // A budget that fits picks the largest count that fits.
    let mut a = prune_args(&src, &stats, None, &out);
    let full = Checkpoint::open(&src).unwrap().total_bytes();
    a.budget_gb = Some((full - 1) as f64 / 1e9);
    let r = pr::run_args(&a).unwrap();
    assert!(r.bytes_written < full);
    assert_eq!(Checkpoint::open(&out).unwrap().config().text_config.num_experts, 15);
}
