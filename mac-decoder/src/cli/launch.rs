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
//! to stderr). When one rank fails, the others are stopped and the launcher fails naming it,
//! with that rank's exit status.
//!
//! Signals: the ranks run in their own process group (a terminal's Ctrl-C reaches only the
//! launcher) and, on Linux, get SIGTERM if the launcher dies. SIGTERM, SIGINT and SIGHUP to the
//! launcher are forwarded to rank 0 first (a `serve` rank 0 shuts down and stops its followers
//! itself), after [`GRACE`] to every rank still running, after another [`GRACE`] the rest are
//! killed; the launcher then exits with rank 0's status (a rank ended by signal S: 128 + S).

#![cfg_attr(not(feature = "mlx"), allow(dead_code, unused_imports))]

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

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

/// How long the ranks get after a forwarded signal before the next step (signal to every rank,
/// then SIGKILL).
pub const GRACE: Duration = Duration::from_secs(10);

/// The last of SIGTERM/SIGINT/SIGHUP the launcher received (0: none).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

/// The launcher's exit status for a rank's: its exit code, or 128 + the signal that ended it.
fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1)
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
    let mut tmp: Option<tempfile::TempDir> = None;
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
            tmp = Some(dir);
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
        bail!(
            "no rank of {} has a loopback address: start each rank on its host with the commands above (or name them with --local-ranks)",
            hostfile.display()
        );
    }

    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        unsafe { libc::signal(sig, on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t) };
    }
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(local.len());
    for &r in &local {
        let mut cmd = Command::new(&exe);
        cmd.args(&args.command).env(crate::distributed::ENV_RANK, r.to_string());
        for (k, v) in &env {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::null()).stdout(if r == 0 { Stdio::inherit() } else { Stdio::null() });
        {
            use std::os::unix::process::CommandExt;
            // own process group: a terminal's Ctrl-C reaches the launcher, which forwards it
            cmd.process_group(0);
            #[cfg(target_os = "linux")]
            // SAFETY: prctl is async-signal-safe; the child gets SIGTERM when the launcher dies.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        match cmd.spawn() {
            Ok(c) => children.push((r, c)),
            Err(e) => {
                stop_all(&mut children);
                return Err(e).with_context(|| format!("starting rank {r} ({})", exe.display()));
            }
        }
    }
    tracing::info!(ranks = n, local = ?local, hostfile = %hostfile.display(), "decoder ranks started");
    let code = wait_ranks(children);
    drop(tmp);
    match code {
        Ok(()) => Ok(()),
        Err((code, msg)) => {
            eprintln!("k3-decode: error: {msg}");
            std::process::exit(code);
        }
    }
}

/// Waits for the local ranks, forwarding the launcher's signals; the first failure stops the
/// rest. `Err((exit status, message))` when the launch failed or was stopped by a signal.
fn wait_ranks(mut children: Vec<(usize, Child)>) -> std::result::Result<(), (i32, String)> {
    let first_local = children.first().map(|(r, _)| *r).unwrap_or(0);
    let mut failure: Option<(i32, String)> = None;
    // after a signal: (the signal, when it was forwarded, escalation steps taken)
    let mut forwarded: Option<(i32, Instant, u8)> = None;
    let mut lead_status: Option<ExitStatus> = None;
    let send = |children: &[(usize, Child)], sig: i32, only_lead: bool| {
        for (r, c) in children {
            if !only_lead || *r == first_local {
                // SAFETY: a signal to our own, not yet reaped child
                unsafe { libc::kill(c.id() as libc::pid_t, sig) };
            }
        }
    };
    while !children.is_empty() {
        let sig = SIGNALLED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            match forwarded {
                None => {
                    tracing::warn!(signal = sig, rank = first_local, "forwarding the signal to rank {first_local}");
                    send(&children, sig, true);
                    forwarded = Some((sig, Instant::now(), 0));
                }
                // a second signal: every rank at once
                Some((s, t, _)) => {
                    send(&children, sig, false);
                    forwarded = Some((s, t, 1));
                }
            }
        }
        if let Some((s, t, step)) = forwarded {
            if step == 0 && t.elapsed() > GRACE {
                tracing::warn!(signal = s, "ranks still running {GRACE:?} after the signal: forwarding it to every rank");
                send(&children, s, false);
                forwarded = Some((s, t, 1));
            } else if step == 1 && t.elapsed() > 2 * GRACE {
                tracing::error!("ranks still running {:?} after the signal: killing them", 2 * GRACE);
                stop_all(&mut children);
                break;
            }
        }
        let mut i = 0;
        while i < children.len() {
            let (r, child) = &mut children[i];
            match child.try_wait() {
                Ok(Some(status)) => {
                    let r = *r;
                    children.remove(i);
                    if r == first_local {
                        lead_status = Some(status);
                    }
                    if forwarded.is_none() && !status.success() && failure.is_none() {
                        failure = Some((exit_code(status), format!("rank {r} failed ({})", describe(status))));
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
                    return Err((1, format!("waiting for rank {r}: {e}")));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some((sig, _, _)) = forwarded {
        return match lead_status {
            Some(st) if st.success() => Ok(()),
            Some(st) => Err((exit_code(st), format!("stopped by signal {sig}: rank {first_local} ended with {}", describe(st)))),
            None => Err((128 + sig, format!("stopped by signal {sig}: rank {first_local} had to be killed"))),
        };
    }
    match failure {
        Some((code, f)) => Err((code, format!("{f}; the other ranks were stopped"))),
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
