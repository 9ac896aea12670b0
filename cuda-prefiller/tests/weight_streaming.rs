//! The weight streamer's planning and the executor's streamed-experts path, without a GPU (CI):
//! - the stream plan of tiny-a puts every checkpoint byte where the synchronous loader would
//!   (dense tensors at their slot offsets, experts in the CUDA expert layout), whole layers
//!   without a budget, expert chunks under a small one, and a budget below one unit is an error
//!   naming the layer and tensor;
//! - the executor fed layers without their experts (experts handed out by
//!   `WeightFeed::experts_in_chunks`, as the CUDA streamer does under a budget) gives results
//!   identical to the ordinary path on the CPU reference.

use std::path::PathBuf;
use std::sync::Arc;

use cuda_prefiller::backend::{Backend, Routing};
use cuda_prefiller::cpu::{CpuBackend, CpuExperts};
use cuda_prefiller::executor::{self, ExecOptions, PrefillInput, WeightFeed};
use cuda_prefiller::expert_layout::ExpertLayout;
use cuda_prefiller::model::weights::{layer_experts, FfnWeights, LayerWeights};
use cuda_prefiller::model::{Model, WeightPolicy};
use cuda_prefiller::stream_plan::{StreamPlan, Unit};
use k3_protocol::handoff::HandoffState;
use k3_protocol::Checkpoint;

fn tiny_a() -> Arc<Checkpoint> {
    Arc::new(Checkpoint::open(&k3_protocol::testdata::golden_dir("tiny-a")).expect("tiny-a checkpoint"))
}

fn plan(ck: &Checkpoint, budget: Option<usize>, max_chunk: Option<usize>) -> anyhow::Result<StreamPlan> {
    let cfg = ck.config().text_config.clone();
    StreamPlan::new(ck, &cfg, &cfg.layer_plan(), budget, max_chunk)
}

/// tiny-a's MoE layers 1..8 alone (tiny-a's layer 0, a dense FFN, is its largest layer: with
/// it, any budget that holds its two dense slots holds two whole MoE layers too).
fn moe_layers_only(ck: &Checkpoint, budget: Option<usize>) -> anyhow::Result<StreamPlan> {
    let p = plan(ck, None, None).unwrap();
    StreamPlan::with_images(p.layers[1..].to_vec(), p.expert_layout, budget, None)
}

