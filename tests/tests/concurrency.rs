//! Two decoders on one prefill node at the same time: the node runs one weight pass at a time
//! (a request arriving during a pass waits in its queue, with heartbeats, and requests waiting
//! together share the next pass) and both conversations get correct results, each with its own
//! session prefix.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use cuda_prefiller::server::{RequestOutcome, ServeOptions};
use k3_e2e_tests::*;
use mac_decoder::decode::{Engine, GenerateParams};
use mac_decoder::remote::{Conversation, Route};

#[test]
fn two_decoders_share_one_node() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (mut scfg, mut ccfg) = paired(fp, fp);
    // No fault is injected here: keep the production-size stall and idle limits, so that the two
    // MLX decoders competing for 2 CPU cores (one verifying against a local prefill while the
    // other confirms its hand-off) are not mistaken for a stalled peer.
    for c in [&mut scfg, &mut ccfg] {
        c.tuning.stall_timeout = Duration::from_secs(60);
        c.tuning.idle_timeout = Duration::from_secs(30);
    }
    // Slow layers: the two requests surely overlap.
    let opts = ServeOptions { layer_delay: Duration::from_millis(60), ..ServeOptions::default() };
    let node = start_node(&dir, scfg, opts);
    let addr = node.local_addr();
    let start = Arc::new(Barrier::new(2));
    let decoders: Vec<_> = (0..2u64)
        .map(|d| {
            let (dir, ccfg, start) = (dir.clone(), ccfg.clone(), start.clone());
            std::thread::spawn(move || {
                let engine = Engine::load(&dir).unwrap();
                let mut remote = remote(&engine, addr, ccfg, 1);
                let mut conv = Conversation::new(&engine).unwrap();
                let turns = [prompt(100 + d, 180 + 20 * d as usize, 1000), prompt(200 + d, 40, 1000)];
                start.wait();
                let mut outputs = Vec::new();
                for p in &turns {
                    let t = remote.prefill(&engine, &mut conv, p, None).unwrap();
                    assert_eq!(t.route, Route::Remote, "decoder {d}: {}", t.reason);
                    outputs.push(conv.generate(&engine, &GenerateParams::greedy(10), |_| true).unwrap().tokens);
                }
                // Reference: the same conversation, prefilled locally turn by turn.
                let mut local = Conversation::new(&engine).unwrap();
                for (p, want) in turns.iter().zip(&outputs) {
                    local.prefill_local(&engine, p, None).unwrap();
                    let got = local.generate(&engine, &GenerateParams::greedy(10), |_| true).unwrap().tokens;
                    assert_eq!(&got, want, "decoder {d}: remote turn tokens differ from local ones");
                }
                (conv.id().to_string(), conv.tokens().len())
            })
        })
        .collect();
    let results: Vec<(String, usize)> = decoders.into_iter().map(|h| h.join().expect("decoder thread")).collect();
    let recs = records(&node, 4);
    assert!(recs.iter().all(|r| r.outcome == RequestOutcome::Completed), "{recs:?}");
    for (session, tokens) in &results {
        let mine: Vec<_> = recs.iter().filter(|r| &r.session == session).collect();
        assert_eq!(mine.len(), 2, "two requests per decoder");
        assert_eq!(mine[1].base_tokens as usize + mine[1].new_tokens as usize + 10, *tokens);
    }
    // They did run at the same time: at least one request waited behind the other's compute, or
    // two shared a weight pass.
    assert!(recs.iter().any(|r| r.queue_s > 0.05 || r.pass_requests > 1), "no request ever waited or shared a pass: {recs:?}");
    assert_eq!(node.snapshot().sessions.sessions, 2);
    assert_eq!(node.snapshot().counters.connections, 2);
}
