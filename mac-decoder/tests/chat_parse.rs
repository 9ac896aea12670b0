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
            .map(|t| format!(r#"{{"id":"{}","type":"function","function":{{"name":"{}","arguments":{}}}}}"#, t.id, t.name, serde_json::to_string(&t.arguments).unwrap()))
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
    let ids = out_ids(&tok, &[("r1", false), ("<|open|>response<|sep|>", true), ("c1", false), ("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", true)]);
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
fn unterminated_marker_at_the_end_keeps_its_text() {
    let tok = tok();
    let ids = out_ids(&tok, &[("<|close|>think<|sep|><|open|>response<|sep|>", true), ("a ", false), ("<|open|>", true), ("tail", false)]);
    let (mut p, _) = run(&tok, &ids, true);
    let ev = p.finish(FinishReason::Length);
    assert_eq!(p.output().content, "a tail");
    assert!(ev.contains(&OutputEvent::Content("tail".into())), "{ev:?}");
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
