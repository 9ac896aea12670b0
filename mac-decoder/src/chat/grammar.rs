//! Grammars of constrained K3 replies, in llguidance's Lark syntax (special tokens as
//! `<|name|>`, inline JSON schemas as `%json {...}`).
//!
//! The grammar covers the whole assistant message after the generation prompt (spec K3_CHAT
//! §3.1): the reasoning (free text, thinking mode only) and its `C think S O response S`, then
//! - for `response_format` json_object / json_schema: a JSON value as the response channel;
//! - for `tool_choice` "required" / a named tool: an empty response channel and a tools block of
//!   well-formed calls (one or more of any declared tool; exactly one of the named tool), each
//!   argument an XTML `argument` element whose value matches its property's schema (a raw string
//!   for string properties, JSON otherwise), or, where the parameters are not a plain object of
//!   properties, one `json` element holding the whole arguments object;
//!
//! and ends with `C message S`, after which the matcher allows only the stop token.

use super::json::Json;
use super::render::escape_attr;
use crate::tokenizer::TokenizerError;

/// Why a reply cannot be constrained: what the request lacks (a client error), or why the
/// tokenizer or llguidance cannot serve grammars.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("tools[{0}] has no function name")]
    NoToolName(usize),
    #[error("the tool {0:?} is not declared in `tools`")]
    ToolNotDeclared(String),
    #[error("no tools are declared")]
    NoTools,
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("token {0} has no bytes")]
    TokenWithoutBytes(u32),
    #[error("llguidance: {0}")]
    Llguidance(String),
    #[error("the grammar cannot be used: {0}")]
    Unusable(String),
}

/// What a constrained reply must be.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyShape {
    /// `response_format: {"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `response_format: {"type": "json_schema"}`: a JSON value valid against the schema.
    JsonSchema(Json),
    /// `tool_choice: "required"` (`only` None: any declared tool, one or more calls) or a named
    /// tool (`only` Some: exactly one call to it). `tools` is the request's `tools` array.
    ToolCalls { tools: Json, only: Option<String> },
}

/// JSON generation options: no free whitespace (a random or wandering model cannot pad
/// forever), Python's separators (what the model saw in rendered JSON).
const JSON_OPTIONS: &str = r#"{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}"#;

/// A Lark string literal (JSON string syntax).
fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// `%json {schema}` with the generation options.
fn json_rule(schema: &Json) -> String {
    let mut entries = match schema {
        Json::Object(e) => e.iter().filter(|(k, _)| k != "x-guidance").cloned().collect(),
        // `true` / non-object schemas: anything.
        _ => Vec::new(),
    };
    entries.push(("x-guidance".into(), Json::parse(JSON_OPTIONS).expect("valid options")));
    format!("%json {}", Json::Object(entries).dumps_compact())
}

/// The schema's single `type`, if it has one.
fn single_type(schema: &Json) -> Option<&str> {
    match schema.get("type") {
        Some(Json::Str(t)) => Some(t),
        Some(Json::Array(a)) if a.len() == 1 => a[0].as_str(),
        _ => None,
    }
}

/// Strings a property allows, when they are a closed set (`enum` / `const` of strings).
fn string_set(schema: &Json) -> Option<Vec<String>> {
    if let Some(Json::Str(c)) = schema.get("const") {
        return Some(vec![c.clone()]);
    }
    let e = schema.get("enum")?.as_array()?;
    e.iter().map(|v| v.as_str().map(str::to_string)).collect()
}

/// The XTML `type` attribute and the value rule of one argument.
fn argument_value(schema: &Json, rules: &mut Vec<String>, name: &str) -> (&'static str, String) {
    if let Some(set) = string_set(schema) {
        let alts: Vec<String> = set.iter().map(|s| lit(s)).collect();
        return ("string", format!("({})", alts.join(" | ")));
    }
    let ty = single_type(schema);
    let plain_string = ty == Some("string") && ["pattern", "format", "minLength", "enum", "const"].iter().all(|k| schema.get(k).is_none());
    if plain_string {
        // The raw text up to the argument's close marker (special tokens cannot occur in it).
        let max = match schema.get("maxLength") {
            Some(Json::Int(n)) if *n >= 0 => n.to_string(),
            Some(Json::UInt(n)) => n.to_string(),
            _ => String::new(),
        };
        let term = format!("{}_TEXT", name.to_uppercase());
        rules.push(format!("{term}: /(?s:.{{0,{max}}})/"));
        return ("string", term);
    }
    let label = match ty {
        Some("integer") | Some("number") => "number",
        Some("boolean") => "boolean",
        Some("null") => "null",
        Some("array") => "array",
        // A string with a pattern / format is written as a JSON string: the parser reads
        // non-"string" types as JSON, so it arrives as a string all the same.
        Some("string") => "object",
        _ => "object",
    };
    (label, json_rule(schema))
}

