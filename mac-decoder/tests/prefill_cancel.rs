//! Local prefill cancellation on the MLX engine (issue 21: an 8k-token prefill ran ~22 s after
//! its client left). `Engine::set_cancel` is checked before every chunk: a prefill whose flag is
//! set stops before its next chunk, the session holds exactly the chunks that ran, and the
//! engine serves the next prompt exactly as if nothing had happened.
#![cfg(feature = "mlx")]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_protocol::synth::{write_model, Preset, SynthOptions};
use mac_decoder::decode::{Engine, EngineOptions};

const CHUNK: usize = 32;
const N: usize = 768;

/// "prefill cancelled after C of N tokens" → C.
fn stopped_at(e: &anyhow::Error) -> usize {
    let m = e.to_string();
    assert!(m.contains("prefill cancelled after") && m.contains(&format!("of {N} tokens")), "{m}");
    m.split_whitespace().nth(3).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{m}"))
}

#[test]
fn an_abandoned_local_prefill_stops_within_a_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.progress = false;
    write_model(dir.path(), &opts).unwrap();
    let engine = Engine::load_with(dir.path(), EngineOptions { prefill_chunk: CHUNK, progress: false }).unwrap();
    let prompt: Vec<u32> = (0..N as u32).map(|i| (i * 37 + 5) % 1000).collect();

    // The whole prefill, uncancelled: its logits and time (the quicker of two runs; the first
    // also warms MLX up).
    let mut full = Duration::MAX;
    let mut want = Vec::new();
    for _ in 0..2 {
        let mut s = engine.new_session().unwrap();
        let t = Instant::now();
        want = engine.prefill_local(&mut s, &prompt, None).unwrap();
        full = full.min(t.elapsed());
    }

    // Cancelled before it starts: no chunk runs.
    let flag = Arc::new(AtomicBool::new(true));
    engine.set_cancel(Some(flag.clone()));
    let mut s = engine.new_session().unwrap();
    let e = engine.prefill_local(&mut s, &prompt, None).expect_err("a cancelled prefill ran to the end");
    assert_eq!(stopped_at(&e), 0);
    assert_eq!(s.tokens(), 0);

    // Cancelled an eighth of the way in: it stops at the next chunk boundary, well before the end.
    flag.store(false, Ordering::SeqCst);
    let setter = std::thread::spawn({
        let flag = flag.clone();
        move || {
            std::thread::sleep(full / 8);
            flag.store(true, Ordering::SeqCst);
            Instant::now()
        }
    });
    let mut s = engine.new_session().unwrap();
    let r = engine.prefill_local(&mut s, &prompt, None);
    let returned = Instant::now();
    let e = r.expect_err("the prefill ran to the end although its flag was set");
    let set_at = setter.join().unwrap();
    let after = returned.saturating_duration_since(set_at);
    let at = stopped_at(&e);
    eprintln!("full prefill {:.3} s ({} chunks); cancelled at {at} of {N} tokens, {:.3} s after the flag", full.as_secs_f64(), N / CHUNK, after.as_secs_f64());
    assert!(at < N && at.is_multiple_of(CHUNK), "stopped at {at}");
    assert_eq!(s.tokens(), at, "the session holds exactly the chunks that ran");
    // At most the chunk in progress finishes (1/24 of the prompt, measured 0.05-0.2 s on a loaded
    // box); an uncancelled run would go on for ~7/8 of `full`.
    assert!(after < full / 2, "ran {:.3} s after the flag (the whole prefill takes {:.3} s)", after.as_secs_f64(), full.as_secs_f64());

    // The engine is unharmed: the same prompt, uncancelled, gives the same logits.
    engine.set_cancel(None);
    let mut s = engine.new_session().unwrap();
    assert_eq!(engine.prefill_local(&mut s, &prompt, None).unwrap(), want);
}
