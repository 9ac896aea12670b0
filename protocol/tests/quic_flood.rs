//! A flood of half-open QUIC Initials (issue 21: 15,090 in 25 s raised the node's RSS from 51 to
//! 640 MB, with no limit on concurrent handshakes and no address validation). The flood goes
//! through a relay that forwards each new connection's first datagram to the node and keeps the
//! node's answers from the flooder, so the node sees Initials from peers that never complete a
//! handshake. The relay reads each answer's first packet: a stateless Retry or the start of a
//! handshake (a server Initial).
//!
//! What is asserted is exact, whatever the machine's load: the flood's Initials carry the right
//! ALPN, so a handshake the node starts waits for its peer (the node's handshake and idle timeouts
//! are set past the test's length) and holds its slot. The node must therefore start exactly
//! `retry_above` handshakes for the flood and answer every other flood Initial with a Retry; the
//! decoder, which connects once those slots are held, is sent a Retry, answers it and is served.
//! The flooder keeps at most `WINDOW` Initials unanswered, far below what quinn buffers for the
//! accept loop, so a slow box makes the flood slower, not different.

mod quic_support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k3_protocol::transport::*;
use quic_support::*;

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<u64>().ok()).map_or(0, |kb| kb * 1024)
}

/// (first byte, destination CID, source CID) of a QUIC long-header packet.
fn long_header(d: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    if d.len() < 7 || d[0] & 0x80 == 0 {
        return None;
    }
    let n = d[5] as usize;
    let dcid = d.get(6..6 + n)?;
    let m = *d.get(6 + n)? as usize;
    let scid = d.get(7 + n..7 + n + m)?;
    Some((d[0], dcid, scid))
}

/// A QUIC v1 long-header packet of type Retry (type bits 0b11).
fn is_retry(first: u8) -> bool {
    first & 0x30 == 0x30
}

/// What the relay saw of the node's first answers to the flood.
#[derive(Default)]
struct Answers {
    /// Source CIDs of forwarded flood Initials not answered yet.
    pending: HashSet<Vec<u8>>,
    retries: u64,
    handshakes: u64,
}

const FLOOD: u64 = 3000;
/// Flood Initials the flooder lets be in flight unanswered (quinn buffers `4 × max_handshakes`).
const WINDOW: u64 = 64;

