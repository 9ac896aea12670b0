//! Which model fits which Mac: the checkpoint's weights (pruned to `N` routed experts per MoE
//! layer, [`crate::prune::pruned_bytes`]) plus one sequence's decode state at a context length
//! (spec §4: BF16 MLA latent per token, FP32 KDA state, BF16 conv windows) against a machine's
//! unified memory less a reserve for the OS and the decoder's working buffers. `k3-prefill
//! inspect` prints this table for the Mac Studio memory sizes (docs/pruning.md).

use serde::Serialize;

use crate::prune::PrunedSizes;
use crate::tensors::DerivedSizes;
use crate::K3Config;

/// Mac Studio unified-memory sizes, GB as Apple counts them (2^30 bytes).
pub const MAC_STUDIO_GB: [u64; 4] = [96, 192, 256, 512];
/// Context lengths of the table, tokens.
pub const CONTEXTS: [u64; 3] = [32_768, 131_072, 1_048_576];
/// Default memory left to macOS and the decoder's transient buffers, GiB.
pub const DEFAULT_RESERVE_GIB: f64 = 16.0;

/// Decode state of one sequence of `tokens` tokens, bytes (spec §4 dtypes).
pub fn state_bytes(cfg: &K3Config, tokens: u64) -> u64 {
    let d = DerivedSizes::of(cfg);
    d.kda_state_bytes_fp32 + d.conv_window_bytes_bf16 + tokens * d.mla_state_bytes_per_token_bf16
}

/// One machine size at one context length.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FitCell {
    pub memory_gb: u64,
    pub context: u64,
    pub state_bytes: u64,
    /// Bytes available to weights: memory − reserve − state.
    pub weight_budget: i128,
    /// The most routed experts per MoE layer (at most the model's own count, at least top-k)
    /// whose weights fit; `None`: not even top-k experts fit.
    pub max_experts: Option<usize>,
    /// Checkpoint bytes at `max_experts`.
    pub weight_bytes: Option<u64>,
}

/// The fit table of a model: every [`MAC_STUDIO_GB`] size at every [`CONTEXTS`] length.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FitTable {
    pub reserve_bytes: u64,
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Checkpoint bytes of the model as it is.
    pub full_bytes: u64,
    pub cells: Vec<FitCell>,
}

/// The fit table for `cfg` with `reserve_gib` GiB held back on every machine.
pub fn fit_table(cfg: &K3Config, reserve_gib: f64) -> FitTable {
    let c = &cfg.text_config;
    let sizes = PrunedSizes::of(cfg);
    let d = DerivedSizes::of(cfg);
    let reserve = (reserve_gib.max(0.0) * (1u64 << 30) as f64) as u64;
    let mut cells = Vec::new();
    for &gb in &MAC_STUDIO_GB {
        for &ctx in &CONTEXTS {
            let state = d.kda_state_bytes_fp32 + d.conv_window_bytes_bf16 + ctx * d.mla_state_bytes_per_token_bf16;
            let budget = (gb << 30) as i128 - reserve as i128 - state as i128;
            let max_experts = sizes.max_keep(budget);
            cells.push(FitCell {
                memory_gb: gb,
                context: ctx,
                state_bytes: state,
                weight_budget: budget,
                max_experts,
                weight_bytes: max_experts.map(|k| sizes.bytes(k)),
            });
        }
    }
    FitTable {
        reserve_bytes: reserve,
        num_experts: c.num_experts,
        experts_per_token: c.num_experts_per_token,
        full_bytes: sizes.full_bytes,
        cells,
    }
}

fn ctx_label(t: u64) -> String {
    if t >= 1 << 20 { format!("{}M", t >> 20) } else { format!("{}k", t >> 10) }
}

impl FitTable {
    /// The table as text: one row per machine, one column per context length; each cell the
    /// most experts per layer that fit and the weights' size, `all` when the model fits as it
    /// is, `—` when not even top-k experts fit.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let contexts: Vec<u64> = CONTEXTS.to_vec();
        let _ = writeln!(
            s,
            "fit on one Mac Studio: weights + decode state of one sequence ≤ memory − {:.0} GiB reserve\n  \
             (routed experts per MoE layer of {}, top-{}; weights in GB = 10^9 B; memory in Apple GB = 2^30 B)",
            self.reserve_bytes as f64 / (1u64 << 30) as f64,
            self.num_experts,
            self.experts_per_token
        );
        let _ = write!(s, "  {:<8}", "memory");
        for &c in &contexts {
            let st = self.cells.iter().find(|x| x.context == c).map(|x| x.state_bytes).unwrap_or(0);
            let _ = write!(s, " {:<26}", format!("{} ctx (state {:.1} GB)", ctx_label(c), st as f64 / 1e9));
        }
        let _ = writeln!(s);
        for &gb in &MAC_STUDIO_GB {
            let _ = write!(s, "  {:<8}", format!("{gb} GB"));
            for &c in &contexts {
                let cell = self.cells.iter().find(|x| x.memory_gb == gb && x.context == c).expect("every cell");
                let text = match (cell.max_experts, cell.weight_bytes) {
                    (Some(k), Some(b)) if k == self.num_experts => format!("all {k} ({:.1} GB)", b as f64 / 1e9),
                    (Some(k), Some(b)) => format!("{k} ({:.1} GB)", b as f64 / 1e9),
                    _ => "—".to_string(),
                };
                let _ = write!(s, " {text:<26}");
            }
            let _ = writeln!(s);
        }
        s
    }
}
