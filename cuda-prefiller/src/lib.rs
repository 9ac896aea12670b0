//! k3-prefill: the GPU node's library.

pub mod cli;
