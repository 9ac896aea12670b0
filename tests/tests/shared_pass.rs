//! The shared weight pass (issue 22): requests waiting on the prefill node when a pass starts are
//! prefilled together, layer by layer — each layer's weights once — while each keeps its own
//! tokens, positions, session base and state. The results must be those of one-at-a-time runs,
//! bitwise, on the CPU reference (f32).

use std::sync::Arc;
use std::time::Duration;

use cuda_prefiller::executor::{self, ExecOptions, LogitsRows, PassRequest, PrefillInput, WeightFeed};
use cuda_prefiller::server::{RequestOutcome, ServeOptions};
use k3_e2e_tests::*;
use k3_protocol::handoff::{token_prefix_hash, HandoffState, LayerState};
use k3_protocol::transport::PrefillClient;
use k3_protocol::wire::{BasePrefix, PrefillOptions, PrefillRequest, SessionId, StateLayout};

/// Counts the weight passes a feed serves (layer 0 handed out once per pass).
struct CountingFeed {
    layer_calls: Vec<usize>,
}

impl<B: cuda_prefiller::backend::Backend> WeightFeed<B> for CountingFeed {
    fn layer(&mut self, model: &cuda_prefiller::model::Model<B>, l: usize) -> anyhow::Result<Arc<cuda_prefiller::model::LayerWeights<B>>> {
        self.layer_calls[l] += 1;
        model.layer(l)
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The layer states' values, bit for bit (KDA: the whole state; MLA: every latent row).
fn state_bits(s: &HandoffState) -> Vec<Vec<u32>> {
    s.layers
        .iter()
        .map(|l| match l {
            LayerState::Kda(k) => [&k.recurrent, &k.conv_q, &k.conv_k, &k.conv_v].into_iter().flat_map(|v| v.iter()).map(|v| v.to_bits()).collect(),
            LayerState::Mla(m) => bits(&m.latent),
        })
        .collect()
}

#[test]
fn a_shared_pass_equals_separate_runs_bitwise() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let model = cpu_model(&dir);
    // Small chunks: the longest prompt spans several chunks (the MoE's many-chunk path).
    let opts = ExecOptions { chunk_tokens: 64, logits: LogitsRows::Last, trace_last: true, ..Default::default() };
    let turn1 = prompt(7, 90, 1000);
    let prompts = [prompt(1, 150, 1000), prompt(2, 33, 1000), prompt(3, 70, 1000)];

    // One at a time; request 2 continues a session of `turn1`.
    let mut based = HandoffState::empty(&model.cfg);
    executor::prefill(&model, &mut based, PrefillInput::tokens(&turn1), &opts, |_| Ok(())).unwrap();
    let starts = [HandoffState::empty(&model.cfg), HandoffState::empty(&model.cfg), based];
    let mut alone = Vec::new();
    for (p, s) in prompts.iter().zip(&starts) {
        let mut st = s.clone();
        let out = executor::prefill(&model, &mut st, PrefillInput::tokens(p), &opts, |_| Ok(())).unwrap();
        alone.push((st, out));
    }

    // Together, plus a fourth request that is refused (a token outside the vocabulary): it drops
    // out with its error and its state untouched, the others are unaffected.
    let mut states: Vec<HandoffState> = starts.to_vec();
    states.push(HandoffState::empty(&model.cfg));
    let bad = vec![1, 2, model.cfg.vocab_size as u32 + 5];
    let mut seen = vec![Vec::new(); 4];
    let mut feed = CountingFeed { layer_calls: vec![0; model.plan.len()] };
    let outs = {
        let mut reqs: Vec<PassRequest<'_, '_>> = states
            .iter_mut()
            .zip(prompts.iter().map(|p| p.as_slice()).chain([bad.as_slice()]))
            .map(|(state, tokens)| PassRequest { state, input: PrefillInput::tokens(tokens) })
            .collect();
        executor::prefill_many_with(&model, &mut feed, &mut reqs, &opts, |i, ev| {
            seen[i].push((ev.layer, ev.base_tokens, ev.new_tokens));
            Ok(())
        })
        .unwrap()
    };
    assert!(feed.layer_calls.iter().all(|&c| c == 1), "each layer's weights are taken once: {:?}", feed.layer_calls);
    let err = outs[3].as_ref().expect_err("the bad request fails");
    assert!(format!("{err:#}").contains("outside the vocabulary"), "{err:#}");
    assert_eq!(states[3].tokens, 0, "the failed request's state is untouched");
    assert!(seen[3].is_empty());
    for (i, ((st, want), got)) in alone.iter().zip(&outs).enumerate() {
        let got = got.as_ref().unwrap_or_else(|e| panic!("request {i}: {e:#}"));
        assert_eq!(states[i].tokens, st.tokens, "request {i}: tokens");
        assert!(bits(&got.logits) == bits(&want.logits), "request {i}: logits differ from a separate run");
        assert!(state_bits(&states[i]) == state_bits(st), "request {i}: state differs from a separate run");
        assert_eq!(got.trace, want.trace, "request {i}: hidden trace");
        assert_eq!(got.topk_gap, want.topk_gap, "request {i}: router gaps");
        let base = starts[i].tokens;
        let want_events: Vec<_> = (0..model.plan.len()).map(|l| (l, base, prompts[i].len())).collect();
        assert_eq!(seen[i], want_events, "request {i}: one event per layer with its own base");
    }
}

/// One decoder's request over QUIC: the delta state and the last logits.
async fn request(
    addr: std::net::SocketAddr,
    cfg: k3_protocol::transport::NodeConfig,
    session: SessionId,
    base: Option<&[u32]>,
    tokens: Vec<u32>,
    c: &k3_protocol::TextConfig,
    start: Arc<tokio::sync::Barrier>,
) -> (HandoffState, Vec<f32>) {
    let mut client = PrefillClient::connect(addr, cfg).await.expect("connect");
    let options = PrefillOptions { keep_session: true, return_last_logits: true, ..PrefillOptions::default() };
    if let Some(first) = base {
        // The session's first turn, alone, before the others start.
        let expected = StateLayout::for_model(c, first.len());
        let req = PrefillRequest { session, base: None, tokens: first.to_vec(), image_embeddings: None, options: options.clone() };
        client.prefill(req, &expected).await.expect("first turn").collect().await.expect("first turn state");
    }
    let base = base.map(|b| BasePrefix { tokens: b.len() as u64, token_prefix_hash: token_prefix_hash(b) });
    let expected = StateLayout::for_model(c, tokens.len());
    let req = PrefillRequest { session, base, tokens, image_embeddings: None, options };
    start.wait().await;
    let (state, summary) = client.prefill(req, &expected).await.expect("request").collect().await.expect("state");
    client.close().await;
    (state, summary.last_logits.expect("last logits"))
}

#[test]
fn three_decoders_at_once_share_weight_passes_with_separate_results() {
    init_tracing();
    let dir = golden_dir("tiny-a");
    let fp = fingerprint_of(&dir);
    let model = cpu_model(&dir);
    let (scfg, ccfg) = paired(fp, fp);
    // Slow layers: the requests that arrive while the first pass runs surely wait for the next.
    let node = start_node(&dir, scfg, ServeOptions { layer_delay: Duration::from_millis(150), ..ServeOptions::default() });
    let addr = node.local_addr();
    let turn1 = prompt(7, 90, 1000);
    let prompts = [prompt(1, 150, 1000), prompt(2, 33, 1000), prompt(3, 70, 1000)];
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let start = Arc::new(tokio::sync::Barrier::new(3));
    let got: Vec<(HandoffState, Vec<f32>)> = rt.block_on(async {
        let tasks: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (ccfg, c, start, p, turn1) = (ccfg.clone(), model.cfg.clone(), start.clone(), p.clone(), turn1.clone());
                tokio::spawn(async move { request(addr, ccfg, SessionId::random(), (i == 2).then_some(turn1.as_slice()), p, &c, start).await })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("decoder task"));
        }
        out
    });
    let recs = records(&node, 4);
    assert!(recs.iter().all(|r| r.outcome == RequestOutcome::Completed), "{recs:?}");
    let c = node.snapshot().counters;
    eprintln!("{} requests completed in {} weight passes", c.completed, c.weight_passes);
    assert_eq!(c.completed, 4);
    assert!(c.weight_passes < c.completed, "the three concurrent requests shared passes: {} passes for {} requests", c.weight_passes, c.completed);
    assert!(recs.iter().any(|r| r.pass_requests >= 2), "{recs:?}");
    assert_eq!(c.pass_requests, c.completed, "every request ran in exactly one pass");
    let text = cuda_prefiller::server::metrics::openmetrics(&c, &Default::default(), None, None);
    assert!(text.lines().any(|l| l == format!("k3_prefill_weight_passes_total {}", c.weight_passes)), "{text}");

    // One at a time on the CPU reference: bitwise the same states and logits.
    let opts = ExecOptions { logits: LogitsRows::Last, ..Default::default() };
    for (i, (p, (delta, logits))) in prompts.iter().zip(&got).enumerate() {
        let mut st = HandoffState::empty(&model.cfg);
        if i == 2 {
            executor::prefill(&model, &mut st, PrefillInput::tokens(&turn1), &opts, |_| Ok(())).unwrap();
        }
        let base = st.tokens;
        let out = executor::prefill(&model, &mut st, PrefillInput::tokens(p), &opts, |_| Ok(())).unwrap();
        assert!(bits(logits) == bits(&out.logits), "decoder {i}: logits differ from a one-at-a-time run");
        for (l, (d, s)) in delta.layers.iter().zip(&st.layers).enumerate() {
            let same = match (d, s) {
                (LayerState::Mla(d), LayerState::Mla(s)) => bits(&d.latent) == bits(&s.latent[base * s.width..]),
                (LayerState::Kda(_), LayerState::Kda(_)) => state_bits(&single(d)) == state_bits(&single(s)),
                _ => false,
            };
            assert!(same, "decoder {i}: layer {l}'s state differs from a one-at-a-time run");
        }
    }
    node.shutdown();
}

/// A one-layer state holding `l` (for [`state_bits`]).
fn single(l: &LayerState) -> HandoffState {
    HandoffState { tokens: 0, layers: vec![l.clone()] }
}
