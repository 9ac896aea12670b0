//! Where each byte of a routed expert sits: the slot layout of an expert arena (the six MXFP4
//! tensors of one expert, 16-byte aligned, in checkpoint order), shared by the CUDA backend that
//! multiplies from the arena and the weight streamer's plan that fills it. No GPU needed.

use anyhow::{ensure, Result};

use crate::backend::ExpertHostWeights;

/// Where one matrix of an expert sits inside an expert's arena slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatOff {
    pub packed: usize,
    pub scale: usize,
}

/// Byte layout of one expert inside an expert arena (all offsets 16-byte aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    /// `moe_intermediate_size`.
    pub inter: usize,
    /// `routed_expert_hidden_size` (latent width).
    pub latent: usize,
    pub w1: MatOff,
    pub w3: MatOff,
    pub w2: MatOff,
    /// Bytes per expert slot.
    pub stride: usize,
}

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl ExpertLayout {
    pub fn new(inter: usize, latent: usize) -> Result<Self> {
        ensure!(inter.is_multiple_of(32) && latent.is_multiple_of(32), "expert widths {inter}/{latent} must be multiples of 32 (MXFP4 groups)");
        let up = inter * latent / 2; // packed bytes of one [inter, latent] matrix
        let us = inter * latent / 32;
        let mut off = 0;
        let mut next = |n: usize| {
            let o = off;
            off = align(off + n, 16);
            o
        };
        // checkpoint order (w1, w2, w3; each packed then scale), so that a run of experts is one
        // contiguous range in both the shard and the slot arena (one copy instead of six per expert)
        let w1 = MatOff { packed: next(up), scale: next(us) };
        let w2 = MatOff { packed: next(up), scale: next(us) };
        let w3 = MatOff { packed: next(up), scale: next(us) };
        Ok(ExpertLayout { inter, latent, w1, w3, w2, stride: align(off, 256) })
    }

    /// The (name, byte offset in slot, bytes) of the six tensors of an expert, in checkpoint order.
    pub fn parts(&self) -> [(&'static str, &'static str, usize, usize); 6] {
        let up = self.inter * self.latent / 2;
        let us = self.inter * self.latent / 32;
        [
            ("w1", "weight_packed", self.w1.packed, up),
            ("w1", "weight_scale", self.w1.scale, us),
            ("w2", "weight_packed", self.w2.packed, up),
            ("w2", "weight_scale", self.w2.scale, us),
            ("w3", "weight_packed", self.w3.packed, up),
            ("w3", "weight_scale", self.w3.scale, us),
        ]
    }

    /// Writes one expert's six tensors into `slot` (at least `stride` bytes).
    pub fn fill_slot(&self, e: &ExpertHostWeights<'_>, slot: &mut [u8]) -> Result<()> {
        let mats = [(&e.w1, self.inter, self.latent, self.w1), (&e.w3, self.inter, self.latent, self.w3), (&e.w2, self.latent, self.inter, self.w2)];
        for (w, out_f, in_f, off) in mats {
            ensure!(
                w.out_features == out_f && w.in_features == in_f,
                "expert weight [{}, {}] does not match the layer's [{out_f}, {in_f}]",
                w.out_features,
                w.in_features
            );
            slot[off.packed..off.packed + w.packed.len()].copy_from_slice(w.packed);
            slot[off.scale..off.scale + w.scale.len()].copy_from_slice(w.scale);
        }
        Ok(())
    }
}
