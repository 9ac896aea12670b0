//! Decoder ranks: several `k3-decode` processes (one per Mac, or several on one machine) form
//! one MLX distributed group and decode as one model (see `docs/multi-mac.md`).
//!
//! The group is MLX's own (mlx-c's `mlx_distributed_init`, reached through `mlx_sys` because
//! mlx-rs 0.33 has no safe wrapper): the ring backend (TCP) reads `MLX_RANK` and `MLX_HOSTFILE`
//! as `mlx.launch` sets them; on macOS JACCL (RDMA over Thunderbolt) can be chosen with
//! `K3_DIST_BACKEND=jaccl` and MLX's JACCL variables. Without `MLX_RANK`/`MLX_HOSTFILE` the
//! process is a group of one and nothing here does any communication.
//!
//! Every rank runs the same command on the same inputs (SPMD). The model splits the routed
//! experts by expert ([`expert_range`]); the MoE output is combined with [`Group::all_sum`];
//! the token fed at each step is rank 0's ([`Group::all_gather`] also checks that the ranks
//! agree). Collectives of the ring backend block forever when a peer dies, so every evaluation
//! that contains a collective runs under the [`watchdog`].

pub mod watchdog;

use std::ffi::CString;
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use mlx_rs::{Array, Stream};

/// The environment variables of MLX's ring backend.
pub const ENV_RANK: &str = "MLX_RANK";
pub const ENV_HOSTFILE: &str = "MLX_HOSTFILE";
/// Backend name passed to `mlx_distributed_init` (default `ring`).
pub const ENV_BACKEND: &str = "K3_DIST_BACKEND";
/// Seconds a decode step may wait on its peers (a prefill chunk of T tokens: 1 + ⌈T/16⌉ times it).
pub const ENV_STEP_TIMEOUT: &str = "K3_RANK_TIMEOUT_S";
/// Seconds the group may take to form and the ranks may take to load the model.
pub const ENV_START_TIMEOUT: &str = "K3_RANK_START_TIMEOUT_S";

const DEFAULT_STEP_TIMEOUT_S: f64 = 30.0;
const DEFAULT_START_TIMEOUT_S: f64 = 900.0;

/// An MLX distributed group (a group of one when the process was not started as a rank).
pub struct Group {
    raw: Option<mlx_sys::mlx_distributed_group>,
    rank: usize,
    size: usize,
    backend: String,
    /// The hostfile's addresses, one list per rank (empty for a group of one).
    hosts: Vec<Vec<String>>,
    step_timeout: Duration,
    start_timeout: Duration,
}

// SAFETY: the handle points at an immutable `mlx::core::distributed::Group` (a shared pointer to
// the backend); the collectives are only queued from the thread that evaluates the model.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

fn env_secs(name: &str, default: f64) -> Result<Duration> {
    match std::env::var(name) {
        Err(_) => Ok(Duration::from_secs_f64(default)),
        Ok(v) => {
            let s: f64 = v.trim().parse().with_context(|| format!("{name}={v:?} is not a number of seconds"))?;
            if !(s > 0.0 && s.is_finite()) {
                bail!("{name}={v:?} must be a positive number of seconds");
            }
            Ok(Duration::from_secs_f64(s))
        }
    }
}

/// The process's group, formed on first use from the environment (like MLX's own
/// `distributed::init`). Forming a ring blocks until every rank has connected; that wait runs
/// under the watchdog with the start timeout.
pub fn world() -> Result<&'static Group> {
    static WORLD: OnceLock<std::result::Result<Group, std::sync::Arc<anyhow::Error>>> = OnceLock::new();
    WORLD.get_or_init(|| Group::from_env().map_err(std::sync::Arc::new)).as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))
}

impl Group {
    fn from_env() -> Result<Group> {
        let step_timeout = env_secs(ENV_STEP_TIMEOUT, DEFAULT_STEP_TIMEOUT_S)?;
        let start_timeout = env_secs(ENV_START_TIMEOUT, DEFAULT_START_TIMEOUT_S)?;
        let backend = std::env::var(ENV_BACKEND).unwrap_or_else(|_| "ring".into());
        let (rank, hostfile) = (std::env::var(ENV_RANK).ok(), std::env::var(ENV_HOSTFILE).ok());
        let (Some(rank_s), Some(hostfile)) = (rank, hostfile) else {
            return Ok(Group { raw: None, rank: 0, size: 1, backend, hosts: Vec::new(), step_timeout, start_timeout });
        };
        let rank: usize = rank_s.trim().parse().with_context(|| format!("{ENV_RANK}={rank_s:?} is not a rank number"))?;
        let hosts = read_hostfile(std::path::Path::new(&hostfile))?;
        if rank >= hosts.len() {
            bail!("{ENV_RANK}={rank} but the hostfile {hostfile} lists {} ranks", hosts.len());
        }
        if hosts.len() == 1 {
            return Ok(Group { raw: None, rank: 0, size: 1, backend, hosts: Vec::new(), step_timeout, start_timeout });
        }
        crate::mlx::ensure_error_handler();
        let bk = CString::new(backend.clone()).context("backend name")?;
        let what = format!("forming the {backend} group as rank {rank} of {} ({hostfile})", hosts.len());
        let _guard = watchdog::guard(&what, start_timeout);
        // SAFETY: an empty group handle filled by mlx_distributed_init; failure frees nothing
        // that was allocated (the handle stays empty).
        let mut g = unsafe { mlx_sys::mlx_distributed_group_new() };
        let status = unsafe { mlx_sys::mlx_distributed_init(&mut g, true, bk.as_ptr()) };
        if status != 0 || g.ctx.is_null() {
            bail!("{what}: MLX could not form the group (status {status}; see MLX's message above)");
        }
        let (r, n) = unsafe { (mlx_sys::mlx_distributed_group_rank(g), mlx_sys::mlx_distributed_group_size(g)) };
        if r as usize != rank || n as usize != hosts.len() {
            bail!("{what}: MLX formed rank {r} of {n}");
        }
        tracing::info!(rank, size = n, backend = %backend, "joined the decoder ranks");
        Ok(Group { raw: Some(g), rank, size: n as usize, backend, hosts, step_timeout, start_timeout })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn size(&self) -> usize {
        self.size
    }
    pub fn is_distributed(&self) -> bool {
        self.size > 1
    }
    pub fn backend(&self) -> &str {
        &self.backend
    }
    /// The hostfile's `host:port` addresses of `rank` (empty in a group of one).
    pub fn addresses(&self, rank: usize) -> &[String] {
        self.hosts.get(rank).map_or(&[], Vec::as_slice)
    }
    /// How long one decode step may wait on its peers.
    pub fn step_timeout(&self) -> Duration {
        self.step_timeout
    }
    /// How long forming the group and the slowest rank's load may take.
    pub fn start_timeout(&self) -> Duration {
        self.start_timeout
    }

    fn collective(&self, what: &str, x: &Array, op: CollectiveOp) -> Result<Array> {
        let Some(g) = self.raw else {
            return Ok(x.clone());
        };
        // the ring backend runs on the CPU stream (also on a Mac; memory is unified)
        let stream = Stream::cpu();
        crate::mlx::run_op(what, |res| unsafe {
            match op {
                CollectiveOp::Sum => mlx_sys::mlx_distributed_all_sum(res, x.as_ptr(), g, stream.as_ptr()),
                CollectiveOp::Gather => mlx_sys::mlx_distributed_all_gather(res, x.as_ptr(), g, stream.as_ptr()),
            }
        })
    }

    /// Element-wise sum over the ranks (lazy: runs when the result is evaluated). A group of one
    /// returns `x`.
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        self.collective("distributed all_sum", x, CollectiveOp::Sum)
    }

