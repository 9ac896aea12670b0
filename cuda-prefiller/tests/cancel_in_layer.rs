//! Cancellation inside a layer: the executor asks `ExecOptions::cancel` before every token
//! chunk (and, on the CPU, before each chunk's routed experts), so a cancelled request stops
//! after the chunk in progress instead of at the end of its layer — which for a long prompt on a
//! slow backend is minutes away. Counted in calls, not seconds: deterministic.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use cuda_prefiller::executor::{self, CancelRef, Cancelled, ExecOptions, LogitsRows, PassRequest, PrefillInput};
use cuda_prefiller::model::Misread;
use k3_protocol::handoff::HandoffState;

fn ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + 13) % 1000).collect()
}

/// A cancel that answers "cancelled" from its `at`-th question on (1-based), counting them.
fn cancel_at(at: usize) -> (CancelRef, Arc<AtomicUsize>) {
    let asked = Arc::new(AtomicUsize::new(0));
    let a = asked.clone();
    (CancelRef(Arc::new(move |_i| a.fetch_add(1, Ordering::SeqCst) + 1 >= at)), asked)
}

/// tiny-a: layer 0 is KDA + dense FFN (one question per chunk), layer 1 KDA + latent MoE
/// (fronts, the routed experts one chunk at a time, backs: three per chunk). With 6 chunks of 64
/// tokens, question 15 is layer 1's third routed-expert chunk.
#[test]
fn a_cancel_stops_the_request_between_token_chunks_with_its_state_untouched() {
    let model = cpu_model(checkpoint(&tiny_a_dir()), Misread::default()).unwrap();
    let tokens = ids(6 * 64);
    let base = ExecOptions { chunk_tokens: 64, logits: LogitsRows::Last, ..Default::default() };

    // Never cancelled: the per-chunk experts give the results of the one call over all chunks.
    let mut plain = HandoffState::empty(&model.cfg);
    let want = executor::prefill(&model, &mut plain, PrefillInput::tokens(&tokens), &base, |_| Ok(())).unwrap();
    let (never, asked) = cancel_at(usize::MAX);
    let mut st = HandoffState::empty(&model.cfg);
    let opts = ExecOptions { cancel: Some(never), ..base.clone() };
    let got = executor::prefill(&model, &mut st, PrefillInput::tokens(&tokens), &opts, |_| Ok(())).unwrap();
    assert_eq!(got.logits, want.logits, "asking changed the results");
    assert_eq!(st, plain);
    // every layer asks once per chunk step: 6 (dense) + 18 per MoE layer
    assert_eq!(asked.load(Ordering::SeqCst), 6 + 8 * 18);

    // Cancelled at question 15: layer 1, after its 6 fronts and 2 of its 6 routed-expert chunks.
    let (cancel, asked) = cancel_at(15);
    let mut st = HandoffState::empty(&model.cfg);
    let before = st.clone();
    let mut layers = Vec::new();
    let opts = ExecOptions { cancel: Some(cancel), ..base.clone() };
    let e = executor::prefill(&model, &mut st, PrefillInput::tokens(&tokens), &opts, |ev| {
        layers.push(ev.layer);
        Ok(())
    })
    .expect_err("cancelled");
    let c = e.downcast_ref::<Cancelled>().unwrap_or_else(|| panic!("not a cancel: {e:#}"));
    assert_eq!(*c, Cancelled { layer: 1, done: 8, of: 18 }, "{e:#}");
    assert_eq!(asked.load(Ordering::SeqCst), 15, "nothing asked (so nothing computed) after the cancel");
    assert_eq!(st, before, "a cancelled request's state is untouched");
    assert!(layers.len() <= 1, "only layer 0 was finished: {layers:?}");

    // In a shared pass only the cancelled request leaves; the other one's results are unchanged.
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let f = flag.clone();
    let opts = ExecOptions { cancel: Some(CancelRef(Arc::new(move |i| i == 0 && f.load(Ordering::SeqCst)))), ..base.clone() };
    let (mut s0, mut s1) = (HandoffState::empty(&model.cfg), HandoffState::empty(&model.cfg));
    let other = ids(100);
    let mut reqs = [PassRequest { state: &mut s0, input: PrefillInput::tokens(&tokens) }, PassRequest { state: &mut s1, input: PrefillInput::tokens(&other) }];
    let outs = executor::prefill_many_with(&model, &mut executor::ModelWeights, &mut reqs, &opts, |_, ev| {
        if ev.layer == 1 {
            flag.store(true, Ordering::SeqCst);
        }
        Ok(())
    })
    .unwrap();
    let e = outs[0].as_ref().expect_err("request 0 cancelled");
    assert_eq!(e.downcast_ref::<Cancelled>().map(|c| (c.layer, c.done)), Some((3, 0)), "{e:#}");
    let mut alone = HandoffState::empty(&model.cfg);
    let want = executor::prefill(&model, &mut alone, PrefillInput::tokens(&other), &base, |_| Ok(())).unwrap();
    assert_eq!(outs[1].as_ref().unwrap().logits, want.logits);
    assert_eq!(s1, alone);
    assert_eq!(s0, HandoffState::empty(&model.cfg));
}
