//! Hand-off transfer benchmark over loopback QUIC (pinned mutual TLS 1.3, both nodes in this
//! process). The state has K3's real per-layer shapes (69 KDA layers [96,128,128] + conv
//! windows, 24 MLA layers of width 576, fp32) with the MLA rows chosen to reach `--gib`.
//! Layers are generated once per shape and shared (`Arc`), so the numbers measure the
//! transport: framing, CRC-32C on both sides, TLS, QUIC, assembly into fresh buffers.
//!
//! ```text
//! cargo run --release -p k3-protocol --example transfer_bench -- --gib 4 --streams 1,8
//! ```
//! Options: `--gib F` (state size), `--streams A,B,..`, `--chunk-kib N` (default 1024),
//! `--mtu N` (QUIC path-MTU upper bound, default 1452; loopback allows up to 65000).

// the synthetic layers of the QUIC tests
#[path = "../tests/quic_support/mod.rs"]
#[allow(unused_imports)]
mod quic_support;

use std::sync::Arc;
use std::time::Instant;

use k3_protocol::fingerprint::Fingerprint;
use k3_protocol::handoff::LayerState;
use k3_protocol::transport::*;
use k3_protocol::wire::checksum::crc_append;
use k3_protocol::wire::chunker::part_bytes;
use k3_protocol::wire::*;

struct Args {
    gib: f64,
    streams: Vec<u16>,
    chunk_kib: u32,
    mtu: u16,
}

fn parse_args() -> Args {
    let mut a = Args { gib: 4.0, streams: vec![1, 8], chunk_kib: 1024, mtu: 1452 };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--gib" => a.gib = v.parse().expect("--gib takes a number"),
            "--streams" => a.streams = v.split(',').map(|s| s.parse().expect("--streams takes a list")).collect(),
            "--chunk-kib" => a.chunk_kib = v.parse().expect("--chunk-kib takes a number"),
            "--mtu" => a.mtu = v.parse().expect("--mtu takes a number"),
            other => panic!("unknown option {other}"),
        }
        i += 2;
    }
    a
}

fn k3_layout(bytes: u64) -> StateLayout {
    let kda = LayerLayout::Kda { heads: 96, head_dim: 128, window: 3 };
    let rows = (bytes.saturating_sub(69 * kda.nbytes().unwrap()) / (24 * 576 * 4)).max(1);
    let mla = LayerLayout::Mla { width: 576, rows };
    let mut n_mla = 0;
    let layers = (0..93)
        .map(|l| {
            if (l % 4 == 3 && n_mla < 23) || l == 92 {
                n_mla += 1;
                mla
            } else {
                kda
            }
        })
        .collect();
    StateLayout { layers }
}

fn crc_of(st: &LayerState, ly: &LayerLayout) -> u32 {
    ly.parts().iter().fold(0, |c, p| crc_append(c, part_bytes(st, *p)))
}

fn vm_hwm_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        >> 10
}

struct Row {
    streams: u16,
    secs: f64,
    state: u64,
    wire: u64,
    udp_tx: u64,
    first_layer_s: f64,
    mtu: u16,
    lost_bytes: u64,
    datagrams: u64,
}