    /// The ranks' arrays concatenated on the first axis in rank order (lazy).
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        self.collective("distributed all_gather", x, CollectiveOp::Gather)
    }

    /// Rank 0's `values` on every rank: the others pass `None` and the length rank 0 uses
    /// (an all_sum where they contribute zeros). Blocks until every rank takes part.
    pub fn broadcast_i32(&self, values: Option<&[i32]>, len: usize) -> Result<Vec<i32>> {
        if let Some(v) = values {
            if v.len() != len {
                bail!("broadcast of {} values announced as {len}", v.len());
            }
        }
        if !self.is_distributed() || len == 0 {
            return Ok(values.map(<[i32]>::to_vec).unwrap_or_else(|| vec![0; len]));
        }
        let zeros;
        let data = match values {
            Some(v) if self.rank == 0 => v,
            _ => {
                zeros = vec![0i32; len];
                &zeros[..]
            }
        };
        let s = self.all_sum(&Array::from_slice(data, &[len as i32]))?;
        s.eval()?;
        Ok(s.as_slice::<i32>().to_vec())
    }

    /// Waits until every rank gets here (an all_sum of one value, evaluated under the watchdog).
    pub fn barrier(&self, what: &str, timeout: Duration) -> Result<()> {
        if !self.is_distributed() {
            return Ok(());
        }
        let _guard = watchdog::guard(&format!("rank {} waiting for every rank: {what}", self.rank), timeout);
        let s = self.all_sum(&Array::from_slice(&[1i32], &[1]))?;
        s.eval()?;
        let n = s.as_slice::<i32>()[0];
        if n as usize != self.size {
            bail!("barrier '{what}': {n} ranks answered, the group has {}", self.size);
        }
        Ok(())
    }
}

/// Ends a rank that failed: prints the error like `exit_on_error` and leaves with `_exit(1)`.
/// After a peer is lost MLX's ring threads are in a failed state, and running the process's
/// destructors can crash (seen: SIGSEGV at exit); a single process returns and exits normally.
pub fn exit_rank_on_error(bin: &str, res: &Result<()>) {
    let in_group = std::env::var_os(ENV_RANK).is_some() && std::env::var_os(ENV_HOSTFILE).is_some();
    if let (true, Err(e)) = (in_group, res) {
        eprintln!("{bin}: error: {e:#}");
        // SAFETY: ends the process at once; nothing is left to flush but stderr (unbuffered).
        unsafe { libc::_exit(1) };
    }
}

#[derive(Clone, Copy)]
enum CollectiveOp {
    Sum,
    Gather,
}

/// The contiguous block of routed experts a rank holds (the fit planner's split).
pub use k3_protocol::fit::expert_range;

/// A ring hostfile: one entry per rank, each a list of `host:port` addresses.
pub fn read_hostfile(path: &std::path::Path) -> Result<Vec<Vec<String>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the hostfile {}", path.display()))?;
    let hosts: Vec<Vec<String>> = serde_json::from_str(&text)
        .with_context(|| format!("{}: a ring hostfile is a JSON list with one list of \"host:port\" strings per rank", path.display()))?;
    if hosts.is_empty() {
        bail!("{}: the hostfile lists no ranks", path.display());
    }
    for (r, h) in hosts.iter().enumerate() {
        if h.is_empty() {
            bail!("{}: rank {r} has no address", path.display());
        }
        for a in h {
            match a.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {}
                _ => bail!("{}: rank {r}: {a:?} is not host:port", path.display()),
            }
        }
        if h.len() != hosts[0].len() {
            bail!("{}: rank {r} has {} addresses, rank 0 has {} (the ring wants as many on every rank)", path.display(), h.len(), hosts[0].len());
        }
    }
    Ok(hosts)
}
