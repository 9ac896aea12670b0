//! `k3-prefill`: the GPU node of k3-offload.

use clap::{Parser, Subcommand};
use cuda_prefiller::cli;

#[derive(Parser)]
#[command(name = "k3-prefill", version, about = "Kimi K3 layer-major prefill node (CUDA or CPU reference)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a random K3 model in the exact release layout.
    Synth(cli::synth::Args),
    /// Load and validate a checkpoint; print its plan and derived sizes.
    Inspect(cli::inspect::Args),
    /// Prefill one prompt; write logits and the hand-off state (golden tensor names).
    Forward(cli::forward::Args),
    /// Prefill throughput benchmark.
    Bench(cli::bench::Args),
    /// Serve prefill requests from paired decoders over QUIC.
    Serve(cli::serve::Args),
    /// Collect routed-expert statistics (REAP saliency, frequency, gate) over a prompt set.
    Calibrate(cli::calibrate::Args),
    /// Write a checkpoint pruned to the best routed experts by calibration statistics.
    Prune(cli::prune::Args),
}

fn main() {
    k3_protocol::process::init_logging();
    let res = match Cli::parse().cmd {
        Cmd::Synth(a) => cli::synth::run(a),
        Cmd::Inspect(a) => cli::inspect::run(a),
        Cmd::Forward(a) => cli::forward::run(a),
        Cmd::Bench(a) => cli::bench::run(a),
        Cmd::Serve(a) => cli::serve::run(a),
        Cmd::Calibrate(a) => cli::calibrate::run(a),
        Cmd::Prune(a) => cli::prune::run(a),
    };
    k3_protocol::process::exit_on_error("k3-prefill", res);
}
