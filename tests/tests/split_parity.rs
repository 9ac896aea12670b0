//! Split inference equals local inference: a prompt prefilled on the prefill node (CPU backend,
//! loopback QUIC, pinned certificates), streamed back layer by layer and ingested by the MLX
//! decoder gives the same greedy tokens as a local prefill — on golden tiny-a (also checked
//! against the golden logits, state and tokens) and on synthetic variants of other shapes.

use std::path::Path;

use cuda_prefiller::server::{PrefillNode, RequestOutcome, ServeOptions};
use k3_e2e_tests::*;
use mac_decoder::decode::{Engine, GenerateParams};
use mac_decoder::remote::{Conversation, RemotePrefiller, Route};

struct Split {
    node: PrefillNode,
    engine: Engine,
    remote: RemotePrefiller,
}

fn split(dir: &Path) -> Split {
    let fp = fingerprint_of(dir);
    let (scfg, ccfg) = paired(fp, fp);
    let node = start_node(dir, scfg, ServeOptions::default());
    let engine = Engine::load(dir).unwrap();
    let remote = remote(&engine, node.local_addr(), ccfg, 1);
    Split { node, engine, remote }
}

/// Remote prefill + greedy decode; returns (tokens, the last logits the node sent, conversation).
fn remote_greedy(s: &mut Split, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>, Conversation) {
    let mut conv = Conversation::new(&s.engine).unwrap();
    let t = s.remote.prefill(&s.engine, &mut conv, prompt, None).unwrap();
    assert_eq!(t.route, Route::Remote, "{}", t.reason);
    assert_eq!(t.prefill_tokens, prompt.len());
    assert_eq!(t.context_tokens, prompt.len());
    assert!(t.remote_compute_s.unwrap() > 0.0, "{t:?}");
    assert!(t.transfer_s.is_some() && t.exposed_tail_s.is_some() && t.ingest_s.is_some(), "{t:?}");
    assert!(t.state_bytes > 0);
    let logits = conv.last_logits().unwrap().to_vec();
    let out = conv.generate(&s.engine, &GenerateParams::greedy(n), |_| true).unwrap();
    (out.tokens, logits, conv)
}

fn assert_remote_equals_local(s: &mut Split, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>, Conversation) {
    let (tokens, logits, conv) = remote_greedy(s, prompt, n);
    let (local_tokens, local_logits) = local_greedy(&s.engine, prompt, n);
    let err = rel_l2(&logits, &local_logits);
    assert!(err <= 1e-3, "last logits, node (CPU reference) vs local (MLX): relative error {err:.2e}");
    assert!(top_margin(&local_logits) > 1e-2, "near tie at the first token: the greedy comparison would be meaningless");
    assert_eq!(tokens, local_tokens, "remote-prefill greedy tokens differ from local-prefill ones");
    let recent = records(&s.node, 1);
    let rec = recent.last().unwrap();
    assert_eq!(rec.outcome, RequestOutcome::Completed);
    assert_eq!(rec.new_tokens as usize, prompt.len());
    assert_eq!(rec.base_tokens, 0);
    (tokens, logits, conv)
}

#[test]
fn tiny_a_remote_prefill_matches_local_and_golden() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let g = Golden::load(&dir.join("golden.safetensors"));
    let ids = g.ids("input_ids");
    let (vocab, golden_logits) = (1024, g.f32("logits").1);
    let golden_tokens = g.ids("decode.tokens");
    let mut s = split(&dir);
    let (tokens, logits, conv) = assert_remote_equals_local(&mut s, &ids, golden_tokens.len());
    assert_eq!(tokens, golden_tokens, "remote prefill + MLX decode vs the golden greedy tokens");
    let last = &golden_logits[(ids.len() - 1) * vocab..];
    let err = rel_l2(&logits, last);
    assert!(err <= 1e-3, "node logits vs golden logits[T-1]: relative error {err:.2e}");
    // The ingested state, as the decoder holds it, vs the golden state (after the 24 decode
    // steps the session holds more rows: compare the prompt's part).
    let st = s.engine.export_state(conv.session()).unwrap();
    let mut checked = 0;
    for (name, _shape, data) in st.named_tensors() {
        if name.starts_with("mla.") {
            let (shape, want) = g.f32(&name);
            let n = shape[0] * shape[1];
            let e = rel_l2(&data[..n], &want);
            assert!(e <= 1e-3, "{name}: ingested rows vs golden: relative error {e:.2e}");
            checked += 1;
        }
    }
    assert_eq!(checked, 3, "tiny-a has 3 MLA layers");
}

#[test]
fn synthetic_variants_remote_prefill_matches_local() {
    init_tracing();
    // Same shapes as tiny-a, other weights.
    let a = synth(7, |_| {});
    // Other shapes: fewer layers, another MLA placement, wider KDA heads, AttnRes block 2.
    let b = synth(3, |o| {
        o.layers = Some(6);
        o.full_attn_layers = Some(vec![3, 6]);
        o.kda_heads = Some(4);
        o.kda_head_dim = Some(16);
        o.block_size = Some(2);
    });
    for (name, dir, seed) in [("same shapes", a.path(), 11), ("other shapes", b.path(), 12)] {
        let mut s = split(dir);
        let p = prompt(seed, 200, 1000);
        let (tokens, _, conv) = assert_remote_equals_local(&mut s, &p, 16);
        assert_eq!(conv.tokens().len(), 216, "{name}");
        assert_eq!(tokens.len(), 16, "{name}");
    }
}

/// Golden tensors by name.
struct Golden {
    st: Vec<u8>,
}

impl Golden {
    fn load(path: &Path) -> Golden {
        Golden { st: std::fs::read(path).unwrap() }
    }
    fn view(&self) -> safetensors::SafeTensors<'_> {
        safetensors::SafeTensors::deserialize(&self.st).unwrap()
    }
    fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = self.view();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("golden {name}"));
        (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
    }
    fn ids(&self, name: &str) -> Vec<u32> {
        let st = self.view();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("golden {name}"));
        t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect()
    }
}

#[test]
fn multimodal_prompt_remote_matches_golden() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let g = Golden::load(&dir.join("golden.safetensors"));
    let ids = g.ids("mm.input_ids_expanded");
    let (shape, embeds) = g.f32("mm.image_embeds");
    let (_, mm_logits) = g.f32("mm.logits");
    let image = mac_decoder::decode::ImageEmbeds { rows: shape[0], data: embeds };
    let mut s = split(&dir);
    let mut conv = Conversation::new(&s.engine).unwrap();
    let t = s.remote.prefill(&s.engine, &mut conv, &ids, Some(&image)).unwrap();
    assert_eq!(t.route, Route::Remote, "{}", t.reason);
    let last = &mm_logits[(ids.len() - 1) * 1024..];
    let err = rel_l2(conv.last_logits().unwrap(), last);
    assert!(err <= 1e-3, "remote multimodal prefill vs golden mm.logits: relative error {err:.2e}");
    // Without the image rows the node would compute something else: the check can fail.
    let plain = cpu_prefill(&cpu_model(&dir), &ids).1;
    assert!(rel_l2(&plain, last) > 1e-2, "the image rows do not matter for this prompt?");
}
