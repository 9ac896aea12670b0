//! `k3-prefill bench --project`: real-width K3 layers (7168 hidden, 896 MXFP4 experts) without a
//! checkpoint, streamed from host RAM through the [`WeightStreamer`] and timed three ways —
//! transfer alone, compute alone, overlapped — with the roofline and a 93-layer projection.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Result};
use serde::Serialize;

use super::bench::Args;
use crate::backend::Backend;
use crate::cuda::gpu::Event;
use crate::cuda::profile;
use crate::cuda::synth_layer::{self as sl, Attn, Dims, LayerLayout, LayerState, LayerWeights};
use crate::cuda::{CudaBackend, Precision};
use crate::streamer::{HostRegions, WeightStreamer};

#[derive(Debug, Clone, Copy)]
enum Unit {
    /// Dense tensors of layer `l` (and all its experts when `whole`).
    Dense { l: usize, whole: bool },
    /// Experts `lo..hi` of layer `l`.
    Experts { l: usize, lo: usize, hi: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Transfer,
    Compute,
    Overlap,
}

#[derive(Serialize, Default, Clone)]
struct LayerTime {
    layer: usize,
    attn: String,
    weight_gb: f64,
    tflop: f64,
    compute_ms: f64,
    wait_ms: f64,
    roofline_ms: f64,
}

#[derive(Serialize, Default)]
struct ProjRow {
    tokens: usize,
    layers_run: usize,
    experts: usize,
    whole_layer_slots: bool,
    expert_chunk: usize,
    transfer_alone_s: f64,
    compute_alone_s: f64,
    overlapped_s: f64,
    overlap_ratio: f64,
    h2d_gbs: f64,
    host_fill_gbs: f64,
    compute_tflops: f64,
    per_layer: Vec<LayerTime>,
    roofline_s: f64,
    roofline_fraction: f64,
    k3_93_layers_s: f64,
    k3_93_roofline_s: f64,
    k3_tokens_per_s: f64,
}

struct Proj<'a> {
    b: &'a CudaBackend,
    d: Dims,
    lay: [LayerLayout; 2],
    regions: HostRegions,
    attn: Vec<Attn>,
    units: Vec<Unit>,
    dense_slots: [crate::cuda::DevMem; 2],
    expert_slots: Vec<crate::cuda::DevMem>,
    whole: bool,
    chunk: usize,
}

fn li(a: Attn) -> usize {
    if a == Attn::Kda {
        0
    } else {
        1
    }
}

