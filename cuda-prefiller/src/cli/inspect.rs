//! `k3-prefill inspect`.

/// Arguments of `k3-prefill inspect` (to be filled in by the owner of this command).
#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("k3-prefill inspect is not implemented yet")
}
