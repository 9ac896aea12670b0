//! The pruned checkpoint writer, expert selection, budgets, statistics files and the fit table
//! (docs/pruning.md), on small synthetic models.

use std::path::Path;

use k3_protocol::fit::fit_table;
use k3_protocol::prune::{check_keep, keep_for_budget, prune_checkpoint, pruned_bytes, select, Criterion, ExpertStats, PruneRecord, RECORD_FORMAT};
use k3_protocol::synth::{write_model, Preset, SynthOptions};
use k3_protocol::tensors::{expert_tensor, layer_tensor, DerivedSizes};
use k3_protocol::Checkpoint;

fn tiny(seed: u64, dir: &Path) -> Checkpoint {
    let mut o = SynthOptions::new(Preset::Tiny);
    o.seed = seed;
    o.overrides.layers = Some(4);
    o.max_shard_bytes = 300_000; // several shards, experts of one layer spread over them
    write_model(dir, &o).unwrap();
    Checkpoint::open(dir).unwrap()
}

/// Statistics with a known ranking: in layer `l`, expert `e` has saliency `(e * 7 + l) % n`.
fn stats_for(ck: &Checkpoint) -> ExpertStats {
    let c = &ck.config().text_config;
    let mut s = ExpertStats::new(c, &ck.fingerprint());
    for ls in &mut s.layers {
        let n = ls.count.len();
        for e in 0..n {
            ls.count[e] = 1 + (e as u64 * 3 + ls.layer as u64) % 5;
            ls.gate_sum[e] = ls.count[e] as f64 * 0.25;
            ls.saliency_sum[e] = ((e * 7 + ls.layer) % n) as f64 * ls.count[e] as f64;
        }
        ls.tokens = 100;
    }
    s.tokens = 100;
    s.prompts_done = 1;
    s
}

fn record(ck: &Checkpoint, kept: &[(usize, Vec<usize>)]) -> PruneRecord {
    PruneRecord {
        format: RECORD_FORMAT.into(),
        source_fingerprint: ck.fingerprint().hex(),
        source_dir: ck.dir().display().to_string(),
        source_num_experts: ck.config().text_config.num_experts,
        num_experts: kept[0].1.len(),
        criterion: Criterion::Reap,
        mode: "uniform".into(),
        seed: 0,
        stats_sha256: String::new(),
        stats_prompts: 1,
        stats_tokens: 100,
        kept: kept.iter().cloned().collect(),
    }
}

fn hidden() -> indicatif::ProgressBar {
    indicatif::ProgressBar::hidden()
}

#[test]
fn keeping_every_expert_copies_every_tensor_bit_exactly() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(3, &d.path().join("src"));
    let n = ck.config().text_config.num_experts;
    let kept = select(&stats_for(&ck), Criterion::Reap, n, 0).unwrap();
    assert!(kept.iter().all(|(_, k)| *k == (0..n).collect::<Vec<_>>()));
    let out = d.path().join("same");
    let r = prune_checkpoint(&ck, &kept, &record(&ck, &kept), &out, &hidden()).unwrap();
    let p = Checkpoint::open(&out).unwrap();
    assert_eq!(r.bytes_written, ck.total_bytes());
    assert_eq!(p.total_bytes(), ck.total_bytes());
    let mut names: Vec<&str> = ck.tensor_names().collect();
    names.sort();
    let mut pnames: Vec<&str> = p.tensor_names().collect();
    pnames.sort();
    assert_eq!(names, pnames);
    for name in names {
        assert_eq!(ck.tensor(name).unwrap().bytes, p.tensor(name).unwrap().bytes, "{name}");
    }
    // The same model: same config and tensors, so the same fingerprint.
    assert_eq!(p.fingerprint(), ck.fingerprint());
    assert_eq!(p.state_identity(), ck.state_identity());
    assert!(std::fs::metadata(out.join("tiktoken.model")).is_ok(), "tokenizer copied");
}