/// Runs every unit's parts against host "slots" (what the streamer does with pread + DMA) and
/// checks each layer's bytes against the checkpoint: dense tensors at their offsets, experts
/// exactly as `ExpertLayout::fill_slot` (the synchronous loader's arena) lays them out.
fn check_bytes(ck: &Checkpoint, p: &StreamPlan) {
    let cfg = ck.config().text_config.clone();
    let layout = p.expert_layout.expect("tiny-a has MoE layers");
    let shard_bytes = |shard: usize, off: u64, len: usize| -> Vec<u8> {
        let path: PathBuf = ck.dir().join(ck.shard_name(shard));
        let data = std::fs::read(&path).unwrap();
        data[off as usize..off as usize + len].to_vec()
    };
    let nl = cfg.layer_plan().len();
    let mut covered_experts = vec![0usize; nl];
    let mut dense_slot_of = vec![None; nl];
    let mut arenas: Vec<Vec<u8>> = (0..nl).map(|l| vec![0u8; p.image_of(l).map(|i| i.experts.len()).unwrap_or(0) * layout.stride]).collect();
    for u in 0..p.units.len() {
        let parts = p.copies(u).unwrap();
        let cap = if p.units[u].ring() == 0 { p.dense_slot } else { p.expert_slot };
        let mut slot = vec![0u8; cap];
        let mut used: Vec<(usize, usize)> = Vec::new();
        for part in &parts {
            assert!(part.dst + part.len <= cap, "unit {u}: part {} ends at {} past the slot's {cap} bytes", part.name, part.dst + part.len);
            for &(a, b) in &used {
                assert!(part.dst >= b || part.dst + part.len <= a, "unit {u}: part {} overlaps another", part.name);
            }
            used.push((part.dst, part.dst + part.len));
            slot[part.dst..part.dst + part.len].copy_from_slice(&shard_bytes(part.src, part.offset, part.len));
        }
        match p.units[u] {
            Unit::Dense { layer, with_experts } => {
                let img = p.image_of(layer).unwrap();
                for t in &img.tensors {
                    let v = ck.tensor(&t.name).unwrap();
                    assert_eq!(&slot[t.off..t.off + t.bytes], &v.bytes[..t.bytes], "tensor {} in the slot", t.name);
                }
                if with_experts {
                    let n = img.experts.len();
                    arenas[layer].copy_from_slice(&slot[img.dense_bytes..img.dense_bytes + n * layout.stride]);
                    covered_experts[layer] = n;
                }
                dense_slot_of[layer] = Some(p.slot[u]);
            }
            Unit::Experts { layer, lo, hi } => {
                assert_eq!(lo, covered_experts[layer], "layer {layer}: expert chunks out of order");
                assert!(hi - lo <= p.chunk && (hi - lo) * layout.stride <= p.expert_slot);
                arenas[layer][lo * layout.stride..hi * layout.stride].copy_from_slice(&slot[..(hi - lo) * layout.stride]);
                covered_experts[layer] = hi;
            }
        }
    }
    for img in &p.layers {
        let l = img.layer;
        let spec = cfg.layer_plan()[l];
        assert!(dense_slot_of[l].is_some(), "layer {l} never streamed");
        if spec.ffn == k3_protocol::config::FfnKind::Dense {
            assert!(img.experts.is_empty());
            continue;
        }
        let host = layer_experts(ck, &cfg, l).unwrap();
        assert_eq!(covered_experts[l], host.len(), "layer {l}: experts covered");
        let mut want = vec![0u8; host.len() * layout.stride];
        for (e, x) in host.iter().enumerate() {
            layout.fill_slot(x, &mut want[e * layout.stride..(e + 1) * layout.stride]).unwrap();
        }
        // padding bytes are not written by either; compare the expert tensors' ranges
        for e in 0..host.len() {
            for (_, _, off, len) in layout.parts() {
                let r = e * layout.stride + off..e * layout.stride + off + len;
                assert_eq!(&arenas[l][r.clone()], &want[r], "layer {l} ({:?}) expert {e}", spec.ffn);
            }
        }
    }
}

/// Each unit waits for the unit that used its slot before: same ring, same slot, earlier, and
/// nothing in between used that slot.
fn check_slot_order(p: &StreamPlan) {
    for u in 0..p.units.len() {
        let same: Vec<usize> = (0..u).filter(|&v| p.units[v].ring() == p.units[u].ring() && p.slot[v] == p.slot[u]).collect();
        assert_eq!(p.prev_in_slot[u], same.last().copied(), "unit {u} {:?}", p.units[u]);
        // two slots per ring, used in turn
        let ring_before = (0..u).filter(|&v| p.units[v].ring() == p.units[u].ring()).count();
        assert_eq!(p.slot[u], ring_before % 2);
    }
}

#[test]
fn plan_without_budget_streams_whole_layers_with_the_checkpoint_bytes() {
    let ck = tiny_a();
    let p = plan(&ck, None, None).unwrap();
    assert!(p.whole_layers);
    assert_eq!(p.expert_slot, 0);
    assert_eq!(p.units.len(), 9, "one unit per layer");
    let stride = p.expert_layout.unwrap().stride;
    let biggest = p.layers.iter().map(|l| l.total_bytes(stride)).max().unwrap();
    assert_eq!(p.dense_slot, biggest);
    for (l, u) in p.units.iter().enumerate() {
        assert_eq!(*u, Unit::Dense { layer: l, with_experts: l >= 1 }, "tiny-a: layer 0 has a dense FFN");
    }
    check_slot_order(&p);
    check_bytes(&ck, &p);
    // exactly two whole layers: still whole
    assert!(plan(&ck, Some(2 * p.dense_slot), None).unwrap().whole_layers);
}

