//! The planned path on the CPU backend (issue 34): a device budget tight enough to force token
//! chunks shorter than the prompt, several routed-expert windows and the AttnRes bank on the
//! host gives bit-identical f32 outputs (logits, every hand-off tensor, the hidden trace, the
//! router margins) to the unconstrained run; a prompt beyond the fit is refused before any
//! weight is read.

mod common;

use std::sync::Arc;

use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::executor::{ExecOptions, LogitsRows, PrefillInput};
use cuda_prefiller::memory_plan::{self, BackendShape, Geometry, Knobs, Limits, LogitsKept, Placement, PlanRequest};
use cuda_prefiller::prefiller::{MemoryOptions, Prefiller, PrefillerOptions, WeightMode};
use k3_protocol::handoff::HandoffState;
use k3_protocol::Checkpoint;

fn open(ck: &Arc<Checkpoint>, n: usize, budget: Option<f64>) -> anyhow::Result<Prefiller<CpuBackend>> {
    Prefiller::open(
        Arc::new(CpuBackend),
        ck.clone(),
        &PrefillerOptions {
            weights: WeightMode::PerLayer,
            memory: MemoryOptions { vram_budget: budget, host_memory: Some(8.0), emulate_gpu_memory: None },
            chunk_tokens: None,
            logits: LogitsKept::All,
            design: vec![PlanRequest { base: 0, new: n }],
            design_cap: usize::MAX,
            emulate_source_gbs: None,
        },
    )
}

/// The smallest budget (bytes, to 1 kB) whose plan fits `n` tokens, and that plan.
fn tightest(g: &Geometry, n: usize) -> (u64, memory_plan::MemoryPlan) {
    let be = BackendShape::cpu();
    let k = Knobs { logits: LogitsKept::All, ..Default::default() };
    let fits = |b: u64| memory_plan::plan(g, &be, &[PlanRequest { base: 0, new: n }], Limits { device: b, host: 8_000_000_000 }, &k).ok();
    let (mut lo, mut hi) = (1_000u64, 1_000_000_000u64);
    assert!(fits(hi).is_some());
    while hi - lo > 1_000 {
        let mid = (lo + hi) / 2;
        if fits(mid).is_some() {
            hi = mid
        } else {
            lo = mid
        }
    }
    (hi, fits(hi).unwrap())
}

#[test]
fn a_tight_budget_plans_small_chunks_windows_and_a_host_bank_with_identical_outputs() {
    let ck = Arc::new(Checkpoint::open(&common::tiny_a_dir()).unwrap());
    let golden = common::tiny_a_golden();
    let ids = golden.ids("input_ids");
    let n = ids.len();
    let cfg = ck.config().text_config.clone();
    let g = Geometry::of(&cfg, &cfg.layer_plan()).unwrap();
    let (budget, tight) = tightest(&g, n);
    eprintln!("tiny-a, {n} tokens: unconstrained vs {}", tight.line());
    assert!(tight.chunk_tokens < n, "{}", tight.line());
    assert_eq!(tight.bank, Placement::Host, "{}", tight.line());
    assert!(tight.windows > 1, "{}", tight.line());

    let run = |budget: Option<f64>| {
        let pf = open(&ck, n, budget).unwrap();
        let mut st = HandoffState::empty(&pf.model.cfg);
        let opts = ExecOptions { logits: LogitsRows::All, trace_last: true, ..Default::default() };
        let (out, _, plan) = pf.prefill(&mut st, PrefillInput::tokens(&ids), &opts, |_| Ok(())).unwrap();
        (out, st, plan)
    };
    let (a, sa, pa) = run(None);
    let (b, sb, pb) = run(Some(budget as f64 / 1e9));
    eprintln!("unconstrained: {}\ntight:         {}", pa.line(), pb.line());
    assert!(pa.chunk_tokens >= n && pa.bank == Placement::Device && pa.windows == 1, "{}", pa.line());
    assert_eq!((pb.chunk_tokens, pb.bank, pb.windows), (tight.chunk_tokens, tight.bank, tight.windows));
    assert!(pb.peak_device <= budget);
    // bit-identical: logits, router margins, hidden trace, every state tensor
    assert_eq!(a.logits.len(), b.logits.len());
    assert!(a.logits.iter().zip(&b.logits).all(|(x, y)| x.to_bits() == y.to_bits()), "logits differ");
    assert_eq!(a.topk_gap.len(), b.topk_gap.len());
    for ((la, ga), (lb, gb)) in a.topk_gap.iter().zip(&b.topk_gap) {
        assert_eq!(la, lb);
        assert!(ga.iter().zip(gb).all(|(x, y)| x.to_bits() == y.to_bits()), "layer {la}: router margins differ");
    }
    assert_eq!(a.trace, b.trace, "hidden trace differs");
    let (ta, tb) = (sa.named_tensors(), sb.named_tensors());
    assert_eq!(ta.len(), tb.len());
    for ((na, _, da), (nb, _, db)) in ta.iter().zip(&tb) {
        assert_eq!(na, nb);
        assert!(da.iter().zip(db.iter()).all(|(x, y)| x.to_bits() == y.to_bits()), "{na} differs");
    }
}

