//! The prefill node under heavy load (docs/hardening.md, "Hostile and heavy load"): an
//! abandoned long prefill stops computing within a token chunk of the cancel, a prompt beyond
//! the node's memory plan is refused before it is accepted, and a decoder queued behind a long
//! prefill takes its turn back once a local prefill would already be done. CPU backend.

use std::time::{Duration, Instant};

use cuda_prefiller::memory_plan::{BackendShape, Geometry, Knobs, Limits};
use cuda_prefiller::prefiller::Planner;
use cuda_prefiller::server::{RequestOutcome, ServeOptions};
use k3_e2e_tests::*;
use k3_protocol::transport::{PrefillClient, TransferError, TransferEvent};
use k3_protocol::wire::{ErrorCode, PrefillOptions, PrefillRequest, SessionId, StateLayout};
use mac_decoder::decode::Engine;
use mac_decoder::remote::{Conversation, Route};

fn request(tokens: Vec<u32>) -> PrefillRequest {
    PrefillRequest {
        session: SessionId::random(),
        base: None,
        tokens,
        image_embeddings: None,
        options: PrefillOptions { keep_session: true, return_last_logits: true, ..PrefillOptions::default() },
    }
}

/// Waits for the node's `n`-th request record (the node writes it once the worker let go of
/// the request), polling; the time it took.
fn wait_record(node: &cuda_prefiller::server::PrefillNode, n: usize, limit: Duration) -> (cuda_prefiller::server::RequestRecord, Duration) {
    let t0 = Instant::now();
    loop {
        if let Some(r) = node.snapshot().recent.get(n - 1) {
            return (r.clone(), t0.elapsed());
        }
        assert!(t0.elapsed() < limit, "no record {n} within {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `cancelled in layer L after D of its N token-chunk steps` in a failure reason.
fn cancelled_steps(reason: &str) -> Option<(usize, usize, usize)> {
    let rest = &reason[reason.find("cancelled in layer ")? + "cancelled in layer ".len()..];
    let mut w = rest.split_whitespace();
    let layer = w.next()?.parse().ok()?;
    let (_, done, _, _, of) = (w.next()?, w.next()?.parse().ok()?, w.next()?, w.next()?, w.next()?.parse().ok()?);
    Some((layer, done, of))
}

/// A 300,000-token prompt on tiny-a (a layer of it takes tens of seconds on the CPU backend):
/// the decoder cancels 1 s after the node started it; the node's worker stops before its next
/// token chunk (it used to go on to the end of the layer, minutes on a slow node) — its record,
/// written once the worker let go, comes within 2 s, names where it stopped, and the node serves
/// the next request at once.
#[test]
fn an_abandoned_long_prefill_stops_computing_within_two_seconds() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    let node = start_node(&dir, scfg, ServeOptions::default());
    let addr = node.local_addr();
    let c = cpu_model(&dir).cfg.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let n = 300_000;
    let cancelled_at = rt.block_on(async {
        let mut client = PrefillClient::connect(addr, ccfg.clone()).await.expect("connect");
        let mut t = client.prefill(request(prompt(1, n, 1000)), &StateLayout::for_model(&c, n)).await.expect("accepted");
        // progress 0: the node started the request
        match t.next().await.expect("transfer") {
            Some(TransferEvent::Progress(p)) if p.layers_done == 0 => {}
            other => panic!("expected the start before anything else: {other:?}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let at = Instant::now();
        t.cancel("the client left").await;
        client.close().await;
        at
    });
    let (rec, _) = wait_record(&node, 1, Duration::from_secs(30));
    let stopped = cancelled_at.elapsed();
    let RequestOutcome::Failed { reason } = &rec.outcome else { panic!("{rec:?}") };
    let (layer, done, of) = cancelled_steps(reason).unwrap_or_else(|| panic!("no in-layer cancel in {reason:?}"));
    eprintln!("stopped {:.3} s after the cancel, in layer {layer} after {done} of {of} chunk steps", stopped.as_secs_f64());
    assert!(stopped < Duration::from_secs(2), "the node stopped {:.2} s after the cancel ({reason})", stopped.as_secs_f64());
    assert!(done < of, "the whole layer ran: {reason}");
    assert!(node.snapshot().counters.layers_sent as usize <= layer, "a layer past the cancel was sent");
    // the compute is free: a short request is served without waiting
    let (state, _) = rt.block_on(async {
        let mut client = PrefillClient::connect(addr, ccfg).await.expect("connect");
        let r = client.prefill(request(prompt(2, 64, 1000)), &StateLayout::for_model(&c, 64)).await.expect("accepted").collect().await.expect("state");
        client.close().await;
        r
    });
    assert_eq!(state.tokens, 64);
    let (rec, _) = wait_record(&node, 2, Duration::from_secs(30));
    assert_eq!(rec.outcome, RequestOutcome::Completed);
    assert!(rec.queue_s < 0.5, "the next request waited {:.2} s for the worker", rec.queue_s);
}

/// The node's memory plan caps the prompt: a prompt that cannot fit is refused (`TooLarge`, with
/// the plan's reason and the longest prompt that fits) before it is accepted or queued — no
/// weight pass runs for it — and one that fits is served.
#[test]
fn a_prompt_beyond_the_memory_plan_is_refused_before_it_is_accepted() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    let model = cpu_model(&dir);
    let planner = Planner {
        geometry: Geometry::of(&model.cfg, &model.plan).unwrap(),
        shape: BackendShape::cpu(),
        limits: Limits { device: 8_000_000, host: 4_000_000_000 },
        knobs: Knobs::default(),
    };
    let longest = planner.longest_prompt();
    assert!(longest > 100 && longest < 100_000, "{longest}");
    let c = model.cfg.clone();
    let node = start_node(&dir, scfg, ServeOptions { planner: Some(planner), ..ServeOptions::default() });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let mut client = PrefillClient::connect(node.local_addr(), ccfg).await.expect("connect");
        let n = longest + 1;
        match client.prefill(request(prompt(3, n, 1000)), &StateLayout::for_model(&c, n)).await {
            Err(TransferError::Refused { code: ErrorCode::TooLarge, message, .. }) => {
                assert!(message.contains("--vram-budget") && message.contains(&format!("the longest prompt that fits is {longest} tokens")), "{message}");
            }
            Err(e) => panic!("expected a TooLarge refusal, got {e}"),
            Ok(_) => panic!("a prompt beyond the plan was accepted"),
        }
        let (st, _) = client.prefill(request(prompt(4, 100, 1000)), &StateLayout::for_model(&c, 100)).await.expect("accepted").collect().await.expect("state");
        assert_eq!(st.tokens, 100);
        client.close().await;
    });
    let recent = records(&node, 2);
    assert!(matches!(&recent[0].outcome, RequestOutcome::Refused { code, .. } if code == "TooLarge"), "{:?}", recent[0]);
    assert_eq!(recent[1].outcome, RequestOutcome::Completed);
    assert_eq!(node.snapshot().counters.weight_passes, 1, "only the prompt that fits ran a weight pass");
}

/// A decoder queued behind a long prefill (9 layers × 1 s on the node) takes its turn back once
/// it has waited in the node's queue as long as its predicted local prefill (240 tokens at the
/// default 120 tok/s: 2 s) and prefills locally, instead of waiting out the other pass.
#[test]
fn a_decoder_queued_behind_a_long_prefill_falls_back_once_local_would_be_done() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    let node = start_node(&dir, scfg, ServeOptions { layer_delay: Duration::from_secs(1), ..ServeOptions::default() });
    let addr = node.local_addr();
    let c = cpu_model(&dir).cfg.clone();
    // The first decoder: a request that holds the node ~9 s, cancelled once the test is done.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let first_cfg = ccfg.clone();
    let first = rt.spawn(async move {
        let mut client = PrefillClient::connect(addr, first_cfg).await.expect("connect");
        let mut t = client.prefill(request(prompt(5, 300, 1000)), &StateLayout::for_model(&c, 300)).await.expect("accepted");
        match t.next().await.expect("transfer") {
            Some(TransferEvent::Progress(p)) if p.layers_done == 0 => started_tx.send(()).unwrap(),
            other => panic!("expected the start first: {other:?}"),
        }
        let _ = go_rx.await;
        t.cancel("done with it").await;
        client.close().await;
    });
    started_rx.recv_timeout(Duration::from_secs(30)).expect("the first request started");

    let engine = Engine::load(&dir).unwrap();
    let mut remote = remote(&engine, addr, ccfg, 1);
    let mut conv = Conversation::new(&engine).unwrap();
    let p = prompt(6, 240, 1000);
    let t0 = Instant::now();
    let t = remote.prefill(&engine, &mut conv, &p, None).unwrap();
    let took = t0.elapsed();
    eprintln!("queued turn: {:?} after {:.2} s: {}", t.route, took.as_secs_f64(), t.reason);
    assert_eq!(t.route, Route::Fallback, "{}", t.reason);
    assert!(t.reason.contains("in the node's queue, longer than a local prefill of this turn"), "{}", t.reason);
    assert!(took < Duration::from_secs(6), "the queued turn took {:.2} s (the node is busy for ~9 s)", took.as_secs_f64());
    assert_eq!(conv.session().tokens(), p.len());
    // the same answer as a local prefill
    let (want, _) = local_greedy(&engine, &p, 4);
    let got = conv.generate(&engine, &mac_decoder::decode::GenerateParams::greedy(4), |_| true).unwrap().tokens;
    assert_eq!(got, want);
    let _ = go_tx.send(());
    rt.block_on(first).unwrap();
}
