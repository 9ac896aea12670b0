//! The `k3-decode` subcommands, one module each.

pub mod encode_image;
pub mod generate;
pub mod launch;
pub mod prefill_node;
pub mod render;
pub mod serve;
