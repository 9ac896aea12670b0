//! Elementwise activations: logistic sigmoid, SiLU, softplus, SiTU-GLU (spec §3.6), on the host.
//! Below both the model (the host-side gate of `model::kda`) and the CPU reference backend.

use rayon::prelude::*;

/// `σ(x) = 1 / (1 + e^{−x})`, stable for large |x|.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `x · σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + e^x)`, stable.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// One SiTU-GLU value: `β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂)` (linear up branch if `β₂` is None).
#[inline]
pub fn situ(g: f32, u: f32, beta: f32, linear_beta: Option<f32>) -> f32 {
    let gate = beta * (g / beta).tanh() * sigmoid(g);
    let up = match linear_beta {
        Some(b2) => b2 * (u / b2).tanh(),
        None => u,
    };
    gate * up
}

/// SiTU-GLU of two equal-length arrays.
pub fn situ_glu(gate: &[f32], up: &[f32], beta: f32, linear_beta: Option<f32>) -> Vec<f32> {
    assert_eq!(gate.len(), up.len(), "situ_glu: gate and up differ in size");
    gate.par_iter().zip(up.par_iter()).with_min_len(4096).map(|(&g, &u)| situ(g, u, beta, linear_beta)).collect()
}

/// `σ(x)` of every element.
pub fn sigmoid_all(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| sigmoid(v)).collect()
}

/// `a ⊙ σ(gate)` in place.
pub fn sigmoid_gate_mul(a: &mut [f32], gate: &[f32]) {
    assert_eq!(a.len(), gate.len(), "sigmoid_gate_mul: sizes differ");
    for (x, &g) in a.iter_mut().zip(gate) {
        *x *= sigmoid(g);
    }
}
