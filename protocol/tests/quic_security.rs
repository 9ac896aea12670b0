//! Pinned mutual TLS and the handshake: wrong model fingerprint, an unknown certificate on
//! either side, `--insecure-dev` limits, identities kept on disk, pairing texts.

mod quic_support;

use k3_protocol::fingerprint::Fingerprint;
use k3_protocol::transport::*;
use quic_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_model_fingerprint_is_refused_with_both_fingerprints() {
    init_tracing();
    let (scfg, mut ccfg) = paired();
    ccfg.model_fingerprint = Fingerprint([0x11; 32]);
    let server = PrefillServer::bind("127.0.0.1:0".parse().unwrap(), scfg).unwrap();
    let addr = server.local_addr();
    let err = PrefillClient::connect(addr, ccfg).await.err().expect("connected despite a model mismatch");
    match &err {
        TransferError::FingerprintMismatch { ours, theirs, .. } => {
            assert_eq!(*ours, Fingerprint([0x11; 32]));
            assert_eq!(*theirs, MODEL);
        }
        e => panic!("{e}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(&"11".repeat(32)) && msg.contains(&"4b".repeat(32)), "{msg}");
    // The server sees it too, with both fingerprints.
    match server.accept().await.unwrap() {
        Err(TransferError::FingerprintMismatch { ours, theirs, .. }) => {
            assert_eq!(ours, MODEL);
            assert_eq!(theirs, Fingerprint([0x11; 32]));
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("server accepted a mismatched model"),
    }
}

/// Issue 17: another fingerprint with the same state identity (a pruned decoder, a full-model
/// node). The node serves it; the decoder refuses it, naming both fingerprints and the flag,
/// unless `accept_compatible_states` is set. Another state identity stays a plain mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_compatible_model_is_used_only_when_accepted() {
    init_tracing();
    let identity = Fingerprint([0x5a; 32]);
    let pruned = Fingerprint([0x22; 32]);
    for accept in [false, true] {
        let (scfg, ccfg) = paired();
        let scfg = scfg.with_state_identity(identity);
        let mut ccfg = ccfg.with_state_identity(identity);
        ccfg.model_fingerprint = pruned;
        ccfg.accept_compatible_states = accept;
        let (addr, _server, srv) = spawn_server(scfg, Behaviour::Serve { seed: 9 }).await;
        let r = PrefillClient::connect(addr, ccfg).await;
        if accept {
            let mut client = r.expect("a state-compatible node refused with accept_compatible_states");
            assert_eq!(client.server().model_fingerprint, MODEL);
            assert_eq!(client.server().state_identity, Some(identity));
            let layout = small_layout(12);
            let (st, _) = client.prefill(request(12, 1, 4096), &layout).await.unwrap().collect().await.unwrap();
            assert_eq!(st, state_of(&layout, 9));
            client.close().await;
            assert!(srv.await.unwrap()[0].is_ok());
        } else {
            let err = r.err().expect("used a state-compatible node without accept_compatible_states");
            match &err {
                TransferError::CompatibleModelNotAccepted { ours, theirs, state_identity, .. } => {
                    assert_eq!((*ours, *theirs, *state_identity), (pruned, MODEL, identity));
                }
                e => panic!("{e}"),
            }
            let msg = err.to_string();
            assert!(msg.contains(&"22".repeat(32)) && msg.contains(&MODEL.hex()) && msg.contains("--accept-compatible-states"), "{msg}");
            srv.abort();
        }
    }
    // Other state identities, or none given: the ordinary mismatch, on both sides.
    let (scfg, ccfg) = paired();
    let scfg = scfg.with_state_identity(identity);
    let mut ccfg = ccfg.with_state_identity(Fingerprint([0x5b; 32]));
    ccfg.model_fingerprint = pruned;
    ccfg.accept_compatible_states = true;
    let server = PrefillServer::bind("127.0.0.1:0".parse().unwrap(), scfg).unwrap();
    let err = PrefillClient::connect(server.local_addr(), ccfg).await.err().expect("connected despite another state identity");
    assert!(matches!(err, TransferError::FingerprintMismatch { .. }), "{err}");
    assert!(matches!(server.accept().await.unwrap(), Err(TransferError::FingerprintMismatch { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_server_certificate_is_refused_by_the_decoder() {
    init_tracing();
    let (scfg, mut ccfg) = paired();
    let real = scfg.identity.fingerprint();
    let other = NodeIdentity::generate().unwrap().fingerprint();
    ccfg.peers = PeerAuth::pinned(other);
    let server = PrefillServer::bind("127.0.0.1:0".parse().unwrap(), scfg).unwrap();
    let err = PrefillClient::connect(server.local_addr(), ccfg).await.err().expect("connected to an unpinned server");
    match &err {
        TransferError::PeerCertificateNotPinned { got, pinned, .. } => {
            assert_eq!(*got, real);
            assert_eq!(*pinned, other.to_string());
        }
        e => panic!("{e}"),
    }
    assert!(err.to_string().contains(&real.to_string()) && err.to_string().contains(&other.to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_decoder_certificate_is_refused_by_the_prefill_node() {
    init_tracing();
    let (mut scfg, ccfg) = paired();
    let decoder = ccfg.identity.fingerprint();
    scfg.peers = PeerAuth::pinned(NodeIdentity::generate().unwrap().fingerprint());
    let server = PrefillServer::bind("127.0.0.1:0".parse().unwrap(), scfg).unwrap();
    let err = PrefillClient::connect(server.local_addr(), ccfg).await.err().expect("an unpaired decoder got in");
    match &err {
        TransferError::CertificateRefusedByPeer { ours, .. } => assert_eq!(*ours, decoder),
        e => panic!("{e}"),
    }
    match server.accept().await.unwrap() {
        Err(TransferError::PeerCertificateNotPinned { got, .. }) => assert_eq!(got, decoder),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("server accepted an unknown decoder"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insecure_dev_mode_works_on_loopback_only() {
    init_tracing();
    let (mut scfg, mut ccfg) = paired();
    scfg.peers = PeerAuth::InsecureDev;
    ccfg.peers = PeerAuth::InsecureDev;
    assert!(matches!(PrefillServer::bind("0.0.0.0:0".parse().unwrap(), scfg.clone()), Err(TransferError::InsecureNotLoopback(_))));
    assert!(matches!(PrefillClient::connect("192.0.2.1:7433".parse().unwrap(), ccfg.clone()).await, Err(TransferError::InsecureNotLoopback(_))));
    let (addr, _server, srv) = spawn_server(scfg, Behaviour::Serve { seed: 5 }).await;
    let mut client = PrefillClient::connect(addr, ccfg).await.unwrap();
    let layout = small_layout(20);
    let (st, _) = client.prefill(request(20, 2, 4096), &layout).await.unwrap().collect().await.unwrap();
    assert_eq!(st, state_of(&layout, 5));
    client.close().await;
    assert!(srv.await.unwrap()[0].is_ok());
}

#[test]
fn identity_is_created_once_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("prefill");
    let a = NodeIdentity::load_or_create(&d).unwrap();
    let b = NodeIdentity::load_or_create(&d).unwrap();
    assert_eq!(a.fingerprint(), b.fingerprint());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.join("node-key.der")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "private key readable by others");
    }
    let text = a.pairing_text(NodeRole::Prefill);
    assert!(text.contains(&a.fingerprint().to_string()) && text.contains("--prefill-fingerprint"), "{text}");
    // A damaged key is reported with its path.
    std::fs::write(d.join("node-key.der"), b"garbage").unwrap();
    let e = NodeIdentity::load_or_create(&d).unwrap_err().to_string();
    assert!(e.contains("node-key.der"), "{e}");
}

#[test]
fn pinned_peers_file_round_trips_and_names_bad_lines() {
    let dir = tempfile::tempdir().unwrap();
    let fp = NodeIdentity::generate().unwrap().fingerprint();
    assert_eq!(CertFingerprint::parse(&fp.to_string()), Some(fp));
    let mut peers = PinnedPeers::load(dir.path()).unwrap();
    assert!(peers.peers.is_empty());
    peers.add_and_save(dir.path(), fp, "mac-studio").unwrap();
    let back = PinnedPeers::load(dir.path()).unwrap();
    assert_eq!(back.fingerprints(), vec![fp]);
    assert_eq!(back.peers[0].1, "mac-studio");
    std::fs::write(dir.path().join("pinned-peers.txt"), "# ok\nsha256:zz bad\n").unwrap();
    let e = PinnedPeers::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("line 2"), "{e}");
}