#[test]
fn plan_under_a_small_budget_streams_experts_in_chunks() {
    let ck = tiny_a();
    let whole = moe_layers_only(&ck, None).unwrap();
    assert!(whole.whole_layers);
    let stride = whole.expert_layout.unwrap().stride;
    let dense_max = whole.layers.iter().map(|l| l.dense_bytes).max().unwrap();
    assert!(2 * dense_max + 2 * 5 * stride + 100 < 2 * whole.dense_slot, "the budget below holds no two whole layers");
    // room for 5 experts per chunk (plus a few spare bytes): 16 experts in 4 units
    let p = moe_layers_only(&ck, Some(2 * dense_max + 2 * 5 * stride + 100)).unwrap();
    assert!(!p.whole_layers);
    assert_eq!((p.chunk, p.dense_slot, p.expert_slot), (5, dense_max, 5 * stride));
    assert!(p.slot_bytes() <= 2 * dense_max + 2 * 5 * stride + 100);
    let l1: Vec<Unit> = p.units.iter().copied().filter(|u| u.layer() == 1).collect();
    assert_eq!(
        l1,
        vec![
            Unit::Dense { layer: 1, with_experts: false },
            Unit::Experts { layer: 1, lo: 0, hi: 5 },
            Unit::Experts { layer: 1, lo: 5, hi: 10 },
            Unit::Experts { layer: 1, lo: 10, hi: 15 },
            Unit::Experts { layer: 1, lo: 15, hi: 16 },
        ]
    );
    assert_eq!(p.units.len(), 8 * 5);
    check_slot_order(&p);
    check_bytes(&ck, &p);
    // the smallest workable budget: one expert per chunk
    let p1 = moe_layers_only(&ck, Some(2 * dense_max + 2 * stride)).unwrap();
    assert_eq!(p1.chunk, 1);
    assert_eq!(p1.units.len(), 8 * 17);
    check_slot_order(&p1);
    check_bytes(&ck, &p1);
}

#[test]
fn expert_chunk_cap_streams_experts_in_chunks_without_a_budget() {
    let ck = tiny_a();
    let p = plan(&ck, None, Some(6)).unwrap();
    assert!(!p.whole_layers);
    let stride = p.expert_layout.unwrap().stride;
    assert_eq!((p.chunk, p.expert_slot), (6, 6 * stride));
    // layer 0 (dense FFN): one unit; each MoE layer: dense + 0..6, 6..12, 12..16
    assert_eq!(p.units.len(), 1 + 8 * 4);
    assert_eq!(p.units[0], Unit::Dense { layer: 0, with_experts: false });
    assert_eq!(p.units[4], Unit::Experts { layer: 1, lo: 12, hi: 16 });
    check_slot_order(&p);
    check_bytes(&ck, &p);
    // a cap at or above the expert count: each MoE layer's experts in one unit after its dense tensors
    let p = plan(&ck, None, Some(16)).unwrap();
    assert!(!p.whole_layers);
    assert_eq!((p.chunk, p.expert_slot), (16, 16 * stride));
    assert_eq!(p.units.len(), 1 + 8 * 2);
    assert_eq!(&p.units[1..3], &[Unit::Dense { layer: 1, with_experts: false }, Unit::Experts { layer: 1, lo: 0, hi: 16 }]);
    check_slot_order(&p);
    check_bytes(&ck, &p);
    assert_eq!(plan(&ck, None, Some(64)).unwrap().chunk, 16);
    assert!(plan(&ck, None, Some(0)).is_err());
}

#[test]
fn budget_below_one_unit_is_an_error_naming_layer_and_tensor() {
    let ck = tiny_a();
    let whole = plan(&ck, None, None).unwrap();
    let dense = whole.layers.iter().max_by_key(|l| l.dense_bytes).unwrap();
    let biggest_tensor = dense.tensors.iter().max_by_key(|t| t.bytes).unwrap();
    let err = plan(&ck, Some(2 * dense.dense_bytes - 1), None).unwrap_err();
    let msg = format!("{err:#}");
    eprintln!("{msg}");
    assert!(msg.contains("--vram-budget"), "{msg}");
    assert!(msg.contains(&format!("layer {}", dense.layer)), "names the layer: {msg}");
    assert!(msg.contains(&biggest_tensor.name), "names its largest tensor: {msg}");
    assert!(msg.contains("block_sparse_moe.experts.0.w1.weight_packed"), "names an expert: {msg}");
    // MoE layers alone: room for the dense slots but not for two experts
    let m = moe_layers_only(&ck, None).unwrap();
    let stride = m.expert_layout.unwrap().stride;
    let dense_max = m.layers.iter().map(|l| l.dense_bytes).max().unwrap();
    let msg = format!("{:#}", moe_layers_only(&ck, Some(2 * dense_max + 2 * stride - 1)).unwrap_err());
    assert!(msg.contains("one routed expert") && msg.contains("layers.1.block_sparse_moe.experts.0.w1.weight_packed"), "{msg}");
}

