//! `k3-decode launch --ranks N [--hostfile F] -- <k3-decode command>`: starts the decoder
//! ranks of an MLX distributed group (see `docs/multi-mac.md`).
//!
//! Without a hostfile, N local processes on loopback: a ring hostfile with N free
//! `127.0.0.1:port` addresses is written to a temporary file and each rank gets `MLX_RANK` and
//! `MLX_HOSTFILE`, as `mlx.launch` does. With `--hostfile F` (MLX's ring format: a JSON list,
//! one list of `"host:port"` per rank) the command for every rank is printed, and the ranks whose
//! addresses are loopback (or the ones named by `--local-ranks`) are started here.
//!
//! Rank 0's stdout is the command's stdout; the other ranks' stdout is discarded (their log goes
//! to stderr). When one rank fails, the others are stopped and the launcher fails naming it.

#![cfg_attr(not(feature = "mlx"), allow(dead_code, unused_imports))]

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Arguments of `k3-decode launch`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Number of ranks (local processes on loopback without --hostfile).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// A ring hostfile (JSON list, one list of "host:port" per rank).
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// With --hostfile: the ranks to start on this machine (default: those with loopback
    /// addresses), comma separated.
    #[arg(long, value_delimiter = ',')]
    pub local_ranks: Vec<usize>,
    /// Only print the per-rank commands, start nothing.
    #[arg(long)]
    pub print_only: bool,
    /// Seconds one decode step may wait on its peers before a rank gives up
    /// (K3_RANK_TIMEOUT_S).
    #[arg(long)]
    pub step_timeout: Option<f64>,
    /// The k3-decode command every rank runs (after `--`).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Free loopback ports for a local ring (bound and released; the ranks bind them right after).
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<std::io::Result<_>>().context("finding free loopback ports")?;
    listeners.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_matches(|c| c == '[' || c == ']');
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("signal {s}"),
        _ => format!("{status}"),
    }
}

#[cfg(not(feature = "mlx"))]
pub fn run(_args: Args) -> Result<()> {
    bail!("k3-decode was built without the `mlx` feature; rebuild with default features to run decoder ranks")
}

#[cfg(feature = "mlx")]
pub fn run(args: Args) -> Result<()> {
    let exe = std::env::current_exe().context("locating the k3-decode binary")?;
    if args.command.first().is_some_and(|c| c == "launch") {
        bail!("launch cannot launch itself");
    }
    // the hostfile: given, or a loopback ring written to a temporary file
    let _tmp;
    let (hostfile, hosts) = match &args.hostfile {
        Some(f) => {
            let hosts = crate::distributed::read_hostfile(f)?;
            if let Some(n) = args.ranks {
                if n != hosts.len() {
                    bail!("--ranks {n} but {} lists {} ranks", f.display(), hosts.len());
                }
            }
            (std::fs::canonicalize(f).with_context(|| format!("resolving {}", f.display()))?, hosts)
        }
        None => {
            let n = args.ranks.context("give --ranks N (local ranks on loopback) or --hostfile F")?;
            if n == 0 {
                bail!("--ranks must be at least 1");
            }
            let hosts: Vec<Vec<String>> = free_ports(n)?.into_iter().map(|p| vec![format!("127.0.0.1:{p}")]).collect();
            let dir = tempfile::Builder::new().prefix("k3-ranks-").tempdir().context("creating a temporary directory for the hostfile")?;
            let path = dir.path().join("hostfile.json");
            std::fs::write(&path, serde_json::to_string(&hosts)?).with_context(|| format!("writing {}", path.display()))?;
            _tmp = dir;
            (path, hosts)
        }
    };
    let n = hosts.len();
    let local: Vec<usize> = if args.hostfile.is_none() {
        (0..n).collect()
    } else if !args.local_ranks.is_empty() {
        for &r in &args.local_ranks {
            if r >= n {
                bail!("--local-ranks {r}: the hostfile lists ranks 0..{}", n - 1);
            }
        }
        args.local_ranks.clone()
    } else {
        (0..n).filter(|&r| hosts[r].iter().all(|a| is_loopback(a))).collect()
    };
    let mut env: Vec<(String, String)> = vec![(crate::distributed::ENV_HOSTFILE.into(), hostfile.display().to_string())];
    if let Some(t) = args.step_timeout {
        env.push((crate::distributed::ENV_STEP_TIMEOUT.into(), t.to_string()));
    }
    if args.hostfile.is_some() || args.print_only {
        for (r, h) in hosts.iter().enumerate() {
            let vars: Vec<String> = env.iter().map(|(k, v)| format!("{k}={}", shell_quote(v))).collect();
            let cmd: Vec<String> = args.command.iter().map(|c| shell_quote(c)).collect();
            println!(
                "# rank {r} ({}){}\n{}={r} {} {} {}",
                h.join(", "),
                if local.contains(&r) && !args.print_only { ": started here" } else { "" },
                crate::distributed::ENV_RANK,
                vars.join(" "),
                shell_quote(&exe.display().to_string()),
                cmd.join(" ")
            );
        }
        if args.print_only {
            return Ok(());
        }
    }
    if local.is_empty() {
        bail!("no rank of {} has a loopback address: start each rank on its host with the commands above (or name them with --local-ranks)", hostfile.display());
    }

    let mut children: Vec<(usize, Child)> = Vec::with_capacity(local.len());
    for &r in &local {
        let mut cmd = Command::new(&exe);
        cmd.args(&args.command).env(crate::distributed::ENV_RANK, r.to_string());
        for (k, v) in &env {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null()).stdout(if r == 0 { Stdio::inherit() } else { Stdio::null() });
        match cmd.spawn() {
            Ok(c) => children.push((r, c)),
            Err(e) => {
                stop_all(&mut children);
                return Err(e).with_context(|| format!("starting rank {r} ({})", exe.display()));
            }
        }
    }
    tracing::info!(ranks = n, local = ?local, hostfile = %hostfile.display(), "decoder ranks started");

    // wait for all; the first failure stops the rest
    let mut failure: Option<String> = None;
    while !children.is_empty() {
        let mut i = 0;
        while i < children.len() {
            let (r, child) = &mut children[i];
            match child.try_wait() {
                Ok(Some(status)) => {
                    let r = *r;
                    children.remove(i);
                    if !status.success() && failure.is_none() {
                        failure = Some(format!("rank {r} failed ({})", describe(status)));
                        if !children.is_empty() {
                            tracing::error!(rank = r, status = %describe(status), "a rank failed: stopping the others");
                            stop_all(&mut children);
                        }
                    }
                }
                Ok(None) => i += 1,
                Err(e) => {
                    let r = *r;
                    stop_all(&mut children);
                    bail!("waiting for rank {r}: {e}");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match failure {
        Some(f) => bail!("{f}; the other ranks were stopped"),
        None => Ok(()),
    }
}

/// Kills and reaps the launcher's own child processes.
fn stop_all(children: &mut Vec<(usize, Child)>) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
    }
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
    children.clear();
}
