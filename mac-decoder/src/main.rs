//! `k3-decode`: the decoder node of k3-offload.

use clap::{Parser, Subcommand};
use mac_decoder::cli;

#[derive(Parser)]
#[command(name = "k3-decode", version, about = "Kimi K3 decoder node (MLX)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate tokens from a prompt (local or remote prefill) or from a hand-off state.
    Generate(cli::generate::Args),
    /// Encode an image with MoonViT-V2 and the projector.
    EncodeImage(cli::encode_image::Args),
    /// OpenAI- and Anthropic-compatible HTTP server (chat completions, completions, responses, messages) for agents and SDKs.
    Serve(cli::serve::Args),
    /// Print the prompt (text, segments, ids) of an OpenAI chat request as the server renders it.
    Render(cli::render::RenderArgs),
    /// Print how the server reads generated ids after a request's prompt.
    Parse(cli::render::ParseArgs),
    /// Start decoder ranks (one model over several processes/Macs): `launch --ranks N -- generate …`.
    Launch(cli::launch::Args),
}

fn main() {
    k3_protocol::process::init_logging();
    let res = match Cli::parse().cmd {
        Cmd::Generate(a) => cli::generate::run(a),
        Cmd::EncodeImage(a) => cli::encode_image::run(a),
        Cmd::Serve(a) => cli::serve::run(a),
        Cmd::Render(a) => cli::render::run_render(a),
        Cmd::Parse(a) => cli::render::run_parse(a),
        Cmd::Launch(a) => cli::launch::run(a),
    };
    #[cfg(feature = "mlx")]
    mac_decoder::distributed::exit_rank_on_error("k3-decode", &res);
    k3_protocol::process::exit_on_error("k3-decode", res);
}
