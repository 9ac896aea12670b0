#!/usr/bin/env python3
"""Plots the training loss log of train.py (loss.jsonl) to a PNG.

    python3 scripts/tiny_t/plot.py RUN/loss.jsonl docs/tiny-t-loss.png
"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    src, dst = sys.argv[1], sys.argv[2]
    recs = [json.loads(l) for l in open(src) if l.strip()]
    tr = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
    va = [(r["step"], r["valid_loss_mxfp4"]) for r in recs if "valid_loss_mxfp4" in r]
    qat = [r["step"] for r in recs if r.get("qat")]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(*zip(*tr), label="training loss (batch)", lw=1)
    if va:
        ax.plot(*zip(*va), "o-", label="validation loss (MXFP4 experts)", lw=1.5)
    if va:
        bs, bl = min(va, key=lambda x: x[1])
        ax.axvline(bs, color="C1", ls=":", lw=1)
        ax.annotate(f"kept: step {bs}", (bs, bl), textcoords="offset points", xytext=(5, 12), color="C1")
    if qat:
        ax.axvspan(min(qat), max(s for s, _ in tr), color="grey", alpha=0.15, label="MXFP4 quantisation-aware")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("tiny-t training")
    ax.set_ylim(bottom=max(0.0, min(l for _, l in tr + va) - 0.3), top=min(9.0, max(l for _, l in tr) + 0.2))
    ax.grid(alpha=0.3)
    ax.legend()
    sec = ax.secondary_yaxis("right", functions=(lambda x: x, lambda x: x))
    sec.set_yticks([math.log(p) for p in (10, 20, 50, 100, 200, 500, 1000, 2000, 4000)])
    sec.set_yticklabels(["10", "20", "50", "100", "200", "500", "1k", "2k", "4k"])
    sec.set_ylabel("perplexity")
    fig.tight_layout()
    fig.savefig(dst)
    print(f"wrote {dst}")


if __name__ == "__main__":
    main()