#[test]
fn pruned_checkpoint_renumbers_experts_and_slices_the_router() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(5, &d.path().join("src"));
    let c = ck.config().text_config.clone();
    let stats = stats_for(&ck);
    let kept = select(&stats, Criterion::Reap, 6, 0).unwrap();
    // The ranking is the one built into the statistics.
    for (l, ids) in &kept {
        let mut want: Vec<usize> = (0..c.num_experts).collect();
        want.sort_by_key(|&e| std::cmp::Reverse((e * 7 + l) % c.num_experts));
        let mut want = want[..6].to_vec();
        want.sort();
        assert_eq!(ids, &want, "layer {l}");
    }
    let out = d.path().join("pruned");
    let rec = record(&ck, &kept);
    let r = prune_checkpoint(&ck, &kept, &rec, &out, &hidden()).unwrap();
    let p = Checkpoint::open(&out).unwrap();
    assert_eq!(p.config().text_config.num_experts, 6);
    assert_ne!(p.fingerprint(), ck.fingerprint(), "a pruned model has its own fingerprint");
    assert_eq!(p.state_identity(), ck.state_identity(), "and the state identity of its source");
    assert_ne!(p.state_identity(), p.fingerprint());
    assert_eq!(r.bytes_written, p.total_bytes());
    assert_eq!(p.total_bytes(), pruned_bytes(ck.config(), 6), "the size formula is exact");
    let mut cfg6 = ck.config().clone();
    cfg6.text_config.num_experts = 6;
    assert_eq!(DerivedSizes::of(&cfg6).checkpoint_bytes, pruned_bytes(ck.config(), 6));
    for (l, ids) in &kept {
        for (i, &e) in ids.iter().enumerate() {
            for w in ["w1", "w2", "w3"] {
                for part in ["weight_packed", "weight_scale"] {
                    assert_eq!(
                        p.tensor(&expert_tensor(*l, i, w, part)).unwrap().bytes,
                        ck.tensor(&expert_tensor(*l, e, w, part)).unwrap().bytes,
                        "layer {l} new expert {i} = source {e} {w}.{part}"
                    );
                }
            }
        }
        assert!(p.tensor(&expert_tensor(*l, 6, "w1", "weight_packed")).is_err());
        let h = c.hidden_size;
        let rw = ck.tensor(&layer_tensor(*l, "block_sparse_moe.gate.weight")).unwrap();
        let pw = p.tensor(&layer_tensor(*l, "block_sparse_moe.gate.weight")).unwrap();
        assert_eq!(pw.shape, &[6, h]);
        let rb = ck.f32(&layer_tensor(*l, "block_sparse_moe.gate.e_score_correction_bias"), &[c.num_experts]).unwrap();
        let pb = p.f32(&layer_tensor(*l, "block_sparse_moe.gate.e_score_correction_bias"), &[6]).unwrap();
        for (i, &e) in ids.iter().enumerate() {
            assert_eq!(pw.bytes[i * h * 2..(i + 1) * h * 2], rw.bytes[e * h * 2..(e + 1) * h * 2]);
            assert_eq!(pb[i].to_bits(), rb[e].to_bits());
        }
    }
    // Everything that is not an expert or the router is untouched.
    for name in ck.tensor_names().filter(|n| !n.contains("block_sparse_moe.experts.") && !n.contains("block_sparse_moe.gate.")) {
        assert_eq!(ck.tensor(name).unwrap().bytes, p.tensor(name).unwrap().bytes, "{name}");
    }
    let back = PruneRecord::load(&out).unwrap().unwrap();
    assert_eq!(back, rec);
    assert_eq!(back.kept.len(), kept.len());
    // The output directory exists now: a second run refuses to overwrite it.
    let e = prune_checkpoint(&ck, &kept, &rec, &out, &hidden()).unwrap_err().to_string();
    assert!(e.contains("already exists"), "{e}");
    assert!(!Path::new(&format!("{}.partial", out.display())).exists());
}

