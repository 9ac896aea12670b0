//! Which model fits which Mac: the checkpoint's weights (pruned to `N` routed experts per MoE
//! layer, [`crate::prune::pruned_bytes`]) plus one sequence's decode state at a context length
//! (spec §4: BF16 MLA latent per token, FP32 KDA state, BF16 conv windows) against a machine's
//! unified memory less a reserve for the OS and the decoder's working buffers. `k3-prefill
//! inspect` prints this table for the Mac Studio memory sizes (docs/pruning.md).
//!
//! Over `H` hosts (decoder ranks, docs/multi-mac.md) the routed experts split by expert
//! ([`expert_range`]) and everything else — the trunk, the router and the decode state — is
//! replicated, so a host holds the checkpoint less the other ranks' expert weights
//! ([`RankShare`]); the largest share (⌈E/H⌉ experts per layer) must fit.

use std::ops::Range;

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

/// The contiguous block of routed experts that `rank` of `size` decoder ranks holds (the same
/// block in every MoE layer): sizes differ by at most one (7 experts over 4 ranks: 1, 2, 2, 2);
/// with more ranks than experts some hold none.
pub fn expert_range(n_experts: usize, rank: usize, size: usize) -> Range<usize> {
    let size = size.max(1);
    (n_experts * rank / size)..(n_experts * (rank + 1) / size)
}

/// What one rank of a split holds.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RankShare {
    pub rank: usize,
    /// Its routed experts in every MoE layer.
    pub experts: Range<usize>,
    /// Checkpoint bytes it holds: everything but the other ranks' routed expert weights (the
    /// router rows of every expert stay: the router is replicated).
    pub weight_bytes: u64,
}

/// The sizes a split needs, computed once from a config.
#[derive(Debug, Clone)]
pub struct SplitSizes {
    pub pruned: PrunedSizes,
    /// Routed-expert weight bytes (MXFP4 + scales, no router row) of one expert over all MoE
    /// layers.
    pub expert_weight_bytes_all_layers: u64,
}

impl SplitSizes {
    pub fn of(cfg: &K3Config) -> Self {
        let moe = cfg.text_config.layer_plan().iter().filter(|s| s.ffn == crate::config::FfnKind::LatentMoe).count() as u64;
        SplitSizes { pruned: PrunedSizes::of(cfg), expert_weight_bytes_all_layers: moe * DerivedSizes::of(cfg).bytes_per_expert }
    }

    /// How the checkpoint pruned to `keep` experts per MoE layer splits over `hosts` ranks.
    pub fn split(&self, keep: usize, hosts: usize) -> Vec<RankShare> {
        let keep = keep.min(self.pruned.num_experts);
        let hosts = hosts.max(1);
        (0..hosts)
            .map(|rank| {
                let experts = expert_range(keep, rank, hosts);
                let weight_bytes = self.pruned.bytes(keep) - self.expert_weight_bytes_all_layers * (keep - experts.len()) as u64;
                RankShare { rank, experts, weight_bytes }
            })
            .collect()
    }

    /// The bytes the largest rank of `hosts` holds with `keep` experts per layer (⌈keep/hosts⌉
    /// experts).
    pub fn largest_share(&self, keep: usize, hosts: usize) -> u64 {
        let keep = keep.min(self.pruned.num_experts);
        let most = keep.div_ceil(hosts.max(1));
        self.pruned.bytes(keep) - self.expert_weight_bytes_all_layers * (keep - most) as u64
    }
}

/// How a checkpoint pruned to `keep` experts per MoE layer splits over `hosts` ranks.
pub fn split(cfg: &K3Config, keep: usize, hosts: usize) -> Vec<RankShare> {
    SplitSizes::of(cfg).split(keep, hosts)
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
    /// Weight bytes the largest rank holds at `max_experts` (= `weight_bytes` on one host).
    pub rank_weight_bytes: Option<u64>,
}

/// The fit table of a model: every [`MAC_STUDIO_GB`] size at every [`CONTEXTS`] length.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FitTable {
    /// Hosts (decoder ranks, one per Mac) the model is split over.
    pub hosts: usize,
    pub reserve_bytes: u64,
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Checkpoint bytes of the model as it is.
    pub full_bytes: u64,
    /// The model as it is over `hosts` ranks.
    pub full_split: Vec<RankShare>,
    pub cells: Vec<FitCell>,
}

/// The fit table for `cfg` on one Mac with `reserve_gib` GiB held back.
pub fn fit_table(cfg: &K3Config, reserve_gib: f64) -> FitTable {
    fit_table_hosts(cfg, reserve_gib, 1)
}

