//! The `k3-prefill` subcommands, one module each.

pub mod backend_args;
pub mod bench;
pub mod bench_elementwise;
pub mod bench_kernels;
pub mod calibrate;
pub mod forward;
pub mod inspect;
pub mod prune;
pub mod serve;
pub mod synth;

/// Parses one subcommand's arguments (`argv[0]` is its name) as the binary does: the unit tests
/// of the subcommands use it.
#[cfg(test)]
pub(crate) fn parse_args<A: clap::Args + clap::FromArgMatches>(argv: &[&str]) -> Result<A, clap::Error> {
    let matches = A::augment_args(clap::Command::new("k3-prefill")).try_get_matches_from(argv)?;
    A::from_arg_matches(&matches)
}
