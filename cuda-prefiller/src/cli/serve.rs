//! `k3-prefill serve`.

/// Arguments of `k3-prefill serve` (to be filled in by the owner of this command).
#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("k3-prefill serve is not implemented yet")
}
