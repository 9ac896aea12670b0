//! Whatever goes wrong with the prefill node, the decoder prefills locally and the user gets the
//! same tokens, with a log line saying why: a node killed mid-transfer, a refusal, another model,
//! a corrupted chunk (never used), a node that is not there. Each check compares against the
//! same engine's local prefill, bit for bit where the fallback is exactly that computation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_prefiller::server::{RequestOutcome, ServeOptions};
use k3_e2e_tests::*;
use k3_protocol::transport::hooks::FaultHooks;
use mac_decoder::decode::{Engine, GenerateParams};
use mac_decoder::remote::{run_turn, Conversation, RemotePrefiller, Route, TurnTiming};

const GEN: usize = 12;

/// One turn through `remote` with the log captured; checks a local fallback happened, the
/// tokens equal a local-only run, and the state was never touched by the failed transfer.
fn expect_fallback(engine: &Engine, remote: &mut RemotePrefiller, p: &[u32], cause: &[&str]) -> TurnTiming {
    let (want_tokens, want_logits) = local_greedy(engine, p, GEN);
    let mut conv = Conversation::new(engine).unwrap();
    let (cap, guard) = LogCapture::start();
    let t = remote.prefill(engine, &mut conv, p, None).unwrap();
    drop(guard);
    let log = cap.text();
    assert_eq!(t.route, Route::Fallback, "expected a fallback: {t:?}");
    for c in cause {
        assert!(t.reason.contains(c), "fallback reason {:?} lacks {c:?}", t.reason);
        assert!(log.contains(c), "the log does not say {c:?}:\n{log}");
    }
    assert!(log.contains("WARN") && log.contains("prefilling locally"), "no warning line:\n{log}");
    // Nothing of the failed transfer reached the session: it is exactly the local prefill.
    assert_eq!(conv.last_logits().unwrap(), &want_logits[..], "the fallback's logits differ from a plain local prefill");
    assert_eq!(conv.remote_prefix_tokens(), 0);
    let out = conv.generate(engine, &GenerateParams::greedy(GEN), |_| true).unwrap();
    assert_eq!(out.tokens, want_tokens);
    t
}

#[test]
fn node_killed_mid_transfer() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (mut scfg, mut ccfg) = paired(fp, fp);
    // Short QUIC idle timeout: the dead node is noticed within ~2 s.
    scfg.tuning = test_tuning();
    ccfg.tuning = test_tuning();
    // Slow layers, so the transfer is surely in progress when the node dies.
    let opts = ServeOptions { layer_delay: Duration::from_millis(250), ..ServeOptions::default() };
    let node = start_node(&dir, scfg, opts);
    let engine = Engine::load(&dir).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 1);
    let metrics = node.metrics();
    let killed = Arc::new(AtomicBool::new(false));
    let k = killed.clone();
    let killer = std::thread::spawn(move || {
        let t0 = Instant::now();
        while metrics.counters().layers_sent < 3 {
            assert!(t0.elapsed() < Duration::from_secs(20), "the transfer never started");
            std::thread::sleep(Duration::from_millis(10));
        }
        node.kill(); // no goodbye: like a killed process
        k.store(true, Ordering::SeqCst);
    });
    let p = prompt(51, 200, 1000);
    let t = expect_fallback(&engine, &mut remote, &p, &["remote prefill on", "connection"]);
    killer.join().unwrap();
    assert!(killed.load(Ordering::SeqCst));
    assert!(t.failed_attempt_s.unwrap() < 10.0, "the dead node was noticed late: {t:?}");
    // The node stays marked down for a while: the next turn does not wait on it again.
    let t2 = expect_fallback(&engine, &mut remote, &prompt(52, 100, 1000), &["failed", "retrying after"]);
    assert!(t2.failed_attempt_s.is_none());
}

#[test]
fn node_refuses_the_request() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    let opts = ServeOptions { max_request_tokens: 100, ..ServeOptions::default() };
    let node = start_node(&dir, scfg, opts);
    let engine = Engine::load(&dir).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 1);
    expect_fallback(&engine, &mut remote, &prompt(61, 150, 1000), &["TooLarge", "limit of 100"]);
    let rec = records(&node, 1)[0].clone();
    assert!(matches!(rec.outcome, RequestOutcome::Refused { ref code, .. } if code == "TooLarge"), "{rec:?}");
    // A refusal is an answer: the connection stays and a request the node takes still works.
    let mut conv = Conversation::new(&engine).unwrap();
    let t = remote.prefill(&engine, &mut conv, &prompt(62, 80, 1000), None).unwrap();
    assert_eq!(t.route, Route::Remote, "{}", t.reason);
    assert_eq!(node.snapshot().counters.connections, 1);
}

