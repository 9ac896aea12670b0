//! Golden-set helpers shared by the decoder's integration tests.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use k3_protocol::testdata::golden_dir;

/// Every tensor of `tests/golden/<set>/golden.safetensors`, as f32 (int64 converted) with shape.
pub(crate) struct Golden {
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    pub ints: HashMap<String, Vec<i64>>,
}

impl Golden {
    pub(crate) fn load(set: &str) -> Golden {
        let path = golden_dir(set).join("golden.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("golden file parses");
        let mut tensors = HashMap::new();
        let mut ints = HashMap::new();
        for (name, t) in st.tensors() {
            match t.dtype() {
                safetensors::Dtype::F32 => {
                    let v = t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
                    tensors.insert(name, (t.shape().to_vec(), v));
                }
                safetensors::Dtype::I64 => {
                    let v = t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect();
                    ints.insert(name, v);
                }
                _ => {}
            }
        }
        Golden { tensors, ints }
    }

    pub(crate) fn f32(&self, name: &str) -> &(Vec<usize>, Vec<f32>) {
        self.tensors.get(name).unwrap_or_else(|| panic!("golden tensor {name} missing"))
    }

    pub(crate) fn ids(&self, name: &str) -> Vec<u32> {
        self.ints.get(name).unwrap_or_else(|| panic!("golden tensor {name} missing")).iter().map(|&x| x as u32).collect()
    }
}

pub(crate) fn model_dir(set: &str) -> PathBuf {
    golden_dir(set)
}

pub(crate) use k3_protocol::testdata::rel_l2;

/// Per-row relative L2 errors of two row-major `[rows, width]` matrices.
pub(crate) fn row_errors(a: &[f32], b: &[f32], width: usize) -> Vec<f64> {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.chunks(width).zip(b.chunks(width)).map(|(x, y)| rel_l2(x, y)).collect()
}

pub(crate) fn argmax(v: &[f32]) -> u32 {
    k3_protocol::eval::argmax(v).expect("non-empty row") as u32
}
