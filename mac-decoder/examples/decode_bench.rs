//! Decode speed and memory of the MLX decoder on this machine, with the memory-bandwidth bound.
//!
//! `cargo run -p mac-decoder --example decode_bench -- --model DIR [--prompt 128] [--tokens 64] [--bf16] [--fork]`
//!
//! `--fork` also times a session checkpoint at the prompt's length: the server's fork
//! (`Engine::fork_session`, shared arrays) against a copy through the hand-off layout (export to
//! host f32 and ingest back, what a fork did before), and the first decode step of each copy.
//!
//! Bytes per token = weights a decode step reads (all non-expert weights in f32 or BF16, `top_k` routed
//! experts per MoE layer in MXFP4, one embedding row) + the sequence state (KDA state read and
//! written, MLA latent rows read). Bound = measured read bandwidth / bytes per token.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mac_decoder::decode::{ComputeDtype, Engine, EngineOptions, GenerateParams};
use rand::{Rng, SeedableRng};

struct Args {
    model: PathBuf,
    prompt: usize,
    tokens: usize,
    bf16: bool,
    fork: bool,
}

fn parse() -> Result<Args> {
    let mut a = Args { model: PathBuf::new(), prompt: 128, tokens: 64, bf16: false, fork: false };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--model" => a.model = PathBuf::from(v()?),
            "--prompt" => a.prompt = v()?.parse()?,
            "--tokens" => a.tokens = v()?.parse()?,
            "--bf16" => a.bf16 = true,
            "--fork" => a.fork = true,
            _ => bail!("unknown argument {k} (--model DIR --prompt N --tokens N [--bf16] [--fork])"),
        }
    }
    if a.model.as_os_str().is_empty() {
        bail!("--model DIR is required");
    }
    Ok(a)
}

/// Best-of-3 read bandwidth (bytes/s) over a 1 GiB buffer with `threads` readers.
fn read_bandwidth(threads: usize) -> f64 {
    let words = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut best = 0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let chunk = words.div_ceil(threads);
            let hs: Vec<_> = buf.chunks(chunk).map(|c| s.spawn(move || c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max((words * 8) as f64 / t0.elapsed().as_secs_f64());
    }
    best
}

/// Peak resident set of this process (Linux `VmHWM`), bytes.
fn peak_rss() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<usize>().ok()? * 1024)
}

fn main() -> Result<()> {
    let a = parse()?;
    let t0 = Instant::now();
    let dtype = if a.bf16 { ComputeDtype::Bf16 } else { ComputeDtype::F32 };
    let engine = Engine::load_with_dtype(&a.model, EngineOptions { progress: true, ..Default::default() }, dtype)?;
    let load_s = t0.elapsed().as_secs_f64();
    let cfg = engine.config();
    let vocab = cfg.text_config.vocab_size as u32;
    let special = [cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.media_placeholder_token_id];
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let ids: Vec<u32> = (0..a.prompt)
        .map(|_| loop {
            let t = rng.gen_range(0..vocab.min(100_000));
            if !special.contains(&t) {
                break t;
            }
        })
        .collect();
    let mut s = engine.new_session()?;
    let t1 = Instant::now();
    engine.prefill_local(&mut s, &ids, None)?;
    let prefill_s = t1.elapsed().as_secs_f64();
    if a.fork {
        fork_costs(&engine, &mut s)?;
    }
    // one warm-up step, then the timed decode
    engine.generate(&mut s, &GenerateParams::greedy(1), |_| true)?;
    let out = engine.generate(&mut s, &GenerateParams::greedy(a.tokens), |_| true)?;
    let tok_s = out.tokens_per_second();
    let weights = engine.decode_weight_bytes();
    let kda_state: usize = s
        .cache()
        .layers
        .iter()
        .map(|l| match l {
            mac_decoder::model::LayerCache::Kda(k) => k.state.nbytes(),
            _ => 0,
        })
        .sum();
    // state read per step at the middle of the timed decode: everything once, KDA state also written
    let state = s.state_bytes() + kda_state;
    let per_token = weights + state;
    let mlx_peak = mlx_rs::memory::peak_memory().unwrap_or(0);
    let rss = peak_rss(); // before the bandwidth test allocates its buffer
    let bw1 = read_bandwidth(1);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let bwn = read_bandwidth(cores);
    println!("model                 {}", a.model.display());
    println!("weights in MLX        {:.1} MB ({dtype:?} non-expert, MXFP4 experts)", engine.weight_bytes() as f64 / 1e6);
    println!("load                  {load_s:.2} s");
    println!("prefill               {} tokens in {prefill_s:.3} s = {:.1} tok/s", a.prompt, a.prompt as f64 / prefill_s);
    println!("decode                {} tokens in {:.3} s = {tok_s:.2} tok/s", out.tokens.len(), out.decode_time.as_secs_f64());
    println!("bytes read / token    {:.2} MB (weights {:.2} MB + state {:.2} MB)", per_token as f64 / 1e6, weights as f64 / 1e6, state as f64 / 1e6);
    println!("read bandwidth        {:.2} GB/s (1 thread), {:.2} GB/s ({cores} threads)", bw1 / 1e9, bwn / 1e9);
    println!("bandwidth bound       {:.1} tok/s (1 thread), {:.1} tok/s ({cores} threads)", bw1 / per_token as f64, bwn / per_token as f64);
    println!("share of the bound    {:.0}% ({cores} threads)", 100.0 * tok_s / (bwn / per_token as f64));
    println!("MLX peak memory       {:.1} MB", mlx_peak as f64 / 1e6);
    if let Some(rss) = rss {
        println!("process peak RSS      {:.1} MB", rss as f64 / 1e6);
    }
    Ok(())
}

/// Times a checkpoint of `s` both ways, and the first decode step of each copy.
fn fork_costs(engine: &Engine, s: &mut mac_decoder::decode::Session) -> Result<()> {
    let next = 7u32;
    let bytes = s.state_bytes();
    // through the hand-off layout: every row to host f32 and back
    let t = Instant::now();
    let state = engine.export_state(s)?;
    let mut copy = engine.new_session()?;
    engine.ingest(&mut copy, 0, &state, s.last_logits().map(<[f32]>::to_vec))?;
    let copy_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    engine.step(&mut copy, next)?;
    let copy_step = t.elapsed().as_secs_f64();
    drop((state, copy));
    // the fork: shared arrays
    let t = Instant::now();
    let mut forked = engine.fork_session(s)?;
    let fork_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let a = engine.step(&mut forked, next)?;
    let fork_step = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let b = engine.step(s, next)?;
    let orig_step = t.elapsed().as_secs_f64();
    anyhow::ensure!(a == b, "the fork and the original disagree on the same step");
    println!("checkpoint at {} tokens, state {:.1} MB:", s.tokens() - 1, bytes as f64 / 1e6);
    println!(
        "  export + ingest     {:.2} ms, {:.1} MB copied (to host and back), first step {:.2} ms",
        copy_s * 1e3,
        2.0 * bytes as f64 / 1e6,
        copy_step * 1e3
    );
    println!(
        "  fork (shared)       {:.3} ms, 0 MB copied, first step {:.2} ms (the original's next step {:.2} ms)",
        fork_s * 1e3,
        fork_step * 1e3,
        orig_step * 1e3
    );
    Ok(())
}
