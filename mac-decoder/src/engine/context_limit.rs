//! The server's default context limit: the longest sequence (prompt + generated) a request may
//! reach when `--max-context` is not given. The model's `max_position_embeddings` (about 1M
//! tokens in K3) is what the weights allow, not what this machine holds: a request sized by it
//! would be accepted and then exhaust memory. The default (`k3-decode serve` computes it before
//! loading the model) is the most tokens whose per-token memory fits the context budget (half
//! the memory available at start beside the model's weights, or `--context-memory-bytes`:
//! [`crate::memory::budget`]), capped by `max_position_embeddings`.

use k3_protocol::TextConfig;

/// The limit is rounded down to a multiple of this (and is at least this, or the model's own
/// limit when smaller).
pub const GRANULE: usize = 1024;

/// Bytes one more token of context costs the local decoder at most:
/// - the latent cache row of every MLA layer (f32, +25 % spare capacity of the cache buffer);
/// - the prompt's input embeddings (f32, built for the whole prompt before its chunks run);
/// - the attention scores of one prefill chunk of `prefill_chunk` queries against it, in
///   every MLA head (f32; the scores, the masked copy and the softmax are alive together).
pub fn bytes_per_token(c: &TextConfig, prefill_chunk: usize) -> u64 {
    let mla_layers = c.mla_layers().len() as u64;
    let cache = mla_layers * (c.kv_lora_rank + c.qk_rope_head_dim) as u64 * 4 * 5 / 4;
    let embeddings = c.hidden_size as u64 * 4;
    let scores = prefill_chunk.max(1) as u64 * c.num_attention_heads as u64 * 4 * 3;
    cache + embeddings + scores
}

/// The default context limit for a memory `budget` (`None`: unbounded, the model's limit).
pub fn fit(c: &TextConfig, prefill_chunk: usize, budget: Option<u64>) -> usize {
    let model = c.max_position_embeddings;
    let Some(budget) = budget else { return model };
    let tokens = budget / bytes_per_token(c, prefill_chunk).max(1);
    let tokens = (tokens.min(usize::MAX as u64) as usize) / GRANULE * GRANULE;
    tokens.max(GRANULE).min(model)
}

/// The context limit of a server: `requested` when it is not 0 (`--max-context`), else
/// [`fit`] for the context memory `budget`. Logged with how it was chosen.
pub fn limit(c: &TextConfig, prefill_chunk: usize, requested: usize, budget: Option<u64>) -> usize {
    if requested != 0 {
        return requested;
    }
    let n = fit(c, prefill_chunk, budget);
    tracing::info!(
        tokens = n,
        model_max = c.max_position_embeddings,
        budget_mb = budget.map(|b| b / 1_000_000),
        bytes_per_token = bytes_per_token(c, prefill_chunk),
        "context limit (set another with --max-context)"
    );
    n
}

/// The bound on tokens in flight (prompt + `max_tokens` of the requests admitted and not
/// finished) of a server: `requested` when it is not 0 (`--max-tokens-in-flight`), else
/// [`in_flight_fit`] for the context memory `budget`. Logged.
pub fn tokens_in_flight(c: &TextConfig, prefill_chunk: usize, max_context: usize, requested: usize, budget: Option<u64>) -> Option<usize> {
    if requested != 0 {
        return Some(requested);
    }
    let n = in_flight_fit(c, prefill_chunk, max_context, budget);
    tracing::info!(tokens = n, budget_mb = budget.map(|b| b / 1_000_000), "tokens-in-flight limit (set another with --max-tokens-in-flight)");
    n
}

/// The default tokens-in-flight bound for a memory `budget`: the tokens whose per-token memory
/// fits it (not capped by the model's context), at least `max_context` so that one request of
/// the full context is always admissible; `None` (unbounded) without a budget.
pub fn in_flight_fit(c: &TextConfig, prefill_chunk: usize, max_context: usize, budget: Option<u64>) -> Option<usize> {
    let budget = budget?;
    let tokens = (budget / bytes_per_token(c, prefill_chunk).max(1)).min(usize::MAX as u64) as usize;
    Some(tokens.max(max_context))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> TextConfig {
        k3_protocol::synth::SynthOptions::new(k3_protocol::synth::Preset::Tiny).config().unwrap().text_config
    }

    #[test]
    fn the_default_is_what_the_budget_holds_capped_by_the_model() {
        let c = tiny();
        let per = bytes_per_token(&c, 256);
        // tiny: 80 latent values per MLA layer (64 + 16 rope), 2 heads
        let mla = c.mla_layers().len() as u64;
        assert_eq!(per, mla * 80 * 5 + c.hidden_size as u64 * 4 + 256 * c.num_attention_heads as u64 * 12);
        assert_eq!(fit(&c, 256, None), c.max_position_embeddings);
        assert_eq!(fit(&c, 256, Some(u64::MAX)), c.max_position_embeddings);
        assert_eq!(fit(&c, 256, Some(per * 10_000)), 9 * GRANULE);
        assert_eq!(fit(&c, 256, Some(0)), GRANULE, "never below one granule");
        // a larger chunk costs more per token, so fits fewer
        assert!(fit(&c, 4096, Some(per * 100_000)) < fit(&c, 256, Some(per * 100_000)));
        assert_eq!(limit(&c, 256, 5000, None), 5000, "an explicit --max-context is kept");
    }

    #[test]
    fn the_tokens_in_flight_default_is_what_the_budget_holds_and_at_least_one_context() {
        let c = tiny();
        let per = bytes_per_token(&c, 256);
        let model = c.max_position_embeddings;
        assert_eq!(in_flight_fit(&c, 256, 4096, Some(per * 3 * model as u64)), Some(3 * model), "not capped by the model's context");
        assert_eq!(in_flight_fit(&c, 256, 4096, Some(per * 100)), Some(4096), "never below one context");
        assert_eq!(in_flight_fit(&c, 256, 4096, None), None);
        assert_eq!(tokens_in_flight(&c, 256, 4096, 700, None), Some(700), "an explicit --max-tokens-in-flight is kept");
    }
}
