//! The id-level output parser (spec K3_CHAT §3): reasoning, content and tool calls from
//! generated ids, streaming, and the malformed-markup rules of §3.4.

mod tokenizer_support;

use std::sync::Arc;

use mac_decoder::chat::parse::{FinishReason, OutputEvent, OutputParser};
use mac_decoder::chat::render::{render, RenderOptions};
use mac_decoder::chat::Json;
use mac_decoder::tokenizer::{Segment, Tokenizer};

fn tok() -> Arc<Tokenizer> {
    tokenizer_support::tokenizer()
}

/// Ids of model output written as markup (`<|…|>` are the special ids) with text in between
/// encoded as plain text, as the model would produce it.
fn out_ids(tok: &Tokenizer, parts: &[(&str, bool)]) -> Vec<u32> {
    let segs: Vec<Segment> = parts.iter().map(|(t, m)| Segment { text: t.to_string(), markup: *m }).collect();
    tok.encode_segments(&segs).unwrap()
}

/// Renders an assistant message as history and returns the ids the model would have generated
/// for it after a thinking generation prompt (everything after `O think S`), stop id included.
fn generated_ids_for(tok: &Tokenizer, assistant: &str, thinking: bool) -> Vec<u32> {
    let msgs = Json::parse(&format!(r#"[{{"role":"user","content":"go"}},{assistant}]"#)).unwrap();
    let opts = RenderOptions { add_generation_prompt: false, thinking, ..Default::default() };
    let ids = tok.encode_segments(&render(msgs.as_array().unwrap(), &opts).unwrap()).unwrap();
    let prompt_opts = RenderOptions { thinking, ..Default::default() };
    let prompt = tok.encode_segments(&render(&msgs.as_array().unwrap()[..1], &prompt_opts).unwrap()).unwrap();
    assert_eq!(&ids[..prompt.len()], &prompt[..], "the history render starts with the generation prompt");
    ids[prompt.len()..].to_vec()
}

fn run(tok: &Arc<Tokenizer>, ids: &[u32], thinking: bool) -> (OutputParser, Vec<OutputEvent>) {
    let mut p = OutputParser::new(tok.clone(), thinking, "call_t").unwrap();
    let mut ev = Vec::new();
    for &id in ids {
        ev.extend(p.push(id));
        if p.is_finished() {
            break;
        }
    }
    (p, ev)
}

#[test]
fn tool_call_round_trip_render_then_parse() {
    let tok = tok();
    // A string argument holding literal markup: only an id-level parser keeps it intact.
    let assistant = r#"{"role":"assistant","reasoning_content":"Check the weather. ünïcode 🚀","content":"Let me look.","tool_calls":[
        {"id":"x","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris <|close|>argument<|sep|>\", \"days\": 2, \"f\": 1.5, \"ok\": true, \"none\": null, \"obj\": {\"k\": [1, \"two\"]}}"}},
        {"id":"y","type":"function","function":{"name":"search","arguments":"{}"}}]}"#;
    let ids = generated_ids_for(&tok, assistant, true);
    let (p, events) = run(&tok, &ids, true);
    let out = p.output();
    assert_eq!(out.finish_reason, Some(FinishReason::ToolCalls));
    assert_eq!(out.reasoning, "Check the weather. ünïcode 🚀");
    assert_eq!(out.content, "Let me look.");
    assert_eq!(out.tool_calls.len(), 2);
    assert_eq!(out.tool_calls[0].name, "get_weather");
    assert_eq!(
        out.tool_calls[0].arguments,
        r#"{"city": "Paris <|close|>argument<|sep|>", "days": 2, "f": 1.5, "ok": true, "none": null, "obj": {"k": [1, "two"]}}"#
    );
    assert_eq!((out.tool_calls[1].name.as_str(), out.tool_calls[1].arguments.as_str()), ("search", "{}"));
    assert_eq!((out.tool_calls[0].index, out.tool_calls[1].index), (0, 1));
    assert_ne!(out.tool_calls[0].id, out.tool_calls[1].id);
    // Streamed deltas add up to the same, and no marker text leaks into any delta.
    let mut r = String::new();
    let mut c = String::new();
    for e in &events {
        match e {
            OutputEvent::Reasoning(s) => r.push_str(s),
            OutputEvent::Content(s) => c.push_str(s),
            OutputEvent::ToolCall(_) => {}
        }
    }
    assert_eq!((r.as_str(), c.as_str()), (out.reasoning.as_str(), out.content.as_str()));

    // The parsed message renders back to the same ids (history rebuilt from the parse).
    let back = format!(
        r#"{{"role":"assistant","reasoning_content":{},"content":{},"tool_calls":[{}]}}"#,
        serde_json::to_string(&out.reasoning).unwrap(),
        serde_json::to_string(&out.content).unwrap(),
        out.tool_calls
            .iter()
            .map(|t| format!(
                r#"{{"id":"{}","type":"function","function":{{"name":"{}","arguments":{}}}}}"#,
                t.id,
                t.name,
                serde_json::to_string(&t.arguments).unwrap()
            ))
            .collect::<Vec<_>>()
            .join(",")
    );
    assert_eq!(generated_ids_for(&tok, &back, true), ids);
}

