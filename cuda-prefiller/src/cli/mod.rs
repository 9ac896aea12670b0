//! The `k3-prefill` subcommands, one module each.

pub mod bench;
pub mod bench_elementwise;
pub mod bench_kernels;
pub mod calibrate;
pub mod forward;
pub mod inspect;
pub mod prune;
pub mod serve;
pub mod synth;
