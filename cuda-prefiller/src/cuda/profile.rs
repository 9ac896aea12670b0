//! Where a prefill's GPU time goes: with `K3_PROFILE=1`, every op of the CUDA backend calls
//! [`begin`] with its step name, which records an event on the compute stream; [`report`] sums
//! the time between consecutive events by step name (the GPU time of the kernels issued in that
//! step, the compute stream being in order; a GPU left idle by the host is charged to the step
//! before). Off by default: no events, no cost.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use anyhow::Result;

use super::gpu::{Event, Gpu};

struct Marks {
    /// (step that ended at this event, event)
    events: Vec<(&'static str, Event)>,
    /// The step begun last.
    current: &'static str,
}

fn marks() -> &'static Mutex<Marks> {
    static M: OnceLock<Mutex<Marks>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(Marks { events: Vec::new(), current: "-" }))
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
