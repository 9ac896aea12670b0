//! MXFP4 experts on MLX: the reinterpreted compressed-tensors bytes dequantise bit-exactly to
//! `k3_protocol`'s decoder on EVERY expert tensor of golden tiny-a, and the quantized matmuls
//! (`quantized_matmul`, `gather_qmm` in mode "mxfp4") equal an f32 matmul with those weights.
#![cfg(feature = "mlx")]

use k3_protocol::config::FfnKind;
use k3_protocol::testdata::golden_dir;
use k3_protocol::Checkpoint;
use mac_decoder::mlx::{array_f32, dequantize_mxfp4, gather_qmm_mxfp4, quantized_matmul_mxfp4, to_vec_f32, Mxfp4Array};
use mlx_rs::Array;

fn expert_stack(ck: &Checkpoint, l: usize, w: &str) -> (Mxfp4Array, Vec<Vec<f32>>) {
    let c = &ck.config().text_config;
    let mut parts = Vec::new();
    let mut reference = Vec::new();
    let (mut out, mut inp) = (0, 0);
    for e in 0..c.num_experts {
        let m = ck.expert(l, e, w).unwrap();
        (out, inp) = (m.out_features, m.in_features);
        reference.push(m.decode());
        parts.push((m.packed, m.scale));
    }
    (Mxfp4Array::from_compressed(&parts, out, inp, w).unwrap(), reference)
}

#[test]
fn every_tiny_a_expert_dequantises_bit_exactly() {
    let ck = Checkpoint::open(&golden_dir("tiny-a")).unwrap();
    let c = ck.config().text_config.clone();
    let mut tensors = 0;
    for spec in c.layer_plan().iter().filter(|s| s.ffn == FfnKind::LatentMoe) {
        for w in ["w1", "w2", "w3"] {
            let (stack, reference) = expert_stack(&ck, spec.index, w);
            let got = to_vec_f32(&dequantize_mxfp4(&stack.weight, &stack.scales).unwrap()).unwrap();
            let n = stack.out_features * stack.in_features;
            for (e, want) in reference.iter().enumerate() {
                let g = &got[e * n..(e + 1) * n];
                let bad = g.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(bad.is_none(), "layer {} expert {e} {w}: element {:?} differs", spec.index, bad);
                tensors += 1;
            }
        }
    }
    // 8 MoE layers x 16 experts x 3 weights
    assert_eq!(tensors, 384);
}

fn matmul_ref(x: &[f32], w: &[f32], rows: usize, out: usize, inp: usize) -> Vec<f32> {
    let mut y = vec![0f32; rows * out];
    for r in 0..rows {
        for o in 0..out {
            y[r * out + o] = (0..inp).map(|i| x[r * inp + i] as f64 * w[o * inp + i] as f64).sum::<f64>() as f32;
        }
    }
    y
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64)) / scale
}

#[test]
fn quantized_and_gathered_matmuls_match_f32() {
    let ck = Checkpoint::open(&golden_dir("tiny-a")).unwrap();
    let (stack, reference) = expert_stack(&ck, 1, "w1");
    let (out, inp) = (stack.out_features, stack.in_features);
    let rows = 5;
    let x: Vec<f32> = (0..rows * inp).map(|i| ((i * 7919 % 997) as f32 / 997.0 - 0.5) * 2.0).collect();
    let xa = array_f32(&x, &[rows, inp], "x").unwrap();
    // one expert
    let y = to_vec_f32(&quantized_matmul_mxfp4(&xa, &stack.get(3).unwrap()).unwrap()).unwrap();
    let e = max_rel(&y, &matmul_ref(&x, &reference[3], rows, out, inp));
    assert!(e < 1e-5, "quantized_matmul vs f32: {e:e}");
    // gathered: row r through expert sel[r]
    let sel = [0i32, 15, 3, 3, 9];
    let xg = xa.reshape(&[rows as i32, 1, inp as i32]).unwrap();
    let y = to_vec_f32(&gather_qmm_mxfp4(&xg, &stack, &Array::from_slice(&sel, &[rows as i32]), false).unwrap()).unwrap();
    for (r, &s) in sel.iter().enumerate() {
        let want = matmul_ref(&x[r * inp..(r + 1) * inp], &reference[s as usize], 1, out, inp);
        let e = max_rel(&y[r * out..(r + 1) * out], &want);
        assert!(e < 1e-5, "gather_qmm row {r} (expert {s}): {e:e}");
    }
}

#[test]
fn mismatched_mxfp4_inputs_are_errors() {
    let packed = vec![0u8; 16];
    let scale = vec![127u8; 2];
    assert!(Mxfp4Array::from_compressed(&[(&packed, &scale)], 1, 32, "t").is_err());
    let ok = Mxfp4Array::from_compressed(&[(&packed, &scale[..1])], 1, 32, "t").unwrap();
    let x = array_f32(&[0.0; 16], &[1, 16], "x").unwrap();
    assert!(quantized_matmul_mxfp4(&x, &ok.get(0).unwrap()).is_err());
}
