//! Faults over loopback QUIC. Each asserts a clear, typed error and that no state comes out:
//! a chunk corrupted / duplicated / missing / truncated / oversized in flight (sender test
//! hooks), a reordered chunk (which must still assemble exactly), the connection dropped
//! mid-transfer, the link cut (UDP relay), a decoder that stops reading (the sender must
//! stall with bounded memory, not buffer the state), and garbage requests to the server.

mod quic_support;

use std::time::{Duration, Instant};

use k3_protocol::transport::hooks::FaultHooks;
use k3_protocol::transport::*;
use k3_protocol::wire::*;
use quic_support::*;

/// Runs one transfer of `small_layout(rows)` with the given hooks; returns the client's
/// result and the server's.
async fn transfer_with(
    server_hooks: FaultHooks,
    client_hooks: FaultHooks,
    rows: u64,
    streams: u16,
    chunk: u32,
) -> (Result<(k3_protocol::HandoffState, TransferSummary), TransferError>, Result<Timing, TransferError>) {
    let (scfg, ccfg) = paired();
    let (addr, _server, srv) = spawn_server(with_hooks(scfg, server_hooks), Behaviour::Serve { seed: 9 }).await;
    let mut client = PrefillClient::connect(addr, with_hooks(ccfg, client_hooks)).await.unwrap();
    let layout = small_layout(rows);
    let r = match client.prefill(request(rows as usize, streams, chunk), &layout).await {
        Ok(t) => t.collect().await,
        Err(e) => Err(e),
    };
    client.close().await;
    let mut s = tokio::time::timeout(Duration::from_secs(20), srv).await.expect("server hung").unwrap();
    (r, s.remove(0))
}

