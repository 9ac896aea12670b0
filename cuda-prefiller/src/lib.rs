//! k3-prefill: the GPU node's library.

pub mod act;
pub mod backend;
pub mod calibrate;
pub mod cli;
pub mod cpu;
pub mod cuda;
pub mod executor;
pub mod expert_layout;
pub mod memory_plan;
pub mod model;
pub mod mx;
pub mod prefiller;
pub mod server;
pub mod source_pace;
pub mod stream_plan;
pub mod streamer;
