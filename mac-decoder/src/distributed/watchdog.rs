//! A watchdog for work that waits on peer ranks. MLX's ring backend blocks (or spins) forever
//! when a peer dies in the middle of a collective, and the waiting thread cannot be
//! interrupted. So every evaluation that contains a collective holds a [`Guard`]; when one is
//! held longer than its timeout, the watchdog thread logs which wait stalled and ends the
//! process with [`EXIT_STALLED`] (`_exit`: MLX's threads are stuck, destructors would hang).

use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Exit status of a rank stopped by the watchdog.
pub const EXIT_STALLED: i32 = 75;

struct Armed {
    id: u64,
    what: String,
    deadline: Instant,
    timeout: Duration,
}

#[derive(Default)]
struct State {
    next_id: u64,
    armed: Vec<Armed>,
}

struct Watchdog {
    state: Mutex<State>,
    wake: Condvar,
}

fn watchdog() -> &'static Watchdog {
    static W: OnceLock<&'static Watchdog> = OnceLock::new();
    W.get_or_init(|| {
        let w: &'static Watchdog = Box::leak(Box::new(Watchdog { state: Mutex::new(State::default()), wake: Condvar::new() }));
        std::thread::Builder::new().name("rank-watchdog".into()).spawn(move || w.run()).expect("spawning the rank watchdog thread");
        w
    })
}

impl Watchdog {
    fn run(&self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let now = Instant::now();
            if let Some(a) = st.armed.iter().find(|a| a.deadline <= now) {
                let msg = format!("no progress for {:.1} s while {}: a peer rank is gone or stalled; stopping this rank", a.timeout.as_secs_f64(), a.what);
                tracing::error!("{msg}");
                eprintln!("k3-decode: error: {msg}");
                // SAFETY: ends the process without running destructors (MLX's collective threads
                // are blocked and would never join).
                unsafe { libc::_exit(EXIT_STALLED) };
            }
            let next = st.armed.iter().map(|a| a.deadline).min();
            st = match next {
                None => self.wake.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(d) => self.wake.wait_timeout(st, d.saturating_duration_since(now)).unwrap_or_else(|e| e.into_inner()).0,
            };
        }
    }
}

/// Disarms its wait when dropped.
pub struct Guard {
    id: u64,
}

/// Arms the watchdog: the process ends if the returned guard lives longer than `timeout`.
/// `what` says which wait stalled (rank, step, collective).
pub fn guard(what: &str, timeout: Duration) -> Guard {
    let w = watchdog();
    let mut st = w.state.lock().unwrap_or_else(|e| e.into_inner());
    st.next_id += 1;
    let id = st.next_id;
    st.armed.push(Armed { id, what: what.to_string(), deadline: Instant::now() + timeout, timeout });
    w.wake.notify_all();
    Guard { id }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let w = watchdog();
        let mut st = w.state.lock().unwrap_or_else(|e| e.into_inner());
        st.armed.retain(|a| a.id != self.id);
    }
}