/// The fit table for `cfg` split over `hosts` Macs (one decoder rank each), `reserve_gib` GiB
/// held back on every one: a cell fits when the largest rank's weights and the (replicated)
/// decode state fit.
pub fn fit_table_hosts(cfg: &K3Config, reserve_gib: f64, hosts: usize) -> FitTable {
    let hosts = hosts.max(1);
    let c = &cfg.text_config;
    let split_sizes = SplitSizes::of(cfg);
    let sizes = &split_sizes.pruned;
    let d = DerivedSizes::of(cfg);
    let reserve = (reserve_gib.max(0.0) * (1u64 << 30) as f64) as u64;
    let mut cells = Vec::new();
    for &gb in &MAC_STUDIO_GB {
        for &ctx in &CONTEXTS {
            let state = d.kda_state_bytes_fp32 + d.conv_window_bytes_bf16 + ctx * d.mla_state_bytes_per_token_bf16;
            let budget = (gb << 30) as i128 - reserve as i128 - state as i128;
            let max_experts = (sizes.experts_per_token..=sizes.num_experts).rev().find(|&k| split_sizes.largest_share(k, hosts) as i128 <= budget);
            cells.push(FitCell {
                memory_gb: gb,
                context: ctx,
                state_bytes: state,
                weight_budget: budget,
                max_experts,
                weight_bytes: max_experts.map(|k| sizes.bytes(k)),
                rank_weight_bytes: max_experts.map(|k| split_sizes.largest_share(k, hosts)),
            });
        }
    }
    FitTable {
        hosts,
        full_split: split_sizes.split(c.num_experts, hosts),
        reserve_bytes: reserve,
        num_experts: c.num_experts,
        experts_per_token: c.num_experts_per_token,
        full_bytes: sizes.full_bytes,
        cells,
    }
}

fn ctx_label(t: u64) -> String {
    if t >= 1 << 20 {
        format!("{}M", t >> 20)
    } else {
        format!("{}k", t >> 10)
    }
}

impl FitTable {
    /// The table as text: one row per machine, one column per context length; each cell the
    /// most experts per layer that fit and the weights' size, `all` when the model fits as it
    /// is, `—` when not even top-k experts fit.
    pub fn render(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let contexts: Vec<u64> = CONTEXTS.to_vec();
        let reserve = self.reserve_bytes as f64 / (1u64 << 30) as f64;
        if self.hosts == 1 {
            let _ = writeln!(s, "fit on one Mac Studio: weights + decode state of one sequence ≤ memory − {reserve:.0} GiB reserve");
        } else {
            let _ = writeln!(
                s,
                "fit on {} Mac Studios (one decoder rank each; routed experts split by expert, the rest and the decode \
                 state replicated):\n  the largest rank's weights + decode state ≤ memory − {reserve:.0} GiB reserve on each Mac",
                self.hosts
            );
        }
        let _ = writeln!(
            s,
            "  (routed experts per MoE layer of {}, top-{}; weights in GB = 10^9 B; memory in Apple GB = 2^30 B{})",
            self.num_experts,
            self.experts_per_token,
            if self.hosts > 1 { "; cells: experts per layer (weights per rank)" } else { "" }
        );
        if self.hosts > 1 {
            let sizes: Vec<usize> = self.full_split.iter().map(|r| r.experts.len()).collect();
            let (lo, hi) =
                (self.full_split.iter().map(|r| r.weight_bytes).min().unwrap_or(0), self.full_split.iter().map(|r| r.weight_bytes).max().unwrap_or(0));
            let _ = writeln!(
                s,
                "  all {} experts over {} ranks: {} per rank and layer; {:.1}–{:.1} GB of weights per rank ({:.1} GB in one)",
                self.num_experts,
                self.hosts,
                sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(" + "),
                lo as f64 / 1e9,
                hi as f64 / 1e9,
                self.full_bytes as f64 / 1e9
            );
        }
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
                let text = match (cell.max_experts, cell.rank_weight_bytes) {
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

#[cfg(test)]
mod tests {
    use super::expert_range;

    #[test]
    fn expert_ranges_cover_every_expert_once() {
        for e in [1usize, 4, 7, 16, 896] {
            for n in 1..=9usize {
                let ranges: Vec<_> = (0..n).map(|r| expert_range(e, r, n)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[n - 1].end, e);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                let (lo, hi) = (ranges.iter().map(|r| r.len()).min().unwrap(), ranges.iter().map(|r| r.len()).max().unwrap());
                assert!(hi - lo <= 1, "{e} experts over {n} ranks: {ranges:?}");
                assert_eq!(hi, e.div_ceil(n), "the largest block is ⌈E/N⌉");
            }
        }
        assert_eq!((0..4).map(|r| expert_range(7, r, 4).len()).collect::<Vec<_>>(), vec![1, 2, 2, 2]);
    }
}
