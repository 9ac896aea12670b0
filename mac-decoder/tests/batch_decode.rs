//! Batched decode steps on the MLX engine (continuous batching, issue 18) against stepping
//! each session alone, on a synthetic tiny model: sessions of very different and of close
//! lengths (each attends over its own MLA latent rows), one joining the batch late and one
//! leaving early — every greedy token equal, every logits row within f32 rounding.
#![cfg(feature = "mlx")]

use k3_protocol::eval::argmax;
use k3_protocol::synth::{write_model, Preset, SynthOptions};
use mac_decoder::decode::{Engine, Session};

fn tiny() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny);
    opts.progress = false;
    write_model(dir.path(), &opts).unwrap();
    dir
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + salt * 101 + 5) % 1000).collect()
}

#[test]
fn batched_steps_equal_steps_alone() {
    let dir = tiny();
    let engine = Engine::load(dir.path()).unwrap();
    check(&engine, [5, 17, 40, 2]);
    check(&engine, [30, 33, 31, 34]);
}

/// Sequence 3 joins at step 4, sequence 1 leaves after step 6.
fn check(engine: &Engine, lens: [usize; 4]) {
    let (join, leave, steps) = ([0usize, 0, 0, 4], [usize::MAX, 6, usize::MAX, usize::MAX], 12usize);
    let fresh = |i: usize| -> Session {
        let mut s = engine.new_session().unwrap();
        engine.prefill_local(&mut s, &prompt(lens[i], i as u32), None).unwrap();
        s
    };
    // alone: each sequence's greedy tokens and logits rows, step by step
    let mut want_tokens = vec![Vec::new(); 4];
    let mut want_logits = vec![Vec::new(); 4];
    for i in 0..4 {
        let mut s = fresh(i);
        for step in 0..steps {
            if step < join[i] || step >= leave[i] {
                continue;
            }
            let t = argmax(s.last_logits().unwrap()).unwrap() as u32;
            want_tokens[i].push(t);
            want_logits[i].push(engine.step(&mut s, t).unwrap());
        }
    }
    // batched: the sequences present at each step go through one step_batch
    let mut sessions: Vec<Session> = (0..4).map(fresh).collect();
    let mut got_tokens = vec![Vec::new(); 4];
    let mut worst = 0.0f32;
    for step in 0..steps {
        let present: Vec<usize> = (0..4).filter(|&i| step >= join[i] && step < leave[i]).collect();
        let toks: Vec<u32> = present.iter().map(|&i| argmax(sessions[i].last_logits().unwrap()).unwrap() as u32).collect();
        let mut refs: Vec<&mut Session> = sessions.iter_mut().enumerate().filter(|(i, _)| present.contains(i)).map(|(_, s)| s).collect();
        engine.step_batch(&mut refs, &toks).unwrap();
        for (&i, &t) in present.iter().zip(&toks) {
            let k = got_tokens[i].len();
            got_tokens[i].push(t);
            let (got, want) = (sessions[i].last_logits().unwrap(), &want_logits[i][k]);
            assert_eq!(got.len(), want.len());
            let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
            let err = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
            assert!(err < 1e-4, "sequence {i}, step {step}: logits differ by {err:.2e} (relative to the largest)");
            worst = worst.max(err);
        }
    }
    eprintln!("lengths {lens:?}: worst relative logits difference {worst:.2e}");
    assert_eq!(got_tokens, want_tokens);
    for i in 0..4 {
        assert_eq!(sessions[i].tokens(), lens[i] + want_tokens[i].len(), "sequence {i} holds the wrong number of tokens");
    }
    // the states match too: a last step alone continues identically
    let t = argmax(sessions[2].last_logits().unwrap()).unwrap() as u32;
    let mut alone = fresh(2);
    for &w in &want_tokens[2] {
        engine.step(&mut alone, w).unwrap();
    }
    let (a, b) = (engine.step(&mut sessions[2], t).unwrap(), engine.step(&mut alone, t).unwrap());
    assert_eq!(argmax(&a), argmax(&b));
}
