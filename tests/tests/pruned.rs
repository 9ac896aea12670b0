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

/// `ck` (at `dir`) pruned to `keep` experts per layer chosen at random (`seed`), written into a
/// temporary directory (returned, to keep it alive) at the returned path. Random selection needs
/// no calibration tokens; the statistics only carry the fingerprint.
fn prune_randomly(ck: &Checkpoint, dir: &std::path::Path, keep: usize, seed: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    let stats = tempfile::tempdir().unwrap();
    let sp = stats.path().join("stats.json");
    ExpertStats::new(&ck.config().text_config, &ck.fingerprint()).save(&sp).unwrap();
    let out = stats.path().join("pruned");
    pr::run_args(&pr::Args {
        model: dir.to_path_buf(),
        stats: sp,
        keep: Some(keep),
        budget_gb: None,
        mode: pr::Mode::Uniform,
        criterion: Criterion::Random,
        seed,
        out: out.clone(),
    })
    .unwrap();
    (stats, out)
}

#[test]
fn both_nodes_load_a_pruned_checkpoint() {
    let src = synth(31, |o| o.layers = Some(5));
    let ck = Checkpoint::open(src.path()).unwrap();
    let (_stats, out) = prune_randomly(&ck, src.path(), 6, 3);
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

/// Issue 17 ★: a prefill node serving the full model and a decoder running a model pruned from
/// it. The handshake carries both identities: without `--accept-compatible-states` the decoder
/// refuses the node (naming both fingerprints) and prefills locally with the pruned model; with
/// it, it continues the full model's state, and its tokens equal the in-process "full-model
/// prefill + pruned decode" (the CPU reference's full-model state and last logits ingested into
/// the pruned engine), bit for bit.
#[test]
fn a_pruned_decoder_uses_full_model_states_only_when_told_to() {
    use mac_decoder::decode::GenerateParams;
    use mac_decoder::remote::{CompatibleSource, Conversation, Route};

    init_tracing();
    const GEN: usize = 8;
    let src = synth(32, |o| o.layers = Some(4));
    let ck = Checkpoint::open(src.path()).unwrap();
    let (_stats, out) = prune_randomly(&ck, src.path(), 5, 7);
    let pruned = Checkpoint::open(&out).unwrap();
    let (full_fp, pruned_fp) = (ck.fingerprint(), pruned.fingerprint());
    assert_ne!(full_fp, pruned_fp);
    assert_eq!(ck.state_identity(), pruned.state_identity());

    let engine = Engine::load(&out).unwrap();
    let ids = prompt(17, 48, 1000);
    // In process: the full model's prefill (CPU reference), continued by the pruned engine.
    let (state, logits) = cpu_prefill(&cpu_model(src.path()), &ids);
    let mut s = engine.new_session().unwrap();
    engine.ingest(&mut s, 0, &state, Some(logits)).unwrap();
    let want = engine.generate(&mut s, &GenerateParams::greedy(GEN), |_| true).unwrap().tokens;
    // The pruned model's own prefill, for the refused case.
    let (local_tokens, _) = local_greedy(&engine, &ids, GEN);

    for accept in [false, true] {
        let (scfg, ccfg) = paired(full_fp, pruned_fp);
        let scfg = scfg.with_state_identity(ck.state_identity());
        let ccfg = ccfg.with_state_identity(pruned.state_identity());
        let node = start_node(src.path(), scfg, cuda_prefiller::server::ServeOptions::default());
        let mut opts = remote_options(node.local_addr(), 1);
        opts.accept_compatible_states = accept;
        let mut remote = mac_decoder::remote::RemotePrefiller::with_node_config(&engine, opts, ccfg).unwrap();
        let mut conv = Conversation::new(&engine).unwrap();
        let (cap, guard) = LogCapture::start();
        let t = remote.prefill(&engine, &mut conv, &ids, None).unwrap();
        drop(guard);
        let log = cap.text();
        let tokens = conv.generate(&engine, &GenerateParams::greedy(GEN), |_| true).unwrap().tokens;
        if accept {
            assert_eq!(t.route, Route::Remote, "{}", t.reason);
            assert_eq!(t.compatible_source, Some(CompatibleSource::Accepted));
            assert!(log.contains("state-compatible") && log.contains(&full_fp.short()), "the log does not say whose state it took:\n{log}");
            assert_eq!(tokens, want, "remote full-model prefill + pruned decode differs from the in-process one");
            assert_eq!(records(&node, 1).len(), 1);
        } else {
            assert_eq!(t.route, Route::Fallback, "{}", t.reason);
            assert_eq!(t.compatible_source, Some(CompatibleSource::Refused));
            for needle in [full_fp.hex(), pruned_fp.hex(), "--accept-compatible-states".to_string()] {
                assert!(t.reason.contains(&needle), "the refusal {:?} does not name {needle}", t.reason);
            }
            assert!(log.contains("WARN") && log.contains(&full_fp.hex()), "no warning naming the node's model:\n{log}");
            assert_eq!(tokens, local_tokens, "the refused case must equal the pruned model's own prefill");
            assert_eq!(node.snapshot().counters.requests, 0, "no request reached the node");
        }
    }
    // The full model's state changes what the pruned decoder says (else the test proves nothing).
    assert_ne!(want, local_tokens, "full-model and pruned prefill gave the same tokens; pick another seed");
}
