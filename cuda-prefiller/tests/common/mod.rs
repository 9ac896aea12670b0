//! Shared helpers of the cuda-prefiller integration tests: golden file access, the tiny-a
//! model on the CPU backend, relative errors.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::model::{Misread, Model, WeightPolicy};
use k3_protocol::Checkpoint;
use safetensors::{Dtype, SafeTensors};

/// Tolerance of the golden README for float32 implementations (never loosen).
pub(crate) const TOL: f64 = 1e-3;

/// A golden `.safetensors` file held in memory.
pub(crate) struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    pub(crate) fn open(path: &Path) -> Self {
        Golden { bytes: std::fs::read(path).unwrap_or_else(|e| panic!("golden file {}: {e}", path.display())) }
    }
    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("golden file parses")
    }
    pub(crate) fn has(&self, name: &str) -> bool {
        self.st().tensor(name).is_ok()
    }
    /// `(shape, values)` of an F32 tensor.
    pub(crate) fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = self.st();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("golden tensor {name} missing"));
        assert_eq!(t.dtype(), Dtype::F32, "golden tensor {name} dtype");
        (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
    /// Values of an I64 tensor.
    pub(crate) fn i64(&self, name: &str) -> Vec<i64> {
        let st = self.st();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("golden tensor {name} missing"));
        assert_eq!(t.dtype(), Dtype::I64, "golden tensor {name} dtype");
        t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect()
    }
    pub(crate) fn ids(&self, name: &str) -> Vec<u32> {
        self.i64(name).into_iter().map(|x| u32::try_from(x).expect("token id fits u32")).collect()
    }
}

pub(crate) use k3_protocol::testdata::rel_l2 as rel;

/// Per-row relative errors of two `[rows, width]` arrays.
pub(crate) fn row_rel(a: &[f32], b: &[f32], width: usize) -> Vec<f64> {
    assert_eq!(a.len(), b.len(), "row_rel: lengths differ");
    a.chunks(width).zip(b.chunks(width)).map(|(x, y)| rel(x, y)).collect()
}

pub(crate) fn max(v: &[f64]) -> f64 {
    v.iter().cloned().fold(0.0, f64::max)
}

pub(crate) fn tiny_a_dir() -> std::path::PathBuf {
    k3_protocol::testdata::golden_dir("tiny-a")
}

pub(crate) fn tiny_a_golden() -> Golden {
    Golden::open(&k3_protocol::testdata::tiny_a_golden())
}

pub(crate) fn checkpoint(dir: &Path) -> Arc<Checkpoint> {
    Arc::new(Checkpoint::open(dir).unwrap_or_else(|e| panic!("checkpoint {}: {e}", dir.display())))
}

pub(crate) fn cpu_model(ck: Arc<Checkpoint>, misread: Misread) -> anyhow::Result<Model<CpuBackend>> {
    Model::with_misread(Arc::new(CpuBackend), ck, WeightPolicy::Resident, misread)
}

/// Positions whose golden router margin (min over MoE layers) is below `1e-5`: exempt from the
/// per-row logits bound (golden README), and always listed.
pub(crate) fn near_tie_rows(golden: &Golden, t: usize) -> Vec<usize> {
    let (shape, gap) = golden.f32("moe.topk_gap");
    assert_eq!(shape[1], t);
    (0..t).filter(|&i| (0..shape[0]).map(|l| gap[l * t + i]).fold(f32::INFINITY, f32::min) < 1e-5).collect()
}

/// Asserts the per-row logits bound, listing exempt rows; returns the max error over the
/// checked rows.
pub(crate) fn check_logits(what: &str, ours: &[f32], reference: &[f32], vocab: usize, exempt: &[usize]) -> f64 {
    let errs = row_rel(ours, reference, vocab);
    eprintln!("{what}: rows exempt from the bound (router margin < 1e-5): {exempt:?}");
    for &r in exempt {
        eprintln!("  row {r}: rel err {:.3e}", errs[r]);
    }
    let bad: Vec<(usize, f64)> = errs.iter().cloned().enumerate().filter(|(i, e)| !exempt.contains(i) && !(*e <= TOL)).collect();
    let worst = errs.iter().enumerate().filter(|(i, _)| !exempt.contains(i)).map(|(_, e)| *e).fold(0.0, f64::max);
    eprintln!("{what}: {} rows, max per-row rel err {worst:.3e}", errs.len());
    assert!(bad.is_empty(), "{what}: {} rows above {TOL}: first {:?}", bad.len(), &bad[..bad.len().min(8)]);
    worst
}

/// Runs `k3-prefill forward ARGS --model MODEL --input-ids IDS --out OUT` (the real binary) to
/// its end.
pub(crate) fn forward_output(args: &[&str], model: &Path, ids: &Path, out: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_k3-prefill"))
        .arg("forward")
        .args(args)
        .arg("--model")
        .arg(model)
        .arg("--input-ids")
        .arg(ids)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}
