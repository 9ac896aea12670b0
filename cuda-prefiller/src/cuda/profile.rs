//! Where a prefill's GPU time goes: with `--profile` ([`Gpu::profile`]), every op of the CUDA backend calls
//! [`begin`] with its step name, which records an event on the compute stream; [`report`] sums
//! the time between consecutive events by step name (the GPU time of the kernels issued in that
//! step, the compute stream being in order; a GPU left idle by the host is charged to the step
//! before). Off by default: no events, no cost.
//!
//! The host side (time the calling thread spends blocked on the GPU, by the step entered here)
//! is kept by [`super::host_wait`], below the GPU wrapper that reports it.

use std::sync::{Mutex, OnceLock};

use anyhow::Result;

use super::gpu::{Event, Gpu};
use super::host_wait;

/// (step that ended at this event, event)
fn marks() -> &'static Mutex<Vec<(&'static str, Event)>> {
    static M: OnceLock<Mutex<Vec<(&'static str, Event)>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(Vec::new()))
}

/// Records the start of step `name` on the compute stream, ending the step begun before (a
/// no-op unless [`Gpu::profile`]); `"-"` ends the step before without starting one.
pub fn begin(g: &Gpu, name: &'static str) -> Result<()> {
    if !g.profile {
        return Ok(());
    }
    let e = g.event()?;
    e.record(g.stream())?;
    // Holding the marks while the step changes keeps the event order and the step order one.
    let mut m = marks().lock().unwrap_or_else(|e| e.into_inner());
    let prev = host_wait::enter_step(name);
    m.push((prev, e));
    Ok(())
}

/// Drops every mark recorded so far (and the host-wait sums).
pub fn reset() {
    let mut m = marks().lock().unwrap_or_else(|e| e.into_inner());
    m.clear();
    host_wait::reset();
}

/// Milliseconds per step name since the last [`reset`] (waits for the marks to complete), largest
/// first; empty unless profiling.
pub fn report() -> Result<Vec<(&'static str, f64)>> {
    let m = std::mem::take(&mut *marks().lock().unwrap_or_else(|e| e.into_inner()));
    let mut sums: std::collections::BTreeMap<&'static str, f64> = Default::default();
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