#[test]
fn node_with_another_model() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    // The fingerprint covers the config and the tensor index (not the data): another shape.
    let other = synth(99, |o| o.layers = Some(5));
    let (theirs, ours) = (fingerprint_of(other.path()), fingerprint_of(&dir));
    assert_ne!(theirs, ours);
    let (scfg, ccfg) = paired(theirs, ours);
    let node = start_node(other.path(), scfg, ServeOptions::default());
    let engine = Engine::load(&dir).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 1);
    expect_fallback(&engine, &mut remote, &prompt(71, 120, 1000), &["fingerprint mismatch", &theirs.hex()]);
    assert_eq!(node.snapshot().counters.requests, 0, "no request reached the node");
    assert!(node.snapshot().counters.handshake_failures >= 1);
}

/// Issue 21: a node with seed-2 weights and the same architecture matched the decoder's seed-1
/// fingerprint and served a remote turn. The fingerprint now covers the weight bytes.
#[test]
fn node_with_other_weights_of_the_same_architecture() {
    init_tracing();
    let ours_dir = synth(1, |_| {});
    let theirs_dir = synth(2, |_| {});
    let (theirs, ours) = (fingerprint_of(theirs_dir.path()), fingerprint_of(ours_dir.path()));
    assert_ne!(theirs, ours, "seed 1 and seed 2 weights give the same model fingerprint");
    let (scfg, ccfg) = paired(theirs, ours);
    let node = start_node(theirs_dir.path(), scfg, ServeOptions::default());
    let engine = Engine::load(ours_dir.path()).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 1);
    expect_fallback(&engine, &mut remote, &prompt(72, 120, 1000), &["fingerprint mismatch", &theirs.hex()]);
    assert_eq!(node.snapshot().counters.requests, 0, "no request reached the node");
}

/// A shard damaged after its digest was cached (size and mtime kept, as bit rot would): the
/// fingerprint still matches, but the node checks each layer's bytes as it uses them and fails
/// the transfer instead of sending state computed from the damaged weights. (The decoder runs
/// an intact copy: it checks its own weights as it loads them and would refuse the damaged one.)
#[test]
fn node_with_a_damaged_layer_refuses_to_use_it() {
    init_tracing();
    let dir = synth(3, |_| {});
    let intact = synth(3, |_| {});
    let fp = fingerprint_of(dir.path()); // digest made and cached beside the checkpoint
    assert_eq!(fingerprint_of(intact.path()), fp);
    let name = "language_model.model.layers.2.input_layernorm.weight";
    let (path, at) = {
        let ck = k3_protocol::Checkpoint::open(dir.path()).unwrap();
        let e = ck.entry(name).unwrap().clone();
        (dir.path().join(ck.shard_name(e.shard)), e.start)
    };
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // The lowest mantissa bit of one BF16 gain: still a finite model (the local fallback runs).
    bytes[at] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    std::fs::File::options().write(true).open(&path).unwrap().set_modified(mtime).unwrap();
    assert_eq!(fingerprint_of(dir.path()), fp, "size and mtime kept: the cached digest is used");
    let (scfg, ccfg) = paired(fp, fp);
    let node = start_node(dir.path(), scfg, ServeOptions::default());
    let engine = Engine::load(intact.path()).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 1);
    expect_fallback(&engine, &mut remote, &prompt(73, 120, 1000), &["remote prefill on", "weight digest"]);
    assert!(node.snapshot().counters.layers_sent <= 2, "layers after the damaged one were sent");
    // the damaged copy's cached digest was deleted: opened again, it has its own fingerprint
    assert_ne!(fingerprint_of(dir.path()), fp);
    // and the decoder refuses to load a damaged checkpoint whose cache still matches its stamps
    let damaged = synth(3, |_| {});
    assert_eq!(fingerprint_of(damaged.path()), fp);
    let path = damaged.path().join(path.file_name().unwrap());
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let mut b = std::fs::read(&path).unwrap();
    b[at] ^= 0x01;
    std::fs::write(&path, &b).unwrap();
    std::fs::File::options().write(true).open(&path).unwrap().set_modified(mtime).unwrap();
    let e = format!("{:#}", Engine::load(damaged.path()).err().expect("the decoder loaded weights that differ from its fingerprint's digest"));
    assert!(e.contains(name) && e.contains("differ from the weight digest"), "{e}");
}

