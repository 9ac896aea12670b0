//! Reads checkpoint tensors (through `k3_protocol::Checkpoint`) into MLX arrays.
//! Non-expert weights: BF16 widened to f32 bit-exactly (F32 tensors as stored); routed
//! experts: MXFP4 reinterpreted for MLX (see `crate::mlx::quant`), never requantised.

use anyhow::{Context, Result};
use k3_protocol::tensors::{expert_tensor, layer_tensor, TEXT_PREFIX};
use k3_protocol::Checkpoint;
use mlx_rs::Array;

use crate::mlx::{array_f32, Mxfp4Array};

pub struct WeightLoader<'a> {
    pub ck: &'a Checkpoint,
    /// Bytes loaded so far (for the load log).
    pub bytes: usize,
}

impl<'a> WeightLoader<'a> {
    pub fn new(ck: &'a Checkpoint) -> Self {
        WeightLoader { ck, bytes: 0 }
    }

    /// A full tensor name from its text-tower suffix, e.g. `model.norm.weight`.
    pub fn text(suffix: &str) -> String {
        format!("{TEXT_PREFIX}{suffix}")
    }

    /// A BF16/F32 tensor as an f32 array of the checkpoint's shape, checked against `shape`.
    pub fn dense(&mut self, name: &str, shape: &[usize]) -> Result<Array> {
        let v = self.ck.f32(name, shape).with_context(|| format!("loading {name}"))?;
        self.bytes += v.len() * 4;
        array_f32(&v, shape, name)
    }

    /// `model.layers.{l}.{suffix}`.
    pub fn layer(&mut self, l: usize, suffix: &str, shape: &[usize]) -> Result<Array> {
        self.dense(&layer_tensor(l, suffix), shape)
    }

    /// The first `n` entries of a padded 1-D tensor (`A_log`).
    pub fn layer_prefix(&mut self, l: usize, suffix: &str, n: usize) -> Result<Array> {
        let name = layer_tensor(l, suffix);
        let v = self.ck.f32_prefix(&name, n).with_context(|| format!("loading {name}"))?;
        array_f32(&v, &[n], &name)
    }

    /// All routed experts' `w` ("w1" gate, "w3" up, "w2" down) of layer `l` as one MXFP4 stack.
    pub fn experts(&mut self, l: usize, n_experts: usize, w: &str, out: usize, inp: usize) -> Result<Mxfp4Array> {
        let mut parts = Vec::with_capacity(n_experts);
        for e in 0..n_experts {
            let m = self.ck.expert(l, e, w).with_context(|| format!("loading {}", expert_tensor(l, e, w, "weight_packed")))?;
            if m.out_features != out || m.in_features != inp {
                anyhow::bail!(
                    "{}: logical shape [{}, {}], expected [{out}, {inp}]",
                    expert_tensor(l, e, w, "weight_packed"),
                    m.out_features,
                    m.in_features
                );
            }
            parts.push((m.packed, m.scale));
        }
        let stack = Mxfp4Array::from_compressed(&parts, out, inp, &layer_tensor(l, &format!("block_sparse_moe.experts.*.{w}")))?;
        self.bytes += stack.nbytes();
        Ok(stack)
    }
}
