//! A flood of half-open QUIC Initials (issue 21: 15,090 in 25 s raised the node's RSS from 51 to
//! 640 MB, with no limit on concurrent handshakes and no address validation). The flood goes
//! through a relay that forwards each new connection's first datagram and drops every answer, so
//! the node sees Initials from peers that never complete a handshake. While it runs, a paired
//! decoder must still connect and complete transfers; the node must answer the flood with
//! stateless Retries and never hold more than its handshake limit.

mod quic_support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_protocol::transport::*;
use quic_support::*;

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// The destination connection ID of a QUIC long-header packet.
fn long_header_dcid(d: &[u8]) -> Option<&[u8]> {
    if d.len() < 6 || d[0] & 0x80 == 0 {
        return None;
    }
    let n = d[5] as usize;
    d.get(6..6 + n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_half_open_initials_is_answered_statelessly_and_the_decoder_is_still_served() {
    init_tracing();
    let (scfg, ccfg) = paired();
    let limits = (scfg.tuning.max_handshakes, scfg.tuning.retry_above);
    let server = Arc::new(PrefillServer::bind("127.0.0.1:0".parse().unwrap(), scfg).unwrap());
    let addr = server.local_addr();
    // Serve every decoder that completes the handshake; skip the flood's failures.
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

    // The relay: forwards the first datagram of each new connection ID to the node, drops the rest
    // and everything the node answers.
    let relay = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let (st, sn) = (stop.clone(), sent.clone());
    let relay_task = tokio::spawn(async move {
        let out = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut seen = HashSet::new();
        let mut buf = vec![0u8; 65536];
        let mut sink = vec![0u8; 65536];
        while !st.load(Ordering::Relaxed) {
            tokio::select! {
                r = relay.recv_from(&mut buf) => {
                    let Ok((n, _)) = r else { break };
                    if let Some(dcid) = long_header_dcid(&buf[..n]) {
                        if seen.insert(dcid.to_vec()) {
                            let _ = out.send_to(&buf[..n], addr).await;
                            sn.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                _ = out.recv_from(&mut sink) => {} // the node's answers: dropped
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    });

    // The flood: one quinn client endpoint starting connections to the relay (a fresh DCID each)
    // and abandoning them; it never sees an answer, so each is a half-open Initial at the node.
    const FLOOD: u64 = 3000;
    let rss0 = rss_bytes();
    let flooder = tokio::spawn({
        let sent = sent.clone();
        async move {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let tls = rustls::ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth();
            let cc = quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap()));
            let ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
            let mut open = Vec::new();
            let mut i = 0u64;
            while sent.load(Ordering::Relaxed) < FLOOD && i < FLOOD * 4 {
                open.push(ep.connect_with(cc.clone(), relay_addr, "flood").unwrap());
                i += 1;
                if open.len() >= 100 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    open.clear();
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(open);
            ep.close(0u32.into(), b"");
        }
    });

    // Meanwhile the paired decoder connects and transfers, several times.
    tokio::time::sleep(Duration::from_millis(300)).await;
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
    flooder.await.unwrap();
    let flood_sent = sent.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let _ = relay_task.await;
    let counts = server.admission_counts();
    let grown = rss_bytes().saturating_sub(rss0);
    eprintln!(
        "flood: {flood_sent} Initials; node: {counts:?}; decoder connected in {connect_s:.2} s; process RSS +{:.1} MB",
        grown as f64 / 1e6
    );
    assert!(flood_sent >= FLOOD / 2, "the flood sent only {flood_sent} Initials");
    assert!(served.load(Ordering::SeqCst) >= 3);
    assert!(counts.peak_handshakes <= limits.0, "{counts:?}");
    // How many Initials find a free slot (and are admitted, then fail on their bogus ALPN) depends
    // on how fast those handshakes fail, i.e. on the machine's load: 2,257 of 3,007 were retried on
    // an idle box, 1,441 of ~3,000 on a loaded 2-core CI box. Retry must carry a large share.
    assert!(counts.retried >= flood_sent / 5, "the node did not answer the flood with Retries: {counts:?}");
    // Unvalidated peers hold at most `retry_above` handshake slots (plus the decoder, validated).
    assert!(counts.peak_handshakes <= limits.1 + 2, "{counts:?}");
}
