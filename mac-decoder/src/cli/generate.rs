//! `k3-decode generate`.

/// Arguments of `k3-decode generate` (to be filled in by the owner of this command).
#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("k3-decode generate is not implemented yet")
}
