//! `k3-decode render` and `k3-decode parse`: the chat format as the server applies it, for
//! debugging prompts and for outside checks.
//!
//! - `render --model DIR --request REQ.json` prints the prompt of an OpenAI chat request body
//!   (messages, tools, tool_choice, response_format, `chat_template_kwargs`) as one JSON object:
//!   `{"text": <prompt, special tokens inline>, "segments": [[<string>, <is_special>], ...], "ids": [...]}`.
//! - `parse --model DIR --request REQ.json --ids IDS.json` prints how the server reads generated
//!   ids after that prompt: `{"reasoning", "content", "tool_calls": [{"name", "arguments"}],
//!   "finish_reason"}` (a stream without a stop id ends as `length`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use serde_json::{json, Value};

use crate::chat::parse::{FinishReason, OutputParser};
use crate::server::api;
use crate::tokenizer::Tokenizer;

/// Arguments of `k3-decode render`.
#[derive(clap::Args, Debug)]
pub struct RenderArgs {
    /// Model directory (its `tiktoken.model` and `tokenizer_config.json`).
    #[arg(long)]
    pub model: PathBuf,
    /// An OpenAI chat completion request body (JSON).
    #[arg(long)]
    pub request: PathBuf,
}

/// Arguments of `k3-decode parse`.
#[derive(clap::Args, Debug)]
pub struct ParseArgs {
    /// Model directory (its `tiktoken.model` and `tokenizer_config.json`).
    #[arg(long)]
    pub model: PathBuf,
    /// The request whose prompt the ids follow (thinking on or off, tools declared or not).
    #[arg(long)]
    pub request: PathBuf,
    /// Generated token ids: a JSON array of integers.
    #[arg(long)]
    pub ids: PathBuf,
}

fn load(model: &std::path::Path, request: &std::path::Path) -> anyhow::Result<(Arc<Tokenizer>, api::ChatRequest)> {
    let tok = Arc::new(Tokenizer::from_dir(model).with_context(|| format!("loading the tokenizer of {}", model.display()))?);
    let body = std::fs::read(request).with_context(|| format!("reading {}", request.display()))?;
    let v = api::parse_body(&body).map_err(|e| anyhow::anyhow!("{}: {}", request.display(), e.message))?;
    let served = v.get("model").and_then(crate::chat::Json::as_str).unwrap_or("k3").to_string();
    let req = api::chat_request(&v, &served, 0).map_err(|e| anyhow::anyhow!("{}: {}", request.display(), e.message))?;
    Ok((tok, req))
}

pub fn run_render(args: RenderArgs) -> anyhow::Result<()> {
    let (tok, req) = load(&args.model, &args.request)?;
    let v = api::render_json(&tok, &req).map_err(|e| anyhow::anyhow!("{}: {}", args.request.display(), e.message))?;
    println!("{v}");
    Ok(())
}

pub fn run_parse(args: ParseArgs) -> anyhow::Result<()> {
    let (tok, req) = load(&args.model, &args.request)?;
    let ids = k3_protocol::files::read_token_ids(&args.ids)?;
    let mut parser = OutputParser::new(tok, req.render.thinking, "call").map_err(|e| anyhow::anyhow!(e))?;
    if !req.tool_calls_allowed() {
        parser = parser.without_tool_calls();
    }
    for &id in &ids {
        parser.push(id);
    }
    parser.finish(FinishReason::Length);
    let out = parser.output();
    let calls: Vec<Value> = out.tool_calls.iter().map(|t| json!({"name": t.name, "arguments": t.arguments})).collect();
    let opt = |s: &str| if s.is_empty() { Value::Null } else { Value::String(s.to_string()) };
    let v = json!({
        "reasoning": opt(&out.reasoning),
        "content": opt(&out.content),
        "tool_calls": calls,
        "finish_reason": out.finish_reason.map(FinishReason::as_str),
    });
    println!("{v}");
    Ok(())
}
