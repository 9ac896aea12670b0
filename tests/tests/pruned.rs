//! A pruned checkpoint (`k3-prefill prune`) is an ordinary checkpoint for both nodes: the CPU
//! prefill reference and the MLX decoder load it and agree on its logits, and its fingerprint
//! differs from the source's while its state identity (docs/pruning.md) is the source's.

use cuda_prefiller::cli::prune as pr;
use k3_e2e_tests::*;
use k3_protocol::prune::{Criterion, ExpertStats};
use k3_protocol::Checkpoint;
use mac_decoder::decode::Engine;

fn rel(a: &[f32], b: &[f32]) -> f32 {
    let d: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>().sqrt();
    d / b.iter().map(|y| y * y).sum::<f32>().sqrt().max(1e-30)
}

#[test]
fn both_nodes_load_a_pruned_checkpoint() {
    let src = synth(31, |o| o.layers = Some(5));
    let ck = Checkpoint::open(src.path()).unwrap();
    // Random selection needs no calibration tokens; the statistics only carry the fingerprint.
    let stats = tempfile::tempdir().unwrap();
    let sp = stats.path().join("stats.json");
    ExpertStats::new(&ck.config().text_config, &ck.fingerprint()).save(&sp).unwrap();
    let out = stats.path().join("pruned");
    pr::run_args(&pr::Args {
        model: src.path().to_path_buf(),
        stats: sp,
        keep: Some(6),
        budget_gb: None,
        mode: pr::Mode::Uniform,
        criterion: Criterion::Random,
        seed: 3,
        out: out.clone(),
    })
    .unwrap();
    let pruned = Checkpoint::open(&out).unwrap();
    assert_eq!(pruned.config().text_config.num_experts, 6);
    assert_ne!(pruned.fingerprint(), ck.fingerprint());
    assert_eq!(pruned.state_identity(), ck.state_identity());

    let ids = prompt(5, 37, 1000);
    let (_, cpu) = cpu_prefill(&cpu_model(&out), &ids);
    let (_, full) = cpu_prefill(&cpu_model(src.path()), &ids);
    let engine = Engine::load(&out).unwrap();
    let (tokens, mlx) = local_greedy(&engine, &ids, 4);
    assert_eq!(tokens.len(), 4);
    let last = &mlx[mlx.len() - cpu.len()..];
    let e = rel(last, &cpu);
    assert!(e < 1e-3, "MLX vs CPU reference on the pruned model: rel err {e:.2e}");
    assert!(rel(&cpu, &full) > 1e-3, "the pruned model differs from its source");
}