pub fn run(args: &Args) -> Result<()> {
    let prec: Precision = args.precision.parse()?;
    let b = CudaBackend::new(prec)?;
    let mut cfg = k3_protocol::synth::presets::build_config(k3_protocol::synth::presets::Preset::K3, &Default::default())
        .map_err(|e| anyhow::anyhow!("K3 config: {e}"))?
        .text_config;
    if let Some(e) = args.experts {
        cfg.num_experts = e;
    }
    let d = Dims::of(&cfg);
    let lay = [LayerLayout::new(Attn::Kda, &d)?, LayerLayout::new(Attn::Mla, &d)?];
    let attn: Vec<Attn> = (0..args.layers).map(|i| if i % 4 == 3 { Attn::Mla } else { Attn::Kda }).collect();
    let t0 = Instant::now();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
    let mut regions = HostRegions::new(vec![Arc::new(lay[0].dense_image()), Arc::new(lay[1].dense_image()), Arc::new(lay[0].experts_image(7, threads))]);
    if args.pinned_source {
        let t1 = Instant::now();
        regions.pin(&b.gpu)?;
        eprintln!("host images page-locked in {:.1} s: the streamer copies straight from them", t1.elapsed().as_secs_f64());
    }
    let host_gb = regions.0.iter().map(|r| r.len()).sum::<usize>() as f64 / 1e9;
    eprintln!("host weight images: {host_gb:.1} GB in {:.1} s", t0.elapsed().as_secs_f64());
    // slots
    let max_total = lay.iter().map(|l| l.total_bytes()).max().unwrap_or(0);
    let max_dense = lay.iter().map(|l| l.dense_bytes).max().unwrap_or(0);
    let stride = lay[0].experts.stride;
    let budget = args.vram_budget.map(|g| (g * 1e9) as usize).unwrap_or(2 * max_total);
    let whole = 2 * max_total <= budget;
    let chunk = if whole {
        d.experts
    } else {
        ensure!(budget > 2 * max_dense + 2 * stride, "--vram-budget {:.1} GB is below two dense layers plus two experts", budget as f64 / 1e9);
        ((budget - 2 * max_dense) / 2 / stride).min(d.experts)
    };
    let dense_slot = if whole { max_total } else { max_dense };
    sl::ensure_room(&b, 2 * dense_slot + if whole { 0 } else { 2 * chunk * stride }, "weight slots")?;
    let dense_slots = [b.gpu.alloc_sync(dense_slot)?, b.gpu.alloc_sync(dense_slot)?];
    let expert_slots = if whole { Vec::new() } else { vec![b.gpu.alloc_sync(chunk * stride)?, b.gpu.alloc_sync(chunk * stride)?] };
    let mut units = Vec::new();
    for l in 0..args.layers {
        units.push(Unit::Dense { l, whole });
        if !whole {
            let mut lo = 0;
            while lo < d.experts {
                let hi = (lo + chunk).min(d.experts);
                units.push(Unit::Experts { l, lo, hi });
                lo = hi;
            }
        }
    }
    eprintln!(
        "weight slots: {} ({:.1} GB each){}; layer = {:.2} GB (dense {:.2} GB)",
        if whole { "2 whole layers" } else { "2 dense + 2 expert chunks" },
        dense_slot as f64 / 1e9,
        if whole { String::new() } else { format!(", {chunk} experts per chunk ({:.1} GB)", (chunk * stride) as f64 / 1e9) },
        max_total as f64 / 1e9,
        max_dense as f64 / 1e9
    );
    let p = Proj { b: &b, d, lay, regions, attn, units, dense_slots, expert_slots, whole, chunk };
    let mut streamer = WeightStreamer::new(b.gpu.clone(), args.stage_mib << 20, args.readers)?;
    // Warm-up, untimed: the kernels compile (NVRTC) at first use, which would otherwise land in
    // the first timed run. 8192 tokens reach every kernel the timed lengths use (incl. the dense
    // expert path, taken from 128 rows per expert).
    if let Some(&t_max) = args.tokens.iter().max() {
        let w0 = Instant::now();
        run_mode(&p, &mut streamer, t_max.min(8192), args, Mode::Compute)?;
        profile::reset();
        eprintln!("warm-up (kernel compilation, {} tokens): {:.1} s", t_max.min(8192), w0.elapsed().as_secs_f64());
    }
    let mut rows = Vec::new();
    for &t in &args.tokens {
        let mut row = ProjRow { tokens: t, layers_run: args.layers, experts: p.d.experts, whole_layer_slots: p.whole, expert_chunk: p.chunk, ..Default::default() };
        if !args.overlapped_only {
            let (s, _, bytes, fill) = run_mode(&p, &mut streamer, t, args, Mode::Transfer)?;
            row.transfer_alone_s = s;
            row.h2d_gbs = bytes as f64 / 1e9 / s;
            // no host fill when the source is page-locked (direct DMA)
            row.host_fill_gbs = if fill > 0.0 { bytes as f64 / 1e9 / fill } else { f64::NAN };
            let (s, _, _, _) = run_mode(&p, &mut streamer, t, args, Mode::Compute)?;
            row.compute_alone_s = s;
        }
        let (s, per_layer, bytes, _) = run_mode(&p, &mut streamer, t, args, Mode::Overlap)?;
        row.overlapped_s = s;
        if args.overlapped_only {
            row.h2d_gbs = f64::NAN;
        }
        let total_flops: f64 = per_layer.iter().map(|l| l.tflop).sum::<f64>() * 1e12;
        row.compute_tflops = if row.compute_alone_s > 0.0 { total_flops / row.compute_alone_s / 1e12 } else { f64::NAN };
        row.overlap_ratio = s / row.transfer_alone_s.max(row.compute_alone_s);
        row.roofline_s = per_layer.iter().map(|l| l.roofline_ms).sum::<f64>() / 1e3;
        row.roofline_fraction = row.roofline_s / s;
        // extrapolation to 93 layers: 69 KDA + 24 MLA, per-layer time = compute + wait of the
        // steady-state layers (the first layer's pipeline fill is left out when possible)
        let steady = |a: &str| -> (f64, f64) {
            let v: Vec<&LayerTime> = per_layer.iter().filter(|l| l.attn == a).collect();
            let v: Vec<&LayerTime> = if v.len() > 1 { v.into_iter().filter(|l| l.layer > 0).collect() } else { v };
            let n = v.len().max(1) as f64;
            (v.iter().map(|l| l.compute_ms + l.wait_ms).sum::<f64>() / n, v.iter().map(|l| l.roofline_ms).sum::<f64>() / n)
        };
        let (kt, kr) = steady("KDA");
        let (mt, mr) = steady("MLA");
        let (mt, mr) = if per_layer.iter().any(|l| l.attn == "MLA") { (mt, mr) } else { (f64::NAN, f64::NAN) };
        row.k3_93_layers_s = (69.0 * kt + 24.0 * mt) / 1e3;
        row.k3_93_roofline_s = (69.0 * kr + 24.0 * mr) / 1e3;
        row.k3_tokens_per_s = t as f64 / row.k3_93_layers_s;
        let _ = bytes;
        row.per_layer = per_layer;
        rows.push(row);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    for r in &rows {
        println!("\n== {} tokens, {} layers, {} experts/layer ==", r.tokens, r.layers_run, r.experts);
        println!("{:>5} {:>4} {:>8} {:>8} {:>10} {:>9} {:>11} {:>7}", "layer", "attn", "GB", "TFLOP", "compute ms", "wait ms", "roofline ms", "ratio");
        for l in &r.per_layer {
            println!(
                "{:>5} {:>4} {:>8.2} {:>8.1} {:>10.1} {:>9.1} {:>11.1} {:>7.2}",
                l.layer,
                l.attn,
                l.weight_gb,
                l.tflop,
                l.compute_ms,
                l.wait_ms,
                l.roofline_ms,
                l.roofline_ms / (l.compute_ms + l.wait_ms)
            );
        }
    }
    println!("\n{:>8} {:>10} {:>10} {:>10} {:>7} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9}", "tokens", "xfer s", "compute s", "overlap s", "o/max", "H2D GB/s", "fill GB/s", "TFLOP/s", "roofl. s", "of roofl", "K3 93L s", "K3 tok/s");
    for r in &rows {
        println!(
            "{:>8} {:>10.3} {:>10.3} {:>10.3} {:>7.3} {:>8.1} {:>8.1} {:>8.1} {:>9.3} {:>8.1}% {:>9.1} {:>9.0}",
            r.tokens,
            r.transfer_alone_s,
            r.compute_alone_s,
            r.overlapped_s,
            r.overlap_ratio,
            r.h2d_gbs,
            r.host_fill_gbs,
            r.compute_tflops,
            r.roofline_s,
            100.0 * r.roofline_fraction,
            r.k3_93_layers_s,
            r.k3_tokens_per_s
        );
    }
    Ok(())
}

/// The slot (0/1 within its ring: dense slots, expert slots) of every unit, and the unit whose
/// compute must end before the unit's slot may be overwritten: the previous expert unit on the
/// same expert slot, or, for a dense slot, the last unit of the layer that held it (its expert
/// units still read the dense weights in moe_back).
fn slot_schedule(units: &[Unit]) -> (Vec<usize>, Vec<Option<usize>>) {
    let is_dense = |u: &Unit| matches!(u, Unit::Dense { .. });
    let layer_of = |u: &Unit| match *u {
        Unit::Dense { l, .. } | Unit::Experts { l, .. } => l,
    };
    let mut count = [0usize; 2];
    let slot_of: Vec<usize> = units
        .iter()
        .map(|u| {
            let ring = is_dense(u) as usize;
            count[ring] += 1;
            (count[ring] - 1) % 2
        })
        .collect();
    let free_after = (0..units.len())
        .map(|i| {
            let prev = (0..i).rev().find(|&j| is_dense(&units[j]) == is_dense(&units[i]) && slot_of[j] == slot_of[i])?;
            if is_dense(&units[i]) {
                (prev..i).rev().find(|&j| layer_of(&units[j]) == layer_of(&units[prev]))
            } else {
                Some(prev)
            }
        })
        .collect();
    (slot_of, free_after)
}

/// What the upload thread reports: host seconds waiting for compute to issue a slot's previous
/// user, the copy stream's wait events, and when the last upload was issued (seconds into the run).
type UploaderTimes = (f64, Vec<(Event, Event)>, f64);

/// One run over all units; returns (wall seconds, per-layer times, bytes moved, host fill seconds).
fn run_mode(p: &Proj<'_>, st: &mut WeightStreamer, t: usize, args: &Args, mode: Mode) -> Result<(f64, Vec<LayerTime>, usize, f64)> {
    let b = p.b;
    let g = &b.gpu;
    let h = p.d.hidden;
    let c = args.chunk_tokens.min(t).max(1);
    let nchunks = t.div_ceil(c);
    // activations: the running sum P and two bank entries per token chunk
    let (mut pc, bank): (Vec<_>, Vec<Vec<_>>) = if mode == Mode::Transfer {
        (Vec::new(), Vec::new())
    } else {
        let mut pc = Vec::new();
        let mut bank = Vec::new();
        for ci in 0..nchunks {
            let rows = c.min(t - ci * c);
            let mk = |seed: u64| -> Result<_> {
                let v: Vec<f32> = (0..rows * h).map(|i| (((i as u64 ^ seed).wrapping_mul(2654435761) >> 8) % 2000) as f32 / 1000.0 - 1.0).collect();
                b.upload(&v, rows, h)
            };
            pc.push(mk(ci as u64)?);
            bank.push(vec![mk(1000 + ci as u64)?, mk(2000 + ci as u64)?]);
        }
        (pc, bank)
    };
    let mut states: Vec<Option<LayerState>> = (0..args.layers).map(|_| None).collect();
    if mode != Mode::Transfer {
        for (l, s) in states.iter_mut().enumerate() {
            *s = Some(LayerState::new(b, p.attn[l], &p.d, t)?);
        }
    }
    g.sync()?;
    profile::reset();
    let wall0 = Instant::now();
    let mut ev_t: Vec<(usize, Event, Event, Event)> = Vec::new(); // (unit, before wait, after wait, done)
    let (slot_of, free_after) = slot_schedule(&p.units);
    // unit i's weights into its slot (the caller orders the copy stream after the slot's previous user)
    let upload = |st: &mut WeightStreamer, i: usize| -> Result<(Event, crate::streamer::UploadStats)> {
        match p.units[i] {
            Unit::Dense { l, whole } => {
                let lay = &p.lay[li(p.attn[l])];
                let dst = p.dense_slots[slot_of[i]].ptr;
                let mut parts = lay.dense_parts(li(p.attn[l]));
                if whole {
                    parts.extend(lay.expert_parts(2, 0, p.d.experts, lay.dense_bytes));
                }
                st.upload(&p.regions, &parts, dst, None)
            }
            Unit::Experts { l, lo, hi } => {
                let lay = &p.lay[li(p.attn[l])];
                st.upload(&p.regions, &lay.expert_parts(2, lo, hi, 0), p.expert_slots[slot_of[i]].ptr, None)
            }
        }
    };
    // per-layer carry between units: MoE plans when experts come in chunks
    let mut plans: Vec<(crate::cuda::backend::MoePlan, crate::cuda::backend::CudaBuf)> = Vec::new();
    let mut new_p: Vec<crate::cuda::backend::CudaBuf> = Vec::new();
    // the dense slot of each layer (expert units need the layer's dense weights for moe_back)
    let mut dense_slot_of_layer = vec![0usize; args.layers];
    let n_units = p.units.len();
    let st = std::sync::Mutex::new(st);
    let mut bytes = 0usize;
    let mut fill = 0.0;
    let mut stall = 0.0;
    std::thread::scope(|sc| -> Result<()> {
        // Uploads run ahead on their own thread, in unit order, each as soon as the unit that last
        // used its slot has been issued on the compute stream (the copy stream then waits for it
        // on the GPU). The compute thread blocks at times (the dense expert path reads the
        // per-expert row counts back), which must not hold up the transfers.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(usize, Event, crate::streamer::UploadStats)>>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<(usize, Event)>();
        let uploader = if mode != Mode::Compute {
            let (upload, free_after, st) = (&upload, &free_after, &st);
            Some(sc.spawn(move || -> Result<UploaderTimes> {
                let mut done: Vec<Option<Event>> = (0..n_units).map(|_| None).collect();
                // diagnostics: host time waiting for compute to issue a slot's previous user, and
                // the copy stream's GPU time waiting for that user to finish
                let (mut host_wait, mut gpu_waits) = (0.0, Vec::new());
                #[allow(clippy::needless_range_loop)]
                for n in 0..n_units {
                    if let Some(f) = free_after[n].filter(|_| mode == Mode::Overlap) {
                        let t0 = Instant::now();
                        while done[f].is_none() {
                            match done_rx.recv() {
                                Ok((u, e)) => done[u] = Some(e),
                                Err(_) => return Ok((host_wait, gpu_waits, 0.0)), // the compute side stopped (an error)
                            }
                        }
                        host_wait += t0.elapsed().as_secs_f64();
                        let (a, b) = (g.event()?, g.event()?);
                        a.record(g.copy_stream())?;
                        done[f].as_ref().expect("received above").wait_on(g.copy_stream())?;
                        b.record(g.copy_stream())?;
                        gpu_waits.push((a, b));
                    }
                    let r = st.lock().map_err(|_| anyhow::anyhow!("streamer lock poisoned")).and_then(|mut s| upload(&mut s, n)).map(|(e, s)| (n, e, s));
                    let failed = r.is_err();
                    if ready_tx.send(r).is_err() || failed {
                        break;
                    }
                }
                Ok((host_wait, gpu_waits, wall0.elapsed().as_secs_f64()))
            }))
        } else {
            None
        };
        let (mut wait_uploads, mut issue) = (0.0, 0.0);
        #[allow(clippy::needless_range_loop)]
        for i in 0..n_units {
            let ready = if mode == Mode::Compute {
                // compute alone: load the unit's weights first, untimed (only GPU compute intervals count)
                g.sync()?;
                let mut guard = st.lock().map_err(|_| anyhow::anyhow!("streamer lock poisoned"))?;
                let (e, _) = upload(&mut guard, i)?;
                drop(guard);
                e.sync()?;
                None
            } else {
                let t0 = Instant::now();
                let (u, e, s) = ready_rx.recv().map_err(|_| anyhow::anyhow!("unit {i}: the upload thread stopped"))??;
                wait_uploads += t0.elapsed().as_secs_f64();
                ensure!(u == i, "unit {u} uploaded, {i} expected");
                bytes += s.bytes;
                fill += s.fill_s;
                stall += s.stall_s;
                Some(e)
            };
            let t_issue = Instant::now();
            if mode != Mode::Transfer {
                let e0 = g.event()?;
                e0.record(g.stream())?;
                if let Some(r) = ready.as_ref().filter(|_| mode == Mode::Overlap) {
                    r.wait_on(g.stream())?;
                }
                let e1 = g.event()?;
                e1.record(g.stream())?;
                match p.units[i] {
                    Unit::Dense { l, whole } => {
                        dense_slot_of_layer[l] = slot_of[i];
                        let lay = &p.lay[li(p.attn[l])];
                        let base = p.dense_slots[slot_of[i]].ptr;
                        let w = LayerWeights::view(b, lay, base);
                        let stt = states[l].as_mut().expect("state");
                        plans.clear();
                        new_p.clear();
                        for ci in 0..nchunks {
                            let bank_refs: Vec<&crate::cuda::backend::CudaBuf> = bank[ci].iter().collect();
                            let (p2, xn2) = sl::attention(b, &w, &p.d, &bank_refs, &pc[ci], stt, ci * c)?;
                            let (plan, sh) = sl::moe_front(b, &w, &p.d, &xn2)?;
                            drop(xn2);
                            plans.push((plan, sh));
                            new_p.push(p2);
                        }
                        if whole {
                            // the routed experts of all token chunks at once (one dequantisation)
                            let refs: Vec<&crate::cuda::backend::MoePlan> = plans.iter().map(|(pl, _)| pl).collect();
                            profile::mark(g, "-")?;
                            b.moe_run_chunks(&refs, &lay.experts, base + lay.dense_bytes as u64, 0, p.d.experts, p.d.betas, None)?;
                            profile::mark(g, "routed experts")?;
                            for (ci, (plan, sh)) in plans.iter().enumerate() {
                                sl::moe_back(b, &w, &p.d, plan, sh, &mut new_p[ci])?;
                            }
                            for (ci, np) in new_p.drain(..).enumerate() {
                                pc[ci] = np;
                            }
                            plans.clear();
                        }
                    }
                    Unit::Experts { l, lo, hi } => {
                        let lay = &p.lay[li(p.attn[l])];
                        profile::mark(g, "-")?;
                        let refs: Vec<&crate::cuda::backend::MoePlan> = plans.iter().map(|(pl, _)| pl).collect();
                        b.moe_run_chunks(&refs, &lay.experts, p.expert_slots[slot_of[i]].ptr, lo, hi, p.d.betas, None)?;
                        profile::mark(g, "routed experts")?;
                        if hi == p.d.experts {
                            let w = LayerWeights::view(b, lay, p.dense_slots[dense_slot_of_layer[l]].ptr);
                            for (ci, (plan, sh)) in plans.iter().enumerate() {
                                sl::moe_back(b, &w, &p.d, plan, sh, &mut new_p[ci])?;
                            }
                            for (ci, np) in new_p.drain(..).enumerate() {
                                pc[ci] = np;
                            }
                            plans.clear();
                        }
                    }
                }
                let e2 = g.event()?;
                e2.record(g.stream())?;
                ev_t.push((i, e0, e1, e2));
                if mode == Mode::Overlap {
                    let d = g.event()?;
                    d.record(g.stream())?;
                    // the upload thread has ended once every unit is uploaded: fine
                    let _ = done_tx.send((i, d));
                }
            }
            issue += t_issue.elapsed().as_secs_f64();
        }
        drop(done_tx);
        if let Some(h) = uploader {
            let (host_wait, gpu_waits, up_end) = h.join().map_err(|_| anyhow::anyhow!("the upload thread panicked"))??;
            if mode == Mode::Overlap {
                g.sync_copy()?;
                g.sync()?;
                let gpu_wait: f64 = gpu_waits.iter().map(|(a, b)| a.ms_to(b).map(|x| x as f64 / 1e3)).sum::<Result<f64>>()?;
                eprintln!(
                    "overlap at {t} tokens: uploads waited {host_wait:.3} s for compute to issue a slot's previous user, the copy stream {gpu_wait:.3} s for it to finish; compute waited {wait_uploads:.3} s for uploads and took {issue:.3} s to issue; the last upload was issued at {up_end:.3} s, the GPU done at {:.3} s", wall0.elapsed().as_secs_f64()
                );
            }
        }
        Ok(())
    })?;
    g.sync()?;
    g.sync_copy()?;
    if mode == Mode::Compute && profile::enabled() {
        let steps = profile::report()?;
        let total: f64 = steps.iter().map(|s| s.1).sum();
        eprintln!("K3_PROFILE: {t} tokens, {} layers, GPU time per step (compute alone)", args.layers);
        for (name, ms) in &steps {
            eprintln!("  {name:<40} {ms:>10.1} ms  {:>5.1} %", 100.0 * ms / total.max(1e-9));
        }
    }
    let mut wall = wall0.elapsed().as_secs_f64();
    if mode == Mode::Compute {
        wall = 0.0;
        for (_, _, e1, e2) in &ev_t {
            wall += e1.ms_to(e2)? as f64 / 1e3;
        }
    }
    // per-layer accounting
    let mut per: Vec<LayerTime> = (0..args.layers)
        .map(|l| {
            let lay = &p.lay[li(p.attn[l])];
            let fl = sl::layer_flops(p.attn[l], &p.d, t, 0);
            let gb = lay.total_bytes() as f64 / 1e9;
            LayerTime {
                layer: l,
                attn: if p.attn[l] == Attn::Kda { "KDA".into() } else { "MLA".into() },
                weight_gb: gb,
                tflop: fl / 1e12,
                roofline_ms: 1e3 * (gb / args.pcie_gbs).max(fl / 1e12 / args.peak_tflops),
                ..Default::default()
            }
        })
        .collect();
    for (i, e0, e1, e2) in &ev_t {
        let l = match p.units[*i] {
            Unit::Dense { l, .. } | Unit::Experts { l, .. } => l,
        };
        per[l].wait_ms += e0.ms_to(e1)? as f64;
        per[l].compute_ms += e1.ms_to(e2)? as f64;
    }
    if mode == Mode::Compute {
        eprintln!("{mode:?} run at {t} tokens: {wall:.3} s");
    } else {
        // host side of the uploads: filling the staging buffers, and waiting for a staging
        // buffer's previous DMA (copy stream behind: PCIe, or a slot not yet free)
        eprintln!("{mode:?} run at {t} tokens: {wall:.3} s (staging fill {fill:.3} s, waits for staging {stall:.3} s)");
    }
    Ok((wall, per, bytes, fill))
}

#[cfg(test)]
mod tests {
    use super::{slot_schedule, Unit};

    #[test]
    fn a_slot_waits_for_its_own_previous_user_only() {
        // 3 layers, experts in two chunks: D0 E0a E0b D1 E1a E1b D2 E2a E2b
        let units: Vec<Unit> = (0..3)
            .flat_map(|l| [Unit::Dense { l, whole: false }, Unit::Experts { l, lo: 0, hi: 610 }, Unit::Experts { l, lo: 610, hi: 896 }])
            .collect();
        let (slot, free) = slot_schedule(&units);
        assert_eq!(slot, vec![0, 0, 1, 1, 0, 1, 0, 0, 1]);
        // D2 reuses D0's slot once layer 0 is done (its last unit E0b, index 2); E1a waits for
        // E0a (1), E1b for E0b (2), E2a for E1a (4), E2b for E1b (5); the first users wait for none
        assert_eq!(free, vec![None, None, None, None, Some(1), Some(2), Some(2), Some(4), Some(5)]);
        // whole layers: each dense slot is freed by the layer two back
        let whole: Vec<Unit> = (0..4).map(|l| Unit::Dense { l, whole: true }).collect();
        assert_eq!(slot_schedule(&whole), (vec![0, 1, 0, 1], vec![None, None, Some(0), Some(1)]));
    }
}
