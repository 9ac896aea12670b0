//! Reads checkpoint tensors (through `k3_protocol::Checkpoint`) into MLX arrays.
//! Non-expert weights: BF16 widened to f32 bit-exactly (F32 tensors as stored); routed
//! experts: MXFP4 reinterpreted for MLX (see `crate::mlx::quant`), never requantised.

use std::collections::HashMap;

use anyhow::{Context, Result};
use k3_protocol::tensors::{expert_tensor, global_text_tensors, layer_dense_tensors, layer_tensor};
use k3_protocol::Checkpoint;
use mlx_rs::{Array, Dtype};

use crate::mlx::{array_f32, Mxfp4Array};

pub struct WeightLoader<'a> {
    pub ck: &'a Checkpoint,
    /// dtype of matrices and norm gains: `Float32` (BF16 widened exactly; the parity path) or
    /// `Bfloat16` (as stored). Tensors the spec keeps in FP32 are loaded with the `*_f32` methods.
    pub dtype: Dtype,
    /// Bytes loaded so far (for the load log).
    pub bytes: usize,
    /// The shape of every text tensor but the routed experts, from the one tensor list
    /// (`k3_protocol::tensors`) for the checkpoint's config.
    shapes: HashMap<String, Vec<usize>>,
    /// Tensors read since the last [`Self::check_read`].
    read: Vec<String>,
}

impl<'a> WeightLoader<'a> {
    pub fn new(ck: &'a Checkpoint) -> Self {
        Self::with_dtype(ck, Dtype::Float32)
    }

    pub fn with_dtype(ck: &'a Checkpoint, dtype: Dtype) -> Self {
        let c = &ck.config().text_config;
        let shapes = global_text_tensors(c)
            .into_iter()
            .chain(c.layer_plan().into_iter().flat_map(|spec| layer_dense_tensors(c, spec)))
            .map(|t| (t.name, t.shape))
            .collect();
        WeightLoader { ck, dtype, bytes: 0, shapes, read: Vec::new() }
    }

    /// The shape the tensor list gives `name`.
    /// Checks the tensors read since the last call against the weight digest the model
    /// fingerprint is made from (SHA-256, in parallel; `Checkpoint::verify_tensors`): the
    /// decoder computes with, and labels its states by, a fingerprint its weights were checked
    /// against. A mismatch (a shard edited in place, a forged digest cache) is an error and the
    /// cached digest is deleted.
    pub fn check_read(&mut self) -> Result<()> {
        let mut names = std::mem::take(&mut self.read);
        names.sort_unstable();
        names.dedup();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        self.ck.verify_tensors(&refs).context("checking the weights against the model fingerprint")?;
        Ok(())
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>> {
        self.shapes.get(name).cloned().with_context(|| format!("{name} is not a dense text tensor of this model"))
    }

    /// A BF16/F32 tensor as an f32 array, its shape checked against the tensor list.
    pub fn dense_f32(&mut self, name: &str) -> Result<Array> {
        let shape = self.shape(name)?;
        let v = self.ck.f32(name, &shape).with_context(|| format!("loading {name}"))?;
        self.read.push(name.to_string());
        self.bytes += v.len() * 4;
        array_f32(&v, &shape, name)
    }

    /// A tensor in the loader's dtype (BF16 data is taken as is in `Bfloat16` mode).
    pub fn dense(&mut self, name: &str) -> Result<Array> {
        if self.dtype == Dtype::Float32 {
            return self.dense_f32(name);
        }
        let shape = self.shape(name)?;
        let shape = &shape[..];
        let v = self.ck.tensor(name).with_context(|| format!("loading {name}"))?;
        self.read.push(name.to_string());
        if v.shape != shape {
            anyhow::bail!("{name}: shape {:?} in {}, expected {shape:?}", v.shape, v.shard);
        }
        let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        let a = match v.dtype {
            k3_protocol::tensors::DType::BF16 => {
                let h: Vec<half::bf16> = v.bytes.chunks_exact(2).map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect();
                Array::from_slice(&h, &dims)
            }
            _ => array_f32(&v.to_f32().with_context(|| format!("loading {name}"))?, shape, name)?,
        };
        let a = if a.dtype() == self.dtype { a } else { a.as_dtype(self.dtype)? };
        self.bytes += a.nbytes();
        Ok(a)
    }

    /// `model.layers.{l}.{suffix}` in the loader's dtype.
    pub fn layer(&mut self, l: usize, suffix: &str) -> Result<Array> {
        self.dense(&layer_tensor(l, suffix))
    }

    /// `model.layers.{l}.{suffix}` in f32 (conv taps, gates, router: FP32 in the spec).
    pub fn layer_f32(&mut self, l: usize, suffix: &str) -> Result<Array> {
        self.dense_f32(&layer_tensor(l, suffix))
    }

    /// The first `n` entries of a padded 1-D tensor (`A_log`).
    pub fn layer_prefix(&mut self, l: usize, suffix: &str, n: usize) -> Result<Array> {
        let name = layer_tensor(l, suffix);
        let v = self.ck.f32_prefix(&name, n).with_context(|| format!("loading {name}"))?;
        self.read.push(name.clone());
        array_f32(&v, &[n], &name)
    }

    /// The routed experts `experts` (all of them, or a rank's block) of weight `w` ("w1" gate,
    /// "w3" up, "w2" down) of layer `l` as one MXFP4 stack. Only those experts' bytes are read
    /// from the memory-mapped checkpoint.
    pub fn experts(&mut self, l: usize, experts: std::ops::Range<usize>, w: &str, out: usize, inp: usize) -> Result<Mxfp4Array> {
        let mut parts = Vec::with_capacity(experts.len());
        for e in experts {
            let m = self.ck.expert(l, e, w).with_context(|| format!("loading {}", expert_tensor(l, e, w, "weight_packed")))?;
            self.read.push(expert_tensor(l, e, w, "weight_packed"));
            self.read.push(expert_tensor(l, e, w, "weight_scale"));
            if m.out_features != out || m.in_features != inp {
                anyhow::bail!("{}: logical shape [{}, {}], expected [{out}, {inp}]", expert_tensor(l, e, w, "weight_packed"), m.out_features, m.in_features);
            }
            parts.push((m.packed, m.scale));
        }
        let stack = Mxfp4Array::from_compressed(&parts, out, inp, &layer_tensor(l, &format!("block_sparse_moe.experts.*.{w}")))?;
        self.bytes += stack.nbytes();
        Ok(stack)
    }
}