#[test]
fn state_identity_ignores_only_the_routed_experts() {
    let d = tempfile::tempdir().unwrap();
    let a = tiny(1, &d.path().join("a"));
    let mut o = SynthOptions::new(Preset::Tiny);
    o.seed = 1; // the same non-expert weights as `a` (synthetic weights depend on seed and name)
    o.overrides.layers = Some(4);
    o.overrides.experts = Some(8);
    write_model(&d.path().join("b"), &o).unwrap();
    let b = Checkpoint::open(&d.path().join("b")).unwrap();
    assert_ne!(a.fingerprint(), b.fingerprint());
    assert_eq!(a.state_identity(), b.state_identity(), "differ only in the routed experts");
    let f = tiny(2, &d.path().join("f"));
    assert_ne!(a.state_identity(), f.state_identity(), "other weights: another identity");
    o.overrides.shared_experts = Some(1);
    write_model(&d.path().join("e"), &o).unwrap();
    let e = Checkpoint::open(&d.path().join("e")).unwrap();
    assert_ne!(a.state_identity(), e.state_identity(), "shared experts produce state");
}

#[test]
fn selection_criteria_and_bad_counts() {
    let d = tempfile::tempdir().unwrap();
    let ck = tiny(7, d.path());
    let s = stats_for(&ck);
    let (n, k) = (s.num_experts, s.experts_per_token);
    let e = select(&s, Criterion::Reap, n + 1, 0).unwrap_err().to_string();
    assert!(e.contains("exceeds") && e.contains(&n.to_string()), "{e}");
    let e = select(&s, Criterion::Reap, k - 1, 0).unwrap_err().to_string();
    assert!(e.contains("top-k") && e.contains(&k.to_string()), "{e}");
    assert!(check_keep(k, n, k).is_ok());
    // Frequency ranks by count (ties: lower id); random depends on the seed only.
    let f = select(&s, Criterion::Frequency, k, 0).unwrap();
    for (l, ids) in &f {
        let ls = s.layers.iter().find(|x| x.layer == *l).unwrap();
        let worst_kept = ids.iter().map(|&e| ls.count[e]).min().unwrap();
        let best_dropped = (0..n).filter(|e| !ids.contains(e)).map(|e| ls.count[e]).max().unwrap();
        assert!(worst_kept >= best_dropped, "layer {l}");
    }
    let r1 = select(&s, Criterion::Random, k, 1).unwrap();
    assert_eq!(r1, select(&s, Criterion::Random, k, 1).unwrap());
    assert_ne!(r1, select(&s, Criterion::Random, k, 2).unwrap());
    assert!(r1.iter().all(|(_, ids)| ids.len() == k && ids.windows(2).all(|w| w[0] < w[1])));
}

#[test]
fn statistics_round_trip_and_reject_another_model() {
    let d = tempfile::tempdir().unwrap();
    let a = tiny(11, &d.path().join("a"));
    let b = tiny(12, &d.path().join("b"));
    let mut s = stats_for(&a);
    s.layers[0].add(s.experts_per_token, &[0, 1, 2, 3], &[0.5, 0.25, 0.125, 0.125], &[1.0, 2.0, 3.0, 4.0]).unwrap();
    assert_eq!(s.layers[0].tokens, 101);
    let path = d.path().join("stats.json");
    s.save(&path).unwrap();
    let back = ExpertStats::load(&path).unwrap();
    assert_eq!(back, s);
    back.check_model(&a.config().text_config, &a.fingerprint(), &path).unwrap();
    // Same config and shapes, other weights (seed): another fingerprint.
    assert_eq!(a.index_fingerprint(), b.index_fingerprint());
    let e = back.check_model(&b.config().text_config, &b.fingerprint(), &path).unwrap_err().to_string();
    assert!(e.contains("another model"), "{e}");
    let text = std::fs::read_to_string(&path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["means"][0]["reap"].as_array().unwrap().len(), s.num_experts, "derived means are written");
    std::fs::write(&path, text.replace("k3-offload expert stats v1", "something else")).unwrap();
    let e = ExpertStats::load(&path).unwrap_err().to_string();
    assert!(e.contains("format"), "{e}");
    let e = s.layers[0].add(4, &[99, 0, 0, 0], &[0.0; 4], &[0.0; 4]).unwrap_err().to_string();
    assert!(e.contains("expert id 99"), "{e}");
}

