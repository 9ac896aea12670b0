//! `k3-prefill bench`.

/// Arguments of `k3-prefill bench` (to be filled in by the owner of this command).
#[derive(clap::Args, Debug)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("k3-prefill bench is not implemented yet")
}