#[test]
fn a_prompt_beyond_the_fit_is_refused_before_any_weight_is_read() {
    let ck = Arc::new(Checkpoint::open(&common::tiny_a_dir()).unwrap());
    let t0 = std::time::Instant::now();
    let e = open(&ck, 50_000_000, Some(0.016)).err().expect("50M tokens in 16 MB must be refused");
    let msg = format!("{e:#}");
    assert!(t0.elapsed().as_secs_f64() < 5.0);
    assert!(msg.contains("0.016 GB (--vram-budget)") && msg.contains("--host-memory") && msg.contains("longest prompt that fits is"), "{msg}");
}

#[test]
fn bench_refuses_an_oversized_prompt_within_five_seconds() {
    let bin = env!("CARGO_BIN_EXE_k3-prefill");
    let t0 = std::time::Instant::now();
    let out = std::process::Command::new(bin)
        .args(["bench", "--model"])
        .arg(common::tiny_a_dir())
        .args(["--backend", "cpu", "--vram-budget", "0.016", "--tokens", "50000000"])
        .output()
        .unwrap();
    let s = t0.elapsed().as_secs_f64();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(s < 5.0, "took {s:.1} s");
    assert!(err.contains("--vram-budget") && err.contains("longest prompt that fits"), "{err}");
}

#[test]
fn forward_refuses_a_prompt_beyond_the_fit_and_writes_nothing() {
    let bin = env!("CARGO_BIN_EXE_k3-prefill");
    let dir = tempfile::tempdir().unwrap();
    let ids = dir.path().join("ids.json");
    std::fs::write(&ids, serde_json::to_string(&(0..4000u32).map(|i| i % 500).collect::<Vec<_>>()).unwrap()).unwrap();
    let out_file = dir.path().join("out.safetensors");
    let out = std::process::Command::new(bin)
        .args(["forward", "--model"])
        .arg(common::tiny_a_dir())
        .args(["--backend", "cpu", "--vram-budget", "0.001", "--input-ids"])
        .arg(&ids)
        .arg("--out")
        .arg(&out_file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("a prompt of 4000 tokens does not fit a device budget of 0.001 GB") && err.contains("longest prompt that fits is"), "{err}");
    assert!(!out_file.exists());
}

/// `bench --backend cpu` prints a table of what it measured: every column a finite, non-zero
/// number (the streamed-weight columns — copy rate, roofline, projection — are not printed for
/// resident weights; they read NaN and 0 % before).
#[test]
fn cpu_bench_table_has_no_nan_or_zero_columns() {
    let bin = env!("CARGO_BIN_EXE_k3-prefill");
    let out = std::process::Command::new(bin)
        .args(["bench", "--model"])
        .arg(common::tiny_a_dir())
        .args(["--backend", "cpu", "--tokens", "64,128", "--repeats", "2"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{}", text, String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    let head = lines.iter().position(|l| l.contains("median s")).unwrap_or_else(|| panic!("no table header in:\n{text}"));
    let header: Vec<&str> = lines[head].split_whitespace().collect();
    let rows: Vec<&str> = lines[head + 1..].iter().take_while(|l| !l.trim().is_empty()).copied().collect();
    assert_eq!(rows.len(), 2, "one row per length:\n{text}");
    for row in rows {
        let fields: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(fields[0], "cpu", "{row}");
        for f in &fields[1..] {
            let v: f64 = f.trim_end_matches('%').parse().unwrap_or_else(|_| panic!("{f:?} is not a number in {row:?} (header {header:?})"));
            assert!(v.is_finite() && v > 0.0, "{f:?} in {row:?} (header {header:?})");
        }
    }
    assert!(!text.to_lowercase().contains("nan"), "{text}");
}

/// A bench run estimated at over ten minutes says so before it starts (the estimate from the
/// model's FLOPs at the backend's measured GEMM rate); the test stops it once it has.
#[test]
fn bench_warns_before_a_run_estimated_at_over_ten_minutes() {
    use std::io::BufRead;
    let bin = env!("CARGO_BIN_EXE_k3-prefill");
    let mut child = std::process::Command::new(bin)
        .args(["bench", "--model"])
        .arg(common::tiny_a_dir())
        .args(["--backend", "cpu", "--tokens", "64,1000000", "--repeats", "5"])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let mut warned = None;
    for l in lines.map_while(Result::ok) {
        if l.contains("run 1/") {
            break; // timing started without a warning
        }
        if l.contains("estimated at") {
            warned = Some(l);
            break;
        }
        seen.push(l);
    }
    let _ = child.kill();
    let _ = child.wait();
    let w = warned.unwrap_or_else(|| panic!("no warning before the runs:\n{}", seen.join("\n")));
    assert!(w.contains("minutes or more") && w.contains("--repeats"), "{w}");
}