/// Statistics no calibration could write (a sum of 1e308, a negative or infinite sum, more
/// choices than tokens, sums for an expert nobody chose, a mean gate weight above the scaling
/// factor) are refused when read or checked against the model, naming the layer and expert.
#[test]
fn impossible_statistics_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let a = tiny(11, &d.path().join("a"));
    let path = d.path().join("stats.json");
    let cfg = &a.config().text_config;
    type Edit = fn(&mut ExpertStats);
    let cases: [(&str, Edit, &str); 7] = [
        ("saliency 1e308", |s| s.layers[0].saliency_sum[1] = 1e308, "beyond any f32"),
        ("gate 1e308", |s| s.layers[0].gate_sum[1] = 1e308, "beyond any f32"),
        ("negative", |s| s.layers[0].gate_sum[2] = -1.0, "finite number"),
        ("count above tokens", |s| s.layers[0].count[0] = 1000, "passed the layer"),
        ("more choices than top-k", |s| s.layers[0].count.iter_mut().for_each(|c| *c = 100), "expert choices"),
        (
            "sums without a count",
            |s| {
                s.layers[0].count[3] = 0;
                s.layers[0].saliency_sum[3] = 1.0
            },
            "chosen by no token",
        ),
        ("mean gate above the scaling factor", |s| s.layers[0].gate_sum[1] = 1e6, "routed_scaling_factor"),
    ];
    for (what, edit, want) in cases {
        let mut s = stats_for(&a);
        edit(&mut s);
        let text = serde_json::to_string(&s).unwrap();
        std::fs::write(&path, text).unwrap();
        let e = match ExpertStats::load(&path) {
            Err(e) => e.to_string(),
            Ok(back) => back.check_model(cfg, &a.fingerprint(), &path).unwrap_err().to_string(),
        };
        assert!(e.contains(want) && e.contains("layer "), "{what}: {e}");
    }
    // serde_json writes an infinite sum as null: a file that cannot be read, refused as malformed.
    let mut s = stats_for(&a);
    s.layers[0].saliency_sum[1] = f64::INFINITY;
    std::fs::write(&path, serde_json::to_string(&s).unwrap()).unwrap();
    assert!(ExpertStats::load(&path).is_err());
    // the sums of a real calibration still load
    stats_for(&a).save(&path).unwrap();
    ExpertStats::load(&path).unwrap().check_model(cfg, &a.fingerprint(), &path).unwrap();
}

#[test]
fn budgets() {
    let mut o = SynthOptions::new(Preset::K3);
    o.weights = false;
    let cfg = o.config().unwrap();
    let full = pruned_bytes(&cfg, 896);
    assert_eq!(full, DerivedSizes::of(&cfg).checkpoint_bytes);
    assert_eq!(keep_for_budget(&cfg, full).unwrap(), 896);
    let k = keep_for_budget(&cfg, 400_000_000_000).unwrap();
    let sizes = k3_protocol::prune::PrunedSizes::of(&cfg);
    assert!(sizes.bytes(k) <= 400_000_000_000 && sizes.bytes(k + 1) > 400_000_000_000);
    let e = keep_for_budget(&cfg, 50_000_000_000).unwrap_err().to_string();
    assert!(e.contains("no pruned model fits 50.000 GB"), "{e}");
}

#[test]
fn fit_table_of_the_real_k3_config() {
    let mut o = SynthOptions::new(Preset::K3);
    o.weights = false;
    let cfg = o.config().unwrap();
    let t = fit_table(&cfg, 16.0);
    let sizes = k3_protocol::prune::PrunedSizes::of(&cfg);
    assert_eq!(t.cells.len(), 12);
    // The full model fits no Mac Studio; a 96 GB one cannot hold even top-16 experts.
    assert!(t.cells.iter().all(|c| c.max_experts != Some(896)));
    assert!(t.cells.iter().filter(|c| c.memory_gb == 96).all(|c| c.max_experts.is_none()));
    for c in &t.cells {
        if let (Some(k), Some(b)) = (c.max_experts, c.weight_bytes) {
            assert!(b as i128 <= c.weight_budget && (k == 896 || sizes.bytes(k + 1) as i128 > c.weight_budget));
        }
    }
    // More memory never fits fewer experts; a longer context never fits more.
    let get = |gb: u64, ctx: u64| t.cells.iter().find(|c| c.memory_gb == gb && c.context == ctx).unwrap().max_experts;
    assert!(get(512, 32_768) >= get(256, 32_768) && get(256, 32_768) >= get(192, 32_768));
    assert!(get(512, 32_768) >= get(512, 1_048_576));
    assert_eq!(t.cells[0].state_bytes, 449_372_160 + 32_768 * 27_648);
    let text = t.render();
    assert!(text.contains("512 GB") && text.contains("1M ctx"), "{text}");
}