async fn run_once(layout: &StateLayout, shapes: &[(LayerLayout, Arc<LayerState>, u32)], streams: u16, a: &Args) -> Row {
    let model = Fingerprint([1; 32]);
    let s = NodeIdentity::generate().unwrap();
    let c = NodeIdentity::generate().unwrap();
    let mut scfg = NodeConfig::new(s.clone(), PeerAuth::pinned(c.fingerprint()), model, "bench");
    let mut ccfg = NodeConfig::new(c, PeerAuth::pinned(s.fingerprint()), model, "bench");
    for cfg in [&mut scfg, &mut ccfg] {
        cfg.tuning.mtu_upper_bound = a.mtu;
        cfg.tuning.max_streams = streams.max(1);
        cfg.capabilities.max_streams = streams.max(1);
        cfg.capabilities.max_frame_size = a.chunk_kib * 1024 + 64;
    }
    let server = PrefillServer::bind("127.0.0.1:0".parse().unwrap(), scfg).unwrap();
    let addr = server.local_addr();
    let (ly, sh) = (layout.clone(), shapes.to_vec());
    let srv = tokio::spawn(async move {
        let mut conn = server.accept().await.unwrap().unwrap();
        let req = conn.next_request().await.unwrap().unwrap();
        let mut tx = req.accept(0, ly.clone()).await.unwrap();
        for (l, lay) in ly.layers.iter().enumerate() {
            let st = sh.iter().find(|(s, _, _)| s == lay).unwrap().1.clone();
            tx.send_layer(l, st).await.unwrap();
        }
        let t = tx.finish(Timing::default(), None).await.unwrap();
        (t, conn.stats())
    });
    let mut client = PrefillClient::connect(addr, ccfg).await.unwrap();
    let rows = layout.rows().unwrap_or(0) as usize;
    let req = PrefillRequest {
        session: SessionId::random(),
        base: None,
        tokens: vec![0; rows],
        image_embeddings: None,
        options: PrefillOptions { keep_session: false, return_last_logits: false, streams, chunk_bytes: a.chunk_kib * 1024 },
    };
    let bar = indicatif::ProgressBar::new(layout.nbytes().unwrap());
    bar.set_style(indicatif::ProgressStyle::with_template("{msg} {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec}").unwrap());
    bar.set_message(format!("{streams} stream(s)"));
    let t0 = Instant::now();
    let mut t = client.prefill(req, layout).await.unwrap();
    let mut summary = None;
    while let Some(ev) = t.next().await.unwrap() {
        match ev {
            TransferEvent::Layer { layer, state } => {
                let lay = &layout.layers[layer as usize];
                let want = shapes.iter().find(|(s, _, _)| s == lay).unwrap().2;
                assert_eq!(crc_of(&state, lay), want, "layer {layer} differs");
                bar.inc(lay.nbytes().unwrap());
            }
            TransferEvent::Progress(_) => {}
            TransferEvent::Done(s) => summary = Some(s),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    drop(t);
    let (timing, st) = srv.await.unwrap();
    let s = summary.unwrap();
    client.close().await;
    Row {
        streams,
        secs,
        state: timing.state_bytes,
        wire: timing.wire_bytes,
        udp_tx: st.udp_tx.bytes,
        first_layer_s: s.first_layer_s.unwrap_or(0.0),
        mtu: st.path.current_mtu,
        lost_bytes: st.path.lost_bytes,
        datagrams: st.udp_tx.datagrams,
    }
}

fn main() {
    let a = parse_args();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let layout = k3_layout((a.gib * (1u64 << 30) as f64) as u64);
    let total = layout.nbytes().unwrap();
    let mut shapes: Vec<(LayerLayout, Arc<LayerState>, u32)> = Vec::new();
    for ly in &layout.layers {
        if !shapes.iter().any(|(s, _, _)| s == ly) {
            let st = quic_support::make_layer(ly, shapes.len() as u64 * 10 + 1);
            let crc = crc_of(&st, ly);
            shapes.push((*ly, Arc::new(st), crc));
        }
    }
    println!(
        "state: {} layers, {} MLA rows, {:.3} GiB fp32; chunks {} KiB; MTU bound {}; {} CPU threads",
        layout.layers.len(),
        layout.rows().unwrap_or(0),
        total as f64 / (1u64 << 30) as f64,
        a.chunk_kib,
        a.mtu,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    let mut rows = Vec::new();
    for &s in &a.streams {
        rows.push(rt.block_on(run_once(&layout, &shapes, s, &a)));
    }
    println!("| streams | state GiB | seconds | Gbit/s | first layer s | protocol overhead | UDP bytes overhead | path MTU | lost (retransmitted) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.3} | {:.2} | {:.2} | {:.3} | {:.4}% | {:.2}% | {} | {:.2}% |",
            r.streams,
            r.state as f64 / (1u64 << 30) as f64,
            r.secs,
            r.state as f64 * 8.0 / r.secs / 1e9,
            r.first_layer_s,
            (r.wire as f64 / r.state as f64 - 1.0) * 100.0,
            (r.udp_tx as f64 / r.state as f64 - 1.0) * 100.0,
            r.mtu,
            r.lost_bytes as f64 / r.state as f64 * 100.0
        );
        let _ = r.datagrams;
    }
    println!("peak RSS of this process (both nodes): {} MiB", vm_hwm_mib());
}