async fn wait_for(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(secs), "timed out after {secs} s waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_half_open_initials_is_answered_statelessly_and_the_decoder_is_still_served() {
    init_tracing();
    let (mut scfg, ccfg) = paired();
    // A half-open handshake holds its slot for the whole test.
    scfg.tuning.handshake_timeout = Duration::from_secs(300);
    scfg.tuning.idle_timeout = Duration::from_secs(300);
    let retry_above = scfg.tuning.retry_above as u64;
    assert!(retry_above < scfg.tuning.max_handshakes as u64 && retry_above + 1 < scfg.tuning.max_connections_per_ip as u64);
    assert!(WINDOW * 2 < 4 * scfg.tuning.max_handshakes as u64);
    let server = Arc::new(PrefillServer::bind("127.0.0.1:0".parse().unwrap(), scfg).unwrap());
    let addr = server.local_addr();
    // Serve every decoder that completes the handshake.
    let srv = server.clone();
    let served = Arc::new(AtomicU64::new(0));
    let sv = served.clone();
    tokio::spawn(async move {
        while let Some(c) = srv.accept().await {
            let Ok(mut conn) = c else { continue };
            let sv = sv.clone();
            tokio::spawn(async move {
                while let Ok(Some(req)) = conn.next_request().await {
                    let layout = small_layout(req.request.tokens.len() as u64);
                    if serve_one(req, layout, Behaviour::Serve { seed: 3 }).await.is_ok() {
                        sv.fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
        }
    });

    // The relay: forwards the first datagram of each new connection to the node, reads the
    // first answer to each and drops every answer.
    let relay = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let answers = Arc::new(Mutex::new(Answers::default()));
    let relay_task = tokio::spawn({
        let (stop, sent, answers) = (stop.clone(), sent.clone(), answers.clone());
        async move {
            let out = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let mut seen = HashSet::new();
            let mut buf = vec![0u8; 65536];
            let mut back = vec![0u8; 65536];
            while !stop.load(Ordering::Relaxed) {
                tokio::select! {
                    r = relay.recv_from(&mut buf) => {
                        let Ok((n, _)) = r else { break };
                        if let Some((_, dcid, scid)) = long_header(&buf[..n]) {
                            if seen.insert(dcid.to_vec()) {
                                answers.lock().unwrap().pending.insert(scid.to_vec());
                                let _ = out.send_to(&buf[..n], addr).await;
                                sent.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    r = out.recv_from(&mut back) => {
                        let Ok((n, _)) = r else { break };
                        if let Some((first, dcid, _)) = long_header(&back[..n]) {
                            let mut a = answers.lock().unwrap();
                            if a.pending.remove(dcid) {
                                if is_retry(first) { a.retries += 1 } else { a.handshakes += 1 }
                            }
                        }
                    }
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        }
    });
    let answered = {
        let a = answers.clone();
        move || {
            let a = a.lock().unwrap();
            a.retries + a.handshakes
        }
    };

    // The flood: one quinn client endpoint (the right ALPN, no certificate) starting connections
    // to the relay, a fresh connection ID each; it never sees an answer, so each is a half-open
    // Initial at the node.
    let rss0 = rss_bytes();
    let t_flood = Instant::now();
    let flooder = tokio::spawn({
        let (sent, answered) = (sent.clone(), answered.clone());
        async move {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut tls = rustls::ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth();
            tls.alpn_protocols = vec![k3_protocol::wire::ALPN.to_vec()];
            let cc = quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap()));
            let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
            let mut open = Vec::new();
            let mut started = 0u64;
            while sent.load(Ordering::Relaxed) < FLOOD {
                assert!(t_flood.elapsed() < Duration::from_secs(120), "the flood stalled: {} sent, {} answered", sent.load(Ordering::Relaxed), answered());
                // Start a connection only while fewer than WINDOW are started and unanswered.
                if started < FLOOD && started - answered().min(started) < WINDOW {
                    open.push(ep.connect_with(cc.clone(), relay_addr, "flood").unwrap());
                    started += 1;
                } else {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            (ep, open)
        }
    });

    // Once the flood holds `retry_above` handshakes, the paired decoder connects and transfers.
    wait_for("the flood to take the unvalidated handshake slots", 60, || server.admission_counts().admitted >= retry_above).await;
    let t0 = Instant::now();
    let mut client = tokio::time::timeout(Duration::from_secs(10), PrefillClient::connect(addr, ccfg.clone()))
        .await
        .expect("the decoder could not connect during the flood within 10 s")
        .expect("the decoder's handshake failed during the flood");
    let connect_s = t0.elapsed().as_secs_f64();
    for k in 0..3 {
        let layout = small_layout(40 + k);
        let t = client.prefill(request(40 + k as usize, 2, 16 << 10), &layout).await.unwrap();
        let (state, _) = t.collect().await.unwrap();
        assert_eq!(state.layers, state_of(&layout, 3).layers, "transfer {k} during the flood");
    }
    let (ep, open) = flooder.await.unwrap();
    let flood_s = t_flood.elapsed().as_secs_f64();
    let flood_sent = sent.load(Ordering::Relaxed);
    wait_for("the node to answer every flood Initial", 30, || answered() >= flood_sent).await;
    stop.store(true, Ordering::Relaxed);
    let _ = relay_task.await;
    drop(open);
    ep.close(0u32.into(), b"");
    let counts = server.admission_counts();
    let grown = rss_bytes().saturating_sub(rss0);
    let (retries, handshakes) = {
        let a = answers.lock().unwrap();
        (a.retries, a.handshakes)
    };
    eprintln!(
        "flood: {flood_sent} Initials in {flood_s:.2} s, answered with {retries} Retries and {handshakes} handshakes; \
         node: {counts:?}; decoder connected in {connect_s:.2} s; process RSS +{:.1} MB",
        grown as f64 / 1e6
    );
    assert_eq!(flood_sent, FLOOD);
    assert_eq!(served.load(Ordering::SeqCst), 3);
    // Every flood Initial got exactly one first answer: a handshake for the first `retry_above`
    // (they then hold their slots), a stateless Retry for every later one.
    assert_eq!(handshakes, retry_above, "flood Initials the node started a handshake for");
    assert_eq!(retries, FLOOD - retry_above, "flood Initials the node answered with a Retry");
    // The node's own count agrees: the flood's Retries plus the decoder's first Initial; the flood's
    // handshakes plus the decoder's validated one; nothing refused; the decoder's handshake the only
    // one above `retry_above`.
    assert_eq!(counts.retried, retries + 1, "{counts:?}");
    assert_eq!(counts.admitted, retry_above + 1, "{counts:?}");
    assert_eq!(counts.refused, 0, "{counts:?}");
    assert_eq!(counts.peak_handshakes as u64, retry_above + 1, "{counts:?}");
    server.close();
}