/// Issue 21: a decoder request whose client left kept the node computing (a disconnect at 2 s
/// still cost the node 25 s). A cancelled prefill now cancels the QUIC transfer; the node's
/// worker stops at its next layer, and the decoder does not fall back to a local prefill.
#[test]
fn a_cancelled_request_stops_the_remote_prefill_within_a_layer() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    let delay = Duration::from_millis(300);
    let node = start_node(&dir, scfg, ServeOptions { layer_delay: delay, ..ServeOptions::default() });
    let engine = Engine::load(&dir).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 1);
    let flag = Arc::new(AtomicBool::new(false));
    remote.set_cancel(Some(flag.clone()));
    let metrics = node.metrics();
    let f = flag.clone();
    let canceller = std::thread::spawn(move || {
        let t0 = Instant::now();
        while metrics.counters().layers_sent < 2 {
            assert!(t0.elapsed() < Duration::from_secs(20), "the transfer never started");
            std::thread::sleep(Duration::from_millis(10));
        }
        f.store(true, Ordering::SeqCst);
        Instant::now()
    });
    let mut conv = Conversation::new(&engine).unwrap();
    let err = remote.prefill(&engine, &mut conv, &prompt(91, 200, 1000), None).expect_err("a cancelled prefill must not succeed");
    let cancelled_at = canceller.join().unwrap();
    let returned_s = cancelled_at.elapsed().as_secs_f64();
    assert!(err.downcast_ref::<mac_decoder::remote::Cancelled>().is_some(), "{err:#}");
    assert_eq!(conv.session().tokens(), 0, "nothing of the cancelled prefill reached the conversation");
    assert!(returned_s < 3.0 * delay.as_secs_f64() + 1.0, "the decoder returned {returned_s:.2} s after the cancel");
    // The node stops within about a layer: far fewer than all 9 layers are computed.
    let t0 = Instant::now();
    while node.snapshot().counters.failed == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the node never saw the transfer end");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(delay * 3);
    let sent = node.snapshot().counters.layers_sent;
    assert!(sent <= 5, "the node sent {sent} of 9 layers after a cancel at 2");
    // The connection stays usable: the next request is served remotely.
    remote.set_cancel(None);
    let mut conv = Conversation::new(&engine).unwrap();
    let t = remote.prefill(&engine, &mut conv, &prompt(92, 60, 1000), None).unwrap();
    assert_eq!(t.route, Route::Remote, "{}", t.reason);
}

#[test]
fn corrupted_chunk_is_never_used() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    // Chunk 5 gets one payload byte flipped after its checksum was computed.
    let scfg = k3_protocol::transport::NodeConfig { hooks: Arc::new(FaultHooks { corrupt_chunk: Some(5), ..FaultHooks::default() }), ..scfg };
    let node = start_node(&dir, scfg, ServeOptions::default());
    let engine = Engine::load(&dir).unwrap();
    let mut remote = remote(&engine, node.local_addr(), ccfg, 1);
    expect_fallback(&engine, &mut remote, &prompt(81, 200, 1000), &["bad data", "checksum"]);
    // The node learns the transfer failed and keeps nothing for the session.
    let t0 = Instant::now();
    while node.snapshot().counters.failed == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the node never saw the transfer fail");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(node.snapshot().sessions.sessions, 0);
}

#[test]
fn node_not_there() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let (_scfg, ccfg) = paired(fp, fp);
    // A loopback port nobody listens on.
    let addr = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let engine = Engine::load(&dir).unwrap();
    let mut opts = remote_options(addr, 1);
    opts.connect_timeout = Duration::from_secs(1);
    let mut remote = RemotePrefiller::with_node_config(&engine, opts, ccfg).unwrap();
    let (out, t) = {
        let mut conv = Conversation::new(&engine).unwrap();
        let (cap, guard) = LogCapture::start();
        let r = run_turn(&engine, &mut conv, Some(&mut remote), &prompt(91, 100, 1000), None, &GenerateParams::greedy(GEN), |_| true).unwrap();
        drop(guard);
        assert!(cap.text().contains("cannot reach"), "{}", cap.text());
        r
    };
    assert_eq!(t.route, Route::Fallback);
    assert!(t.reason.contains("cannot reach"), "{}", t.reason);
    assert_eq!(out.tokens, local_greedy(&engine, &prompt(91, 100, 1000), GEN).0);
}