#[test]
fn fit_over_hosts_of_the_real_k3_config() {
    use k3_protocol::fit::{fit_table_hosts, split, SplitSizes};
    let mut o = SynthOptions::new(Preset::K3);
    o.weights = false;
    let cfg = o.config().unwrap();
    let sz = SplitSizes::of(&cfg);
    let d = DerivedSizes::of(&cfg);
    let moe = cfg.text_config.layer_plan().iter().filter(|s| s.ffn == k3_protocol::config::FfnKind::LatentMoe).count() as u64;
    let full = d.checkpoint_bytes;
    // one host is the one-Mac table
    let one = fit_table(&cfg, 16.0);
    assert_eq!(fit_table_hosts(&cfg, 16.0, 1), one);
    // even and uneven splits: every rank drops exactly the other ranks' expert weights
    for (hosts, sizes) in [(4usize, vec![224usize, 224, 224, 224]), (3, vec![298, 299, 299]), (5, vec![179, 179, 179, 179, 180])] {
        let s = sz.split(896, hosts);
        assert_eq!(s.iter().map(|r| r.experts.len()).collect::<Vec<_>>(), sizes, "{hosts} hosts");
        assert_eq!(s.last().unwrap().experts.end, 896);
        for r in &s {
            assert_eq!(r.weight_bytes, full - d.bytes_per_expert * moe * (896 - r.experts.len()) as u64, "rank {} of {hosts}", r.rank);
        }
    }
    // a pruned split: 448 kept experts over 4 ranks
    let p = sz.split(448, 4);
    assert_eq!(p, split(&cfg, 448, 4));
    assert_eq!(p[0].weight_bytes, pruned_bytes(&cfg, 448) - d.bytes_per_expert * moe * (448 - 112));
    let get = |t: &k3_protocol::fit::FitTable, gb: u64, ctx: u64| t.cells.iter().find(|c| c.memory_gb == gb && c.context == ctx).unwrap().clone();
    let mut last = one.clone();
    let tables: Vec<_> = [2usize, 4, 8].iter().map(|&h| fit_table_hosts(&cfg, 16.0, h)).collect();
    for t in &tables {
        let hosts = t.hosts;
        assert_eq!(t.hosts, hosts);
        for c in &t.cells {
            // the largest rank fits; one more expert per layer would not (unless all fit)
            if let (Some(k), Some(b)) = (c.max_experts, c.rank_weight_bytes) {
                assert!(b as i128 <= c.weight_budget);
                assert_eq!(b, sz.split(k, hosts).iter().map(|r| r.weight_bytes).max().unwrap());
                if k < 896 {
                    let next = sz.split(k + 1, hosts).iter().map(|r| r.weight_bytes).max().unwrap();
                    assert!(next as i128 > c.weight_budget, "{hosts} hosts, {} GB, {} ctx: {} experts", c.memory_gb, c.context, k + 1);
                }
            }
            // more hosts never fit fewer experts
            assert!(c.max_experts >= get(&last, c.memory_gb, c.context).max_experts);
        }
        last = t.clone();
    }
    // the full K3 needs four 512 GB Macs at a 128k context (the largest rank's 224 experts per layer)
    let (t2, t4) = (&tables[0], &tables[1]);
    assert!(get(t2, 512, 131_072).max_experts < Some(896));
    assert_eq!(get(t4, 512, 131_072).max_experts, Some(896));
    assert_eq!(get(t4, 512, 131_072).rank_weight_bytes, Some(sz.split(896, 4)[0].weight_bytes));
    let text = t4.render();
    assert!(text.contains("fit on 4 Mac Studios") && text.contains("224 + 224 + 224 + 224"), "{text}");
    assert!(text.contains("all 896"), "{text}");
}
