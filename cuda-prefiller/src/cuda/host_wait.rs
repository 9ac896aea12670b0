//! Host time blocked on the GPU, by profiling step: every call of [`super::gpu::Gpu`] that blocks
//! the calling thread (the compute stream's host <-> device copies and synchronisations) reports
//! here through [`host_blocked`]. With `--profile` ([`super::gpu::Gpu::profile`], passed in by the
//! caller) the waits are summed by kind and by the step [`super::profile::begin`] entered last
//! ([`host_report`]); any single wait over 2 ms is logged (tracing, debug level) whether or not
//! profiling is on.
//!
//! Below [`super::gpu`] (it needs no GPU): the profiler's event marks, which do, live in
//! [`super::profile`] and set the current step here.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

struct Waits {
    /// The step begun last.
    current: &'static str,
    /// (what, step) → (calls, seconds, bytes) of host time blocked on the GPU.
    host: BTreeMap<(&'static str, &'static str), (usize, f64, usize)>,
}

fn waits() -> &'static Mutex<Waits> {
    static W: OnceLock<Mutex<Waits>> = OnceLock::new();
    W.get_or_init(|| Mutex::new(Waits { current: "-", host: BTreeMap::new() }))
}

/// Makes `name` the current step; returns the step it ends.
pub fn enter_step(name: &'static str) -> &'static str {
    let mut w = waits().lock().unwrap_or_else(|e| e.into_inner());
    std::mem::replace(&mut w.current, name)
}

/// Drops the sums and the current step.
pub fn reset() {
    let mut w = waits().lock().unwrap_or_else(|e| e.into_inner());
    w.current = "-";
    w.host.clear();
}

/// The calling thread was blocked for `d` in `what` (a copy of `bytes` bytes, or a
/// synchronisation): summed per step when `on` (the GPU's `--profile`); logged when over 2 ms.
pub fn host_blocked(on: bool, what: &'static str, bytes: usize, d: std::time::Duration) {
    if !on && d.as_micros() < 2000 {
        return;
    }
    let mut w = waits().lock().unwrap_or_else(|e| e.into_inner());
    let step = w.current;
    if d.as_micros() >= 2000 {
        tracing::debug!(what, step, bytes, ms = d.as_secs_f64() * 1e3, "host blocked on the GPU");
    }
    if on {
        let e = w.host.entry((what, step)).or_default();
        e.0 += 1;
        e.1 += d.as_secs_f64();
        e.2 += bytes;
    }
}

/// Host time blocked on the GPU since the last [`reset`]: `(what, step, calls, ms, bytes)`,
/// largest first; empty unless profiling.
pub fn host_report() -> Vec<(&'static str, &'static str, usize, f64, usize)> {
    let w = waits().lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<_> = w.host.iter().map(|(&(what, s), &(c, secs, b))| (what, s, c, secs * 1e3, b)).collect();
    v.sort_by(|a, b| b.3.total_cmp(&a.3));
    v
}
