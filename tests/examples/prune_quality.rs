//! Held-out perplexity of a trained model (tiny-t) pruned to fractions of its routed experts by
//! REAP, frequency and random selection, with the project's own commands (calibrate, prune) and
//! the CPU reference; and, for long prompts, full-model prefill + pruned continuation against
//! pruned prefill + pruned continuation. Writes `results.json` and `table.md` to `--out`
//! (scripts/prune-quality.sh runs it and plots; docs/pruning.md shows the result).
//!
//! ```sh
//! cargo run --release -p k3-e2e-tests --example prune_quality -- --model tests/models/tiny-t \
//!     --calib /tmp/prune-corpus/valid.txt --heldout /tmp/prune-corpus/heldout.txt --out /tmp/prune-quality \
//!     [--seq 1024] [--calib-windows 16] [--eval-windows 16] [--keep 32,16,9,6] [--prefix 768]
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use cuda_prefiller::cli::backend_args::BackendChoice;
use cuda_prefiller::cli::calibrate as cal;
use cuda_prefiller::cli::prune as pr;
use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::executor::{self, ExecOptions, LogitsRows, PrefillInput};
use cuda_prefiller::model::{Model, WeightPolicy};
use k3_protocol::handoff::HandoffState;
use k3_protocol::prune::Criterion;
use k3_protocol::Checkpoint;
use mac_decoder::tokenizer::Tokenizer;

struct Opts {
    model: PathBuf,
    calib: PathBuf,
    heldout: PathBuf,
    out: PathBuf,
    seq: usize,
    calib_windows: usize,
    eval_windows: usize,
    keep: Vec<usize>,
    prefix: usize,
}

fn parse() -> anyhow::Result<Opts> {
    let mut m: BTreeMap<String, String> = BTreeMap::new();
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().with_context(|| format!("{k} needs a value"))?;
        m.insert(k.trim_start_matches("--").to_string(), v);
    }
    let get = |k: &str| m.get(k).cloned().with_context(|| format!("--{k} is required"));
    let num = |k: &str, d: usize| -> anyhow::Result<usize> { m.get(k).map_or(Ok(d), |v| v.parse().with_context(|| format!("--{k}"))) };
    Ok(Opts {
        model: get("model")?.into(),
        calib: get("calib")?.into(),
        heldout: get("heldout")?.into(),
        out: get("out")?.into(),
        seq: num("seq", 1024)?,
        calib_windows: num("calib-windows", 16)?,
        eval_windows: num("eval-windows", 16)?,
        keep: m.get("keep").map_or("32,16,9,6", |s| s).split(',').map(|x| x.parse().context("--keep")).collect::<anyhow::Result<_>>()?,
        prefix: num("prefix", 768)?,
    })
}

fn windows(tok: &Tokenizer, path: &Path, seq: usize, n: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let ids = tok.encode(&text, false)?;
    let w: Vec<Vec<u32>> = ids.chunks_exact(seq).take(n).map(|c| c.to_vec()).collect();
    anyhow::ensure!(w.len() == n, "{}: only {} windows of {seq} tokens", path.display(), w.len());
    Ok(w)
}

fn model(dir: &Path) -> anyhow::Result<Model<CpuBackend>> {
    Model::new(Arc::new(CpuBackend), Arc::new(Checkpoint::open(dir)?), WeightPolicy::Resident)
}

/// Σ −log p(ids[i+1] | row i) over rows `0..rows-1` of `[rows, vocab]` logits (f64).
fn nll(logits: &[f32], vocab: usize, next: &[u32]) -> f64 {
    next.iter()
        .enumerate()
        .map(|(i, &t)| {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = mx + row.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln();
            lse - row[t as usize] as f64
        })
        .sum()
}

fn opts() -> ExecOptions {
    ExecOptions { chunk_tokens: 512, logits: LogitsRows::All, ..Default::default() }
}

/// Held-out perplexity: each window from an empty state, every position but the last predicts.
fn perplexity(m: &Model<CpuBackend>, ws: &[Vec<u32>]) -> anyhow::Result<f64> {
    let (mut total, mut count) = (0.0, 0usize);
    for w in ws {
        let mut st = HandoffState::empty(&m.cfg);
        let out = executor::prefill(m, &mut st, PrefillInput::tokens(w), &opts(), |_| Ok(()))?;
        total += nll(&out.logits, out.vocab, &w[1..]);
        count += w.len() - 1;
    }
    Ok((total / count as f64).exp())
}

/// Perplexity of the continuation `w[prefix..]` decoded (teacher-forced) by `dec` from the state
/// `pre` left after the first `prefix` tokens.
fn continuation_perplexity(pre: &Model<CpuBackend>, dec: &Model<CpuBackend>, ws: &[Vec<u32>], prefix: usize) -> anyhow::Result<f64> {
    let (mut total, mut count) = (0.0, 0usize);
    let none = ExecOptions { logits: LogitsRows::None, ..opts() };
    for w in ws {
        let mut st = HandoffState::empty(&pre.cfg);
        executor::prefill(pre, &mut st, PrefillInput::tokens(&w[..prefix]), &none, |_| Ok(()))?;
        let out = executor::prefill(dec, &mut st, PrefillInput::tokens(&w[prefix..]), &opts(), |_| Ok(()))?;
        total += nll(&out.logits, out.vocab, &w[prefix + 1..]);
        count += w.len() - prefix - 1;
    }
    Ok((total / count as f64).exp())
}