/// A CPU weight feed that hands out MoE layers without their experts, as the CUDA streamer does
/// under a budget, and runs them in `experts_in_chunks`.
struct ExpertsApart {
    experts: Vec<Option<CpuExperts>>,
    calls: Vec<(usize, usize)>,
    done: Vec<usize>,
}

impl WeightFeed<CpuBackend> for ExpertsApart {
    fn layer(&mut self, model: &Model<CpuBackend>, l: usize) -> anyhow::Result<Arc<LayerWeights<CpuBackend>>> {
        let mut w = LayerWeights::load(&*model.backend, &model.ck, &model.cfg, model.plan[l])?;
        if let FfnWeights::LatentMoe(m) = &mut w.ffn {
            self.experts[l] = m.experts.take();
        }
        Ok(Arc::new(w))
    }
    fn experts_in_chunks(
        &mut self,
        model: &Model<CpuBackend>,
        l: usize,
        inputs: &[(&<CpuBackend as Backend>::Buf, &Routing)],
    ) -> anyhow::Result<Vec<<CpuBackend as Backend>::Buf>> {
        self.calls.push((l, inputs.len()));
        let e = self.experts[l].as_ref().expect("layer taken first");
        inputs.iter().map(|(x, r)| model.backend.moe_experts(x, r, e, model.dims.situ)).collect()
    }
    fn layer_done(&mut self, _model: &Model<CpuBackend>, l: usize) -> anyhow::Result<()> {
        self.done.push(l);
        Ok(())
    }
}

#[test]
fn executor_with_experts_apart_matches_the_ordinary_path() {
    let ck = tiny_a();
    let model = Model::new(Arc::new(CpuBackend), ck, WeightPolicy::PerLayer).unwrap();
    let bytes = std::fs::read(k3_protocol::testdata::tiny_a_golden()).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<u32> = st.tensor("input_ids").unwrap().data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect();
    // 4 token chunks (the last one partial), traced, in two calls (split prefill)
    let opts = ExecOptions { chunk_tokens: 80, trace_last: true, ..Default::default() };
    let split = 170;
    let run = |feed: Option<&mut ExpertsApart>| {
        let mut state = HandoffState::empty(&model.cfg);
        let (a, b) = match feed {
            Some(f) => (
                executor::prefill_with(&model, f, &mut state, PrefillInput::tokens(&ids[..split]), &opts, |_| Ok(())).unwrap(),
                executor::prefill_with(&model, f, &mut state, PrefillInput::tokens(&ids[split..]), &opts, |_| Ok(())).unwrap(),
            ),
            None => (
                executor::prefill(&model, &mut state, PrefillInput::tokens(&ids[..split]), &opts, |_| Ok(())).unwrap(),
                executor::prefill(&model, &mut state, PrefillInput::tokens(&ids[split..]), &opts, |_| Ok(())).unwrap(),
            ),
        };
        (state, a, b)
    };
    let mut feed = ExpertsApart { experts: (0..9).map(|_| None).collect(), calls: Vec::new(), done: Vec::new() };
    let (s1, a1, b1) = run(Some(&mut feed));
    let (s0, a0, b0) = run(None);
    assert_eq!(a1, a0, "first call: logits, router margins and hidden trace identical");
    assert_eq!(b1, b0, "continuation: identical");
    assert_eq!(s1.layers, s0.layers, "hand-off state identical");
    // the MoE layers 1..8 went through experts_in_chunks with every token chunk at once
    let chunks_first = split.div_ceil(80);
    let chunks_second = (ids.len() - split).div_ceil(80);
    let want: Vec<(usize, usize)> = (1..9).map(|l| (l, chunks_first)).chain((1..9).map(|l| (l, chunks_second))).collect();
    assert_eq!(feed.calls, want);
    assert_eq!(feed.done, (0..9).chain(0..9).collect::<Vec<_>>());
    // and the golden logits hold (1e-3, as in golden_tiny_a)
    let gold: Vec<f32> = st.tensor("logits").unwrap().data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    let v = model.dims.vocab;
    let last = ids.len() - 1 - split;
    let got = b1.row(last);
    let want = &gold[(ids.len() - 1) * v..ids.len() * v];
    let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    assert!((num / den).sqrt() < 1e-3, "last row vs golden: {}", (num / den).sqrt());
}

