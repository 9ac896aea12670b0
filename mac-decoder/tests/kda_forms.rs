//! Reference checks of spec §6 on the MLX model: chunked KDA (prefill) equals the recurrence
//! (decode), and a token-by-token decode equals a prefill at the same positions.
#![cfg(feature = "mlx")]

mod decoder_golden;

use decoder_golden::{model_dir, rel_l2, row_errors, Golden};
use mac_decoder::decode::Engine;
use mac_decoder::mlx::{array_f32, to_vec_f32};
use mac_decoder::model::k3::{kda_chunked, kda_recurrent};
use rand::{Rng, SeedableRng};

fn random(rng: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.gen::<f32>() - 0.5) * 2.0 * scale).collect()
}

#[test]
fn chunked_kda_equals_the_recurrence() {
    let (h, t, d) = (3usize, 150usize, 16usize); // 150 tokens: two full 64-chunks and a short one
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let l2 = |v: Vec<f32>, scale: f32| -> Vec<f32> {
        v.chunks(d)
            .flat_map(|c| {
                let n = (c.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
                c.iter().map(move |x| x / n * scale).collect::<Vec<_>>()
            })
            .collect()
    };
    let q = l2(random(&mut rng, h * t * d, 1.0), (d as f32).powf(-0.5));
    let k = l2(random(&mut rng, h * t * d, 1.0), 1.0);
    let v = random(&mut rng, h * t * d, 1.0);
    // bounded gate g ∈ (-5, 0), beta ∈ (0, 1), a non-zero initial state
    let g: Vec<f32> = (0..h * t * d).map(|_| -5.0 * rng.gen::<f32>()).collect();
    let beta: Vec<f32> = (0..h * t).map(|_| rng.gen::<f32>()).collect();
    let s0 = random(&mut rng, h * d * d, 0.3);
    let a = |x: &[f32], shape: &[usize]| array_f32(x, shape, "t").unwrap();
    let (qa, ka, va, ga) = (a(&q, &[h, t, d]), a(&k, &[h, t, d]), a(&v, &[h, t, d]), a(&g, &[h, t, d]));
    let ba = a(&beta, &[h, t]);
    let mut s_rec = a(&s0, &[h, d, d]);
    let mut s_ch = a(&s0, &[h, d, d]);
    let o_rec = to_vec_f32(&kda_recurrent(&qa, &ka, &va, &ga, &ba, &mut s_rec).unwrap()).unwrap();
    let o_ch = to_vec_f32(&kda_chunked(&qa, &ka, &va, &ga, &ba, &mut s_ch).unwrap()).unwrap();
    let eo = rel_l2(&o_ch, &o_rec);
    let es = rel_l2(&to_vec_f32(&s_ch).unwrap(), &to_vec_f32(&s_rec).unwrap());
    eprintln!("chunked vs recurrent: output {eo:.2e}, state {es:.2e}");
    assert!(eo < 1e-5 && es < 1e-5, "output {eo:e}, state {es:e}");
}

#[test]
fn token_by_token_decode_equals_prefill() {
    let g = Golden::load("tiny-a");
    let engine = Engine::load(&model_dir("tiny-a")).unwrap();
    let vocab = engine.text_config().vocab_size;
    let ids = &g.ids("input_ids")[..70]; // crosses a 64-token KDA chunk and an AttnRes block
    let mut a = engine.new_session().unwrap();
    let prefill = engine.prefill_logits(&mut a, ids, None).unwrap();
    let mut b = engine.new_session().unwrap();
    let mut steps = Vec::new();
    for &t in ids {
        steps.extend(engine.step(&mut b, t).unwrap());
    }
    let worst = row_errors(&steps, &prefill, vocab).into_iter().fold(0f64, f64::max);
    eprintln!("decode vs prefill, 70 positions: worst row {worst:.2e}");
    assert!(worst < 1e-4, "worst row {worst:e}");
}
