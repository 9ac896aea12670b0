//! `k3-decode generate` with `--prefill-node` and/or `--next-turn`: a conversation of one or
//! more turns, each prompt routed to the prefill node or prefilled locally, the timing table of
//! every turn on stderr. stdout (and `--out`) carry `{"tokens": [...]}` — the last turn's tokens —
//! plus `"turns": [[...], ...]` when there is more than one turn.

use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::cli::generate::{read_ids, Args};
use crate::decode::{Engine, EngineOptions};
use crate::remote::{format_table, run_turn, Conversation, RemotePrefiller};

pub fn run_generate(args: &Args) -> Result<()> {
    if args.state.is_some() {
        bail!("--state cannot be combined with --prefill-node or --next-turn (a conversation starts from its prompt ids)");
    }
    let first = args.input_ids.as_deref().context("--prefill-node and --next-turn need --input-ids (the first turn's prompt)")?;
    let mut turns = vec![read_ids(first)?];
    for p in &args.next_turn {
        turns.push(read_ids(p)?);
    }
    if let Some((i, _)) = turns.iter().enumerate().find(|(_, t)| t.is_empty()) {
        bail!("turn {} has no token ids", i + 1);
    }
    let engine = Engine::load_with(
        &args.model,
        EngineOptions { prefill_chunk: args.prefill_chunk, progress: std::io::IsTerminal::is_terminal(&std::io::stderr()) },
    )?;
    let mut remote = match args.node.remote_options() {
        Some(mut o) => {
            o.retry_after = Duration::from_secs(30);
            Some(RemotePrefiller::new(&engine, o)?)
        }
        None => None,
    };
    let params = args.generate_params(engine.eos_token());
    let mut conv = Conversation::new(&engine)?;
    let mut outputs = Vec::new();
    let mut timings = Vec::new();
    for (i, prompt) in turns.iter().enumerate() {
        let (out, t) = run_turn(&engine, &mut conv, remote.as_mut(), prompt, None, &params, |_| true)
            .with_context(|| format!("turn {}", i + 1))?;
        tracing::info!(
            turn = i + 1,
            route = t.route.as_str(),
            prompt = prompt.len(),
            context = t.context_tokens,
            generated = out.tokens.len(),
            first_token_s = t.first_token_s.map(|v| format!("{v:.3}")).unwrap_or_default(),
            "turn done"
        );
        outputs.push(out.tokens);
        timings.push(t);
    }
    eprintln!("\n{}", format_table(&timings));
    let last = outputs.last().cloned().unwrap_or_default();
    let json = if outputs.len() == 1 {
        serde_json::json!({ "tokens": last })
    } else {
        serde_json::json!({ "tokens": last, "turns": outputs })
    };
    println!("{json}");
    if let Some(path) = &args.out {
        std::fs::write(path, format!("{json}\n")).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.timing_json {
        let text = serde_json::to_string_pretty(&timings)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
