//! The golden tiny-a checkpoint loads, its layer plan is the documented one, and every MXFP4
//! expert decodes consistently with the release's quantisation rule.

use k3_protocol::config::{AttnKind, FfnKind};
use k3_protocol::mxfp4::{self, Mxfp4Weight};
use k3_protocol::testdata::golden_dir;
use k3_protocol::Checkpoint;

#[test]
fn tiny_a_loads_and_plan_matches_readme() {
    let ck = Checkpoint::open(&golden_dir("tiny-a")).expect("tiny-a opens and validates");
    let c = &ck.config().text_config;
    assert_eq!(c.kda_layers(), vec![0, 1, 2, 4, 5, 6]);
    assert_eq!(c.mla_layers(), vec![3, 7, 8]);
    let plan = c.layer_plan();
    assert_eq!(plan[0].ffn, FfnKind::Dense);
    assert!(plan[1..].iter().all(|s| s.ffn == FfnKind::LatentMoe));
    let banks: Vec<usize> = plan.iter().filter(|s| s.bank_boundary).map(|s| s.index).collect();
    assert_eq!(banks, vec![0, 3, 6]);
    assert_eq!(plan[3].attn, AttnKind::Mla);
    assert_eq!(ck.total_bytes(), 4_092_992, "README: checkpoint tensors total 4092992 bytes");
    assert_eq!(ck.config().media_placeholder_token_id, 1005);
    // A_log is stored padded to head_dim with zeros past num_heads.
    let a = ck.tensor("language_model.model.layers.0.self_attn.A_log").unwrap().to_f32().unwrap();
    assert_eq!(a.len(), 32);
    assert!(a[2..].iter().all(|&x| x == 0.0));
    assert!(a[..2].iter().all(|&x| x != 0.0));
}

#[test]
fn every_tiny_a_expert_decodes_bit_exactly() {
    let ck = Checkpoint::open(&golden_dir("tiny-a")).unwrap();
    let c = ck.config().text_config.clone();
    let mut n = 0;
    for l in 1..c.num_hidden_layers {
        for e in 0..c.num_experts {
            for w in ["w1", "w2", "w3"] {
                let x: Mxfp4Weight = ck.expert(l, e, w).unwrap();
                let d = x.decode();
                // Independent per-element decode from the spec formula.
                for r in 0..x.out_features {
                    for i in 0..x.in_features {
                        let byte = x.packed[r * x.in_features / 2 + i / 2];
                        let code = if i % 2 == 0 { byte & 15 } else { byte >> 4 };
                        let mag = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(code & 7) as usize];
                        let sign = if code & 8 != 0 { -1.0f64 } else { 1.0 };
                        let e8 = x.scale[r * x.in_features / 32 + i / 32] as i32;
                        let v = sign * mag * 2f64.powi(e8 - 127);
                        assert_eq!(d[r * x.in_features + i] as f64, v, "layer {l} expert {e} {w} [{r},{i}]");
                    }
                }
                // The generator's rule scale = 2^ceil(log2(amax/6)) puts each group's largest
                // |value|/scale in (3, 6], so its largest code magnitude is 3, 4 or 6.
                for r in 0..x.out_features {
                    for g in 0..x.in_features / 32 {
                        let sc = mxfp4::e8m0(x.scale[r * x.in_features / 32 + g]);
                        let amax = d[r * x.in_features + g * 32..][..32].iter().fold(0f32, |m, v| m.max(v.abs()));
                        assert!(amax / sc >= 3.0, "layer {l} expert {e} {w} row {r} group {g}: amax/scale {}", amax / sc);
                    }
                }
                n += 1;
            }
        }
    }
    assert_eq!(n, 8 * 16 * 3);
}

#[test]
fn fingerprint_is_stable_and_sensitive() {
    let ck = Checkpoint::open(&golden_dir("tiny-a")).unwrap();
    let f1 = ck.fingerprint();
    let f2 = Checkpoint::open(&golden_dir("tiny-a")).unwrap().fingerprint();
    assert_eq!(f1, f2);
    // The index fingerprint (config + tensor index) is what fingerprint_of computes; the model
    // fingerprint adds the weight digests.
    let f1 = ck.index_fingerprint();
    assert_ne!(f1, f2);
    let mut cfg = ck.config().clone();
    cfg.text_config.rms_norm_eps = 1e-6;
    let mut list: Vec<(String, &'static str, Vec<usize>)> =
        ck.tensor_names().map(|n| (n.to_string(), ck.entry(n).unwrap().dtype.name(), ck.entry(n).unwrap().shape.clone())).collect();
    assert_eq!(k3_protocol::fingerprint::fingerprint_of(ck.config(), &mut list.clone()), f1);
    assert_ne!(k3_protocol::fingerprint::fingerprint_of(&cfg, &mut list.clone()), f1);
    list.pop();
    assert_ne!(k3_protocol::fingerprint::fingerprint_of(ck.config(), &mut list), f1);
}

#[test]
fn golden_state_loads_as_a_session() {
    let ck = Checkpoint::open(&golden_dir("tiny-a")).unwrap();
    let s = k3_protocol::handoff::load_session(&k3_protocol::testdata::tiny_a_golden(), &ck.config().text_config).unwrap();
    assert_eq!(s.state.tokens, 300);
    s.state.check(&ck.config().text_config).unwrap();
    assert!(s.extra.contains_key("logits"));
}