fn main() -> anyhow::Result<()> {
    let o = parse()?;
    std::fs::create_dir_all(&o.out)?;
    let tok = Tokenizer::from_dir(&o.model)?;
    let calib = windows(&tok, &o.calib, o.seq, o.calib_windows)?;
    let eval = windows(&tok, &o.heldout, o.seq, o.eval_windows)?;
    let prompts = o.out.join("calib.jsonl");
    std::fs::write(&prompts, calib.iter().map(|w| serde_json::to_string(w).unwrap() + "\n").collect::<String>())?;
    let stats = o.out.join("stats.json");
    let t0 = std::time::Instant::now();
    let s = cal::run_with(Arc::new(CpuBackend), &{
        let mut a = cal::Args::with_paths(&o.model, &prompts, &stats);
        a.fresh = true;
        a.backend.choice = BackendChoice::Cpu;
        a.chunk_tokens = Some(512);
        a
    })?;
    let calib_s = t0.elapsed().as_secs_f64();
    eprintln!("calibrated on {} tokens in {calib_s:.1} s", s.tokens);
    let full = model(&o.model)?;
    let n = full.cfg.num_experts;
    let t0 = std::time::Instant::now();
    let base = perplexity(&full, &eval)?;
    let eval_s = t0.elapsed().as_secs_f64();
    eprintln!("full model ({n} experts): held-out perplexity {base:.3} ({eval_s:.1} s)");
    let mut rows = Vec::new();
    for &keep in &o.keep {
        for crit in [Criterion::Reap, Criterion::Frequency, Criterion::Random] {
            let (ppl, long_full, long_pruned) = if keep == n {
                (base, None, None)
            } else {
                let dir = o.out.join(format!("{crit:?}-{keep}").to_lowercase());
                if dir.exists() {
                    std::fs::remove_dir_all(&dir)?;
                }
                pr::run_args(&pr::Args {
                    model: o.model.clone(),
                    stats: stats.clone(),
                    keep: Some(keep),
                    budget_gb: None,
                    mode: pr::Mode::Uniform,
                    criterion: crit,
                    seed: 1,
                    out: dir.clone(),
                })?;
                let m = model(&dir)?;
                let ppl = perplexity(&m, &eval)?;
                let (lf, lp) = if crit == Criterion::Reap {
                    (Some(continuation_perplexity(&full, &m, &eval, o.prefix)?), Some(continuation_perplexity(&m, &m, &eval, o.prefix)?))
                } else {
                    (None, None)
                };
                std::fs::remove_dir_all(&dir)?;
                (ppl, lf, lp)
            };
            eprintln!("keep {keep}/{n} {crit:?}: {ppl:.3} {long_full:?} {long_pruned:?}");
            rows.push(serde_json::json!({
                "keep": keep, "fraction": keep as f64 / n as f64, "criterion": crit,
                "perplexity": ppl, "long_full_prefill": long_full, "long_pruned_prefill": long_pruned,
            }));
        }
    }
    let long_full_model = continuation_perplexity(&full, &full, &eval, o.prefix)?;
    let res = serde_json::json!({
        "model": o.model, "num_experts": n, "top_k": full.cfg.num_experts_per_token,
        "seq": o.seq, "calib_tokens": s.tokens, "eval_tokens": eval.len() * (o.seq - 1),
        "calib_seconds": calib_s, "eval_seconds_full": eval_s, "prefix": o.prefix,
        "full_perplexity": base, "long_full_model": long_full_model, "rows": rows,
    });
    std::fs::write(o.out.join("results.json"), serde_json::to_string_pretty(&res)?)?;
    // The markdown table.
    let mut t = String::from("| experts kept | REAP | frequency | random |\n|---|---|---|---|\n");
    for &keep in &o.keep {
        let get = |c: &str| {
            rows.iter()
                .find(|r| r["keep"] == keep && r["criterion"] == c)
                .and_then(|r| r["perplexity"].as_f64())
                .map_or("—".to_string(), |p| format!("{p:.2}"))
        };
        t += &format!("| {keep} / {n} ({:.0} %) | {} | {} | {} |\n", 100.0 * keep as f64 / n as f64, get("reap"), get("frequency"), get("random"));
    }
    t += &format!(
        "\nLong prompts (REAP; perplexity of tokens {}..{} decoded by the pruned model, teacher-forced):\n\n\
         | experts kept | full-model prefill | pruned prefill |\n|---|---|---|\n| {n} / {n} (100 %) | {long_full_model:.2} | {long_full_model:.2} |\n",
        o.prefix + 1,
        o.seq
    );
    for &keep in o.keep.iter().filter(|&&k| k != n) {
        let r = rows.iter().find(|r| r["keep"] == keep && r["criterion"] == "reap").expect("a REAP row");
        t += &format!(
            "| {keep} / {n} ({:.0} %) | {:.2} | {:.2} |\n",
            100.0 * keep as f64 / n as f64,
            r["long_full_prefill"].as_f64().unwrap_or(f64::NAN),
            r["long_pruned_prefill"].as_f64().unwrap_or(f64::NAN)
        );
    }
    std::fs::write(o.out.join("table.md"), &t)?;
    println!("{t}");
    Ok(())
}
