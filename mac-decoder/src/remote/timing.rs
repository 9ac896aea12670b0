//! Where the time of one turn went: the per-request breakdown the CLI prints and the OpenAI
//! server exports as metrics.

use serde::Serialize;

/// How a prompt was prefilled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Route {
    /// On this node, by choice (short prompt, or no prefill node configured).
    #[default]
    Local,
    /// On the prefill node.
    Remote,
    /// On this node after the prefill node could not be used (see `reason`).
    Fallback,
}

impl Route {
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Local => "local",
            Route::Remote => "remote",
            Route::Fallback => "fallback",
        }
    }
}

/// A prefill node whose model differs from the decoder's but has the same state identity
/// (docs/pruning.md: e.g. the full model a pruned decoder was made from).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CompatibleSource {
    /// Its state was used (`--accept-compatible-states`).
    Accepted,
    /// It was refused (no `--accept-compatible-states`) and the turn prefilled locally.
    Refused,
}

impl CompatibleSource {
    pub fn as_str(self) -> &'static str {
        match self {
            CompatibleSource::Accepted => "accepted",
            CompatibleSource::Refused => "refused",
        }
    }
}

/// The breakdown of one request (one chat turn). Seconds; `None` where a phase did not happen.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TurnTiming {
    pub route: Route,
    /// Why this route (the threshold, or the cause of a fallback).
    pub reason: String,
    /// New prompt tokens of this turn.
    pub prompt_tokens: usize,
    /// Tokens prefilled: on a remote turn also the earlier generated tokens the node had not
    /// seen; on a local turn the prompt tokens.
    pub prefill_tokens: usize,
    /// Tokens the session holds after the prefill (the context).
    pub context_tokens: usize,
    /// Layer compute on the prefill node.
    pub remote_compute_s: Option<f64>,
    /// Request sent → every layer received and verified (`Done`).
    pub transfer_s: Option<f64>,
    /// The last layer finished on the prefill node → the state usable here (its last chunks,
    /// the logits, the final checks and the commit; one-way latency estimated as RTT/2).
    pub exposed_tail_s: Option<f64>,
    /// Staging arriving layers into MLX and committing them (on this node).
    pub ingest_s: Option<f64>,
    /// Local prefill (a local turn, or the fallback).
    pub local_prefill_s: Option<f64>,
    /// A remote attempt that failed before the fallback.
    pub failed_attempt_s: Option<f64>,
    /// The router's predictions for this turn (None: not predicted, e.g. no prefill node).
    pub predicted_local_s: Option<f64>,
    pub predicted_remote_s: Option<f64>,
    /// State bytes received.
    pub state_bytes: u64,
    /// Set when the prefill node runs a different, state-compatible model.
    pub compatible_source: Option<CompatibleSource>,
    /// Prefill call start → usable logits.
    pub prefill_s: f64,
    /// Prefill call start → first token sampled.
    pub first_token_s: Option<f64>,
    pub decode_tokens: usize,
    pub decode_tok_per_s: Option<f64>,
}

fn secs(v: Option<f64>) -> String {
    match v {
        Some(s) if s < 10.0 => format!("{:.3}", s),
        Some(s) => format!("{:.1}", s),
        None => "-".into(),
    }
}

/// A fixed-width table of turns, one row each, with the reasons for fallbacks below it.
pub fn format_table(turns: &[TurnTiming]) -> String {
    let head = [
        "turn",
        "route",
        "prompt",
        "prefill",
        "context",
        "remote",
        "transfer",
        "tail",
        "ingest",
        "local",
        "1st tok",
        "decode",
        "tok/s",
        "state MB",
        "pred local",
        "pred remote",
    ];
    let mut rows: Vec<Vec<String>> = vec![head.iter().map(|s| s.to_string()).collect()];
    for (i, t) in turns.iter().enumerate() {
        rows.push(vec![
            (i + 1).to_string(),
            t.route.as_str().to_string(),
            t.prompt_tokens.to_string(),
            t.prefill_tokens.to_string(),
            t.context_tokens.to_string(),
            secs(t.remote_compute_s),
            secs(t.transfer_s),
            secs(t.exposed_tail_s),
            secs(t.ingest_s),
            secs(t.local_prefill_s),
            secs(t.first_token_s),
            t.decode_tokens.to_string(),
            t.decode_tok_per_s.map_or("-".into(), |v| format!("{v:.1}")),
            format!("{:.2}", t.state_bytes as f64 / 1e6),
            secs(t.predicted_local_s),
            secs(t.predicted_remote_s),
        ]);
    }
    let widths: Vec<usize> = (0..head.len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for (ri, r) in rows.iter().enumerate() {
        let line: Vec<String> = r.iter().zip(&widths).map(|(v, w)| format!("{v:>w$}")).collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
        if ri == 0 {
            out.push_str(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("  "));
            out.push('\n');
        }
    }
    out.push_str(
        "seconds; remote = layer compute on the prefill node, transfer = request → state verified, \
         tail = last layer done on the node → state usable here, 1st tok = prefill start → first token, \
         pred = the router's predicted prefill time of each route\n",
    );
    for (i, t) in turns.iter().enumerate() {
        if !t.reason.is_empty() {
            out.push_str(&format!("turn {}: {}: {}\n", i + 1, t.route.as_str(), t.reason));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_a_row_per_turn_and_the_reasons() {
        let t = vec![
            TurnTiming { route: Route::Remote, prompt_tokens: 4000, prefill_tokens: 4000, remote_compute_s: Some(1.5), ..Default::default() },
            TurnTiming { route: Route::Fallback, reason: "cannot reach 127.0.0.1:9: timeout".into(), ..Default::default() },
        ];
        let s = format_table(&t);
        let lines: Vec<&str> = s.lines().collect();
        assert!(lines[0].contains("route") && lines[0].contains("tail"));
        assert!(lines[2].contains("remote") && lines[2].contains("4000") && lines[2].contains("1.500"));
        assert!(lines[3].contains("fallback"));
        assert!(s.contains("turn 2: fallback: cannot reach 127.0.0.1:9"));
    }
}
