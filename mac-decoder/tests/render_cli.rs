//! `k3-decode render` and `k3-decode parse` on the trained tiny-t model's tokenizer: the render
//! equals the library's (segments and ids), and parsing ids of a rendered reply gives it back.

use std::process::Command;

use mac_decoder::tokenizer::{Segment, Tokenizer};
use serde_json::{json, Value};

fn run(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_k3-decode")).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn render_and_parse_commands() {
    let model = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/models/tiny-t");
    let tok = Tokenizer::from_dir(&model).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("req.json");
    std::fs::write(
        &req,
        json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|open|> there"}],
               "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
        .to_string(),
    )
    .unwrap();
    let m = model.to_str().unwrap();
    let r = run(&["render", "--model", m, "--request", req.to_str().unwrap()]);
    let segs: Vec<Segment> =
        r["segments"].as_array().unwrap().iter().map(|s| Segment { text: s[0].as_str().unwrap().into(), markup: s[1].as_bool().unwrap() }).collect();
    let ids: Vec<u32> = r["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    assert_eq!(tok.encode_segments(&segs).unwrap(), ids);
    assert_eq!(r["text"].as_str().unwrap(), segs.iter().map(|s| s.text.as_str()).collect::<String>());
    assert!(r["text"].as_str().unwrap().ends_with("<|open|>think<|sep|>"));
    // The user's literal "<|open|>" is text, not the special token.
    let open = tok.special_id("<|open|>").unwrap();
    assert!(segs.iter().any(|s| !s.markup && s.text.contains("<|open|>")));
    assert!(ids.iter().filter(|&&i| i == open).count() < r["text"].as_str().unwrap().matches("<|open|>").count());

    let reply = [
        Segment::text("thought"),
        Segment::markup("<|close|>think<|sep|><|open|>response<|sep|>"),
        Segment::text("Hello"),
        Segment::markup(
            "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"a\" type=\"number\"<|sep|>",
        ),
        Segment::text("3"),
        Segment::markup("<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"),
    ];
    let gen = dir.path().join("ids.json");
    std::fs::write(&gen, serde_json::to_string(&tok.encode_segments(&reply).unwrap()).unwrap()).unwrap();
    let p = run(&["parse", "--model", m, "--request", req.to_str().unwrap(), "--ids", gen.to_str().unwrap()]);
    assert_eq!(p, json!({"reasoning": "thought", "content": "Hello", "tool_calls": [{"name": "f", "arguments": "{\"a\": 3}"}], "finish_reason": "tool_calls"}));
}
