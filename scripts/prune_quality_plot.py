#!/usr/bin/env python3
"""Plots held-out perplexity against the fraction of routed experts kept, per selection criterion,
from the results.json of the prune_quality example (scripts/prune-quality.sh).

    python3 scripts/prune_quality_plot.py RESULTS.json OUT.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    res = json.load(open(sys.argv[1]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for crit, style in (("reap", "o-"), ("frequency", "s--"), ("random", "^:")):
        rows = sorted((r for r in res["rows"] if r["criterion"] == crit), key=lambda r: r["fraction"])
        ax.plot([100 * r["fraction"] for r in rows], [r["perplexity"] for r in rows], style, label=crit)
    rows = sorted((r for r in res["rows"] if r["criterion"] == "reap" and r["long_full_prefill"]), key=lambda r: r["fraction"])
    if rows:
        ax.plot([100 * r["fraction"] for r in rows], [r["long_full_prefill"] for r in rows], "x-.",
                label=f"REAP, tokens {res['prefix'] + 1}..{res['seq']} after a full-model prefill")
        ax.plot([100 * r["fraction"] for r in rows], [r["long_pruned_prefill"] for r in rows], "+-.",
                label=f"REAP, tokens {res['prefix'] + 1}..{res['seq']} after a pruned prefill")
    ax.set_xlabel(f"routed experts kept per layer, % of {res['num_experts']} (top-{res['top_k']})")
    ax.set_ylabel("held-out perplexity")
    ax.set_yscale("log")
    ax.set_title(f"{res['model']}: {res['eval_tokens']} held-out tokens, calibrated on {res['calib_tokens']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
