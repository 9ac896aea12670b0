//! A fresh streamed CUDA node's first advertised cost against its first measured pass.
//!
//! Before it has served anything the node advertises a weight pass predicted from its start-up
//! read of the shards and the pinned copy rate, and a compute predicted from the model's FLOPs
//! at the GEMM rate it measures (`server/predict.rs`); the decoder routes the first turn on
//! that. Here the prediction (`NodeCost::predict_s`) must be within 30 % of the first request's
//! measured time, request to hand-off state, over QUIC on loopback, on a node started the way
//! a node is restarted (kernels in the disk cache, weights checked).
//!
//! The check needs a checkpoint large enough that the weight pass and the GEMMs, not start-up
//! costs, set the time: `K3_COST_MODEL=DIR` (the K3-width 3-layer checkpoint that
//! `scripts/gpu-memory-plan.sh` synthesizes in /dev/shm/k3-3l; `scripts/gpu-run.sh tests` sets
//! it when that exists). Skipped, with the reason printed, without a GPU or without it.

mod cuda_util;

use std::sync::Arc;
use std::time::Instant;

use cuda_prefiller::backend::Backend;
use cuda_prefiller::cuda::Precision;
use cuda_prefiller::executor::{ExecOptions, LogitsRows, PrefillInput};
use cuda_prefiller::memory_plan::LogitsKept;
use cuda_prefiller::prefiller::{MemoryOptions, Prefiller, PrefillerOptions, WeightMode};
use cuda_prefiller::server::{PrefillNode, ServeOptions};
use cuda_prefiller::streamer::StreamOptions;
use k3_protocol::checkpoint::Checkpoint;
use k3_protocol::handoff::HandoffState;
use k3_protocol::transport::{NodeConfig, NodeIdentity, PeerAuth, PrefillClient};
use k3_protocol::wire::{PrefillOptions, PrefillRequest, SessionId, StateLayout};

#[test]
fn a_fresh_streamed_node_predicts_its_first_pass_within_30_percent() {
    let Some(dir) = std::env::var_os("K3_COST_MODEL") else {
        eprintln!("SKIPPED: set K3_COST_MODEL to a K3-width checkpoint (synth --preset k3 --layers 3) to run this check");
        return;
    };
    let Some(backend) = cuda_util::cuda(Precision::Bf16) else { return };
    let ck = Arc::new(Checkpoint::open(std::path::Path::new(&dir)).expect("checkpoint opens"));
    let fp = ck.fingerprint();
    let pf = Prefiller::open(
        Arc::new(backend),
        ck.clone(),
        &PrefillerOptions {
            weights: WeightMode::Streamed(StreamOptions::default()),
            memory: MemoryOptions::default(),
            chunk_tokens: None,
            logits: LogitsKept::Last,
            design: Vec::new(),
            design_cap: 65_536,
            emulate_source_gbs: None,
        },
    )
    .expect("the streamed prefiller opens");
    let cfg = pf.model.cfg.clone();
    // What a restarted node has before its first request: its kernels in the disk cache (a
    // short pass compiles or loads them; the first start of an install compiles them once)
    // and the weights checked against their digest (the node starts that in the background).
    let t = Instant::now();
    let mut scratch = HandoffState::empty(&cfg);
    let ids: Vec<u32> = (0..256u32).map(|i| 1 + i % (cfg.vocab_size as u32 - 1)).collect();
    let exec = ExecOptions { logits: LogitsRows::Last, ..Default::default() };
    pf.prefill(&mut scratch, PrefillInput::tokens(&ids), &exec, |_| Ok(())).expect("warm-up pass");
    ck.verify_all().expect("the weights match their digest");
    eprintln!("kernels loaded and weights checked in {:.1} s", t.elapsed().as_secs_f64());
    let opts = ServeOptions {
        chunk_tokens: pf.model.backend.default_chunk_tokens(),
        streamed: pf.streamed.clone(),
        planner: Some(pf.planner.clone()),
        ..ServeOptions::default()
    };
    let (s, c) = (NodeIdentity::generate().unwrap(), NodeIdentity::generate().unwrap());
    let scfg = NodeConfig::new(s.clone(), PeerAuth::pinned(c.fingerprint()), fp, "cuda");
    let ccfg = NodeConfig::new(c, PeerAuth::pinned(s.fingerprint()), fp, "mlx");
    let node = PrefillNode::start(pf.model.clone(), "127.0.0.1:0".parse().unwrap(), scfg, opts).expect("node starts");
    let addr = node.local_addr();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let vocab = cfg.vocab_size as u32;
    let mut rows = Vec::new();
    rt.block_on(async {
        for (turn, n) in [(1usize, 8192usize), (2, 8192), (3, 32_768)] {
            let mut client = PrefillClient::connect(addr, ccfg.clone()).await.expect("connect");
            let cost = client.cost().clone();
            let predicted = cost.predict_s(n as u64, 0);
            let tokens: Vec<u32> = (0..n as u32).map(|i| (i.wrapping_mul(7919) + 13 * turn as u32) % vocab).collect();
            let req = PrefillRequest { session: SessionId::random(), base: None, tokens, image_embeddings: None, options: PrefillOptions::default() };
            let t0 = Instant::now();
            let (state, _) = client.prefill(req, &StateLayout::for_model(&cfg, n)).await.expect("request").collect().await.expect("state");
            let measured = t0.elapsed().as_secs_f64();
            assert_eq!(state.tokens, n);
            client.close().await;
            eprintln!(
                "turn {turn}: {n} tokens, predicted {predicted:.3} s (pass {:.3} s from {} measured passes, compute {:.3} s, queue {:.3} s), measured {measured:.3} s, ratio {:.2}",
                cost.pass_s,
                cost.passes,
                cost.compute.seconds(n as u64, 0),
                cost.queue_s,
                predicted / measured
            );
            rows.push((turn, cost.passes, predicted, measured));
        }
    });
    drop(node);
    let (_, passes, predicted, measured) = rows[0];
    assert_eq!(passes, 0, "the first request's cost is the start-up prediction");
    let ratio = predicted / measured;
    assert!((0.7..=1.3).contains(&ratio), "first pass: predicted {predicted:.3} s, measured {measured:.3} s (ratio {ratio:.2}, bound ±30 %)");
}
