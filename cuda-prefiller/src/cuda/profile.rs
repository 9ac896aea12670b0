//! Where a prefill's GPU time goes: with `K3_PROFILE=1`, every op of the CUDA backend calls
//! [`begin`] with its step name, which records an event on the compute stream; [`report`] sums
//! the time between consecutive events by step name (the GPU time of the kernels issued in that
//! step, the compute stream being in order; a GPU left idle by the host is charged to the step
//! before). Off by default: no events, no cost.
//!
//! The host side too: every call that blocks the calling thread on the GPU (the compute stream's
//! host <-> device copies and synchronisations, [`host_blocked`]) is timed; with `K3_PROFILE=1`
//! [`host_report`] sums them by kind and step, and any single wait over 2 ms is logged (tracing,
//! debug level) whether or not profiling is on.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use anyhow::Result;

use super::gpu::{Event, Gpu};

struct Marks {
    /// (step that ended at this event, event)
    events: Vec<(&'static str, Event)>,
    /// The step begun last.
    current: &'static str,
    /// (what, step) → (calls, seconds, bytes) of host time blocked on the GPU.
    host: BTreeMap<(&'static str, &'static str), (usize, f64, usize)>,
}

fn marks() -> &'static Mutex<Marks> {
    static M: OnceLock<Mutex<Marks>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(Marks { events: Vec::new(), current: "-", host: BTreeMap::new() }))
}

/// True when `K3_PROFILE` is set to something other than `0`.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("K3_PROFILE").map(|v| v != "0" && !v.is_empty()).unwrap_or(false))
}

/// Records the start of step `name` on the compute stream, ending the step begun before (a
/// no-op unless [`enabled`]); `"-"` ends the step before without starting one.
pub fn begin(g: &Gpu, name: &'static str) -> Result<()> {
    if !enabled() {
        return Ok(());
    }
    let e = g.event()?;
    e.record(g.stream())?;
    let mut m = marks().lock().unwrap_or_else(|e| e.into_inner());
    let prev = std::mem::replace(&mut m.current, name);
    m.events.push((prev, e));
    Ok(())
}

/// Drops every mark recorded so far.
pub fn reset() {
    let mut m = marks().lock().unwrap_or_else(|e| e.into_inner());
    m.events.clear();
    m.current = "-";
    m.host.clear();
}

/// The calling thread was blocked for `d` in `what` (a copy of `bytes` bytes, or a
/// synchronisation): summed per step while profiling; logged when over 2 ms.
pub fn host_blocked(what: &'static str, bytes: usize, d: std::time::Duration) {
    let on = enabled();
    if !on && d.as_micros() < 2000 {
        return;
    }
    let mut m = marks().lock().unwrap_or_else(|e| e.into_inner());
    let step = m.current;
    if d.as_micros() >= 2000 {
        tracing::debug!(what, step, bytes, ms = d.as_secs_f64() * 1e3, "host blocked on the GPU");
    }
    if on {
        let e = m.host.entry((what, step)).or_default();
        e.0 += 1;
        e.1 += d.as_secs_f64();
        e.2 += bytes;
    }
}

/// Host time blocked on the GPU since the last [`reset`]: `(what, step, calls, ms, bytes)`,
/// largest first; empty unless [`enabled`].
pub fn host_report() -> Vec<(&'static str, &'static str, usize, f64, usize)> {
    let m = marks().lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<_> = m.host.iter().map(|(&(w, s), &(c, secs, b))| (w, s, c, secs * 1e3, b)).collect();
    v.sort_by(|a, b| b.3.total_cmp(&a.3));
    v
}

/// Milliseconds per step name since the last [`reset`] (waits for the marks to complete), largest
/// first; empty unless [`enabled`].
pub fn report() -> Result<Vec<(&'static str, f64)>> {
    let m = std::mem::take(&mut marks().lock().unwrap_or_else(|e| e.into_inner()).events);
    let mut sums: BTreeMap<&'static str, f64> = BTreeMap::new();
    if let Some((_, last)) = m.last() {
        last.sync()?;
    }
    for w in m.windows(2) {
        let (name, ref end) = w[1];
        if name == "-" {
            continue;
        }
        *sums.entry(name).or_default() += w[0].1.ms_to(end)? as f64;
    }
    let mut v: Vec<_> = sums.into_iter().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok(v)
}
