//! How much a model amplifies a tiny perturbation of its input: the CPU reference forward is
//! run once as is and once with every embedding row multiplied element-wise by `1 ± eps`
//! (random signs); the per-row relative change of the logits, divided by `eps`, is the
//! amplification factor. `eps = 2^-24` is fp32 rounding, `2^-9` bf16 rounding.
//!   cargo run --release -p cuda-prefiller --example amplification -- MODEL_DIR [TOKENS | golden]
//! `golden` takes the prompt `input_ids` of `MODEL_DIR/golden.safetensors` (a golden set);
//! a number draws that many random token ids.
use std::sync::Arc;

use cuda_prefiller::cpu::CpuBackend;
use cuda_prefiller::executor::{self, EmbeddingOverrides, ExecOptions, PrefillInput};
use cuda_prefiller::model::{Model, WeightPolicy};
use k3_protocol::checkpoint::Checkpoint;
use k3_protocol::handoff::HandoffState;

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let dir = a.get(1).expect("MODEL_DIR");
    let arg = a.get(2).map(String::as_str).unwrap_or("64");
    let ck = Arc::new(Checkpoint::open(std::path::Path::new(dir))?);
    let model = Model::new(Arc::new(CpuBackend), ck, WeightPolicy::Resident)?;
    let vocab = model.dims.vocab as u64;
    let mut s = 0x9e3779b97f4a7c15u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let ids: Vec<u32> = if arg == "golden" {
        let bytes = std::fs::read(std::path::Path::new(dir).join("golden.safetensors"))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)?;
        let t = st.tensor("input_ids")?;
        anyhow::ensure!(t.dtype() == safetensors::Dtype::I64, "golden input_ids: expected I64, found {:?}", t.dtype());
        t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
    } else {
        let n: usize = arg.parse().map_err(|e| anyhow::anyhow!("TOKENS {arg:?}: {e}"))?;
        (0..n).map(|_| (next() % vocab) as u32).collect()
    };
    let n = ids.len();
    let opts = ExecOptions::default();
    let run = |ov: Option<&EmbeddingOverrides>| -> anyhow::Result<Vec<f32>> {
        let mut st = HandoffState::empty(&model.cfg);
        Ok(executor::prefill(&model, &mut st, PrefillInput { tokens: &ids, overrides: ov }, &opts, |_| Ok(()))?.logits)
    };
    let base = run(None)?;
    let emb = model.embed_rows(&ids)?;
    let v = model.dims.vocab;
    for eps in [2f32.powi(-24), 2f32.powi(-9)] {
        let rows: Vec<f32> = emb.iter().map(|x| x * (1.0 + if next() & 1 == 0 { eps } else { -eps })).collect();
        let ov = EmbeddingOverrides { positions: (0..n).collect(), rows };
        let p = run(Some(&ov))?;
        let mut rel: Vec<f64> = (0..n)
            .map(|r| {
                let (x, y) = (&base[r * v..(r + 1) * v], &p[r * v..(r + 1) * v]);
                let d: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
                d / x.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt()
            })
            .collect();
        rel.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "eps {eps:.3e}: logits row rel change median {:.3e} worst {:.3e}  (amplification median {:.0}, worst {:.0}); rows > 2e-2: {}",
            rel[n / 2],
            rel[n - 1],
            rel[n / 2] / eps as f64,
            rel[n - 1] / eps as f64,
            rel.iter().filter(|r| **r > 2e-2).count()
        );
    }
    Ok(())
}
