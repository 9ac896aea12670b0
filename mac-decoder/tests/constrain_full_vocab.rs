//! Constrained decoding at K3's full vocabulary size (163,840 ids): llguidance's token trie over
//! the test tokenizer, with the ranks the golden cases do not pin filled by distinct word-like
//! tokens (so the trie branches like a real BPE vocabulary), random logits standing in for the
//! model. Every json_schema reply parses and validates, every forced named-tool reply is one
//! well-formed call with valid arguments; prints the mask time per token.

mod tokenizer_support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use mac_decoder::chat::constrain::Grammars;
use mac_decoder::chat::grammar::ReplyShape;
use mac_decoder::chat::parse::{FinishReason, OutputParser};
use mac_decoder::chat::Json;
use mac_decoder::decode_loop::{generate_constrained, GenerateParams, TokenStep};
use mac_decoder::sampler::SamplingParams;
use mac_decoder::tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};

fn word_like_tokenizer() -> Arc<Tokenizer> {
    let mut ranks = tokenizer_support::ranks();
    let mut seen: HashSet<Vec<u8>> = ranks.iter().filter(|r| r.first() != Some(&0xF8)).cloned().collect();
    let letters = b"etaoinshrdlcumwfgypbvkjxqz";
    for (r, slot) in ranks.iter_mut().enumerate() {
        if slot.first() != Some(&0xF8) {
            continue;
        }
        // A word of 1-6 letters from the rank, with a leading space or capital for some.
        let mut w = Vec::new();
        match r % 4 {
            0 | 1 => w.push(b' '),
            _ => {}
        }
        let mut n = r / 4 + 1;
        while n > 0 {
            w.push(letters[n % 26]);
            n /= 26;
        }
        if r % 4 == 1 {
            let i = w.len() - 1;
            w[i] = w[i].to_ascii_uppercase();
        }
        if seen.insert(w.clone()) {
            *slot = w;
        }
    }
    Arc::new(Tokenizer::from_parts(ranks, &tokenizer_support::named_specials(), 256).unwrap())
}

/// Random logits (the stand-in model), a new row per fed token.
struct RandomModel {
    rng: rand::rngs::StdRng,
    logits: Vec<f32>,
}

impl TokenStep for RandomModel {
    fn next_logits(&self) -> Option<&[f32]> {
        Some(&self.logits)
    }
    fn feed(&mut self, _: u32) -> anyhow::Result<()> {
        for l in self.logits.iter_mut() {
            *l = self.rng.gen::<f32>() * 4.0;
        }
        Ok(())
    }
}

fn valid(v: &serde_json::Value) -> bool {
    let Some(o) = v.as_object() else { return false };
    o.len() == 3
        && ["fast", "slow", "auto"].contains(&o.get("mode").and_then(|m| m.as_str()).unwrap_or(""))
        && o.get("verbose").is_some_and(|b| b.is_boolean())
        && ["low", "high"].contains(&o.get("level").and_then(|m| m.as_str()).unwrap_or(""))
}

#[test]
fn constrained_replies_at_full_vocabulary() {
    let tok = word_like_tokenizer();
    let vocab = tok.vocab_size() as usize;
    assert_eq!(vocab, 163_840);
    let t = Instant::now();
    let grammars = Grammars::new(tok.clone()).unwrap();
    println!("token trie + parser factory for {vocab} ids: {:.2} s", t.elapsed().as_secs_f64());
    let schema = Json::parse(
        r#"{"type":"object","properties":{"mode":{"type":"string","enum":["fast","slow","auto"]},"verbose":{"type":"boolean"},
            "level":{"enum":["low","high"]}},"required":["mode","verbose","level"],"additionalProperties":false}"#,
    )
    .unwrap();
    let tools = Json::parse(&format!(
        r#"[{{"type":"function","function":{{"name":"set_mode","parameters":{}}}}},{{"type":"function","function":{{"name":"other"}}}}]"#,
        schema.dumps_compact()
    ))
    .unwrap();
    let end = tok.special_id("<|end_of_msg|>").unwrap();
    let (mut mask_s, mut steps) = (0.0, 0usize);
    for (shape, name) in
        [(ReplyShape::JsonSchema(schema.clone()), "json_schema"), (ReplyShape::ToolCalls { tools: tools.clone(), only: Some("set_mode".into()) }, "named tool")]
    {
        let mut good = 0;
        for seed in 0..20u64 {
            let mut c = grammars.constraint(&shape, false).unwrap();
            let mut model = RandomModel { rng: rand::rngs::StdRng::seed_from_u64(seed), logits: vec![0.0; vocab] };
            model.feed(0).unwrap();
            let params = GenerateParams {
                max_new_tokens: 300,
                sampling: SamplingParams { greedy: false, temperature: 1.0, top_p: 1.0, top_k: 0, seed },
                stop_tokens: vec![end],
                logprobs: None,
            };
            let out = generate_constrained(&mut model, &params, Some(&mut c), |_| true).unwrap();
            mask_s += out.mask_time.as_secs_f64();
            steps += out.tokens.len();
            let mut p = OutputParser::new(tok.clone(), false, "call").unwrap();
            for &id in &out.tokens {
                p.push(id);
            }
            p.finish(FinishReason::Length);
            let o = p.output();
            let ok = match &shape {
                ReplyShape::JsonSchema(_) => serde_json::from_str(&o.content).is_ok_and(|v| valid(&v)),
                _ => o.tool_calls.len() == 1 && o.tool_calls[0].name == "set_mode" && serde_json::from_str(&o.tool_calls[0].arguments).is_ok_and(|v| valid(&v)),
            };
            if !ok {
                println!("{name} seed {seed}: {:?} -> {o:?}", tok.decode(&out.tokens));
            }
            good += ok as usize;
            assert_eq!(o.finish_reason, Some(if matches!(shape, ReplyShape::JsonSchema(_)) { FinishReason::Stop } else { FinishReason::ToolCalls }));
        }
        println!("{name}: {good}/20 valid");
        assert_eq!(good, 20, "{name}");
    }
    println!("mask: {:.3} ms per token over {steps} tokens at {vocab} ids", 1e3 * mask_s / steps as f64);
}