#[test]
fn streaming_one_token_at_a_time_never_splits_characters() {
    let tok = tok();
    let ids = generated_ids_for(&tok, r#"{"role":"assistant","reasoning_content":"日本語のテキスト 🚀🔥","content":"👨‍👩‍👧 naïve"}"#, true);
    let (p, events) = run(&tok, &ids, true);
    for e in &events {
        if let OutputEvent::Reasoning(s) | OutputEvent::Content(s) = e {
            assert!(!s.contains('\u{FFFD}'), "{s:?}");
        }
    }
    assert_eq!(p.output().reasoning, "日本語のテキスト 🚀🔥");
    assert_eq!(p.output().content, "👨‍👩‍👧 naïve");
    assert_eq!(p.output().finish_reason, Some(FinishReason::Stop));
}

#[test]
fn non_thinking_output_starts_in_the_response() {
    let tok = tok();
    let ids = generated_ids_for(&tok, r#"{"role":"assistant","content":"Plain answer."}"#, false);
    let (p, _) = run(&tok, &ids, false);
    assert_eq!((p.output().reasoning.as_str(), p.output().content.as_str()), ("", "Plain answer."));
}

#[test]
fn length_cutoff_inside_tools_keeps_only_complete_calls() {
    let tok = tok();
    let ids = out_ids(
        &tok,
        &[
            ("why", false),
            ("<|close|>think<|sep|><|open|>response<|sep|>", true),
            ("ok", false),
            ("<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"a\" index=\"1\"<|sep|><|close|>call<|sep|><|open|>call tool=\"b\" index=\"2\"<|sep|><|open|>argument key=\"q\" type=\"string\"<|sep|>", true),
            ("half", false),
        ],
    );
    let (mut p, _) = run(&tok, &ids, true);
    assert!(!p.is_finished());
    p.finish(FinishReason::Length);
    let out = p.output();
    assert_eq!(out.finish_reason, Some(FinishReason::Length));
    assert_eq!(out.tool_calls.len(), 1);
    assert_eq!(out.tool_calls[0].name, "a");
    assert_eq!(out.content, "ok");
}

#[test]
fn stream_ending_in_think_is_all_reasoning() {
    let tok = tok();
    let ids = tok.encode("still thinking about it", false).unwrap();
    let (mut p, _) = run(&tok, &ids, true);
    p.finish(FinishReason::Length);
    assert_eq!(p.output().reasoning, "still thinking about it");
    assert_eq!(p.output().content, "");
}

#[test]
fn tolerant_of_missing_think_close_and_missing_sep() {
    let tok = tok();
    // `O response S` without closing think: reasoning ends implicitly.
    let ids = out_ids(
        &tok,
        &[("r1", false), ("<|open|>response<|sep|>", true), ("c1", false), ("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", true)],
    );
    let (p, _) = run(&tok, &ids, true);
    assert_eq!((p.output().reasoning.as_str(), p.output().content.as_str()), ("r1", "c1"));
    // `C think` directly followed by another marker without `S`.
    let ids = out_ids(&tok, &[("r2", false), ("<|close|>think<|open|>response<|sep|>", true), ("c2", false), ("<|end_of_msg|>", true)]);
    let (p, _) = run(&tok, &ids, true);
    assert_eq!((p.output().reasoning.as_str(), p.output().content.as_str()), ("r2", "c2"));
    // Whitespace around tag names; unknown tags dropped; a call without `tool` dropped; [EOS] stops.
    let ids = out_ids(
        &tok,
        &[
            ("r3", false),
            ("<|close|> think <|sep|><|open|>response<|sep|>", true),
            ("c3", false),
            ("<|open|>weird<|sep|>", true),
            ("!", false),
            ("<|close|>response<|sep|><|open|>tools<|sep|><|open|>call index=\"1\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>[EOS]", true),
        ],
    );
    let (p, _) = run(&tok, &ids, true);
    let out = p.output();
    assert_eq!((out.reasoning.as_str(), out.content.as_str()), ("r3", "c3!"));
    assert!(out.tool_calls.is_empty());
    assert_eq!(out.finish_reason, Some(FinishReason::Stop));
}

#[test]
fn non_string_argument_that_is_not_json_stays_a_string() {
    let tok = tok();
    let ids = out_ids(
        &tok,
        &[
            ("<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"n\" type=\"number\"<|sep|>", true),
            ("twelve", false),
            ("<|close|>argument<|sep|><|open|>argument key=\"n\" type=\"number\"<|sep|>", true),
            ("12", false),
            ("<|close|>argument<|sep|><|open|>argument key=\"s\"<|sep|>", true),
            ("  raw \"text\"\n", false),
            ("<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>", true),
        ],
    );
    let (p, _) = run(&tok, &ids, true);
    // The repeated key keeps its first position and its last value; a missing type is string.
    assert_eq!(p.output().tool_calls[0].arguments, r#"{"n": 12, "s": "  raw \"text\"\n"}"#);
    assert_eq!(p.output().finish_reason, Some(FinishReason::ToolCalls));
}

#[test]
fn think_block_opening_in_the_response_is_reasoning_not_content() {
    let tok = tok();
    let ids = out_ids(
        &tok,
        &[
            ("r1", false),
            ("<|close|>think<|sep|><|open|>response<|sep|>", true),
            ("c1 ", false),
            ("<|open|>think<|sep|>", true),
            ("more thought", false),
            ("<|close|>think<|sep|>", true),
            ("c2", false),
            ("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", true),
        ],
    );
    let (p, _) = run(&tok, &ids, true);
    assert_eq!((p.output().reasoning.as_str(), p.output().content.as_str()), ("r1more thought", "c1 c2"));
}

#[test]
fn a_stream_ending_inside_a_marker_leaves_no_fragment() {
    let tok = tok();
    // The stream ends inside a marker's header (`O tools` without `S`), in both channels.
    for (parts, thinking, want) in [
        (vec![("<|close|>think<|sep|><|open|>response<|sep|>", true), ("a ", false), ("<|open|>", true), ("tools", false)], true, ("", "a ")),
        (vec![("b ", false), ("<|close|>", true), ("response", false)], false, ("", "b ")),
        (vec![("thinking ", false), ("<|close|>", true)], true, ("thinking ", "")),
    ] {
        let ids = out_ids(&tok, &parts);
        let (mut p, mut ev) = run(&tok, &ids, thinking);
        ev.extend(p.finish(FinishReason::Length));
        assert_eq!((p.output().reasoning.as_str(), p.output().content.as_str()), want, "{parts:?}");
        let streamed: String = ev
            .iter()
            .filter_map(|e| match e {
                OutputEvent::Content(c) | OutputEvent::Reasoning(c) => Some(c.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(streamed, format!("{}{}", want.0, want.1), "{parts:?}");
        assert_eq!(p.output().finish_reason, Some(FinishReason::Length));
    }
    // The same markers *spelled* with ordinary tokens (what a random or undertrained model
    // writes) at the end of the stream: `<|`, `<|open|>tools`, `<|close|>response`.
    for tail in ["<|", "<|open|>tools", "<|close|>response", "<|open|>call tool=\"f\""] {
        let ids = out_ids(&tok, &[("<|close|>think<|sep|><|open|>response<|sep|>", true), (&format!("hello {tail}"), false)]);
        let (mut p, mut ev) = run(&tok, &ids, true);
        ev.extend(p.finish(FinishReason::Length));
        assert_eq!(p.output().content, "hello ", "{tail:?}");
        assert!(p.output().stripped_markers >= 1);
        let streamed: String = ev
            .iter()
            .filter_map(|e| match e {
                OutputEvent::Content(c) => Some(c.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(streamed, "hello ", "{tail:?}");
    }
    // Spelled markers inside the text are removed; other `<|...|>` text stays.
    let ids = out_ids(
        &tok,
        &[
            ("r<|close|>think<|sep|>", false),
            ("<|close|>think<|sep|><|open|>response<|sep|>", true),
            ("x <|close|>response<|sep|>y <|im_end|>", false),
            ("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", true),
        ],
    );
    let (p, _) = run(&tok, &ids, true);
    assert_eq!((p.output().reasoning.as_str(), p.output().content.as_str()), ("r", "x y <|im_end|>"));
}

#[test]
fn a_close_without_its_open_is_dropped() {
    let tok = tok();
    // Non-thinking prompt: `C think S`, `C tools S`, `C call S`, `C argument S` close nothing
    // and are dropped; the content channel goes on around them.
    let ids = out_ids(
        &tok,
        &[
            ("one ", false),
            ("<|close|>think<|sep|>", true),
            ("two ", false),
            ("<|close|>tools<|sep|>", true),
            ("three ", false),
            ("<|close|>call<|sep|><|close|>argument<|sep|><|close|>json<|sep|>", true),
            ("four", false),
            ("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", true),
        ],
    );
    let (p, _) = run(&tok, &ids, false);
    assert_eq!(p.output().content, "one two three four");
    assert_eq!(p.output().finish_reason, Some(FinishReason::Stop));
    assert_eq!(p.output().stripped_markers, 5);
    // Thinking prompt: `C response S` while still thinking closes nothing: still reasoning.
    let ids = out_ids(
        &tok,
        &[
            ("r1 ", false),
            ("<|close|>response<|sep|>", true),
            ("r2", false),
            ("<|close|>think<|sep|><|open|>response<|sep|>", true),
            ("c", false),
            ("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", true),
        ],
    );
    let (p, _) = run(&tok, &ids, true);
    assert_eq!((p.output().reasoning.as_str(), p.output().content.as_str()), ("r1 r2", "c"));
}

#[test]
fn a_call_to_an_undeclared_tool_is_reported_not_returned() {
    let tok = tok();
    let assistant = r#"{"role":"assistant","reasoning_content":"r","content":"Looking.","tool_calls":[
        {"id":"x","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}},
        {"id":"y","type":"function","function":{"name":"rm_rf","arguments":"{\"path\": \"/\"}"}}]}"#;
    let ids = generated_ids_for(&tok, assistant, true);
    let mut p = OutputParser::new(tok.clone(), true, "call_t").unwrap().with_declared_tools(vec!["get_weather".into()]);
    let mut ev = Vec::new();
    for &id in &ids {
        ev.extend(p.push(id));
    }
    let out = p.output();
    assert_eq!(out.tool_calls.len(), 1);
    assert_eq!(out.tool_calls[0].name, "get_weather");
    assert_eq!(out.undeclared_tool_calls, vec!["rm_rf".to_string()]);
    assert_eq!(out.content, r#"Looking.[call to undeclared tool "rm_rf": {"path": "/"}]"#);
    assert_eq!(out.finish_reason, Some(FinishReason::ToolCalls));
    assert!(ev.contains(&OutputEvent::Content(r#"[call to undeclared tool "rm_rf": {"path": "/"}]"#.into())));
    // Only undeclared calls: the reply is text, finish reason stop.
    let assistant = r#"{"role":"assistant","content":"","tool_calls":[{"id":"y","type":"function","function":{"name":"rm_rf","arguments":"{}"}}]}"#;
    let ids = generated_ids_for(&tok, assistant, false);
    let mut p = OutputParser::new(tok.clone(), false, "call_t").unwrap().with_declared_tools(vec!["get_weather".into()]);
    for &id in &ids {
        p.push(id);
    }
    assert!(p.output().tool_calls.is_empty());
    assert_eq!(p.output().finish_reason, Some(FinishReason::Stop));
}

#[test]
fn numbers_in_arguments_come_back_as_written() {
    let tok = tok();
    // The model writes numbers Python would print otherwise (`1.50`, `1e3`, a 23-digit
    // integer, `-0`): the call's arguments keep them, and the client's arguments string sent
    // back in the next turn renders to the ids the model generated.
    let ids = out_ids(
        &tok,
        &[
            ("<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"a\" type=\"number\"<|sep|>", true),
            ("1.50", false),
            ("<|close|>argument<|sep|><|open|>argument key=\"b\" type=\"object\"<|sep|>", true),
            ("{\"x\": 1e3, \"y\": [12345678901234567890123, -0, 2.5]}", false),
            ("<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>", true),
        ],
    );
    let mut all = out_ids(&tok, &[("<|close|>response<|sep|>", true)]);
    all.extend(&ids);
    let (p, _) = run(&tok, &all, false);
    let call = &p.output().tool_calls[0];
    assert_eq!(call.arguments, r#"{"a": 1.50, "b": {"x": 1e3, "y": [12345678901234567890123, -0, 2.5]}}"#);
    // Round trip: the history render of that call holds the same argument text.
    let history = Json::Array(vec![
        Json::parse(r#"{"role":"user","content":"go"}"#).unwrap(),
        Json::Object(vec![
            ("role".into(), "assistant".into()),
            ("content".into(), "".into()),
            (
                "tool_calls".into(),
                Json::Array(vec![Json::Object(vec![
                    ("id".into(), "c".into()),
                    ("type".into(), "function".into()),
                    ("function".into(), Json::Object(vec![("name".into(), "f".into()), ("arguments".into(), Json::Str(call.arguments.clone()))])),
                ])]),
            ),
        ]),
    ]);
    let opts = RenderOptions { thinking: false, add_generation_prompt: false, ..Default::default() };
    let text: String = render(history.as_array().unwrap(), &opts).unwrap().iter().map(|s| s.text.as_str()).collect();
    assert!(text.contains(r#"type="number"<|sep|>1.50<|close|>argument"#), "{text}");
    assert!(text.contains(r#"{"x": 1e3, "y": [12345678901234567890123, -0, 2.5]}"#), "{text}");
}

#[test]
fn tool_calls_are_dropped_when_the_request_allows_none() {
    let tok = tok();
    let assistant = r#"{"role":"assistant","reasoning_content":"r","content":"Let me look.","tool_calls":[
        {"id":"x","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]}"#;
    let ids = generated_ids_for(&tok, assistant, true);
    let mut p = OutputParser::new(tok.clone(), true, "call_t").unwrap().without_tool_calls();
    let mut ev = Vec::new();
    for &id in &ids {
        ev.extend(p.push(id));
    }
    assert!(p.output().tool_calls.is_empty());
    assert!(!ev.iter().any(|e| matches!(e, OutputEvent::ToolCall(_))));
    assert_eq!(p.output().finish_reason, Some(FinishReason::Stop));
    assert_eq!(p.output().content, "Let me look.");
}

#[test]
fn without_tools_a_written_call_leaves_only_the_content() {
    let tok = tok();
    // No tools declared (or tool_choice none): the call is dropped, its markers and argument
    // text never reach the content, which is the response channel.
    let assistant = r#"{"role":"assistant","content":"Plain answer.","tool_calls":[
        {"id":"x","type":"function","function":{"name":"f","arguments":"{\"q\": \"secret\"}"}}]}"#;
    let ids = generated_ids_for(&tok, assistant, false);
    let mut p = OutputParser::new(tok.clone(), false, "call_t").unwrap().without_tool_calls();
    let mut streamed = String::new();
    for &id in &ids {
        for e in p.push(id) {
            match e {
                OutputEvent::Content(c) => streamed.push_str(&c),
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    assert_eq!(streamed, "Plain answer.");
    assert_eq!(p.output().content, "Plain answer.");
    assert_eq!(p.output().finish_reason, Some(FinishReason::Stop));
}

#[test]
fn a_reply_budget_closes_the_reply_well_formed() {
    use mac_decoder::chat::budget::{ReplyBudget, CLOSE_ALLOWANCE};
    use mac_decoder::sampler::TokenConstraint;
    let tok = tok();
    let vocab = tok.vocab_size() as usize;
    // A "model" that only writes ordinary text (never a marker): the budget must end it.
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for (thinking, total) in [(true, 20usize), (false, 9), (true, 1)] {
        let mut budget = ReplyBudget::half(tok.clone(), thinking, total).unwrap();
        let mut p = OutputParser::new(tok.clone(), thinking, "call_t").unwrap();
        let mut n = 0;
        while !p.is_finished() {
            assert!(n < total + CLOSE_ALLOWANCE, "the reply was not closed");
            let mut logits = vec![0f32; vocab];
            for (i, l) in logits.iter_mut().enumerate() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                // ordinary ids only: specials never win unless forced
                *l = if tok.is_special(i as u32) { -1e9 } else { (rng % 1000) as f32 };
            }
            budget.mask(&mut logits).unwrap();
            let id = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
            budget.commit(id).unwrap();
            p.push(id);
            n += 1;
        }
        let out = p.output();
        assert_eq!(out.finish_reason, Some(FinishReason::Stop), "thinking {thinking}, total {total}");
        if total > 2 {
            assert!(!out.content.is_empty(), "the response got its share");
            assert_eq!(!out.reasoning.is_empty(), thinking);
        }
        assert!(n <= total + CLOSE_ALLOWANCE);
    }
}
