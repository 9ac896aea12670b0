//! Multi-turn sessions: the prefill node keeps each conversation's prefix, so every later turn
//! prefills only what the node has not seen — the tokens the decoder generated and the new
//! prompt — and the result equals a fresh one-shot prefill of the whole conversation.

use cuda_prefiller::server::{RequestOutcome, ServeOptions, StoreLimits};
use k3_e2e_tests::*;
use mac_decoder::decode::{Engine, GenerateParams};
use mac_decoder::remote::{Conversation, Route};

const GEN: usize = 8;

#[test]
fn three_turns_prefill_only_new_tokens_and_equal_one_shot() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    let node = start_node(&dir, scfg, ServeOptions::default());
    let engine = Engine::load(&dir).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 16);
    let mut conv = Conversation::new(&engine).unwrap();
    let turns = [prompt(21, 150, 1000), prompt(22, 60, 1000), prompt(24, 45, 1000)];
    let mut held = 0; // tokens the node holds for this conversation
    let mut last_logits = Vec::new();
    for (i, p) in turns.iter().enumerate() {
        let before = conv.tokens().len();
        let t = remote.prefill(&engine, &mut conv, p, None).unwrap();
        assert_eq!(t.route, Route::Remote, "turn {}: {}", i + 1, t.reason);
        // Only what the node has not seen: the previous turn's generated tokens + this prompt.
        let unseen = before - held;
        assert_eq!(t.prefill_tokens, unseen + p.len(), "turn {}", i + 1);
        assert_eq!(unseen, if i == 0 { 0 } else { GEN });
        let rec = records(&node, i + 1)[i].clone();
        assert_eq!(rec.outcome, RequestOutcome::Completed);
        assert_eq!(rec.base_tokens as usize, held, "turn {}: the request's base is the node's prefix", i + 1);
        assert_eq!(rec.new_tokens as usize, unseen + p.len());
        assert_eq!(conv.remote_prefix_tokens(), before + p.len());
        held = before + p.len();
        last_logits = conv.last_logits().unwrap().to_vec();
        if i + 1 < turns.len() {
            let out = conv.generate(&engine, &GenerateParams::greedy(GEN), |_| true).unwrap();
            assert_eq!(out.tokens.len(), GEN);
        }
    }
    let conversation = conv.tokens().to_vec();
    assert_eq!(conversation.len(), 150 + GEN + 60 + GEN + 45);

    // A fresh one-shot prefill of the whole conversation, on the decoder (MLX) and on the CPU
    // reference: the last logits agree within the golden tolerance.
    let (one_shot_tokens, one_shot_logits) = local_greedy(&engine, &conversation, 12);
    let err = rel_l2(&last_logits, &one_shot_logits);
    assert!(err <= 1e-3, "three remote turns vs one-shot local prefill: relative error {err:.2e}");
    let (_, cpu_logits) = cpu_prefill(&cpu_model(&dir), &conversation);
    let err = rel_l2(&last_logits, &cpu_logits);
    assert!(err <= 1e-3, "three remote turns vs one-shot CPU reference prefill: relative error {err:.2e}");
    // And the same greedy continuation.
    let m = top_margin(&one_shot_logits);
    assert!(m > 1e-2, "near tie ({m:.2e}): the greedy comparison would be meaningless");
    let out = conv.generate(&engine, &GenerateParams::greedy(12), |_| true).unwrap();
    assert_eq!(out.tokens, one_shot_tokens, "greedy tokens after three remote turns vs a one-shot prefill");
    records(&node, 3);
    let snap = node.snapshot();
    assert_eq!(snap.counters.completed, 3);
    assert_eq!(snap.sessions.sessions, 1);
}

#[test]
fn an_evicted_prefix_is_resent_whole_with_the_same_result() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    // A store too small for any prefix: the node keeps nothing between turns.
    let opts = ServeOptions { store: StoreLimits { max_bytes: 1000, ..StoreLimits::default() }, ..ServeOptions::default() };
    let node = start_node(&dir, scfg, opts);
    let engine = Engine::load(&dir).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 16);
    let mut conv = Conversation::new(&engine).unwrap();
    let (p1, p2) = (prompt(31, 120, 1000), prompt(32, 40, 1000));
    remote.prefill(&engine, &mut conv, &p1, None).unwrap();
    conv.generate(&engine, &GenerateParams::greedy(GEN), |_| true).unwrap();
    let (cap, guard) = LogCapture::start();
    let t = remote.prefill(&engine, &mut conv, &p2, None).unwrap();
    drop(guard);
    assert_eq!(t.route, Route::Remote, "{}", t.reason);
    assert_eq!(t.prefill_tokens, 120 + GEN + 40, "the whole conversation was resent");
    assert!(cap.text().contains("no longer holds this conversation"), "log: {}", cap.text());
    let recent = records(&node, 3);
    let refused = &recent[recent.len() - 2];
    assert!(matches!(&refused.outcome, RequestOutcome::Refused { code, .. } if code == "BaseNotHeld"), "{refused:?}");
    assert_eq!(recent.last().unwrap().base_tokens, 0);
    let (_, one_shot) = local_greedy(&engine, conv.tokens(), 1);
    let err = rel_l2(conv.last_logits().unwrap(), &one_shot);
    assert!(err <= 1e-3, "resent conversation vs one-shot: relative error {err:.2e}");
}

#[test]
fn short_turns_stay_local_and_the_next_long_turn_sends_them() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    let node = start_node(&dir, scfg, ServeOptions::default());
    let engine = Engine::load(&dir).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 50);
    let mut conv = Conversation::new(&engine).unwrap();
    let t1 = remote.prefill(&engine, &mut conv, &prompt(41, 100, 1000), None).unwrap();
    assert_eq!(t1.route, Route::Remote);
    conv.generate(&engine, &GenerateParams::greedy(4), |_| true).unwrap();
    let t2 = remote.prefill(&engine, &mut conv, &prompt(42, 10, 1000), None).unwrap();
    assert_eq!(t2.route, Route::Local, "10 tokens are under the threshold of 50");
    assert!(t2.reason.contains("below --remote-min-tokens 50"), "{}", t2.reason);
    conv.generate(&engine, &GenerateParams::greedy(4), |_| true).unwrap();
    let t3 = remote.prefill(&engine, &mut conv, &prompt(43, 60, 1000), None).unwrap();
    assert_eq!(t3.route, Route::Remote, "{}", t3.reason);
    // The node holds 100 tokens; everything after them travels: 4 + 10 + 4 + 60.
    assert_eq!(t3.prefill_tokens, 78);
    assert_eq!(records(&node, 2)[1].base_tokens, 100);
    let (_, one_shot) = local_greedy(&engine, conv.tokens(), 1);
    let err = rel_l2(conv.last_logits().unwrap(), &one_shot);
    assert!(err <= 1e-3, "mixed local/remote turns vs one-shot: relative error {err:.2e}");
}