fn corrupt(r: &Result<(k3_protocol::HandoffState, TransferSummary), TransferError>) -> WireError {
    match r {
        Err(TransferError::Corrupt { source, .. }) => source.clone(),
        Err(e) => panic!("expected a Corrupt error, got: {e}"),
        Ok(_) => panic!("a faulty transfer produced a state"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunk_corrupted_in_flight() {
    init_tracing();
    let hooks = FaultHooks { corrupt_chunk: Some(7), ..Default::default() };
    let (r, s) = transfer_with(hooks, FaultHooks::default(), 200, 2, 4096).await;
    assert!(matches!(corrupt(&r), WireError::Checksum { .. }), "{:?}", r.err());
    // The decoder told the prefill node why.
    match s {
        Err(TransferError::Aborted { code: ErrorCode::Malformed, message, .. }) => assert!(message.contains("checksum"), "{message}"),
        other => panic!("server: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunk_duplicated() {
    init_tracing();
    let hooks = FaultHooks { duplicate_chunk: Some(3), ..Default::default() };
    let (r, _) = transfer_with(hooks, FaultHooks::default(), 200, 1, 4096).await;
    let e = corrupt(&r);
    assert!(matches!(e, WireError::Overlap { .. } | WireError::LayerAlreadyComplete { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunk_reordered_still_assembles_exactly() {
    init_tracing();
    // Chunk 2 goes after chunk 3 on the same single stream.
    let hooks = FaultHooks { delay_chunk: Some(2), ..Default::default() };
    let (r, s) = transfer_with(hooks, FaultHooks::default(), 200, 1, 1024).await;
    let (st, _) = r.unwrap();
    assert_eq!(st, state_of(&small_layout(200), 9));
    assert!(s.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunk_missing() {
    init_tracing();
    let hooks = FaultHooks { drop_chunk: Some(4), ..Default::default() };
    let (r, _) = transfer_with(hooks, FaultHooks::default(), 200, 2, 4096).await;
    match corrupt(&r) {
        WireError::Incomplete(m) => assert!(m.contains("never arrived"), "{m}"),
        e => panic!("{e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_chunk_frame() {
    init_tracing();
    let hooks = FaultHooks { truncate_chunk: Some(3), ..Default::default() };
    let (r, _) = transfer_with(hooks, FaultHooks::default(), 200, 1, 4096).await;
    assert!(matches!(corrupt(&r), WireError::Truncated { .. }), "{:?}", r.err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_chunk_frame() {
    init_tracing();
    let hooks = FaultHooks { oversize_chunk: Some(2), ..Default::default() };
    let (r, _) = transfer_with(hooks, FaultHooks::default(), 200, 1, 4096).await;
    assert!(matches!(corrupt(&r), WireError::Oversized { .. }), "{:?}", r.err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_dropped_mid_transfer() {
    init_tracing();
    let hooks = FaultHooks { close_at_chunk: Some(60), ..Default::default() };
    let (r, _) = transfer_with(hooks, FaultHooks::default(), 2000, 2, 4096).await;
    match r {
        // The CONNECTION_CLOSE itself, or (if that packet was lost) the stateless reset.
        Err(TransferError::ConnectionLost { reason, .. }) => {
            assert!(reason.contains("closed by the peer") || reason.contains("reset by the peer"), "{reason}")
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("state from a dropped connection"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_cut_mid_transfer_times_out() {
    init_tracing();
    let (mut scfg, mut ccfg) = paired();
    for c in [&mut scfg, &mut ccfg] {
        c.tuning.idle_timeout = Duration::from_secs(2);
        c.tuning.stall_timeout = Duration::from_secs(3);
    }
    let (addr, _server, srv) = spawn_server(scfg, Behaviour::Serve { seed: 2 }).await;
    let relay = UdpRelay::start(addr, Some(2 << 20)).await;
    let mut client = PrefillClient::connect(relay.addr, ccfg).await.unwrap();
    let layout = small_layout(60_000);
    let t0 = Instant::now();
    let r = client.prefill(request(60_000, 2, 65536), &layout).await.unwrap().collect().await;
    match r {
        Err(TransferError::ConnectionLost { reason, .. }) => assert!(reason.contains("idle timeout"), "{reason}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("state through a cut link"),
    }
    assert!(relay.cut.load(std::sync::atomic::Ordering::Relaxed));
    assert!(t0.elapsed() < Duration::from_secs(15));
    // The prefill node notices too (idle timeout or stalled writes), and does not hang.
    let s = tokio::time::timeout(Duration::from_secs(20), srv).await.expect("server hung").unwrap();
    assert!(s[0].is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_that_stops_reading_stalls_the_sender_in_bounded_memory() {
    init_tracing();
    let (mut scfg, ccfg) = paired();
    scfg.tuning.stall_timeout = Duration::from_secs(2);
    let ccfg = with_hooks(ccfg, FaultHooks { stop_reading_after: Some(4), ..Default::default() });
    // 512 MiB of K3-shaped state, generated layer by layer as the sender asks for it.
    let layout = k3_layout_of_size(512 << 20);
    let total = layout.nbytes().unwrap();
    let server = PrefillServer::bind("127.0.0.1:0".parse().unwrap(), scfg).unwrap();
    let addr = server.local_addr();
    let ly = layout.clone();
    let srv = tokio::spawn(async move {
        let mut conn = server.accept().await.unwrap().unwrap();
        let req = conn.next_request().await.unwrap().unwrap();
        let mut tx = req.accept(0, ly.clone()).await.unwrap();
        for (l, lay) in ly.layers.iter().enumerate() {
            if let Err(e) = tx.send_layer(l, make_layer(lay, l as u64)).await {
                return (e, tx.bytes_handed_to_quic(), l);
            }
        }
        panic!("the sender sent everything to a decoder that stopped reading");
    });
    let mut client = PrefillClient::connect(addr, ccfg).await.unwrap();
    let tokens = 100_000 + 512;
    let r = client.prefill(request(tokens, 4, 1 << 20), &small_or_bulk_layout(tokens as u64)).await.unwrap().collect().await;
    let (e, handed, layer) = tokio::time::timeout(Duration::from_secs(30), srv).await.expect("sender hung").unwrap();
    assert!(matches!(e, TransferError::Stalled { .. }), "{e}");
    // Flow control held the sender to the QUIC windows (32 MiB + 4 × 8 MiB), not the state.
    assert!(handed < 80 << 20, "sender handed {handed} bytes of {total} to QUIC");
    assert!(layer < ly_len(&layout), "stalled at layer {layer}");
    // The decoder hears why, and has no state.
    match r {
        Err(TransferError::Aborted { code: ErrorCode::Timeout, .. }) => {}
        Err(e) => panic!("decoder: {e}"),
        Ok(_) => panic!("decoder got a state it never read"),
    }
}

fn ly_len(l: &StateLayout) -> usize {
    l.layers.len()
}

async fn raw_request_gets(raw: Vec<u8>) -> (TransferError, TransferError) {
    let (scfg, ccfg) = paired();
    let (addr, _server, srv) = spawn_server(scfg, Behaviour::Serve { seed: 1 }).await;
    let ccfg = with_hooks(ccfg, FaultHooks { raw_request: Some(raw), ..Default::default() });
    let mut client = PrefillClient::connect(addr, ccfg).await.unwrap();
    let e = client.prefill(request(10, 1, 4096), &small_layout(10)).await.map(|_| ()).expect_err("garbage accepted");
    client.close().await;
    let mut s = tokio::time::timeout(Duration::from_secs(20), srv).await.expect("server hung").unwrap();
    (e, s.remove(0).expect_err("server served garbage"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_truncated_and_oversized_requests_are_refused_without_harm() {
    init_tracing();
    // Garbage body.
    let (c, s) = raw_request_gets(vec![5, 0, 0, 0, 1, 0xff, 0xfe, 0xfd, 0xfc]).await;
    assert!(matches!(c, TransferError::Refused { code: ErrorCode::Malformed, .. }), "{c}");
    assert!(matches!(s, TransferError::Corrupt { source: WireError::BadMessage(_), .. }), "{s}");
    // A frame cut short (then the stream ends).
    let mut full = k3_protocol::wire::encode_control(&Message::PrefillRequest(request(1000, 1, 4096))).unwrap();
    full.truncate(full.len() / 2);
    let (c, s) = raw_request_gets(full).await;
    assert!(matches!(c, TransferError::Refused { code: ErrorCode::Malformed, .. }), "{c}");
    assert!(matches!(s, TransferError::Corrupt { source: WireError::Truncated { .. }, .. }), "{s}");
    // A length field over the limit.
    let (c, s) = raw_request_gets(vec![0xf0, 0xff, 0xff, 0xff, 1]).await;
    match c {
        TransferError::Refused { code: ErrorCode::Malformed, message, .. } => assert!(message.contains("exceeds"), "{message}"),
        e => panic!("{e}"),
    }
    assert!(matches!(s, TransferError::Corrupt { source: WireError::Oversized { .. }, .. }), "{s}");
    // A valid message that is not a request.
    let (c, _) = raw_request_gets(k3_protocol::wire::encode_control(&Message::Heartbeat { request: 1 }).unwrap()).await;
    assert!(matches!(c, TransferError::Refused { code: ErrorCode::Malformed, .. }), "{c}");
}