/// The arguments rule of one tool (`args_{i}`) and its helper rules.
fn tool_arguments(i: usize, params: Option<&Json>, rules: &mut Vec<String>) -> String {
    let empty = Json::Object(vec![("type".into(), Json::Str("object".into()))]);
    let params = params.filter(|p| !p.is_null()).unwrap_or(&empty);
    let props = params.get("properties").and_then(Json::as_object);
    let simple = single_type(params) == Some("object")
        && ["patternProperties", "anyOf", "oneOf", "allOf", "$ref", "if", "dependentRequired", "minProperties"].iter().all(|k| params.get(k).is_none());
    let rule = format!("args_{i}");
    let Some(props) = props.filter(|_| simple) else {
        // The whole object in one `json` element.
        rules.push(format!("{rule}: <|open|> {} <|sep|> {} <|close|> {} <|sep|>", lit("json type=\"object\""), json_rule(params), lit("json")));
        return rule;
    };
    let required: Vec<&str> = params.get("required").and_then(Json::as_array).map(|r| r.iter().filter_map(Json::as_str).collect()).unwrap_or_default();
    let mut parts = Vec::new();
    for (k, (key, schema)) in props.iter().enumerate() {
        let (label, value) = argument_value(schema, rules, &format!("a{i}_{k}"));
        let header = format!("argument key=\"{}\" type=\"{label}\"", escape_attr(key));
        let arg = format!("arg_{i}_{k}");
        rules.push(format!("{arg}: <|open|> {} <|sep|> {value} <|close|> {} <|sep|>", lit(&header), lit("argument")));
        parts.push(if required.contains(&key.as_str()) { arg } else { format!("{arg}?") });
    }
    rules.push(format!("{rule}: {}", if parts.is_empty() { "\"\"".to_string() } else { parts.join(" ") }));
    rule
}

/// The Lark grammar of a reply of `shape` after a generation prompt in thinking mode
/// (`thinking`: the prompt ends `O think S`) or not (it ends `O response S`). Errors name
/// what the request lacks (a named tool that is not declared, a tool without a name).
pub fn reply_grammar(shape: &ReplyShape, thinking: bool) -> Result<String, GrammarError> {
    let mut rules: Vec<String> = Vec::new();
    let (body, tail) = match shape {
        ReplyShape::JsonObject => (json_rule(&Json::parse(r#"{"type": "object"}"#).expect("valid")), String::new()),
        ReplyShape::JsonSchema(schema) => (json_rule(schema), String::new()),
        ReplyShape::ToolCalls { tools, only } => {
            let declared = tools.as_array().unwrap_or_default();
            let mut calls = Vec::new();
            for (i, t) in declared.iter().enumerate() {
                let f = t.get("function").unwrap_or(t);
                let Some(name) = f.get("name").and_then(Json::as_str).filter(|n| !n.is_empty()) else {
                    return Err(GrammarError::NoToolName(i));
                };
                if only.as_deref().is_some_and(|o| o != name) {
                    continue;
                }
                let args = tool_arguments(i, f.get("parameters"), &mut rules);
                let call = format!("call_{i}");
                rules.push(format!(
                    "{call}: <|open|> {} CALL_INDEX {} <|sep|> {args} <|close|> {} <|sep|>",
                    lit(&format!("call tool=\"{}\" index=\"", escape_attr(name))),
                    lit("\""),
                    lit("call")
                ));
                calls.push(call);
            }
            if calls.is_empty() {
                return Err(match only {
                    Some(n) => GrammarError::ToolNotDeclared(n.clone()),
                    None => GrammarError::NoTools,
                });
            }
            rules.push(format!("call: {}", calls.join(" | ")));
            rules.push("CALL_INDEX: /[1-9][0-9]{0,2}/".to_string());
            let n = if only.is_some() { "call" } else { "call+" };
            let tools_block = format!("<|open|> {} <|sep|> {n} <|close|> {} <|sep|>", lit("tools"), lit("tools"));
            (String::new(), tools_block)
        }
    };
    let reasoning = if thinking {
        rules.push("THINK_TEXT: /(?s:.*)/".to_string());
        format!("THINK_TEXT <|close|> {} <|sep|> <|open|> {} <|sep|> ", lit("think"), lit("response"))
    } else {
        String::new()
    };
    let start = format!(
        "start: {reasoning}{body} <|close|> {r} <|sep|> {tail} <|close|> {m} <|sep|>",
        body = if body.is_empty() { String::new() } else { "reply_body".to_string() },
        r = lit("response"),
        m = lit("message"),
    );
    let mut out = vec![start];
    if !body.is_empty() {
        out.push(format!("reply_body: {body}"));
    }
    out.extend(rules);
    Ok(out.join("\n") + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_grammar_names_every_argument_and_marks_optional_ones() {
        let tools = Json::parse(
            r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
               "properties":{"city":{"type":"string"},"unit":{"enum":["c","f"]},"days":{"type":"integer"}},"required":["city"]}}},
               {"type":"function","function":{"name":"other"}}]"#,
        )
        .unwrap();
        let g = reply_grammar(&ReplyShape::ToolCalls { tools: tools.clone(), only: Some("get_weather".into()) }, false).unwrap();
        assert!(g.contains(r#""call tool=\"get_weather\" index=\"""#), "{g}");
        assert!(g.contains(r#""argument key=\"city\" type=\"string\"""#), "{g}");
        assert!(g.contains(r#"("c" | "f")"#), "{g}");
        assert!(g.contains("arg_0_1?") && g.contains("arg_0_2?") && !g.contains("arg_0_0?"), "{g}");
        assert!(!g.contains("other"), "{g}");
        assert!(!g.contains("THINK_TEXT"));
        let g = reply_grammar(&ReplyShape::ToolCalls { tools, only: None }, true).unwrap();
        assert!(g.contains("call+") && g.contains("other") && g.contains("THINK_TEXT"), "{g}");
        assert!(reply_grammar(&ReplyShape::ToolCalls { tools: Json::parse("[]").unwrap(), only: Some("x".into()) }, true).is_err());
    }
}
