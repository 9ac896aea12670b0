//! k3-decode: the decoder node's library.

pub mod cli;
pub mod vision;
