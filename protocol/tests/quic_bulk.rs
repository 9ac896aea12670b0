//! A large round trip over loopback QUIC in bounded memory. The prefill side generates each
//! layer when it is about to send it; the decoder checks each assembled layer's CRC-32C
//! against the sender's and drops it. The transfer runs in a child process (this test binary
//! again) so that its peak RSS (VmHWM) is measured alone, and must stay well below the state.
//!
//! In CI: 2 GiB (about 11 s on 2 cores). `cargo test --release -p k3-protocol --test quic_bulk -- --ignored` runs 4 GiB.

mod quic_support;

use std::process::Command;
use std::sync::{Arc, Mutex};

use k3_protocol::handoff::LayerState;
use k3_protocol::transport::*;
use k3_protocol::wire::checksum::crc_append;
use k3_protocol::wire::chunker::part_bytes;
use k3_protocol::wire::*;
use quic_support::*;

const CHILD_ENV: &str = "K3_QUIC_BULK_CHILD";

fn layer_crc(st: &LayerState, ly: &LayerLayout) -> u32 {
    ly.parts().iter().fold(0, |c, p| crc_append(c, part_bytes(st, *p)))
}

fn vm_hwm_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap_or(0)
}

/// The transfer itself (in the child).
fn child(mib: u64, streams: u16) {
    init_tracing();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async move {
        let (scfg, ccfg) = paired();
        let tokens = (100_000 + mib) as usize;
        let layout = small_or_bulk_layout(tokens as u64);
        let total = layout.nbytes().unwrap();
        let sent_crcs = Arc::new(Mutex::new(vec![0u32; layout.layers.len()]));
        let server = PrefillServer::bind("127.0.0.1:0".parse().unwrap(), scfg).unwrap();
        let addr = server.local_addr();
        let (ly, crcs) = (layout.clone(), sent_crcs.clone());
        let srv = tokio::spawn(async move {
            let mut conn = server.accept().await.unwrap().unwrap();
            let req = conn.next_request().await.unwrap().unwrap();
            let mut tx = req.accept(0, ly.clone()).await.unwrap();
            for (l, lay) in ly.layers.iter().enumerate() {
                let st = make_layer(lay, 77 + l as u64);
                crcs.lock().unwrap()[l] = layer_crc(&st, lay);
                tx.send_layer(l, st).await.unwrap();
            }
            let t = tx.finish(Timing::default(), None).await.unwrap();
            (t, conn.stats().udp_tx.bytes)
        });
        let mut client = PrefillClient::connect(addr, ccfg).await.unwrap();
        let t0 = std::time::Instant::now();
        let mut t = client.prefill(request(tokens, streams, 1 << 20), &layout).await.unwrap();
        let mut got = vec![None; layout.layers.len()];
        let mut summary = None;
        while let Some(ev) = t.next().await.unwrap() {
            match ev {
                TransferEvent::Layer { layer, state } => {
                    let l = layer as usize;
                    assert!(got[l].is_none());
                    got[l] = Some(layer_crc(&state, &layout.layers[l]));
                }
                TransferEvent::Progress(_) => {}
                TransferEvent::Done(s) => summary = Some(s),
            }
        }
        drop(t);
        let secs = t0.elapsed().as_secs_f64();
        let (timing, udp_tx) = srv.await.unwrap();
        let summary = summary.unwrap();
        assert_eq!(summary.state_bytes, total);
        let sent = sent_crcs.lock().unwrap().clone();
        let matching = got.iter().zip(&sent).filter(|(g, s)| **g == Some(**s)).count();
        println!(
            "BULK_RESULT bytes={total} layers={} matching={matching} secs={secs:.3} vmhwm_kib={} wire_bytes={} udp_tx={udp_tx}",
            layout.layers.len(),
            vm_hwm_kib(),
            timing.wire_bytes
        );
        client.close().await;
    });
}

struct Outcome {
    bytes: u64,
    layers: u64,
    matching: u64,
    secs: f64,
    vmhwm: u64,
    wire_bytes: u64,
}

fn run_in_child(test: &str, mib: u64, streams: u16) -> Outcome {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--include-ignored", "--test-threads=1"])
        .env(CHILD_ENV, format!("{mib},{streams}"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let line = text.lines().find_map(|l| l.find("BULK_RESULT").map(|i| &l[i..])).unwrap_or_else(|| panic!("child failed:\n{text}"));
    let get = |k: &str| -> f64 { line.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{k}="))).unwrap().parse().unwrap() };
    println!("{line}");
    Outcome {
        bytes: get("bytes") as u64,
        layers: get("layers") as u64,
        matching: get("matching") as u64,
        secs: get("secs"),
        vmhwm: get("vmhwm_kib") as u64 * 1024,
        wire_bytes: get("wire_bytes") as u64,
    }
}

fn bulk(test: &str, mib: u64, streams: u16) {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        let (m, s) = spec.split_once(',').unwrap();
        return child(m.parse().unwrap(), s.parse().unwrap());
    }
    let o = run_in_child(test, mib, streams);
    assert!(o.bytes >= (mib << 20) * 99 / 100, "state of {} bytes", o.bytes);
    assert_eq!(o.matching, o.layers, "every layer must arrive with the sender's CRC");
    // Bounded memory: both nodes together (one process) stay far below the state size.
    assert!(o.vmhwm * 3 < o.bytes, "peak RSS {} MiB for a {} MiB state", o.vmhwm >> 20, o.bytes >> 20);
    assert!((o.wire_bytes as f64 / o.bytes as f64 - 1.0) < 0.01, "protocol overhead");
    println!("{} MiB in {:.2} s = {:.2} Gbit/s, peak RSS {} MiB", o.bytes >> 20, o.secs, o.bytes as f64 * 8.0 / o.secs / 1e9, o.vmhwm >> 20);
}

#[test]
fn bulk_2gib_round_trip_in_bounded_memory() {
    bulk("bulk_2gib_round_trip_in_bounded_memory", 2048, 4);
}

#[test]
#[ignore = "4 GiB: run with --ignored (a minute or more on 2 cores)"]
fn bulk_4gib_round_trip_in_bounded_memory() {
    bulk("bulk_4gib_round_trip_in_bounded_memory", 4096, 8);
}
