//! `k3-prefill synth`.

/// Arguments of `k3-prefill synth` (to be filled in by the owner of this command).
#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("k3-prefill synth is not implemented yet")
}