#[test]
fn expert_layout_of_the_plan_is_the_loaders() {
    let ck = tiny_a();
    let p = plan(&ck, None, None).unwrap();
    let c = ck.config().text_config.clone();
    assert_eq!(p.expert_layout.unwrap(), ExpertLayout::new(c.moe_intermediate_size, c.routed_expert_hidden_size).unwrap());
}

#[test]
fn expert_windows_take_the_experts_once_per_window_with_identical_results() {
    // The memory plan's expert windows: the streamed experts come once per window of token
    // chunks (StreamPlan::with_expert_passes repeats a layer's expert units that often).
    let ck = tiny_a();
    let model = Model::new(Arc::new(CpuBackend), ck.clone(), WeightPolicy::PerLayer).unwrap();
    let bytes = std::fs::read(k3_protocol::testdata::tiny_a_golden()).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<u32> = st.tensor("input_ids").unwrap().data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect();
    let whole = ExecOptions { chunk_tokens: 64, trace_last: true, ..Default::default() };
    let windowed = ExecOptions { expert_window_tokens: Some(128), ..whole.clone() };
    let windows = executor::expert_windows(&[ids.len()], &windowed);
    assert_eq!(windows.len(), ids.len().div_ceil(64).div_ceil(2), "two 64-token chunks per window");
    let mut feed = ExpertsApart { experts: (0..9).map(|_| None).collect(), calls: Vec::new(), done: Vec::new() };
    let (mut s0, mut s1) = (HandoffState::empty(&model.cfg), HandoffState::empty(&model.cfg));
    let a = executor::prefill(&model, &mut s0, PrefillInput::tokens(&ids), &whole, |_| Ok(())).unwrap();
    let b = executor::prefill_with(&model, &mut feed, &mut s1, PrefillInput::tokens(&ids), &windowed, |_| Ok(())).unwrap();
    assert_eq!(a, b, "logits, router margins and hidden trace identical");
    assert_eq!(s0.layers, s1.layers, "hand-off state identical");
    let per_layer: Vec<usize> = windows.iter().map(|w| w.iter().map(|&(_, c0, c1)| c1 - c0).sum()).collect();
    let want: Vec<(usize, usize)> = (1..9).flat_map(|l| per_layer.iter().map(move |&n| (l, n))).collect();
    assert_eq!(feed.calls, want, "one experts_in_chunks call per layer and window, with the window's chunks");
    // the streamer's units for the same pass: each MoE layer's expert chunks once per window
    let p = plan(&ck, None, Some(6)).unwrap();
    let q = p.with_expert_passes(windows.len());
    let experts_of = |p: &StreamPlan, l: usize| p.units.iter().filter(|u| matches!(u, Unit::Experts { layer, .. } if *layer == l)).count();
    for l in 1..9 {
        assert_eq!(experts_of(&q, l), windows.len() * experts_of(&p, l));
    }
    check_slot_order(&q);
    assert_eq!(
        q.prompt_bytes(),
        p.prompt_bytes()
            + (windows.len() - 1)
                * (1..9)
                    .map(|l| (0..p.units.len())
                        .filter(|&u| matches!(p.units[u], Unit::Experts { layer, .. } if layer == l))
                        .map(|u| p.unit_bytes(u))
                        .sum::<usize>())
                    .sum::<usize>()
    );
    // whole-layer slots keep the experts in the layer's slot: nothing repeats
    let w = plan(&ck, None, None).unwrap();
    assert_eq!(w.with_expert_passes(5).units, w.units);
}
